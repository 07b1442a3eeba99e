//! Services the supervisor hosts for paths above the control plane. The supervisor knows
//! nodes, windows and clients; what a path keeps about them — the verbs registry of regions,
//! grants and QP blocks (`crate::verbs::registry`) — is a [`Service`] handed to
//! [`super::run`] by whoever starts the supervisor (the `backplane` binary), so `fabric` does
//! not depend on the paths.

#![forbid(unsafe_code)]

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Instant;

use super::super::alloc::WindowAlloc;
use super::super::ctl::ErrorKind;
use super::super::life::NodeLife;
use crate::mem::Region;
use crate::wire::NodeState;

/// A refusal: the kind and a one-line message for the client.
pub type Failure = (ErrorKind, String);

/// What a service may use of the supervisor.
pub trait Host {
    /// Ok if `slot` names a node that is READY; otherwise the refusal to answer with.
    fn ready_slot(&self, slot: u32) -> Result<(), Failure>;
    /// `len` bytes of node `slot`'s window, `align`-aligned; None when the window is full.
    fn alloc(&mut self, slot: u32, len: u64, align: u64) -> Option<u64>;
    /// Gives back a range `alloc` handed out.
    fn free(&mut self, slot: u32, off: u64, len: u64);
    /// The refusal for an `alloc` that found node `slot`'s window full.
    fn full(&self, slot: u32) -> Failure {
        (ErrorKind::NoSpace, crate::fabric::alloc::window_full(slot))
    }
    /// Node `slot`'s window (`slot` must exist: checked by `ready_slot` or recorded earlier).
    fn window(&self, slot: u32) -> &Arc<Region>;
    /// Node `slot`'s generation.
    fn generation(&self, slot: u32) -> u32;
    /// Ok if `slot` names a node that is READY, on this host or another (a fabric across
    /// hosts mirrors the other hosts' nodes).
    fn ready_anywhere(&self, slot: u32) -> Result<(), Failure> {
        self.ready_slot(slot)
    }
}

/// A queue pair's block as the datagram bridge mirrors it between hosts: where it lies in its
/// node's window (a real one, or the shadow window of a node on another host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpSide {
    /// The QP's node.
    pub slot: u32,
    /// Its number.
    pub qpn: u32,
    /// 2 RC, 3 UC.
    pub qp_type: u32,
    /// Its inbound ring's size.
    pub ring_len: u32,
    /// The block's offset in the node's window.
    pub block_off: u64,
    /// The event block its peers ring (in the same window).
    pub event_off: u64,
    /// A shadow's one-sided area (`wire::verbs::RDMA_*`; 0 for a QP of this host).
    pub rdma_off: u64,
    /// A QP of this host: the datagram port its process carries pairs with other hosts
    /// through itself (`verbs::direct`), if it does. A shadow: the remote process's port when
    /// the pair is direct.
    pub direct: Option<u32>,
}

/// A request for a region through a QP whose peer is on another host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantAsk {
    /// The asking QP (node, QPN).
    pub qp: (u32, u32),
    /// Its peer (a shadow here).
    pub peer: (u32, u32),
    /// The region.
    pub rkey: u32,
}

/// A region granted to a QP of another host: the memfd and what it allows.
#[derive(Debug)]
pub struct RemoteGrant {
    /// Data bytes.
    pub len: u64,
    /// `IBV_ACCESS_*` flags.
    pub access: u32,
    /// Whether the fd may be mapped writable.
    pub writable: bool,
    /// The region's memfd (and its data's file, if another object backs it).
    pub fds: crate::transport::shm::RegionFds,
}

