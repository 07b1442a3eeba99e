//! Unmodified libibverbs programs from Debian (ibverbs-utils) on a fabric through
//! `backplane exec --verbs`, which puts the `backplane-ibverbs` crate's `libibverbs.so.1`
//! first on their library path. The programs are the judges: their own exit status and output.
//! `scripts/setup.sh --test` installs them; elsewhere these tests say so and pass.

mod common;
use common::*;

use std::process::{Command, Output};

fn lib_built() {
    common::lib_built("libibverbs.so", "backplane-ibverbs");
}

/// `backplane exec --verbs --name F NODE -- ARGS...`
fn exec_verbs(fab: &Fab, node: u32, args: &[&str]) -> Output {
    exec_verbs_in(&fab.name, node, args)
}

fn exec_verbs_in(fabric: &str, node: u32, args: &[&str]) -> Output {
    let n = node.to_string();
    let mut a = vec!["exec", "--verbs", "--name", fabric, &n, "--"];
    a.extend_from_slice(args);
    bp(&a)
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn ibv_devices_and_ibv_devinfo_see_the_fabric_as_a_device_with_a_lid_per_node() {
    if !have("ibv_devices") {
        return;
    }
    lib_built();
    let fab = Fab::up("ibv_devinfo", 2, &[]);
    let dev = format!("bp_{}", fab.name);

    let o = exec_verbs(&fab, 1, &["ibv_devices"]);
    assert!(o.status.success(), "ibv_devices: {}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out
        .lines()
        .find(|l| l.contains(&dev))
        .unwrap_or_else(|| panic!("no {dev} in: {out}"));
    assert!(line.contains("0000000100000b0b"), "node 1's GUID: {line}");
    assert_eq!(
        out.matches("bp_").count(),
        1,
        "only the fabric it runs in: {out}"
    );

    let o = exec_verbs(&fab, 2, &["ibv_devinfo", "-v"]);
    assert!(o.status.success(), "ibv_devinfo: {}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in [
        format!("hca_id:\t{dev}"),
        "node_guid:\t\t\t0000:0002:0000:0b0b".into(),
        "phys_port_cnt:\t\t\t1".into(),
        "state:\t\t\tPORT_ACTIVE (4)".into(),
        "port_lid:\t\t2".into(),
        "link_layer:\t\tInfiniBand".into(),
        "active_mtu:\t\t4096 (5)".into(),
        "GID[  0]:\t\tfe80:".into(),
    ] {
        assert!(
            out.contains(&want),
            "'{want}' not in ibv_devinfo's output:\n{out}"
        );
    }

    // Outside every node the fabric is no device of the process's (the library is the same).
    let dir = backplane::fabric::fabric_dir(&fab.name).join("verbs-lib");
    let o = Command::new("ibv_devices")
        .env("LD_LIBRARY_PATH", &dir)
        .env_remove("BACKPLANE_FABRIC")
        .env_remove("BACKPLANE_NODE")
        .output()
        .expect("run ibv_devices");
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains(&dev),
        "{}",
        text(&o)
    );
    let hint = stderr(&o);
    assert!(
        hint.contains("runs in no node of fabric") && hint.contains("exec --verbs"),
        "a one-line hint: {hint}"
    );
}

/// True once something listens on TCP `port` (IPv4 or IPv6), read from /proc/net: a probe
/// connection would be taken by the server as its peer.
fn listening(port: u16) -> bool {
    let want = format!(":{port:04X} ");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let mut w = l.split_whitespace();
                let local = w.nth(1).unwrap_or("");
                let state = w.nth(1).unwrap_or("");
                format!("{local} ").ends_with(&want) && state == "0A"
            })
        })
    })
}

/// Runs `prog` as a server in node 1 and as a client of it in node 2 (TCP `port` on
/// loopback, the fabric having no IP), each bounded by `timeout`; both outputs.
fn pair(fab: &Fab, prog: &str, port: u16, args: &[&str]) -> (Output, Output) {
    pair_env(fab, &[], prog, port, args)
}

