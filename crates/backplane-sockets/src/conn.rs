//! One accelerated connection: the byte stream over the segment's rings, the kernel's TCP
//! socket kept beside it, and the wake-up socket pair that gives the program's descriptor its
//! readiness.
//!
//! The program's descriptor is one end (`A`) of a Unix socket pair; we keep the other end
//! (`B`), and the peer process holds a duplicate of our `B` (taken with `pidfd_getfd`). So:
//!
//! - *readable*: a byte queued on `A`. A consumer that finds its ring empty drains `A`, sets
//!   its direction's `rx_wait` word, and looks again; a producer that publishes bytes and
//!   takes `rx_wait` sends one byte into the consumer's `B`. Blocking reads sleep in `recv` on
//!   `A` (so `SA_RESTART`, `EINTR` and `SO_RCVTIMEO` behave as the kernel's).
//! - *writable*: `A`'s own send buffer has room. A producer that finds its ring full fills
//!   `A`'s (tiny) send buffer, sets `tx_wait` and looks again; a consumer that frees room and
//!   takes `tx_wait` drains the producer's `B`, which makes `A` writable again.
//!
//! `poll`, `select` and `epoll` therefore need no help: the kernel sees the readiness of a real
//! socket. The TCP socket carries the first bytes of each direction until its producer sees
//! the agreement complete (the *prefix*, whose length the producer publishes when it switches
//! to the ring) and tells, by its end-of-file, that every process of the peer has closed or
//! died: with the peer's `fin` set that is a clean end, without it a reset.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::sync::Mutex;

use libc::c_int;

use crate::config::{self, stats};
use crate::seg::{Corrupt, Dir, Role, Seg, RX_ACTIVE, RX_ARMED, RX_OWED, RX_POKED};
use crate::sys::{self, Res};

/// Everything needed to build a connection once the agreement's resources exist.
pub struct Parts {
    /// The mapped segment.
    pub seg: Seg,
    /// Our end.
    pub role: Role,
    /// The kernel's TCP socket (hidden descriptor).
    pub tcp: c_int,
    /// Our hidden duplicate of `A` (the program's descriptor).
    pub a: c_int,
    /// `B` (hidden).
    pub b: c_int,
    /// The peer's `B`, if already fetched.
    pub peer_wake: Option<c_int>,
    /// The offer file to remove if the connection ends unclaimed (client).
    pub offer_path: Option<Vec<u8>>,
    /// `O_NONBLOCK` of the program's descriptor.
    pub nonblock: bool,
    /// The peer's node (slot).
    pub peer_node: u32,
    /// Our side already shut down its sending direction (a connection inherited across exec).
    pub tx_shut: bool,
    /// For log lines.
    pub label: String,
}

struct RxState {
    /// The process these positions are right for (0: none yet); another process of our end
    /// (after a fork or an exec) may have moved them since.
    pid: u32,
    head: u64,
    tcp_in: u64,
    /// Bytes received not yet added to the node's counters.
    unflushed: u64,
}

struct TxState {
    /// See `RxState::pid`.
    pid: u32,
    tail: u64,
    tcp_out: u64,
    switched: bool,
    /// Bytes sent not yet added to the node's counters.
    unflushed: u64,
}

/// Counters are shared by every process of a node: add to them in batches.
const FLUSH_BYTES: u64 = 64 << 20;

/// The most bytes copied into or out of a ring before the position is published: large
/// calls are pipelined (the reader copies out the first piece while the writer copies in the
/// next) instead of one side waiting for the other's whole copy.
const PIECE: usize = 64 << 10;

/// The longest a reader waits for a wake-up byte a live producer announced (POKED) but has
/// not sent yet, see [`Conn::clear_token`].
const TOKEN_WAIT_NS: u64 = 5_000_000_000;

fn add_bytes(unflushed: &mut u64, n: usize, idx: usize) {
    *unflushed += n as u64;
    if *unflushed >= FLUSH_BYTES {
        config::count(idx, std::mem::take(unflushed));
    }
}

/// A live or ended connection. Never freed (a descriptor table slot or another thread may
/// still point at it); ending it releases its memory mapping and descriptors.
pub struct Conn {
    seg: Mutex<Option<Seg>>,
    seg_fast: Seg,
    role: Role,
    tcp: c_int,
    a: c_int,
    b: c_int,
    peer_wake: AtomicI32,
    offer_path: Mutex<Option<Vec<u8>>>,
    rx: Mutex<RxState>,
    tx: Mutex<TxState>,
    /// `O_NONBLOCK` of the program's descriptor, kept in step by `fcntl`/`ioctl`.
    pub nonblock: AtomicBool,
    /// Program descriptors (in this process) that name the connection.
    pub refs: AtomicU32,
    ended: AtomicBool,
    /// The helper thread is using the descriptors; `end` waits for it.
    pub helper_busy: AtomicBool,
    /// Threads looking at the rings without a lock (`ready`); `end` waits for them.
    peekers: AtomicU32,
    /// Threads of this process asleep on `A` in `recv`/`send`: `end` wakes them — and only
    /// then, since `A` and `B` are shared with a fork's other side, where a byte it did not
    /// ask for would make the descriptor readable with nothing to read.
    sleepers: AtomicU32,
    rx_shut: AtomicBool,
    tx_shut: AtomicBool,
    /// The TCP connection reached end-of-file: every peer process closed or died.
    pub peer_eof: AtomicBool,
    /// A write to the kernel's socket found it full (before the switch); the helper drains
    /// `B` when it becomes writable.
    pub tcp_tx_blocked: AtomicBool,
    corrupt: AtomicBool,
    /// Our node's and the peer's (slot, node word) when the connection was made.
    nodes: [(u32, Option<u64>); 2],
    /// A node of the connection went DOWN or restarted: reset.
    reset: AtomicBool,
    /// A fork happened while the connection existed: other processes of our end may use it at
    /// the same instant, so each call also holds our end's lock of the direction in the segment.
    pub shared: AtomicBool,
    label: String,
}

/// Our end's lock of one direction in the segment, held for one call (see [`Conn::shared`]).
struct EndLock<'a> {
    d: Dir<'a>,
    tx: bool,
    me: u32,
}

impl Drop for EndLock<'_> {
    fn drop(&mut self) {
        self.d.unlock(self.tx, self.me);
    }
}

/// What taking our end's lock gave.
enum Locked<'a> {
    /// Held (or not needed: no other process has the connection).
    Yes(Option<EndLock<'a>>),
    /// Another process holds it and the call must not wait.
    Busy,
    /// The connection ended or was reset while we waited.
    Over,
}

