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

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::{AsFd, AsRawFd};
use std::ptr::{null_mut, NonNull};
use std::sync::{Mutex, OnceLock};
use std::thread::ThreadId;
use std::time::Duration;

use backplane::verbs::cm::{self, ConnParam, Listener, PeerInfo};
use backplane::verbs::{
    AccessFlags, Ah, AhAttr, CompChannel, Context, Cq, Mr, Mtu, Pd, Qp, QpAttr, QpAttrMask, QpCap,
    QpInitAttr, QpState, QpType, RecvWr, SendFlags, SendWr, Sge, VerbsError, Wc, WrDetail,
    WrOpcode,
};

use crate::{bad_handle, fabric_errno, get_fabric, guard, BpFabric, CErr};

// ---------------------------------------------------------------------------------------------
// C structs (mirrors of verbs.h; sizes checked at compile time).
// ---------------------------------------------------------------------------------------------

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
    /// Always NULL.
    pub srq: *mut c_void,
    /// Serial number.
    pub handle: u32,
    /// QP number.
    pub qp_num: u32,
    /// State as of the last modify.
    pub state: u32,
    /// Transport.
    pub qp_type: u32,
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
    /// Must be NULL.
    pub srq: *mut c_void,
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
    assert!(size_of::<BpConnParam>() == 40);
    assert!(size_of::<BpPeerInfo>() == 96);
};

// ---------------------------------------------------------------------------------------------
// The thread-local registry.
// ---------------------------------------------------------------------------------------------

/// A struct handed to C: allocated here, freed here, never borrowed by Rust across calls
/// (C may write its `*_context` fields at any time between calls).
pub(crate) struct Owned<T>(NonNull<T>);

impl<T> Owned<T> {
    pub(crate) fn new(v: T) -> Self {
        Self(NonNull::from(Box::leak(Box::new(v))))
    }
    pub(crate) fn ptr(&self) -> *mut T {
        self.0.as_ptr()
    }
    pub(crate) fn key(&self) -> usize {
        self.0.as_ptr() as usize
    }
}

/// How many destroyed handle structs are kept before their memory goes back to the allocator.
/// A freed struct's address would otherwise soon come back for the next object of the same
/// size, and a stale handle would then name that new object instead of failing with EBADF.
const QUARANTINE: usize = 4096;

/// Destroyed handle structs, oldest first, with the function that frees each.
fn quarantine() -> std::sync::MutexGuard<'static, std::collections::VecDeque<(usize, Free)>> {
    static Q: OnceLock<Mutex<std::collections::VecDeque<(usize, Free)>>> = OnceLock::new();
    Q.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

type Free = unsafe fn(usize);

/// # Safety
/// `p` came from `Box::leak` of a `Box<T>` and is freed once.
unsafe fn free_boxed<T>(p: usize) {
    // SAFETY: caller contract.
    drop(unsafe { Box::from_raw(p as *mut T) });
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        let oldest = {
            let mut q = quarantine();
            q.push_back((self.0.as_ptr() as usize, free_boxed::<T> as Free));
            if q.len() > QUARANTINE {
                q.pop_front()
            } else {
                None
            }
        };
        if let Some((p, free)) = oldest {
            // SAFETY: every entry is a leaked box of the type its function frees, queued once
            // by the drop of the one `Owned` that held it.
            unsafe { free(p) };
        }
    }
}

