//! The physical limit every path is compared with: single-thread `memcpy` bandwidth of a
//! buffer far larger than the caches, measured in the same run; and the optional background
//! memory writer (`--load`) that competes with the paths for memory bandwidth and a core, as
//! in the "UDP with memory access" experiment of seed 003.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Result of a memcpy measurement.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Memcpy {
    /// Buffer size copied per pass.
    pub bytes: u64,
    /// Best pass, MB/s (10^6 bytes per second).
    pub mb_per_s: f64,
    /// Median pass, MB/s.
    pub median_mb_per_s: f64,
    /// Microseconds per byte at the best pass: the latency slope of one copy.
    pub slope_us_per_byte: f64,
}

/// Copies a `bytes` buffer `passes` times (after touching both buffers once) and reports the
/// best and median bandwidth. Both buffers are page-aligned, as regions and windows are: two
/// heap buffers a few bytes apart modulo 4 KiB make `rep movsb` crawl on some CPUs (measured:
/// 3 instead of 40 GB/s at 64 and 256 KiB, depending on where the allocator put them). A pass
/// of a small buffer copies it several times (at least 64 KiB in all) so that the clock's own
/// cost does not count as copying time.
pub fn measure(bytes: usize, passes: usize) -> Memcpy {
    let a: Vec<u8> = (0..bytes + 4096).map(|i| i as u8).collect();
    let mut b = vec![0u8; bytes + 4096];
    let (ao, bo) = (a.as_ptr().align_offset(4096), b.as_ptr().align_offset(4096));
    let src = &a[ao..ao + bytes];
    let dst = &mut b[bo..bo + bytes];
    dst.copy_from_slice(src); // fault every page in before timing
    let reps = (65536 / bytes.max(1)).max(1);
    let mut rates = Vec::with_capacity(passes);
    for _ in 0..passes.max(1) {
        let t = Instant::now();
        for _ in 0..reps {
            dst.copy_from_slice(std::hint::black_box(src));
            std::hint::black_box(&mut *dst);
        }
        let s = t.elapsed().as_secs_f64().max(1e-9);
        rates.push((bytes * reps) as f64 / s / 1e6);
    }
    rates.sort_by(|a, b| a.total_cmp(b));
    let best = rates[rates.len() - 1];
    Memcpy {
        bytes: bytes as u64,
        mb_per_s: best,
        median_mb_per_s: rates[rates.len() / 2],
        slope_us_per_byte: 1.0 / best, // 1 / (MB/s) = µs per byte
    }
}

/// A background thread writing 8 MB blocks in a loop until dropped.
pub struct Load {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Load {
    /// Starts the writer.
    pub fn start() -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("bench-load".into())
            .spawn(move || {
                let mut block = vec![0u8; 8_000_000];
                let mut passes = 0u64;
                while !s.load(Ordering::Relaxed) {
                    block.fill(passes as u8);
                    std::hint::black_box(&mut block);
                    passes += 1;
                }
                passes
            })
            .expect("spawn the load thread");
        Load {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Buffer size for the in-cache memcpy: fits the L2 cache of any current core.
pub const IN_CACHE_BYTES: usize = 256 << 10;

/// Sleeps briefly; lets a just-stopped peer or load settle between measurements.
pub fn settle() {
    std::thread::sleep(Duration::from_millis(5));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memcpy_bandwidth_is_positive_and_slope_is_its_inverse() {
        let m = measure(1 << 20, 3);
        assert!(m.mb_per_s > 0.0 && m.median_mb_per_s > 0.0);
        assert!(m.median_mb_per_s <= m.mb_per_s);
        assert!((m.slope_us_per_byte * m.mb_per_s - 1.0).abs() < 1e-9);
    }

    #[test]
    fn the_load_thread_stops_when_dropped() {
        let l = Load::start();
        std::thread::sleep(Duration::from_millis(20));
        drop(l); // joins: the test would hang if it did not stop
    }
}
