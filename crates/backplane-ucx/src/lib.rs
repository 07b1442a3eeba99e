//! The link between the supervisors of a fabric that spans hosts: UCP active messages over the
//! transport UCX picks at run time (TCP, RDMA verbs, shared memory), driven from one thread.
//!
//! A [`Link`] is one UCP context and worker, an optional listener, and up to 64 endpoints named
//! by an [`EpId`]. Messages are whole byte strings up to [`MAX_MSG`] (sent eagerly, copied on
//! both sides). Nothing blocks: connecting, accepting, receiving and failing arrive as
//! [`Event`]s from [`Link::poll`], which the caller runs from its own event loop (the worker's
//! wake-up fd is [`Link::fd`]).
//!
//! Why a C shim (`src/shim.c`) rather than bindings: UCP's parameter structs are unions and
//! field masks whose layouts change between releases; the shim is compiled against the
//! installed header, so the Rust side binds ten plain functions and nothing can drift.

use std::ffi::{c_int, c_void, CStr, CString};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// The largest message [`Link::send`] takes (a 4 MiB datagram and a header).
pub const MAX_MSG: usize = 4 * 1024 * 1024 + 4096;

/// The unsafe FFI: the shim's functions, nothing else.
/// Bytes that [`Link::send_zc`] hands to UCX in place.
///
/// # Safety
///
/// [`InPlace::bytes`] must name memory that stays readable for as long as the value lives,
/// the same range on every call.
pub unsafe trait InPlace: Send {
    /// The address and length of the bytes.
    fn bytes(&self) -> (*const u8, usize);
}

/// A piece of a message sent with [`Link::send_pieces`]: bytes UCX reads in place, or owned
/// bytes (which UCX reads where they are too).
pub enum MsgPiece {
    Lent(Box<dyn InPlace>),
    Owned(Vec<u8>),
}

impl MsgPiece {
    fn range(&self) -> (*const u8, usize) {
        match self {
            MsgPiece::Lent(b) => b.bytes(),
            MsgPiece::Owned(v) => (v.as_ptr(), v.len()),
        }
    }
}

/// The first `len` bytes of an owned buffer, handed to UCX in place ([`Link::send_zc`]); once
/// UCX let go of them the buffer goes to `recycle` (a sender that fills one buffer after
/// another reuses them: no allocation, no page faults, no zeroing per message).
pub struct OwnedBytes {
    buf: Vec<u8>,
    len: usize,
    recycle: Option<Box<dyn FnOnce(Vec<u8>) + Send>>,
}

impl OwnedBytes {
    /// `buf[..len]` (`len` is clamped to the buffer), `recycle` called with `buf` at the end.
    pub fn new(buf: Vec<u8>, len: usize, recycle: Box<dyn FnOnce(Vec<u8>) + Send>) -> Self {
        let len = len.min(buf.len());
        Self {
            buf,
            len,
            recycle: Some(recycle),
        }
    }
}

impl Drop for OwnedBytes {
    fn drop(&mut self) {
        if let Some(r) = self.recycle.take() {
            r(std::mem::take(&mut self.buf));
        }
    }
}

// SAFETY: the Vec is owned and never touched while the value lives (no method hands it out),
// so its heap buffer stays where it is and readable, the same range every call.
unsafe impl InPlace for OwnedBytes {
    fn bytes(&self) -> (*const u8, usize) {
        (self.buf.as_ptr(), self.len)
    }
}

mod ffi {
    use std::ffi::{c_char, c_int, c_void};

    #[repr(C)]
    pub struct Link {
        _private: [u8; 0],
    }

    /// A piece of a message read in place (`bpx_piece`).
    #[repr(C)]
    pub struct Piece {
        pub buf: *const c_void,
        pub len: usize,
    }

    #[repr(C)]
    pub struct Event {
        pub kind: c_int,
        pub ep: c_int,
        pub status: c_int,
        pub len: usize,
        pub data: *mut c_void,
    }

    pub const EV_ACCEPTED: c_int = 1;
    pub const EV_MESSAGE: c_int = 2;
    pub const EV_FAILED: c_int = 3;
    pub const EV_DROPPED: c_int = 4;

    extern "C" {
        pub fn bpx_open(ip: *const c_char, port: u16, no_shm: c_int, out: *mut *mut Link) -> c_int;
        pub fn bpx_set_host_netns(fd: c_int) -> c_int;
        pub fn bpx_addr_is_local(ip: *const c_char) -> c_int;
        pub fn bpx_listen_port(l: *mut Link) -> c_int;
        pub fn bpx_efd(l: *mut Link) -> c_int;
        pub fn bpx_connect(l: *mut Link, ip: *const c_char, port: u16) -> c_int;
        pub fn bpx_send2(
            l: *mut Link,
            ep: c_int,
            head: *const c_void,
            hlen: usize,
            buf: *const c_void,
            blen: usize,
        ) -> c_int;
        pub fn bpx_send_alloc(
            l: *mut Link,
            ep: c_int,
            len: usize,
            status: *mut c_int,
        ) -> *mut c_void;
        pub fn bpx_send_cancel(payload: *mut c_void);
        pub fn bpx_send_zc(
            l: *mut Link,
            ep: c_int,
            head: *const c_void,
            hlen: usize,
            body: *const c_void,
            blen: usize,
            tail: *const c_void,
            tlen: usize,
            release: extern "C" fn(*mut c_void),
            token: *mut c_void,
        ) -> c_int;
        pub fn bpx_send_iov(
            l: *mut Link,
            ep: c_int,
            head: *const c_void,
            hlen: usize,
            pieces: *const Piece,
            n: usize,
            tail: *const c_void,
            tlen: usize,
            release: extern "C" fn(*mut c_void),
            token: *mut c_void,
        ) -> c_int;
        pub fn bpx_send_ready(l: *mut Link, ep: c_int, payload: *mut c_void, len: usize) -> c_int;
        pub fn bpx_progress(l: *mut Link) -> c_int;
        pub fn bpx_look(l: *mut Link) -> c_int;
        pub fn bpx_progress_with(
            l: *mut Link,
            deliver: extern "C" fn(*mut c_void, c_int, *const c_void, usize) -> c_int,
            ctx: *mut c_void,
        ) -> c_int;
        pub fn bpx_inflight_bytes(l: *mut Link) -> usize;
        pub fn bpx_idle(l: *mut Link) -> c_int;
        pub fn bpx_queued(l: *mut Link) -> usize;
        pub fn bpx_arm(l: *mut Link) -> c_int;
        pub fn bpx_next_event(l: *mut Link, ev: *mut Event) -> c_int;
        pub fn bpx_free(p: *mut c_void);
        pub fn bpx_close(l: *mut Link, ep: c_int);
        pub fn bpx_close_flush(l: *mut Link, ep: c_int, timeout_us: std::ffi::c_long) -> c_int;
        pub fn bpx_ep_info(l: *mut Link, ep: c_int, buf: *mut c_char, cap: usize) -> usize;
        #[cfg(test)]
        pub fn bpx_text_am_lane_is_tcp(text: *mut c_char) -> c_int;
        pub fn bpx_close_all(l: *mut Link);
        pub fn bpx_reset(l: *mut Link);
        pub fn bpx_status_string(status: c_int) -> *const c_char;
        pub fn bpx_log_to_stderr();
    }
}

