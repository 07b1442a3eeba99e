//! The agreement: which connections move to a ring, decided without a byte on the TCP
//! stream and without a timeout.
//!
//! 1. A program that `listen`s on a fabric address (or any address) registers the port: it
//!    holds a shared `flock` on `n{node}-l{port}` in the fabric's directory for as long as the
//!    listening socket lives (a dead process's lock goes with it).
//! 2. A program that `connect`s to a fabric node's address checks that a live listener holds
//!    that file; if so it binds (to know its port), writes an *offer* — the segment, named by
//!    both ends' node and port — and only then sends its SYN. So when `accept` returns the
//!    connection on the other side, the offer already exists: no race, no waiting.
//! 3. `accept` looks for the offer of the connection it returns, validates it, takes the
//!    client's wake-up socket (`pidfd_getfd`), and claims it.
//!
//! Whatever fails — no listener registered, no offer, a bad one, a peer that cannot be
//! reached — the connection stays the kernel's (the program's descriptor is left untouched),
//! or, on the client after its offer, keeps using the kernel's TCP until a claim shows up.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicI32, Ordering};

use libc::{c_int, socklen_t};

use crate::config::{self, Config, Fallback};
use crate::conn::{Conn, Parts};
use crate::seg::{self, Offer, Role, Seg};
use crate::sys;

static HIDDEN_BASE: AtomicI32 = AtomicI32::new(0);

/// Where hidden descriptors go: high, out of the way of `select`'s `FD_SETSIZE` and of the
/// numbers programs pick for themselves.
fn hidden_base() -> c_int {
    let b = HIDDEN_BASE.load(Ordering::Relaxed);
    if b > 0 {
        return b;
    }
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 {
        rl.rlim_cur.min(1 << 20) as c_int
    } else {
        1024
    };
    let b = (soft / 2).clamp(3, 4096);
    HIDDEN_BASE.store(b, Ordering::Relaxed);
    b
}

/// Moves `fd` to a high close-on-exec descriptor and marks it ours (closing the original).
pub fn hide(fd: c_int) -> c_int {
    let nfd = match sys::fcntl(fd, libc::F_DUPFD_CLOEXEC, hidden_base() as usize) {
        Ok(n) => {
            let _ = sys::close(fd);
            n as c_int
        }
        Err(_) => {
            let _ = sys::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC as usize);
            fd
        }
    };
    crate::mark_hidden(nfd, true);
    nfd
}

/// Closes a hidden descriptor.
pub fn close_hidden(fd: c_int) {
    crate::mark_hidden(fd, false);
    let _ = sys::close(fd);
}

/// A duplicate of descriptor `fd` of process `pid`, if it is still the socket with inode
/// `ino` (the peer's wake-up socket), hidden.
pub fn fetch_fd(pid: u32, fd: c_int, ino: u64) -> Option<c_int> {
    if pid == 0 || fd < 0 {
        return None;
    }
    let pidfd = sys::pidfd_open(pid).ok()? as c_int;
    let got = sys::pidfd_getfd(pidfd, fd);
    let _ = sys::close(pidfd);
    let got = got.ok()? as c_int;
    match sys::fstat(got) {
        Ok((i, _, mode)) if i == ino && mode & libc::S_IFMT == libc::S_IFSOCK => Some(hide(got)),
        _ => {
            let _ = sys::close(got);
            None
        }
    }
}

/// Parses a socket address the kernel or a caller gave.
///
/// # Safety
/// `addr` must be valid for `len` bytes (or null).
pub unsafe fn parse_addr(addr: *const libc::sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() {
        return None;
    }
    let len = len as usize;
    let fam = if len >= 2 {
        // SAFETY: addr is valid for len >= 2 bytes (checked) per the caller.
        c_int::from(unsafe { (*addr).sa_family })
    } else {
        return None;
    };
    match fam {
        libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: family AF_INET and len covers sockaddr_in.
            let a = unsafe { std::ptr::read_unaligned(addr as *const libc::sockaddr_in) };
            Some(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr))),
                u16::from_be(a.sin_port),
            ))
        }
        libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: family AF_INET6 and len covers sockaddr_in6.
            let a = unsafe { std::ptr::read_unaligned(addr as *const libc::sockaddr_in6) };
            Some(SocketAddr::new(
                IpAddr::V6(Ipv6Addr::from(a.sin6_addr.s6_addr)),
                u16::from_be(a.sin6_port),
            ))
        }
        _ => None,
    }
}

