//! `backplane perf dma-bw`: raw DMA bandwidth from a region of node 1 into a region of node 2
//! (granted and mapped as a peer would), and what the offload costs the submitting thread:
//! its own CPU time (`CLOCK_THREAD_CPUTIME_ID`) per GB moved and in percent of one core.
//! Beside it, single-thread memcpy of the same size measured in the same run
//! (`backplane_bench::memcpy`), the physical limit one copying thread reaches.
//!
//! Each job is `--segments` segments splitting the size evenly; jobs are kept `depth` deep
//! (enough for 64 MiB in flight, 2..64 jobs) and the submitter sleeps in `DmaQueue::wait`
//! until three quarters of them completed, then tops the queue up. Per size, `--rounds` (default
//! five) rounds of DMA and of memcpy alternate (so both meet the same spells of a shared
//! machine); the figure to judge by is the median of the rounds' paired ratios (DMA round /
//! the memcpy round beside it), with the medians of both sides beside it. The submitter's CPU
//! is summed over the DMA rounds.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use backplane::dma::*;
use backplane::fabric::Fabric;
use backplane::verbs::{AccessFlags, Context};
use backplane_bench::dma_path::{depth, poll_all};
use serde::Serialize;

use super::{Args, Loop, Test, MAX_SIZE};
use backplane_bench::ucx;

const MAX: u64 = 64 << 20;

/// CPU time of the calling thread, seconds: `CLOCK_THREAD_CPUTIME_ID`, the scheduler's exact
/// run time. (`getrusage(RUSAGE_THREAD)` is sampled at the timer tick on this kernel: 4 ms
/// steps, too coarse for a thread that runs a few ms per second.)
fn thread_cpu_s() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

#[derive(Debug, Serialize)]
struct DmaRow {
    bytes: u64,
    segments: u64,
    iterations: u64,
    engines: usize,
    inline_threshold: u64,
    /// Median of the rounds' bandwidths.
    bw_avg_mbps: f64,
    /// Median of the rounds' paired ratios: DMA bandwidth / memcpy bandwidth of the same round.
    ratio_to_memcpy: f64,
    /// Every round's DMA bandwidth, in order.
    round_mbps: Vec<f64>,
    /// Every round's memcpy bandwidth (median pass), in order.
    round_memcpy_mbps: Vec<f64>,
    /// Slowest round.
    bw_min_mbps: f64,
    /// Fastest round.
    bw_max_mbps: f64,
    /// Submitting thread: CPU seconds per GB (10^9 bytes) moved.
    submitter_cpu_s_per_gb: f64,
    /// Submitting thread: percent of one core over the run.
    submitter_cpu_pct: f64,
    /// Single-thread memcpy of the same size, same run: median of the rounds' median passes.
    memcpy_mbps: f64,
    /// Best pass.
    memcpy_best_mbps: f64,
    /// With `--peer-via` (node 2 on another host): `ucx_perftest ucp_put_bw` between the
    /// hosts, same size, rounds alternating with DMA's (median).
    #[serde(skip_serializing_if = "Option::is_none")]
    ucx_put_mbps: Option<f64>,
    /// Median of the rounds' paired ratios DMA / UCX.
    #[serde(skip_serializing_if = "Option::is_none")]
    ratio_to_ucx: Option<f64>,
    /// Every round's UCX bandwidth, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    round_ucx_mbps: Vec<f64>,
}

#[derive(Debug, Serialize)]
struct DmaReport {
    version: u32,
    test: &'static str,
    fabric: String,
    /// Node 2 runs on another host (`--peer-via`).
    across_hosts: bool,
    /// Why UCX was not run beside it (across hosts only).
    #[serde(skip_serializing_if = "Option::is_none")]
    ucx_note: Option<String>,
    rows: Vec<DmaRow>,
}

