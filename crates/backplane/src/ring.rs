//! The SPSC ring protocol: one producer (a sender endpoint), one consumer (a receiver endpoint).
//!
//! The data area lives in the *receiver's* window. The sender writes records and publishes its
//! producer index (`tail`) there; the receiver writes its consumer index (`head`) back into the
//! *sender's* window (the credit line). Neither side ever spins on the other's memory: each
//! polls the index the other writes *into its own* window.
//!
//! Indices are free-running byte positions (u64, never wrap in practice); the position in the
//! data area is `index % data_len`. Records are `RECORD_ALIGN`-aligned: a 16-byte header then the
//! payload. A record never straddles the end of the data area: the producer writes a PAD record
//! to the end instead and starts again at 0, so every payload is one contiguous slice (which is
//! what makes the zero-copy API possible).
//!
//! Everything the consumer reads from the producer, and vice versa, is validated: an index that
//! goes backwards or beyond the ring, a misaligned index, a record with a bad kind, length or
//! sequence number. A bad value yields [`RingError::Corrupt`]; the caller retires the ring.
#![deny(unsafe_code)]

use crate::wire::{
    RecordHeader, RecordKind, RecordRepr, MAX_DGRAM, RECORD_ALIGN, RECORD_HEADER_LEN,
};

/// Memory a ring runs over. Production: a window mapping plus a credit line; tests: loom cells.
///
/// `write`/`read` positions are always checked by the protocol to lie within
/// `[0, data_len)` with `pos + len <= data_len`; implementations may still check again.
pub trait RingMemory {
    /// Bytes in the data area: a power of two, a multiple of [`RECORD_ALIGN`].
    fn data_len(&self) -> u64;
    /// Consumer side: loads the producer index (Acquire).
    fn load_tail(&self) -> u64;
    /// Producer side: publishes the producer index (Release).
    fn store_tail(&self, v: u64);
    /// Producer side: loads the consumer index (Acquire).
    fn load_head(&self) -> u64;
    /// Consumer side: publishes the consumer index (Release).
    fn store_head(&self, v: u64);
    /// Copies `src` into the data area at `pos`.
    fn write(&self, pos: u64, src: &[u8]);
    /// Copies from the data area at `pos` into `dst`.
    fn read(&self, pos: u64, dst: &mut [u8]);
    /// Hints that the data area at `pos` will be read soon (a cache prefetch; default: none).
    fn prefetch(&self, _pos: u64) {}
}

/// What went wrong on a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// Occurs when the ring has no room for the record right now.
    #[error("ring full")]
    Full,
    /// Occurs when a payload is larger than [`MAX_DGRAM`].
    #[error("datagram of {0} bytes exceeds the {MAX_DGRAM}-byte maximum")]
    TooBig(usize),
    /// Occurs when the peer wrote an impossible index or record; the ring must be retired.
    #[error("ring corrupted by peer: {0}")]
    Corrupt(&'static str),
}

/// A record ready to be read: payload at `pos` (in the data area), `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Position of the payload in the data area.
    pub pos: u64,
    /// Payload length.
    pub len: usize,
    /// Sequence number.
    pub seq: u64,
    /// Delivery time (link emulation), CLOCK_MONOTONIC ns; 0 for "at once".
    pub not_before_ns: u64,
    end: u64,
}

/// Room reserved for one record: fill `len` bytes at `pos`, then [`Producer::commit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Position of the payload in the data area.
    pub pos: u64,
    /// Payload length.
    pub len: usize,
    /// Delivery time to stamp on the record (link emulation); 0 for "at once".
    pub not_before_ns: u64,
    start: u64,
}

impl Reservation {
    /// The producer index (free-running, as `tail`) of the payload's first byte.
    pub fn index(&self) -> u64 {
        self.start + RECORD_HEADER_LEN
    }
}

fn emit_header(mem: &impl RingMemory, pos: u64, repr: RecordRepr) {
    let mut h = [0u8; RECORD_HEADER_LEN as usize];
    repr.emit(&mut RecordHeader::new_unchecked(&mut h[..]));
    mem.write(pos, &h);
}

/// Producer state, private to the sender.
#[derive(Debug, Clone, Default)]
pub struct Producer {
    tail: u64,
    head_cache: u64,
    seq: u64,
}

/// `x % len`: a mask when `len` is a power of two (the rings the library makes: a 64-bit
/// division costs tens of cycles, several times per message), a division otherwise.
#[inline(always)]
fn wrap(x: u64, len: u64) -> u64 {
    if len.is_power_of_two() {
        x & (len - 1)
    } else {
        x % len
    }
}

impl Producer {
    /// A producer at the start of a fresh ring.
    pub fn new() -> Self {
        Self::default()
    }

