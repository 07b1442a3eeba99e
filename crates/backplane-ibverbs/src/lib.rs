//! A drop-in `libibverbs.so.1`: programs built against rdma-core's libibverbs (Debian's
//! ibverbs-utils, perftest, your own) run unmodified on a backplane fabric, with no RDMA
//! hardware and no kernel module. `backplane exec --verbs NODE -- CMD` runs CMD in a node with
//! this library first on its search path; `LD_LIBRARY_PATH` pointing at a directory holding it
//! as `libibverbs.so.1` works too.
//!
//! Exported symbols carry rdma-core's version tags (`ibv_get_device_list@@IBVERBS_1.1`, …;
//! see `abi::symver!`), and the structures handed out have the header's layouts (checked
//! against the installed header at build time). It is a thin layer over
//! [`backplane::verbs`], not a second engine.
//!
//! **Devices.** One per fabric the process runs in (a node of it), named `bp_FABRIC`; port 1, ACTIVE while the node is
//! READY, link layer InfiniBand, LID = the node's slot, GID 0 = the node's `bp0` address as
//! an IPv4-mapped IPv6 address (RoCE v2 style; `fe80::` + the node GUID on a fabric without
//! IP). Opening a device needs to know the node: the process runs in it (`BACKPLANE_FABRIC` and
//! `BACKPLANE_NODE`, which `backplane exec` sets, or the node's network namespace).
//!
//! **Objects** (`objects`, `qp`, `srq`): PDs, MRs — the program's own buffers, registered in
//! place ([`backplane::verbs::Pd::reg_user_mr`]) — completion channels, CQs, RC/UC/UD QPs,
//! shared receive queues and address handles are the engine's; the header's inline data path
//! (`ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`)
//! jumps through the context's `ops`, one call at a time per context (the `lock` module).
//! A context is a `struct verbs_context` with three extended operations: `create_qp_ex` (a QP
//! made with `send_ops_flags` posts through the `ibv_wr_*` calls too: the `wr` module),
//! `create_cq_ex` (polled through `ibv_start_poll` & co., with completion timestamps: the
//! `cq_ex` module) and `query_device_ex` (the timestamps' clock); the header's wrappers of the
//! others find their slots null and fall back or answer `EOPNOTSUPP`. Asynchronous events
//! (port, device, CQ errors) come through `async_fd` (the `async_events` module).
//! Not offered (the program gets libibverbs' failure and stops with its own error): memory
//! windows, multicast, XRC, device memory, ODP, `rdma_cm`.

pub mod abi;
mod async_events;
mod cq_ex;
mod lock;
mod objects;
mod qp;
mod srq;
mod stubs;
mod turn;
mod wr;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use abi::*;
use backplane::fabric::Fabric;
use backplane::verbs::Context;

/// A device as handed out: the public struct first, so a `*mut IbvDevice` is a `*mut Dev`.
#[repr(C)]
struct Dev {
    ibv: IbvDevice,
    fabric: String,
}

// SAFETY: a device is never written after it is made, and its only pointers (`_ops`) are
// null; sharing it between threads is sharing plain data.
unsafe impl Sync for Dev {}

/// Every device ever listed in this process, by fabric: programs compare device pointers
/// across `ibv_get_device_list` calls, and a device must outlive the lists it was in.
static DEVICES: Mutex<Vec<&'static Dev>> = Mutex::new(Vec::new());

/// An open context: a `struct verbs_context` first (its operations, then the public
/// `struct ibv_context`), so a `*mut IbvContext` is a `*mut Ctx` [`Ctx::of_ibv`] bytes on.
#[repr(C)]
struct Ctx {
    head: VerbsContextHead,
    ibv: IbvContext,
    ctx: Context,
    fabric: Fabric,
    slot: u32,
    gid: [u8; 16],
    /// Held by every call that reaches the engine. The engine takes no lock (a context's
    /// objects belong to one thread in the Rust API); libibverbs programs may use one context
    /// from several threads, so calls are made one at a time here (biased towards the first
    /// thread: see [`lock::EngineLock`]).
    engine: lock::EngineLock,
    /// Its asynchronous events and `async_fd`.
    events: std::sync::Arc<async_events::Events>,
    /// PDs, MRs, channels, CQs, QPs and AHs made on it and not destroyed yet.
    objects: std::sync::atomic::AtomicUsize,
}

