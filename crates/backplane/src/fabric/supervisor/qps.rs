//! Queue pairs between hosts, as the supervisors agree on them (the bytes and words are the
//! bridge's mirrors, `mirror.rs`). A QP here connecting to a QP of another host is answered
//! only once that host checked its QP and made a shadow of ours for it (`OpenQp` →
//! `QpOpened`): then this host makes the shadow of the peer, the service connects our QP to
//! it as to a local one, and the bridges of both hosts mirror the pair. Either QP destroyed
//! (its process, its node, its host gone) ends the pair on both sides: the other QP sees its
//! peer gone and completes its outstanding work with an error, as on one host.
#![forbid(unsafe_code)]

use super::bridge::{Cmd, Note};
use super::mirror::QpBlock;
use super::*;
use crate::fabric::hosts::HostMsg;
use crate::wire::verbs::{DMA_PAIR_QPN, QP_MIN_RING, RDMA_GONE_OFF};

/// `IBV_QPT_RC`: the type a DMA pair's shadow is made as (it has no QP to match).
const QP_TYPE_RC: u32 = 2;

/// How long a connecting QP waits for the other host to answer.
const QP_PATIENCE: Duration = Duration::from_secs(5);

/// A request waiting for the peer's host.
struct Asked {
    client: u64,
    host: usize,
    at: Instant,
    what: AskedFor,
}

enum AskedFor {
    /// A connect of our QP `from` to `to` (the service request, served once answered).
    Connect {
        req: serde_json::Value,
        from: QpSide,
        to: (u32, u32),
    },
    /// A region `rkey` of `peer`, for our QP `qp`.
    Grant {
        qp: (u32, u32),
        peer: (u32, u32),
        rkey: u32,
    },
    /// A region `rkey` of node `node`, for the DMA engines of a process on our node `slot`,
    /// through the DMA pair numbered `pair`.
    Dma {
        slot: u32,
        node: u32,
        rkey: u32,
        pair: u32,
    },
}

impl AskedFor {
    fn what(&self) -> String {
        match self {
            AskedFor::Connect { to, .. } => {
                format!("the connect to QP {:#x} of node {}", to.1, to.0)
            }
            AskedFor::Grant { peer, rkey, .. } => {
                format!("region {rkey:#x} of QP {:#x} of node {}", peer.1, peer.0)
            }
            AskedFor::Dma { node, rkey, .. } => {
                format!("the DMA grant of region {rkey:#x} of node {node}")
            }
        }
    }
}

/// The QP pairs between hosts, kept by the supervisor.
pub(super) struct QpLinks {
    asked: HashMap<u64, Asked>,
    next: u64,
    /// Local QP → its peer on another host, and that host.
    pairs: HashMap<(u32, u32), ((u32, u32), usize)>,
    /// DMA pairs of this host's processes, by (client, its node, region's node, rkey).
    dma: HashMap<(u64, u32, u32, u32), DmaPair>,
    /// The next DMA pair's number (below [`DMA_PAIR_QPN`], with this host's index above).
    dma_next: u32,
    /// The region's ends of other hosts' DMA pairs here: (node, pair) → the requester's host.
    dma_targets: HashMap<(u32, u32), usize>,
    /// DMA pairs that went and were replaced by a new grant, by client (freed when it goes).
    dma_dead: Vec<(u64, DmaPair)>,
}

/// A process's way to one region of another host for its DMA engines: a shadow (of no QP)
/// whose one-sided area its transport writes requests into, mirrored by the bridge to the
/// region's host. One per region, so that a region that fails (deregistered, say) fails only
/// its own accesses.
struct DmaPair {
    host: usize,
    /// The shadow here (node = the region's, QPN with [`DMA_PAIR_QPN`]).
    shadow: QpSide,
    /// The requester's end (its node, the same number).
    local: (u32, u32),
    grant: Granted,
    /// False once its host or the pair went: a new grant makes a new pair (the old one's
    /// area stays until its process goes, which may still hold it).
    alive: bool,
}

