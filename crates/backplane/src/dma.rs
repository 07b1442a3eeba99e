//! Raw mode (seed 000 §4.6): scatter/gather DMA jobs between node memories, executed by DMA
//! engine threads so the submitting thread does no copying.
//!
//! ```no_run
//! use backplane::dma::{DmaConfig, DmaEngines, DmaQueue, Job, Mem, Segment};
//! use backplane::verbs::{AccessFlags, Context};
//! # let fabric = backplane::fabric::Fabric::attach("default")?;
//! let ctx = Context::open(&fabric.node(1)?)?;
//! let src = ctx.alloc_pd().alloc_mr(64 << 20, AccessFlags::LOCAL_WRITE)?;
//! let engines = DmaEngines::start(&DmaConfig::default())?;     // one engine thread
//! let q = DmaQueue::new(&ctx, &engines, 64);
//! let (node, rkey) = (2, 0x1234); // a region of node 2 with REMOTE_WRITE, rkey learned somehow
//! let segs = [Segment {
//!     src: Mem::local(&src), src_off: 0,
//!     dst: Mem::Remote { node, rkey }, dst_off: 0,
//!     len: 64 << 20,
//! }];
//! q.submit(&Job::new(7, &segs))?;
//! let mut wc = [Default::default(); 8];
//! q.wait(1, None);
//! let n = q.poll(&mut wc);
//! assert!(n == 1 && wc[0].status.is_ok());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **What a job is.** A list of [`Segment`]s, each copying `len` bytes from (region, offset)
//! to (region, offset). A region is one of this context's memory regions ([`Mem::Local`], by
//! lkey) or a region of any node ([`Mem::Remote`], by node and rkey), mapped through a grant
//! of the supervisor (`DmaGrant`: read-only unless the region has REMOTE_WRITE or
//! REMOTE_ATOMIC). Offsets are zero-based, as in verbs.
//!
//! **Semantics.** Segments of a job run in any order, possibly at once on several engines. A
//! job completes once, into its queue's completion list ([`DmaQueue::poll`]), with a
//! [`DmaStatus`] and, when it is not a success, the index of the segment to blame. Every
//! segment is checked before any byte moves: region known and granted, bounds, direction
//! (REMOTE_READ to read a remote region; REMOTE_WRITE, or LOCAL_WRITE for a local one, to
//! write), and no overlap between a destination and any other range of the job; a job that
//! fails the checks copies nothing. While it runs, each piece re-checks that its regions are
//! still registered and their nodes still READY in the same generation, before and after
//! copying, so a node that goes DOWN fails the job (`NodeDown`, naming the segment) within one
//! piece (a few milliseconds) of the supervisor noticing. Writes land only inside checked
//! ranges; mappings of read-only grants are `PROT_READ`, so the OS enforces it as well.
//!
//! **Ordering.** Jobs of a queue run concurrently unless told otherwise: a *fenced* job
//! ([`Job::fenced`]) starts after every job submitted before it completed (later jobs do not
//! wait for it, as with `IBV_SEND_FENCE`); a *chained* job ([`Job::chained`]) is fenced and
//! runs only if the job submitted just before it succeeded, else it completes `Cancelled`.
//! [`DmaQueue::cancel`] stops a job: pieces not yet started are skipped and the job completes
//! `Cancelled` naming its lowest skipped segment (a job whose pieces had all started completes
//! normally).
//!
//! **Engines.** [`DmaEngines`] is a node process's engine set: `engines` threads (default 1,
//! optionally pinned to CPUs) taking pieces from one work list. A segment of at least
//! [`SPLIT_MIN`] bytes is cut into page-aligned pieces, at least one per engine and at most
//! `max_piece` bytes each, so large segments spread over the engines; runs of small segments
//! are grouped into pieces of about [`BATCH`] bytes. A job of at most `inline_threshold` bytes
//! that may start at once is copied by the submitter itself (the hand-off costs more than the
//! copy, as with `ntb_transport`'s `copy_bytes`); the default was chosen by measurement (see
//! [`DEFAULT_INLINE_THRESHOLD`]).
//!
//! **Threads.** A verbs [`Context`] is not `Send`, so the part that needs it stays in the
//! submitting thread: [`DmaQueue`] (not `Send`) resolves keys, asks for grants, checks bounds
//! and access, and turns each segment into two raw pointers inside mappings it holds by
//! `Arc<Region>`. What crosses to the engines is only that resolved job (`JobRun`: pointers,
//! the `Arc`s that keep their mappings alive, atomics) and the queue's completion list behind
//! a mutex. Engine threads never touch the context, its tables or the supervisor; they read
//! the regions' state words and the node table (both shared memory, validated) to notice
//! deregistration and node death.
//!
//! Completions go to the DMA queue's own list, not to a verbs CQ: a verbs CQ is single-threaded
//! state inside a context (no lock on its data path), and engine threads complete jobs
//! asynchronously; feeding it would put a lock on every verbs poll.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::fabric::FabricError;
use crate::mem::{MemError, Span, Word32};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::transport::{CopyKind, GrantRequest, RemoteRegion, Transport};
use crate::verbs::{AccessFlags, Context, Mr};
use crate::wire::verbs::{MR_STATE_OFF, MR_STATE_VALID};
use crate::wire::NodeState;

/// Jobs of at most this many bytes that may start at once are copied by the submitting thread.
///
/// Measured with `backplane perf dma-bw -s SIZE --inline-threshold 0` (every job to the engine)
/// against `--inline-threshold 1G` (every job inline), one engine, same session (README, "Raw
/// DMA"): up to 16 KiB the inline copy is both faster (16 KiB: 27.8 against 19.5 GB/s) and
/// cheaper for the submitter per byte (0.036 against 0.048 CPU-s/GB: handing a job over and
/// taking its completion costs the submitter about 0.8 µs, a 16 KiB memcpy less); from 32 KiB
/// on the engine saves the submitter CPU (32 KiB: 0.020 against 0.032 s/GB at 93 % of the
/// inline bandwidth; 64 KiB: 0.0087 against 0.026 at the same bandwidth), which is what the
/// offload is for. Hence 16 KiB.
pub const DEFAULT_INLINE_THRESHOLD: u64 = 16 << 10;
/// Default largest piece an engine copies in one go: big enough that glibc's memcpy uses its
/// large-copy strategy, small enough that cancellation and node death are seen within ms.
pub const DEFAULT_MAX_PIECE: u64 = 8 << 20;
/// Jobs of at least this many bytes are copied with stores that bypass the cache
/// ([`crate::mem::copy_streaming`]), as a DMA engine's writes do: such a job cannot stay in
/// the last-level cache (32 MiB on the development machine) anyway, and an ordinary copy
/// would read every destination line before overwriting it. `perf dma-bw -r 5` at 64 MiB:
/// 0.85 of memcpy with ordinary stores, see the README for the figure with streaming ones.
pub const STREAM_MIN: u64 = 32 << 20;
/// Segments at least this long are split (one piece per engine at least).
pub const SPLIT_MIN: u64 = 256 << 10;
/// Small segments are grouped into pieces of about this many bytes.
pub const BATCH: u64 = 256 << 10;
/// Most segments one piece groups.
const BATCH_SEGS: u32 = 1024;
/// Most segments in one job.
pub const MAX_SEGMENTS: usize = 1 << 20;
/// Regions a queue keeps resolved (mappings of grants, local regions).
const MAP_CACHE: usize = 64;
/// Piece boundaries inside a split segment are multiples of this.
const PIECE_ALIGN: u64 = 4096;

/// A region as a segment names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mem {
    /// A region of the queue's own context, by lkey.
    Local {
        /// The region's key.
        lkey: u32,
    },
    /// A region registered on node `node` (by any process), by rkey.
    Remote {
        /// Node slot.
        node: u32,
        /// The region's key.
        rkey: u32,
    },
}

impl Mem {
    /// This context's region `mr`.
    pub fn local(mr: &Mr) -> Self {
        Mem::Local { lkey: mr.lkey() }
    }
}

/// One copy of a job: `len` bytes from `src` at `src_off` to `dst` at `dst_off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Source region.
    pub src: Mem,
    /// Offset in the source region.
    pub src_off: u64,
    /// Destination region.
    pub dst: Mem,
    /// Offset in the destination region.
    pub dst_off: u64,
    /// Bytes.
    pub len: u64,
}

