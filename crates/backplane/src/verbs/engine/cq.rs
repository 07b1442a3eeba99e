//! Completion queues: the entries a context's CQs hold, and pushing into them.

use super::*;

// ---------------------------------------------------------------------------------------------
// Completion queues.
// ---------------------------------------------------------------------------------------------

pub(crate) struct CqState {
    pub(crate) entries: VecDeque<Wc>,
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

pub(super) fn cq_room(cqs: &Cqs, cq: usize) -> bool {
    cqs.get(cq)
        .and_then(|c| c.as_ref())
        .is_some_and(|c| c.entries.len() < c.cap)
}