/// A UCX status, with UCX's own words for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// The `ucs_status_t` value (negative).
    pub status: i32,
    /// What was being done.
    pub what: String,
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.what, status_string(self.status))
    }
}

impl std::error::Error for Error {}

/// UCX's description of a status code.
pub fn status_string(status: i32) -> String {
    // SAFETY: ucs_status_string takes any value and returns a static NUL-terminated string
    // ("Unknown error" for values it does not know).
    let p = unsafe { ffi::bpx_status_string(status) };
    if p.is_null() {
        return format!("UCX status {status}");
    }
    // SAFETY: p is non-null and points to a static C string (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A received message, in the buffer the shim copied it into (freed on drop): handed over
/// without another copy.
pub struct Bytes {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain malloc'ed memory owned by this value alone; freeing it from
// another thread is allowed.
unsafe impl Send for Bytes {}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        if self.ptr.is_null() {
            return &[];
        }
        // SAFETY: ptr is a live allocation of len bytes owned by self (see poll).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Bytes {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: ptr came from the shim's malloc and is freed once, here.
            unsafe { ffi::bpx_free(self.ptr.cast()) }
        }
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} B)", self.len)
    }
}

impl PartialEq for Bytes {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Bytes {}

/// An endpoint of a [`Link`] (an index, reused after [`Link::close`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EpId(pub i32);

/// Something that happened on a link.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// A peer connected to the listener: a new endpoint.
    Accepted(EpId),
    /// A message from an endpoint (`None`: its sender is not one of our endpoints).
    Message(Option<EpId>, Bytes),
    /// An endpoint failed (peer gone, connection refused, …); close it.
    Failed(EpId, Error),
    /// A message we could not take (rendezvous or larger than [`MAX_MSG`]) was dropped.
    Dropped(Option<EpId>, usize),
}

/// One UCP context + worker (+ listener). `Send`, not `Sync`: the worker is made for one
/// thread at a time (`UCS_THREAD_MODE_SERIALIZED`), and `&mut self` on every call that
/// touches it keeps two threads from using it at once.
pub struct Link {
    raw: *mut ffi::Link,
}

// SAFETY: the shim creates the worker in UCS_THREAD_MODE_SERIALIZED (any thread, one at a
// time); the link's state is plain memory owned by it; callbacks run only inside calls made
// with `&mut self` (progress), so moving the link between threads never overlaps two calls.
unsafe impl Send for Link {}

fn ipv4(addr: IpAddr) -> Result<CString, Error> {
    match addr {
        IpAddr::V4(a) => Ok(CString::new(a.to_string()).expect("no NUL in an address")),
        IpAddr::V6(_) => Err(Error {
            status: -20, // UCS_ERR_INVALID_ADDR
            what: format!("{addr}: only IPv4 addresses are supported"),
        }),
    }
}

fn check(status: i32, what: impl FnOnce() -> String) -> Result<(), Error> {
    if status < 0 {
        Err(Error {
            status,
            what: what(),
        })
    } else {
        Ok(())
    }
}

/// Environment defaults set once, before the first context (UCX 1.13 reads these options from
/// the environment only: `ucp_config_modify` of `TCP_CM_REUSEADDR` is accepted and ignored —
/// tried; so are `TCP_TX_SEG_SIZE`/`TCP_RX_SEG_SIZE`, session 28: a 1 MiB datagram stream
/// then made as many `sendmsg` calls as with UCX's defaults, 7 005 against 7 008, and 3 589
/// with these set in the environment), each unless the environment already says otherwise.
/// A program's own use of UCX sees them too, and so do the programs it starts:
///
/// - UCX's log goes to stderr (it writes to stdout by default, which is the program's: `perf
///   --json` across hosts printed a UCX warning into its JSON), unless `UCX_LOG_FILE` is set.
/// - `UCX_TCP_CM_REUSEADDR`, `UCX_RDMA_CM_REUSEADDR` = `y`: a supervisor restarted on the same
///   address must listen again at once, while its old connections sit in TIME_WAIT.
/// - `UCX_TCP_TX_SEG_SIZE`, `UCX_TCP_RX_SEG_SIZE` = [`TCP_SEGMENT`]: over TCP, UCX sends an
///   eager active message in pieces of `TX_SEG_SIZE` (8 KiB by default), each a `sendmsg` on
///   one side and a handler call and copy on the other. A link's messages are up to 4 MiB;
///   with 512 KiB pieces a bridge carried 1 MiB datagrams between two hosts at 1 540 MB/s
///   against 660–900 with the default (64 KiB ones: 1 080–1 440 against 670–770). Set on
///   both sides alike: every host runs the same defaults. (1 MiB since session 47: see
///   [`TCP_SEGMENT`].)
/// - `UCX_TCP_MAX_IOV` = [`TCP_MAX_IOV`]: the pieces of one message that UCX's TCP transport
///   gives one `sendmsg` (6 by default); a list of datagrams sent in place
///   ([`Link::send_lent`]) is one piece each (those back to back in memory merged). It changes nothing for a contiguous message
///   (`ucx_perftest`'s).
fn set_defaults() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: called once, before any context of ours, from inside the Once; the shim
        // only pushes a log handler (UCX's own list) unless UCX_LOG_FILE is set.
        unsafe { ffi::bpx_log_to_stderr() };
        for var in ["UCX_TCP_CM_REUSEADDR", "UCX_RDMA_CM_REUSEADDR"] {
            if std::env::var_os(var).is_none() {
                std::env::set_var(var, "y");
            }
        }
        // A user's segment sizes stand as they are, both of them (RX must hold what TX sends).
        // Pieces of a message read in place (`Link::send_lent`) in one `sendmsg`: a list of
        // datagrams, its header and UCX's own (the default, 6, would split a list of 14).
        if std::env::var_os("UCX_TCP_MAX_IOV").is_none() {
            std::env::set_var("UCX_TCP_MAX_IOV", TCP_MAX_IOV.to_string());
        }
        let segments = ["UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"];
        if segments.iter().all(|v| std::env::var_os(v).is_none()) {
            for var in segments {
                std::env::set_var(var, TCP_SEGMENT.to_string());
            }
        }
    });
}

