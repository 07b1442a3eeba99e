//! `backplane perf`: perftest-like micro benchmarks of the fabric's datagram path and of RDMA
//! verbs over it, measured side by side with UCX over shared memory (`ucx_perftest`) in the
//! same run (and, for bandwidth, with a single-thread memcpy).
//!
//! The local side runs on node 1 in this process; the far side is a `perf-peer` process on
//! node 2. Datagram messages larger than one datagram (64 KiB) travel as consecutive
//! datagrams. The verbs tests (`write-lat` ... `atomic-lat`, in `perf/verbs.rs`) connect one
//! RC QP pair with the connection helper.

mod dma;
mod perftest;
mod verbs;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use backplane::dgram::{Addr, DgramError, Endpoint, Wait};
use backplane::fabric::Fabric;
use serde::Serialize;

use backplane_bench::perf_row::{median_rows, Row};
use backplane_bench::stats::{median, new_histogram};
use backplane_bench::{teardown, ucx};

use super::parse_size;

const PEER_PORT: u32 = 18515; // perftest's default port, for familiarity
const MAX_SIZE: u64 = 1 << 20;

/// Which benchmark.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Test {
    /// Datagram ping-pong latency (one-way = round trip / 2).
    DgramLat,
    /// Datagram streaming bandwidth and message rate.
    DgramBw,
    /// RDMA_WRITE ping-pong latency, polling memory (ib_write_lat; one-way = round trip / 2).
    WriteLat,
    /// RDMA_WRITE streaming bandwidth (ib_write_bw).
    WriteBw,
    /// RDMA_READ latency (ib_read_lat; the whole read).
    ReadLat,
    /// RDMA_READ streaming bandwidth (ib_read_bw).
    ReadBw,
    /// SEND/RECV ping-pong latency (ib_send_lat; one-way = round trip / 2).
    SendLat,
    /// SEND streaming bandwidth (ib_send_bw).
    SendBw,
    /// ATOMIC_FETCH_AND_ADD latency (ib_atomic_lat; the whole operation, 8 B).
    AtomicLat,
    /// IP over the fabric vs a veth pair: iperf3 TCP and sockperf latency (root).
    Ip,
    /// Raw DMA jobs node 1 -> node 2 by engine threads: bandwidth and the submitting thread's
    /// CPU time per GB, beside single-thread memcpy (sizes 1 KiB .. 64 MiB).
    DmaBw,
}

impl Test {
    fn name(self) -> &'static str {
        match self {
            Test::DgramLat => "dgram-lat",
            Test::DgramBw => "dgram-bw",
            Test::WriteLat => "write-lat",
            Test::WriteBw => "write-bw",
            Test::ReadLat => "read-lat",
            Test::ReadBw => "read-bw",
            Test::SendLat => "send-lat",
            Test::SendBw => "send-bw",
            Test::AtomicLat => "atomic-lat",
            Test::Ip => "ip",
            Test::DmaBw => "dma-bw",
        }
    }
    fn ucx_test(self) -> &'static str {
        match self {
            Test::DgramLat | Test::SendLat => "tag_lat",
            Test::DgramBw | Test::SendBw => "tag_bw",
            Test::WriteLat => "ucp_put_lat",
            Test::WriteBw => "ucp_put_bw",
            Test::ReadLat | Test::ReadBw => "ucp_get",
            Test::AtomicLat => "ucp_fadd",
            Test::Ip | Test::DmaBw => "tag_bw",
        }
    }
    /// Latency test (else bandwidth).
    fn is_lat(self) -> bool {
        matches!(
            self,
            Test::DgramLat | Test::WriteLat | Test::ReadLat | Test::SendLat | Test::AtomicLat
        )
    }
    /// A verbs test (else datagrams).
    fn is_verbs(self) -> bool {
        !matches!(self, Test::DgramLat | Test::DgramBw)
    }
    /// Ping-pong: latency is half the round trip (else the whole operation).
    fn halved(self) -> bool {
        matches!(self, Test::DgramLat | Test::WriteLat | Test::SendLat)
    }
    fn title(self) -> &'static str {
        match self {
            Test::DgramLat | Test::DgramBw => "backplane fabric datagrams",
            Test::WriteLat | Test::WriteBw => "RDMA_WRITE on an RC QP",
            Test::ReadLat | Test::ReadBw => "RDMA_READ on an RC QP",
            Test::SendLat | Test::SendBw => "SEND/RECV on an RC QP",
            Test::AtomicLat => "ATOMIC_FETCH_AND_ADD on an RC QP",
            Test::Ip => "IP over the fabric",
            Test::DmaBw => "raw DMA jobs",
        }
    }
    fn note(self) -> &'static str {
        match self {
            Test::DgramLat => " one-way latency = round trip / 2\n",
            Test::DgramBw => {
                " receiver reads every cache line of every payload in place (zero-copy receive)\n"
            }
            Test::WriteLat => {
                " one-way latency = round trip / 2; each side polls the last byte of its region\n"
            }
            Test::SendLat => " one-way latency = round trip / 2; both sides poll their CQ\n",
            Test::ReadLat | Test::AtomicLat => {
                " latency of the whole operation, post to completion\n"
            }
            Test::WriteBw | Test::ReadBw => {
                " one-sided: the initiator copies straight into / out of the peer's region\n"
            }
            Test::SendBw => {
                " the receiver copies each message from its ring into the posted buffer\n"
            }
            Test::Ip => " iperf3 and sockperf over bp0 and over veth\n",
            Test::DmaBw => " engine threads copy; the submitting thread only submits and waits\n",
        }
    }
}

/// Whether to run a peer program (`ucx_perftest` for `--ucx`, perftest's for `--perftest`)
/// alongside.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum UcxMode {
    /// Run it when it is installed; say so when it is not.
    Auto,
    /// Do not run it.
    Off,
    /// Fail if it is missing.
    Require,
}

/// The loop the verbs latency tests run on the backplane side (`--loop`).
#[derive(
    clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Loop {
    /// The fabric's own: requests signaled every 64th, a clock read per round trip on the
    /// client only, waiting loops that PAUSE.
    #[default]
    Native,
    /// perftest's (`run_iter_lat_write`, `run_iter_lat_send`, `run_iter_lat`), step for step
    /// over the Rust API: every request signaled and its completion polled before anything
    /// else, a clock read per iteration (on both sides of a ping-pong) and the time between
    /// consecutive reads as the sample, waiting loops without PAUSE, and in send-lat the
    /// receive reposted between the answer and the next send. perftest beside it then differs
    /// only by the drop-in libibverbs.so.1.
    Perftest,
}

