//! The supervisor: the one process that keeps a fabric. It owns the control region and every
//! window (memfds), spawns one agent per node, watches their liveness (pidfd for death,
//! heartbeat for hangs), serves the control socket (grants, binds, connects, status), and on
//! shutdown removes everything it created.
//!
//! Single-threaded: one `poll` loop over the listener, client sockets and agent pidfds, with a
//! 50 ms tick for heartbeats, restarts and allocator quarantine. The life-cycle decisions are
//! made by the sans-IO [`NodeLife`]; the supervisor only applies them.
//!
//! Rooms: this file holds the state (`Sup`), start-up and the event loop (poll, tick, request
//! dispatch); `config` what `up` asks for and its checks; `lock` the run directory and its
//! lock; `nodes` agents and the node table (spawn, entries, windows, DOWN); `rings` the ring
//! broker (bind, connect, routes, teardown); `status` the status report; `service` the
//! interface of the verbs registry the supervisor hosts (which lives with the verbs, in
//! `crate::verbs::registry`).

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::alloc::WindowAlloc;
use super::ctl::{self, ErrorKind, Request, Response, SlotStatus, StatusReport};
use super::life::{NodeLife, Transition};
use super::{fabric_dir, validate_name, FabricError, LOCK_FILE, SOCKET_FILE};
use crate::fabric::netns::{self as net, NetPlan};
use crate::mem::Region;
use crate::sync::{self, fence, Ordering};
use crate::wire::{self, *};

mod bridge;
mod config;
mod hosts;
mod lock;
pub(crate) mod mirror;
mod nodes;
mod qps;
mod rings;
mod routes;
mod service;
mod status;

use service::HostView;
pub use service::{Failure, GrantAsk, Host, NoService, QpSide, RemoteGrant, Service};

use config::os;
pub use config::{check_config, Config, StartError};
pub use lock::{is_running, lock_fabric, FabricLock};

/// First port handed out for `bind(0)`.
pub const EPHEMERAL_BASE: u32 = 49152;
/// How long `up` waits for every node to become READY.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(30);
const TICK: Duration = Duration::from_millis(50);
/// A round of the loop this long after the last one means this supervisor itself was not
/// running (the machine paused its processes, or it was stopped): the nodes' heartbeats and
/// the other hosts' reports are timed from the end of the pause, not from before it. (On a
/// loaded 2-vCPU VM a pause of ~1 s made a supervisor declare its own node hung and the other
/// host lost at once, breaking every queue pair between the hosts.)
const STALLED: Duration = Duration::from_millis(250);

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

struct Agent {
    child: Child,
    pidfd: OwnedFd,
}

struct Client {
    sock: OwnedFd,
    pid: u32,
    agent_slot: Option<u32>,
    endpoints: Vec<(u32, u32)>,
}

struct Ep {
    record_off: u64,
    client: u64,
    generation: u32,
    /// Occupancy of the record's ring list, kept here: the copy in shared memory is only
    /// ever written by us, never read back (a peer may have scribbled on it).
    list: Vec<bool>,
    rings_in: Vec<u64>,
    rings_out: Vec<u64>,
    /// Its direct listener's TCP port (fabrics across hosts, `Bind.direct`).
    direct: Option<u16>,
}

struct RingInfo {
    /// Intermediate nodes the ring's traffic is forwarded through (distributed topologies).
    via: Vec<u32>,
    src: (u32, u32),
    dst: (u32, u32),
    ring_off: u64,
    /// Its data area's size.
    data_len: u32,
    credit_off: u64,
    list_index: u32,
}

