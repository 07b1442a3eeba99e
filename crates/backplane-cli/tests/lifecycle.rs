//! `up` / `status` / `down` through the real binary: what users see, and what is left behind.

mod common;
use common::*;

#[test]
fn up_status_down_leaves_nothing_behind() {
    let fab = Fab::up("lifecycle_basic", 4, &[]);
    let s = fab.status();
    assert_eq!(s["version"], 1);
    assert_eq!(s["nodes"], 4);
    assert_eq!(s["window_size"], 8 << 20);
    let slots = s["slots"].as_array().unwrap();
    assert_eq!(slots.len(), 4);
    for (i, slot) in slots.iter().enumerate() {
        assert_eq!(slot["slot"], i as u64 + 1);
        assert_eq!(slot["state"], "READY");
        assert_eq!(slot["generation"], 1);
        assert!(slot["pid"].as_u64().unwrap() > 0);
        assert_eq!(slot["window_base"], ((i as u64) + 1) << 32);
        assert_eq!(slot["drops"], 0);
    }
    let table = bp(&["status", "--name", &fab.name]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("SLOT STATE"), "{text}");
    assert_eq!(text.matches("READY").count(), 4, "{text}");
    assert!(
        !leftovers(&fab.name).is_empty(),
        "a running fabric is visible"
    );

    let out = bp(&["down", "--name", &fab.name]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(leftovers(&fab.name), Vec::<String>::new());
    let after = bp(&["status", "--name", &fab.name]);
    assert_eq!(after.status.code(), Some(1));
    let err = stderr(&after);
    assert!(err.starts_with("backplane: no fabric named"), "{err}");
    assert_eq!(err.lines().count(), 1);
}

#[test]
fn sixty_four_nodes_come_up_ready() {
    let fab = Fab::up("lifecycle_64", 64, &["--window-size", "4M"]);
    let s = fab.status();
    let slots = s["slots"].as_array().unwrap();
    assert_eq!(slots.len(), 64);
    assert!(slots.iter().all(|x| x["state"] == "READY"));
    let name = fab.name.clone();
    drop(fab);
    assert_eq!(leftovers(&name), Vec::<String>::new());
}

#[test]
fn several_fabrics_coexist_and_a_second_up_of_one_name_fails() {
    let a = Fab::up("coexist_a", 2, &[]);
    let b = Fab::up("coexist_b", 3, &[]);
    assert_eq!(a.status()["nodes"], 2);
    assert_eq!(b.status()["nodes"], 3);
    let again = bp(&[
        "up",
        "--name",
        &a.name,
        "--nodes",
        "2",
        "--window-size",
        "8M",
    ]);
    assert_eq!(again.status.code(), Some(1));
    assert!(
        stderr(&again).contains("already running"),
        "{}",
        stderr(&again)
    );
    assert_eq!(
        a.status()["slots"][0]["state"],
        "READY",
        "the running fabric is untouched"
    );
}

#[test]
fn a_crashed_supervisor_is_cleaned_up_by_down_and_by_up() {
    for next in ["down", "up"] {
        let fab = Fab::up(&format!("crash_{next}"), 2, &[]);
        let pid = fab.supervisor_pid();
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
        // Agents die with their supervisor (PR_SET_PDEATHSIG); only the directory stays.
        let gone = wait_for(std::time::Duration::from_secs(10), || {
            let l = leftovers(&fab.name);
            l.iter().all(|x| x.starts_with("directory")).then_some(())
        });
        assert!(gone.is_some(), "{:?}", leftovers(&fab.name));
        if next == "down" {
            let out = bp(&["down", "--name", &fab.name]);
            assert!(out.status.success(), "{}", stderr(&out));
            assert!(String::from_utf8_lossy(&out.stdout).contains("crashed supervisor"));
        } else {
            let out = bp(&[
                "up",
                "--name",
                &fab.name,
                "--nodes",
                "2",
                "--window-size",
                "8M",
            ]);
            assert!(out.status.success(), "{}", stderr(&out));
            assert_eq!(fab.status()["slots"][1]["state"], "READY");
            let out = bp(&["down", "--name", &fab.name]);
            assert!(out.status.success(), "{}", stderr(&out));
        }
        assert_eq!(leftovers(&fab.name), Vec::<String>::new());
    }
}

#[test]
fn bad_input_gets_one_line_errors_and_leaves_nothing() {
    let n = name("badinput");
    let cases: &[(&[&str], i32, &str)] = &[
        (&["up", "--name", &n, "--nodes", "0"], 1, "out of range"),
        (
            &["up", "--name", &n, "--nodes", "100000"],
            1,
            "out of range",
        ),
        (
            &["up", "--name", &n, "--window-size", "12Q"],
            2,
            "unknown unit",
        ),
        (
            &["up", "--name", &n, "--window-size", "1K"],
            1,
            "out of range",
        ),
        (
            &["up", "--name", &n, "--nodes", "8", "--window-size", "60G"],
            1,
            "available",
        ),
        (&["up", "--name", "a/b"], 1, "invalid fabric name"),
        (
            &["status", "--name", &n],
            1,
            &format!("backplane up --name {n}"),
        ),
        (&["down", "--name", &n], 1, "no fabric named"),
        (&["frobnicate"], 2, ""),
        (
            &["perf", "dgram-lat", "--size", "2G", "--ucx", "off"],
            1,
            "out of range",
        ),
    ];
    for (args, code, want) in cases {
        let out = bp(args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(*code), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        if *code == 1 {
            assert!(err.starts_with("backplane: "), "{args:?}: {err}");
            assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        }
    }
    assert_eq!(leftovers(&n), Vec::<String>::new());
}

/// Processes whose environment names fabric `name` (what `exec` sets), other than us.
fn exec_processes(name: &str) -> Vec<u32> {
    let want = format!("BACKPLANE_FABRIC={name}");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|p| {
            let pid: u32 = p.file_name().to_str()?.parse().ok()?;
            let env = std::fs::read(p.path().join("environ")).ok()?;
            let stat = std::fs::read_to_string(p.path().join("stat")).ok()?;
            let zombie = stat
                .rsplit_once(") ")
                .is_some_and(|(_, r)| r.starts_with('Z'));
            (!zombie && env.split(|&b| b == 0).any(|kv| kv == want.as_bytes())).then_some(pid)
        })
        .filter(|&p| p != std::process::id())
        .collect()
}

/// Programs started with `exec` are counted per node by `status` and stopped by `down`:
/// SIGTERM, then SIGKILL after the grace for one that ignores SIGTERM; `down` says so.
#[test]
fn down_stops_what_exec_started_in_the_nodes_and_status_counts_it() {
    let fab = Fab::up("lifecycle_exec_procs", 2, &[]);
    let spawn = |node: &str, cmd: &[&str]| {
        let mut args = vec!["exec", "--name", &fab.name, node, "--"];
        args.extend_from_slice(cmd);
        std::process::Command::new(BIN)
            .args(&args)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut a = spawn("1", &["sleep", "1000"]);
    let mut b = spawn("2", &["sh", "-c", "trap '' TERM; sleep 1000"]);
    let counted = wait_for(std::time::Duration::from_secs(10), || {
        let s = fab.status();
        let n: Vec<u64> = s["slots"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["procs"].as_u64().unwrap())
            .collect();
        (n == [1, 2]).then_some(())
    });
    assert!(
        counted.is_some(),
        "status never counted 1 and 2: {}",
        fab.status()
    );
    let table = String::from_utf8_lossy(&bp(&["status", "--name", &fab.name]).stdout).to_string();
    assert!(table.contains("PROCS"), "{table}");
    let out = bp(&["down", "--name", &fab.name, "--grace", "0.5"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("stopped 3 processes running in nodes 1, 2 (2 killed after the 0.5s grace"),
        "{text}"
    );
    assert!(text.contains("is down"), "{text}");
    // The exec wrappers report their programs' deaths by signal.
    assert_eq!(a.wait().unwrap().code(), Some(128 + 15));
    assert_eq!(b.wait().unwrap().code(), Some(128 + 9));
    assert!(
        exec_processes(&fab.name).is_empty(),
        "{:?}",
        exec_processes(&fab.name)
    );
    assert!(
        leftovers(&fab.name).is_empty(),
        "{:?}",
        leftovers(&fab.name)
    );
    let bad = bp(&["down", "--name", &fab.name, "--grace", "-1"]);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
}

/// `rsh HOST COMMAND...` runs as ssh would, in the node HOST names (`nodeN` or `N`): the
/// command's words joined and run by `sh -c` (so a launcher's quoted command line works), its
/// exit status passed on, the fabric taken from `BACKPLANE_FABRIC` as inside a node; a HOST
/// that names no node is one line.
#[test]
fn rsh_runs_a_command_line_in_the_node_a_host_name_names() {
    let fab = Fab::up("lifecycle_rsh", 3, &[]);
    let o = bp(&[
        "rsh",
        "--name",
        &fab.name,
        "node3",
        "echo",
        "in node $BACKPLANE_NODE of $BACKPLANE_FABRIC;",
        "echo",
        "second",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out, format!("in node 3 of {}\nsecond\n", fab.name));
    // The fabric from the environment (as inside a node); the command's status passed on.
    let o = std::process::Command::new(BIN)
        .env("BACKPLANE_FABRIC", &fab.name)
        .args(["rsh", "2", "exit 7"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
    // `--mpi` on a fabric whose device UCX cannot name (15 characters: `bp_` and 12).
    let o = bp(&[
        "exec",
        "--name",
        "a-fabric-name-too-long",
        "--mpi",
        "1",
        "--",
        "true",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.trim().lines().count() == 1 && e.contains("12 characters or fewer"),
        "{e}"
    );
    for bad in ["node4", "node0", "elsewhere"] {
        let o = bp(&["rsh", "--name", &fab.name, bad, "true"]);
        assert_eq!(o.status.code(), Some(1), "{bad}");
        let e = stderr(&o);
        assert_eq!(e.trim().lines().count(), 1, "{e}");
        assert!(
            e.starts_with("backplane: ") && e.contains(bad) && e.contains("not a node"),
            "{e}"
        );
    }
}
