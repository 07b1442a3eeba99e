//! Queue pairs between hosts carried by their own two processes.
//!
//! Across hosts a QP connects to a *shadow* of its peer (`fabric::supervisor::mirror`): it
//! writes its ring bytes, reliability words and one-sided requests there as it would into a
//! local peer's block, and a mirror carries them to the other host, where they are written
//! into the real block. The supervisors' bridges used to run every mirror: sender, two bridge
//! threads and receiver each need a core for every message, which on a machine of few cores is
//! most of the latency. Here each process runs the mirror of its own QP: a QP created on a
//! fabric across hosts binds a datagram endpoint of its own (a direct one: its own UCX
//! worker, `dgram::direct`) and names its port in `CreateQp`; when both QPs of a pair have
//! one, the supervisors agree the pair is direct (`OpenQp`/`QpOpened`), their bridges' mirrors
//! of it only end it (peer gone, host lost), and each process ships what its QP wrote into the
//! shadow as datagrams to the other process's endpoint, which applies them to its QP's block.
//! One-sided requests are carried out by the process that owns the region, on its own mapping
//! of it, with the checks the bridge makes ([`Mirror::execute`]): the region must be of the
//! QP's protection domain and allow the access, and a deregistered one is refused.
//!
//! Who pumps (waking another thread costs more than the rest of a message on a machine of
//! few cores, so program threads do it whenever they are in the library): the thread that
//! posts (the engine rings the shadow's bell: [`DirectQp::kick`]), the thread that polls a
//! completion queue and finds it empty ([`progress_all`]), a thread that waits for a READ's
//! or an atomic's answer (`transport::across`), and a thread per pair for the rest ([`watch`]:
//! a program that waits on memory or on a completion channel, a peer whose program never
//! polls, acks to send back while nobody polls). That thread rests while program threads
//! poll or sleep in `ibv_get_cq_event` on the pairs' fds ([`sleep_on_pairs`]), and is called
//! back ([`app_arms_channel`], [`app_may_wait_for_write`]) when one may stop. The datagram
//! path keeps the messages in order and lossless, and tells a sender when the other endpoint
//! went (the pair breaks: the QP sees its peer gone).
#![forbid(unsafe_code)]

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use crate::dgram::{DgramError, Endpoint, Wait};
use crate::fabric::ctl::ErrorKind;
use crate::fabric::supervisor::mirror::{self, Mirror, QpBlock};
use crate::fabric::FabricError;
use crate::sync::Ordering;
use crate::transport::shm::{RegionMaps, ShmRegion};
use crate::transport::Addr;
use crate::wire::verbs::RDMA_REQ_HEAD;
use crate::wire::MAX_DGRAM;

/// Who may take a whole SEND out of a message before the mirror writes it into its QP's
/// ring: the local QP's key (node, QPN), the ring index and bytes (see
/// `QpEngine::deliver_ahead`, and [`progress_all`]); the bytes taken.
pub(crate) type Deliver<'a> = dyn FnMut((u32, u32), u64, &[u8]) -> usize + 'a;

/// SENDs this process's QPs took straight from the message that brought them (see
/// [`Deliver`]).
static DELIVERED: AtomicU64 = AtomicU64::new(0);

/// Counts a SEND delivered straight from its message.
pub(crate) fn delivered_one() {
    DELIVERED.fetch_add(1, Ordering::Relaxed);
}

/// How many SENDs from QPs on other hosts this process's QPs took straight from the message
/// that brought them into the posted receive, without the copy into their ring (for tests
/// and diagnostics).
pub fn sends_delivered_in_place() -> u64 {
    DELIVERED.load(Ordering::Relaxed)
}

/// A [`Deliver`] that takes nothing (a pump outside the QP's context).
fn no_delivery(_: (u32, u32), _: u64, _: &[u8]) -> usize {
    0
}

/// A mirror message (ring bytes and words).
const KIND_QP: u8 = 1;
/// A one-sided request of the sender's QP.
const KIND_RDMA: u8 = 2;
/// The answer to one.
const KIND_ANSWER: u8 = 3;
/// How long the pair's thread, or a program thread asleep on the pairs
/// ([`sleep_on_pairs`]), sleeps at most between looks: a safety net, as the completion
/// channel's own longest sleep. What comes wakes them (the worker's fd, and the endpoint's
/// eventfd for arrivals another thread's look took off the wire: the endpoint's waker, a
/// send that made room), the pair's end too (its `rest_bell`).
/// (It was 1 ms, for those arrivals: an idle program waiting for completion events across
/// hosts woke ~1 100 times a second.)
const NAP: Duration = Duration::from_millis(100);
/// How long a thread asleep on the pairs' fds ([`sleep_on_pairs`]) sleeps at most while a
/// pair is busy elsewhere or has acks waiting to go.
const SHORT_LOOK: Duration = Duration::from_micros(30);
/// How long after a program thread last pumped a pair its own thread takes over.
const APP_ACTIVE_NS: u64 = 200_000;
/// How long after a program's last poll its posts count as the program at work
/// ([`DirectQp::kick`]).
const POSTER_POLLED_NS: u64 = 5_000_000;
/// How often the pair's thread looks whether the program still polls.
const APP_CHECK: Duration = Duration::from_millis(5);
/// How long the pair's thread pauses when UCX is busy but nothing came or went.
const BUSY_NAP: Duration = Duration::from_micros(20);
/// How long the pair's thread keeps looking after it carried something, before it sleeps:
/// a peer that posts READs or atomics one after another sends the next within a round trip
/// of the last answer (`ib_atomic_lat` with its server not polling: 31 -> 12 us typical;
/// `ib_read_lat` 29 -> 12; `ib_atomic_bw` twice the rate; the perf tests, whose peers poll,
/// unchanged in a same-run A/B).
const PAIR_LINGER_NS: u64 = 30_000;
/// How long a pair waits for room in a window for its route before it breaks (freed memory
/// is reusable after 1 s).
const NO_ROOM_PATIENCE_NS: u64 = 3_000_000_000;
/// How long acks and credits alone wait for a message to go with.
const WORDS_LINGER_NS: u64 = 30_000;
/// How long the answers to RDMA WRITEs (acks, as in RC) wait for a message to go with while
/// a program thread pumps: a peer that answers a WRITE with its own (`ib_write_lat`) sends
/// both in one message (over TCP one system call and one segment each way, not two).
const ANSWER_LINGER_NS: u64 = 10_000;