// The head and the context sit as in `struct verbs_context` (whose layout `build.rs` checks).
const _: () = assert!(std::mem::offset_of!(Ctx, head) == 0);
const _: () =
    assert!(std::mem::offset_of!(Ctx, ibv) == std::mem::offset_of!(VerbsContext, context));

impl Ctx {
    /// The `Ctx` a context pointer this library handed out (`&ctx.ibv`) belongs to; only
    /// address arithmetic, nothing is read.
    fn of_ibv(p: *mut IbvContext) -> *mut Ctx {
        p.wrapping_byte_sub(std::mem::offset_of!(Ctx, ibv)).cast()
    }

    /// Waits for the context's engine to be free and holds it.
    #[inline]
    fn lock(&self) -> lock::Held<'_> {
        self.engine.lock()
    }
}

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: errno is this thread's; writing it is what every libc function does.
    unsafe { *libc::__errno_location() = e };
}

/// Copies `s` into a C char array, truncated, NUL-terminated.
fn put_str(dst: &mut [c_char], s: &str) {
    let n = s.len().min(dst.len().saturating_sub(1));
    for (d, b) in dst.iter_mut().zip(s.bytes().take(n)) {
        *d = b as c_char;
    }
    dst[n] = 0;
}

/// The fabrics this process can reach — whose supervisor runs and in one of whose nodes it
/// runs — with that node's slot.
fn reachable_fabrics() -> Vec<(String, u32)> {
    running_fabrics()
        .into_iter()
        .filter_map(|f| {
            let nodes = Fabric::attach(&f).ok()?.nodes();
            let slot = own_slot(&f, nodes)?;
            Some((f, slot))
        })
        .collect()
}

/// The fabrics whose supervisor runs now, by name.
fn running_fabrics() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(backplane::fabric::run_root()) else {
        return Vec::new();
    };
    let mut names: Vec<String> = dir
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| backplane::fabric::validate_name(n).is_ok())
        .filter(|n| backplane::fabric::supervisor::is_running(n))
        .collect();
    names.sort();
    names
}

fn device_for(fabric: &str) -> &'static Dev {
    let mut all = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = all.iter().find(|d| d.fabric == fabric) {
        return d;
    }
    let mut ibv = IbvDevice {
        ops: IbvDeviceOps {
            _dummy1: std::ptr::null(),
            _dummy2: std::ptr::null(),
        },
        node_type: NODE_CA,
        transport_type: TRANSPORT_IB,
        name: [0; SYSFS_NAME_MAX],
        dev_name: [0; SYSFS_NAME_MAX],
        dev_path: [0; SYSFS_PATH_MAX],
        ibdev_path: [0; SYSFS_PATH_MAX],
    };
    put_str(&mut ibv.name, &format!("bp_{fabric}"));
    put_str(&mut ibv.dev_name, &format!("uverbs_bp_{fabric}"));
    let dir = backplane::fabric::fabric_dir(fabric);
    put_str(&mut ibv.dev_path, &dir.to_string_lossy());
    put_str(&mut ibv.ibdev_path, &dir.to_string_lossy());
    let d: &'static Dev = Box::leak(Box::new(Dev {
        ibv,
        fabric: fabric.to_owned(),
    }));
    all.push(d);
    d
}

/// The `Dev` behind a device pointer this library handed out, or `None`.
fn dev_of(device: *mut IbvDevice) -> Option<&'static Dev> {
    let all = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    all.iter().find(|d| std::ptr::eq(&d.ibv, device)).copied()
}

/// `ibv_get_device_list`: a NULL-terminated array (free it with `ibv_free_device_list`).
///
/// # Safety
/// `num_devices` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut IbvDevice {
    // UCX starting this process's own link between hosts: no device (it would be the fabric
    // the link carries; see `opening_link`).
    let inner = backplane::opening_link();
    // The program's UCX_* variables are for its own UCX (which may run on this device), not
    // for this process's link to other hosts.
    backplane::ucx_env_is_the_programs();
    let devs: Vec<&'static Dev> = if inner {
        Vec::new()
    } else {
        reachable_fabrics()
            .iter()
            .map(|(f, _)| device_for(f))
            .collect()
    };
    if devs.is_empty() && !inner {
        no_device_hint();
    }
    // SAFETY: calloc of (n + 1) pointers; checked for NULL below.
    let list = unsafe { libc::calloc(devs.len() + 1, std::mem::size_of::<*mut IbvDevice>()) }
        .cast::<*mut IbvDevice>();
    if list.is_null() {
        set_errno(libc::ENOMEM);
        return null_mut();
    }
    for (i, d) in devs.iter().enumerate() {
        // SAFETY: `list` holds devs.len() + 1 pointers; the device lives forever (leaked).
        unsafe { *list.add(i) = std::ptr::from_ref(&d.ibv).cast_mut() };
    }
    if !num_devices.is_null() {
        // SAFETY: the caller passes NULL or a writable int.
        unsafe { *num_devices = devs.len() as c_int };
    }
    list
}
abi::symver!(bp_ibv_get_device_list, "ibv_get_device_list@@IBVERBS_1.1");

