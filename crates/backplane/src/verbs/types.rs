//! The verbs vocabulary: flags, enums and work-request / work-completion structs, named and
//! numbered as in libibverbs (`IBV_ACCESS_*`, `IBV_WC_*`, `IBV_WR_*`, `IBV_QP_*`, ...), so that
//! code and habits carry over.
#![forbid(unsafe_code)]

use std::fmt;

use crate::fabric::FabricError;
use crate::mem::MemError;

bitflags::bitflags! {
    /// Memory region access (`IBV_ACCESS_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct AccessFlags: u32 {
        /// The local side may write the region (receives, READ results, atomic results).
        const LOCAL_WRITE = 1;
        /// Peers may RDMA_WRITE into the region (granted writable).
        const REMOTE_WRITE = 2;
        /// Peers may RDMA_READ the region (granted read-only unless also remotely writable).
        const REMOTE_READ = 4;
        /// Peers may run atomics on the region (granted writable).
        const REMOTE_ATOMIC = 8;
    }
}

/// The remote-access rule every path applies before it touches a peer's region (RDMA WRITE,
/// READ, atomics, on the fast paths and the general one): the region grants `need`, the
/// QP's peer granted `need` to this QP (`qp_access_flags`), and `[addr, addr + len)` lies
/// inside the region of `region_len` bytes. One function, so the security rule cannot drift
/// between paths.
#[inline(always)]
pub(crate) fn remote_access_allowed(
    region_len: u64,
    region_access: AccessFlags,
    qp_access: AccessFlags,
    need: AccessFlags,
    addr: u64,
    len: u64,
) -> bool {
    remote_flags_allowed(region_access, qp_access, need)
        && addr.checked_add(len).is_some_and(|end| end <= region_len)
}

/// The flags half of [`remote_access_allowed`], for a path whose copy checks the range
/// itself against a span exactly as long as the region (the RDMA WRITE fast path: one range
/// check per write, not two).
#[inline(always)]
pub(crate) fn remote_flags_allowed(
    region_access: AccessFlags,
    qp_access: AccessFlags,
    need: AccessFlags,
) -> bool {
    region_access.contains(need) && qp_access.contains(need)
}

bitflags::bitflags! {
    /// Send work-request flags (`IBV_SEND_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SendFlags: u32 {
        /// Wait for earlier READs and atomics (they complete in order here anyway).
        const FENCE = 1;
        /// Generate a completion on success.
        const SIGNALED = 2;
        /// Ask for a solicited event at the receiver.
        const SOLICITED = 4;
        /// Copy the data at post time; the buffer is free when `post_send` returns.
        const INLINE = 8;
    }
}

bitflags::bitflags! {
    /// Work completion flags (`IBV_WC_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct WcFlags: u32 {
        /// A 40-byte GRH precedes the data in the receive buffer (UD).
        const GRH = 1;
        /// `imm_data` is valid.
        const WITH_IMM = 2;
    }
}

bitflags::bitflags! {
    /// Which attributes `Qp::modify` applies (`IBV_QP_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct QpAttrMask: u32 {
        /// `qp_state`.
        const STATE = 1 << 0;
        /// `cur_qp_state`.
        const CUR_STATE = 1 << 1;
        /// `en_sqd_async_notify`.
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        /// `qp_access_flags`.
        const ACCESS_FLAGS = 1 << 3;
        /// `pkey_index`.
        const PKEY_INDEX = 1 << 4;
        /// `port_num`.
        const PORT = 1 << 5;
        /// `qkey`.
        const QKEY = 1 << 6;
        /// `ah_attr` (the address vector: the remote node).
        const AV = 1 << 7;
        /// `path_mtu`.
        const PATH_MTU = 1 << 8;
        /// `timeout`.
        const TIMEOUT = 1 << 9;
        /// `retry_cnt`.
        const RETRY_CNT = 1 << 10;
        /// `rnr_retry`.
        const RNR_RETRY = 1 << 11;
        /// `rq_psn`.
        const RQ_PSN = 1 << 12;
        /// `max_rd_atomic`.
        const MAX_QP_RD_ATOMIC = 1 << 13;
        /// `alt_ah_attr` (not supported).
        const ALT_PATH = 1 << 14;
        /// `min_rnr_timer`.
        const MIN_RNR_TIMER = 1 << 15;
        /// `sq_psn`.
        const SQ_PSN = 1 << 16;
        /// `max_dest_rd_atomic`.
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        /// `path_mig_state` (not supported).
        const PATH_MIG_STATE = 1 << 18;
        /// `cap`.
        const CAP = 1 << 19;
        /// `dest_qp_num`.
        const DEST_QPN = 1 << 20;
    }
}