/// Whether RC QPs of this process carry their pairs across hosts themselves: the default
/// (session 21); `BACKPLANE_DIRECT_QP=0` leaves them to the bridges, as `BACKPLANE_DIRECT=0`
/// leaves everything.
pub(crate) fn wanted() -> bool {
    std::env::var_os("BACKPLANE_DIRECT_QP").is_none_or(|v| v != "0")
        && std::env::var_os("BACKPLANE_DIRECT").is_none_or(|v| v != "0")
}

/// The regions of this process that allow remote access, by rkey: what a direct pair's
/// requests are carried out on.
struct OwnMr {
    pd: u32,
    region: RegionMaps,
    len: u64,
    access: u32,
}

static OWN_MRS: Mutex<Vec<(u32, OwnMr)>> = Mutex::new(Vec::new());

fn own_mrs() -> MutexGuard<'static, Vec<(u32, OwnMr)>> {
    OWN_MRS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Region `rkey` (of protection domain `pd`, `len` bytes) was registered here.
pub(crate) fn region_registered(rkey: u32, pd: u32, region: RegionMaps, len: u64, access: u32) {
    let mut m = own_mrs();
    m.retain(|(k, _)| *k != rkey);
    m.push((
        rkey,
        OwnMr {
            pd,
            region,
            len,
            access,
        },
    ));
}

/// Region `rkey` was deregistered.
pub(crate) fn region_gone(rkey: u32) {
    own_mrs().retain(|(k, _)| *k != rkey);
}

/// Region `rkey` if it is this process's and of protection domain `pd`.
fn own_region(rkey: u32, pd: u32) -> Option<Arc<ShmRegion>> {
    let m = own_mrs();
    let (_, r) = m.iter().find(|(k, r)| *k == rkey && r.pd == pd)?;
    ShmRegion::from_region(r.region.clone(), r.len, r.access).map(Arc::new)
}

/// A QP's endpoint, bound when the QP is made (so that a peer's first messages wait there
/// for the pair, whichever side connects first).
pub(crate) struct Home {
    ep: Arc<Mutex<Endpoint>>,
    port: u32,
    pd: u32,
}

impl std::fmt::Debug for Home {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Home").field("port", &self.port).finish()
    }
}

impl Home {
    /// An endpoint for a QP of protection domain `pd` on `node`, if the node's fabric spans
    /// hosts and the endpoint got a worker of its own (otherwise the bridges carry the QP).
    pub(crate) fn open(node: &crate::fabric::Node, pd: u32) -> Option<Self> {
        let ep = node.bind(0).ok().filter(|e| e.is_direct())?;
        let port = ep.local_addr().port;
        Some(Self {
            ep: Arc::new(Mutex::new(ep)),
            port,
            pd,
        })
    }

    /// The endpoint's port, named in `CreateQp`.
    pub(crate) fn port(&self) -> u32 {
        self.port
    }
}

struct Inner {
    m: Mirror,
    peer: Addr,
    /// When acks or credits alone were first seen waiting (monotonic ns).
    words_since: Option<u64>,
    /// When answers that may wait were first held back (monotonic ns).
    answers_since: Option<u64>,
    /// The pump under way is a program thread's, which polls and may post soon.
    by_app: bool,
    /// Since when the datagram path has found no room for the pair's route (monotonic ns).
    no_room_since: Option<u64>,
    /// What the datagram path said when the pair broke, for the one line on stderr.
    detail: Option<String>,
    /// That line was written.
    said: bool,
    /// The data of the local QP's large RDMA WRITEs and SENDs, sent from its regions in place
    /// (`transport::across::carried_here`).
    elsewhere: Arc<crate::transport::across::Carried>,
    /// The head and trailer of the message that sends a SEND's payload in place (kept: one a
    /// message otherwise).
    in_place_buf: (Vec<u8>, Vec<u8>),
}

struct Shared {
    inner: Mutex<Inner>,
    /// The pair's datagram endpoint (its QP's `Home`'s), locked after `inner`. (Here, not
    /// in `Inner`: a pump under `inner`'s lock borrows it instead of cloning the `Arc` — two
    /// atomic read-modify-writes a post and a poll less.)
    ep: Arc<Mutex<Endpoint>>,
    stop: AtomicBool,
    /// When a program thread last pumped the pair (monotonic ns): while programs poll, the
    /// pair's own thread stays out of their way.
    app_ns: AtomicU64,
    /// When a program thread last polled a completion queue (monotonic ns; 0: it went
    /// elsewhere since): a post this soon after counts as the program at work too
    /// ([`DirectQp::kick`]).
    polled_ns: AtomicU64,
    /// The pair's thread rests because programs poll (on `rest_bell`, written by
    /// [`app_went_elsewhere`]: a program may now wait on memory or a channel).
    resting: AtomicBool,
    rest_bell: Option<OwnedFd>,
}

/// One direct pair: the mirror of a local QP and its peer's shadow, run by this process.
pub(crate) struct DirectQp {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for DirectQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectQp").finish_non_exhaustive()
    }
}

