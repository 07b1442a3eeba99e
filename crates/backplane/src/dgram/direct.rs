//! Datagrams between hosts straight from the sender's process to the receiver's (fabrics
//! across hosts).
//!
//! Without this, a datagram to a node of another host goes sender → shadow ring → this host's
//! bridge → UCX → the other host's bridge → ring → receiver: four threads take turns on it,
//! and where CPUs are few each turn waits for one (`perf dgram-lat` between two hosts on
//! 2 vCPUs: 22–45 µs one way against `ucx_perftest`'s 5). A direct endpoint has a UCX worker
//! of its own, listening on its host's address (`Welcome.direct_ip`), made before it binds
//! and named in `Bind.direct`; its supervisor tells a host that opens a route to it
//! (`HostMsg::RouteOpened.direct`), whose supervisor tells the sender (`Connected.direct`),
//! and the sender's own worker connects there and sends each datagram as an active message.
//! The supervisors still decide everything else: a route is opened, refused and torn down
//! (receiver gone, node or host lost) exactly as before, and the shadow ring's flags are how
//! the sender learns that its route ended; only the bytes skip the bridges.
//!
//! - *Order.* A sender uses one path per (sender, receiver) pair for the pair's whole life.
//!   UCX delivered the first messages of a fresh connection after later ones (those sent
//!   before its wire-up completed; seen between two workers over TCP), so each message
//!   carries its connection's name and number, and the receiver queues them in that order,
//!   holding the few that come early.
//! - *One connection per pair.* Two endpoints that send to each other share one connection
//!   (whoever connects second uses the first's; two that connected at once end on the lesser
//!   address's): over TCP, two connections cost every datagram a bare acknowledgement
//!   segment of its own (`dgram-lat` 1.26 -> 1.11x `tag_lat`, `send-lat` over direct QPs
//!   1.67 -> 1.36x).
//! - *Batches.* Over TCP each message costs a system call on both sides (~5 µs here), so a
//!   stream of small datagrams (each send within [`STREAM_GAP_NS`] of the last) shares
//!   messages of up to [`BATCH_MAX`], as the bridges do; a batch waits at most [`LINGER_NS`]
//!   for more. A lone datagram, or a request and its answer, always goes at once. A stream
//!   of large datagrams (over [`BATCH_SMALL`]) shares messages of up to [`BIG_BATCH_MAX`]
//!   (one of UCX's TCP segments), each batch's buffer handed to UCX in place and recycled:
//!   a datagram a message made twice the TCP segments and sixteen times the `sendmsg`
//!   calls per MiB of `ucx_perftest`'s one message. `Endpoint::send_many` sends up to
//!   [`LIST_MAX`] datagrams as one message read in place (a list), no copy at all: up to
//!   [`LIST_FRAME_BYTES`] in at most [`LIST_PIECES`] pieces of memory (a frame cut into
//!   datagrams is one piece).
//! - *Back-pressure.* A receiver takes at most [`QUEUE_MAX`] bytes off the wire before its
//!   program reads them (then TCP's window fills), and a sender lets UCX hold at most
//!   [`WINDOW`] unsent bytes before it waits; nothing is dropped.
//! - *Large sends in place.* A blocking send of more than [`LENT_MIN`] bytes is not copied
//!   into a message: UCX reads the caller's buffer in place (over TCP the kernel copies it
//!   from there into the socket) and the send returns once UCX let go of it — the message
//!   left, or failed ([`Worker::send_lent`]): a stream's sender saves a copy of every
//!   byte, which `ucx_perftest`'s sender never makes. While the kernel does not take the bytes (the receiver stopped
//!   reading) the send waits there, asking now and then whether its receiver's node is
//!   still up; one that went DOWN fails the send. Non-blocking and timed sends copy.
//! - *The waker.* UCX moves data only when its worker is progressed. A thread per endpoint
//!   rings the endpoint's doorbell when UCX has news for a receiver asleep on it (local
//!   senders ring the same doorbell), and, when the endpoint's thread is elsewhere, sends
//!   what UCX or a batch still holds (a reply sent just before its sender went on to other
//!   work stayed in UCX otherwise). The worker is behind a mutex the two take turns on.
//! - *Workers outlive endpoints.* UCX 1.13 now and then aborted in `ucp_worker_destroy`
//!   when an endpoint closed under load, so a closed endpoint's worker is reset and kept for
//!   the process's next bind ([`IDLE`]); none is destroyed while the process runs.
//! - *What a send promises.* A send that returned is in the sender's process (a batch, or
//!   UCX's queue while a connection comes up or the receiver is behind) or on its way: an
//!   endpoint that closes sends it first (for at most [`FLUSH_PATIENCE`]), but a sender
//!   killed at that moment loses it — unlike a ring, which lives in shared memory. Set
//!   `BACKPLANE_DIRECT=0` where that matters more than the latency.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use backplane_ucx::{Bytes, EpId, Event, Link, MsgPiece};
use rustc_hash::FxHashMap;
use rustix::event::{PollFd, PollFlags};

use crate::mem::Word32;
use crate::transport::Addr;

/// "BPD1": the first word of a message that is one datagram.
const MAGIC: u32 = 0x4250_4431;
/// "BPDB": the first word of a batch: after the header, each datagram as a u32 LE length and
/// its bytes.
const MAGIC_BATCH: u32 = 0x4250_4442;
/// "BPDV": the first word of a list of datagrams sent in place together: after the header,
/// their number and each one's length (u32 LE), then their bytes one after the other.
const MAGIC_LIST: u32 = 0x4250_4456;
/// At most this many datagrams in one list (the receiver refuses more; UCX's
/// `backplane_ucx::MAX_PIECES`).
pub(super) const LIST_MAX: usize = 64;
/// At most this many pieces of memory make one list, after datagrams that lie back to back
/// in the sender's memory (a frame cut into datagrams) are merged ([`list_pieces`]): with
/// the header and UCX's own, within the iovs UCP 1.13 takes for one message sent in place
/// (more make it cut the message where it need not, and it trips its own assertion,
/// `proto_am.inl:403`: seen with 16).
pub(super) const LIST_PIECES: usize = 14;
/// A list holds at most this many bytes: a frame of 1 MiB cut into 64 KiB datagrams is one
/// message. Past one TCP segment UCX sends it in two pieces (and its receiver puts them
/// together), as it sends `ucx_perftest`'s 1 MiB messages: 1 MiB frames between two hosts
/// 6.1–8.5 GB/s as lists of 14 (924 KB) and the rest, 8.3–9.3 as one (session 47, pinned,
/// 10 alternating pairs: every one faster, median 1.11).
pub(super) const LIST_FRAME_BYTES: usize = 2 * BIG_BATCH_MAX;

pub(super) use backplane_ucx::back_to_back;

/// The pieces of memory `list` is made of: its datagrams, those [`back_to_back`] counted once
/// (as `backplane_ucx::Link::send_lent` merges them).
pub(super) fn list_pieces(list: &[&[u8]]) -> usize {
    list.iter()
        .enumerate()
        .filter(|&(i, d)| i == 0 || !back_to_back(list[i - 1], d))
        .count()
}
/// Datagrams up to this size may share a message (a batch) when they come in a stream.
const BATCH_SMALL: usize = 16 * 1024;
/// A batch is sent once it holds this much.
const BATCH_MAX: usize = 64 * 1024;
/// ... and a batch of large datagrams (more than [`BATCH_SMALL`]) in a stream holds up to this
/// (UCX's TCP segment, [`backplane_ucx::TCP_SEGMENT`], less room for its headers): the
/// buffer goes to UCX in place, and one `sendmsg` carries the lot (a 1 MiB message as 16
/// datagrams of its own made 16 system calls and twice as many TCP segments as
/// `ucx_perftest`'s one message).
const BIG_BATCH_MAX: usize = backplane_ucx::TCP_SEGMENT - 1024;
/// How long a batch waits for a large datagram to join it, at most, while its stream goes on
/// (a stream of 64 KiB datagrams fills one in ~100 µs at 4 GB/s). A stream that stops
/// ships its batch at once all the same (the next progress, or the waker).
const BIG_LINGER_NS: u64 = 250_000;
/// Spare buffers of big batches kept per worker.
const SPARE_MAX: usize = 4;
/// Datagrams longer than this that a blocking `send` hands over are read by UCX in place
/// (never batched: longer than [`BATCH_SMALL`]; sent zero-copy by UCX: past its 16 KiB
/// `ZCOPY_THRESH`, set by the shim).
pub(super) const LENT_MIN: usize = BATCH_SMALL;
/// A blocking `send` of a datagram this long goes in place even in a stream, a message of its
/// own, rather than copied into a batch: the copy into the batch cost more than the system
/// call it saves. `perf dgram-bw` between hosts, alternating pairs, lent / batched: 64 KiB
/// median ~1.06 (14 pairs), 48 KiB ~1.17 (6); 40 KiB ~0.92 and 32 KiB ~0.83 (6 each: there
/// batches win, several datagrams a system call).
const STREAM_LENT_MIN: usize = 48 * 1024;
/// How many large datagrams of a stream whose payloads go in place ([`Worker::send_zc_held`]:
/// a queue pair's SENDs) share one message at most: one `sendmsg` for them all over TCP, and
/// one message for UCX and the receiver (`perf send-bw` 64 KiB between hosts, alternating
/// runs against one a message: `docs/multi-host-journal.md`, session 41).
/// `BACKPLANE_SENDS_TOGETHER` (1 to 4) sets it; 1 holds none.
fn sends_together() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("BACKPLANE_SENDS_TOGETHER")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(SENDS_TOGETHER)
            .clamp(1, HELD_PIECES / 2 - 1)
    })
}
/// [`sends_together`]'s default.
const SENDS_TOGETHER: usize = 4;
/// At most this many pieces in a message of held datagrams. (Seven 64 KiB SENDs a message,
/// 14 pieces and the header, broke the pair at once — the message never arrived whole —
/// where six, 12 pieces, went: kept well below.)
const HELD_PIECES: usize = 10;
/// Held datagrams leave at the next progress once the first of them waited this long, even
/// in a stream that goes on...
const HELD_LINGER_NS: u64 = 100_000;
/// ... or once no other came for this long (the stream paused: a program that posts a
/// stream of SENDs and polls in between keeps them; one that polls for their completions
/// has them sent this soon).
const HELD_GAP_NS: u64 = 20_000;
/// How often the waker looks at held datagrams (for a program that went elsewhere: one that
/// polls sends them itself). Not [`DRAIN_EVERY`]: a waker woken every 50 µs through a
/// stream took its receiver's core thousands of times a second.
const HELD_LOOK: Duration = Duration::from_millis(1);
/// A list of datagrams sent together holds at most this many bytes (one message, one of
/// UCX's TCP segments: see [`BIG_BATCH_MAX`]).
pub(super) const LIST_BYTES: usize = BIG_BATCH_MAX;
/// A send that starts this soon after the previous one to the same receiver returned is part
/// of a stream: it joins a batch instead of costing a message (over TCP, a system call on
/// each side) of its own. A request-answer exchange never comes this fast.
const STREAM_GAP_NS: u64 = 2_000;
/// How long a batch waits for more datagrams at most (the waker sends it then, or the
/// endpoint's thread whenever it next receives, waits or sends).
const LINGER_NS: u64 = 50_000;
/// A direct datagram's header (little-endian): magic, sender node, sender port, receiver
/// port (u32 each), the sender's connection (u64) and the datagram's number on it (u64).
const HEAD: usize = 32;
/// Datagrams a receiver holds for one connection while an earlier one is still to come.
const HELD_MAX: usize = 4096;
/// Unsent bytes a sender lets UCX hold before it waits for its receiver.
const WINDOW: usize = 8 << 20;
/// Bytes a receiver takes off the wire before its program reads them. Small enough that a
/// datagram is still in the cache when the program reads it (a core's L2 here is 2 MiB, and
/// UCX's receive segment and the kernel's copy pass through it too): with 8 MiB a stream of
/// 64 KiB datagrams between hosts ran 12-19 % slower (two A/Bs of 4 alternating runs each:
/// medians 3 363 → 3 805 and 2 858 → 3 400 MB/s; WRITE and SEND streams +4 % and +2 %,
/// within the noise). Past it, TCP's window holds the sender back. (The sender's [`WINDOW`]
/// at 1, 2 or 4 MiB instead of 8 made no difference.)
const QUEUE_MAX: usize = 512 << 10;
/// How long a closing endpoint waits for UCX to send what it holds.
const FLUSH_PATIENCE: Duration = Duration::from_secs(2);

/// Why a direct send did not go.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Blocked {
    /// The receiver is behind: wait (or `WouldBlock`).
    Full,
    /// The connection failed: the route's end is on its way from the supervisors.
    Failed,
}

/// One outgoing connection.
struct Out {
    ep: EpId,
    /// The receiver.
    dst: Addr,
    failed: bool,
    /// Names the connection to the receiver (its numbering starts again with each).
    conn: u64,
    /// The next message's number.
    seq: u64,
    /// When the last send returned (CLOCK_MONOTONIC ns).
    last_send: u64,
    /// A batch being filled: header room, then datagrams, in `batch[..used]` (`used` 0:
    /// none). The buffer keeps its length between batches (zeroed once, not per datagram).
    batch: Vec<u8>,
    used: usize,
    /// When its first datagram came.
    batch_since: u64,
    /// Large datagrams of a stream whose payloads UCX will read in place, waiting for the next
    /// ones to share their message (a list): [`Worker::send_zc_held`]. Never both this and a
    /// batch: each ships before the other takes a datagram.
    held: Vec<MsgPiece>,
    /// Their lengths (one each).
    held_lens: Vec<usize>,
    /// Their bytes.
    held_len: usize,
    /// When the first of them came, and the last.
    held_since: u64,
    held_last: u64,
}

