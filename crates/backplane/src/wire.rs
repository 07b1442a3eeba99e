//! Every layout that lives in shared memory.
//!
//! Each layout has a `Packet<T: AsRef<[u8]>>` view (smoltcp style) with `check_len`, typed
//! accessors and, for the static headers, a `Repr` with `parse` / `emit`. Field ranges live in
//! a private `mod field`. **If `check_len` passed, no accessor panics.**
//!
//! Static headers are written once by the supervisor, then published by writing the
//! `initialized` marker last with Release ordering; readers snapshot them into local memory and
//! parse the snapshot, so a peer scribbling on the header can only make `parse` fail.
//!
//! Live fields (indices, doorbells, counters) are not parsed: they are accessed as atomics at
//! the offsets exported here (`*_OFF` constants), always through [`crate::mem::Region`], which
//! checks bounds and alignment. Producer- and consumer-written fields sit on separate cache lines.
//!
//! All integers are little-endian (the only byte order this crate runs on; checked at compile
//! time below).
#![forbid(unsafe_code)]

use core::fmt;

/// One cache line; every independently written field gets its own.
pub const CACHE_LINE: usize = 64;

/// Written last into a header: the layout behind it is complete.
pub const INIT_MARK: u32 = 0x1B1B_0001;

/// Largest datagram payload, in bytes: 64 KiB plus headroom, so that a 64 KiB IP packet with
/// its Ethernet and virtio-net headers travels as one datagram.
pub const MAX_DGRAM: usize = 64 * 1024 + 512;

/// Highest supported node count in one fabric.
pub const MAX_NODES: u32 = 256;

/// Scratchpad registers per node (32-bit each), as on common NT switches.
pub const SCRATCHPADS: usize = 16;

/// Virtual fabric address of slot `s`'s window base: each slot owns a 4 GiB aperture, like the
/// BAR windows of an NT switch. Shown in `status`; never dereferenced.
pub const fn window_base(slot: u32) -> u64 {
    (slot as u64) << 32
}

const _: () = assert!(
    cfg!(target_endian = "little"),
    "backplane layouts are little-endian"
);

/// Why a layout was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// Occurs when the buffer is shorter than the layout.
    #[error("buffer too short: {have} bytes, layout needs {need}")]
    Truncated {
        /// Bytes available.
        have: usize,
        /// Bytes the layout needs.
        need: usize,
    },
    /// Occurs when the magic number does not name this layout.
    #[error("bad magic {0:#018x}")]
    BadMagic(u64),
    /// Occurs when the layout version is not one this build understands.
    #[error("unsupported layout version {0}")]
    BadVersion(u32),
    /// Occurs when the `initialized` marker has not been written (yet).
    #[error("layout not initialized")]
    NotInitialized,
    /// Occurs when a field holds a value outside its allowed range.
    #[error("field {field} holds invalid value {value}")]
    BadField {
        /// Field name.
        field: &'static str,
        /// The offending value.
        value: u64,
    },
}

fn rd_u32(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}
fn rd_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}
fn wr_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn wr_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn check(b: &[u8], need: usize) -> Result<(), LayoutError> {
    if b.len() < need {
        Err(LayoutError::Truncated {
            have: b.len(),
            need,
        })
    } else {
        Ok(())
    }
}