/// Every live pair of this process, for [`progress_all`].
static LIVE: Mutex<Vec<Weak<Shared>>> = Mutex::new(Vec::new());
/// How many pairs [`LIVE`] holds: read on every empty CQ poll of every program, so on a
/// cache line of its own (nothing written near it may pull the line away).
#[repr(align(128))]
struct Count(AtomicUsize);
static LIVE_COUNT: Count = Count(AtomicUsize::new(0));

impl DirectQp {
    /// Starts the pair of local QP `local_key` (block `local`) with the shadow `shadow` of its
    /// peer `remote_key`, whose process listens at `peer`; `in_place`: its large RDMA WRITEs
    /// go from the program's regions in place (`transport::across::carried_here`).
    pub(crate) fn start(
        home: &Home,
        (local_key, remote_key): ((u32, u32), (u32, u32)),
        local: &QpBlock,
        shadow: &QpBlock,
        peer: Addr,
        in_place: bool,
    ) -> Result<Self, crate::mem::MemError> {
        let mut m = Mirror::new(0, local_key, remote_key, local, shadow)?;
        // The peer's endpoint exists since its QP was made: what goes now waits there.
        m.ready = true;
        let pd = home.pd;
        m.lookup = Some(Box::new(move |rkey| own_region(rkey, pd)));
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                m,
                peer,
                words_since: None,
                answers_since: None,
                by_app: false,
                no_room_since: None,
                detail: None,
                said: false,
                elsewhere: if in_place {
                    crate::transport::across::carried_here(remote_key)
                } else {
                    Arc::default()
                },
                in_place_buf: Default::default(),
            }),
            ep: home.ep.clone(),
            stop: AtomicBool::new(false),
            app_ns: AtomicU64::new(0),
            polled_ns: AtomicU64::new(0),
            resting: AtomicBool::new(false),
            rest_bell: rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )
            .ok(),
        });
        {
            let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
            live.retain(|w| w.strong_count() > 0);
            live.push(Arc::downgrade(&shared));
            LIVE_COUNT.0.store(live.len(), Ordering::Relaxed);
            LIVE_GEN.fetch_add(1, Ordering::Release);
        }
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("bp-qp-direct".into())
            .spawn(move || watch(&s))
            .ok();
        Ok(Self { shared, thread })
    }

    /// The local QP wrote into the shadow: ship it now (after a pump another thread has in
    /// progress).
    #[inline]
    pub(crate) fn kick(&self) {
        // Waits for a pump in progress elsewhere (it may be past its shipping), so nothing
        // posted waits for a later look.
        //
        // Posting alone says nothing of whether the program will poll (one that waits on
        // memory for a peer's RDMA WRITE needs the pair's thread to take what comes), but a
        // program that polls now and then and posts in between — a stream's sender, which
        // polls only when its send queue is full, milliseconds apart — is at work while it
        // posts: its posts keep the pair's thread resting as its polls do, for as long as it
        // polled within [`POSTER_POLLED_NS`]. Otherwise the pair's thread took the program
        // for gone 200 µs after its last poll and pumped beside it, the two taking turns on
        // the pair's lock (`perf send-bw` 64 KiB between hosts: the pair's thread at 5-10 %
        // of a CPU in its slow runs). A program that posts and then waits on memory without
        // polling again has the pair's thread back that long after its last poll at most
        // (one whose wait the library sees, `app_may_wait_for_write`, at once as before).
        // (The clock is read only for a program that polled at all.)
        let s = &self.shared;
        let polled = s.polled_ns.load(Ordering::Relaxed);
        if polled != 0 {
            let now = crate::sync::fast_ns();
            if now.saturating_sub(polled) < POSTER_POLLED_NS {
                s.app_ns.store(now, Ordering::Relaxed);
            }
        }
        let mut g = s.lock();
        let mut ep = s.ep.lock().unwrap_or_else(|e| e.into_inner());
        g.ship(&mut ep);
    }
}

