//! Socket acceleration: `libbackplane_sockets.so`, loaded into unmodified programs through
//! `LD_PRELOAD` by `backplane exec --accel NODE -- CMD`.
//!
//! A TCP connection between two fabric nodes is made by the kernel, over `bp0`, exactly as
//! without the library (ports, `accept`, addresses, errors are the kernel's). When both ends
//! run with the library, they agree out of band (see the `setup` module) to carry the byte stream on a
//! pair of shared-memory rings instead (see the `conn` and `seg` modules); the kernel's connection stays
//! open beside it for the socket's options and names and to tell when the peer is gone. Any
//! other descriptor, and any connection that does not agree, passes straight to the kernel.
//!
//! The library exports the socket and descriptor calls a program makes (`read`, `send`,
//! `close`, `dup2`, `fcntl` …). For a descriptor that is not an accelerated connection each is
//! one table look-up and the system call itself (the `sys` module: no `dlsym`, no recursion, nothing
//! that needs libc to be initialised). `poll`, `select` and `epoll` are not wrapped at all:
//! an accelerated descriptor is a real socket whose readiness the library keeps true.

#![allow(clippy::missing_safety_doc)] // the exported functions are libc's, documented there.

mod config;
mod conn;
mod seg;
mod setup;
mod sys;
mod wait;

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicUsize, Ordering};
use std::sync::Mutex;

use libc::{c_char, c_int, c_ulong, c_void, iovec, size_t, sockaddr, socklen_t, ssize_t};

use conn::{Bufs, Conn};

/// Descriptors the table covers; a connection on a higher number stays the kernel's.
pub const MAX_FD: usize = 1 << 16;

static TABLE: [AtomicPtr<Conn>; MAX_FD] = [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_FD];
static HIDDEN: [AtomicBool; MAX_FD] = [const { AtomicBool::new(false) }; MAX_FD];
/// One more than the highest descriptor that ever held a connection: walks of the table stop
/// there.
static TOP: AtomicUsize = AtomicUsize::new(0);

/// Puts `c` at table slot `fd` (in range).
fn put(fd: c_int, c: &'static Conn) {
    if let Some((i, s)) = usize::try_from(fd)
        .ok()
        .and_then(|i| Some((i, TABLE.get(i)?)))
    {
        TOP.fetch_max(i + 1, Ordering::AcqRel);
        s.store(c as *const Conn as *mut Conn, Ordering::Release);
    }
}

/// Listening sockets we registered: (descriptor, hidden lock file descriptor).
static LISTENERS: Mutex<Vec<(c_int, c_int)>> = Mutex::new(Vec::new());

fn conn_of(fd: c_int) -> Option<&'static Conn> {
    let p = TABLE
        .get(usize::try_from(fd).ok()?)?
        .load(Ordering::Acquire);
    // SAFETY: table entries point at leaked, never-freed connections.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// True when `fd` can hold a connection (in range, none there yet).
pub fn slot_free(fd: c_int) -> bool {
    usize::try_from(fd)
        .ok()
        .and_then(|i| TABLE.get(i))
        .is_some_and(|s| s.load(Ordering::Acquire).is_null())
}

/// Marks `fd` as one of the library's own descriptors (or not any more).
pub fn mark_hidden(fd: c_int, on: bool) {
    if let Some(h) = usize::try_from(fd).ok().and_then(|i| HIDDEN.get(i)) {
        h.store(on, Ordering::Release);
    }
}

fn is_hidden(fd: c_int) -> bool {
    usize::try_from(fd)
        .ok()
        .and_then(|i| HIDDEN.get(i))
        .is_some_and(|h| h.load(Ordering::Acquire))
}

/// Puts a new connection at the program's descriptor `fd` and starts watching it.
pub fn install(fd: c_int, c: &'static Conn) {
    put(fd, c);
    helper::watch(c);
}

/// True in a child that shares our memory (`vfork`, `posix_spawn`'s clone): the
/// library's state is the parent's and must not change; descriptor calls go to the kernel.
fn shares_parent_memory() -> bool {
    sys::getpid() != my_pid()
}

/// One more program descriptor names `c`.
fn add_ref(fd: c_int, c: &'static Conn) {
    if shares_parent_memory() {
        return;
    }
    c.refs.fetch_add(1, Ordering::AcqRel);
    put(fd, c);
}

/// Descriptor `fd` no longer names what it named: drop the connection's reference (ending it
/// on the last) and a listener's registration.
fn forget(fd: c_int) {
    if let Some(s) = usize::try_from(fd).ok().and_then(|i| TABLE.get(i)) {
        if !s.load(Ordering::Acquire).is_null() && shares_parent_memory() {
            return;
        }
        let p = s.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if !p.is_null() {
            // SAFETY: table entries point at leaked, never-freed connections.
            let c = unsafe { &*p };
            if c.refs.fetch_sub(1, Ordering::AcqRel) == 1 {
                c.end();
            }
        }
    }
    wait::forget(fd);
    let mut l = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = l.iter().position(|&(f, _)| f == fd) {
        let (_, lock) = l.swap_remove(i);
        setup::close_hidden(lock);
    }
}

