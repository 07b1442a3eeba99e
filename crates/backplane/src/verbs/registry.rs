//! The supervisor's side of the RDMA verbs path: the registries peers must go through. The
//! supervisor hosts it as a [`Service`] (the `backplane` binary hands it over at start-up);
//! it reaches nodes, windows and window space only through the supervisor's [`Host`].
//!
//! - **Memory regions**: the owner sends the region's memfd with `RegMr`; the supervisor checks
//!   it (a sealed memfd at least as long as announced), seals it against new writable mappings
//!   when the region allows no remote writes, and hands out one key. A peer gets the fd only
//!   through `MrGrant`, only for a region of the protection domain of the QP its own QP is
//!   connected to, and read-only (a fresh `O_RDONLY` open of the memfd, which the seal keeps
//!   read-only even if reopened) unless the region allows remote writes or atomics.
//!   The DMA engines of a process get a region with `DmaGrant` instead: by node and rkey, for a
//!   process with a device context on a READY node (see `grant_dma`).
//! - **QP blocks**: RC/UC queue pairs live in their owner's window; the supervisor allocates
//!   them, numbers them, records who is connected to whom, and when a QP's process or node goes
//!   away it raises the peer-gone flag in the connected QP's block and rings its bell.
//! - **Context event blocks**: one doorbell per device context.
//!
//! When a region's owner goes away (its process, or its node goes DOWN) the supervisor sets the
//! region's state word to DEREGISTERED through a header mapping it made before sealing, so
//! peers that mapped it stop, as after the owner's own deregistration.
//!
//! Everything a client asks for is checked against what that client owns.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::os::fd::{AsRawFd, OwnedFd};

use crate::fabric::ctl::ErrorKind;
use crate::fabric::supervisor::{publish, Failure, GrantAsk, Host, QpSide, RemoteGrant, Service};
use crate::mem::Region;
use crate::sync::{self, Ordering};
use crate::transport::shm::RegionFds;
use crate::wire::registry::{VerbsRequest, VerbsResponse};
use crate::wire::verbs::*;
use serde::Deserialize;

/// `IBV_ACCESS_REMOTE_WRITE`.
const REMOTE_WRITE: u32 = 1 << 1;
/// `IBV_ACCESS_REMOTE_READ`.
const REMOTE_READ: u32 = 1 << 2;
/// `IBV_ACCESS_REMOTE_ATOMIC`.
const REMOTE_ATOMIC: u32 = 1 << 3;
/// First RC/UC QP number (UD QPs are datagram ports, below this).
const QPN_BASE: u32 = 0x10_0000;
/// Largest registrable region.
const MAX_MR: u64 = 1 << 40;
/// The owner of a shadow QP (a QP of another host, mirrored here): no client.
const SHADOW: u64 = u64::MAX;

struct MrEntry {
    client: u64,
    slot: u32,
    pd: u32,
    len: u64,
    access: u32,
    /// The region's memfd (its header page first).
    fd: OwnedFd,
    /// The data's file and where the data starts in it, for a region over memory another
    /// object backs (`RegMr`'s `data_off`); else the data follows the header in `fd`.
    data: Option<(OwnedFd, u64)>,
    /// The region's header page, mapped writable before the region was sealed read-only: how
    /// the supervisor tells mappers the region is gone when its owner or node dies.
    header: Option<Region>,
}

impl MrEntry {
    /// Marks the region deregistered for every process that mapped it (QPs, DMA engines), as
    /// the owner's own deregistration does.
    fn mark_gone(&self) {
        if let Some(w) = self
            .header
            .as_ref()
            .and_then(|h| h.u32_at(MR_STATE_OFF as u64).ok())
        {
            // SYNC POINT mr-state (release): mappers stop using the region when they see it.
            w.store(MR_STATE_DEREGISTERED, Ordering::Release);
        }
    }
}

struct QpEntry {
    client: u64,
    pd: u32,
    qp_type: u32,
    block_off: u64,
    block_len: u64,
    event_off: u64,
    peer: Option<(u32, u32)>,
    /// A shadow's own event block (in the same shadow window), freed with it.
    shadow_ev: Option<u64>,
    ring_len: u32,
    /// A shadow's one-sided area (inside its block; 0 for a QP of this host).
    rdma_off: u64,
    /// `QpSide::direct`.
    direct: Option<u32>,
}

struct CtxEntry {
    client: u64,
    slot: u32,
    event_off: u64,
}

