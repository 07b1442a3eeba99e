//! The thread-local registry.

use super::*;

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
pub(crate) const QUARANTINE: usize = 4096;

/// Destroyed handle structs, oldest first, with the function that frees each.
pub(crate) fn quarantine(
) -> std::sync::MutexGuard<'static, std::collections::VecDeque<(usize, Free)>> {
    static Q: OnceLock<Mutex<std::collections::VecDeque<(usize, Free)>>> = OnceLock::new();
    Q.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

pub(crate) type Free = unsafe fn(usize);

/// # Safety
/// `p` came from `Box::leak` of a `Box<T>` and is freed once.
pub(crate) unsafe fn free_boxed<T>(p: usize) {
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
    pub(crate) _c: Owned<BpContext>,
    pub(crate) ctx: Context,
}
pub(crate) struct PdObj {
    pub(crate) _c: Owned<BpPd>,
    pub(crate) pd: Pd,
    pub(crate) ctx: usize,
}
pub(crate) struct MrObj {
    pub(crate) _c: Owned<BpMr>,
    pub(crate) _mr: Mr,
    pub(crate) pd: usize,
    pub(crate) ctx: usize,
    pub(crate) key: u32,
}
pub(crate) struct ChObj {
    pub(crate) c: Owned<BpCompChannel>,
    pub(crate) ch: CompChannel,
    pub(crate) ctx: usize,
}
pub(crate) struct CqObj {
    pub(crate) c: Owned<BpCq>,
    pub(crate) cq: Cq,
    pub(crate) ctx: usize,
    pub(crate) channel: usize,
    pub(crate) unacked: Cell<u32>,
}
pub(crate) struct QpObj {
    pub(crate) c: Owned<BpQp>,
    pub(crate) qp: Qp,
    pub(crate) pd: usize,
    pub(crate) ctx: usize,
    pub(crate) send_cq: usize,
    pub(crate) recv_cq: usize,
    /// Its shared receive queue (0: none).
    pub(crate) srq: usize,
    pub(crate) sq_sig_all: bool,
}
pub(crate) struct SrqObj {
    pub(crate) _c: Owned<BpSrq>,
    pub(crate) srq: Srq,
    pub(crate) pd: usize,
    pub(crate) ctx: usize,
}
pub(crate) struct AhObj {
    pub(crate) _c: Owned<BpAh>,
    pub(crate) ah: Ah,
    pub(crate) pd: usize,
}
pub(crate) struct ListenerObj {
    pub(crate) _c: Owned<BpListener>,
    pub(crate) l: RefCell<Listener>,
    pub(crate) ctx: usize,
}

pub(crate) enum VObj {
    Ctx(CtxObj),
    Pd(PdObj),
    Mr(MrObj),
    Channel(ChObj),
    Cq(CqObj),
    Qp(QpObj),
    Ah(AhObj),
    Srq(SrqObj),
    /// Boxed: a listener holds a datagram endpoint, several times any other object's size.
    Listener(Box<ListenerObj>),
    /// A raw-DMA queue (`dma.h`): it uses its context, so it lives in the same registry.
    DmaQueue(crate::dma::DmaQueueObj),
}

impl VObj {
    /// The handles this object depends on (which cannot be destroyed before it).
    pub(crate) fn parents(&self) -> [usize; 5] {
        match self {
            VObj::Ctx(_) => [0; 5],
            VObj::Pd(p) => [p.ctx, 0, 0, 0, 0],
            VObj::Mr(m) => [m.ctx, m.pd, 0, 0, 0],
            VObj::Channel(c) => [c.ctx, 0, 0, 0, 0],
            VObj::Cq(c) => [c.ctx, c.channel, 0, 0, 0],
            VObj::Qp(q) => [q.ctx, q.pd, q.send_cq, q.recv_cq, q.srq],
            VObj::Ah(a) => [a.pd, 0, 0, 0, 0],
            VObj::Srq(s) => [s.ctx, s.pd, 0, 0, 0],
            VObj::Listener(l) => [l.ctx, 0, 0, 0, 0],
            VObj::DmaQueue(q) => [q.ctx, 0, 0, 0, 0],
        }
    }
}

/// Handle-keyed maps hash with FxHash: the keys are our own numbers and lkeys (not
/// attacker-chosen), and SipHash costs more than the rest of a `bp_poll_cq` lookup.
pub(crate) type FastMap<K, V> = rustc_hash::FxHashMap<K, V>;

/// Who owns a handle: for the "another thread" error and for `bp_fabric_detach`.
pub(crate) struct Owner {
    pub(crate) thread: ThreadId,
    /// The fabric handle (contexts only; 0 otherwise).
    pub(crate) fabric: usize,
}

pub(crate) fn owners() -> std::sync::MutexGuard<'static, HashMap<usize, Owner>> {
    static O: OnceLock<Mutex<HashMap<usize, Owner>>> = OnceLock::new();
    O.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

pub(crate) struct Local {
    pub(crate) thread: ThreadId,
    pub(crate) objs: FastMap<usize, VObj>,
    /// (context, lkey) -> (address, length) of this thread's regions, to turn pointers in
    /// scatter/gather entries into offsets.
    pub(crate) mrs: FastMap<(usize, u32), (usize, usize)>,
    pub(crate) serial: u32,
    /// `bp_poll_cq`'s staging buffer, kept so a spinning poll does not clear 768 B each time.
    pub(crate) wcs: RefCell<[Wc; 16]>,
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
                VObj::Cq(_) | VObj::Srq(_) => 1,
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
getter!(get_srq, Srq, SrqObj, "shared receive queue");
getter!(get_listener, Listener, ListenerObj, "listener");
