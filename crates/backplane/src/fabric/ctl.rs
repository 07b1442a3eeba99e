//! The control protocol between processes and the supervisor: JSON messages over a Unix
//! `SOCK_SEQPACKET` socket (one message per packet), with window file descriptors passed as
//! `SCM_RIGHTS`. Control traffic only: the data path never touches the socket.
//!
//! Every connection starts with `Hello` carrying [`PROTOCOL_VERSION`]; a mismatch is refused.
//! The connection lives as long as the client process: when it closes (exit, crash, SIGKILL),
//! the supervisor releases everything the client held.
#![forbid(unsafe_code)]

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};

use crate::wire::{DownReason, NodeState};

/// Version of the control protocol.
pub const PROTOCOL_VERSION: u32 = 2;
/// Largest control message.
pub const MAX_MSG: usize = 256 * 1024;

/// A request from a process to the supervisor.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// First message on every connection. Reply: `Welcome` + control region fd.
    Hello {
        /// [`PROTOCOL_VERSION`].
        version: u32,
        /// Caller's pid.
        pid: u32,
        /// Set by a node agent taking its slot.
        agent_slot: Option<u32>,
    },
    /// The agent finished initialising its window.
    AgentReady {
        /// Slot.
        slot: u32,
    },
    /// Map a node's window. Reply: `Granted` + window fd.
    Grant {
        /// Slot.
        slot: u32,
    },
    /// Bind an endpoint; port 0 picks a free one. Reply: `Bound`.
    Bind {
        /// Slot.
        slot: u32,
        /// Port (0: any).
        port: u32,
        /// A fabric across hosts: the endpoint takes datagrams from other hosts straight from
        /// their senders' processes, at this TCP port of its UCX listener (on the address
        /// `Welcome` gave). The supervisor tells senders on other hosts when they connect.
        #[serde(default)]
        direct: Option<u16>,
    },
    /// Close an endpoint.
    Unbind {
        /// Slot.
        slot: u32,
        /// Port.
        port: u32,
    },
    /// Make a ring from (src_slot, src_port) to (dst_slot, dst_port). Reply: `Connected`.
    Connect {
        /// Sender slot.
        src_slot: u32,
        /// Sender port.
        src_port: u32,
        /// Receiver slot.
        dst_slot: u32,
        /// Receiver port.
        dst_port: u32,
    },
    /// A receiver is done with a ring (drained after its sender left, or corrupted): tear it
    /// down and reclaim its memory.
    RetireRing {
        /// Receiver slot.
        slot: u32,
        /// Ring offset in the receiver's window.
        ring_off: u64,
    },
    /// The agent's network interface is configured.
    NetReady {
        /// Slot.
        slot: u32,
    },
    /// Fabric report. Reply: `Status`.
    Status,
    /// Stop the fabric. Reply: `Ok`, then the supervisor exits.
    Shutdown,
    /// A request for the service the supervisor hosts (the verbs registry), opaque here: a
    /// JSON object the service decodes. Reply: `Service`.
    Service(serde_json::Value),
}

/// One link of a route through a distributed topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteHop {
    /// The node the link leaves (its window holds the link's clock).
    pub from: u32,
    /// The node the link reaches (an intermediate forwards; the last one receives).
    pub to: u32,
    /// Effective bandwidth of the link, bytes/s.
    pub bytes_per_s: u64,
    /// Latency of forwarding onto the next link, ns.
    pub hop_ns: u64,
}

/// Error classes the supervisor reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// A slot, port or offset outside what exists.
    NotFound,
    /// A port already bound.
    InUse,
    /// A node not READY.
    NodeDown,
    /// No room left in a window.
    NoSpace,
    /// A malformed or unexpected request.
    Invalid,
    /// A distributed topology has no path between the nodes through READY nodes.
    NoRoute,
}