/// Queue pair transport (`IBV_QPT_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpType {
    /// Reliable connected: in order, exactly once, every operation.
    Rc = 2,
    /// Unreliable connected: SEND and WRITE only; a message without a receive is dropped.
    Uc = 3,
    /// Unreliable datagram: SEND up to the MTU to any peer QP, addressed by an [`super::Ah`].
    Ud = 4,
}

/// Queue pair state (`IBV_QPS_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum QpState {
    /// Just created or reset: nothing may be posted.
    #[default]
    Reset = 0,
    /// Receives may be posted; nothing is processed.
    Init = 1,
    /// Ready to receive.
    Rtr = 2,
    /// Ready to send.
    Rts = 3,
    /// Send queue drained (not supported as a target state).
    Sqd = 4,
    /// Send queue error (not used: errors take the whole QP to ERR).
    Sqe = 5,
    /// Error: posted work completes with `WR_FLUSH_ERR`.
    Err = 6,
}

/// Path MTU (`IBV_MTU_*`). UD messages are limited to it; RC/UC messages are not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes (the fabric's MTU).
    #[default]
    Mtu4096 = 5,
}

impl Mtu {
    /// The MTU in bytes.
    pub const fn bytes(self) -> u32 {
        128 << self as u32
    }
}

/// Work request opcode (`IBV_WR_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WrOpcode {
    /// One-sided write into a peer's region.
    RdmaWrite = 0,
    /// One-sided write, then a notification that consumes a receive at the peer.
    RdmaWriteWithImm = 1,
    /// Two-sided send into the peer's next posted receive.
    #[default]
    Send = 2,
    /// Send with 32 bits of immediate data.
    SendWithImm = 3,
    /// One-sided read from a peer's region.
    RdmaRead = 4,
    /// 64-bit compare and swap on a peer's region.
    AtomicCmpAndSwp = 5,
    /// 64-bit fetch and add on a peer's region.
    AtomicFetchAndAdd = 6,
}

/// The enums above from libibverbs' numbers (`IBV_QPT_*`, `IBV_QPS_*`, `IBV_MTU_*`,
/// `IBV_WR_*`), for the C API and the drop-in `libibverbs.so.1`: `None` for a number that is
/// not one of them.
macro_rules! from_ibv {
    ($t:ty { $($n:literal => $v:ident),* $(,)? }) => {
        impl $t {
            /// The value libibverbs numbers `v`, if there is one.
            pub const fn from_ibv(v: u32) -> Option<Self> {
                match v {
                    $($n => Some(Self::$v),)*
                    _ => None,
                }
            }
        }
    };
}
from_ibv!(QpType { 2 => Rc, 3 => Uc, 4 => Ud });
from_ibv!(QpState { 0 => Reset, 1 => Init, 2 => Rtr, 3 => Rts, 4 => Sqd, 5 => Sqe, 6 => Err });
from_ibv!(Mtu { 1 => Mtu256, 2 => Mtu512, 3 => Mtu1024, 4 => Mtu2048, 5 => Mtu4096 });
from_ibv!(WrOpcode {
    0 => RdmaWrite,
    1 => RdmaWriteWithImm,
    2 => Send,
    3 => SendWithImm,
    4 => RdmaRead,
    5 => AtomicCmpAndSwp,
    6 => AtomicFetchAndAdd,
});

