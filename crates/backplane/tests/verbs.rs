//! RDMA verbs across nodes: every operation on every transport that has it, every error
//! status a libibverbs user relies on, grants and read-only mappings, completion channels,
//! the connection helper, and two processes talking over it.

mod common;
use common::*;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use backplane::fabric::Fabric;
use backplane::verbs::cm::{self, ConnParam, PeerInfo};
use backplane::verbs::*;

const ALL: AccessFlags = AccessFlags::from_bits_retain(
    AccessFlags::LOCAL_WRITE.bits()
        | AccessFlags::REMOTE_WRITE.bits()
        | AccessFlags::REMOTE_READ.bits()
        | AccessFlags::REMOTE_ATOMIC.bits(),
);

/// One end: a context on a node, a PD, one CQ for both queues, a QP and a region.
struct Side {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
    /// The CQ's completion channel ([`watched_side`] only).
    ch: Option<CompChannel>,
}

fn side(f: &Fabric, slot: u32, ty: QpType, access: AccessFlags, len: usize) -> Side {
    let ctx = Context::open(&f.node(slot).unwrap()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024, None).unwrap();
    let mut init = QpInitAttr::new(ty, &cq, &cq);
    init.cap.max_send_wr = 256;
    init.cap.max_recv_wr = 256;
    let qp = pd.create_qp(&init).unwrap();
    let mr = pd.alloc_mr(len, access).unwrap();
    Side {
        ctx,
        pd,
        cq,
        qp,
        mr,
        ch: None,
    }
}

/// An RC side whose small CQ (16) has a completion channel: for tests that sleep on it.
fn watched_side(f: &Fabric, slot: u32) -> Side {
    let ctx = Context::open(&f.node(slot).unwrap()).unwrap();
    let ch = ctx.create_comp_channel().unwrap();
    let cq = ctx.create_cq(16, Some(&ch)).unwrap();
    let pd = ctx.alloc_pd();
    let qp = pd
        .create_qp(&QpInitAttr::new(QpType::Rc, &cq, &cq))
        .unwrap();
    let mr = pd.alloc_mr(4096, ALL).unwrap();
    Side {
        ctx,
        pd,
        cq,
        qp,
        mr,
        ch: Some(ch),
    }
}

fn info(s: &Side) -> PeerInfo {
    PeerInfo {
        node: s.ctx.node().slot(),
        qpn: s.qp.qp_num(),
        psn: 0,
        rkey: s.mr.rkey(),
        addr: 0,
        len: s.mr.len() as u64,
        qkey: cm::DEFAULT_QKEY,
        private_data: Vec::new(),
    }
}

/// Two connected sides on nodes 1 and 2.
fn pair(f: &Fabric, ty: QpType, access: AccessFlags, len: usize) -> (Side, Side) {
    let a = side(f, 1, ty, access, len);
    let b = side(f, 2, ty, access, len);
    cm::ready_qp(&a.qp, &info(&b), &ConnParam::default()).unwrap();
    cm::ready_qp(&b.qp, &info(&a), &ConnParam::default()).unwrap();
    (a, b)
}

/// Polls several CQs of this thread (each side's progress happens in its own polls) and hands
/// out completions per CQ. A hang ends the test after 20 s.
struct Pump<'a> {
    cqs: Vec<&'a Cq>,
    got: Vec<VecDeque<Wc>>,
}

impl<'a> Pump<'a> {
    fn new(cqs: &[&'a Cq]) -> Self {
        Self {
            cqs: cqs.to_vec(),
            got: vec![VecDeque::new(); cqs.len()],
        }
    }
    fn turn(&mut self) {
        let mut buf = [Wc::default(); 16];
        for (i, cq) in self.cqs.iter().enumerate() {
            let n = cq.poll(&mut buf);
            self.got[i].extend(&buf[..n]);
        }
    }
    fn next(&mut self, i: usize) -> Wc {
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(w) = self.got[i].pop_front() {
                return w;
            }
            assert!(Instant::now() < end, "no completion on CQ {i}");
            self.turn();
        }
    }
    /// Nothing more arrives on CQ `i` during a few hundred polls.
    fn quiet(&mut self, i: usize) -> bool {
        for _ in 0..300 {
            self.turn();
        }
        self.got[i].is_empty()
    }
}

fn recv(s: &Side, wr_id: u64, off: u64, len: u32) {
    s.qp.post_recv(&[RecvWr {
        wr_id,
        sg_list: &[s.mr.sge(off, len)],
    }])
    .unwrap();
}

#[test]
fn rc_sends_with_and_without_immediate_arrive_in_order_gathered_and_scattered() {
    let fab = Fab::up("verbs_rc_send", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, b) = pair(&f, QpType::Rc, ALL, 4 << 20);
    // Receives: one split over two SGEs, then plain ones, one of 2 MiB for a fragmented message.
    b.qp.post_recv(&[RecvWr {
        wr_id: 100,
        sg_list: &[b.mr.sge(0, 3), b.mr.sge(1000, 100)],
    }])
    .unwrap();
    recv(&b, 101, 4096, 64);
    recv(&b, 102, 8192, 64);
    recv(&b, 103, 1 << 20, 2 << 20);
    a.mr.write(0, b"hello world").unwrap();
    let pattern: Vec<u8> = (0..1_500_000).map(|i| (i % 251) as u8).collect();
    a.mr.write(1 << 20, &pattern).unwrap();
    a.qp.post_send(&[
        SendWr::send(1, &[a.mr.sge(0, 5), a.mr.sge(5, 6)]).signaled(),
        SendWr::send_inline(2, b"inline!")
            .with_imm(0xfeed)
            .signaled(),
        SendWr::send(3, &[]).signaled(),
        SendWr::send(4, &[a.mr.sge(1 << 20, 1_500_000)]).signaled(),
    ])
    .unwrap();
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    let r: Vec<Wc> = (0..4).map(|_| p.next(1)).collect();
    let s: Vec<Wc> = (0..4).map(|_| p.next(0)).collect();
    for (i, w) in s.iter().enumerate() {
        assert_eq!(
            (w.wr_id, w.status, w.opcode),
            (i as u64 + 1, WcStatus::Success, WcOpcode::Send)
        );
    }
    assert_eq!(
        r.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        [100, 101, 102, 103]
    );
    assert!(r
        .iter()
        .all(|w| w.status == WcStatus::Success && w.opcode == WcOpcode::Recv));
    assert_eq!(
        r.iter().map(|w| w.byte_len).collect::<Vec<_>>(),
        [11, 7, 0, 1_500_000]
    );
    assert_eq!(r[1].imm_data, 0xfeed);
    assert!(
        r[1].wc_flags.contains(WcFlags::WITH_IMM) && !r[0].wc_flags.contains(WcFlags::WITH_IMM)
    );
    assert_eq!((r[0].src_qp, r[0].slid), (a.qp.qp_num(), 1));
    let bm = common::bytes(&b.mr);
    assert_eq!(&bm[..3], b"hel");
    assert_eq!(&bm[1000..1008], b"lo world");
    assert_eq!(&bm[4096..4103], b"inline!");
    assert!(bm[1 << 20..(1 << 20) + 1_500_000]
        .iter()
        .enumerate()
        .all(|(i, &x)| x == (i % 251) as u8));
}

