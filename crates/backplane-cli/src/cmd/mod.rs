//! Command-line definitions and dispatch.

mod agent;
mod bench;
mod down;
mod perf;
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
    /// perftest-like micro benchmarks: dgram-lat, dgram-bw.
    Perf(perf::Args),
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

/// Runs the parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Up(a) => up::run(a),
        Command::Status(a) => status::run(a),
        Command::Down(a) => down::run(a),
        Command::Perf(a) => perf::run(a),
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