/// Says once per process, on stderr, why the list is empty: libibverbs programs then print
/// only "No IB devices found".
fn no_device_hint() {
    static SAID: AtomicBool = AtomicBool::new(false);
    if SAID.swap(true, Ordering::Relaxed) {
        return;
    }
    let running = running_fabrics();
    if running.is_empty() {
        eprintln!(
            "libibverbs (backplane): no device: no backplane fabric is running (backplane up)"
        );
    } else {
        eprintln!(
            "libibverbs (backplane): no device: this process runs in no node of fabric {} \
             (run it with `backplane exec --verbs NODE -- …`)",
            running.join(", ")
        );
    }
}

/// `ibv_free_device_list`: frees the array, not the devices (they stay valid).
///
/// # Safety
/// `list` is NULL or an array `ibv_get_device_list` returned, not freed before.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_free_device_list(list: *mut *mut IbvDevice) {
    // SAFETY: `list` came from calloc in `ibv_get_device_list` (or is NULL).
    unsafe { libc::free(list.cast()) };
}
abi::symver!(bp_ibv_free_device_list, "ibv_free_device_list@@IBVERBS_1.1");

/// `ibv_get_device_name`.
#[no_mangle]
pub extern "C" fn bp_ibv_get_device_name(device: *mut IbvDevice) -> *const c_char {
    match dev_of(device) {
        Some(d) => d.ibv.name.as_ptr(),
        None => {
            set_errno(libc::EINVAL);
            std::ptr::null()
        }
    }
}
abi::symver!(bp_ibv_get_device_name, "ibv_get_device_name@@IBVERBS_1.1");

/// `ibv_get_device_index`: the device's index, stable for the process's life (the order in
/// which this process first listed the fabrics; the kernel's `ibdev` index on a NIC). -1 and
/// `EINVAL` for a pointer that is no device of ours.
#[no_mangle]
pub extern "C" fn bp_ibv_get_device_index(device: *mut IbvDevice) -> c_int {
    let all = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    match all.iter().position(|d| std::ptr::eq(&d.ibv, device)) {
        Some(i) => i as c_int,
        None => {
            set_errno(libc::EINVAL);
            -1
        }
    }
}
abi::symver!(bp_ibv_get_device_index, "ibv_get_device_index@@IBVERBS_1.9");

/// The node GUID of slot `slot` (as `Context::query_device` makes it), big-endian.
fn guid_be(slot: u32) -> u64 {
    ((u64::from(slot) << 32) | 0x0b0b).to_be()
}

/// The node this process runs in, on fabric `fabric` of `nodes` nodes: `BACKPLANE_FABRIC` and
/// `BACKPLANE_NODE` (set by `backplane exec`), else the node whose network namespace it is in.
fn own_slot(fabric: &str, nodes: u32) -> Option<u32> {
    if std::env::var("BACKPLANE_FABRIC").ok().as_deref() == Some(fabric) {
        if let Some(n) = std::env::var("BACKPLANE_NODE")
            .ok()
            .and_then(|s| s.parse::<u32>().ok())
            .filter(|n| (1..=nodes).contains(n))
        {
            return Some(n);
        }
    }
    use std::os::unix::fs::MetadataExt;
    let mine = std::fs::metadata("/proc/self/ns/net").ok()?.ino();
    (1..=nodes).find(|&s| {
        std::fs::metadata(
            std::path::Path::new("/run/netns")
                .join(backplane::fabric::netns::netns_name(fabric, s)),
        )
        .is_ok_and(|m| m.ino() == mine)
    })
}

