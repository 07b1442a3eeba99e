//! Queue pairs between hosts: the bridge mirrors a QP's block into the shadow of it that the
//! other host keeps, so that RC and UC queue pairs on two hosts talk exactly as on one.
//!
//! On one host a connected QP writes its messages into its peer's inbound ring and its
//! reliability words (credits, NAK, RNR timer, gone, and the consumer index of its own
//! inbound ring) into its peer's block; it reads its peer's words in its own block. Across
//! hosts the peer's block is a *shadow* in the peer node's shadow window here: the local QP
//! writes into it as into a real one. Each host's bridge then carries what its local QP wrote
//! into the shadow — the new ring bytes, at the same ring positions, and the words — to the
//! other host, whose bridge writes them into the real block of the QP there, and rings its
//! event bell like a peer would. The ring's bytes are copied, not parsed: the receiving QP
//! validates every record as it does on one host, and positions are the same on both sides
//! (the shadow ring has the size of the real one), so the consumer index the receiving QP
//! publishes acknowledges exactly the sender's bytes. A sender never has more in flight than
//! the real ring can hold: the consumer index it waits on comes back from the real ring.
//!
//! One-sided operations (RDMA WRITE, READ, atomics) of the local QP go through the shadow's
//! one-sided area (`wire::verbs::RDMA_*`): the local QP's process puts requests into its
//! request ring; this bridge ships them to the other host's bridge, which carries them out on
//! the peer QP's region (granted to it by its supervisor, [`Mirror::add_region`]) after the
//! same checks as on one host, and answers; the answer is written back here — READ data and
//! atomic values into the response ring, then the id of the last finished request. Requests
//! are shipped before the QP ring bytes the local QP published after them, and both travel in
//! order on one UCX endpoint: a WRITE lands before a SEND posted after it is seen.
//!
//! A mirror ships nothing before the other host's bridge said it has the pair too
//! ([`encode_ready`]): what went before would be dropped there. Every value from the other
//! host is checked: a ring position that goes backwards, skips, or would overwrite unread
//! bytes breaks the pair (the local QP sees its peer gone).
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::Arc;

use crate::mem::{MemError, Region, Span, Word32, Word64};
use crate::sync::Ordering;
use crate::transport::shm::{ShmReceiver, ShmRegion, ShmRing, ShmSender};
use crate::transport::{CopyKind, RecvChannel, RemoteRegion, SendChannel};
use crate::wire::verbs::{
    rdma_area_at, rdma_footprint, rdma_ring_len, EV_ARMED_OFF, EV_BELL_OFF, EV_LEN, QP_ACCESS_OFF,
    QP_ACK_OFF, QP_CREDITS_OFF, QP_MIN_RING, QP_NAK_OFF, QP_PEER_ERR_OFF, QP_PEER_RNR_OFF,
    QP_RING_OFF, QP_TAIL_OFF, RDMA_DONE_OFF, RDMA_FAILED_OFF, RDMA_GONE_OFF, RDMA_OP_CMP_SWAP,
    RDMA_OP_FETCH_ADD, RDMA_OP_READ, RDMA_OP_WRITE, RDMA_PIECE, RDMA_REQ_HEAD, RDMA_REQ_HEAD_OFF,
    RDMA_REQ_TAIL_OFF, RDMA_RESP_HEAD, RDMA_RESP_HEAD_OFF, RDMA_RESP_TAIL_OFF, RDMA_RING_OFF,
};

/// `IBV_ACCESS_REMOTE_WRITE`, `_READ`, `_ATOMIC`.
const REMOTE_WRITE: u32 = 1 << 1;
const REMOTE_READ: u32 = 1 << 2;
const REMOTE_ATOMIC: u32 = 1 << 3;
/// `IBV_WC_REM_ACCESS_ERR`: what a refused one-sided request answers.
const REM_ACCESS_ERR: u32 = 10;
/// `IBV_WC_REM_INV_REQ_ERR`: a malformed request.
const REM_INV_REQ_ERR: u32 = 9;
/// An answer's header after the two QP keys: id, status, op, value.
pub(crate) const ANSWER_HEAD: usize = 16 + 24;
use crate::wire::RECORD_ALIGN;

/// How many buffers of answers that went out a mirror keeps for the next ones.
const SPARE_ANSWERS: usize = 8;

/// At most this many ring bytes go in one message.
pub(crate) const CHUNK: u64 = 256 * 1024;
/// A mirror message's header (after the bridge's own): two QP keys, the words, where the
/// ring bytes that follow start.
pub(crate) const MSG_HEAD: usize = 72;
/// The largest mirror message: its header and a chunk of ring bytes.
pub(crate) const MSG_MAX: usize = MSG_HEAD + CHUNK as usize;

/// A QP block in a window of this host: a real QP's, or a shadow's.
#[derive(Clone)]
pub(crate) struct QpBlock {
    /// The window (a node's, or a shadow window).
    pub(crate) win: Arc<Region>,
    /// The block's offset.
    pub(crate) off: u64,
    /// Its inbound ring's size.
    pub(crate) ring_len: u32,
    /// The event block its peers ring.
    pub(crate) event_off: u64,
    /// A shadow's one-sided area (ignored for the local QP's block).
    pub(crate) rdma_off: u64,
}

/// A block no QP uses, in memory of the bridge's own, for an end of a *DMA pair* (a
/// process's DMA engines reaching a region of another host): the requesting end has no QP of
/// its own, the region's end neither a QP nor requests of its own. A mirror of two such ends
/// carries only one-sided requests and their answers. `access` is the end's QP access word:
/// every remote right at the region's end (the region's own flags decide, as for a DMA grant
/// on one host), none at the other.
pub(crate) fn bare_block(access: u32) -> Result<QpBlock, MemError> {
    let ring_len = QP_MIN_RING;
    let rdma_off = rdma_area_at(ring_len);
    let event_off = rdma_off + rdma_footprint(ring_len);
    let len = usize::try_from(event_off + EV_LEN).expect("a few MiB");
    let win = Arc::new(Region::create("bp-dma-pair", len)?);
    Word32::at(&win, QP_ACCESS_OFF as u64)?.store(access, Ordering::Release);
    Ok(QpBlock {
        win,
        off: 0,
        ring_len,
        event_off,
        rdma_off,
    })
}

/// Every remote right: the access word of a DMA pair's end at the region.
pub(crate) const DMA_TARGET_ACCESS: u32 = REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC;

/// The one-sided area of the shadow: the local QP's requests and their answers.
struct Rdma {
    req: ShmReceiver,
    resp: ShmSender,
    done: Word64,
    failed: Word64,
    gone: Word32,
}

