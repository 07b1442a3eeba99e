//! The datagram bridge of a fabric across hosts: a thread of the supervisor that carries
//! datagrams between this host's nodes and the other hosts' over UCX, so that programs send
//! and receive exactly as they do on one host.
//!
//! A sender on this host sends to a node of another host through an ordinary datagram ring,
//! made by this supervisor in the *shadow window* it keeps for that node (a window no agent
//! runs in). The bridge is that ring's receiver: it reads each record, sends it to the other
//! host's bridge (UCX active messages: one per datagram over 16 KiB, smaller ones several to a
//! message; numbered per route), and releases it.
//! The other host's bridge is the sender of an ordinary ring into the destination node's real
//! window, made by its supervisor for the route; it commits each datagram there in order and
//! returns credits as they go in. A route's bytes in flight never exceed the destination
//! ring's size, so a slow receiver holds its senders back through both rings: back-pressure,
//! never loss. A sender that closes is carried across too: the last datagram, then `End`,
//! after which the destination ring is marked sender-closed like any other.
//!
//! The supervisor decides (routes opened and closed, hosts joined and lost) and tells the
//! thread with [`Cmd`]s; the thread tells it when an outbound route has delivered its end
//! ([`Note::OutDone`]), so the shadow ring can be torn down.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use backplane_ucx::{EpId, Event, Link};

use crate::mem::{Word32, Word64};
use crate::ring::RingError;
use crate::sync::Ordering;
use crate::transport::shm::{ShmReceiver, ShmSender};
use crate::transport::{RecvChannel, SendChannel};

use super::mirror::{self, Mirror, QpBlock};

/// Bytes a record costs against a route's window besides its payload (its header, rounded).
const RECORD_COST: u64 = 64;
/// How long the thread keeps polling after the last thing it did before it sleeps.
const SPIN: Duration = Duration::from_micros(20);
/// How long it sleeps at most when idle: senders here, receivers making room and UCX wake
/// it before (a wake-up it misses costs at most this).
const NAP: Duration = Duration::from_millis(100);

const KIND_HELLO: u8 = 1;
const KIND_DATA: u8 = 2;
const KIND_END: u8 = 3;
const KIND_ACK: u8 = 4;
/// Several small datagrams in one message: a u32 count, then each as a u32 length and bytes.
const KIND_BATCH: u8 = 5;
/// A queue pair's mirror message (`mirror.rs`).
const KIND_QP: u8 = 6;
/// The sender has a queue pair's mirror too: the receiver's may ship.
const KIND_QP_READY: u8 = 7;
/// A queue pair's one-sided request (RDMA WRITE, READ, atomic).
const KIND_RDMA: u8 = 8;
/// The sender's QP of a pair was destroyed, after its last words (on the same endpoint, so
/// they are applied before the receiver drops its side).
const KIND_QP_GONE: u8 = 10;
/// The answer to one.
const KIND_RDMA_ANSWER: u8 = 9;
/// Ready notes kept for pairs not made here yet (the supervisor's command is on its way).
const EARLY_READY_MAX: usize = 4096;
/// A ready note for a pair not made here yet: (host, its QP, our QP).
type EarlyReady = (usize, (u32, u32), (u32, u32));
const HEAD: usize = 24;
/// Datagrams up to this size are batched; a batch stops growing at [`BATCH_MAX`] bytes.
const BATCH_SMALL: usize = 16 * 1024;
const BATCH_MAX: usize = 64 * 1024;

/// A datagram waiting to go into its ring: `len` bytes at `off` of a received message (one
/// datagram's, or a batch's that several share).
struct Item {
    msg: std::rc::Rc<backplane_ucx::Bytes>,
    off: usize,
    len: usize,
    /// When it arrived (CLOCK_MONOTONIC ns): an emulated link's downlink starts then at the
    /// earliest.
    arrived_ns: u64,
}

impl Item {
    fn bytes(&self) -> &[u8] {
        &self.msg[self.off..self.off + self.len]
    }
}

/// The datagrams of a batch message's body: (offset in the whole message, length) each, or
/// None if it is malformed.
fn batch_items(msg: &[u8]) -> Option<Vec<(usize, usize)>> {
    let body = msg.get(HEAD..)?;
    let count = u32::from_le_bytes(body.get(..4)?.try_into().ok()?) as usize;
    let mut at = 4;
    let mut out = Vec::with_capacity(count.min(BATCH_MAX / 4));
    for _ in 0..count {
        let len = u32::from_le_bytes(body.get(at..at + 4)?.try_into().ok()?) as usize;
        at += 4;
        body.get(at..at.checked_add(len)?)?;
        out.push((HEAD + at, len));
        at += len;
    }
    (at == body.len()).then_some(out)
}

fn head(kind: u8, route: u64, n: u64) -> [u8; HEAD] {
    let mut h = [0u8; HEAD];
    h[0] = kind;
    h[8..16].copy_from_slice(&route.to_le_bytes());
    h[16..24].copy_from_slice(&n.to_le_bytes());
    h
}

fn parse(msg: &[u8]) -> Option<(u8, u64, u64, &[u8])> {
    if msg.len() < HEAD {
        return None;
    }
    let route = u64::from_le_bytes(msg[8..16].try_into().ok()?);
    let n = u64::from_le_bytes(msg[16..24].try_into().ok()?);
    Some((msg[0], route, n, &msg[HEAD..]))
}

/// Ships mirror `m`'s next message, read from its ring straight into the message UCX sends;
/// true if one went out.
fn ship_next(link: &mut SeqLink, ep: EpId, m: &mut Mirror, upto: u64) -> bool {
    if !m.has_news() {
        return false; // (no message buffer taken for nothing: this runs on every round)
    }
    let mut shipment = None;
    let sent = link.send_with(ep, &head(KIND_QP, 0, 0), mirror::MSG_MAX, |buf| {
        let (n, s) = m.next_message(buf, upto, None)?;
        shipment = Some(s);
        Some(n)
    });
    match (sent, shipment) {
        (Ok(true), Some(s)) => {
            m.shipped(s);
            true
        }
        _ => false,
    }
}

