//! RDMA verbs over the fabric: the libibverbs object model — device context, protection
//! domain, memory region, completion queue (+ completion channel), queue pair (RC, UC, UD),
//! address handle — with its names, state machine and completion statuses, so code written
//! for libibverbs reads the same here.
//!
//! | libibverbs | here |
//! | --- | --- |
//! | `ibv_open_device` / `ibv_close_device` | [`Context::open`] / drop |
//! | `ibv_query_device`, `ibv_query_port` | [`Context::query_device`], [`Context::query_port`] |
//! | `ibv_alloc_pd` / `ibv_dealloc_pd` | [`Context::alloc_pd`] / drop |
//! | `ibv_reg_mr` / `ibv_dereg_mr` | [`Pd::alloc_mr`] (alias [`Pd::reg_mr`]) / drop or [`Mr::dereg`] |
//! | `ibv_create_comp_channel`, `ibv_get_cq_event`, `ibv_ack_cq_events` | [`Context::create_comp_channel`], [`CompChannel::get_cq_event`], [`CompChannel::ack_cq_events`] |
//! | `ibv_create_cq` / `ibv_destroy_cq` | [`Context::create_cq`] / drop |
//! | `ibv_poll_cq`, `ibv_req_notify_cq` | [`Cq::poll`], [`Cq::req_notify`] |
//! | `ibv_create_qp` / `ibv_destroy_qp` | [`Pd::create_qp`] / drop |
//! | `ibv_modify_qp`, `ibv_query_qp` | [`Qp::modify`], [`Qp::query`] |
//! | `ibv_post_send`, `ibv_post_recv` | [`Qp::post_send`], [`Qp::post_recv`] |
//! | `ibv_create_ah` | [`Pd::create_ah`] |
//! | `ibv_create_srq` / `ibv_destroy_srq`, `ibv_post_srq_recv`, `ibv_query_srq` | [`Pd::create_srq`] / drop, [`Srq::post_recv`], [`Srq::query`]; QPs on it: [`QpInitAttr::srq`] |
//! | `rdma_listen` / `rdma_accept`, `rdma_connect` | [`cm::Listener::bind`] / [`cm::Listener::accept`], [`cm::connect`] |
//!
//! Differences a libibverbs user should know:
//! - **Registrable memory is memory the library provides.** Peers map a region, so it must be
//!   shareable: [`Pd::alloc_mr`] allocates a memfd-backed buffer and registers it; the
//!   application fills and reads it by copy ([`Mr::write`], [`Mr::read`]): peers may write it
//!   at any time, so it is never lent out as a `&[u8]` (see `docs/architecture.md`).
//! - **Addresses are offsets.** `Sge::addr` and `remote_addr` are offsets into the region
//!   (zero-based, like `IBV_ACCESS_ZERO_BASED`), never pointers.
//! - **LIDs are node slots**; there is one port (1); the MTU is 4096.
//! - **A context and its objects belong to one thread** (they are not `Send`): the data path
//!   takes no lock. Open one context per thread.
//! - **Progress happens in your calls**: `poll`, `post_send`, `post_recv` and `req_notify` move
//!   work along (there is no adapter doing it in the background); a completion channel's
//!   watcher thread only wakes you.
//!
//! Data paths and guarantees are described in `engine.rs`; the supervisor's registry of
//! regions and QPs (grants, read-only mappings) in [`registry`], hosted by the supervisor.

pub mod channel;
pub mod cm;
pub(crate) mod direct;
pub(crate) mod engine;
pub mod fsm;
pub mod registry;
mod types;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

pub use channel::{CompChannel, CqEvent};
pub use direct::sends_delivered_in_place;
pub use types::*;

use crate::fabric::{FabricError, Node};
use crate::mem::{MemError, Region, Span};
use crate::sync::Ordering;
use crate::transport::shm::{RegionMaps, ShmTransport};
use crate::wire::registry::{VerbsRequest, VerbsResponse};
use crate::wire::verbs::*;
use crate::wire::NodeState;
use engine::{CqState, Cqs, Ctx, Engine, LocalMr, MrTable, QpEngine};

/// Default inbound ring of an RC/UC QP.
pub const DEFAULT_RING: u32 = 512 * 1024;

/// A device context (`ibv_context`) on one node of a fabric.
#[derive(Debug, Clone)]
pub struct Context {
    inner: Rc<Ctx>,
}

impl Context {
    /// Opens the fabric "device" of `node` (`ibv_open_device`).
    pub fn open(node: &Node) -> Result<Self, VerbsError> {
        node.check_current()?;
        let (resp, _) = node
            .fabric()
            .call_service::<VerbsResponse>(&VerbsRequest::OpenContext { slot: node.slot() }, &[])?;
        let VerbsResponse::ContextOpened { event_off } = resp else {
            return Err(FabricError::Protocol(format!("{resp:?}")).into());
        };
        let win = node.fabric().window(node.slot())?;
        win.check(event_off, EV_LEN, 64)?;
        Ok(Self {
            inner: Rc::new(Ctx {
                node: node.clone(),
                transport: Arc::new(ShmTransport::new(node.fabric().clone())),
                links: ShmTransport::new(node.fabric().clone()),
                win,
                event_off,
                yield_every: node.fabric().yield_every(),
                eng: RefCell::new(Engine::default()),
            }),
        })
    }

