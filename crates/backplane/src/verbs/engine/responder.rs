//! The responder: messages taken from the inbound QP ring into posted receives (whole, or
//! reassembled from fragments), with their completions.

use super::*;

impl QpEngine {
    /// Turns inbound messages into receive completions (RC/UC).
    pub(super) fn drive_rx(&mut self, env: &CtxParts<'_>, cqs: &mut Cqs) {
        loop {
            let Some(p) = &mut self.peer else { return };
            if !cq_room(cqs, self.recv_cq) {
                return;
            }
            let rec = match p.inbound.peek() {
                Ok(Some(r)) => r,
                Ok(None) => return,
                Err(_) => {
                    self.fail_why(
                        "the peer corrupted the inbound ring",
                        WcStatus::LocQpOpErr,
                        cqs,
                    );
                    return;
                }
            };
            if rec.len < HDR {
                self.fail_why(
                    "a record shorter than a message header",
                    WcStatus::LocQpOpErr,
                    cqs,
                );
                return;
            }
            let mut hb = [0u8; HDR];
            // Inside the data area (validated by the consumer); zeros would not parse.
            let _ = p.inbound.data().read(rec.pos, &mut hb);
            let Ok(h) = MsgRepr::parse(&MsgHeader::new_unchecked(&hb[..]), rec.len - HDR) else {
                self.fail_why("a malformed message header", WcStatus::LocQpOpErr, cqs);
                return;
            };
            // Where the payload lies in the inbound ring (validated by the consumer).
            let payload = rec.pos + HDR as u64;
            let frag_len = rec.len - HDR;
            if !self.note_piggy_ack(h.ack) {
                self.fail_why(
                    "an acknowledgement beyond what was sent",
                    WcStatus::LocQpOpErr,
                    cqs,
                );
                return;
            }
            self.credits = self.credits.max(h.credits);
            if h.flags & MSG_FIRST != 0 && self.inbound.is_none() && self.srq_empty() {
                // No receive in the shared queue: the message waits in the ring, in order,
                // until one is posted (the next progress looks again).
                return;
            }
            self.accept_fragment(&h, payload, frag_len, env, cqs);
            if self.state == QpState::Err {
                return;
            }
            let Some(p) = &mut self.peer else { return };
            p.inbound.release(rec);
            self.bell_pending = true;
            self.idle = 0;
            if p.inbound.drained_cached() {
                // Everything the last look at the producer index announced is taken; what came
                // since is the next poll's (which looks at the index first), so the message
                // just taken reaches its completion without one more look now.
                return;
            }
        }
    }

    /// The QP takes its receives from a shared queue that holds none.
    fn srq_empty(&self) -> bool {
        self.rq.is_shared() && self.rq.is_empty()
    }