/// Verbs objects the supervisor knows about.
#[derive(Default)]
pub struct Registry {
    mrs: HashMap<u32, MrEntry>,
    qps: HashMap<(u32, u32), QpEntry>,
    ctxs: Vec<CtxEntry>,
    next_qpn: u32,
    keys: RandomState,
    key_counter: u64,
    /// QPs destroyed since the supervisor last asked (`take_destroyed`).
    destroyed: Vec<(u32, u32)>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self {
            mrs: HashMap::new(),
            qps: HashMap::new(),
            ctxs: Vec::new(),
            next_qpn: QPN_BASE,
            keys: RandomState::new(),
            key_counter: 0,
            destroyed: Vec::new(),
        }
    }

    /// A fresh key: unpredictable, non-zero, unused.
    fn new_key(&mut self) -> u32 {
        loop {
            self.key_counter += 1;
            let mut h = self.keys.build_hasher();
            h.write_u64(self.key_counter);
            let k = h.finish() as u32;
            if k != 0 && !self.mrs.contains_key(&k) {
                return k;
            }
        }
    }

    fn new_qpn(&mut self, slot: u32) -> u32 {
        loop {
            let q = self.next_qpn;
            self.next_qpn = if q >= 0xFF_FFFF { QPN_BASE } else { q + 1 };
            if !self.qps.contains_key(&(slot, q)) {
                return q;
            }
        }
    }
}

fn invalid(m: impl Into<String>) -> Failure {
    (ErrorKind::Invalid, m.into())
}

/// A QP block can be made for this transport and ring size.
/// A grant for another host's bridge (the region's memfd and what it allows).
fn remote_grant(granted: (VerbsResponse, Vec<OwnedFd>)) -> Result<RemoteGrant, Failure> {
    match granted {
        (
            VerbsResponse::MrGranted {
                len,
                access,
                writable,
                data_off,
            },
            fds,
        ) => Ok(RemoteGrant {
            len,
            access,
            writable,
            fds: RegionFds::from_message(fds, data_off).ok_or_else(|| invalid("no region"))?,
        }),
        _ => Err(invalid("no region")),
    }
}

fn check_qp_shape(qp_type: u32, ring_len: u32) -> Result<(), Failure> {
    if qp_type != 2 && qp_type != 3 {
        return Err(invalid(format!("QP type {qp_type} has no QP block")));
    }
    if !ring_len.is_power_of_two() || !(QP_MIN_RING..=QP_MAX_RING).contains(&ring_len) {
        return Err(invalid(format!("ring of {ring_len} bytes is out of range")));
    }
    Ok(())
}

/// Writes a QP block's header at `off` of `w` (its control words zeroed first) and publishes
/// it: peers that find the block see it whole.
fn emit_qp_block(w: &Region, off: u64, repr: QpBlockRepr) {
    w.zero(off, QP_RING_OFF).expect("allocated");
    let mut h = [0u8; 64];
    repr.emit(&mut QpBlockHeader::new_unchecked(&mut h[..]));
    publish(w, off, &h, QP_INIT_OFF);
}

