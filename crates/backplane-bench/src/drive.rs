//! The client's two loops — send as fast as the path takes it, and ping-pong — over any
//! [`Link`]. The engine runs them in its own thread for most paths; for a path whose client
//! must be a program of its own (the accelerated sockets are loaded into a process at its
//! start, with `LD_PRELOAD`), a `bench-peer` of kind `tcp-client` runs them and reports back.

use std::time::{Duration, Instant};

use anyhow::bail;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::link::{chunk_lens, put_stamp, stamp_of, touch, Link};
use crate::stats;

/// What a sending run did.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Sent {
    /// Payload bytes sent.
    pub bytes: u64,
    /// Datagrams sent (0 on a stream).
    pub dgrams: u64,
    /// Bytes sent during the warm-up, left out of the throughput window.
    pub skip: u64,
}

/// Sends messages of `size` bytes for `warm` + `dur`, then waits until they have left.
/// On a datagram path every datagram carries the next stamp from `base`.
pub fn send_for(
    link: &mut dyn Link,
    size: u64,
    base: u64,
    dur: Duration,
    warm: Duration,
) -> anyhow::Result<Sent> {
    let size_u = size as usize;
    let mut msg = vec![0x5Au8; size_u];
    let (dgram, chunks) = pieces(link, size_u);
    // Look at the clock about every 64 KiB.
    let every = (65_536 / size.max(1)).clamp(1, 256);
    let (mut sent, mut dgrams, mut skip, mut n) = (0u64, 0u64, None, 0u64);
    let t0 = Instant::now();
    let (warm_end, end) = (t0 + warm, t0 + warm + dur);
    loop {
        let mut off = 0;
        for &len in &chunks {
            let c = &mut msg[off..off + len];
            if dgram.is_some() {
                put_stamp(c, base + dgrams);
            }
            link.send(c)?;
            dgrams += 1;
            off += len;
        }
        sent += size;
        n += 1;
        if n.is_multiple_of(every) {
            let now = Instant::now();
            if skip.is_none() && now >= warm_end {
                skip = Some(sent);
            }
            if now >= end {
                break;
            }
        }
    }
    link.flush()?;
    Ok(Sent {
        bytes: sent,
        dgrams: if dgram.is_some() { dgrams } else { 0 },
        skip: skip.unwrap_or(0),
    })
}

/// The path's datagram size (None: a stream) and the lengths a message of `size` bytes goes
/// out in: one piece on a stream, datagrams of at most that size otherwise.
fn pieces(link: &dyn Link, size: usize) -> (Option<usize>, Vec<usize>) {
    let dgram = link.max_dgram();
    let chunks = match dgram {
        Some(m) => chunk_lens(size, m).collect(),
        None => vec![size],
    };
    (dgram, chunks)
}

/// What a ping-pong run measured.
pub struct Pinged {
    /// One-way latencies (ns) after the warm-up.
    pub hist: Histogram<u64>,
    /// Round trips given up on (lossy paths only).
    pub lost: u64,
    /// The stamp after the last round's.
    pub next_stamp: u64,
}

/// Ping-pong of `size`-byte messages for `warm` + `dur`: each round sends one message and
/// waits for the whole echo (round r's datagrams carry stamp r, counting from `base` + 1).
/// On a `lossy` path a round unanswered after 200 ms is counted lost; otherwise 10 s without
/// an echo is an error.
pub fn ping_for(
    link: &mut dyn Link,
    size: u64,
    base: u64,
    dur: Duration,
    warm: Duration,
    lossy: bool,
) -> anyhow::Result<Pinged> {
    let mut h = stats::new_histogram();
    let size_u = size as usize;
    let mut msg = vec![0xA5u8; size_u];
    let (dgram, chunks) = pieces(link, size_u);
    let give_up = if lossy {
        Duration::from_millis(200)
    } else {
        Duration::from_secs(10)
    };
    let (mut round, mut lost) = (base, 0u64);
    let t0 = Instant::now();
    let (warm_end, end) = (t0 + warm, t0 + warm + dur);
    loop {
        round += 1;
        let start = Instant::now();
        let mut off = 0;
        for &len in &chunks {
            let c = &mut msg[off..off + len];
            if dgram.is_some() {
                put_stamp(c, round);
            }
            link.send(c)?;
            off += len;
        }
        let deadline = start + give_up;
        let mut got = 0u64;
        let mut ok = true;
        while got < size {
            let now = Instant::now();
            if now >= deadline {
                ok = false;
                break;
            }
            let mut stamp = None;
            let n = link.recv(deadline - now, (size - got) as usize, &mut |p| {
                stamp = stamp_of(p);
                touch(p);
            })?;
            if let Some(n) = n {
                if dgram.is_none() || stamp == Some(round) {
                    got += n as u64;
                }
            }
        }
        let done = Instant::now();
        if !ok {
            if !lossy {
                bail!("no echo from the peer within {give_up:?}");
            }
            lost += 1;
        } else if done >= warm_end {
            let one_way = (done - start).as_nanos() as u64 / 2;
            h.record(one_way.max(1))?;
        }
        if done >= end {
            break;
        }
    }
    Ok(Pinged {
        hist: h,
        lost,
        next_stamp: round + 1,
    })
}

/// A histogram as (value, count) pairs, one per bucket that holds anything: how a client
/// process hands its latencies to the bench.
pub fn hist_to_pairs(h: &Histogram<u64>) -> Vec<(u64, u64)> {
    h.iter_recorded()
        .map(|v| (v.value_iterated_to(), v.count_at_value()))
        .collect()
}

/// The histogram of [`hist_to_pairs`]'s pairs (values out of range are refused).
pub fn hist_from_pairs(pairs: &[(u64, u64)]) -> anyhow::Result<Histogram<u64>> {
    let mut h = stats::new_histogram();
    for &(v, n) in pairs {
        h.record_n(v, n)?;
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_survives_the_trip_as_pairs() {
        let mut h = stats::new_histogram();
        for v in [1_000u64, 1_000, 1_200, 35_000, 2_000_000] {
            h.record(v).unwrap();
        }
        let back = hist_from_pairs(&hist_to_pairs(&h)).unwrap();
        assert_eq!(back.len(), h.len());
        for q in [0.0, 0.5, 0.9, 1.0] {
            assert_eq!(back.value_at_quantile(q), h.value_at_quantile(q));
        }
        assert!(hist_from_pairs(&[(u64::MAX, 1)]).is_err());
    }

    #[test]
    fn both_loops_run_over_a_stream_pair() {
        use crate::link::StreamLink;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let echo = std::thread::spawn(move || {
            let mut b = StreamLink::new(b);
            let mut got = 0u64;
            // Ping-pong of 100-byte messages until the other side hangs up.
            while let Ok(n) = b.recv(
                Duration::from_secs(5),
                100 - (got % 100) as usize,
                &mut |_| (),
            ) {
                got += n.unwrap_or(0) as u64;
                if n.is_some() && got.is_multiple_of(100) {
                    b.send(&[1u8; 100]).unwrap();
                }
            }
        });
        let mut a = StreamLink::new(a);
        let p = ping_for(
            &mut a,
            100,
            7,
            Duration::from_millis(30),
            Duration::ZERO,
            false,
        )
        .unwrap();
        assert!(!p.hist.is_empty() && p.lost == 0 && p.next_stamp > 8);
        drop(a);
        echo.join().unwrap();
    }
}
