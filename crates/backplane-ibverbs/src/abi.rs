//! The structures of rdma-core's `<infiniband/verbs.h>` (44) that this library hands out or
//! fills, as `#[repr(C)]` mirrors; `build.rs` checks their sizes and offsets against the
//! installed header at compile time. Field names follow the header.

#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_void};

/// `struct _ibv_device_ops`: two unused pointers (always null here).
#[repr(C)]
pub struct IbvDeviceOps {
    pub _dummy1: *const c_void,
    pub _dummy2: *const c_void,
}

/// `IBV_SYSFS_NAME_MAX`.
pub const SYSFS_NAME_MAX: usize = 64;
/// `IBV_SYSFS_PATH_MAX`.
pub const SYSFS_PATH_MAX: usize = 256;

/// `struct ibv_device`.
#[repr(C)]
pub struct IbvDevice {
    pub ops: IbvDeviceOps,
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; SYSFS_NAME_MAX],
    pub dev_name: [c_char; SYSFS_NAME_MAX],
    pub dev_path: [c_char; SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; SYSFS_PATH_MAX],
}

/// `struct ibv_context_ops`: the table the inline data-path calls (`ibv_poll_cq`,
/// `ibv_req_notify_cq`, `ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`, the memory
/// window calls) jump through; the `_compat_*` slots are unused by programs built against
/// rdma-core ≥ 17. A null slot is an operation this library does not offer yet.
#[repr(C)]
pub struct IbvContextOps {
    pub _compat_query_device: *const c_void,
    pub _compat_query_port: *const c_void,
    pub _compat_alloc_pd: *const c_void,
    pub _compat_dealloc_pd: *const c_void,
    pub _compat_reg_mr: *const c_void,
    pub _compat_rereg_mr: *const c_void,
    pub _compat_dereg_mr: *const c_void,
    pub alloc_mw: *const c_void,
    pub bind_mw: *const c_void,
    pub dealloc_mw: *const c_void,
    pub _compat_create_cq: *const c_void,
    pub poll_cq: *const c_void,
    pub req_notify_cq: *const c_void,
    pub _compat_cq_event: *const c_void,
    pub _compat_resize_cq: *const c_void,
    pub _compat_destroy_cq: *const c_void,
    pub _compat_create_srq: *const c_void,
    pub _compat_modify_srq: *const c_void,
    pub _compat_query_srq: *const c_void,
    pub _compat_destroy_srq: *const c_void,
    pub post_srq_recv: *const c_void,
    pub _compat_create_qp: *const c_void,
    pub _compat_query_qp: *const c_void,
    pub _compat_modify_qp: *const c_void,
    pub _compat_destroy_qp: *const c_void,
    pub post_send: *const c_void,
    pub post_recv: *const c_void,
    pub _compat_create_ah: *const c_void,
    pub _compat_destroy_ah: *const c_void,
    pub _compat_attach_mcast: *const c_void,
    pub _compat_detach_mcast: *const c_void,
    pub _compat_async_event: *const c_void,
}