    /// The node this context runs on.
    pub fn node(&self) -> &Node {
        &self.inner.node
    }

    /// Runs `f` on this context's region `key` (None if it has none by that key): how the DMA
    /// queues of this context find local regions without a second table.
    /// How this context reaches peers (for the DMA queues it feeds).
    pub(crate) fn transport(&self) -> Arc<dyn crate::transport::Transport> {
        self.inner.transport.clone()
    }

    pub(crate) fn with_local_mr<R>(&self, key: u32, f: impl FnOnce(Option<&LocalMr>) -> R) -> R {
        f(self.inner.eng.borrow().mrs.get(key))
    }

    /// Device attributes (`ibv_query_device`).
    pub fn query_device(&self) -> DeviceAttr {
        DeviceAttr {
            fw_ver: env!("CARGO_PKG_VERSION").to_string(),
            node_guid: (u64::from(self.inner.node.slot()) << 32) | 0x0b0b,
            max_mr_size: 1 << 40,
            page_size_cap: 4096,
            max_qp_wr: 1 << 16,
            max_sge: 32,
            max_cqe: 1 << 22,
            max_qp_rd_atom: 16,
            atomic_cap: AtomicCap::Glob,
            phys_port_cnt: 1,
        }
    }

    /// Port attributes (`ibv_query_port`); the only port is 1.
    pub fn query_port(&self, port: u8) -> Result<PortAttr, VerbsError> {
        if port != 1 {
            return Err(VerbsError::inval(format!(
                "port {port} does not exist (ports: 1)"
            )));
        }
        let n = &self.inner.node;
        let up = n
            .fabric()
            .node_info(n.slot())
            .is_ok_and(|i| i.state == NodeState::Ready);
        Ok(PortAttr {
            state: if up {
                PortState::Active
            } else {
                PortState::Down
            },
            max_mtu: Mtu::Mtu4096,
            active_mtu: Mtu::Mtu4096,
            lid: n.slot() as u16,
            max_msg_sz: MAX_MSG,
        })
    }

    /// A protection domain (`ibv_alloc_pd`).
    pub fn alloc_pd(&self) -> Pd {
        let mut e = self.inner.eng.borrow_mut();
        e.next_pd += 1;
        Pd {
            ctx: self.inner.clone(),
            id: e.next_pd,
        }
    }

    /// A completion channel (`ibv_create_comp_channel`).
    pub fn create_comp_channel(&self) -> Result<CompChannel, VerbsError> {
        CompChannel::new(
            self.inner.node.fabric().clone(),
            self.inner.win.clone(),
            self.inner.event_off,
        )
    }

    /// A completion queue of `cqe` entries, optionally reporting to `channel`
    /// (`ibv_create_cq`). Receives stop being taken from the fabric while it is full.
    pub fn create_cq(&self, cqe: usize, channel: Option<&CompChannel>) -> Result<Cq, VerbsError> {
        if cqe == 0 || cqe > 1 << 22 {
            return Err(VerbsError::inval(format!("cqe {cqe} is not 1..=4194304")));
        }
        let mut e = self.inner.eng.borrow_mut();
        let st = CqState {
            entries: engine::CqRing::with_capacity(cqe.min(4096)),
            cap: cqe,
            qps: Vec::new(),
            channel: channel.map(|c| c.shared.clone()),
            handle_alive: true,
            overruns: 0,
        };
        let id = match e.cqs.iter().position(|c| c.is_none()) {
            Some(i) => {
                e.cqs[i] = Some(st);
                i
            }
            None => {
                e.cqs.push(Some(st));
                e.cqs.len() - 1
            }
        };
        Ok(Cq {
            ctx: self.inner.clone(),
            id,
        })
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        let _ = self.node.fabric().call_service::<VerbsResponse>(
            &VerbsRequest::CloseContext {
                slot: self.node.slot(),
                event_off: self.event_off,
            },
            &[],
        );
    }
}

/// A protection domain (`ibv_pd`): regions and QPs of one PD work together only.
#[derive(Debug, Clone)]
pub struct Pd {
    ctx: Rc<Ctx>,
    id: u32,
}

impl Pd {
    /// Allocates `len` bytes of shareable memory (zero-filled) and registers them with
    /// `access` — what `malloc` + `ibv_reg_mr` are in libibverbs code. REMOTE_WRITE and
    /// REMOTE_ATOMIC need LOCAL_WRITE, as in libibverbs.
    pub fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<Mr, VerbsError> {
        check_mr_args(len, access)?;
        let region = self.mr_region(len)?;
        let maps = RegionMaps::single(Arc::new(region));
        self.register(maps, None, (0, len), access, 0, Backing::Own)
    }