/// A DMA job: segments, an id for its completion, and its ordering.
#[derive(Debug, Clone, Copy)]
pub struct Job<'a> {
    /// Returned in the completion (need not be unique; [`DmaQueue::cancel`] takes every job
    /// with the id).
    pub id: u64,
    /// What to copy.
    pub segments: &'a [Segment],
    /// Start only after every job submitted before this one completed.
    pub fence: bool,
    /// Fenced, and run only if the job submitted just before succeeded (else `Cancelled`).
    pub chain: bool,
}

impl<'a> Job<'a> {
    /// An unordered job.
    pub fn new(id: u64, segments: &'a [Segment]) -> Self {
        Self {
            id,
            segments,
            fence: false,
            chain: false,
        }
    }
    /// Fenced: starts after every earlier job of the queue completed.
    pub fn fenced(mut self) -> Self {
        self.fence = true;
        self
    }
    /// Chained to the job submitted just before: runs after it, only if it succeeded.
    pub fn chained(mut self) -> Self {
        self.chain = true;
        self
    }
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DmaStatus {
    /// Every byte was copied.
    #[default]
    Success,
    /// Cancelled (or chained to a job that did not succeed) before some segments started.
    Cancelled,
    /// A local lkey this context does not have, or a node number outside the fabric.
    InvalidRegion,
    /// The supervisor granted no mapping: the rkey names no region on that node, or the
    /// region allows no remote access.
    NoGrant,
    /// A segment reaches past the end of its source or destination region.
    OutOfBounds,
    /// The region does not allow the direction: a destination without REMOTE_WRITE (remote)
    /// or LOCAL_WRITE (local), a remote source without REMOTE_READ.
    AccessDenied,
    /// A destination range overlaps another range (source or destination) of the same job.
    Overlap,
    /// A node of the job (a region's owner or this one) is not READY in the generation the
    /// region was mapped in.
    NodeDown,
    /// A region was deregistered.
    RegionGone,
}

impl DmaStatus {
    /// True for `Success`.
    pub fn is_ok(self) -> bool {
        self == DmaStatus::Success
    }
}

impl std::fmt::Display for DmaStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DmaStatus::Success => "success",
            DmaStatus::Cancelled => "cancelled",
            DmaStatus::InvalidRegion => "invalid region",
            DmaStatus::NoGrant => "no grant",
            DmaStatus::OutOfBounds => "out of bounds",
            DmaStatus::AccessDenied => "access denied",
            DmaStatus::Overlap => "overlapping segments",
            DmaStatus::NodeDown => "node down",
            DmaStatus::RegionGone => "region deregistered",
        })
    }
}

/// A job's completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DmaWc {
    /// The job's id.
    pub id: u64,
    /// How it ended.
    pub status: DmaStatus,
    /// The segment to blame: the failing one for an error, the lowest-numbered one that did
    /// not run for `Cancelled`; None on success.
    pub segment: Option<u32>,
    /// Bytes copied.
    pub bytes: u64,
}

/// What went wrong submitting a job or starting engines.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// Occurs when `depth` jobs are outstanding: poll completions first.
    #[error("the DMA queue is full ({0} jobs outstanding); poll completions first")]
    Full(usize),
    /// Occurs when a job or a configuration is malformed (no segments, too many, 0 engines).
    #[error("{0}")]
    Invalid(String),
    /// Occurs when an engine thread cannot be started.
    #[error("cannot start a DMA engine thread: {0}")]
    Spawn(std::io::Error),
}

/// How a node process's engine set is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DmaConfig {
    /// Engine threads (1..=64).
    pub engines: usize,
    /// CPUs to pin the engines to (engine i to `pin[i % pin.len()]`); empty: not pinned.
    pub pin: Vec<usize>,
    /// Jobs of at most this many bytes are copied by the submitter when they may start at once.
    pub inline_threshold: u64,
    /// Largest piece an engine copies at once (at least 64 KiB).
    pub max_piece: u64,
}

impl Default for DmaConfig {
    fn default() -> Self {
        Self {
            engines: 1,
            pin: Vec::new(),
            inline_threshold: DEFAULT_INLINE_THRESHOLD,
            max_piece: DEFAULT_MAX_PIECE,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Planning: pure functions (unit-tested below).
// ---------------------------------------------------------------------------------------------

/// A piece of a job's work: whole segments `[seg, seg+nseg)`, or (`nseg == 1`) bytes
/// `[off, off+len)` of segment `seg`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PieceSpec {
    pub(crate) seg: u32,
    pub(crate) nseg: u32,
    pub(crate) off: u64,
    pub(crate) len: u64,
}

/// Cuts segments of lengths `lens` into pieces for `engines` engines (see the module doc).
/// Every byte of every segment is in exactly one piece; pieces of a split segment are
/// `PIECE_ALIGN`-aligned except the last, and at most `max_piece` bytes (rounded up to that
/// alignment).
pub(crate) fn plan(lens: &[u64], engines: usize, max_piece: u64) -> Vec<PieceSpec> {
    let mut out = Vec::new();
    let mut run: Option<PieceSpec> = None;
    let flush = |run: &mut Option<PieceSpec>, out: &mut Vec<PieceSpec>| {
        if let Some(r) = run.take() {
            out.push(r);
        }
    };
    for (i, &len) in lens.iter().enumerate() {
        let i = i as u32;
        if len >= SPLIT_MIN {
            flush(&mut run, &mut out);
            let by_size = len.div_ceil(max_piece.max(PIECE_ALIGN));
            let n = by_size.max(engines as u64).max(1);
            let step = len.div_ceil(n).div_ceil(PIECE_ALIGN) * PIECE_ALIGN;
            let mut off = 0;
            while off < len {
                let l = step.min(len - off);
                out.push(PieceSpec {
                    seg: i,
                    nseg: 1,
                    off,
                    len: l,
                });
                off += l;
            }
            continue;
        }
        match &mut run {
            Some(r) if r.len + len <= BATCH && r.nseg < BATCH_SEGS => {
                r.nseg += 1;
                r.len += len;
            }
            _ => {
                flush(&mut run, &mut out);
                run = Some(PieceSpec {
                    seg: i,
                    nseg: 1,
                    off: 0,
                    len,
                });
            }
        }
    }
    flush(&mut run, &mut out);
    out
}

/// Checks one segment against its source (length, readable) and destination (length,
/// writable): the direction first, then both ranges inside their regions, overflow-proof.
/// Only a segment this accepts is ever turned into pointers.
pub(crate) fn check_segment(
    src: (u64, bool),
    dst: (u64, bool),
    src_off: u64,
    dst_off: u64,
    len: u64,
) -> Result<(), DmaStatus> {
    if !src.1 || !dst.1 {
        return Err(DmaStatus::AccessDenied);
    }
    let inside = |size: u64, off: u64| off.checked_add(len).is_some_and(|e| e <= size);
    if !inside(src.0, src_off) || !inside(dst.0, dst_off) {
        return Err(DmaStatus::OutOfBounds);
    }
    Ok(())
}

/// One range of a job for the overlap check: region identity, [start, end), destination?,
/// segment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Range {
    pub(crate) region: (u64, u64),
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) dst: bool,
    pub(crate) seg: u32,
}

/// The first segment (in a deterministic sweep) whose range overlaps another range of the job
/// where at least one of the two is a destination; the later-numbered segment of the pair.
/// Empty ranges overlap nothing.
pub(crate) fn find_overlap(ranges: &mut [Range]) -> Option<u32> {
    if plainly_disjoint(ranges) {
        return None;
    }
    ranges.sort_unstable_by_key(|r| (r.region, r.start, r.end, r.seg));
    let mut region = None;
    let (mut any_end, mut any_seg) = (0u64, 0u32);
    let (mut dst_end, mut dst_seg) = (0u64, 0u32);
    for r in ranges.iter().filter(|r| r.end > r.start) {
        if region != Some(r.region) {
            region = Some(r.region);
            (any_end, dst_end) = (0, 0);
        }
        if r.dst && r.start < any_end {
            return Some(r.seg.max(any_seg));
        }
        if !r.dst && r.start < dst_end {
            return Some(r.seg.max(dst_seg));
        }
        if r.end > any_end {
            (any_end, any_seg) = (r.end, r.seg);
        }
        if r.dst && r.end > dst_end {
            (dst_end, dst_seg) = (r.end, r.seg);
        }
    }
    None
}

/// The common shape, checked in one pass without sorting: every source in one region, every
/// destination in another, destinations in ascending order without overlap. True means no
/// overlap; false means "look closer".
fn plainly_disjoint(ranges: &[Range]) -> bool {
    let (mut src, mut dst) = (None, None);
    let mut dst_end = 0;
    for r in ranges.iter().filter(|r| r.end > r.start) {
        if r.dst {
            if *dst.get_or_insert(r.region) != r.region || r.start < dst_end {
                return false;
            }
            dst_end = r.end;
        } else if *src.get_or_insert(r.region) != r.region {
            return false;
        }
    }
    src.is_none() || src != dst
}

