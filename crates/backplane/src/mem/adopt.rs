//! Memory a program allocated, put under a region in place: how an unmodified libibverbs
//! program's `ibv_reg_mr(pd, malloc'd buffer, …)` becomes memory peers can map.
//!
//! Peers reach a region by mapping its memfd, so registered bytes must live in one. A program's
//! `malloc`/`mmap` buffer is private anonymous memory; [`Adopted::new`] moves it into a region
//! without changing its addresses: the pages' bytes are copied into the region's memfd (mapped
//! at a spare address), and that mapping is then moved onto the buffer's pages with
//! `mremap(MREMAP_FIXED)`, which replaces them in one step (no moment where the addresses are
//! unmapped). The program keeps its pointers and reads a peer's RDMA WRITE where it expects
//! it, zero-copy. Dropping an [`Adopted`] (deregistration) does the reverse — private
//! anonymous pages with the same bytes — if the pages are still the region's, so a peer's
//! mapping of the memfd no longer reaches memory the program reuses.
//!
//! The alternative, leaving the buffer where it is and having peers write it with
//! `process_vm_writev`, costs a system call per access (see `docs/architecture.md` for the
//! figures) and leaves no memory a peer can poll: it was measured and not chosen.
//!
//! What the program must know (as with pinning on a NIC): bytes another thread writes into the
//! buffer's pages *while* `ibv_reg_mr` runs may be lost; after `fork()` the child shares the
//! registered pages with the parent instead of copying them (libibverbs' `ibv_fork_init`
//! problem, the other way round).
//!
//! Pages that are shared already — a `MAP_SHARED` mapping (memfd, SysV segment, POSIX shared
//! memory, shared anonymous memory), or pages of another live registration — are not moved
//! (other processes, or the other registration's peers, share them): [`shared_backing`] finds
//! the object under them, and the region's data is that object's file from that offset, with
//! a header page of its own.

use std::sync::Arc;

use super::{MemError, Region};

const PAGE: usize = 4096;

/// A range of this process's pages backed by (part of) a region, until dropped.
#[derive(Debug)]
pub struct Adopted {
    at: usize,
    len: usize,
    region: Arc<Region>,
    /// The memfd's identity, to recognise the pages as still ours at drop.
    ident: (u64, u64),
    /// The protections the pages had, per `/proc/self/maps` segment: restored at both ends.
    prots: Vec<(usize, usize, rustix::mm::MprotectFlags)>,
}

/// One line of `/proc/self/maps`.
struct Segment {
    start: usize,
    end: usize,
    perms: [u8; 4],
    /// The file offset of `start`.
    off: u64,
    dev_ino: (u64, u64),
    /// The whole mapping's bounds (`start`/`end` may be clipped to a range).
    whole: (usize, usize),
}

fn segments() -> std::io::Result<Vec<Segment>> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    Ok(maps.lines().filter_map(parse_segment).collect())
}

fn parse_segment(l: &str) -> Option<Segment> {
    let mut w = l.split_whitespace();
    let (s, e) = w.next()?.split_once('-')?;
    let p = w.next()?.as_bytes();
    let off = u64::from_str_radix(w.next()?, 16).ok()?;
    let (maj, min) = w.next()?.split_once(':')?;
    let ino = w.next()?.parse::<u64>().ok()?;
    let dev = (u64::from_str_radix(maj, 16).ok()? << 8) | u64::from_str_radix(min, 16).ok()?;
    let (start, end) = (
        usize::from_str_radix(s, 16).ok()?,
        usize::from_str_radix(e, 16).ok()?,
    );
    Some(Segment {
        start,
        end,
        perms: p.get(..4)?.try_into().ok()?,
        off,
        dev_ino: (dev, ino),
        whole: (start, end),
    })
}

/// The segments covering `[at, at + len)`, clipped to it; an error if a byte is unmapped.
///
/// Asked of the kernel mapping by mapping (`PROCMAP_QUERY`, Linux 6.11): reading the whole of
/// `/proc/self/maps` — three times a registration and its deregistration — was half of an
/// `ibv_reg_mr`'s time (the kernel formats every mapping of the process; a program with many
/// libraries, an MPI rank, has hundreds). Older kernels: the file as before.
fn covering(at: usize, len: usize) -> Result<Vec<Segment>, String> {
    match query::covering(at, len) {
        Some(r) => r,
        None => covering_from_file(at, len),
    }
}

