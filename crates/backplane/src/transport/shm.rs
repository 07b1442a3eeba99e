//! The shared-memory transport: every node is a process on this host. A grant is the region's
//! memfd, handed over by the supervisor after its checks (owner, PD, QP connection, access
//! flags) and mapped read-only unless the grant is writable; an access is a checked copy or
//! atomic on that mapping. A message channel is an SPSC ring ([`crate::ring`]) with its data
//! and published position in the receiver's window and its released position in the sender's.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use std::time::Duration;

use super::across;
use super::{
    Addr, Channels, CopyKind, GrantRequest, OpenedDatagram, PeerState, QpChannels, QpConnection,
    QpHome, QpLink, Record, RecvChannel, RemoteRegion, Reservation, RingError, SendChannel,
    Transport, Watch, WatchRoles,
};
use crate::fabric::ctl::{Request, Response};
use crate::fabric::{Fabric, FabricError};
use crate::mem::{MemError, Region, Span, Word32, Word64};
use crate::ring::{Consumer, Producer, RingMemory};
use crate::sync::Ordering;
use crate::wire::registry::{VerbsRequest, VerbsResponse};
use crate::wire::verbs::{
    MrHeader, MrRepr, QpBlockHeader, QpBlockRepr, EV_ARMED_OFF, EV_BELL_OFF, MR_DATA_OFF,
    MR_STATE_OFF, MR_STATE_VALID, QP_ACCESS_OFF, QP_ACK_OFF, QP_CREDITS_OFF, QP_NAK_OFF,
    QP_PEER_ERR_OFF, QP_PEER_RNR_OFF, QP_RING_OFF, QP_TAIL_OFF,
};
use crate::wire::{
    RingHeader, RingRepr, CREDIT_ARMED_OFF, CREDIT_COOKIE_OFF, CREDIT_PEER_CLOSED_OFF,
    CREDIT_SEQ_OFF, EP_ARMED_OFF, EP_DOORBELL_OFF, RING_SENDER_CLOSED_OFF,
};

/// The one-sided rings of the pairs this process reaches regions on other hosts through, by
/// (peer node, peer QPN, area offset): shared by every region granted through one pair.
type AcrossPairs = HashMap<(u32, u32, u64), Weak<Mutex<across::Pair>>>;

/// The transport of a fabric on one host.
#[derive(Debug, Clone)]
pub struct ShmTransport {
    fabric: Fabric,
    across: Arc<Mutex<AcrossPairs>>,
}

impl ShmTransport {
    /// The transport of `fabric`.
    pub fn new(fabric: Fabric) -> Self {
        Self {
            fabric,
            across: Arc::default(),
        }
    }

    /// The pair whose one-sided area lies at `rdma_off` of node `slot`'s (shadow) window.
    fn across_pair(
        &self,
        key: (u32, u32, u64),
        ring_len: u32,
        event_off: u64,
    ) -> Option<Arc<Mutex<across::Pair>>> {
        let mut pairs = self.across.lock().unwrap_or_else(|e| e.into_inner());
        pairs.retain(|_, w| w.strong_count() > 0);
        if let Some(p) = pairs.get(&key).and_then(Weak::upgrade) {
            return Some(p);
        }
        let win = self.fabric.window(key.0).ok()?;
        let mut p = across::Pair::new(&win, key.2, ring_len, event_off).ok()?;
        p.set_peer((key.0, key.1));
        let p = Arc::new(Mutex::new(p));
        pairs.insert(key, Arc::downgrade(&p));
        Some(p)
    }
}

impl Transport for ShmTransport {
    fn map_region(&self, req: GrantRequest) -> Option<Arc<dyn RemoteRegion>> {
        let rkey = match req {
            GrantRequest::ThroughQp { rkey, .. } | GrantRequest::ForDma { rkey, .. } => rkey,
        };
        let req = match req {
            GrantRequest::ThroughQp { slot, qpn, rkey } => {
                VerbsRequest::MrGrant { slot, qpn, rkey }
            }
            GrantRequest::ForDma { slot, node, rkey } => {
                VerbsRequest::DmaGrant { slot, node, rkey }
            }
        };
        let (resp, fds) = self.fabric.call_service::<VerbsResponse>(&req, &[]).ok()?;
        match resp {
            VerbsResponse::MrGranted {
                len,
                access,
                writable,
                data_off,
            } => Some(Arc::new(ShmRegion::from_fd(
                RegionFds::from_message(fds, data_off)?,
                len,
                access,
                writable,
            )?)),
            // The QP's peer is on another host: through the one-sided rings of its shadow.
            VerbsResponse::MrAcross {
                len,
                access,
                writable,
                iova,
                peer_slot,
                peer_qpn,
                rdma_off,
                ring_len,
                event_off,
            } => {
                let pair =
                    self.across_pair((peer_slot, peer_qpn, rdma_off), ring_len, event_off)?;
                let grant = (len, access, writable, iova);
                Some(Arc::new(across::AcrossRegion::new(
                    pair, rkey, grant, peer_slot,
                )))
            }
            _ => None,
        }
    }

