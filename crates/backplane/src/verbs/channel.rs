//! Completion channels (`ibv_comp_channel`): an eventfd that becomes readable when an armed
//! completion queue (`Cq::req_notify`) gets a completion, for poll/epoll/select loops.
//!
//! Completions made by the application's own calls (a signaled RDMA_WRITE, a flush) signal the
//! channel directly. Completions that depend on peers (an arriving SEND, an acknowledgement, a
//! peer that dies, an RNR timer) are watched by one small thread per channel: it sleeps on the
//! context's bell — a futex word in the node's window that peers ring only while the channel
//! is armed (the armed-flag pattern of the rest of the fabric) — and on the doorbells of UD QPs
//! (several futexes at once with `futex_waitv`), wakes at RNR deadlines, and checks node
//! liveness at least every 100 ms. When something moved for an armed CQ it queues an event and
//! writes the eventfd. A thread waiting in `get_cq_event` does the watcher's looking itself and
//! sleeps on the same words, so a peer's ring wakes it directly. As with libibverbs, an event
//! means "poll this CQ": the completion may already have been taken by an earlier poll.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::types::VerbsError;
use crate::fabric::Fabric;
use crate::mem::Region;
use crate::mem::Word32;
use crate::sync::{fence, futex_wait, futex_wake, AtomicU32, Ordering};
use crate::wire::NodeState;

/// Longest sleep of the watcher: node liveness is checked at least this often.
const MAX_SLEEP: Duration = Duration::from_millis(100);

pub(crate) use crate::transport::Watch;

/// An armed completion queue.
#[derive(Debug, Clone)]
pub(crate) struct Armed {
    pub(crate) cq: u32,
    pub(crate) watch: Vec<Watch>,
    pub(crate) deadline: Option<Instant>,
    /// (slot, generation) of nodes whose death must wake the CQ.
    pub(crate) nodes: Vec<(u32, u32)>,
}

impl Armed {
    fn fires(&self, now: Instant, fabric: &Fabric) -> bool {
        let moved = self.watch.iter().any(|w| match w {
            Watch::Moved { word, seen } => word.load(Ordering::Acquire) != *seen,
            Watch::Flag(word) => word.load(Ordering::Acquire) != 0,
            Watch::Bell { word, seen } => word.load(Ordering::Acquire) != *seen,
        });
        moved
            || self.deadline.is_some_and(|d| d <= now)
            || self.nodes.iter().any(|&(slot, generation)| {
                !fabric
                    .node_info(slot)
                    .is_ok_and(|i| i.state == NodeState::Ready && i.generation == generation)
            })
    }
}

#[derive(Default)]
struct Inner {
    events: VecDeque<u32>,
    armed: Vec<Armed>,
    /// The eventfd's count is not zero (written since the last drain): a read of it now
    /// returns at once. The fd is blocking unless the program makes it non-blocking (as
    /// libibverbs' own), so a read must never find it at zero.
    signaled: bool,
}

/// State shared by a channel's owner, its CQs and its watcher thread.
pub(crate) struct ChannelShared {
    efd: OwnedFd,
    inner: Mutex<Inner>,
    armed_count: AtomicUsize,
    wake: AtomicU32,
    stop: AtomicBool,
    bell: Word32,
    bell_armed: Word32,
    _win: Arc<Region>,
    fabric: Fabric,
}

