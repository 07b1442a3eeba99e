//! `backplane up`: start a supervisor for a new fabric and wait until every node is READY.

use anyhow::Context;
use backplane::fabric::launch::{self, Options};
use backplane::net::NetPlan;

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
    /// Do not give nodes network interfaces (no namespaces, no TAPs: works without root).
    #[arg(long)]
    no_net: bool,
    /// IPv4 subnet of the fabric's interfaces; node N gets host address N.
    #[arg(long, default_value = backplane::net::DEFAULT_SUBNET)]
    subnet: String,
    /// MTU of every node's bp0.
    #[arg(long, default_value_t = backplane::net::DEFAULT_MTU)]
    mtu: u32,
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
    net: Option<NetPlan>,
) -> anyhow::Result<Options> {
    Ok(Options {
        name: name.to_owned(),
        nodes,
        window_size,
        restart_delay_ms,
        exe: std::env::current_exe().context("cannot find the backplane executable")?,
        net,
    })
}

pub fn run(a: Args) -> anyhow::Result<()> {
    // Judge the node count and window before the subnet they must fit in.
    let plain = options(
        &a.name.name,
        a.nodes,
        a.window_size,
        a.restart_delay_ms,
        None,
    )?;
    backplane::fabric::supervisor::check_config(&plain.config())?;
    let net = if a.no_net {
        None
    } else {
        Some(NetPlan::new(&a.subnet, a.mtu, a.nodes)?)
    };
    launch::start(&options(
        &a.name.name,
        a.nodes,
        a.window_size,
        a.restart_delay_ms,
        net,
    )?)?;
    let net_note = net.map_or(String::from(", no network"), |p| {
        format!(", bp0 {} .. {} (MTU {})", p.cidr(1), p.cidr(a.nodes), p.mtu)
    });
    println!(
        "fabric '{}' is up: {} nodes, {} windows{net_note}",
        a.name.name,
        a.nodes,
        human_size(a.window_size)
    );
    Ok(())
}

/// Starts a fabric without networking and returns once every node is READY.
pub fn start(
    name: &str,
    nodes: u32,
    window_size: u64,
    restart_delay_ms: u64,
) -> anyhow::Result<()> {
    launch::start(&options(name, nodes, window_size, restart_delay_ms, None)?)?;
    Ok(())
}