#[test]
fn rc_write_read_and_atomics_act_on_the_peer_region_directly() {
    let fab = Fab::up("verbs_rc_onesided", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, mut b) = pair(&f, QpType::Rc, ALL, 1 << 20);
    a.mr.write(0, b"written!").unwrap();
    b.mr.write(5000, b"read").unwrap();
    b.mr.write(64, &40u64.to_le_bytes()).unwrap();
    let rkey = b.mr.rkey();
    a.qp.post_send(&[
        SendWr::write(1, &[a.mr.sge(0, 8)], 300, rkey).signaled(),
        SendWr::read(2, &[a.mr.sge(100, 4)], 5000, rkey).signaled(),
        SendWr::fetch_add(3, &[a.mr.sge(200, 8)], 64, rkey, 2).signaled(),
        SendWr::cmp_swap(4, &[a.mr.sge(208, 8)], 64, rkey, 42, 7).signaled(),
        SendWr::cmp_swap(5, &[a.mr.sge(216, 8)], 64, rkey, 42, 9).signaled(),
    ])
    .unwrap();
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    let ops: Vec<(u64, WcStatus, WcOpcode)> = (0..5)
        .map(|_| p.next(0))
        .map(|w| (w.wr_id, w.status, w.opcode))
        .collect();
    use WcOpcode::*;
    use WcStatus::Success as S;
    assert_eq!(
        ops,
        [
            (1, S, RdmaWrite),
            (2, S, RdmaRead),
            (3, S, FetchAdd),
            (4, S, CompSwap),
            (5, S, CompSwap)
        ]
    );
    assert_eq!(&common::bytes(&b.mr)[300..308], b"written!");
    let am = common::bytes(&a.mr);
    assert_eq!(&am[100..104], b"read");
    let word = |o: usize| u64::from_le_bytes(am[o..o + 8].try_into().unwrap());
    assert_eq!((word(200), word(208), word(216)), (40, 42, 7), "old values");
    assert_eq!(
        &common::bytes(&b.mr)[64..72],
        &7u64.to_le_bytes(),
        "42 swapped for 7"
    );
    assert!(
        p.quiet(1),
        "one-sided operations make no completion at the target"
    );

    // WRITE_WITH_IMM: the data lands, then a receive completes with the immediate.
    recv(&b, 77, 0, 0);
    a.mr.write(0, b"imm!").unwrap();
    a.qp.post_send(&[SendWr::write(6, &[a.mr.sge(0, 4)], 9000, rkey)
        .with_imm(99)
        .signaled()])
        .unwrap();
    let r = p.next(1);
    assert_eq!((r.wr_id, r.status, r.opcode), (77, S, RecvRdmaWithImm));
    assert_eq!((r.imm_data, r.byte_len), (99, 4));
    assert_eq!(&common::bytes(&b.mr)[9000..9004], b"imm!");
    assert_eq!(p.next(0).wr_id, 6);
    let _ = &mut b;
}

/// `Qp::post_one_sided` (the drop-in libibverbs' way for one READ or atomic) does what
/// `post_send` does with the same request: on the first use of a region (the general way),
/// on later ones (the fast path), behind an unacknowledged SEND (completing after it), with a
/// bad rkey (REM_ACCESS_ERR, the QP in error); any other opcode is an invalid argument.
#[test]
fn post_one_sided_reads_and_atomics_as_post_send_does() {
    let fab = Fab::up("verbs_one_sided", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, b) = pair(&f, QpType::Rc, ALL, 1 << 16);
    b.mr.write(4096, b"remote data!").unwrap();
    b.mr.write(64, &40u64.to_le_bytes()).unwrap();
    let rkey = b.mr.rkey();
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    let one = |wr_id: u64, opcode: WrOpcode, local: &Sge, remote_addr: u64, ops: (u64, u64)| {
        a.qp.post_one_sided(&OneSided {
            wr_id,
            opcode,
            send_flags: SendFlags::SIGNALED,
            local,
            remote_addr,
            rkey,
            compare_add: ops.0,
            swap: ops.1,
        })
    };
    // Three rounds: the first maps the region (general way), the others take the fast path.
    let mut expect = 40u64;
    for round in 0..3u64 {
        let base = round * 256;
        let (rd, fa, cs) = (
            a.mr.sge(base, 12),
            a.mr.sge(base + 64, 8),
            a.mr.sge(base + 128, 8),
        );
        one(10 * round + 1, WrOpcode::RdmaRead, &rd, 4096, (0, 0)).unwrap();
        one(10 * round + 2, WrOpcode::AtomicFetchAndAdd, &fa, 64, (2, 0)).unwrap();
        one(
            10 * round + 3,
            WrOpcode::AtomicCmpAndSwp,
            &cs,
            64,
            (expect + 2, expect + 10),
        )
        .unwrap();
        let got: Vec<(u64, WcStatus, WcOpcode, u32)> = (0..3)
            .map(|_| p.next(0))
            .map(|w| (w.wr_id, w.status, w.opcode, w.byte_len))
            .collect();
        use WcOpcode::*;
        use WcStatus::Success as S;
        let r = 10 * round;
        assert_eq!(
            got,
            [
                (r + 1, S, RdmaRead, 12),
                (r + 2, S, FetchAdd, 8),
                (r + 3, S, CompSwap, 8)
            ],
            "round {round}"
        );
        let am = common::bytes(&a.mr);
        let word = |o: u64| u64::from_le_bytes(am[o as usize..o as usize + 8].try_into().unwrap());
        assert_eq!(&am[base as usize..base as usize + 12], b"remote data!");
        assert_eq!((word(base + 64), word(base + 128)), (expect, expect + 2));
        expect += 10;
        let bm = common::bytes(&b.mr);
        assert_eq!(&bm[64..72], &expect.to_le_bytes(), "round {round}");
    }
    // Behind an unacknowledged SEND: the READ is carried out, its completion waits for the
    // SEND's.
    recv(&b, 7, 0, 64);
    a.qp.post_send(&[SendWr::send(100, &[a.mr.sge(0, 8)]).signaled()])
        .unwrap();
    let rd = a.mr.sge(2048, 4);
    one(101, WrOpcode::RdmaRead, &rd, 4096, (0, 0)).unwrap();
    let mut wc = [Wc::default(); 4];
    for _ in 0..100 {
        assert_eq!(a.cq.poll(&mut wc), 0, "{:?}", &wc[0]);
    }
    assert_eq!(p.next(1).wr_id, 7);
    let (first, second) = (p.next(0), p.next(0));
    assert_eq!((first.wr_id, first.opcode), (100, WcOpcode::Send));
    assert_eq!(
        (second.wr_id, second.opcode, second.status),
        (101, WcOpcode::RdmaRead, WcStatus::Success)
    );
    // Any other opcode: refused, nothing posted.
    let e = one(102, WrOpcode::Send, &rd, 0, (0, 0)).unwrap_err();
    assert!(
        matches!(&e, VerbsError::Post { bad_wr: 0, source } if matches!(**source, VerbsError::InvalidArgument(_))),
        "{e:?}"
    );
    // A bad rkey: REM_ACCESS_ERR, as through post_send.
    a.qp.post_one_sided(&OneSided {
        wr_id: 103,
        opcode: WrOpcode::RdmaRead,
        send_flags: SendFlags::SIGNALED,
        local: &rd,
        remote_addr: 0,
        rkey: rkey ^ 0x5a5a_0001,
        compare_add: 0,
        swap: 0,
    })
    .unwrap();
    let w = p.next(0);
    assert_eq!((w.wr_id, w.status), (103, WcStatus::RemAccessErr));
    assert_eq!(a.qp.state(), QpState::Err);
}

#[test]
fn unsignaled_work_completes_silently_and_signaled_work_reports() {
    let fab = Fab::up("verbs_signal", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, b) = pair(&f, QpType::Rc, ALL, 4096);
    let rkey = b.mr.rkey();
    for i in 0..10 {
        a.qp.post_send(&[SendWr::write(i, &[a.mr.sge(0, 8)], 0, rkey)])
            .unwrap();
    }
    for i in 0..5 {
        recv(&b, i, 0, 64);
        a.qp.post_send(&[SendWr::send(100 + i, &[a.mr.sge(0, 8)])])
            .unwrap();
    }
    a.qp.post_send(&[SendWr::send_inline(999, b"x").signaled()])
        .unwrap();
    recv(&b, 5, 0, 64);
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    let w = p.next(0);
    assert_eq!((w.wr_id, w.status), (999, WcStatus::Success));
    assert!(p.quiet(0));
    for i in 0..6 {
        assert_eq!(p.next(1).wr_id, i);
    }
}

/// Completions come in posting order: a signaled WRITE (done at once, on the fast path) posted
/// behind a SEND still waiting for its acknowledgement completes after that SEND, not before.
#[test]
fn a_write_behind_an_unacknowledged_send_completes_after_it() {
    let fab = Fab::up("verbs_order", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, b) = pair(&f, QpType::Rc, ALL, 4096);
    // A first write maps B's region, so the one under test takes the fast path.
    a.qp.post_send(&[SendWr::write(0, &[a.mr.sge(8, 8)], 64, b.mr.rkey())])
        .unwrap();
    recv(&b, 7, 0, 64);
    a.qp.post_send(&[SendWr::send(1, &[a.mr.sge(0, 8)]).signaled()])
        .unwrap();
    a.qp.post_send(&[SendWr::write(2, &[a.mr.sge(8, 8)], 64, b.mr.rkey()).signaled()])
        .unwrap();
    // B has not polled: the SEND is unacknowledged, so nothing may complete on A yet.
    let mut wc = [Wc::default(); 4];
    for _ in 0..100 {
        assert_eq!(a.cq.poll(&mut wc), 0, "{:?}", &wc[0]);
    }
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    assert_eq!(p.next(1).wr_id, 7);
    let (first, second) = (p.next(0), p.next(0));
    assert_eq!((first.wr_id, first.opcode), (1, WcOpcode::Send));
    assert_eq!((second.wr_id, second.opcode), (2, WcOpcode::RdmaWrite));
    assert_eq!(second.status, WcStatus::Success);
}