/// Arguments of `perf`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The benchmark.
    #[arg(value_enum)]
    test: Test,
    /// Use this running fabric (nodes 1 and 2); default: a temporary 2-node fabric.
    #[arg(long)]
    name: Option<String>,
    /// Message size (8 B to 1 MiB; default 8 for latency, 1M for bandwidth).
    #[arg(short = 's', long = "size", value_parser = parse_size)]
    size: Option<u64>,
    /// Sweep sizes 8 B .. 1 MiB in powers of two.
    #[arg(short = 'a', long = "all")]
    all: bool,
    /// Iterations per size (default: 20000 for latency — READ and atomic latency on one host:
    /// a million, or about 1 GiB; about 1 GiB of traffic for bandwidth).
    #[arg(short = 'n', long = "iters")]
    iters: Option<u64>,
    /// Run `ucx_perftest` (UCX_TLS=posix,cma,self) with the same sizes in the same run.
    #[arg(long, value_enum, default_value = "auto")]
    ucx: UcxMode,
    /// Verbs tests: run perftest's program for the same operation (`ib_write_lat`, …),
    /// unmodified, over the fabric through the drop-in `libibverbs.so.1`, in the same run.
    #[arg(long, value_enum, default_value = "auto")]
    perftest: UcxMode,
    /// Latency tests: the backplane side's loop — its own, or perftest's step for step, so
    /// that `--perftest` beside it measures the drop-in library alone.
    #[arg(long = "loop", value_enum, default_value = "native")]
    loop_: Loop,
    /// Repeat the whole comparison this many times, backplane and its peer (UCX; veth for
    /// `ip`; memcpy for `dma-bw`) alternating, and report each field's median over the rounds
    /// with every round's ratio and their median (a shared, noisy machine moves single runs
    /// by tens of percent, so one run is never the figure to quote; `-r 1` for a quick look).
    #[arg(short = 'r', long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=50))]
    rounds: u32,
    /// Start the far side (the perf peer in node 2, and `ucx_perftest`'s server) through this
    /// command, e.g. `ssh hostb`, when node 2 runs on another host of the fabric (`--name`;
    /// the datagram, verbs and dma-bw tests — dma-bw then writes into the peer's region, at
    /// most 1 MiB per job, beside `ucp_put_bw`). `ucx_perftest` then runs between the two
    /// hosts with the environment's `UCX_TLS` (set it to what the fabric's hosts use, e.g.
    /// `tcp`).
    #[arg(long, value_name = "CMD", requires = "name")]
    peer_via: Option<String>,
    /// Print a JSON document (version 1) instead of tables.
    #[arg(long)]
    json: bool,
    /// ip: add the accelerated path (`exec --accel`: unmodified iperf3 and sockperf with
    /// `libbackplane_sockets.so`) and loopback to bp0 and veth, and measure latency over TCP
    /// (`sockperf --tcp`) on every path.
    #[arg(long)]
    accel: bool,
    /// Seconds per iperf3 run (ip only).
    #[arg(short = 'D', long = "duration", default_value_t = 5)]
    duration: u64,
    /// dma-bw: segments per job (the job's bytes split evenly between them).
    #[arg(long, default_value_t = 1)]
    segments: u64,
    /// dma-bw: DMA engine threads.
    #[arg(long, default_value_t = 1)]
    engines: usize,
    /// dma-bw: jobs of at most this many bytes are copied by the submitter itself
    /// (default: the library's, 16 KiB).
    #[arg(long, value_parser = parse_size)]
    inline_threshold: Option<u64>,
    /// dma-bw: pin engine i to CPU PIN[i % n] (comma-separated CPU numbers).
    #[arg(long, value_delimiter = ',')]
    pin: Vec<usize>,
    /// Run the measuring side on CPU CLIENT and the far side on CPU PEER — backplane's and
    /// its peer's alike (the perf peer, `ucx_perftest`'s and perftest's servers on PEER; this
    /// process and the clients it starts on CLIENT): on a small machine, unpinned rounds
    /// swing by tens of percent as the scheduler moves the busy-polling programs. With
    /// `--peer-via` the far side is pinned where the command runs it on this machine.
    #[arg(long, value_delimiter = ',', value_name = "CLIENT,PEER")]
    cpus: Vec<usize>,
}

/// Arguments of the far side.
#[derive(clap::Args, Debug)]
pub struct PeerArgs {
    /// Labels for `ps` (fabric name, test); the configuration comes on standard input.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    labels: Vec<String>,
}

/// What the perf peer runs: the first line (JSON) on its standard input.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
struct PeerConfig {
    name: String,
    test: Test,
    node: u32,
    port: u32,
    #[serde(default, rename = "loop")]
    loop_: Loop,
}

#[derive(Debug, Serialize)]
struct Report {
    version: u32,
    test: Test,
    fabric: String,
    /// The backplane side's loop (latency tests).
    #[serde(rename = "loop")]
    loop_: Loop,
    backplane: Vec<Row>,
    ucx: Option<Vec<Row>>,
    ucx_note: Option<String>,
    /// Where `ucx_perftest` ran: `UCX_TLS=posix,cma,self` on this host, or between the hosts
    /// of nodes 1 and 2 (`--peer-via`) with the environment's `UCX_TLS`.
    ucx_where: String,
    /// Between hosts (`--peer-via`): the TCP congestion control of this host's network
    /// namespace, where both senders' connections of a bandwidth test start (`bbr` paces each
    /// connection; see [`tcp_congestion_control`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    tcp_congestion_control: Option<String>,
    /// perftest's program for the same operation over the same fabric (verbs tests).
    #[serde(skip_serializing_if = "Option::is_none")]
    perftest: Option<Vec<Row>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    perftest_note: Option<String>,
    /// `--cpus`: the measuring side's CPU and the far side's.
    #[serde(skip_serializing_if = "Option::is_none")]
    cpus: Option<[usize; 2]>,
    /// With `--rounds` > 1: every round's rows (`backplane` and `ucx` above are then each
    /// field's median over these).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    rounds: Vec<Round>,
}

/// One round of a `--rounds` run.
#[derive(Debug, Clone, Serialize)]
struct Round {
    backplane: Vec<Row>,
    ucx: Option<Vec<Row>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    perftest: Option<Vec<Row>>,
}

fn sizes(a: &Args) -> anyhow::Result<Vec<u64>> {
    if a.test == Test::AtomicLat {
        return Ok(vec![8]); // atomics are 8 bytes
    }
    if a.all {
        return Ok((3..=20).map(|p| 1u64 << p).collect());
    }
    let s = a.size.unwrap_or(if a.test.is_lat() { 8 } else { MAX_SIZE });
    if !(1..=MAX_SIZE).contains(&s) {
        bail!("--size {s} is out of range: use 1 B to 1 MiB");
    }
    Ok(vec![s])
}