/// [`covering`] from the text of `/proc/self/maps`.
fn covering_from_file(at: usize, len: usize) -> Result<Vec<Segment>, String> {
    let all = segments().map_err(|e| format!("cannot read /proc/self/maps: {e}"))?;
    let end = at + len;
    let mut next = at;
    let mut out = Vec::new();
    for s in all.into_iter().filter(|s| s.end > at && s.start < end) {
        if s.start > next {
            break;
        }
        next = s.end;
        let start = s.start.max(at);
        out.push(Segment {
            start,
            end: s.end.min(end),
            off: s.off + (start - s.start) as u64,
            ..s
        });
    }
    if next < end {
        return Err(format!("{:#x}..{:#x} is not all mapped memory", at, end));
    }
    Ok(out)
}

/// `PROCMAP_QUERY` (`ioctl` on `/proc/self/maps`): one mapping at a time, no text.
mod query {
    use super::Segment;
    use std::os::fd::AsRawFd;

    /// `_IOWR('f', 17, struct procmap_query)` (`<linux/fs.h>`, Linux 6.11).
    const PROCMAP_QUERY: libc::c_ulong = 0xC068_6611;
    const READABLE: u64 = 0x01;
    const WRITABLE: u64 = 0x02;
    const EXECUTABLE: u64 = 0x04;
    const SHARED: u64 = 0x08;

    /// `struct procmap_query`, as the kernel's uapi header lays it out (104 bytes).
    #[repr(C)]
    #[derive(Default)]
    struct ProcmapQuery {
        size: u64,
        query_flags: u64,
        query_addr: u64,
        vma_start: u64,
        vma_end: u64,
        vma_flags: u64,
        vma_page_size: u64,
        vma_offset: u64,
        inode: u64,
        dev_major: u32,
        dev_minor: u32,
        vma_name_size: u32,
        build_id_size: u32,
        vma_name_addr: u64,
        build_id_addr: u64,
    }
    const _: () = assert!(std::mem::size_of::<ProcmapQuery>() == 104);

    /// Whether the kernel answered `PROCMAP_QUERY` (false once it did not: `ENOTTY` on a
    /// kernel before 6.11, or a filter refusing `ioctl`).
    static WORKS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

    /// The mappings covering `[at, at + len)` clipped to it, an error if a byte is unmapped;
    /// `None` if the kernel cannot say (the caller reads the file).
    pub(super) fn covering(at: usize, len: usize) -> Option<Result<Vec<Segment>, String>> {
        use std::sync::atomic::Ordering::Relaxed;
        if !WORKS.load(Relaxed) {
            return None;
        }
        // (Opened each time: a descriptor kept across a fork() would answer for the parent.)
        let maps = std::fs::File::open("/proc/self/maps").ok()?;
        let end = at.checked_add(len)?;
        let mut next = at;
        let mut out = Vec::new();
        while next < end {
            let mut q = ProcmapQuery {
                size: std::mem::size_of::<ProcmapQuery>() as u64,
                query_addr: next as u64,
                ..ProcmapQuery::default()
            };
            // SAFETY: `q` is a `struct procmap_query` of the size it says, with no name or
            // build-id buffer (their sizes 0); the kernel writes only into it.
            let r = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY, &mut q) };
            if r != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ENOENT) {
                    // No mapping covers `next`.
                    return Some(Err(format!(
                        "{:#x}..{:#x} is not all mapped memory",
                        at, end
                    )));
                }
                WORKS.store(false, Relaxed);
                return None;
            }
            let (start, vend) = (q.vma_start as usize, q.vma_end as usize);
            // (The kernel's answer, checked: a mapping that covers `next`.)
            if start > next || vend <= next {
                WORKS.store(false, Relaxed);
                return None;
            }
            let bit = |b: u64, c: u8| if q.vma_flags & b != 0 { c } else { b'-' };
            let perms = [
                bit(READABLE, b'r'),
                bit(WRITABLE, b'w'),
                bit(EXECUTABLE, b'x'),
                if q.vma_flags & SHARED != 0 {
                    b's'
                } else {
                    b'p'
                },
            ];
            let dev = (u64::from(q.dev_major) << 8) | u64::from(q.dev_minor);
            let clipped = next.max(start);
            out.push(Segment {
                start: clipped,
                end: vend.min(end),
                off: q.vma_offset + (clipped - start) as u64,
                perms,
                dev_ino: (dev, q.inode),
                whole: (start, vend),
            });
            next = vend;
        }
        Some(Ok(out))
    }
}

