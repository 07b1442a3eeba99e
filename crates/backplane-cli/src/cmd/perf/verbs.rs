//! The verbs benchmarks of `backplane perf`, shaped like perftest's `ib_*_lat` / `ib_*_bw`:
//! one RC QP pair between node 1 (this process) and node 2 (`perf-peer`), connected with the
//! connection helper, each side with one region of 3 MiB:
//!
//! - `[0, 1 MiB)`: written or read by the peer (RDMA targets; polled in `write-lat`);
//! - `[1 MiB, 2 MiB)`: local source of writes and sends, destination of reads and atomics;
//! - `[2 MiB, 3 MiB)`: every posted receive (control messages and SEND data).
//!
//! Per size the client sends a control message `(size, count)`; the peer answers "ready" and
//! plays its part: echo (`write-lat`, `send-lat`), sink and answer "done" (`send-bw`), or
//! nothing (the one-sided `write-bw`, `read-*`, `atomic-lat`).

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use backplane::fabric::Fabric;
use backplane::verbs::cm::{self, ConnParam, PeerInfo};
use backplane::verbs::*;

use super::{Loop, Test, MAX_SIZE};
use backplane_bench::perf_row::Row;

const RX_DEPTH: u32 = 512;
const TX_DEPTH: u32 = 128;
/// Every CQ_MOD-th send is signaled (perftest's `--cq-mod`).
const CQ_MOD: u64 = 64;
const INLINE: u64 = 256;
const RING: u32 = 4 << 20;
/// The ring on a fabric across hosts. While each process copied what its QP wrote into the
/// ring into the messages to the other host and back, a ring that stayed in the cache was
/// faster (`ib_send_bw` 64 KiB between two hosts, session 31: 512 KiB ring 3 464 MiB/s,
/// 1 MiB 3 898, 4 MiB 2 817). Since a large SEND's payload goes from the program's region
/// into the message and from the message into the posted receive (sessions 31, 38, 39), the
/// ring holds little more than headers, and it is the window of SEND data in flight: `perf
/// send-bw` 64 KiB, alternating pairs against 1 MiB, median ~1.14 with 2 MiB (6 pairs), ~1.1
/// with 4 MiB (12). (The drop-in library gives perftest 1 MiB by default, 2 MiB at most:
/// `BACKPLANE_VERBS_RING` sets it.)
const RING_ACROSS: u32 = 2 << 20;
const SRC: u64 = MAX_SIZE;
const RX: u64 = 2 * MAX_SIZE;
const ALL: AccessFlags = AccessFlags::from_bits_retain(
    AccessFlags::LOCAL_WRITE.bits()
        | AccessFlags::REMOTE_WRITE.bits()
        | AccessFlags::REMOTE_READ.bits()
        | AccessFlags::REMOTE_ATOMIC.bits(),
);

/// One side's verbs objects.
struct End {
    _ctx: Context,
    cq: Cq,
    /// The receive CQ when it is not `cq` (see [`open`]).
    rcq: Option<Cq>,
    qp: Qp,
    mr: Mr,
    /// Send work requests posted since the last signaled one.
    sent: u64,
    /// Receives completed while [`End::poll_one`] waited for a send's completion.
    early_recvs: u64,
}

/// The 30 s a polling loop waits for the peer, checked now and then: reading the clock costs
/// as much as a poll, or as the operation being timed (read-lat), so it is read only every
/// 65536th empty poll, from the first such one on.
struct Patience {
    polls: u32,
    since: Option<Instant>,
}

impl Patience {
    fn new() -> Self {
        Self {
            polls: 0,
            since: None,
        }
    }

    /// Counts one empty poll; true once the 30 s are over.
    #[inline]
    fn out(&mut self) -> bool {
        self.polls = self.polls.wrapping_add(1);
        self.polls.is_multiple_of(65536)
            && self.since.get_or_insert_with(Instant::now).elapsed() > Duration::from_secs(30)
    }
}

