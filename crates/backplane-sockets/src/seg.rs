//! The shared segment of one accelerated connection: a header both ends fill in during the
//! agreement, and two single-producer single-consumer byte rings, one per direction.
//!
//! The segment is a file in the fabric's run directory that the connecting end creates (the
//! *offer*) and the accepting end maps and claims. Everything the other process writes here is
//! untrusted: positions are validated against the ring size on every read, and a position
//! that cannot be right ends the connection (`ECONNRESET`), never a read out of bounds.
//!
//! Each end keeps its own copy of the position it advances (the producer its tail, the
//! consumer its head) and only ever *writes* that word; the peer's word is read, checked and
//! used. A process of the same end that takes over (after a fork) starts from the words in
//! the segment. A connection inherited across `exec` goes back to the kernel's TCP in both
//! directions (`back`): the new program gets the TCP socket itself. Layout (offsets in bytes):
//!
//! ```text
//! 0     magic "BPACCEL1", version u32, ring size u32, cookie u64
//! 24    state u32 (OFFERED, CLAIMED), client pid/wake fd, server pid/wake fd (u32 each)
//! 48    client wake inode u64, server wake inode u64, dst port, src port, dst node, src node
//! 256   direction block client→server (see `Dir`), 768 bytes
//! 1024  direction block server→client
//! 4096  ring data client→server, then ring data server→client
//! ```

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// "BPACCEL1", little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"BPACCEL1");
/// Layout version; a segment of another version is not claimed.
pub const VERSION: u32 = 2;
/// Bytes before the first ring.
pub const HDR: usize = 4096;
/// Smallest and largest ring a peer may declare.
pub const MIN_RING: usize = 4096;
/// See [`MIN_RING`].
pub const MAX_RING: usize = 64 << 20;

/// Consumer wake-up state: a wake-up byte was sent (by the producer or the helper) or the
/// consumer itself queued one; no more are needed.
pub const RX_POKED: u32 = 0;
/// Consumer wake-up state: the consumer is idle (in the program, maybe in `poll`) with no
/// wake-up byte queued; the next bytes must send one.
pub const RX_ARMED: u32 = 1;
/// Consumer wake-up state: the consumer is inside a call, looking at the ring itself.
pub const RX_ACTIVE: u32 = 2;
/// Consumer wake-up state: idle, but a `poll`/`select`/`epoll_wait` of the consumer's is
/// spinning on the ring: the producer sends no byte; the spinner queues one itself when it
/// sees bytes (or goes back to ARMED and looks again), so the program's kernel call that
/// follows finds the descriptor readable instead of sleeping until the producer's byte comes.
pub const RX_SPIN: u32 = 3;
/// Consumer wake-up state: idle, bytes on the ring, and the wake-up byte that says so not sent
/// yet: a `poll`/`select` spinner saw bytes come, and answers from the rings — the program's
/// read that follows takes them, without the byte's send and receive (two system calls per
/// read of a streaming reader). A wait that sleeps in the kernel instead pays the byte first,
/// and the helper thread pays any debt left on its next round (a program that never read).
/// The producer sends nothing in this state: there are bytes already.
pub const RX_OWED: u32 = 4;

/// `state`: the connecting end offered the segment.
pub const OFFERED: u32 = 1;
/// `state`: the accepting end claimed it; its pid and wake descriptor are filled in.
pub const CLAIMED: u32 = 2;

const O_MAGIC: usize = 0;
const O_VERSION: usize = 8;
const O_RING: usize = 12;
const O_COOKIE: usize = 16;
const O_STATE: usize = 24;
const O_CPID: usize = 28;
const O_CWAKE: usize = 32;
const O_SPID: usize = 36;
const O_SWAKE: usize = 40;
const O_CINO: usize = 48;
const O_SINO: usize = 56;
const O_DPORT: usize = 64;
const O_SPORT: usize = 68;
const O_DNODE: usize = 72;
const O_SNODE: usize = 76;
const O_C2S: usize = 256;
const O_S2C: usize = 1024;

// Direction block: each word the two ends write often on its own cache line.
const D_TAIL: usize = 0; // producer
const D_HEAD: usize = 64; // consumer
const D_RX_WAIT: usize = 128; // consumer sets, producer clears (then wakes the consumer)
const D_TX_WAIT: usize = 192; // producer sets, consumer clears (then wakes the producer)
const D_SWITCHED: usize = 256; // producer: bytes now go to the ring, after `prefix` on TCP
const D_FIN: usize = 260; // producer: no more bytes (shutdown/close)
const D_TCP_FIN: usize = 268; // producer: shut down on the kernel's TCP before switching
const D_PREFIX: usize = 272; // producer: bytes sent on the TCP connection before the switch
                             // Which process of an end last used a direction, and where it left it: a process that takes
                             // over (the other side of a fork, the new program after an exec) starts from these words.
