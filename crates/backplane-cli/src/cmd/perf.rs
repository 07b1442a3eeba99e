//! `backplane perf`: perftest-like micro benchmarks of the fabric's datagram path, measured
//! side by side with UCX over shared memory (`ucx_perftest`) in the same run.
//!
//! The local side runs on node 1 in this process; the far side is a `perf-peer` process on
//! node 2. Messages larger than one datagram (64 KiB) travel as consecutive datagrams.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use backplane::dgram::{Addr, DgramError, Endpoint, Wait};
use backplane::fabric::Fabric;
use backplane_bench::link::{fabric_recv_msg, fabric_send_msg};
use backplane_bench::ucx::{self, UcxTest};
use hdrhistogram::Histogram;
use serde::Serialize;

use super::parse_size;

const PEER_PORT: u32 = 18515; // perftest's default port, for familiarity
const MAX_SIZE: u64 = 1 << 20;

/// Which benchmark.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Test {
    /// Datagram ping-pong latency (one-way = round trip / 2).
    DgramLat,
    /// Datagram streaming bandwidth and message rate.
    DgramBw,
}

impl Test {
    fn name(self) -> &'static str {
        match self {
            Test::DgramLat => "dgram-lat",
            Test::DgramBw => "dgram-bw",
        }
    }
    fn ucx_test(self) -> UcxTest {
        match self {
            Test::DgramLat => UcxTest::TagLat,
            Test::DgramBw => UcxTest::TagBw,
        }
    }
}

/// Whether to run UCX alongside.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum UcxMode {
    /// Run `ucx_perftest` when it is installed; say so when it is not.
    Auto,
    /// Do not run UCX.
    Off,
    /// Fail if `ucx_perftest` is missing.
    Require,
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
    /// Iterations per size (default: 20000 for latency; about 1 GiB of traffic for bandwidth).
    #[arg(short = 'n', long = "iters")]
    iters: Option<u64>,
    /// Run `ucx_perftest` (UCX_TLS=posix,cma,self) with the same sizes in the same run.
    #[arg(long, value_enum, default_value = "auto")]
    ucx: UcxMode,
    /// Print a JSON document (version 1) instead of tables.
    #[arg(long)]
    json: bool,
}

/// Arguments of the far side.
#[derive(clap::Args, Debug)]
pub struct PeerArgs {
    #[arg(long)]
    name: String,
    #[arg(long, value_enum)]
    test: Test,
    #[arg(long)]
    node: u32,
    #[arg(long)]
    port: u32,
}

/// One row of results.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Row {
    bytes: u64,
    iterations: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    t_min_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    t_max_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    t_typical_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    t_avg_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    t_stdev_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p99_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p999_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bw_peak_mbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bw_avg_mbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    msg_rate_mpps: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    version: u32,
    test: Test,
    fabric: String,
    backplane: Vec<Row>,
    ucx: Option<Vec<Row>>,
    ucx_note: Option<String>,
}

/// Tears down what a run started, whatever happens.
struct Cleanup {
    fabric: Option<String>,
    peer: Option<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut p) = self.peer.take() {
            let _ = p.kill();
            let _ = p.wait();
        }
        if let Some(name) = self.fabric.take() {
            let _ = backplane::fabric::launch::stop(&name);
        }
    }
}

fn sizes(a: &Args) -> anyhow::Result<Vec<u64>> {
    if a.all {
        return Ok((3..=20).map(|p| 1u64 << p).collect());
    }
    let s = a.size.unwrap_or(match a.test {
        Test::DgramLat => 8,
        Test::DgramBw => MAX_SIZE,
    });
    if !(1..=MAX_SIZE).contains(&s) {
        bail!("--size {s} is out of range: use 1 B to 1 MiB");
    }
    Ok(vec![s])
}

