//! The window allocator: hands out cache-line-aligned ranges of a node window's heap to
//! endpoint records, rings and credit lines. Supervisor-private (never in shared memory).
//!
//! Freed ranges sit in quarantine for [`QUARANTINE`] before reuse, so a peer that has not yet
//! seen a "closed" flag and writes one last record lands in memory nobody else owns yet.
//! Sans-IO: time comes in as `now`.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long freed memory waits before it can be handed out again.
pub const QUARANTINE: Duration = Duration::from_secs(1);

/// What [`WindowAlloc::full_message`] says when freed ranges wait in quarantine: a client that
/// meets it may retry within [`QUARANTINE`] (`Fabric::call_service` does).
pub const REUSABLE_SOON: &str = "freed less than";

/// The refusal for a full window, on node `slot`.
pub fn window_full(slot: u32) -> String {
    format!("node {slot}'s window is full; use a larger --window-size")
}

/// First-fit allocator over `[base, end)`.
#[derive(Debug, Clone)]
pub struct WindowAlloc {
    free: BTreeMap<u64, u64>,
    quarantine: Vec<(Instant, u64, u64)>,
    base: u64,
    end: u64,
}

impl WindowAlloc {
    /// An allocator over `[base, end)`; `base` must be cache-line aligned.
    pub fn new(base: u64, end: u64) -> Self {
        let mut free = BTreeMap::new();
        if end > base {
            free.insert(base, end - base);
        }
        Self {
            free,
            quarantine: Vec::new(),
            base,
            end,
        }
    }

    /// Allocates `len` bytes aligned to `align` (a power of two ≥ 64). `None` when full.
    pub fn alloc(&mut self, len: u64, align: u64, now: Instant) -> Option<u64> {
        self.reclaim(now);
        let len = len.div_ceil(64) * 64;
        let (start, size, at) = self.free.iter().find_map(|(&s, &n)| {
            let at = s.div_ceil(align) * align;
            (at + len <= s + n).then_some((s, n, at))
        })?;
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        if at + len < start + size {
            self.free.insert(at + len, start + size - at - len);
        }
        Some(at)
    }

    /// Returns a range; it becomes reusable after [`QUARANTINE`].
    pub fn free(&mut self, off: u64, len: u64, now: Instant) {
        let len = len.div_ceil(64) * 64;
        debug_assert!(off >= self.base && off + len <= self.end);
        self.quarantine.push((now + QUARANTINE, off, len));
    }

    /// Drops every allocation at once (a node rejoining with a fresh window).
    pub fn reset(&mut self) {
        *self = Self::new(self.base, self.end);
    }

    /// What to tell a client this allocator refused, on node `slot`: the window is full — and,
    /// when ranges freed less than [`QUARANTINE`] ago are waiting, that retrying soon may
    /// succeed (a program run again right after it exited finds its last run's memory there).
    pub fn full_message(&self, slot: u32, now: Instant) -> String {
        let waiting: u64 = self
            .quarantine
            .iter()
            .filter(|&&(t, _, _)| t > now)
            .map(|&(_, _, len)| len)
            .sum();
        if waiting == 0 {
            window_full(slot)
        } else {
            format!(
                "node {slot}'s window is full ({} KiB {REUSABLE_SOON} {} s ago are reusable \
                 then: retry, or use a larger --window-size)",
                waiting.div_ceil(1024),
                QUARANTINE.as_secs()
            )
        }
    }

    /// Bytes free now (quarantined bytes excluded).
    pub fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }

    fn reclaim(&mut self, now: Instant) {
        let (ready, wait): (Vec<_>, Vec<_>) =
            self.quarantine.drain(..).partition(|&(t, _, _)| t <= now);
        self.quarantine = wait;
        for (_, off, len) in ready {
            self.insert_merged(off, len);
        }
    }

    fn insert_merged(&mut self, mut off: u64, mut len: u64) {
        if let Some((&s, &n)) = self.free.range(..off).next_back() {
            if s + n == off {
                self.free.remove(&s);
                off = s;
                len += n;
            }
        }
        if let Some(&n) = self.free.get(&(off + len)) {
            self.free.remove(&(off + len));
            len += n;
        }
        self.free.insert(off, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_hands_out_disjoint_aligned_ranges_until_full() {
        let now = Instant::now();
        let mut a = WindowAlloc::new(4096, 4096 + 64 * 1024);
        let x = a.alloc(4096, 4096, now).unwrap();
        let y = a.alloc(128, 64, now).unwrap();
        let z = a.alloc(4096, 4096, now).unwrap();
        assert_eq!(x % 4096, 0);
        assert_eq!(z % 4096, 0);
        assert!(y >= x + 4096 || y + 128 <= x);
        assert!(z >= y + 128);
        assert!(a.alloc(1 << 20, 64, now).is_none());
    }

    #[test]
    fn a_full_window_with_memory_in_quarantine_says_a_retry_may_succeed() {
        let t0 = Instant::now();
        let mut a = WindowAlloc::new(0, 8192);
        let x = a.alloc(8192, 64, t0).unwrap();
        assert!(a.alloc(64, 64, t0).is_none());
        let plain = a.full_message(3, t0);
        assert_eq!(plain, "node 3's window is full; use a larger --window-size");
        a.free(x, 8192, t0);
        assert!(a.alloc(64, 64, t0).is_none());
        let m = a.full_message(3, t0);
        assert!(
            m.contains("8 KiB freed less than 1 s ago") && m.contains("retry"),
            "{m}"
        );
        assert_eq!(
            a.full_message(3, t0 + QUARANTINE),
            plain,
            "once reusable: plain"
        );
    }

    #[test]
    fn freed_memory_is_quarantined_then_merged_and_reused() {
        let t0 = Instant::now();
        let mut a = WindowAlloc::new(0, 8192);
        let x = a.alloc(4096, 64, t0).unwrap();
        let y = a.alloc(4096, 64, t0).unwrap();
        assert!(a.alloc(64, 64, t0).is_none());
        a.free(x, 4096, t0);
        a.free(y, 4096, t0);
        assert!(
            a.alloc(64, 64, t0).is_none(),
            "quarantined memory must not be reused"
        );
        let later = t0 + QUARANTINE;
        assert_eq!(a.alloc(8192, 64, later), Some(0), "neighbours merge back");
    }

    #[test]
    fn reset_frees_everything_at_once() {
        let now = Instant::now();
        let mut a = WindowAlloc::new(0, 8192);
        a.alloc(8192, 64, now).unwrap();
        a.reset();
        assert_eq!(a.free_bytes(), 8192);
    }
}