/// `ibv_get_device_guid`: the node GUID of the node this process runs in (0 if it runs in
/// none of the fabric's nodes).
#[no_mangle]
pub extern "C" fn bp_ibv_get_device_guid(device: *mut IbvDevice) -> u64 {
    let Some(d) = dev_of(device) else {
        set_errno(libc::EINVAL);
        return 0;
    };
    let nodes = Fabric::attach(&d.fabric).map(|f| f.nodes()).unwrap_or(0);
    own_slot(&d.fabric, nodes).map_or(0, guid_be)
}
abi::symver!(bp_ibv_get_device_guid, "ibv_get_device_guid@@IBVERBS_1.1");

/// GID 0 of node `slot`: its `bp0` address (from the hosts file the fabric gives each node)
/// as `::ffff:a.b.c.d`, else `fe80::` and the node GUID.
fn gid_of(fabric: &str, slot: u32) -> [u8; 16] {
    let hosts = backplane::fabric::netns::netns_etc(fabric, slot).join("hosts");
    let me = format!("node{slot}");
    let addr = std::fs::read_to_string(hosts).ok().and_then(|s| {
        s.lines().find_map(|l| {
            let mut w = l.split_whitespace();
            let a = w.next()?;
            w.any(|n| n == me)
                .then(|| a.parse::<std::net::Ipv4Addr>().ok())
                .flatten()
        })
    });
    match addr {
        Some(a) => a.to_ipv6_mapped().octets(),
        None => {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g[8..].copy_from_slice(&guid_be(slot).to_ne_bytes());
            g
        }
    }
}

/// `ibv_open_device`: a context on the node this process runs in.
#[no_mangle]
pub extern "C" fn bp_ibv_open_device(device: *mut IbvDevice) -> *mut IbvContext {
    let Some(d) = dev_of(device) else {
        set_errno(libc::EINVAL);
        return null_mut();
    };
    match open(d) {
        Ok(c) => c,
        Err((errno, msg)) => {
            eprintln!("libibverbs (backplane): bp_{}: {msg}", d.fabric);
            set_errno(errno);
            null_mut()
        }
    }
}
abi::symver!(bp_ibv_open_device, "ibv_open_device@@IBVERBS_1.1");

fn open(d: &'static Dev) -> Result<*mut IbvContext, (c_int, String)> {
    let fabric = Fabric::attach(&d.fabric).map_err(|e| (libc::ENODEV, e.to_string()))?;
    let slot = own_slot(&d.fabric, fabric.nodes()).ok_or_else(|| {
        (
            libc::ENODEV,
            format!(
                "this process runs in no node of fabric '{}' (start it with `backplane exec \
                 --verbs NODE -- …`, or set BACKPLANE_FABRIC and BACKPLANE_NODE)",
                d.fabric
            ),
        )
    })?;
    let node = fabric
        .node(slot)
        .map_err(|e| (libc::ENODEV, e.to_string()))?;
    let ctx = Context::open(&node).map_err(|e| (libc::ENODEV, e.to_string()))?;
    let events = async_events::Events::new().map_err(|e| {
        (
            e.raw_os_error().unwrap_or(libc::EMFILE),
            format!("cannot make the asynchronous event descriptor: {e}"),
        )
    })?;
    async_events::watch(&events, fabric.clone(), slot);
    let null = std::ptr::null::<c_void>();
    let ops = IbvContextOps {
        _compat_query_device: null,
        _compat_query_port: null,
        _compat_alloc_pd: null,
        _compat_dealloc_pd: null,
        _compat_reg_mr: null,
        _compat_rereg_mr: null,
        _compat_dereg_mr: null,
        alloc_mw: null,
        bind_mw: null,
        dealloc_mw: null,
        _compat_create_cq: null,
        poll_cq: objects::poll_cq as *const c_void,
        req_notify_cq: objects::req_notify_cq as *const c_void,
        _compat_cq_event: null,
        _compat_resize_cq: null,
        _compat_destroy_cq: null,
        _compat_create_srq: null,
        _compat_modify_srq: null,
        _compat_query_srq: null,
        _compat_destroy_srq: null,
        post_srq_recv: srq::post_srq_recv as *const c_void,
        _compat_create_qp: null,
        _compat_query_qp: null,
        _compat_modify_qp: null,
        _compat_destroy_qp: null,
        post_send: qp::post_send as *const c_void,
        post_recv: qp::post_recv as *const c_void,
        _compat_create_ah: null,
        _compat_destroy_ah: null,
        _compat_attach_mcast: null,
        _compat_detach_mcast: null,
        _compat_async_event: null,
    };
    let c = Box::new(Ctx {
        head: VerbsContextHead {
            ops_a: [null; 25],
            create_cq_ex: cq_ex::create_cq_ex as *const c_void,
            priv_: null,
            query_device_ex: query_device_ex as *const c_void,
            ops_b: [null; VCTX_OPS_BEFORE_CREATE_QP_EX - 28],
            create_qp_ex: qp::create_qp_ex as *const c_void,
            get_srq_num: null,
            create_srq_ex: null,
            open_xrcd: null,
            close_xrcd: null,
            _abi_placeholder3: 0,
            sz: std::mem::size_of::<VerbsContext>(),
        },
        ibv: IbvContext {
            device: std::ptr::from_ref(&d.ibv).cast_mut(),
            ops,
            cmd_fd: -1,
            async_fd: events.raw_fd(),
            num_comp_vectors: 1,
            mutex: libc::PTHREAD_MUTEX_INITIALIZER,
            abi_compat: VERBS_ABI_IS_EXTENDED,
        },
        gid: gid_of(&d.fabric, slot),
        ctx,
        fabric,
        slot,
        events,
        engine: lock::EngineLock::new(
            std::env::var("BACKPLANE_VERBS_SINGLE_THREADED").is_ok_and(|v| v == "1"),
        ),
        objects: std::sync::atomic::AtomicUsize::new(0),
    });
    let p = Box::into_raw(c);
    // SAFETY: a live box; only the field's address is taken.
    let ibv = unsafe { &raw mut (*p).ibv };
    OPEN.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(ibv as usize);
    Ok(ibv)
}