impl Registry {
    fn serve_verbs(
        &mut self,
        host: &mut dyn Host,
        id: u64,
        req: VerbsRequest,
        fds: Vec<OwnedFd>,
    ) -> Result<(VerbsResponse, Vec<OwnedFd>), Failure> {
        match req {
            VerbsRequest::OpenContext { slot } => {
                host.ready_slot(slot)?;
                let off = host
                    .alloc(slot, EV_LEN, 64)
                    .ok_or_else(|| host.full(slot))?;
                host.window(slot).zero(off, EV_LEN).expect("allocated");
                self.ctxs.push(CtxEntry {
                    client: id,
                    slot,
                    event_off: off,
                });
                Ok((VerbsResponse::ContextOpened { event_off: off }, Vec::new()))
            }
            VerbsRequest::CloseContext { slot, event_off } => {
                if let Some(i) = self
                    .ctxs
                    .iter()
                    .position(|c| c.client == id && c.slot == slot && c.event_off == event_off)
                {
                    let c = self.ctxs.swap_remove(i);
                    host.free(c.slot, c.event_off, EV_LEN);
                }
                Ok((VerbsResponse::ContextOpened { event_off }, Vec::new()))
            }
            VerbsRequest::RegMr {
                slot,
                pd,
                len,
                access,
                data_off,
            } => {
                host.ready_slot(slot)?;
                let RegionFds { header: fd, data } = RegionFds::from_message(fds, data_off)
                    .ok_or_else(|| invalid("reg_mr carries one memfd, or two with data_off"))?;
                let header = match &data {
                    None => check_region_fd(&fd, len, access)?,
                    Some((data, off)) => {
                        check_data_fd(data, *off, len)?;
                        check_header_fd(&fd)?
                    }
                };
                let key = self.new_key();
                self.mrs.insert(
                    key,
                    MrEntry {
                        client: id,
                        slot,
                        pd,
                        len,
                        access,
                        fd,
                        data,
                        header,
                    },
                );
                Ok((VerbsResponse::MrRegistered { key }, Vec::new()))
            }
            VerbsRequest::DeregMr { key } => {
                if self.mrs.get(&key).is_some_and(|m| m.client == id) {
                    self.mrs.remove(&key);
                }
                Ok((VerbsResponse::MrRegistered { key }, Vec::new()))
            }
            VerbsRequest::MrGrant { slot, qpn, rkey } => self.grant_mr(id, slot, qpn, rkey),
            VerbsRequest::DmaGrant { slot, node, rkey } => {
                self.grant_dma(host, id, slot, node, rkey)
            }
            VerbsRequest::CreateQp {
                slot,
                pd,
                qp_type,
                ring_len,
                event_off,
                direct,
            } => {
                let shape = (qp_type, ring_len, event_off, direct);
                self.create_qp(host, id, slot, pd, shape)
            }
            VerbsRequest::DestroyQp { slot, qpn } => {
                if self.qps.get(&(slot, qpn)).is_some_and(|q| q.client == id) {
                    self.destroy_qp(host, (slot, qpn));
                }
                Ok((VerbsResponse::QpCreated { qpn, block_off: 0 }, Vec::new()))
            }
            VerbsRequest::ConnectQp {
                slot,
                qpn,
                dest_slot,
                dest_qpn,
            } => {
                host.ready_slot(slot)?;
                if dest_qpn & DMA_PAIR_QPN != 0 {
                    return Err((
                        ErrorKind::NotFound,
                        format!("node {dest_slot} has no QP {dest_qpn:#x}"),
                    ));
                }
                // A shadow stands for a QP of another host (mirrored by the bridge).
                if self
                    .qps
                    .get(&(dest_slot, dest_qpn))
                    .is_some_and(|q| q.client == SHADOW)
                {
                    host.ready_anywhere(dest_slot)?;
                } else {
                    host.ready_slot(dest_slot)?;
                }
                let own_type = match self.qps.get(&(slot, qpn)) {
                    Some(q) if q.client == id => q.qp_type,
                    _ => {
                        return Err(invalid(format!(
                            "this process has no QP {qpn:#x} on node {slot}"
                        )))
                    }
                };
                let dest = self.qps.get(&(dest_slot, dest_qpn)).ok_or_else(|| {
                    (
                        ErrorKind::NotFound,
                        format!("node {dest_slot} has no QP {dest_qpn:#x}"),
                    )
                })?;
                if dest.qp_type != own_type {
                    return Err(invalid(format!(
                        "QP {dest_qpn:#x} on node {dest_slot} is of another transport"
                    )));
                }
                let (block_off, direct) = (dest.block_off, dest.direct);
                // (A shadow names a port only for a pair both hosts agreed is direct.)
                let direct = direct.filter(|_| dest.client == SHADOW);
                if let Some(q) = self.qps.get_mut(&(slot, qpn)) {
                    q.peer = Some((dest_slot, dest_qpn));
                }
                Ok((
                    VerbsResponse::QpConnected {
                        block_off,
                        generation: host.generation(dest_slot),
                        direct,
                    },
                    Vec::new(),
                ))
            }
        }
    }

    fn grant_mr(
        &mut self,
        id: u64,
        slot: u32,
        qpn: u32,
        rkey: u32,
    ) -> Result<(VerbsResponse, Vec<OwnedFd>), Failure> {
        let peer = match self.qps.get(&(slot, qpn)) {
            Some(q) if q.client == id => q.peer.ok_or_else(|| {
                invalid(format!(
                    "QP {qpn:#x} is not connected; move it to RTR first"
                ))
            })?,
            _ => {
                return Err(invalid(format!(
                    "this process has no QP {qpn:#x} on node {slot}"
                )))
            }
        };
        let owner = self.qps.get(&peer).map(|pq| (pq.client, pq.pd));
        self.grant_region(rkey, "of the peer's protection domain", |mr| {
            owner
                .is_some_and(|(client, pd)| mr.client == client && mr.pd == pd && mr.slot == peer.0)
        })
    }

    /// A grant for the DMA engines of client `id`: it must have a device context on the READY
    /// node `slot`; region `rkey` must be registered on the READY node `node`. No protection
    /// domain takes part (a DMA engine is the fabric's, not a QP's): the unpredictable rkey is
    /// the capability, and the region's access flags decide read-only or writable, as for QPs.
    fn grant_dma(
        &mut self,
        host: &mut dyn Host,
        id: u64,
        slot: u32,
        node: u32,
        rkey: u32,
    ) -> Result<(VerbsResponse, Vec<OwnedFd>), Failure> {
        host.ready_slot(slot)?;
        if !self.ctxs.iter().any(|c| c.client == id && c.slot == slot) {
            return Err(invalid(format!(
                "this process has no device context on node {slot}"
            )));
        }
        host.ready_slot(node)?;
        self.grant_region(rkey, &format!("on node {node}"), |mr| mr.slot == node)
    }