    fn peer(&self, slot: u32) -> Option<PeerState> {
        let i = self.fabric.node_info(slot).ok()?;
        Some(PeerState {
            state: i.state,
            generation: i.generation,
        })
    }
}

/// Datagram channels are rings the supervisor's ring broker makes: one per (sender endpoint,
/// receiver endpoint), in the receiver's window, with the sender's credit line (released
/// position, credit doorbell, cookie, peer-closed flag) in the sender's.
impl Channels for ShmTransport {
    type Tx = DatagramSender;
    type Rx = DatagramReceiver;

    fn open_datagram(
        &self,
        src: Addr,
        dst: Addr,
    ) -> Result<OpenedDatagram<DatagramSender>, FabricError> {
        let fabric = &self.fabric;
        fabric.check_slot(dst.node)?;
        let (resp, _) = fabric.call(&Request::Connect {
            src_slot: src.node,
            src_port: src.port,
            dst_slot: dst.node,
            dst_port: dst.port,
        })?;
        let Response::Connected {
            ring_off,
            credit_off,
            dst_record_off,
            route,
            direct,
            ring_data,
            ..
        } = resp
        else {
            return Err(FabricError::Protocol(format!("{resp:?}")));
        };
        // The fabric's ring size, or the least one on a route whose datagrams go directly.
        let fabric_ring = crate::wire::ring_data_for_window(fabric.window_size());
        let data_len = match ring_data {
            None => fabric_ring,
            Some(n) if n == fabric_ring || n == crate::wire::MIN_RING_DATA => n,
            Some(n) => {
                return Err(FabricError::Protocol(format!(
                    "a ring of {n} bytes (this fabric's are {fabric_ring})"
                )))
            }
        };
        let dst_win = fabric.window(dst.node)?;
        let me = fabric.window(src.node)?;
        let ring = ShmRing::datagram(&dst_win, ring_off, data_len, &me, credit_off)?;
        let credit = |o: usize| Word32::at(&me, credit_off + o as u64);
        let cookie_word = credit(CREDIT_COOKIE_OFF)?;
        let life = SenderLife {
            cookie: cookie_word.load(Ordering::Acquire),
            cookie_word,
            peer_closed: credit(CREDIT_PEER_CLOSED_OFF)?,
            credit_seq: credit(CREDIT_SEQ_OFF)?,
            credit_armed: credit(CREDIT_ARMED_OFF)?,
        };
        // The receiver's doorbell: its endpoint's, shared by every ring it receives from.
        let bell = Bell::new(
            Word32::at(&dst_win, dst_record_off + EP_ARMED_OFF as u64)?,
            Word32::at(&dst_win, dst_record_off + EP_DOORBELL_OFF as u64)?,
        );
        let ch = DatagramSender {
            ch: ShmSender::new(ring).with_bell(bell),
            life,
        };
        Ok(OpenedDatagram { ch, route, direct })
    }

    fn accept_datagram(&self, dst: Addr, at: u64) -> Result<(Addr, DatagramReceiver), FabricError> {
        let w = self.fabric.window(dst.node)?;
        let mut h = [0u8; 64];
        w.read(at, &mut h)?;
        let r = RingRepr::parse(&RingHeader::new_checked(&h[..])?)?;
        let src_win = self.fabric.window(r.src_slot)?;
        let ring = ShmRing::datagram(&w, at, r.data_len, &src_win, r.credit_off)?;
        // The sender's credit doorbell, in its credit line.
        let ch = DatagramReceiver {
            ch: ShmReceiver::new(ring).with_bell(Bell::new(
                Word32::at(&src_win, r.credit_off + CREDIT_ARMED_OFF as u64)?,
                Word32::at(&src_win, r.credit_off + CREDIT_SEQ_OFF as u64)?,
            )),
            sender_closed: Word32::at(&w, at + RING_SENDER_CLOSED_OFF as u64)?,
        };
        Ok((Addr::new(r.src_slot, r.src_port), ch))
    }

    fn retire_datagram(&self, dst: Addr, at: u64) {
        // Best effort: the supervisor tears the ring down; a live sender reconnects.
        let _ = self.fabric.call(&Request::RetireRing {
            slot: dst.node,
            ring_off: at,
        });
    }
}

/// A datagram sender's view of its channel's life, in its credit line: the receiver's
/// incarnation (cookie) and closed flag, and the credit doorbell it sleeps on when full.
#[derive(Debug)]
struct SenderLife {
    cookie: u32,
    cookie_word: Word32,
    peer_closed: Word32,
    credit_seq: Word32,
    credit_armed: Word32,
}

/// The sending end of a datagram channel: the ring, and the channel's life in the sender's
/// credit line. (A wrapper rather than fields of [`ShmSender`]: the QP's sender, which has
/// no such life, stays as small as it was — measured, `send-lat` 8 B read ~10 ns slower with
/// the fields in.)
#[derive(Debug)]
pub struct DatagramSender {
    ch: ShmSender,
    life: SenderLife,
}

