//! The transport: how a path reaches another node. Every one-sided access to a peer's memory
//! (verbs RDMA WRITE / READ / atomics, DMA segments on another node), the granting that
//! precedes it, and the liveness of the peer behind it go through the [`Transport`] and
//! [`RemoteRegion`] traits; the paths above (`verbs`, `dma`) never map a peer's memory
//! themselves and never ask the fabric's node table directly whether a peer lives.
//!
//! Today there is one implementation, [`shm::ShmTransport`]: every node of the fabric is a
//! process on this host, a grant is a memfd passed over the supervisor's socket and mapped, and
//! an access is a checked copy or atomic on that mapping ([`crate::mem::Span`]). A network
//! engine (UCX between hosts, issue 19) implements the same two traits: `map_region` exchanges
//! a packed rkey through the supervisors instead of a memfd, `put`/`get` become
//! `ucp_put_nbx`/`ucp_get_nbx` (completed before they return, or flushed by the caller's
//! completion), the atomics `ucp_atomic_op_nbx`, and `peer` reports a host that went away as
//! its nodes DOWN. Nothing in the paths changes.
//!
//! What stays below the paths, not yet behind the trait (see `docs/architecture.md`): the
//! message rings (datagram rings and the QP ring of SEND/RECV) are shared-memory rings built
//! by [`crate::dgram`] and the verbs engine on windows, with their doorbells; a network
//! transport carries them as active messages, which needs a `Channel` trait of its own
//! (reserve/commit/peek/release with credits) — the next step of this module.
//!
//! Promises of every implementation: an access outside the granted bytes is an error, never an
//! access; a region whose owner deregistered it, or whose node went DOWN, answers
//! `valid() == false` before the next access; `put` with [`CopyKind::Ordered`] makes the last
//! 8 bytes visible after all the others (a peer polling the last byte sees the whole payload).

#![forbid(unsafe_code)]

pub mod shm;

use std::fmt;
use std::sync::Arc;

use crate::mem::{MemError, Span, Word32};
use crate::wire::NodeState;

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
    /// True if this process may write the region (the grant was writable).
    fn writable(&self) -> bool;
    /// False once the owner deregistered the region (or its node went DOWN): the next access
    /// must not be made.
    fn valid(&self) -> bool;
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