/// Work completion opcode (`IBV_WC_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WcOpcode {
    /// A SEND or SEND_WITH_IMM completed.
    #[default]
    Send = 0,
    /// An RDMA_WRITE or RDMA_WRITE_WITH_IMM completed.
    RdmaWrite = 1,
    /// An RDMA_READ completed.
    RdmaRead = 2,
    /// A compare-and-swap completed.
    CompSwap = 3,
    /// A fetch-and-add completed.
    FetchAdd = 4,
    /// A receive completed (SEND or SEND_WITH_IMM from the peer).
    Recv = 128,
    /// A receive was consumed by the peer's RDMA_WRITE_WITH_IMM.
    RecvRdmaWithImm = 129,
}

/// libibverbs' text for completion status number `status` (`ibv_wc_status_str`), as a C
/// string for the C API and the drop-in libibverbs; "unknown" outside the table.
pub fn wc_status_cstr(status: i32) -> &'static std::ffi::CStr {
    const S: [&std::ffi::CStr; 22] = [
        c"success",
        c"local length error",
        c"local QP operation error",
        c"local EE context operation error",
        c"local protection error",
        c"Work Request Flushed Error",
        c"memory management operation error",
        c"bad response error",
        c"local access error",
        c"remote invalid request error",
        c"remote access error",
        c"remote operation error",
        c"transport retry counter exceeded",
        c"RNR retry counter exceeded",
        c"local RDD violation error",
        c"remote invalid RD request",
        c"aborted error",
        c"invalid EE context number",
        c"invalid EE context state",
        c"fatal error",
        c"response timeout error",
        c"general error",
    ];
    usize::try_from(status)
        .ok()
        .and_then(|i| S.get(i).copied())
        .unwrap_or(c"unknown")
}

/// Work completion status (`IBV_WC_*`), numbered as in libibverbs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WcStatus {
    /// The work completed.
    #[default]
    Success = 0,
    /// A message was longer than the receive buffer (or a UD send longer than the MTU).
    LocLenErr = 1,
    /// A local QP inconsistency (a peer corrupted the QP's ring).
    LocQpOpErr = 2,
    /// Unused (EE contexts).
    LocEecOpErr = 3,
    /// A local scatter/gather entry names no region of the QP's PD, lies outside it, or
    /// needs LOCAL_WRITE the region lacks.
    LocProtErr = 4,
    /// The QP was in, or went to, ERR: the work was never done.
    WrFlushErr = 5,
    /// Unused (memory windows).
    MwBindErr = 6,
    /// Unused.
    BadRespErr = 7,
    /// Unused.
    LocAccessErr = 8,
    /// The responder could not take the request (its receive buffer was too small).
    RemInvReqErr = 9,
    /// The rkey is unknown, deregistered or not granted; the access lies outside the region;
    /// or the region or the peer QP lacks the access flag.
    RemAccessErr = 10,
    /// The responder could not complete the operation (a bad receive WQE on its side).
    RemOpErr = 11,
    /// The peer stopped answering: its node went DOWN, its process or QP is gone.
    RetryExcErr = 12,
    /// The peer had no receive posted and the RNR retries ran out.
    RnrRetryExcErr = 13,
    /// Unused.
    LocRddViolErr = 14,
    /// Unused.
    RemInvRdReqErr = 15,
    /// Unused.
    RemAbortErr = 16,
    /// Unused.
    InvEecnErr = 17,
    /// Unused.
    InvEecStateErr = 18,
    /// Unused.
    FatalErr = 19,
    /// Unused.
    RespTimeoutErr = 20,
    /// Unused.
    GeneralErr = 21,
}

