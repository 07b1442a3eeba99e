//! The supervisor: the one process that keeps a fabric. It owns the control region and every
//! window (memfds), spawns one agent per node, watches their liveness (pidfd for death,
//! heartbeat for hangs), serves the control socket (grants, binds, connects, status), and on
//! shutdown removes everything it created.
//!
//! Single-threaded: one `poll` loop over the listener, client sockets and agent pidfds, with a
//! 50 ms tick for heartbeats, restarts and allocator quarantine. The life-cycle decisions are
//! made by the sans-IO [`NodeLife`]; this file only applies them.

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
use crate::mem::Region;
use crate::net::{self, NetPlan};
use crate::sync::{self, fence, Ordering};
use crate::wire::{self, *};

mod verbs;

/// First port handed out for `bind(0)`.
pub const EPHEMERAL_BASE: u32 = 49152;
/// How long `up` waits for every node to become READY.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(30);
const TICK: Duration = Duration::from_millis(50);

/// What a supervisor is asked to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Fabric name.
    pub name: String,
    /// Node count.
    pub nodes: u32,
    /// Window size per node.
    pub window_size: u64,
    /// Restart a dead agent after this long (None: leave it DOWN).
    pub restart_delay: Option<Duration>,
    /// Program and leading arguments that start a node agent; `--name F --slot N` is appended.
    pub agent_cmd: Vec<String>,
    /// IP over the fabric: `None` for `--no-net`.
    pub net: Option<NetPlan>,
    /// Link emulation: every node's link to the switch (`None`: memory speed).
    pub link: Option<LinkRepr>,
    /// A distributed topology (star topologies only set `link`).
    pub topology: Option<super::topology::Topology>,
}