fn iov1(buf: *const c_void, len: usize) -> [iovec; 1] {
    [iovec {
        iov_base: buf as *mut c_void,
        iov_len: len,
    }]
}

fn iov_slice<'a>(iov: *const iovec, cnt: c_int) -> Result<&'a [iovec], c_int> {
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) {
        return Err(libc::EINVAL);
    }
    if cnt == 0 {
        return Ok(&[]);
    }
    if iov.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: the caller passed cnt iovecs at iov (as readv/writev require).
    Ok(unsafe { std::slice::from_raw_parts(iov, cnt as usize) })
}

fn recv_on(c: &Conn, iov: &[iovec], flags: c_int) -> ssize_t {
    // SAFETY: the iovecs are the caller's buffers, valid for writing (as recv requires).
    let b = unsafe { Bufs::new(iov) };
    sys::to_c(c.recv(&b, flags))
}

fn send_on(c: &Conn, iov: &[iovec], flags: c_int) -> ssize_t {
    // SAFETY: the iovecs are the caller's buffers, valid for reading (as send requires).
    let b = unsafe { Bufs::new(iov) };
    sys::to_c(c.send(&b, iov, flags))
}

// ---- data calls ----

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    match conn_of(fd) {
        Some(c) => recv_on(c, &iov1(buf, n), 0),
        None => sys::to_c(sys::read(fd, buf, n)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: the fortify failure handler (as glibc's own __read_chk calls).
        unsafe { __chk_fail() };
    }
    // SAFETY: as read.
    unsafe { read(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    match conn_of(fd) {
        Some(c) => send_on(c, &iov1(buf, n), 0),
        None => sys::to_c(sys::write(fd, buf, n)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match conn_of(fd) {
        Some(c) => match iov_slice(iov, cnt) {
            Ok(v) => recv_on(c, v, 0),
            Err(e) => sys::to_c(Err(e)),
        },
        None => sys::to_c(sys::readv(fd, iov, cnt)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    match conn_of(fd) {
        Some(c) => match iov_slice(iov, cnt) {
            Ok(v) => send_on(c, v, 0),
            Err(e) => sys::to_c(Err(e)),
        },
        None => sys::to_c(sys::writev(fd, iov, cnt)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    match conn_of(fd) {
        Some(c) => recv_on(c, &iov1(buf, n), flags),
        None => sys::to_c(sys::recvfrom(
            fd,
            buf,
            n,
            flags,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )),
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if n > buflen {
        // SAFETY: the fortify failure handler.
        unsafe { __chk_fail() };
    }
    // SAFETY: as recv.
    unsafe { recv(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    match conn_of(fd) {
        Some(c) => {
            if !addr.is_null() && !alen.is_null() {
                // A connected TCP socket reports no address (as Linux does).
                // SAFETY: alen is the caller's, valid when non-null.
                unsafe { *alen = 0 };
            }
            recv_on(c, &iov1(buf, n), flags)
        }
        None => sys::to_c(sys::recvfrom(fd, buf, n, flags, addr, alen)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: the fortify failure handler.
        unsafe { __chk_fail() };
    }
    // SAFETY: as recvfrom.
    unsafe { recvfrom(fd, buf, n, flags, addr, alen) }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    match conn_of(fd) {
        Some(c) => send_on(c, &iov1(buf, n), flags),
        None => sys::to_c(sys::sendto(fd, buf, n, flags, std::ptr::null(), 0)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    match conn_of(fd) {
        // A connected TCP socket ignores the address (as Linux does).
        Some(c) => send_on(c, &iov1(buf, n), flags),
        None => sys::to_c(sys::sendto(fd, buf, n, flags, addr, alen)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> ssize_t {
    match conn_of(fd) {
        Some(c) => {
            if msg.is_null() {
                return sys::to_c(Err(libc::EFAULT));
            }
            // SAFETY: msg is the caller's msghdr, valid when non-null.
            let m = unsafe { &mut *msg };
            let cnt = c_int::try_from(m.msg_iovlen).unwrap_or(-1);
            let r = match iov_slice(m.msg_iov, cnt) {
                Ok(v) => recv_on(c, v, flags),
                Err(e) => return sys::to_c(Err(e)),
            };
            if r >= 0 {
                m.msg_namelen = 0;
                m.msg_controllen = 0;
                m.msg_flags = 0;
            }
            r
        }
        None => sys::to_c(sys::recvmsg(fd, msg, flags)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> ssize_t {
    match conn_of(fd) {
        Some(c) => {
            if msg.is_null() {
                return sys::to_c(Err(libc::EFAULT));
            }
            // SAFETY: msg is the caller's msghdr, valid when non-null.
            let m = unsafe { &*msg };
            let cnt = c_int::try_from(m.msg_iovlen).unwrap_or(-1);
            match iov_slice(m.msg_iov, cnt) {
                Ok(v) => send_on(c, v, flags),
                Err(e) => sys::to_c(Err(e)),
            }
        }
        None => sys::to_c(sys::sendmsg(fd, msg, flags)),
    }
}

// ---- connection set-up ----

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, alen: socklen_t) -> c_int {
    if conn_of(fd).is_some() {
        return sys::to_c(Err(libc::EISCONN)) as c_int;
    }
    // SAFETY: addr valid for alen (the caller's, as connect requires).
    unsafe { setup::connect(fd, addr, alen) as c_int }
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
    flags: c_int,
) -> c_int {
    if conn_of(fd).is_some() {
        return sys::to_c(Err(libc::EINVAL)) as c_int;
    }
    // SAFETY: as accept4(2), the caller's pointers.
    unsafe { setup::accept(fd, addr, alen, flags) as c_int }
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, alen: *mut socklen_t) -> c_int {
    // SAFETY: as accept4.
    unsafe { accept4(fd, addr, alen, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    let known = LISTENERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|&(f, _)| f == fd);
    // Registered before the kernel listens, so that no client can connect without seeing the
    // registration (it would stay on TCP); a socket not bound yet gets its port from listen.
    let mut lock = if known {
        None
    } else {
        setup::register_listener(fd)
    };
    if let Err(e) = sys::listen(fd, backlog) {
        if let Some(l) = lock {
            setup::close_hidden(l);
        }
        return sys::to_c(Err(e)) as c_int;
    }
    if !known && lock.is_none() {
        lock = setup::register_listener(fd);
    }
    if let Some(lock) = lock {
        LISTENERS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((fd, lock));
    }
    0
}

// ---- waiting: spin on the rings before the kernel sleep ----

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    // SAFETY: the caller's arguments, as poll(2).
    unsafe { wait::poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    if (fdslen / std::mem::size_of::<libc::pollfd>()) < n as usize {
        // SAFETY: the fortify failure handler.
        unsafe { __chk_fail() };
    }
    // SAFETY: as poll.
    unsafe { wait::poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    tmo: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the caller's arguments, as ppoll(2).
    unsafe { wait::ppoll(fds, n, tmo, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    tmo: *const libc::timespec,
    mask: *const libc::sigset_t,
    fdslen: size_t,
) -> c_int {
    if (fdslen / std::mem::size_of::<libc::pollfd>()) < n as usize {
        // SAFETY: the fortify failure handler.
        unsafe { __chk_fail() };
    }
    // SAFETY: as ppoll.
    unsafe { wait::ppoll(fds, n, tmo, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tmo: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the caller's arguments, as pselect(2).
    unsafe { wait::pselect(nfds, r, w, e, tmo, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    // SAFETY: the caller's arguments, as select(2).
    unsafe { wait::select(nfds, r, w, e, tv) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    ep: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    let r = sys::epoll_ctl(ep, op, fd, ev);
    if r.is_ok() {
        wait::epoll_ctl(ep, op, fd, ev);
    }
    sys::to_c(r) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    ep: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    // SAFETY: the caller's arguments, as epoll_wait(2).
    unsafe { wait::epoll_wait(ep, evs, max, timeout, std::ptr::null()) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    ep: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the caller's arguments, as epoll_pwait(2).
    unsafe { wait::epoll_wait(ep, evs, max, timeout, sigmask) }
}

// ---- descriptors ----

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if is_hidden(fd) {
        // Not the program's: it never got this number from us.
        return sys::to_c(Err(libc::EBADF)) as c_int;
    }
    forget(fd);
    sys::to_c(sys::close(fd)) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn close_range(first: u32, last: u32, flags: c_int) -> c_int {
    if flags & libc::CLOSE_RANGE_CLOEXEC as c_int != 0 {
        return sys::to_c(sys::close_range(first, last, flags as u32)) as c_int;
    }
    if first > last {
        return sys::to_c(Err(libc::EINVAL)) as c_int;
    }
    let top = (last as usize).min(MAX_FD - 1);
    let mut start = first as usize;
    let mut i = first as usize;
    // Close the program's descriptors in runs that skip the library's own.
    while i <= top {
        if HIDDEN[i].load(Ordering::Acquire) {
            if start < i {
                close_run(start, i - 1, flags);
            }
            start = i + 1;
        }
        i += 1;
    }
    if start <= top {
        close_run(start, top, flags);
    }
    if last as usize >= MAX_FD {
        let from = (MAX_FD as u32).max(first);
        return sys::to_c(sys::close_range(from, last, flags as u32)) as c_int;
    }
    0
}

fn close_run(a: usize, b: usize, flags: c_int) {
    for (fd, slot) in TABLE.iter().enumerate().take(b + 1).skip(a) {
        if !slot.load(Ordering::Acquire).is_null() {
            forget(fd as c_int);
        }
    }
    {
        let l = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
        let hit: Vec<c_int> = l
            .iter()
            .map(|&(f, _)| f)
            .filter(|&f| (a..=b).contains(&(f as usize)))
            .collect();
        drop(l);
        for f in hit {
            forget(f);
        }
    }
    let _ = sys::close_range(a as u32, b as u32, flags as u32);
}

#[no_mangle]
pub unsafe extern "C" fn closefrom(low: c_int) {
    // SAFETY: close_range has no pointer arguments.
    unsafe { close_range(low.max(0) as u32, u32::MAX, 0) };
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    match conn_of(fd) {
        Some(c) => sys::to_c(c.shutdown(how)) as c_int,
        None => sys::to_c(sys::shutdown(fd, how)) as c_int,
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    if is_hidden(fd) {
        return sys::to_c(Err(libc::EBADF)) as c_int;
    }
    let r = sys::dup(fd);
    if let (Ok(n), Some(c)) = (r, conn_of(fd)) {
        add_ref(n as c_int, c);
    }
    sys::to_c(r) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    if is_hidden(old) || is_hidden(new) {
        return sys::to_c(Err(libc::EBADF)) as c_int;
    }
    if old == new {
        return sys::to_c(Err(libc::EINVAL)) as c_int;
    }
    let r = sys::dup3(old, new, flags);
    if r.is_ok() {
        forget(new);
        if let Some(c) = conn_of(old) {
            add_ref(new, c);
        }
    }
    sys::to_c(r) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    if old == new {
        if is_hidden(old) {
            return sys::to_c(Err(libc::EBADF)) as c_int;
        }
        return match sys::fcntl(old, libc::F_GETFD, 0) {
            Ok(_) => new,
            Err(e) => sys::to_c(Err(e)) as c_int,
        };
    }
    // SAFETY: no pointers.
    unsafe { dup3(old, new, 0) }
}

/// `F_SETOWN_EX` (Linux; not in the libc crate for every target).
const F_SETOWN_EX: c_int = 15;

fn fcntl_impl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    if is_hidden(fd) {
        return sys::to_c(Err(libc::EBADF)) as c_int;
    }
    let r = sys::fcntl(fd, cmd, arg);
    if let Some(c) = conn_of(fd) {
        match (cmd, r) {
            (libc::F_DUPFD | libc::F_DUPFD_CLOEXEC, Ok(n)) => add_ref(n as c_int, c),
            (libc::F_SETFL, Ok(_)) => c
                .nonblock
                .store(arg & libc::O_NONBLOCK as usize != 0, Ordering::Relaxed),
            // SIGURG comes from the kernel's TCP socket, where urgent data arrives.
            (libc::F_SETOWN | F_SETOWN_EX, Ok(_)) => {
                let _ = sys::fcntl(c.tcp(), cmd, arg);
            }
            _ => {}
        }
    }
    sys::to_c(r) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    fcntl_impl(fd, cmd, arg)
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    fcntl_impl(fd, cmd, arg)
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: usize) -> c_int {
    if let Some(c) = conn_of(fd) {
        match req {
            libc::FIONREAD => {
                if arg == 0 {
                    return sys::to_c(Err(libc::EFAULT)) as c_int;
                }
                let n = c.readable().min(c_int::MAX as usize) as c_int;
                // SAFETY: FIONREAD's argument is an int* (the caller's).
                unsafe { *(arg as *mut c_int) = n };
                return 0;
            }
            libc::FIONBIO => {
                let r = sys::ioctl(fd, req, arg);
                if r.is_ok() && arg != 0 {
                    // SAFETY: FIONBIO's argument is an int* (the caller's).
                    let on = unsafe { *(arg as *const c_int) } != 0;
                    c.nonblock.store(on, Ordering::Relaxed);
                }
                return sys::to_c(r) as c_int;
            }
            libc::TIOCOUTQ => {
                if arg == 0 {
                    return sys::to_c(Err(libc::EFAULT)) as c_int;
                }
                // SAFETY: SIOCOUTQ's argument is an int* (the caller's).
                unsafe { *(arg as *mut c_int) = 0 };
                return 0;
            }
            // Close-on-exec belongs to the program's descriptor, not to the socket.
            libc::FIOCLEX | libc::FIONCLEX => return sys::to_c(sys::ioctl(fd, req, arg)) as c_int,
            _ => return sys::to_c(sys::ioctl(c.tcp(), req, arg)) as c_int,
        }
    }
    if is_hidden(fd) {
        return sys::to_c(Err(libc::EBADF)) as c_int;
    }
    sys::to_c(sys::ioctl(fd, req, arg)) as c_int
}

// ---- socket names and options: the kernel's TCP socket answers ----

#[no_mangle]
pub unsafe extern "C" fn getsockname(
    fd: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> c_int {
    let fd = conn_of(fd).map_or(fd, |c| c.tcp());
    sys::to_c(sys::getsockname(fd, addr, alen)) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn getpeername(
    fd: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> c_int {
    let fd = conn_of(fd).map_or(fd, |c| c.tcp());
    sys::to_c(sys::getpeername(fd, addr, alen)) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    let fd = conn_of(fd).map_or(fd, |c| c.tcp());
    sys::to_c(sys::getsockopt(fd, level, name, val, len)) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if let Some(c) = conn_of(fd) {
        let r = sys::setsockopt(c.tcp(), level, name, val, len);
        if r.is_ok()
            && level == libc::SOL_SOCKET
            && matches!(name, libc::SO_RCVTIMEO | libc::SO_SNDTIMEO)
        {
            // Blocking waits sleep on the program's descriptor: give it the same timeout.
            let _ = sys::setsockopt(fd, level, name, val, len);
        }
        return sys::to_c(r) as c_int;
    }
    sys::to_c(sys::setsockopt(fd, level, name, val, len)) as c_int
}

// ---- sendfile / splice: correct through a copy loop ----

#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    inp: c_int,
    off: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    if conn_of(out).is_none() && conn_of(inp).is_none() {
        return sys::to_c(sys::sendfile(out, inp, off, count));
    }
    let mut buf = vec![0u8; 256 << 10];
    let mut done = 0usize;
    while done < count {
        let want = (count - done).min(buf.len());
        let n = if off.is_null() {
            // SAFETY: buf is ours, want <= its length.
            unsafe { read(inp, buf.as_mut_ptr() as *mut c_void, want) }
        } else {
            // SAFETY: off is the caller's offset, valid when non-null; buf is ours.
            let o = unsafe { *off };
            // SAFETY: pread into our buffer.
            let r = unsafe { libc::pread(inp, buf.as_mut_ptr() as *mut c_void, want, o) };
            if r > 0 {
                // SAFETY: as above.
                unsafe { *off = o + r as libc::off_t };
            }
            r
        };
        if n < 0 {
            return if done > 0 { done as ssize_t } else { -1 };
        }
        if n == 0 {
            break;
        }
        let n = n as usize;
        let mut w = 0usize;
        while w < n {
            // SAFETY: our buffer, w < n <= its length.
            let r = unsafe { write(out, buf.as_ptr().add(w) as *const c_void, n - w) };
            if r < 0 {
                let e = sys::errno();
                // Give back what was read and not sent, so nothing is lost.
                let back = (n - w) as libc::off_t;
                if off.is_null() {
                    // SAFETY: plain lseek on the caller's descriptor.
                    unsafe { libc::lseek(inp, -back, libc::SEEK_CUR) };
                } else {
                    // SAFETY: off valid when non-null.
                    unsafe { *off -= back };
                }
                done += w;
                if done > 0 {
                    return done as ssize_t;
                }
                sys::set_errno(e);
                return -1;
            }
            w += r as usize;
        }
        done += n;
    }
    done as ssize_t
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    inp: c_int,
    off: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: same arguments.
    unsafe { sendfile(out, inp, off, count) }
}

#[no_mangle]
pub unsafe extern "C" fn splice(
    fin: c_int,
    offin: *mut libc::loff_t,
    fout: c_int,
    offout: *mut libc::loff_t,
    len: size_t,
    flags: u32,
) -> ssize_t {
    let cin = conn_of(fin);
    let cout = conn_of(fout);
    if cin.is_none() && cout.is_none() {
        return sys::to_c(sys::splice(fin, offin, fout, offout, len, flags));
    }
    let want = len.min(64 << 10);
    let mut buf = vec![0u8; want];
    if let Some(c) = cin {
        // Socket → pipe: look at the bytes, write what the pipe takes, consume exactly that.
        let nb = if flags & libc::SPLICE_F_NONBLOCK != 0 {
            libc::MSG_DONTWAIT
        } else {
            0
        };
        let n = recv_on(
            c,
            &iov1(buf.as_mut_ptr() as *const c_void, want),
            libc::MSG_PEEK | nb,
        );
        if n <= 0 {
            return n;
        }
        // SAFETY: our buffer, n bytes filled.
        let w = unsafe { write(fout, buf.as_ptr() as *const c_void, n as usize) };
        if w > 0 {
            let _ = recv_on(c, &iov1(buf.as_mut_ptr() as *const c_void, w as usize), 0);
        }
        return w;
    }
    // Pipe (or file) → socket: read, then send all of it.
    // SAFETY: our buffer.
    let n = unsafe { read(fin, buf.as_mut_ptr() as *mut c_void, want) };
    if n <= 0 {
        return n;
    }
    let c = cout.expect("one side is a connection");
    let mut w = 0usize;
    while w < n as usize {
        // SAFETY: our buffer.
        let r = send_on(
            c,
            &iov1(
                unsafe { buf.as_ptr().add(w) } as *const c_void,
                n as usize - w,
            ),
            libc::MSG_NOSIGNAL,
        );
        if r < 0 {
            if sys::errno() == libc::EAGAIN {
                // The program asked for a non-blocking socket: wait for room rather than
                // lose bytes already taken from the pipe.
                let mut p = libc::pollfd {
                    fd: fout,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                let _ = sys::ppoll(&mut p, 1, std::ptr::null());
                continue;
            }
            return if w > 0 { w as ssize_t } else { -1 };
        }
        w += r as usize;
    }
    w as ssize_t
}

extern "C" {
    fn __chk_fail() -> !;
    static environ: *const *const c_char;
}

// ---- exec: a connection kept across it goes back to the kernel's TCP ----

/// Before a new program replaces this one, or a spawned one inherits our descriptors: every
/// connection with a descriptor that is not close-on-exec goes back to the kernel's TCP in
/// both directions, and its TCP socket takes the place of the wake-up socket at that
/// descriptor (the new program may not load the library, or may run where it cannot work —
/// sshd's sandboxed child). The connection object stays: if the exec fails, the program's
/// calls still go through it, to TCP. Nothing but descriptors and the segments changes, so
/// this is safe in a `vfork` child.
fn before_exec() {
    for (fd, slot) in TABLE.iter().enumerate() {
        let p = slot.load(Ordering::Acquire);
        if p.is_null() {
            continue;
        }
        // SAFETY: table entries point at leaked, never-freed connections.
        let c = unsafe { &*p };
        let fd = fd as c_int;
        match sys::fcntl(fd, libc::F_GETFD, 0) {
            Ok(fl) if fl & libc::FD_CLOEXEC as usize == 0 => {}
            _ => continue,
        }
        if c.ended() {
            continue;
        }
        c.hand_back();
        let _ = sys::dup3(c.tcp(), fd, 0);
    }
}

type ExecvpeFn =
    unsafe extern "C" fn(*const c_char, *const *const c_char, *const *const c_char) -> c_int;
type FexecveFn = unsafe extern "C" fn(c_int, *const *const c_char, *const *const c_char) -> c_int;
type SpawnFn = unsafe extern "C" fn(
    *mut libc::pid_t,
    *const c_char,
    *const c_void,
    *const c_void,
    *const *const c_char,
    *const *const c_char,
) -> c_int;

/// libc's own functions for the exec calls that search `PATH` or spawn, looked up once at
/// load (never later: a `vfork` child must not take the loader's lock).
static REAL: [AtomicUsize; 6] = [const { AtomicUsize::new(0) }; 6];
const R_EXECVPE: usize = 0;
const R_FEXECVE: usize = 1;
const R_SPAWN: usize = 2;
const R_SPAWNP: usize = 3;
const R_SYSTEM: usize = 4;
const R_POPEN: usize = 5;

fn resolve_real() {
    let names = [
        c"execvpe",
        c"fexecve",
        c"posix_spawn",
        c"posix_spawnp",
        c"system",
        c"popen",
    ];
    for (i, name) in names.iter().enumerate() {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name, after libc is initialised
        // (a constructor of a library that depends on it).
        let f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
        REAL[i].store(f as usize, Ordering::Release);
    }
}

fn real(i: usize) -> Option<usize> {
    let f = REAL[i].load(Ordering::Acquire);
    (f != 0).then_some(f)
}

#[no_mangle]
pub unsafe extern "C" fn execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    before_exec();
    sys::to_c(sys::execve(path, argv, envp)) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: the caller's arguments; `environ` is libc's.
    unsafe { execve(path, argv, environ) }
}

#[no_mangle]
pub unsafe extern "C" fn execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    let Some(f) = real(R_EXECVPE) else {
        return sys::to_c(Err(libc::ENOSYS)) as c_int;
    };
    before_exec();
    // SAFETY: libc's execvpe (resolved at load), with the caller's arguments.
    unsafe { std::mem::transmute::<usize, ExecvpeFn>(f)(file, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: as execvpe, with libc's environment.
    unsafe { execvpe(file, argv, environ) }
}

#[no_mangle]
pub unsafe extern "C" fn fexecve(
    fd: c_int,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    let Some(f) = real(R_FEXECVE) else {
        return sys::to_c(Err(libc::ENOSYS)) as c_int;
    };
    before_exec();
    // SAFETY: libc's fexecve (resolved at load), with the caller's arguments.
    unsafe { std::mem::transmute::<usize, FexecveFn>(f)(fd, argv, envp) }
}

unsafe fn spawn(
    which: usize,
    pid: *mut libc::pid_t,
    path: *const c_char,
    actions: *const c_void,
    attr: *const c_void,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    let Some(f) = real(which) else {
        return libc::ENOSYS;
    };
    // The child inherits what is not close-on-exec: those connections go back to TCP here,
    // for the parent too (both processes then share the kernel's socket).
    before_exec();
    // SAFETY: libc's posix_spawn/posix_spawnp (resolved at load), the caller's arguments.
    unsafe { std::mem::transmute::<usize, SpawnFn>(f)(pid, path, actions, attr, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut libc::pid_t,
    path: *const c_char,
    actions: *const c_void,
    attr: *const c_void,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the caller's arguments, as posix_spawn(3).
    unsafe { spawn(R_SPAWN, pid, path, actions, attr, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut libc::pid_t,
    file: *const c_char,
    actions: *const c_void,
    attr: *const c_void,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the caller's arguments, as posix_spawnp(3).
    unsafe { spawn(R_SPAWNP, pid, file, actions, attr, argv, envp) }
}

// `system` and `popen` spawn through libc's internal posix_spawn, which no preload sees: the
// connections their shell inherits go back to the kernel's TCP first, as for posix_spawn.

#[no_mangle]
pub unsafe extern "C" fn system(cmd: *const c_char) -> c_int {
    let Some(f) = real(R_SYSTEM) else {
        return -1;
    };
    if !cmd.is_null() {
        before_exec();
    }
    // SAFETY: libc's system (resolved at load), the caller's argument.
    unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char) -> c_int>(f)(cmd) }
}

#[no_mangle]
pub unsafe extern "C" fn popen(cmd: *const c_char, mode: *const c_char) -> *mut c_void {
    type PopenFn = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut c_void;
    let Some(f) = real(R_POPEN) else {
        sys::set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    before_exec();
    // SAFETY: libc's popen (resolved at load), the caller's arguments.
    unsafe { std::mem::transmute::<usize, PopenFn>(f)(cmd, mode) }
}

// `execl`, `execlp`, `execle` are C-variadic, which Rust cannot define: each exported name is
// a jump, with the caller's registers and stack untouched, to a C function (src/execl.c) that
// builds the argument vector and calls our execv/execvp/execve above.
extern "C" {
    fn bp_execl();
    fn bp_execlp();
    fn bp_execle();
}

macro_rules! variadic_exec {
    ($name:ident, $target:ident) => {
        // SAFETY: a naked function whose whole body is one jump to a C function of the same
        // (variadic) signature: no prologue, nothing of the caller's state is touched.
        #[unsafe(naked)]
        #[no_mangle]
        pub unsafe extern "C" fn $name() {
            #[cfg(target_arch = "x86_64")]
            core::arch::naked_asm!("jmp {}", sym $target);
            #[cfg(target_arch = "aarch64")]
            core::arch::naked_asm!("b {}", sym $target);
        }
    };
}

variadic_exec!(execl, bp_execl);
variadic_exec!(execlp, bp_execlp);
variadic_exec!(execle, bp_execle);

// ---- process life: fork and exit ----

static MY_PID: AtomicU32 = AtomicU32::new(0);

/// This process's pid, cached (kept right across fork by the at-fork handler).
pub fn my_pid() -> u32 {
    let p = MY_PID.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    let p = sys::getpid();
    MY_PID.store(p, Ordering::Relaxed);
    p
}

/// Calls `f` on every connection in the table (a walk without a lock: safe in a fork's
/// handlers, where another thread may have held any lock).
fn each_conn(mut f: impl FnMut(&'static Conn)) {
    for s in TABLE.iter().take(TOP.load(Ordering::Acquire)) {
        let p = s.load(Ordering::Acquire);
        if !p.is_null() {
            // SAFETY: table entries point at leaked, never-freed connections.
            f(unsafe { &*p });
        }
    }
}

extern "C" fn after_fork_parent() {
    // The child may use these connections at the same instant as we do.
    each_conn(|c| c.shared.store(true, Ordering::Release));
}

extern "C" fn after_fork_child() {
    MY_PID.store(sys::getpid(), Ordering::Relaxed);
    each_conn(|c| {
        c.shared.store(true, Ordering::Release);
        c.forked();
    });
}

/// A child after fork has no helper thread yet: start one (one comparison when it has).
pub fn ensure_helper() {
    helper::ensure();
}

extern "C" fn at_load() {
    // SAFETY: registers a plain function without captures.
    unsafe { libc::pthread_atfork(None, Some(after_fork_parent), Some(after_fork_child)) };
    MY_PID.store(sys::getpid(), Ordering::Relaxed);
    resolve_real();
}

/// At `exit`: nothing that could block (a signal handler may call exit while this thread
/// holds a connection's lock). The kernel closes the TCP sockets, and the peers read the
/// stream's end from that; only the offers nobody claimed are removed here.
extern "C" fn at_unload() {
    each_conn(|c| c.at_exit());
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = at_load;

#[used]
#[link_section = ".fini_array"]
static FINI: extern "C" fn() = at_unload;

// ---- the helper thread ----

mod helper {
    //! One thread per process watches the kernel's TCP sockets of the accelerated
    //! connections (edge-triggered epoll) and turns what it sees into the program
    //! descriptor's readiness: bytes on TCP (the prefix) or the peer gone → readable;
    //! room on TCP again before the switch → writable.

    use super::*;

    static EP: AtomicI32 = AtomicI32::new(-1);
    /// How often the nodes of the connections are checked (and wake-up bytes still owed are
    /// paid: see `seg::RX_OWED`).
    const NODE_CHECK_MS: c_int = 200;
    static PID: AtomicU32 = AtomicU32::new(0);
    static START: Mutex<()> = Mutex::new(());

    pub fn ensure() -> c_int {
        let me = my_pid();
        if PID.load(Ordering::Acquire) == me {
            return EP.load(Ordering::Acquire);
        }
        let _g = START.lock().unwrap_or_else(|e| e.into_inner());
        if PID.load(Ordering::Acquire) == me {
            return EP.load(Ordering::Acquire);
        }
        let old = EP.swap(-1, Ordering::AcqRel);
        if old >= 0 {
            // Inherited from the parent: its epoll instance is its own.
            setup::close_hidden(old);
        }
        let Ok(ep) = sys::epoll_create1(libc::EPOLL_CLOEXEC) else {
            return -1;
        };
        let ep = setup::hide(ep as c_int);
        if std::thread::Builder::new()
            .name("bp-accel".into())
            .spawn(move || run(ep))
            .is_err()
        {
            setup::close_hidden(ep);
            return -1;
        }
        EP.store(ep, Ordering::Release);
        let first = PID.swap(me, Ordering::AcqRel) == 0;
        if first {
            return ep;
        }
        // A child after fork: watch the connections it inherited.
        each_conn(|c| add(ep, c));
        ep
    }

    fn add(ep: c_int, c: &'static Conn) {
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN
                | libc::EPOLLOUT
                | libc::EPOLLPRI
                | libc::EPOLLRDHUP
                | libc::EPOLLET) as u32,
            u64: c as *const Conn as u64,
        };
        let _ = sys::epoll_ctl(ep, libc::EPOLL_CTL_ADD, c.tcp(), &mut ev);
    }

    /// Resets the connections whose node went down or restarted (a walk of the table, no
    /// lock: a fork's child must never find one held).
    fn check_nodes() {
        each_conn(|c| {
            c.check_nodes();
            c.pay_debt();
        });
    }

    /// Starts watching a new connection.
    pub fn watch(c: &'static Conn) {
        let ep = ensure();
        if ep >= 0 {
            add(ep, c);
        }
        // Bytes that reached TCP before the watch made no edge: make them readable.
        let mut n: c_int = 0;
        if sys::ioctl(c.tcp(), libc::FIONREAD, &mut n as *mut c_int as usize).is_ok() && n > 0 {
            c.tcp_event(true, false);
        }
    }

    fn run(ep: c_int) {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 64];
        let mut last = crate::conn::now_ns();
        loop {
            let now = crate::conn::now_ns();
            if now.saturating_sub(last) >= NODE_CHECK_MS as u64 * 1_000_000 {
                last = now;
                check_nodes();
            }
            let n = match sys::epoll_wait(ep, evs.as_mut_ptr(), evs.len() as c_int, NODE_CHECK_MS) {
                Ok(n) => n,
                Err(libc::EINTR) => continue,
                Err(_) => return,
            };
            for ev in &evs[..n] {
                // SAFETY: the data is a leaked, never-freed connection we registered.
                let c = unsafe { &*(ev.u64 as *const Conn) };
                c.helper_busy.store(true, Ordering::SeqCst);
                if !c.ended() {
                    let e = ev.events as c_int;
                    c.tcp_event(
                        e & libc::EPOLLIN != 0,
                        e & (libc::EPOLLRDHUP | libc::EPOLLHUP | libc::EPOLLERR) != 0,
                    );
                    if e & libc::EPOLLOUT != 0 && c.tcp_tx_blocked.swap(false, Ordering::AcqRel) {
                        sys::drain(c.b());
                    }
                    if e & libc::EPOLLPRI != 0 {
                        c.back_event();
                    }
                }
                c.helper_busy.store(false, Ordering::SeqCst);
            }
        }
    }
}