    /// The producer index published so far.
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// Bytes a payload of `len` needs from the current tail, padding included.
    fn needed(&self, data_len: u64, len: usize) -> (u64, u64) {
        let rec = RecordRepr::footprint(len as u64);
        let pos = wrap(self.tail, data_len);
        let pad = if pos + rec > data_len {
            data_len - pos
        } else {
            0
        };
        (pad, rec)
    }

    fn refresh_head(&mut self, mem: &impl RingMemory) -> Result<(), RingError> {
        // SYNC POINT ring-release (acquire): the consumer is done with everything before head.
        let head = mem.load_head();
        if head < self.head_cache || head > self.tail || !head.is_multiple_of(RECORD_ALIGN) {
            return Err(RingError::Corrupt("consumer index out of range"));
        }
        self.head_cache = head;
        Ok(())
    }

    /// True if a payload of `len` bytes fits now (reloads the consumer index if needed).
    #[inline]
    pub fn has_room(&mut self, mem: &impl RingMemory, len: usize) -> Result<bool, RingError> {
        let data_len = mem.data_len();
        let (pad, rec) = self.needed(data_len, len);
        if self.tail - self.head_cache + pad + rec <= data_len {
            return Ok(true);
        }
        self.refresh_head(mem)?;
        Ok(self.tail - self.head_cache + pad + rec <= data_len)
    }

    /// Reserves room for a payload of `len` bytes, writing a PAD record first if the payload
    /// would straddle the end of the data area.
    #[inline]
    pub fn reserve(&mut self, mem: &impl RingMemory, len: usize) -> Result<Reservation, RingError> {
        if len > MAX_DGRAM {
            return Err(RingError::TooBig(len));
        }
        if !self.has_room(mem, len)? {
            return Err(RingError::Full);
        }
        let data_len = mem.data_len();
        let (pad, _) = self.needed(data_len, len);
        let mut start = self.tail;
        if pad > 0 {
            emit_header(
                mem,
                wrap(start, data_len),
                RecordRepr {
                    len: (pad - RECORD_HEADER_LEN) as u32,
                    kind: RecordKind::Pad,
                    seq: self.seq,
                    not_before_ns: 0,
                },
            );
            start += pad;
        }
        Ok(Reservation {
            pos: wrap(start, data_len) + RECORD_HEADER_LEN,
            len,
            not_before_ns: 0,
            start,
        })
    }

    /// Publishes a filled reservation (and the PAD before it, if any).
    #[inline]
    pub fn commit(&mut self, mem: &impl RingMemory, r: Reservation) {
        let data_len = mem.data_len();
        emit_header(
            mem,
            wrap(r.start, data_len),
            RecordRepr {
                len: r.len as u32,
                kind: RecordKind::Data,
                seq: self.seq,
                not_before_ns: r.not_before_ns,
            },
        );
        self.seq += 1;
        self.tail = r.start + RecordRepr::footprint(r.len as u64);
        // SYNC POINT ring-publish (release): header and payload are visible before the tail.
        mem.store_tail(self.tail);
    }

    /// Copies `payload` into the ring and publishes it.
    pub fn push(&mut self, mem: &impl RingMemory, payload: &[u8]) -> Result<(), RingError> {
        let r = self.reserve(mem, payload.len())?;
        mem.write(r.pos, payload);
        self.commit(mem, r);
        Ok(())
    }
}

/// A record [`Consumer::take_ahead`] found in ring bytes before they are written: its
/// payload at `off`, `len` bytes, in the bytes; `taken` of the bytes it (and a pad before it
/// there) spans; `consumed`, what [`Consumer::skip_ahead`] moves the consumer by (a pad before
/// it in the ring too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ahead {
    /// The payload's offset in the bytes.
    pub off: usize,
    /// The payload's length.
    pub len: usize,
    /// How many of the bytes the record (and a pad at their front) spans.
    pub taken: u64,
    /// How far the consumer moves past it.
    pub consumed: u64,
}

/// Consumer state, private to the receiver.
#[derive(Debug, Clone, Default)]
pub struct Consumer {
    head: u64,
    tail_cache: u64,
    seq: u64,
}

impl Consumer {
    /// A consumer at the start of a fresh ring.
    pub fn new() -> Self {
        Self::default()
    }

    /// The consumer index released so far.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// True when no record waits: none seen and not yet taken, and the producer index (one
    /// load) still at our head. Anything else — records, or an index that moved in a way
    /// [`Consumer::peek`] would call corrupt — is false: a cheap test before a full look.
    #[inline]
    pub fn is_drained(&self, mem: &impl RingMemory) -> bool {
        // The record the producer index will announce sits at our head: ask for its line now,
        // so that when a message arrives the index and the record are fetched side by side.
        mem.prefetch(wrap(self.head, mem.data_len()));
        self.head == self.tail_cache && mem.load_tail() == self.head
    }

