//! The transport: how a path reaches another node. Every one-sided access to a peer's memory
//! (verbs RDMA WRITE / READ / atomics, DMA segments on another node), the granting that
//! precedes it, and the liveness of the peer behind it go through the [`Transport`] and
//! [`RemoteRegion`] traits; the paths above (`verbs`, `dma`) never map a peer's memory
//! themselves and never ask the fabric's node table directly whether a peer lives.
//!
//! Today there is one implementation, [`shm::ShmTransport`]: every node of the fabric is a
//! process on this host, a grant is a memfd passed over the supervisor's socket and mapped, and
//! an access is a checked copy or atomic on that mapping ([`crate::mem::Span`]). Across hosts
//! (issue 19) the same transport reaches another host's nodes through its supervisor's shadows
//! of them, which the supervisors' bridges mirror over UCX: a QP connects to a shadow QP as to
//! a local one, and a region of a QP on another host is an [`across::AcrossRegion`] — puts and
//! gets are requests the owner's bridge carries out — whose puts land later
//! ([`RemoteRegion::ticket`], [`RemoteRegion::settled`]). A transport whose senders and
//! receivers speak UCX themselves (`ucp_put_nbx`/`ucp_get_nbx`, packed rkeys exchanged through
//! the supervisors) would implement the same traits; nothing in the paths would change.
//!
//! Messages go through the other pair of traits, [`SendChannel`] and [`RecvChannel`]: one
//! direction of a message channel to one peer, with room reserved, filled and committed by the
//! sender and records peeked, read and released by the receiver, in order, with back-pressure
//! (a full channel refuses a reservation, it never drops). The datagram rings of
//! [`crate::dgram`] and the QP ring that carries SEND/RECV and WRITE_WITH_IMM notifications
//! use nothing else of a ring; [`shm::ShmSender`]/[`shm::ShmReceiver`] are the shared-memory
//! SPSC ring ([`crate::ring`]) behind them. A network engine implements them as active
//! messages: `reserve` hands out a local staging span, `commit` sends it, the receiver's
//! callback appends to a local span that `peek` reads, and `release` returns a credit. Waking
//! a sleeping peer is the channel's too (`wake_receiver`, `wake_sender`: a futex doorbell in
//! the peer's memory here, nothing for a transport whose arrivals wake by themselves), and so
//! is the channel's life (`receiver_gone`, `sender_gone`, `wait_for_room`). Datagram channels
//! are set up through the transport too ([`Channels`]: `open_datagram`, `accept_datagram`,
//! `retire_datagram`), so the datagram path never speaks the supervisor's ring broker. A QP's
//! connection is not yet: it maps its peer's QP block and keeps its reliability words
//! (credits, NAK, RNR, peer error) and its peer's event doorbell there; see
//! `docs/architecture.md`.
//!
//! Promises of every implementation: an access outside the granted bytes is an error, never an
//! access; a region whose owner deregistered it, or whose node went DOWN, answers
//! `valid() == false` before the next access; `put` with [`CopyKind::Ordered`] makes the last
//! 8 bytes visible after all the others (a peer polling the last byte sees the whole payload).

#![forbid(unsafe_code)]

pub mod across;
pub mod shm;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::fabric::ctl::RouteHop;
use crate::fabric::FabricError;
use crate::mem::{MemError, Span, Word32, Word64};
pub use crate::ring::{Record, Reservation, RingError};
use crate::wire::NodeState;

/// A datagram address: a node's slot and a port on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Addr {
    /// Slot of the node.
    pub node: u32,
    /// Port on the node.
    pub port: u32,
}

impl Addr {
    /// `node:port`.
    pub const fn new(node: u32, port: u32) -> Self {
        Self { node, port }
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.node, self.port)
    }
}

