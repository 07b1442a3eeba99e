//! `backplane model pcie|eth` through the real binary: the JSON documents users script
//! against, the human tables, and one-line errors with the right exit codes.

use std::process::{Command, Output};

fn bp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_backplane"))
        .args(args)
        .output()
        .expect("run backplane")
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = bp(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs()
}

#[test]
fn model_pcie_json_shows_each_step_down_to_the_effective_bandwidth() {
    let v = json(&["model", "pcie", "--gen", "3", "--lanes", "4", "--json"]);
    assert_eq!(v["version"], 1);
    assert_eq!(v["model"], "pcie-gen3x4");
    assert_eq!(v["max_payload_size"], 256);
    assert_eq!(v["header"], "4dw");
    assert_eq!(v["encoding"], "128b/130b");
    assert_eq!(v["tlp_overhead_bytes"], 24);
    let steps = v["steps"].as_array().unwrap();
    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(names, ["raw", "encoding", "tlp", "dllp"]);
    for s in steps {
        assert!(!s["assumption"].as_str().unwrap().is_empty());
    }
    // 8e9 * 4 / 8 = 4000e6 raw; * 128/130 = 3938.46e6; * 256 / (256 + 24 + 4) = 3550.16e6.
    let bw = |i: usize| steps[i]["bytes_per_s"].as_f64().unwrap();
    assert_eq!(bw(0), 4000e6);
    assert!(close(bw(1), 3938.4615e6, 1e-7));
    assert!(close(bw(3), 3550.1625e6, 1e-7));
    assert_eq!(v["effective_bytes_per_s"], steps[3]["bytes_per_s"]);
    let slope = v["latency_slope_us_per_byte"].as_f64().unwrap();
    assert!(close(slope, 1.0 / 3550.1625, 1e-6));
    assert_eq!(v["per_hop"][0]["mode"], "cut-through");
    assert_eq!(v["per_hop"][1]["mode"], "store-and-forward");
    assert_eq!(v["per_hop"][1]["wait_bytes"], 280);

    // Options change the numbers they should: 3DW header, ECRC, another payload size.
    let v = json(&[
        "model", "pcie", "--gen", "1", "--lanes", "4", "--mps", "128", "--header", "3dw", "--ecrc",
        "--json",
    ]);
    // 1 STP + 2 seq + 12 header + 4 ECRC + 4 LCRC + 1 END = 24 B; 1000e6 * 128 / 156.
    assert_eq!(v["tlp_overhead_bytes"], 24);
    assert_eq!(v["ecrc"], true);
    assert!(close(
        v["effective_bytes_per_s"].as_f64().unwrap(),
        820.5128e6,
        1e-7
    ));
}

#[test]
fn model_eth_json_is_the_rfc_2544_table_unless_a_frame_size_is_given() {
    let v = json(&["model", "eth", "--speed", "10g", "--json"]);
    assert_eq!(v["version"], 1);
    assert_eq!(v["model"], "eth-10g");
    assert_eq!(v["line_rate_bits_per_s"], 10_000_000_000u64);
    assert_eq!(v["per_frame_overhead_bytes"], 20);
    let frames = v["frames"].as_array().unwrap();
    let sizes: Vec<u64> = frames
        .iter()
        .map(|f| f["frame_bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [64, 128, 256, 512, 1024, 1280, 1518]);
    assert_eq!(
        frames[0]["frames_per_s"].as_f64().unwrap().floor(),
        14_880_952.0
    );

    let v = json(&["model", "eth", "--speed", "1g", "--frame", "1518", "--json"]);
    let frames = v["frames"].as_array().unwrap();
    assert_eq!(frames.len(), 1);
    assert_eq!(
        frames[0]["frames_per_s"].as_f64().unwrap().floor(),
        81_274.0
    );
    // 81,274.38 frames/s * 1500 B of payload.
    assert!(close(
        frames[0]["payload_bytes_per_s"].as_f64().unwrap(),
        121.9115e6,
        1e-6
    ));
}

#[test]
fn model_tables_show_each_step_next_to_its_assumption() {
    let out = bp(&["model", "pcie", "--gen", "2", "--lanes", "8"]);
    assert!(out.status.success());
    let t = String::from_utf8_lossy(&out.stdout);
    for want in [
        "pcie-gen2x8",
        "raw ",
        "after encoding ",
        "8b/10b",
        "after TLP overhead ",
        "after DLLP/flow control ",
        "UpdateFC",
        "latency slope:",
        "per hop, cut-through:",
        "per hop, store-and-forward:",
    ] {
        assert!(t.contains(want), "missing {want:?} in\n{t}");
    }
    let out = bp(&["model", "eth", "--speed", "100g"]);
    assert!(out.status.success());
    let t = String::from_utf8_lossy(&out.stdout);
    assert!(t.contains("148,809,523"), "{t}");
    assert!(t.contains("1518"), "{t}");
}

#[test]
fn bad_model_input_gets_a_one_line_error_and_the_right_exit_code() {
    let cases: &[(&[&str], i32, &str)] = &[
        (
            &["model", "pcie", "--gen", "7", "--lanes", "4"],
            1,
            "generation 7",
        ),
        (
            &["model", "pcie", "--gen", "3", "--lanes", "3"],
            1,
            "x3 is not a PCIe link width",
        ),
        (
            &[
                "model", "pcie", "--gen", "3", "--lanes", "4", "--mps", "100",
            ],
            1,
            "max payload size 100",
        ),
        (
            &["model", "eth", "--speed", "2g"],
            1,
            "unknown Ethernet speed '2g'",
        ),
        (
            &["model", "eth", "--speed", "10g", "--frame", "20"],
            1,
            "frame size 20",
        ),
        (&["model", "pcie", "--gen", "x", "--lanes", "4"], 2, "--gen"),
        (&["model", "pcie", "--lanes", "4"], 2, "--gen"),
        (&["model", "token-ring"], 2, ""),
    ];
    for (args, code, want) in cases {
        let out = bp(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(*code), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
        if *code == 1 {
            assert!(err.starts_with("backplane: "), "{args:?}: {err}");
            assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        }
    }
}
