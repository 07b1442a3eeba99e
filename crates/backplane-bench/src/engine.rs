//! The measurement engine: sets up every path, runs the size sweeps (throughput with CPU
//! accounting, ping-pong latency), the loss sweep and zero-loss search on datagram paths, and
//! the memcpy reference, and assembles the [`Report`].
//!
//! A path that cannot run (missing tool, no root) is skipped with its reason; one that fails
//! part-way keeps what it measured and says where it stopped; the run goes on either way.

use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use backplane::dgram::Addr;
use backplane::fabric::{launch, Fabric};
use backplane::net::{self, NetPlan};
use hdrhistogram::Histogram;

use crate::cpu::{ProcStat, Rusage, SideCpu, Snapshot, Who};
use crate::dma_path::DmaPath;
use crate::drive;
use crate::link::{put_stamp, FabricLink, Link, StreamLink, UdpLink};
use crate::memcpy::{self, Load, Memcpy};
use crate::netns::{self, VethPair};
use crate::peer::{self, Command, PeerProc, PeerResult};
use crate::progress::Progress;
use crate::report::{
    self, ConfigOut, FitOut, LatencyPoint, LossReport, LossTrial, MemcpyOut, PathReport, Report,
    Skip, Status, ThroughputPoint,
};
use crate::stats::{self, estimate, least_squares, LatencySummary};
use crate::teardown::{self, Guard};
use crate::ucx::{self, UcxTest};
use crate::verbs_link::VerbsLink;

/// Smallest message size accepted.
pub const MIN_SIZE: u64 = 8;
/// Largest message size accepted.
pub const MAX_SIZE: u64 = 64 << 20;
/// Fabric port the peer binds on node 2.
const PEER_PORT: u32 = 18516;
/// Buffer copied to measure memcpy bandwidth: far beyond any cache.
const MEMCPY_BYTES: usize = 64 << 20;

/// The default size sweep: 64 B to 8 MiB in powers of two.
pub fn default_sizes() -> Vec<u64> {
    (6..=23).map(|p| 1u64 << p).collect()
}

/// How a path moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Messages as datagrams (split above the path's datagram size); may lose.
    Datagram,
    /// A byte stream.
    Stream,
    /// Measured by `ucx_perftest`.
    Ucx,
    /// Raw DMA jobs run by the engine threads.
    Dma,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Datagram => "datagram",
            Kind::Stream => "stream",
            Kind::Ucx => "ucx",
            Kind::Dma => "dma",
        }
    }
}

/// A path the lab knows.
#[derive(Debug, Clone, Copy)]
pub struct PathDef {
    /// Name, as `--paths` takes it.
    pub name: &'static str,
    /// What it is.
    pub title: &'static str,
    /// How it moves data.
    pub kind: Kind,
    /// Copies of the payload per message (for the expected latency slope).
    pub copies: f64,
    /// Why it cannot be measured yet, for paths backplane does not have yet.
    pub not_yet: Option<&'static str>,
}

impl PathDef {
    /// The largest message the path can carry, and why, for paths that have one: kernel UDP
    /// sends a message as one datagram, and a datagram holds at most [`MAX_UDP`](crate::link::MAX_UDP) bytes. (The
    /// fabric's own datagram path carries larger messages as several lossless datagrams.)
    pub fn largest_message(&self) -> Option<(u64, &'static str)> {
        matches!(self.name, "fabric-udp" | "udp-loopback" | "udp-veth").then_some((
            crate::link::MAX_UDP as u64,
            "larger than the largest UDP datagram (65507 B): kernel UDP cannot carry it as one message",
        ))
    }
}

/// Every path, in report order.
pub const PATHS: &[PathDef] = &[
    PathDef {
        name: "fabric-dgram",
        title: "fabric datagrams, node 1 → node 2 in two processes (kernel bypass)",
        kind: Kind::Datagram,
        copies: 1.0,
        not_yet: None,
    },
    PathDef {
        name: "fabric-verbs-write",
        title: "fabric RDMA verbs: a stream of RDMA_WRITE_WITH_IMM into the peer's ring (RC QP), read in place, node 1 → node 2 in two processes",
        kind: Kind::Stream,
        // Into the registered staging area, then the write into the peer's ring (chunks up
        // to 256 B go inline: one copy); the receiver reads in place.
        copies: 2.0,
        not_yet: None,
    },
    PathDef {
        name: "fabric-verbs-read",
        title: "fabric RDMA verbs: chunks announced with SEND_WITH_IMM and pulled by the receiver with RDMA_READ (rendezvous), node 1 → node 2",
        kind: Kind::Stream,
        // Into the staging area, then the receiver's READ into its ring.
        copies: 2.0,
        not_yet: None,
    },
    PathDef {
        name: "fabric-verbs-send",
        title: "fabric RDMA verbs: a stream of SENDs (≤ 64 KiB) into posted receive buffers, read in place, node 1 → node 2",
        kind: Kind::Stream,
        // Into the staging area, into the QP ring, into the posted receive.
        copies: 3.0,
        not_yet: None,
    },
    PathDef {
        name: "fabric-raw",
        title: "fabric raw mode: a stream of DMA jobs from a region of node 1 into one of node 2, copied by an engine thread (seed 000 §4.6)",
        kind: Kind::Dma,
        // The engine's one copy; jobs of at most 16 KiB are copied by the submitter instead.
        copies: 1.0,
        not_yet: None,
    },
    PathDef {
        name: "fabric-tcp",
        title: "kernel TCP over the fabric's bp0 interfaces, node 1 → node 2 namespaces",
        kind: Kind::Stream,
        // send() into the kernel, TAP → ring (agent), ring → TAP (agent), recv() out.
        copies: 4.0,
        not_yet: None,
    },
    PathDef {
        name: "fabric-tcp-accel",
        title: "TCP over the fabric with socket acceleration: unmodified socket calls in two processes (libbackplane_sockets.so preloaded, `backplane exec --accel`), the byte stream on shared-memory rings, node 1 → node 2 namespaces",
        kind: Kind::Stream,
        // write() into the ring, read() out of it.
        copies: 2.0,
        not_yet: None,
    },
    PathDef {
        name: "fabric-udp",
        title: "kernel UDP over the fabric's bp0 interfaces, node 1 → node 2 namespaces",
        kind: Kind::Datagram,
        copies: 4.0,
        not_yet: None,
    },
    PathDef {
        name: "ucx-shm",
        title: "UCX tag matching over shared memory (ucx_perftest, UCX_TLS=posix,cma,self)",
        kind: Kind::Ucx,
        copies: 2.0,
        not_yet: None,
    },
    PathDef {
        name: "tcp-loopback",
        title: "kernel TCP over loopback",
        kind: Kind::Stream,
        copies: 2.0,
        not_yet: None,
    },
    PathDef {
        name: "udp-loopback",
        title: "kernel UDP over loopback",
        kind: Kind::Datagram,
        copies: 2.0,
        not_yet: None,
    },
    PathDef {
        name: "unix-stream",
        title: "Unix domain stream socket",
        kind: Kind::Stream,
        copies: 2.0,
        not_yet: None,
    },
    PathDef {
        name: "tcp-veth",
        title: "kernel TCP over a veth pair between two network namespaces",
        kind: Kind::Stream,
        copies: 2.0,
        not_yet: None,
    },
    PathDef {
        name: "udp-veth",
        title: "kernel UDP over a veth pair between two network namespaces",
        kind: Kind::Datagram,
        copies: 2.0,
        not_yet: None,
    },
];