impl Drop for DirectQp {
    fn drop(&mut self) {
        // The QP's last words (its final acks, gone) go before the pair ends; the peer may be
        // gone already, which is no news worth a line now.
        {
            let mut g = self.shared.lock();
            g.said = true;
            g.pump(&self.shared.ep);
        }
        // (The thread looks at `stop` at least every NAP, and when its bell rings.)
        self.shared.stop.store(true, Ordering::Release);
        if let Some(fd) = &self.shared.rest_bell {
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        {
            let g = self.shared.lock();
            crate::transport::across::carried_no_more(g.m.remote_key, &g.elsewhere);
        }
        let me = Arc::downgrade(&self.shared);
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|w| w.strong_count() > 0 && !Weak::ptr_eq(w, &me));
        LIVE_COUNT.0.store(live.len(), Ordering::Relaxed);
        LIVE_GEN.fetch_add(1, Ordering::Release);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A program thread pumps (unless another thread is at it); if it polls a completion
    /// queue (`polling`: the time), it will again, so the pair's thread stays out of its way
    /// for a while.
    #[inline]
    fn pumped_by_app(&self, polling: Option<u64>, deliver: &mut Deliver<'_>) {
        if let Some(now) = polling {
            self.app_ns.store(now, Ordering::Relaxed);
            self.polled_ns.store(now, Ordering::Relaxed);
        }
        if let Ok(mut g) = self.inner.try_lock() {
            g.by_app = polling.is_some();
            g.pump_with(&self.ep, deliver);
            g.by_app = false;
        }
    }
}

/// Whether this process carries any pair (one load; false on a fabric on one host).
#[inline(always)]
pub(crate) fn carries_pairs() -> bool {
    LIVE_COUNT.0.load(Ordering::Relaxed) != 0
}

/// Moves every direct pair of this process along (a completion queue was found empty);
/// `polling`: the program polls in a loop (the pairs' threads stay out of its way).
///
/// `deliver`: the caller's engine, which may take a whole SEND for one of its QPs straight
/// from the message that brought it (`QpEngine::deliver_ahead`; pairs of QPs it does not
/// hold take nothing there).
#[inline(always)]
pub(crate) fn progress_all(polling: bool, deliver: &mut Deliver<'_>) {
    if LIVE_COUNT.0.load(Ordering::Relaxed) != 0 {
        progress_live(polling, deliver);
    }
}

/// A program thread polled a completion queue and found completions there (no pump: it
/// will poll again, and an empty poll pumps): the pairs' threads stay out of its way. A
/// stream's sender that found completions on most polls went 200 µs without an empty one
/// often enough that its pair's thread switched in ~5 500 times a second beside it (a sixth
/// of a core, and the runnable threads of both programs waited for a CPU).
#[inline(always)]
pub(crate) fn app_polled() {
    if LIVE_COUNT.0.load(Ordering::Relaxed) != 0 {
        stamp_live();
    }
}

#[cold]
#[inline(never)]
fn stamp_live() {
    for_my_pairs(|pairs| {
        let now = crate::sync::fast_ns();
        for s in pairs.iter().filter_map(Weak::upgrade) {
            s.app_ns.store(now, Ordering::Relaxed);
            s.polled_ns.store(now, Ordering::Relaxed);
        }
    });
}

/// A program thread arms a completion channel: it may sleep on the channel next, so the pairs'
/// threads look after the pairs again until it polls an empty queue — unless a thread
/// of the program slept in `ibv_get_cq_event` on the pairs a moment ago (it will again, and
/// takes what comes itself: waking the pairs' threads now would only have one of them wake
/// for the next arrival too).
#[inline(always)]
pub(crate) fn app_arms_channel() {
    if LIVE_COUNT.0.load(Ordering::Relaxed) != 0
        && crate::sync::fast_ns().saturating_sub(WAITED_NS.load(Ordering::Relaxed)) >= APP_ACTIVE_NS
    {
        app_went_elsewhere();
    }
}

/// For a thread about to sleep in `ibv_get_cq_event` on a process that carries pairs: moves
/// every pair along, then sleeps until one of the pairs' UCX workers has news, `efd` (the
/// channel's eventfd: an event was queued, by this process or by the channel's watcher for a
/// peer on this host) is readable, or `timeout`. False if the process carries no pair (the
/// caller sleeps as before). Without this, an arrival from another host woke the pair's thread,
/// which then woke the program (`ibv_rc_pingpong -e` between two hosts: two thread wake-ups
/// each way, ~25-35 µs each on a VM of two cores).
pub(crate) fn sleep_on_pairs(efd: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> bool {
    if LIVE_COUNT.0.load(Ordering::Relaxed) == 0 {
        return false;
    }
    let pairs: Vec<Arc<Shared>> = match LIVE.try_lock() {
        Ok(l) => l.iter().filter_map(Weak::upgrade).collect(),
        Err(_) => return true, // (changing: look again)
    };
    // SYNC POINT pair-rest (app side): counted before the pairs are looked at, so a pair's
    // thread that goes to rest after this look sees it (and one already asleep on its fd
    // takes what comes as before: it is not told, and both wake).
    WAITERS.0.fetch_add(1, Ordering::SeqCst);
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            WAITED_NS.store(crate::sync::fast_ns(), Ordering::Relaxed);
            WAITERS.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let _leave = Leave;
    let mut fds = Vec::with_capacity(pairs.len());
    // (At most a NAP, as the pairs' threads: the endpoint's waker may take an arrival off the
    // wire, and the fd then says nothing of it.)
    let mut timeout = timeout.min(NAP);
    for s in &pairs {
        let Ok(mut g) = s.inner.try_lock() else {
            // Another thread pumps it: what it takes rings the channel, but what comes after
            // it nobody may watch (its thread may rest now): look again soon.
            timeout = timeout.min(SHORT_LOOK);
            continue;
        };
        if g.pump(&s.ep) {
            return true; // its CQs may have completions now
        }
        if g.m.pending() {
            // Acks or credits wait for a message to go with (they go after a while), or UCX
            // could not take what the QP has for the peer yet (its fd may not say when it
            // can: a connection still coming up).
            timeout = timeout.min(SHORT_LOOK);
        }
        let fd = s.ep.lock().unwrap_or_else(|e| e.into_inner()).arm_fd();
        match fd {
            Some(two) => fds.push(two),
            None => return true, // news already: no sleep
        }
    }
    let mut polled: Vec<rustix::event::PollFd<'_>> = fds
        .iter()
        .flat_map(|(fd, took)| [fd, &**took])
        .map(|fd| rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN))
        .collect();
    polled.push(rustix::event::PollFd::from_borrowed_fd(
        efd,
        rustix::event::PollFlags::IN,
    ));
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    let _ = rustix::event::poll(&mut polled, Some(&ts));
    // (Each pair's two fds in order, the channel's last.)
    let rang: Vec<bool> = polled.iter().map(|p| !p.revents().is_empty()).collect();
    drop(polled);
    for (i, (_, took)) in fds.iter().enumerate() {
        if rang[2 * i + 1] {
            crate::dgram::drain_took(took);
        }
    }
    // Take what came now, before anyone else looks.
    for s in &pairs {
        s.pumped_by_app(None, &mut no_delivery);
    }
    true
}

/// A program thread's RDMA WRITE completed and it waited for it: it may poll memory next for
/// the peer's WRITE (`ib_write_lat`). When a peer's WRITE landed here since this thread last
/// posted, the peer answered in kind (its WRITE carries the ack of ours): what the program
/// looks for is most likely there already, and waking the pairs' threads for every round
/// trip cost `ib_write_lat` most of its time on a machine of few cores (29 -> 5 us typical).
/// Otherwise they take over now (the peer's WRITE may come later, with no program thread
/// to take it).
#[inline(always)]
pub(crate) fn app_may_wait_for_write() {
    if LIVE_COUNT.0.load(Ordering::Relaxed) != 0 {
        let posted_at = POSTED_AT.with(std::cell::Cell::get);
        if posted_at == usize::MAX || posted_at == PEER_WRITES.0.load(Ordering::Relaxed) {
            app_went_elsewhere();
        }
    }
}

/// This thread posts to a queue pair (see [`app_may_wait_for_write`]).
#[inline(always)]
pub(crate) fn posting() {
    if LIVE_COUNT.0.load(Ordering::Relaxed) != 0 {
        POSTED_AT.with(|p| p.set(PEER_WRITES.0.load(Ordering::Relaxed)));
    }
}

/// Program threads asleep in `ibv_get_cq_event` on the pairs' own wake-up fds
/// ([`sleep_on_pairs`]): while any is, the pairs' threads rest (one wake-up per arrival).
static WAITERS: Count = Count(AtomicUsize::new(0));
/// When a program thread last left such a sleep (CLOCK_MONOTONIC ns): one that arms its
/// channel again soon after will sleep there again, so arming does not wake the pairs' threads.
static WAITED_NS: AtomicU64 = AtomicU64::new(0);

/// RDMA WRITEs of peers that landed in this process's regions (wrapping).
static PEER_WRITES: Count = Count(AtomicUsize::new(0));

thread_local! {
    /// [`PEER_WRITES`] when this thread last posted to a direct pair (`usize::MAX`: never,
    /// which always wakes the pairs' threads).
    static POSTED_AT: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

#[cold]
#[inline(never)]
fn app_went_elsewhere() {
    let Ok(live) = LIVE.try_lock() else {
        return;
    };
    for s in live.iter().filter_map(Weak::upgrade) {
        // SYNC POINT pair-rest (app side): the stamp is cleared before `resting` is read.
        s.polled_ns.store(0, Ordering::Relaxed);
        s.app_ns.store(0, Ordering::SeqCst);
        if s.resting.swap(false, Ordering::SeqCst) {
            if let Some(fd) = &s.rest_bell {
                let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
            }
        }
    }
}

/// Bumped whenever [`LIVE`] changes: a thread's copy of it ([`MY_PAIRS`]) is then taken again.
static LIVE_GEN: AtomicUsize = AtomicUsize::new(0);

/// A polling thread's copy of [`LIVE`] (as of [`LIVE_GEN`] `gen`): the poll loop takes no
/// lock and allocates nothing. (Its clock reading is not shared between looks: a program that
/// posts a stream and polls now and then left stamps milliseconds old, and the pairs'
/// threads, taking the program for gone, pumped beside it — contending for the pair's lock.)
struct MyPairs {
    gen: usize,
    pairs: Vec<Weak<Shared>>,
}

thread_local! {
    static MY_PAIRS: std::cell::RefCell<MyPairs> = const {
        std::cell::RefCell::new(MyPairs {
            gen: usize::MAX,
            pairs: Vec::new(),
        })
    };
}

#[cold]
#[inline(never)]
fn progress_live(polling: bool, deliver: &mut Deliver<'_>) {
    for_my_pairs(|pairs| {
        // (The stamps are compared with `fast_ns` readings only: `clock_gettime` here was
        // one vDSO call a turn of the program's poll loop.)
        let stamp = polling.then(crate::sync::fast_ns);
        for s in pairs.iter().filter_map(Weak::upgrade) {
            s.pumped_by_app(stamp, deliver);
        }
    });
}

/// Runs `f` on this thread's copy of [`LIVE`] (taken again when it changed); not at all if
/// this thread is inside a pump already (which called back here) or [`LIVE`] is changing.
#[inline(always)]
fn for_my_pairs(f: impl FnOnce(&[Weak<Shared>])) {
    let gen = LIVE_GEN.load(Ordering::Acquire);
    MY_PAIRS.with(|c| {
        let Ok(mut c) = c.try_borrow_mut() else {
            return;
        };
        if c.gen != gen {
            let Ok(live) = LIVE.try_lock() else {
                return; // (changing: look again next time)
            };
            c.pairs.clone_from(&live);
            c.gen = gen;
        }
        f(&c.pairs);
    });
}

/// The pair's own thread: pumps whenever UCX has news for the pair's endpoint (it sleeps on
/// the endpoint's worker itself: one wake-up per arrival), while acks or credits wait to
/// go, and every [`NAP`] regardless; what the local QP posts is shipped by the posting
/// thread ([`DirectQp::kick`]).
fn watch(s: &Shared) {
    while !s.stop.load(Ordering::Acquire) {
        // A program thread polled a moment ago: it will again (waking here for every
        // message would take its core); look again when it may have stopped.
        let quiet = crate::sync::fast_ns().saturating_sub(s.app_ns.load(Ordering::Relaxed));
        if quiet < APP_ACTIVE_NS || WAITERS.0.load(Ordering::SeqCst) != 0 {
            // (Not a short timer in a loop: thousands of wake-ups a second from these
            // starved the machine's timer and softirq work — the nodes' agents overslept a
            // 100 ms sleep by a second and were declared hung.) A poll that takes
            // completions ends the rest early.
            // SYNC POINT pair-rest (pair side): `resting` is set before the stamp is read
            // again, so a program's `app_went_elsewhere` either sees it or is seen here.
            s.resting.store(true, Ordering::SeqCst);
            let stamp = s.app_ns.load(Ordering::SeqCst);
            let waiter = WAITERS.0.load(Ordering::SeqCst) != 0;
            match &s.rest_bell {
                Some(fd)
                    if waiter || crate::sync::fast_ns().saturating_sub(stamp) < APP_ACTIVE_NS =>
                {
                    let ts = rustix::time::Timespec {
                        tv_sec: 0,
                        tv_nsec: APP_CHECK.as_nanos() as i64,
                    };
                    let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
                    let _ = rustix::event::poll(&mut fds, Some(&ts));
                    let mut b = [0u8; 8];
                    let _ = rustix::io::read(fd, &mut b);
                }
                Some(_) => {}
                None => std::thread::sleep(APP_CHECK),
            }
            s.resting.store(false, Ordering::SeqCst);
            continue;
        }
        let mut g = s.lock();
        let worked = g.pump(&s.ep);
        if worked {
            // A request often follows its answer within a round trip (a program that posts
            // READs or atomics one after another, its peer's program never polling): look
            // for it a while before going to sleep, with the pair unlocked for the programs.
            drop(g);
            let mut last = crate::sync::fast_ns();
            loop {
                // (A few PAUSEs: 64 of them took ~3 us here and delayed every look by half
                // that: atomic-lat 1.31 -> 1.24x `ucp_fadd`.)
                for _ in 0..4 {
                    std::hint::spin_loop();
                }
                let now = crate::sync::fast_ns();
                if s.stop.load(Ordering::Acquire)
                    || now.saturating_sub(last) > PAIR_LINGER_NS
                    || now.saturating_sub(s.app_ns.load(Ordering::Relaxed)) < APP_ACTIVE_NS
                {
                    break;
                }
                if let Ok(mut g) = s.inner.try_lock() {
                    if g.pump(&s.ep) {
                        last = crate::sync::fast_ns();
                    }
                }
            }
            g = s.lock();
        }
        let lingering = g.words_since.is_some() || g.answers_since.is_some();
        let fd = s.ep.lock().unwrap_or_else(|e| e.into_inner()).arm_fd();
        // News the worker could not take yet (UCX busy): not worth a sleep on its fd.
        let stuck = !lingering && g.m.pending();
        drop(g);
        match fd {
            Some((fd, took)) if !stuck && !s.stop.load(Ordering::Acquire) => {
                let nap = if lingering {
                    Duration::from_nanos(WORDS_LINGER_NS)
                } else {
                    NAP
                };
                let ts = rustix::time::Timespec {
                    tv_sec: nap.as_secs() as i64,
                    tv_nsec: i64::from(nap.subsec_nanos()),
                };
                let mut fds: Vec<_> = [Some(&fd), Some(&*took), s.rest_bell.as_ref()]
                    .into_iter()
                    .flatten()
                    .map(|fd| rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN))
                    .collect();
                let _ = rustix::event::poll(&mut fds, Some(&ts));
                let rang: Vec<bool> = fds.iter().map(|p| !p.revents().is_empty()).collect();
                drop(fds);
                if rang[1] {
                    crate::dgram::drain_took(&took);
                }
                if let (Some(bell), Some(true)) = (&s.rest_bell, rang.get(2)) {
                    let mut b = [0u8; 8];
                    let _ = rustix::io::read(bell, &mut b);
                }
            }
            _ if !worked => {
                // UCX not ready to sleep on (sends still on their way) and nothing came or
                // went: not a spin that takes a core from the programs and the nodes' agents.
                std::thread::sleep(BUSY_NAP);
            }
            _ => {}
        }
    }
}

impl Inner {
    /// Ships what the local QP wrote and takes what came, until neither has anything; true if
    /// anything went or came.
    fn pump(&mut self, ep: &Mutex<Endpoint>) -> bool {
        self.pump_with(ep, &mut no_delivery)
    }