fn sock_addr(fd: c_int, peer: bool) -> Option<SocketAddr> {
    // SAFETY: sockaddr_storage is plain data; all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    let p = &mut ss as *mut libc::sockaddr_storage as *mut libc::sockaddr;
    let r = if peer {
        sys::getpeername(fd, p, &mut len)
    } else {
        sys::getsockname(fd, p, &mut len)
    };
    r.ok()?;
    // SAFETY: the kernel wrote len bytes into ss.
    unsafe { parse_addr(p, len) }
}

fn sock_type(fd: c_int) -> Option<c_int> {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    sys::getsockopt(
        fd,
        libc::SOL_SOCKET,
        libc::SO_TYPE,
        &mut v as *mut c_int as *mut libc::c_void,
        &mut len,
    )
    .ok()?;
    Some(v)
}

/// A listener's registration: the lock file descriptor (hidden).
pub fn register_listener(fd: c_int) -> Option<c_int> {
    let cfg = config::get()?;
    if sock_type(fd)? != libc::SOCK_STREAM {
        return None;
    }
    let local = sock_addr(fd, false)?;
    let ours = local.ip().is_unspecified() || cfg.node_of(local.ip()) == Some(cfg.node);
    if !ours || local.port() == 0 {
        return None;
    }
    let path = cfg.listener_path(cfg.node, local.port());
    let lf = sys::open(
        &path,
        libc::O_RDONLY | libc::O_CREAT | libc::O_CLOEXEC,
        0o644,
    )
    .ok()? as c_int;
    if sys::flock(lf, libc::LOCK_SH).is_err() {
        let _ = sys::close(lf);
        return None;
    }
    config::log(format_args!(
        "listening on {local}: accelerated connections accepted"
    ));
    Some(hide(lf))
}

/// True when a live listener registered (`node`, `port`).
fn listener_alive(cfg: &Config, node: u32, port: u16) -> bool {
    let path = cfg.listener_path(node, port);
    let Ok(fd) = sys::open(&path, libc::O_RDONLY | libc::O_CLOEXEC, 0) else {
        return false;
    };
    let fd = fd as c_int;
    let alive = match sys::flock(fd, libc::LOCK_EX | libc::LOCK_NB) {
        Ok(_) => {
            let _ = sys::flock(fd, libc::LOCK_UN);
            false
        }
        Err(e) => e == libc::EWOULDBLOCK,
    };
    let _ = sys::close(fd);
    alive
}

/// The wake-up pair: (the program's `A`, our hidden duplicate of `A`, hidden `B`, `B`'s inode).
fn wake_pair(nonblock: bool) -> Result<(c_int, c_int, c_int, u64), c_int> {
    let mut sv = [-1; 2];
    sys::socketpair(
        libc::AF_UNIX,
        libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
        0,
        &mut sv,
    )?;
    let [a, b] = sv;
    let small: c_int = 4096;
    let _ = sys::setsockopt(
        a,
        libc::SOL_SOCKET,
        libc::SO_SNDBUF,
        &small as *const c_int as *const libc::c_void,
        4,
    );
    if nonblock {
        let _ = sys::fcntl(a, libc::F_SETFL, (libc::O_RDWR | libc::O_NONBLOCK) as usize);
    }
    let a_own = match sys::dup(a) {
        Ok(d) => hide(d as c_int),
        Err(e) => {
            let _ = sys::close(a);
            let _ = sys::close(b);
            return Err(e);
        }
    };
    let b = hide(b);
    let ino = sys::fstat(b).map(|(i, _, _)| i).unwrap_or(0);
    Ok((a, a_own, b, ino))
}

fn close_pair(a: c_int, a_own: c_int, b: c_int) {
    let _ = sys::close(a);
    close_hidden(a_own);
    close_hidden(b);
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    let _ = sys::getrandom(&mut b);
    u64::from_le_bytes(b)
}

