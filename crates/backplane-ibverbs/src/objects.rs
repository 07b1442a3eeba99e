//! Protection domains, memory regions, completion channels, CQs and address handles.
//!
//! Every object handed out is a box whose first field is the public struct (`struct ibv_pd`,
//! …), so the program's pointer is the box's. The control calls (create, destroy, modify,
//! query) look the pointer up in [`LIVE`] first and refuse one this library did not hand out
//! or already destroyed (`EINVAL`); the data-path calls the header inlines (`ibv_post_send`,
//! `ibv_poll_cq`, …) trust it, as libibverbs' providers do.

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::{AsFd, AsRawFd};
use std::ptr::null_mut;
use std::sync::{Mutex, MutexGuard};

use backplane::verbs::{AccessFlags, Ah, AhAttr, CompChannel, Cq, Mr, Pd, VerbsError};

use crate::abi::*;
use crate::{ctx_of, set_errno, Ctx};

/// What a live pointer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Pd,
    Mr,
    Channel,
    Cq,
    Qp,
    Ah,
    Srq,
}

/// Objects alive now, by address: control calls check a pointer here before using it.
static LIVE: Mutex<Option<HashMap<usize, Kind>>> = Mutex::new(None);

fn live() -> MutexGuard<'static, Option<HashMap<usize, Kind>>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The context an object belongs to: every object struct starts with `struct ibv_context
/// *context`, which is a [`Ctx`] this library opened.
fn ctx_of_obj<'a, T>(p: *mut T) -> &'a Ctx {
    // SAFETY: `p` is one of this module's boxes, whose first field is the public struct,
    // whose first field is the context pointer; a context is freed only with no objects left
    // (`ibv_close_device` keeps it otherwise).
    unsafe { &*Ctx::of_ibv(*p.cast::<*mut IbvContext>()) }
}

/// Records a new object (a leaked box of kind `k`).
pub(crate) fn add_live<T>(p: *mut T, k: Kind) {
    ctx_of_obj(p)
        .objects
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    live()
        .get_or_insert_with(HashMap::new)
        .insert(p as usize, k);
}

/// Forgets an object about to be freed.
pub(crate) fn remove_live<T>(p: *mut T) {
    if let Some(m) = live().as_mut() {
        m.remove(&(p as usize));
    }
    ctx_of_obj(p)
        .objects
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Pd => "PD",
            Kind::Mr => "MR",
            Kind::Channel => "completion channel",
            Kind::Cq => "CQ",
            Kind::Qp => "QP",
            Kind::Ah => "address handle",
            Kind::Srq => "SRQ",
        }
    }
}

/// Frees the object at `p` if it is a live one of kind `k`, its Rust objects dropped under
/// its context's lock: 0, or `EINVAL` with a line naming `call`.
pub(crate) fn destroy<T>(p: *mut T, k: Kind, call: &str) -> c_int {
    if obj::<T>(p.cast(), k).is_none() {
        return fail(call, libc::EINVAL, format!("not a live {}", k.name()));
    }
    let c = ctx_of_obj(p);
    let _g = c.lock();
    remove_live(p);
    // SAFETY: a live `Box<T>` of kind `k` (checked), out of LIVE now: freed once.
    drop(unsafe { Box::from_raw(p) });
    0
}

/// The object behind `p` if it is a live object of kind `k`.
pub(crate) fn obj<'a, T>(p: *mut c_void, k: Kind) -> Option<&'a mut T> {
    let ok = live().as_ref().and_then(|m| m.get(&(p as usize)).copied()) == Some(k);
    // SAFETY: a live pointer of kind `k` is a `Box<T>` for that kind's `T` (every `add_live`
    // caller passes the box it leaked), freed only after `remove_live`.
    ok.then(|| unsafe { &mut *p.cast::<T>() })
}

/// The errno of a verbs error, as libibverbs' providers report them.
pub(crate) fn errno_of(e: &VerbsError) -> c_int {
    use backplane::fabric::FabricError as F;
    match e {
        VerbsError::InvalidArgument(_) => libc::EINVAL,
        VerbsError::QueueFull(_) | VerbsError::Mem(_) => libc::ENOMEM,
        VerbsError::Post { source, .. } => errno_of(source),
        VerbsError::TimedOut => libc::ETIMEDOUT,
        VerbsError::Refused(_) => libc::ECONNREFUSED,
        VerbsError::Fabric(F::NodeNotReady { .. }) => libc::ENETDOWN,
        VerbsError::Fabric(F::NotRunning(_) | F::SupervisorGone(_)) => libc::ENODEV,
        VerbsError::Fabric(_) => libc::EIO,
        VerbsError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
    }
}