impl QpLinks {
    pub(super) fn new() -> Self {
        Self {
            asked: HashMap::new(),
            next: 1,
            pairs: HashMap::new(),
            dma: HashMap::new(),
            dma_next: 1,
            dma_targets: HashMap::new(),
            dma_dead: Vec::new(),
        }
    }
}

/// A service's answer as the client gets it.
fn served(r: Result<serde_json::Value, (ErrorKind, String)>) -> Response {
    match r {
        Ok(v) => Response::Service(v),
        Err((kind, message)) => Response::Error { kind, message },
    }
}

/// What a reply says of a granted region: its size, access flags, whether writable, the
/// owner's address of its first byte.
type Granted = (u64, u32, bool, u64);

/// Maps a region granted to another host's QP or DMA pair (for this host's bridge): the
/// mapping and what the reply says of it (size, access, writable, the owner's address).
fn map_grant(
    g: RemoteGrant,
    rkey: u32,
) -> Result<(Arc<crate::transport::shm::ShmRegion>, Granted), (ErrorKind, String)> {
    let (len, access, writable) = (g.len, g.access, g.writable);
    let mr = crate::transport::shm::ShmRegion::from_fd(g.fds, len, access, writable).ok_or_else(
        || {
            (
                ErrorKind::Invalid,
                format!("region {rkey:#x} cannot be mapped or was deregistered"),
            )
        },
    )?;
    let iova = crate::transport::RemoteRegion::iova(&mr);
    Ok((Arc::new(mr), (len, access, writable, iova)))
}

impl Sup {
    fn qp_block(&self, s: &QpSide) -> QpBlock {
        QpBlock {
            win: self.windows[s.slot as usize - 1].clone(),
            off: s.block_off,
            ring_len: s.ring_len,
            event_off: s.event_off,
            rdma_off: s.rdma_off,
        }
    }

    /// A service request that connects a QP here to a QP of another host: asked there first
    /// (true: the client is answered later, or was refused now).
    pub(super) fn connect_across(&mut self, id: u64, req: &serde_json::Value) -> bool {
        if self.hosts.is_none() {
            return false;
        }
        let Some((from, to)) = self.verbs.qp_connect_of(id, req) else {
            return false;
        };
        let Some(host) = self.remote_host(to.0) else {
            return false;
        };
        let refuse = |kind, message| Response::Error { kind, message };
        let st = self.life[to.0 as usize - 1].state();
        if st != NodeState::Ready {
            let r = refuse(
                ErrorKind::NodeDown,
                format!("node {} is {st}, not READY", to.0),
            );
            self.reply(id, &r, &[]);
            return true;
        }
        let what = AskedFor::Connect {
            req: req.clone(),
            from,
            to,
        };
        self.ask(id, host, what, |tag| HostMsg::OpenQp {
            tag,
            from: (from.slot, from.qpn),
            qp_type: from.qp_type,
            ring_len: from.ring_len,
            to,
            direct: from.direct,
        });
        true
    }

    /// Sends host `host` the request `msg(tag)` for client `id` and waits for its answer
    /// (`what`); the client is refused at once if the host has not joined.
    fn ask(&mut self, id: u64, host: usize, what: AskedFor, msg: impl FnOnce(u64) -> HostMsg) {
        let tag = self.qps.next;
        self.qps.next += 1;
        let Some(h) = self.hosts.as_mut() else { return };
        if !h.send_to(host, &msg(tag)) {
            let message = format!(
                "{} needs host '{}', which has not joined",
                what.what(),
                h.plan.hosts[host].name
            );
            let r = Response::Error {
                kind: ErrorKind::NodeDown,
                message,
            };
            self.reply(id, &r, &[]);
            return;
        }
        let asked = Asked {
            client: id,
            host,
            at: Instant::now(),
            what,
        };
        self.qps.asked.insert(tag, asked);
    }