pub(crate) struct CtxObj {
    _c: Owned<BpContext>,
    pub(crate) ctx: Context,
}
pub(crate) struct PdObj {
    _c: Owned<BpPd>,
    pd: Pd,
    ctx: usize,
}
pub(crate) struct MrObj {
    _c: Owned<BpMr>,
    _mr: Mr,
    pd: usize,
    ctx: usize,
    key: u32,
}
pub(crate) struct ChObj {
    c: Owned<BpCompChannel>,
    ch: CompChannel,
    ctx: usize,
}
pub(crate) struct CqObj {
    c: Owned<BpCq>,
    cq: Cq,
    ctx: usize,
    channel: usize,
    unacked: Cell<u32>,
}
pub(crate) struct QpObj {
    c: Owned<BpQp>,
    qp: Qp,
    pd: usize,
    ctx: usize,
    send_cq: usize,
    recv_cq: usize,
    sq_sig_all: bool,
}
pub(crate) struct AhObj {
    _c: Owned<BpAh>,
    ah: Ah,
    pd: usize,
}
pub(crate) struct ListenerObj {
    _c: Owned<BpListener>,
    l: RefCell<Listener>,
    ctx: usize,
}

pub(crate) enum VObj {
    Ctx(CtxObj),
    Pd(PdObj),
    Mr(MrObj),
    Channel(ChObj),
    Cq(CqObj),
    Qp(QpObj),
    Ah(AhObj),
    Listener(ListenerObj),
    /// A raw-DMA queue (`dma.h`): it uses its context, so it lives in the same registry.
    DmaQueue(crate::dma::DmaQueueObj),
}

impl VObj {
    /// The handles this object depends on (which cannot be destroyed before it).
    fn parents(&self) -> [usize; 4] {
        match self {
            VObj::Ctx(_) => [0; 4],
            VObj::Pd(p) => [p.ctx, 0, 0, 0],
            VObj::Mr(m) => [m.ctx, m.pd, 0, 0],
            VObj::Channel(c) => [c.ctx, 0, 0, 0],
            VObj::Cq(c) => [c.ctx, c.channel, 0, 0],
            VObj::Qp(q) => [q.ctx, q.pd, q.send_cq, q.recv_cq],
            VObj::Ah(a) => [a.pd, 0, 0, 0],
            VObj::Listener(l) => [l.ctx, 0, 0, 0],
            VObj::DmaQueue(q) => [q.ctx, 0, 0, 0],
        }
    }
}

/// Handle-keyed maps hash with FxHash: the keys are our own numbers and lkeys (not
/// attacker-chosen), and SipHash costs more than the rest of a `bp_poll_cq` lookup.
type FastMap<K, V> = rustc_hash::FxHashMap<K, V>;

/// Who owns a handle: for the "another thread" error and for `bp_fabric_detach`.
struct Owner {
    thread: ThreadId,
    /// The fabric handle (contexts only; 0 otherwise).
    fabric: usize,
}

fn owners() -> std::sync::MutexGuard<'static, HashMap<usize, Owner>> {
    static O: OnceLock<Mutex<HashMap<usize, Owner>>> = OnceLock::new();
    O.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

pub(crate) struct Local {
    thread: ThreadId,
    objs: FastMap<usize, VObj>,
    /// (context, lkey) -> (address, length) of this thread's regions, to turn pointers in
    /// scatter/gather entries into offsets.
    mrs: FastMap<(usize, u32), (usize, usize)>,
    serial: u32,
    /// `bp_poll_cq`'s staging buffer, kept so a spinning poll does not clear 768 B each time.
    wcs: RefCell<[Wc; 16]>,
}

impl Local {
    pub(crate) fn insert(&mut self, key: usize, obj: VObj, fabric: usize) {
        owners().insert(
            key,
            Owner {
                thread: self.thread,
                fabric,
            },
        );
        self.objs.insert(key, obj);
    }

    pub(crate) fn serial(&mut self) -> u32 {
        self.serial = self.serial.wrapping_add(1);
        self.serial
    }

    pub(crate) fn get(&self, h: usize, what: &str) -> Result<&VObj, CErr> {
        if let Some(o) = self.objs.get(&h) {
            return Ok(o);
        }
        if h != 0 && owners().get(&h).is_some_and(|o| o.thread != self.thread) {
            return Err(CErr(
                libc::EPERM,
                format!(
                    "the {what} belongs to another thread: verbs objects are used only from \
                     the thread that opened their context (open one context per thread)"
                ),
            ));
        }
        Err(bad_handle(what))
    }

