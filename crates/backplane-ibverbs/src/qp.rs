//! Queue pairs: create, modify (the connection: `dest_qp_num` + `ah_attr.dlid`, the peer's
//! LID being its node slot), query, destroy, and the two posting calls the header inlines.

use std::ffi::c_int;
use std::ptr::null_mut;

use backplane::verbs::{
    Mtu, OneSided, Qp, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, QpType, RecvWr, SendFlags,
    SendWr, Sge, VerbsError, WrDetail, WrOpcode,
};

use crate::abi::*;
use crate::objects::*;
use crate::Ctx;
use backplane::wire::verbs::QP_MIN_RING;

/// A QP as handed out: `struct ibv_qp`, then the rest of a `struct ibv_qp_ex` (used when the
/// QP was made with `send_ops_flags`: `ibv_qp_to_qp_ex`), then ours.
#[repr(C)]
pub(crate) struct QpObj {
    pub(crate) ibv: IbvQp,
    /// In a cell: the program writes `wr_id` and `wr_flags` through its pointer while other
    /// threads may hold references to the object.
    pub(crate) ex: std::cell::UnsafeCell<IbvQpExTail>,
    pub(crate) qp: Qp,
    pub(crate) ctx: *const Ctx,
    /// The `IBV_QP_EX_WITH_*` operations it was made for (0: a QP of `ibv_create_qp`).
    pub(crate) send_ops: u64,
    /// The `ibv_wr_*` batch being built (see `crate::wr`).
    pub(crate) batch: crate::wr::Region,
}

// `ibv_qp_to_qp_ex` hands out the object as a `struct ibv_qp_ex` (layout checked by build.rs).
const _: () = assert!(std::mem::offset_of!(QpObj, ibv) == 0);
const _: () = assert!(std::mem::offset_of!(QpObj, ex) == std::mem::offset_of!(IbvQpEx, tail));

fn qp_type_in(v: c_int) -> Option<QpType> {
    QpType::from_ibv(v as u32)
}

fn qp_state_in(v: c_int) -> Option<QpState> {
    QpState::from_ibv(v as u32)
}

fn mtu_in(v: c_int) -> Option<Mtu> {
    Mtu::from_ibv(v as u32)
}

fn cap_in(c: IbvQpCap) -> QpCap {
    QpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
    .zero_counts_default()
}

fn cap_out(c: QpCap) -> IbvQpCap {
    IbvQpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

/// The largest ring a QP gets when `BACKPLANE_VERBS_RING` is unset. A stream of large SENDs
/// needs a ring that holds a whole message: `ib_send_bw` 1 MiB measured 10–11 GB/s with
/// 512 KiB rings, 29–31 with 1 MiB, 33 with 2 MiB (alternating, same fabric, 64 MiB window).
const AUTO_RING_MAX: u32 = 2 << 20;

/// The ring a QP gets when `BACKPLANE_VERBS_RING` is unset, for a node window of `window`
/// bytes: a 64th of it (room for a program's dozens of QPs), as a power of two between the
/// smallest ring and [`AUTO_RING_MAX`] — 1 MiB in the default 64 MiB window, 512 KiB (the
/// fixed size before) in 32 MiB. When the window still cannot hold it, `ibv_create_qp` halves
/// it, and the process's later QPs start from the smaller size (saying so once).
fn auto_ring(window: u64) -> u32 {
    let share = (window / 64).clamp(u64::from(QP_MIN_RING), u64::from(AUTO_RING_MAX));
    let ring = 1u32 << (63 - share.leading_zeros());
    match SHORT_RING.load(std::sync::atomic::Ordering::Relaxed) {
        0 => ring,
        short => ring.min(short),
    }
}

/// The ring size a QP of this process last had to fall back to (0: none yet).
static SHORT_RING: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The inbound ring of each RC/UC QP: `BACKPLANE_VERBS_RING` (bytes, a power of two from
/// 256 KiB to 64 MiB, with K/M suffixes), else 0: [`auto_ring`]. Only SEND data travels
/// through it (RDMA WRITE/READ go straight to the peer's memory); a larger ring keeps more
/// SEND data in flight, at the cost of window space per QP.
fn ring_bytes() -> u32 {
    static RING: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *RING.get_or_init(|| {
        let Ok(v) = std::env::var("BACKPLANE_VERBS_RING") else {
            return 0;
        };
        let t = v.trim();
        let (num, mul) = match t.char_indices().last() {
            Some((i, 'K' | 'k')) => (&t[..i], 1 << 10),
            Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
            _ => (t, 1),
        };
        match num.parse::<u32>().ok().and_then(|n| n.checked_mul(mul)) {
            Some(n) => n,
            None => {
                eprintln!("libibverbs (backplane): BACKPLANE_VERBS_RING={v} is not a size; using the default");
                0
            }
        }
    })
}

/// The supervisor refused for want of window space.
fn window_full(e: &VerbsError) -> bool {
    use backplane::fabric::{ctl::ErrorKind, FabricError};
    matches!(
        e,
        VerbsError::Fabric(FabricError::Refused {
            kind: ErrorKind::NoSpace,
            ..
        })
    )
}

/// One line, the first time a QP of this process gets a ring smaller than `wanted`.
fn smaller_rings_once(bytes: u32, wanted: u32) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        eprintln!(
            "libibverbs (backplane): the node's window is short: a QP gets a {} KiB SEND ring \
             instead of {} KiB (slower large SENDs; a larger --window-size or \
             BACKPLANE_VERBS_RING sets it)",
            bytes / 1024,
            wanted / 1024
        );
    }
}

