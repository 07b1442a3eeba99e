//! `poll`, `select` and `epoll_wait` with accelerated connections among their descriptors:
//! spin briefly on the rings before the kernel sleep. An accelerated descriptor is a real
//! socket whose readiness the library keeps exact, so the kernel's answer is always right (the
//! real call is made after the spin, with the time spun taken off its timeout). What the spin
//! saves is the sleep and the wake-up — tens of microseconds each time a reader empties its
//! ring — which on a streaming connection decides whether the two sides run side by side or
//! take turns.
//!
//! `poll` and `select` may also answer from the rings alone, without the system call, when a
//! ring has bytes to read or room to write: a streaming reader calls `select` before each
//! `read` (iperf3's server does), and the call costs as much as copying 64 KiB. The
//! descriptors that are not accelerated (a listener, a pipe) are then not looked at, so at most
//! [`SKIP_OS`] answers in a row come from the rings before the kernel is asked again, unless
//! every descriptor of the call is an accelerated connection (libvma's `VMA_SELECT_SKIP_OS`
//! works the same way, with the same default).

use std::cell::Cell;
use std::sync::Mutex;

use libc::{c_int, c_void};

use crate::conn::{now_ns, spin, Conn};
use crate::{config, conn_of, sys};

/// epoll registrations of accelerated connections: (epoll fd, fd, connection, events).
static EPOLL: Mutex<Vec<(c_int, c_int, usize, u32)>> = Mutex::new(Vec::new());

/// Answers in a row a thread's `poll`/`select` may give from the rings alone, without asking
/// the kernel about the descriptors that are not accelerated.
pub const SKIP_OS: u32 = 4;

thread_local! {
    static SKIPPED: Cell<u32> = const { Cell::new(0) };
}

/// May this call answer from the rings (`all_ours`: every descriptor in it is an accelerated
/// connection, nothing else to ask the kernel about)? Counts the answers given that way.
fn may_skip_os(all_ours: bool) -> bool {
    all_ours
        || SKIPPED.with(|s| {
            let n = s.get();
            s.set(n.saturating_add(1));
            n < SKIP_OS
        })
}

/// The kernel was asked: the next calls may answer from the rings again.
fn asked_os() {
    SKIPPED.with(|s| s.set(0));
}

/// `poll`'s answer when a ring is ready: the number of entries ready, every entry's
/// `revents` set; 0, the entries untouched, when no ring is. The other descriptors are asked
/// about (the kernel's poll, no timeout) unless `skip_os()` says this answer may skip them.
fn poll_rings(set: &mut [libc::pollfd], skip_os: impl FnOnce() -> bool) -> c_int {
    let want = |p: &libc::pollfd| -> libc::c_short {
        let Some(c) = conn_of(p.fd) else {
            return 0;
        };
        let (r, w) = c.ring_ready();
        let mut ev = 0;
        if r {
            ev |= p.events & (libc::POLLIN | libc::POLLRDNORM);
        }
        if w {
            ev |= p.events & (libc::POLLOUT | libc::POLLWRNORM);
        }
        ev
    };
    // Two looks at the rings rather than a list of the first (no allocation per call): a
    // ring only gets readier for us between them, unless another thread reads meanwhile.
    if set.iter().all(|p| want(p) == 0) {
        return 0;
    }
    if !skip_os() {
        // The others, as the kernel sees them now (an accelerated one's entry is left out: a
        // negative descriptor is ignored by poll).
        let mut others: Vec<libc::pollfd> = set
            .iter()
            .map(|p| libc::pollfd {
                fd: if conn_of(p.fd).is_some() { -1 } else { p.fd },
                events: p.events,
                revents: 0,
            })
            .collect();
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        if sys::ppoll(others.as_mut_ptr(), others.len(), &zero).is_ok() {
            for (p, o) in set.iter_mut().zip(&others) {
                p.revents = o.revents;
            }
        }
        asked_os();
    } else {
        for p in set.iter_mut() {
            p.revents = 0;
        }
    }
    let mut n = 0;
    for p in set.iter_mut() {
        p.revents |= want(p);
        n += (p.revents != 0) as c_int;
    }
    n
}