/// Reports a failed control call: one line on stderr (what programs print — "Couldn't
/// create QP" — does not say why), errno set; returns the errno.
pub(crate) fn fail(call: &str, errno: c_int, why: impl std::fmt::Display) -> c_int {
    eprintln!("libibverbs (backplane): {call}: {why}");
    set_errno(errno);
    errno
}

pub(crate) fn fail_verbs(call: &str, e: &VerbsError) -> c_int {
    fail(call, errno_of(e), e)
}

/// A counter for the `handle` fields (unique per process, as the kernel's are per context).
pub(crate) fn next_handle() -> u32 {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// Protection domains.
// ---------------------------------------------------------------------------------------------

#[repr(C)]
pub(crate) struct PdObj {
    pub(crate) ibv: IbvPd,
    pub(crate) pd: Pd,
    pub(crate) ctx: *const Ctx,
}

/// `ibv_alloc_pd`.
#[no_mangle]
pub extern "C" fn bp_ibv_alloc_pd(context: *mut IbvContext) -> *mut IbvPd {
    let Some(c) = ctx_of(context) else {
        fail("ibv_alloc_pd", libc::EINVAL, "not an open context");
        return null_mut();
    };
    let _g = c.lock();
    let pd = c.ctx.alloc_pd();
    let p = Box::into_raw(Box::new(PdObj {
        ibv: IbvPd {
            context,
            handle: next_handle(),
        },
        pd,
        ctx: c,
    }));
    add_live(p, Kind::Pd);
    p.cast()
}
crate::abi::symver!(bp_ibv_alloc_pd, "ibv_alloc_pd@@IBVERBS_1.1");

/// `ibv_dealloc_pd`: 0 or an errno. The engine keeps what still uses the PD alive; libibverbs
/// would answer `EBUSY`, which programs tearing down in the wrong order then ignore.
#[no_mangle]
pub extern "C" fn bp_ibv_dealloc_pd(pd: *mut IbvPd) -> c_int {
    destroy(pd.cast::<PdObj>(), Kind::Pd, "ibv_dealloc_pd")
}
crate::abi::symver!(bp_ibv_dealloc_pd, "ibv_dealloc_pd@@IBVERBS_1.1");

// ---------------------------------------------------------------------------------------------
// Memory regions.
// ---------------------------------------------------------------------------------------------

#[repr(C)]
pub(crate) struct MrObj {
    pub(crate) ibv: IbvMr,
    pub(crate) mr: Option<Mr>,
    pub(crate) ctx: *const Ctx,
}

/// `IBV_ACCESS_*` bits this library knows: the four rights, MW_BIND (memory windows are not
/// offered, so it grants nothing) and ZERO_BASED.
const ACCESS_RIGHTS: u32 = 0xf;
const ACCESS_MW_BIND: u32 = 1 << 4;
const ACCESS_ZERO_BASED: u32 = 1 << 5;
const ACCESS_ON_DEMAND: u32 = 1 << 6;
const ACCESS_HUGETLB: u32 = 1 << 7;
/// `IBV_ACCESS_OPTIONAL_RANGE`: hints a device may ignore (relaxed ordering, …); libibverbs
/// drops those a device does not support, and so does this library.
const ACCESS_OPTIONAL: u32 = 0x3ff << 20;

fn reg(pd: *mut IbvPd, addr: *mut c_void, len: usize, iova: u64, access: c_int) -> *mut IbvMr {
    let call = "ibv_reg_mr";
    let Some(p) = obj::<PdObj>(pd.cast(), Kind::Pd) else {
        fail(call, libc::EINVAL, "not a live PD");
        return null_mut();
    };
    let access = access as u32 & !ACCESS_OPTIONAL;
    if access & ACCESS_ON_DEMAND != 0 {
        fail(
            call,
            libc::EOPNOTSUPP,
            "on-demand paging (IBV_ACCESS_ON_DEMAND) is not offered: registered memory is \
             shared with peers when it is registered",
        );
        return null_mut();
    }
    let unknown = access & !(ACCESS_RIGHTS | ACCESS_MW_BIND | ACCESS_ZERO_BASED | ACCESS_HUGETLB);
    if unknown != 0 {
        fail(
            call,
            libc::EINVAL,
            format!("access flags {unknown:#x} are not offered"),
        );
        return null_mut();
    }
    if addr.is_null() || len == 0 {
        fail(
            call,
            libc::EINVAL,
            format!("nothing to register ({addr:p}, {len} bytes)"),
        );
        return null_mut();
    }
    let iova = if access & ACCESS_ZERO_BASED != 0 {
        0
    } else {
        iova
    };
    // SAFETY: the context outlives its PDs.
    let c = unsafe { &*p.ctx };
    let _g = c.lock();
    let rights = AccessFlags::from_bits_retain(access & ACCESS_RIGHTS);
    // SAFETY: the program registers its own memory and, as with any RDMA device, keeps it
    // mapped and leaves it alone while registering (the notes of `Adopted`).
    let mr = match unsafe { p.pd.reg_user_mr(addr.cast(), len, rights, iova) } {
        Ok(m) => m,
        Err(e) => {
            fail_verbs(call, &e);
            return null_mut();
        }
    };
    let m = Box::into_raw(Box::new(MrObj {
        ibv: IbvMr {
            context: p.ibv.context,
            pd,
            addr,
            length: len,
            handle: next_handle(),
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        },
        mr: Some(mr),
        ctx: p.ctx,
    }));
    add_live(m, Kind::Mr);
    m.cast()
}

/// `ibv_reg_mr` (the exported function; the header's macro calls it for constant flags).
#[no_mangle]
pub extern "C" fn bp_ibv_reg_mr(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut IbvMr {
    reg(pd, addr, length, addr as u64, access)
}
crate::abi::symver!(bp_ibv_reg_mr, "ibv_reg_mr@@IBVERBS_1.1");

/// `ibv_reg_mr_iova`.
#[no_mangle]
pub extern "C" fn bp_ibv_reg_mr_iova(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut IbvMr {
    reg(pd, addr, length, iova, access)
}
crate::abi::symver!(bp_ibv_reg_mr_iova, "ibv_reg_mr_iova@@IBVERBS_1.7");

/// `ibv_reg_mr_iova2` (what the header's `ibv_reg_mr` macro calls for flags not known at
/// compile time, perftest's case).
#[no_mangle]
pub extern "C" fn bp_ibv_reg_mr_iova2(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut IbvMr {
    reg(pd, addr, length, iova, access as c_int)
}
crate::abi::symver!(bp_ibv_reg_mr_iova2, "ibv_reg_mr_iova2@@IBVERBS_1.8");

/// `ibv_reg_dmabuf_mr`: memory another driver exports as a dma-buf (a GPU's) — none on the
/// fabric: NULL with `EOPNOTSUPP`, as libibverbs answers for a device without it. (libfabric
/// imports it: without it the library, and OpenMPI's OFI components with it, did not load.)
#[no_mangle]
pub extern "C" fn bp_ibv_reg_dmabuf_mr(
    _pd: *mut IbvPd,
    _offset: u64,
    _length: usize,
    _iova: u64,
    _fd: c_int,
    _access: c_int,
) -> *mut IbvMr {
    fail(
        "ibv_reg_dmabuf_mr",
        libc::EOPNOTSUPP,
        "dma-buf memory is not offered: register the program's own memory with ibv_reg_mr",
    );
    null_mut()
}
crate::abi::symver!(bp_ibv_reg_dmabuf_mr, "ibv_reg_dmabuf_mr@@IBVERBS_1.12");

/// `ibv_dereg_mr`: peers lose access at once; the program's pages become private memory
/// again, with their bytes.
#[no_mangle]
pub extern "C" fn bp_ibv_dereg_mr(mr: *mut IbvMr) -> c_int {
    destroy(mr.cast::<MrObj>(), Kind::Mr, "ibv_dereg_mr")
}
crate::abi::symver!(bp_ibv_dereg_mr, "ibv_dereg_mr@@IBVERBS_1.1");

// ---------------------------------------------------------------------------------------------
// Completion channels and CQs.
// ---------------------------------------------------------------------------------------------

#[repr(C)]
pub(crate) struct ChObj {
    pub(crate) ibv: IbvCompChannel,
    pub(crate) ch: CompChannel,
    /// The CQs reporting here: (engine CQ id, the CQ's pointer).
    pub(crate) cqs: Mutex<Vec<(u32, usize)>>,
}

/// `ibv_create_comp_channel`.
#[no_mangle]
pub extern "C" fn bp_ibv_create_comp_channel(context: *mut IbvContext) -> *mut IbvCompChannel {
    let call = "ibv_create_comp_channel";
    let Some(c) = ctx_of(context) else {
        fail(call, libc::EINVAL, "not an open context");
        return null_mut();
    };
    let _g = c.lock();
    let ch = match c.ctx.create_comp_channel() {
        Ok(ch) => ch,
        Err(e) => {
            fail_verbs(call, &e);
            return null_mut();
        }
    };
    let p = Box::into_raw(Box::new(ChObj {
        ibv: IbvCompChannel {
            context,
            fd: ch.as_fd().as_raw_fd(),
            refcnt: 0,
        },
        ch,
        cqs: Mutex::new(Vec::new()),
    }));
    add_live(p, Kind::Channel);
    p.cast()
}
crate::abi::symver!(
    bp_ibv_create_comp_channel,
    "ibv_create_comp_channel@@IBVERBS_1.0"
);

/// `ibv_destroy_comp_channel`: `EBUSY` while CQs report to it.
#[no_mangle]
pub extern "C" fn bp_ibv_destroy_comp_channel(channel: *mut IbvCompChannel) -> c_int {
    let call = "ibv_destroy_comp_channel";
    if let Some(ch) = obj::<ChObj>(channel.cast(), Kind::Channel) {
        if ch.ibv.refcnt > 0 {
            return fail(
                call,
                libc::EBUSY,
                format!("{} CQs still use it", ch.ibv.refcnt),
            );
        }
    }
    destroy(channel.cast::<ChObj>(), Kind::Channel, call)
}
crate::abi::symver!(
    bp_ibv_destroy_comp_channel,
    "ibv_destroy_comp_channel@@IBVERBS_1.0"
);

/// A CQ as handed out: `struct ibv_cq`, then the rest of a `struct ibv_cq_ex` (used when the
/// CQ was made by `ibv_create_cq_ex`), then ours.
#[repr(C)]
pub(crate) struct CqObj {
    pub(crate) ibv: IbvCq,
    /// In a cell: the polling API writes the current completion's `status` and `wr_id` there,
    /// which the program reads through its pointer.
    pub(crate) ex: std::cell::UnsafeCell<IbvCqExTail>,
    pub(crate) cq: Cq,
    pub(crate) ctx: *const Ctx,
    /// The completion `ibv_start_poll`/`ibv_next_poll` took (see `crate::cq_ex`).
    pub(crate) current: crate::cq_ex::Current,
    /// Its overrun was reported as `IBV_EVENT_CQ_ERR`.
    pub(crate) overrun_said: std::sync::atomic::AtomicBool,
}

impl CqObj {
    /// True if the CQ overran (it is in error, as after `IBV_EVENT_CQ_ERR`), which is then
    /// reported once as that event. `cq` is this object's pointer (the event's element).
    pub(crate) fn overrun<T>(&self, cq: *mut T) -> bool {
        if self.cq.overruns() == 0 {
            return false;
        }
        if !self
            .overrun_said
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            let ev = IbvAsyncEvent::of(crate::async_events::kind::CQ_ERR, cq);
            // SAFETY: the context outlives its CQs.
            unsafe { &*self.ctx }.events.push(ev);
        }
        true
    }
}

// `ibv_create_cq_ex` hands out the object as a `struct ibv_cq_ex` (layout checked by build.rs).
const _: () = assert!(std::mem::offset_of!(CqObj, ibv) == 0);
const _: () = assert!(std::mem::offset_of!(CqObj, ex) == std::mem::offset_of!(IbvCqEx, tail));

/// `ibv_create_cq`.
#[no_mangle]
pub extern "C" fn bp_ibv_create_cq(
    context: *mut IbvContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut IbvCompChannel,
    comp_vector: c_int,
) -> *mut IbvCq {
    let ask = (cqe, cq_context, channel, comp_vector);
    create_cq("ibv_create_cq", context, ask, None)
}
crate::abi::symver!(bp_ibv_create_cq, "ibv_create_cq@@IBVERBS_1.1");

/// Makes a CQ of `context` with (cqe, cq_context, channel, comp_vector); with `ex` (the
/// `wc_flags` of `ibv_create_cq_ex`) it polls through the extended API too.
pub(crate) fn create_cq(
    call: &str,
    context: *mut IbvContext,
    (cqe, cq_context, channel, comp_vector): (c_int, *mut c_void, *mut IbvCompChannel, c_int),
    ex: Option<u64>,
) -> *mut IbvCq {
    let Some(c) = ctx_of(context) else {
        fail(call, libc::EINVAL, "not an open context");
        return null_mut();
    };
    if comp_vector != 0 {
        fail(
            call,
            libc::EINVAL,
            format!("comp_vector {comp_vector}: the device has one (0)"),
        );
        return null_mut();
    }
    if cqe <= 0 {
        fail(call, libc::EINVAL, format!("cqe {cqe}"));
        return null_mut();
    }
    let ch = if channel.is_null() {
        None
    } else {
        match obj::<ChObj>(channel.cast(), Kind::Channel) {
            Some(ch) if ch.ibv.context == context => Some(ch),
            _ => {
                fail(
                    call,
                    libc::EINVAL,
                    "not a live completion channel of this context",
                );
                return null_mut();
            }
        }
    };
    let _g = c.lock();
    let cq = match c.ctx.create_cq(cqe as usize, ch.as_ref().map(|c| &c.ch)) {
        Ok(cq) => cq,
        Err(e) => {
            fail_verbs(call, &e);
            return null_mut();
        }
    };
    let id = cq.id();
    let p = Box::into_raw(Box::new(CqObj {
        ibv: IbvCq {
            context,
            channel,
            cq_context,
            handle: next_handle(),
            cqe,
            mutex: libc::PTHREAD_MUTEX_INITIALIZER,
            cond: libc::PTHREAD_COND_INITIALIZER,
            comp_events_completed: 0,
            async_events_completed: 0,
        },
        ex: std::cell::UnsafeCell::new(crate::cq_ex::table(ex)),
        cq,
        ctx: c,
        current: crate::cq_ex::Current::default(),
        overrun_said: std::sync::atomic::AtomicBool::new(false),
    }));
    if let Some(ch) = ch {
        ch.ibv.refcnt += 1;
        ch.cqs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, p as usize));
    }
    add_live(p, Kind::Cq);
    p.cast()
}

/// `ibv_destroy_cq`.
#[no_mangle]
pub extern "C" fn bp_ibv_destroy_cq(cq: *mut IbvCq) -> c_int {
    if let Some(c) = obj::<CqObj>(cq.cast(), Kind::Cq) {
        if let Some(ch) = obj::<ChObj>(c.ibv.channel.cast(), Kind::Channel) {
            ch.ibv.refcnt -= 1;
            ch.cqs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|&(_, p)| p != cq as usize);
        }
    }
    destroy(cq.cast::<CqObj>(), Kind::Cq, "ibv_destroy_cq")
}
crate::abi::symver!(bp_ibv_destroy_cq, "ibv_destroy_cq@@IBVERBS_1.1");