    /// The producer index as last loaded.
    pub fn tail_seen(&self) -> u64 {
        self.tail_cache
    }

    /// True if records published so far have all been consumed (uses the cached tail).
    pub fn drained_cached(&self) -> bool {
        self.head == self.tail_cache
    }

    /// Returns the next record, if any, after validating everything the producer wrote.
    #[inline]
    pub fn peek(&mut self, mem: &impl RingMemory) -> Result<Option<Record>, RingError> {
        let data_len = mem.data_len();
        if self.head == self.tail_cache {
            // As in `is_drained`: the next record's line travels beside the producer index.
            mem.prefetch(wrap(self.head, data_len));
            // SYNC POINT ring-publish (acquire): records before tail are complete.
            let tail = mem.load_tail();
            if tail < self.tail_cache
                || tail - self.head > data_len
                || !tail.is_multiple_of(RECORD_ALIGN)
            {
                return Err(RingError::Corrupt("producer index out of range"));
            }
            self.tail_cache = tail;
            if tail == self.head {
                return Ok(None);
            }
        }
        loop {
            let pos = wrap(self.head, data_len);
            let mut h = [0u8; RECORD_HEADER_LEN as usize];
            mem.read(pos, &mut h);
            let rec = RecordRepr::parse(&RecordHeader::new_unchecked(&h[..]))
                .map_err(|_| RingError::Corrupt("bad record kind"))?;
            if rec.seq != self.seq {
                return Err(RingError::Corrupt("record out of sequence"));
            }
            let contiguous = data_len - pos;
            match rec.kind {
                RecordKind::Pad => {
                    if u64::from(rec.len) + RECORD_HEADER_LEN != contiguous
                        || self.head + contiguous >= self.tail_cache
                    {
                        return Err(RingError::Corrupt("bad pad record"));
                    }
                    self.head += contiguous;
                }
                RecordKind::Data => {
                    let len = rec.len as usize;
                    let foot = RecordRepr::footprint(len as u64);
                    if len > MAX_DGRAM || foot > contiguous || self.head + foot > self.tail_cache {
                        return Err(RingError::Corrupt("record length out of range"));
                    }
                    return Ok(Some(Record {
                        pos: pos + RECORD_HEADER_LEN,
                        len,
                        seq: rec.seq,
                        not_before_ns: rec.not_before_ns,
                        end: self.head + foot,
                    }));
                }
            }
        }
    }

    /// The record that starts the ring bytes `bytes`, which are to be written at index `at`
    /// and are not in the data area yet (a QP's messages from another host, before the pair's
    /// mirror writes them) — if `at` is where this consumer stands with nothing published
    /// unread, and the record is a whole data record of the next sequence number that fits
    /// where it would lie. Anything else (a record cut at the end of `bytes`, a bad header) is
    /// `None`: the bytes go into the ring and [`Consumer::peek`] judges them there.
    ///
    /// A pad record at the ring's end before it is passed over: a producer that wraps writes
    /// a pad and publishes it with the record after it, and a mirror ships the ring's bytes in
    /// chunks — the pad may come at the front of `bytes`, or in the message before (written
    /// into the ring but not published: a published index may not stop at a pad's end, see
    /// [`Consumer::peek`]). Without this the record after every pad, and all after it in the
    /// same look, went through the ring. A pad passes only if its header reads right (kind,
    /// this consumer's sequence number, a length that reaches the ring's end exactly) with
    /// nothing published unread.
    pub fn take_ahead(&self, mem: &impl RingMemory, at: u64, bytes: &[u8]) -> Option<Ahead> {
        let data_len = mem.data_len();
        if self.tail_cache != self.head {
            return None;
        }
        let contiguous = data_len - wrap(self.head, data_len);
        let is_pad = |h: &[u8]| {
            RecordRepr::parse(&RecordHeader::new_unchecked(h)).is_ok_and(|rec| {
                rec.kind == RecordKind::Pad
                    && rec.seq == self.seq
                    && u64::from(rec.len) + RECORD_HEADER_LEN == contiguous
            })
        };
        let header = RECORD_HEADER_LEN as usize;
        // Where the pad lies: in the ring before `at`, at the front of `bytes`, or nowhere.
        let (in_ring, in_bytes) = if at == self.head + contiguous {
            // SYNC POINT ring-publish (acquire): nothing published unread (the pad's bytes
            // were written by this pair's pump, not published).
            if mem.load_tail() != self.head {
                return None;
            }
            let mut h = [0u8; RECORD_HEADER_LEN as usize];
            mem.read(wrap(self.head, data_len), &mut h);
            if !is_pad(&h) {
                return None;
            }
            (contiguous, 0)
        } else if at == self.head
            && bytes.len() as u64 > contiguous
            && bytes.get(..header).is_some_and(is_pad)
        {
            (0, contiguous)
        } else if at == self.head {
            (0, 0)
        } else {
            return None;
        };
        // (In bounds: a pad in the bytes is shorter than they are.)
        let rest = &bytes[in_bytes as usize..];
        let (off, len, foot) = self.data_record(data_len, at + in_bytes, rest)?;
        Some(Ahead {
            off: off + in_bytes as usize,
            len,
            taken: in_bytes + foot,
            consumed: in_ring + in_bytes + foot,
        })
    }

