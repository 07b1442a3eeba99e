//! RC reliability on the requester side: acknowledgements (the responder's consumer index),
//! credits (its posted receives), RNR waits and retries, NAKs, and completing acknowledged work.

use super::*;

/// The requester's side of RC reliability as a sans-IO state machine: acknowledgements come
/// in as the values read from the words the responder writes, time as `now`; it answers
/// whether work is acknowledged, how a NAK completes it, and what an RNR wait does next. The
/// QP does the reading and the waiting (`impl QpEngine` below); this type decides, and is
/// tested on a virtual clock.
#[derive(Debug, Default, Clone)]
pub(super) struct Reliability {
    /// Ring position the responder has consumed up to (its consumer index).
    acked: u64,
    /// The part of `acked` learnt from acks piggybacked on messages: a responder that NAKs
    /// sends nothing after, so work it covers completes without a look at the NAK word.
    acked_piggy: u64,
    /// The RNR wait in progress: retries left and when to look again.
    rnr: Option<(u8, Instant)>,
}

/// What an RNR (no receive posted at the responder) means now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RnrStep {
    /// Keep the request queued; look again at the deadline (or when credits arrive).
    Wait,
    /// Every retry is spent: the request completes with RNR_RETRY_EXC_ERR.
    Exhausted,
}

/// `rnr_retry` 7 means "retry forever", as in the IB specification.
const RNR_FOREVER: u8 = 7;

impl Reliability {
    /// How far the responder acknowledged.
    #[inline(always)]
    pub(super) fn acked(&self) -> u64 {
        self.acked
    }

    /// An acknowledgement read from our QP block; `sent` is how far we have produced. False
    /// for a value no live peer can write (beyond what was sent, or misaligned).
    pub(super) fn ack(&mut self, a: u64, sent: u64) -> bool {
        if a > sent || !a.is_multiple_of(64) {
            return false;
        }
        self.acked = self.acked.max(a);
        true
    }

    /// An acknowledgement piggybacked on a message (see `acked_piggy`).
    pub(super) fn piggy_ack(&mut self, a: u64, sent: u64) -> bool {
        let ok = self.ack(a, sent);
        if ok {
            self.acked_piggy = self.acked_piggy.max(a);
        }
        ok
    }

    /// How a request that ends at ring position `end` (message `msg`) completes, or None while
    /// it is not acknowledged. `nak` reads the NAK word — only when the answer depends on it
    /// (the peer may be writing that line).
    pub(super) fn settle(&self, end: u64, msg: u64, nak: impl FnOnce() -> u64) -> Option<WcStatus> {
        if end <= self.acked_piggy {
            return Some(WcStatus::Success);
        }
        if end > self.acked {
            return None;
        }
        let n = nak();
        if n != 0 && (n >> 8).wrapping_sub(1) == msg {
            return Some(match (n & 0xff) as u8 {
                NAK_INV_REQ => WcStatus::RemInvReqErr,
                NAK_RNR => WcStatus::RnrRetryExcErr,
                _ => WcStatus::RemOpErr,
            });
        }
        Some(WcStatus::Success)
    }

    /// True while an RNR wait is in progress.
    #[inline(always)]
    pub(super) fn rnr_waiting(&self) -> bool {
        self.rnr.is_some()
    }

    /// The request got through (or the QP is gone): no RNR wait any more.
    pub(super) fn rnr_clear(&mut self) {
        self.rnr = None;
    }

    /// A request found no credit at `now`. The first time starts a wait of `delay` with
    /// `retry` retries; each time the wait has run out with still no credit spends one retry
    /// (none with `retry` 7, forever) and waits `delay` again.
    pub(super) fn rnr(&mut self, now: Instant, retry: u8, delay: Duration) -> RnrStep {
        match self.rnr {
            None => self.rnr = Some((retry, now + delay)),
            Some((left, next)) if now >= next => {
                let left = if retry == RNR_FOREVER {
                    left
                } else if left == 0 {
                    return RnrStep::Exhausted;
                } else {
                    left - 1
                };
                self.rnr = Some((left, now + delay));
            }
            Some(_) => {}
        }
        RnrStep::Wait
    }