impl ChannelShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn post_events(&self, inner: &mut Inner, cqs: &[u32]) {
        inner.events.extend(cqs);
        self.armed_count.store(inner.armed.len(), Ordering::Relaxed);
        let one = 1u64.to_ne_bytes();
        // (A count below the eventfd's maximum never blocks the write.)
        inner.signaled |= rustix::io::write(&self.efd, &one).is_ok();
        // A thread asleep in `get_cq_event` sleeps on `wake`, not on the fd.
        self.wake.fetch_add(1, Ordering::Release);
        futex_wake(&self.wake);
    }

    /// One look at the armed CQs, by the watcher or by a thread waiting in
    /// [`CompChannel::get_cq_event`] (which then needs no wake-up from the watcher: one thread
    /// wake fewer per event, ~15-20 µs on a VM of few cores). Queues the events of the CQs
    /// whose watched words moved, whose deadline passed or whose nodes died; else sleeps
    /// until the bell, `wake` (read as `w` before the caller last looked) or a watched bell
    /// moves, a deadline comes or `until`. `armed`: a copy of what is armed, not empty.
    fn look(&self, armed: &[Armed], w: u32, until: Option<Instant>) {
        let b = self.bell.load(Ordering::Acquire);
        // Peers ring the context's bell only for what reaches RC/UC QPs (their rings, acks,
        // NAKs, a peer gone: `Moved`/`Flag` watches); a UD QP's arrival bumps its own doorbell
        // (`Bell`). A channel armed only for UD CQs — UCX's UD transport keeps its CQs armed
        // for its async thread — would otherwise be woken by every RC message to the context,
        // a futex wake and a context switch each (`ucx_perftest tag_lat` over `rc_verbs`).
        let needs_bell = armed
            .iter()
            .any(|a| a.watch.iter().any(|w| !matches!(w, Watch::Bell { .. })));
        self.bell_armed
            .store(u32::from(needs_bell), Ordering::Relaxed);
        // SYNC POINT qp-bell (sleeper): armed before we re-check what peers publish.
        fence(Ordering::SeqCst);
        if self.fire(armed) {
            return;
        }
        let sleep = sleep_for(armed, until);
        let mut words: Vec<(&AtomicU32, u32)> = vec![(&*self.bell, b), (&self.wake, w)];
        for a in armed {
            for x in &a.watch {
                if let Watch::Bell { word, seen } = x {
                    words.push((&**word, *seen));
                }
            }
        }
        wait_any(&words, sleep);
    }

    /// [`ChannelShared::look`] for a thread in `get_cq_event` of a process that carries pairs
    /// with other hosts: queues what fired, else sleeps on the pairs' own fds and this
    /// channel's fd (see `verbs::direct::sleep_on_pairs`); the watcher still watches the bell
    /// for peers on this host and queues their events. False if there are no pairs.
    fn look_pairs(&self, armed: &[Armed], until: Option<Instant>) -> bool {
        if self.fire(armed) {
            return true;
        }
        let sleep = sleep_for(armed, until);
        if !crate::verbs::direct::sleep_on_pairs(self.efd.as_fd(), sleep) {
            return false;
        }
        self.fire(armed);
        true
    }

    /// Queues the events of the armed CQs (`armed`, a copy) that fire now; true if any did.
    fn fire(&self, armed: &[Armed]) -> bool {
        let now = Instant::now();
        let fired: Vec<u32> = armed
            .iter()
            .filter(|a| a.fires(now, &self.fabric))
            .map(|a| a.cq)
            .collect();
        if fired.is_empty() {
            return false;
        }
        let mut g = self.lock();
        // (The other looker may have queued them first.)
        let fired: Vec<u32> = fired
            .into_iter()
            .filter(|&cq| g.armed.iter().any(|a| a.cq == cq))
            .collect();
        if !fired.is_empty() {
            g.armed.retain(|a| !fired.contains(&a.cq));
            self.post_events(&mut g, &fired);
        }
        true
    }

    /// Whether any CQ is armed (a relaxed look: `extend` decides).
    pub(crate) fn armed_any(&self) -> bool {
        self.armed_count.load(Ordering::Relaxed) != 0
    }

    /// If `cq` is armed (an event asked for and not yet delivered), adds what `more` watches
    /// to it — keeping what it watched already, so nothing that moved since it was armed is
    /// forgotten — and wakes the watcher. False if it is not armed.
    pub(crate) fn extend(&self, more: Armed) -> bool {
        if self.armed_count.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let mut g = self.lock();
        let Some(a) = g.armed.iter_mut().find(|a| a.cq == more.cq) else {
            return false;
        };
        // A word already watched keeps the value it was armed with (a poll loop that extends
        // again and again adds nothing).
        for w in more.watch {
            if !a.watch.iter().any(|x| same_word(x, &w)) {
                a.watch.push(w);
            }
        }
        a.deadline = match (a.deadline, more.deadline) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, y) => x.or(y),
        };
        for n in more.nodes {
            if !a.nodes.contains(&n) {
                a.nodes.push(n);
            }
        }
        drop(g);
        self.wake.fetch_add(1, Ordering::Release);
        futex_wake(&self.wake);
        true
    }

    /// A completion was added to `cq` by this process: fire its event if it is armed.
    pub(crate) fn completion_added(&self, cq: u32) {
        if self.armed_count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut g = self.lock();
        if let Some(i) = g.armed.iter().position(|a| a.cq == cq) {
            g.armed.swap_remove(i);
            self.post_events(&mut g, &[cq]);
        }
    }

    /// Arms `a.cq` (replacing an earlier arming) and wakes the watcher.
    pub(crate) fn arm(&self, a: Armed) {
        let mut g = self.lock();
        g.armed.retain(|x| x.cq != a.cq);
        g.armed.push(a);
        self.armed_count.store(g.armed.len(), Ordering::Relaxed);
        drop(g);
        self.wake.fetch_add(1, Ordering::Release);
        futex_wake(&self.wake);
    }

    /// Forgets `cq` (destroyed).
    pub(crate) fn forget(&self, cq: u32) {
        let mut g = self.lock();
        g.armed.retain(|x| x.cq != cq);
        g.events.retain(|&x| x != cq);
        self.armed_count.store(g.armed.len(), Ordering::Relaxed);
    }

    fn watcher(self: Arc<Self>) {
        loop {
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            let w = self.wake.load(Ordering::Acquire);
            let armed: Vec<Armed> = self.lock().armed.clone();
            if armed.is_empty() {
                // (Also after a `get_cq_event` armed the bell for an arming this thread never
                // saw: it fired before this thread looked.)
                self.bell_armed.store(0, Ordering::Relaxed);
                futex_wait(&self.wake, w, Some(MAX_SLEEP));
                continue;
            }
            self.look(&armed, w, None);
        }
        self.bell_armed.store(0, Ordering::Relaxed);
    }
}