    /// [`Inner::pump`], offering whole SENDs that come to `deliver` (see [`progress_all`]).
    fn pump_with(&mut self, ep: &Mutex<Endpoint>, deliver: &mut Deliver<'_>) -> bool {
        let mut ep = ep.lock().unwrap_or_else(|e| e.into_inner());
        let mut worked = false;
        for round in 0..64 {
            let shipped = self.ship(&mut ep);
            // The network is looked at once a pump (over TCP a system call, which found
            // nothing more after an arrival nearly always: ~0.4 us each on the way from a
            // message to its completion); later rounds take what that look brought.
            let took = self.take(&mut ep, round == 0, deliver);
            worked |= shipped || took;
            // Another round if something went (more may go, and sending may have taken
            // messages off the wire) or what came asks for answers. Not for what came alone:
            // `take` read every message there was, and applying them gave the local QP work,
            // not the mirror (its engine runs after this; what it writes then is shipped by
            // the next pump or the next post) — a round for nothing cost ~0.1 µs on the way
            // from a message to its completion.
            if !(shipped || (took && !self.m.answers.is_empty())) || self.m.broken.is_some() {
                break;
            }
        }
        drop(ep);
        if self.m.broken.is_none() && !self.said && self.m.peer_gone() {
            // The peer ended the pair itself (its QP destroyed): nothing to say when the
            // datagram path refuses what follows.
            self.said = true;
        }
        if let (Some(why), false) = (self.m.broken, self.said) {
            self.said = true;
            let (me, peer) = (self.m.local_key, self.m.remote_key);
            eprintln!(
                "backplane: QP {:#x} of node {}: the pair with QP {:#x} of node {} on another \
                 host ended: {why}{}",
                me.1,
                me.0,
                peer.1,
                peer.0,
                self.detail
                    .take()
                    .map_or(String::new(), |d| format!(" ({d})"))
            );
        }
        worked
    }

