//! backplane: a software switch fabric for multi-node embedded computing, on one Linux host.
//!
//! Layers, lowest first (dependencies point down only):
//! - [`wire`]: every layout in shared memory (Packet/Repr, validated parsing);
//! - [`sync`]: atomics (swappable for loom), futex doorbells, spin-then-sleep;
//! - [`mem`]: memfd-backed shared regions with bounds-checked access;
//! - [`ring`]: the SPSC ring protocol over a window;
//! - [`transport`]: how the paths reach a peer node's memory and learn whether it lives
//!   (shared memory on one host today; the trait a network engine implements);
//! - [`fabric`]: control plane — supervisor, node table, node life cycle, attach;
//! - [`dgram`]: kernel-bypass datagram endpoints;
//! - [`net`]: IP over the fabric — addressing, frame switching, namespaces, TAP;
//! - [`model`]: link models (pure arithmetic): what a PCIe or Ethernet link delivers;
//! - [`verbs`]: RDMA verbs (PD, MR, CQ, QP: RC, UC, UD) over the fabric;
//! - [`dma`]: raw mode — scatter/gather DMA jobs run by engine threads, over verbs regions;
//! - [`daemon`]: the fabric's processes (supervisor hosting the verbs registry, node agent)
//!   as entry points an executable calls — `backplane` and this crate's `backplane-fabricd`.
//!
//! ```no_run
//! use backplane::{fabric::Fabric, dgram::Addr};
//! let fabric = Fabric::attach("default")?;
//! let mut rx = fabric.node(2)?.bind(7000)?;
//! let mut tx = fabric.node(1)?.bind(0)?;
//! tx.send_to(Addr::new(2, 7000), b"ping")?;
//! let mut buf = [0u8; 64];
//! let (n, from) = rx.recv_from(&mut buf)?;
//! assert_eq!(&buf[..n], b"ping");
//! # let _ = from;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#[cfg(not(loom))]
pub mod daemon;
#[cfg(not(loom))]
pub mod dgram;
#[cfg(not(loom))]
pub mod dma;
#[cfg(not(loom))]
pub mod fabric;
#[cfg(not(loom))]
pub mod mem;
#[cfg(not(loom))]
pub mod model;
#[cfg(not(loom))]
pub mod net;
pub mod ring;
pub mod sync;
#[cfg(not(loom))]
pub mod transport;
#[cfg(not(loom))]
pub mod verbs;
pub mod wire;

/// See [`backplane_ucx::opening_link`] and [`backplane_ucx::ucx_env_is_the_programs`] (for
/// the drop-in `libibverbs.so.1`).
pub use backplane_ucx::{opening_link, ucx_env_is_the_programs};
