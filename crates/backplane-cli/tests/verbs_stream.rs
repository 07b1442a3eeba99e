//! The bench's fabric-verbs paths (`backplane_bench::verbs_link`): a byte stream over
//! RDMA_WRITE_WITH_IMM, SEND or announced RDMA_READs. Everything sent arrives once, in
//! order, whatever the piece sizes (inline, staged, larger than a chunk, wrapping the ring
//! many times), in every mode. (Here rather than beside the bench: it starts fabrics with the
//! `backplane` binary this crate builds.)

mod common;
use common::*;

use std::time::Duration;

use backplane::fabric::Fabric;
use backplane_bench::link::Link;
use backplane_bench::verbs_link::{Mode, VerbsLink, CHUNK, INLINE, RING, SEND_CHUNK};

/// A deterministic byte stream: byte i of the stream.
fn byte(i: u64) -> u8 {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

#[test]
fn a_write_stream_delivers_every_byte_once_in_order_across_ring_wraps() {
    stream(Mode::WriteImm, "verbs-stream-write");
}

#[test]
fn a_send_stream_delivers_every_byte_once_in_order_across_ring_wraps() {
    stream(Mode::Send, "verbs-stream-send");
}

#[test]
fn a_read_stream_delivers_every_byte_once_in_order_across_ring_wraps() {
    stream(Mode::Read, "verbs-stream-read");
}

fn stream(mode: Mode, test: &str) {
    let fab = Fab::up(test, 2, &[]);
    let name = fab.name.clone();
    // Piece sizes around every boundary of the protocol.
    let pieces: Vec<usize> = [
        1,
        INLINE,
        INLINE + 1,
        4096,
        CHUNK - 1,
        CHUNK,
        CHUNK + 1,
        SEND_CHUNK + 1,
        RING - 3,
        3 * RING + 17,
        63,
    ]
    .iter()
    .copied()
    .cycle()
    .take(40)
    .collect();
    let total: u64 = pieces.iter().map(|&p| p as u64).sum();
    let receiver = std::thread::spawn(move || {
        let f = Fabric::attach(&name).unwrap();
        let mut l =
            VerbsLink::accept(&f.node(2).unwrap(), 7001, mode, Duration::from_secs(10)).unwrap();
        let mut got = 0u64;
        let mut bad = None;
        while got < total {
            // Odd read sizes: a chunk is handed over in several parts.
            let max = [1usize, 100, 5000, 1 << 20][(got % 4) as usize];
            let n = l
                .recv(Duration::from_secs(10), max, &mut |p| {
                    for (k, &b) in p.iter().enumerate() {
                        if bad.is_none() && b != byte(got + k as u64) {
                            bad = Some(got + k as u64);
                        }
                    }
                })
                .unwrap()
                .expect("the stream stalled for 10 s");
            assert!(n <= max);
            got += n as u64;
        }
        // Nothing beyond what was sent.
        let extra = l
            .recv(Duration::from_millis(50), 1 << 20, &mut |_| {})
            .unwrap();
        (got, bad, extra)
    });
    let f = Fabric::attach(&fab.name).unwrap();
    let mut l =
        VerbsLink::connect(&f.node(1).unwrap(), 2, 7001, mode, Duration::from_secs(10)).unwrap();
    let mut pos = 0u64;
    for p in &pieces {
        let data: Vec<u8> = (pos..pos + *p as u64).map(byte).collect();
        l.send(&data).unwrap();
        pos += *p as u64;
    }
    l.flush().unwrap();
    let (got, bad, extra) = receiver.join().unwrap();
    assert_eq!(got, total);
    assert_eq!(bad, None, "first wrong byte");
    assert_eq!(extra, None);
}
