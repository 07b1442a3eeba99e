//! `backplane agent` (internal): a node's agent. It takes the node's slot, keeps its heartbeat
//! going and lives as long as the node does: killing it takes the node DOWN.

use backplane::fabric::life::HEARTBEAT_PERIOD;
use backplane::fabric::Fabric;
use backplane::sync::Ordering;
use backplane::wire::WIN_HEARTBEAT_OFF;

use super::NameArg;

/// Arguments of the agent.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
    #[arg(long)]
    slot: u32,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let fabric = Fabric::attach_agent(&a.name.name, a.slot)?;
    let window = fabric.raw_window(a.slot)?;
    let beat = window.u64_at(WIN_HEARTBEAT_OFF as u64)?;
    beat.fetch_add(1, Ordering::Relaxed);
    fabric.agent_ready(a.slot)?;
    loop {
        if fabric.supervisor_gone(HEARTBEAT_PERIOD) {
            return Ok(());
        }
        beat.fetch_add(1, Ordering::Relaxed);
    }
}
