//! Link emulation (`up --link`): datagram streams paced to the model's effective bandwidth,
//! per-hop latency added, cut-through vs store-and-forward.
//!
//! Rates are compared with the model only where the machine can sustain them, judged in the
//! same run: an unpaced fabric is measured first, and a model counts as sustainable when it
//! asks for at most half of that. Pacing can only slow traffic, so "never faster than the
//! model (+10%)" and "never sooner than the modelled latency" hold on any machine.

mod common;
use common::*;

use std::time::{Duration, Instant};

use backplane::dgram::{Addr, Wait};
use backplane::fabric::Fabric;

const SIZE: usize = 64 * 1024;

/// Streams 64 KiB datagrams from node 1 to node 2 for about `secs` at `expected` B/s and
/// returns the rate the receiver saw (first to last datagram).
fn stream_rate(name: &str, expected: f64, secs: f64) -> f64 {
    let f = Fabric::attach(name).unwrap();
    let mut rx = f.node(2).unwrap().bind(40).unwrap();
    let mut tx = f.node(1).unwrap().bind(0).unwrap();
    let count = ((expected * secs) as usize / SIZE).clamp(20, 200_000);
    let reader = std::thread::spawn(move || {
        let mut first = None;
        for i in 0..count {
            rx.recv_with(Wait::For(Duration::from_secs(30)), |_, p| Ok(p.len()))
                .unwrap();
            if i == 0 {
                first = Some(Instant::now());
            }
        }
        let el = first.unwrap().elapsed().as_secs_f64();
        ((count - 1) * SIZE) as f64 / el
    });
    let data = vec![7u8; SIZE];
    for _ in 0..count {
        tx.send_to(Addr::new(2, 40), &data).unwrap();
    }
    reader.join().unwrap()
}

#[test]
fn emulated_pcie_links_pace_datagrams_to_the_model_in_figure_12_order() {
    // The unpaced fabric stays up: a window that falls short is judged against what the
    // machine sustains at that moment, measured right after it.
    let free = Fab::up("link_free", 2, &[]);
    let unpaced = stream_rate(&free.name, 10e9, 0.2);
    let mut last = 0.0;
    for model in ["pcie-gen1x4", "pcie-gen2x4", "pcie-gen3x4", "pcie-gen3x8"] {
        let fab = Fab::up(&format!("link_{model}"), 2, &["--link", model]);
        let want = fab.status()["link"]["bytes_per_s"].as_f64().unwrap();
        let mut sustainable = want <= unpaced / 2.0;
        // A busy machine can only slow a 0.2 s window down, never speed it past the pacing:
        // a window below the model is measured again (up to three in all) and the best one
        // judged; every window must stay under the model's ceiling.
        let mut got = 0.0f64;
        let mut now_unpaced = unpaced;
        for _ in 0..3 {
            let g = stream_rate(&fab.name, want, 0.2);
            assert!(
                g <= want * 1.10,
                "{model}: {g} B/s exceeds the model's {want}"
            );
            got = got.max(g);
            if !sustainable || got >= want * 0.90 {
                break;
            }
            // Short: is it the pacing, or is the machine busy now (other tests, builds)?
            now_unpaced = stream_rate(&free.name, 10e9, 0.1);
            if want > now_unpaced / 2.0 {
                sustainable = false;
            }
        }
        eprintln!(
            "{model}: model {:.0} MB/s, measured {:.0} MB/s (unpaced {:.0} MB/s, {:.0} MB/s \
             last){}",
            want / 1e6,
            got / 1e6,
            unpaced / 1e6,
            now_unpaced / 1e6,
            if sustainable {
                ""
            } else {
                " - beyond what this machine sustains now"
            }
        );
        if sustainable {
            assert!(
                got >= want * 0.90,
                "{model}: {got} B/s is >10% below the model's {want} (unpaced {now_unpaced} B/s \
                 just after)"
            );
            assert!(
                got > last,
                "{model} must be faster than the slower link before it"
            );
            last = got;
        }
    }
    drop(free);
}