fn prot_of(p: &[u8; 4]) -> rustix::mm::MprotectFlags {
    use rustix::mm::MprotectFlags as F;
    let mut f = F::empty();
    if p[0] == b'r' {
        f |= F::READ;
    }
    if p[1] == b'w' {
        f |= F::WRITE;
    }
    if p[2] == b'x' {
        f |= F::EXEC;
    }
    f
}

fn memfd_ident(region: &Region) -> (u64, u64) {
    rustix::fs::fstat(region.fd())
        .map(|s| (s.st_dev, s.st_ino))
        .unwrap_or((u64::MAX, u64::MAX))
}

/// The kernel's `st_dev` for a memfd is the encoded device number; `/proc/self/maps` prints
/// major:minor. Both sides are compared through this.
fn dev_as_maps(dev: u64) -> u64 {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major << 8) | minor
}

/// The pages this process put under its own regions (weakly: as long as a registration holds
/// them): where a range inside them is registered again, the new registration reaches the same
/// memfd without `/proc/self/map_files` (which needs privilege), and holds the pages so that
/// they stay under the memfd until the last registration over them is gone.
static ADOPTING: std::sync::Mutex<Vec<std::sync::Weak<Adopted>>> =
    std::sync::Mutex::new(Vec::new());

/// Pages of this process put under a region whose memfd is the file `dev_ino` (as
/// `/proc/self/maps` prints it).
fn adopted_file(dev_ino: (u64, u64)) -> Option<Arc<Adopted>> {
    let mut all = ADOPTING.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|w| w.strong_count() > 0);
    all.iter()
        .filter_map(|w| w.upgrade())
        .find(|a| (dev_as_maps(a.ident.0), a.ident.1) == dev_ino)
}

/// The shared object under a range of this process's memory: its file (open read-write if
/// every page of the range is mapped writable, else read-only) and the file offset of the
/// range's first byte.
#[derive(Debug)]
pub struct SharedBacking {
    /// The object's file.
    pub fd: std::os::fd::OwnedFd,
    /// Where the range starts in it (page-aligned).
    pub off: u64,
    /// Whether every page of the range is mapped writable (and `fd` open for writing).
    pub writable: bool,
    /// The pages of another registration the range is inside: held, so that they stay under
    /// its memfd (which this registration's peers map) while this registration lives.
    pub holds: Option<Arc<Adopted>>,
}

/// What backs the pages `[at, at + len)` (page-aligned): `None` if they are all private
/// memory (put them under a region with [`Adopted::new`]); the object if one shared object
/// backs all of them, contiguously — a `MAP_SHARED` mapping (memfd, SysV segment, POSIX shared
/// memory, shared anonymous memory) or pages of another region of this process. Such memory
/// is registered where it is: a region's data is that object, from that offset. A range
/// that mixes private and shared pages or two objects, or is not all mapped, is an error.
///
/// The object's file comes from this process's own regions, else from
/// `/proc/self/map_files/`, which needs `CAP_SYS_ADMIN` or `CAP_CHECKPOINT_RESTORE`.
pub fn shared_backing(at: usize, len: usize) -> Result<Option<SharedBacking>, String> {
    let segs = covering(at, len)?;
    if let Some(s) = segs.iter().find(|s| s.perms[0] != b'r') {
        return Err(format!("{:#x}..{:#x} is not readable", s.start, s.end));
    }
    let shared = segs.iter().filter(|s| s.perms[3] == b's').count();
    if shared == 0 {
        return Ok(None);
    }
    let first = &segs[0];
    if shared < segs.len() {
        return Err(format!(
            "{at:#x}+{len} mixes private and shared memory: register them separately"
        ));
    }
    let mut expect = first.off;
    for s in &segs {
        if s.dev_ino != first.dev_ino || s.off != expect {
            return Err(format!(
                "{at:#x}+{len} spans two shared mappings: register them separately"
            ));
        }
        expect += (s.end - s.start) as u64;
    }
    let writable = segs.iter().all(|s| s.perms[1] == b'w');
    let holds = adopted_file(first.dev_ino);
    let fd = match &holds {
        Some(a) => a
            .region
            .fd()
            .try_clone_to_owned()
            .map_err(|e| format!("cannot share the region under {at:#x}: {e}"))?,
        None => {
            use rustix::fs::{open, Mode, OFlags};
            let path = format!(
                "/proc/self/map_files/{:x}-{:x}",
                first.whole.0, first.whole.1
            );
            let mode = if writable {
                OFlags::RDWR
            } else {
                OFlags::RDONLY
            };
            open(&path, mode | OFlags::CLOEXEC, Mode::empty()).map_err(|e| {
                if e == rustix::io::Errno::PERM || e == rustix::io::Errno::ACCESS {
                    format!(
                        "{at:#x}+{len} is shared memory (a MAP_SHARED mapping): registering it \
                         where it is needs its file from {path}, which needs CAP_SYS_ADMIN or \
                         CAP_CHECKPOINT_RESTORE; register private memory (malloc, \
                         MAP_PRIVATE) instead"
                    )
                } else {
                    format!("cannot open {path} for the shared memory at {at:#x}: {e}")
                }
            })?
        }
    };
    Ok(Some(SharedBacking {
        fd,
        off: first.off,
        writable,
        holds,
    }))
}