/// How long a looker may sleep: until the first armed CQ's deadline or `until`, at most
/// [`MAX_SLEEP`].
fn sleep_for(armed: &[Armed], until: Option<Instant>) -> Duration {
    let now = Instant::now();
    armed
        .iter()
        .filter_map(|a| a.deadline)
        .chain(until)
        .min()
        .map_or(MAX_SLEEP, |d| {
            d.saturating_duration_since(now).min(MAX_SLEEP)
        })
}

/// Whether two watches look at the same word the same way.
fn same_word(a: &Watch, b: &Watch) -> bool {
    match (a, b) {
        (Watch::Moved { word: x, .. }, Watch::Moved { word: y, .. }) => std::ptr::eq(&**x, &**y),
        (Watch::Flag(x), Watch::Flag(y))
        | (Watch::Bell { word: x, .. }, Watch::Bell { word: y, .. }) => std::ptr::eq(&**x, &**y),
        _ => false,
    }
}

/// Sleeps until one of `words` no longer holds its value, a wake, or `timeout`.
fn wait_any(words: &[(&AtomicU32, u32)], timeout: Duration) {
    use rustix::thread::futex::{self, WaitFlags, WaitPtr, WaitvFlags};
    use rustix::time::{clock_gettime, ClockId, Timespec};
    let v: Vec<futex::Wait> = words
        .iter()
        .take(128)
        .map(|(w, val)| {
            let mut e = futex::Wait::new();
            e.val = u64::from(*val);
            e.uaddr = WaitPtr::new(w.as_ptr().cast());
            e.flags = WaitFlags::SIZE_U32;
            e
        })
        .collect();
    // futex_waitv takes an absolute deadline.
    let now = clock_gettime(ClockId::Monotonic);
    let ns = now.tv_nsec as u64 + u64::from(timeout.subsec_nanos());
    let until = Timespec {
        tv_sec: now.tv_sec + timeout.as_secs() as i64 + (ns / 1_000_000_000) as i64,
        tv_nsec: (ns % 1_000_000_000) as _,
    };
    // The words are borrowed for the whole call, so every address stays valid while the
    // kernel reads it. Other errors (EAGAIN: a word already changed, EINTR, ETIMEDOUT) mean
    // "go and re-check".
    let r = futex::waitv(&v, WaitvFlags::empty(), Some(&until), ClockId::Monotonic);
    if r == Err(rustix::io::Errno::NOSYS) {
        // Kernels before 5.16: sleep on the bell, briefly if there are other words to watch.
        let t = if words.len() > 2 {
            timeout.min(Duration::from_millis(1))
        } else {
            timeout
        };
        futex_wait(words[0].0, words[0].1, Some(t));
    }
}

/// A completion channel (`ibv_comp_channel`): its fd ([`AsFd`]) is readable when an event is
/// queued; [`CompChannel::get_cq_event`] takes one.
pub struct CompChannel {
    pub(crate) shared: Arc<ChannelShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for CompChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompChannel")
            .field("fd", &self.shared.efd.as_raw_fd())
            .finish()
    }
}

/// An event taken from a channel: which CQ it is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CqEvent {
    /// The CQ's id ([`super::Cq::id`]).
    pub cq_id: u32,
}