/// A poll that takes a message hands it over first and leaves the send side for the next poll
/// — only once: a signaled SEND that the peer's messages acknowledge completes within two polls
/// that take messages, however many keep coming.
#[test]
fn a_send_acknowledged_by_a_stream_of_messages_completes_while_they_keep_coming() {
    let fab = Fab::up("verbs_settle", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, b) = pair(&f, QpType::Rc, ALL, 4096);
    for i in 0..64 {
        recv(&a, 1000 + i, 64, 64);
    }
    recv(&b, 7, 0, 64);
    a.qp.post_send(&[SendWr::send_inline(1, b"ping").signaled()])
        .unwrap();
    let mut wc = [Wc::default(); 4];
    let end = Instant::now() + Duration::from_secs(20);
    while b.cq.poll(&mut wc) == 0 {
        assert!(Instant::now() < end, "B never got the SEND");
    }
    assert_eq!((wc[0].wr_id, wc[0].status), (7, WcStatus::Success));
    // Every message B sends from now on acknowledges A's SEND.
    let mut polls_with_receives = 0;
    for i in 0..64 {
        b.qp.post_send(&[SendWr::send_inline(2000 + i, b"more")])
            .unwrap();
        b.cq.poll(&mut wc);
        let n = a.cq.poll(&mut wc);
        let got = &wc[..n];
        if let Some(w) = got.iter().find(|w| w.opcode == WcOpcode::Send) {
            assert_eq!((w.wr_id, w.status), (1, WcStatus::Success));
            assert!(
                polls_with_receives < 2,
                "{polls_with_receives} polls before"
            );
            return;
        }
        if got.iter().any(|w| w.opcode == WcOpcode::Recv) {
            polls_with_receives += 1;
        }
    }
    panic!("the SEND never completed while messages kept coming");
}

#[test]
fn a_full_cq_counts_send_overruns_and_holds_receives_back_without_losing_any() {
    let fab = Fab::up("verbs_overrun", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, b) = pair(&f, QpType::Rc, ALL, 4096);
    // Small CQs beside the pair's: a 4-entry send CQ on A and a 2-entry receive CQ on B.
    let acq = a.ctx.create_cq(4, None).unwrap();
    let bcq = b.ctx.create_cq(2, None).unwrap();
    let aqp =
        a.pd.create_qp(&QpInitAttr::new(QpType::Rc, &acq, &acq))
            .unwrap();
    let bqp =
        b.pd.create_qp(&QpInitAttr::new(QpType::Rc, &bcq, &bcq))
            .unwrap();
    let peer = |s: &Side, qp: &Qp| PeerInfo {
        qpn: qp.qp_num(),
        ..info(s)
    };
    cm::ready_qp(&aqp, &peer(&b, &bqp), &ConnParam::default()).unwrap();
    cm::ready_qp(&bqp, &peer(&a, &aqp), &ConnParam::default()).unwrap();
    // Six signaled WRITEs complete at post time into a CQ of four: two overruns, none lost.
    for i in 0..6 {
        aqp.post_send(&[SendWr::write(i, &[a.mr.sge(0, 8)], 0, b.mr.rkey()).signaled()])
            .unwrap();
    }
    assert_eq!(acq.overruns(), 2);
    let mut wc = [Wc::default(); 16];
    assert_eq!(acq.poll(&mut wc), 6);
    // Five SENDs towards a receive CQ of two: receives stop being taken while it is full,
    // so it never overruns, and every message arrives once the application polls.
    for i in 0..5 {
        bqp.post_recv(&[RecvWr {
            wr_id: i,
            sg_list: &[b.mr.sge(0, 64)],
        }])
        .unwrap();
        aqp.post_send(&[SendWr::send(100 + i, &[a.mr.sge(0, 8)])])
            .unwrap();
    }
    let mut p = Pump::new(&[&acq, &bcq]);
    for _ in 0..50 {
        p.turn();
    }
    for i in 0..5 {
        assert_eq!(p.next(1).wr_id, i);
    }
    assert_eq!(bcq.overruns(), 0);
    drop((aqp, bqp));
}

#[test]
fn uc_carries_sends_and_writes_refuses_reads_and_atomics_and_drops_without_a_receive() {
    let fab = Fab::up("verbs_uc", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, b) = pair(&f, QpType::Uc, ALL, 65536);
    let rkey = b.mr.rkey();
    a.mr.write(0, b"uc-ok").unwrap();
    for op in [
        SendWr::read(1, &[a.mr.sge(0, 8)], 0, rkey),
        SendWr::fetch_add(1, &[a.mr.sge(0, 8)], 0, rkey, 1),
    ] {
        let e = a.qp.post_send(&[op]).unwrap_err();
        assert!(matches!(e, VerbsError::Post { bad_wr: 0, .. }), "{e}");
    }
    // No receive posted: the message is dropped, the sender does not wait.
    a.qp.post_send(&[SendWr::send(2, &[a.mr.sge(0, 5)]).signaled()])
        .unwrap();
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    assert_eq!(p.next(0).status, WcStatus::Success);
    assert!(p.quiet(1));
    recv(&b, 10, 100, 64);
    a.qp.post_send(&[
        SendWr::send(3, &[a.mr.sge(0, 5)]).signaled(),
        SendWr::write(4, &[a.mr.sge(0, 5)], 900, rkey).signaled(),
    ])
    .unwrap();
    let r = p.next(1);
    assert_eq!((r.wr_id, r.status, r.byte_len), (10, WcStatus::Success, 5));
    assert_eq!(&common::bytes(&b.mr)[100..105], b"uc-ok");
    assert_eq!((p.next(0).wr_id, p.next(0).wr_id), (3, 4));
    assert_eq!(&common::bytes(&b.mr)[900..905], b"uc-ok");
    assert_eq!(b.qp.drops(), 1);
}

#[test]
fn ud_datagrams_reach_any_peer_with_a_grh_up_to_the_mtu_and_only_with_the_right_qkey() {
    let fab = Fab::up("verbs_ud", 3);
    let f = Fabric::attach(&fab.name).unwrap();
    let a = side(&f, 1, QpType::Ud, ALL, 16384);
    let b = side(&f, 2, QpType::Ud, ALL, 16384);
    let c = side(&f, 3, QpType::Ud, ALL, 16384);
    let none = ConnParam::default();
    for s in [&a, &b, &c] {
        // UD needs no peer: RTR/RTS with its own Q_Key.
        cm::ready_qp(&s.qp, &info(s), &none).unwrap();
    }
    recv(&b, 1, 0, 4096 + 40);
    recv(&c, 2, 0, 4096 + 40);
    recv(&c, 3, 8192, 40 + 10);
    a.mr.write(0, b"to-b").unwrap();
    let ah_b =
        a.pd.create_ah(&AhAttr {
            dlid: 2,
            port_num: 1,
            ..AhAttr::default()
        })
        .unwrap();
    let ah_c =
        a.pd.create_ah(&AhAttr {
            dlid: 3,
            port_num: 1,
            ..AhAttr::default()
        })
        .unwrap();
    let q = cm::DEFAULT_QKEY;
    a.qp.post_send(&[
        SendWr::send(1, &[a.mr.sge(0, 4)])
            .ud(&ah_b, b.qp.qp_num(), q)
            .signaled(),
        SendWr::send_inline(2, b"to-c")
            .with_imm(5)
            .ud(&ah_c, c.qp.qp_num(), q)
            .signaled(),
        // Wrong Q_Key: dropped by the receiver; the sender still completes (UD).
        SendWr::send_inline(3, b"bad")
            .ud(&ah_c, c.qp.qp_num(), 7)
            .signaled(),
        // Over the MTU: a local length error.
        SendWr::send(4, &[a.mr.sge(0, 4097)])
            .ud(&ah_b, b.qp.qp_num(), q)
            .signaled(),
    ])
    .unwrap();
    let mut p = Pump::new(&[&a.cq, &b.cq, &c.cq]);
    let st: Vec<_> = (0..4)
        .map(|_| p.next(0))
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(
        st,
        [
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success),
            (4, WcStatus::LocLenErr)
        ]
    );
    let rb = p.next(1);
    assert_eq!((rb.byte_len, rb.src_qp, rb.slid), (44, a.qp.qp_num(), 1));
    assert!(rb.wc_flags.contains(WcFlags::GRH));
    assert_eq!(&common::bytes(&b.mr)[40..44], b"to-b");
    let rc = p.next(2);
    assert_eq!((rc.wr_id, rc.imm_data, rc.byte_len), (2, 5, 44));
    assert_eq!(&common::bytes(&c.mr)[40..44], b"to-c");
    assert!(
        p.quiet(2),
        "the datagram with the wrong Q_Key must not be delivered"
    );
    assert_eq!(c.qp.drops(), 1);
    // A datagram longer than the receive buffer: LOC_LEN_ERR on that receive.
    a.qp.post_send(&[SendWr::send(5, &[a.mr.sge(0, 100)]).ud(&ah_c, c.qp.qp_num(), q)])
        .unwrap();
    let r = p.next(2);
    assert_eq!((r.wr_id, r.status), (3, WcStatus::LocLenErr));
    // UD refuses one-sided operations.
    assert!(a.qp.post_send(&[SendWr::write(9, &[], 0, 1)]).is_err());
}

