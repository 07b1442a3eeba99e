//! The verbs half of the C ABI (`include/backplane/verbs.h`): libibverbs' functions, structs
//! and numbers over [`backplane::verbs`].
//!
//! **Threads.** The Rust verbs objects are `!Send`: a context's engine sits in an `Rc` +
//! `RefCell` and takes no lock on the data path. So the objects live in a *thread-local*
//! registry of the thread that opened their context, and only that thread can reach them; a
//! small global table records which thread owns which handle, so that a call from another
//! thread is told so (`EPERM`) instead of getting a bare "bad handle". Nothing here needs an
//! `unsafe impl Send`: no verbs object ever leaves its thread. Objects still alive when the
//! thread exits are dropped by the thread-local's destructor, on that thread.
//!
//! **Handles** are pointers to `#[repr(C)]` structs the library allocates (C reads
//! `mr->addr`, `qp->qp_num`, ... as with libibverbs); they are used as keys and only
//! dereferenced through the registry's own pointer, after the lookup succeeded. A NULL,
//! destroyed or made-up handle is `EBADF`.
//!
//! **Return values** follow libibverbs: pointers are NULL + errno; most ints are 0 or the errno
//! value (errno is set too); `bp_close_device` and `bp_get_cq_event` are -1 + errno;
//! `bp_poll_cq` is a count or -1.
//!
//! **Rooms**: `types` (the C structs, layouts asserted), `registry` (the one thread-local
//! handle registry and the global owner table), `errors` (the one errno mapping and the entry
//! guards), `convert` (C ↔ Rust values), `device` (device, PD, MR), `cq` (completion channels
//! and CQs), `qp` (QPs and AHs), `connect` (the connection helper).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::os::fd::{AsFd, AsRawFd};
use std::ptr::{null_mut, NonNull};
use std::sync::{Mutex, OnceLock};
use std::thread::ThreadId;
use std::time::Duration;

use backplane::verbs::cm::{self, ConnParam, Listener, PeerInfo};
use backplane::verbs::{
    AccessFlags, Ah, AhAttr, CompChannel, Context, Cq, Mr, Mtu, Pd, Qp, QpAttr, QpAttrMask, QpCap,
    QpInitAttr, QpState, QpType, RecvWr, SendFlags, SendWr, Sge, Srq, SrqAttr, VerbsError, Wc,
    WrDetail, WrOpcode,
};

use crate::{bad_handle, fabric_errno, get_fabric, guard, BpFabric, CErr};

mod connect;
mod convert;
mod cq;
mod device;
mod errors;
mod qp;
mod registry;
mod types;

pub(crate) use convert::*;
pub(crate) use errors::*;
pub(crate) use qp::*;
pub(crate) use registry::*;
pub(crate) use types::*;

#[cfg(test)]
mod tests {
    use super::cq::*;
    use super::device::*;
    use super::*;
    use backplane::verbs::{WcOpcode, WcStatus};
    use std::ffi::CStr;

    fn errno() -> Option<c_int> {
        std::io::Error::last_os_error().raw_os_error()
    }

    #[test]
    fn null_and_made_up_verbs_handles_are_ebadf_and_set_errno() {
        assert_eq!(bp_dealloc_pd(null_mut()), libc::EBADF);
        assert_eq!(errno(), Some(libc::EBADF));
        assert_eq!(bp_close_device(0x1000 as *mut BpContext), -1);
        assert_eq!(errno(), Some(libc::EBADF));
        // SAFETY: a NULL handle is looked up, never dereferenced; `wc` is unused.
        assert_eq!(unsafe { bp_poll_cq(null_mut(), 1, null_mut()) }, -1);
        assert!(bp_alloc_pd(std::ptr::dangling_mut()).is_null());
        assert_eq!(errno(), Some(libc::EBADF));
        let mut bad = std::ptr::dangling_mut::<BpSendWr>();
        // SAFETY: the QP handle is rejected before the list is read.
        let rc = unsafe { bp_post_send(null_mut(), null_mut(), &mut bad) };
        assert_eq!(rc, libc::EBADF);
        assert!(bad.is_null());
    }

    #[test]
    fn a_handle_of_another_thread_is_eperm() {
        let key = 0x5000usize;
        let other = std::thread::spawn(|| std::thread::current().id())
            .join()
            .unwrap();
        owners().insert(
            key,
            Owner {
                thread: other,
                fabric: 0,
            },
        );
        assert_eq!(bp_dealloc_pd(key as *mut BpPd), libc::EPERM);
        // SAFETY: bp_last_error returns a valid string.
        let msg = unsafe { CStr::from_ptr(crate::bp_last_error()) }
            .to_string_lossy()
            .into_owned();
        assert!(msg.contains("another thread"), "{msg}");
        owners().remove(&key);
    }

    #[test]
    fn status_strings_are_libibverbs_texts() {
        let s = |i| {
            // SAFETY: a static C string.
            unsafe { CStr::from_ptr(bp_wc_status_str(i)) }
                .to_str()
                .unwrap()
        };
        assert_eq!(
            s(WcStatus::LocProtErr as c_int),
            WcStatus::LocProtErr.as_str()
        );
        assert_eq!(
            s(WcStatus::GeneralErr as c_int),
            WcStatus::GeneralErr.as_str()
        );
        assert_eq!(
            s(WcStatus::WrFlushErr as c_int),
            "Work Request Flushed Error"
        );
        assert_eq!(s(99), "unknown");
        assert_eq!(s(-1), "unknown");
    }

    #[test]
    fn wc_opcodes_keep_libibverbs_numbers() {
        assert_eq!(WcOpcode::RecvRdmaWithImm as u32, 129);
        let w = wc_out(&Wc {
            imm_data: 0x0102_0304,
            ..Wc::default()
        });
        assert_eq!(w.imm_data.to_ne_bytes(), [1, 2, 3, 4], "network order in C");
    }
}
