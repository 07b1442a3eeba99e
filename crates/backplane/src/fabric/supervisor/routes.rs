//! Datagram routes between hosts, as the supervisors agree on them (the bytes are the
//! bridge's, `bridge.rs`). A sender here connecting to a node of another host is answered
//! only once that host made the ring into its node (`OpenRoute` → `RouteOpened`): then this
//! host makes the shadow ring the sender writes and the bridge reads. Either side's end tears
//! the other down: the receiver going (`RouteClosed`), the sender's last datagram (`End` on
//! the data link, then [`Note::OutDone`]), a host lost (every route through it).
#![forbid(unsafe_code)]

use super::bridge::{Cmd, Note};
use super::*;
use crate::fabric::hosts::HostMsg;
use crate::mem::{Word32, Word64};
use crate::transport::shm::{Bell, ShmReceiver, ShmRing, ShmSender};
use crate::wire::MIN_RING_DATA;

/// How long a sender waits for the other host to open a route.
const ROUTE_PATIENCE: Duration = Duration::from_secs(5);

/// An outbound route: asked for (ring `None`) or open.
pub(super) struct RouteOut {
    host: usize,
    ring: Option<u64>,
    client: u64,
    src: (u32, u32),
    dst: (u32, u32),
    asked: Instant,
}

/// Which route a ring carries.
#[derive(Clone, Copy)]
pub(super) enum RouteRef {
    Out(u64),
    In(usize, u64),
}

/// The routes' state, kept by the supervisor.
pub(super) struct Routes {
    out: HashMap<u64, RouteOut>,
    inbound: HashMap<(usize, u64), u64>,
    by_ring: HashMap<u64, RouteRef>,
    next: u64,
}

impl Routes {
    pub(super) fn new() -> Self {
        Self {
            out: HashMap::new(),
            inbound: HashMap::new(),
            by_ring: HashMap::new(),
            // Numbered from the clock, so a restarted supervisor's routes are new numbers to
            // the hosts that knew its previous incarnation.
            next: now_ms() << 20,
        }
    }
}

/// A ring made for a route, and what its bridge end is built from.
struct Made {
    rid: u64,
    resp: Response,
    ring: ShmRing,
    /// The ring's data size.
    data_len: u32,
    ring_off: u64,
    credit_off: u64,
    dst_record_off: u64,
    dst_w: Arc<Region>,
    src_w: Arc<Region>,
}

impl Sup {
    /// The ring from `src` to `dst` (made unless it exists, with `data_len` bytes of data)
    /// with the views the bridge uses.
    fn ring_for_bridge(
        &mut self,
        src: (u32, u32),
        dst: (u32, u32),
        data_len: u32,
    ) -> Result<Made, (ErrorKind, String)> {
        let resp = self.make_ring(src, dst, data_len)?;
        let Response::Connected {
            ring_off,
            credit_off,
            dst_record_off,
            ring_data,
            ..
        } = resp
        else {
            return Err((ErrorKind::Invalid, "no ring".into()));
        };
        let rid = self
            .rings
            .iter()
            .find(|(_, r)| r.src == src && r.dst == dst)
            .map(|(&k, _)| k)
            .expect("make_ring made it");
        let dst_w = self.windows[dst.0 as usize - 1].clone();
        let src_w = self.windows[src.0 as usize - 1].clone();
        let data_len = ring_data.unwrap_or(data_len);
        match ShmRing::datagram(&dst_w, ring_off, data_len, &src_w, credit_off) {
            Ok(ring) => Ok(Made {
                rid,
                resp,
                ring,
                data_len,
                ring_off,
                credit_off,
                dst_record_off,
                dst_w,
                src_w,
            }),
            Err(e) => {
                self.teardown_ring(rid);
                Err((ErrorKind::Invalid, e.to_string()))
            }
        }
    }