    /// The data record of this consumer's next number that starts `bytes`, to lie at ring
    /// index `at` whole before the ring's end: its payload's offset and length, its footprint.
    fn data_record(&self, data_len: u64, at: u64, bytes: &[u8]) -> Option<(usize, usize, u64)> {
        let h = bytes.get(..RECORD_HEADER_LEN as usize)?;
        let rec = RecordRepr::parse(&RecordHeader::new_unchecked(h)).ok()?;
        if rec.kind != RecordKind::Data || rec.seq != self.seq || rec.not_before_ns != 0 {
            return None;
        }
        let len = rec.len as usize;
        let foot = RecordRepr::footprint(len as u64);
        let contiguous = data_len - wrap(at, data_len);
        if len > MAX_DGRAM || foot > contiguous || foot > bytes.len() as u64 {
            return None;
        }
        Some((RECORD_HEADER_LEN as usize, len, foot))
    }

    /// Consumes the record [`Consumer::take_ahead`] found, which was read where it came
    /// (its bytes never enter the data area): the consumer index moves past it as after
    /// [`Consumer::release`], and the producer index the consumer last saw with it (the
    /// producer publishes at least as far before anything after it is read). `foot` counts a
    /// pad passed before it too ([`Consumer::take_ahead`]: a pad shares its record's number).
    pub fn skip_ahead(&mut self, mem: &impl RingMemory, foot: u64) {
        self.head += foot;
        self.tail_cache = self.head;
        self.seq += 1;
        // SYNC POINT ring-release (release): as in `release`.
        mem.store_head(self.head);
    }

    /// Releases a record returned by [`Consumer::peek`]: its bytes may be overwritten.
    #[inline]
    pub fn release(&mut self, mem: &impl RingMemory, rec: Record) {
        self.head = rec.end;
        self.seq += 1;
        // SYNC POINT ring-release (release): we no longer read anything before head.
        mem.store_head(self.head);
    }

    /// Copies the next payload into `dst`; returns its length.
    pub fn pop(
        &mut self,
        mem: &impl RingMemory,
        dst: &mut [u8],
    ) -> Result<Option<usize>, RingError> {
        match self.peek(mem)? {
            None => Ok(None),
            Some(rec) => {
                mem.read(rec.pos, &mut dst[..rec.len]);
                self.release(mem, rec);
                Ok(Some(rec.len))
            }
        }
    }
}

/// Ring memory in plain process memory, for tests and the fuzz target.
#[cfg(not(loom))]
pub mod local {
    use super::RingMemory;
    use crate::sync::{AtomicU64, Ordering};
    use std::cell::RefCell;

    /// A ring in a heap buffer (single-threaded use: tests and property tests).
    #[derive(Debug)]
    pub struct LocalRing {
        /// Producer index.
        pub tail: AtomicU64,
        /// Consumer index.
        pub head: AtomicU64,
        /// Data area.
        pub data: RefCell<Vec<u8>>,
    }

    impl LocalRing {
        /// A ring with `len` data bytes.
        pub fn new(len: usize) -> Self {
            Self {
                tail: AtomicU64::new(0),
                head: AtomicU64::new(0),
                data: RefCell::new(vec![0; len]),
            }
        }
        /// Raw access to the data area (to corrupt it in tests).
        pub fn data_mut(&mut self) -> &mut Vec<u8> {
            self.data.get_mut()
        }
    }