impl SendChannel for DatagramSender {
    #[inline]
    fn data(&self) -> &Span {
        self.ch.data()
    }
    #[inline]
    fn reserve(&mut self, len: usize) -> Result<Reservation, RingError> {
        self.ch.reserve(len)
    }
    #[inline]
    fn commit(&mut self, r: Reservation) {
        self.ch.commit(r)
    }
    #[inline]
    fn has_room(&mut self, len: usize) -> Result<bool, RingError> {
        self.ch.has_room(len)
    }
    #[inline]
    fn sent(&self) -> u64 {
        self.ch.sent()
    }
    fn published_anything(&self) -> bool {
        self.ch.published_anything()
    }
    #[inline]
    fn next_hint(&self) -> [*const u8; 2] {
        self.ch.next_hint()
    }
    #[inline]
    fn wake_receiver(&self) {
        self.ch.wake_receiver()
    }
    fn ring_receiver(&self) {
        self.ch.ring_receiver()
    }
    #[inline]
    fn receiver_gone(&self) -> bool {
        let l = &self.life;
        l.peer_closed.load(Ordering::Acquire) != 0
            || l.cookie_word.load(Ordering::Acquire) != l.cookie
    }
    fn wait_for_room(&mut self, len: usize, timeout: Option<Duration>) {
        let l = &self.life;
        let s = l.credit_seq.load(Ordering::Acquire);
        l.credit_armed.store(1, Ordering::Relaxed);
        // SYNC POINT credit-arm (sender): armed before we re-check the consumer index.
        crate::sync::fence(Ordering::SeqCst);
        let room = self.ch.has_room(len).unwrap_or(true);
        if !room && l.peer_closed.load(Ordering::Acquire) == 0 {
            crate::sync::futex_wait(&l.credit_seq, s, timeout);
        }
        l.credit_armed.store(0, Ordering::Relaxed);
    }
}

/// The receiving end of a datagram channel: the ring and the sender's closed flag.
#[derive(Debug)]
pub struct DatagramReceiver {
    ch: ShmReceiver,
    sender_closed: Word32,
}

impl RecvChannel for DatagramReceiver {
    #[inline]
    fn data(&self) -> &Span {
        self.ch.data()
    }
    #[inline]
    fn peek(&mut self) -> Result<Option<Record>, RingError> {
        self.ch.peek()
    }
    #[inline]
    fn release(&mut self, rec: Record) {
        self.ch.release(rec)
    }
    #[inline]
    fn consumed(&self) -> u64 {
        self.ch.consumed()
    }
    #[inline]
    fn is_drained(&self) -> bool {
        self.ch.is_drained()
    }
    #[inline]
    fn drained_cached(&self) -> bool {
        self.ch.drained_cached()
    }
    #[inline]
    fn wake_sender(&self) {
        self.ch.wake_sender()
    }
    #[inline]
    fn sender_gone(&self) -> bool {
        self.sender_closed.load(Ordering::Acquire) != 0
    }
}

/// A peer's region mapped in this process.
#[derive(Debug)]
pub struct ShmRegion {
    data: Span,
    state: Word32,
    access: u32,
    iova: u64,
    ident: (u64, u64),
}

/// The descriptors of a region, as the supervisor holds and grants them: one memfd (the
/// header page, then the data) or, for a region over memory another object backs (a shared
/// mapping's file, another region's memfd), a one-page header memfd and that object's file
/// with the offset its data starts at.
#[derive(Debug)]
pub struct RegionFds {
    /// The region's memfd (its header page first).
    pub header: std::os::fd::OwnedFd,
    /// The data's file and the page-aligned offset the data starts at (the header's `skew`
    /// then applies), if not the header's memfd.
    pub data: Option<(std::os::fd::OwnedFd, u64)>,
}

impl RegionFds {
    /// The descriptors of a message (one, or two when `data_off` is set); `None` if their
    /// number does not match.
    pub fn from_message(fds: Vec<std::os::fd::OwnedFd>, data_off: Option<u64>) -> Option<Self> {
        let mut it = fds.into_iter();
        let header = it.next()?;
        let data = match data_off {
            Some(off) => Some((it.next()?, off)),
            None => None,
        };
        it.next().is_none().then_some(Self { header, data })
    }

    /// The descriptors to send and the `data_off` that says how many.
    pub fn into_message(self) -> (Vec<std::os::fd::OwnedFd>, Option<u64>) {
        match self.data {
            Some((d, off)) => (vec![self.header, d], Some(off)),
            None => (vec![self.header], None),
        }
    }
}

/// A region's mappings in this process: its header page and its data, which begins at
/// `data_off` of `data` (then the header's `skew`). A region in one memfd has the same
/// mapping for both, with its data at [`MR_DATA_OFF`].
#[derive(Debug, Clone)]
pub struct RegionMaps {
    /// The mapping with the header at offset 0.
    pub header: Arc<Region>,
    /// The mapping that holds the data.
    pub data: Arc<Region>,
    /// Where the data area starts in `data`.
    pub data_off: u64,
}