const D_RX_OWNER: usize = 320; // consumer: pid that last read
const D_RX_TCP: usize = 328; // consumer: bytes read from TCP (the prefix, as far as read)
const D_TX_OWNER: usize = 384; // producer: pid that last wrote
const D_TX_TCP: usize = 392; // producer: bytes written to TCP before the switch
                             // Back to the kernel's TCP (a connection inherited across `exec` leaves the rings): the
                             // producer's bytes from ring position `back_at` on are on TCP.
const D_BACK: usize = 448; // producer
const D_BACK_AT: usize = 456; // producer
const D_BACK_CLAIM: usize = 464; // producer processes: which one moves the ring's bytes
const D_BACK_REQ: usize = 512; // consumer: asks the producer to go back
const D_URG_TAKEN: usize = 516; // consumer: took the producer's going-back urgent byte
                                // After a fork, several processes of one end may use a direction at the same instant: each
                                // call holds its end's lock word for the direction (the pid holding it, `LOCK_WAITERS` set by
                                // the processes sleeping on it).
const D_TX_LOCK: usize = 576; // producer processes
const D_RX_LOCK: usize = 640; // consumer processes

/// Set in a lock word when a process sleeps on it (the holder wakes them on release).
const LOCK_WAITERS: u32 = 1 << 31;
/// How long a waiter sleeps before it looks whether the holder is still alive.
const LOCK_CHECK_NS: u64 = 20_000_000;

/// Who an end is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Connected (`connect`), made the offer.
    Client,
    /// Accepted (`accept`), claimed the offer.
    Server,
}

/// What a client writes into a fresh segment.
#[derive(Debug, Clone, Copy)]
pub struct Offer {
    /// Ring bytes per direction (power of two).
    pub ring: usize,
    /// Random, to tell segments apart in logs.
    pub cookie: u64,
    /// The client's pid and wake descriptor (and that socket's inode, to check a duplicate).
    pub pid: u32,
    /// See `pid`.
    pub wake_fd: i32,
    /// See `pid`.
    pub wake_ino: u64,
    /// Destination (listening) port and node, source port and node.
    pub dport: u16,
    /// See `dport`.
    pub sport: u16,
    /// See `dport`.
    pub dnode: u32,
    /// See `dport`.
    pub snode: u32,
}

/// Why a segment is not claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalid {
    /// Shorter than its header or rings say.
    Size,
    /// Not a segment of this version.
    Magic,
    /// A ring size that is not a power of two in range.
    Ring,
    /// Not in the OFFERED state (claimed already, or garbage).
    State,
    /// Made for another connection.
    Endpoints,
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Invalid::Size => "offer too short",
            Invalid::Magic => "offer of another version",
            Invalid::Ring => "offer with a bad ring size",
            Invalid::State => "offer not in the offered state",
            Invalid::Endpoints => "offer for other endpoints",
        })
    }
}

/// A mapped segment.
#[derive(Debug)]
pub struct Seg {
    base: *mut u8,
    len: usize,
    ring: usize,
}

// SAFETY: the segment is shared memory accessed only through atomics and byte copies; the
// mapping itself is valid from any thread until `unmap`.
unsafe impl Send for Seg {}
// SAFETY: as above.
unsafe impl Sync for Seg {}

/// Bytes a segment with `ring` bytes per direction needs.
pub fn seg_len(ring: usize) -> usize {
    HDR + 2 * ring
}

impl Seg {
    /// Wraps a mapping of `len` bytes at `base`.
    ///
    /// # Safety
    /// `base` must be a live, writable mapping of at least `len` bytes, page-aligned, that
    /// stays mapped until [`Seg::unmap`] (or forever).
    pub unsafe fn from_raw(base: *mut u8, len: usize) -> Self {
        Seg { base, len, ring: 0 }
    }

    /// A second handle on the same mapping (never unmapped through it).
    ///
    /// # Safety
    /// The caller must not use the alias after the original is unmapped.
    pub unsafe fn alias(&self) -> Seg {
        Seg {
            base: self.base,
            len: self.len,
            ring: self.ring,
        }
    }

