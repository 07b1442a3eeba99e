//! The programs running in a fabric's nodes — started with `backplane exec`, or from a shell
//! inside a node — so that `status` can count them and `down` can stop them instead of
//! leaving them running in deleted namespaces.
//!
//! A process is in node N of fabric F when its network namespace is the node's
//! (`/run/netns/bp-F-N`, fabrics with IP) or its environment names the node
//! (`BACKPLANE_FABRIC=F` and `BACKPLANE_NODE=N`, which `exec` sets on every fabric); daemons
//! that double-fork keep both. The fabric's own supervisor and agents are left out by pid.
//! Everything read from `/proc` is another process's and may vanish or change under us: a
//! process that cannot be read is simply not counted (nor one caught in the middle of its
//! `exec`, before its new environment is laid out: [`stop`]'s callers look twice).
#![forbid(unsafe_code)]

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// A process found in a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// The node's slot.
    pub slot: u32,
    /// Process id.
    pub pid: u32,
}

/// The node whose environment block `environ` (NUL-separated `KEY=VALUE`) names, if it names
/// a node of fabric `fabric`.
fn node_of_environ(environ: &[u8], fabric: &str) -> Option<u32> {
    let (mut f, mut n) = (None, None);
    for kv in environ.split(|&b| b == 0) {
        if let Some(v) = kv.strip_prefix(b"BACKPLANE_FABRIC=") {
            f = Some(v);
        } else if let Some(v) = kv.strip_prefix(b"BACKPLANE_NODE=") {
            n = std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<u32>().ok());
        }
    }
    (f == Some(fabric.as_bytes())).then_some(n).flatten()
}

/// Finds the processes in the nodes `1..=nodes` of fabric `fabric`, leaving out `own` (the
/// supervisor's and agents' pids) and the calling process.
pub fn find(fabric: &str, nodes: u32, own: &[u32]) -> Vec<Member> {
    find_in(Path::new("/proc"), fabric, nodes, own)
}

fn find_in(proc: &Path, fabric: &str, nodes: u32, own: &[u32]) -> Vec<Member> {
    // Each node namespace's inode, as `/proc/PID/ns/net` names it: "net:[INODE]".
    let ns: Vec<(String, u32)> = (1..=nodes)
        .filter_map(|slot| {
            let m = std::fs::metadata(
                Path::new("/run/netns").join(crate::fabric::netns::netns_name(fabric, slot)),
            )
            .ok()?;
            Some((format!("net:[{}]", m.ino()), slot))
        })
        .collect();
    // The caller and its ancestors are left out: `down` run from a shell inside a node stops
    // the node's other programs, not the shell it was typed in.
    let mine = ancestry(proc, std::process::id());
    let Ok(dir) = std::fs::read_dir(proc) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if mine.contains(&pid) || own.contains(&pid) || is_zombie(&e.path()) {
            continue;
        }
        let by_ns = std::fs::read_link(e.path().join("ns/net"))
            .ok()
            .and_then(|l| {
                ns.iter()
                    .find(|(n, _)| l.as_os_str() == n.as_str())
                    .map(|&(_, s)| s)
            });
        let slot = by_ns.or_else(|| {
            std::fs::read(e.path().join("environ"))
                .ok()
                .and_then(|env| node_of_environ(&env, fabric))
                .filter(|s| (1..=nodes).contains(s))
        });
        if let Some(slot) = slot {
            out.push(Member { slot, pid });
        }
    }
    out.sort_by_key(|m| (m.slot, m.pid));
    out
}

/// `pid` and its ancestors up to init, from `/proc/PID/stat`'s parent field.
fn ancestry(proc: &Path, pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let mut p = pid;
    while out.len() < 4096 {
        let parent = std::fs::read_to_string(proc.join(p.to_string()).join("stat"))
            .ok()
            .and_then(|s| {
                let (_, rest) = s.rsplit_once(") ")?;
                rest.split_whitespace().nth(1)?.parse::<u32>().ok()
            });
        match parent {
            Some(pp) if pp > 1 && !out.contains(&pp) => {
                out.push(pp);
                p = pp;
            }
            _ => break,
        }
    }
    out
}