impl RegionMaps {
    /// A region in one memfd.
    pub fn single(region: Arc<Region>) -> Self {
        Self {
            header: region.clone(),
            data: region,
            data_off: MR_DATA_OFF,
        }
    }
}

impl ShmRegion {
    /// Maps a granted region (read-only unless `writable`; a separate header always
    /// read-only), populated, its header checked against the grant (`len`), its state VALID;
    /// `None` if anything fails a check. The supervisor's bridge maps the regions it is
    /// granted for another host this way.
    pub fn from_fd(fds: RegionFds, len: u64, access: u32, writable: bool) -> Option<Self> {
        let maps = match fds.data {
            None => RegionMaps::single(Arc::new(Region::map(fds.header, writable).ok()?)),
            Some((data, off)) => {
                let header = Arc::new(Region::map_prefix(fds.header, 4096, false).ok()?);
                let skew = Self::header_of(&header, u64::MAX)?.skew;
                let want = usize::try_from(u64::from(skew).checked_add(len)?).ok()?;
                let data = Region::map_range(data, off, want, writable).ok()?;
                RegionMaps {
                    header,
                    data: Arc::new(data),
                    data_off: 0,
                }
            }
        };
        maps.data.populate(writable);
        Self::from_region(maps, len, access)
    }

    /// The header of a region mapping, checked against `mapped` bytes of data area (plus
    /// [`MR_DATA_OFF`]).
    fn header_of(header: &Region, mapped: u64) -> Option<MrRepr> {
        let mut h = [0u8; 64];
        header.read(0, &mut h).ok()?;
        MrRepr::parse(&MrHeader::new_unchecked(&h[..]), mapped).ok()
    }

    /// A region already mapped here (a process's own, for the requests of a peer on another
    /// host that its process carries itself, `verbs::direct`), with the checks of
    /// [`ShmRegion::from_fd`].
    pub fn from_region(maps: RegionMaps, len: u64, access: u32) -> Option<Self> {
        // The data area's mapped length, counted as if it followed a header page.
        let area = (maps.data.len() as u64).checked_sub(maps.data_off)?;
        let repr = Self::header_of(&maps.header, area.checked_add(MR_DATA_OFF)?)?;
        if repr.len != len {
            return None;
        }
        let state = Word32::at(&maps.header, MR_STATE_OFF as u64).ok()?;
        // SYNC POINT mr-state (acquire): a region deregistered before we mapped it is refused.
        if state.load(Ordering::Acquire) != MR_STATE_VALID {
            return None;
        }
        let data = Span::new(&maps.data, maps.data_off + u64::from(repr.skew), len).ok()?;
        // Names the region: its header's memfd (one per registration; two registrations over
        // the same shared memory are told apart, so DMA's overlap check does not see them as
        // one). fstat of a memfd we hold does not fail; if it did, the mapping's address
        // stands in (unique, so two such mappings are never seen as one region).
        let ident = rustix::fs::fstat(maps.header.fd())
            .map(|s| (s.st_dev, s.st_ino))
            .unwrap_or((u64::MAX, data.addr(0) as u64));
        Some(Self {
            data,
            state,
            access,
            iova: repr.iova,
            ident,
        })
    }
}

impl RemoteRegion for ShmRegion {
    #[inline]
    fn len(&self) -> u64 {
        self.data.len()
    }
    #[inline]
    fn access_bits(&self) -> u32 {
        self.access
    }
    #[inline]
    fn iova(&self) -> u64 {
        self.iova
    }
    fn writable(&self) -> bool {
        self.data.writable()
    }
    #[inline]
    fn valid(&self) -> bool {
        // SYNC POINT mr-state (acquire): the owner's deregistration, seen before each access.
        self.state.load(Ordering::Acquire) == MR_STATE_VALID
    }
    fn ident(&self) -> (u64, u64) {
        self.ident
    }
    #[inline]
    fn put(
        &self,
        off: u64,
        src: &Span,
        src_off: u64,
        n: usize,
        how: CopyKind,
    ) -> Result<(), MemError> {
        match how {
            CopyKind::Plain => src.copy_to(src_off, &self.data, off, n),
            CopyKind::Ordered => src.copy_to_ordered(src_off, &self.data, off, n),
            CopyKind::Streaming => src.copy_to_streaming(src_off, &self.data, off, n),
        }
    }
    #[inline]
    fn put_bytes(&self, off: u64, src: &[u8], how: CopyKind) -> Result<(), MemError> {
        match how {
            CopyKind::Ordered => self.data.write_ordered(off, src),
            _ => self.data.write(off, src),
        }
    }
    #[inline]
    fn get(
        &self,
        off: u64,
        dst: &Span,
        dst_off: u64,
        n: usize,
        how: CopyKind,
    ) -> Result<(), MemError> {
        match how {
            CopyKind::Streaming => self.data.copy_to_streaming(off, dst, dst_off, n),
            _ => self.data.copy_to(off, dst, dst_off, n),
        }
    }
    fn fetch_add(&self, off: u64, add: u64) -> Result<u64, MemError> {
        self.data.fetch_add(off, add)
    }
    fn compare_swap(&self, off: u64, compare: u64, swap: u64) -> Result<u64, MemError> {
        self.data.compare_swap(off, compare, swap)
    }
    fn local(&self) -> Option<(&Span, &Word32)> {
        Some((&self.data, &self.state))
    }
}

