//! The C ABI of backplane: fabrics and datagram endpoints (`include/backplane/dgram.h`, this
//! file) and RDMA verbs (`include/backplane/verbs.h`, [`verbs`]).
//!
//! Conventions follow libibverbs and POSIX: NULL or -1 on error with `errno` set, and a
//! thread-local one-line message in `bp_last_error()`.
//!
//! Handles are validated, never trusted: every handle a caller passes is looked up in a
//! registry of live objects before it is touched, so a NULL, closed or made-up handle is
//! `EBADF`, not a crash. The registry holds an `Arc` per object and a call clones it, so a
//! close racing with a call on another thread frees the object only when the call is done.
//! Opaque handles (fabrics, endpoints, DMA engine sets) are never-reused numbers shaped like
//! pointers, not addresses, so a stale handle can never name an object created after it was
//! closed. (Verbs objects are structs C reads, as in libibverbs, so their handles are
//! addresses.)
//! No panic crosses the boundary: each entry point runs under `catch_unwind`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use backplane::dgram::{Addr, DgramError, Endpoint, Wait};
use backplane::fabric::ctl::ErrorKind;
use backplane::fabric::{Fabric, FabricError};

pub mod dma;
pub mod verbs;

/// `struct bp_addr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BpAddr {
    /// Slot.
    pub node: u32,
    /// Port.
    pub port: u32,
}

/// `struct bp_dgram_stats`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct BpDgramStats {
    /// Datagrams sent.
    pub sent: u64,
    /// Bytes sent.
    pub sent_bytes: u64,
    /// Datagrams received.
    pub received: u64,
    /// Bytes received.
    pub received_bytes: u64,
    /// Datagrams dropped.
    pub dropped: u64,
}

/// `struct bp_fabric` (opaque to C).
pub struct BpFabric {
    pub(crate) fabric: Fabric,
}

/// `struct bp_endpoint` (opaque to C).
pub struct BpEndpoint {
    ep: Mutex<Endpoint>,
    fabric: usize,
}

enum Obj {
    Fabric(Arc<BpFabric>),
    Endpoint(Arc<BpEndpoint>),
}

/// A fresh opaque handle: a number no other handle of this process had or will have, aligned
/// and non-NULL like a pointer. Never dereferenced: it is only a registry key.
pub(crate) fn new_handle<T>() -> *mut T {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(1);
    // 2^60 handles before wrapping: not reachable.
    (NEXT.fetch_add(1, Ordering::Relaxed) << 4) as *mut T
}

fn registry() -> &'static Mutex<HashMap<usize, Obj>> {
    static R: OnceLock<Mutex<HashMap<usize, Obj>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// An error crossing the boundary: errno and message.
pub(crate) struct CErr(pub(crate) c_int, pub(crate) String);

pub(crate) fn fail(e: CErr) {
    LAST.with(|l| {
        *l.borrow_mut() = CString::new(e.1.replace('\0', " ")).unwrap_or_default();
    });
    // SAFETY: __errno_location returns this thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e.0 };
}

pub(crate) fn fabric_errno(e: &FabricError) -> c_int {
    match e {
        FabricError::NotRunning(_) => libc::ENOENT,
        FabricError::BadName(_) | FabricError::NoSuchNode { .. } => libc::EINVAL,
        FabricError::NodeNotReady { .. } => libc::ENETDOWN,
        FabricError::Restarted { .. } => libc::ESHUTDOWN,
        FabricError::Refused { kind, .. } => match kind {
            ErrorKind::InUse => libc::EADDRINUSE,
            ErrorKind::NotFound => libc::ECONNREFUSED,
            ErrorKind::NodeDown => libc::ENETDOWN,
            ErrorKind::NoSpace => libc::ENOSPC,
            ErrorKind::Invalid => libc::EINVAL,
            ErrorKind::NoRoute => libc::EHOSTUNREACH,
        },
        FabricError::Mem(_) => libc::ENOMEM,
        FabricError::Layout(_) => libc::EPROTO,
        FabricError::Protocol(_) | FabricError::Io(_) | FabricError::SupervisorGone(_) => libc::EIO,
    }
}

impl From<FabricError> for CErr {
    fn from(e: FabricError) -> Self {
        CErr(fabric_errno(&e), e.to_string())
    }
}

