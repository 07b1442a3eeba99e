//! CQs of `ibv_create_cq_ex` and the polling API the header inlines over them
//! (`ibv_start_poll`, `ibv_next_poll`, `ibv_end_poll`, `ibv_wc_read_*`; rdma-core's
//! `ibv_create_cq_ex(3)`). `ibv_start_poll` enters the CQ's polling region (one thread at a
//! time, as providers lock it), takes the next completion from the engine and makes it the
//! current one (its `status` and `wr_id` in the `struct ibv_cq_ex`, the rest read through
//! the `read_*` calls); `ibv_next_poll` takes the next; `ENOENT` when there is none
//! (`EOVERFLOW` when the CQ overran and is in error; `ibv_start_poll` then leaves the region
//! itself, as the man page says); `ibv_end_poll` leaves it. The CQ is an ordinary one too (`ibv_cq_ex_to_cq`: `ibv_poll_cq`, events,
//! `ibv_destroy_cq`).
//!
//! Completion timestamps: the fabric has no NIC clock; a completion's timestamp is the time
//! the library took it from the engine (`CLOCK_MONOTONIC` in ns: `hca_core_clock` 1 GHz,
//! `completion_timestamp_mask` all 64 bits), its wall-clock timestamp `CLOCK_REALTIME` then.
//! A software fabric makes a completion in the poll that finds it, so that is also about when
//! it was made.

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_uint, c_void};
use std::ptr::null;

use backplane::verbs::Wc;

use crate::abi::*;
use crate::objects::{create_cq, fail, CqObj};
use crate::turn::Turn;

/// A CQ's polling region and its current completion with its two timestamps.
#[derive(Default)]
pub(crate) struct Current {
    turn: Turn,
    /// Touched only by the thread inside `turn`.
    wc: UnsafeCell<(Wc, u64, u64)>,
}

// SAFETY: `wc` is reached only by the thread inside the region (`turn`), one at a time.
unsafe impl Sync for Current {}

/// `verbs_context.create_cq_ex` (the header's inline `ibv_create_cq_ex`): a CQ as
/// `ibv_create_cq` makes it, polled through the extended API too. `wc_flags` may ask for the
/// standard fields and the two timestamps; the VLAN, flow tag and tag-matching fields, a
/// parent domain and `IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN` are refused (`EOPNOTSUPP`).
///
/// # Safety
/// `attr` is NULL or readable.
pub(crate) unsafe extern "C" fn create_cq_ex(
    context: *mut IbvContext,
    attr: *const IbvCqInitAttrEx,
) -> *mut IbvCqEx {
    let call = "ibv_create_cq_ex";
    if attr.is_null() {
        fail(call, libc::EINVAL, "attr is NULL");
        return std::ptr::null_mut();
    }
    // SAFETY: non-null; the caller promises it is readable.
    let a = unsafe { &*attr };
    let flags_ok = wc_ex_with::STANDARD
        | wc_ex_with::COMPLETION_TIMESTAMP
        | wc_ex_with::COMPLETION_TIMESTAMP_WALLCLOCK;
    let refused = if a.wc_flags & !flags_ok != 0 {
        Some(format!(
            "wc_flags {:#x}: {:#x} not offered (the standard fields and the two timestamps are; \
             no VLAN, flow tag or tag matching)",
            a.wc_flags,
            a.wc_flags & !flags_ok
        ))
    } else if a.comp_mask & !CQ_INIT_ATTR_MASK_FLAGS != 0 {
        Some(format!(
            "comp_mask {:#x}: a parent domain is not offered",
            a.comp_mask
        ))
    } else if a.comp_mask & CQ_INIT_ATTR_MASK_FLAGS != 0
        && a.flags & !CREATE_CQ_ATTR_SINGLE_THREADED != 0
    {
        Some(format!(
            "flags {:#x}: only IBV_CREATE_CQ_ATTR_SINGLE_THREADED is offered",
            a.flags
        ))
    } else {
        None
    };
    if let Some(why) = refused {
        fail(call, libc::EOPNOTSUPP, why);
        return std::ptr::null_mut();
    }
    let (Ok(cqe), Ok(vector)) = (c_int::try_from(a.cqe), c_int::try_from(a.comp_vector)) else {
        fail(
            call,
            libc::EINVAL,
            format!("cqe {} or comp_vector {}", a.cqe, a.comp_vector),
        );
        return std::ptr::null_mut();
    };
    let ask = (cqe, a.cq_context, a.channel, vector);
    create_cq(call, context, ask, Some(a.wc_flags)).cast()
}

/// The CQ behind the program's `struct ibv_cq_ex`.
///
/// # Safety
/// `cq` is a CQ of [`create_cq_ex`], alive.
unsafe fn obj<'a>(cq: *mut IbvCqEx) -> &'a CqObj {
    // SAFETY: caller contract (the object starts with the `struct ibv_cq_ex`).
    unsafe { &*cq.cast::<CqObj>() }
}

