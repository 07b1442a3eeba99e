//! IP over the fabric: each node gets a network namespace with a TAP interface `bp0`, driven
//! by the node's agent, which switches Ethernet frames over the fabric's datagram rings.
//!
//! [`agent`] is the node's agent with its TAP ↔ ring data path; this module holds the pieces
//! it and the supervisor use: the addressing plan (subnet, MACs derived from the slot, host
//! names), frame classification (sans-IO), namespace names and the files a fabric creates for
//! them, and the TAP device itself.
//!
//! Frames cross the fabric with the TAP's virtio-net header in front (IFF_VNET_HDR), so
//! checksum offload and TSO/GSO super-frames of up to 64 KiB travel as they are: the sending
//! kernel never segments, the receiving kernel never recomputes checksums.

pub mod agent;

use std::fmt;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;

/// Port every node agent's frame endpoint is bound to. Ports at and above
/// [`RESERVED_PORTS`] are the fabric's own.
pub const NET_PORT: u32 = 0xFFFF_0001;
/// First port reserved for the fabric's own services.
pub const RESERVED_PORTS: u32 = 0xFFFF_0000;
/// Interface name inside every node.
pub const IFNAME: &str = "bp0";
/// Default MTU, as VXFabric's `vxeth0`.
pub const DEFAULT_MTU: u32 = 65500;
/// Default subnet.
pub const DEFAULT_SUBNET: &str = "192.168.20.0/24";
/// Size of the virtio-net header the TAP prepends (`virtio_net_hdr_v1`, with num_buffers).
pub const VNET_HDR_LEN: usize = 12;
/// Largest frame on the fabric: header + Ethernet header + a 64 KiB GSO IP packet.
pub const MAX_FRAME: usize = VNET_HDR_LEN + 14 + 65535;
const _: () = assert!(MAX_FRAME <= crate::wire::MAX_DGRAM);

/// Why a network setting was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetConfigError {
    /// Occurs when the subnet is not `a.b.c.d/len`.
    #[error("--subnet '{0}' is not an IPv4 CIDR such as 192.168.20.0/24")]
    BadSubnet(String),
    /// Occurs when the subnet has fewer host addresses than nodes.
    #[error("--subnet {subnet} has room for {room} nodes, not {nodes}; use a larger subnet")]
    SubnetTooSmall {
        /// The subnet.
        subnet: String,
        /// Host addresses available.
        room: u64,
        /// Nodes requested.
        nodes: u32,
    },
    /// Occurs when the MTU is outside what the interface supports.
    #[error("--mtu {0} is out of range: use 68 to 65535")]
    BadMtu(u32),
}

/// The addressing plan of a fabric's network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetPlan {
    /// Network address.
    pub network: Ipv4Addr,
    /// Prefix length.
    pub prefix: u8,
    /// Interface MTU.
    pub mtu: u32,
}

impl NetPlan {
    /// Parses `--subnet` and `--mtu` and checks they fit `nodes`.
    pub fn new(subnet: &str, mtu: u32, nodes: u32) -> Result<Self, NetConfigError> {
        let bad = || NetConfigError::BadSubnet(subnet.to_owned());
        let (ip, len) = subnet.split_once('/').ok_or_else(bad)?;
        let ip: Ipv4Addr = ip.parse().map_err(|_| bad())?;
        let prefix: u8 = len.parse().map_err(|_| bad())?;
        if prefix > 30 {
            return Err(NetConfigError::SubnetTooSmall {
                subnet: subnet.to_owned(),
                room: 0,
                nodes,
            });
        }
        let mask = u32::MAX << (32 - prefix);
        let network = Ipv4Addr::from(u32::from(ip) & mask);
        let room = (1u64 << (32 - prefix)) - 2;
        if u64::from(nodes) > room {
            return Err(NetConfigError::SubnetTooSmall {
                subnet: subnet.to_owned(),
                room,
                nodes,
            });
        }
        if !(68..=65535).contains(&mtu) {
            return Err(NetConfigError::BadMtu(mtu));
        }
        Ok(Self {
            network,
            prefix,
            mtu,
        })
    }