    /// A service request for a region through a QP whose peer is on another host: asked
    /// there (true: the client is answered later, or was refused now).
    pub(super) fn grant_across(&mut self, id: u64, req: &serde_json::Value) -> bool {
        if self.hosts.is_none() {
            return false;
        }
        let Some(GrantAsk { qp, peer, rkey }) = self.verbs.grant_across_of(id, req) else {
            return false;
        };
        let host = match self.qps.pairs.get(&qp) {
            Some(&(p, host)) if p == peer => host,
            _ => {
                let message = format!(
                    "QP {:#x} is not connected to QP {:#x} of node {} any more",
                    qp.1, peer.1, peer.0
                );
                let r = Response::Error {
                    kind: ErrorKind::NotFound,
                    message,
                };
                self.reply(id, &r, &[]);
                return true;
            }
        };
        let what = AskedFor::Grant { qp, peer, rkey };
        self.ask(id, host, what, |tag| HostMsg::GrantMr {
            tag,
            qp,
            peer,
            rkey,
        });
        true
    }

    /// A DMA grant of a region of another host's node: through a DMA pair to that host (made
    /// once the host granted the region; true: the client is answered later, or now).
    pub(super) fn dma_across(&mut self, id: u64, req: &serde_json::Value) -> bool {
        if self.hosts.is_none() {
            return false;
        }
        let Some((slot, node, rkey)) = self.verbs.dma_grant_of(id, req) else {
            return false;
        };
        let Some(host) = self.remote_host(node) else {
            return false;
        };
        let st = self.life[node as usize - 1].state();
        let ready = self.ready_slot(slot).and_then(|()| {
            (st == NodeState::Ready).then_some(()).ok_or_else(|| {
                (
                    ErrorKind::NodeDown,
                    format!("node {node} is {st}, not READY"),
                )
            })
        });
        if let Err((kind, message)) = ready {
            self.reply(id, &Response::Error { kind, message }, &[]);
            return true;
        }
        if let Some(p) = self
            .qps
            .dma
            .get(&(id, slot, node, rkey))
            .filter(|p| p.alive)
        {
            let r = served(self.verbs.dma_reply(&p.shadow, p.grant));
            self.reply(id, &r, &[]);
            return true;
        }
        let me = self.hosts.as_ref().map_or(0, |h| h.plan.me) as u32;
        let pair = DMA_PAIR_QPN | (me & 0x7f) << 24 | (self.qps.dma_next & 0xff_ffff);
        self.qps.dma_next = self.qps.dma_next.wrapping_add(1);
        let what = AskedFor::Dma {
            slot,
            node,
            rkey,
            pair,
        };
        self.ask(id, host, what, |tag| HostMsg::GrantDma {
            tag,
            from: (slot, pair),
            node,
            rkey,
        });
        true
    }

    /// Host `i` asks for region `rkey` of our node `node` for its DMA pair `from`: granted as
    /// a DMA grant here, the pair's end here made (a bare mirror) unless it exists, the region
    /// handed to it.
    fn dma_target(
        &mut self,
        i: usize,
        from: (u32, u32),
        node: u32,
        rkey: u32,
    ) -> Result<Granted, (ErrorKind, String)> {
        if self.remote_host(from.0) != Some(i)
            || self.remote_host(node).is_some()
            || from.1 & DMA_PAIR_QPN == 0
        {
            return Err((
                ErrorKind::Invalid,
                format!("node {node} is not this host's to grant DMA from"),
            ));
        }
        self.ready_slot(node)?;
        let g = self.verbs.grant_for_dma(node, rkey)?;
        let (mr, granted) = map_grant(g, rkey)?;
        let ours = (node, from.1);
        self.qps.dma_targets.insert(ours, i);
        let bare = |a| {
            super::mirror::bare_block(a)
                .map_err(|e| (ErrorKind::Invalid, format!("cannot make a DMA pair: {e}")))
        };
        let (local, shadow) = (bare(super::mirror::DMA_TARGET_ACCESS)?, bare(0)?);
        if let Some(h) = &self.hosts {
            // (A pair the bridge has already keeps going: only the region is added.)
            h.bridge.send(Cmd::AddQp {
                host: i,
                local_key: ours,
                remote_key: from,
                direct: false,
                local,
                shadow,
            });
            h.bridge.send(Cmd::AddMr {
                local_key: ours,
                remote_key: from,
                rkey,
                mr,
            });
        }
        Ok(granted)
    }