    /// The memfd of region `rkey` if `owner_ok` accepts it and it allows remote access:
    /// duplicated when it allows remote writes or atomics, else reopened read-only (the seal
    /// keeps it so).
    fn grant_region(
        &self,
        rkey: u32,
        where_: &str,
        owner_ok: impl Fn(&MrEntry) -> bool,
    ) -> Result<(VerbsResponse, Vec<OwnedFd>), Failure> {
        let not_found = || {
            (
                ErrorKind::NotFound,
                format!("rkey {rkey:#x} names no region {where_}"),
            )
        };
        let mr = self.mrs.get(&rkey).ok_or_else(not_found)?;
        if !owner_ok(mr) {
            return Err(not_found());
        }
        if mr.access & (REMOTE_READ | REMOTE_WRITE | REMOTE_ATOMIC) == 0 {
            return Err((
                ErrorKind::Invalid,
                format!("region {rkey:#x} allows no remote access"),
            ));
        }
        let writable = mr.access & (REMOTE_WRITE | REMOTE_ATOMIC) != 0;
        let share = |fd: &OwnedFd, writable: bool| {
            if writable {
                fd.try_clone()
            } else {
                reopen_read_only(fd)
            }
            .map_err(|e| invalid(format!("cannot share region {rkey:#x}: {e}")))
        };
        // A separate header is only ever read by peers.
        let fds = RegionFds {
            header: share(&mr.fd, writable && mr.data.is_none())?,
            data: match &mr.data {
                Some((d, off)) => Some((share(d, writable)?, *off)),
                None => None,
            },
        };
        let (fds, data_off) = fds.into_message();
        Ok((
            VerbsResponse::MrGranted {
                len: mr.len,
                access: mr.access,
                writable,
                data_off,
            },
            fds,
        ))
    }

    // The request's five fields, the host and the client: a struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    fn create_qp(
        &mut self,
        host: &mut dyn Host,
        id: u64,
        slot: u32,
        pd: u32,
        (qp_type, ring_len, event_off, direct): (u32, u32, u64, Option<u32>),
    ) -> Result<(VerbsResponse, Vec<OwnedFd>), Failure> {
        host.ready_slot(slot)?;
        check_qp_shape(qp_type, ring_len)?;
        if !self
            .ctxs
            .iter()
            .any(|c| c.client == id && c.slot == slot && c.event_off == event_off)
        {
            return Err(invalid("the QP's context is not open on this node"));
        }
        let len = QpBlockRepr::footprint(ring_len);
        let off = host.alloc(slot, len, 4096).ok_or_else(|| host.full(slot))?;
        let qpn = self.new_qpn(slot);
        let repr = QpBlockRepr {
            qp_type,
            qpn,
            slot,
            generation: host.generation(slot),
            ring_len,
            event_off,
        };
        emit_qp_block(host.window(slot), off, repr);
        self.qps.insert(
            (slot, qpn),
            QpEntry {
                client: id,
                pd,
                qp_type,
                block_off: off,
                block_len: len,
                event_off,
                peer: None,
                shadow_ev: None,
                ring_len,
                rdma_off: 0,
                direct,
            },
        );
        Ok((
            VerbsResponse::QpCreated {
                qpn,
                block_off: off,
            },
            Vec::new(),
        ))
    }

    /// Removes a QP: every QP connected to it learns its peer is gone, its block is freed.
    fn destroy_qp(&mut self, host: &mut dyn Host, key: (u32, u32)) {
        let Some(q) = self.qps.remove(&key) else {
            return;
        };
        self.destroyed.push(key);
        if let Some(ev) = q.shadow_ev {
            host.free(key.0, ev, EV_LEN);
        }
        let peers: Vec<((u32, u32), u64, u64)> = self
            .qps
            .iter()
            .filter(|(_, p)| p.peer == Some(key))
            .map(|(&k, p)| (k, p.block_off, p.event_off))
            .collect();
        for ((slot, _), block_off, event_off) in peers {
            let w = host.window(slot);
            if let Ok(flag) = w.u32_at(block_off + QP_PEER_ERR_OFF as u64) {
                // SYNC POINT qp-peer-gone (release): the peer QP is gone from the registry.
                flag.store(1, Ordering::Release);
            }
            if let Ok(bell) = w.u32_at(event_off + EV_BELL_OFF as u64) {
                sync::ring(bell);
            }
        }
        host.free(key.0, q.block_off, q.block_len);
    }

    /// A client went away: its regions, QPs and contexts go with it.
    fn drop_client(&mut self, host: &mut dyn Host, id: u64) {
        self.mrs.retain(|_, m| {
            let keep = m.client != id;
            if !keep {
                m.mark_gone();
            }
            keep
        });
        let qps: Vec<_> = self
            .qps
            .iter()
            .filter(|(_, q)| q.client == id)
            .map(|(&k, _)| k)
            .collect();
        for k in qps {
            self.destroy_qp(host, k);
        }
        self.drop_contexts(host, |c| c.client == id);
    }

    /// A node went DOWN: the verbs objects of its processes are stale.
    fn drop_node(&mut self, host: &mut dyn Host, slot: u32) {
        self.mrs.retain(|_, m| {
            let keep = m.slot != slot;
            if !keep {
                m.mark_gone();
            }
            keep
        });
        let qps: Vec<_> = self.qps.keys().filter(|k| k.0 == slot).copied().collect();
        for k in qps {
            self.destroy_qp(host, k);
        }
        self.drop_contexts(host, |c| c.slot == slot);
    }

    fn drop_contexts(&mut self, host: &mut dyn Host, gone: impl Fn(&CtxEntry) -> bool) {
        let (dead, live): (Vec<_>, Vec<_>) = self.ctxs.drain(..).partition(|c| gone(c));
        self.ctxs = live;
        for c in dead {
            host.free(c.slot, c.event_off, EV_LEN);
        }
    }
}

