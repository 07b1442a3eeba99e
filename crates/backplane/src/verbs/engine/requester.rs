//! The general way of `ibv_post_send` and `ibv_post_recv`: checking, queueing and executing
//! every request kind, one-sided operations through the transport, messages into the ring.

use super::*;

impl QpEngine {
    /// `ibv_post_send` the general way (every request kind, lists, errors).
    pub(crate) fn post_send(
        &mut self,
        wrs: &[SendWr<'_>],
        env: &CtxParts<'_>,
        cqs: &mut Cqs,
    ) -> Result<(), VerbsError> {
        for (i, wr) in wrs.iter().enumerate() {
            let bad = |e: VerbsError| VerbsError::Post {
                bad_wr: i,
                source: Box::new(e),
            };
            match self.state {
                QpState::Rts => {}
                QpState::Err => {
                    let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, wc_opcode(wr.opcode), 0);
                    push_cqe(cqs, self.send_cq, wc);
                    continue;
                }
                s => {
                    return Err(bad(VerbsError::inval(format!(
                        "post_send on a QP in {s:?}"
                    ))))
                }
            }
            self.check_wr(wr).map_err(bad)?;
            if self.sq.len() >= self.cap.max_send_wr as usize {
                return Err(bad(VerbsError::QueueFull(format!(
                    "{} send work requests outstanding (max_send_wr)",
                    self.sq.len()
                ))));
            }
            let signaled = self.signaled(wr.send_flags);
            let byte_len = byte_len_of(wr);
            if self.exec == self.sq.len() && !self.rel.rnr_waiting() {
                // Nothing waits ahead of this request: run it now, without copying it.
                let src = match (wr.send_flags.contains(SendFlags::INLINE), wr.inline_data) {
                    (true, d) if !d.is_empty() => Src::Inline(d),
                    _ => Src::Sges(wr.sg_list),
                };
                let op = OpView::of(wr, src);
                let mut prog = Progress::default();
                let r = self.execute(&op, &mut prog, env);
                match r {
                    Exec::Done(st) if self.sq.is_empty() => {
                        if st != WcStatus::Success || signaled {
                            let wc = self.wc(wr.wr_id, st, wc_opcode(wr.opcode), byte_len);
                            push_cqe(cqs, self.send_cq, wc);
                        }
                        continue;
                    }
                    Exec::Fatal(st) => {
                        self.sq.push_back(SqEntry {
                            wr_id: wr.wr_id,
                            opcode: wr.opcode,
                            signaled,
                            byte_len,
                            st: SendPhase::Pending(Box::new((Work::from_wr(wr), prog))),
                        });
                        let at = self.sq.len() - 1;
                        self.fail(Some(at), st, cqs);
                        continue;
                    }
                    Exec::Done(st) => {
                        self.push_executed(wr, signaled, byte_len, SendPhase::Done(st));
                    }
                    Exec::Ack { end, msg } => {
                        self.push_executed(wr, signaled, byte_len, SendPhase::Ack { end, msg });
                    }
                    Exec::Placed(m, t) => {
                        self.push_executed(wr, signaled, byte_len, SendPhase::Placed(m, t));
                    }
                    Exec::Fetching(m, first, last) => {
                        let f = Fetching {
                            m,
                            work: Work::from_wr(wr),
                            first,
                            next: first,
                            last,
                        };
                        self.fetching += 1;
                        self.push_executed(
                            wr,
                            signaled,
                            byte_len,
                            SendPhase::Fetching(Box::new(f)),
                        );
                    }
                    Exec::Full | Exec::Rnr => {
                        if matches!(r, Exec::Rnr) {
                            let delay = self.rnr_delay();
                            // The first RNR only starts the wait: it cannot exhaust it.
                            let _ = self.rel.rnr(Instant::now(), self.attr.rnr_retry, delay);
                        }
                        self.sq.push_back(SqEntry {
                            wr_id: wr.wr_id,
                            opcode: wr.opcode,
                            signaled,
                            byte_len,
                            st: SendPhase::Pending(Box::new((Work::from_wr(wr), prog))),
                        });
                    }
                }
            } else {
                self.sq.push_back(SqEntry {
                    wr_id: wr.wr_id,
                    opcode: wr.opcode,
                    signaled,
                    byte_len,
                    st: SendPhase::Pending(Box::new((Work::from_wr(wr), Progress::default()))),
                });
            }
        }
        Ok(())
    }