    /// Removes `h` unless another object still depends on it (EBUSY, naming `users`).
    pub(crate) fn remove(&mut self, h: usize, users: &str) -> Result<VObj, CErr> {
        if self.objs.values().any(|o| o.parents().contains(&h)) {
            return Err(CErr(libc::EBUSY, format!("destroy its {users} first")));
        }
        owners().remove(&h);
        Ok(self.objs.remove(&h).expect("looked up before"))
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        // The thread is exiting with objects still alive: forget them globally and drop them
        // here, children first (QPs, MRs, AHs, listeners; then CQs; channels and PDs; contexts).
        let keys: Vec<usize> = self.objs.keys().copied().collect();
        {
            let mut o = owners();
            for k in &keys {
                o.remove(k);
            }
        }
        let objs = std::mem::take(&mut self.objs);
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let mut v: Vec<VObj> = objs.into_values().collect();
            v.sort_by_key(|o| match o {
                VObj::Qp(_) | VObj::Mr(_) | VObj::Ah(_) | VObj::Listener(_) | VObj::DmaQueue(_) => {
                    0
                }
                VObj::Cq(_) => 1,
                VObj::Channel(_) | VObj::Pd(_) => 2,
                VObj::Ctx(_) => 3,
            });
            drop(v);
        }));
    }
}

thread_local! {
    static LOCAL: RefCell<Local> = RefCell::new(Local {
        thread: std::thread::current().id(),
        objs: FastMap::default(),
        mrs: FastMap::default(),
        serial: 0,
        wcs: RefCell::new([Wc::default(); 16]),
    });
}

/// Runs `f` on this thread's registry.
pub(crate) fn local<R>(f: impl FnOnce(&mut Local) -> Result<R, CErr>) -> Result<R, CErr> {
    LOCAL
        .try_with(|l| f(&mut l.borrow_mut()))
        .unwrap_or_else(|_| Err(CErr(libc::EPERM, "this thread is exiting".into())))
}

/// True while a verbs context opened on fabric handle `fabric` is alive (any thread).
pub(crate) fn fabric_in_use(fabric: usize) -> bool {
    owners().values().any(|o| o.fabric == fabric)
}

macro_rules! getter {
    ($name:ident, $var:ident, $ty:ty, $what:literal) => {
        pub(crate) fn $name(l: &Local, h: usize) -> Result<&$ty, CErr> {
            match l.get(h, $what)? {
                VObj::$var(o) => Ok(o),
                _ => Err(bad_handle($what)),
            }
        }
    };
}
getter!(get_ctx, Ctx, CtxObj, "context");
getter!(get_pd, Pd, PdObj, "protection domain");
getter!(get_mr, Mr, MrObj, "memory region");
getter!(get_ch, Channel, ChObj, "completion channel");
getter!(get_cq, Cq, CqObj, "completion queue");
getter!(get_qp, Qp, QpObj, "queue pair");
getter!(get_ah, Ah, AhObj, "address handle");
getter!(get_listener, Listener, ListenerObj, "listener");

// ---------------------------------------------------------------------------------------------
// Errors and entry-point guards.
// ---------------------------------------------------------------------------------------------

fn verbs_errno(e: &VerbsError) -> c_int {
    match e {
        VerbsError::InvalidArgument(_) => libc::EINVAL,
        VerbsError::QueueFull(_) => libc::ENOMEM,
        VerbsError::Post { source, .. } => verbs_errno(source),
        VerbsError::TimedOut => libc::ETIMEDOUT,
        VerbsError::Refused(_) => libc::ECONNREFUSED,
        VerbsError::Fabric(f) => fabric_errno(f),
        VerbsError::Mem(_) => libc::ENOMEM,
        VerbsError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
    }
}

