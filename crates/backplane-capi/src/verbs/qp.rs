//! QPs and AHs.

use super::*;

/// `bp_create_qp`.
///
/// # Safety
/// `attr` is NULL or points to a readable and writable `struct bp_qp_init_attr`.
#[no_mangle]
pub unsafe extern "C" fn bp_create_qp(pd: *mut BpPd, attr: *mut BpQpInitAttr) -> *mut BpQp {
    guard(null_mut(), || {
        local(|l| {
            let p = get_pd(l, pd as usize)?;
            if attr.is_null() {
                return Err(inval("qp_init_attr is NULL"));
            }
            // SAFETY: non-null, and the caller promises it is readable.
            let a = unsafe { attr.read() };
            let srq = if a.srq.is_null() {
                None
            } else {
                let s = get_srq(l, a.srq as usize)?;
                if s.ctx != p.ctx {
                    return Err(inval("the SRQ belongs to another context than the PD"));
                }
                Some(s)
            };
            let scq = get_cq(l, a.send_cq as usize)?;
            let rcq = get_cq(l, a.recv_cq as usize)?;
            if scq.ctx != p.ctx || rcq.ctx != p.ctx {
                return Err(inval("a CQ belongs to another context than the PD"));
            }
            let ty = qp_type(a.qp_type)?;
            let init = QpInitAttr {
                send_cq: &scq.cq,
                recv_cq: &rcq.cq,
                cap: cap_in(a.cap),
                qp_type: ty,
                sq_sig_all: a.sq_sig_all != 0,
                ring_bytes: a.ring_bytes,
                srq: srq.map(|s| &s.srq),
            };
            let qp = p.pd.create_qp(&init)?;
            let cap = cap_out(qp.query().cap);
            // SAFETY: non-null, and the caller promises it is writable.
            unsafe { (*attr).cap = cap };
            let ctx = p.ctx;
            let c = Owned::new(BpQp {
                context: ctx as *mut BpContext,
                qp_context: a.qp_context,
                pd,
                send_cq: a.send_cq,
                recv_cq: a.recv_cq,
                srq: a.srq,
                handle: l.serial(),
                qp_num: qp.qp_num(),
                state: QpState::Reset as u32,
                qp_type: a.qp_type,
            });
            let out = c.ptr();
            l.insert(
                c.key(),
                VObj::Qp(QpObj {
                    c,
                    qp,
                    pd: pd as usize,
                    ctx,
                    send_cq: a.send_cq as usize,
                    recv_cq: a.recv_cq as usize,
                    srq: a.srq as usize,
                    sq_sig_all: a.sq_sig_all != 0,
                }),
                0,
            );
            Ok(out)
        })
    })
}

/// `bp_destroy_qp`.
#[no_mangle]
pub extern "C" fn bp_destroy_qp(qp: *mut BpQp) -> c_int {
    guard_rc(|| {
        local(|l| {
            get_qp(l, qp as usize)?;
            l.remove(qp as usize, "")?;
            Ok(())
        })
    })
}

pub(crate) fn set_state(q: &QpObj) {
    // SAFETY: the QP struct is live (registered); `state` is a field C only reads.
    unsafe { (*q.c.ptr()).state = q.qp.state() as u32 };
}