impl WcStatus {
    /// The text of `ibv_wc_status_str`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::LocLenErr => "local length error",
            Self::LocQpOpErr => "local QP operation error",
            Self::LocEecOpErr => "local EE context operation error",
            Self::LocProtErr => "local protection error",
            Self::WrFlushErr => "Work Request Flushed Error",
            Self::MwBindErr => "memory management operation error",
            Self::BadRespErr => "bad response error",
            Self::LocAccessErr => "local access error",
            Self::RemInvReqErr => "remote invalid request error",
            Self::RemAccessErr => "remote access error",
            Self::RemOpErr => "remote operation error",
            Self::RetryExcErr => "transport retry counter exceeded",
            Self::RnrRetryExcErr => "RNR retry counter exceeded",
            Self::LocRddViolErr => "local RDD violation error",
            Self::RemInvRdReqErr => "remote invalid RD request",
            Self::RemAbortErr => "aborted error",
            Self::InvEecnErr => "invalid EE context number",
            Self::InvEecStateErr => "invalid EE context state",
            Self::FatalErr => "fatal error",
            Self::RespTimeoutErr => "response timeout error",
            Self::GeneralErr => "general error",
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A work completion (`struct ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Wc {
    /// The work request's id.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What completed (valid for successful completions, as in libibverbs).
    pub opcode: WcOpcode,
    /// Always 0.
    pub vendor_err: u32,
    /// Bytes received (receives, including the 40-byte GRH on UD), read or written.
    pub byte_len: u32,
    /// Immediate data, valid with [`WcFlags::WITH_IMM`].
    pub imm_data: u32,
    /// The local QP number.
    pub qp_num: u32,
    /// The sending QP (receives).
    pub src_qp: u32,
    /// [`WcFlags`].
    pub wc_flags: WcFlags,
    /// The sending node's LID, which is its slot (receives).
    pub slid: u16,
    /// Service level (always 0).
    pub sl: u8,
    /// Always 0.
    pub dlid_path_bits: u8,
    /// Always 0.
    pub pkey_index: u16,
}

/// A scatter/gather entry (`struct ibv_sge`, same layout). `addr` names a byte of the region
/// `lkey` by the region's addresses: an offset for regions the library allocated (zero-based,
/// as with `IBV_ACCESS_ZERO_BASED`), the program's own address for memory it registered
/// ([`super::Pd::reg_user_mr`]); [`super::Mr::sge`] makes the right one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct Sge {
    /// Address in the region (`Mr::iova` + offset).
    pub addr: u64,
    /// Bytes.
    pub length: u32,
    /// The region's lkey.
    pub lkey: u32,
}

/// The per-opcode part of a send work request (the `wr` union of `struct ibv_send_wr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WrDetail<'a> {
    /// SEND / SEND_WITH_IMM on RC or UC.
    #[default]
    None,
    /// RDMA_WRITE, RDMA_WRITE_WITH_IMM, RDMA_READ: `remote_addr` is an offset in the peer's
    /// region `rkey`.
    Rdma {
        /// Offset in the remote region.
        remote_addr: u64,
        /// The remote region's rkey.
        rkey: u32,
    },
    /// ATOMIC_*: `remote_addr` is an 8-aligned offset in the peer's region `rkey`.
    Atomic {
        /// Offset in the remote region (8-aligned).
        remote_addr: u64,
        /// Value to compare (CMP_AND_SWP) or to add (FETCH_AND_ADD).
        compare_add: u64,
        /// Value to store if the comparison succeeds (CMP_AND_SWP).
        swap: u64,
        /// The remote region's rkey.
        rkey: u32,
    },
    /// SEND on UD: where to.
    Ud {
        /// Address handle of the destination node.
        ah: &'a super::Ah,
        /// Destination QP number.
        remote_qpn: u32,
        /// Q_Key the destination QP must hold.
        remote_qkey: u32,
    },
}

/// An RDMA_READ or an atomic of one local range, as [`super::Qp::post_one_sided`] takes it:
/// the fields of a [`SendWr`] such a request uses, and nothing else to fill or to read (the
/// drop-in libibverbs hands `ib_read_lat`'s and `ib_atomic_lat`'s requests over so).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OneSided<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// [`WrOpcode::RdmaRead`], [`WrOpcode::AtomicFetchAndAdd`] or
    /// [`WrOpcode::AtomicCmpAndSwp`] (anything else is refused as [`SendWr`] would be).
    pub opcode: WrOpcode,
    /// [`SendFlags`].
    pub send_flags: SendFlags,
    /// Where the data (or the old value) lands.
    pub local: &'a Sge,
    /// Offset in the remote region.
    pub remote_addr: u64,
    /// The remote region's rkey.
    pub rkey: u32,
    /// Value to compare (CMP_AND_SWP) or to add (FETCH_AND_ADD).
    pub compare_add: u64,
    /// Value to store if the comparison succeeds (CMP_AND_SWP).
    pub swap: u64,
}