/// `ibv_create_qp`: RC, UC or UD, with its own receive queue or a shared one (`srq`).
///
/// # Safety
/// `attr` is readable and writable (the granted `cap` is written back).
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_create_qp(pd: *mut IbvPd, attr: *mut IbvQpInitAttr) -> *mut IbvQp {
    let call = "ibv_create_qp";
    if attr.is_null() {
        fail(call, libc::EINVAL, "attr is NULL");
        return null_mut();
    }
    // SAFETY: non-null; the caller promises it is readable and writable.
    create(call, pd, unsafe { &mut *attr }, 0)
}
crate::abi::symver!(bp_ibv_create_qp, "ibv_create_qp@@IBVERBS_1.1");

/// `verbs_context.create_qp_ex` (the header's inline `ibv_create_qp_ex` when `comp_mask` is
/// more than `IBV_QP_INIT_ATTR_PD`): a QP as `ibv_create_qp` makes it, with the `ibv_wr_*`
/// calls for the operations `send_ops_flags` names. XRC, creation flags, TSO, RSS and the
/// other extended attributes are refused (`EOPNOTSUPP`), as are operations the QP type cannot
/// carry (READ and atomics on UC, anything but SEND on UD) and memory windows, invalidation,
/// TSO and atomic writes.
///
/// # Safety
/// `attr` is NULL or readable and writable (the granted `cap` is written back).
pub(crate) unsafe extern "C" fn create_qp_ex(
    context: *mut IbvContext,
    attr: *mut IbvQpInitAttrEx,
) -> *mut IbvQp {
    use crate::abi::qp_ex_with as w;
    let call = "ibv_create_qp_ex";
    if attr.is_null() {
        fail(call, libc::EINVAL, "attr is NULL");
        return null_mut();
    }
    // SAFETY: non-null; the caller promises it is readable and writable.
    let a = unsafe { &mut *attr };
    let known = QP_INIT_ATTR_PD | QP_INIT_ATTR_SEND_OPS_FLAGS;
    if a.comp_mask & !known != 0 {
        fail(
            call,
            libc::EOPNOTSUPP,
            format!(
                "comp_mask {:#x}: only IBV_QP_INIT_ATTR_PD and IBV_QP_INIT_ATTR_SEND_OPS_FLAGS \
                 are offered (no XRC, creation flags, TSO or RSS)",
                a.comp_mask
            ),
        );
        return null_mut();
    }
    if a.comp_mask & QP_INIT_ATTR_PD == 0 {
        fail(call, libc::EINVAL, "comp_mask lacks IBV_QP_INIT_ATTR_PD");
        return null_mut();
    }
    let ops = if a.comp_mask & QP_INIT_ATTR_SEND_OPS_FLAGS != 0 {
        a.send_ops_flags
    } else {
        0
    };
    let ty = QpType::from_ibv(a.qp_type as u32);
    let offered = match ty {
        Some(QpType::Rc) => {
            w::RDMA_WRITE
                | w::RDMA_WRITE_WITH_IMM
                | w::SEND
                | w::SEND_WITH_IMM
                | w::RDMA_READ
                | w::ATOMIC_CMP_AND_SWP
                | w::ATOMIC_FETCH_AND_ADD
        }
        Some(QpType::Uc) => w::RDMA_WRITE | w::RDMA_WRITE_WITH_IMM | w::SEND | w::SEND_WITH_IMM,
        Some(QpType::Ud) => w::SEND | w::SEND_WITH_IMM,
        // `create` refuses the type with its own message.
        _ => u64::MAX,
    };
    if ops & !offered != 0 {
        fail(
            call,
            libc::EOPNOTSUPP,
            format!(
                "send_ops_flags {ops:#x}: {:#x} not offered on a{} QP (RC: WRITE, \
                 WRITE_WITH_IMM, SEND, SEND_WITH_IMM, READ, the two atomics; UC: the WRITEs and \
                 SENDs; UD: the SENDs; no memory windows, invalidation, TSO or atomic write)",
                ops & !offered,
                match ty {
                    Some(QpType::Rc) => "n RC",
                    Some(QpType::Uc) => " UC",
                    _ => " UD",
                }
            ),
        );
        return null_mut();
    }
    // The PD must be of this context (`create` refuses a PD that is not live).
    if let Some(p) = obj::<PdObj>(a.pd.cast(), Kind::Pd) {
        if p.ibv.context != context {
            fail(call, libc::EINVAL, "the PD belongs to another context");
            return null_mut();
        }
    }
    let mut legacy = IbvQpInitAttr {
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        cap: a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all,
    };
    let qp = create(call, a.pd, &mut legacy, ops);
    a.cap = legacy.cap;
    qp
}

