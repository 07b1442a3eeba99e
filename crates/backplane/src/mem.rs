//! Windows and regions: memfd-backed shared mappings, passed between processes as file
//! descriptors, mapped read-write or read-only.
//!
//! A [`Region`] is the only way the rest of the crate touches shared memory. Every accessor
//! checks bounds (and alignment for atomics) against the mapped length, so an offset read from a
//! peer can at worst produce an error, never an out-of-bounds access.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use crate::sync::{AtomicU32, AtomicU64};

/// What went wrong creating or using a region.
#[derive(Debug, thiserror::Error)]
pub enum MemError {
    /// Occurs when memfd_create, ftruncate or fstat fails.
    #[error("cannot create shared memory '{name}': {source}")]
    Create {
        /// memfd name.
        name: String,
        /// OS error.
        source: std::io::Error,
    },
    /// Occurs when mmap fails (too large for the address space or memory limits).
    #[error("cannot map {len} bytes of shared memory: {source}")]
    Map {
        /// Requested length.
        len: usize,
        /// OS error.
        source: std::io::Error,
    },
    /// Occurs when an access falls outside the region or is misaligned.
    #[error("access at offset {off} length {len} is outside the {size}-byte region or misaligned")]
    OutOfBounds {
        /// Offset of the access.
        off: u64,
        /// Length of the access.
        len: u64,
        /// Size of the region.
        size: u64,
    },
}

/// A shared memory mapping.
#[derive(Debug)]
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory; every access goes through atomics or explicit
// copies whose ordering is established by the ring protocol, so sharing the handle between
// threads adds no hazard that sharing between processes does not already have.
unsafe impl Send for Region {}
// SAFETY: see `Send` above.
unsafe impl Sync for Region {}