/// One side's objects; `split`: receives complete on a CQ of their own, as in perftest's
/// SEND tests (`--loop perftest`), rather than on the send CQ.
fn open(fabric: &Fabric, slot: u32, split: bool) -> anyhow::Result<End> {
    let ctx = Context::open(&fabric.node(slot)?)?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(4 * (RX_DEPTH + TX_DEPTH) as usize, None)?;
    let rcq = if split {
        Some(ctx.create_cq(4 * RX_DEPTH as usize, None)?)
    } else {
        None
    };
    let mut init = QpInitAttr::new(QpType::Rc, &cq, rcq.as_ref().unwrap_or(&cq));
    init.cap = QpCap {
        max_send_wr: TX_DEPTH,
        max_recv_wr: RX_DEPTH,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: INLINE as u32,
    };
    init.ring_bytes = if fabric.spans_hosts() {
        RING_ACROSS
    } else {
        RING
    };
    let qp = pd.create_qp(&init)?;
    let mr = pd.alloc_mr(3 * MAX_SIZE as usize, ALL)?;
    cm::init_qp(&qp, &ConnParam::default())?;
    let e = End {
        _ctx: ctx,
        cq,
        rcq,
        qp,
        mr,
        sent: 0,
        early_recvs: 0,
    };
    for _ in 0..RX_DEPTH {
        e.repost()?;
    }
    Ok(e)
}

impl End {
    /// Where receives complete.
    fn recv_cq(&self) -> &Cq {
        self.rcq.as_ref().unwrap_or(&self.cq)
    }

    fn repost(&self) -> anyhow::Result<()> {
        self.qp.post_recv(&[RecvWr {
            wr_id: 0,
            sg_list: &[self.mr.sge(RX, MAX_SIZE as u32)],
        }])?;
        Ok(())
    }

    fn offer(&self) -> ConnParam {
        ConnParam {
            rkey: self.mr.rkey(),
            len: MAX_SIZE,
            ..ConnParam::default()
        }
    }

    /// Polls until a receive completes (send completions are checked and dropped); the
    /// receive is reposted.
    fn wait_recv(&self) -> anyhow::Result<Wc> {
        let w = self.take_recv()?;
        self.repost()?;
        Ok(w)
    }

    /// Polls until a receive completes (send completions are checked and dropped); the caller
    /// reposts it (after answering, in the latency loops: off the critical path).
    fn take_recv(&self) -> anyhow::Result<Wc> {
        let mut wc = [Wc::default(); 2];
        let mut got = None;
        let mut patience = Patience::new();
        loop {
            let n = self.recv_cq().poll(&mut wc);
            for w in &wc[..n] {
                if w.status != WcStatus::Success {
                    bail!("work completed with {} ({w:?})", w.status);
                }
                if w.opcode == WcOpcode::Recv && got.is_none() {
                    got = Some(*w);
                } else if w.opcode == WcOpcode::Recv {
                    bail!("two receives in one poll: the protocol is out of step");
                }
            }
            if let Some(w) = got {
                return Ok(w);
            }
            if patience.out() {
                bail!("the peer stopped answering");
            }
        }
    }

    /// Takes `count` receives (several per poll), reposting each.
    fn sink(&self, count: u64) -> anyhow::Result<()> {
        let mut wc = [Wc::default(); 32];
        let mut got = 0;
        let mut patience = Patience::new();
        while got < count {
            let n = self.cq.poll(&mut wc);
            for w in &wc[..n] {
                if w.status != WcStatus::Success {
                    bail!("work completed with {} ({w:?})", w.status);
                }
                if w.opcode == WcOpcode::Recv {
                    got += 1;
                    self.repost()?;
                }
            }
            if n == 0 && patience.out() {
                bail!("the sender stopped after {got} of {count} messages");
            }
        }
        Ok(())
    }

    /// Polls until the signaled work request `wr_id` completes.
    fn wait_send(&self, wr_id: u64) -> anyhow::Result<()> {
        let mut patience = Patience::new();
        loop {
            // Each completion looked at where it lies (`poll_each`): no buffer to clear and
            // copy into on every READ of `read-lat`'s loop.
            let (mut done, mut bad) = (false, None);
            self.cq.poll_each(1, |_, w| {
                if w.status != WcStatus::Success || w.opcode == WcOpcode::Recv {
                    bad = Some(*w);
                } else {
                    done = w.wr_id == wr_id;
                }
            });
            if let Some(w) = bad {
                if w.status != WcStatus::Success {
                    bail!("work completed with {} ({w:?})", w.status);
                }
                bail!("unexpected receive");
            }
            if done {
                return Ok(());
            }
            if patience.out() {
                bail!("work request {wr_id} never completed");
            }
        }
    }

