//! The fast paths of `ibv_post_send`: one request, nothing queued ahead, executed at once
//! (RDMA_WRITE, SEND, RDMA_READ and the atomics); anything else takes the general way.

use super::*;

impl QpEngine {
    /// A request posted now may run at once, on a fast path: RTS, nothing queued or waiting
    /// for an RNR retry ahead of it, the peer there, a connected transport.
    #[inline(always)]
    pub(super) fn runs_now(&self) -> bool {
        self.state == QpState::Rts
            && self.exec == self.sq.len()
            && !self.rel.rnr_waiting()
            && !self.peer_gone
            && self.ty != QpType::Ud
    }

    /// One request on its fast path (RDMA_WRITE, SEND, READ, atomics), or `false` with nothing
    /// done: the caller then takes the general way, which also reports every error.
    #[inline(always)]
    pub(crate) fn post_one_fast(&mut self, wr: &SendWr<'_>, mrs: &MrTable, cqs: &mut Cqs) -> bool {
        match wr.opcode {
            WrOpcode::RdmaWrite => self.fast_rdma_write(wr, mrs, cqs),
            WrOpcode::Send | WrOpcode::SendWithImm => self.fast_send(wr, mrs, cqs),
            _ => self.fast_read_atomic(wr, mrs, cqs),
        }
    }

    /// The RDMA_WRITE fast path — the latency-critical operation (a peer polling memory) — on
    /// its own so it compiles to a short straight line: one request, nothing waiting ahead, a
    /// single local range or inline data, the region last used for this QP's one-sided work,
    /// the same checks as [`QpEngine::fast_read_atomic`]. Anything else goes the general way.
    #[inline(always)]
    pub(super) fn fast_rdma_write(
        &mut self,
        wr: &SendWr<'_>,
        mrs: &MrTable,
        cqs: &mut Cqs,
    ) -> bool {
        let WrDetail::Rdma { remote_addr, rkey } = wr.wr else {
            return false;
        };
        if !self.runs_now() {
            return false;
        }
        let inline = wr.send_flags.contains(SendFlags::INLINE);
        let local = if inline && !wr.inline_data.is_empty() {
            if wr.inline_data.len() > self.cap.max_inline_data as usize {
                return false;
            }
            Bytes::Slice(wr.inline_data)
        } else {
            let [one] = wr.sg_list else { return false };
            if inline && one.length > self.cap.max_inline_data {
                return false;
            }
            match resolve(mrs, self.pd, one, false) {
                Ok(b) => b,
                Err(_) => return false,
            }
        };
        let len = local.len();
        // The fast path reaches the region directly (mapped here by the shared-memory
        // transport); any other transport takes the general way, through the trait.
        let Some((m, d)) = self
            .remote
            .last()
            .and_then(|m| Some((m, m.direct.as_ref()?)))
        else {
            return false;
        };
        // Remote bytes are named by the owner's addresses (`iova`); a wrapped offset is far past
        // the end, which the checked copy refuses.
        let off = remote_addr.wrapping_sub(m.iova);
        // The line the write ends in (the one a peer polls) starts coming while the checks run.
        let end_line = write_end(&d.data, off, len);
        crate::sync::prefetch_write(end_line);
        let Some(p) = &self.peer else { return false };
        if m.key != rkey
            // SYNC POINT mr-state (acquire): the owner's deregistration, seen before each access.
            || d.state.load(Ordering::Acquire) != MR_STATE_VALID
            || !remote_flags_allowed(
                m.access,
                // SYNC POINT qp-access (relaxed read of a word that only gates, never publishes).
                AccessFlags::from_bits_retain(p.link.peer_access()),
                AccessFlags::REMOTE_WRITE,
            )
        {
            return false;
        }
        // The range half of the access rule: `d.data` is exactly the region's granted bytes
        // (`RemoteMr::new`), so the checked copy refuses what `remote_access_allowed` would;
        // the general way then reports the error.
        if local.copy_to(&d.data, off, true).is_err() {
            return false;
        }
        self.write_hint = WriteHint {
            rkey,
            remote_addr,
            line: end_line,
        };
        self.done_at_once(wr, WcOpcode::RdmaWrite, len, cqs);
        true
    }

    /// A request a fast path carried out entirely: a signaled one completes now, or — if work
    /// posted before it still waits for its acknowledgement — right after that work (in order).
    #[inline(always)]
    pub(super) fn done_at_once(
        &mut self,
        wr: &SendWr<'_>,
        op: WcOpcode,
        len: usize,
        cqs: &mut Cqs,
    ) {
        self.done_at_once_as((wr.wr_id, wr.opcode, wr.send_flags), op, len, cqs);
    }

