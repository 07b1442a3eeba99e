//! Regions on another host of a fabric across hosts: a QP connected to a QP of another host
//! reaches its peer's regions through the one-sided area of the peer's shadow here
//! (`wire::verbs::RDMA_*`); a process's DMA engines reach one through the area of a *DMA
//! pair*, a shadow of no QP made for that region (`wire::verbs::DMA_PAIR_QPN`). A put becomes WRITE requests in the request ring (the bridge
//! ships them, the other host's bridge writes them into the region and answers); a get or an
//! atomic waits for its answer in the response ring. Puts return once queued: the engine
//! completes an RDMA WRITE when [`RemoteRegion::settled`] says it landed.
//!
//! Everything read from the area was written by this host's bridge (the supervisor), still
//! checked: a record the ring does not validate, or an answer for another request, fails the
//! access instead of being trusted.
#![forbid(unsafe_code)]

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::shm::{Bell, ShmReceiver, ShmRing, ShmSender};
use super::{CopyKind, Fetch, FetchOp, RecvChannel, RemoteRegion, SendChannel};
use crate::mem::{MemError, Region, Span, Word32, Word64};
use crate::ring::RingError;
use crate::sync::Ordering;
use crate::wire::verbs::{
    EV_ARMED_OFF, EV_BELL_OFF, RDMA_DONE_OFF, RDMA_FAILED_OFF, RDMA_GONE_OFF, RDMA_OP_CMP_SWAP,
    RDMA_OP_FETCH_ADD, RDMA_OP_READ, RDMA_OP_WRITE, RDMA_PIECE, RDMA_REQ_HEAD, RDMA_REQ_HEAD_OFF,
    RDMA_REQ_TAIL_OFF, RDMA_RESP_HEAD, RDMA_RESP_HEAD_OFF, RDMA_RESP_TAIL_OFF, RDMA_RING_OFF,
};

/// A request header's byte 1: the WRITE's data is not in the ring record but in a
/// [`Deferred`] (its pair is carried by this process: [`carried_here`]).
pub(crate) const REQ_DATA_ELSEWHERE: u8 = 1;
/// WRITE pieces from this size on go from the program's memory straight into the message
/// when this process carries the pair: no copy into the request ring, none into the message
/// (`write-bw` 64 KiB between two hosts with both copies skipped, a debug patch: 4 832 →
/// 6 531 MB/s, 5 alternating pairs, under reno). Smaller ones are copied: cheaper than the
/// hand-over for a few cache lines, and a latency test's 8 bytes stay as they were.
pub(crate) const ELSEWHERE_MIN: usize = 16 * 1024;

/// Data a pair carried by this process sends from the program's region in place, `len`
/// bytes at `off` of `span`: a WRITE piece's (`id` its request id) or a SEND's (`id` the QP
/// ring index where its record starts, `at` where its payload's room does).
#[derive(Debug)]
pub(crate) struct Deferred {
    pub(crate) id: u64,
    pub(crate) at: u64,
    pub(crate) span: Span,
    pub(crate) off: u64,
    pub(crate) len: usize,
}

/// Data of one pair waiting for its mirror, in order.
pub(crate) type DeferQueue = Arc<Mutex<std::collections::VecDeque<Deferred>>>;

/// What a pair carried by this process sends in place: its WRITE pieces (request ring order)
/// and its SEND payloads (QP ring order).
#[derive(Debug, Default)]
pub(crate) struct Carried {
    pub(crate) writes: DeferQueue,
    pub(crate) sends: DeferQueue,
}

/// Messages this process sent from the program's memory in place.
static SENT_IN_PLACE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many RDMA WRITE pieces (up to 64 KiB each) and SENDs of this process went from the
/// program's memory to another host in place, without a copy: RC pairs the process carries
/// itself, WRITEs of 16 KiB or more, SENDs of one fragment of 16 to 64 KiB from one region.
pub fn sent_in_place() -> u64 {
    SENT_IN_PLACE.load(Ordering::Relaxed)
}

