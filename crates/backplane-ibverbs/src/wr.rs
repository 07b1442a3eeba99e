//! The extended post API (`ibv_wr_*`, rdma-core's `struct ibv_qp_ex`): a QP made with
//! `ibv_create_qp_ex(… IBV_QP_INIT_ATTR_SEND_OPS_FLAGS …)` carries a table of builders that
//! the header's inline `ibv_wr_*` calls jump through. Between `ibv_wr_start` and
//! `ibv_wr_complete` / `ibv_wr_abort` (a critical region per QP, one thread at a time, as
//! providers lock it) each builder starts a request with the `wr_id` and `wr_flags` the
//! program set in the `struct ibv_qp_ex`, the setters give the last one its data (a gather
//! list, or inline bytes: the setter used decides, not `IBV_SEND_INLINE` in `wr_flags`, as
//! on mlx5) and, on UD, its address; `ibv_wr_complete` posts the batch through
//! the engine as `ibv_post_send` posts a list. The builders return nothing: an error (a setter
//! before any builder, an operation the QP was not made for, one not offered) is kept and
//! `ibv_wr_complete` answers it — `EINVAL`, or `EOPNOTSUPP` — posting nothing. A batch the
//! engine refuses part-way (a full send queue: `ENOMEM`) has the requests before the refused
//! one posted, as `ibv_post_send` with a list does.

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};

use backplane::verbs::{SendFlags, SendWr, Sge, WrDetail, WrOpcode};

use crate::abi::{qp_ex_with as with, *};
use crate::objects::{errno_of, obj, AhObj, Kind};
use crate::qp::QpObj;
use crate::turn::Turn;

/// One request being built.
struct Pending {
    wr_id: u64,
    opcode: WrOpcode,
    flags: SendFlags,
    imm: u32,
    /// The remote part (never `Ud`: that is `ud`, checked at `ibv_wr_complete`).
    detail: WrDetail<'static>,
    sges: Vec<Sge>,
    inline: Vec<u8>,
    /// The UD address (`ibv_wr_set_ud_addr`): the AH as the program gave it, checked at
    /// `ibv_wr_complete`.
    ud: Option<(*mut c_void, u32, u32)>,
}

#[derive(Default)]
struct Batch {
    wrs: Vec<Pending>,
    /// The first error a builder or setter met (0: none).
    err: c_int,
}

impl Batch {
    /// Keeps `e` unless an error was met already.
    fn fail(&mut self, e: c_int) {
        if self.err == 0 {
            self.err = e;
        }
    }

    /// Empty again (a new region, or the end of one).
    fn reset(&mut self) {
        self.wrs.clear();
        self.err = 0;
    }
}

/// A QP's critical region and the batch built in it.
#[derive(Default)]
pub(crate) struct Region {
    turn: Turn,
    /// Touched only by the thread inside `turn`.
    batch: UnsafeCell<Batch>,
}

// SAFETY: `batch` is reached only by the thread inside the region (`turn`), one at a time.
unsafe impl Sync for Region {}

/// The QP and its batch, if the calling thread is inside the QP's region.
///
/// # Safety
/// `qpx` is a `struct ibv_qp_ex` this library handed out (`ibv_qp_to_qp_ex`), alive.
unsafe fn held<'a>(qpx: *mut IbvQpEx) -> Option<(&'a QpObj, &'a mut Batch)> {
    // SAFETY: caller contract: the pointer is a live `QpObj` (its first fields are the
    // `struct ibv_qp_ex`).
    let q = unsafe { &*qpx.cast::<QpObj>() };
    if !q.batch.turn.held() {
        return None;
    }
    // SAFETY: this thread is inside the region, so nobody else touches the batch.
    Some((q, unsafe { &mut *q.batch.batch.get() }))
}

