//! A QP's life: progress, the state machine (`modify`), connecting to the peer's block,
//! reset, what a completion channel watches, destruction.

use super::*;

impl QpEngine {
    /// Everything a poll does for this QP: inbound messages, acknowledgements, waiting work.
    pub(crate) fn progress(&mut self, env: &CtxParts<'_>, cqs: &mut Cqs) {
        self.flush_bell();
        self.idle = self.idle.saturating_add(1);
        match self.state {
            QpState::Rtr | QpState::Rts => {}
            QpState::Init | QpState::Reset if self.ty == QpType::Ud => {
                self.drain_ud_dropping();
                return;
            }
            _ => return,
        }
        if self.ty == QpType::Ud {
            self.drive_rx_ud(env, cqs);
        } else {
            self.drive_rx(env, cqs);
            if std::mem::take(&mut self.took_ahead) {
                self.idle = 0;
            }
        }
        if self.idle > 0 {
            self.publish_credits();
        } else if !self.settle_later
            && self.ty != QpType::Ud
            && cqs
                .get(self.send_cq)
                .is_some_and(|c| c.as_ref().is_some_and(|c| c.channel.is_none()))
        {
            // A receive just completed and whoever polls is waiting for it: the send side
            // (typically the SEND this very message acknowledged) can wait for the next poll
            // — once, so a stream of messages cannot hold it back, and not on a CQ with a
            // completion channel, whose waiter sleeps until a watched word moves (an ack
            // already seen will not). The send queue is not empty or there is nothing to do,
            // so that next poll comes here ([`QpEngine::quiet`] is false).
            self.settle_later = true;
            return;
        }
        self.settle_later = false;
        if self.state == QpState::Rts && !self.sq.is_empty() {
            // Idle for a while (about 5-10 µs of polls) or the send queue filling up.
            let look = self.idle >= IDLE_LOOK || self.sq.len() * 2 >= self.cap.max_send_wr as usize;
            if look
                && self.ty != QpType::Ud
                && !self.peer_gone
                && self.own.as_ref().is_some_and(|o| o.peer_gone())
            {
                self.peer_gone = true;
            }
            if self.fetching != 0 {
                self.take_fetched(env.mrs);
            }
            self.complete_acked(cqs, look);
            if self.exec < self.sq.len() {
                self.drive_sq(env, cqs);
                self.complete_acked(cqs, false);
            }
        }
    }

    /// True when [`QpEngine::progress`] would find nothing to do: a connected QP with no send work
    /// outstanding, no doorbell or credits to publish, and nothing in its inbound ring (UD
    /// QPs always take the full look). An empty poll then costs a few loads, so a thread
    /// polling for a message sees it sooner.
    #[inline]
    pub(super) fn quiet(&self) -> bool {
        if self.ty == QpType::Ud {
            return false;
        }
        if !matches!(self.state, QpState::Rtr | QpState::Rts) {
            return true; // progress returns at once in every other state
        }
        if self.bell_pending || !self.sq.is_empty() || self.published != self.rq_posted {
            return false;
        }
        match &self.peer {
            None => true,
            // SYNC POINT ring-publish (acquire, in is_drained): as in drive_rx.
            Some(p) => p.inbound.is_drained(),
        }
    }

    /// The peer's node went DOWN or restarted.
    pub(crate) fn check_peer_node(&mut self, env: &CtxParts<'_>) {
        let Some(p) = &self.peer else { return };
        if !env
            .transport
            .peer(p.slot)
            .is_some_and(|s| s.is_live(p.generation))
        {
            self.peer_gone = true;
        }
    }

    pub(crate) fn peer_slot(&self) -> Option<(u32, u32)> {
        self.peer.as_ref().map(|p| (p.slot, p.generation))
    }

    pub(crate) fn modify(
        &mut self,
        attr: &QpAttr,
        mask: QpAttrMask,
        env: &CtxParts<'_>,
        cqs: &mut Cqs,
    ) -> Result<(), VerbsError> {
        let next = fsm::check(self.ty, self.state, attr, mask).map_err(VerbsError::inval)?;
        if next == QpState::Rtr && self.ty != QpType::Ud {
            self.connect(attr, env)?;
        }
        self.apply_attrs(attr, mask);
        match next {
            QpState::Err => {
                self.fail_why("moved to ERR by modify", WcStatus::WrFlushErr, cqs);
            }
            QpState::Reset => self.reset(),
            _ => {}
        }
        if let Some(o) = &self.own {
            o.set_access(self.attr.qp_access_flags.bits());
        }
        self.state = next;
        Ok(())
    }