/// Makes a QP of `pd` as `a` asks (the granted `cap` is written back into it); `send_ops`
/// non-zero gives it the `ibv_wr_*` table for those operations.
fn create(call: &str, pd: *mut IbvPd, a: &mut IbvQpInitAttr, send_ops: u64) -> *mut IbvQp {
    let Some(p) = obj::<PdObj>(pd.cast(), Kind::Pd) else {
        fail(call, libc::EINVAL, "not a live PD");
        return null_mut();
    };
    let srq = match crate::srq::srq_of(a.srq) {
        Ok(s) => s,
        Err(e) => {
            fail_verbs(call, &e);
            return null_mut();
        }
    };
    let Some(ty) = qp_type_in(a.qp_type) else {
        fail(
            call,
            libc::EOPNOTSUPP,
            format!("QP type {} is not offered (RC, UC and UD are)", a.qp_type),
        );
        return null_mut();
    };
    let (Some(scq), Some(rcq)) = (
        obj::<CqObj>(a.send_cq.cast(), Kind::Cq),
        obj::<CqObj>(a.recv_cq.cast(), Kind::Cq),
    ) else {
        fail(call, libc::EINVAL, "send_cq or recv_cq is not a live CQ");
        return null_mut();
    };
    if scq.ibv.context != p.ibv.context || rcq.ibv.context != p.ibv.context {
        fail(
            call,
            libc::EINVAL,
            "a CQ belongs to another context than the PD",
        );
        return null_mut();
    }
    // SAFETY: the context outlives its PDs.
    let _g = unsafe { &*p.ctx }.lock();
    let mut init = QpInitAttr {
        send_cq: &scq.cq,
        recv_cq: &rcq.cq,
        cap: cap_in(a.cap),
        qp_type: ty,
        sq_sig_all: a.sq_sig_all != 0,
        ring_bytes: ring_bytes(),
        srq: srq.map(|s| &s.srq),
    };
    let auto = init.ring_bytes == 0 && ty != QpType::Ud;
    if auto {
        // SAFETY: the context outlives its PDs.
        init.ring_bytes = auto_ring(unsafe { &*p.ctx }.fabric.window_size());
    }
    let wanted = init.ring_bytes;
    let qp = loop {
        match p.pd.create_qp(&init) {
            Ok(q) => break q,
            Err(e) if auto && window_full(&e) && init.ring_bytes > QP_MIN_RING => {
                init.ring_bytes /= 2;
                SHORT_RING.store(init.ring_bytes, std::sync::atomic::Ordering::Relaxed);
                smaller_rings_once(init.ring_bytes, wanted);
            }
            Err(e) => {
                fail_verbs(call, &e);
                return null_mut();
            }
        }
    };
    a.cap = cap_out(qp.query().cap);
    let q = Box::into_raw(Box::new(QpObj {
        ibv: IbvQp {
            context: p.ibv.context,
            qp_context: a.qp_context,
            pd,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            handle: next_handle(),
            qp_num: qp.qp_num(),
            state: QpState::Reset as c_int,
            qp_type: a.qp_type,
            mutex: libc::PTHREAD_MUTEX_INITIALIZER,
            cond: libc::PTHREAD_COND_INITIALIZER,
            events_completed: 0,
        },
        ex: std::cell::UnsafeCell::new(crate::wr::table(send_ops)),
        qp,
        ctx: p.ctx,
        send_ops,
        batch: crate::wr::Region::default(),
    }));
    add_live(q, Kind::Qp);
    q.cast()
}

/// `ibv_qp_to_qp_ex`: the QP as a `struct ibv_qp_ex` if it was made with `send_ops_flags`
/// (`ibv_create_qp_ex`), else NULL (as rdma-core answers for a QP without the extended API).
#[no_mangle]
pub extern "C" fn bp_ibv_qp_to_qp_ex(qp: *mut IbvQp) -> *mut IbvQpEx {
    match obj::<QpObj>(qp.cast(), Kind::Qp) {
        Some(q) if q.send_ops != 0 => qp.cast(),
        _ => null_mut(),
    }
}
crate::abi::symver!(bp_ibv_qp_to_qp_ex, "ibv_qp_to_qp_ex@@IBVERBS_1.6");