    /// Registers memory the program allocated (`ibv_reg_mr` on a `malloc`/`mmap` buffer):
    /// the pages under `[addr, addr + len)` are put under a new region in place — their bytes
    /// and addresses kept (see [`crate::mem::Adopted`]) — so peers reach them and the program
    /// sees a peer's RDMA WRITE at `addr`. Scatter/gather entries and peers' `remote_addr`
    /// name the bytes by `iova + (address - addr)` (libibverbs passes `iova = addr`). At drop,
    /// the pages become private memory again (with their bytes).
    ///
    /// # Safety
    /// `[addr, addr + len)` is memory of this process that no other thread writes during the
    /// call, and whose pages may change backing (the notes of [`crate::mem::Adopted`]).
    pub unsafe fn reg_user_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        iova: u64,
    ) -> Result<Mr, VerbsError> {
        check_mr_args(len, access)?;
        if iova.checked_add(len as u64).is_none() {
            return Err(VerbsError::inval(format!("iova {iova:#x} + {len} wraps")));
        }
        let page_start = addr as usize & !4095;
        let skew = addr as usize - page_start;
        let pages = (skew + len).div_ceil(4096) * 4096;
        let cannot = |e: &dyn std::fmt::Display| cannot_register(addr, len, e);
        if let Some(shared) =
            crate::mem::shared_backing(page_start, pages).map_err(|e| cannot(&e))?
        {
            return self.reg_shared(shared, (addr, len, skew, pages), access, iova);
        }
        let region = Arc::new(self.mr_region(pages)?);
        // SAFETY: the caller's contract is `Adopted::new`'s; the region holds `pages` bytes
        // after its header page.
        let adopted = unsafe {
            crate::mem::Adopted::new_shared(&region, MR_DATA_OFF, page_start as *mut u8, pages)
        }
        .map_err(|e| cannot(&e))?;
        let maps = RegionMaps::single(region);
        self.register(
            maps,
            None,
            (skew as u32, len),
            access,
            iova,
            Backing::Adopted(adopted),
        )
    }

    /// Registers memory that is shared already (a `MAP_SHARED` mapping, or pages of another
    /// region) where it is: a header memfd of its own, the data the object's file from the
    /// range's offset (`crate::mem::shared_backing`). Nothing moves; peers map the same object.
    fn reg_shared(
        &self,
        shared: crate::mem::SharedBacking,
        (addr, len, skew, pages): (*mut u8, usize, usize, usize),
        access: AccessFlags,
        iova: u64,
    ) -> Result<Mr, VerbsError> {
        let cannot = |e: &dyn std::fmt::Display| cannot_register(addr, len, e);
        if access.contains(AccessFlags::LOCAL_WRITE) && !shared.writable {
            return Err(cannot(
                &"the memory is mapped read-only and the access asks to write it",
            ));
        }
        let fd = shared.fd;
        crate::verbs::registry::shared_memory_size(&fd).map_err(|e| cannot(&e))?;
        let data =
            Region::map_range(fd, shared.off, pages, shared.writable).map_err(|e| cannot(&e))?;
        if data.len() < pages {
            return Err(cannot(&"the shared memory ends before the range does"));
        }
        let maps = RegionMaps {
            // (A region of no data bytes: its header page.)
            header: Arc::new(self.mr_region(0)?),
            data: Arc::new(data),
            data_off: 0,
        };
        let shared_at = Backing::Shared {
            at: addr as usize,
            _holds: shared.holds,
        };
        self.register(
            maps,
            Some(shared.off),
            (skew as u32, len),
            access,
            iova,
            shared_at,
        )
    }

    /// A zero-filled region memfd with room for the header page and `len` data bytes.
    fn mr_region(&self, len: usize) -> Result<Region, VerbsError> {
        let node = &self.ctx.node;
        let size = (MR_DATA_OFF + len as u64).div_ceil(4096) * 4096;
        Ok(Region::create(
            &format!("bp-{}-mr-n{}", node.fabric().name(), node.slot()),
            size as usize,
        )?)
    }

    /// Writes the region's header, registers it with the supervisor (the header's memfd, and
    /// the data's file from `data_off` if that is set) and in the engine.
    fn register(
        &self,
        maps: RegionMaps,
        data_off: Option<u64>,
        (skew, len): (u32, usize),
        access: AccessFlags,
        iova: u64,
        backing: Backing,
    ) -> Result<Mr, VerbsError> {
        let node = &self.ctx.node;
        let region = &maps.header;
        let mut h = [0u8; 64];
        MrRepr {
            len: len as u64,
            skew,
            iova,
        }
        .emit(&mut MrHeader::new_unchecked(&mut h[..]));
        h[MR_INIT_OFF..MR_INIT_OFF + 4].fill(0);
        region.write(0, &h)?;
        region
            .u32_at(MR_STATE_OFF as u64)?
            .store(MR_STATE_VALID, Ordering::Relaxed);
        // SYNC POINT header-init (release): the header is complete before the marker is seen.
        region
            .u32_at(MR_INIT_OFF as u64)?
            .store(crate::wire::INIT_MARK, Ordering::Release);
        let (resp, _) = node.fabric().call_service::<VerbsResponse>(
            &VerbsRequest::RegMr {
                slot: node.slot(),
                pd: self.id,
                len: len as u64,
                access: access.bits(),
                data_off,
            },
            &if data_off.is_some() {
                vec![region.fd(), maps.data.fd()]
            } else {
                vec![region.fd()]
            },
        )?;
        let VerbsResponse::MrRegistered { key } = resp else {
            return Err(FabricError::Protocol(format!("{resp:?}")).into());
        };
        let data = Span::new(&maps.data, maps.data_off + u64::from(skew), len as u64)?;
        data.populate(maps.data.writable());
        let region = region.clone();
        if node.fabric().inner.direct_ip.is_some() {
            // Peers on other hosts whose pairs this process carries reach it here.
            direct::region_registered(key, self.id, maps, len as u64, access.bits());
        }
        self.ctx.eng.borrow_mut().mrs.insert(
            key,
            LocalMr {
                pd: self.id,
                access,
                iova,
                data: data.clone(),
                header: region.clone(),
            },
        );
        Ok(Mr {
            ctx: self.ctx.clone(),
            key,
            region,
            data,
            len,
            access,
            iova,
            backing,
        })
    }

    /// The same as [`Pd::alloc_mr`], under its libibverbs name.
    pub fn reg_mr(&self, len: usize, access: AccessFlags) -> Result<Mr, VerbsError> {
        self.alloc_mr(len, access)
    }

    /// An address handle for UD sends to node `attr.dlid` (`ibv_create_ah`).
    pub fn create_ah(&self, attr: &AhAttr) -> Result<Ah, VerbsError> {
        let nodes = self.ctx.node.fabric().nodes();
        let slot = u32::from(attr.dlid);
        if slot == 0 || slot > nodes || attr.port_num > 1 {
            return Err(VerbsError::inval(format!(
                "LID {slot} port {} is not a node port (LIDs 1..={nodes}, port 1)",
                attr.port_num
            )));
        }
        Ok(Ah { slot, attr: *attr })
    }

    /// A shared receive queue (`ibv_create_srq`).
    pub fn create_srq(&self, attr: SrqAttr) -> Result<Srq, VerbsError> {
        if !(1..=1 << 16).contains(&attr.max_wr) || !(1..=32).contains(&attr.max_sge) {
            return Err(VerbsError::inval(format!(
                "SRQ capabilities out of range: max_wr {} (1..=65536), max_sge {} (1..=32)",
                attr.max_wr, attr.max_sge
            )));
        }
        Ok(Srq {
            ctx: self.ctx.clone(),
            q: Rc::new(RefCell::new(engine::SrqEngine::new(
                self.id,
                attr.max_wr,
                attr.max_sge,
            ))),
        })
    }

    /// A queue pair (`ibv_create_qp`), in RESET.
    pub fn create_qp(&self, init: &QpInitAttr<'_>) -> Result<Qp, VerbsError> {
        for cq in [init.send_cq, init.recv_cq] {
            if !Rc::ptr_eq(&cq.ctx, &self.ctx) {
                return Err(VerbsError::inval("the CQ belongs to another context"));
            }
        }
        if init.srq.is_some_and(|s| !Rc::ptr_eq(&s.ctx, &self.ctx)) {
            return Err(VerbsError::inval("the SRQ belongs to another context"));
        }
        let mut c = init.cap;
        if init.srq.is_some() {
            // Ignored with a shared receive queue, as in libibverbs.
            c.max_recv_wr = 0;
            c.max_recv_sge = 0;
        }
        if c.max_send_wr == 0
            || (c.max_recv_wr == 0 && init.srq.is_none())
            || c.max_send_wr > 1 << 16
            || c.max_recv_wr > 1 << 16
            || c.max_send_sge > 32
            || c.max_recv_sge > 32
            || c.max_inline_data > 4096
        {
            return Err(VerbsError::inval(format!(
                "QP capabilities out of range: {c:?}"
            )));
        }
        let ring = if init.ring_bytes == 0 {
            DEFAULT_RING
        } else {
            init.ring_bytes
        };
        if !ring.is_power_of_two() || !(QP_MIN_RING..=QP_MAX_RING).contains(&ring) {
            return Err(VerbsError::inval(format!(
                "ring_bytes {ring} is not a power of two in {QP_MIN_RING}..={QP_MAX_RING}"
            )));
        }
        let (id, qpn) = self.ctx.create_qp(engine::QpSpec {
            pd: self.id,
            ty: init.qp_type,
            send_cq: init.send_cq.id,
            recv_cq: init.recv_cq.id,
            cap: c,
            sig_all: init.sq_sig_all,
            ring_len: ring,
            srq: init.srq.map(|s| s.q.clone()),
        })?;
        Ok(Qp {
            ctx: self.ctx.clone(),
            id,
            write_hint: Cell::new(engine::WriteHint::NONE),
            send_hint: Cell::new([std::ptr::null(); 2]),
            qpn,
            ty: init.qp_type,
        })
    }
}