/// The memory of one ring, seen from either side: data and published position (`tail`) in
/// the receiver's window, released position (`head`) in the sender's. Views are resolved once,
/// after bounds checks, so the hot path does no lookups.
#[derive(Debug, Clone)]
pub struct ShmRing {
    tail: Word64,
    head: Word64,
    data: Span,
}

impl ShmRing {
    /// A ring over views the caller resolved: `data` a power of two long.
    pub fn new(tail: Word64, head: Word64, data: Span) -> Self {
        Self { tail, head, data }
    }

    /// A datagram ring of `data_len` bytes at `ring_off` of the receiver's window (the
    /// `wire::RingHeader` layout) with its credit line at `credit_off` of the sender's.
    pub fn datagram(
        ring_win: &Arc<Region>,
        ring_off: u64,
        data_len: u32,
        credit_win: &Arc<Region>,
        credit_off: u64,
    ) -> Result<Self, MemError> {
        use crate::wire::{RingRepr, CREDIT_HEAD_OFF, CREDIT_LEN, RING_DATA_OFF, RING_TAIL_OFF};
        ring_win.check(ring_off, RingRepr::footprint(data_len), 64)?;
        credit_win.check(credit_off, CREDIT_LEN, 64)?;
        Ok(Self {
            tail: Word64::at(ring_win, ring_off + RING_TAIL_OFF as u64)?,
            head: Word64::at(credit_win, credit_off + CREDIT_HEAD_OFF as u64)?,
            data: Span::new(ring_win, ring_off + RING_DATA_OFF, data_len.into())?,
        })
    }
}

impl RingMemory for ShmRing {
    #[inline]
    fn data_len(&self) -> u64 {
        self.data.len()
    }
    #[inline]
    fn load_tail(&self) -> u64 {
        self.tail.load(Ordering::Acquire)
    }
    #[inline]
    fn store_tail(&self, v: u64) {
        self.tail.store(v, Ordering::Release)
    }
    #[inline]
    fn load_head(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }
    #[inline]
    fn store_head(&self, v: u64) {
        self.head.store(v, Ordering::Release)
    }
    #[inline]
    fn write(&self, pos: u64, src: &[u8]) {
        // Out of range is unreachable: the protocol validated the range.
        let _ = self.data.write(pos, src);
    }
    #[inline]
    fn read(&self, pos: u64, dst: &mut [u8]) {
        if self.data.read(pos, dst).is_err() {
            dst.fill(0); // unreachable: the protocol validated the range
        }
    }
    #[inline]
    fn prefetch(&self, pos: u64) {
        self.data.prefetch(pos);
    }
}

/// A futex doorbell in a peer's memory: the peer sets `armed` before it sleeps on `bell`;
/// whoever published something it waits for bumps `bell` and wakes it, if armed.
#[derive(Debug, Clone)]
pub struct Bell {
    armed: Word32,
    bell: Word32,
}

impl Bell {
    /// The doorbell made of these two words.
    pub fn new(armed: Word32, bell: Word32) -> Self {
        Self { armed, bell }
    }

    /// Rings if the peer armed (after our stores are visible).
    #[inline]
    pub fn wake(&self) {
        // SYNC POINT doorbell-arm (publisher): what we published is visible before we read
        // `armed`; the sleeper armed before its last look (the datagram path's doorbell-arm
        // and credit-arm, the QP's qp-bell).
        crate::sync::fence(Ordering::SeqCst);
        if self.armed.load(Ordering::Relaxed) != 0 {
            crate::sync::ring(&self.bell);
        }
    }

    /// Rings whether the peer armed or not.
    pub fn ring(&self) {
        crate::sync::ring(&self.bell);
    }
}

/// The sending end of a shared-memory ring.
#[derive(Debug)]
pub struct ShmSender {
    ring: ShmRing,
    producer: Producer,
    bell: Option<Bell>,
}

impl ShmSender {
    /// The sending end of `ring`, at its start.
    pub fn new(ring: ShmRing) -> Self {
        Self {
            ring,
            producer: Producer::new(),
            bell: None,
        }
    }

    /// With the receiver's doorbell, rung by `wake_receiver`.
    pub fn with_bell(mut self, bell: Bell) -> Self {
        self.bell = Some(bell);
        self
    }
}