/// `ibv_get_cq_event`: waits for the next event of a CQ reporting to `channel`; 0 or -1.
///
/// # Safety
/// `cq` and `cq_context` are writable.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_get_cq_event(
    channel: *mut IbvCompChannel,
    cq: *mut *mut IbvCq,
    cq_context: *mut *mut c_void,
) -> c_int {
    let call = "ibv_get_cq_event";
    let Some(ch) = obj::<ChObj>(channel.cast(), Kind::Channel) else {
        fail(call, libc::EINVAL, "not a live completion channel");
        return -1;
    };
    loop {
        // Not under the context's lock: another thread may post and poll meanwhile.
        let ev = match ch.ch.try_get_cq_event() {
            Some(ev) => ev,
            // None queued. A program may make the channel's fd non-blocking (UCX does, and
            // calls this before it sleeps in epoll on the fd): then, as libibverbs' read() of
            // the fd, -1 with EAGAIN (said quietly: it is no failure). (Asked only now: a
            // system call, where an event was waiting, would be one too many.)
            // SAFETY: F_GETFL on our own eventfd.
            None if unsafe { libc::fcntl(ch.ibv.fd, libc::F_GETFL) } & libc::O_NONBLOCK != 0 => {
                crate::set_errno(libc::EAGAIN);
                return -1;
            }
            None => match ch.ch.get_cq_event(None) {
                Ok(ev) => ev,
                Err(e) => {
                    fail_verbs(call, &e);
                    return -1;
                }
            },
        };
        let found = ch
            .cqs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|&&(id, _)| id == ev.cq_id)
            .map(|&(_, p)| p as *mut IbvCq);
        // An event of a CQ destroyed since is nobody's.
        let Some(p) = found else { continue };
        // SAFETY: `p` is a live CQ (above) made by this library.
        if !unsafe { completion_behind(p) } {
            continue; // re-armed: the next event comes with a completion
        }
        // SAFETY: the caller passes writable pointers; `p` is a live CQ (listed by its
        // channel until destroyed), whose `cq_context` the program may have changed.
        unsafe {
            if !cq.is_null() {
                *cq = p;
            }
            if !cq_context.is_null() {
                *cq_context = (*p).cq_context;
            }
        }
        return 0;
    }
}
crate::abi::symver!(bp_ibv_get_cq_event, "ibv_get_cq_event@@IBVERBS_1.1");