impl From<DgramError> for CErr {
    fn from(e: DgramError) -> Self {
        let errno = match &e {
            DgramError::WouldBlock => libc::EAGAIN,
            DgramError::TimedOut => libc::ETIMEDOUT,
            DgramError::TooBig(_) | DgramError::BufferTooSmall { .. } => libc::EMSGSIZE,
            DgramError::NodeDown(_) => libc::ENETDOWN,
            DgramError::Closed(_) => libc::ESHUTDOWN,
            DgramError::Unreachable(_) => libc::ECONNREFUSED,
            DgramError::NoRoute(_) => libc::EHOSTUNREACH,
            DgramError::Corrupt { .. } => libc::EPROTO,
            DgramError::Fabric(f) => fabric_errno(f),
        };
        CErr(errno, e.to_string())
    }
}

pub(crate) fn bad_handle(what: &str) -> CErr {
    CErr(
        libc::EBADF,
        format!("{what} is NULL, closed or not a valid handle"),
    )
}

pub(crate) fn get_fabric(p: *const BpFabric) -> Result<Arc<BpFabric>, CErr> {
    match registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(p as usize))
    {
        Some(Obj::Fabric(f)) => Ok(f.clone()),
        _ => Err(bad_handle("fabric")),
    }
}

fn get_endpoint(p: *const BpEndpoint) -> Result<Arc<BpEndpoint>, CErr> {
    match registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(p as usize))
    {
        Some(Obj::Endpoint(e)) => Ok(e.clone()),
        _ => Err(bad_handle("endpoint")),
    }
}

/// Runs an entry point: errors set errno and the message, panics become EIO.
pub(crate) fn guard<T>(on_err: T, f: impl FnOnce() -> Result<T, CErr>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            fail(e);
            on_err
        }
        Err(_) => {
            fail(CErr(
                libc::EIO,
                "internal error in backplane (a bug): please report it".into(),
            ));
            on_err
        }
    }
}

fn wait_of(timeout_ms: c_int) -> Result<Wait, CErr> {
    match timeout_ms {
        -1 => Ok(Wait::Forever),
        0 => Ok(Wait::Never),
        t if t > 0 => Ok(Wait::For(Duration::from_millis(t as u64))),
        t => Err(CErr(
            libc::EINVAL,
            format!("timeout {t} ms: use BP_WAIT_FOREVER (-1), BP_NO_WAIT (0) or a positive value"),
        )),
    }
}

/// `bp_fabric_attach`.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn bp_fabric_attach(name: *const c_char) -> *mut BpFabric {
    guard(std::ptr::null_mut(), || {
        let name = if name.is_null() {
            std::env::var("BACKPLANE_FABRIC").unwrap_or_else(|_| "default".into())
        } else {
            // SAFETY: the caller promises a NUL-terminated string.
            unsafe { CStr::from_ptr(name) }
                .to_str()
                .map_err(|_| CErr(libc::EINVAL, "fabric name is not UTF-8".into()))?
                .to_owned()
        };
        let f = Arc::new(BpFabric {
            fabric: Fabric::attach(&name)?,
        });
        let p = new_handle::<BpFabric>();
        registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(p as usize, Obj::Fabric(f));
        Ok(p)
    })
}

/// `bp_fabric_detach`.
#[no_mangle]
pub extern "C" fn bp_fabric_detach(fabric: *mut BpFabric) -> c_int {
    guard(-1, || {
        let mut r = registry().lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(r.get(&(fabric as usize)), Some(Obj::Fabric(_))) {
            return Err(bad_handle("fabric"));
        }
        let busy = r
            .values()
            .any(|o| matches!(o, Obj::Endpoint(e) if e.fabric == fabric as usize));
        if busy {
            return Err(CErr(
                libc::EBUSY,
                "close the fabric's endpoints before detaching it".into(),
            ));
        }
        if verbs::fabric_in_use(fabric as usize) {
            return Err(CErr(
                libc::EBUSY,
                "close the verbs devices opened on this fabric before detaching it".into(),
            ));
        }
        r.remove(&(fabric as usize));
        Ok(0)
    })
}

/// `bp_fabric_nodes`.
#[no_mangle]
pub extern "C" fn bp_fabric_nodes(fabric: *const BpFabric) -> c_int {
    guard(-1, || Ok(get_fabric(fabric)?.fabric.nodes() as c_int))
}