/// A registry hosted by the supervisor: it serves the verbs part of the control protocol and
/// hears when a client or a node goes away.
pub trait Service: Send {
    /// Serves one request of client `client` (with the descriptors that came with it): the
    /// response and the descriptors to pass back, or a refusal. Requests and responses
    /// are the service's own messages as JSON (the registry's are `wire::registry`); the
    /// supervisor only carries them.
    fn handle(
        &mut self,
        host: &mut dyn Host,
        client: u64,
        req: serde_json::Value,
        fds: Vec<OwnedFd>,
    ) -> Result<(serde_json::Value, Vec<OwnedFd>), Failure>;
    /// Client `client` went away (its process died or closed its socket).
    fn client_gone(&mut self, host: &mut dyn Host, client: u64);
    /// Node `slot` went DOWN.
    fn node_down(&mut self, host: &mut dyn Host, slot: u32);
    /// If request `req` of client `client` connects one of its queue pairs to another node's,
    /// that QP (of this host) and the peer (node, QPN): the supervisor asks the peer's host
    /// first when the peer is not here.
    fn qp_connect_of(
        &self,
        _client: u64,
        _req: &serde_json::Value,
    ) -> Option<(QpSide, (u32, u32))> {
        None
    }
    /// A queue pair of this host (RC or UC), for a host whose QP connects to it.
    fn local_qp(&self, _slot: u32, _qpn: u32) -> Option<QpSide> {
        None
    }
    /// The shadow of queue pair `qpn` of node `slot` (on another host, of type `qp_type`,
    /// inbound ring `ring_len`), made in that node's shadow window unless it exists: QPs here
    /// connect to it as to a local one, and the bridge mirrors it.
    /// `peer` is the QP of this host it pairs with (whose regions it may be granted);
    /// `direct` the remote process's port when the pair is direct (`QpSide::direct`).
    #[allow(clippy::too_many_arguments)]
    fn shadow_qp(
        &mut self,
        _host: &mut dyn Host,
        _slot: u32,
        _qpn: u32,
        _qp_type: u32,
        _ring_len: u32,
        _peer: (u32, u32),
        _direct: Option<u32>,
    ) -> Result<QpSide, Failure> {
        Err((
            ErrorKind::Invalid,
            "this supervisor hosts no verbs registry".into(),
        ))
    }
    /// The remote queue pair `qpn` of node `slot` is gone: its shadow goes, and the QPs here
    /// connected to it see their peer gone.
    fn drop_shadow_qp(&mut self, _host: &mut dyn Host, _slot: u32, _qpn: u32) {}
    /// If request `req` of client `client` asks for a region through one of its QPs whose
    /// peer is a shadow: that QP, the peer and the rkey (the peer's host grants it).
    fn grant_across_of(&self, _client: u64, _req: &serde_json::Value) -> Option<GrantAsk> {
        None
    }
    /// Region `rkey` for the shadow `shadow` (a QP of another host): granted only if it is a
    /// region of the protection domain of the QP here the shadow pairs with.
    fn grant_to_shadow(&mut self, _shadow: (u32, u32), _rkey: u32) -> Result<RemoteGrant, Failure> {
        Err((
            ErrorKind::Invalid,
            "this supervisor hosts no verbs registry".into(),
        ))
    }
    /// The reply to QP `qp`'s request for a region its peer's host granted (`len`, `access`,
    /// `writable`, `iova`): where the one-sided area lies.
    fn across_reply(
        &self,
        _qp: (u32, u32),
        _grant: (u64, u32, bool, u64),
    ) -> Result<serde_json::Value, Failure> {
        Err((
            ErrorKind::Invalid,
            "this supervisor hosts no verbs registry".into(),
        ))
    }
    /// If request `req` of client `client` asks for a DMA grant of a region of another node:
    /// (its node with a context of the client, the region's node, the rkey). The supervisor
    /// asks the region's host when that node is not here.
    fn dma_grant_of(&self, _client: u64, _req: &serde_json::Value) -> Option<(u32, u32, u32)> {
        None
    }
    /// Region `rkey` of node `node` (of this host) for the DMA engines of a process on another
    /// host: granted as a DMA grant here is (the region allows remote access).
    fn grant_for_dma(&mut self, _node: u32, _rkey: u32) -> Result<RemoteGrant, Failure> {
        Err((
            ErrorKind::Invalid,
            "this supervisor hosts no verbs registry".into(),
        ))
    }
    /// The reply to a DMA grant its region's host granted (`len`, `access`, `writable`,
    /// `iova`), reached through the one-sided area of `pair` (the DMA pair's shadow here).
    fn dma_reply(
        &self,
        _pair: &QpSide,
        _grant: (u64, u32, bool, u64),
    ) -> Result<serde_json::Value, Failure> {
        Err((
            ErrorKind::Invalid,
            "this supervisor hosts no verbs registry".into(),
        ))
    }
    /// The queue pairs destroyed since the last call (node, QPN): shadows and this host's.
    fn take_destroyed(&mut self) -> Vec<(u32, u32)> {
        Vec::new()
    }
}