/// `select`'s answer when a ring is ready, as [`poll_rings`] (`conns`: the accelerated
/// descriptors asked about, with read and write interest).
///
/// # Safety
/// As select(2): the sets, when non-null, hold `FD_SETSIZE` bits; every fd < `nfds`.
unsafe fn select_rings(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    conns: &[(c_int, &Conn, bool, bool)],
    skip_os: impl FnOnce() -> bool,
) -> c_int {
    let ready = |&(fd, c, rd, wr): &(c_int, &Conn, bool, bool)| {
        let (rr, ww) = c.ring_ready();
        (fd, rd && rr, wr && ww)
    };
    // Two looks at the rings, as in `poll_rings`.
    if !conns.iter().map(ready).any(|(_, a, b)| a || b) {
        return 0;
    }
    let sets = [r, w, e];
    let mut n = 0;
    if !skip_os() {
        // The others, as the kernel sees them now: our descriptors taken out of copies of
        // the sets, then the kernel's select without a timeout.
        // SAFETY: fd_set is plain bits; the copies are ours.
        let mut copies: [libc::fd_set; 3] = unsafe { std::mem::zeroed() };
        for (copy, &set) in copies.iter_mut().zip(&sets) {
            if !set.is_null() {
                // SAFETY: the caller's set, FD_SETSIZE bits.
                *copy = unsafe { *set };
                for &(fd, ..) in conns {
                    // SAFETY: our copy; fd < nfds <= FD_SETSIZE.
                    unsafe { libc::FD_CLR(fd, copy) };
                }
            }
        }
        let ptr = |i: usize, c: &mut [libc::fd_set; 3]| -> *mut libc::fd_set {
            if sets[i].is_null() {
                std::ptr::null_mut()
            } else {
                &mut c[i]
            }
        };
        let (pr, pw, pe) = (
            ptr(0, &mut copies),
            ptr(1, &mut copies),
            ptr(2, &mut copies),
        );
        let mut zero = libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        };
        let k = sys::select(nfds, pr, pw, pe, &mut zero);
        asked_os();
        for (i, &set) in sets.iter().enumerate() {
            if !set.is_null() {
                // SAFETY: the caller's set; the kernel's answer when it gave one, else empty.
                unsafe {
                    if k.is_ok() {
                        *set = copies[i];
                    } else {
                        libc::FD_ZERO(set);
                    }
                }
            }
        }
        n = k.unwrap_or(0) as c_int;
    } else {
        for set in sets {
            if !set.is_null() {
                // SAFETY: the caller's set of FD_SETSIZE bits.
                unsafe { libc::FD_ZERO(set) };
            }
        }
    }
    for (fd, rd, wr) in conns.iter().map(ready) {
        if rd {
            // SAFETY: as above; r is non-null when read interest was found in it.
            unsafe { libc::FD_SET(fd, r) };
            n += 1;
        }
        if wr {
            // SAFETY: as above, for w.
            unsafe { libc::FD_SET(fd, w) };
            n += 1;
        }
    }
    n
}

fn budget(timeout_ns: Option<u64>) -> u64 {
    let spin_ns = config::get().map_or(0, |c| c.spin_ns);
    timeout_ns.map_or(spin_ns, |t| t.min(spin_ns))
}

/// Spins until one of `conns` (connection, read, write) is ready; returns the nanoseconds spent.
/// Readers among them are marked spinning meanwhile, so their producers send no wake-up
/// byte, and one that has bytes at the end gets its byte from us at once: the kernel call
/// that follows does not sleep waiting for a byte still on its way.
fn spin_on(conns: &[(&Conn, bool, bool)], timeout_ns: Option<u64>) -> u64 {
    let t0 = now_ns();
    let readers: Vec<&Conn> = conns
        .iter()
        .filter(|&&(c, r, _)| r && c.spin_begin())
        .map(|&(c, _, _)| c)
        .collect();
    spin(budget(timeout_ns), || {
        conns.iter().any(|&(c, r, w)| c.ready(r, w))
    });
    for c in readers {
        c.spin_end();
    }
    now_ns().saturating_sub(t0)
}

/// Before a kernel call that may sleep on the descriptors: every wake-up byte their readers
/// owe (a spinner that saw bytes and answered from the rings) is queued, so the kernel sees
/// them readable.
fn pay_debts<'a>(conns: impl IntoIterator<Item = (&'a Conn, bool)>) {
    for (c, r) in conns {
        if r {
            c.pay_debt();
        }
    }
}