    /// Posts one send work request, signaling every CQ_MOD-th and reaping it when the send
    /// queue fills.
    #[inline]
    fn post(&mut self, wr: &SendWr<'_>) -> anyhow::Result<()> {
        self.sent += 1;
        let signaled;
        let wrs = if self.sent.is_multiple_of(CQ_MOD) {
            signaled = [SendWr {
                wr_id: self.sent,
                send_flags: wr.send_flags | SendFlags::SIGNALED,
                ..*wr
            }];
            &signaled[..]
        } else {
            std::slice::from_ref(wr)
        };
        self.post_reaping(wrs)
    }

    /// Posts `wrs`, reaping completions while the send queue is full (work whose completion
    /// comes later — an RDMA WRITE to another host — holds its slot until then).
    fn post_reaping(&self, wrs: &[SendWr<'_>]) -> anyhow::Result<()> {
        loop {
            match self.qp.post_send(wrs) {
                Ok(()) => return Ok(()),
                Err(VerbsError::Post { source, .. })
                    if matches!(*source, VerbsError::QueueFull(_)) =>
                {
                    self.reap()?;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Takes whatever completions are there (sends only expected).
    fn reap(&self) -> anyhow::Result<()> {
        let mut wc = [Wc::default(); 16];
        let n = self.cq.poll(&mut wc);
        for w in &wc[..n] {
            if w.status != WcStatus::Success || w.opcode == WcOpcode::Recv {
                bail!("unexpected completion {w:?}");
            }
        }
        Ok(())
    }

    /// Polls one completion at a time, as perftest does, until one of `op` comes (no PAUSE
    /// between polls), receives on the receive CQ. Where that is the send CQ too, a receive
    /// that completes while a send's completion is awaited is counted and taken by the next
    /// wait for a receive. Any other completion, or an error, ends the run.
    fn poll_one(&mut self, op: WcOpcode) -> anyhow::Result<()> {
        if op == WcOpcode::Recv && self.early_recvs > 0 {
            self.early_recvs -= 1;
            return Ok(());
        }
        let mut wc = [Wc::default(); 1];
        let mut patience = Patience::new();
        let on_recv_cq = op == WcOpcode::Recv && self.rcq.is_some();
        loop {
            let cq = match &self.rcq {
                Some(r) if on_recv_cq => r,
                _ => &self.cq,
            };
            if cq.poll(&mut wc) == 1 {
                let w = wc[0];
                if w.status == WcStatus::Success && w.opcode == op {
                    return Ok(());
                }
                if w.status == WcStatus::Success && w.opcode == WcOpcode::Recv {
                    self.early_recvs += 1;
                    continue;
                }
                bail!("unexpected completion {w:?} (waiting for {op:?})");
            }
            if patience.out() {
                bail!("the peer stopped answering");
            }
        }
    }

    /// Polls the byte at `off` of the region until it reads `v`, as `ucx_perftest`'s
    /// `ucp_put_lat` waits: taking this side's completions now and then meanwhile, as it
    /// progresses its worker (one empty poll per 64 loads: nothing on one host; a QP that
    /// this process carries to another host moves along in this thread instead of waking
    /// another for every message — `--loop perftest` is `ib_write_lat`'s loop, which never
    /// calls the library while it waits).
    #[inline]
    fn await_byte(&self, off: u64, v: u8) -> anyhow::Result<()> {
        let mut spins = 0u32;
        while self.peek(off) != v {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                self.reap()?;
            } else {
                std::hint::spin_loop();
            }
        }
        Ok(())
    }

    fn send_ctl(&mut self, a: u64, b: u64) -> anyhow::Result<()> {
        let mut m = [0u8; 16];
        m[..8].copy_from_slice(&a.to_le_bytes());
        m[8..].copy_from_slice(&b.to_le_bytes());
        // Unsignaled: the answer that follows says it arrived.
        self.qp.post_send(&[SendWr::send_inline(u64::MAX, &m)])?;
        Ok(())
    }

    fn ctl(&self, w: &Wc) -> (u64, u64) {
        let mut b = [0u8; 16];
        if w.byte_len != 16 || self.mr.read(RX, &mut b).is_err() {
            return (u64::MAX, 0);
        }
        (
            u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            u64::from_le_bytes(b[8..].try_into().expect("8 bytes")),
        )
    }

    fn send_wr(&self, size: u64) -> SendWr<'static> {
        SendWr {
            opcode: WrOpcode::Send,
            send_flags: if size <= INLINE {
                SendFlags::INLINE
            } else {
                SendFlags::empty()
            },
            ..SendWr::default()
        }
    }

    /// The byte at `off` of our region, as a peer's write left it.
    fn peek(&self, off: u64) -> u8 {
        // Callers pass offsets below 1 MiB of a 3 MiB region.
        self.mr.load_volatile(off).unwrap_or(0)
    }

    /// Puts `v` in the last byte of the next write's source. With 8 bytes or more the whole
    /// last word is stored, so the copy's 8-byte load forwards from one store.
    fn stamp_src(&self, size: u64, v: u8) {
        let end = SRC + size;
        // [SRC, SRC + size) lies in our local source area (size <= 1 MiB of a 3 MiB region).
        let _ = if size >= 8 {
            self.mr.write(end - 8, &(u64::from(v) << 56).to_le_bytes())
        } else {
            self.mr.write(end - 1, &[v])
        };
    }
}

/// A cheap timestamp for per-iteration latencies, as perftest's `get_cycles`: the TSC on
/// x86_64 (calibrated against the monotonic clock), `Instant` elsewhere.
pub(super) struct Clock {
    #[cfg(target_arch = "x86_64")]
    ns_per_cycle: f64,
}

impl Clock {
    pub(super) fn new() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let t0 = Instant::now();
            let c0 = tsc();
            while t0.elapsed() < Duration::from_millis(20) {
                std::hint::spin_loop();
            }
            let ns = t0.elapsed().as_nanos() as f64;
            let ns_per_cycle = ns / (tsc() - c0).max(1) as f64;
            Self { ns_per_cycle }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Self {}
    }

    /// A raw timestamp (cycles on x86_64); [`Clock::ns`] converts a difference.
    #[inline]
    pub(super) fn raw() -> u64 {
        #[cfg(target_arch = "x86_64")]
        {
            tsc()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            EPOCH.elapsed().as_nanos() as u64
        }
    }

    /// Nanoseconds in a difference of raw timestamps.
    pub(super) fn ns(&self, d: u64) -> u64 {
        #[cfg(target_arch = "x86_64")]
        {
            (d as f64 * self.ns_per_cycle) as u64
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            d
        }
    }
}

#[cfg(target_arch = "x86_64")]
use crate::sys::tsc;

#[cfg(not(target_arch = "x86_64"))]
static EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

/// An unsignaled RDMA_WRITE of `sge` to the start of the peer's region, inline when small.
fn write_wr<'a>(sge: &'a [Sge], rkey: u32, size: u64) -> SendWr<'a> {
    let mut wr = SendWr::write(0, sge, 0, rkey);
    if size <= INLINE {
        wr.send_flags |= SendFlags::INLINE;
    }
    wr
}