// ---------------------------------------------------------------------------------------------
// Mappings and resolved jobs (what crosses to the engine threads).
// ---------------------------------------------------------------------------------------------

/// A region as the engines see it: its bytes (this process's region, or a peer's through the
/// transport), what may be done with them, the node (slot, generation) whose death fails jobs
/// using it.
struct Mapping {
    transport: Arc<dyn Transport>,
    bytes: MapBytes,
    /// May be read (REMOTE_READ for a grant; always for a local region).
    readable: bool,
    /// May be written (a writable grant of a REMOTE_WRITE region; LOCAL_WRITE locally).
    writable: bool,
    /// Names the region's memory: two mappings of one region have the same.
    ident: (u64, u64),
    owner: (u32, u32),
}

/// Where a mapping's bytes are.
enum MapBytes {
    /// A region of this process, with its state word.
    Local { data: Span, state: Word32 },
    /// A peer's region.
    Remote(Arc<dyn RemoteRegion>),
}

impl Mapping {
    fn len(&self) -> u64 {
        match &self.bytes {
            MapBytes::Local { data, .. } => data.len(),
            MapBytes::Remote(r) => r.len(),
        }
    }

    /// Ok while the region is registered and its node READY in the same generation. A node
    /// that went DOWN is reported as such even though the supervisor also marked its regions
    /// gone (it publishes the node's state first).
    fn live(&self) -> Result<(), DmaStatus> {
        let node_ok = || {
            self.transport
                .peer(self.owner.0)
                .is_some_and(|p| p.is_live(self.owner.1))
        };
        let registered = match &self.bytes {
            // SYNC POINT mr-state (acquire): our own deregistration, seen before each piece.
            MapBytes::Local { state, .. } => state.load(Ordering::Acquire) == MR_STATE_VALID,
            MapBytes::Remote(r) => r.valid(),
        };
        // A region on another host whose host or link went: its node, as far as we can tell.
        let cut = matches!(&self.bytes, MapBytes::Remote(r) if r.cut());
        if !registered {
            return Err(if node_ok() && !cut {
                DmaStatus::RegionGone
            } else {
                DmaStatus::NodeDown
            });
        }
        if !node_ok() {
            return Err(DmaStatus::NodeDown);
        }
        Ok(())
    }

    /// One end of a segment: `len` bytes at `off` (checked against the region by the caller).
    fn end(&self, off: u64, len: u64) -> Option<End> {
        Some(match &self.bytes {
            MapBytes::Local { data, .. } => End::Local(data.sub(off, len).ok()?),
            MapBytes::Remote(r) => End::Remote(r.clone(), off),
        })
    }
}

/// One end of a checked segment: a span of this process, or an offset in a peer's region.
#[derive(Clone)]
enum End {
    Local(Span),
    Remote(Arc<dyn RemoteRegion>, u64),
}

/// Copies `n` bytes at `off` of `src` to `off` of `dst` (offsets within the segment).
fn copy_piece(src: &End, dst: &End, off: u64, n: usize, stream: bool) -> Result<(), MemError> {
    let how = if stream {
        CopyKind::Streaming
    } else {
        CopyKind::Plain
    };
    let spans = |s: &Span, so: u64, d: &Span, dof: u64| {
        if stream {
            s.copy_to_streaming(so, d, dof, n)
        } else {
            s.copy_to(so, d, dof, n)
        }
    };
    match (src, dst) {
        (End::Local(s), End::Local(d)) => spans(s, off, d, off),
        (End::Local(s), End::Remote(r, base)) => r.put(base + off, s, off, n, how),
        (End::Remote(r, base), End::Local(d)) => r.get(base + off, d, off, n, how),
        // Between two peers: direct, the transport maps both here (checked at submission).
        (End::Remote(a, sa), End::Remote(b, sb)) => match (a.local(), b.local()) {
            (Some((s, _)), Some((d, _))) => spans(s, sa + off, d, sb + off),
            _ => Err(MemError::OutOfBounds {
                off,
                len: n as u64,
                size: 0,
            }),
        },
    }
}

/// How long a piece waits for its puts to a region on another host to land (its host is
/// seen gone within a second; this bounds a host that stops answering otherwise).
const SETTLE_PATIENCE: Duration = Duration::from_secs(10);

/// Puts of a piece still on their way to regions on other hosts: (region, ticket) each.
type Unsettled = Vec<(Arc<dyn RemoteRegion>, u64)>;

/// Adds the puts made so far to `end` unless they landed (a region whose transport carries
/// puts out later: on another host).
fn unsettled(end: &End, out: &mut Unsettled) {
    if let End::Remote(r, _) = end {
        if let Some(t) = r.ticket() {
            if r.settled(t) != Some(true) {
                out.push((r.clone(), t));
            }
        }
    }
}

/// `None` while some put of `wait` is on its way (before `deadline`); else `Ok` if every one
/// landed, `RegionGone` if an owner refused one, `NodeDown` if the way to a region is gone or
/// no answer came in time.
fn settled_all(wait: &Unsettled, deadline: Instant) -> Option<Result<(), DmaStatus>> {
    let mut all = true;
    for (r, t) in wait {
        match r.settled(*t) {
            Some(true) => {}
            Some(false) if r.cut() => return Some(Err(DmaStatus::NodeDown)),
            Some(false) => return Some(Err(DmaStatus::RegionGone)),
            None => all = false,
        }
    }
    match (all, Instant::now() < deadline) {
        (true, _) => Some(Ok(())),
        (false, true) => None,
        (false, false) => Some(Err(DmaStatus::NodeDown)),
    }
}

/// A piece whose copies are done and whose puts to regions on other hosts are on their way:
/// it counts as done when they landed (engine threads take other pieces meanwhile).
struct Awaiting {
    j: Arc<JobRun>,
    seg: u32,
    wait: Unsettled,
    deadline: Instant,
}

/// Whether `end` is a region on another host whose host or link went.
fn cut(end: &End) -> bool {
    matches!(end, End::Remote(r, _) if r.cut())
}

/// A segment after the checks: its source and destination, of `len` bytes each.
#[derive(Clone)]
struct Resolved {
    src: End,
    dst: End,
    len: u64,
}

const PENDING: u8 = 0;
const OK: u8 = 1;
const NOT_OK: u8 = 2;

/// A submitted job, shared by the submitter, the engines and the queue.
struct JobRun {
    id: u64,
    seq: u64,
    fence: bool,
    /// For a chained job: the job submitted just before it.
    after: Mutex<Option<Arc<JobRun>>>,
    q: Arc<QShared>,
    /// The distinct mappings the segments point into (keeps them alive).
    maps: Vec<Arc<Mapping>>,
    segs: Vec<Resolved>,
    /// Copy with cache-bypassing stores (the job is at least [`STREAM_MIN`] bytes).
    stream: bool,
    /// Set when validation failed: (status, segment); the job never runs.
    rejected: Option<(DmaStatus, u32)>,
    /// Pieces handed to engines and not yet finished.
    pending: AtomicUsize,
    cancelled: AtomicBool,
    /// Set with the first error: other pieces stop.
    failed: AtomicBool,
    error: Mutex<Option<(DmaStatus, u32)>>,
    first_skipped: AtomicU32,
    bytes: AtomicU64,
    outcome: AtomicU8,
}

impl JobRun {
    #[allow(clippy::too_many_arguments)]
    fn new(
        job: &Job<'_>,
        seq: u64,
        after: Option<Arc<JobRun>>,
        q: &Arc<QShared>,
        maps: Vec<Arc<Mapping>>,
        segs: Vec<Resolved>,
        rejected: Option<(DmaStatus, u32)>,
    ) -> Arc<Self> {
        Arc::new(JobRun {
            id: job.id,
            seq,
            fence: job.fence || job.chain,
            after: Mutex::new(after),
            q: q.clone(),
            maps,
            stream: segs.iter().map(|s| s.len).sum::<u64>() >= STREAM_MIN,
            segs,
            rejected,
            pending: AtomicUsize::new(0),
            cancelled: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            first_skipped: AtomicU32::new(u32::MAX),
            bytes: AtomicU64::new(0),
            outcome: AtomicU8::new(PENDING),
        })
    }

    fn live(&self) -> Result<(), DmaStatus> {
        for m in &self.maps {
            m.live()?;
        }
        Ok(())
    }