macro_rules! packet {
    ($(#[$m:meta])* $name:ident, $len:expr) => {
        $(#[$m])*
        #[derive(Debug, Clone)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }
        impl<T: AsRef<[u8]>> $name<T> {
            /// Size of the layout in bytes.
            pub const LEN: usize = $len;
            /// Wraps a buffer without checking it; call [`Self::check_len`] before accessors.
            pub const fn new_unchecked(buffer: T) -> Self {
                Self { buffer }
            }
            /// Wraps a buffer, checking that every accessor stays in bounds.
            pub fn new_checked(buffer: T) -> Result<Self, LayoutError> {
                let p = Self { buffer };
                p.check_len()?;
                Ok(p)
            }
            /// Ensures the buffer holds the whole layout.
            pub fn check_len(&self) -> Result<(), LayoutError> {
                check(self.buffer.as_ref(), Self::LEN)
            }
            /// Gives the buffer back.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}

// ---------------------------------------------------------------------------------------------
// Fabric header + node table (the control region; written only by the supervisor).
// ---------------------------------------------------------------------------------------------

/// Magic of the control region: `BPFABRIC`.
pub const FABRIC_MAGIC: u64 = u64::from_le_bytes(*b"BPFABRIC");
/// Layout version of the control region.
pub const FABRIC_VERSION: u32 = 1;

mod fabric_field {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const HEADER_LEN: usize = 12;
    pub const NODES: usize = 16;
    pub const ENTRY_LEN: usize = 20;
    pub const WINDOW_SIZE: usize = 24;
    pub const CREATED_MS: usize = 32;
    pub const SUPERVISOR_PID: usize = 40;
    pub const INITIALIZED: usize = 44;
    pub const NAME: usize = 48;
    pub const NAME_LEN: usize = 32;
    pub const LINK_BPS: usize = 80;
    pub const LINK_HOP_NS: usize = 88;
    pub const LINK_NAME: usize = 96;
    pub const LINK_NAME_LEN: usize = 24;
    pub const LINK_MODE: usize = 120;
    /// 1 if the fabric spans hosts (u32).
    pub const HOSTS: usize = 124;
    pub const EPOCH: usize = 128;
}

/// Offset of the fabric epoch (u32, futex word): bumped on every node state change.
pub const FABRIC_EPOCH_OFF: usize = fabric_field::EPOCH;
/// Offset of the fabric header's `initialized` marker.
pub const FABRIC_INIT_OFF: usize = fabric_field::INITIALIZED;
/// Offset of the first node table entry in the control region.
pub const NODE_TABLE_OFF: usize = 192;

/// Size in bytes of a control region for `nodes` nodes.
pub const fn control_region_size(nodes: u32) -> usize {
    NODE_TABLE_OFF + nodes as usize * NodeEntry::<&[u8]>::LEN
}

packet!(
    /// The fabric header at offset 0 of the control region.
    FabricHeader,
    NODE_TABLE_OFF
);

impl<T: AsRef<[u8]>> FabricHeader<T> {
    /// Layout magic.
    pub fn magic(&self) -> u64 {
        rd_u64(self.buffer.as_ref(), fabric_field::MAGIC)
    }
    /// Layout version.
    pub fn version(&self) -> u32 {
        rd_u32(self.buffer.as_ref(), fabric_field::VERSION)
    }
    /// Node count.
    pub fn nodes(&self) -> u32 {
        rd_u32(self.buffer.as_ref(), fabric_field::NODES)
    }
}

/// Parsed fabric header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricHeaderRepr {
    /// Number of slots (1..=nodes).
    pub nodes: u32,
    /// Size of each node's window in bytes.
    pub window_size: u64,
    /// Creation time, ms since the Unix epoch.
    pub created_ms: u64,
    /// Pid of the supervisor.
    pub supervisor_pid: u32,
    /// Fabric name.
    pub name: String,
    /// The emulated link every node has to the switch (`None`: memory speed).
    pub link: Option<LinkRepr>,
    /// The fabric spans hosts: this host runs a datagram bridge thread beside the nodes.
    pub spans_hosts: bool,
}

/// The emulated link of a fabric, as stored in its header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkRepr {
    /// Model name, e.g. `pcie-gen3x4`.
    pub name: String,
    /// Effective payload bandwidth per direction, bytes/s (> 0).
    pub bytes_per_s: u64,
    /// Latency one switch hop adds, ns.
    pub hop_ns: u64,
    /// True for store-and-forward switching, false for cut-through.
    pub store_and_forward: bool,
}

fn rd_name(b: &[u8], at: usize, len: usize, field: &'static str) -> Result<String, LayoutError> {
    let raw = &b[at..at + len];
    let end = raw.iter().position(|&c| c == 0).unwrap_or(raw.len());
    core::str::from_utf8(&raw[..end])
        .map(str::to_owned)
        .map_err(|_| LayoutError::BadField { field, value: 0 })
}

fn wr_name(b: &mut [u8], at: usize, len: usize, v: &str) {
    let dst = &mut b[at..at + len];
    dst.fill(0);
    let n = v.len().min(len);
    dst[..n].copy_from_slice(&v.as_bytes()[..n]);
}

impl FabricHeaderRepr {
    /// Parses and validates a fabric header.
    pub fn parse<T: AsRef<[u8]>>(p: &FabricHeader<T>) -> Result<Self, LayoutError> {
        p.check_len()?;
        let b = p.buffer.as_ref();
        if p.magic() != FABRIC_MAGIC {
            return Err(LayoutError::BadMagic(p.magic()));
        }
        if p.version() != FABRIC_VERSION {
            return Err(LayoutError::BadVersion(p.version()));
        }
        if rd_u32(b, fabric_field::INITIALIZED) != INIT_MARK {
            return Err(LayoutError::NotInitialized);
        }
        let header_len = rd_u32(b, fabric_field::HEADER_LEN);
        if header_len as usize != NODE_TABLE_OFF {
            return Err(LayoutError::BadField {
                field: "header_len",
                value: header_len.into(),
            });
        }
        let entry_len = rd_u32(b, fabric_field::ENTRY_LEN);
        if entry_len as usize != NodeEntry::<&[u8]>::LEN {
            return Err(LayoutError::BadField {
                field: "entry_len",
                value: entry_len.into(),
            });
        }
        let nodes = p.nodes();
        if nodes == 0 || nodes > MAX_NODES {
            return Err(LayoutError::BadField {
                field: "nodes",
                value: nodes.into(),
            });
        }
        let name = rd_name(b, fabric_field::NAME, fabric_field::NAME_LEN, "name")?;
        let bps = rd_u64(b, fabric_field::LINK_BPS);
        let link = if bps == 0 {
            None
        } else {
            let hop_ns = rd_u64(b, fabric_field::LINK_HOP_NS);
            if hop_ns > 1_000_000_000 {
                return Err(LayoutError::BadField {
                    field: "link_hop_ns",
                    value: hop_ns,
                });
            }
            Some(LinkRepr {
                name: rd_name(
                    b,
                    fabric_field::LINK_NAME,
                    fabric_field::LINK_NAME_LEN,
                    "link_name",
                )?,
                bytes_per_s: bps,
                hop_ns,
                store_and_forward: rd_u32(b, fabric_field::LINK_MODE) == 1,
            })
        };
        let spans_hosts = match rd_u32(b, fabric_field::HOSTS) {
            0 => false,
            1 => true,
            v => {
                return Err(LayoutError::BadField {
                    field: "hosts",
                    value: v.into(),
                })
            }
        };
        Ok(Self {
            link,
            spans_hosts,
            nodes,
            window_size: rd_u64(b, fabric_field::WINDOW_SIZE),
            created_ms: rd_u64(b, fabric_field::CREATED_MS),
            supervisor_pid: rd_u32(b, fabric_field::SUPERVISOR_PID),
            name,
        })
    }

    /// Writes the header, `initialized` included. Callers publishing into live shared memory
    /// write every byte but the marker first and the marker last (see `mem`).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut FabricHeader<T>) {
        let b = p.buffer.as_mut();
        wr_u64(b, fabric_field::MAGIC, FABRIC_MAGIC);
        wr_u32(b, fabric_field::VERSION, FABRIC_VERSION);
        wr_u32(b, fabric_field::HEADER_LEN, NODE_TABLE_OFF as u32);
        wr_u32(b, fabric_field::NODES, self.nodes);
        wr_u32(b, fabric_field::ENTRY_LEN, NodeEntry::<&[u8]>::LEN as u32);
        wr_u64(b, fabric_field::WINDOW_SIZE, self.window_size);
        wr_u64(b, fabric_field::CREATED_MS, self.created_ms);
        wr_u32(b, fabric_field::SUPERVISOR_PID, self.supervisor_pid);
        wr_name(b, fabric_field::NAME, fabric_field::NAME_LEN, &self.name);
        wr_u32(b, fabric_field::HOSTS, u32::from(self.spans_hosts));
        let (bps, hop, lname) = self
            .link
            .as_ref()
            .map_or((0, 0, ""), |l| (l.bytes_per_s, l.hop_ns, l.name.as_str()));
        wr_u64(b, fabric_field::LINK_BPS, bps);
        wr_u64(b, fabric_field::LINK_HOP_NS, hop);
        wr_name(
            b,
            fabric_field::LINK_NAME,
            fabric_field::LINK_NAME_LEN,
            lname,
        );
        let sf = self.link.as_ref().is_some_and(|l| l.store_and_forward);
        wr_u32(b, fabric_field::LINK_MODE, u32::from(sf));
        wr_u32(b, fabric_field::INITIALIZED, INIT_MARK);
    }
}

/// Node life-cycle state, as stored in the node table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum NodeState {
    /// No node has ever occupied the slot.
    Empty = 0,
    /// The node's agent is starting.
    Booting = 1,
    /// The node serves traffic.
    Ready = 2,
    /// The node died, hung or was stopped; its peers no longer deliver to it.
    Down = 3,
}

impl NodeState {
    /// Decodes a stored state.
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::Empty,
            1 => Self::Booting,
            2 => Self::Ready,
            3 => Self::Down,
            _ => return None,
        })
    }
}