impl From<VerbsError> for CErr {
    fn from(e: VerbsError) -> Self {
        CErr(verbs_errno(&e), e.to_string())
    }
}

fn inval(m: impl Into<String>) -> CErr {
    CErr(libc::EINVAL, m.into())
}

/// libibverbs' int convention: 0, or the errno value (errno is set as well).
fn guard_rc(f: impl FnOnce() -> Result<(), CErr>) -> c_int {
    let mut code = 0;
    let r = guard(-1, || f().map(|()| 0).inspect_err(|e| code = e.0));
    match r {
        0 => 0,
        // A panic (guard set EIO) leaves `code` at 0.
        _ if code == 0 => libc::EIO,
        _ => code,
    }
}

pub(crate) fn ms(timeout_ms: c_int) -> Result<Option<Duration>, CErr> {
    match timeout_ms {
        -1 => Ok(None),
        t if t >= 0 => Ok(Some(Duration::from_millis(t as u64))),
        t => Err(inval(format!("timeout {t} ms: use -1 (forever) or >= 0"))),
    }
}

// ---------------------------------------------------------------------------------------------
// Conversions.
// ---------------------------------------------------------------------------------------------

fn qp_state(v: u32) -> Result<QpState, CErr> {
    Ok(match v {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        4 => QpState::Sqd,
        5 => QpState::Sqe,
        6 => QpState::Err,
        v => return Err(inval(format!("QP state {v} is not a BP_QPS_* value"))),
    })
}

fn qp_type(v: u32) -> Result<QpType, CErr> {
    Ok(match v {
        2 => QpType::Rc,
        3 => QpType::Uc,
        4 => QpType::Ud,
        v => return Err(inval(format!("QP type {v}: use BP_QPT_RC, _UC or _UD"))),
    })
}

fn mtu(v: u32) -> Result<Mtu, CErr> {
    Ok(match v {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        5 => Mtu::Mtu4096,
        v => return Err(inval(format!("path MTU {v} is not a BP_MTU_* value"))),
    })
}

fn access(v: c_uint) -> Result<AccessFlags, CErr> {
    const ZERO_BASED: u32 = 1 << 5;
    let known = 0xf | ZERO_BASED;
    if v & !known != 0 {
        return Err(inval(format!(
            "access flags {v:#x}: only LOCAL_WRITE, REMOTE_WRITE/READ/ATOMIC and ZERO_BASED exist"
        )));
    }
    Ok(AccessFlags::from_bits_retain(v & 0xf))
}

fn wr_opcode(v: u32) -> Result<WrOpcode, CErr> {
    Ok(match v {
        0 => WrOpcode::RdmaWrite,
        1 => WrOpcode::RdmaWriteWithImm,
        2 => WrOpcode::Send,
        3 => WrOpcode::SendWithImm,
        4 => WrOpcode::RdmaRead,
        5 => WrOpcode::AtomicCmpAndSwp,
        6 => WrOpcode::AtomicFetchAndAdd,
        v => return Err(inval(format!("opcode {v} is not a BP_WR_* value"))),
    })
}

fn cap_in(c: BpQpCap) -> QpCap {
    let d = QpCap::default();
    let or = |v: u32, d: u32| if v == 0 { d } else { v };
    QpCap {
        max_send_wr: or(c.max_send_wr, d.max_send_wr),
        max_recv_wr: or(c.max_recv_wr, d.max_recv_wr),
        max_send_sge: or(c.max_send_sge, d.max_send_sge),
        max_recv_sge: or(c.max_recv_sge, d.max_recv_sge),
        max_inline_data: c.max_inline_data,
    }
}

