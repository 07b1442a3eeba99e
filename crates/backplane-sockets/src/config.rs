//! What `backplane exec --accel` tells the library through the environment, which addresses
//! are fabric nodes, where the agreement's files live, the per-node counters `status` shows,
//! and the one log line per connection.
//!
//! - `BACKPLANE_ACCEL_DIR`: the fabric's directory for accelerated sockets (listener
//!   registrations, offers, counters); no directory, no acceleration.
//! - `BACKPLANE_NODE`: this node's slot.
//! - `BACKPLANE_ACCEL_NET`: `NETWORK/PREFIX,NODES`, the fabric's IPv4 plan (IPv6 link-local
//!   addresses carry the slot in their interface identifier, as the MAC does).
//! - `BACKPLANE_ACCEL=0`: load, but accelerate nothing.
//! - `BACKPLANE_ACCEL_LOG=1`: a line on stderr per connection: accelerated or not, and why.
//! - `BACKPLANE_ACCEL_RING`: ring bytes per direction (power of two, 4 KiB–64 MiB).
//! - `BACKPLANE_ACCEL_SPIN_US`: how long a blocking call spins before it sleeps.

use std::ffi::CStr;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::sys;

/// Default ring bytes per direction: 8 MiB, the size of the kernel's own TCP buffers' maxima
/// (4 MiB to send, 6 MiB to receive by default). Against 2 MiB, in four alternating pairs
/// of `perf ip --accel` runs: iperf3 through the rings 251–266 Gbit/s against 194–242 in the
/// runs without a collapsed round, and 0.88–1.01× the datagram bandwidth against 0.65–0.80×
/// (a bigger ring lets the reader lag the writer by more than a core's 1 MiB L2).
pub const DEFAULT_RING: usize = 8 << 20;
/// Default spin before a blocking call sleeps.
pub const DEFAULT_SPIN_US: u64 = 50;

/// The library's settings, read once.
#[derive(Debug)]
pub struct Config {
    /// Directory of the agreement's files, with a trailing '/'.
    pub dir: Vec<u8>,
    /// This node's slot.
    pub node: u32,
    /// IPv4 network, prefix length, node count.
    pub net: Option<(Ipv4Addr, u8, u32)>,
    /// Print a line per connection.
    pub log: bool,
    /// Ring bytes per direction.
    pub ring: usize,
    /// Spin before sleeping, in nanoseconds.
    pub spin_ns: u64,
}

static CONFIG: OnceLock<Option<Config>> = OnceLock::new();

