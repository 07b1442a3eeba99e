//! The control plane: where fabrics live on disk, attaching to one, the node table, node
//! handles (doorbells, scratchpads), and the supervisor that keeps a fabric.
//!
//! A fabric named F owns one private directory (see [`fabric_dir`]) holding its control socket
//! and lock file; its memory is memfds that exist only while some process holds them, so a
//! crash can leave at most that directory behind, which the next `up` or `down` removes.

pub mod accel;
pub mod alloc;
pub mod ctl;
pub mod hosts;
pub mod launch;
pub mod life;
pub mod members;
pub mod netns;
pub mod supervisor;
pub mod topology;

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::mem::{MemError, Region};
use crate::sync::{fence, futex_wait, AtomicU32, Ordering};
use crate::wire::{
    self, FabricHeader, FabricHeaderRepr, LayoutError, NodeEntry, NodeEntryRepr, NodeState,
    NODE_TABLE_OFF, SCRATCHPADS,
};
use ctl::{ErrorKind, Request, Response, StatusReport};

/// Control socket file name inside the fabric directory.
pub const SOCKET_FILE: &str = "ctl.sock";
/// Supervisor lock file name (held with `flock` for the supervisor's life).
pub const LOCK_FILE: &str = "supervisor.lock";
/// Supervisor log file name.
pub const LOG_FILE: &str = "supervisor.log";
/// Default fabric name.
pub const DEFAULT_NAME: &str = "default";

/// The fabric's own processes: its supervisor and its nodes' agents.
fn own_pids(s: &StatusReport) -> Vec<u32> {
    std::iter::once(s.supervisor_pid)
        .chain(s.slots.iter().map(|x| x.pid))
        .filter(|&p| p != 0)
        .collect()
}

/// Where fabric directories live: `$BACKPLANE_RUN_DIR`, else `/run/backplane` for root, else
/// `$XDG_RUNTIME_DIR/backplane`, else `/tmp/backplane-$UID`.
pub fn run_root() -> PathBuf {
    if let Some(d) = std::env::var_os("BACKPLANE_RUN_DIR") {
        return PathBuf::from(d);
    }
    let uid = rustix::process::geteuid();
    if uid.is_root() {
        return PathBuf::from("/run/backplane");
    }
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(x).join("backplane");
    }
    PathBuf::from(format!("/tmp/backplane-{}", uid.as_raw()))
}

/// The private directory of fabric `name`.
pub fn fabric_dir(name: &str) -> PathBuf {
    run_root().join(name)
}

/// Checks a fabric name: 1–32 characters from `[A-Za-z0-9_-]`, not starting with `-`.
pub fn validate_name(name: &str) -> Result<(), FabricError> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
    if ok {
        Ok(())
    } else {
        Err(FabricError::BadName(name.to_owned()))
    }
}

