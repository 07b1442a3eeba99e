//! Completion queues: the entries a context's CQs hold, and pushing into them.

use super::*;

// ---------------------------------------------------------------------------------------------
// Completion queues.
// ---------------------------------------------------------------------------------------------

/// A CQ's completions, oldest first: a ring that grows (completions past the CQ's size are
/// kept and counted as overruns). Not a `VecDeque`: its `push_back` is not inlined into the
/// engine's fast paths, so each completion was built on the stack in narrow stores and then
/// reloaded whole — a store-forwarding stall, a fifth of an RDMA READ's post. Here the push
/// is inlined and the completion is stored straight into its slot.
pub(crate) struct CqRing {
    slots: Vec<Wc>,
    head: usize,
    len: usize,
}

impl CqRing {
    /// An empty ring with room for `n` completions before it grows.
    pub(crate) fn with_capacity(n: usize) -> Self {
        Self {
            slots: vec![Wc::default(); n.max(1)],
            head: 0,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    pub(crate) fn push_back(&mut self, wc: Wc) {
        if self.len == self.slots.len() {
            self.grow();
        }
        let mut i = self.head + self.len;
        if i >= self.slots.len() {
            i -= self.slots.len();
        }
        self.slots[i] = wc;
        self.len += 1;
    }

    #[inline]
    pub(crate) fn pop_front(&mut self) -> Option<Wc> {
        if self.len == 0 {
            return None;
        }
        let wc = self.slots[self.head];
        self.len -= 1;
        // Drained: the next completion goes to slot 0 again, so a program that takes each
        // completion as it comes (a latency loop) writes and reads one slot that stays in
        // the L1 cache, not a new one of the ring's each time (a slot's line missed L1 on
        // every READ: that store was the fast path's costliest instruction).
        self.head = if self.len == 0 || self.head + 1 == self.slots.len() {
            0
        } else {
            self.head + 1
        };
        Some(wc)
    }

    /// Twice the room, the entries in order from slot 0.
    #[cold]
    fn grow(&mut self) {
        let n = self.slots.len();
        let mut slots = Vec::with_capacity(2 * n);
        slots.extend_from_slice(&self.slots[self.head..]);
        slots.extend_from_slice(&self.slots[..self.head]);
        slots.resize(2 * n, Wc::default());
        self.slots = slots;
        self.head = 0;
    }
}

pub(crate) struct CqState {
    pub(crate) entries: CqRing,
    pub(crate) cap: usize,
    pub(crate) qps: Vec<usize>,
    pub(crate) channel: Option<Arc<ChannelShared>>,
    pub(crate) handle_alive: bool,
    /// Completions that arrived while the CQ already held `cap` entries (kept, but counted:
    /// on hardware that is a CQ overrun, `IBV_EVENT_CQ_ERR`).
    pub(crate) overruns: u64,
}

pub(crate) type Cqs = Vec<Option<CqState>>;

/// Appends a completion (inlined: built in place, a completion is not first stored on the
/// stack in narrow pieces and then reloaded whole — a store-forwarding stall that was a fifth
/// of a signaled RDMA WRITE's cost).
#[inline(always)]
pub(super) fn push_cqe(cqs: &mut Cqs, cq: usize, wc: Wc) {
    if let Some(Some(c)) = cqs.get_mut(cq) {
        // Receives wait in the ring while the CQ is full (`cq_room`); send completions cannot
        // wait, so they are kept and the overrun is counted for `Cq::overruns`.
        if c.entries.len() >= c.cap {
            c.overruns += 1;
        }
        c.entries.push_back(wc);
        if let Some(ch) = &c.channel {
            ch.completion_added(cq as u32);
        }
    }
}

/// Whether CQ `cq` holds completions not yet taken.
pub(crate) fn holds_completions(cqs: &Cqs, cq: usize) -> bool {
    cqs.get(cq)
        .and_then(|c| c.as_ref())
        .is_some_and(|c| c.entries.len() != 0)
}

pub(super) fn cq_room(cqs: &Cqs, cq: usize) -> bool {
    cqs.get(cq)
        .and_then(|c| c.as_ref())
        .is_some_and(|c| c.entries.len() < c.cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_order_across_wraps_and_growth() {
        let mut r = CqRing::with_capacity(3);
        let wc = |id| Wc {
            wr_id: id,
            ..Wc::default()
        };
        let mut next_in = 0u64;
        let mut next_out = 0u64;
        // Fill and drain unevenly so the head wraps, then grow while wrapped.
        for round in 0..50u64 {
            for _ in 0..(round % 7) {
                r.push_back(wc(next_in));
                next_in += 1;
            }
            for _ in 0..(round % 5) {
                match r.pop_front() {
                    Some(w) => {
                        assert_eq!(w.wr_id, next_out);
                        next_out += 1;
                    }
                    None => assert_eq!(next_out, next_in),
                }
            }
            assert_eq!(r.len() as u64, next_in - next_out);
        }
        while let Some(w) = r.pop_front() {
            assert_eq!(w.wr_id, next_out);
            next_out += 1;
        }
        assert_eq!(next_out, next_in);
        assert!(r.pop_front().is_none());
    }

    #[test]
    fn a_drained_ring_starts_again_at_its_first_slot() {
        let mut r = CqRing::with_capacity(8);
        for id in 0..5 {
            r.push_back(Wc {
                wr_id: id,
                ..Wc::default()
            });
            // One in, one out (a latency loop): always the same, first slot.
            assert_eq!((r.head, r.len()), (0, 1));
            assert_eq!(r.pop_front().map(|w| w.wr_id), Some(id));
            assert_eq!(r.head, 0);
        }
        r.push_back(Wc::default());
        r.push_back(Wc::default());
        r.pop_front();
        assert_eq!((r.head, r.len()), (1, 1), "not drained: the head moves on");
    }
}