fn env(name: &CStr) -> Option<String> {
    // SAFETY: getenv with a NUL-terminated name; the result, if not null, is a NUL-terminated
    // string owned by the environment, copied before anything could change it.
    let p = unsafe { libc::getenv(name.as_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null result of getenv, NUL-terminated.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// The settings, or `None` when the library should accelerate nothing.
pub fn get() -> Option<&'static Config> {
    CONFIG.get_or_init(read).as_ref()
}

fn read() -> Option<Config> {
    if env(c"BACKPLANE_ACCEL").as_deref() == Some("0") {
        return None;
    }
    let dir = env(c"BACKPLANE_ACCEL_DIR").filter(|d| !d.is_empty())?;
    let node: u32 = env(c"BACKPLANE_NODE")?.parse().ok()?;
    let net = env(c"BACKPLANE_ACCEL_NET").and_then(|s| parse_net(&s));
    let ring = env(c"BACKPLANE_ACCEL_RING")
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|r| {
            r.is_power_of_two() && (crate::seg::MIN_RING..=crate::seg::MAX_RING).contains(r)
        })
        .unwrap_or(DEFAULT_RING);
    let spin_ns = env(c"BACKPLANE_ACCEL_SPIN_US")
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(DEFAULT_SPIN_US)
        .saturating_mul(1000);
    let mut dir = dir.into_bytes();
    if dir.last() != Some(&b'/') {
        dir.push(b'/');
    }
    Some(Config {
        dir,
        node,
        net,
        log: env(c"BACKPLANE_ACCEL_LOG").is_some_and(|v| v != "0" && !v.is_empty()),
        ring,
        spin_ns,
    })
}

/// Parses `NETWORK/PREFIX,NODES`.
pub fn parse_net(s: &str) -> Option<(Ipv4Addr, u8, u32)> {
    let (cidr, nodes) = s.split_once(',')?;
    let (ip, len) = cidr.split_once('/')?;
    let ip: Ipv4Addr = ip.parse().ok()?;
    let len: u8 = len.parse().ok()?;
    if len > 30 {
        return None;
    }
    Some((ip, len, nodes.parse().ok()?))
}

impl Config {
    /// The node an address belongs to, if it is a fabric node's `bp0` address.
    pub fn node_of(&self, ip: std::net::IpAddr) -> Option<u32> {
        match ip {
            std::net::IpAddr::V4(v4) => self.node_of_v4(v4),
            std::net::IpAddr::V6(v6) => {
                if let Some(v4) = v6.to_ipv4_mapped() {
                    return self.node_of_v4(v4);
                }
                node_of_link_local(v6).filter(|&n| self.net.is_none_or(|(_, _, max)| n <= max))
            }
        }
    }

    fn node_of_v4(&self, ip: Ipv4Addr) -> Option<u32> {
        let (net, prefix, nodes) = self.net?;
        let mask = u32::MAX << (32 - u32::from(prefix));
        let ip = u32::from(ip);
        if ip & mask != u32::from(net) & mask {
            return None;
        }
        let host = ip - (u32::from(net) & mask);
        (1..=nodes).contains(&host).then_some(host)
    }

    /// The file a listener on `port` of `node` holds a shared lock on.
    pub fn listener_path(&self, node: u32, port: u16) -> Vec<u8> {
        self.path(format_args!("n{node}-l{port}"))
    }

    /// The offer a client at (`snode`, `sport`) makes to (`dnode`, `dport`).
    pub fn offer_path(&self, dnode: u32, dport: u16, snode: u32, sport: u16) -> Vec<u8> {
        self.path(format_args!("n{dnode}-p{dport}-n{snode}-p{sport}"))
    }

    /// A path in the directory, NUL-terminated.
    pub fn path(&self, name: std::fmt::Arguments<'_>) -> Vec<u8> {
        let mut p = self.dir.clone();
        p.extend_from_slice(name.to_string().as_bytes());
        p.push(0);
        p
    }
}

/// The slot in a fabric node's IPv6 link-local address: the kernel derives it from the MAC
/// `02:62:70:00:HH:LL` as `fe80::62:70ff:fe00:HHLL`.
pub fn node_of_link_local(ip: Ipv6Addr) -> Option<u32> {
    let s = ip.segments();
    (s[0] == 0xfe80 && s[1..4] == [0, 0, 0] && s[4] == 0x0062 && s[5] == 0x70ff && s[6] == 0xfe00)
        .then_some(u32::from(s[7]))
        .filter(|&n| n >= 1)
}

/// Why a connection stays on the kernel's TCP (the counters' order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Fallback {
    /// No accelerated listener on the peer's port.
    PeerNotAccelerated = 0,
    /// The accepting end found no offer for the connection (the peer is not accelerated).
    NoOffer = 1,
    /// An offer that failed validation.
    BadOffer = 2,
    /// The connect did not complete within a second (non-blocking) or was interrupted.
    SlowConnect = 3,
    /// The peer's wake-up socket could not be reached (the peer is gone or not allowed).
    PeerUnreachable = 4,
    /// Out of descriptors, memory or a descriptor number beyond the table.
    Resources = 5,
}

/// Names of the fallback reasons, by index.
pub const FALLBACK_NAMES: [&str; 6] = [
    "peer-not-accelerated",
    "no-offer",
    "bad-offer",
    "slow-connect",
    "peer-unreachable",
    "resources",
];

