//! `backplane agent` (internal): a node's agent, started by the supervisor. The agent itself
//! is library code ([`backplane::daemon::agent`]), configured by the typed `AgentConfig` the
//! supervisor writes to its standard input; the arguments are labels for `ps`.

/// Arguments of the agent: the fabric's name and the slot, as labels (not parsed).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Labels for `ps` (fabric name, slot); the configuration comes on standard input.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    labels: Vec<String>,
}

pub fn run(_: Args) -> anyhow::Result<()> {
    backplane::daemon::agent()?;
    Ok(())
}