/// What the supervisor tells the bridge.
pub(super) enum Cmd {
    /// Connect the data link to host `host`'s bridge (this host dials it).
    Dial { host: usize, addr: SocketAddr },
    /// Host `host` is gone: drop its link and every route through it.
    Forget { host: usize },
    /// A ring in a shadow window whose records go to `host`, route `route`, at most `window`
    /// bytes in flight; `sender_closed` is the ring's flag the supervisor sets when its
    /// sender closes.
    AddOut {
        host: usize,
        route: u64,
        rx: Box<ShmReceiver>,
        sender_closed: Word32,
        window: u64,
        /// The shadow endpoint's doorbell (armed flag, bell) its senders ring.
        bell: (Word32, Word32),
    },
    /// Drop an outbound route now (its receiver went away on the other host).
    RemoveOut { route: u64 },
    /// A ring into a node of this host fed by `host`'s route `route`: the bridge is its
    /// sender; `sender_closed` is set (and the receiver woken) once the route ends;
    /// `peer_closed` is the credit line's flag set when the receiver goes.
    AddIn {
        host: usize,
        route: u64,
        tx: Box<ShmSender>,
        sender_closed: Word32,
        receiver_bell: Word32,
        peer_closed: Word32,
        /// The credit line's doorbell (armed flag, bell) the receiver rings as it makes room.
        credit_bell: (Word32, Word32),
        /// Link emulation: the destination node's downlink clock (`WIN_LINK_INGRESS_OFF`).
        ingress: Option<Word64>,
    },
    /// Drop an inbound route (its ring was torn down here).
    RemoveIn { host: usize, route: u64 },
    /// Mirror local QP `local_key` (block `local`) and the shadow of its peer `remote_key` on
    /// host `host` (block `shadow`), replacing any mirror of that local QP.
    AddQp {
        host: usize,
        local_key: (u32, u32),
        remote_key: (u32, u32),
        local: QpBlock,
        shadow: QpBlock,
        /// The two processes carry the pair themselves (`verbs::direct`): the mirror only
        /// ends it (the peer gone, its host lost), it never ships or applies.
        direct: bool,
    },
    /// Drop the mirrors of QP `key` (local or remote): it was destroyed. A local QP that was
    /// paired with a QP of host `host` has its last words and its end sent there.
    DropQp {
        key: (u32, u32),
        host: Option<usize>,
    },
    /// Region `rkey` of local QP `local_key`, granted to its peer `remote_key` on another
    /// host: the bridge carries out that peer's one-sided requests on it.
    AddMr {
        local_key: (u32, u32),
        remote_key: (u32, u32),
        rkey: u32,
        mr: std::sync::Arc<crate::transport::shm::ShmRegion>,
    },
}

/// What the bridge tells the supervisor.
pub(super) enum Note {
    /// Outbound route `route` delivered everything and its end: tear its shadow ring down.
    OutDone { route: u64 },
    /// The data link to host `host` failed (`why`): the datagrams on it are lost, so its routes
    /// are ended (senders open new ones once it is back; this side dials again if it dials).
    LinkLost { host: usize, why: String },
    /// The mirror of local QP `key` broke (`why`): the QP sees its peer gone.
    QpBroken { key: (u32, u32), why: String },
    /// Host `host`'s QP `qp` was destroyed (its last words applied here): drop its shadow.
    PeerQpGone { host: usize, qp: (u32, u32) },
    /// Our QP `qp` was destroyed but its mirror could not say so on the data link: the
    /// supervisor tells host `host` (`QpGone`).
    TellQpGone { host: usize, qp: (u32, u32) },
}

/// How long after a failed data link this side dials again.
const REDIAL: Duration = Duration::from_millis(100);

struct Out {
    host: usize,
    /// A batch read from the ring that UCX could not take yet, and how many datagrams it holds.
    unsent: Option<(Vec<u8>, u64)>,
    rx: Box<ShmReceiver>,
    sender_closed: Word32,
    bell: (Word32, Word32),
    window: u64,
    inflight: u64,
    seq: u64,
    ended: bool,
    /// Link emulation: the next datagram is still on its sender's uplink (not due to leave).
    held: bool,
}

struct In {
    tx: Box<ShmSender>,
    sender_closed: Word32,
    receiver_bell: Word32,
    peer_closed: Word32,
    credit_bell: (Word32, Word32),
    /// Datagrams arrived ahead of their turn or waiting for room, by sequence number.
    waiting: BTreeMap<u64, Item>,
    next: u64,
    end_at: Option<u64>,
    unacked: u64,
    window_hint: u64,
    /// Link emulation: the destination node's downlink clock.
    ingress: Option<Word64>,
}

/// How UCX wakes the sleeping bridge: the watcher thread polls the worker's fd while `watch`
/// is 1 (the bridge armed the worker and sleeps) and rings `bell` when it is readable.
#[derive(Default)]
struct Wake {
    bell: crate::sync::AtomicU32,
    watch: crate::sync::AtomicU32,
}

/// The watcher: UCX's wake-up fd turned into a futex ring the bridge sleeps on with the
/// shared-memory doorbells (a thread cannot sleep on a fd and futexes at once).
fn watch(fd: std::os::fd::OwnedFd, wake: &Wake, stop: &std::sync::atomic::AtomicBool) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let tick = Duration::from_millis(100);
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if wake.watch.load(Ordering::Acquire) == 0 {
            crate::sync::futex_wait(&wake.watch, 0, Some(tick));
            continue;
        }
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        let ts = Timespec::try_from(tick).expect("tick fits");
        if poll(&mut fds, Some(&ts)).is_ok_and(|n| n > 0) {
            wake.watch.store(0, Ordering::Release);
            crate::sync::ring(&wake.bell);
        }
    }
}

/// The bridge's handle, kept by the supervisor.
pub(super) struct Bridge {
    pub(super) port: u16,
    tx: mpsc::Sender<Cmd>,
    notes: mpsc::Receiver<Note>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    watcher: Option<std::thread::JoinHandle<()>>,
    wake: std::sync::Arc<Wake>,
}

/// How the bridge paces the datagrams it ships to other hosts (see [`Worker::pump_out`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pace {
    /// At memory speed: a datagram leaves at once.
    Memory,
    /// `--link` (or a star topology): the model's bandwidth in bytes/s; a datagram leaves when
    /// its sender's uplink and the switch are done, the other host claims the downlink.
    Link(u64),
    /// A distributed topology: the sender stamped the whole route (every link on it); a
    /// datagram leaves at its stamp and is delivered as it arrives.
    Route,
}

impl Pace {
    /// The model's bandwidth where the receiving host claims a downlink.
    fn downlink(self) -> Option<u64> {
        match self {
            Pace::Link(bps) => Some(bps),
            _ => None,
        }
    }
}