/// The RDMA_WRITE ping-pong of `write-lat` (ib_write_lat): each side writes the iteration's
/// stamp into the last byte of the other's region and polls the last byte of its own. The
/// work requests are built once (as perftest does); `first` is the side that starts. Returns
/// the raw round-trip timestamps differences of the starting side.
fn write_pingpong(
    e: &mut End,
    rkey: u32,
    size: u64,
    count: u64,
    first: bool,
) -> anyhow::Result<Vec<u64>> {
    let sge = [e.mr.sge(SRC, size as u32)];
    let wr = write_wr(&sge, rkey, size);
    let signaled = [wr.signaled()];
    let plain = [wr];
    let mut rtt = Vec::with_capacity(if first { count as usize } else { 0 });
    // One timestamp per iteration, as ucx_perftest takes it: a round trip is the time between
    // two consecutive ends of iteration.
    let mut last = Clock::raw();
    for i in 0..count {
        let s = stamp(i);
        if !first {
            e.await_byte(size - 1, s)?;
        }
        e.stamp_src(size, s);
        let sig = (i + 1).is_multiple_of(CQ_MOD);
        e.qp.post_send(if sig { &signaled } else { &plain })?;
        if first {
            e.await_byte(size - 1, s)?;
            let now = Clock::raw();
            rtt.push(now - last);
            last = now;
        }
        if sig {
            e.reap()?;
        }
    }
    Ok(rtt)
}