    /// Node `slot`'s address: the network plus `slot` (node 1 gets .1).
    pub fn address(&self, slot: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + slot)
    }

    /// `address/prefix` of node `slot`.
    pub fn cidr(&self, slot: u32) -> String {
        format!("{}/{}", self.address(slot), self.prefix)
    }

    /// The `/etc/hosts` every node sees: localhost and `node1`..`nodeN`.
    pub fn hosts_file(&self, nodes: u32) -> String {
        let mut s =
            String::from("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n");
        for n in 1..=nodes {
            s += &format!("{}\tnode{n}\n", self.address(n));
        }
        s
    }
}

/// A MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mac(pub [u8; 6]);

impl Mac {
    /// The MAC of node `slot`: locally administered, unicast, `02:62:70:00:HH:LL` ("bp").
    pub fn of_slot(slot: u32) -> Self {
        Mac([
            0x02,
            0x62,
            0x70,
            (slot >> 16) as u8,
            (slot >> 8) as u8,
            slot as u8,
        ])
    }

    /// The slot a fabric MAC belongs to, if it is one.
    pub fn slot(&self) -> Option<u32> {
        let m = self.0;
        (m[0] == 0x02 && m[1] == 0x62 && m[2] == 0x70)
            .then(|| u32::from(m[3]) << 16 | u32::from(m[4]) << 8 | u32::from(m[5]))
    }