/// `bp_dgram_bind`.
#[no_mangle]
pub extern "C" fn bp_dgram_bind(fabric: *mut BpFabric, node: u32, port: u32) -> *mut BpEndpoint {
    guard(std::ptr::null_mut(), || {
        let f = get_fabric(fabric)?;
        let ep = f.fabric.node(node)?.bind(port)?;
        let e = Arc::new(BpEndpoint {
            ep: Mutex::new(ep),
            fabric: fabric as usize,
        });
        let p = new_handle::<BpEndpoint>();
        registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(p as usize, Obj::Endpoint(e));
        Ok(p)
    })
}

/// `bp_dgram_close`.
#[no_mangle]
pub extern "C" fn bp_dgram_close(ep: *mut BpEndpoint) -> c_int {
    guard(-1, || {
        let removed = registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(ep as usize));
        match removed {
            Some(Obj::Endpoint(_)) => Ok(0),
            Some(other) => {
                // Not an endpoint: put it back untouched.
                registry()
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(ep as usize, other);
                Err(bad_handle("endpoint"))
            }
            None => Err(bad_handle("endpoint")),
        }
    })
}

/// `bp_dgram_local_addr`.
///
/// # Safety
/// `addr` is NULL or points to a writable `struct bp_addr`.
#[no_mangle]
pub unsafe extern "C" fn bp_dgram_local_addr(ep: *const BpEndpoint, addr: *mut BpAddr) -> c_int {
    guard(-1, || {
        let e = get_endpoint(ep)?;
        if addr.is_null() {
            return Err(CErr(libc::EINVAL, "addr is NULL".into()));
        }
        let a = e.ep.lock().unwrap_or_else(|p| p.into_inner()).local_addr();
        // SAFETY: non-null, and the caller promises it is writable.
        unsafe {
            *addr = BpAddr {
                node: a.node,
                port: a.port,
            }
        };
        Ok(0)
    })
}

/// `bp_dgram_send`.
///
/// # Safety
/// `buf` points to `len` readable bytes (or `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn bp_dgram_send(
    ep: *mut BpEndpoint,
    dst: BpAddr,
    buf: *const c_void,
    len: usize,
    timeout_ms: c_int,
) -> c_int {
    guard(-1, || {
        let e = get_endpoint(ep)?;
        let wait = wait_of(timeout_ms)?;
        if buf.is_null() && len > 0 {
            return Err(CErr(libc::EINVAL, "buf is NULL".into()));
        }
        let data: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: non-null, and the caller promises `len` readable bytes.
            unsafe { std::slice::from_raw_parts(buf.cast(), len) }
        };
        let mut g = e.ep.lock().unwrap_or_else(|p| p.into_inner());
        g.send(Addr::new(dst.node, dst.port), data, wait)?;
        Ok(0)
    })
}

/// `bp_dgram_recv`.
///
/// # Safety
/// `buf` points to `len` writable bytes (or `len` is 0); `src` and `needed` are NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn bp_dgram_recv(
    ep: *mut BpEndpoint,
    buf: *mut c_void,
    len: usize,
    src: *mut BpAddr,
    needed: *mut usize,
    timeout_ms: c_int,
) -> isize {
    guard(-1, || {
        let e = get_endpoint(ep)?;
        let wait = wait_of(timeout_ms)?;
        if buf.is_null() && len > 0 {
            return Err(CErr(libc::EINVAL, "buf is NULL".into()));
        }
        let out: &mut [u8] = if len == 0 {
            &mut []
        } else {
            // SAFETY: non-null, and the caller promises `len` writable bytes.
            unsafe { std::slice::from_raw_parts_mut(buf.cast(), len) }
        };
        let mut g = e.ep.lock().unwrap_or_else(|p| p.into_inner());
        let r = g.recv(out, wait);
        match r {
            Ok((n, from)) => {
                if !src.is_null() {
                    // SAFETY: non-null, and the caller promises it is writable.
                    unsafe {
                        *src = BpAddr {
                            node: from.node,
                            port: from.port,
                        }
                    };
                }
                Ok(n as isize)
            }
            Err(DgramError::BufferTooSmall { need, .. }) => {
                if !needed.is_null() {
                    // SAFETY: non-null, and the caller promises it is writable.
                    unsafe { *needed = need };
                }
                Err(DgramError::BufferTooSmall { have: len, need }.into())
            }
            Err(e) => Err(e.into()),
        }
    })
}