impl Bridge {
    /// Starts the bridge thread, listening on `ip` (any port) for the other hosts' bridges.
    /// `pace`: how datagrams to other hosts are held back (link emulation).
    pub(super) fn start(ip: std::net::IpAddr, me: usize, pace: Pace) -> Result<Self, String> {
        let (tx, rx) = mpsc::channel();
        let (note_tx, notes) = mpsc::channel();
        let (port_tx, port_rx) = mpsc::channel();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let wake = std::sync::Arc::new(Wake::default());
        let wake2 = wake.clone();
        let (fd_tx, fd_rx) = mpsc::channel::<std::os::fd::OwnedFd>();
        let thread = std::thread::Builder::new()
            .name("bp-bridge".into())
            .spawn(move || {
                // The link is made on the thread that runs it (UCX single-threaded mode).
                let link = match Link::open(Some(SocketAddr::new(ip, 0))) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = port_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                match link.fd().try_clone_to_owned() {
                    Ok(fd) => {
                        let _ = fd_tx.send(fd);
                    }
                    Err(e) => {
                        let _ = port_tx.send(Err(format!("cannot watch UCX's fd: {e}")));
                        return;
                    }
                }
                let _ = port_tx.send(Ok(link.listen_port()));
                let worker = Worker {
                    link: SeqLink::new(link),
                    me,
                    pace,
                    due: None,
                    cmds: rx,
                    notes: note_tx,
                    hosts: HashMap::new(),
                    dial: HashMap::new(),
                    pending: Vec::new(),
                    outs: HashMap::new(),
                    ins: HashMap::new(),
                    mirrors: HashMap::new(),
                    early_ready: Vec::new(),
                    scratch: Vec::new(),
                    wake: wake2,
                };
                // A bridge that stopped would leave routes silently stuck: the whole
                // supervisor goes instead, which its peers see as this host lost (and its
                // agents die with it), and `down` or `up` cleans up.
                let run = std::panic::AssertUnwindSafe(|| worker.run(&stop2));
                if std::panic::catch_unwind(run).is_err() {
                    std::process::abort();
                }
            })
            .map_err(|e| format!("cannot start the bridge thread: {e}"))?;
        let port = port_rx
            .recv()
            .map_err(|_| "the bridge thread died at start".to_string())??;
        let fd = fd_rx
            .recv()
            .map_err(|_| "the bridge thread died at start".to_string())?;
        let stop3 = stop.clone();
        let wake3 = wake.clone();
        let watcher = std::thread::Builder::new()
            .name("bp-bridge-watch".into())
            .spawn(move || watch(fd, &wake3, &stop3))
            .map_err(|e| format!("cannot start the bridge's watcher: {e}"))?;
        Ok(Self {
            port,
            tx,
            notes,
            stop,
            thread: Some(thread),
            watcher: Some(watcher),
            wake,
        })
    }

    /// Hands the thread a command and wakes it (it may sleep up to [`NAP`] otherwise: a new
    /// route's first datagram would wait for it).
    pub(super) fn send(&self, c: Cmd) {
        let _ = self.tx.send(c);
        crate::sync::ring(&self.wake.bell);
    }

    pub(super) fn notes(&self) -> Vec<Note> {
        self.notes.try_iter().collect()
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        crate::sync::ring(&self.wake.bell);
        crate::sync::futex_wake(&self.wake.watch);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(t) = self.watcher.take() {
            let _ = t.join();
        }
    }
}

/// The data link with its messages in order. UCX does not keep one endpoint's active messages
/// in order: on TCP under load, the `HELLO` sent right after connecting was seen to arrive
/// after the datagrams sent a few milliseconds later, which were then dropped as coming from
/// no known host — the route's first sequence number lost, the route stalled for good (the
/// flaky IP-across-hosts test). So every message carries its endpoint's sequence number (head
/// bytes 4..8) and the receiver takes them in that order, holding the early ones.
struct SeqLink {
    link: Link,
    next_out: HashMap<EpId, u32>,
    inbound: HashMap<EpId, Reorder<backplane_ucx::Bytes>>,
}

/// Bytes of early messages held for one endpoint before its link is given up: more than any
/// peer keeping its windows has in flight.
const HELD_MAX: usize = 64 << 20;

impl SeqLink {
    fn new(link: Link) -> Self {
        Self {
            link,
            next_out: HashMap::new(),
            inbound: HashMap::new(),
        }
    }

    /// Sends `head` (a [`HEAD`]-byte head) with the endpoint's next sequence number, then
    /// `body`; the number is used only if UCX took the message.
    fn send2(
        &mut self,
        ep: EpId,
        head: &[u8; HEAD],
        body: &[u8],
    ) -> Result<(), backplane_ucx::Error> {
        let seq = self.next_out.entry(ep).or_insert(0);
        let mut h = *head;
        h[4..8].copy_from_slice(&seq.to_le_bytes());
        self.link.send2(ep, &h, body)?;
        *seq = seq.wrapping_add(1);
        Ok(())
    }

    /// [`SeqLink::send2`] with a body of at most `len` bytes written in place by `fill` (see
    /// [`Link::send_with`]); `Ok(false)` if `fill` declined.
    fn send_with(
        &mut self,
        ep: EpId,
        head: &[u8; HEAD],
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<bool, backplane_ucx::Error> {
        let seq = self.next_out.entry(ep).or_insert(0);
        let mut h = *head;
        h[4..8].copy_from_slice(&seq.to_le_bytes());
        let sent = self.link.send_with(ep, HEAD + len, |buf| {
            let (at, body) = buf.split_at_mut(HEAD);
            at.copy_from_slice(&h);
            fill(body).map(|n| HEAD + n)
        })?;
        if sent {
            *seq = seq.wrapping_add(1);
        }
        Ok(sent)
    }

    fn connect(&mut self, addr: SocketAddr) -> Result<EpId, backplane_ucx::Error> {
        let ep = self.link.connect(addr)?;
        self.forget(ep);
        Ok(ep)
    }

    fn close(&mut self, ep: EpId) {
        self.link.close(ep);
        self.forget(ep);
    }

    /// Endpoint numbers are reused: a new endpoint starts from sequence number 0.
    fn forget(&mut self, ep: EpId) {
        self.next_out.remove(&ep);
        self.inbound.remove(&ep);
    }

    /// UCX's events, each endpoint's messages in the order they were sent (early ones held).
    /// An endpoint that holds too much, or sends a message without a head, fails.
    fn poll(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        for ev in self.link.poll() {
            match ev {
                Event::Accepted(ep) => {
                    self.forget(ep);
                    out.push(Event::Accepted(ep));
                }
                Event::Message(Some(ep), msg) => {
                    let seq = msg
                        .get(4..8)
                        .filter(|_| msg.len() >= HEAD)
                        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
                    let r = self
                        .inbound
                        .entry(ep)
                        .or_insert_with(|| Reorder::new(HELD_MAX));
                    let len = msg.len();
                    let deliver = |m| out.push(Event::Message(Some(ep), m));
                    match seq.map(|seq| r.arrive(seq, msg, len, deliver)) {
                        Some(Ok(())) => {}
                        // (UCS_ERR_EXCEEDS_LIMIT: "Exceeds limit" in the log.)
                        _ => out.push(Event::Failed(
                            ep,
                            backplane_ucx::Error {
                                status: -21,
                                what: "messages out of order beyond what a peer has in flight"
                                    .into(),
                            },
                        )),
                    }
                }
                ev => out.push(ev),
            }
        }
        out
    }
}

impl std::ops::Deref for SeqLink {
    type Target = Link;
    fn deref(&self) -> &Link {
        &self.link
    }
}

impl std::ops::DerefMut for SeqLink {
    fn deref_mut(&mut self) -> &mut Link {
        &mut self.link
    }
}

/// One sender's messages put back in order by their sequence numbers (wrapping u32).
struct Reorder<T> {
    next: u32,
    held: HashMap<u32, (T, usize)>,
    held_bytes: usize,
    max_bytes: usize,
}

impl<T> Reorder<T> {
    fn new(max_bytes: usize) -> Self {
        Self {
            next: 0,
            held: HashMap::new(),
            held_bytes: 0,
            max_bytes,
        }
    }