impl SendChannel for ShmSender {
    #[inline]
    fn data(&self) -> &Span {
        &self.ring.data
    }
    #[inline]
    fn reserve(&mut self, len: usize) -> Result<Reservation, RingError> {
        self.producer.reserve(&self.ring, len)
    }
    #[inline]
    fn commit(&mut self, r: Reservation) {
        self.producer.commit(&self.ring, r)
    }
    #[inline]
    fn has_room(&mut self, len: usize) -> Result<bool, RingError> {
        self.producer.has_room(&self.ring, len)
    }
    #[inline]
    fn sent(&self) -> u64 {
        self.producer.tail()
    }
    fn published_anything(&self) -> bool {
        self.ring.load_tail() != 0
    }
    #[inline]
    fn next_hint(&self) -> [*const u8; 2] {
        // The ring's data length is a power of two; if a peer lied about it, this is a wrong
        // hint, not a wrong access (it is never dereferenced).
        let d = &self.ring.data;
        [
            d.addr(self.producer.tail() & d.len().wrapping_sub(1)),
            std::ptr::from_ref::<crate::sync::AtomicU64>(&self.ring.tail).cast::<u8>(),
        ]
    }
    #[inline]
    fn wake_receiver(&self) {
        if let Some(b) = &self.bell {
            b.wake();
        }
    }
    fn ring_receiver(&self) {
        if let Some(b) = &self.bell {
            b.ring();
        }
    }
}

/// The receiving end of a shared-memory ring.
#[derive(Debug)]
pub struct ShmReceiver {
    ring: ShmRing,
    consumer: Consumer,
    bell: Option<Bell>,
}

impl ShmReceiver {
    /// The receiving end of `ring`, at its start.
    pub fn new(ring: ShmRing) -> Self {
        Self {
            ring,
            consumer: Consumer::new(),
            bell: None,
        }
    }

    /// With the sender's credit doorbell, rung by `wake_sender`.
    pub fn with_bell(mut self, bell: Bell) -> Self {
        self.bell = Some(bell);
        self
    }

    /// See [`Consumer::take_ahead`]: the whole record that starts ring bytes about to be
    /// written at index `at` (past a pad at the ring's end), if this receiver would read it
    /// next.
    pub(crate) fn take_ahead(&self, at: u64, bytes: &[u8]) -> Option<crate::ring::Ahead> {
        self.consumer.take_ahead(&self.ring, at, bytes)
    }

    /// See [`Consumer::skip_ahead`].
    pub(crate) fn skip_ahead(&mut self, foot: u64) {
        self.consumer.skip_ahead(&self.ring, foot)
    }
}

