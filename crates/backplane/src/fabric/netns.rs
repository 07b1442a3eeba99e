//! The node environment of IP over the fabric, which the control plane makes and removes: the
//! addressing plan (subnet, MTU, MACs derived from the slot, host names), each node's network
//! namespace and its `/etc/netns` files. The data path that uses them (the TAP and the node
//! agent) is [`crate::net`], which re-exports this module.

#![forbid(unsafe_code)]

use std::fmt;
use std::net::Ipv4Addr;
use std::path::PathBuf;

/// Interface name inside every node.
pub const IFNAME: &str = "bp0";

/// Default MTU, as VXFabric's `vxeth0`.
pub const DEFAULT_MTU: u32 = 65500;

/// Default subnet.
pub const DEFAULT_SUBNET: &str = "192.168.20.0/24";

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

/// Name of node `slot`'s network namespace in fabric `fabric`.
pub fn netns_name(fabric: &str, slot: u32) -> String {
    format!("bp-{fabric}-{slot}")
}

/// Where `ip netns` keeps per-namespace files (its `exec` bind-mounts them over `/etc`).
pub fn netns_etc(fabric: &str, slot: u32) -> PathBuf {
    PathBuf::from("/etc/netns").join(netns_name(fabric, slot))
}

pub(crate) fn ip(args: &[&str]) -> std::io::Result<()> {
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

/// Where libibverbs programs look for the character device of fabric `fabric`'s verbs device
/// (`ibv_device.dev_name` under `/dev/infiniband`, as the kernel's `uverbsN`).
pub fn verbs_device_node(fabric: &str) -> PathBuf {
    PathBuf::from("/dev/infiniband").join(format!("uverbs_bp_{fabric}"))
}

/// Makes the fabric's verbs device node (the drop-in `libibverbs.so.1` names the device
/// `uverbs_bp_FABRIC`). Nothing opens it — the library reaches the fabric through its
/// supervisor — but UCX offers an InfiniBand device only if `/dev/infiniband/<dev_name>` is a
/// character device it may read and write. It is `/dev/null`'s (1:3, mode 0666): opening it
/// does nothing. Best effort (it needs root, as the namespaces do); [`cleanup`] removes it.
pub fn create_verbs_device_node(fabric: &str) -> std::io::Result<()> {
    use rustix::fs::{mknodat, FileType, Mode, CWD};
    let node = verbs_device_node(fabric);
    let dir = node.parent().expect("a path with a directory");
    std::fs::create_dir_all(dir)?;
    let made = mknodat(
        CWD,
        &node,
        FileType::CharacterDevice,
        Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    );
    match made {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(e.into()),
    }
    // (mknod applies the umask.)
    std::fs::set_permissions(&node, std::os::unix::fs::PermissionsExt::from_mode(0o666))
}

/// Removes every namespace and `/etc/netns` directory of fabric `fabric` (also those a
/// crashed supervisor left behind), and its verbs device node (with `/dev/infiniband` if
/// that is left empty). Best effort; safe to call when there are none.
pub fn cleanup(fabric: &str) {
    let node = verbs_device_node(fabric);
    if std::fs::symlink_metadata(&node)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_char_device(&m.file_type()))
    {
        let _ = std::fs::remove_file(&node);
        // Fails (and is left) unless empty: another fabric's node, or a real device.
        let _ = std::fs::remove_dir(node.parent().expect("a path with a directory"));
    }
    let prefix = format!("bp-{fabric}-");
    let own = own_slots(fabric);
    let ours = |name: &str| {
        name.strip_prefix(&prefix).is_some_and(|rest| {
            !rest.is_empty()
                && rest.bytes().all(|c| c.is_ascii_digit())
                && own
                    .as_ref()
                    .is_none_or(|s| rest.parse::<u32>().is_ok_and(|n| s.contains(&n)))
        })
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

/// The file in a fabric's run directory that lists the slots this host runs (a fabric across
/// hosts: the other hosts' nodes' namespaces are theirs, even on one machine).
pub const SLOTS_FILE: &str = "slots";

/// The slots whose namespaces are this host's, if the fabric spans hosts (None: all).
fn own_slots(fabric: &str) -> Option<Vec<u32>> {
    let text = std::fs::read_to_string(super::fabric_dir(fabric).join(SLOTS_FILE)).ok()?;
    Some(
        text.split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect(),
    )
}

/// True if fabric `fabric` has IP over the fabric (its namespaces exist).
pub fn has_netns(fabric: &str, slot: u32) -> bool {
    PathBuf::from("/run/netns")
        .join(netns_name(fabric, slot))
        .exists()
}