/// Puts `A` at the program's descriptor number `fd` (keeping its close-on-exec flag) and
/// moves the TCP socket that was there to a hidden descriptor. Returns the hidden TCP fd.
fn swap_in(fd: c_int, a: c_int, cloexec: bool) -> Result<c_int, c_int> {
    let t = sys::fcntl(fd, libc::F_DUPFD_CLOEXEC, hidden_base() as usize)
        .or_else(|_| sys::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3))? as c_int;
    if let Err(e) = sys::dup3(a, fd, if cloexec { libc::O_CLOEXEC } else { 0 }) {
        let _ = sys::close(t);
        return Err(e);
    }
    let _ = sys::close(a);
    crate::mark_hidden(t, true);
    // Our own operations on TCP say MSG_DONTWAIT when they must not block.
    if let Ok(fl) = sys::fcntl(t, libc::F_GETFL, 0) {
        let _ = sys::fcntl(t, libc::F_SETFL, fl & !(libc::O_NONBLOCK as usize));
    }
    Ok(t)
}

/// `connect` on a socket with no connection of ours yet.
///
/// # Safety
/// `addr` must be valid for `alen` bytes.
pub unsafe fn connect(fd: c_int, addr: *const libc::sockaddr, alen: socklen_t) -> isize {
    let plain = || sys::to_c(sys::connect(fd, addr, alen));
    let Some(cfg) = config::get() else {
        return plain();
    };
    // SAFETY: addr valid for alen (caller).
    let Some(dst) = (unsafe { parse_addr(addr, alen) }) else {
        return plain();
    };
    let Some(dnode) = cfg.node_of(dst.ip()) else {
        return plain();
    };
    if !crate::slot_free(fd) || sock_type(fd) != Some(libc::SOCK_STREAM) {
        return plain();
    }
    if !listener_alive(cfg, dnode, dst.port()) {
        config::fallback(Fallback::PeerNotAccelerated, &dst);
        return plain();
    }
    // SAFETY: addr valid for alen (caller).
    match unsafe { offer_and_connect(cfg, fd, addr, alen, dst, dnode) } {
        Ok(r) => r,
        Err((why, e)) => {
            // The socket itself is as the program left it (or connected, or failed, as
            // the kernel said).
            if let Some(why) = why {
                config::fallback(why, &dst);
            }
            match e {
                Some(r) => r,
                None => plain(),
            }
        }
    }
}

type SetupErr = (Option<Fallback>, Option<isize>);

