//! The engine behind a device context: memory region tables, completion queues and queue
//! pairs, and the code that executes work requests and turns inbound messages into
//! completions. Single-threaded by design (one `RefCell` per context, no lock on the data
//! path); everything read from shared memory is validated.
//!
//! How each operation moves data:
//! - RDMA_WRITE / RDMA_READ / atomics execute at post time, in the initiator's process, on its
//!   mapping of the peer's region (granted by the supervisor): one copy, the one-sided model.
//!   A WRITE stores its last 8 bytes after the rest, so a peer polling the last byte sees the
//!   whole payload (what perftest-style code relies on with real HCAs).
//! - SEND / SEND_WITH_IMM / the notification of RDMA_WRITE_WITH_IMM are records in the QP
//!   ring in the responder's window; the responder copies them into its posted receive when it
//!   polls (its receive buffers need only LOCAL_WRITE, as on hardware). Messages above 64 KiB
//!   travel as several fragments.
//! - RC reliability: the responder's consumer index, written back into the requester's QP
//!   block, is the acknowledgement; a SEND completes when it is acknowledged. Credits (the
//!   responder's posted-receive count, written into the requester's block and piggybacked on
//!   every message) tell an RC requester whether a receive is waiting; with none it waits
//!   `min_rnr_timer` per retry, `rnr_retry` times, as after an RNR NAK.
#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::channel::{ChannelShared, Watch};
use super::fsm;
use super::types::*;
use crate::dgram::{Addr, DgramError, Endpoint, Wait};
use crate::fabric::ctl::{Request, Response};
use crate::fabric::ctl_verbs::{VerbsRequest, VerbsResponse};
use crate::fabric::{FabricError, Node};
use crate::mem::{MemError, Region, Span, Word32, Word64};
use crate::ring::{Consumer, Producer, RingError, RingMemory};
use crate::sync::{fence, AtomicU64, Ordering};
use crate::transport::{CopyKind, GrantRequest, RemoteRegion, Transport};
use crate::wire::verbs::*;

/// Payload bytes per message fragment (one ring record).
pub(crate) const FRAG: usize = 64 * 1024;
const HDR: usize = 32;
/// Polls without inbound traffic before a QP reads the words its peer writes into its block.
const IDLE_LOOK: u32 = 512;
/// Remote regions a QP keeps mapped.
const REMOTE_CACHE: usize = 64;

// ---------------------------------------------------------------------------------------------
// Shared words.
// ---------------------------------------------------------------------------------------------

/// Ring memory of one direction of a QP pair: data and producer index in the receiver's block,
/// consumer index in the sender's block.
#[derive(Debug)]
struct QRing {
    tail: Word64,
    head: Word64,
    data: Span,
}

impl RingMemory for QRing {
    fn data_len(&self) -> u64 {
        self.data.len()
    }
    fn load_tail(&self) -> u64 {
        self.tail.load(Ordering::Acquire)
    }
    fn store_tail(&self, v: u64) {
        self.tail.store(v, Ordering::Release)
    }
    fn load_head(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }
    fn store_head(&self, v: u64) {
        self.head.store(v, Ordering::Release)
    }
    fn write(&self, pos: u64, src: &[u8]) {
        // Out of range is unreachable: the ring protocol validated the range.
        let _ = self.data.write(pos, src);
    }
    fn read(&self, pos: u64, dst: &mut [u8]) {
        if self.data.read(pos, dst).is_err() {
            dst.fill(0);
        }
    }
    fn prefetch(&self, pos: u64) {
        self.data.prefetch(pos);
    }
}

// ---------------------------------------------------------------------------------------------
// Memory regions.
// ---------------------------------------------------------------------------------------------

/// Keys are random 32-bit numbers already: FxHash's one multiply is all a lookup needs
/// (SipHash would cost more than the rest of a post's key check).
type KeyMap<T> = rustc_hash::FxHashMap<u32, T>;

/// This process's regions by key, with the last key looked up remembered (most work requests
/// of a QP use the same region).
#[derive(Default)]
pub(crate) struct MrTable {
    slab: Vec<Option<LocalMr>>,
    index: KeyMap<usize>,
    last: std::cell::Cell<(u32, usize)>,
}

impl MrTable {
    pub(crate) fn insert(&mut self, key: u32, mr: LocalMr) {
        let i = match self.slab.iter().position(|m| m.is_none()) {
            Some(i) => {
                self.slab[i] = Some(mr);
                i
            }
            None => {
                self.slab.push(Some(mr));
                self.slab.len() - 1
            }
        };
        self.index.insert(key, i);
    }

    pub(crate) fn remove(&mut self, key: u32) {
        if let Some(i) = self.index.remove(&key) {
            self.slab[i] = None;
        }
        self.last.set((0, 0));
    }

    /// The region with `key`; the last key looked up is answered without hashing (the hot
    /// path posts from the same region again and again).
    #[inline(always)]
    pub(crate) fn get(&self, key: u32) -> Option<&LocalMr> {
        let (k, i) = self.last.get();
        if k == key && k != 0 {
            if let Some(Some(m)) = self.slab.get(i) {
                return Some(m);
            }
        }
        self.get_slow(key)
    }

    #[cold]
    #[inline(never)]
    fn get_slow(&self, key: u32) -> Option<&LocalMr> {
        let i = *self.index.get(&key)?;
        self.last.set((key, i));
        self.slab[i].as_ref()
    }
}

/// A region registered by this process.
pub(crate) struct LocalMr {
    pub(crate) pd: u32,
    pub(crate) access: AccessFlags,
    /// The data bytes (the region past its header).
    pub(crate) data: Span,
}

/// A peer's region, granted through the transport.
struct RemoteMr {
    key: u32,
    access: AccessFlags,
    mem: Arc<dyn RemoteRegion>,
}

impl RemoteMr {
    #[inline(always)]
    fn valid(&self) -> bool {
        self.mem.valid()
    }
}

/// Where a copy lands: a span of this process (a ring record, a local region) or a peer's
/// region through the transport.
trait Sink {
    fn put(&self, off: u64, b: Bytes<'_>, how: CopyKind) -> Result<(), MemError>;
}

impl Sink for Span {
    #[inline(always)]
    fn put(&self, off: u64, b: Bytes<'_>, how: CopyKind) -> Result<(), MemError> {
        b.copy_to(self, off, how == CopyKind::Ordered)
    }
}

impl Sink for dyn RemoteRegion {
    #[inline(always)]
    fn put(&self, off: u64, b: Bytes<'_>, how: CopyKind) -> Result<(), MemError> {
        match b {
            Bytes::Slice(d) => self.put_bytes(off, d, how),
            Bytes::Span(s, src_off, n) => RemoteRegion::put(self, off, s, src_off, n, how),
        }
    }
}

/// Bytes a message is copied from: caller memory (inline data) or a range of a region.
#[derive(Clone, Copy)]
enum Bytes<'a> {
    Slice(&'a [u8]),
    /// `len` bytes at `off` of a span (validated against it).
    Span(&'a Span, u64, usize),
}

impl<'a> Bytes<'a> {
    fn len(&self) -> usize {
        match self {
            Bytes::Slice(d) => d.len(),
            Bytes::Span(_, _, n) => *n,
        }
    }

    /// `n` bytes from offset `at` of these bytes.
    fn part(&self, at: usize, n: usize) -> Bytes<'a> {
        match *self {
            Bytes::Slice(d) => Bytes::Slice(d.get(at..at + n).unwrap_or(&[])),
            Bytes::Span(s, off, _) => Bytes::Span(s, off + at as u64, n),
        }
    }

    /// Copies these bytes to `dst_off` of `dst`, the last 8 last if `ordered` (see
    /// [`Span::write_ordered`]). Errors only if a range is out of bounds, which the callers'
    /// validation rules out.
    #[inline(always)]
    fn copy_to(&self, dst: &Span, dst_off: u64, ordered: bool) -> Result<(), MemError> {
        match (*self, ordered) {
            (Bytes::Slice(d), false) => dst.write(dst_off, d),
            (Bytes::Slice(d), true) => dst.write_ordered(dst_off, d),
            (Bytes::Span(s, off, n), false) => s.copy_to(off, dst, dst_off, n),
            (Bytes::Span(s, off, n), true) => s.copy_to_ordered(off, dst, dst_off, n),
        }
    }

    /// Copies these bytes into `dst` (as long as they are).
    fn copy_into(&self, dst: &mut [u8]) -> Result<(), MemError> {
        match *self {
            Bytes::Slice(d) => {
                dst.get_mut(..d.len())
                    .ok_or(MemError::ReadOnly)?
                    .copy_from_slice(d);
                Ok(())
            }
            Bytes::Span(s, off, n) => s.read(off, dst.get_mut(..n).ok_or(MemError::ReadOnly)?),
        }
    }
}

/// The bytes an entry names in a local region of `pd` (for a receive or a READ/atomic result,
/// `write`: the region allows LOCAL_WRITE), or LOC_PROT_ERR.
#[inline(always)]
fn resolve<'m>(mrs: &'m MrTable, pd: u32, sge: &Sge, write: bool) -> Result<Bytes<'m>, WcStatus> {
    let mr = mrs.get(sge.lkey).ok_or(WcStatus::LocProtErr)?;
    let end = sge.addr.checked_add(u64::from(sge.length));
    if mr.pd != pd
        || end.is_none_or(|e| e > mr.data.len())
        || (write && !mr.access.contains(AccessFlags::LOCAL_WRITE))
    {
        return Err(WcStatus::LocProtErr);
    }
    Ok(Bytes::Span(&mr.data, sge.addr, sge.length as usize))
}

fn check_sges(mrs: &MrTable, pd: u32, sges: &[Sge], write: bool) -> Result<u64, WcStatus> {
    let mut total = 0u64;
    for s in sges {
        resolve(mrs, pd, s, write)?;
        total += u64::from(s.length);
    }
    Ok(total)
}

/// Where a message's bytes come from: inline data, one validated range, or a gather list.
#[derive(Clone, Copy)]
enum Src<'a> {
    Inline(&'a [u8]),
    Sges(&'a [Sge]),
    /// One validated range (inline data, or a single-entry list resolved once).
    One(Bytes<'a>),
}

/// Validates a message's source; returns its length and the source to copy from (a
/// single-entry list comes back resolved).
fn prepare<'a>(mrs: &'a MrTable, pd: u32, src: Src<'a>) -> Result<(u64, Src<'a>), WcStatus> {
    match src {
        Src::Inline(d) => Ok((d.len() as u64, Src::One(Bytes::Slice(d)))),
        Src::Sges([one]) => Ok((
            u64::from(one.length),
            Src::One(resolve(mrs, pd, one, false)?),
        )),
        Src::Sges(s) => Ok((check_sges(mrs, pd, s, false)?, src)),
        Src::One(b) => Ok((b.len() as u64, src)),
    }
}

/// Calls `f(at, bytes)` for the pieces of the `n` bytes at entry-list offset `off` of `sges`
/// (`at` counts from `off`), resolving each entry (`write`: LOCAL_WRITE needed); entries that
/// fail to resolve are skipped (callers validated the list beforehand).
fn walk_sges<'m>(
    mrs: &'m MrTable,
    pd: u32,
    sges: &[Sge],
    mut off: u64,
    n: usize,
    write: bool,
    mut f: impl FnMut(usize, Bytes<'m>),
) {
    let mut done = 0usize;
    for s in sges {
        if done == n {
            break;
        }
        let l = u64::from(s.length);
        if off >= l {
            off -= l;
            continue;
        }
        let take = ((l - off) as usize).min(n - done);
        if let Ok(b) = resolve(mrs, pd, s, write) {
            f(done, b.part(off as usize, take));
        }
        done += take;
        off = 0;
    }
}

impl Src<'_> {
    /// Copies `n` bytes of the message from offset `off` to `dst_off` of `dst`; with `ordered`
    /// the message's last 8 bytes are stored last (see [`Span::write_ordered`]). Ranges were
    /// validated by [`prepare`]; a range that is not is skipped.
    fn gather_to<D: Sink + ?Sized>(
        &self,
        mrs: &MrTable,
        pd: u32,
        off: u64,
        n: usize,
        dst: &D,
        dst_off: u64,
    ) {
        match self {
            Src::Inline(d) => {
                let _ = dst.put(
                    dst_off,
                    Bytes::Slice(d).part(off as usize, n),
                    CopyKind::Plain,
                );
            }
            Src::One(b) => {
                let _ = dst.put(dst_off, b.part(off as usize, n), CopyKind::Plain);
            }
            Src::Sges(sges) => walk_sges(mrs, pd, sges, off, n, false, |at, b| {
                let _ = dst.put(dst_off + at as u64, b, CopyKind::Plain);
            }),
        }
    }

    /// Copies the first `dst.len()` bytes of the message into `dst`.
    fn gather_into(&self, mrs: &MrTable, pd: u32, dst: &mut [u8]) {
        match self {
            Src::Inline(d) => {
                let _ = Bytes::Slice(d).part(0, dst.len()).copy_into(dst);
            }
            Src::One(b) => {
                let _ = b.part(0, dst.len()).copy_into(dst);
            }
            Src::Sges(sges) => walk_sges(mrs, pd, sges, 0, dst.len(), false, |at, b| {
                let _ = b.copy_into(&mut dst[at..at + b.len()]);
            }),
        }
    }
}

