//! `backplane perf` interrupted through the real binary: SIGINT or SIGTERM in the middle of a
//! run leaves no temporary fabric, peer process, namespace, veth or iperf3/sockperf server.

mod common;

use std::os::unix::fs::MetadataExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// Processes (other than us) whose cmdline contains `needle`.
fn processes_with(needle: &str) -> Vec<String> {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|p| {
            let pid = p.file_name().to_string_lossy().to_string();
            if pid == me || !pid.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            let cmd = std::fs::read(p.path().join("cmdline")).ok()?;
            let s = String::from_utf8_lossy(&cmd).replace('\0', " ");
            s.contains(needle).then(|| format!("{pid}: {s}"))
        })
        .collect()
}

/// Processes (other than us) in the network namespace whose inode is `ino`.
fn processes_in_netns(ino: u64) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|p| {
            let link = std::fs::read_link(p.path().join("ns/net")).ok()?;
            (link.to_string_lossy() == format!("net:[{ino}]"))
                .then(|| p.file_name().to_string_lossy().to_string())
        })
        .collect()
}

/// Starts `backplane ARGS`, waits until `ready(pid)`, lets it measure a moment, sends `sig`
/// and returns its pid and exit status.
fn interrupt(
    args: &[&str],
    ready: impl Fn(u32) -> bool,
    sig: rustix::process::Signal,
) -> (u32, std::process::ExitStatus) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let seen = wait_for(Duration::from_secs(60), || ready(pid).then_some(()));
    if seen.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the run never reached the point to interrupt");
    }
    std::thread::sleep(Duration::from_millis(500)); // into the measurements
    let p = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::kill_process(p, sig).unwrap();
    let st = child.wait().unwrap();
    (pid, st)
}

fn peer_of(name: &str) -> Vec<String> {
    processes_with(&format!("perf-peer {name} "))
}

#[test]
fn sigint_or_sigterm_in_the_middle_of_perf_leaves_no_fabric_and_no_peer() {
    use rustix::process::Signal;
    for (test, sig) in [("dgram-lat", Signal::INT), ("write-lat", Signal::TERM)] {
        let (pid, st) = interrupt(
            &["perf", test, "-a", "-n", "200000", "--ucx", "off"],
            |pid| !peer_of(&format!("perf-{pid}")).is_empty(),
            sig,
        );
        assert_eq!(st.code(), Some(130), "{test}: {st:?}");
        let name = format!("perf-{pid}");
        let left = leftovers(&name);
        assert!(left.is_empty(), "{test}: {left:?}");
        assert!(peer_of(&name).is_empty(), "{test}: {:?}", peer_of(&name));
    }
}

#[test]
fn sigterm_in_the_middle_of_perf_ip_leaves_no_namespace_veth_fabric_or_server() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: perf ip needs namespaces; skipped");
        return;
    }
    let inodes = std::sync::Mutex::new(Vec::new());
    let (pid, st) = interrupt(
        &["perf", "ip", "-D", "5", "-r", "1"],
        |pid| {
            // Ready once the veth namespaces exist and an iperf3 server runs in one of them.
            let ns = format!("/run/netns/bpv-{pid}-2");
            let Ok(m) = std::fs::metadata(&ns) else {
                return false;
            };
            let mut seen = inodes.lock().unwrap();
            if !seen.contains(&m.ino()) {
                seen.push(m.ino());
            }
            for slot in [1, 2] {
                if let Ok(m) = std::fs::metadata(format!("/run/netns/bp-perfip-{pid}-{slot}")) {
                    if !seen.contains(&m.ino()) {
                        seen.push(m.ino());
                    }
                }
            }
            !processes_with("iperf3 -s -1 -p 5201").is_empty()
        },
        rustix::process::Signal::TERM,
    );
    assert_eq!(st.code(), Some(130), "{st:?}");
    let name = format!("perfip-{pid}");
    assert!(leftovers(&name).is_empty(), "{:?}", leftovers(&name));
    let netns = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap()
            .stdout,
    )
    .to_string();
    assert!(!netns.contains(&format!("bpv-{pid}-")), "{netns}");
    assert!(!netns.contains(&format!("bp-{name}-")), "{netns}");
    let links =
        String::from_utf8_lossy(&Command::new("ip").args(["link"]).output().unwrap().stdout)
            .to_string();
    assert!(!links.contains(&format!("bpv{pid}")), "{links}");
    for ino in inodes.lock().unwrap().iter() {
        // Nothing (an iperf3 or sockperf server or client) still runs in a namespace of the run.
        let left = wait_for(Duration::from_secs(5), || {
            processes_in_netns(*ino).is_empty().then_some(())
        });
        assert!(
            left.is_some(),
            "processes left in netns {ino}: {:?}",
            processes_in_netns(*ino)
        );
    }
}

#[test]
fn a_perf_client_killed_outright_takes_its_peer_with_it() {
    // SIGKILL runs no teardown: the peer learns of it from its configuration pipe closing.
    let fab = Fab::up("peerkill", 2, &["--window-size", "64M"]);
    let mut child = Command::new(BIN)
        .args(["perf", "write-lat", "--name", &fab.name, "-n", "100000000"])
        .args(["--ucx", "off", "--perftest", "off", "-s", "8"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let seen = wait_for(Duration::from_secs(60), || {
        (!peer_of(&fab.name).is_empty()).then_some(())
    });
    assert!(seen.is_some(), "the peer never started");
    std::thread::sleep(Duration::from_millis(500)); // into the measurement
    child.kill().unwrap(); // SIGKILL
    let _ = child.wait();
    let gone = wait_for(Duration::from_secs(20), || {
        peer_of(&fab.name).is_empty().then_some(())
    });
    assert!(gone.is_some(), "peer left behind: {:?}", peer_of(&fab.name));
    // Its port is free again: the next run works.
    let out = bp(&[
        "perf",
        "dgram-lat",
        "--name",
        &fab.name,
        "-n",
        "1000",
        "-s",
        "8",
        "-r",
        "1",
        "--ucx",
        "off",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn sigint_while_bench_starts_its_fabric_leaves_no_fabric() {
    // The clean-up once stopped the fabric before its supervisor ran, the start went on, and
    // the fabric outlived the run (`bench` interrupted in its first seconds: 2 runs in 5).
    // Interrupted as soon as the supervisor exists, the start is under way.
    let dir = std::env::temp_dir().join(format!("bp-bench-int-{}", std::process::id()));
    for round in 0..3 {
        let mut child = Command::new(BIN)
            .args([
                "bench",
                "--paths",
                "fabric-dgram",
                "--sizes",
                "64",
                "-q",
                "--out",
            ])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        let name = format!("bench-{pid}");
        let seen = wait_for(Duration::from_secs(60), || {
            (!processes_with(&format!("supervisor --name {name} ")).is_empty()).then_some(())
        });
        let p = rustix::process::Pid::from_raw(pid as i32).unwrap();
        rustix::process::kill_process(p, rustix::process::Signal::INT).unwrap();
        let st = child.wait().unwrap();
        assert!(seen.is_some(), "round {round}: no fabric was started");
        assert_eq!(st.code(), Some(130), "round {round}: {st:?}");
        let left = leftovers(&name);
        assert!(left.is_empty(), "round {round}: {left:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