/// Sets, in this process's environment, what a link asks of UCX (see `set_defaults`) — at
/// once, not at the first link: for a program this process starts that must run UCX as the
/// links do (`perf --peer-via` starts `ucx_perftest` beside its own links, on both hosts;
/// otherwise it would inherit these settings only once the first link had opened).
pub fn environment_defaults() {
    set_defaults();
}

/// Links opened from now on make their sockets in network namespace `ns` (an open
/// `/proc/PID/ns/net` of a process there), not in the calling thread's: for a program in a
/// node's namespace on a fabric across hosts (`bp0` and `lo` only), whose links must reach the
/// other hosts from the host's namespace. Each call that makes sockets — opening a link,
/// connecting, accepting, and the progress that wires a new endpoint's lanes — moves the
/// thread there and back (`setns`, which needs `CAP_SYS_ADMIN`); the rest runs as before (a
/// socket keeps the namespace it was made in). Call it before the first link opens, once.
pub fn use_network_namespace(ns: std::os::fd::OwnedFd) {
    use std::os::fd::IntoRawFd;
    // SAFETY: the shim takes the fd (it closes the one it held, if any); no link is open yet
    // (caller), so no thread is inside a move.
    unsafe {
        ffi::bpx_set_host_netns(ns.into_raw_fd());
    }
}

/// Links make their sockets in the calling thread's namespace again (see
/// [`use_network_namespace`]; before any link opens).
pub fn forget_network_namespace() {
    // SAFETY: -1 is "none"; the shim closes the fd it held. No link is open (caller).
    unsafe {
        ffi::bpx_set_host_netns(-1);
    }
}

/// Whether `ip` is an address of the namespace links make their sockets in (see
/// [`use_network_namespace`]) that UCX can use: a UDP socket binds to it there, and — in a
/// namespace set with [`use_network_namespace`] — its interface is in `/sys/class/net` as
/// there (UCX looks for its devices in `/sys`, whose view `ip netns exec` changes to the
/// node's).
pub fn address_is_local(ip: IpAddr) -> bool {
    let Ok(c) = ipv4(ip) else {
        return false;
    };
    // SAFETY: c is a valid C string for the call.
    unsafe { ffi::bpx_addr_is_local(c.as_ptr()) == 1 }
}

/// The iovs UCX's TCP transport may give one `sendmsg` (`UCX_TCP_MAX_IOV`, see
/// `set_defaults`).
pub const TCP_MAX_IOV: usize = 20;

/// At most this many pieces in a message of [`Link::send_lent`].
pub const MAX_PIECES: usize = 64;

/// Whether `next` starts where `prev` ends in memory: [`Link::send_lent`] hands such pieces
/// to UCX as one iov (a caller that counts the iovs of a message counts them so).
pub fn back_to_back(prev: &[u8], next: &[u8]) -> bool {
    prev.as_ptr().wrapping_add(prev.len()) == next.as_ptr()
}

/// The TCP segment size a link asks of UCX (see `set_defaults`): the largest message UCX's
/// TCP transport sends in one `sendmsg` and its receiver reads in one piece. A datagram
/// stream's list of up to 14 datagrams of 64 KiB (a frame cut up, sent in place) is one
/// message; with 512 KiB segments it held 7 (462 KB), with 1 MiB it holds 14 (924 KB), and
/// 1 MiB frames between two hosts went from 5.7–6.3 GB/s to 8.4–8.6 (session 47, pinned,
/// alternating builds; a plain TCP sender over the same veth: 5.3–5.7 — per `sendmsg`, the
/// kernel's cost here falls with its size). 2 MiB changed nothing more for a frame; UCX 1.13
/// trips its own assertion on a message sent in place in more iovs than it takes (a list of
/// 16 separate datagrams), so a list stays within 14 pieces of memory
/// (`dgram::direct::LIST_PIECES`; datagrams back to back are one, see [`Link::send_lent`]).
pub const TCP_SEGMENT: usize = 1024 * 1024;