impl fmt::Display for NodeState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Empty => "EMPTY",
            Self::Booting => "BOOTING",
            Self::Ready => "READY",
            Self::Down => "DOWN",
        })
    }
}

/// Why a node went DOWN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DownReason {
    /// Not down.
    None = 0,
    /// The node's agent exited or was killed (seen through its pidfd).
    Exited = 1,
    /// The node's heartbeat stopped (hung or stopped process).
    Hung = 2,
    /// The fabric is shutting down.
    Shutdown = 3,
    /// The node runs on another host, which stopped answering (fabrics across hosts).
    HostLost = 4,
}

impl DownReason {
    /// Decodes a stored reason.
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::None,
            1 => Self::Exited,
            2 => Self::Hung,
            3 => Self::Shutdown,
            4 => Self::HostLost,
            _ => return None,
        })
    }
}

mod node_field {
    pub const SEQ: usize = 0;
    pub const STATE: usize = 4;
    pub const GENERATION: usize = 8;
    pub const PID: usize = 12;
    pub const WINDOW_SIZE: usize = 16;
    pub const SINCE_MS: usize = 24;
    pub const SLOT: usize = 32;
    pub const REASON: usize = 36;
}

/// Offset, inside a node entry, of its seqlock word (odd while the supervisor writes).
pub const NODE_SEQ_OFF: usize = node_field::SEQ;

packet!(
    /// One slot's entry in the node table; protected by a seqlock (`seq`, odd while written).
    NodeEntry,
    64
);

/// Parsed node table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeEntryRepr {
    /// Slot number, 1-based.
    pub slot: u32,
    /// Life-cycle state.
    pub state: NodeState,
    /// Incarnation; bumped on every BOOTING → READY.
    pub generation: u32,
    /// Pid of the node's agent (0 when none).
    pub pid: u32,
    /// Window size in bytes.
    pub window_size: u64,
    /// When the node entered its current state, ms since the Unix epoch.
    pub since_ms: u64,
    /// Why the node is DOWN.
    pub reason: DownReason,
}

impl<T: AsRef<[u8]>> NodeEntry<T> {
    /// The seqlock word.
    pub fn seq(&self) -> u32 {
        rd_u32(self.buffer.as_ref(), node_field::SEQ)
    }
}

impl NodeEntryRepr {
    /// Parses and validates an entry (the caller checked the seqlock).
    pub fn parse<T: AsRef<[u8]>>(p: &NodeEntry<T>) -> Result<Self, LayoutError> {
        p.check_len()?;
        let b = p.buffer.as_ref();
        let state_raw = rd_u32(b, node_field::STATE);
        let state = NodeState::from_u32(state_raw).ok_or(LayoutError::BadField {
            field: "state",
            value: state_raw.into(),
        })?;
        let reason_raw = rd_u32(b, node_field::REASON);
        let reason = DownReason::from_u32(reason_raw).ok_or(LayoutError::BadField {
            field: "reason",
            value: reason_raw.into(),
        })?;
        let slot = rd_u32(b, node_field::SLOT);
        if slot == 0 || slot > MAX_NODES {
            return Err(LayoutError::BadField {
                field: "slot",
                value: slot.into(),
            });
        }
        Ok(Self {
            slot,
            state,
            generation: rd_u32(b, node_field::GENERATION),
            pid: rd_u32(b, node_field::PID),
            window_size: rd_u64(b, node_field::WINDOW_SIZE),
            since_ms: rd_u64(b, node_field::SINCE_MS),
            reason,
        })
    }

    /// Writes every field but the seqlock word.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut NodeEntry<T>) {
        let b = p.buffer.as_mut();
        wr_u32(b, node_field::STATE, self.state as u32);
        wr_u32(b, node_field::GENERATION, self.generation);
        wr_u32(b, node_field::PID, self.pid);
        wr_u64(b, node_field::WINDOW_SIZE, self.window_size);
        wr_u64(b, node_field::SINCE_MS, self.since_ms);
        wr_u32(b, node_field::SLOT, self.slot);
        wr_u32(b, node_field::REASON, self.reason as u32);
    }
}

// ---------------------------------------------------------------------------------------------
// Window header (offset 0 of every node window).
// ---------------------------------------------------------------------------------------------