    /// Sends one datagram of kind `kind` and at most `max` bytes made by `fill` (its length,
    /// or `None`): true if it went; the pair breaks if the datagram path refuses it (the
    /// peer's endpoint, its node or its host gone). (A tight `max` lets a small one share a
    /// message with others: see [`Inner::ship`].)
    fn send(
        m: &mut Mirror,
        (detail, no_room): (&mut Option<String>, &mut Option<u64>),
        ep: &mut Endpoint,
        (peer, kind, max): (Addr, u8, usize),
        fill: impl FnOnce(&mut Mirror, &mut [u8]) -> Option<usize>,
    ) -> bool {
        let max = max.saturating_add(1).min(MAX_DGRAM);
        let r = ep.send_with_max(peer, max, Wait::Never, |buf| {
            buf[0] = kind;
            fill(m, &mut buf[1..]).map(|n| n + 1)
        });
        Self::outcome(m, (detail, no_room), r)
    }

    /// What a send's result `r` means for the pair: true if it went; the pair breaks if the
    /// datagram path refused it for good.
    fn outcome(
        m: &mut Mirror,
        (detail, no_room): (&mut Option<String>, &mut Option<u64>),
        r: Result<bool, DgramError>,
    ) -> bool {
        match r {
            Ok(sent) => {
                *no_room = None;
                sent
            }
            Err(DgramError::WouldBlock) => false,
            // The route's ring found no room in a window: memory a program that just ended
            // freed is reusable a second later (perftest's next program between the same
            // nodes met it). The pair waits for it a while; then it breaks with that line.
            Err(DgramError::Fabric(FabricError::Refused {
                kind: ErrorKind::NoSpace,
                ..
            })) if crate::sync::fast_ns()
                .saturating_sub(*no_room.get_or_insert_with(crate::sync::now_ns))
                < NO_ROOM_PATIENCE_NS =>
            {
                false
            }
            Err(e) => {
                *detail = Some(e.to_string());
                m.fail("the peer QP's process cannot be reached");
                false
            }
        }
    }

