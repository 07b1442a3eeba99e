//! The counters of accelerated sockets (`backplane exec --accel`, the `backplane-sockets`
//! crate's `libbackplane_sockets.so`): each node's file `n{slot}.stats` in the fabric's
//! `accel` directory, 4 KiB of little-endian u64 words that every accelerated program of the
//! node adds to. This module is the reader `status` uses; the library writes the same layout
//! (its own copy of these numbers is checked against this one by its tests).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Word 0: "BPACSTA1".
pub const STATS_MAGIC: u64 = u64::from_le_bytes(*b"BPACSTA1");
/// Word: connections accelerated (each end counts its own).
pub const CONNS: usize = 1;
/// Word: bytes sent over rings.
pub const TX_BYTES: usize = 2;
/// Word: bytes received over rings.
pub const RX_BYTES: usize = 3;
/// Word: connections ended because their ring memory was corrupt.
pub const CORRUPT: usize = 4;
/// Word: accelerated connections open now.
pub const OPEN: usize = 5;
/// First fallback word: `FALLBACK + reason`, reasons in [`FALLBACK_NAMES`]' order.
pub const FALLBACK: usize = 8;
/// Words in the file.
pub const WORDS: usize = 512;
/// Why a connection stayed on the kernel's TCP, by index.
pub const FALLBACK_NAMES: [&str; 6] = [
    "peer-not-accelerated",
    "no-offer",
    "bad-offer",
    "slow-connect",
    "peer-unreachable",
    "resources",
];

/// The file, in the `accel` directory, where the supervisor keeps every node's state and
/// generation for the library: one little-endian u64 per slot (slot `s` at word `s - 1`),
/// `generation << 32 | state`, stored whole on every transition. A connection whose node (either
/// end's) leaves READY or comes back with another generation is reset.
pub const NODES_FILE: &str = "nodes";

/// The supervisor's writable mapping of [`NODES_FILE`].
#[derive(Debug)]
pub struct NodeWords {
    ptr: std::ptr::NonNull<std::sync::atomic::AtomicU64>,
    nodes: u32,
}

// SAFETY: a shared mapping written only through atomics; valid until drop from any thread.
unsafe impl Send for NodeWords {}
// SAFETY: as above.
unsafe impl Sync for NodeWords {}

impl NodeWords {
    /// Creates (or truncates) the file of fabric `fabric` with `nodes` slots, all zero.
    pub fn create(fabric: &str, nodes: u32) -> std::io::Result<Self> {
        use rustix::fs::{ftruncate, open, Mode, OFlags};
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        let dir = super::fabric_dir(fabric).join("accel");
        std::fs::create_dir_all(&dir)?;
        let fd = open(
            dir.join(NODES_FILE),
            OFlags::RDWR | OFlags::CREATE | OFlags::TRUNC | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )?;
        let len = (nodes as usize * 8).div_ceil(4096) * 4096;
        ftruncate(&fd, len as u64)?;
        // SAFETY: a fresh shared mapping of the file's `len` bytes, owned by the result and
        // unmapped in drop; nothing else in this process maps it.
        let p = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )?
        };
        Ok(NodeWords {
            ptr: std::ptr::NonNull::new(p.cast()).expect("mmap returns non-null"),
            nodes,
        })
    }

    /// Stores slot's state and generation.
    pub fn set(&self, slot: u32, state: u32, generation: u32) {
        if slot == 0 || slot > self.nodes {
            return;
        }
        // SAFETY: slot - 1 < nodes words, inside the mapping; 8-aligned (page-aligned base).
        let w = unsafe { &*self.ptr.as_ptr().add(slot as usize - 1) };
        w.store(
            u64::from(generation) << 32 | u64::from(state),
            std::sync::atomic::Ordering::Release,
        );
    }
}

impl Drop for NodeWords {
    fn drop(&mut self) {
        let len = (self.nodes as usize * 8).div_ceil(4096) * 4096;
        // SAFETY: the mapping made in `create`, of `len` bytes, no longer used.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), len) };
    }
}

/// One node's accelerated-socket counters, as `status --json` shows them.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct AccelStats {
    /// Connections accelerated since the fabric came up.
    pub connections: u64,
    /// Accelerated connections open now.
    pub open: u64,
    /// Bytes sent over rings (added in batches of 64 MiB and at close).
    pub tx_bytes: u64,
    /// Bytes received over rings (likewise).
    pub rx_bytes: u64,
    /// Connections reset because their ring memory was corrupt.
    pub corrupt: u64,
    /// Connections that stayed on the kernel's TCP, by reason.
    pub fallbacks: BTreeMap<String, u64>,
}

/// Node `slot`'s counters, if any accelerated program ran there.
pub fn read_stats(fabric: &str, slot: u32) -> Option<AccelStats> {
    let path = super::fabric_dir(fabric)
        .join("accel")
        .join(format!("n{slot}.stats"));
    let bytes = std::fs::read(path).ok()?;
    parse_stats(&bytes)
}

/// Parses a counters file (a torn read of a word being added to is harmless: each word is
/// read whole).
pub fn parse_stats(bytes: &[u8]) -> Option<AccelStats> {
    let word = |i: usize| -> u64 {
        bytes
            .get(i * 8..i * 8 + 8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    };
    if word(0) != STATS_MAGIC {
        return None;
    }
    Some(AccelStats {
        connections: word(CONNS),
        // The gauge is decremented by each close; a program killed mid-connection leaves it
        // high, and a wrap below zero is shown as zero.
        open: if word(OPEN) > 1 << 62 { 0 } else { word(OPEN) },
        tx_bytes: word(TX_BYTES),
        rx_bytes: word(RX_BYTES),
        corrupt: word(CORRUPT),
        fallbacks: FALLBACK_NAMES
            .iter()
            .enumerate()
            .filter(|&(i, _)| word(FALLBACK + i) > 0)
            .map(|(i, n)| ((*n).to_owned(), word(FALLBACK + i)))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_file_is_parsed() {
        let mut f = vec![0u8; WORDS * 8];
        let mut put = |i: usize, v: u64| f[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        put(0, STATS_MAGIC);
        put(CONNS, 3);
        put(OPEN, 1);
        put(RX_BYTES, 1000);
        put(FALLBACK + 1, 2);
        let s = parse_stats(&f).unwrap();
        assert_eq!((s.connections, s.open, s.rx_bytes), (3, 1, 1000));
        assert_eq!(s.fallbacks.get("no-offer"), Some(&2));
        assert_eq!(s.fallbacks.len(), 1);
        assert_eq!(parse_stats(&[0u8; 16]), None, "no magic");
        assert_eq!(parse_stats(&[]), None);
    }
}