    /// The region's host granted it: the pair's shadow here, the bridge's mirror of it, the
    /// client answered where the one-sided area is.
    fn dma_opened(&mut self, client: u64, host: usize, asked: AskedFor, grant: Granted) {
        let AskedFor::Dma {
            slot,
            node,
            rkey,
            pair,
        } = asked
        else {
            return;
        };
        let local = (slot, pair);
        if !self.clients.contains_key(&client) {
            // Its process went while the host answered: the other end goes too.
            return self.tell_dma_gone(host, local);
        }
        let made = self
            .with_service(|s, h| s.shadow_qp(h, node, pair, QP_TYPE_RC, QP_MIN_RING, local, None));
        let shadow = match made {
            Ok(side) => side,
            Err((kind, message)) => {
                self.tell_dma_gone(host, local);
                return self.reply(client, &Response::Error { kind, message }, &[]);
            }
        };
        let block = match super::mirror::bare_block(0) {
            Ok(b) => b,
            Err(e) => {
                self.tell_dma_gone(host, local);
                self.with_service(|s, h| s.drop_shadow_qp(h, node, pair));
                let message = format!("cannot make a DMA pair: {e}");
                let r = Response::Error {
                    kind: ErrorKind::Invalid,
                    message,
                };
                return self.reply(client, &r, &[]);
            }
        };
        let cmd = Cmd::AddQp {
            host,
            direct: false,
            local_key: local,
            remote_key: (node, pair),
            local: block,
            shadow: self.qp_block(&shadow),
        };
        if let Some(h) = &self.hosts {
            h.bridge.send(cmd);
        }
        let r = served(self.verbs.dma_reply(&shadow, grant));
        let p = DmaPair {
            host,
            shadow,
            local,
            grant,
            alive: true,
        };
        if let Some(old) = self.qps.dma.insert((client, slot, node, rkey), p) {
            // A pair that went: its process may still hold it (its area stays till it goes).
            self.qps.dma_dead.push((client, old));
        }
        self.reply(client, &r, &[]);
    }

    /// The region's host is told the pair `local` is over (it drops its end).
    fn tell_dma_gone(&mut self, host: usize, local: (u32, u32)) {
        if let Some(h) = self.hosts.as_mut() {
            h.send_to(host, &HostMsg::QpGone { qp: local });
        }
    }

    /// A client went: its DMA pairs end on both hosts (the bridge says the last words and
    /// that the pair is gone), their shadows go.
    pub(super) fn dma_client_gone(&mut self, id: u64) {
        let mine: Vec<_> = self.qps.dma.keys().filter(|k| k.0 == id).copied().collect();
        let mut pairs: Vec<DmaPair> = mine.iter().filter_map(|k| self.qps.dma.remove(k)).collect();
        let (dead, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.qps.dma_dead)
            .into_iter()
            .partition(|(c, _)| *c == id);
        self.qps.dma_dead = rest;
        pairs.extend(dead.into_iter().map(|(_, p)| p));
        for p in pairs {
            if let Some(h) = &self.hosts {
                let host = p.alive.then_some(p.host);
                h.bridge.send(Cmd::DropQp { key: p.local, host });
            }
            let (node, pair) = (p.shadow.slot, p.shadow.qpn);
            self.with_service(|s, h| s.drop_shadow_qp(h, node, pair));
        }
        self.qps_destroyed();
    }

    /// The DMA pair named `key` (our end, or its shadow) ended — its host said so, the pair
    /// broke, its host went: its accesses fail from now on (a new grant makes a new pair); the
    /// area stays until its process goes.
    fn dma_pair_gone(&mut self, key: (u32, u32)) {
        for p in self.qps.dma.values_mut() {
            if (p.shadow.slot, p.shadow.qpn) != key && p.local != key {
                continue;
            }
            p.alive = false;
            let win = &self.windows[p.shadow.slot as usize - 1];
            let at = p.shadow.rdma_off + RDMA_GONE_OFF as u64;
            if let Ok(w) = crate::mem::Word32::at(win, at) {
                // SYNC POINT rdma-gone (release), as the bridge's `Mirror::fail`.
                w.store(1, Ordering::Release);
            }
        }
    }