    /// When an RNR wait needs the process to look again (None with `retry` 7: no timer can end
    /// that wait, credits arriving wake it).
    pub(super) fn rnr_deadline(&self, retry: u8) -> Option<Instant> {
        self.rnr
            .filter(|_| retry != RNR_FOREVER)
            .map(|(_, next)| next)
    }

    /// Back to nothing sent, nothing acknowledged (RESET).
    pub(super) fn reset(&mut self) {
        *self = Self::default();
    }
}

impl QpEngine {
    pub(super) fn rnr_delay(&self) -> Duration {
        let v = self.own.as_ref().map(|o| o.peer_rnr()).unwrap_or(0);
        Duration::from_micros(fsm::rnr_timer_us(v.saturating_sub(1) as u8))
    }

    /// When the QP needs the process to look again (for the completion channel): an RNR
    /// wait's next retry, or the end of the retries for work a gone peer never acknowledged.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        earlier(
            self.rel.rnr_deadline(self.attr.rnr_retry),
            self.gone_deadline(),
        )
    }

    fn gone_deadline(&self) -> Option<Instant> {
        self.gone_since
            .filter(|_| !self.sq.is_empty())
            .map(|t| t + fsm::retry_wait(self.attr.timeout, self.attr.retry_cnt))
    }

    /// Writes our posted-receive count into the peer's block (the credits its sends wait for).
    pub(super) fn publish_credits(&mut self) {
        if self.published != self.rq_posted {
            if let Some(p) = &self.peer {
                p.link.publish_credits(self.rq_posted);
                self.published = self.rq_posted;
            }
        }
    }

    pub(super) fn note_ack(&mut self, a: u64) -> bool {
        self.rel.ack(a, self.sent())
    }

    /// An acknowledgement piggybacked on a message (see [`Reliability::piggy_ack`]).
    pub(super) fn note_piggy_ack(&mut self, a: u64) -> bool {
        self.rel.piggy_ack(a, self.sent())
    }

    pub(super) fn complete_acked(&mut self, cqs: &mut Cqs, look: bool) {
        if self.peer_gone && !self.sq.is_empty() && self.ty != QpType::Ud {
            // Acknowledged work completes; the first unacknowledged request fails once the
            // retries a NIC would make have run out (the peer cannot acknowledge any more,
            // but a program that is about to finish, with the work it needs acknowledged,
            // must not see the failure sooner than on hardware).
            self.refresh_ack();
            self.pop_completed(cqs);
            if !self.sq.is_empty() {
                let now = Instant::now();
                self.gone_since.get_or_insert(now);
                if self.gone_deadline().is_some_and(|d| now >= d) {
                    self.gone_since = None;
                    self.fail(Some(0), WcStatus::RetryExcErr, cqs);
                }
            }
            return;
        }
        if look
            && self.sq.front().is_some_and(
                |e| matches!(e.st, SendPhase::Ack { end, .. } if end > self.rel.acked()),
            )
        {
            self.refresh_ack();
        }
        self.pop_completed(cqs);
    }

    pub(super) fn refresh_ack(&mut self) {
        if let Some(o) = &self.own {
            let a = o.acked();
            if !self.note_ack(a) {
                self.peer_gone = true;
            }
        }
    }

    /// Takes the answers that came for the READs and atomics waiting in the send queue, in
    /// the order their requests went out, into their local buffers; one that is complete is
    /// done (refused by the owner: `REM_ACCESS_ERR`). Answers of one region's requests come
    /// in order, so the first that is missing ends the look.
    pub(super) fn take_fetched(&mut self, mrs: &MrTable) {
        let pd = self.pd;
        for e in self.sq.iter_mut() {
            let SendPhase::Fetching(f) = &mut e.st else {
                continue;
            };
            let atomic = matches!(
                f.work.opcode,
                WrOpcode::AtomicFetchAndAdd | WrOpcode::AtomicCmpAndSwp
            );
            let OwnedSrc::Sges(sges) = &f.work.src else {
                e.st = SendPhase::Done(WcStatus::LocProtErr);
                self.fetching -= 1;
                continue;
            };
            let sges = sges.as_slice();
            let total: u64 = sges.iter().map(|g| u64::from(g.length)).sum();
            let mut status = None;
            while f.next <= f.last {
                let at = (f.next - f.first) * RDMA_PIECE as u64;
                let want = total.saturating_sub(at).min(RDMA_PIECE as u64) as usize;
                let mut short = false;
                let mut copy = |d: &Span, pos: u64, n: usize| {
                    if atomic {
                        return;
                    }
                    // The other host's answer must be the piece asked for, no more, no less.
                    if n != want {
                        short = true;
                        return;
                    }
                    // The answer's bytes, at the piece's place in the local entries (validated
                    // writable when posted; one deregistered since is skipped).
                    walk_sges(mrs, pd, sges, at, n, true, |k, b| {
                        if let Bytes::Span(dst, dst_off, len) = b {
                            let _ = d.copy_to(pos + k as u64, dst, dst_off, len);
                        }
                    });
                };
                match f.m.mem.fetched(f.next, &mut copy) {
                    None => return,
                    Some(Ok(_)) if short => {
                        status = Some(WcStatus::RemAccessErr);
                        break;
                    }
                    Some(Ok(old)) => {
                        if atomic {
                            scatter(mrs, pd, sges, 0, Bytes::Slice(&old.to_le_bytes()));
                        }
                        f.next += 1;
                    }
                    Some(Err(_)) => {
                        status = Some(WcStatus::RemAccessErr);
                        break;
                    }
                }
            }
            if status.is_some() && f.next < f.last {
                f.m.mem.abandon(f.next + 1, f.last);
            }
            e.st = SendPhase::Done(status.unwrap_or(WcStatus::Success));
            self.fetching -= 1;
        }
    }

    pub(super) fn pop_completed(&mut self, cqs: &mut Cqs) {
        while let Some(e) = self.sq.front() {
            let st = match e.st {
                SendPhase::Done(s) => s,
                SendPhase::Ack { end, msg } => {
                    let own = &self.own;
                    // The NAK word, read after the ack word's acquire (qp-ack).
                    let nak = || own.as_ref().map_or(0, |o| o.nak());
                    match self.rel.settle(end, msg, nak) {
                        None => break,
                        Some(WcStatus::Success) => WcStatus::Success,
                        Some(st) => {
                            self.fail(Some(0), st, cqs);
                            return;
                        }
                    }
                }
                SendPhase::Placed(ref m, t) => match m.mem.settled(t) {
                    None => break,
                    Some(true) => WcStatus::Success,
                    Some(false) => {
                        self.fail(Some(0), WcStatus::RemAccessErr, cqs);
                        return;
                    }
                },
                SendPhase::Pending(_) | SendPhase::Fetching(_) => break,
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
                    self.rel.rnr_clear();
                    self.sq[i].st = SendPhase::Done(s);
                    self.exec += 1;
                }
                Exec::Ack { end, msg } => {
                    self.rel.rnr_clear();
                    self.sq[i].st = SendPhase::Ack { end, msg };
                    self.exec += 1;
                }
                Exec::Placed(m, t) => {
                    self.rel.rnr_clear();
                    self.sq[i].st = SendPhase::Placed(m, t);
                    self.exec += 1;
                }
                Exec::Fetching(m, first, last) => {
                    self.rel.rnr_clear();
                    let f = Fetching {
                        m,
                        work,
                        first,
                        next: first,
                        last,
                    };
                    self.sq[i].st = SendPhase::Fetching(Box::new(f));
                    self.fetching += 1;
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
                    let delay = self.rnr_delay();
                    let step = self.rel.rnr(Instant::now(), self.attr.rnr_retry, delay);
                    if step == RnrStep::Exhausted {
                        self.fail(Some(i), WcStatus::RnrRetryExcErr, cqs);
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
            p.link.publish_nak(((msg + 1) << 8) | u64::from(syndrome));
        }
    }

    /// A responder error: release the offending record (publishing the NAK), then go to ERR.
    pub(super) fn fail_after_release(&mut self, cqs: &mut Cqs) {
        if let Some(p) = &mut self.peer {
            if let Ok(Some(rec)) = p.inbound.peek() {
                p.inbound.release(rec);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A virtual clock: `t(ms)` is a fixed origin plus `ms` milliseconds.
    fn clock() -> impl Fn(u64) -> Instant {
        let t0 = Instant::now();
        move |ms| t0 + Duration::from_millis(ms)
    }

    #[test]
    fn acks_only_move_forward_and_impossible_ones_are_refused() {
        let mut r = Reliability::default();
        assert!(r.ack(128, 256));
        assert!(
            r.ack(64, 256),
            "an older ack is valid but does not move back"
        );
        assert_eq!(r.acked(), 128);
        assert!(!r.ack(320, 256), "beyond what was sent");
        assert!(!r.ack(130, 256), "misaligned");
        assert_eq!(r.acked(), 128);
    }

    #[test]
    fn work_settles_once_acknowledged_and_a_nak_for_it_decides_its_status() {
        let mut r = Reliability::default();
        assert!(r.ack(192, 256));
        assert_eq!(r.settle(256, 3, || 0), None, "not acknowledged yet");
        assert_eq!(r.settle(128, 1, || 0), Some(WcStatus::Success));
        let nak = |msg: u64, syn: u8| ((msg + 1) << 8) | u64::from(syn);
        assert_eq!(
            r.settle(128, 1, || nak(1, NAK_INV_REQ)),
            Some(WcStatus::RemInvReqErr)
        );
        assert_eq!(
            r.settle(128, 1, || nak(1, NAK_RNR)),
            Some(WcStatus::RnrRetryExcErr)
        );
        assert_eq!(
            r.settle(128, 1, || nak(1, NAK_REM_OP)),
            Some(WcStatus::RemOpErr)
        );
        assert_eq!(
            r.settle(128, 1, || nak(2, NAK_INV_REQ)),
            Some(WcStatus::Success),
            "a NAK of another message"
        );
    }

    #[test]
    fn work_a_piggybacked_ack_covers_completes_without_reading_the_nak_word() {
        let mut r = Reliability::default();
        assert!(r.piggy_ack(128, 256));
        let settled = r.settle(128, 1, || panic!("the NAK word must not be read"));
        assert_eq!(settled, Some(WcStatus::Success));
    }

    #[test]
    fn an_rnr_wait_spends_one_retry_per_expired_delay_then_is_exhausted() {
        let t = clock();
        let mut r = Reliability::default();
        let d = Duration::from_millis(10);
        assert_eq!(
            r.rnr(t(0), 2, d),
            RnrStep::Wait,
            "the first RNR starts the wait"
        );
        assert_eq!(r.rnr_deadline(2), Some(t(10)));
        assert_eq!(
            r.rnr(t(5), 2, d),
            RnrStep::Wait,
            "before the deadline: no retry spent"
        );
        assert_eq!(r.rnr(t(10), 2, d), RnrStep::Wait, "retry 1");
        assert_eq!(r.rnr_deadline(2), Some(t(20)));
        assert_eq!(r.rnr(t(20), 2, d), RnrStep::Wait, "retry 2");
        assert_eq!(r.rnr(t(29), 2, d), RnrStep::Wait);
        assert_eq!(r.rnr(t(30), 2, d), RnrStep::Exhausted);
        r.rnr_clear();
        assert!(!r.rnr_waiting());
        assert_eq!(
            r.rnr(t(40), 0, d),
            RnrStep::Wait,
            "rnr_retry 0 still waits once"
        );
        assert_eq!(r.rnr(t(50), 0, d), RnrStep::Exhausted);
    }

    #[test]
    fn rnr_retry_seven_waits_forever_and_has_no_deadline() {
        let t = clock();
        let mut r = Reliability::default();
        let d = Duration::from_millis(1);
        for ms in 0..1000 {
            assert_eq!(r.rnr(t(ms), 7, d), RnrStep::Wait);
        }
        assert_eq!(r.rnr_deadline(7), None);
        r.reset();
        assert!(!r.rnr_waiting());
        assert_eq!(r.acked(), 0);
    }
}
