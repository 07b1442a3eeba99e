//! The fabric-verbs paths: a byte stream over one RC queue pair, the ways an application (or
//! rsocket) streams over RDMA. Three [`Mode`]s:
//!
//! - **WRITE** ([`Mode::WriteImm`]): the sender RDMA_WRITE_WITH_IMMs each chunk into a ring
//!   in the receiver's region (imm = length); the receiver reads it in place.
//! - **SEND** ([`Mode::Send`]): the sender SENDs each chunk (≤ 64 KiB) into the receiver's
//!   next posted receive buffer; the receiver reads it there and reposts the buffer.
//! - **READ** ([`Mode::Read`], rendezvous): the sender puts each chunk in its staging area and
//!   announces it with a zero-length SEND_WITH_IMM; the receiver pulls it with RDMA_READ into
//!   its ring and reads it in place.
//!
//! Each side owns one registered region:
//! - `[0, RING)`: the receive ring (WRITE: written by the peer; READ: read into by us);
//! - `[RING, 2·RING)`: the send staging area, at the same offsets as the ring positions its
//!   chunks go to (the application's bytes are copied here first);
//! - then the posted receives: 64 B each (credits, announcements), or 64 KiB each (SEND).
//!
//! Flow control (WRITE, READ) is by credits: the receiver returns "k chunks consumed" as a
//! zero-length SEND_WITH_IMM once it has consumed a quarter of the ring or of its posted
//! receives; the sender keeps the lengths of chunks in flight and never has more than the
//! ring's bytes or half the receives outstanding, so a chunk always finds a free ring range
//! and a posted receive. SEND needs no credits: the RC QP waits for posted receives itself
//! (receiver-not-ready), and a staging range is reused once its SEND completed. Chunks never
//! wrap: the last one before the end of the ring is shortened instead.
//!
//! Chunks of up to [`INLINE`] bytes are posted inline (WRITE, SEND), skipping the staging copy.

use std::collections::VecDeque;
use std::io;
use std::time::{Duration, Instant};

use backplane::fabric::Node;
use backplane::verbs::cm::{self, ConnParam, Listener};
use backplane::verbs::*;

use crate::link::Link;

/// Bytes of the receive ring (and of the staging area).
pub const RING: usize = 4 << 20;
/// Largest chunk one WRITE or READ carries.
pub const CHUNK: usize = 1 << 20;
/// Largest chunk one SEND carries (the size of a posted receive).
pub const SEND_CHUNK: usize = 64 << 10;
/// Chunks up to this size are posted inline.
pub const INLINE: usize = 256;
const TX_DEPTH: u32 = 128;
/// Every SIGNAL_EVERY-th send is signaled.
const SIGNAL_EVERY: u32 = 32;
const STAGING: u64 = RING as u64;
const RX_AREA: u64 = 2 * RING as u64;
/// Immediate of an announcement (READ mode); credits have the bit clear.
const ANNOUNCE: u32 = 1 << 31;
/// Completion tags in a signaled WR's id (the low 32 bits count the send slots it frees).
const TAG_READ: u64 = 1 << 32;

/// How the stream moves its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// RDMA_WRITE_WITH_IMM into the peer's ring.
    WriteImm,
    /// SEND into the peer's posted receives.
    Send,
    /// Announce, then the peer pulls with RDMA_READ.
    Read,
}

impl Mode {
    fn rx_depth(self) -> u32 {
        match self {
            Mode::Send => 128,
            _ => 512,
        }
    }
    fn rx_slot(self) -> u64 {
        match self {
            Mode::Send => SEND_CHUNK as u64,
            _ => 64,
        }
    }
    fn chunk(self) -> usize {
        match self {
            Mode::Send => SEND_CHUNK,
            _ => CHUNK,
        }
    }
}

fn err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// Context, PD, CQ, QP, region, completion channel.
type Parts = (Context, Pd, Cq, Qp, Mr, CompChannel);

/// How long a waiting side polls before it sleeps on its completion channel (the
/// libibverbs pattern: poll, arm, poll, wait for the event). Waking through the channel
/// costs a watcher thread and an eventfd, tens of µs or more on a loaded machine; never
/// sleeping starves the peer of a processor on a small one. 20 µs covers a quiet round trip.
const SPIN: Duration = Duration::from_micros(20);

/// Empty polls counted by a waiting side; the clock is read only every 256 of them.
#[derive(Default)]
struct Idle {
    polls: u32,
    since: Option<Instant>,
}