    /// Host `i` asks for region `rkey` of our QP `peer` for its QP `qp`: granted by the
    /// service, mapped, handed to the bridge; what the reply says of it.
    fn grant_for(
        &mut self,
        i: usize,
        qp: (u32, u32),
        peer: (u32, u32),
        rkey: u32,
    ) -> Result<Granted, (ErrorKind, String)> {
        if self.qps.pairs.get(&peer) != Some(&(qp, i))
            || self.verbs.local_qp(peer.0, peer.1).is_none()
        {
            return Err((
                ErrorKind::NotFound,
                format!(
                    "QP {:#x} of node {} is not connected to QP {:#x} of node {}",
                    peer.1, peer.0, qp.1, qp.0
                ),
            ));
        }
        let g = self.verbs.grant_to_shadow(qp, rkey)?;
        let (mr, granted) = map_grant(g, rkey)?;
        if let Some(h) = &self.hosts {
            h.bridge.send(Cmd::AddMr {
                local_key: peer,
                remote_key: qp,
                rkey,
                mr,
            });
        }
        Ok(granted)
    }

    /// Tells host `i` whether its request `tag` for a region was granted.
    fn answer_grant(&mut self, i: usize, tag: u64, granted: Result<Granted, (ErrorKind, String)>) {
        let reply = match granted {
            Ok((len, access, writable, iova)) => HostMsg::MrOpened {
                tag,
                len,
                access,
                writable,
                iova,
            },
            Err((kind, message)) => HostMsg::MrRefused { tag, kind, message },
        };
        if let Some(h) = self.hosts.as_mut() {
            h.send_to(i, &reply);
        }
    }

    /// A QP message from host `i`.
    pub(super) fn qp_msg(&mut self, i: usize, m: HostMsg) {
        match m {
            HostMsg::OpenQp {
                tag,
                from,
                qp_type,
                ring_len,
                to,
                direct,
            } => {
                let reply = match self.accept_qp(i, from, (qp_type, ring_len, direct), to) {
                    Ok((ring_len, direct)) => HostMsg::QpOpened {
                        tag,
                        ring_len,
                        direct,
                    },
                    Err((kind, message)) => HostMsg::QpRefused { tag, kind, message },
                };
                if let Some(h) = self.hosts.as_mut() {
                    h.send_to(i, &reply);
                }
            }
            HostMsg::QpOpened {
                tag,
                ring_len,
                direct,
            } => {
                if let Some(a) = self.qps.asked.remove(&tag).filter(|a| a.host == i) {
                    if let AskedFor::Connect { req, from, to } = a.what {
                        self.qp_opened(a.client, a.host, req, from, to, (ring_len, direct));
                    }
                }
            }
            HostMsg::QpRefused { tag, kind, message }
            | HostMsg::MrRefused { tag, kind, message } => {
                if let Some(a) = self.qps.asked.remove(&tag).filter(|a| a.host == i) {
                    self.reply(a.client, &Response::Error { kind, message }, &[]);
                }
            }
            HostMsg::GrantMr {
                tag,
                qp,
                peer,
                rkey,
            } => {
                let granted = self.grant_for(i, qp, peer, rkey);
                self.answer_grant(i, tag, granted);
            }
            HostMsg::GrantDma {
                tag,
                from,
                node,
                rkey,
            } => {
                let granted = self.dma_target(i, from, node, rkey);
                self.answer_grant(i, tag, granted);
            }
            HostMsg::MrOpened {
                tag,
                len,
                access,
                writable,
                iova,
            } => {
                if let Some(a) = self.qps.asked.remove(&tag).filter(|a| a.host == i) {
                    if let what @ AskedFor::Dma { .. } = a.what {
                        return self.dma_opened(a.client, i, what, (len, access, writable, iova));
                    }
                    if let AskedFor::Grant { qp, .. } = a.what {
                        let r = served(self.verbs.across_reply(qp, (len, access, writable, iova)));
                        self.reply(a.client, &r, &[]);
                    }
                }
            }
            // A DMA pair's end on the other host went: our end goes from the bridge (a
            // requester's shadow here stays for its process, its accesses failing).
            HostMsg::QpGone { qp }
                if qp.1 & DMA_PAIR_QPN != 0 && self.remote_host(qp.0) == Some(i) =>
            {
                self.dma_pair_gone(qp);
                self.qps
                    .dma_targets
                    .retain(|k, h| !(k.1 == qp.1 && *h == i));
                if let Some(h) = &self.hosts {
                    h.bridge.send(Cmd::DropQp {
                        key: qp,
                        host: None,
                    });
                }
            }
            HostMsg::QpGone { qp } if self.remote_host(qp.0) == Some(i) => {
                self.with_service(|s, h| s.drop_shadow_qp(h, qp.0, qp.1));
                self.qps_destroyed();
            }
            _ => {}
        }
    }