/// What to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Path names; `None`: every path.
    pub paths: Option<Vec<String>>,
    /// Message sizes, as given (checked against [`MIN_SIZE`]..=[`MAX_SIZE`]).
    pub sizes: Vec<u64>,
    /// Measurement time per point.
    pub duration: Duration,
    /// Warm-up before each point, discarded.
    pub warmup: Duration,
    /// Runs per point.
    pub repeat: usize,
    /// Run a background memory writer.
    pub load: bool,
    /// Datagram size for the loss measurements.
    pub loss_bytes: u64,
    /// The `backplane` executable (for the fabric and the `bench-peer` processes).
    pub exe: PathBuf,
    /// No progress output.
    pub quiet: bool,
    /// Emulate this link model on the temporary fabric (`backplane up --link`).
    pub link: Option<String>,
}

/// Splits requested names into known paths (catalogue order) and skips for unknown ones.
pub fn select_paths(req: Option<&[String]>) -> (Vec<&'static PathDef>, Vec<Skip>) {
    let Some(req) = req else {
        return (PATHS.iter().collect(), Vec::new());
    };
    let mut skips = Vec::new();
    for r in req {
        if !PATHS.iter().any(|p| p.name == r) {
            skips.push(Skip {
                what: r.clone(),
                reason: format!(
                    "unknown path (known: {})",
                    PATHS.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
                ),
            });
        }
    }
    let sel = PATHS
        .iter()
        .filter(|p| req.iter().any(|r| r == p.name))
        .collect();
    (sel, skips)
}

/// Keeps sizes within range (sorted, without repeats); the rest become skips.
pub fn check_sizes(sizes: &[u64]) -> (Vec<u64>, Vec<Skip>) {
    let mut ok: Vec<u64> = Vec::new();
    let mut skips = Vec::new();
    for &s in sizes {
        if (MIN_SIZE..=MAX_SIZE).contains(&s) {
            ok.push(s);
        } else {
            skips.push(Skip {
                what: format!("size {s}"),
                reason: format!(
                    "out of range: sizes go from {MIN_SIZE} B (a datagram's sequence stamp) to {}",
                    report::human_bytes(MAX_SIZE)
                ),
            });
        }
    }
    ok.sort_unstable();
    ok.dedup();
    (ok, skips)
}

struct Ctx<'a> {
    cfg: &'a Config,
    sizes: Vec<u64>,
    progress: Progress,
    memcpy: Memcpy,
    veth: Option<Result<VethPair, String>>,
    loss_ok: Result<(), String>,
}

/// Loss trials per datagram path (sweep + search), for the progress bar.
const LOSS_STEPS: u64 = 7 + 7;
const LOSS_FRACTIONS: [f64; 6] = [0.25, 0.5, 0.75, 0.9, 1.0, 1.1];

/// Runs the whole characterization and returns the report (nothing is written here).
pub fn run(cfg: &Config) -> anyhow::Result<Report> {
    teardown::install_signal_handler();
    let (started_utc, _) = report::utc_now();
    let t0 = Instant::now();
    if cfg.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let (sizes, mut skipped) = check_sizes(&cfg.sizes);
    let (paths, unknown) = select_paths(cfg.paths.as_deref());
    skipped.extend(unknown);
    let steps: u64 = paths
        .iter()
        .filter(|p| p.not_yet.is_none())
        .map(|p| {
            sizes.len() as u64 * cfg.repeat as u64 * 2
                + if p.kind == Kind::Datagram {
                    LOSS_STEPS
                } else {
                    0
                }
        })
        .sum();
    let progress = Progress::new(steps.max(1), cfg.quiet);
    for s in &skipped {
        progress.warn(&format!("skipping {}: {}", s.what, s.reason));
    }
    if sizes.is_empty() {
        bail!(
            "no message size left to measure (sizes go from {MIN_SIZE} B to {})",
            report::human_bytes(MAX_SIZE)
        );
    }
    let loss_ok = if (16..=link_max_loss_bytes()).contains(&cfg.loss_bytes) {
        Ok(())
    } else {
        Err(format!(
            "loss datagram size {} is out of range (16 B to {} B, one datagram on every path)",
            cfg.loss_bytes,
            link_max_loss_bytes()
        ))
    };
    progress.phase("memcpy reference");
    let mc_start = memcpy::measure(MEMCPY_BYTES, 5);
    let mc_cache = memcpy::measure(memcpy::IN_CACHE_BYTES, 200);
    let load = cfg.load.then(Load::start);
    let mut ctx = Ctx {
        cfg,
        sizes: sizes.clone(),
        progress,
        memcpy: mc_start,
        veth: None,
        loss_ok,
    };
    // UCX first: its CPU is read from reaped children, so no other child (a fabric supervisor
    // being reaped after its fabric stopped) may be reaped meanwhile.
    let mut order: Vec<&PathDef> = paths.clone();
    order.sort_by_key(|p| p.kind != Kind::Ucx);
    let mut reports = Vec::new();
    for def in order {
        let pr = if let Some(why) = def.not_yet {
            let mut pr = PathReport::new(def.name, def.title, def.kind.as_str(), def.copies);
            pr.status = Status::NotAvailable;
            pr.reason = Some(why.into());
            pr
        } else {
            ctx.progress.phase(def.name);
            let pr = match def.kind {
                Kind::Ucx => run_ucx(&mut ctx, def),
                Kind::Dma => run_dma_path(&mut ctx, def),
                _ => run_link_path(&mut ctx, def),
            };
            if let Some(why) = &pr.reason {
                ctx.progress.warn(&format!("{}: {why}", def.name));
            }
            pr
        };
        reports.push(pr);
    }
    reports.sort_by_key(|p| PATHS.iter().position(|d| d.name == p.name));
    drop(ctx.veth.take());
    drop(load);
    ctx.progress.phase("memcpy reference");
    let mc_end = memcpy::measure(MEMCPY_BYTES, 5);
    ctx.progress.finish();
    let reference = mc_start.mb_per_s.max(mc_end.mb_per_s);
    // Ratios refer to the better memcpy of the run.
    for p in &mut reports {
        for t in &mut p.throughput {
            t.ratio_to_memcpy = t.mb_per_s / reference;
        }
        if let Some(f) = &mut p.latency_fit {
            *f = FitOut::new(
                stats::LineFit {
                    intercept: f.intercept_us,
                    slope: f.slope_us_per_byte,
                    r2: f.r2,
                    points: f.points,
                },
                1.0 / reference,
                p.copies,
            );
        }
    }
    for p in &reports {
        if matches!(p.status, Status::Skipped | Status::Failed | Status::Partial) {
            skipped.push(Skip {
                what: p.name.clone(),
                reason: p.reason.clone().unwrap_or_default(),
            });
        }
    }
    let link_model = cfg
        .link
        .as_deref()
        .map(report::LinkModelOut::new)
        .transpose()?;
    let mut summary = report::summarize(&reports);
    if let Some(m) = &link_model {
        for row in summary.iter_mut().filter(|r| r.path.starts_with("fabric")) {
            row.model_mb_per_s = Some(m.effective_mb_per_s);
            row.model_slope_us_per_byte = Some(m.latency_slope_us_per_byte);
        }
    }
    let mut report = Report {
        link_model,
        published: Vec::new(),
        version: report::VERSION,
        tool: "backplane bench".into(),
        backplane_version: env!("CARGO_PKG_VERSION").into(),
        started_utc,
        elapsed_s: t0.elapsed().as_secs_f64(),
        host: report::host(),
        config: ConfigOut {
            sizes,
            duration_s: cfg.duration.as_secs_f64(),
            warmup_s: cfg.warmup.as_secs_f64(),
            repeat: cfg.repeat,
            load: cfg.load,
            loss_bytes: cfg.loss_bytes,
            paths_requested: paths.iter().map(|p| p.name.to_string()).collect(),
        },
        memcpy: MemcpyOut {
            start: mc_start,
            end: Some(mc_end),
            in_cache: mc_cache,
            reference_mb_per_s: reference,
            slope_us_per_byte: 1.0 / reference,
        },
        paths: reports,
        summary,
        skipped,
        notes: general_notes(cfg),
    };
    report.published = crate::published::rows(&report);
    Ok(report)
}