impl Idle {
    /// Whether the side has polled for [`SPIN`] without result.
    fn should_sleep(&mut self) -> bool {
        self.polls += 1;
        if !self.polls.is_multiple_of(256) {
            return false;
        }
        let t = *self.since.get_or_insert_with(Instant::now);
        t.elapsed() >= SPIN
    }
}

/// A received chunk waiting to be consumed.
#[derive(Debug, Clone, Copy)]
struct Ready {
    /// Offset in our region.
    off: u64,
    len: u32,
    /// SEND: the receive buffer to repost once consumed.
    repost: Option<u64>,
}

/// One end of the stream.
pub struct VerbsLink {
    // Field order is drop order: the QP before the CQ, the region and the context.
    qp: Qp,
    cq: Cq,
    chan: CompChannel,
    mr: Mr,
    _pd: Pd,
    _ctx: Context,
    mode: Mode,
    peer_rkey: u32,
    /// Bytes sent to the peer (its ring position is `wpos % RING`).
    wpos: u64,
    /// Lengths of chunks sent and not yet credited (WRITE, READ) or completed (SEND).
    in_flight: VecDeque<u32>,
    in_flight_bytes: usize,
    /// Send WRs posted since the last signaled one, and SQ slots in use.
    unsignaled: u32,
    sq_used: u32,
    /// Chunks received, in order; how much of the first is consumed.
    ready: VecDeque<Ready>,
    first_done: usize,
    /// Bytes that arrived in (WRITE) or were pulled into (READ) our ring.
    lpos: u64,
    /// READ: announced chunks not yet pulled (lengths), and chunks whose RDMA_READ is posted
    /// and not complete, in order.
    announced: VecDeque<u32>,
    reading: VecDeque<Ready>,
    /// Chunks and bytes consumed since the last credit.
    owe_chunks: u32,
    owe_bytes: usize,
}

impl VerbsLink {
    fn open(node: &Node, mode: Mode) -> io::Result<Parts> {
        let ctx = Context::open(node).map_err(err)?;
        let pd = ctx.alloc_pd();
        let chan = ctx.create_comp_channel().map_err(err)?;
        let cq = ctx
            .create_cq(2 * (mode.rx_depth() + TX_DEPTH) as usize, Some(&chan))
            .map_err(err)?;
        let mut init = QpInitAttr::new(QpType::Rc, &cq, &cq);
        init.cap = QpCap {
            max_send_wr: TX_DEPTH,
            max_recv_wr: mode.rx_depth(),
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: INLINE as u32,
        };
        let qp = pd.create_qp(&init).map_err(err)?;
        let access = AccessFlags::from_bits_retain(
            AccessFlags::LOCAL_WRITE.bits()
                | AccessFlags::REMOTE_WRITE.bits()
                | AccessFlags::REMOTE_READ.bits(),
        );
        let region = 2 * RING + (mode.rx_depth() as u64 * mode.rx_slot()) as usize;
        let mr = pd.alloc_mr(region, access).map_err(err)?;
        Ok((ctx, pd, cq, qp, mr, chan))
    }

    fn new(parts: Parts, mode: Mode) -> io::Result<Self> {
        let (ctx, pd, cq, qp, mr, chan) = parts;
        let l = VerbsLink {
            qp,
            cq,
            chan,
            mr,
            _pd: pd,
            _ctx: ctx,
            mode,
            peer_rkey: 0,
            wpos: 0,
            in_flight: VecDeque::new(),
            in_flight_bytes: 0,
            unsignaled: 0,
            sq_used: 0,
            ready: VecDeque::new(),
            first_done: 0,
            lpos: 0,
            announced: VecDeque::new(),
            reading: VecDeque::new(),
            owe_chunks: 0,
            owe_bytes: 0,
        };
        for i in 0..mode.rx_depth() {
            l.post_recv(u64::from(i))?;
        }
        Ok(l)
    }

    fn offer(mr: &Mr) -> ConnParam {
        ConnParam {
            rkey: mr.rkey(),
            addr: 0,
            len: mr.len() as u64,
            ..ConnParam::default()
        }
    }

