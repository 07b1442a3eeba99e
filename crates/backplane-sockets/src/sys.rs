//! Raw system calls. The library exports `read`, `close`, `send` … itself, so calling libc's
//! functions of those names from inside it would call back into the library; everything here
//! goes straight to the kernel through `syscall(2)` instead. That also keeps the library free
//! of `dlsym`: nothing to resolve, safe to call before libc has finished starting up.

use libc::{c_int, c_long, c_void};

/// A call's result: the kernel's non-negative return value, or the errno it failed with.
pub type Res = Result<usize, c_int>;

/// The calling thread's `errno`.
pub fn errno() -> c_int {
    // SAFETY: __errno_location returns the calling thread's errno slot, always valid.
    unsafe { *libc::__errno_location() }
}

/// Sets the calling thread's `errno`.
pub fn set_errno(e: c_int) {
    // SAFETY: as in `errno`.
    unsafe { *libc::__errno_location() = e }
}

fn ret(r: c_long) -> Res {
    if r < 0 {
        Err(errno())
    } else {
        Ok(r as usize)
    }
}

/// Turns a result into what a libc function returns: the value, or -1 with errno set.
pub fn to_c(r: Res) -> isize {
    match r {
        Ok(n) => n as isize,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

macro_rules! sc {
    ($nr:expr $(, $a:expr)*) => {
        // SAFETY: a raw system call; every caller passes pointers that are valid for the
        // lengths it passes beside them (or null where the kernel allows it), as documented at
        // each wrapper below.
        ret(unsafe { libc::syscall($nr $(, $a)*) })
    };
}

/// `read(2)` into `len` bytes at `buf` (the caller's buffer).
pub fn read(fd: c_int, buf: *mut c_void, len: usize) -> Res {
    sc!(libc::SYS_read, fd, buf, len)
}
/// `write(2)` of `len` bytes at `buf`.
pub fn write(fd: c_int, buf: *const c_void, len: usize) -> Res {
    sc!(libc::SYS_write, fd, buf, len)
}
/// `readv(2)` with `cnt` iovecs at `iov`.
pub fn readv(fd: c_int, iov: *const libc::iovec, cnt: c_int) -> Res {
    sc!(libc::SYS_readv, fd, iov, cnt)
}
/// `writev(2)` with `cnt` iovecs at `iov`.
pub fn writev(fd: c_int, iov: *const libc::iovec, cnt: c_int) -> Res {
    sc!(libc::SYS_writev, fd, iov, cnt)
}
/// `recvfrom(2)`; `addr`/`alen` may be null.
pub fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    addr: *mut libc::sockaddr,
    alen: *mut libc::socklen_t,
) -> Res {
    sc!(libc::SYS_recvfrom, fd, buf, len, flags, addr, alen)
}
/// `sendto(2)`; `addr` may be null.
pub fn sendto(
    fd: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    addr: *const libc::sockaddr,
    alen: libc::socklen_t,
) -> Res {
    sc!(libc::SYS_sendto, fd, buf, len, flags, addr, alen)
}
/// `recvmsg(2)`.
pub fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> Res {
    sc!(libc::SYS_recvmsg, fd, msg, flags)
}
/// `sendmsg(2)`.
pub fn sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> Res {
    sc!(libc::SYS_sendmsg, fd, msg, flags)
}
/// `close(2)`.
pub fn close(fd: c_int) -> Res {
    sc!(libc::SYS_close, fd)
}
/// `close_range(2)`.
pub fn close_range(first: u32, last: u32, flags: u32) -> Res {
    sc!(libc::SYS_close_range, first, last, flags)
}
/// `dup(2)`.
pub fn dup(fd: c_int) -> Res {
    sc!(libc::SYS_dup, fd)
}
/// `dup3(2)` (`dup2` when `flags` is 0 and the descriptors differ).
pub fn dup3(old: c_int, new: c_int, flags: c_int) -> Res {
    sc!(libc::SYS_dup3, old, new, flags)
}
/// `fcntl(2)` with an integer or pointer argument.
pub fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> Res {
    sc!(libc::SYS_fcntl, fd, cmd, arg)
}
/// `ioctl(2)` with an integer or pointer argument.
pub fn ioctl(fd: c_int, req: libc::c_ulong, arg: usize) -> Res {
    sc!(libc::SYS_ioctl, fd, req, arg)
}
/// `socketpair(2)` into `sv`.
pub fn socketpair(domain: c_int, ty: c_int, proto: c_int, sv: &mut [c_int; 2]) -> Res {
    sc!(libc::SYS_socketpair, domain, ty, proto, sv.as_mut_ptr())
}
/// `accept4(2)`; `addr`/`alen` may be null.
pub fn accept4(
    fd: c_int,
    addr: *mut libc::sockaddr,
    alen: *mut libc::socklen_t,
    flags: c_int,
) -> Res {
    sc!(libc::SYS_accept4, fd, addr, alen, flags)
}
/// `connect(2)`.
pub fn connect(fd: c_int, addr: *const libc::sockaddr, alen: libc::socklen_t) -> Res {
    sc!(libc::SYS_connect, fd, addr, alen)
}
/// `bind(2)`.
pub fn bind(fd: c_int, addr: *const libc::sockaddr, alen: libc::socklen_t) -> Res {
    sc!(libc::SYS_bind, fd, addr, alen)
}
/// `listen(2)`.
pub fn listen(fd: c_int, backlog: c_int) -> Res {
    sc!(libc::SYS_listen, fd, backlog)
}
/// `getsockname(2)`.
pub fn getsockname(fd: c_int, addr: *mut libc::sockaddr, alen: *mut libc::socklen_t) -> Res {
    sc!(libc::SYS_getsockname, fd, addr, alen)
}
/// `getpeername(2)`.
pub fn getpeername(fd: c_int, addr: *mut libc::sockaddr, alen: *mut libc::socklen_t) -> Res {
    sc!(libc::SYS_getpeername, fd, addr, alen)
}
/// `getsockopt(2)`.
pub fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut libc::socklen_t,
) -> Res {
    sc!(libc::SYS_getsockopt, fd, level, name, val, len)
}
/// `setsockopt(2)`.
pub fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: libc::socklen_t,
) -> Res {
    sc!(libc::SYS_setsockopt, fd, level, name, val, len)
}
/// `shutdown(2)`.
pub fn shutdown(fd: c_int, how: c_int) -> Res {
    sc!(libc::SYS_shutdown, fd, how)
}
/// `sendfile(2)`; `off` may be null.
pub fn sendfile(out: c_int, inp: c_int, off: *mut libc::off_t, count: usize) -> Res {
    sc!(libc::SYS_sendfile, out, inp, off, count)
}
/// `splice(2)`; the offsets may be null.
pub fn splice(
    fin: c_int,
    offin: *mut libc::loff_t,
    fout: c_int,
    offout: *mut libc::loff_t,
    len: usize,
    flags: u32,
) -> Res {
    sc!(libc::SYS_splice, fin, offin, fout, offout, len, flags)
}
/// `ppoll(2)` with no timeout limit when `ts` is null and no signal mask.
pub fn ppoll(fds: *mut libc::pollfd, n: usize, ts: *const libc::timespec) -> Res {
    sc!(libc::SYS_ppoll, fds, n, ts, 0usize, 0usize)
}
/// `ppoll(2)` with the caller's timeout (updated by the kernel) and signal mask (may be null).
pub fn ppoll_mask(
    fds: *mut libc::pollfd,
    n: usize,
    ts: *mut libc::timespec,
    mask: *const libc::sigset_t,
) -> Res {
    sc!(libc::SYS_ppoll, fds, n, ts, mask, 8usize)
}
/// `pselect6(2)` with the caller's timeout (updated by the kernel) and signal mask.
pub fn pselect(
    n: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    ts: *mut libc::timespec,
    mask: *const libc::sigset_t,
) -> Res {
    // The kernel's sixth argument: the mask and its size.
    let data: [usize; 2] = [mask as usize, 8];
    sc!(libc::SYS_pselect6, n, r, w, e, ts, data.as_ptr())
}
/// `poll(2)`.
pub fn poll(fds: *mut libc::pollfd, n: usize, timeout: c_int) -> Res {
    sc!(libc::SYS_poll, fds, n, timeout)
}
/// `select(2)`.
pub fn select(
    n: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> Res {
    sc!(libc::SYS_select, n, r, w, e, tv)
}
/// `epoll_pwait(2)`; `sigmask` may be null.
pub fn epoll_pwait(
    ep: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    sigmask: *const c_void,
) -> Res {
    sc!(
        libc::SYS_epoll_pwait,
        ep,
        evs,
        max,
        timeout,
        sigmask,
        8usize
    )
}
/// `openat(2)` relative to the working directory; `path` is NUL-terminated.
pub fn open(path: &[u8], flags: c_int, mode: u32) -> Res {
    debug_assert_eq!(path.last(), Some(&0));
    sc!(libc::SYS_openat, libc::AT_FDCWD, path.as_ptr(), flags, mode)
}
/// `unlink(2)`; `path` is NUL-terminated.
pub fn unlink(path: &[u8]) -> Res {
    debug_assert_eq!(path.last(), Some(&0));
    sc!(libc::SYS_unlinkat, libc::AT_FDCWD, path.as_ptr(), 0)
}
/// `rename(2)`; both NUL-terminated.
pub fn rename(from: &[u8], to: &[u8]) -> Res {
    debug_assert_eq!(from.last(), Some(&0));
    debug_assert_eq!(to.last(), Some(&0));
    sc!(
        libc::SYS_renameat,
        libc::AT_FDCWD,
        from.as_ptr(),
        libc::AT_FDCWD,
        to.as_ptr()
    )
}
/// Bytes free to unprivileged users on the filesystem of `fd` (`fstatfs(2)`).
pub fn free_bytes(fd: c_int) -> Result<u64, c_int> {
    // SAFETY: statfs is plain data, filled by the kernel.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    sc!(libc::SYS_fstatfs, fd, &mut st as *mut libc::statfs)?;
    Ok((st.f_bavail as u64).saturating_mul(st.f_bsize as u64))
}
/// `ftruncate(2)`.
pub fn ftruncate(fd: c_int, len: u64) -> Res {
    sc!(libc::SYS_ftruncate, fd, len)
}
/// `flock(2)`.
pub fn flock(fd: c_int, op: c_int) -> Res {
    sc!(libc::SYS_flock, fd, op)
}
/// `fstat(2)`: (inode, size, mode).
pub fn fstat(fd: c_int) -> Result<(u64, u64, u32), c_int> {
    // SAFETY: stat is plain old data; an all-zero value is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    sc!(libc::SYS_fstat, fd, &mut st as *mut libc::stat)?;
    Ok((st.st_ino, st.st_size as u64, st.st_mode))
}
/// `mmap(2)` of `len` bytes of `fd`, shared, read-write.
pub fn mmap_shared(fd: c_int, len: usize) -> Result<*mut u8, c_int> {
    let p = sc!(
        libc::SYS_mmap,
        0usize,
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_SHARED,
        fd,
        0usize
    )?;
    Ok(p as *mut u8)
}
/// A read-only shared mapping of `len` bytes of `fd`.
pub fn mmap_read(fd: c_int, len: usize) -> Result<*mut u8, c_int> {
    let p = sc!(
        libc::SYS_mmap,
        0usize,
        len,
        libc::PROT_READ,
        libc::MAP_SHARED,
        fd,
        0usize
    )?;
    Ok(p as *mut u8)
}
/// `munmap(2)`.
pub fn munmap(p: *mut u8, len: usize) -> Res {
    sc!(libc::SYS_munmap, p, len)
}
/// `execve(2)`.
pub fn execve(
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> Res {
    sc!(libc::SYS_execve, path, argv, envp)
}
/// `getpid(2)`.
pub fn getpid() -> u32 {
    sc!(libc::SYS_getpid).unwrap_or(0) as u32
}
/// `gettid(2)`.
pub fn gettid() -> u32 {
    sc!(libc::SYS_gettid).unwrap_or(0) as u32
}
/// Sends `sig` to the calling thread (as the kernel does for `SIGPIPE`).
pub fn raise_here(sig: c_int) {
    let _ = sc!(libc::SYS_tgkill, getpid(), gettid(), sig);
}
/// True unless `pid` names no process (`kill(pid, 0)` failing with `ESRCH`).
pub fn alive(pid: u32) -> bool {
    pid != 0 && !matches!(sc!(libc::SYS_kill, pid as libc::pid_t, 0), Err(libc::ESRCH))
}
/// `futex(FUTEX_WAIT)` on a word of a mapping other processes share (not `PRIVATE`): sleeps
/// while `*word == val`, at most `ns` nanoseconds.
pub fn futex_wait(word: &std::sync::atomic::AtomicU32, val: u32, ns: u64) -> Res {
    let ts = libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    };
    sc!(
        libc::SYS_futex,
        word.as_ptr(),
        libc::FUTEX_WAIT,
        val,
        &ts as *const libc::timespec
    )
}
/// `futex(FUTEX_WAKE)`: wakes every process sleeping on `word` (shared, not `PRIVATE`).
pub fn futex_wake_all(word: &std::sync::atomic::AtomicU32) {
    let _ = sc!(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
}
/// `pidfd_open(2)`.
pub fn pidfd_open(pid: u32) -> Res {
    sc!(libc::SYS_pidfd_open, pid, 0)
}
/// `pidfd_getfd(2)`: a duplicate of descriptor `fd` of the process behind `pidfd`.
pub fn pidfd_getfd(pidfd: c_int, fd: c_int) -> Res {
    sc!(libc::SYS_pidfd_getfd, pidfd, fd, 0)
}
/// `epoll_create1(2)`.
pub fn epoll_create1(flags: c_int) -> Res {
    sc!(libc::SYS_epoll_create1, flags)
}
/// `epoll_ctl(2)`; `ev` may be null for `EPOLL_CTL_DEL`.
pub fn epoll_ctl(ep: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> Res {
    sc!(libc::SYS_epoll_ctl, ep, op, fd, ev)
}
/// `epoll_pwait(2)` without a signal mask.
pub fn epoll_wait(ep: c_int, evs: *mut libc::epoll_event, max: c_int, timeout: c_int) -> Res {
    sc!(libc::SYS_epoll_pwait, ep, evs, max, timeout, 0usize, 8usize)
}
/// `getrandom(2)` into `buf`.
pub fn getrandom(buf: &mut [u8]) -> Res {
    sc!(libc::SYS_getrandom, buf.as_mut_ptr(), buf.len(), 0)
}
/// Looks at the next byte queued on `fd` without taking it or blocking: Ok(0) at the end of
/// the stream, Ok(1) with a byte, Err(EAGAIN) with none.
pub fn peek1(fd: c_int) -> Res {
    recv1(fd, libc::MSG_PEEK | libc::MSG_DONTWAIT)
}

/// Receives one byte from `fd` (discarded) with `flags`.
pub fn recv1(fd: c_int, flags: c_int) -> Res {
    let mut b = 0u8;
    recvfrom(
        fd,
        &mut b as *mut u8 as *mut c_void,
        1,
        flags,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    )
}

/// Sends one wake-up byte on `fd` without blocking; a full queue already holds one.
pub fn poke(fd: c_int) {
    let b = 1u8;
    let _ = sendto(
        fd,
        &b as *const u8 as *const c_void,
        1,
        libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        std::ptr::null(),
        0,
    );
}

/// Reads and discards everything queued on `fd` without blocking.
pub fn drain(fd: c_int) {
    let mut buf = [0u8; 4096];
    while let Ok(n) = recvfrom(
        fd,
        buf.as_mut_ptr() as *mut c_void,
        buf.len(),
        libc::MSG_DONTWAIT,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    ) {
        if n < buf.len() {
            break;
        }
    }
}