    /// Message `seq` (of `len` bytes) arrived: hands `deliver` the messages now deliverable,
    /// in order (none if it is early; a number already taken is a duplicate and dropped).
    /// `Err` if holding it would pass the limit. (No allocation for one in order.)
    fn arrive(
        &mut self,
        seq: u32,
        msg: T,
        len: usize,
        mut deliver: impl FnMut(T),
    ) -> Result<(), ()> {
        let ahead = seq.wrapping_sub(self.next);
        if ahead >= 1 << 31 {
            return Ok(()); // behind: a duplicate
        }
        if ahead > 0 {
            if self.held_bytes + len > self.max_bytes {
                return Err(());
            }
            if self.held.insert(seq, (msg, len)).is_none() {
                self.held_bytes += len;
            }
            return Ok(());
        }
        deliver(msg);
        self.next = self.next.wrapping_add(1);
        while let Some((msg, len)) = self.held.remove(&self.next) {
            self.held_bytes -= len;
            deliver(msg);
            self.next = self.next.wrapping_add(1);
        }
        Ok(())
    }
}

struct Worker {
    link: SeqLink,
    me: usize,
    /// Link emulation: how datagrams to other hosts are held back.
    pace: Pace,
    /// Link emulation: when the first datagram held on its uplink is due to leave.
    due: Option<u64>,
    cmds: mpsc::Receiver<Cmd>,
    notes: mpsc::Sender<Note>,
    /// Host index → its bridge's endpoint.
    hosts: HashMap<usize, EpId>,
    /// The hosts whose data link this side makes: their bridge's address, and when to dial.
    dial: HashMap<usize, (SocketAddr, Instant)>,
    /// Accepted endpoints that have not said which host they are.
    pending: Vec<EpId>,
    outs: HashMap<u64, Out>,
    ins: HashMap<(usize, u64), In>,
    /// Queue pairs mirrored to other hosts, by local QP, with whether their ready note went.
    mirrors: HashMap<(u32, u32), (Mirror, bool)>,
    /// Ready notes that came before their pair was made here: (host, their QP, our QP).
    early_ready: Vec<EarlyReady>,
    /// A datagram on its way from a shadow ring to UCX (kept: no allocation per datagram).
    scratch: Vec<u8>,
    wake: std::sync::Arc<Wake>,
}

impl Worker {
    fn run(mut self, stop: &std::sync::atomic::AtomicBool) {
        let mut idle_since = Instant::now();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let mut busy = self.commands();
            busy |= self.redial();
            busy |= self.events();
            busy |= self.pump_out();
            busy |= self.pump_in();
            busy |= self.pump_qps();
            if busy {
                idle_since = Instant::now();
                continue;
            }
            if idle_since.elapsed() < SPIN {
                // Give the CPU to whatever else is runnable here (the sender or receiver the
                // bridge waits for) rather than spin it away: two cores, four parties.
                std::thread::yield_now();
                continue;
            }
            self.sleep();
        }
    }

    /// Sleeps until there is something to do: a sender here rings a shadow endpoint's
    /// doorbell, a receiver here makes room in a ring with datagrams waiting for it, or UCX
    /// has events (the watcher thread turns its fd into a ring of `wake.bell`).
    fn sleep(&mut self) {
        let seen = self.wake.bell.load(Ordering::Acquire);
        if !self.link.arm() {
            return; // UCX has more to do first
        }
        self.wake.watch.store(1, Ordering::Release);
        crate::sync::futex_wake(&self.wake.watch);
        // (Clones of the words: the last look below needs the rings mutably.)
        let mut bells: Vec<(Word32, u32)> = Vec::new();
        for o in self.outs.values().filter(|o| !o.ended) {
            bells.push((o.bell.1.clone(), o.bell.1.load(Ordering::Acquire)));
            o.bell.0.store(1, Ordering::Relaxed);
        }
        for r in self.ins.values().filter(|r| !r.waiting.is_empty()) {
            bells.push((
                r.credit_bell.1.clone(),
                r.credit_bell.1.load(Ordering::Acquire),
            ));
            r.credit_bell.0.store(1, Ordering::Relaxed);
        }
        for (m, _) in self.mirrors.values().filter(|(m, _)| m.ready) {
            let (armed, bell) = m.bell();
            bells.push((bell.clone(), bell.load(Ordering::Acquire)));
            armed.store(1, Ordering::Relaxed);
        }
        // SYNC POINT doorbell-arm (receiver) and credit-arm (sender), as the datagram path's:
        // armed before the last look at every ring.
        crate::sync::fence(Ordering::SeqCst);
        // (An outbound route with its window full waits for the other side's ack: UCX.)
        let pending = self.outs.values().any(|o| {
            !o.ended
                && ((!o.held && o.inflight < o.window && !o.rx.is_drained())
                    || o.unsent.is_some()
                    || o.sender_closed.load(Ordering::Acquire) != 0)
        }) || self.ins.values_mut().any(|r| {
            r.waiting
                .first_key_value()
                .filter(|(&k, _)| k == r.next)
                .is_some_and(|(_, m)| r.tx.has_room(m.len).unwrap_or(true))
        }) || self
            .mirrors
            .values()
            .any(|(m, said)| m.pending() || (!said && self.hosts.contains_key(&m.host)));
        if !pending {
            let mut words: Vec<(&crate::sync::AtomicU32, u32)> = vec![(&self.wake.bell, seen)];
            words.extend(bells.iter().map(|(w, v)| (&**w, *v)));
            // Not past a data link's redial; with more than futex_waitv's 128 words, the rest
            // are looked at every millisecond.
            let redial = self
                .dial
                .iter()
                .filter(|(h, _)| !self.hosts.contains_key(h))
                .map(|(_, &(_, at))| at.saturating_duration_since(Instant::now()))
                .min();
            let nap = if words.len() > 128 {
                Duration::from_millis(1)
            } else {
                NAP
            };
            let nap = redial.map_or(nap, |r| r.min(nap));
            // Not past the time a datagram held on its emulated uplink may leave.
            let nap = self.due.map_or(nap, |d| {
                nap.min(Duration::from_nanos(
                    d.saturating_sub(crate::sync::now_ns()),
                ))
            });
            crate::sync::futex_wait_any(&words, nap);
        }
        for o in self.outs.values() {
            o.bell.0.store(0, Ordering::Relaxed);
        }
        for r in self.ins.values() {
            r.credit_bell.0.store(0, Ordering::Relaxed);
        }
        for (m, _) in self.mirrors.values() {
            m.bell().0.store(0, Ordering::Relaxed);
        }
    }

