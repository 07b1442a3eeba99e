//! Windows and regions: memfd-backed shared mappings, passed between processes as file
//! descriptors, mapped read-write or read-only.
//!
//! A [`Region`] and the typed views made from it — [`Word32`], [`Word64`] (an atomic word) and
//! [`Span`] (a byte range) — are the only way the rest of the crate touches shared memory. Every
//! view is made by a bounds- (and, for atomics, alignment-) checked constructor and holds its
//! region mapped (an `Arc<Region>`), so it can never point at memory that is gone; every
//! accessor checks its offsets again against the view, so an offset read from a peer can at
//! worst produce an error, never an out-of-bounds access. Bytes that peers may write are reached
//! by copy (`read`, `write`, `copy_to`), never as `&[u8]`: a reference would promise Rust that
//! nobody changes them, which no process sharing a window can promise.

mod adopt;
pub use adopt::{shared_backing, Adopted, SharedBacking};

use std::ops::Deref;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

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
    /// Occurs when a view of a read-only mapping is asked to write.
    #[error("write to a read-only mapping")]
    ReadOnly,
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
        Self::map_range(fd, 0, max, writable)
    }

    /// Maps `max` bytes of a file from offset `off` (page-aligned), fewer if the file ends
    /// sooner: the data of a region registered over memory another object backs (a shared
    /// mapping's file). Offsets into the mapping count from `off`.
    pub fn map_range(fd: OwnedFd, off: u64, max: usize, writable: bool) -> Result<Self, MemError> {
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        let size = rustix::fs::fstat(&fd)
            .map_err(|e| MemError::Create {
                name: "received fd".into(),
                source: e.into(),
            })?
            .st_size as u64;
        let len = usize::try_from(size.saturating_sub(off))
            .unwrap_or(usize::MAX)
            .min(max);
        if len == 0 || !off.is_multiple_of(4096) {
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
        let ptr = unsafe { mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, &fd, off) }
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
    #[inline(always)]
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

    /// Maps every page of the region into this process's page tables now (and, if `write`,
    /// allocates them), so a data path never takes a page fault: a minor fault costs
    /// microseconds, the whole budget of hundreds of messages. Best effort (kernels before 5.14
    /// lack the advice; the pages then fault in on first use).
    pub fn populate(&self, write: bool) {
        let advice = if write {
            libc::MADV_POPULATE_WRITE
        } else {
            libc::MADV_POPULATE_READ
        };
        // SAFETY: `ptr`/`len` are exactly this live mapping (mmap returns page-aligned
        // addresses); MADV_POPULATE_* only faults pages in and changes no contents.
        unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, advice) };
    }
}

/// An `AtomicU32` in a region, resolved once by a checked constructor and holding the region
/// mapped: it derefs to the atomic for as long as it lives.
#[derive(Clone)]
pub struct Word32 {
    ptr: NonNull<AtomicU32>,
    _region: Arc<Region>,
}

/// An `AtomicU64` in a region; see [`Word32`].
#[derive(Clone)]
pub struct Word64 {
    ptr: NonNull<AtomicU64>,
    _region: Arc<Region>,
}

// SAFETY: the pointee is an atomic in a MAP_SHARED mapping that the word keeps alive; atomics
// may be used from any thread.
unsafe impl Send for Word32 {}
// SAFETY: as above.
unsafe impl Sync for Word32 {}
// SAFETY: as above.
unsafe impl Send for Word64 {}
// SAFETY: as above.
unsafe impl Sync for Word64 {}

impl Word32 {
    /// The word at `off` of `region` (in bounds and 4-aligned, or an error).
    pub fn at(region: &Arc<Region>, off: u64) -> Result<Self, MemError> {
        let ptr = NonNull::from(region.u32_at(off)?);
        Ok(Self {
            ptr,
            _region: region.clone(),
        })
    }
}

impl Word64 {
    /// The word at `off` of `region` (in bounds and 8-aligned, or an error).
    pub fn at(region: &Arc<Region>, off: u64) -> Result<Self, MemError> {
        let ptr = NonNull::from(region.u64_at(off)?);
        Ok(Self {
            ptr,
            _region: region.clone(),
        })
    }
}

impl Deref for Word32 {
    type Target = AtomicU32;
    #[inline(always)]
    fn deref(&self) -> &AtomicU32 {
        // SAFETY: checked in bounds and aligned by `Region::u32_at` when made; the mapping is
        // kept alive by `_region` for as long as `self` (and so the returned borrow) lives.
        unsafe { self.ptr.as_ref() }
    }
}