impl Rdma {
    fn of(b: &QpBlock) -> Result<Self, MemError> {
        let w = &b.win;
        let at = |o: usize| b.rdma_off + o as u64;
        let len = u64::from(rdma_ring_len(b.ring_len));
        let req = ShmRing::new(
            Word64::at(w, at(RDMA_REQ_TAIL_OFF))?,
            Word64::at(w, at(RDMA_REQ_HEAD_OFF))?,
            Span::new(w, b.rdma_off + RDMA_RING_OFF, len)?,
        );
        let resp = ShmRing::new(
            Word64::at(w, at(RDMA_RESP_TAIL_OFF))?,
            Word64::at(w, at(RDMA_RESP_HEAD_OFF))?,
            Span::new(w, b.rdma_off + RDMA_RING_OFF + len, len)?,
        );
        Ok(Self {
            req: ShmReceiver::new(req),
            resp: ShmSender::new(resp),
            done: Word64::at(w, at(RDMA_DONE_OFF))?,
            failed: Word64::at(w, at(RDMA_FAILED_OFF))?,
            gone: Word32::at(w, at(RDMA_GONE_OFF))?,
        })
    }
}

struct Words {
    ack: Word64,
    credits: Word64,
    nak: Word64,
    peer_err: Word32,
    rnr: Word32,
    access: Word32,
    tail: Word64,
    ring: Span,
    armed: Word32,
    bell: Word32,
}

impl Words {
    fn of(b: &QpBlock) -> Result<Self, MemError> {
        let w = &b.win;
        let at32 = |o: usize| Word32::at(w, b.off + o as u64);
        let at64 = |o: usize| Word64::at(w, b.off + o as u64);
        Ok(Self {
            ack: at64(QP_ACK_OFF)?,
            credits: at64(QP_CREDITS_OFF)?,
            nak: at64(QP_NAK_OFF)?,
            peer_err: at32(QP_PEER_ERR_OFF)?,
            rnr: at32(QP_PEER_RNR_OFF)?,
            access: at32(QP_ACCESS_OFF)?,
            tail: at64(QP_TAIL_OFF)?,
            ring: Span::new(w, b.off + QP_RING_OFF, u64::from(b.ring_len))?,
            armed: Word32::at(w, b.event_off + EV_ARMED_OFF as u64)?,
            bell: Word32::at(w, b.event_off + EV_BELL_OFF as u64)?,
        })
    }

    /// Rings the block's event bell if its owner sleeps on it (after our stores).
    fn wake(&self) {
        // SYNC POINT qp-bell (sender), as a peer QP's `wake_peer`.
        crate::sync::fence(Ordering::SeqCst);
        if self.armed.load(Ordering::Relaxed) != 0 {
            crate::sync::ring(&self.bell);
        }
    }
}

/// What the local QP told its peer (read from the shadow, and its own access word).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Snap {
    ack: u64,
    nak: u64,
    credits: u64,
    gone: u32,
    rnr: u32,
    access: u32,
}

/// Finds the local QP's region of an rkey (checked against the QP's protection domain).
pub(crate) type RegionLookup = Box<dyn Fn(u32) -> Option<Arc<ShmRegion>> + Send>;

/// One local QP and the shadow of its peer on another host.
pub(crate) struct Mirror {
    /// The other host.
    pub(crate) host: usize,
    /// The local QP (node, QPN).
    pub(crate) local_key: (u32, u32),
    /// The peer QP on the other host (node, QPN).
    pub(crate) remote_key: (u32, u32),
    local: Words,
    shadow: Words,
    rdma: Rdma,
    /// The local QP's regions granted to the other host's QP, by rkey.
    regions: rustc_hash::FxHashMap<u32, Arc<ShmRegion>>,
    /// Answers to the other host's requests that UCX could not take yet.
    pub(crate) answers: VecDeque<Vec<u8>>,
    /// Buffers of answers that went out, for the next ones ([`Mirror::answer_buf`]).
    spare: Vec<Vec<u8>>,
    /// The id of the last request of the local QP shipped (answers must stay at or below it).
    asked_id: u64,
    /// The other bridge has this pair too: shipping may start.
    pub(crate) ready: bool,
    /// The pair is broken (a bad value from either side), and why: nothing more is carried.
    pub(crate) broken: Option<&'static str>,
    /// The two processes carry this pair themselves (`verbs::direct`): a bridge's mirror of
    /// it never becomes ready, it only ends the pair.
    pub(crate) direct: bool,
    /// Where regions not granted through [`Mirror::add_region`] are looked up (a process's
    /// own regions, for a direct pair).
    pub(crate) lookup: Option<RegionLookup>,
    /// Shadow ring position shipped so far.
    shipped: u64,
    /// The words last shipped (None: nothing yet).
    last: Option<Snap>,
    /// Local ring position written so far (from the other host).
    applied: u64,
}

const MALFORMED: &str = "a malformed mirror message from the other host";
const POSITION: &str = "ring bytes from the other host out of place";
const OVERRUN: &str = "the other host sent more than the ring holds unread";
const LOCAL_POSITION: &str = "the local QP published an impossible ring position";

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The two QP keys a mirror message or ready note names: (sender's QP, receiver's QP).
pub(crate) fn keys(body: &[u8]) -> Option<((u32, u32), (u32, u32))> {
    if body.len() < 16 {
        return None;
    }
    Some((
        (u32_at(body, 0), u32_at(body, 4)),
        (u32_at(body, 8), u32_at(body, 12)),
    ))
}

/// The note that this bridge has the pair (local QP `from`, remote QP `to`).
pub(crate) fn encode_ready(from: (u32, u32), to: (u32, u32)) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&from.0.to_le_bytes());
    b[4..8].copy_from_slice(&from.1.to_le_bytes());
    b[8..12].copy_from_slice(&to.0.to_le_bytes());
    b[12..16].copy_from_slice(&to.1.to_le_bytes());
    b
}

impl Mirror {
    pub(crate) fn new(
        host: usize,
        local_key: (u32, u32),
        remote_key: (u32, u32),
        local: &QpBlock,
        shadow: &QpBlock,
    ) -> Result<Self, MemError> {
        let local = Words::of(local)?;
        let rdma = Rdma::of(shadow)?;
        let shadow = Words::of(shadow)?;
        // Whatever the local QP already wrote into the shadow goes with the first message.
        Ok(Self {
            host,
            local_key,
            remote_key,
            local,
            shadow,
            rdma,
            regions: rustc_hash::FxHashMap::default(),
            answers: VecDeque::new(),
            spare: Vec::new(),
            asked_id: 0,
            ready: false,
            broken: None,
            direct: false,
            lookup: None,
            shipped: 0,
            last: None,
            applied: 0,
        })
    }