/// Contexts open now (their addresses): a pointer that is not one is refused with EINVAL.
static OPEN: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// The `Ctx` behind a context pointer this library handed out and that is still open.
fn ctx_of<'a>(context: *mut IbvContext) -> Option<&'a Ctx> {
    let open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    if !open.contains(&(context as usize)) {
        return None;
    }
    // SAFETY: the pointer is a live `Box<Ctx>`'s `ibv` (in OPEN until `ibv_close_device`
    // frees it).
    Some(unsafe { &*Ctx::of_ibv(context) })
}

/// `ibv_close_device`: 0, or -1 with errno.
#[no_mangle]
pub extern "C" fn bp_ibv_close_device(context: *mut IbvContext) -> c_int {
    let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    let Some(i) = open.iter().position(|&p| p == context as usize) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    open.swap_remove(i);
    // SAFETY: a live `Box<Ctx>` (it was in OPEN).
    let c = unsafe { &*Ctx::of_ibv(context) };
    let left = c.objects.load(Ordering::Relaxed);
    // The watcher ends now (woken on its own word); the eventfd closes with its last
    // reference.
    c.events.close();
    if left > 0 {
        // libibverbs closes a context whatever is left of it (the kernel cleans up after a
        // program that does not destroy everything — perftest's `ib_send_bw` client keeps
        // its receive CQ); the objects left keep pointing at the context, so its memory stays.
        return 0;
    }
    // SAFETY: it was a live `Box<Ctx>` from `ibv_open_device`, now out of OPEN, with no
    // object pointing at it.
    drop(unsafe { Box::from_raw(Ctx::of_ibv(context)) });
    0
}
abi::symver!(bp_ibv_close_device, "ibv_close_device@@IBVERBS_1.1");