    /// Listens on `port` of `node` and accepts one connection (the peer's side).
    pub fn accept(node: &Node, port: u32, mode: Mode, timeout: Duration) -> io::Result<Self> {
        let parts = Self::open(node, mode)?;
        let mut l = Listener::bind(&parts.0, port).map_err(err)?;
        // The peer may send as soon as it is connected: receives are posted before.
        let mine = Self::offer(&parts.4);
        cm::init_qp(&parts.3, &mine).map_err(err)?;
        let mut link = Self::new(parts, mode)?;
        let peer = l.accept(&link.qp, &mine, Some(timeout)).map_err(err)?;
        link.peer_rkey = peer.rkey;
        Ok(link)
    }

    /// Connects from `node` to the listener at (`to`, `port`) (the bench's side).
    pub fn connect(
        node: &Node,
        to: u32,
        port: u32,
        mode: Mode,
        timeout: Duration,
    ) -> io::Result<Self> {
        let parts = Self::open(node, mode)?;
        let mine = Self::offer(&parts.4);
        cm::init_qp(&parts.3, &mine).map_err(err)?;
        let mut link = Self::new(parts, mode)?;
        let peer = cm::connect(&link._ctx, to, port, &link.qp, &mine, timeout).map_err(err)?;
        link.peer_rkey = peer.rkey;
        Ok(link)
    }

    fn post_recv(&self, slot: u64) -> io::Result<()> {
        let rx = self.mode.rx_slot();
        self.qp
            .post_recv(&[RecvWr {
                wr_id: slot,
                sg_list: &[self.mr.sge(RX_AREA + slot * rx, rx as u32)],
            }])
            .map_err(err)
    }

    /// Polls the CQ once: frees send slots, queues received chunks, applies credits, pulls
    /// announced chunks. Whether anything completed.
    fn progress(&mut self) -> io::Result<bool> {
        let mut wc = [Wc::default(); 32];
        let n = self.cq.poll(&mut wc);
        for w in &wc[..n] {
            if w.status != WcStatus::Success {
                return Err(err(format!(
                    "verbs work completed with {} ({:?})",
                    w.status, w.opcode
                )));
            }
            match w.opcode {
                WcOpcode::RecvRdmaWithImm => {
                    self.arrived(w.imm_data, None)?;
                    self.post_recv(w.wr_id)?;
                }
                WcOpcode::Recv if self.mode == Mode::Send && w.byte_len == 0 => {
                    // A flush marker (see `flush`): no data.
                    self.post_recv(w.wr_id)?;
                }
                WcOpcode::Recv if self.mode == Mode::Send => {
                    let len = w.byte_len;
                    if u64::from(len) > self.mode.rx_slot() {
                        return Err(err(format!("a SEND of {len} bytes from the peer")));
                    }
                    self.ready.push_back(Ready {
                        off: RX_AREA + w.wr_id * self.mode.rx_slot(),
                        len,
                        repost: Some(w.wr_id),
                    });
                }
                WcOpcode::Recv if w.imm_data & ANNOUNCE != 0 && self.mode == Mode::Read => {
                    self.announced.push_back(w.imm_data & !ANNOUNCE);
                    self.post_recv(w.wr_id)?;
                }
                WcOpcode::Recv => {
                    self.credited(w.imm_data as usize)?;
                    self.post_recv(w.wr_id)?;
                }
                _ => {
                    self.sq_used -= w.wr_id as u32;
                    if self.mode == Mode::Send {
                        // Every WR of a SEND stream is a chunk: those up to this one are done.
                        for _ in 0..(w.wr_id as u32) {
                            if let Some(len) = self.in_flight.pop_front() {
                                self.in_flight_bytes -= len as usize;
                            }
                        }
                    }
                    if w.wr_id & TAG_READ != 0 {
                        let r = self
                            .reading
                            .pop_front()
                            .ok_or_else(|| err("an RDMA_READ completed that was not posted"))?;
                        self.ready.push_back(r);
                    }
                }
            }
        }
        self.pull()?;
        Ok(n > 0)
    }

    /// A chunk of `len` bytes landed at our ring position (WRITE).
    fn arrived(&mut self, len: u32, repost: Option<u64>) -> io::Result<()> {
        let off = self.ring_take(len)?;
        self.ready.push_back(Ready { off, len, repost });
        Ok(())
    }

    /// Claims the next `len` bytes of our ring (never wrapping, as the sender cut them).
    fn ring_take(&mut self, len: u32) -> io::Result<u64> {
        let off = self.lpos % RING as u64;
        if len == 0 || len as usize > CHUNK || off + u64::from(len) > RING as u64 {
            return Err(err(format!("a chunk of {len} bytes at ring offset {off}")));
        }
        self.lpos += u64::from(len);
        Ok(off)
    }

