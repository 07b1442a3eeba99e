//! The raw-DMA part of the C ABI (`include/backplane/dma.h`) over [`backplane::dma`].
//!
//! **Engines** (`DmaEngines`) are thread-safe: they live in a global registry like fabrics,
//! keyed by the address of their `Arc`, and any thread may start, use or stop them. Each
//! engine set counts the queues made with it, and refuses to stop (`EBUSY`) while any is
//! alive, so no queue ever feeds engines that are gone.
//!
//! **Queues** (`DmaQueue`) are `!Send` (they use their verbs context), so they live in the
//! verbs thread-local registry as one more object of their context (`VObj::DmaQueue`): the
//! same ownership rules (`EPERM` from another thread), the context cannot be closed under a
//! queue (`EBUSY`), and a thread's queues go away with it.
//!
//! **Return values**: unlike verbs.h, errors are `-errno` (errno and `bp_last_error()` set too),
//! because most of these functions return counts; constructors are NULL + errno.
//!
//! Every pointer and count from C is checked (NULL, alignment, range) before it is read; a
//! job's segments are copied into a buffer of the queue before anything else happens.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use backplane::dma::{
    DmaConfig, DmaEngines, DmaError, DmaQueue, DmaStatus, DmaWc, Job, Mem, Segment,
    DEFAULT_MAX_PIECE, MAX_SEGMENTS,
};

use crate::verbs::{get_ctx, local, ms, BpContext, Owned, VObj};
use crate::{bad_handle, guard, CErr};

// ---------------------------------------------------------------------------------------------
// C structs (mirrors of dma.h; layouts checked below and in tests/c/dma_errors.c).
// ---------------------------------------------------------------------------------------------

/// `struct bp_dma_config`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BpDmaConfig {
    /// Engine threads (0: 1).
    pub engines: u32,
    /// Entries in `pin`.
    pub npin: u32,
    /// CPUs to pin engines to.
    pub pin: *const u32,
    /// Submitter-copy threshold.
    pub inline_threshold: u64,
    /// Largest piece (0: default).
    pub max_piece: u64,
}

/// `struct bp_dma_seg`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct BpDmaSeg {
    /// Source node (0: local, by lkey).
    pub src_node: u32,
    /// Source lkey or rkey.
    pub src_key: u32,
    /// Source offset.
    pub src_off: u64,
    /// Destination node (0: local, by lkey).
    pub dst_node: u32,
    /// Destination lkey or rkey.
    pub dst_key: u32,
    /// Destination offset.
    pub dst_off: u64,
    /// Bytes.
    pub len: u64,
}

/// `struct bp_dma_job`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BpDmaJob {
    /// Returned in the completion.
    pub wr_id: u64,
    /// `num_segs` segments.
    pub segs: *const BpDmaSeg,
    /// Segments.
    pub num_segs: u32,
    /// `BP_DMA_FENCE | BP_DMA_CHAIN`.
    pub flags: u32,
}

/// `struct bp_dma_wc`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BpDmaWc {
    /// The job's id.
    pub wr_id: u64,
    /// Bytes copied.
    pub bytes: u64,
    /// `enum bp_dma_status`.
    pub status: u32,
    /// Segment to blame, -1 for none.
    pub segment: i32,
}

/// `struct bp_dma_engines` (opaque to C).
pub struct BpDmaEngines {
    engines: DmaEngines,
    /// Live queues made with these engines.
    queues: AtomicUsize,
}

/// `struct bp_dma_queue` (opaque to C; the allocation only gives the handle its address).
#[repr(C)]
pub struct BpDmaQueue {
    serial: u32,
}