impl Deref for Word64 {
    type Target = AtomicU64;
    #[inline(always)]
    fn deref(&self) -> &AtomicU64 {
        // SAFETY: as in `Word32::deref`, with 8 bytes and 8-alignment.
        unsafe { self.ptr.as_ref() }
    }
}

impl std::fmt::Debug for Word32 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Word32({})", self.load(crate::sync::Ordering::Relaxed))
    }
}

impl std::fmt::Debug for Word64 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Word64({})", self.load(crate::sync::Ordering::Relaxed))
    }
}

/// A byte range of a region that peers may write, holding the region mapped. Its bytes are
/// reached by checked copies only; offsets are relative to the span's start.
#[derive(Clone)]
pub struct Span {
    ptr: NonNull<u8>,
    len: u64,
    writable: bool,
    region: Arc<Region>,
}

// SAFETY: a span is a pointer into a MAP_SHARED mapping it keeps alive; every access is a
// checked copy or an atomic, the same from any thread as from another process.
unsafe impl Send for Span {}
// SAFETY: as above.
unsafe impl Sync for Span {}

impl std::fmt::Debug for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Span")
            .field("len", &self.len)
            .field("writable", &self.writable)
            .finish()
    }
}

impl Span {
    /// The bytes `[off, off+len)` of `region` (inside it, or an error).
    pub fn new(region: &Arc<Region>, off: u64, len: u64) -> Result<Self, MemError> {
        let ptr = region.ptr_at(off, len)?;
        Ok(Self {
            ptr: NonNull::new(ptr).expect("inside a mapping, never null"),
            len,
            writable: region.writable(),
            region: region.clone(),
        })
    }

    /// The whole of `region`.
    pub fn whole(region: &Arc<Region>) -> Self {
        Self::new(region, 0, region.len() as u64).expect("a region spans itself")
    }

    /// Length in bytes.
    #[inline(always)]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for a span of no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True if the region is mapped read-write.
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// The region the span lies in.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// `[off, off+len)` of this span, as a span of its own.
    pub fn sub(&self, off: u64, len: u64) -> Result<Self, MemError> {
        let o = self.check(off, len)?;
        Ok(Self {
            // SAFETY: `o + len <= self.len` (checked), so the pointer stays inside the span.
            ptr: unsafe { self.ptr.add(o) },
            len,
            writable: self.writable,
            region: self.region.clone(),
        })
    }