/// `ibv_query_device`: 0 or an errno.
///
/// # Safety
/// `attr` is NULL or points to a writable `struct ibv_device_attr`.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_query_device(
    context: *mut IbvContext,
    attr: *mut IbvDeviceAttr,
) -> c_int {
    let Some(c) = ctx_of(context) else {
        return libc::EINVAL;
    };
    if attr.is_null() {
        return libc::EINVAL;
    }
    let d = c.ctx.query_device();
    let mut a = IbvDeviceAttr {
        node_guid: d.node_guid.to_be(),
        sys_image_guid: guid_be(0),
        max_mr_size: d.max_mr_size,
        page_size_cap: d.page_size_cap,
        vendor_id: 0,
        vendor_part_id: 0,
        max_qp: 1 << 16,
        max_qp_wr: d.max_qp_wr as c_int,
        max_srq: 1 << 16,
        max_srq_wr: 1 << 16,
        max_srq_sge: 32,
        max_sge: d.max_sge as c_int,
        max_sge_rd: d.max_sge as c_int,
        max_cq: 1 << 16,
        max_cqe: d.max_cqe as c_int,
        max_mr: 1 << 20,
        max_pd: 1 << 16,
        max_qp_rd_atom: d.max_qp_rd_atom as c_int,
        max_res_rd_atom: (d.max_qp_rd_atom as c_int) << 16,
        max_qp_init_rd_atom: d.max_qp_rd_atom as c_int,
        // What NICs report. The atomics are CPU atomics on the word, so they hold against the
        // CPU's too (`IBV_ATOMIC_GLOB` would be true), but UCX's verbs transport offers
        // hardware atomics only on a device that says HCA (and emulates them otherwise).
        atomic_cap: ATOMIC_HCA,
        max_ah: 1 << 16,
        max_pkeys: 1,
        phys_port_cnt: d.phys_port_cnt,
        ..IbvDeviceAttr::default()
    };
    put_str(&mut a.fw_ver, &d.fw_ver);
    // SAFETY: non-null, and the caller promises it is writable.
    unsafe { attr.write(a) };
    0
}
abi::symver!(bp_ibv_query_device, "ibv_query_device@@IBVERBS_1.1");

/// How many of the device's clock ticks make a millisecond (`hca_core_clock`, kHz): the
/// completion timestamps of `ibv_create_cq_ex` CQs are nanoseconds (a 1 GHz clock).
const CORE_CLOCK_KHZ: u64 = 1_000_000;

/// `verbs_context.query_device_ex` (the header's inline `ibv_query_device_ex`): the legacy
/// attributes, and the completion timestamps' clock (`completion_timestamp_mask`: all 64
/// bits, `hca_core_clock`: 1 GHz); everything else (ODP, TSO, RSS, packet pacing, …) zero,
/// as a device without them reports. 0 or an errno.
///
/// # Safety
/// `attr` is NULL or `attr_size` writable bytes.
unsafe extern "C" fn query_device_ex(
    context: *mut IbvContext,
    input: *const c_void,
    attr: *mut IbvDeviceAttrEx,
    attr_size: usize,
) -> c_int {
    let _ = input; // its comp_mask is checked 0 by the inline wrapper
    if attr.is_null() || attr_size < std::mem::size_of::<IbvDeviceAttr>() {
        return libc::EINVAL;
    }
    // SAFETY: `attr_size` writable bytes (caller).
    unsafe { std::ptr::write_bytes(attr.cast::<u8>(), 0, attr_size) };
    // SAFETY: the legacy attributes are the first part (checked size above).
    let rc = unsafe { bp_ibv_query_device(context, attr.cast()) };
    if rc != 0 {
        return rc;
    }
    let end = std::mem::offset_of!(IbvDeviceAttrEx, hca_core_clock) + 8;
    if attr_size >= end {
        // SAFETY: within the `attr_size` writable bytes.
        unsafe {
            (*attr).completion_timestamp_mask = u64::MAX;
            (*attr).hca_core_clock = CORE_CLOCK_KHZ;
        }
    }
    0
}

/// `ibv_query_port` (what the header's inline wrapper calls when the context has no extended
/// `query_port`): fills rdma-core's compat prefix of `ibv_port_attr`; 0 or an errno.
///
/// # Safety
/// `attr` is NULL or points to at least `COMPAT_PORT_ATTR_LEN` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_query_port(
    context: *mut IbvContext,
    port: u8,
    attr: *mut IbvPortAttr,
) -> c_int {
    let Some(c) = ctx_of(context) else {
        return libc::EINVAL;
    };
    if attr.is_null() {
        return libc::EINVAL;
    }
    let Ok(p) = c.ctx.query_port(port) else {
        return libc::EINVAL;
    };
    let a = IbvPortAttr {
        state: if p.state == backplane::verbs::PortState::Active {
            PORT_ACTIVE
        } else {
            PORT_DOWN
        },
        max_mtu: MTU_4096,
        active_mtu: MTU_4096,
        gid_tbl_len: 1,
        max_msg_sz: p.max_msg_sz,
        pkey_tbl_len: 1,
        lid: p.lid,
        max_vl_num: 1,
        active_width: 2,  // 4x
        active_speed: 32, // EDR
        phys_state: 5,    // LinkUp
        link_layer: LINK_LAYER_INFINIBAND,
        ..IbvPortAttr::default()
    };
    // SAFETY: the caller gives at least the compat prefix; we write only that much.
    unsafe {
        std::ptr::copy_nonoverlapping(
            std::ptr::from_ref(&a).cast::<u8>(),
            attr.cast::<u8>(),
            COMPAT_PORT_ATTR_LEN,
        )
    };
    0
}
abi::symver!(bp_ibv_query_port, "ibv_query_port@@IBVERBS_1.1");