/// `ibv_destroy_qp`.
#[no_mangle]
pub extern "C" fn bp_ibv_destroy_qp(qp: *mut IbvQp) -> c_int {
    destroy(qp.cast::<QpObj>(), Kind::Qp, "ibv_destroy_qp")
}
crate::abi::symver!(bp_ibv_destroy_qp, "ibv_destroy_qp@@IBVERBS_1.1");

/// `IBV_QP_*` bits this library applies; the alternate path, path migration and rate limit
/// are refused.
const UNSUPPORTED_MASK: u32 = (1 << 14) | (1 << 18) | (1 << 25);

/// `ibv_modify_qp`: 0 or an errno. Reads only the fields the mask names (programs leave the
/// others uninitialized).
///
/// # Safety
/// `attr` is readable.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_modify_qp(
    qp: *mut IbvQp,
    attr: *mut IbvQpAttr,
    mask: c_int,
) -> c_int {
    let call = "ibv_modify_qp";
    let Some(q) = obj::<QpObj>(qp.cast(), Kind::Qp) else {
        return fail(call, libc::EINVAL, "not a live QP");
    };
    if attr.is_null() {
        return fail(call, libc::EINVAL, "attr is NULL");
    }
    let mask = mask as u32;
    if mask & UNSUPPORTED_MASK != 0 {
        return fail(
            call,
            libc::EOPNOTSUPP,
            format!("attribute mask {:#x}: alternate paths, path migration and rate limits are not offered", mask & UNSUPPORTED_MASK),
        );
    }
    let m = QpAttrMask::from_bits_truncate(mask);
    // SAFETY: non-null; the caller promises it is readable (the fields the mask names are
    // initialized; the others are read only as plain integers, never interpreted).
    let a = unsafe { attr.read() };
    let d = QpAttr::default();
    let pick = |bit: QpAttrMask| m.contains(bit);
    let state = |v: c_int, what: &str| {
        qp_state_in(v).ok_or_else(|| {
            VerbsError::InvalidArgument(format!("{what} {v} is not an IBV_QPS_* value"))
        })
    };
    let r = (|| -> Result<QpAttr, VerbsError> {
        Ok(QpAttr {
            qp_state: if pick(QpAttrMask::STATE) {
                state(a.qp_state, "qp_state")?
            } else {
                d.qp_state
            },
            cur_qp_state: if pick(QpAttrMask::CUR_STATE) {
                state(a.cur_qp_state, "cur_qp_state")?
            } else {
                d.cur_qp_state
            },
            path_mtu: if pick(QpAttrMask::PATH_MTU) {
                mtu_in(a.path_mtu).ok_or_else(|| {
                    VerbsError::InvalidArgument(format!(
                        "path_mtu {} is not an IBV_MTU_* value",
                        a.path_mtu
                    ))
                })?
            } else {
                d.path_mtu
            },
            qkey: if pick(QpAttrMask::QKEY) {
                a.qkey
            } else {
                d.qkey
            },
            rq_psn: if pick(QpAttrMask::RQ_PSN) {
                a.rq_psn
            } else {
                d.rq_psn
            },
            sq_psn: if pick(QpAttrMask::SQ_PSN) {
                a.sq_psn
            } else {
                d.sq_psn
            },
            dest_qp_num: if pick(QpAttrMask::DEST_QPN) {
                a.dest_qp_num
            } else {
                d.dest_qp_num
            },
            qp_access_flags: if pick(QpAttrMask::ACCESS_FLAGS) {
                backplane::verbs::AccessFlags::from_bits_retain(a.qp_access_flags & 0xe)
            } else {
                d.qp_access_flags
            },
            cap: if pick(QpAttrMask::CAP) {
                cap_in(a.cap)
            } else {
                d.cap
            },
            ah_attr: if pick(QpAttrMask::AV) {
                ah_in(&a.ah_attr)
            } else {
                d.ah_attr
            },
            pkey_index: if pick(QpAttrMask::PKEY_INDEX) {
                a.pkey_index
            } else {
                d.pkey_index
            },
            en_sqd_async_notify: if pick(QpAttrMask::EN_SQD_ASYNC_NOTIFY) {
                a.en_sqd_async_notify
            } else {
                d.en_sqd_async_notify
            },
            max_rd_atomic: if pick(QpAttrMask::MAX_QP_RD_ATOMIC) {
                a.max_rd_atomic
            } else {
                d.max_rd_atomic
            },
            max_dest_rd_atomic: if pick(QpAttrMask::MAX_DEST_RD_ATOMIC) {
                a.max_dest_rd_atomic
            } else {
                d.max_dest_rd_atomic
            },
            min_rnr_timer: if pick(QpAttrMask::MIN_RNR_TIMER) {
                a.min_rnr_timer
            } else {
                d.min_rnr_timer
            },
            port_num: if pick(QpAttrMask::PORT) {
                a.port_num
            } else {
                d.port_num
            },
            timeout: if pick(QpAttrMask::TIMEOUT) {
                a.timeout
            } else {
                d.timeout
            },
            retry_cnt: if pick(QpAttrMask::RETRY_CNT) {
                a.retry_cnt
            } else {
                d.retry_cnt
            },
            rnr_retry: if pick(QpAttrMask::RNR_RETRY) {
                a.rnr_retry
            } else {
                d.rnr_retry
            },
        })
    })();
    let r = match r {
        Ok(r) => r,
        Err(e) => return fail_verbs(call, &e),
    };
    // SAFETY: the context outlives its QPs.
    let _g = unsafe { &*q.ctx }.lock();
    let res = q.qp.modify(&r, m);
    q.ibv.state = q.qp.state() as c_int;
    match res {
        Ok(()) => 0,
        Err(e) => fail_verbs(call, &e),
    }
}
crate::abi::symver!(bp_ibv_modify_qp, "ibv_modify_qp@@IBVERBS_1.1");