fn iters_for(a: &Args, size: u64) -> u64 {
    a.iters.unwrap_or(if one_sided_here(a) {
        // A READ or an atomic on one host takes ~50 ns: 20 000 of them were one millisecond,
        // which one hiccup of a shared VM moved by 2x (per-round ratios against `ucp_get`
        // from 0.26 to 1.96 in one run); a million (or about 1 GiB) lasts tens of ms.
        ((1u64 << 30) / size).clamp(20_000, 1_000_000)
    } else if a.test.is_lat() {
        20_000
    } else {
        ((1u64 << 30) / size).clamp(1_000, 500_000)
    })
}

/// A READ or atomic latency test between nodes of this host (no `--peer-via`).
fn one_sided_here(a: &Args) -> bool {
    matches!(a.test, Test::ReadLat | Test::AtomicLat) && a.peer_via.is_none()
}

pub fn run(a: Args) -> anyhow::Result<()> {
    teardown::install_signal_handler();
    let cpus = if a.cpus.is_empty() {
        None
    } else if matches!(a.test, Test::Ip | Test::DmaBw) {
        bail!(
            "--cpus is for the tests with a far side (not {}; dma-bw pins its engines with --pin)",
            a.test.name()
        );
    } else {
        Some(backplane_bench::pinning::set(&a.cpus)?)
    };
    if a.test == Test::Ip {
        return super::perf_ip::run(a.duration, a.json, a.rounds, a.accel);
    }
    if a.test == Test::DmaBw {
        return dma::run(&a);
    }
    // This thread measures, and starts the clients (UCX's, perftest's): they inherit its CPU.
    // (A temporary fabric's supervisor is started unpinned: see `measure_backplane`.)
    let unpinned = match cpus {
        Some((client, _)) => Some(
            backplane_bench::pinning::pin_this_thread(client)
                .with_context(|| format!("cannot run on CPU {client}"))?,
        ),
        None => None,
    };
    let sizes = sizes(&a)?;
    if a.loop_ == Loop::Perftest && !a.test.is_lat() {
        bail!(
            "--loop perftest is for the latency tests (the bandwidth loops are perftest's already)"
        );
    }
    if a.iters == Some(0) {
        bail!("--iters must be at least 1");
    }
    if a.peer_via.is_some() && a.perftest == UcxMode::Require {
        bail!(
            "--peer-via with --perftest: perftest's programs between hosts are run by \
             hand (`backplane exec --verbs` on each host)"
        );
    }
    let remote = remote_of(&a)?;
    if remote.is_some() {
        // `ucx_perftest` between the hosts runs UCX as the fabric's own links do (their TCP
        // segment sizes: 64 KiB `tag_bw` 2 537-2 980 MB/s with UCX's defaults, 3 096-3 583
        // with these, here), from the first round on: the ratios measure the layer, not a
        // setting.
        backplane_ucx::environment_defaults();
    }
    let ucx_path = ucx_perftest(a.ucx)?;
    let mut rounds = Vec::new();
    let mut fabric_name = String::new();
    let mut ucx_note = ucx_path.as_ref().err().cloned();
    let mut perftest_note = match (a.perftest, perftest::unavailable(a.test)) {
        _ if remote.is_some() => {
            Some("perftest is not run between hosts (start it with `exec --verbs` on each host, the server's node name, `nodeN`, to the client on a fabric with IP, its host's address otherwise)".into())
        }
        (_, None) => None,
        (UcxMode::Require, Some(why)) => bail!("{why}"),
        (UcxMode::Off, Some(_)) => None,
        (UcxMode::Auto, Some(why)) => Some(why),
    };
    let with_perftest = perftest::program(a.test).is_some()
        && a.perftest != UcxMode::Off
        && perftest_note.is_none();
    for round in 0..a.rounds {
        let (name, rows, pt) = measure_backplane(
            &a,
            &sizes,
            round == 0,
            with_perftest.then_some(&mut perftest_note),
            unpinned.as_ref().zip(cpus.map(|(client, _)| client)),
        )?;
        fabric_name = name;
        let ucx = match &ucx_path {
            Ok(path) => {
                let mut out = Vec::new();
                for &size in &sizes {
                    match ucx_run(path, a.test, size, iters_for(&a, size), remote.as_ref()) {
                        Ok(r) => out.push(r),
                        Err(e) => {
                            ucx_note = Some(format!("ucx_perftest failed at {size} B: {e:#}"));
                            break;
                        }
                    }
                }
                Some(out)
            }
            Err(_) => None,
        };
        if a.rounds > 1 && !a.json {
            eprintln!(
                "{}: round {} of {} done",
                a.test.name(),
                round + 1,
                a.rounds
            );
        }
        rounds.push(Round {
            backplane: rows,
            ucx,
            perftest: pt,
        });
    }
    let (rows, ucx, perftest) = if rounds.len() == 1 {
        let r = rounds.pop().expect("one round");
        (r.backplane, r.ucx, r.perftest)
    } else {
        let bp: Vec<&[Row]> = rounds.iter().map(|r| &r.backplane[..]).collect();
        let ucx: Option<Vec<&[Row]>> = rounds.iter().map(|r| r.ucx.as_deref()).collect();
        let pt: Option<Vec<&[Row]>> = rounds.iter().map(|r| r.perftest.as_deref()).collect();
        (
            median_rows(&bp),
            ucx.map(|u| median_rows(&u)),
            pt.map(|p| median_rows(&p)),
        )
    };
    let cc = remote.as_ref().and_then(|_| tcp_congestion_control());
    let report = Report {
        version: 1,
        test: a.test,
        fabric: fabric_name,
        loop_: a.loop_,
        backplane: rows,
        ucx,
        ucx_note,
        ucx_where: match &remote {
            Some(r) => {
                let var = |v: &str| std::env::var(v).unwrap_or_else(|_| "(UCX's choice)".into());
                format!(
                    "between the hosts, server at {}, UCX_TLS={}, UCX_TCP_TX_SEG_SIZE={} and \
                     UCX_TCP_RX_SEG_SIZE={} (as the fabric's links), TCP congestion control {}",
                    r.addr,
                    var("UCX_TLS"),
                    var("UCX_TCP_TX_SEG_SIZE"),
                    var("UCX_TCP_RX_SEG_SIZE"),
                    cc.as_deref().unwrap_or("unknown")
                )
            }
            None => "UCX_TLS=posix,cma,self".into(),
        },
        tcp_congestion_control: cc,
        perftest,
        perftest_note,
        cpus: cpus.map(|(c, p)| [c, p]),
        rounds,
    };
    if a.json {
        super::emit(&format!("{}\n", serde_json::to_string_pretty(&report)?))?;
    } else {
        super::emit(&render(&report))?;
    }
    Ok(())
}