/// Why a fabric could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Occurs when the fabric name is invalid.
    #[error(transparent)]
    Name(#[from] FabricError),
    /// Occurs when a supervisor already holds the fabric's lock.
    #[error("fabric '{0}' is already running (stop it with `backplane down --name {0}`)")]
    AlreadyRunning(String),
    /// Occurs when the node count is out of range.
    #[error("--nodes {0} is out of range: a fabric has 1 to {MAX_NODES} nodes")]
    BadNodeCount(u32),
    /// Occurs when the window size is out of range.
    #[error("--window-size {0} is out of range: use {min} to 64 GiB", min = MIN_WINDOW)]
    BadWindowSize(u64),
    /// Occurs when the windows need more shared memory than the machine has available.
    #[error("{nodes} windows of {each} MiB need {need} MiB of shared memory but only {avail} MiB is available; use a smaller --window-size or fewer --nodes")]
    NoMemory {
        /// Node count.
        nodes: u32,
        /// MiB per window.
        each: u64,
        /// MiB needed.
        need: u64,
        /// MiB available.
        avail: u64,
    },
    /// Occurs when an OS call fails while creating the fabric.
    #[error("{what}: {source}")]
    Os {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Occurs when a node does not come up.
    #[error("{0}")]
    Boot(String),
    /// Occurs when IP over the fabric is asked for without the privileges it needs.
    #[error("IP over the fabric needs root (network namespaces and TAP devices); run as root or add --no-net")]
    NeedRoot,
    /// Occurs when a network namespace cannot be set up.
    #[error("cannot set up the network of node {slot}: {message}")]
    Net {
        /// Slot.
        slot: u32,
        /// What failed.
        message: String,
    },
}

fn os(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StartError {
    let what = what.into();
    move |source| StartError::Os { what, source }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Checks the arguments of `up` before anything is created.
pub fn check_config(c: &Config) -> Result<(), StartError> {
    validate_name(&c.name)?;
    if c.nodes == 0 || c.nodes > MAX_NODES {
        return Err(StartError::BadNodeCount(c.nodes));
    }
    if c.window_size < MIN_WINDOW || c.window_size > 64 << 30 || !c.window_size.is_multiple_of(4096)
    {
        return Err(StartError::BadWindowSize(c.window_size));
    }
    if c.net.is_some() && !rustix::process::geteuid().is_root() {
        return Err(StartError::NeedRoot);
    }
    let need = c.nodes as u64 * c.window_size;
    if let Some(avail) = mem_available() {
        if need > avail {
            return Err(StartError::NoMemory {
                nodes: c.nodes,
                each: c.window_size >> 20,
                need: need >> 20,
                avail: avail >> 20,
            });
        }
    }
    Ok(())
}

/// The lock that marks a fabric as running. Held for the supervisor's whole life.
pub struct FabricLock {
    _file: File,
    dir: PathBuf,
    /// True if the directory held leftovers of a supervisor that died without cleaning up.
    pub stale: bool,
}

/// Takes the fabric's lock, creating its private directory, and removes what a crashed
/// supervisor left behind.
pub fn lock_fabric(name: &str) -> Result<FabricLock, StartError> {
    validate_name(name)?;
    let dir = fabric_dir(name);
    if let Some(root) = dir.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root)
            .map_err(os(format!("cannot create {}", root.display())))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(os(format!("cannot create {}", dir.display()))(e)),
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(dir.join(LOCK_FILE))
        .map_err(os("cannot open the fabric lock"))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => return Err(StartError::AlreadyRunning(name.into())),
        Err(e) => return Err(os("cannot lock the fabric")(e.into())),
    }
    let stale = dir.join(SOCKET_FILE).exists();
    let _ = std::fs::remove_file(dir.join(SOCKET_FILE));
    if stale {
        net::cleanup(name);
    }
    Ok(FabricLock {
        _file: file,
        dir,
        stale,
    })
}

impl FabricLock {
    /// Removes the fabric directory (the lock is released when `self` drops).
    pub fn remove_dir(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// True if some process holds fabric `name`'s lock right now.
pub fn is_running(name: &str) -> bool {
    let Ok(f) = File::open(fabric_dir(name).join(LOCK_FILE)) else {
        return false;
    };
    match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockShared) {
        Ok(()) => false,
        Err(_) => true,
    }
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
}

struct RingInfo {
    /// Intermediate nodes the ring's traffic is forwarded through (distributed topologies).
    via: Vec<u32>,
    src: (u32, u32),
    dst: (u32, u32),
    ring_off: u64,
    credit_off: u64,
    list_index: u32,
}

struct Sup {
    cfg: Config,
    created: Instant,
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
    verbs: verbs::Registry,
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

/// Runs a supervisor until the fabric is shut down. `ready` gets one line when every node is
/// READY ("ready") or boot failed ("error: ..."), then is closed.
pub fn run(
    cfg: Config,
    lock: FabricLock,
    ready: Option<File>,
    log: File,
) -> Result<(), StartError> {
    install_signal_handlers();
    let mut ready = ready;
    let result = run_inner(cfg, &lock, &mut ready, log);
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
) -> Result<(), StartError> {
    check_config(&cfg)?;
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
    }
    .emit(&mut FabricHeader::new_unchecked(&mut hdr[..]));
    publish(&control, 0, &hdr, FABRIC_INIT_OFF);

    let listener = bind_listener(&lock.dir.join(SOCKET_FILE))?;
    let mut sup = Sup {
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
        verbs: verbs::Registry::new(),
    };
    if lock.stale {
        sup.say("removed what a crashed supervisor left behind");
    }
    if let Some(plan) = sup.cfg.net {
        net::cleanup(&sup.cfg.name);
        for slot in 1..=sup.cfg.nodes {
            if let Err(e) = net::create_node_netns(&sup.cfg.name, slot, &plan, sup.cfg.nodes) {
                net::cleanup(&sup.cfg.name);
                return Err(StartError::Net {
                    slot,
                    message: e.to_string(),
                });
            }
        }
    }
    for slot in 1..=sup.cfg.nodes {
        sup.write_entry(slot, DownReason::None);
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
            let net_up = sup.cfg.net.is_none() || sup.net_ready.iter().all(|&r| r);
            if net_up && sup.life.iter().all(|l| l.state() == NodeState::Ready) {
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
fn publish(region: &Region, off: u64, bytes: &[u8], init_off: usize) {
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

    fn spawn_agent(&mut self, slot: u32) -> Result<(), StartError> {
        let (prog, args) = self
            .cfg
            .agent_cmd
            .split_first()
            .ok_or_else(|| StartError::Boot("no agent command".into()))?;
        let log = self.log.try_clone().map_err(os("log"))?;
        let log2 = self.log.try_clone().map_err(os("log"))?;
        let mut cmd = Command::new(prog);
        cmd.args(args)
            .args(["--name", &self.cfg.name, "--slot", &slot.to_string()])
            .args(self.cfg.net.iter().flat_map(|p| {
                [
                    "--subnet".to_string(),
                    format!("{}/{}", p.network, p.prefix),
                    "--mtu".to_string(),
                    p.mtu.to_string(),
                ]
            }))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        // SAFETY: the closure only makes the prctl system call (async-signal-safe, no
        // allocation) between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                rustix::process::set_parent_process_death_signal(Some(
                    rustix::process::Signal::KILL,
                ))?;
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .map_err(os(format!("cannot start the agent of node {slot}")))?;
        let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("child pid > 0");
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
            .map_err(|e| os("pidfd_open")(e.into()))?;
        self.agents[slot as usize - 1] = Some(Agent { child, pidfd });
        let t = self.life[slot as usize - 1].spawned(Instant::now());
        self.apply(slot, t);
        Ok(())
    }

    fn agent_pid(&self, slot: u32) -> u32 {
        self.agents[slot as usize - 1]
            .as_ref()
            .map_or(0, |a| a.child.id())
    }

    fn first_down_during_boot(&self) -> Option<u32> {
        (1..=self.cfg.nodes).find(|&s| self.life[s as usize - 1].state() == NodeState::Down)
    }

    /// Writes slot's node table entry under the seqlock and bumps the fabric epoch.
    fn write_entry(&mut self, slot: u32, reason: DownReason) {
        let l = &self.life[slot as usize - 1];
        let repr = NodeEntryRepr {
            slot,
            state: l.state(),
            generation: l.generation(),
            pid: self.agent_pid(slot),
            window_size: self.cfg.window_size,
            since_ms: self.since[slot as usize - 1],
            reason,
        };
        let mut b = [0u8; 64];
        repr.emit(&mut NodeEntry::new_unchecked(&mut b[..]));
        let off = (NODE_TABLE_OFF + (slot as usize - 1) * 64) as u64;
        let seq = self.control.u32_at(off).expect("entry in region");
        let s = seq.load(Ordering::Relaxed);
        // SYNC POINT node-seqlock (release): odd seq, body, even seq.
        seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        self.control
            .write(off + 4, &b[4..])
            .expect("entry in region");
        seq.store(s.wrapping_add(2), Ordering::Release);
        let epoch = self.control.u32_at(FABRIC_EPOCH_OFF as u64).expect("epoch");
        sync::ring(epoch);
    }

    fn apply(&mut self, slot: u32, t: Option<Transition>) {
        let Some(t) = t else { return };
        self.since[slot as usize - 1] = now_ms();
        self.say(&format!(
            "node {slot}: {} (generation {}{})",
            t.state,
            t.generation,
            match t.reason {
                DownReason::None => "",
                DownReason::Exited => ", agent exited",
                DownReason::Hung => ", heartbeat stopped",
                DownReason::Shutdown => ", shutdown",
            }
        ));
        match t.state {
            NodeState::Down => self.node_down(slot),
            NodeState::Ready => self.init_window(slot, t.generation),
            _ => {}
        }
        self.write_entry(slot, t.reason);
    }

    fn init_window(&mut self, slot: u32, generation: u32) {
        let w = self.windows[slot as usize - 1].clone();
        w.u32_at(WIN_INIT_OFF as u64)
            .expect("hdr")
            .store(0, Ordering::Release);
        w.zero(
            WIN_DOORBELL_BITS_OFF as u64,
            (4096 - WIN_DOORBELL_BITS_OFF) as u64,
        )
        .expect("hdr");
        let mut h = [0u8; 64];
        WindowHeaderRepr {
            slot,
            generation,
            size: self.cfg.window_size,
        }
        .emit(&mut WindowHeader::new_unchecked(&mut h[..]));
        publish(&w, 0, &h, WIN_INIT_OFF);
    }

    fn node_down(&mut self, slot: u32) {
        self.net_ready[slot as usize - 1] = false;
        // Traffic forwarded through this node has lost its path: its senders must re-route.
        let through: Vec<u64> = self
            .rings
            .iter()
            .filter(|(_, r)| r.via.contains(&slot))
            .map(|(&id, _)| id)
            .collect();
        for id in through {
            self.teardown_ring(id);
        }
        self.verbs_node_down(slot);
        let eps: Vec<(u32, u32)> = self
            .endpoints
            .keys()
            .filter(|k| k.0 == slot)
            .copied()
            .collect();
        for key in eps {
            self.close_endpoint(key);
        }
        // Wake anything sleeping on this node's doorbell so it re-checks the node state.
        if let Ok(seq) = self.win(slot).u32_at(WIN_DOORBELL_SEQ_OFF as u64) {
            sync::ring(seq);
        }
    }

    /// Closes an endpoint: receivers' rings are torn down (their senders see peer-closed),
    /// senders' rings are marked sender-closed and left for their receivers to drain.
    fn close_endpoint(&mut self, key: (u32, u32)) {
        let Some(ep) = self.endpoints.remove(&key) else {
            return;
        };
        let now = Instant::now();
        let w = self.windows[key.0 as usize - 1].clone();
        let rec = ep.record_off;
        if let Ok(c) = w.u32_at(rec + EP_CLOSED_OFF as u64) {
            c.store(1, Ordering::Release);
        }
        let mut counters = [0u64; 5];
        for (i, c) in counters.iter_mut().enumerate() {
            *c = w
                .u64_at(rec + (EP_COUNTERS_OFF + 8 * i) as u64)
                .map(|a| a.load(Ordering::Relaxed))
                .unwrap_or(0);
        }
        let t = &mut self.totals[key.0 as usize - 1];
        for i in 0..5 {
            t[i] = t[i].saturating_add(counters[i]);
        }
        if let Ok(d) = w.u32_at(rec + EP_DOORBELL_OFF as u64) {
            sync::ring(d);
        }
        for id in ep.rings_in {
            self.teardown_ring(id);
        }
        for id in ep.rings_out {
            if let Some(r) = self.rings.get(&id) {
                let dst_w = self.windows[r.dst.0 as usize - 1].clone();
                if let Ok(c) = dst_w.u32_at(r.ring_off + RING_SENDER_CLOSED_OFF as u64) {
                    c.store(1, Ordering::Release);
                }
                if let Some(dst) = self.endpoints.get(&r.dst) {
                    if let Ok(d) = dst_w.u32_at(dst.record_off + EP_DOORBELL_OFF as u64) {
                        sync::ring(d);
                    }
                }
            }
        }
        self.allocs[key.0 as usize - 1].free(rec, ENDPOINT_LEN, now);
        if let Some(c) = self.clients.get_mut(&ep.client) {
            c.endpoints.retain(|&k| k != key);
        }
    }

    fn shutdown_all(&mut self) {
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
        if self.cfg.net.is_some() {
            net::cleanup(&self.cfg.name);
        }
        self.say("fabric stopped");
    }

    fn poll_once(&mut self, listener: &OwnedFd, buf: &mut Vec<u8>, booted: bool) {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let client_ids: Vec<u64> = self.clients.keys().copied().collect();
        let agent_slots: Vec<u32> = (1..=self.cfg.nodes)
            .filter(|&s| self.agents[s as usize - 1].is_some())
            .collect();
        let ready_flags;
        {
            let mut fds = Vec::with_capacity(1 + client_ids.len() + agent_slots.len());
            fds.push(PollFd::new(listener, PollFlags::IN));
            for id in &client_ids {
                fds.push(PollFd::new(&self.clients[id].sock, PollFlags::IN));
            }
            for &s in &agent_slots {
                let a = self.agents[s as usize - 1].as_ref().expect("filtered");
                fds.push(PollFd::new(&a.pidfd, PollFlags::IN));
            }
            let ts = Timespec::try_from(TICK).expect("tick fits");
            let _ = poll(&mut fds, Some(&ts));
            ready_flags = fds.iter().map(|f| f.revents()).collect::<Vec<_>>();
        }
        let now = Instant::now();
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
                Ok(Some((Request::Verbs(v), fds))) => self.handle_verbs(*id, v, fds),
                Ok(Some((req, _fds))) => self.handle(*id, req),
                Ok(None) | Err(_) => self.drop_client(*id),
            }
        }
        self.tick(now);
    }

    fn tick(&mut self, now: Instant) {
        for slot in 1..=self.cfg.nodes {
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
        self.verbs_drop_client(id);
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
        if slot == 0 || slot > self.cfg.nodes {
            return Err((
                ErrorKind::NotFound,
                format!("node {slot} does not exist (nodes 1..={})", self.cfg.nodes),
            ));
        }
        let st = self.life[slot as usize - 1].state();
        if st != NodeState::Ready {
            return Err((
                ErrorKind::NodeDown,
                format!("node {slot} is {st}, not READY"),
            ));
        }
        Ok(())
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
            Request::Bind { slot, port } => self.bind(id, slot, port).map(|r| (r, None)),
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
            } => self
                .connect(id, (src_slot, src_port), (dst_slot, dst_port))
                .map(|r| (r, None)),
            Request::RetireRing { slot, ring_off } => {
                self.retire_ring(id, slot, ring_off);
                Ok((Response::Ok, None))
            }
            Request::Status => Ok((Response::Status(self.status()), None)),
            Request::Verbs(_) => Err(invalid("verbs requests are served by handle_verbs")),
            Request::Shutdown => {
                self.stopping = true;
                self.say("shutdown requested");
                Ok((Response::Ok, None))
            }
        }
    }

    fn bind(&mut self, id: u64, slot: u32, port: u32) -> Result<Response, (ErrorKind, String)> {
        self.ready_slot(slot)?;
        let port = if port == 0 {
            let mut p = self.next_ephemeral;
            let mut tries = 0;
            while self.endpoints.contains_key(&(slot, p)) {
                p = if p == u32::MAX { EPHEMERAL_BASE } else { p + 1 };
                tries += 1;
                if tries > 1_000_000 {
                    return Err((ErrorKind::NoSpace, "no free port".into()));
                }
            }
            self.next_ephemeral = p.wrapping_add(1).max(EPHEMERAL_BASE);
            p
        } else {
            port
        };
        if self.endpoints.contains_key(&(slot, port)) {
            return Err((
                ErrorKind::InUse,
                format!("port {port} on node {slot} is already bound"),
            ));
        }
        let now = Instant::now();
        let Some(rec) = self.allocs[slot as usize - 1].alloc(ENDPOINT_LEN, 4096, now) else {
            return Err((
                ErrorKind::NoSpace,
                format!("node {slot}'s window is full; use a larger --window-size"),
            ));
        };
        let generation = self.life[slot as usize - 1].generation();
        let pid = self.clients.get(&id).map_or(0, |c| c.pid);
        let w = self.windows[slot as usize - 1].clone();
        w.zero(rec, ENDPOINT_LEN)
            .expect("allocated inside the window");
        let mut h = [0u8; 64];
        EndpointRepr {
            slot,
            port,
            owner_pid: pid,
            generation,
        }
        .emit(&mut EndpointHeader::new_unchecked(&mut h[..]));
        publish(&w, rec, &h, EP_INIT_OFF);
        self.endpoints.insert(
            (slot, port),
            Ep {
                record_off: rec,
                client: id,
                generation,
                list: Vec::new(),
                rings_in: Vec::new(),
                rings_out: Vec::new(),
            },
        );
        if let Some(c) = self.clients.get_mut(&id) {
            c.endpoints.push((slot, port));
        }
        Ok(Response::Bound {
            port,
            record_off: rec,
            generation,
        })
    }

    fn connect(
        &mut self,
        id: u64,
        src: (u32, u32),
        dst: (u32, u32),
    ) -> Result<Response, (ErrorKind, String)> {
        self.ready_slot(src.0)?;
        self.ready_slot(dst.0)?;
        match self.endpoints.get(&src) {
            Some(e) if e.client == id => {}
            _ => {
                return Err((
                    ErrorKind::Invalid,
                    format!("this process does not own port {} on node {}", src.1, src.0),
                ))
            }
        }
        let Some(dst_ep) = self.endpoints.get(&dst) else {
            return Err((
                ErrorKind::NotFound,
                format!("nothing is bound to port {} on node {}", dst.1, dst.0),
            ));
        };
        let dst_rec = dst_ep.record_off;
        let dst_gen = dst_ep.generation;
        let route = self.route(src.0, dst.0)?;
        if let Some(r) = self.rings.values().find(|r| r.src == src && r.dst == dst) {
            return Ok(Response::Connected {
                route: route.clone(),
                ring_off: r.ring_off,
                credit_off: r.credit_off,
                dst_record_off: dst_rec,
                dst_generation: dst_gen,
            });
        }
        let dst_w = self.windows[dst.0 as usize - 1].clone();
        let src_w = self.windows[src.0 as usize - 1].clone();
        let list = &dst_ep.list;
        let list_index = list.iter().position(|used| !used).unwrap_or(list.len()) as u32;
        let count = list.len() as u32;
        if list_index >= ENDPOINT_MAX_RINGS {
            return Err((
                ErrorKind::NoSpace,
                format!(
                    "port {} on node {} already hears {ENDPOINT_MAX_RINGS} senders",
                    dst.1, dst.0
                ),
            ));
        }
        let now = Instant::now();
        let no_room = |slot: u32| {
            (
                ErrorKind::NoSpace,
                format!("node {slot}'s window is full; use a larger --window-size"),
            )
        };
        let ring_bytes = RingRepr::footprint(self.ring_data());
        let ring_off = self.allocs[dst.0 as usize - 1]
            .alloc(ring_bytes, 4096, now)
            .ok_or_else(|| no_room(dst.0))?;
        let Some(credit_off) = self.allocs[src.0 as usize - 1].alloc(CREDIT_LEN, 64, now) else {
            self.allocs[dst.0 as usize - 1].free(ring_off, ring_bytes, now);
            return Err(no_room(src.0));
        };
        let ring_id = self.next_ring;
        self.next_ring += 1;
        src_w.zero(credit_off, CREDIT_LEN).expect("allocated");
        src_w
            .u32_at(credit_off + CREDIT_COOKIE_OFF as u64)
            .expect("allocated")
            .store(ring_id as u32, Ordering::Release);
        dst_w.zero(ring_off, RING_DATA_OFF).expect("allocated");
        let mut h = [0u8; 64];
        RingRepr {
            data_len: self.ring_data(),
            src_slot: src.0,
            src_port: src.1,
            dst_port: dst.1,
            src_generation: self.life[src.0 as usize - 1].generation(),
            credit_off,
        }
        .emit(&mut RingHeader::new_unchecked(&mut h[..]));
        publish(&dst_w, ring_off, &h, RING_INIT_OFF);
        // SYNC POINT ring-list (release): the ring header is initialised before it is listed.
        dst_w
            .u64_at(dst_rec + EP_RING_LIST_OFF as u64 + 8 * list_index as u64)
            .expect("list entry")
            .store(ring_off, Ordering::Release);
        if list_index == count {
            dst_w
                .u32_at(dst_rec + EP_RING_COUNT_OFF as u64)
                .expect("record")
                .store(count + 1, Ordering::Release);
        }
        dst_w
            .u32_at(dst_rec + EP_RING_SEQ_OFF as u64)
            .expect("record")
            .fetch_add(1, Ordering::Release);
        self.rings.insert(
            ring_id,
            RingInfo {
                via: route.iter().skip(1).map(|h| h.from).collect(),
                src,
                dst,
                ring_off,
                credit_off,
                list_index,
            },
        );
        if let Some(e) = self.endpoints.get_mut(&dst) {
            e.rings_in.push(ring_id);
            if list_index == count {
                e.list.push(true);
            } else {
                e.list[list_index as usize] = true;
            }
        }
        if let Some(e) = self.endpoints.get_mut(&src) {
            e.rings_out.push(ring_id);
        }
        Ok(Response::Connected {
            route,
            ring_off,
            credit_off,
            dst_record_off: dst_rec,
            dst_generation: dst_gen,
        })
    }

    /// The links from `src` to `dst` in a distributed topology, through READY nodes only.
    fn route(&self, src: u32, dst: u32) -> Result<Vec<ctl::RouteHop>, (ErrorKind, String)> {
        let Some(t) = &self.cfg.topology else {
            return Ok(Vec::new());
        };
        if src == dst {
            return Ok(Vec::new());
        }
        let ready = |n: u32| self.life[n as usize - 1].state() == NodeState::Ready;
        let path = t.route(src, dst, ready).ok_or_else(|| {
            let down: Vec<String> = (1..=self.cfg.nodes)
                .filter(|&n| !ready(n))
                .map(|n| n.to_string())
                .collect();
            (
                ErrorKind::NodeDown,
                format!(
                    "no route from node {src} to node {dst}: the nodes that would forward between them are DOWN ({})",
                    down.join(", ")
                ),
            )
        })?;
        Ok(path
            .windows(2)
            .map(|w| {
                let m = t
                    .link_between(w[0], w[1])
                    .expect("routes follow declared links");
                ctl::RouteHop {
                    from: w[0],
                    to: w[1],
                    bytes_per_s: m.bytes_per_s.max(1),
                    hop_ns: m.hop_ns,
                }
            })
            .collect())
    }

    /// The receiver is done with a ring: drained after its sender left, or found corrupted.
    /// Either way it is torn down; a sender still attached sees peer-closed on its next send
    /// and reconnects with a fresh ring.
    fn retire_ring(&mut self, id: u64, slot: u32, ring_off: u64) {
        let Some(rid) = self
            .rings
            .iter()
            .find(|(_, r)| r.dst.0 == slot && r.ring_off == ring_off)
            .map(|(&rid, _)| rid)
        else {
            return;
        };
        if self
            .endpoints
            .get(&self.rings[&rid].dst)
            .is_none_or(|e| e.client != id)
        {
            return; // only the receiver may retire its rings
        }
        self.teardown_ring(rid);
    }

    /// Removes a ring: its sender sees peer-closed (and is woken), the receiver's list entry
    /// is cleared if the receiver still exists, and both allocations are freed (quarantined).
    fn teardown_ring(&mut self, rid: u64) {
        let Some(r) = self.rings.remove(&rid) else {
            return;
        };
        let now = Instant::now();
        let src_w = self.windows[r.src.0 as usize - 1].clone();
        if let Ok(c) = src_w.u32_at(r.credit_off + CREDIT_PEER_CLOSED_OFF as u64) {
            c.store(1, Ordering::Release);
        }
        if let Ok(s) = src_w.u32_at(r.credit_off + CREDIT_SEQ_OFF as u64) {
            sync::ring(s);
        }
        if let Some(e) = self.endpoints.get_mut(&r.src) {
            e.rings_out.retain(|&x| x != rid);
        }
        let dst_w = self.windows[r.dst.0 as usize - 1].clone();
        if let Some(e) = self.endpoints.get_mut(&r.dst) {
            e.rings_in.retain(|&x| x != rid);
            if let Some(u) = e.list.get_mut(r.list_index as usize) {
                *u = false;
            }
            let rec = e.record_off;
            let _ = dst_w
                .u64_at(rec + EP_RING_LIST_OFF as u64 + 8 * r.list_index as u64)
                .map(|a| a.store(0, Ordering::Release));
            let _ = dst_w
                .u32_at(rec + EP_RING_SEQ_OFF as u64)
                .map(|a| a.fetch_add(1, Ordering::Release));
        }
        let ring_bytes = RingRepr::footprint(self.ring_data());
        self.allocs[r.dst.0 as usize - 1].free(r.ring_off, ring_bytes, now);
        self.allocs[r.src.0 as usize - 1].free(r.credit_off, CREDIT_LEN, now);
    }

    /// Ring data size of every datagram ring of this fabric (see [`wire::ring_data_for_window`]).
    fn ring_data(&self) -> u32 {
        wire::ring_data_for_window(self.cfg.window_size)
    }

    fn status(&self) -> StatusReport {
        let now = now_ms();
        let slots = (1..=self.cfg.nodes)
            .map(|slot| {
                let i = slot as usize - 1;
                let mut c = self.totals[i];
                let mut endpoints = 0;
                for (_, e) in self.endpoints.iter().filter(|(k, _)| k.0 == slot) {
                    endpoints += 1;
                    for (k, v) in c.iter_mut().enumerate() {
                        let x = self
                            .win(slot)
                            .u64_at(e.record_off + (EP_COUNTERS_OFF + 8 * k) as u64)
                            .map(|a| a.load(Ordering::Relaxed))
                            .unwrap_or(0);
                        *v = v.saturating_add(x);
                    }
                }
                let entry_reason = self.read_reason(slot);
                let fwd = |k: usize| {
                    self.win(slot)
                        .u64_at((WIN_FWD_OFF + 8 * k) as u64)
                        .map(|a| a.load(Ordering::Relaxed))
                        .unwrap_or(0)
                };
                let ifstats = self.cfg.net.map(|_| {
                    let mut v = [0u64; 6];
                    for (k, x) in v.iter_mut().enumerate() {
                        *x = self
                            .win(slot)
                            .u64_at((WIN_IFSTATS_OFF + 8 * k) as u64)
                            .map(|a| a.load(Ordering::Relaxed))
                            .unwrap_or(0);
                    }
                    ctl::IfStats {
                        name: net::IFNAME.to_string(),
                        up: self.net_ready[i],
                        rx_packets: v[0],
                        rx_bytes: v[1],
                        tx_packets: v[2],
                        tx_bytes: v[3],
                        rx_dropped: v[4],
                        tx_dropped: v[5],
                    }
                });
                SlotStatus {
                    slot,
                    state: self.life[i].state(),
                    down_reason: entry_reason,
                    generation: self.life[i].generation(),
                    pid: self.agent_pid(slot),
                    procs: 0, // counted by the asking process
                    window_base: wire::window_base(slot),
                    window_size: self.cfg.window_size,
                    doorbell: wire::window_base(slot) + WIN_DOORBELL_BITS_OFF as u64,
                    uptime_s: now.saturating_sub(self.since[i]) as f64 / 1000.0,
                    endpoints,
                    tx_msgs: c[0],
                    tx_bytes: c[1],
                    rx_msgs: c[2],
                    rx_bytes: c[3],
                    drops: c[4],
                    fwd_msgs: fwd(0),
                    fwd_bytes: fwd(1),
                    address: self.cfg.net.map(|p| p.cidr(slot)),
                    mac: self.cfg.net.map(|_| net::Mac::of_slot(slot).to_string()),
                    interface: ifstats,
                }
            })
            .collect();
        StatusReport {
            topology: self.cfg.topology.as_ref().map(|t| ctl::TopologyStatus {
                kind: match t.kind {
                    super::topology::Kind::Star => "star".into(),
                    super::topology::Kind::Distributed => "distributed".into(),
                },
                links: t
                    .links
                    .iter()
                    .map(|l| format!("{}-{} {}", l.a, l.b, l.model.name))
                    .collect(),
            }),
            link: self.cfg.link.as_ref().map(|l| ctl::LinkStatus {
                model: l.name.clone(),
                bytes_per_s: l.bytes_per_s,
                hop_ns: l.hop_ns,
                forwarding: if l.store_and_forward {
                    "store-and-forward".into()
                } else {
                    "cut-through".into()
                },
            }),
            version: ctl::STATUS_VERSION,
            fabric: self.cfg.name.clone(),
            nodes: self.cfg.nodes,
            window_size: self.cfg.window_size,
            supervisor_pid: std::process::id(),
            uptime_s: self.created.elapsed().as_secs_f64(),
            slots,
        }
    }

    fn read_reason(&self, slot: u32) -> DownReason {
        let off = (NODE_TABLE_OFF + (slot as usize - 1) * 64) as u64;
        let mut b = [0u8; 64];
        if self.control.read(off, &mut b).is_err() {
            return DownReason::None;
        }
        NodeEntryRepr::parse(&NodeEntry::new_unchecked(&b[..]))
            .map(|e| e.reason)
            .unwrap_or(DownReason::None)
    }
}