/// Magic of a node window: `BPWINDOW`.
pub const WINDOW_MAGIC: u64 = u64::from_le_bytes(*b"BPWINDOW");
/// Layout version of the window header.
pub const WINDOW_VERSION: u32 = 1;
/// Where the allocatable heap of a window begins.
pub const WINDOW_HEAP_OFF: u64 = 4096;
/// Smallest window: header page plus room for an endpoint and one ring.
pub const MIN_WINDOW: u64 = 4 << 20;

mod window_field {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const HEADER_LEN: usize = 12;
    pub const SLOT: usize = 16;
    pub const GENERATION: usize = 20;
    pub const SIZE: usize = 24;
    pub const HEAP: usize = 32;
    pub const INITIALIZED: usize = 40;
}

/// Heartbeat counter (u64), written by the node's agent every tick.
pub const WIN_HEARTBEAT_OFF: usize = 64;
/// Doorbell register (u64 bit set; peers `fetch_or` into it).
pub const WIN_DOORBELL_BITS_OFF: usize = 128;
/// Doorbell futex word (u32; bumped after every ring so a sleeper wakes).
pub const WIN_DOORBELL_SEQ_OFF: usize = 136;
/// Doorbell armed flag (u32; written by the window's owner before it sleeps).
pub const WIN_DOORBELL_ARMED_OFF: usize = 192;
/// First scratchpad register (u32 × [`SCRATCHPADS`]).
pub const WIN_SCRATCH_OFF: usize = 256;
/// Interface counters published by the agent (u64 × 6: rx packets, rx bytes, tx packets,
/// tx bytes, rx dropped, tx dropped).
pub const WIN_IFSTATS_OFF: usize = 512;
/// Link emulation: CLOCK_MONOTONIC ns at which the node's uplink is next free (u64; updated
/// with compare-and-swap by the node's senders).
pub const WIN_LINK_EGRESS_OFF: usize = 576;
/// Link emulation: ns at which the node's downlink is next free (u64; updated with
/// compare-and-swap by every sender to this node).
pub const WIN_LINK_INGRESS_OFF: usize = 640;
/// Distributed topologies: datagrams this node forwarded (u64) and their bytes (u64), added to
/// by the senders whose route passes through it.
pub const WIN_FWD_OFF: usize = 704;
/// Distributed topologies: the clock of this node's link toward node `v` is the u64 at
/// `WIN_LINK_CLOCKS_OFF + 8 * (v - 1)`.
pub const WIN_LINK_CLOCKS_OFF: usize = 1024;
/// Offset of the window header's `initialized` marker.
pub const WIN_INIT_OFF: usize = window_field::INITIALIZED;

packet!(
    /// The static part of a node window's header.
    WindowHeader,
    64
);

/// Parsed window header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowHeaderRepr {
    /// Owning slot.
    pub slot: u32,
    /// Generation the window was initialised for.
    pub generation: u32,
    /// Window size in bytes.
    pub size: u64,
}

impl WindowHeaderRepr {
    /// Parses and validates a window header against the size actually mapped.
    pub fn parse<T: AsRef<[u8]>>(p: &WindowHeader<T>, mapped: u64) -> Result<Self, LayoutError> {
        p.check_len()?;
        let b = p.buffer.as_ref();
        let magic = rd_u64(b, window_field::MAGIC);
        if magic != WINDOW_MAGIC {
            return Err(LayoutError::BadMagic(magic));
        }
        let version = rd_u32(b, window_field::VERSION);
        if version != WINDOW_VERSION {
            return Err(LayoutError::BadVersion(version));
        }
        if rd_u32(b, window_field::INITIALIZED) != INIT_MARK {
            return Err(LayoutError::NotInitialized);
        }
        let size = rd_u64(b, window_field::SIZE);
        if size != mapped {
            return Err(LayoutError::BadField {
                field: "size",
                value: size,
            });
        }
        let heap = rd_u64(b, window_field::HEAP);
        if heap != WINDOW_HEAP_OFF || rd_u32(b, window_field::HEADER_LEN) != 4096 {
            return Err(LayoutError::BadField {
                field: "heap",
                value: heap,
            });
        }
        Ok(Self {
            slot: rd_u32(b, window_field::SLOT),
            generation: rd_u32(b, window_field::GENERATION),
            size,
        })
    }

    /// Writes the header, `initialized` included.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut WindowHeader<T>) {
        let b = p.buffer.as_mut();
        wr_u64(b, window_field::MAGIC, WINDOW_MAGIC);
        wr_u32(b, window_field::VERSION, WINDOW_VERSION);
        wr_u32(b, window_field::HEADER_LEN, 4096);
        wr_u32(b, window_field::SLOT, self.slot);
        wr_u32(b, window_field::GENERATION, self.generation);
        wr_u64(b, window_field::SIZE, self.size);
        wr_u64(b, window_field::HEAP, WINDOW_HEAP_OFF);
        wr_u32(b, window_field::INITIALIZED, INIT_MARK);
    }
}

// ---------------------------------------------------------------------------------------------
// Endpoint record (in the owning node's window).
// ---------------------------------------------------------------------------------------------

/// Magic of an endpoint record: `BPENDPNT`.
pub const ENDPOINT_MAGIC: u64 = u64::from_le_bytes(*b"BPENDPNT");
/// Layout version of an endpoint record.
pub const ENDPOINT_VERSION: u32 = 1;
/// Size of an endpoint record.
pub const ENDPOINT_LEN: u64 = 4096;
/// Ring list capacity of one endpoint (how many senders it can hear at once).
pub const ENDPOINT_MAX_RINGS: u32 = ((ENDPOINT_LEN as usize - EP_RING_LIST_OFF) / 8) as u32;

mod endpoint_field {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const PORT: usize = 12;
    pub const OWNER_PID: usize = 16;
    pub const GENERATION: usize = 20;
    pub const MAX_RINGS: usize = 24;
    pub const SLOT: usize = 28;
    pub const INITIALIZED: usize = 32;
}