/// A WRITE piece or a SEND went in place.
pub(crate) fn count_sent_in_place() {
    SENT_IN_PLACE.fetch_add(1, Ordering::Relaxed);
}

/// The pairs this process carries itself (`verbs::direct`), by the peer QP (node, QPN): only
/// their requests may leave their data out of the ring (a supervisor's bridge, which carries
/// the others, reads only the ring).
static CARRIED: Mutex<CarriedPairs> = Mutex::new(Vec::new());
/// How many pairs [`CARRIED`] holds: a program on one host never takes its lock.
static CARRIED_COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Each carried pair's peer QP (node, QPN) and queues.
type CarriedPairs = Vec<((u32, u32), Arc<Carried>)>;

fn carried() -> std::sync::MutexGuard<'static, CarriedPairs> {
    CARRIED.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process now carries the pair with peer QP `peer` (node, QPN): its WRITE data and
/// SEND payloads may be left out of the rings, in the queues returned.
pub(crate) fn carried_here(peer: (u32, u32)) -> Arc<Carried> {
    let q = Arc::<Carried>::default();
    let mut c = carried();
    c.retain(|(k, _)| *k != peer);
    c.push((peer, q.clone()));
    CARRIED_COUNT.store(c.len(), Ordering::Relaxed);
    q
}

/// The pair with `peer` ended here (its queues `q`).
pub(crate) fn carried_no_more(peer: (u32, u32), q: &Arc<Carried>) {
    let mut c = carried();
    c.retain(|(k, x)| !(*k == peer && Arc::ptr_eq(x, q)));
    CARRIED_COUNT.store(c.len(), Ordering::Relaxed);
}

/// The queues of the pair with `peer`, if this process carries it.
pub(crate) fn carrier_of(peer: (u32, u32)) -> Option<Arc<Carried>> {
    if CARRIED_COUNT.load(Ordering::Relaxed) == 0 {
        return None;
    }
    carried()
        .iter()
        .find(|(k, _)| *k == peer)
        .map(|(_, q)| q.clone())
}

/// One request's header fields.
struct Req {
    op: u8,
    rkey: u32,
    off: u64,
    len: usize,
    operands: (u64, u64),
}

/// How long an access waits for room or an answer before it fails (the pair is cut sooner
/// when the other host goes: its supervisors see it within a second).
const PATIENCE: Duration = Duration::from_secs(10);

/// The request and response rings of one pair, shared by the regions granted through it.
#[derive(Debug)]
pub struct Pair {
    req: ShmSender,
    resp: ShmReceiver,
    bell: Bell,
    done: Word64,
    failed: Word64,
    gone: Word32,
    next_id: u64,
    ring_len: u64,
    /// Requests of fetches whose answers were not taken yet, in order (see
    /// [`RemoteRegion::fetch`]), and what their answers take of the response ring.
    pending: std::collections::VecDeque<Pending>,
    pending_cost: u64,
    /// The peer QP (node, QPN) whose shadow this area is (`None`: a DMA pair).
    peer: Option<(u32, u32)>,
}

/// A request of a fetch whose answer is not taken yet.
#[derive(Debug, Clone, Copy)]
struct Pending {
    id: u64,
    /// What its answer takes of the response ring at most.
    cost: u64,
    /// Nobody waits for it (its work request was flushed): its answer is dropped.
    abandoned: bool,
}

/// What an answer of `n` data bytes takes of the response ring at most (its header, and a
/// record's header and alignment).
fn answer_cost(n: usize) -> u64 {
    (n + RDMA_RESP_HEAD + 64) as u64
}

fn oob(off: u64, len: u64) -> MemError {
    MemError::OutOfBounds { off, len, size: 0 }
}