/// The supervisor's reply.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Response {
    /// Request done.
    Ok,
    /// Reply to `Hello`.
    Welcome {
        /// Fabric name.
        name: String,
        /// Node count.
        nodes: u32,
        /// Window size.
        window_size: u64,
        /// A fabric across hosts: this host's address, where an endpoint may listen for
        /// datagrams straight from other hosts (`Bind.direct`); none where datagrams between
        /// hosts go only through the bridges.
        #[serde(default)]
        direct_ip: Option<std::net::IpAddr>,
    },
    /// Reply to `Grant`.
    Granted {
        /// Slot.
        slot: u32,
        /// Generation of the window's node.
        generation: u32,
    },
    /// Reply to `Bind`.
    Bound {
        /// Port bound.
        port: u32,
        /// Offset of the endpoint record in the node's window.
        record_off: u64,
        /// Node generation.
        generation: u32,
    },
    /// Reply to `Connect`.
    Connected {
        /// Distributed topologies: the links the datagrams cross, in order (empty otherwise).
        #[serde(default)]
        route: Vec<RouteHop>,
        /// Ring offset in the receiver's window.
        ring_off: u64,
        /// Credit line offset in the sender's window.
        credit_off: u64,
        /// Receiver's endpoint record offset in its window.
        dst_record_off: u64,
        /// Receiver node generation.
        dst_generation: u32,
        /// A receiver on another host that takes datagrams straight from senders: its
        /// listener. The ring stays the route's token (its flags say when the route ends).
        #[serde(default)]
        direct: Option<std::net::SocketAddr>,
        /// The ring's data size: the fabric's ([`crate::wire::ring_data_for_window`]) or, on
        /// a route whose datagrams go directly, [`crate::wire::MIN_RING_DATA`].
        #[serde(default)]
        ring_data: Option<u32>,
    },
    /// Reply to `Status`.
    Status(StatusReport),
    /// Reply to `Service`, opaque here (a JSON object the client decodes).
    Service(serde_json::Value),
    /// The request failed.
    Error {
        /// Class.
        kind: ErrorKind,
        /// One-line explanation.
        message: String,
    },
}

/// Version of the `status --json` document.
pub const STATUS_VERSION: u32 = 1;

/// `backplane status --json`, version [`STATUS_VERSION`]. Documented in the README.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StatusReport {
    /// Document version.
    pub version: u32,
    /// Fabric name.
    pub fabric: String,
    /// Node count.
    pub nodes: u32,
    /// Window size per node, bytes.
    pub window_size: u64,
    /// Supervisor pid.
    pub supervisor_pid: u32,
    /// Seconds since `up`.
    pub uptime_s: f64,
    /// Link emulation in force (absent: memory speed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<LinkStatus>,
    /// The topology (absent: star at memory speed, or `--link` alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<TopologyStatus>,
    /// One row per slot, slot order.
    pub slots: Vec<SlotStatus>,
    /// A fabric across hosts: every host, this one first (empty on a one-host fabric).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<HostStatus>,
}

/// One host of a fabric across hosts, as this host's supervisor sees it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostStatus {
    /// Its name.
    pub name: String,
    /// Where its supervisor listens.
    pub address: String,
    /// The slots it runs.
    pub slots: Vec<u32>,
    /// `this host`, `joined`, `dialing`, `waiting` (for it to dial us), `lost`, `refused`,
    /// `left` (it shut down).
    pub state: String,
    /// The transports UCX chose to reach it (`tl/device`, e.g. `tcp/eth0`), once joined.
    #[serde(default)]
    pub transport: Vec<String>,
    /// Milliseconds since it was last heard from (joined hosts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heard_ms_ago: Option<u64>,
    /// The last failure or refusal, in one line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A fabric's topology in `status`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TopologyStatus {
    /// `star` or `distributed`.
    pub kind: String,
    /// Declared links as `A-B MODEL` (distributed only).
    pub links: Vec<String>,
}

/// The emulated link of every node (`up --link`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LinkStatus {
    /// Model name, e.g. `pcie-gen3x4`.
    pub model: String,
    /// Effective payload bandwidth per direction, bytes/s.
    pub bytes_per_s: u64,
    /// Per-hop latency of the switch, ns.
    pub hop_ns: u64,
    /// `cut-through` or `store-and-forward`.
    pub forwarding: String,
}

/// One slot in [`StatusReport`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SlotStatus {
    /// Slot (1-based).
    pub slot: u32,
    /// Life-cycle state.
    pub state: NodeState,
    /// Why the node is DOWN (`none` otherwise).
    pub down_reason: DownReason,
    /// Incarnation.
    pub generation: u32,
    /// Agent pid (0 when none).
    pub pid: u32,
    /// Fabric address of the window (each slot has a 4 GiB aperture).
    pub window_base: u64,
    /// Window size, bytes.
    pub window_size: u64,
    /// Fabric address of the doorbell register.
    pub doorbell: u64,
    /// Seconds in the current state.
    pub uptime_s: f64,
    /// Bound endpoints.
    pub endpoints: u32,
    /// Datagrams sent.
    pub tx_msgs: u64,
    /// Payload bytes sent.
    pub tx_bytes: u64,
    /// Datagrams received.
    pub rx_msgs: u64,
    /// Payload bytes received.
    pub rx_bytes: u64,
    /// Datagrams dropped (refused, corrupt, undeliverable).
    pub drops: u64,
    /// Programs running in the node besides its agent (counted by the process asking for the
    /// status: see `fabric::members`).
    #[serde(default)]
    pub procs: u32,
    /// Datagrams this node forwarded for others (distributed topologies).
    #[serde(default)]
    pub fwd_msgs: u64,
    /// Bytes this node forwarded for others.
    #[serde(default)]
    pub fwd_bytes: u64,
    /// IPv4 address/prefix of the node's `bp0` (absent with `--no-net`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// MAC of the node's `bp0` (absent with `--no-net`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// The interface's own counters, as `ip -s link` shows them inside the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<IfStats>,
    /// The host that runs the node (fabrics across hosts only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Accelerated sockets of the node's programs (`exec --accel`), read by the process
    /// asking for the status; absent until one ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accel: Option<super::accel::AccelStats>,
}