#[test]
fn bad_deregistered_out_of_bounds_or_unflagged_remote_access_is_rem_access_err_and_flushes() {
    let fab = Fab::up("verbs_remacc", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    // Each case on a fresh pair: one bad operation, then a good one that must flush.
    let check = |name: &str, setup: &dyn Fn(&Side, &mut Side) -> (u64, u32, WrOpcode)| {
        let (a, mut b) = pair(&f, QpType::Rc, ALL, 8192);
        let (addr, rkey, op) = setup(&a, &mut b);
        let sge = [a.mr.sge(0, 8)];
        let bad = match op {
            WrOpcode::RdmaRead => SendWr::read(1, &sge, addr, rkey),
            WrOpcode::AtomicFetchAndAdd => SendWr::fetch_add(1, &sge, addr, rkey, 1),
            _ => SendWr::write(1, &sge, addr, rkey),
        };
        a.qp.post_send(&[
            bad.signaled(),
            SendWr::write(2, &sge, 0, b.mr.rkey()).signaled(),
        ])
        .unwrap();
        let mut p = Pump::new(&[&a.cq]);
        let (w1, w2) = (p.next(0), p.next(0));
        assert_eq!((w1.wr_id, w1.status), (1, WcStatus::RemAccessErr), "{name}");
        assert_eq!((w2.wr_id, w2.status), (2, WcStatus::WrFlushErr), "{name}");
        assert_eq!(a.qp.state(), QpState::Err, "{name}");
        // Work posted in ERR is flushed at once.
        a.qp.post_send(&[SendWr::write(3, &sge, 0, b.mr.rkey())])
            .unwrap();
        assert_eq!(p.next(0).status, WcStatus::WrFlushErr, "{name}");
    };
    check("unknown rkey", &|_, b| {
        (0, b.mr.rkey() ^ 0x5a5a_0001, WrOpcode::RdmaWrite)
    });
    check("past the end", &|_, b| {
        (8190, b.mr.rkey(), WrOpcode::RdmaWrite)
    });
    check("offset overflow", &|_, b| {
        (u64::MAX - 2, b.mr.rkey(), WrOpcode::RdmaRead)
    });
    check("misaligned atomic", &|_, b| {
        (4, b.mr.rkey(), WrOpcode::AtomicFetchAndAdd)
    });
    check("region without REMOTE_WRITE", &|_, b| {
        let ro = b.pd.alloc_mr(4096, AccessFlags::REMOTE_READ).unwrap();
        let k = ro.rkey();
        std::mem::forget(ro); // keep it registered for the rest of the case
        (0, k, WrOpcode::RdmaWrite)
    });
    check("deregistered after a first use", &|a, b| {
        let m = b.pd.alloc_mr(4096, ALL).unwrap();
        let k = m.rkey();
        a.qp.post_send(&[SendWr::write(50, &[a.mr.sge(0, 8)], 0, k).signaled()])
            .unwrap();
        let mut p = Pump::new(&[&a.cq]);
        assert_eq!(p.next(0).status, WcStatus::Success);
        drop(m);
        (0, k, WrOpcode::RdmaWrite)
    });
    check("QP without remote access", &|_, b| {
        // Take the responder QP's REMOTE_WRITE away (RTS -> RTS with ACCESS_FLAGS).
        let attr = QpAttr {
            qp_state: QpState::Rts,
            qp_access_flags: AccessFlags::REMOTE_READ,
            ..QpAttr::default()
        };
        b.qp.modify(&attr, QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS)
            .unwrap();
        (0, b.mr.rkey(), WrOpcode::RdmaWrite)
    });
    check("region of another protection domain", &|_, b| {
        let other = b.ctx.alloc_pd();
        let m = other.alloc_mr(4096, ALL).unwrap();
        let k = m.rkey();
        std::mem::forget(m);
        (0, k, WrOpcode::RdmaRead)
    });
}

#[test]
fn a_write_alone_to_where_the_last_one_went_after_the_region_is_gone_is_rem_access_err() {
    // The handle remembers the line the last WRITE went to and prefetches it for the next
    // WRITE to the same rkey and address, before any check: that hint is stale here.
    let fab = Fab::up("verbs_stalehint", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, b) = pair(&f, QpType::Rc, ALL, 8192);
    let m = b.pd.alloc_mr(4096, ALL).unwrap();
    let k = m.rkey();
    let sge = [a.mr.sge(0, 8)];
    let mut p = Pump::new(&[&a.cq]);
    for id in [1, 2] {
        a.qp.post_send(&[SendWr::write(id, &sge, 4088, k).signaled()])
            .unwrap();
        assert_eq!(p.next(0).status, WcStatus::Success);
    }
    drop(m);
    a.qp.post_send(&[SendWr::write(3, &sge, 4088, k).signaled()])
        .unwrap();
    let w = p.next(0);
    assert_eq!((w.wr_id, w.status), (3, WcStatus::RemAccessErr));
    assert_eq!(a.qp.state(), QpState::Err);
}

#[test]
fn bad_lkey_is_loc_prot_err_and_a_short_receive_is_loc_len_err_with_rem_inv_req_err() {
    let fab = Fab::up("verbs_local", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, b) = pair(&f, QpType::Rc, ALL, 8192);
    let bad = Sge {
        addr: 0,
        length: 8,
        lkey: a.mr.lkey() ^ 0x77,
    };
    a.qp.post_send(&[
        SendWr::write(1, &[bad], 0, b.mr.rkey()),
        SendWr::send(2, &[a.mr.sge(0, 8)]),
    ])
    .unwrap();
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    let (w1, w2) = (p.next(0), p.next(0));
    assert_eq!((w1.wr_id, w1.status), (1, WcStatus::LocProtErr));
    assert_eq!((w2.wr_id, w2.status), (2, WcStatus::WrFlushErr));
    // Outside its own region, too.
    let (a, b) = pair(&f, QpType::Rc, ALL, 8192);
    a.qp.post_send(&[SendWr::send(1, &[a.mr.sge(8190, 8)])])
        .unwrap();
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    assert_eq!(p.next(0).status, WcStatus::LocProtErr);

    // Receive buffer too small: the receiver sees LOC_LEN_ERR, the sender REM_INV_REQ_ERR.
    let (a, b) = pair(&f, QpType::Rc, ALL, 8192);
    recv(&b, 10, 0, 4);
    recv(&b, 11, 0, 64);
    a.qp.post_send(&[
        SendWr::send(1, &[a.mr.sge(0, 16)]).signaled(),
        SendWr::send(2, &[a.mr.sge(0, 1)]),
    ])
    .unwrap();
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    let r1 = p.next(1);
    assert_eq!((r1.wr_id, r1.status), (10, WcStatus::LocLenErr));
    let r2 = p.next(1);
    assert_eq!((r2.wr_id, r2.status), (11, WcStatus::WrFlushErr));
    let s1 = p.next(0);
    assert_eq!((s1.wr_id, s1.status), (1, WcStatus::RemInvReqErr));
    assert_eq!(p.next(0).status, WcStatus::WrFlushErr);
    assert_eq!((a.qp.state(), b.qp.state()), (QpState::Err, QpState::Err));
}

/// RESET → RTS towards `peer` with the given RNR attributes (what an application sets by hand).
fn ready_rnr(qp: &Qp, peer: &PeerInfo, min_rnr_timer: u8, rnr_retry: u8) {
    use QpAttrMask as M;
    cm::init_qp(qp, &ConnParam::default()).unwrap();
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        dest_qp_num: peer.qpn,
        ah_attr: AhAttr {
            dlid: peer.node as u16,
            port_num: 1,
            ..AhAttr::default()
        },
        min_rnr_timer,
        ..QpAttr::default()
    };
    let m = M::STATE
        | M::AV
        | M::PATH_MTU
        | M::DEST_QPN
        | M::RQ_PSN
        | M::MAX_DEST_RD_ATOMIC
        | M::MIN_RNR_TIMER;
    qp.modify(&rtr, m).unwrap();
    let rts = QpAttr {
        qp_state: QpState::Rts,
        rnr_retry,
        ..QpAttr::default()
    };
    let m = M::STATE | M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC;
    qp.modify(&rts, m).unwrap();
}