struct Sup {
    cfg: Config,
    created: Instant,
    /// When the loop last looked at the clock (see [`STALLED`]; `None` before its first round).
    last_round: Option<Instant>,
    control: Region,
    windows: Vec<Arc<Region>>,
    allocs: Vec<WindowAlloc>,
    life: Vec<NodeLife>,
    since: Vec<u64>,
    agents: Vec<Option<Agent>>,
    clients: HashMap<u64, Client>,
    next_client: u64,
    endpoints: HashMap<(u32, u32), Ep>,
    rings: HashMap<u64, RingInfo>,
    next_ring: u64,
    next_ephemeral: u32,
    totals: Vec<[u64; 5]>,
    net_ready: Vec<bool>,
    log: File,
    stopping: bool,
    /// The verbs registry (or [`NoService`]), given to [`run`].
    verbs: Box<dyn Service>,
    /// Each node's state and generation for accelerated sockets (none if the file could not
    /// be made: connections then outlive a node's restart as the kernel's TCP would).
    accel_nodes: Option<crate::fabric::accel::NodeWords>,
    /// A fabric across hosts: the link to the other hosts' supervisors.
    hosts: Option<hosts::HostLink>,
    /// The generation each remote node last had on its own host.
    remote_gen: HashMap<u32, u32>,
    /// Datagram routes to and from other hosts.
    routes: routes::Routes,
    qps: qps::QpLinks,
}

/// Set by SIGTERM, SIGINT or SIGHUP; the event loop (whose `poll` has a timeout and is never
/// restarted after a signal) sees it and shuts down.
fn signalled() -> &'static Arc<AtomicBool> {
    static FLAG: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();
    FLAG.get_or_init(|| Arc::new(AtomicBool::new(false)))
}

fn install_signal_handlers() {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    for sig in [SIGTERM, SIGINT, SIGHUP] {
        // Cannot fail for these signals (only the forbidden ones, such as SIGKILL, are refused).
        let _ = signal_hook::flag::register(sig, Arc::clone(signalled()));
    }
    // SAFETY: ignoring SIGPIPE is always sound; writes to closed sockets then return EPIPE.
    // (signal-hook has no call that ignores a signal; the CLI's `main` restores the default.)
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
}