/// Whether an event of `cq` has a completion behind it; if not, `cq` is armed again. The
/// engine's channels fire when what a CQ's QPs wait for moves (an ack, a message, a peer's
/// going), and the completion is made by the next poll — which may find it was not one yet,
/// or was taken already. Programs written for hardware take an event as "a completion is
/// there": `ib_send_lat -e` polls its send CQ once per event and read a completion that was
/// not written (its server reported "Completion with error", status garbage; its client's
/// send queue filled: "Couldn't post send"). So an event goes to the program only when the
/// CQ holds a completion (checked after arming again, so one that comes in between fires).
///
/// # Safety
/// `cq` is a CQ this library made, alive.
unsafe fn completion_behind(cq: *mut IbvCq) -> bool {
    // SAFETY: caller contract.
    let c = unsafe { &*cq.cast::<CqObj>() };
    // SAFETY: the context outlives its CQs.
    let _g = unsafe { &*c.ctx }.lock();
    if c.cq.has_completion() {
        return true;
    }
    // The program armed this CQ and waits for its event: it stays armed.
    if c.cq.req_notify(false).is_err() {
        return true; // (the program's poll will say what is wrong)
    }
    c.cq.has_completion()
}

/// `ibv_ack_cq_events`.
#[no_mangle]
pub extern "C" fn bp_ibv_ack_cq_events(cq: *mut IbvCq, nevents: c_uint) {
    if let Some(c) = obj::<CqObj>(cq.cast(), Kind::Cq) {
        c.ibv.comp_events_completed = c.ibv.comp_events_completed.wrapping_add(nevents);
    }
}
crate::abi::symver!(bp_ibv_ack_cq_events, "ibv_ack_cq_events@@IBVERBS_1.1");