/// A memory region (`ibv_mr`): shareable memory the library allocated ([`Pd::alloc_mr`]) or
/// the program's own put under a region ([`Pd::reg_user_mr`]), registered in a PD. Dropping it
/// deregisters it: peers that mapped it get REM_ACCESS_ERR from then on.
pub struct Mr {
    ctx: Rc<Ctx>,
    key: u32,
    region: Arc<Region>,
    data: Span,
    len: usize,
    access: AccessFlags,
    iova: u64,
    /// The memory the program registered, if it was the program's.
    backing: Backing,
}

/// Whose memory a region's data is.
#[derive(Debug)]
enum Backing {
    /// The region's own (`alloc_mr`).
    Own,
    /// The program's private pages, put under the region (`reg_user_mr`); dropped after the
    /// deregistration (private again once no other registration holds them).
    Adopted(Arc<crate::mem::Adopted>),
    /// The program's shared memory at this address, registered where it is, and the pages of
    /// another registration it is inside (held until this one is dropped).
    Shared {
        at: usize,
        _holds: Option<Arc<crate::mem::Adopted>>,
    },
}

/// Why registering `len` bytes at `addr` failed, as `EINVAL`.
fn cannot_register(addr: *mut u8, len: usize, e: &dyn std::fmt::Display) -> VerbsError {
    VerbsError::inval(format!("cannot register {addr:p}+{len}: {e}"))
}