    pub(super) fn remote_host(&self, slot: u32) -> Option<usize> {
        let h = self.hosts.as_ref()?;
        (!h.plan.is_local(slot))
            .then(|| h.plan.owner(slot))
            .flatten()
    }

    /// `Connect` to a node of another host: the ring if the route exists, else the route is
    /// asked for and the client answered when the other host does (`Ok(None)`).
    pub(super) fn open_route(
        &mut self,
        id: u64,
        src: (u32, u32),
        dst: (u32, u32),
    ) -> Result<Option<Response>, (ErrorKind, String)> {
        self.ready_slot(src.0)?;
        self.check_owner(id, src)?;
        let host = self.remote_host(dst.0).expect("caller checked");
        if self.life[dst.0 as usize - 1].state() != NodeState::Ready {
            let st = self.life[dst.0 as usize - 1].state();
            return Err((
                ErrorKind::NodeDown,
                format!("node {} is {st}, not READY", dst.0),
            ));
        }
        if self.rings.values().any(|r| r.src == src && r.dst == dst) {
            return self.make_ring(src, dst, self.ring_data()).map(Some);
        }
        let direct = self.endpoints.get(&src).is_some_and(|e| e.direct.is_some());
        let route = self.routes.next;
        self.routes.next += 1;
        let h = self
            .hosts
            .as_mut()
            .expect("remote slots exist only with hosts");
        let asked = h.send_to(
            host,
            &HostMsg::OpenRoute {
                route,
                src,
                dst,
                direct,
            },
        );
        if !asked {
            return Err((
                ErrorKind::NodeDown,
                format!(
                    "node {} runs on host '{}', which has not joined",
                    dst.0, h.plan.hosts[host].name
                ),
            ));
        }
        self.routes.out.insert(
            route,
            RouteOut {
                host,
                ring: None,
                client: id,
                src,
                dst,
                asked: Instant::now(),
            },
        );
        Ok(None)
    }

    /// A route message from host `i`.
    pub(super) fn route_msg(&mut self, i: usize, m: HostMsg) {
        match m {
            HostMsg::OpenRoute {
                route,
                src,
                dst,
                direct,
            } => {
                let reply = match self.accept_route(i, route, src, dst, direct) {
                    Ok(window) => HostMsg::RouteOpened {
                        route,
                        window,
                        direct: self.endpoints.get(&dst).and_then(|e| e.direct),
                    },
                    Err((kind, message)) => HostMsg::RouteRefused {
                        route,
                        kind,
                        message,
                    },
                };
                if let Some(h) = self.hosts.as_mut() {
                    h.send_to(i, &reply);
                }
            }
            HostMsg::RouteOpened {
                route,
                window,
                direct,
            } => self.route_opened(i, route, window, direct),
            HostMsg::RouteRefused {
                route,
                kind,
                message,
            } => {
                if let Some(r) = self.routes.out.remove(&route).filter(|r| r.host == i) {
                    self.reply(r.client, &Response::Error { kind, message }, &[]);
                }
            }
            HostMsg::RouteClosed { route } => {
                let ring = self.routes.out.get(&route).filter(|r| r.host == i);
                if let Some(rid) = ring.and_then(|r| r.ring) {
                    self.teardown_ring(rid);
                }
            }
            HostMsg::CloseRoute { route } => {
                if let Some(&rid) = self.routes.inbound.get(&(i, route)) {
                    self.end_inbound(rid);
                }
            }
            m @ (HostMsg::OpenQp { .. }
            | HostMsg::QpOpened { .. }
            | HostMsg::QpRefused { .. }
            | HostMsg::QpGone { .. }
            | HostMsg::GrantMr { .. }
            | HostMsg::GrantDma { .. }
            | HostMsg::MrOpened { .. }
            | HostMsg::MrRefused { .. }) => self.qp_msg(i, m),
            _ => {}
        }
    }