#[test]
fn no_receive_on_rc_retries_rnr_rnr_retry_times_then_fails() {
    let fab = Fab::up("verbs_rnr", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let a = side(&f, 1, QpType::Rc, ALL, 4096);
    let b = side(&f, 2, QpType::Rc, ALL, 4096);
    // The responder asks for 1.28 ms between retries (encoding 14); the requester retries 3
    // times: the error comes after about 4 x 1.28 ms.
    ready_rnr(&a.qp, &info(&b), 14, 3);
    ready_rnr(&b.qp, &info(&a), 14, 3);
    // Timed from before the post: the first try (and the first wait) starts inside it (a
    // stamp taken after it was 20 us short of 4 x 1.28 ms on a loaded CI machine).
    let t0 = Instant::now();
    a.qp.post_send(&[
        SendWr::send(1, &[a.mr.sge(0, 8)]).signaled(),
        SendWr::send(2, &[a.mr.sge(0, 8)]),
    ])
    .unwrap();
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    let w = p.next(0);
    let took = t0.elapsed();
    assert_eq!((w.wr_id, w.status), (1, WcStatus::RnrRetryExcErr));
    assert_eq!(p.next(0).status, WcStatus::WrFlushErr);
    assert!(
        took >= Duration::from_micros(4 * 1280),
        "gave up after {took:?}"
    );
    eprintln!("RNR_RETRY_EXC_ERR after {took:?} (1 try + 3 retries of 1.28 ms)");
    // With a receive posted in time, the same send goes through (rnr_retry 7 = forever).
    let (a, b) = pair(&f, QpType::Rc, ALL, 4096);
    a.qp.post_send(&[SendWr::send(1, &[a.mr.sge(0, 8)]).signaled()])
        .unwrap();
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    assert!(p.quiet(0), "waits for a receive");
    recv(&b, 9, 0, 64);
    assert_eq!(p.next(0).status, WcStatus::Success);
    assert_eq!(p.next(1).wr_id, 9);
}

#[test]
fn a_peer_node_going_down_fails_outstanding_work_within_a_second() {
    let fab = Fab::up_restarting("verbs_down", 2, 0);
    let f = Fabric::attach(&fab.name).unwrap();
    // The requester sleeps on a completion channel: the watcher must notice the death.
    let a = watched_side(&f, 1);
    let b = side(&f, 2, QpType::Rc, ALL, 4096);
    cm::ready_qp(&a.qp, &info(&b), &ConnParam::default()).unwrap();
    cm::ready_qp(&b.qp, &info(&a), &ConnParam::default()).unwrap();
    let (aqp, acq, amr, ch) = (&a.qp, &a.cq, &a.mr, a.ch.as_ref().unwrap());
    // Outstanding: sends waiting for a receive node 2 will never post.
    aqp.post_send(&[
        SendWr::send(1, &[amr.sge(0, 8)]).signaled(),
        SendWr::send(2, &[amr.sge(0, 8)]),
    ])
    .unwrap();
    let mut wc = [Wc::default(); 4];
    assert_eq!(acq.poll(&mut wc), 0);
    acq.req_notify(false).unwrap();
    assert!(matches!(
        ch.get_cq_event(Some(Duration::from_millis(20))),
        Err(VerbsError::TimedOut)
    ));
    let pid = fab.status()["slots"][1]["pid"].as_i64().unwrap() as i32;
    let t0 = Instant::now();
    // SAFETY: kill(2) with a pid read from the fabric's status; no memory is involved.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let ev = ch.get_cq_event(Some(Duration::from_secs(20))).unwrap();
    assert_eq!(ev.cq_id, acq.id());
    let mut got = Vec::new();
    while got.len() < 2 {
        let n = acq.poll(&mut wc);
        got.extend_from_slice(&wc[..n]);
        assert!(t0.elapsed() < Duration::from_secs(20), "no completion");
    }
    let took = t0.elapsed();
    assert_eq!((got[0].wr_id, got[0].status), (1, WcStatus::RetryExcErr));
    assert_eq!((got[1].wr_id, got[1].status), (2, WcStatus::WrFlushErr));
    eprintln!("outstanding work failed {took:?} after node 2 was killed (completion channel)");
    drop(b);
}

/// A NIC acknowledges a message when it lands in a posted receive, polled or not, and a
/// requester whose peer vanished retries for `(retry_cnt + 1) × 4.096 µs × 2^timeout` before
/// RETRY_EXC_ERR. `ibv_srq_pingpong` depends on both: its client exits after its last expected
/// completion with the server's extra sends in its ring; failing those at once failed the server.
#[test]
fn a_destroyed_qp_acknowledges_what_it_holds_and_unacknowledged_work_fails_after_the_retries() {
    let fab = Fab::up("verbs_gone_ack", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, b) = pair(&f, QpType::Rc, ALL, 4096);
    recv(&b, 7, 0, 64);
    recv(&b, 8, 64, 64);
    let mut wc = [Wc::default(); 4];
    // b's poll publishes its credits; a's two sends then go out at once, into b's ring.
    assert_eq!(b.cq.poll(&mut wc), 0);
    a.qp.post_send(&[
        SendWr::send_inline(1, b"one").signaled(),
        SendWr::send_inline(2, b"two").signaled(),
    ])
    .unwrap();
    // b does not poll again: its QP goes with both messages in its ring.
    let Side { qp: bqp, .. } = b;
    drop(bqp);
    let mut p = Pump::new(&[&a.cq]);
    for id in [1, 2] {
        let w = p.next(0);
        assert_eq!((w.wr_id, w.status), (id, WcStatus::Success), "{w:?}");
    }
    // Work posted now is never acknowledged: it fails once the retries are spent (ready_qp
    // sets timeout 14 and retry_cnt 7: 8 × 67 ms), not sooner.
    let t0 = Instant::now();
    a.qp.post_send(&[SendWr::send_inline(3, b"three").signaled()])
        .unwrap();
    let w = p.next(0);
    let took = t0.elapsed();
    assert_eq!((w.wr_id, w.status), (3, WcStatus::RetryExcErr), "{w:?}");
    let wait = backplane::verbs::fsm::retry_wait(14, 7);
    assert!(
        took >= wait,
        "failed after {took:?}, before the retries ({wait:?})"
    );
    assert_eq!(a.cq.poll(&mut wc), 0);
}

#[test]
fn a_peer_scribbling_over_its_window_gets_its_qp_in_error_never_a_panic() {
    let fab = Fab::up("verbs_hostile", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let (a, b) = pair(&f, QpType::Rc, ALL, 4096);
    for i in 0..4 {
        recv(&b, i, 0, 64);
    }
    a.qp.post_send(&[SendWr::send_inline(1, b"before").signaled()])
        .unwrap();
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    assert_eq!(p.next(1).status, WcStatus::Success);
    assert_eq!(p.next(0).status, WcStatus::Success);
    // Garbage over node 2's whole heap: b's QP block, ring and event block included.
    let w = f.raw_window(2).unwrap();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut junk = vec![0u8; w.len() - 4096];
    for c in junk.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    w.write(4096, &junk).unwrap();
    // b finds its ring corrupt at its next poll and goes to ERR, flushing its receives.
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    let r = p.next(1);
    assert_eq!(r.status, WcStatus::WrFlushErr, "{r:?}");
    assert_eq!(b.qp.state(), QpState::Err);
    // a's next send fails (the peer is in error) instead of hanging.
    a.qp.post_send(&[SendWr::send_inline(2, b"after").signaled()])
        .unwrap();
    let s = p.next(0);
    assert_eq!((s.wr_id, s.status), (2, WcStatus::RetryExcErr), "{s:?}");
    eprintln!("b: {:?}; a's send: {}", b.qp.fatal_error(), s.status);
}

#[test]
fn wrong_transitions_and_missing_attributes_are_invalid_arguments() {
    let fab = Fab::up("verbs_fsm", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let a = side(&f, 1, QpType::Rc, ALL, 4096);
    let rts = QpAttr {
        qp_state: QpState::Rts,
        ..QpAttr::default()
    };
    assert!(matches!(
        a.qp.modify(&rts, QpAttrMask::STATE),
        Err(VerbsError::InvalidArgument(_))
    ));
    let init = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        ..QpAttr::default()
    };
    let e =
        a.qp.modify(&init, QpAttrMask::STATE | QpAttrMask::PORT)
            .unwrap_err();
    assert!(e.to_string().contains("ACCESS_FLAGS"), "{e}");
    assert_eq!(a.qp.state(), QpState::Reset);
    // Posting before RTS is refused; receives before INIT too.
    let e = a.qp.post_send(&[SendWr::send(1, &[])]).unwrap_err();
    assert!(matches!(e, VerbsError::Post { bad_wr: 0, .. }), "{e}");
    assert!(a
        .qp
        .post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: &[]
        }])
        .is_err());
    // RTR towards a QP that does not exist.
    let mut b = info(&a);
    b.node = 2;
    b.qpn = 0xABCDE;
    assert!(cm::ready_qp(&a.qp, &b, &ConnParam::default()).is_err());
    assert_eq!(a.qp.query().qp_state, QpState::Init);
    // Any state may go to ERR, then RESET, and start over.
    let err = QpAttr {
        qp_state: QpState::Err,
        ..QpAttr::default()
    };
    a.qp.modify(&err, QpAttrMask::STATE).unwrap();
    let reset = QpAttr {
        qp_state: QpState::Reset,
        ..QpAttr::default()
    };
    a.qp.modify(&reset, QpAttrMask::STATE).unwrap();
    assert_eq!(a.qp.state(), QpState::Reset);
}