    /// Checks that `[off, off+len)` lies in the span; returns `off` as an index.
    #[inline(always)]
    pub fn check(&self, off: u64, len: u64) -> Result<usize, MemError> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(off as usize),
            _ => Err(MemError::OutOfBounds {
                off,
                len,
                size: self.len,
            }),
        }
    }

    #[inline(always)]
    fn check_write(&self, off: u64, len: u64) -> Result<usize, MemError> {
        if !self.writable {
            return Err(MemError::ReadOnly);
        }
        self.check(off, len)
    }

    /// Copies `dst.len()` bytes at `off` out of the span.
    #[inline(always)]
    pub fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), MemError> {
        let o = self.check(off, dst.len() as u64)?;
        // SAFETY: the source is inside the live span (checked); `dst` is process memory that
        // no mapping of ours aliases (a `&mut` to it exists). A peer writing concurrently can
        // change the bytes copied, which callers validate after the copy.
        unsafe { copy_bytes(self.ptr.as_ptr().add(o), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the span at `off`.
    #[inline(always)]
    pub fn write(&self, off: u64, src: &[u8]) -> Result<(), MemError> {
        let o = self.check_write(off, src.len() as u64)?;
        // SAFETY: the destination is inside the live, writable span (checked); `src` is a
        // shared borrow Rust guarantees nobody writes during the copy, so it is not these bytes.
        unsafe { copy_bytes(src.as_ptr(), self.ptr.as_ptr().add(o), src.len()) };
        Ok(())
    }

    /// Copies `src` into the span at `off`, storing its last 8 bytes after all the others
    /// (with a release fence between): a peer that polls the last byte of a payload and sees
    /// it written sees the whole payload (the ordering an RDMA WRITE gives on real HCAs).
    #[inline(always)]
    pub fn write_ordered(&self, off: u64, src: &[u8]) -> Result<(), MemError> {
        let n = src.len();
        if n <= 8 {
            return self.write(off, src);
        }
        let o = self.check_write(off, n as u64)?;
        let head = n - 8;
        // SAFETY: as in `write`; `head + 8 == n`, so both copies stay inside the checked range.
        unsafe {
            let d = self.ptr.as_ptr().add(o);
            copy_bytes(src.as_ptr(), d, head);
            // SYNC POINT write-order (release): the body is visible before the last 8 bytes
            // (the peer polls the last byte; its acquire is its read of that byte's line).
            crate::sync::fence(crate::sync::Ordering::Release);
            copy_bytes(src.as_ptr().add(head), d.add(head), 8);
        }
        Ok(())
    }

    /// Copies `n` bytes at `off` of this span to `dst_off` of `dst`.
    #[inline(always)]
    pub fn copy_to(&self, off: u64, dst: &Span, dst_off: u64, n: usize) -> Result<(), MemError> {
        // One branch for the four conditions (this is the RDMA WRITE's copy: every branch
        // before the store delays the moment the peer sees the data).
        let n64 = n as u64;
        let (s_end, s_over) = off.overflowing_add(n64);
        let (d_end, d_over) = dst_off.overflowing_add(n64);
        if s_over | d_over | (s_end > self.len) | (d_end > dst.len) | !dst.writable {
            return Err(self.copy_error(off, dst, dst_off, n64));
        }
        let (s, d) = (off as usize, dst_off as usize);
        // SAFETY: both ranges are inside live spans (checked), the destination writable. They
        // may be the same pages (two spans of one region, or a peer mapping one memfd twice):
        // `copy_bytes` is a byte copy that tolerates overlap of shared memory, which changes
        // bytes, never memory safety.
        unsafe { copy_bytes(self.ptr.as_ptr().add(s), dst.ptr.as_ptr().add(d), n) };
        Ok(())
    }

    /// Why `copy_to` refused (out of line: the fast path only branches to it).
    #[cold]
    #[inline(never)]
    fn copy_error(&self, off: u64, dst: &Span, dst_off: u64, n: u64) -> MemError {
        match (self.check(off, n), dst.check_write(dst_off, n)) {
            (Err(e), _) | (_, Err(e)) => e,
            _ => MemError::ReadOnly,
        }
    }

    /// As [`Span::copy_to`], storing the last 8 bytes last (see [`Span::write_ordered`]).
    #[inline(always)]
    pub fn copy_to_ordered(
        &self,
        off: u64,
        dst: &Span,
        dst_off: u64,
        n: usize,
    ) -> Result<(), MemError> {
        if n <= 8 {
            return self.copy_to(off, dst, dst_off, n);
        }
        self.copy_to(off, dst, dst_off, n - 8)?;
        // SYNC POINT write-order (release): as in `write_ordered`.
        crate::sync::fence(crate::sync::Ordering::Release);
        self.copy_to(off + (n - 8) as u64, dst, dst_off + (n - 8) as u64, 8)
    }

    /// As [`Span::copy_to`], with stores that bypass the cache (see [`copy_streaming`]).
    pub fn copy_to_streaming(
        &self,
        off: u64,
        dst: &Span,
        dst_off: u64,
        n: usize,
    ) -> Result<(), MemError> {
        let s = self.check(off, n as u64)?;
        let d = dst.check_write(dst_off, n as u64)?;
        // SAFETY: as in `copy_to`; overlapping spans copy garbage at worst (shared memory).
        unsafe { copy_streaming(self.ptr.as_ptr().add(s), dst.ptr.as_ptr().add(d), n) };
        Ok(())
    }

    /// Sets `[off, off+len)` to `byte`.
    pub fn fill(&self, off: u64, len: u64, byte: u8) -> Result<(), MemError> {
        let o = self.check_write(off, len)?;
        // SAFETY: the range is inside the live, writable span (checked).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(o), byte, len as usize) };
        Ok(())
    }

    /// `[off, off+len)` as a mutable slice, for zero-copy APIs that let the caller fill or read
    /// a ring record in place (the datagram path's `send_with`/`recv_with`).
    ///
    /// # Safety
    /// The caller has exclusive use of the range under a protocol (a ring reservation before
    /// commit, or a peeked record before release) and drops the slice before giving it up.
    /// A hostile peer that breaks the protocol can change the bytes under the slice; that
    /// changes data, never which memory is touched.
    #[allow(clippy::mut_from_ref)] // the bytes are shared memory, exclusivity is the contract
    #[inline(always)]
    pub unsafe fn bytes_mut(&self, off: u64, len: usize) -> Result<&mut [u8], MemError> {
        let o = self.check_write(off, len as u64)?;
        // SAFETY: inside the live span (checked); exclusivity is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(o), len) })
    }

    /// `[off, off+len)` as a shared slice, for reading bytes in place (zero-copy).
    ///
    /// # Safety
    /// Nobody — no thread of this process, no peer — writes the range while the slice lives:
    /// a ring record after it was peeked, or a region range after the completion that handed
    /// it to the caller and before it is given back (reposted, granted again).
    #[inline(always)]
    pub unsafe fn bytes(&self, off: u64, len: usize) -> Result<&[u8], MemError> {
        let o = self.check(off, len as u64)?;
        // SAFETY: inside the live span (checked); no writer while it lives (caller contract).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(o), len) })
    }

    /// The byte at `off`, read with a volatile load (for polling a byte a peer writes).
    #[inline(always)]
    pub fn load_volatile(&self, off: u64) -> Result<u8, MemError> {
        let o = self.check(off, 1)?;
        // SAFETY: inside the live span (checked); a volatile read of a byte is never torn.
        Ok(unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(o)) })
    }

    /// The `AtomicU64` at `off` (in bounds and 8-aligned, or an error), borrowed from the span.
    #[inline(always)]
    pub fn u64_at(&self, off: u64) -> Result<&AtomicU64, MemError> {
        let o = self.check(off, 8)?;
        let p = self.ptr.as_ptr().wrapping_add(o);
        if !(p as usize).is_multiple_of(8) {
            return Err(MemError::OutOfBounds {
                off,
                len: 8,
                size: self.len,
            });
        }
        // SAFETY: in bounds and 8-aligned (checked just above); AtomicU64 has u64's layout and
        // every access to it is atomic; the borrow cannot outlive the span, which keeps the
        // mapping.
        Ok(unsafe { &*p.cast::<AtomicU64>() })
    }

    /// Atomically adds `add` to the 8-aligned u64 at `off`; returns the old value.
    pub fn fetch_add(&self, off: u64, add: u64) -> Result<u64, MemError> {
        Ok(self
            .u64_at(off)?
            .fetch_add(add, crate::sync::Ordering::SeqCst))
    }

    /// Atomically replaces the 8-aligned u64 at `off` with `swap` if it equals `compare`;
    /// returns the old value either way.
    pub fn compare_swap(&self, off: u64, compare: u64, swap: u64) -> Result<u64, MemError> {
        use crate::sync::Ordering::SeqCst;
        Ok(
            match self
                .u64_at(off)?
                .compare_exchange(compare, swap, SeqCst, SeqCst)
            {
                Ok(v) | Err(v) => v,
            },
        )
    }

    /// Asks the CPU to start loading the line at `off` (a hint; out-of-range offsets are
    /// ignored).
    #[inline(always)]
    pub fn prefetch(&self, off: u64) {
        if off < self.len {
            crate::sync::prefetch(self.ptr.as_ptr().wrapping_add(off as usize));
        }
    }

    /// Asks for the line at `off` in a writable state (a hint; see
    /// [`crate::sync::prefetch_write`]).
    #[inline(always)]
    pub fn prefetch_write(&self, off: u64) {
        if off < self.len {
            crate::sync::prefetch_write(self.ptr.as_ptr().wrapping_add(off as usize));
        }
    }

    /// Maps the span's pages into this process's page tables now (see [`Region::populate`]).
    pub fn populate(&self, write: bool) {
        let page = 4096usize;
        let start = self.ptr.as_ptr() as usize & !(page - 1);
        let end = (self.ptr.as_ptr() as usize + self.len as usize).div_ceil(page) * page;
        let advice = if write {
            libc::MADV_POPULATE_WRITE
        } else {
            libc::MADV_POPULATE_READ
        };
        // SAFETY: the span lies in a live mapping, which starts and ends on page boundaries,
        // so the rounded-out range is still that mapping's; MADV_POPULATE_* only faults pages
        // in and changes no contents.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
    }

    /// The address of byte `off`, for hints and for handing to C callers; never dereferenced
    /// by Rust code outside this module.
    #[inline(always)]
    pub fn addr(&self, off: u64) -> *const u8 {
        self.ptr.as_ptr().wrapping_add(off as usize)
    }
}

