//! Connection helper.

use super::*;

/// Reads a `struct bp_conn_param` (NULL: all defaults).
///
/// # Safety
/// `p` is NULL or readable, its `private_data` holds `private_data_len` bytes.
pub(crate) unsafe fn conn_param(p: *const BpConnParam) -> Result<ConnParam, CErr> {
    if p.is_null() {
        return Ok(ConnParam::default());
    }
    // SAFETY: non-null and readable (caller).
    let p = unsafe { &*p };
    if p.private_data_len > 56 {
        return Err(inval("private_data_len is more than 56"));
    }
    let private_data = if p.private_data_len == 0 {
        Vec::new()
    } else if p.private_data.is_null() {
        return Err(inval("private_data is NULL"));
    } else {
        // SAFETY: the caller promises `private_data_len` readable bytes.
        unsafe {
            std::slice::from_raw_parts(p.private_data.cast::<u8>(), p.private_data_len.into())
        }
        .to_vec()
    };
    Ok(ConnParam {
        rkey: p.rkey,
        addr: p.addr,
        len: p.len,
        psn: p.psn,
        qkey: p.qkey,
        private_data,
    })
}

/// Writes a `struct bp_peer_info` (if `out` is not NULL).
///
/// # Safety
/// `out` is NULL or writable.
pub(crate) unsafe fn peer_out(i: &PeerInfo, out: *mut BpPeerInfo) {
    if out.is_null() {
        return;
    }
    let mut pd = [0u8; 56];
    let n = i.private_data.len().min(56);
    pd[..n].copy_from_slice(&i.private_data[..n]);
    // SAFETY: non-null, and the caller promises it is writable.
    unsafe {
        out.write(BpPeerInfo {
            node: i.node,
            qpn: i.qpn,
            psn: i.psn,
            rkey: i.rkey,
            addr: i.addr,
            len: i.len,
            qkey: i.qkey,
            private_data_len: n as u8,
            private_data: pd,
        })
    };
}

/// `bp_listen`.
#[no_mangle]
pub extern "C" fn bp_listen(context: *mut BpContext, port: u32) -> *mut BpListener {
    guard(null_mut(), || {
        local(|l| {
            let c = get_ctx(l, context as usize)?;
            let lis = Listener::bind(&c.ctx, port)?;
            let a = lis.addr();
            let h = Owned::new(BpListener {
                context,
                node: a.node,
                port: a.port,
            });
            let p = h.ptr();
            l.insert(
                h.key(),
                VObj::Listener(Box::new(ListenerObj {
                    _c: h,
                    l: RefCell::new(lis),
                    ctx: context as usize,
                })),
                0,
            );
            Ok(p)
        })
    })
}

/// `bp_destroy_listener`.
#[no_mangle]
pub extern "C" fn bp_destroy_listener(listener: *mut BpListener) -> c_int {
    guard_rc(|| {
        local(|l| {
            get_listener(l, listener as usize)?;
            l.remove(listener as usize, "")?;
            Ok(())
        })
    })
}

/// `bp_accept`.
///
/// # Safety
/// `mine` is NULL or readable (see `conn_param`); `peer` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn bp_accept(
    listener: *mut BpListener,
    qp: *mut BpQp,
    mine: *const BpConnParam,
    peer: *mut BpPeerInfo,
    timeout_ms: c_int,
) -> c_int {
    guard_rc(|| {
        local(|l| {
            let lis = get_listener(l, listener as usize)?;
            let q = get_qp(l, qp as usize)?;
            // SAFETY: forwarded from the caller's promise.
            let mine = unsafe { conn_param(mine) }?;
            let t = ms(timeout_ms)?;
            let r = lis.l.borrow_mut().accept(&q.qp, &mine, t);
            set_state(q);
            let info = r?;
            // SAFETY: forwarded from the caller's promise.
            unsafe { peer_out(&info, peer) };
            Ok(())
        })
    })
}

/// `bp_connect`.
///
/// # Safety
/// `mine` is NULL or readable (see `conn_param`); `peer` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn bp_connect(
    context: *mut BpContext,
    node: u32,
    port: u32,
    qp: *mut BpQp,
    mine: *const BpConnParam,
    peer: *mut BpPeerInfo,
    timeout_ms: c_int,
) -> c_int {
    guard_rc(|| {
        local(|l| {
            let c = get_ctx(l, context as usize)?;
            let q = get_qp(l, qp as usize)?;
            // SAFETY: forwarded from the caller's promise.
            let mine = unsafe { conn_param(mine) }?;
            let t = ms(timeout_ms)?.unwrap_or(Duration::from_secs(365 * 86400));
            let r = cm::connect(&c.ctx, node, port, &q.qp, &mine, t);
            set_state(q);
            let info = r?;
            // SAFETY: forwarded from the caller's promise.
            unsafe { peer_out(&info, peer) };
            Ok(())
        })
    })
}