thread_local! {
    static OPENING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as starting UCX for a link, until dropped.
struct Opening(bool);

impl Opening {
    fn begin() -> Self {
        Self(OPENING.with(|o| o.replace(true)))
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        OPENING.with(|o| o.set(self.0));
    }
}

/// True while the calling thread starts UCX for a link ([`Link::open`]). UCX then lists
/// every InfiniBand device libibverbs offers and opens it; in a program that runs over the
/// fabric's drop-in `libibverbs.so.1`, that device is the fabric itself, whose opening starts
/// this process's link again (endless recursion). The drop-in lists no device to such a
/// thread: a link never runs over the fabric it carries.
pub fn opening_link() -> bool {
    OPENING.with(std::cell::Cell::get)
}

static PROGRAM_UCX_ENV: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Says that this process's `UCX_*` variables are its program's, not the fabric's: the
/// drop-in `libibverbs.so.1` calls it, because a program over it may run UCX on the fabric's
/// device (`UCX_TLS=rc_verbs,… UCX_NET_DEVICES=bp_FABRIC:1`), which the process's own link to
/// other hosts cannot use. Links opened after it take `BACKPLANE_UCX_TLS` and
/// `BACKPLANE_UCX_NET_DEVICES` if set, else UCX's defaults.
pub fn ucx_env_is_the_programs() {
    PROGRAM_UCX_ENV.store(true, std::sync::atomic::Ordering::Relaxed);
}

impl Link {
    /// Opens a link, listening on `listen` if given (port 0: any free port).
    ///
    /// The first call sets UCX's address reuse and TCP segment sizes in the environment unless
    /// they are set (see `set_defaults`): make it before starting threads that read the
    /// environment from C.
    pub fn open(listen: Option<SocketAddr>) -> Result<Self, Error> {
        Self::open_with(listen, true)
    }

    /// [`Link::open`], offering UCX its shared-memory transports or not (`UCX_TLS`, when set,
    /// decides either way). A program's own link to other hosts goes without them: between
    /// hosts there is no shared memory, and between two namespaces of one machine (the
    /// tests' hosts) UCX 1.13 aborted destroying such a worker under load (an assertion on
    /// an endpoint's reference count in `ucp_worker_destroy`, 4 runs in 7 with two CPU hogs).
    pub fn open_with(listen: Option<SocketAddr>, shared_memory: bool) -> Result<Self, Error> {
        set_defaults();
        let ip = listen.map(|a| ipv4(a.ip())).transpose()?;
        let mut raw = std::ptr::null_mut();
        let _opening = Opening::begin();
        // SAFETY: ip is a valid C string or null; raw is a valid out-pointer; on failure the
        // shim frees what it made and leaves raw untouched.
        let s = unsafe {
            ffi::bpx_open(
                ip.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
                listen.map_or(0, |a| a.port()),
                std::ffi::c_int::from(!shared_memory)
                    | (std::ffi::c_int::from(
                        PROGRAM_UCX_ENV.load(std::sync::atomic::Ordering::Relaxed),
                    ) << 1),
                &mut raw,
            )
        };
        check(s, || match listen {
            Some(a) => format!("cannot listen on {a} with UCX"),
            None => "cannot start UCX".into(),
        })?;
        Ok(Self { raw })
    }

    /// The port the listener listens on (0 without one).
    pub fn listen_port(&self) -> u16 {
        // SAFETY: raw is a live link (owned by self).
        unsafe { ffi::bpx_listen_port(self.raw) as u16 }
    }

    /// The worker's wake-up file descriptor: poll it for readability, then [`Link::poll`].
    pub fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: raw is a live link; the fd belongs to its worker and lives as long as it.
        let fd: RawFd = unsafe { ffi::bpx_efd(self.raw) };
        // SAFETY: the worker's fd stays open until the link is dropped, which the borrow of
        // self prevents while the BorrowedFd lives.
        unsafe { BorrowedFd::borrow_raw(fd) }
    }

    /// Starts connecting to `addr`; a failure to connect arrives as [`Event::Failed`].
    pub fn connect(&mut self, addr: SocketAddr) -> Result<EpId, Error> {
        let ip = ipv4(addr.ip())?;
        // SAFETY: raw is live; ip is a valid C string for the call.
        let r = unsafe { ffi::bpx_connect(self.raw, ip.as_ptr(), addr.port()) };
        check(r, || format!("cannot connect to {addr} with UCX"))?;
        Ok(EpId(r))
    }

    /// Sends one message (copied; at most [`MAX_MSG`] bytes).
    pub fn send(&mut self, ep: EpId, msg: &[u8]) -> Result<(), Error> {
        self.send2(ep, &[], msg)
    }

    /// Sends one message made of `head` then `body` (copied once, into the message UCX
    /// sends; at most [`MAX_MSG`] bytes in all). `NoResource` (status -2) when too many sends
    /// are still in flight: try again after [`Link::poll`].
    pub fn send2(&mut self, ep: EpId, head: &[u8], body: &[u8]) -> Result<(), Error> {
        // SAFETY: raw is live; head and body are valid for their lengths and copied before
        // the call returns.
        let r = unsafe {
            ffi::bpx_send2(
                self.raw,
                ep.0,
                head.as_ptr().cast(),
                head.len(),
                body.as_ptr().cast(),
                body.len(),
            )
        };
        check(r, || format!("cannot send to endpoint {}", ep.0))
    }

    /// Sends one message made of `head` (copied), `body`'s bytes, which UCX reads in place
    /// (no copy: over TCP the kernel reads them from there) until the send completes, and
    /// `tail` (copied); `body` is dropped then — at once if the message went (or failed)
    /// within this call, else from the [`Link::poll`] that completes it. `NoResource`
    /// (status -2) when too many sends are in flight.
    pub fn send_zc(
        &mut self,
        ep: EpId,
        head: &[u8],
        body: Box<dyn InPlace>,
        tail: &[u8],
    ) -> Result<(), Error> {
        extern "C" fn release(token: *mut c_void) {
            // SAFETY: token is the Box::into_raw below, handed back exactly once by the shim.
            drop(unsafe { Box::from_raw(token.cast::<Box<dyn InPlace>>()) });
        }
        let (ptr, len) = body.bytes();
        let token = Box::into_raw(Box::new(body)).cast::<c_void>();
        // SAFETY: raw is live; head and tail are copied before the call returns; [ptr, ptr + len) stays
        // readable while the token lives (`InPlace`'s contract), and the shim calls `release`
        // exactly once.
        let r = unsafe {
            ffi::bpx_send_zc(
                self.raw,
                ep.0,
                head.as_ptr().cast(),
                head.len(),
                ptr.cast(),
                len,
                tail.as_ptr().cast(),
                tail.len(),
                release,
                token,
            )
        };
        check(r, || format!("cannot send to endpoint {}", ep.0))
    }

    /// `bpx_send_iov` on this link: one message of `head`, the `list`'s pieces and `tail`
    /// (head, tail and the list are copied before the call returns; the pieces are read in
    /// place). `release(token)` is called exactly once: at once if the message is refused,
    /// else when UCX lets go of the pieces.
    ///
    /// # Safety
    ///
    /// The pieces' bytes stay readable and unchanged until `release` is called.
    unsafe fn send_iov(
        &mut self,
        ep: EpId,
        (head, list, tail): (&[u8], &[ffi::Piece], &[u8]),
        release: extern "C" fn(*mut c_void),
        token: *mut c_void,
    ) -> Result<(), Error> {
        // SAFETY: raw is live; head, tail and the list are copied before the call returns;
        // the pieces are the caller's promise.
        let r = unsafe {
            ffi::bpx_send_iov(
                self.raw,
                ep.0,
                head.as_ptr().cast(),
                head.len(),
                list.as_ptr(),
                list.len(),
                tail.as_ptr().cast(),
                tail.len(),
                release,
                token,
            )
        };
        check(r, || format!("cannot send to endpoint {}", ep.0))
    }

    /// As [`Link::send_zc`] with the message's middle made of `pieces` (at most
    /// [`MAX_PIECES`]; within [`TCP_MAX_IOV`] less UCX's, `head` and `tail`, one `sendmsg`
    /// over TCP), which UCX reads where they are until it lets go of them (then they are
    /// dropped). Refused at once, the pieces come back with the error; `NoResource` (status
    /// -2) when too many sends are in flight.
    pub fn send_pieces(
        &mut self,
        ep: EpId,
        head: &[u8],
        pieces: Vec<MsgPiece>,
        tail: &[u8],
    ) -> Result<(), (Error, Vec<MsgPiece>)> {
        extern "C" fn release(token: *mut c_void) {
            // SAFETY: token is the Arc::into_raw below, handed back exactly once by the shim.
            drop(unsafe {
                std::sync::Arc::from_raw(
                    token.cast_const().cast::<std::sync::Mutex<Vec<MsgPiece>>>(),
                )
            });
        }
        if pieces.len() > MAX_PIECES {
            let e = Error {
                status: -5, // UCS_ERR_INVALID_PARAM
                what: format!(
                    "{} pieces in one message (at most {MAX_PIECES})",
                    pieces.len()
                ),
            };
            return Err((e, pieces));
        }
        // (A mutex only to make the shared list `Sync`: the shim may drop its reference on
        // another thread.)
        let pieces = std::sync::Arc::new(std::sync::Mutex::new(pieces));
        let list: Vec<ffi::Piece> = pieces
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|p| {
                let (buf, len) = p.range();
                ffi::Piece {
                    buf: buf.cast(),
                    len,
                }
            })
            .collect();
        let token = std::sync::Arc::into_raw(pieces.clone())
            .cast_mut()
            .cast::<c_void>();
        // SAFETY: the pieces' bytes stay readable and unchanged while the token's reference
        // lives (the Vec is shared, never changed: `InPlace`'s contract for lent ones, owned
        // buffers' heap bytes for the others), which `release` drops.
        let r = unsafe { self.send_iov(ep, (head, &list, tail), release, token) };
        r.map_err(|e| {
            let back = std::sync::Arc::try_unwrap(pieces)
                .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()))
                .unwrap_or_default();
            (e, back)
        })
    }

    /// Sends one message made of `head` (copied) then `pieces` — at most [`MAX_PIECES`] —
    /// which UCX reads in place from the caller's memory (over TCP the kernel copies them
    /// from there into the socket: one `sendmsg` for the lot, up to UCX's `TCP_MAX_IOV`
    /// pieces), and returns only once UCX let go of them: when the message left (the kernel
    /// took every byte) or failed. Until then it progresses the link and calls `meanwhile`
    /// after each progress (with the link, whose events it may collect); once `meanwhile`
    /// returns false the endpoint is closed (forced: UCX then completes the send with an
    /// error) and the call still waits for UCX to let go. The pieces are free again on
    /// return, whatever happened: a send that must not leave the caller's buffers lent (a
    /// non-blocking one) copies instead ([`Link::send2`]). `NoResource` (status -2) when too
    /// many sends are in flight.
    pub fn send_lent(
        &mut self,
        ep: EpId,
        (head, pieces): (&[u8], &[&[u8]]),
        mut meanwhile: impl FnMut(&mut Link) -> bool,
    ) -> Result<(), Error> {
        extern "C" fn release(token: *mut c_void) {
            // SAFETY: token is the Arc::into_raw below, handed back exactly once by the shim.
            let done = unsafe { std::sync::Arc::from_raw(token.cast::<AtomicBool>()) };
            done.store(true, Ordering::Release);
        }
        /// Aborts the process if unwinding would leave `send_lent` while UCX still reads the
        /// caller's bytes (a panic in `meanwhile`): memory in use by UCX cannot be handed back.
        struct Wait<'a>(&'a AtomicBool);
        impl Drop for Wait<'_> {
            fn drop(&mut self) {
                if !self.0.load(Ordering::Acquire) {
                    eprintln!(
                        "backplane-ucx: unwinding out of a send whose buffer UCX still reads"
                    );
                    std::process::abort();
                }
            }
        }
        if pieces.len() > MAX_PIECES {
            return Err(Error {
                status: -5, // UCS_ERR_INVALID_PARAM
                what: format!(
                    "{} pieces in one message (at most {MAX_PIECES})",
                    pieces.len()
                ),
            });
        }
        // Pieces that lie back to back in memory (a frame cut into datagrams) go as one iov.
        let mut list: Vec<ffi::Piece> = Vec::with_capacity(pieces.len());
        for (i, p) in pieces.iter().enumerate() {
            match list.last_mut() {
                Some(l) if back_to_back(pieces[i - 1], p) => l.len += p.len(),
                _ => list.push(ffi::Piece {
                    buf: p.as_ptr().cast(),
                    len: p.len(),
                }),
            }
        }
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let token = std::sync::Arc::into_raw(done.clone())
            .cast_mut()
            .cast::<c_void>();
        // SAFETY: the pieces stay readable and unchanged until `release` sets `done` (this
        // function does not return nor unwind before: `Wait`).
        let r = unsafe { self.send_iov(ep, (head, &list, &[]), release, token) };
        // (On an error the shim released it already: nothing to wait for.)
        r?;
        let wait = Wait(&done);
        let mut closed = false;
        while !done.load(Ordering::Acquire) {
            // SAFETY: raw is live; progress runs the callbacks (the release) on this thread.
            unsafe { ffi::bpx_progress(self.raw) };
            if done.load(Ordering::Acquire) {
                break;
            }
            if !meanwhile(self) && !closed {
                self.close(ep);
                closed = true;
            }
        }
        drop(wait);
        Ok(())
    }

    /// Sends one message of at most `len` bytes written in place by `fill`, which returns how
    /// many it wrote (`None`: send nothing). Saves the copy [`Link::send2`] makes of a body
    /// that is read from elsewhere anyway (a ring in shared memory). `Ok(false)` when `fill`
    /// declined; `NoResource` (status -2, `fill` not called) when too many sends are in
    /// flight: try again after [`Link::poll`].
    pub fn send_with(
        &mut self,
        ep: EpId,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<bool, Error> {
        let mut status = 0;
        // SAFETY: raw is live; status is a valid out-pointer.
        let p = unsafe { ffi::bpx_send_alloc(self.raw, ep.0, len, &mut status) };
        if p.is_null() {
            return Err(Error {
                status: status.min(-1),
                what: format!("cannot send to endpoint {}", ep.0),
            });
        }
        // SAFETY: p is a fresh malloc'ed block of at least len bytes (max(len, 1)) that only
        // this function refers to until it is handed back to the shim below.
        let buf = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) };
        // (A panic in fill leaks the block: no unwinding through the shim.)
        match fill(buf).filter(|&n| n <= len) {
            None => {
                // SAFETY: p came from bpx_send_alloc and is not used again.
                unsafe { ffi::bpx_send_cancel(p) };
                Ok(false)
            }
            Some(n) => {
                // SAFETY: raw is live; p came from bpx_send_alloc, holds n written bytes, and
                // the shim owns it from here.
                let r = unsafe { ffi::bpx_send_ready(self.raw, ep.0, p, n) };
                check(r, || format!("cannot send to endpoint {}", ep.0))?;
                Ok(true)
            }
        }
    }

    /// Makes progress and returns what happened. If it returns nothing and [`Link::arm`]
    /// returns true, it is safe to wait on [`Link::fd`].
    pub fn poll(&mut self) -> Vec<Event> {
        // Bounded: under a steady stream progress never runs dry, and the caller has other
        // work (its own sends) between polls.
        for _ in 0..64 {
            // SAFETY: raw is live; progress runs the callbacks on this thread.
            if unsafe { ffi::bpx_look(self.raw) } == 0 {
                break;
            }
        }
        self.events()
    }

    /// [`Link::poll`] for a latency-bound caller: stops progressing as soon as something
    /// happened (over TCP each progress is a system call: the one that would find nothing
    /// more costs a round trip its time). The events are appended to `out` (a caller that
    /// polls in a loop keeps one vector instead of allocating one per arrival).
    pub fn poll_some_into(&mut self, out: &mut Vec<Event>) {
        for _ in 0..64 {
            // SAFETY: raw is live; progress runs the callbacks on this thread.
            let n = unsafe { ffi::bpx_look(self.raw) };
            // SAFETY: raw is live; the call only reads a counter.
            if n == 0 || unsafe { ffi::bpx_queued(self.raw) } != 0 {
                break;
            }
        }
        self.events_into(out);
    }

    /// [`Link::poll_some_into`], offering each message that comes while no event waits to
    /// `deliver` first, in place in UCX's receive buffer (sender's endpoint, bytes): one it
    /// takes (returns true) is neither copied nor queued — a receiver that reads messages in
    /// order saves a copy of each. Messages after one it declined are queued (so `out`
    /// keeps their order). Stops once something happened, as `poll_some_into`.
    pub fn poll_some_with(
        &mut self,
        out: &mut Vec<Event>,
        deliver: &mut dyn FnMut(Option<EpId>, &[u8]) -> bool,
    ) {
        struct Ctx<'a> {
            deliver: &'a mut dyn FnMut(Option<EpId>, &[u8]) -> bool,
            took: bool,
        }
        extern "C" fn offer(
            ctx: *mut c_void,
            from: c_int,
            data: *const c_void,
            len: usize,
        ) -> c_int {
            // SAFETY: `ctx` is the `Ctx` below, live and not otherwise borrowed for the whole
            // progress call that runs this callback (on this thread).
            let c = unsafe { &mut *ctx.cast::<Ctx<'_>>() };
            let bytes = if data.is_null() || len == 0 {
                &[][..]
            } else {
                // SAFETY: UCX passes its receive buffer, `len` bytes valid for the callback.
                unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }
            };
            let from = (from >= 0).then_some(EpId(from));
            // (No unwinding into C: a panic declines, and the message is queued instead.)
            let took =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (c.deliver)(from, bytes)))
                    .unwrap_or(false);
            c.took |= took;
            c_int::from(took)
        }
        let mut ctx = Ctx {
            deliver,
            took: false,
        };
        for _ in 0..64 {
            // SAFETY: raw is live; `offer` gets `ctx` only during this call, on this thread.
            let n =
                unsafe { ffi::bpx_progress_with(self.raw, offer, (&raw mut ctx).cast::<c_void>()) };
            // SAFETY: raw is live; the call only reads a counter.
            if n == 0 || ctx.took || unsafe { ffi::bpx_queued(self.raw) } != 0 {
                break;
            }
        }
        self.events_into(out);
    }

    /// The events queued so far.
    fn events(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        self.events_into(&mut out);
        out
    }

    /// [`Link::events`], appended to `out`.
    fn events_into(&mut self, out: &mut Vec<Event>) {
        loop {
            let mut ev = ffi::Event {
                kind: 0,
                ep: -1,
                status: 0,
                len: 0,
                data: std::ptr::null_mut(),
            };
            // SAFETY: raw is live; ev is a valid out-pointer.
            if unsafe { ffi::bpx_next_event(self.raw, &mut ev) } == 0 {
                break;
            }
            let ep = (ev.ep >= 0).then_some(EpId(ev.ep));
            // The shim malloc'ed ev.len bytes at ev.data (or null) for this event and hands
            // them over: Bytes owns and frees them.
            let data = Bytes {
                ptr: ev.data.cast(),
                len: if ev.data.is_null() { 0 } else { ev.len },
            };
            match (ev.kind, ep) {
                (ffi::EV_ACCEPTED, Some(e)) => out.push(Event::Accepted(e)),
                (ffi::EV_MESSAGE, from) => out.push(Event::Message(from, data)),
                (ffi::EV_FAILED, Some(e)) => out.push(Event::Failed(
                    e,
                    Error {
                        status: ev.status,
                        what: format!("endpoint {}", e.0),
                    },
                )),
                (ffi::EV_DROPPED, from) => out.push(Event::Dropped(from, ev.len)),
                _ => {} // an event of an endpoint closed since
            }
        }
    }

    /// Bytes of messages handed to UCX that it has not sent yet (they go out as the link is
    /// polled): what a sender holds against its peer's pace.
    pub fn in_flight_bytes(&self) -> usize {
        // SAFETY: raw is live; the call only reads a counter.
        unsafe { ffi::bpx_inflight_bytes(self.raw) }
    }

    /// Whether everything sent has left the worker. A message counts as sent (and leaves
    /// [`Link::in_flight_bytes`]) once UCX copied it, possibly into a transport's buffer it has
    /// not written out yet; only this says that nothing is left to progress.
    pub fn idle(&mut self) -> bool {
        // SAFETY: raw is live; the flush request the shim may make is released by UCX.
        unsafe { ffi::bpx_idle(self.raw) != 0 }
    }

    /// Arms the wake-up fd: true if it is safe to sleep on [`Link::fd`] now.
    pub fn arm(&mut self) -> bool {
        // SAFETY: raw is live.
        unsafe { ffi::bpx_arm(self.raw) != 0 }
    }

    /// Closes an endpoint at once (its outstanding sends are cancelled).
    pub fn close(&mut self, ep: EpId) {
        // SAFETY: raw is live; the shim ignores indexes that are not open.
        unsafe { ffi::bpx_close(self.raw, ep.0) }
    }

    /// Closes an endpoint once what was sent on it has left, telling the peer after the data,
    /// for at most `timeout`: true if it closed in time. (A forced close, [`Link::close`],
    /// can reach the peer before the last bytes sent, which it then never reads.) One that
    /// did not close in time leaves the link's UCX worker allocated until the process ends:
    /// UCX 1.13 aborts destroying a worker under a half-closed endpoint.
    pub fn close_flush(&mut self, ep: EpId, timeout: std::time::Duration) -> bool {
        let us = timeout.as_micros().min(i64::MAX as u128) as std::ffi::c_long;
        // SAFETY: raw is live; the shim ignores indexes that are not open; progress runs the
        // callbacks on this thread.
        unsafe { ffi::bpx_close_flush(self.raw, ep.0, us) != 0 }
    }

    /// Closes every endpoint at once and forgets every event not taken: the link as freshly
    /// opened (its listener stays), for another user.
    pub fn reset(&mut self) {
        // SAFETY: raw is live; the shim closes only open endpoints and frees the events' data
        // it still owns.
        unsafe { ffi::bpx_reset(self.raw) }
    }

    /// The transports UCX chose for an endpoint, as `tl/device` (e.g. `tcp/veth0`,
    /// `rc_mlx5/mlx5_0:1`, `posix/memory`), once it is connected; empty before.
    pub fn transports(&mut self, ep: EpId) -> Vec<String> {
        let mut buf = vec![0u8; 8192];
        // SAFETY: raw is live; buf is writable for its length; the shim NUL-terminates.
        let n = unsafe { ffi::bpx_ep_info(self.raw, ep.0, buf.as_mut_ptr().cast(), buf.len()) };
        parse_lanes(&String::from_utf8_lossy(&buf[..n]))
    }
}