fn link_max_loss_bytes() -> u64 {
    crate::link::MAX_UDP as u64
}

fn general_notes(cfg: &Config) -> Vec<String> {
    let mut n = vec![
        "Throughput is goodput: payload bytes the receiver got per second, timed by the receiver \
         over the measurement window (warm-up excluded); MB = 10^6 bytes."
            .to_string(),
        "Latency is one-way = round trip / 2 of a ping-pong, as perftest reports it; the \
         receiver reads every cache line of every message."
            .into(),
        "CPU: each side's user+system time from getrusage (client: the measuring thread; server: \
         the peer process; UCX: each ucx_perftest process), in % of one processor; the machine's \
         split (user, system, irq, softirq) from /proc/stat includes everything else the \
         machine ran. Service demand = CPU µs of both sides per MB moved."
            .into(),
        "Jitter is the full width at half maximum of the latency histogram.".into(),
        "Paths run one after another, never at the same time; the client and the peer are \
         separate processes on the same host."
            .into(),
    ];
    if cfg.load {
        n.push(
            "--load: a background thread wrote 8 MB blocks in a loop for the whole run, \
             competing for memory bandwidth and a processor."
                .into(),
        );
    }
    n
}

/// Where the client side of a path runs.
enum Client {
    /// In the bench's own thread.
    Here(Box<dyn Link>),
    /// In a `bench-peer` of kind `tcp-client` (a process of its own, e.g. one the socket
    /// acceleration library is preloaded into).
    Process(PeerProc),
}

/// What a set-up path hands to the measurements. Fields drop in order: client, peer, handles,
/// then the guards that remove the resources.
struct Setup {
    client: Client,
    /// The next datagram stamp: stamps rise over the whole life of a path, so a straggler
    /// of an earlier operation is told apart from the current one's datagrams.
    next_stamp: u64,
    peer: PeerProc,
    lossy: bool,
    _fabric: Option<Fabric>,
    _guards: Vec<Guard>,
}

/// Starts a bench peer of `kind` at `at` (fabric node 2, port [`PEER_PORT`] for the fabric
/// kinds), in namespace `ns` if given. Its configuration travels typed on its standard input;
/// the command line carries the kind only as a label for `ps`.
fn spawn_peer(
    ctx: &Ctx,
    ns: Option<&str>,
    kind: peer::PeerKind,
    at: &str,
) -> anyhow::Result<PeerProc> {
    let mut v = Vec::new();
    if let Some(ns) = ns {
        v.extend(["ip", "netns", "exec", ns].map(String::from));
    }
    v.push(ctx.cfg.exe.to_string_lossy().into_owned());
    v.extend(["bench-peer", kind.as_str()].map(String::from));
    PeerProc::spawn(
        &v,
        &peer::PeerConfig {
            kind,
            at: at.to_string(),
            node: 2,
            port: PEER_PORT,
        },
    )
}

/// Starts a bench peer of `kind` (`tcp` listening at `at`, or `tcp-client` connecting to
/// it) in node `node` of fabric `fabric` with its TCP accelerated: under `backplane exec
/// --accel`, which preloads the socket library.
fn spawn_accel(
    ctx: &Ctx,
    fabric: &str,
    node: u32,
    kind: peer::PeerKind,
    at: &str,
) -> anyhow::Result<PeerProc> {
    let exe = ctx.cfg.exe.to_string_lossy().into_owned();
    let node = node.to_string();
    let v: Vec<String> = [
        &exe,
        "exec",
        "--name",
        fabric,
        "--accel",
        &node,
        "--",
        &exe,
        "bench-peer",
        kind.as_str(),
    ]
    .map(String::from)
    .into();
    PeerProc::spawn(
        &v,
        &peer::PeerConfig {
            kind,
            at: at.to_string(),
            node: 0,
            port: 0,
        },
    )
}

/// The socket library's own word that the bench connection went onto rings: both nodes
/// count it as accelerated, or the path would measure the kernel's TCP under another name.
fn check_accelerated(fabric: &str) -> anyhow::Result<()> {
    use backplane::fabric::accel::read_stats;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (a, b) = (read_stats(fabric, 1), read_stats(fabric, 2));
        if [&a, &b]
            .iter()
            .all(|s| s.as_ref().is_some_and(|s| s.connections >= 1))
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let why: Vec<String> = [a, b]
                .iter()
                .flatten()
                .flat_map(|s| s.fallbacks.iter().map(|(k, n)| format!("{k} ×{n}")))
                .collect();
            bail!(
                "the connection stayed on the kernel's TCP (fallbacks: {})",
                if why.is_empty() {
                    "none counted".to_string()
                } else {
                    why.join(", ")
                }
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A client in the bench's own thread.
fn here(l: impl Link + 'static) -> Client {
    Client::Here(Box::new(l))
}

fn veth<'c>(ctx: &'c mut Ctx) -> anyhow::Result<&'c VethPair> {
    if ctx.veth.is_none() {
        let tag = std::process::id().to_string();
        ctx.veth = Some(VethPair::create(&tag).map_err(|e| format!("{e:#}")));
    }
    match ctx.veth.as_ref().expect("set above") {
        Ok(v) => Ok(v),
        Err(e) => bail!("{e}"),
    }
}