const PEER_UNKNOWN: i32 = -1;
const PEER_FAILED: i32 = -2;

fn epipe(nosignal: bool) -> Res {
    if !nosignal {
        sys::raise_here(libc::SIGPIPE);
    }
    Err(libc::EPIPE)
}

/// A list of caller buffers, read or written in order.
pub struct Bufs<'a> {
    iov: &'a [libc::iovec],
}

impl<'a> Bufs<'a> {
    /// Wraps the caller's iovecs.
    ///
    /// # Safety
    /// Every iovec must describe memory valid for its length (for reads or writes as used).
    pub unsafe fn new(iov: &'a [libc::iovec]) -> Self {
        Bufs { iov }
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.iov
            .iter()
            .fold(0usize, |a, v| a.saturating_add(v.iov_len))
    }

    /// True when there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The contiguous piece starting at byte `at`: (pointer, length).
    fn piece(&self, mut at: usize) -> (*mut u8, usize) {
        for v in self.iov {
            if at < v.iov_len {
                // SAFETY: at < iov_len: inside the caller's buffer.
                return (unsafe { (v.iov_base as *mut u8).add(at) }, v.iov_len - at);
            }
            at -= v.iov_len;
        }
        (std::ptr::null_mut(), 0)
    }

    /// Calls `f(ptr, len, offset_in_stream)` for bytes `at..at+n`, piece by piece.
    fn each(&self, at: usize, n: usize, mut f: impl FnMut(*mut u8, usize, usize)) {
        let mut done = 0;
        while done < n {
            let (p, len) = self.piece(at + done);
            if len == 0 {
                break;
            }
            let k = len.min(n - done);
            f(p, k, done);
            done += k;
        }
    }
}

