//! `backplane perf ip`: IP over the fabric against the kernel's own virtual link, in one run.
//!
//! Two nodes of a fabric (their `bp0`) and two namespaces joined by a veth pair with the same
//! MTU, each measured with unmodified tools: iperf3 (`-J`) for TCP throughput and the CPU of
//! both ends, sockperf ping-pong for latency. The fabric's agents do work veth does in the
//! kernel, so their CPU is measured too (from /proc) and shown beside iperf3's.

use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use backplane::fabric::launch::{self, Options};
use backplane::fabric::Fabric;
use backplane::net::{self, NetPlan};
use backplane_bench::teardown::{self, OutputGuarded as _};
use serde::Serialize;

/// One path's figures.
#[derive(Debug, Serialize, Default, Clone)]
pub struct IpRow {
    path: String,
    tcp_gbps: f64,
    cpu_client_pct: f64,
    cpu_server_pct: f64,
    cpu_agents_pct: Option<f64>,
    lat_avg_us: f64,
    lat_p50_us: f64,
    lat_p99_us: f64,
    lat_p999_us: f64,
}

#[derive(Debug, Serialize)]
struct IpReport {
    version: u32,
    test: &'static str,
    mtu: u32,
    seconds: u64,
    /// The protocol of the latency figures: "udp" (sockperf's default), "tcp" with `--accel`.
    latency: &'static str,
    /// Every path measured; the ratios compare the first (the accelerated path with
    /// `--accel`, else bp0) with the veth pair.
    rows: Vec<IpRow>,
    ratio_tcp: f64,
    ratio_lat_p50: f64,
    /// With `--rounds` > 1: each round's rows (fabric, veth); `rows` then holds each field's
    /// median over the rounds.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    rounds: Vec<Vec<IpRow>>,
    /// With `--accel`: the fabric's own datagram bandwidth (MB/s, messages of iperf3's
    /// 128 KiB writes, node 1 → node 2) measured in each round beside the TCP paths.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    dgram_mbps_rounds: Vec<f64>,
    /// With `--accel`: the median over rounds of accelerated TCP / datagrams.
    #[serde(skip_serializing_if = "Option::is_none")]
    ratio_dgram: Option<f64>,
}

/// Datagram size of the `--accel` comparison: iperf3's default TCP write.
const DGRAM_SIZE: u64 = 128 << 10;

/// Each field's median over rounds of one path.
fn median_row(rows: &[&IpRow]) -> IpRow {
    let med = |get: fn(&IpRow) -> f64| {
        backplane_bench::stats::median(rows.iter().map(|r| get(r))).unwrap_or(0.0)
    };
    IpRow {
        path: rows.first().map(|r| r.path.clone()).unwrap_or_default(),
        tcp_gbps: med(|r| r.tcp_gbps),
        cpu_client_pct: med(|r| r.cpu_client_pct),
        cpu_server_pct: med(|r| r.cpu_server_pct),
        cpu_agents_pct: backplane_bench::stats::median(
            rows.iter().filter_map(|r| r.cpu_agents_pct),
        ),
        lat_avg_us: med(|r| r.lat_avg_us),
        lat_p50_us: med(|r| r.lat_p50_us),
        lat_p99_us: med(|r| r.lat_p99_us),
        lat_p999_us: med(|r| r.lat_p999_us),
    }
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let o = Command::new("ip")
        .args(args)
        .output()
        .context("cannot run ip")?;
    if !o.status.success() {
        bail!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(())
}

/// The environment a path's programs run with (the preload for the accelerated path).
type Env = Vec<(String, std::ffi::OsString)>;

fn in_ns(ns: &str, prog: &str, env: &Env) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, prog]);
    c.envs(env.iter().map(|(k, v)| (k, v)));
    c
}

/// CPU seconds (user + system) of a process so far, from /proc/PID/stat.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = s.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    let hz = crate::sys::clock_ticks_per_second();
    (ticks(11) + ticks(12)) / hz.max(1.0)
}