/// The checks every registration makes: a length in range, and the remote rights that need
/// LOCAL_WRITE (as in libibverbs).
fn check_mr_args(len: usize, access: AccessFlags) -> Result<(), VerbsError> {
    if len == 0 || len as u64 > 1 << 40 {
        return Err(VerbsError::inval(format!("region of {len} bytes")));
    }
    if access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
        && !access.contains(AccessFlags::LOCAL_WRITE)
    {
        return Err(VerbsError::inval(
            "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE",
        ));
    }
    Ok(())
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("key", &format_args!("{:#x}", self.key))
            .field("len", &self.len)
            .field("access", &self.access)
            .finish()
    }
}

impl Mr {
    /// Local key, for scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        self.key
    }
    /// Remote key, for peers' RDMA operations.
    pub fn rkey(&self) -> u32 {
        self.key
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Never true (regions are not empty).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Access flags.
    pub fn access(&self) -> AccessFlags {
        self.access
    }
    /// The address of byte 0 that scatter/gather entries and peers use (0 for a region the
    /// library allocated).
    pub fn iova(&self) -> u64 {
        self.iova
    }
    /// A scatter/gather entry for `[offset, offset+length)` of this region.
    pub fn sge(&self, offset: u64, length: u32) -> Sge {
        Sge {
            addr: self.iova + offset,
            length,
            lkey: self.key,
        }
    }
    /// Copies `dst.len()` bytes at `offset` out of the region. Peers (remote writes) and
    /// completions (receives, READ results) change the bytes: read after the completion that
    /// says so, as with any RDMA buffer. The region is reached by copy, never lent out as a
    /// `&[u8]`: other processes may write it at any time, which no Rust reference allows.
    #[inline]
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemError> {
        self.data.read(offset, dst)
    }
    /// `len` bytes at `offset`, copied out (see [`Mr::read`]).
    pub fn to_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, MemError> {
        let mut v = vec![0u8; len];
        self.data.read(offset, &mut v)?;
        Ok(v)
    }
    /// Copies `src` into the region at `offset`.
    #[inline]
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), MemError> {
        self.data.write(offset, src)
    }
    /// Sets `len` bytes at `offset` to `byte`.
    #[inline]
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<(), MemError> {
        self.data.fill(offset, len, byte)
    }
    /// The byte at `offset`, read with a volatile load: for polling memory a peer writes (a
    /// WRITE stores its last 8 bytes last, so a changed last byte means the whole payload).
    #[inline]
    pub fn load_volatile(&self, offset: u64) -> Result<u8, MemError> {
        self.data.load_volatile(offset)
    }
    /// `len` bytes at `offset`, in place (zero-copy), for code that must not pay a copy.
    ///
    /// # Safety
    /// Nobody writes the range while the slice lives: neither a peer (the range was handed
    /// over by a completion and not yet given back — reposted, or announced as free to the
    /// peer) nor this process (no receive or READ completes into it meanwhile).
    #[inline]
    pub unsafe fn bytes(&self, offset: u64, len: usize) -> Result<&[u8], MemError> {
        // SAFETY: the caller's contract is `Span::bytes`'s.
        unsafe { self.data.bytes(offset, len) }
    }
    /// The region's bytes as a span, for copies between regions without a bounce buffer.
    #[inline]
    pub fn span(&self) -> &Span {
        &self.data
    }
    /// Address of byte 0, for C callers (`ibv_mr.addr`); Rust code reaches the bytes through
    /// the copies above.
    #[inline]
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.backing {
            Backing::Adopted(a) => a.addr().wrapping_add(self.data.addr(0) as usize % 4096),
            Backing::Shared { at, .. } => *at as *mut u8,
            Backing::Own => self.data.addr(0).cast_mut(),
        }
    }
    /// Deregisters the region (`ibv_dereg_mr`); the same as dropping it.
    pub fn dereg(self) {}
}

impl Drop for Mr {
    fn drop(&mut self) {
        if let Ok(s) = self.region.u32_at(MR_STATE_OFF as u64) {
            // SYNC POINT mr-state (release): peers that see the change stop using the region.
            s.store(MR_STATE_DEREGISTERED, Ordering::Release);
        }
        direct::region_gone(self.key);
        self.ctx.eng.borrow_mut().mrs.remove(self.key);
        let _ = self
            .ctx
            .node
            .fabric()
            .call_service::<VerbsResponse>(&VerbsRequest::DeregMr { key: self.key }, &[]);
    }
}

/// A completion queue (`ibv_cq`).
#[derive(Debug)]
pub struct Cq {
    ctx: Rc<Ctx>,
    id: usize,
}

impl Cq {
    /// Identifies the CQ in [`CqEvent`]s.
    pub fn id(&self) -> u32 {
        self.id as u32
    }

    /// Takes up to `wc.len()` completions (`ibv_poll_cq`). When the CQ holds none, its QPs
    /// are moved along first (inbound messages, acknowledgements, waiting work), so a poll
    /// loop is what makes progress.
    pub fn poll(&self, wc: &mut [Wc]) -> usize {
        self.ctx.poll(self.id, wc)
    }

