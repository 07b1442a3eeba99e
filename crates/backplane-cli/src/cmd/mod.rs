//! Command-line definitions and dispatch.

mod agent;
mod bench;
mod down;
mod exec;
mod model;
mod perf;
mod perf_ip;
mod rsh;
mod status;
mod supervisor;
mod up;

use clap::{Parser, Subcommand};

/// backplane: a software switch fabric for multi-node embedded computing.
#[derive(Parser, Debug)]
#[command(name = "backplane", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Bring up a fabric of N nodes, each with a memory window, doorbells and scratchpads.
    Up(up::Args),
    /// Show every slot of a fabric: state, window, doorbell, pid, generation, traffic.
    Status(status::Args),
    /// Stop a fabric and remove everything it created.
    Down(down::Args),
    /// Run a program inside a node (its network namespace, BACKPLANE_FABRIC/NODE set).
    Exec(exec::Args),
    /// What `ssh HOST COMMAND` does, for a node (`nodeN`): for launchers that start their
    /// remote parts over ssh (OpenMPI's `--mca plm_rsh_agent "backplane rsh --verbs"`).
    Rsh(rsh::Args),
    /// perftest-like micro benchmarks: dgram-lat, dgram-bw, write-lat, write-bw, read-lat,
    /// read-bw, send-lat, send-bw, atomic-lat, ip, dma-bw (UCX and memcpy in the same run).
    Perf(perf::Args),
    /// Link models: what a PCIe or Ethernet backplane link delivers.
    Model(model::Args),
    /// The characterization lab: every path measured side by side, with tables, JSON and plots.
    Bench(bench::Args),
    /// (internal) The process that keeps a fabric; started by `up`.
    #[command(hide = true)]
    Supervisor(supervisor::Args),
    /// (internal) A node's agent; started by the supervisor.
    #[command(hide = true)]
    Agent(agent::Args),
    /// (internal) The far side of a `perf` run.
    #[command(hide = true, name = "perf-peer")]
    PerfPeer(perf::PeerArgs),
    /// (internal) The far side of one path of a `bench` run.
    #[command(hide = true, name = "bench-peer")]
    BenchPeer(bench::PeerArgs),
}

/// Writes a command's result to stdout. A closed stdout (`backplane perf ... | head`) is not
/// an error: commands that clean up on signals catch SIGPIPE, so it shows up here as EPIPE.
/// Refuses nodes that run on another host of a fabric across hosts: a program for one runs on
/// its host.
pub fn require_local(fabric: &backplane::fabric::Fabric, nodes: &[u32]) -> anyhow::Result<()> {
    let st = fabric.status()?;
    let Some(me) = st.hosts.first() else {
        return Ok(());
    };
    for &n in nodes {
        if let Some(row) = st.slots.iter().find(|s| s.slot == n) {
            if !me.slots.contains(&n) {
                anyhow::bail!(
                    "node {n} runs on host '{}', not on this host ('{}'): run its programs there \
                     (this host's nodes: {})",
                    row.host.as_deref().unwrap_or("?"),
                    me.name,
                    me.slots
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
    }
    Ok(())
}

pub fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Up(a) => up::run(a),
        Command::Status(a) => status::run(a),
        Command::Down(a) => down::run(a),
        Command::Exec(a) => exec::run(a),
        Command::Rsh(a) => rsh::run(a),
        Command::Perf(a) => perf::run(a),
        Command::Model(a) => model::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Supervisor(a) => supervisor::run(a),
        Command::Agent(a) => agent::run(a),
        Command::PerfPeer(a) => perf::run_peer(a),
        Command::BenchPeer(a) => bench::run_peer(a),
    }
}

/// Parses a byte size: `65536`, `64K`, `64KiB`, `64M`, `1G` (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 4096, 64K, 64M, 1G)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("'{s}' has an unknown unit (use K, M or G)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("'{s}' is too large"))
}

/// Formats a byte count for humans: 64 MiB, 4 KiB, 100 B.
pub fn human_size(n: u64) -> String {
    if n >= 1 << 30 && n.is_multiple_of(1 << 30) {
        format!("{} GiB", n >> 30)
    } else if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

/// The network options of `up` (and of the supervisor it starts).
#[derive(clap::Args, Debug, Clone)]
pub struct NetArgs {
    /// Do not give nodes network interfaces (no namespaces, no TAPs: works without root).
    #[arg(long)]
    pub no_net: bool,
    /// IPv4 subnet of the fabric's interfaces; node N gets host address N.
    #[arg(long, default_value = backplane::net::DEFAULT_SUBNET)]
    pub subnet: String,
    /// MTU of every node's bp0.
    #[arg(long, default_value_t = backplane::net::DEFAULT_MTU)]
    pub mtu: u32,
}

impl NetArgs {
    /// The addressing plan for `nodes` nodes, or `None` with `--no-net`.
    pub fn plan(&self, nodes: u32) -> anyhow::Result<Option<backplane::net::NetPlan>> {
        if self.no_net {
            return Ok(None);
        }
        Ok(Some(backplane::net::NetPlan::new(
            &self.subnet,
            self.mtu,
            nodes,
        )?))
    }
}

/// The `--name` option shared by every fabric command.
#[derive(clap::Args, Debug, Clone)]
pub struct NameArg {
    /// Fabric name.
    #[arg(long, default_value = backplane::fabric::DEFAULT_NAME, env = "BACKPLANE_FABRIC")]
    pub name: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units_and_reject_garbage() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
        assert_eq!(human_size(64 << 20), "64 MiB");
        assert_eq!(human_size(100), "100 B");
    }
}