/// `bp_modify_qp`.
///
/// # Safety
/// `attr` is NULL or points to a readable `struct bp_qp_attr`.
#[no_mangle]
pub unsafe extern "C" fn bp_modify_qp(
    qp: *mut BpQp,
    attr: *mut BpQpAttr,
    attr_mask: c_int,
) -> c_int {
    guard_rc(|| {
        local(|l| {
            let q = get_qp(l, qp as usize)?;
            if attr.is_null() {
                return Err(inval("attr is NULL"));
            }
            let mask = QpAttrMask::from_bits_retain(attr_mask as u32);
            // Only the fields the mask names are read: libibverbs callers often leave the
            // others uninitialized, and reading those would be undefined behaviour.
            macro_rules! field {
                ($m:ident, $f:ident) => {
                    if mask.contains(QpAttrMask::$m) {
                        // SAFETY: non-null, and the caller promises the fields its mask names
                        // are initialized and readable.
                        Some(unsafe { std::ptr::addr_of!((*attr).$f).read() })
                    } else {
                        None
                    }
                };
            }
            let d = QpAttr::default();
            let r = QpAttr {
                qp_state: field!(STATE, qp_state)
                    .map(qp_state)
                    .transpose()?
                    .unwrap_or(d.qp_state),
                cur_qp_state: field!(CUR_STATE, cur_qp_state)
                    .map(qp_state)
                    .transpose()?
                    .unwrap_or(d.cur_qp_state),
                path_mtu: field!(PATH_MTU, path_mtu)
                    .map(mtu)
                    .transpose()?
                    .unwrap_or(d.path_mtu),
                qkey: field!(QKEY, qkey).unwrap_or(d.qkey),
                rq_psn: field!(RQ_PSN, rq_psn).unwrap_or(d.rq_psn),
                sq_psn: field!(SQ_PSN, sq_psn).unwrap_or(d.sq_psn),
                dest_qp_num: field!(DEST_QPN, dest_qp_num).unwrap_or(d.dest_qp_num),
                qp_access_flags: field!(ACCESS_FLAGS, qp_access_flags)
                    .map(access)
                    .transpose()?
                    .unwrap_or(d.qp_access_flags),
                cap: field!(CAP, cap).map(cap_in).unwrap_or(d.cap),
                ah_attr: field!(AV, ah_attr).map(|a| ah_in(&a)).unwrap_or(d.ah_attr),
                pkey_index: field!(PKEY_INDEX, pkey_index).unwrap_or(d.pkey_index),
                en_sqd_async_notify: field!(EN_SQD_ASYNC_NOTIFY, en_sqd_async_notify)
                    .unwrap_or(d.en_sqd_async_notify),
                max_rd_atomic: field!(MAX_QP_RD_ATOMIC, max_rd_atomic).unwrap_or(d.max_rd_atomic),
                max_dest_rd_atomic: field!(MAX_DEST_RD_ATOMIC, max_dest_rd_atomic)
                    .unwrap_or(d.max_dest_rd_atomic),
                min_rnr_timer: field!(MIN_RNR_TIMER, min_rnr_timer).unwrap_or(d.min_rnr_timer),
                port_num: field!(PORT, port_num).unwrap_or(d.port_num),
                timeout: field!(TIMEOUT, timeout).unwrap_or(d.timeout),
                retry_cnt: field!(RETRY_CNT, retry_cnt).unwrap_or(d.retry_cnt),
                rnr_retry: field!(RNR_RETRY, rnr_retry).unwrap_or(d.rnr_retry),
            };
            let res = q.qp.modify(&r, mask);
            set_state(q);
            res?;
            Ok(())
        })
    })
}

/// `bp_query_qp`: fills every attribute whatever the mask.
///
/// # Safety
/// `attr` points to a writable `struct bp_qp_attr`; `init_attr` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn bp_query_qp(
    qp: *mut BpQp,
    attr: *mut BpQpAttr,
    _attr_mask: c_int,
    init_attr: *mut BpQpInitAttr,
) -> c_int {
    guard_rc(|| {
        local(|l| {
            let q = get_qp(l, qp as usize)?;
            if attr.is_null() {
                return Err(inval("attr is NULL"));
            }
            let a = q.qp.query();
            let out = BpQpAttr {
                qp_state: a.qp_state as u32,
                cur_qp_state: a.cur_qp_state as u32,
                path_mtu: a.path_mtu as u32,
                qkey: a.qkey,
                rq_psn: a.rq_psn,
                sq_psn: a.sq_psn,
                dest_qp_num: a.dest_qp_num,
                qp_access_flags: a.qp_access_flags.bits(),
                cap: cap_out(a.cap),
                ah_attr: ah_out(&a.ah_attr),
                pkey_index: a.pkey_index,
                en_sqd_async_notify: a.en_sqd_async_notify,
                max_rd_atomic: a.max_rd_atomic,
                max_dest_rd_atomic: a.max_dest_rd_atomic,
                min_rnr_timer: a.min_rnr_timer,
                port_num: a.port_num,
                timeout: a.timeout,
                retry_cnt: a.retry_cnt,
                rnr_retry: a.rnr_retry,
            };
            // SAFETY: non-null, and the caller promises it is writable.
            unsafe { attr.write(out) };
            set_state(q);
            if !init_attr.is_null() {
                let p = q.c.ptr();
                // SAFETY: `p` is live (registered) and read through the pointer (C may have
                // written qp_context); `init_attr` is writable (caller).
                unsafe {
                    init_attr.write(BpQpInitAttr {
                        qp_context: (*p).qp_context,
                        send_cq: q.send_cq as *mut BpCq,
                        recv_cq: q.recv_cq as *mut BpCq,
                        srq: q.srq as *mut BpSrq,
                        cap: cap_out(a.cap),
                        qp_type: q.qp.qp_type() as u32,
                        sq_sig_all: c_int::from(q.sq_sig_all),
                        ring_bytes: 0,
                    })
                };
            }
            Ok(())
        })
    })
}

