//! Synchronisation primitives shared across processes: the atomics (one module, swapped for
//! loom's under `--cfg loom`), futex wait/wake on shared memory, and spin-then-sleep waiting.
//!
//! Futexes here are *shared* (no `FUTEX_PRIVATE_FLAG`): the words live in `MAP_SHARED` memfd
//! mappings and are waited on from several processes.

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use std::time::{Duration, Instant};

/// How many polls a waiter spins before it arms its doorbell and sleeps. About 20–50 µs on
/// current CPUs: long enough to catch a ping-pong reply, short enough that idle costs nothing.
pub const SPIN_POLLS: u32 = 4000;

/// On a fabric that spans hosts a spinning waiter gives its CPU away every this many polls:
/// the bridge thread it waits for needs one. (Two hosts on a 2-vCPU VM, two spinning
/// `perf dgram-lat` sides: 75–83 µs one way without, 15–25 with.)
pub const YIELD_POLLS: u32 = 64;

/// One poll of a spinning waiter: a PAUSE, or, on every `yield_every`th poll (0: never), the
/// rest of its time slice to whatever else is runnable here (`sched_yield`; returns at once
/// when nothing is).
#[inline]
pub fn relax(spins: u32, yield_every: u32) {
    if yield_every != 0 && spins.is_multiple_of(yield_every) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Sleeps until `word` no longer holds `expected`, someone wakes it, or `timeout` passes.
/// Spurious returns are allowed; callers re-check their condition.
#[cfg(not(loom))]
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    use rustix::thread::futex;
    let ts = timeout.map(|d| rustix::time::Timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as _,
        tv_nsec: d.subsec_nanos().into(),
    });
    // Errors (EAGAIN: the word already changed, EINTR, ETIMEDOUT) all mean "go and re-check".
    let _ = futex::wait(word, futex::Flags::empty(), expected, ts.as_ref());
}

/// Sleeps until any of `words` no longer holds its expected value, someone wakes one of them,
/// or `timeout` passes (`futex_waitv`, Linux 5.16; at most 128 words, the rest are not
/// watched; before 5.16 only the first). Spurious returns are allowed; callers re-check
/// their conditions.
#[cfg(not(loom))]
pub fn futex_wait_any(words: &[(&AtomicU32, u32)], timeout: Duration) {
    use rustix::thread::futex;
    let waits: Vec<futex::Wait> = words
        .iter()
        .take(128)
        .map(|&(w, v)| {
            let mut x = futex::Wait::new();
            x.val = u64::from(v);
            x.uaddr = futex::WaitPtr::new(std::ptr::from_ref(w).cast_mut().cast());
            x.flags = futex::WaitFlags::SIZE_U32;
            x
        })
        .collect();
    // futex_waitv's timeout is absolute.
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let ns = now.tv_nsec as u64 + u64::from(timeout.subsec_nanos());
    let until = rustix::time::Timespec {
        tv_sec: now.tv_sec + timeout.as_secs() as i64 + (ns / 1_000_000_000) as i64,
        tv_nsec: (ns % 1_000_000_000) as _,
    };
    // Errors (EAGAIN: a word already changed, ETIMEDOUT, EINTR) all mean "go and re-check";
    // a kernel before 5.16 has no futex_waitv: there the first word alone is watched (a
    // caller that returned at once would spin).
    if let Err(rustix::io::Errno::NOSYS) = futex::waitv(
        &waits,
        futex::WaitvFlags::empty(),
        Some(&until),
        rustix::time::ClockId::Monotonic,
    ) {
        if let Some(&(w, v)) = words.first() {
            futex_wait(w, v, Some(timeout));
        }
    }
}

