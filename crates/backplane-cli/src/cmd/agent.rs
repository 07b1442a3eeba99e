//! `backplane agent` (internal): a node's agent, started by the supervisor. The agent itself
//! is library code ([`backplane::net::agent`]); this file only parses its arguments.

use backplane::net::agent::{self, AgentConfig};

use super::NameArg;

/// Arguments of the agent.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
    #[arg(long)]
    slot: u32,
    /// Give the node a bp0 on this subnet (absent: no networking).
    #[arg(long)]
    subnet: Option<String>,
    #[arg(long, default_value_t = backplane::net::DEFAULT_MTU)]
    mtu: u32,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    agent::run(&AgentConfig {
        fabric: a.name.name,
        slot: a.slot,
        net: a.subnet.map(|s| (s, a.mtu)),
    })?;
    Ok(())
}