/// Starts a request of kind `opcode` (an `IBV_QP_EX_WITH_*` bit `with`) with the program's
/// `wr_id` and `wr_flags`.
///
/// # Safety
/// As [`held`].
unsafe fn build(
    qpx: *mut IbvQpEx,
    opcode: WrOpcode,
    with: u64,
    imm: u32,
    detail: WrDetail<'static>,
) {
    // SAFETY: caller contract.
    let Some((q, b)) = (unsafe { held(qpx) }) else {
        return;
    };
    if q.send_ops & with == 0 {
        // Not among the operations the QP was made for (mlx5 refuses them the same way).
        b.fail(libc::EINVAL);
        return;
    }
    // SAFETY: the QP's `struct ibv_qp_ex` tail (a cell), alive; the program set these before
    // the call.
    let (wr_id, flags) = unsafe { ((*q.ex.get()).wr_id, (*q.ex.get()).wr_flags) };
    b.wrs.push(Pending {
        wr_id,
        opcode,
        flags: SendFlags::from_bits_truncate(flags),
        imm,
        detail,
        sges: Vec::new(),
        inline: Vec::new(),
        ud: None,
    });
}

/// Applies `f` to the last request of the batch (a setter), or keeps `EINVAL` if there is none.
///
/// # Safety
/// As [`held`].
unsafe fn last(qpx: *mut IbvQpEx, f: impl FnOnce(&mut Pending)) {
    // SAFETY: caller contract.
    let Some((_, b)) = (unsafe { held(qpx) }) else {
        return;
    };
    match b.wrs.last_mut() {
        Some(w) => f(w),
        None => b.fail(libc::EINVAL),
    }
}

/// Keeps `EOPNOTSUPP` for a builder this library does not offer.
///
/// # Safety
/// As [`held`].
unsafe fn not_offered(qpx: *mut IbvQpEx) {
    // SAFETY: caller contract.
    if let Some((_, b)) = unsafe { held(qpx) } {
        b.fail(libc::EOPNOTSUPP);
    }
}

// The table's entries. Each: # Safety — `qp` is a `struct ibv_qp_ex` this library handed out,
// alive (the header's inline wrappers pass the program's pointer), and the pointers it passes
// name what the man page says (readable lists and bytes).

unsafe extern "C" fn wr_start(qp: *mut IbvQpEx) {
    // SAFETY: a live `QpObj` (the table's contract).
    let q = unsafe { &*qp.cast::<QpObj>() };
    if q.batch.turn.enter() {
        // SAFETY: the region is ours now.
        unsafe { &mut *q.batch.batch.get() }.reset();
    }
}

unsafe extern "C" fn wr_abort(qp: *mut IbvQpEx) {
    // SAFETY: the table's contract.
    if let Some((q, b)) = unsafe { held(qp) } {
        b.reset();
        q.batch.turn.leave();
    }
}

unsafe extern "C" fn wr_complete(qp: *mut IbvQpEx) -> c_int {
    // SAFETY: the table's contract.
    let Some((q, b)) = (unsafe { held(qp) }) else {
        // Not inside the region (no `ibv_wr_start`, or another thread's).
        return libc::EINVAL;
    };
    let rc = if b.err != 0 { b.err } else { post(q, &b.wrs) };
    b.reset();
    q.batch.turn.leave();
    rc
}

/// Posts the batch: 0 or an errno.
fn post(q: &QpObj, wrs: &[Pending]) -> c_int {
    let ud = q.ibv.qp_type == backplane::verbs::QpType::Ud as c_int;
    let mut out = Vec::with_capacity(wrs.len());
    for w in wrs {
        let inline = w.flags.contains(SendFlags::INLINE);
        let wr = match w.ud {
            Some((ah, remote_qpn, remote_qkey)) if ud => {
                let Some(a) = obj::<AhObj>(ah, Kind::Ah) else {
                    return libc::EINVAL;
                };
                WrDetail::Ud {
                    ah: &a.ah,
                    remote_qpn,
                    remote_qkey,
                }
            }
            // A UD request needs its address.
            _ if ud => return libc::EINVAL,
            _ => w.detail,
        };
        out.push(SendWr {
            wr_id: w.wr_id,
            sg_list: if inline { &[] } else { &w.sges },
            opcode: w.opcode,
            send_flags: w.flags,
            imm_data: w.imm,
            wr,
            inline_data: if inline { &w.inline } else { &[] },
        });
    }
    // SAFETY: the context outlives its QPs.
    let _g = unsafe { &*q.ctx }.lock();
    match q.qp.post_send(&out) {
        Ok(()) => 0,
        Err(e) => errno_of(&e),
    }
}