/// Receive doorbell (u32 futex word), bumped by senders when the owner is armed.
pub const EP_DOORBELL_OFF: usize = 64;
/// Armed flag (u32), written by the owner before it sleeps.
pub const EP_ARMED_OFF: usize = 128;
/// Number of ring list entries in use (u32, supervisor-written, Release).
pub const EP_RING_COUNT_OFF: usize = 192;
/// Closed flag (u32, supervisor-written): the endpoint is gone or its node went DOWN.
pub const EP_CLOSED_OFF: usize = 196;
/// Ring list change counter (u32, supervisor-written, Release): rescan the list when it moves.
pub const EP_RING_SEQ_OFF: usize = 200;
/// Owner-written counters (u64 × 5: tx msgs, tx bytes, rx msgs, rx bytes, drops).
pub const EP_COUNTERS_OFF: usize = 256;
/// Ring list: u64 ring offsets in this window, 0 for a free entry.
pub const EP_RING_LIST_OFF: usize = 320;
/// Offset of an endpoint record's `initialized` marker.
pub const EP_INIT_OFF: usize = endpoint_field::INITIALIZED;

packet!(
    /// Static part of an endpoint record.
    EndpointHeader,
    64
);

/// Parsed endpoint header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointRepr {
    /// Slot of the owning node.
    pub slot: u32,
    /// Port the endpoint is bound to.
    pub port: u32,
    /// Pid of the owning process.
    pub owner_pid: u32,
    /// Node generation the endpoint belongs to.
    pub generation: u32,
}

impl EndpointRepr {
    /// Parses and validates an endpoint header.
    pub fn parse<T: AsRef<[u8]>>(p: &EndpointHeader<T>) -> Result<Self, LayoutError> {
        p.check_len()?;
        let b = p.buffer.as_ref();
        let magic = rd_u64(b, endpoint_field::MAGIC);
        if magic != ENDPOINT_MAGIC {
            return Err(LayoutError::BadMagic(magic));
        }
        let version = rd_u32(b, endpoint_field::VERSION);
        if version != ENDPOINT_VERSION {
            return Err(LayoutError::BadVersion(version));
        }
        if rd_u32(b, endpoint_field::INITIALIZED) != INIT_MARK {
            return Err(LayoutError::NotInitialized);
        }
        let max = rd_u32(b, endpoint_field::MAX_RINGS);
        if max != ENDPOINT_MAX_RINGS {
            return Err(LayoutError::BadField {
                field: "max_rings",
                value: max.into(),
            });
        }
        Ok(Self {
            slot: rd_u32(b, endpoint_field::SLOT),
            port: rd_u32(b, endpoint_field::PORT),
            owner_pid: rd_u32(b, endpoint_field::OWNER_PID),
            generation: rd_u32(b, endpoint_field::GENERATION),
        })
    }

    /// Writes the header, `initialized` included.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut EndpointHeader<T>) {
        let b = p.buffer.as_mut();
        wr_u64(b, endpoint_field::MAGIC, ENDPOINT_MAGIC);
        wr_u32(b, endpoint_field::VERSION, ENDPOINT_VERSION);
        wr_u32(b, endpoint_field::PORT, self.port);
        wr_u32(b, endpoint_field::OWNER_PID, self.owner_pid);
        wr_u32(b, endpoint_field::GENERATION, self.generation);
        wr_u32(b, endpoint_field::MAX_RINGS, ENDPOINT_MAX_RINGS);
        wr_u32(b, endpoint_field::SLOT, self.slot);
        wr_u32(b, endpoint_field::INITIALIZED, INIT_MARK);
    }
}

// ---------------------------------------------------------------------------------------------
// Ring header (in the receiver's window) and credit line (in the sender's window).
// ---------------------------------------------------------------------------------------------

/// Magic of a ring: `BPRING01`.
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"BPRING01");
/// Layout version of a ring.
pub const RING_VERSION: u32 = 1;
/// Offset of the data area from the ring header.
pub const RING_DATA_OFF: u64 = 256;
/// Producer index (u64 byte position, sender-written, Release).
pub const RING_TAIL_OFF: usize = 64;
/// Sender-closed flag (u32, set by the supervisor when the sender is gone).
pub const RING_SENDER_CLOSED_OFF: usize = 128;
/// Offset of a ring header's `initialized` marker.
pub const RING_INIT_OFF: usize = ring_field::INITIALIZED;
/// Records are aligned to this (a cache line), so payloads start on a cache line.
pub const RECORD_ALIGN: u64 = CACHE_LINE as u64;
/// Size of a record header.
pub const RECORD_HEADER_LEN: u64 = 24;

/// Ring data size per (sender, receiver) endpoint pair in a fabric of small windows (and the
/// least any fabric gets): 16 datagrams of the largest size.
pub const DEFAULT_RING_DATA: u32 = 1 << 20;

/// The least ring data size the ring format allows (two datagrams of the largest size), which
/// a route between hosts gets when its sender and receiver exchange datagrams directly
/// (`dgram::direct`): the ring then carries no datagrams, only the route's life (its flags),
/// and a window's [`MAX_RING_DATA`] per route would let only a dozen senders of other hosts
/// reach an endpoint (`ibv_srq_pingpong`'s 16 QPs between two hosts found the window full).
pub const MIN_RING_DATA: u32 = (2 * (MAX_DGRAM as u64 + RECORD_ALIGN)).next_power_of_two() as u32;

/// The largest ring data size a fabric gives a (sender, receiver) pair.
pub const MAX_RING_DATA: u32 = 4 << 20;