/// `ibv_query_qp`: every attribute, whatever the mask.
///
/// # Safety
/// `attr` is writable; `init_attr` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_query_qp(
    qp: *mut IbvQp,
    attr: *mut IbvQpAttr,
    _mask: c_int,
    init_attr: *mut IbvQpInitAttr,
) -> c_int {
    let call = "ibv_query_qp";
    let Some(q) = obj::<QpObj>(qp.cast(), Kind::Qp) else {
        return fail(call, libc::EINVAL, "not a live QP");
    };
    if attr.is_null() {
        return fail(call, libc::EINVAL, "attr is NULL");
    }
    // SAFETY: the context outlives its QPs.
    let _g = unsafe { &*q.ctx }.lock();
    let a = q.qp.query();
    let ah = IbvAhAttr {
        dlid: a.ah_attr.dlid,
        sl: a.ah_attr.sl,
        src_path_bits: a.ah_attr.src_path_bits,
        static_rate: a.ah_attr.static_rate,
        is_global: u8::from(a.ah_attr.is_global),
        port_num: a.ah_attr.port_num,
        ..IbvAhAttr::default()
    };
    let out = IbvQpAttr {
        qp_state: a.qp_state as c_int,
        cur_qp_state: a.cur_qp_state as c_int,
        path_mtu: a.path_mtu as c_int,
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        qp_access_flags: a.qp_access_flags.bits(),
        cap: cap_out(a.cap),
        ah_attr: ah,
        pkey_index: a.pkey_index,
        en_sqd_async_notify: a.en_sqd_async_notify,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        ..IbvQpAttr::default()
    };
    // SAFETY: the caller promises `attr` is writable and `init_attr` NULL or writable.
    unsafe {
        attr.write(out);
        if !init_attr.is_null() {
            init_attr.write(IbvQpInitAttr {
                qp_context: q.ibv.qp_context,
                send_cq: q.ibv.send_cq,
                recv_cq: q.ibv.recv_cq,
                srq: q.ibv.srq,
                cap: cap_out(a.cap),
                qp_type: q.ibv.qp_type,
                sq_sig_all: 0,
            });
        }
    }
    q.ibv.state = a.qp_state as c_int;
    0
}
crate::abi::symver!(bp_ibv_query_qp, "ibv_query_qp@@IBVERBS_1.1");

// ---------------------------------------------------------------------------------------------
// Posting.
// ---------------------------------------------------------------------------------------------

/// Longest list one `ibv_post_send`/`ibv_post_recv` takes (a cycle in `next` ends there).
const MAX_LIST: usize = 1 << 16;

fn opcode_in(v: c_int) -> Option<WrOpcode> {
    WrOpcode::from_ibv(v as u32)
}

/// The program's scatter/gather list, in place (`struct ibv_sge` is [`Sge`]).
///
/// # Safety
/// `sg` holds `n` readable entries (when `n > 0`), left alone during the call.
unsafe fn sges<'a>(sg: *const IbvSge, n: c_int) -> &'a [Sge] {
    if n <= 0 || sg.is_null() {
        &[]
    } else {
        // SAFETY: caller contract.
        unsafe { std::slice::from_raw_parts(sg, n as usize) }
    }
}