    /// As [`Cq::poll`], handing each of up to `max` completions to `sink` (its index in this
    /// call, the completion) as it leaves the queue — for a caller that converts them (the
    /// drop-in libibverbs writes `struct ibv_wc`s), without a buffer in between.
    #[inline]
    pub fn poll_each(&self, max: usize, sink: impl FnMut(usize, &Wc)) -> usize {
        self.ctx.poll_each(self.id, max, sink)
    }

    /// Changes the CQ's size to `cqe` entries (`ibv_resize_cq`): 1..=4194304 and at least the
    /// completions it holds now (`InvalidArgument` otherwise, the CQ unchanged); the size is
    /// where completions start to count as overruns ([`Cq::overruns`]). Returns the new size.
    pub fn resize(&self, cqe: usize) -> Result<usize, VerbsError> {
        if cqe == 0 || cqe > 1 << 22 {
            return Err(VerbsError::inval(format!("cqe {cqe} is not 1..=4194304")));
        }
        let mut eng = self.ctx.eng.borrow_mut();
        let Some(Some(c)) = eng.cqs.get_mut(self.id) else {
            return Err(VerbsError::inval("the CQ is gone"));
        };
        if c.entries.len() > cqe {
            return Err(VerbsError::inval(format!(
                "the CQ holds {} completions, more than {cqe}",
                c.entries.len()
            )));
        }
        c.cap = cqe;
        Ok(cqe)
    }

    /// Completions that arrived while the CQ already held its `cqe` entries. On hardware that
    /// is a CQ overrun (the asynchronous event `IBV_EVENT_CQ_ERR`, completions lost); here the
    /// completions are kept and counted, so the mistake is visible without losing work.
    /// Receive completions never overrun: while the CQ is full, inbound messages wait in the
    /// QP's ring (the sender sees back-pressure); only send completions can.
    pub fn overruns(&self) -> u64 {
        let eng = self.ctx.eng.borrow();
        eng.cqs
            .get(self.id)
            .and_then(|c| c.as_ref())
            .map_or(0, |c| c.overruns)
    }

    /// Whether the CQ holds a completion, after moving its QPs along as a poll that finds it
    /// empty does (nothing is taken). For a caller that hands on an event only with a
    /// completion behind it, as hardware does (see the drop-in's `ibv_get_cq_event`).
    pub fn has_completion(&self) -> bool {
        self.ctx.poll_each(self.id, 0, |_, _| {});
        engine::holds_completions(&self.ctx.eng.borrow().cqs, self.id)
    }

    /// Asks for an event on the channel when the next completion arrives (`ibv_req_notify_cq`);
    /// at once if the CQ holds completions already. `solicited_only` is accepted and treated
    /// as "any completion" (events may be spurious).
    pub fn req_notify(&self, _solicited_only: bool) -> Result<(), VerbsError> {
        let mut eng = self.ctx.eng.borrow_mut();
        self.ctx.arm_cq(&mut eng, self.id)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        let mut eng = self.ctx.eng.borrow_mut();
        if let Some(Some(c)) = eng.cqs.get_mut(self.id) {
            c.handle_alive = false;
            if let Some(ch) = &c.channel {
                ch.forget(self.id as u32);
            }
            if c.qps.is_empty() {
                eng.cqs[self.id] = None;
            }
        }
    }
}

/// What a QP is created with (`struct ibv_qp_init_attr`).
#[derive(Debug, Clone, Copy)]
pub struct QpInitAttr<'a> {
    /// Where send completions go.
    pub send_cq: &'a Cq,
    /// Where receive completions go.
    pub recv_cq: &'a Cq,
    /// Queue sizes.
    pub cap: QpCap,
    /// Transport.
    pub qp_type: QpType,
    /// Every send completes with a completion (as if SIGNALED).
    pub sq_sig_all: bool,
    /// Extension: bytes of the QP's inbound ring (RC/UC; power of two, 256 KiB..64 MiB;
    /// 0 = [`DEFAULT_RING`]). Larger rings keep more SEND data in flight.
    pub ring_bytes: u32,
    /// Take receives from this shared receive queue instead of the QP's own (`max_recv_wr`
    /// and `max_recv_sge` are then ignored, and `post_recv` on the QP is refused).
    pub srq: Option<&'a Srq>,
}

impl<'a> QpInitAttr<'a> {
    /// Default capabilities, no `sq_sig_all`, default ring.
    pub fn new(qp_type: QpType, send_cq: &'a Cq, recv_cq: &'a Cq) -> Self {
        Self {
            send_cq,
            recv_cq,
            cap: QpCap::default(),
            qp_type,
            sq_sig_all: false,
            ring_bytes: 0,
            srq: None,
        }
    }
}

/// What a shared receive queue is made with, and what it reports (`struct ibv_srq_attr`;
/// `srq_limit` and its async event are not offered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrqAttr {
    /// Receives it holds at most (1..=65536).
    pub max_wr: u32,
    /// Scatter/gather entries per receive (1..=32).
    pub max_sge: u32,
}

/// A shared receive queue (`ibv_srq`): receives that every QP made with it takes in turn,
/// as a server with many connections posts one pool of buffers instead of one per QP. An RC
/// message that finds it empty waits in its QP's ring until a receive is posted (an RNR
/// retried without limit); a UC or UD message is dropped, as on hardware.
pub struct Srq {
    ctx: Rc<Ctx>,
    q: Rc<RefCell<engine::SrqEngine>>,
}