impl CompChannel {
    pub(crate) fn new(
        fabric: Fabric,
        win: Arc<Region>,
        event_off: u64,
    ) -> Result<Self, VerbsError> {
        use crate::wire::verbs::{EV_ARMED_OFF, EV_BELL_OFF};
        use rustix::event::{eventfd, EventfdFlags};
        // Blocking, as libibverbs' channel fd: a program that wants EAGAIN from
        // `ibv_get_cq_event` sets O_NONBLOCK itself (UCX does).
        let efd = eventfd(0, EventfdFlags::CLOEXEC).map_err(std::io::Error::from)?;
        let shared = Arc::new(ChannelShared {
            efd,
            inner: Mutex::new(Inner::default()),
            armed_count: AtomicUsize::new(0),
            wake: AtomicU32::new(0),
            stop: AtomicBool::new(false),
            bell: Word32::at(&win, event_off + EV_BELL_OFF as u64)?,
            bell_armed: Word32::at(&win, event_off + EV_ARMED_OFF as u64)?,
            _win: win,
            fabric,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("bp-comp-channel".into())
            .spawn(move || s.watcher())?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Takes the next event, waiting up to `timeout` (`None`: forever). `ibv_get_cq_event`.
    ///
    /// The waiting thread looks at what the armed CQs watch itself, as the watcher does, and
    /// sleeps on the same words: a peer's ring wakes it directly rather than through the
    /// watcher and the fd (`ibv_rc_pingpong -e` on one host: 72-90 -> 17-58 µs an iteration;
    /// between two hosts, where the pair's thread wakes first, 148-157 -> 105-157).
    pub fn get_cq_event(&self, timeout: Option<Duration>) -> Result<CqEvent, VerbsError> {
        let s = &self.shared;
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(e) = self.try_get_cq_event() {
                return Ok(e);
            }
            if deadline.is_some_and(|d| d <= Instant::now()) {
                return Err(VerbsError::TimedOut);
            }
            // (An event queued after this read bumps `wake`: the sleep below ends at once.)
            let w = s.wake.load(Ordering::Acquire);
            if let Some(e) = self.try_get_cq_event() {
                return Ok(e);
            }
            let armed: Vec<Armed> = s.lock().armed.clone();
            if armed.is_empty() {
                // Nothing armed here: an event comes from another thread of the program
                // (arming, a completion it made) or the watcher, each of which bumps `wake`.
                let left = deadline.map_or(MAX_SLEEP, |d| {
                    d.saturating_duration_since(Instant::now()).min(MAX_SLEEP)
                });
                futex_wait(&s.wake, w, Some(left));
            } else if !(crate::verbs::direct::carries_pairs() && s.look_pairs(&armed, deadline)) {
                s.look(&armed, w, deadline);
            }
        }
    }

    /// Takes the next event if one is queued.
    pub fn try_get_cq_event(&self) -> Option<CqEvent> {
        let mut g = self.shared.lock();
        let e = g.events.pop_front()?;
        if g.events.is_empty() && g.signaled {
            let mut b = [0u8; 8];
            // Drain (the fd is no longer readable); the count is not zero, so this returns.
            let _ = rustix::io::read(&self.shared.efd, &mut b);
            g.signaled = false;
        }
        Some(CqEvent { cq_id: e })
    }

    /// Acknowledges events (`ibv_ack_cq_events`); nothing to release here.
    pub fn ack_cq_events(&self, _n: u32) {}
}

impl AsFd for CompChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.shared.efd.as_fd()
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.fetch_add(1, Ordering::Release);
        futex_wake(&self.shared.wake);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiting_on_several_words_returns_when_any_moves_or_the_time_is_up() {
        let a = Arc::new(AtomicU32::new(0));
        let b = Arc::new(AtomicU32::new(0));
        let t0 = Instant::now();
        wait_any(&[(&a, 0), (&b, 0)], Duration::from_millis(20));
        assert!(
            t0.elapsed() >= Duration::from_millis(19),
            "slept until the timeout"
        );
        // A word that already moved returns at once; one moved by another thread wakes us.
        wait_any(&[(&a, 5), (&b, 0)], Duration::from_secs(30));
        let b2 = b.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            b2.store(1, Ordering::Release);
            futex_wake(&b2);
        });
        wait_any(&[(&a, 0), (&b, 0)], Duration::from_secs(30));
        assert_eq!(b.load(Ordering::Acquire), 1);
        h.join().unwrap();
    }
}