/// What went wrong talking to a fabric.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    /// Occurs when a fabric name has characters outside `[A-Za-z0-9_-]` or is too long.
    #[error("invalid fabric name '{0}': use 1-32 letters, digits, '-' or '_'")]
    BadName(String),
    /// Occurs when no supervisor answers for the named fabric.
    #[error("no fabric named '{0}' is running (start it with `backplane up --name {0}`)")]
    NotRunning(String),
    /// Occurs when a slot number is outside 1..=nodes.
    #[error("node {slot} does not exist: fabric '{fabric}' has nodes 1..={nodes}")]
    NoSuchNode {
        /// Fabric name.
        fabric: String,
        /// Requested slot.
        slot: u32,
        /// Node count.
        nodes: u32,
    },
    /// Occurs when a node is not READY.
    #[error("node {slot} is {state}, not READY")]
    NodeNotReady {
        /// Slot.
        slot: u32,
        /// Its state.
        state: NodeState,
    },
    /// Occurs when a node restarted since this handle joined it.
    #[error(
        "node {slot} restarted (generation {had} -> {now}); join it again with `node({slot})`"
    )]
    Restarted {
        /// Slot.
        slot: u32,
        /// Generation this handle joined.
        had: u32,
        /// Current generation.
        now: u32,
    },
    /// Occurs when the supervisor is gone (the fabric was stopped or crashed).
    #[error("the supervisor of fabric '{0}' is gone (was it stopped with `backplane down`?)")]
    SupervisorGone(String),
    /// Occurs when the supervisor refuses a request.
    #[error("{message}")]
    Refused {
        /// Error class.
        kind: ErrorKind,
        /// The supervisor's explanation.
        message: String,
    },
    /// Occurs when the supervisor answers something unexpected.
    #[error("unexpected reply from the fabric supervisor: {0}")]
    Protocol(String),
    /// Occurs when the control socket fails (the supervisor died or was stopped).
    #[error("lost contact with the fabric supervisor: {0}")]
    Io(#[from] std::io::Error),
    /// Occurs when shared memory cannot be mapped.
    #[error(transparent)]
    Mem(#[from] MemError),
    /// Occurs when a shared layout fails validation.
    #[error("shared memory of the fabric is corrupted: {0}")]
    Layout(#[from] LayoutError),
}

/// A process's connection to a running fabric. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Fabric {
    pub(crate) inner: Arc<FabricInner>,
}

#[derive(Debug)]
pub(crate) struct FabricInner {
    pub(crate) name: String,
    pub(crate) nodes: u32,
    pub(crate) window_size: u64,
    pub(crate) link: Option<wire::LinkRepr>,
    pub(crate) spans_hosts: bool,
    /// Where an endpoint may listen for datagrams straight from other hosts (`Welcome`).
    pub(crate) direct_ip: Option<std::net::IpAddr>,
    sock: Mutex<OwnedFd>,
    control: Region,
    windows: Mutex<HashMap<u32, Arc<Region>>>,
}

impl Fabric {
    /// Attaches to the running fabric `name`.
    pub fn attach(name: &str) -> Result<Self, FabricError> {
        Self::connect(name, None)
    }

    /// Attaches as the agent of `slot` (used by the supervisor's node agents).
    pub fn attach_agent(name: &str, slot: u32) -> Result<Self, FabricError> {
        Self::connect(name, Some(slot))
    }

    fn connect(name: &str, agent_slot: Option<u32>) -> Result<Self, FabricError> {
        use rustix::net::{
            connect, socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType,
        };
        validate_name(name)?;
        let path = fabric_dir(name).join(SOCKET_FILE);
        let not_running = || FabricError::NotRunning(name.to_owned());
        let addr = SocketAddrUnix::new(&path).map_err(|_| not_running())?;
        let sock = socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(std::io::Error::from)?;
        connect(&sock, &addr).map_err(|_| not_running())?;
        let hello = Request::Hello {
            version: ctl::PROTOCOL_VERSION,
            pid: std::process::id(),
            agent_slot,
        };
        let (resp, fds) = ctl::call(&sock, &hello, &[]).map_err(|_| not_running())?;
        let (nodes, window_size, direct_ip) = match resp {
            Response::Welcome {
                nodes,
                window_size,
                direct_ip,
                ..
            } => (nodes, window_size, direct_ip),
            Response::Error { kind, message } => {
                return Err(FabricError::Refused { kind, message })
            }
            other => return Err(FabricError::Protocol(format!("{other:?}"))),
        };
        let fd = fds
            .into_iter()
            .next()
            .ok_or_else(|| FabricError::Protocol("welcome without control region".into()))?;
        let control = Region::map(fd, false)?;
        let mut hdr = vec![0u8; NODE_TABLE_OFF];
        control.read(0, &mut hdr)?;
        let repr = FabricHeaderRepr::parse(&FabricHeader::new_checked(&hdr[..])?)?;
        if repr.nodes != nodes
            || repr.window_size != window_size
            || control.len() < wire::control_region_size(nodes)
        {
            return Err(FabricError::Protocol(
                "control region disagrees with welcome".into(),
            ));
        }
        Ok(Self {
            inner: Arc::new(FabricInner {
                name: name.to_owned(),
                nodes,
                window_size,
                link: repr.link.clone(),
                spans_hosts: repr.spans_hosts,
                direct_ip,
                sock: Mutex::new(sock),
                control,
                windows: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// Fabric name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Number of slots.
    pub fn nodes(&self) -> u32 {
        self.inner.nodes
    }

    /// Window size per node.
    pub fn window_size(&self) -> u64 {
        self.inner.window_size
    }

    /// The emulated link of every node (`None`: the fabric runs at memory speed).
    pub fn link(&self) -> Option<&wire::LinkRepr> {
        self.inner.link.as_ref()
    }

    /// True if the fabric spans hosts: this host's supervisor runs a bridge thread that
    /// carries datagrams and queue pairs between hosts, and needs a CPU as they move.
    pub fn spans_hosts(&self) -> bool {
        self.inner.spans_hosts
    }

    /// How often the library's own spinning waits give the CPU away (`sync::relax`): every
    /// [`crate::sync::YIELD_POLLS`] polls on a fabric across hosts, for the bridge thread;
    /// never (0) on one host.
    pub(crate) fn yield_every(&self) -> u32 {
        if self.inner.spans_hosts {
            crate::sync::YIELD_POLLS
        } else {
            0
        }
    }

    pub(crate) fn check_slot(&self, slot: u32) -> Result<(), FabricError> {
        if slot == 0 || slot > self.inner.nodes {
            return Err(FabricError::NoSuchNode {
                fabric: self.inner.name.clone(),
                slot,
                nodes: self.inner.nodes,
            });
        }
        Ok(())
    }

    /// Reads slot `slot`'s node table entry (seqlock-consistent).
    pub fn node_info(&self, slot: u32) -> Result<NodeEntryRepr, FabricError> {
        self.check_slot(slot)?;
        let off = (NODE_TABLE_OFF + (slot as usize - 1) * NodeEntry::<&[u8]>::LEN) as u64;
        let seq = self.inner.control.u32_at(off + wire::NODE_SEQ_OFF as u64)?;
        let mut buf = [0u8; 64];
        for _ in 0..10_000 {
            // SYNC POINT node-seqlock (acquire): an even, unchanged seq brackets a whole entry.
            let s1 = seq.load(Ordering::Acquire);
            if s1 % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            self.inner.control.read(off, &mut buf)?;
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == s1 {
                let e = NodeEntryRepr::parse(&NodeEntry::new_checked(&buf[..])?)?;
                if e.slot != slot {
                    return Err(LayoutError::BadField {
                        field: "slot",
                        value: e.slot.into(),
                    }
                    .into());
                }
                return Ok(e);
            }
        }
        Err(FabricError::Protocol(
            "node table entry never stabilised".into(),
        ))
    }

    /// The fabric epoch: bumped (and futex-woken) on every node state change.
    pub fn epoch(&self) -> &AtomicU32 {
        self.inner
            .control
            .u32_at(wire::FABRIC_EPOCH_OFF as u64)
            .expect("control region size checked at attach")
    }

    /// Waits until the epoch moves away from `seen` or `timeout` passes.
    pub fn wait_epoch(&self, seen: u32, timeout: Duration) {
        futex_wait(self.epoch(), seen, Some(timeout));
    }

    /// Joins node `slot` as one of its processes. The node must be READY.
    pub fn node(&self, slot: u32) -> Result<Node, FabricError> {
        let info = self.node_info(slot)?;
        if info.state != NodeState::Ready {
            return Err(FabricError::NodeNotReady {
                slot,
                state: info.state,
            });
        }
        let window = self.window(slot)?;
        Ok(Node {
            fabric: self.clone(),
            slot,
            generation: info.generation,
            window,
        })
    }

    /// The fabric report (what `backplane status` shows).
    pub fn status(&self) -> Result<StatusReport, FabricError> {
        match self.call(&Request::Status)?.0 {
            Response::Status(mut s) => {
                // Counted here, by the asking process, not by the supervisor's event loop.
                for m in members::find(&s.fabric, s.nodes, &own_pids(&s)) {
                    if let Some(slot) = s.slots.iter_mut().find(|x| x.slot == m.slot) {
                        slot.procs += 1;
                    }
                }
                for slot in s.slots.iter_mut() {
                    slot.accel = accel::read_stats(&s.fabric, slot.slot);
                }
                Ok(s)
            }
            other => Err(FabricError::Protocol(format!("{other:?}"))),
        }
    }

    /// The programs running in this fabric's nodes (not its supervisor and agents).
    pub fn members(&self) -> Result<Vec<members::Member>, FabricError> {
        let s = self.status()?;
        Ok(members::find(&s.fabric, s.nodes, &own_pids(&s)))
    }

    /// Asks the supervisor to stop the fabric.
    pub fn shutdown(&self) -> Result<(), FabricError> {
        self.call(&Request::Shutdown).map(|_| ())
    }

    /// One request/response with the supervisor; supervisor errors become `Refused`.
    pub(crate) fn call(&self, req: &Request) -> Result<(Response, Vec<OwnedFd>), FabricError> {
        self.call_with_fds(req, &[])
    }

    /// One request/response carrying file descriptors with the request (memfds of memory
    /// regions); supervisor errors become `Refused`.
    pub(crate) fn call_with_fds(
        &self,
        req: &Request,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<(Response, Vec<OwnedFd>), FabricError> {
        let sock = self.inner.sock.lock().unwrap_or_else(|p| p.into_inner());
        let (resp, fds) = ctl::call(&sock.as_fd(), req, fds)?;
        if let Response::Error { kind, message } = resp {
            return Err(FabricError::Refused { kind, message });
        }
        Ok((resp, fds))
    }

    /// As [`Fabric::call`], made again while the window is full only of memory about to be
    /// reusable (see [`while_room_comes`]): for requests a caller may wait for.
    pub(crate) fn call_patiently(
        &self,
        req: &Request,
    ) -> Result<(Response, Vec<OwnedFd>), FabricError> {
        let until = std::time::Instant::now() + ROOM_PATIENCE;
        while_room_comes(until, || self.call(req))
    }

    /// One request to the service the supervisor hosts (the verbs registry), with `fds`
    /// passed along: `req` and the reply `R` are the service's messages, opaque to `fabric`
    /// (JSON inside `Request::Service`). Refusals become `Refused`; a reply that does not
    /// decode as `R` is a `Protocol` error.
    pub(crate) fn call_service<R: serde::de::DeserializeOwned>(
        &self,
        req: &impl serde::Serialize,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<(R, Vec<OwnedFd>), FabricError> {
        let body = serde_json::to_value(req)
            .map_err(|e| FabricError::Protocol(format!("cannot encode a service request: {e}")))?;
        let request = Request::Service(body);
        let until = std::time::Instant::now() + ROOM_PATIENCE;
        let (resp, fds) = while_room_comes(until, || self.call_with_fds(&request, fds))?;
        let Response::Service(body) = resp else {
            return Err(FabricError::Protocol(format!("{resp:?}")));
        };
        let r = serde_json::from_value(body)
            .map_err(|e| FabricError::Protocol(format!("malformed service reply: {e}")))?;
        Ok((r, fds))
    }

    /// The window of `slot`, mapped read-write (granted once per process, then cached).
    pub(crate) fn window(&self, slot: u32) -> Result<Arc<Region>, FabricError> {
        self.check_slot(slot)?;
        if let Some(w) = self
            .inner
            .windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&slot)
        {
            return Ok(w.clone());
        }
        let (resp, fds) = self.call(&Request::Grant { slot })?;
        if !matches!(resp, Response::Granted { .. }) {
            return Err(FabricError::Protocol(format!("{resp:?}")));
        }
        let fd = fds
            .into_iter()
            .next()
            .ok_or_else(|| FabricError::Protocol("grant without a window".into()))?;
        let region = Region::map(fd, true)?;
        if region.len() as u64 != self.inner.window_size {
            return Err(FabricError::Protocol(
                "granted window has the wrong size".into(),
            ));
        }
        let region = Arc::new(region);
        self.inner
            .windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(slot, region.clone());
        Ok(region)
    }

    /// Tells the supervisor this agent's network interface is configured.
    pub fn net_ready(&self, slot: u32) -> Result<(), FabricError> {
        self.call(&Request::NetReady { slot }).map(|_| ())
    }

    /// Tells the supervisor this agent's window is initialised.
    pub fn agent_ready(&self, slot: u32) -> Result<(), FabricError> {
        self.call(&Request::AgentReady { slot }).map(|_| ())
    }

    /// Raw read-write access to node `slot`'s window, as every peer that sends to it has: for
    /// agents, tools and tests. Everything in it is untrusted shared memory.
    pub fn raw_window(&self, slot: u32) -> Result<Arc<Region>, FabricError> {
        self.window(slot)
    }

    /// Ok while the supervisor is alive; checked by waiters whose sleep ran out, so that a
    /// fabric stopped under a blocked call ends it with an error instead of a hang.
    pub fn check_supervisor(&self) -> Result<(), FabricError> {
        if self.supervisor_gone(Duration::ZERO) {
            return Err(FabricError::SupervisorGone(self.inner.name.clone()));
        }
        Ok(())
    }

    /// The network namespace of this host's supervisor (an open `/proc/PID/ns/net`), if it is
    /// not this thread's: a process in a node's namespace (`bp0` and `lo`) reaches the other
    /// hosts of a fabric across hosts from there (see `dgram::Node::bind`).
    pub(crate) fn supervisor_netns(&self) -> Option<OwnedFd> {
        let pid = {
            let sock = self.inner.sock.lock().unwrap_or_else(|p| p.into_inner());
            rustix::net::sockopt::socket_peercred(&*sock).ok()?.pid
        };
        let theirs = std::fs::File::open(format!("/proc/{}/ns/net", pid.as_raw_nonzero())).ok()?;
        let mine = rustix::fs::stat("/proc/thread-self/ns/net").ok()?;
        let st = rustix::fs::fstat(&theirs).ok()?;
        (st.st_dev != mine.st_dev || st.st_ino != mine.st_ino).then(|| theirs.into())
    }

    /// True if the supervisor closed our control connection (it exited). Holds the control
    /// socket for up to `timeout`: other threads' control calls wait meanwhile, so keep it
    /// short (zero) in processes with several threads.
    pub fn supervisor_gone(&self, timeout: Duration) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let sock = self.inner.sock.lock().unwrap_or_else(|p| p.into_inner());
        let mut fds = [PollFd::new(&*sock, PollFlags::IN)];
        let ts = Timespec::try_from(timeout).unwrap_or(Timespec {
            tv_sec: 1,
            tv_nsec: 0,
        });
        match poll(&mut fds, Some(&ts)) {
            Ok(0) => false,
            Ok(_) => {
                let r = fds[0].revents();
                r.intersects(PollFlags::HUP | PollFlags::ERR)
                    || (r.contains(PollFlags::IN)
                        && rustix::net::recv(&*sock, &mut [0u8; 1], rustix::net::RecvFlags::PEEK)
                            .map(|(n, _)| n == 0)
                            .unwrap_or(true))
            }
            Err(_) => false,
        }
    }
}

/// A process's membership of one node: its window, doorbells and scratchpads, and the place
/// endpoints are bound.
#[derive(Clone, Debug)]
pub struct Node {
    pub(crate) fabric: Fabric,
    pub(crate) slot: u32,
    pub(crate) generation: u32,
    pub(crate) window: Arc<Region>,
}

impl Node {
    /// Slot number.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Generation this handle belongs to.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// The fabric.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// Ok if the node is still READY in the generation this handle joined.
    pub fn check_current(&self) -> Result<(), FabricError> {
        let info = self.fabric.node_info(self.slot)?;
        if info.state != NodeState::Ready {
            return Err(FabricError::NodeNotReady {
                slot: self.slot,
                state: info.state,
            });
        }
        if info.generation != self.generation {
            return Err(FabricError::Restarted {
                slot: self.slot,
                had: self.generation,
                now: info.generation,
            });
        }
        Ok(())
    }

    /// Rings doorbell bits on node `peer` (a write into the peer's doorbell register).
    pub fn ring_doorbell(&self, peer: u32, bits: u64) -> Result<(), FabricError> {
        let w = self.fabric.window(peer)?;
        w.u64_at(wire::WIN_DOORBELL_BITS_OFF as u64)?
            .fetch_or(bits, Ordering::AcqRel);
        // SYNC POINT doorbell-arm (ring side): bits set before we look at the armed flag.
        fence(Ordering::SeqCst);
        if w.u32_at(wire::WIN_DOORBELL_ARMED_OFF as u64)?
            .load(Ordering::Relaxed)
            != 0
        {
            crate::sync::ring(w.u32_at(wire::WIN_DOORBELL_SEQ_OFF as u64)?);
        }
        Ok(())
    }

    /// Takes (and clears) the doorbell bits rung on this node, waiting up to `timeout` for at
    /// least one. Returns 0 on timeout.
    pub fn wait_doorbell(&self, timeout: Option<Duration>) -> Result<u64, FabricError> {
        let w = &self.window;
        let bits = w.u64_at(wire::WIN_DOORBELL_BITS_OFF as u64)?;
        let seq = w.u32_at(wire::WIN_DOORBELL_SEQ_OFF as u64)?;
        let armed = w.u32_at(wire::WIN_DOORBELL_ARMED_OFF as u64)?;
        let deadline = crate::sync::Deadline::after(timeout);
        loop {
            let b = bits.swap(0, Ordering::AcqRel);
            if b != 0 {
                return Ok(b);
            }
            if deadline.expired() {
                return Ok(0);
            }
            let s = seq.load(Ordering::Acquire);
            armed.store(1, Ordering::Relaxed);
            // SYNC POINT doorbell-arm (wait side): armed before we re-check the bits.
            fence(Ordering::SeqCst);
            if bits.load(Ordering::Relaxed) == 0 {
                futex_wait(
                    seq,
                    s,
                    deadline.remaining().or(Some(Duration::from_millis(100))),
                );
            }
            armed.store(0, Ordering::Relaxed);
            self.check_current()?;
        }
    }

    /// Writes scratchpad register `idx` of node `peer`.
    pub fn write_scratchpad(&self, peer: u32, idx: usize, value: u32) -> Result<(), FabricError> {
        let w = self.fabric.window(peer)?;
        w.u32_at(scratch_off(idx)?)?.store(value, Ordering::Release);
        Ok(())
    }

    /// Reads this node's scratchpad register `idx`.
    pub fn read_scratchpad(&self, idx: usize) -> Result<u32, FabricError> {
        Ok(self
            .window
            .u32_at(scratch_off(idx)?)?
            .load(Ordering::Acquire))
    }
}

fn scratch_off(idx: usize) -> Result<u64, FabricError> {
    if idx >= SCRATCHPADS {
        return Err(FabricError::Refused {
            kind: ErrorKind::NotFound,
            message: format!("scratchpad {idx} does not exist (0..{SCRATCHPADS})"),
        });
    }
    Ok((wire::WIN_SCRATCH_OFF + idx * 4) as u64)
}

/// How long a request that may wait waits for memory a program just freed: the allocator's
/// quarantine and a margin.
pub(crate) const ROOM_PATIENCE: Duration =
    alloc::QUARANTINE.saturating_add(Duration::from_millis(200));

/// Runs `call` until it is not refused for a window full of memory freed less than the
/// allocator's quarantine ago, or `until` passes (then with that refusal). Such memory is
/// reusable within the quarantine and the supervisor refused the request whole (nothing of it
/// was made), so a program started right after another — perftest's, the pingpongs' 16 QPs,
/// `perf` run twice — does not fail for memory that is about to come back.
pub(crate) fn while_room_comes<T>(
    until: std::time::Instant,
    mut call: impl FnMut() -> Result<T, FabricError>,
) -> Result<T, FabricError> {
    const STEP: Duration = Duration::from_millis(20);
    loop {
        match call() {
            Err(FabricError::Refused {
                kind: ErrorKind::NoSpace,
                message,
            }) if message.contains(alloc::REUSABLE_SOON)
                && std::time::Instant::now() + STEP <= until =>
            {
                std::thread::sleep(STEP);
            }
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_waits_only_for_memory_about_to_come_back_and_only_until_its_deadline() {
        let refused = |message: &str| FabricError::Refused {
            kind: ErrorKind::NoSpace,
            message: message.into(),
        };
        let soon = format!(
            "node 2's window is full (8 KiB {} 1 s ago ...)",
            alloc::REUSABLE_SOON
        );
        let until = std::time::Instant::now() + Duration::from_secs(2);
        // Refused twice for memory in quarantine, then made.
        let mut calls = 0;
        let r = while_room_comes(until, || {
            calls += 1;
            if calls < 3 {
                Err(refused(&soon))
            } else {
                Ok(calls)
            }
        });
        assert_eq!(r.unwrap(), 3);
        // A window full for good, or another error: at once.
        let other = || FabricError::NotRunning("f".into());
        for e in [refused(&alloc::window_full(2)), other()] {
            let mut calls = 0;
            let r: Result<(), _> = while_room_comes(until, || {
                calls += 1;
                Err(match &e {
                    FabricError::Refused { message, .. } => refused(message),
                    _ => other(),
                })
            });
            assert!(r.is_err());
            assert_eq!(calls, 1, "{e}");
        }
        // A deadline that has passed: the refusal itself.
        let mut calls = 0;
        let r: Result<(), _> = while_room_comes(std::time::Instant::now(), || {
            calls += 1;
            Err(refused(&soon))
        });
        assert!(matches!(r, Err(FabricError::Refused { .. })));
        assert_eq!(calls, 1);
    }

    #[test]
    fn fabric_names_are_checked() {
        assert!(validate_name("radar-1_x").is_ok());
        for bad in ["", "-x", "a/b", "a b", &"x".repeat(33), ".."] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn attaching_to_a_missing_fabric_says_how_to_start_it() {
        let e = Fabric::attach("no-such-fabric-xyz").unwrap_err();
        assert!(
            e.to_string()
                .contains("backplane up --name no-such-fabric-xyz"),
            "{e}"
        );
    }
}
