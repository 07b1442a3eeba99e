//! Datagram endpoints across nodes and processes: ordering, no loss, blocking / non-blocking /
//! timed operations, zero-copy, full rings, dead and hostile peers.

mod common;
use common::*;

use std::io::{Seek, Write};
use std::time::Duration;

use backplane::dgram::{Addr, DgramError, Wait};
use backplane::fabric::Fabric;
use backplane::wire::MAX_DGRAM;

fn payload(seq: u64, len: usize) -> Vec<u8> {
    let mut v = vec![(seq % 251) as u8; len.max(8)];
    v[..8].copy_from_slice(&seq.to_le_bytes());
    v.truncate(len.max(8));
    v
}

#[test]
fn datagrams_of_every_size_arrive_in_order_and_intact() {
    let fab = Fab::up("dgram_order", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    assert!(
        !f.spans_hosts(),
        "one host: waits spin without giving the CPU away"
    );
    let mut rx = f.node(2).unwrap().bind(100).unwrap();
    let mut tx = f.node(1).unwrap().bind(0).unwrap();
    let src = tx.local_addr();
    let sizes: Vec<usize> = (0..3000)
        .map(|i| 8 + (i * 7919) % (MAX_DGRAM - 8))
        .collect();
    let expect = sizes.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; MAX_DGRAM];
        for (seq, &len) in expect.iter().enumerate() {
            let (n, from) = rx
                .recv_from_timeout(&mut buf, Duration::from_secs(20))
                .unwrap();
            assert_eq!(from, src);
            assert_eq!(&buf[..n], &payload(seq as u64, len)[..], "datagram {seq}");
        }
        rx.stats()
    });
    for (seq, &len) in sizes.iter().enumerate() {
        tx.send_to(Addr::new(2, 100), &payload(seq as u64, len))
            .unwrap();
    }
    let rs = reader.join().unwrap();
    assert_eq!(rs.received, 3000);
    assert_eq!(tx.stats().sent, 3000);
    assert_eq!(
        tx.stats().sent_bytes,
        sizes.iter().map(|&s| s as u64).sum::<u64>()
    );
    let st = fab.status();
    assert_eq!(st["slots"][0]["tx_msgs"], 3000);
    assert_eq!(st["slots"][1]["rx_msgs"], 3000);
}

#[test]
fn a_full_ring_gives_would_block_or_blocks_and_loses_nothing() {
    let fab = Fab::up("dgram_full", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let mut rx = f.node(2).unwrap().bind(5).unwrap();
    let mut tx = f.node(1).unwrap().bind(0).unwrap();
    let dst = Addr::new(2, 5);
    let mut queued = 0u64;
    loop {
        match tx.try_send_to(dst, &payload(queued, MAX_DGRAM)) {
            Ok(()) => queued += 1,
            Err(DgramError::WouldBlock) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        queued >= 10,
        "a 1 MiB ring holds at least ten 64 KiB datagrams, got {queued}"
    );
    assert!(matches!(
        tx.send(
            dst,
            &payload(queued, MAX_DGRAM),
            Wait::For(Duration::from_millis(20))
        ),
        Err(DgramError::TimedOut)
    ));
    let total = queued + 50;
    let reader = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        let mut buf = vec![0u8; MAX_DGRAM];
        for seq in 0..total {
            let (n, _) = rx.recv_from(&mut buf).unwrap();
            assert_eq!(&buf[..n], &payload(seq, MAX_DGRAM)[..], "datagram {seq}");
        }
    });
    for seq in queued..total {
        tx.send_to(dst, &payload(seq, MAX_DGRAM)).unwrap(); // blocks until the reader drains
    }
    reader.join().unwrap();
}