    fn snap(&self) -> Snap {
        // SYNC POINT qp-peer-gone (acquire): the local QP's acks and NAKs before its flag.
        let gone = self.shadow.peer_err.load(Ordering::Acquire);
        // SYNC POINT qp-ack (acquire): a NAK is published before the index after it.
        let ack = self.shadow.ack.load(Ordering::Acquire);
        Snap {
            ack,
            nak: self.shadow.nak.load(Ordering::Relaxed),
            // SYNC POINT qp-credits (acquire).
            credits: self.shadow.credits.load(Ordering::Acquire),
            gone,
            rnr: self.shadow.rnr.load(Ordering::Relaxed),
            // SYNC POINT qp-access (acquire).
            access: self.local.access.load(Ordering::Acquire),
        }
    }

    /// Whether the local QP wrote anything not shipped yet.
    pub(crate) fn pending(&self) -> bool {
        self.has_news()
            || (self.ready
                && self.broken.is_none()
                && (!self.rdma.req.is_drained() || !self.answers.is_empty()))
    }

    /// Whether [`Mirror::next_message`] may have a message to make: ring bytes or words not
    /// shipped yet (checked before a message buffer is taken for it).
    pub(crate) fn has_news(&self) -> bool {
        self.ready
            && self.broken.is_none()
            // SYNC POINT ring-publish (acquire).
            && (self.shadow.tail.load(Ordering::Acquire) != self.shipped
                || self.last != Some(self.snap()))
    }

    /// Whether what [`Mirror::has_news`] found may not wait: ring bytes, or a word that ends
    /// or rewinds the peer's sending (gone, NAK, RNR). Acks and credits alone may wait to go
    /// with the next message.
    pub(crate) fn has_urgent_news(&self) -> bool {
        if !self.has_news() {
            return false;
        }
        // SYNC POINT ring-publish (acquire).
        if self.shadow.tail.load(Ordering::Acquire) != self.shipped {
            return true;
        }
        let (now, last) = (self.snap(), self.last.unwrap_or_default());
        self.last.is_none()
            || now.gone != last.gone
            || now.nak != last.nak
            || now.rnr != last.rnr
            || now.access != last.access
    }

    /// Whether the local QP already sees its peer gone (the peer said so, or the pair broke).
    pub(crate) fn peer_gone(&self) -> bool {
        // SYNC POINT qp-peer-gone (acquire).
        self.local.peer_err.load(Ordering::Acquire) != 0
    }

    /// The local QP's ring position now: what [`Mirror::next_message`] may ship after the
    /// requests in the request ring at this moment (read before them).
    pub(crate) fn published(&self) -> u64 {
        // SYNC POINT ring-publish (acquire).
        self.shadow.tail.load(Ordering::Acquire)
    }

    /// The next one-sided request of the local QP, its record bytes in `out` (to ship with
    /// the two QP keys before it); `release` it once UCX took it.
    pub(crate) fn next_request(&mut self, out: &mut Vec<u8>) -> Option<crate::ring::Record> {
        let rec = self.peek_request()?;
        out.clear();
        out.extend_from_slice(&encode_ready(self.local_key, self.remote_key));
        let at = out.len();
        out.resize(at + rec.len, 0);
        // Inside the data area (validated by the consumer).
        let _ = self.rdma.req.data().read(rec.pos, &mut out[at..]);
        Some(rec)
    }

    /// The oldest request in the local QP's request ring, if the pair runs (a ring that
    /// says an impossible position breaks it).
    fn peek_request(&mut self) -> Option<crate::ring::Record> {
        // (Drained — the producer index where this side's head is — is one load: most looks,
        // a SEND's ship asks twice, and a whole peek was ~44 instructions each.)
        if !self.ready || self.broken.is_some() || self.rdma.req.is_drained() {
            return None;
        }
        match self.rdma.req.peek() {
            Ok(r) => r,
            Err(_) => {
                self.fail(LOCAL_POSITION);
                None
            }
        }
    }

    /// The bytes [`Mirror::next_request_into`] would write for the request that waits.
    pub(crate) fn request_len(&mut self) -> Option<usize> {
        let rec = self.peek_request()?;
        Some(encode_ready(self.local_key, self.remote_key).len() + rec.len)
    }

    /// The bytes [`Mirror::next_message`] writes at most now (what it ships of the ring is
    /// bounded by its room).
    pub(crate) fn message_len(&self, upto: u64) -> usize {
        // SYNC POINT ring-publish (acquire).
        let tail = self
            .shadow
            .tail
            .load(Ordering::Acquire)
            .min(upto.max(self.shipped));
        let unsent = tail.saturating_sub(self.shipped).min(CHUNK);
        // (Past the ring's length the position is impossible: `next_message` says so.)
        MSG_HEAD + 1 + unsent as usize
    }

    /// Whether a request waits (for [`Mirror::next_request_into`]).
    pub(crate) fn request_waits(&mut self) -> bool {
        self.peek_request().is_some()
    }

    /// As [`Mirror::next_request`], straight into `out` (a message being sent): the record
    /// and the number of bytes written, `None` if no request waits or it does not fit.
    pub(crate) fn next_request_into(
        &mut self,
        out: &mut [u8],
    ) -> Option<(crate::ring::Record, usize)> {
        let rec = self.peek_request()?;
        let keys = encode_ready(self.local_key, self.remote_key);
        let n = keys.len() + rec.len;
        let Some(out) = out.get_mut(..n) else {
            self.fail(LOCAL_POSITION);
            return None;
        };
        out[..keys.len()].copy_from_slice(&keys);
        // Inside the data area (validated by the consumer).
        let _ = self.rdma.req.data().read(rec.pos, &mut out[keys.len()..]);
        Some((rec, n))
    }

