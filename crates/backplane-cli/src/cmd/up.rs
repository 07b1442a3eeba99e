//! `backplane up`: start a supervisor for a new fabric and wait until every node is READY.

use anyhow::Context;
use backplane::fabric::launch::{self, Options};

use super::{human_size, parse_size, NameArg};

/// Arguments of `up`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
    /// Number of nodes (slots 1..N).
    #[arg(long, default_value_t = 4)]
    nodes: u32,
    /// Inbound memory window per node (e.g. 64M, 1G).
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    window_size: u64,
    /// Do not create network interfaces (IP over the fabric is not built yet; accepted now so
    /// scripts keep working when it is).
    #[arg(long)]
    no_net: bool,
    /// Restart a node whose agent died after this many milliseconds (0: leave it DOWN).
    #[arg(long, default_value_t = 1000)]
    restart_delay_ms: u64,
}

/// Launch options for this executable.
pub fn options(
    name: &str,
    nodes: u32,
    window_size: u64,
    restart_delay_ms: u64,
) -> anyhow::Result<Options> {
    Ok(Options {
        name: name.to_owned(),
        nodes,
        window_size,
        restart_delay_ms,
        exe: std::env::current_exe().context("cannot find the backplane executable")?,
    })
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let _ = a.no_net;
    start(&a.name.name, a.nodes, a.window_size, a.restart_delay_ms)?;
    println!(
        "fabric '{}' is up: {} nodes, {} windows",
        a.name.name,
        a.nodes,
        human_size(a.window_size)
    );
    Ok(())
}

/// Starts a fabric and returns once every node is READY.
pub fn start(
    name: &str,
    nodes: u32,
    window_size: u64,
    restart_delay_ms: u64,
) -> anyhow::Result<()> {
    launch::start(&options(name, nodes, window_size, restart_delay_ms)?)?;
    Ok(())
}