    /// Host `i` asks for a ring from `src` (its node) to `dst` (ours): made like any other,
    /// with the sender's credit line in the shadow window of its node; the bridge feeds it.
    /// When the sender sends `direct` and the receiver takes datagrams so, the ring carries
    /// none: it is the least the format allows ([`crate::wire::MIN_RING_DATA`]).
    fn accept_route(
        &mut self,
        i: usize,
        route: u64,
        src: (u32, u32),
        dst: (u32, u32),
        direct: bool,
    ) -> Result<u64, (ErrorKind, String)> {
        let plan = &self.hosts.as_ref().expect("hosts").plan;
        if plan.owner(src.0) != Some(i) || !plan.is_local(dst.0) {
            return Err((
                ErrorKind::Invalid,
                format!(
                    "a route from node {} to node {} does not go from host '{}' to host '{}'",
                    src.0,
                    dst.0,
                    plan.hosts[i].name,
                    plan.this().name
                ),
            ));
        }
        if self.routes.inbound.contains_key(&(i, route)) {
            return Err((ErrorKind::Invalid, format!("route {route} is open already")));
        }
        service::ready_slot(self.cfg.nodes, &self.life, dst.0)?;
        service::ready_slot(self.cfg.nodes, &self.life, src.0)?;
        let both_direct = direct && self.endpoints.get(&dst).is_some_and(|e| e.direct.is_some());
        let data_len = if both_direct {
            MIN_RING_DATA
        } else {
            self.ring_data()
        };
        let m = self.ring_for_bridge(src, dst, data_len)?;
        let (dst_w, src_w) = (&m.dst_w, &m.src_w);
        let words = (|| {
            let bell = Bell::new(
                Word32::at(dst_w, m.dst_record_off + EP_ARMED_OFF as u64)?,
                Word32::at(dst_w, m.dst_record_off + EP_DOORBELL_OFF as u64)?,
            );
            Ok::<_, crate::mem::MemError>(Cmd::AddIn {
                host: i,
                route,
                tx: Box::new(ShmSender::new(m.ring.clone()).with_bell(bell)),
                sender_closed: Word32::at(dst_w, m.ring_off + RING_SENDER_CLOSED_OFF as u64)?,
                receiver_bell: Word32::at(dst_w, m.dst_record_off + EP_DOORBELL_OFF as u64)?,
                peer_closed: Word32::at(src_w, m.credit_off + CREDIT_PEER_CLOSED_OFF as u64)?,
                credit_bell: (
                    Word32::at(src_w, m.credit_off + CREDIT_ARMED_OFF as u64)?,
                    Word32::at(src_w, m.credit_off + CREDIT_SEQ_OFF as u64)?,
                ),
                ingress: match self.cfg.link {
                    Some(_) => Some(Word64::at(dst_w, crate::wire::WIN_LINK_INGRESS_OFF as u64)?),
                    None => None,
                },
            })
        })();
        let (rid, data_len) = (m.rid, m.data_len);
        let cmd = match words {
            Ok(c) => c,
            Err(e) => {
                self.teardown_ring(rid);
                return Err((ErrorKind::Invalid, e.to_string()));
            }
        };
        self.routes.inbound.insert((i, route), rid);
        self.routes.by_ring.insert(rid, RouteRef::In(i, route));
        if let Some(h) = &self.hosts {
            h.bridge.send(cmd);
        }
        Ok(u64::from(data_len))
    }

