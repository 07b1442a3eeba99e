//! Shared harness for the multi-process tests: start/stop fabrics through the real binary,
//! find leftovers, and re-run this test binary as a child process playing a role.
#![allow(dead_code)]

use std::process::{Command, Output};

#[path = "../../../backplane/tests/common/shared.rs"]
mod shared;
pub use shared::*;

pub const BIN: &str = env!("CARGO_BIN_EXE_backplane");

/// Whether an iperf3 client's JSON report (`-J`) says it failed: iperf3 3.12 exits 0 when it
/// cannot connect (a server not listening yet), with the error only in its report.
pub fn iperf3_refused(stdout: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(stdout)
        .is_ok_and(|j| j.get("error").is_some_and(|e| !e.is_null()))
}

/// perftest's eight programs, every RDMA operation's bandwidth and latency.
pub const PERFTEST: [&str; 8] = [
    "ib_write_bw",
    "ib_write_lat",
    "ib_read_bw",
    "ib_read_lat",
    "ib_send_bw",
    "ib_send_lat",
    "ib_atomic_bw",
    "ib_atomic_lat",
];

/// The start of the MPI tests' command lines: two ranks, in nodes 1 and 2, within 2 minutes.
pub const MPIRUN_TWO_NODES: [&str; 8] = [
    "timeout",
    "120",
    "mpirun",
    "--allow-run-as-root",
    "-np",
    "2",
    "--host",
    "node1,node2",
];

/// Compiles `tests/c/mpi_pingpong.c` with `mpicc` into `dir` (made if missing); the program.
pub fn mpi_pingpong(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let exe = dir.join("mpi_pingpong");
    let cc = Command::new("mpicc")
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/mpi_pingpong.c"))
        .output()
        .expect("run mpicc");
    assert!(
        cc.status.success(),
        "mpicc: {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    exe
}

/// Checks that `mpirun` of `mpi_pingpong` (`how`) succeeded with both ranks in nodes 1 and 2
/// and every part done; its output.
pub fn mpi_pingpong_ran(how: &str, out: &Output) -> String {
    let t = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{how}: {t}");
    for want in [
        "rank 0 in node 1",
        "rank 1 in node 2",
        "pingpong  262144 B:",
        "put and get: 512 words right",
        "accumulate: 2",
        "allreduce: 3",
    ] {
        assert!(t.contains(want), "{how}: no '{want}' in:\n{t}");
    }
    t
}

/// Runs `backplane ARGS...`.
pub fn bp(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run backplane")
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

/// True if program `prog` is on PATH; says it skips otherwise (scripts/setup.sh --test
/// installs every program the tests run).
pub fn have(prog: &str) -> bool {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(prog).is_file()));
    if !found {
        eprintln!("skipped: {prog} is not installed (scripts/setup.sh --test installs it)");
    }
    found
}

/// stderr as a string.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Checks that the shared library `file` (e.g. `libbackplane_sockets.so`) was built beside the
/// binary from the current sources of workspace crate `krate` (`cargo test --workspace`
/// builds it; `cargo test -p backplane-cli` alone does not, and a library older than its
/// sources would test yesterday's code).
#[allow(dead_code)] // each test file uses what it needs
pub fn lib_built(file: &str, krate: &str) {
    let lib = std::path::Path::new(BIN).with_file_name(file);
    let built = std::fs::metadata(&lib).and_then(|m| m.modified());
    let Ok(built) = built else {
        panic!(
            "{} is missing: build it with `cargo build -p {krate}` (or test the workspace)",
            lib.display()
        );
    };
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(krate)
        .join("src");
    let newest = std::fs::read_dir(&src)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok()?.modified().ok())
        .max();
    if let Some(newest) = newest {
        assert!(
            newest <= built,
            "{} is older than {}: rebuild it with `cargo build -p {krate}` (or test the workspace)",
            lib.display(),
            src.display()
        );
    }
}