    /// The request that waits, if its WRITE data is not in its record
    /// (`across::REQ_DATA_ELSEWHERE`: a pair this process carries, the data waits in the
    /// pair's queue): its record, the message head to send before the data (the two QP keys
    /// and its header, as [`Mirror::next_request_into`] writes them, the flag cleared), its
    /// id and its data's length. A record that says so but is not a WRITE's header and the
    /// room for its data fails the pair.
    pub(crate) fn next_request_elsewhere(
        &mut self,
    ) -> Option<(crate::ring::Record, [u8; 16 + RDMA_REQ_HEAD], u64, usize)> {
        let rec = self.peek_request()?;
        let mut flag = [0u8; 2];
        // Inside the data area (validated by the consumer); a record shorter reads zeros.
        let _ = self
            .rdma
            .req
            .data()
            .read(rec.pos, &mut flag[..2.min(rec.len)]);
        if flag[1] != crate::transport::across::REQ_DATA_ELSEWHERE {
            return None;
        }
        let mut head = [0u8; 16 + RDMA_REQ_HEAD];
        head[..16].copy_from_slice(&encode_ready(self.local_key, self.remote_key));
        let h = &mut head[16..];
        if rec.len < RDMA_REQ_HEAD || self.rdma.req.data().read(rec.pos, h).is_err() {
            self.fail(LOCAL_POSITION);
            return None;
        }
        h[1] = 0;
        let (id, len) = (u64_at(h, 8), u32_at(h, 20) as usize);
        if h[0] != RDMA_OP_WRITE || len == 0 || len > RDMA_PIECE || rec.len != RDMA_REQ_HEAD + len {
            self.fail(LOCAL_POSITION);
            return None;
        }
        Some((rec, head, id, len))
    }

    /// The request `next_request` gave (its bytes still in `out`) went out.
    pub(crate) fn release_request(&mut self, rec: crate::ring::Record, out: &[u8]) {
        self.release_request_id(rec, out.get(24..32).map(|b| u64_at(b, 0)));
    }

    /// The request `next_request_into` gave went out; `id` is its id (the 8 bytes at 24 of
    /// what it wrote).
    pub(crate) fn release_request_id(&mut self, rec: crate::ring::Record, id: Option<u64>) {
        if let Some(id) = id {
            self.asked_id = self.asked_id.max(id);
        }
        self.rdma.req.release(rec);
    }