/// Ring data size per (sender, receiver) endpoint pair in a fabric whose windows are
/// `window_size` bytes: a sixteenth of the window as a power of two, from
/// [`DEFAULT_RING_DATA`] to [`MAX_RING_DATA`] (64 MiB windows and up get the maximum).
///
/// Why not 1 MiB everywhere: a ring no larger than a core's L2 (1 MiB on the development
/// machine) keeps the lines the receiver last read in the receiver's cache, so every line the
/// sender writes on the next lap has to be taken from the other core first. Measured with
/// `perf dgram-bw -r 5` (1 MiB messages): 1 MiB ring 10.8–11.0 GB/s, 2 MiB 23.7, 4 MiB
/// 29.6–29.9, 8 MiB 28.9, 256 KiB 7.9 GB/s. Both ends derive the size from the window size,
/// which every process of a fabric agrees on, so nothing read from shared memory decides it.
pub const fn ring_data_for_window(window_size: u64) -> u32 {
    let want = window_size / 16;
    let mut size = DEFAULT_RING_DATA as u64;
    while size * 2 <= want && size * 2 <= MAX_RING_DATA as u64 {
        size *= 2;
    }
    size as u32
}

mod ring_field {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const DATA_LEN: usize = 12;
    pub const SRC_SLOT: usize = 16;
    pub const SRC_PORT: usize = 20;
    pub const DST_PORT: usize = 24;
    pub const SRC_GEN: usize = 28;
    pub const CREDIT_OFF: usize = 32;
    pub const INITIALIZED: usize = 40;
}

packet!(
    /// Static part of a ring header.
    RingHeader,
    64
);

/// Parsed ring header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingRepr {
    /// Bytes in the data area (a power of two, multiple of [`RECORD_ALIGN`]).
    pub data_len: u32,
    /// Sender slot.
    pub src_slot: u32,
    /// Sender port.
    pub src_port: u32,
    /// Receiver port.
    pub dst_port: u32,
    /// Generation of the sender's node when the ring was made.
    pub src_generation: u32,
    /// Offset of the credit line in the sender's window.
    pub credit_off: u64,
}

impl RingRepr {
    /// Parses and validates a ring header.
    pub fn parse<T: AsRef<[u8]>>(p: &RingHeader<T>) -> Result<Self, LayoutError> {
        p.check_len()?;
        let b = p.buffer.as_ref();
        let magic = rd_u64(b, ring_field::MAGIC);
        if magic != RING_MAGIC {
            return Err(LayoutError::BadMagic(magic));
        }
        let version = rd_u32(b, ring_field::VERSION);
        if version != RING_VERSION {
            return Err(LayoutError::BadVersion(version));
        }
        if rd_u32(b, ring_field::INITIALIZED) != INIT_MARK {
            return Err(LayoutError::NotInitialized);
        }
        let data_len = rd_u32(b, ring_field::DATA_LEN);
        if !data_len.is_power_of_two() || data_len < MIN_RING_DATA {
            return Err(LayoutError::BadField {
                field: "data_len",
                value: data_len.into(),
            });
        }
        let src_slot = rd_u32(b, ring_field::SRC_SLOT);
        if src_slot == 0 || src_slot > MAX_NODES {
            return Err(LayoutError::BadField {
                field: "src_slot",
                value: src_slot.into(),
            });
        }
        let credit_off = rd_u64(b, ring_field::CREDIT_OFF);
        if !credit_off.is_multiple_of(CACHE_LINE as u64) || credit_off < WINDOW_HEAP_OFF {
            return Err(LayoutError::BadField {
                field: "credit_off",
                value: credit_off,
            });
        }
        Ok(Self {
            data_len,
            src_slot,
            src_port: rd_u32(b, ring_field::SRC_PORT),
            dst_port: rd_u32(b, ring_field::DST_PORT),
            src_generation: rd_u32(b, ring_field::SRC_GEN),
            credit_off,
        })
    }

    /// Writes the header, `initialized` included.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut RingHeader<T>) {
        let b = p.buffer.as_mut();
        wr_u64(b, ring_field::MAGIC, RING_MAGIC);
        wr_u32(b, ring_field::VERSION, RING_VERSION);
        wr_u32(b, ring_field::DATA_LEN, self.data_len);
        wr_u32(b, ring_field::SRC_SLOT, self.src_slot);
        wr_u32(b, ring_field::SRC_PORT, self.src_port);
        wr_u32(b, ring_field::DST_PORT, self.dst_port);
        wr_u32(b, ring_field::SRC_GEN, self.src_generation);
        wr_u64(b, ring_field::CREDIT_OFF, self.credit_off);
        wr_u32(b, ring_field::INITIALIZED, INIT_MARK);
    }

    /// Total bytes a ring with this data size occupies in a window.
    pub fn footprint(data_len: u32) -> u64 {
        RING_DATA_OFF + u64::from(data_len)
    }
}

/// Size of a credit line block in the sender's window.
pub const CREDIT_LEN: u64 = 128;
/// Consumer index (u64), written by the receiver (Release).
pub const CREDIT_HEAD_OFF: usize = 0;
/// Credit futex word (u32), bumped by the receiver when the sender is armed.
pub const CREDIT_SEQ_OFF: usize = 8;
/// Sender's armed flag (u32), on the sender's own cache line.
pub const CREDIT_ARMED_OFF: usize = 64;
/// Peer-closed flag (u32), set by the supervisor when the receiver or its node is gone. On the
/// sender's line so that checking it on every send costs no cache miss.
pub const CREDIT_PEER_CLOSED_OFF: usize = 68;
/// Connection cookie (u32), written by the supervisor at connect: a sender whose cookie no
/// longer matches holds a connection that was torn down and its memory reused.
pub const CREDIT_COOKIE_OFF: usize = 72;

/// Kind of a ring record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// A datagram.
    Data = 1,
    /// Filler up to the end of the data area; the next record starts at offset 0.
    Pad = 2,
}

mod record_field {
    pub const LEN: usize = 0;
    pub const KIND: usize = 4;
    pub const SEQ: usize = 8;
    pub const NOT_BEFORE: usize = 16;
}

packet!(
    /// A record header inside a ring's data area.
    RecordHeader,
    RECORD_HEADER_LEN as usize
);