impl std::fmt::Debug for Srq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let q = self.q.borrow();
        f.debug_struct("Srq")
            .field("waiting", &q.len())
            .field("max_wr", &q.max_wr)
            .finish()
    }
}

impl Srq {
    /// Posts receive work requests (`ibv_post_srq_recv`); their buffers are checked against
    /// the SRQ's PD when a message arrives.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), VerbsError> {
        self.q.borrow_mut().post(wrs)
    }

    /// Its attributes (`ibv_query_srq`).
    pub fn query(&self) -> SrqAttr {
        let q = self.q.borrow();
        SrqAttr {
            max_wr: q.max_wr,
            max_sge: q.max_sge,
        }
    }

    /// Receives waiting in it.
    pub fn waiting(&self) -> usize {
        self.q.borrow().len()
    }

    /// QPs made with it still exist (destroying it would fail with `EBUSY` in libibverbs).
    pub fn in_use(&self) -> bool {
        Rc::strong_count(&self.q) > 1
    }
}

/// An address handle (`ibv_ah`): a destination node for UD sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ah {
    pub(crate) slot: u32,
    attr: AhAttr,
}

impl Ah {
    /// The attributes it was made from.
    pub fn attr(&self) -> AhAttr {
        self.attr
    }
}

/// A queue pair (`ibv_qp`).
#[derive(Debug)]
pub struct Qp {
    ctx: Rc<Ctx>,
    id: usize,
    /// Where this QP's last fast-path RDMA_WRITE went (rkey, address, the line it ended in):
    /// the next WRITE to the same rkey and address asks for that line before anything else
    /// (`prefetch_targets`). A hint only: it may be stale, and is never dereferenced.
    write_hint: Cell<engine::WriteHint>,
    /// Where this QP's next SEND goes in the ring to the peer (record, producer index), as
    /// the last fast-path SEND left it; null before. A hint only, never dereferenced.
    send_hint: Cell<[*const u8; 2]>,
    qpn: u32,
    ty: QpType,
}

impl Qp {
    /// QP number (`qp->qp_num`).
    pub fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// Transport.
    pub fn qp_type(&self) -> QpType {
        self.ty
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.with(|q, _, _| q.state)
    }

    /// Messages this QP dropped (UC/UD without a posted receive, bad Q_Key, malformed).
    pub fn drops(&self) -> u64 {
        self.with(|q, _, _| q.drops)
    }