const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<BpDmaConfig>() == 32 && align_of::<BpDmaConfig>() == 8);
    assert!(offset_of!(BpDmaConfig, inline_threshold) == 16);
    assert!(size_of::<BpDmaSeg>() == 40 && align_of::<BpDmaSeg>() == 8);
    assert!(offset_of!(BpDmaSeg, dst_node) == 16 && offset_of!(BpDmaSeg, len) == 32);
    assert!(size_of::<BpDmaJob>() == 24 && offset_of!(BpDmaJob, num_segs) == 16);
    assert!(size_of::<BpDmaWc>() == 24 && offset_of!(BpDmaWc, status) == 16);
    assert!(MAX_SEGMENTS == 1 << 20); // BP_DMA_MAX_SEGMENTS
    assert!(DEFAULT_MAX_PIECE == 8 << 20); // BP_DMA_DEFAULT_MAX_PIECE
    assert!(backplane::dma::DEFAULT_INLINE_THRESHOLD == 16 << 10);
};

/// `BP_DMA_FENCE`.
pub const BP_DMA_FENCE: u32 = 1;
/// `BP_DMA_CHAIN`.
pub const BP_DMA_CHAIN: u32 = 1 << 1;
/// `BP_DMA_MAX_DEPTH`.
pub const BP_DMA_MAX_DEPTH: c_int = 1 << 20;

/// The `enum bp_dma_status` value of `s` (the Rust declaration order).
pub fn status_c(s: DmaStatus) -> u32 {
    match s {
        DmaStatus::Success => 0,
        DmaStatus::Cancelled => 1,
        DmaStatus::InvalidRegion => 2,
        DmaStatus::NoGrant => 3,
        DmaStatus::OutOfBounds => 4,
        DmaStatus::AccessDenied => 5,
        DmaStatus::Overlap => 6,
        DmaStatus::NodeDown => 7,
        DmaStatus::RegionGone => 8,
    }
}

fn wc_out(w: &DmaWc) -> BpDmaWc {
    BpDmaWc {
        wr_id: w.id,
        bytes: w.bytes,
        status: status_c(w.status),
        segment: w
            .segment
            .map_or(-1, |s| i32::try_from(s).unwrap_or(i32::MAX)),
    }
}

fn mem(node: u32, key: u32) -> Mem {
    if node == 0 {
        Mem::Local { lkey: key }
    } else {
        Mem::Remote { node, rkey: key }
    }
}

fn seg_in(s: &BpDmaSeg) -> Segment {
    Segment {
        src: mem(s.src_node, s.src_key),
        src_off: s.src_off,
        dst: mem(s.dst_node, s.dst_key),
        dst_off: s.dst_off,
        len: s.len,
    }
}

// ---------------------------------------------------------------------------------------------
// Registries and guards.
// ---------------------------------------------------------------------------------------------