/// Scatters `src` into the (validated, writable) entries at message offset `off`.
fn scatter(mrs: &MrTable, pd: u32, sges: &[Sge], off: u64, src: Bytes<'_>) {
    walk_sges(mrs, pd, sges, off, src.len(), true, |at, b| {
        let Bytes::Span(dst, dst_off, n) = b else {
            return;
        };
        let _ = src.part(at, n).copy_to(dst, dst_off, false);
    });
}

/// RDMA WRITE's copy into a peer's region: the message's last 8 bytes stored after the rest,
/// so a peer polling the last byte sees the whole payload.
fn ordered_write<D: Sink + ?Sized>(
    src: &Src<'_>,
    mrs: &MrTable,
    pd: u32,
    dst: &D,
    dst_off: u64,
    n: usize,
) {
    if let Src::One(b) = src {
        let _ = dst.put(dst_off, *b, CopyKind::Ordered);
        return;
    }
    if n <= 8 {
        src.gather_to(mrs, pd, 0, n, dst, dst_off);
        return;
    }
    let head = n - 8;
    src.gather_to(mrs, pd, 0, head, dst, dst_off);
    // SYNC POINT write-order (release): the body is visible before the last 8 bytes.
    fence(Ordering::Release);
    src.gather_to(mrs, pd, head as u64, 8, dst, dst_off + head as u64);
}

// ---------------------------------------------------------------------------------------------
// Completion queues.
// ---------------------------------------------------------------------------------------------

pub(crate) struct CqState {
    pub(crate) entries: VecDeque<Wc>,
    pub(crate) cap: usize,
    pub(crate) qps: Vec<usize>,
    pub(crate) channel: Option<Arc<ChannelShared>>,
    pub(crate) handle_alive: bool,
    /// Completions that arrived while the CQ already held `cap` entries (kept, but counted:
    /// on hardware that is a CQ overrun, `IBV_EVENT_CQ_ERR`).
    pub(crate) overruns: u64,
}

pub(crate) type Cqs = Vec<Option<CqState>>;

fn push_cqe(cqs: &mut Cqs, cq: usize, wc: Wc) {
    if let Some(Some(c)) = cqs.get_mut(cq) {
        // Receives wait in the ring while the CQ is full (`cq_room`); send completions cannot
        // wait, so they are kept and the overrun is counted for `Cq::overruns`.
        if c.entries.len() >= c.cap {
            c.overruns += 1;
        }
        c.entries.push_back(wc);
        if let Some(ch) = &c.channel {
            ch.completion_added(cq as u32);
        }
    }
}

fn cq_room(cqs: &Cqs, cq: usize) -> bool {
    cqs.get(cq)
        .and_then(|c| c.as_ref())
        .is_some_and(|c| c.entries.len() < c.cap)
}

// ---------------------------------------------------------------------------------------------
// Queue pairs.
// ---------------------------------------------------------------------------------------------

/// A scatter/gather list kept by the engine (two entries inline, more on the heap).
#[derive(Debug, Clone)]
enum SgeList {
    Small([Sge; 2], u8),
    Heap(Vec<Sge>),
}

impl SgeList {
    fn new(s: &[Sge]) -> Self {
        if s.len() <= 2 {
            let mut a = [Sge::default(); 2];
            a[..s.len()].copy_from_slice(s);
            Self::Small(a, s.len() as u8)
        } else {
            Self::Heap(s.to_vec())
        }
    }
    fn as_slice(&self) -> &[Sge] {
        match self {
            Self::Small(a, n) => &a[..*n as usize],
            Self::Heap(v) => v,
        }
    }
}

#[derive(Debug)]
struct RqEntry {
    wr_id: u64,
    sges: SgeList,
    total: u64,
}

/// A send work request as the engine runs it: the opcode and its parameters, with the
/// payload's source `S` — borrowed from the caller's request ([`OpView`], the usual case,
/// executed at once) or owned while the request waits in the send queue ([`Work`]). One type,
/// so the two forms cannot disagree on what a request carries.
#[derive(Debug, Clone, Copy)]
struct Op<S> {
    opcode: WrOpcode,
    src: S,
    imm: u32,
    solicited: bool,
    remote_addr: u64,
    rkey: u32,
    compare_add: u64,
    swap: u64,
    ud: Option<(u32, u32, u32)>,
}

/// A request executed from the caller's memory.
type OpView<'a> = Op<Src<'a>>;
/// A request that waits in the send queue: its gather list or inline bytes copied.
type Work = Op<OwnedSrc>;

/// The payload source of a queued request.
#[derive(Debug, Clone)]
enum OwnedSrc {
    Sges(SgeList),
    Inline(Vec<u8>),
}

impl<S> Op<S> {
    /// The parameters of `wr`, with the payload from `src`.
    fn of(wr: &SendWr<'_>, src: S) -> Self {
        let mut v = Self {
            opcode: wr.opcode,
            src,
            imm: wr.imm_data,
            solicited: wr.send_flags.contains(SendFlags::SOLICITED),
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            ud: None,
        };
        match wr.wr {
            WrDetail::None => {}
            WrDetail::Rdma { remote_addr, rkey } => {
                v.remote_addr = remote_addr;
                v.rkey = rkey;
            }
            WrDetail::Atomic {
                remote_addr,
                compare_add,
                swap,
                rkey,
            } => {
                v.remote_addr = remote_addr;
                v.rkey = rkey;
                v.compare_add = compare_add;
                v.swap = swap;
            }
            WrDetail::Ud {
                ah,
                remote_qpn,
                remote_qkey,
            } => v.ud = Some((ah.slot, remote_qpn, remote_qkey)),
        }
        v
    }

    /// The same request with another payload source.
    fn with_src<T>(&self, src: T) -> Op<T> {
        Op {
            opcode: self.opcode,
            src,
            imm: self.imm,
            solicited: self.solicited,
            remote_addr: self.remote_addr,
            rkey: self.rkey,
            compare_add: self.compare_add,
            swap: self.swap,
            ud: self.ud,
        }
    }
}

impl Work {
    fn from_wr(wr: &SendWr<'_>) -> Self {
        let src = if wr.send_flags.contains(SendFlags::INLINE) && !wr.inline_data.is_empty() {
            OwnedSrc::Inline(wr.inline_data.to_vec())
        } else {
            OwnedSrc::Sges(SgeList::new(wr.sg_list))
        };
        Op::of(wr, src)
    }

    /// The request as the executing code takes it.
    fn view(&self) -> OpView<'_> {
        self.with_src(match &self.src {
            OwnedSrc::Inline(d) => Src::Inline(d),
            OwnedSrc::Sges(l) => Src::Sges(l.as_slice()),
        })
    }
}

/// How far a send got before it had to wait.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    started: bool,
    pushed: u64,
    msg: u64,
}

#[derive(Debug)]
enum SqSt {
    Pending(Box<(Work, Progress)>),
    Ack { end: u64, msg: u64 },
    Done(WcStatus),
}

#[derive(Debug)]
struct SqEntry {
    wr_id: u64,
    opcode: WrOpcode,
    signaled: bool,
    byte_len: u32,
    st: SqSt,
}

enum Exec {
    Done(WcStatus),
    Ack {
        end: u64,
        msg: u64,
    },
    Full,
    Rnr,
    /// The QP must go to ERR with this status for the work request.
    Fatal(WcStatus),
}

#[derive(Debug)]
struct OwnBlock {
    off: u64,
    ack: Word64,
    credits: Word64,
    nak: Word64,
    peer_err: Word32,
    peer_rnr: Word32,
    access: Word32,
    tail: Word64,
    /// The inbound ring's data area.
    data: Span,
}

struct PeerLink {
    slot: u32,
    qpn: u32,
    generation: u32,
    credits: Word64,
    nak: Word64,
    peer_err: Word32,
    rnr: Word32,
    access: Word32,
    ev_bell: Word32,
    ev_armed: Word32,
    out: QRing,
    inr: QRing,
}

#[derive(Debug)]
struct InMsg {
    wqe: Option<RqEntry>,
    op: MsgOp,
    imm: u32,
    msg_len: u32,
    status: WcStatus,
}

#[derive(Debug, Clone, Copy)]
struct Rnr {
    left: u8,
    next: Instant,
}

pub(crate) struct QpSt {
    /// Where the last fast-path RDMA_WRITE went, for the handle's early prefetch.
    pub(crate) write_hint: WriteHint,
    /// Where the next SEND goes (the ring's next record and its producer index), for the
    /// handle's early prefetch; never dereferenced.
    pub(crate) send_hint: [*const u8; 2],
    pub(crate) qpn: u32,
    pub(crate) ty: QpType,
    pub(crate) state: QpState,
    pd: u32,
    pub(crate) send_cq: usize,
    pub(crate) recv_cq: usize,
    sig_all: bool,
    pub(crate) cap: QpCap,
    pub(crate) attr: QpAttr,
    own: Option<OwnBlock>,
    peer: Option<PeerLink>,
    prod: Producer,
    cons: Consumer,
    sq: VecDeque<SqEntry>,
    exec: usize,
    rq: VecDeque<RqEntry>,
    rq_posted: u64,
    credits: u64,
    used_credits: u64,
    acked: u64,
    rnr: Option<Rnr>,
    inbound: Option<InMsg>,
    msgs_in: u64,
    msgs_out: u64,
    bell_pending: bool,
    peer_gone: bool,
    ud: Option<Endpoint>,
    remote: Vec<Rc<RemoteMr>>,
    /// Messages dropped: UC/UD without a receive, bad Q_Key, malformed datagrams.
    pub(crate) drops: u64,
    /// Why the QP went to ERR when no work request was to blame (the async event of
    /// libibverbs, `IBV_EVENT_QP_FATAL`).
    pub(crate) error: Option<&'static str>,
    /// Polls in a row that found no inbound message: the peer-written words (acks, peer
    /// gone) are read only when they cannot arrive piggybacked, to keep from pulling the
    /// cache line the peer is about to write on every poll.
    idle: u32,
    /// The last progress took a message and left the send side for this one.
    settle_later: bool,
    /// How far piggybacked acknowledgements reached.
    acked_piggy: u64,
    /// Posted-receive count last written into the peer's block.
    published: u64,
}

/// What every QP operation needs from its context.
pub(crate) struct Env<'a> {
    pub(crate) node: &'a Node,
    pub(crate) transport: &'a dyn Transport,
    pub(crate) win: &'a Arc<Region>,
    pub(crate) mrs: &'a MrTable,
}

impl QpSt {
    fn signaled(&self, flags: SendFlags) -> bool {
        self.sig_all || flags.contains(SendFlags::SIGNALED)
    }

    fn wc(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode, byte_len: u32) -> Wc {
        Wc {
            wr_id,
            status,
            opcode,
            byte_len,
            qp_num: self.qpn,
            ..Wc::default()
        }
    }

    /// Rings the peer context's bell if its channel sleeps (after our stores are visible).
    fn ring_peer(&mut self) {
        self.bell_pending = false;
        if let Some(p) = &self.peer {
            // SYNC POINT qp-bell (sender): ring/ack stores are visible before we read `armed`.
            fence(Ordering::SeqCst);
            if p.ev_armed.load(Ordering::Relaxed) != 0 {
                crate::sync::ring(&p.ev_bell);
            }
        }
    }

    pub(crate) fn flush_bell_pub(&mut self) {
        self.publish_credits();
        self.flush_bell();
    }

    fn flush_bell(&mut self) {
        if self.bell_pending {
            self.ring_peer();
        }
    }

    /// Takes the QP to ERR for a reason that is no work request's, and records the reason.
    pub(crate) fn fail_why(&mut self, why: &'static str, status: WcStatus, cqs: &mut Cqs) {
        if self.error.is_none() {
            self.error = Some(why);
        }
        self.fail(None, status, cqs);
    }

    /// Takes the QP to ERR: every unfinished send completes (the one at `failed` with
    /// `status`, the others with WR_FLUSH_ERR), every receive is flushed, the peer is told.
    fn fail(&mut self, failed: Option<usize>, status: WcStatus, cqs: &mut Cqs) {
        let entries: Vec<SqEntry> = self.sq.drain(..).collect();
        for (i, e) in entries.into_iter().enumerate() {
            let st = match e.st {
                SqSt::Done(s) => s,
                _ if Some(i) == failed => status,
                _ => WcStatus::WrFlushErr,
            };
            if st != WcStatus::Success || e.signaled {
                let wc = self.wc(e.wr_id, st, wc_opcode(e.opcode), e.byte_len);
                push_cqe(cqs, self.send_cq, wc);
            }
        }
        self.exec = 0;
        self.flush_rq(cqs);
        self.rnr = None;
        if self.state != QpState::Err {
            self.state = QpState::Err;
            if let Some(p) = &self.peer {
                // SYNC POINT qp-peer-gone (release): our acks and NAKs are visible before the flag.
                p.peer_err.store(1, Ordering::Release);
                if !self.peer_gone {
                    crate::sync::ring(&p.ev_bell);
                }
            }
        }
    }