impl Pair {
    /// The area at `rdma_off` of `win` (the shadow window of the peer's node), rings of
    /// `ring_len` bytes, the shadow's event block at `event_off`.
    pub fn new(
        win: &Arc<Region>,
        rdma_off: u64,
        ring_len: u32,
        event_off: u64,
    ) -> Result<Self, MemError> {
        let at = |o: usize| rdma_off + o as u64;
        let len = u64::from(ring_len);
        win.check(rdma_off, RDMA_RING_OFF + 2 * len, 4096)?;
        let req = ShmRing::new(
            Word64::at(win, at(RDMA_REQ_TAIL_OFF))?,
            Word64::at(win, at(RDMA_REQ_HEAD_OFF))?,
            Span::new(win, rdma_off + RDMA_RING_OFF, len)?,
        );
        let resp = ShmRing::new(
            Word64::at(win, at(RDMA_RESP_TAIL_OFF))?,
            Word64::at(win, at(RDMA_RESP_HEAD_OFF))?,
            Span::new(win, rdma_off + RDMA_RING_OFF + len, len)?,
        );
        let done = Word64::at(win, at(RDMA_DONE_OFF))?;
        Ok(Self {
            req: ShmSender::new(req),
            resp: ShmReceiver::new(resp),
            bell: Bell::new(
                Word32::at(win, event_off + EV_ARMED_OFF as u64)?,
                Word32::at(win, event_off + EV_BELL_OFF as u64)?,
            ),
            // Requests are numbered after what the bridge already finished (a pair made
            // again for a second grant shares the area).
            // SYNC POINT rdma-done (acquire).
            next_id: done.load(Ordering::Acquire),
            done,
            failed: Word64::at(win, at(RDMA_FAILED_OFF))?,
            gone: Word32::at(win, at(RDMA_GONE_OFF))?,
            ring_len: len,
            pending: std::collections::VecDeque::new(),
            pending_cost: 0,
            peer: None,
        })
    }

    /// The area is the shadow of peer QP `peer` (node, QPN).
    pub fn set_peer(&mut self, peer: (u32, u32)) {
        self.peer = Some(peer);
    }

    /// What the answers in flight may take of the response ring (the rest stays free: an
    /// answer that finds no room fails its request).
    fn window(&self) -> u64 {
        (self.ring_len / 2).max(RDMA_PIECE as u64 + 64)
    }

    /// Forgets pending request `id` (answered, or dropped).
    fn settle(&mut self, id: u64) {
        if let Some(i) = self.pending.iter().position(|p| p.id == id) {
            let p = self.pending.remove(i).expect("found");
            self.pending_cost -= p.cost;
        }
    }

    fn gone(&self) -> bool {
        self.gone.load(Ordering::Acquire) != 0
    }