    fn commands(&mut self) -> bool {
        let mut any = false;
        while let Ok(c) = self.cmds.try_recv() {
            any = true;
            match c {
                Cmd::Dial { host, addr } => {
                    if let Some(old) = self.hosts.remove(&host) {
                        self.link.close(old);
                    }
                    self.dial.insert(host, (addr, Instant::now()));
                }
                Cmd::Forget { host } => {
                    self.dial.remove(&host);
                    if let Some(ep) = self.hosts.remove(&host) {
                        self.link.close(ep);
                    }
                    self.outs.retain(|_, o| o.host != host);
                    self.ins.retain(|k, _| k.0 != host);
                    self.break_mirrors(host, "its host is gone");
                }
                Cmd::AddOut {
                    host,
                    route,
                    rx,
                    sender_closed,
                    window,
                    bell,
                } => {
                    self.outs.insert(
                        route,
                        Out {
                            host,
                            unsent: None,
                            rx,
                            sender_closed,
                            bell,
                            window,
                            inflight: 0,
                            seq: 0,
                            ended: false,
                            held: false,
                        },
                    );
                }
                Cmd::RemoveOut { route } => {
                    self.outs.remove(&route);
                }
                Cmd::AddIn {
                    host,
                    route,
                    tx,
                    sender_closed,
                    receiver_bell,
                    peer_closed,
                    credit_bell,
                    ingress,
                } => {
                    let window_hint = tx.data().len();
                    self.ins.insert(
                        (host, route),
                        In {
                            tx,
                            sender_closed,
                            receiver_bell,
                            peer_closed,
                            credit_bell,
                            waiting: BTreeMap::new(),
                            next: 0,
                            end_at: None,
                            unacked: 0,
                            window_hint,
                            ingress,
                        },
                    );
                }
                Cmd::RemoveIn { host, route } => {
                    self.ins.remove(&(host, route));
                }
                Cmd::AddQp {
                    host,
                    local_key,
                    remote_key,
                    ..
                } if self.mirrors.get(&local_key).is_some_and(|(m, _)| {
                    m.host == host && m.remote_key == remote_key && m.broken.is_none()
                }) =>
                {
                    // Connected again to the same peer: the mirror goes on where it is.
                }
                Cmd::AddQp {
                    host,
                    local_key,
                    remote_key,
                    local,
                    shadow,
                    direct,
                } => match Mirror::new(host, local_key, remote_key, &local, &shadow) {
                    Ok(mut m) => {
                        m.direct = direct;
                        let early = (host, remote_key, local_key);
                        if let Some(i) = self.early_ready.iter().position(|e| *e == early) {
                            self.early_ready.swap_remove(i);
                            m.ready = !direct;
                        }
                        // (A direct pair says nothing to the other bridge: it is never ready.)
                        self.mirrors.insert(local_key, (m, direct));
                    }
                    Err(e) => {
                        let why = format!("its blocks cannot be mapped: {e}");
                        let _ = self.notes.send(Note::QpBroken {
                            key: local_key,
                            why,
                        });
                    }
                },
                Cmd::AddMr {
                    local_key,
                    remote_key,
                    rkey,
                    mr,
                } => {
                    if let Some((m, _)) = self
                        .mirrors
                        .get_mut(&local_key)
                        .filter(|(m, _)| m.remote_key == remote_key)
                    {
                        m.add_region(rkey, mr);
                    }
                }
                Cmd::DropQp { key, host } => {
                    match self.mirrors.remove(&key) {
                        Some((m, _)) => self.last_words(m),
                        // No mirror (its peer went first, or it never got one): the other
                        // host still keeps a shadow of it.
                        None => {
                            if let Some(host) = host {
                                let _ = self.notes.send(Note::TellQpGone { host, qp: key });
                            }
                        }
                    }
                    self.mirrors.retain(|_, (m, _)| m.remote_key != key);
                    self.early_ready.retain(|e| e.1 != key && e.2 != key);
                }
            }
        }
        any
    }

    /// Dials the hosts whose data link this side makes and that have none now, when due.
    fn redial(&mut self) -> bool {
        let now = Instant::now();
        let due: Vec<(usize, SocketAddr)> = self
            .dial
            .iter()
            .filter(|(h, (_, at))| !self.hosts.contains_key(h) && *at <= now)
            .map(|(&h, &(a, _))| (h, a))
            .collect();
        for &(host, addr) in &due {
            match self.link.connect(addr) {
                Ok(ep) => {
                    let _ = self
                        .link
                        .send2(ep, &head(KIND_HELLO, self.me as u64, 0), &[]);
                    self.hosts.insert(host, ep);
                }
                Err(_) => {
                    self.dial.insert(host, (addr, now + REDIAL));
                }
            }
        }
        !due.is_empty()
    }

    fn host_of(&self, ep: EpId) -> Option<usize> {
        self.hosts.iter().find(|(_, &e)| e == ep).map(|(&h, _)| h)
    }

