//! Shared harness for the multi-process tests: start/stop fabrics through the real binary,
//! find leftovers, and re-run this test binary as a child process playing a role.
#![allow(dead_code)]

use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_backplane");

/// Runs `backplane ARGS...`.
pub fn bp(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run backplane")
}

/// A unique fabric name for one test (≤ 32 characters).
pub fn name(test: &str) -> String {
    let mut t: String = test.chars().filter(|c| c.is_ascii_alphanumeric()).collect();
    t.truncate(20);
    format!("{t}-{}", std::process::id())
}

/// A running fabric, stopped on drop.
pub struct Fab {
    pub name: String,
}

impl Fab {
    /// A fabric without networking (works without root; most tests need no more).
    pub fn up(test: &str, nodes: u32, extra: &[&str]) -> Fab {
        let mut e = vec!["--no-net"];
        e.extend_from_slice(extra);
        Self::up_with(test, nodes, &e)
    }

    /// A fabric with IP over the fabric (root only).
    pub fn up_net(test: &str, nodes: u32, extra: &[&str]) -> Fab {
        Self::up_with(test, nodes, extra)
    }

    fn up_with(test: &str, nodes: u32, extra: &[&str]) -> Fab {
        let name = name(test);
        let n = nodes.to_string();
        let mut args = vec!["up", "--name", &name, "--nodes", &n];
        if !extra.contains(&"--window-size") {
            args.extend_from_slice(&["--window-size", "8M"]);
        }
        args.extend_from_slice(extra);
        let out = bp(&args);
        assert!(
            out.status.success(),
            "up failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Fab { name }
    }

    pub fn status(&self) -> serde_json::Value {
        let out = bp(&["status", "--name", &self.name, "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("status JSON")
    }

    pub fn supervisor_pid(&self) -> i32 {
        self.status()["supervisor_pid"].as_i64().unwrap() as i32
    }
}

impl Drop for Fab {
    fn drop(&mut self) {
        let _ = bp(&["down", "--name", &self.name]);
    }
}

/// Everything of fabric `name` still on the system: its run directory, processes started
/// for it, and memfds of it mapped or open in any process.
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
            if args.iter().any(|a| a.ends_with("backplane"))
                && args.windows(2).any(|w| w[0] == "--name" && w[1] == name)
            {
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

/// stderr as a string.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
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