fn iters_for(a: &Args, size: u64) -> u64 {
    a.iters.unwrap_or(match a.test {
        Test::DgramLat => 20_000,
        Test::DgramBw => ((1u64 << 30) / size).clamp(1_000, 500_000),
    })
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let sizes = sizes(&a)?;
    if a.iters == Some(0) {
        bail!("--iters must be at least 1");
    }
    let mut cleanup = Cleanup {
        fabric: None,
        peer: None,
    };
    let name = match &a.name {
        Some(n) => n.clone(),
        None => {
            let n = format!("perf-{}", std::process::id());
            super::up::start(&n, 2, 64 << 20, 0)?;
            cleanup.fabric = Some(n.clone());
            n
        }
    };
    let fabric = Fabric::attach(&name)?;
    if fabric.nodes() < 2 {
        bail!("fabric '{name}' has one node; perf needs nodes 1 and 2");
    }
    let exe = std::env::current_exe()?;
    cleanup.peer = Some(
        Command::new(exe)
            .args([
                "perf-peer",
                "--name",
                &name,
                "--test",
                a.test.name(),
                "--node",
                "2",
                "--port",
                &PEER_PORT.to_string(),
            ])
            .stdin(Stdio::null())
            .spawn()
            .context("cannot start the perf peer")?,
    );
    let mut ep = fabric.node(1)?.bind(0)?;
    let peer = Addr::new(2, PEER_PORT);
    wait_for_peer(&mut ep, peer)?;
    if !a.json {
        eprintln!(
            "{}: fabric '{name}', node 1 <-> node 2, sizes {}..{} B",
            a.test.name(),
            sizes[0],
            sizes[sizes.len() - 1]
        );
    }
    let mut rows = Vec::new();
    for &size in &sizes {
        let iters = iters_for(&a, size);
        let row = match a.test {
            Test::DgramLat => lat_client(&mut ep, peer, size, iters)?,
            Test::DgramBw => bw_client(&mut ep, peer, size, iters)?,
        };
        rows.push(row);
    }
    // Stop the peer before UCX runs so the two never compete for the CPUs.
    announce(&mut ep, peer, 0, 0)?;
    if let Some(mut p) = cleanup.peer.take() {
        let _ = p.wait();
    }
    drop(ep);
    drop(fabric);
    drop(cleanup);

    let (ucx, ucx_note) = match (a.ucx, ucx::which("ucx_perftest")) {
        (UcxMode::Off, _) => (
            None,
            Some("UCX comparison disabled (--ucx off)".to_string()),
        ),
        (UcxMode::Require, None) => {
            bail!("ucx_perftest is not installed (Debian package ucx-utils)")
        }
        (UcxMode::Auto, None) => (
            None,
            Some(
                "ucx_perftest not found (install Debian package ucx-utils); UCX comparison skipped"
                    .into(),
            ),
        ),
        (_, Some(path)) => {
            let mut out = Vec::new();
            let mut note = None;
            for &size in &sizes {
                match ucx_run(&path, a.test, size, iters_for(&a, size)) {
                    Ok(r) => out.push(r),
                    Err(e) => {
                        note = Some(format!("ucx_perftest failed at {size} B: {e:#}"));
                        break;
                    }
                }
            }
            (Some(out), note)
        }
    };
    let report = Report {
        version: 1,
        test: a.test,
        fabric: name,
        backplane: rows,
        ucx,
        ucx_note,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

fn wait_for_peer(ep: &mut Endpoint, peer: Addr) -> anyhow::Result<()> {
    backplane_bench::peer::fabric_hello(ep, peer).context("perf peer")
}

/// Sends one message of `data.len()` bytes as consecutive datagrams (at least one).
fn send_msg(ep: &mut Endpoint, to: Addr, data: &[u8], wait: Wait) -> Result<(), DgramError> {
    fabric_send_msg(ep, to, data, wait)
}

/// Receives one message of `size` bytes, reading every byte in place.
fn recv_msg(ep: &mut Endpoint, size: u64) -> Result<u64, DgramError> {
    fabric_recv_msg(ep, size, Wait::Forever)
}

fn lat_client(ep: &mut Endpoint, peer: Addr, size: u64, iters: u64) -> anyhow::Result<Row> {
    let msg = vec![0xA5u8; size as usize];
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let warmup = (iters / 10).clamp(100, 10_000);
    announce(ep, peer, size, warmup + iters)?;
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        send_msg(ep, peer, &msg, Wait::Forever)?;
        recv_msg(ep, size)?;
        let rtt = t0.elapsed().as_nanos() as u64;
        if i >= warmup {
            h.record(rtt.max(1))?;
        }
    }
    let us = |ns: f64| ns / 2.0 / 1000.0; // one-way
    Ok(Row {
        bytes: size,
        iterations: iters,
        t_min_us: Some(us(h.min() as f64)),
        t_max_us: Some(us(h.max() as f64)),
        t_typical_us: Some(us(h.value_at_quantile(0.5) as f64)),
        t_avg_us: Some(us(h.mean())),
        t_stdev_us: Some(us(h.stdev())),
        p99_us: Some(us(h.value_at_quantile(0.99) as f64)),
        p999_us: Some(us(h.value_at_quantile(0.999) as f64)),
        ..Row::default()
    })
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
pub fn run_peer(a: PeerArgs) -> anyhow::Result<()> {
    let fabric = Fabric::attach(&a.name)?;
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
        for _ in 0..count {
            recv_msg(&mut ep, size)?;
            if a.test == Test::DgramLat {
                send_msg(&mut ep, client, &reply[..size as usize], Wait::Forever)?;
            }
        }
        if a.test == Test::DgramBw {
            ep.send_to(client, b"done")?;
        }
    }
}

fn announce(ep: &mut Endpoint, peer: Addr, size: u64, count: u64) -> Result<(), DgramError> {
    let mut c = [0u8; 16];
    c[..8].copy_from_slice(&size.to_le_bytes());
    c[8..].copy_from_slice(&count.to_le_bytes());
    ep.send_to(peer, &c)
}

/// Runs one `ucx_perftest` client/server pair (UCX_TLS=posix,cma,self) and maps its result.
fn ucx_run(path: &std::path::Path, test: Test, size: u64, iters: u64) -> anyhow::Result<Row> {
    let r = ucx::run(
        path,
        test.ucx_test(),
        size,
        iters,
        (iters / 10).clamp(10, 10_000),
    )?;
    Ok(ucx_row(&r, test, size))
}

/// A perf row from a UCX result: latency or bandwidth columns.
fn ucx_row(r: &ucx::UcxResult, test: Test, size: u64) -> Row {
    let mut row = Row {
        bytes: size,
        iterations: r.iterations,
        ..Row::default()
    };
    match test {
        Test::DgramLat => {
            row.t_typical_us = Some(r.typical_lat_us);
            row.t_avg_us = Some(r.avg_lat_us);
        }
        Test::DgramBw => {
            row.bw_avg_mbps = Some(r.bw_mb_per_s);
            row.msg_rate_mpps = Some(r.msg_rate / 1e6);
        }
    }
    row
}

fn f(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.2}"))
}