/// `ibv_query_gid`: 0, or -1 (bad port or index).
///
/// # Safety
/// `gid` is NULL or points to 16 writable bytes.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_query_gid(
    context: *mut IbvContext,
    port: u8,
    index: c_int,
    gid: *mut [u8; 16],
) -> c_int {
    let Some(c) = ctx_of(context) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    if port != 1 || index != 0 || gid.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: non-null, 16 writable bytes per the contract.
    unsafe { gid.write(c.gid) };
    0
}
abi::symver!(bp_ibv_query_gid, "ibv_query_gid@@IBVERBS_1.1");

/// `_ibv_query_gid_ex` (behind the header's `ibv_query_gid_ex`): 0 or a positive errno
/// (`ENODATA` for an index past the table).
///
/// # Safety
/// `entry` is NULL or points to `entry_size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_query_gid_ex(
    context: *mut IbvContext,
    port: u32,
    index: u32,
    entry: *mut IbvGidEntry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    let Some(c) = ctx_of(context) else {
        return libc::EINVAL;
    };
    if flags != 0 || entry.is_null() || entry_size < std::mem::size_of::<IbvGidEntry>() {
        return libc::EINVAL;
    }
    if port != 1 {
        return libc::EINVAL;
    }
    if index != 0 {
        return libc::ENODATA;
    }
    let e = IbvGidEntry {
        gid: c.gid,
        gid_index: 0,
        port_num: 1,
        gid_type: GID_TYPE_ROCE_V2,
        ndev_ifindex: 0,
    };
    // SAFETY: non-null and large enough per the contract.
    unsafe { entry.write(e) };
    0
}
abi::symver!(bp_ibv_query_gid_ex, "_ibv_query_gid_ex@@IBVERBS_1.11");

/// `ibv_query_gid_type` (rdma-core private, used by `ibv_devinfo`): 0 or -1.
///
/// # Safety
/// `ty` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_query_gid_type(
    context: *mut IbvContext,
    port: u8,
    index: u32,
    ty: *mut c_int,
) -> c_int {
    if ctx_of(context).is_none() || port != 1 || index != 0 || ty.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: non-null, writable per the contract.
    unsafe { ty.write(GID_TYPE_SYSFS_ROCE_V2) };
    0
}
abi::symver!(
    bp_ibv_query_gid_type,
    "ibv_query_gid_type@@IBVERBS_PRIVATE_34"
);

/// `ibv_query_pkey`: the one P_Key, 0xffff (full member, default partition), big-endian.
///
/// # Safety
/// `pkey` is NULL or points to a writable `__be16`.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_query_pkey(
    context: *mut IbvContext,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    if ctx_of(context).is_none() || port != 1 || index != 0 || pkey.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: non-null, writable per the contract.
    unsafe { pkey.write(0xffffu16.to_be()) };
    0
}
abi::symver!(bp_ibv_query_pkey, "ibv_query_pkey@@IBVERBS_1.1");

/// `ibv_read_sysfs_file`: reads `dir/file` into `buf` (NUL-terminated, trailing newline
/// dropped); its length, or -1.
///
/// # Safety
/// `dir` and `file` are NUL-terminated strings; `buf` has `size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn bp_ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: NUL-terminated per the contract.
    let (d, f) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
    use std::os::unix::ffi::OsStrExt;
    let path = std::path::Path::new(std::ffi::OsStr::from_bytes(d.to_bytes()))
        .join(std::ffi::OsStr::from_bytes(f.to_bytes()));
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            return -1;
        }
    };
    let n = data.len().min(size - 1);
    // SAFETY: `buf` has `size` > n bytes.
    let out = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), size) };
    out[..n].copy_from_slice(&data[..n]);
    let n = if n > 0 && out[n - 1] == b'\n' {
        n - 1
    } else {
        n
    };
    out[n] = 0;
    n as c_int
}
abi::symver!(bp_ibv_read_sysfs_file, "ibv_read_sysfs_file@@IBVERBS_1.0");