    pub(super) fn accept_fragment(
        &mut self,
        h: &MsgRepr,
        payload: u64,
        frag_len: usize,
        env: &CtxParts<'_>,
        cqs: &mut Cqs,
    ) {
        if h.flags & (MSG_FIRST | MSG_LAST) == MSG_FIRST | MSG_LAST
            && self.inbound.is_none()
            && self.rx_whole(h, Payload::Ring(payload), frag_len, env, cqs)
        {
            return;
        }
        if h.flags & MSG_FIRST != 0 {
            if self.inbound.is_some() {
                self.fail_why(
                    "a message started inside another",
                    WcStatus::LocQpOpErr,
                    cqs,
                );
                return;
            }
            let msg = self.msgs_in;
            self.msgs_in += 1;
            let wqe = self.rq.pop_front();
            let mut m = InMsg {
                wqe,
                op: h.op,
                imm: h.imm,
                msg_len: h.msg_len,
                status: WcStatus::Success,
            };
            match &m.wqe {
                None => {
                    // RC: the requester ran past our credits (it should not); UC: dropped.
                    self.drops += 1;
                    if self.ty == QpType::Rc {
                        self.nak(msg, NAK_RNR);
                    }
                }
                Some(w) => {
                    let carries = h.op != MsgOp::WriteImm;
                    if carries && u64::from(h.msg_len) > w.total {
                        m.status = WcStatus::LocLenErr;
                        self.nak(msg, NAK_INV_REQ);
                    } else if carries
                        && check_sges(env.mrs, self.rq.pd(self.pd), w.sges.as_slice(), true)
                            .is_err()
                    {
                        m.status = WcStatus::LocProtErr;
                        self.nak(msg, NAK_REM_OP);
                    }
                }
            }
            if m.status != WcStatus::Success {
                let w = m.wqe.take().expect("checked above");
                let wc = self.wc(w.wr_id, m.status, WcOpcode::Recv, 0);
                push_cqe(cqs, self.recv_cq, wc);
                // The NAK is published with the release that follows; then the QP is in error.
                self.inbound = None;
                self.fail_after_release(cqs);
                return;
            }
            self.inbound = Some(m);
        }
        let Some(m) = &mut self.inbound else {
            self.fail_why("a fragment without its first", WcStatus::LocQpOpErr, cqs);
            return;
        };
        if let (Some(w), true, Some(p)) = (&m.wqe, frag_len > 0, &self.peer) {
            // The entries were validated writable when the message started (the region table
            // cannot change within this call); `frag_off + frag_len <= msg_len <= total`.
            scatter(
                env.mrs,
                self.rq.pd(self.pd),
                w.sges.as_slice(),
                u64::from(h.frag_off),
                Bytes::Span(p.inbound.data(), payload, frag_len),
            );
        }
        if h.flags & MSG_LAST != 0 {
            let m = self.inbound.take().expect("present");
            if let Some(w) = m.wqe {
                let peer = self.peer.as_ref().map_or((0, 0), |p| (p.qpn, p.slot));
                let imm = m.op != MsgOp::Send;
                let wc = Wc {
                    wr_id: w.wr_id,
                    status: m.status,
                    opcode: if m.op == MsgOp::WriteImm {
                        WcOpcode::RecvRdmaWithImm
                    } else {
                        WcOpcode::Recv
                    },
                    byte_len: m.msg_len,
                    imm_data: if imm { m.imm } else { 0 },
                    qp_num: self.qpn,
                    src_qp: peer.0,
                    wc_flags: if imm {
                        WcFlags::WITH_IMM
                    } else {
                        WcFlags::empty()
                    },
                    slid: peer.1 as u16,
                    ..Wc::default()
                };
                push_cqe(cqs, self.recv_cq, wc);
            }
        }
    }