/// `ops.poll_cq` (the header's inline `ibv_poll_cq`): the number of completions written, or
/// -1 (the CQ overran: it is in error, as after `IBV_EVENT_CQ_ERR`).
///
/// # Safety
/// `cq` is a CQ this library made, alive; `wc` holds `num_entries` writable entries.
pub(crate) unsafe extern "C" fn poll_cq(
    cq: *mut IbvCq,
    num_entries: c_int,
    wc: *mut IbvWc,
) -> c_int {
    // SAFETY: caller contract (the inline wrapper passes the program's CQ); the context's
    // lock, taken next, makes this call the only one using its engine.
    let c = unsafe { &*cq.cast::<CqObj>() };
    // SAFETY: the context outlives its CQs.
    let _g = unsafe { &*c.ctx }.lock();
    let want = num_entries.max(0) as usize;
    if want == 0 {
        // Nothing to take, but the poll still moves the CQ's QPs along.
        c.cq.poll(&mut []);
        return 0;
    }
    // Each completion goes from the engine's queue straight into the program's array, in
    // libibverbs' layout (no buffer in between: reloading a just-stored completion whole
    // stalled on store forwarding, 40 % of a poll).
    let n = c.cq.poll_each(want, |i, w| {
        // SAFETY: i < want = num_entries, which the caller promises are writable.
        unsafe { wc.add(i).write(wc_out(w)) };
    });
    // An overrun CQ is in error (as after IBV_EVENT_CQ_ERR): said when it has nothing left.
    if n == 0 && c.overrun(cq) {
        return -1;
    }
    n as c_int
}