/// One request of the program's list as the engine's, reading only what its opcode uses.
/// `inline` holds the gathered bytes of an inline request with several entries.
///
/// # Safety
/// `w` is a readable request whose `sg_list` holds `num_sge` readable entries, and, if
/// INLINE, whose entries name readable memory.
#[inline(always)]
unsafe fn send_in<'a>(
    w: &'a IbvSendWr,
    ud: bool,
    inline: &'a mut Vec<u8>,
) -> Result<SendWr<'a>, c_int> {
    let opcode = opcode_in(w.opcode).ok_or(libc::EINVAL)?;
    let flags = SendFlags::from_bits_truncate(w.send_flags);
    // SAFETY: caller contract.
    let list = unsafe { sges(w.sg_list, w.num_sge) };
    let (sg_list, inline_data): (&[Sge], &[u8]) = if flags.contains(SendFlags::INLINE) {
        match list {
            [] => (&[], &[]),
            // SAFETY: an inline request's entries name readable memory (caller), by address.
            [one] => (&[], unsafe {
                crate::wr::bytes(one.addr as usize as *const _, one.length as usize)
            }),
            many => {
                inline.clear();
                for s in many {
                    // SAFETY: as above.
                    // (An entry of length 0 may name NULL: UCX's header-only inline SENDs.)
                    inline.extend_from_slice(unsafe {
                        crate::wr::bytes(s.addr as usize as *const _, s.length as usize)
                    });
                }
                (&[], inline.as_slice())
            }
        }
    } else {
        (list, &[])
    };
    let detail = match opcode {
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm | WrOpcode::RdmaRead => {
            // SAFETY: the opcode says which member of the union the program filled.
            let r = unsafe { w.wr.rdma };
            WrDetail::Rdma {
                remote_addr: r.remote_addr,
                rkey: r.rkey,
            }
        }
        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
            // SAFETY: the opcode says which member of the union the program filled.
            let a = unsafe { w.wr.atomic };
            WrDetail::Atomic {
                remote_addr: a.remote_addr,
                compare_add: a.compare_add,
                swap: a.swap,
                rkey: a.rkey,
            }
        }
        WrOpcode::Send | WrOpcode::SendWithImm if ud => {
            // SAFETY: the opcode says which member of the union the program filled.
            let u = unsafe { w.wr.ud };
            let ah = obj::<AhObj>(u.ah.cast(), Kind::Ah).ok_or(libc::EINVAL)?;
            WrDetail::Ud {
                ah: &ah.ah,
                remote_qpn: u.remote_qpn,
                remote_qkey: u.remote_qkey,
            }
        }
        _ => WrDetail::None,
    };
    Ok(SendWr {
        wr_id: w.wr_id,
        sg_list,
        opcode,
        send_flags: flags,
        imm_data: match opcode {
            WrOpcode::RdmaWriteWithImm | WrOpcode::SendWithImm => u32::from_be(w.imm_data),
            _ => 0,
        },
        wr: detail,
        inline_data,
    })
}

/// `ops.post_send` (the header's inline `ibv_post_send`): 0, or an errno with `*bad_wr` the
/// first request not posted.
///
/// # Safety
/// `qp` is a QP this library made, alive; `wr` a NULL-terminated list of readable requests
/// (see `send_in`); `bad_wr` writable.
pub(crate) unsafe extern "C" fn post_send(
    qp: *mut IbvQp,
    wr: *mut IbvSendWr,
    bad_wr: *mut *mut IbvSendWr,
) -> c_int {
    // SAFETY: caller contract.
    let q = unsafe { &*qp.cast::<QpObj>() };
    if !wr.is_null() {
        // SAFETY: `wr` is readable (caller).
        let w = unsafe { &*wr };
        if w.next.is_null() {
            // One request, the common case (perftest posts one at a time): a short path of
            // its own, with the list's bookkeeping out of it (one READ through the drop-in
            // cost ~120 instructions above the engine's own post with it in).
            // SAFETY: caller contract.
            if let Some(r) = unsafe { one_sided(w) } {
                // A READ or an atomic of one range (`ib_read_lat`'s, `ib_atomic_lat`'s),
                // handed over without building the engine's whole request, and on the
                // engine's short way without room for an error: what that way does not take
                // (nothing done) goes the general way below.
                let done = {
                    // SAFETY: the context outlives its QPs.
                    let _g = unsafe { &*q.ctx }.lock();
                    q.qp.try_post_one_sided(&r)
                };
                if done {
                    if !bad_wr.is_null() {
                        // SAFETY: non-null; the caller promises it is writable.
                        unsafe { *bad_wr = null_mut() };
                    }
                    return 0;
                }
            }
            // SAFETY: caller contract.
            let rc = unsafe { post_one(q, w) };
            if !bad_wr.is_null() {
                // SAFETY: non-null; the caller promises it is writable.
                unsafe { *bad_wr = if rc == 0 { null_mut() } else { wr } };
            }
            return rc;
        }
    }
    // SAFETY: caller contract.
    unsafe { post_list(q, wr, bad_wr) }
}

