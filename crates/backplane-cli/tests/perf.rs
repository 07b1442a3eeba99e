//! `backplane perf` through the binary: the measurement commands that run a temporary fabric
//! and the peers they compare it with.

mod common;
use common::*;

#[test]
fn perf_dma_bw_reports_bandwidth_cpu_and_memcpy_of_the_same_run() {
    let out = bp(&[
        "perf",
        "dma-bw",
        "--size",
        "1M",
        "--iters",
        "50",
        "--segments",
        "4",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("memcpy[MB/sec]"), "{text}");
    assert!(
        text.contains("cpu[s/GB]") || text.contains("submitter"),
        "{text}"
    );
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("1048576"))
        .unwrap_or_else(|| panic!("no 1 MiB row: {text}"));
    assert!(row.contains('%'), "{row}");
}

/// `perf write-lat --rounds` through the binary: every round kept in the JSON, medians on top,
/// the temporary fabrics of all rounds gone afterwards.
#[test]
fn perf_rounds_keep_every_round_and_report_medians() {
    let out = bp(&[
        "perf",
        "write-lat",
        "-n",
        "300",
        "--rounds",
        "3",
        "--ucx",
        "off",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rounds = v["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 3);
    let typical: Vec<f64> = rounds
        .iter()
        .map(|r| r["backplane"][0]["t_typical_us"].as_f64().unwrap())
        .collect();
    let mut sorted = typical.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(v["backplane"][0]["t_typical_us"].as_f64(), Some(sorted[1]));
    assert!(typical.iter().all(|&t| t > 0.0 && t < 1e6), "{typical:?}");
    let bad = bp(&["perf", "write-lat", "--rounds", "0", "--ucx", "off"]);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
}

/// `perf write-lat / send-lat / read-lat / atomic-lat --loop perftest`: perftest's loop over
/// the Rust API runs to the end on both sides (the peer's answers all taken, the protocol in
/// step for the next size) and says so in the JSON; the bandwidth tests refuse the option in
/// one line.
#[test]
fn perf_loop_perftest_runs_perftests_loop_for_every_latency_test() {
    for test in ["write-lat", "send-lat", "read-lat", "atomic-lat"] {
        let out = bp(&[
            "perf",
            test,
            "-a",
            "-n",
            "200",
            "-r",
            "1",
            "--loop",
            "perftest",
            "--ucx",
            "off",
            "--perftest",
            "off",
            "--json",
        ]);
        assert!(out.status.success(), "{test}: {}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["loop"], "perftest", "{v}");
        let rows = v["backplane"].as_array().unwrap();
        let sizes = if test == "atomic-lat" { 1 } else { 18 };
        assert_eq!(rows.len(), sizes, "{test}: every size 8 B .. 1 MiB");
        for r in rows {
            let t = r["t_typical_us"].as_f64().unwrap();
            assert!(t > 0.0 && t < 1e6, "{test}: {r}");
        }
    }
    let bad = bp(&["perf", "read-bw", "--loop", "perftest", "--ucx", "off"]);
    assert_eq!(bad.status.code(), Some(1), "{}", stderr(&bad));
    assert!(
        stderr(&bad).contains("--loop perftest is for the latency tests"),
        "{}",
        stderr(&bad)
    );
}

/// `--cpus CLIENT,PEER` runs the two sides pinned, says so in the JSON, and refuses what it
/// cannot do in one line.
#[test]
fn perf_cpus_pins_the_two_sides_and_refuses_bad_cpus_in_one_line() {
    let last = std::thread::available_parallelism().map_or(1, |n| n.get()) - 1;
    let cpus = format!("0,{last}");
    let out = bp(&[
        "perf",
        "read-lat",
        "-n",
        "200",
        "-r",
        "2",
        "--cpus",
        &cpus,
        "--ucx",
        "off",
        "--perftest",
        "off",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cpus"], serde_json::json!([0, last]), "{v}");
    assert!(v["backplane"][0]["t_avg_us"].as_f64().unwrap() > 0.0, "{v}");
    for (args, want) in [
        (&["perf", "read-lat", "--cpus", "0"][..], "two CPU numbers"),
        (
            &["perf", "read-lat", "--cpus", "0,4096"][..],
            "CPU 4096 is not one",
        ),
        (
            &["perf", "ip", "--cpus", "0,0"][..],
            "--cpus is for the tests with a far side",
        ),
    ] {
        let bad = bp(args);
        assert_eq!(bad.status.code(), Some(1), "{args:?}: {}", stderr(&bad));
        let e = stderr(&bad);
        assert!(e.contains(want) && e.lines().count() == 1, "{args:?}: {e}");
    }
}

/// A far side that could not start (a `--peer-via` command that fails) is named as such, in one
/// line and at once, not as a peer that never answered.
#[test]
fn perf_names_a_peer_via_command_that_failed_in_one_line() {
    let fab = Fab::up("peervia", 2, &[]);
    let out = bp(&[
        "perf",
        "dgram-lat",
        "--name",
        &fab.name,
        "-n",
        "100",
        "-r",
        "1",
        "--ucx",
        "off",
        "--peer-via",
        "false",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let e = stderr(&out);
    assert!(
        e.contains("the perf peer on node 2 exited (exit status: 1) before it came up")
            && e.contains("`false`")
            && e.lines().count() == 1,
        "{e}"
    );
}