impl Out {
    /// Whether a batch or held datagrams wait to go to this receiver (that can still take
    /// them).
    fn waits(&self) -> bool {
        (self.used != 0 || !self.held.is_empty()) && !self.failed
    }
}

/// What a received message's header says (checked).
struct Header {
    src: Addr,
    conn: u64,
    seq: u64,
    /// A batch's datagrams (offset, length); empty for a single datagram.
    items: Vec<(usize, usize)>,
}

/// A received message from `src`: one datagram, or a batch of several.
struct Msg {
    src: Addr,
    bytes: Bytes,
    /// A batch's datagrams (offset, length); empty for a single datagram after the header.
    items: Vec<(usize, usize)>,
    /// The next datagram of a batch to read.
    next: usize,
}

impl Msg {
    fn front(&self) -> (usize, usize) {
        match self.items.get(self.next) {
            Some(&i) => i,
            None => (HEAD, self.bytes.len() - HEAD),
        }
    }
}

/// A batch's datagrams (offset, length each), if it is well formed: at least one, each at
/// most [`crate::wire::MAX_DGRAM`], filling the message exactly.
fn batch_items(msg: &[u8]) -> Option<Vec<(usize, usize)>> {
    let mut out = Vec::new();
    let mut at = HEAD;
    while at < msg.len() {
        let n = u32::from_le_bytes(msg.get(at..at + 4)?.try_into().ok()?) as usize;
        at += 4;
        if n > crate::wire::MAX_DGRAM || msg.len() - at < n {
            return None;
        }
        out.push((at, n));
        at += n;
    }
    (!out.is_empty()).then_some(out)
}

/// A list's datagrams (offset, length each), if it is well formed: at least one, each at most
/// [`crate::wire::MAX_DGRAM`], filling the message exactly.
fn list_items(msg: &[u8]) -> Option<Vec<(usize, usize)>> {
    let word = |at: usize| -> Option<usize> {
        Some(u32::from_le_bytes(msg.get(at..at + 4)?.try_into().ok()?) as usize)
    };
    let k = word(HEAD)?;
    if k == 0 || k > LIST_MAX {
        return None;
    }
    let mut out = Vec::with_capacity(k);
    let mut at = HEAD + 4 + 4 * k;
    for i in 0..k {
        let n = word(HEAD + 4 + 4 * i)?;
        if n > crate::wire::MAX_DGRAM || msg.len().checked_sub(at)? < n {
            return None;
        }
        out.push((at, n));
        at += n;
    }
    (at == msg.len()).then_some(out)
}

/// A receiver's state of one sender's connection.
#[derive(Default)]
struct Order {
    /// The number of the datagram to queue next.
    next: u64,
    /// Later ones that came first.
    held: BTreeMap<u64, Msg>,
}

impl Order {
    /// The datagram numbered `next` was queued or read: the held ones that follow it on
    /// move to `queue` (`held_bytes` no longer counts them).
    fn passed(&mut self, queue: &mut VecDeque<Msg>, held_bytes: &mut usize) {
        self.next += 1;
        while let Some(m) = self.held.remove(&self.next) {
            *held_bytes -= m.bytes.len();
            queue.push_back(m);
            self.next += 1;
        }
    }
}

/// A fresh connection name: the clock, the process and a counter.
fn conn_name() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    crate::sync::now_ns() ^ (u64::from(std::process::id()) << 40) ^ n.rotate_right(16)
}

/// Writes a message's header into `h` ([`HEAD`] bytes).
fn head(h: &mut [u8], magic: u32, me: Addr, dst_port: u32, conn: u64, seq: u64) {
    for (k, v) in [magic, me.node, me.port, dst_port].into_iter().enumerate() {
        h[4 * k..4 * k + 4].copy_from_slice(&v.to_le_bytes());
    }
    h[16..24].copy_from_slice(&conn.to_le_bytes());
    h[24..32].copy_from_slice(&seq.to_le_bytes());
}

/// A direct endpoint's UCX worker and what it received (behind [`Direct`]'s lock).
struct Worker {
    link: Link,
    /// The address its listener listens on.
    ip: IpAddr,
    me: Addr,
    nodes: u32,
    queue: VecDeque<Msg>,
    /// Whether `queue` holds a datagram, readable without the worker's lock (set whenever
    /// `queue` changes): a hint for a reader that takes only what already came, which right
    /// after a look that read what came would otherwise lock the worker to find nothing
    /// ([`Direct::may_have_queued`]).
    has_queued: Arc<AtomicBool>,
    /// Bytes taken off the wire and not read yet: in `queue`, or held in `order` for an
    /// earlier datagram of their connection.
    queued: usize,
    /// Of those, the held ones: they never stop the worker from taking more (the datagram
    /// they wait for is still to come: UCX's lanes may deliver a large message before a small
    /// one sent earlier).
    held_bytes: usize,
    /// (Fx: keys the supervisors gave; looked up on every send.)
    out: FxHashMap<SocketAddr, Out>,
    /// Each sender connection's numbering.
    order: FxHashMap<(Addr, u64), Order>,
    /// Which sender connection each endpoint carries (to forget it when it fails, and to send
    /// that sender our own datagrams over it).
    senders: FxHashMap<EpId, (Addr, u64)>,
    /// Messages that were not ours or were malformed (counted as drops by the endpoint).
    rejected: u64,
    /// Batches of the look under way whose first datagrams the reader took in place before it
    /// declined one (sender, connection, number, how many taken): queued by [`Worker::take`]
    /// from the first declined on.
    partly_read: Vec<((Addr, u64), u64, usize)>,
    sends: u32,
    /// Some connection has a batch waiting.
    batching: bool,
    /// Small datagrams join a batch whatever their pace, until [`Direct::uncork`].
    corked: bool,
    /// The events of a poll (kept: one allocation, not one per arrival).
    events: Vec<Event>,
    /// A datagram was sent since [`Direct::cork`].
    sent_corked: bool,
    /// Buffers of big batches that UCX let go of, for the next ones (see [`Worker::ship`]).
    spare: Arc<Mutex<Vec<Vec<u8>>>>,
    /// A thread sleeps on the worker's fd ([`Direct::arm_fd`]) and is told through this
    /// eventfd when a look queues what came (UCX's fd then says nothing of it): any look, the
    /// waker's or a sender's that made room. (Cleared once told: the next sleep arms it again.)
    sleeper: Option<Arc<OwnedFd>>,
}

impl Worker {
    /// A worker listening on `ip`: one an earlier endpoint of this process left (see
    /// [`IDLE`]), else a new one.
    fn open(ip: IpAddr, nodes: u32) -> Result<Self, String> {
        let kept = {
            let mut idle = IDLE.lock().unwrap_or_else(|e| e.into_inner());
            idle.iter()
                .position(|w| w.ip == ip)
                .map(|i| idle.swap_remove(i))
        };
        if let Some(w) = kept {
            return Ok(Self::with_link(w.link, ip, nodes));
        }
        // A process in a node's network namespace (`exec` on a fabric with IP over it) does
        // not have the host's address unless its links work from the supervisor's namespace
        // (`dgram::reach_hosts_from`): UCX would fail to listen, say so on the program's
        // stderr, and the endpoint would go through the bridges anyway. Ask the kernel first,
        // quietly, in the namespace the links make their sockets in.
        if !backplane_ucx::address_is_local(ip) {
            return Err(format!("{ip} is not an address of this network namespace"));
        }
        // No shared memory between hosts (see `Link::open_with`).
        let link =
            Link::open_with(Some(SocketAddr::new(ip, 0)), false).map_err(|e| e.to_string())?;
        Ok(Self::with_link(link, ip, nodes))
    }

    /// A worker of `link` (open, nothing connected), as new.
    fn with_link(link: Link, ip: IpAddr, nodes: u32) -> Self {
        Self {
            link,
            ip,
            me: Addr::new(0, 0),
            nodes,
            queue: VecDeque::new(),
            has_queued: Arc::new(AtomicBool::new(false)),
            queued: 0,
            held_bytes: 0,
            out: FxHashMap::default(),
            order: FxHashMap::default(),
            senders: FxHashMap::default(),
            rejected: 0,
            partly_read: Vec::new(),
            spare: Arc::default(),
            sends: 0,
            batching: false,
            corked: false,
            events: Vec::new(),
            sent_corked: false,
            sleeper: None,
        }
    }

    /// Connects to the receiver listening at `to` (once; later calls reuse the connection
    /// unless it failed).
    fn connect(&mut self, to: SocketAddr, dst: Addr) -> Result<(), String> {
        if self.out.get(&to).is_some_and(|o| !o.failed) {
            return Ok(());
        }
        // A failed connection's endpoint was closed when it failed (and its index may be
        // another's now): nothing to close.
        self.out.remove(&to);
        // A receiver that already sends to us does so over a connection of its own worker,
        // which carries our datagrams too: one TCP connection between the two, whose
        // acknowledgements ride on the answers. (Two — one each way — cost every datagram a
        // segment of bare acknowledgement, ~0.8 µs of `dgram-lat`'s 4.4 here.)
        let theirs = self
            .senders
            .iter()
            .find(|&(_, &(src, _))| src == dst)
            .map(|(&ep, _)| ep);
        let ep = match theirs {
            Some(ep) => ep,
            None => self.link.connect(to).map_err(|e| e.to_string())?,
        };
        self.out.insert(
            to,
            Out {
                ep,
                dst,
                failed: false,
                conn: conn_name(),
                seq: 0,
                last_send: 0,
                batch: Vec::new(),
                used: 0,
                batch_since: 0,
                held: Vec::new(),
                held_lens: Vec::new(),
                held_len: 0,
                held_since: 0,
                held_last: 0,
            },
        );
        Ok(())
    }

    /// Forgets the connection to `to` (its route ended).
    fn disconnect(&mut self, to: SocketAddr) {
        // A connection the receiver sends us datagrams over stays until it fails (the
        // receiver's worker closes it).
        if let Some(o) = self
            .out
            .remove(&to)
            .filter(|o| !o.failed && !self.senders.contains_key(&o.ep))
        {
            self.link.close(o.ep);
        }
    }

