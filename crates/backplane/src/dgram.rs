//! Datagram endpoints (the "UDP Direct" of the seed documents): kernel-bypass, lossless,
//! in-order datagrams of up to 64 KiB between (node, port) addresses.
//!
//! One SPSC ring per (sender endpoint, receiver endpoint) pair, made on first send through the
//! supervisor and then used without any system call: the sender copies (or fills in place) a
//! record into the ring in the receiver's window; the receiver reads it in place and writes its
//! consumer index back into the sender's window. Doorbells are rung only when the other side
//! has armed them before sleeping, so a busy path makes no system calls and an idle one burns
//! no CPU.
//!
//! Promises: delivery between two live endpoints is in order and loses nothing; a full ring
//! blocks the sender or returns [`DgramError::WouldBlock`], as the caller chooses; data a send
//! acknowledged stays readable by the receiver even if the sender dies; a peer that writes
//! garbage gets its ring retired and counted in `dropped`, never a panic.

mod direct;
pub(crate) use direct::drain_took;

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fabric::ctl::{ErrorKind, Request, Response};
use crate::fabric::{FabricError, Node};
use crate::mem::{Region, Span, Word32, Word64};
use crate::sync::{fence, futex_wait, relax, AtomicU64, Deadline, Ordering, SPIN_POLLS};
use crate::transport::shm::ShmTransport;
pub use crate::transport::Addr;
use crate::transport::{Channels, RecvChannel, RingError, SendChannel};
use crate::wire::*;

/// The channels an endpoint sends and receives through, from its transport.
type Tx = <ShmTransport as Channels>::Tx;
type Rx = <ShmTransport as Channels>::Rx;

/// How long an operation may wait when the ring is full (send) or empty (receive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Return [`DgramError::WouldBlock`] at once.
    Never,
    /// Wait as long as it takes.
    Forever,
    /// Wait up to this long, then return [`DgramError::TimedOut`].
    For(Duration),
}

/// What went wrong with a datagram operation.
#[derive(Debug, thiserror::Error)]
pub enum DgramError {
    /// Occurs when the ring is full (send) or empty (receive) and the caller chose not to wait.
    #[error("operation would block")]
    WouldBlock,
    /// Occurs when a timed wait expires.
    #[error("timed out")]
    TimedOut,
    /// Occurs when a payload exceeds 64 KiB.
    #[error("datagram of {0} bytes exceeds the {MAX_DGRAM}-byte maximum")]
    TooBig(usize),
    /// Occurs when the receive buffer cannot hold the next datagram (it stays queued).
    #[error("receive buffer of {have} bytes is too small for a {need}-byte datagram")]
    BufferTooSmall {
        /// Buffer size.
        have: usize,
        /// Datagram size.
        need: usize,
    },
    /// Occurs when the destination's node is not READY.
    #[error("node {0} is down")]
    NodeDown(u32),
    /// Occurs when this endpoint's own node went DOWN or restarted, or the endpoint was closed.
    #[error("endpoint {0} is closed (its node went down or restarted); bind a new one")]
    Closed(Addr),
    /// Occurs when the topology has no path to the destination through READY nodes.
    #[error("{0}")]
    NoRoute(String),
    /// Occurs when nothing is bound at the destination, or the receiver closed.
    #[error("no endpoint is listening at {0}")]
    Unreachable(Addr),
    /// Occurs when a peer corrupted a shared ring; the ring is retired and counted as a drop.
    #[error("ring with {addr} was corrupted by the peer ({what}) and has been retired")]
    Corrupt {
        /// The peer.
        addr: Addr,
        /// What was wrong.
        what: &'static str,
    },
    /// Occurs when the control plane fails.
    #[error(transparent)]
    Fabric(#[from] FabricError),
}

/// Per-endpoint counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointStats {
    /// Datagrams sent.
    pub sent: u64,
    /// Payload bytes sent.
    pub sent_bytes: u64,
    /// Datagrams received.
    pub received: u64,
    /// Payload bytes received.
    pub received_bytes: u64,
    /// Datagrams dropped: refused (no receiver), lost to a corrupted ring.
    pub dropped: u64,
}

/// The bytes at `[pos, pos+len)` of a channel's data area, for the zero-copy API.
///
/// # Safety
/// The caller owns that range under the ring protocol (reserved by the producer or peeked by
/// the consumer) and drops the slice before commit/release.
#[allow(clippy::mut_from_ref)]
#[inline]
unsafe fn slice_mut(data: &Span, pos: u64, len: usize) -> &mut [u8] {
    // SAFETY: exclusivity per the contract; the protocol validated the range, and if it did
    // not, `bytes_mut` refuses it and the caller gets an empty slice.
    unsafe { data.bytes_mut(pos, len) }.unwrap_or(&mut [])
}

/// One link of a route through a distributed topology, resolved for stamping.
struct RouteStep {
    /// The link's clock (in the window of the node it leaves).
    clock: Word64,
    bytes_per_s: u64,
    hop_ns: u64,
    /// Forward counters (datagrams, bytes) of the node it reaches, if that node forwards.
    fwd: Option<(Word64, Word64)>,
}

struct TxConn {
    dst: Addr,
    /// Distributed topologies: the links crossed (empty: direct).
    route: Vec<RouteStep>,
    /// The receiver's downlink clock (link emulation), when the link is emulated.
    dst_ingress: Option<Word64>,
    /// The channel to the receiver, used only through `SendChannel`. When the datagrams go
    /// straight to the receiver's process (`direct`), nothing is written to it: its flags
    /// still say when the route ends.
    ch: Tx,
    /// A receiver on another host that takes datagrams straight from us: its listener.
    direct: Option<SocketAddr>,
}

struct RxRing {
    src: Addr,
    /// Where the transport announced the channel (the token it is retired by).
    ring_off: u64,
    /// The channel from the sender, used only through `RecvChannel`.
    ch: Rx,
}

/// A datagram endpoint bound to (node, port). Owned by one thread at a time (`Send`, not
/// `Sync`); several endpoints, in one process or many, may live on the same node.
pub struct Endpoint {
    node: Node,
    /// How channels to and from other endpoints are set up.
    transport: ShmTransport,
    addr: Addr,
    window: Arc<Region>,
    record_off: u64,
    doorbell: Word32,
    armed: Word32,
    closed: Word32,
    ring_seq: Word32,
    /// sent, sent bytes, received, received bytes, dropped.
    counters: [Word64; 5],
    stats: EndpointStats,
    tx: Vec<TxConn>,
    last_tx: usize,
    rx: Vec<RxRing>,
    rx_seq_seen: u32,
    rx_next: usize,
    /// The next receive looks at the direct queue before the rings (they take turns).
    direct_first: bool,
    spin_polls: u32,
    /// Spinning gives the CPU away every this many polls (0: never; see [`relax`]).
    yield_every: u32,
    link: Option<Link>,
    /// Fabrics across hosts: our own UCX worker, for datagrams to and from other hosts.
    direct: Option<direct::Direct>,
}

