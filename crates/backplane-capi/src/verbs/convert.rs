//! Conversions.

use super::*;

pub(crate) fn qp_state(v: u32) -> Result<QpState, CErr> {
    QpState::from_ibv(v).ok_or_else(|| inval(format!("QP state {v} is not a BP_QPS_* value")))
}

pub(crate) fn qp_type(v: u32) -> Result<QpType, CErr> {
    QpType::from_ibv(v).ok_or_else(|| inval(format!("QP type {v}: use BP_QPT_RC, _UC or _UD")))
}

pub(crate) fn mtu(v: u32) -> Result<Mtu, CErr> {
    Mtu::from_ibv(v).ok_or_else(|| inval(format!("path MTU {v} is not a BP_MTU_* value")))
}

pub(crate) fn access(v: c_uint) -> Result<AccessFlags, CErr> {
    const ZERO_BASED: u32 = 1 << 5;
    let known = 0xf | ZERO_BASED;
    if v & !known != 0 {
        return Err(inval(format!(
            "access flags {v:#x}: only LOCAL_WRITE, REMOTE_WRITE/READ/ATOMIC and ZERO_BASED exist"
        )));
    }
    Ok(AccessFlags::from_bits_retain(v & 0xf))
}

pub(crate) fn wr_opcode(v: u32) -> Result<WrOpcode, CErr> {
    WrOpcode::from_ibv(v).ok_or_else(|| inval(format!("opcode {v} is not a BP_WR_* value")))
}

pub(crate) fn cap_in(c: BpQpCap) -> QpCap {
    QpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
    .zero_counts_default()
}

pub(crate) fn cap_out(c: QpCap) -> BpQpCap {
    BpQpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

pub(crate) fn ah_in(a: &BpAhAttr) -> AhAttr {
    AhAttr {
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: a.is_global != 0,
        port_num: a.port_num,
    }
}

pub(crate) fn ah_out(a: &AhAttr) -> BpAhAttr {
    BpAhAttr {
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: u8::from(a.is_global),
        port_num: a.port_num,
    }
}

pub(crate) fn wc_out(w: &Wc) -> BpWc {
    BpWc {
        wr_id: w.wr_id,
        status: w.status as u32,
        opcode: w.opcode as u32,
        vendor_err: w.vendor_err,
        byte_len: w.byte_len,
        imm_data: w.imm_data.to_be(),
        qp_num: w.qp_num,
        src_qp: w.src_qp,
        wc_flags: w.wc_flags.bits(),
        pkey_index: w.pkey_index,
        slid: w.slid,
        sl: w.sl,
        dlid_path_bits: w.dlid_path_bits,
    }
}

/// A scatter/gather list read from C: up to four entries without a heap allocation.
pub(crate) struct SgeBuf {
    pub(crate) small: [Sge; 4],
    pub(crate) n: usize,
    pub(crate) heap: Vec<Sge>,
}

impl SgeBuf {
    pub(crate) fn new() -> Self {
        Self {
            small: [Sge::default(); 4],
            n: 0,
            heap: Vec::new(),
        }
    }
    pub(crate) fn push(&mut self, s: Sge) {
        if self.heap.is_empty() && self.n < 4 {
            self.small[self.n] = s;
            self.n += 1;
        } else {
            if self.heap.is_empty() {
                self.heap.extend_from_slice(&self.small[..self.n]);
            }
            self.heap.push(s);
        }
    }
    pub(crate) fn as_slice(&self) -> &[Sge] {
        if self.heap.is_empty() {
            &self.small[..self.n]
        } else {
            &self.heap
        }
    }
}

/// Reads a `struct bp_sge` array into offsets (pointers into a region of `ctx` become
/// offsets; everything else is passed on for the engine to judge).
///
/// # Safety
/// `sg` points to `n` readable entries when `n > 0`.
pub(crate) unsafe fn sges(
    l: &Local,
    ctx: usize,
    sg: *const BpSge,
    n: c_int,
) -> Result<SgeBuf, CErr> {
    if !(0..=32).contains(&n) {
        return Err(inval(format!("num_sge {n} is not 0..=32")));
    }
    if n > 0 && sg.is_null() {
        return Err(inval("sg_list is NULL"));
    }
    let list: &[BpSge] = if n == 0 {
        &[]
    } else {
        // SAFETY: non-null, and the caller promises `n` readable entries.
        unsafe { std::slice::from_raw_parts(sg, n as usize) }
    };
    let mut out = SgeBuf::new();
    for s in list {
        let addr = match l.mrs.get(&(ctx, s.lkey)) {
            Some(&(base, len)) if s.addr >= base as u64 && s.addr <= base as u64 + len as u64 => {
                s.addr - base as u64
            }
            _ => s.addr,
        };
        out.push(Sge {
            addr,
            length: s.length,
            lkey: s.lkey,
        });
    }
    Ok(out)
}

/// Walks a C linked list (at most `max` entries, so a cycle cannot hang us).
///
/// # Safety
/// Every `next` pointer is NULL or points to a readable `T`.
pub(crate) unsafe fn walk<T>(
    first: *mut T,
    next: impl Fn(*mut T) -> *mut T,
    max: usize,
) -> Vec<*mut T> {
    let mut v = Vec::new();
    let mut p = first;
    while !p.is_null() && v.len() < max {
        v.push(p);
        p = next(p);
    }
    v
}

/// Longest work-request list one post walks (the longest queue, plus one to be refused).
pub(crate) const MAX_LIST: usize = (1 << 16) + 1;