/// Median one-way latency (half round trip) of 8-byte datagrams between nodes 1 and 2.
fn one_way_ns(name: &str) -> u64 {
    let f = Fabric::attach(name).unwrap();
    let mut a = f.node(1).unwrap().bind(0).unwrap();
    let mut b = f.node(2).unwrap().bind(50).unwrap();
    let a_addr = a.local_addr();
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 8];
        for _ in 0..300 {
            b.recv_from(&mut buf).unwrap();
            b.send_to(a_addr, &buf).unwrap();
        }
    });
    let mut rtts = Vec::new();
    let mut buf = [0u8; 8];
    for _ in 0..300 {
        let t = Instant::now();
        a.send_to(Addr::new(2, 50), &buf.clone()).unwrap();
        a.recv_from(&mut buf).unwrap();
        rtts.push(t.elapsed().as_nanos() as u64 / 2);
    }
    echo.join().unwrap();
    rtts.sort_unstable();
    rtts[rtts.len() / 2]
}

#[test]
fn store_and_forward_adds_a_whole_frame_per_hop_and_nothing_arrives_early() {
    let sf = Fab::up(
        "link_sf",
        2,
        &["--link", "eth-1g", "--forwarding", "store-and-forward"],
    );
    let hop = sf.status()["link"]["hop_ns"].as_u64().unwrap();
    assert!(
        hop > 10_000,
        "a 1518-byte frame at 1 Gb/s takes > 10 µs: {hop}"
    );
    let lat = one_way_ns(&sf.name);
    eprintln!("eth-1g store-and-forward: hop {hop} ns, measured one-way {lat} ns");
    assert!(
        lat >= hop,
        "delivered after {lat} ns, before the {hop} ns hop ended"
    );
    drop(sf);
    let ct = Fab::up("link_ct", 2, &["--link", "eth-1g"]);
    let hop_ct = ct.status()["link"]["hop_ns"].as_u64().unwrap();
    assert!(
        hop_ct < hop / 10,
        "cut-through waits for the header only: {hop_ct}"
    );
    let lat_ct = one_way_ns(&ct.name);
    eprintln!("eth-1g cut-through: hop {hop_ct} ns, measured one-way {lat_ct} ns");
    assert!(lat_ct >= hop_ct);
    let table = bp(&["status", "--name", &ct.name]);
    assert!(String::from_utf8_lossy(&table.stdout).contains("link eth-1g"));
}

#[test]
fn bad_link_settings_are_refused_clearly() {
    let n = name("linkbad");
    let o = bp(&["up", "--name", &n, "--no-net", "--link", "pcie-gen9x4"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.starts_with("backplane: ") && e.contains("pcie-gen9x4"),
        "{e}"
    );
    let o = bp(&["up", "--name", &n, "--no-net", "--link", "token-ring"]);
    assert!(stderr(&o).contains("unknown link model"), "{}", stderr(&o));
    let o = bp(&[
        "up",
        "--name",
        &n,
        "--no-net",
        "--forwarding",
        "store-and-forward",
    ]);
    assert_eq!(o.status.code(), Some(2), "--forwarding needs --link");
    assert_eq!(leftovers(&n), Vec::<String>::new());
}

fn topology_file(test: &str, text: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("bp-topo-{test}-{}.toml", std::process::id()));
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn traffic_through_a_chain_topology_all_arrives_and_every_hop_is_counted() {
    let file = topology_file(
        "chain",
        "kind = \"distributed\"\nlink = \"pcie-gen3x4\"\nlinks = [{a = 1, b = 2}, {a = 2, b = 3}, {a = 3, b = 4}]\n",
    );
    let fab = Fab::up("topo_chain", 4, &["--topology", file.to_str().unwrap()]);
    let s = fab.status();
    assert_eq!(s["topology"]["kind"], "distributed");
    assert_eq!(s["topology"]["links"].as_array().unwrap().len(), 3);
    let f = Fabric::attach(&fab.name).unwrap();
    let mut rx = f.node(4).unwrap().bind(9).unwrap();
    let mut tx = f.node(1).unwrap().bind(0).unwrap();
    const N: u64 = 2000;
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 4096];
        for i in 0..N {
            let (n, from) = rx
                .recv_from_timeout(&mut buf, Duration::from_secs(20))
                .unwrap();
            assert_eq!(from.node, 1);
            assert_eq!(
                u64::from_le_bytes(buf[..8].try_into().unwrap()),
                i,
                "in order"
            );
            assert_eq!(n, 1000);
        }
    });
    let mut msg = vec![0u8; 1000];
    for i in 0..N {
        msg[..8].copy_from_slice(&i.to_le_bytes());
        tx.send_to(Addr::new(4, 9), &msg).unwrap();
    }
    reader.join().unwrap();
    let s = fab.status();
    for (slot, fwd) in [(1, 0), (2, N), (3, N), (4, 0)] {
        assert_eq!(s["slots"][slot - 1]["fwd_msgs"], fwd, "node {slot}");
    }
    assert_eq!(s["slots"][1]["fwd_bytes"], N * 1000);
    let _ = std::fs::remove_file(file);
}

