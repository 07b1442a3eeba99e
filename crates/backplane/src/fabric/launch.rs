//! Starting and stopping fabrics from a program (what `backplane up` / `down` do): a detached
//! supervisor process is started from an executable that runs [`crate::daemon`] (`backplane`
//! or `backplane-fabricd`) and waited for. It gets its
//! [`Options`] typed, as JSON on a pipe (fd 4), and answers on another (fd 3): "ready" or
//! "error: …". Its command line carries only the fabric's name, for `ps` and for finding it.

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::supervisor::{self, Config, StartError};
use super::{fabric_dir, validate_name, Fabric, FabricError};

/// What a node agent runs with: written by the supervisor as one JSON line on the agent's
/// standard input (its command line only names fabric and slot, for `ps`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgentConfig {
    /// Fabric name.
    pub fabric: String,
    /// The node's slot.
    pub slot: u32,
    /// IP over the fabric: the subnet and the MTU of `bp0` (None: no networking).
    pub net: Option<(String, u32)>,
}

/// What a fabric is started with.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Options {
    /// Fabric name.
    pub name: String,
    /// Node count.
    pub nodes: u32,
    /// Window size per node.
    pub window_size: u64,
    /// Restart a dead node agent after this long (0: leave it DOWN).
    pub restart_delay_ms: u64,
    /// The executable whose `supervisor` and `agent` commands run [`crate::daemon`]:
    /// `backplane`, or this crate's `backplane-fabricd`.
    pub exe: PathBuf,
    /// IP over the fabric (`None`: `--no-net`).
    pub net: Option<crate::fabric::netns::NetPlan>,
    /// Link emulation: model name and forwarding mode (`None`: memory speed).
    pub link: Option<(String, crate::model::Forwarding)>,
    /// A topology file (its node count and links replace `nodes` and `link`).
    pub topology: Option<PathBuf>,
    /// A fabric across hosts (the file's slots replace `nodes`).
    pub hosts: Option<HostsOptions>,
}

/// How this host takes part in a fabric across hosts.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct HostsOptions {
    /// The hosts file.
    pub file: PathBuf,
    /// This host's name in it.
    pub host: String,
    /// How long `up` waits to join the hosts listed before this one.
    pub join_timeout_ms: u64,
}

/// Reads and checks a hosts file for host `me`.
pub fn load_hosts(path: &std::path::Path, me: &str) -> Result<super::hosts::HostPlan, StartError> {
    let text = std::fs::read_to_string(path).map_err(|e| StartError::Os {
        what: format!("cannot read hosts file {}", path.display()),
        source: e,
    })?;
    super::hosts::HostPlan::parse(&path.display().to_string(), &text, me)
        .map_err(|e| StartError::Hosts(e.to_string()))
}

/// Reads and checks a topology file.
pub fn load_topology(path: &std::path::Path) -> Result<super::topology::Topology, StartError> {
    let text = std::fs::read_to_string(path).map_err(|e| StartError::Os {
        what: format!("cannot read topology file {}", path.display()),
        source: e,
    })?;
    super::topology::Topology::parse(&path.display().to_string(), &text)
        .map_err(|e| StartError::Boot(e.to_string()))
}

/// Resolves a link model name and forwarding mode into what the fabric header stores.
pub fn resolve_link(
    name: &str,
    mode: crate::model::Forwarding,
) -> Result<crate::wire::LinkRepr, crate::model::LinkModelError> {
    let m: crate::model::LinkModel = name.parse()?;
    Ok(crate::wire::LinkRepr {
        name: name.to_ascii_lowercase(),
        bytes_per_s: m.effective_bandwidth_bytes_per_s() as u64,
        hop_ns: m.per_hop_latency(mode).ns.round() as u64,
        store_and_forward: mode == crate::model::Forwarding::StoreAndForward,
    })
}

impl Options {
    /// A fabric of `nodes` nodes whose processes run from `exe`, with `backplane up`'s
    /// defaults but no networking: 64 MiB windows, a dead agent restarted after a second,
    /// memory-speed links.
    pub fn new(name: &str, nodes: u32, exe: PathBuf) -> Self {
        Self {
            name: name.to_owned(),
            nodes,
            window_size: 64 << 20,
            restart_delay_ms: 1000,
            exe,
            net: None,
            link: None,
            topology: None,
            hosts: None,
        }
    }

    /// The supervisor configuration these options describe (reads the topology file).
    pub fn config(&self) -> Result<Config, StartError> {
        let topology = self.topology.as_deref().map(load_topology).transpose()?;
        let mut c = Config {
            name: self.name.clone(),
            nodes: self.nodes,
            window_size: self.window_size,
            restart_delay: (self.restart_delay_ms > 0)
                .then(|| Duration::from_millis(self.restart_delay_ms)),
            agent_cmd: vec![self.exe.to_string_lossy().into_owned(), "agent".into()],
            net: self.net,
            link: self
                .link
                .as_ref()
                .and_then(|(n, m)| resolve_link(n, *m).ok()),
            topology: None,
            hosts: None,
        };
        if let Some(h) = &self.hosts {
            let mut plan = load_hosts(&h.file, &h.host)?;
            plan.join_timeout_ms = h.join_timeout_ms;
            c.nodes = plan.nodes();
            c.hosts = Some(plan);
        }
        if let Some(t) = topology {
            if c.hosts.is_some() && t.nodes != c.nodes {
                return Err(StartError::Hosts(format!(
                    "the topology file has {} nodes but the hosts file {}: a topology across hosts names every slot of every host",
                    t.nodes, c.nodes
                )));
            }
            c.nodes = t.nodes;
            if t.kind == super::topology::Kind::Star {
                c.link = Some(t.link.clone());
            } else {
                c.link = None;
                c.topology = Some(t);
            }
        }
        Ok(c)
    }
}