#[test]
fn a_blocking_send_waits_for_the_room_that_memory_just_freed_makes() {
    let fab = Fab::up("dgram_room", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let mut rx = f.node(2).unwrap().bind(5).unwrap();
    let n1 = f.node(1).unwrap();
    let dst = Addr::new(2, 5);
    // Routes to node 2 (each a ring in its window) until its window refuses one.
    let mut senders = Vec::new();
    let full = loop {
        let mut tx = n1.bind(0).unwrap();
        match tx.try_send_to(dst, b"x") {
            Ok(()) => senders.push(tx),
            Err(e) => break e,
        }
        assert!(
            senders.len() < 64,
            "an 8 MiB window holds fewer than 64 rings"
        );
    };
    assert!(full.to_string().contains("window is full"), "{full}");
    let mut buf = [0u8; 16];
    for _ in &senders {
        let (n, _) = rx
            .recv(&mut buf, Wait::For(Duration::from_secs(5)))
            .unwrap();
        assert_eq!(&buf[..n], b"x");
    }
    // Their rings are freed once the receiver retires them (a receive finds them closed and
    // drained), reusable after the allocator's quarantine (1 s).
    drop(senders);
    let mut tx = n1.bind(0).unwrap();
    let t0 = std::time::Instant::now();
    loop {
        assert!(matches!(
            rx.recv(&mut buf, Wait::Never),
            Err(DgramError::WouldBlock)
        ));
        let e = tx.try_send_to(dst, b"y").unwrap_err();
        if e.to_string().contains("freed less than") {
            break; // a send that may not wait is refused, saying a retry may succeed
        }
        assert!(
            t0.elapsed() < Duration::from_millis(500),
            "rings not freed: {e}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let e = tx
        .send(dst, b"y", Wait::For(Duration::from_millis(10)))
        .unwrap_err();
    assert!(
        e.to_string().contains("freed less than"),
        "a short wait: {e}"
    );
    // A send that may wait does, until the memory comes back (a program started right after
    // another one ended, on the routes that one had).
    let t0 = std::time::Instant::now();
    tx.send(dst, b"y", Wait::Forever).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let (n, _) = rx
        .recv(&mut buf, Wait::For(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(&buf[..n], b"y");
}

#[test]
fn receive_modes_zero_copy_and_size_errors() {
    let fab = Fab::up("dgram_modes", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let mut rx = f.node(2).unwrap().bind(9).unwrap();
    let mut tx = f.node(1).unwrap().bind(0).unwrap();
    let mut buf = [0u8; 32];
    assert!(matches!(
        rx.try_recv_from(&mut buf),
        Err(DgramError::WouldBlock)
    ));
    assert!(matches!(
        rx.recv_from_timeout(&mut buf, Duration::from_millis(30)),
        Err(DgramError::TimedOut)
    ));
    assert!(matches!(
        tx.send_to(Addr::new(2, 9), &vec![0; MAX_DGRAM + 1]),
        Err(DgramError::TooBig(_))
    ));
    // Zero-copy both ways.
    tx.send_with(Addr::new(2, 9), 100, Wait::Forever, |b| {
        b.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8)
    })
    .unwrap();
    // Too small a buffer: an error, and the datagram stays queued.
    assert!(matches!(
        rx.try_recv_from(&mut buf),
        Err(DgramError::BufferTooSmall {
            have: 32,
            need: 100
        })
    ));
    let sum = rx
        .recv_with(Wait::Never, |from, p| {
            assert_eq!(from, tx.local_addr());
            Ok(p.iter().map(|&x| x as u64).sum::<u64>())
        })
        .unwrap();
    assert_eq!(sum, (0..100u64).sum::<u64>());
    // Nothing bound there: refused, counted as a drop.
    assert!(matches!(
        tx.send_to(Addr::new(2, 4444), b"x"),
        Err(DgramError::Unreachable(_))
    ));
    assert_eq!(tx.stats().dropped, 1);
    assert!(matches!(
        tx.send_to(Addr::new(9, 1), b"x"),
        Err(DgramError::Fabric(_))
    ));
    // A port can be bound once.
    assert!(f.node(2).unwrap().bind(9).is_err());
}

#[test]
fn recv_many_takes_what_is_there_up_to_its_limit_and_a_refused_datagram_stays_next() {
    let fab = Fab::up("dgram_many", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let mut rx = f.node(2).unwrap().bind(9).unwrap();
    let mut tx = f.node(1).unwrap().bind(0).unwrap();
    let to = Addr::new(2, 9);
    assert!(matches!(
        rx.recv_many_with(Wait::Never, 8, |_, _| Ok(())),
        Err(DgramError::WouldBlock)
    ));
    for i in 0..5u8 {
        tx.send_to(to, &[i; 3]).unwrap();
    }
    let mut got = Vec::new();
    let mut take = |rx: &mut backplane::dgram::Endpoint, max, refuse: Option<u8>| {
        rx.recv_many_with(Wait::Never, max, |from, p| {
            assert_eq!(from, tx.local_addr());
            if Some(p[0]) == refuse {
                return Err(DgramError::BufferTooSmall {
                    have: 0,
                    need: p.len(),
                });
            }
            got.push(p.to_vec());
            Ok(())
        })
    };
    // At most the limit; then up to the refused one (what came before it counts); the
    // refused one first of a call is the error; then the rest.
    assert_eq!(take(&mut rx, 2, None).unwrap(), 2);
    assert_eq!(take(&mut rx, 8, Some(3)).unwrap(), 1);
    assert!(matches!(
        take(&mut rx, 8, Some(3)),
        Err(DgramError::BufferTooSmall { have: 0, need: 3 })
    ));
    assert_eq!(take(&mut rx, 8, None).unwrap(), 2);
    assert_eq!(got, (0..5u8).map(|i| vec![i; 3]).collect::<Vec<_>>());
    // With nothing there it waits for the first.
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        tx.send_to(to, b"late").unwrap();
        tx
    });
    let mut late = Vec::new();
    let n = rx
        .recv_many_with(Wait::For(Duration::from_secs(10)), 8, |_, p| {
            late.push(p.to_vec());
            Ok(())
        })
        .unwrap();
    assert_eq!((n, late), (1, vec![b"late".to_vec()]));
    drop(sender.join().unwrap());
}

#[test]
fn doorbells_and_scratchpads_work_between_nodes() {
    let fab = Fab::up("dgram_bells", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let n1 = f.node(1).unwrap();
    let n2 = f.node(2).unwrap();
    assert_eq!(
        n2.wait_doorbell(Some(Duration::from_millis(20))).unwrap(),
        0
    );
    let t = std::thread::spawn(move || n2.wait_doorbell(Some(Duration::from_secs(10))).unwrap());
    std::thread::sleep(Duration::from_millis(20));
    n1.ring_doorbell(2, 1 << 3).unwrap();
    assert_eq!(t.join().unwrap(), 1 << 3);
    n1.write_scratchpad(2, 5, 0xfeed).unwrap();
    assert_eq!(f.node(2).unwrap().read_scratchpad(5).unwrap(), 0xfeed);
    assert!(n1.write_scratchpad(2, 99, 1).is_err());
}

/// Child role: stream numbered datagrams from `BP_NODE` to 1:`BP_PORT`, recording after each
/// acknowledged send how many were acknowledged, until killed or `BP_COUNT` are sent.
#[test]
fn role_sender() {
    let Some(role) = role() else { return };
    assert_eq!(role, "sender");
    let env = |k: &str| std::env::var(k).unwrap();
    let f = Fabric::attach(&env("BP_FABRIC")).unwrap();
    let node: u32 = env("BP_NODE").parse().unwrap();
    let count: u64 = env("BP_COUNT").parse().unwrap();
    let mut ep = f.node(node).unwrap().bind(0).unwrap();
    let mut acked = std::fs::OpenOptions::new()
        .write(true)
        .open(env("BP_ACKED"))
        .unwrap();
    for seq in 0..count {
        ep.send_to(
            Addr::new(1, env("BP_PORT").parse().unwrap()),
            &payload(seq, 1000),
        )
        .unwrap();
        acked.seek(std::io::SeekFrom::Start(0)).unwrap();
        acked.write_all(&(seq + 1).to_le_bytes()).unwrap();
    }
}

#[test]
fn a_sender_killed_mid_stream_loses_nothing_it_had_acknowledged() {
    if role().is_some() {
        return;
    }
    let fab = Fab::up("dgram_killsender", 3);
    let f = Fabric::attach(&fab.name).unwrap();
    let mut rx = f.node(1).unwrap().bind(77).unwrap();
    let dir = std::env::temp_dir();
    let ack_a = dir.join(format!("bp-acked-a-{}", std::process::id()));
    let ack_b = dir.join(format!("bp-acked-b-{}", std::process::id()));
    std::fs::write(&ack_a, [0u8; 8]).unwrap();
    std::fs::write(&ack_b, [0u8; 8]).unwrap();
    let spawn = |node: &str, count: &str, acked: &std::path::Path| {
        spawn_role(
            "role_sender",
            "sender",
            &[
                ("BP_FABRIC", fab.name.clone()),
                ("BP_NODE", node.into()),
                ("BP_PORT", "77".into()),
                ("BP_COUNT", count.into()),
                ("BP_ACKED", acked.display().to_string()),
            ],
        )
    };
    let mut a = spawn("2", "100000000", &ack_a);
    let mut b = spawn("3", "20000", &ack_b);
    let mut buf = vec![0u8; 2048];
    let mut next = std::collections::HashMap::<u32, u64>::new();
    let mut check = |rx: &mut backplane::dgram::Endpoint, limit: Duration| -> Option<u32> {
        match rx.recv_from_timeout(&mut buf, limit) {
            Ok((n, from)) => {
                let want = next.entry(from.node).or_insert(0);
                assert_eq!(
                    &buf[..n],
                    &payload(*want, 1000)[..],
                    "from {from} seq {want}"
                );
                *want += 1;
                Some(from.node)
            }
            Err(DgramError::TimedOut) => None,
            Err(e) => panic!("{e}"),
        }
    };
    // Let A stream for a while, then kill it while its ring is busy.
    let mut from_a = 0;
    while from_a < 5000 {
        if check(&mut rx, Duration::from_secs(20)) == Some(2) {
            from_a += 1;
        }
    }
    a.kill().unwrap();
    a.wait().unwrap();
    let acked_a = u64::from_le_bytes(std::fs::read(&ack_a).unwrap()[..8].try_into().unwrap());
    // Drain: everything A had acknowledged is still delivered, B carries on to the end.
    while check(&mut rx, Duration::from_millis(500)).is_some() {}
    assert!(b.wait().unwrap().success(), "the other sender carries on");
    let acked_b = u64::from_le_bytes(std::fs::read(&ack_b).unwrap()[..8].try_into().unwrap());
    while check(&mut rx, Duration::from_millis(200)).is_some() {}
    assert!(
        next[&2] >= acked_a,
        "received {} from the killed sender, it had {acked_a} acknowledged",
        next[&2]
    );
    assert_eq!(next[&3], 20000);
    assert_eq!(acked_b, 20000);
    let _ = std::fs::remove_file(&ack_a);
    let _ = std::fs::remove_file(&ack_b);
}

#[test]
fn several_processes_on_one_node_each_hold_endpoints() {
    if role().is_some() {
        return;
    }
    let fab = Fab::up("dgram_multiproc", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let mut rx = f.node(1).unwrap().bind(78).unwrap();
    let kids: Vec<_> = (0..3)
        .map(|_| {
            let ack = std::env::temp_dir().join(format!(
                "bp-acked-mp-{}-{}",
                std::process::id(),
                rand_suffix()
            ));
            std::fs::write(&ack, [0u8; 8]).unwrap();
            (
                spawn_role(
                    "role_sender",
                    "sender",
                    &[
                        ("BP_FABRIC", fab.name.clone()),
                        ("BP_NODE", "2".into()),
                        ("BP_PORT", "78".into()),
                        ("BP_COUNT", "2000".into()),
                        ("BP_ACKED", ack.display().to_string()),
                    ],
                ),
                ack,
            )
        })
        .collect();
    let mut per_sender = std::collections::HashMap::<Addr, u64>::new();
    let mut buf = vec![0u8; 2048];
    for _ in 0..6000 {
        let (n, from) = rx
            .recv_from_timeout(&mut buf, Duration::from_secs(20))
            .unwrap();
        let want = per_sender.entry(from).or_insert(0);
        assert_eq!(&buf[..n], &payload(*want, 1000)[..]);
        *want += 1;
    }
    assert_eq!(per_sender.len(), 3, "three distinct endpoints on node 2");
    assert!(per_sender.keys().all(|a| a.node == 2));
    for (mut k, ack) in kids {
        assert!(k.wait().unwrap().success());
        let _ = std::fs::remove_file(ack);
    }
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64
}

fn scribble(w: &backplane::mem::Region, from: u64, to: u64, seed: u64) {
    let mut x = seed;
    let mut chunk = vec![0u8; 4096];
    let mut off = from;
    while off < to {
        for b in chunk.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        let n = (to - off).min(4096) as usize;
        w.write(off, &chunk[..n]).unwrap();
        off += n as u64;
    }
}

/// A peer has every window it talks to mapped read-write, as a sender must. Here the "peer"
/// fills the receiver's window with pseudo-random bytes: first the ring alone (header,
/// indices, records), then the whole heap. The receiver must report errors and count drops,
/// never panic or read out of bounds; the sender must learn its ring was retired; the fabric
/// must keep working.
#[test]
fn a_hostile_peer_scribbling_over_a_window_causes_errors_not_crashes() {
    let fab = Fab::up("dgram_hostile", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let mut rx = f.node(1).unwrap().bind(1).unwrap();
    let mut tx = f.node(2).unwrap().bind(0).unwrap();
    let w = f.raw_window(1).unwrap();
    let mut buf = vec![0u8; MAX_DGRAM];
    let mut outcomes = std::collections::BTreeMap::<String, u32>::new();
    let note = |outcomes: &mut std::collections::BTreeMap<String, u32>,
                r: &Result<(usize, Addr), DgramError>| {
        let k = match r {
            Ok(_) => "Ok".to_string(),
            Err(e) => format!("{e:?}")
                .split(['(', ' ', '{'])
                .next()
                .unwrap()
                .to_string(),
        };
        *outcomes.entry(k).or_default() += 1;
    };
    // The endpoint record is the first allocation of the heap; the ring follows it.
    let ring_start = backplane::wire::WINDOW_HEAP_OFF + backplane::wire::ENDPOINT_LEN;
    for round in 0..20u64 {
        for i in 0..20u64 {
            let _ = tx.try_send_to(Addr::new(1, 1), &payload(i, 500));
        }
        scribble(
            &w,
            ring_start,
            w.len() as u64,
            0x9E37_79B9_7F4A_7C15 ^ round,
        );
        for _ in 0..30 {
            note(
                &mut outcomes,
                &rx.recv_from_timeout(&mut buf, Duration::from_millis(1)),
            );
        }
    }
    eprintln!(
        "outcomes with a scribbled ring: {outcomes:?}, receiver {:?}",
        rx.stats()
    );
    assert!(
        rx.stats().dropped >= 1,
        "corruption must be counted: {:?}",
        rx.stats()
    );
    scribble(&w, backplane::wire::WINDOW_HEAP_OFF, w.len() as u64, 7);
    for _ in 0..50 {
        note(
            &mut outcomes,
            &rx.recv_from_timeout(&mut buf, Duration::from_millis(1)),
        );
        let _ = tx.try_send_to(Addr::new(1, 1), b"more");
    }
    eprintln!("outcomes after scribbling the whole heap: {outcomes:?}");
    // The supervisor and the rest of the fabric are still fine.
    let st = fab.status();
    assert_eq!(st["slots"][0]["state"], "READY");
    assert!(st["slots"][0]["drops"].as_u64().unwrap() >= 1);
    let mut rx2 = f.node(2).unwrap().bind(2).unwrap();
    let mut tx2 = f.node(2).unwrap().bind(0).unwrap();
    tx2.send_to(Addr::new(2, 2), b"still works").unwrap();
    let (n, _) = rx2
        .recv_from_timeout(&mut buf, Duration::from_secs(5))
        .unwrap();
    assert_eq!(&buf[..n], b"still works");
}