#[test]
fn a_completion_channel_fd_wakes_a_poll_loop_for_a_peer_send() {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let fab = Fab::up("verbs_channel", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let a = side(&f, 1, QpType::Rc, ALL, 4096);
    let b = watched_side(&f, 2);
    cm::ready_qp(&a.qp, &info(&b), &ConnParam::default()).unwrap();
    cm::ready_qp(&b.qp, &info(&a), &ConnParam::default()).unwrap();
    let (bqp, bcq, bmr, ch) = (&b.qp, &b.cq, &b.mr, b.ch.as_ref().unwrap());
    bqp.post_recv(&[RecvWr {
        wr_id: 5,
        sg_list: &[bmr.sge(0, 64)],
    }])
    .unwrap();
    bcq.req_notify(false).unwrap();
    let ts = Timespec {
        tv_sec: 0,
        tv_nsec: 50_000_000,
    };
    let mut fds = [PollFd::new(&ch, PollFlags::IN)];
    assert_eq!(
        poll(&mut fds, Some(&ts)).unwrap(),
        0,
        "no event before the send"
    );
    a.qp.post_send(&[SendWr::send_inline(1, b"wake up")])
        .unwrap();
    let ts = Timespec {
        tv_sec: 10,
        tv_nsec: 0,
    };
    let mut fds = [PollFd::new(&ch, PollFlags::IN)];
    assert_eq!(
        poll(&mut fds, Some(&ts)).unwrap(),
        1,
        "the channel fd became readable"
    );
    let ev = ch.get_cq_event(Some(Duration::from_secs(1))).unwrap();
    assert_eq!(ev.cq_id, bcq.id());
    ch.ack_cq_events(1);
    let mut wc = [Wc::default()];
    assert_eq!(bcq.poll(&mut wc), 1);
    assert_eq!((wc[0].wr_id, wc[0].byte_len), (5, 7));
    assert_eq!(&common::bytes(bmr)[..7], b"wake up");
    // Nothing more: no event within 50 ms after re-arming.
    bcq.req_notify(false).unwrap();
    assert!(matches!(
        ch.get_cq_event(Some(Duration::from_millis(50))),
        Err(VerbsError::TimedOut)
    ));
}

#[test]
fn arming_a_cq_that_holds_a_completion_fires_at_once() {
    // As a NIC's CQ does: a program that took an event for another CQ of its channel re-arms
    // a CQ whose completion a poll already made (`ib_send_lat -e` waited for ever).
    let fab = Fab::up("verbs_arm_full", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let a = side(&f, 1, QpType::Rc, ALL, 4096);
    let b = watched_side(&f, 2);
    cm::ready_qp(&a.qp, &info(&b), &ConnParam::default()).unwrap();
    cm::ready_qp(&b.qp, &info(&a), &ConnParam::default()).unwrap();
    let ch = b.ch.as_ref().unwrap();
    recv(&b, 4, 0, 64);
    a.qp.post_send(&[SendWr::send_inline(1, b"early")]).unwrap();
    // A poll of no entries moves the QP along: the completion is made, not taken.
    assert_eq!(b.cq.poll(&mut []), 0);
    b.cq.req_notify(false).unwrap();
    let ev = ch.get_cq_event(Some(Duration::from_secs(5)));
    assert_eq!(
        ev.map(|e| e.cq_id).ok(),
        Some(b.cq.id()),
        "an event at once"
    );
    ch.ack_cq_events(1);
    let mut wc = [Wc::default()];
    assert_eq!(b.cq.poll(&mut wc), 1);
    assert_eq!((wc[0].wr_id, wc[0].byte_len), (4, 5));
}

#[test]
fn a_send_that_starts_waiting_for_a_receive_after_arming_still_wakes_the_channel() {
    // A arms its CQ, then posts a SEND while B has no receive (RNR, retried forever): what
    // the channel watches must grow to B's credits, or A sleeps through B's receive (the
    // pingpong across hosts, whose server posts its receives after the client sends).
    let fab = Fab::up("verbs_rnr_armed", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let a = watched_side(&f, 1);
    let b = side(&f, 2, QpType::Rc, ALL, 4096);
    ready_rnr(&a.qp, &info(&b), 14, 7);
    ready_rnr(&b.qp, &info(&a), 14, 7);
    let ch = a.ch.as_ref().unwrap();
    a.cq.req_notify(false).unwrap();
    a.qp.post_send(&[SendWr::send_inline(1, b"late").signaled()])
        .unwrap();
    recv(&b, 9, 0, 64);
    let ev = ch.get_cq_event(Some(Duration::from_secs(5)));
    assert!(ev.is_ok(), "no event for the SEND waiting on B's receive");
    ch.ack_cq_events(1);
    let mut p = Pump::new(&[&a.cq, &b.cq]);
    assert_eq!(p.next(0).status, WcStatus::Success);
    assert_eq!(p.next(1).wr_id, 9);
}

#[test]
fn an_ack_that_came_before_arming_still_wakes_the_channel() {
    // A's SEND completes only once B acknowledges it. B takes the message (its ack moves)
    // while A is not polling; A then arms its CQ and waits: the channel must fire for the ack
    // A has not taken in yet, not sleep until another one comes (none will: B is idle).
    let fab = Fab::up("verbs_ack_arm", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    let a = watched_side(&f, 1);
    let b = side(&f, 2, QpType::Rc, ALL, 4096);
    cm::ready_qp(&a.qp, &info(&b), &ConnParam::default()).unwrap();
    cm::ready_qp(&b.qp, &info(&a), &ConnParam::default()).unwrap();
    let (acq, ch) = (&a.cq, a.ch.as_ref().unwrap());
    recv(&b, 5, 0, 64);
    a.qp.post_send(&[SendWr::send_inline(1, b"ack me").signaled()])
        .unwrap();
    let mut pump = Pump::new(&[&b.cq]);
    let w = pump.next(0);
    assert_eq!((w.wr_id, w.status), (5, WcStatus::Success));
    acq.req_notify(false).unwrap();
    let ev = ch.get_cq_event(Some(Duration::from_secs(5)));
    assert!(
        ev.is_ok(),
        "no event for an ack given before arming: {ev:?}"
    );
    ch.ack_cq_events(1);
    let mut wc = [Wc::default()];
    let end = Instant::now() + Duration::from_secs(20);
    while acq.poll(&mut wc) == 0 {
        assert!(Instant::now() < end, "the SEND never completed");
    }
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::Success));
}

// ---------------------------------------------------------------------------------------------
// Two processes: the test process is node 1, a child plays the server on node 2.
// ---------------------------------------------------------------------------------------------

const CM_PORT: u32 = cm::DEFAULT_PORT;

/// The server (child process, node 2): offers a region through the connection helper, answers
/// "ping" with "pong", checks RDMA_WRITE_WITH_IMM data, ends on "bye". `BP_CASE` says which
/// region it offers: `ops` (all access, in the QP's PD), `nogrant` (a region of another PD),
/// `ro` (remote read only).
#[test]
fn role_server() {
    let Some(role) = role() else { return };
    assert_eq!(role, "server");
    let var = |k: &str| std::env::var(k).unwrap();
    let f = Fabric::attach(&var("BP_FABRIC")).unwrap();
    let case = var("BP_CASE");
    let ctx = Context::open(&f.node(2).unwrap()).unwrap();
    let pd = ctx.alloc_pd();
    let other = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let qp = pd
        .create_qp(&QpInitAttr::new(QpType::Rc, &cq, &cq))
        .unwrap();
    let ctl = pd.alloc_mr(64 * 16, AccessFlags::LOCAL_WRITE).unwrap();
    cm::init_qp(&qp, &ConnParam::default()).unwrap();
    let mr = match case.as_str() {
        "ops" => pd.alloc_mr(1 << 20, ALL).unwrap(),
        "nogrant" => other.alloc_mr(4096, ALL).unwrap(),
        _ => pd
            .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
            .unwrap(),
    };
    let pattern: Vec<u8> = (0..mr.len()).map(|i| (i % 199) as u8).collect();
    mr.write(0, &pattern).unwrap();
    for i in 0..16 {
        qp.post_recv(&[RecvWr {
            wr_id: i,
            sg_list: &[ctl.sge(i * 64, 64)],
        }])
        .unwrap();
    }
    let mut l = cm::Listener::bind(&ctx, CM_PORT).unwrap();
    let offer = ConnParam {
        rkey: mr.rkey(),
        len: mr.len() as u64,
        private_data: b"server".to_vec(),
        ..ConnParam::default()
    };
    let peer = l
        .accept(&qp, &offer, Some(Duration::from_secs(20)))
        .unwrap();
    assert_eq!((peer.node, &peer.private_data[..]), (1, &b"client"[..]));
    let mut wc = [Wc::default(); 4];
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < end, "server: no word from the client");
        let n = cq.poll(&mut wc);
        for w in &wc[..n] {
            assert_eq!(
                w.status,
                WcStatus::Success,
                "server: {w:?} {:?}",
                qp.fatal_error()
            );
            if w.opcode == WcOpcode::Send {
                continue;
            }
            let slot = w.wr_id;
            let reply: &[u8] = if w.opcode == WcOpcode::RecvRdmaWithImm {
                let n = w.imm_data as usize;
                let ok = mr.to_vec(0, n).unwrap().iter().all(|&b| b == 0xEE);
                if ok {
                    b"imm-ok"
                } else {
                    b"imm-bad"
                }
            } else {
                let msg = ctl.to_vec(slot * 64, w.byte_len as usize).unwrap();
                match &msg[..] {
                    b"ping" => b"pong",
                    b"bye" => return,
                    _ => b"what?",
                }
            };
            qp.post_recv(&[RecvWr {
                wr_id: slot,
                sg_list: &[ctl.sge(slot * 64, 64)],
            }])
            .unwrap();
            qp.post_send(&[SendWr::send_inline(1000, reply).signaled()])
                .unwrap();
        }
    }
}