impl Conn {
    /// Builds a connection (leaked: see the type's comment).
    pub fn new(p: Parts) -> &'static Conn {
        // SAFETY: a second handle on the same mapping, used only while `seg` is Some (every
        // use holds `rx` or `tx`, which `end` takes before unmapping).
        let fast = unsafe { p.seg.alias() };
        config::count(stats::CONNS, 1);
        config::count(stats::OPEN, 1);
        Box::leak(Box::new(Conn {
            seg: Mutex::new(Some(p.seg)),
            seg_fast: fast,
            role: p.role,
            tcp: p.tcp,
            a: p.a,
            b: p.b,
            peer_wake: AtomicI32::new(p.peer_wake.unwrap_or(PEER_UNKNOWN)),
            offer_path: Mutex::new(p.offer_path),
            rx: Mutex::new(RxState {
                pid: 0,
                head: 0,
                tcp_in: 0,
                unflushed: 0,
            }),
            tx: Mutex::new(TxState {
                pid: 0,
                tail: 0,
                tcp_out: 0,
                switched: false,
                unflushed: 0,
            }),
            nonblock: AtomicBool::new(p.nonblock),
            refs: AtomicU32::new(1),
            ended: AtomicBool::new(false),
            helper_busy: AtomicBool::new(false),
            peekers: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
            rx_shut: AtomicBool::new(false),
            tx_shut: AtomicBool::new(p.tx_shut),
            peer_eof: AtomicBool::new(false),
            tcp_tx_blocked: AtomicBool::new(false),
            corrupt: AtomicBool::new(false),
            nodes: {
                let own = config::get().map_or(0, |c| c.node);
                [
                    (own, config::node_word(own)),
                    (p.peer_node, config::node_word(p.peer_node)),
                ]
            },
            reset: AtomicBool::new(false),
            shared: AtomicBool::new(false),
            label: p.label,
        }))
    }

    /// Takes our end's lock of direction `d` when other processes may use the connection
    /// (after a fork): one call at a time per direction across processes, as the in-process
    /// mutex does across threads.
    fn end_lock<'a>(&self, d: Dir<'a>, tx: bool, wait: bool) -> Locked<'a> {
        if !self.shared.load(Ordering::Relaxed) {
            return Locked::Yes(None);
        }
        let me = crate::my_pid();
        let over = || self.ended() || self.reset.load(Ordering::Acquire);
        if d.lock(tx, me, wait, over) {
            Locked::Yes(Some(EndLock { d, tx, me }))
        } else if over() {
            Locked::Over
        } else {
            Locked::Busy
        }
    }

    /// The kernel's TCP socket: `getsockopt`, `getsockname` … go there.
    pub fn tcp(&self) -> c_int {
        self.tcp
    }
    /// Our end of the wake-up pair (the helper pokes it).
    pub fn b(&self) -> c_int {
        self.b
    }
    /// True once the connection ended in this process.
    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    fn corrupt(&self, got: usize) -> Res {
        if !self.corrupt.swap(true, Ordering::AcqRel) {
            config::count(stats::CORRUPT, 1);
            config::log(format_args!(
                "{}: ring memory corrupt, connection reset",
                self.label
            ));
        }
        if got > 0 {
            Ok(got)
        } else {
            Err(libc::ECONNRESET)
        }
    }

    /// The peer's wake-up socket, fetched from the peer process the first time.
    fn peer_wake(&self) -> Option<c_int> {
        let w = self.peer_wake.load(Ordering::Acquire);
        if w >= 0 {
            return Some(w);
        }
        if w == PEER_FAILED {
            return None;
        }
        let (pid, fd, ino) = self.seg_fast.peer(self.role)?;
        let got = crate::setup::fetch_fd(pid, fd, ino);
        match got {
            Some(fd) => {
                if self
                    .peer_wake
                    .compare_exchange(PEER_UNKNOWN, fd, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    let _ = sys::close(fd);
                }
                let w = self.peer_wake.load(Ordering::Acquire);
                (w >= 0).then_some(w)
            }
            None => {
                self.peer_wake.store(PEER_FAILED, Ordering::Release);
                None
            }
        }
    }

    /// Sends the reader of direction `d` its wake-up byte if it asked for one. `data`: the
    /// wake is for bytes just published — if the reader took them meanwhile (it read them
    /// while looking at the ring itself, then asked for a byte for the next ones: its state
    /// says nothing about ours), the claim is undone instead, since a byte with nothing to
    /// read behind it would make its descriptor readable with nothing to read (the pingpoll
    /// test saw it in 1 run of 4).
    fn wake_reader(&self, d: &Dir<'_>, data: bool) {
        if d.prefix_unread() || !d.take_rx_wait() {
            return;
        }
        if data && d.pending() == 0 && d.untake_rx_wait() {
            return;
        }
        if let Some(w) = self.peer_wake() {
            sys::poke(w);
        }
    }

    fn wake_writer(&self, d: &Dir<'_>) {
        if d.take_tx_wait() {
            if let Some(w) = self.peer_wake() {
                sys::drain(w);
            }
        }
    }

    /// True when a read of the TCP socket would not block (bytes, its end, or an error).
    fn tcp_has_bytes(&self) -> bool {
        !matches!(sys::peek1(self.tcp), Err(libc::EAGAIN))
    }

    /// Removes the offer's file, once (after the switch, or at the end).
    fn drop_offer(&self) {
        if let Some(p) = self
            .offer_path
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = sys::unlink(&p);
        }
    }

    /// True when the TCP connection says the peer is gone (checked without blocking).
    fn tcp_eof(&self) -> bool {
        if self.peer_eof.load(Ordering::Acquire) {
            return true;
        }
        let r = sys::peek1(self.tcp);
        let eof = matches!(
            r,
            Ok(0) | Err(libc::ECONNRESET | libc::EPIPE | libc::ENOTCONN)
        );
        if eof {
            self.peer_eof.store(true, Ordering::Release);
        }
        eof
    }

    /// Every peer process closed or died (seen on the TCP connection), and not because the
    /// peer only shut down its side of the kernel's TCP.
    fn peer_gone(&self) -> bool {
        self.peer_eof.load(Ordering::Acquire) && !self.seg_fast.dir(self.role, false).tcp_fin()
    }

    fn spin_until(&self, ready: impl FnMut() -> bool) -> bool {
        spin(config::get().map_or(0, |c| c.spin_ns), ready)
    }

    /// Checked by the helper thread now and then: if our node or the peer's left READY or
    /// came back as another generation, the connection is reset (as the kernel's would be
    /// by a peer that lost its state), and every waiter wakes.
    pub fn check_nodes(&self) {
        if self.ended() || self.reset.load(Ordering::Acquire) {
            return;
        }
        let lost = self.nodes.iter().find(|&&(slot, then)| {
            then.is_some_and(|w| {
                config::node_word(slot).is_some_and(|now| now != w || !config::node_ready(now))
            })
        });
        if let Some(&(slot, _)) = lost {
            self.reset.store(true, Ordering::Release);
            config::log(format_args!(
                "{}: node {slot} went down or restarted: connection reset",
                self.label
            ));
            sys::poke(self.b);
            sys::drain(self.b);
        }
    }

    /// `recv`/`read`/`recvmsg` on the connection.
    pub fn recv(&self, bufs: &Bufs<'_>, flags: c_int) -> Res {
        if self.ended() {
            return Err(libc::EBADF);
        }
        crate::ensure_helper();
        if flags & libc::MSG_OOB != 0 {
            return self.recv_urgent(bufs, flags);
        }
        if flags & libc::MSG_ERRQUEUE != 0 {
            return Err(libc::EAGAIN);
        }
        let want = bufs.len();
        if want == 0 {
            return Ok(0);
        }
        let peek = flags & libc::MSG_PEEK != 0;
        let dontwait = flags & libc::MSG_DONTWAIT != 0 || self.nonblock.load(Ordering::Relaxed);
        let waitall = flags & libc::MSG_WAITALL != 0 && !peek && !dontwait;
        let mut st = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        if self.ended() {
            return Err(libc::EBADF);
        }
        let d = self.seg_fast.dir(self.role, false);
        let _end = match self.end_lock(d, false, !dontwait) {
            Locked::Yes(l) => l,
            Locked::Busy => return Err(libc::EAGAIN),
            Locked::Over if self.ended() => return Err(libc::EBADF),
            Locked::Over => return Err(libc::ECONNRESET),
        };
        sync_rx(&d, &mut st);
        // We look at the ring ourselves from here: nobody needs to send us wake-up bytes.
        // `token`: whether a wake-up byte is queued on A (None: not known).
        let mut token = Some(d.set_rx_state(RX_ACTIVE) == RX_POKED);
        let mut got = 0usize;
        let mut spun = false;
        let result = loop {
            if self.rx_shut.load(Ordering::Acquire) {
                break Ok(got);
            }
            let mut progressed = false;
            // Where the next byte is: on TCP until the peer switched and its prefix is read,
            // then on the ring (and on TCP again if the peer went back).
            let src = match self.source(&d, &st) {
                Ok(s) => s,
                Err(Corrupt) => break self.corrupt(got),
            };
            let ring_limit = match src {
                Src::Ring(l) => Some(l),
                _ => None,
            };
            if let Some(limit) = src.tcp_limit() {
                let (ptr, len) = bufs.piece(got);
                let n = len.min(limit);
                let fl = libc::MSG_DONTWAIT | if peek { libc::MSG_PEEK } else { 0 };
                match sys::recvfrom(
                    self.tcp,
                    ptr as *mut libc::c_void,
                    n,
                    fl,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                ) {
                    Ok(0) => match src {
                        Src::Prefix(_) => {
                            // The peer went away in the middle of its prefix.
                            break if got > 0 {
                                Ok(got)
                            } else {
                                Err(libc::ECONNRESET)
                            };
                        }
                        // It switched meanwhile: its bytes are on the ring.
                        Src::Unswitched if d.switched().is_some() => continue,
                        // The peer never switched, or went back, and closed: the kernel's
                        // own end-of-file.
                        _ => break Ok(got),
                    },
                    Ok(k) => {
                        if !peek && src != Src::Back {
                            // The prefix's bytes (after going back, TCP's count no longer
                            // matters).
                            st.tcp_in += k as u64;
                            d.set_rx_tcp(st.tcp_in);
                        }
                        got += k;
                        progressed = true;
                    }
                    Err(libc::EAGAIN) => {}
                    Err(e) => break if got > 0 { Ok(got) } else { Err(e) },
                }
            } else {
                match d.readable(st.head).map(|a| a.min(ring_limit.unwrap_or(0))) {
                    Err(Corrupt) => break self.corrupt(got),
                    Ok(0) => {}
                    Ok(avail) => {
                        let n = avail.min(want - got);
                        let (head, mut done) = (st.head, 0);
                        // Consumed piece by piece, so the writer refills behind us.
                        while done < n {
                            let k = (n - done).min(PIECE);
                            let at = got + done;
                            bufs.each(at, k, |p, len, off| {
                                // SAFETY: p is valid for len bytes (caller's buffer); the
                                // bytes at head + done + off.. are among the `avail` readable.
                                unsafe { d.copy_out(head + (done + off) as u64, p, len) }
                            });
                            done += k;
                            if !peek {
                                st.head = head + done as u64;
                                d.consume(st.head);
                                self.wake_writer(&d);
                            }
                        }
                        got += n;
                        progressed = true;
                    }
                }
                if !progressed && d.fin() && d.readable(st.head) == Ok(0) {
                    break Ok(got);
                }
            }
            if progressed {
                if peek || !waitall || got == want {
                    break Ok(got);
                }
                continue;
            }
            if got > 0 && !waitall {
                break Ok(got);
            }
            // Nothing here now.
            if self.reset.load(Ordering::Acquire) {
                break if got > 0 {
                    Ok(got)
                } else {
                    Err(libc::ECONNRESET)
                };
            }
            // (With the ring limited — we asked the peer to go back — a peer that is gone
            // will never send its bytes again on TCP: its end, not a wait.) Before a
            // non-blocking return or a spin, the helper's word is enough (it sees the end on
            // TCP and wakes us): no system call per empty read of a streaming reader.
            let cheap = ring_limit == Some(usize::MAX) && (dontwait || !spun);
            let eof = if cheap {
                self.peer_eof.load(Ordering::Acquire)
            } else {
                self.tcp_eof()
            };
            if let (Some(l), true) = (ring_limit, eof) {
                if d.readable(st.head).map(|a| a.min(l)) != Ok(0) {
                    continue;
                }
                if d.fin() && l == usize::MAX {
                    continue;
                }
                // Every peer process closed or died. Like the kernel: end-of-file, or a reset
                // if it left bytes of ours unread.
                let unread = self.seg_fast.dir(self.role, true).pending() > 0;
                break if got > 0 {
                    Ok(got)
                } else if unread {
                    Err(libc::ECONNRESET)
                } else {
                    Ok(0)
                };
            }
            if dontwait {
                break if got > 0 { Ok(got) } else { Err(libc::EAGAIN) };
            }
            if ring_limit == Some(usize::MAX) && !spun {
                spun = true;
                if self.spin_until(|| d.readable(st.head) != Ok(0) || d.fin()) {
                    continue;
                }
            }
            // Sleep: ask for a wake-up byte, look once more, then wait for it on A (a
            // blocking recv: SA_RESTART, EINTR and SO_RCVTIMEO as the kernel's).
            self.clear_token(token);
            d.set_rx_state(RX_ARMED);
            if self.has_data(&d, &st) {
                token = Some(d.set_rx_state(RX_ACTIVE) == RX_POKED);
                continue;
            }
            let r = self.asleep(|| sys::recv1(self.a, 0));
            // We took the byte whoever woke us sent; another may or may not be queued.
            d.set_rx_state(RX_ACTIVE);
            token = None;
            let Some(r) = r.filter(|_| !self.ended()) else {
                break Err(libc::EBADF);
            };
            if let Err(e) = r {
                break if got > 0 { Ok(got) } else { Err(e) };
            }
        };
        if !self.ended() {
            self.go_idle(&d, &st, token);
        }
        if let Ok(n) = result {
            if !peek {
                add_bytes(&mut st.unflushed, n, stats::RX_BYTES);
            }
        }
        result
    }

    /// Where the next bytes of our receiving direction are.
    fn source(&self, d: &Dir<'_>, st: &RxState) -> Result<Src, Corrupt> {
        let Some(p) = d.switched() else {
            return Ok(if d.back().is_some() {
                Src::Back
            } else {
                Src::Unswitched
            });
        };
        let left = p.wrapping_sub(st.tcp_in);
        if left > (1 << 48) {
            return Err(Corrupt);
        }
        if left > 0 {
            return Ok(Src::Prefix(left as usize));
        }
        Ok(match d.back() {
            Some(at) => {
                let l = at.wrapping_sub(st.head);
                if l > self.seg_fast.ring() as u64 {
                    return Err(Corrupt);
                }
                if l == 0 {
                    Src::Back
                } else {
                    Src::Ring(l as usize)
                }
            }
            // We asked the producer to go back: nothing more from the ring.
            None if d.back_requested() => Src::Ring(0),
            None => Src::Ring(usize::MAX),
        })
    }

    /// True when a read would not block: bytes on the ring or TCP, the end, or an error.
    fn has_data(&self, d: &Dir<'_>, st: &RxState) -> bool {
        if self.rx_shut.load(Ordering::Acquire)
            || self.reset.load(Ordering::Acquire)
            || self.peer_eof.load(Ordering::Acquire)
            || self.corrupt.load(Ordering::Acquire)
        {
            return true;
        }
        // (The producer's end on the ring counts once the prefix before it is read.)
        match self.source(d, st) {
            Err(Corrupt) => true,
            Ok(Src::Ring(l)) => d.fin() || d.readable(st.head).map_or(true, |a| a.min(l) > 0),
            Ok(_) => self.tcp_has_bytes(),
        }
    }

    /// Empties A of wake-up bytes: `token` says whether one is queued — or on its way: a
    /// producer sets POKED before it sends, so after we saw POKED its byte may not have
    /// arrived yet, and draining too early would leave it to arrive later, making the
    /// descriptor readable with nothing to read (a program that trusts `select` would then
    /// block in `read`). So that byte is waited for as long as a producer may still send it:
    /// a producer descheduled between the two steps on a loaded machine can take more than
    /// 100 ms (a clean-clone CI run saw the byte come after that old bound), so the wait ends
    /// only when the byte comes, when every peer process is gone (its TCP end closed), or
    /// after [`TOKEN_WAIT_NS`] (a producer stopped in that window of a microsecond).
    fn clear_token(&self, token: Option<bool>) {
        match token {
            Some(false) => {}
            None => sys::drain(self.a),
            Some(true) => {
                let take = || sys::recv1(self.a, libc::MSG_DONTWAIT).is_ok();
                if spin(20_000, take) {
                    return;
                }
                let mut p = libc::pollfd {
                    fd: self.a,
                    events: libc::POLLIN,
                    revents: 0,
                };
                let deadline = now_ns() + TOKEN_WAIT_NS;
                loop {
                    let _ = sys::poll(&mut p, 1, 10);
                    if take() || self.tcp_eof() || now_ns() >= deadline {
                        return;
                    }
                }
            }
        }
    }

    /// Back to the program: leave exactly the readiness the kernel would show — a wake-up
    /// byte queued on A iff a read would not block — and, with nothing to read, ask the
    /// producer for a byte when bytes come.
    fn go_idle(&self, d: &Dir<'_>, st: &RxState, token: Option<bool>) {
        if self.has_data(d, st) {
            let queued = token.unwrap_or_else(|| sys::peek1(self.a).is_ok_and(|n| n > 0));
            if !queued {
                sys::poke(self.b);
            }
            d.set_rx_state(RX_POKED);
        } else {
            self.clear_token(token);
            d.set_rx_state(RX_ARMED);
            if self.has_data(d, st) && d.take_rx_wait() {
                sys::poke(self.b);
            }
        }
    }

    /// Without a lock or a system call: would a read (`read`) or a write (`write`) not block
    /// now? Only the rings are looked at (false while a direction is still on TCP, or while
    /// a prefix on TCP is still to be read before the ring's bytes), for
    /// `poll`/`select`/`epoll_wait` to spin on before they sleep in the kernel.
    pub fn ready(&self, read: bool, write: bool) -> bool {
        self.peekers.fetch_add(1, Ordering::SeqCst);
        let r = if self.ended() || self.reset.load(Ordering::Relaxed) {
            true
        } else {
            let rx = self.seg_fast.dir(self.role, false);
            let tx = self.seg_fast.dir(self.role, true);
            (read && self.rx_ring_has(&rx, self.peer_eof.load(Ordering::Relaxed)))
                || (write && tx.on_ring() && tx.pending() < self.seg_fast.ring() as u64)
        };
        self.peekers.fetch_sub(1, Ordering::SeqCst);
        r
    }

    /// Would a read of the receiving direction `rx` find something without TCP: bytes or the
    /// producer's end on the ring — once the prefix before them is read — or (`eof`) the
    /// TCP connection's end while the direction is on the ring.
    fn rx_ring_has(&self, rx: &Dir<'_>, eof: bool) -> bool {
        (rx.on_ring_for_good() && (rx.pending() > 0 || rx.fin())) || (eof && rx.on_ring())
    }

    /// Sends the wake-up byte a reader of ours owes (see [`RX_OWED`]), if it owes one: before
    /// a wait sleeps in the kernel on the descriptor.
    pub fn pay_debt(&self) {
        self.peekers.fetch_add(1, Ordering::SeqCst);
        if !self.ended() && self.seg_fast.dir(self.role, false).pay_rx_debt() {
            sys::poke(self.b);
        }
        self.peekers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Without a lock or a system call: (bytes to read on the ring, room to write on the
    /// ring) — only the plain cases a wait may answer by itself, not an end or an error
    /// (those go to the kernel, which reports them in full).
    pub fn ring_ready(&self) -> (bool, bool) {
        self.peekers.fetch_add(1, Ordering::SeqCst);
        let r = if self.ended() || self.reset.load(Ordering::Relaxed) {
            (false, false)
        } else {
            let rx = self.seg_fast.dir(self.role, false);
            let tx = self.seg_fast.dir(self.role, true);
            (
                rx.on_ring_for_good() && rx.pending() > 0,
                tx.on_ring()
                    && !self.tx_shut.load(Ordering::Relaxed)
                    && tx.pending() < self.seg_fast.ring() as u64,
            )
        };
        self.peekers.fetch_sub(1, Ordering::SeqCst);
        r
    }

    /// Before a `poll`/`select`/`epoll_wait` spins on this connection's ring: tells the
    /// producer it need not send a wake-up byte while we look (see [`crate::seg::RX_SPIN`]). True if
    /// taken; then [`Conn::spin_end`] must follow.
    pub fn spin_begin(&self) -> bool {
        self.peekers.fetch_add(1, Ordering::SeqCst);
        let r = !self.ended()
            && !self.reset.load(Ordering::Relaxed)
            && self.seg_fast.dir(self.role, false).begin_rx_spin();
        self.peekers.fetch_sub(1, Ordering::SeqCst);
        r
    }

    /// After the spin: bytes seen → the wake-up byte is owed: the wait answers from the rings
    /// (and the program's read that follows takes the bytes), or pays it before its kernel
    /// call, which then returns at once; none → ARMED again, and anything that came
    /// meanwhile (a producer that saw SPIN sent nothing) is signalled now.
    pub fn spin_end(&self) {
        self.peekers.fetch_add(1, Ordering::SeqCst);
        if !self.ended() {
            let d = self.seg_fast.dir(self.role, false);
            if self.ready(true, false) {
                d.end_rx_spin(RX_OWED);
            } else if d.end_rx_spin(RX_ARMED) {
                let any = self.reset.load(Ordering::Acquire)
                    || self.rx_ring_has(&d, self.peer_eof.load(Ordering::Acquire))
                    || (!d.on_ring_for_good() && self.tcp_has_bytes());
                if any && d.take_rx_wait() {
                    sys::poke(self.b);
                }
            }
        }
        self.peekers.fetch_sub(1, Ordering::SeqCst);
    }

    /// What the helper thread saw on the TCP socket: bytes (the prefix) or its end.
    pub fn tcp_event(&self, readable: bool, hangup: bool) {
        if hangup {
            self.peer_eof.store(true, Ordering::Release);
            // Readable (end) and writable (EPIPE) for good.
            sys::poke(self.b);
            sys::drain(self.b);
        } else if readable {
            // An edge of another kind (writable) also reports EPOLLIN while bytes sit on TCP,
            // and the reader may take them between our look and our claim: a byte on A must
            // mean something to read, so the claim is undone when there is nothing.
            let d = self.seg_fast.dir(self.role, false);
            let on_tcp = || self.tcp_has_bytes();
            if !on_tcp() || !d.take_rx_wait() {
                return;
            }
            if on_tcp() || !d.untake_rx_wait() {
                // Bytes to read, or the reader saw our claim and waits for the byte.
                sys::poke(self.b);
                return;
            }
            // Undone: whatever arrived meanwhile (a producer that saw our claim did not
            // send) is signalled now.
            if (on_tcp() || d.pending() > 0) && d.take_rx_wait() {
                sys::poke(self.b);
            }
        }
    }

    fn claimed(&self) -> bool {
        self.role == Role::Server || self.seg_fast.claimed().is_some()
    }

    /// `send`/`write`/`sendmsg` on the connection.
    pub fn send(&self, bufs: &Bufs<'_>, iov: &[libc::iovec], flags: c_int) -> Res {
        if self.ended() {
            return Err(libc::EBADF);
        }
        crate::ensure_helper();
        let nosig = flags & libc::MSG_NOSIGNAL != 0;
        let want = bufs.len();
        let dontwait = flags & libc::MSG_DONTWAIT != 0 || self.nonblock.load(Ordering::Relaxed);
        let mut st = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if self.ended() {
            return Err(libc::EBADF);
        }
        if self.tx_shut.load(Ordering::Acquire) || self.reset.load(Ordering::Acquire) {
            return epipe(nosig);
        }
        if want == 0 {
            return Ok(0);
        }
        let d = self.seg_fast.dir(self.role, true);
        let _end = match self.end_lock(d, true, !dontwait) {
            Locked::Yes(l) => l,
            Locked::Busy => return Err(libc::EAGAIN),
            Locked::Over if self.ended() => return Err(libc::EBADF),
            Locked::Over => return epipe(nosig),
        };
        sync_tx(&d, &mut st);
        if d.back_requested() && d.back().is_none() {
            self.give_back(&d, &mut st);
        }
        if flags & libc::MSG_OOB != 0 {
            // Urgent data is the kernel's: the connection goes back to TCP for good first.
            if d.back().is_none() {
                self.back_for_urgent(&d, &st);
            }
            return self.send_tcp(&mut st, iov, flags, dontwait, nosig);
        }
        let back = d.back().is_some();
        if back || !st.switched {
            if !back && self.claimed() && self.peer_wake().is_some() {
                d.switch(st.tcp_out);
                st.switched = true;
                self.drop_offer();
            } else {
                // Not agreed (yet), or back: the kernel's TCP, exactly as without us.
                return self.send_tcp(&mut st, iov, flags, dontwait, nosig);
            }
        }
        let mut sent = 0usize;
        let mut armed = false;
        let mut spun = false;
        let result = loop {
            if self.peer_gone() || self.reset.load(Ordering::Acquire) {
                break if sent > 0 { Ok(sent) } else { epipe(nosig) };
            }
            if d.back_requested() {
                // The peer's program leaves the rings (an exec): so do we.
                self.give_back(&d, &mut st);
                if sent > 0 {
                    break Ok(sent);
                }
                return self.send_tcp(&mut st, iov, flags, dontwait, nosig);
            }
            match d.free(st.tail) {
                Err(Corrupt) => break self.corrupt(sent),
                Ok(0) => {}
                Ok(free) => {
                    // Published piece by piece, so the reader copies out while we copy in.
                    let n = free.min(want - sent).min(PIECE);
                    let tail = st.tail;
                    bufs.each(sent, n, |p, k, off| {
                        // SAFETY: p is valid for k bytes of reads (caller's buffer); the ring
                        // has `free` >= n bytes at tail.
                        unsafe { d.copy_in(tail + off as u64, p, k) }
                    });
                    st.tail += n as u64;
                    d.publish(st.tail);
                    self.wake_reader(&d, true);
                    sent += n;
                    if sent == want {
                        break Ok(sent);
                    }
                    continue;
                }
            }
            if !dontwait && !spun {
                spun = true;
                if self.spin_until(|| d.free(st.tail) != Ok(0)) {
                    continue;
                }
            }
            if !armed {
                fill(self.a);
                d.arm_tx();
                armed = true;
                self.tcp_eof();
                continue;
            }
            if dontwait {
                break if sent > 0 {
                    Ok(sent)
                } else {
                    Err(libc::EAGAIN)
                };
            }
            let tok = 0u8;
            let r = self.asleep(|| {
                sys::sendto(
                    self.a,
                    &tok as *const u8 as *const libc::c_void,
                    1,
                    libc::MSG_NOSIGNAL,
                    std::ptr::null(),
                    0,
                )
            });
            match r {
                Some(Ok(_)) => {
                    armed = false;
                    if self.ended() {
                        break Err(libc::EBADF);
                    }
                }
                // Ended before we slept: nothing of the segment to look at any more.
                None => {
                    armed = false;
                    break Err(libc::EBADF);
                }
                Some(Err(e)) => break if sent > 0 { Ok(sent) } else { Err(e) },
            }
        };
        if armed && d.free(st.tail).is_ok_and(|f| f > 0) && d.take_tx_wait() {
            // We asked to be woken and nobody took the request: undo the fill ourselves, or
            // the descriptor stays unwritable with room in the ring.
            sys::drain(self.b);
        }
        if let Ok(n) = result {
            add_bytes(&mut st.unflushed, n, stats::TX_BYTES);
        }
        result
    }

    /// A send on the kernel's TCP socket (before the switch, or after going back).
    fn send_tcp(
        &self,
        st: &mut TxState,
        iov: &[libc::iovec],
        flags: c_int,
        dontwait: bool,
        nosig: bool,
    ) -> Res {
        let msg = libc::msghdr {
            msg_name: std::ptr::null_mut(),
            msg_namelen: 0,
            msg_iov: iov.as_ptr() as *mut libc::iovec,
            msg_iovlen: iov.len(),
            msg_control: std::ptr::null_mut(),
            msg_controllen: 0,
            msg_flags: 0,
        };
        let fl = (flags & !libc::MSG_DONTWAIT)
            | libc::MSG_NOSIGNAL
            | if dontwait { libc::MSG_DONTWAIT } else { 0 };
        match sys::sendmsg(self.tcp, &msg, fl) {
            Ok(n) => {
                if !st.switched {
                    st.tcp_out += n as u64;
                    self.seg_fast.dir(self.role, true).set_tx_tcp(st.tcp_out);
                }
                Ok(n)
            }
            Err(libc::EPIPE) => epipe(nosig),
            Err(libc::EAGAIN) => {
                self.tcp_tx_blocked.store(true, Ordering::SeqCst);
                fill(self.a);
                Err(libc::EAGAIN)
            }
            Err(e) => Err(e),
        }
    }

    /// Our sending direction goes back to the kernel's TCP because the peer asked (its
    /// program execs): what the peer has not consumed from the ring is sent again on TCP,
    /// where the peer's next program reads it, then every later byte.
    fn give_back(&self, d: &Dir<'_>, st: &mut TxState) {
        if d.back().is_some() {
            return;
        }
        if !d.claim_back() {
            // Another process of our end is doing it: wait for it, or for the end.
            while d.back().is_none() && !self.tcp_eof() && !self.ended() {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            return;
        }
        let mut at = st.tail;
        if st.switched {
            let head = d.peer_head();
            let n = st.tail.wrapping_sub(head);
            if n <= self.seg_fast.ring() as u64 {
                at = head;
                let mut off = 0u64;
                while off < n {
                    let (p, len) = d.piece(head + off, (n - off) as usize);
                    match sys::sendto(
                        self.tcp,
                        p as *const libc::c_void,
                        len,
                        libc::MSG_NOSIGNAL,
                        std::ptr::null(),
                        0,
                    ) {
                        Ok(k) => off += k as u64,
                        Err(libc::EINTR) => {}
                        // The peer is gone: nothing to deliver any more.
                        Err(_) => break,
                    }
                }
            } else {
                let _ = self.corrupt(0);
            }
        }
        d.set_back(at);
        if self.tx_shut.load(Ordering::Acquire) {
            // We had shut down (a fin on the ring, after the bytes just sent): say it on TCP.
            let _ = sys::shutdown(self.tcp, libc::SHUT_WR);
        }
        self.left_ring(d, "back on the kernel's TCP (the peer's program execs)");
    }

    /// Our sending direction just went back to the kernel's TCP (`d.set_back` done).
    fn left_ring(&self, d: &Dir<'_>, what: &str) {
        // Writable is the kernel socket's business from now on: undo any fill of A.
        sys::drain(self.b);
        config::log(format_args!("{}: {what}", self.label));
        // A reader of the peer's waiting on the ring looks again (and turns to TCP).
        self.wake_reader(d, false);
    }

    /// Takes the urgent byte the peer sent with its request to go back, if it asked and the
    /// byte has not been taken: an urgent byte after that one is the program's.
    fn take_back_urgent(&self) {
        let rx = self.seg_fast.dir(self.role, false);
        if self.seg_fast.dir(self.role, true).back_requested()
            && !rx.urgent_taken()
            && sys::recv1(self.tcp, libc::MSG_OOB | libc::MSG_DONTWAIT).is_ok()
        {
            rx.set_urgent_taken();
        }
    }

    /// `recv(MSG_OOB)`: the kernel's urgent byte, once our receiving direction is back on TCP
    /// (a peer that sends urgent data goes back first); before, there is none (`EINVAL`).
    fn recv_urgent(&self, bufs: &Bufs<'_>, flags: c_int) -> Res {
        self.peekers.fetch_add(1, Ordering::SeqCst);
        let back = !self.ended() && {
            self.take_back_urgent();
            let rx = self.seg_fast.dir(self.role, false);
            let tx = self.seg_fast.dir(self.role, true);
            rx.back().is_some() && (!tx.back_requested() || rx.urgent_taken())
        };
        self.peekers.fetch_sub(1, Ordering::SeqCst);
        if !back {
            return Err(libc::EINVAL);
        }
        let (p, len) = bufs.piece(0);
        sys::recvfrom(
            self.tcp,
            p as *mut libc::c_void,
            len,
            flags,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    }

    /// Before our first urgent byte: our sending direction goes back to the kernel's TCP for
    /// good (urgent data is the kernel's: its mark, `SIGURG`, `sockatmark`). The peer reads the
    /// ring up to where we stopped, then TCP; its own direction stays on the ring. No request
    /// and no urgent byte of ours go with it (Linux keeps one urgent mark: a second urgent byte
    /// sent before the first is read turns the first into stream data).
    fn back_for_urgent(&self, d: &Dir<'_>, st: &TxState) {
        d.set_back(st.tail);
        self.left_ring(d, "sending on the kernel's TCP (urgent data)");
    }

    /// The helper thread saw urgent data on TCP: the peer asks us to go back (it execs, or
    /// sends urgent data), or the urgent byte is the program's (left to it).
    pub fn back_event(&self) {
        self.take_back_urgent();
        let d = self.seg_fast.dir(self.role, true);
        if !d.back_requested() || d.back().is_some() {
            return;
        }
        // A writer of ours may sleep on the full ring with the lock: wake it; it goes back
        // itself, or we do once it has left.
        sys::drain(self.b);
        loop {
            if self.ended() {
                return;
            }
            let guard = match self.tx.try_lock() {
                Ok(g) => Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
            if let Some(mut st) = guard {
                match self.end_lock(d, true, false) {
                    Locked::Yes(_end) => {
                        sync_tx(&d, &mut st);
                        self.give_back(&d, &mut st);
                        return;
                    }
                    Locked::Over => return,
                    // Another process of ours is writing: it goes back itself.
                    Locked::Busy => {}
                }
            }
            if d.back().is_some() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }

    /// Before an `exec` that keeps the connection (or a spawn that inherits it): both
    /// directions go back to the kernel's TCP, whose socket the caller then puts at the
    /// program's descriptors. Our bytes: the peer reads the ring up to our tail, then TCP.
    /// The peer's: we ask it (urgent byte, seen by its helper thread) to send again on TCP
    /// what we have not consumed, then everything after. No lock is taken and nothing of
    /// this process is changed but the segment (this may run in a `vfork` child).
    pub fn hand_back(&self) {
        if self.ended() {
            return;
        }
        let tx = self.seg_fast.dir(self.role, true);
        if tx.back().is_none() {
            let (tail, _) = tx.take_tx(crate::my_pid());
            tx.set_back(tail);
        }
        if self.tx_shut.load(Ordering::Acquire) {
            let _ = sys::shutdown(self.tcp, libc::SHUT_WR);
        }
        let rx = self.seg_fast.dir(self.role, false);
        if rx.back().is_none() {
            rx.request_back();
            let b = [b'!'];
            let _ = sys::sendto(
                self.tcp,
                b.as_ptr() as *const libc::c_void,
                1,
                libc::MSG_OOB | libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                std::ptr::null(),
                0,
            );
        }
    }

    /// Bytes a `read` would return now (`FIONREAD`).
    pub fn readable(&self) -> usize {
        let mut st = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        if self.ended() {
            return 0;
        }
        let d = self.seg_fast.dir(self.role, false);
        let _end = match self.end_lock(d, false, false) {
            Locked::Yes(l) => l,
            // Another process of ours is reading: what the ring holds, roughly.
            _ => return d.pending() as usize,
        };
        sync_rx(&d, &mut st);
        match self.source(&d, &st) {
            Err(Corrupt) => 0,
            Ok(Src::Ring(l)) => d.readable(st.head).unwrap_or(0).min(l),
            Ok(src) => {
                let mut n: c_int = 0;
                let _ = sys::ioctl(self.tcp, libc::FIONREAD, &mut n as *mut c_int as usize);
                (n.max(0) as usize).min(src.tcp_limit().unwrap_or(0))
            }
        }
    }

    /// `shutdown(how)`.
    pub fn shutdown(&self, how: c_int) -> Res {
        if self.ended() {
            return Err(libc::EBADF);
        }
        if !matches!(how, libc::SHUT_RD | libc::SHUT_WR | libc::SHUT_RDWR) {
            return Err(libc::EINVAL);
        }
        if how != libc::SHUT_WR {
            self.rx_shut.store(true, Ordering::Release);
            sys::poke(self.b);
        }
        if how != libc::SHUT_RD {
            let mut st = self.tx.lock().unwrap_or_else(|e| e.into_inner());
            if self.ended() {
                return Err(libc::EBADF);
            }
            self.tx_shut.store(true, Ordering::Release);
            let d = self.seg_fast.dir(self.role, true);
            let _end = match self.end_lock(d, true, true) {
                Locked::Yes(l) => l,
                _ => return Ok(0),
            };
            sync_tx(&d, &mut st);
            if d.back().is_some() {
                // Back on the kernel's TCP: its own shutdown.
                let _ = sys::shutdown(self.tcp, libc::SHUT_WR);
                return Ok(0);
            }
            if !st.switched && !d.back_requested() && self.claimed() && self.peer_wake().is_some() {
                d.switch(st.tcp_out);
                st.switched = true;
            }
            if st.switched {
                d.set_fin();
                // (A reader still to read our prefix sees the end after it.)
                if !d.prefix_unread() {
                    if let Some(w) = self.peer_wake() {
                        sys::poke(w);
                    }
                }
            } else {
                // Still on the kernel's TCP: its own FIN says it (and the flag tells the peer
                // that this end-of-file is a half-close).
                d.set_tcp_fin();
                let _ = sys::shutdown(self.tcp, libc::SHUT_WR);
            }
        }
        Ok(0)
    }

    /// In a child just forked (no locks: another thread of the parent may have held them):
    /// name this process as the holder the peer fetches our wake-up socket from.
    pub fn forked(&self) {
        if !self.ended() {
            self.seg_fast.set_holder(self.role, crate::my_pid());
        }
    }

    /// Runs `sleep` (a blocking call on `A`) counted among the [`Conn::sleepers`]; None,
    /// without sleeping, once the connection has ended (`end` either sees us counted and
    /// wakes us, or we see `ended`).
    fn asleep<T>(&self, sleep: impl FnOnce() -> T) -> Option<T> {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let r = (!self.ended.load(Ordering::SeqCst)).then(sleep);
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        r
    }

    /// The process exits: remove an unclaimed offer, without waiting for any lock.
    pub fn at_exit(&self) {
        if let Ok(mut p) = self.offer_path.try_lock() {
            if let Some(p) = p.take() {
                let _ = sys::unlink(&p);
            }
        }
    }

    /// The last program descriptor in this process closed: wake every sleeper, release
    /// everything. No fin is written: the peer learns that every process of ours closed from
    /// the TCP connection's end-of-file (a fork's copies keep it open), as the kernel's TCP.
    pub fn end(&self) {
        if self.ended.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake our own threads sleeping in recv/send on A; they see `ended` and leave. (None
        // asleep: no byte, which would stay on A for a fork's other side, see `sleepers`.)
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            sys::poke(self.b);
            sys::drain(self.b);
        }
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        while self.helper_busy.load(Ordering::SeqCst) || self.peekers.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
        let mut seg = self.seg.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = seg.as_mut() {
            // SAFETY: every user of the mapping holds rx or tx (held here) and checks
            // `ended` (set) first; `seg_fast` is never used after this.
            unsafe { s.unmap() };
        }
        *seg = None;
        config::count(stats::RX_BYTES, std::mem::take(&mut rx.unflushed));
        config::count(stats::TX_BYTES, std::mem::take(&mut tx.unflushed));
        config::uncount(stats::OPEN);
        self.drop_offer();
        let w = self.peer_wake.swap(PEER_FAILED, Ordering::AcqRel);
        for fd in [self.tcp, self.a, self.b, w] {
            if fd >= 0 {
                crate::setup::close_hidden(fd);
            }
        }
        config::log(format_args!("{}: closed", self.label));
    }
}

/// Where the next bytes of a receiving direction are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Src {
    /// On TCP: the producer has not switched (if it switches meanwhile, the ring follows).
    Unswitched,
    /// On TCP: this many bytes of the producer's prefix are left.
    Prefix(usize),
    /// On TCP for good: the producer went back.
    Back,
    /// On the ring, at most this many bytes.
    Ring(usize),
}

impl Src {
    /// How many bytes to take from TCP, if TCP is where they are.
    fn tcp_limit(self) -> Option<usize> {
        match self {
            Src::Unswitched | Src::Back => Some(usize::MAX),
            Src::Prefix(l) => Some(l),
            Src::Ring(_) => None,
        }
    }
}

/// Before reading: if another process of our end read last (a fork's other side, or this
/// process before an `exec`), start from where it left the direction.
fn sync_rx(d: &Dir<'_>, st: &mut RxState) {
    let me = crate::my_pid();
    if st.pid != me || d.rx_owner() != me {
        (st.head, st.tcp_in) = d.take_rx(me);
        st.pid = me;
    }
}

/// Before writing: as [`sync_rx`], for our sending direction.
fn sync_tx(d: &Dir<'_>, st: &mut TxState) {
    let me = crate::my_pid();
    if st.pid != me || d.tx_owner() != me {
        (st.tail, st.tcp_out) = d.take_tx(me);
        st.switched = d.switched().is_some();
        st.pid = me;
    }
}

/// Spins up to `budget_ns` until `ready()`; false if it never was.
pub fn spin(budget_ns: u64, mut ready: impl FnMut() -> bool) -> bool {
    if budget_ns == 0 {
        return ready();
    }
    let start = now_ns();
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if now_ns().saturating_sub(start) > budget_ns {
            return ready();
        }
    }
}

/// Makes `a` unwritable: fills its (small) send buffer toward `B`.
fn fill(a: c_int) {
    let junk = [0u8; 2048];
    while sys::sendto(
        a,
        junk.as_ptr() as *const libc::c_void,
        junk.len(),
        libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        std::ptr::null(),
        0,
    )
    .is_ok()
    {}
}

/// CLOCK_MONOTONIC in nanoseconds (vDSO, no system call).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into ts.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