impl Region {
    /// Creates a zero-filled memfd of `len` bytes (sealed against shrinking) and maps it
    /// read-write.
    pub fn create(name: &str, len: usize) -> Result<Self, MemError> {
        use rustix::fs::{fcntl_add_seals, ftruncate, memfd_create, MemfdFlags, SealFlags};
        let err = |e: rustix::io::Errno| MemError::Create {
            name: name.to_owned(),
            source: e.into(),
        };
        let fd =
            memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).map_err(err)?;
        ftruncate(&fd, len as u64).map_err(err)?;
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).map_err(err)?;
        Self::map(fd, true)
    }

    /// Maps a region received from another process. Its length is the file's size.
    pub fn map(fd: OwnedFd, writable: bool) -> Result<Self, MemError> {
        Self::map_prefix(fd, usize::MAX, writable)
    }

    /// Maps the first `max` bytes of a region (all of it if it is shorter): for a process that
    /// needs only a region's header.
    pub fn map_prefix(fd: OwnedFd, max: usize, writable: bool) -> Result<Self, MemError> {
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        let len = (rustix::fs::fstat(&fd)
            .map_err(|e| MemError::Create {
                name: "received fd".into(),
                source: e.into(),
            })?
            .st_size as usize)
            .min(max);
        if len == 0 {
            return Err(MemError::Map {
                len,
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            });
        }
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        // SAFETY: we map a fresh range chosen by the kernel (null hint), so no existing Rust
        // object is aliased; the mapping stays valid until `Drop` unmaps it.
        let ptr = unsafe { mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, &fd, 0) }
            .map_err(|e| MemError::Map {
                len,
                source: e.into(),
            })?;
        Ok(Self {
            ptr: NonNull::new(ptr.cast()).expect("mmap never returns null on success"),
            len,
            writable,
            fd,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True if mapped read-write.
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// The backing file descriptor (for passing to peers).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Checks that `[off, off+len)` is inside the region and `off` is `align`-aligned.
    pub fn check(&self, off: u64, len: u64, align: u64) -> Result<usize, MemError> {
        let oob = || MemError::OutOfBounds {
            off,
            len,
            size: self.len as u64,
        };
        let end = off.checked_add(len).ok_or_else(oob)?;
        if end > self.len as u64 || !off.is_multiple_of(align) {
            return Err(oob());
        }
        Ok(off as usize)
    }

    /// The u32 atomic at `off`.
    pub fn u32_at(&self, off: u64) -> Result<&AtomicU32, MemError> {
        let o = self.check(off, 4, 4)?;
        // SAFETY: `check` proved [o, o+4) is inside the live mapping and 4-aligned; AtomicU32
        // has the size and alignment of u32 and every access to shared words is atomic.
        Ok(unsafe { &*(self.ptr.as_ptr().add(o) as *const AtomicU32) })
    }

    /// The u64 atomic at `off`.
    pub fn u64_at(&self, off: u64) -> Result<&AtomicU64, MemError> {
        let o = self.check(off, 8, 8)?;
        // SAFETY: as in `u32_at`, with 8 bytes and 8-alignment.
        Ok(unsafe { &*(self.ptr.as_ptr().add(o) as *const AtomicU64) })
    }

    /// Copies `dst.len()` bytes starting at `off` out of the region.
    pub fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), MemError> {
        let o = self.check(off, dst.len() as u64, 1)?;
        // SAFETY: the source range is inside the mapping (checked); `dst` is a distinct local
        // buffer. Concurrent writes by a peer can only change the bytes copied, which callers
        // validate after the copy.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(o), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Copies `src` into the region at `off`.
    pub fn write(&self, off: u64, src: &[u8]) -> Result<(), MemError> {
        let o = self.check(off, src.len() as u64, 1)?;
        assert!(self.writable, "write to a read-only region");
        // SAFETY: the destination range is inside a writable mapping (checked); `src` is a
        // distinct buffer, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(o), src.len()) };
        Ok(())
    }

    /// Fills `[off, off+len)` with zeros.
    pub fn zero(&self, off: u64, len: u64) -> Result<(), MemError> {
        let o = self.check(off, len, 1)?;
        assert!(self.writable, "write to a read-only region");
        // SAFETY: the range is inside a writable mapping (checked).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(o), 0, len as usize) };
        Ok(())
    }

    /// Raw pointer to `off` after a bounds check, for zero-copy slices handed to callers.
    pub fn ptr_at(&self, off: u64, len: u64) -> Result<*mut u8, MemError> {
        let o = self.check(off, len, 1)?;
        // SAFETY: `o` is inside the mapping (checked), so the offset pointer stays in bounds.
        Ok(unsafe { self.ptr.as_ptr().add(o) })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe exactly the mapping made in `map`; no reference derived
        // from it outlives `self` (all accessors borrow `self`).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Copies `n` bytes from `src` to `dst` with stores that bypass the cache (non-temporal), as
/// a DMA engine's writes do: for copies far larger than the last-level cache this saves the
/// read of every destination line before it is overwritten (a third of the memory traffic of
/// an ordinary copy), and leaves the cache to the program. Elsewhere than on x86-64 it is an
/// ordinary copy.
///
/// Written here rather than taken from a crate because glibc's `memcpy` switches to such
/// stores only above `x86_non_temporal_threshold` (240 MiB on the development machine, so
/// never for a 64 MiB job) and no well-kept crate offers a streaming copy.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `n` bytes, and the ranges must not
/// overlap.
pub unsafe fn copy_streaming(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Head: an ordinary copy up to the destination's next 16-byte boundary.
        let head = dst.align_offset(16).min(n);
        // SAFETY: caller contract; `head <= n`.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let mut i = head;
        while i + 64 <= n {
            // SAFETY: `i + 64 <= n`, so all four 16-byte loads and stores are inside the
            // ranges; `dst + i` is 16-byte aligned (the head aligned it, and `i - head` is a
            // multiple of 64); SSE2 is part of x86-64.
            unsafe {
                let s = src.add(i).cast::<__m128i>();
                let d = dst.add(i).cast::<__m128i>();
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
            i += 64;
        }
        // SAFETY: the tail `[i, n)` is inside both ranges. The fence orders the streaming
        // stores before whatever publishes the copy (a completion), as ordinary stores are.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
            _mm_sfence();
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: caller contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_rejects_out_of_bounds_and_misaligned_access() {
        let r = Region::create("bp-test", 4096).unwrap();
        assert!(r.u64_at(4088).is_ok());
        assert!(r.u64_at(4092).is_err());
        assert!(r.u64_at(4).is_err());
        assert!(r.u32_at(u64::MAX - 1).is_err());
        let mut b = [0u8; 16];
        assert!(r.read(4090, &mut b).is_err());
        assert!(r.write(u64::MAX, &b).is_err());
    }

    #[test]
    fn region_shared_through_fd_sees_the_same_bytes() {
        let a = Region::create("bp-test", 8192).unwrap();
        let fd = a.fd().try_clone_to_owned().unwrap();
        let b = Region::map(fd, false).unwrap();
        a.write(100, b"fabric").unwrap();
        let mut got = [0u8; 6];
        b.read(100, &mut got).unwrap();
        assert_eq!(&got, b"fabric");
        assert!(!b.writable());
        let fd = a.fd().try_clone_to_owned().unwrap();
        let head = Region::map_prefix(fd, 4096, true).unwrap();
        assert_eq!(head.len(), 4096);
        head.write(0, b"head").unwrap();
        let mut got = [0u8; 4];
        a.read(0, &mut got).unwrap();
        assert_eq!(&got, b"head");
    }

    #[test]
    fn a_streaming_copy_moves_every_byte_whatever_the_alignment_and_length() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for (so, doff, n) in [
            (0, 0, 4096),
            (1, 3, 4000),
            (5, 0, 63),
            (0, 9, 64),
            (7, 1, 0),
            (2, 15, 129),
        ] {
            let mut dst = vec![0xEEu8; 4200];
            // SAFETY: both ranges are inside their vectors and distinct.
            unsafe { copy_streaming(src.as_ptr().add(so), dst.as_mut_ptr().add(doff), n) };
            assert_eq!(&dst[doff..doff + n], &src[so..so + n], "{so} {doff} {n}");
            assert!(dst[..doff].iter().all(|&b| b == 0xEE));
            assert!(dst[doff + n..].iter().all(|&b| b == 0xEE));
        }
    }
}