    /// The other host made its ring: make the shadow ring the sender writes, give it to the
    /// bridge, and answer the sender.
    fn route_opened(&mut self, i: usize, route: u64, window: u64, direct: Option<u16>) {
        let Some(r) = self
            .routes
            .out
            .get(&route)
            .filter(|r| r.host == i && r.ring.is_none())
        else {
            return;
        };
        let (client, src, dst) = (r.client, r.src, r.dst);
        let still_there = self.endpoints.get(&src).is_some_and(|e| e.client == client);
        if !still_there {
            self.routes.out.remove(&route);
            if let Some(h) = self.hosts.as_mut() {
                h.send_to(i, &HostMsg::CloseRoute { route });
            }
            return;
        }
        // A route whose datagrams go directly has the least ring on both hosts (see
        // `accept_route`); any other the fabric's.
        let sends_direct = self.endpoints.get(&src).is_some_and(|e| e.direct.is_some());
        let data_len = if direct.is_some() && sends_direct && window == u64::from(MIN_RING_DATA) {
            MIN_RING_DATA
        } else {
            self.ring_data()
        };
        let made = self.shadow_ring(src, dst, route, i, (window, data_len));
        match made {
            Ok(mut resp) => {
                // The receiver's listener is on its host's address (the one we reach it at).
                if let (Response::Connected { direct: d, .. }, Some(p), Some(h)) =
                    (&mut resp, direct, &self.hosts)
                {
                    *d = Some(std::net::SocketAddr::new(h.plan.hosts[i].address.ip(), p));
                }
                self.reply(client, &resp, &[]);
            }
            Err((kind, message)) => {
                self.routes.out.remove(&route);
                if let Some(h) = self.hosts.as_mut() {
                    h.send_to(i, &HostMsg::CloseRoute { route });
                }
                self.reply(client, &Response::Error { kind, message }, &[]);
            }
        }
    }

    fn shadow_ring(
        &mut self,
        src: (u32, u32),
        dst: (u32, u32),
        route: u64,
        host: usize,
        (window, data_len): (u64, u32),
    ) -> Result<Response, (ErrorKind, String)> {
        if !self.endpoints.contains_key(&dst) {
            // The destination's stand-in here: an endpoint of the bridge (client 0) in the
            // node's shadow window, which the sender's ring is listed in.
            self.create_endpoint(0, dst.0, dst.1)?;
        }
        let m = self.ring_for_bridge(src, dst, data_len)?;
        let (dst_w, src_w) = (&m.dst_w, &m.src_w);
        let data_len = m.data_len;
        let cmd = (|| {
            let bell = Bell::new(
                Word32::at(src_w, m.credit_off + CREDIT_ARMED_OFF as u64)?,
                Word32::at(src_w, m.credit_off + CREDIT_SEQ_OFF as u64)?,
            );
            Ok::<_, crate::mem::MemError>(Cmd::AddOut {
                host,
                route,
                rx: Box::new(ShmReceiver::new(m.ring.clone()).with_bell(bell)),
                sender_closed: Word32::at(dst_w, m.ring_off + RING_SENDER_CLOSED_OFF as u64)?,
                window: window.min(u64::from(data_len)).max(1),
                bell: (
                    Word32::at(dst_w, m.dst_record_off + EP_ARMED_OFF as u64)?,
                    Word32::at(dst_w, m.dst_record_off + EP_DOORBELL_OFF as u64)?,
                ),
            })
        })();
        let (rid, resp) = (m.rid, m.resp);
        let cmd = match cmd {
            Ok(c) => c,
            Err(e) => {
                self.teardown_ring(rid);
                return Err((ErrorKind::Invalid, e.to_string()));
            }
        };
        if let Some(r) = self.routes.out.get_mut(&route) {
            r.ring = Some(rid);
        }
        self.routes.by_ring.insert(rid, RouteRef::Out(route));
        if let Some(h) = &self.hosts {
            h.bridge.send(cmd);
        }
        Ok(resp)
    }

    /// The bridge delivered an outbound route's end: its shadow ring goes.
    pub(super) fn route_note(&mut self, n: Note) {
        match n {
            Note::OutDone { route } => {
                if let Some(rid) = self.routes.out.get(&route).and_then(|r| r.ring) {
                    self.teardown_ring(rid);
                }
            }
            Note::LinkLost { host, why } => {
                let name = self
                    .hosts
                    .as_ref()
                    .map_or(String::new(), |h| h.plan.hosts[host].name.clone());
                self.say(&format!(
                    "datagram link to host '{name}' failed ({why}): its routes end"
                ));
                self.routes_host_gone(host);
            }
            n @ (Note::QpBroken { .. } | Note::PeerQpGone { .. } | Note::TellQpGone { .. }) => {
                self.qp_note(n)
            }
        }
    }