#[test]
fn when_the_openvpx_hub_goes_down_its_spokes_lose_their_route() {
    let file = topology_file(
        "3slot",
        "# OpenVPX 3-slot distributed layout\nkind = \"distributed\"\nlink = \"pcie-gen2x4\"\n\n[[links]]\na = 1\nb = 2\n\n[[links]]\na = 1\nb = 3\n",
    );
    let fab = Fab::up(
        "topo_hub",
        3,
        &[
            "--topology",
            file.to_str().unwrap(),
            "--restart-delay-ms",
            "0",
        ],
    );
    let f = Fabric::attach(&fab.name).unwrap();
    let _rx = f.node(3).unwrap().bind(9).unwrap();
    let mut tx = f.node(2).unwrap().bind(0).unwrap();
    tx.send_to(Addr::new(3, 9), b"via the hub").unwrap();
    let hub = f.node_info(1).unwrap().pid as i32;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(hub).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let down = wait_for(Duration::from_secs(10), || {
        (f.node_info(1).unwrap().state == backplane::wire::NodeState::Down).then_some(())
    });
    assert!(down.is_some());
    let e = tx.send_to(Addr::new(3, 9), b"no way").unwrap_err();
    let again = tx.send_to(Addr::new(3, 9), b"no way").unwrap_err();
    let text = format!("{e} / {again}");
    assert!(text.contains("node"), "{text}");
    // (The first send may find the ring torn down; the next asks for a route and is told
    // there is none, and why.)
    match again {
        backplane::dgram::DgramError::NoRoute(m) => {
            assert!(
                m.contains("no route from node 2 to node 3") && m.contains("DOWN (1)"),
                "{m}"
            );
        }
        other => panic!("expected a routing failure, got {other:?}"),
    }
    let _ = std::fs::remove_file(file);
}

#[test]
fn a_bad_topology_file_is_refused_with_its_line() {
    let n = name("topobad");
    let file = topology_file(
        "bad",
        "kind = \"distributed\"\nlink = \"pcie-gen2x4\"\nnodes = 2\n[[links]]\na = 1\nb = 9\n",
    );
    let o = bp(&[
        "up",
        "--name",
        &n,
        "--no-net",
        "--topology",
        file.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains(".toml:4: slot 9 does not exist"), "{e}");
    assert_eq!(e.trim_end().lines().count(), 1);
    let o = bp(&[
        "up",
        "--name",
        &n,
        "--no-net",
        "--topology",
        file.to_str().unwrap(),
        "--link",
        "eth-10g",
    ]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "--topology and --link both set the links"
    );
    assert_eq!(leftovers(&n), Vec::<String>::new());
    let _ = std::fs::remove_file(file);
}