/// The owned form of one C send work request.
pub(crate) struct OwnedSend {
    pub(crate) wr_id: u64,
    pub(crate) opcode: WrOpcode,
    pub(crate) flags: SendFlags,
    pub(crate) imm: u32,
    pub(crate) sges: SgeBuf,
    pub(crate) inline: Vec<u8>,
    pub(crate) detail: OwnedDetail,
}

pub(crate) enum OwnedDetail {
    None,
    Rdma(u64, u32),
    Atomic(u64, u64, u64, u32),
    Ud(Ah, u32, u32),
}

/// Reads one `struct bp_send_wr`.
///
/// # Safety
/// `w` is readable, its `sg_list` holds `num_sge` entries, and with `BP_SEND_INLINE` every
/// entry's `addr` points to `length` readable bytes.
pub(crate) unsafe fn read_send(
    l: &Local,
    q: &QpObj,
    w: *const BpSendWr,
) -> Result<OwnedSend, CErr> {
    // SAFETY: readable (caller). Only the union member the opcode names is read below.
    let w = unsafe { &*w };
    let opcode = wr_opcode(w.opcode)?;
    let flags = SendFlags::from_bits_retain(w.send_flags & 0xf);
    let mut inline = Vec::new();
    let mut list = SgeBuf::new();
    if flags.contains(SendFlags::INLINE) {
        if w.num_sge < 0 || w.num_sge > 32 || (w.num_sge > 0 && w.sg_list.is_null()) {
            return Err(inval("bad sg_list / num_sge"));
        }
        for i in 0..w.num_sge as usize {
            // SAFETY: `sg_list` holds `num_sge` entries (caller).
            let s = unsafe { w.sg_list.add(i).read() };
            if inline.len() + s.length as usize > 4096 {
                return Err(inval("inline data larger than 4096 bytes"));
            }
            if s.length > 0 {
                if s.addr == 0 {
                    return Err(inval("inline sg_list entry with a NULL address"));
                }
                // SAFETY: with INLINE the caller promises `length` readable bytes at `addr`.
                let b =
                    unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
                inline.extend_from_slice(b);
            }
        }
    } else {
        // SAFETY: `sg_list` holds `num_sge` entries (caller).
        list = unsafe { sges(l, q.ctx, w.sg_list, w.num_sge) }?;
    }
    // Only the fields the opcode uses are read (the others may be uninitialized in C).
    let detail = match opcode {
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm | WrOpcode::RdmaRead => {
            // SAFETY: an RDMA opcode: the caller filled `wr.rdma`'s fields.
            let (a, k) = unsafe { (w.wr.rdma.remote_addr, w.wr.rdma.rkey) };
            OwnedDetail::Rdma(a, k)
        }
        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
            // SAFETY: an atomic opcode: the caller filled these fields of `wr.atomic`.
            let (a, c, k) = unsafe {
                (
                    w.wr.atomic.remote_addr,
                    w.wr.atomic.compare_add,
                    w.wr.atomic.rkey,
                )
            };
            let swap = if opcode == WrOpcode::AtomicCmpAndSwp {
                // SAFETY: CMP_AND_SWP: the caller filled `swap` too.
                unsafe { w.wr.atomic.swap }
            } else {
                0
            };
            OwnedDetail::Atomic(a, c, swap, k)
        }
        WrOpcode::Send | WrOpcode::SendWithImm if q.qp.qp_type() == QpType::Ud => {
            // SAFETY: a send on a UD QP: the caller filled `wr.ud`.
            let u = unsafe { w.wr.ud };
            let ah = get_ah(l, u.ah as usize)?;
            OwnedDetail::Ud(ah.ah, u.remote_qpn, u.remote_qkey)
        }
        _ => OwnedDetail::None,
    };
    Ok(OwnedSend {
        wr_id: w.wr_id,
        opcode,
        flags,
        imm: match opcode {
            WrOpcode::RdmaWriteWithImm | WrOpcode::SendWithImm => u32::from_be(w.imm_data),
            _ => 0,
        },
        sges: list,
        inline,
        detail,
    })
}