    /// Sends what the local QP has for the peer: answers, requests, ring bytes and words,
    /// in one message where they fit (one system call and segment each way over TCP:
    /// `write-lat` 3 segments each way a round trip before).
    fn ship(&mut self, ep: &mut Endpoint) -> bool {
        if self.m.answers.is_empty() && !self.m.pending() {
            // Nothing to say (most looks of a program's poll loop): no cork, no worker lock.
            self.answers_since = None;
            self.words_since = None;
            return false;
        }
        // The cork makes answers and requests share one message with the ring bytes after
        // them. One datagram alone — ring bytes and words (more than one only when they fill
        // one, which no batch would join), or one answer or one request with nothing after
        // it — goes at once, written in place into the message UCX sends, not into a batch
        // that is copied there at the uncork. From a program's post to UCX's `sendmsg` in
        // `perf send-lat` between hosts: ~1 300 -> ~650 cycles. (A second request found
        // after the first corks the rest: see `ship_corked`.)
        let lone = match (self.m.answers.len(), self.m.request_waits()) {
            (0, false) => true,
            (1, false) | (0, true) => !self.m.has_news(),
            _ => false,
        };
        if lone {
            ep.alone(true);
            let mut alone = true;
            let any = self.ship_corked(ep, &mut alone);
            ep.alone(false);
            if !alone {
                ep.uncork();
            }
            return any;
        }
        ep.cork();
        let any = self.ship_corked(ep, &mut false);
        ep.uncork();
        any
    }

