//! `backplane supervisor` (internal): the process that keeps a fabric. `launch::start` runs it
//! with its typed options on a pipe; the supervisor itself is library code
//! ([`backplane::daemon::supervisor`]).

use super::NameArg;

/// Arguments of the supervisor.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The fabric (for `ps`; the options carry it too and must agree).
    #[command(flatten)]
    name: NameArg,
    /// File descriptor that receives "ready" or "error: ...".
    #[arg(long)]
    ready_fd: i32,
    /// File descriptor to read the options from (JSON of `launch::Options`, to its end).
    #[arg(long)]
    options_fd: i32,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    backplane::daemon::supervisor(&a.name.name, a.ready_fd, a.options_fd)?;
    Ok(())
}