/// `bp_dgram_reader`: takes (0) or leaves (nonzero) one datagram, given in place.
pub type BpDgramReader = unsafe extern "C" fn(
    ctx: *mut c_void,
    src: *const BpAddr,
    payload: *const c_void,
    len: usize,
) -> c_int;

/// `bp_dgram_recv_many`.
///
/// # Safety
/// `read` is a valid function that may be called with `ctx` (passed through untouched) while
/// this call lasts; it must not call into this endpoint.
#[no_mangle]
pub unsafe extern "C" fn bp_dgram_recv_many(
    ep: *mut BpEndpoint,
    max: usize,
    timeout_ms: c_int,
    read: Option<BpDgramReader>,
    ctx: *mut c_void,
) -> isize {
    guard(-1, || {
        let e = get_endpoint(ep)?;
        let wait = wait_of(timeout_ms)?;
        let Some(read) = read else {
            return Err(CErr(libc::EINVAL, "read is NULL".into()));
        };
        if max == 0 {
            return Err(CErr(libc::EINVAL, "max is 0".into()));
        }
        let mut left = false;
        let mut g = e.ep.lock().unwrap_or_else(|p| p.into_inner());
        let r = g.recv_many_with(wait, max, |from, payload| {
            let src = BpAddr {
                node: from.node,
                port: from.port,
            };
            // SAFETY: the caller promises `read` may be called with `ctx`; `src` and the
            // payload (`len` bytes, in ring or UCX memory) are valid for the call.
            let took = unsafe { read(ctx, &src, payload.as_ptr().cast(), payload.len()) };
            if took != 0 {
                left = true;
                return Err(DgramError::WouldBlock);
            }
            Ok(())
        });
        match r {
            Ok(n) => Ok(n as isize),
            Err(DgramError::WouldBlock) if left => Err(CErr(
                libc::ECANCELED,
                "the reader left the first datagram (it stays queued)".into(),
            )),
            Err(e) => Err(e.into()),
        }
    })
}

/// `bp_dgram_stats`.
///
/// # Safety
/// `stats` is NULL or points to a writable `struct bp_dgram_stats`.
#[no_mangle]
pub unsafe extern "C" fn bp_dgram_stats(ep: *const BpEndpoint, stats: *mut BpDgramStats) -> c_int {
    guard(-1, || {
        let e = get_endpoint(ep)?;
        if stats.is_null() {
            return Err(CErr(libc::EINVAL, "stats is NULL".into()));
        }
        let s = e.ep.lock().unwrap_or_else(|p| p.into_inner()).stats();
        // SAFETY: non-null, and the caller promises it is writable.
        unsafe {
            *stats = BpDgramStats {
                sent: s.sent,
                sent_bytes: s.sent_bytes,
                received: s.received,
                received_bytes: s.received_bytes,
                dropped: s.dropped,
            }
        };
        Ok(0)
    })
}

/// `bp_last_error`.
#[no_mangle]
pub extern "C" fn bp_last_error() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_and_made_up_handles_are_ebadf_not_crashes() {
        let errno = || std::io::Error::last_os_error().raw_os_error();
        assert_eq!(bp_fabric_nodes(std::ptr::null()), -1);
        assert_eq!(errno(), Some(libc::EBADF));
        assert_eq!(bp_dgram_close(0x1000 as *mut BpEndpoint), -1);
        assert_eq!(errno(), Some(libc::EBADF));
        assert!(bp_dgram_bind(std::ptr::dangling_mut::<BpFabric>(), 1, 1).is_null());
        assert_eq!(errno(), Some(libc::EBADF));
        // SAFETY: bp_last_error returns a valid NUL-terminated string.
        let msg = unsafe { CStr::from_ptr(bp_last_error()) }
            .to_string_lossy()
            .into_owned();
        assert!(msg.contains("not a valid handle"), "{msg}");
    }

    #[test]
    fn attaching_to_no_fabric_is_enoent() {
        let name = CString::new("capi-no-such-fabric").unwrap();
        // SAFETY: a valid C string.
        let f = unsafe { bp_fabric_attach(name.as_ptr()) };
        assert!(f.is_null());
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ENOENT)
        );
    }

    #[test]
    fn bad_timeouts_are_einval() {
        assert!(wait_of(-2).is_err());
        assert!(matches!(wait_of(-1), Ok(Wait::Forever)));
        assert!(matches!(wait_of(0), Ok(Wait::Never)));
    }
}