/// The client side of the server role: a context on node 1 connected through the helper.
struct Client {
    ctx: Context,
    cq: Cq,
    qp: Qp,
    mr: Mr,
    peer: PeerInfo,
    child: std::process::Child,
    stash: VecDeque<Wc>,
}

fn client(fab: &Fab, case: &str) -> Client {
    let child = spawn_role(
        "role_server",
        "server",
        &[
            ("BP_FABRIC", fab.name.clone()),
            ("BP_CASE", case.to_string()),
        ],
    );
    let f = Fabric::attach(&fab.name).unwrap();
    let ctx = Context::open(&f.node(1).unwrap()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let qp = pd
        .create_qp(&QpInitAttr::new(QpType::Rc, &cq, &cq))
        .unwrap();
    let mr = pd.alloc_mr(1 << 20, ALL).unwrap();
    cm::init_qp(&qp, &ConnParam::default()).unwrap();
    for i in 0..8 {
        qp.post_recv(&[RecvWr {
            wr_id: i,
            sg_list: &[mr.sge(900_000 + i * 64, 64)],
        }])
        .unwrap();
    }
    let mine = ConnParam {
        private_data: b"client".to_vec(),
        ..ConnParam::default()
    };
    let peer = cm::connect(&ctx, 2, CM_PORT, &qp, &mine, Duration::from_secs(20)).unwrap();
    assert_eq!(peer.private_data, b"server");
    Client {
        ctx,
        cq,
        qp,
        mr,
        peer,
        child,
        stash: VecDeque::new(),
    }
}

impl Client {
    /// The next completion matching `want` (others are kept for later).
    fn take(&mut self, want: impl Fn(&Wc) -> bool) -> Wc {
        if let Some(i) = self.stash.iter().position(&want) {
            return self.stash.remove(i).unwrap();
        }
        let mut wc = [Wc::default()];
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            if self.cq.poll(&mut wc) == 1 {
                if want(&wc[0]) {
                    return wc[0];
                }
                self.stash.push_back(wc[0]);
            }
            assert!(Instant::now() < end, "client: no completion");
        }
    }
    fn wait(&mut self, wr_id: u64) -> Wc {
        self.take(|w| w.wr_id == wr_id && (w.opcode as u32) < 128)
    }
    /// The next message from the server (the receive is reposted).
    fn reply(&mut self) -> Vec<u8> {
        let w = self.take(|w| w.opcode == WcOpcode::Recv);
        assert_eq!(w.status, WcStatus::Success, "{w:?}");
        let o = 900_000 + w.wr_id as usize * 64;
        let r = self.mr.to_vec(o as u64, w.byte_len as usize).unwrap();
        self.qp
            .post_recv(&[RecvWr {
                wr_id: w.wr_id,
                sg_list: &[self.mr.sge(o as u64, 64)],
            }])
            .unwrap();
        r
    }
    /// Sends `msg`; returns the server's reply.
    fn say(&mut self, msg: &[u8]) -> Vec<u8> {
        self.qp
            .post_send(&[SendWr::send_inline(7, msg).signaled()])
            .unwrap();
        assert_eq!(self.wait(7).status, WcStatus::Success);
        self.reply()
    }
    fn bye(mut self) {
        self.qp
            .post_send(&[SendWr::send_inline(8, b"bye").signaled()])
            .unwrap();
        assert_eq!(self.wait(8).status, WcStatus::Success);
        assert!(self.child.wait().unwrap().success(), "server role failed");
    }
}

/// After `down`: nothing of fabric `name` is left but what this (test) process still holds.
fn nothing_left_but_this_process(name: &str) {
    let left = leftovers(name);
    assert!(
        left.iter()
            .all(|l| l.starts_with(&format!("pid {}", std::process::id()))),
        "{left:?}"
    );
}

#[test]
fn two_processes_connect_with_the_helper_and_run_every_rc_operation() {
    if role().is_some() {
        return;
    }
    let fab = Fab::up("verbs_2proc", 2);
    let mut c = client(&fab, "ops");
    let rkey = c.peer.rkey;
    assert_eq!(c.say(b"ping"), b"pong");
    // READ the server's pattern, WRITE over it, READ it back, atomics on it.
    c.qp.post_send(&[SendWr::read(1, &[c.mr.sge(0, 4096)], 0, rkey).signaled()])
        .unwrap();
    assert_eq!(c.wait(1).status, WcStatus::Success);
    assert!(common::bytes(&c.mr)[..4096]
        .iter()
        .enumerate()
        .all(|(i, &b)| b == (i % 199) as u8));
    c.mr.fill(0, 100, 0xEE).unwrap();
    c.qp.post_send(&[
        SendWr::write(2, &[c.mr.sge(0, 100)], 0, rkey)
            .with_imm(100)
            .signaled(),
        SendWr::fetch_add(3, &[c.mr.sge(8192, 8)], 512, rkey, 1).signaled(),
    ])
    .unwrap();
    let (w2, w3) = (c.wait(2), c.wait(3));
    assert_eq!(
        (w2.wr_id, w2.status, w3.wr_id, w3.status),
        (2, WcStatus::Success, 3, WcStatus::Success)
    );
    let old = u64::from_le_bytes(common::bytes(&c.mr)[8192..8200].try_into().unwrap());
    let expect = u64::from_le_bytes(std::array::from_fn(|i| ((512 + i) % 199) as u8));
    assert_eq!(old, expect);
    assert_eq!(c.reply(), b"imm-ok");
    assert_eq!(c.say(b"ping"), b"pong");
    let name = fab.name.clone();
    assert_eq!(
        region_maps(&name).len(),
        1,
        "the granted region is mapped once"
    );
    let _ = &c.ctx;
    c.bye();
    drop(fab);
    nothing_left_but_this_process(&name);
}