    /// Broadcast or multicast (group bit set).
    pub fn is_group(&self) -> bool {
        self.0[0] & 1 == 1
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// Where a frame read from a node's TAP goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dest {
    /// To one node.
    Node(u32),
    /// To every other node (broadcast, multicast).
    All,
    /// Nowhere: too short, or a unicast MAC no node owns.
    Drop,
}

/// Classifies a fabric frame (virtio-net header + Ethernet frame) by its destination MAC.
pub fn classify(frame: &[u8], nodes: u32, me: u32) -> Dest {
    let Some(dst) = frame.get(VNET_HDR_LEN..VNET_HDR_LEN + 6) else {
        return Dest::Drop;
    };
    if frame.len() < VNET_HDR_LEN + 14 {
        return Dest::Drop;
    }
    let mac = Mac(dst.try_into().expect("6 bytes"));
    if mac.is_group() {
        return Dest::All;
    }
    match mac.slot() {
        Some(s) if s >= 1 && s <= nodes && s != me => Dest::Node(s),
        _ => Dest::Drop,
    }
}

/// Name of node `slot`'s network namespace in fabric `fabric`.
pub fn netns_name(fabric: &str, slot: u32) -> String {
    format!("bp-{fabric}-{slot}")
}

/// Where `ip netns` keeps per-namespace files (its `exec` bind-mounts them over `/etc`).
pub fn netns_etc(fabric: &str, slot: u32) -> PathBuf {
    PathBuf::from("/etc/netns").join(netns_name(fabric, slot))
}

/// A TAP device with a virtio-net header and checksum/TSO offloads.
#[derive(Debug)]
pub struct Tap {
    fd: OwnedFd,
}

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
const TUN_F_CSUM: libc::c_uint = 0x01;
const TUN_F_TSO4: libc::c_uint = 0x02;
const TUN_F_TSO6: libc::c_uint = 0x04;
const TUN_F_TSO_ECN: libc::c_uint = 0x08;

impl Tap {
    /// Creates TAP `name` in the calling thread's network namespace.
    pub fn create(name: &str) -> std::io::Result<Self> {
        use rustix::fs::{open, Mode, OFlags};
        let fd = open(
            "/dev/net/tun",
            OFlags::RDWR | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let mut ifr = [0u8; 40];
        let n = name.len().min(15);
        ifr[..n].copy_from_slice(&name.as_bytes()[..n]);
        ifr[16..18].copy_from_slice(&(IFF_TAP | IFF_NO_PI | IFF_VNET_HDR).to_ne_bytes());
        let ioctl = |req: libc::c_ulong, arg: *mut libc::c_void| -> std::io::Result<()> {
            // SAFETY: `fd` is an open tun device; each request below is passed the argument
            // type the kernel expects (an ifreq buffer of 40 bytes, or an int by pointer/value).
            if unsafe { libc::ioctl(fd.as_raw_fd(), req, arg) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        };
        ioctl(TUNSETIFF, ifr.as_mut_ptr().cast())?;
        let mut hdr = VNET_HDR_LEN as libc::c_int;
        ioctl(TUNSETVNETHDRSZ, (&mut hdr as *mut libc::c_int).cast())?;
        let offload = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN;
        ioctl(TUNSETOFFLOAD, offload as usize as *mut libc::c_void)?;
        Ok(Self { fd })
    }

    /// Reads one frame (virtio-net header + Ethernet frame) into `bufs`.
    pub fn read_vectored(&self, bufs: &mut [std::io::IoSliceMut<'_>]) -> std::io::Result<usize> {
        loop {
            match rustix::io::readv(&self.fd, bufs) {
                Err(rustix::io::Errno::INTR) => continue,
                r => return r.map_err(Into::into),
            }
        }
    }

    /// Writes one frame (virtio-net header + Ethernet frame).
    pub fn write(&self, frame: &[u8]) -> std::io::Result<usize> {
        loop {
            match rustix::io::write(&self.fd, frame) {
                Err(rustix::io::Errno::INTR) => continue,
                r => return r.map_err(Into::into),
            }
        }
    }
}

/// Enters the network namespace mounted at `/run/netns/NAME` (calling thread only: call it
/// before starting other threads).
pub fn enter_netns(name: &str) -> std::io::Result<()> {
    use rustix::fs::{open, Mode, OFlags};
    let fd = open(
        format!("/run/netns/{name}").as_str(),
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    rustix::thread::move_into_link_name_space(
        std::os::fd::AsFd::as_fd(&fd),
        Some(rustix::thread::LinkNameSpaceType::Network),
    )?;
    Ok(())
}

fn ip(args: &[&str]) -> std::io::Result<()> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot run `ip` (install iproute2): {e}"))
        })?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Creates node `slot`'s namespace (with loopback up) and its `/etc/netns/.../hosts`.
pub fn create_node_netns(
    fabric: &str,
    slot: u32,
    plan: &NetPlan,
    nodes: u32,
) -> std::io::Result<()> {
    let ns = netns_name(fabric, slot);
    ip(&["netns", "add", &ns])?;
    ip(&["-n", &ns, "link", "set", "lo", "up"])?;
    let etc = netns_etc(fabric, slot);
    std::fs::create_dir_all(&etc)?;
    std::fs::write(etc.join("hosts"), plan.hosts_file(nodes))?;
    Ok(())
}

/// Runs an `ip` command in the current namespace (the agent configuring its interface).
pub fn ip_here(args: &[&str]) -> std::io::Result<()> {
    ip(args)
}

/// Removes every namespace and `/etc/netns` directory of fabric `fabric` (also those a
/// crashed supervisor left behind). Best effort; safe to call when there are none.
pub fn cleanup(fabric: &str) {
    let prefix = format!("bp-{fabric}-");
    let ours = |name: &str| {
        name.strip_prefix(&prefix)
            .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|c| c.is_ascii_digit()))
    };
    if let Ok(d) = std::fs::read_dir("/run/netns") {
        for e in d.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if ours(&name) {
                let _ = ip(&["netns", "del", &name]);
            }
        }
    }
    if let Ok(d) = std::fs::read_dir("/etc/netns") {
        for e in d.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if ours(&name) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Parses `/proc/net/dev` for `ifname`: rx packets, rx bytes, tx packets, tx bytes,
/// rx dropped, tx dropped.
pub fn parse_net_dev(text: &str, ifname: &str) -> Option<[u64; 6]> {
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{ifname}:")))?;
    let (_, rest) = line.split_once(':')?;
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    if f.len() < 16 {
        return None;
    }
    Some([f[1], f[0], f[9], f[8], f[3], f[11]])
}

/// True if fabric `fabric` has IP over the fabric (its namespaces exist).
pub fn has_netns(fabric: &str, slot: u32) -> bool {
    PathBuf::from("/run/netns")
        .join(netns_name(fabric, slot))
        .exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnet_gives_node_n_the_address_dot_n_and_rejects_small_subnets() {
        let p = NetPlan::new("192.168.20.0/24", 65500, 4).unwrap();
        assert_eq!(p.cidr(1), "192.168.20.1/24");
        assert_eq!(p.cidr(4), "192.168.20.4/24");
        assert!(p.hosts_file(2).contains("192.168.20.2\tnode2\n"));
        let e = NetPlan::new("10.9.0.0/30", 1500, 4).unwrap_err();
        assert!(e.to_string().contains("room for 2 nodes, not 4"), "{e}");
        assert!(NetPlan::new("10.9.0.0/32", 1500, 1).is_err());
        assert!(NetPlan::new("banana", 1500, 1).is_err());
        assert!(NetPlan::new("10.0.0.0/33", 1500, 1).is_err());
        assert_eq!(
            NetPlan::new("10.0.0.0/8", 70000, 1),
            Err(NetConfigError::BadMtu(70000))
        );
        assert_eq!(
            NetPlan::new("10.0.0.0/8", 67, 1),
            Err(NetConfigError::BadMtu(67))
        );
    }

    #[test]
    fn proc_net_dev_counters_are_parsed_for_the_interface() {
        let text = "Inter-|   Receive                                                |  Transmit\n \
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n\
    lo:       0       0    0    0    0     0          0         0        0       0    0    0    0     0       0          0\n\
   bp0: 4796682   61484    0    2    0     0          0         0 9997919222  164805    0    5    0     0       0          0\n";
        assert_eq!(
            parse_net_dev(text, "bp0"),
            Some([61484, 4796682, 164805, 9997919222, 2, 5])
        );
        assert_eq!(parse_net_dev(text, "eth0"), None);
    }

    #[test]
    fn macs_are_derived_from_the_slot_and_map_back() {
        let m = Mac::of_slot(258);
        assert_eq!(m.to_string(), "02:62:70:00:01:02");
        assert_eq!(m.slot(), Some(258));
        assert!(!m.is_group());
        assert_eq!(Mac([0x02, 0, 0, 0, 0, 1]).slot(), None);
    }

    #[test]
    fn frames_are_switched_by_destination_mac() {
        let frame = |dst: [u8; 6]| {
            let mut f = vec![0u8; VNET_HDR_LEN + 60];
            f[VNET_HDR_LEN..VNET_HDR_LEN + 6].copy_from_slice(&dst);
            f
        };
        assert_eq!(classify(&frame(Mac::of_slot(3).0), 4, 1), Dest::Node(3));
        assert_eq!(classify(&frame([0xff; 6]), 4, 1), Dest::All);
        assert_eq!(classify(&frame([0x33, 0x33, 0, 0, 0, 1]), 4, 1), Dest::All);
        assert_eq!(
            classify(&frame(Mac::of_slot(9).0), 4, 1),
            Dest::Drop,
            "no such node"
        );
        assert_eq!(
            classify(&frame(Mac::of_slot(1).0), 4, 1),
            Dest::Drop,
            "to itself"
        );
        assert_eq!(classify(&frame([0x00, 1, 2, 3, 4, 5]), 4, 1), Dest::Drop);
        assert_eq!(classify(&[0u8; 20], 4, 1), Dest::Drop, "too short");
    }
}