/// `struct ibv_context`. `abi_compat` is `__VERBS_ABI_IS_EXTENDED`: the context is the last
/// field of a `struct verbs_context` ([`VerbsContextHead`] before it), whose only operation
/// set is `create_qp_ex`; the header's inline wrappers of the other extended operations
/// (`ibv_query_port`, `ibv_query_device_ex`) find theirs null and fall back to the exported
/// functions, or answer `EOPNOTSUPP` (`ibv_create_cq_ex`, …).
#[repr(C)]
pub struct IbvContext {
    pub device: *mut IbvDevice,
    pub ops: IbvContextOps,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

/// `__VERBS_ABI_IS_EXTENDED`: `abi_compat` of a context that is a `verbs_context`'s.
pub const VERBS_ABI_IS_EXTENDED: *mut c_void = usize::MAX as *mut c_void;

/// How many operation slots `struct verbs_context` has before `create_qp_ex` (`query_port`
/// … `open_qp`, the two ABI placeholders included).
pub const VCTX_OPS_BEFORE_CREATE_QP_EX: usize = 33;

/// The part of `struct verbs_context` before its `struct ibv_context context` (rdma-core 44):
/// the extended operations ("grows up": new ones are added at the front), then `sz`. Set:
/// `create_cq_ex`, `query_device_ex`, `create_qp_ex`; a null slot is an operation not offered.
#[repr(C)]
pub struct VerbsContextHead {
    pub ops_a: [*const c_void; 25],
    pub create_cq_ex: *const c_void,
    pub priv_: *const c_void,
    pub query_device_ex: *const c_void,
    pub ops_b: [*const c_void; VCTX_OPS_BEFORE_CREATE_QP_EX - 28],
    pub create_qp_ex: *const c_void,
    pub get_srq_num: *const c_void,
    pub create_srq_ex: *const c_void,
    pub open_xrcd: *const c_void,
    pub close_xrcd: *const c_void,
    pub _abi_placeholder3: u64,
    pub sz: usize,
}

/// `struct verbs_context`: the layout checked against the header (the library's `Ctx` puts
/// a [`VerbsContextHead`] right before its [`IbvContext`] the same way).
#[repr(C)]
pub struct VerbsContext {
    pub head: VerbsContextHead,
    pub context: IbvContext,
}

/// `struct ibv_device_attr`.
#[repr(C)]
pub struct IbvDeviceAttr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: u32,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr`.
#[repr(C)]
#[derive(Default)]
pub struct IbvPortAttr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

impl Default for IbvDeviceAttr {
    fn default() -> Self {
        // SAFETY: plain integers and a char array: all zeroes is a valid value.
        unsafe { std::mem::zeroed() }
    }
}

/// The part of `ibv_port_attr` the exported `ibv_query_port` fills (rdma-core's
/// `_compat_ibv_port_attr`: everything before `port_cap_flags2`).
pub const COMPAT_PORT_ATTR_LEN: usize = std::mem::offset_of!(IbvPortAttr, port_cap_flags2);

/// `struct ibv_gid_entry`.
#[repr(C)]
#[derive(Default)]
pub struct IbvGidEntry {
    pub gid: [u8; 16],
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

/// `IBV_NODE_CA`.
pub const NODE_CA: c_int = 1;
/// `IBV_TRANSPORT_IB`.
pub const TRANSPORT_IB: c_int = 0;
/// `IBV_PORT_DOWN`, `IBV_PORT_ACTIVE`.
pub const PORT_DOWN: c_int = 1;
pub const PORT_ACTIVE: c_int = 4;
/// `IBV_MTU_4096`.
pub const MTU_4096: c_int = 5;
/// `IBV_LINK_LAYER_INFINIBAND`.
pub const LINK_LAYER_INFINIBAND: u8 = 1;
/// `IBV_ATOMIC_HCA`.
pub const ATOMIC_HCA: c_int = 1;
/// `IBV_GID_TYPE_ROCE_V2` (`ibv_gid_entry`) and `IBV_GID_TYPE_SYSFS_ROCE_V2` (the private
/// `ibv_query_gid_type`).
pub const GID_TYPE_ROCE_V2: u32 = 2;
pub const GID_TYPE_SYSFS_ROCE_V2: c_int = 1;

include!(concat!(env!("OUT_DIR"), "/layout_checks.rs"));

/// Gives the exported function `$imp` the public name and version `$ver`
/// (`"ibv_get_device_list@@IBVERBS_1.1"`), as rdma-core's version script does; the nodes are
/// declared by `build.rs`.
macro_rules! symver {
    ($imp:ident, $ver:literal) => {
        core::arch::global_asm!(concat!(".symver ", stringify!($imp), ", ", $ver));
    };
}
pub(crate) use symver;

/// `struct ibv_pd`.
#[repr(C)]
pub struct IbvPd {
    pub context: *mut IbvContext,
    pub handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct IbvMr {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct IbvCompChannel {
    pub context: *mut IbvContext,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_cq`.
#[repr(C)]
pub struct IbvCq {
    pub context: *mut IbvContext,
    pub channel: *mut IbvCompChannel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
pub struct IbvQp {
    pub context: *mut IbvContext,
    pub qp_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_srq`.
#[repr(C)]
pub struct IbvSrq {
    pub context: *mut IbvContext,
    pub srq_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub handle: u32,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_srq_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvSrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

/// `struct ibv_srq_init_attr`.
#[repr(C)]
pub struct IbvSrqInitAttr {
    pub srq_context: *mut c_void,
    pub attr: IbvSrqAttr,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvQpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct IbvQpInitAttr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut c_void,
    pub cap: IbvQpCap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

/// `struct ibv_device_attr_ex`, as far as this library fills it (the rest zero).
#[repr(C)]
pub struct IbvDeviceAttrEx {
    pub orig_attr: IbvDeviceAttr,
    pub comp_mask: u32,
    pub _pad: u32,
    pub _odp_caps: [u8; 24],
    pub completion_timestamp_mask: u64,
    pub hca_core_clock: u64,
    pub _rest: [u8; 120],
}

/// `IBV_WC_EX_WITH_*`: what the completions of a CQ of `ibv_create_cq_ex` carry.
pub mod wc_ex_with {
    /// `IBV_WC_STANDARD_FLAGS`: byte_len, imm, qp_num, src_qp, slid, sl, dlid_path_bits.
    pub const STANDARD: u64 = 0x7f;
    pub const COMPLETION_TIMESTAMP: u64 = 1 << 7;
    pub const COMPLETION_TIMESTAMP_WALLCLOCK: u64 = 1 << 11;
}

/// `IBV_CQ_INIT_ATTR_MASK_FLAGS`.
pub const CQ_INIT_ATTR_MASK_FLAGS: u32 = 1 << 0;
/// `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`.
pub const CREATE_CQ_ATTR_SINGLE_THREADED: u32 = 1 << 0;

/// `struct ibv_cq_init_attr_ex`.
#[repr(C)]
pub struct IbvCqInitAttrEx {
    pub cqe: u32,
    pub cq_context: *mut c_void,
    pub channel: *mut IbvCompChannel,
    pub comp_vector: u32,
    pub wc_flags: u64,
    pub comp_mask: u32,
    pub flags: u32,
    pub parent_domain: *mut IbvPd,
}

/// `struct ibv_cq_ex` after the fields it shares with `struct ibv_cq`: the current
/// completion's status and id, and the polling table the header's inline `ibv_start_poll`,
/// `ibv_next_poll`, `ibv_end_poll` and `ibv_wc_read_*` jump through.
#[repr(C)]
pub struct IbvCqExTail {
    pub comp_mask: u32,
    pub status: c_int,
    pub wr_id: u64,
    pub start_poll: *const c_void,
    pub next_poll: *const c_void,
    pub end_poll: *const c_void,
    pub read_opcode: *const c_void,
    pub read_vendor_err: *const c_void,
    pub read_byte_len: *const c_void,
    pub read_imm_data: *const c_void,
    pub read_qp_num: *const c_void,
    pub read_src_qp: *const c_void,
    pub read_wc_flags: *const c_void,
    pub read_slid: *const c_void,
    pub read_sl: *const c_void,
    pub read_dlid_path_bits: *const c_void,
    pub read_completion_ts: *const c_void,
    pub read_cvlan: *const c_void,
    pub read_flow_tag: *const c_void,
    pub read_tm_info: *const c_void,
    pub read_completion_wallclock_ns: *const c_void,
}

/// `struct ibv_cq_ex`: the layout checked against the header (the library's CQ object puts
/// an [`IbvCqExTail`] right after its [`IbvCq`] the same way).
#[repr(C)]
pub struct IbvCqEx {
    pub base: IbvCq,
    pub tail: IbvCqExTail,
}

/// `struct ibv_async_event`: the object it concerns (a CQ, QP, SRQ pointer, or the port number
/// in the union's first bytes) and `enum ibv_event_type`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IbvAsyncEvent {
    pub element: usize,
    pub event_type: c_int,
}

impl IbvAsyncEvent {
    /// An event of port `port` (or of the device, with 0).
    pub fn port(event_type: u32, port: c_int) -> Self {
        Self {
            element: port as u32 as usize,
            event_type: event_type as c_int,
        }
    }

    /// An event of the object at `p` (a CQ, QP or SRQ of this library).
    pub fn of<T>(event_type: u32, p: *mut T) -> Self {
        Self {
            element: p as usize,
            event_type: event_type as c_int,
        }
    }
}

/// `IBV_QP_INIT_ATTR_PD`.
pub const QP_INIT_ATTR_PD: u32 = 1 << 0;
/// `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`.
pub const QP_INIT_ATTR_SEND_OPS_FLAGS: u32 = 1 << 6;

/// `IBV_QP_EX_WITH_*`: the work requests a QP made with `send_ops_flags` may post through the
/// `ibv_wr_*` calls.
pub mod qp_ex_with {
    pub const RDMA_WRITE: u64 = 1 << 0;
    pub const RDMA_WRITE_WITH_IMM: u64 = 1 << 1;
    pub const SEND: u64 = 1 << 2;
    pub const SEND_WITH_IMM: u64 = 1 << 3;
    pub const RDMA_READ: u64 = 1 << 4;
    pub const ATOMIC_CMP_AND_SWP: u64 = 1 << 5;
    pub const ATOMIC_FETCH_AND_ADD: u64 = 1 << 6;
}

/// `struct ibv_qp_init_attr_ex` (the fields after `sq_sig_all` are read only as far as
/// `comp_mask` says they are valid).
#[repr(C)]
pub struct IbvQpInitAttrEx {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut c_void,
    pub cap: IbvQpCap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
    pub comp_mask: u32,
    pub pd: *mut IbvPd,
    pub xrcd: *mut c_void,
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut c_void,
    pub rx_hash_function: u8,
    pub rx_hash_key_len: u8,
    pub rx_hash_key: *mut u8,
    pub rx_hash_fields_mask: u64,
    pub source_qpn: u32,
    pub send_ops_flags: u64,
}

/// `struct ibv_data_buf` (`ibv_wr_set_inline_data_list`).
#[repr(C)]
pub struct IbvDataBuf {
    pub addr: *mut c_void,
    pub length: usize,
}

/// `struct ibv_qp_ex` after its `struct ibv_qp qp_base`: the request's id and flags the
/// program sets before each builder, and the `ibv_wr_*` table the header's inline calls jump
/// through (a null slot: a builder the QP was not made for).
#[repr(C)]
pub struct IbvQpExTail {
    pub comp_mask: u64,
    pub wr_id: u64,
    pub wr_flags: u32,
    pub wr_atomic_cmp_swp: *const c_void,
    pub wr_atomic_fetch_add: *const c_void,
    pub wr_bind_mw: *const c_void,
    pub wr_local_inv: *const c_void,
    pub wr_rdma_read: *const c_void,
    pub wr_rdma_write: *const c_void,
    pub wr_rdma_write_imm: *const c_void,
    pub wr_send: *const c_void,
    pub wr_send_imm: *const c_void,
    pub wr_send_inv: *const c_void,
    pub wr_send_tso: *const c_void,
    pub wr_set_ud_addr: *const c_void,
    pub wr_set_xrc_srqn: *const c_void,
    pub wr_set_inline_data: *const c_void,
    pub wr_set_inline_data_list: *const c_void,
    pub wr_set_sge: *const c_void,
    pub wr_set_sge_list: *const c_void,
    pub wr_start: *const c_void,
    pub wr_complete: *const c_void,
    pub wr_abort: *const c_void,
    pub wr_atomic_write: *const c_void,
}

/// `struct ibv_qp_ex`: the layout checked against the header (the library's QP object puts
/// an [`IbvQpExTail`] right after its [`IbvQp`] the same way).
#[repr(C)]
pub struct IbvQpEx {
    pub qp_base: IbvQp,
    pub tail: IbvQpExTail,
}

/// `union ibv_gid` (16 bytes, 8-aligned: it also holds two `__be64`).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct IbvGid(pub [u8; 16]);

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvGlobalRoute {
    pub dgid: IbvGid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvAhAttr {
    pub grh: IbvGlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvQpAttr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: IbvQpCap,
    pub ah_attr: IbvAhAttr,
    pub alt_ah_attr: IbvAhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_ah`.
#[repr(C)]
pub struct IbvAh {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub handle: u32,
}

/// `struct ibv_sge`: the engine's [`backplane::verbs::Sge`] has its layout (checked below),
/// so a program's list is used in place.
pub type IbvSge = backplane::verbs::Sge;

/// `wr.rdma` of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvRdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// `wr.atomic` of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvAtomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// `wr.ud` of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvUd {
    pub ah: *mut IbvAh,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// The `wr` union of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union IbvWrUnion {
    pub rdma: IbvRdma,
    pub atomic: IbvAtomic,
    pub ud: IbvUd,
}

/// `struct ibv_send_wr` (the XRC, memory-window bind and TSO members at its end are not
/// read: those operations are refused).
#[repr(C)]
pub struct IbvSendWr {
    pub wr_id: u64,
    pub next: *mut IbvSendWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: u32,
    pub imm_data: u32,
    pub wr: IbvWrUnion,
    pub qp_type: u32,
    pub _bind_mw_tso: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct IbvRecvWr {
    pub wr_id: u64,
    pub next: *mut IbvRecvWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvWc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}
