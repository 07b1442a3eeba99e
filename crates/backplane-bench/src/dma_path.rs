//! The `fabric-raw` path: the raw mode of seed 000 §4.6 — a stream of DMA jobs from a region
//! of node 1 into a region of node 2, copied by the DMA engine threads
//! ([`backplane::dma`]) while the submitting thread only submits and waits.
//!
//! Both regions are made by this process through two device contexts, one per node, and the
//! destination is named by node 2's rkey, so every job goes through the same checks and grant
//! mapping as a peer's region would (the way `backplane perf dma-bw` measures). There is no
//! receiving process: a DMA job's completion is the evidence that the bytes landed, and after
//! each throughput point the destination is compared with the source byte for byte.
//!
//! What is reported, per job size:
//! - throughput: bytes of completed jobs per second between the end of the warm-up and the
//!   last completion, with up to 64 MiB of jobs in flight;
//! - CPU: the submitting thread (`client_cpu`) and the engine threads (`server_cpu`: the
//!   process's CPU minus the submitter's, the engines being the only other busy threads);
//! - latency: one job at a time, from submission to its completion seen by polling — the
//!   whole transfer, not half a round trip (jobs of at most 16 KiB are copied by the submitter
//!   itself, as the library does, so they show the inline path).

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use backplane::dma::{DmaConfig, DmaEngines, DmaQueue, DmaWc, Job, Mem, Segment};
use backplane::fabric::Fabric;
use backplane::verbs::{AccessFlags, Context, Mr};
use hdrhistogram::Histogram;

use crate::cpu::{MachineCpu, Rusage, SideCpu, Snapshot, Who};

/// One throughput measurement.
pub struct DmaRun {
    /// MB/s (10^6 B/s) of completed jobs after the warm-up.
    pub mb_per_s: f64,
    /// Jobs per second after the warm-up.
    pub jobs_per_s: f64,
    /// The submitting thread.
    pub submitter: SideCpu,
    /// Its CPU time.
    pub submitter_used: Rusage,
    /// The engine threads.
    pub engines: SideCpu,
    /// Their CPU time.
    pub engines_used: Rusage,
    /// The machine over the run.
    pub machine: Option<MachineCpu>,
    /// Wall time of the run, ns.
    pub wall_ns: u64,
    /// Bytes moved in the whole run (warm-up included).
    pub bytes: u64,
}

/// Source and destination regions and the engines, for the whole sweep.
pub struct DmaPath {
    c1: Context,
    _c2: Context,
    src: Mr,
    dst: Mr,
    engines: DmaEngines,
}

/// Jobs in flight: enough for 64 MiB, 2..=64 (the submitter wakes once per three quarters of
/// them: each sleep and wake-up costs it several µs of CPU).
pub fn depth(size: u64) -> usize {
    ((64u64 << 20) / size.max(1)).clamp(2, 64) as usize
}

impl DmaPath {
    /// Regions of `max` bytes on nodes 1 and 2 of `fabric` and one engine thread.
    pub fn new(fabric: &Fabric, max: u64) -> anyhow::Result<Self> {
        let c1 = Context::open(&fabric.node(1)?).context("opening node 1")?;
        let c2 = Context::open(&fabric.node(2)?).context("opening node 2")?;
        let src = c1
            .alloc_pd()
            .alloc_mr(max as usize, AccessFlags::LOCAL_WRITE)?;
        let dst = c2.alloc_pd().alloc_mr(
            max as usize,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )?;
        let engines = DmaEngines::start(&DmaConfig::default())?;
        Ok(DmaPath {
            c1,
            _c2: c2,
            src,
            dst,
            engines,
        })
    }

    fn job(&self, size: u64) -> [Segment; 1] {
        [Segment {
            src: Mem::local(&self.src),
            src_off: 0,
            dst: Mem::Remote {
                node: 2,
                rkey: self.dst.rkey(),
            },
            dst_off: 0,
            len: size,
        }]
    }

