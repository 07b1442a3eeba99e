//! Shared harness for the library's multi-process tests: fabrics started and stopped through
//! `backplane::fabric::launch` with this crate's `backplane-fabricd` (no CLI involved),
//! leftovers found, and this test binary re-run as a child process playing a role.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use backplane::fabric::launch::{self, Options};

/// The fabric processes' executable, built with this crate.
pub const FABRICD: &str = env!("CARGO_BIN_EXE_backplane-fabricd");

/// A copy of a memory region's bytes (regions are read by copy: peers may write them).
pub fn bytes(mr: &backplane::verbs::Mr) -> Vec<u8> {
    mr.to_vec(0, mr.len())
        .expect("a region holds its own length")
}

/// A unique fabric name for one test (≤ 32 characters).
pub fn name(test: &str) -> String {
    let mut t: String = test.chars().filter(|c| c.is_ascii_alphanumeric()).collect();
    t.truncate(20);
    format!("{t}-{}", std::process::id())
}

/// A running fabric without networking (8 MiB windows), stopped on drop.
pub struct Fab {
    pub name: String,
}

impl Fab {
    /// A fabric of `nodes` nodes whose dead agents are restarted after a second.
    pub fn up(test: &str, nodes: u32) -> Fab {
        Self::up_restarting(test, nodes, 1000)
    }

    /// A fabric restarting a dead agent after `restart_delay_ms` (0: it stays DOWN).
    pub fn up_restarting(test: &str, nodes: u32, restart_delay_ms: u64) -> Fab {
        let name = name(test);
        let o = Options {
            window_size: 8 << 20,
            restart_delay_ms,
            ..Options::new(&name, nodes, PathBuf::from(FABRICD))
        };
        if let Err(e) = launch::start(&o) {
            panic!("fabric {name} did not start: {e}");
        }
        Fab { name }
    }

    /// The status report, as `backplane status --json` prints it.
    pub fn status(&self) -> serde_json::Value {
        let f = backplane::fabric::Fabric::attach(&self.name).expect("attach");
        serde_json::to_value(f.status().expect("status")).expect("status JSON")
    }

    pub fn supervisor_pid(&self) -> i32 {
        self.status()["supervisor_pid"].as_i64().unwrap() as i32
    }
}

impl Drop for Fab {
    fn drop(&mut self) {
        let _ = launch::stop(&self.name);
    }
}

/// Everything of fabric `name` still on the system: its run directory, its supervisor and
/// agents, and memfds of it mapped or open in any process.
pub fn leftovers(name: &str) -> Vec<String> {
    let mut found = Vec::new();
    let dir = backplane::fabric::fabric_dir(name);
    if dir.exists() {
        found.push(format!("directory {}", dir.display()));
    }
    let me = std::process::id().to_string();
    let memfd = format!("memfd:bp-{name}-");
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let pid = p.file_name().to_string_lossy().to_string();
        if !pid.chars().all(|c| c.is_ascii_digit()) || pid == me {
            continue;
        }
        if let Ok(cmd) = std::fs::read(p.path().join("cmdline")) {
            let args: Vec<String> = cmd
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let ours = args
                .first()
                .is_some_and(|a| a.ends_with("backplane-fabricd") || a.ends_with("backplane"));
            let of_it = args.windows(2).any(|w| w[0] == "--name" && w[1] == name)
                || (args.get(1).map(String::as_str) == Some("agent")
                    && args.get(2).map(String::as_str) == Some(name));
            if ours && of_it {
                found.push(format!("process {pid}: {}", args.join(" ")));
            }
        }
        if let Ok(fds) = std::fs::read_dir(p.path().join("fd")) {
            for fd in fds.flatten() {
                if let Ok(t) = std::fs::read_link(fd.path()) {
                    if t.to_string_lossy().contains(&memfd) {
                        found.push(format!("pid {pid} holds {}", t.display()));
                    }
                }
            }
        }
        if let Ok(maps) = std::fs::read_to_string(p.path().join("maps")) {
            if maps.contains(&memfd) {
                found.push(format!("pid {pid} maps a {memfd} region"));
            }
        }
    }
    found
}

/// Polls `f` until it returns Some or `limit` passes (a bound on a hang, not a timing claim).
pub fn wait_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Re-runs this test binary as a child that executes only `test_fn` with `BP_ROLE=role`.
pub fn spawn_role(test_fn: &str, role: &str, env: &[(&str, String)]) -> std::process::Child {
    let exe = std::env::current_exe().unwrap();
    let mut c = Command::new(exe);
    c.args([test_fn, "--exact", "--nocapture", "--test-threads=1"])
        .env("BP_ROLE", role);
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().expect("spawn child role")
}

/// The role this process plays, if it is a child started by `spawn_role`.
pub fn role() -> Option<String> {
    std::env::var("BP_ROLE").ok()
}

/// This process's mappings of node 2's regions, as /proc/self/maps shows them.
pub fn region_maps(fab: &str) -> Vec<String> {
    let tag = format!("bp-{fab}-mr-n2");
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&tag))
        .map(str::to_owned)
        .collect()
}