pub(crate) fn send_wr(o: &OwnedSend) -> SendWr<'_> {
    SendWr {
        wr_id: o.wr_id,
        sg_list: o.sges.as_slice(),
        opcode: o.opcode,
        send_flags: o.flags,
        imm_data: o.imm,
        wr: match o.detail {
            OwnedDetail::None => WrDetail::None,
            OwnedDetail::Rdma(remote_addr, rkey) => WrDetail::Rdma { remote_addr, rkey },
            OwnedDetail::Atomic(remote_addr, compare_add, swap, rkey) => WrDetail::Atomic {
                remote_addr,
                compare_add,
                swap,
                rkey,
            },
            OwnedDetail::Ud(ref ah, remote_qpn, remote_qkey) => WrDetail::Ud {
                ah,
                remote_qpn,
                remote_qkey,
            },
        },
        inline_data: &o.inline,
    }
}

/// `bp_post_send`.
///
/// # Safety
/// `wr` is a NULL-terminated list of readable requests (see `read_send`); `bad_wr` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn bp_post_send(
    qp: *mut BpQp,
    wr: *mut BpSendWr,
    bad_wr: *mut *mut BpSendWr,
) -> c_int {
    let mut bad: *mut BpSendWr = null_mut();
    let rc = guard_rc(|| {
        local(|l| {
            let q = get_qp(l, qp as usize)?;
            bad = wr;
            if wr.is_null() {
                return Err(inval("wr is NULL"));
            }
            // SAFETY: `wr` is readable (caller).
            if unsafe { (*wr).next.is_null() } {
                // One request (the common case): no list to build.
                // SAFETY: `wr` is readable, as the rest of the request (caller).
                let o = unsafe { read_send(l, q, wr) }?;
                let r = q.qp.post_send(std::slice::from_ref(&send_wr(&o)));
                set_state(q);
                r?;
                bad = null_mut();
                return Ok(());
            }
            // SAFETY: every `next` is NULL or readable (caller).
            let ptrs = unsafe { walk(wr, |p| (*p).next, MAX_LIST) };
            let mut owned = Vec::with_capacity(ptrs.len());
            let mut conv_err = None;
            for (i, &p) in ptrs.iter().enumerate() {
                // SAFETY: `p` is readable, as the rest of the request (caller).
                match unsafe { read_send(l, q, p) } {
                    Ok(o) => owned.push(o),
                    Err(e) => {
                        conv_err = Some((i, e));
                        break;
                    }
                }
            }
            let wrs: Vec<SendWr<'_>> = owned.iter().map(send_wr).collect();
            let r = if wrs.is_empty() {
                Ok(())
            } else {
                q.qp.post_send(&wrs)
            };
            set_state(q);
            match r {
                Err(VerbsError::Post { bad_wr: i, source }) => {
                    bad = ptrs[i.min(ptrs.len() - 1)];
                    Err((*source).into())
                }
                Err(e) => Err(e.into()),
                Ok(()) => match conv_err {
                    Some((i, e)) => {
                        bad = ptrs[i];
                        Err(e)
                    }
                    None if ptrs.len() == MAX_LIST => {
                        bad = ptrs[MAX_LIST - 1];
                        Err(CErr(libc::ENOMEM, "work request list too long".into()))
                    }
                    None => {
                        bad = null_mut();
                        Ok(())
                    }
                },
            }
        })
    });
    if !bad_wr.is_null() {
        // SAFETY: non-null, and the caller promises it is writable.
        unsafe { bad_wr.write(if rc == 0 { null_mut() } else { bad }) };
    }
    rc
}