fn map_err(len: usize, e: impl Into<std::io::Error>) -> MemError {
    MemError::Map {
        len,
        source: e.into(),
    }
}

impl Adopted {
    /// Puts the pages `[at, at + len)` of this process (page-aligned) under `region` at
    /// `off` (page-aligned, `off + len` inside the region), keeping their bytes, addresses and
    /// protections. Fails (nothing changed) if a byte is unmapped or unreadable, or a page is
    /// shared memory already.
    ///
    /// # Safety
    /// The range is memory of this process whose contents may move to other physical pages:
    /// no thread writes it during the call, and nothing relies on its pages being private
    /// (the module's notes).
    pub unsafe fn new(
        region: &Arc<Region>,
        off: u64,
        at: *mut u8,
        len: usize,
    ) -> Result<Self, MemError> {
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        let at = at as usize;
        let inval = |m: String| {
            map_err(
                len,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, m),
            )
        };
        if !at.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) || len == 0 {
            return Err(inval(format!("{at:#x}+{len} is not whole pages")));
        }
        region.check(off, len as u64, PAGE as u64)?;
        let segs = covering(at, len).map_err(inval)?;
        if let Some(s) = segs.iter().find(|s| s.perms[0] != b'r') {
            return Err(inval(format!(
                "{:#x}..{:#x} is not readable",
                s.start, s.end
            )));
        }
        if let Some(s) = segs.iter().find(|s| s.perms[3] == b's') {
            return Err(inval(format!(
                "{:#x}..{:#x} is shared memory already (a MAP_SHARED mapping or a page of \
                 another registered region): only private memory can be registered in place",
                s.start, s.end
            )));
        }
        let prots: Vec<_> = segs
            .iter()
            .map(|s| (s.start, s.end, prot_of(&s.perms)))
            .collect();
        // SAFETY: a fresh kernel-chosen mapping of the memfd (aliases nothing); unmapped below
        // on failure or moved onto `at`.
        let tmp = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::POPULATE,
                region.fd(),
                off,
            )
        }
        .map_err(|e| map_err(len, e))?;
        // SAFETY: `at..at+len` is mapped and readable (checked above) and may change backing
        // (the caller's contract); `tmp` is our fresh writable mapping of `len` bytes.
        unsafe { copy_and_swap(tmp, at, len, &prots, Backing::Memfd(region.fd(), off)) }
            .map_err(|e| map_err(len, e))?;
        Ok(Self {
            at,
            len,
            ident: memfd_ident(region),
            region: region.clone(),
            prots,
        })
    }

    /// [`Adopted::new`], shared: later registrations of ranges inside these pages find them
    /// ([`shared_backing`]) and hold them; the pages become private again when the last holder
    /// is dropped.
    ///
    /// # Safety
    /// As [`Adopted::new`]'s.
    pub unsafe fn new_shared(
        region: &Arc<Region>,
        off: u64,
        at: *mut u8,
        len: usize,
    ) -> Result<Arc<Self>, MemError> {
        // SAFETY: the caller's contract is `new`'s.
        let a = Arc::new(unsafe { Self::new(region, off, at, len) }?);
        let mut all = ADOPTING.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&a));
        Ok(a)
    }

    /// The first adopted address.
    pub fn addr(&self) -> *mut u8 {
        self.at as *mut u8
    }

    /// The region the pages are under.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// True if every page of the range still maps this region's memfd (the program did not
    /// unmap or remap it meanwhile).
    fn still_ours(&self) -> bool {
        let (dev, ino) = self.ident;
        covering(self.at, self.len).is_ok_and(|segs| {
            segs.iter()
                .all(|s| s.dev_ino == (dev_as_maps(dev), ino) && s.perms[3] == b's')
        })
    }
}