/// `memcpy` between two ranges of which at least one is shared memory.
///
/// # Safety
/// Both ranges are valid for `n` bytes. They may overlap only if both are shared memory (a
/// peer mapping the same pages twice), which yields garbage bytes, never a fault.
#[inline(always)]
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: (all branches) caller contract.
    unsafe {
        if n == 8 {
            // The common small case (8-byte messages, atomics) without a call.
            std::ptr::write_unaligned(
                dst.cast::<u64>(),
                std::ptr::read_unaligned(src.cast::<u64>()),
            );
        } else if n < 8 {
            for i in 0..n {
                *dst.add(i) = *src.add(i);
            }
        } else {
            std::ptr::copy(src, dst, n)
        }
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

/// `len` bytes at `off` of a span, handed to UCX in place ([`backplane_ucx::Link::send_zc`]):
/// the span's clone keeps them mapped until UCX drops this.
pub(crate) struct SpanBytes {
    span: Span,
    off: usize,
    len: usize,
}

impl SpanBytes {
    /// `[off, off+len)` of `span`, if it lies in it.
    pub(crate) fn new(span: &Span, off: u64, len: usize) -> Result<Self, MemError> {
        let off = span.check(off, len as u64)?;
        Ok(Self {
            span: span.clone(),
            off,
            len,
        })
    }
}

// SAFETY: the range was checked to lie in the span at `new`, and the span's `Arc<Region>`
// keeps its mapping alive for as long as this value lives; the range never changes.
unsafe impl backplane_ucx::InPlace for SpanBytes {
    fn bytes(&self) -> (*const u8, usize) {
        (
            self.span.ptr.as_ptr().wrapping_add(self.off).cast_const(),
            self.len,
        )
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
    fn spans_check_every_access_and_refuse_writes_through_a_read_only_mapping() {
        let rw = Arc::new(Region::create("bp-test", 8192).unwrap());
        let ro = Arc::new(Region::map(rw.fd().try_clone_to_owned().unwrap(), false).unwrap());
        let a = Span::new(&rw, 4096, 4096).unwrap();
        let r = Span::new(&ro, 4096, 4096).unwrap();
        assert!(Span::new(&rw, 4096, 4097).is_err());
        assert!(a.sub(4000, 97).is_err());
        a.write(4088, b"12345678").unwrap();
        assert!(a.write(4089, b"12345678").is_err());
        assert!(a.write(u64::MAX, b"x").is_err());
        let mut got = [0u8; 8];
        r.read(4088, &mut got).unwrap();
        assert_eq!(&got, b"12345678", "the same bytes through both mappings");
        assert!(r.write(0, b"x").is_err(), "read-only mapping");
        assert!(r.fill(0, 1, 0).is_err());
        assert!(
            a.copy_to(0, &r, 0, 8).is_err(),
            "copy into a read-only span"
        );
        assert!(r.copy_to(4088, &a, 0, 8).is_ok());
        assert!(r.copy_to(4089, &a, 0, 8).is_err());
        assert!(a.copy_to(0, &a, 4089, 8).is_err());
        // SAFETY: nothing else uses these spans while the slices live.
        unsafe {
            assert!(
                r.bytes_mut(0, 8).is_err(),
                "no &mut into a read-only mapping"
            );
            assert!(a.bytes_mut(4090, 8).is_err());
            assert_eq!(a.bytes(4088, 8).unwrap(), b"12345678");
        }
        assert!(a.u64_at(4).is_err(), "misaligned");
        assert!(a.u64_at(4096).is_err());
        assert_eq!(a.load_volatile(4095).unwrap(), b'8');
        let w = Word32::at(&rw, 4092).unwrap();
        assert!(Word32::at(&rw, 8190).is_err());
        w.store(7, crate::sync::Ordering::Relaxed);
        assert_eq!(
            Word32::at(&ro, 4092)
                .unwrap()
                .load(crate::sync::Ordering::Relaxed),
            7
        );
    }

    #[test]
    fn an_ordered_span_write_lands_whole_for_every_length() {
        let rw = Arc::new(Region::create("bp-test", 8192).unwrap());
        let src_r = Arc::new(Region::create("bp-test", 8192).unwrap());
        let (d, s) = (Span::whole(&rw), Span::whole(&src_r));
        for n in [0usize, 1, 7, 8, 9, 64, 4096] {
            let src: Vec<u8> = (0..n).map(|i| i as u8 ^ 0x3c).collect();
            s.write(10, &src).unwrap();
            d.fill(0, 8192, 0).unwrap();
            d.write_ordered(100, &src).unwrap();
            let mut got = vec![0u8; n];
            d.read(100, &mut got).unwrap();
            assert_eq!(got, src, "{n} bytes written");
            d.fill(0, 8192, 0).unwrap();
            s.copy_to_ordered(10, &d, 200, n).unwrap();
            d.read(200, &mut got).unwrap();
            assert_eq!(got, src, "{n} bytes copied");
        }
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
