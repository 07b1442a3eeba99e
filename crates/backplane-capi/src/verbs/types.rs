//! C structs (mirrors of verbs.h; sizes checked at compile time).

use super::*;

/// `struct bp_context`.
#[repr(C)]
pub struct BpContext {
    /// The fabric handle it was opened on.
    pub fabric: *mut BpFabric,
    /// The node's slot.
    pub node: u32,
}

/// `struct bp_pd`.
#[repr(C)]
pub struct BpPd {
    /// Owning context.
    pub context: *mut BpContext,
    /// Serial number.
    pub handle: u32,
}

/// `struct bp_mr`.
#[repr(C)]
pub struct BpMr {
    /// Owning context.
    pub context: *mut BpContext,
    /// Protection domain.
    pub pd: *mut BpPd,
    /// The region's bytes.
    pub addr: *mut c_void,
    /// Bytes.
    pub length: usize,
    /// Serial number.
    pub handle: u32,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

/// `struct bp_comp_channel`.
#[repr(C)]
pub struct BpCompChannel {
    /// Owning context.
    pub context: *mut BpContext,
    /// Readable when an event is queued.
    pub fd: c_int,
    /// CQs using it.
    pub refcnt: c_int,
}

/// `struct bp_cq`.
#[repr(C)]
pub struct BpCq {
    /// Owning context.
    pub context: *mut BpContext,
    /// Completion channel or NULL.
    pub channel: *mut BpCompChannel,
    /// The application's pointer.
    pub cq_context: *mut c_void,
    /// Serial number.
    pub handle: u32,
    /// Entries.
    pub cqe: c_int,
}

/// `struct bp_qp`.
#[repr(C)]
pub struct BpQp {
    /// Owning context.
    pub context: *mut BpContext,
    /// The application's pointer.
    pub qp_context: *mut c_void,
    /// Protection domain.
    pub pd: *mut BpPd,
    /// Send CQ.
    pub send_cq: *mut BpCq,
    /// Receive CQ.
    pub recv_cq: *mut BpCq,
    /// Its shared receive queue, or NULL.
    pub srq: *mut BpSrq,
    /// Serial number.
    pub handle: u32,
    /// QP number.
    pub qp_num: u32,
    /// State as of the last modify.
    pub state: u32,
    /// Transport.
    pub qp_type: u32,
}

/// `struct bp_srq`.
#[repr(C)]
pub struct BpSrq {
    /// Owning context.
    pub context: *mut BpContext,
    /// The application's pointer.
    pub srq_context: *mut c_void,
    /// Protection domain.
    pub pd: *mut BpPd,
    /// Serial number.
    pub handle: u32,
}

/// `struct bp_srq_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct BpSrqAttr {
    /// Receives it holds at most.
    pub max_wr: u32,
    /// Scatter/gather entries per receive.
    pub max_sge: u32,
    /// Must be 0 (the limit event is not offered).
    pub srq_limit: u32,
}

/// `struct bp_srq_init_attr`.
#[repr(C)]
pub struct BpSrqInitAttr {
    /// The application's pointer.
    pub srq_context: *mut c_void,
    /// Sizes.
    pub attr: BpSrqAttr,
}

/// `struct bp_ah`.
#[repr(C)]
pub struct BpAh {
    /// Owning context.
    pub context: *mut BpContext,
    /// Protection domain.
    pub pd: *mut BpPd,
    /// Serial number.
    pub handle: u32,
}

/// `struct bp_listener`.
#[repr(C)]
pub struct BpListener {
    /// Owning context.
    pub context: *mut BpContext,
    /// Node it listens on.
    pub node: u32,
    /// Port it listens on.
    pub port: u32,
}

/// `struct bp_device_attr`.
#[repr(C)]
pub struct BpDeviceAttr {
    /// NUL-terminated version.
    pub fw_ver: [c_char; 64],
    /// Node GUID.
    pub node_guid: u64,
    /// Largest region.
    pub max_mr_size: u64,
    /// Page sizes.
    pub page_size_cap: u64,
    /// WRs per queue.
    pub max_qp_wr: c_int,
    /// SGEs per WR.
    pub max_sge: c_int,
    /// Entries per CQ.
    pub max_cqe: c_int,
    /// Outstanding READs/atomics.
    pub max_qp_rd_atom: c_int,
    /// `enum bp_atomic_cap`.
    pub atomic_cap: u32,
    /// Ports.
    pub phys_port_cnt: u8,
}