/// Counters of a node's network interface (published by its agent every 100 ms).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct IfStats {
    /// Interface name.
    pub name: String,
    /// True once the agent configured it (and while the node is not DOWN).
    pub up: bool,
    /// Packets received by the kernel from the fabric.
    pub rx_packets: u64,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Packets the kernel sent into the fabric.
    pub tx_packets: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Receive drops.
    pub rx_dropped: u64,
    /// Transmit drops.
    pub tx_dropped: u64,
}

/// Sends one message with optional fds.
pub fn send<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !anc.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(std::io::Error::other("too many fds in one control message"));
    }
    sendmsg(sock, &[IoSlice::new(&bytes)], &mut anc, SendFlags::NOSIGNAL)?;
    Ok(())
}

/// Receives one message and the fds attached to it. `Ok(None)` on orderly EOF.
pub fn recv<T: for<'de> Deserialize<'de>>(
    sock: BorrowedFd<'_>,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<(T, Vec<OwnedFd>)>> {
    buf.resize(MAX_MSG, 0);
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut anc = RecvAncillaryBuffer::new(&mut space);
    let n = loop {
        match recvmsg(
            sock,
            &mut [IoSliceMut::new(buf)],
            &mut anc,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(r) => break r.bytes,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds = Vec::new();
    for m in anc.drain() {
        if let RecvAncillaryMessage::ScmRights(r) = m {
            fds.extend(r);
        }
    }
    if n == 0 {
        return Ok(None);
    }
    let msg = serde_json::from_slice(&buf[..n])
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    Ok(Some((msg, fds)))
}

/// A blocking request/response round trip on a client socket, `fds` passed with the request.
/// The receive buffer (`MAX_MSG` bytes) is the thread's, made once: a fresh one per call
/// cost a 256 KiB memset per control request.
pub fn call(
    sock: &impl AsFd,
    req: &Request,
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<(Response, Vec<OwnedFd>)> {
    thread_local! {
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    send(sock.as_fd(), req, fds)?;
    BUF.with_borrow_mut(|buf| recv(sock.as_fd(), buf))?
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the fabric supervisor closed the connection",
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};

    #[test]
    fn control_messages_cross_a_socket_with_their_fds() {
        let (a, b) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let r = crate::mem::Region::create("bp-ctl-test", 4096).unwrap();
        r.write(0, b"hi").unwrap();
        send(a.as_fd(), &Request::Grant { slot: 3 }, &[r.fd()]).unwrap();
        let mut buf = Vec::new();
        let (req, fds): (Request, _) = recv(b.as_fd(), &mut buf).unwrap().unwrap();
        assert!(matches!(req, Request::Grant { slot: 3 }));
        assert_eq!(fds.len(), 1);
        let m = crate::mem::Region::map(fds.into_iter().next().unwrap(), false).unwrap();
        let mut got = [0u8; 2];
        m.read(0, &mut got).unwrap();
        assert_eq!(&got, b"hi");
    }

    #[test]
    fn service_requests_cross_the_socket_tagged_inside_the_request() {
        let body = serde_json::json!({"verb": "mr_grant", "slot": 1, "rkey": 43981});
        let s = serde_json::to_string(&Request::Service(body.clone())).unwrap();
        assert!(
            s.contains("\"op\":\"service\"") && s.contains("\"verb\":\"mr_grant\""),
            "{s}"
        );
        let Request::Service(back) = serde_json::from_str(&s).unwrap() else {
            panic!("not a service request: {s}");
        };
        assert_eq!(back, body);
        let resp = Response::Service(serde_json::json!({"verb": "mr_registered", "key": 5}));
        let s = serde_json::to_string(&resp).unwrap();
        let Response::Service(back) = serde_json::from_str(&s).unwrap() else {
            panic!("not a service reply: {s}");
        };
        assert_eq!(back["key"], 5);
    }

    #[test]
    fn garbage_on_the_control_socket_is_an_error_not_a_panic() {
        let (a, b) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::io::write(&a, b"{not json").unwrap();
        let mut buf = Vec::new();
        assert!(recv::<Request>(b.as_fd(), &mut buf).is_err());
        drop(a);
        assert!(recv::<Request>(b.as_fd(), &mut buf).unwrap().is_none());
    }
}
