//! One fabric across hosts (issue 19), on one machine: each "host" is a supervisor in a
//! network namespace of its own with its own run directory, the namespaces joined by veth
//! pairs to a bridge in a third, and the supervisors talk over UCX (`UCX_TLS=tcp`). Needs
//! root (namespaces): CI runs as root; elsewhere these tests say so and pass without running.

mod common;
use common::*;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn root() -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    eprintln!("skipped: hosts in network namespaces need root");
    false
}

fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().expect("run ip");
    assert!(o.status.success(), "ip {args:?}: {}", stderr(&o));
}

/// Hosts `h0, h1, …` of one fabric, each a namespace with address 10.79.NET.(k+1) on a veth
/// to a bridge in a switch namespace; a run directory each. Everything goes on drop.
struct Hosts {
    fabric: String,
    tag: String,
    net: u8,
    count: usize,
    dir: PathBuf,
    /// `UCX_TLS` for the hosts' processes (`tcp`; None: UCX chooses).
    tls: Option<&'static str>,
}

impl Hosts {
    fn new(test: &str, net: u8, count: usize) -> Self {
        let fabric = name(test);
        let tag = format!("h{net}x{}", std::process::id() % 10000);
        let dir = std::env::temp_dir().join(format!("bp-hosts-{fabric}"));
        let h = Self {
            fabric,
            tag,
            net,
            count,
            dir,
            tls: Some("tcp"),
        };
        h.cleanup_netns();
        std::fs::create_dir_all(&h.dir).unwrap();
        let sw = h.ns_switch();
        ip(&["netns", "add", &sw]);
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &sw, "link", "set", "br0", "up"]);
        for k in 0..count {
            let ns = h.ns(k);
            std::fs::create_dir_all(h.run_dir(k)).unwrap();
            ip(&["netns", "add", &ns]);
            let (a, b) = (format!("{}a{k}", h.tag), format!("{}b{k}", h.tag));
            ip(&["link", "add", &a, "type", "veth", "peer", "name", &b]);
            ip(&["link", "set", &a, "netns", &ns, "name", "bpx0"]);
            ip(&["link", "set", &b, "netns", &sw]);
            ip(&["-n", &sw, "link", "set", &b, "master", "br0", "up"]);
            let addr = format!("{}/24", h.addr(k));
            ip(&["-n", &ns, "addr", "add", &addr, "dev", "bpx0"]);
            ip(&["-n", &ns, "link", "set", "bpx0", "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        h
    }

    /// Two hosts without IP over the fabric, up and joined: odd slots 1, 3 on h0, even 2, 4
    /// on h1 (so nodes 1 and 2, `perf`'s, are on different hosts).
    fn odd_even(test: &str, net: u8) -> Self {
        Self::odd_even_over(test, net, Some("tcp"))
    }

    /// [`Hosts::odd_even`] with `UCX_TLS=tls` (None: whatever UCX picks).
    fn odd_even_over(test: &str, net: u8, tls: Option<&'static str>) -> Self {
        Self::odd_even_with(test, net, tls, &[])
    }

    /// [`Hosts::odd_even_over`] with more arguments of `up` on both hosts.
    fn odd_even_with(test: &str, net: u8, tls: Option<&'static str>, extra: &[&str]) -> Self {
        let mut h = Self::new(test, net, 2);
        h.tls = tls;
        let file = h.file("hosts.toml", &[&[1, 3], &[2, 4]]);
        for k in 0..2 {
            let o = h.up(k, &file, extra);
            assert!(o.status.success(), "up on h{k}: {}{}", stderr(&o), h.logs());
        }
        h.wait_slot(0, 2, "READY", None);
        h.wait_slot(1, 1, "READY", None);
        h
    }

    fn ns(&self, k: usize) -> String {
        format!("{}-{k}", self.tag)
    }
    fn ns_switch(&self) -> String {
        format!("{}-sw", self.tag)
    }
    fn addr(&self, k: usize) -> String {
        format!("10.79.{}.{}", self.net, k + 1)
    }
    fn run_dir(&self, k: usize) -> PathBuf {
        self.dir.join(format!("run{k}"))
    }

    /// Writes a hosts file: host k runs `slots[k]`, listening on port 13500.
    fn file(&self, file: &str, slots: &[&[u32]]) -> PathBuf {
        let mut t = String::new();
        for (k, s) in slots.iter().enumerate() {
            t += &format!(
                "[[hosts]]\nname = \"h{k}\"\naddress = \"{}:13500\"\nslots = {s:?}\n\n",
                self.addr(k)
            );
        }
        let p = self.dir.join(file);
        std::fs::write(&p, t).unwrap();
        p
    }

    /// `backplane ARGS` on host k (its namespace and run directory, UCX over TCP).
    fn bp(&self, k: usize, args: &[&str]) -> Output {
        self.in_host(k)
            .arg(format!("BACKPLANE_RUN_DIR={}", self.run_dir(k).display()))
            .arg(BIN)
            .args(args)
            .output()
            .expect("run backplane")
    }

    /// A command on host k: in its network namespace, with a /sys of that namespace (UCX
    /// finds its interfaces there), in a mount namespace that still shares /run/netns both
    /// ways (not `ip netns exec`, whose mounts stay private: the node namespaces a supervisor
    /// mounts there would be invisible to everyone else). `env` follows.
    fn in_host(&self, k: usize) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.ns(k)))
            .args([
                "unshare",
                "--mount",
                "--propagation",
                "unchanged",
                "sh",
                "-c",
            ])
            .arg("mount --make-private /sys && mount -t sysfs sysfs /sys && exec \"$0\" \"$@\"")
            .arg("env");
        match self.tls {
            Some(t) => c.arg(format!("UCX_TLS={t}")),
            None => c.arg("-u").arg("UCX_TLS"),
        };
        c
    }

    /// This test binary, re-run on host k as `role` of test `test_fn`.
    fn spawn_role(&self, k: usize, test_fn: &str, role: &str) -> std::process::Child {
        self.spawn_role_with(k, test_fn, role, &[])
    }

    /// [`Hosts::spawn_role`] with `env` (`NAME=value` each) set for the role.
    fn spawn_role_with(
        &self,
        k: usize,
        test_fn: &str,
        role: &str,
        env: &[&str],
    ) -> std::process::Child {
        self.in_host(k)
            .args(env)
            .arg(format!("BACKPLANE_RUN_DIR={}", self.run_dir(k).display()))
            .arg(format!("BP_ROLE={role}"))
            .arg(format!("BP_FABRIC={}", self.fabric))
            .arg(std::env::current_exe().unwrap())
            .args([test_fn, "--exact", "--nocapture", "--test-threads=1"])
            .spawn()
            .expect("spawn a role")
    }

    fn up(&self, k: usize, file: &std::path::Path, extra: &[&str]) -> Output {
        let mut e = vec!["--no-net"];
        e.extend_from_slice(extra);
        self.up_net(k, file, &e)
    }

    /// `up` on host k with IP over the fabric unless `extra` says `--no-net`.
    fn up_net(&self, k: usize, file: &std::path::Path, extra: &[&str]) -> Output {
        let host = format!("h{k}");
        let f = file.to_str().unwrap();
        let mut a = vec!["up", "--name", &self.fabric, "--hosts", f];
        if !extra.contains(&"--host") {
            a.extend_from_slice(&["--host", &host]);
        }
        if !extra.contains(&"--window-size") {
            a.extend_from_slice(&["--window-size", "8M"]);
        }
        a.extend_from_slice(extra);
        self.bp(k, &a)
    }

    fn up_ok(&self, k: usize, file: &std::path::Path) {
        let o = self.up(k, file, &[]);
        assert!(
            o.status.success(),
            "up on h{k}: {}\n{}",
            stderr(&o),
            self.logs()
        );
    }

    /// `kill -9` of host k's supervisor (the host stops answering at once).
    fn kill_supervisor(&self, k: usize) {
        let pid = self.status(k)["supervisor_pid"].as_i64().unwrap() as i32;
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
    }

    fn down(&self, k: usize) {
        let _ = self.bp(k, &["down", "--name", &self.fabric]);
    }

    fn status(&self, k: usize) -> serde_json::Value {
        let o = self.bp(k, &["status", "--name", &self.fabric, "--json"]);
        assert!(
            o.status.success(),
            "status on h{k}: {}\n{}",
            stderr(&o),
            self.logs()
        );
        serde_json::from_slice(&o.stdout).unwrap()
    }

    /// (state, down_reason, generation, host) of `slot` as host k sees it.
    fn slot(&self, k: usize, slot: u32) -> (String, String, u64, String) {
        let s = self.status(k);
        let row = &s["slots"][slot as usize - 1];
        (
            row["state"].as_str().unwrap().to_owned(),
            row["down_reason"].as_str().unwrap().to_owned(),
            row["generation"].as_u64().unwrap(),
            row["host"].as_str().unwrap_or("").to_owned(),
        )
    }

    /// Waits until host k sees `slot` in `state` (with `reason`, if given); returns how long.
    fn wait_slot(&self, k: usize, slot: u32, state: &str, reason: Option<&str>) -> Duration {
        let t0 = Instant::now();
        let got = wait_for(Duration::from_secs(15), || {
            let (st, r, _, _) = self.slot(k, slot);
            (st == state && reason.is_none_or(|x| x == r)).then_some(())
        });
        assert!(
            got.is_some(),
            "h{k} never saw slot {slot} {state} {reason:?}: {}\n{}",
            self.status(k),
            self.logs()
        );
        t0.elapsed()
    }

    /// Every host's supervisor log (for a failure's message).
    fn logs(&self) -> String {
        (0..self.count)
            .map(|k| {
                let f = self.run_dir(k).join(&self.fabric).join("supervisor.log");
                format!(
                    "--- h{k}'s supervisor log:\n{}",
                    std::fs::read_to_string(f).unwrap_or_default()
                )
            })
            .collect()
    }

    fn host_state(&self, k: usize, host: &str) -> serde_json::Value {
        let s = self.status(k);
        s["hosts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|h| h["name"] == host)
            .cloned()
            .unwrap_or_else(|| panic!("no host {host} in {s}"))
    }

    fn cleanup_netns(&self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.ns_switch()])
            .output();
        for k in 0..self.count {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(k)])
                .output();
        }
    }

    /// Nothing of the fabric left on any host: no run directory, process or shared memory.
    fn assert_nothing_left(&self) {
        for k in 0..self.count {
            let d = self.run_dir(k).join(&self.fabric);
            assert!(!d.exists(), "{} is left", d.display());
        }
        let left: Vec<String> = leftovers(&self.fabric)
            .into_iter()
            .filter(|l| !l.starts_with("directory"))
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for k in 0..self.count {
            self.down(k);
        }
        self.cleanup_netns();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits for a child role with a bound on a hang; its exit status.
fn finish(mut c: std::process::Child, what: &str) -> std::process::ExitStatus {
    let got = wait_for(Duration::from_secs(90), || c.try_wait().unwrap());
    match got {
        Some(s) => s,
        None => {
            let _ = c.kill();
            let _ = c.wait();
            panic!("{what} hung");
        }
    }
}

fn one_line(o: &Output) -> String {
    let e = stderr(o);
    let lines: Vec<&str> = e
        .lines()
        .filter(|l| !l.contains("UCX  ERROR") && !l.trim().is_empty())
        .collect();
    assert_eq!(lines.len(), 1, "not one line: {e}");
    lines[0].to_owned()
}

#[test]
fn two_hosts_join_lose_each_other_and_rejoin_with_new_generations() {
    if !root() {
        return;
    }
    let h = Hosts::new("hosts_two", 11, 2);
    // Odd slots on h0, even on h1: `perf --name` (nodes 1 and 2) spans both.
    let file = h.file("hosts.toml", &[&[1, 3], &[2, 4]]);
    h.up_ok(0, &file);
    h.up_ok(1, &file);
    // Every slot of every host, on either host, with its host and UCX's transport.
    for k in 0..2 {
        for slot in 1..=4 {
            h.wait_slot(k, slot, "READY", None);
            let (_, _, gen, host) = h.slot(k, slot);
            assert_eq!(host, if slot % 2 == 1 { "h0" } else { "h1" });
            assert_eq!(gen, 1);
        }
    }
    let peer = h.host_state(0, "h1");
    assert_eq!(peer["state"], "joined");
    let tl = peer["transport"].to_string();
    assert!(tl.contains("tcp/bpx0"), "transport {tl}");
    let table = h.bp(0, &["status", "--name", &h.fabric]);
    let table = String::from_utf8_lossy(&table.stdout).into_owned();
    assert!(
        table.contains("HOST") && table.contains("tcp/bpx0"),
        "{table}"
    );

    // The network to h1 is cut: h0 sees h1's nodes DOWN (host-lost), and back with a new
    // generation once the network returns.
    // (Generations are compared as "greater than before": a host starved of CPU for longer
    // than the heartbeat allows on a loaded machine is, rightly, lost and rejoined once more.)
    let gen2 = h.slot(0, 2).2;
    ip(&["-n", &h.ns(1), "link", "set", "bpx0", "down"]);
    let took = h.wait_slot(0, 2, "DOWN", Some("host_lost"));
    eprintln!("h0 saw h1 lost after {took:?} (cut network)");
    assert_eq!(h.slot(0, 1).0, "READY", "h0's own nodes are untouched");
    ip(&["-n", &h.ns(1), "link", "set", "bpx0", "up"]);
    h.wait_slot(0, 2, "READY", None);
    let gen2_back = h.slot(0, 2).2;
    assert!(gen2_back > gen2, "a rejoined node has a new generation");

    // h1's supervisor is killed: seen at once (UCX reports the closed connection); h1 comes
    // back after `down` cleans up what it left.
    let gen4 = h.slot(0, 4).2;
    h.kill_supervisor(1);
    let took = h.wait_slot(0, 4, "DOWN", Some("host_lost"));
    eprintln!("h0 saw h1 lost after {took:?} (supervisor killed)");
    h.down(1);
    h.up_ok(1, &file);
    h.wait_slot(0, 4, "READY", None);
    assert!(h.slot(0, 4).2 > gen4);

    // A node of the other host cannot be used from here yet, and says so in one line.
    let o = h.bp(
        0,
        &[
            "perf",
            "dgram-lat",
            "--name",
            &h.fabric,
            "-r",
            "1",
            "--ucx",
            "off",
        ],
    );
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("node 2 runs on host 'h1', not on this host ('h0'): run its programs there"),
        "{e}"
    );
    let o = h.bp(0, &["exec", "--name", &h.fabric, "4", "--", "true"]);
    assert!(
        one_line(&o).contains("node 4 runs on host 'h1'"),
        "{}",
        stderr(&o)
    );

    // `down` on h1: h0 sees its nodes DOWN at once (shutdown) and keeps its own running.
    h.down(1);
    h.wait_slot(0, 2, "DOWN", Some("shutdown"));
    assert_eq!(h.host_state(0, "h1")["state"], "left");
    assert_eq!(h.slot(0, 3).0, "READY");
    h.down(0);
    h.assert_nothing_left();
}