fn iperf(
    ns_server: &str,
    ns_client: &str,
    addr: &str,
    port: u16,
    secs: u64,
    env: &(Env, Env),
) -> anyhow::Result<serde_json::Value> {
    let mut server = in_ns(ns_server, "iperf3", &env.1)
        .args(["-s", "-1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start iperf3 (install Debian package iperf3)")?;
    let guard = teardown::child("iperf3 server", server.id());
    let mut last = String::new();
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let o = in_ns(ns_client, "iperf3", &env.0)
            .args([
                "-c",
                addr,
                "-p",
                &port.to_string(),
                "-t",
                &secs.to_string(),
                "-J",
            ])
            .output_guarded("iperf3 client")?;
        if o.status.success() {
            let _ = server.wait();
            guard.disarm(); // reaped
            return Ok(serde_json::from_slice(&o.stdout)?);
        }
        last = String::from_utf8_lossy(&o.stdout)
            .chars()
            .take(200)
            .collect();
    }
    let _ = server.kill();
    let _ = server.wait();
    guard.disarm(); // reaped
    bail!("iperf3 over {addr} never ran: {last}")
}

/// Parses sockperf's summary: average and the 50/99/99.9 percentiles, in µs.
pub fn parse_sockperf(text: &str) -> Option<(f64, f64, f64, f64)> {
    let num_after = |key: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.contains(key))?;
        let rest = &line[line.find(key)? + key.len()..];
        let t: String = rest
            .trim_start_matches([' ', '='])
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        t.parse().ok()
    };
    Some((
        num_after("avg-latency=")?,
        num_after("percentile 50.000")?,
        num_after("percentile 99.000")?,
        num_after("percentile 99.900")?,
    ))
}

