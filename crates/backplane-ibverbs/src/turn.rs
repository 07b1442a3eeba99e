//! A critical region one thread holds across several calls of the program: the extended
//! APIs' `ibv_wr_start` … `ibv_wr_complete` on a QP and `ibv_start_poll` … `ibv_end_poll` on
//! a CQ, which providers lock per object (rdma-core's `ibv_wr_post(3)`, `ibv_create_cq_ex(3)`).
//! The state built in the region sits in an `UnsafeCell` beside the [`Turn`] and is touched
//! only by the thread that holds it.

use std::sync::atomic::{AtomicUsize, Ordering};

thread_local! {
    static TOKEN: u8 = const { 0 };
}

/// This thread's token: the address of its thread-local byte (non-zero, unique among live
/// threads).
fn me() -> usize {
    TOKEN.with(|t| std::ptr::from_ref(t) as usize)
}

/// Who is inside the region: a thread's token, or 0.
#[derive(Default)]
pub(crate) struct Turn(AtomicUsize);

impl Turn {
    /// Enters the region, waiting (yielding) while another thread is inside; a thread already
    /// inside stays (a second start without an end neither deadlocks nor resets anything
    /// here). True if the thread entered now, false if it was inside already.
    pub(crate) fn enter(&self) -> bool {
        let me = me();
        if self.0.load(Ordering::Relaxed) == me {
            return false;
        }
        while self
            .0
            .compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
        true
    }

    /// True if the calling thread is inside.
    pub(crate) fn held(&self) -> bool {
        self.0.load(Ordering::Acquire) == me()
    }

    /// Leaves the region (the caller is inside: see [`Turn::held`]).
    pub(crate) fn leave(&self) {
        self.0.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_thread_at_a_time_and_the_holder_may_enter_again() {
        let t = std::sync::Arc::new(Turn::default());
        assert!(!t.held());
        assert!(t.enter());
        assert!(!t.enter(), "already inside");
        assert!(t.held());
        let t2 = t.clone();
        let other = std::thread::spawn(move || {
            assert!(!t2.held());
            assert!(t2.enter(), "waits, then enters");
            t2.leave();
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            !other.is_finished(),
            "the other thread waits while this one is inside"
        );
        t.leave();
        other.join().unwrap();
        assert!(!t.held());
    }
}