    fn u32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off + 4 <= HDR && off.is_multiple_of(4));
        // SAFETY: off is a constant of the layout inside the header, 4-aligned; the mapping
        // is page-aligned and at least HDR long (checked by `init`/`validate`).
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    fn u64(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= HDR && off.is_multiple_of(8));
        // SAFETY: as in `u32`, 8-aligned.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    /// Writes a fresh offer (the client, before anyone else can see the file).
    pub fn init(&mut self, o: &Offer) {
        assert!(self.len >= seg_len(o.ring) && o.ring.is_power_of_two());
        self.ring = o.ring;
        self.u32(O_VERSION).store(VERSION, Ordering::Relaxed);
        self.u32(O_RING).store(o.ring as u32, Ordering::Relaxed);
        self.u64(O_COOKIE).store(o.cookie, Ordering::Relaxed);
        self.u32(O_CPID).store(o.pid, Ordering::Relaxed);
        self.u32(O_CWAKE).store(o.wake_fd as u32, Ordering::Relaxed);
        self.u64(O_CINO).store(o.wake_ino, Ordering::Relaxed);
        self.u32(O_DPORT)
            .store(u32::from(o.dport), Ordering::Relaxed);
        self.u32(O_SPORT)
            .store(u32::from(o.sport), Ordering::Relaxed);
        self.u32(O_DNODE).store(o.dnode, Ordering::Relaxed);
        self.u32(O_SNODE).store(o.snode, Ordering::Relaxed);
        // Both consumers start out waiting: the first bytes of either direction wake the
        // consumer even if it never read (a program that selects before its first read).
        // Invariant: rx_wait == 0 only while a wake-up byte is queued for the consumer.
        for ctl in [O_C2S, O_S2C] {
            self.u32(ctl + D_RX_WAIT).store(1, Ordering::Relaxed);
        }
        self.u32(O_STATE).store(OFFERED, Ordering::Relaxed);
        self.u64(O_MAGIC).store(MAGIC, Ordering::Release);
    }

    /// Checks an offer made by another process for the connection (`dport`, `sport`,
    /// `dnode`, `snode`) and returns the client's (pid, wake fd, wake inode).
    pub fn validate(
        &mut self,
        dport: u16,
        sport: u16,
        dnode: u32,
        snode: u32,
    ) -> Result<(u32, i32, u64), Invalid> {
        if self.len < HDR {
            return Err(Invalid::Size);
        }
        if self.u64(O_MAGIC).load(Ordering::Acquire) != MAGIC
            || self.u32(O_VERSION).load(Ordering::Relaxed) != VERSION
        {
            return Err(Invalid::Magic);
        }
        let ring = self.u32(O_RING).load(Ordering::Relaxed) as usize;
        if !ring.is_power_of_two() || !(MIN_RING..=MAX_RING).contains(&ring) {
            return Err(Invalid::Ring);
        }
        if self.len < seg_len(ring) {
            return Err(Invalid::Size);
        }
        if self.u32(O_STATE).load(Ordering::Acquire) != OFFERED {
            return Err(Invalid::State);
        }
        if self.u32(O_DPORT).load(Ordering::Relaxed) != u32::from(dport)
            || self.u32(O_SPORT).load(Ordering::Relaxed) != u32::from(sport)
            || self.u32(O_DNODE).load(Ordering::Relaxed) != dnode
            || self.u32(O_SNODE).load(Ordering::Relaxed) != snode
        {
            return Err(Invalid::Endpoints);
        }
        self.ring = ring;
        Ok((
            self.u32(O_CPID).load(Ordering::Relaxed),
            self.u32(O_CWAKE).load(Ordering::Relaxed) as i32,
            self.u64(O_CINO).load(Ordering::Relaxed),
        ))
    }

    /// The server claims the offer: its pid and wake descriptor, then CLAIMED. False if the
    /// state was no longer OFFERED.
    pub fn claim(&self, pid: u32, wake_fd: i32, wake_ino: u64) -> bool {
        self.u32(O_SPID).store(pid, Ordering::Relaxed);
        self.u32(O_SWAKE).store(wake_fd as u32, Ordering::Relaxed);
        self.u64(O_SINO).store(wake_ino, Ordering::Relaxed);
        self.u32(O_STATE)
            .compare_exchange(OFFERED, CLAIMED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The server's (pid, wake fd, wake inode) once it claimed the offer.
    pub fn claimed(&self) -> Option<(u32, i32, u64)> {
        (self.u32(O_STATE).load(Ordering::Acquire) == CLAIMED).then(|| {
            (
                self.u32(O_SPID).load(Ordering::Relaxed),
                self.u32(O_SWAKE).load(Ordering::Relaxed) as i32,
                self.u64(O_SINO).load(Ordering::Relaxed),
            )
        })
    }

    /// A process that holds `role`'s end (after a fork: the child, which often outlives its
    /// parent's copy) names itself as the one the peer takes the wake-up socket from.
    pub fn set_holder(&self, role: Role, pid: u32) {
        self.u32(if role == Role::Client { O_CPID } else { O_SPID })
            .store(pid, Ordering::Release);
    }

    /// The peer's (pid, wake fd, wake inode) as `role` sees it, once the offer is claimed.
    pub fn peer(&self, role: Role) -> Option<(u32, i32, u64)> {
        match role {
            Role::Client => self.claimed(),
            Role::Server => (self.u32(O_STATE).load(Ordering::Acquire) == CLAIMED).then(|| {
                (
                    self.u32(O_CPID).load(Ordering::Relaxed),
                    self.u32(O_CWAKE).load(Ordering::Relaxed) as i32,
                    self.u64(O_CINO).load(Ordering::Relaxed),
                )
            }),
        }
    }

    /// Ring bytes per direction.
    pub fn ring(&self) -> usize {
        self.ring
    }

    /// The direction `role` sends on (`tx`) or receives on.
    pub fn dir(&self, role: Role, tx: bool) -> Dir<'_> {
        let c2s = (role == Role::Client) == tx;
        let ctl = if c2s { O_C2S } else { O_S2C };
        let data = if c2s { HDR } else { HDR + self.ring };
        Dir {
            seg: self,
            ctl,
            data,
        }
    }

    /// Unmaps the segment.
    ///
    /// # Safety
    /// No `Dir` of it and no pointer into it may be used afterwards.
    pub unsafe fn unmap(&mut self) {
        if !self.base.is_null() {
            let _ = crate::sys::munmap(self.base, self.len);
            self.base = std::ptr::null_mut();
        }
    }
}