unsafe extern "C" fn wr_send(qp: *mut IbvQpEx) {
    // SAFETY: the table's contract.
    unsafe { build(qp, WrOpcode::Send, with::SEND, 0, WrDetail::None) }
}

unsafe extern "C" fn wr_send_imm(qp: *mut IbvQpEx, imm_be: u32) {
    let imm = u32::from_be(imm_be);
    // SAFETY: the table's contract.
    unsafe {
        build(
            qp,
            WrOpcode::SendWithImm,
            with::SEND_WITH_IMM,
            imm,
            WrDetail::None,
        )
    }
}

unsafe extern "C" fn wr_rdma_write(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64) {
    let d = WrDetail::Rdma { remote_addr, rkey };
    // SAFETY: the table's contract.
    unsafe { build(qp, WrOpcode::RdmaWrite, with::RDMA_WRITE, 0, d) }
}

unsafe extern "C" fn wr_rdma_write_imm(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64, imm_be: u32) {
    let d = WrDetail::Rdma { remote_addr, rkey };
    let (op, w) = (WrOpcode::RdmaWriteWithImm, with::RDMA_WRITE_WITH_IMM);
    // SAFETY: the table's contract.
    unsafe { build(qp, op, w, u32::from_be(imm_be), d) }
}

unsafe extern "C" fn wr_rdma_read(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64) {
    let d = WrDetail::Rdma { remote_addr, rkey };
    // SAFETY: the table's contract.
    unsafe { build(qp, WrOpcode::RdmaRead, with::RDMA_READ, 0, d) }
}

unsafe extern "C" fn wr_atomic_fetch_add(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64, add: u64) {
    let d = WrDetail::Atomic {
        remote_addr,
        rkey,
        compare_add: add,
        swap: 0,
    };
    let (op, w) = (WrOpcode::AtomicFetchAndAdd, with::ATOMIC_FETCH_AND_ADD);
    // SAFETY: the table's contract.
    unsafe { build(qp, op, w, 0, d) }
}

unsafe extern "C" fn wr_atomic_cmp_swp(
    qp: *mut IbvQpEx,
    rkey: u32,
    remote_addr: u64,
    compare: u64,
    swap: u64,
) {
    let d = WrDetail::Atomic {
        remote_addr,
        rkey,
        compare_add: compare,
        swap,
    };
    let (op, w) = (WrOpcode::AtomicCmpAndSwp, with::ATOMIC_CMP_AND_SWP);
    // SAFETY: the table's contract.
    unsafe { build(qp, op, w, 0, d) }
}

unsafe extern "C" fn wr_set_sge(qp: *mut IbvQpEx, lkey: u32, addr: u64, length: u32) {
    // SAFETY: the table's contract.
    unsafe {
        last(qp, |w| {
            w.sges.clear();
            w.flags.remove(SendFlags::INLINE);
            w.sges.push(Sge { addr, length, lkey });
        })
    }
}

unsafe extern "C" fn wr_set_sge_list(qp: *mut IbvQpEx, n: usize, list: *const IbvSge) {
    let sges: &[Sge] = if n == 0 || list.is_null() {
        &[]
    } else {
        // SAFETY: the program passes `n` readable entries (the table's contract).
        unsafe { std::slice::from_raw_parts(list, n) }
    };
    // SAFETY: the table's contract.
    unsafe {
        last(qp, |w| {
            w.sges.clear();
            w.flags.remove(SendFlags::INLINE);
            w.sges.extend_from_slice(sges);
        })
    }
}

/// The bytes of an inline setter or of an inline request's entry (`len` 0 may come with any
/// address, NULL too: no slice is made of it).
///
/// # Safety
/// `addr` names `len` readable bytes when `len > 0`.
pub(crate) unsafe fn bytes<'a>(addr: *const c_void, len: usize) -> &'a [u8] {
    if len == 0 || addr.is_null() {
        &[]
    } else {
        // SAFETY: caller contract.
        unsafe { std::slice::from_raw_parts(addr.cast(), len) }
    }
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut IbvQpEx, addr: *mut c_void, len: usize) {
    // SAFETY: the program's bytes (the table's contract).
    let data = unsafe { bytes(addr, len) };
    // SAFETY: the table's contract.
    unsafe {
        last(qp, |w| {
            w.inline.clear();
            w.inline.extend_from_slice(data);
            w.flags |= SendFlags::INLINE;
        })
    }
}

