//! Unmodified libibverbs programs from Debian (ibverbs-utils) on a fabric through
//! `backplane exec --verbs`, which puts the `backplane-ibverbs` crate's `libibverbs.so.1`
//! first on their library path. The programs are the judges: their own exit status and output.
//! `scripts/setup.sh --test` installs them; elsewhere these tests say so and pass.

mod common;
use common::*;

use std::process::{Command, Output};

fn have(prog: &str) -> bool {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(prog).is_file()));
    if !found {
        eprintln!("skipped: {prog} is not installed (apt-get install ibverbs-utils)");
    }
    found
}

/// The library must have been built beside the binary (`cargo test --workspace` does).
fn lib_built() {
    let lib = std::path::Path::new(BIN).with_file_name("libibverbs.so");
    assert!(
        lib.is_file(),
        "{} is missing: build it with `cargo build -p backplane-ibverbs` (or test the workspace)",
        lib.display()
    );
}

/// `backplane exec --verbs --name F NODE -- ARGS...`
fn exec_verbs(fab: &Fab, node: u32, args: &[&str]) -> Output {
    let n = node.to_string();
    let mut a = vec!["exec", "--verbs", "--name", &fab.name, &n, "--"];
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
}

#[test]
fn a_program_needing_what_is_not_offered_yet_stops_with_its_own_error_not_a_load_failure() {
    if !have("ibv_rc_pingpong") {
        return;
    }
    lib_built();
    let fab = Fab::up("ibv_notyet", 2, &[]);
    // Every symbol it binds at start-up (BIND_NOW) is there; the first verb we do not offer
    // yet fails as libibverbs reports failure and the program says so itself.
    let o = exec_verbs(&fab, 1, &["ibv_rc_pingpong"]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        !t.contains("symbol lookup error") && !t.contains("not found"),
        "{t}"
    );
    assert!(t.contains("Couldn't allocate PD"), "{t}");
    assert!(t.contains("ibv_alloc_pd is not offered yet"), "{t}");
}

#[test]
fn exec_verbs_refuses_an_unknown_node_with_one_line() {
    lib_built();
    let fab = Fab::up("ibv_badnode", 1, &[]);
    let o = exec_verbs(&fab, 7, &["true"]);
    assert!(!o.status.success());
    assert_eq!(stderr(&o).trim().lines().count(), 1, "{}", stderr(&o));
}
