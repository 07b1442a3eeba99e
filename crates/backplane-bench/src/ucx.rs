//! UCX over shared memory as the reference in the same run: one `ucx_perftest` server and
//! client per measurement, over loopback for the handshake, `UCX_TLS=posix,cma,self` for data.
//! Used by `backplane perf` and `backplane bench`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Serialize;

use crate::cpu::{Rusage, Who};

/// The environment `ucx_perftest` runs with: shared memory transports only.
pub const UCX_ENV: [(&str, &str); 2] = [
    ("UCX_TLS", "posix,cma,self"),
    ("UCX_WARN_UNUSED_ENV_VARS", "n"),
];

/// Which UCX test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum UcxTest {
    /// `tag_lat`: ping-pong latency.
    TagLat,
    /// `tag_bw`: streaming bandwidth.
    TagBw,
}

impl UcxTest {
    /// The `-t` name.
    pub fn name(self) -> &'static str {
        match self {
            UcxTest::TagLat => "tag_lat",
            UcxTest::TagBw => "tag_bw",
        }
    }
}

/// One `ucx_perftest` result.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct UcxResult {
    /// Iterations run.
    pub iterations: u64,
    /// Median one-way latency, µs.
    pub typical_lat_us: f64,
    /// Mean one-way latency, µs.
    pub avg_lat_us: f64,
    /// Overall bandwidth, MB/s (10^6 bytes per second).
    pub bw_mb_per_s: f64,
    /// Overall message rate, messages per second.
    pub msg_rate: f64,
    /// CPU of the client process.
    pub client_cpu: Rusage,
    /// CPU of the server process.
    pub server_cpu: Rusage,
    /// Wall-clock time of the client run, ns.
    pub wall_ns: u64,
}

/// Finds an executable on `$PATH`.
pub fn which(prog: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(prog))
            .find(|f| f.is_file())
    })
}

/// A TCP port free on loopback right now.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Runs one `ucx_perftest` client/server pair over loopback and parses its CSV line. The CPU
/// of each process is read from `getrusage(RUSAGE_CHILDREN)` around reaping it, so nothing
/// else may reap children of this process meanwhile.
pub fn run(
    path: &Path,
    test: UcxTest,
    size: u64,
    iters: u64,
    warmup: u64,
) -> anyhow::Result<UcxResult> {
    run_named(path, test.name(), size, iters, warmup)
}

/// [`run`] with any `ucx_perftest -t` test (`ucp_put_lat`, `ucp_get`, ... for `backplane perf`).
pub fn run_named(
    path: &Path,
    test: &str,
    size: u64,
    iters: u64,
    warmup: u64,
) -> anyhow::Result<UcxResult> {
    run_between(path, test, size, iters, warmup, None)
}

/// Where `ucx_perftest`'s server runs when it is not this host: started through `via` (a
/// command prefix such as `ssh hostb`), reached at `addr`; both sides then use the
/// environment's `UCX_TLS` (the transport between the hosts), not [`UCX_ENV`].
#[derive(Debug, Clone)]
pub struct Remote {
    /// The command prefix that runs a program on the other host.
    pub via: Vec<String>,
    /// The other host's address.
    pub addr: String,
}