impl Service for Registry {
    fn handle(
        &mut self,
        host: &mut dyn Host,
        client: u64,
        req: serde_json::Value,
        fds: Vec<OwnedFd>,
    ) -> Result<(serde_json::Value, Vec<OwnedFd>), Failure> {
        let req: VerbsRequest = serde_json::from_value(req)
            .map_err(|e| invalid(format!("malformed verbs request: {e}")))?;
        let (resp, fd) = self.serve_verbs(host, client, req, fds)?;
        let resp = serde_json::to_value(resp).map_err(|e| invalid(e.to_string()))?;
        Ok((resp, fd))
    }

    /// A client went away: its regions, QPs and contexts go with it.
    fn client_gone(&mut self, host: &mut dyn Host, client: u64) {
        self.drop_client(host, client);
    }

    /// A node went DOWN: the verbs objects of its processes are stale.
    fn node_down(&mut self, host: &mut dyn Host, slot: u32) {
        self.drop_node(host, slot);
    }

    fn qp_connect_of(&self, client: u64, req: &serde_json::Value) -> Option<(QpSide, (u32, u32))> {
        let Ok(VerbsRequest::ConnectQp {
            slot,
            qpn,
            dest_slot,
            dest_qpn,
        }) = VerbsRequest::deserialize(req)
        else {
            return None;
        };
        let own = self.local_qp(slot, qpn)?;
        let mine = self
            .qps
            .get(&(slot, qpn))
            .is_some_and(|q| q.client == client);
        mine.then_some((own, (dest_slot, dest_qpn)))
    }

    fn local_qp(&self, slot: u32, qpn: u32) -> Option<QpSide> {
        let q = self.qps.get(&(slot, qpn)).filter(|q| q.client != SHADOW)?;
        Some(QpSide {
            slot,
            qpn,
            qp_type: q.qp_type,
            ring_len: q.ring_len,
            block_off: q.block_off,
            event_off: q.event_off,
            rdma_off: 0,
            direct: q.direct,
        })
    }

    fn shadow_qp(
        &mut self,
        host: &mut dyn Host,
        slot: u32,
        qpn: u32,
        qp_type: u32,
        ring_len: u32,
        peer: (u32, u32),
        direct: Option<u32>,
    ) -> Result<QpSide, Failure> {
        if let Some(q) = self.qps.get_mut(&(slot, qpn)) {
            if q.client != SHADOW || q.qp_type != qp_type || q.ring_len != ring_len {
                return Err(invalid(format!(
                    "QP {qpn:#x} of node {slot} is already known here as another QP"
                )));
            }
            q.peer = Some(peer);
            q.direct = direct;
            return Ok(QpSide {
                slot,
                qpn,
                qp_type,
                ring_len,
                block_off: q.block_off,
                event_off: q.event_off,
                rdma_off: q.rdma_off,
                direct,
            });
        }
        check_qp_shape(qp_type, ring_len)?;
        let ev = host
            .alloc(slot, EV_LEN, 64)
            .ok_or_else(|| host.full(slot))?;
        // The QP block, then (page-aligned) the one-sided area.
        let rdma_at = crate::wire::verbs::rdma_area_at(ring_len);
        let len = rdma_at + rdma_footprint(ring_len);
        let Some(off) = host.alloc(slot, len, 4096) else {
            host.free(slot, ev, EV_LEN);
            return Err(host.full(slot));
        };
        let w = host.window(slot);
        w.zero(ev, EV_LEN).expect("allocated");
        w.zero(off + rdma_at, RDMA_RING_OFF).expect("allocated");
        let repr = QpBlockRepr {
            qp_type,
            qpn,
            slot,
            generation: host.generation(slot),
            ring_len,
            event_off: ev,
        };
        emit_qp_block(w, off, repr);
        self.qps.insert(
            (slot, qpn),
            QpEntry {
                client: SHADOW,
                pd: 0,
                qp_type,
                block_off: off,
                block_len: len,
                event_off: ev,
                peer: Some(peer),
                shadow_ev: Some(ev),
                ring_len,
                rdma_off: off + rdma_at,
                direct,
            },
        );
        Ok(QpSide {
            slot,
            qpn,
            qp_type,
            ring_len,
            block_off: off,
            event_off: ev,
            rdma_off: off + rdma_at,
            direct,
        })
    }