    /// Sends a datagram of at most `len` bytes that `fill` writes in place to `dst`, which
    /// listens at `to`; `Ok(None)` if `fill` declined. In a stream of small datagrams it
    /// joins a batch (sent when full, when it lingered [`LINGER_NS`], or at the next
    /// [`Worker::progress`]) unless `batch` is false: then it goes at once, in a message of
    /// its own, after what a batch held for `to`.
    fn send(
        &mut self,
        to: SocketAddr,
        dst: Addr,
        len: usize,
        (batch, big_ok): (bool, bool),
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<Option<usize>, Blocked> {
        // (One look-up of the connection where nothing waits: `may_send` looks it up too, so
        // only when UCX holds a window's worth — a send's look-ups were ~200 instructions.)
        if self.link.in_flight_bytes() >= WINDOW {
            self.may_send(to)?;
        }
        let now = crate::sync::fast_ns();
        let mut o = match self.out.get_mut(&to) {
            Some(o) if !o.failed => o,
            _ => return Err(Blocked::Failed),
        };
        let streaming = now.saturating_sub(o.last_send) < STREAM_GAP_NS;
        let pending = o.used != 0 || !o.held.is_empty();
        let big = len > BATCH_SMALL;
        let (cap, linger) = if big {
            (BIG_BATCH_MAX, BIG_LINGER_NS)
        } else {
            (BATCH_MAX, LINGER_NS)
        };
        // Large datagrams share a message only in a stream of a program's own datagrams
        // (`big_ok`: their length is known); a queue pair's ring bytes (a loose `len`, corked
        // or not) go straight into a message, one copy, as before.
        let batch = batch && !(big && (self.corked || !big_ok));
        if pending
            && (!o.held.is_empty()
                || !batch
                || o.used + 4 + len > cap
                || now.saturating_sub(o.batch_since) > linger)
        {
            // What came before goes first.
            self.ship(to)?;
            o = self.out.get_mut(&to).ok_or(Blocked::Failed)?;
        }
        // (A batch shipped above for lingering too long ended its stream unless this send
        // still is one.)
        if batch && (o.used != 0 || streaming || self.corked && !big) {
            if o.used == 0 {
                o.used = HEAD;
                o.batch_since = now;
            }
            let at = o.used;
            if o.batch.len() < at + 4 + len {
                // (Zeroed once: a buffer keeps its length from batch to batch.)
                let want = (at + 4 + len).max(if big { BIG_BATCH_MAX } else { 0 });
                o.batch.resize(want, 0);
            }
            let Some(n) = fill(&mut o.batch[at + 4..at + 4 + len]).filter(|&n| n <= len) else {
                o.used = if at == HEAD { 0 } else { at };
                return Ok(None);
            };
            o.batch[at..at + 4].copy_from_slice(&(n as u32).to_le_bytes());
            o.used = at + 4 + n;
            o.last_send = now;
            self.batching = true;
            return Ok(Some(n));
        }
        let (ep, conn, seq) = (o.ep, o.conn, o.seq);
        let me = self.me;
        let mut used = None;
        let r = self.link.send_with(ep, HEAD + len, |buf| {
            let (h, body) = buf.split_at_mut(HEAD);
            let n = fill(body).filter(|&n| n <= len)?;
            head(h, MAGIC, me, dst.port, conn, seq);
            used = Some(n);
            Some(HEAD + n)
        });
        match r {
            // The count and the stream's clock (when this send returned) on the connection
            // at hand: `after_send` looked it up again, a hash look-up a datagram.
            Ok(sent) => {
                o.seq += sent as u64;
                o.last_send = crate::sync::fast_ns();
                self.after_counted(to);
            }
            Err(e) => self.sent(to, Err(e))?,
        }
        Ok(used)
    }

    /// Accounts for a message to `to` that UCX took or refused (`r`, as [`Worker::sent`]);
    /// what UCX could not send at once goes out as the worker progresses, and a sender that
    /// only sends still looks at its worker now and then (failures, a peer's sends).
    fn after_send(
        &mut self,
        to: SocketAddr,
        r: Result<u64, backplane_ucx::Error>,
    ) -> Result<(), Blocked> {
        let n = match r {
            Ok(n) => n,
            Err(e) => return self.sent(to, Err(e)),
        };
        // ([`Worker::sent`]'s count and the stream's clock in one look-up.)
        if let Some(o) = self.out.get_mut(&to) {
            o.seq += n;
            o.last_send = crate::sync::fast_ns();
        }
        self.after_counted(to);
        Ok(())
    }

    /// [`Worker::after_send`] once the message is counted on its connection `to`: a sender
    /// that only sends still looks at its worker now and then, and at once while UCX holds
    /// bytes (the stream's clock then restarts after the look).
    fn after_counted(&mut self, to: SocketAddr) {
        self.sends = self.sends.wrapping_add(1);
        if self.link.in_flight_bytes() != 0 || self.sends.is_multiple_of(64) {
            self.poll();
            if let Some(o) = self.out.get_mut(&to) {
                o.last_send = crate::sync::fast_ns();
            }
        }
    }

    /// Sends a datagram of `head_bytes`, `body`'s bytes and `tail` to `dst`, which listens at
    /// `to`, with UCX reading `body` in place (never batched: what a batch holds for `to`
    /// goes first).
    fn send_zc(
        &mut self,
        to: SocketAddr,
        dst: Addr,
        (head_bytes, body, tail): (&[u8], Box<dyn backplane_ucx::InPlace>, &[u8]),
    ) -> Result<(), Blocked> {
        self.may_send(to)?;
        // What came before goes first.
        self.ship(to)?;
        let o = self.out.get_mut(&to).ok_or(Blocked::Failed)?;
        let (ep, conn, seq) = (o.ep, o.conn, o.seq);
        let mut h = Vec::with_capacity(HEAD + head_bytes.len());
        h.resize(HEAD, 0);
        head(&mut h, MAGIC, self.me, dst.port, conn, seq);
        h.extend_from_slice(head_bytes);
        let r = self.link.send_zc(ep, &h, body, tail);
        self.after_send(to, r.map(|()| 1))
    }

    /// As [`Worker::send_zc`], for a datagram whose payload stays readable until UCX lets go
    /// of it however long that is (a queue pair's SEND: its buffer is the pair's until the
    /// SEND completes): in a stream of large ones it waits for the next ones to share its
    /// message, a list read in place — until [`sends_together`] of them wait, another
    /// datagram goes to `to`, or the next progress (the endpoint's thread's, or the waker's
    /// within [`HELD_LOOK`]) finds the first there [`HELD_LINGER_NS`] or the stream paused
    /// [`HELD_GAP_NS`].
    fn send_zc_held(
        &mut self,
        to: SocketAddr,
        dst: Addr,
        (head_bytes, body, tail): (&[u8], Box<dyn backplane_ucx::InPlace>, &[u8]),
    ) -> Result<(), Blocked> {
        let together = sends_together();
        let body_len = body.bytes().1;
        let len = head_bytes.len() + body_len + tail.len();
        // (At most 3 pieces more: within what one message may have, see `HELD_PIECES`.)
        let room = |o: &Out| {
            o.held_lens.len() < together
                && o.held.len() + 3 <= HELD_PIECES
                && HEAD + 4 + 4 * LIST_MAX + o.held_len + len <= LIST_BYTES
        };
        let o = self.out.get(&to).ok_or(Blocked::Failed)?;
        if together < 2 || body_len < STREAM_LENT_MIN || o.dst != dst {
            return self.send_zc(to, dst, (head_bytes, body, tail));
        }
        self.may_send(to)?;
        let now = crate::sync::fast_ns();
        let o = self.out.get(&to).ok_or(Blocked::Failed)?;
        if o.used != 0 || !o.held.is_empty() && !room(o) {
            // What came before goes first.
            self.ship(to)?;
        }
        let o = self.out.get_mut(&to).ok_or(Blocked::Failed)?;
        let stream = now.saturating_sub(o.last_send.max(o.held_last)) < STREAM_GAP_NS;
        if !room(o) || !stream && o.held.is_empty() {
            return self.send_zc(to, dst, (head_bytes, body, tail));
        }
        if o.held.is_empty() {
            o.held_since = now;
        }
        // (Its pieces as the message will have them: one `sendmsg` reads them all. Its head
        // joins the bytes before it: the pieces are the message's iovs, and they are few.)
        match o.held.last_mut() {
            _ if head_bytes.is_empty() => {}
            Some(MsgPiece::Owned(before)) => before.extend_from_slice(head_bytes),
            _ => o.held.push(MsgPiece::Owned(head_bytes.to_vec())),
        }
        o.held.push(MsgPiece::Lent(body));
        if !tail.is_empty() {
            o.held.push(MsgPiece::Owned(tail.to_vec()));
        }
        o.held_lens.push(len);
        o.held_len += len;
        o.held_last = now;
        self.batching = true;
        if o.held_lens.len() >= together {
            // (Refused for now: it stays, and goes at a later progress.)
            match self.ship(to) {
                Ok(()) | Err(Blocked::Full) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Sends what [`Worker::send_zc_held`] holds for `to` as one message: a plain datagram
    /// for one, a list for several. Refused for now (`Full`), they stay.
    fn ship_held(&mut self, to: SocketAddr) -> Result<(), Blocked> {
        let me = self.me;
        let o = self.out.get_mut(&to).ok_or(Blocked::Failed)?;
        let pieces = std::mem::take(&mut o.held);
        let lens = std::mem::take(&mut o.held_lens);
        let held_len = std::mem::take(&mut o.held_len);
        let (ep, conn, seq) = (o.ep, o.conn, o.seq);
        let mut h = Vec::with_capacity(HEAD + 4 + 4 * lens.len());
        h.resize(HEAD, 0);
        if let [_] = lens[..] {
            head(&mut h, MAGIC, me, o.dst.port, conn, seq);
        } else {
            head(&mut h, MAGIC_LIST, me, o.dst.port, conn, seq);
            h.extend_from_slice(&(lens.len() as u32).to_le_bytes());
            for &n in &lens {
                h.extend_from_slice(&(n as u32).to_le_bytes());
            }
        }
        let r = match self.link.send_pieces(ep, &h, pieces, &[]) {
            Ok(()) => Ok(()),
            Err((e, back)) => {
                // Refused (UCX let go of them at once): they wait for another try.
                if let Some(o) = self.out.get_mut(&to) {
                    (o.held, o.held_lens, o.held_len) = (back, lens, held_len);
                }
                Err(e)
            }
        };
        self.after_send(to, r.map(|()| 1))
    }

    /// Sends the datagrams of `list` (at most [`LIST_MAX`], [`LIST_PIECES`] pieces of memory
    /// and [`LIST_FRAME_BYTES`]) to `dst`, which listens at `to`,
    /// as one message whose pieces UCX reads in place — no copy into a message — and returns
    /// once UCX let go of them (the message left, or failed): see [`Link::send_lent`]. While it waits, what
    /// arrives is queued as [`Worker::poll`] queues it (past [`QUEUE_MAX`] by at most what
    /// arrives meanwhile); `alive` is asked every [`LENT_CHECK`] whether the receiver may
    /// still take it — false (its node or host is gone) closes the connection, and the send
    /// fails once UCX let go. `Ok(false)`, nothing sent, for one datagram while a batch
    /// waits for `to`, or one shorter than [`STREAM_LENT_MIN`] in a stream (the last send to
    /// `to` returned less than [`STREAM_GAP_NS`] ago): [`Worker::send`] then puts it in a
    /// batch — one message of up to [`BIG_BATCH_MAX`] for several, whose copy costs less
    /// than a message each.
    fn send_lent(
        &mut self,
        to: SocketAddr,
        dst: Addr,
        list: &[&[u8]],
        alive: &mut dyn FnMut() -> bool,
    ) -> Result<bool, Blocked> {
        let o = self.out.get(&to).ok_or(Blocked::Failed)?;
        let stream = crate::sync::fast_ns().saturating_sub(o.last_send) < STREAM_GAP_NS;
        // (A stream's datagram of `STREAM_LENT_MIN` or more goes in place too: see there.)
        if list.is_empty()
            || list.len() > LIST_MAX
            || list_pieces(list) > LIST_PIECES
            || list.iter().map(|d| d.len()).sum::<usize>() > LIST_FRAME_BYTES
            || list.len() == 1 && (o.used != 0 || stream && list[0].len() < STREAM_LENT_MIN)
        {
            return Ok(false);
        }
        self.may_send(to)?;
        // What came before goes first.
        self.ship(to)?;
        let o = self.out.get_mut(&to).ok_or(Blocked::Failed)?;
        let (ep, conn, seq) = (o.ep, o.conn, o.seq);
        let mut h = Vec::with_capacity(HEAD + 4 + 4 * list.len());
        h.resize(HEAD, 0);
        if let [_] = list {
            head(&mut h, MAGIC, self.me, dst.port, conn, seq);
        } else {
            head(&mut h, MAGIC_LIST, self.me, dst.port, conn, seq);
            h.extend_from_slice(&(list.len() as u32).to_le_bytes());
            for d in list {
                h.extend_from_slice(&(d.len() as u32).to_le_bytes());
            }
        }
        let mut events = std::mem::take(&mut self.events);
        let mut next_check = Instant::now() + LENT_CHECK;
        let mut gave_up = false;
        let r = self.link.send_lent(ep, (&h, list), |link| {
            link.poll_some_into(&mut events);
            gave_up |= events
                .iter()
                .any(|e| matches!(e, Event::Failed(failed, _) if *failed == ep));
            let now = Instant::now();
            if !gave_up && now >= next_check {
                next_check = now + LENT_CHECK;
                gave_up = !alive();
            }
            !gave_up
        });
        self.handle(&mut events);
        self.events = events;
        if gave_up {
            // Closed (by UCX or above): the connection is done with, as after a failure.
            if let Some(o) = self.out.get_mut(&to) {
                o.failed = true;
            }
            return Err(Blocked::Failed);
        }
        self.after_send(to, r.map(|()| 1)).map(|()| true)
    }

    /// Whether a message to `to` may go now: its connection is not broken, and UCX holds
    /// fewer than [`WINDOW`] unsent bytes (after a look at the worker).
    fn may_send(&mut self, to: SocketAddr) -> Result<(), Blocked> {
        if self.out.get(&to).is_none_or(|o| o.failed) {
            return Err(Blocked::Failed);
        }
        if self.link.in_flight_bytes() >= WINDOW {
            self.progress();
            if self.link.in_flight_bytes() >= WINDOW {
                return Err(Blocked::Full);
            }
        }
        Ok(())
    }

    /// Accounts for a message handed to UCX (`Ok(n)`: n messages went, 0 or 1).
    fn sent(
        &mut self,
        to: SocketAddr,
        r: Result<u64, backplane_ucx::Error>,
    ) -> Result<(), Blocked> {
        match r {
            Ok(n) => {
                if let Some(o) = self.out.get_mut(&to) {
                    o.seq += n;
                }
                Ok(())
            }
            // UCS_ERR_NO_RESOURCE: too many sends in flight.
            Err(e) if e.status == -2 => {
                self.poll();
                Err(Blocked::Full)
            }
            Err(_) => {
                if let Some(o) = self.out.get_mut(&to) {
                    o.failed = true;
                }
                Err(Blocked::Failed)
            }
        }
    }

    /// Sends the batch waiting for `to`, if any.
    fn ship(&mut self, to: SocketAddr) -> Result<(), Blocked> {
        if self.out.get(&to).is_some_and(|o| !o.held.is_empty()) {
            return self.ship_held(to);
        }
        let me = self.me;
        let Some(o) = self.out.get_mut(&to).filter(|o| o.used != 0) else {
            return Ok(());
        };
        let used = o.used;
        // A batch of one (a corked sender's lone datagram) goes as a plain datagram: the
        // receiver then makes no list of its items.
        let first = o
            .batch
            .get(HEAD..HEAD + 4)
            .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
        let lone = HEAD + 4 + first == used;
        // Large datagrams (a stream's) go in place, even one alone (as a batch of one).
        let in_place = used > BATCH_MAX || first > BATCH_SMALL;
        let magic = if lone && !in_place {
            MAGIC
        } else {
            MAGIC_BATCH
        };
        head(&mut o.batch[..HEAD], magic, me, o.dst.port, o.conn, o.seq);
        let r = if lone && !in_place {
            self.link
                .send2(o.ep, &o.batch[..HEAD], &o.batch[HEAD + 4..used])
        } else if in_place {
            // A stream of large datagrams: the buffer itself goes to UCX (no copy into a
            // message), and a spare one takes its place; UCX hands it back when done.
            let spare = {
                let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
                spare.truncate(SPARE_MAX);
                spare.pop()
            };
            let full = std::mem::replace(&mut o.batch, spare.unwrap_or_default());
            let back = self.spare.clone();
            let recycle = Box::new(move |b: Vec<u8>| {
                back.lock().unwrap_or_else(|e| e.into_inner()).push(b);
            });
            let body = backplane_ucx::OwnedBytes::new(full, used, recycle);
            let r = self.link.send_zc(o.ep, &[], Box::new(body), &[]);
            if r.is_err() {
                // Refused before it went (the shim released it at once, on this thread: the
                // buffer is the one just recycled): the batch is kept, as a copied one is.
                let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(full) = spare.pop() {
                    spare.push(std::mem::replace(&mut o.batch, full));
                }
            }
            r
        } else {
            self.link.send(o.ep, &o.batch[..used])
        };
        if let (Ok(()), Some(o)) = (&r, self.out.get_mut(&to)) {
            o.used = 0;
        }
        self.sent(to, r.map(|()| 1))
    }

    /// How the waker should look after what UCX or a batch still holds, if anything: after a
    /// send, whatever is left (a batch, a queued message, bytes in a transport's buffer)
    /// leaves even if the sending thread goes elsewhere now.
    fn drain_mode(&mut self) -> Option<u32> {
        match (self.holds(), self.batching) {
            (false, _) => None,
            // Held datagrams alone: a slow look is enough (see `HELD_LOOK`).
            (true, true) if self.holds_only_held() => Some(HELD),
            _ => Some(DRAIN),
        }
    }

    /// Whether UCX or a batch still holds something to send.
    fn holds(&mut self) -> bool {
        self.batching || self.link.in_flight_bytes() != 0 || !self.link.idle()
    }

    /// Sends every batch waiting (those that cannot go now stay).
    fn ship_all(&mut self) {
        // (Nearly always one: no list made for it.)
        let mut tried = 0;
        let waits = Out::waits;
        while let Some(to) = self
            .out
            .iter()
            .filter(|(_, o)| waits(o))
            .map(|(&to, _)| to)
            .nth(tried)
        {
            let _ = self.ship(to);
            // One that is still waiting (UCX full) is passed over now.
            if self.out.get(&to).is_some_and(waits) {
                tried += 1;
            }
        }
        self.batching = self.out.values().any(waits);
    }

    /// Makes progress: sends go out, received datagrams are queued in their senders' order
    /// (while fewer than [`QUEUE_MAX`] bytes wait), failures are noted.
    fn progress(&mut self) {
        if self.batching {
            if self.any_due() {
                self.ship_all();
            } else if !self.out.values().any(Out::waits) {
                // Every batch left with a later send to its receiver (`send` ships what
                // waits first), which does not look at the others: nothing is batching. (The
                // flag stayed set, and with it the waker's look every HELD_LOOK, for as long
                // as the endpoint lived: ~1 000 wake-ups a second of an idle node's agent
                // after IP traffic between hosts.)
                self.batching = false;
            }
        }
        self.poll();
    }

    /// Whether a batch waits, or held datagrams whose stream paused ([`HELD_GAP_NS`]) or
    /// that waited [`HELD_LINGER_NS`] (those of a stream going on wait for the next ones).
    fn any_due(&self) -> bool {
        let now = crate::sync::fast_ns();
        self.out.values().any(|o| {
            !o.failed
                && (o.used != 0
                    || !o.held.is_empty()
                        && (now.saturating_sub(o.held_last) > HELD_GAP_NS
                            || now.saturating_sub(o.held_since) > HELD_LINGER_NS))
        })
    }

    /// Whether all the worker keeps back is held datagrams (no batch, nothing in UCX).
    fn holds_only_held(&mut self) -> bool {
        self.link.in_flight_bytes() == 0
            && self.out.values().all(|o| o.used == 0 || o.failed)
            && self.link.idle()
    }

    /// [`Worker::progress`] without sending the batches.
    fn poll(&mut self) {
        self.poll_offering(None);
    }

    /// [`Worker::poll`]; while no datagram is queued, the next one in order is offered to
    /// `read` first, in place in UCX's receive buffer: one it takes (returns true) is read
    /// without a copy (a 64 KiB stream between hosts copied each datagram out of UCX's
    /// buffer into a queue, and out of the queue again). A batch's datagrams are offered one
    /// after another (a 1 MiB stream of `send_many`s copied every batch whole); what comes
    /// after one it declined — the rest of a batch too — is queued as before.
    fn poll_offering(&mut self, read: Option<&mut InPlace<'_>>) {
        let had = self.queue.len();
        self.poll_offering_inner(read);
        if self.queue.len() > had {
            if let Some(fd) = self.sleeper.take() {
                let _ = rustix::io::write(&*fd, &1u64.to_ne_bytes());
            }
        }
    }

    /// [`Worker::poll_offering`] but for telling a sleeper.
    fn poll_offering_inner(&mut self, read: Option<&mut InPlace<'_>>) {
        if self.readable() >= QUEUE_MAX {
            return;
        }
        let mut events = std::mem::take(&mut self.events);
        match read {
            Some(read) if self.queue.is_empty() => {
                let Worker {
                    link,
                    me,
                    nodes,
                    queue,
                    held_bytes,
                    out,
                    order,
                    senders,
                    partly_read,
                    ..
                } = self;
                let mut offer = |from: Option<EpId>, msg: &[u8]| -> bool {
                    // (Anything else is left to `take`, which queues, holds or refuses it.)
                    let Some(h) = Self::check_for(*me, *nodes, msg) else {
                        return false;
                    };
                    if !queue.is_empty() {
                        return false;
                    }
                    let o = order.entry((h.src, h.conn)).or_default();
                    if h.seq != o.next {
                        return false;
                    }
                    if h.items.is_empty() {
                        if !read(h.src, &msg[HEAD..]) {
                            return false;
                        }
                    } else {
                        // (The items lie inside the message: `check_for` made them so.)
                        let took = h
                            .items
                            .iter()
                            .take_while(|&&(at, len)| read(h.src, &msg[at..at + len]))
                            .count();
                        if took < h.items.len() {
                            if took != 0 {
                                partly_read.push(((h.src, h.conn), h.seq, took));
                            }
                            return false;
                        }
                    }
                    o.passed(queue, held_bytes);
                    Self::note_sender(*me, out, senders, from, (h.src, h.conn));
                    true
                };
                link.poll_some_with(&mut events, &mut offer);
            }
            _ => self.link.poll_some_into(&mut events),
        }
        self.handle(&mut events);
        // (A batch read in part is among the events just handled, unless the link lost it.)
        self.partly_read.clear();
        self.events = events;
    }

    /// Takes in the events of a poll (messages queued in order, failures noted).
    fn handle(&mut self, events: &mut Vec<Event>) {
        for ev in events.drain(..) {
            match ev {
                Event::Message(from, msg) => self.take(from, msg),
                Event::Failed(ep, _) => {
                    self.link.close(ep);
                    // (A failed one keeps its index, which a later connect may reuse.)
                    if let Some(o) = self.out.values_mut().find(|o| o.ep == ep && !o.failed) {
                        o.failed = true;
                    }
                    // A sender gone: forget its numbering once nothing of it waits (and no
                    // other connection carries it: see `take`).
                    if let Some(key) = self.senders.remove(&ep) {
                        if self.order.get(&key).is_some_and(|o| o.held.is_empty())
                            && !self.senders.values().any(|&k| k == key)
                        {
                            self.order.remove(&key);
                        }
                    }
                }
                Event::Dropped(..) => self.rejected += 1,
                Event::Accepted(_) => {}
            }
        }
        self.note_queue();
    }

    /// A message from a sender: queued if it is the next of its connection, held if an
    /// earlier one is still to come, refused if it is malformed, not for us, or a repeat.
    fn take(&mut self, from: Option<EpId>, msg: Bytes) {
        let Some(Header {
            src,
            conn,
            seq,
            items,
        }) = self.check(&msg)
        else {
            self.rejected += 1;
            return;
        };
        let o = self.order.entry((src, conn)).or_default();
        if seq < o.next || o.held.contains_key(&seq) || o.held.len() >= HELD_MAX {
            self.rejected += 1;
            return;
        }
        Self::note_sender(self.me, &mut self.out, &mut self.senders, from, (src, conn));
        self.queued += msg.len();
        // A batch whose first datagrams were read in place as it came: the rest only.
        let next = match self
            .partly_read
            .iter()
            .position(|&(k, s, _)| k == (src, conn) && s == seq)
        {
            Some(i) => self.partly_read.swap_remove(i).2.min(items.len()),
            None => 0,
        };
        let msg = Msg {
            src,
            bytes: msg,
            items,
            next,
        };
        if seq > o.next {
            self.held_bytes += msg.bytes.len();
            o.held.insert(seq, msg);
            return;
        }
        self.queue.push_back(msg);
        o.passed(&mut self.queue, &mut self.held_bytes);
    }

    /// A message of sender connection `key` came over endpoint `from`.
    fn note_sender(
        me: Addr,
        out: &mut FxHashMap<SocketAddr, Out>,
        senders: &mut FxHashMap<EpId, (Addr, u64)>,
        from: Option<EpId>,
        key: (Addr, u64),
    ) {
        let Some(ep) = from else {
            return;
        };
        if senders.get(&ep) != Some(&key) {
            senders.insert(ep, key);
        }
        // Two endpoints that connected to each other at once (a queue pair's two ends do)
        // each send over their own connection: the one of the greater address moves its
        // datagrams onto the other's (see `connect`). What it sent before may come after:
        // each carries its number, and the receiver puts them back in order.
        let src = key.0;
        if src < me {
            if let Some(o) = out
                .values_mut()
                .find(|o| o.dst == src && o.ep != ep && !o.failed)
            {
                o.ep = ep;
            }
        }
    }

    /// The sender, its connection, the message's number and a batch's datagrams, if the
    /// message is a well-formed datagram or batch for us.
    fn check(&self, msg: &[u8]) -> Option<Header> {
        Self::check_for(self.me, self.nodes, msg)
    }

    /// [`Worker::check`] for a receiver `me` of a fabric of `nodes` nodes.
    fn check_for(me: Addr, nodes: u32, msg: &[u8]) -> Option<Header> {
        let word = |k: usize| {
            let b = msg.get(4 * k..4 * k + 4)?;
            Some(u32::from_le_bytes(b.try_into().ok()?))
        };
        let long = |k: usize| Some(u64::from(word(k)?) | u64::from(word(k + 1)?) << 32);
        let (magic, node, port, dst) = (word(0)?, word(1)?, word(2)?, word(3)?);
        let (conn, seq) = (long(4)?, long(6)?);
        if dst != me.port || !(1..=nodes).contains(&node) {
            return None;
        }
        let items = match magic {
            MAGIC if msg.len() - HEAD <= crate::wire::MAX_DGRAM => Vec::new(),
            MAGIC_BATCH => batch_items(msg)?,
            MAGIC_LIST => list_items(msg)?,
            _ => return None,
        };
        Some(Header {
            src: Addr::new(node, port),
            conn,
            seq,
            items,
        })
    }

    /// The oldest received datagram: its sender and payload.
    fn front(&self) -> Option<(Addr, &[u8])> {
        let m = self.queue.front()?;
        let (off, len) = m.front();
        Some((m.src, &m.bytes[off..off + len]))
    }

    /// Drops the oldest received datagram (read).
    fn pop(&mut self) {
        let Some(m) = self.queue.front_mut() else {
            return;
        };
        m.next += 1;
        if m.next >= m.items.len() {
            self.queued -= m.bytes.len();
            self.queue.pop_front();
            self.note_queue();
        }
    }

    /// Publishes whether a datagram is queued (see `has_queued`).
    fn note_queue(&self) {
        self.has_queued
            .store(!self.queue.is_empty(), Ordering::Relaxed);
    }

    /// Bytes the program can read now (in its senders' order), which [`QUEUE_MAX`] bounds.
    /// (Counting the held ones too stopped a receiver for good: held past the limit, they
    /// kept the worker from taking the datagram they waited for — a stream of mixed sizes
    /// between hosts stalled until its receiver timed out, 3 hosts tests in 15 with the limit
    /// at 512 KiB, now and then at 8 MiB.)
    fn readable(&self) -> usize {
        self.queued - self.held_bytes
    }

    /// Whether a received datagram waits.
    fn has_queued(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Before the receiver sleeps: false if the worker has something to do first.
    fn arm(&mut self) -> bool {
        // At the queue's limit nothing is taken off the wire until the program reads.
        self.readable() >= QUEUE_MAX || self.link.arm()
    }

    /// A sender waiting for its receiver: sleeps until the worker has news (or `timeout`).
    fn wait(&mut self, timeout: Duration) {
        self.progress();
        if !self.link.arm() {
            return;
        }
        let efd = self.link.fd();
        let mut fd = [PollFd::new(&efd, PollFlags::IN)];
        let ts = rustix::time::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        let _ = rustix::event::poll(&mut fd, Some(&ts));
    }

    /// Before the endpoint closes: lets UCX send what it holds (acknowledged sends), for at
    /// most [`FLUSH_PATIENCE`] and only while a connection is up.
    fn flush(&mut self) {
        let start = Instant::now();
        // The receive queue must not stop the worker now: nobody reads it any more.
        self.queue.clear();
        self.note_queue();
        self.order.clear();
        self.queued = 0;
        self.held_bytes = 0;
        self.ship_all();
        while (self.batching || self.link.in_flight_bytes() != 0)
            && start.elapsed() < FLUSH_PATIENCE
            && self.out.values().any(|o| !o.failed)
        {
            self.wait(Duration::from_millis(10));
            self.ship_all();
        }
        // A forced close can reach the receiver before the last bytes, which it then never
        // reads (seen: an endpoint's last datagram, sent just before it closed, lost).
        for (_, o) in self.out.drain() {
            let left = FLUSH_PATIENCE.saturating_sub(start.elapsed());
            if o.failed {
                // Closed when it failed.
            } else if left.is_zero() {
                self.link.close(o.ep);
            } else {
                self.link.close_flush(o.ep, left);
            }
        }
    }
}

/// How often a send whose bytes UCX reads in place asks whether its receiver may still take
/// them, while it waits for UCX to let go of them ([`Worker::send_lent`]).
const LENT_CHECK: Duration = Duration::from_millis(50);

/// What the waker is asked to do (bits of [`Shared::modes`]).
const ARMED: u32 = 1;
const DRAIN: u32 = 2;
/// Held datagrams only (see [`HELD_LOOK`]).
const HELD: u32 = 4;
/// How often the waker looks at a worker that holds unsent messages or a batch.
const DRAIN_EVERY: Duration = Duration::from_nanos(LINGER_NS);
/// ... and how seldom, at most, while nothing leaves (its receiver does not read).
const DRAIN_MAX: Duration = Duration::from_millis(10);
/// How many looks in a row may find the worker locked by the endpoint's thread (~1 ms at
/// [`DRAIN_EVERY`]) before the waker looks less often, up to every [`HELD_LOOK`].
const LOCKED_OUT_LOOKS: u32 = 20;

/// What the endpoint and its waker share.
struct Shared {
    worker: Mutex<Worker>,
    /// [`ARMED`]: the receiver sleeps on its doorbell; [`DRAIN`]: UCX holds unsent messages.
    modes: AtomicU32,
    /// An eventfd: written when a mode is set, and to stop the waker.
    ctl: OwnedFd,
    stop: AtomicBool,
    /// The endpoint's doorbell.
    bell: Word32,
    /// The eventfd a thread asleep on the worker's fd sleeps on too ([`Worker::sleeper`]).
    took: Arc<OwnedFd>,
}

/// A direct endpoint: its worker, and the thread that keeps it going while the endpoint's
/// own thread does not look (see the module's text).
pub(super) struct Direct {
    /// (`None` only once dropped.)
    shared: Option<Arc<Shared>>,
    waker: Option<JoinHandle<()>>,
    /// Sends go at once, each its own message, never into a batch (see [`Direct::alone`]).
    alone: bool,
    /// The worker's `has_queued`.
    has_queued: Arc<AtomicBool>,
}

/// A direct endpoint's worker before the endpoint is bound.
pub(super) struct Unbound {
    worker: Worker,
    port: u16,
}

impl Unbound {
    /// A worker listening on `ip`, for an endpoint of a fabric of `nodes` nodes about to be
    /// bound (with this listener's port, then [`Unbound::bound`]).
    pub(super) fn open(ip: IpAddr, nodes: u32) -> Result<Self, String> {
        let worker = Worker::open(ip, nodes)?;
        let port = worker.link.listen_port();
        Ok(Self { worker, port })
    }

    /// The listener's TCP port.
    pub(super) fn port(&self) -> u16 {
        self.port
    }

    /// The endpoint is bound at `me`, its doorbell is `bell`: starts the waker that rings it.
    /// (On an error the bind fails: senders on other hosts were already told of the port.)
    pub(super) fn bound(self, me: Addr, bell: Word32) -> Result<Direct, String> {
        let Self { mut worker, .. } = self;
        worker.me = me;
        let efd =
            rustix::io::fcntl_dupfd_cloexec(worker.link.fd(), 0).map_err(|e| e.to_string())?;
        let ctl = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
            .map_err(|e| e.to_string())?;
        let took = Arc::new(
            rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )
            .map_err(|e| e.to_string())?,
        );
        let has_queued = worker.has_queued.clone();
        let shared = Arc::new(Shared {
            worker: Mutex::new(worker),
            modes: AtomicU32::new(0),
            ctl,
            stop: AtomicBool::new(false),
            bell,
            took,
        });
        let s = shared.clone();
        let waker = std::thread::Builder::new()
            .name("bp-direct".into())
            .spawn(move || watch(&efd, &s))
            .map_err(|e| e.to_string())?;
        Ok(Direct {
            shared: Some(shared),
            waker: Some(waker),
            alone: false,
            has_queued,
        })
    }
}

/// A reader offered a datagram in place (sender, bytes): true if it took it.
type InPlace<'a> = dyn FnMut(Addr, &[u8]) -> bool + 'a;

/// A received datagram's length and what the reader made of it.
type Taken<R, E> = (usize, Result<R, E>);

impl Direct {
    fn shared(&self) -> &Shared {
        self.shared.as_ref().expect("taken only by drop")
    }

    fn lock(&self) -> MutexGuard<'_, Worker> {
        // A panic while holding the lock leaves a worker still consistent for UCX (every
        // call into it returned): carry on.
        self.shared()
            .worker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Asks the waker for `mode` (it is told only when the mode was not set already).
    fn ask(&self, mode: u32) -> bool {
        if self.shared().modes.fetch_or(mode, Ordering::AcqRel) & mode != 0 {
            return true;
        }
        rustix::io::write(&self.shared().ctl, &1u64.to_ne_bytes()).is_ok()
    }

    /// Connects to the receiver listening at `to` (once; later calls reuse the connection
    /// unless it failed).
    pub(super) fn connect(&mut self, to: SocketAddr, dst: Addr) -> Result<(), String> {
        self.lock().connect(to, dst)
    }

    /// Forgets the connection to `to` (its route ended).
    pub(super) fn disconnect(&mut self, to: SocketAddr) {
        self.lock().disconnect(to);
    }

    /// Sends a datagram of at most `len` bytes that `fill` writes in place to `dst`, which
    /// listens at `to`; `Ok(None)` if `fill` declined. What UCX could not send at once the
    /// waker sends if this thread does not come back soon. `big_ok`: a large datagram may
    /// join a stream's batch (a program's datagram of known length).
    pub(super) fn send(
        &mut self,
        to: SocketAddr,
        dst: Addr,
        len: usize,
        big_ok: bool,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<Option<usize>, Blocked> {
        let batch = !self.alone;
        self.sending(|w| w.send(to, dst, len, (batch, big_ok), fill))
    }

    /// Until called again with false, each datagram goes at once as a message of its own,
    /// written in place into the message UCX sends, whatever the pace (what a batch holds
    /// for its receiver goes first): for a sender with one datagram ready that must not
    /// wait — a queue pair's ring bytes, which a cork would copy into a batch and the batch
    /// into the message (see `verbs::direct`). No lock: a flag of the endpoint's.
    pub(super) fn alone(&mut self, on: bool) {
        self.alone = on;
    }

    /// Runs a send on the worker; what it leaves with UCX is seen to (corked: the batch
    /// leaves at `uncork`, which looks then).
    fn sending<R>(&mut self, send: impl FnOnce(&mut Worker) -> R) -> R {
        let mut w = self.lock();
        let r = send(&mut w);
        let corked = w.corked;
        w.sent_corked |= corked;
        // (Under the same lock: a second one for the look cost ~190 instructions a send.)
        let mode = if corked { None } else { w.drain_mode() };
        drop(w);
        if let Some(mode) = mode {
            self.ask(mode);
        }
        r
    }

    /// As [`Direct::send`] for [`Worker::send_lent`]: returns once UCX let go of `list`.
    pub(super) fn send_lent(
        &mut self,
        to: SocketAddr,
        dst: Addr,
        list: &[&[u8]],
        alive: &mut dyn FnMut() -> bool,
    ) -> Result<bool, Blocked> {
        self.sending(|w| w.send_lent(to, dst, list, alive))
    }

    /// As [`Direct::send`] for [`Worker::send_zc_held`].
    pub(super) fn send_zc_held(
        &mut self,
        to: SocketAddr,
        dst: Addr,
        msg: (&[u8], Box<dyn backplane_ucx::InPlace>, &[u8]),
    ) -> Result<(), Blocked> {
        self.sending(|w| w.send_zc_held(to, dst, msg))
    }

    /// From here to [`Direct::uncork`], small datagrams to one receiver share messages: a
    /// sender that has several to send at once (a queue pair's answer, request and acks)
    /// sends them as one (over TCP, one system call and one segment each way).
    pub(super) fn cork(&mut self) {
        self.lock().corked = true;
    }

    /// Sends what waited since [`Direct::cork`].
    pub(super) fn uncork(&mut self) {
        let held = {
            let mut w = self.lock();
            w.corked = false;
            if !std::mem::take(&mut w.sent_corked) {
                return;
            }
            if w.batching {
                w.ship_all();
            }
            w.holds()
        };
        if held {
            self.ask(DRAIN);
        }
    }

    /// Makes progress (see [`Worker::progress`]), then does what [`Direct::take`] does, under
    /// one lock (a poll loop looks at both every time round) — with the datagram read where
    /// UCX received it if none was queued; first the number of messages refused since the
    /// last call.
    pub(super) fn progress_take<R, E>(
        &mut self,
        read: impl FnOnce(Addr, &[u8]) -> Result<R, E>,
    ) -> (u64, Option<Taken<R, E>>) {
        let mut w = self.lock();
        if w.batching {
            w.ship_all();
        }
        // The next datagram may be read where UCX received it (see `Worker::poll_offering`).
        let mut read = Some(read);
        let mut got = None;
        let mut offer = |src: Addr, payload: &[u8]| -> bool {
            let Some(read) = read.take() else {
                return false; // one a call
            };
            let out = read(src, payload);
            let taken = out.is_ok();
            // (Declined, it is queued: it stays the next datagram, as `take` leaves it.)
            got = Some((payload.len(), out));
            taken
        };
        w.poll_offering(Some(&mut offer));
        let rejected = std::mem::take(&mut w.rejected);
        match (got, read) {
            (Some(got), _) => (rejected, Some(got)),
            (None, Some(read)) => (rejected, Self::take_locked(&mut w, read)),
            (None, None) => (rejected, None),
        }
    }

    /// Makes progress (see [`Worker::progress`]) and offers `read` every datagram the poll
    /// brings, in order, where UCX received it, while nothing is queued and `read` takes them
    /// ([`Direct::progress_take`] offers one a call: in a stream, the others of the same poll
    /// were copied out of UCX's buffer into the queue, and out of it again). What `read`
    /// declines (an error), and what comes after, is queued. The number of messages refused
    /// since the last call, the datagrams taken and their bytes, and `read`'s error.
    pub(super) fn progress_take_all<E>(
        &mut self,
        mut read: impl FnMut(Addr, &[u8]) -> Result<(), E>,
    ) -> (u64, usize, usize, Option<E>) {
        let mut w = self.lock();
        if w.batching {
            w.ship_all();
        }
        let (mut n, mut bytes, mut err) = (0, 0, None);
        let mut offer = |src: Addr, payload: &[u8]| -> bool {
            if err.is_some() {
                return false;
            }
            match read(src, payload) {
                Ok(()) => {
                    n += 1;
                    bytes += payload.len();
                    true
                }
                Err(e) => {
                    err = Some(e);
                    false
                }
            }
        };
        w.poll_offering(Some(&mut offer));
        let rejected = std::mem::take(&mut w.rejected);
        (rejected, n, bytes, err)
    }

    /// Gives the oldest received datagram to `read`; it is taken only if `read` returns `Ok`.
    /// `None` if none waits.
    pub(super) fn take<R, E>(
        &mut self,
        read: impl FnOnce(Addr, &[u8]) -> Result<R, E>,
    ) -> Option<(usize, Result<R, E>)> {
        Self::take_locked(&mut self.lock(), read)
    }

    fn take_locked<R, E>(
        w: &mut Worker,
        read: impl FnOnce(Addr, &[u8]) -> Result<R, E>,
    ) -> Option<Taken<R, E>> {
        let (src, payload) = w.front()?;
        let len = payload.len();
        let out = read(src, payload);
        if out.is_ok() {
            w.pop();
        }
        Some((len, out))
    }

    /// Whether a received datagram may wait, without the worker's lock: false only if none
    /// did when the worker last changed its queue (one that another thread queued a moment
    /// ago may be missed: the next look finds it).
    pub(super) fn may_have_queued(&self) -> bool {
        self.has_queued.load(Ordering::Relaxed)
    }

    /// Whether a received datagram waits.
    pub(super) fn has_queued(&self) -> bool {
        self.lock().has_queued()
    }

    /// Before the receiver sleeps on its doorbell: false if the worker has something to do
    /// first; true once the waker watches it (the doorbell rings when UCX has news).
    pub(super) fn arm(&self) -> bool {
        // Without a waker (it could not start) the receiver polls instead of sleeping.
        self.waker.is_some() && self.lock().arm() && self.ask(ARMED)
    }

    /// A sender waiting for its receiver: sleeps until the worker has news (or `timeout`).
    pub(super) fn wait(&mut self, timeout: Duration) {
        self.lock().wait(timeout);
    }

    /// For a thread that sleeps on this worker alone (without the waker): moves it along,
    /// arms it, and returns the fds to wait on with the worker unlocked — the worker's, and
    /// [`Shared::took`], readable once another thread's look (the waker's, a sender's) queued
    /// what came, which the worker's then does not say (the sleeper empties it with
    /// [`drain_took`] before it looks again); `None` when a datagram waits or UCX has more to
    /// do first.
    pub(super) fn arm_fd(&mut self) -> Option<(OwnedFd, Arc<OwnedFd>)> {
        let mut w = self.lock();
        w.progress();
        if w.has_queued() || !w.arm() {
            return None;
        }
        let fd = w.link.fd().try_clone_to_owned().ok()?;
        let took = self.shared().took.clone();
        w.sleeper = Some(took.clone());
        Some((fd, took))
    }
}

/// Empties the eventfd returned by [`Direct::arm_fd`] (after the sleep on it, before the
/// sleeper looks at the worker again: what a look queues after this rings it again).
pub(crate) fn drain_took(fd: &OwnedFd) {
    let mut b = [0u8; 8];
    let _ = rustix::io::read(fd, &mut b);
}

impl Drop for Direct {
    fn drop(&mut self) {
        // What a send acknowledged leaves before the endpoint goes.
        self.lock().flush();
        self.shared().stop.store(true, Ordering::Release);
        let _ = rustix::io::write(&self.shared().ctl, &1u64.to_ne_bytes());
        if let Some(t) = self.waker.take() {
            let _ = t.join();
        }
        // The worker is kept for the next endpoint this process binds (see [`IDLE`]).
        let Some(Ok(shared)) = self.shared.take().map(Arc::try_unwrap) else {
            return;
        };
        let mut w = shared
            .worker
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        w.link.reset();
        let fresh = Worker::with_link(w.link, w.ip, w.nodes);
        let mut idle = IDLE.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < IDLE_MAX {
            idle.push(fresh);
        }
    }
}

/// Workers of endpoints that closed, kept for the next bind in this process (same address):
/// UCX 1.13 aborted in `ucp_worker_destroy` (an assertion on an endpoint's reference count)
/// now and then under load — 1 hosts-suite run in 7 with two CPU hogs — so a direct worker
/// is never destroyed while the process runs; the process's end frees it.
static IDLE: Mutex<Vec<Worker>> = Mutex::new(Vec::new());
/// Idle workers kept at most (more are destroyed after all).
const IDLE_MAX: usize = 64;

/// The waker: rings the doorbell of a receiver that sleeps when UCX has news for it
/// ([`ARMED`]), and sends what UCX holds when the endpoint's thread does not ([`DRAIN`]).
fn watch(efd: &OwnedFd, s: &Shared) {
    // Backs off while nothing leaves (a receiver that does not read), from DRAIN_EVERY.
    let mut every = DRAIN_EVERY;
    // Looks in a row that found the worker locked by the endpoint's thread.
    let mut locked_out = 0u32;
    loop {
        let modes = s.modes.load(Ordering::Acquire);
        let mut fds = [
            PollFd::new(&s.ctl, PollFlags::IN),
            PollFd::new(efd, PollFlags::IN),
        ];
        let n = if modes & ARMED != 0 { 2 } else { 1 };
        let tick = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: every.as_nanos() as i64,
        };
        let look = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: HELD_LOOK.as_nanos() as i64,
        };
        let timeout = if modes & DRAIN != 0 {
            Some(&tick)
        } else {
            (modes & HELD != 0).then_some(&look)
        };
        match rustix::event::poll(&mut fds[..n], timeout) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(_) => return,
        }
        let (told, news) = (!fds[0].revents().is_empty(), !fds[1].revents().is_empty());
        if told {
            let mut b = [0u8; 8];
            let _ = rustix::io::read(&s.ctl, &mut b);
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            every = DRAIN_EVERY;
        }
        if modes & DRAIN != 0 {
            // Only when the endpoint's thread is not in a call: it makes progress itself.
            if let Ok(mut w) = s.worker.try_lock() {
                let (had, unsent) = (w.queue.len(), w.link.in_flight_bytes());
                w.progress();
                let left = w.link.in_flight_bytes();
                let sent = !w.batching && left == 0 && w.link.idle();
                if sent {
                    // Under the lock: a send after it asks again (and is seen then).
                    s.modes.fetch_and(!DRAIN, Ordering::AcqRel);
                } else if w.holds_only_held() {
                    // Held datagrams alone are left: a slow look (their sender sends them).
                    s.modes.fetch_or(HELD, Ordering::AcqRel);
                    s.modes.fetch_and(!DRAIN, Ordering::AcqRel);
                }
                let got = w.queue.len() != had;
                drop(w);
                locked_out = 0;
                every = if sent || left < unsent {
                    DRAIN_EVERY
                } else {
                    (every * 2).min(DRAIN_MAX)
                };
                if got {
                    crate::sync::ring(&s.bell);
                }
            } else {
                // The endpoint's thread is in a call: it moves the worker itself, and lets go
                // of it between calls. One that holds it on and on (a send whose fill waits
                // for its data) is looked at less often, up to every HELD_LOOK: the net
                // agent's, waiting there for its node's next frame, had this thread wake every
                // 50 µs for as long as the node sent nothing. (Not up to DRAIN_MAX: a stream's
                // sender that keeps it busy may stop with bytes in UCX, and those wait for
                // the next look.)
                locked_out = locked_out.saturating_add(1);
                if locked_out > LOCKED_OUT_LOOKS {
                    every = (every * 2).min(HELD_LOOK.max(every));
                }
            }
        }
        if modes & (DRAIN | HELD) == HELD {
            if let Ok(mut w) = s.worker.try_lock() {
                let had = w.queue.len();
                w.progress();
                if !w.batching {
                    // Under the lock, as above.
                    s.modes.fetch_and(!HELD, Ordering::AcqRel);
                }
                let got = w.queue.len() != had;
                drop(w);
                if got {
                    crate::sync::ring(&s.bell);
                }
            }
        }
        if n == 2 && news {
            s.modes.fetch_and(!ARMED, Ordering::AcqRel);
            crate::sync::ring(&s.bell);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::ManuallyDrop;

    // The tests' UCX workers are never destroyed (`ManuallyDrop`; the process's end frees
    // them), as the endpoints' are not in use (see [`IDLE`]): UCX 1.13 aborts in
    // `ucp_worker_destroy` now and then (`refcounts.create == 1`), seen here in 1 run of the
    // library's tests in 10 with two CPU hogs, and once in CI.

    /// A message as a sender writes it: header, then `body` (a batch's body as given).
    fn message(magic: u32, src: Addr, dst_port: u32, conn: u64, seq: u64, body: &[u8]) -> Vec<u8> {
        let mut m = vec![0u8; HEAD];
        head(&mut m, magic, src, dst_port, conn, seq);
        m.extend_from_slice(body);
        m
    }

    /// A receiver (node 2, port 7, of a fabric of 4 nodes) and a bare UCX link connected to
    /// it, on which a test writes messages by hand.
    fn receiver_and_bare_sender() -> (ManuallyDrop<Worker>, ManuallyDrop<Link>, EpId) {
        let mut w = ManuallyDrop::new(Worker::open("127.0.0.1".parse().unwrap(), 4).unwrap());
        w.me = Addr::new(2, 7);
        let to = SocketAddr::from(([127, 0, 0, 1], w.link.listen_port()));
        let mut raw = ManuallyDrop::new(Link::open(None).unwrap());
        let ep = raw.connect(to).unwrap();
        (w, raw, ep)
    }

    /// Reads every queued datagram, in order.
    fn read_queue(w: &mut Worker) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while let Some((_, p)) = w.front() {
            out.push(p.to_vec());
            w.pop();
        }
        out
    }

    /// A batch's body: each datagram as a u32 length and its bytes.
    fn batch(items: &[&[u8]]) -> Vec<u8> {
        let mut b = Vec::new();
        for i in items {
            b.extend_from_slice(&(i.len() as u32).to_le_bytes());
            b.extend_from_slice(i);
        }
        b
    }

    #[test]
    fn a_batch_is_taken_only_when_every_length_fits_the_message() {
        let src = Addr::new(1, 9);
        let ok = message(MAGIC_BATCH, src, 7, 1, 0, &batch(&[b"ab", b"", b"cde"]));
        assert_eq!(
            batch_items(&ok),
            Some(vec![(HEAD + 4, 2), (HEAD + 10, 0), (HEAD + 14, 3)])
        );
        // A length past the end, a trailing partial length, nothing at all, one too large.
        let mut past = ok.clone();
        past[HEAD..HEAD + 4].copy_from_slice(&1000u32.to_le_bytes());
        assert_eq!(batch_items(&past), None);
        let mut partial = ok.clone();
        partial.extend_from_slice(&[1, 0]);
        assert_eq!(batch_items(&partial), None);
        assert_eq!(batch_items(&message(MAGIC_BATCH, src, 7, 1, 0, &[])), None);
        let huge = vec![0u8; crate::wire::MAX_DGRAM + 1];
        let big = message(MAGIC_BATCH, src, 7, 1, 0, &batch(&[&huge]));
        assert_eq!(batch_items(&big), None);
    }

    /// Two workers on loopback (nodes 1 and 2, port 3 each), `a` connected to `b` (at the
    /// address returned).
    fn connected_pair() -> (ManuallyDrop<Worker>, ManuallyDrop<Worker>, SocketAddr) {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let (mut a, mut b) = (
            ManuallyDrop::new(Worker::open(ip, 4).unwrap()),
            ManuallyDrop::new(Worker::open(ip, 4).unwrap()),
        );
        (a.me, b.me) = (Addr::new(1, 3), Addr::new(2, 3));
        let to_b = SocketAddr::new(ip, b.link.listen_port());
        a.connect(to_b, b.me).unwrap();
        (a, b, to_b)
    }

    /// Progresses `b` and appends what it received to `got`.
    fn take_all(b: &mut Worker, got: &mut Vec<Vec<u8>>) {
        b.progress();
        while let Some((_, p)) = b.front() {
            got.push(p.to_vec());
            b.pop();
        }
    }

    /// Sends `refs` from `a` to `b` as one list, `b` moved along while `a` waits (one thread
    /// here: the connection's wire-up needs it; `alive` is asked every LENT_CHECK): the
    /// number the list's message took, and what `b` took meanwhile.
    fn send_list(
        (a, b): (&mut Worker, &mut Worker),
        to_b: SocketAddr,
        refs: &[&[u8]],
    ) -> (u64, Vec<Vec<u8>>) {
        let seq = a.out[&to_b].seq;
        let mut got = Vec::new();
        let b_me = b.me;
        let mut receive = || {
            take_all(b, &mut got);
            true
        };
        assert_eq!(a.send_lent(to_b, b_me, refs, &mut receive), Ok(true));
        (seq, got)
    }

    /// Moves both workers along until `b` took `n` datagrams into `got` (or `deadline`).
    fn take_until(
        (a, b): (&mut Worker, &mut Worker),
        got: &mut Vec<Vec<u8>>,
        n: usize,
        deadline: Instant,
    ) {
        while got.len() < n {
            assert!(Instant::now() < deadline, "got {} of {n}", got.len());
            a.progress();
            take_all(b, got);
        }
    }

    /// A list of datagrams goes as one message read in place, and the receiver gets each
    /// whole, in order, after what was sent before it; a malformed list is refused.
    #[test]
    fn a_list_of_datagrams_goes_as_one_message_and_arrives_as_each() {
        let (mut a, mut b, to_b) = connected_pair();
        let deadline = Instant::now() + Duration::from_secs(20);
        let dgram = |i: usize| -> Vec<u8> {
            (0..[0, 1, 65_000, 300][i % 4] + i)
                .map(|k| (k * 3 + i) as u8)
                .collect()
        };
        // One first, in a batch of its own (corked), then a list of LIST_PIECES datagrams, each
        // in its own memory.
        a.corked = true;
        let first = dgram(0);
        a.send(to_b, b.me, first.len(), (true, false), |buf| {
            buf.copy_from_slice(&first);
            Some(first.len())
        })
        .unwrap();
        a.corked = false;
        let list: Vec<Vec<u8>> = (1..=LIST_PIECES).map(dgram).collect();
        let refs: Vec<&[u8]> = list.iter().map(Vec::as_slice).collect();
        assert_eq!(list_pieces(&refs), LIST_PIECES);
        // (One piece more is refused: nothing sent, the caller sends them one by one.)
        let one_more: Vec<Vec<u8>> = (1..=LIST_PIECES + 1).map(dgram).collect();
        let more: Vec<&[u8]> = one_more.iter().map(Vec::as_slice).collect();
        assert_eq!(a.send_lent(to_b, b.me, &more, &mut || true), Ok(false));
        let (seq, mut got) = send_list((&mut a, &mut b), to_b, &refs);
        assert_eq!(
            a.out[&to_b].seq,
            seq + 2,
            "the batch, then the list: two messages"
        );
        take_until((&mut a, &mut b), &mut got, 1 + LIST_PIECES, deadline);
        for (i, g) in got.iter().enumerate() {
            assert!(*g == dgram(i), "datagram {i}");
        }
        assert_eq!(b.rejected, 0);
        // Malformed lists.
        let mut m = vec![0u8; HEAD];
        m.extend_from_slice(&2u32.to_le_bytes());
        m.extend_from_slice(&3u32.to_le_bytes());
        m.extend_from_slice(&1u32.to_le_bytes());
        m.extend_from_slice(b"abcd");
        assert_eq!(list_items(&m), Some(vec![(HEAD + 12, 3), (HEAD + 15, 1)]));
        assert_eq!(list_items(&m[..m.len() - 1]), None, "short");
        let mut long = m.clone();
        long.push(0);
        assert_eq!(list_items(&long), None, "trailing bytes");
        m[HEAD..HEAD + 4].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(list_items(&m), None, "empty");
        m[HEAD..HEAD + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(list_items(&m), None, "too many");
        m[HEAD..HEAD + 4].copy_from_slice(&2u32.to_le_bytes());
        m[HEAD + 4..HEAD + 8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(list_items(&m), None, "a length past the end");
    }

    /// A frame cut into datagrams that lie back to back in one buffer is one piece of memory
    /// however many they are: 1 MiB and a bit as 17 datagrams (more than one TCP segment:
    /// UCX sends it in two pieces) goes as one message, and each arrives whole, in order.
    #[test]
    fn a_frame_cut_into_datagrams_goes_as_one_message_past_a_segment() {
        let (mut a, mut b, to_b) = connected_pair();
        let deadline = Instant::now() + Duration::from_secs(20);
        let frame: Vec<u8> = (0..17 * 64 * 1024)
            .map(|k| (k * 7 + k / 4099) as u8)
            .collect();
        let refs: Vec<&[u8]> = frame.chunks(64 * 1024).collect();
        assert_eq!(list_pieces(&refs), 1);
        assert!(frame.len() > backplane_ucx::TCP_SEGMENT && frame.len() <= LIST_FRAME_BYTES);
        let (seq, mut got) = send_list((&mut a, &mut b), to_b, &refs);
        assert_eq!(a.out[&to_b].seq, seq + 1, "one message");
        take_until((&mut a, &mut b), &mut got, refs.len(), deadline);
        for (i, g) in got.iter().enumerate() {
            assert!(*g == refs[i], "datagram {i}");
        }
        assert_eq!(b.rejected, 0);
        // Counted as the link hands them over: back to back is one, a gap is two.
        let gap = [&frame[..10], &frame[11..20]];
        assert_eq!(list_pieces(&gap), 2);
        assert_eq!(
            list_pieces(&[&frame[..10], &frame[10..20], &frame[20..30]]),
            1
        );
    }

    /// In a stream, a blocking send of a datagram of [`STREAM_LENT_MIN`] or more goes in
    /// place as a message of its own; a shorter one, or any while a batch waits for the
    /// receiver, is left to the batch (nothing sent); the receiver gets the lent one whole.
    #[test]
    fn a_streams_large_datagram_goes_in_place_unless_a_batch_waits() {
        let (mut a, mut b, to_b) = connected_pair();
        let deadline = Instant::now() + Duration::from_secs(20);
        let big: Vec<u8> = (0..STREAM_LENT_MIN).map(|k| (k * 5) as u8).collect();
        let short = vec![7u8; STREAM_LENT_MIN - 1];
        let b_me = b.me;
        let mut got = Vec::new();
        let mut receive = || {
            take_all(&mut b, &mut got);
            true
        };
        // (The last send "ahead" of now: a stream however slowly this machine goes on to the
        // next send — a loaded CI machine took more than STREAM_GAP_NS.)
        let stream = |a: &mut Worker| {
            a.out.get_mut(&to_b).unwrap().last_send = crate::sync::fast_ns() + 60_000_000_000;
        };
        stream(&mut a);
        assert_eq!(a.send_lent(to_b, b_me, &[&short], &mut receive), Ok(false));
        stream(&mut a);
        let seq = a.out[&to_b].seq;
        assert_eq!(a.send_lent(to_b, b_me, &[&big], &mut receive), Ok(true));
        assert_eq!(a.out[&to_b].seq, seq + 1, "one message of its own");
        // A batch waiting: the large one joins it (the order of the stream).
        a.corked = true;
        a.send(to_b, b_me, 1, (true, false), |buf| {
            buf[0] = 1;
            Some(1)
        })
        .unwrap();
        a.corked = false;
        assert_ne!(a.out[&to_b].used, 0);
        stream(&mut a);
        assert_eq!(a.send_lent(to_b, b_me, &[&big], &mut receive), Ok(false));
        a.ship_all();
        take_until((&mut a, &mut b), &mut got, 2, deadline);
        assert!(got[0] == big, "the lent datagram whole");
        assert_eq!(got[1], [1]);
    }

    /// A payload for [`Worker::send_zc_held`] (an owned buffer: the test's stand-in for a
    /// queue pair's region).
    fn lent(bytes: &[u8]) -> Box<dyn backplane_ucx::InPlace> {
        Box::new(backplane_ucx::OwnedBytes::new(
            bytes.to_vec(),
            bytes.len(),
            Box::new(|_| {}),
        ))
    }

    /// Large datagrams of a stream whose payloads stay the sender's until sent (a queue pair's
    /// SENDs) wait for the next ones: [`sends_together`] of them go as one message, each
    /// whole (its head, payload and tail), in order; a datagram of another kind sends those
    /// held before it first; one alone, out of a stream, goes at once; held ones left when
    /// the stream pauses leave at the next progress.
    #[test]
    fn a_streams_held_datagrams_share_a_message_whole_and_in_order() {
        let (mut a, mut b, to_b) = connected_pair();
        let deadline = Instant::now() + Duration::from_secs(20);
        let n = sends_together();
        assert!(n >= 2, "held datagrams share messages by default");
        let part = |i: usize, what: u8, len: usize| -> Vec<u8> {
            (0..len).map(|k| (k * 3 + i * 7) as u8 ^ what).collect()
        };
        let whole = |i: usize| -> Vec<u8> {
            let (h, p, t) = (
                part(i, 1, 9 + i),
                part(i, 2, STREAM_LENT_MIN + i),
                part(i, 3, i),
            );
            [h, p, t].concat()
        };
        let b_me = b.me;
        let stream = |a: &mut Worker| {
            a.out.get_mut(&to_b).unwrap().last_send = crate::sync::fast_ns() + 60_000_000_000;
        };
        let send_held = |a: &mut Worker, i: usize| {
            let (h, p, t) = (
                part(i, 1, 9 + i),
                part(i, 2, STREAM_LENT_MIN + i),
                part(i, 3, i),
            );
            a.send_zc_held(to_b, b_me, (&h, lent(&p), &t))
        };
        // Out of a stream: at once.
        let seq = a.out[&to_b].seq;
        send_held(&mut a, 0).unwrap();
        assert_eq!(a.out[&to_b].seq, seq + 1, "a lone one goes at once");
        // A stream: the first n - 1 wait, the n-th sends them all, one message.
        for i in 1..n {
            stream(&mut a);
            send_held(&mut a, i).unwrap();
            assert_eq!(a.out[&to_b].held_lens.len(), i, "held");
            assert_eq!(a.out[&to_b].seq, seq + 1, "nothing sent while they wait");
        }
        stream(&mut a);
        send_held(&mut a, n).unwrap();
        assert!(a.out[&to_b].held.is_empty());
        assert_eq!(a.out[&to_b].seq, seq + 2, "one message for {n}");
        // Two held, then a small datagram: they go before it.
        for i in n + 1..n + 3 {
            stream(&mut a);
            send_held(&mut a, i).unwrap();
        }
        a.send(to_b, b_me, 1, (false, false), |buf| {
            buf[0] = 0xee;
            Some(1)
        })
        .unwrap();
        assert!(a.out[&to_b].held.is_empty(), "held ones went first");
        // One held, the stream pauses: the next progress sends it.
        stream(&mut a);
        send_held(&mut a, n + 3).unwrap();
        assert_eq!(a.out[&to_b].held_lens.len(), 1);
        a.out.get_mut(&to_b).unwrap().held_last = 0; // (long ago)
        a.progress();
        assert!(
            a.out[&to_b].held.is_empty(),
            "a paused stream's held ones leave"
        );
        let mut want: Vec<Vec<u8>> = (0..n + 3).map(whole).collect();
        want.push(vec![0xee]);
        want.push(whole(n + 3));
        let mut got = Vec::new();
        take_until((&mut a, &mut b), &mut got, want.len(), deadline);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g == w,
                "datagram {i}: {} bytes, {} expected",
                g.len(),
                w.len()
            );
        }
    }

    /// A stream of large datagrams shares messages of up to [`BIG_BATCH_MAX`], each batch's
    /// buffer handed to UCX in place and recycled; the receiver gets every datagram whole,
    /// in order.
    #[test]
    fn a_stream_of_large_datagrams_goes_in_big_batches_whole_and_in_order() {
        let (mut a, mut b, to_b) = connected_pair();
        let deadline = Instant::now() + Duration::from_secs(20);
        const N: usize = 40;
        let dgram =
            |i: usize| -> Vec<u8> { (0..40_000 + i * 611).map(|k| (k * 7 + i) as u8).collect() };
        let (mut got, mut biggest) = (Vec::<Vec<u8>>::new(), 0);
        for i in 0..N {
            let d = dgram(i);
            // A stream, whatever this machine's pace (a corked sender's large datagrams go
            // one to a message), and one that never lingers.
            let o = a.out.get_mut(&to_b).unwrap();
            (o.last_send, o.batch_since) = (crate::sync::fast_ns(), crate::sync::fast_ns());
            while a
                .send(to_b, b.me, d.len(), (true, true), |buf| {
                    buf[..d.len()].copy_from_slice(&d);
                    Some(d.len())
                })
                .is_err()
            {
                assert!(Instant::now() < deadline, "UCX never took datagram {i}");
                a.progress();
            }
            biggest = biggest.max(a.out[&to_b].used);
        }
        assert!(biggest > BATCH_MAX, "no big batch: {biggest} bytes at most");
        assert!(biggest <= BIG_BATCH_MAX);
        a.ship_all();
        take_until((&mut a, &mut b), &mut got, N, deadline);
        for (i, g) in got.iter().enumerate() {
            assert!(*g == dgram(i), "datagram {i}");
        }
        assert!(!a.spare.lock().unwrap().is_empty(), "no buffer came back");
    }

    /// A send that must not wait (`batch` false) goes at once, after what a stream's batch
    /// held for the same receiver: nothing is left batching, and the receiver gets every
    /// datagram in the order sent.
    #[test]
    fn an_unbatched_send_ships_the_batch_before_it_and_waits_for_nothing() {
        let (mut a, mut b, to_b) = connected_pair();
        let deadline = Instant::now() + Duration::from_secs(10);
        let send = |a: &mut Worker, i: u8, batch: bool| {
            while a
                .send(to_b, b.me, 1, (batch, false), |buf| {
                    buf[0] = i;
                    Some(1)
                })
                .is_err()
            {
                assert!(Instant::now() < deadline, "UCX never took datagram {i}");
                a.progress();
            }
        };
        // A stream (each send within STREAM_GAP_NS of the last, so corked to be sure).
        a.corked = true;
        for i in 0..3 {
            send(&mut a, i, true);
        }
        assert!(a.batching && a.out[&to_b].used != 0, "the stream batches");
        a.corked = false;
        send(&mut a, 3, false);
        assert!(
            (a.out[&to_b].used == 0),
            "the batch went before the lone one"
        );
        let mut got = Vec::new();
        while got.len() < 4 {
            assert!(Instant::now() < deadline, "got {got:?}");
            a.progress();
            b.progress();
            while let Some((_, p)) = b.front() {
                got.push(p[0]);
                b.pop();
            }
        }
        assert_eq!(got, [0, 1, 2, 3]);
        // Nothing waits, so nothing is batching: a flag left set kept the endpoint's waker
        // looking every HELD_LOOK for as long as the endpoint lived.
        a.progress();
        assert!(!a.batching, "the worker still says it batches");
        assert_ne!(
            a.drain_mode(),
            Some(HELD),
            "the waker would look for held datagrams"
        );
    }

    /// A receiver takes each sender connection's messages in their numbers' order whatever
    /// order they come in, splits batches, and refuses (counting) repeats, messages for
    /// another port or from no node, unknown kinds and malformed batches. The messages are
    /// written by hand on a bare UCX link, as a buggy or hostile peer could.
    #[test]
    fn two_endpoints_that_connected_to_each_other_end_up_on_one_connection_in_order() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let (mut a, mut b) = (
            ManuallyDrop::new(Worker::open(ip, 4).unwrap()),
            ManuallyDrop::new(Worker::open(ip, 4).unwrap()),
        );
        (a.me, b.me) = (Addr::new(1, 3), Addr::new(2, 3));
        let to_a = SocketAddr::new(ip, a.link.listen_port());
        let to_b = SocketAddr::new(ip, b.link.listen_port());
        a.connect(to_b, b.me).unwrap();
        b.connect(to_a, a.me).unwrap();
        let (a_own, b_own) = (a.out[&to_b].ep, b.out[&to_a].ep);
        let deadline = Instant::now() + Duration::from_secs(10);
        let (mut at_a, mut at_b) = (Vec::new(), Vec::new());
        let drain = |w: &mut Worker, into: &mut Vec<u8>| {
            w.progress();
            while let Some((_, p)) = w.front() {
                into.push(p[0]);
                w.pop();
            }
        };
        for i in 0..40u8 {
            let one = |buf: &mut [u8]| {
                buf[0] = i;
                Some(1)
            };
            while a.send(to_b, b.me, 1, (true, false), one).is_err() {
                drain(&mut a, &mut at_a);
            }
            while b.send(to_a, a.me, 1, (true, false), one).is_err() {
                drain(&mut b, &mut at_b);
            }
            drain(&mut a, &mut at_a);
            drain(&mut b, &mut at_b);
        }
        while at_a.len() < 40 || at_b.len() < 40 {
            assert!(Instant::now() < deadline, "A got {at_a:?}, B got {at_b:?}");
            drain(&mut a, &mut at_a);
            drain(&mut b, &mut at_b);
        }
        let want: Vec<u8> = (0..40).collect();
        assert_eq!(at_a, want, "B's datagrams, across its move, in order");
        assert_eq!(at_b, want);
        // B, the greater address, now sends over A's connection, on which A's came.
        let b_now = b.out[&to_a].ep;
        assert_ne!(b_now, b_own);
        assert_eq!(b.senders.get(&b_now), Some(&(a.me, a.out[&to_b].conn)));
        assert_eq!(a.out[&to_b].ep, a_own, "A never moves");
        // B's route to A ending does not close the connection A sends to B over.
        b.disconnect(to_a);
        while a
            .send(to_b, b.me, 1, (true, false), |buf| {
                buf[0] = 99;
                Some(1)
            })
            .is_err()
        {
            drain(&mut a, &mut at_a);
        }
        while at_b.len() < 41 {
            assert!(Instant::now() < deadline, "B got {at_b:?}");
            drain(&mut a, &mut at_a);
            drain(&mut b, &mut at_b);
        }
        assert_eq!(at_b[40], 99);
    }

    #[test]
    fn a_receiver_queues_each_connection_in_order_and_refuses_what_is_not_its() {
        let (mut w, mut raw, ep) = receiver_and_bare_sender();
        let (a, b) = (Addr::new(1, 9), Addr::new(3, 5));
        let sends = [
            message(MAGIC, a, 7, 11, 2, b"a2"),
            message(MAGIC, b, 7, 22, 0, b"b0"),
            message(MAGIC, a, 7, 11, 0, b"a0"),
            message(MAGIC_BATCH, a, 7, 11, 3, &batch(&[b"a3x", b"a3y"])),
            message(MAGIC, a, 7, 11, 1, b"a1"),
            message(MAGIC, a, 7, 11, 1, b"a1"), // a repeat
            message(MAGIC, a, 8, 11, 4, b"other port"),
            message(MAGIC, Addr::new(0, 1), 7, 11, 4, b"no node"),
            message(MAGIC, Addr::new(5, 1), 7, 11, 4, b"past the last node"),
            message(0x1234_5678, a, 7, 11, 4, b"unknown kind"),
            message(MAGIC_BATCH, a, 7, 11, 4, &[9, 9]), // malformed
            message(MAGIC, b, 7, 22, 1, b"b1"),
        ];
        for m in &sends {
            raw.send(ep, m).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got: Vec<(Addr, Vec<u8>)> = Vec::new();
        while got.len() < 7 || w.rejected < 6 {
            assert!(
                Instant::now() < deadline,
                "got {got:?}, {} refused",
                w.rejected
            );
            let _ = raw.poll();
            w.progress();
            while let Some((src, p)) = w.front() {
                got.push((src, p.to_vec()));
                w.pop();
            }
        }
        let of = |who: Addr| -> Vec<Vec<u8>> {
            got.iter()
                .filter(|(s, _)| *s == who)
                .map(|(_, p)| p.clone())
                .collect()
        };
        let want_a: Vec<Vec<u8>> = [&b"a0"[..], b"a1", b"a2", b"a3x", b"a3y"]
            .iter()
            .map(|s| s.to_vec())
            .collect();
        assert_eq!(of(a), want_a);
        assert_eq!(of(b), vec![b"b0".to_vec(), b"b1".to_vec()]);
        assert_eq!(w.rejected, 6);
        assert_eq!(w.queued, 0, "every byte taken is accounted for");
    }

    #[test]
    fn datagrams_held_out_of_order_past_the_queue_limit_do_not_stop_the_one_they_wait_for() {
        let (mut w, mut raw, ep) = receiver_and_bare_sender();
        let a = Addr::new(1, 9);
        // Numbers 1.. first, more than the queue's limit of them, then number 0.
        let big = vec![5u8; 60_000];
        let later = QUEUE_MAX / big.len() + 4;
        for seq in 1..=later as u64 {
            raw.send(ep, &message(MAGIC, a, 7, 11, seq, &big)).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while w.held_bytes <= QUEUE_MAX {
            assert!(Instant::now() < deadline, "held {} B", w.held_bytes);
            let _ = raw.poll();
            w.progress();
        }
        assert!(w.front().is_none(), "nothing is readable before number 0");
        raw.send(ep, &message(MAGIC, a, 7, 11, 0, b"first"))
            .unwrap();
        let mut got = 0;
        while got <= later {
            assert!(Instant::now() < deadline, "read {got} of {}", later + 1);
            let _ = raw.poll();
            w.progress();
            while let Some((_, p)) = w.front() {
                assert_eq!(p.len(), if got == 0 { 5 } else { big.len() });
                got += 1;
                w.pop();
            }
        }
        assert_eq!((w.queued, w.held_bytes), (0, 0));
    }

    /// The next datagram in order is read where UCX received it when nothing is queued; one
    /// that comes early, one after a queued one, and one the reader declines are queued and
    /// read in their order, and nothing stays counted.
    #[test]
    fn a_datagram_read_in_place_keeps_its_connections_order_and_a_declined_one_stays() {
        let (mut w, mut raw, ep) = receiver_and_bare_sender();
        let a = Addr::new(1, 9);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut in_place = Vec::new();
        // Polls (offering to a reader that declines "no") until `done`.
        let poll_until = |w: &mut Worker,
                          raw: &mut Link,
                          in_place: &mut Vec<Vec<u8>>,
                          done: &dyn Fn(&Worker, usize) -> bool| {
            while !done(w, in_place.len()) {
                assert!(Instant::now() < deadline, "in place {in_place:?}");
                let _ = raw.poll();
                let mut read = |src: Addr, p: &[u8]| {
                    assert_eq!(src, a);
                    if p == b"no" {
                        return false;
                    }
                    in_place.push(p.to_vec());
                    true
                };
                w.poll_offering(Some(&mut read));
            }
        };
        let send = |raw: &mut Link, seq: u64, body: &[u8]| {
            raw.send(ep, &message(MAGIC, a, 7, 11, seq, body)).unwrap();
        };
        // Number 1 before 0: held; 0 is read in place, then 1 is queued.
        send(&mut raw, 1, b"one");
        poll_until(&mut w, &mut raw, &mut in_place, &|w, _| w.held_bytes != 0);
        send(&mut raw, 0, b"zero");
        poll_until(&mut w, &mut raw, &mut in_place, &|_, n| n == 1);
        assert_eq!(in_place, [b"zero".to_vec()]);
        assert_eq!(w.front().map(|(_, p)| p.to_vec()), Some(b"one".to_vec()));
        // The hint a reader looks at without the lock follows the queue.
        let hint = |w: &Worker| w.has_queued.load(Ordering::Relaxed);
        assert!(hint(&w), "a queued datagram is announced");
        // Behind a queued one, the next is queued too.
        send(&mut raw, 2, b"two");
        poll_until(&mut w, &mut raw, &mut in_place, &|w, _| w.queue.len() == 2);
        assert_eq!(read_queue(&mut w), [b"one".to_vec(), b"two".to_vec()]);
        assert!(!hint(&w), "an emptied queue is announced");
        // Declined: queued, and the next after it too; then nothing is read in place.
        send(&mut raw, 3, b"no");
        poll_until(&mut w, &mut raw, &mut in_place, &|w, _| w.queue.len() == 1);
        send(&mut raw, 4, b"four");
        poll_until(&mut w, &mut raw, &mut in_place, &|w, _| w.queue.len() == 2);
        assert_eq!(in_place.len(), 1);
        assert_eq!(read_queue(&mut w), [b"no".to_vec(), b"four".to_vec()]);
        // In order and queue empty again: read in place.
        send(&mut raw, 5, b"five");
        poll_until(&mut w, &mut raw, &mut in_place, &|_, n| n == 2);
        assert_eq!(in_place[1], b"five");
        assert_eq!((w.queued, w.held_bytes, w.rejected), (0, 0, 0));
        assert!(!hint(&w));
    }

    /// A bound receiver (node 2, port 7, its doorbell in `region`) and a bare UCX link
    /// connected to it, on which a test writes messages by hand.
    fn direct_and_bare_sender(
        region: &Arc<crate::mem::Region>,
    ) -> (Direct, ManuallyDrop<Link>, EpId) {
        let bell = crate::mem::Word32::at(region, 0).unwrap();
        let un = Unbound::open("127.0.0.1".parse().unwrap(), 4).unwrap();
        let to = SocketAddr::from(([127, 0, 0, 1], un.port()));
        let d = un.bound(Addr::new(2, 7), bell).unwrap();
        let mut raw = ManuallyDrop::new(Link::open(None).unwrap());
        let ep = raw.connect(to).unwrap();
        (d, raw, ep)
    }

    /// What looks take in place from `src`, in order, over as many looks as UCX needs, up to
    /// the datagram `no`, which the reader refuses.
    fn in_place_until_refused(d: &mut Direct, raw: &mut Link, src: Addr) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut taken = Vec::new();
        loop {
            assert!(Instant::now() < deadline, "taken in place: {taken:?}");
            let _ = raw.poll();
            let (rejected, _, _, err) = d.progress_take_all(|from, p: &[u8]| {
                assert_eq!(from, src);
                if p == b"no" {
                    return Err(());
                }
                taken.push(p.to_vec());
                Ok(())
            });
            assert_eq!(rejected, 0);
            if err.is_some() {
                return taken;
            }
        }
    }

    /// The next `count` datagrams, which must all be queued (no look offers anything in
    /// place while something is).
    fn queued(d: &mut Direct, raw: &mut Link, count: usize) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut rest = Vec::new();
        while rest.len() < count {
            assert!(Instant::now() < deadline, "queued: {rest:?}");
            let _ = raw.poll();
            let (_, n, _, _) = d.progress_take_all(|_, _| Err::<(), ()>(()));
            assert_eq!(n, 0);
            while let Some((_, Ok(p))) = d.take(|_, p: &[u8]| Ok::<_, ()>(p.to_vec())) {
                rest.push(p);
            }
        }
        rest
    }

    #[test]
    fn a_sleeper_on_the_workers_fd_is_told_of_what_another_look_took_off_the_wire() {
        let region = Arc::new(crate::mem::Region::create("bp-direct-test-t", 4096).unwrap());
        let (mut d, mut raw, ep) = direct_and_bare_sender(&region);
        let readable = |fd: &OwnedFd| {
            let mut p = [PollFd::new(fd, PollFlags::IN)];
            rustix::event::poll(&mut p, Some(&rustix::time::Timespec::default())).unwrap() == 1
        };
        // A thread about to sleep on the worker (a QP pair's): nothing there yet.
        let (_worker, took) = d.arm_fd().expect("nothing waits: armed");
        assert!(!readable(&took));
        // A datagram comes, and the waker (draining: UCX held sends) takes it off the wire:
        // the worker's fd may say nothing of it, the waker's says it.
        raw.send(ep, &message(MAGIC, Addr::new(1, 9), 7, 11, 0, b"x"))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !d.has_queued() {
            assert!(Instant::now() < deadline, "the waker never took it");
            let _ = raw.poll();
            assert!(d.ask(DRAIN));
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            readable(&took),
            "the waker took an arrival and said nothing"
        );
        drain_took(&took);
        assert!(!readable(&took), "emptied");
        let got = d.take(|_, p: &[u8]| Ok::<_, ()>(p.to_vec()));
        assert!(matches!(got, Some((1, Ok(ref p))) if p == b"x"), "{got:?}");
        // Asleep again; this time another thread of the process looks (a sender's progress
        // while it waits for room in UCX's window) and queues what came: told as well.
        // (UCX may have events left from the look before: the sleeper looks again.)
        let (_worker, took) = loop {
            assert!(Instant::now() < deadline, "never armed");
            if let Some(fds) = d.arm_fd() {
                break fds;
            }
        };
        raw.send(ep, &message(MAGIC, Addr::new(1, 9), 7, 11, 1, b"y"))
            .unwrap();
        while !d.has_queued() {
            assert!(Instant::now() < deadline, "the look never took it");
            let _ = raw.poll();
            d.lock().progress();
        }
        assert!(
            readable(&took),
            "a sender's look took an arrival and said nothing"
        );
    }

    #[test]
    fn one_look_takes_every_message_it_brought_in_place_until_the_reader_refuses_one() {
        let region = Arc::new(crate::mem::Region::create("bp-direct-test", 4096).unwrap());
        let (mut d, mut raw, ep) = direct_and_bare_sender(&region);
        let a = Addr::new(1, 9);
        for (seq, body) in [&b"a"[..], b"b", b"no", b"d"].into_iter().enumerate() {
            raw.send(ep, &message(MAGIC, a, 7, 11, seq as u64, body))
                .unwrap();
        }
        let taken = in_place_until_refused(&mut d, &mut raw, a);
        assert_eq!(taken, [b"a".to_vec(), b"b".to_vec()]);
        // The refused one stays the next datagram, and what came after waits behind it.
        let rest = queued(&mut d, &mut raw, 2);
        assert_eq!(rest, [b"no".to_vec(), b"d".to_vec()]);
    }

    #[test]
    fn a_batch_is_read_in_place_up_to_the_datagram_the_reader_refuses_and_the_rest_queued() {
        let region = Arc::new(crate::mem::Region::create("bp-direct-test-b", 4096).unwrap());
        let (mut d, mut raw, ep) = direct_and_bare_sender(&region);
        let a = Addr::new(1, 9);
        let first = batch(&[b"a", b"", b"no", b"d"]);
        raw.send(ep, &message(MAGIC_BATCH, a, 7, 11, 0, &first))
            .unwrap();
        let second = batch(&[b"e", b"f"]);
        raw.send(ep, &message(MAGIC_BATCH, a, 7, 11, 1, &second))
            .unwrap();
        raw.send(ep, &message(MAGIC, a, 7, 11, 2, b"g")).unwrap();
        let taken = in_place_until_refused(&mut d, &mut raw, a);
        assert_eq!(taken, [b"a".to_vec(), Vec::new()]);
        // The batch waits from the refused datagram on (nothing of it twice), and what came
        // after it behind it, in order.
        let rest = queued(&mut d, &mut raw, 5);
        let want: [&[u8]; 5] = [b"no", b"d", b"e", b"f", b"g"];
        assert_eq!(rest, want.map(<[u8]>::to_vec));
        // A batch taken whole in place is not queued at all.
        raw.send(
            ep,
            &message(MAGIC_BATCH, a, 7, 11, 3, &batch(&[b"h", b"i"])),
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut whole = Vec::new();
        while whole.len() < 2 {
            assert!(Instant::now() < deadline, "whole: {whole:?}");
            let _ = raw.poll();
            d.progress_take_all(|_, p: &[u8]| {
                whole.push(p.to_vec());
                Ok::<(), ()>(())
            });
        }
        assert_eq!(whole, [b"h".to_vec(), b"i".to_vec()]);
        assert!(d.take(|_, _| Ok::<_, ()>(())).is_none(), "nothing queued");
    }
}