impl<'a> OneSided<'a> {
    /// The same request as a [`SendWr`].
    pub fn send_wr(&self) -> SendWr<'a> {
        let (remote_addr, rkey) = (self.remote_addr, self.rkey);
        SendWr {
            wr_id: self.wr_id,
            sg_list: std::slice::from_ref(self.local),
            opcode: self.opcode,
            send_flags: self.send_flags,
            imm_data: 0,
            wr: match self.opcode {
                WrOpcode::AtomicFetchAndAdd | WrOpcode::AtomicCmpAndSwp => WrDetail::Atomic {
                    remote_addr,
                    compare_add: self.compare_add,
                    swap: self.swap,
                    rkey,
                },
                _ => WrDetail::Rdma { remote_addr, rkey },
            },
            inline_data: &[],
        }
    }
}

/// A send work request (`struct ibv_send_wr`); post a slice of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Local buffers (gathered for sends and writes, scattered for reads and atomics).
    pub sg_list: &'a [Sge],
    /// What to do.
    pub opcode: WrOpcode,
    /// [`SendFlags`].
    pub send_flags: SendFlags,
    /// Immediate data (`*_WITH_IMM`), in host order.
    pub imm_data: u32,
    /// Remote address, atomic operands, or UD destination.
    pub wr: WrDetail<'a>,
    /// With [`SendFlags::INLINE`]: the payload itself, from any memory, copied at post time
    /// (used instead of `sg_list` when non-empty).
    pub inline_data: &'a [u8],
}

impl<'a> SendWr<'a> {
    /// A SEND of `sg_list`.
    pub fn send(wr_id: u64, sg_list: &'a [Sge]) -> Self {
        Self {
            wr_id,
            sg_list,
            opcode: WrOpcode::Send,
            ..Self::default()
        }
    }

    /// An inline SEND of `data` (any memory; copied at post time).
    pub fn send_inline(wr_id: u64, data: &'a [u8]) -> Self {
        Self {
            wr_id,
            opcode: WrOpcode::Send,
            send_flags: SendFlags::INLINE,
            inline_data: data,
            ..Self::default()
        }
    }

    /// An RDMA_WRITE of `sg_list` to `remote_addr` in region `rkey`.
    pub fn write(wr_id: u64, sg_list: &'a [Sge], remote_addr: u64, rkey: u32) -> Self {
        Self {
            wr_id,
            sg_list,
            opcode: WrOpcode::RdmaWrite,
            wr: WrDetail::Rdma { remote_addr, rkey },
            ..Self::default()
        }
    }

    /// An RDMA_READ from `remote_addr` in region `rkey` into `sg_list`.
    pub fn read(wr_id: u64, sg_list: &'a [Sge], remote_addr: u64, rkey: u32) -> Self {
        Self {
            wr_id,
            sg_list,
            opcode: WrOpcode::RdmaRead,
            wr: WrDetail::Rdma { remote_addr, rkey },
            ..Self::default()
        }
    }

    /// An ATOMIC_FETCH_AND_ADD of `add` at `remote_addr`; the old value lands in `sge`.
    pub fn fetch_add(wr_id: u64, sge: &'a [Sge], remote_addr: u64, rkey: u32, add: u64) -> Self {
        Self {
            wr_id,
            sg_list: sge,
            opcode: WrOpcode::AtomicFetchAndAdd,
            wr: WrDetail::Atomic {
                remote_addr,
                compare_add: add,
                swap: 0,
                rkey,
            },
            ..Self::default()
        }
    }

    /// An ATOMIC_CMP_AND_SWP: if the word at `remote_addr` equals `compare`, store `swap`;
    /// the old value lands in `sge`.
    pub fn cmp_swap(
        wr_id: u64,
        sge: &'a [Sge],
        remote_addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    ) -> Self {
        Self {
            wr_id,
            sg_list: sge,
            opcode: WrOpcode::AtomicCmpAndSwp,
            wr: WrDetail::Atomic {
                remote_addr,
                compare_add: compare,
                swap,
                rkey,
            },
            ..Self::default()
        }
    }