/// # Safety
/// `addr` must be valid for `alen` bytes.
unsafe fn offer_and_connect(
    cfg: &Config,
    fd: c_int,
    addr: *const libc::sockaddr,
    alen: socklen_t,
    dst: SocketAddr,
    dnode: u32,
) -> Result<isize, SetupErr> {
    let res = |_| (Some(Fallback::Resources), None);
    // Bind first, so the offer can name our port before the SYN leaves.
    let mut local = sock_addr(fd, false).ok_or((Some(Fallback::Resources), None))?;
    if local.port() == 0 {
        let any: SocketAddr = if dst.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let (ss, sl) = to_sockaddr(any);
        sys::bind(fd, &ss as *const _ as *const libc::sockaddr, sl).map_err(res)?;
        local = sock_addr(fd, false).ok_or((Some(Fallback::Resources), None))?;
    }
    let flags = sys::fcntl(fd, libc::F_GETFL, 0).map_err(res)?;
    let nonblock = flags & libc::O_NONBLOCK as usize != 0;
    let cloexec = sys::fcntl(fd, libc::F_GETFD, 0).map_err(res)? & libc::FD_CLOEXEC as usize != 0;
    let (a, a_own, b, b_ino) = wake_pair(nonblock).map_err(res)?;
    let ring = cfg.ring;
    let len = seg::seg_len(ring);
    let cookie = random_u64();
    let path = cfg.offer_path(dnode, dst.port(), cfg.node, local.port());
    let tmp = cfg.path(format_args!(".o{}-{cookie:x}", sys::getpid()));
    let made = (|| -> Result<Seg, c_int> {
        let mf = sys::open(
            &tmp,
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o600,
        )? as c_int;
        // The segment is sparse: a write into a page the filesystem (a tmpfs /run) has no
        // room for would be SIGBUS in the program. Without ample room, the kernel's TCP.
        if sys::free_bytes(mf).is_ok_and(|free| free < 4 * len as u64) {
            let _ = sys::close(mf);
            return Err(libc::ENOSPC);
        }
        let r = sys::ftruncate(mf, len as u64)
            .and_then(|_| sys::mmap_shared(mf, len).map(|p| p as usize));
        let _ = sys::close(mf);
        let p = r? as *mut u8;
        // SAFETY: a fresh shared mapping of len bytes.
        let mut s = unsafe { Seg::from_raw(p, len) };
        s.init(&Offer {
            ring,
            cookie,
            pid: sys::getpid(),
            wake_fd: b,
            wake_ino: b_ino,
            dport: dst.port(),
            sport: local.port(),
            dnode,
            snode: cfg.node,
        });
        if let Err(e) = sys::rename(&tmp, &path) {
            // SAFETY: nothing else refers to the mapping.
            unsafe { s.unmap() };
            return Err(e);
        }
        Ok(s)
    })();
    let mut seg = match made {
        Ok(s) => s,
        Err(_) => {
            let _ = sys::unlink(&tmp);
            close_pair(a, a_own, b);
            return Err((Some(Fallback::Resources), None));
        }
    };
    let undo = |seg: &mut Seg| {
        let _ = sys::unlink(&path);
        // SAFETY: nothing else refers to the mapping.
        unsafe { seg.unmap() };
        close_pair(a, a_own, b);
    };
    match sys::connect(fd, addr, alen) {
        Ok(_) => {}
        Err(libc::EINPROGRESS) => {
            if let Err(e) = wait_connected(fd) {
                undo(&mut seg);
                return Err(match e {
                    Some(err) => (None, Some(sys::to_c(Err(err)))),
                    None => (
                        Some(Fallback::SlowConnect),
                        Some(sys::to_c(Err(libc::EINPROGRESS))),
                    ),
                });
            }
        }
        Err(e) => {
            undo(&mut seg);
            let why = (e == libc::EINTR).then_some(Fallback::SlowConnect);
            return Err((why, Some(sys::to_c(Err(e)))));
        }
    }
    let tcp = match swap_in(fd, a, cloexec) {
        Ok(t) => t,
        Err(_) => {
            undo(&mut seg);
            // Connected, on the kernel's TCP.
            config::fallback(Fallback::Resources, &dst);
            return Ok(0);
        }
    };
    let label = format!("{local} -> {dst} (fd {fd})");
    config::log(format_args!(
        "{label}: accelerated, offer made (ring {} KiB)",
        ring >> 10
    ));
    let c = Conn::new(Parts {
        seg,
        role: Role::Client,
        tcp,
        a: a_own,
        b,
        peer_wake: None,
        offer_path: Some(path),
        nonblock,
        peer_node: dnode,
        tx_shut: false,
        label,
    });
    crate::install(fd, c);
    Ok(0)
}

/// Waits up to a second for a non-blocking connect: Ok when connected, Err(Some(errno)) when
/// it failed, Err(None) when it is still in progress.
fn wait_connected(fd: c_int) -> Result<(), Option<c_int>> {
    let deadline = crate::conn::now_ns() + 1_000_000_000;
    loop {
        let left = deadline.saturating_sub(crate::conn::now_ns());
        if left == 0 {
            return Err(None);
        }
        let ts = libc::timespec {
            tv_sec: (left / 1_000_000_000) as libc::time_t,
            tv_nsec: (left % 1_000_000_000) as libc::c_long,
        };
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        match sys::ppoll(&mut p, 1, &ts) {
            Ok(0) => return Err(None),
            Ok(_) => break,
            Err(libc::EINTR) => continue,
            Err(e) => return Err(Some(e)),
        }
    }
    let mut err: c_int = 0;
    let mut len = 4 as socklen_t;
    sys::getsockopt(
        fd,
        libc::SOL_SOCKET,
        libc::SO_ERROR,
        &mut err as *mut c_int as *mut libc::c_void,
        &mut len,
    )
    .map_err(Some)?;
    if err != 0 {
        return Err(Some(err));
    }
    Ok(())
}

fn to_sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, socklen_t) {
    // SAFETY: plain data, zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            // SAFETY: plain data, zero is valid.
            let mut sin6: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
            sin6.sin6_scope_id = v6.scope_id();
            // SAFETY: sockaddr_storage is larger than sockaddr_in6 and suitably aligned.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in6, sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as socklen_t)
}