    fn grant_across_of(&self, client: u64, req: &serde_json::Value) -> Option<GrantAsk> {
        let Ok(VerbsRequest::MrGrant { slot, qpn, rkey }) = VerbsRequest::deserialize(req) else {
            return None;
        };
        let q = self.qps.get(&(slot, qpn)).filter(|q| q.client == client)?;
        let peer = q.peer?;
        let shadow = self.qps.get(&peer).is_some_and(|p| p.client == SHADOW);
        shadow.then_some(GrantAsk {
            qp: (slot, qpn),
            peer,
            rkey,
        })
    }

    fn grant_to_shadow(&mut self, shadow: (u32, u32), rkey: u32) -> Result<RemoteGrant, Failure> {
        let peer = self
            .qps
            .get(&shadow)
            .filter(|q| q.client == SHADOW)
            .and_then(|q| q.peer)
            .ok_or_else(|| {
                invalid(format!(
                    "QP {:#x} of node {} is not connected here",
                    shadow.1, shadow.0
                ))
            })?;
        let owner = self.qps.get(&peer).map(|pq| (pq.client, pq.pd));
        remote_grant(
            self.grant_region(rkey, "of the peer's protection domain", |mr| {
                owner.is_some_and(|(client, pd)| {
                    mr.client == client && mr.pd == pd && mr.slot == peer.0
                })
            })?,
        )
    }

    fn dma_grant_of(&self, client: u64, req: &serde_json::Value) -> Option<(u32, u32, u32)> {
        let Ok(VerbsRequest::DmaGrant { slot, node, rkey }) = VerbsRequest::deserialize(req) else {
            return None;
        };
        self.ctxs
            .iter()
            .any(|c| c.client == client && c.slot == slot)
            .then_some((slot, node, rkey))
    }

    fn grant_for_dma(&mut self, node: u32, rkey: u32) -> Result<RemoteGrant, Failure> {
        remote_grant(self.grant_region(rkey, &format!("on node {node}"), |mr| mr.slot == node)?)
    }

    fn dma_reply(
        &self,
        pair: &QpSide,
        grant: (u64, u32, bool, u64),
    ) -> Result<serde_json::Value, Failure> {
        let (len, access, writable, iova) = grant;
        let resp = VerbsResponse::MrAcross {
            len,
            access,
            writable,
            iova,
            peer_slot: pair.slot,
            peer_qpn: pair.qpn,
            rdma_off: pair.rdma_off,
            ring_len: rdma_ring_len(pair.ring_len),
            event_off: pair.event_off,
        };
        serde_json::to_value(resp).map_err(|e| invalid(e.to_string()))
    }

    fn across_reply(
        &self,
        qp: (u32, u32),
        grant: (u64, u32, bool, u64),
    ) -> Result<serde_json::Value, Failure> {
        let (len, access, writable, iova) = grant;
        let (peer_slot, peer_qpn) = self
            .qps
            .get(&qp)
            .and_then(|q| q.peer)
            .ok_or_else(|| invalid(format!("QP {:#x} is not connected", qp.1)))?;
        let p = self
            .qps
            .get(&(peer_slot, peer_qpn))
            .filter(|p| p.client == SHADOW)
            .ok_or_else(|| invalid(format!("QP {:#x} is not connected across hosts", qp.1)))?;
        let resp = VerbsResponse::MrAcross {
            len,
            access,
            writable,
            iova,
            peer_slot,
            peer_qpn,
            rdma_off: p.rdma_off,
            ring_len: rdma_ring_len(p.ring_len),
            event_off: p.event_off,
        };
        serde_json::to_value(resp).map_err(|e| invalid(e.to_string()))
    }

    fn drop_shadow_qp(&mut self, host: &mut dyn Host, slot: u32, qpn: u32) {
        if self
            .qps
            .get(&(slot, qpn))
            .is_some_and(|q| q.client == SHADOW)
        {
            self.destroy_qp(host, (slot, qpn));
        }
    }

    fn take_destroyed(&mut self) -> Vec<(u32, u32)> {
        std::mem::take(&mut self.destroyed)
    }
}