    /// READ: pulls announced chunks from the peer's staging area into our ring, in order,
    /// while the send queue has room (never waiting: this runs inside `progress`, which
    /// must not recurse, or completions would be handled out of order).
    fn pull(&mut self) -> io::Result<()> {
        while self.sq_used < TX_DEPTH {
            let Some(len) = self.announced.pop_front() else {
                break;
            };
            let off = self.ring_take(len)?;
            let sge = [self.mr.sge(off, len)];
            let wr = SendWr::read(0, &sge, STAGING + off, self.peer_rkey);
            self.post(wr, Some(TAG_READ))?;
            self.reading.push_back(Ready {
                off,
                len,
                repost: None,
            });
        }
        Ok(())
    }

    /// The peer consumed `k` more chunks (WRITE, READ).
    fn credited(&mut self, k: usize) -> io::Result<()> {
        if k > self.in_flight.len() {
            return Err(err(format!(
                "credit for {k} chunks, {} in flight",
                self.in_flight.len()
            )));
        }
        for len in self.in_flight.drain(..k) {
            self.in_flight_bytes -= len as usize;
        }
        Ok(())
    }

    /// Sleeps until the CQ has a completion or `max` passes (the libibverbs pattern: arm,
    /// poll once more for what arrived before arming, then wait for the event).
    fn sleep(&mut self, max: Duration) -> io::Result<()> {
        self.cq.req_notify(false).map_err(err)?;
        if self.progress()? {
            return Ok(());
        }
        match self.chan.get_cq_event(Some(max)) {
            Ok(_) => {
                self.chan.ack_cq_events(1);
                Ok(())
            }
            Err(VerbsError::TimedOut) => Ok(()),
            Err(e) => Err(err(e)),
        }
    }

    /// Posts one send WR, signaling every SIGNAL_EVERY-th (and every one given a tag); waits
    /// for a free send slot. A signaled WR's id counts the slots its completion frees.
    fn post(&mut self, mut wr: SendWr<'_>, tag: Option<u64>) -> io::Result<()> {
        let mut idle = Idle::default();
        while self.sq_used >= TX_DEPTH {
            if !self.progress()? && idle.should_sleep() {
                self.sleep(Duration::from_millis(100))?;
            }
        }
        self.unsignaled += 1;
        if self.unsignaled == SIGNAL_EVERY || tag.is_some() {
            wr.wr_id = u64::from(self.unsignaled) | tag.unwrap_or(0);
            wr.send_flags |= SendFlags::SIGNALED;
            self.unsignaled = 0;
        }
        self.sq_used += 1;
        self.qp.post_send(&[wr]).map_err(err)
    }

    /// Returns credit for what was consumed once it is worth a message (a quarter of the
    /// ring or of the receives), so a sender never waits on credit the receiver holds back.
    fn maybe_credit(&mut self) -> io::Result<()> {
        if self.owe_chunks >= self.mode.rx_depth() / 4 || self.owe_bytes >= RING / 4 {
            let k = self.owe_chunks;
            self.owe_chunks = 0;
            self.owe_bytes = 0;
            self.post_signal(k)?;
        }
        Ok(())
    }

    /// A zero-length SEND_WITH_IMM (a credit, or an announcement with [`ANNOUNCE`]).
    fn post_signal(&mut self, imm: u32) -> io::Result<()> {
        let wr = SendWr {
            opcode: WrOpcode::SendWithImm,
            imm_data: imm,
            ..SendWr::default()
        };
        self.post(wr, None)
    }

    /// Makes progress until `done`, polling for [`SPIN`] and then sleeping on the channel;
    /// gives up when 10 s pass without `done` (the peer "`what` for 10 s").
    fn wait_for(&mut self, done: impl Fn(&Self) -> bool, what: &str) -> io::Result<()> {
        let t0 = Instant::now();
        let mut idle = Idle::default();
        while !done(self) {
            if self.progress()? {
                idle = Idle::default();
            } else if idle.should_sleep() {
                if t0.elapsed() > Duration::from_secs(10) {
                    return Err(err(format!("the peer {what} for 10 s")));
                }
                self.sleep(Duration::from_millis(100))?;
            }
        }
        Ok(())
    }