    fn events(&mut self) -> bool {
        let evs = self.link.poll();
        let any = !evs.is_empty();
        for ev in evs {
            match ev {
                Event::Accepted(ep) => self.pending.push(ep),
                Event::Message(Some(ep), msg) => {
                    let Some((kind, route, n, _)) = parse(&msg) else {
                        continue;
                    };
                    if kind == KIND_HELLO {
                        if let Some(i) = self.pending.iter().position(|&p| p == ep) {
                            self.pending.swap_remove(i);
                            let host = route as usize;
                            if let Some(old) = self.hosts.insert(host, ep) {
                                if old != ep {
                                    self.link.close(old);
                                }
                            }
                        }
                        continue;
                    }
                    let Some(host) = self.host_of(ep) else {
                        continue;
                    };
                    match kind {
                        KIND_QP | KIND_QP_READY | KIND_RDMA | KIND_RDMA_ANSWER | KIND_QP_GONE => {
                            self.qp_message(host, kind, &msg[HEAD..])
                        }
                        KIND_DATA | KIND_BATCH => {
                            if let Some(r) = self.ins.get_mut(&(host, route)) {
                                let items = if kind == KIND_DATA {
                                    Some(vec![(HEAD, msg.len() - HEAD)])
                                } else {
                                    batch_items(&msg)
                                };
                                // A host that keeps its window never has more than a ring's
                                // worth waiting; one that does not, or sends a malformed
                                // batch, loses the route, not this host's memory.
                                let count = items.as_ref().map_or(0, Vec::len) as u64;
                                let last = n.saturating_add(count);
                                let ahead = last.saturating_sub(r.next).saturating_mul(RECORD_COST);
                                let over = (r.waiting.len() as u64 + count) * RECORD_COST
                                    > 4 * r.window_hint;
                                match items {
                                    Some(items) if !over && ahead <= 4 * r.window_hint => {
                                        let arrived_ns = crate::sync::now_ns();
                                        let msg = std::rc::Rc::new(msg);
                                        for (k, (off, len)) in items.into_iter().enumerate() {
                                            let seq = n + k as u64;
                                            if seq >= r.next {
                                                let msg = msg.clone();
                                                r.waiting.insert(
                                                    seq,
                                                    Item {
                                                        msg,
                                                        off,
                                                        len,
                                                        arrived_ns,
                                                    },
                                                );
                                            }
                                        }
                                    }
                                    _ => {
                                        r.waiting.clear();
                                        r.peer_closed.store(1, Ordering::Release);
                                        r.sender_closed.store(1, Ordering::Release);
                                        crate::sync::ring(&r.receiver_bell);
                                    }
                                }
                            }
                        }
                        KIND_END => {
                            if let Some(r) = self.ins.get_mut(&(host, route)) {
                                r.end_at = Some(n);
                            }
                        }
                        KIND_ACK => {
                            if let Some(o) = self.outs.get_mut(&route) {
                                if o.host == host {
                                    o.inflight = o.inflight.saturating_sub(n);
                                }
                            }
                        }
                        _ => {}
                    }
                }
                Event::Message(None, _) | Event::Dropped(..) => {}
                Event::Failed(ep, e) => {
                    self.pending.retain(|&p| p != ep);
                    // The supervisors' heartbeat decides whether the host is lost; here the
                    // link goes, its routes with it, and the dialling side dials again.
                    if let Some(host) = self.host_of(ep) {
                        self.hosts.remove(&host);
                        if let Some(d) = self.dial.get_mut(&host) {
                            d.1 = Instant::now() + REDIAL;
                        }
                        self.outs.retain(|_, o| o.host != host);
                        self.ins.retain(|k, _| k.0 != host);
                        self.break_mirrors(host, "the data link to its host failed");
                        let why = backplane_ucx::status_string(e.status);
                        let _ = self.notes.send(Note::LinkLost { host, why });
                    }
                    self.link.close(ep);
                }
            }
        }
        any
    }

    /// A mirror message or ready note from host `host`'s bridge.
    fn qp_message(&mut self, host: usize, kind: u8, body: &[u8]) {
        let Some((theirs, ours)) = mirror::keys(body) else {
            return;
        };
        if kind == KIND_RDMA {
            // The region a request names was granted by this supervisor, which queued it here
            // (`Cmd::AddMr`) before it answered the other host; the requester posted only
            // after that answer, but this thread may have looked at its commands before the
            // grant and only now at the request (preempted in between: a READ across hosts
            // failed with REM_ACCESS_ERR under a loaded CI run). Take the commands first.
            self.commands();
        }
        let m = self
            .mirrors
            .get_mut(&ours)
            .filter(|(m, _)| m.host == host && m.remote_key == theirs);
        match (kind, m) {
            (KIND_QP_READY, Some((m, _))) => m.ready = !m.direct,
            (KIND_QP_READY, None) => {
                if self.early_ready.len() >= EARLY_READY_MAX {
                    self.early_ready.remove(0);
                }
                self.early_ready.push((host, theirs, ours));
            }
            // A bad message breaks the pair (`pump_qps` drops it and says why).
            (KIND_QP, Some((m, _))) => m.apply(body),
            (KIND_RDMA, Some((m, _))) => {
                let mut out = Vec::new();
                m.execute(&body[16..], &mut out);
                let sent = m.answers.is_empty()
                    && self.hosts.get(&host).is_some_and(|&ep| {
                        self.link
                            .send2(ep, &head(KIND_RDMA_ANSWER, 0, 0), &out)
                            .is_ok()
                    });
                if !sent {
                    m.answers.push_back(out); // in order, after the ones waiting
                }
            }
            (KIND_RDMA_ANSWER, Some((m, _))) => m.answer(&body[16..]),
            (KIND_QP_GONE, Some(_)) => {
                self.mirrors.remove(&ours);
                let _ = self.notes.send(Note::PeerQpGone { host, qp: theirs });
            }
            (_, Some(_)) => {}
            // A pair dropped here meanwhile.
            (_, None) => {}
        }
    }

    /// Our QP of mirror `m` was destroyed: what it wrote last (its final acks, then gone) goes
    /// to the other host, then that its QP is gone, on the same endpoint — so the other side
    /// applies them before it drops its shadow. Without a ready link the supervisor says it.
    fn last_words(&mut self, mut m: Mirror) {
        let keys = mirror::encode_ready(m.local_key, m.remote_key);
        if let Some(&ep) = self.hosts.get(&m.host).filter(|_| m.ready) {
            while ship_next(&mut self.link, ep, &mut m, u64::MAX) {}
            if self
                .link
                .send2(ep, &head(KIND_QP_GONE, 0, 0), &keys)
                .is_ok()
            {
                return;
            }
        }
        let _ = self.notes.send(Note::TellQpGone {
            host: m.host,
            qp: m.local_key,
        });
    }

    /// The mirrors through host `host` end: their local QPs see their peers gone.
    fn break_mirrors(&mut self, host: usize, why: &'static str) {
        self.early_ready.retain(|e| e.0 != host);
        let gone: Vec<(u32, u32)> = self
            .mirrors
            .iter()
            .filter(|(_, (m, _))| m.host == host)
            .map(|(&k, _)| k)
            .collect();
        for key in gone {
            if let Some((mut m, _)) = self.mirrors.remove(&key) {
                m.fail(why);
                let why = why.to_string();
                let _ = self.notes.send(Note::QpBroken { key, why });
            }
        }
    }