/// Checks a region's memfd: sealed against shrinking (a peer's mapping can never fault), long
/// enough for the header page and `len` data bytes; maps its header page writable (for
/// [`MrEntry::mark_gone`]), then seals it against new writable mappings when the region allows
/// neither remote writes nor remote atomics. The header mapping is None if the owner sealed
/// the region read-only already.
fn check_region_fd(fd: &OwnedFd, len: u64, access: u32) -> Result<Option<Region>, Failure> {
    if len == 0 || len > MAX_MR {
        return Err(invalid(format!("a region of {len} bytes is out of range")));
    }
    let read_only = access & (REMOTE_WRITE | REMOTE_ATOMIC) == 0;
    check_memfd(fd, MR_DATA_OFF + len, read_only, |size| {
        format!("the region's memfd holds {size} bytes, fewer than its header and {len} bytes")
    })
}

/// Checks a separate header's memfd (`RegMr` with `data_off`): one page or more, sealed
/// against shrinking; maps it writable (for [`MrEntry::mark_gone`]), then seals it against
/// new writable mappings (peers only read it).
fn check_header_fd(fd: &OwnedFd) -> Result<Option<Region>, Failure> {
    check_memfd(fd, MR_DATA_OFF, true, |_| {
        "a region's header memfd must hold a page".into()
    })
}

/// [`check_region_fd`]'s and [`check_header_fd`]'s checks: sealed against shrinking, at least
/// `min` bytes (else `too_small(size)`); the header page mapped writable; then sealed against
/// new writable mappings if `read_only`.
fn check_memfd(
    fd: &OwnedFd,
    min: u64,
    read_only: bool,
    too_small: impl FnOnce(u64) -> String,
) -> Result<Option<Region>, Failure> {
    use rustix::fs::{fcntl_add_seals, fcntl_get_seals, fstat, SealFlags};
    let seals = fcntl_get_seals(fd).map_err(|_| invalid("a region must be a sealable memfd"))?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(invalid("a region's memfd must be sealed against shrinking"));
    }
    let size = fstat(fd)
        .map_err(|e| invalid(format!("cannot stat the region: {e}")))?
        .st_size as u64;
    if size < min {
        return Err(invalid(too_small(size)));
    }
    // Sealed against shrinking and at least a page long: the page never faults.
    let header = fd
        .try_clone()
        .ok()
        .and_then(|f| Region::map_prefix(f, MR_DATA_OFF as usize, true).ok());
    if read_only && !seals.contains(SealFlags::FUTURE_WRITE) {
        fcntl_add_seals(fd, SealFlags::FUTURE_WRITE)
            .map_err(|e| invalid(format!("cannot seal the region read-only: {e}")))?;
    }
    Ok(header)
}

/// Checks the data file of a region over memory another object backs: shared memory (a
/// memfd, a SysV segment, POSIX shared memory, shared anonymous memory: tmpfs or hugetlbfs),
/// page-aligned offset, long enough for `len` bytes there.
fn check_data_fd(fd: &OwnedFd, off: u64, len: u64) -> Result<(), Failure> {
    if len == 0 || len > MAX_MR {
        return Err(invalid(format!("a region of {len} bytes is out of range")));
    }
    if !off.is_multiple_of(4096) {
        return Err(invalid(format!("data offset {off:#x} is not page-aligned")));
    }
    shared_memory_size(fd)
        .and_then(|size| {
            if off.checked_add(len).is_none_or(|e| e > size) {
                Err(format!(
                    "the region's data file holds {size} bytes, fewer than {off} + {len}"
                ))
            } else {
                Ok(())
            }
        })
        .map_err(invalid)
}

/// The size of a file that is shared memory (on tmpfs — memfds, SysV segments, POSIX shared
/// memory, shared anonymous memory — or hugetlbfs), or why it is not.
pub fn shared_memory_size(fd: &OwnedFd) -> Result<u64, String> {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    let fs = rustix::fs::fstatfs(fd).map_err(|e| format!("cannot statfs the memory: {e}"))?;
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between targets
    let kind = fs.f_type as i64;
    if kind != TMPFS_MAGIC && kind != HUGETLBFS_MAGIC {
        return Err(format!(
            "the memory is a mapping of a file on a disk file system (type {kind:#x}): only \
             shared memory can be registered where it is mapped"
        ));
    }
    rustix::fs::fstat(fd)
        .map(|s| s.st_size as u64)
        .map_err(|e| format!("cannot stat the memory: {e}"))
}