    impl RingMemory for LocalRing {
        fn data_len(&self) -> u64 {
            self.data.borrow().len() as u64
        }
        fn load_tail(&self) -> u64 {
            self.tail.load(Ordering::Acquire)
        }
        fn store_tail(&self, v: u64) {
            self.tail.store(v, Ordering::Release)
        }
        fn load_head(&self) -> u64 {
            self.head.load(Ordering::Acquire)
        }
        fn store_head(&self, v: u64) {
            self.head.store(v, Ordering::Release)
        }
        fn write(&self, pos: u64, src: &[u8]) {
            // Slicing panics (test-only type) rather than going out of bounds.
            self.data.borrow_mut()[pos as usize..pos as usize + src.len()].copy_from_slice(src);
        }
        fn read(&self, pos: u64, dst: &mut [u8]) {
            dst.copy_from_slice(&self.data.borrow()[pos as usize..pos as usize + dst.len()]);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::local::LocalRing;
    use super::*;
    use proptest::prelude::*;

    const LEN: usize = 256 * 1024;

    #[test]
    fn a_record_read_where_it_came_is_consumed_without_entering_the_ring() {
        // What the other side wrote into its copy of the ring: the bytes a mirror ships.
        let theirs = LocalRing::new(4096);
        let mut p = Producer::new();
        p.push(&theirs, b"first").unwrap();
        p.push(&theirs, &[7u8; 100]).unwrap();
        let tail = p.tail();
        let bytes = theirs.data.borrow()[..tail as usize].to_vec();
        let ours = LocalRing::new(4096);
        let mut c = Consumer::new();
        // Only where the consumer stands, and only a record whole in the bytes.
        assert_eq!(c.take_ahead(&ours, 64, &bytes[64..]), None);
        assert_eq!(c.take_ahead(&ours, 0, &bytes[..20]), None);
        let Ahead {
            off,
            len,
            consumed: foot,
            ..
        } = c.take_ahead(&ours, 0, &bytes).unwrap();
        assert_eq!(&bytes[off..off + len], b"first");
        c.skip_ahead(&ours, foot);
        assert_eq!(ours.load_head(), foot, "the room goes back as if read");
        // The rest is written into the ring (as the mirror does) and read there, in order.
        ours.write(foot, &bytes[foot as usize..]);
        ours.store_tail(tail);
        let mut buf = [0u8; 200];
        assert_eq!(c.pop(&ours, &mut buf).unwrap(), Some(100));
        assert_eq!(buf[..100], [7u8; 100]);
        // A record out of sequence (the first one again) is not taken.
        assert_eq!(c.take_ahead(&ours, tail, &bytes), None);
        // Nor one while records published before it wait unread.
        let mut c2 = Consumer::new();
        let ours2 = LocalRing::new(4096);
        ours2.write(0, &bytes);
        ours2.store_tail(tail);
        assert!(c2.peek(&ours2).unwrap().is_some());
        assert_eq!(c2.take_ahead(&ours2, 0, &bytes), None);
    }

    /// A record after a pad at the ring's end is taken where it came whether the pad comes at
    /// the front of the same bytes or in the chunk before (written, not published); a pad
    /// published at its own end, or one whose header does not read as this consumer's pad,
    /// is not passed over.
    #[test]
    fn a_record_after_a_pad_is_taken_where_it_came() {
        const L: u64 = 4096;
        // Three records, then one that does not fit before the ring's end: a pad, then it.
        let theirs = LocalRing::new(L as usize);
        let mut p = Producer::new();
        for i in 0..3u8 {
            p.push(&theirs, &[i; 1200]).unwrap();
        }
        let pad_at = p.tail();
        // (Before the fourth overwrites the first's place.)
        let first = theirs.data.borrow()[..pad_at as usize].to_vec();
        theirs.store_head(pad_at); // (read: room for the fourth)
        p.push(&theirs, &[9u8; 600]).unwrap();
        let tail = p.tail();
        let contiguous = L - pad_at;
        assert!(tail > L, "the fourth record went to the ring's start");
        let bytes = |from: u64, to: u64| -> Vec<u8> {
            (from..to)
                .map(|x| theirs.data.borrow()[(x % L) as usize])
                .collect()
        };
        // Ours with the three records read from the ring: the consumer stands at the pad.
        let fresh = || {
            let ours = LocalRing::new(L as usize);
            ours.write(0, &first);
            ours.store_tail(pad_at);
            let mut c = Consumer::new();
            let mut buf = vec![0u8; 2000];
            for _ in 0..3 {
                assert_eq!(c.pop(&ours, &mut buf).unwrap(), Some(1200));
            }
            (ours, c)
        };
        let foot = RecordRepr::footprint(600);
        // The pad at the front of the bytes.
        let (ours, mut c) = fresh();
        let chunk = bytes(pad_at, tail);
        let a = c.take_ahead(&ours, pad_at, &chunk).unwrap();
        assert_eq!(&chunk[a.off..a.off + a.len], &[9u8; 600][..]);
        assert_eq!(
            (a.taken, a.consumed),
            (contiguous + foot, contiguous + foot)
        );
        c.skip_ahead(&ours, a.consumed);
        assert_eq!(ours.load_head(), tail, "pad and record released as read");
        // The pad in the chunk before, written into the ring and not published.
        let (ours, mut c) = fresh();
        ours.write(pad_at, &bytes(pad_at, L));
        let chunk = bytes(L, tail);
        let a = c.take_ahead(&ours, L, &chunk).unwrap();
        assert_eq!(&chunk[a.off..a.off + a.len], &[9u8; 600][..]);
        assert_eq!((a.taken, a.consumed), (foot, contiguous + foot));
        c.skip_ahead(&ours, a.consumed);
        assert_eq!(ours.load_head(), tail);
        // Not past a pad published at its own end (records unread may lie there), nor one
        // whose header is not this consumer's pad.
        let (ours, c) = fresh();
        ours.write(pad_at, &bytes(pad_at, L));
        ours.store_tail(L);
        assert_eq!(c.take_ahead(&ours, L, &chunk), None);
        let (ours, c) = fresh();
        let mut pad = bytes(pad_at, L);
        pad[..8].copy_from_slice(&[0xff; 8]);
        ours.write(pad_at, &pad);
        assert_eq!(c.take_ahead(&ours, L, &chunk), None);
        let mut front = bytes(pad_at, tail);
        front[..8].copy_from_slice(&[0xff; 8]);
        let (ours, c) = fresh();
        assert_eq!(c.take_ahead(&ours, pad_at, &front), None);
    }

    #[test]
    fn ring_delivers_in_order_across_many_wraps() {
        let ring = LocalRing::new(LEN);
        let (mut p, mut c) = (Producer::new(), Consumer::new());
        let mut buf = vec![0u8; MAX_DGRAM];
        let mut next_expected = 0u32;
        for i in 0u32..5000 {
            let len = (i as usize * 7919) % 3000;
            let payload: Vec<u8> = (0..len).map(|k| (k as u32 ^ i) as u8).collect();
            while p.push(&ring, &payload) == Err(RingError::Full) {
                let n = c.pop(&ring, &mut buf).unwrap().unwrap();
                let l = (next_expected as usize * 7919) % 3000;
                assert_eq!(n, l);
                assert!(buf[..n]
                    .iter()
                    .enumerate()
                    .all(|(k, &b)| b == (k as u32 ^ next_expected) as u8));
                next_expected += 1;
            }
        }
        while let Some(n) = c.pop(&ring, &mut buf).unwrap() {
            assert_eq!(n, (next_expected as usize * 7919) % 3000);
            next_expected += 1;
        }
        assert_eq!(next_expected, 5000);
    }

    #[test]
    fn ring_reports_full_and_never_overwrites_unread_records() {
        let ring = LocalRing::new(LEN);
        let mut p = Producer::new();
        let mut n = 0;
        while p.push(&ring, &[n as u8; MAX_DGRAM]).is_ok() {
            n += 1;
        }
        assert_eq!(n, 3, "256 KiB holds three 64 KiB records plus headers");
        assert_eq!(p.push(&ring, &[0; MAX_DGRAM]), Err(RingError::Full));
        let mut c = Consumer::new();
        let mut buf = vec![0u8; MAX_DGRAM];
        for i in 0..n {
            assert_eq!(c.pop(&ring, &mut buf).unwrap(), Some(MAX_DGRAM));
            assert!(buf.iter().all(|&b| b == i as u8));
        }
        assert_eq!(c.pop(&ring, &mut buf).unwrap(), None);
    }

    #[test]
    fn ring_rejects_oversized_datagram() {
        let ring = LocalRing::new(LEN);
        let mut p = Producer::new();
        assert_eq!(
            p.push(&ring, &vec![0; MAX_DGRAM + 1]),
            Err(RingError::TooBig(MAX_DGRAM + 1))
        );
    }

    #[test]
    fn ring_rejects_producer_index_past_the_ring() {
        let ring = LocalRing::new(LEN);
        ring.store_tail(LEN as u64 + 64);
        assert!(matches!(
            Consumer::new().peek(&ring),
            Err(RingError::Corrupt(_))
        ));
        ring.store_tail(65);
        assert!(matches!(
            Consumer::new().peek(&ring),
            Err(RingError::Corrupt(_))
        ));
    }

    #[test]
    fn ring_rejects_record_length_past_the_tail() {
        let mut ring = LocalRing::new(LEN);
        let mut p = Producer::new();
        p.push(&ring, &[1; 10]).unwrap();
        ring.data_mut()[0..4].copy_from_slice(&5000u32.to_le_bytes());
        assert!(matches!(
            Consumer::new().peek(&ring),
            Err(RingError::Corrupt(_))
        ));
    }

    #[test]
    fn ring_rejects_consumer_index_running_ahead_of_the_producer() {
        let ring = LocalRing::new(LEN);
        let mut p = Producer::new();
        p.push(&ring, &[1; 10]).unwrap();
        ring.store_head(1 << 20);
        // Force a reload of the consumer index by filling the ring.
        let r = (0..10).try_for_each(|_| p.push(&ring, &[0; MAX_DGRAM]));
        assert!(matches!(r, Err(RingError::Corrupt(_))));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// A ring mirrored from another copy (as a QP's between hosts): records taken where
        /// they came when the consumer may (`take_ahead`/`skip_ahead`), the rest written
        /// into the ring and read there. What was published ships as one chunk (across the
        /// ring's end, as a mirror's message) or as two split at the ring's end — a pad
        /// there then comes alone, written but not published, as a mirror leaves it. Every
        /// payload arrives once, whole, in order, across wraps and pad records, whatever the
        /// mix.
        #[test]
        fn records_taken_ahead_and_read_from_the_ring_arrive_once_in_order(
            ops in proptest::collection::vec(
                (0usize..1500, any::<bool>(), any::<bool>(), any::<bool>()),
                1..200,
            ),
        ) {
            const L: u64 = 8192;
            let (theirs, ours) = (LocalRing::new(L as usize), LocalRing::new(L as usize));
            let (mut p, mut c) = (Producer::new(), Consumer::new());
            let (mut shipped, mut got, mut buf) = (0u64, Vec::new(), vec![0u8; MAX_DGRAM]);
            let payload = |i: usize, len: usize| -> Vec<u8> {
                (0..len).map(|k| (k * 31 + i) as u8).collect()
            };
            let drain = |c: &mut Consumer, got: &mut Vec<Vec<u8>>, buf: &mut Vec<u8>| {
                while let Some(n) = c.pop(&ours, buf).unwrap() {
                    got.push(buf[..n].to_vec());
                }
                // The consumer index goes back to the producer's copy (the mirror's credits).
                theirs.store_head(ours.load_head());
            };
            for (i, &(len, ahead, drain_first, split)) in ops.iter().enumerate() {
                while p.push(&theirs, &payload(i, len)) == Err(RingError::Full) {
                    drain(&mut c, &mut got, &mut buf);
                }
                if drain_first {
                    drain(&mut c, &mut got, &mut buf);
                }
                let tail = p.tail();
                while shipped < tail {
                    // One chunk up to the tail, or (split) up to the ring's end first.
                    let to_end = L - shipped % L;
                    let end = if split && tail - shipped > to_end { shipped + to_end } else { tail };
                    let bytes: Vec<u8> = (shipped..end)
                        .map(|x| theirs.data.borrow()[(x % L) as usize])
                        .collect();
                    let mut at = 0usize;
                    while let Some(a) = ahead
                        .then(|| c.take_ahead(&ours, shipped + at as u64, &bytes[at..]))
                        .flatten()
                    {
                        got.push(bytes[at + a.off..at + a.off + a.len].to_vec());
                        c.skip_ahead(&ours, a.consumed);
                        at += a.taken as usize;
                    }
                    for (k, &byte) in bytes.iter().enumerate().skip(at) {
                        ours.write((shipped + k as u64) % L, &[byte]);
                    }
                    // Published as a mirror does: a whole chunk to its end, else past what
                    // was taken (never at a pad's end alone).
                    if end == tail {
                        ours.store_tail(tail);
                    } else if at != 0 {
                        ours.store_tail(shipped + at as u64);
                    }
                    shipped = end;
                }
            }
            drain(&mut c, &mut got, &mut buf);
            prop_assert_eq!(got.len(), ops.len());
            for (i, (g, &(len, _, _, _))) in got.iter().zip(&ops).enumerate() {
                prop_assert_eq!(g, &payload(i, len), "payload {}", i);
            }
        }

        /// Arbitrary bytes in the data area and arbitrary indices: the consumer never panics,
        /// never reads out of bounds (LocalRing slices would panic), and every record it
        /// returns lies inside the data area.
        #[test]
        fn ring_consumer_survives_arbitrary_bytes(
            bytes in proptest::collection::vec(any::<u8>(), 4096),
            tail in any::<u64>(),
            small_tail in 0u64..8192,
            use_small in any::<bool>(),
        ) {
            let mut ring = LocalRing::new(4096);
            ring.data_mut().copy_from_slice(&bytes);
            ring.store_tail(if use_small { small_tail } else { tail });
            let mut c = Consumer::new();
            let mut buf = vec![0u8; MAX_DGRAM];
            for _ in 0..64 {
                match c.peek(&ring) {
                    Ok(Some(rec)) => {
                        prop_assert!(rec.pos + rec.len as u64 <= 4096);
                        ring.read(rec.pos, &mut buf[..rec.len]);
                        c.release(&ring, rec);
                    }
                    Ok(None) | Err(_) => break,
                }
            }
        }

        /// Valid traffic with random sizes interleaved with random consumption: everything
        /// pushed arrives once, in order, intact.
        #[test]
        fn ring_delivers_every_accepted_payload_in_order(
            sizes in proptest::collection::vec(0usize..20_000, 1..200),
            pops in proptest::collection::vec(0usize..4, 1..200),
        ) {
            let ring = LocalRing::new(LEN);
            let (mut p, mut c) = (Producer::new(), Consumer::new());
            let mut sent = std::collections::VecDeque::new();
            let mut buf = vec![0u8; MAX_DGRAM];
            for (i, &s) in sizes.iter().enumerate() {
                let payload = vec![i as u8; s];
                if p.push(&ring, &payload).is_ok() {
                    sent.push_back(payload);
                }
                for _ in 0..pops[i % pops.len()] {
                    if let Some(n) = c.pop(&ring, &mut buf).unwrap() {
                        prop_assert_eq!(&buf[..n], &sent.pop_front().unwrap()[..]);
                    }
                }
            }
            while let Some(n) = c.pop(&ring, &mut buf).unwrap() {
                prop_assert_eq!(&buf[..n], &sent.pop_front().unwrap()[..]);
            }
            prop_assert!(sent.is_empty());
        }
    }
}

#[cfg(all(test, loom))]
#[allow(unsafe_code)] // loom's UnsafeCell is how loom checks the data area's accesses
mod loom_tests {
    //! `RUSTFLAGS="--cfg loom" cargo test -p backplane --release ring::loom_tests`
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::{AtomicU64, Ordering};
    use loom::sync::Arc;