/// A position read from the peer that cannot be right.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt;

/// One direction of a segment.
#[derive(Debug, Clone, Copy)]
pub struct Dir<'a> {
    seg: &'a Seg,
    ctl: usize,
    data: usize,
}

impl Dir<'_> {
    fn w32(&self, off: usize) -> &AtomicU32 {
        self.seg.u32(self.ctl + off)
    }
    fn w64(&self, off: usize) -> &AtomicU64 {
        self.seg.u64(self.ctl + off)
    }

    /// Consumer: bytes readable after local head `head` (tail read from the peer, checked).
    pub fn readable(&self, head: u64) -> Result<usize, Corrupt> {
        let tail = self.w64(D_TAIL).load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used > self.seg.ring as u64 {
            return Err(Corrupt);
        }
        Ok(used as usize)
    }

    /// Producer: bytes free after local tail `tail` (head read from the peer, checked).
    pub fn free(&self, tail: u64) -> Result<usize, Corrupt> {
        let head = self.w64(D_HEAD).load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used > self.seg.ring as u64 {
            return Err(Corrupt);
        }
        Ok(self.seg.ring - used as usize)
    }

    /// Copies `n` readable bytes at `head` to `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for `n` bytes of writes; `n` at most what `readable` returned.
    pub unsafe fn copy_out(&self, head: u64, dst: *mut u8, n: usize) {
        let size = self.seg.ring;
        let idx = (head as usize) & (size - 1);
        let first = n.min(size - idx);
        // SAFETY: idx + first <= size and the rest wraps to the ring's start, all inside this
        // direction's data area (checked at mapping); dst is valid for n bytes (caller).
        unsafe {
            let base = self.seg.base.add(self.data);
            std::ptr::copy_nonoverlapping(base.add(idx), dst, first);
            std::ptr::copy_nonoverlapping(base, dst.add(first), n - first);
        }
    }

    /// Copies `n` bytes from `src` into free space at `tail`.
    ///
    /// # Safety
    /// `src` must be valid for `n` bytes of reads; `n` at most what `free` returned.
    pub unsafe fn copy_in(&self, tail: u64, src: *const u8, n: usize) {
        let size = self.seg.ring;
        let idx = (tail as usize) & (size - 1);
        let first = n.min(size - idx);
        // SAFETY: as in `copy_out`, the other way.
        unsafe {
            let base = self.seg.base.add(self.data);
            std::ptr::copy_nonoverlapping(src, base.add(idx), first);
            std::ptr::copy_nonoverlapping(src.add(first), base, n - first);
        }
    }

    /// The contiguous ring bytes at position `pos`, at most `n`: (pointer, length).
    pub fn piece(&self, pos: u64, n: usize) -> (*const u8, usize) {
        let size = self.seg.ring;
        let idx = (pos as usize) & (size - 1);
        // SAFETY: idx < size: inside this direction's data area (checked at mapping).
        (
            unsafe { self.seg.base.add(self.data + idx) },
            n.min(size - idx),
        )
    }

    /// Producer publishes its tail.
    pub fn publish(&self, tail: u64) {
        self.w64(D_TAIL).store(tail, Ordering::SeqCst);
    }
    /// Consumer publishes its head.
    pub fn consume(&self, head: u64) {
        self.w64(D_HEAD).store(head, Ordering::SeqCst);
    }

    /// The consumer's wake-up state (see [`RX_ARMED`]).
    pub fn rx_state(&self) -> u32 {
        self.w32(D_RX_WAIT).load(Ordering::SeqCst)
    }
    /// Sets the consumer's wake-up state, returning the previous one (consumer only).
    pub fn set_rx_state(&self, v: u32) -> u32 {
        self.w32(D_RX_WAIT).swap(v, Ordering::SeqCst)
    }
    /// Producer (or the helper): if the consumer is idle and wants a wake-up byte, take that
    /// duty (ARMED → POKED); true means the caller must send the byte.
    pub fn take_rx_wait(&self) -> bool {
        self.w32(D_RX_WAIT).load(Ordering::SeqCst) == RX_ARMED
            && self
                .w32(D_RX_WAIT)
                .compare_exchange(RX_ARMED, RX_POKED, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
    }
    /// Whoever sleeps on the consumer's descriptor: takes its owed wake-up byte (OWED →
    /// POKED); true means the caller must send it.
    pub fn pay_rx_debt(&self) -> bool {
        let w = self.w32(D_RX_WAIT);
        w.load(Ordering::SeqCst) == RX_OWED
            && w.compare_exchange(RX_OWED, RX_POKED, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
    }
    /// Consumer's spinner: ARMED → SPIN, or SPIN already (another thread spins too, or one
    /// left the spin without ending it — a signal handler that jumped out: the state must not
    /// stay SPIN with nobody to end it); false if the state was another.
    pub fn begin_rx_spin(&self) -> bool {
        let w = self.w32(D_RX_WAIT);
        w.load(Ordering::SeqCst) == RX_SPIN
            || w.compare_exchange(RX_ARMED, RX_SPIN, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
    }
    /// Consumer's spinner: SPIN → `to` (POKED: the spinner queues the byte; ARMED: nothing
    /// seen); false if a reader took over meanwhile.
    pub fn end_rx_spin(&self, to: u32) -> bool {
        self.w32(D_RX_WAIT)
            .compare_exchange(RX_SPIN, to, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }
    /// Undoes [`Dir::take_rx_wait`] (POKED → ARMED) if the consumer did not see it meanwhile;
    /// false means it did and waits for the byte.
    pub fn untake_rx_wait(&self) -> bool {
        self.w32(D_RX_WAIT)
            .compare_exchange(RX_POKED, RX_ARMED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }
    /// Producer: wake me when room frees up.
    pub fn arm_tx(&self) {
        self.w32(D_TX_WAIT).store(1, Ordering::SeqCst);
    }
    /// Takes the producer's wake-up request.
    pub fn take_tx_wait(&self) -> bool {
        self.w32(D_TX_WAIT).load(Ordering::SeqCst) != 0
            && self.w32(D_TX_WAIT).swap(0, Ordering::SeqCst) != 0
    }

    /// Producer switches to the ring after `prefix` bytes on TCP.
    pub fn switch(&self, prefix: u64) {
        self.w64(D_PREFIX).store(prefix, Ordering::Relaxed);
        self.w32(D_SWITCHED).store(1, Ordering::SeqCst);
    }
    /// Consumer: `Some(prefix)` once the producer switched.
    pub fn switched(&self) -> Option<u64> {
        (self.w32(D_SWITCHED).load(Ordering::Acquire) != 0)
            .then(|| self.w64(D_PREFIX).load(Ordering::Relaxed))
    }
    /// Producer: no more bytes.
    pub fn set_fin(&self) {
        self.w32(D_FIN).store(1, Ordering::SeqCst);
    }
    /// Consumer: the producer said no more bytes.
    pub fn fin(&self) -> bool {
        self.w32(D_FIN).load(Ordering::Acquire) != 0
    }
    /// Producer shut its side down on the kernel's TCP (before it switched): the TCP
    /// connection's end-of-file then means a half-close, not a peer gone.
    pub fn set_tcp_fin(&self) {
        self.w32(D_TCP_FIN).store(1, Ordering::SeqCst);
    }
    /// See [`Dir::set_tcp_fin`].
    pub fn tcp_fin(&self) -> bool {
        self.w32(D_TCP_FIN).load(Ordering::Acquire) != 0
    }
    /// Consumer: the process of our end that last read, and our head and TCP count as it left
    /// them (our own words, but in shared memory: the caller validates them).
    pub fn rx_owner(&self) -> u32 {
        self.w32(D_RX_OWNER).load(Ordering::Acquire)
    }
    /// Consumer: takes over reading; returns (head, bytes read from TCP) to start from.
    pub fn take_rx(&self, pid: u32) -> (u64, u64) {
        self.w32(D_RX_OWNER).store(pid, Ordering::SeqCst);
        (
            self.w64(D_HEAD).load(Ordering::Acquire),
            self.w64(D_RX_TCP).load(Ordering::Acquire),
        )
    }
    /// Consumer: bytes of the prefix read so far (sequentially consistent: a producer that
    /// published bytes and then sees the prefix unread leaves the wake-up to the prefix, see
    /// [`Dir::prefix_unread`]).
    pub fn set_rx_tcp(&self, n: u64) {
        self.w64(D_RX_TCP).store(n, Ordering::SeqCst);
    }
    /// Producer: the consumer has not read all of our prefix from TCP yet, so it cannot read
    /// the ring's bytes behind it. A wake-up byte now would make its descriptor readable with
    /// nothing a read can take (the prefix can lag on a loaded machine: qperf's server got
    /// EAGAIN after `select`). Its wake-up comes with the prefix (the helper thread sees TCP
    /// readable), and the read that takes the prefix goes on to the ring.
    pub fn prefix_unread(&self) -> bool {
        self.switched()
            .is_some_and(|p| self.w64(D_RX_TCP).load(Ordering::SeqCst) != p)
    }
    /// The direction is on the ring: the producer switched, and nobody is going back.
    pub fn on_ring(&self) -> bool {
        self.switched().is_some() && self.back().is_none() && !self.back_requested()
    }
    /// Consumer: true when every byte still to come is on the ring: [`Dir::on_ring`], and our
    /// end has read the producer's whole prefix from TCP. Bytes on TCP then mean nothing to a
    /// reader (its end is seen by the helper thread).
    pub fn on_ring_for_good(&self) -> bool {
        self.on_ring() && !self.prefix_unread()
    }
    /// Producer: see [`Dir::rx_owner`].
    pub fn tx_owner(&self) -> u32 {
        self.w32(D_TX_OWNER).load(Ordering::Acquire)
    }
    /// Producer: takes over writing; returns (tail, bytes written to TCP) to start from.
    pub fn take_tx(&self, pid: u32) -> (u64, u64) {
        self.w32(D_TX_OWNER).store(pid, Ordering::SeqCst);
        (
            self.w64(D_TAIL).load(Ordering::Acquire),
            self.w64(D_TX_TCP).load(Ordering::Acquire),
        )
    }
    /// Producer: bytes written to TCP so far (before the switch).
    pub fn set_tx_tcp(&self, n: u64) {
        self.w64(D_TX_TCP).store(n, Ordering::Release);
    }

    /// Consumer: `Some(at)` once the producer went back to TCP: ring bytes before ring
    /// position `at`, then TCP.
    pub fn back(&self) -> Option<u64> {
        (self.w32(D_BACK).load(Ordering::Acquire) != 0)
            .then(|| self.w64(D_BACK_AT).load(Ordering::Acquire))
    }
    /// Producer: from ring position `at` on, the bytes are on TCP.
    pub fn set_back(&self, at: u64) {
        self.w64(D_BACK_AT).store(at, Ordering::SeqCst);
        self.w32(D_BACK).store(1, Ordering::SeqCst);
    }
    /// Consumer: asks the producer to go back to TCP (sending again, on TCP, every byte of
    /// the ring the consumer has not consumed).
    pub fn request_back(&self) {
        self.w32(D_BACK_REQ).store(1, Ordering::SeqCst);
    }
    /// Producer: the consumer asked to go back.
    pub fn back_requested(&self) -> bool {
        self.w32(D_BACK_REQ).load(Ordering::Acquire) != 0
    }
    /// Consumer: the urgent byte the producer sent on TCP with its request to go back (see
    /// `Conn::hand_back`) is taken: any urgent byte after it is the program's.
    pub fn set_urgent_taken(&self) {
        self.w32(D_URG_TAKEN).store(1, Ordering::SeqCst);
    }
    /// See [`Dir::set_urgent_taken`].
    pub fn urgent_taken(&self) -> bool {
        self.w32(D_URG_TAKEN).load(Ordering::Acquire) != 0
    }
    /// Producer: takes the duty of going back (one process of the end does it).
    pub fn claim_back(&self) -> bool {
        self.w32(D_BACK_CLAIM)
            .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }
    /// Producer: the consumer's head (read to send again what it has not consumed).
    pub fn peer_head(&self) -> u64 {
        self.w64(D_HEAD).load(Ordering::Acquire)
    }

    /// Takes our end's lock of this direction for process `me` (`tx`: the producer's, else the
    /// consumer's). Blocking (`wait`), it sleeps until the holder releases it, dies, or
    /// `give_up()` says the connection is over; otherwise it spins briefly. False: not taken.
    /// A lock word is our end's, but in shared memory: a holder that names no live process
    /// (a process that died in a call, or garbage) is taken over.
    pub fn lock(&self, tx: bool, me: u32, wait: bool, mut give_up: impl FnMut() -> bool) -> bool {
        let w = self.w32(if tx { D_TX_LOCK } else { D_RX_LOCK });
        let start = crate::conn::now_ns();
        loop {
            let cur = w.load(Ordering::Acquire);
            let holder = cur & !LOCK_WAITERS;
            if holder == 0 || holder == me || !crate::sys::alive(holder) {
                // Free, left by this process (a call that unwound), or its holder is gone.
                if w.compare_exchange(cur, me, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    if cur & LOCK_WAITERS != 0 {
                        // Others may sleep on the word we just cleared of their flag.
                        crate::sys::futex_wake_all(w);
                    }
                    return true;
                }
                continue;
            }
            if !wait {
                if crate::conn::now_ns().saturating_sub(start) > 20_000 {
                    return false;
                }
                std::hint::spin_loop();
                continue;
            }
            if give_up() {
                return false;
            }
            if cur & LOCK_WAITERS == 0
                && w.compare_exchange(cur, cur | LOCK_WAITERS, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
            {
                continue;
            }
            let _ = crate::sys::futex_wait(w, cur | LOCK_WAITERS, LOCK_CHECK_NS);
        }
    }

    /// Releases what [`Dir::lock`] took (nothing if another process took it over meanwhile).
    pub fn unlock(&self, tx: bool, me: u32) {
        let w = self.w32(if tx { D_TX_LOCK } else { D_RX_LOCK });
        loop {
            let cur = w.load(Ordering::Acquire);
            if cur & !LOCK_WAITERS != me {
                return;
            }
            if w.compare_exchange(cur, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                if cur & LOCK_WAITERS != 0 {
                    crate::sys::futex_wake_all(w);
                }
                return;
            }
        }
    }

    /// Bytes the producer published that the consumer has not consumed (both words read
    /// from shared memory; only a hint).
    pub fn pending(&self) -> u64 {
        let tail = self.w64(D_TAIL).load(Ordering::Acquire);
        let head = self.w64(D_HEAD).load(Ordering::Acquire);
        tail.wrapping_sub(head).min(self.seg.ring as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anon(len: usize) -> Seg {
        // SAFETY: an anonymous private mapping of len bytes, never unmapped in the test.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: just mapped, len bytes, page-aligned.
        unsafe { Seg::from_raw(p as *mut u8, len) }
    }

    fn offer() -> Offer {
        Offer {
            ring: 4096,
            cookie: 7,
            pid: 10,
            wake_fd: 5,
            wake_ino: 99,
            dport: 80,
            sport: 40000,
            dnode: 2,
            snode: 1,
        }
    }

    #[test]
    fn offer_claim_and_validation() {
        let mut s = anon(seg_len(4096));
        s.init(&offer());
        assert_eq!(s.validate(80, 40000, 2, 1), Ok((10, 5, 99)));
        assert_eq!(s.validate(81, 40000, 2, 1), Err(Invalid::Endpoints));
        assert_eq!(s.claimed(), None);
        assert!(s.claim(20, 6, 100));
        assert_eq!(s.claimed(), Some((20, 6, 100)));
        assert!(!s.claim(21, 6, 100), "claimed twice");
        assert_eq!(s.validate(80, 40000, 2, 1), Err(Invalid::State));
        // A peer that declares a ring larger than the file.
        s.u32(O_RING).store(8192, Ordering::Relaxed);
        s.u32(O_STATE).store(OFFERED, Ordering::Relaxed);
        assert_eq!(s.validate(80, 40000, 2, 1), Err(Invalid::Size));
        s.u32(O_RING).store(5000, Ordering::Relaxed);
        assert_eq!(s.validate(80, 40000, 2, 1), Err(Invalid::Ring));
        s.u64(O_MAGIC).store(1, Ordering::Relaxed);
        assert_eq!(s.validate(80, 40000, 2, 1), Err(Invalid::Magic));
    }

    #[test]
    fn ring_wraps_and_checks_positions() {
        let mut s = anon(seg_len(4096));
        s.init(&offer());
        let tx = s.dir(Role::Client, true);
        let rx = s.dir(Role::Server, false);
        let (mut tail, mut head) = (4000u64, 4000u64);
        tx.publish(tail);
        rx.consume(head);
        let data: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        assert_eq!(tx.free(tail), Ok(4096));
        // SAFETY: data is 3000 bytes, the ring has 4096 free.
        unsafe { tx.copy_in(tail, data.as_ptr(), 3000) };
        tail += 3000;
        tx.publish(tail);
        assert_eq!(rx.readable(head), Ok(3000));
        let mut out = vec![0u8; 3000];
        // SAFETY: out is 3000 bytes, 3000 readable.
        unsafe { rx.copy_out(head, out.as_mut_ptr(), 3000) };
        head += 3000;
        rx.consume(head);
        assert_eq!(out, data);
        assert_eq!(tx.free(tail), Ok(4096));
        // A peer tail beyond one ring of the consumer's head is corruption.
        tx.publish(head + 4097);
        assert_eq!(rx.readable(head), Err(Corrupt));
        tx.publish(head.wrapping_sub(1));
        assert_eq!(rx.readable(head), Err(Corrupt));
        rx.consume(tail + 1);
        assert_eq!(tx.free(tail), Err(Corrupt));
    }

    #[test]
    fn wake_requests_are_taken_once() {
        let mut s = anon(seg_len(4096));
        s.init(&offer());
        let d = s.dir(Role::Client, true);
        assert_eq!(d.rx_state(), RX_ARMED, "a consumer starts idle");
        assert!(d.take_rx_wait());
        assert!(!d.take_rx_wait(), "taken once");
        assert!(d.untake_rx_wait(), "undone while the consumer did not look");
        assert!(d.begin_rx_spin());
        assert!(d.begin_rx_spin(), "a second spinner shares the state");
        assert!(!d.take_rx_wait(), "a spinning consumer needs no byte");
        assert!(d.end_rx_spin(RX_ARMED));
        assert!(!d.end_rx_spin(RX_POKED), "ended once");
        assert!(d.take_rx_wait());
        assert_eq!(d.set_rx_state(RX_ACTIVE), RX_POKED);
        assert!(!d.take_rx_wait(), "an active consumer needs no byte");
        d.set_rx_state(RX_ARMED);
        assert!(d.take_rx_wait());
        d.arm_tx();
        assert!(d.take_tx_wait());
        assert_eq!(d.switched(), None);
        assert!(!d.prefix_unread(), "no prefix before a switch");
        d.switch(37);
        assert_eq!(d.switched(), Some(37));
        assert!(d.prefix_unread(), "37 bytes on TCP still to read");
        d.set_rx_tcp(36);
        assert!(d.prefix_unread());
        d.set_rx_tcp(37);
        assert!(!d.prefix_unread(), "the reader reached the ring");
        assert!(!d.fin());
        d.set_fin();
        assert!(d.fin());
    }

    #[test]
    fn going_back_and_taking_over_read_the_segment() {
        let mut s = anon(seg_len(4096));
        s.init(&offer());
        let d = s.dir(Role::Server, true);
        assert_eq!(d.back(), None);
        assert!(!d.back_requested());
        d.request_back();
        assert!(d.back_requested());
        assert!(d.claim_back(), "one process of the end takes it");
        assert!(!d.claim_back(), "and only one");
        d.set_back(1234);
        assert_eq!(d.back(), Some(1234));
        // A process that takes over starts from the words in the segment.
        d.publish(777);
        d.set_tx_tcp(5);
        assert_eq!(d.take_tx(42), (777, 5));
        assert_eq!(d.tx_owner(), 42);
        let r = s.dir(Role::Client, false);
        r.consume(700);
        r.set_rx_tcp(5);
        assert_eq!(r.take_rx(43), (700, 5));
        assert_eq!(r.rx_owner(), 43);
        // The ring's contiguous piece at a position near its end.
        let (_, len) = r.piece(4000, 500);
        assert_eq!(len, 96);
    }

    #[test]
    fn an_ends_lock_is_taken_once_and_over_from_a_dead_holder() {
        let mut s = anon(seg_len(4096));
        s.init(&offer());
        let d = s.dir(Role::Client, true);
        let me = crate::sys::getpid();
        let dead = 0x7fff_fff0; // above any pid_max: no such process
        assert!(!crate::sys::alive(dead));
        assert!(d.lock(true, dead, false, || false), "free: taken");
        assert!(
            d.lock(true, me, false, || false),
            "its holder is dead: taken over"
        );
        // pid 1 is alive: it waits, or gives up when told to.
        assert!(
            !d.lock(true, 1, false, || false),
            "held: not taken without waiting"
        );
        assert!(
            !d.lock(true, 1, true, || true),
            "held: waiting gives up when told"
        );
        // The consumer's lock is another word.
        assert!(d.lock(false, 1, false, || false));
        d.unlock(true, 1);
        assert!(
            !d.lock(true, 1, false, || false),
            "only the holder releases"
        );
        d.unlock(true, me);
        assert!(d.lock(true, 1, false, || false), "released: taken");
        // A waiter in another thread gets it when the holder releases.
        // SAFETY: the test's mapping is never unmapped.
        let s2 = unsafe { s.alias() };
        let t =
            std::thread::spawn(move || s2.dir(Role::Client, true).lock(true, me, true, || false));
        std::thread::sleep(std::time::Duration::from_millis(50));
        d.unlock(true, 1);
        assert!(t.join().unwrap(), "the waiter took it");
    }
}
