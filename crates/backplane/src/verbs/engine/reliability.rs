//! RC reliability on the requester side: acknowledgements (the responder's consumer index),
//! credits (its posted receives), RNR waits and retries, NAKs, and completing acknowledged work.

use super::*;

impl QpEngine {
    pub(super) fn start_rnr(&mut self) {
        if self.rnr.is_none() {
            self.rnr = Some(Rnr {
                left: self.attr.rnr_retry,
                next: Instant::now() + self.rnr_delay(),
            });
        }
    }

    pub(super) fn rnr_delay(&self) -> Duration {
        let v = self
            .own
            .as_ref()
            .map(|o| o.peer_rnr.load(Ordering::Relaxed))
            .unwrap_or(0);
        Duration::from_micros(fsm::rnr_timer_us(v.saturating_sub(1) as u8))
    }

    /// When the RNR wait needs the process to look again (for the completion channel).
    pub(crate) fn deadline(&self) -> Option<Instant> {
        // With rnr_retry 7 (forever) no timer can end the wait: credits arriving wake us.
        self.rnr
            .filter(|_| self.attr.rnr_retry != 7)
            .map(|r| r.next)
    }

    /// Writes our posted-receive count into the peer's block (the credits its sends wait for).
    pub(super) fn publish_credits(&mut self) {
        if self.published != self.rq_posted {
            if let Some(p) = &self.peer {
                // SYNC POINT qp-credits (release): the peer may send once it sees the count.
                p.credits.store(self.rq_posted, Ordering::Release);
                self.published = self.rq_posted;
            }
        }
    }

    pub(super) fn note_ack(&mut self, a: u64) -> bool {
        if a > self.prod.tail() || !a.is_multiple_of(64) {
            return false;
        }
        self.acked = self.acked.max(a);
        true
    }

    /// An acknowledgement piggybacked on a message. A responder that NAKs goes to ERR and sends
    /// nothing after, so a piggybacked ack never covers a NAK'd message: work it covers
    /// completes without a look at the NAK word (which the peer may be writing).
    pub(super) fn note_piggy_ack(&mut self, a: u64) -> bool {
        let ok = self.note_ack(a);
        if ok {
            self.acked_piggy = self.acked_piggy.max(a);
        }
        ok
    }

    pub(super) fn complete_acked(&mut self, cqs: &mut Cqs, look: bool) {
        if self.peer_gone && !self.sq.is_empty() && self.ty != QpType::Ud {
            // Acknowledged work completes; the first unacknowledged request fails.
            self.refresh_ack();
            self.pop_completed(cqs);
            if !self.sq.is_empty() {
                self.fail(Some(0), WcStatus::RetryExcErr, cqs);
            }
            return;
        }
        if look
            && self
                .sq
                .front()
                .is_some_and(|e| matches!(e.st, SendPhase::Ack { end, .. } if end > self.acked))
        {
            self.refresh_ack();
        }
        self.pop_completed(cqs);
    }

    pub(super) fn refresh_ack(&mut self) {
        if let Some(o) = &self.own {
            // SYNC POINT qp-ack (acquire): the peer consumed (and NAK'd, if it did) up to here.
            let a = o.ack.load(Ordering::Acquire);
            if !self.note_ack(a) {
                self.peer_gone = true;
            }
        }
    }

    pub(super) fn pop_completed(&mut self, cqs: &mut Cqs) {
        while let Some(e) = self.sq.front() {
            let st = match e.st {
                SendPhase::Done(s) => s,
                SendPhase::Ack { end, .. } if end <= self.acked_piggy => WcStatus::Success,
                SendPhase::Ack { end, msg } if end <= self.acked => {
                    let nak = self
                        .own
                        .as_ref()
                        .map_or(0, |o| o.nak.load(Ordering::Relaxed));
                    if nak != 0 && (nak >> 8).wrapping_sub(1) == msg {
                        let st = match (nak & 0xff) as u8 {
                            NAK_INV_REQ => WcStatus::RemInvReqErr,
                            NAK_RNR => WcStatus::RnrRetryExcErr,
                            _ => WcStatus::RemOpErr,
                        };
                        self.fail(Some(0), st, cqs);
                        return;
                    }
                    WcStatus::Success
                }
                _ => break,
            };
            let e = self.sq.pop_front().expect("front exists");
            self.exec = self.exec.saturating_sub(1);
            if st != WcStatus::Success || e.signaled {
                let wc = self.wc(e.wr_id, st, wc_opcode(e.opcode), e.byte_len);
                push_cqe(cqs, self.send_cq, wc);
            }
        }
    }

    pub(super) fn drive_sq(&mut self, env: &CtxParts<'_>, cqs: &mut Cqs) {
        while self.exec < self.sq.len() && self.state == QpState::Rts {
            let i = self.exec;
            let SendPhase::Pending(b) =
                std::mem::replace(&mut self.sq[i].st, SendPhase::Done(WcStatus::Success))
            else {
                self.exec += 1;
                continue;
            };
            let (work, mut prog) = *b;
            let r = self.execute(&work.view(), &mut prog, env);
            match r {
                Exec::Done(s) => {
                    self.rnr = None;
                    self.sq[i].st = SendPhase::Done(s);
                    self.exec += 1;
                }
                Exec::Ack { end, msg } => {
                    self.rnr = None;
                    self.sq[i].st = SendPhase::Ack { end, msg };
                    self.exec += 1;
                }
                Exec::Fatal(s) => {
                    self.fail(Some(i), s, cqs);
                    return;
                }
                Exec::Full => {
                    self.sq[i].st = SendPhase::Pending(Box::new((work, prog)));
                    return;
                }
                Exec::Rnr => {
                    self.sq[i].st = SendPhase::Pending(Box::new((work, prog)));
                    let now = Instant::now();
                    match self.rnr {
                        None => self.start_rnr(),
                        Some(mut r) if now >= r.next => {
                            if self.attr.rnr_retry != 7 {
                                if r.left == 0 {
                                    self.fail(Some(i), WcStatus::RnrRetryExcErr, cqs);
                                    return;
                                }
                                r.left -= 1;
                            }
                            r.next = now + self.rnr_delay();
                            self.rnr = Some(r);
                        }
                        Some(_) => {}
                    }
                    return;
                }
            }
        }
    }

    /// Writes a NAK for message `msg` into the requester's block; the release of the record
    /// that follows publishes it.
    pub(super) fn nak(&self, msg: u64, syndrome: u8) {
        if let Some(p) = &self.peer {
            // SYNC POINT qp-ack (release, with the consumer index stored after it).
            p.nak
                .store(((msg + 1) << 8) | u64::from(syndrome), Ordering::Relaxed);
        }
    }

    /// A responder error: release the offending record (publishing the NAK), then go to ERR.
    pub(super) fn fail_after_release(&mut self, cqs: &mut Cqs) {
        if let Some(p) = &self.peer {
            if let Ok(Some(rec)) = self.cons.peek(&p.inbound) {
                self.cons.release(&p.inbound, rec);
            }
        }
        self.ring_peer();
        self.fail_why(
            "a receive could not take a message",
            WcStatus::WrFlushErr,
            cqs,
        );
    }
}