    /// Whether the peer has room for one more chunk of `len` bytes.
    fn room(&self, len: usize) -> bool {
        let chunks = match self.mode {
            // Bounded by the send queue (and staging bytes) only.
            Mode::Send => usize::MAX,
            _ => (self.mode.rx_depth() / 2) as usize,
        };
        self.in_flight_bytes + len <= RING && self.in_flight.len() < chunks
    }
}

impl Link for VerbsLink {
    fn max_dgram(&self) -> Option<usize> {
        None
    }

    /// The engine moves work only inside calls (there is no adapter to do it in the
    /// background): a sender that stops calling could leave its last WRs queued, waiting for
    /// receive credit. Posts a signaled zero-length marker (a SEND_WITH_IMM crediting
    /// nothing; an empty SEND on a SEND stream) and polls until every WR has completed.
    fn flush(&mut self) -> io::Result<()> {
        if self.sq_used == 0 {
            return Ok(());
        }
        let marker = match self.mode {
            Mode::Send => SendWr::send(0, &[]),
            _ => SendWr {
                opcode: WrOpcode::SendWithImm,
                imm_data: 0,
                ..SendWr::default()
            },
        };
        self.post(marker, Some(0))?;
        self.wait_for(|l| l.sq_used == 0, "acknowledged nothing")
    }

    fn send(&mut self, data: &[u8]) -> io::Result<()> {
        let mut off = 0;
        while off < data.len() {
            let pos = (self.wpos % RING as u64) as usize;
            let len = (data.len() - off).min(self.mode.chunk()).min(RING - pos);
            if !self.room(len) {
                self.wait_for(|l| l.room(len), "made no room")?;
            }
            let chunk = &data[off..off + len];
            let remote = pos as u64;
            if len <= INLINE && self.mode != Mode::Read {
                let mut wr = match self.mode {
                    Mode::Send => SendWr::send_inline(0, chunk),
                    _ => SendWr::write(0, &[], remote, self.peer_rkey).with_imm(len as u32),
                };
                wr.send_flags = SendFlags::INLINE;
                wr.inline_data = chunk;
                self.post(wr, None)?;
            } else {
                let stage = STAGING as usize + pos;
                self.mr
                    .write(stage as u64, chunk)
                    .map_err(|e| io::Error::other(e.to_string()))?;
                let sge = [self.mr.sge(stage as u64, len as u32)];
                match self.mode {
                    Mode::WriteImm => {
                        let wr =
                            SendWr::write(0, &sge, remote, self.peer_rkey).with_imm(len as u32);
                        self.post(wr, None)?;
                    }
                    Mode::Send => self.post(SendWr::send(0, &sge), None)?,
                    Mode::Read => self.post_signal(ANNOUNCE | len as u32)?,
                }
            }
            self.in_flight.push_back(len as u32);
            self.in_flight_bytes += len;
            self.wpos += len as u64;
            off += len;
        }
        Ok(())
    }

    fn recv(
        &mut self,
        timeout: Duration,
        max: usize,
        f: &mut dyn FnMut(&[u8]),
    ) -> io::Result<Option<usize>> {
        let mut deadline = None;
        let mut idle = Idle::default();
        while self.ready.is_empty() {
            if self.progress()? {
                continue;
            }
            if idle.should_sleep() {
                let d = *deadline.get_or_insert_with(|| Instant::now() + timeout);
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(None);
                }
                self.sleep(left.min(Duration::from_millis(100)))?;
            }
        }
        let r = self.ready[0];
        let n = (r.len as usize - self.first_done).min(max.max(1));
        let at = r.off as usize + self.first_done;
        // In place, as a receiver of RDMA data reads its own buffer (a copy here would charge
        // this path a second pass the others do not pay).
        #[allow(unsafe_code)]
        // SAFETY: `[at, at+n)` lies in a chunk a completion handed over (`ready`); the peer
        // writes it again only after it is reposted or announced free, which happens below,
        // after `f` returns; no receive of ours completes into it meanwhile.
        let bytes =
            unsafe { self.mr.bytes(at as u64, n) }.map_err(|e| io::Error::other(e.to_string()))?;
        f(bytes);
        self.first_done += n;
        if self.first_done == r.len as usize {
            self.ready.pop_front();
            self.first_done = 0;
            match r.repost {
                Some(slot) => self.post_recv(slot)?,
                None => {
                    self.owe_chunks += 1;
                    self.owe_bytes += r.len as usize;
                    self.maybe_credit()?;
                }
            }
        }
        Ok(Some(n))
    }
}
