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
//!
//! Where things are: this file holds the QP's types (`QpEngine` and what it is made of, the one
//! operation type `Op`) and the small helpers every part uses; [`memory`] the region tables and
//! the gather/scatter copies; [`cq`] completion queues; [`fast`] the post-time fast paths;
//! [`requester`] the general posting and execution of send requests; [`reliability`] acks,
//! credits, RNR and NAKs on the requester side; [`responder`] inbound messages into receives;
//! [`ud`] datagram QPs; [`state`] progress, `modify`, connect, reset, watches, destroy;
//! [`context`] the context (QP creation, CQ polling).
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
use crate::fabric::Node;
use crate::mem::{MemError, Region, Span, Word32};
use crate::sync::{fence, Ordering};
use crate::transport::shm::ShmTransport;
use crate::transport::{
    CopyKind, GrantRequest, QpChannels, QpHome, QpLink, RecvChannel, RemoteRegion, RingError,
    SendChannel, Transport,
};
use crate::transport::{Fetch, FetchOp, WatchRoles};
use crate::wire::verbs::*;

/// Payload bytes per message fragment (one ring record).
pub(crate) const FRAG: usize = 64 * 1024;
const HDR: usize = 32;
/// Polls without inbound traffic before a QP reads the words its peer writes into its block.
const IDLE_LOOK: u32 = 512;
/// Remote regions a QP keeps mapped.
const REMOTE_CACHE: usize = 64;

mod context;
mod cq;
mod fast;
mod memory;
mod reliability;
mod requester;
mod responder;
mod state;
mod ud;

pub(crate) use context::{Ctx, Engine, QpSpec};
use cq::*;
pub(crate) use cq::{holds_completions, CqRing, CqState, Cqs};
use memory::*;
pub(crate) use memory::{LocalMr, MrTable};
use reliability::Reliability;

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

impl RqEntry {
    fn new(wr: &RecvWr<'_>) -> Self {
        Self {
            wr_id: wr.wr_id,
            sges: SgeList::new(wr.sg_list),
            total: wr.sg_list.iter().map(|s| u64::from(s.length)).sum(),
        }
    }
}