/// Calls `f` with a copy of the timeout at `tmo` (null stays null), as glibc does: the kernel
/// writes the time left into it, and the caller's is `const`.
///
/// # Safety
/// `tmo` is null or a readable timespec.
unsafe fn with_copy<R>(tmo: *const libc::timespec, f: impl FnOnce(*mut libc::timespec) -> R) -> R {
    // SAFETY: caller contract.
    let mut t = (!tmo.is_null()).then(|| unsafe { *tmo });
    f(t.as_mut()
        .map_or(std::ptr::null_mut(), |t| t as *mut libc::timespec))
}

/// `ppoll(2)`: not spun or answered from the rings (a program that passes a signal mask
/// wants the kernel's exact wait), but every wake-up byte its descriptors' readers owe is
/// paid first, so the kernel sees them readable.
///
/// # Safety
/// As ppoll(2).
pub unsafe fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    tmo: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if !fds.is_null() && n as usize <= 1 << 16 {
        // SAFETY: the caller's n pollfds.
        let set = unsafe { std::slice::from_raw_parts(fds, n as usize) };
        pay_debts(
            set.iter()
                .filter_map(|p| Some((conn_of(p.fd)?, p.events & libc::POLLIN != 0))),
        );
    }
    // SAFETY: tmo is the caller's timespec when non-null.
    unsafe {
        with_copy(tmo, |tp| {
            sys::to_c(sys::ppoll_mask(fds, n as usize, tp, mask)) as c_int
        })
    }
}

/// `pselect(2)`, as [`ppoll`].
///
/// # Safety
/// As pselect(2).
pub unsafe fn pselect(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tmo: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if !r.is_null() && (1..=libc::FD_SETSIZE as c_int).contains(&nfds) {
        // SAFETY: the caller's read set holds FD_SETSIZE bits; fd < nfds <= FD_SETSIZE.
        pay_debts((0..nfds).filter_map(|fd| unsafe {
            libc::FD_ISSET(fd, r)
                .then(|| conn_of(fd))
                .flatten()
                .map(|c| (c, true))
        }));
    }
    // SAFETY: tmo is the caller's timespec when non-null.
    unsafe {
        with_copy(tmo, |tp| {
            sys::to_c(sys::pselect(nfds, r, w, e, tp, mask)) as c_int
        })
    }
}

/// Spins with a millisecond timeout (-1: none) and returns what is left of it.
fn spin_ms(conns: &[(&Conn, bool, bool)], timeout_ms: c_int) -> c_int {
    let limit = (timeout_ms > 0).then(|| timeout_ms as u64 * 1_000_000);
    let spent = spin_on(conns, limit);
    if timeout_ms < 0 {
        timeout_ms
    } else {
        (timeout_ms as u64).saturating_sub(spent / 1_000_000) as c_int
    }
}

/// `poll(2)`.
///
/// # Safety
/// As poll(2): `fds` valid for `n` entries.
pub unsafe fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout_ms: c_int) -> c_int {
    let real = |t: c_int| sys::to_c(sys::poll(fds, n as usize, t)) as c_int;
    if timeout_ms == 0 || fds.is_null() || n == 0 || n > 1 << 16 {
        return real(timeout_ms);
    }
    // SAFETY: the caller's n pollfds.
    let set = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    let conns: Vec<(&Conn, bool, bool)> = set
        .iter()
        .filter_map(|p| {
            conn_of(p.fd).map(|c| {
                (
                    c,
                    p.events & libc::POLLIN != 0,
                    p.events & libc::POLLOUT != 0,
                )
            })
        })
        .collect();
    if conns.is_empty() {
        return real(timeout_ms);
    }
    let all_ours = conns.len() == set.len();
    let k = poll_rings(set, || may_skip_os(all_ours));
    if k > 0 {
        return k;
    }
    let left = spin_ms(&conns, timeout_ms);
    let k = poll_rings(set, || may_skip_os(all_ours));
    if k > 0 {
        return k;
    }
    asked_os();
    pay_debts(conns.iter().map(|&(c, r, _)| (c, r)));
    real(left)
}