/// perftest's `run_iter_lat_write`, step for step: wait for the peer's byte (a plain load
/// loop, no PAUSE; the `first` side skips the first wait), a clock read, the byte stored,
/// the WRITE posted signaled, its completion polled. The client's round trips are the
/// differences of consecutive clock reads (`count - 1` of them), as perftest computes them.
fn write_pingpong_perftest(
    e: &mut End,
    rkey: u32,
    size: u64,
    count: u64,
    first: bool,
) -> anyhow::Result<Vec<u64>> {
    let sge = [e.mr.sge(SRC, size as u32)];
    let wr = [write_wr(&sge, rkey, size).signaled()];
    let mut t = vec![0u64; count as usize];
    for i in 0..count {
        if !(first && i == 0) {
            // The peer's answer to our last byte (client), or its next byte (peer).
            let want = stamp(if first { i - 1 } else { i });
            while e.peek(size - 1) != want {}
        }
        t[i as usize] = Clock::raw();
        e.stamp_src(size, stamp(i));
        e.qp.post_send(&wr)?;
        e.poll_one(WcOpcode::RdmaWrite)?;
    }
    if first && count > 0 {
        // The peer's last answer, so the next size starts from a quiet region.
        while e.peek(size - 1) != stamp(count - 1) {}
    }
    Ok(t.windows(2).map(|w| w[1] - w[0]).collect())
}

/// perftest's `run_iter_lat_send`, step for step: poll until a receive completes (no PAUSE;
/// the client, which sends first, skips the first wait), post that receive again, a clock
/// read, the SEND posted signaled, its completion polled. Round trips as in
/// [`write_pingpong_perftest`]; the client takes the last answer after its loop.
fn send_pingpong_perftest(
    e: &mut End,
    size: u64,
    count: u64,
    first: bool,
) -> anyhow::Result<Vec<u64>> {
    let sge = [e.mr.sge(SRC, size as u32)];
    let mut wr = e.send_wr(size).signaled();
    wr.sg_list = &sge;
    let wr = [wr];
    let mut t = vec![0u64; count as usize];
    for i in 0..count {
        if !(first && i == 0) {
            e.poll_one(WcOpcode::Recv)?;
            e.repost()?;
        }
        t[i as usize] = Clock::raw();
        e.qp.post_send(&wr)?;
        e.poll_one(WcOpcode::Send)?;
    }
    if first && count > 0 {
        e.poll_one(WcOpcode::Recv)?;
        e.repost()?;
    }
    Ok(t.windows(2).map(|w| w[1] - w[0]).collect())
}