pub(crate) fn wc_out(w: &backplane::verbs::Wc) -> IbvWc {
    IbvWc {
        wr_id: w.wr_id,
        status: w.status as c_int,
        opcode: w.opcode as c_int,
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

/// `ibv_resize_cq`: 0 with `cq->cqe` the new size, or an errno (`EINVAL`: a size out of
/// range or below the completions the CQ holds). (OpenMPI's openib component imports it.)
#[no_mangle]
pub extern "C" fn bp_ibv_resize_cq(cq: *mut IbvCq, cqe: c_int) -> c_int {
    let call = "ibv_resize_cq";
    let Some(c) = obj::<CqObj>(cq.cast(), Kind::Cq) else {
        return fail(call, libc::EINVAL, "not a CQ of this library");
    };
    if cqe <= 0 {
        return fail(call, libc::EINVAL, format!("cqe {cqe}"));
    }
    // SAFETY: the context outlives its CQs.
    let _g = unsafe { &*c.ctx }.lock();
    match c.cq.resize(cqe as usize) {
        Ok(n) => {
            c.ibv.cqe = n as c_int;
            0
        }
        Err(e) => fail_verbs(call, &e),
    }
}
crate::abi::symver!(bp_ibv_resize_cq, "ibv_resize_cq@@IBVERBS_1.1");

/// `ops.req_notify_cq` (the header's inline `ibv_req_notify_cq`): 0 or an errno.
///
/// # Safety
/// `cq` is a CQ this library made, alive.
pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut IbvCq, solicited_only: c_int) -> c_int {
    // SAFETY: caller contract.
    let c = unsafe { &*cq.cast::<CqObj>() };
    // SAFETY: the context outlives its CQs.
    let _g = unsafe { &*c.ctx }.lock();
    match c.cq.req_notify(solicited_only != 0) {
        Ok(()) => 0,
        Err(e) => errno_of(&e),
    }
}

// ---------------------------------------------------------------------------------------------
// Address handles.
// ---------------------------------------------------------------------------------------------

#[repr(C)]
pub(crate) struct AhObj {
    pub(crate) ibv: IbvAh,
    pub(crate) ah: Ah,
    pub(crate) ctx: *const Ctx,
}

pub(crate) fn ah_in(a: &IbvAhAttr) -> AhAttr {
    AhAttr {
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: a.is_global != 0,
        port_num: a.port_num,
    }
}

/// `ibv_create_ah`: to the node whose LID (= slot) is `dlid`.
///
/// # Safety
/// `attr` is readable.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_create_ah(pd: *mut IbvPd, attr: *mut IbvAhAttr) -> *mut IbvAh {
    let call = "ibv_create_ah";
    let Some(p) = obj::<PdObj>(pd.cast(), Kind::Pd) else {
        fail(call, libc::EINVAL, "not a live PD");
        return null_mut();
    };
    if attr.is_null() {
        fail(call, libc::EINVAL, "attr is NULL");
        return null_mut();
    }
    // SAFETY: non-null; the caller promises it is readable.
    let a = unsafe { attr.read() };
    // SAFETY: the context outlives its PDs.
    let _g = unsafe { &*p.ctx }.lock();
    let ah = match p.pd.create_ah(&ah_in(&a)) {
        Ok(ah) => ah,
        Err(e) => {
            fail_verbs(call, &e);
            return null_mut();
        }
    };
    let h = Box::into_raw(Box::new(AhObj {
        ibv: IbvAh {
            context: p.ibv.context,
            pd,
            handle: next_handle(),
        },
        ah,
        ctx: p.ctx,
    }));
    add_live(h, Kind::Ah);
    h.cast()
}
crate::abi::symver!(bp_ibv_create_ah, "ibv_create_ah@@IBVERBS_1.1");

/// `ibv_destroy_ah`.
#[no_mangle]
pub extern "C" fn bp_ibv_destroy_ah(ah: *mut IbvAh) -> c_int {
    destroy(ah.cast::<AhObj>(), Kind::Ah, "ibv_destroy_ah")
}
crate::abi::symver!(bp_ibv_destroy_ah, "ibv_destroy_ah@@IBVERBS_1.1");