    /// A message of the peer QP on another host, in the datagram that brought it: `bytes`
    /// are ring bytes that the pair's mirror (`verbs::direct`, in the pump of a thread polling
    /// this QP's context) is about to write at ring index `at`. When they start with the
    /// record this QP reads next, a whole SEND that the posted receive at the front takes,
    /// it is delivered from there — the mirror's copy into the ring saved (a 64 KiB SEND
    /// stream's receiver spent 20 % of its time in it, session 36) — and its ring room
    /// released as if read. Returns the bytes taken from the front of `bytes` (0: none; they
    /// go into the ring, and `drive_rx` judges them there as before). Nothing here may ring
    /// the peer: the pump that calls this holds the pair.
    pub(crate) fn deliver_ahead(
        &mut self,
        at: u64,
        bytes: &[u8],
        env: &CtxParts<'_>,
        cqs: &mut Cqs,
    ) -> usize {
        if !matches!(self.state, QpState::Rtr | QpState::Rts)
            || self.ty == QpType::Ud
            || self.inbound.is_some()
            || self.srq_empty()
            || !cq_room(cqs, self.recv_cq)
        {
            return 0;
        }
        let Some(p) = &self.peer else { return 0 };
        // (Past a pad at the ring's end, in the ring or at the front of `bytes`.)
        let Some(a) = p.inbound.take_ahead(at, bytes) else {
            return 0;
        };
        let len = a.len;
        // (In bounds: `take_ahead` checked the record's footprint lies within `bytes`.)
        let Some(rec) = bytes.get(a.off..a.off + len).filter(|r| r.len() >= HDR) else {
            return 0;
        };
        let Ok(h) = MsgRepr::parse(&MsgHeader::new_unchecked(&rec[..HDR]), len - HDR) else {
            return 0;
        };
        if h.flags & (MSG_FIRST | MSG_LAST) != MSG_FIRST | MSG_LAST
            || !matches!(h.op, MsgOp::Send | MsgOp::SendImm)
        {
            return 0;
        }
        // (Idempotent: a message left to the ring after this is judged the same there.)
        if !self.note_piggy_ack(h.ack) {
            return 0;
        }
        self.credits = self.credits.max(h.credits);
        if !self.rx_whole(&h, Payload::Here(&rec[HDR..]), len - HDR, env, cqs) {
            return 0;
        }
        if let Some(p) = &mut self.peer {
            p.inbound.skip_ahead(a.consumed);
        }
        // The ring room goes back with the pair's next message (or after its words' linger,
        // as drive_rx's release would: ringing the bell here had the next progress pump the
        // pair before the program saw this completion, `send-lat` 5 % slower); the next
        // progress takes this as a receive just completed (see `progress`).
        self.took_ahead = true;
        a.taken as usize
    }

    /// A whole message in one fragment, into a receive with one entry and room enough: the
    /// common case, without the reassembly state. False: take the general way.
    #[inline]
    pub(super) fn rx_whole(
        &mut self,
        h: &MsgRepr,
        payload: Payload<'_>,
        frag_len: usize,
        env: &CtxParts<'_>,
        cqs: &mut Cqs,
    ) -> bool {
        let Some(one) = self.rq.front_single() else {
            return false;
        };
        let carries = h.op != MsgOp::WriteImm;
        if carries {
            let Some(one) = one else {
                return false;
            };
            if u64::from(h.msg_len) > u64::from(one.length) {
                return false;
            }
            let pd = self.rq.pd(self.pd);
            let Ok(Bytes::Span(dst, dst_off, _)) = resolve(env.mrs, pd, &one, true) else {
                return false;
            };
            let Some(p) = &self.peer else { return false };
            // `dst` holds `length >= msg_len = frag_len` bytes of a writable local region.
            let src = match payload {
                Payload::Ring(at) => Bytes::Span(p.inbound.data(), at, frag_len),
                Payload::Here(b) => Bytes::Slice(b),
            };
            if src.copy_to(dst, dst_off, false).is_err() {
                return false;
            }
        }
        let w = self.rq.pop_front().expect("front exists");
        self.msgs_in += 1;
        let (src_qp, slid) = self
            .peer
            .as_ref()
            .map_or((0, 0), |p| (p.qpn, p.slot as u16));
        let imm = h.op != MsgOp::Send;
        push_cqe(
            cqs,
            self.recv_cq,
            Wc {
                wr_id: w.wr_id,
                opcode: if carries {
                    WcOpcode::Recv
                } else {
                    WcOpcode::RecvRdmaWithImm
                },
                byte_len: h.msg_len,
                imm_data: if imm { h.imm } else { 0 },
                qp_num: self.qpn,
                src_qp,
                wc_flags: if imm {
                    WcFlags::WITH_IMM
                } else {
                    WcFlags::empty()
                },
                slid,
                ..Wc::default()
            },
        );
        true
    }
}

/// Where a whole message's payload lies for [`QpEngine::rx_whole`].
pub(super) enum Payload<'a> {
    /// In the inbound ring, at this position of its data area.
    Ring(u64),
    /// In the datagram that brought it (see [`QpEngine::deliver_ahead`]).
    Here(&'a [u8]),
}