    /// Ships what local QPs wrote into their peers' shadows, and the ready notes not sent.
    fn pump_qps(&mut self) -> bool {
        let mut any = false;
        for (&key, (m, said)) in self.mirrors.iter_mut() {
            let Some(&ep) = self.hosts.get(&m.host).filter(|_| !m.direct) else {
                continue;
            };
            if !*said {
                let note = mirror::encode_ready(key, m.remote_key);
                if self
                    .link
                    .send2(ep, &head(KIND_QP_READY, 0, 0), &note)
                    .is_err()
                {
                    continue;
                }
                *said = true;
                any = true;
            }
            // Answers the other host waits for, in order.
            while let Some(a) = m.answers.front() {
                if self
                    .link
                    .send2(ep, &head(KIND_RDMA_ANSWER, 0, 0), a)
                    .is_err()
                {
                    break;
                }
                m.answers.pop_front();
                any = true;
            }
            // One-sided requests go before the ring bytes published after them (the position
            // is read first): a WRITE lands before a later SEND is seen.
            let upto = m.published();
            let mut requests_out = true;
            for _ in 0..64 {
                let Some(rec) = m.next_request(&mut self.scratch) else {
                    break;
                };
                if self
                    .link
                    .send2(ep, &head(KIND_RDMA, 0, 0), &self.scratch)
                    .is_err()
                {
                    requests_out = false;
                    break; // too much in flight in UCX: after the next poll
                }
                m.release_request(rec, &self.scratch);
                any = true;
            }
            if !requests_out || m.next_request(&mut self.scratch).is_some() {
                // Requests still wait: the ring bytes after them wait too.
                continue;
            }
            // A few messages per pair per round, so one busy pair does not starve the rest.
            for _ in 0..8 {
                if !ship_next(&mut self.link, ep, m, upto) {
                    break; // nothing more, or too much in flight in UCX: after the next poll
                }
                any = true;
            }
        }
        // A pair broken by a bad value (either side's): the local QP already sees its peer
        // gone; the supervisor tells the other host.
        let broken: Vec<(u32, u32)> = self
            .mirrors
            .iter()
            .filter(|(_, (m, _))| m.broken.is_some())
            .map(|(&k, _)| k)
            .collect();
        for key in broken {
            if let Some((m, _)) = self.mirrors.remove(&key) {
                let why = m.broken.unwrap_or("broken").to_string();
                let _ = self.notes.send(Note::QpBroken { key, why });
                any = true;
            }
        }
        any
    }

    /// Reads this host's shadow rings and sends what the windows allow.
    ///
    /// With an emulated link, a datagram leaves only when its sender's uplink and the switch
    /// are done with it: its stamp (`not_before_ns`, the delivery time the sender computed on
    /// this host's clock) less its serialisation on the destination's downlink, which the
    /// other host's bridge claims on the node's own clock as the datagram arrives (so senders
    /// on every host share that downlink). The real link's latency adds to the model's.
    fn pump_out(&mut self) -> bool {
        let mut any = false;
        let mut done = Vec::new();
        let pace = self.pace;
        let now = if pace == Pace::Memory {
            0
        } else {
            crate::sync::now_ns()
        };
        let mut due: Option<u64> = None;
        // The time a record may leave, if that is still ahead. (A stamp further out than any
        // the sender could make is its own mistake: shipped at once — with `--link` the other
        // host's downlink still paces it.)
        let mut hold = |rec: &crate::ring::Record| {
            let at = match pace {
                Pace::Memory => return None,
                Pace::Link(bps) => rec
                    .not_before_ns
                    .saturating_sub(crate::dgram::serialise_ns(rec.len, bps)),
                Pace::Route => rec.not_before_ns,
            };
            (at > now && at <= now + crate::dgram::MAX_HOLD_NS).then(|| {
                due = Some(due.map_or(at, |d| d.min(at)));
                at
            })
        };
        for (&route, o) in self.outs.iter_mut() {
            o.held = false;
            if o.ended {
                continue;
            }
            let Some(&ep) = self.hosts.get(&o.host) else {
                continue;
            };
            loop {
                // A batch that did not go out last time goes first.
                if let Some((b, count)) = o.unsent.take() {
                    if self
                        .link
                        .send2(ep, &head(KIND_BATCH, route, o.seq), &b)
                        .is_err()
                    {
                        o.unsent = Some((b, count));
                        break;
                    }
                    o.seq += count;
                    any = true;
                }
                match o.rx.peek() {
                    Ok(Some(rec)) if hold(&rec).is_some() => {
                        o.held = true;
                        break;
                    }
                    Ok(Some(rec)) if rec.len <= BATCH_SMALL => {
                        // Small datagrams go several to a message (read and released into
                        // the batch; kept here if UCX cannot take it now).
                        let batch = &mut self.scratch;
                        batch.clear();
                        batch.extend_from_slice(&[0; 4]);
                        let mut count = 0u64;
                        while let Ok(Some(rec)) = o.rx.peek() {
                            if hold(&rec).is_some() {
                                break; // the next round finds it at the head
                            }
                            let cost = rec.len as u64 + RECORD_COST;
                            let fits = batch.len() + 4 + rec.len <= BATCH_MAX;
                            if rec.len > BATCH_SMALL
                                || !fits
                                || (o.inflight > 0 && o.inflight + cost > o.window)
                            {
                                break;
                            }
                            let at = batch.len();
                            batch.extend_from_slice(&(rec.len as u32).to_le_bytes());
                            batch.resize(at + 4 + rec.len, 0);
                            if o.rx.data().read(rec.pos, &mut batch[at + 4..]).is_err() {
                                batch.truncate(at);
                                break;
                            }
                            o.rx.release(rec);
                            o.inflight += cost;
                            count += 1;
                        }
                        if count == 0 {
                            break;
                        }
                        batch[..4].copy_from_slice(&(count as u32).to_le_bytes());
                        o.rx.wake_sender();
                        any = true;
                        if self
                            .link
                            .send2(ep, &head(KIND_BATCH, route, o.seq), batch)
                            .is_err()
                        {
                            o.unsent = Some((batch.clone(), count));
                            break; // too much in flight in UCX: after the next poll
                        }
                        o.seq += count;
                    }
                    Ok(Some(rec)) => {
                        let cost = rec.len as u64 + RECORD_COST;
                        if o.inflight > 0 && o.inflight + cost > o.window {
                            break;
                        }
                        // Read from the ring straight into the message UCX sends.
                        let h = head(KIND_DATA, route, o.seq);
                        let data = o.rx.data();
                        let fill =
                            |body: &mut [u8]| data.read(rec.pos, body).is_ok().then_some(rec.len);
                        if self.link.send_with(ep, &h, rec.len, fill) != Ok(true) {
                            break; // too much in flight in UCX (after the next poll), or a bad record
                        }
                        o.seq += 1;
                        o.inflight += cost;
                        o.rx.release(rec);
                        o.rx.wake_sender();
                        any = true;
                    }
                    Ok(None) => {
                        // The sender closed: everything before its flag was read above.
                        if o.sender_closed.load(Ordering::Acquire) != 0
                            && matches!(o.rx.peek(), Ok(None))
                        {
                            let _ = self.link.send2(ep, &head(KIND_END, route, o.seq), &[]);
                            o.ended = true;
                            done.push(route);
                            any = true;
                        }
                        break;
                    }
                    Err(RingError::Corrupt(_)) | Err(_) => {
                        // A sender that scribbled on its ring: end the route here.
                        let _ = self.link.send2(ep, &head(KIND_END, route, o.seq), &[]);
                        o.ended = true;
                        done.push(route);
                        any = true;
                        break;
                    }
                }
            }
        }
        for route in done {
            let _ = self.notes.send(Note::OutDone { route });
        }
        self.due = due;
        any
    }