    /// Host `i` asks to connect its QP `from` (of type `qp_type`, inbound ring `ring_len`,
    /// its process's direct port) to our QP `to`: checked, the shadow of `from` made, the pair
    /// handed to the bridge; our QP's ring size and direct port for the reply. The pair is
    /// direct (the two processes carry it, `verbs::direct`) when both name a port.
    fn accept_qp(
        &mut self,
        i: usize,
        from: (u32, u32),
        (qp_type, ring_len, direct): (u32, u32, Option<u32>),
        to: (u32, u32),
    ) -> Result<(u32, Option<u32>), (ErrorKind, String)> {
        if self.remote_host(from.0) != Some(i) || self.remote_host(to.0).is_some() {
            return Err((
                ErrorKind::Invalid,
                format!(
                    "QP {:#x} of node {} is not this host's to connect",
                    to.1, to.0
                ),
            ));
        }
        self.ready_slot(to.0)?;
        let side = self.verbs.local_qp(to.0, to.1).ok_or_else(|| {
            (
                ErrorKind::NotFound,
                format!("node {} has no QP {:#x}", to.0, to.1),
            )
        })?;
        if side.qp_type != qp_type {
            return Err((
                ErrorKind::Invalid,
                format!("QP {:#x} on node {} is of another transport", to.1, to.0),
            ));
        }
        let direct = direct.filter(|_| side.direct.is_some());
        let shadow = self
            .with_service(|s, h| s.shadow_qp(h, from.0, from.1, qp_type, ring_len, to, direct))?;
        self.pair_up(i, &side, &shadow);
        Ok((side.ring_len, side.direct))
    }

    /// Local QP `local` and the shadow of its peer on host `i`: recorded, mirrored.
    fn pair_up(&mut self, i: usize, local: &QpSide, shadow: &QpSide) {
        let (lk, rk) = ((local.slot, local.qpn), (shadow.slot, shadow.qpn));
        self.qps.pairs.insert(lk, (rk, i));
        let cmd = Cmd::AddQp {
            host: i,
            local_key: lk,
            remote_key: rk,
            local: self.qp_block(local),
            shadow: self.qp_block(shadow),
            direct: shadow.direct.is_some(),
        };
        if let Some(h) = &self.hosts {
            h.bridge.send(cmd);
        }
    }

    /// The other host has its end: our shadow of its QP, then the connect as on one host.
    fn qp_opened(
        &mut self,
        client: u64,
        host: usize,
        req: serde_json::Value,
        from: QpSide,
        to: (u32, u32),
        (ring_len, direct): (u32, Option<u32>),
    ) {
        let me = (from.slot, from.qpn);
        let direct = direct.filter(|_| from.direct.is_some());
        let shadow = self
            .with_service(|s, h| s.shadow_qp(h, to.0, to.1, from.qp_type, ring_len, me, direct));
        let shadow = match shadow {
            Ok(s) => s,
            Err((kind, message)) => {
                self.reply(client, &Response::Error { kind, message }, &[]);
                return;
            }
        };
        let ok = self.serve_service(client, req, Vec::new());
        if ok && self.verbs.local_qp(from.slot, from.qpn) == Some(from) {
            self.pair_up(host, &from, &shadow);
        } else if let Some(h) = self.hosts.as_mut() {
            // Our QP went meanwhile: the other host's shadow of it goes too.
            h.send_to(
                host,
                &HostMsg::QpGone {
                    qp: (from.slot, from.qpn),
                },
            );
        }
    }