/// The service of a supervisor started without one: every verbs request is refused.
pub struct NoService;

impl Service for NoService {
    fn handle(
        &mut self,
        _: &mut dyn Host,
        _: u64,
        _: serde_json::Value,
        _: Vec<OwnedFd>,
    ) -> Result<(serde_json::Value, Vec<OwnedFd>), Failure> {
        Err((
            ErrorKind::Invalid,
            "this supervisor hosts no service (no verbs registry)".into(),
        ))
    }
    fn client_gone(&mut self, _: &mut dyn Host, _: u64) {}
    fn node_down(&mut self, _: &mut dyn Host, _: u32) {}
}

/// Ok if `slot` is one of `nodes` and READY.
pub(super) fn ready_slot(nodes: u32, life: &[NodeLife], slot: u32) -> Result<(), Failure> {
    if slot == 0 || slot > nodes {
        return Err((
            ErrorKind::NotFound,
            format!("node {slot} does not exist (nodes 1..={nodes})"),
        ));
    }
    let st = life[slot as usize - 1].state();
    if st != NodeState::Ready {
        return Err((
            ErrorKind::NodeDown,
            format!("node {slot} is {st}, not READY"),
        ));
    }
    Ok(())
}

/// The supervisor's parts a service uses, borrowed while it runs.
pub(super) struct HostView<'a> {
    /// A fabric across hosts: nodes on other hosts are refused.
    pub(super) plan: Option<&'a crate::fabric::hosts::HostPlan>,
    pub(super) nodes: u32,
    pub(super) life: &'a [NodeLife],
    pub(super) allocs: &'a mut [WindowAlloc],
    pub(super) windows: &'a [Arc<Region>],
}

impl Host for HostView<'_> {
    fn ready_slot(&self, slot: u32) -> Result<(), Failure> {
        if let Some(p) = self.plan {
            if slot >= 1 && slot <= self.nodes && !p.is_local(slot) {
                return Err(super::hosts::remote_refusal(p, slot));
            }
        }
        ready_slot(self.nodes, self.life, slot)
    }
    fn alloc(&mut self, slot: u32, len: u64, align: u64) -> Option<u64> {
        self.allocs
            .get_mut(slot.checked_sub(1)? as usize)?
            .alloc(len, align, Instant::now())
    }
    fn free(&mut self, slot: u32, off: u64, len: u64) {
        if let Some(a) = slot
            .checked_sub(1)
            .and_then(|i| self.allocs.get_mut(i as usize))
        {
            a.free(off, len, Instant::now());
        }
    }
    fn full(&self, slot: u32) -> Failure {
        let msg = match slot
            .checked_sub(1)
            .and_then(|i| self.allocs.get(i as usize))
        {
            Some(a) => a.full_message(slot, Instant::now()),
            None => crate::fabric::alloc::window_full(slot),
        };
        (ErrorKind::NoSpace, msg)
    }
    fn window(&self, slot: u32) -> &Arc<Region> {
        &self.windows[slot as usize - 1]
    }
    fn generation(&self, slot: u32) -> u32 {
        self.life[slot as usize - 1].generation()
    }
    fn ready_anywhere(&self, slot: u32) -> Result<(), Failure> {
        ready_slot(self.nodes, self.life, slot)
    }
}