/// One request (`next` is NULL) of `post_send` that the one-sided short way did not take: 0
/// or an errno. Out of line, so that its frame (the converted request, inline data, an
/// error) is not set up for every READ or atomic.
///
/// # Safety
/// As `post_send`'s, for `w`.
#[inline(never)]
unsafe fn post_one(q: &QpObj, w: &IbvSendWr) -> c_int {
    if w.opcode == WrOpcode::RdmaWrite as c_int {
        // The line the write will end in starts its trip before the lock and the
        // conversion, not after them (a peer polling it sees the data sooner).
        // SAFETY: the opcode says which member of the union the program filled.
        let r = unsafe { w.wr.rdma };
        q.qp.prefetch_write(r.remote_addr, r.rkey);
    }
    // SAFETY: caller contract.
    unsafe { post_one_general(q, w) }
}

/// [`post_one`] of a request the engine takes whole (a `SendWr`).
///
/// # Safety
/// As `post_send`'s, for `w`.
#[inline(always)]
unsafe fn post_one_general(q: &QpObj, w: &IbvSendWr) -> c_int {
    let ud = q.ibv.qp_type == QpType::Ud as c_int;
    // SAFETY: the context outlives its QPs.
    let _g = unsafe { &*q.ctx }.lock();
    let mut inline = Vec::new();
    // SAFETY: caller contract.
    match unsafe { send_in(w, ud, &mut inline) } {
        Ok(w) => match q.qp.post_send(std::slice::from_ref(&w)) {
            Ok(()) => 0,
            Err(e) => errno_of(&e),
        },
        Err(e) => e,
    }
}

/// `w` as a [`OneSided`] if it is an RDMA_READ or an atomic of exactly one range.
///
/// # Safety
/// `w.sg_list` holds `w.num_sge` readable entries (`ibv_post_send`'s contract).
#[inline(always)]
unsafe fn one_sided(w: &IbvSendWr) -> Option<OneSided<'_>> {
    const READ: c_int = WrOpcode::RdmaRead as c_int;
    const FETCH_ADD: c_int = WrOpcode::AtomicFetchAndAdd as c_int;
    const CMP_SWAP: c_int = WrOpcode::AtomicCmpAndSwp as c_int;
    let send_flags = SendFlags::from_bits_truncate(w.send_flags);
    // (INLINE makes the entry the data itself, as `send_in` reads it: the general way.)
    if w.num_sge != 1 || w.sg_list.is_null() || send_flags.contains(SendFlags::INLINE) {
        return None;
    }
    // SAFETY: the request's `sg_list` holds `num_sge` (1) readable entries (the caller's
    // contract with `ibv_post_send`), and `struct ibv_sge` is `Sge`.
    let local = unsafe { &*w.sg_list };
    Some(match w.opcode {
        READ => {
            // SAFETY: the opcode says which member of the union the program filled.
            let r = unsafe { w.wr.rdma };
            OneSided {
                wr_id: w.wr_id,
                opcode: WrOpcode::RdmaRead,
                send_flags,
                local,
                remote_addr: r.remote_addr,
                rkey: r.rkey,
                compare_add: 0,
                swap: 0,
            }
        }
        FETCH_ADD | CMP_SWAP => {
            // SAFETY: the opcode says which member of the union the program filled.
            let a = unsafe { w.wr.atomic };
            OneSided {
                wr_id: w.wr_id,
                opcode: if w.opcode == FETCH_ADD {
                    WrOpcode::AtomicFetchAndAdd
                } else {
                    WrOpcode::AtomicCmpAndSwp
                },
                send_flags,
                local,
                remote_addr: a.remote_addr,
                rkey: a.rkey,
                compare_add: a.compare_add,
                swap: a.swap,
            }
        }
        _ => return None,
    })
}

/// `post_send` of a list (or of NULL): 0, or an errno with `*bad_wr` the first request not
/// posted.
///
/// # Safety
/// As `post_send`'s.
#[cold]
#[inline(never)]
unsafe fn post_list(q: &QpObj, wr: *mut IbvSendWr, bad_wr: *mut *mut IbvSendWr) -> c_int {
    let ud = q.ibv.qp_type == QpType::Ud as c_int;
    // SAFETY: the context outlives its QPs.
    let _g = unsafe { &*q.ctx }.lock();
    let mut bad = wr;
    let rc = 'post: {
        if wr.is_null() {
            break 'post libc::EINVAL;
        }
        let mut ptrs = Vec::new();
        let mut p = wr;
        while !p.is_null() && ptrs.len() < MAX_LIST {
            ptrs.push(p);
            // SAFETY: every `next` is NULL or readable (caller).
            p = unsafe { (*p).next };
        }
        let mut bufs: Vec<Vec<u8>> = (0..ptrs.len()).map(|_| Vec::new()).collect();
        let mut wrs = Vec::with_capacity(ptrs.len());
        let mut conv_err = None;
        for (i, (&p, buf)) in ptrs.iter().zip(bufs.iter_mut()).enumerate() {
            // SAFETY: `p` is readable (caller).
            match unsafe { send_in(&*p, ud, buf) } {
                Ok(w) => wrs.push(w),
                Err(e) => {
                    conv_err = Some((i, e));
                    break;
                }
            }
        }
        let r = if wrs.is_empty() {
            Ok(())
        } else {
            q.qp.post_send(&wrs)
        };
        match (r, conv_err) {
            (Err(VerbsError::Post { bad_wr: i, source }), _) => {
                bad = ptrs[i.min(ptrs.len() - 1)];
                errno_of(&source)
            }
            (Err(e), _) => errno_of(&e),
            (Ok(()), Some((i, e))) => {
                bad = ptrs[i];
                e
            }
            (Ok(()), None) => {
                bad = null_mut();
                0
            }
        }
    };
    // `qp->state` is left as it is: libibverbs changes it in modify and query only.
    if !bad_wr.is_null() {
        // SAFETY: non-null; the caller promises it is writable.
        unsafe { *bad_wr = if rc == 0 { null_mut() } else { bad } };
    }
    rc
}