    /// Why the QP went to ERR when no work request was to blame (what libibverbs reports as
    /// the asynchronous event `IBV_EVENT_QP_FATAL`), if it did.
    pub fn fatal_error(&self) -> Option<&'static str> {
        self.with(|q, _, _| q.error)
    }

    fn with<R>(
        &self,
        f: impl FnOnce(&mut engine::QpEngine, &engine::CtxParts<'_>, &mut engine::Cqs) -> R,
    ) -> R {
        let mut eng = self.ctx.eng.borrow_mut();
        let Engine { qps, cqs, mrs, .. } = &mut *eng;
        let q = qps[self.id]
            .as_mut()
            .expect("a live Qp handle has engine state");
        let env = self.ctx.env(mrs);
        f(q, &env, cqs)
    }

    /// Changes state and attributes (`ibv_modify_qp`). A transition the state machine does not
    /// have, or a mask without the attributes it needs, is `InvalidArgument` (`EINVAL`).
    pub fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<(), VerbsError> {
        self.with(|q, env, cqs| q.modify(attr, mask, env, cqs))
    }

    /// Attributes and state (`ibv_query_qp`).
    pub fn query(&self) -> QpAttr {
        self.with(|q, _, _| QpAttr {
            qp_state: q.state,
            cur_qp_state: q.state,
            cap: q.query_cap(),
            ..q.attr
        })
    }

    /// Posts send work requests (`ibv_post_send`). Structural problems (wrong state, opcode not
    /// available on the transport, too many SGEs or outstanding requests) are refused here with
    /// `Post { bad_wr }`; everything else — bad keys, remote access, RNR, a dead peer — ends
    /// as a completion with an error status.
    #[inline]
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), VerbsError> {
        direct::posting();
        if let [wr] = wrs {
            self.prefetch_targets(wr);
            if self.post_one_fast(wr) {
                return Ok(());
            }
        }
        let (r, waits) = self.with(|q, env, cqs| {
            let r = q.post_send(wrs, env, cqs);
            (r, q.waits_in_background().then_some(q.send_cq))
        });
        if let Some(cq) = waits {
            // Work waiting on something the armed channel may not watch yet (an RNR timer,
            // a WRITE landing on another host): the watch is made again.
            let mut eng = self.ctx.eng.borrow_mut();
            self.ctx.rearm_if_armed(&mut eng, cq);
        }
        r
    }

    /// Posts one RDMA_READ or atomic (`ibv_post_send` of one such request), as
    /// [`Qp::post_send`] of [`OneSided::send_wr`] does — for a caller that has the request's
    /// fields at hand and would otherwise build a [`SendWr`] only for this (the drop-in
    /// libibverbs: `ib_read_lat` spent ~100 instructions a READ converting its request, a
    /// sixth of the iteration).
    #[inline]
    pub fn post_one_sided(&self, r: &OneSided<'_>) -> Result<(), VerbsError> {
        direct::posting();
        if self.one_sided_fast(r) {
            return Ok(());
        }
        self.post_one_sided_slow(r)
    }

    /// [`Qp::post_one_sided`]'s short way alone: true if the request was carried out (its
    /// completion, if signaled, is in the send CQ), false if nothing was done and it must go
    /// the general way ([`Qp::post_one_sided`] or [`Qp::post_send`]). For the drop-in
    /// libibverbs, whose `ibv_post_send` then needs no room for an error on its way.
    #[inline]
    pub fn try_post_one_sided(&self, r: &OneSided<'_>) -> bool {
        direct::posting();
        self.one_sided_fast(r)
    }

    #[cold]
    #[inline(never)]
    fn post_one_sided_slow(&self, r: &OneSided<'_>) -> Result<(), VerbsError> {
        if !matches!(
            r.opcode,
            WrOpcode::RdmaRead | WrOpcode::AtomicFetchAndAdd | WrOpcode::AtomicCmpAndSwp
        ) {
            return Err(VerbsError::Post {
                bad_wr: 0,
                source: Box::new(VerbsError::inval(format!(
                    "post_one_sided takes RDMA_READ and the atomics, not {:?}",
                    r.opcode
                ))),
            });
        }
        self.post_send(std::slice::from_ref(&r.send_wr()))
    }

    /// [`Qp::post_one_fast`] of a [`OneSided`].
    #[inline(never)]
    fn one_sided_fast(&self, r: &OneSided<'_>) -> bool {
        self.on_fast_path(|q, mrs, cqs| q.fast_one_sided(r, mrs, cqs))
    }

    /// `f` on this QP's engine, its context's regions and CQs, if the engine is free (not
    /// entered further up this thread's stack) and the QP alive; otherwise `false`.
    #[inline(always)]
    fn on_fast_path(&self, f: impl FnOnce(&mut QpEngine, &MrTable, &mut Cqs) -> bool) -> bool {
        let Ok(mut eng) = self.ctx.eng.try_borrow_mut() else {
            return false;
        };
        let Engine { qps, cqs, mrs, .. } = &mut *eng;
        let Some(Some(q)) = qps.get_mut(self.id) else {
            return false;
        };
        f(q, mrs, cqs)
    }

    /// Asks for the line an RDMA_WRITE to `remote_addr` (with `rkey`) will end in, if it goes
    /// where the last one went (see [`Qp::post_send`]'s prefetch): for a caller that has work to
    /// do before it can post — the drop-in libibverbs converting the program's request — so
    /// the line's trip overlaps that work too. Only a hint: never faults, changes nothing.
    #[inline(always)]
    pub fn prefetch_write(&self, remote_addr: u64, rkey: u32) {
        let h = self.write_hint.get();
        if h.rkey == rkey && h.remote_addr == remote_addr {
            crate::sync::prefetch_write(h.line);
        }
    }

    /// Asks for the lines `wr` will write in the peer's memory, as the handle's hints predict
    /// them (PREFETCHW; a hint never faults and is never dereferenced), so they start their
    /// trip to this core while the engine is looked up and the request checked — which the
    /// stores must wait for — and a peer polling them sees the data sooner.
    #[inline(always)]
    fn prefetch_targets(&self, wr: &SendWr<'_>) {
        match (wr.opcode, wr.wr) {
            (WrOpcode::RdmaWrite, WrDetail::Rdma { remote_addr, rkey }) => {
                // A WRITE to where the last one went.
                self.prefetch_write(remote_addr, rkey);
            }
            (WrOpcode::Send | WrOpcode::SendWithImm, _) => {
                // The next record of the ring to the peer (its first lines: a small
                // message's), and the producer index.
                let [rec, tail] = self.send_hint.get();
                if !rec.is_null() {
                    crate::sync::prefetch_write(tail);
                    let n = match (wr.inline_data, wr.sg_list) {
                        (d, _) if !d.is_empty() => d.len(),
                        (_, [s, ..]) => s.length as usize,
                        _ => 0,
                    };
                    let end = engine::send_record_len(n).min(4 * crate::wire::CACHE_LINE);
                    let mut off = 0;
                    while off < end {
                        crate::sync::prefetch_write(rec.wrapping_add(off));
                        off += crate::wire::CACHE_LINE;
                    }
                }
            }
            _ => {}
        }
    }

    /// One request on its fast path, or `false` (nothing done) for the general way. A function
    /// of its own, answering a bool, so the latency-critical paths keep their values in
    /// registers.
    #[inline(never)]
    fn post_one_fast(&self, wr: &SendWr<'_>) -> bool {
        self.on_fast_path(|q, mrs, cqs| {
            let r = q.post_one_fast(wr, mrs, cqs);
            self.write_hint.set(q.write_hint);
            self.send_hint.set(q.send_hint);
            r
        })
    }

    /// Posts receive work requests (`ibv_post_recv`).
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), VerbsError> {
        self.with(|q, _, cqs| q.post_recv(wrs, cqs))
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        let mut eng = self.ctx.eng.borrow_mut();
        let Engine { qps, cqs, mrs, .. } = &mut *eng;
        if let Some(mut q) = qps[self.id].take() {
            let env = self.ctx.env(mrs);
            q.destroy(&env, cqs);
            for cq in [q.send_cq, q.recv_cq] {
                if let Some(Some(c)) = cqs.get_mut(cq) {
                    c.qps.retain(|&x| x != self.id);
                    if c.qps.is_empty() && !c.handle_alive {
                        cqs[cq] = None;
                    }
                }
            }
        }
    }
}