    /// A ring is being torn down: the route it carried ends on both sides.
    pub(super) fn route_ring_gone(&mut self, rid: u64) {
        let Some(r) = self.routes.by_ring.remove(&rid) else {
            return;
        };
        match r {
            RouteRef::Out(route) => {
                self.routes.out.remove(&route);
                if let Some(h) = &self.hosts {
                    h.bridge.send(Cmd::RemoveOut { route });
                }
            }
            RouteRef::In(i, route) => {
                // Only if the route is still this ring's: a host that restarted numbers its
                // routes afresh (from its clock), and a gone host's entries are dropped.
                if self.routes.inbound.get(&(i, route)) == Some(&rid) {
                    self.routes.inbound.remove(&(i, route));
                    if let Some(h) = self.hosts.as_mut() {
                        h.bridge.send(Cmd::RemoveIn { host: i, route });
                        h.send_to(i, &HostMsg::RouteClosed { route });
                    }
                }
            }
        }
    }

    /// An inbound route ends without its last datagrams (its host is gone, or gave it up):
    /// the ring is marked sender-closed so its receiver reads what arrived and retires it.
    fn end_inbound(&mut self, rid: u64) {
        self.close_ring_sender(rid);
        if let Some(RouteRef::In(i, route)) = self.routes.by_ring.get(&rid).copied() {
            if let Some(h) = &self.hosts {
                h.bridge.send(Cmd::RemoveIn { host: i, route });
            }
        }
    }

    /// Host `i` is gone: senders here see their channels to it closed; its senders' rings
    /// here end after what arrived; senders still waiting for a route are refused.
    pub(super) fn routes_host_gone(&mut self, i: usize) {
        let name = self
            .hosts
            .as_ref()
            .map_or(String::new(), |h| h.plan.hosts[i].name.clone());
        let outs: Vec<(u64, Option<u64>, u64)> = self
            .routes
            .out
            .iter()
            .filter(|(_, r)| r.host == i)
            .map(|(&k, r)| (k, r.ring, r.client))
            .collect();
        for (route, ring, client) in outs {
            match ring {
                Some(rid) => self.teardown_ring(rid),
                None => {
                    self.routes.out.remove(&route);
                    let message = format!("host '{name}' went away before it opened the route");
                    self.reply(
                        client,
                        &Response::Error {
                            kind: ErrorKind::NodeDown,
                            message,
                        },
                        &[],
                    );
                }
            }
        }
        let ins: Vec<((usize, u64), u64)> = self
            .routes
            .inbound
            .iter()
            .filter(|(k, _)| k.0 == i)
            .map(|(&k, &rid)| (k, rid))
            .collect();
        for (k, rid) in ins {
            self.end_inbound(rid);
            self.routes.inbound.remove(&k);
        }
    }

    /// Senders waiting too long for a route are refused.
    pub(super) fn routes_tick(&mut self, now: Instant) {
        let late: Vec<(u64, u64, usize)> = self
            .routes
            .out
            .iter()
            .filter(|(_, r)| r.ring.is_none() && now.duration_since(r.asked) > ROUTE_PATIENCE)
            .map(|(&k, r)| (k, r.client, r.host))
            .collect();
        for (route, client, host) in late {
            self.routes.out.remove(&route);
            let name = self
                .hosts
                .as_ref()
                .map_or(String::new(), |h| h.plan.hosts[host].name.clone());
            self.reply(
                client,
                &Response::Error {
                    kind: ErrorKind::NodeDown,
                    message: format!(
                        "host '{name}' did not open the route within {} s",
                        ROUTE_PATIENCE.as_secs()
                    ),
                },
                &[],
            );
        }
    }
}