    pub(super) fn apply_attrs(&mut self, a: &QpAttr, m: QpAttrMask) {
        let t = &mut self.attr;
        let set = |f: QpAttrMask| m.contains(f);
        if set(QpAttrMask::ACCESS_FLAGS) {
            t.qp_access_flags = a.qp_access_flags;
        }
        if set(QpAttrMask::PKEY_INDEX) {
            t.pkey_index = a.pkey_index;
        }
        if set(QpAttrMask::PORT) {
            t.port_num = a.port_num;
        }
        if set(QpAttrMask::QKEY) {
            t.qkey = a.qkey;
        }
        if set(QpAttrMask::AV) {
            t.ah_attr = a.ah_attr;
        }
        if set(QpAttrMask::PATH_MTU) {
            t.path_mtu = a.path_mtu;
        }
        if set(QpAttrMask::TIMEOUT) {
            t.timeout = a.timeout;
        }
        if set(QpAttrMask::RETRY_CNT) {
            t.retry_cnt = a.retry_cnt;
        }
        if set(QpAttrMask::RNR_RETRY) {
            t.rnr_retry = a.rnr_retry;
        }
        if set(QpAttrMask::RQ_PSN) {
            t.rq_psn = a.rq_psn;
        }
        if set(QpAttrMask::SQ_PSN) {
            t.sq_psn = a.sq_psn;
        }
        if set(QpAttrMask::MAX_QP_RD_ATOMIC) {
            t.max_rd_atomic = a.max_rd_atomic;
        }
        if set(QpAttrMask::MAX_DEST_RD_ATOMIC) {
            t.max_dest_rd_atomic = a.max_dest_rd_atomic;
        }
        if set(QpAttrMask::MIN_RNR_TIMER) {
            t.min_rnr_timer = a.min_rnr_timer;
            if let Some(p) = &self.peer {
                p.link.publish_rnr(u32::from(a.min_rnr_timer) + 1);
            }
        }
        if set(QpAttrMask::DEST_QPN) {
            t.dest_qp_num = a.dest_qp_num;
        }
    }

    /// INIT → RTR of an RC/UC QP: find the peer's block through the supervisor and wire the
    /// two rings.
    pub(super) fn connect(&mut self, a: &QpAttr, env: &CtxParts<'_>) -> Result<(), VerbsError> {
        let fabric = env.node.fabric();
        let dest_slot = u32::from(a.ah_attr.dlid);
        if dest_slot == 0 || dest_slot > fabric.nodes() {
            return Err(VerbsError::inval(format!(
                "LID {dest_slot} is no node of fabric '{}' (1..={})",
                fabric.name(),
                fabric.nodes()
            )));
        }
        let own = self
            .own
            .as_ref()
            .ok_or_else(|| VerbsError::inval("QP has no block"))?;
        let c = env.links.connect_qp(
            own,
            env.node.slot(),
            self.qpn,
            self.ty as u32,
            dest_slot,
            a.dest_qp_num,
        )?;
        let peer = PeerLink {
            slot: c.slot,
            qpn: c.qpn,
            generation: c.generation,
            link: c.link,
            outbound: c.outbound,
            inbound: c.inbound,
        };
        peer.link.publish_rnr(u32::from(a.min_rnr_timer) + 1);
        // Receives posted before the connection count.
        peer.link.publish_credits(self.rq_posted);
        self.published = self.rq_posted;
        self.peer = Some(peer);
        self.peer_gone = false;
        self.gone_since = None;
        Ok(())
    }

    pub(super) fn reset(&mut self) {
        if let Some(p) = self.peer.take() {
            p.link.publish_gone();
        }
        self.fetching = 0;
        for e in self.sq.drain(..) {
            if let SendPhase::Fetching(f) = &e.st {
                f.m.mem.abandon(f.next, f.last);
            }
        }
        if let RecvQueue::Own(q) = &mut self.rq {
            q.clear();
        }
        self.exec = 0;
        self.inbound = None;
        self.rel.reset();
        self.rq_posted = if self.rq.is_shared() { SRQ_CREDITS } else { 0 };
        self.credits = 0;
        self.used_credits = 0;
        self.msgs_in = 0;
        self.msgs_out = 0;
        self.peer_gone = false;
        self.gone_since = None;
        self.bell_pending = false;
        self.idle = 0;
        self.published = 0;
        self.remote.clear();
        if let Some(o) = &self.own {
            o.reset();
        }
        self.attr = QpAttr {
            cap: self.cap,
            ..QpAttr::default()
        };
    }

