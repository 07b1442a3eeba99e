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

// The addressing plan and the node namespaces are the control plane's (the supervisor makes
// them); they live in `fabric::netns` and are re-exported here, beside the data path.
pub use crate::fabric::netns::*;

use std::os::fd::{AsRawFd, OwnedFd};

/// Port every node agent's frame endpoint is bound to. Ports at and above
/// [`RESERVED_PORTS`] are the fabric's own.
pub const NET_PORT: u32 = 0xFFFF_0001;
/// First port reserved for the fabric's own services.
pub const RESERVED_PORTS: u32 = 0xFFFF_0000;
/// Size of the virtio-net header the TAP prepends (`virtio_net_hdr_v1`, with num_buffers).
pub const VNET_HDR_LEN: usize = 12;
/// Largest frame on the fabric: header + Ethernet header + a 64 KiB GSO IP packet.
pub const MAX_FRAME: usize = VNET_HDR_LEN + 14 + 65535;
const _: () = assert!(MAX_FRAME <= crate::wire::MAX_DGRAM);

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

    /// Reads one frame into `bufs` if one waits, without waiting for one (`Ok(None)`: none
    /// does) — for a reader that must not block where it reads: inside a send's fill, which
    /// on a fabric across hosts runs under the lock of the sender's UCX worker that its waker
    /// needs to move what UCX holds (see `agent::tx_loop`).
    pub fn try_read_vectored(
        &self,
        bufs: &mut [std::io::IoSliceMut<'_>],
    ) -> std::io::Result<Option<usize>> {
        use rustix::io::{Errno, ReadWriteFlags};
        loop {
            // (`u64::MAX`: at the file's position, as `readv`.)
            match rustix::io::preadv2(&self.fd, bufs, u64::MAX, ReadWriteFlags::NOWAIT) {
                Ok(n) => return Ok(Some(n)),
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => return Ok(None),
                // A kernel whose tun does not take RWF_NOWAIT: a frame waits if the device is
                // readable (this thread is its only reader).
                Err(Errno::OPNOTSUPP | Errno::INVAL) => {
                    let mut fds = [rustix::event::PollFd::new(
                        &self.fd,
                        rustix::event::PollFlags::IN,
                    )];
                    let zero = rustix::time::Timespec {
                        tv_sec: 0,
                        tv_nsec: 0,
                    };
                    return match rustix::event::poll(&mut fds, Some(&zero)) {
                        Ok(0) => Ok(None),
                        Ok(_) => self.read_vectored(bufs).map(Some),
                        Err(Errno::INTR) => Ok(None),
                        Err(e) => Err(e.into()),
                    };
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Waits until a frame can be read (or the device is gone: the read then says so).
    pub fn wait_readable(&self) {
        let mut fds = [rustix::event::PollFd::new(
            &self.fd,
            rustix::event::PollFlags::IN,
        )];
        while let Err(rustix::io::Errno::INTR) = rustix::event::poll(&mut fds, None) {}
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

/// Moves the calling thread into the network namespace mounted at `/run/netns/NAME` (the
/// process's other threads stay where they are; see [`in_netns`]).
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

/// Runs `f` on the calling thread inside the network namespace mounted at `/run/netns/NAME`,
/// then returns the thread to the namespace it was in (setns is per thread: the process's
/// other threads never leave theirs, and threads `f` starts stay in `NAME`).
pub fn in_netns<T>(name: &str, f: impl FnOnce() -> T) -> std::io::Result<T> {
    use rustix::fs::{open, Mode, OFlags};
    let here = open(
        "/proc/thread-self/ns/net",
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    enter_netns(name)?;
    let out = f();
    rustix::thread::move_into_link_name_space(
        std::os::fd::AsFd::as_fd(&here),
        Some(rustix::thread::LinkNameSpaceType::Network),
    )?;
    Ok(out)
}

/// Runs an `ip` command in the current namespace (the agent configuring its interface).
pub fn ip_here(args: &[&str]) -> std::io::Result<()> {
    crate::fabric::netns::ip(args)
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
