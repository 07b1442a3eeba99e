//! perftest over the fabric in the same run: the same operation, measured by the unmodified
//! Debian binary (`ib_write_lat`, …) through the drop-in `libibverbs.so.1` — what the ABI
//! layer costs a libibverbs program, beside the engine measured directly.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use backplane_bench::perf_row::Row;
use backplane_bench::teardown;

use super::Test;

/// The perftest program of a verbs test.
pub(super) fn program(test: Test) -> Option<&'static str> {
    Some(match test {
        Test::WriteLat => "ib_write_lat",
        Test::WriteBw => "ib_write_bw",
        Test::ReadLat => "ib_read_lat",
        Test::ReadBw => "ib_read_bw",
        Test::SendLat => "ib_send_lat",
        Test::SendBw => "ib_send_bw",
        Test::AtomicLat => "ib_atomic_lat",
        _ => return None,
    })
}

/// Why perftest cannot run here, or `None` when it can (installed, the library built).
pub(super) fn unavailable(test: Test) -> Option<String> {
    let prog = program(test)?;
    if backplane_bench::ucx::which(prog).is_none() {
        return Some(format!(
            "{prog} not found (install Debian package perftest); perftest comparison skipped"
        ));
    }
    let lib = std::env::current_exe()
        .ok()?
        .with_file_name("libibverbs.so");
    if !lib.is_file() {
        return Some(format!(
            "{} not built (cargo build -p backplane-ibverbs); perftest comparison skipped",
            lib.display()
        ));
    }
    None
}

/// True once something listens on TCP `port` (a probe connection would be taken by the
/// server for its client).
fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                w.len() > 3 && w[1].ends_with(&want) && w[3] == "0A"
            })
        })
    })
}

/// A free TCP port on loopback.
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot find a free port")?;
    Ok(l.local_addr()?.port())
}