    /// Commits what arrived, in order, into this host's rings as room allows; acknowledges.
    fn pump_in(&mut self) -> bool {
        let mut any = false;
        for (&(host, route), r) in self.ins.iter_mut() {
            if r.peer_closed.load(Ordering::Acquire) != 0 {
                r.waiting.clear(); // the receiver is gone: nothing more goes in
                continue;
            }
            let mut wrote = false;
            while let Some(entry) = r.waiting.first_entry() {
                if *entry.key() != r.next {
                    break;
                }
                let payload_len = entry.get().len;
                let mut res = match r.tx.reserve(payload_len) {
                    Ok(res) => res,
                    Err(RingError::Full) => break, // when the receiver makes room
                    Err(_) => {
                        // Too big for any ring (the other host's sender could not have
                        // written it): not deliverable; the route goes on without it.
                        entry.remove();
                        r.next += 1;
                        r.unacked += payload_len as u64 + RECORD_COST;
                        continue;
                    }
                };
                let item = entry.remove();
                if let (Some(bps), Some(clock)) = (self.pace.downlink(), &r.ingress) {
                    // The destination's downlink, shared with every sender to the node.
                    let ser = crate::dgram::serialise_ns(payload_len, bps);
                    let now = crate::sync::now_ns();
                    let start = crate::dgram::claim(clock, item.arrived_ns, ser, now);
                    res.not_before_ns = start + ser;
                }
                let _ = r.tx.data().write(res.pos, item.bytes());
                r.tx.commit(res);
                r.next += 1;
                r.unacked += payload_len as u64 + RECORD_COST;
                wrote = true;
            }
            if wrote {
                r.tx.wake_receiver();
                any = true;
            }
            if r.unacked > 0 && (r.waiting.is_empty() || r.unacked >= r.window_hint / 4) {
                if let Some(&ep) = self.hosts.get(&host) {
                    if self
                        .link
                        .send2(ep, &head(KIND_ACK, route, r.unacked), &[])
                        .is_ok()
                    {
                        r.unacked = 0;
                    }
                }
            }
            if r.end_at == Some(r.next) {
                r.sender_closed.store(1, Ordering::Release);
                crate::sync::ring(&r.receiver_bell);
                r.end_at = None;
                any = true;
            }
        }
        any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl<T> Reorder<T> {
        /// [`Reorder::arrive`] with what it delivers collected.
        fn arrive_all(&mut self, seq: u32, msg: T, len: usize) -> Result<Vec<T>, ()> {
            let mut out = Vec::new();
            self.arrive(seq, msg, len, |m| out.push(m)).map(|()| out)
        }
    }

    #[test]
    fn reorder_gives_each_message_once_in_order_across_the_wrap() {
        let mut r = Reorder::new(100);
        assert_eq!(r.arrive_all(0, 'a', 1), Ok(vec!['a']));
        // Early ones are held until the gap fills; a duplicate is dropped.
        assert_eq!(r.arrive_all(3, 'd', 1), Ok(vec![]));
        assert_eq!(r.arrive_all(2, 'c', 1), Ok(vec![]));
        assert_eq!(r.arrive_all(0, 'x', 1), Ok(vec![]));
        assert_eq!(r.arrive_all(1, 'b', 1), Ok(vec!['b', 'c', 'd']));
        assert_eq!(r.held_bytes, 0);
        // Across u32's wrap.
        r.next = u32::MAX - 1;
        assert_eq!(r.arrive_all(0, 'g', 1), Ok(vec![]));
        assert_eq!(r.arrive_all(u32::MAX, 'f', 1), Ok(vec![]));
        assert_eq!(r.arrive_all(u32::MAX - 1, 'e', 1), Ok(vec!['e', 'f', 'g']));
        assert_eq!(r.next, 1);
    }

    #[test]
    fn reorder_refuses_to_hold_more_than_its_limit() {
        let mut r = Reorder::new(10);
        assert_eq!(r.arrive_all(1, 1, 6), Ok(vec![]));
        assert_eq!(r.arrive_all(2, 2, 5), Err(()));
        assert_eq!(r.arrive_all(2, 2, 4), Ok(vec![]));
        assert_eq!(r.arrive_all(0, 0, 100), Ok(vec![0, 1, 2]));
    }

    fn batch(items: &[&[u8]]) -> Vec<u8> {
        let mut m = head(KIND_BATCH, 7, 100).to_vec();
        m.extend_from_slice(&(items.len() as u32).to_le_bytes());
        for i in items {
            m.extend_from_slice(&(i.len() as u32).to_le_bytes());
            m.extend_from_slice(i);
        }
        m
    }

    #[test]
    fn batches_parse_back_and_every_malformed_one_is_refused() {
        let m = batch(&[b"abc", b"", b"hello"]);
        let items = batch_items(&m).unwrap();
        let got: Vec<&[u8]> = items.iter().map(|&(o, l)| &m[o..o + l]).collect();
        assert_eq!(got, vec![&b"abc"[..], b"", b"hello"]);
        assert_eq!(
            parse(&m).map(|p| (p.0, p.1, p.2)),
            Some((KIND_BATCH, 7, 100))
        );
        // A count beyond the body, a length beyond it, trailing bytes, no count at all.
        let mut more = m.clone();
        more[HEAD..HEAD + 4].copy_from_slice(&4u32.to_le_bytes());
        assert!(batch_items(&more).is_none());
        let mut long = m.clone();
        long[HEAD + 4..HEAD + 8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(batch_items(&long).is_none());
        let mut trailing = m.clone();
        trailing.push(0);
        assert!(batch_items(&trailing).is_none());
        assert!(batch_items(&head(KIND_BATCH, 7, 100)).is_none());
        assert!(batch_items(&[1, 2, 3]).is_none());
    }
}