fn cap_out(c: QpCap) -> BpQpCap {
    BpQpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

fn ah_in(a: &BpAhAttr) -> AhAttr {
    AhAttr {
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: a.is_global != 0,
        port_num: a.port_num,
    }
}

fn ah_out(a: &AhAttr) -> BpAhAttr {
    BpAhAttr {
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: u8::from(a.is_global),
        port_num: a.port_num,
    }
}

fn wc_out(w: &Wc) -> BpWc {
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
struct SgeBuf {
    small: [Sge; 4],
    n: usize,
    heap: Vec<Sge>,
}

impl SgeBuf {
    fn new() -> Self {
        Self {
            small: [Sge::default(); 4],
            n: 0,
            heap: Vec::new(),
        }
    }
    fn push(&mut self, s: Sge) {
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
    fn as_slice(&self) -> &[Sge] {
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
unsafe fn sges(l: &Local, ctx: usize, sg: *const BpSge, n: c_int) -> Result<SgeBuf, CErr> {
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
unsafe fn walk<T>(first: *mut T, next: impl Fn(*mut T) -> *mut T, max: usize) -> Vec<*mut T> {
    let mut v = Vec::new();
    let mut p = first;
    while !p.is_null() && v.len() < max {
        v.push(p);
        p = next(p);
    }
    v
}

/// Longest work-request list one post walks (the longest queue, plus one to be refused).
const MAX_LIST: usize = (1 << 16) + 1;

// ---------------------------------------------------------------------------------------------
// Device, PD, MR.
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Completion channels and CQs.
// ---------------------------------------------------------------------------------------------

/// `bp_create_comp_channel`.
#[no_mangle]
pub extern "C" fn bp_create_comp_channel(context: *mut BpContext) -> *mut BpCompChannel {
    guard(null_mut(), || {
        local(|l| {
            let ch = get_ctx(l, context as usize)?.ctx.create_comp_channel()?;
            let c = Owned::new(BpCompChannel {
                context,
                fd: ch.as_fd().as_raw_fd(),
                refcnt: 0,
            });
            let p = c.ptr();
            let ctx = context as usize;
            l.insert(c.key(), VObj::Channel(ChObj { c, ch, ctx }), 0);
            Ok(p)
        })
    })
}

/// `bp_destroy_comp_channel`.
#[no_mangle]
pub extern "C" fn bp_destroy_comp_channel(channel: *mut BpCompChannel) -> c_int {
    guard_rc(|| {
        local(|l| {
            get_ch(l, channel as usize)?;
            l.remove(channel as usize, "completion queues")?;
            Ok(())
        })
    })
}

/// `bp_get_cq_event`: blocks until an event; 0 or -1 with errno.
///
/// # Safety
/// `cq` and `cq_context` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn bp_get_cq_event(
    channel: *mut BpCompChannel,
    cq: *mut *mut BpCq,
    cq_context: *mut *mut c_void,
) -> c_int {
    guard(-1, || {
        local(|l| {
            let ch = get_ch(l, channel as usize)?;
            loop {
                let ev = ch.ch.get_cq_event(None)?;
                let found = l.objs.values().find_map(|o| match o {
                    VObj::Cq(c) if c.channel == channel as usize && c.cq.id() == ev.cq_id => {
                        Some(c)
                    }
                    _ => None,
                });
                let Some(c) = found else {
                    continue; // an event for a CQ destroyed since: not the caller's
                };
                c.unacked.set(c.unacked.get().saturating_add(1));
                let p = c.c.ptr();
                if !cq.is_null() {
                    // SAFETY: non-null, and the caller promises it is writable.
                    unsafe { cq.write(p) };
                }
                if !cq_context.is_null() {
                    // SAFETY: `p` is live (registered); C may have written the field, so it
                    // is read through the pointer. `cq_context` is writable (caller).
                    unsafe { cq_context.write((*p).cq_context) };
                }
                return Ok(0);
            }
        })
    })
}

/// `bp_ack_cq_events`.
#[no_mangle]
pub extern "C" fn bp_ack_cq_events(cq: *mut BpCq, nevents: c_uint) {
    guard((), || {
        local(|l| {
            let c = get_cq(l, cq as usize)?;
            c.unacked.set(c.unacked.get().saturating_sub(nevents));
            Ok(())
        })
    })
}

/// `bp_create_cq`.
#[no_mangle]
pub extern "C" fn bp_create_cq(
    context: *mut BpContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut BpCompChannel,
    comp_vector: c_int,
) -> *mut BpCq {
    guard(null_mut(), || {
        local(|l| {
            let c = get_ctx(l, context as usize)?;
            if comp_vector != 0 {
                return Err(inval(format!(
                    "comp_vector {comp_vector}: there is one (0)"
                )));
            }
            if cqe <= 0 {
                return Err(inval(format!("cqe {cqe} is not 1..=4194304")));
            }
            let ch = if channel.is_null() {
                None
            } else {
                let ch = get_ch(l, channel as usize)?;
                if ch.ctx != context as usize {
                    return Err(inval("the completion channel belongs to another context"));
                }
                Some(ch)
            };
            let cq = c.ctx.create_cq(cqe as usize, ch.map(|c| &c.ch))?;
            if let Some(ch) = ch {
                // SAFETY: the channel is live (registered); only counters C reads are changed.
                unsafe { (*ch.c.ptr()).refcnt += 1 };
            }
            let h = Owned::new(BpCq {
                context,
                channel,
                cq_context,
                handle: l.serial(),
                cqe,
            });
            let p = h.ptr();
            l.insert(
                h.key(),
                VObj::Cq(CqObj {
                    c: h,
                    cq,
                    ctx: context as usize,
                    channel: channel as usize,
                    unacked: Cell::new(0),
                }),
                0,
            );
            Ok(p)
        })
    })
}

/// `bp_destroy_cq`.
#[no_mangle]
pub extern "C" fn bp_destroy_cq(cq: *mut BpCq) -> c_int {
    guard_rc(|| {
        local(|l| {
            let c = get_cq(l, cq as usize)?;
            if c.unacked.get() > 0 {
                return Err(CErr(
                    libc::EBUSY,
                    format!(
                        "{} completion events of this CQ are not acknowledged (bp_ack_cq_events)",
                        c.unacked.get()
                    ),
                ));
            }
            let channel = c.channel;
            l.remove(cq as usize, "queue pairs")?;
            if let Ok(ch) = get_ch(l, channel) {
                // SAFETY: the channel is live (registered).
                unsafe { (*ch.c.ptr()).refcnt -= 1 };
            }
            Ok(())
        })
    })
}

/// `bp_req_notify_cq`.
#[no_mangle]
pub extern "C" fn bp_req_notify_cq(cq: *mut BpCq, solicited_only: c_int) -> c_int {
    guard_rc(|| {
        local(|l| {
            get_cq(l, cq as usize)?.cq.req_notify(solicited_only != 0)?;
            Ok(())
        })
    })
}

/// `bp_poll_cq`: a count, or -1 with errno.
///
/// # Safety
/// `wc` points to `num_entries` writable `struct bp_wc` (or `num_entries` is 0).
#[no_mangle]
pub unsafe extern "C" fn bp_poll_cq(cq: *mut BpCq, num_entries: c_int, wc: *mut BpWc) -> c_int {
    guard(-1, || {
        local(|l| {
            let c = get_cq(l, cq as usize)?;
            if num_entries < 0 || (num_entries > 0 && wc.is_null()) {
                return Err(inval("num_entries < 0, or wc is NULL"));
            }
            let over = c.cq.overruns();
            if over > 0 {
                return Err(CErr(
                    libc::EOVERFLOW,
                    format!(
                        "CQ overrun: {over} completions arrived while it held its {} entries; \
                         it is in error (as after IBV_EVENT_CQ_ERR): destroy it and size CQs \
                         for every outstanding signaled work request",
                        // SAFETY: the CQ struct is live (registered).
                        unsafe { (*c.c.ptr()).cqe }
                    ),
                ));
            }
            let mut buf = l.wcs.borrow_mut();
            let mut n = 0usize;
            let want = num_entries as usize;
            if want == 0 {
                // Nothing to take, but the poll still moves the CQ's QPs along.
                c.cq.poll(&mut []);
            }
            while n < want {
                let k = c.cq.poll(&mut buf[..(want - n).min(16)]);
                for (i, w) in buf[..k].iter().enumerate() {
                    // SAFETY: n + i < num_entries, and the caller promises that many entries.
                    unsafe { wc.add(n + i).write(wc_out(w)) };
                }
                n += k;
                if k < 16 {
                    break;
                }
            }
            Ok(n as c_int)
        })
    })
}

// ---------------------------------------------------------------------------------------------
// QPs and AHs.
// ---------------------------------------------------------------------------------------------

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
            if !a.srq.is_null() {
                return Err(inval(
                    "shared receive queues are not supported: srq must be NULL",
                ));
            }
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
                srq: null_mut(),
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

fn set_state(q: &QpObj) {
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
                        srq: null_mut(),
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
struct OwnedSend {
    wr_id: u64,
    opcode: WrOpcode,
    flags: SendFlags,
    imm: u32,
    sges: SgeBuf,
    inline: Vec<u8>,
    detail: OwnedDetail,
}

enum OwnedDetail {
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
unsafe fn read_send(l: &Local, q: &QpObj, w: *const BpSendWr) -> Result<OwnedSend, CErr> {
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

fn send_wr(o: &OwnedSend) -> SendWr<'_> {
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
    let mut bad: *mut BpRecvWr = null_mut();
    let rc = guard_rc(|| {
        local(|l| {
            let q = get_qp(l, qp as usize)?;
            bad = wr;
            if wr.is_null() {
                return Err(inval("wr is NULL"));
            }
            // SAFETY: `wr` is readable (caller).
            if unsafe { (*wr).next.is_null() } {
                // SAFETY: `wr` is readable and its sg_list holds num_sge entries (caller).
                let (wr_id, s) =
                    unsafe { ((*wr).wr_id, sges(l, q.ctx, (*wr).sg_list, (*wr).num_sge)?) };
                q.qp.post_recv(&[RecvWr {
                    wr_id,
                    sg_list: s.as_slice(),
                }])?;
                return Ok(());
            }
            // SAFETY: every `next` is NULL or readable (caller).
            let ptrs = unsafe { walk(wr, |p| (*p).next, MAX_LIST) };
            let mut lists = Vec::with_capacity(ptrs.len());
            let mut conv_err = None;
            for (i, &p) in ptrs.iter().enumerate() {
                // SAFETY: `p` is readable and its sg_list holds num_sge entries (caller).
                match unsafe { sges(l, q.ctx, (*p).sg_list, (*p).num_sge) } {
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
            let r = if wrs.is_empty() {
                Ok(())
            } else {
                q.qp.post_recv(&wrs)
            };
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
                    None => Ok(()),
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
    const S: [&CStr; 22] = [
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
        .and_then(|i| S.get(i))
        .map_or(c"unknown".as_ptr(), |s| s.as_ptr())
}

// ---------------------------------------------------------------------------------------------
// Connection helper.
// ---------------------------------------------------------------------------------------------

/// Reads a `struct bp_conn_param` (NULL: all defaults).
///
/// # Safety
/// `p` is NULL or readable, its `private_data` holds `private_data_len` bytes.
unsafe fn conn_param(p: *const BpConnParam) -> Result<ConnParam, CErr> {
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
unsafe fn peer_out(i: &PeerInfo, out: *mut BpPeerInfo) {
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
                VObj::Listener(ListenerObj {
                    _c: h,
                    l: RefCell::new(lis),
                    ctx: context as usize,
                }),
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

#[cfg(test)]
mod tests {
    use super::*;
    use backplane::verbs::{WcOpcode, WcStatus};

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