impl Drop for Adopted {
    fn drop(&mut self) {
        use rustix::mm::{mmap_anonymous, mprotect, MapFlags, ProtFlags};
        if !self.still_ours() {
            return;
        }
        let len = self.len;
        // SAFETY: a fresh private anonymous mapping (aliases nothing).
        let Ok(tmp) = (unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE | MapFlags::POPULATE,
            )
        }) else {
            return;
        };
        // Unreadable pages (mprotect'ed by the program) cannot be copied; make them readable
        // for the copy (their protection is restored below).
        // SAFETY: the range is ours (checked), the protection change is undone below.
        let _ = unsafe {
            mprotect(
                self.at as *mut std::ffi::c_void,
                len,
                rustix::mm::MprotectFlags::READ,
            )
        };
        // SAFETY: `at..at+len` is our readable mapping (made readable above), which the
        // program gave up with the registration; `tmp` a fresh writable one.
        if unsafe { copy_and_swap(tmp, self.at, len, &self.prots, Backing::Anon) }.is_err() {
            for &(s, e, p) in &self.prots {
                // SAFETY: part of the range, still the shared pages; the protection the
                // program gave it.
                let _ = unsafe { mprotect(s as *mut std::ffi::c_void, e - s, p) };
            }
        }
    }
}

/// What `tmp` maps in [`copy_and_swap`]: what to map at the pages' addresses where the
/// kernel (or a tool such as valgrind, which refuses `mremap(MREMAP_FIXED)`) will not move it.
#[derive(Clone, Copy)]
enum Backing<'a> {
    /// The region's memfd at this offset (registration).
    Memfd(std::os::fd::BorrowedFd<'a>, u64),
    /// Private anonymous memory (deregistration).
    Anon,
}

/// Copies the `len` bytes at `at` into `tmp` and moves `tmp` onto `at` in one step (the
/// pages change backing, their addresses and bytes stay), then gives each part of the range
/// in `prots` its protection back (the new pages are read-write). On failure `tmp` is
/// unmapped and the pages at `at` are as they were.
///
/// Where `mremap(MREMAP_FIXED)` is refused with `EINVAL` (a program run under valgrind,
/// which does not emulate it), `backing` is mapped over the pages with `MAP_FIXED` instead:
/// for a memfd the same one-step replacement (its bytes are the copy already); for
/// anonymous memory the fresh pages are zero until the copy back, a moment in which the
/// program, which gave the range up with the deregistration, must not read it.
///
/// # Safety
/// `at..at+len` is mapped and readable by this process and may change backing; `tmp` is a
/// mapping of ours, writable, `len` bytes, aliased by nothing, not used after the call, and
/// it maps `backing` (from its start).
unsafe fn copy_and_swap(
    tmp: *mut std::ffi::c_void,
    at: usize,
    len: usize,
    prots: &[(usize, usize, rustix::mm::MprotectFlags)],
    backing: Backing<'_>,
) -> rustix::io::Result<()> {
    use rustix::mm::{mprotect, mremap_fixed, MprotectFlags, MremapFlags};
    // SAFETY: both ranges are `len` readable/writable bytes (caller) and do not overlap
    // (`tmp` aliases nothing).
    unsafe { std::ptr::copy_nonoverlapping(at as *const u8, tmp.cast::<u8>(), len) };
    // SAFETY: moves our mapping onto the caller's pages, replacing them atomically; the
    // caller allows the pages to change backing; `tmp` is not used after.
    let moved = unsafe { mremap_fixed(tmp, len, len, MremapFlags::MAYMOVE, at as *mut _) };
    let moved = match moved {
        // SAFETY: as for the move: the caller's pages may change backing; `tmp` is only
        // read (anonymous) or unmapped after.
        Err(rustix::io::Errno::INVAL) => unsafe { map_over(tmp, at, len, backing) },
        other => other.map(drop),
    };
    if let Err(e) = moved {
        // SAFETY: our own temporary mapping, not moved.
        let _ = unsafe { rustix::mm::munmap(tmp, len) };
        return Err(e);
    }
    for &(s, e, p) in prots {
        if p != MprotectFlags::READ | MprotectFlags::WRITE {
            // SAFETY: a part of the range just mapped; the protection it had before.
            let _ = unsafe { mprotect(s as *mut std::ffi::c_void, e - s, p) };
        }
    }
    Ok(())
}