    /// Sets the opcode (for example to a `*_WITH_IMM` one) and the immediate data.
    pub fn with_imm(mut self, imm: u32) -> Self {
        self.opcode = match self.opcode {
            WrOpcode::RdmaWrite => WrOpcode::RdmaWriteWithImm,
            WrOpcode::Send => WrOpcode::SendWithImm,
            o => o,
        };
        self.imm_data = imm;
        self
    }

    /// Adds [`SendFlags::SIGNALED`].
    pub fn signaled(mut self) -> Self {
        self.send_flags |= SendFlags::SIGNALED;
        self
    }

    /// Adds `flags`.
    pub fn flags(mut self, flags: SendFlags) -> Self {
        self.send_flags |= flags;
        self
    }

    /// Addresses a UD send.
    pub fn ud(mut self, ah: &'a super::Ah, remote_qpn: u32, remote_qkey: u32) -> Self {
        self.wr = WrDetail::Ud {
            ah,
            remote_qpn,
            remote_qkey,
        };
        self
    }
}

/// A receive work request (`struct ibv_recv_wr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecvWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where the message lands (regions need LOCAL_WRITE).
    pub sg_list: &'a [Sge],
}

/// Queue sizes (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCap {
    /// Outstanding send work requests.
    pub max_send_wr: u32,
    /// Outstanding receive work requests.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive.
    pub max_recv_sge: u32,
    /// Largest inline payload.
    pub max_inline_data: u32,
}

impl Default for QpCap {
    fn default() -> Self {
        Self {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 256,
        }
    }
}

impl QpCap {
    /// The C interfaces' reading of a request: a work-request or scatter/gather count of 0
    /// takes the default; `max_inline_data` is as given (0: no inline data).
    pub fn zero_counts_default(self) -> Self {
        let d = Self::default();
        let or = |v: u32, d: u32| if v == 0 { d } else { v };
        Self {
            max_send_wr: or(self.max_send_wr, d.max_send_wr),
            max_recv_wr: or(self.max_recv_wr, d.max_recv_wr),
            max_send_sge: or(self.max_send_sge, d.max_send_sge),
            max_recv_sge: or(self.max_recv_sge, d.max_recv_sge),
            max_inline_data: self.max_inline_data,
        }
    }
}

/// Address vector (`struct ibv_ah_attr`): on the fabric a node's LID is its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AhAttr {
    /// Destination LID = destination node's slot.
    pub dlid: u16,
    /// Service level (ignored).
    pub sl: u8,
    /// Source path bits (ignored).
    pub src_path_bits: u8,
    /// Static rate (ignored).
    pub static_rate: u8,
    /// Global routing (ignored: one fabric is one subnet).
    pub is_global: bool,
    /// Port (must be 1).
    pub port_num: u8,
}

/// QP attributes (`struct ibv_qp_attr`); `Qp::modify` applies those named by the mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAttr {
    /// Target state.
    pub qp_state: QpState,
    /// Expected current state (with [`QpAttrMask::CUR_STATE`]).
    pub cur_qp_state: QpState,
    /// Path MTU.
    pub path_mtu: Mtu,
    /// Q_Key (UD).
    pub qkey: u32,
    /// Receive PSN.
    pub rq_psn: u32,
    /// Send PSN.
    pub sq_psn: u32,
    /// Remote QP number (RC/UC).
    pub dest_qp_num: u32,
    /// Remote operations this QP accepts as a responder (REMOTE_WRITE/READ/ATOMIC).
    pub qp_access_flags: AccessFlags,
    /// Queue sizes (query only).
    pub cap: QpCap,
    /// The remote node (RC/UC).
    pub ah_attr: AhAttr,
    /// Partition key index (must be 0).
    pub pkey_index: u16,
    /// SQ drain notification (ignored).
    pub en_sqd_async_notify: u8,
    /// Outstanding RDMA reads / atomics as initiator.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA reads / atomics as responder.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer this QP asks its peer to wait (IB encoding 0..31; 12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// Port (must be 1).
    pub port_num: u8,
    /// Local ACK timeout (IB encoding; recorded, the fabric does not lose packets).
    pub timeout: u8,
    /// Transport retries (recorded, the fabric does not lose packets).
    pub retry_cnt: u8,
    /// RNR retries (0..7; 7 = forever).
    pub rnr_retry: u8,
}