impl RecvChannel for ShmReceiver {
    #[inline]
    fn data(&self) -> &Span {
        &self.ring.data
    }
    #[inline]
    fn peek(&mut self) -> Result<Option<Record>, RingError> {
        self.consumer.peek(&self.ring)
    }
    #[inline]
    fn release(&mut self, rec: Record) {
        self.consumer.release(&self.ring, rec)
    }
    #[inline]
    fn consumed(&self) -> u64 {
        self.consumer.head()
    }
    #[inline]
    fn is_drained(&self) -> bool {
        self.consumer.is_drained(&self.ring)
    }
    #[inline]
    fn drained_cached(&self) -> bool {
        self.consumer.drained_cached()
    }
    #[inline]
    fn wake_sender(&self) {
        if let Some(b) = &self.bell {
            b.wake();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Queue pairs' reliable connections.
// ---------------------------------------------------------------------------------------------

/// A queue pair's home: its block in the owner's window (the static header the supervisor
/// wrote, the line the connected peer writes, the inbound ring).
#[derive(Debug)]
pub struct ShmQpHome {
    win: Arc<Region>,
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
    /// The owner context's event block.
    event_off: u64,
    /// The endpoint through which this process carries the QP's pair with a QP of another
    /// host itself, if it does (`verbs::direct`).
    direct: Option<crate::verbs::direct::Home>,
}

impl QpHome for ShmQpHome {
    #[inline]
    fn acked(&self) -> u64 {
        // SYNC POINT qp-ack (acquire): the peer consumed (and NAK'd, if it did) up to here.
        self.ack.load(Ordering::Acquire)
    }
    #[inline]
    fn nak(&self) -> u64 {
        // Read after the ack word's acquire (qp-ack).
        self.nak.load(Ordering::Relaxed)
    }
    #[inline]
    fn credits(&self) -> u64 {
        // SYNC POINT qp-credits (acquire).
        self.credits.load(Ordering::Acquire)
    }
    #[inline]
    fn peer_gone(&self) -> bool {
        // SYNC POINT qp-peer-gone (acquire): the peer's acks and NAKs before the flag are seen.
        self.peer_err.load(Ordering::Acquire) != 0
    }
    #[inline]
    fn peer_rnr(&self) -> u32 {
        self.peer_rnr.load(Ordering::Relaxed)
    }
    fn set_access(&self, bits: u32) {
        // SYNC POINT qp-access (release): requesters read the flags before each one-sided
        // operation.
        self.access.store(bits, Ordering::Release);
    }
    fn reset(&self) {
        let _ = self.win.zero(self.off + QP_ACK_OFF as u64, 64);
        // SYNC POINT ring-publish (release): a reset ring has published nothing.
        self.tail.store(0, Ordering::Release);
    }
    fn watches(
        &self,
        out: &mut Vec<Watch>,
        roles: WatchRoles,
        (tail_seen, ack_seen): (impl FnOnce(u64) -> u64, impl FnOnce(u64) -> u64),
        credits: bool,
    ) {
        if roles.recv {
            out.push(Watch::Moved {
                word: self.tail.clone(),
                // SYNC POINT ring-publish (acquire, watched): what the peer published so far.
                seen: tail_seen(self.tail.load(Ordering::Acquire)),
            });
        }
        out.push(Watch::Flag(self.peer_err.clone()));
        if !roles.send {
            return;
        }
        // SYNC POINT qp-ack (acquire, watched).
        let ack = self.ack.load(Ordering::Acquire);
        out.push(Watch::Moved {
            word: self.ack.clone(),
            seen: ack_seen(ack),
        });
        if credits {
            out.push(Watch::Moved {
                word: self.credits.clone(),
                // SYNC POINT qp-credits (acquire, watched).
                seen: self.credits.load(Ordering::Acquire),
            });
        }
    }
}

/// The peer's block as this end writes it, and its context's event block.
#[derive(Debug)]
pub struct ShmQpLink {
    credits: Word64,
    nak: Word64,
    peer_err: Word32,
    rnr: Word32,
    access: Word32,
    /// The peer context's event block: its completion channel sleeps on it. Rung here, not
    /// through the outbound channel's `wake_receiver`: that cost send-lat 8 B 10–15 ns
    /// (alternating A/Bs), and acks and credits ring it without a message too.
    ev_bell: Word32,
    ev_armed: Word32,
    /// A peer on another host whose pair this process carries itself (`verbs::direct`):
    /// what is written into its shadow is shipped as soon as the bell would ring.
    direct: Option<crate::verbs::direct::DirectQp>,
}

impl QpLink for ShmQpLink {
    #[inline]
    fn publish_credits(&self, posted: u64) {
        // SYNC POINT qp-credits (release): the peer may send once it sees the count.
        self.credits.store(posted, Ordering::Release);
    }
    #[inline]
    fn publish_nak(&self, v: u64) {
        // SYNC POINT qp-ack (release, with the consumer index stored after it).
        self.nak.store(v, Ordering::Relaxed);
    }
    fn publish_rnr(&self, v: u32) {
        self.rnr.store(v, Ordering::Relaxed);
    }
    fn publish_gone(&self) {
        // SYNC POINT qp-peer-gone (release): our acks and NAKs are visible before the flag.
        self.peer_err.store(1, Ordering::Release);
    }
    #[inline(always)]
    fn peer_access(&self) -> u32 {
        // SYNC POINT qp-access (relaxed read of a word that only gates, never publishes).
        self.access.load(Ordering::Relaxed)
    }
    #[inline]
    fn wake_peer(&self) {
        // SYNC POINT qp-bell (sender): ring/ack stores are visible before we read `armed`.
        crate::sync::fence(Ordering::SeqCst);
        if let Some(d) = &self.direct {
            d.kick();
        }
        if self.ev_armed.load(Ordering::Relaxed) != 0 {
            crate::sync::ring(&self.ev_bell);
        }
    }
    fn ring_peer(&self) {
        if let Some(d) = &self.direct {
            d.kick();
        }
        crate::sync::ring(&self.ev_bell);
    }
}

impl QpChannels for ShmTransport {
    type Home = ShmQpHome;
    type Link = ShmQpLink;
    type QpTx = ShmSender;
    type QpRx = ShmReceiver;

    fn create_qp_home(
        &self,
        slot: u32,
        pd: u32,
        qp_type: u32,
        ring_len: u32,
        event_off: u64,
    ) -> Result<(u32, ShmQpHome), FabricError> {
        // RC and UC QPs on a fabric across hosts carry their pairs with other hosts' QPs
        // themselves when they can (unless `BACKPLANE_DIRECT_QP=0`). (UC stayed on the
        // bridges until session 25: `ibv_uc_pingpong -e` hung direct — the lost completion
        // events that `ib_send_lat -e` showed too, since fixed.)
        let direct = (self.fabric.inner.direct_ip.is_some()
            && (qp_type == 2 || qp_type == 3)
            && crate::verbs::direct::wanted())
        .then(|| self.fabric.node(slot).ok())
        .flatten()
        .and_then(|n| crate::verbs::direct::Home::open(&n, pd));
        let (resp, _) = self.fabric.call_service::<VerbsResponse>(
            &VerbsRequest::CreateQp {
                slot,
                pd,
                qp_type,
                ring_len,
                event_off,
                direct: direct.as_ref().map(|d| d.port()),
            },
            &[],
        )?;
        let VerbsResponse::QpCreated { qpn, block_off } = resp else {
            return Err(FabricError::Protocol(format!("{resp:?}")));
        };
        let w = self.fabric.window(slot)?;
        w.check(block_off, QpBlockRepr::footprint(ring_len), 64)?;
        let home = ShmQpHome {
            off: block_off,
            ack: Word64::at(&w, block_off + QP_ACK_OFF as u64)?,
            credits: Word64::at(&w, block_off + QP_CREDITS_OFF as u64)?,
            nak: Word64::at(&w, block_off + QP_NAK_OFF as u64)?,
            peer_err: Word32::at(&w, block_off + QP_PEER_ERR_OFF as u64)?,
            peer_rnr: Word32::at(&w, block_off + QP_PEER_RNR_OFF as u64)?,
            access: Word32::at(&w, block_off + QP_ACCESS_OFF as u64)?,
            tail: Word64::at(&w, block_off + QP_TAIL_OFF as u64)?,
            data: {
                let d = Span::new(&w, block_off + QP_RING_OFF, ring_len.into())?;
                d.populate(true);
                d
            },
            win: w,
            event_off,
            direct,
        };
        Ok((qpn, home))
    }

    fn connect_qp(
        &self,
        home: &ShmQpHome,
        slot: u32,
        qpn: u32,
        qp_type: u32,
        dest_slot: u32,
        dest_qpn: u32,
    ) -> Result<QpConnection<ShmSender, ShmReceiver, ShmQpLink>, FabricError> {
        let fabric = &self.fabric;
        let (resp, _) = fabric.call_service::<VerbsResponse>(
            &VerbsRequest::ConnectQp {
                slot,
                qpn,
                dest_slot,
                dest_qpn,
            },
            &[],
        )?;
        let VerbsResponse::QpConnected {
            block_off,
            generation,
            direct,
        } = resp
        else {
            return Err(FabricError::Protocol(format!("{resp:?}")));
        };
        let pw = fabric.window(dest_slot)?;
        let mut h = [0u8; 64];
        pw.read(block_off, &mut h)?;
        let r = QpBlockRepr::parse(&QpBlockHeader::new_unchecked(&h[..]))?;
        if r.qpn != dest_qpn || r.slot != dest_slot || r.qp_type != qp_type {
            return Err(FabricError::Protocol("peer QP block does not match".into()));
        }
        pw.check(block_off, QpBlockRepr::footprint(r.ring_len), 64)?;
        let at32 = |o: usize| Word32::at(&pw, block_off + o as u64);
        let at64 = |o: usize| Word64::at(&pw, block_off + o as u64);
        // The pair is direct: this process runs its mirror (the shadow's one-sided area
        // follows its block, page-aligned, as the registry lays it out).
        let direct = match (direct, &home.direct) {
            (Some(port), Some(h)) => {
                use crate::fabric::supervisor::mirror::QpBlock;
                let local = QpBlock {
                    win: home.win.clone(),
                    off: home.off,
                    ring_len: home.data.len() as u32,
                    event_off: home.event_off,
                    rdma_off: 0,
                };
                let shadow = QpBlock {
                    win: pw.clone(),
                    off: block_off,
                    ring_len: r.ring_len,
                    event_off: r.event_off,
                    rdma_off: block_off + crate::wire::verbs::rdma_area_at(r.ring_len),
                };
                let peer = Addr {
                    node: dest_slot,
                    port,
                };
                let keys = ((slot, qpn), (dest_slot, dest_qpn));
                // RC only: a UC WRITE_WITH_IMM completes once posted, and its source is the
                // program's again then (a WRITE alone completes once landed, on either).
                let in_place = qp_type == crate::verbs::QpType::Rc as u32;
                Some(crate::verbs::direct::DirectQp::start(
                    h, keys, &local, &shadow, peer, in_place,
                )?)
            }
            _ => None,
        };
        Ok(QpConnection {
            slot: dest_slot,
            qpn: dest_qpn,
            generation,
            link: ShmQpLink {
                credits: at64(QP_CREDITS_OFF)?,
                nak: at64(QP_NAK_OFF)?,
                peer_err: at32(QP_PEER_ERR_OFF)?,
                rnr: at32(QP_PEER_RNR_OFF)?,
                access: at32(QP_ACCESS_OFF)?,
                ev_bell: Word32::at(&pw, r.event_off + EV_BELL_OFF as u64)?,
                ev_armed: Word32::at(&pw, r.event_off + EV_ARMED_OFF as u64)?,
                direct,
            },
            outbound: ShmSender::new(ShmRing::new(at64(QP_TAIL_OFF)?, home.ack.clone(), {
                let d = Span::new(&pw, block_off + QP_RING_OFF, r.ring_len.into())?;
                d.populate(true);
                d
            })),
            inbound: ShmReceiver::new(ShmRing::new(
                home.tail.clone(),
                at64(QP_ACK_OFF)?,
                home.data.clone(),
            )),
        })
    }

    fn destroy_qp_home(&self, slot: u32, qpn: u32) {
        let _ = self
            .fabric
            .call_service::<VerbsResponse>(&VerbsRequest::DestroyQp { slot, qpn }, &[]);
    }
}