/// `ops.post_recv` (the header's inline `ibv_post_recv`).
///
/// # Safety
/// `qp` is a QP this library made, alive; `wr` a NULL-terminated list of readable requests
/// whose `sg_list` hold `num_sge` entries; `bad_wr` writable.
pub(crate) unsafe extern "C" fn post_recv(
    qp: *mut IbvQp,
    wr: *mut IbvRecvWr,
    bad_wr: *mut *mut IbvRecvWr,
) -> c_int {
    // SAFETY: caller contract.
    let q = unsafe { &*qp.cast::<QpObj>() };
    // SAFETY: the context outlives its QPs.
    let _g = unsafe { &*q.ctx }.lock();
    // SAFETY: caller contract.
    unsafe { post_recv_list(wr, bad_wr, |wrs: &[RecvWr<'_>]| q.qp.post_recv(wrs)) }
}

/// Posts the program's receive list through `post` (a QP's or an SRQ's): 0, or the errno
/// with `*bad_wr` at the first request not posted.
///
/// # Safety
/// `wr` is a NULL-terminated list of readable requests whose `sg_list` hold `num_sge`
/// entries; `bad_wr` is NULL or writable.
pub(crate) unsafe fn post_recv_list(
    wr: *mut IbvRecvWr,
    bad_wr: *mut *mut IbvRecvWr,
    post: impl Fn(&[RecvWr<'_>]) -> Result<(), VerbsError>,
) -> c_int {
    if !wr.is_null() {
        // SAFETY: `wr` is readable (caller).
        let w = unsafe { &*wr };
        if w.next.is_null() {
            // One request, the common case: nothing to collect.
            let one = RecvWr {
                wr_id: w.wr_id,
                // SAFETY: its list holds `num_sge` entries (caller).
                sg_list: unsafe { sges(w.sg_list, w.num_sge) },
            };
            let rc = match post(std::slice::from_ref(&one)) {
                Ok(()) => 0,
                Err(e) => errno_of(&e),
            };
            if !bad_wr.is_null() {
                // SAFETY: non-null; the caller promises it is writable.
                unsafe { *bad_wr = if rc == 0 { null_mut() } else { wr } };
            }
            return rc;
        }
    }
    let mut ptrs = Vec::new();
    let mut p = wr;
    while !p.is_null() && ptrs.len() < MAX_LIST {
        ptrs.push(p);
        // SAFETY: every `next` is NULL or readable (caller).
        p = unsafe { (*p).next };
    }
    let wrs: Vec<RecvWr<'_>> = ptrs
        .iter()
        .map(|&p| {
            // SAFETY: `p` is readable and its list holds `num_sge` entries (caller).
            let w = unsafe { &*p };
            RecvWr {
                wr_id: w.wr_id,
                // SAFETY: as above.
                sg_list: unsafe { sges(w.sg_list, w.num_sge) },
            }
        })
        .collect();
    let (rc, bad) = if wrs.is_empty() {
        (libc::EINVAL, wr)
    } else {
        match post(&wrs) {
            Ok(()) => (0, null_mut()),
            Err(VerbsError::Post { bad_wr: i, source }) => {
                (errno_of(&source), ptrs[i.min(ptrs.len() - 1)])
            }
            Err(e) => (errno_of(&e), wr),
        }
    };
    if !bad_wr.is_null() {
        // SAFETY: non-null; the caller promises it is writable.
        unsafe { *bad_wr = bad };
    }
    rc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_automatic_ring_is_a_64th_of_the_window_within_its_bounds() {
        assert_eq!(auto_ring(64 << 20), 1 << 20, "the default window");
        assert_eq!(auto_ring(1 << 30), AUTO_RING_MAX);
        assert_eq!(auto_ring(32 << 20), 512 << 10);
        assert_eq!(auto_ring(96 << 20), 1 << 20, "a power of two, rounded down");
        assert_eq!(auto_ring(8 << 20), QP_MIN_RING);
        assert_eq!(auto_ring(1 << 20), QP_MIN_RING);
    }
}
