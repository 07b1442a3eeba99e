//! Memory regions: this process's region table, peers' regions (through the transport),
//! and the gather/scatter copies between them, rings and caller memory.

use super::*;

// ---------------------------------------------------------------------------------------------
// Memory regions.
// ---------------------------------------------------------------------------------------------

/// Keys are random 32-bit numbers already: FxHash's one multiply is all a lookup needs
/// (SipHash would cost more than the rest of a post's key check).
pub(super) type KeyMap<T> = rustc_hash::FxHashMap<u32, T>;

/// This process's regions by key, with the last key looked up remembered (most work requests
/// of a QP use the same region).
#[derive(Default)]
pub(crate) struct MrTable {
    pub(super) slab: Vec<Option<LocalMr>>,
    pub(super) index: KeyMap<usize>,
    pub(super) last: std::cell::Cell<(u32, usize)>,
}

impl MrTable {
    pub(crate) fn insert(&mut self, key: u32, mr: LocalMr) {
        let i = match self.slab.iter().position(|m| m.is_none()) {
            Some(i) => {
                self.slab[i] = Some(mr);
                i
            }
            None => {
                self.slab.push(Some(mr));
                self.slab.len() - 1
            }
        };
        self.index.insert(key, i);
    }

    pub(crate) fn remove(&mut self, key: u32) {
        if let Some(i) = self.index.remove(&key) {
            self.slab[i] = None;
        }
        self.last.set((0, 0));
    }

    /// The region with `key`; the last key looked up is answered without hashing (the hot
    /// path posts from the same region again and again).
    #[inline(always)]
    pub(crate) fn get(&self, key: u32) -> Option<&LocalMr> {
        let (k, i) = self.last.get();
        if k == key && k != 0 {
            if let Some(Some(m)) = self.slab.get(i) {
                return Some(m);
            }
        }
        self.get_slow(key)
    }

    #[cold]
    #[inline(never)]
    pub(super) fn get_slow(&self, key: u32) -> Option<&LocalMr> {
        let i = *self.index.get(&key)?;
        self.last.set((key, i));
        self.slab[i].as_ref()
    }
}

/// A region registered by this process.
pub(crate) struct LocalMr {
    pub(crate) pd: u32,
    pub(crate) access: AccessFlags,
    /// The address of the first byte (scatter/gather entries name bytes by it): 0 for a
    /// region the library allocated, the program's own address for memory it registered.
    pub(crate) iova: u64,
    /// The data bytes (the region past its header).
    pub(crate) data: Span,
    /// The mapping with the region's header (and its state word) at offset 0: `data`'s
    /// region, or a page of its own for a region over shared memory.
    pub(crate) header: Arc<Region>,
}

/// A peer's region, granted through the transport.
pub(super) struct RemoteMr {
    pub(super) key: u32,
    pub(super) access: AccessFlags,
    /// The owner's address of the first byte (`remote_addr`s name bytes by it).
    pub(super) iova: u64,
    /// Granted bytes.
    pub(super) len: u64,
    pub(super) mem: Arc<dyn RemoteRegion>,
    /// Present where the transport maps the region here.
    pub(super) direct: Option<Direct>,
}

/// A peer's region mapped into this process (the shared-memory transport): the fast paths
/// reach it without an indirect call per check (see [`RemoteRegion::local`]).
pub(super) struct Direct {
    /// The region's granted bytes, exactly (`len` of the `RemoteMr`).
    pub(super) data: Span,
    pub(super) state: Word32,
}

impl std::fmt::Debug for RemoteMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteMr({:#x})", self.key)
    }
}

impl RemoteMr {
    pub(super) fn new(key: u32, mem: Arc<dyn RemoteRegion>) -> Self {
        // The direct span is exactly the granted bytes: the WRITE fast path lets its checked
        // copy stand for the range half of the access rule.
        let direct =
            mem.local()
                .filter(|(data, _)| data.len() == mem.len())
                .map(|(data, state)| Direct {
                    data: data.clone(),
                    state: state.clone(),
                });
        Self {
            key,
            access: AccessFlags::from_bits_retain(mem.access_bits()),
            iova: mem.iova(),
            len: mem.len(),
            mem,
            direct,
        }
    }

    #[inline(always)]
    pub(super) fn valid(&self) -> bool {
        match &self.direct {
            // SYNC POINT mr-state (acquire): the owner's deregistration, seen before each access.
            Some(d) => d.state.load(Ordering::Acquire) == MR_STATE_VALID,
            None => self.mem.valid(),
        }
    }
}