/// The sending end of one direction of a message channel to a peer: messages are sent in
/// order, each once; a full channel refuses a reservation (back-pressure, never loss).
pub trait SendChannel: Send {
    /// The memory reservations lie in: fill `[r.pos, r.pos + r.len)` of it (checked copies,
    /// or the zero-copy `Span::bytes_mut` under its contract) between `reserve` and `commit`.
    fn data(&self) -> &Span;
    /// Room for a message of `len` bytes: `Full` when there is none right now, `Corrupt` when
    /// the receiver's side of the channel cannot be trusted any more.
    fn reserve(&mut self, len: usize) -> Result<Reservation, RingError>;
    /// Publishes a reserved message (its `len` may have shrunk, its delivery time been set).
    fn commit(&mut self, r: Reservation);
    /// Whether a message of `len` bytes would fit now (after a fresh look at the receiver).
    fn has_room(&mut self, len: usize) -> Result<bool, RingError>;
    /// The channel position after everything sent so far: it only grows, and the receiver's
    /// acknowledgements ([`RecvChannel::consumed`] on the other side) count against it.
    fn sent(&self) -> u64;
    /// Whether the receiver's side shows anything published: a channel handed out as new
    /// must not (a retired ring handed out again has lost its sequence state).
    fn published_anything(&self) -> bool;
    /// Where the next message and the published position lie, for a cache prefetch: hints,
    /// never dereferenced (null where a transport has none).
    fn next_hint(&self) -> [*const u8; 2] {
        [std::ptr::null(); 2]
    }
    /// Wakes the receiver if it sleeps waiting for messages, after `commit` (or other stores
    /// it should see): its doorbell, where it armed one. A transport whose delivery wakes the
    /// receiver by itself does nothing.
    fn wake_receiver(&self) {}
    /// Wakes the receiver whether it armed or not: it is being told the channel ends.
    fn ring_receiver(&self) {}
    /// True once the channel was torn down under the sender (the receiver closed, or the
    /// channel was handed to another incarnation of it): nothing sent now would be read, so
    /// the sender drops the channel and opens a new one (which says why it cannot).
    fn receiver_gone(&self) -> bool {
        false
    }
    /// Sleeps until a message of `len` bytes may fit, the receiver is gone, or `timeout`
    /// passes (spurious returns are allowed: the caller looks again). A channel without a
    /// way to sleep returns at once.
    fn wait_for_room(&mut self, _len: usize, _timeout: Option<Duration>) {}
}

/// The receiving end of one direction of a message channel from a peer.
pub trait RecvChannel: Send {
    /// The memory peeked records lie in: read `[rec.pos, rec.pos + rec.len)` of it before
    /// `release`.
    fn data(&self) -> &Span;
    /// The next record, if any, after validating everything the sender wrote; `Corrupt` when
    /// it cannot be trusted (retire the channel).
    fn peek(&mut self) -> Result<Option<Record>, RingError>;
    /// Gives a peeked record's room back to the sender.
    fn release(&mut self, rec: Record);
    /// The channel position released so far (what the sender may count as acknowledged).
    fn consumed(&self) -> u64;
    /// Whether nothing waits, with one fresh look at the sender's published position.
    fn is_drained(&self) -> bool;
    /// Whether everything seen published has been released (no fresh look).
    fn drained_cached(&self) -> bool;
    /// Wakes the sender if it sleeps waiting for room, after `release`. A transport whose
    /// credits wake the sender by themselves does nothing.
    fn wake_sender(&self) {}
    /// True once the sender closed its end: after the last record (read everything `peek`
    /// still returns), the channel can be retired.
    fn sender_gone(&self) -> bool {
        false
    }
}

/// A datagram channel a sender opened: the channel, and the links its records cross on the
/// way (distributed topologies, for the link model's delivery stamps; empty when direct).
#[derive(Debug)]
pub struct OpenedDatagram<T> {
    /// The sending end.
    pub ch: T,
    /// The links crossed, in order.
    pub route: Vec<RouteHop>,
    /// A receiver on another host that takes datagrams straight from the sender's process:
    /// its listener (the channel then carries no data, only the route's end).
    pub direct: Option<std::net::SocketAddr>,
}