/// [`pair`] with environment variables (`NAME=value`) for both sides.
fn pair_env(fab: &Fab, env: &[&str], prog: &str, port: u16, args: &[&str]) -> (Output, Output) {
    let p = port.to_string();
    let mut server: Vec<String> = ["env"]
        .iter()
        .chain(env)
        .chain(&["timeout", "60", prog, "-p", &p])
        .map(|s| s.to_string())
        .collect();
    server.extend(args.iter().map(|s| s.to_string()));
    let mut client = server.clone();
    client.push("localhost".into());
    let name = fab.name.clone();
    let srv = std::thread::spawn(move || {
        let a: Vec<&str> = server.iter().map(String::as_str).collect();
        exec_verbs_in(&name, 1, &a)
    });
    let t0 = std::time::Instant::now();
    while !listening(port) {
        if srv.is_finished() {
            let o = srv.join().expect("server thread");
            panic!("{prog} ended before listening on {port}: {}", text(&o));
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "{prog} did not start listening on {port}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let a: Vec<&str> = client.iter().map(String::as_str).collect();
    let c = exec_verbs(fab, 2, &a);
    let s = srv.join().expect("server thread");
    (s, c)
}

fn both_succeed(what: &str, (s, c): &(Output, Output)) {
    assert!(s.status.success(), "{what} server: {}", text(s));
    assert!(c.status.success(), "{what} client: {}", text(c));
}

#[test]
fn the_pingpong_examples_run_rc_uc_ud_and_srq_with_their_data_checks() {
    if !have("ibv_rc_pingpong") {
        return;
    }
    lib_built();
    // The 16 QPs of ibv_srq_pingpong with their 512 KiB rings need more than the tests' 8 MiB.
    let fab = Fab::up("ibv_pingpong", 2, &["--window-size", "32M"]);
    // `-c`: each side checks every byte it received (the buffers are the programs' own
    // memalign'ed memory, registered in place).
    for (i, (prog, extra)) in [
        ("ibv_rc_pingpong", &["-n", "300", "-c"][..]),
        ("ibv_rc_pingpong", &["-n", "100", "-c", "-s", "65536"][..]),
        ("ibv_rc_pingpong", &["-n", "100", "-c", "-e"][..]),
        // The extended API: posting (`ibv_create_qp_ex`, `ibv_wr_send`, `ibv_wr_set_sge`),
        // polling with completion timestamps (`ibv_create_cq_ex`, `ibv_start_poll`, …).
        ("ibv_rc_pingpong", &["-n", "300", "-c", "-N"][..]),
        (
            "ibv_rc_pingpong",
            &["-n", "100", "-c", "-N", "-e", "-s", "65536"][..],
        ),
        ("ibv_rc_pingpong", &["-n", "300", "-c", "-t"][..]),
        (
            "ibv_rc_pingpong",
            &["-n", "100", "-c", "-t", "-e", "-N"][..],
        ),
        ("ibv_uc_pingpong", &["-n", "300", "-c"][..]),
        ("ibv_ud_pingpong", &["-n", "300", "-c"][..]),
        // 16 RC QPs on one shared receive queue; then 4 QPs, 64 KiB, an SRQ of 8.
        ("ibv_srq_pingpong", &["-n", "300", "-c", "-e"][..]),
        (
            "ibv_srq_pingpong",
            &["-n", "100", "-c", "-s", "65536", "-q", "4", "-r", "8"][..],
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let r = pair(&fab, prog, 18700 + i as u16, extra);
        both_succeed(&format!("{prog} {extra:?}"), &r);
        let out = String::from_utf8_lossy(&r.1.stdout).into_owned();
        assert!(out.contains("iters in"), "{prog}: {out}");
        if extra.contains(&"-t") {
            // Printed only when receive completions came with timestamps.
            assert!(
                out.contains("Average receive completion clock cycles"),
                "{prog} {extra:?}: {out}"
            );
        }
        assert!(out.contains("remote address: LID 0x0001"), "{prog}: {out}");
        // Nothing they call is missing (each looks up its device's index).
        for o in [&r.0, &r.1] {
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!err.contains("not offered"), "{prog}: {err}");
        }
    }
}

#[test]
fn perftest_runs_every_rdma_operation_between_two_nodes() {
    if !have("ib_write_bw") {
        return;
    }
    lib_built();
    let fab = Fab::up("ibv_perftest", 2, &[]);
    for (i, prog) in PERFTEST.into_iter().enumerate() {
        let r = pair(&fab, prog, 18720 + i as u16, &["-n", "200"]);
        both_succeed(prog, &r);
        let out = String::from_utf8_lossy(&r.1.stdout).into_owned();
        assert!(out.contains(&format!("bp_{}", fab.name)), "{prog}: {out}");
        assert!(
            out.contains(" 200 "),
            "{prog} ran its 200 iterations: {out}"
        );
    }
    // With completion events: `ib_send_lat -e` polls once per event and takes the event for a
    // completion (an event with none behind it read garbage: "Couldn't post send: scnt=3").
    for (i, prog) in ["ib_send_lat", "ib_send_bw"].into_iter().enumerate() {
        let r = pair(&fab, prog, 18740 + i as u16, &["-e", "-n", "1000"]);
        both_succeed(&format!("{prog} -e"), &r);
        let out = String::from_utf8_lossy(&r.1.stdout).into_owned();
        assert!(
            out.contains(" 1000 "),
            "{prog} -e ran its 1000 iterations: {out}"
        );
    }
}

#[test]
fn what_is_not_offered_stops_the_program_with_its_own_error_not_a_crash() {
    if !have("ib_write_bw") {
        return;
    }
    lib_built();
    let fab = Fab::up("ibv_notoffered", 2, &[]);
    for (args, says) in [
        (
            &["ib_write_bw", "-R"][..],
            "Unable to create RDMA_CM resources",
        ),
        (&["ibv_rc_pingpong", "-j"][..], "dm allocation"),
        (&["ibv_rc_pingpong", "-o"][..], "ODP"),
    ] {
        let o = exec_verbs(&fab, 1, args);
        let t = text(&o);
        assert_eq!(
            o.status.code(),
            Some(1),
            "{args:?} exits 1, not by a signal: {t}"
        );
        assert!(t.contains(says), "{args:?}: {t}");
        assert!(!t.contains("symbol lookup error"), "{t}");
    }
}

/// `ibv_asyncwatch` (ibverbs-utils) sees what an HCA reports: its node's agent killed, the
/// port goes down and comes back with the node's restart (`IBV_EVENT_PORT_ERR`, then
/// `IBV_EVENT_PORT_ACTIVE`); the supervisor killed, the device is gone
/// (`IBV_EVENT_DEVICE_FATAL`). (Before session 43 the program did not even start: "symbol
/// lookup error: ibv_ack_async_event".)
#[test]
fn asynchronous_events_report_the_port_and_the_device_as_an_hca_does() {
    use rustix::process::{kill_process, Pid, Signal};
    use std::time::{Duration, Instant};
    if !have("ibv_asyncwatch") {
        return;
    }
    lib_built();
    let fab = Fab::up("ibv_async", 2, &["--restart-delay-ms", "200"]);
    let dev = format!("bp_{}", fab.name);
    let (name, d) = (fab.name.clone(), dev.clone());
    let watch = std::thread::spawn(move || {
        exec_verbs_in(&name, 1, &["timeout", "60", "ibv_asyncwatch", "-d", &d])
    });
    let slot1 = |fab: &Fab| fab.status()["slots"][0].clone();
    let until = |what: &str, ok: &dyn Fn() -> bool| {
        let t0 = Instant::now();
        while !ok() {
            assert!(t0.elapsed() < Duration::from_secs(20), "never: {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // The program in node 1 (its process counted), its context open (a moment more).
    until("ibv_asyncwatch runs in node 1", &|| {
        assert!(!watch.is_finished(), "ibv_asyncwatch ended early");
        slot1(&fab)["procs"].as_u64() >= Some(1)
    });
    std::thread::sleep(Duration::from_millis(500));
    let agent = slot1(&fab)["pid"].as_i64().unwrap() as i32;
    kill_process(Pid::from_raw(agent).unwrap(), Signal::KILL).unwrap();
    until("node 1 back in generation 2", &|| {
        let s = slot1(&fab);
        s["state"] == "READY" && s["generation"].as_u64() == Some(2)
    });
    std::thread::sleep(Duration::from_millis(300));
    kill_process(Pid::from_raw(fab.supervisor_pid()).unwrap(), Signal::KILL).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    // It waits for more events for ever: end it.
    for (pid, _) in running("ibv_asyncwatch")
        .into_iter()
        .filter(|(_, args)| args.contains(&dev))
    {
        let _ = kill_process(Pid::from_raw(pid).unwrap(), Signal::TERM);
    }
    let out = watch.join().unwrap();
    let t = text(&out);
    let lines: Vec<&str> = t.lines().filter(|l| l.contains("event_type")).collect();
    assert_eq!(
        lines,
        [
            "  event_type IBV_EVENT_PORT_ERR (10), port 1",
            "  event_type IBV_EVENT_PORT_ACTIVE (9), port 1",
            "  event_type IBV_EVENT_DEVICE_FATAL (8), port 0",
        ],
        "{t}"
    );
    assert!(t.contains(&format!("{dev}: async event FD")), "{t}");
}

/// Every libibverbs symbol (with its version) that the installed programs and libraries which
/// load ours import is exported: ibverbs-utils, perftest, the rdma-core providers perftest
/// links, and UCX's verbs transports (`libuct_ib`, which found no `ibv_fork_init`,
/// `ibv_event_type_str` or `ibv_node_type_str` before session 43: "symbol lookup error").
/// A program then fails, if at all, with its own error, never with the dynamic linker's.
#[test]
fn every_libibverbs_symbol_the_installed_programs_import_is_exported() {
    lib_built();
    let nm = |args: &[&str], file: &std::path::Path| -> Option<String> {
        let o = Command::new("nm").args(args).arg(file).output().ok()?;
        o.status
            .success()
            .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let lib = std::path::Path::new(BIN).with_file_name("libibverbs.so");
    let Some(ours) = nm(&["-D", "--defined-only"], &lib) else {
        eprintln!("skipped: no nm");
        return;
    };
    let ours: std::collections::HashSet<String> = ours
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .map(|s| s.replace("@@", "@"))
        .collect();
    let mut importers: Vec<std::path::PathBuf> = [
        "ibv_asyncwatch",
        "ibv_devices",
        "ibv_devinfo",
        "ibv_rc_pingpong",
        "ibv_srq_pingpong",
        "ibv_uc_pingpong",
        "ibv_ud_pingpong",
        "ibv_xsrq_pingpong",
    ]
    .iter()
    .chain(PERFTEST.iter())
    .map(|p| std::path::Path::new("/usr/bin").join(p))
    .collect();
    let libdir = std::path::Path::new("/usr/lib/x86_64-linux-gnu");
    importers.extend(
        ["ucx/libuct_ib.so.0", "libmlx5.so.1", "libefa.so.1"]
            .iter()
            .map(|l| libdir.join(l)),
    );
    let mut checked = 0;
    let mut missing = Vec::new();
    for f in importers.iter().filter(|f| f.exists()) {
        let Some(imports) = nm(&["-D", "--undefined-only"], f) else {
            continue;
        };
        checked += 1;
        for sym in imports
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter(|s| s.contains("@IBVERBS_"))
        {
            if !ours.contains(sym) {
                missing.push(format!("{}: {sym}", f.display()));
            }
        }
    }
    assert!(missing.is_empty(), "not exported: {missing:#?}");
    eprintln!("{checked} programs and libraries: every libibverbs symbol they import is exported");
}

#[test]
fn exec_verbs_refuses_an_unknown_node_with_one_line() {
    lib_built();
    let fab = Fab::up("ibv_badnode", 1, &[]);
    let o = exec_verbs(&fab, 7, &["true"]);
    assert!(!o.status.success());
    assert_eq!(stderr(&o).trim().lines().count(), 1, "{}", stderr(&o));
}

/// Processes running `prog` with `-p port` on their command line: pid, and whether it is the
/// client (it names the server host last).
fn procs_of(prog: &str, port: u16) -> Vec<(i32, bool)> {
    let p = port.to_string();
    running(prog)
        .into_iter()
        .filter(|(_, args)| args.windows(2).any(|w| w[0] == "-p" && w[1] == p))
        .map(|(pid, args)| (pid, args.last().is_some_and(|a| a == "localhost")))
        .collect()
}

/// Processes running `prog` (its path ends so): pid and arguments.
fn running(prog: &str) -> Vec<(i32, Vec<String>)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let args: Vec<String> = cmd
                .split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            args.first()?.ends_with(prog).then_some((pid, args))
        })
        .collect()
}

#[test]
fn a_program_killed_mid_run_leaves_its_peer_able_to_finish_and_nothing_behind() {
    if !have("ib_write_bw") {
        return;
    }
    lib_built();
    let fab = Fab::up("ibv_killed", 2, &[]);
    let port = 18740u16;
    let spawn = |node: u32, extra: &[&str]| {
        let n = node.to_string();
        let p = port.to_string();
        let mut a = vec!["exec", "--verbs", "--name", &fab.name, &n, "--"];
        a.extend_from_slice(&["timeout", "60", "ib_write_bw", "-p", &p, "-D", "4"]);
        a.extend_from_slice(extra);
        Command::new(BIN)
            .args(&a)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let server = spawn(1, &[]);
    let t0 = std::time::Instant::now();
    while !listening(port) {
        assert!(t0.elapsed().as_secs() < 30, "ib_write_bw did not listen");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let client = spawn(2, &["localhost"]);
    // Mid-run: both programs exist and the client has been writing for a while.
    let client_pid = wait_for(std::time::Duration::from_secs(30), || {
        let p = procs_of("ib_write_bw", port);
        let client = p.iter().find(|(_, client)| *client).map(|&(pid, _)| pid);
        client.filter(|_| p.len() == 2)
    })
    .expect("both ib_write_bw processes run");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: kill(2) on a pid we found; no memory is involved.
    assert_eq!(unsafe { libc::kill(client_pid, libc::SIGKILL) }, 0);
    let c = client.wait_with_output().unwrap();
    assert_eq!(c.status.code(), Some(128 + libc::SIGKILL), "{}", text(&c));
    // The server ends by itself (its peer's socket closed, or its duration over), not by a
    // signal and not hanging.
    let s = server.wait_with_output().unwrap();
    assert!(
        s.status.code().is_some_and(|c| c != 124 && c < 128),
        "server: {:?} {}",
        s.status,
        text(&s)
    );
    let name = fab.name.clone();
    drop(fab);
    let left = leftovers(&name);
    assert!(left.is_empty(), "{left:?}");
}

/// Compiles `src` (relative to this crate) against the system's `<infiniband/verbs.h>` with
/// warnings as errors, into a directory of its own; the directory and the program.
fn compile_c(src: &str, name: &str) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("bp-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join(name);
    let cc = std::process::Command::new("cc")
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(src))
        .args(["-libverbs", "-lpthread"])
        .output()
        .expect("run cc");
    assert!(cc.status.success(), "cc {src}: {}", text(&cc));
    let exe = exe.to_str().unwrap().to_owned();
    (dir, exe)
}

/// Compiles `tests/c/NAME.c`, runs it in node 1 of a fabric of its own (`nodes` nodes) with
/// `args`, and checks it succeeded and said `says`.
fn c_program_succeeds(name: &str, nodes: u32, args: &[&str], says: &str) {
    lib_built();
    let (dir, exe) = compile_c(&format!("tests/c/{name}.c"), name);
    let fab = Fab::up(name, nodes, &[]);
    let mut argv = vec![exe.as_str()];
    argv.extend(args);
    let out = exec_verbs(&fab, 1, &argv);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains(says), "{}", text(&out));
}

/// A multi-threaded libibverbs program (`tests/c/ibv_threads.c`, compiled here against the
/// system's `<infiniband/verbs.h>` and run with the drop-in library): four threads on one
/// context at once, the main thread — which opened the context and so holds the lock's bias —
/// among them, each with its own CQ and a connected pair of RC QPs doing WRITE, READ and SEND
/// with every byte checked. With the bias never revoked the engine is entered twice at once
/// and the program aborts (checked); with it, every operation succeeds.
#[test]
fn threads_sharing_one_context_take_turns_and_every_byte_arrives() {
    c_program_succeeds(
        "ibv_threads",
        2,
        &["4", "3000"],
        "4 threads x 3000 iterations of WRITE, READ, SEND: all bytes right",
    );
}

/// The extended API as rdma-core documents it (`tests/c/ibv_extended.c`, one process, QPs
/// connected to each other). Posting (`ibv_wr_post(3)`): every builder and setter the fabric
/// offers moves the right bytes (WRITE from a gather entry and inline, READ, both atomics, a
/// batch of a two-entry SEND, a WRITE_WITH_IMM and an inline-list SEND_WITH_IMM completing in
/// order, a UD SEND), the errors `ibv_wr_complete` answers post nothing (no region, a setter
/// first, an operation the QP was not made for, one not offered, an abort), and the QPs that
/// cannot be made are refused with `EOPNOTSUPP`. Polling (`ibv_create_cq_ex(3)`): a CQ with
/// completion timestamps read field by field, `ENOENT` when empty, timestamps on
/// `ibv_query_device_ex`'s clock within the run, unoffered fields refused.
#[test]
fn the_extended_api_moves_the_right_bytes_and_answers_its_errors() {
    c_program_succeeds("ibv_extended", 1, &[], "all as documented");
}

/// Memory that is shared already (`tests/c/ibv_shared_mr.c`, one process): a memfd mapped
/// `MAP_SHARED`, a SysV segment, shared anonymous memory and ranges registered twice are
/// registered where they are — a WRITE lands at the program's address and in the object's
/// other mappings, READ returns what the program wrote — overlapping registrations have
/// their own keys, deregistering the inner one revokes it while the outer still works, and a
/// disk file's mapping is refused with `EINVAL`.
#[test]
fn shared_memory_and_overlapping_ranges_register_where_they_are() {
    c_program_succeeds("ibv_shared_mr", 1, &[], "shared memory registered in place");
}

/// UCX, which nobody here wrote, over the drop-in library: `ucx_perftest` between two nodes
/// with UCX's InfiniBand transports (`rc_verbs`, `ud_verbs` to wire up) on the fabric's
/// device — it stats `/dev/infiniband/uverbs_bp_FABRIC` (made by `up`), registers SysV
/// segments and the same pages twice, makes its completion channel's fd non-blocking, flushes
/// with zero-length WRITEs of rkey 0 and uses hardware atomics only on an `IBV_ATOMIC_HCA`
/// device. Tag matching (eager, and rendezvous by RDMA READ at 1 MiB), one-sided PUT and GET
/// through UCP, and UCT's FETCH_AND_ADD and COMPARE_AND_SWAP straight on `rc_verbs`, each
/// checked by its exit status (ucx_perftest checks no data).
#[test]
fn ucx_perftest_runs_over_the_fabric_through_ucx_infiniband_transports() {
    if !have("ucx_perftest") {
        return;
    }
    lib_built();
    // (A short name: UCX keeps 15 characters of a device's name, `bp_` + the fabric's.)
    let fab = Fab::up("ucx", 2, &[]);
    assert!(
        std::path::Path::new(&format!("/dev/infiniband/uverbs_bp_{}", fab.name)).exists(),
        "up made no verbs device node"
    );
    let tls = "UCX_TLS=rc_verbs,ud_verbs,self";
    let dev = format!("UCX_NET_DEVICES=bp_{}:1", fab.name);
    let device = &dev["UCX_NET_DEVICES=".len()..];
    let uct = |op| ["-t", op, "-x", "rc_verbs", "-d", device, "-n", "2000"];
    let (fadd, cswap) = (uct("fadd"), uct("cswap"));
    let runs: &[&[&str]] = &[
        &["-t", "tag_lat", "-n", "2000"],
        &["-t", "tag_bw", "-s", "1048576", "-n", "200"],
        &["-t", "ucp_put_bw", "-s", "65536", "-n", "500"],
        &["-t", "ucp_get", "-s", "8", "-n", "2000"],
        &fadd,
        &cswap,
    ];
    for (i, args) in runs.iter().enumerate() {
        let r = pair_env(&fab, &[tls, &dev], "ucx_perftest", 18780 + i as u16, args);
        both_succeed(&format!("ucx_perftest {}", args[1]), &r);
        assert!(text(&r.1).contains("Final:"), "{}", text(&r.1));
    }
    // UCP's own atomics on the fabric's (UCX's `guess` emulates them: no scalable transport
    // with device atomics).
    let amo = "UCX_ATOMIC_MODE=device";
    let r = pair_env(
        &fab,
        &[tls, &dev, amo],
        "ucx_perftest",
        18790,
        &["-t", "ucp_fadd", "-n", "2000"],
    );
    both_succeed("ucx_perftest ucp_fadd", &r);
    assert!(text(&r.1).contains("Final:"), "{}", text(&r.1));
    let name = fab.name.clone();
    drop(fab);
    assert!(
        !std::path::Path::new(&format!("/dev/infiniband/uverbs_bp_{name}")).exists(),
        "down left the verbs device node behind"
    );
}

/// MPI, the HPC programs' API, over UCX's InfiniBand transports over the drop-in: OpenMPI's
/// `mpirun`, run in node 1, starts its ranks in nodes 1 and 2 — the second through `backplane
/// rsh --verbs` as its ssh (`plm_rsh_agent`); `tests/c/mpi_pingpong.c`, compiled with
/// `mpicc`, checks every byte of a ping-pong from 8 B to 256 KiB (eager and rendezvous), a
/// one-sided put, get and accumulate through a window (OpenMPI's `osc ucx`: RDMA WRITE, READ
/// and atomics on the fabric), and an allreduce. Debian turns `pml ucx` and `osc ucx` off in
/// `/etc/openmpi/openmpi-mca-params.conf`: asked for by name. `--bind-to none`: each node is
/// a host to MPI, and each would bind its first rank to core 0 — the same core.
#[test]
fn mpi_runs_over_ucx_over_the_fabric_with_ranks_started_through_backplane_rsh() {
    if !have("mpirun") || !have("mpicc") {
        return;
    }
    lib_built();
    let dir = std::env::temp_dir().join(format!("bp-mpi-{}", std::process::id()));
    let exe = mpi_pingpong(&dir);
    // (A short name: UCX keeps 15 characters of a device's name, `bp_` + the fabric's.)
    let fab = Fab::up("mpi", 2, &[]);
    let agent = format!("{} rsh --verbs", common::BIN);
    let dev = format!("UCX_NET_DEVICES=bp_{}:1", fab.name);
    let exe = exe.to_str().unwrap();
    let mut args = MPIRUN_TWO_NODES.to_vec();
    args.extend([
        "--bind-to",
        "none",
        "--mca",
        "plm_rsh_agent",
        &agent,
        "--mca",
        "pml",
        "ucx",
        "--mca",
        "osc",
        "ucx",
        "--mca",
        "rtc",
        "^hwloc",
        "-x",
        "UCX_TLS=rc_verbs,ud_verbs,self",
        "-x",
        &dev,
        "-x",
        "UCX_ATOMIC_MODE=device",
        exe,
        "300",
    ]);
    let out = exec_verbs(&fab, 1, &args);
    let check = |how: &str, out: &Output| {
        let t = mpi_pingpong_ran(how, out);
        assert!(
            t.contains("pingpong       8 B:"),
            "{how}: no 8 B row in:\n{t}"
        );
    };
    check("mpirun with every setting on its command line", &out);
    // `exec --mpi` gives mpirun all of that: a plain `mpirun` runs the same.
    let n = fab.name.clone();
    let mut args = vec!["exec", "--mpi", "--name", &n, "1", "--"];
    args.extend(MPIRUN_TWO_NODES);
    args.extend([exe, "300"]);
    let out = bp(&args);
    check("exec --mpi", &out);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `examples/c/perftest_loops.c` — perftest's latency and bandwidth loops over plain
/// libibverbs, the probe behind the README's findings on where `ib_write_lat`'s time goes and
/// on short runs' first-time costs — builds and runs each of its loops between two nodes (a
/// few thousand iterations: it must work, not measure here).
#[test]
fn the_perftest_loops_probe_runs_each_loop_between_two_nodes() {
    lib_built();
    let (dir, exe) = compile_c("../../examples/c/perftest_loops.c", "perftest_loops");
    let fab = Fab::up("ibv_ptloops", 2, &[]);
    for (i, (args, want)) in [
        (&["-t", "write", "-n", "3000"][..], "write: "),
        (
            &["-t", "write", "-P", "-n", "3000"][..],
            "write with PAUSE: ",
        ),
        (&["-t", "send", "-n", "3000"][..], "send: "),
        (&["-t", "post", "-o", "read", "-n", "3000"][..], "read: "),
        (&["-t", "post", "-o", "fadd", "-n", "3000"][..], "fadd: "),
        (&["-t", "bw", "-o", "write", "-n", "3000"][..], "bw write: "),
        (&["-t", "bw", "-o", "send", "-n", "3000"][..], "bw send: "),
    ]
    .into_iter()
    .enumerate()
    {
        let r = pair(&fab, &exe, 18760 + i as u16, args);
        both_succeed(&format!("perftest_loops {args:?}"), &r);
        let out = String::from_utf8_lossy(&r.1.stdout).into_owned();
        assert!(
            out.starts_with(want) && (out.contains(" ns ") || out.contains(" Mpps ")),
            "{args:?}: {out}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