/// Wakes every waiter sleeping on `word`.
#[cfg(not(loom))]
pub fn futex_wake(word: &AtomicU32) {
    use rustix::thread::futex;
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

/// Asks the CPU to start loading the cache line at `p` (a hint: never faults, never blocks,
/// changes no memory). A consumer polling an index issues it for the record the index will
/// announce, so the two lines the producer wrote travel at the same time instead of one
/// after the other.
#[inline(always)]
pub fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint with no architectural effect: it does not fault on any
    // address, mapped or not, and reads or writes no memory visible to the program.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Asks for the cache line holding `p` in a state that can be written (PREFETCHW), so a store
/// that follows finds it owned instead of waiting for the other cores' copies to go at commit.
#[inline(always)]
pub fn prefetch_write(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHW is a hint with no architectural effect: it does not fault on any
    // address, mapped or not, and reads or writes no memory visible to the program.
    unsafe {
        core::arch::asm!("prefetchw byte ptr [{p}]", p = in(reg) p, options(nostack, preserves_flags, readonly));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Rings a doorbell: bumps its futex word and wakes sleepers.
#[cfg(not(loom))]
pub fn ring(word: &AtomicU32) {
    word.fetch_add(1, Ordering::Release);
    futex_wake(word);
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process on the host (link emulation
/// stamps delivery times with it).
#[cfg(not(loom))]
pub fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// A clock in nanoseconds for one process's own bookkeeping — stamps compared only with this
/// clock's other readings in the same process, never with [`now_ns`] nor across processes:
/// the time-stamp counter scaled to nanoseconds once it is calibrated against
/// CLOCK_MONOTONIC (its first 20 ms it *is* [`now_ns`]), where the kernel keeps
/// time with the TSC itself (so it runs at one rate on every CPU); [`now_ns`] elsewhere.
///
/// Why not [`now_ns`]: a queue pair between hosts read the clock two or three times a turn
/// of a program's poll loop and once a post (stamps that keep the pair's thread out of the
/// way, lingers of acks), and the vDSO's serialized TSC read waits for the loads before it:
/// ~4 % of `perf send-lat`'s answering process, the post's share on the way to `sendmsg`.
#[cfg(not(loom))]
#[inline]
pub fn fast_ns() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        let mult = TSC_MULT.load(Ordering::Acquire);
        if mult > 1 {
            let ticks = tsc().wrapping_sub(TSC_BASE.load(Ordering::Relaxed));
            let ns = (u128::from(ticks) * u128::from(mult)) >> 32;
            return NS_BASE.load(Ordering::Relaxed).wrapping_add(ns as u64);
        }
        if mult == 0 {
            return calibrate();
        }
    }
    now_ns()
}

/// How long [`fast_ns`] measures the TSC's rate against CLOCK_MONOTONIC before it uses it.
#[cfg(all(not(loom), target_arch = "x86_64"))]
const CAL_SPAN_NS: u64 = 20_000_000;
/// Nanoseconds per TSC tick in 32.32 fixed point once calibrated; 0 while calibrating, 1
/// when the TSC is not used.
#[cfg(all(not(loom), target_arch = "x86_64"))]
static TSC_MULT: AtomicU64 = AtomicU64::new(0);
/// The TSC and CLOCK_MONOTONIC read together when calibration began.
#[cfg(all(not(loom), target_arch = "x86_64"))]
static TSC_BASE: AtomicU64 = AtomicU64::new(0);
#[cfg(all(not(loom), target_arch = "x86_64"))]
static NS_BASE: AtomicU64 = AtomicU64::new(0);
/// Calibration began (the bases are set).
#[cfg(all(not(loom), target_arch = "x86_64"))]
static CAL_STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[cfg(all(not(loom), target_arch = "x86_64"))]
#[inline(always)]
fn tsc() -> u64 {
    // SAFETY: RDTSC reads a counter; it has no memory effects and every x86_64 CPU has it.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// [`fast_ns`] before the TSC's rate is known: CLOCK_MONOTONIC, and the rate measured once
/// [`CAL_SPAN_NS`] passed since the first reading.
#[cfg(all(not(loom), target_arch = "x86_64"))]
#[cold]
#[inline(never)]
fn calibrate() -> u64 {
    let now = now_ns();
    let ticks = tsc();
    if !CAL_STARTED.load(Ordering::Acquire) {
        static BEGIN: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _g = BEGIN.lock().unwrap_or_else(|e| e.into_inner());
        if !CAL_STARTED.load(Ordering::Acquire) {
            // Only where the kernel itself keeps time with the TSC: it checked the counter
            // is invariant and in step on every CPU.
            let tsc_clock = std::fs::read_to_string(
                "/sys/devices/system/clocksource/clocksource0/current_clocksource",
            )
            .is_ok_and(|s| s.trim() == "tsc");
            if !tsc_clock {
                TSC_MULT.store(1, Ordering::Release);
                return now;
            }
            TSC_BASE.store(ticks, Ordering::Relaxed);
            NS_BASE.store(now, Ordering::Relaxed);
            CAL_STARTED.store(true, Ordering::Release);
        }
        return now;
    }
    let (ns0, t0) = (
        NS_BASE.load(Ordering::Relaxed),
        TSC_BASE.load(Ordering::Relaxed),
    );
    let (dns, dt) = (now.saturating_sub(ns0), ticks.wrapping_sub(t0));
    if dns >= CAL_SPAN_NS && dt != 0 {
        let mult = (u128::from(dns) << 32) / u128::from(dt);
        // (0.1 to 20 GHz, or not a counter to trust.)
        let sane = (1u128 << 32) / 20..=(10u128 << 32);
        let m = if sane.contains(&mult) { mult as u64 } else { 1 };
        let _ = TSC_MULT.compare_exchange(0, m, Ordering::AcqRel, Ordering::Acquire);
    }
    now
}

/// A deadline helper: `None` means wait forever.
#[derive(Debug, Clone, Copy)]
pub struct Deadline(Option<Instant>);

impl Deadline {
    /// A deadline `timeout` from now, or never.
    pub fn after(timeout: Option<Duration>) -> Self {
        Self(timeout.map(|t| Instant::now() + t))
    }
    /// Time left; `Some(ZERO)` once passed, `None` for "forever".
    pub fn remaining(&self) -> Option<Duration> {
        self.0.map(|d| d.saturating_duration_since(Instant::now()))
    }
    /// True once the deadline has passed.
    pub fn expired(&self) -> bool {
        matches!(self.remaining(), Some(d) if d.is_zero())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_fast_clock_keeps_pace_with_clock_monotonic_and_never_goes_back() {
        // Through its calibration and after it (it uses the TSC from 20 ms on).
        let (f0, n0) = (fast_ns(), now_ns());
        let mut last = f0;
        while now_ns() - n0 < 60_000_000 {
            let f = fast_ns();
            // (A reading a few ns behind the last one on another CPU would be in step, but
            // one thread's readings only go forward.)
            assert!(f + 1_000 >= last, "went back: {last} -> {f}");
            last = last.max(f);
        }
        let (f1, n1) = (fast_ns(), now_ns());
        std::thread::sleep(Duration::from_millis(30));
        let (f2, n2) = (fast_ns(), now_ns());
        let (df, dn) = ((f2 - f1) as f64, (n2 - n1) as f64);
        assert!((df / dn - 1.0).abs() < 0.01, "fast {df} ns against {dn} ns");
        // Continuous across the switch from CLOCK_MONOTONIC: no jump beyond a reading's cost.
        assert!(
            (f1 as f64 - n1 as f64).abs() < 1_000_000.0,
            "{f1} against {n1}"
        );
    }
}
