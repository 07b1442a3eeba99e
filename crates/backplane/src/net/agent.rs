//! A node's agent: it takes the node's slot, keeps its heartbeat going and lives as long as
//! the node does (killing it takes the node DOWN). The supervisor starts one per node.
//!
//! With networking it also owns the node's `bp0` (a TAP in the node's namespace) and switches
//! Ethernet frames over the fabric: a TX thread reads frames from the TAP straight into the
//! ring of the destination node (one copy), an RX thread writes frames from its ring straight
//! into the TAP (one copy).
#![forbid(unsafe_code)]

use std::io::IoSliceMut;
use std::sync::Arc;
use std::time::Duration;

use crate::dgram::{Addr, DgramError, Endpoint, Wait};
use crate::fabric::life::HEARTBEAT_PERIOD;
use crate::fabric::{Fabric, FabricError};
use crate::mem::MemError;
use crate::net::{
    self, classify, Dest, Mac, NetConfigError, NetPlan, Tap, MAX_FRAME, NET_PORT, VNET_HDR_LEN,
};
use crate::sync::Ordering;
use crate::wire::{NodeState, WIN_HEARTBEAT_OFF, WIN_IFSTATS_OFF};

pub use crate::fabric::launch::AgentConfig;

/// Runs the agent of the configuration read from standard input (one JSON line, as the
/// supervisor writes it): what `backplane agent` does.
pub fn run_from_stdin() -> Result<(), AgentError> {
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .map_err(|e| AgentError::Start(format!("cannot read the agent's configuration: {e}")))?;
    let cfg: AgentConfig = serde_json::from_str(&line)
        .map_err(|e| AgentError::Start(format!("malformed agent configuration: {e}")))?;
    run(&cfg)
}