fn render(r: &Report) -> String {
    let line = "-".repeat(100);
    let mut o = format!(
        "{line}\n {} over backplane fabric datagrams (node 1 <-> node 2)\n",
        r.test.name()
    );
    match r.test {
        Test::DgramLat => {
            o += " one-way latency = round trip / 2\n";
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
        }
        Test::DgramBw => {
            o += " receiver reads every cache line of every payload in place (zero-copy receive)\n";
            o += &format!(
                "{:>9} {:>12} {:>16} {:>19} {:>14}\n",
                "#bytes", "#iterations", "BW peak[MB/sec]", "BW average[MB/sec]", "MsgRate[Mpps]"
            );
            for x in &r.backplane {
                o += &format!(
                    "{:>9} {:>12} {:>16} {:>19} {:>14.6}\n",
                    x.bytes,
                    x.iterations,
                    f(x.bw_peak_mbps),
                    f(x.bw_avg_mbps),
                    x.msg_rate_mpps.unwrap_or(0.0)
                );
            }
        }
    }
    o += &format!("{line}\n");
    if let Some(u) = &r.ucx {
        o += &format!(
            " same run: UCX {} (ucx_perftest, UCX_TLS=posix,cma,self); ratio = backplane / UCX\n",
            r.test.ucx_test().name()
        );
        match r.test {
            Test::DgramLat => {
                o += &format!(
                    "{:>9} {:>12} {:>16} {:>12} {:>30}\n",
                    "#bytes",
                    "#iterations",
                    "t_typical[usec]",
                    "t_avg[usec]",
                    "ratio t_typical (<=1 is better)"
                );
                for (x, b) in u.iter().zip(&r.backplane) {
                    let ratio = b.t_typical_us.zip(x.t_typical_us).map(|(b, u)| b / u);
                    o += &format!(
                        "{:>9} {:>12} {:>16} {:>12} {:>30}\n",
                        x.bytes,
                        x.iterations,
                        f(x.t_typical_us),
                        f(x.t_avg_us),
                        f(ratio)
                    );
                }
            }
            Test::DgramBw => {
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
        }
        o += &format!("{line}\n");
    }
    if let Some(n) = &r.ucx_note {
        o += &format!(" note: {n}\n");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_results_fill_the_latency_or_the_bandwidth_columns() {
        let text = "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n\
                    100000,0.135,0.140,0.140,54.65,54.65,7162588,7162588\n";
        let u = ucx::parse_csv(text).unwrap();
        let r = ucx_row(&u, Test::DgramLat, 8);
        assert_eq!(r.iterations, 100000);
        assert_eq!(r.t_typical_us, Some(0.135));
        assert_eq!(r.bw_avg_mbps, None);
        let r = ucx_row(&u, Test::DgramBw, 8);
        assert!((r.bw_avg_mbps.unwrap() - 54.65 * 1.048576).abs() < 1e-6);
        assert_eq!(r.t_typical_us, None);
    }
}