/// READ or FETCH_AND_ADD latency: the request built once and posted signaled, then its
/// completion taken, one clock read per iteration; the samples are the differences of
/// consecutive reads, the whole iteration, as `ucx_perftest` and perftest take them.
///
/// `Loop::Perftest` is perftest's `run_iter_lat` step for step: polled without PAUSE, the
/// timestamps' memory touched as the loop goes (as perftest's `malloc` leaves it). The fabric's
/// own loop waits as it does elsewhere and touches that memory before the loop (its page faults,
/// one every 512 operations, fell inside the timed iterations). Before session 42 it read the
/// clock before each post and after its completion and counted only that: the read after a
/// locked FETCH_AND_ADD may execute before the operation is done, and the loop's own work fell
/// outside — a FETCH_AND_ADD on one host timed ~40 % short.
fn one_sided(
    e: &mut End,
    test: Test,
    rkey: u32,
    size: u64,
    (count, lp): (u64, Loop),
) -> anyhow::Result<Vec<u64>> {
    let read = test == Test::ReadLat;
    let sge = e.mr.sge(SRC, if read { size as u32 } else { 8 });
    let (opcode, op) = if read {
        (WrOpcode::RdmaRead, WcOpcode::RdmaRead)
    } else {
        (WrOpcode::AtomicFetchAndAdd, WcOpcode::FetchAdd)
    };
    // Posted as the drop-in libibverbs posts perftest's (`Qp::post_one_sided`, the engine's
    // shortest way for one READ or atomic), so `--perftest` beside it shows the ABI layer's
    // own cost.
    let wr = OneSided {
        wr_id: 0,
        opcode,
        send_flags: SendFlags::SIGNALED,
        local: &sge,
        remote_addr: 0,
        rkey,
        compare_add: 1,
        swap: 0,
    };
    let perftest = lp == Loop::Perftest;
    let mut t = vec![if perftest { 0 } else { u64::MAX }; count as usize + 1];
    t[0] = Clock::raw();
    for slot in &mut t[1..] {
        e.qp.post_one_sided(&wr)?;
        if perftest {
            e.poll_one(op)?;
        } else {
            e.wait_send(0)?;
        }
        *slot = Clock::raw();
    }
    Ok(t.windows(2).map(|w| w[1] - w[0]).collect())
}

fn stamp(i: u64) -> u8 {
    (i % 255) as u8 + 1
}

fn warmup(iters: u64) -> u64 {
    (iters / 10).clamp(100, 10_000)
}

/// The client side (node 1): one row per size.
pub(super) fn client(
    fabric: &Fabric,
    test: Test,
    lp: Loop,
    port: u32,
    sizes: &[u64],
    iters: &[u64],
    announce: impl FnOnce(),
) -> anyhow::Result<Vec<Row>> {
    let mut e = open(fabric, 1, lp == Loop::Perftest && test == Test::SendLat)?;
    let peer = cm::connect(&e._ctx, 2, port, &e.qp, &e.offer(), Duration::from_secs(10))
        .context("perf peer did not come up")?;
    announce();
    let mut rows = Vec::new();
    for (&size, &n) in sizes.iter().zip(iters) {
        let warm = warmup(n);
        if test == Test::WriteLat {
            e.mr.fill(0, size, 0)?;
        }
        e.send_ctl(size, warm + n)?;
        let w = e.wait_recv()?;
        if e.ctl(&w).0 != 0 {
            bail!("perf peer did not get ready");
        }
        let row = match test {
            Test::WriteLat | Test::ReadLat | Test::AtomicLat | Test::SendLat => {
                lat(&mut e, &peer, test, lp, size, warm, n)?
            }
            _ => bw(&mut e, &peer, test, size, warm, n)?,
        };
        if !matches!(test, Test::WriteLat | Test::SendLat | Test::SendBw) {
            // One-sided: tell the idle peer this size is over.
            e.send_ctl(1, 1)?;
            e.wait_recv()?;
        }
        rows.push(row);
    }
    e.send_ctl(0, 0)?;
    Ok(rows)
}