/// Parsed record header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordRepr {
    /// Payload length (Data) or bytes skipped after the header (Pad).
    pub len: u32,
    /// Record kind.
    pub kind: RecordKind,
    /// Sequence number, consecutive per ring starting at 0.
    pub seq: u64,
    /// Link emulation: CLOCK_MONOTONIC nanoseconds before which the record must not be
    /// delivered (0: at once).
    pub not_before_ns: u64,
}

impl RecordRepr {
    /// Parses a record header (the ring validates `len` and `seq` against its own state).
    pub fn parse<T: AsRef<[u8]>>(p: &RecordHeader<T>) -> Result<Self, LayoutError> {
        p.check_len()?;
        let b = p.buffer.as_ref();
        let kind_raw = rd_u32(b, record_field::KIND);
        let kind = match kind_raw {
            1 => RecordKind::Data,
            2 => RecordKind::Pad,
            v => {
                return Err(LayoutError::BadField {
                    field: "kind",
                    value: v.into(),
                })
            }
        };
        Ok(Self {
            len: rd_u32(b, record_field::LEN),
            kind,
            seq: rd_u64(b, record_field::SEQ),
            not_before_ns: rd_u64(b, record_field::NOT_BEFORE),
        })
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut RecordHeader<T>) {
        let b = p.buffer.as_mut();
        wr_u32(b, record_field::LEN, self.len);
        wr_u32(b, record_field::KIND, self.kind as u32);
        wr_u64(b, record_field::SEQ, self.seq);
        wr_u64(b, record_field::NOT_BEFORE, self.not_before_ns);
    }

    /// Bytes a data record with `len` payload bytes occupies in the ring.
    pub const fn footprint(len: u64) -> u64 {
        (RECORD_HEADER_LEN + len).div_ceil(RECORD_ALIGN) * RECORD_ALIGN
    }
}

// Layouts of the RDMA verbs path live in their own file.
pub mod registry;
pub mod verbs;