    /// A tiny ring over loom cells: loom checks every data access is ordered by the
    /// tail/head Release/Acquire pairs (a missing edge is reported as a data race).
    struct LoomRing {
        tail: AtomicU64,
        head: AtomicU64,
        data: Vec<UnsafeCell<u8>>,
    }

    impl RingMemory for LoomRing {
        fn data_len(&self) -> u64 {
            self.data.len() as u64
        }
        fn load_tail(&self) -> u64 {
            self.tail.load(Ordering::Acquire)
        }
        fn store_tail(&self, v: u64) {
            self.tail.store(v, Ordering::Release)
        }
        fn load_head(&self) -> u64 {
            self.head.load(Ordering::Acquire)
        }
        fn store_head(&self, v: u64) {
            self.head.store(v, Ordering::Release)
        }
        fn write(&self, pos: u64, src: &[u8]) {
            for (i, b) in src.iter().enumerate() {
                // SAFETY: loom tracks the access and fails the model on a race.
                self.data[pos as usize + i].with_mut(|p| unsafe { *p = *b });
            }
        }
        fn read(&self, pos: u64, dst: &mut [u8]) {
            for (i, b) in dst.iter_mut().enumerate() {
                // SAFETY: as in `write`.
                *b = self.data[pos as usize + i].with(|p| unsafe { *p });
            }
        }
    }