/// Brings up a temporary 2-node fabric (with IP over it when `net` is given, and the run's
/// link model) whose removal is registered in `guards`; returns its name and a handle.
fn start_fabric(
    ctx: &Ctx,
    guards: &mut Vec<Guard>,
    net: Option<NetPlan>,
) -> anyhow::Result<(String, Fabric)> {
    let fname = format!("bench-{}", std::process::id());
    guards.push(teardown::fabric(&fname));
    let options = launch::Options {
        name: fname.clone(),
        nodes: 2,
        window_size: 64 << 20,
        restart_delay_ms: 0,
        exe: ctx.cfg.exe.clone(),
        net,
        link: ctx
            .cfg
            .link
            .clone()
            .map(|m| (m, backplane::model::Forwarding::CutThrough)),
        topology: None,
        hosts: None,
    };
    teardown::starting(&fname, || launch::start(&options))
        .context("cannot start a temporary fabric")?;
    let f = Fabric::attach(&fname)?;
    Ok((fname, f))
}

fn setup(ctx: &mut Ctx, name: &str) -> anyhow::Result<Setup> {
    use peer::PeerKind as K;
    let mut guards = Vec::new();
    let mut fabric = None;
    let (client, peer, lossy): (Client, PeerProc, bool) = match name {
        "fabric-dgram" => {
            let (fname, f) = start_fabric(ctx, &mut guards, None)?;
            let peer = spawn_peer(ctx, None, K::Fabric, &fname)?;
            let mut ep = f.node(1)?.bind(0)?;
            let to = Addr::new(2, PEER_PORT);
            peer::fabric_hello(&mut ep, to)?;
            fabric = Some(f);
            (here(FabricLink::new(ep, to)), peer, false)
        }
        "fabric-verbs-write" | "fabric-verbs-read" | "fabric-verbs-send" => {
            let kind = match name {
                "fabric-verbs-write" => K::VerbsWrite,
                "fabric-verbs-read" => K::VerbsRead,
                _ => K::VerbsSend,
            };
            let mode = kind.verbs_mode().expect("a verbs kind");
            let (fname, f) = start_fabric(ctx, &mut guards, None)?;
            let peer = spawn_peer(ctx, None, kind, &fname)?;
            let link = VerbsLink::connect(&f.node(1)?, 2, PEER_PORT, mode, Duration::from_secs(10))
                .context("cannot connect to the bench peer's queue pair")?;
            fabric = Some(f);
            (here(link), peer, false)
        }
        "fabric-tcp" | "fabric-tcp-accel" | "fabric-udp" => {
            // Node 1's and node 2's namespaces, joined by nothing but the fabric.
            let plan = NetPlan::new(net::DEFAULT_SUBNET, net::DEFAULT_MTU, 2)?;
            let (fname, f) = start_fabric(ctx, &mut guards, Some(plan))?;
            let (ns1, ns2) = (net::netns_name(&fname, 1), net::netns_name(&fname, 2));
            let at = format!("{}:0", plan.address(2));
            fabric = Some(f);
            if name == "fabric-tcp-accel" {
                let peer = spawn_accel(ctx, &fname, 2, K::Tcp, &at)?;
                let client = spawn_accel(ctx, &fname, 1, K::TcpClient, &peer.addr)?;
                check_accelerated(&fname)?;
                (Client::Process(client), peer, false)
            } else if name == "fabric-tcp" {
                let peer = spawn_peer(ctx, Some(&ns2), K::Tcp, &at)?;
                let addr: SocketAddr = peer.addr.parse()?;
                let s = netns::in_ns(&ns1, move || Ok(TcpStream::connect(addr)?))?;
                s.set_nodelay(true)?;
                (here(StreamLink::new(s)), peer, false)
            } else {
                let peer = spawn_peer(ctx, Some(&ns2), K::Udp, &at)?;
                let addr: SocketAddr = peer.addr.parse()?;
                let me = format!("{}:0", plan.address(1));
                let s = netns::in_ns(&ns1, move || Ok(UdpSocket::bind(me)?))?;
                peer::udp_hello(&s, addr)?;
                (here(UdpLink::new(s)), peer, true)
            }
        }
        "tcp-loopback" => {
            let peer = spawn_peer(ctx, None, K::Tcp, "127.0.0.1:0")?;
            let s = TcpStream::connect(peer.addr.parse::<SocketAddr>()?)?;
            s.set_nodelay(true)?;
            (here(StreamLink::new(s)), peer, false)
        }
        "udp-loopback" => {
            let peer = spawn_peer(ctx, None, K::Udp, "127.0.0.1:0")?;
            let s = UdpSocket::bind("127.0.0.1:0")?;
            peer::udp_hello(&s, peer.addr.parse()?)?;
            (here(UdpLink::new(s)), peer, true)
        }
        "unix-stream" => {
            let dir = std::env::temp_dir().join(format!("bpb-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let d = dir.clone();
            guards.push(teardown::register(
                format!("directory {}", dir.display()),
                move || {
                    let _ = std::fs::remove_dir_all(&d);
                },
            ));
            let path = dir.join("peer.sock");
            let peer = spawn_peer(ctx, None, K::Unix, &path.to_string_lossy())?;
            let s = UnixStream::connect(&path)?;
            (here(StreamLink::new(s)), peer, false)
        }
        "tcp-veth" | "udp-veth" => {
            let tcp = name == "tcp-veth";
            let (ns_b, at) = {
                let v = veth(ctx)?;
                (v.ns_b.clone(), format!("{}:0", netns::ADDR_B))
            };
            let kind = if tcp { K::Tcp } else { K::Udp };
            let peer = spawn_peer(ctx, Some(&ns_b), kind, &at)?;
            let addr: SocketAddr = peer.addr.parse()?;
            let v = veth(ctx)?;
            if tcp {
                let s = v.in_a(move || Ok(TcpStream::connect(addr)?))?;
                s.set_nodelay(true)?;
                (here(StreamLink::new(s)), peer, false)
            } else {
                let s = v.in_a(|| Ok(UdpSocket::bind(format!("{}:0", netns::ADDR_A))?))?;
                peer::udp_hello(&s, addr)?;
                (here(UdpLink::new(s)), peer, true)
            }
        }
        other => bail!("no set-up for path {other}"),
    };
    Ok(Setup {
        client,
        next_stamp: 1,
        peer,
        lossy,
        _fabric: fabric,
        _guards: guards,
    })
}

fn run_link_path(ctx: &mut Ctx, def: &PathDef) -> PathReport {
    let mut pr = PathReport::new(def.name, def.title, def.kind.as_str(), def.copies);
    if def.name.ends_with("-veth")
        || matches!(def.name, "fabric-tcp" | "fabric-tcp-accel" | "fabric-udp")
    {
        if let Some(why) = netns::unavailable() {
            pr.status = Status::Skipped;
            pr.reason = Some(why);
            ctx.progress.inc(steps_of(ctx, def));
            return pr;
        }
    }
    if def.name == "fabric-tcp-accel" {
        let lib = ctx.cfg.exe.with_file_name("libbackplane_sockets.so");
        if !lib.is_file() {
            pr.status = Status::Skipped;
            pr.reason = Some(format!(
                "{} is not built (cargo build -p backplane-sockets)",
                lib.display()
            ));
            ctx.progress.inc(steps_of(ctx, def));
            return pr;
        }
    }
    set_up_and_measure(
        ctx,
        def,
        &mut pr,
        |ctx| setup(ctx, def.name),
        |ctx, s, pr| measure_link(ctx, def, s, pr),
    );
    pr
}

fn run_dma_path(ctx: &mut Ctx, def: &PathDef) -> PathReport {
    let mut pr = PathReport::new(def.name, def.title, def.kind.as_str(), def.copies);
    let mut guards = Vec::new();
    let max = ctx.sizes.iter().copied().max().unwrap_or(MIN_SIZE);
    let set_up = set_up_and_measure(
        ctx,
        def,
        &mut pr,
        |ctx| {
            let (_, f) = start_fabric(ctx, &mut guards, None)?;
            let path = DmaPath::new(&f, max)?;
            Ok((f, path))
        },
        |ctx, (_, path), pr| measure_dma(ctx, def, path, pr),
    );
    if set_up.is_none() {
        return pr;
    }
    pr.notes.push(
        "client CPU is the submitting thread, server CPU the engine thread (the process's CPU \
         less the submitter's); latency is one job at a time from submission to its \
         completion, the whole transfer rather than half a round trip; jobs of at most 16 KiB \
         are copied by the submitter itself (the library's inline threshold); after every \
         throughput point the destination region is compared with the source byte for byte"
            .into(),
    );
    if ctx.cfg.link.is_some() {
        pr.notes.push(
            "the link model paces datagrams, not DMA jobs: this path runs at memory speed \
             whatever --link says (DMA link emulation is not built yet)"
                .into(),
        );
    }
    drop(set_up); // the regions and engines before the fabric
    drop(guards);
    pr
}

fn measure_dma(
    ctx: &mut Ctx,
    def: &PathDef,
    path: &mut DmaPath,
    pr: &mut PathReport,
) -> anyhow::Result<()> {
    let sizes = ctx.sizes.clone();
    sweep(
        ctx,
        def,
        pr,
        &sizes,
        path,
        |path, size, dur, warm| {
            let r = path.throughput(size, dur, warm)?;
            Ok(TpRun {
                mb_per_s: r.mb_per_s,
                msgs_per_s: r.jobs_per_s,
                client: r.submitter,
                client_used: r.submitter_used,
                server: r.engines,
                server_used: r.engines_used,
                machine: r.machine,
                machine_wall_ns: r.wall_ns,
                op_bytes: r.bytes,
                sent_dgrams: 0,
                peer: PeerResult::default(),
            })
        },
        |path, size, dur, warm| Ok((path.latency(size, dur, warm)?, 0)),
    )
}

/// The size sweep every path shares: `repeat` throughput runs per size, then `repeat`
/// latency runs per size (histograms merged, lost round trips summed), then the latency fit.
fn sweep<S: ?Sized>(
    ctx: &mut Ctx,
    def: &PathDef,
    pr: &mut PathReport,
    sizes: &[u64],
    s: &mut S,
    mut tp: impl FnMut(&mut S, u64, Duration, Duration) -> anyhow::Result<TpRun>,
    mut lat: impl FnMut(&mut S, u64, Duration, Duration) -> anyhow::Result<(Histogram<u64>, u64)>,
) -> anyhow::Result<()> {
    let cfg = ctx.cfg;
    for &size in sizes {
        ctx.progress.step(&format!(
            "{} throughput {}",
            def.name,
            report::human_bytes(size)
        ));
        let mut runs = Vec::new();
        for _ in 0..cfg.repeat {
            runs.push(tp(s, size, cfg.duration, cfg.warmup)?);
            ctx.progress.inc(1);
        }
        pr.throughput
            .push(throughput_point(size, &runs, ctx.memcpy.mb_per_s, def.kind));
    }
    for &size in sizes {
        ctx.progress.step(&format!(
            "{} latency {}",
            def.name,
            report::human_bytes(size)
        ));
        let mut merged = stats::new_histogram();
        let mut p50s = Vec::new();
        let mut lost = 0;
        for _ in 0..cfg.repeat {
            let (h, l) = lat(s, size, cfg.duration, cfg.warmup)?;
            if let Some(sum) = LatencySummary::from_histogram(&h) {
                p50s.push(sum.p50_us);
            }
            merged.add(&h).context("merging histograms")?;
            lost += l;
            ctx.progress.inc(1);
        }
        pr.latency
            .push(latency_point(size, cfg.repeat, &merged, &p50s, lost));
    }
    pr.latency_fit = fit(&pr.latency, ctx.memcpy.slope_us_per_byte, def.copies);
    Ok(())
}

/// Sets a path up and measures it; a failed set-up makes the path `failed`, a failure
/// part-way `partial` (or `failed` when nothing was measured), with the reason.
fn set_up_and_measure<S>(
    ctx: &mut Ctx,
    def: &PathDef,
    pr: &mut PathReport,
    setup: impl FnOnce(&mut Ctx) -> anyhow::Result<S>,
    measure: impl FnOnce(&mut Ctx, &mut S, &mut PathReport) -> anyhow::Result<()>,
) -> Option<S> {
    let mut s = match setup(ctx) {
        Ok(s) => s,
        Err(e) => {
            pr.status = Status::Failed;
            pr.reason = Some(format!("set-up failed: {e:#}"));
            ctx.progress.inc(steps_of(ctx, def));
            return None;
        }
    };
    if let Err(e) = measure(ctx, &mut s, pr) {
        let any = !pr.throughput.is_empty() || !pr.latency.is_empty();
        pr.status = if any { Status::Partial } else { Status::Failed };
        pr.reason = Some(format!("failed mid-run: {e:#}"));
    }
    Some(s)
}

fn steps_of(ctx: &Ctx, def: &PathDef) -> u64 {
    ctx.sizes.len() as u64 * ctx.cfg.repeat as u64 * 2
        + if def.kind == Kind::Datagram {
            LOSS_STEPS
        } else {
            0
        }
}

fn measure_link(
    ctx: &mut Ctx,
    def: &PathDef,
    s: &mut Setup,
    pr: &mut PathReport,
) -> anyhow::Result<()> {
    let cfg = ctx.cfg;
    let (sizes, too_big): (Vec<u64>, Vec<u64>) = ctx
        .sizes
        .iter()
        .partition(|&&s| def.largest_message().is_none_or(|(max, _)| s <= max));
    if let (Some((_, why)), false) = (def.largest_message(), too_big.is_empty()) {
        for &bytes in &too_big {
            pr.not_applicable.push(report::NotApplicable {
                bytes,
                reason: why.into(),
            });
        }
        ctx.progress
            .inc(too_big.len() as u64 * cfg.repeat as u64 * 2);
    }
    sweep(ctx, def, pr, &sizes, s, throughput_once, latency_once)?;
    if def.kind == Kind::Datagram {
        match &ctx.loss_ok {
            Ok(()) => {
                ctx.progress.step(&format!("{} loss", def.name));
                pr.loss = Some(loss_sweep(ctx, def, s)?);
            }
            Err(why) => {
                pr.notes.push(format!("loss not measured: {why}"));
                ctx.progress.inc(LOSS_STEPS);
            }
        }
    }
    if def.name == "fabric-dgram" {
        pr.notes.push(
            "messages over 64 KiB travel as consecutive 64 KiB datagrams; the receiver reads \
             them in place (zero-copy receive) through rings of a sixteenth of its window (1 to 4 MiB) in its own window"
                .into(),
        );
    }
    if def.largest_message().is_some() {
        pr.notes.push(
            "sizes over 65507 B are not measured (n/a): a UDP datagram holds no more; the \
             sockets keep the kernel's default buffer sizes, so bursts larger than the receive \
             buffer lose datagrams (a lost round trip is counted in `lost` after 200 ms)"
                .into(),
        );
    }
    Ok(())
}

fn fit(lat: &[LatencyPoint], memcpy_slope: f64, copies: f64) -> Option<FitOut> {
    let pts: Vec<(f64, f64)> = lat
        .iter()
        .filter(|l| l.p50_us > 0.0)
        .map(|l| (l.bytes as f64, l.p50_us))
        .collect();
    let xs: Vec<f64> = pts.iter().map(|p| p.0).collect();
    let ys: Vec<f64> = pts.iter().map(|p| p.1).collect();
    least_squares(&xs, &ys).map(|f| FitOut::new(f, memcpy_slope, copies))
}

/// One throughput run's raw numbers.
struct TpRun {
    mb_per_s: f64,
    msgs_per_s: f64,
    client: SideCpu,
    client_used: Rusage,
    server: SideCpu,
    server_used: Rusage,
    machine: Option<crate::cpu::MachineCpu>,
    machine_wall_ns: u64,
    op_bytes: u64,
    sent_dgrams: u64,
    peer: PeerResult,
}

fn throughput_once(
    s: &mut Setup,
    size: u64,
    dur: Duration,
    warm: Duration,
) -> anyhow::Result<TpRun> {
    let base = s.next_stamp;
    s.peer.start(&Command::Sink { base })?;
    let snap = Snapshot::take(Who::Thread);
    let (sent, remote) = match &mut s.client {
        Client::Here(link) => (drive::send_for(link.as_mut(), size, base, dur, warm)?, None),
        Client::Process(c) => {
            let r = c.run_client(&Command::Send {
                size,
                dur_ns: dur.as_nanos() as u64,
                warm_ns: warm.as_nanos() as u64,
            })?;
            (r.sent, Some((r.cpu, r.wall_ns)))
        }
    };
    s.next_stamp = base + sent.dgrams;
    let r = s.peer.stop(&Command::Stop {
        sent_bytes: sent.bytes,
        sent_dgrams: sent.dgrams,
        skip_bytes: sent.skip,
        lossy: s.lossy,
    })?;
    let (machine, mut client, mut client_used, wall) = snap.finish();
    if let Some((cpu, wall_ns)) = remote {
        (client, client_used) = (SideCpu::of(cpu, wall_ns), cpu);
    }
    if r.short {
        bail!(
            "the receiver got {} of {} bytes before the path went quiet",
            r.bytes,
            sent.bytes
        );
    }
    let secs = r.window_ns as f64 / 1e9;
    let mb_per_s = r.window_bytes as f64 / secs / 1e6;
    Ok(TpRun {
        mb_per_s,
        msgs_per_s: r.window_bytes as f64 / size as f64 / secs,
        client,
        client_used,
        server: SideCpu::of(r.cpu, r.cpu_wall_ns),
        server_used: r.cpu,
        machine,
        machine_wall_ns: wall,
        op_bytes: r.bytes,
        sent_dgrams: sent.dgrams,
        peer: r,
    })
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = xs.collect();
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn throughput_point(size: u64, runs: &[TpRun], memcpy: f64, kind: Kind) -> ThroughputPoint {
    let rates: Vec<f64> = runs.iter().map(|r| r.mb_per_s).collect();
    let e = estimate(&rates).expect("at least one run");
    let side = |f: &dyn Fn(&TpRun) -> SideCpu| SideCpu {
        user_pct: mean(runs.iter().map(|r| f(r).user_pct)),
        system_pct: mean(runs.iter().map(|r| f(r).system_pct)),
    };
    let mb: f64 = runs
        .iter()
        .map(|r| r.op_bytes as f64 / 1e6)
        .sum::<f64>()
        .max(1e-9);
    let cpu_us: f64 = runs
        .iter()
        .map(|r| (r.client_used.total_us() + r.server_used.total_us()) as f64)
        .sum();
    let machine = runs.iter().filter_map(|r| r.machine).next_back();
    let machine_busy_us: Option<f64> = runs
        .iter()
        .map(|r| {
            r.machine
                .map(|m| m.busy_pct / 100.0 * m.cpus as f64 * r.machine_wall_ns as f64 / 1000.0)
        })
        .sum();
    let dg = kind == Kind::Datagram;
    let sent: u64 = runs.iter().map(|r| r.sent_dgrams).sum();
    let uniq: u64 = runs.iter().map(|r| r.peer.unique).sum();
    let lost = sent.saturating_sub(uniq);
    ThroughputPoint {
        bytes: size,
        repeats: runs.len(),
        mb_per_s: e.mean,
        mb_per_s_ci95: [e.ci95_low, e.ci95_high],
        msgs_per_s: mean(runs.iter().map(|r| r.msgs_per_s)),
        ratio_to_memcpy: e.mean / memcpy,
        client_cpu: side(&|r| r.client),
        server_cpu: side(&|r| r.server),
        machine_cpu: machine,
        service_demand_us_per_mb: cpu_us / mb,
        machine_service_demand_us_per_mb: machine_busy_us.map(|b| b / mb),
        sent_dgrams: dg.then_some(sent),
        lost_dgrams: dg.then_some(lost),
        loss_pct: dg.then(|| 100.0 * lost as f64 / sent.max(1) as f64),
        duplicates: dg.then(|| runs.iter().map(|r| r.peer.duplicates).sum()),
        reordered: dg.then(|| runs.iter().map(|r| r.peer.reordered).sum()),
    }
}

/// Ping-pong for `warm` + `dur`; returns the histogram of one-way latencies (ns) after
/// warm-up and the number of round trips lost.
fn latency_once(
    s: &mut Setup,
    size: u64,
    dur: Duration,
    warm: Duration,
) -> anyhow::Result<(Histogram<u64>, u64)> {
    let base = s.next_stamp;
    s.peer.start(&Command::Echo { size, base })?;
    let (h, lost) = match &mut s.client {
        Client::Here(link) => {
            let p = drive::ping_for(link.as_mut(), size, base, dur, warm, s.lossy)?;
            s.next_stamp = p.next_stamp;
            (p.hist, p.lost)
        }
        Client::Process(c) => {
            let r = c.run_client(&Command::Ping {
                size,
                dur_ns: dur.as_nanos() as u64,
                warm_ns: warm.as_nanos() as u64,
            })?;
            (drive::hist_from_pairs(&r.latency)?, 0)
        }
    };
    s.peer.stop(&Command::Stop {
        sent_bytes: 0,
        sent_dgrams: 0,
        skip_bytes: 0,
        lossy: true,
    })?;
    Ok((h, lost))
}

fn latency_point(
    size: u64,
    repeats: usize,
    h: &Histogram<u64>,
    p50s: &[f64],
    lost: u64,
) -> LatencyPoint {
    let Some(s) = LatencySummary::from_histogram(h) else {
        return LatencyPoint {
            bytes: size,
            repeats,
            lost,
            ..LatencyPoint::default()
        };
    };
    let ci = estimate(p50s)
        .map(|e| [e.ci95_low, e.ci95_high])
        .unwrap_or([s.p50_us, s.p50_us]);
    LatencyPoint {
        bytes: size,
        repeats,
        samples: s.samples,
        lost,
        p50_us: s.p50_us,
        p50_ci95_us: ci,
        mean_us: s.mean_us,
        min_us: Some(s.min_us),
        p90_us: Some(s.p90_us),
        p99_us: Some(s.p99_us),
        p999_us: Some(s.p999_us),
        p9999_us: Some(s.p9999_us),
        max_us: Some(s.max_us),
        jitter_fwhm_us: Some(s.jitter_fwhm_us),
    }
}

/// One loss trial: offer datagrams of `bytes` at `rate` (None: as fast as possible) for
/// `dur` with non-blocking sends.
fn loss_trial(
    s: &mut Setup,
    bytes: usize,
    rate: Option<f64>,
    dur: Duration,
) -> anyhow::Result<LossTrial> {
    let base = s.next_stamp;
    s.peer.start(&Command::Sink { base })?;
    let mut d = vec![0x3Cu8; bytes];
    let (mut offered, mut accepted) = (0u64, 0u64);
    let t0 = Instant::now();
    loop {
        let el = t0.elapsed();
        if el >= dur {
            break;
        }
        let due = match rate {
            Some(r) => (el.as_secs_f64() * r) as u64 + 1,
            None => offered + 64,
        };
        let due = due.min(offered + 256);
        while offered < due {
            put_stamp(&mut d, base + accepted);
            let Client::Here(link) = &mut s.client else {
                bail!("the loss trials need a datagram client in the bench");
            };
            if link.try_send(&d)? {
                accepted += 1;
            }
            offered += 1;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    s.next_stamp = base + accepted;
    let r = s.peer.stop(&Command::Stop {
        sent_bytes: accepted * bytes as u64,
        sent_dgrams: accepted,
        skip_bytes: 0,
        lossy: true,
    })?;
    let lost = accepted.saturating_sub(r.unique);
    let not_accepted = offered - accepted;
    let offered_rate = offered as f64 / secs;
    Ok(LossTrial {
        target_msgs_per_s: rate,
        offered_msgs_per_s: offered_rate,
        offered_mb_per_s: offered_rate * bytes as f64 / 1e6,
        offered,
        not_accepted,
        lost,
        duplicates: r.duplicates,
        reordered: r.reordered,
        received: r.unique,
        loss_pct: 100.0 * (not_accepted + lost) as f64 / offered.max(1) as f64,
    })
}

/// Loss at fractions of the capacity, then a binary search for the highest zero-loss rate.
fn loss_sweep(ctx: &mut Ctx, def: &PathDef, s: &mut Setup) -> anyhow::Result<LossReport> {
    let bytes = ctx.cfg.loss_bytes as usize;
    let dur = ctx.cfg.duration;
    let unpaced = loss_trial(s, bytes, None, dur)?;
    ctx.progress.inc(1);
    let capacity = unpaced.received as f64 / dur.as_secs_f64();
    let mut sweep = Vec::new();
    for f in LOSS_FRACTIONS {
        sweep.push(loss_trial(s, bytes, Some(capacity * f), dur)?);
        ctx.progress.inc(1);
    }
    sweep.push(unpaced);
    // RFC 2544 style: the highest rate known good, the lowest known bad, halve the gap.
    let good = |t: &LossTrial| t.zero_loss();
    let mut lo = sweep
        .iter()
        .filter(|t| good(t))
        .map(|t| t.offered_msgs_per_s)
        .fold(0.0, f64::max);
    let mut hi = sweep
        .iter()
        .filter(|t| !good(t) && t.offered_msgs_per_s > lo)
        .map(|t| t.offered_msgs_per_s)
        .fold(f64::INFINITY, f64::min);
    let mut best = (lo > 0.0).then_some(lo);
    let mut search = Vec::new();
    let mut steps = 0;
    while hi.is_finite() && steps < LOSS_STEPS - 7 && hi - lo > 0.02 * capacity.max(1.0) {
        let mid = (lo + hi) / 2.0;
        let t = loss_trial(s, bytes, Some(mid), dur)?;
        ctx.progress.inc(1);
        if good(&t) {
            lo = t.offered_msgs_per_s.max(lo);
            best = Some(lo);
        } else {
            hi = mid;
        }
        search.push(t);
        steps += 1;
    }
    ctx.progress.inc(LOSS_STEPS - 7 - steps);
    let method = if def.name.starts_with("fabric") {
        "Fabric datagrams are lossless by construction: a blocking send waits for room in the \
         receiver's ring. Here the sender uses non-blocking sends (WouldBlock when the ring is \
         full) and counts a refused datagram as 'not accepted' and drops it, as a full \
         transmit queue would; 'lost' (accepted, never received) stays 0."
    } else {
        "Non-blocking sends: EAGAIN/ENOBUFS count as 'not accepted'; datagrams the kernel \
         accepted but the receiver never got (its socket buffer overflowed) count as 'lost'."
    };
    let mut method = method.to_string();
    if sweep.last().is_some_and(good) {
        method += " The receiver kept up even with the sender at full speed (no loss when \
                   offering as fast as possible): the zero-loss rate is the sender's limit.";
    }
    Ok(LossReport {
        bytes: bytes as u64,
        capacity_msgs_per_s: capacity,
        sweep,
        search,
        zero_loss_msgs_per_s: best,
        zero_loss_mb_per_s: best.map(|b| b * bytes as f64 / 1e6),
        method,
    })
}

/// UCX over shared memory: `ucx_perftest` `tag_bw` and `tag_lat` at every size.
fn run_ucx(ctx: &mut Ctx, def: &PathDef) -> PathReport {
    let mut pr = PathReport::new(def.name, def.title, def.kind.as_str(), def.copies);
    let Some(exe) = ucx::which("ucx_perftest") else {
        pr.status = Status::Skipped;
        pr.reason = Some("ucx_perftest is not installed (Debian package ucx-utils)".into());
        ctx.progress.inc(steps_of(ctx, def));
        return pr;
    };
    if let Err(e) = measure_ucx(ctx, &exe, &mut pr) {
        let any = !pr.throughput.is_empty() || !pr.latency.is_empty();
        pr.status = if any { Status::Partial } else { Status::Failed };
        pr.reason = Some(format!("ucx_perftest failed: {e:#}"));
    }
    pr.notes.push(
        "ucx_perftest reports only the median and the mean latency, so UCX has no percentiles \
         or jitter; its bandwidth is the sender's view (overall_bw), converted to 10^6 bytes/s; \
         its CPU is each process's whole life (start-up and connection included) over the \
         client's wall time, so it understates the busy polling of the measured part and \
         overstates the service demand of short runs"
            .into(),
    );
    pr
}

fn measure_ucx(ctx: &mut Ctx, exe: &std::path::Path, pr: &mut PathReport) -> anyhow::Result<()> {
    let cfg = ctx.cfg;
    let dur_us = (cfg.duration + cfg.warmup).as_secs_f64() * 1e6;
    let slope = ctx.memcpy.slope_us_per_byte;
    for test in [UcxTest::TagBw, UcxTest::TagLat] {
        // Iterations chosen so a run lasts about warm-up + duration: from the time per
        // iteration of the previous size plus the copies the size difference costs.
        let mut per_iter_us = 1.0;
        let mut prev = ctx.sizes[0];
        for &size in &ctx.sizes.clone() {
            ctx.progress.step(&format!(
                "ucx-shm {} {}",
                test.name(),
                report::human_bytes(size)
            ));
            let est = per_iter_us + (size.saturating_sub(prev)) as f64 * 2.0 * slope;
            let total = (dur_us / est.max(0.05)) as u64;
            let warm = (total as f64 * cfg.warmup.as_secs_f64()
                / (cfg.duration + cfg.warmup).as_secs_f64()) as u64;
            let iters = total.saturating_sub(warm).clamp(20, 5_000_000);
            let warm = warm.clamp(2, 1_000_000);
            let mut runs = Vec::new();
            for _ in 0..cfg.repeat {
                let m0 = ProcStat::now().ok();
                let r = ucx::run(exe, test, size, iters, warm)?;
                let m1 = ProcStat::now().ok();
                runs.push((r, m0.zip(m1).map(|(a, b)| a.until(&b))));
                ctx.progress.inc(1);
            }
            let r0 = runs[0].0;
            per_iter_us = match test {
                UcxTest::TagBw => 1e6 / r0.msg_rate.max(1.0),
                UcxTest::TagLat => 2.0 * r0.avg_lat_us,
            };
            prev = size;
            match test {
                UcxTest::TagBw => {
                    let rates: Vec<f64> = runs.iter().map(|r| r.0.bw_mb_per_s).collect();
                    let e = estimate(&rates).expect("one run");
                    let mb: f64 = runs
                        .iter()
                        .map(|r| (r.0.iterations + warm) as f64 * size as f64 / 1e6)
                        .sum();
                    let cpu_us: f64 = runs
                        .iter()
                        .map(|r| (r.0.client_cpu.total_us() + r.0.server_cpu.total_us()) as f64)
                        .sum();
                    let side = |f: &dyn Fn(&ucx::UcxResult) -> SideCpu| SideCpu {
                        user_pct: mean(runs.iter().map(|r| f(&r.0).user_pct)),
                        system_pct: mean(runs.iter().map(|r| f(&r.0).system_pct)),
                    };
                    let machine = runs.iter().filter_map(|r| r.1).next_back();
                    let busy: Option<f64> = runs
                        .iter()
                        .map(|r| {
                            r.1.map(|m| {
                                m.busy_pct / 100.0 * m.cpus as f64 * r.0.wall_ns as f64 / 1000.0
                            })
                        })
                        .sum();
                    pr.throughput.push(ThroughputPoint {
                        bytes: size,
                        repeats: runs.len(),
                        mb_per_s: e.mean,
                        mb_per_s_ci95: [e.ci95_low, e.ci95_high],
                        msgs_per_s: mean(runs.iter().map(|r| r.0.msg_rate)),
                        ratio_to_memcpy: e.mean / ctx.memcpy.mb_per_s,
                        client_cpu: side(&|r| SideCpu::of(r.client_cpu, r.wall_ns)),
                        server_cpu: side(&|r| SideCpu::of(r.server_cpu, r.wall_ns)),
                        machine_cpu: machine,
                        service_demand_us_per_mb: cpu_us / mb.max(1e-9),
                        machine_service_demand_us_per_mb: busy.map(|b| b / mb.max(1e-9)),
                        sent_dgrams: None,
                        lost_dgrams: None,
                        loss_pct: None,
                        duplicates: None,
                        reordered: None,
                    });
                }
                UcxTest::TagLat => {
                    let p50s: Vec<f64> = runs.iter().map(|r| r.0.typical_lat_us).collect();
                    let e = estimate(&p50s).expect("one run");
                    pr.latency.push(LatencyPoint {
                        bytes: size,
                        repeats: runs.len(),
                        samples: runs.iter().map(|r| r.0.iterations).sum(),
                        lost: 0,
                        p50_us: e.mean,
                        p50_ci95_us: [e.ci95_low, e.ci95_high],
                        mean_us: mean(runs.iter().map(|r| r.0.avg_lat_us)),
                        ..LatencyPoint::default()
                    });
                }
            }
        }
    }
    pr.latency_fit = fit(&pr.latency, slope, pr.copies);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_paths_are_skipped_with_the_list_of_known_ones() {
        let (sel, skips) = select_paths(Some(&["tcp-loopback".into(), "warp-drive".into()]));
        assert_eq!(sel.len(), 1);
        assert_eq!(sel[0].name, "tcp-loopback");
        assert_eq!(skips.len(), 1);
        assert_eq!(skips[0].what, "warp-drive");
        assert!(
            skips[0].reason.contains("fabric-dgram"),
            "{}",
            skips[0].reason
        );
        let (all, none) = select_paths(None);
        assert_eq!(all.len(), PATHS.len());
        assert!(none.is_empty());
    }

    #[test]
    fn sizes_out_of_range_are_skipped_and_the_rest_sorted_once() {
        let (ok, skips) = check_sizes(&[4096, 1, 64, 4096, 1 << 40]);
        assert_eq!(ok, [64, 4096]);
        assert_eq!(skips.len(), 2);
        assert!(skips[0].reason.contains("out of range"));
        assert_eq!(default_sizes().first(), Some(&64));
        assert_eq!(default_sizes().last(), Some(&(8 << 20)));
        assert_eq!(default_sizes().len(), 18);
    }

    #[test]
    fn every_path_has_a_unique_name_and_the_future_ones_say_so() {
        for (i, p) in PATHS.iter().enumerate() {
            assert!(PATHS[i + 1..].iter().all(|q| q.name != p.name));
            if let Some(why) = p.not_yet {
                assert!(
                    why.contains("`backplane perf"),
                    "says where it is measured: {why}"
                );
            }
        }
    }
}