    pub(super) fn push_executed(
        &mut self,
        wr: &SendWr<'_>,
        signaled: bool,
        byte_len: u32,
        st: SendPhase,
    ) {
        self.push_executed_as(wr.wr_id, wr.opcode, signaled, byte_len, st);
    }

    /// [`QpEngine::push_executed`] of a request known by its id and opcode.
    pub(super) fn push_executed_as(
        &mut self,
        wr_id: u64,
        opcode: WrOpcode,
        signaled: bool,
        byte_len: u32,
        st: SendPhase,
    ) {
        self.sq.push_back(SqEntry {
            wr_id,
            opcode,
            signaled,
            byte_len,
            st,
        });
        self.exec = self.sq.len();
    }

    pub(crate) fn post_recv(
        &mut self,
        wrs: &[RecvWr<'_>],
        cqs: &mut Cqs,
    ) -> Result<(), VerbsError> {
        let RecvQueue::Own(rq) = &self.rq else {
            return Err(VerbsError::Post {
                bad_wr: 0,
                source: Box::new(VerbsError::inval(
                    "post_recv on a QP with a shared receive queue (post to the SRQ)",
                )),
            });
        };
        let was_empty = rq.is_empty();
        for (i, wr) in wrs.iter().enumerate() {
            let bad = |e: VerbsError| VerbsError::Post {
                bad_wr: i,
                source: Box::new(e),
            };
            match self.state {
                QpState::Reset => {
                    return Err(bad(VerbsError::inval("post_recv on a QP in Reset")));
                }
                QpState::Err => {
                    let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
                    push_cqe(cqs, self.recv_cq, wc);
                    continue;
                }
                _ => {}
            }
            if wr.sg_list.len() > self.cap.max_recv_sge as usize {
                return Err(bad(VerbsError::inval(format!(
                    "{} scatter/gather entries exceed max_recv_sge {}",
                    wr.sg_list.len(),
                    self.cap.max_recv_sge
                ))));
            }
            let RecvQueue::Own(rq) = &mut self.rq else {
                unreachable!("checked above")
            };
            if rq.len() >= self.cap.max_recv_wr as usize {
                return Err(bad(VerbsError::QueueFull(format!(
                    "{} receive work requests outstanding (max_recv_wr)",
                    rq.len()
                ))));
            }
            rq.push_back(RqEntry::new(wr));
            self.rq_posted += 1;
        }
        // Credits travel piggybacked on our messages; the peer's block is written when the
        // queue was empty (the peer may be waiting), every eighth of the queue, and when a
        // poll finds nothing to do.
        let batch = u64::from((self.cap.max_recv_wr / 8).max(1));
        if was_empty {
            // The peer may be waiting for a receive (RNR), perhaps asleep: wake it.
            self.publish_credits();
            self.ring_peer();
        } else if self.rq_posted - self.published >= batch {
            self.publish_credits();
        }
        Ok(())
    }

    pub(super) fn execute(
        &mut self,
        op: &OpView<'_>,
        prog: &mut Progress,
        env: &CtxParts<'_>,
    ) -> Exec {
        use WrOpcode::*;
        if self.peer_gone && self.ty != QpType::Ud {
            // Nobody will acknowledge it: it waits for the retries to run out, then fails
            // (`complete_acked`).
            return Exec::Full;
        }
        if op.fence && self.fetching != 0 {
            // Waits for the READs and atomics ahead of it (they may still be on the wire).
            return Exec::Full;
        }
        match op.opcode {
            Send | SendWithImm if self.ty == QpType::Ud => self.exec_ud(op, env),
            Send | SendWithImm => self.exec_send(op, prog, env),
            RdmaWrite | RdmaWriteWithImm => self.exec_write(op, prog, env),
            RdmaRead => self.exec_read(op, env),
            AtomicCmpAndSwp | AtomicFetchAndAdd => self.exec_atomic(op, env),
        }
    }

    /// Takes a credit (RC), refreshing the view of the peer's posted receives if needed.
    pub(super) fn take_credit(&mut self) -> bool {
        if self.ty != QpType::Rc {
            return true;
        }
        if self.used_credits >= self.credits {
            if let Some(o) = &self.own {
                self.credits = self.credits.max(o.credits());
            }
            if self.used_credits >= self.credits {
                return false;
            }
        }
        self.used_credits += 1;
        true
    }

    pub(super) fn exec_send(
        &mut self,
        op: &OpView<'_>,
        prog: &mut Progress,
        env: &CtxParts<'_>,
    ) -> Exec {
        let (total, src) = match prepare(env.mrs, self.pd, op.src) {
            Ok(t) => t,
            Err(s) => return Exec::Fatal(s),
        };
        let op = &op.with_src(src);
        if total > u64::from(MAX_MSG) {
            return Exec::Fatal(WcStatus::LocLenErr);
        }
        let mop = if op.opcode == WrOpcode::SendWithImm {
            MsgOp::SendImm
        } else {
            MsgOp::Send
        };
        if !prog.started {
            if !self.take_credit() {
                return Exec::Rnr;
            }
            prog.started = true;
            prog.msg = self.msgs_out;
            self.msgs_out += 1;
        }
        let before = prog.pushed;
        match self.push_message(mop, op, total, prog, env) {
            Ok(true) => {}
            Ok(false) => {
                // The fragments that fitted are published: a peer asleep must take them to
                // make room for the rest (the bridge of a fabric across hosts carries them).
                if prog.pushed != before {
                    self.ring_peer();
                }
                return Exec::Full;
            }
            Err(s) => return Exec::Fatal(s),
        }
        self.ring_peer();
        match self.ty {
            QpType::Rc => Exec::Ack {
                end: self.sent(),
                msg: prog.msg,
            },
            _ => Exec::Done(WcStatus::Success),
        }
    }

    /// Pushes the rest of a message into the peer's ring. `Ok(false)`: the ring is full.
    pub(super) fn push_message(
        &mut self,
        mop: MsgOp,
        op: &OpView<'_>,
        total: u64,
        prog: &mut Progress,
        env: &CtxParts<'_>,
    ) -> Result<bool, WcStatus> {
        let Some(p) = &mut self.peer else {
            return Err(WcStatus::LocQpOpErr);
        };
        let payload = mop != MsgOp::WriteImm;
        loop {
            let frag = if payload {
                (total - prog.pushed).min(FRAG as u64) as usize
            } else {
                0
            };
            let r = match p.outbound.reserve(HDR + frag) {
                Ok(r) => r,
                Err(RingError::Full) => return Ok(false),
                Err(_) => return Err(WcStatus::LocQpOpErr),
            };
            let first = prog.pushed == 0;
            let last = !payload || prog.pushed + frag as u64 == total;
            let mut flags = 0;
            if first {
                flags |= MSG_FIRST;
            }
            if last {
                flags |= MSG_LAST;
                if op.solicited {
                    flags |= MSG_SOLICITED;
                }
            }
            let mut h = [0u8; HDR];
            MsgRepr {
                op: mop,
                flags,
                imm: op.imm,
                msg_len: total as u32,
                frag_off: if payload { prog.pushed as u32 } else { 0 },
                ack: p.inbound.consumed(),
                credits: self.rq_posted,
            }
            .emit(&mut MsgHeader::new_unchecked(&mut h[..]));
            let _ = p.outbound.data().write(r.pos, &h);
            let whole_one = match op.src {
                Src::One(b) if payload && first && last && b.len() == frag => Some(b),
                _ => None,
            };
            if whole_one
                .is_some_and(|b| super::fast::send_in_place(p, self.ty == QpType::Rc, &b, &r))
            {
                // Its payload goes from the program's region in place.
            } else if frag > 0 {
                // The reservation covers HDR + frag bytes at r.pos, inside the ring; the
                // source was validated by `prepare` in this same call.
                op.src.gather_to(
                    env.mrs,
                    self.pd,
                    prog.pushed,
                    frag,
                    p.outbound.data(),
                    r.pos + HDR as u64,
                );
            }
            p.outbound.commit(r);
            prog.pushed += frag as u64;
            if last {
                return Ok(true);
            }
        }
    }

    /// The peer's region `rkey`, granted and mapped on first use; None → REM_ACCESS_ERR.
    pub(super) fn remote_mr(&mut self, rkey: u32, env: &CtxParts<'_>) -> Option<Rc<RemoteMr>> {
        if let Some(i) = self.remote.iter().rposition(|m| m.key == rkey) {
            if self.remote[i].valid() {
                let m = self.remote.remove(i);
                self.remote.push(m.clone()); // most recently used last (the fast path's)
                return Some(m);
            }
            self.remote.remove(i);
            return None;
        }
        let mem = env.transport.map_region(GrantRequest::ThroughQp {
            slot: env.node.slot(),
            qpn: self.qpn,
            rkey,
        })?;
        let m = Rc::new(RemoteMr::new(rkey, mem));
        if self.remote.len() >= REMOTE_CACHE {
            self.remote.remove(0);
        }
        self.remote.push(m.clone());
        Some(m)
    }

    /// Checks a one-sided access: region valid and allowing `need`, the peer QP accepting it,
    /// `[addr, addr+len)` inside the region.
    pub(super) fn remote_access(
        &mut self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
        env: &CtxParts<'_>,
    ) -> Result<(Rc<RemoteMr>, u64), WcStatus> {
        let peer_access = self
            .peer
            .as_ref()
            // SYNC POINT qp-access (relaxed read of a word that only gates, never publishes).
            .map(|p| AccessFlags::from_bits_retain(p.link.peer_access()))
            .ok_or(WcStatus::LocQpOpErr)?;
        let m = self.remote_mr(rkey, env).ok_or(WcStatus::RemAccessErr)?;
        // A peer on another host checks its own flags (the copy here may not have caught up
        // with its modify_qp yet: perftest's first WRITE follows the connection at once).
        let peer_access = if !peer_access.contains(need) && m.mem.owner_checks_qp_access() {
            peer_access | need
        } else {
            peer_access
        };
        // The owner's address of a byte → its offset in the region; below the region wraps
        // past its end, which the bounds check refuses.
        let off = addr.wrapping_sub(m.iova);
        if !remote_access_allowed(m.len, m.access, peer_access, need, off, len) {
            return Err(WcStatus::RemAccessErr);
        }
        Ok((m, off))
    }

    pub(super) fn exec_write(
        &mut self,
        op: &OpView<'_>,
        prog: &mut Progress,
        env: &CtxParts<'_>,
    ) -> Exec {
        let (total, src) = match prepare(env.mrs, self.pd, op.src) {
            Ok(t) => t,
            Err(s) => return Exec::Fatal(s),
        };
        let op = &op.with_src(src);
        let imm = op.opcode == WrOpcode::RdmaWriteWithImm;
        // A zero-length WRITE names no remote bytes: as on InfiniBand, its rkey and address
        // are not checked (UCX's rc transport flushes with one whose rkey is 0).
        if total == 0 && !prog.started {
            if !imm {
                return Exec::Done(WcStatus::Success);
            }
            if !self.take_credit() {
                return Exec::Rnr;
            }
            prog.msg = self.msgs_out;
            self.msgs_out += 1;
            prog.started = true;
        }
        if !prog.started {
            let (m, off) = match self.remote_access(
                op.rkey,
                op.remote_addr,
                total,
                AccessFlags::REMOTE_WRITE,
                env,
            ) {
                Ok(m) => m,
                Err(s) => return Exec::Fatal(s),
            };
            if imm {
                if !self.take_credit() {
                    return Exec::Rnr;
                }
                prog.msg = self.msgs_out;
                self.msgs_out += 1;
            }
            prog.started = true;
            // [remote_addr, +total) is inside the region (remote_access checked the bounds;
            // REMOTE_WRITE regions are granted writable); the source was validated by `prepare`.
            ordered_write(&op.src, env.mrs, self.pd, &*m.mem, off, total as usize);
            if !imm {
                // A region on another host: complete once the write landed there.
                if let Some(t) = m.mem.ticket() {
                    return Exec::Placed(m, t);
                }
            }
        }
        if !imm {
            return Exec::Done(WcStatus::Success);
        }
        match self.push_message(MsgOp::WriteImm, op, total, prog, env) {
            Ok(true) => {}
            Ok(false) => return Exec::Full,
            Err(s) => return Exec::Fatal(s),
        }
        self.ring_peer();
        match self.ty {
            QpType::Rc => Exec::Ack {
                end: self.sent(),
                msg: prog.msg,
            },
            _ => Exec::Done(WcStatus::Success),
        }
    }

    /// Sends a READ's or an atomic's requests without waiting for the answer, where the
    /// region's transport does that ([`RemoteRegion::fetch`]); `None`: do it at once.
    fn fetch_start(m: &Rc<RemoteMr>, op: FetchOp, off: u64, n: usize) -> Option<Exec> {
        match m.mem.fetch(op, off, n) {
            Ok(Fetch::Started { first, last }) => Some(Exec::Fetching(m.clone(), first, last)),
            // Earlier answers fill the ring they come through: once they are taken.
            Ok(Fetch::Busy) => Some(Exec::Full),
            Ok(Fetch::Whole) => None,
            Err(_) => Some(Exec::Fatal(WcStatus::RemAccessErr)),
        }
    }

    pub(super) fn exec_read(&mut self, op: &OpView<'_>, env: &CtxParts<'_>) -> Exec {
        let Src::Sges(sges) = op.src else {
            return Exec::Fatal(WcStatus::LocProtErr);
        };
        let total = match check_sges(env.mrs, self.pd, sges, true) {
            Ok(t) => t,
            Err(s) => return Exec::Fatal(s),
        };
        if total == 0 {
            // As a zero-length WRITE: nothing remote to check or read.
            return Exec::Done(WcStatus::Success);
        }
        let (m, off) = match self.remote_access(
            op.rkey,
            op.remote_addr,
            total,
            AccessFlags::REMOTE_READ,
            env,
        ) {
            Ok(m) => m,
            Err(s) => return Exec::Fatal(s),
        };
        // A region on another host: the request goes now, the answer completes it later
        // (several outstanding, as on a NIC: a READ waited for its answer in `post_send`,
        // one at a time — `ib_read_bw` between two hosts ran at its latency's rate).
        if let Some(e) = Self::fetch_start(&m, FetchOp::Read, off, total as usize) {
            return e;
        }
        // [remote_addr, +total) is inside the region (checked); the local entries were
        // validated writable.
        let mut refused = false;
        walk_sges(env.mrs, self.pd, sges, 0, total as usize, true, |at, b| {
            if let Bytes::Span(dst, dst_off, n) = b {
                if !refused {
                    let got = m.mem.get(off + at as u64, dst, dst_off, n, CopyKind::Plain);
                    // Shared memory checked the range above; a region on another host may
                    // still refuse (deregistered there, or its host gone).
                    refused = got.is_err();
                }
            }
        });
        if refused {
            return Exec::Fatal(WcStatus::RemAccessErr);
        }
        Exec::Done(WcStatus::Success)
    }

    pub(super) fn exec_atomic(&mut self, op: &OpView<'_>, env: &CtxParts<'_>) -> Exec {
        let Src::Sges(sges) = op.src else {
            return Exec::Fatal(WcStatus::LocProtErr);
        };
        match check_sges(env.mrs, self.pd, sges, true) {
            Ok(8) => {}
            Ok(_) => return Exec::Fatal(WcStatus::LocLenErr),
            Err(s) => return Exec::Fatal(s),
        }
        if !op.remote_addr.is_multiple_of(8) {
            return Exec::Fatal(WcStatus::RemAccessErr);
        }
        let (m, off) =
            match self.remote_access(op.rkey, op.remote_addr, 8, AccessFlags::REMOTE_ATOMIC, env) {
                Ok(m) => m,
                Err(s) => return Exec::Fatal(s),
            };
        let fop = if op.opcode == WrOpcode::AtomicFetchAndAdd {
            FetchOp::FetchAdd(op.compare_add)
        } else {
            FetchOp::CmpSwap(op.compare_add, op.swap)
        };
        if let Some(e) = Self::fetch_start(&m, fop, off, 8) {
            return e;
        }
        let old = if op.opcode == WrOpcode::AtomicFetchAndAdd {
            m.mem.fetch_add(off, op.compare_add)
        } else {
            m.mem.compare_swap(off, op.compare_add, op.swap)
        };
        let Ok(old) = old else {
            return Exec::Fatal(WcStatus::RemAccessErr);
        };
        let b = old.to_le_bytes();
        // The entries were validated writable and hold exactly 8 bytes.
        scatter(env.mrs, self.pd, sges, 0, Bytes::Slice(&b));
        Exec::Done(WcStatus::Success)
    }
}