fn lat(
    e: &mut End,
    peer: &PeerInfo,
    test: Test,
    lp: Loop,
    size: u64,
    warm: u64,
    n: u64,
) -> anyhow::Result<Row> {
    let mut h = backplane_bench::stats::new_histogram();
    let len = size as u32;
    let clock = Clock::new();
    let mut samples = Vec::with_capacity(n as usize);
    if lp == Loop::Perftest {
        let raw = match test {
            Test::WriteLat => write_pingpong_perftest(e, peer.rkey, size, warm + n, true)?,
            Test::SendLat => send_pingpong_perftest(e, size, warm + n, true)?,
            _ => one_sided(e, test, peer.rkey, size, (warm + n, lp))?,
        };
        for r in raw.iter().skip(warm as usize) {
            h.record(clock.ns(*r).max(1))?;
        }
        return Ok(Row::latency(&h, size, n, test.halved()));
    }
    if test == Test::WriteLat {
        let raw = write_pingpong(e, peer.rkey, size, warm + n, true)?;
        for r in &raw[warm as usize..] {
            h.record(clock.ns(*r).max(1))?;
        }
        return Ok(Row::latency(&h, size, n, true));
    }
    if matches!(test, Test::ReadLat | Test::AtomicLat) {
        let raw = one_sided(e, test, peer.rkey, size, (warm + n, lp))?;
        for r in &raw[warm as usize..] {
            h.record(clock.ns(*r).max(1))?;
        }
        return Ok(Row::latency(&h, size, n, false));
    }
    // SEND latency (the others returned above).
    debug_assert_eq!(test, Test::SendLat);
    for i in 0..warm + n {
        let sge = [e.mr.sge(SRC, len)];
        let mut wr = e.send_wr(size);
        wr.sg_list = &sge;
        let t0 = Clock::raw();
        e.post(&wr)?;
        if i > 0 {
            // The receive the last answer used goes back while this message travels (plenty
            // are posted ahead of it), not between an answer and the next send.
            e.repost()?;
        }
        e.take_recv()?;
        // (Raw cycles, converted after the loop: the conversion's float arithmetic in the loop
        // was half of `perf read-lat`'s own time outside the library.)
        let rtt = Clock::raw() - t0;
        if i >= warm {
            samples.push(rtt); // into the histogram after the loop: off the measured path
        }
    }
    if warm + n > 0 {
        e.repost()?; // the last answer's receive
    }
    for s in samples {
        h.record(clock.ns(s).max(1))?;
    }
    Ok(Row::latency(&h, size, n, test.halved()))
}

