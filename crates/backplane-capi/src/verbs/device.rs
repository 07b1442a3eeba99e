//! Device, PD, MR.

use super::*;

/// `bp_open_device`.
#[no_mangle]
pub extern "C" fn bp_open_device(fabric: *mut BpFabric, node: u32) -> *mut BpContext {
    guard(null_mut(), || {
        let f = get_fabric(fabric)?;
        let ctx = Context::open(&f.fabric.node(node)?)?;
        local(|l| {
            let c = Owned::new(BpContext { fabric, node });
            let p = c.ptr();
            l.insert(c.key(), VObj::Ctx(CtxObj { _c: c, ctx }), fabric as usize);
            Ok(p)
        })
    })
}

/// `bp_close_device`: 0 or -1 with errno.
#[no_mangle]
pub extern "C" fn bp_close_device(context: *mut BpContext) -> c_int {
    guard(-1, || {
        local(|l| {
            get_ctx(l, context as usize)?;
            l.remove(
                context as usize,
                "PDs, CQs, completion channels, listeners and DMA queues",
            )?;
            Ok(0)
        })
    })
}

/// `bp_query_device`.
///
/// # Safety
/// `attr` is NULL or points to a writable `struct bp_device_attr`.
#[no_mangle]
pub unsafe extern "C" fn bp_query_device(
    context: *mut BpContext,
    attr: *mut BpDeviceAttr,
) -> c_int {
    guard_rc(|| {
        local(|l| {
            let c = get_ctx(l, context as usize)?;
            if attr.is_null() {
                return Err(inval("device_attr is NULL"));
            }
            let d = c.ctx.query_device();
            let mut fw = [0 as c_char; 64];
            for (o, b) in fw.iter_mut().zip(d.fw_ver.bytes().take(63)) {
                *o = b as c_char;
            }
            let out = BpDeviceAttr {
                fw_ver: fw,
                node_guid: d.node_guid,
                max_mr_size: d.max_mr_size,
                page_size_cap: d.page_size_cap,
                max_qp_wr: d.max_qp_wr as c_int,
                max_sge: d.max_sge as c_int,
                max_cqe: d.max_cqe as c_int,
                max_qp_rd_atom: d.max_qp_rd_atom as c_int,
                atomic_cap: d.atomic_cap as u32,
                phys_port_cnt: d.phys_port_cnt,
            };
            // SAFETY: non-null, and the caller promises it is writable.
            unsafe { attr.write(out) };
            Ok(())
        })
    })
}

/// `bp_query_port`.
///
/// # Safety
/// `attr` is NULL or points to a writable `struct bp_port_attr`.
#[no_mangle]
pub unsafe extern "C" fn bp_query_port(
    context: *mut BpContext,
    port_num: u8,
    attr: *mut BpPortAttr,
) -> c_int {
    guard_rc(|| {
        local(|l| {
            let c = get_ctx(l, context as usize)?;
            if attr.is_null() {
                return Err(inval("port_attr is NULL"));
            }
            let p = c.ctx.query_port(port_num)?;
            let out = BpPortAttr {
                state: p.state as u32,
                max_mtu: p.max_mtu as u32,
                active_mtu: p.active_mtu as u32,
                max_msg_sz: p.max_msg_sz,
                lid: p.lid,
            };
            // SAFETY: non-null, and the caller promises it is writable.
            unsafe { attr.write(out) };
            Ok(())
        })
    })
}

/// `bp_alloc_pd`.
#[no_mangle]
pub extern "C" fn bp_alloc_pd(context: *mut BpContext) -> *mut BpPd {
    guard(null_mut(), || {
        local(|l| {
            let pd = get_ctx(l, context as usize)?.ctx.alloc_pd();
            let c = Owned::new(BpPd {
                context,
                handle: l.serial(),
            });
            let p = c.ptr();
            let ctx = context as usize;
            l.insert(c.key(), VObj::Pd(PdObj { _c: c, pd, ctx }), 0);
            Ok(p)
        })
    })
}

/// `bp_dealloc_pd`.
#[no_mangle]
pub extern "C" fn bp_dealloc_pd(pd: *mut BpPd) -> c_int {
    guard_rc(|| {
        local(|l| {
            get_pd(l, pd as usize)?;
            l.remove(
                pd as usize,
                "memory regions, queue pairs and address handles",
            )?;
            Ok(())
        })
    })
}

/// `bp_reg_mr`: allocates and registers `length` bytes; `addr` must be NULL.
#[no_mangle]
pub extern "C" fn bp_reg_mr(
    pd: *mut BpPd,
    addr: *mut c_void,
    length: usize,
    access_flags: c_int,
) -> *mut BpMr {
    guard(null_mut(), || {
        local(|l| {
            let p = get_pd(l, pd as usize)?;
            if !addr.is_null() {
                return Err(inval(
                    "backplane allocates registered memory (peers map it): pass addr = NULL \
                     and use mr->addr",
                ));
            }
            let acc = access(access_flags as c_uint)?;
            let mr = p.pd.reg_mr(length, acc)?;
            let ctx = p.ctx;
            let key = mr.lkey();
            let data = mr.as_ptr();
            let c = Owned::new(BpMr {
                context: ctx as *mut BpContext,
                pd,
                addr: data.cast(),
                length,
                handle: l.serial(),
                lkey: key,
                rkey: mr.rkey(),
            });
            let out = c.ptr();
            l.mrs.insert((ctx, key), (data as usize, length));
            l.insert(
                c.key(),
                VObj::Mr(MrObj {
                    _c: c,
                    _mr: mr,
                    pd: pd as usize,
                    ctx,
                    key,
                }),
                0,
            );
            Ok(out)
        })
    })
}

/// `bp_dereg_mr`.
#[no_mangle]
pub extern "C" fn bp_dereg_mr(mr: *mut BpMr) -> c_int {
    guard_rc(|| {
        local(|l| {
            let m = get_mr(l, mr as usize)?;
            let k = (m.ctx, m.key);
            l.remove(mr as usize, "")?;
            l.mrs.remove(&k);
            Ok(())
        })
    })
}
