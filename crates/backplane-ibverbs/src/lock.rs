//! The context's engine lock, biased towards the first thread that uses it.
//!
//! libibverbs programs may call one context from several threads, so every call that reaches
//! the engine holds this lock. Most programs (perftest, the pingpong examples) use a context
//! from one thread, and for them an atomic read-modify-write per call is pure cost: besides
//! its own cycles it is a full barrier, so each `ibv_post_recv` / `ibv_post_send` first waits
//! for the stores of the call before it (a consumer index the peer reads, a ring record) to
//! leave the store buffer — a cache-line transfer on the critical path of a SEND ping-pong
//! (about 5 % of `ib_send_lat` measured, more when transfers are slow).
//!
//! So the first thread to take the lock becomes its *owner* and from then on enters with a
//! plain store and load (`inside`, `owner`). Any other thread takes the shared flag (`busy`)
//! with a compare-and-swap and revokes the bias for good: it closes `owner`, runs
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` — a full barrier on every running thread of
//! the process — and waits until the owner is not inside. This is the asymmetric Dekker
//! pattern (liburcu, folly's `asymmetricHeavyBarrier`): the owner stores `inside` then loads
//! `owner` with only a compiler fence between; the revoker stores `owner` then issues the
//! heavy barrier then loads `inside`; the barrier guarantees that either the owner sees the
//! bias closed or the revoker sees it inside. Where membarrier cannot be registered (an old
//! kernel, a seccomp filter), the lock is never biased. `BACKPLANE_VERBS_SINGLE_THREADED=1`
//! (as `MLX5_SINGLE_THREADED=1` for mlx5) skips the lock altogether.

use std::sync::atomic::{compiler_fence, AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

/// `owner` when no thread has taken the lock yet.
const FREE: u64 = 0;
/// `owner` once the bias is revoked (or membarrier is unavailable): every thread uses `busy`.
const CLOSED: u64 = u64::MAX;

/// The lock (see the module's notes).
#[derive(Debug)]
pub(crate) struct EngineLock {
    /// The owner's thread (`pthread_self`), or FREE, or CLOSED.
    owner: AtomicU64,
    /// The owner is inside (written by the owner only, with plain stores).
    inside: AtomicBool,
    /// Held by non-owners (and by everyone once the bias is closed).
    busy: AtomicBool,
    /// No lock at all (the program promised one thread per context).
    none: bool,
}

/// A held lock; dropping it releases.
pub(crate) struct Held<'a>(Option<&'a AtomicBool>);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.0 {
            b.store(false, Ordering::Release);
        }
    }
}

/// Whether this process may use the asymmetric barrier (registered once).
fn membarrier_ok() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        use rustix::thread::{membarrier, MembarrierCommand};
        membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
    })
}

/// The calling thread's handle (`pthread_self`): a TCB address, never FREE (0) or CLOSED
/// (all ones).
#[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
#[inline(always)]
fn this_thread() -> u64 {
    // SAFETY: on x86_64 glibc the thread pointer (%fs) points at the thread's control block,
    // whose `self` field at offset 16 is what `pthread_self` returns (the TLS ABI the
    // compilers' stack protector at %fs:40 relies on too); a load from the calling thread's
    // own TCB, always mapped. Saves a call through the PLT per lock. (A user-space address:
    // neither marker, so no clamp on the owner's way in.)
    unsafe {
        let t: u64;
        core::arch::asm!("mov {}, qword ptr fs:[16]", out(reg) t, options(nostack, readonly, preserves_flags));
        t
    }
}

/// The calling thread's handle (`pthread_self`), kept off the two markers.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu")))]
#[inline(always)]
fn this_thread() -> u64 {
    // SAFETY: pthread_self has no preconditions; it reads the calling thread's handle.
    let t = unsafe { libc::pthread_self() } as u64;
    // A handle is a TCB address: never 0 or all ones, but keep the two markers out anyway.
    t.clamp(1, CLOSED - 1)
}

impl EngineLock {
    /// A lock; `none` for a program that uses the context from one thread only.
    pub(crate) fn new(none: bool) -> Self {
        Self {
            owner: AtomicU64::new(if membarrier_ok() { FREE } else { CLOSED }),
            inside: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            none,
        }
    }

    /// Waits for the engine to be free and holds it.
    #[inline]
    pub(crate) fn lock(&self) -> Held<'_> {
        if self.none {
            return Held(None);
        }
        let me = this_thread();
        if self.owner.load(Ordering::Relaxed) == me {
            self.inside.store(true, Ordering::Relaxed);
            // SYNC POINT bias-enter: a compiler fence only; a revoker's membarrier is the
            // hardware barrier between this store and the load below.
            compiler_fence(Ordering::SeqCst);
            if self.owner.load(Ordering::Relaxed) == me {
                // SYNC POINT bias-acquire: what the last holder of `busy` wrote is seen — a
                // revoker never releases `busy` while the bias is open, so the only other
                // holders came before the bias (none) — and our own earlier calls are ours.
                std::sync::atomic::fence(Ordering::Acquire);
                return Held(Some(&self.inside));
            }
            self.inside.store(false, Ordering::Release);
        }
        self.lock_other(me)
    }

    /// [`EngineLock::lock`] of a thread that is not the owner: the first caller becomes the
    /// owner (one atomic, once) and enters as one; any other takes the shared flag. Out of
    /// line: the owner's way in is a load, a store and a load (`ib_read_lat` takes the lock
    /// twice a READ).
    #[cold]
    #[inline(never)]
    fn lock_other(&self, me: u64) -> Held<'_> {
        if self.owner.load(Ordering::Relaxed) == FREE
            && self
                .owner
                .compare_exchange(FREE, me, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            // (The bias may be revoked before this enters: `lock` then takes `busy`.)
            return self.lock();
        }
        self.lock_shared()
    }

    /// Non-owners, and everyone once the bias is closed.
    #[cold]
    fn lock_shared(&self) -> Held<'_> {
        while self
            .busy
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        if self.owner.load(Ordering::Relaxed) != CLOSED {
            // Close the bias for good, then make sure the owner has seen that or is seen
            // inside, and wait for it to leave.
            self.owner.store(CLOSED, Ordering::SeqCst);
            use rustix::thread::{membarrier, MembarrierCommand};
            if membarrier(MembarrierCommand::PrivateExpedited).is_err() {
                // Registered but refused: not expected; a SeqCst fence is not enough for the
                // owner's side, so wait a scheduler tick's worth for it to be seen.
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            // SYNC POINT bias-revoke (acquire): the owner's critical section is over and its
            // writes are seen before ours begin.
            while self.inside.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
        }
        Held(Some(&self.busy))
    }

    /// Whether the lock is biased (a thread enters without an atomic read-modify-write).
    #[cfg(test)]
    fn biased(&self) -> bool {
        !matches!(self.owner.load(Ordering::Relaxed), FREE | CLOSED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::UnsafeCell;
    use std::sync::Arc;

    struct Guarded {
        lock: EngineLock,
        n: UnsafeCell<u64>,
    }
    // SAFETY: `n` is only touched with `lock` held (what the test checks).
    unsafe impl Sync for Guarded {}

    fn bump(g: &Guarded) {
        let _h = g.lock.lock();
        // SAFETY: the lock is held: no other thread is inside.
        unsafe {
            let v = std::ptr::read_volatile(g.n.get());
            for _ in 0..8 {
                std::hint::spin_loop();
            }
            std::ptr::write_volatile(g.n.get(), v + 1);
        }
    }

    #[test]
    fn one_thread_is_biased_and_a_second_thread_revokes_without_losing_an_increment() {
        let g = Arc::new(Guarded {
            lock: EngineLock::new(false),
            n: UnsafeCell::new(0),
        });
        for _ in 0..1000 {
            bump(&g);
        }
        assert_eq!(g.lock.biased(), membarrier_ok());
        // The owner keeps going while four more threads arrive: every increment is kept.
        const EACH: u64 = 200_000;
        let start = Arc::new(std::sync::Barrier::new(5));
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let (g, start) = (Arc::clone(&g), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    for _ in 0..EACH {
                        bump(&g);
                    }
                })
            })
            .collect();
        start.wait();
        for _ in 0..EACH {
            bump(&g);
        }
        for h in hs {
            h.join().unwrap();
        }
        assert!(!g.lock.biased());
        let _h = g.lock.lock();
        // SAFETY: the lock is held.
        assert_eq!(unsafe { *g.n.get() }, 1000 + 5 * EACH);
    }

    #[test]
    fn this_thread_is_pthread_self() {
        let mine = this_thread();
        // SAFETY: pthread_self has no preconditions.
        let libc_says = unsafe { libc::pthread_self() } as u64;
        assert_eq!(mine, libc_says.clamp(1, CLOSED - 1));
        let other = std::thread::spawn(this_thread).join().unwrap();
        assert_ne!(mine, other);
    }

    #[test]
    fn a_single_threaded_context_takes_no_lock() {
        let l = EngineLock::new(true);
        let a = l.lock();
        let b = l.lock(); // would spin for ever with a lock
        drop((a, b));
        assert!(!l.biased());
    }
}