unsafe extern "C" fn wr_set_inline_data_list(qp: *mut IbvQpEx, n: usize, list: *const IbvDataBuf) {
    let bufs: &[IbvDataBuf] = if n == 0 || list.is_null() {
        &[]
    } else {
        // SAFETY: the program passes `n` readable entries (the table's contract).
        unsafe { std::slice::from_raw_parts(list, n) }
    };
    // SAFETY: each entry names readable bytes (the table's contract).
    let parts: Vec<&[u8]> = bufs
        .iter()
        .map(|b| unsafe { bytes(b.addr, b.length) })
        .collect();
    // SAFETY: the table's contract.
    unsafe {
        last(qp, |w| {
            w.inline.clear();
            parts.iter().for_each(|p| w.inline.extend_from_slice(p));
            w.flags |= SendFlags::INLINE;
        })
    }
}

unsafe extern "C" fn wr_set_ud_addr(qp: *mut IbvQpEx, ah: *mut IbvAh, qpn: u32, qkey: u32) {
    // SAFETY: the table's contract.
    unsafe { last(qp, |w| w.ud = Some((ah.cast(), qpn, qkey))) }
}

unsafe extern "C" fn wr_unoffered_1(qp: *mut IbvQpEx, _: usize) {
    // SAFETY: the table's contract.
    unsafe { not_offered(qp) }
}

unsafe extern "C" fn wr_unoffered_4(qp: *mut IbvQpEx, _: usize, _: usize, _: usize) {
    // SAFETY: the table's contract.
    unsafe { not_offered(qp) }
}

/// The `struct ibv_qp_ex` tail of a QP made for `send_ops` (`IBV_QP_EX_WITH_*`; 0: no
/// extended API, every slot null). Every builder is set, whatever `send_ops` says: one the QP
/// was not made for makes `ibv_wr_complete` answer `EINVAL`, one not offered (memory windows,
/// invalidation, TSO, XRC, atomic write) `EOPNOTSUPP`, never a call through a null pointer.
pub(crate) fn table(send_ops: u64) -> IbvQpExTail {
    let f = |p: *const c_void| if send_ops == 0 { std::ptr::null() } else { p };
    // Entries that take the QP and up to three more word-sized arguments (ignored).
    let none1 = f(wr_unoffered_1 as *const c_void);
    let none4 = f(wr_unoffered_4 as *const c_void);
    IbvQpExTail {
        comp_mask: 0,
        wr_id: 0,
        wr_flags: 0,
        wr_atomic_cmp_swp: f(wr_atomic_cmp_swp as *const c_void),
        wr_atomic_fetch_add: f(wr_atomic_fetch_add as *const c_void),
        wr_bind_mw: none4,
        wr_local_inv: none1,
        wr_rdma_read: f(wr_rdma_read as *const c_void),
        wr_rdma_write: f(wr_rdma_write as *const c_void),
        wr_rdma_write_imm: f(wr_rdma_write_imm as *const c_void),
        wr_send: f(wr_send as *const c_void),
        wr_send_imm: f(wr_send_imm as *const c_void),
        wr_send_inv: none1,
        wr_send_tso: none4,
        wr_set_ud_addr: f(wr_set_ud_addr as *const c_void),
        wr_set_xrc_srqn: none1,
        wr_set_inline_data: f(wr_set_inline_data as *const c_void),
        wr_set_inline_data_list: f(wr_set_inline_data_list as *const c_void),
        wr_set_sge: f(wr_set_sge as *const c_void),
        wr_set_sge_list: f(wr_set_sge_list as *const c_void),
        wr_start: f(wr_start as *const c_void),
        wr_complete: f(wr_complete as *const c_void),
        wr_abort: f(wr_abort as *const c_void),
        wr_atomic_write: none4,
    }
}