/// `bp_post_recv`.
///
/// # Safety
/// `wr` is a NULL-terminated list of readable requests whose `sg_list` hold `num_sge`
/// entries; `bad_wr` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn bp_post_recv(
    qp: *mut BpQp,
    wr: *mut BpRecvWr,
    bad_wr: *mut *mut BpRecvWr,
) -> c_int {
    // SAFETY: caller contract.
    unsafe {
        post_recv_list(wr, bad_wr, |l, post| {
            let q = get_qp(l, qp as usize)?;
            post(l, q.ctx, &|wrs: &[RecvWr<'_>]| q.qp.post_recv(wrs))
        })
    }
}

/// `bp_post_srq_recv`.
///
/// # Safety
/// As [`bp_post_recv`].
#[no_mangle]
pub unsafe extern "C" fn bp_post_srq_recv(
    srq: *mut BpSrq,
    wr: *mut BpRecvWr,
    bad_wr: *mut *mut BpRecvWr,
) -> c_int {
    // SAFETY: caller contract.
    unsafe {
        post_recv_list(wr, bad_wr, |l, post| {
            let s = get_srq(l, srq as usize)?;
            post(l, s.ctx, &|wrs: &[RecvWr<'_>]| s.srq.post_recv(wrs))
        })
    }
}

/// Posts a receive list: a QP's or an SRQ's (`target` finds it and calls `post` with its
/// context, for the lkeys, and the function that posts). Sets `*bad_wr` to the first request
/// not posted.
///
/// # Safety
/// `wr` is a NULL-terminated list of readable requests whose `sg_list` hold `num_sge`
/// entries; `bad_wr` is NULL or writable.
unsafe fn post_recv_list(
    wr: *mut BpRecvWr,
    bad_wr: *mut *mut BpRecvWr,
    target: impl FnOnce(&Local, &mut RecvPost<'_>) -> Result<(), CErr>,
) -> c_int {
    let mut bad: *mut BpRecvWr = null_mut();
    let rc = guard_rc(|| {
        local(|l| {
            // A bad handle leaves `*bad_wr` NULL; a bad list names its first request.
            target(l, &mut |l, ctx, post| {
                if wr.is_null() {
                    return Err(inval("wr is NULL"));
                }
                // SAFETY: caller contract (the list), passed through.
                let (r, b) = unsafe { post_list(l, ctx, wr, post) };
                bad = b;
                r
            })
        })
    });
    if !bad_wr.is_null() {
        // SAFETY: non-null, and the caller promises it is writable.
        unsafe { bad_wr.write(if rc == 0 { null_mut() } else { bad }) };
    }
    rc
}

/// What [`post_recv_list`]'s target calls: the registry, the context the lkeys belong to, and
/// the function that posts converted requests.
type RecvPost<'a> = dyn FnMut(&Local, usize, &dyn Fn(&[RecvWr<'_>]) -> Result<(), VerbsError>) -> Result<(), CErr>
    + 'a;

/// Converts the list at `wr` (lkeys of context `ctx`) and posts it: the result and the first
/// request not posted.
///
/// # Safety
/// `wr` is non-NULL, a NULL-terminated list of readable requests whose `sg_list` hold
/// `num_sge` entries.
unsafe fn post_list(
    l: &Local,
    ctx: usize,
    wr: *mut BpRecvWr,
    post: &dyn Fn(&[RecvWr<'_>]) -> Result<(), VerbsError>,
) -> (Result<(), CErr>, *mut BpRecvWr) {
    // SAFETY: `wr` is readable (caller).
    if unsafe { (*wr).next.is_null() } {
        // SAFETY: `wr` is readable and its sg_list holds num_sge entries (caller).
        let r = unsafe { sges(l, ctx, (*wr).sg_list, (*wr).num_sge) }.and_then(|s| {
            post(&[RecvWr {
                // SAFETY: as above.
                wr_id: unsafe { (*wr).wr_id },
                sg_list: s.as_slice(),
            }])
            .map_err(CErr::from)
        });
        return (r, wr);
    }
    // SAFETY: every `next` is NULL or readable (caller).
    let ptrs = unsafe { walk(wr, |p| (*p).next, MAX_LIST) };
    let mut lists = Vec::with_capacity(ptrs.len());
    let mut conv_err = None;
    for (i, &p) in ptrs.iter().enumerate() {
        // SAFETY: `p` is readable and its sg_list holds num_sge entries (caller).
        match unsafe { sges(l, ctx, (*p).sg_list, (*p).num_sge) } {
            // SAFETY: as above.
            Ok(s) => lists.push((unsafe { (*p).wr_id }, s)),
            Err(e) => {
                conv_err = Some((i, e));
                break;
            }
        }
    }
    let wrs: Vec<RecvWr<'_>> = lists
        .iter()
        .map(|(wr_id, s)| RecvWr {
            wr_id: *wr_id,
            sg_list: s.as_slice(),
        })
        .collect();
    let r = if wrs.is_empty() { Ok(()) } else { post(&wrs) };
    match r {
        Err(VerbsError::Post { bad_wr: i, source }) => {
            (Err((*source).into()), ptrs[i.min(ptrs.len() - 1)])
        }
        Err(e) => (Err(e.into()), wr),
        Ok(()) => match conv_err {
            Some((i, e)) => (Err(e), ptrs[i]),
            None if ptrs.len() == MAX_LIST => (
                Err(CErr(libc::ENOMEM, "work request list too long".into())),
                ptrs[MAX_LIST - 1],
            ),
            None => (Ok(()), null_mut()),
        },
    }
}

/// `bp_create_srq`: the granted sizes are written back into `attr`.
///
/// # Safety
/// `attr` is NULL or points to a readable and writable `struct bp_srq_init_attr`.
#[no_mangle]
pub unsafe extern "C" fn bp_create_srq(pd: *mut BpPd, attr: *mut BpSrqInitAttr) -> *mut BpSrq {
    guard(null_mut(), || {
        local(|l| {
            let p = get_pd(l, pd as usize)?;
            if attr.is_null() {
                return Err(inval("srq_init_attr is NULL"));
            }
            // SAFETY: non-null, and the caller promises it is readable.
            let a = unsafe { attr.read() };
            if a.attr.srq_limit != 0 {
                return Err(inval(
                    "srq_limit (the limit event) is not offered: create with srq_limit 0",
                ));
            }
            let srq = p.pd.create_srq(SrqAttr {
                max_wr: a.attr.max_wr,
                max_sge: a.attr.max_sge,
            })?;
            let ctx = p.ctx;
            let c = Owned::new(BpSrq {
                context: ctx as *mut BpContext,
                srq_context: a.srq_context,
                pd,
                handle: l.serial(),
            });
            let out = c.ptr();
            l.insert(
                c.key(),
                VObj::Srq(SrqObj {
                    _c: c,
                    srq,
                    pd: pd as usize,
                    ctx,
                }),
                0,
            );
            Ok(out)
        })
    })
}

/// `bp_destroy_srq`: `EBUSY` while a QP made with it exists.
#[no_mangle]
pub extern "C" fn bp_destroy_srq(srq: *mut BpSrq) -> c_int {
    guard_rc(|| {
        local(|l| {
            get_srq(l, srq as usize)?;
            l.remove(srq as usize, "QPs made with it")?;
            Ok(())
        })
    })
}

/// `bp_query_srq`.
///
/// # Safety
/// `attr` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn bp_query_srq(srq: *mut BpSrq, attr: *mut BpSrqAttr) -> c_int {
    guard_rc(|| {
        local(|l| {
            let s = get_srq(l, srq as usize)?;
            if attr.is_null() {
                return Err(inval("attr is NULL"));
            }
            let a = s.srq.query();
            // SAFETY: non-null, and the caller promises it is writable.
            unsafe {
                attr.write(BpSrqAttr {
                    max_wr: a.max_wr,
                    max_sge: a.max_sge,
                    srq_limit: 0,
                })
            };
            Ok(())
        })
    })
}

/// `bp_create_ah`.
///
/// # Safety
/// `attr` is NULL or points to a readable `struct bp_ah_attr`.
#[no_mangle]
pub unsafe extern "C" fn bp_create_ah(pd: *mut BpPd, attr: *mut BpAhAttr) -> *mut BpAh {
    guard(null_mut(), || {
        local(|l| {
            let p = get_pd(l, pd as usize)?;
            if attr.is_null() {
                return Err(inval("attr is NULL"));
            }
            // SAFETY: non-null, and the caller promises it is readable.
            let a = unsafe { attr.read() };
            let ah = p.pd.create_ah(&ah_in(&a))?;
            let c = Owned::new(BpAh {
                context: p.ctx as *mut BpContext,
                pd,
                handle: l.serial(),
            });
            let out = c.ptr();
            l.insert(
                c.key(),
                VObj::Ah(AhObj {
                    _c: c,
                    ah,
                    pd: pd as usize,
                }),
                0,
            );
            Ok(out)
        })
    })
}

/// `bp_destroy_ah`.
#[no_mangle]
pub extern "C" fn bp_destroy_ah(ah: *mut BpAh) -> c_int {
    guard_rc(|| {
        local(|l| {
            get_ah(l, ah as usize)?;
            l.remove(ah as usize, "")?;
            Ok(())
        })
    })
}

/// `bp_wc_status_str`.
#[no_mangle]
pub extern "C" fn bp_wc_status_str(status: c_int) -> *const c_char {
    backplane::verbs::wc_status_cstr(status).as_ptr()
}