/// `accept4`: the kernel's accept, then, if the client offered, the claim.
///
/// # Safety
/// `addr`/`alen` as for accept4(2).
pub unsafe fn accept(
    lfd: c_int,
    addr: *mut libc::sockaddr,
    alen: *mut socklen_t,
    flags: c_int,
) -> isize {
    let Some(cfg) = config::get() else {
        return sys::to_c(sys::accept4(lfd, addr, alen, flags));
    };
    let t = match sys::accept4(lfd, addr, alen, flags) {
        Ok(t) => t as c_int,
        Err(e) => return sys::to_c(Err(e)),
    };
    if !crate::slot_free(t) {
        return t as isize;
    }
    let Some(peer) = sock_addr(t, true) else {
        return t as isize;
    };
    let Some(snode) = cfg.node_of(peer.ip()) else {
        return t as isize;
    };
    let Some(local) = sock_addr(t, false) else {
        return t as isize;
    };
    if let Err(why) = claim(cfg, t, local, peer, snode, flags) {
        config::fallback(why, &format_args!("{peer} -> {local} (fd {t})"));
    }
    t as isize
}

fn claim(
    cfg: &Config,
    t: c_int,
    local: SocketAddr,
    peer: SocketAddr,
    snode: u32,
    flags: c_int,
) -> Result<(), Fallback> {
    let path = cfg.offer_path(cfg.node, local.port(), snode, peer.port());
    let mf = match sys::open(&path, libc::O_RDWR | libc::O_CLOEXEC, 0) {
        Ok(f) => f as c_int,
        Err(_) => return Err(Fallback::NoOffer),
    };
    let size = sys::fstat(mf).map(|(_, s, _)| s).unwrap_or(0) as usize;
    if size < seg::HDR || size > seg::seg_len(seg::MAX_RING) {
        let _ = sys::close(mf);
        let _ = sys::unlink(&path);
        return Err(Fallback::BadOffer);
    }
    let map = sys::mmap_shared(mf, size);
    let _ = sys::close(mf);
    let Ok(p) = map else {
        return Err(Fallback::Resources);
    };
    // SAFETY: a fresh shared mapping of `size` bytes.
    let mut s = unsafe { Seg::from_raw(p, size) };
    let fail = |s: &mut Seg, why: Fallback| {
        // SAFETY: nothing else refers to the mapping.
        unsafe { s.unmap() };
        Err(why)
    };
    let (cpid, cwake, cino) = match s.validate(local.port(), peer.port(), cfg.node, snode) {
        Ok(v) => v,
        Err(e) => {
            config::log(format_args!("{peer} -> {local}: {e}"));
            let _ = sys::unlink(&path);
            return fail(&mut s, Fallback::BadOffer);
        }
    };
    let Some(peer_wake) = fetch_fd(cpid, cwake, cino) else {
        let _ = sys::unlink(&path);
        return fail(&mut s, Fallback::PeerUnreachable);
    };
    let nonblock = flags & libc::SOCK_NONBLOCK != 0;
    let Ok((a, a_own, b, b_ino)) = wake_pair(nonblock) else {
        close_hidden(peer_wake);
        return fail(&mut s, Fallback::Resources);
    };
    let tcp = match swap_in(t, a, flags & libc::SOCK_CLOEXEC != 0) {
        Ok(tcp) => tcp,
        Err(_) => {
            close_pair(a, a_own, b);
            close_hidden(peer_wake);
            return fail(&mut s, Fallback::Resources);
        }
    };
    if !s.claim(sys::getpid(), b, b_ino) {
        // Someone else claimed it: put the TCP socket back where the program expects it.
        let _ = sys::dup3(
            tcp,
            t,
            if flags & libc::SOCK_CLOEXEC != 0 {
                libc::O_CLOEXEC
            } else {
                0
            },
        );
        close_hidden(tcp);
        close_hidden(a_own);
        close_hidden(b);
        close_hidden(peer_wake);
        return fail(&mut s, Fallback::BadOffer);
    }
    let _ = sys::unlink(&path);
    let label = format!("{peer} -> {local} (fd {t})");
    config::log(format_args!(
        "{label}: accelerated, offer claimed (ring {} KiB)",
        s.ring() >> 10
    ));
    let c = Conn::new(Parts {
        seg: s,
        role: Role::Server,
        tcp,
        a: a_own,
        b,
        peer_wake: Some(peer_wake),
        offer_path: None,
        nonblock,
        peer_node: snode,
        tx_shut: false,
        label,
    });
    crate::install(t, c);
    Ok(())
}
