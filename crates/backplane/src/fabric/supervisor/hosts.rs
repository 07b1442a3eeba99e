//! The supervisor's side of a fabric across hosts: the link to the other hosts' supervisors
//! (UCX active messages, `backplane-ucx`), joining them, reporting this host's slots to them
//! every [`REPORT_PERIOD_MS`] (the heartbeat), and mirroring their slots in this host's node
//! table: a remote node is READY while its host says so and DOWN (`host-lost`) once its host
//! has been silent for [`LOST_AFTER_MS`]. Decisions about the file and the messages are the
//! sans-IO [`crate::fabric::hosts`]'s.
#![forbid(unsafe_code)]

use std::net::SocketAddr;

use backplane_ucx::{EpId, Event, Link};

use super::*;
use crate::fabric::hosts::{HostMsg, HostPlan, SlotReport, LOST_AFTER_MS, REPORT_PERIOD_MS};

/// How often a host listed before this one is dialled again while it does not answer.
const REDIAL: Duration = Duration::from_millis(250);
/// A dial not welcomed within this long is abandoned and tried again.
const DIAL_PATIENCE: Duration = Duration::from_millis(1500);
/// How long a refused join's endpoint stays open so the refusal reaches the other host.
const REFUSAL_LINGER: Duration = Duration::from_millis(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerState {
    /// Waiting for it to dial us (it is listed after this host), or to dial it again.
    Waiting,
    /// Dialled; waiting for its welcome.
    Dialing,
    Joined,
    /// It stopped answering.
    Lost,
    /// It refused us, or we refused it.
    Refused,
    /// It said goodbye (`down` on that host).
    Left,
}

struct Peer {
    ep: Option<EpId>,
    state: PeerState,
    heard: Instant,
    dialed: Option<Instant>,
    error: Option<String>,
    transports: Vec<String>,
    /// Its slots as it last reported them.
    remote: HashMap<u32, SlotReport>,
    /// What its senders had forwarded through each node (datagrams, bytes), as it last said.
    forwarded: HashMap<u32, (u64, u64)>,
}

impl HostLink {
    /// This supervisor ran nothing for a while: the joined hosts' silence is counted from
    /// `now` (they may have sent meanwhile; nobody read it).
    pub(super) fn grace(&mut self, now: Instant) {
        for p in &mut self.peers {
            if p.state == PeerState::Joined {
                p.heard = now;
            }
        }
    }
}

pub(super) struct HostLink {
    pub(super) plan: HostPlan,
    link: Link,
    peers: Vec<Peer>,
    /// Accepted endpoints that have not joined yet.
    pending: HashMap<EpId, Instant>,
    /// Endpoints to close once their last message had time to leave.
    closing: Vec<(EpId, Instant)>,
    last_report: Instant,
    started: Instant,
    /// The datagram bridge (its own thread and UCX link).
    pub(super) bridge: super::bridge::Bridge,
}

impl HostLink {
    /// `pace`: how the bridge holds back datagrams to other hosts (link emulation).
    pub(super) fn open(
        plan: HostPlan,
        pace: super::bridge::Pace,
        now: Instant,
    ) -> Result<Self, StartError> {
        let me = plan.this().clone();
        let link = Link::open(Some(me.address)).map_err(|e| {
            let words = backplane_ucx::status_string(e.status).to_ascii_lowercase();
            let hint = if words.contains("busy") {
                format!(
                    "is another fabric or program listening on port {}?",
                    me.address.port()
                )
            } else if words.contains("no such device") || words.contains("unreachable") {
                match std::env::var("UCX_TLS") {
                    Ok(tls) => format!(
                        "UCX_TLS={tls} leaves UCX no transport to listen with here (`ucx_info \
                         -d` lists this host's)"
                    ),
                    Err(_) => format!("is {} an address of this host?", me.address.ip()),
                }
            } else {
                format!("is {} an address of this host?", me.address.ip())
            };
            StartError::Hosts(format!(
                "host '{}': {e}: {hint} (hosts file {})",
                me.name, plan.file
            ))
        })?;
        super::keep_freed_memory();
        let bridge = super::bridge::Bridge::start(me.address.ip(), plan.me, pace)
            .map_err(|e| StartError::Hosts(format!("host '{}': datagram bridge: {e}", me.name)))?;
        let peers = plan
            .hosts
            .iter()
            .map(|_| Peer {
                ep: None,
                state: PeerState::Waiting,
                heard: now,
                dialed: None,
                error: None,
                transports: Vec::new(),
                remote: HashMap::new(),
                forwarded: HashMap::new(),
            })
            .collect();
        Ok(Self {
            plan,
            link,
            peers,
            pending: HashMap::new(),
            closing: Vec::new(),
            last_report: now,
            started: now,
            bridge,
        })
    }

    pub(super) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.link.fd()
    }

    /// Arms the wake-up fd: false if there is more to do before sleeping.
    pub(super) fn arm(&mut self) -> bool {
        self.link.arm()
    }

    fn peer_of(&self, ep: EpId) -> Option<usize> {
        self.peers.iter().position(|p| p.ep == Some(ep))
    }

    /// Sends to host `i` if it is joined (false otherwise).
    /// The next step reports this host's slots to the others (a slot changed).
    pub(super) fn report_soon(&mut self) {
        self.last_report = Instant::now() - Duration::from_millis(REPORT_PERIOD_MS);
    }

    pub(super) fn send_to(&mut self, i: usize, msg: &HostMsg) -> bool {
        match (
            self.peers.get(i).map(|p| p.state),
            self.peers.get(i).and_then(|p| p.ep),
        ) {
            (Some(PeerState::Joined), Some(ep)) => {
                self.send(ep, msg);
                true
            }
            _ => false,
        }
    }

    fn send(&mut self, ep: EpId, msg: &HostMsg) {
        // A send that fails is a peer that failed: its endpoint's error event follows.
        let _ = self.link.send(ep, &msg.encode());
    }

    /// Boot: Ok(true) once every host this one dials has welcomed it; the refusal or the
    /// unreachable host otherwise.
    pub(super) fn boot(&self, now: Instant) -> Result<bool, String> {
        let mut done = true;
        for (i, p) in self.peers.iter().enumerate() {
            if !self.plan.dials(i) || p.state == PeerState::Joined {
                continue;
            }
            let h = &self.plan.hosts[i];
            if p.state == PeerState::Refused {
                return Err(format!(
                    "host '{}' refused host '{}': {}",
                    h.name,
                    self.plan.this().name,
                    p.error.as_deref().unwrap_or("no reason given")
                ));
            }
            let patience = Duration::from_millis(self.plan.join_timeout_ms);
            if now.duration_since(self.started) > patience {
                return Err(format!(
                    "cannot reach host '{}' at {} within {:.1} s{}: start `backplane up --host {}` \
                     there first, or check its address in {}",
                    h.name,
                    h.address,
                    patience.as_secs_f64(),
                    p.error
                        .as_ref()
                        .map_or(String::new(), |e| format!(" (UCX: {e})")),
                    h.name,
                    self.plan.file
                ));
            }
            done = false;
        }
        Ok(done)
    }

    pub(super) fn status(&mut self, now: Instant) -> Vec<ctl::HostStatus> {
        let mut out = Vec::new();
        let order = std::iter::once(self.plan.me)
            .chain((0..self.peers.len()).filter(|&i| i != self.plan.me));
        for i in order {
            let h = &self.plan.hosts[i];
            let p = &self.peers[i];
            let state = if i == self.plan.me {
                "this host"
            } else {
                match p.state {
                    PeerState::Waiting => "waiting",
                    PeerState::Dialing => "dialing",
                    PeerState::Joined => "joined",
                    PeerState::Lost => "lost",
                    PeerState::Refused => "refused",
                    PeerState::Left => "left",
                }
            };
            out.push(ctl::HostStatus {
                name: h.name.clone(),
                address: h.address.to_string(),
                slots: h.slots.clone(),
                state: state.into(),
                transport: p.transports.clone(),
                heard_ms_ago: (i != self.plan.me && p.state == PeerState::Joined)
                    .then(|| now.duration_since(p.heard).as_millis() as u64),
                error: p.error.clone(),
            });
        }
        out
    }

    /// What a remote slot's host last reported of it.
    fn remote(&self, slot: u32) -> Option<&SlotReport> {
        self.plan
            .owner(slot)
            .and_then(|i| self.peers[i].remote.get(&slot))
    }

    /// The pid a remote slot's host reported (0: none, or a local slot).
    pub(super) fn remote_pid(&self, slot: u32) -> u32 {
        self.remote(slot).map_or(0, |r| r.pid)
    }

    /// What the other hosts' senders forwarded through `slot` (datagrams, bytes), as they
    /// last reported it.
    pub(super) fn forwarded_elsewhere(&self, slot: u32) -> (u64, u64) {
        self.peers
            .iter()
            .filter(|p| p.state == PeerState::Joined)
            .filter_map(|p| p.forwarded.get(&slot))
            .fold((0, 0), |(m, b), &(pm, pb)| {
                (m.saturating_add(pm), b.saturating_add(pb))
            })
    }

    /// The counters and open endpoints a remote slot's host reported.
    pub(super) fn remote_counters(&self, slot: u32) -> ([u64; 5], u32) {
        self.remote(slot)
            .map_or(([0; 5], 0), |r| (r.counters, r.endpoints))
    }

    /// Tells every joined host this one is going away, and gives the messages a moment to
    /// leave.
    pub(super) fn goodbye(&mut self) {
        let bye = HostMsg::Bye {
            host: self.plan.this().name.clone(),
        };
        let eps: Vec<EpId> = self
            .peers
            .iter()
            .filter(|p| p.state == PeerState::Joined)
            .filter_map(|p| p.ep)
            .collect();
        for ep in &eps {
            self.send(*ep, &bye);
        }
        let until = Instant::now() + Duration::from_millis(100);
        while !eps.is_empty() && Instant::now() < until {
            let _ = self.link.poll();
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// What the host link asks the supervisor to apply to a remote slot.
enum SlotChange {
    /// The node is (still) READY at this generation of its host.
    Ready(u32),
    Booting,
    Down(DownReason),
}

impl Sup {
    /// One round of the host link: its events, its deadlines, the periodic report.
    pub(super) fn hosts_step(&mut self, now: Instant) {
        let Some(mut h) = self.hosts.take() else {
            return;
        };
        let mut changes: Vec<(u32, SlotChange)> = Vec::new();
        let mut log: Vec<String> = Vec::new();
        // (With how many slot changes had been collected when the host was lost: those came
        // before the loss and are dropped; later ones, after a rejoin in the same batch, stay.)
        let mut lost_hosts: Vec<(usize, DownReason, usize)> = Vec::new();
        let mut route_msgs: Vec<(usize, HostMsg)> = Vec::new();
        for ev in h.link.poll() {
            match ev {
                Event::Accepted(ep) => {
                    h.pending.insert(ep, now);
                }
                Event::Message(Some(ep), bytes) => {
                    let msg = match HostMsg::decode(&bytes) {
                        Ok(m) => m,
                        Err(e) => {
                            log.push(format!("ignored {e}"));
                            continue;
                        }
                    };
                    if h.pending.remove(&ep).is_some() {
                        match h.plan.check_join(
                            &msg,
                            &self.cfg.name,
                            self.cfg.window_size,
                            &net_shape(&self.cfg),
                            &link_shape(&self.cfg),
                        ) {
                            Ok(i) => {
                                if let Some(old) = h.peers[i].ep.take() {
                                    h.link.close(old);
                                    if h.peers[i].state == PeerState::Joined {
                                        lost_hosts.push((i, DownReason::Exited, changes.len()));
                                    }
                                }
                                let p = &mut h.peers[i];
                                p.ep = Some(ep);
                                p.state = PeerState::Joined;
                                p.heard = now;
                                p.error = None;
                                p.remote.clear();
                                let welcome = HostMsg::Welcome {
                                    host: h.plan.this().name.clone(),
                                    data_port: h.bridge.port,
                                };
                                h.send(ep, &welcome);
                                h.last_report = now - Duration::from_millis(REPORT_PERIOD_MS);
                                log.push(format!("host '{}' joined", h.plan.hosts[i].name));
                            }
                            Err(reason) => {
                                log.push(format!("refused a host: {reason}"));
                                h.send(ep, &HostMsg::Refuse { reason });
                                h.closing.push((ep, now));
                            }
                        }
                        continue;
                    }
                    let Some(i) = h.peer_of(ep) else {
                        continue;
                    };
                    match msg {
                        HostMsg::Welcome { data_port, .. }
                            if h.peers[i].state == PeerState::Dialing =>
                        {
                            let addr = SocketAddr::new(h.plan.hosts[i].address.ip(), data_port);
                            h.bridge.send(super::bridge::Cmd::Dial { host: i, addr });
                            let p = &mut h.peers[i];
                            p.state = PeerState::Joined;
                            p.heard = now;
                            p.error = None;
                            p.remote.clear();
                            h.last_report = now - Duration::from_millis(REPORT_PERIOD_MS);
                            log.push(format!("joined host '{}'", h.plan.hosts[i].name));
                        }
                        HostMsg::Refuse { reason } => {
                            log.push(format!(
                                "host '{}' refused us ({:?} then): {reason}",
                                h.plan.hosts[i].name, h.peers[i].state
                            ));
                            if h.peers[i].state == PeerState::Joined {
                                lost_hosts.push((i, DownReason::HostLost, changes.len()));
                            }
                            let p = &mut h.peers[i];
                            p.state = PeerState::Refused;
                            p.error = Some(reason);
                            if let Some(ep) = p.ep.take() {
                                h.link.close(ep);
                            }
                        }
                        HostMsg::Slots {
                            slots, forwarded, ..
                        } if h.peers[i].state == PeerState::Joined => {
                            h.peers[i].heard = now;
                            // Counters only: any slot of the fabric, the latest word.
                            h.peers[i].forwarded = forwarded
                                .into_iter()
                                .filter(|&(slot, ..)| (1..=self.cfg.nodes).contains(&slot))
                                .map(|(slot, m, b)| (slot, (m, b)))
                                .collect();
                            for r in slots {
                                // Only the slots the file gives that host; anything else
                                // from the wire is ignored.
                                if h.plan.owner(r.slot) != Some(i) {
                                    continue;
                                }
                                let Some(st) = NodeState::from_u32(r.state) else {
                                    continue;
                                };
                                let reason = DownReason::from_u32(r.reason)
                                    .filter(|&r| r != DownReason::None)
                                    .unwrap_or(DownReason::Exited);
                                h.peers[i].remote.insert(r.slot, r);
                                match st {
                                    NodeState::Ready => {
                                        changes.push((r.slot, SlotChange::Ready(r.generation)))
                                    }
                                    NodeState::Booting => {
                                        changes.push((r.slot, SlotChange::Booting))
                                    }
                                    NodeState::Down => {
                                        changes.push((r.slot, SlotChange::Down(reason)))
                                    }
                                    NodeState::Empty => {}
                                }
                            }
                        }
                        HostMsg::Bye { .. } => {
                            log.push(format!("host '{}' shut down", h.plan.hosts[i].name));
                            lost_hosts.push((i, DownReason::Shutdown, changes.len()));
                            h.peers[i].state = PeerState::Left;
                            if let Some(ep) = h.peers[i].ep.take() {
                                h.closing.push((ep, now));
                            }
                        }
                        m @ (HostMsg::OpenRoute { .. }
                        | HostMsg::RouteOpened { .. }
                        | HostMsg::RouteRefused { .. }
                        | HostMsg::RouteClosed { .. }
                        | HostMsg::CloseRoute { .. }
                        | HostMsg::OpenQp { .. }
                        | HostMsg::QpOpened { .. }
                        | HostMsg::QpRefused { .. }
                        | HostMsg::QpGone { .. }
                        | HostMsg::GrantMr { .. }
                        | HostMsg::GrantDma { .. }
                        | HostMsg::MrOpened { .. }
                        | HostMsg::MrRefused { .. })
                            if h.peers[i].state == PeerState::Joined =>
                        {
                            route_msgs.push((i, m));
                        }
                        _ => {}
                    }
                }
                Event::Message(None, _) => {}
                Event::Failed(ep, e) => {
                    if h.pending.remove(&ep).is_some() {
                        h.link.close(ep);
                    } else if let Some(i) = h.peer_of(ep) {
                        let name = h.plan.hosts[i].name.clone();
                        let p = &mut h.peers[i];
                        p.ep = None;
                        p.error = Some(crate_ucx_words(&e));
                        if p.state == PeerState::Joined {
                            p.state = PeerState::Lost;
                            lost_hosts.push((i, DownReason::HostLost, changes.len()));
                            log.push(format!("host '{name}' lost: {}", crate_ucx_words(&e)));
                        } else if p.state == PeerState::Dialing {
                            p.state = PeerState::Waiting;
                        }
                        h.link.close(ep);
                    }
                }
                Event::Dropped(_, len) => log.push(format!("dropped a {len}-byte host message")),
            }
        }
        // Deadlines.
        for i in 0..h.peers.len() {
            if i == h.plan.me {
                continue;
            }
            let p = &h.peers[i];
            if p.state == PeerState::Joined
                && now.duration_since(p.heard) > Duration::from_millis(LOST_AFTER_MS)
            {
                log.push(format!(
                    "host '{}' lost: silent for {} ms",
                    h.plan.hosts[i].name,
                    now.duration_since(p.heard).as_millis()
                ));
                lost_hosts.push((i, DownReason::HostLost, changes.len()));
                let p = &mut h.peers[i];
                p.state = PeerState::Lost;
                p.error = Some("stopped answering".into());
                if let Some(ep) = p.ep.take() {
                    h.link.close(ep);
                }
                continue;
            }
            if p.state == PeerState::Dialing
                && p.dialed
                    .is_some_and(|d| now.duration_since(d) > DIAL_PATIENCE)
            {
                let p = &mut h.peers[i];
                p.state = PeerState::Waiting;
                p.error.get_or_insert_with(|| "no answer".into());
                if let Some(ep) = p.ep.take() {
                    h.link.close(ep);
                }
            }
            let p = &h.peers[i];
            let again = match p.state {
                PeerState::Refused => REDIAL * 8,
                _ => REDIAL,
            };
            let due = p.dialed.is_none_or(|d| now.duration_since(d) >= again);
            if h.plan.dials(i) && p.ep.is_none() && p.state != PeerState::Joined && due {
                let addr = h.plan.hosts[i].address;
                let join = h.plan.join(
                    &self.cfg.name,
                    self.cfg.window_size,
                    net_shape(&self.cfg),
                    link_shape(&self.cfg),
                );
                h.peers[i].dialed = Some(now);
                match h.link.connect(addr) {
                    Ok(ep) => {
                        // A refused host is asked again too (its file may have been fixed).
                        h.peers[i].ep = Some(ep);
                        h.peers[i].state = PeerState::Dialing;
                        h.send(ep, &join);
                    }
                    Err(e) => h.peers[i].error = Some(crate_ucx_words(&e)),
                }
            }
        }
        h.pending.retain(|&ep, &mut t| {
            let keep = now.duration_since(t) < Duration::from_secs(5);
            if !keep {
                h.closing.push((ep, now));
            }
            keep
        });
        let (due, keep): (Vec<_>, Vec<_>) = h
            .closing
            .drain(..)
            .partition(|&(_, t)| now.duration_since(t) >= REFUSAL_LINGER);
        h.closing = keep;
        for (ep, _) in due {
            h.link.close(ep);
        }
        // The periodic report (also the heartbeat), and what UCX chose for each link.
        if now.duration_since(h.last_report) >= Duration::from_millis(REPORT_PERIOD_MS) {
            h.last_report = now;
            let slots: Vec<SlotReport> = self
                .cfg
                .local_slots()
                .into_iter()
                .map(|slot| {
                    let (counters, endpoints) = self.slot_counters(slot);
                    SlotReport {
                        slot,
                        state: self.life[slot as usize - 1].state() as u32,
                        generation: self.life[slot as usize - 1].generation(),
                        reason: self.read_reason(slot) as u32,
                        pid: self.agent_pid(slot),
                        counters,
                        endpoints,
                    }
                })
                .collect();
            let forwarded = match &self.cfg.topology {
                Some(_) => (1..=self.cfg.nodes)
                    .map(|slot| {
                        let (m, b) = self.own_forwarded(slot);
                        (slot, m, b)
                    })
                    .filter(|&(_, m, _)| m != 0)
                    .collect(),
                None => Vec::new(),
            };
            let msg = HostMsg::Slots {
                host: h.plan.this().name.clone(),
                slots,
                forwarded,
            };
            for i in 0..h.peers.len() {
                if h.peers[i].state != PeerState::Joined {
                    continue;
                }
                if let Some(ep) = h.peers[i].ep {
                    h.send(ep, &msg);
                    let t = h.link.transports(ep);
                    if !t.is_empty() && t != h.peers[i].transports {
                        log.push(format!(
                            "host '{}' over {}",
                            h.plan.hosts[i].name,
                            t.join(", ")
                        ));
                        h.peers[i].transports = t;
                    }
                }
            }
        }
        for &(i, reason, _) in &lost_hosts {
            // (A host that rejoined before it was missed — `Exited` here — keeps the data
            // link its new incarnation's bridge may already have made; its old routes are
            // dropped one by one below.)
            if reason != DownReason::Exited {
                h.bridge.send(super::bridge::Cmd::Forget { host: i });
            }
        }
        // Whatever the path out of Joined was, a host that is not joined has no node up here.
        for i in 0..h.peers.len() {
            if i == h.plan.me
                || h.peers[i].state == PeerState::Joined
                || lost_hosts.iter().any(|&(l, _, _)| l == i)
            {
                continue;
            }
            let up = h.plan.hosts[i].slots.iter().any(|&s| {
                matches!(
                    self.life[s as usize - 1].state(),
                    NodeState::Ready | NodeState::Booting
                )
            });
            if up {
                log.push(format!(
                    "host '{}' is {:?} but its nodes were up here: DOWN",
                    h.plan.hosts[i].name, h.peers[i].state
                ));
                lost_hosts.push((i, DownReason::HostLost, changes.len()));
            }
        }
        let notes = h.bridge.notes();
        let owners: Vec<Vec<u32>> = lost_hosts
            .iter()
            .map(|&(i, _, _)| h.plan.hosts[i].slots.clone())
            .collect();
        let changes: Vec<(u32, SlotChange)> = changes
            .into_iter()
            .enumerate()
            .filter(|(k, (slot, _))| {
                !lost_hosts
                    .iter()
                    .any(|&(i, _, mark)| *k < mark && h.plan.owner(*slot) == Some(i))
            })
            .map(|(_, c)| c)
            .collect();
        self.hosts = Some(h);
        for m in log {
            self.say(&m);
        }
        for &(i, _, _) in &lost_hosts {
            self.routes_host_gone(i);
            self.qps_host_gone(i);
        }
        for n in notes {
            self.route_note(n);
        }
        for (i, m) in route_msgs {
            self.route_msg(i, m);
        }
        for ((_, reason, _), slots) in lost_hosts.iter().zip(owners) {
            for slot in slots {
                let t = self.life[slot as usize - 1].lost(*reason);
                self.apply(slot, t);
            }
        }
        for (slot, c) in changes {
            self.apply_remote(slot, c, now);
        }
    }

    /// Mirrors a remote node's state in this host's node table. Its generation here is this
    /// host's own count (bumped on every READY), so a node that restarted on its host, or
    /// whose host came back, is a new generation here too.
    fn apply_remote(&mut self, slot: u32, c: SlotChange, now: Instant) {
        let i = slot as usize - 1;
        let state = self.life[i].state();
        match c {
            SlotChange::Ready(remote_gen) => {
                let seen = self.remote_gen.get(&slot).copied();
                if state == NodeState::Ready && seen == Some(remote_gen) {
                    return;
                }
                if state == NodeState::Ready {
                    let t = self.life[i].lost(DownReason::Exited);
                    self.apply(slot, t);
                }
                let t = self.life[i].spawned(now);
                self.apply(slot, t);
                let t = self.life[i].ready(now, 0);
                self.apply(slot, t);
                self.remote_gen.insert(slot, remote_gen);
            }
            SlotChange::Booting => {
                if state == NodeState::Ready {
                    let t = self.life[i].lost(DownReason::Exited);
                    self.apply(slot, t);
                }
                if self.life[i].state() != NodeState::Booting {
                    let t = self.life[i].spawned(now);
                    self.apply(slot, t);
                }
            }
            SlotChange::Down(reason) => {
                let t = self.life[i].lost(reason);
                self.apply(slot, t);
            }
        }
    }

    /// The refusal for a request that names a node on another host.
    pub(super) fn remote_refusal(&self, slot: u32) -> Result<(), (ErrorKind, String)> {
        match &self.hosts {
            Some(h) if slot >= 1 && slot <= self.cfg.nodes && !h.plan.is_local(slot) => {
                Err(remote_refusal(&h.plan, slot))
            }
            _ => Ok(()),
        }
    }
}

/// Why a node on another host cannot be used from this one (yet).
pub(super) fn remote_refusal(plan: &HostPlan, slot: u32) -> (ErrorKind, String) {
    let host = plan
        .owner(slot)
        .map_or("another host", |i| plan.hosts[i].name.as_str());
    (
        ErrorKind::Invalid,
        format!(
            "node {slot} runs on host '{host}': RC/UC queue pairs, memory grants and DMA between \
             hosts are not carried yet (datagrams and UD queue pairs are); use nodes of host \
             '{}' ({})",
            plan.this().name,
            plan.this()
                .slots
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )
}

/// IP over the fabric as the hosts compare it.
fn net_shape(cfg: &Config) -> Option<String> {
    cfg.net
        .map(|p| format!("{}/{} mtu {}", p.network, p.prefix, p.mtu))
}

/// The emulated link as the hosts compare it: the model and how the switch forwards, or a
/// distributed topology's links and their models (a star file is a `--link`).
fn link_shape(cfg: &Config) -> Option<String> {
    if let Some(t) = &cfg.topology {
        let links: Vec<String> = t
            .links
            .iter()
            .map(|l| {
                let mode = if l.model.store_and_forward {
                    "store-and-forward"
                } else {
                    "cut-through"
                };
                format!("{}-{} {} {mode}", l.a, l.b, l.model.name)
            })
            .collect();
        return Some(format!("topology: links {}", links.join(", ")));
    }
    cfg.link.as_ref().map(|l| {
        let mode = if l.store_and_forward {
            "store-and-forward"
        } else {
            "cut-through"
        };
        format!("{} {mode}", l.name)
    })
}

fn crate_ucx_words(e: &backplane_ucx::Error) -> String {
    backplane_ucx::status_string(e.status)
}