/// `struct bp_port_attr`.
#[repr(C)]
pub struct BpPortAttr {
    /// `enum bp_port_state`.
    pub state: u32,
    /// `enum bp_mtu`.
    pub max_mtu: u32,
    /// `enum bp_mtu`.
    pub active_mtu: u32,
    /// Largest message.
    pub max_msg_sz: u32,
    /// The node's slot.
    pub lid: u16,
}

/// `struct bp_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BpQpCap {
    /// Outstanding sends.
    pub max_send_wr: u32,
    /// Outstanding receives.
    pub max_recv_wr: u32,
    /// SGEs per send.
    pub max_send_sge: u32,
    /// SGEs per receive.
    pub max_recv_sge: u32,
    /// Inline bytes.
    pub max_inline_data: u32,
}

/// `struct bp_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BpAhAttr {
    /// Destination slot.
    pub dlid: u16,
    /// Ignored.
    pub sl: u8,
    /// Ignored.
    pub src_path_bits: u8,
    /// Ignored.
    pub static_rate: u8,
    /// Ignored.
    pub is_global: u8,
    /// 1.
    pub port_num: u8,
}

/// `struct bp_qp_init_attr`.
#[repr(C)]
pub struct BpQpInitAttr {
    /// The application's pointer.
    pub qp_context: *mut c_void,
    /// Send CQ.
    pub send_cq: *mut BpCq,
    /// Receive CQ.
    pub recv_cq: *mut BpCq,
    /// Take receives from this shared receive queue (NULL: the QP's own).
    pub srq: *mut BpSrq,
    /// Capabilities (in: wanted, out: actual).
    pub cap: BpQpCap,
    /// `enum bp_qp_type`.
    pub qp_type: u32,
    /// Every send signaled.
    pub sq_sig_all: c_int,
    /// Inbound ring bytes (0: default).
    pub ring_bytes: u32,
}

/// `struct bp_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BpQpAttr {
    /// `enum bp_qp_state`.
    pub qp_state: u32,
    /// `enum bp_qp_state`.
    pub cur_qp_state: u32,
    /// `enum bp_mtu`.
    pub path_mtu: u32,
    /// Q_Key.
    pub qkey: u32,
    /// Receive PSN.
    pub rq_psn: u32,
    /// Send PSN.
    pub sq_psn: u32,
    /// Remote QP.
    pub dest_qp_num: u32,
    /// `BP_ACCESS_*`.
    pub qp_access_flags: c_uint,
    /// Capabilities.
    pub cap: BpQpCap,
    /// Remote node.
    pub ah_attr: BpAhAttr,
    /// 0.
    pub pkey_index: u16,
    /// Ignored.
    pub en_sqd_async_notify: u8,
    /// Initiator depth.
    pub max_rd_atomic: u8,
    /// Responder depth.
    pub max_dest_rd_atomic: u8,
    /// RNR timer.
    pub min_rnr_timer: u8,
    /// 1.
    pub port_num: u8,
    /// ACK timeout.
    pub timeout: u8,
    /// Retries.
    pub retry_cnt: u8,
    /// RNR retries.
    pub rnr_retry: u8,
}

/// `struct bp_sge`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BpSge {
    /// Offset (or pointer into the region; or, inline, any pointer).
    pub addr: u64,
    /// Bytes.
    pub length: u32,
    /// Local key.
    pub lkey: u32,
}

/// `wr.rdma` of `struct bp_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BpWrRdma {
    /// Offset in the peer's region.
    pub remote_addr: u64,
    /// The peer's rkey.
    pub rkey: u32,
}

/// `wr.atomic` of `struct bp_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BpWrAtomic {
    /// Offset in the peer's region.
    pub remote_addr: u64,
    /// Compare or add operand.
    pub compare_add: u64,
    /// Swap operand.
    pub swap: u64,
    /// The peer's rkey.
    pub rkey: u32,
}