const _: () = {
    assert!(EP_RING_LIST_OFF.is_multiple_of(CACHE_LINE));
    assert!(EP_DOORBELL_OFF / CACHE_LINE != EP_ARMED_OFF / CACHE_LINE);
    assert!(RING_TAIL_OFF / CACHE_LINE != RING_SENDER_CLOSED_OFF / CACHE_LINE);
    assert!(CREDIT_HEAD_OFF / CACHE_LINE != CREDIT_ARMED_OFF / CACHE_LINE);
    assert!(WIN_DOORBELL_SEQ_OFF / CACHE_LINE != WIN_DOORBELL_ARMED_OFF / CACHE_LINE);
    assert!(WIN_SCRATCH_OFF + SCRATCHPADS * 4 <= WIN_IFSTATS_OFF);
    assert!(WIN_IFSTATS_OFF + 48 <= WIN_LINK_EGRESS_OFF);
    assert!(WIN_LINK_INGRESS_OFF + 8 <= WIN_FWD_OFF);
    assert!(WIN_FWD_OFF + 16 <= WIN_LINK_CLOCKS_OFF);
    assert!(WIN_LINK_CLOCKS_OFF + 8 * MAX_NODES as usize <= 4096);
    assert!(FABRIC_EPOCH_OFF + 4 <= NODE_TABLE_OFF);
    assert!(fabric_field::LINK_MODE + 4 <= fabric_field::HOSTS);
    assert!(fabric_field::HOSTS + 4 <= fabric_field::EPOCH);
    assert!(RING_DATA_OFF.is_multiple_of(RECORD_ALIGN));
    assert!(ENDPOINT_MAX_RINGS >= 256);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fabric_header_round_trips() {
        let repr = FabricHeaderRepr {
            spans_hosts: true,
            nodes: 4,
            window_size: 64 << 20,
            created_ms: 123,
            supervisor_pid: 77,
            name: "radar".into(),
            link: Some(LinkRepr {
                name: "pcie-gen3x4".into(),
                bytes_per_s: 3_200_000_000,
                hop_ns: 20,
                store_and_forward: true,
            }),
        };
        let mut buf = [0u8; NODE_TABLE_OFF];
        repr.emit(&mut FabricHeader::new_unchecked(&mut buf[..]));
        let parsed =
            FabricHeaderRepr::parse(&FabricHeader::new_checked(&buf[..]).unwrap()).unwrap();
        assert_eq!(parsed, repr);
    }

    #[test]
    fn fabric_header_rejects_bad_magic_version_marker_and_node_count() {
        let repr = FabricHeaderRepr {
            spans_hosts: false,
            nodes: 4,
            window_size: 1,
            created_ms: 0,
            supervisor_pid: 1,
            name: "x".into(),
            link: None,
        };
        let mut good = vec![0u8; NODE_TABLE_OFF];
        repr.emit(&mut FabricHeader::new_unchecked(&mut good[..]));
        let parse = |b: &[u8]| FabricHeaderRepr::parse(&FabricHeader::new_unchecked(b));

        let mut b = good.clone();
        b[0] ^= 1;
        assert!(matches!(parse(&b), Err(LayoutError::BadMagic(_))));
        let mut b = good.clone();
        b[8] = 9;
        assert_eq!(parse(&b), Err(LayoutError::BadVersion(9)));
        let mut b = good.clone();
        b[FABRIC_INIT_OFF] = 0;
        assert_eq!(parse(&b), Err(LayoutError::NotInitialized));
        let mut b = good.clone();
        b[fabric_field::HOSTS] = 2;
        assert_eq!(
            parse(&b),
            Err(LayoutError::BadField {
                field: "hosts",
                value: 2
            })
        );
        let mut b = good.clone();
        b[16..20].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            parse(&b),
            Err(LayoutError::BadField { field: "nodes", .. })
        ));
        let mut b = good.clone();
        b[16..20].copy_from_slice(&(MAX_NODES + 1).to_le_bytes());
        assert!(matches!(
            parse(&b),
            Err(LayoutError::BadField { field: "nodes", .. })
        ));
        assert!(matches!(
            parse(&good[..10]),
            Err(LayoutError::Truncated { .. })
        ));
    }

    #[test]
    fn node_entry_round_trips_and_rejects_unknown_state() {
        let repr = NodeEntryRepr {
            slot: 3,
            state: NodeState::Ready,
            generation: 2,
            pid: 99,
            window_size: 64 << 20,
            since_ms: 5,
            reason: DownReason::None,
        };
        let mut buf = [0u8; 64];
        repr.emit(&mut NodeEntry::new_unchecked(&mut buf[..]));
        assert_eq!(
            NodeEntryRepr::parse(&NodeEntry::new_unchecked(&buf[..])).unwrap(),
            repr
        );
        let mut bad = buf;
        bad[4] = 7;
        assert!(NodeEntryRepr::parse(&NodeEntry::new_unchecked(&bad[..])).is_err());
        let mut bad = buf;
        bad[32..36].copy_from_slice(&0u32.to_le_bytes());
        assert!(NodeEntryRepr::parse(&NodeEntry::new_unchecked(&bad[..])).is_err());
        assert!(NodeEntry::new_checked(&buf[..63]).is_err());
    }

    #[test]
    fn window_header_round_trips_and_rejects_size_mismatch() {
        let repr = WindowHeaderRepr {
            slot: 2,
            generation: 1,
            size: 64 << 20,
        };
        let mut buf = [0u8; 64];
        repr.emit(&mut WindowHeader::new_unchecked(&mut buf[..]));
        let p = WindowHeader::new_unchecked(&buf[..]);
        assert_eq!(WindowHeaderRepr::parse(&p, 64 << 20).unwrap(), repr);
        assert!(WindowHeaderRepr::parse(&p, 32 << 20).is_err());
        let mut bad = buf;
        bad[WIN_INIT_OFF] = 0;
        assert_eq!(
            WindowHeaderRepr::parse(&WindowHeader::new_unchecked(&bad[..]), 64 << 20),
            Err(LayoutError::NotInitialized)
        );
    }

    #[test]
    fn endpoint_header_round_trips_and_rejects_bad_bytes() {
        let repr = EndpointRepr {
            slot: 1,
            port: 7,
            owner_pid: 10,
            generation: 3,
        };
        let mut buf = [0u8; 64];
        repr.emit(&mut EndpointHeader::new_unchecked(&mut buf[..]));
        assert_eq!(
            EndpointRepr::parse(&EndpointHeader::new_unchecked(&buf[..])).unwrap(),
            repr
        );
        for i in [0usize, 8, 24, EP_INIT_OFF] {
            let mut bad = buf;
            bad[i] ^= 0x55;
            assert!(EndpointRepr::parse(&EndpointHeader::new_unchecked(&bad[..])).is_err());
        }
    }

    #[test]
    fn ring_size_grows_with_the_window_from_one_to_four_mib() {
        assert_eq!(ring_data_for_window(MIN_WINDOW), DEFAULT_RING_DATA);
        assert_eq!(ring_data_for_window(8 << 20), 1 << 20);
        assert_eq!(ring_data_for_window(32 << 20), 2 << 20);
        assert_eq!(ring_data_for_window(63 << 20), 2 << 20);
        assert_eq!(ring_data_for_window(64 << 20), 4 << 20);
        assert_eq!(ring_data_for_window(64 << 30), MAX_RING_DATA);
        for w in [MIN_WINDOW, 5 << 20, 100 << 20, 1 << 30] {
            let r = ring_data_for_window(w);
            assert!(
                r.is_power_of_two() && r as usize >= 16 * MAX_DGRAM / 2,
                "{w}: {r}"
            );
        }
    }

    #[test]
    fn ring_header_round_trips_and_rejects_bad_sizes_and_offsets() {
        let repr = RingRepr {
            data_len: DEFAULT_RING_DATA,
            src_slot: 2,
            src_port: 5,
            dst_port: 6,
            src_generation: 1,
            credit_off: 8192,
        };
        let mut buf = [0u8; 64];
        repr.emit(&mut RingHeader::new_unchecked(&mut buf[..]));
        assert_eq!(
            RingRepr::parse(&RingHeader::new_unchecked(&buf[..])).unwrap(),
            repr
        );
        let with = |f: &dyn Fn(&mut RingRepr)| {
            let mut r = repr;
            f(&mut r);
            let mut b = [0u8; 64];
            r.emit(&mut RingHeader::new_unchecked(&mut b[..]));
            RingRepr::parse(&RingHeader::new_unchecked(&b[..]))
        };
        assert!(with(&|r| r.data_len = 3 << 18).is_err());
        assert!(with(&|r| r.data_len = 4096).is_err());
        // The least ring (a direct route's between hosts) holds two of the largest datagrams.
        assert_eq!(MIN_RING_DATA, 256 << 10);
        assert!(with(&|r| r.data_len = MIN_RING_DATA).is_ok());
        assert!(with(&|r| r.data_len = MIN_RING_DATA / 2).is_err());
        assert!(with(&|r| r.src_slot = 0).is_err());
        assert!(with(&|r| r.credit_off = 8193).is_err());
        assert!(with(&|r| r.credit_off = 64).is_err());
    }

    #[test]
    fn record_header_round_trips_and_rejects_unknown_kind() {
        let repr = RecordRepr {
            len: 100,
            kind: RecordKind::Data,
            seq: 42,
            not_before_ns: 7,
        };
        let mut buf = [0u8; RECORD_HEADER_LEN as usize];
        repr.emit(&mut RecordHeader::new_unchecked(&mut buf[..]));
        assert_eq!(
            RecordRepr::parse(&RecordHeader::new_unchecked(&buf[..])).unwrap(),
            repr
        );
        buf[4] = 9;
        assert!(RecordRepr::parse(&RecordHeader::new_unchecked(&buf[..])).is_err());
        assert_eq!(RecordRepr::footprint(0), 64);
        assert_eq!(RecordRepr::footprint(40), 64);
        assert_eq!(RecordRepr::footprint(41), 128);
    }
}