/// `ibv_wc_status_str`: rdma-core's text for a completion status.
#[no_mangle]
pub extern "C" fn bp_ibv_wc_status_str(status: c_int) -> *const c_char {
    backplane::verbs::wc_status_cstr(status).as_ptr()
}
abi::symver!(bp_ibv_wc_status_str, "ibv_wc_status_str@@IBVERBS_1.1");

/// A static C string's pointer for the enum value `v` from `names`, or `unknown`.
fn name_of(names: &[&'static CStr], v: c_int) -> *const c_char {
    usize::try_from(v)
        .ok()
        .and_then(|i| names.get(i))
        .unwrap_or(&c"unknown")
        .as_ptr()
}

/// `ibv_event_type_str`: rdma-core's text for an asynchronous event type.
#[no_mangle]
pub extern "C" fn bp_ibv_event_type_str(event: c_int) -> *const c_char {
    const NAMES: [&CStr; 20] = [
        c"CQ error",
        c"local work queue catastrophic error",
        c"invalid request local work queue error",
        c"local access violation work queue error",
        c"communication established",
        c"send queue drained",
        c"path migrated",
        c"path migration request error",
        c"local catastrophic error",
        c"port active",
        c"port error",
        c"LID change",
        c"P_Key change",
        c"SM change",
        c"SRQ catastrophic error",
        c"SRQ limit reached",
        c"last WQE reached",
        c"client reregistration",
        c"GID table change",
        c"WQ fatal",
    ];
    name_of(&NAMES, event)
}
abi::symver!(bp_ibv_event_type_str, "ibv_event_type_str@@IBVERBS_1.1");

/// `ibv_node_type_str`: rdma-core's text for a node type (`IBV_NODE_CA` is 1).
#[no_mangle]
pub extern "C" fn bp_ibv_node_type_str(node_type: c_int) -> *const c_char {
    const NAMES: [&CStr; 8] = [
        c"unknown",
        c"InfiniBand channel adapter",
        c"InfiniBand switch",
        c"InfiniBand router",
        c"iWARP NIC",
        c"usNIC",
        c"usNIC UDP",
        c"unspecified",
    ];
    name_of(&NAMES, node_type)
}
abi::symver!(bp_ibv_node_type_str, "ibv_node_type_str@@IBVERBS_1.1");

/// `ibv_fork_init`: 0. Fabric memory is not pinned by a device (a registration is a shared
/// mapping, see `backplane::mem::adopt`), so a forked child breaks no registration and there
/// is nothing to prepare; `ibv_is_fork_initialized` says so.
#[no_mangle]
pub extern "C" fn bp_ibv_fork_init() -> c_int {
    0
}
abi::symver!(bp_ibv_fork_init, "ibv_fork_init@@IBVERBS_1.1");

/// `ibv_is_fork_initialized`: `IBV_FORK_UNNEEDED` (see [`bp_ibv_fork_init`]).
#[no_mangle]
pub extern "C" fn bp_ibv_is_fork_initialized() -> c_int {
    2
}
abi::symver!(
    bp_ibv_is_fork_initialized,
    "ibv_is_fork_initialized@@IBVERBS_1.13"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_truncated_and_terminated() {
        let mut b = [1 as c_char; 4];
        put_str(&mut b, "abcdef");
        assert_eq!(b, [b'a' as c_char, b'b' as c_char, b'c' as c_char, 0]);
    }

    #[test]
    fn a_pointer_never_handed_out_is_refused() {
        let mut x = 0u64;
        assert!(dev_of(std::ptr::from_mut(&mut x).cast()).is_none());
        assert!(ctx_of(std::ptr::from_mut(&mut x).cast()).is_none());
        assert_eq!(bp_ibv_close_device(std::ptr::from_mut(&mut x).cast()), -1);
    }

    #[test]
    fn gid_without_ip_is_link_local_with_the_guid() {
        let g = gid_of("no-such-fabric-gid", 3);
        assert_eq!(&g[..2], &[0xfe, 0x80]);
        assert_eq!(&g[8..], &guid_be(3).to_ne_bytes());
    }
}