/// The per-node counters file: `n{node}.stats`, 4 KiB of little-endian u64s.
pub mod stats {
    /// "BPACSTA1".
    pub const MAGIC: u64 = u64::from_le_bytes(*b"BPACSTA1");
    /// Connections accelerated (each end counts its own).
    pub const CONNS: usize = 1;
    /// Bytes sent over rings.
    pub const TX_BYTES: usize = 2;
    /// Bytes received over rings.
    pub const RX_BYTES: usize = 3;
    /// Connections ended because their ring memory was corrupt.
    pub const CORRUPT: usize = 4;
    /// Connections open now (accelerated ends).
    pub const OPEN: usize = 5;
    /// First fallback counter; `FALLBACK + reason`.
    pub const FALLBACK: usize = 8;
    /// Words in the file.
    pub const WORDS: usize = 512;
}

struct Stats(*mut AtomicU64);
// SAFETY: a shared mapping of atomics, valid for the process's life.
unsafe impl Send for Stats {}
// SAFETY: as above.
unsafe impl Sync for Stats {}

static STATS: OnceLock<Option<Stats>> = OnceLock::new();

fn stats_map() -> Option<&'static Stats> {
    STATS
        .get_or_init(|| {
            let cfg = get()?;
            let path = cfg.path(format_args!("n{}.stats", cfg.node));
            let fd = sys::open(&path, libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC, 0o600).ok()?
                as i32;
            let len = stats::WORDS * 8;
            let ok = sys::fstat(fd).is_ok_and(|(_, size, _)| size >= len as u64)
                || sys::ftruncate(fd, len as u64).is_ok();
            let map = if ok {
                sys::mmap_shared(fd, len).ok()
            } else {
                None
            };
            let _ = sys::close(fd);
            let p = map? as *mut AtomicU64;
            // SAFETY: the mapping is len bytes, page-aligned; word 0 is inside it.
            unsafe { &*p }.store(stats::MAGIC, Ordering::Relaxed);
            Some(Stats(p))
        })
        .as_ref()
}

/// The supervisor's file of node words in the directory (per slot `generation << 32 | state`).
pub const NODES_FILE: &str = "nodes";
/// The state a node serves traffic in (the low half of its word).
pub const NODE_READY: u64 = 2;

/// The supervisor's node words ([`NODES_FILE`]): mapped read-only, once.
struct NodeWords(*const AtomicU64, usize);
// SAFETY: a shared read-only mapping of atomics, valid for the process's life.
unsafe impl Send for NodeWords {}
// SAFETY: as above.
unsafe impl Sync for NodeWords {}

static NODES: OnceLock<Option<NodeWords>> = OnceLock::new();

/// Node `slot`'s state and generation as the supervisor last wrote them (`None`: no such
/// file or slot, e.g. a fabric started by an older supervisor).
pub fn node_word(slot: u32) -> Option<u64> {
    let n = NODES
        .get_or_init(|| {
            let cfg = get()?;
            let path = cfg.path(format_args!("{NODES_FILE}"));
            let fd = sys::open(&path, libc::O_RDONLY | libc::O_CLOEXEC, 0).ok()? as i32;
            let len = sys::fstat(fd)
                .map(|(_, size, _)| size as usize)
                .unwrap_or(0);
            let map = (8..=1 << 20)
                .contains(&len)
                .then(|| sys::mmap_read(fd, len).ok())
                .flatten();
            let _ = sys::close(fd);
            Some(NodeWords(map? as *const AtomicU64, len / 8))
        })
        .as_ref()?;
    let i = (slot as usize).checked_sub(1)?;
    // SAFETY: i < words of the mapping (checked), 8-aligned (page-aligned base).
    (i < n.1).then(|| unsafe { &*n.0.add(i) }.load(Ordering::Acquire))
}

