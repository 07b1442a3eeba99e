//! The fabric-verbs path: a byte stream over one RC queue pair, the way an application (or
//! rsocket) streams over RDMA. Each side owns one registered region:
//!
//! - `[0, RING)`: the receive ring, written by the peer with RDMA_WRITE_WITH_IMM (the
//!   immediate is the chunk's length; the receiver reads the bytes in place);
//! - `[RING, 2·RING)`: the send staging area, at the same offsets as the ring positions
//!   they are written to (the application's bytes are copied here, then written out);
//! - `[2·RING, +RX_DEPTH·64)`: the posted receives (credit messages land here).
//!
//! Flow control is by credits: the receiver returns "k chunks consumed" as a zero-length
//! SEND_WITH_IMM (imm = k) once it has consumed a quarter of the ring or of its posted
//! receives; the sender keeps the lengths of chunks in flight and never has more than the
//! ring's bytes or half the receives outstanding, so a WRITE_WITH_IMM always finds both a
//! free ring range and a posted receive. Chunks never wrap: the last one before the end of
//! the ring is shortened instead.
//!
//! Small chunks (≤ [`INLINE`]) are posted inline (one copy, straight into the peer's ring);
//! larger ones take two (into staging, then the write).

use std::collections::VecDeque;
use std::io;
use std::time::{Duration, Instant};

use backplane::fabric::Node;
use backplane::verbs::cm::{self, ConnParam, Listener};
use backplane::verbs::*;

use crate::link::Link;

/// Bytes of the receive ring (and of the staging area).
pub const RING: usize = 4 << 20;
/// Largest chunk one WRITE_WITH_IMM carries.
pub const CHUNK: usize = 1 << 20;
/// Chunks up to this size are posted inline.
pub const INLINE: usize = 256;
const RX_DEPTH: u32 = 512;
const TX_DEPTH: u32 = 128;
/// Every SIGNAL_EVERY-th send is signaled.
const SIGNAL_EVERY: u32 = 32;
const RX_SLOT: u64 = 64;
const STAGING: u64 = RING as u64;
const RX_AREA: u64 = 2 * RING as u64;
const REGION: usize = 2 * RING + (RX_DEPTH as usize) * RX_SLOT as usize;

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

/// One end of the stream.
pub struct VerbsLink {
    // Field order is drop order: the QP before the CQ, the region and the context.
    qp: Qp,
    cq: Cq,
    chan: CompChannel,
    mr: Mr,
    _pd: Pd,
    _ctx: Context,
    peer_rkey: u32,
    /// Bytes written to the peer (its ring position is `wpos % RING`).
    wpos: u64,
    /// Lengths of chunks written and not yet credited.
    in_flight: VecDeque<u32>,
    in_flight_bytes: usize,
    /// Send WRs posted since the last signaled one, and SQ slots in use.
    unsignaled: u32,
    sq_used: u32,
    /// Received chunks not yet fully consumed (lengths), and how much of the first is.
    ready: VecDeque<u32>,
    first_done: usize,
    /// Bytes consumed from the ring (our ring position is `rpos % RING`).
    rpos: u64,
    /// Chunks and bytes consumed since the last credit.
    owe_chunks: u32,
    owe_bytes: usize,
}

impl VerbsLink {
    fn open(node: &Node) -> io::Result<Parts> {
        let ctx = Context::open(node).map_err(err)?;
        let pd = ctx.alloc_pd();
        let chan = ctx.create_comp_channel().map_err(err)?;
        let cq = ctx
            .create_cq(2 * (RX_DEPTH + TX_DEPTH) as usize, Some(&chan))
            .map_err(err)?;
        let mut init = QpInitAttr::new(QpType::Rc, &cq, &cq);
        init.cap = QpCap {
            max_send_wr: TX_DEPTH,
            max_recv_wr: RX_DEPTH,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: INLINE as u32,
        };
        let qp = pd.create_qp(&init).map_err(err)?;
        let access = AccessFlags(AccessFlags::LOCAL_WRITE.0 | AccessFlags::REMOTE_WRITE.0);
        let mr = pd.alloc_mr(REGION, access).map_err(err)?;
        Ok((ctx, pd, cq, qp, mr, chan))
    }

    fn new(parts: Parts, peer_rkey: u32) -> io::Result<Self> {
        let (ctx, pd, cq, qp, mr, chan) = parts;
        let l = VerbsLink {
            qp,
            cq,
            chan,
            mr,
            _pd: pd,
            _ctx: ctx,
            peer_rkey,
            wpos: 0,
            in_flight: VecDeque::new(),
            in_flight_bytes: 0,
            unsignaled: 0,
            sq_used: 0,
            ready: VecDeque::new(),
            first_done: 0,
            rpos: 0,
            owe_chunks: 0,
            owe_bytes: 0,
        };
        for i in 0..RX_DEPTH {
            l.post_recv(u64::from(i))?;
        }
        Ok(l)
    }

    fn offer(mr: &Mr) -> ConnParam {
        ConnParam {
            rkey: mr.rkey(),
            addr: 0,
            len: RING as u64,
            ..ConnParam::default()
        }
    }

    /// Listens on `port` of `node` and accepts one connection (the peer's side).
    pub fn accept(node: &Node, port: u32, timeout: Duration) -> io::Result<Self> {
        let parts = Self::open(node)?;
        let mut l = Listener::bind(&parts.0, port).map_err(err)?;
        // The peer may write as soon as it is connected: receives are posted before.
        let mine = Self::offer(&parts.4);
        cm::init_qp(&parts.3, &mine).map_err(err)?;
        let mut link = Self::new(parts, 0)?;
        let peer = l.accept(&link.qp, &mine, Some(timeout)).map_err(err)?;
        link.peer_rkey = peer.rkey;
        Ok(link)
    }