    /// [`QpEngine::done_at_once`] of a request known by its id, opcode and flags.
    #[inline(always)]
    fn done_at_once_as(
        &mut self,
        (wr_id, opcode, flags): (u64, WrOpcode, SendFlags),
        op: WcOpcode,
        len: usize,
        cqs: &mut Cqs,
    ) {
        if !self.signaled(flags) {
            return;
        }
        if self.sq.is_empty() {
            let wc = self.wc(wr_id, WcStatus::Success, op, len as u32);
            push_cqe(cqs, self.send_cq, wc);
        } else {
            self.push_executed_as(
                wr_id,
                opcode,
                true,
                len as u32,
                SendPhase::Done(WcStatus::Success),
            );
        }
    }

    /// The fast path of RDMA_READ and the atomics (RC): one request, nothing waiting ahead of
    /// it, a single local range, a region already mapped. Anything else — including every
    /// error — goes the general way (which reports it). RDMA_WRITE has its own,
    /// [`QpEngine::fast_rdma_write`].
    #[inline(never)]
    pub(super) fn fast_read_atomic(
        &mut self,
        wr: &SendWr<'_>,
        mrs: &MrTable,
        cqs: &mut Cqs,
    ) -> bool {
        // By reference: copying the request's detail out (a 40-byte enum) cost ~14
        // instructions a READ.
        let (remote_addr, rkey, compare_add, swap) = match (wr.opcode, &wr.wr) {
            (WrOpcode::RdmaRead, &WrDetail::Rdma { remote_addr, rkey }) => {
                (remote_addr, rkey, 0, 0)
            }
            (
                WrOpcode::AtomicFetchAndAdd | WrOpcode::AtomicCmpAndSwp,
                &WrDetail::Atomic {
                    remote_addr,
                    rkey,
                    compare_add,
                    swap,
                },
            ) => (remote_addr, rkey, compare_add, swap),
            _ => return false,
        };
        let [local] = wr.sg_list else { return false };
        self.fast_one_sided_in(
            &OneSided {
                wr_id: wr.wr_id,
                opcode: wr.opcode,
                send_flags: wr.send_flags,
                local,
                remote_addr,
                rkey,
                compare_add,
                swap,
            },
            mrs,
            cqs,
        )
    }

    /// [`QpEngine::fast_read_atomic`] of a request handed over as a [`OneSided`]
    /// (`Qp::post_one_sided`).
    #[inline(never)]
    pub(crate) fn fast_one_sided(
        &mut self,
        r: &OneSided<'_>,
        mrs: &MrTable,
        cqs: &mut Cqs,
    ) -> bool {
        self.fast_one_sided_in(r, mrs, cqs)
    }

    #[inline(always)]
    fn fast_one_sided_in(&mut self, r: &OneSided<'_>, mrs: &MrTable, cqs: &mut Cqs) -> bool {
        let (need, wc_op) = match r.opcode {
            WrOpcode::RdmaRead => (AccessFlags::REMOTE_READ, WcOpcode::RdmaRead),
            WrOpcode::AtomicFetchAndAdd => (AccessFlags::REMOTE_ATOMIC, WcOpcode::FetchAdd),
            WrOpcode::AtomicCmpAndSwp => (AccessFlags::REMOTE_ATOMIC, WcOpcode::CompSwap),
            _ => return false,
        };
        // UC has neither: the general way refuses them.
        if !self.runs_now() || self.ty == QpType::Uc {
            return false;
        }
        let Ok(Bytes::Span(local, local_off, len)) = resolve(mrs, self.pd, r.local, true) else {
            return false;
        };
        if r.send_flags.contains(SendFlags::INLINE) && len > self.cap.max_inline_data as usize {
            return false;
        }
        let atomic = wc_op != WcOpcode::RdmaRead;
        if atomic && (len != 8 || !r.remote_addr.is_multiple_of(8)) {
            return false;
        }
        let Some((m, d)) = self
            .remote
            .last()
            .filter(|m| m.key == r.rkey)
            .and_then(|m| Some((m, m.direct.as_ref()?)))
        else {
            return false;
        };
        let remote_addr = r.remote_addr.wrapping_sub(m.iova);
        let Some(p) = &self.peer else { return false };
        // SYNC POINT mr-state (acquire): the owner's deregistration, seen before each access.
        if d.state.load(Ordering::Acquire) != MR_STATE_VALID
            || !remote_access_allowed(
                m.len,
                m.access,
                // SYNC POINT qp-access (relaxed read of a word that only gates, never publishes).
                AccessFlags::from_bits_retain(p.link.peer_access()),
                need,
                remote_addr,
                len as u64,
            )
        {
            return false;
        }
        // Ranges checked just above (atomics only on regions granted writable, which
        // REMOTE_ATOMIC regions are); an error here means a check disagreed: the general way.
        let done = match wc_op {
            WcOpcode::RdmaRead => d.data.copy_to(remote_addr, local, local_off, len),
            WcOpcode::FetchAdd => d
                .data
                .fetch_add(remote_addr, r.compare_add)
                .and_then(|old| local.write(local_off, &old.to_le_bytes())),
            _ => d
                .data
                .compare_swap(remote_addr, r.compare_add, r.swap)
                .and_then(|old| local.write(local_off, &old.to_le_bytes())),
        };
        if done.is_err() {
            return false;
        }
        self.done_at_once_as((r.wr_id, r.opcode, r.send_flags), wc_op, len, cqs);
        true
    }

