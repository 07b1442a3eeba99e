//! Test helpers both test crates use (the library's `tests/common` and, by path, the CLI's):
//! fabric names, leftovers, waiting, and this test binary re-run as a child playing a role.
#![allow(dead_code)]

use std::process::Command;
use std::time::{Duration, Instant};

/// A unique fabric name for one test (≤ 32 characters).
pub fn name(test: &str) -> String {
    let mut t: String = test.chars().filter(|c| c.is_ascii_alphanumeric()).collect();
    t.truncate(20);
    format!("{t}-{}", std::process::id())
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