fn sizes(a: &Args) -> anyhow::Result<Vec<u64>> {
    if a.all {
        return Ok((5..=13).map(|p| 1u64 << (2 * p)).collect()); // 1 KiB, 4 KiB .. 64 MiB
    }
    let s = a.size.unwrap_or(1 << 20);
    if !(1..=MAX).contains(&s) {
        bail!("--size {s} is out of range for dma-bw: use 1 B to 64 MiB");
    }
    Ok(vec![s])
}

fn iters_for(a: &Args, size: u64) -> u64 {
    a.iters.unwrap_or(((8u64 << 30) / size).clamp(16, 100_000))
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let mut sizes = sizes(a)?;
    let remote = super::remote_of(a)?;
    if remote.is_some() {
        sizes.retain(|&s| s <= MAX_SIZE);
        if sizes.is_empty() {
            bail!(
                "dma-bw --peer-via moves at most {MAX_SIZE} bytes per job (the perf peer's region)"
            );
        }
    }
    // Across hosts, `ucp_put_bw` between them is the peer (on one host, memcpy is).
    let (ucx_path, ucx_note) = match &remote {
        None => (None, None),
        Some(_) => match super::ucx_perftest(a.ucx)? {
            Ok(p) => (Some(p), None),
            Err(note) => (None, Some(note)),
        },
    };
    if a.iters == Some(0) {
        bail!("--iters must be at least 1");
    }
    if a.segments == 0 || a.segments > 1 << 16 {
        bail!("--segments {} is out of range: use 1..=65536", a.segments);
    }
    let mut cleanup = None;
    let name = match &a.name {
        Some(n) => n.clone(),
        None => {
            let n = format!("perf-{}", std::process::id());
            cleanup = Some(backplane_bench::teardown::fabric(&n));
            backplane_bench::teardown::starting(&n, || super::super::up::start(&n, 2, 8 << 20, 0))?;
            n
        }
    };
    let fabric = Fabric::attach(&name)?;
    if fabric.nodes() < 2 {
        bail!("fabric '{name}' has one node; perf needs nodes 1 and 2");
    }
    let cfg = DmaConfig {
        engines: a.engines,
        pin: a.pin.clone(),
        inline_threshold: a.inline_threshold.unwrap_or(DEFAULT_INLINE_THRESHOLD),
        ..DmaConfig::default()
    };
    let max = *sizes.iter().max().expect("one size at least");
    crate::cmd::require_local(&fabric, if remote.is_some() { &[1] } else { &[1, 2] })?;
    let c1 = Context::open(&fabric.node(1)?)?;
    let src = c1
        .alloc_pd()
        .alloc_mr(max as usize, AccessFlags::LOCAL_WRITE)?;
    src.fill(0, max, 0x5A)?;
    // Node 2's region: of a context here, or the perf peer's on node 2's host.
    let mut far = None;
    let mut here = None;
    let dst_rkey = match &remote {
        Some(r) => {
            let (child, guard) = super::spawn_peer(&name, Test::DmaBw, Loop::Native, Some(&r.via))?;
            let region = super::verbs::FarRegion::connect(&fabric, super::PEER_PORT)?;
            if region.len < max {
                bail!("the perf peer offers {} bytes, not {max}", region.len);
            }
            let rkey = region.rkey;
            far = Some((region, child, guard));
            rkey
        }
        None => {
            let c2 = Context::open(&fabric.node(2)?)?;
            let dst = c2.alloc_pd().alloc_mr(
                max as usize,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            )?;
            let rkey = dst.rkey();
            here = Some((c2, dst));
            rkey
        }
    };
    let engines = DmaEngines::start(&cfg)?;
    if !a.json {
        eprintln!(
            "dma-bw: fabric '{name}', node 1 region -> node 2 region{}, {} engine(s){}, {} segment(s) per job, inline threshold {} B",
            if remote.is_some() { " (on another host)" } else { "" },
            cfg.engines,
            if cfg.pin.is_empty() { String::new() } else { format!(" pinned to {:?}", cfg.pin) },
            a.segments,
            cfg.inline_threshold
        );
    }
    let mut rows = Vec::new();
    for &size in &sizes {
        let segs = a.segments.min(size);
        let q = DmaQueue::new(&c1, &engines, depth(size));
        let job: Vec<Segment> = (0..segs)
            .map(|i| {
                let (o, e) = (size * i / segs, size * (i + 1) / segs);
                Segment {
                    src: Mem::local(&src),
                    src_off: o,
                    dst: Mem::Remote {
                        node: 2,
                        rkey: dst_rkey,
                    },
                    dst_off: o,
                    len: e - o,
                }
            })
            .collect();
        let iters = iters_for(a, size);
        pump(&q, &job, (iters / 10).clamp(2, 1000))?; // warm-up: grants mapped, caches warm
                                                      // Rounds of DMA and memcpy in turn, so that both see the same spells of a shared
                                                      // machine; the medians of the rounds are compared.
        let rounds = u64::from(a.rounds);
        let per = (iters / rounds).max(1);
        let passes = ((512u64 << 20) / size / rounds).clamp(4, 4000) as usize;
        let (mut dma_rates, mut mc_rates, mut best) = (Vec::new(), Vec::new(), 0f64);
        let mut ucx_rates = Vec::new();
        let (mut cpu, mut wall) = (0f64, 0f64);
        for _ in 0..rounds {
            let wall0 = Instant::now();
            let cpu0 = thread_cpu_s();
            pump(&q, &job, per)?;
            let c = thread_cpu_s() - cpu0;
            let w = wall0.elapsed().as_secs_f64().max(1e-9);
            dma_rates.push((size * per) as f64 / w / 1e6);
            (cpu, wall) = (cpu + c, wall + w);
            let m = backplane_bench::memcpy::measure(size as usize, passes);
            mc_rates.push(m.median_mb_per_s);
            best = best.max(m.mb_per_s);
            if let (Some(p), Some(r)) = (&ucx_path, &remote) {
                let warm = (per / 10).clamp(10, 10_000);
                let u = ucx::run_between(p, "ucp_put_bw", size, per, warm, Some(r))?;
                ucx_rates.push(u.bw_mb_per_s);
            }
        }
        drop(q);
        let total = (size * per * rounds) as f64;
        let ratios = dma_rates.iter().zip(&mc_rates).map(|(d, m)| d / m);
        let med = |v: &[f64]| backplane_bench::stats::median(v.iter().copied()).unwrap_or(f64::NAN);
        let has_ucx = !ucx_rates.is_empty();
        let to_ucx = dma_rates.iter().zip(&ucx_rates).map(|(d, u)| d / u);
        rows.push(DmaRow {
            bytes: size,
            segments: segs,
            iterations: per * rounds,
            engines: cfg.engines,
            inline_threshold: cfg.inline_threshold,
            ratio_to_memcpy: backplane_bench::stats::median(ratios).unwrap_or(f64::NAN),
            bw_avg_mbps: med(&dma_rates),
            bw_min_mbps: dma_rates.iter().copied().fold(f64::INFINITY, f64::min),
            bw_max_mbps: dma_rates.iter().copied().fold(0.0, f64::max),
            submitter_cpu_s_per_gb: cpu / (total / 1e9),
            submitter_cpu_pct: 100.0 * cpu / wall,
            memcpy_mbps: med(&mc_rates),
            memcpy_best_mbps: best,
            ucx_put_mbps: has_ucx.then(|| med(&ucx_rates)),
            ratio_to_ucx: backplane_bench::stats::median(to_ucx),
            round_mbps: dma_rates,
            round_memcpy_mbps: mc_rates,
            round_ucx_mbps: ucx_rates,
        });
    }
    drop(engines);
    if let Some((region, mut child, guard)) = far {
        region.finish()?;
        let _ = child.wait();
        guard.disarm(); // reaped
    }
    drop((src, here, c1));
    drop(fabric);
    drop(cleanup);
    let report = DmaReport {
        version: 1,
        test: "dma-bw",
        fabric: name,
        across_hosts: remote.is_some(),
        ucx_note,
        rows,
    };
    if a.json {
        super::super::emit(&format!("{}\n", serde_json::to_string_pretty(&report)?))?;
    } else {
        super::super::emit(&render(&report))?;
    }
    Ok(())
}