    /// Waits (spinning, then yielding) until `ready` holds; false after [`PATIENCE`] or once
    /// the pair is cut.
    fn wait(&mut self, mut ready: impl FnMut(&mut Self) -> bool) -> bool {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if ready(self) {
                return true;
            }
            if self.gone() || start.elapsed() > PATIENCE {
                return false;
            }
            // A pair this process carries itself (`verbs::direct`) moves only when a thread
            // of it pumps: this one ships the request and takes the answer itself, instead
            // of waking the pair's thread for each (an atomic's round trip 31 -> 10.5 us).
            crate::verbs::direct::progress_all(true, &mut |_, _, _| 0);
            spins += 1;
            if spins < 256 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Queues one request (header, byte 1 `flags`, + `data` bytes written by `fill`, which
    /// also gets its id); its id.
    fn request(
        &mut self,
        q: Req,
        (data, flags): (usize, u8),
        fill: impl FnOnce(&Span, u64, u64) -> Result<(), MemError>,
    ) -> Result<u64, MemError> {
        let Req {
            op,
            rkey,
            off,
            len,
            operands,
        } = q;
        let mut res = None;
        let mut rang = false;
        let room = self.wait(|p| match p.req.reserve(RDMA_REQ_HEAD + data) {
            Ok(r) => {
                res = Some(r);
                true
            }
            Err(RingError::Full) => {
                // The bridge empties the ring as it ships: make sure it is awake.
                if !rang {
                    p.bell.ring();
                    rang = true;
                }
                false
            }
            Err(_) => false,
        });
        let r = match res {
            Some(r) if room => r,
            _ => return Err(oob(off, len as u64)),
        };
        self.next_id += 1;
        let id = self.next_id;
        let mut h = [0u8; RDMA_REQ_HEAD];
        h[0] = op;
        h[1] = flags;
        h[8..16].copy_from_slice(&id.to_le_bytes());
        h[16..20].copy_from_slice(&rkey.to_le_bytes());
        h[20..24].copy_from_slice(&(len as u32).to_le_bytes());
        h[24..32].copy_from_slice(&off.to_le_bytes());
        h[32..40].copy_from_slice(&operands.0.to_le_bytes());
        h[40..48].copy_from_slice(&operands.1.to_le_bytes());
        let d = self.req.data().clone();
        d.write(r.pos, &h)?;
        // (Before the commit: a mirror that sees the record finds what goes with it.)
        fill(&d, r.pos + RDMA_REQ_HEAD as u64, id)?;
        self.req.commit(r);
        Ok(id)
    }

    /// The answer to request `id`: its value, with its data handed to `take`.
    fn answer(&mut self, id: u64, take: impl FnOnce(&Span, u64, usize)) -> Result<u64, MemError> {
        self.bell.wake();
        let mut take = Some(take);
        let mut out = None;
        let got = self.wait(|p| {
            out = p.take(id, &mut |d, pos, n| {
                if let Some(t) = take.take() {
                    t(d, pos, n);
                }
            });
            out.is_some()
        });
        match out {
            Some(r) if got => r,
            _ => Err(oob(0, 0)),
        }
    }

    /// The answer to request `id` if it came (see [`Pair::answer`]); answers of abandoned
    /// requests before it are dropped.
    fn take(
        &mut self,
        id: u64,
        take: &mut dyn FnMut(&Span, u64, usize),
    ) -> Option<Result<u64, MemError>> {
        loop {
            let rec = match self.resp.peek() {
                Ok(Some(r)) if r.len >= RDMA_RESP_HEAD => r,
                Ok(None) => return None,
                _ => return Some(Err(oob(0, 0))),
            };
            let mut h = [0u8; RDMA_RESP_HEAD];
            if let Err(e) = self.resp.data().read(rec.pos, &mut h) {
                return Some(Err(e));
            }
            let rid = u64::from_le_bytes(h[0..8].try_into().expect("8 bytes"));
            let status = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
            let value = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
            let data = self.resp.data().clone();
            let n = rec.len - RDMA_RESP_HEAD;
            if rid != id && self.pending.iter().any(|p| p.id == rid && p.abandoned) {
                self.resp.release(rec);
                self.settle(rid);
                continue;
            }
            if rid == id && status == 0 {
                take(&data, rec.pos + RDMA_RESP_HEAD as u64, n);
            }
            self.resp.release(rec);
            self.settle(rid);
            if rid != id || status != 0 {
                return Some(Err(oob(0, n as u64)));
            }
            return Some(Ok(value));
        }
    }

    /// Whether the requests up to `id` finished: `Some(false)` if one of them failed or no
    /// answer will come.
    fn settled(&self, id: u64) -> Option<bool> {
        // SYNC POINT rdma-done (acquire): `failed` is written before `done` passes it.
        let done = self.done.load(Ordering::Acquire);
        let failed = self.failed.load(Ordering::Relaxed);
        if failed != 0 && failed <= id.min(done) {
            return Some(false);
        }
        if done >= id {
            return Some(true);
        }
        if self.gone() {
            return Some(false);
        }
        None
    }
}

/// A region of a QP on another host, reached through the pair's rings.
#[derive(Debug)]
pub struct AcrossRegion {
    pair: Arc<Mutex<Pair>>,
    rkey: u32,
    len: u64,
    access: u32,
    writable: bool,
    iova: u64,
    ident: (u64, u64),
    /// The last WRITE request queued (the ticket).
    issued: std::sync::atomic::AtomicU64,
    broken: AtomicBool,
}

impl AcrossRegion {
    /// Region `rkey` (`len` bytes, `access`, the owner's address `iova`) of the peer on node
    /// `peer_slot`, through `pair`.
    pub fn new(
        pair: Arc<Mutex<Pair>>,
        rkey: u32,
        grant: (u64, u32, bool, u64),
        peer_slot: u32,
    ) -> Self {
        let (len, access, writable, iova) = grant;
        Self {
            pair,
            rkey,
            len,
            access,
            writable,
            iova,
            ident: (u64::MAX - u64::from(peer_slot), u64::from(rkey)),
            issued: std::sync::atomic::AtomicU64::new(0),
            broken: AtomicBool::new(false),
        }
    }

    fn pair(&self) -> std::sync::MutexGuard<'_, Pair> {
        // A thread that panicked inside leaves the rings as they were: still usable.
        self.pair.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check(&self, off: u64, n: u64) -> Result<(), MemError> {
        if off.checked_add(n).is_none_or(|e| e > self.len) || self.broken.load(Ordering::Relaxed) {
            return Err(oob(off, n));
        }
        Ok(())
    }

    /// Queues WRITE requests for `n` bytes at `off`, each piece's data written by `fill`.
    fn write(
        &self,
        off: u64,
        n: usize,
        flags: u8,
        mut fill: impl FnMut(&Span, u64, usize, usize, u64) -> Result<(), MemError>,
    ) -> Result<(), MemError> {
        self.check(off, n as u64)?;
        let mut p = self.pair();
        let mut at = 0;
        let mut last = None;
        while at < n || (n == 0 && last.is_none()) {
            let piece = (n - at).min(RDMA_PIECE);
            let q = Req {
                op: RDMA_OP_WRITE,
                rkey: self.rkey,
                off: off + at as u64,
                len: piece,
                operands: (0, 0),
            };
            let id = p.request(q, (piece, flags), |d, pos, id| fill(d, pos, at, piece, id));
            match id {
                Ok(id) => last = Some(id),
                Err(e) => {
                    self.broken.store(true, Ordering::Relaxed);
                    return Err(e);
                }
            }
            at += piece;
        }
        p.bell.wake();
        if let Some(id) = last {
            // (Engines of one process may put at once: the ticket never goes back.)
            self.issued.fetch_max(id, Ordering::Relaxed);
        }
        Ok(())
    }

    /// As [`AcrossRegion::write`] from `src` for a pair this process carries: each piece's
    /// record holds its header (its data's room left unwritten), and its data waits in `q`
    /// for the mirror, which sends it from `src` in place (the program leaves a WRITE's
    /// source alone until it completes, which is after the other side answered).
    fn write_elsewhere(
        &self,
        off: u64,
        (src, src_off): (&Span, u64),
        n: usize,
        q: &DeferQueue,
    ) -> Result<(), MemError> {
        src.check(src_off, n as u64)?;
        // The record keeps the room for the data it does not hold: the ring bounds what is
        // in flight as before (without that bound, 128 WRITEs of 64 KiB handed to UCX at
        // once made `write-bw` ~10 % slower under bbr, which paces the connection).
        self.write(off, n, REQ_DATA_ELSEWHERE, |_, _, at, piece, id| {
            let d = Deferred {
                id,
                at: 0,
                span: src.clone(),
                off: src_off + at as u64,
                len: piece,
            };
            q.lock().unwrap_or_else(|e| e.into_inner()).push_back(d);
            Ok(())
        })
    }

    /// [`RemoteRegion::fetch`].
    fn start_fetch(&self, op: FetchOp, off: u64, n: usize) -> Result<Fetch, MemError> {
        let (code, operands, n) = match op {
            FetchOp::Read => (RDMA_OP_READ, (0, 0), n),
            FetchOp::FetchAdd(a) => (RDMA_OP_FETCH_ADD, (a, 0), 8),
            FetchOp::CmpSwap(c, w) => (RDMA_OP_CMP_SWAP, (c, w), 8),
        };
        if n == 0 {
            return Ok(Fetch::Whole);
        }
        self.check(off, n as u64)?;
        let mut p = self.pair();
        // Answers of abandoned requests at the ring's front go first: they hold room.
        while let Some(a) = p.pending.front().copied().filter(|a| a.abandoned) {
            if p.take(a.id, &mut |_, _, _| {}).is_none() {
                break;
            }
        }
        let pieces = n.div_ceil(RDMA_PIECE);
        let cost: u64 = (0..pieces)
            .map(|k| answer_cost((n - k * RDMA_PIECE).min(RDMA_PIECE)))
            .sum();
        let window = p.window();
        if cost > window {
            // More than the ring takes at once: a READ asked for piece by piece as answers
            // are taken (`get`), once nothing else is in flight.
            return Ok(if p.pending.is_empty() {
                Fetch::Whole
            } else {
                Fetch::Busy
            });
        }
        if p.pending_cost + cost > window {
            return Ok(Fetch::Busy);
        }
        let mut first = None;
        let mut last = 0;
        for k in 0..pieces {
            let at = k * RDMA_PIECE;
            let piece = (n - at).min(RDMA_PIECE);
            let q = Req {
                op: code,
                rkey: self.rkey,
                off: off + at as u64,
                len: piece,
                operands,
            };
            let id = p.request(q, (0, 0), |_, _, _| Ok(())).inspect_err(|_| {
                self.broken.store(true, Ordering::Relaxed);
            })?;
            let cost = answer_cost(piece);
            p.pending.push_back(Pending {
                id,
                cost,
                abandoned: false,
            });
            p.pending_cost += cost;
            first.get_or_insert(id);
            last = id;
        }
        p.bell.wake();
        Ok(Fetch::Started {
            first: first.expect("one piece at least"),
            last,
        })
    }

    fn atomic(&self, op: u8, off: u64, a: u64, b: u64) -> Result<u64, MemError> {
        self.check(off, 8)?;
        let mut p = self.pair();
        let q = Req {
            op,
            rkey: self.rkey,
            off,
            len: 8,
            operands: (a, b),
        };
        let id = p.request(q, (0, 0), |_, _, _| Ok(()))?;
        p.answer(id, |_, _, _| {}).inspect_err(|_| {
            self.broken.store(true, Ordering::Relaxed);
        })
    }
}

impl RemoteRegion for AcrossRegion {
    fn len(&self) -> u64 {
        self.len
    }
    fn access_bits(&self) -> u32 {
        self.access
    }
    fn iova(&self) -> u64 {
        self.iova
    }
    fn writable(&self) -> bool {
        self.writable
    }
    fn cut(&self) -> bool {
        self.pair().gone()
    }
    fn owner_checks_qp_access(&self) -> bool {
        // `Mirror::execute` on the owner's side checks its QP's access word.
        true
    }
    fn valid(&self) -> bool {
        !self.broken.load(Ordering::Relaxed) && !self.pair().gone()
    }
    fn ident(&self) -> (u64, u64) {
        self.ident
    }
    fn put(
        &self,
        off: u64,
        src: &Span,
        src_off: u64,
        n: usize,
        _how: CopyKind,
    ) -> Result<(), MemError> {
        if n >= ELSEWHERE_MIN {
            let peer = self.pair().peer;
            if let Some(q) = peer.and_then(carrier_of) {
                return self.write_elsewhere(off, (src, src_off), n, &q.writes);
            }
        }
        // Pieces land in order, each with its last 8 bytes last (the other bridge's ordered
        // copy): the whole write's last bytes land last.
        self.write(off, n, 0, |d, pos, at, piece, _| {
            src.copy_to(src_off + at as u64, d, pos, piece)
        })
    }
    fn put_bytes(&self, off: u64, src: &[u8], _how: CopyKind) -> Result<(), MemError> {
        self.write(off, src.len(), 0, |d, pos, at, piece, _| {
            d.write(pos, &src[at..at + piece])
        })
    }
    fn ticket(&self) -> Option<u64> {
        Some(self.issued.load(Ordering::Relaxed))
    }
    fn settled(&self, ticket: u64) -> Option<bool> {
        self.pair().settled(ticket)
    }
    fn watch(&self, ticket: u64, out: &mut Vec<super::Watch>) {
        let p = self.pair();
        // SYNC POINT rdma-done (acquire, watched): fires at once if it already passed.
        let seen = p.done.load(Ordering::Acquire).min(ticket.saturating_sub(1));
        out.push(super::Watch::Moved {
            word: p.done.clone(),
            seen,
        });
        out.push(super::Watch::Flag(p.gone.clone()));
    }
    fn fetch(&self, op: FetchOp, off: u64, n: usize) -> Result<Fetch, MemError> {
        self.start_fetch(op, off, n)
    }
    fn fetched(
        &self,
        id: u64,
        take: &mut dyn FnMut(&Span, u64, usize),
    ) -> Option<Result<u64, MemError>> {
        let r = self.pair().take(id, take);
        if matches!(r, Some(Err(_))) {
            self.broken.store(true, Ordering::Relaxed);
        }
        r
    }
    fn abandon(&self, first: u64, last: u64) {
        for p in self.pair().pending.iter_mut() {
            if (first..=last).contains(&p.id) {
                p.abandoned = true;
            }
        }
    }
    fn watch_answers(&self, out: &mut Vec<super::Watch>) {
        let p = self.pair();
        let Some(first) = p.pending.iter().find(|a| !a.abandoned).map(|a| a.id) else {
            return;
        };
        // SYNC POINT rdma-done (acquire, watched): fires at once if that answer came.
        let seen = p.done.load(Ordering::Acquire).min(first - 1);
        out.push(super::Watch::Moved {
            word: p.done.clone(),
            seen,
        });
        out.push(super::Watch::Flag(p.gone.clone()));
    }
    fn get(
        &self,
        off: u64,
        dst: &Span,
        dst_off: u64,
        n: usize,
        _how: CopyKind,
    ) -> Result<(), MemError> {
        self.check(off, n as u64)?;
        if n == 0 {
            return Ok(());
        }
        let mut p = self.pair();
        // Pieces are asked for ahead of the answers, as many as half the response ring holds.
        let window = p.window() as usize;
        let mut asked = 0usize;
        let mut answered = 0usize;
        let mut ids = std::collections::VecDeque::new();
        let fail = |e| {
            self.broken.store(true, Ordering::Relaxed);
            e
        };
        while answered < n {
            while asked < n && asked - answered < window {
                let piece = (n - asked).min(RDMA_PIECE);
                let q = Req {
                    op: RDMA_OP_READ,
                    rkey: self.rkey,
                    off: off + asked as u64,
                    len: piece,
                    operands: (0, 0),
                };
                let id = p.request(q, (0, 0), |_, _, _| Ok(())).map_err(fail)?;
                ids.push_back((id, asked, piece));
                asked += piece;
            }
            let Some((id, at, piece)) = ids.pop_front() else {
                break;
            };
            let mut copied = Ok(());
            p.answer(id, |data, pos, len| {
                copied = if len == piece {
                    data.copy_to(pos, dst, dst_off + at as u64, piece)
                } else {
                    Err(oob(pos, len as u64))
                };
            })
            .map_err(fail)?;
            copied.map_err(fail)?;
            answered += piece;
        }
        Ok(())
    }
    fn fetch_add(&self, off: u64, add: u64) -> Result<u64, MemError> {
        self.atomic(RDMA_OP_FETCH_ADD, off, add, 0)
    }
    fn compare_swap(&self, off: u64, compare: u64, swap: u64) -> Result<u64, MemError> {
        self.atomic(RDMA_OP_CMP_SWAP, off, compare, swap)
    }
}