/// Starts a fabric and returns once every node is READY.
pub fn start(o: &Options) -> Result<(), StartError> {
    let os = |what: &str| {
        let what = what.to_owned();
        move |e: std::io::Error| StartError::Os { what, source: e }
    };
    let cfg = o.config()?;
    supervisor::check_config(&cfg)?;
    if supervisor::is_running(&o.name) {
        return Err(StartError::AlreadyRunning(o.name.clone()));
    }
    // Close-on-exec, so the supervisor inherits none of these ends but the two dup2'ed to fds
    // 3 and 4 (dup2 clears the flag on the copy): a write end it kept would hold its own read
    // of the options open forever.
    let pipe = || {
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            .map_err(|e| os("cannot create a pipe")(e.into()))
    };
    let (rd, wr) = pipe()?;
    let (opts_rd, opts_wr) = pipe()?;
    let (wr_raw, opts_raw) = (wr.as_raw_fd(), opts_rd.as_raw_fd());
    let mut cmd = Command::new(&o.exe);
    cmd.args([
        "supervisor",
        "--name",
        &o.name,
        "--ready-fd",
        "3",
        "--options-fd",
        "4",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    // SAFETY: only async-signal-safe calls (setsid, dup, dup2, fcntl) run between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            // Move the options end out of the way first if it sits where the ready end goes.
            let opts = if opts_raw == 3 {
                libc::dup(opts_raw)
            } else {
                opts_raw
            };
            if opts < 0 || libc::dup2(wr_raw, 3) < 0 || libc::dup2(opts, 4) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // dup2 onto itself (an end that already was fd 3 or 4, which a process with
            // threads opening and closing descriptors gets now and then) keeps close-on-exec:
            // clear it, or the supervisor starts without its pipe and start-up fails.
            for fd in [3, 4] {
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(os("cannot start the fabric supervisor"))?;
    drop((wr, opts_rd));
    // The options, typed: the supervisor reads them to the end of the pipe. A supervisor that
    // died first shows as EPIPE here and as no "ready" below.
    let json = serde_json::to_vec(o).expect("options serialize");
    let _ = std::io::Write::write_all(&mut std::fs::File::from(opts_wr), &json);
    let mut line = String::new();
    let _ = BufReader::new(std::fs::File::from(rd)).read_line(&mut line);
    let outcome = match line.trim() {
        "ready" => Ok(()),
        l if l.starts_with("error: ") => Err(StartError::Boot(l[7..].to_owned())),
        _ => Err(StartError::Boot(
            "the fabric supervisor exited during start-up".into(),
        )),
    };
    if outcome.is_err() {
        // A refused start leaves nothing: the supervisor removes what it made after it said
        // why, then exits; wait for that (bounded) so the caller finds nothing left.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    // The supervisor keeps running detached; reap it here only if it already exited.
    std::thread::spawn(move || child.wait());
    outcome
}

/// How a fabric was stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// The supervisor shut down and cleaned up.
    Clean,
    /// Only leftovers of a dead supervisor were found and removed.
    Stale,
}

/// Stops fabric `name`, waiting until its supervisor has removed everything.
pub fn stop(name: &str) -> Result<Stopped, FabricError> {
    validate_name(name)?;
    let dir = fabric_dir(name);
    if !supervisor::is_running(name) {
        if dir.exists() {
            // Namespaces first: which are this host's is written in the directory.
            crate::fabric::netns::cleanup(name);
            std::fs::remove_dir_all(&dir)?;
            return Ok(Stopped::Stale);
        }
        return Err(FabricError::NotRunning(name.to_owned()));
    }
    let f = Fabric::attach(name)?;
    let pid = f.status()?.supervisor_pid;
    // Watch the supervisor itself: `down` returns only once the process is gone, not merely
    // once it has released its lock (it still exits after that).
    let pidfd = rustix::process::Pid::from_raw(pid as i32)
        .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok());
    f.shutdown()?;
    drop(f);
    let deadline = Instant::now() + Duration::from_secs(10);
    let exited = |fd: &Option<std::os::fd::OwnedFd>| {
        fd.as_ref().is_none_or(|fd| {
            use rustix::event::{poll, PollFd, PollFlags, Timespec};
            let mut fds = [PollFd::new(fd, PollFlags::IN)];
            let zero = Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            poll(&mut fds, Some(&zero)).is_ok_and(|n| n > 0)
        })
    };
    while supervisor::is_running(name) || dir.exists() || !exited(&pidfd) {
        if Instant::now() > deadline {
            if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            std::thread::sleep(Duration::from_millis(100));
            let _ = std::fs::remove_dir_all(&dir);
            return Err(FabricError::SupervisorGone(name.to_owned()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(Stopped::Clean)
}