/// One backplane measurement of every size: a temporary fabric (unless `--name`), the peer
/// process, the rows (with same-run memcpy for bandwidth), everything torn down after.
/// With `perftest` (the note to set if it fails), perftest's program for the same operation
/// runs next on the same fabric, after the backplane peer stopped.
fn measure_backplane(
    a: &Args,
    sizes: &[u64],
    first: bool,
    perftest: Option<&mut Option<String>>,
    pinned: Option<(&rustix::thread::CpuSet, usize)>,
) -> anyhow::Result<(String, Vec<Row>, Option<Vec<Row>>)> {
    // Everything this round starts is registered with the bench's teardown, so an error, a
    // return or Ctrl-C/SIGTERM (the handler `run` installs) removes it.
    let mut fabric_guard = None;
    let name = match &a.name {
        Some(n) => n.clone(),
        None => {
            let n = format!("perf-{}", std::process::id());
            fabric_guard = Some(teardown::fabric(&n));
            // Its supervisor and agents run wherever the machine puts them, not on the
            // measuring side's CPU (`--cpus`).
            let pinned_to = pinned.map(|(before, client)| {
                backplane_bench::pinning::restore(before);
                client
            });
            let up = teardown::starting(&n, || super::up::start(&n, 2, 64 << 20, 0));
            if let Some(client) = pinned_to {
                backplane_bench::pinning::pin_this_thread(client)?;
            }
            up?;
            n
        }
    };
    let fabric = Fabric::attach(&name)?;
    if fabric.nodes() < 2 {
        bail!("fabric '{name}' has one node; perf needs nodes 1 and 2");
    }
    let via: Option<Vec<String>> = a
        .peer_via
        .as_ref()
        .map(|v| v.split_whitespace().map(str::to_owned).collect());
    super::require_local(&fabric, if via.is_some() { &[1] } else { &[1, 2] })?;
    let (mut peer, peer_guard) = spawn_peer(&name, a.test, a.loop_, via.as_deref())?;
    let mut peer_guard = Some(peer_guard);
    let announce_run = || {
        if !a.json && first {
            eprintln!(
                "{}: fabric '{name}', node 1 <-> node 2, sizes {}..{} B",
                a.test.name(),
                sizes[0],
                sizes[sizes.len() - 1]
            );
        }
    };
    let mut peer_gone = |peer: &mut std::process::Child, e| {
        peer_exited(peer, peer_guard.take().expect("once"), via.as_deref(), e)
    };
    let mut rows = Vec::new();
    if a.test.is_verbs() {
        let iters: Vec<u64> = sizes.iter().map(|&s| iters_for(a, s)).collect();
        rows = verbs::client(
            &fabric,
            a.test,
            a.loop_,
            PEER_PORT,
            sizes,
            &iters,
            announce_run,
        )
        .map_err(|e| peer_gone(&mut peer, e))?;
    } else {
        let mut ep = fabric.node(1)?.bind(0)?;
        let to = Addr::new(2, PEER_PORT);
        backplane_bench::peer::fabric_hello_while(&mut ep, to, || {
            matches!(peer.try_wait(), Ok(None))
        })
        .context("perf peer")
        .map_err(|e| peer_gone(&mut peer, e))?;
        announce_run();
        for &size in sizes {
            let iters = iters_for(a, size);
            let row = match a.test {
                Test::DgramLat => lat_client(&mut ep, to, size, iters)?,
                _ => bw_client(&mut ep, to, size, iters)?,
            };
            rows.push(row);
        }
        // Stop the peer before UCX runs so the two never compete for the CPUs.
        announce(&mut ep, to, 0, 0)?;
    }
    let _ = peer.wait();
    if let Some(g) = peer_guard {
        g.disarm(); // reaped
    }
    let pt = perftest.and_then(|note| {
        let mut out = Vec::new();
        for &size in sizes {
            match perftest::run(&name, a.test, size, iters_for(a, size)) {
                Ok(r) => out.push(r),
                Err(e) => {
                    *note = Some(format!("perftest failed at {size} B: {e:#}"));
                    return None;
                }
            }
        }
        Some(out)
    });
    drop(fabric);
    drop(fabric_guard);
    if !a.test.is_lat() {
        // The physical limit, same sizes, same machine, same run, nothing else running.
        for r in &mut rows {
            r.memcpy_mbps = Some(memcpy_mbps(r.bytes));
        }
    }
    Ok((name, rows, pt))
}

/// `ucx_perftest` as `--ucx` wants it: its path, or why it is not run (an error if it is
/// required and missing).
fn ucx_perftest(mode: UcxMode) -> anyhow::Result<Result<std::path::PathBuf, String>> {
    Ok(match (mode, ucx::which("ucx_perftest")) {
        (UcxMode::Require, None) => {
            bail!("ucx_perftest is not installed (Debian package ucx-utils)")
        }
        (UcxMode::Off, _) => Err("UCX comparison disabled (--ucx off)".to_string()),
        (UcxMode::Auto, None) => Err(
            "ucx_perftest not found (install Debian package ucx-utils); UCX comparison skipped"
                .to_string(),
        ),
        (_, Some(path)) => Ok(path),
    })
}

/// With `--peer-via`: how to start programs on node 2's host, and its address (where
/// `ucx_perftest`'s server runs there).
fn remote_of(a: &Args) -> anyhow::Result<Option<ucx::Remote>> {
    let Some(via) = &a.peer_via else {
        return Ok(None);
    };
    let via: Vec<String> = via.split_whitespace().map(str::to_owned).collect();
    if via.is_empty() {
        bail!("--peer-via needs a command (e.g. `ssh hostb`)");
    }
    let name = a.name.as_deref().expect("clap requires --name");
    let st = Fabric::attach(name)?.status()?;
    let owner = st.slots.get(1).and_then(|s| s.host.clone());
    let addr = st
        .hosts
        .iter()
        .find(|h| Some(&h.name) == owner.as_ref())
        .and_then(|h| h.address.parse::<std::net::SocketAddr>().ok())
        .map_or("127.0.0.1".to_string(), |a| a.ip().to_string());
    Ok(Some(ucx::Remote { via, addr }))
}