/// `wr.ud` of `struct bp_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BpWrUd {
    /// Address handle.
    pub ah: *mut BpAh,
    /// Destination QP.
    pub remote_qpn: u32,
    /// Destination Q_Key.
    pub remote_qkey: u32,
}

/// The `wr` union of `struct bp_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union BpWrUnion {
    /// RDMA operations.
    pub rdma: BpWrRdma,
    /// Atomics.
    pub atomic: BpWrAtomic,
    /// UD sends.
    pub ud: BpWrUd,
}

/// `struct bp_send_wr`.
#[repr(C)]
pub struct BpSendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Next request or NULL.
    pub next: *mut BpSendWr,
    /// Buffers.
    pub sg_list: *mut BpSge,
    /// Entries of `sg_list`.
    pub num_sge: c_int,
    /// `enum bp_wr_opcode`.
    pub opcode: u32,
    /// `BP_SEND_*`.
    pub send_flags: c_uint,
    /// Immediate data, network order.
    pub imm_data: u32,
    /// Per-opcode part.
    pub wr: BpWrUnion,
}

/// `struct bp_recv_wr`.
#[repr(C)]
pub struct BpRecvWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Next request or NULL.
    pub next: *mut BpRecvWr,
    /// Buffers.
    pub sg_list: *mut BpSge,
    /// Entries of `sg_list`.
    pub num_sge: c_int,
}

/// `struct bp_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct BpWc {
    /// The request's id.
    pub wr_id: u64,
    /// `enum bp_wc_status`.
    pub status: u32,
    /// `enum bp_wc_opcode`.
    pub opcode: u32,
    /// 0.
    pub vendor_err: u32,
    /// Bytes.
    pub byte_len: u32,
    /// Immediate data, network order.
    pub imm_data: u32,
    /// Local QP.
    pub qp_num: u32,
    /// Sending QP.
    pub src_qp: u32,
    /// `BP_WC_GRH`, `BP_WC_WITH_IMM`.
    pub wc_flags: c_uint,
    /// 0.
    pub pkey_index: u16,
    /// Sending node.
    pub slid: u16,
    /// 0.
    pub sl: u8,
    /// 0.
    pub dlid_path_bits: u8,
}

/// `struct bp_conn_param`.
#[repr(C)]
pub struct BpConnParam {
    /// A region the peer may use.
    pub rkey: u32,
    /// Starting PSN.
    pub psn: u32,
    /// Offset in that region.
    pub addr: u64,
    /// Bytes of it.
    pub len: u64,
    /// UD Q_Key.
    pub qkey: u32,
    /// Bytes of `private_data`.
    pub private_data_len: u8,
    /// Application bytes.
    pub private_data: *const c_void,
}

/// `struct bp_peer_info`.
#[repr(C)]
pub struct BpPeerInfo {
    /// Peer node.
    pub node: u32,
    /// Peer QP.
    pub qpn: u32,
    /// Peer PSN.
    pub psn: u32,
    /// Offered rkey.
    pub rkey: u32,
    /// Offered offset.
    pub addr: u64,
    /// Offered length.
    pub len: u64,
    /// Peer Q_Key.
    pub qkey: u32,
    /// Bytes of `private_data`.
    pub private_data_len: u8,
    /// Application bytes.
    pub private_data: [u8; 56],
}

// The layouts C compilers give verbs.h on LP64 (the C tests assert the same numbers).
const _: () = {
    use std::mem::size_of;
    assert!(size_of::<BpSge>() == 16);
    assert!(size_of::<BpSendWr>() == 72);
    assert!(size_of::<BpRecvWr>() == 32);
    assert!(size_of::<BpWc>() == 48);
    assert!(size_of::<BpQpAttr>() == 72);
    assert!(size_of::<BpQpInitAttr>() == 64);
    assert!(size_of::<BpMr>() == 48);
    assert!(size_of::<BpQp>() == 64);
    assert!(size_of::<BpSrq>() == 32);
    assert!(size_of::<BpSrqInitAttr>() == 24);
    assert!(size_of::<BpConnParam>() == 40);
    assert!(size_of::<BpPeerInfo>() == 96);
};