/// Takes the next completion into the current one (the caller is inside the region): 0, or
/// `ENOENT` if there is none.
///
/// # Safety
/// As [`obj`].
unsafe fn take(cq: *mut IbvCqEx) -> c_int {
    // SAFETY: caller contract.
    let c = unsafe { obj(cq) };
    let mut got = None;
    {
        // SAFETY: the context outlives its CQs.
        let _g = unsafe { &*c.ctx }.lock();
        c.cq.poll_each(1, |_, w| got = Some(*w));
    }
    let Some(w) = got else {
        // An overrun CQ is in error (as `ibv_poll_cq` answers -1 then).
        return if c.overrun(cq) {
            libc::EOVERFLOW
        } else {
            libc::ENOENT
        };
    };
    // One reading per clock: seconds and nanoseconds of the same instant.
    let stamp = |clock| {
        let t = rustix::time::clock_gettime(clock);
        t.tv_sec
            .unsigned_abs()
            .saturating_mul(1_000_000_000)
            .saturating_add(t.tv_nsec.unsigned_abs())
    };
    let mono = stamp(rustix::time::ClockId::Monotonic);
    let wall = stamp(rustix::time::ClockId::Realtime);
    // SAFETY: inside the region (caller), so the current completion and the tail's fields
    // for it (cells, which the program only reads) are this thread's to write.
    unsafe {
        *c.current.wc.get() = (w, mono, wall);
        (*c.ex.get()).status = w.status as c_int;
        (*c.ex.get()).wr_id = w.wr_id;
    }
    0
}

unsafe extern "C" fn start_poll(cq: *mut IbvCqEx, attr: *const u32) -> c_int {
    // `struct ibv_poll_cq_attr` is one `comp_mask`, which must be 0.
    // SAFETY: the program's attributes, readable (the table's contract).
    if !attr.is_null() && unsafe { *attr } != 0 {
        return libc::EINVAL;
    }
    // SAFETY: the table's contract.
    let c = unsafe { obj(cq) };
    c.current.turn.enter();
    // SAFETY: inside the region.
    let rc = unsafe { take(cq) };
    if rc != 0 {
        // Nothing there: the poll ends now (no `ibv_end_poll` follows).
        c.current.turn.leave();
    }
    rc
}

unsafe extern "C" fn next_poll(cq: *mut IbvCqEx) -> c_int {
    // SAFETY: the table's contract.
    if !unsafe { obj(cq) }.current.turn.held() {
        return libc::EINVAL;
    }
    // SAFETY: inside the region.
    unsafe { take(cq) }
}

unsafe extern "C" fn end_poll(cq: *mut IbvCqEx) {
    // SAFETY: the table's contract.
    let c = unsafe { obj(cq) };
    if c.current.turn.held() {
        c.current.turn.leave();
    }
}

/// The current completion and its timestamps (zeros outside the region).
///
/// # Safety
/// As [`obj`].
unsafe fn cur(cq: *mut IbvCqEx) -> (Wc, u64, u64) {
    // SAFETY: the table's contract.
    let c = unsafe { obj(cq) };
    if !c.current.turn.held() {
        return Default::default();
    }
    // SAFETY: inside the region: the current completion is this thread's.
    unsafe { *c.current.wc.get() }
}

macro_rules! reader {
    ($name:ident -> $t:ty, |$w:ident, $mono:ident, $wall:ident| $e:expr) => {
        unsafe extern "C" fn $name(cq: *mut IbvCqEx) -> $t {
            // SAFETY: the table's contract.
            let ($w, $mono, $wall) = unsafe { cur(cq) };
            let _ = (&$w, $mono, $wall);
            $e
        }
    };
}

reader!(read_opcode -> c_int, |w, m, r| w.opcode as c_int);
reader!(read_vendor_err -> u32, |w, m, r| w.vendor_err);
reader!(read_byte_len -> u32, |w, m, r| w.byte_len);
reader!(read_imm_data -> u32, |w, m, r| w.imm_data.to_be());
reader!(read_qp_num -> u32, |w, m, r| w.qp_num);
reader!(read_src_qp -> u32, |w, m, r| w.src_qp);
reader!(read_wc_flags -> c_uint, |w, m, r| w.wc_flags.bits() as c_uint);
reader!(read_slid -> u32, |w, m, r| u32::from(w.slid));
reader!(read_sl -> u8, |w, m, r| w.sl);
reader!(read_dlid_path_bits -> u8, |w, m, r| w.dlid_path_bits);
reader!(read_completion_ts -> u64, |w, m, r| m);
reader!(read_completion_wallclock_ns -> u64, |w, m, r| r);

/// The `struct ibv_cq_ex` tail of a CQ: with `wc_flags` (a CQ of `ibv_create_cq_ex`) the
/// polling table — every reader set, whatever the flags (a reader of a field not asked for
/// reads the completion anyway, never a null pointer) but the refused VLAN, flow tag and
/// tag-matching ones; without, every slot null.
pub(crate) fn table(wc_flags: Option<u64>) -> IbvCqExTail {
    let f = |p: *const c_void| if wc_flags.is_some() { p } else { null() };
    IbvCqExTail {
        comp_mask: 0,
        status: 0,
        wr_id: 0,
        start_poll: f(start_poll as *const c_void),
        next_poll: f(next_poll as *const c_void),
        end_poll: f(end_poll as *const c_void),
        read_opcode: f(read_opcode as *const c_void),
        read_vendor_err: f(read_vendor_err as *const c_void),
        read_byte_len: f(read_byte_len as *const c_void),
        read_imm_data: f(read_imm_data as *const c_void),
        read_qp_num: f(read_qp_num as *const c_void),
        read_src_qp: f(read_src_qp as *const c_void),
        read_wc_flags: f(read_wc_flags as *const c_void),
        read_slid: f(read_slid as *const c_void),
        read_sl: f(read_sl as *const c_void),
        read_dlid_path_bits: f(read_dlid_path_bits as *const c_void),
        read_completion_ts: f(read_completion_ts as *const c_void),
        read_cvlan: null(),
        read_flow_tag: null(),
        read_tm_info: null(),
        read_completion_wallclock_ns: f(read_completion_wallclock_ns as *const c_void),
    }
}