/// A new, read-only open file description of the same memfd.
fn reopen_read_only(fd: &OwnedFd) -> std::io::Result<OwnedFd> {
    use rustix::fs::{open, Mode, OFlags};
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    Ok(open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::Region;
    use std::sync::Arc;

    #[test]
    fn region_fds_must_be_sealed_memfds_long_enough_for_their_length() {
        let r = Region::create("bp-test-mr", 4096 + 8192).unwrap();
        let fd = r.fd().try_clone_to_owned().unwrap();
        assert!(check_region_fd(&fd, 8192, REMOTE_WRITE).is_ok());
        assert!(check_region_fd(&fd, 8193, REMOTE_WRITE).is_err());
        assert!(check_region_fd(&fd, 0, REMOTE_WRITE).is_err());
        let file: OwnedFd = std::fs::File::open("/proc/self/exe").unwrap().into();
        assert!(
            check_region_fd(&file, 1, REMOTE_READ).is_err(),
            "not a memfd"
        );
    }

    #[test]
    fn a_read_only_region_cannot_be_mapped_writable_even_after_reopening() {
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        let r = Region::create("bp-test-mr", 4096 + 4096).unwrap();
        r.write(4096, b"owner").unwrap();
        let fd = r.fd().try_clone_to_owned().unwrap();
        check_region_fd(&fd, 4096, REMOTE_READ).unwrap();
        let ro = reopen_read_only(&fd).unwrap();
        let map_rw = |f: &OwnedFd| {
            // SAFETY: a fresh kernel-chosen mapping; unmapped right away if it succeeds.
            unsafe {
                mmap(
                    std::ptr::null_mut(),
                    8192,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::SHARED,
                    f,
                    0,
                )
            }
            .map(|p| {
                // SAFETY: `p` is the 8192-byte mapping just made, referenced by nothing else.
                let _ = unsafe { rustix::mm::munmap(p, 8192) };
            })
        };
        assert!(map_rw(&ro).is_err(), "O_RDONLY fd mapped writable");
        let upgraded = rustix::fs::open(
            format!("/proc/self/fd/{}", ro.as_raw_fd()),
            rustix::fs::OFlags::RDWR,
            rustix::fs::Mode::empty(),
        );
        if let Ok(rw) = upgraded {
            assert!(map_rw(&rw).is_err(), "sealed region mapped writable");
        }
        // The owner's own mapping still writes, and readers see it.
        r.write(4096, b"still").unwrap();
        let reader = Region::map(ro, false).unwrap();
        let mut got = [0u8; 5];
        reader.read(4096, &mut got).unwrap();
        assert_eq!(&got, b"still");
    }

    /// One READY node with a bump allocator over its window: what the supervisor lends.
    struct OneNode {
        window: Arc<Region>,
        next: u64,
    }

    impl Host for OneNode {
        fn ready_slot(&self, slot: u32) -> Result<(), Failure> {
            if slot == 1 {
                Ok(())
            } else {
                Err((ErrorKind::NotFound, format!("node {slot} does not exist")))
            }
        }
        fn alloc(&mut self, _: u32, len: u64, align: u64) -> Option<u64> {
            let off = self.next.next_multiple_of(align);
            (off + len <= self.window.len() as u64).then(|| {
                self.next = off + len;
                off
            })
        }
        fn free(&mut self, _: u32, _: u64, _: u64) {}
        fn window(&self, _: u32) -> &Arc<Region> {
            &self.window
        }
        fn generation(&self, _: u32) -> u32 {
            1
        }
    }

    #[test]
    fn the_service_decodes_its_own_messages_and_refuses_malformed_ones() {
        let mut host = OneNode {
            window: Arc::new(Region::create("bp-test-win", 1 << 16).unwrap()),
            next: 0,
        };
        let mut reg = Registry::new();
        let open = serde_json::to_value(VerbsRequest::OpenContext { slot: 1 }).unwrap();
        let (resp, fd) = reg.handle(&mut host, 1, open, Vec::new()).unwrap();
        assert!(fd.is_empty());
        assert!(matches!(
            serde_json::from_value(resp).unwrap(),
            VerbsResponse::ContextOpened { .. }
        ));
        for bad in [
            serde_json::json!({"verb": "open_context"}),
            serde_json::json!({"verb": "format_disk", "slot": 1}),
            serde_json::json!("open_context"),
        ] {
            let Err((kind, msg)) = reg.handle(&mut host, 1, bad.clone(), Vec::new()) else {
                panic!("{bad} accepted");
            };
            assert_eq!(kind, ErrorKind::Invalid, "{bad}");
            assert!(msg.starts_with("malformed verbs request"), "{msg}");
        }
        let elsewhere = serde_json::to_value(VerbsRequest::OpenContext { slot: 9 }).unwrap();
        let Err((kind, _)) = reg.handle(&mut host, 1, elsewhere, Vec::new()) else {
            panic!("a context on a node that does not exist");
        };
        assert_eq!(kind, ErrorKind::NotFound);
    }
}