/// Keeps freed heap memory in the process rather than handing it back to the kernel: the
/// bridge of a fabric across hosts receives and sends messages of up to 4 MiB, and UCX
/// assembles each in a fresh allocation. With glibc's defaults every such buffer was trimmed
/// from the thread's arena (`madvise`) or `munmap`ped when freed and faulted in and zeroed
/// again by the next message: 11 % of all CPU time in a 1 MiB datagram stream between two
/// hosts went to page faults. Fixed thresholds keep the pages (and end glibc's dynamic ones).
fn keep_freed_memory() {
    // SAFETY: mallopt only sets allocator parameters; any values are valid, and a refusal
    // (return 0) leaves the defaults, which are correct, only slower.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// Runs a supervisor until the fabric is shut down. `ready` gets one line when every node is
/// READY ("ready") or boot failed ("error: ..."), then is closed.
///
/// `verbs` serves the verbs part of the control protocol (regions, grants, QP blocks): the
/// binary passes `backplane::verbs::registry::Registry`; [`NoService`] refuses it all.
pub fn run(
    cfg: Config,
    lock: FabricLock,
    ready: Option<File>,
    log: File,
    verbs: Box<dyn Service>,
) -> Result<(), StartError> {
    install_signal_handlers();
    let mut ready = ready;
    let result = run_inner(cfg, &lock, &mut ready, log, verbs);
    if let Err(e) = &result {
        if let Some(mut r) = ready.take() {
            let _ = writeln!(r, "error: {e}");
        }
    }
    lock.remove_dir();
    result
}

fn run_inner(
    cfg: Config,
    lock: &FabricLock,
    ready: &mut Option<File>,
    log: File,
    verbs: Box<dyn Service>,
) -> Result<(), StartError> {
    check_config(&cfg)?;
    if cfg.hosts.is_some() {
        let slots: Vec<String> = cfg.local_slots().iter().map(u32::to_string).collect();
        std::fs::write(lock.dir.join(net::SLOTS_FILE), slots.join(" ") + "\n")
            .map_err(os("cannot write the fabric's slot list"))?;
    }
    let now = Instant::now();
    let control = Region::create(
        &format!("bp-{}-control", cfg.name),
        control_region_size(cfg.nodes).div_ceil(4096) * 4096,
    )
    .map_err(|e| StartError::Boot(e.to_string()))?;
    let mut windows = Vec::new();
    for slot in 1..=cfg.nodes {
        let w = Region::create(
            &format!("bp-{}-win{slot}", cfg.name),
            cfg.window_size as usize,
        )
        .map_err(|e| StartError::Boot(e.to_string()))?;
        windows.push(Arc::new(w));
    }
    let mut hdr = vec![0u8; NODE_TABLE_OFF];
    FabricHeaderRepr {
        nodes: cfg.nodes,
        window_size: cfg.window_size,
        created_ms: now_ms(),
        supervisor_pid: std::process::id(),
        name: cfg.name.clone(),
        link: cfg.link.clone(),
        spans_hosts: cfg.hosts.is_some(),
    }
    .emit(&mut FabricHeader::new_unchecked(&mut hdr[..]));
    publish(&control, 0, &hdr, FABRIC_INIT_OFF);

    let listener = bind_listener(&lock.dir.join(SOCKET_FILE))?;
    let hosts = match &cfg.hosts {
        Some(plan) => {
            let pace = match (&cfg.link, &cfg.topology) {
                (_, Some(_)) => bridge::Pace::Route,
                (Some(l), None) => bridge::Pace::Link(l.bytes_per_s.max(1)),
                (None, None) => bridge::Pace::Memory,
            };
            Some(hosts::HostLink::open(plan.clone(), pace, now)?)
        }
        None => None,
    };
    let accel_nodes = crate::fabric::accel::NodeWords::create(&cfg.name, cfg.nodes).ok();
    let mut sup = Sup {
        last_round: None,
        allocs: (0..cfg.nodes)
            .map(|_| WindowAlloc::new(WINDOW_HEAP_OFF, cfg.window_size))
            .collect(),
        life: (0..cfg.nodes).map(|_| NodeLife::new(now)).collect(),
        since: vec![now_ms(); cfg.nodes as usize],
        agents: (0..cfg.nodes).map(|_| None).collect(),
        totals: vec![[0; 5]; cfg.nodes as usize],
        net_ready: vec![false; cfg.nodes as usize],
        cfg,
        created: now,
        control,
        windows,
        clients: HashMap::new(),
        next_client: 1,
        endpoints: HashMap::new(),
        rings: HashMap::new(),
        next_ring: 1,
        next_ephemeral: EPHEMERAL_BASE,
        log,
        stopping: false,
        verbs,
        accel_nodes,
        hosts,
        remote_gen: HashMap::new(),
        routes: routes::Routes::new(),
        qps: qps::QpLinks::new(),
    };
    if lock.stale {
        sup.say("removed what a crashed supervisor left behind");
    }
    if let Some(plan) = sup.cfg.net {
        net::cleanup(&sup.cfg.name);
        for slot in sup.cfg.local_slots() {
            if let Err(e) = net::create_node_netns(&sup.cfg.name, slot, &plan, sup.cfg.nodes) {
                net::cleanup(&sup.cfg.name);
                return Err(StartError::Net {
                    slot,
                    message: e.to_string(),
                });
            }
        }
    }
    // For UCX's InfiniBand transports over the drop-in libibverbs (see the function).
    let _ = net::create_verbs_device_node(&sup.cfg.name);
    for slot in 1..=sup.cfg.nodes {
        sup.write_entry(slot, DownReason::None);
        if !sup.cfg.is_local(slot) {
            continue; // another host runs it: its entry follows what that host reports
        }
        if let Err(e) = sup.spawn_agent(slot) {
            sup.shutdown_all();
            return Err(e);
        }
    }
    let boot_deadline = Instant::now() + BOOT_TIMEOUT;
    let mut booted = false;
    let mut buf = Vec::new();
    loop {
        if signalled().load(std::sync::atomic::Ordering::Relaxed) {
            sup.say("signal received: shutting down");
            sup.stopping = true;
        }
        if sup.stopping {
            break;
        }
        if !booted {
            let net_up = sup.cfg.net.is_none()
                || sup
                    .cfg
                    .local_slots()
                    .iter()
                    .all(|&s| sup.net_ready[s as usize - 1]);
            let joined = match sup.hosts.as_ref().map(|h| h.boot(Instant::now())) {
                None => true,
                Some(Ok(done)) => done,
                Some(Err(msg)) => {
                    sup.say(&msg);
                    sup.shutdown_all();
                    return Err(StartError::Hosts(msg));
                }
            };
            let local_ready = sup
                .cfg
                .local_slots()
                .iter()
                .all(|&s| sup.life[s as usize - 1].state() == NodeState::Ready);
            if net_up && joined && local_ready {
                booted = true;
                if let Some(mut r) = ready.take() {
                    let _ = writeln!(r, "ready");
                }
            } else if let Some(slot) = sup.first_down_during_boot() {
                let msg = format!(
                    "node {slot} failed to boot (its agent exited; see {})",
                    lock.dir.join(super::LOG_FILE).display()
                );
                sup.shutdown_all();
                return Err(StartError::Boot(msg));
            } else if Instant::now() > boot_deadline {
                sup.shutdown_all();
                return Err(StartError::Boot(format!(
                    "nodes did not become READY within {}s",
                    BOOT_TIMEOUT.as_secs()
                )));
            }
        }
        sup.poll_once(&listener, &mut buf, booted);
    }
    sup.shutdown_all();
    Ok(())
}

fn bind_listener(path: &Path) -> Result<OwnedFd, StartError> {
    use rustix::net::{
        bind, listen, socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType,
    };
    let sock = socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| os("cannot create the control socket")(e.into()))?;
    let addr = SocketAddrUnix::new(path).map_err(|e| os("control socket path")(e.into()))?;
    bind(&sock, &addr).map_err(|e| os(format!("cannot bind {}", path.display()))(e.into()))?;
    listen(&sock, 128).map_err(|e| os("cannot listen on the control socket")(e.into()))?;
    Ok(sock)
}