    /// The SEND fast path (RC/UC): one request, nothing waiting ahead, one source range or
    /// inline data, one fragment, a credit and ring room at hand. Anything else goes the
    /// general way. Kept out of line so the one-sided path stays small (registers, spills).
    #[inline(never)]
    pub(super) fn fast_send(&mut self, wr: &SendWr<'_>, mrs: &MrTable, cqs: &mut Cqs) -> bool {
        let mop = match wr.opcode {
            WrOpcode::Send => MsgOp::Send,
            WrOpcode::SendWithImm => MsgOp::SendImm,
            _ => return false,
        };
        if !matches!(wr.wr, WrDetail::None) || !self.runs_now() {
            return false;
        }
        let inline = wr.send_flags.contains(SendFlags::INLINE);
        let src = match (inline, wr.inline_data, wr.sg_list) {
            (true, d, _) if !d.is_empty() => Bytes::Slice(d),
            (_, _, [one]) => match resolve(mrs, self.pd, one, false) {
                Ok(b) => b,
                Err(_) => return false,
            },
            _ => return false,
        };
        let len = src.len();
        if len > FRAG || (inline && len > self.cap.max_inline_data as usize) {
            return false;
        }
        let rc = self.ty == QpType::Rc;
        if rc && self.used_credits >= self.credits {
            if let Some(o) = &self.own {
                self.credits = self.credits.max(o.credits());
            }
            if self.used_credits >= self.credits {
                return false;
            }
        }
        let Some(p) = &mut self.peer else {
            return false;
        };
        let Ok(r) = p.outbound.reserve(HDR + len) else {
            return false;
        };
        let solicited = if wr.send_flags.contains(SendFlags::SOLICITED) {
            MSG_SOLICITED
        } else {
            0
        };
        let mut hdr = [0u8; HDR];
        MsgRepr {
            op: mop,
            flags: MSG_FIRST | MSG_LAST | solicited,
            imm: wr.imm_data,
            msg_len: len as u32,
            frag_off: 0,
            ack: p.inbound.consumed(),
            credits: self.rq_posted,
        }
        .emit(&mut MsgHeader::new_unchecked(&mut hdr[..]));
        // The reservation covers HDR + len bytes at r.pos, ours until commit.
        let _ = p.outbound.data().write(r.pos, &hdr);
        if !send_in_place(p, rc, &src, &r) {
            let _ = src.copy_to(p.outbound.data(), r.pos + HDR as u64, false);
        }
        p.outbound.commit(r);
        self.send_hint = p.outbound.next_hint();
        let end = p.outbound.sent();
        if rc {
            self.used_credits += 1;
        }
        let msg = self.msgs_out;
        self.msgs_out += 1;
        self.ring_peer();
        if rc {
            let signaled = self.signaled(wr.send_flags);
            self.push_executed(wr, signaled, len as u32, SendPhase::Ack { end, msg });
        } else {
            self.done_at_once(wr, WcOpcode::Send, len, cqs);
        }
        true
    }
}

/// An RC SEND of one fragment to a peer on another host whose pair this process carries,
/// reserved at `r` with its payload `src` (`len` bytes of a region): leaves the payload out
/// of the ring, for the pair's mirror to send from the region in place, and says so (true:
/// the caller does not copy it). The SEND completes once the peer took it, and the program
/// leaves its source alone until then, as it must on a NIC. (Session 29: no faster for
/// `perf send-bw` between two hosts, whose sender is not bound by these copies.)
pub(super) fn send_in_place(
    p: &PeerLink,
    rc: bool,
    src: &Bytes<'_>,
    r: &crate::transport::Reservation,
) -> bool {
    let Bytes::Span(span, off, len) = *src else {
        return false;
    };
    if !rc || len < crate::transport::across::ELSEWHERE_MIN {
        return false;
    }
    let Some(c) = crate::transport::across::carrier_of((p.slot, p.qpn)) else {
        return false;
    };
    let d = crate::transport::across::Deferred {
        id: r.index() - crate::wire::RECORD_HEADER_LEN,
        at: r.index() + HDR as u64,
        span: span.clone(),
        off,
        len,
    };
    // (Before the commit: a mirror that sees the record finds its payload.)
    c.sends
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push_back(d);
    true
}