/// The earlier of two optional deadlines (None: no deadline).
pub(crate) fn earlier(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Credits an RC QP on a shared receive queue publishes: more than any sender will use, so its
/// peer never waits for them. A message that finds the SRQ empty waits in the QP's inbound
/// ring (in order, as after an RNR NAK retried without limit) until a receive is posted.
pub(crate) const SRQ_CREDITS: u64 = 1 << 62;

/// A shared receive queue (`ibv_srq`): receives that any QP attached to it takes, in order.
#[derive(Debug)]
pub(crate) struct SrqEngine {
    /// The PD its receive buffers are checked against.
    pub(crate) pd: u32,
    entries: VecDeque<RqEntry>,
    pub(crate) max_wr: u32,
    pub(crate) max_sge: u32,
}

impl SrqEngine {
    pub(crate) fn new(pd: u32, max_wr: u32, max_sge: u32) -> Self {
        Self {
            pd,
            entries: VecDeque::new(),
            max_wr,
            max_sge,
        }
    }

    /// Receives waiting.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Posts receive work requests (`ibv_post_srq_recv`).
    pub(crate) fn post(&mut self, wrs: &[RecvWr<'_>]) -> Result<(), VerbsError> {
        for (i, wr) in wrs.iter().enumerate() {
            let bad = |e: VerbsError| VerbsError::Post {
                bad_wr: i,
                source: Box::new(e),
            };
            if wr.sg_list.len() > self.max_sge as usize {
                return Err(bad(VerbsError::inval(format!(
                    "{} scatter/gather entries exceed the SRQ's max_sge {}",
                    wr.sg_list.len(),
                    self.max_sge
                ))));
            }
            if self.entries.len() >= self.max_wr as usize {
                return Err(bad(VerbsError::QueueFull(format!(
                    "{} receive work requests outstanding (the SRQ's max_wr)",
                    self.entries.len()
                ))));
            }
            self.entries.push_back(RqEntry::new(wr));
        }
        Ok(())
    }

    fn pop_front(&mut self) -> Option<RqEntry> {
        self.entries.pop_front()
    }
}

/// Where a QP's receives wait: its own receive queue, or a shared one.
#[derive(Debug)]
enum RecvQueue {
    Own(VecDeque<RqEntry>),
    Shared(Rc<RefCell<SrqEngine>>),
}

impl RecvQueue {
    fn pop_front(&mut self) -> Option<RqEntry> {
        match self {
            Self::Own(q) => q.pop_front(),
            Self::Shared(s) => s.borrow_mut().pop_front(),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Self::Own(q) => q.is_empty(),
            Self::Shared(s) => s.borrow().entries.is_empty(),
        }
    }

    /// The next receive's single scatter/gather entry: `None` with none waiting,
    /// `Some(None)` when it has more or fewer than one entry.
    fn front_single(&self) -> Option<Option<Sge>> {
        let one = |w: &RqEntry| match w.sges.as_slice() {
            [one] => Some(*one),
            _ => None,
        };
        match self {
            Self::Own(q) => q.front().map(one),
            Self::Shared(s) => s.borrow().entries.front().map(one),
        }
    }

    /// The PD the receives' buffers are checked against (`qp_pd` for the QP's own).
    fn pd(&self, qp_pd: u32) -> u32 {
        match self {
            Self::Own(_) => qp_pd,
            Self::Shared(s) => s.borrow().pd,
        }
    }

    fn is_shared(&self) -> bool {
        matches!(self, Self::Shared(_))
    }
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
    /// `IBV_SEND_FENCE`: runs only once the READs and atomics before it completed.
    fence: bool,
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
            fence: wr.send_flags.contains(SendFlags::FENCE),
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
            fence: self.fence,
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

/// Where a send-queue entry is: waiting to run (or part-way through a long message), run and
/// waiting for the peer's acknowledgement up to ring position `end`, or done with a status.
#[derive(Debug)]
enum SendPhase {
    Pending(Box<(Work, Progress)>),
    Ack {
        end: u64,
        msg: u64,
    },
    Done(WcStatus),
    /// An RDMA WRITE a transport carries out later (a region on another host): done when
    /// the region says its puts up to the ticket landed.
    Placed(Rc<RemoteMr>, u64),
    /// A READ or atomic on a region of another host, its requests out: done once their
    /// answers are taken (in order, into the request's local buffers).
    Fetching(Box<Fetching>),
}

/// A READ or atomic waiting for its answers ([`SendPhase::Fetching`]).
#[derive(Debug)]
struct Fetching {
    m: Rc<RemoteMr>,
    /// The request (its local buffers).
    work: Work,
    /// Its requests' ids: `first..=last`, answers taken up to `next` (excluded).
    first: u64,
    next: u64,
    last: u64,
}

#[derive(Debug)]
struct SqEntry {
    wr_id: u64,
    opcode: WrOpcode,
    signaled: bool,
    byte_len: u32,
    st: SendPhase,
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
    /// Executed; complete once the region's puts up to the ticket landed.
    Placed(Rc<RemoteMr>, u64),
    /// A READ or atomic whose requests `first..=last` went out ([`SendPhase::Fetching`]).
    Fetching(Rc<RemoteMr>, u64, u64),
}

/// A QP's home (its end of the connection), through the transport.
type Home = <ShmTransport as QpChannels>::Home;

struct PeerLink {
    slot: u32,
    qpn: u32,
    generation: u32,
    /// The peer's control words and doorbell, used only through `QpLink`.
    link: <ShmTransport as QpChannels>::Link,
    /// The message channel to the peer, used only through `SendChannel`.
    outbound: <ShmTransport as QpChannels>::QpTx,
    /// The message channel from the peer, used only through `RecvChannel`.
    inbound: <ShmTransport as QpChannels>::QpRx,
}

#[derive(Debug)]
struct InMsg {
    wqe: Option<RqEntry>,
    op: MsgOp,
    imm: u32,
    msg_len: u32,
    status: WcStatus,
}

/// A queue pair as the engine runs it: its attributes and state, its send and receive
/// queues, its ring to the peer (`outbound`) and from it (`inbound`), credits, acks and RNR.
pub(crate) struct QpEngine {
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
    own: Option<Home>,
    peer: Option<PeerLink>,
    sq: VecDeque<SqEntry>,
    exec: usize,
    rq: RecvQueue,
    rq_posted: u64,
    credits: u64,
    used_credits: u64,
    /// Acknowledgements, NAKs and RNR waits (sans-IO; see `reliability.rs`).
    rel: Reliability,
    inbound: Option<InMsg>,
    msgs_in: u64,
    msgs_out: u64,
    bell_pending: bool,
    /// A message was delivered since the last progress by the pair's pump
    /// ([`QpEngine::deliver_ahead`]): that progress treats it as one its `drive_rx` took.
    took_ahead: bool,
    peer_gone: bool,
    /// When this QP first saw its peer gone with work unacknowledged: that work completes
    /// with RETRY_EXC_ERR once the retries a NIC would make are spent (`fsm::retry_wait`).
    gone_since: Option<Instant>,
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
    /// Posted-receive count last written into the peer's block.
    published: u64,
    /// Send-queue entries in [`SendPhase::Fetching`] (a poll looks for answers only then).
    fetching: u32,
}

/// What every QP operation needs from its context.
pub(crate) struct CtxParts<'a> {
    pub(crate) node: &'a Node,
    pub(crate) transport: &'a dyn Transport,
    /// Queue pairs' connections.
    pub(crate) links: &'a ShmTransport,
    pub(crate) mrs: &'a MrTable,
}

impl QpEngine {
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

    /// The position of the outbound channel after everything sent (0 unconnected).
    fn sent(&self) -> u64 {
        self.peer.as_ref().map_or(0, |p| p.outbound.sent())
    }

    /// Rings the peer context's bell if its channel sleeps (after our stores are visible).
    fn ring_peer(&mut self) {
        self.bell_pending = false;
        if let Some(p) = &self.peer {
            p.link.wake_peer();
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
        self.fetching = 0;
        for (i, e) in entries.into_iter().enumerate() {
            if let SendPhase::Fetching(f) = &e.st {
                // Its answers, if they come, are nobody's.
                f.m.mem.abandon(f.next, f.last);
            }
            let st = match e.st {
                SendPhase::Done(s) => s,
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
        self.rel.rnr_clear();
        if self.state != QpState::Err {
            self.state = QpState::Err;
            if let Some(p) = &self.peer {
                p.link.publish_gone();
                if !self.peer_gone {
                    p.link.ring_peer();
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
        // A shared receive queue's receives are not this QP's: they stay for the others.
        let own = match &mut self.rq {
            RecvQueue::Own(q) => std::mem::take(q),
            RecvQueue::Shared(_) => VecDeque::new(),
        };
        for w in own {
            let wc = self.wc(w.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0);
            push_cqe(cqs, self.recv_cq, wc);
        }
    }

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

/// The address of the last byte an RDMA_WRITE of `len` bytes at `remote_addr` lands on, in the
/// region `data` maps — for a prefetch only: computed with wrapping arithmetic, it may
/// point anywhere (a prefetch does not fault) and must not be dereferenced.
#[inline(always)]
pub(crate) fn write_end(data: &Span, remote_addr: u64, len: usize) -> *const u8 {
    data.addr(0)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn region_mr(pd: u32, len: usize, access: AccessFlags) -> (LocalMr, Arc<Region>) {
        let r = Arc::new(Region::create("bp-test-mr", len).unwrap());
        let mr = LocalMr {
            pd,
            access,
            iova: 0,
            data: Span::whole(&r),
            header: r.clone(),
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