/// Why an agent could not run.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Occurs when the configuration on standard input is missing or malformed.
    #[error("{0}")]
    Start(String),
    /// Occurs when the node's network namespace cannot be entered.
    #[error("cannot enter the namespace of node {slot}: {source}")]
    Netns {
        /// The node.
        slot: u32,
        /// The OS error.
        source: std::io::Error,
    },
    /// Occurs when the TAP device cannot be created.
    #[error("cannot create the TAP device bp0: {0}")]
    Tap(std::io::Error),
    /// Occurs when `ip` cannot configure `bp0`.
    #[error("cannot configure bp0: {0}")]
    Interface(std::io::Error),
    /// Occurs when the subnet or MTU is refused.
    #[error(transparent)]
    Config(#[from] NetConfigError),
    /// Occurs when the fabric cannot be attached or answers wrongly.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// Occurs when the node's window is not laid out as expected.
    #[error(transparent)]
    Window(#[from] MemError),
}

/// Runs the agent of `cfg.slot` until the supervisor goes away.
pub fn run(cfg: &AgentConfig) -> Result<(), AgentError> {
    let (name, slot) = (cfg.fabric.as_str(), cfg.slot);
    let fabric = Fabric::attach_agent(name, slot)?;
    let window = fabric.raw_window(slot)?;
    let beat = window.u64_at(WIN_HEARTBEAT_OFF as u64)?;
    beat.fetch_add(1, Ordering::Relaxed);
    // Only bp0 lives in the node's namespace: it is made and configured there, and its
    // counters' file opened there (it keeps showing that namespace); the agent's threads stay
    // in the host's, so that on a fabric across hosts their endpoints listen on the host's
    // address and reach the other hosts straight (from the node's namespace, which has only
    // bp0 and lo, they could not: every frame to another host went through the bridges).
    let (tap, mut dev_stats) = match &cfg.net {
        Some((subnet, mtu)) => {
            let plan = NetPlan::new(subnet, *mtu, fabric.nodes())?;
            let (tap, stats) = net::in_netns(&net::netns_name(name, slot), || {
                let tap = setup_interface(slot, &plan)?;
                Ok::<_, AgentError>((tap, std::fs::File::open("/proc/thread-self/net/dev").ok()))
            })
            .map_err(|source| AgentError::Netns { slot, source })??;
            (Some(Arc::new(tap)), stats)
        }
        None => (None, None),
    };
    fabric.agent_ready(slot)?;
    if let Some(tap) = tap {
        let (f1, t1) = (fabric.clone(), tap.clone());
        std::thread::spawn(move || rx_loop(&f1, slot, &t1));
        let f2 = fabric.clone();
        std::thread::spawn(move || tx_loop(&f2, slot, &tap));
        fabric.net_ready(slot)?;
    }
    loop {
        // Sleep without holding the control socket: the frame threads share it.
        std::thread::sleep(HEARTBEAT_PERIOD);
        if fabric.supervisor_gone(Duration::ZERO) {
            return Ok(());
        }
        beat.fetch_add(1, Ordering::Relaxed);
        if let Some(f) = &mut dev_stats {
            publish_ifstats(&window, f);
        }
    }
}

fn setup_interface(slot: u32, plan: &NetPlan) -> Result<Tap, AgentError> {
    let tap = Tap::create(net::IFNAME).map_err(AgentError::Tap)?;
    let mac = Mac::of_slot(slot).to_string();
    let mtu = plan.mtu.to_string();
    let ip = |args: &[&str]| net::ip_here(args).map_err(AgentError::Interface);
    ip(&["link", "set", net::IFNAME, "address", &mac, "mtu", &mtu])?;
    ip(&["addr", "add", &plan.cidr(slot), "dev", net::IFNAME])?;
    ip(&["link", "set", net::IFNAME, "up"])?;
    Ok(tap)
}

/// Copies the kernel's counters of bp0 into the window for `status`, from `dev`: the node's
/// `/proc/net/dev`, opened in its namespace (unlike `/sys`, which is the host's here).
fn publish_ifstats(window: &crate::mem::Region, dev: &mut std::fs::File) {
    use std::io::{Read, Seek};
    let mut text = String::new();
    if dev.rewind().is_err() || dev.read_to_string(&mut text).is_err() {
        return;
    }
    let Some(v) = net::parse_net_dev(&text, net::IFNAME) else {
        return;
    };
    for (i, x) in v.iter().enumerate() {
        if let Ok(a) = window.u64_at((WIN_IFSTATS_OFF + 8 * i) as u64) {
            a.store(*x, Ordering::Relaxed);
        }
    }
}

/// Polls before a frame thread sleeps: the agent shares the CPUs with the programs whose
/// traffic it carries, so it spins briefly (a few µs) rather than the library default.
const AGENT_SPIN_POLLS: u32 = 200;

/// Binds `port` on our node, waiting (across a DOWN → READY rejoin) until the node is READY.
fn bind_when_ready(fabric: &Fabric, slot: u32, port: u32) -> Endpoint {
    loop {
        let seen = fabric.epoch().load(Ordering::Acquire);
        let ready = fabric
            .node_info(slot)
            .is_ok_and(|i| i.state == NodeState::Ready);
        if ready {
            match fabric
                .node(slot)
                .map_err(DgramError::from)
                .and_then(|n| n.bind(port))
            {
                Ok(mut ep) => {
                    ep.set_spin_polls(AGENT_SPIN_POLLS);
                    return ep;
                }
                Err(DgramError::Fabric(FabricError::Io(_))) => std::process::exit(0),
                Err(_) => {}
            }
        }
        fabric.wait_epoch(seen, Duration::from_millis(200));
    }
}

/// How many frames the RX loop takes a call at most.
const RX_BURST: usize = 64;

/// Fabric → TAP: every frame from a peer is written from ring memory into the TAP — from
/// another host, from UCX's receive buffer, every frame of a look (`recv_many_with`: one a
/// call copied the others of a look out of UCX's buffer first).
fn rx_loop(fabric: &Fabric, slot: u32, tap: &Tap) {
    let mut ep = bind_when_ready(fabric, slot, NET_PORT);
    loop {
        let mut refused = 0;
        let r = ep.recv_many_with(Wait::Forever, RX_BURST, |_, frame| {
            // The kernel refused the frame (bad header, link down): a drop.
            refused += u32::from(tap.write(frame).is_err());
            Ok(())
        });
        match r {
            Ok(_) => (0..refused).for_each(|_| ep.count_drop()),
            Err(_) => ep = bind_when_ready(fabric, slot, NET_PORT),
        }
    }
}

/// TAP → fabric. A frame's destination is known only once it is read, so the frame is read
/// straight into the ring of the node the previous frame went to (the common case: one flow);
/// if it turns out to be for someone else, or for everyone, it is sent from a spill buffer.
///
/// On a fabric across hosts the frame is read there only if one waits, and the wait for the
/// next is outside the send: a send to a node of another host fills its message under the lock
/// of the endpoint's UCX worker, and a read that waited there for the node's next frame kept
/// the worker's waker from moving what UCX still held (seen: a frame's 86 bytes, until the
/// node sent again), while the waker, finding the lock taken, looked again every 50 µs for as
/// long as the node sent nothing (~20 000 wake-ups a second of an idle node's agent after IP
/// traffic between hosts). On one host the read waits where it is, as before (one system call
/// a frame).
fn tx_loop(fabric: &Fabric, slot: u32, tap: &Tap) {
    const HDR: usize = VNET_HDR_LEN + 14;
    let nodes = fabric.nodes();
    let wait_outside = fabric.spans_hosts();
    let mut ep = bind_when_ready(fabric, slot, 0);
    let mut guess: Option<u32> = None;
    let mut spill = vec![0u8; MAX_FRAME];
    let mut hdr = [0u8; HDR];
    loop {
        let mut spilled = 0usize;
        let mut sent_direct = false;
        let mut none_waits = false;
        if let Some(g) = guess {
            let r = ep.send_with_max(Addr::new(g, NET_PORT), MAX_FRAME, Wait::Never, |buf| {
                let mut bufs = [IoSliceMut::new(&mut hdr), IoSliceMut::new(&mut buf[HDR..])];
                let n = if wait_outside {
                    match tap.try_read_vectored(&mut bufs) {
                        Ok(Some(n)) => n,
                        Ok(None) => {
                            none_waits = true;
                            return None;
                        }
                        Err(_) => return None,
                    }
                } else {
                    tap.read_vectored(&mut bufs).ok()?
                };
                let head = n.min(HDR);
                buf[..head].copy_from_slice(&hdr[..head]);
                if classify(&buf[..n], nodes, slot) == Dest::Node(g) {
                    return Some(n);
                }
                spill[..n].copy_from_slice(&buf[..n]);
                spilled = n;
                None
            });
            match r {
                Ok(true) => sent_direct = true,
                Ok(false) => {}
                Err(_) => guess = None, // ring full, node down, ...: read into the spill buffer
            }
        }
        if sent_direct {
            continue;
        }
        if none_waits {
            tap.wait_readable();
            continue;
        }
        if spilled == 0 {
            match tap.read_vectored(&mut [IoSliceMut::new(&mut spill)]) {
                Ok(n) => spilled = n,
                Err(_) => continue,
            }
        }
        let frame = &spill[..spilled];
        let targets: Vec<u32> = match classify(frame, nodes, slot) {
            Dest::Node(n) => {
                guess = Some(n);
                vec![n]
            }
            Dest::All => (1..=nodes)
                .filter(|&n| n != slot)
                .filter(|&n| {
                    fabric
                        .node_info(n)
                        .is_ok_and(|i| i.state == NodeState::Ready)
                })
                .collect(),
            Dest::Drop => {
                ep.count_drop();
                continue;
            }
        };
        for n in targets {
            match ep.send(
                Addr::new(n, NET_PORT),
                frame,
                Wait::For(Duration::from_millis(100)),
            ) {
                Ok(()) => {}
                Err(DgramError::Closed(_)) => {
                    ep = bind_when_ready(fabric, slot, 0);
                }
                Err(_) => ep.count_drop(), // peer down or not listening: the frame is lost, as on a wire
            }
        }
    }
}