    /// A buffer for the answer to a request ([`Mirror::execute`]): one that went out before
    /// if there is one. An answer grew from nothing in three allocations, each on the way
    /// from a request's arrival to its answer's departure.
    pub(crate) fn answer_buf(&mut self) -> Vec<u8> {
        self.spare
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(ANSWER_HEAD + 8))
    }

    /// An answer that went out: its buffer serves a later one (a few are kept, none larger
    /// than a READ piece's answer).
    pub(crate) fn recycle(&mut self, mut answer: Vec<u8>) {
        if self.spare.len() < SPARE_ANSWERS && answer.capacity() <= ANSWER_HEAD + RDMA_PIECE {
            answer.clear();
            self.spare.push(answer);
        }
    }

    /// A region of the local QP granted to the other host's QP.
    pub(crate) fn add_region(&mut self, rkey: u32, mr: Arc<ShmRegion>) {
        self.regions.insert(rkey, mr);
    }

    /// Carries out a request of the other host's QP (`req`: its record, after the keys) on
    /// the local QP's regions, with the checks of one host; the answer (keys, id, status, op,
    /// value, READ data) in `out`.
    pub(crate) fn execute(&mut self, req: &[u8], out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(&encode_ready(self.local_key, self.remote_key));
        if req.len() < RDMA_REQ_HEAD {
            out.extend_from_slice(&[0; 24]);
            out[24..28].copy_from_slice(&REM_INV_REQ_ERR.to_le_bytes());
            return;
        }
        let op = req[0];
        let id = u64_at(req, 8);
        let rkey = u32_at(req, 16);
        let len = u32_at(req, 20) as usize;
        let off = u64_at(req, 24);
        let (a, b) = (u64_at(req, 32), u64_at(req, 40));
        let data = &req[RDMA_REQ_HEAD..];
        out.extend_from_slice(&id.to_le_bytes());
        let status_at = out.len();
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&u32::from(op).to_le_bytes());
        let value_at = out.len();
        out.extend_from_slice(&0u64.to_le_bytes());
        let need = match op {
            RDMA_OP_WRITE => REMOTE_WRITE,
            RDMA_OP_READ => REMOTE_READ,
            RDMA_OP_FETCH_ADD | RDMA_OP_CMP_SWAP => REMOTE_ATOMIC,
            _ => 0,
        };
        // SYNC POINT qp-access (relaxed read of a word that only gates).
        let qp_access = self.local.access.load(Ordering::Relaxed);
        // (A region cached here that went may have been followed by a new one of that rkey.)
        if self.regions.get(&rkey).is_none_or(|r| !r.valid()) {
            if let Some(r) = self.lookup.as_ref().and_then(|f| f(rkey)) {
                self.regions.insert(rkey, r);
            }
        }
        let region = self.regions.get(&rkey).filter(|r| r.valid());
        let ok = need != 0
            && len <= RDMA_PIECE
            && (op != RDMA_OP_WRITE || data.len() == len)
            && qp_access & need != 0
            && region.is_some_and(|r| {
                r.access_bits() & need != 0
                    && off.checked_add(len as u64).is_some_and(|e| e <= r.len())
            });
        let status = match region.filter(|_| ok) {
            None => REM_ACCESS_ERR,
            Some(r) => {
                let done = match op {
                    RDMA_OP_WRITE => r.put_bytes(off, data, CopyKind::Ordered).map(|_| 0),
                    RDMA_OP_READ => {
                        let at = out.len();
                        out.resize(at + len, 0);
                        r.local()
                            .ok_or(MemError::OutOfBounds {
                                off,
                                len: len as u64,
                                size: 0,
                            })
                            .and_then(|(span, _)| span.read(off, &mut out[at..]))
                            .map(|_| 0)
                    }
                    RDMA_OP_FETCH_ADD if len == 8 => r.fetch_add(off, a),
                    RDMA_OP_CMP_SWAP if len == 8 => r.compare_swap(off, a, b),
                    _ => Err(MemError::OutOfBounds {
                        off,
                        len: len as u64,
                        size: 0,
                    }),
                };
                match done {
                    Ok(v) => {
                        out[value_at..value_at + 8].copy_from_slice(&v.to_le_bytes());
                        0
                    }
                    Err(_) => {
                        out.truncate(value_at + 8);
                        REM_ACCESS_ERR
                    }
                }
            }
        };
        out[status_at..status_at + 4].copy_from_slice(&status.to_le_bytes());
    }

    /// An answer from the other host to one of the local QP's requests (after the keys):
    /// READ data and atomic values go into the response ring, then `done` moves past it.
    pub(crate) fn answer(&mut self, body: &[u8]) {
        if body.len() < ANSWER_HEAD - 16 {
            return self.fail(MALFORMED);
        }
        let id = u64_at(body, 0);
        // Answers come in order, each for a request that went out.
        // SYNC POINT rdma-done (relaxed: only this thread writes it).
        if id <= self.rdma.done.load(Ordering::Relaxed) || id > self.asked_id {
            return self.fail(MALFORMED);
        }
        let status = u32_at(body, 8);
        let op = u32_at(body, 12) as u8;
        let value = u64_at(body, 16);
        let data = &body[24..];
        if op != RDMA_OP_WRITE {
            let ok = match self.rdma.resp.reserve(RDMA_RESP_HEAD + data.len()) {
                Ok(r) => {
                    let mut h = [0u8; RDMA_RESP_HEAD];
                    h[0..8].copy_from_slice(&id.to_le_bytes());
                    h[8..12].copy_from_slice(&status.to_le_bytes());
                    h[16..24].copy_from_slice(&value.to_le_bytes());
                    let d = self.rdma.resp.data();
                    let _ = d.write(r.pos, &h);
                    let _ = d.write(r.pos + RDMA_RESP_HEAD as u64, data);
                    self.rdma.resp.commit(r);
                    true
                }
                Err(_) => false,
            };
            if !ok {
                // The requester asked for more than its response ring holds: it fails.
                self.note_failed(id);
            }
        }
        if status != 0 {
            self.note_failed(id);
        }
        // SYNC POINT rdma-done (release): the response record and `failed` are seen first.
        self.rdma.done.store(id, Ordering::Release);
        // A completion channel of the local QP's context may sleep on the word.
        self.local.wake();
    }

    fn note_failed(&self, id: u64) {
        if self.rdma.failed.load(Ordering::Relaxed) == 0 {
            self.rdma.failed.store(id, Ordering::Relaxed);
        }
    }

    /// The shadow's event block (armed flag, bell): the local QP rings it as it writes.
    pub(crate) fn bell(&self) -> (&Word32, &Word32) {
        (&self.shadow.armed, &self.shadow.bell)
    }

    /// The next message to ship, if there is anything new: the header and ring bytes written
    /// at the start of `out` (more than [`MSG_HEAD`] bytes; ring bytes up to [`CHUNK`] or
    /// what `out` has room for), and how many; `None` when there is nothing, or the local QP
    /// published an impossible position (then the pair is broken).
    /// Ring bytes go at most up to `upto` (a position read before the requests shipped), and
    /// not past `stop` where a SEND's payload that is sent in place starts
    /// ([`Mirror::next_message_in_place`] ships it).
    pub(crate) fn next_message(
        &mut self,
        out: &mut [u8],
        upto: u64,
        stop: Option<u64>,
    ) -> Option<(usize, Shipment)> {
        if !self.ready || self.broken.is_some() || out.len() <= MSG_HEAD {
            return None;
        }
        let room = (out.len() - MSG_HEAD) as u64;
        let (snap, tail) = (self.snap(), self.shippable(upto));
        let len = self.shadow.ring.len();
        let Some(unsent) = tail
            .checked_sub(self.shipped)
            .filter(|&n| n <= len && tail.is_multiple_of(RECORD_ALIGN))
        else {
            self.fail(LOCAL_POSITION);
            return None;
        };
        if unsent == 0 && self.last == Some(snap) {
            return None;
        }
        let n = unsent.min(CHUNK).min(room);
        let n = stop.map_or(n, |s| n.min(s.saturating_sub(self.shipped)));
        // The header, written in place (no buffer of its own: one message per post). The
        // receiver publishes the bytes only up to a position the local QP published (a
        // record boundary): a chunk may end inside a record.
        let whole = self.shipped + n == tail;
        self.emit_head(&mut out[..MSG_HEAD], self.shipped + n, &snap, whole);
        // The bytes, in at most two pieces (the ring's end, then its start).
        let mut at = self.shipped;
        let end = self.shipped + n;
        let mut used = MSG_HEAD;
        while at < end {
            let pos = at % len;
            let piece = (len - pos).min(end - at) as usize;
            // In bounds: pos + piece <= len, and used + n <= out.len().
            let _ = self.shadow.ring.read(pos, &mut out[used..used + piece]);
            used += piece;
            at += piece as u64;
        }
        Some((used, Shipment { end, snap }))
    }

    /// Whether a message of at most `max` bytes, after `before` of its own, can ship the ring
    /// from where shipping stands through the SEND payload of `len` bytes at producer index
    /// `at` ([`Mirror::next_message_in_place`]); else what comes before goes first.
    pub(crate) fn in_place_fits(&self, before: usize, (at, len): (u64, u64), max: usize) -> bool {
        at.saturating_sub(self.shipped)
            .saturating_add(len)
            .saturating_add(RECORD_ALIGN + (before + MSG_HEAD) as u64)
            <= max as u64
    }

    /// A message that ships the local QP's ring up to the end of a SEND's record whose
    /// payload, `len` bytes at producer index `at`, the local QP left unwritten (its bytes go
    /// from the program's region in place): appended to `head`, the message header and the
    /// ring bytes from where shipping stands up to `at`; `trailer` gets the record's bytes
    /// after the payload (its alignment). `None` while the record is not published (before
    /// `upto`); a position that cannot be breaks the pair.
    pub(crate) fn next_message_in_place(
        &mut self,
        head: &mut Vec<u8>,
        trailer: &mut Vec<u8>,
        upto: u64,
        (at, len): (u64, u64),
    ) -> Option<Shipment> {
        if !self.ready || self.broken.is_some() {
            return None;
        }
        let (snap, tail) = (self.snap(), self.shippable(upto));
        let ring_len = self.shadow.ring.len();
        let end = at
            .checked_add(len)
            .map(|e| e.next_multiple_of(RECORD_ALIGN));
        let Some(end) = end.filter(|&e| {
            at >= self.shipped
                && e - self.shipped <= CHUNK
                && tail.saturating_sub(self.shipped) <= ring_len
                && at % ring_len + len <= ring_len
        }) else {
            self.fail(LOCAL_POSITION);
            return None;
        };
        if end > tail {
            return None; // not published yet
        }
        let start = head.len();
        head.resize(start + MSG_HEAD, 0);
        // `end` closes a record (the SEND's): the receiver may publish up to it.
        self.emit_head(&mut head[start..], end, &snap, true);
        let read = |from: u64, to: u64, out: &mut Vec<u8>| {
            let mut x = from;
            while x < to {
                let pos = x % ring_len;
                let piece = (ring_len - pos).min(to - x) as usize;
                let at = out.len();
                out.resize(at + piece, 0);
                // In bounds: pos + piece <= ring_len.
                let _ = self.shadow.ring.read(pos, &mut out[at..]);
                x += piece as u64;
            }
        };
        read(self.shipped, at, head);
        trailer.clear();
        read(at + len, end, trailer);
        Some(Shipment { end, snap })
    }

    /// How far the local QP's ring may ship now: its published position, not past `upto`
    /// (nor back before what shipped).
    fn shippable(&self, upto: u64) -> u64 {
        // SYNC POINT ring-publish (acquire): the ring bytes before the index are readable.
        self.shadow
            .tail
            .load(Ordering::Acquire)
            .min(upto.max(self.shipped))
    }

    /// A message's header into `head` ([`MSG_HEAD`] bytes): the QP keys, the ring bytes
    /// from where shipping stands up to `end` (`whole`: `end` closes a record), the words.
    fn emit_head(&self, head: &mut [u8], end: u64, snap: &Snap, whole: bool) {
        head[..16].copy_from_slice(&encode_ready(self.local_key, self.remote_key));
        let mut at = 16;
        for v in [end, snap.ack, snap.nak, snap.credits] {
            head[at..at + 8].copy_from_slice(&v.to_le_bytes());
            at += 8;
        }
        for v in [snap.gone, snap.rnr, snap.access, u32::from(whole)] {
            head[at..at + 4].copy_from_slice(&v.to_le_bytes());
            at += 4;
        }
        head[at..at + 8].copy_from_slice(&self.shipped.to_le_bytes());
        debug_assert_eq!(at + 8, MSG_HEAD);
    }

    /// Where shipping the local QP's ring stands (its next byte's producer index).
    pub(crate) fn shipped_to(&self) -> u64 {
        self.shipped
    }

    /// The message [`Mirror::next_message`] made went out.
    pub(crate) fn shipped(&mut self, s: Shipment) {
        self.shipped = s.end;
        self.last = Some(s.snap);
    }

    /// Writes a message from the other host's bridge into the local QP's block: ring bytes at
    /// their positions, then the words (NAK before the consumer index, gone last), then rings
    /// the QP's bell. A bad message breaks the pair.
    pub(crate) fn apply(&mut self, body: &[u8]) {
        self.apply_with(body, &mut |_, _| 0)
    }

    /// As [`Mirror::apply`], offering the ring bytes first to `deliver` (their ring index, the
    /// bytes from there): it may take whole records from their front where they lie (the
    /// local QP's engine delivering a SEND into its posted receive, `verbs::direct`) and says
    /// how many bytes it took — those are not written into the ring, and the producer index
    /// is published at least past them (the engine's consumer index moved there).
    pub(crate) fn apply_with(&mut self, body: &[u8], deliver: &mut dyn FnMut(u64, &[u8]) -> usize) {
        if self.broken.is_some() {
            return;
        }
        if body.len() < MSG_HEAD {
            return self.fail(MALFORMED);
        }
        let tail = u64_at(body, 16);
        let (ack, nak, credits) = (u64_at(body, 24), u64_at(body, 32), u64_at(body, 40));
        let (gone, rnr, access) = (u32_at(body, 48), u32_at(body, 52), u32_at(body, 56));
        let whole = u32_at(body, 60) != 0;
        let from = u64_at(body, 64);
        let data = &body[MSG_HEAD..];
        let len = self.local.ring.len();
        if from != self.applied || from.checked_add(data.len() as u64) != Some(tail) {
            return self.fail(POSITION);
        }
        // The local QP's consumer index of this ring (it writes it into its peer's block).
        // SYNC POINT ring-consume (acquire): the bytes before it were read.
        let head = self.shadow.ack.load(Ordering::Acquire);
        if tail.saturating_sub(head) > len {
            return self.fail(OVERRUN);
        }
        let mut at = from;
        let mut rest = data;
        while !rest.is_empty() {
            let n = deliver(at, rest).min(rest.len());
            if n == 0 {
                break;
            }
            at += n as u64;
            rest = &rest[n..];
        }
        let delivered_to = at;
        while !rest.is_empty() {
            let pos = at % len;
            let piece = ((len - pos) as usize).min(rest.len());
            // In bounds: pos + piece <= len.
            let _ = self.local.ring.write(pos, &rest[..piece]);
            rest = &rest[piece..];
            at += piece as u64;
        }
        self.applied = tail;
        // SYNC POINT qp-ack (release, with the NAK stored before it).
        self.local.nak.store(nak, Ordering::Relaxed);
        self.local.ack.store(ack, Ordering::Release);
        // SYNC POINT qp-credits (release).
        self.local.credits.store(credits, Ordering::Release);
        self.local.rnr.store(rnr, Ordering::Relaxed);
        // SYNC POINT qp-access (release).
        self.shadow.access.store(access, Ordering::Release);
        if whole {
            // SYNC POINT ring-publish (release): the bytes above before the index.
            self.local.tail.store(tail, Ordering::Release);
        } else if delivered_to != from {
            // The records delivered in place end on a record's boundary, where the consumer
            // index now is: the producer index may not stay behind it.
            // SYNC POINT ring-publish (release).
            self.local.tail.store(delivered_to, Ordering::Release);
        }
        if gone != 0 {
            // SYNC POINT qp-peer-gone (release): the acks and NAKs above are seen first.
            self.local.peer_err.store(1, Ordering::Release);
        }
        self.local.wake();
    }

    /// Breaks the pair here: the local QP sees its peer gone, its one-sided requests waiting
    /// for answers that will not come.
    pub(crate) fn fail(&mut self, why: &'static str) {
        self.broken.get_or_insert(why);
        // SYNC POINT qp-peer-gone (release).
        self.local.peer_err.store(1, Ordering::Release);
        self.rdma.gone.store(1, Ordering::Release);
        crate::sync::ring(&self.local.bell);
    }
}