/// [`run_named`] with the server on this host (`None`) or on another ([`Remote`]).
pub fn run_between(
    path: &Path,
    test: &str,
    size: u64,
    iters: u64,
    warmup: u64,
    remote: Option<&Remote>,
) -> anyhow::Result<UcxResult> {
    let port = free_port()?.to_string();
    let mut server_cmd = match remote {
        Some(r) if !r.via.is_empty() => {
            let mut c = Command::new(&r.via[0]);
            c.args(&r.via[1..]).arg(path);
            c
        }
        _ => {
            let mut c = Command::new(path);
            c.envs(UCX_ENV);
            c
        }
    };
    let client_env: &[(&str, &str)] = if remote.is_some() { &[] } else { &UCX_ENV };
    let server_addr = remote.map_or("127.0.0.1", |r| r.addr.as_str());
    crate::pinning::pin_peer(&mut server_cmd);
    let mut server = server_cmd
        .args(["-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start ucx_perftest")?;
    let pid = server.id();
    let guard = crate::teardown::child(format!("ucx_perftest server {pid}"), pid);
    let mut last_err = String::new();
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(20));
        let before = Rusage::now(Who::Children);
        let t0 = crate::cpu::mono_ns();
        let mut cmd = Command::new(path);
        cmd.args([
            server_addr,
            "-p",
            &port,
            "-t",
            test,
            "-s",
            &size.to_string(),
            "-n",
            &iters.to_string(),
            "-w",
            &warmup.to_string(),
            "-f",
            "-v",
        ])
        .envs(client_env.iter().copied())
        .stdin(Stdio::null());
        let out = crate::teardown::output_unless_server_gone(
            &mut cmd,
            "ucx_perftest client",
            pid,
            Duration::from_secs(5),
        )?;
        let wall_ns = crate::cpu::mono_ns() - t0;
        let client_cpu = before.until(&Rusage::now(Who::Children));
        if !out.status.success() {
            last_err = String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
                .to_string();
            if let Ok(Some(_)) = server.try_wait() {
                guard.disarm(); // reaped by try_wait
                bail!("ucx_perftest server exited: {last_err}");
            }
            continue; // the server may not be listening yet
        }
        let before = Rusage::now(Who::Children);
        // The server ends by itself after one client; wait a little, then make it.
        for _ in 0..200 {
            if let Ok(Some(_)) = server.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = server.kill();
        let _ = server.wait();
        guard.disarm(); // reaped: its pid may be reused from now on
        let server_cpu = before.until(&Rusage::now(Who::Children));
        let text = String::from_utf8_lossy(&out.stdout);
        let mut r = parse_csv(&text)?;
        r.client_cpu = client_cpu;
        r.server_cpu = server_cpu;
        r.wall_ns = wall_ns;
        return Ok(r);
    }
    let _ = server.kill();
    let _ = server.wait();
    guard.disarm();
    bail!("ucx_perftest client never connected: {last_err}")
}

/// Parses `ucx_perftest -f -v` output: a header line then
/// `iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr`.
/// ucx_perftest's MB/s are 2^20 bytes per second; they are converted to 10^6.
pub fn parse_csv(text: &str) -> anyhow::Result<UcxResult> {
    let line = text
        .lines()
        .rev()
        .find(|l| {
            l.split(',').count() >= 8 && l.trim_start().starts_with(|c: char| c.is_ascii_digit())
        })
        .context("no result line in ucx_perftest output")?;
    let v: Vec<f64> = line
        .split(',')
        .map(|f| f.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .context("malformed ucx_perftest result line")?;
    Ok(UcxResult {
        iterations: v[0] as u64,
        typical_lat_us: v[1],
        avg_lat_us: v[2],
        bw_mb_per_s: v[5] * 1_048_576.0 / 1e6,
        msg_rate: v[7],
        ..UcxResult::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_csv_is_parsed_into_latency_and_bandwidth_in_decimal_megabytes() {
        let text = "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n\
                    100000,0.135,0.140,0.140,54.65,54.65,7162588,7162588\n";
        let r = parse_csv(text).unwrap();
        assert_eq!(r.iterations, 100000);
        assert_eq!(r.typical_lat_us, 0.135);
        assert_eq!(r.avg_lat_us, 0.140);
        assert!((r.bw_mb_per_s - 54.65 * 1.048576).abs() < 1e-6);
        assert_eq!(r.msg_rate, 7162588.0);
        // ucx_perftest pads the iteration count with spaces at large sizes.
        assert_eq!(
            parse_csv(" 100,1216.0,1230.0,1230.0,6503.79,6503.79,813,813\n")
                .unwrap()
                .iterations,
            100
        );
        assert!(parse_csv("garbage\n").is_err());
    }
}