/// `IBV_ATOMIC_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicCap {
    /// No atomics.
    None,
    /// Atomic within this device only.
    Hca,
    /// Atomic with respect to every access to the memory (CPU atomics on shared memory).
    Glob,
}

/// What the device offers (`struct ibv_device_attr`, the fields that mean something here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version: the crate version.
    pub fw_ver: String,
    /// Node GUID (fabric-derived).
    pub node_guid: u64,
    /// Largest region.
    pub max_mr_size: u64,
    /// Page sizes (4 KiB).
    pub page_size_cap: u64,
    /// Outstanding work requests per queue.
    pub max_qp_wr: u32,
    /// Scatter/gather entries per work request.
    pub max_sge: u32,
    /// Entries per completion queue.
    pub max_cqe: u32,
    /// Outstanding READs/atomics per QP.
    pub max_qp_rd_atom: u32,
    /// Atomic guarantees.
    pub atomic_cap: AtomicCap,
    /// Physical ports.
    pub phys_port_cnt: u8,
}

/// Port state (`IBV_PORT_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// The node is not READY.
    Down = 1,
    /// The node is READY.
    Active = 4,
}

/// A port's attributes (`struct ibv_port_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// State.
    pub state: PortState,
    /// Largest MTU.
    pub max_mtu: Mtu,
    /// Active MTU.
    pub active_mtu: Mtu,
    /// LID: the node's slot.
    pub lid: u16,
    /// Largest message.
    pub max_msg_sz: u32,
}

/// What went wrong with a verbs call (the `errno` a libibverbs call would return).
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// Occurs when an argument, attribute mask or state transition is not allowed, or the QP's
    /// state does not allow the call (`EINVAL`).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Occurs when a queue is full (`ENOMEM`): too many outstanding work requests.
    #[error("queue full: {0}")]
    QueueFull(String),
    /// Occurs when a work request of a posted list is refused; earlier ones were posted
    /// (`bad_wr` in libibverbs).
    #[error("work request {bad_wr} refused: {source}")]
    Post {
        /// Index of the first refused work request.
        bad_wr: usize,
        /// Why.
        source: Box<VerbsError>,
    },
    /// Occurs when nothing happened within the time asked for (`ETIMEDOUT`).
    #[error("timed out")]
    TimedOut,
    /// Occurs when the connection helper's peer refuses or answers garbage.
    #[error("connection refused: {0}")]
    Refused(String),
    /// Occurs when the control plane fails (fabric gone, node not READY, ...).
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// Occurs when shared memory cannot be created or mapped.
    #[error(transparent)]
    Mem(#[from] MemError),
    /// Occurs when an OS call fails (eventfd, thread).
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl VerbsError {
    pub(crate) fn inval(m: impl Into<String>) -> Self {
        Self::InvalidArgument(m.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_access_needs_the_region_the_qp_and_the_bounds_to_agree() {
        use AccessFlags as A;
        let rw = A::REMOTE_WRITE | A::REMOTE_READ;
        assert!(remote_access_allowed(
            4096,
            rw,
            rw,
            A::REMOTE_WRITE,
            0,
            4096
        ));
        assert!(remote_access_allowed(4096, rw, rw, A::REMOTE_READ, 4095, 1));
        assert!(remote_access_allowed(4096, rw, rw, A::REMOTE_READ, 4096, 0));
        // The region does not grant it, the QP was not given it, or it runs past the end.
        assert!(!remote_access_allowed(
            4096,
            A::REMOTE_READ,
            rw,
            A::REMOTE_WRITE,
            0,
            8
        ));
        assert!(!remote_access_allowed(
            4096,
            rw,
            A::REMOTE_READ,
            A::REMOTE_WRITE,
            0,
            8
        ));
        assert!(!remote_access_allowed(
            4096,
            rw,
            rw,
            A::REMOTE_WRITE,
            4090,
            8
        ));
        assert!(!remote_access_allowed(
            4096,
            rw,
            rw,
            A::REMOTE_WRITE,
            u64::MAX,
            2
        ));
        assert!(!remote_access_allowed(4096, rw, rw, A::REMOTE_ATOMIC, 0, 8));
    }
}