/// Setting up message channels: how a path gets the channels it then uses only through
/// [`SendChannel`] and [`RecvChannel`]. The channel types are associated types, not boxes,
/// so the paths' hot loops are compiled against the implementation (measured: a boxed
/// channel cost `send-lat` ~35 ns; see `docs/architecture.md`).
pub trait Channels {
    /// The sending end of a channel.
    type Tx: SendChannel;
    /// The receiving end of a channel.
    type Rx: RecvChannel;
    /// Opens the datagram channel from endpoint `src` (bound in this process) to endpoint
    /// `dst`: `Refused` (with the fabric's error class) when nothing is bound there, either
    /// node is not READY, or no route through READY nodes exists.
    fn open_datagram(&self, src: Addr, dst: Addr) -> Result<OpenedDatagram<Self::Tx>, FabricError>;
    /// The receiving end of a channel a sender opened to endpoint `dst` of this process,
    /// announced to it at `at` (a token of the transport's: the endpoint lists them), with
    /// the sender's address; an error when what the sender's side shows fails a check.
    fn accept_datagram(&self, dst: Addr, at: u64) -> Result<(Addr, Self::Rx), FabricError>;
    /// Retires the channel announced at `at` to `dst` (its sender closed, or it is corrupt):
    /// best effort, a live sender opens a new one.
    fn retire_datagram(&self, dst: Addr, at: u64);
}

/// Something a completion channel's watcher compares with what it was when the CQ was armed,
/// and sleeps on: words of the transport's shared memory.
#[derive(Debug, Clone)]
pub enum Watch {
    /// A 64-bit index that moves when work arrives (a ring's producer index, an ack).
    Moved {
        /// The word.
        word: Word64,
        /// Its value at arming.
        seen: u64,
    },
    /// A flag that fires when non-zero (peer gone).
    Flag(Word32),
    /// A futex doorbell that peers bump (UD endpoints); the watcher also sleeps on it.
    Bell {
        /// The word.
        word: Word32,
        /// Its value at arming.
        seen: u32,
    },
}

/// This end of a reliable connection (a queue pair's home): what the peer tells it besides
/// messages — how far it consumed them, NAKs, its posted receives (credits), that it is gone,
/// the RNR timer it asks for — and the remote rights this end grants, for the peer to read.
pub trait QpHome {
    /// How far the peer consumed this end's outbound messages (acquire: a NAK, read next with
    /// [`QpHome::nak`], was published before it).
    fn acked(&self) -> u64;
    /// The peer's negative acknowledgement, `(message seq + 1) << 8 | syndrome` (0: none).
    fn nak(&self) -> u64;
    /// Receives the peer has posted so far (acquire).
    fn credits(&self) -> u64;
    /// True once the peer said it is gone (acquire: its last acks and NAKs are seen).
    fn peer_gone(&self) -> bool;
    /// The RNR timer the peer asks this end to wait (IB encoding + 1; 0: not said).
    fn peer_rnr(&self) -> u32;
    /// Publishes the remote operations this end accepts (release: requesters read them
    /// before each one-sided operation).
    fn set_access(&self, bits: u32);
    /// Back to nothing received and nothing acknowledged (RESET).
    fn reset(&self);
    /// What a completion channel watches for this end: the peer going; for a receive CQ
    /// (`roles.recv`) the producer index moving past `tail_seen(current index)` (arriving
    /// messages); for a send CQ (`roles.send`) the ack moving past `ack_seen(current ack)`
    /// and, with `credits`, the peer's credits.
    fn watches(
        &self,
        out: &mut Vec<Watch>,
        roles: WatchRoles,
        seen: (impl FnOnce(u64) -> u64, impl FnOnce(u64) -> u64),
        credits: bool,
    );
}