fn sockperf(
    ns_server: &str,
    ns_client: &str,
    addr: &str,
    port: u16,
    env: &(Env, Env),
    tcp: bool,
) -> anyhow::Result<(f64, f64, f64, f64)> {
    // Over TCP the accelerated path outruns sockperf's default ceiling on the message rate
    // (it sizes its tables for it and fails beyond), so lift it for every path alike.
    let tcp_arg: &[&str] = if tcp {
        &["--tcp", "--mps", "10000000"]
    } else {
        &[]
    };
    let mut server = in_ns(ns_server, "sockperf", &env.1)
        .args(["sr", "-i", addr, "-p", &port.to_string()])
        .args(&tcp_arg[..tcp_arg.len().min(1)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start sockperf (install Debian package sockperf)")?;
    let guard = teardown::child("sockperf server", server.id());
    std::thread::sleep(Duration::from_millis(300));
    let o = in_ns(ns_client, "sockperf", &env.0)
        .args([
            "pp",
            "-i",
            addr,
            "-p",
            &port.to_string(),
            "-t",
            "2",
            "-m",
            "64",
        ])
        .args(tcp_arg)
        .output_guarded("sockperf client");
    let _ = server.kill();
    let _ = server.wait();
    guard.disarm(); // reaped
    let o = o?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    parse_sockperf(&text).with_context(|| {
        let tail: Vec<&str> = text.lines().rev().take(3).collect();
        format!(
            "no latency summary from sockperf over {addr}: {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
        )
    })
}

/// One path: where its two ends run, the server's address, and the programs' environment
/// (client's, server's).
struct Path<'a> {
    name: &'a str,
    ns: (&'a str, &'a str),
    addr: String,
    env: (Env, Env),
}

fn measure(p: &Path<'_>, secs: u64, agents: &[u32], tcp_lat: bool) -> anyhow::Result<IpRow> {
    let (path, ns, addr) = (p.name, p.ns, p.addr.as_str());
    let cpu0: f64 = agents.iter().map(|&p| cpu_seconds(p)).sum();
    let t0 = Instant::now();
    let j = iperf(ns.1, ns.0, addr, 5201, secs, &p.env)?;
    let agent_pct = (!agents.is_empty()).then(|| {
        let cpu1: f64 = agents.iter().map(|&p| cpu_seconds(p)).sum();
        100.0 * (cpu1 - cpu0) / t0.elapsed().as_secs_f64()
    });
    let end = &j["end"];
    let bps = end["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0);
    let cpu = &end["cpu_utilization_percent"];
    let (avg, p50, p99, p999) = sockperf(ns.1, ns.0, addr, 11111, &p.env, tcp_lat)?;
    Ok(IpRow {
        path: path.into(),
        tcp_gbps: bps / 1e9,
        cpu_client_pct: cpu["host_total"].as_f64().unwrap_or(0.0),
        cpu_server_pct: cpu["remote_total"].as_f64().unwrap_or(0.0),
        cpu_agents_pct: agent_pct,
        lat_avg_us: avg,
        lat_p50_us: p50,
        lat_p99_us: p99,
        lat_p999_us: p999,
    })
}

/// Runs the comparison; `secs` per iperf3 run.
pub fn run(secs: u64, json: bool, rounds: u32, accel: bool) -> anyhow::Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!("perf ip needs root: it creates network namespaces and TAP devices");
    }
    let mtu = net::DEFAULT_MTU;
    let pid = std::process::id();
    let name = format!("perfip-{pid}");
    // Everything started here is registered with the bench's teardown: an error, a return or
    // Ctrl-C/SIGTERM removes it (servers, namespaces, the fabric), newest first.
    let mut guards = vec![teardown::fabric(&name)];
    let options = Options {
        name: name.clone(),
        nodes: 2,
        window_size: 64 << 20,
        restart_delay_ms: 0,
        exe: std::env::current_exe()?,
        net: Some(NetPlan::new(net::DEFAULT_SUBNET, mtu, 2)?),
        link: None,
        topology: None,
        hosts: None,
    };
    teardown::starting(&name, || launch::start(&options))?;
    let fabric = Fabric::attach(&name)?;
    let agents = [fabric.node_info(1)?.pid, fabric.node_info(2)?.pid];
    drop(fabric);
    let (va, vb) = (format!("bpv-{pid}-1"), format!("bpv-{pid}-2"));
    for ns in [&va, &vb] {
        let n = ns.clone();
        guards.push(teardown::register(format!("namespace {ns}"), move || {
            let _ = Command::new("ip").args(["netns", "del", &n]).status();
        }));
        ip(&["netns", "add", ns])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
    }
    let (ia, ib) = (format!("bpv{pid}a"), format!("bpv{pid}b"));
    // Until the pair moves into the namespaces it lives in the host's: remove it from there.
    let link = ia.clone();
    guards.push(teardown::register(format!("veth {ia}"), move || {
        let _ = Command::new("ip")
            .args(["link", "del", &link])
            .stderr(Stdio::null())
            .status();
    }));
    ip(&[
        "link",
        "add",
        &ia,
        "mtu",
        &mtu.to_string(),
        "type",
        "veth",
        "peer",
        "name",
        &ib,
        "mtu",
        &mtu.to_string(),
    ])?;
    ip(&["link", "set", &ia, "netns", &va])?;
    ip(&["link", "set", &ib, "netns", &vb])?;
    ip(&["-n", &va, "addr", "add", "10.255.255.1/30", "dev", &ia])?;
    ip(&["-n", &vb, "addr", "add", "10.255.255.2/30", "dev", &ib])?;
    ip(&["-n", &va, "link", "set", &ia, "up"])?;
    ip(&["-n", &vb, "link", "set", &ib, "up"])?;

    let (fa, fb) = (net::netns_name(&name, 1), net::netns_name(&name, 2));
    if !json {
        eprintln!(
            "perf ip: iperf3 -t {secs} and sockperf ping-pong, fabric bp0 vs veth, MTU {mtu}"
        );
    }
    let plan = NetPlan::new(net::DEFAULT_SUBNET, mtu, 2)?;
    let fabric_addr = plan.address(2).to_string();
    let mut paths = Vec::new();
    if accel {
        let f = Fabric::attach(&name)?;
        let common = super::exec::accel_env(&name, &f)?;
        let side = |node: u32| {
            let mut e = common.clone();
            e.push(("BACKPLANE_NODE".into(), node.to_string().into()));
            e.push(("BACKPLANE_FABRIC".into(), name.clone().into()));
            e
        };
        paths.push(Path {
            name: "fabric accel",
            ns: (&fa, &fb),
            addr: fabric_addr.clone(),
            env: (side(1), side(2)),
        });
    }
    paths.push(Path {
        name: "fabric bp0",
        ns: (&fa, &fb),
        addr: fabric_addr,
        env: (Env::new(), Env::new()),
    });
    paths.push(Path {
        name: "veth pair",
        ns: (&va, &vb),
        addr: "10.255.255.2".into(),
        env: (Env::new(), Env::new()),
    });
    if accel {
        paths.push(Path {
            name: "loopback",
            ns: (&va, &va),
            addr: "127.0.0.1".into(),
            env: (Env::new(), Env::new()),
        });
    }
    // The figure the ratios compare: the accelerated path with --accel, else bp0.
    let veth = paths
        .iter()
        .position(|p| p.name == "veth pair")
        .expect("veth is measured");
    let mut all = Vec::new();
    let mut dgram = Vec::new();
    for round in 0..rounds {
        let mut row = Vec::new();
        for p in &paths {
            let agents: &[u32] = if p.name.starts_with("fabric") {
                &agents
            } else {
                &[]
            };
            row.push(measure(p, secs, agents, accel)?);
        }
        if accel {
            // About 8 GB a second of iperf3 time: under a second at the usual 20-40 GB/s.
            let iters = (secs * 8_000_000_000 / DGRAM_SIZE).max(1000);
            dgram.push(super::perf::dgram_bw_on(&name, DGRAM_SIZE, iters)?);
        }
        if rounds > 1 && !json {
            eprintln!("perf ip: round {} of {rounds} done", round + 1);
        }
        all.push(row);
    }
    drop(guards);
    let (rows, rounds_kept) = if all.len() == 1 {
        (all.pop().expect("one round"), Vec::new())
    } else {
        let path = |i: usize| all.iter().map(|r| &r[i]).collect::<Vec<_>>();
        (
            (0..paths.len()).map(|i| median_row(&path(i))).collect(),
            all,
        )
    };
    let report = IpReport {
        version: 1,
        test: "ip",
        mtu,
        seconds: secs,
        latency: if accel { "tcp" } else { "udp" },
        ratio_tcp: rows[0].tcp_gbps / rows[veth].tcp_gbps.max(1e-9),
        ratio_lat_p50: rows[0].lat_p50_us / rows[veth].lat_p50_us.max(1e-9),
        ratio_dgram: backplane_bench::stats::median(
            all_rounds(&rows, &rounds_kept)
                .iter()
                .zip(&dgram)
                .map(|(r, d)| r[0].tcp_gbps * 1e3 / 8.0 / d.max(1e-9)),
        )
        .filter(|_| accel),
        rows,
        rounds: rounds_kept,
        dgram_mbps_rounds: dgram,
    };
    if json {
        return super::emit(&format!("{}\n", serde_json::to_string_pretty(&report)?));
    }
    let mut o = String::new();
    let line = "-".repeat(112);
    let _ = writeln!(o, "{line}\n ip: TCP (iperf3) and {} ping-pong latency (sockperf, 64 B, one-way) between two nodes, same run\n{line}", report.latency.to_uppercase());
    let _ = writeln!(
        o,
        "{:<12} {:>10} {:>12} {:>12} {:>12} {:>11} {:>11} {:>11} {:>12}",
        "path",
        "TCP Gbit/s",
        "CPU client%",
        "CPU server%",
        "CPU agents%",
        "lat avg us",
        "lat p50 us",
        "lat p99 us",
        "lat p99.9 us"
    );
    for r in &report.rows {
        let _ = writeln!(
            o,
            "{:<12} {:>10.2} {:>12.1} {:>12.1} {:>12} {:>11.2} {:>11.2} {:>11.2} {:>12.2}",
            r.path,
            r.tcp_gbps,
            r.cpu_client_pct,
            r.cpu_server_pct,
            r.cpu_agents_pct.map_or("-".into(), |c| format!("{c:.1}")),
            r.lat_avg_us,
            r.lat_p50_us,
            r.lat_p99_us,
            r.lat_p999_us
        );
    }
    let _ = writeln!(
        o,
        "{line}\n ratio {} / veth: TCP throughput {:.2} (>=1 is better), latency p50 {:.2} (<=1 is better)",
        report.rows[0].path, report.ratio_tcp, report.ratio_lat_p50
    );
    if !report.rounds.is_empty() {
        let per = |f: &dyn Fn(&[IpRow]) -> f64| {
            report
                .rounds
                .iter()
                .map(|r| format!("{:.2}", f(r)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let _ = writeln!(
        o,
            " {} rounds, fabric and veth alternating; the table holds each field's median\n per-round TCP ratio: {}\n per-round latency p50 ratio: {}",
            report.rounds.len(),
            per(&|r| r[0].tcp_gbps / r[veth].tcp_gbps.max(1e-9)),
            per(&|r| r[0].lat_p50_us / r[veth].lat_p50_us.max(1e-9)),
        );
    }
    if let Some(r) = report.ratio_dgram {
        let per: Vec<String> = all_rounds(&report.rows, &report.rounds)
            .iter()
            .zip(&report.dgram_mbps_rounds)
            .map(|(row, d)| format!("{:.2}", row[0].tcp_gbps * 1e3 / 8.0 / d.max(1e-9)))
            .collect();
        let _ = writeln!(
            o,
            " fabric datagrams node 1 -> node 2, 128 KiB messages (iperf3's write size): {:.0} MB/s (median)\n accelerated TCP / datagrams: {r:.2} (median of the rounds: {})",
            backplane_bench::stats::median(report.dgram_mbps_rounds.iter().copied()).unwrap_or(0.0),
            per.join(" ")
        );
    }
    super::emit(&o)
}

/// Every round's rows: the kept rounds, or the one round `rows` holds.
fn all_rounds<'a>(rows: &'a [IpRow], rounds: &'a [Vec<IpRow>]) -> Vec<&'a [IpRow]> {
    if rounds.is_empty() {
        vec![rows]
    } else {
        rounds.iter().map(|r| r.as_slice()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockperf_summary_is_parsed() {
        let text = "sockperf: \x1b[2;35m====> avg-latency=7.717 (std-dev=22.130)\x1b[0m\n\
                    sockperf: ---> percentile 99.900 =   19.501\n\
                    sockperf: ---> percentile 99.000 =   13.700\n\
                    sockperf: ---> percentile 50.000 =    7.173\n";
        assert_eq!(parse_sockperf(text), Some((7.717, 7.173, 13.7, 19.501)));
        assert_eq!(parse_sockperf("nothing"), None);
    }

    #[test]
    fn rounds_of_a_path_are_summarised_by_medians() {
        let row = |g: f64, a: Option<f64>| IpRow {
            path: "fabric bp0".into(),
            tcp_gbps: g,
            lat_p50_us: g * 10.0,
            cpu_agents_pct: a,
            ..IpRow::default()
        };
        let (a, b, c) = (row(3.0, Some(50.0)), row(1.0, None), row(2.0, Some(70.0)));
        let m = median_row(&[&a, &b, &c]);
        assert_eq!(
            (m.path.as_str(), m.tcp_gbps, m.lat_p50_us),
            ("fabric bp0", 2.0, 20.0)
        );
        assert_eq!(m.cpu_agents_pct, Some(60.0)); // the rounds that measured agents
    }
}