/// A zombie has exited already: nothing to count or stop.
fn is_zombie(proc_pid: &Path) -> bool {
    std::fs::read_to_string(proc_pid.join("stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('Z')))
        .unwrap_or(true) // gone
}

/// How a stop went.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stopped {
    /// Processes that ended after SIGTERM.
    pub terminated: Vec<Member>,
    /// Processes still there after the grace period, sent SIGKILL.
    pub killed: Vec<Member>,
}

/// Sends SIGTERM to every member, waits up to `grace` for them to end, then sends SIGKILL to
/// those still there.
pub fn stop(members: &[Member], grace: Duration) -> Stopped {
    use rustix::process::{kill_process, Pid, Signal};
    let send = |m: &Member, sig| {
        if let Some(p) = Pid::from_raw(m.pid as i32) {
            let _ = kill_process(p, sig);
        }
    };
    for m in members {
        send(m, Signal::TERM);
    }
    let alive = |m: &Member| !is_zombie(&Path::new("/proc").join(m.pid.to_string()));
    let until = Instant::now() + grace;
    while members.iter().any(alive) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    let (killed, terminated): (Vec<Member>, Vec<Member>) = members.iter().partition(|m| alive(m));
    for m in &killed {
        send(m, Signal::KILL);
    }
    Stopped { terminated, killed }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_names_a_node_only_with_both_variables_and_the_right_fabric() {
        let env = b"PATH=/bin\0BACKPLANE_FABRIC=radar\0BACKPLANE_NODE=3\0";
        assert_eq!(node_of_environ(env, "radar"), Some(3));
        assert_eq!(node_of_environ(env, "rada"), None);
        assert_eq!(node_of_environ(b"BACKPLANE_FABRIC=radar\0", "radar"), None);
        assert_eq!(node_of_environ(b"BACKPLANE_NODE=2\0", "radar"), None);
        assert_eq!(
            node_of_environ(b"BACKPLANE_FABRIC=radar\0BACKPLANE_NODE=x\0", "radar"),
            None
        );
        // Garbage bytes in another process's environment are not an error.
        assert_eq!(node_of_environ(&[0xff, 0, 0x3d, 0], "radar"), None);
    }

    #[test]
    fn a_child_with_the_node_environment_is_found_and_stopped() {
        let fabric = format!("memb{}", std::process::id());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env("BACKPLANE_FABRIC", &fabric)
            .env("BACKPLANE_NODE", "2")
            .spawn()
            .unwrap();
        // Until the child's exec has laid out its new environment, /proc shows none: wait
        // for it (a bound on a hang, not a timing claim).
        let until = Instant::now() + Duration::from_secs(10);
        let mut found = find(&fabric, 4, &[]);
        while found.is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
            found = find(&fabric, 4, &[]);
        }
        assert_eq!(
            found,
            [Member {
                slot: 2,
                pid: child.id()
            }]
        );
        // The caller's ancestors are never members (the test harness's parent has no such
        // environment anyway; this checks the walk itself).
        let chain = ancestry(Path::new("/proc"), std::process::id());
        assert_eq!(chain[0], std::process::id());
        assert!(chain.len() >= 2, "{chain:?}");
        // Not a node of a 1-node fabric, and left out when it is one of the fabric's own.
        assert!(find(&fabric, 1, &[]).is_empty());
        assert!(find(&fabric, 4, &[child.id()]).is_empty());
        let s = stop(&found, Duration::from_secs(5));
        let _ = child.wait();
        assert_eq!(s.terminated.len() + s.killed.len(), 1);
        assert!(find(&fabric, 4, &[]).is_empty());
    }
}