/// A one-sided request that returns something ([`RemoteRegion::fetch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchOp {
    /// RDMA READ.
    Read,
    /// FETCH_AND_ADD of the value.
    FetchAdd(u64),
    /// COMPARE_AND_SWAP: (compare, swap).
    CmpSwap(u64, u64),
}

/// How [`RemoteRegion::fetch`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetch {
    /// Requests `first..=last` went out.
    Started {
        /// The id of its first request.
        first: u64,
        /// The id of its last.
        last: u64,
    },
    /// The answers of fetches not yet taken would leave its answer no room: try again once
    /// they are taken.
    Busy,
    /// Not this way: do it at once (shared memory; or a READ larger than the answers' ring
    /// takes in one go, with nothing outstanding).
    Whole,
}

/// Which of a QP's completion queues a channel watches for (both: one CQ for both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchRoles {
    /// Its send CQ: acks, credits.
    pub send: bool,
    /// Its receive CQ: arriving messages.
    pub recv: bool,
}

/// The peer's end of a reliable connection as this end writes it: the counterpart of the
/// peer's [`QpHome`], and its context's doorbell.
pub trait QpLink {
    /// Publishes this end's posted-receive count (release: the peer may send once it sees it).
    fn publish_credits(&self, posted: u64);
    /// Publishes a NAK (published by the consumer index released after it).
    fn publish_nak(&self, v: u64);
    /// Tells the peer the RNR timer to wait (IB encoding + 1).
    fn publish_rnr(&self, v: u32);
    /// Tells the peer this end is gone (release: acks and NAKs before it are seen first).
    fn publish_gone(&self);
    /// The remote operations the peer accepts (a relaxed read of a word that only gates).
    fn peer_access(&self) -> u32;
    /// Wakes the peer's completion channel if it sleeps (after this end's stores).
    fn wake_peer(&self);
    /// Wakes the peer's completion channel whether or not it sleeps.
    fn ring_peer(&self);
}

/// A queue pair connected through a transport: the peer, the two message channels, and the
/// control words.
#[derive(Debug)]
pub struct QpConnection<Tx, Rx, L> {
    /// The peer's node.
    pub slot: u32,
    /// The peer's QP number.
    pub qpn: u32,
    /// The generation the peer's node was in when the connection was made.
    pub generation: u32,
    /// The peer's end, written from here.
    pub link: L,
    /// Messages to the peer.
    pub outbound: Tx,
    /// Messages from the peer.
    pub inbound: Rx,
}

/// The connection type of a [`QpChannels`] implementation.
pub type ConnectionOf<C> =
    QpConnection<<C as QpChannels>::QpTx, <C as QpChannels>::QpRx, <C as QpChannels>::Link>;

/// Setting up a queue pair's reliable connection (RC and UC): its home, made when the QP is
/// created, and the connection to a peer's QP (INIT → RTR). As with [`Channels`], the types
/// are associated, not boxed: the verbs fast paths are compiled against them.
pub trait QpChannels {
    /// This end of a connection.
    type Home: QpHome;
    /// The peer's end, as written from here.
    type Link: QpLink;
    /// Messages to the peer.
    type QpTx: SendChannel;
    /// Messages from the peer.
    type QpRx: RecvChannel;
    /// Makes the home of a new RC/UC QP of node `slot` (type `qp_type`, inbound ring of
    /// `ring_len` bytes, its context's event block at `event_off`): its QP number and home.
    fn create_qp_home(
        &self,
        slot: u32,
        pd: u32,
        qp_type: u32,
        ring_len: u32,
        event_off: u64,
    ) -> Result<(u32, Self::Home), FabricError>;
    /// Connects QP `qpn` of node `slot` (home `home`) to QP `dest_qpn` of node `dest_slot`,
    /// of the same type: refused unless the peer exists and matches.
    fn connect_qp(
        &self,
        home: &Self::Home,
        slot: u32,
        qpn: u32,
        qp_type: u32,
        dest_slot: u32,
        dest_qpn: u32,
    ) -> Result<ConnectionOf<Self>, FabricError>;
    /// Gives QP `qpn` of node `slot` back (destroyed).
    fn destroy_qp_home(&self, slot: u32, qpn: u32);
}

