//! Asynchronous events (`ibv_get_async_event`, `ibv_ack_async_event`, `context->async_fd`).
//!
//! A context's `async_fd` is an eventfd (semaphore mode: one count per event, blocking unless
//! the program sets `O_NONBLOCK`, as it may on the kernel's) beside a queue of events. What
//! this fabric reports, as an HCA would:
//! - `IBV_EVENT_PORT_ERR` / `IBV_EVENT_PORT_ACTIVE` (port 1) when the node the process runs in
//!   leaves or reaches READY (its agent died; a restart brings it back with a new
//!   generation) — the same rule as `ibv_query_port`'s port state;
//! - `IBV_EVENT_DEVICE_FATAL` once when the fabric's supervisor is gone (the device is
//!   unplugged: nothing on the context works any more);
//! - `IBV_EVENT_CQ_ERR` (its CQ) when a CQ overruns (the poll that finds it also answers -1).
//!
//! The port and device events come from a thread per context that sleeps on the fabric's
//! epoch word (futex-woken on every node state change) and looks at the supervisor at least
//! every second, and on a word of its own that `ibv_close_device` changes and wakes
//! (`futex_waitv` on both: a wake of the epoch alone was lost when it came between the
//! thread's look at `closed` and its sleep, and the thread lived on for up to a second); its
//! own reference keeps the eventfd open until it has ended, so the number is never reused
//! under it.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backplane::fabric::Fabric;
use backplane::wire::NodeState;

use crate::abi::{symver, IbvAsyncEvent, IbvContext};
use crate::{ctx_of, set_errno};

/// `enum ibv_event_type` values this library reports.
pub(crate) mod kind {
    pub const CQ_ERR: u32 = 0;
    pub const PORT_ACTIVE: u32 = 9;
    pub const PORT_ERR: u32 = 10;
    pub const DEVICE_FATAL: u32 = 8;
}

/// A context's events and their descriptor.
pub(crate) struct Events {
    fd: OwnedFd,
    queue: Mutex<VecDeque<IbvAsyncEvent>>,
    /// Set at `ibv_close_device`: the watcher ends.
    closed: AtomicBool,
    /// Moved and woken at `ibv_close_device`: the watcher sleeps on it beside the epoch.
    bell: AtomicU32,
}

impl Events {
    /// A new, empty event queue with its eventfd.
    pub(crate) fn new() -> std::io::Result<Arc<Self>> {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Arc::new(Self {
            // SAFETY: a descriptor just made, owned by nobody else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            queue: Mutex::new(VecDeque::new()),
            closed: AtomicBool::new(false),
            bell: AtomicU32::new(0),
        }))
    }

    /// The descriptor the program sees as `async_fd`.
    pub(crate) fn raw_fd(&self) -> c_int {
        self.fd.as_raw_fd()
    }

    /// Queues an event and makes the descriptor readable for it.
    pub(crate) fn push(&self, e: IbvAsyncEvent) {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(e);
        let one = 1u64.to_ne_bytes();
        // SAFETY: our eventfd, 8 readable bytes.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// A port event for port 1.
    fn port(&self, kind: u32) {
        self.push(IbvAsyncEvent::port(kind, 1));
    }

    /// The watcher ends (at `ibv_close_device`), at once: the word it sleeps on changes
    /// after `closed` is set, so it either sees `closed` or finds the word moved.
    pub(crate) fn close(&self) {
        // SYNC POINT async-close (closer side): `closed` before the bell moves.
        self.closed.store(true, Ordering::SeqCst);
        self.bell.fetch_add(1, Ordering::SeqCst);
        backplane::sync::futex_wake(&self.bell);
    }
}

/// Starts the thread that reports node `slot`'s port and the supervisor's end as events.
pub(crate) fn watch(events: &Arc<Events>, fabric: Fabric, slot: u32) {
    let ev = events.clone();
    let ready = move |f: &Fabric| {
        f.node_info(slot)
            .map(|i| (i.state == NodeState::Ready, i.generation))
            .unwrap_or((false, 0))
    };
    let (mut up, mut generation) = ready(&fabric);
    let spawned = std::thread::Builder::new()
        .name("bp-ibv-async".into())
        // It holds little: a small stack (a program may open many contexts).
        .stack_size(256 << 10)
        .spawn(move || loop {
            // SYNC POINT async-close (watcher side): the bell is read before `closed`, so a
            // close after this look moves the bell from what the sleep below expects.
            let rung = ev.bell.load(Ordering::SeqCst);
            if ev.closed.load(Ordering::SeqCst) {
                return;
            }
            let seen = fabric.epoch().load(Ordering::Acquire);
            let (now_up, now_gen) = ready(&fabric);
            if now_up != up {
                ev.port(if now_up {
                    kind::PORT_ACTIVE
                } else {
                    kind::PORT_ERR
                });
            } else if now_up && now_gen != generation {
                // Down and back between two looks: both edges.
                ev.port(kind::PORT_ERR);
                ev.port(kind::PORT_ACTIVE);
            }
            (up, generation) = (now_up, now_gen);
            if fabric.supervisor_gone(Duration::ZERO) {
                ev.push(IbvAsyncEvent::port(kind::DEVICE_FATAL, 0));
                return;
            }
            backplane::sync::futex_wait_any(
                &[(fabric.epoch(), seen), (&ev.bell, rung)],
                Duration::from_secs(1),
            );
        });
    if let Err(e) = spawned {
        eprintln!("libibverbs (backplane): no asynchronous events on this context: {e}");
    }
}

/// `ibv_get_async_event`: the next event (waiting for one unless `async_fd` was made
/// non-blocking: then -1 with `EAGAIN`); 0, or -1 with errno.
///
/// # Safety
/// `event` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_get_async_event(
    context: *mut IbvContext,
    event: *mut IbvAsyncEvent,
) -> c_int {
    let Some(c) = ctx_of(context) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    if event.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    let ev = c.events.clone();
    loop {
        let mut count = [0u8; 8];
        // SAFETY: our eventfd, 8 writable bytes; blocks unless the program set O_NONBLOCK.
        let n = unsafe { libc::read(ev.raw_fd(), count.as_mut_ptr().cast(), 8) };
        if n != 8 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            return -1;
        }
        let next = ev
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front();
        if let Some(e) = next {
            // SAFETY: non-null; the caller promises it is writable.
            unsafe { event.write(e) };
            return 0;
        }
    }
}
symver!(bp_ibv_get_async_event, "ibv_get_async_event@@IBVERBS_1.1");

/// `ibv_ack_async_event`: nothing to do (objects are not kept alive for unacknowledged
/// events here: destroying one never waits).
#[no_mangle]
pub extern "C" fn bp_ibv_ack_async_event(_event: *mut IbvAsyncEvent) {}
symver!(bp_ibv_ack_async_event, "ibv_ack_async_event@@IBVERBS_1.1");