/// A node word that says READY (state 2 in the low half).
pub fn node_ready(word: u64) -> bool {
    word & 0xffff_ffff == NODE_READY
}

/// Adds `v` to counter `idx` of this node.
pub fn count(idx: usize, v: u64) {
    if idx >= stats::WORDS || v == 0 {
        return;
    }
    if let Some(s) = stats_map() {
        // SAFETY: idx < WORDS, inside the mapping.
        unsafe { &*s.0.add(idx) }.fetch_add(v, Ordering::Relaxed);
    }
}

/// Subtracts one from counter `idx` (the open-connection gauge).
pub fn uncount(idx: usize) {
    if let Some(s) = stats_map() {
        if idx < stats::WORDS {
            // SAFETY: idx < WORDS, inside the mapping.
            unsafe { &*s.0.add(idx) }.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Counts a fallback and logs it.
pub fn fallback(why: Fallback, what: &dyn std::fmt::Display) {
    count(stats::FALLBACK + why as usize, 1);
    log(format_args!(
        "{what}: not accelerated ({})",
        FALLBACK_NAMES[why as usize]
    ));
}

/// One line on stderr when `BACKPLANE_ACCEL_LOG` is set.
pub fn log(msg: std::fmt::Arguments<'_>) {
    if get().is_some_and(|c| c.log) {
        let line = format!("backplane-accel[{}]: {msg}\n", sys::getpid());
        let _ = sys::write(2, line.as_ptr() as *const libc::c_void, line.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config {
            dir: b"/x/".to_vec(),
            node: 1,
            net: parse_net("192.168.20.0/24,4"),
            log: false,
            ring: DEFAULT_RING,
            spin_ns: 0,
        }
    }

    #[test]
    fn fabric_addresses_map_to_nodes() {
        let c = cfg();
        let n = |s: &str| c.node_of(s.parse().unwrap());
        assert_eq!(n("192.168.20.1"), Some(1));
        assert_eq!(n("192.168.20.4"), Some(4));
        assert_eq!(n("192.168.20.5"), None, "beyond the fabric's nodes");
        assert_eq!(n("192.168.20.0"), None);
        assert_eq!(n("192.168.21.1"), None);
        assert_eq!(n("127.0.0.1"), None);
        assert_eq!(n("::ffff:192.168.20.2"), Some(2));
        assert_eq!(n("fe80::62:70ff:fe00:3"), Some(3));
        assert_eq!(n("fe80::62:70ff:fe00:9"), None);
        assert_eq!(n("fe80::1"), None);
        assert_eq!(n("::1"), None);
        assert_eq!(parse_net("10.0.0.0/31,2"), None);
        assert_eq!(parse_net("garbage"), None);
    }

    #[test]
    fn counters_layout_is_the_one_status_reads() {
        use backplane::fabric::accel as r;
        assert_eq!(stats::MAGIC, r::STATS_MAGIC);
        assert_eq!(
            [
                stats::CONNS,
                stats::TX_BYTES,
                stats::RX_BYTES,
                stats::CORRUPT,
                stats::OPEN
            ],
            [r::CONNS, r::TX_BYTES, r::RX_BYTES, r::CORRUPT, r::OPEN]
        );
        assert_eq!((stats::FALLBACK, stats::WORDS), (r::FALLBACK, r::WORDS));
        assert_eq!(FALLBACK_NAMES, r::FALLBACK_NAMES);
        // The node words the supervisor writes.
        assert_eq!(NODES_FILE, r::NODES_FILE);
        assert_eq!(NODE_READY, backplane::wire::NodeState::Ready as u64);
    }

    #[test]
    fn agreement_paths() {
        let c = cfg();
        assert_eq!(c.listener_path(2, 5201), b"/x/n2-l5201\0");
        assert_eq!(c.offer_path(2, 5201, 1, 40000), b"/x/n2-p5201-n1-p40000\0");
    }
}