/// `select(2)`.
///
/// # Safety
/// As select(2).
pub unsafe fn select(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    let real = |tv: *mut libc::timeval| sys::to_c(sys::select(nfds, r, w, e, tv)) as c_int;
    // SAFETY: tv is the caller's timeval when non-null.
    let timeout_ns = (!tv.is_null()).then(|| unsafe {
        (*tv).tv_sec.max(0) as u64 * 1_000_000_000 + (*tv).tv_usec.max(0) as u64 * 1000
    });
    if timeout_ns == Some(0) || !(1..=libc::FD_SETSIZE as c_int).contains(&nfds) {
        return real(tv);
    }
    let mut conns = Vec::new();
    let mut all_ours = true;
    for fd in 0..nfds {
        // SAFETY: the caller's fd_sets hold FD_SETSIZE bits; fd < nfds <= FD_SETSIZE.
        let (rd, wr, ex) = unsafe {
            (
                !r.is_null() && libc::FD_ISSET(fd, r),
                !w.is_null() && libc::FD_ISSET(fd, w),
                !e.is_null() && libc::FD_ISSET(fd, e),
            )
        };
        if rd || wr || ex {
            match conn_of(fd) {
                Some(c) => conns.push((fd, c, rd, wr)),
                None => all_ours = false,
            }
        }
    }
    if conns.is_empty() {
        return real(tv);
    }
    // SAFETY: the caller's sets (as select(2)); every fd in conns < nfds.
    let k = unsafe { select_rings(nfds, r, w, e, &conns, || may_skip_os(all_ours)) };
    if k > 0 {
        return k;
    }
    let spun: Vec<(&Conn, bool, bool)> = conns.iter().map(|&(_, c, rd, wr)| (c, rd, wr)).collect();
    let spent = spin_on(&spun, timeout_ns);
    // SAFETY: as above.
    let k = unsafe { select_rings(nfds, r, w, e, &conns, || may_skip_os(all_ours)) };
    if k > 0 {
        return k;
    }
    asked_os();
    pay_debts(spun.iter().map(|&(c, r, _)| (c, r)));
    if let Some(t) = timeout_ns {
        let left = t.saturating_sub(spent);
        // SAFETY: tv is the caller's, non-null here.
        unsafe {
            (*tv).tv_sec = (left / 1_000_000_000) as libc::time_t;
            (*tv).tv_usec = ((left % 1_000_000_000) / 1000) as libc::suseconds_t;
        }
    }
    real(tv)
}

/// Records an `epoll_ctl` the kernel accepted.
pub fn epoll_ctl(ep: c_int, op: c_int, fd: c_int, ev: *const libc::epoll_event) {
    let mut l = EPOLL.lock().unwrap_or_else(|e| e.into_inner());
    match op {
        libc::EPOLL_CTL_DEL => l.retain(|&(e, f, _, _)| !(e == ep && f == fd)),
        libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD => {
            let Some(c) = conn_of(fd) else {
                return;
            };
            let events = if ev.is_null() {
                0
            } else {
                // SAFETY: the kernel read the caller's event for ADD/MOD: it is valid.
                unsafe { (*ev).events }
            };
            l.retain(|&(e, f, _, _)| !(e == ep && f == fd));
            l.push((ep, fd, c as *const Conn as usize, events));
        }
        _ => {}
    }
}

/// A descriptor closed: forget its registrations (as an epoll set or as a member).
pub fn forget(fd: c_int) {
    let mut l = EPOLL.lock().unwrap_or_else(|e| e.into_inner());
    if !l.is_empty() {
        l.retain(|&(e, f, _, _)| e != fd && f != fd);
    }
}

/// `epoll_wait(2)` / `epoll_pwait(2)` (`sigmask` may be null).
///
/// # Safety
/// As epoll_pwait(2).
pub unsafe fn epoll_wait(
    ep: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout_ms: c_int,
    sigmask: *const libc::sigset_t,
) -> c_int {
    let real =
        |t: c_int| sys::to_c(sys::epoll_pwait(ep, evs, max, t, sigmask as *const c_void)) as c_int;
    if timeout_ms == 0 {
        return real(0);
    }
    let conns: Vec<(&Conn, bool, bool)> = {
        let l = EPOLL.lock().unwrap_or_else(|e| e.into_inner());
        l.iter()
            .filter(|&&(e, _, _, _)| e == ep)
            .map(|&(_, _, c, events)| {
                // SAFETY: recorded from a live table entry; connections are never freed.
                let c = unsafe { &*(c as *const Conn) };
                (
                    c,
                    events & libc::EPOLLIN as u32 != 0,
                    events & libc::EPOLLOUT as u32 != 0,
                )
            })
            .filter(|(c, _, _)| !c.ended())
            .collect()
    };
    if conns.is_empty() {
        return real(timeout_ms);
    }
    let left = spin_ms(&conns, timeout_ms);
    pay_debts(conns.iter().map(|&(c, r, _)| (c, r)));
    real(left)
}