/// One perftest run between nodes 1 (server) and 2 (client) of `fabric`: the client's row.
pub(super) fn run(fabric: &str, test: Test, size: u64, iters: u64) -> anyhow::Result<Row> {
    let prog = program(test).context("no perftest program for this test")?;
    let dir = super::super::exec::verbs_lib_dir(fabric)?;
    let port = free_port()?.to_string();
    let (s, n) = (size.to_string(), iters.to_string());
    let cmd = |node: u32| {
        let mut c = Command::new(prog);
        c.args(["-p", &port, "-n", &n]);
        if test != Test::AtomicLat {
            c.args(["-s", &s]);
        }
        c.env("LD_LIBRARY_PATH", &dir)
            .env("BACKPLANE_FABRIC", fabric)
            .env("BACKPLANE_NODE", node.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let mut server = cmd(1);
    backplane_bench::pinning::pin_peer(&mut server);
    let server = server
        .spawn()
        .with_context(|| format!("cannot run {prog}"))?;
    let guard = teardown::child(prog, server.id());
    let t0 = Instant::now();
    while !listening(port.parse()?) {
        if t0.elapsed() > Duration::from_secs(20) {
            bail!("{prog} (server) did not start listening");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut client = cmd(2);
    if test.is_lat() {
        // Every sample, sorted (`-H`): its median is `t_typical` to the nanosecond, where the
        // table rounds to 10 ns — a tenth of a fast band's one-way latency.
        client.arg("-H");
    }
    let client = client.arg("localhost").output();
    let server = server.wait_with_output();
    guard.disarm();
    let client = client.with_context(|| format!("cannot run {prog}"))?;
    let server = server.with_context(|| format!("{prog} (server)"))?;
    for (o, side) in [(&client, "client"), (&server, "server")] {
        if !o.status.success() {
            bail!("{prog} ({side}) failed: {}", last_line(o));
        }
    }
    parse(&String::from_utf8_lossy(&client.stdout), test.is_lat())
        .with_context(|| format!("cannot read {prog}'s results"))
}

fn last_line(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr);
    e.lines()
        .rfind(|l| !l.trim().is_empty())
        .unwrap_or("no message")
        .trim()
        .to_owned()
}

/// perftest's result line (the one after the last `#bytes` header) as a row; its MB are 2^20
/// bytes, a row's 10^6. With the samples `-H` prints (`N, value` lines, sorted, the tail
/// perftest leaves out already left out), `t_typical` is their median as perftest computes it
/// (the mean of the middle two for an even count) and `t_avg` their mean, unrounded.
fn parse(out: &str, lat: bool) -> anyhow::Result<Row> {
    let all: Vec<&str> = out.lines().collect();
    let header = all
        .iter()
        .rposition(|l| l.trim_start().starts_with("#bytes"))
        .context("no result table")?;
    let mut lines = all[header + 1..].iter();
    let v: Vec<f64> = lines
        .next()
        .context("no result line")?
        .split_whitespace()
        .map(|w| w.parse::<f64>())
        .collect::<Result<_, _>>()
        .context("a result that is not a number")?;
    let get = |i: usize| v.get(i).copied().context("a short result line");
    let mut row = Row {
        bytes: get(0)? as u64,
        iterations: get(1)? as u64,
        ..Row::default()
    };
    if lat {
        // #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%
        row.t_min_us = Some(get(2)?);
        row.t_max_us = Some(get(3)?);
        let d = samples(out);
        row.t_typical_us = Some(match d.as_slice() {
            [] => get(4)?,
            d if d.len() % 2 == 0 => (d[d.len() / 2] + d[d.len() / 2 - 1]) / 2.0,
            d => d[d.len() / 2],
        });
        // (Their mean too: the table's 0.07 is any of 0.065-0.075, a seventh of a READ.)
        row.t_avg_us = Some(if d.is_empty() {
            get(5)?
        } else {
            d.iter().sum::<f64>() / d.len() as f64
        });
        row.t_stdev_us = Some(get(6)?);
        row.p99_us = Some(get(7)?);
        row.p999_us = Some(get(8)?);
    } else {
        // #bytes #iterations BW_peak BW_average MsgRate
        const MIB: f64 = 1_048_576.0 / 1e6;
        row.bw_peak_mbps = Some(get(2)? * MIB);
        row.bw_avg_mbps = Some(get(3)? * MIB);
        row.msg_rate_mpps = Some(get(4)?);
    }
    Ok(row)
}

/// The samples of perftest's `-H` (lines `N, value`, in its order: sorted).
fn samples(out: &str) -> Vec<f64> {
    out.lines()
        .filter_map(|l| {
            let (i, v) = l.split_once(", ")?;
            i.trim().parse::<u64>().ok()?;
            v.trim().parse::<f64>().ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perftest_tables_parse_into_rows_in_decimal_megabytes() {
        let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n 2       1000          0.09           0.35         0.13     \t       0.13        \t0.00   \t\t0.19    \t\t0.35   \n";
        let r = parse(lat, true).unwrap();
        assert_eq!((r.bytes, r.iterations), (2, 1000));
        assert_eq!(r.t_typical_us, Some(0.13));
        assert_eq!(r.p999_us, Some(0.35));
        let bw = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n 65536      5000             38850.50            29343.74\t\t   0.469500\n";
        let r = parse(bw, false).unwrap();
        assert!((r.bw_avg_mbps.unwrap() - 29343.74 * 1.048576).abs() < 1e-6);
        assert_eq!(r.msg_rate_mpps, Some(0.4695));
        assert!(parse("Couldn't connect", true).is_err());
        // With -H: a header before the samples, the samples, the header and the result line.
        let h = format!(
            "{}#, usec\n1, 0.0712\n2, 0.0731\n3, 0.0744\n4, 0.0795\n{}",
            " #bytes #iterations t_min\n",
            " #bytes #iterations t_min\n 8 5 0.07 0.08 0.07 0.08 0.00 0.08 0.08\n"
        );
        let r = parse(&h, true).unwrap();
        assert!((r.t_typical_us.unwrap() - 0.07375).abs() < 1e-9, "{r:?}");
        assert!((r.t_avg_us.unwrap() - 0.074_55).abs() < 1e-9, "{r:?}");
        assert_eq!(r.t_min_us, Some(0.07));
        assert!(parse(" #bytes\n 8 100 x\n", true).is_err());
    }
}