/// Link emulation state of an endpoint: the fabric's link model and our uplink clock.
struct Link {
    bytes_per_s: u64,
    hop_ns: u64,
    egress: Word64,
}

/// A link clock further in the future than this was scribbled on by a peer: reset it.
const LINK_CLOCK_SLACK_NS: u64 = 1_000_000_000;
/// Holds shorter than this are waited out spinning rather than sleeping.
const HOLD_SPIN_NS: u64 = 200_000;
/// A delivery time further in the future than this is corrupt.
pub(crate) const MAX_HOLD_NS: u64 = 2_000_000_000;

/// Distributed topologies: crosses every link of a route in turn (each forwarding node adds
/// its hop latency and counts the datagram); returns the delivery time.
fn stamp_route(route: &[RouteStep], len: usize) -> u64 {
    let now = crate::sync::now_ns();
    let mut t = now;
    for (k, h) in route.iter().enumerate() {
        let ser = serialise_ns(len, h.bytes_per_s);
        let start = claim(&h.clock, t, ser, now);
        t = if k + 1 == route.len() {
            start + ser
        } else {
            start + h.hop_ns.max(1)
        };
        if let Some((msgs, bytes)) = &h.fwd {
            msgs.fetch_add(1, Ordering::Relaxed);
            bytes.fetch_add(len as u64, Ordering::Relaxed);
        }
    }
    t
}

/// How long `len` bytes take on an emulated link of `bytes_per_s` (at least 1 ns).
pub(crate) fn serialise_ns(len: usize, bytes_per_s: u64) -> u64 {
    ((len as u128 * 1_000_000_000) / u128::from(bytes_per_s.max(1))).max(1) as u64
}

/// Claims `ser` ns on a link clock from `earliest` on; returns when the transfer starts.
pub(crate) fn claim(clock: &AtomicU64, earliest: u64, ser: u64, now: u64) -> u64 {
    let mut start = earliest;
    // SYNC POINT link-clock: a CAS loop; the value is a time, not a publication of data.
    let _ = clock.fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
        let cur = if cur > now + LINK_CLOCK_SLACK_NS {
            now
        } else {
            cur
        };
        start = cur.max(earliest);
        Some(start + ser)
    });
    start
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("addr", &self.addr)
            .finish()
    }
}

/// Setting `BACKPLANE_DIRECT=0` sends every datagram between hosts through the bridges (for
/// comparison; the default sends them straight between the two processes).
fn direct_wanted() -> bool {
    std::env::var_os("BACKPLANE_DIRECT").is_none_or(|v| v != "0")
}

/// A process in a node's network namespace (`exec` on a fabric with IP over it: `bp0` and
/// `lo`) does not have its host's address, `ip`, where UCX would listen and connect: its
/// endpoints' UCX works in the namespace of this host's supervisor instead, which has it
/// (`backplane_ucx::use_network_namespace`; moving a thread there needs `CAP_SYS_ADMIN`,
/// which a program `exec` starts as root has, and UCX must find the host's interfaces in
/// `/sys`, which `exec` leaves as the host's on a fabric across hosts). Decided once a process, at its first endpoint
/// that may go direct; without it, such a process's datagrams and queue pairs to other hosts
/// went through the supervisors' bridges (`ib_send_lat` 8.2 µs one way from the host's
/// namespace, 125 from a node's).
fn reach_hosts_from(fabric: &crate::fabric::Fabric, ip: std::net::IpAddr) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if backplane_ucx::address_is_local(ip) {
            return;
        }
        if let Some(ns) = fabric.supervisor_netns() {
            backplane_ucx::use_network_namespace(ns);
            // (Not where /sys shows the node's interfaces, not the host's: `ip netns exec`.)
            if !backplane_ucx::address_is_local(ip) {
                backplane_ucx::forget_network_namespace();
            }
        }
    });
}

impl Node {
    /// Binds a datagram endpoint to `port` on this node (0 picks a free port ≥ 49152).
    pub fn bind(&self, port: u32) -> Result<Endpoint, DgramError> {
        self.bind_as(port, direct_wanted())
    }

    fn bind_as(&self, port: u32, direct: bool) -> Result<Endpoint, DgramError> {
        self.check_current()?;
        // Best effort: without a worker of its own the endpoint still reaches every host
        // through the bridges, only slower. Made before the bind so that no sender on another
        // host connects in between and goes through the bridges for good.
        let direct = match self.fabric.inner.direct_ip.filter(|_| direct) {
            Some(ip) => {
                reach_hosts_from(&self.fabric, ip);
                direct::Unbound::open(ip, self.fabric.nodes()).ok()
            }
            None => None,
        };
        let (resp, _) = self.fabric.call_patiently(&Request::Bind {
            slot: self.slot,
            port,
            direct: direct.as_ref().map(|d| d.port()),
        })?;
        let Response::Bound {
            port, record_off, ..
        } = resp
        else {
            return Err(FabricError::Protocol(format!("{resp:?}")).into());
        };
        let w = self.window.clone();
        let mut h = [0u8; 64];
        w.read(record_off, &mut h).map_err(FabricError::from)?;
        EndpointRepr::parse(&EndpointHeader::new_checked(&h[..]).map_err(FabricError::from)?)
            .map_err(FabricError::from)?;
        let at32 = |o: usize| -> Result<Word32, DgramError> {
            Ok(Word32::at(&w, record_off + o as u64).map_err(FabricError::from)?)
        };
        let at64 = |o: u64| -> Result<Word64, DgramError> {
            Ok(Word64::at(&w, o).map_err(FabricError::from)?)
        };
        let c = record_off + EP_COUNTERS_OFF as u64;
        let ep = Endpoint {
            node: self.clone(),
            transport: ShmTransport::new(self.fabric.clone()),
            addr: Addr::new(self.slot, port),
            doorbell: at32(EP_DOORBELL_OFF)?,
            armed: at32(EP_ARMED_OFF)?,
            closed: at32(EP_CLOSED_OFF)?,
            ring_seq: at32(EP_RING_SEQ_OFF)?,
            counters: [
                at64(c)?,
                at64(c + 8)?,
                at64(c + 16)?,
                at64(c + 24)?,
                at64(c + 32)?,
            ],
            window: w,
            record_off,
            stats: EndpointStats::default(),
            tx: Vec::new(),
            last_tx: 0,
            rx: Vec::new(),
            rx_seq_seen: u32::MAX,
            rx_next: 0,
            direct_first: false,
            spin_polls: SPIN_POLLS,
            // A host of a fabric across hosts runs the bridge thread its senders' and
            // receivers' datagrams pass through: a waiter must not keep the CPU from it.
            yield_every: self.fabric.yield_every(),
            link: None,
            direct: None,
        };
        let mut ep = ep;
        if let Some(d) = direct {
            // The supervisor names this listener to senders on other hosts from now on: an
            // endpoint whose worker cannot run must not stay bound (dropping `ep` unbinds).
            let started = d.bound(ep.addr, ep.doorbell.clone()).map_err(|e| {
                FabricError::Protocol(format!("cannot start the endpoint's UCX waker: {e}"))
            })?;
            ep.direct = Some(started);
        }
        if let Some(l) = self.fabric.link() {
            // A slow emulated link stretches round trips: spin long enough to cover a few hops
            // so that a reply does not pay a thread wake-up the modelled link would not.
            let scale = 1 + (l.hop_ns / 1000).min(15) as u32;
            ep.spin_polls = SPIN_POLLS.saturating_mul(scale);
            ep.link = Some(Link {
                bytes_per_s: l.bytes_per_s.max(1),
                hop_ns: l.hop_ns,
                egress: Word64::at(&ep.window, WIN_LINK_EGRESS_OFF as u64)
                    .map_err(FabricError::from)?,
            });
        }
        Ok(ep)
    }
}