/// Where a copy lands: a span of this process (a ring record, a local region) or a peer's
/// region through the transport.
pub(super) trait Sink {
    fn put(&self, off: u64, b: Bytes<'_>, how: CopyKind) -> Result<(), MemError>;
}

impl Sink for Span {
    #[inline(always)]
    fn put(&self, off: u64, b: Bytes<'_>, how: CopyKind) -> Result<(), MemError> {
        b.copy_to(self, off, how == CopyKind::Ordered)
    }
}

impl Sink for dyn RemoteRegion {
    #[inline(always)]
    fn put(&self, off: u64, b: Bytes<'_>, how: CopyKind) -> Result<(), MemError> {
        match b {
            Bytes::Slice(d) => self.put_bytes(off, d, how),
            Bytes::Span(s, src_off, n) => RemoteRegion::put(self, off, s, src_off, n, how),
        }
    }
}

/// Bytes a message is copied from: caller memory (inline data) or a range of a region.
#[derive(Clone, Copy)]
pub(super) enum Bytes<'a> {
    Slice(&'a [u8]),
    /// `len` bytes at `off` of a span (validated against it).
    Span(&'a Span, u64, usize),
}

impl<'a> Bytes<'a> {
    pub(super) fn len(&self) -> usize {
        match self {
            Bytes::Slice(d) => d.len(),
            Bytes::Span(_, _, n) => *n,
        }
    }

    /// `n` bytes from offset `at` of these bytes.
    pub(super) fn part(&self, at: usize, n: usize) -> Bytes<'a> {
        match *self {
            Bytes::Slice(d) => Bytes::Slice(d.get(at..at + n).unwrap_or(&[])),
            Bytes::Span(s, off, _) => Bytes::Span(s, off + at as u64, n),
        }
    }

    /// Copies these bytes to `dst_off` of `dst`, the last 8 last if `ordered` (see
    /// [`Span::write_ordered`]). Errors only if a range is out of bounds, which the callers'
    /// validation rules out.
    #[inline(always)]
    pub(super) fn copy_to(&self, dst: &Span, dst_off: u64, ordered: bool) -> Result<(), MemError> {
        match (*self, ordered) {
            (Bytes::Slice(d), false) => dst.write(dst_off, d),
            (Bytes::Slice(d), true) => dst.write_ordered(dst_off, d),
            (Bytes::Span(s, off, n), false) => s.copy_to(off, dst, dst_off, n),
            (Bytes::Span(s, off, n), true) => s.copy_to_ordered(off, dst, dst_off, n),
        }
    }

    /// Copies these bytes into `dst` (as long as they are).
    pub(super) fn copy_into(&self, dst: &mut [u8]) -> Result<(), MemError> {
        let (n, size) = (self.len(), dst.len() as u64);
        let dst = dst.get_mut(..n).ok_or(MemError::OutOfBounds {
            off: 0,
            len: n as u64,
            size,
        })?;
        match *self {
            Bytes::Slice(d) => {
                dst.copy_from_slice(d);
                Ok(())
            }
            Bytes::Span(s, off, _) => s.read(off, dst),
        }
    }
}

/// The bytes an entry names in a local region of `pd` (for a receive or a READ/atomic result,
/// `write`: the region allows LOCAL_WRITE), or LOC_PROT_ERR.
#[inline(always)]
pub(super) fn resolve<'m>(
    mrs: &'m MrTable,
    pd: u32,
    sge: &Sge,
    write: bool,
) -> Result<Bytes<'m>, WcStatus> {
    let mr = mrs.get(sge.lkey).ok_or(WcStatus::LocProtErr)?;
    // Bytes are named by the region's addresses (`iova`, 0 for zero-based regions); an address
    // below the region wraps far past its end.
    let off = sge.addr.wrapping_sub(mr.iova);
    let end = off.checked_add(u64::from(sge.length));
    if mr.pd != pd
        || end.is_none_or(|e| e > mr.data.len())
        || (write && !mr.access.contains(AccessFlags::LOCAL_WRITE))
    {
        return Err(WcStatus::LocProtErr);
    }
    Ok(Bytes::Span(&mr.data, off, sge.length as usize))
}

pub(super) fn check_sges(
    mrs: &MrTable,
    pd: u32,
    sges: &[Sge],
    write: bool,
) -> Result<u64, WcStatus> {
    let mut total = 0u64;
    for s in sges {
        resolve(mrs, pd, s, write)?;
        total += u64::from(s.length);
    }
    Ok(total)
}