/// The `tl/device` of each lane in `ucp_ep_print_info`'s text, without repeats: lines such as
/// `#                 lane[0]:  1:tcp/vethA.0 md[1]  -> md[1]/tcp/sysdev[255] rma_bw#0 am`.
pub fn parse_lanes(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.split("lane[").nth(1) else {
            continue;
        };
        let Some(tok) = rest.split_whitespace().nth(1) else {
            continue;
        };
        // "1:tcp/vethA.0" → "tcp/vethA"
        let tl = tok.split_once(':').map_or(tok, |(_, t)| t);
        let tl = tl.rsplit_once('.').map_or(tl, |(a, b)| {
            if b.bytes().all(|c| c.is_ascii_digit()) {
                a
            } else {
                tl
            }
        });
        // Lanes without a device (the connection manager, `cm`) carry no data.
        if tl.contains('/') && !out.iter().any(|x| x == tl) {
            out.push(tl.to_owned());
        }
    }
    out
}

impl Drop for Link {
    fn drop(&mut self) {
        // SAFETY: raw is live and owned; it is not used after this.
        unsafe { ffi::bpx_close_all(self.raw) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// The tests open links from several threads: one at a time (see [`Link::open`]).
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
        LOCK.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[test]
    fn lanes_are_read_from_ucps_own_description() {
        let text = "#\n# UCP endpoint\n#\n#               peer: <no debug data>\n\
                    #                 lane[0]:  1:tcp/vethA.0 md[1]          -> md[1]/tcp/sysdev[255] rma_bw#0 am am_bw#0\n\
                    #                 lane[1]:  3:tcp/vethA.0 md[1]          -> md[1]/tcp/sysdev[255] am_bw#1\n\
                    #                 lane[2]:  0:posix/memory.0 md[0]        -> md[0]/posix am\n\
                    #                 lane[3]:  cm\n";
        assert_eq!(parse_lanes(text), vec!["tcp/vethA", "posix/memory"]);
        assert!(parse_lanes("nothing here").is_empty());
    }

    /// Whether the shim sends an endpoint's small messages in one buffer: only when its
    /// active-message lane (the one used for "am") is TCP.
    #[test]
    fn small_messages_go_in_one_buffer_only_over_a_tcp_am_lane() {
        fn am_tcp(text: &str) -> bool {
            let mut b = std::ffi::CString::new(text).unwrap().into_bytes_with_nul();
            // SAFETY: b is a writable NUL-terminated buffer the call only cuts into lines.
            unsafe { ffi::bpx_text_am_lane_is_tcp(b.as_mut_ptr().cast()) != 0 }
        }
        let tcp = "#\n# UCP endpoint\n#\n\
                   #                 lane[0]:  1:tcp/vethA.0 md[1]          -> md[1]/tcp/sysdev[255] rma_bw#0 am am_bw#0\n\
                   #                 lane[1]:  3:tcp/vethA.0 md[1]          -> md[1]/tcp/sysdev[255] am_bw#1\n";
        assert!(am_tcp(tcp));
        let shm = "#                 lane[0]:  1:tcp/vethA.0 md[1]          -> md[1]/tcp/sysdev[255] rma_bw#0 am_bw#0\n\
                   #                 lane[1]:  0:posix/memory.0 md[0]        -> md[0]/posix am\n\
                   #                 lane[2]:  cm\n";
        assert!(!am_tcp(shm));
        let rc = "#                 lane[0]:  5:rc_verbs/bp_x:1.0 md[3]  -> md[3]/ib/sysdev[255] rma_bw#0 am am_bw#0\n";
        assert!(!am_tcp(rc));
        assert!(!am_tcp(""));
        assert!(!am_tcp("lane[0]: tcp/x -> am"));
    }

    fn until<T>(l: &mut Link, what: &str, mut f: impl FnMut(Event) -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            for e in l.poll() {
                if let Some(t) = f(e) {
                    return t;
                }
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn two_links_exchange_messages_and_see_each_other_fail() {
        let _one = serial();
        let mut server = Link::open(Some("127.0.0.1:0".parse().unwrap())).unwrap();
        let port = server.listen_port();
        assert_ne!(port, 0);
        let mut client = Link::open(None).unwrap();
        let ep = client
            .connect(SocketAddr::from(([127, 0, 0, 1], port)))
            .unwrap();
        client.send(ep, b"hello").unwrap();
        // Drive both from one thread: the client's progress is what sends.
        let (from, msg) = {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let _ = client.poll();
                let got = server.poll().into_iter().find_map(|e| match e {
                    Event::Message(f, m) => Some((f, m)),
                    _ => None,
                });
                if let Some(g) = got {
                    break g;
                }
                assert!(Instant::now() < deadline, "no message");
            }
        };
        assert_eq!(&*msg, b"hello");
        let back = from.expect("the reply endpoint is the accepted one");
        server.send2(back, &[7u8; 1000], &[7u8; 2000]).unwrap();
        let reply = until(&mut client, "the reply", |e| match e {
            Event::Message(Some(f), m) if f == ep => Some(m.to_vec()),
            _ => None,
        });
        assert_eq!(reply, vec![7u8; 3000]);
        // Written in place: a declined fill sends nothing, a short one only what it wrote,
        // and a message too large is refused before the fill is asked.
        assert_eq!(server.send_with(back, 64, |_| None), Ok(false));
        let filled = server.send_with(back, 4096, |b| {
            b[..5].copy_from_slice(b"fresh");
            Some(5)
        });
        assert_eq!(filled, Ok(true));
        let next = until(&mut client, "the message written in place", |e| match e {
            Event::Message(Some(f), m) if f == ep => Some(m.to_vec()),
            _ => None,
        });
        assert_eq!(
            next, b"fresh",
            "the declined fill sent nothing, the short one 5 bytes"
        );
        let huge = server.send_with(back, MAX_MSG + 1, |_| panic!("asked to fill"));
        assert!(huge.unwrap_err().to_string().contains("cannot send"));
        assert!(!client.transports(ep).is_empty());
        let too_big = client.send(ep, &vec![0u8; MAX_MSG + 1]).unwrap_err();
        assert!(too_big.to_string().contains("cannot send"), "{too_big}");
        // The server goes away: the client's endpoint fails.
        drop(server);
        let failed = until(&mut client, "the failure", |e| match e {
            Event::Failed(f, err) if f == ep => Some(err),
            _ => None,
        });
        assert!(failed.status < 0);
        client.close(ep);
    }

    #[test]
    fn a_port_in_use_and_a_v6_address_are_refused_in_one_line() {
        let _one = serial();
        let a = Link::open(Some("127.0.0.1:0".parse().unwrap())).unwrap();
        let taken = SocketAddr::from(([127, 0, 0, 1], a.listen_port()));
        let e = Link::open(Some(taken)).err().expect("port in use");
        assert!(
            e.to_string().starts_with("cannot listen on 127.0.0.1:"),
            "{e}"
        );
        assert!(!e.to_string().contains('\n'));
        let e = Link::open(Some("[::1]:0".parse().unwrap())).err().unwrap();
        assert!(e.to_string().contains("only IPv4"), "{e}");
    }
}