fn bw(
    e: &mut End,
    peer: &PeerInfo,
    test: Test,
    size: u64,
    warm: u64,
    n: u64,
) -> anyhow::Result<Row> {
    let len = size as u32;
    let sge = [e.mr.sge(SRC, len)];
    let one = |e: &mut End| -> anyhow::Result<()> {
        let wr = match test {
            Test::WriteBw => write_wr(&sge, peer.rkey, size),
            Test::ReadBw => SendWr::read(0, &sge, 0, peer.rkey),
            _ => {
                let mut wr = e.send_wr(size);
                wr.sg_list = &sge;
                wr
            }
        };
        e.post(&wr)
    };
    for _ in 0..warm {
        one(e)?;
    }
    let chunks = 10u64.min(n);
    let per = n / chunks;
    let t0 = Instant::now();
    let mut peak = 0f64;
    let mut last = t0;
    for i in 0..n {
        one(e)?;
        if (i + 1) % per == 0 {
            let now = Instant::now();
            let mbps = (per * size) as f64 / now.duration_since(last).as_secs_f64() / 1e6;
            // SENDs are queued, not done, while the send queue fills: skip those chunks.
            if test != Test::SendBw || i + 1 > u64::from(TX_DEPTH) + per {
                peak = peak.max(mbps);
            }
            last = now;
        }
    }
    if test == Test::SendBw {
        e.wait_recv()?; // "done": the peer has every message
    } else {
        // A signaled request completes after everything posted before it (in order).
        let fence = [e.mr.sge(SRC, 8)];
        e.post_reaping(&[SendWr::read(u64::MAX - 1, &fence, 0, peer.rkey).signaled()])?;
        e.wait_send(u64::MAX - 1)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let avg = (n * size) as f64 / secs / 1e6;
    Ok(Row {
        bytes: size,
        iterations: n,
        bw_peak_mbps: Some(peak.max(avg)),
        bw_avg_mbps: Some(avg),
        msg_rate_mpps: Some(n as f64 / secs / 1e6),
        ..Row::default()
    })
}

/// The far side (node 2, `perf-peer`): listens, then plays its part size after size.
/// A QP of its own and a small region for it (the connection helper's and the closing
/// message's), without the bandwidth tests' rings: `dma-bw --peer-via`'s two sides.
/// (Fields drop in order: the QP and region before their PD and context.)
struct Small {
    qp: Qp,
    ctl: Mr,
    cq: Cq,
    pd: Pd,
    ctx: Context,
}

fn small(fabric: &Fabric, slot: u32) -> anyhow::Result<Small> {
    let ctx = Context::open(&fabric.node(slot)?)?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(8, None)?;
    let qp = pd.create_qp(&QpInitAttr::new(QpType::Rc, &cq, &cq))?;
    let ctl = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    cm::init_qp(&qp, &ConnParam::default())?;
    Ok(Small {
        qp,
        ctl,
        cq,
        pd,
        ctx,
    })
}

/// The far side of `dma-bw --peer-via`: a region of [`MAX_SIZE`] bytes with every right,
/// offered through the connection helper; then it waits asleep (so `ucx_perftest` between
/// the hosts runs beside an idle peer) for the client's closing message, or its going.
fn dma_target(fabric: &Fabric, node: u32, port: u32) -> anyhow::Result<()> {
    let s = small(fabric, node)?;
    let region = s.pd.alloc_mr(MAX_SIZE as usize, ALL)?;
    s.qp.post_recv(&[RecvWr {
        wr_id: 0,
        sg_list: &[s.ctl.sge(0, 64)],
    }])?;
    let offer = ConnParam {
        rkey: region.rkey(),
        len: MAX_SIZE,
        ..ConnParam::default()
    };
    let mut l = cm::Listener::bind(&s.ctx, port)?;
    l.accept(&s.qp, &offer, Some(Duration::from_secs(30)))?;
    let mut wc = [Wc::default(); 2];
    while s.cq.poll(&mut wc) == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// The client's end of `dma-bw --peer-via`: connected to the perf peer in node 2 (on another
/// host), which offers its region (`rkey`, `len` bytes); [`FarRegion::finish`] lets it go.
pub(super) struct FarRegion {
    s: Small,
    pub(super) rkey: u32,
    pub(super) len: u64,
}

impl FarRegion {
    pub(super) fn connect(fabric: &Fabric, port: u32) -> anyhow::Result<Self> {
        let s = small(fabric, 1)?;
        let mine = ConnParam::default();
        let peer = cm::connect(&s.ctx, 2, port, &s.qp, &mine, Duration::from_secs(10))
            .context("perf peer did not come up")?;
        Ok(Self {
            rkey: peer.rkey,
            len: peer.len,
            s,
        })
    }

    /// Tells the peer the run is over (a SEND), once it has landed.
    pub(super) fn finish(self) -> anyhow::Result<()> {
        let s = &self.s;
        s.qp.post_send(&[SendWr::send_inline(1, b"done").signaled()])?;
        let mut wc = [Wc::default(); 1];
        let mut patience = Patience::new();
        while s.cq.poll(&mut wc) == 0 {
            if patience.out() {
                bail!("the perf peer never took the closing message");
            }
        }
        Ok(())
    }
}

pub(super) fn peer(
    fabric: &Fabric,
    test: Test,
    lp: Loop,
    node: u32,
    port: u32,
) -> anyhow::Result<()> {
    if test == Test::DmaBw {
        return dma_target(fabric, node, port);
    }
    let mut e = open(fabric, node, lp == Loop::Perftest && test == Test::SendLat)?;
    let mut l = cm::Listener::bind(&e._ctx, port)?;
    let client = l.accept(&e.qp, &e.offer(), Some(Duration::from_secs(30)))?;
    loop {
        let w = e.wait_recv()?;
        let (size, count) = e.ctl(&w);
        if size == 0 || size > MAX_SIZE {
            return Ok(());
        }
        if test == Test::WriteLat {
            e.mr.fill(0, size, 0)?;
        }
        e.send_ctl(0, 0)?; // ready
        let len = size as u32;
        match test {
            Test::WriteLat if lp == Loop::Perftest => {
                write_pingpong_perftest(&mut e, client.rkey, size, count, false)?;
            }
            Test::SendLat if lp == Loop::Perftest => {
                send_pingpong_perftest(&mut e, size, count, false)?;
            }
            Test::WriteLat => {
                write_pingpong(&mut e, client.rkey, size, count, false)?;
            }
            Test::SendLat => {
                let sge = [e.mr.sge(SRC, len)];
                for _ in 0..count {
                    e.take_recv()?;
                    let mut wr = e.send_wr(size);
                    wr.sg_list = &sge;
                    e.post(&wr)?;
                    e.repost()?;
                }
            }
            Test::SendBw => {
                e.sink(count)?;
                e.send_ctl(0, 1)?; // done
            }
            _ => {
                // One-sided: nothing to do until the client's closing message.
                e.wait_recv()?;
                e.send_ctl(0, 2)?;
            }
        }
    }
}
