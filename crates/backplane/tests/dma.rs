//! Raw DMA across nodes: scatter/gather jobs between regions of node 1 and node 2 (in this
//! process and in a child process owning node 2's regions), integrity by checksum, every
//! refusal naming its segment, read-only grants mapped read-only, and a node killed mid-run.

mod common;
use common::*;

use std::time::{Duration, Instant};

use backplane::dma::*;
use backplane::fabric::Fabric;
use backplane::verbs::*;
use sha2::{Digest, Sha256};

const RW: AccessFlags = AccessFlags::from_bits_retain(
    AccessFlags::LOCAL_WRITE.bits()
        | AccessFlags::REMOTE_WRITE.bits()
        | AccessFlags::REMOTE_READ.bits(),
);

fn engines(n: usize) -> DmaEngines {
    DmaEngines::start(&DmaConfig {
        engines: n,
        ..DmaConfig::default()
    })
    .unwrap()
}

/// Waits for the next completion (a hang ends the test after 20 s).
fn next(q: &DmaQueue) -> DmaWc {
    let end = Instant::now() + Duration::from_secs(20);
    let mut wc = [DmaWc::default()];
    loop {
        if q.poll(&mut wc) == 1 {
            return wc[0];
        }
        assert!(Instant::now() < end, "no DMA completion");
        q.wait(1, Some(Duration::from_millis(100)));
    }
}

fn run(q: &DmaQueue, id: u64, segs: &[Segment]) -> DmaWc {
    q.submit(&Job::new(id, segs)).unwrap();
    let w = next(q);
    assert_eq!(w.id, id);
    w
}

/// `len` pseudo-random bytes of `seed`.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    let mut x = seed | 1;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    buf
}

/// Fills the first `len` bytes of `mr` with `pattern(len, seed)`.
fn fill(mr: &Mr, len: usize, seed: u64) {
    mr.write(0, &pattern(len, seed)).unwrap();
}

fn seg(src: Mem, src_off: u64, dst: Mem, dst_off: u64, len: u64) -> Segment {
    Segment {
        src,
        src_off,
        dst,
        dst_off,
        len,
    }
}

