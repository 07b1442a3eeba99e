//! Node liveness: death seen through the OS (pidfd), hangs through the heartbeat, rejoin with
//! a new generation, and what peers see meanwhile.
//!
//! Detection latency is printed, not asserted (the machine is shared); what is asserted is the
//! *mechanism*: a killed agent is reported DOWN with reason `exited` (pidfd path) long before a
//! heartbeat timeout could fire, and a stopped one with reason `hung`.

mod common;
use common::*;

use std::time::{Duration, Instant};

use backplane::dgram::{Addr, DgramError, Wait};
use backplane::fabric::Fabric;
use backplane::wire::{DownReason, NodeState};
use rustix::process::{kill_process, Pid, Signal};

/// Waits on the fabric epoch futex (no polling of pids) until `slot` satisfies `pred`.
fn await_node(
    f: &Fabric,
    slot: u32,
    limit: Duration,
    pred: impl Fn(&backplane::wire::NodeEntryRepr) -> bool,
) -> Option<(backplane::wire::NodeEntryRepr, Duration)> {
    let t0 = Instant::now();
    loop {
        let seen = f.epoch().load(backplane::sync::Ordering::Acquire);
        let info = f.node_info(slot).unwrap();
        if pred(&info) {
            return Some((info, t0.elapsed()));
        }
        if t0.elapsed() > limit {
            return None;
        }
        f.wait_epoch(seen, Duration::from_millis(500));
    }
}

#[test]
fn killed_node_is_seen_down_by_peers_and_rejoins_with_a_new_generation() {
    let fab = Fab::up_restarting("live_kill", 3, 300);
    let f = Fabric::attach(&fab.name).unwrap();
    let old_node2 = f.node(2).unwrap();
    let mut rx = old_node2.bind(7).unwrap();
    let mut tx = f.node(1).unwrap().bind(0).unwrap();
    tx.send_to(Addr::new(2, 7), b"before").unwrap();
    let info = f.node_info(2).unwrap();
    assert_eq!((info.state, info.generation), (NodeState::Ready, 1));

    kill_process(Pid::from_raw(info.pid as i32).unwrap(), Signal::KILL).unwrap();
    let (down, took) = await_node(&f, 2, Duration::from_secs(10), |i| {
        i.state == NodeState::Down
    })
    .expect("node 2 never went DOWN");
    eprintln!("SIGKILL -> DOWN seen after {took:?}");
    assert_eq!(
        down.reason,
        DownReason::Exited,
        "death must come from the pidfd, not a timeout"
    );
    let s = fab.status();
    assert_eq!(s["slots"][1]["state"], "DOWN");
    assert_eq!(s["slots"][1]["down_reason"], "exited");
    assert_eq!(
        s["slots"][0]["state"], "READY",
        "other nodes are unaffected"
    );

    // Peers stop delivering: a send to the DOWN node fails clearly, and the endpoint that
    // lived on it reports itself closed.
    match tx.send(Addr::new(2, 7), b"after", Wait::Never) {
        Err(DgramError::NodeDown(2)) => {}
        other => panic!("expected NodeDown(2), got {other:?}"),
    }
    let mut buf = [0u8; 16];
    assert!(matches!(
        rx.try_recv_from(&mut buf),
        Err(DgramError::Closed(_))
    ));

    let (back, _) = await_node(&f, 2, Duration::from_secs(10), |i| {
        i.state == NodeState::Ready
    })
    .expect("node 2 never rejoined");
    assert_eq!(back.generation, 2);
    assert_ne!(back.pid, info.pid);
    // A handle from the old incarnation is recognised as stale.
    let e = old_node2.bind(8).unwrap_err().to_string();
    assert!(e.contains("restarted (generation 1 -> 2)"), "{e}");
    // Work continues with the new incarnation.
    let mut rx2 = f.node(2).unwrap().bind(7).unwrap();
    tx.send_to(Addr::new(2, 7), b"again").unwrap();
    let (n, from) = rx2
        .recv_from_timeout(&mut buf, Duration::from_secs(5))
        .unwrap();
    assert_eq!((&buf[..n], from.node), (&b"again"[..], 1));
}

#[test]
fn stopped_node_is_seen_down_by_heartbeat_and_rejoins_when_continued() {
    let fab = Fab::up("live_stop", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let info = f.node_info(2).unwrap();
    let pid = Pid::from_raw(info.pid as i32).unwrap();
    kill_process(pid, Signal::STOP).unwrap();
    let res = await_node(&f, 2, Duration::from_secs(10), |i| {
        i.state == NodeState::Down
    });
    let reported = fab.status()["slots"][1]["down_reason"].clone();
    let _ = kill_process(pid, Signal::CONT); // before any assertion: never leave it stopped
    let (down, took) = res.expect("a stopped node never went DOWN");
    eprintln!("SIGSTOP -> DOWN seen after {took:?}");
    assert_eq!(down.reason, DownReason::Hung);
    assert_eq!(reported, "hung");
    let (back, _) = await_node(&f, 2, Duration::from_secs(10), |i| {
        i.state == NodeState::Ready
    })
    .expect("a continued node never rejoined");
    assert_eq!(back.generation, 2);
    assert_eq!(back.pid, info.pid, "same agent, new incarnation");
}

#[test]
fn a_receiver_blocked_when_the_supervisor_is_killed_gets_an_error_not_a_hang() {
    let fab = Fab::up("live_supkill", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let mut rx = f.node(1).unwrap().bind(3).unwrap();
    let waiter = std::thread::spawn(move || {
        let mut buf = [0u8; 8];
        rx.recv_from(&mut buf).map(|_| ())
    });
    std::thread::sleep(Duration::from_millis(50));
    kill_process(Pid::from_raw(fab.supervisor_pid()).unwrap(), Signal::KILL).unwrap();
    let got = wait_for(Duration::from_secs(10), || {
        waiter.is_finished().then_some(())
    });
    assert!(
        got.is_some(),
        "recv_from still blocked after the supervisor died"
    );
    match waiter.join().unwrap() {
        Err(DgramError::Fabric(e)) => assert!(e.to_string().contains("is gone"), "{e}"),
        other => panic!("expected SupervisorGone, got {other:?}"),
    }
}