/// Starts the far side (`perf-peer`) of `test` on node 2 of fabric `name`; the guard kills
/// it on an error, a return or Ctrl-C.
fn spawn_peer(
    name: &str,
    test: Test,
    loop_: Loop,
    via: Option<&[String]>,
) -> anyhow::Result<(std::process::Child, teardown::Guard)> {
    let exe = std::env::current_exe()?;
    // The peer's configuration travels typed on its stdin; fabric and test are labels for ps.
    // Through `--peer-via` it runs on node 2's host (the same path to this program there).
    let mut cmd = match via {
        Some(v) if !v.is_empty() => {
            let mut c = Command::new(&v[0]);
            c.args(&v[1..]).arg(exe);
            c
        }
        _ => Command::new(exe),
    };
    backplane_bench::pinning::pin_peer(&mut cmd);
    let mut peer = cmd
        .args(["perf-peer", name, test.name()])
        .stdin(Stdio::piped())
        .spawn()
        .context("cannot start the perf peer")?;
    let guard = teardown::child("perf peer", peer.id());
    {
        use std::io::Write;
        let cfg = PeerConfig {
            name: name.to_owned(),
            test,
            node: 2,
            port: PEER_PORT,
            loop_,
        };
        let mut line = serde_json::to_vec(&cfg)?;
        line.push(b'\n');
        // The pipe stays open while this process lives (`Child::wait` closes it): the peer
        // takes its end-of-file as this process gone, however it went (see `run_peer`).
        let stdin = peer.stdin.as_mut().expect("piped");
        let sent = stdin.write_all(&line).and_then(|()| stdin.flush());
        if let Err(e) = sent {
            // (It is gone or going: a moment for its status.)
            for _ in 0..100 {
                if !matches!(peer.try_wait(), Ok(None)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let e = anyhow::Error::new(e).context("the perf peer is gone");
            return Err(peer_exited(&mut peer, guard, via, e));
        }
    }
    Ok((peer, guard))
}

/// `e`, or — when the far side `peer` already exited with a failure (a `--peer-via` command
/// that failed, `via`) — that, named as such rather than as a peer that never answered.
/// `guard` (the peer's) is let go of: disarmed if the peer was reaped (its pid may be reused),
/// else dropped (the peer killed).
fn peer_exited(
    peer: &mut std::process::Child,
    guard: teardown::Guard,
    via: Option<&[String]>,
    e: anyhow::Error,
) -> anyhow::Error {
    let status = peer.try_wait();
    if matches!(status, Ok(Some(_))) {
        guard.disarm();
    } else {
        drop(guard);
    }
    match status {
        Ok(Some(st)) if !st.success() => anyhow::anyhow!(
            "the perf peer on node 2 exited ({st}) before it came up{}",
            via.map_or(String::new(), |v| format!(
                " (started through `{}`)",
                v.join(" ")
            ))
        ),
        _ => e,
    }
}

/// `dgram-bw` node 1 → node 2 on the running fabric `name`: `iters` messages of `size` bytes;
/// the average in MB/s (for `perf ip --accel`, which sets the accelerated TCP beside it).
pub fn dgram_bw_on(name: &str, size: u64, iters: u64) -> anyhow::Result<f64> {
    let fabric = Fabric::attach(name)?;
    let (mut peer, guard) = spawn_peer(name, Test::DgramBw, Loop::Native, None)?;
    let mut ep = fabric.node(1)?.bind(0)?;
    let to = Addr::new(2, PEER_PORT);
    backplane_bench::peer::fabric_hello(&mut ep, to).context("perf peer")?;
    let row = bw_client(&mut ep, to, size, iters)?;
    announce(&mut ep, to, 0, 0)?;
    let _ = peer.wait();
    guard.disarm();
    Ok(row.bw_avg_mbps.unwrap_or(0.0))
}

/// Sends one message as consecutive datagrams (shared with `bench`).
fn send_msg(ep: &mut Endpoint, to: Addr, data: &[u8], wait: Wait) -> Result<(), DgramError> {
    backplane_bench::link::fabric_send_msg(ep, to, data, wait)
}

/// Receives one message of `size` bytes, reading every byte in place (shared with `bench`).
fn recv_msg(ep: &mut Endpoint, size: u64) -> Result<u64, DgramError> {
    backplane_bench::link::fabric_recv_msg(ep, size, Wait::Forever)
}

/// Single-thread memcpy bandwidth between two page-aligned buffers of `size` bytes, about
/// 256 MiB copied in all (the bench's toolkit): the best pass, the limit the machine reaches.
fn memcpy_mbps(size: u64) -> f64 {
    let per_pass = size.max(65536);
    let passes = ((256u64 << 20) / per_pass).clamp(8, 4096) as usize;
    backplane_bench::memcpy::measure(size as usize, passes).mb_per_s
}

fn lat_client(ep: &mut Endpoint, peer: Addr, size: u64, iters: u64) -> anyhow::Result<Row> {
    let msg = vec![0xA5u8; size as usize];
    let mut h = new_histogram();
    let warmup = (iters / 10).clamp(100, 10_000);
    announce(ep, peer, size, warmup + iters)?;
    // Timed with the TSC, samples into the histogram after the loop: two `clock_gettime`s
    // and a histogram update were ~0.1 µs of each round trip here (`ucx_perftest` reads
    // the TSC too).
    let clock = verbs::Clock::new();
    let mut samples = Vec::with_capacity(iters as usize);
    for i in 0..warmup + iters {
        let t0 = verbs::Clock::raw();
        send_msg(ep, peer, &msg, Wait::Forever)?;
        recv_msg(ep, size)?;
        let rtt = verbs::Clock::raw() - t0;
        if i >= warmup {
            samples.push(rtt);
        }
    }
    for s in samples {
        h.record(clock.ns(s).max(1))?;
    }
    Ok(Row::latency(&h, size, iters, true)) // one-way
}

fn bw_client(ep: &mut Endpoint, peer: Addr, size: u64, iters: u64) -> anyhow::Result<Row> {
    let msg = vec![0x5Au8; size as usize];
    let warmup = (iters / 10).max(10);
    announce(ep, peer, size, warmup + iters)?;
    for _ in 0..warmup {
        send_msg(ep, peer, &msg, Wait::Forever)?;
    }
    let chunks = 10u64.min(iters);
    let per = iters / chunks;
    let t0 = Instant::now();
    let mut peak = 0f64;
    let mut last = t0;
    for i in 0..iters {
        send_msg(ep, peer, &msg, Wait::Forever)?;
        if (i + 1) % per == 0 {
            let now = Instant::now();
            let mbps = (per * size) as f64 / now.duration_since(last).as_secs_f64() / 1e6;
            peak = peak.max(mbps);
            last = now;
        }
    }
    let mut b = [0u8; 16];
    ep.recv(&mut b, Wait::For(Duration::from_secs(60)))
        .context("perf peer did not acknowledge the stream")?;
    let secs = t0.elapsed().as_secs_f64();
    let avg = (iters * size) as f64 / secs / 1e6;
    Ok(Row {
        bytes: size,
        iterations: iters,
        bw_peak_mbps: Some(peak.max(avg)),
        bw_avg_mbps: Some(avg),
        msg_rate_mpps: Some(iters as f64 / secs / 1e6),
        ..Row::default()
    })
}

/// The far side: for each size the client announces (size, count), echoes (latency) or sinks
/// and acknowledges (bandwidth) `count` messages; size 0 ends the run.
pub fn run_peer(_: PeerArgs) -> anyhow::Result<()> {
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .context("cannot read the perf peer's configuration")?;
    let a: PeerConfig = serde_json::from_str(&line).context("malformed perf peer configuration")?;
    watch_client(CLIENT_GRACE);
    let fabric = Fabric::attach(&a.name)?;
    if a.test.is_verbs() {
        return verbs::peer(&fabric, a.test, a.loop_, a.node, a.port);
    }
    let mut ep = fabric.node(a.node)?.bind(a.port)?;
    let mut ctl = [0u8; 16];
    let (_, client) = ep.recv_from(&mut ctl)?;
    ep.send_to(client, b"ok")?;
    let reply = vec![0xC3u8; MAX_SIZE as usize];
    loop {
        let (n, _) = ep.recv_from(&mut ctl)?;
        if n != 16 {
            bail!("perf peer: malformed control datagram of {n} bytes");
        }
        let size = u64::from_le_bytes(ctl[..8].try_into()?);
        let count = u64::from_le_bytes(ctl[8..].try_into()?);
        if size == 0 || size > MAX_SIZE {
            return Ok(());
        }
        if a.test == Test::DgramBw {
            // A stream: every datagram read in place, as many a call as are there.
            backplane_bench::link::fabric_recv_stream(&mut ep, size, count, Wait::Forever)?;
            ep.send_to(client, b"done")?;
        } else {
            for _ in 0..count {
                recv_msg(&mut ep, size)?;
                send_msg(&mut ep, client, &reply[..size as usize], Wait::Forever)?;
            }
        }
    }
}

/// How long the peer goes on after its client closed the configuration pipe: a client that
/// finished closes it in `Child::wait`, while the peer ends its last size and tears down.
const CLIENT_GRACE: Duration = Duration::from_secs(5);

/// Ends this peer process `grace` after its standard input — the client's pipe — reaches
/// end-of-file or fails. The client holds the pipe until it waits for the peer, so a client
/// that died without its teardown (SIGKILL, a crash) no longer leaves the peer behind
/// holding node 2's port; through `--peer-via ssh …` the end-of-file travels too.
fn watch_client(grace: Duration) {
    let spawned = std::thread::Builder::new()
        .name("bp-peer-watch".into())
        .spawn(move || {
            use std::io::Read;
            let mut buf = [0u8; 64];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
            std::thread::sleep(grace);
            eprintln!("perf peer: its client is gone (its pipe closed {grace:?} ago); exiting");
            std::process::exit(1);
        });
    if let Err(e) = spawned {
        eprintln!("perf peer: cannot watch for its client ({e}); it ends only when told");
    }
}

fn announce(ep: &mut Endpoint, peer: Addr, size: u64, count: u64) -> Result<(), DgramError> {
    let mut c = [0u8; 16];
    c[..8].copy_from_slice(&size.to_le_bytes());
    c[8..].copy_from_slice(&count.to_le_bytes());
    ep.send_to(peer, &c)
}

/// One `ucx_perftest` run (the bench crate's runner) as a row of this test's table.
fn ucx_run(
    path: &std::path::Path,
    test: Test,
    size: u64,
    iters: u64,
    remote: Option<&ucx::Remote>,
) -> anyhow::Result<Row> {
    let r = ucx::run_between(
        path,
        test.ucx_test(),
        size,
        iters,
        (iters / 10).clamp(10, 10_000),
        remote,
    )?;
    Ok(Row::from_ucx(&r, size, test.is_lat()))
}

/// Two decimals as perftest prints them, three below 1 (sub-microsecond latencies).
fn f(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| {
        if v.abs() < 1.0 {
            format!("{v:.3}")
        } else {
            format!("{v:.2}")
        }
    })
}

fn render(r: &Report) -> String {
    let line = "-".repeat(100);
    let mut o = format!(
        "{line}\n {} over {} (node 1 <-> node 2)\n{}",
        r.test.name(),
        r.test.title(),
        r.test.note()
    );
    if r.loop_ == Loop::Perftest {
        o += " loop: perftest's, step for step (every request signaled and its completion polled, \
              a clock read per iteration on both sides, waits without PAUSE)\n";
    }
    let lat = r.test.is_lat();
    if lat {
        o += &format!(
            "{:>9} {:>12} {:>12} {:>12} {:>16} {:>12} {:>14} {:>9} {:>10}\n",
            "#bytes",
            "#iterations",
            "t_min[usec]",
            "t_max[usec]",
            "t_typical[usec]",
            "t_avg[usec]",
            "t_stdev[usec]",
            "99%[usec]",
            "99.9%[usec]"
        );
        for x in &r.backplane {
            o += &format!(
                "{:>9} {:>12} {:>12} {:>12} {:>16} {:>12} {:>14} {:>9} {:>10}\n",
                x.bytes,
                x.iterations,
                f(x.t_min_us),
                f(x.t_max_us),
                f(x.t_typical_us),
                f(x.t_avg_us),
                f(x.t_stdev_us),
                f(x.p99_us),
                f(x.p999_us)
            );
        }
    } else {
        o += &format!(
            "{:>9} {:>12} {:>16} {:>19} {:>14} {:>16} {:>10}\n",
            "#bytes",
            "#iterations",
            "BW peak[MB/sec]",
            "BW average[MB/sec]",
            "MsgRate[Mpps]",
            "memcpy[MB/sec]",
            "of memcpy"
        );
        for x in &r.backplane {
            let of = x.bw_avg_mbps.zip(x.memcpy_mbps).map(|(b, m)| b / m);
            o += &format!(
                "{:>9} {:>12} {:>16} {:>19} {:>14.6} {:>16} {:>10}\n",
                x.bytes,
                x.iterations,
                f(x.bw_peak_mbps),
                f(x.bw_avg_mbps),
                x.msg_rate_mpps.unwrap_or(0.0),
                f(x.memcpy_mbps),
                of.map_or("-".into(), |v| format!("{:.0}%", v * 100.0))
            );
        }
    }
    o += &format!("{line}\n");
    if let Some(u) = &r.ucx {
        o += &format!(
            " same run: UCX {} (ucx_perftest, {}); ratio = backplane / UCX\n",
            r.test.ucx_test(),
            r.ucx_where
        );
        if lat {
            o += &format!(
                "{:>9} {:>12} {:>16} {:>12} {:>30}\n",
                "#bytes",
                "#iterations",
                "t_typical[usec]",
                "t_avg[usec]",
                format!("ratio {} (<=1 is better)", latency_field(r).0)
            );
            let value = latency_field(r).1;
            for (x, b) in u.iter().zip(&r.backplane) {
                let ratio = value(b).zip(value(x)).map(|(b, u)| b / u);
                o += &format!(
                    "{:>9} {:>12} {:>16} {:>12} {:>30}\n",
                    x.bytes,
                    x.iterations,
                    f(x.t_typical_us),
                    f(x.t_avg_us),
                    f(ratio)
                );
            }
        } else {
            o += &format!(
                "{:>9} {:>12} {:>19} {:>14} {:>26}\n",
                "#bytes",
                "#iterations",
                "BW average[MB/sec]",
                "MsgRate[Mpps]",
                "ratio BW (>=1 is better)"
            );
            for (x, b) in u.iter().zip(&r.backplane) {
                let ratio = b.bw_avg_mbps.zip(x.bw_avg_mbps).map(|(b, u)| b / u);
                o += &format!(
                    "{:>9} {:>12} {:>19} {:>14.6} {:>26}\n",
                    x.bytes,
                    x.iterations,
                    f(x.bw_avg_mbps),
                    x.msg_rate_mpps.unwrap_or(0.0),
                    f(ratio)
                );
            }
        }
        o += &format!("{line}\n");
    }
    if let Some(p) = &r.perftest {
        o += &render_perftest(r, p);
    }
    if !r.rounds.is_empty() {
        o += &render_rounds(r);
    }
    if let Some(n) = &r.ucx_note {
        o += &format!(" note: {n}\n");
    }
    if let Some(n) = &r.perftest_note {
        o += &format!(" note: {n}\n");
    }
    if r.tcp_congestion_control.as_deref() == Some("bbr") && !r.test.is_lat() {
        // Why the per-round ratios of a stream between hosts swing (session 29).
        o += " note: TCP congestion control here is bbr, which paces each connection: between \
               hosts over a veth the 64 KiB streams (ours and ucx_perftest's) then swing by up \
               to 3x from round to round; cubic and reno do not pace (README, \"A fabric across \
               hosts\")\n";
    }
    o
}

/// perftest's block: its figures and the ratio to the engine measured directly (the ABI
/// layer's cost), per size, and with rounds the median of the per-round ratios.
fn render_perftest(r: &Report, p: &[Row]) -> String {
    let lat = r.test.is_lat();
    let (field, lat_value) = latency_field(r);
    let value = |x: &Row| if lat { lat_value(x) } else { x.bw_avg_mbps };
    let mut o = format!(
        " same run: perftest {} (unmodified, over the fabric through the drop-in libibverbs.so.1); \
         ratio = perftest / backplane ({} is better)\n{:>9} {:>12} {:>19} {:>26}\n",
        perftest::program(r.test).unwrap_or("-"),
        if lat { "<=1" } else { ">=1" },
        "#bytes",
        "#iterations",
        if !lat {
            "BW average[MB/sec]"
        } else if field == "t_avg" {
            "t_avg[usec]"
        } else {
            "t_typical[usec]"
        },
        "ratio (median per round)"
    );
    for (i, (x, b)) in p.iter().zip(&r.backplane).enumerate() {
        let per_round: Vec<f64> = r
            .rounds
            .iter()
            .filter_map(|rd| {
                Some(value(rd.perftest.as_ref()?.get(i)?)? / value(rd.backplane.get(i)?)?)
            })
            .collect();
        let ratio = median(per_round.iter().copied())
            .or_else(|| value(x).zip(value(b)).map(|(p, b)| p / b));
        o += &format!(
            "{:>9} {:>12} {:>19} {:>26}\n",
            x.bytes,
            x.iterations,
            f(value(x)),
            f(ratio)
        );
    }
    o += &format!("{}\n", "-".repeat(100));
    o
}

/// Latencies below this (µs) are compared by their means.
const TYPICAL_FROM_US: f64 = 0.1;

/// The latency field the ratios compare: `t_typical`, or `t_avg` where a latency is under
/// [`TYPICAL_FROM_US`] (a READ or an atomic on one host, ~30 ns). Every sample is a difference
/// of TSC reads, and on this kind of VM the TSC moves 26 cycles (10 ns) at a time: a ~30 ns
/// operation's samples fall on three or four values and their median on one of them — ratios
/// of 0.03 and 0.04 µs are 0.75 or 1.33 whatever the two took (per-round ratios against
/// `ucp_get` from 0.75 to 3.0 in one run). A mean is not rounded so.
fn latency_field(r: &Report) -> (&'static str, fn(&Row) -> Option<f64>) {
    let short = r
        .backplane
        .iter()
        .chain(r.ucx.iter().flatten())
        .filter_map(|x| x.t_typical_us)
        .any(|t| t < TYPICAL_FROM_US);
    if short {
        ("t_avg", |x: &Row| x.t_avg_us)
    } else {
        ("t_typical", |x: &Row| x.t_typical_us)
    }
}

/// The `--rounds` block: every round's ratio, their median, the ratio of the medians, and in
/// how many rounds the fabric was at least as good as UCX.
///
/// The median of the per-round ratios is the paired figure: each round runs both back to back,
/// so it compares them under the same conditions. The ratio of the medians does not pair them;
/// where the machine moves between placement bands (latencies here sit in bands a factor of
/// three apart, depending on where the host put the two vCPUs) it follows whichever side
/// happened to draw more slow rounds.
fn render_rounds(r: &Report) -> String {
    let lat = r.test.is_lat();
    let (field, lat_value) = latency_field(r);
    let value = |x: &Row| if lat { lat_value(x) } else { x.bw_avg_mbps };
    let mut o = format!(
        " {} rounds, backplane and UCX alternating{}; the tables above hold each field's median\n",
        r.rounds.len(),
        r.cpus.map_or(String::new(), |[c, p]| format!(
            " (measuring side on CPU {c}, far side on CPU {p})"
        ))
    );
    if r.ucx.is_none() {
        return o;
    }
    o += &format!(
        " per-round ratio of {} (backplane / UCX, {} is better){}:\n",
        if lat { field } else { "BW average" },
        if lat { "<=1" } else { ">=1" },
        if lat && field == "t_avg" {
            " — the means: under 0.1 µs a median of TSC-timed samples falls on the \
             counter's steps (10 ns on this kind of VM)"
        } else {
            ""
        }
    );
    for (i, x) in r.backplane.iter().enumerate() {
        let ratios: Vec<f64> = r
            .rounds
            .iter()
            .filter_map(|rd| {
                let b = value(rd.backplane.get(i)?)?;
                let u = value(rd.ucx.as_ref()?.get(i)?)?;
                Some(b / u)
            })
            .collect();
        let good = ratios
            .iter()
            .filter(|&&q| if lat { q <= 1.0 } else { q >= 1.0 })
            .count();
        let med = value(x).zip(r.ucx.as_ref().and_then(|u| u.get(i)).and_then(value));
        o += &format!(
            "{:>9} B: {}  | median ratio {}  | ratio of medians {}  | as good as UCX in {} of {} rounds\n",
            x.bytes,
            ratios
                .iter()
                .map(|q| format!("{q:.2}"))
                .collect::<Vec<_>>()
                .join(" "),
            f(median(ratios.iter().copied())),
            f(med.map(|(b, u)| b / u)),
            good,
            ratios.len()
        );
    }
    o
}

/// The TCP congestion control of this process's network namespace
/// (`/proc/sys/net/ipv4/tcp_congestion_control`), if it can be read. It decides much of a
/// bandwidth test between hosts over TCP: `bbr` paces each connection to the rate it
/// measured, `cubic` and `reno` send as fast as the window allows.
fn tcp_congestion_control() -> Option<String> {
    let s = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").ok()?;
    let s = s.trim();
    (!s.is_empty() && s.len() <= 16 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        .then(|| s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report of `test` on one host: these median rows (backplane, UCX) and rounds.
    fn report_of(test: Test, (backplane, ucx): (Vec<Row>, Vec<Row>), rounds: Vec<Round>) -> Report {
        Report {
            version: 1,
            test,
            fabric: "t".into(),
            loop_: Loop::Native,
            backplane,
            ucx: Some(ucx),
            ucx_note: None,
            ucx_where: "UCX_TLS=posix,cma,self".into(),
            tcp_congestion_control: None,
            perftest: None,
            perftest_note: None,
            cpus: None,
            rounds,
        }
    }

    #[test]
    fn the_paired_ratio_is_not_fooled_by_which_side_drew_more_slow_rounds() {
        let row = |t: f64| Row {
            bytes: 8,
            iterations: 10,
            t_typical_us: Some(t),
            ..Row::default()
        };
        // backplane 6 µs against UCX 7 in the fast band, 19 against 26 in the slow one;
        // backplane drew the slow band in 3 rounds of 5, UCX in 2.
        let pairs = [
            (6.0, 7.0),
            (19.0, 26.0),
            (19.0, 7.0),
            (6.0, 26.0),
            (19.0, 7.0),
        ];
        let rounds: Vec<Round> = pairs
            .iter()
            .map(|&(b, u)| Round {
                backplane: vec![row(b)],
                ucx: Some(vec![row(u)]),
                perftest: None,
            })
            .collect();
        let bp: Vec<Vec<Row>> = rounds.iter().map(|r| r.backplane.clone()).collect();
        let ux: Vec<Vec<Row>> = rounds.iter().map(|r| r.ucx.clone().unwrap()).collect();
        let r = report_of(
            Test::WriteLat,
            (
                median_rows(&bp.iter().map(|v| &v[..]).collect::<Vec<_>>()),
                median_rows(&ux.iter().map(|v| &v[..]).collect::<Vec<_>>()),
            ),
            rounds,
        );
        let text = render_rounds(&r);
        // Per round: 0.857 0.731 2.71 0.231 2.71 -> median 0.857; medians 19 / 7 = 2.71.
        assert!(text.contains("| median ratio 0.857 "), "{text}");
        assert!(text.contains("| ratio of medians 2.71 "), "{text}");
        assert!(text.contains("as good as UCX in 3 of 5 rounds"), "{text}");
    }

    #[test]
    fn latencies_under_a_tenth_of_a_microsecond_are_compared_by_their_means() {
        let row = |typical: f64, avg: f64| Row {
            bytes: 8,
            iterations: 10,
            t_typical_us: Some(typical),
            t_avg_us: Some(avg),
            ..Row::default()
        };
        // A READ of ~30 ns against a GET of ~25 timed by a TSC that moves 10 ns at a time: the
        // medians fall on 0.03 / 0.02 (1.5) or 0.03 / 0.03 (1.0) by chance.
        let pairs = [
            ((0.03, 0.031), (0.02, 0.026)),
            ((0.03, 0.030), (0.03, 0.025)),
            ((0.03, 0.032), (0.02, 0.025)),
        ];
        let report = |scale: f64| {
            let rounds: Vec<Round> = pairs
                .iter()
                .map(|&((bt, ba), (ut, ua))| Round {
                    backplane: vec![row(bt * scale, ba * scale)],
                    ucx: Some(vec![row(ut * scale, ua * scale)]),
                    perftest: None,
                })
                .collect();
            report_of(
                Test::ReadLat,
                (
                    vec![row(0.03 * scale, 0.031 * scale)],
                    vec![row(0.02 * scale, 0.025 * scale)],
                ),
                rounds,
            )
        };
        // Under 0.1 µs, the means: 1.19 1.20 1.28.
        let text = render_rounds(&report(1.0));
        assert!(text.contains("per-round ratio of t_avg"), "{text}");
        assert!(text.contains("| median ratio 1.20 "), "{text}");
        assert!(render(&report(1.0)).contains("ratio t_avg"));
        // The same shape at a hundred times the latency: the medians, as for every other.
        let text = render_rounds(&report(100.0));
        assert!(text.contains("per-round ratio of t_typical"), "{text}");
        assert!(text.contains("| median ratio 1.50 "), "{text}");
    }

    #[test]
    fn reads_and_atomics_on_one_host_run_long_enough_to_outlast_a_hiccup() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: Args,
        }
        let iters = |argv: &[&str], size: u64| {
            let cli = <Cli as clap::Parser>::try_parse_from(
                std::iter::once("perf").chain(argv.iter().copied()),
            )
            .unwrap();
            iters_for(&cli.a, size)
        };
        assert_eq!(iters(&["read-lat"], 8), 1_000_000);
        assert_eq!(iters(&["atomic-lat"], 8), 1_000_000);
        // About 1 GiB for large READs, never fewer than the other latency tests.
        assert_eq!(iters(&["read-lat"], 4096), 262_144);
        assert_eq!(iters(&["read-lat"], 1 << 20), 20_000);
        // Across hosts (a round trip of microseconds) and the two-sided tests: as before.
        assert_eq!(
            iters(&["read-lat", "--name", "f", "--peer-via", "ssh b"], 8),
            20_000
        );
        assert_eq!(iters(&["write-lat"], 8), 20_000);
        assert_eq!(iters(&["send-lat"], 8), 20_000);
        // A count given is the count.
        assert_eq!(iters(&["read-lat", "-n", "300"], 8), 300);
    }
}