/// [`copy_and_swap`]'s way where `mremap(MREMAP_FIXED)` is refused: maps `backing` over
/// `at..at+len` with `MAP_FIXED` (anonymous memory then gets `tmp`'s bytes) and unmaps `tmp`.
/// On failure `tmp` is still mapped and the pages at `at` are as they were.
///
/// # Safety
/// As [`copy_and_swap`]'s, with `tmp` holding the pages' bytes.
unsafe fn map_over(
    tmp: *mut std::ffi::c_void,
    at: usize,
    len: usize,
    backing: Backing<'_>,
) -> rustix::io::Result<()> {
    use rustix::mm::{mmap, mmap_anonymous, MapFlags, ProtFlags};
    let rw = ProtFlags::READ | ProtFlags::WRITE;
    match backing {
        // SAFETY: replaces the caller's pages (which may change backing) with the memfd's,
        // which hold their bytes (copied through `tmp`, a mapping of the same range).
        Backing::Memfd(fd, off) => unsafe {
            mmap(
                at as *mut _,
                len,
                rw,
                MapFlags::SHARED | MapFlags::FIXED,
                fd,
                off,
            )
        }
        .map(drop)?,
        Backing::Anon => {
            // SAFETY: replaces the caller's pages with fresh private ones, then gives them
            // the bytes kept in `tmp` (a separate mapping of `len` readable bytes).
            unsafe {
                mmap_anonymous(at as *mut _, len, rw, MapFlags::PRIVATE | MapFlags::FIXED)?;
                std::ptr::copy_nonoverlapping(tmp.cast::<u8>(), at as *mut u8, len);
            }
        }
    };
    // SAFETY: our own temporary mapping, no longer needed.
    let _ = unsafe { rustix::mm::munmap(tmp, len) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn byte(r: &Region, off: u64) -> u8 {
        let mut b = [0u8];
        r.read(off, &mut b).unwrap();
        b[0]
    }

    fn anon(len: usize) -> *mut u8 {
        use rustix::mm::{mmap_anonymous, MapFlags, ProtFlags};
        // SAFETY: a fresh private mapping, leaked by the test.
        unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .unwrap()
        .cast()
    }

    /// The kernel's answer (`PROCMAP_QUERY`) and the text of `/proc/self/maps` say the same of
    /// private and shared memory, a region's memfd mapping, a read-only page, ranges across
    /// mappings and a range that runs into a hole.
    #[test]
    fn the_kernels_answer_and_the_maps_file_agree() {
        // Another test's thread may map a page into the hole meanwhile (seen under load: 1
        // run in 10 with two CPU hogs): the maps file says so afterwards, and the test goes
        // again with a new hole.
        for _ in 0..20 {
            if !kernel_and_file_agree_once() {
                return;
            }
        }
        panic!("the hole was filled by another thread in 20 tries");
    }

    /// One try of [`the_kernels_answer_and_the_maps_file_agree`]: false once it concluded
    /// (or the kernel cannot answer), true if the hole was filled meanwhile.
    fn kernel_and_file_agree_once() -> bool {
        let p = anon(4 * PAGE) as usize;
        // A hole after the first page, a read-only third page.
        // SAFETY: the test's own fresh mapping.
        unsafe {
            rustix::mm::munmap((p + PAGE) as *mut _, PAGE).unwrap();
            rustix::mm::mprotect(
                (p + 2 * PAGE) as *mut _,
                PAGE,
                rustix::mm::MprotectFlags::READ,
            )
            .unwrap();
        }
        let r = Region::create("bp-test-query", 2 * PAGE).unwrap();
        let m = r.ptr.as_ptr() as usize;
        let flat = |v: Result<Vec<Segment>, String>| {
            v.map(|v| {
                v.iter()
                    .map(|s| (s.start, s.end, s.perms, s.off, s.dev_ino, s.whole))
                    .collect::<Vec<_>>()
            })
        };
        let mut answers = Vec::new();
        for (at, len) in [
            (p, PAGE),
            (p, 2 * PAGE),
            (p + 2 * PAGE, 2 * PAGE),
            (p + 3 * PAGE, PAGE),
            (m, 2 * PAGE),
            (m + PAGE, PAGE),
            (m + 100, 10),
        ] {
            let Some(k) = query::covering(at, len) else {
                return false; // a kernel before 6.11: nothing to compare
            };
            answers.push((at, len, flat(k), flat(covering_from_file(at, len))));
        }
        let hole = query::covering(p, 2 * PAGE).unwrap();
        if covering_from_file(p, 2 * PAGE).is_ok() {
            // SAFETY: the test's own pages around the hole (page 0, pages 2 and 3).
            unsafe {
                let _ = rustix::mm::munmap(p as *mut _, PAGE);
                let _ = rustix::mm::munmap((p + 2 * PAGE) as *mut _, 2 * PAGE);
            }
            return true;
        }
        for (at, len, k, f) in answers {
            assert_eq!(k, f, "{at:#x}+{len:#x}");
        }
        assert!(hole.is_err(), "the hole");
        assert_eq!(
            query::covering(m, 2 * PAGE).unwrap().unwrap()[0].perms[3],
            b's'
        );
        assert_eq!(
            query::covering(p + 2 * PAGE, PAGE).unwrap().unwrap()[0].perms,
            *b"r--p"
        );
        false
    }

    #[test]
    fn adopted_pages_keep_their_bytes_and_share_the_region_until_dropped() {
        let p = anon(3 * PAGE);
        // SAFETY: our fresh mapping of three pages.
        unsafe { std::ptr::write_bytes(p, 0x5a, 3 * PAGE) };
        let r = Arc::new(Region::create("bp-test-adopt", 4 * PAGE).unwrap());
        // SAFETY: the test's own private pages, written by no other thread.
        let a = unsafe { Adopted::new(&r, PAGE as u64, p, 3 * PAGE) }.unwrap();
        assert_eq!(
            byte(&r, PAGE as u64 + 7),
            0x5a,
            "bytes moved into the region"
        );
        // SAFETY: still our mapping (now the region's pages).
        unsafe { *p.add(9) = 1 };
        assert_eq!(
            byte(&r, PAGE as u64 + 9),
            1,
            "program writes reach the region"
        );
        r.write(PAGE as u64 + 10, &[2]).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { *p.add(10) }, 2, "region writes reach the program");
        assert!(a.still_ours());
        drop(a);
        // SAFETY: private again, same bytes.
        assert_eq!(unsafe { *p.add(10) }, 2);
        r.write(PAGE as u64 + 11, &[3]).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { *p.add(11) }, 0x5a, "no longer shared after drop");
    }

    #[test]
    fn a_range_inside_adopted_pages_is_their_memfd_and_holds_them_until_dropped() {
        let p = anon(2 * PAGE);
        // SAFETY: our fresh mapping of two pages.
        unsafe { std::ptr::write_bytes(p, 0x3c, 2 * PAGE) };
        assert!(
            shared_backing(p as usize, 2 * PAGE).unwrap().is_none(),
            "private memory"
        );
        let r = Arc::new(Region::create("bp-test-adopt", 3 * PAGE).unwrap());
        // SAFETY: the test's own private pages, written by no other thread.
        let a = unsafe { Adopted::new_shared(&r, PAGE as u64, p, 2 * PAGE) }.unwrap();
        let b = shared_backing(p as usize + PAGE, PAGE)
            .unwrap()
            .expect("shared now");
        assert_eq!(
            b.off,
            2 * PAGE as u64,
            "the memfd's offset of the second page"
        );
        assert!(b.writable && b.holds.is_some());
        let shared = |p: *mut u8| covering(p as usize, 2 * PAGE).unwrap()[0].perms[3] == b's';
        drop(a);
        assert!(shared(p), "still under the memfd while held");
        drop(b);
        assert!(!shared(p), "private again once nothing holds the pages");
        // SAFETY: our mapping, private again.
        assert_eq!(unsafe { *p.add(PAGE + 1) }, 0x3c, "with their bytes");
    }

    #[test]
    fn unmapped_shared_and_unaligned_ranges_are_refused() {
        let r = Arc::new(Region::create("bp-test-adopt", 4 * PAGE).unwrap());
        let p = anon(2 * PAGE);
        // SAFETY: refused before anything changes (unaligned).
        assert!(unsafe { Adopted::new(&r, PAGE as u64, p.wrapping_add(1), PAGE) }.is_err());
        // SAFETY: as above (past the region).
        assert!(unsafe { Adopted::new(&r, 3 * PAGE as u64, p, 2 * PAGE) }.is_err());
        // A shared page (the region's own mapping) is refused.
        let shared = r.ptr.as_ptr();
        // SAFETY: refused before anything changes.
        let e = unsafe { Adopted::new(&r, PAGE as u64, shared, PAGE) }.unwrap_err();
        assert!(e.to_string().contains("shared memory already"), "{e}");
        // SAFETY: our mapping; unmap its second page, then ask for both.
        unsafe { rustix::mm::munmap(p.add(PAGE).cast(), PAGE).unwrap() };
        // SAFETY: refused before anything changes — unless another test thread's mapping
        // filled the hole meanwhile (the kernel hands a freed hole out first): then the two
        // pages are all mapped and private, adopted and given back at drop; nothing to check.
        match unsafe { Adopted::new(&r, PAGE as u64, p, 2 * PAGE) } {
            Err(e) => assert!(
                e.to_string().contains("not all mapped")
                    || covering(p as usize + PAGE, PAGE).is_ok(),
                "{e}"
            ),
            Ok(a) => drop(a),
        }
    }

    #[test]
    fn pages_the_program_unmapped_are_left_alone_at_drop() {
        use rustix::mm::{mmap_anonymous, MapFlags, ProtFlags};
        let p = anon(PAGE);
        let r = Arc::new(Region::create("bp-test-adopt", 2 * PAGE).unwrap());
        // SAFETY: the test's own page.
        let a = unsafe { Adopted::new(&r, PAGE as u64, p, PAGE) }.unwrap();
        // SAFETY: the program frees its buffer before deregistering.
        unsafe { rustix::mm::munmap(p.cast(), PAGE).unwrap() };
        assert!(!a.still_ours());
        // The test's other threads map memory too, and the kernel hands out a freed hole
        // first: hold the address, inaccessible, so whatever is there after the drop is
        // either this placeholder or the drop's doing. (Taken already: nothing to check.)
        // SAFETY: NOREPLACE maps only where nothing is mapped.
        let held = unsafe {
            mmap_anonymous(
                p.cast(),
                PAGE,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::FIXED_NOREPLACE,
            )
        };
        drop(a);
        if let Ok(h) = held {
            let segs = covering(p as usize, PAGE).expect("the placeholder");
            assert!(
                segs.iter().all(|s| &s.perms[..3] == b"---"),
                "nothing mapped back over it"
            );
            // SAFETY: the placeholder mapped above, ours alone.
            unsafe { rustix::mm::munmap(h, PAGE).unwrap() };
        }
    }

    #[test]
    fn where_pages_cannot_be_moved_the_backing_is_mapped_over_them_with_their_bytes() {
        use rustix::mm::{mmap, mmap_anonymous, MapFlags, ProtFlags};
        let rw = ProtFlags::READ | ProtFlags::WRITE;
        let r = Arc::new(Region::create("bp-test-adopt", 2 * PAGE).unwrap());
        let p = anon(PAGE);
        // SAFETY: our fresh page.
        unsafe { std::ptr::write_bytes(p, 0x6b, PAGE) };
        // What `Adopted::new` does before the move: a mapping of the memfd with the bytes.
        // SAFETY: a fresh kernel-chosen mapping of the region's memfd.
        let tmp = unsafe {
            mmap(
                std::ptr::null_mut(),
                PAGE,
                rw,
                MapFlags::SHARED,
                r.fd(),
                PAGE as u64,
            )
        }
        .unwrap();
        // SAFETY: both our own mappings of a page each.
        unsafe { std::ptr::copy_nonoverlapping(p, tmp.cast(), PAGE) };
        // SAFETY: the test's own page, which may change backing; `tmp` maps the memfd there.
        unsafe { map_over(tmp, p as usize, PAGE, Backing::Memfd(r.fd(), PAGE as u64)) }.unwrap();
        assert_eq!(
            byte(&r, PAGE as u64 + 3),
            0x6b,
            "the bytes are the region's"
        );
        r.write(PAGE as u64 + 4, &[7]).unwrap();
        // SAFETY: our page, now the region's.
        assert_eq!(unsafe { *p.add(4) }, 7, "region writes reach the program");
        // And back, as a drop does.
        // SAFETY: a fresh private mapping.
        let back =
            unsafe { mmap_anonymous(std::ptr::null_mut(), PAGE, rw, MapFlags::PRIVATE) }.unwrap();
        // SAFETY: both our own mappings of a page each.
        unsafe { std::ptr::copy_nonoverlapping(p, back.cast(), PAGE) };
        // SAFETY: as above; `back` holds the bytes.
        unsafe { map_over(back, p as usize, PAGE, Backing::Anon) }.unwrap();
        r.write(PAGE as u64 + 5, &[9]).unwrap();
        // SAFETY: our page, private again.
        let (b4, b5) = unsafe { (*p.add(4), *p.add(5)) };
        assert_eq!((b4, b5), (7, 0x6b), "private again, with the bytes it had");
        let segs = covering(p as usize, PAGE).unwrap();
        assert!(segs.iter().all(|s| s.perms[3] == b'p'), "a private mapping");
    }
}
