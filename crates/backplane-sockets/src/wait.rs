//! `poll`, `select` and `epoll_wait` with accelerated connections among their descriptors:
//! spin briefly on the rings before the kernel sleep. The answer is always the kernel's (the
//! real call is made afterwards, with the time spun taken off its timeout): an accelerated
//! descriptor is a real socket whose readiness the library keeps exact. What the spin saves is
//! the sleep and the wake-up — tens of microseconds each time a reader empties its ring —
//! which on a streaming connection decides whether the two sides run side by side or take
//! turns.

use std::sync::Mutex;

use libc::{c_int, c_void};

use crate::conn::{now_ns, spin, Conn};
use crate::{config, conn_of, sys};

/// epoll registrations of accelerated connections: (epoll fd, fd, connection, events).
static EPOLL: Mutex<Vec<(c_int, c_int, usize, u32)>> = Mutex::new(Vec::new());

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
    let set = unsafe { std::slice::from_raw_parts(fds, n as usize) };
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
    real(spin_ms(&conns, timeout_ms))
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
    for fd in 0..nfds {
        // SAFETY: the caller's fd_sets hold FD_SETSIZE bits; fd < nfds <= FD_SETSIZE.
        let (rd, wr) = unsafe {
            (
                !r.is_null() && libc::FD_ISSET(fd, r),
                !w.is_null() && libc::FD_ISSET(fd, w),
            )
        };
        if rd || wr {
            if let Some(c) = conn_of(fd) {
                conns.push((c, rd, wr));
            }
        }
    }
    if conns.is_empty() {
        return real(tv);
    }
    let spent = spin_on(&conns, timeout_ns);
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
    real(spin_ms(&conns, timeout_ms))
}