/// Writes a static header into shared memory with its `initialized` marker published last.
pub fn publish(region: &Region, off: u64, bytes: &[u8], init_off: usize) {
    let mut body = bytes.to_vec();
    body[init_off..init_off + 4].fill(0);
    region
        .write(off, &body)
        .expect("supervisor-computed offset");
    let mark = region
        .u32_at(off + init_off as u64)
        .expect("aligned marker");
    // SYNC POINT header-init (release): the header is complete before the marker is seen.
    mark.store(INIT_MARK, Ordering::Release);
}

impl Sup {
    fn say(&mut self, msg: &str) {
        let _ = writeln!(
            self.log,
            "[{:.3}] {msg}",
            self.created.elapsed().as_secs_f64()
        );
    }

    fn win(&self, slot: u32) -> &Region {
        &self.windows[slot as usize - 1]
    }

    fn shutdown_all(&mut self) {
        if let Some(mut h) = self.hosts.take() {
            h.goodbye();
        }
        for slot in 1..=self.cfg.nodes {
            let t = self.life[slot as usize - 1].shutdown();
            self.apply(slot, t);
        }
        for a in self.agents.iter_mut().flatten() {
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(a.child.id() as i32).expect("pid"),
                rustix::process::Signal::TERM,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        for a in self.agents.iter_mut().flatten() {
            loop {
                match a.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() > deadline => {
                        let _ = a.child.kill();
                        let _ = a.child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        }
        // (The namespaces, if any, and the verbs device node.)
        net::cleanup(&self.cfg.name);
        self.say("fabric stopped");
    }

    fn poll_once(&mut self, listener: &OwnedFd, buf: &mut Vec<u8>, booted: bool) {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let client_ids: Vec<u64> = self.clients.keys().copied().collect();
        let agent_slots: Vec<u32> = (1..=self.cfg.nodes)
            .filter(|&s| self.agents[s as usize - 1].is_some())
            .collect();
        // The host link's wake-up fd may only be slept on once armed; if it cannot be armed
        // there is host traffic to take first.
        let link_busy = self.hosts.as_mut().is_some_and(|h| !h.arm());
        let ready_flags;
        {
            let mut fds = Vec::with_capacity(2 + client_ids.len() + agent_slots.len());
            fds.push(PollFd::new(listener, PollFlags::IN));
            for id in &client_ids {
                fds.push(PollFd::new(&self.clients[id].sock, PollFlags::IN));
            }
            for &s in &agent_slots {
                let a = self.agents[s as usize - 1].as_ref().expect("filtered");
                fds.push(PollFd::new(&a.pidfd, PollFlags::IN));
            }
            let link_fd = self.hosts.as_ref().map(|h| h.fd());
            if let Some(fd) = &link_fd {
                fds.push(PollFd::new(fd, PollFlags::IN));
            }
            let wait = if link_busy { Duration::ZERO } else { TICK };
            let ts = Timespec::try_from(wait).expect("tick fits");
            let _ = poll(&mut fds, Some(&ts));
            ready_flags = fds.iter().map(|f| f.revents()).collect::<Vec<_>>();
        }
        let now = Instant::now();
        let gap = self
            .last_round
            .replace(now)
            .map_or(Duration::ZERO, |t| now.duration_since(t));
        if gap > STALLED {
            for l in &mut self.life {
                l.grace(now);
            }
            if let Some(h) = self.hosts.as_mut() {
                h.grace(now);
            }
            self.say(&format!(
                "this supervisor ran nothing for {} ms: the nodes' and hosts' silences are \
                 counted from now",
                gap.as_millis()
            ));
        }
        // Deaths first: they are what peers must see fastest.
        for (i, &slot) in agent_slots.iter().enumerate() {
            if !ready_flags[1 + client_ids.len() + i].is_empty() {
                if let Some(mut a) = self.agents[slot as usize - 1].take() {
                    let status = a.child.wait().ok();
                    self.say(&format!(
                        "node {slot}: agent {} exited ({status:?})",
                        a.child.id()
                    ));
                }
                let delay = if booted { self.cfg.restart_delay } else { None };
                let t = self.life[slot as usize - 1].exited(now, delay);
                self.apply(slot, t);
            }
        }
        if ready_flags[0].contains(PollFlags::IN) {
            if let Ok(sock) = rustix::net::accept_with(listener, rustix::net::SocketFlags::CLOEXEC)
            {
                let id = self.next_client;
                self.next_client += 1;
                self.clients.insert(
                    id,
                    Client {
                        sock,
                        pid: 0,
                        agent_slot: None,
                        endpoints: Vec::new(),
                    },
                );
            }
        }
        for (i, id) in client_ids.iter().enumerate() {
            if ready_flags[1 + i].is_empty() {
                continue;
            }
            let msg = match self.clients.get(id) {
                Some(c) => ctl::recv::<Request>(c.sock.as_fd(), buf),
                None => continue,
            };
            match msg {
                Ok(Some((Request::Service(v), fds))) => self.handle_service(*id, v, fds),
                Ok(Some((req, _fds))) => self.handle(*id, req),
                Ok(None) | Err(_) => self.drop_client(*id),
            }
        }
        self.hosts_step(now);
        self.routes_tick(now);
        self.qps_tick(now);
        self.tick(now);
    }

    fn tick(&mut self, now: Instant) {
        for slot in 1..=self.cfg.nodes {
            if !self.cfg.is_local(slot) {
                continue;
            }
            let i = slot as usize - 1;
            let beat = self
                .win(slot)
                .u64_at(WIN_HEARTBEAT_OFF as u64)
                .map(|a| a.load(Ordering::Relaxed))
                .unwrap_or(0);
            let alive = self.agents[i].is_some();
            for t in self.life[i].tick(now, beat, alive) {
                self.apply(slot, Some(t));
            }
            if self.life[i].restart_due(now) && !self.stopping {
                if let Err(e) = self.spawn_agent(slot) {
                    self.say(&format!("node {slot}: restart failed: {e}"));
                }
            }
        }
    }

    fn drop_client(&mut self, id: u64) {
        let Some(c) = self.clients.get(&id) else {
            return;
        };
        let eps = c.endpoints.clone();
        for key in eps {
            self.close_endpoint(key);
        }
        self.with_service(|s, h| s.client_gone(h, id));
        self.dma_client_gone(id);
        self.clients.remove(&id);
    }

    fn reply(&mut self, id: u64, resp: &Response, fds: &[std::os::fd::BorrowedFd<'_>]) {
        let Some(c) = self.clients.get(&id) else {
            return;
        };
        let r = ctl::send(c.sock.as_fd(), resp, fds);
        if r.is_err() {
            self.drop_client(id);
        }
    }

    fn handle(&mut self, id: u64, req: Request) {
        // A datagram channel to a node on another host is answered once that host opened
        // its end of the route (or refused it).
        if let Request::Connect {
            src_slot,
            src_port,
            dst_slot,
            dst_port,
        } = req
        {
            let remote = self.hosts.as_ref().is_some_and(|h| {
                dst_slot >= 1 && dst_slot <= self.cfg.nodes && !h.plan.is_local(dst_slot)
            });
            if remote {
                match self.open_route(id, (src_slot, src_port), (dst_slot, dst_port)) {
                    Ok(Some(resp)) => self.reply(id, &resp, &[]),
                    Ok(None) => {}
                    Err((kind, message)) => self.reply(id, &Response::Error { kind, message }, &[]),
                }
                return;
            }
        }
        let result = self.serve(id, req);
        match result {
            Ok((resp, fd)) => {
                let fds: Vec<_> = fd.iter().map(|r| r.fd()).collect();
                self.reply(id, &resp, &fds);
            }
            Err((kind, message)) => self.reply(id, &Response::Error { kind, message }, &[]),
        }
    }

    fn ready_slot(&self, slot: u32) -> Result<(), (ErrorKind, String)> {
        self.remote_refusal(slot)?;
        service::ready_slot(self.cfg.nodes, &self.life, slot)
    }

    /// Runs `f` on the hosted service with the supervisor parts it may use.
    fn with_service<R>(&mut self, f: impl FnOnce(&mut dyn Service, &mut dyn Host) -> R) -> R {
        let mut host = HostView {
            plan: self.hosts.as_ref().map(|h| &h.plan),
            nodes: self.cfg.nodes,
            life: &self.life,
            allocs: &mut self.allocs,
            windows: &self.windows,
        };
        f(&mut *self.verbs, &mut host)
    }

    /// Serves one request of the hosted service (with the fds that came with it) and replies.
    fn handle_service(&mut self, id: u64, req: serde_json::Value, fds: Vec<OwnedFd>) {
        let hello_done = self.clients.get(&id).is_some_and(|c| c.pid != 0);
        // A QP connecting to a QP on another host is answered once that host agreed.
        if hello_done
            && (self.connect_across(id, &req)
                || self.grant_across(id, &req)
                || self.dma_across(id, &req))
        {
            return;
        }
        self.serve_service(id, req, fds);
    }

    /// Serves a request of the hosted service and replies; true if it succeeded.
    fn serve_service(&mut self, id: u64, req: serde_json::Value, fds: Vec<OwnedFd>) -> bool {
        let hello_done = self.clients.get(&id).is_some_and(|c| c.pid != 0);
        let result = if hello_done {
            self.with_service(|s, h| s.handle(h, id, req, fds))
        } else {
            Err((ErrorKind::Invalid, "first message must be hello".into()))
        };
        match result {
            Ok((resp, fds)) => {
                let fds: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                self.reply(id, &Response::Service(resp), &fds);
                true
            }
            Err((kind, message)) => {
                self.reply(id, &Response::Error { kind, message }, &[]);
                false
            }
        }
    }

    #[allow(clippy::type_complexity)]
    fn serve(
        &mut self,
        id: u64,
        req: Request,
    ) -> Result<(Response, Option<Arc<Region>>), (ErrorKind, String)> {
        let invalid = |m: &str| (ErrorKind::Invalid, m.to_owned());
        let hello_done = self.clients.get(&id).is_some_and(|c| c.pid != 0);
        match req {
            Request::Hello {
                version,
                pid,
                agent_slot,
            } => {
                if version != ctl::PROTOCOL_VERSION {
                    return Err(invalid(&format!(
                        "control protocol {version} is not supported (this fabric speaks {})",
                        ctl::PROTOCOL_VERSION
                    )));
                }
                if let Some(slot) = agent_slot {
                    if slot == 0 || slot > self.cfg.nodes || self.agent_pid(slot) != pid {
                        return Err(invalid(
                            "agent hello from a process that is not the node's agent",
                        ));
                    }
                }
                if let Some(c) = self.clients.get_mut(&id) {
                    c.pid = pid.max(1);
                    c.agent_slot = agent_slot;
                }
                let control = Arc::new(
                    Region::map(
                        self.control
                            .fd()
                            .try_clone_to_owned()
                            .map_err(|e| invalid(&e.to_string()))?,
                        false,
                    )
                    .map_err(|e| invalid(&e.to_string()))?,
                );
                Ok((
                    Response::Welcome {
                        name: self.cfg.name.clone(),
                        nodes: self.cfg.nodes,
                        window_size: self.cfg.window_size,
                        direct_ip: self.direct_ip(),
                    },
                    Some(control),
                ))
            }
            _ if !hello_done => Err(invalid("first message must be hello")),
            Request::AgentReady { slot } => {
                let is_agent = self.clients.get(&id).and_then(|c| c.agent_slot) == Some(slot);
                if !is_agent {
                    return Err(invalid("only the node's agent can report it ready"));
                }
                let beat = self
                    .win(slot)
                    .u64_at(WIN_HEARTBEAT_OFF as u64)
                    .map(|a| a.load(Ordering::Relaxed))
                    .unwrap_or(0);
                let t = self.life[slot as usize - 1].ready(Instant::now(), beat);
                self.apply(slot, t);
                Ok((Response::Ok, None))
            }
            Request::NetReady { slot } => {
                let is_agent = self.clients.get(&id).and_then(|c| c.agent_slot) == Some(slot);
                if !is_agent {
                    return Err(invalid("only the node's agent can report its network up"));
                }
                self.net_ready[slot as usize - 1] = true;
                self.say(&format!("node {slot}: {} up", net::IFNAME));
                Ok((Response::Ok, None))
            }
            Request::Grant { slot } => {
                // A node on another host is granted as its shadow window here: datagram
                // senders write their rings to it there, receivers read senders' credit
                // lines there (verbs and DMA are refused by the registry).
                if slot == 0 || slot > self.cfg.nodes {
                    return Err((ErrorKind::NotFound, format!("node {slot} does not exist")));
                }
                Ok((
                    Response::Granted {
                        slot,
                        generation: self.life[slot as usize - 1].generation(),
                    },
                    Some(self.windows[slot as usize - 1].clone()),
                ))
            }
            Request::Bind { slot, port, direct } => {
                self.remote_refusal(slot)?;
                self.bind(id, slot, port, direct).map(|r| (r, None))
            }
            Request::Unbind { slot, port } => {
                if self
                    .endpoints
                    .get(&(slot, port))
                    .is_some_and(|e| e.client == id)
                {
                    self.close_endpoint((slot, port));
                }
                Ok((Response::Ok, None))
            }
            Request::Connect {
                src_slot,
                src_port,
                dst_slot,
                dst_port,
            } => {
                self.remote_refusal(src_slot)?;
                self.connect(id, (src_slot, src_port), (dst_slot, dst_port))
                    .map(|r| (r, None))
            }
            Request::RetireRing { slot, ring_off } => {
                self.retire_ring(id, slot, ring_off);
                Ok((Response::Ok, None))
            }
            Request::Status => Ok((Response::Status(self.status()), None)),
            Request::Service(_) => Err(invalid("service requests are served by handle_service")),
            Request::Shutdown => {
                self.stopping = true;
                self.say("shutdown requested");
                Ok((Response::Ok, None))
            }
        }
    }
}
