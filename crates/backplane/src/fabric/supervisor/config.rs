//! What a supervisor is started with, and the checks made before anything is created.
#![forbid(unsafe_code)]

use super::*;

/// What a supervisor is asked to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Fabric name.
    pub name: String,
    /// Node count.
    pub nodes: u32,
    /// Window size per node.
    pub window_size: u64,
    /// Restart a dead agent after this long (None: leave it DOWN).
    pub restart_delay: Option<Duration>,
    /// Program and leading arguments that start a node agent; the fabric's name and the slot
    /// are appended (labels for `ps`), its [`crate::fabric::launch::AgentConfig`] is written
    /// to its standard input.
    pub agent_cmd: Vec<String>,
    /// IP over the fabric: `None` for `--no-net`.
    pub net: Option<NetPlan>,
    /// Link emulation: every node's link to the switch (`None`: memory speed).
    pub link: Option<LinkRepr>,
    /// A distributed topology (star topologies only set `link`).
    pub topology: Option<crate::fabric::topology::Topology>,
    /// A fabric across hosts: which host this is and which slots each host runs (`None`: one
    /// host runs every slot).
    pub hosts: Option<crate::fabric::hosts::HostPlan>,
}

impl Config {
    /// True if this supervisor runs `slot` (always, on a one-host fabric).
    pub fn is_local(&self, slot: u32) -> bool {
        self.hosts.as_ref().is_none_or(|h| h.is_local(slot))
    }

    /// The slots this supervisor runs.
    pub fn local_slots(&self) -> Vec<u32> {
        (1..=self.nodes).filter(|&s| self.is_local(s)).collect()
    }
}

/// Why a fabric could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Occurs when the fabric name is invalid.
    #[error(transparent)]
    Name(#[from] FabricError),
    /// Occurs when a supervisor already holds the fabric's lock.
    #[error("fabric '{0}' is already running (stop it with `backplane down --name {0}`)")]
    AlreadyRunning(String),
    /// Occurs when the node count is out of range.
    #[error("--nodes {0} is out of range: a fabric has 1 to {MAX_NODES} nodes")]
    BadNodeCount(u32),
    /// Occurs when the window size is out of range.
    #[error("--window-size {0} is out of range: use {min} to 64 GiB", min = MIN_WINDOW)]
    BadWindowSize(u64),
    /// Occurs when the windows need more shared memory than the machine has available.
    #[error("{nodes} windows of {each} MiB need {need} MiB of shared memory but only {avail} MiB is available; use a smaller --window-size or fewer --nodes")]
    NoMemory {
        /// Node count.
        nodes: u32,
        /// MiB per window.
        each: u64,
        /// MiB needed.
        need: u64,
        /// MiB available.
        avail: u64,
    },
    /// Occurs when an OS call fails while creating the fabric.
    #[error("{what}: {source}")]
    Os {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Occurs when a node does not come up.
    #[error("{0}")]
    Boot(String),
    /// Occurs when a fabric across hosts is asked for something it does not carry yet.
    #[error("{0}")]
    Hosts(String),
    /// Occurs when IP over the fabric is asked for without the privileges it needs.
    #[error("IP over the fabric needs root (network namespaces and TAP devices); run as root or add --no-net")]
    NeedRoot,
    /// Occurs when a network namespace cannot be set up.
    #[error("cannot set up the network of node {slot}: {message}")]
    Net {
        /// Slot.
        slot: u32,
        /// What failed.
        message: String,
    },
}

pub(super) fn os(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StartError {
    let what = what.into();
    move |source| StartError::Os { what, source }
}

pub(super) fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Checks the arguments of `up` before anything is created.
pub fn check_config(c: &Config) -> Result<(), StartError> {
    validate_name(&c.name)?;
    if c.nodes == 0 || c.nodes > MAX_NODES {
        return Err(StartError::BadNodeCount(c.nodes));
    }
    if c.window_size < MIN_WINDOW || c.window_size > 64 << 30 || !c.window_size.is_multiple_of(4096)
    {
        return Err(StartError::BadWindowSize(c.window_size));
    }
    if let Some(h) = &c.hosts {
        if h.nodes() != c.nodes {
            return Err(StartError::Hosts(format!(
                "--nodes {} disagrees with the hosts file, whose slots run 1..={}",
                c.nodes,
                h.nodes()
            )));
        }
    }
    if c.net.is_some() && !rustix::process::geteuid().is_root() {
        return Err(StartError::NeedRoot);
    }
    let need = c.local_slots().len() as u64 * c.window_size;
    if let Some(avail) = mem_available() {
        if need > avail {
            return Err(StartError::NoMemory {
                nodes: c.local_slots().len() as u32,
                each: c.window_size >> 20,
                need: need >> 20,
                avail: avail >> 20,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config {
            name: "cfgtest".into(),
            nodes: 4,
            window_size: 8 << 20,
            restart_delay: None,
            agent_cmd: Vec::new(),
            net: None,
            link: None,
            topology: None,
            hosts: None,
        }
    }

    #[test]
    fn a_sane_config_passes_and_every_bad_value_is_named() {
        assert!(check_config(&config()).is_ok());
        let bad = |f: &dyn Fn(&mut Config)| {
            let mut c = config();
            f(&mut c);
            check_config(&c).unwrap_err().to_string()
        };
        assert!(bad(&|c| c.nodes = 0).contains("--nodes 0 is out of range"));
        assert!(bad(&|c| c.nodes = MAX_NODES + 1).contains("out of range"));
        assert!(bad(&|c| c.window_size = MIN_WINDOW - 4096).contains("--window-size"));
        assert!(bad(&|c| c.window_size = (8 << 20) + 1).contains("--window-size"));
        assert!(bad(&|c| c.window_size = 128 << 30).contains("--window-size"));
        assert!(bad(&|c| c.name = "a/b".into()).contains("a/b"));
        // More shared memory than the machine has: refused up front, with the figures.
        let e = bad(&|c| {
            c.nodes = MAX_NODES;
            c.window_size = 64 << 30;
        });
        assert!(e.contains("of shared memory but only"), "{e}");
    }
}