#[test]
fn a_peer_without_a_grant_cannot_map_a_region() {
    if role().is_some() {
        return;
    }
    let fab = Fab::up("verbs_nogrant", 2);
    let mut c = client(&fab, "nogrant");
    // The server offered the rkey of a region in another PD than its QP's: no grant.
    c.qp.post_send(&[SendWr::read(1, &[c.mr.sge(0, 8)], 0, c.peer.rkey).signaled()])
        .unwrap();
    assert_eq!(c.wait(1).status, WcStatus::RemAccessErr);
    assert!(region_maps(&fab.name).is_empty(), "no grant, no mapping");
    let fds: Vec<_> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter(|t| {
            t.to_string_lossy()
                .contains(&format!("bp-{}-mr-n2", fab.name))
        })
        .collect();
    assert!(fds.is_empty(), "no grant, no fd: {fds:?}");
    // The QP is in ERR now; the server is told through a fresh QP? Simply stop it.
    let mut child = c.child;
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn a_read_only_grant_is_mapped_read_only_and_the_os_refuses_writes() {
    if role().is_some() {
        return;
    }
    let fab = Fab::up("verbs_rogrant", 2);
    let mut c = client(&fab, "ro");
    let rkey = c.peer.rkey;
    c.qp.post_send(&[SendWr::read(1, &[c.mr.sge(0, 4096)], 0, rkey).signaled()])
        .unwrap();
    assert_eq!(c.wait(1).status, WcStatus::Success);
    assert_eq!(common::bytes(&c.mr)[198], 198);
    let maps = region_maps(&fab.name);
    assert_eq!(maps.len(), 1, "{maps:?}");
    let perms = maps[0].split_whitespace().nth(1).unwrap();
    assert_eq!(perms, "r--s", "{}", maps[0]);
    // The fd we were granted: mapping it writable must fail, even after reopening it
    // read-write through /proc.
    let fd = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .find(|e| {
            std::fs::read_link(e.path()).is_ok_and(|t| {
                t.to_string_lossy()
                    .contains(&format!("bp-{}-mr-n2", fab.name))
            })
        })
        .expect("granted fd")
        .path();
    let map_rw = |path: &std::path::Path, flags: libc::c_int| -> Result<(), std::io::Error> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(flags == libc::O_RDWR)
            .open(path)?;
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh mapping chosen by the kernel; unmapped at once if it succeeds.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `p` is the 4096-byte mapping just made.
        unsafe { libc::munmap(p, 4096) };
        Ok(())
    };
    let e = map_rw(&fd, libc::O_RDONLY).unwrap_err();
    eprintln!("mmap PROT_WRITE of the read-only grant: {e}");
    if let Err(e) = map_rw(&fd, libc::O_RDWR) {
        eprintln!("mmap PROT_WRITE after reopening O_RDWR: {e}");
    } else {
        panic!("a read-only region was mapped writable after reopening it");
    }
    // And the verbs layer refuses a WRITE to it.
    c.qp.post_send(&[SendWr::write(2, &[c.mr.sge(0, 8)], 0, rkey).signaled()])
        .unwrap();
    assert_eq!(c.wait(2).status, WcStatus::RemAccessErr);
    let mut child = c.child;
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn a_shared_receive_queue_feeds_every_qp_made_with_it_and_an_empty_one_holds_messages_back() {
    let fab = Fab::up("verbs_srq", 2);
    let f = Fabric::attach(&fab.name).unwrap();
    // Node 1: two plain RC QPs. Node 2: two RC QPs on one SRQ.
    let a = side(&f, 1, QpType::Rc, ALL, 4096);
    let a2 =
        a.pd.create_qp(&QpInitAttr::new(QpType::Rc, &a.cq, &a.cq))
            .unwrap();
    let ctx = Context::open(&f.node(2).unwrap()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(64, None).unwrap();
    let mr = pd.alloc_mr(4096, ALL).unwrap();
    assert!(pd
        .create_srq(SrqAttr {
            max_wr: 0,
            max_sge: 1
        })
        .is_err());
    let srq = pd
        .create_srq(SrqAttr {
            max_wr: 3,
            max_sge: 1,
        })
        .unwrap();
    let mut init = QpInitAttr::new(QpType::Rc, &cq, &cq);
    init.srq = Some(&srq);
    let (b1, b2) = (pd.create_qp(&init).unwrap(), pd.create_qp(&init).unwrap());
    assert!(srq.in_use());
    let peer = |qp: &Qp| PeerInfo {
        node: 2,
        qpn: qp.qp_num(),
        psn: 0,
        rkey: mr.rkey(),
        addr: 0,
        len: 4096,
        qkey: cm::DEFAULT_QKEY,
        private_data: Vec::new(),
    };
    let mut from_a = info(&a);
    cm::ready_qp(&a.qp, &peer(&b1), &ConnParam::default()).unwrap();
    cm::ready_qp(&b1, &from_a, &ConnParam::default()).unwrap();
    from_a.qpn = a2.qp_num();
    cm::ready_qp(&a2, &peer(&b2), &ConnParam::default()).unwrap();
    cm::ready_qp(&b2, &from_a, &ConnParam::default()).unwrap();
    let post = |wr_id: u64, off: u64| {
        srq.post_recv(&[RecvWr {
            wr_id,
            sg_list: &[mr.sge(off, 64)],
        }])
    };
    post(100, 0).unwrap();
    post(101, 64).unwrap();
    post(102, 128).unwrap();
    assert!(
        matches!(post(103, 192), Err(VerbsError::Post { .. })),
        "a full SRQ refuses"
    );
    assert!(
        b1.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: &[mr.sge(0, 8)]
        }])
        .is_err(),
        "a QP on an SRQ takes no receives of its own"
    );
    a.mr.write(0, b"one.....two.....three...").unwrap();
    a.qp.post_send(&[SendWr::send(1, &[a.mr.sge(0, 8)]).signaled()])
        .unwrap();
    a2.post_send(&[SendWr::send(2, &[a.mr.sge(8, 8)]).signaled()])
        .unwrap();
    let mut p = Pump::new(&[&a.cq, &cq]);
    let mut got = [p.next(1), p.next(1)];
    got.sort_by_key(|w| w.wr_id);
    assert_eq!(
        got.map(|w| (w.wr_id, w.status, w.byte_len)),
        [(100, WcStatus::Success, 8), (101, WcStatus::Success, 8)]
    );
    let by_qp = |w: &Wc| if w.qp_num == b1.qp_num() { 1 } else { 2 };
    let mut seen: Vec<(u8, Vec<u8>)> = got
        .iter()
        .map(|w| {
            let mut b = vec![0u8; 8];
            mr.read((w.wr_id - 100) * 64, &mut b).unwrap();
            (by_qp(w), b)
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        vec![(1, b"one.....".to_vec()), (2, b"two.....".to_vec())]
    );
    assert_eq!([p.next(0).status, p.next(0).status], [WcStatus::Success; 2]);
    // One receive left, two messages: the second waits in its QP's ring, unacknowledged.
    a.qp.post_send(&[SendWr::send(3, &[a.mr.sge(16, 8)]).signaled()])
        .unwrap();
    a.qp.post_send(&[SendWr::send(4, &[a.mr.sge(0, 8)]).signaled()])
        .unwrap();
    assert_eq!(p.next(1).wr_id, 102);
    assert_eq!(p.next(0).wr_id, 3);
    assert!(p.quiet(1) && p.quiet(0), "held back while the SRQ is empty");
    assert_eq!(srq.waiting(), 0);
    post(104, 256).unwrap();
    let w = p.next(1);
    assert_eq!((w.wr_id, w.qp_num), (104, b1.qp_num()));
    let mut b = [0u8; 8];
    mr.read(256, &mut b).unwrap();
    assert_eq!(&b, b"one.....");
    assert_eq!(p.next(0).wr_id, 4);
    drop((b1, b2));
    assert!(!srq.in_use());
}

#[test]
fn the_rkey_of_a_killed_process_is_rem_access_err_for_the_process_that_takes_its_place() {
    if role().is_some() {
        return;
    }
    let fab = Fab::up("verbs_deadkey", 2);
    let mut first = client(&fab, "ops");
    let dead = first.peer.rkey;
    assert_eq!(first.say(b"ping"), b"pong");
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    // The same program again on the same node: its region gets a new key, and the old one
    // names nothing any more — not the new process's memory, not the dead one's.
    let mut second = client(&fab, "ops");
    assert_ne!(second.peer.rkey, dead);
    assert_eq!(second.say(b"ping"), b"pong");
    second.mr.fill(0, 64, 0xAB).unwrap();
    second
        .qp
        .post_send(&[SendWr::write(1, &[second.mr.sge(0, 64)], 0, dead).signaled()])
        .unwrap();
    assert_eq!(second.wait(1).status, WcStatus::RemAccessErr);
    let _ = second.child.kill();
    let _ = second.child.wait();
    drop((first.qp, first.cq, first.mr, first.ctx));
    let name = fab.name.clone();
    drop(fab);
    nothing_left_but_this_process(&name);
}