/// A message made by [`Mirror::next_message`], to confirm once UCX took it.
pub(crate) struct Shipment {
    end: u64,
    snap: Snap,
}

/// Whether `answer` (made by [`Mirror::execute`]) says an RDMA WRITE landed: an ack, which
/// may wait for a message to go with; READ and atomic answers carry what their requester
/// waits for, and refusals end its work.
pub(crate) fn answer_is_write_ack(answer: &[u8]) -> bool {
    // The keys (16 bytes), then what `Mirror::answer` reads: id, status, op, value.
    answer.len() >= ANSWER_HEAD
        && u32_at(answer, 16 + 8) == 0
        && u32_at(answer, 16 + 12) == u32::from(RDMA_OP_WRITE)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RING: u32 = 4096;

    fn block(win: &Arc<Region>, off: u64, ev: u64) -> QpBlock {
        QpBlock {
            win: win.clone(),
            off,
            ring_len: RING,
            event_off: ev,
            rdma_off: off + 8192,
        }
    }

    /// Two hosts: on each a real block and the shadow of the other's QP.
    fn pair() -> (Mirror, Mirror, Arc<Region>, Arc<Region>) {
        let a = Arc::new(Region::create("mirror-a", 64 << 10).unwrap());
        let b = Arc::new(Region::create("mirror-b", 64 << 10).unwrap());
        // Real block at 0 (event at 60K), shadow at 16K (event at 62K), on both.
        let ma = Mirror::new(
            1,
            (1, 7),
            (3, 9),
            &block(&a, 0, 60 << 10),
            &block(&a, 16 << 10, 62 << 10),
        )
        .unwrap();
        let mb = Mirror::new(
            0,
            (3, 9),
            (1, 7),
            &block(&b, 0, 60 << 10),
            &block(&b, 16 << 10, 62 << 10),
        )
        .unwrap();
        (ma, mb, a, b)
    }

    /// The next message into `buf` (resized to it), as the bridge ships it.
    fn next(m: &mut Mirror, buf: &mut Vec<u8>) -> Option<Shipment> {
        buf.resize(MSG_MAX, 0);
        let bound = m.message_len(u64::MAX);
        let (n, s) = m.next_message(buf, u64::MAX, None)?;
        assert!(n <= bound, "{n} bytes, {bound} promised");
        buf.truncate(n);
        Some(s)
    }

    fn carry(from: &mut Mirror, to: &mut Mirror) -> usize {
        let mut buf = Vec::new();
        let mut n = 0;
        while let Some(s) = next(from, &mut buf) {
            assert_eq!(keys(&buf), Some((from.local_key, from.remote_key)));
            to.apply(&buf);
            assert_eq!(to.broken, None);
            from.shipped(s);
            n += 1;
        }
        n
    }

    #[test]
    fn only_a_write_that_landed_is_answered_with_a_bare_ack() {
        let answer = |status: u32, op: u8| {
            let mut a = encode_ready((1, 7), (3, 9)).to_vec();
            a.extend_from_slice(&5u64.to_le_bytes());
            a.extend_from_slice(&status.to_le_bytes());
            a.extend_from_slice(&u32::from(op).to_le_bytes());
            a.extend_from_slice(&0u64.to_le_bytes());
            a
        };
        assert_eq!(answer(0, RDMA_OP_WRITE).len(), ANSWER_HEAD);
        assert!(answer_is_write_ack(&answer(0, RDMA_OP_WRITE)));
        assert!(!answer_is_write_ack(&answer(REM_ACCESS_ERR, RDMA_OP_WRITE)));
        assert!(!answer_is_write_ack(&answer(0, RDMA_OP_READ)));
        assert!(!answer_is_write_ack(&answer(0, RDMA_OP_FETCH_ADD)));
        assert!(!answer_is_write_ack(&answer(0, RDMA_OP_WRITE)[..28]));
    }

    #[test]
    fn an_answer_is_made_in_the_buffer_of_one_that_went_out() {
        let (mut ma, _mb, _a, _b) = pair();
        // A refused request (no region of that rkey): the whole answer, as `execute` makes it.
        let mut req = vec![0u8; RDMA_REQ_HEAD];
        req[0] = RDMA_OP_FETCH_ADD;
        req[8..16].copy_from_slice(&5u64.to_le_bytes());
        req[20..24].copy_from_slice(&8u32.to_le_bytes());
        let mut out = ma.answer_buf();
        assert!(
            out.capacity() >= ANSWER_HEAD,
            "made once, big enough for an atomic's"
        );
        ma.execute(&req, &mut out);
        assert_eq!(out.len(), ANSWER_HEAD);
        assert_eq!(u32_at(&out, 24), REM_ACCESS_ERR);
        let at = out.as_ptr();
        ma.recycle(out);
        let again = ma.answer_buf();
        assert_eq!(
            (again.as_ptr(), again.len()),
            (at, 0),
            "the same buffer, emptied"
        );
        // At most SPARE_ANSWERS are kept, and none larger than a READ piece's answer.
        for _ in 0..SPARE_ANSWERS + 3 {
            ma.recycle(Vec::with_capacity(64));
        }
        ma.recycle(Vec::with_capacity(ANSWER_HEAD + RDMA_PIECE + 1));
        assert_eq!(ma.spare.len(), SPARE_ANSWERS);
        assert!(ma.spare.iter().all(|b| b.capacity() == 64));
    }

    #[test]
    fn ring_bytes_and_words_land_at_the_same_positions_and_wrap() {
        let (mut ma, mut mb, a, b) = pair();
        let mut buf = Vec::new();
        // Nothing ships before the other side is ready.
        a.write((16 << 10) + QP_RING_OFF, &[5; 64]).unwrap();
        a.u64_at((16 << 10) + QP_TAIL_OFF as u64)
            .unwrap()
            .store(64, Ordering::Release);
        assert!(next(&mut ma, &mut buf).is_none());
        ma.ready = true;
        mb.ready = true;
        // Credits and access go with the bytes.
        a.u64_at((16 << 10) + QP_CREDITS_OFF as u64)
            .unwrap()
            .store(12, Ordering::Release);
        a.u32_at(QP_ACCESS_OFF as u64)
            .unwrap()
            .store(0b110, Ordering::Release);
        assert_eq!(carry(&mut ma, &mut mb), 1);
        let mut got = [0u8; 64];
        b.read(QP_RING_OFF, &mut got).unwrap();
        assert_eq!(got, [5; 64]);
        let tail = b.u64_at(QP_TAIL_OFF as u64).unwrap();
        assert_eq!(tail.load(Ordering::Acquire), 64);
        let credits = b.u64_at(QP_CREDITS_OFF as u64).unwrap();
        assert_eq!(credits.load(Ordering::Acquire), 12);
        let access = b.u32_at((16 << 10) + QP_ACCESS_OFF as u64).unwrap();
        assert_eq!(access.load(Ordering::Acquire), 0b110);
        // Nothing new: nothing ships.
        assert_eq!(carry(&mut ma, &mut mb), 0);
        // The receiver consumes; its index comes back as the sender's ack.
        b.u64_at((16 << 10) + QP_ACK_OFF as u64)
            .unwrap()
            .store(64, Ordering::Release);
        assert_eq!(carry(&mut mb, &mut ma), 1);
        assert_eq!(
            a.u64_at(QP_ACK_OFF as u64).unwrap().load(Ordering::Acquire),
            64
        );
        // Bytes across the ring's end land across it there too.
        let start = u64::from(RING) - 64;
        a.write((16 << 10) + QP_RING_OFF + 64, &vec![6; start as usize - 64])
            .unwrap();
        a.write((16 << 10) + QP_RING_OFF + start, &[7; 64]).unwrap();
        a.write((16 << 10) + QP_RING_OFF, &[8; 64]).unwrap();
        a.u64_at((16 << 10) + QP_TAIL_OFF as u64)
            .unwrap()
            .store(u64::from(RING) + 64, Ordering::Release);
        assert_eq!(carry(&mut ma, &mut mb), 1);
        b.read(QP_RING_OFF + start, &mut got).unwrap();
        assert_eq!(got, [7; 64]);
        b.read(QP_RING_OFF, &mut got).unwrap();
        assert_eq!(got, [8; 64]);
        assert_eq!(tail.load(Ordering::Acquire), u64::from(RING) + 64);
    }

    #[test]
    fn bytes_a_deliverer_takes_skip_the_ring_and_the_producer_index_covers_them() {
        let (mut ma, mut mb, a, b) = pair();
        ma.ready = true;
        mb.ready = true;
        a.write((16 << 10) + QP_RING_OFF, &[5; 64]).unwrap();
        a.write((16 << 10) + QP_RING_OFF + 64, &[6; 64]).unwrap();
        a.u64_at((16 << 10) + QP_TAIL_OFF as u64)
            .unwrap()
            .store(128, Ordering::Release);
        let mut buf = Vec::new();
        let s = next(&mut ma, &mut buf).unwrap();
        // The deliverer sees the bytes at their ring index and takes the first 64.
        let mut seen = Vec::new();
        mb.apply_with(&buf, &mut |at, bytes| {
            seen.push((at, bytes.len()));
            if at == 0 {
                64
            } else {
                0
            }
        });
        ma.shipped(s);
        assert_eq!(mb.broken, None);
        assert_eq!(seen, [(0, 128), (64, 64)]);
        let mut got = [0u8; 64];
        b.read(QP_RING_OFF, &mut got).unwrap();
        assert_eq!(got, [0; 64], "taken bytes are not written into the ring");
        b.read(QP_RING_OFF + 64, &mut got).unwrap();
        assert_eq!(got, [6; 64]);
        let tail = b.u64_at(QP_TAIL_OFF as u64).unwrap();
        assert_eq!(tail.load(Ordering::Acquire), 128);
    }

    #[test]
    fn a_chunk_that_ends_inside_a_record_is_not_published_until_the_rest_is_there() {
        chunk_inside_a_record(0);
    }

    /// ... and one whose first 4 KiB a deliverer took is published that far, where the
    /// consumer now stands.
    #[test]
    fn a_partial_chunk_is_published_as_far_as_a_deliverer_took_it() {
        chunk_inside_a_record(4096);
    }

    /// A chunk that ends inside a record, its first `taken` bytes taken by a deliverer: the
    /// producer index stays at `taken` until the rest comes.
    fn chunk_inside_a_record(taken: usize) {
        let big = 4 * CHUNK as usize;
        let a = Arc::new(Region::create("mirror-a", 4 * big).unwrap());
        let b = Arc::new(Region::create("mirror-b", 4 * big).unwrap());
        let blk = |w: &Arc<Region>, off: u64| QpBlock {
            win: w.clone(),
            off,
            ring_len: big as u32 / 2,
            event_off: 4 * big as u64 - 256,
            rdma_off: off + big as u64 / 2 + 4096,
        };
        let mut ma = Mirror::new(
            1,
            (1, 7),
            (3, 9),
            &blk(&a, 0),
            &blk(&a, big as u64 / 2 + 4096),
        )
        .unwrap();
        let mut mb = Mirror::new(
            0,
            (3, 9),
            (1, 7),
            &blk(&b, 0),
            &blk(&b, big as u64 / 2 + 4096),
        )
        .unwrap();
        ma.ready = true;
        mb.ready = true;
        let shadow_tail = a
            .u64_at(big as u64 / 2 + 4096 + QP_TAIL_OFF as u64)
            .unwrap();
        let end = CHUNK + CHUNK / 2;
        shadow_tail.store(end, Ordering::Release);
        let mut buf = Vec::new();
        let s = next(&mut ma, &mut buf).unwrap();
        mb.apply_with(&buf, &mut |at, _| if at == 0 { taken } else { 0 });
        ma.shipped(s);
        let tail = b.u64_at(QP_TAIL_OFF as u64).unwrap();
        assert_eq!(
            tail.load(Ordering::Acquire),
            taken as u64,
            "a chunk inside a record"
        );
        carry(&mut ma, &mut mb);
        assert_eq!(tail.load(Ordering::Acquire), end);
        assert_eq!(mb.broken, None);
    }

    #[test]
    fn gone_goes_last_and_bad_positions_break_the_pair() {
        let (mut ma, mut mb, a, b) = pair();
        ma.ready = true;
        mb.ready = true;
        a.u32_at((16 << 10) + QP_PEER_ERR_OFF as u64)
            .unwrap()
            .store(1, Ordering::Release);
        carry(&mut ma, &mut mb);
        let gone = b.u32_at(QP_PEER_ERR_OFF as u64).unwrap();
        assert_eq!(gone.load(Ordering::Acquire), 1);

        // Bytes that skip ahead, overrun the unread ones, or a short message: refused.
        let (mut ma, mut mb, a, b) = pair();
        ma.ready = true;
        mb.ready = true;
        let mut buf = Vec::new();
        a.u64_at((16 << 10) + QP_TAIL_OFF as u64)
            .unwrap()
            .store(64, Ordering::Release);
        next(&mut ma, &mut buf).unwrap();
        let mut skip = buf.clone();
        skip[64..72].copy_from_slice(&64u64.to_le_bytes());
        mb.apply(&skip);
        assert_eq!(mb.broken, Some(POSITION));
        assert_eq!(
            b.u32_at(QP_PEER_ERR_OFF as u64)
                .unwrap()
                .load(Ordering::Acquire),
            1
        );
        let (_, mut mb, _, _) = pair();
        mb.ready = true;
        mb.apply(&buf[..40]);
        assert_eq!(mb.broken, Some(MALFORMED));
        let (_, mut mb, _, _) = pair();
        let mut over = buf[..MSG_HEAD].to_vec();
        over.resize(MSG_HEAD + RING as usize + 64, 0);
        over[16..24].copy_from_slice(&(u64::from(RING) + 64).to_le_bytes());
        mb.apply(&over);
        assert_eq!(mb.broken, Some(OVERRUN));
        // A local QP that publishes a position beyond its ring breaks the pair, ships nothing.
        let (mut ma, _, a, _) = pair();
        ma.ready = true;
        a.u64_at((16 << 10) + QP_TAIL_OFF as u64)
            .unwrap()
            .store(u64::from(RING) * 2, Ordering::Release);
        assert!(next(&mut ma, &mut buf).is_none());
        assert_eq!(ma.broken, Some(LOCAL_POSITION));
    }
}
