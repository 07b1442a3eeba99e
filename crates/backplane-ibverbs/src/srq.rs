//! Shared receive queues (`ibv_srq`): create, destroy, query, modify, and the inline
//! `ibv_post_srq_recv` through the context's ops.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

use backplane::verbs::{RecvWr, Srq, SrqAttr, VerbsError};

use crate::abi::*;
use crate::objects::{add_live, destroy, fail, fail_verbs, next_handle, obj, Kind, PdObj};
use crate::Ctx;

#[repr(C)]
pub(crate) struct SrqObj {
    pub(crate) ibv: IbvSrq,
    pub(crate) srq: Srq,
    pub(crate) ctx: *const Ctx,
}

/// `IBV_SRQ_MAX_WR`, `IBV_SRQ_LIMIT` (`ibv_modify_srq`'s mask).
const SRQ_MAX_WR: c_int = 1 << 0;
const SRQ_LIMIT: c_int = 1 << 1;

/// `ibv_create_srq`: the granted sizes are written back into `attr`, as providers do.
/// `srq_limit` must be 0 (the limit event is not offered).
///
/// # Safety
/// `init` is readable and writable.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_create_srq(
    pd: *mut IbvPd,
    init: *mut IbvSrqInitAttr,
) -> *mut IbvSrq {
    let call = "ibv_create_srq";
    let Some(p) = obj::<PdObj>(pd.cast(), Kind::Pd) else {
        fail(call, libc::EINVAL, "not a live PD");
        return null_mut();
    };
    if init.is_null() {
        fail(call, libc::EINVAL, "attr is NULL");
        return null_mut();
    }
    // SAFETY: non-null; the caller promises it is readable and writable.
    let a = unsafe { &mut *init };
    if a.attr.srq_limit != 0 {
        fail(
            call,
            libc::EINVAL,
            "srq_limit (the limit event) is not offered: create with srq_limit 0",
        );
        return null_mut();
    }
    // SAFETY: the context outlives its PDs.
    let _g = unsafe { &*p.ctx }.lock();
    let srq = match p.pd.create_srq(SrqAttr {
        max_wr: a.attr.max_wr,
        max_sge: a.attr.max_sge,
    }) {
        Ok(s) => s,
        Err(e) => {
            fail_verbs(call, &e);
            return null_mut();
        }
    };
    let s = Box::into_raw(Box::new(SrqObj {
        ibv: IbvSrq {
            context: p.ibv.context,
            srq_context: a.srq_context,
            pd,
            handle: next_handle(),
            mutex: libc::PTHREAD_MUTEX_INITIALIZER,
            cond: libc::PTHREAD_COND_INITIALIZER,
            events_completed: 0,
        },
        srq,
        ctx: p.ctx,
    }));
    add_live(s, Kind::Srq);
    s.cast()
}
crate::abi::symver!(bp_ibv_create_srq, "ibv_create_srq@@IBVERBS_1.1");

/// `ibv_destroy_srq`: `EBUSY` while a QP made with it exists, as libibverbs.
#[no_mangle]
pub extern "C" fn bp_ibv_destroy_srq(srq: *mut IbvSrq) -> c_int {
    let call = "ibv_destroy_srq";
    if let Some(s) = obj::<SrqObj>(srq.cast(), Kind::Srq) {
        let busy = {
            // SAFETY: the context outlives its SRQs.
            let _g = unsafe { &*s.ctx }.lock();
            s.srq.in_use()
        };
        if busy {
            return fail(call, libc::EBUSY, "QPs made with the SRQ still exist");
        }
    }
    destroy(srq.cast::<SrqObj>(), Kind::Srq, call)
}
crate::abi::symver!(bp_ibv_destroy_srq, "ibv_destroy_srq@@IBVERBS_1.1");

/// `ibv_query_srq`.
///
/// # Safety
/// `attr` is writable.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_query_srq(srq: *mut IbvSrq, attr: *mut IbvSrqAttr) -> c_int {
    let call = "ibv_query_srq";
    let Some(s) = obj::<SrqObj>(srq.cast(), Kind::Srq) else {
        return fail(call, libc::EINVAL, "not a live SRQ");
    };
    if attr.is_null() {
        return fail(call, libc::EINVAL, "attr is NULL");
    }
    let a = {
        // SAFETY: the context outlives its SRQs.
        let _g = unsafe { &*s.ctx }.lock();
        s.srq.query()
    };
    // SAFETY: non-null; the caller promises it is writable.
    unsafe {
        attr.write(IbvSrqAttr {
            max_wr: a.max_wr,
            max_sge: a.max_sge,
            srq_limit: 0,
        })
    };
    0
}
crate::abi::symver!(bp_ibv_query_srq, "ibv_query_srq@@IBVERBS_1.1");

/// `ibv_modify_srq`: resizing is not offered (`IBV_DEVICE_SRQ_RESIZE` is not in the device's
/// capabilities) and neither is the limit event: both `EINVAL`, but a limit of 0 (disarm),
/// which is what the SRQ already has.
///
/// # Safety
/// `attr` is readable.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_modify_srq(
    srq: *mut IbvSrq,
    attr: *mut IbvSrqAttr,
    mask: c_int,
) -> c_int {
    let call = "ibv_modify_srq";
    if obj::<SrqObj>(srq.cast(), Kind::Srq).is_none() {
        return fail(call, libc::EINVAL, "not a live SRQ");
    }
    if attr.is_null() {
        return fail(call, libc::EINVAL, "attr is NULL");
    }
    // SAFETY: non-null; the caller promises it is readable.
    let a = unsafe { &*attr };
    if mask & SRQ_MAX_WR != 0 {
        return fail(call, libc::EINVAL, "resizing an SRQ is not offered");
    }
    if mask & SRQ_LIMIT != 0 && a.srq_limit != 0 {
        return fail(call, libc::EINVAL, "the SRQ limit event is not offered");
    }
    if mask & !(SRQ_MAX_WR | SRQ_LIMIT) != 0 {
        return fail(
            call,
            libc::EINVAL,
            format!("unknown attribute mask {mask:#x}"),
        );
    }
    0
}
crate::abi::symver!(bp_ibv_modify_srq, "ibv_modify_srq@@IBVERBS_1.1");

/// `ops.post_srq_recv` (the header's inline `ibv_post_srq_recv`).
///
/// # Safety
/// `srq` is an SRQ this library made, alive; `wr` a NULL-terminated list of readable requests
/// whose `sg_list` hold `num_sge` entries; `bad_wr` writable.
pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut IbvSrq,
    wr: *mut IbvRecvWr,
    bad_wr: *mut *mut IbvRecvWr,
) -> c_int {
    // SAFETY: caller contract.
    let s = unsafe { &*srq.cast::<SrqObj>() };
    // SAFETY: the context outlives its SRQs.
    let _g = unsafe { &*s.ctx }.lock();
    // SAFETY: the caller's list, as `post_recv`'s.
    unsafe { crate::qp::post_recv_list(wr, bad_wr, |wrs: &[RecvWr<'_>]| s.srq.post_recv(wrs)) }
}

/// The SRQ behind a QP's `srq` pointer (NULL: none), checked.
pub(crate) fn srq_of<'a>(p: *mut c_void) -> Result<Option<&'a SrqObj>, VerbsError> {
    if p.is_null() {
        return Ok(None);
    }
    obj::<SrqObj>(p, Kind::Srq)
        .map(|s| Some(&*s))
        .ok_or_else(|| VerbsError::InvalidArgument("srq is not a live SRQ".into()))
}