#[test]
fn many_small_segments_and_a_large_multi_segment_job_arrive_intact() {
    let fab = Fab::up("dma_integrity", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let c1 = Context::open(&f.node(1).unwrap()).unwrap();
    let c2 = Context::open(&f.node(2).unwrap()).unwrap();
    let src = c1
        .alloc_pd()
        .alloc_mr(64 << 20, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let back = c1
        .alloc_pd()
        .alloc_mr(1 << 20, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let dst = c2.alloc_pd().alloc_mr(64 << 20, RW).unwrap();
    fill(&src, src.len(), 42);
    let e = engines(2);
    let q = DmaQueue::new(&c1, &e, 16);
    let (l, r) = (
        Mem::local(&src),
        Mem::Remote {
            node: 2,
            rkey: dst.rkey(),
        },
    );

    // 4096 segments of 256 B, scattered: source block i lands at block 4095 - i.
    let small: Vec<Segment> = (0..4096u64)
        .map(|i| seg(l, i * 256, r, (4095 - i) * 256, 256))
        .collect();
    let w = run(&q, 1, &small);
    assert_eq!(
        (w.status, w.segment, w.bytes),
        (DmaStatus::Success, None, 1 << 20)
    );
    let (dst_bytes, src_bytes) = (common::bytes(&dst), common::bytes(&src));
    for i in 0..4096usize {
        let d = &dst_bytes[(4095 - i) * 256..][..256];
        assert_eq!(d, &src_bytes[i * 256..][..256], "block {i}");
    }

    // 64 MiB in 37 segments of uneven sizes, in reverse order; checksum at the destination.
    let mut cuts: Vec<u64> = (1..37u64).map(|k| k * k * 49_000 + k * 7).collect();
    cuts.insert(0, 0);
    cuts.push(64 << 20);
    let big: Vec<Segment> = cuts
        .windows(2)
        .rev()
        .map(|w| seg(l, w[0], r, w[0], w[1] - w[0]))
        .collect();
    let w = run(&q, 2, &big);
    assert_eq!((w.status, w.bytes), (DmaStatus::Success, 64 << 20));
    let sum = |b: &[u8]| Sha256::digest(b);
    assert_eq!(sum(&common::bytes(&dst)), sum(&common::bytes(&src)));

    // And back: a remote source (REMOTE_READ) into a local region, gathered.
    let w = run(
        &q,
        3,
        &[
            seg(r, 5 << 20, Mem::local(&back), 0, 1000),
            seg(r, 0, Mem::local(&back), 1000, (1 << 20) - 1000),
        ],
    );
    assert!(w.status.is_ok(), "{w:?}");
    assert_eq!(
        &common::bytes(&back)[..1000],
        &common::bytes(&src)[5 << 20..][..1000]
    );
    assert_eq!(
        &common::bytes(&back)[1000..],
        &common::bytes(&src)[..(1 << 20) - 1000]
    );

    // Fenced and chained jobs in one go: the chain carries the data along.
    let a = seg(l, 0, r, 0, 8 << 20);
    let b = seg(r, 0, r, 16 << 20, 8 << 20);
    fill(&src, 8 << 20, 7);
    q.submit(&Job::new(4, &[a])).unwrap();
    q.submit(&Job::new(5, &[b]).chained()).unwrap();
    let (w4, w5) = (next(&q), next(&q));
    assert_eq!(
        (w4.id, w5.id),
        (4, 5),
        "a chained job completes after its predecessor"
    );
    assert!(w4.status.is_ok() && w5.status.is_ok());
    assert_eq!(
        sum(&common::bytes(&dst)[16 << 20..24 << 20]),
        sum(&common::bytes(&src)[..8 << 20])
    );
}

#[test]
fn invalid_out_of_bounds_overlapping_and_forbidden_segments_fail_naming_the_segment() {
    let fab = Fab::up("dma_invalid", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let c1 = Context::open(&f.node(1).unwrap()).unwrap();
    let c2 = Context::open(&f.node(2).unwrap()).unwrap();
    let pd1 = c1.alloc_pd();
    let src = pd1.alloc_mr(1 << 20, AccessFlags::LOCAL_WRITE).unwrap();
    let ro_local = pd1.alloc_mr(4096, AccessFlags::empty()).unwrap();
    let pd2 = c2.alloc_pd();
    let dst = pd2.alloc_mr(1 << 20, RW).unwrap();
    let ro = pd2
        .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
        .unwrap();
    let wo = pd2
        .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    let private = pd2.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    fill(&src, src.len(), 1);
    let e = engines(1);
    let q = DmaQueue::new(&c1, &e, 8);
    let l = Mem::local(&src);
    let rem = |mr: &Mr| Mem::Remote {
        node: 2,
        rkey: mr.rkey(),
    };
    let r = rem(&dst);
    let ok = seg(l, 0, r, 0, 64 << 10); // a valid first segment: must not be copied either
    let cases: Vec<(&str, Segment, DmaStatus)> = vec![
        (
            "unknown lkey",
            seg(Mem::Local { lkey: 0xdead }, 0, r, 0, 8),
            DmaStatus::InvalidRegion,
        ),
        (
            "node 9 of 2",
            seg(
                l,
                0,
                Mem::Remote {
                    node: 9,
                    rkey: dst.rkey(),
                },
                0,
                8,
            ),
            DmaStatus::InvalidRegion,
        ),
        (
            "unknown rkey",
            seg(
                l,
                0,
                Mem::Remote {
                    node: 2,
                    rkey: 0xdead,
                },
                0,
                8,
            ),
            DmaStatus::NoGrant,
        ),
        (
            "rkey of another node",
            seg(
                l,
                0,
                Mem::Remote {
                    node: 1,
                    rkey: dst.rkey(),
                },
                0,
                8,
            ),
            DmaStatus::NoGrant,
        ),
        (
            "no remote access",
            seg(l, 0, rem(&private), 0, 8),
            DmaStatus::NoGrant,
        ),
        (
            "read-only destination",
            seg(l, 0, rem(&ro), 0, 8),
            DmaStatus::AccessDenied,
        ),
        (
            "local destination without LOCAL_WRITE",
            seg(rem(&dst), 900_000, Mem::local(&ro_local), 0, 8),
            DmaStatus::AccessDenied,
        ),
        (
            "remote source without REMOTE_READ",
            seg(rem(&wo), 0, l, 900_000, 8),
            DmaStatus::AccessDenied,
        ),
        (
            "past the destination's end",
            seg(l, 0, r, (1 << 20) - 8, 9),
            DmaStatus::OutOfBounds,
        ),
        (
            "past the source's end",
            seg(l, (1 << 20) - 1, r, 0, 2),
            DmaStatus::OutOfBounds,
        ),
        (
            "offset overflow",
            seg(l, u64::MAX - 2, r, 0, 8),
            DmaStatus::OutOfBounds,
        ),
        (
            "destination overlapping the first",
            seg(l, 0, r, 1000, 8),
            DmaStatus::Overlap,
        ),
        (
            "reading what the first writes",
            seg(r, 4096, l, 512 << 10, 8),
            DmaStatus::Overlap,
        ),
    ];
    for (i, (what, bad, status)) in cases.iter().enumerate() {
        let w = run(&q, 100 + i as u64, &[ok, *bad]);
        assert_eq!(
            (w.status, w.segment, w.bytes),
            (*status, Some(1), 0),
            "{what}: {w:?}"
        );
    }
    assert!(
        common::bytes(&dst).iter().all(|&b| b == 0),
        "a refused job wrote"
    );
    // One segment whose source and destination overlap in one region, named locally and
    // through a grant of the same region: both are the same memory.
    let src_rw = pd1.alloc_mr(4096, RW).unwrap();
    let w = run(
        &q,
        201,
        &[seg(
            Mem::local(&src_rw),
            0,
            Mem::Remote {
                node: 1,
                rkey: src_rw.rkey(),
            },
            100,
            200,
        )],
    );
    assert_eq!(
        (w.status, w.segment),
        (DmaStatus::Overlap, Some(0)),
        "{w:?}"
    );
    // Non-overlapping source and destination in one region are fine.
    let w = run(
        &q,
        202,
        &[seg(Mem::local(&src_rw), 0, Mem::local(&src_rw), 2048, 1024)],
    );
    assert!(w.status.is_ok(), "{w:?}");
    // A deregistered region: new jobs fail, as the mapping's state word says.
    drop(dst);
    let w = run(&q, 203, &[seg(l, 0, r, 0, 8)]);
    assert!(
        matches!(w.status, DmaStatus::NoGrant | DmaStatus::RegionGone),
        "{w:?}"
    );
    // Structural problems are refused at submission.
    assert!(q.submit(&Job::new(1, &[])).is_err());
}

/// Node 2's regions belong to a child process: `ro` (REMOTE_READ, a pattern), `rw`
/// (REMOTE_WRITE) and `private` (no remote access); their rkeys reach node 1 through its
/// scratchpads 0..3. The child stays until killed.
#[test]
fn role_owner() {
    let Some(role) = role() else { return };
    assert_eq!(role, "owner");
    let f = Fabric::attach(&std::env::var("BP_FABRIC").unwrap()).unwrap();
    let n2 = f.node(2).unwrap();
    let ctx = Context::open(&n2).unwrap();
    let pd = ctx.alloc_pd();
    let ro = pd
        .alloc_mr(1 << 20, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
        .unwrap();
    fill(&ro, ro.len(), 99);
    let rw = pd.alloc_mr(8 << 20, RW).unwrap();
    let private = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    n2.write_scratchpad(1, 1, ro.rkey()).unwrap();
    n2.write_scratchpad(1, 2, rw.rkey()).unwrap();
    n2.write_scratchpad(1, 3, private.rkey()).unwrap();
    n2.write_scratchpad(1, 0, 1).unwrap(); // ready
                                           // Until killed, or until the fabric is gone (a test that failed before killing us).
    for _ in 0..600 {
        if f.check_supervisor().is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn another_process_regions_read_only_grants_are_mapped_read_only_and_ungranted_ones_not_at_all() {
    if role().is_some() {
        return;
    }
    let fab = Fab::up("dma_grants", 2);
    let mut child = Reap(spawn_role(
        "role_owner",
        "owner",
        &[("BP_FABRIC", fab.name.clone())],
    ));
    let f = Fabric::attach(&fab.name).unwrap();
    let n1 = f.node(1).unwrap();
    let ready = wait_for(Duration::from_secs(20), || {
        (n1.read_scratchpad(0).unwrap() == 1).then_some(())
    });
    assert!(ready.is_some(), "the owner never came up");
    let key = |i| n1.read_scratchpad(i).unwrap();
    let (ro, rw, private) = (key(1), key(2), key(3));
    let ctx = Context::open(&n1).unwrap();
    let mine = ctx
        .alloc_pd()
        .alloc_mr(8 << 20, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let e = engines(1);
    let q = DmaQueue::new(&ctx, &e, 8);
    let l = Mem::local(&mine);
    let at = |rkey| Mem::Remote { node: 2, rkey };

    // Ungranted: no mapping, no fd.
    let w = run(&q, 1, &[seg(l, 0, at(private), 0, 8)]);
    assert_eq!((w.status, w.segment), (DmaStatus::NoGrant, Some(0)));
    assert!(region_maps(&fab.name).is_empty(), "no grant, no mapping");

    // Read-only: readable, mapped r--s, writes refused before any byte moves.
    let w = run(&q, 2, &[seg(at(ro), 0, l, 0, 1 << 20)]);
    assert!(w.status.is_ok(), "{w:?}");
    let want = pattern(1 << 20, 99);
    assert_eq!(&common::bytes(&mine)[..1 << 20], &want[..]);
    let w = run(&q, 3, &[seg(l, 0, at(ro), 0, 8)]);
    assert_eq!((w.status, w.segment), (DmaStatus::AccessDenied, Some(0)));
    let maps = region_maps(&fab.name);
    assert_eq!(maps.len(), 1, "{maps:?}");
    assert_eq!(
        maps[0].split_whitespace().nth(1),
        Some("r--s"),
        "{}",
        maps[0]
    );

    // Writable: 8 MiB out and back, checksum compared.
    fill(&mine, mine.len(), 5);
    let sent = Sha256::digest(common::bytes(&mine));
    let w = run(&q, 4, &[seg(l, 0, at(rw), 0, 8 << 20)]);
    assert!(w.status.is_ok(), "{w:?}");
    mine.fill(0, mine.len() as u64, 0).unwrap();
    let w = run(&q, 5, &[seg(at(rw), 0, l, 0, 8 << 20)]);
    assert!(w.status.is_ok(), "{w:?}");
    assert_eq!(Sha256::digest(common::bytes(&mine)), sent);
    let maps = region_maps(&fab.name);
    assert!(maps.iter().any(|m| m.contains("rw-s")), "{maps:?}");

    // The owner dies while its node stays READY: the supervisor marks its regions gone, and a
    // job to the still-mapped region fails instead of writing into orphaned memory.
    let _ = child.0.kill();
    let _ = child.0.wait();
    let w = wait_for(Duration::from_secs(20), || {
        let w = run(&q, 6, &[seg(l, 0, at(rw), 0, 4096)]);
        (!w.status.is_ok()).then_some(w)
    })
    .expect("jobs to a dead owner's region kept succeeding");
    assert!(
        matches!(w.status, DmaStatus::RegionGone | DmaStatus::NoGrant),
        "{w:?}"
    );
    assert_eq!(w.bytes, 0);
}

/// Kills and reaps a child role when the test ends, passed or failed.
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_node_killed_mid_run_fails_its_jobs_with_node_down_and_nothing_hangs() {
    let fab = Fab::up_restarting("dma_down", 2, 0);
    let f = Fabric::attach(&fab.name).unwrap();
    let c1 = Context::open(&f.node(1).unwrap()).unwrap();
    let c2 = Context::open(&f.node(2).unwrap()).unwrap();
    let src = c1
        .alloc_pd()
        .alloc_mr(64 << 20, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let dst = c2.alloc_pd().alloc_mr(64 << 20, RW).unwrap();
    let e = DmaEngines::start(&DmaConfig {
        engines: 1,
        max_piece: 1 << 20,
        ..DmaConfig::default()
    })
    .unwrap();
    let q = DmaQueue::new(&c1, &e, 4);
    let r = Mem::Remote {
        node: 2,
        rkey: dst.rkey(),
    };
    // Jobs of 64 one-MiB segments, kept 4 deep, until node 2 has been dead a while.
    let job: Vec<Segment> = (0..64u64)
        .map(|i| seg(Mem::local(&src), i << 20, r, i << 20, 1 << 20))
        .collect();
    let w = run(&q, 0, &job);
    assert!(w.status.is_ok(), "{w:?}");
    let pid = fab.status()["slots"][1]["pid"].as_i64().unwrap() as i32;
    let mut killed: Option<Instant> = None;
    let mut first_failure: Option<(DmaWc, Duration)> = None;
    let mut id = 1;
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(
            Instant::now() < end,
            "jobs never failed after node 2 was killed"
        );
        for _ in q.outstanding()..4 {
            q.submit(&Job::new(id, &job)).unwrap();
            id += 1;
        }
        if killed.is_none() && id > 3 {
            // SAFETY: kill(2) with a pid read from the fabric's status; no memory is involved.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed = Some(Instant::now());
        }
        let w = next(&q);
        match w.status {
            DmaStatus::Success => assert!(first_failure.is_none(), "success after a failure"),
            DmaStatus::NodeDown => {
                assert!(w.segment.is_some_and(|s| s < 64), "{w:?}");
                if first_failure.is_none() {
                    first_failure = Some((w, killed.unwrap().elapsed()));
                }
                if w.bytes == 0 && w.segment == Some(0) {
                    break; // refused at submission: the node is known DOWN
                }
            }
            other => panic!("unexpected {other}: {w:?}"),
        }
    }
    let (w, took) = first_failure.unwrap();
    eprintln!(
        "first failed job {} ({} of 64 MiB copied, segment {:?}) {took:?} after the kill",
        w.id, w.bytes, w.segment
    );
    // Nothing is left hanging: the outstanding jobs all complete.
    while q.outstanding() > 0 {
        assert_eq!(next(&q).status, DmaStatus::NodeDown);
    }
    drop(q);
    drop(dst);
}
