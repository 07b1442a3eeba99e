//! `backplane up`: start a supervisor for a new fabric and wait until every node is READY.

use anyhow::Context;
use backplane::fabric::launch::{self, Options};
use backplane::fabric::topology::Kind;
use backplane::model::Forwarding;
use backplane::net::NetPlan;

use super::{human_size, parse_size, NameArg};

/// Arguments of `up`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
    /// Number of nodes (slots 1..N; default 4, or the topology file's).
    #[arg(long)]
    nodes: Option<u32>,
    /// Inbound memory window per node (e.g. 64M, 1G).
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    window_size: u64,
    #[command(flatten)]
    net: super::NetArgs,
    /// Emulate a backplane link (pcie-genGxL, eth-SPEED) between every node and the switch:
    /// pace to its effective bandwidth and add its per-hop latency.
    #[arg(long, value_name = "MODEL")]
    link: Option<String>,
    /// How the emulated switch forwards: cut-through or store-and-forward.
    #[arg(long, value_enum, default_value = "cut-through", requires = "link")]
    forwarding: Fwd,
    /// A topology file (TOML): star or distributed, its links and their models.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["link", "forwarding"])]
    topology: Option<std::path::PathBuf>,
    /// A fabric across hosts: a TOML file of `[[hosts]]` (name, address = "IPv4:PORT", slots),
    /// the same on every host; each host runs `up --hosts FILE --host NAME` for its slots.
    #[arg(long, value_name = "FILE", requires = "host", conflicts_with_all = ["nodes"])]
    hosts: Option<std::path::PathBuf>,
    /// Which host of the hosts file this is.
    #[arg(long, value_name = "NAME", requires = "hosts")]
    host: Option<String>,
    /// How long to wait for the hosts listed before this one to welcome it (seconds).
    #[arg(long, value_name = "SECS", default_value_t = 10.0, requires = "hosts")]
    join_timeout: f64,
    /// Restart a node whose agent died after this many milliseconds (0: leave it DOWN).
    #[arg(long, default_value_t = 1000)]
    restart_delay_ms: u64,
}

/// Forwarding mode of the emulated switch.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Fwd {
    /// Start forwarding once the header has arrived.
    CutThrough,
    /// Start forwarding once the whole packet has arrived.
    StoreAndForward,
}

impl From<Fwd> for Forwarding {
    fn from(f: Fwd) -> Self {
        match f {
            Fwd::CutThrough => Forwarding::CutThrough,
            Fwd::StoreAndForward => Forwarding::StoreAndForward,
        }
    }
}

/// Launch options for this executable.
pub fn options(
    name: &str,
    nodes: u32,
    window_size: u64,
    restart_delay_ms: u64,
    net: Option<NetPlan>,
) -> anyhow::Result<Options> {
    let exe = std::env::current_exe().context("cannot find the backplane executable")?;
    Ok(Options {
        window_size,
        restart_delay_ms,
        net,
        ..Options::new(name, nodes, exe)
    })
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let topo_path = a
        .topology
        .as_ref()
        .map(|p| {
            std::fs::canonicalize(p)
                .with_context(|| format!("cannot read topology file {}", p.display()))
        })
        .transpose()?;
    let topo = topo_path
        .as_deref()
        .map(launch::load_topology)
        .transpose()?;
    let hosts = match (&a.hosts, &a.host) {
        (Some(f), Some(me)) => {
            let path = std::fs::canonicalize(f)
                .with_context(|| format!("cannot read hosts file {}", f.display()))?;
            let plan = launch::load_hosts(&path, me)?;
            Some((path, plan))
        }
        _ => None,
    };
    let nodes = match (a.nodes, &topo, &hosts) {
        (_, Some(t), Some((_, p))) if t.nodes != p.nodes() => {
            anyhow::bail!(
                "the topology file has {} nodes but the hosts file {}: a topology across hosts names every slot of every host",
                t.nodes,
                p.nodes()
            )
        }
        (_, _, Some((_, p))) => p.nodes(),
        (Some(n), Some(t), None) if n != t.nodes => {
            anyhow::bail!(
                "--nodes {n} disagrees with the topology file, which has {} nodes",
                t.nodes
            )
        }
        (Some(n), _, None) => n,
        (None, Some(t), None) => t.nodes,
        (None, None, None) => 4,
    };
    // Judge the node count and window before the subnet they must fit in.
    let mut plain = options(&a.name.name, nodes, a.window_size, a.restart_delay_ms, None)?;
    if !(a.join_timeout.is_finite() && a.join_timeout > 0.0 && a.join_timeout <= 3600.0) {
        anyhow::bail!(
            "--join-timeout {} is out of range: use 0.1 to 3600 seconds",
            a.join_timeout
        );
    }
    plain.hosts = hosts.as_ref().map(|(p, plan)| launch::HostsOptions {
        file: p.clone(),
        host: plan.this().name.clone(),
        join_timeout_ms: (a.join_timeout * 1000.0).round().max(1.0) as u64,
    });
    backplane::fabric::supervisor::check_config(&plain.config()?)?;
    let net = a.net.plan(nodes)?;
    let link = match &a.link {
        Some(m) => {
            let repr = launch::resolve_link(m, a.forwarding.into())?;
            Some((repr, (m.clone(), Forwarding::from(a.forwarding))))
        }
        None => None,
    };
    let mut o = options(&a.name.name, nodes, a.window_size, a.restart_delay_ms, net)?;
    o.link = link.as_ref().map(|(_, l)| l.clone());
    o.topology = topo_path;
    o.hosts = plain.hosts.clone();
    launch::start(&o)?;
    let net_note = net.map_or(String::from(", no network"), |p| {
        format!(", bp0 {} .. {} (MTU {})", p.cidr(1), p.cidr(nodes), p.mtu)
    });
    let topo_note = topo.as_ref().map_or(String::new(), |t| match t.kind {
        Kind::Star => format!(", star topology, link {}", t.link.name),
        Kind::Distributed => {
            let links: Vec<String> = t.links.iter().map(|l| format!("{}-{}", l.a, l.b)).collect();
            format!(", distributed topology: links {}", links.join(" "))
        }
    });
    let link_note = link.map_or(topo_note, |(r, _)| {
        format!(
            ", link {} ({:.0} MB/s, hop {} ns, {})",
            r.name,
            r.bytes_per_s as f64 / 1e6,
            r.hop_ns,
            if r.store_and_forward {
                "store-and-forward"
            } else {
                "cut-through"
            }
        )
    });
    if let Some((_, plan)) = &hosts {
        let me = plan.this();
        let others: Vec<String> = plan
            .hosts
            .iter()
            .filter(|h| h.name != me.name)
            .map(|h| format!("{} ({})", h.name, h.address))
            .collect();
        println!(
            "fabric '{}' is up on host '{}': nodes {} of 1..={}, {} windows{net_note}{link_note}; other hosts: {}",
            a.name.name,
            me.name,
            me.slots
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            nodes,
            human_size(a.window_size),
            others.join(", ")
        );
        return Ok(());
    }
    println!(
        "fabric '{}' is up: {} nodes, {} windows{net_note}{link_note}",
        a.name.name,
        nodes,
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