/// How a copy into a peer's memory is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// Any order.
    Plain,
    /// The last 8 bytes after all the others (RDMA WRITE's guarantee on real HCAs).
    Ordered,
    /// With stores that bypass the cache (bulk DMA jobs larger than the last-level cache).
    Streaming,
}

/// Who asks for a grant, and through what: the owner's checks depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantRequest {
    /// Region `rkey` of the peer of QP `qpn` (on node `slot`, the asker's): granted only
    /// through a connected QP whose peer owns the region (verbs one-sided operations).
    ThroughQp {
        /// The asker's node.
        slot: u32,
        /// The asker's QP, connected to the region's owner.
        qpn: u32,
        /// The region.
        rkey: u32,
    },
    /// Region `rkey` on node `node`, for raw DMA from node `slot`.
    ForDma {
        /// The asker's node.
        slot: u32,
        /// The node that owns the region.
        node: u32,
        /// The region.
        rkey: u32,
    },
}

/// A peer's memory region as granted to this process: the only way a path reads, writes or
/// updates memory of another node. Offsets are relative to the region's first data byte.
pub trait RemoteRegion: Send + Sync + fmt::Debug {
    /// Data bytes granted.
    fn len(&self) -> u64;
    /// True for a region of no bytes (never granted in practice).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The access flags the owner registered the region with (`ibv_access_flags` bits).
    fn access_bits(&self) -> u32;
    /// The owner's address of the region's first byte: peers name remote bytes by it
    /// (`remote_addr`), so `remote_addr - iova` is the offset the methods below take. 0 for a
    /// zero-based region.
    fn iova(&self) -> u64 {
        0
    }
    /// True if this process may write the region (the grant was writable).
    fn writable(&self) -> bool;
    /// False once the owner deregistered the region (or its node went DOWN): the next access
    /// must not be made.
    fn valid(&self) -> bool;
    /// True once the way to the region is gone — a transport that reaches it through another
    /// host lost that host or its link — as opposed to the owner refusing an access (a
    /// deregistered region). `valid` is false then too.
    fn cut(&self) -> bool {
        false
    }
    /// True when the region's owner checks every access against its QP's access flags as it
    /// carries it out (a region on another host: that host's side does), so the requester's
    /// copy of those flags — which may lag behind the owner's `ibv_modify_qp` — gates nothing.
    fn owner_checks_qp_access(&self) -> bool {
        false
    }
    /// A key naming the region's memory (two grants of one region have the same), for
    /// overlap checks between regions.
    fn ident(&self) -> (u64, u64);
    /// Copies `n` bytes at `src_off` of a local span to `off` of the region.
    fn put(
        &self,
        off: u64,
        src: &Span,
        src_off: u64,
        n: usize,
        how: CopyKind,
    ) -> Result<(), MemError>;
    /// Copies `src` (process memory: inline data, an atomic's operand) to `off`.
    fn put_bytes(&self, off: u64, src: &[u8], how: CopyKind) -> Result<(), MemError>;
    /// For a transport that carries puts out later (a region on another host): the ticket
    /// of the puts made so far, for [`RemoteRegion::settled`]. `None`: a put is done when it
    /// returns.
    fn ticket(&self) -> Option<u64> {
        None
    }
    /// Whether the puts up to `ticket` landed: `Some(true)` done, `Some(false)` refused by
    /// the owner (or no answer will come), `None` not yet.
    fn settled(&self, _ticket: u64) -> Option<bool> {
        Some(true)
    }
    /// What a completion channel watches while a put up to `ticket` has not settled (the
    /// word that moves when it does); nothing for a transport whose puts are done at once.
    fn watch(&self, _ticket: u64, _out: &mut Vec<Watch>) {}
    /// Starts a READ of `n` bytes at `off` or an atomic at `off` without waiting for its
    /// answer (a region on another host: the request goes now, the answer comes through
    /// [`RemoteRegion::fetched`]), so that a QP can have several outstanding, as a NIC does.
    /// [`Fetch::Whole`] (the default): do it at once with [`RemoteRegion::get`] or the atomic
    /// calls.
    fn fetch(&self, _op: FetchOp, _off: u64, _n: usize) -> Result<Fetch, MemError> {
        Ok(Fetch::Whole)
    }
    /// The answer to request `id` of a [`Fetch::Started`] (taken in the order they went out),
    /// if it came: the atomic's old value (0 for a READ), the data handed to `take(span, pos,
    /// len)` first. `None`: not yet (also while the way to the region is cut: the QP's peer
    /// is gone, and its work fails as the rest of it). `Err`: the owner refused it.
    fn fetched(
        &self,
        _id: u64,
        _take: &mut dyn FnMut(&Span, u64, usize),
    ) -> Option<Result<u64, MemError>> {
        Some(Err(MemError::OutOfBounds {
            off: 0,
            len: 0,
            size: 0,
        }))
    }
    /// Requests `first..=last` of a fetch nobody waits for any more (its work request was
    /// flushed): their answers are dropped as they come.
    fn abandon(&self, _first: u64, _last: u64) {}
    /// What a completion channel watches while a fetch's answer has not been taken.
    fn watch_answers(&self, _out: &mut Vec<Watch>) {}
    /// Copies `n` bytes at `off` of the region to `dst_off` of a local span.
    fn get(
        &self,
        off: u64,
        dst: &Span,
        dst_off: u64,
        n: usize,
        how: CopyKind,
    ) -> Result<(), MemError>;
    /// Atomically adds `add` to the 8-aligned u64 at `off`; returns the old value.
    fn fetch_add(&self, off: u64, add: u64) -> Result<u64, MemError>;
    /// Atomically replaces the 8-aligned u64 at `off` with `swap` if it equals `compare`;
    /// returns the old value either way.
    fn compare_swap(&self, off: u64, compare: u64, swap: u64) -> Result<u64, MemError>;
    /// Where the transport maps peers' memory into this process (shared memory): the region's
    /// bytes as a span and the word that holds [`crate::wire::verbs::MR_STATE_VALID`] while
    /// the region is registered. A path may use them directly — a copy between two peers'
    /// regions, or a latency-critical operation that must not pay an indirect call per check
    /// — and must then check the word before each access as `valid` does. `None` elsewhere.
    fn local(&self) -> Option<(&Span, &Word32)> {
        None
    }
}

/// What a transport knows of a node: its state and the generation it is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerState {
    /// EMPTY, BOOTING, READY or DOWN.
    pub state: NodeState,
    /// Bumped each time the node (re)joins.
    pub generation: u32,
}

impl PeerState {
    /// True while the node is READY in generation `generation`.
    pub fn is_live(&self, generation: u32) -> bool {
        self.state == NodeState::Ready && self.generation == generation
    }
}

/// How the paths reach other nodes: grants of their memory, and whether they live.
pub trait Transport: Send + Sync + fmt::Debug {
    /// Asks the region's owner (through whatever control channel the transport has) for
    /// access and makes it reachable; `None` when it is refused or what comes back fails a
    /// check (the caller reports REM_ACCESS_ERR or NoGrant).
    fn map_region(&self, req: GrantRequest) -> Option<Arc<dyn RemoteRegion>>;
    /// The state of node `slot`, or `None` if there is no such node.
    fn peer(&self, slot: u32) -> Option<PeerState>;
}