    /// Fills the first `size` bytes of the source with a pattern of this size.
    fn stamp(&mut self, size: u64) {
        let salt = size.wrapping_mul(0x9E37_79B9) as u8;
        let pattern: Vec<u8> = (0..size as usize)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt))
            .collect();
        self.src
            .write(0, &pattern)
            .expect("the source region holds every size measured");
    }

    /// Checks that the destination holds what the source does (the jobs' bytes landed).
    fn check(&self, size: u64) -> anyhow::Result<()> {
        let n = size as usize;
        if self.dst.to_vec(0, n)? != self.src.to_vec(0, n)? {
            bail!("the destination region does not hold the source's {size} bytes after the jobs completed");
        }
        Ok(())
    }

    /// Streams jobs of `size` bytes for `warm` + `dur`, keeping the queue full.
    pub fn throughput(
        &mut self,
        size: u64,
        dur: Duration,
        warm: Duration,
    ) -> anyhow::Result<DmaRun> {
        self.stamp(size);
        let job = self.job(size);
        let q = DmaQueue::new(&self.c1, &self.engines, depth(size));
        let me = Snapshot::take(Who::Thread);
        let all = Snapshot::take(Who::Process);
        let (mut sent, mut done, mut counted, mut skip_at) = (0u64, 0u64, 0u64, None);
        let t0 = Instant::now();
        let (warm_end, end) = (t0 + warm, t0 + warm + dur);
        let mut wc = vec![DmaWc::default(); 64];
        let mut last = t0;
        loop {
            while sent - done < depth(size) as u64 && Instant::now() < end {
                q.submit(&Job::new(sent, &job))
                    .context("submitting a DMA job")?;
                sent += 1;
            }
            if sent == done {
                break;
            }
            let want = ((sent - done) as usize * 3 / 4).max(1);
            q.wait(want, Some(Duration::from_secs(10)));
            let n = poll_all(&q, &mut wc)?;
            if n == 0 {
                bail!(
                    "no DMA completion in 10 s ({} jobs outstanding)",
                    q.outstanding()
                );
            }
            done += n;
            let now = Instant::now();
            match skip_at {
                None if now >= warm_end => skip_at = Some((now, done)),
                Some(_) => {
                    counted = done;
                    last = now;
                }
                None => {}
            }
        }
        let (machine, submitter, submitter_used, wall) = me.finish();
        let (_, _, process_used, _) = all.finish();
        let engines_used = Rusage {
            user_us: process_used.user_us.saturating_sub(submitter_used.user_us),
            system_us: process_used
                .system_us
                .saturating_sub(submitter_used.system_us),
        };
        drop(q);
        self.check(size)?;
        let Some((t_skip, n_skip)) = skip_at.filter(|_| counted > 0) else {
            bail!("no job of {size} bytes completed after the warm-up: raise --duration");
        };
        let secs = last.duration_since(t_skip).as_secs_f64().max(1e-9);
        let jobs = (counted - n_skip) as f64;
        Ok(DmaRun {
            mb_per_s: jobs * size as f64 / secs / 1e6,
            jobs_per_s: jobs / secs,
            submitter,
            submitter_used,
            engines: SideCpu::of(engines_used, wall),
            engines_used,
            machine,
            wall_ns: wall,
            bytes: done * size,
        })
    }

    /// One job of `size` bytes at a time for `warm` + `dur`: submission to completion, ns,
    /// recorded after the warm-up.
    pub fn latency(
        &mut self,
        size: u64,
        dur: Duration,
        warm: Duration,
    ) -> anyhow::Result<Histogram<u64>> {
        let job = self.job(size);
        let q = DmaQueue::new(&self.c1, &self.engines, 1);
        let mut h = crate::stats::new_histogram();
        let mut wc = [DmaWc::default(); 1];
        let t0 = Instant::now();
        let (warm_end, end) = (t0 + warm, t0 + warm + dur);
        let mut id = 0;
        loop {
            let start = Instant::now();
            if start >= end {
                break;
            }
            q.submit(&Job::new(id, &job))
                .context("submitting a DMA job")?;
            id += 1;
            let spin_until = start + Duration::from_secs(10);
            while poll_all(&q, &mut wc)? == 0 {
                if Instant::now() > spin_until {
                    bail!("a DMA job of {size} bytes did not complete in 10 s");
                }
                std::hint::spin_loop();
            }
            let ns = start.elapsed().as_nanos() as u64;
            if start >= warm_end {
                h.record(ns.max(1)).context("recording a latency")?;
            }
        }
        Ok(h)
    }
}

/// Takes every completion there is; a failed job is an error naming its status and segment.
pub fn poll_all(q: &DmaQueue, wc: &mut [DmaWc]) -> anyhow::Result<u64> {
    let mut got = 0;
    loop {
        let n = q.poll(wc);
        if n == 0 {
            return Ok(got);
        }
        for w in &wc[..n] {
            if !w.status.is_ok() {
                bail!(
                    "DMA job {} failed: {} at segment {:?}",
                    w.id,
                    w.status,
                    w.segment
                );
            }
        }
        got += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_in_flight_cover_64_mib_within_two_and_sixty_four() {
        assert_eq!(depth(64), 64);
        assert_eq!(depth(1 << 20), 64);
        assert_eq!(depth(4 << 20), 16);
        assert_eq!(depth(64 << 20), 2);
        assert_eq!(depth(0), 64);
    }
}