fn engines_reg() -> std::sync::MutexGuard<'static, HashMap<usize, Arc<BpDmaEngines>>> {
    static R: OnceLock<Mutex<HashMap<usize, Arc<BpDmaEngines>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A queue in the verbs registry. Dropping it drops the Rust queue (which cancels and waits
/// for its running pieces), then releases its engines.
pub(crate) struct DmaQueueObj {
    _c: Owned<BpDmaQueue>,
    q: Option<DmaQueue>,
    eng: Arc<BpDmaEngines>,
    /// The context handle.
    pub(crate) ctx: usize,
    /// `bp_dma_submit`'s conversion buffer, kept so a submit does not allocate.
    segs: RefCell<Vec<Segment>>,
}

impl DmaQueueObj {
    fn queue(&self) -> &DmaQueue {
        self.q.as_ref().expect("set until drop")
    }
}

impl Drop for DmaQueueObj {
    fn drop(&mut self) {
        drop(self.q.take());
        self.eng.queues.fetch_sub(1, Ordering::AcqRel);
    }
}

fn get_queue(l: &crate::verbs::Local, h: usize) -> Result<&DmaQueueObj, CErr> {
    match l.get(h, "DMA queue")? {
        VObj::DmaQueue(q) => Ok(q),
        _ => Err(bad_handle("DMA queue")),
    }
}

fn inval(m: impl Into<String>) -> CErr {
    CErr(libc::EINVAL, m.into())
}

impl From<DmaError> for CErr {
    fn from(e: DmaError) -> Self {
        let errno = match &e {
            DmaError::Full(_) => libc::ENOMEM,
            DmaError::Invalid(_) => libc::EINVAL,
            DmaError::Spawn(_) => libc::EAGAIN,
        };
        CErr(errno, e.to_string())
    }
}

/// This file's int convention: a count (or 0), or -errno (errno set as well).
fn guard_neg(f: impl FnOnce() -> Result<c_int, CErr>) -> c_int {
    let mut code = 0;
    let r = guard(-1, || f().inspect_err(|e| code = e.0));
    match r {
        r if r >= 0 => r,
        // A panic (guard set EIO) leaves `code` at 0.
        _ if code == 0 => -libc::EIO,
        _ => -code,
    }
}

/// Checks that `p` is non-null and aligned for `T`.
fn check_ptr<T>(p: *const T, what: &str) -> Result<(), CErr> {
    if p.is_null() {
        return Err(inval(format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(inval(format!(
            "{what} is not aligned to {} bytes",
            std::mem::align_of::<T>()
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Entry points.
// ---------------------------------------------------------------------------------------------

/// Reads a `struct bp_dma_config` (NULL: defaults).
///
/// # Safety
/// `cfg` is NULL or readable, and its `pin` holds `npin` entries.
unsafe fn config_in(cfg: *const BpDmaConfig) -> Result<DmaConfig, CErr> {
    if cfg.is_null() {
        return Ok(DmaConfig::default());
    }
    check_ptr(cfg, "cfg")?;
    // SAFETY: non-null and aligned (checked); the caller promises it is readable.
    let c = unsafe { cfg.read() };
    if c.engines > 64 {
        return Err(inval(format!("{} DMA engines: use 1..=64", c.engines)));
    }
    if c.npin > 4096 {
        return Err(inval(format!("npin {} is more than 4096 CPUs", c.npin)));
    }
    let pin = if c.npin == 0 {
        Vec::new()
    } else {
        check_ptr(c.pin, "cfg->pin")?;
        // SAFETY: non-null and aligned (checked), npin <= 4096 entries the caller promises.
        unsafe { std::slice::from_raw_parts(c.pin, c.npin as usize) }
            .iter()
            .map(|&p| p as usize)
            .collect()
    };
    Ok(DmaConfig {
        engines: (c.engines as usize).max(1),
        pin,
        inline_threshold: c.inline_threshold,
        max_piece: if c.max_piece == 0 {
            DEFAULT_MAX_PIECE
        } else {
            c.max_piece
        },
    })
}

/// `bp_dma_engines_start`.
///
/// # Safety
/// `cfg` is NULL or points to a readable `struct bp_dma_config` whose `pin` holds `npin`
/// entries.
#[no_mangle]
pub unsafe extern "C" fn bp_dma_engines_start(cfg: *const BpDmaConfig) -> *mut BpDmaEngines {
    guard(null_mut(), || {
        // SAFETY: forwarded from the caller's promise.
        let cfg = unsafe { config_in(cfg) }?;
        let e = Arc::new(BpDmaEngines {
            engines: DmaEngines::start(&cfg)?,
            queues: AtomicUsize::new(0),
        });
        let p = crate::new_handle::<BpDmaEngines>();
        engines_reg().insert(p as usize, e);
        Ok(p)
    })
}

/// `bp_dma_engines_stop`.
#[no_mangle]
pub extern "C" fn bp_dma_engines_stop(engines: *mut BpDmaEngines) -> c_int {
    guard_neg(|| {
        let e = {
            let mut r = engines_reg();
            let Some(e) = r.get(&(engines as usize)) else {
                return Err(bad_handle("DMA engine set"));
            };
            let n = e.queues.load(Ordering::Acquire);
            if n > 0 {
                return Err(CErr(
                    libc::EBUSY,
                    format!("{n} DMA queues still use these engines: destroy them first"),
                ));
            }
            r.remove(&(engines as usize)).expect("looked up")
        };
        // Joins the threads, outside the registry lock.
        drop(e);
        Ok(0)
    })
}

/// `bp_dma_queue_create`.
#[no_mangle]
pub extern "C" fn bp_dma_queue_create(
    context: *mut BpContext,
    engines: *mut BpDmaEngines,
    depth: c_int,
) -> *mut BpDmaQueue {
    guard(null_mut(), || {
        local(|l| {
            let ctx = get_ctx(l, context as usize)?.ctx.clone();
            if !(1..=BP_DMA_MAX_DEPTH).contains(&depth) {
                return Err(inval(format!("depth {depth}: use 1..={BP_DMA_MAX_DEPTH}")));
            }
            // Count the queue under the registry lock, so a racing stop sees it.
            let eng = {
                let r = engines_reg();
                let e = r
                    .get(&(engines as usize))
                    .ok_or_else(|| bad_handle("DMA engine set"))?
                    .clone();
                e.queues.fetch_add(1, Ordering::AcqRel);
                e
            };
            let q = DmaQueue::new(&ctx, &eng.engines, depth as usize);
            let c = Owned::new(BpDmaQueue { serial: l.serial() });
            let p = c.ptr();
            let obj = DmaQueueObj {
                _c: c,
                q: Some(q),
                eng,
                ctx: context as usize,
                segs: RefCell::new(Vec::new()),
            };
            l.insert(p as usize, VObj::DmaQueue(obj), 0);
            Ok(p)
        })
    })
}

/// `bp_dma_queue_destroy`.
#[no_mangle]
pub extern "C" fn bp_dma_queue_destroy(queue: *mut BpDmaQueue) -> c_int {
    guard_neg(|| {
        let obj = local(|l| {
            get_queue(l, queue as usize)?;
            l.remove(queue as usize, "(nothing)")
        })?;
        // Dropped outside the registry borrow: it may wait for running pieces.
        drop(obj);
        Ok(0)
    })
}

/// `bp_dma_submit`.
///
/// # Safety
/// `job` is NULL or points to a readable `struct bp_dma_job` whose `segs` holds `num_segs`
/// readable segments.
#[no_mangle]
pub unsafe extern "C" fn bp_dma_submit(queue: *mut BpDmaQueue, job: *const BpDmaJob) -> c_int {
    guard_neg(|| {
        local(|l| {
            let q = get_queue(l, queue as usize)?;
            check_ptr(job, "job")?;
            // SAFETY: non-null and aligned (checked); the caller promises it is readable.
            let j = unsafe { job.read() };
            if j.flags & !(BP_DMA_FENCE | BP_DMA_CHAIN) != 0 {
                return Err(inval(format!(
                    "job flags {:#x}: only BP_DMA_FENCE and BP_DMA_CHAIN exist",
                    j.flags
                )));
            }
            let n = j.num_segs as usize;
            if n == 0 || n > MAX_SEGMENTS {
                return Err(inval(format!(
                    "a job has 1..={MAX_SEGMENTS} segments, not {n}"
                )));
            }
            check_ptr(j.segs, "job->segs")?;
            // SAFETY: non-null and aligned (checked); n <= MAX_SEGMENTS, so n * 40 bytes does
            // not overflow isize; the caller promises `num_segs` readable segments. The slice
            // lives only in this call, while C cannot run.
            let segs = unsafe { std::slice::from_raw_parts(j.segs, n) };
            let mut buf = q.segs.borrow_mut();
            buf.clear();
            buf.extend(segs.iter().map(seg_in));
            let mut rj = Job::new(j.wr_id, &buf);
            if j.flags & BP_DMA_FENCE != 0 {
                rj = rj.fenced();
            }
            if j.flags & BP_DMA_CHAIN != 0 {
                rj = rj.chained();
            }
            q.queue().submit(&rj)?;
            Ok(0)
        })
    })
}

/// `bp_dma_cancel`.
#[no_mangle]
pub extern "C" fn bp_dma_cancel(queue: *mut BpDmaQueue, wr_id: u64) -> c_int {
    guard_neg(|| {
        local(|l| {
            let n = get_queue(l, queue as usize)?.queue().cancel(wr_id);
            Ok(c_int::try_from(n).unwrap_or(c_int::MAX))
        })
    })
}

/// `bp_dma_poll`.
///
/// # Safety
/// `wc` points to `n` writable `struct bp_dma_wc` (or `n` is 0).
#[no_mangle]
pub unsafe extern "C" fn bp_dma_poll(queue: *mut BpDmaQueue, n: c_int, wc: *mut BpDmaWc) -> c_int {
    guard_neg(|| {
        local(|l| {
            let q = get_queue(l, queue as usize)?;
            if n < 0 {
                return Err(inval(format!("n = {n} completions")));
            }
            if n == 0 {
                return Ok(0);
            }
            check_ptr(wc, "wc")?;
            let want = n as usize;
            let mut buf = [DmaWc::default(); 16];
            let mut got = 0usize;
            while got < want {
                let k = q.queue().poll(&mut buf[..(want - got).min(16)]);
                for (i, w) in buf[..k].iter().enumerate() {
                    // SAFETY: got + i < n, the caller promises n writable entries, and `wc`
                    // is non-null and aligned (checked).
                    unsafe { wc.add(got + i).write(wc_out(w)) };
                }
                got += k;
                if k < 16 {
                    break;
                }
            }
            Ok(got as c_int)
        })
    })
}

/// `bp_dma_wait`.
#[no_mangle]
pub extern "C" fn bp_dma_wait(queue: *mut BpDmaQueue, min: c_int, timeout_ms: c_int) -> c_int {
    guard_neg(|| {
        local(|l| {
            let q = get_queue(l, queue as usize)?;
            if min < 0 {
                return Err(inval(format!("min = {min} completions")));
            }
            let t = ms(timeout_ms)?;
            let n = q.queue().wait(min as usize, t);
            Ok(c_int::try_from(n).unwrap_or(c_int::MAX))
        })
    })
}

/// `bp_dma_outstanding`.
#[no_mangle]
pub extern "C" fn bp_dma_outstanding(queue: *mut BpDmaQueue) -> c_int {
    guard_neg(|| {
        local(|l| {
            let n = get_queue(l, queue as usize)?.queue().outstanding();
            Ok(c_int::try_from(n).unwrap_or(c_int::MAX))
        })
    })
}

/// `bp_dma_status_str`.
#[no_mangle]
pub extern "C" fn bp_dma_status_str(status: c_int) -> *const c_char {
    const S: [&CStr; 9] = [
        c"success",
        c"cancelled",
        c"invalid region",
        c"no grant",
        c"out of bounds",
        c"access denied",
        c"overlapping segments",
        c"node down",
        c"region deregistered",
    ];
    usize::try_from(status)
        .ok()
        .and_then(|i| S.get(i))
        .map_or(c"unknown".as_ptr(), |s| s.as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUSES: [DmaStatus; 9] = [
        DmaStatus::Success,
        DmaStatus::Cancelled,
        DmaStatus::InvalidRegion,
        DmaStatus::NoGrant,
        DmaStatus::OutOfBounds,
        DmaStatus::AccessDenied,
        DmaStatus::Overlap,
        DmaStatus::NodeDown,
        DmaStatus::RegionGone,
    ];

    fn errno() -> Option<c_int> {
        std::io::Error::last_os_error().raw_os_error()
    }

    #[test]
    fn status_numbers_and_strings_follow_the_rust_enum() {
        for (i, s) in STATUSES.iter().enumerate() {
            assert_eq!(status_c(*s), i as u32);
            // SAFETY: a static C string.
            let c = unsafe { CStr::from_ptr(bp_dma_status_str(i as c_int)) };
            assert_eq!(c.to_str().unwrap(), s.to_string());
        }
        // SAFETY: a static C string.
        let u = unsafe { CStr::from_ptr(bp_dma_status_str(9)) };
        assert_eq!(u.to_str().unwrap(), "unknown");
        // SAFETY: a static C string.
        let u = unsafe { CStr::from_ptr(bp_dma_status_str(-1)) };
        assert_eq!(u.to_str().unwrap(), "unknown");
    }

    #[test]
    fn completions_name_the_segment_or_minus_one() {
        let w = wc_out(&DmaWc {
            id: 7,
            status: DmaStatus::OutOfBounds,
            segment: Some(3),
            bytes: 0,
        });
        assert_eq!((w.wr_id, w.status, w.segment), (7, 4, 3));
        assert_eq!(wc_out(&DmaWc::default()).segment, -1);
    }

    #[test]
    fn segments_with_node_zero_are_local_lkeys() {
        let s = seg_in(&BpDmaSeg {
            src_node: 0,
            src_key: 5,
            src_off: 1,
            dst_node: 2,
            dst_key: 9,
            dst_off: 2,
            len: 3,
        });
        assert_eq!(s.src, Mem::Local { lkey: 5 });
        assert_eq!(s.dst, Mem::Remote { node: 2, rkey: 9 });
        assert_eq!((s.src_off, s.dst_off, s.len), (1, 2, 3));
    }

    #[test]
    fn null_and_made_up_dma_handles_are_minus_ebadf() {
        assert_eq!(bp_dma_engines_stop(null_mut()), -libc::EBADF);
        assert_eq!(errno(), Some(libc::EBADF));
        assert_eq!(bp_dma_engines_stop(0x1000 as *mut _), -libc::EBADF);
        assert_eq!(bp_dma_queue_destroy(null_mut()), -libc::EBADF);
        assert_eq!(bp_dma_cancel(0x2000 as *mut _, 1), -libc::EBADF);
        assert_eq!(bp_dma_wait(null_mut(), 1, 0), -libc::EBADF);
        assert_eq!(bp_dma_outstanding(null_mut()), -libc::EBADF);
        // SAFETY: the queue handle is rejected before `job` or `wc` is read.
        unsafe {
            assert_eq!(bp_dma_submit(null_mut(), std::ptr::null()), -libc::EBADF);
            assert_eq!(bp_dma_poll(null_mut(), 4, null_mut()), -libc::EBADF);
        }
        assert!(bp_dma_queue_create(null_mut(), null_mut(), 8).is_null());
        assert_eq!(errno(), Some(libc::EBADF));
    }

    #[test]
    fn engines_start_with_defaults_refuse_bad_configs_and_stop() {
        // SAFETY: NULL is the documented default.
        let e = unsafe { bp_dma_engines_start(std::ptr::null()) };
        assert!(!e.is_null());
        assert_eq!(bp_dma_engines_stop(e), 0);
        assert_eq!(bp_dma_engines_stop(e), -libc::EBADF, "stale");
        let bad = |c: BpDmaConfig| {
            // SAFETY: `c` is a valid config on the stack (pin checked by the callee).
            let e = unsafe { bp_dma_engines_start(&c) };
            (e.is_null(), errno())
        };
        let ok = BpDmaConfig {
            engines: 2,
            npin: 0,
            pin: std::ptr::null(),
            inline_threshold: 0,
            max_piece: 0,
        };
        assert_eq!(
            bad(BpDmaConfig { engines: 65, ..ok }),
            (true, Some(libc::EINVAL))
        );
        assert_eq!(
            bad(BpDmaConfig {
                max_piece: 4096,
                ..ok
            }),
            (true, Some(libc::EINVAL))
        );
        assert_eq!(
            bad(BpDmaConfig { npin: 1, ..ok }),
            (true, Some(libc::EINVAL))
        );
        let pins = [0u32];
        let c = BpDmaConfig {
            npin: 1,
            pin: pins.as_ptr(),
            ..ok
        };
        // SAFETY: `c.pin` holds `npin` entries.
        let e = unsafe { bp_dma_engines_start(&c) };
        assert!(!e.is_null());
        assert_eq!(bp_dma_engines_stop(e), 0);
        // A misaligned config pointer is refused before it is read.
        let raw = [0u64; 6];
        let mis = (raw.as_ptr() as usize + 4) as *const BpDmaConfig;
        // SAFETY: refused for its alignment before any read.
        assert!(unsafe { bp_dma_engines_start(mis) }.is_null());
        assert_eq!(errno(), Some(libc::EINVAL));
    }
}