    fn fail(&self, status: DmaStatus, seg: u32) {
        let mut e = lock(&self.error);
        if e.is_none() {
            *e = Some((status, seg));
        }
        self.failed.store(true, Ordering::Release);
    }

    /// `NodeDown` if a node of the job is down now (its supervisor saw it), else `why`.
    fn node_down_or(&self, why: DmaStatus) -> DmaStatus {
        match self.live() {
            Err(DmaStatus::NodeDown) => DmaStatus::NodeDown,
            _ => why,
        }
    }

    /// Copies piece `p` (or skips it when the job was cancelled or failed). Returns the puts
    /// to regions on other hosts that have not landed yet: the piece is done once they have
    /// ([`JobRun::settle`], or an engine's [`Awaiting`]).
    fn run_piece(&self, p: PieceSpec) -> Unsettled {
        if self.cancelled.load(Ordering::Acquire) {
            self.first_skipped.fetch_min(p.seg, Ordering::AcqRel);
            return Vec::new();
        }
        if self.failed.load(Ordering::Acquire) {
            return Vec::new();
        }
        if let Err(s) = self.live() {
            self.fail(s, p.seg);
            return Vec::new();
        }
        let segs = &self.segs[p.seg as usize..(p.seg + p.nseg) as usize];
        let mut n = 0;
        for s in segs {
            let (off, len) = if p.nseg == 1 {
                (p.off, p.len)
            } else {
                (0, s.len)
            };
            // `plan` keeps pieces inside their segment, whose spans were checked at submission
            // (the destination writable, no destination range overlapping another): an error
            // here means a check disagreed, and the piece fails rather than copy.
            let copied = copy_piece(&s.src, &s.dst, off, len as usize, self.stream);
            if copied.is_err() {
                // A region on another host refuses a get when its owner does (deregistered)
                // or its host went: say which rather than "out of bounds".
                let across = |e: &End| matches!(e, End::Remote(r, _) if r.ticket().is_some());
                let s = if across(&s.src) || across(&s.dst) {
                    self.node_down_or(if cut(&s.src) || cut(&s.dst) {
                        DmaStatus::NodeDown
                    } else {
                        DmaStatus::RegionGone
                    })
                } else {
                    DmaStatus::OutOfBounds
                };
                self.fail(s, p.seg);
                return Vec::new();
            }
            n += len;
        }
        // A node that died while we copied: the bytes went to a dead node's memory.
        if let Err(s) = self.live() {
            self.fail(s, p.seg);
            return Vec::new();
        }
        self.bytes.fetch_add(n, Ordering::Relaxed);
        // Puts to a region on another host return once queued.
        let mut wait = Unsettled::new();
        for s in segs {
            unsettled(&s.dst, &mut wait);
        }
        wait
    }

    /// Waits (this thread) until the puts of piece `seg` landed; the job fails if they do
    /// not. For a piece run by its submitter, and by the tests' step.
    fn settle(&self, seg: u32, wait: &Unsettled) {
        let deadline = Instant::now() + SETTLE_PATIENCE;
        let mut polls = 0u32;
        loop {
            match settled_all(wait, deadline) {
                Some(Ok(())) => return,
                Some(Err(st)) => return self.fail(self.node_down_or(st), seg),
                None => {}
            }
            // The answer crosses two bridges and a network: tens of µs at best.
            if polls < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
            polls += 1;
        }
    }

