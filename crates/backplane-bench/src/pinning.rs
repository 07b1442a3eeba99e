//! `perf --cpus CLIENT,PEER`: the measuring side on one CPU, the far side on another.
//!
//! On a small machine the scheduler moves two busy-polling programs (and UCX's pair of them
//! in the same run) between the CPUs, and a round that found both on one CPU, or a neighbour
//! on theirs, swings a ratio by tens of percent. Pinned, both pairs of programs run as each
//! other's did: `perf send-lat` between two hosts' namespaces, 15 alternating rounds against
//! `tag_lat`, per-round ratios 0.89-1.45 unpinned, 1.21-1.22 in 8 of 15 pinned (session 46).
//!
//! This process's measuring thread is pinned to CLIENT (what it starts inherits that: UCX's
//! and perftest's clients); the far side's programs (the perf peer, `ucx_perftest`'s server,
//! perftest's server) are started pinned to PEER. With `--peer-via` the pin reaches the far
//! side only where the command runs it on this machine (a namespace); elsewhere pin it there.

use std::process::Command;
use std::sync::OnceLock;

use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

/// The far side's CPU, once `perf --cpus` set it.
static PEER_CPU: OnceLock<usize> = OnceLock::new();

/// The CPUs this process may run on now.
fn allowed() -> std::io::Result<CpuSet> {
    sched_getaffinity(None).map_err(std::io::Error::from)
}

/// Checks `cpus` (`CLIENT,PEER`: two CPUs this process may run on) and remembers PEER for
/// [`pin_peer`]. The one-line error names what is wrong.
pub fn set(cpus: &[usize]) -> anyhow::Result<(usize, usize)> {
    let [client, peer] = cpus else {
        anyhow::bail!("--cpus takes two CPU numbers, CLIENT,PEER (e.g. --cpus 0,1)");
    };
    let ok = allowed()?;
    for &c in [client, peer] {
        if c >= CpuSet::MAX_CPU || !ok.is_set(c) {
            let list: Vec<String> = (0..CpuSet::MAX_CPU)
                .filter(|&i| ok.is_set(i))
                .map(|i| i.to_string())
                .collect();
            anyhow::bail!(
                "--cpus: CPU {c} is not one this process may run on ({})",
                list.join(",")
            );
        }
    }
    let _ = PEER_CPU.set(*peer);
    Ok((*client, *peer))
}

/// Runs the calling thread (and what it starts from now on) on `cpu` alone; returns the CPUs
/// it could run on before, for [`restore`].
pub fn pin_this_thread(cpu: usize) -> std::io::Result<CpuSet> {
    let before = allowed()?;
    let mut set = CpuSet::new();
    set.set(cpu);
    sched_setaffinity(None, &set)?;
    Ok(before)
}

/// Lets the calling thread run where it could before [`pin_this_thread`].
pub fn restore(before: &CpuSet) {
    let _ = sched_setaffinity(None, before);
}

/// Makes `cmd` start on the far side's CPU, if `perf --cpus` named one.
pub fn pin_peer(cmd: &mut Command) {
    let Some(&cpu) = PEER_CPU.get() else {
        return;
    };
    use std::os::unix::process::CommandExt;
    let mut set = CpuSet::new();
    set.set(cpu);
    // (std has no safe way to set a child's affinity before it runs; `taskset` would be a
    // program to install on every machine the far side runs on.)
    // SAFETY: the closure runs in the child between fork and exec: it only makes one system
    // call (sched_setaffinity on the child itself) on a set built before the fork, allocates
    // nothing and takes no lock.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(move || sched_setaffinity(None, &set).map_err(std::io::Error::from));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_must_be_two_that_this_process_may_use() {
        assert!(set(&[0])
            .unwrap_err()
            .to_string()
            .contains("two CPU numbers"));
        assert!(set(&[0, 1, 2]).is_err());
        let e = set(&[0, 100_000]).unwrap_err().to_string();
        assert!(e.contains("CPU 100000 is not one"), "{e}");
    }

    #[test]
    fn a_pinned_thread_runs_on_its_cpu_and_is_restored() {
        let first = (0..CpuSet::MAX_CPU)
            .find(|&i| allowed().unwrap().is_set(i))
            .unwrap();
        std::thread::spawn(move || {
            let before = pin_this_thread(first).unwrap();
            let now = allowed().unwrap();
            assert!(now.is_set(first));
            assert_eq!(now.count(), 1);
            restore(&before);
            assert_eq!(allowed().unwrap().count(), before.count());
        })
        .join()
        .unwrap();
    }
}