impl Endpoint {
    /// This endpoint's address.
    pub fn local_addr(&self) -> Addr {
        self.addr
    }

    /// Whether datagrams between this endpoint and other hosts' go straight between the two
    /// processes (a fabric across hosts, `BACKPLANE_DIRECT` not `0`, no `--link` model, and a
    /// UCX worker of its own could start), not through the supervisors' bridges. Same API
    /// either way; see `dgram/direct.rs`.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Until [`Endpoint::uncork`], small datagrams to a receiver on another host share
    /// messages, whatever their pace (nothing changes between nodes of one host): for a
    /// sender with several datagrams ready at once.
    pub fn cork(&mut self) {
        if let Some(d) = self.direct.as_mut() {
            d.cork();
        }
    }

    /// While `on`, each datagram to a receiver on another host goes at once in a message of
    /// its own, written in place into the message (what a batch held for it goes first),
    /// whatever the pace: for a sender with one datagram ready that must not wait.
    pub(crate) fn alone(&mut self, on: bool) {
        if let Some(d) = self.direct.as_mut() {
            d.alone(on);
        }
    }

    /// Sends what waited since [`Endpoint::cork`].
    pub fn uncork(&mut self) {
        if let Some(d) = self.direct.as_mut() {
            d.uncork();
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> EndpointStats {
        self.stats
    }

    /// How many times a blocked send or receive polls before it sleeps (default
    /// [`SPIN_POLLS`]). Spinning buys latency with CPU: lower it where CPUs are scarce.
    pub fn set_spin_polls(&mut self, polls: u32) {
        self.spin_polls = polls.max(1);
    }

    /// The endpoint's receive doorbell (the futex word senders bump when the endpoint is armed)
    /// and its armed flag, both in this node's window: for waiters outside the endpoint (the
    /// verbs completion channel).
    pub(crate) fn doorbell_words(&self) -> (Word32, Word32) {
        (self.doorbell.clone(), self.armed.clone())
    }

    /// Counts a datagram the application dropped on this endpoint's behalf (for example a
    /// frame for an unknown MAC), so that it shows in `stats()` and `backplane status`.
    pub fn count_drop(&mut self) {
        self.stats.dropped += 1;
        self.publish_stats();
    }

    #[inline]
    fn publish_stats(&self) {
        let s = [
            self.stats.sent,
            self.stats.sent_bytes,
            self.stats.received,
            self.stats.received_bytes,
            self.stats.dropped,
        ];
        for (w, v) in self.counters.iter().zip(s) {
            w.store(v, Ordering::Relaxed);
        }
    }

    #[inline]
    fn check_open(&self) -> Result<(), DgramError> {
        if self.closed.load(Ordering::Acquire) != 0 {
            return Err(DgramError::Closed(self.addr));
        }
        Ok(())
    }

    fn peer_state(&self, dst: Addr) -> DgramError {
        match self.node.fabric.node_info(dst.node) {
            Ok(i) if i.state == NodeState::Ready => DgramError::Unreachable(dst),
            Ok(_) => DgramError::NodeDown(dst.node),
            Err(e) => e.into(),
        }
    }

    /// Opens the route to `dst`; while `until` has not passed, waits for room that memory
    /// freed less than the allocator's quarantine ago will make (a blocking send).
    fn connect(&mut self, dst: Addr, until: Option<Instant>) -> Result<usize, DgramError> {
        let fabric = self.node.fabric.clone();
        let (transport, src) = (&self.transport, self.addr);
        let open = || transport.open_datagram(src, dst);
        let opened = match until.map_or_else(open, |t| crate::fabric::while_room_comes(t, open)) {
            Ok(o) => o,
            Err(FabricError::Refused { kind, message }) => {
                self.stats.dropped += 1;
                self.publish_stats();
                return Err(match kind {
                    ErrorKind::NoRoute => DgramError::NoRoute(message),
                    ErrorKind::NodeDown => {
                        if !fabric
                            .node_info(self.addr.node)
                            .is_ok_and(|i| i.state == NodeState::Ready)
                        {
                            DgramError::Closed(self.addr)
                        } else {
                            DgramError::NodeDown(dst.node)
                        }
                    }
                    ErrorKind::Invalid => DgramError::Closed(self.addr),
                    // A window full: the supervisor's line says whose and what to do.
                    ErrorKind::NoSpace => {
                        DgramError::Fabric(FabricError::Refused { kind, message })
                    }
                    _ => DgramError::Unreachable(dst),
                });
            }
            Err(e) => return Err(e.into()),
        };
        // Link emulation (the link model's clocks live in the nodes' windows).
        let f = FabricError::from;
        let emulated = self.link.is_some() && dst.node != self.addr.node;
        let hops = &opened.route;
        let mut route = Vec::new();
        for (k, h) in hops.iter().enumerate() {
            fabric.check_slot(h.from)?;
            fabric.check_slot(h.to)?;
            let from_w = fabric.window(h.from)?;
            let clock = Word64::at(
                &from_w,
                (WIN_LINK_CLOCKS_OFF + 8 * (h.to as usize - 1)) as u64,
            )
            .map_err(f)?;
            let fwd = if k + 1 < hops.len() {
                let to_w = fabric.window(h.to)?;
                Some((
                    Word64::at(&to_w, WIN_FWD_OFF as u64).map_err(f)?,
                    Word64::at(&to_w, WIN_FWD_OFF as u64 + 8).map_err(f)?,
                ))
            } else {
                None
            };
            route.push(RouteStep {
                clock,
                bytes_per_s: h.bytes_per_s.max(1),
                hop_ns: h.hop_ns,
                fwd,
            });
        }
        let dst_ingress = if emulated {
            let dst_win = fabric.window(dst.node)?;
            Some(Word64::at(&dst_win, WIN_LINK_INGRESS_OFF as u64).map_err(f)?)
        } else {
            None
        };
        let direct = match (opened.direct, self.direct.as_mut()) {
            (Some(to), Some(d)) => d.connect(to, dst).is_ok().then_some(to),
            _ => None,
        };
        let conn = TxConn {
            dst,
            route,
            dst_ingress,
            ch: opened.ch,
            direct,
        };
        // The supervisor hands back an existing ring only if this endpoint fed it before and
        // then dropped it (after a corruption): its sequence state is lost, so refuse it.
        if conn.ch.published_anything() {
            return Err(DgramError::Corrupt {
                addr: dst,
                what: "ring was retired after an earlier error; bind a new endpoint",
            });
        }
        self.tx.push(conn);
        Ok(self.tx.len() - 1)
    }

    fn tx_index(&mut self, dst: Addr) -> Result<usize, DgramError> {
        self.tx_index_waiting(dst, Wait::Never)
    }

    /// [`Endpoint::tx_index`] for a send that may wait as `wait` says (at most
    /// [`crate::fabric::ROOM_PATIENCE`]) for room to open a route in.
    fn tx_index_waiting(&mut self, dst: Addr, wait: Wait) -> Result<usize, DgramError> {
        if self.tx.get(self.last_tx).is_some_and(|c| c.dst == dst) {
            return Ok(self.last_tx);
        }
        let i = match self.tx.iter().position(|c| c.dst == dst) {
            Some(i) => i,
            None => {
                let patience = match wait {
                    Wait::Never => None,
                    Wait::For(d) => Some(d.min(crate::fabric::ROOM_PATIENCE)),
                    Wait::Forever => Some(crate::fabric::ROOM_PATIENCE),
                };
                self.connect(dst, patience.map(|p| Instant::now() + p))?
            }
        };
        self.last_tx = i;
        Ok(i)
    }

    fn drop_conn(&mut self, i: usize) {
        let c = self.tx.swap_remove(i);
        if let (Some(to), Some(d)) = (c.direct, self.direct.as_mut()) {
            d.disconnect(to);
        }
        self.last_tx = 0;
    }

    /// As [`Endpoint::send_with_max`] with [`Wait::Never`], for a datagram of `head`, `len`
    /// bytes of `body` at `off` and `tail`: over a direct connection (another host) UCX reads
    /// those bytes in place — no copy into a message; a clone of `body` keeps them mapped
    /// until the send completes — else they are copied as `send_with_max` does. The caller
    /// leaves them unchanged until the peer answered (a QP's RDMA WRITE source or SEND
    /// payload, which the program may not touch before its completion): so in a stream of
    /// large ones the datagram may wait a little for the next ones to share its message
    /// (see `direct::Worker::send_zc_held`).
    pub(crate) fn send_span(
        &mut self,
        dst: Addr,
        (head, tail): (&[u8], &[u8]),
        (body, off, len): (&crate::mem::Span, u64, usize),
    ) -> Result<bool, DgramError> {
        let total = head.len() + len + tail.len();
        if total > MAX_DGRAM {
            return Err(DgramError::TooBig(total));
        }
        self.check_open()?;
        let i = self.tx_index(dst)?;
        let c = &self.tx[i];
        if let (false, Some(to), Some(d), Ok(bytes)) = (
            c.ch.receiver_gone(),
            c.direct,
            self.direct.as_mut(),
            crate::mem::SpanBytes::new(body, off, len),
        ) {
            match d.send_zc_held(to, dst, (head, Box::new(bytes), tail)) {
                Ok(()) => {
                    self.count_sent(1, total);
                    return Ok(true);
                }
                Err(direct::Blocked::Full) => return Err(DgramError::WouldBlock),
                // The connection broke: the general path says how (or reconnects).
                Err(direct::Blocked::Failed) => {}
            }
        }
        self.send_with_max(dst, total, Wait::Never, |buf| {
            let (h, rest) = buf[..total].split_at_mut(head.len());
            let (b, t) = rest.split_at_mut(len);
            h.copy_from_slice(head);
            body.read(off, b).ok()?;
            t.copy_from_slice(tail);
            Some(total)
        })
    }

    /// Sends `data` to `dst`, waiting for room as `wait` says.
    ///
    /// Over a direct connection (a receiver on another host) a large datagram sent with
    /// [`Wait::Forever`] is not copied into a message: UCX reads it from `data`, and the call
    /// returns once it did (the kernel took the bytes, or the send failed).
    pub fn send(&mut self, dst: Addr, data: &[u8], wait: Wait) -> Result<(), DgramError> {
        if data.len() > direct::LENT_MIN && matches!(wait, Wait::Forever) {
            if let Some(r) = self.send_lent(dst, &[data]) {
                return r;
            }
        }
        self.send_general(dst, data.len(), wait, true, |buf| {
            buf.copy_from_slice(data);
            Some(data.len())
        })
        .map(|_| ())
    }

    /// Sends each of `datagrams` to `dst` as a datagram of its own, in order, waiting for
    /// room as `wait` says — as that many [`Endpoint::send`]s (`sendmmsg` to `send`'s
    /// `sendto`), but over a direct connection (a receiver on another host) a blocking call
    /// hands up to 64 of them (at most ~2 MiB, in at most 14 pieces of memory: datagrams
    /// that lie back to back count once) to UCX as one message read in place, and returns
    /// once UCX let go of them: no copy on the sender. A frame cut into datagrams (a 1 MiB
    /// image as 16) goes this way as one message. On an error the datagrams before it were
    /// sent; which of the failing group arrived is not known (the receiver's node went
    /// down, or its connection broke).
    pub fn send_many(
        &mut self,
        dst: Addr,
        datagrams: &[&[u8]],
        wait: Wait,
    ) -> Result<(), DgramError> {
        let mut rest = datagrams;
        while !rest.is_empty() {
            // The next group: as many as fit one message (at least one): its bytes, and the
            // pieces of memory they are in (datagrams back to back count once).
            let (mut n, mut bytes, mut pieces) = (0, 0, 0);
            while n < rest.len().min(direct::LIST_MAX) {
                let piece = usize::from(n == 0 || !direct::back_to_back(rest[n - 1], rest[n]));
                if n > 0
                    && (bytes + rest[n].len() > direct::LIST_FRAME_BYTES
                        || pieces + piece > direct::LIST_PIECES)
                {
                    break;
                }
                bytes += rest[n].len();
                pieces += piece;
                n += 1;
            }
            let (group, after) = rest.split_at(n);
            rest = after;
            if n > 1 && matches!(wait, Wait::Forever) {
                if let Some(r) = self.send_lent(dst, group) {
                    r?;
                    continue;
                }
            }
            for d in group {
                self.send(dst, d, wait)?;
            }
        }
        Ok(())
    }

    /// A blocking send of the datagrams of `list` (one, or several as one message) over a
    /// direct connection with UCX reading the bytes in place: the sender's copy into the
    /// message is saved, and the call waits instead until the kernel took the bytes — where
    /// a stream's sender waits anyway once UCX holds its window. `None` when they must take
    /// the general path (no direct connection, one datagram in a stream — batched —, UCX's
    /// window full, the connection broken: that path waits, reconnects or says why).
    fn send_lent(&mut self, dst: Addr, list: &[&[u8]]) -> Option<Result<(), DgramError>> {
        // (A fabric on one host has no direct connections: nothing checked twice there.)
        self.direct.as_ref()?;
        if let Some(big) = list.iter().find(|d| d.len() > MAX_DGRAM) {
            return Some(Err(DgramError::TooBig(big.len())));
        }
        if let Err(e) = self.check_open() {
            return Some(Err(e));
        }
        let i = match self.tx_index_waiting(dst, Wait::Forever) {
            Ok(i) => i,
            Err(e) => return Some(Err(e)),
        };
        let c = &self.tx[i];
        let (false, Some(to), Some(d)) = (c.ch.receiver_gone(), c.direct, self.direct.as_mut())
        else {
            return None;
        };
        let (fabric, ch) = (&self.node.fabric, &c.ch);
        // Asked now and then while the kernel does not take the bytes (the receiver stopped
        // reading): its node and route still there.
        let mut alive = || {
            !ch.receiver_gone()
                && fabric
                    .node_info(dst.node)
                    .is_ok_and(|n| n.state == NodeState::Ready)
        };
        match d.send_lent(to, dst, list, &mut alive) {
            Ok(false) => None,
            Ok(true) => {
                self.count_sent(list.len(), list.iter().map(|d| d.len()).sum());
                Some(Ok(()))
            }
            Err(direct::Blocked::Full | direct::Blocked::Failed) => None,
        }
    }

    /// Counts `n` datagrams of `bytes` in all as sent (and publishes the counters).
    fn count_sent(&mut self, n: usize, bytes: usize) {
        self.stats.sent += n as u64;
        self.stats.sent_bytes += bytes as u64;
        self.publish_stats();
    }

    /// Sends `data` to `dst`, blocking while the receiver's ring is full.
    pub fn send_to(&mut self, dst: Addr, data: &[u8]) -> Result<(), DgramError> {
        self.send(dst, data, Wait::Forever)
    }

    /// Sends `data` to `dst`, or returns [`DgramError::WouldBlock`] if the ring is full.
    pub fn try_send_to(&mut self, dst: Addr, data: &[u8]) -> Result<(), DgramError> {
        self.send(dst, data, Wait::Never)
    }

    /// Zero-copy send: `fill` writes the `len`-byte payload straight into the receiver's ring.
    pub fn send_with(
        &mut self,
        dst: Addr,
        len: usize,
        wait: Wait,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), DgramError> {
        self.send_with_max(dst, len, wait, |buf| {
            fill(buf);
            Some(buf.len())
        })
        .map(|_| ())
    }

    /// Zero-copy send of a payload whose length is known only once it is written: `fill` gets
    /// `max_len` bytes of ring memory and returns how many it used, or `None` to abandon the
    /// send (nothing is published). Returns whether a datagram was sent.
    ///
    /// `fill` should not wait for its data: to a node on another host it writes into the
    /// message UCX sends, under the lock of the endpoint's UCX worker, and while it waits
    /// nothing else moves what that worker holds (a reader of a device checks that data is
    /// there first, as `net`'s agent does).
    pub fn send_with_max(
        &mut self,
        dst: Addr,
        max_len: usize,
        wait: Wait,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<bool, DgramError> {
        self.send_general(dst, max_len, wait, false, fill)
    }

    /// [`Endpoint::send_with_max`]; `exact`: `max_len` is the datagram's length (a large one
    /// may then join a stream's batch over a direct connection, see `dgram/direct.rs`).
    fn send_general(
        &mut self,
        dst: Addr,
        max_len: usize,
        wait: Wait,
        exact: bool,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<bool, DgramError> {
        let len = max_len;
        if len > MAX_DGRAM {
            return Err(DgramError::TooBig(len));
        }
        self.check_open()?;
        // (Started first: waiting for room to open the route spends the same wait.)
        let deadline = deadline_of(wait);
        let mut i = self.tx_index_waiting(dst, wait)?;
        let mut spins = 0u32;
        let mut reconnected = false;
        // Taken by the send that goes (a direct send that must wait leaves it).
        let mut fill = Some(fill);
        loop {
            let c = &mut self.tx[i];
            if c.ch.receiver_gone() {
                // The ring was torn down under us (receiver gone, its node or a forwarding
                // node DOWN). Connect once more: that re-routes, or says why it cannot.
                self.drop_conn(i);
                self.check_open()?;
                if reconnected {
                    return Err(self.peer_state(dst));
                }
                reconnected = true;
                i = self.tx_index(dst)?;
                continue;
            }
            if let (Some(to), Some(d)) = (c.direct, self.direct.as_mut()) {
                let fill = &mut fill;
                match d.send(to, dst, len, exact, |buf| fill.take().and_then(|f| f(buf))) {
                    Ok(None) => return Ok(false),
                    Ok(Some(used)) => {
                        self.count_sent(1, used);
                        return Ok(true);
                    }
                    // Full: the receiver is behind. Failed: the connection broke; the
                    // supervisors end the route (flags above) or the node's state changes.
                    Err(direct::Blocked::Full | direct::Blocked::Failed) => {}
                }
                if fill.is_none() {
                    // Written, then refused by UCX (the connection broke under it): gone.
                    return Err(self.peer_state(dst));
                }
                if !self.spin_once(wait, &deadline, &mut spins)? {
                    if let Some(d) = self.direct.as_mut() {
                        d.wait(cap(deadline.remaining()).unwrap_or(Duration::from_millis(100)));
                    }
                    self.check_open()?;
                    self.node.fabric.check_supervisor()?;
                    if self
                        .node
                        .fabric
                        .node_info(dst.node)
                        .is_ok_and(|n| n.state != NodeState::Ready)
                    {
                        return Err(self.peer_state(dst));
                    }
                }
                continue;
            }
            match c.ch.reserve(len) {
                Ok(mut r) => {
                    // (Still there: only a direct send takes it, and one that failed after
                    // taking it returned above.)
                    let Some(fill) = fill.take() else {
                        return Err(self.peer_state(dst));
                    };
                    // SAFETY: the reservation is inside the data area and ours until commit.
                    let used = fill(unsafe { slice_mut(c.ch.data(), r.pos, len) });
                    let Some(used) = used.filter(|&u| u <= len) else {
                        return Ok(false); // abandoned: the producer index never moved
                    };
                    r.len = used;
                    if !c.route.is_empty() {
                        r.not_before_ns = stamp_route(&c.route, used);
                    } else if let (Some(l), Some(ing)) = (&self.link, &c.dst_ingress) {
                        // Link emulation: serialise on our uplink, cross the switch, serialise
                        // on the receiver's downlink; the record is delivered when that ends.
                        let ser = serialise_ns(used, l.bytes_per_s);
                        let now = crate::sync::now_ns();
                        let up = claim(&l.egress, now, ser, now);
                        let down = claim(ing, up + l.hop_ns, ser, now);
                        r.not_before_ns = down + ser;
                    }
                    c.ch.commit(r);
                    // SYNC POINT doorbell-arm (sender): in `wake_receiver` (`Bell::wake`).
                    c.ch.wake_receiver();
                    self.count_sent(1, used);
                    return Ok(true);
                }
                Err(RingError::Full) => {}
                Err(RingError::TooBig(n)) => return Err(DgramError::TooBig(n)),
                Err(RingError::Corrupt(what)) => {
                    self.drop_conn(i);
                    self.stats.dropped += 1;
                    self.publish_stats();
                    return Err(DgramError::Corrupt { addr: dst, what });
                }
            }
            // Ring full: spin a little, then sleep on the credit doorbell.
            if self.spin_once(wait, &deadline, &mut spins)? {
                continue;
            }
            let c = &mut self.tx[i];
            // SYNC POINT credit-arm (sender): in `wait_for_room`.
            c.ch.wait_for_room(len, cap(deadline.remaining()));
            let still_full = !c.ch.has_room(len).unwrap_or(true);
            self.check_open()?;
            if still_full {
                self.node.fabric.check_supervisor()?; // slept without credit: still there?
            }
        }
    }

    /// One more round of a blocked send: an error when it must stop waiting (`WouldBlock`,
    /// `TimedOut`), true after a spin, false when it is time to sleep.
    #[inline]
    fn spin_once(
        &self,
        wait: Wait,
        deadline: &Deadline,
        spins: &mut u32,
    ) -> Result<bool, DgramError> {
        match wait {
            Wait::Never => return Err(DgramError::WouldBlock),
            _ if deadline.expired() => return Err(DgramError::TimedOut),
            _ => {}
        }
        *spins += 1;
        if *spins < self.spin_polls {
            relax(*spins, self.yield_every);
            return Ok(true);
        }
        Ok(false)
    }

    fn refresh_rx(&mut self) -> Result<(), DgramError> {
        let seq = self.ring_seq.load(Ordering::Acquire);
        if seq == self.rx_seq_seen {
            return Ok(());
        }
        let w = self.window.clone();
        let rec = self.record_off;
        let f = FabricError::from;
        self.rx_seq_seen = seq;
        // SYNC POINT ring-list (acquire): listed rings have initialised headers.
        let count = w
            .u32_at(rec + EP_RING_COUNT_OFF as u64)
            .map_err(f)?
            .load(Ordering::Acquire)
            .min(ENDPOINT_MAX_RINGS);
        let mut listed = Vec::with_capacity(count as usize);
        for i in 0..count {
            let off = w
                .u64_at(rec + EP_RING_LIST_OFF as u64 + 8 * u64::from(i))
                .map_err(f)?
                .load(Ordering::Acquire);
            if off != 0 {
                listed.push(off);
            }
        }
        self.rx.retain(|r| listed.contains(&r.ring_off));
        for off in listed {
            if self.rx.iter().any(|r| r.ring_off == off) {
                continue;
            }
            match self.open_rx(off) {
                Ok(r) => self.rx.push(r),
                Err(_) => {
                    self.stats.dropped += 1;
                    self.publish_stats();
                }
            }
        }
        Ok(())
    }

    fn open_rx(&self, ring_off: u64) -> Result<RxRing, FabricError> {
        let (src, ch) = self.transport.accept_datagram(self.addr, ring_off)?;
        Ok(RxRing { src, ring_off, ch })
    }

    /// Zero-copy receive: calls `read` with the sender's address and the payload in place in
    /// the ring. The datagram is consumed only if `read` returns `Ok`.
    pub fn recv_with<R>(
        &mut self,
        wait: Wait,
        read: impl FnMut(Addr, &[u8]) -> Result<R, DgramError>,
    ) -> Result<R, DgramError> {
        self.recv_inner(wait, true, false, read)
    }

    /// Receives what is there: at least one datagram (waiting for it as `wait` says) and at
    /// most `max`, each given to `read` in place, in each sender's order; returns how many
    /// `read` took. From other hosts every datagram one look at the network brings is read
    /// where UCX received it, the datagrams of a batch (`send_many`) too — [`recv_with`]
    /// takes one a call, and what else that look brought is copied out of UCX's buffer to
    /// wait for the next calls (a stream of 1 MiB `send_many`s between hosts: a copy of every
    /// byte, a tenth of the receiver's time). A datagram `read` refuses (an error) is not
    /// taken: it stays the next one, and the error is returned unless some were taken before
    /// it (then the count, and the next call meets it first).
    ///
    /// [`recv_with`]: Endpoint::recv_with
    pub fn recv_many_with(
        &mut self,
        wait: Wait,
        max: usize,
        mut read: impl FnMut(Addr, &[u8]) -> Result<(), DgramError>,
    ) -> Result<usize, DgramError> {
        let max = max.max(1);
        let (n, full) = (std::cell::Cell::new(0usize), std::cell::Cell::new(false));
        // `read`, counted and stopped at `max` (the rest stays for the next call).
        let mut counted = |src: Addr, p: &[u8]| -> Result<(), DgramError> {
            if n.get() >= max {
                full.set(true);
                return Err(DgramError::WouldBlock);
            }
            read(src, p)?;
            n.set(n.get() + 1);
            Ok(())
        };
        // What waits already (rings of this host's senders, what a look queued) comes before
        // what the network brings now; then one look, every datagram of it in place; then
        // what that look queued. If none of it had anything, the first datagram is waited for.
        let mut r = self.drain_taken(&mut counted);
        if r.is_ok() && n.get() < max {
            r = self.recv_direct_all_with(&mut counted).map(|_| ());
        }
        if r.is_ok() && n.get() < max {
            r = self.drain_taken(&mut counted);
        }
        if r.is_ok() && n.get() == 0 {
            // (Waiting, each look still takes every datagram it brings in place.)
            r = self.recv_inner(wait, true, true, &mut counted);
        }
        match r {
            Ok(()) => Ok(n.get()),
            Err(_) if full.get() || n.get() != 0 => Ok(n.get()),
            Err(e) => Err(e),
        }
    }

    /// Gives `read` every datagram that is there without a look at the network
    /// ([`Endpoint::recv_taken_with`]), until it has none or `read` refuses one.
    fn drain_taken(
        &mut self,
        read: &mut impl FnMut(Addr, &[u8]) -> Result<(), DgramError>,
    ) -> Result<(), DgramError> {
        loop {
            match self.recv_taken_with(&mut *read) {
                Ok(()) => {}
                Err(DgramError::WouldBlock) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// As [`Endpoint::recv_with`] without waiting, and of datagrams from other hosts only
    /// those already taken off the wire (no look at the network: over TCP that is a system
    /// call, which a caller that just received and drains what came with it need not pay).
    pub(crate) fn recv_taken_with<R>(
        &mut self,
        read: impl FnMut(Addr, &[u8]) -> Result<R, DgramError>,
    ) -> Result<R, DgramError> {
        // Nothing can be there — no record in the rings of this host's senders (nor a sender
        // gone, whose ring the general way retires), no ring new, nothing queued by the
        // worker: most calls, right after a look that read what came (a direct QP pair's
        // `take`; the look and this one locked the worker both, ~170 cycles of a SEND's
        // turnaround between hosts). A pair's endpoint keeps the ring its peer's first
        // messages came by through the bridges (before the direct connection): checked
        // whole, it was ~160 instructions a poll of `perf send-lat` between hosts.
        if self.ring_seq.load(Ordering::Acquire) == self.rx_seq_seen
            && self.direct.as_ref().is_some_and(|d| !d.may_have_queued())
            && self
                .rx
                .iter()
                .all(|r| r.ch.is_drained() && !r.ch.sender_gone())
        {
            self.check_open()?;
            return Err(DgramError::WouldBlock);
        }
        self.recv_inner(Wait::Never, false, false, read)
    }

    /// `look`: at the network too (the endpoint's UCX worker); `many`: a look gives `read`
    /// every datagram it brings (the value of the last is returned), not the first only.
    fn recv_inner<R>(
        &mut self,
        wait: Wait,
        look: bool,
        many: bool,
        mut read: impl FnMut(Addr, &[u8]) -> Result<R, DgramError>,
    ) -> Result<R, DgramError> {
        let deadline = deadline_of(wait);
        let mut spins = 0u32;
        loop {
            self.check_open()?;
            self.refresh_rx()?;
            // The worker was looked at (and found nothing) with nothing else between.
            let mut direct_looked = false;
            if look && (self.direct_first || self.rx.is_empty()) {
                if let Some(out) = self.look_direct(many, &mut read) {
                    return out;
                }
                direct_looked = true;
            }
            let n = self.rx.len();
            let mut retire = None;
            let mut due: Option<u64> = None;
            for k in 0..n {
                let i = (self.rx_next + k) % n;
                let r = &mut self.rx[i];
                match r.ch.peek() {
                    Ok(Some(rec))
                        if rec.not_before_ns != 0 && {
                            let now = crate::sync::now_ns();
                            rec.not_before_ns > now
                        } =>
                    {
                        // Link emulation: on the wire still. Too far out is a corrupt stamp.
                        if rec.not_before_ns > crate::sync::now_ns() + MAX_HOLD_NS {
                            retire = Some((i, true));
                            break;
                        }
                        due = Some(due.map_or(rec.not_before_ns, |d| d.min(rec.not_before_ns)));
                    }
                    Ok(Some(rec)) => {
                        // SAFETY: peek validated the record lies inside the data area; it is
                        // ours to read until release.
                        let payload = unsafe { slice_mut(r.ch.data(), rec.pos, rec.len) };
                        let out = read(r.src, payload)?;
                        r.ch.release(rec);
                        // SYNC POINT credit-arm (receiver): in `wake_sender` (`Bell::wake`).
                        r.ch.wake_sender();
                        self.rx_next = i + 1;
                        self.direct_first = true;
                        self.stats.received += 1;
                        self.stats.received_bytes += rec.len as u64;
                        self.publish_stats();
                        return Ok(out);
                    }
                    Ok(None) => {
                        if r.ch.sender_gone() {
                            // Re-check after seeing the flag: records published before it count.
                            if let Ok(None) = r.ch.peek() {
                                retire = Some((i, false));
                                break;
                            }
                        }
                    }
                    Err(RingError::Corrupt(_)) | Err(_) => {
                        retire = Some((i, true));
                        break;
                    }
                }
            }
            if let Some((i, corrupt)) = retire {
                let r = self.rx.swap_remove(i);
                if corrupt {
                    self.stats.dropped += 1;
                    self.publish_stats();
                }
                self.transport.retire_datagram(self.addr, r.ring_off);
                continue;
            }
            if look && !direct_looked {
                if let Some(out) = self.look_direct(many, &mut read) {
                    return out;
                }
            } else if !(direct_looked && n == 0) {
                if let Some(out) = self.recv_direct(&mut read) {
                    return out;
                }
            }
            match wait {
                Wait::Never => return Err(DgramError::WouldBlock),
                _ if deadline.expired() => return Err(DgramError::TimedOut),
                _ => {}
            }
            spins += 1;
            let hold = due.map(|d| d.saturating_sub(crate::sync::now_ns()));
            // Short holds are spun out: a futex timeout overshoots by the timer slack (50 µs).
            if spins < self.spin_polls || hold.is_some_and(|h| h < HOLD_SPIN_NS) {
                relax(spins, self.yield_every);
                continue;
            }
            let s = self.doorbell.load(Ordering::Acquire);
            if !self.arm_and_look() {
                let bell = &self.doorbell;
                // Wake a little early for a long hold and spin the rest.
                let hold = hold.map(|h| h - HOLD_SPIN_NS / 2);
                let until = match (deadline.remaining(), hold) {
                    (Some(r), Some(h)) => Some(r.min(Duration::from_nanos(h))),
                    (r, None) => r,
                    (None, Some(h)) => Some(Duration::from_nanos(h)),
                };
                futex_wait(bell, s, cap(until));
                if bell.load(Ordering::Acquire) == s {
                    self.node.fabric.check_supervisor()?; // slept without a ring: still there?
                }
            }
            self.disarm();
            spins = self.spin_polls / 2;
        }
    }

    /// Arms the doorbell, then looks at everything that may bring a datagram: true if one
    /// may be there (the caller disarms either way).
    fn arm_and_look(&mut self) -> bool {
        self.armed.store(1, Ordering::Relaxed);
        // SYNC POINT doorbell-arm (receiver): armed before we re-check every ring.
        fence(Ordering::SeqCst);
        // A direct endpoint's worker is watched by its waker, which rings the doorbell.
        let direct_busy = self
            .direct
            .as_mut()
            .is_some_and(|d| d.has_queued() || !d.arm());
        direct_busy
            || self.rx.iter().any(|r| !r.ch.is_drained())
            || self.ring_seq.load(Ordering::Acquire) != self.rx_seq_seen
            || self.closed.load(Ordering::Acquire) != 0
    }

    /// For a watcher outside the endpoint that sleeps on its doorbell (a UD queue pair's
    /// completion channel), after it armed the doorbell and read its value: has the
    /// endpoint's own UCX worker, if it has one, ring the doorbell when it has news (its
    /// waker does). True if a datagram from it may be there already (look now).
    pub(crate) fn arm_direct_for_doorbell(&self) -> bool {
        self.direct
            .as_ref()
            .is_some_and(|d| d.has_queued() || !d.arm())
    }

    /// For a thread that serves this endpoint alone (a direct QP pair's): arms the
    /// endpoint's own UCX worker and returns descriptors one of which becomes readable when it
    /// has news — one wake-up, not the waker's and then the doorbell's: the worker's, and an
    /// eventfd for arrivals another thread's look took off the wire (the waker's, a sender's;
    /// empty it with [`drain_took`] once awake). `None` when a datagram may already be there,
    /// or the endpoint has no worker of its own.
    pub(crate) fn arm_fd(&mut self) -> Option<(std::os::fd::OwnedFd, Arc<std::os::fd::OwnedFd>)> {
        if self.rx.iter().any(|r| !r.ch.is_drained()) {
            return None;
        }
        self.direct.as_mut()?.arm_fd()
    }

    /// Ends a wait that armed the doorbell.
    fn disarm(&mut self) {
        self.armed.store(0, Ordering::Relaxed);
    }

    /// The oldest datagram that came straight from another host, given to `read` (`None`:
    /// none waits).
    fn recv_direct<R>(
        &mut self,
        read: &mut impl FnMut(Addr, &[u8]) -> Result<R, DgramError>,
    ) -> Option<Result<R, DgramError>> {
        let (len, out) = self
            .direct
            .as_mut()?
            .take(|src, payload| read(src, payload))?;
        self.took_direct(len, out.is_ok());
        Some(out)
    }

    /// Moves the endpoint's own UCX worker along and gives the oldest datagram from another
    /// host to `read` — straight from UCX's receive buffer when none was queued (`None`: none
    /// waits, or the endpoint has no worker of its own).
    fn look_direct<R>(
        &mut self,
        many: bool,
        read: &mut impl FnMut(Addr, &[u8]) -> Result<R, DgramError>,
    ) -> Option<Result<R, DgramError>> {
        if many {
            // Every datagram of the look, in place; the last one's value (some were taken
            // before a refusal: the caller counted them).
            let mut last = None;
            let r = self.recv_direct_all_with(|src, p| {
                last = Some(read(src, p)?);
                Ok(())
            });
            return match (r, last) {
                (_, Some(v)) => Some(Ok(v)),
                // (A look takes nothing in place while the worker has datagrams queued: the
                // oldest of those, then — the worker locked again only if some may be, not
                // on every empty turn of a wait.)
                (Ok(_), None) if self.direct.as_ref().is_some_and(|d| d.may_have_queued()) => {
                    self.recv_direct(read)
                }
                (Ok(_), None) => None,
                (Err(e), None) => Some(Err(e)),
            };
        }
        let (rejected, got) = self.direct.as_mut()?.progress_take(|src, p| read(src, p));
        if rejected != 0 {
            self.stats.dropped += rejected;
            self.publish_stats();
        }
        let (len, out) = got?;
        self.took_direct(len, out.is_ok());
        Some(out)
    }

    /// Takes what one look at the network brings from other hosts, every datagram read by
    /// `read` where UCX received it (see `direct::Direct::progress_take_all`); the number
    /// taken (0 without a direct worker). What `read` declines with an error stays the next
    /// datagram, and the error is returned. Rings and queued datagrams are left to the
    /// other calls (`recv_taken_with`).
    pub(crate) fn recv_direct_all_with(
        &mut self,
        read: impl FnMut(Addr, &[u8]) -> Result<(), DgramError>,
    ) -> Result<usize, DgramError> {
        self.check_open()?;
        let Some(d) = self.direct.as_mut() else {
            return Ok(0);
        };
        let (rejected, n, bytes, err) = d.progress_take_all(read);
        if n != 0 {
            self.direct_first = false;
            self.stats.received += n as u64;
            self.stats.received_bytes += bytes as u64;
        }
        if rejected != 0 {
            self.stats.dropped += rejected;
        }
        if n != 0 || rejected != 0 {
            self.publish_stats();
        }
        err.map_or(Ok(n), Err)
    }

    /// A datagram of `len` bytes from another host was given to the reader (`taken`: and
    /// taken).
    fn took_direct(&mut self, len: usize, taken: bool) {
        if taken {
            self.direct_first = false;
            self.stats.received += 1;
            self.stats.received_bytes += len as u64;
            self.publish_stats();
        }
    }

    /// Receives one datagram into `buf`, waiting as `wait` says; returns its length and sender.
    pub fn recv(&mut self, buf: &mut [u8], wait: Wait) -> Result<(usize, Addr), DgramError> {
        self.recv_with(wait, |src, payload| {
            let have = buf.len();
            let dst = buf
                .get_mut(..payload.len())
                .ok_or(DgramError::BufferTooSmall {
                    have,
                    need: payload.len(),
                })?;
            dst.copy_from_slice(payload);
            Ok((payload.len(), src))
        })
    }

    /// Receives one datagram into `buf`, blocking until one arrives.
    pub fn recv_from(&mut self, buf: &mut [u8]) -> Result<(usize, Addr), DgramError> {
        self.recv(buf, Wait::Forever)
    }

    /// Receives one datagram if one is queued, else [`DgramError::WouldBlock`].
    pub fn try_recv_from(&mut self, buf: &mut [u8]) -> Result<(usize, Addr), DgramError> {
        self.recv(buf, Wait::Never)
    }

    /// Receives one datagram, waiting at most `timeout`.
    pub fn recv_from_timeout(
        &mut self,
        buf: &mut [u8],
        timeout: Duration,
    ) -> Result<(usize, Addr), DgramError> {
        self.recv(buf, Wait::For(timeout))
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // What a direct send acknowledged leaves before the endpoint goes (`Direct`'s drop).
        self.direct = None;
        let _ = self.node.fabric.call(&Request::Unbind {
            slot: self.addr.node,
            port: self.addr.port,
        });
    }
}

fn deadline_of(wait: Wait) -> Deadline {
    match wait {
        Wait::For(d) => Deadline::after(Some(d)),
        _ => Deadline::after(None),
    }
}

/// Sleeps are capped so that a lost wake-up (a peer that died between publishing and ringing)
/// costs at most this much latency, never a hang.
fn cap(remaining: Option<Duration>) -> Option<Duration> {
    const MAX_SLEEP: Duration = Duration::from_millis(100);
    Some(remaining.map_or(MAX_SLEEP, |r| r.min(MAX_SLEEP)))
}