    /// QPs the service destroyed: a local QP's peer host is told, every mirror of either goes.
    pub(super) fn qps_destroyed(&mut self) {
        let gone = self.verbs.take_destroyed();
        if gone.is_empty() || self.hosts.is_none() {
            return;
        }
        for key in gone {
            // The other host keeps a shadow of our QP until told, whichever end went first
            // (an entry stays after its peer went, for this): the bridge tells it after the
            // QP's last words, on the data link (`Note::TellQpGone` if it cannot).
            let host = self.qps.pairs.remove(&key).map(|(_, h)| h);
            if let Some(h) = &self.hosts {
                h.bridge.send(Cmd::DropQp { key, host });
            }
        }
    }

    /// A bridge note about a mirror: said, and the other host told the pair is over.
    pub(super) fn qp_note(&mut self, n: Note) {
        match n {
            Note::PeerQpGone { host, qp } => {
                return self.qp_msg(host, HostMsg::QpGone { qp });
            }
            Note::TellQpGone { host, qp } => {
                if let Some(h) = self.hosts.as_mut() {
                    h.send_to(host, &HostMsg::QpGone { qp });
                }
                return;
            }
            _ => {}
        }
        if let Note::QpBroken { key, why } = n {
            self.say(&format!(
                "QP {:#x} of node {}: its peer on another host is cut off ({why})",
                key.1, key.0
            ));
            let host = self.qps.pairs.remove(&key).map(|(_, h)| h);
            let host = host.or_else(|| self.qps.dma_targets.remove(&key));
            if let Some(host) = host {
                if let Some(h) = self.hosts.as_mut() {
                    h.send_to(host, &HostMsg::QpGone { qp: key });
                }
            }
            if key.1 & DMA_PAIR_QPN != 0 {
                self.dma_pair_gone(key);
            }
        }
    }

    /// Host `i` is gone: connects waiting for it are refused, its pairs forgotten (the bridge
    /// breaks their mirrors; its nodes going DOWN take the shadows).
    pub(super) fn qps_host_gone(&mut self, i: usize) {
        let name = self
            .hosts
            .as_ref()
            .map_or(String::new(), |h| h.plan.hosts[i].name.clone());
        let waiting: Vec<u64> = self
            .qps
            .asked
            .iter()
            .filter(|(_, a)| a.host == i)
            .map(|(&t, _)| t)
            .collect();
        for tag in waiting {
            if let Some(a) = self.qps.asked.remove(&tag) {
                let message = format!(
                    "host '{name}' went away before it answered {}",
                    a.what.what()
                );
                let r = Response::Error {
                    kind: ErrorKind::NodeDown,
                    message,
                };
                self.reply(a.client, &r, &[]);
            }
        }
        self.qps.pairs.retain(|_, (_, h)| *h != i);
        self.qps.dma_targets.retain(|_, h| *h != i);
        let through: Vec<(u32, u32)> = self
            .qps
            .dma
            .values()
            .filter(|p| p.host == i)
            .map(|p| p.local)
            .collect();
        for key in through {
            self.dma_pair_gone(key);
        }
    }

    /// Connects waiting too long are refused; destroyed QPs are told.
    pub(super) fn qps_tick(&mut self, now: Instant) {
        self.qps_destroyed();
        let late: Vec<u64> = self
            .qps
            .asked
            .iter()
            .filter(|(_, a)| now.duration_since(a.at) > QP_PATIENCE)
            .map(|(&t, _)| t)
            .collect();
        for tag in late {
            if let Some(a) = self.qps.asked.remove(&tag) {
                let name = self
                    .hosts
                    .as_ref()
                    .map_or(String::new(), |h| h.plan.hosts[a.host].name.clone());
                let message = format!(
                    "host '{name}' did not answer {} within {} s",
                    a.what.what(),
                    QP_PATIENCE.as_secs()
                );
                let r = Response::Error {
                    kind: ErrorKind::NodeDown,
                    message,
                };
                self.reply(a.client, &r, &[]);
                // A DMA grant it answers after all would leave its end of the pair there.
                if let AskedFor::Dma { slot, pair, .. } = a.what {
                    self.tell_dma_gone(a.host, (slot, pair));
                }
            }
        }
    }
}