    fn flush_rq(&mut self, cqs: &mut Cqs) {
        if let Some(m) = self.inbound.take() {
            if let Some(w) = m.wqe {
                let wc = self.wc(w.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
                push_cqe(cqs, self.recv_cq, wc);
            }
        }
        while let Some(w) = self.rq.pop_front() {
            let wc = self.wc(w.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
            push_cqe(cqs, self.recv_cq, wc);
        }
    }

    // -----------------------------------------------------------------------------------------
    // Posting.
    // -----------------------------------------------------------------------------------------

    fn check_wr(&self, wr: &SendWr<'_>) -> Result<(), VerbsError> {
        use WrOpcode::*;
        let ok = match self.ty {
            QpType::Rc => true,
            QpType::Uc => matches!(wr.opcode, Send | SendWithImm | RdmaWrite | RdmaWriteWithImm),
            QpType::Ud => matches!(wr.opcode, Send | SendWithImm),
        };
        if !ok {
            return Err(VerbsError::inval(format!(
                "{:?} is not available on a {:?} QP",
                wr.opcode, self.ty
            )));
        }
        if wr.sg_list.len() > self.cap.max_send_sge as usize {
            return Err(VerbsError::inval(format!(
                "{} scatter/gather entries exceed max_send_sge {}",
                wr.sg_list.len(),
                self.cap.max_send_sge
            )));
        }
        let detail_ok = match (wr.opcode, wr.wr) {
            (Send | SendWithImm, WrDetail::None) => self.ty != QpType::Ud,
            (Send | SendWithImm, WrDetail::Ud { .. }) => self.ty == QpType::Ud,
            (RdmaWrite | RdmaWriteWithImm | RdmaRead, WrDetail::Rdma { .. }) => true,
            (AtomicCmpAndSwp | AtomicFetchAndAdd, WrDetail::Atomic { .. }) => true,
            _ => false,
        };
        if !detail_ok {
            return Err(VerbsError::inval(format!(
                "{:?} needs {} (wr field)",
                wr.opcode,
                match wr.opcode {
                    Send | SendWithImm if self.ty == QpType::Ud => "WrDetail::Ud",
                    Send | SendWithImm => "WrDetail::None",
                    RdmaWrite | RdmaWriteWithImm | RdmaRead => "WrDetail::Rdma",
                    _ => "WrDetail::Atomic",
                }
            )));
        }
        if wr.send_flags.contains(SendFlags::INLINE) {
            let n = if wr.inline_data.is_empty() {
                wr.sg_list.iter().map(|s| u64::from(s.length)).sum::<u64>()
            } else {
                wr.inline_data.len() as u64
            };
            if n > u64::from(self.cap.max_inline_data)
                || matches!(wr.opcode, RdmaRead | AtomicCmpAndSwp | AtomicFetchAndAdd)
            {
                return Err(VerbsError::inval(format!(
                    "inline {:?} of {n} bytes (max_inline_data {})",
                    wr.opcode, self.cap.max_inline_data
                )));
            }
        }
        Ok(())
    }

    /// A request posted now may run at once, on a fast path: RTS, nothing queued or waiting
    /// for an RNR retry ahead of it, the peer there, a connected transport.
    #[inline(always)]
    fn runs_now(&self) -> bool {
        self.state == QpState::Rts
            && self.exec == self.sq.len()
            && self.rnr.is_none()
            && !self.peer_gone
            && self.ty != QpType::Ud
    }

    /// One request on its fast path (RDMA_WRITE, SEND, READ, atomics), or `false` with nothing
    /// done: the caller then takes the general way, which also reports every error.
    #[inline(always)]
    pub(crate) fn post_one_fast(&mut self, wr: &SendWr<'_>, mrs: &MrTable, cqs: &mut Cqs) -> bool {
        match wr.opcode {
            WrOpcode::RdmaWrite => self.fast_rdma_write(wr, mrs, cqs),
            WrOpcode::Send | WrOpcode::SendWithImm => self.fast_send(wr, mrs, cqs),
            _ => self.fast_read_atomic(wr, mrs, cqs),
        }
    }

    /// The RDMA_WRITE fast path — the latency-critical operation (a peer polling memory) — on
    /// its own so it compiles to a short straight line: one request, nothing waiting ahead, a
    /// single local range or inline data, the region last used for this QP's one-sided work,
    /// the same checks as [`QpSt::fast_read_atomic`]. Anything else goes the general way.
    #[inline(always)]
    fn fast_rdma_write(&mut self, wr: &SendWr<'_>, mrs: &MrTable, cqs: &mut Cqs) -> bool {
        let WrDetail::Rdma { remote_addr, rkey } = wr.wr else {
            return false;
        };
        if !self.runs_now() {
            return false;
        }
        let inline = wr.send_flags.contains(SendFlags::INLINE);
        let local = if inline && !wr.inline_data.is_empty() {
            if wr.inline_data.len() > self.cap.max_inline_data as usize {
                return false;
            }
            Bytes::Slice(wr.inline_data)
        } else {
            let [one] = wr.sg_list else { return false };
            if inline && one.length > self.cap.max_inline_data {
                return false;
            }
            match resolve(mrs, self.pd, one, false) {
                Ok(b) => b,
                Err(_) => return false,
            }
        };
        let len = local.len();
        let Some(m) = self.remote.last() else {
            return false;
        };
        // The line the write ends in (the one a peer polls) starts coming while the checks run.
        let end_line = write_end(&*m.mem, remote_addr, len);
        crate::sync::prefetch_write(end_line);
        let Some(p) = &self.peer else { return false };
        if m.key != rkey
            || !m.valid()
            || !remote_access_allowed(
                m.mem.len(),
                m.access,
                // SYNC POINT qp-access (relaxed read of a word that only gates, never publishes).
                AccessFlags::from_bits_retain(p.access.load(Ordering::Relaxed)),
                AccessFlags::REMOTE_WRITE,
                remote_addr,
                len as u64,
            )
        {
            return false;
        }
        // In bounds (checked just above) and granted writable (REMOTE_WRITE): cannot fail.
        if Sink::put(&*m.mem, remote_addr, local, CopyKind::Ordered).is_err() {
            return false;
        }
        self.write_hint = WriteHint {
            rkey,
            remote_addr,
            line: end_line,
        };
        self.done_at_once(wr, WcOpcode::RdmaWrite, len, cqs);
        true
    }

    /// A request a fast path carried out entirely: a signaled one completes now, or — if work
    /// posted before it still waits for its acknowledgement — right after that work (in order).
    #[inline(always)]
    fn done_at_once(&mut self, wr: &SendWr<'_>, op: WcOpcode, len: usize, cqs: &mut Cqs) {
        if !self.signaled(wr.send_flags) {
            return;
        }
        if self.sq.is_empty() {
            let wc = self.wc(wr.wr_id, WcStatus::Success, op, len as u32);
            push_cqe(cqs, self.send_cq, wc);
        } else {
            self.push_executed(wr, true, len as u32, SqSt::Done(WcStatus::Success));
        }
    }

    /// The fast path of RDMA_READ and the atomics (RC): one request, nothing waiting ahead of
    /// it, a single local range, a region already mapped. Anything else — including every
    /// error — goes the general way (which reports it). RDMA_WRITE has its own,
    /// [`QpSt::fast_rdma_write`].
    #[inline(never)]
    fn fast_read_atomic(&mut self, wr: &SendWr<'_>, mrs: &MrTable, cqs: &mut Cqs) -> bool {
        let (remote_addr, rkey, need, wc_op) = match (wr.opcode, wr.wr) {
            (WrOpcode::RdmaRead, WrDetail::Rdma { remote_addr, rkey }) => (
                remote_addr,
                rkey,
                AccessFlags::REMOTE_READ,
                WcOpcode::RdmaRead,
            ),
            (
                WrOpcode::AtomicFetchAndAdd,
                WrDetail::Atomic {
                    remote_addr, rkey, ..
                },
            ) => (
                remote_addr,
                rkey,
                AccessFlags::REMOTE_ATOMIC,
                WcOpcode::FetchAdd,
            ),
            (
                WrOpcode::AtomicCmpAndSwp,
                WrDetail::Atomic {
                    remote_addr, rkey, ..
                },
            ) => (
                remote_addr,
                rkey,
                AccessFlags::REMOTE_ATOMIC,
                WcOpcode::CompSwap,
            ),
            _ => return false,
        };
        // UC has neither: the general way refuses them.
        if !self.runs_now() || self.ty == QpType::Uc {
            return false;
        }
        let [one] = wr.sg_list else { return false };
        let Ok(Bytes::Span(local, local_off, len)) = resolve(mrs, self.pd, one, true) else {
            return false;
        };
        if wr.send_flags.contains(SendFlags::INLINE) && len > self.cap.max_inline_data as usize {
            return false;
        }
        let atomic = matches!(wc_op, WcOpcode::FetchAdd | WcOpcode::CompSwap);
        if atomic && (len != 8 || !remote_addr.is_multiple_of(8)) {
            return false;
        }
        let Some(m) = self.remote.last().filter(|m| m.key == rkey) else {
            return false;
        };
        let Some(p) = &self.peer else { return false };
        if !m.valid()
            || !remote_access_allowed(
                m.mem.len(),
                m.access,
                // SYNC POINT qp-access (relaxed read of a word that only gates, never publishes).
                AccessFlags::from_bits_retain(p.access.load(Ordering::Relaxed)),
                need,
                remote_addr,
                len as u64,
            )
        {
            return false;
        }
        // Ranges checked just above (atomics only on regions granted writable, which
        // REMOTE_ATOMIC regions are); an error here means a check disagreed: the general way.
        let done = match (wc_op, wr.wr) {
            (WcOpcode::RdmaRead, _) => {
                m.mem
                    .get(remote_addr, local, local_off, len, CopyKind::Plain)
            }
            (
                op,
                WrDetail::Atomic {
                    compare_add, swap, ..
                },
            ) => if op == WcOpcode::FetchAdd {
                m.mem.fetch_add(remote_addr, compare_add)
            } else {
                m.mem.compare_swap(remote_addr, compare_add, swap)
            }
            .and_then(|old| local.write(local_off, &old.to_le_bytes())),
            _ => return false,
        };
        if done.is_err() {
            return false;
        }
        self.done_at_once(wr, wc_op, len, cqs);
        true
    }

    /// The SEND fast path (RC/UC): one request, nothing waiting ahead, one source range or
    /// inline data, one fragment, a credit and ring room at hand. Anything else goes the
    /// general way. Kept out of line so the one-sided path stays small (registers, spills).
    #[inline(never)]
    fn fast_send(&mut self, wr: &SendWr<'_>, mrs: &MrTable, cqs: &mut Cqs) -> bool {
        let mop = match wr.opcode {
            WrOpcode::Send => MsgOp::Send,
            WrOpcode::SendWithImm => MsgOp::SendImm,
            _ => return false,
        };
        if !matches!(wr.wr, WrDetail::None) || !self.runs_now() {
            return false;
        }
        let inline = wr.send_flags.contains(SendFlags::INLINE);
        let src = match (inline, wr.inline_data, wr.sg_list) {
            (true, d, _) if !d.is_empty() => Bytes::Slice(d),
            (_, _, [one]) => match resolve(mrs, self.pd, one, false) {
                Ok(b) => b,
                Err(_) => return false,
            },
            _ => return false,
        };
        let len = src.len();
        if len > FRAG || (inline && len > self.cap.max_inline_data as usize) {
            return false;
        }
        let rc = self.ty == QpType::Rc;
        if rc && self.used_credits >= self.credits {
            if let Some(o) = &self.own {
                // SYNC POINT qp-credits (acquire).
                self.credits = self.credits.max(o.credits.load(Ordering::Acquire));
            }
            if self.used_credits >= self.credits {
                return false;
            }
        }
        let Some(p) = &self.peer else { return false };
        let Ok(r) = self.prod.reserve(&p.out, HDR + len) else {
            return false;
        };
        let solicited = if wr.send_flags.contains(SendFlags::SOLICITED) {
            MSG_SOLICITED
        } else {
            0
        };
        let mut hdr = [0u8; HDR];
        MsgRepr {
            op: mop,
            flags: MSG_FIRST | MSG_LAST | solicited,
            imm: wr.imm_data,
            msg_len: len as u32,
            frag_off: 0,
            ack: self.cons.head(),
            credits: self.rq_posted,
        }
        .emit(&mut MsgHeader::new_unchecked(&mut hdr[..]));
        // The reservation covers HDR + len bytes at r.pos, ours until commit.
        p.out.write(r.pos, &hdr);
        let _ = src.copy_to(&p.out.data, r.pos + HDR as u64, false);
        self.prod.commit(&p.out, r);
        self.send_hint = [
            // The ring's data length is a power of two; if a peer lied about it, this is a
            // wrong hint, not a wrong access (it is never dereferenced).
            p.out
                .data
                .addr(self.prod.tail() & p.out.data.len().wrapping_sub(1)),
            std::ptr::from_ref::<AtomicU64>(&p.out.tail).cast::<u8>(),
        ];
        if rc {
            self.used_credits += 1;
        }
        let msg = self.msgs_out;
        self.msgs_out += 1;
        self.ring_peer();
        if rc {
            let signaled = self.signaled(wr.send_flags);
            self.push_executed(
                wr,
                signaled,
                len as u32,
                SqSt::Ack {
                    end: self.prod.tail(),
                    msg,
                },
            );
        } else {
            self.done_at_once(wr, WcOpcode::Send, len, cqs);
        }
        true
    }

    /// `ibv_post_send` the general way (every request kind, lists, errors).
    pub(crate) fn post_send(
        &mut self,
        wrs: &[SendWr<'_>],
        env: &Env<'_>,
        cqs: &mut Cqs,
    ) -> Result<(), VerbsError> {
        for (i, wr) in wrs.iter().enumerate() {
            let bad = |e: VerbsError| VerbsError::Post {
                bad_wr: i,
                source: Box::new(e),
            };
            match self.state {
                QpState::Rts => {}
                QpState::Err => {
                    let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, wc_opcode(wr.opcode), 0);
                    push_cqe(cqs, self.send_cq, wc);
                    continue;
                }
                s => {
                    return Err(bad(VerbsError::inval(format!(
                        "post_send on a QP in {s:?}"
                    ))))
                }
            }
            self.check_wr(wr).map_err(bad)?;
            if self.sq.len() >= self.cap.max_send_wr as usize {
                return Err(bad(VerbsError::QueueFull(format!(
                    "{} send work requests outstanding (max_send_wr)",
                    self.sq.len()
                ))));
            }
            let signaled = self.signaled(wr.send_flags);
            let byte_len = byte_len_of(wr);
            if self.exec == self.sq.len() && self.rnr.is_none() {
                // Nothing waits ahead of this request: run it now, without copying it.
                let src = match (wr.send_flags.contains(SendFlags::INLINE), wr.inline_data) {
                    (true, d) if !d.is_empty() => Src::Inline(d),
                    _ => Src::Sges(wr.sg_list),
                };
                let op = OpView::of(wr, src);
                let mut prog = Progress::default();
                let r = self.execute(&op, &mut prog, env);
                match r {
                    Exec::Done(st) if self.sq.is_empty() => {
                        if st != WcStatus::Success || signaled {
                            let wc = self.wc(wr.wr_id, st, wc_opcode(wr.opcode), byte_len);
                            push_cqe(cqs, self.send_cq, wc);
                        }
                        continue;
                    }
                    Exec::Fatal(st) => {
                        self.sq.push_back(SqEntry {
                            wr_id: wr.wr_id,
                            opcode: wr.opcode,
                            signaled,
                            byte_len,
                            st: SqSt::Pending(Box::new((Work::from_wr(wr), prog))),
                        });
                        let at = self.sq.len() - 1;
                        self.fail(Some(at), st, cqs);
                        continue;
                    }
                    Exec::Done(st) => {
                        self.push_executed(wr, signaled, byte_len, SqSt::Done(st));
                    }
                    Exec::Ack { end, msg } => {
                        self.push_executed(wr, signaled, byte_len, SqSt::Ack { end, msg });
                    }
                    Exec::Full | Exec::Rnr => {
                        if matches!(r, Exec::Rnr) {
                            self.start_rnr();
                        }
                        self.sq.push_back(SqEntry {
                            wr_id: wr.wr_id,
                            opcode: wr.opcode,
                            signaled,
                            byte_len,
                            st: SqSt::Pending(Box::new((Work::from_wr(wr), prog))),
                        });
                    }
                }
            } else {
                self.sq.push_back(SqEntry {
                    wr_id: wr.wr_id,
                    opcode: wr.opcode,
                    signaled,
                    byte_len,
                    st: SqSt::Pending(Box::new((Work::from_wr(wr), Progress::default()))),
                });
            }
        }
        Ok(())
    }

    fn push_executed(&mut self, wr: &SendWr<'_>, signaled: bool, byte_len: u32, st: SqSt) {
        self.sq.push_back(SqEntry {
            wr_id: wr.wr_id,
            opcode: wr.opcode,
            signaled,
            byte_len,
            st,
        });
        self.exec = self.sq.len();
    }

    pub(crate) fn post_recv(
        &mut self,
        wrs: &[RecvWr<'_>],
        cqs: &mut Cqs,
    ) -> Result<(), VerbsError> {
        let was_empty = self.rq.is_empty();
        for (i, wr) in wrs.iter().enumerate() {
            let bad = |e: VerbsError| VerbsError::Post {
                bad_wr: i,
                source: Box::new(e),
            };
            match self.state {
                QpState::Reset => {
                    return Err(bad(VerbsError::inval("post_recv on a QP in Reset")));
                }
                QpState::Err => {
                    let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
                    push_cqe(cqs, self.recv_cq, wc);
                    continue;
                }
                _ => {}
            }
            if wr.sg_list.len() > self.cap.max_recv_sge as usize {
                return Err(bad(VerbsError::inval(format!(
                    "{} scatter/gather entries exceed max_recv_sge {}",
                    wr.sg_list.len(),
                    self.cap.max_recv_sge
                ))));
            }
            if self.rq.len() >= self.cap.max_recv_wr as usize {
                return Err(bad(VerbsError::QueueFull(format!(
                    "{} receive work requests outstanding (max_recv_wr)",
                    self.rq.len()
                ))));
            }
            self.rq.push_back(RqEntry {
                wr_id: wr.wr_id,
                sges: SgeList::new(wr.sg_list),
                total: wr.sg_list.iter().map(|s| u64::from(s.length)).sum(),
            });
            self.rq_posted += 1;
        }
        // Credits travel piggybacked on our messages; the peer's block is written when the
        // queue was empty (the peer may be waiting), every eighth of the queue, and when a
        // poll finds nothing to do.
        let batch = u64::from((self.cap.max_recv_wr / 8).max(1));
        if was_empty {
            // The peer may be waiting for a receive (RNR), perhaps asleep: wake it.
            self.publish_credits();
            self.ring_peer();
        } else if self.rq_posted - self.published >= batch {
            self.publish_credits();
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Execution of send work requests.
    // -----------------------------------------------------------------------------------------

    fn execute(&mut self, op: &OpView<'_>, prog: &mut Progress, env: &Env<'_>) -> Exec {
        use WrOpcode::*;
        if self.peer_gone && self.ty != QpType::Ud {
            return Exec::Fatal(WcStatus::RetryExcErr);
        }
        match op.opcode {
            Send | SendWithImm if self.ty == QpType::Ud => self.exec_ud(op, env),
            Send | SendWithImm => self.exec_send(op, prog, env),
            RdmaWrite | RdmaWriteWithImm => self.exec_write(op, prog, env),
            RdmaRead => self.exec_read(op, env),
            AtomicCmpAndSwp | AtomicFetchAndAdd => self.exec_atomic(op, env),
        }
    }

    /// Takes a credit (RC), refreshing the view of the peer's posted receives if needed.
    fn take_credit(&mut self) -> bool {
        if self.ty != QpType::Rc {
            return true;
        }
        if self.used_credits >= self.credits {
            if let Some(o) = &self.own {
                // SYNC POINT qp-credits (acquire).
                self.credits = self.credits.max(o.credits.load(Ordering::Acquire));
            }
            if self.used_credits >= self.credits {
                return false;
            }
        }
        self.used_credits += 1;
        true
    }

    fn exec_send(&mut self, op: &OpView<'_>, prog: &mut Progress, env: &Env<'_>) -> Exec {
        let (total, src) = match prepare(env.mrs, self.pd, op.src) {
            Ok(t) => t,
            Err(s) => return Exec::Fatal(s),
        };
        let op = &op.with_src(src);
        if total > u64::from(MAX_MSG) {
            return Exec::Fatal(WcStatus::LocLenErr);
        }
        let mop = if op.opcode == WrOpcode::SendWithImm {
            MsgOp::SendImm
        } else {
            MsgOp::Send
        };
        if !prog.started {
            if !self.take_credit() {
                return Exec::Rnr;
            }
            prog.started = true;
            prog.msg = self.msgs_out;
            self.msgs_out += 1;
        }
        match self.push_message(mop, op, total, prog, env) {
            Ok(true) => {}
            Ok(false) => return Exec::Full,
            Err(s) => return Exec::Fatal(s),
        }
        self.ring_peer();
        match self.ty {
            QpType::Rc => Exec::Ack {
                end: self.prod.tail(),
                msg: prog.msg,
            },
            _ => Exec::Done(WcStatus::Success),
        }
    }

    /// Pushes the rest of a message into the peer's ring. `Ok(false)`: the ring is full.
    fn push_message(
        &mut self,
        mop: MsgOp,
        op: &OpView<'_>,
        total: u64,
        prog: &mut Progress,
        env: &Env<'_>,
    ) -> Result<bool, WcStatus> {
        let Some(p) = &self.peer else {
            return Err(WcStatus::LocQpOpErr);
        };
        let payload = mop != MsgOp::WriteImm;
        loop {
            let frag = if payload {
                (total - prog.pushed).min(FRAG as u64) as usize
            } else {
                0
            };
            let r = match self.prod.reserve(&p.out, HDR + frag) {
                Ok(r) => r,
                Err(RingError::Full) => return Ok(false),
                Err(_) => return Err(WcStatus::LocQpOpErr),
            };
            let first = prog.pushed == 0;
            let last = !payload || prog.pushed + frag as u64 == total;
            let mut flags = 0;
            if first {
                flags |= MSG_FIRST;
            }
            if last {
                flags |= MSG_LAST;
                if op.solicited {
                    flags |= MSG_SOLICITED;
                }
            }
            let mut h = [0u8; HDR];
            MsgRepr {
                op: mop,
                flags,
                imm: op.imm,
                msg_len: total as u32,
                frag_off: if payload { prog.pushed as u32 } else { 0 },
                ack: self.cons.head(),
                credits: self.rq_posted,
            }
            .emit(&mut MsgHeader::new_unchecked(&mut h[..]));
            p.out.write(r.pos, &h);
            if frag > 0 {
                // The reservation covers HDR + frag bytes at r.pos, inside the ring; the
                // source was validated by `prepare` in this same call.
                op.src.gather_to(
                    env.mrs,
                    self.pd,
                    prog.pushed,
                    frag,
                    &p.out.data,
                    r.pos + HDR as u64,
                );
            }
            self.prod.commit(&p.out, r);
            prog.pushed += frag as u64;
            if last {
                return Ok(true);
            }
        }
    }

    /// The peer's region `rkey`, granted and mapped on first use; None → REM_ACCESS_ERR.
    fn remote_mr(&mut self, rkey: u32, env: &Env<'_>) -> Option<Rc<RemoteMr>> {
        if let Some(i) = self.remote.iter().rposition(|m| m.key == rkey) {
            if self.remote[i].valid() {
                let m = self.remote.remove(i);
                self.remote.push(m.clone()); // most recently used last (the fast path's)
                return Some(m);
            }
            self.remote.remove(i);
            return None;
        }
        let mem = env.transport.map_region(GrantRequest::ThroughQp {
            slot: env.node.slot(),
            qpn: self.qpn,
            rkey,
        })?;
        let m = Rc::new(RemoteMr {
            key: rkey,
            access: AccessFlags::from_bits_retain(mem.access_bits()),
            mem,
        });
        if self.remote.len() >= REMOTE_CACHE {
            self.remote.remove(0);
        }
        self.remote.push(m.clone());
        Some(m)
    }

    /// Checks a one-sided access: region valid and allowing `need`, the peer QP accepting it,
    /// `[addr, addr+len)` inside the region.
    fn remote_access(
        &mut self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
        env: &Env<'_>,
    ) -> Result<Rc<RemoteMr>, WcStatus> {
        let peer_access = self
            .peer
            .as_ref()
            // SYNC POINT qp-access (relaxed read of a word that only gates, never publishes).
            .map(|p| AccessFlags::from_bits_retain(p.access.load(Ordering::Relaxed)))
            .ok_or(WcStatus::LocQpOpErr)?;
        let m = self.remote_mr(rkey, env).ok_or(WcStatus::RemAccessErr)?;
        if !remote_access_allowed(m.mem.len(), m.access, peer_access, need, addr, len) {
            return Err(WcStatus::RemAccessErr);
        }
        Ok(m)
    }

    fn exec_write(&mut self, op: &OpView<'_>, prog: &mut Progress, env: &Env<'_>) -> Exec {
        let (total, src) = match prepare(env.mrs, self.pd, op.src) {
            Ok(t) => t,
            Err(s) => return Exec::Fatal(s),
        };
        let op = &op.with_src(src);
        let imm = op.opcode == WrOpcode::RdmaWriteWithImm;
        if !prog.started {
            let m = match self.remote_access(
                op.rkey,
                op.remote_addr,
                total,
                AccessFlags::REMOTE_WRITE,
                env,
            ) {
                Ok(m) => m,
                Err(s) => return Exec::Fatal(s),
            };
            if imm {
                if !self.take_credit() {
                    return Exec::Rnr;
                }
                prog.msg = self.msgs_out;
                self.msgs_out += 1;
            }
            prog.started = true;
            // [remote_addr, +total) is inside the region (remote_access checked the bounds;
            // REMOTE_WRITE regions are granted writable); the source was validated by `prepare`.
            ordered_write(
                &op.src,
                env.mrs,
                self.pd,
                &*m.mem,
                op.remote_addr,
                total as usize,
            );
        }
        if !imm {
            return Exec::Done(WcStatus::Success);
        }
        match self.push_message(MsgOp::WriteImm, op, total, prog, env) {
            Ok(true) => {}
            Ok(false) => return Exec::Full,
            Err(s) => return Exec::Fatal(s),
        }
        self.ring_peer();
        match self.ty {
            QpType::Rc => Exec::Ack {
                end: self.prod.tail(),
                msg: prog.msg,
            },
            _ => Exec::Done(WcStatus::Success),
        }
    }

    fn exec_read(&mut self, op: &OpView<'_>, env: &Env<'_>) -> Exec {
        let Src::Sges(sges) = op.src else {
            return Exec::Fatal(WcStatus::LocProtErr);
        };
        let total = match check_sges(env.mrs, self.pd, sges, true) {
            Ok(t) => t,
            Err(s) => return Exec::Fatal(s),
        };
        let m = match self.remote_access(
            op.rkey,
            op.remote_addr,
            total,
            AccessFlags::REMOTE_READ,
            env,
        ) {
            Ok(m) => m,
            Err(s) => return Exec::Fatal(s),
        };
        // [remote_addr, +total) is inside the region (checked); the local entries were
        // validated writable.
        walk_sges(env.mrs, self.pd, sges, 0, total as usize, true, |at, b| {
            if let Bytes::Span(dst, dst_off, n) = b {
                let _ = m
                    .mem
                    .get(op.remote_addr + at as u64, dst, dst_off, n, CopyKind::Plain);
            }
        });
        Exec::Done(WcStatus::Success)
    }

    fn exec_atomic(&mut self, op: &OpView<'_>, env: &Env<'_>) -> Exec {
        let Src::Sges(sges) = op.src else {
            return Exec::Fatal(WcStatus::LocProtErr);
        };
        match check_sges(env.mrs, self.pd, sges, true) {
            Ok(8) => {}
            Ok(_) => return Exec::Fatal(WcStatus::LocLenErr),
            Err(s) => return Exec::Fatal(s),
        }
        if !op.remote_addr.is_multiple_of(8) {
            return Exec::Fatal(WcStatus::RemAccessErr);
        }
        let m =
            match self.remote_access(op.rkey, op.remote_addr, 8, AccessFlags::REMOTE_ATOMIC, env) {
                Ok(m) => m,
                Err(s) => return Exec::Fatal(s),
            };
        let old = if op.opcode == WrOpcode::AtomicFetchAndAdd {
            m.mem.fetch_add(op.remote_addr, op.compare_add)
        } else {
            m.mem.compare_swap(op.remote_addr, op.compare_add, op.swap)
        };
        let Ok(old) = old else {
            return Exec::Fatal(WcStatus::RemAccessErr);
        };
        let b = old.to_le_bytes();
        // The entries were validated writable and hold exactly 8 bytes.
        scatter(env.mrs, self.pd, sges, 0, Bytes::Slice(&b));
        Exec::Done(WcStatus::Success)
    }

    fn exec_ud(&mut self, op: &OpView<'_>, env: &Env<'_>) -> Exec {
        let (total, src) = match prepare(env.mrs, self.pd, op.src) {
            Ok(t) => t,
            Err(s) => return Exec::Fatal(s),
        };
        let op = &op.with_src(src);
        let Some((slot, qpn, qkey)) = op.ud else {
            return Exec::Fatal(WcStatus::LocQpOpErr);
        };
        if total > u64::from(Mtu::Mtu4096.bytes()) {
            // Only this request fails; the UD QP goes on (as from SQE back to RTS).
            return Exec::Done(WcStatus::LocLenErr);
        }
        let qkey = if qkey & 0x8000_0000 != 0 {
            self.attr.qkey
        } else {
            qkey
        };
        let hdr = UdRepr {
            op: if op.opcode == WrOpcode::SendWithImm {
                MsgOp::SendImm
            } else {
                MsgOp::Send
            },
            flags: if op.solicited { MSG_SOLICITED } else { 0 },
            imm: op.imm,
            qkey,
            src_qpn: self.qpn,
        };
        let (mrs, pd, src) = (env.mrs, self.pd, op.src);
        let Some(ep) = self.ud.as_mut() else {
            return Exec::Fatal(WcStatus::LocQpOpErr);
        };
        let r = ep.send_with(
            Addr::new(slot, qpn),
            16 + total as usize,
            Wait::Never,
            |buf| {
                hdr.emit(&mut UdHeader::new_unchecked(&mut buf[..16]));
                // `buf` holds 16 + total bytes; the source was validated by `prepare`.
                src.gather_into(mrs, pd, &mut buf[16..]);
            },
        );
        match r {
            Ok(()) => Exec::Done(WcStatus::Success),
            Err(DgramError::WouldBlock) => Exec::Full,
            // A datagram to nowhere is lost silently, as on a real UD QP.
            Err(DgramError::Unreachable(_))
            | Err(DgramError::NodeDown(_))
            | Err(DgramError::Corrupt { .. }) => Exec::Done(WcStatus::Success),
            Err(_) => Exec::Fatal(WcStatus::LocQpOpErr),
        }
    }

    fn start_rnr(&mut self) {
        if self.rnr.is_none() {
            self.rnr = Some(Rnr {
                left: self.attr.rnr_retry,
                next: Instant::now() + self.rnr_delay(),
            });
        }
    }

    fn rnr_delay(&self) -> Duration {
        let v = self
            .own
            .as_ref()
            .map(|o| o.peer_rnr.load(Ordering::Relaxed))
            .unwrap_or(0);
        Duration::from_micros(fsm::rnr_timer_us(v.saturating_sub(1) as u8))
    }

    /// When the RNR wait needs the process to look again (for the completion channel).
    pub(crate) fn deadline(&self) -> Option<Instant> {
        // With rnr_retry 7 (forever) no timer can end the wait: credits arriving wake us.
        self.rnr
            .filter(|_| self.attr.rnr_retry != 7)
            .map(|r| r.next)
    }

    // -----------------------------------------------------------------------------------------
    // Progress.
    // -----------------------------------------------------------------------------------------

    /// Everything a poll does for this QP: inbound messages, acknowledgements, waiting work.
    pub(crate) fn progress(&mut self, env: &Env<'_>, cqs: &mut Cqs) {
        self.flush_bell();
        self.idle = self.idle.saturating_add(1);
        match self.state {
            QpState::Rtr | QpState::Rts => {}
            QpState::Init | QpState::Reset if self.ty == QpType::Ud => {
                self.drain_ud_dropping();
                return;
            }
            _ => return,
        }
        if self.ty == QpType::Ud {
            self.drive_rx_ud(env, cqs);
        } else {
            self.drive_rx(env, cqs);
        }
        if self.idle > 0 {
            self.publish_credits();
        } else if !self.settle_later
            && self.ty != QpType::Ud
            && cqs
                .get(self.send_cq)
                .is_some_and(|c| c.as_ref().is_some_and(|c| c.channel.is_none()))
        {
            // A receive just completed and whoever polls is waiting for it: the send side
            // (typically the SEND this very message acknowledged) can wait for the next poll
            // — once, so a stream of messages cannot hold it back, and not on a CQ with a
            // completion channel, whose waiter sleeps until a watched word moves (an ack
            // already seen will not). The send queue is not empty or there is nothing to do,
            // so that next poll comes here ([`QpSt::quiet`] is false).
            self.settle_later = true;
            return;
        }
        self.settle_later = false;
        if self.state == QpState::Rts && !self.sq.is_empty() {
            // Idle for a while (about 5-10 µs of polls) or the send queue filling up.
            let look = self.idle >= IDLE_LOOK || self.sq.len() * 2 >= self.cap.max_send_wr as usize;
            if look && self.ty != QpType::Ud && !self.peer_gone {
                if let Some(o) = &self.own {
                    // SYNC POINT qp-peer-gone (acquire): the peer's acks and NAKs before the
                    // flag are seen.
                    if o.peer_err.load(Ordering::Acquire) != 0 {
                        self.peer_gone = true;
                    }
                }
            }
            self.complete_acked(cqs, look);
            if self.exec < self.sq.len() {
                self.drive_sq(env, cqs);
                self.complete_acked(cqs, false);
            }
        }
    }

    /// True when [`QpSt::progress`] would find nothing to do: a connected QP with no send work
    /// outstanding, no doorbell or credits to publish, and nothing in its inbound ring (UD
    /// QPs always take the full look). An empty poll then costs a few loads, so a thread
    /// polling for a message sees it sooner.
    #[inline]
    fn quiet(&self) -> bool {
        if self.ty == QpType::Ud {
            return false;
        }
        if !matches!(self.state, QpState::Rtr | QpState::Rts) {
            return true; // progress returns at once in every other state
        }
        if self.bell_pending || !self.sq.is_empty() || self.published != self.rq_posted {
            return false;
        }
        match &self.peer {
            None => true,
            // SYNC POINT ring-publish (acquire, in is_drained): as in drive_rx.
            Some(p) => self.cons.is_drained(&p.inr),
        }
    }

    /// Writes our posted-receive count into the peer's block (the credits its sends wait for).
    fn publish_credits(&mut self) {
        if self.published != self.rq_posted {
            if let Some(p) = &self.peer {
                // SYNC POINT qp-credits (release): the peer may send once it sees the count.
                p.credits.store(self.rq_posted, Ordering::Release);
                self.published = self.rq_posted;
            }
        }
    }

    /// The peer's node went DOWN or restarted.
    pub(crate) fn check_peer_node(&mut self, env: &Env<'_>) {
        let Some(p) = &self.peer else { return };
        if !env
            .transport
            .peer(p.slot)
            .is_some_and(|s| s.is_live(p.generation))
        {
            self.peer_gone = true;
        }
    }

    pub(crate) fn peer_slot(&self) -> Option<(u32, u32)> {
        self.peer.as_ref().map(|p| (p.slot, p.generation))
    }

    fn note_ack(&mut self, a: u64) -> bool {
        if a > self.prod.tail() || !a.is_multiple_of(64) {
            return false;
        }
        self.acked = self.acked.max(a);
        true
    }

    /// An acknowledgement piggybacked on a message. A responder that NAKs goes to ERR and sends
    /// nothing after, so a piggybacked ack never covers a NAK'd message: work it covers
    /// completes without a look at the NAK word (which the peer may be writing).
    fn note_piggy_ack(&mut self, a: u64) -> bool {
        let ok = self.note_ack(a);
        if ok {
            self.acked_piggy = self.acked_piggy.max(a);
        }
        ok
    }

    fn complete_acked(&mut self, cqs: &mut Cqs, look: bool) {
        if self.peer_gone && !self.sq.is_empty() && self.ty != QpType::Ud {
            // Acknowledged work completes; the first unacknowledged request fails.
            self.refresh_ack();
            self.pop_completed(cqs);
            if !self.sq.is_empty() {
                self.fail(Some(0), WcStatus::RetryExcErr, cqs);
            }
            return;
        }
        if look
            && self
                .sq
                .front()
                .is_some_and(|e| matches!(e.st, SqSt::Ack { end, .. } if end > self.acked))
        {
            self.refresh_ack();
        }
        self.pop_completed(cqs);
    }

    fn refresh_ack(&mut self) {
        if let Some(o) = &self.own {
            // SYNC POINT qp-ack (acquire): the peer consumed (and NAK'd, if it did) up to here.
            let a = o.ack.load(Ordering::Acquire);
            if !self.note_ack(a) {
                self.peer_gone = true;
            }
        }
    }

    fn pop_completed(&mut self, cqs: &mut Cqs) {
        while let Some(e) = self.sq.front() {
            let st = match e.st {
                SqSt::Done(s) => s,
                SqSt::Ack { end, .. } if end <= self.acked_piggy => WcStatus::Success,
                SqSt::Ack { end, msg } if end <= self.acked => {
                    let nak = self
                        .own
                        .as_ref()
                        .map_or(0, |o| o.nak.load(Ordering::Relaxed));
                    if nak != 0 && (nak >> 8).wrapping_sub(1) == msg {
                        let st = match (nak & 0xff) as u8 {
                            NAK_INV_REQ => WcStatus::RemInvReqErr,
                            NAK_RNR => WcStatus::RnrRetryExcErr,
                            _ => WcStatus::RemOpErr,
                        };
                        self.fail(Some(0), st, cqs);
                        return;
                    }
                    WcStatus::Success
                }
                _ => break,
            };
            let e = self.sq.pop_front().expect("front exists");
            self.exec = self.exec.saturating_sub(1);
            if st != WcStatus::Success || e.signaled {
                let wc = self.wc(e.wr_id, st, wc_opcode(e.opcode), e.byte_len);
                push_cqe(cqs, self.send_cq, wc);
            }
        }
    }

    fn drive_sq(&mut self, env: &Env<'_>, cqs: &mut Cqs) {
        while self.exec < self.sq.len() && self.state == QpState::Rts {
            let i = self.exec;
            let SqSt::Pending(b) =
                std::mem::replace(&mut self.sq[i].st, SqSt::Done(WcStatus::Success))
            else {
                self.exec += 1;
                continue;
            };
            let (work, mut prog) = *b;
            let r = self.execute(&work.view(), &mut prog, env);
            match r {
                Exec::Done(s) => {
                    self.rnr = None;
                    self.sq[i].st = SqSt::Done(s);
                    self.exec += 1;
                }
                Exec::Ack { end, msg } => {
                    self.rnr = None;
                    self.sq[i].st = SqSt::Ack { end, msg };
                    self.exec += 1;
                }
                Exec::Fatal(s) => {
                    self.fail(Some(i), s, cqs);
                    return;
                }
                Exec::Full => {
                    self.sq[i].st = SqSt::Pending(Box::new((work, prog)));
                    return;
                }
                Exec::Rnr => {
                    self.sq[i].st = SqSt::Pending(Box::new((work, prog)));
                    let now = Instant::now();
                    match self.rnr {
                        None => self.start_rnr(),
                        Some(mut r) if now >= r.next => {
                            if self.attr.rnr_retry != 7 {
                                if r.left == 0 {
                                    self.fail(Some(i), WcStatus::RnrRetryExcErr, cqs);
                                    return;
                                }
                                r.left -= 1;
                            }
                            r.next = now + self.rnr_delay();
                            self.rnr = Some(r);
                        }
                        Some(_) => {}
                    }
                    return;
                }
            }
        }
    }

    /// Turns inbound messages into receive completions (RC/UC).
    fn drive_rx(&mut self, env: &Env<'_>, cqs: &mut Cqs) {
        loop {
            let Some(p) = &self.peer else { return };
            if !cq_room(cqs, self.recv_cq) {
                return;
            }
            let rec = match self.cons.peek(&p.inr) {
                Ok(Some(r)) => r,
                Ok(None) => return,
                Err(_) => {
                    self.fail_why(
                        "the peer corrupted the inbound ring",
                        WcStatus::LocQpOpErr,
                        cqs,
                    );
                    return;
                }
            };
            if rec.len < HDR {
                self.fail_why(
                    "a record shorter than a message header",
                    WcStatus::LocQpOpErr,
                    cqs,
                );
                return;
            }
            let mut hb = [0u8; HDR];
            p.inr.read(rec.pos, &mut hb);
            let Ok(h) = MsgRepr::parse(&MsgHeader::new_unchecked(&hb[..]), rec.len - HDR) else {
                self.fail_why("a malformed message header", WcStatus::LocQpOpErr, cqs);
                return;
            };
            // Where the payload lies in the inbound ring (validated by the consumer).
            let payload = rec.pos + HDR as u64;
            let frag_len = rec.len - HDR;
            if !self.note_piggy_ack(h.ack) {
                self.fail_why(
                    "an acknowledgement beyond what was sent",
                    WcStatus::LocQpOpErr,
                    cqs,
                );
                return;
            }
            self.credits = self.credits.max(h.credits);
            self.accept_fragment(&h, payload, frag_len, env, cqs);
            if self.state == QpState::Err {
                return;
            }
            let Some(p) = &self.peer else { return };
            self.cons.release(&p.inr, rec);
            self.bell_pending = true;
            self.idle = 0;
            if self.cons.drained_cached() {
                // Everything the last look at the producer index announced is taken; what came
                // since is the next poll's (which looks at the index first), so the message
                // just taken reaches its completion without one more look now.
                return;
            }
        }
    }

    fn accept_fragment(
        &mut self,
        h: &MsgRepr,
        payload: u64,
        frag_len: usize,
        env: &Env<'_>,
        cqs: &mut Cqs,
    ) {
        if h.flags & (MSG_FIRST | MSG_LAST) == MSG_FIRST | MSG_LAST
            && self.inbound.is_none()
            && self.rx_whole(h, payload, frag_len, env, cqs)
        {
            return;
        }
        if h.flags & MSG_FIRST != 0 {
            if self.inbound.is_some() {
                self.fail_why(
                    "a message started inside another",
                    WcStatus::LocQpOpErr,
                    cqs,
                );
                return;
            }
            let msg = self.msgs_in;
            self.msgs_in += 1;
            let wqe = self.rq.pop_front();
            let mut m = InMsg {
                wqe,
                op: h.op,
                imm: h.imm,
                msg_len: h.msg_len,
                status: WcStatus::Success,
            };
            match &m.wqe {
                None => {
                    // RC: the requester ran past our credits (it should not); UC: dropped.
                    self.drops += 1;
                    if self.ty == QpType::Rc {
                        self.nak(msg, NAK_RNR);
                    }
                }
                Some(w) => {
                    let carries = h.op != MsgOp::WriteImm;
                    if carries && u64::from(h.msg_len) > w.total {
                        m.status = WcStatus::LocLenErr;
                        self.nak(msg, NAK_INV_REQ);
                    } else if carries
                        && check_sges(env.mrs, self.pd, w.sges.as_slice(), true).is_err()
                    {
                        m.status = WcStatus::LocProtErr;
                        self.nak(msg, NAK_REM_OP);
                    }
                }
            }
            if m.status != WcStatus::Success {
                let w = m.wqe.take().expect("checked above");
                let wc = self.wc(w.wr_id, m.status, WcOpcode::Recv, 0);
                push_cqe(cqs, self.recv_cq, wc);
                // The NAK is published with the release that follows; then the QP is in error.
                self.inbound = None;
                self.fail_after_release(cqs);
                return;
            }
            self.inbound = Some(m);
        }
        let Some(m) = &mut self.inbound else {
            self.fail_why("a fragment without its first", WcStatus::LocQpOpErr, cqs);
            return;
        };
        if let (Some(w), true, Some(p)) = (&m.wqe, frag_len > 0, &self.peer) {
            // The entries were validated writable when the message started (the region table
            // cannot change within this call); `frag_off + frag_len <= msg_len <= total`.
            scatter(
                env.mrs,
                self.pd,
                w.sges.as_slice(),
                u64::from(h.frag_off),
                Bytes::Span(&p.inr.data, payload, frag_len),
            );
        }
        if h.flags & MSG_LAST != 0 {
            let m = self.inbound.take().expect("present");
            if let Some(w) = m.wqe {
                let peer = self.peer.as_ref().map_or((0, 0), |p| (p.qpn, p.slot));
                let imm = m.op != MsgOp::Send;
                let wc = Wc {
                    wr_id: w.wr_id,
                    status: m.status,
                    opcode: if m.op == MsgOp::WriteImm {
                        WcOpcode::RecvRdmaWithImm
                    } else {
                        WcOpcode::Recv
                    },
                    byte_len: m.msg_len,
                    imm_data: if imm { m.imm } else { 0 },
                    qp_num: self.qpn,
                    src_qp: peer.0,
                    wc_flags: if imm {
                        WcFlags::WITH_IMM
                    } else {
                        WcFlags::empty()
                    },
                    slid: peer.1 as u16,
                    ..Wc::default()
                };
                push_cqe(cqs, self.recv_cq, wc);
            }
        }
    }

    /// A whole message in one fragment, into a receive with one entry and room enough: the
    /// common case, without the reassembly state. False: take the general way.
    #[inline]
    fn rx_whole(
        &mut self,
        h: &MsgRepr,
        payload: u64,
        frag_len: usize,
        env: &Env<'_>,
        cqs: &mut Cqs,
    ) -> bool {
        let Some(w) = self.rq.front() else {
            return false;
        };
        let carries = h.op != MsgOp::WriteImm;
        if carries {
            let [one] = w.sges.as_slice() else {
                return false;
            };
            if u64::from(h.msg_len) > u64::from(one.length) {
                return false;
            }
            let Ok(Bytes::Span(dst, dst_off, _)) = resolve(env.mrs, self.pd, one, true) else {
                return false;
            };
            let Some(p) = &self.peer else { return false };
            // `dst` holds `length >= msg_len = frag_len` bytes of a writable local region.
            if Bytes::Span(&p.inr.data, payload, frag_len)
                .copy_to(dst, dst_off, false)
                .is_err()
            {
                return false;
            }
        }
        let w = self.rq.pop_front().expect("front exists");
        self.msgs_in += 1;
        let (src_qp, slid) = self
            .peer
            .as_ref()
            .map_or((0, 0), |p| (p.qpn, p.slot as u16));
        let imm = h.op != MsgOp::Send;
        push_cqe(
            cqs,
            self.recv_cq,
            Wc {
                wr_id: w.wr_id,
                opcode: if carries {
                    WcOpcode::Recv
                } else {
                    WcOpcode::RecvRdmaWithImm
                },
                byte_len: h.msg_len,
                imm_data: if imm { h.imm } else { 0 },
                qp_num: self.qpn,
                src_qp,
                wc_flags: if imm {
                    WcFlags::WITH_IMM
                } else {
                    WcFlags::empty()
                },
                slid,
                ..Wc::default()
            },
        );
        true
    }

    /// Writes a NAK for message `msg` into the requester's block; the release of the record
    /// that follows publishes it.
    fn nak(&self, msg: u64, syndrome: u8) {
        if let Some(p) = &self.peer {
            // SYNC POINT qp-ack (release, with the consumer index stored after it).
            p.nak
                .store(((msg + 1) << 8) | u64::from(syndrome), Ordering::Relaxed);
        }
    }

    /// A responder error: release the offending record (publishing the NAK), then go to ERR.
    fn fail_after_release(&mut self, cqs: &mut Cqs) {
        if let Some(p) = &self.peer {
            if let Ok(Some(rec)) = self.cons.peek(&p.inr) {
                self.cons.release(&p.inr, rec);
            }
        }
        self.ring_peer();
        self.fail_why(
            "a receive could not take a message",
            WcStatus::WrFlushErr,
            cqs,
        );
    }

    fn drain_ud_dropping(&mut self) {
        let Some(ep) = self.ud.as_mut() else { return };
        let mut n = 0;
        while ep.recv_with(Wait::Never, |_, _| Ok(())).is_ok() {
            n += 1;
        }
        self.drops += n;
    }

    fn drive_rx_ud(&mut self, env: &Env<'_>, cqs: &mut Cqs) {
        let Some(mut ep) = self.ud.take() else { return };
        loop {
            if !cq_room(cqs, self.recv_cq) {
                break;
            }
            let r = ep.recv_with(Wait::Never, |src, payload| {
                self.accept_datagram(src, payload, env, cqs);
                Ok(())
            });
            match r {
                Ok(()) => {}
                Err(DgramError::WouldBlock) => break,
                Err(DgramError::Closed(_)) => {
                    self.ud = Some(ep);
                    self.fail_why(
                        "the QP's datagram endpoint was closed (node down?)",
                        WcStatus::LocQpOpErr,
                        cqs,
                    );
                    return;
                }
                Err(_) => break,
            }
        }
        self.ud = Some(ep);
    }

    fn accept_datagram(&mut self, src: Addr, payload: &[u8], env: &Env<'_>, cqs: &mut Cqs) {
        let Ok(h) = UdHeader::new_checked(payload)
            .map_err(|_| ())
            .and_then(|p| UdRepr::parse(&p).map_err(|_| ()))
        else {
            self.drops += 1;
            return;
        };
        if h.qkey != self.attr.qkey || h.src_qpn != src.port {
            self.drops += 1; // Q_Key violation or forged source: dropped, as on hardware
            return;
        }
        let Some(w) = self.rq.pop_front() else {
            self.drops += 1;
            return;
        };
        let data = &payload[16..];
        let need = (GRH_LEN + data.len()) as u64;
        let imm = h.op == MsgOp::SendImm;
        let mut wc = Wc {
            wr_id: w.wr_id,
            opcode: WcOpcode::Recv,
            byte_len: need as u32,
            imm_data: if imm { h.imm } else { 0 },
            qp_num: self.qpn,
            src_qp: src.port,
            wc_flags: if imm {
                WcFlags::GRH | WcFlags::WITH_IMM
            } else {
                WcFlags::GRH
            },
            slid: src.node as u16,
            ..Wc::default()
        };
        if need > w.total {
            wc.status = WcStatus::LocLenErr;
        } else if check_sges(env.mrs, self.pd, w.sges.as_slice(), true).is_err() {
            wc.status = WcStatus::LocProtErr;
        } else {
            let mut grh = [0u8; GRH_LEN];
            grh[0] = 0x60; // IPv6-style version nibble, as a RoCE GRH
            grh[8] = 0xfe;
            grh[9] = 0x80; // source GID fe80::<slot>
            grh[20..24].copy_from_slice(&src.node.to_be_bytes());
            // The entries were validated writable and hold at least `need` bytes.
            let sges = w.sges.as_slice();
            scatter(env.mrs, self.pd, sges, 0, Bytes::Slice(&grh));
            scatter(env.mrs, self.pd, sges, GRH_LEN as u64, Bytes::Slice(data));
        }
        push_cqe(cqs, self.recv_cq, wc);
    }

    // -----------------------------------------------------------------------------------------
    // State changes.
    // -----------------------------------------------------------------------------------------

    pub(crate) fn modify(
        &mut self,
        attr: &QpAttr,
        mask: QpAttrMask,
        env: &Env<'_>,
        cqs: &mut Cqs,
    ) -> Result<(), VerbsError> {
        let next = fsm::check(self.ty, self.state, attr, mask).map_err(VerbsError::inval)?;
        if next == QpState::Rtr && self.ty != QpType::Ud {
            self.connect(attr, env)?;
        }
        self.apply_attrs(attr, mask);
        match next {
            QpState::Err => {
                self.fail_why("moved to ERR by modify", WcStatus::WrFlushErr, cqs);
            }
            QpState::Reset => self.reset(env),
            _ => {}
        }
        if let Some(o) = &self.own {
            o.access
                // SYNC POINT qp-access (release): requesters read the flags before each
                // one-sided operation.
                .store(self.attr.qp_access_flags.bits(), Ordering::Release);
        }
        self.state = next;
        Ok(())
    }

    fn apply_attrs(&mut self, a: &QpAttr, m: QpAttrMask) {
        let t = &mut self.attr;
        let set = |f: QpAttrMask| m.contains(f);
        if set(QpAttrMask::ACCESS_FLAGS) {
            t.qp_access_flags = a.qp_access_flags;
        }
        if set(QpAttrMask::PKEY_INDEX) {
            t.pkey_index = a.pkey_index;
        }
        if set(QpAttrMask::PORT) {
            t.port_num = a.port_num;
        }
        if set(QpAttrMask::QKEY) {
            t.qkey = a.qkey;
        }
        if set(QpAttrMask::AV) {
            t.ah_attr = a.ah_attr;
        }
        if set(QpAttrMask::PATH_MTU) {
            t.path_mtu = a.path_mtu;
        }
        if set(QpAttrMask::TIMEOUT) {
            t.timeout = a.timeout;
        }
        if set(QpAttrMask::RETRY_CNT) {
            t.retry_cnt = a.retry_cnt;
        }
        if set(QpAttrMask::RNR_RETRY) {
            t.rnr_retry = a.rnr_retry;
        }
        if set(QpAttrMask::RQ_PSN) {
            t.rq_psn = a.rq_psn;
        }
        if set(QpAttrMask::SQ_PSN) {
            t.sq_psn = a.sq_psn;
        }
        if set(QpAttrMask::MAX_QP_RD_ATOMIC) {
            t.max_rd_atomic = a.max_rd_atomic;
        }
        if set(QpAttrMask::MAX_DEST_RD_ATOMIC) {
            t.max_dest_rd_atomic = a.max_dest_rd_atomic;
        }
        if set(QpAttrMask::MIN_RNR_TIMER) {
            t.min_rnr_timer = a.min_rnr_timer;
            if let Some(p) = &self.peer {
                p.rnr
                    .store(u32::from(a.min_rnr_timer) + 1, Ordering::Relaxed);
            }
        }
        if set(QpAttrMask::DEST_QPN) {
            t.dest_qp_num = a.dest_qp_num;
        }
    }

    /// INIT → RTR of an RC/UC QP: find the peer's block through the supervisor and wire the
    /// two rings.
    fn connect(&mut self, a: &QpAttr, env: &Env<'_>) -> Result<(), VerbsError> {
        let fabric = env.node.fabric();
        let dest_slot = u32::from(a.ah_attr.dlid);
        if dest_slot == 0 || dest_slot > fabric.nodes() {
            return Err(VerbsError::inval(format!(
                "LID {dest_slot} is no node of fabric '{}' (1..={})",
                fabric.name(),
                fabric.nodes()
            )));
        }
        let (resp, _) = fabric.call(&Request::Verbs(VerbsRequest::ConnectQp {
            slot: env.node.slot(),
            qpn: self.qpn,
            dest_slot,
            dest_qpn: a.dest_qp_num,
        }))?;
        let Response::Verbs(VerbsResponse::QpConnected {
            block_off,
            generation,
        }) = resp
        else {
            return Err(FabricError::Protocol(format!("{resp:?}")).into());
        };
        let pw = fabric.window(dest_slot)?;
        let mut h = [0u8; 64];
        pw.read(block_off, &mut h)?;
        let r =
            QpBlockRepr::parse(&QpBlockHeader::new_unchecked(&h[..])).map_err(FabricError::from)?;
        if r.qpn != a.dest_qp_num || r.slot != dest_slot || r.qp_type != self.ty as u32 {
            return Err(FabricError::Protocol("peer QP block does not match".into()).into());
        }
        pw.check(block_off, QpBlockRepr::footprint(r.ring_len), 64)?;
        let own = self
            .own
            .as_ref()
            .ok_or_else(|| VerbsError::inval("QP has no block"))?;
        let at32 = |o: usize| Word32::at(&pw, block_off + o as u64);
        let at64 = |o: usize| Word64::at(&pw, block_off + o as u64);
        let peer = PeerLink {
            slot: dest_slot,
            qpn: a.dest_qp_num,
            generation,
            credits: at64(QP_CREDITS_OFF)?,
            nak: at64(QP_NAK_OFF)?,
            peer_err: at32(QP_PEER_ERR_OFF)?,
            rnr: at32(QP_PEER_RNR_OFF)?,
            access: at32(QP_ACCESS_OFF)?,
            ev_bell: Word32::at(&pw, r.event_off + EV_BELL_OFF as u64)?,
            ev_armed: Word32::at(&pw, r.event_off + EV_ARMED_OFF as u64)?,
            out: QRing {
                tail: at64(QP_TAIL_OFF)?,
                head: own.ack.clone(),
                data: {
                    let d = Span::new(&pw, block_off + QP_RING_OFF, r.ring_len.into())?;
                    d.populate(true);
                    d
                },
            },
            inr: QRing {
                tail: own.tail.clone(),
                head: at64(QP_ACK_OFF)?,
                data: own.data.clone(),
            },
        };
        peer.rnr
            .store(u32::from(a.min_rnr_timer) + 1, Ordering::Relaxed);
        // SYNC POINT qp-credits (release): receives posted before the connection count.
        peer.credits.store(self.rq_posted, Ordering::Release);
        self.published = self.rq_posted;
        self.peer = Some(peer);
        self.prod = Producer::new();
        self.cons = Consumer::new();
        self.peer_gone = false;
        Ok(())
    }

    fn reset(&mut self, env: &Env<'_>) {
        if let Some(p) = self.peer.take() {
            // SYNC POINT qp-peer-gone (release): as in `fail`.
            p.peer_err.store(1, Ordering::Release);
        }
        self.sq.clear();
        self.rq.clear();
        self.exec = 0;
        self.inbound = None;
        self.rnr = None;
        self.rq_posted = 0;
        self.credits = 0;
        self.used_credits = 0;
        self.acked = 0;
        self.msgs_in = 0;
        self.msgs_out = 0;
        self.peer_gone = false;
        self.bell_pending = false;
        self.idle = 0;
        self.acked_piggy = 0;
        self.published = 0;
        self.remote.clear();
        self.prod = Producer::new();
        self.cons = Consumer::new();
        if let Some(o) = &self.own {
            let _ = env.win.zero(o.off + QP_ACK_OFF as u64, 64);
            // SYNC POINT ring-publish (release): a reset ring has published nothing.
            o.tail.store(0, Ordering::Release);
        }
        self.attr = QpAttr {
            cap: self.cap,
            ..QpAttr::default()
        };
    }

    /// What the completion channel watches for this QP.
    pub(crate) fn watches(&self, out: &mut Vec<Watch>) {
        if let Some(o) = &self.own {
            out.push(Watch::Moved {
                word: o.tail.clone(),
                // SYNC POINT ring-publish (acquire, watched): what the peer published so far.
                seen: o.tail.load(Ordering::Acquire),
            });
            // SYNC POINT qp-ack (acquire, watched).
            let ack = o.ack.load(Ordering::Acquire);
            // Work waiting for an acknowledgement the peer already gave (polls look at the ack
            // word only every so often, see `complete_acked`) must wake the channel at once:
            // compare with what this QP has taken in, not with the word as it is now, or the
            // watcher sleeps through an ack that moved before arming.
            let waiting = self
                .sq
                .front()
                .is_some_and(|e| matches!(e.st, SqSt::Ack { end, .. } if end > self.acked));
            out.push(Watch::Moved {
                word: o.ack.clone(),
                seen: if waiting { ack.min(self.acked) } else { ack },
            });
            out.push(Watch::Flag(o.peer_err.clone()));
            if self.rnr.is_some() {
                out.push(Watch::Moved {
                    word: o.credits.clone(),
                    // SYNC POINT qp-credits (acquire, watched).
                    seen: o.credits.load(Ordering::Acquire),
                });
            }
        }
        if let Some(ep) = &self.ud {
            let (bell, armed) = ep.doorbell_words();
            // Senders ring a UD QP's endpoint only while it is armed: keep it armed while a
            // channel watches (each datagram then costs its sender one wake-up call).
            armed.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            // SYNC POINT qp-bell (watch): the doorbell value peers bump after publishing.
            let seen = bell.load(Ordering::Acquire);
            out.push(Watch::Bell { word: bell, seen });
        }
    }

    pub(crate) fn destroy(&mut self, env: &Env<'_>) {
        if let Some(p) = self.peer.take() {
            // SYNC POINT qp-peer-gone (release): our last acks and NAKs are visible before the flag.
            p.peer_err.store(1, Ordering::Release);
            crate::sync::ring(&p.ev_bell);
        }
        if self.own.is_some() {
            let _ = env
                .node
                .fabric()
                .call(&Request::Verbs(VerbsRequest::DestroyQp {
                    slot: env.node.slot(),
                    qpn: self.qpn,
                }));
        }
    }

    pub(crate) fn query_cap(&self) -> QpCap {
        self.cap
    }
}

/// The bytes a SEND of `len` bytes takes in the ring from its record's start (record header,
/// message header, payload).
#[inline(always)]
pub(crate) fn send_record_len(len: usize) -> usize {
    crate::wire::RECORD_HEADER_LEN as usize + HDR + len
}

/// Where a QP's last fast-path RDMA_WRITE went: a WRITE to the same `(rkey, remote_addr)`
/// prefetches `line` for writing before anything else. A hint only: it may be stale (the
/// region gone), so it is only ever prefetched (which never faults), never dereferenced.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WriteHint {
    pub(crate) rkey: u32,
    pub(crate) remote_addr: u64,
    pub(crate) line: *const u8,
}

impl WriteHint {
    pub(crate) const NONE: WriteHint = WriteHint {
        rkey: 0,
        remote_addr: u64::MAX,
        line: std::ptr::null(),
    };
}

/// The address of the last byte an RDMA_WRITE of `len` bytes at `remote_addr` lands on, in a
/// region mapped at `base` — for a prefetch only: computed with wrapping arithmetic, it may
/// point anywhere (a prefetch does not fault) and must not be dereferenced.
#[inline(always)]
pub(crate) fn write_end(mem: &dyn RemoteRegion, remote_addr: u64, len: usize) -> *const u8 {
    mem.hint_addr(0)
        .wrapping_add((remote_addr as usize).wrapping_add(len).wrapping_sub(1))
}

fn byte_len_of(wr: &SendWr<'_>) -> u32 {
    match wr.opcode {
        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => 8,
        _ if wr.send_flags.contains(SendFlags::INLINE) && !wr.inline_data.is_empty() => {
            wr.inline_data.len() as u32
        }
        _ => wr.sg_list.iter().map(|s| s.length).sum(),
    }
}

fn wc_opcode(op: WrOpcode) -> WcOpcode {
    match op {
        WrOpcode::Send | WrOpcode::SendWithImm => WcOpcode::Send,
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
        WrOpcode::RdmaRead => WcOpcode::RdmaRead,
        WrOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
        WrOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
    }
}

// ---------------------------------------------------------------------------------------------
// The context.
// ---------------------------------------------------------------------------------------------

/// What a QP is made of (checked by the caller).
pub(crate) struct QpSpec {
    pub(crate) pd: u32,
    pub(crate) ty: QpType,
    pub(crate) send_cq: usize,
    pub(crate) recv_cq: usize,
    pub(crate) cap: QpCap,
    pub(crate) sig_all: bool,
    pub(crate) ring_len: u32,
}

/// A device context's shared state: its node, its window, its engine.
pub(crate) struct Ctx {
    pub(crate) node: Node,
    /// How the context reaches peers' memory and learns whether they live.
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) win: Arc<Region>,
    pub(crate) event_off: u64,
    pub(crate) eng: RefCell<Engine>,
}

#[derive(Default)]
pub(crate) struct Engine {
    pub(crate) next_pd: u32,
    pub(crate) mrs: MrTable,
    pub(crate) cqs: Cqs,
    pub(crate) qps: Vec<Option<QpSt>>,
    epoch: u32,
}

impl Ctx {
    pub(crate) fn env<'a>(&'a self, mrs: &'a MrTable) -> Env<'a> {
        Env {
            node: &self.node,
            transport: &*self.transport,
            win: &self.win,
            mrs,
        }
    }

    /// Creates a QP's engine state (and, for RC/UC, its block through the supervisor).
    pub(crate) fn create_qp(&self, spec: QpSpec) -> Result<(usize, u32), VerbsError> {
        let QpSpec {
            pd,
            ty,
            send_cq,
            recv_cq,
            cap,
            sig_all,
            ring_len,
        } = spec;
        let (qpn, own, ud) = match ty {
            QpType::Ud => {
                let ep = self
                    .node
                    .bind(0)
                    .map_err(|e| VerbsError::inval(e.to_string()))?;
                (ep.local_addr().port, None, Some(ep))
            }
            _ => {
                let (resp, _) =
                    self.node
                        .fabric()
                        .call(&Request::Verbs(VerbsRequest::CreateQp {
                            slot: self.node.slot(),
                            pd,
                            qp_type: ty as u32,
                            ring_len,
                            event_off: self.event_off,
                        }))?;
                let Response::Verbs(VerbsResponse::QpCreated { qpn, block_off }) = resp else {
                    return Err(FabricError::Protocol(format!("{resp:?}")).into());
                };
                let w = &self.win;
                w.check(block_off, QpBlockRepr::footprint(ring_len), 64)?;
                let own = OwnBlock {
                    off: block_off,
                    ack: Word64::at(w, block_off + QP_ACK_OFF as u64)?,
                    credits: Word64::at(w, block_off + QP_CREDITS_OFF as u64)?,
                    nak: Word64::at(w, block_off + QP_NAK_OFF as u64)?,
                    peer_err: Word32::at(w, block_off + QP_PEER_ERR_OFF as u64)?,
                    peer_rnr: Word32::at(w, block_off + QP_PEER_RNR_OFF as u64)?,
                    access: Word32::at(w, block_off + QP_ACCESS_OFF as u64)?,
                    tail: Word64::at(w, block_off + QP_TAIL_OFF as u64)?,
                    data: {
                        let d = Span::new(w, block_off + QP_RING_OFF, ring_len.into())?;
                        d.populate(true);
                        d
                    },
                };
                (qpn, Some(own), None)
            }
        };
        let st = QpSt {
            write_hint: WriteHint::NONE,
            send_hint: [std::ptr::null(); 2],
            qpn,
            ty,
            state: QpState::Reset,
            pd,
            send_cq,
            recv_cq,
            sig_all,
            cap,
            attr: QpAttr {
                cap,
                ..QpAttr::default()
            },
            own,
            peer: None,
            prod: Producer::new(),
            cons: Consumer::new(),
            sq: VecDeque::new(),
            exec: 0,
            rq: VecDeque::new(),
            rq_posted: 0,
            credits: 0,
            used_credits: 0,
            acked: 0,
            rnr: None,
            inbound: None,
            msgs_in: 0,
            msgs_out: 0,
            bell_pending: false,
            peer_gone: false,
            ud,
            remote: Vec::new(),
            drops: 0,
            error: None,
            idle: 0,
            settle_later: false,
            acked_piggy: 0,
            published: 0,
        };
        let mut eng = self.eng.borrow_mut();
        let id = match eng.qps.iter().position(|q| q.is_none()) {
            Some(i) => {
                eng.qps[i] = Some(st);
                i
            }
            None => {
                eng.qps.push(Some(st));
                eng.qps.len() - 1
            }
        };
        for cq in [send_cq, recv_cq] {
            if let Some(Some(c)) = eng.cqs.get_mut(cq) {
                if !c.qps.contains(&id) {
                    c.qps.push(id);
                }
            }
        }
        Ok((id, qpn))
    }

    /// Polls completion queue `cq`: up to `out.len()` completions; when it holds none, its QPs
    /// are moved along first (so completions already there come back at once).
    pub(crate) fn poll(&self, cq: usize, out: &mut [Wc]) -> usize {
        let mut eng = self.eng.borrow_mut();
        let eng = &mut *eng;
        let need = eng
            .cqs
            .get(cq)
            .and_then(|c| c.as_ref())
            .map_or(0, |c| c.entries.len());
        if need == 0 && !self.all_quiet(eng, cq) {
            self.progress_cq(eng, cq);
        }
        let Some(Some(c)) = eng.cqs.get_mut(cq) else {
            return 0;
        };
        let mut n = 0;
        while n < out.len() {
            let Some(wc) = c.entries.pop_front() else {
                break;
            };
            out[n] = wc;
            n += 1;
        }
        n
    }

    /// Nothing can have happened for `cq`: the fabric's epoch has not moved (no node came or
    /// went) and every QP on it is [`QpSt::quiet`].
    #[inline]
    fn all_quiet(&self, eng: &Engine, cq: usize) -> bool {
        if self.node.fabric().epoch().load(Ordering::Relaxed) != eng.epoch {
            return false;
        }
        let Some(Some(c)) = eng.cqs.get(cq) else {
            return false;
        };
        c.qps
            .iter()
            .all(|&id| matches!(eng.qps.get(id), Some(Some(q)) if q.quiet()))
    }

    pub(crate) fn progress_cq(&self, eng: &mut Engine, cq: usize) {
        let epoch = self.node.fabric().epoch().load(Ordering::Relaxed);
        let epoch_moved = epoch != eng.epoch;
        eng.epoch = epoch;
        let env = Env {
            node: &self.node,
            transport: &*self.transport,
            win: &self.win,
            mrs: &eng.mrs,
        };
        let own_ok = !epoch_moved || self.node.check_current().is_ok();
        for k in 0.. {
            let Some(id) = eng
                .cqs
                .get(cq)
                .and_then(|c| c.as_ref())
                .and_then(|c| c.qps.get(k).copied())
            else {
                break;
            };
            let Some(Some(q)) = eng.qps.get_mut(id) else {
                continue;
            };
            if epoch_moved {
                if !own_ok && q.state != QpState::Err && q.state != QpState::Reset {
                    q.fail_why(
                        "this node went DOWN or restarted",
                        WcStatus::WrFlushErr,
                        &mut eng.cqs,
                    );
                    continue;
                }
                q.check_peer_node(&env);
            }
            q.progress(&env, &mut eng.cqs);
        }
    }
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("node", &self.node.slot())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region_mr(pd: u32, len: usize, access: AccessFlags) -> (LocalMr, Arc<Region>) {
        let r = Arc::new(Region::create("bp-test-mr", len).unwrap());
        let mr = LocalMr {
            pd,
            access,
            data: Span::whole(&r),
        };
        (mr, r)
    }

    #[test]
    fn the_region_table_finds_keys_and_forgets_removed_ones_even_when_cached() {
        let mut t = MrTable::default();
        let (a, _) = region_mr(1, 4096, AccessFlags::LOCAL_WRITE);
        let (b, _) = region_mr(1, 8192, AccessFlags::empty());
        t.insert(7, a);
        t.insert(9, b);
        assert_eq!(t.get(7).unwrap().data.len(), 4096);
        assert_eq!(t.get(9).unwrap().data.len(), 8192);
        assert_eq!(t.get(9).unwrap().data.len(), 8192, "cached");
        t.remove(9);
        assert!(
            t.get(9).is_none(),
            "a removed key must not survive in the cache"
        );
        assert!(t.get(0).is_none());
        let (c, _) = region_mr(2, 4096, AccessFlags::empty());
        t.insert(11, c);
        assert_eq!(t.get(11).unwrap().pd, 2, "slots are reused");
    }

    #[test]
    fn scatter_gather_entries_are_checked_for_key_domain_bounds_and_write_access() {
        let mut t = MrTable::default();
        let (rw, _) = region_mr(1, 4096, AccessFlags::LOCAL_WRITE);
        let (ro, _) = region_mr(1, 4096, AccessFlags::empty());
        t.insert(1, rw);
        t.insert(2, ro);
        let sge = |lkey, addr, length| Sge { addr, length, lkey };
        assert!(resolve(&t, 1, &sge(1, 4000, 96), true).is_ok());
        assert_eq!(
            resolve(&t, 1, &sge(1, 4000, 97), true).err(),
            Some(WcStatus::LocProtErr)
        );
        assert_eq!(
            resolve(&t, 1, &sge(1, u64::MAX, 2), false).err(),
            Some(WcStatus::LocProtErr)
        );
        assert_eq!(
            resolve(&t, 1, &sge(3, 0, 1), false).err(),
            Some(WcStatus::LocProtErr)
        );
        assert_eq!(
            resolve(&t, 2, &sge(1, 0, 1), false).err(),
            Some(WcStatus::LocProtErr),
            "other PD"
        );
        assert!(resolve(&t, 1, &sge(2, 0, 8), false).is_ok());
        assert_eq!(
            resolve(&t, 1, &sge(2, 0, 8), true).err(),
            Some(WcStatus::LocProtErr)
        );
        assert_eq!(
            check_sges(&t, 1, &[sge(1, 0, 10), sge(2, 0, 5)], false),
            Ok(15)
        );
    }

    #[test]
    fn gather_and_scatter_walk_several_entries_from_any_message_offset() {
        let mut t = MrTable::default();
        let (a, ra) = region_mr(1, 4096, AccessFlags::LOCAL_WRITE);
        t.insert(1, a);
        ra.write(0, b"0123456789abcdef").unwrap();
        let sges = [
            Sge {
                addr: 0,
                length: 4,
                lkey: 1,
            },
            Sge {
                addr: 8,
                length: 8,
                lkey: 1,
            },
        ];
        let mut out = [0u8; 10];
        // Offset 2 + 10 = 12 bytes, all inside the entries.
        let (b, rb) = region_mr(1, 64, AccessFlags::LOCAL_WRITE);
        Src::Sges(&sges).gather_to(&t, 1, 2, 10, &b.data, 3);
        rb.read(3, &mut out).unwrap();
        assert_eq!(&out, b"2389abcdef");
        let mut first = [0u8; 6];
        Src::Sges(&sges).gather_into(&t, 1, &mut first);
        assert_eq!(&first, b"012389");
        scatter(&t, 1, &sges, 1, Bytes::Slice(b"XYZUVW"));
        let mut back = [0u8; 16];
        ra.read(0, &mut back).unwrap();
        assert_eq!(
            &back,
            b"0XYZ4567UVW"[..]
                .iter()
                .chain(b"bcdef")
                .copied()
                .collect::<Vec<_>>()
                .as_slice()
        );
    }

    #[test]
    fn an_ordered_write_lands_whole_for_every_length() {
        let mut t = MrTable::default();
        let (a, ra) = region_mr(1, 8192, AccessFlags::LOCAL_WRITE);
        t.insert(1, a);
        let (d, rd) = region_mr(1, 8192, AccessFlags::LOCAL_WRITE);
        for n in [0usize, 1, 7, 8, 9, 64, 4096] {
            let src: Vec<u8> = (0..n).map(|i| i as u8 ^ 0x5a).collect();
            ra.write(100, &src).unwrap();
            let one = [Sge {
                addr: 100,
                length: n as u32,
                lkey: 1,
            }];
            let two = [
                Sge {
                    addr: 100,
                    length: (n / 2) as u32,
                    lkey: 1,
                },
                Sge {
                    addr: 100 + (n / 2) as u64,
                    length: (n - n / 2) as u32,
                    lkey: 1,
                },
            ];
            let (_, resolved) = prepare(&t, 1, Src::Sges(&one)).unwrap();
            for (how, s) in [
                ("inline", Src::Inline(&src)),
                ("one range", resolved),
                ("two entries", Src::Sges(&two)),
            ] {
                d.data.fill(0, 8192, 0).unwrap();
                ordered_write(&s, &t, 1, &d.data, 5, n);
                let mut got = vec![0u8; n];
                rd.read(5, &mut got).unwrap();
                assert_eq!(got, src, "{n} bytes from {how}");
            }
        }
    }

    #[test]
    fn small_sge_lists_stay_inline_and_large_ones_spill() {
        let s = [Sge::default(); 3];
        assert!(matches!(SgeList::new(&s[..2]), SgeList::Small(_, 2)));
        assert_eq!(SgeList::new(&s[..1]).as_slice().len(), 1);
        assert!(matches!(SgeList::new(&s), SgeList::Heap(_)));
        assert_eq!(SgeList::new(&s).as_slice().len(), 3);
    }
}