    /// The completion, once every piece has finished.
    fn wc(&self) -> DmaWc {
        let bytes = self.bytes.load(Ordering::Acquire);
        let (status, segment) = if let Some((s, i)) = self.rejected {
            (s, Some(i))
        } else if let Some((s, i)) = *lock(&self.error) {
            (s, Some(i))
        } else {
            match self.first_skipped.load(Ordering::Acquire) {
                u32::MAX => (DmaStatus::Success, None),
                i => (DmaStatus::Cancelled, Some(i)),
            }
        };
        DmaWc {
            id: self.id,
            status,
            segment,
            bytes,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking engine thread must not take every queue down with it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------------------------
// The queue's shared state: completions, live jobs, fences.
// ---------------------------------------------------------------------------------------------

struct QShared {
    st: Mutex<QState>,
    cv: Condvar,
}

impl QShared {
    fn new() -> Arc<Self> {
        Arc::new(QShared {
            st: Mutex::new(QState::default()),
            cv: Condvar::new(),
        })
    }

    /// Takes up to `out.len()` completions.
    fn poll(&self, out: &mut [DmaWc]) -> usize {
        let mut q = lock(&self.st);
        let n = out.len().min(q.done.len());
        for (o, w) in out.iter_mut().zip(q.done.drain(..n)) {
            *o = w;
        }
        n
    }

    /// See [`DmaQueue::wait`].
    fn wait(&self, min: usize, timeout: Option<Duration>) -> usize {
        let end = timeout.map(|t| Instant::now() + t);
        let mut q = lock(&self.st);
        loop {
            let want = min.min(q.done.len() + q.live.len()).max(1);
            if q.done.len() >= want || (q.live.is_empty() && q.done.is_empty()) {
                q.want = 0;
                return q.done.len();
            }
            q.want = want;
            q = match end {
                None => self.cv.wait(q).unwrap_or_else(|p| p.into_inner()),
                Some(e) => {
                    let left = e.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        q.want = 0;
                        return q.done.len();
                    }
                    self.cv
                        .wait_timeout(q, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    /// Marks every outstanding job with id `id` cancelled; returns how many, and the ones
    /// parked behind a fence (to be finished by the caller).
    fn cancel(&self, id: u64) -> (usize, VecDeque<Arc<JobRun>>) {
        let mut q = lock(&self.st);
        let mut n = 0;
        for j in q.live.values().filter(|j| j.id == id) {
            j.cancelled.store(true, Ordering::Release);
            n += 1;
        }
        let (parked, keep): (VecDeque<_>, VecDeque<_>) =
            q.blocked.drain(..).partition(|j| j.id == id);
        q.blocked = keep;
        (n, parked)
    }
}

#[derive(Default)]
struct QState {
    done: VecDeque<DmaWc>,
    /// Jobs submitted and not completed, by sequence number.
    live: BTreeMap<u64, Arc<JobRun>>,
    /// Fenced or chained jobs waiting for earlier ones, in submission order.
    blocked: VecDeque<Arc<JobRun>>,
    /// A waiter wants this many completions (0: nobody waits).
    want: usize,
}

impl QState {
    fn eligible(&self, j: &JobRun) -> bool {
        !(j.fence && self.live.range(..j.seq).next().is_some())
    }
}

/// Work the engine threads share.
struct EngShared {
    st: Mutex<Work>,
    cv: Condvar,
    engines: usize,
    max_piece: u64,
    inline_threshold: u64,
}

#[derive(Default)]
struct Work {
    pieces: VecDeque<(Arc<JobRun>, PieceSpec)>,
    sleepers: usize,
    shutdown: bool,
}

impl EngShared {
    fn new(cfg: &DmaConfig) -> Arc<Self> {
        Arc::new(EngShared {
            st: Mutex::new(Work::default()),
            cv: Condvar::new(),
            engines: cfg.engines,
            max_piece: cfg.max_piece,
            inline_threshold: cfg.inline_threshold,
        })
    }

    /// Starts job `j`, which is registered in its queue's `live` and may start (no earlier
    /// job holds it back, or it was cancelled); `inline` lets the calling thread copy a small
    /// job itself. Jobs its completion releases are started in turn.
    fn start(self: &Arc<Self>, j: Arc<JobRun>, inline: bool) {
        let mut todo = vec![(j, inline)];
        while let Some((j, inline)) = todo.pop() {
            let prev_ok = lock(&j.after)
                .take()
                .is_none_or(|p| p.outcome.load(Ordering::Acquire) == OK);
            if !prev_ok {
                j.cancelled.store(true, Ordering::Release);
            }
            let total: u64 = j.segs.iter().map(|s| s.len).sum();
            if j.rejected.is_some() || j.cancelled.load(Ordering::Acquire) {
                if j.rejected.is_none() && !j.segs.is_empty() {
                    j.first_skipped.fetch_min(0, Ordering::AcqRel);
                }
                self.finish(&j, &mut todo);
                continue;
            }
            if inline && total <= self.inline_threshold {
                let wait = j.run_piece(PieceSpec {
                    seg: 0,
                    nseg: j.segs.len() as u32,
                    off: 0,
                    len: total,
                });
                j.settle(0, &wait);
                self.finish(&j, &mut todo);
                continue;
            }
            let lens: Vec<u64> = j.segs.iter().map(|s| s.len).collect();
            let pieces = plan(&lens, self.engines, self.max_piece);
            if pieces.is_empty() {
                self.finish(&j, &mut todo); // only reachable with no segments
                continue;
            }
            j.pending.store(pieces.len(), Ordering::Release);
            let wake = {
                let mut w = lock(&self.st);
                if w.shutdown {
                    None
                } else {
                    for p in pieces {
                        w.pieces.push_back((j.clone(), p));
                    }
                    Some(w.sleepers)
                }
            };
            match wake {
                None => {
                    j.cancelled.store(true, Ordering::Release);
                    j.first_skipped.fetch_min(0, Ordering::AcqRel);
                    self.finish(&j, &mut todo);
                }
                Some(0) => {}
                Some(1) => self.cv.notify_one(),
                Some(_) => self.cv.notify_all(),
            }
        }
    }

    /// One piece of `j` is done (engine threads).
    fn piece_done(self: &Arc<Self>, j: &Arc<JobRun>) {
        if j.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            let mut todo = Vec::new();
            self.finish(j, &mut todo);
            for (k, _) in todo.drain(..) {
                self.start(k, false);
            }
        }
    }

    /// Completes `j`: its completion goes to the queue; fenced jobs it held back are queued
    /// on `todo` to start.
    fn finish(&self, j: &Arc<JobRun>, todo: &mut Vec<(Arc<JobRun>, bool)>) {
        let wc = j.wc();
        j.outcome.store(
            if wc.status.is_ok() { OK } else { NOT_OK },
            Ordering::Release,
        );
        let mut q = lock(&j.q.st);
        q.live.remove(&j.seq);
        q.done.push_back(wc);
        while let Some(b) = q.blocked.front() {
            if !q.eligible(b) {
                break;
            }
            let b = q.blocked.pop_front().expect("front exists");
            todo.push((b, false));
        }
        if q.want > 0 && q.done.len() >= q.want.min(q.done.len() + q.live.len()) {
            q.want = 0;
            j.q.cv.notify_all();
        }
    }

    fn engine_loop(self: Arc<Self>) {
        // Pieces whose puts to regions on other hosts are on their way: the engine takes
        // other pieces meanwhile (waiting for each round trip would bound it to one piece in
        // flight), and looks at these between pieces and every few µs when idle.
        let mut awaiting: Vec<Awaiting> = Vec::new();
        loop {
            self.reap(&mut awaiting);
            let next = {
                let mut w = lock(&self.st);
                loop {
                    if let Some(x) = w.pieces.pop_front() {
                        break Some(x);
                    }
                    if !awaiting.is_empty() {
                        w.sleepers += 1;
                        let nap = Duration::from_micros(20);
                        w = self
                            .cv
                            .wait_timeout(w, nap)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                        w.sleepers -= 1;
                        break w.pieces.pop_front();
                    }
                    if w.shutdown {
                        return;
                    }
                    w.sleepers += 1;
                    w = self.cv.wait(w).unwrap_or_else(|p| p.into_inner());
                    w.sleepers -= 1;
                }
            };
            if let Some((j, p)) = next {
                let wait = j.run_piece(p);
                if wait.is_empty() {
                    self.piece_done(&j);
                } else {
                    let deadline = Instant::now() + SETTLE_PATIENCE;
                    let seg = p.seg;
                    awaiting.push(Awaiting {
                        j,
                        seg,
                        wait,
                        deadline,
                    });
                }
            }
        }
    }

    /// The awaited pieces whose puts landed, failed or ran out of patience are done.
    fn reap(self: &Arc<Self>, awaiting: &mut Vec<Awaiting>) {
        let mut i = 0;
        while i < awaiting.len() {
            let Some(outcome) = settled_all(&awaiting[i].wait, awaiting[i].deadline) else {
                i += 1;
                continue;
            };
            let a = awaiting.swap_remove(i);
            if let Err(st) = outcome {
                a.j.fail(a.j.node_down_or(st), a.seg);
            }
            self.piece_done(&a.j);
        }
    }
}

/// A node process's DMA engines: threads that execute the pieces of every queue made with it.
/// Dropping it stops the threads; pieces not started by then are skipped (their jobs complete
/// `Cancelled`).
pub struct DmaEngines {
    shared: Arc<EngShared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for DmaEngines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaEngines")
            .field("engines", &self.shared.engines)
            .finish()
    }
}

impl DmaEngines {
    /// Starts `cfg.engines` engine threads.
    pub fn start(cfg: &DmaConfig) -> Result<Self, DmaError> {
        if !(1..=64).contains(&cfg.engines) {
            return Err(DmaError::Invalid(format!(
                "{} DMA engines: use 1..=64",
                cfg.engines
            )));
        }
        if cfg.max_piece < 64 << 10 {
            return Err(DmaError::Invalid(format!(
                "max_piece {} is below 64 KiB",
                cfg.max_piece
            )));
        }
        let shared = EngShared::new(cfg);
        let mut me = Self {
            shared,
            threads: Vec::new(),
        };
        for i in 0..cfg.engines {
            let s = me.shared.clone();
            let cpu = (!cfg.pin.is_empty()).then(|| cfg.pin[i % cfg.pin.len()]);
            let t = std::thread::Builder::new()
                .name(format!("bp-dma-{i}"))
                .spawn(move || {
                    if let Some(c) = cpu {
                        pin_to(c);
                    }
                    s.engine_loop()
                })
                .map_err(DmaError::Spawn)?;
            me.threads.push(t);
        }
        Ok(me)
    }

    /// Engine threads.
    pub fn engines(&self) -> usize {
        self.shared.engines
    }
}

impl Drop for DmaEngines {
    fn drop(&mut self) {
        let left: Vec<_> = {
            let mut w = lock(&self.shared.st);
            w.shutdown = true;
            w.pieces.drain(..).collect()
        };
        self.shared.cv.notify_all();
        for (j, _) in left {
            j.cancelled.store(true, Ordering::Release);
            j.first_skipped.fetch_min(0, Ordering::AcqRel);
            self.shared.piece_done(&j);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Pins the calling thread to `cpu` (best effort: a CPU outside the allowed set is ignored).
fn pin_to(cpu: usize) {
    use rustix::thread::{sched_setaffinity, CpuSet};
    if cpu >= CpuSet::MAX_CPU {
        return;
    }
    let mut set = CpuSet::new();
    set.set(cpu);
    let _ = sched_setaffinity(None, &set);
}

// ---------------------------------------------------------------------------------------------
// The queue (submitting thread).
// ---------------------------------------------------------------------------------------------

/// A DMA queue of one device context: submit jobs, poll their completions. Not `Send` (it
/// uses the context); the engines it feeds are other threads.
pub struct DmaQueue {
    ctx: Context,
    transport: Arc<dyn Transport>,
    eng: Arc<EngShared>,
    q: Arc<QShared>,
    depth: usize,
    next_seq: std::cell::Cell<u64>,
    last: std::cell::RefCell<Option<Arc<JobRun>>>,
    cache: std::cell::RefCell<Vec<(Mem, Arc<Mapping>)>>,
}

impl std::fmt::Debug for DmaQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaQueue")
            .field("node", &self.ctx.node().slot())
            .field("depth", &self.depth)
            .finish()
    }
}

impl DmaQueue {
    /// A queue of context `ctx` feeding `engines`, with at most `depth` jobs outstanding.
    pub fn new(ctx: &Context, engines: &DmaEngines, depth: usize) -> Self {
        Self {
            ctx: ctx.clone(),
            transport: ctx.transport(),
            eng: engines.shared.clone(),
            q: QShared::new(),
            depth: depth.max(1),
            next_seq: std::cell::Cell::new(0),
            last: std::cell::RefCell::new(None),
            cache: std::cell::RefCell::new(Vec::new()),
        }
    }

    /// Submits a job. Refused (`Err`) only when the queue is full or the job has no segments
    /// or too many; every other problem completes the job with an error status.
    pub fn submit(&self, job: &Job<'_>) -> Result<(), DmaError> {
        if job.segments.is_empty() || job.segments.len() > MAX_SEGMENTS {
            return Err(DmaError::Invalid(format!(
                "a job has 1..={MAX_SEGMENTS} segments, not {}",
                job.segments.len()
            )));
        }
        let seq = self.next_seq.get();
        self.next_seq.set(seq + 1);
        let (maps, segs, rejected) = match self.resolve(job.segments) {
            Ok((m, s)) => (m, s, None),
            Err(e) => (Vec::new(), Vec::new(), Some(e)),
        };
        let after = if job.chain {
            self.last.borrow().clone()
        } else {
            None
        };
        let j = JobRun::new(job, seq, after, &self.q, maps, segs, rejected);
        {
            // One lock: room, registration, and the fence (park the job, or start it below).
            let mut q = lock(&self.q.st);
            if q.live.len() >= self.depth {
                return Err(DmaError::Full(q.live.len()));
            }
            q.live.insert(seq, j.clone());
            *self.last.borrow_mut() = Some(j.clone());
            if !q.eligible(&j) {
                q.blocked.push_back(j);
                return Ok(());
            }
        }
        self.eng.start(j, true);
        Ok(())
    }

    /// Cancels every outstanding job with id `id`: pieces not yet started are skipped. Returns
    /// how many jobs were outstanding with that id.
    pub fn cancel(&self, id: u64) -> usize {
        let (n, parked) = self.q.cancel(id);
        for j in parked {
            // Parked behind a fence: nothing of it started; start() finishes it as cancelled.
            self.eng.start(j, false);
        }
        n
    }

    /// Takes up to `out.len()` completions.
    pub fn poll(&self, out: &mut [DmaWc]) -> usize {
        self.q.poll(out)
    }

    /// Sleeps until at least `min` completions can be polled (fewer if fewer jobs are
    /// outstanding) or `timeout` passes; returns how many can be polled.
    pub fn wait(&self, min: usize, timeout: Option<Duration>) -> usize {
        self.q.wait(min, timeout)
    }

    /// Jobs submitted and not yet completed.
    pub fn outstanding(&self) -> usize {
        lock(&self.q.st).live.len()
    }

    /// The mapping of `m`, from the cache when it is still registered and its node current.
    fn mapping(&self, m: Mem) -> Result<Arc<Mapping>, DmaStatus> {
        let mut cache = self.cache.borrow_mut();
        if let Some(i) = cache.iter().rposition(|(k, _)| *k == m) {
            let map = cache[i].1.clone();
            match map.live() {
                Ok(()) => {
                    if i + 1 != cache.len() {
                        let e = cache.remove(i);
                        cache.push(e); // most recently used last
                    }
                    return Ok(map);
                }
                Err(_) => {
                    cache.remove(i);
                }
            }
        }
        let map = Arc::new(self.map_new(m)?);
        if cache.len() >= MAP_CACHE {
            cache.remove(0);
        }
        cache.push((m, map.clone()));
        Ok(map)
    }

    fn map_new(&self, m: Mem) -> Result<Mapping, DmaStatus> {
        let me = self.ctx.node();
        match m {
            Mem::Local { lkey } => {
                me.check_current().map_err(|_| DmaStatus::NodeDown)?;
                self.ctx.with_local_mr(lkey, |mr| {
                    let mr = mr.ok_or(DmaStatus::InvalidRegion)?;
                    let state = Word32::at(&mr.header, MR_STATE_OFF as u64)
                        .map_err(|_| DmaStatus::InvalidRegion)?;
                    // fstat of a memfd we hold does not fail; if it did, the mapping's address
                    // stands in (unique, so two such mappings are never seen as one region).
                    let ident = rustix::fs::fstat(mr.header.fd())
                        .map(|s| (s.st_dev, s.st_ino))
                        .unwrap_or((u64::MAX, mr.data.addr(0) as u64));
                    Ok(Mapping {
                        transport: self.transport.clone(),
                        bytes: MapBytes::Local {
                            data: mr.data.clone(),
                            state,
                        },
                        readable: true,
                        writable: mr.access.contains(AccessFlags::LOCAL_WRITE),
                        ident,
                        owner: (me.slot(), me.generation()),
                    })
                })
            }
            Mem::Remote { node, rkey } => {
                if node == 0 {
                    return Err(DmaStatus::InvalidRegion);
                }
                let info = self.transport.peer(node).ok_or(DmaStatus::InvalidRegion)?;
                if info.state != NodeState::Ready {
                    return Err(DmaStatus::NodeDown);
                }
                let r = self
                    .transport
                    .map_region(GrantRequest::ForDma {
                        slot: me.slot(),
                        node,
                        rkey,
                    })
                    .ok_or_else(|| {
                        if self
                            .transport
                            .peer(node)
                            .is_some_and(|p| p.is_live(info.generation))
                        {
                            DmaStatus::NoGrant
                        } else {
                            DmaStatus::NodeDown
                        }
                    })?;
                let access = AccessFlags::from_bits_retain(r.access_bits());
                Ok(Mapping {
                    transport: self.transport.clone(),
                    readable: access.contains(AccessFlags::REMOTE_READ),
                    writable: r.writable() && access.contains(AccessFlags::REMOTE_WRITE),
                    ident: r.ident(),
                    bytes: MapBytes::Remote(r),
                    owner: (node, info.generation),
                })
            }
        }
    }

    /// Checks every segment (see the module doc) and resolves it to pointers; the first
    /// failing segment's status and index otherwise.
    #[allow(clippy::type_complexity)]
    fn resolve(
        &self,
        segs: &[Segment],
    ) -> Result<(Vec<Arc<Mapping>>, Vec<Resolved>), (DmaStatus, u32)> {
        let mut maps: Vec<(Mem, Arc<Mapping>)> = Vec::new();
        let mut out = Vec::with_capacity(segs.len());
        let mut ranges = Vec::with_capacity(2 * segs.len());
        for (i, s) in segs.iter().enumerate() {
            let i = i as u32;
            let mut get = |m: Mem| -> Result<(usize, Arc<Mapping>), (DmaStatus, u32)> {
                if let Some(k) = maps.iter().position(|(x, _)| *x == m) {
                    return Ok((k, maps[k].1.clone()));
                }
                let map = self.mapping(m).map_err(|e| (e, i))?;
                maps.push((m, map.clone()));
                Ok((maps.len() - 1, map))
            };
            let (_, src) = get(s.src)?;
            let (_, dst) = get(s.dst)?;
            // A copy between two peers' regions goes direct, so both must be mapped here;
            // a transport that cannot (a network) refuses the segment rather than fail later.
            if let (MapBytes::Remote(a), MapBytes::Remote(b)) = (&src.bytes, &dst.bytes) {
                if a.local().is_none() || b.local().is_none() {
                    return Err((DmaStatus::InvalidRegion, i));
                }
            }
            check_segment(
                (src.len(), src.readable),
                (dst.len(), dst.writable),
                s.src_off,
                s.dst_off,
                s.len,
            )
            .map_err(|e| (e, i))?;
            // Every mapping's data starts at the same offset of its memfd (MR_DATA_OFF), so
            // offsets into the data compare across two mappings of one region.
            ranges.push(Range {
                region: src.ident,
                start: s.src_off,
                end: s.src_off + s.len,
                dst: false,
                seg: i,
            });
            ranges.push(Range {
                region: dst.ident,
                start: s.dst_off,
                end: s.dst_off + s.len,
                dst: true,
                seg: i,
            });
            // In bounds (checked just above).
            let (Some(src_end), Some(dst_end)) =
                (src.end(s.src_off, s.len), dst.end(s.dst_off, s.len))
            else {
                return Err((DmaStatus::OutOfBounds, i));
            };
            out.push(Resolved {
                src: src_end,
                dst: dst_end,
                len: s.len,
            });
        }
        if let Some(i) = find_overlap(&mut ranges) {
            return Err((DmaStatus::Overlap, i));
        }
        Ok((maps.into_iter().map(|(_, m)| m).collect(), out))
    }
}

impl Drop for DmaQueue {
    fn drop(&mut self) {
        // Nothing of this queue may run after it is gone: cancel, then wait for the pieces an
        // engine has started (milliseconds at most; bounded in case an engine is stuck).
        let ids: Vec<u64> = lock(&self.q.st).live.values().map(|j| j.id).collect();
        for id in ids {
            self.cancel(id);
        }
        let end = Instant::now() + Duration::from_secs(5);
        while self.outstanding() > 0 && Instant::now() < end {
            self.wait(usize::MAX, Some(Duration::from_millis(10)));
            lock(&self.q.st).done.clear();
        }
    }
}

impl From<FabricError> for DmaError {
    fn from(e: FabricError) -> Self {
        DmaError::Invalid(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::Region;
    use proptest::prelude::*;

    /// A queue and an engine set without threads: the test moves pieces with `step`. Jobs copy
    /// from `src` to `dst`, two shared-memory buffers the test fills and reads back.
    struct Rig {
        eng: Arc<EngShared>,
        q: Arc<QShared>,
        seq: u64,
        last: Option<Arc<JobRun>>,
        src: Option<Span>,
        dst: Option<Span>,
    }

    impl EngShared {
        /// Runs one queued piece in the calling thread; false when none is queued.
        fn step(self: &Arc<Self>) -> bool {
            let x = lock(&self.st).pieces.pop_front();
            match x {
                Some((j, p)) => {
                    let wait = j.run_piece(p);
                    j.settle(p.seg, &wait);
                    self.piece_done(&j);
                    true
                }
                None => false,
            }
        }
    }

    impl Rig {
        fn new(engines: usize, max_piece: u64) -> Self {
            let cfg = DmaConfig {
                engines,
                max_piece,
                ..DmaConfig::default()
            };
            Self {
                eng: EngShared::new(&cfg),
                q: QShared::new(),
                seq: 0,
                last: None,
                src: None,
                dst: None,
            }
        }
        /// Gives the rig a source holding `src` and a zeroed destination of `dst_len` bytes.
        fn buffers(&mut self, src: &[u8], dst_len: usize) {
            let s = Arc::new(Region::create("bp-dma-test", src.len()).unwrap());
            s.write(0, src).unwrap();
            let d = Arc::new(Region::create("bp-dma-test", dst_len).unwrap());
            self.src = Some(Span::whole(&s));
            self.dst = Some(Span::whole(&d));
        }
        /// The destination's bytes.
        fn dst(&self) -> Vec<u8> {
            let d = self.dst.as_ref().unwrap();
            let mut v = vec![0u8; d.len() as usize];
            d.read(0, &mut v).unwrap();
            v
        }
        /// Submits segments (source offset, destination offset, length) between the rig's
        /// buffers, as `DmaQueue::submit` does.
        fn submit(&mut self, id: u64, segs: &[(usize, usize, u64)], fence: bool, chain: bool) {
            let job = Job {
                id,
                segments: &[],
                fence,
                chain,
            };
            let (src, dst) = (self.src.as_ref().unwrap(), self.dst.as_ref().unwrap());
            let segs = segs
                .iter()
                .map(|&(s, d, len)| Resolved {
                    src: End::Local(src.sub(s as u64, len).unwrap()),
                    dst: End::Local(dst.sub(d as u64, len).unwrap()),
                    len,
                })
                .collect();
            let after = if chain { self.last.clone() } else { None };
            let j = JobRun::new(&job, self.seq, after, &self.q, Vec::new(), segs, None);
            self.seq += 1;
            self.last = Some(j.clone());
            let mut q = lock(&self.q.st);
            q.live.insert(j.seq, j.clone());
            if !q.eligible(&j) {
                q.blocked.push_back(j);
                return;
            }
            drop(q);
            self.eng.start(j, true);
        }
        fn drain(&self) {
            while self.eng.step() {}
        }
        fn done(&self) -> Vec<DmaWc> {
            let mut out = vec![DmaWc::default(); 64];
            let n = self.q.poll(&mut out);
            out.truncate(n);
            out
        }
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn a_fenced_job_starts_after_earlier_ones_and_unfenced_ones_do_not_wait_for_it() {
        let mut r = Rig::new(1, 1 << 20);
        let src = pattern(4 << 20, 1);
        r.buffers(&src, 8 << 20);
        let (s0, d0, d1, d2) = (0, 0, 4 << 20, 6 << 20);
        r.submit(1, &[(s0, d0, 4 << 20)], false, false); // 4 pieces, queued
        r.submit(2, &[(s0, d1, 1 << 20)], true, false); // fenced: parked
        r.submit(3, &[(s0, d2, 100)], false, false); // small, unfenced: copied inline
        assert_eq!(r.done().iter().map(|w| w.id).collect::<Vec<_>>(), [3]);
        assert_eq!(lock(&r.q.st).blocked.len(), 1);
        r.drain();
        let done = r.done();
        assert_eq!(done.iter().map(|w| w.id).collect::<Vec<_>>(), [1, 2]);
        assert!(done.iter().all(|w| w.status.is_ok() && w.segment.is_none()));
        assert_eq!(done[0].bytes, 4 << 20);
        let dst = r.dst();
        assert_eq!(&dst[..4 << 20], &src[..]);
        assert_eq!(&dst[4 << 20..5 << 20], &src[..1 << 20]);
        assert_eq!(&dst[6 << 20..(6 << 20) + 100], &src[..100]);
    }

    #[test]
    fn cancelling_skips_segments_not_started_and_a_chained_job_behind_it_is_cancelled() {
        let mut r = Rig::new(1, 8 << 20);
        let src = pattern(4 << 20, 7);
        r.buffers(&src, 8 << 20);
        let mb = 1usize << 20;
        let segs: Vec<_> = (0..4).map(|i| (i * mb, i * mb, mb as u64)).collect();
        r.submit(10, &segs, false, false);
        r.submit(11, &[(0, 4 * mb, 64)], false, true);
        r.submit(12, &[(0, 5 * mb, 64 << 10)], true, false);
        assert!(r.eng.step(), "segment 0 runs");
        let (n, parked) = r.q.cancel(10);
        assert_eq!((n, parked.len()), (1, 0));
        r.drain();
        let done = r.done();
        let w: Vec<_> = done
            .iter()
            .map(|w| (w.id, w.status, w.segment, w.bytes))
            .collect();
        assert_eq!(
            w,
            [
                (10, DmaStatus::Cancelled, Some(1), mb as u64),
                (11, DmaStatus::Cancelled, Some(0), 0),
                (12, DmaStatus::Success, None, 64 << 10),
            ]
        );
        let dst = r.dst();
        assert_eq!(&dst[..mb], &src[..mb]);
        assert!(
            dst[mb..5 * mb].iter().all(|&b| b == 0),
            "skipped segments untouched"
        );
        assert_eq!(&dst[5 * mb..5 * mb + (64 << 10)], &src[..64 << 10]);
    }

    #[test]
    fn a_job_parked_behind_a_fence_is_cancelled_at_once_and_releases_nothing_early() {
        let mut r = Rig::new(1, 8 << 20);
        let src = pattern(1 << 20, 3);
        r.buffers(&src, 2 << 20);
        r.submit(1, &[(0, 0, 1 << 20)], false, false);
        r.submit(2, &[(0, 1 << 20, 1 << 20)], true, false);
        let (n, parked) = r.q.cancel(2);
        assert_eq!((n, parked.len()), (1, 1));
        for j in parked {
            r.eng.start(j, false);
        }
        assert_eq!(r.done()[0].status, DmaStatus::Cancelled);
        r.drain();
        assert_eq!(r.done()[0].status, DmaStatus::Success);
        assert!(r.dst()[1 << 20..].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_rejected_job_completes_with_its_status_and_segment_and_copies_nothing() {
        let r = Rig::new(1, 8 << 20);
        let job = Job::new(5, &[]);
        let j = JobRun::new(
            &job,
            0,
            None,
            &r.q,
            vec![],
            vec![],
            Some((DmaStatus::OutOfBounds, 3)),
        );
        lock(&r.q.st).live.insert(0, j.clone());
        r.eng.start(j, true);
        let w = r.done();
        assert_eq!(
            (w[0].id, w[0].status, w[0].segment, w[0].bytes),
            (5, DmaStatus::OutOfBounds, Some(3), 0)
        );
    }

    #[test]
    fn engine_threads_run_many_jobs_of_many_segments_and_wait_returns_their_completions() {
        let e = DmaEngines::start(&DmaConfig {
            engines: 2,
            inline_threshold: 0,
            max_piece: 1 << 20,
            ..DmaConfig::default()
        })
        .unwrap();
        let mut r = Rig::new(2, 1 << 20);
        r.eng = e.shared.clone();
        let src = pattern(3 << 20, 9);
        r.buffers(&src, 3 << 20);
        // 48 jobs: 16 of 1000 scattered 64-byte segments, 32 splitting 64 KiB..2 MiB segments.
        let mut want = Vec::new();
        for k in 0..16usize {
            let segs: Vec<_> = (0..1000)
                .map(|i| {
                    let o = k * 64_000 + i * 64;
                    // o + 64 <= 1 024 000 < 3 MiB.
                    (o, o, 64)
                })
                .collect();
            r.submit(k as u64, &segs, false, false);
            want.push(k as u64);
        }
        let big = 1_100_000usize;
        for k in 0..32usize {
            let len = (64 << 10) + k * 60_000;
            let o = big + (k % 2) * (len.min(900_000));
            let len = len
                .min(2 * (1 << 20) - o % (1 << 20))
                .min(3 * (1 << 20) - o);
            // o + len <= 3 MiB by the clamps above.
            r.submit(100 + k as u64, &[(o, o, len as u64)], true, false);
            want.push(100 + k as u64);
        }
        let mut got = Vec::new();
        while got.len() < want.len() {
            assert!(r.q.wait(want.len() - got.len(), Some(Duration::from_secs(20))) > 0);
            got.extend(r.done());
        }
        assert!(got.iter().all(|w| w.status.is_ok()), "{got:?}");
        let mut ids: Vec<u64> = got.iter().map(|w| w.id).collect();
        ids.sort();
        assert_eq!(ids, want);
        assert_eq!(&r.dst()[..1_024_000], &src[..1_024_000]);
        drop(e);
    }

    #[test]
    fn dropping_the_engines_cancels_queued_pieces_and_later_jobs() {
        let e = DmaEngines::start(&DmaConfig::default()).unwrap();
        let mut r = Rig::new(1, 8 << 20);
        r.eng = e.shared.clone();
        drop(e);
        let src = pattern(1 << 20, 1);
        r.buffers(&src, 1 << 20);
        r.submit(1, &[(0, 0, 1 << 20)], false, false);
        let w = r.done();
        assert_eq!((w[0].status, w[0].segment), (DmaStatus::Cancelled, Some(0)));
        assert!(r.dst().iter().all(|&b| b == 0));
    }

    fn covered(lens: &[u64], pieces: &[PieceSpec]) -> Vec<Vec<(u64, u64)>> {
        let mut cov = vec![Vec::new(); lens.len()];
        for p in pieces {
            if p.nseg == 1 {
                cov[p.seg as usize].push((p.off, p.off + p.len));
            } else {
                for s in p.seg..p.seg + p.nseg {
                    cov[s as usize].push((0, lens[s as usize]));
                }
            }
        }
        cov
    }

    #[test]
    fn segments_are_refused_for_direction_before_bounds_and_at_either_end() {
        assert_eq!(check_segment((100, true), (100, true), 0, 0, 100), Ok(()));
        assert_eq!(check_segment((100, true), (100, true), 100, 0, 0), Ok(()));
        let oob = Err(DmaStatus::OutOfBounds);
        assert_eq!(check_segment((100, true), (100, true), 1, 0, 100), oob);
        assert_eq!(check_segment((100, true), (100, true), 0, 1, 100), oob);
        assert_eq!(check_segment((100, true), (100, true), u64::MAX, 0, 2), oob);
        assert_eq!(check_segment((100, true), (100, true), 0, 0, u64::MAX), oob);
        let denied = Err(DmaStatus::AccessDenied);
        assert_eq!(check_segment((100, false), (100, true), 0, 0, 1), denied);
        assert_eq!(check_segment((100, true), (100, false), 500, 0, 1), denied);
    }

    proptest! {
        #[test]
        fn an_accepted_segment_lies_inside_both_regions(
            sl in 0u64..10_000, dl in 0u64..10_000,
            so in prop_oneof![0u64..12_000, Just(u64::MAX), (u64::MAX - 100)..u64::MAX],
            d_o in prop_oneof![0u64..12_000, Just(u64::MAX)],
            len in prop_oneof![0u64..12_000, Just(u64::MAX)],
        ) {
            let inside = |size: u64, off: u64| (off as u128) + (len as u128) <= size as u128;
            let r = check_segment((sl, true), (dl, true), so, d_o, len);
            prop_assert_eq!(r.is_ok(), inside(sl, so) && inside(dl, d_o));
        }

        #[test]
        fn pieces_cover_every_byte_of_every_segment_exactly_once(
            lens in proptest::collection::vec(
                prop_oneof![0u64..5000, 0u64..(300 << 10), (1u64 << 20)..(40 << 20)], 1..40),
            engines in 1usize..5,
            max_piece in (64u64 << 10)..(16 << 20),
        ) {
            let pieces = plan(&lens, engines, max_piece);
            let cap = max_piece.div_ceil(PIECE_ALIGN) * PIECE_ALIGN;
            for p in &pieces {
                prop_assert!(p.nseg >= 1);
                if p.nseg > 1 {
                    prop_assert!(p.len <= BATCH && p.off == 0);
                    let sum: u64 = lens[p.seg as usize..(p.seg + p.nseg) as usize].iter().sum();
                    prop_assert_eq!(sum, p.len);
                } else if lens[p.seg as usize] >= SPLIT_MIN {
                    prop_assert!(p.len <= cap && p.len > 0 && p.off % PIECE_ALIGN == 0);
                }
            }
            for (i, mut c) in covered(&lens, &pieces).into_iter().enumerate() {
                c.sort();
                let mut at = 0;
                for (a, b) in &c {
                    prop_assert_eq!(*a, at, "segment {} has a gap or overlap", i);
                    at = *b;
                }
                prop_assert_eq!(at, lens[i], "segment {} not covered to its end", i);
                if lens[i] >= SPLIT_MIN {
                    // Large segments are spread over the engines.
                    prop_assert!(c.len() >= engines.min((lens[i] / PIECE_ALIGN) as usize / 2).max(1));
                }
            }
        }

        #[test]
        fn the_one_pass_check_agrees_with_the_sort_on_jobs_between_two_regions(
            segs in proptest::collection::vec((0u64..300, 0u64..300, 0u64..40), 1..30),
            same in any::<bool>(),
        ) {
            let mut ranges = Vec::new();
            for (i, &(so, d_o, len)) in segs.iter().enumerate() {
                let seg = i as u32;
                let r = |region, start: u64, dst| Range { region, start, end: start + len, dst, seg };
                ranges.push(r((0, 1), so, false));
                ranges.push(r((0, if same { 1 } else { 2 }), d_o, true));
            }
            let mut sorted = ranges.clone();
            let quick = plainly_disjoint(&ranges);
            let slow = {
                // The sweep alone, without the one-pass shortcut.
                sorted.sort_unstable_by_key(|r| (r.region, r.start, r.end, r.seg));
                let naive = (0..sorted.len()).any(|a| (0..sorted.len()).any(|b| {
                    let (x, y) = (&sorted[a], &sorted[b]);
                    a != b && x.region == y.region && (x.dst || y.dst)
                        && x.start < y.end && y.start < x.end && x.end > x.start && y.end > y.start
                }));
                !naive
            };
            if quick {
                prop_assert!(slow, "the one-pass check missed an overlap");
            }
            prop_assert_eq!(find_overlap(&mut ranges).is_none(), slow);
        }

        #[test]
        fn overlap_is_found_exactly_when_a_destination_meets_another_range(
            raw in proptest::collection::vec((0u64..2, 0u64..200, 0u64..40, any::<bool>()), 1..30),
        ) {
            // Two ranges per segment: (region, start, len, ...) pairs taken two at a time.
            let mut ranges: Vec<Range> = raw
                .iter()
                .enumerate()
                .map(|(k, &(reg, start, len, _))| Range {
                    region: (0, reg),
                    start,
                    end: start + len,
                    dst: k % 2 == 1,
                    seg: (k / 2) as u32,
                })
                .collect();
            let naive = (0..ranges.len()).any(|a| {
                (0..ranges.len()).any(|b| {
                    let (x, y) = (&ranges[a], &ranges[b]);
                    a != b
                        && x.region == y.region
                        && (x.dst || y.dst)
                        && x.start < y.end
                        && y.start < x.end
                        && x.end > x.start
                        && y.end > y.start
                })
            });
            let found = find_overlap(&mut ranges);
            prop_assert_eq!(found.is_some(), naive);
        }
    }

    #[test]
    fn overlap_names_the_later_segment_of_the_pair() {
        let r = |seg, start, end, dst| Range {
            region: (1, 1),
            start,
            end,
            dst,
            seg,
        };
        // Segment 0 writes [0, 100); segment 3 reads [50, 60): 3 is blamed.
        let mut v = vec![
            r(0, 0, 100, true),
            r(3, 50, 60, false),
            r(2, 200, 300, false),
        ];
        assert_eq!(find_overlap(&mut v), Some(3));
        // Two sources may overlap; a source and a destination of another region may too.
        let mut v = vec![r(0, 0, 100, false), r(1, 50, 60, false)];
        assert_eq!(find_overlap(&mut v), None);
        // A segment reading and writing overlapping bytes of one region is blamed alone.
        let mut v = vec![r(4, 0, 100, false), r(4, 99, 199, true)];
        assert_eq!(find_overlap(&mut v), Some(4));
    }
}