/// Where a message's bytes come from: inline data, one validated range, or a gather list.
#[derive(Clone, Copy)]
pub(super) enum Src<'a> {
    Inline(&'a [u8]),
    Sges(&'a [Sge]),
    /// One validated range (inline data, or a single-entry list resolved once).
    One(Bytes<'a>),
}

/// Validates a message's source; returns its length and the source to copy from (a
/// single-entry list comes back resolved).
pub(super) fn prepare<'a>(
    mrs: &'a MrTable,
    pd: u32,
    src: Src<'a>,
) -> Result<(u64, Src<'a>), WcStatus> {
    match src {
        Src::Inline(d) => Ok((d.len() as u64, Src::One(Bytes::Slice(d)))),
        Src::Sges([one]) => Ok((
            u64::from(one.length),
            Src::One(resolve(mrs, pd, one, false)?),
        )),
        Src::Sges(s) => Ok((check_sges(mrs, pd, s, false)?, src)),
        Src::One(b) => Ok((b.len() as u64, src)),
    }
}

/// Calls `f(at, bytes)` for the pieces of the `n` bytes at entry-list offset `off` of `sges`
/// (`at` counts from `off`), resolving each entry (`write`: LOCAL_WRITE needed); entries that
/// fail to resolve are skipped (callers validated the list beforehand).
pub(super) fn walk_sges<'m>(
    mrs: &'m MrTable,
    pd: u32,
    sges: &[Sge],
    mut off: u64,
    n: usize,
    write: bool,
    mut f: impl FnMut(usize, Bytes<'m>),
) {
    let mut done = 0usize;
    for s in sges {
        if done == n {
            break;
        }
        let l = u64::from(s.length);
        if off >= l {
            off -= l;
            continue;
        }
        let take = ((l - off) as usize).min(n - done);
        if let Ok(b) = resolve(mrs, pd, s, write) {
            f(done, b.part(off as usize, take));
        }
        done += take;
        off = 0;
    }
}

impl Src<'_> {
    /// Copies `n` bytes of the message from offset `off` to `dst_off` of `dst`; with `ordered`
    /// the message's last 8 bytes are stored last (see [`Span::write_ordered`]). Ranges were
    /// validated by [`prepare`]; a range that is not is skipped.
    pub(super) fn gather_to<D: Sink + ?Sized>(
        &self,
        mrs: &MrTable,
        pd: u32,
        off: u64,
        n: usize,
        dst: &D,
        dst_off: u64,
    ) {
        match self {
            Src::Inline(d) => {
                let _ = dst.put(
                    dst_off,
                    Bytes::Slice(d).part(off as usize, n),
                    CopyKind::Plain,
                );
            }
            Src::One(b) => {
                let _ = dst.put(dst_off, b.part(off as usize, n), CopyKind::Plain);
            }
            Src::Sges(sges) => walk_sges(mrs, pd, sges, off, n, false, |at, b| {
                let _ = dst.put(dst_off + at as u64, b, CopyKind::Plain);
            }),
        }
    }

    /// Copies the first `dst.len()` bytes of the message into `dst`.
    pub(super) fn gather_into(&self, mrs: &MrTable, pd: u32, dst: &mut [u8]) {
        match self {
            Src::Inline(d) => {
                let _ = Bytes::Slice(d).part(0, dst.len()).copy_into(dst);
            }
            Src::One(b) => {
                let _ = b.part(0, dst.len()).copy_into(dst);
            }
            Src::Sges(sges) => walk_sges(mrs, pd, sges, 0, dst.len(), false, |at, b| {
                let _ = b.copy_into(&mut dst[at..at + b.len()]);
            }),
        }
    }
}

/// Scatters `src` into the (validated, writable) entries at message offset `off`.
pub(super) fn scatter(mrs: &MrTable, pd: u32, sges: &[Sge], off: u64, src: Bytes<'_>) {
    walk_sges(mrs, pd, sges, off, src.len(), true, |at, b| {
        let Bytes::Span(dst, dst_off, n) = b else {
            return;
        };
        let _ = src.part(at, n).copy_to(dst, dst_off, false);
    });
}

/// RDMA WRITE's copy into a peer's region: the message's last 8 bytes stored after the rest,
/// so a peer polling the last byte sees the whole payload.
pub(super) fn ordered_write<D: Sink + ?Sized>(
    src: &Src<'_>,
    mrs: &MrTable,
    pd: u32,
    dst: &D,
    dst_off: u64,
    n: usize,
) {
    if let Src::One(b) = src {
        let _ = dst.put(dst_off, *b, CopyKind::Ordered);
        return;
    }
    if n <= 8 {
        src.gather_to(mrs, pd, 0, n, dst, dst_off);
        return;
    }
    let head = n - 8;
    src.gather_to(mrs, pd, 0, head, dst, dst_off);
    // SYNC POINT write-order (release): the body is visible before the last 8 bytes.
    fence(Ordering::Release);
    src.gather_to(mrs, pd, head as u64, 8, dst, dst_off + head as u64);
}