    /// Whether this QP's send work waits for something a completion channel armed earlier
    /// may not watch: an RNR timer (and the peer's credits), a WRITE landing on another host.
    pub(crate) fn waits_in_background(&self) -> bool {
        self.rel.rnr_waiting()
            || matches!(
                self.sq.front().map(|e| &e.st),
                Some(SendPhase::Placed(..) | SendPhase::Fetching(_))
            )
    }

    /// What the completion channel of CQ `cq` watches for this QP: for its receive CQ arriving
    /// messages, for its send CQ acknowledgements (one watch for both fired the receive CQ's
    /// channel on an ack: an event with no completion behind it).
    pub(crate) fn watches(&self, cq: usize, out: &mut Vec<Watch>) {
        let roles = WatchRoles {
            send: cq == self.send_cq,
            recv: cq == self.recv_cq,
        };
        if let Some(o) = &self.own {
            // Work waiting for an acknowledgement the peer already gave (polls look at the ack
            // word only every so often, see `complete_acked`) must wake the channel at once:
            // compare with what this QP has taken in, not with the word as it is now, or the
            // watcher sleeps through an ack that moved before arming.
            let waiting = self.sq.front().is_some_and(
                |e| matches!(e.st, SendPhase::Ack { end, .. } if end > self.rel.acked()),
            );
            let acked = self.rel.acked();
            // Likewise a message that arrived before arming and is not taken yet (a poll
            // that found completions queued moves no QP along) must fire at once: compare
            // with what this QP has consumed.
            let consumed = self.peer.as_ref().map(|p| p.inbound.consumed());
            o.watches(
                out,
                roles,
                (
                    |tail: u64| consumed.map_or(tail, |c| tail.min(c)),
                    |ack| if waiting { ack.min(acked) } else { ack },
                ),
                self.rel.rnr_waiting(),
            );
        }
        // An RDMA WRITE to another host completes when its answer comes (the bridge moves a
        // word and rings this context's bell).
        let placed = self.sq.front().map(|e| &e.st).filter(|_| roles.send);
        if let Some(SendPhase::Placed(m, t)) = placed {
            m.mem.watch(*t, out);
        }
        // A READ or atomic on another host completes when its answer comes.
        let fetching = (roles.send && self.fetching != 0)
            .then(|| {
                self.sq.iter().find_map(|e| match &e.st {
                    SendPhase::Fetching(f) => Some(f),
                    _ => None,
                })
            })
            .flatten();
        if let Some(f) = fetching {
            f.m.mem.watch_answers(out);
        }
        if let Some(ep) = self.ud.as_ref().filter(|_| roles.recv) {
            let (bell, armed) = ep.doorbell_words();
            // Senders ring a UD QP's endpoint only while it is armed: keep it armed while a
            // channel watches (each datagram then costs its sender one wake-up call).
            armed.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            // SYNC POINT qp-bell (watch): the doorbell value peers bump after publishing.
            let seen = bell.load(Ordering::Acquire);
            // Datagrams from other hosts: the endpoint's own UCX worker's waker rings the
            // doorbell on news (armed after the value was read: its ring is seen); news there
            // already fires at once (a watched value the word does not hold).
            let seen = if ep.arm_direct_for_doorbell() {
                seen.wrapping_sub(1)
            } else {
                seen
            };
            out.push(Watch::Bell { word: bell, seen });
        }
    }

    pub(crate) fn destroy(&mut self, env: &CtxParts<'_>, cqs: &mut Cqs) {
        if self.ty != QpType::Ud && matches!(self.state, QpState::Rtr | QpState::Rts) {
            // A NIC acknowledges a message when it lands in a posted receive, whether or not
            // the program polled for it. Messages already in our ring that have a receive are
            // taken (and so acknowledged) before the peer learns we are gone; otherwise a
            // program that exits after its last expected completion fails the peer's sends
            // that hardware would have completed.
            self.drive_rx(env, cqs);
        }
        if let Some(p) = self.peer.take() {
            // Our last acks and NAKs are visible before the flag (`publish_gone`).
            p.link.publish_gone();
            p.link.ring_peer();
        }
        if self.own.is_some() {
            env.links.destroy_qp_home(env.node.slot(), self.qpn);
        }
    }

    pub(crate) fn query_cap(&self) -> QpCap {
        self.cap
    }
}