/// Runs `iters` copies of `job`, keeping the queue full; sleeps while engines work.
fn pump(q: &DmaQueue, job: &[Segment], iters: u64) -> anyhow::Result<()> {
    let depth = depth(job.iter().map(|s| s.len).sum());
    let mut wc = vec![DmaWc::default(); 64];
    let (mut sent, mut done) = (0u64, 0u64);
    while done < iters {
        while sent < iters && sent - done < depth as u64 {
            q.submit(&Job::new(sent, job))
                .context("submitting a DMA job")?;
            sent += 1;
        }
        let want = (depth * 3 / 4).max(1).min((sent - done) as usize);
        q.wait(want, Some(Duration::from_secs(10)));
        let got = poll_all(q, &mut wc)?;
        if got == 0 {
            bail!(
                "no DMA completion in 10 s ({} jobs outstanding)",
                q.outstanding()
            );
        }
        done += got;
    }
    Ok(())
}

fn render(r: &DmaReport) -> String {
    let line = "-".repeat(140);
    let rounds = r.rows.first().map_or(0, |x| x.round_mbps.len());
    let where_ = if r.across_hosts {
        "node 1 region -> node 2 region on another host, through the hosts' bridges"
    } else {
        "node 1 region -> node 2 region"
    };
    let mut o = format!(
        "{line}\n dma-bw over raw DMA jobs ({where_})\n \
         engine threads copy; the submitting thread only submits and waits. BW: median of \
         {rounds} rounds (slowest-fastest);\n memcpy: single thread, same size, rounds \
         alternating with DMA's (median); of memcpy: median of the rounds' paired ratios\n"
    );
    o += &format!(
        "{:>9} {:>9} {:>11} {:>8} {:>19} {:>17} {:>15} {:>10} {:>20} {:>13}\n",
        "#bytes",
        "#segments",
        "#iterations",
        "engines",
        "BW average[MB/sec]",
        "rounds[MB/sec]",
        "memcpy[MB/sec]",
        "of memcpy",
        "submitter cpu[s/GB]",
        "submitter[%]"
    );
    for x in &r.rows {
        o += &format!(
            "{:>9} {:>9} {:>11} {:>8} {:>19.2} {:>17} {:>15.2} {:>10} {:>20.4} {:>13.2}\n",
            x.bytes,
            x.segments,
            x.iterations,
            x.engines,
            x.bw_avg_mbps,
            format!("{:.0}-{:.0}", x.bw_min_mbps, x.bw_max_mbps),
            x.memcpy_mbps,
            format!("{:.0}%", 100.0 * x.ratio_to_memcpy),
            x.submitter_cpu_s_per_gb,
            x.submitter_cpu_pct
        );
    }
    if r.rows.iter().any(|x| x.ucx_put_mbps.is_some()) {
        o += &format!(
            "{line}\n same run: UCX ucp_put_bw (ucx_perftest between the hosts, the environment's \
             UCX_TLS), rounds alternating with DMA's; of UCX: median of the paired ratios (>=1 \
             is better)\n{:>9} {:>19} {:>17} {:>10}\n",
            "#bytes", "BW average[MB/sec]", "rounds[MB/sec]", "of UCX"
        );
        for x in &r.rows {
            let (lo, hi) = x
                .round_ucx_mbps
                .iter()
                .fold((f64::INFINITY, 0f64), |(l, h), &v| (l.min(v), h.max(v)));
            o += &format!(
                "{:>9} {:>19.2} {:>17} {:>10}\n",
                x.bytes,
                x.ucx_put_mbps.unwrap_or(f64::NAN),
                format!("{lo:.0}-{hi:.0}"),
                x.ratio_to_ucx.map_or("-".into(), |v| format!("{v:.2}")),
            );
        }
    }
    if let Some(n) = &r.ucx_note {
        o += &format!(" note: {n}\n");
    }
    o += &format!("{line}\n");
    o
}