    fn ring(len: usize) -> Arc<LoomRing> {
        Arc::new(LoomRing {
            tail: AtomicU64::new(0),
            head: AtomicU64::new(0),
            data: (0..len).map(|_| UnsafeCell::new(0)).collect(),
        })
    }

    /// A 256-byte data area and payloads of 40, 100 and 100 bytes (footprints 64, 128, 128):
    /// the third record does not fit before the end, so the producer must wait for the
    /// consumer (ring full), write a PAD record and wrap to offset 0. Loom explores every
    /// interleaving and fails on any data access not ordered by the tail/head pairs.
    #[test]
    fn loom_ring_producer_consumer_deliver_in_order_with_pad_wrap_and_full() {
        const LENS: [usize; 3] = [40, 100, 100];
        loom::model(|| {
            let r = ring(256);
            let rp = r.clone();
            let producer = loom::thread::spawn(move || {
                let mut p = Producer::new();
                for (i, &len) in LENS.iter().enumerate() {
                    let payload = [i as u8 + 1; 100];
                    loop {
                        match p.push(&*rp, &payload[..len]) {
                            Ok(()) => break,
                            Err(RingError::Full) => loom::thread::yield_now(),
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            });
            let mut c = Consumer::new();
            let mut got = 0usize;
            let mut buf = [0u8; 128];
            while got < LENS.len() {
                match c.pop(&*r, &mut buf).unwrap() {
                    Some(n) => {
                        assert_eq!(n, LENS[got]);
                        assert!(buf[..n].iter().all(|&b| b == got as u8 + 1));
                        got += 1;
                    }
                    None => loom::thread::yield_now(),
                }
            }
            producer.join().unwrap();
        });
    }
}