#[test]
fn a_host_that_does_not_match_or_cannot_join_is_refused_in_one_line_and_leaves_nothing() {
    if let Some(r) = role() {
        old_host_role(&r);
        return;
    }
    if !root() {
        return;
    }
    let h = Hosts::new("hosts_refused", 12, 2);
    let file = h.file("hosts.toml", &[&[1, 2], &[3]]);
    // Nobody to join yet: h1 gives up after --join-timeout, naming h0 and what to do.
    let t0 = Instant::now();
    let o = h.up(1, &file, &["--join-timeout", "1"]);
    assert!(!o.status.success());
    let e = one_line(&o);
    assert!(
        e.contains("cannot reach host 'h0' at 10.79.12.1:13500 within 1.0 s")
            && e.contains("start `backplane up --host h0` there first"),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    h.up_ok(0, &file);
    // A host of another backplane version (its join says so): refused, and h0 says why.
    let test_fn =
        "a_host_that_does_not_match_or_cannot_join_is_refused_in_one_line_and_leaves_nothing";
    let old = h.spawn_role(1, test_fn, &format!("old_host {}:13500", h.addr(0)));
    assert!(finish(old, "the old host").success(), "{}", h.logs());
    let log = h.logs();
    assert!(
        log.contains("refused a host: host 'h1' runs backplane 0.0.1 (host protocol 99)")
            && log.contains("run the same version on every host"),
        "{log}"
    );
    // Another window size, another hosts file: h0 refuses, h1's `up` fails with the reason.
    let o = h.up(1, &file, &["--window-size", "16M"]);
    let e = one_line(&o);
    assert!(
        e.contains("host 'h0' refused host 'h1'") && e.contains("same --window-size"),
        "{e}"
    );
    // Another link model (h0 emulates none): refused, naming both.
    let e = one_line(&h.up(1, &file, &["--link", "eth-1g"]));
    assert!(
        e.contains("host 'h1' emulates --link eth-1g cut-through, host 'h0' no link model"),
        "{e}"
    );
    let other = h.file("other.toml", &[&[1, 2], &[3, 4]]);
    let e = one_line(&h.up(1, &other, &[]));
    assert!(
        e.contains("gives host 'h1' slots [3, 4], we give it [3]"),
        "{e}"
    );
    // The port h0 listens on is taken (a second fabric on h0 with the same file).
    let o = h.bp(
        0,
        &[
            "up",
            "--name",
            "other-fabric",
            "--hosts",
            file.to_str().unwrap(),
            "--host",
            "h0",
            "--no-net",
            "--window-size",
            "8M",
        ],
    );
    let e = one_line(&o);
    assert!(
        e.contains("host 'h0': cannot listen on 10.79.12.1:13500"),
        "{e}"
    );
    // Bad files and flags, before anything starts.
    let twice = h.file("twice.toml", &[&[1, 2], &[2, 3]]);
    assert!(one_line(&h.up(1, &twice, &[])).contains("hosts 'h0' and 'h1' both claim slot 2"));
    assert!(one_line(&h.up(1, &file, &["--host", "h9"])).contains("--host h9 is not one of"));
    // IP over the fabric on h1 but not on h0.
    let e = one_line(&h.up_net(1, &file, &[]));
    assert!(
        e.contains("host 'h1' runs IP over the fabric as 192.168.") && e.contains("(or --no-net)"),
        "{e}"
    );
    // None of the refused attempts left anything on h1; h0 runs on, alone.
    assert!(!h.run_dir(1).join(&h.fabric).exists());
    assert!(!h.run_dir(0).join("other-fabric").exists());
    assert_eq!(h.slot(0, 1).0, "READY");
    assert_eq!(h.slot(0, 3).0, "EMPTY");
    // With the right file and size it joins.
    h.up_ok(1, &file);
    h.wait_slot(0, 3, "READY", None);
    h.down(1);
    h.down(0);
    h.assert_nothing_left();
}

#[test]
fn three_hosts_see_every_slot_and_one_leaving_and_returning_leaves_the_others_working() {
    if !root() {
        return;
    }
    let h = Hosts::new("hosts_three", 13, 3);
    let file = h.file("hosts.toml", &[&[1, 2], &[3, 4], &[5, 6]]);
    for k in 0..3 {
        h.up_ok(k, &file);
    }
    for k in 0..3 {
        for slot in 1..=6 {
            h.wait_slot(k, slot, "READY", None);
        }
        for other in (0..3).filter(|&o| o != k) {
            let s = h.host_state(k, &format!("h{other}"));
            assert_eq!(s["state"], "joined", "h{k} sees h{other}: {s}");
        }
    }
    let gen4 = [h.slot(0, 4).2, 0, h.slot(2, 4).2];
    h.down(1);
    for k in [0, 2] {
        h.wait_slot(k, 3, "DOWN", Some("shutdown"));
        h.wait_slot(k, 4, "DOWN", Some("shutdown"));
        for slot in [1, 2, 5, 6] {
            assert_eq!(h.slot(k, slot).0, "READY", "h{k} slot {slot}");
        }
    }
    // h1 comes back: h0 (which it dials) and h2 (which dials it) both take it back.
    h.up_ok(1, &file);
    for k in [0, 2] {
        h.wait_slot(k, 4, "READY", None);
        assert!(h.slot(k, 4).2 > gen4[k]);
    }
    for k in 0..3 {
        h.down(k);
    }
    h.assert_nothing_left();
}

/// Datagram `seq`'s length and bytes: lengths from 1 B to 64 KiB, every byte checked.
fn dgram_of(seq: u64) -> Vec<u8> {
    let len = match seq % 5 {
        0 => 8,
        1 => 1 + (seq as usize * 7919) % 4096,
        2 => 65536,
        3 => 1500,
        _ => 16 + (seq as usize * 104729) % 60000,
    };
    let mut v: Vec<u8> = (0..len).map(|i| (i as u64 + seq * 31) as u8).collect();
    if len >= 8 {
        v[..8].copy_from_slice(&seq.to_le_bytes());
    }
    v
}

const CROSS_PORT: u32 = 7000;
const CROSS_COUNT: u64 = 3000;
/// From this datagram on the receiver reads with `recv_many_with`.
const MANY_FROM: u64 = 900;

/// Whether this role's endpoints should take datagrams between hosts straight (the default)
/// or through the bridges (`BACKPLANE_DIRECT=0`).
fn direct_wanted() -> bool {
    std::env::var("BACKPLANE_DIRECT").map_or(true, |v| v != "0")
}

fn cross_host_role(role: &str) {
    use backplane::dgram::{DgramError, Wait};
    use backplane::fabric::Fabric;
    use backplane::transport::Addr;
    let fabric = Fabric::attach(&std::env::var("BP_FABRIC").unwrap()).unwrap();
    match role {
        "receiver" => {
            let mut ep = fabric.node(2).unwrap().bind(CROSS_PORT).unwrap();
            assert_eq!(ep.is_direct(), direct_wanted(), "the receiver's path");
            let mut buf = vec![0u8; 65536];
            let mut from = None;
            for seq in 0..MANY_FROM {
                let (n, src) = ep
                    .recv_from_timeout(&mut buf, Duration::from_secs(30))
                    .unwrap();
                assert_eq!(src.node, 1, "datagram {seq} from {src}");
                assert!(from.is_none_or(|f| f == src));
                from = Some(src);
                let want = dgram_of(seq);
                assert_eq!(n, want.len(), "datagram {seq}'s length");
                assert!(buf[..n] == want[..], "datagram {seq}'s bytes");
                // A slow receiver for a while: the sender must wait, not lose anything.
                if seq < 300 && seq % 30 == 0 {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            // The rest as a stream's reader takes it: as many a call as are there, read in
            // place (at most 7: the sender's batches of ten split across calls), each once and
            // in order; one refused once stays the next.
            let (mut seq, mut refused) = (MANY_FROM, false);
            while seq < CROSS_COUNT {
                let r = ep.recv_many_with(Wait::For(Duration::from_secs(30)), 7, |src, p| {
                    if seq == MANY_FROM + 505 && !refused {
                        refused = true;
                        return Err(DgramError::BufferTooSmall {
                            have: 0,
                            need: p.len(),
                        });
                    }
                    assert_eq!(Some(src), from, "datagram {seq}'s sender");
                    assert!(p == dgram_of(seq), "datagram {seq}'s bytes");
                    seq += 1;
                    Ok(())
                });
                match r {
                    Ok(n) => assert!((1..=7).contains(&n), "{n} datagrams in one call"),
                    // Refused as the first of a call.
                    Err(DgramError::BufferTooSmall { .. }) => {}
                    Err(e) => panic!("recv_many_with at datagram {seq}: {e}"),
                }
            }
            assert!(refused);
            let src = from.unwrap();
            ep.send_to(src, format!("done:{CROSS_COUNT}").as_bytes())
                .unwrap();
            let (n, _) = ep
                .recv_from_timeout(&mut buf, Duration::from_secs(30))
                .unwrap();
            assert_eq!(&buf[..n], b"bye");
        }
        "sender" => {
            let mut ep = fabric.node(1).unwrap().bind(0).unwrap();
            assert_eq!(ep.is_direct(), direct_wanted(), "the sender's path");
            let to = Addr::new(2, CROSS_PORT);
            // The receiver binds when its process is up: until then nothing listens there.
            let first = dgram_of(0);
            let sent = wait_for(Duration::from_secs(30), || match ep.send_to(to, &first) {
                Ok(()) => Some(()),
                Err(backplane::dgram::DgramError::Unreachable(_)) => {
                    std::thread::sleep(Duration::from_millis(20));
                    None
                }
                Err(e) => panic!("first send: {e}"),
            });
            assert!(sent.is_some(), "the receiver never bound");
            let mut seq = 1;
            while seq < CROSS_COUNT {
                if (1000..2000).contains(&seq) {
                    // Ten at a time in one call: over a direct connection a few to a message.
                    let group: Vec<Vec<u8>> = (seq..seq + 10).map(dgram_of).collect();
                    let list: Vec<&[u8]> = group.iter().map(Vec::as_slice).collect();
                    ep.send_many(to, &list, backplane::dgram::Wait::Forever)
                        .unwrap();
                    seq += 10;
                } else {
                    ep.send_to(to, &dgram_of(seq)).unwrap();
                    seq += 1;
                }
            }
            let mut buf = [0u8; 64];
            let (n, src) = ep
                .recv_from_timeout(&mut buf, Duration::from_secs(60))
                .unwrap();
            assert_eq!(src, to);
            assert_eq!(&buf[..n], format!("done:{CROSS_COUNT}").as_bytes());
            ep.send_to(to, b"bye").unwrap();
            // The receiver leaves after "bye": a sender still sending hears it, whichever path
            // its datagrams take (the route ends; a direct connection fails first).
            let gone = wait_for(Duration::from_secs(10), || match ep.send_to(to, b"late") {
                Err(backplane::dgram::DgramError::Unreachable(_)) => Some(()),
                Ok(()) => {
                    std::thread::sleep(Duration::from_millis(5));
                    None
                }
                Err(e) => panic!("a send after the receiver left: {e}"),
            });
            assert!(
                gone.is_some(),
                "the receiver left 10 s ago; sends still succeed"
            );
        }
        "stream_receiver" => {
            let mut ep = fabric.node(2).unwrap().bind(CROSS_PORT).unwrap();
            let mut buf = vec![0u8; 65536];
            // Until its host goes away under it.
            while ep
                .recv_from_timeout(&mut buf, Duration::from_secs(60))
                .is_ok()
            {}
        }
        "stalled_receiver" => {
            let mut ep = fabric.node(2).unwrap().bind(CROSS_PORT).unwrap();
            let mut buf = vec![0u8; 65536];
            for _ in 0..STALL_AFTER {
                ep.recv_from_timeout(&mut buf, Duration::from_secs(60))
                    .unwrap();
            }
            // Stops reading: the sender's bytes pile up in TCP, its send waits, until this
            // host goes away under it.
            std::thread::sleep(Duration::from_secs(8));
            while ep
                .recv_from_timeout(&mut buf, Duration::from_secs(10))
                .is_ok()
            {}
        }
        // Blocking sends until the receiver's host is gone: of 1 000 bytes, or of 40 000
        // (UCX reads each from `data` in place, and the send waits for the kernel to take
        // it: `Endpoint::send`) — the receiver then stopped reading after STALL_AFTER.
        "stream_sender" | "lending_sender" => {
            let lending = role == "lending_sender";
            let mut ep = fabric.node(1).unwrap().bind(0).unwrap();
            let to = Addr::new(2, CROSS_PORT);
            let data = vec![7u8; if lending { 40_000 } else { 1000 }];
            let mut sent = 0u64;
            let err = loop {
                match ep.send_to(to, &data) {
                    Ok(()) => sent += 1,
                    Err(backplane::dgram::DgramError::Unreachable(_)) if sent == 0 => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => break e,
                }
            };
            eprintln!("sender stopped after {sent} datagrams: {err}");
            assert!(sent >= if lending { STALL_AFTER } else { 1 });
            assert!(
                matches!(
                    err,
                    backplane::dgram::DgramError::NodeDown(2)
                        | backplane::dgram::DgramError::Unreachable(_)
                ),
                "{err}"
            );
        }
        _ => unreachable!(),
    }
}

#[test]
fn datagrams_cross_hosts_whole_in_order_with_back_pressure_and_answers() {
    if let Some(r) = role() {
        cross_host_role(&r);
        return;
    }
    if !root() {
        return;
    }
    let h = Hosts::odd_even("hosts_dgram", 14);
    let test_fn = "datagrams_cross_hosts_whole_in_order_with_back_pressure_and_answers";
    // Straight between the two processes (the default), then through the bridges.
    for env in [&[][..], &["BACKPLANE_DIRECT=0"][..]] {
        let rx = h.spawn_role_with(1, test_fn, "receiver", env);
        let tx = h.spawn_role_with(0, test_fn, "sender", env);
        assert!(
            finish(tx, "the sender").success(),
            "the sender failed ({env:?})"
        );
        assert!(
            finish(rx, "the receiver").success(),
            "the receiver failed ({env:?})"
        );
    }
    // Both hosts count the traffic on their own node's side.
    let s0 = h.status(0);
    assert!(
        s0["slots"][0]["tx_msgs"].as_u64().unwrap() > CROSS_COUNT,
        "{s0}"
    );
    let s1 = h.status(1);
    assert!(
        s1["slots"][1]["rx_msgs"].as_u64().unwrap() > CROSS_COUNT,
        "{s1}"
    );
    // h0's status shows node 2's traffic as h1 reports it (within a report period).
    let seen = wait_for(Duration::from_secs(5), || {
        (h.status(0)["slots"][1]["rx_msgs"].as_u64().unwrap_or(0) > CROSS_COUNT).then_some(())
    });
    assert!(seen.is_some(), "{}", h.status(0));
    // `perf` between the hosts: its peer started on h1 through --peer-via, ucx_perftest
    // between the same two namespaces beside it.
    let via = h.dir.join("on-h1.sh");
    std::fs::write(
        &via,
        format!(
            "#!/bin/sh\nexec nsenter --net=/run/netns/{} unshare --mount --propagation unchanged \
             sh -c 'mount --make-private /sys && mount -t sysfs sysfs /sys && exec \"$0\" \"$@\"' \
             env BACKPLANE_RUN_DIR={} UCX_TLS=tcp \"$@\"\n",
            h.ns(1),
            h.run_dir(1).display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&via, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // `perf TEST --name F -r 1 -n N -s SIZE --json --peer-via on-h1.sh`: its JSON.
    let perf = |test: &str, n: &str, size: &str| -> serde_json::Value {
        let via = via.to_str().unwrap();
        let args = [
            "perf",
            test,
            "--name",
            &h.fabric,
            "-r",
            "1",
            "-n",
            n,
            "-s",
            size,
            "--json",
            "--peer-via",
            via,
        ];
        let o = h.bp(0, &args);
        assert!(
            o.status.success(),
            "perf {test} across hosts: {}",
            stderr(&o)
        );
        serde_json::from_slice(&o.stdout).unwrap()
    };
    for test in ["dgram-lat", "dgram-bw"] {
        let j = perf(test, "300", "4K");
        assert!(j["backplane"][0]["bytes"] == 4096, "{j}");
        eprintln!(
            "perf {test} across hosts: {} / UCX {}",
            j["backplane"][0], j["ucx"][0]
        );
        let ucx_ran = j["ucx"].is_array();
        assert!(
            ucx_ran || j["ucx_note"].as_str().unwrap_or("").contains("not found"),
            "{j}"
        );
        if ucx_ran {
            let at = j["ucx_where"].as_str().unwrap();
            assert!(at.contains("UCX_TLS=tcp"), "{j}");
            // ucx_perftest runs with the links' own TCP segments, from the first round on.
            let seg = format!("UCX_TCP_TX_SEG_SIZE={}", backplane_ucx::TCP_SEGMENT);
            assert!(
                at.contains(&seg) || std::env::var_os("UCX_TCP_TX_SEG_SIZE").is_some(),
                "{j}"
            );
            // ... and the TCP congestion control of host 0's namespace, which paces both
            // streams or not (bbr swings them by up to 3x a round).
            let cc = Command::new("ip")
                .args(["netns", "exec", &h.ns(0), "cat"])
                .arg("/proc/sys/net/ipv4/tcp_congestion_control")
                .output()
                .unwrap();
            let cc = String::from_utf8_lossy(&cc.stdout).trim().to_string();
            assert!(!cc.is_empty(), "no congestion control in {}", h.ns(0));
            assert_eq!(j["tcp_congestion_control"], cc.as_str(), "{j}");
            assert!(at.contains(&format!("TCP congestion control {cc}")), "{j}");
        }
    }
    // DMA jobs into the perf peer's region on h1, beside ucp_put_bw between the hosts.
    let j = perf("dma-bw", "200", "64K");
    let row = &j["rows"][0];
    eprintln!("perf dma-bw across hosts: {row}");
    assert!(j["across_hosts"] == true && row["bytes"] == 65536, "{j}");
    assert!(row["bw_avg_mbps"].as_f64().unwrap() > 0.0, "{j}");
    assert!(
        row["ucx_put_mbps"].as_f64().is_some()
            || j["ucx_note"].as_str().unwrap_or("").contains("not found"),
        "{j}"
    );
    // Past the peer's region: refused in one line before anything runs.
    let via = via.to_str().unwrap();
    let args = [
        "perf",
        "dma-bw",
        "--name",
        &h.fabric,
        "-s",
        "4M",
        "--peer-via",
        via,
    ];
    let o = h.bp(0, &args);
    assert!(
        one_line(&o).contains("moves at most 1048576 bytes per job"),
        "{}",
        stderr(&o)
    );
    h.down(1);
    h.down(0);
    h.assert_nothing_left();
}

const LINK_PORT: u32 = 7100;
/// Datagrams each sender sends into the shared downlink, and their size.
const LINK_DGRAMS: u64 = 48;
const LINK_DGRAM: usize = 65536;

/// Checks that 2 × [`LINK_DGRAMS`] datagrams took at least their time on one link of the
/// fabric's model (a floor, not a speed: the emulation never delivers early).
fn not_before_the_model(fabric: &backplane::fabric::Fabric, who: &str, took: Duration) {
    let rate = fabric.link().unwrap().bytes_per_s as f64;
    let floor = (2 * LINK_DGRAMS) as f64 * LINK_DGRAM as f64 / rate;
    eprintln!("{who}: {took:?}, the model's floor {floor:.4} s");
    assert!(
        took.as_secs_f64() >= 0.95 * floor,
        "{who}: {took:?} < the model's {floor} s"
    );
}

/// Says hello to each of `peers` (which may not have bound yet) until every one answered
/// `answer`.
fn hail(ep: &mut backplane::dgram::Endpoint, peers: &[backplane::transport::Addr], answer: &[u8]) {
    let mut answered = Vec::new();
    let mut buf = [0u8; 16];
    let all = wait_for(Duration::from_secs(30), || {
        for p in peers.iter().filter(|p| !answered.contains(*p)) {
            match ep.send_to(*p, b"hello") {
                Ok(()) | Err(backplane::dgram::DgramError::Unreachable(_)) => {}
                Err(e) => panic!("hello to {p}: {e}"),
            }
        }
        if let Ok((n, src)) = ep.recv_from_timeout(&mut buf, Duration::from_millis(50)) {
            if &buf[..n] == answer && !answered.contains(&src) {
                answered.push(src);
            }
        }
        (answered.len() == peers.len()).then_some(())
    });
    assert!(all.is_some(), "{answered:?} of {peers:?} answered");
}

/// Node 3 (on h0) receives from node 1 (h0) and node 2 (h1) at once through one emulated
/// downlink; the senders start together when the sink has heard both.
fn link_role(role: &str) {
    use backplane::fabric::Fabric;
    use backplane::transport::Addr;
    let fabric = Fabric::attach(&std::env::var("BP_FABRIC").unwrap()).unwrap();
    let sink = Addr::new(3, LINK_PORT);
    // (Its waits give the CPU away now and then: this host's bridge needs one.)
    assert!(fabric.spans_hosts());
    match role {
        "sink" => {
            let mut ep = fabric.node(3).unwrap().bind(LINK_PORT).unwrap();
            let mut buf = vec![0u8; LINK_DGRAM];
            let mut senders = Vec::new();
            while senders.len() < 2 {
                let (_, src) = ep
                    .recv_from_timeout(&mut buf, Duration::from_secs(30))
                    .unwrap();
                if !senders.contains(&src) {
                    senders.push(src);
                }
            }
            let t0 = Instant::now();
            for &s in &senders {
                ep.send_to(s, b"go").unwrap();
            }
            let mut from = [0u64; 2];
            while from.iter().sum::<u64>() < 2 * LINK_DGRAMS {
                let (n, src) = ep
                    .recv_from_timeout(&mut buf, Duration::from_secs(30))
                    .unwrap();
                if n == LINK_DGRAM {
                    from[senders.iter().position(|&s| s == src).unwrap()] += 1;
                } // (a late hello otherwise)
            }
            // Nothing left before the go; all of it then crossed one downlink at the model's
            // rate (were it modelled once per host, the two streams would pass side by side,
            // in half the time).
            assert_eq!(from, [LINK_DGRAMS; 2]);
            not_before_the_model(&fabric, "the sink", t0.elapsed());
            for &s in &senders {
                ep.send_to(s, b"bye").unwrap();
            }
        }
        "sender_1" | "sender_2" => {
            let node = if role == "sender_1" { 1 } else { 2 };
            let mut ep = fabric.node(node).unwrap().bind(0).unwrap();
            let mut buf = [0u8; 16];
            hail(&mut ep, &[sink], b"go");
            let data = vec![node as u8; LINK_DGRAM];
            for _ in 0..LINK_DGRAMS {
                ep.send_to(sink, &data).unwrap();
            }
            let (n, _) = ep
                .recv_from_timeout(&mut buf, Duration::from_secs(30))
                .unwrap();
            assert_eq!(&buf[..n], b"bye");
        }
        "fan_sink_1" | "fan_sink_3" => {
            let node = if role == "fan_sink_1" { 1 } else { 3 };
            let mut ep = fabric.node(node).unwrap().bind(LINK_PORT + 1).unwrap();
            let mut buf = vec![0u8; LINK_DGRAM];
            let (_, src) = ep
                .recv_from_timeout(&mut buf, Duration::from_secs(30))
                .unwrap();
            ep.send_to(src, b"ready").unwrap();
            let mut got = 0;
            while got < LINK_DGRAMS {
                let (n, _) = ep
                    .recv_from_timeout(&mut buf, Duration::from_secs(30))
                    .unwrap();
                got += u64::from(n == LINK_DGRAM); // (later hellos are short)
            }
            ep.send_to(src, b"got").unwrap();
        }
        "fan_sender" => {
            // Node 2 (h1) to nodes 1 and 3 (h0) in turn: two downlinks, one uplink.
            let mut ep = fabric.node(2).unwrap().bind(0).unwrap();
            let sinks = [Addr::new(1, LINK_PORT + 1), Addr::new(3, LINK_PORT + 1)];
            let mut buf = [0u8; 16];
            hail(&mut ep, &sinks, b"ready");
            let t0 = Instant::now();
            let data = vec![2u8; LINK_DGRAM];
            for k in 0..2 * LINK_DGRAMS {
                ep.send_to(sinks[k as usize % 2], &data).unwrap();
            }
            for _ in 0..2 {
                let (n, _) = ep
                    .recv_from_timeout(&mut buf, Duration::from_secs(30))
                    .unwrap();
                assert_eq!(&buf[..n], b"got");
            }
            // Every datagram crossed node 2's one uplink in turn (were it not modelled on
            // the sending host, the two downlinks would take them side by side).
            not_before_the_model(&fabric, "the fan sender", t0.elapsed());
        }
        _ => unreachable!(),
    }
}

#[test]
fn an_emulated_link_spans_hosts_one_downlink_for_senders_on_both_one_uplink_per_sender() {
    if let Some(r) = role() {
        link_role(&r);
        return;
    }
    if !root() {
        return;
    }
    let h = Hosts::odd_even_with("hosts_link", 22, Some("tcp"), &["--link", "eth-1g"]);
    for k in 0..2 {
        let link = h.status(k)["link"].clone();
        assert!(link["model"] == "eth-1g", "h{k}: {link}");
    }
    let test_fn =
        "an_emulated_link_spans_hosts_one_downlink_for_senders_on_both_one_uplink_per_sender";
    let sink = h.spawn_role(0, test_fn, "sink");
    let s1 = h.spawn_role(0, test_fn, "sender_1");
    let s2 = h.spawn_role(1, test_fn, "sender_2");
    assert!(finish(s1, "sender 1").success(), "sender 1 failed");
    assert!(finish(s2, "sender 2").success(), "sender 2 failed");
    assert!(finish(sink, "the sink").success(), "the sink failed");
    // One sender on h1 to two nodes on h0: its uplink holds them back on its own host.
    let f1 = h.spawn_role(0, test_fn, "fan_sink_1");
    let f3 = h.spawn_role(0, test_fn, "fan_sink_3");
    let fs = h.spawn_role(1, test_fn, "fan_sender");
    assert!(
        finish(fs, "the fan sender").success(),
        "the fan sender failed"
    );
    assert!(finish(f1, "sink 1").success(), "sink 1 failed");
    assert!(finish(f3, "sink 3").success(), "sink 3 failed");
    h.down(1);
    h.down(0);
    h.assert_nothing_left();
}

/// Port of the topology test's sinks.
const TOPO_PORT: u32 = 7200;

/// The roles of [`a_distributed_topology_spans_hosts_forwarding_nodes_on_either_host`].
fn topo_role(role: &str) {
    use backplane::dgram::DgramError;
    use backplane::fabric::Fabric;
    use backplane::transport::Addr;
    let fabric = Fabric::attach(&std::env::var("BP_FABRIC").unwrap()).unwrap();
    let sink = Addr::new(4, TOPO_PORT);
    match role {
        "sink_4" => {
            let mut ep = fabric.node(4).unwrap().bind(TOPO_PORT).unwrap();
            let mut buf = vec![0u8; LINK_DGRAM];
            let (_, src) = ep
                .recv_from_timeout(&mut buf, Duration::from_secs(30))
                .unwrap();
            // The clock starts before the go: a sink descheduled between the two would
            // otherwise start it after the first datagrams left (a run here saw 0.83 of
            // the floor).
            let t0 = Instant::now();
            ep.send_to(src, b"go").unwrap();
            let mut got = 0;
            while got < 2 * LINK_DGRAMS {
                let (n, from) = ep
                    .recv_from_timeout(&mut buf, Duration::from_secs(30))
                    .unwrap();
                if n == LINK_DGRAM {
                    assert_eq!(from, src);
                    assert!(
                        buf.iter().all(|&b| b == (got % 251) as u8),
                        "datagram {got}"
                    );
                    got += 1;
                }
            }
            // Three links of the model, one after another, each at its rate: never sooner
            // than one link's time for all of it.
            let rate = backplane::fabric::launch::resolve_link(
                "eth-1g",
                backplane::model::Forwarding::CutThrough,
            )
            .unwrap()
            .bytes_per_s as f64;
            let floor = (2 * LINK_DGRAMS) as f64 * LINK_DGRAM as f64 / rate;
            let took = t0.elapsed();
            eprintln!("the sink: {took:?}, the model's floor {floor:.4} s");
            assert!(took.as_secs_f64() >= 0.95 * floor, "{took:?} < {floor} s");
            ep.send_to(src, b"bye").unwrap();
        }
        "sender_1" => {
            let mut ep = fabric.node(1).unwrap().bind(0).unwrap();
            let mut buf = [0u8; 16];
            hail(&mut ep, &[sink], b"go");
            for k in 0..2 * LINK_DGRAMS {
                ep.send_to(sink, &vec![(k % 251) as u8; LINK_DGRAM])
                    .unwrap();
            }
            let (n, _) = ep
                .recv_from_timeout(&mut buf, Duration::from_secs(30))
                .unwrap();
            assert_eq!(&buf[..n], b"bye");
        }
        "no_route" => {
            // Node 1 to node 3, both here: the one path runs through node 2, whose host left.
            let _sink = fabric.node(3).unwrap().bind(TOPO_PORT).unwrap();
            let mut ep = fabric.node(1).unwrap().bind(0).unwrap();
            match ep.send_to(Addr::new(3, TOPO_PORT), b"x") {
                Err(DgramError::NoRoute(m)) => {
                    assert!(m.contains("no route from node 1 to node 3"), "{m}");
                    assert!(m.contains("DOWN (2, 4)"), "{m}");
                }
                other => panic!("node 1 to node 3 without node 2: {other:?}"),
            }
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn a_distributed_topology_spans_hosts_forwarding_nodes_on_either_host() {
    if let Some(r) = role() {
        topo_role(&r);
        return;
    }
    if !root() {
        return;
    }
    let h = Hosts::new("hosts_topo", 24, 2);
    let _ = std::fs::create_dir_all(&h.dir);
    // A chain 1-2-3-4 with nodes 1 and 3 on h0, 2 and 4 on h1: from 1 to 4 a datagram
    // crosses the hosts three times, forwarded by node 2 (h1) and node 3 (h0).
    let topo = h.dir.join("chain.toml");
    std::fs::write(
        &topo,
        "kind = \"distributed\"\nlink = \"eth-1g\"\n\n[[links]]\na = 1\nb = 2\n\n\
         [[links]]\na = 2\nb = 3\n\n[[links]]\na = 3\nb = 4\n",
    )
    .unwrap();
    let file = h.file("hosts.toml", &[&[1, 3], &[2, 4]]);
    // A topology that does not cover the hosts' slots is refused before anything starts.
    let short = h.dir.join("short.toml");
    std::fs::write(
        &short,
        "kind = \"distributed\"\nlink = \"eth-1g\"\n\n[[links]]\na = 1\nb = 2\n",
    )
    .unwrap();
    let o = h.up(0, &file, &["--topology", short.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("the topology file has 2 nodes but the hosts file 4"),
        "{}",
        stderr(&o)
    );
    // A host without the topology is refused by one with it, naming both.
    let o = h.up(0, &file, &["--topology", topo.to_str().unwrap()]);
    assert!(o.status.success(), "up on h0: {}{}", stderr(&o), h.logs());
    let o = h.up(1, &file, &[]);
    assert!(!o.status.success(), "h1 without the topology joined");
    assert!(
        stderr(&o).contains("a topology: links 1-2 eth-1g"),
        "{}",
        stderr(&o)
    );
    let o = h.up(1, &file, &["--topology", topo.to_str().unwrap()]);
    assert!(o.status.success(), "up on h1: {}{}", stderr(&o), h.logs());
    h.wait_slot(0, 2, "READY", None);
    h.wait_slot(1, 1, "READY", None);
    for k in 0..2 {
        let t = h.status(k)["topology"].clone();
        assert!(t["kind"] == "distributed", "h{k}: {t}");
    }
    let test_fn = "a_distributed_topology_spans_hosts_forwarding_nodes_on_either_host";
    let sink = h.spawn_role(1, test_fn, "sink_4");
    let sender = h.spawn_role(0, test_fn, "sender_1");
    assert!(finish(sender, "the sender").success(), "the sender failed");
    assert!(finish(sink, "the sink").success(), "the sink failed");
    // Both forwarding nodes counted every datagram, whichever host's sender it was, and
    // either host's status says so (each adds what the other reported).
    let counted = wait_for(Duration::from_secs(10), || {
        let all = (0..2).all(|k| {
            let s = h.status(k);
            [2, 3].iter().all(|&slot| {
                s["slots"][slot - 1]["fwd_msgs"].as_u64().unwrap_or(0) >= 2 * LINK_DGRAMS
            })
        });
        all.then_some(())
    });
    assert!(
        counted.is_some(),
        "forwarding counts:\n--- h0: {}\n--- h1: {}",
        h.status(0),
        h.status(1)
    );
    // h1 leaves: nodes 2 and 4 go DOWN, and node 1 no longer reaches node 3.
    h.down(1);
    h.wait_slot(0, 2, "DOWN", None);
    let r = h.spawn_role(0, test_fn, "no_route");
    assert!(finish(r, "no route").success(), "no_route failed");
    h.down(0);
    h.assert_nothing_left();
}

/// The port of `ns_echo` (node 2).
const NS_ECHO_PORT: u32 = 7100;

/// Roles run in a node's network namespace (`bp0` and `lo`, no address of the host): by
/// `exec`, their endpoints still go straight to the other host (UCX works from the
/// supervisor's namespace); by `ip netns exec` (`BP_DIRECT=0`: /sys shows the node's
/// interfaces, where UCX would find none to reach the host with), through the bridges. A
/// datagram crosses each way either way.
fn node_ns_role(role: &str) {
    let direct = std::env::var("BP_DIRECT").map_or(true, |v| v != "0");
    use backplane::dgram::Wait;
    use backplane::fabric::Fabric;
    use backplane::transport::Addr;
    let fabric = Fabric::attach(&std::env::var("BP_FABRIC").unwrap()).unwrap();
    let mut buf = [0u8; 64];
    match role {
        "ns_echo" => {
            let mut ep = fabric.node(2).unwrap().bind(NS_ECHO_PORT).unwrap();
            assert_eq!(ep.is_direct(), direct, "node 2's endpoint's path");
            let (n, src) = ep
                .recv_from_timeout(&mut buf, Duration::from_secs(30))
                .unwrap();
            assert_eq!(&buf[..n], b"ping");
            ep.send_to(src, b"echo").unwrap();
            let (n, _) = ep
                .recv_from_timeout(&mut buf, Duration::from_secs(30))
                .unwrap();
            assert_eq!(&buf[..n], b"bye");
        }
        "ns_ping" => {
            let mut ep = fabric.node(1).unwrap().bind(0).unwrap();
            assert_eq!(ep.is_direct(), direct, "node 1's endpoint's path");
            let to = Addr::new(2, NS_ECHO_PORT);
            // (Until node 2's endpoint is bound.)
            let t0 = Instant::now();
            while let Err(e) = ep.send(to, b"ping", Wait::For(Duration::from_secs(5))) {
                assert!(
                    t0.elapsed() < Duration::from_secs(30),
                    "no echo endpoint: {e}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            let (n, src) = ep
                .recv_from_timeout(&mut buf, Duration::from_secs(30))
                .unwrap();
            assert_eq!((&buf[..n], src), (&b"echo"[..], to));
            ep.send_to(to, b"bye").unwrap();
            // (What was sent leaves before the endpoint closes.)
            std::thread::sleep(Duration::from_millis(200));
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn ip_over_the_fabric_spans_hosts_ping_and_iperf3_run_unmodified() {
    if let Some(r) = role() {
        node_ns_role(&r);
        return;
    }
    if !root() {
        return;
    }
    // (A short name: UCX keeps 15 characters of a device's name, `bp_` + the fabric's.)
    let h = Hosts::new("hip", 15, 2);
    let file = h.file("hosts.toml", &[&[1, 3], &[2, 4]]);
    for k in 0..2 {
        let o = h.up_net(k, &file, &[]);
        assert!(o.status.success(), "up on h{k}: {}", stderr(&o));
    }
    h.wait_slot(0, 2, "READY", None);
    let exec = |k: usize, node: &str, args: &[&str]| {
        let mut a = vec!["exec", "--name", &h.fabric, node, "--"];
        a.extend_from_slice(args);
        h.bp(k, &a)
    };
    // node1 (h0) → node2 and node4 (h1) by name, and node3 (h0) → node2.
    for (k, from, to) in [
        (0, "1", "node2"),
        (0, "1", "node4"),
        (0, "3", "node2"),
        (1, "4", "node1"),
    ] {
        // The first packets may be lost while the routes to the other host open (and ARP
        // gives up after three tries): one answer first, then three in a row.
        let first = wait_for(Duration::from_secs(30), || {
            let o = exec(k, from, &["ping", "-c", "1", "-W", "2", to]);
            o.status.success().then_some(())
        });
        // (On failure, both hosts' status too: which endpoints and counters moved.)
        assert!(
            first.is_some(),
            "no ping {to} from node {from}:\n{}\n--- h0: {}\n--- h1: {}",
            h.logs(),
            h.status(0),
            h.status(1)
        );
        let o = exec(k, from, &["ping", "-c", "3", "-i", "0.2", "-W", "5", to]);
        assert!(
            o.status.success(),
            "ping {to} from node {from}: {}{}\n{}",
            String::from_utf8_lossy(&o.stdout),
            stderr(&o),
            h.logs()
        );
    }
    // iperf3 (TCP) from node 1 on h0 to node 2 on h1.
    let mut server = h
        .in_host(1)
        .arg(format!("BACKPLANE_RUN_DIR={}", h.run_dir(1).display()))
        .args([
            BIN, "exec", "--name", &h.fabric, "2", "--", "iperf3", "-s", "-1", "-p", "5402",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut last = None;
    let got = wait_for(Duration::from_secs(20), || {
        std::thread::sleep(Duration::from_millis(100));
        let o = exec(
            0,
            "1",
            &[
                "timeout", "30", "iperf3", "-c", "node2", "-p", "5402", "-t", "2", "-J",
            ],
        );
        // (A try before the server listens is refused, and iperf3 exits 0 then: a try.)
        if o.status.success() && !iperf3_refused(&o.stdout) {
            return Some(o);
        }
        last = Some(o);
        None
    });
    let _ = server.kill();
    let _ = server.wait();
    let Some(o) = got else {
        // (What the last try said, and both hosts' view: a stall or a refusal.)
        let said = last.map_or(String::new(), |o| {
            format!(
                "{:?}: {}{}",
                o.status,
                String::from_utf8_lossy(&o.stdout),
                stderr(&o)
            )
        });
        panic!(
            "iperf3 never connected across hosts: {said}\n{}\n--- h0: {}\n--- h1: {}",
            h.logs(),
            h.status(0),
            h.status(1)
        );
    };
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // The receiver's figure; once in CI (1 run in 3 that day) iperf3 exited 0 with only the
    // sender's, so that one counts too — and neither is a failure that shows the report.
    let (side, bps) = ["sum_received", "sum_sent"]
        .into_iter()
        .find_map(|k| Some((k, j["end"][k]["bits_per_second"].as_f64()?)))
        .unwrap_or_else(|| panic!("iperf3 reported no throughput: {j}"));
    eprintln!("iperf3 across hosts: {:.0} Mbit/s ({side})", bps / 1e6);
    assert!(bps > 0.0);
    // The agents' endpoints listened on their host's address and carried the frames straight
    // to the other host: from inside a node's namespace (bp0 and lo only) UCX could not bind
    // there, said so in the log, and every frame went through the bridges.
    let logs = h.logs();
    assert!(
        !logs.contains("Cannot assign requested address"),
        "an agent's endpoint could not listen on its host's address:\n{logs}"
    );
    // Once the traffic stops the agents of nodes 1 and 2 rest: ~20-40 context switches a
    // second each (their periodic looks), where after any IP traffic between hosts the waker
    // of the agent's sending endpoint woke every 50 µs (its worker locked by the TAP read
    // inside a send's fill) or every 1 ms (a stale batching flag) for as long as it lived.
    std::thread::sleep(Duration::from_millis(300));
    let agents = [
        h.status(0)["slots"][0]["pid"].as_u64().unwrap(),
        h.status(1)["slots"][1]["pid"].as_u64().unwrap(),
    ];
    let before = agents.map(context_switches);
    std::thread::sleep(Duration::from_secs(1));
    let after = agents.map(context_switches);
    for ((pid, b), a) in agents.iter().zip(before).zip(after) {
        let n = a.saturating_sub(b);
        eprintln!("idle agent {pid}: {n} context switches in a second");
        assert!(
            n < 500,
            "the idle agent {pid} switched {n} times in a second"
        );
    }
    // `exec --host-net` runs in the host's namespace (the node's identity kept), plain
    // `exec` in the node's.
    let ns = |o: Output| String::from_utf8_lossy(&o.stdout).trim().to_string();
    let host_ns = ns(h
        .in_host(0)
        .args(["readlink", "/proc/self/ns/net"])
        .output()
        .unwrap());
    let node_ns = ns(exec(0, "1", &["readlink", "/proc/self/ns/net"]));
    let o = h.bp(
        0,
        &[
            "exec",
            "--name",
            &h.fabric,
            "--host-net",
            "1",
            "--",
            "sh",
            "-c",
            "readlink /proc/self/ns/net; echo $BACKPLANE_NODE",
        ],
    );
    assert!(o.status.success(), "exec --host-net: {}", stderr(&o));
    assert_eq!(ns(o), format!("{host_ns}\n1"));
    assert_ne!(node_ns, host_ns);
    let o = h.bp(
        0,
        &[
            "exec",
            "--name",
            &h.fabric,
            "--host-net",
            "--accel",
            "1",
            "--",
            "true",
        ],
    );
    assert!(
        !o.status.success() && stderr(&o).contains("--accel"),
        "{}",
        stderr(&o)
    );
    // A program in a node's namespace reaches the other host straight from its process too:
    // its endpoints' UCX works from the supervisor's namespace (they went through the bridges
    // before, 3-4x slower).
    let test_fn = "ip_over_the_fabric_spans_hosts_ping_and_iperf3_run_unmodified";
    let exe = std::env::current_exe().unwrap();
    let role_in_node = |k: usize, node: &str, role: &str| {
        h.in_host(k)
            .arg(format!("BACKPLANE_RUN_DIR={}", h.run_dir(k).display()))
            .arg(BIN)
            .args(["exec", "--name", &h.fabric, node, "--", "env"])
            .arg(format!("BP_ROLE={role}"))
            .arg(format!("BP_FABRIC={}", h.fabric))
            .arg(&exe)
            .args([test_fn, "--exact", "--nocapture", "--test-threads=1"])
            .spawn()
            .unwrap()
    };
    let echo = role_in_node(1, "2", "ns_echo");
    let ping = role_in_node(0, "1", "ns_ping");
    assert!(finish(ping, "ns_ping").success(), "ns_ping failed");
    assert!(finish(echo, "ns_echo").success(), "ns_echo failed");
    // Entered with `ip netns exec` (its own /sys: UCX could not reach the host from there),
    // the same programs go through the bridges, and still cross.
    let role_by_ip = |k: usize, node: u32, role: &str| {
        h.in_host(k)
            .arg(format!("BACKPLANE_RUN_DIR={}", h.run_dir(k).display()))
            .args(["ip", "netns", "exec"])
            .arg(format!("bp-{}-{node}", h.fabric))
            .args(["env", "BP_DIRECT=0"])
            .arg(format!("BP_ROLE={role}"))
            .arg(format!("BP_FABRIC={}", h.fabric))
            .arg(&exe)
            .args([test_fn, "--exact", "--nocapture", "--test-threads=1"])
            .spawn()
            .unwrap()
    };
    let echo = role_by_ip(1, 2, "ns_echo");
    let ping = role_by_ip(0, 1, "ns_ping");
    assert!(
        finish(ping, "ns_ping by ip").success(),
        "ns_ping by ip netns exec failed"
    );
    assert!(
        finish(echo, "ns_echo by ip").success(),
        "ns_echo by ip netns exec failed"
    );
    // ... and so does an unmodified verbs program (its peer's address: the node's bp0).
    if have("ibv_rc_pingpong") {
        lib_built("libibverbs.so", "backplane-ibverbs");
        let (c, s) = verbs_pair_node_ns(&h, "ibv_rc_pingpong", "18789", &["-n", "200", "-c"]);
        both_ended_well("ibv_rc_pingpong in the nodes' namespaces", &c, &s);
        assert!(String::from_utf8_lossy(&c.stdout).contains("200 iters in"));
    }
    // ... and UCX over the drop-in, on the fabric's device: the program's own UCX, started in
    // the node's namespace, made UCX's async thread there, and the library's links between
    // the hosts (which share that thread) never connected until the thread was moved to the
    // host's namespace.
    if have("ucx_perftest") {
        lib_built("libibverbs.so", "backplane-ibverbs");
        let dev = format!("UCX_NET_DEVICES=bp_{}:1", h.fabric);
        let env = ["UCX_TLS=rc_verbs,ud_verbs,self", dev.as_str()];
        for (port, args) in [
            ("18786", &["-t", "tag_lat", "-n", "300"][..]),
            ("18787", &["-t", "ucp_get", "-s", "65536", "-n", "100"][..]),
        ] {
            let (c, s) = verbs_pair_env(&h, &[], &env, ("ucx_perftest", port, args), "node2");
            both_ended_well(&format!("ucx_perftest {} between hosts", args[1]), &c, &s);
            assert!(String::from_utf8_lossy(&c.stdout).contains("Final:"));
        }
    }
    // ... and MPI over UCX over the drop-in: `mpirun` in node 1 starts its second rank in
    // node 2, on the other host, through an agent that does what `ssh HOST backplane rsh
    // node2 ...` would (enters that host's namespace, then `rsh`); the ranks' OOB runs over
    // bp0, their messages over the fabric. Every byte checked, windows, an allreduce.
    if have("mpirun") && have("mpicc") {
        lib_built("libibverbs.so", "backplane-ibverbs");
        let dir = h.dir.join("mpi");
        let exe = mpi_pingpong(&dir);
        let agent = dir.join("rsh-to-host");
        let script = format!(
            "#!/bin/sh\n# agent HOST CMD...: node2 is on host 1\nhost=$1; shift\n\
             [ \"$host\" = node2 ] || {{ echo \"agent: $host is not on the other host\" >&2; exit 1; }}\n\
             exec nsenter --net=/run/netns/{ns} unshare --mount --propagation unchanged sh -c \
             'mount --make-private /sys && mount -t sysfs sysfs /sys && exec \"$0\" \"$@\"' \
             env BACKPLANE_RUN_DIR={run} {bin} rsh --name {fabric} --mpi \"$host\" \"$@\"\n",
            ns = h.ns(1),
            run = h.run_dir(1).display(),
            bin = BIN,
            fabric = h.fabric,
        );
        std::fs::write(&agent, script).unwrap();
        std::fs::set_permissions(&agent, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        // `exec --mpi` gives mpirun the rest, its ranks the fabric's UCX settings (the agent
        // passes the environment on); the agent on the command line wins over --mpi's.
        let (agent, exe) = (agent.to_str().unwrap(), exe.to_str().unwrap());
        let mut args = vec!["exec", "--name", &h.fabric, "--mpi", "1", "--"];
        args.extend(MPIRUN_TWO_NODES);
        args.extend(["--mca", "plm_rsh_agent", agent, exe, "50"]);
        let o = h.bp(0, &args);
        mpi_pingpong_ran("mpirun between hosts", &o);
    }
    // ... where a verbs program reaches the other host's (its peer's address is that host's).
    if have("ibv_rc_pingpong") {
        lib_built("libibverbs.so", "backplane-ibverbs");
        let (c, s) = verbs_pair_with(
            &h,
            &["--host-net"],
            "ibv_rc_pingpong",
            "18799",
            &["-n", "200"],
        );
        both_ended_well("ibv_rc_pingpong --host-net", &c, &s);
        assert!(String::from_utf8_lossy(&c.stdout).contains("200 iters in"));
    }
    // Each host removes only its own nodes' namespaces.
    h.down(1);
    assert!(std::path::Path::new(&format!("/run/netns/bp-{}-1", h.fabric)).exists());
    assert!(!std::path::Path::new(&format!("/run/netns/bp-{}-2", h.fabric)).exists());
    h.down(0);
    assert!(!std::path::Path::new(&format!("/run/netns/bp-{}-1", h.fabric)).exists());
    h.assert_nothing_left();
}

#[test]
fn a_sender_to_a_host_that_dies_gets_an_error_not_a_hang() {
    if let Some(r) = role() {
        cross_host_role(&r);
        return;
    }
    if !root() {
        return;
    }
    let h = Hosts::odd_even("hosts_dgram_dies", 16);
    let test_fn = "a_sender_to_a_host_that_dies_gets_an_error_not_a_hang";
    host_dies_under_a_sender(&h, test_fn, ("stream_receiver", "stream_sender"), 1000);
}

/// Runs `roles` (receiver on node 2 of host 1, sender on node 1 of host 0); once node 2 took
/// more than `taken` datagrams (and a moment more), kills host 1's supervisor: the sender
/// must end with an error, not hang, and nothing is left.
fn host_dies_under_a_sender(h: &Hosts, test_fn: &str, roles: (&str, &str), taken: u64) {
    let rx = h.spawn_role(1, test_fn, roles.0);
    let tx = h.spawn_role(0, test_fn, roles.1);
    let flowing = wait_for(Duration::from_secs(30), || {
        (h.status(1)["slots"][1]["rx_msgs"].as_u64().unwrap_or(0) >= taken).then_some(())
    });
    assert!(flowing.is_some(), "no traffic across: {}", h.status(1));
    // (A stalled receiver's sender is then inside a send whose bytes the kernel does not take.)
    std::thread::sleep(Duration::from_millis(700));
    h.kill_supervisor(1);
    assert!(finish(tx, "the sender").success(), "the sender failed");
    let _ = finish(rx, "the receiver");
    h.down(1);
    h.down(0);
    h.assert_nothing_left();
}

/// Datagrams the stalled receiver reads before it stops.
const STALL_AFTER: u64 = 1500;

#[test]
fn a_sender_whose_bytes_a_stalled_receiver_leaves_in_tcp_gets_an_error_when_its_host_dies() {
    if let Some(r) = role() {
        cross_host_role(&r);
        return;
    }
    if !root() {
        return;
    }
    let h = Hosts::odd_even("hosts_dgram_stall", 26);
    let test_fn =
        "a_sender_whose_bytes_a_stalled_receiver_leaves_in_tcp_gets_an_error_when_its_host_dies";
    let roles = ("stalled_receiver", "lending_sender");
    host_dies_under_a_sender(&h, test_fn, roles, STALL_AFTER);
}

#[test]
fn without_ucx_tls_ucx_picks_the_transport_and_datagrams_still_cross() {
    if let Some(r) = role() {
        cross_host_role(&r);
        return;
    }
    if !root() {
        return;
    }
    // UCX may pick shared memory here (the "hosts" share a kernel); whatever it picks is
    // shown and carries the same traffic.
    let h = Hosts::odd_even_over("hosts_any_tl", 17, None);
    let tl = h.host_state(0, "h1")["transport"].clone();
    eprintln!("UCX chose {tl} between the hosts");
    assert!(tl.as_array().is_some_and(|t| !t.is_empty()), "{tl}");
    let test_fn = "without_ucx_tls_ucx_picks_the_transport_and_datagrams_still_cross";
    let rx = h.spawn_role(1, test_fn, "receiver");
    let tx = h.spawn_role(0, test_fn, "sender");
    assert!(finish(tx, "the sender").success(), "the sender failed");
    assert!(finish(rx, "the receiver").success(), "the receiver failed");
    h.down(1);
    h.down(0);
    h.assert_nothing_left();
}

#[test]
fn unmodified_pingpongs_ud_rc_and_uc_run_between_nodes_of_two_hosts() {
    if !have("ibv_ud_pingpong") || !root() {
        return;
    }
    lib_built("libibverbs.so", "backplane-ibverbs");
    // The default 64 MiB windows: ibv_srq_pingpong's 16 QPs have 512 KiB rings.
    let h = Hosts::odd_even_with("hosts_verbs_ud", 18, Some("tcp"), &["--window-size", "64M"]);
    let pair = |prog: &str, port: &str, extra: &[&str]| {
        let mut a = vec!["-g", "0"];
        a.extend_from_slice(extra);
        verbs_pair(&h, prog, port, &a)
    };
    // Polled, and with completion events (the worker's waker rings the endpoint's doorbell).
    for (port, extra) in [
        ("18791", &["-n", "300", "-c"][..]),
        ("18798", &["-n", "100", "-c", "-e"][..]),
    ] {
        let (c, s) = pair("ibv_ud_pingpong", port, extra);
        both_ended_well(&format!("ibv_ud_pingpong {extra:?}"), &c, &s);
        for o in [&c, &s] {
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(out.contains(&format!("{} iters in", extra[1])), "{out}");
        }
    }
    // RC and UC (direct: each process carries its pair): the programs check every byte
    // (`-c`), with completion events (`-e`), large messages and the 16 QPs of
    // ibv_srq_pingpong.
    for (prog, port, extra) in [
        // Its 16 RC QPs, 32 datagram routes between the hosts: with a fabric's ring per
        // route (4 MiB) the server's 9th QP found node 1's window full. The programs after
        // it start at once, while most of both windows is what it freed (quarantined for a
        // second: their QPs wait for it rather than fail).
        ("ibv_srq_pingpong", "18796", &["-n", "300", "-c"][..]),
        ("ibv_rc_pingpong", "18792", &["-n", "500", "-c"][..]),
        ("ibv_rc_pingpong", "18793", &["-n", "100", "-c", "-e"][..]),
        (
            "ibv_rc_pingpong",
            "18794",
            &["-n", "20", "-c", "-s", "1048576"][..],
        ),
        // 32 KiB: one fragment, sent from the program's buffer in place (session 29).
        (
            "ibv_rc_pingpong",
            "18798",
            &["-n", "200", "-c", "-s", "32768"][..],
        ),
        ("ibv_uc_pingpong", "18795", &["-n", "300", "-c"][..]),
        ("ibv_uc_pingpong", "18797", &["-n", "100", "-c", "-e"][..]),
    ] {
        let (c, s) = pair(prog, port, extra);
        let iters = extra[1];
        both_ended_well(&format!("{prog} {extra:?}"), &c, &s);
        for (who, o) in [("client", &c), ("server", &s)] {
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(out.contains(&format!("{iters} iters in")), "{out}");
            // Nothing they call is missing (they look up their device's index).
            assert!(
                !stderr(o).contains("not offered"),
                "{prog} {who}: {}",
                stderr(o)
            );
            eprintln!("{prog} {extra:?} {who}: {}", out.trim());
        }
    }
    h.down(1);
    h.down(0);
    h.assert_nothing_left();
}

/// Runs an unmodified verbs program between node 2 (host h1, the server, started first)
/// and node 1 (host h0, the client, retried until the server listens), with `-p port` and
/// `args`; a hang fails after 60 s. The client's and the server's outputs.
fn verbs_pair(h: &Hosts, prog: &str, port: &str, args: &[&str]) -> (Output, Output) {
    verbs_pair_with(h, &[], prog, port, args)
}

/// [`verbs_pair`] with more `exec` flags.
fn verbs_pair_with(
    h: &Hosts,
    flags: &[&str],
    prog: &str,
    port: &str,
    args: &[&str],
) -> (Output, Output) {
    verbs_pair_to(h, flags, (prog, port, args), &h.addr(1))
}

/// [`verbs_pair`] between the nodes' own namespaces, the client reaching the server at its
/// node's name (`bp0`, IP over the fabric across the hosts).
fn verbs_pair_node_ns(h: &Hosts, prog: &str, port: &str, args: &[&str]) -> (Output, Output) {
    verbs_pair_to(h, &[], (prog, port, args), "node2")
}

/// [`verbs_pair_with`], the client reaching the server's exchange at `addr`.
fn verbs_pair_to(
    h: &Hosts,
    flags: &[&str],
    (prog, port, args): (&str, &str, &[&str]),
    addr: &str,
) -> (Output, Output) {
    verbs_pair_env(h, flags, &[], (prog, port, args), addr)
}

/// [`verbs_pair_to`] with environment variables (`NAME=value`) for both programs.
fn verbs_pair_env(
    h: &Hosts,
    flags: &[&str],
    env: &[&str],
    (prog, port, args): (&str, &str, &[&str]),
    addr: &str,
) -> (Output, Output) {
    // The programs exchange their addresses over TCP between the hosts' own addresses, then
    // talk through the fabric.
    let on = |node: &'static str| {
        let mut a = vec!["exec", "--name", &h.fabric, "--verbs"];
        a.extend_from_slice(flags);
        a.extend_from_slice(&[node, "--", "env"]);
        a.extend_from_slice(env);
        a.extend_from_slice(&["timeout", "60", prog, "-p", port]);
        a.extend_from_slice(args);
        a
    };
    let a = on("2");
    let server = h
        .in_host(1)
        .arg(format!("BACKPLANE_RUN_DIR={}", h.run_dir(1).display()))
        .arg(BIN)
        .args(&a)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut c = on("1");
    c.push(addr);
    let client = wait_for(Duration::from_secs(20), || {
        let o = h.bp(0, &c);
        // Until the server listens: the client's "Couldn't connect" (both kinds),
        // "Unable to open file descriptor" (perftest) or "connect() failed" (ucx_perftest,
        // which logs to stdout).
        let e = stderr(&o) + &String::from_utf8_lossy(&o.stdout);
        let early = e.contains("Couldn't connect")
            || e.contains("Unable to open file descriptor")
            || e.contains("connect() failed");
        (o.status.success() || !early).then_some(o)
    })
    .expect("the client never reached the server");
    let server = server.wait_with_output().unwrap();
    (client, server)
}

/// Both ends of a [`verbs_pair`] exited 0 (else their output in the failure).
fn both_ended_well(what: &str, client: &Output, server: &Output) {
    for (who, o) in [("client", client), ("server", server)] {
        assert!(
            o.status.success(),
            "{what} {who}: {}{} (the {}: {}{})",
            String::from_utf8_lossy(&o.stdout),
            stderr(o),
            if who == "client" { "server" } else { "client" },
            String::from_utf8_lossy(&[client, server][usize::from(who == "client")].stdout),
            stderr([client, server][usize::from(who == "client")])
        );
    }
}

/// perftest's eight programs between a node of each host (their pairs carried by the two
/// processes, the default): each ends well and reports its 200 iterations. (They found two
/// faults the tests of our own API did not: a WRITE refused because the peer's access flags
/// had not crossed yet, and a program that polls memory left to a thread that slept 5 ms.)
#[test]
fn perftest_runs_every_rdma_operation_between_nodes_of_two_hosts() {
    if !have("ib_write_bw") || !root() {
        return;
    }
    lib_built("libibverbs.so", "backplane-ibverbs");
    let h = Hosts::odd_even("hosts_perftest", 25);
    for (i, prog) in PERFTEST.into_iter().enumerate() {
        let port = (18830 + i).to_string();
        let (c, s) = verbs_pair(&h, prog, &port, &["-n", "200"]);
        both_ended_well(prog, &c, &s);
        let out = String::from_utf8_lossy(&c.stdout);
        assert!(
            out.contains(" 200 "),
            "{prog} ran its 200 iterations: {out}"
        );
        eprintln!("{prog}: {}", out.lines().rev().nth(1).unwrap_or("").trim());
    }
    // UC (carried directly like RC since session 25), UD (datagrams straight from the QP's
    // own UCX worker since session 25), and completion events: `ib_send_lat
    // -e` polls once per event, so an event must have a completion behind it.
    for (i, (prog, args)) in [
        ("ib_send_lat", &["-n", "200", "-c", "UC"][..]),
        ("ib_send_lat", &["-n", "200", "-c", "UD"][..]),
        ("ib_write_bw", &["-n", "200", "-c", "UC"][..]),
        ("ib_send_lat", &["-n", "500", "-e"][..]),
    ]
    .into_iter()
    .enumerate()
    {
        let port = (18850 + i).to_string();
        let (c, s) = verbs_pair(&h, prog, &port, args);
        both_ended_well(&format!("{prog} {args:?}"), &c, &s);
        let out = String::from_utf8_lossy(&c.stdout);
        assert!(
            out.contains(&format!(" {} ", args[1])),
            "{prog} {args:?}: {out}"
        );
        eprintln!(
            "{prog} {args:?}: {}",
            out.lines().rev().nth(1).unwrap_or("").trim()
        );
    }
    h.down(1);
    h.down(0);
    h.assert_nothing_left();
}

const RDMA_CM_PORT: u32 = 4791;
/// Takes the next completion a predicate wants (keeping the others for later).
type Take<'a> = dyn FnMut(&dyn Fn(&backplane::verbs::Wc) -> bool) -> backplane::verbs::Wc + 'a;
const RDMA_ALL: u32 = 0b1111; // LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC

/// The server of the cross-host verbs test (node 2, host h1): offers a 1 MiB region with a
/// pattern; answers "ping" with "pong"; "check N" with whether the first N bytes of the region
/// hold the client's second pattern (a WRITE posted just before the SEND must be there); a
/// WRITE_WITH_IMM with whether its bytes are 0xEE; ends a while after "last".
/// The client (node 1, host h0) checks READ data, atomics, and that a bad rkey is
/// REM_ACCESS_ERR.
fn rdma_role(role: &str) {
    use backplane::fabric::Fabric;
    use backplane::verbs::cm::{self, ConnParam};
    use backplane::verbs::*;
    let all = AccessFlags::from_bits_retain(RDMA_ALL);
    let f = Fabric::attach(&std::env::var("BP_FABRIC").unwrap()).unwrap();
    let pattern = |seed: usize, n: usize| -> Vec<u8> {
        (0..n).map(|i| ((i * 7 + seed) % 251) as u8).collect()
    };
    let end = Instant::now() + Duration::from_secs(60);
    match role {
        "rdma_server" => {
            let ctx = Context::open(&f.node(2).unwrap()).unwrap();
            let pd = ctx.alloc_pd();
            let cq = ctx.create_cq(64, None).unwrap();
            let qp = pd
                .create_qp(&QpInitAttr::new(QpType::Rc, &cq, &cq))
                .unwrap();
            let ctl = pd.alloc_mr(64 * 16, AccessFlags::LOCAL_WRITE).unwrap();
            let mr = pd.alloc_mr(1 << 20, all).unwrap();
            mr.write(0, &pattern(1, 1 << 20)).unwrap();
            // A second region, deregistered when the client says "drop2".
            let mut mr2 = Some(pd.alloc_mr(64 << 10, all).unwrap());
            cm::init_qp(&qp, &ConnParam::default()).unwrap();
            for i in 0..16 {
                qp.post_recv(&[RecvWr {
                    wr_id: i,
                    sg_list: &[ctl.sge(i * 64, 64)],
                }])
                .unwrap();
            }
            let mut l = cm::Listener::bind(&ctx, RDMA_CM_PORT).unwrap();
            let offer = ConnParam {
                rkey: mr.rkey(),
                len: mr.len() as u64,
                ..ConnParam::default()
            };
            l.accept(&qp, &offer, Some(Duration::from_secs(30)))
                .unwrap();
            let mut wc = [Wc::default(); 4];
            loop {
                assert!(Instant::now() < end, "server: no word from the client");
                let n = cq.poll(&mut wc);
                for w in &wc[..n] {
                    assert_eq!(w.status, WcStatus::Success, "server: {w:?}");
                    if w.opcode == WcOpcode::Send {
                        continue;
                    }
                    let reply: Vec<u8> = if w.opcode == WcOpcode::RecvRdmaWithImm {
                        let ok = mr.to_vec(0, w.imm_data as usize).unwrap();
                        if ok.iter().all(|&b| b == 0xEE) {
                            b"imm-ok".to_vec()
                        } else {
                            b"imm-bad".to_vec()
                        }
                    } else {
                        let msg = ctl.to_vec(w.wr_id * 64, w.byte_len as usize).unwrap();
                        let msg = String::from_utf8_lossy(&msg).to_string();
                        if msg == "ping" {
                            b"pong".to_vec()
                        } else if msg == "rkey2" {
                            format!("{}", mr2.as_ref().map_or(0, |m| m.rkey())).into_bytes()
                        } else if msg == "drop2" {
                            mr2 = None;
                            b"dropped".to_vec()
                        } else if msg == "last" {
                            // The client's last check (a bad rkey) follows: stay registered
                            // while it runs, then go.
                            qp.post_send(&[SendWr::send_inline(1000, b"ok").signaled()])
                                .unwrap();
                            std::thread::sleep(Duration::from_secs(3));
                            return;
                        } else if let Some(n) = msg.strip_prefix("check ") {
                            let n: usize = n.parse().unwrap();
                            let ok = mr.to_vec(0, n).unwrap() == pattern(2, n);
                            format!("check {ok}").into_bytes()
                        } else {
                            b"what?".to_vec()
                        }
                    };
                    qp.post_recv(&[RecvWr {
                        wr_id: w.wr_id,
                        sg_list: &[ctl.sge(w.wr_id * 64, 64)],
                    }])
                    .unwrap();
                    qp.post_send(&[SendWr::send_inline(1000, &reply).signaled()])
                        .unwrap();
                }
            }
        }
        "rdma_client" => {
            let ctx = Context::open(&f.node(1).unwrap()).unwrap();
            let pd = ctx.alloc_pd();
            let cq = ctx.create_cq(64, None).unwrap();
            let eps = || f.status().unwrap().slots[0].endpoints;
            let before = eps();
            let qp = pd
                .create_qp(&QpInitAttr::new(QpType::Rc, &cq, &cq))
                .unwrap();
            // A QP whose process carries its pair itself binds an endpoint of its own.
            let direct = std::env::var("BACKPLANE_DIRECT_QP").map_or(true, |v| v != "0");
            assert_eq!(eps(), before + u32::from(direct), "direct: {direct}");
            let mr = pd.alloc_mr(1 << 20, all).unwrap();
            cm::init_qp(&qp, &ConnParam::default()).unwrap();
            for i in 0..8 {
                qp.post_recv(&[RecvWr {
                    wr_id: 100 + i,
                    sg_list: &[mr.sge(900_000 + i * 64, 64)],
                }])
                .unwrap();
            }
            // The server binds when its process is up: connect until it answers.
            let peer = wait_for(Duration::from_secs(30), || {
                cm::connect(
                    &ctx,
                    2,
                    RDMA_CM_PORT,
                    &qp,
                    &ConnParam::default(),
                    Duration::from_secs(2),
                )
                .ok()
            })
            .expect("the server never answered the connect");
            let rkey = peer.rkey;
            let mut stash: Vec<Wc> = Vec::new();
            let mut take = |want: &dyn Fn(&Wc) -> bool| -> Wc {
                if let Some(i) = stash.iter().position(want) {
                    return stash.remove(i);
                }
                let mut wc = [Wc::default()];
                loop {
                    assert!(Instant::now() < end, "client: no completion");
                    if cq.poll(&mut wc) == 1 {
                        if want(&wc[0]) {
                            return wc[0];
                        }
                        stash.push(wc[0]);
                    }
                }
            };
            let say = |msg: &[u8], take: &mut Take<'_>| -> Vec<u8> {
                qp.post_send(&[SendWr::send_inline(7, msg).signaled()])
                    .unwrap();
                assert_eq!(take(&|w| w.wr_id == 7).status, WcStatus::Success);
                let w = take(&|w| w.opcode == WcOpcode::Recv);
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
                let o = 900_000 + (w.wr_id - 100) * 64;
                let r = mr.to_vec(o, w.byte_len as usize).unwrap();
                qp.post_recv(&[RecvWr {
                    wr_id: w.wr_id,
                    sg_list: &[mr.sge(o, 64)],
                }])
                .unwrap();
                r
            };
            assert_eq!(say(b"ping", &mut take), b"pong");
            for _ in 0..20 {
                assert_eq!(say(b"ping", &mut take), b"pong");
            }
            // Carried by this process, the answers went from the messages that brought them
            // straight into the posted receives (not through the QP's ring): a poll that found
            // the queue empty pumped the pair and its engine took them.
            if direct {
                assert!(
                    backplane::verbs::sends_delivered_in_place() > 0,
                    "no SEND delivered in place"
                );
                // This program out of the library for a second, its pair idle: the pair's
                // thread sleeps until something comes (the worker's fd, or the endpoint's
                // eventfd for what another look took off the wire), not a look every millisecond
                // (~1 000 wake-ups a second before session 51).
                std::thread::sleep(Duration::from_millis(300));
                let before = context_switches(u64::from(std::process::id()));
                std::thread::sleep(Duration::from_secs(1));
                let woke = context_switches(u64::from(std::process::id())) - before;
                eprintln!("an idle pair: this process switched {woke} times in 1 s");
                assert!(
                    woke < 300,
                    "an idle pair's process woke {woke} times in 1 s"
                );
            }
            // READ across several pieces, every byte.
            let n = 300_000u32;
            qp.post_send(&[SendWr::read(1, &[mr.sge(0, n)], 4096, rkey).signaled()])
                .unwrap();
            assert_eq!(take(&|w| w.wr_id == 1).status, WcStatus::Success);
            let want = pattern(1, 4096 + n as usize);
            assert!(
                mr.to_vec(0, n as usize).unwrap() == want[4096..],
                "READ data"
            );
            // A WRITE, not signaled, then a SEND at once: the server must see the WRITE.
            let n2 = 200_000usize;
            mr.write(0, &pattern(2, n2)).unwrap();
            qp.post_send(&[SendWr::write(2, &[mr.sge(0, n2 as u32)], 0, rkey)])
                .unwrap();
            assert_eq!(
                say(format!("check {n2}").as_bytes(), &mut take),
                b"check true"
            );
            // A pair this process carries sends that WRITE's 4 pieces from `mr` in place.
            let in_place = backplane::transport::across::sent_in_place();
            assert_eq!(in_place, if direct { 4 } else { 0 }, "direct: {direct}");
            // WRITE_WITH_IMM, and the atomics on what the WRITE left.
            mr.fill(0, 100, 0xEE).unwrap();
            qp.post_send(&[
                SendWr::write(3, &[mr.sge(0, 100)], 0, rkey)
                    .with_imm(100)
                    .signaled(),
                SendWr::fetch_add(4, &[mr.sge(8192, 8)], 512, rkey, 5).signaled(),
            ])
            .unwrap();
            assert_eq!(take(&|w| w.wr_id == 3).status, WcStatus::Success);
            assert_eq!(take(&|w| w.wr_id == 4).status, WcStatus::Success);
            let old = u64::from_le_bytes(mr.to_vec(8192, 8).unwrap().try_into().unwrap());
            let at512 = u64::from_le_bytes(pattern(2, 520)[512..520].try_into().unwrap());
            assert_eq!(old, at512, "FETCH_ADD's old value");
            let w = take(&|w| w.opcode == WcOpcode::Recv);
            let o = 900_000 + (w.wr_id - 100) * 64;
            assert_eq!(mr.to_vec(o, w.byte_len as usize).unwrap(), b"imm-ok");
            qp.post_recv(&[RecvWr {
                wr_id: w.wr_id,
                sg_list: &[mr.sge(o, 64)],
            }])
            .unwrap();
            qp.post_send(&[
                SendWr::cmp_swap(5, &[mr.sge(8192, 8)], 512, rkey, at512 + 5, 42).signaled(),
            ])
            .unwrap();
            assert_eq!(take(&|w| w.wr_id == 5).status, WcStatus::Success);
            let old = u64::from_le_bytes(mr.to_vec(8192, 8).unwrap().try_into().unwrap());
            assert_eq!(old, at512 + 5, "CMP_SWAP's old value (after the add)");
            qp.post_send(&[SendWr::read(6, &[mr.sge(8192, 8)], 512, rkey).signaled()])
                .unwrap();
            assert_eq!(take(&|w| w.wr_id == 6).status, WcStatus::Success);
            assert_eq!(mr.to_vec(8192, 8).unwrap(), 42u64.to_le_bytes(), "swapped");
            // Several READs and atomics outstanding at once, as a NIC keeps them (each
            // waited for its answer in `post_send` before session 25): eight READs of 4 KiB
            // from different places and four FETCH_ADDs of one word, posted in one call,
            // complete in order, each with its own data.
            let mut wrs = Vec::new();
            for k in 0..8u64 {
                let sge = [mr.sge(400_000 + k * 4096, 4096)];
                wrs.push((k, sge));
            }
            let mut posted: Vec<SendWr<'_>> = wrs
                .iter()
                .map(|(k, sge)| SendWr::read(20 + k, sge, 4096 + k * 8192, rkey).signaled())
                .collect();
            let words: Vec<_> = (0..4u64).map(|k| [mr.sge(450_000 + k * 8, 8)]).collect();
            for (k, sge) in words.iter().enumerate() {
                posted.push(SendWr::fetch_add(30 + k as u64, sge, 512, rkey, 1).signaled());
            }
            qp.post_send(&posted).unwrap();
            let order: Vec<u64> = (0..12)
                .map(|_| {
                    let w = take(&|w| (20..34).contains(&w.wr_id));
                    assert_eq!(w.status, WcStatus::Success, "{w:?}");
                    w.wr_id
                })
                .collect();
            assert_eq!(
                order,
                [20, 21, 22, 23, 24, 25, 26, 27, 30, 31, 32, 33],
                "in order"
            );
            let p2 = pattern(2, n2);
            for k in 0..8usize {
                let at = 4096 + k * 8192;
                let got = mr.to_vec(400_000 + k as u64 * 4096, 4096).unwrap();
                assert!(got == p2[at..at + 4096], "READ {k}'s data");
            }
            for k in 0..4u64 {
                let old =
                    u64::from_le_bytes(mr.to_vec(450_000 + k * 8, 8).unwrap().try_into().unwrap());
                assert_eq!(old, 42 + k, "FETCH_ADD {k}'s old value");
            }
            // DMA jobs (no QP) on the server's region, two engines splitting the pieces.
            let rkey2 = String::from_utf8(say(b"rkey2", &mut take)).unwrap();
            let rkey2: u32 = rkey2.parse().unwrap();
            let dma = dma_across_hosts(&ctx, &mr, rkey, rkey2, &pattern);
            assert_eq!(say(b"check 250000", &mut take), b"check true");
            // A region deregistered by its owner after the grant: a job's WRITE to it fails
            // (it completes only once the owner's host answered), and so does a READ.
            assert_eq!(say(b"drop2", &mut take), b"dropped");
            dma(10, rkey2, true, backplane::dma::DmaStatus::RegionGone);
            dma(11, rkey2, false, backplane::dma::DmaStatus::RegionGone);
            // An rkey the server never registered: the owner's host refuses it.
            assert_eq!(say(b"last", &mut take), b"ok");
            qp.post_send(&[SendWr::write(9, &[mr.sge(0, 8)], 0, rkey ^ 0x5a5a).signaled()])
                .unwrap();
            assert_eq!(take(&|w| w.wr_id == 9).status, WcStatus::RemAccessErr);
        }
        "loss_server" | "loss_client" => rdma_loss_role(role, &f),
        _ => unreachable!(),
    }
}

/// The DMA part of the cross-host verbs client: node 2's region `rkey` (1 MiB, pattern 1 from
/// 300 000 on) read into `mr` by one job, pattern 2 written over its first 250 000 bytes by
/// a job of two segments (the server checks them after), an unknown rkey refused, a WRITE to
/// region `rkey2` (64 KiB). Returns a way to run more jobs: (id, rkey, write?) one 8-byte
/// segment between `mr` and that region of node 2, its status checked.
fn dma_across_hosts<'a>(
    ctx: &backplane::verbs::Context,
    mr: &'a backplane::verbs::Mr,
    rkey: u32,
    rkey2: u32,
    pattern: &dyn Fn(usize, usize) -> Vec<u8>,
) -> impl Fn(u64, u32, bool, backplane::dma::DmaStatus) + 'a {
    use backplane::dma::*;
    let cfg = DmaConfig {
        engines: 2,
        ..DmaConfig::default()
    };
    let engines = DmaEngines::start(&cfg).unwrap();
    let q = DmaQueue::new(ctx, &engines, 16);
    let run = move |id: u64, segs: &[Segment]| -> DmaWc {
        q.submit(&Job::new(id, segs)).unwrap();
        assert_eq!(q.wait(1, Some(Duration::from_secs(30))), 1, "job {id}");
        let mut wc = [DmaWc::default(); 1];
        assert_eq!(q.poll(&mut wc), 1);
        wc[0]
    };
    let remote = Mem::Remote { node: 2, rkey };
    let (from, n) = (300_000u64, (1 << 20) - 300_000u64);
    let read = [Segment {
        src: remote,
        src_off: from,
        dst: Mem::local(mr),
        dst_off: 0,
        len: n,
    }];
    let wc = run(1, &read);
    assert!(wc.status.is_ok(), "DMA read: {wc:?}");
    assert_eq!(wc.bytes, n);
    let want = pattern(1, 1 << 20);
    assert!(
        mr.to_vec(0, n as usize).unwrap() == want[from as usize..],
        "DMA read data"
    );
    mr.write(0, &pattern(2, 250_000)).unwrap();
    let half = 125_000;
    let write = [0, half].map(|at| Segment {
        src: Mem::local(mr),
        src_off: at,
        dst: remote,
        dst_off: at,
        len: half,
    });
    let wc = run(2, &write);
    assert!(wc.status.is_ok(), "DMA write: {wc:?}");
    let one = move |id: u64, rkey: u32, write: bool, want: DmaStatus| {
        let _keep = &engines; // the engines run as long as the queue is used
        let (local, remote) = (Mem::local(mr), Mem::Remote { node: 2, rkey });
        let (src, dst) = if write {
            (local, remote)
        } else {
            (remote, local)
        };
        let seg = Segment {
            src,
            src_off: 0,
            dst,
            dst_off: 0,
            len: 8,
        };
        let wc = run(id, &[seg]);
        assert_eq!(wc.status, want, "{wc:?}");
    };
    one(3, rkey ^ 0x5a5a, false, DmaStatus::NoGrant);
    one(4, rkey2, true, DmaStatus::Success);
    one
}

/// A host of another version, as far as its join says (`old_host ADDR`): joins the
/// supervisor at ADDR with protocol 99 and version 0.0.1 and expects a refusal naming them.
fn old_host_role(role: &str) {
    use backplane::fabric::hosts::HostMsg;
    use backplane_ucx::{Event, Link};
    let addr: std::net::SocketAddr = role.strip_prefix("old_host ").unwrap().parse().unwrap();
    let join = HostMsg::Join {
        protocol: 99,
        version: "0.0.1".into(),
        fabric: std::env::var("BP_FABRIC").unwrap(),
        host: "h1".into(),
        window_size: 8 << 20,
        net: None,
        link: None,
        hosts: Vec::new(),
    };
    let mut link = Link::open(None).unwrap();
    let ep = link.connect(addr).unwrap();
    link.send(ep, &join.encode()).unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < end, "no answer to the join");
        for ev in link.poll() {
            if let Event::Message(_, m) = ev {
                match HostMsg::decode(&m) {
                    Ok(HostMsg::Refuse { reason }) => {
                        assert!(
                            reason.contains("runs backplane 0.0.1 (host protocol 99)")
                                && reason.contains("run the same version on every host"),
                            "{reason}"
                        );
                        return;
                    }
                    other => panic!("not a refusal: {other:?}"),
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The marker file the loss client makes once its QP talks to the other host.
fn loss_marker(fabric: &str) -> PathBuf {
    std::env::temp_dir().join(format!("bp-{fabric}-rc-talking"))
}

/// A ping-pong over RC between hosts until the server's host goes: the client's SEND then
/// completes with RETRY_EXC_ERR (its peer is gone with the host), within seconds.
fn rdma_loss_role(role: &str, f: &backplane::fabric::Fabric) {
    use backplane::verbs::cm::{self, ConnParam};
    use backplane::verbs::*;
    let slot = if role == "loss_server" { 2 } else { 1 };
    let ctx = Context::open(&f.node(slot).unwrap()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let qp = pd
        .create_qp(&QpInitAttr::new(QpType::Rc, &cq, &cq))
        .unwrap();
    let mr = pd.alloc_mr(64 * 16, AccessFlags::LOCAL_WRITE).unwrap();
    cm::init_qp(&qp, &ConnParam::default()).unwrap();
    for i in 0..16 {
        qp.post_recv(&[RecvWr {
            wr_id: i,
            sg_list: &[mr.sge(i * 64, 64)],
        }])
        .unwrap();
    }
    let mine = ConnParam::default();
    if role == "loss_server" {
        let mut l = cm::Listener::bind(&ctx, RDMA_CM_PORT).unwrap();
        l.accept(&qp, &mine, Some(Duration::from_secs(30))).unwrap();
    } else {
        wait_for(Duration::from_secs(30), || {
            cm::connect(&ctx, 2, RDMA_CM_PORT, &qp, &mine, Duration::from_secs(2)).ok()
        })
        .expect("the server never answered the connect");
    }
    let mut wc = [Wc::default(); 4];
    let mut pongs = 0u64;
    let mut since: Option<Instant> = None;
    if role == "loss_client" {
        qp.post_send(&[SendWr::send_inline(1, b"ping").signaled()])
            .unwrap();
    }
    loop {
        let n = cq.poll(&mut wc);
        for w in &wc[..n] {
            if w.status != WcStatus::Success {
                assert_eq!(role, "loss_client", "server: {w:?}");
                let took = since.expect("a failure before the host was lost").elapsed();
                eprintln!(
                    "client: {:?} {took:?} after it said it talked (the server's host was cut \
                     then; the QP: {:?})",
                    w.status,
                    qp.fatal_error()
                );
                assert_eq!(w.status, WcStatus::RetryExcErr, "{w:?}");
                assert!(took < Duration::from_secs(5), "{took:?}");
                return;
            }
            if w.opcode != WcOpcode::Recv {
                continue;
            }
            qp.post_recv(&[RecvWr {
                wr_id: w.wr_id,
                sg_list: &[mr.sge(w.wr_id * 64, 64)],
            }])
            .unwrap();
            pongs += 1;
            if pongs == 100 && role == "loss_client" {
                std::fs::write(loss_marker(f.name()), b"").unwrap();
            }
            if since.is_none() && loss_marker(f.name()).exists() && pongs > 100 {
                since = Some(Instant::now());
            }
            let reply: &[u8] = if role == "loss_client" {
                b"ping"
            } else {
                b"pong"
            };
            qp.post_send(&[SendWr::send_inline(1, reply).signaled()])
                .unwrap();
        }
    }
}

/// DMA jobs from node 1 (h0) into a region of node 2 (h1) until h1 is lost: the first job
/// that fails says `NodeDown`, within seconds of the loss (`dma_loss_client`); the server
/// only offers the region (`dma_loss_server`).
fn dma_loss_role(role: &str, f: &backplane::fabric::Fabric) {
    use backplane::dma::*;
    use backplane::verbs::cm::{self, ConnParam};
    use backplane::verbs::*;
    let server = role == "dma_loss_server";
    let ctx = Context::open(&f.node(if server { 2 } else { 1 }).unwrap()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(8, None).unwrap();
    let qp = pd
        .create_qp(&QpInitAttr::new(QpType::Rc, &cq, &cq))
        .unwrap();
    let mr = pd
        .alloc_mr(64 << 10, AccessFlags::from_bits_retain(RDMA_ALL))
        .unwrap();
    cm::init_qp(&qp, &ConnParam::default()).unwrap();
    if server {
        let offer = ConnParam {
            rkey: mr.rkey(),
            len: mr.len() as u64,
            ..ConnParam::default()
        };
        let mut l = cm::Listener::bind(&ctx, RDMA_CM_PORT).unwrap();
        l.accept(&qp, &offer, Some(Duration::from_secs(30)))
            .unwrap();
        std::thread::sleep(Duration::from_secs(60)); // until its host is killed
        return;
    }
    let peer = wait_for(Duration::from_secs(30), || {
        let mine = ConnParam::default();
        cm::connect(&ctx, 2, RDMA_CM_PORT, &qp, &mine, Duration::from_secs(2)).ok()
    })
    .expect("the server never answered the connect");
    let engines = DmaEngines::start(&DmaConfig::default()).unwrap();
    let q = DmaQueue::new(&ctx, &engines, 4);
    let seg = [Segment {
        src: Mem::local(&mr),
        src_off: 0,
        dst: Mem::Remote {
            node: 2,
            rkey: peer.rkey,
        },
        dst_off: 0,
        len: 64 << 10,
    }];
    let marker = loss_marker(f.name());
    let end = Instant::now() + Duration::from_secs(60);
    let mut since: Option<Instant> = None;
    for id in 0.. {
        assert!(Instant::now() < end, "no job failed");
        q.submit(&Job::new(id, &seg)).unwrap();
        assert_eq!(
            q.wait(1, Some(Duration::from_secs(30))),
            1,
            "job {id} never completed"
        );
        let mut wc = [DmaWc::default(); 1];
        assert_eq!(q.poll(&mut wc), 1);
        if !wc[0].status.is_ok() {
            let took = since.expect("a failure before the host was lost").elapsed();
            eprintln!(
                "client: job {id} {} {took:?} after it said it wrote",
                wc[0].status
            );
            assert_eq!(wc[0].status, DmaStatus::NodeDown, "{:?}", wc[0]);
            assert!(took < Duration::from_secs(5), "{took:?}");
            return;
        }
        if id == 20 {
            std::fs::write(&marker, b"").unwrap();
            since = Some(Instant::now());
        }
    }
}

#[test]
fn a_dma_job_into_a_host_that_is_lost_fails_with_node_down() {
    if let Some(r) = role() {
        let f = backplane::fabric::Fabric::attach(&std::env::var("BP_FABRIC").unwrap()).unwrap();
        dma_loss_role(&r, &f);
        return;
    }
    if !root() {
        return;
    }
    host_lost_under_a_client(
        ("hosts_dma_loss", 21),
        "a_dma_job_into_a_host_that_is_lost_fails_with_node_down",
        "dma_loss",
    );
}

/// Two hosts; role `{roles}_server` on h1, `{roles}_client` on h0; once the client made the
/// loss marker, h1's supervisor is killed: the client must then end well (it checks how its
/// work failed); nothing is left.
fn host_lost_under_a_client(fabric: (&str, u8), test_fn: &str, roles: &str) {
    let h = Hosts::odd_even(fabric.0, fabric.1);
    let marker = loss_marker(&h.fabric);
    let _ = std::fs::remove_file(&marker);
    let mut server = h.spawn_role(1, test_fn, &format!("{roles}_server"));
    let client = h.spawn_role(0, test_fn, &format!("{roles}_client"));
    let started = wait_for(Duration::from_secs(30), || marker.exists().then_some(()));
    assert!(started.is_some(), "the client never got going");
    h.kill_supervisor(1);
    let ok = finish(client, "the client").success();
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_file(&marker);
    assert!(ok, "the client failed");
    h.down(1);
    h.down(0);
    h.assert_nothing_left();
}

#[test]
fn an_rc_peer_whose_host_is_lost_fails_outstanding_work_with_retry_exc_err() {
    if let Some(r) = role() {
        rdma_role(&r);
        return;
    }
    if !root() {
        return;
    }
    host_lost_under_a_client(
        ("hosts_rc_loss", 20),
        "an_rc_peer_whose_host_is_lost_fails_outstanding_work_with_retry_exc_err",
        "loss",
    );
}

#[test]
fn rdma_write_read_and_atomics_reach_a_region_on_another_host_in_order_with_sends() {
    if let Some(r) = role() {
        rdma_role(&r);
        return;
    }
    if !root() {
        return;
    }
    rdma_between_two_hosts(
        ("hosts_rdma", 19),
        "rdma_write_read_and_atomics_reach_a_region_on_another_host_in_order_with_sends",
        &["BACKPLANE_DIRECT_QP=0"],
    );
}

/// The same, with the pair carried by the two processes themselves (the default,
/// `verbs::direct`; the test above keeps it on the bridges with `BACKPLANE_DIRECT_QP=0`); the
/// client checks that its QP bound an endpoint of its own.
#[test]
fn rdma_between_hosts_carried_by_the_two_processes_themselves() {
    if let Some(r) = role() {
        rdma_role(&r);
        return;
    }
    if !root() {
        return;
    }
    rdma_between_two_hosts(
        ("hosts_rdma_direct", 23),
        "rdma_between_hosts_carried_by_the_two_processes_themselves",
        &[],
    );
}

/// The RDMA roles between node 1 (h0) and node 2 (h1), with `env` for both.
fn rdma_between_two_hosts(fabric: (&str, u8), test_fn: &str, env: &[&str]) {
    let h = Hosts::odd_even(fabric.0, fabric.1);
    let server = h.spawn_role_with(1, test_fn, "rdma_server", env);
    let client = h.spawn_role_with(0, test_fn, "rdma_client", env);
    assert!(finish(client, "the client").success(), "the client failed");
    assert!(finish(server, "the server").success(), "the server failed");
    h.down(1);
    h.down(0);
    h.assert_nothing_left();
}

/// Context switches of every thread of process `pid` so far (voluntary and not).
fn context_switches(pid: u64) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .flat_map(|st| {
            st.lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}