    /// Connects from `node` to the listener at (`to`, `port`) (the bench's side).
    pub fn connect(node: &Node, to: u32, port: u32, timeout: Duration) -> io::Result<Self> {
        let parts = Self::open(node)?;
        let mine = Self::offer(&parts.4);
        cm::init_qp(&parts.3, &mine).map_err(err)?;
        let mut link = Self::new(parts, 0)?;
        let peer = cm::connect(&link._ctx, to, port, &link.qp, &mine, timeout).map_err(err)?;
        link.peer_rkey = peer.rkey;
        Ok(link)
    }

    fn post_recv(&self, slot: u64) -> io::Result<()> {
        self.qp
            .post_recv(&[RecvWr {
                wr_id: slot,
                sg_list: &[self.mr.sge(RX_AREA + slot * RX_SLOT, RX_SLOT as u32)],
            }])
            .map_err(err)
    }

    /// Polls the CQ once: frees send slots, queues received chunks, applies credits.
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
                    if w.imm_data == 0 || w.imm_data as usize > CHUNK {
                        return Err(err(format!("chunk of {} bytes from the peer", w.imm_data)));
                    }
                    self.ready.push_back(w.imm_data);
                    self.post_recv(w.wr_id)?;
                }
                WcOpcode::Recv => {
                    let k = w.imm_data as usize;
                    if k > self.in_flight.len() {
                        return Err(err(format!(
                            "credit for {k} chunks, {} in flight",
                            self.in_flight.len()
                        )));
                    }
                    for len in self.in_flight.drain(..k) {
                        self.in_flight_bytes -= len as usize;
                    }
                    self.post_recv(w.wr_id)?;
                }
                // Signaled sends carry the number of send slots they free.
                _ => self.sq_used -= w.wr_id as u32,
            }
        }
        Ok(n > 0)
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

    /// Posts one send WR, signaling every SIGNAL_EVERY-th; waits for a free send slot.
    fn post(&mut self, mut wr: SendWr<'_>) -> io::Result<()> {
        while self.sq_used >= TX_DEPTH {
            self.progress()?;
        }
        self.unsignaled += 1;
        if self.unsignaled == SIGNAL_EVERY {
            wr.wr_id = u64::from(self.unsignaled);
            wr.send_flags = SendFlags(wr.send_flags.0 | SendFlags::SIGNALED.0);
            self.unsignaled = 0;
        }
        self.sq_used += 1;
        self.qp.post_send(&[wr]).map_err(err)
    }

    /// Returns credit for what was consumed once it is worth a message (a quarter of the
    /// ring or of the receives), so a sender never waits on credit the receiver holds back.
    fn maybe_credit(&mut self) -> io::Result<()> {
        if self.owe_chunks >= RX_DEPTH / 4 || self.owe_bytes >= RING / 4 {
            let k = self.owe_chunks;
            self.owe_chunks = 0;
            self.owe_bytes = 0;
            let wr = SendWr {
                opcode: WrOpcode::SendWithImm,
                imm_data: k,
                ..SendWr::default()
            };
            self.post(wr)?;
        }
        Ok(())
    }
}

impl Link for VerbsLink {
    fn max_dgram(&self) -> Option<usize> {
        None
    }

    fn send(&mut self, data: &[u8]) -> io::Result<()> {
        let mut off = 0;
        let t0 = Instant::now();
        while off < data.len() {
            let pos = (self.wpos % RING as u64) as usize;
            let len = (data.len() - off).min(CHUNK).min(RING - pos);
            let mut idle = Idle::default();
            while self.in_flight_bytes + len > RING
                || self.in_flight.len() >= (RX_DEPTH / 2) as usize
            {
                if self.progress()? {
                    idle = Idle::default();
                } else if idle.should_sleep() {
                    if t0.elapsed() > Duration::from_secs(10) {
                        return Err(err("the peer returned no credit for 10 s"));
                    }
                    self.sleep(Duration::from_millis(100))?;
                }
            }
            let chunk = &data[off..off + len];
            let remote = pos as u64;
            if len <= INLINE {
                let mut wr = SendWr::write(0, &[], remote, self.peer_rkey).with_imm(len as u32);
                wr.send_flags = SendFlags::INLINE;
                wr.inline_data = chunk;
                self.post(wr)?;
            } else {
                let stage = STAGING as usize + pos;
                self.mr.as_mut_slice()[stage..stage + len].copy_from_slice(chunk);
                let sge = [self.mr.sge(stage as u64, len as u32)];
                let wr = SendWr::write(0, &sge, remote, self.peer_rkey).with_imm(len as u32);
                self.post(wr)?;
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
        let chunk = self.ready[0] as usize;
        let n = (chunk - self.first_done).min(max.max(1));
        let pos = (self.rpos % RING as u64) as usize;
        f(&self.mr.as_slice()[pos..pos + n]);
        self.rpos += n as u64;
        self.first_done += n;
        if self.first_done == chunk {
            self.ready.pop_front();
            self.first_done = 0;
            self.owe_chunks += 1;
            self.owe_bytes += chunk;
            self.maybe_credit()?;
        }
        Ok(Some(n))
    }
}