    /// [`Inner::ship`]'s sends, corked or (`alone`) each at once; a second request found
    /// while alone corks what follows it (`alone` is then false: the caller uncorks).
    fn ship_corked(&mut self, ep: &mut Endpoint, alone: &mut bool) -> bool {
        let Inner {
            m,
            peer,
            words_since,
            answers_since,
            by_app,
            detail,
            no_room_since,
            elsewhere,
            in_place_buf,
            ..
        } = self;
        let peer = *peer;
        let mut any = false;
        // Answers the other side waits for, in order. Those that are acks (WRITEs that
        // landed) wait for a message to go with while a program pumps, which may post one.
        let hold = *by_app
            && !m.answers.is_empty()
            && !m.request_waits()
            && !m.has_urgent_news()
            && m.answers.iter().all(|a| mirror::answer_is_write_ack(a))
            && {
                let now = crate::sync::fast_ns();
                now.saturating_sub(*answers_since.get_or_insert(now)) < ANSWER_LINGER_NS
            };
        if !hold {
            *answers_since = None;
        }
        while let Some(a) = (!hold).then(|| m.answers.pop_front()).flatten() {
            let put = |_: &mut Mirror, b: &mut [u8]| {
                b[..a.len()].copy_from_slice(&a);
                Some(a.len())
            };
            if !Self::send(
                m,
                (detail, no_room_since),
                ep,
                (peer, KIND_ANSWER, a.len()),
                put,
            ) {
                m.answers.push_front(a);
                return any;
            }
            m.recycle(a);
            any = true;
        }
        // One-sided requests before the ring bytes published after them (the position is
        // read first): a WRITE lands before a later SEND is seen.
        // Each goes from the request ring straight into the message (a WRITE's data too).
        let upto = m.published();
        while m.request_waits() {
            if let Some((rec, head, id, len)) = m.next_request_elsewhere() {
                // A WRITE piece whose data goes from the program's region in place.
                let q = elsewhere.writes.lock().unwrap_or_else(|e| e.into_inner());
                let Some(d) = q.front().filter(|d| d.id == id && d.len == len) else {
                    drop(q);
                    m.fail("a WRITE's data went missing in this process");
                    return any;
                };
                let mut msg_head = [0u8; 1 + 16 + RDMA_REQ_HEAD];
                msg_head[0] = KIND_RDMA;
                msg_head[1..].copy_from_slice(&head);
                // (Its buffer is the QP's until the WRITE completes, which its answer says:
                // in a stream it may wait for the next pieces to share its message.)
                let r = ep.send_span(peer, (&msg_head, &[]), (&d.span, d.off, d.len));
                drop(q);
                if !Self::outcome(m, (detail, no_room_since), r) {
                    return any;
                }
                elsewhere
                    .writes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .pop_front();
                m.release_request_id(rec, Some(id));
                crate::transport::across::count_sent_in_place();
                any = true;
                Self::cork_the_rest(m, ep, alone);
                continue;
            }
            let (mut asked, mut taken) = (false, None);
            let put = |m: &mut Mirror, b: &mut [u8]| {
                asked = true;
                let (rec, n) = m.next_request_into(b)?;
                let id = b.get(24..32).and_then(|id| id.try_into().ok());
                taken = Some((rec, id.map(u64::from_le_bytes)));
                Some(n)
            };
            let max = m.request_len().unwrap_or(MAX_DGRAM);
            let sent = Self::send(m, (detail, no_room_since), ep, (peer, KIND_RDMA, max), put);
            match taken {
                Some((rec, id)) if sent => m.release_request_id(rec, id),
                // No request waits.
                None if asked => break,
                // No room (the ring bytes after it wait too), or written into a message that
                // UCX then refused (the pair broke).
                _ => return any,
            }
            any = true;
            Self::cork_the_rest(m, ep, alone);
        }
        // Acks and credits alone wait a little for a message to go with (a reply carries its
        // request's ack): every message is a system call on each side over TCP.
        if !m.has_urgent_news() && m.has_news() {
            let now = crate::sync::fast_ns();
            let since = *words_since.get_or_insert(now);
            if now.saturating_sub(since) < WORDS_LINGER_NS {
                return any;
            }
        }
        *words_since = None;
        while m.has_news() {
            // A SEND whose payload goes from the program's region in place: the ring bytes
            // before its record share its message where they fit (copied into its head),
            // else go first in messages of their own.
            let front = {
                let q = elsewhere.sends.lock().unwrap_or_else(|e| e.into_inner());
                q.front()
                    .map(|d| (d.id, d.at, d.span.clone(), d.off, d.len))
            };
            let mut stop = None;
            if let Some((rec, at, span, off, len)) = front {
                if rec < m.shipped_to() || at < rec {
                    m.fail("a SEND's payload went missing in this process");
                    return any;
                }
                if m.in_place_fits(1, (at, len as u64), MAX_DGRAM) {
                    let (head, trailer) = in_place_buf;
                    head.clear();
                    head.push(KIND_QP);
                    let Some(s) = m.next_message_in_place(head, trailer, upto, (at, len as u64))
                    else {
                        break; // not published yet (or the pair broke)
                    };
                    // (Its buffer is the QP's until the SEND completes: in a stream it may
                    // wait for the next SENDs to share its message.)
                    let r = ep.send_span(peer, (head, trailer), (&span, off, len));
                    if !Self::outcome(m, (detail, no_room_since), r) {
                        break;
                    }
                    elsewhere
                        .sends
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .pop_front();
                    m.shipped(s);
                    crate::transport::across::count_sent_in_place();
                    any = true;
                    continue;
                }
                stop = Some(rec);
            }
            let mut shipment = None;
            let made = |m: &mut Mirror, b: &mut [u8]| {
                let (n, s) = m.next_message(b, upto, stop)?;
                shipment = Some(s);
                Some(n)
            };
            let max = m.message_len(upto);
            if !Self::send(m, (detail, no_room_since), ep, (peer, KIND_QP, max), made) {
                break;
            }
            match shipment {
                Some(s) => m.shipped(s),
                None => break,
            }
            any = true;
        }
        any
    }

    /// A request went alone and another waits: the rest share a message (corked).
    fn cork_the_rest(m: &mut Mirror, ep: &mut Endpoint, alone: &mut bool) {
        if *alone && m.request_waits() {
            ep.alone(false);
            ep.cork();
            *alone = false;
        }
    }

    /// Applies what came from the peer's process (`look`: after one look at the network);
    /// true if anything did.
    fn take(&mut self, ep: &mut Endpoint, look: bool, deliver: &mut Deliver<'_>) -> bool {
        // Read in place (a WRITE's data goes from the endpoint's message into the region, a
        // SEND's into the posted receive when `deliver` takes it).
        let (m, peer) = (&mut self.m, self.peer);
        let mut apply = |src, msg: &[u8]| {
            Self::apply(m, peer, src, msg, deliver);
            Ok(())
        };
        // One look at the network, every message it brings applied; then what the look
        // queued (a batch, or what came out of order) and the rings (a pair through the
        // bridges), without another look.
        let mut got = if look {
            ep.recv_direct_all_with(&mut apply).map(|n| n != 0)
        } else {
            Ok(false)
        };
        let mut any = false;
        loop {
            match got {
                Ok(took) => any |= took,
                Err(DgramError::WouldBlock) => return any,
                Err(e) => {
                    self.detail = Some(e.to_string());
                    self.m.fail("the QP's endpoint closed");
                    return any;
                }
            }
            got = ep.recv_taken_with(&mut apply).map(|()| true);
        }
    }

    /// Applies one message `msg` from `src`, which must be the peer's process.
    fn apply(m: &mut Mirror, peer: Addr, src: Addr, msg: &[u8], deliver: &mut Deliver<'_>) {
        let Some((&kind, body)) = msg.split_first().filter(|_| src == peer) else {
            return; // not the peer's: no one else may write to the pair
        };
        let Some((theirs, ours)) = mirror::keys(body) else {
            m.fail("a malformed message from the peer QP's process");
            return;
        };
        if theirs != m.remote_key || ours != m.local_key {
            m.fail("a message for another QP from the peer's process");
            return;
        }
        match kind {
            KIND_QP => {
                let key = m.local_key;
                m.apply_with(body, &mut |at, bytes| deliver(key, at, bytes));
            }
            KIND_RDMA => {
                let mut out = m.answer_buf();
                m.execute(&body[16..], &mut out);
                if mirror::answer_is_write_ack(&out) {
                    PEER_WRITES.0.fetch_add(1, Ordering::Relaxed);
                }
                m.answers.push_back(out);
            }
            KIND_ANSWER => m.answer(&body[16..]),
            _ => m.fail("a message of unknown kind from the peer's process"),
        }
    }
}
