//! `backplane supervisor` (internal): the process that keeps a fabric. `launch::start` runs it
//! with its typed options on a pipe; the supervisor itself is library code
//! ([`backplane::fabric::supervisor`]).

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;

use anyhow::Context;
use backplane::fabric::launch::Options;
use backplane::fabric::{supervisor, LOG_FILE};

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
    let mut ready = crate::sys::inherited_fd(a.ready_fd)?;
    let fail = |ready: &mut File, e: &dyn std::fmt::Display| {
        let _ = writeln!(ready, "error: {e}");
    };
    let mut json = Vec::new();
    crate::sys::inherited_fd(a.options_fd)?
        .read_to_end(&mut json)
        .context("cannot read the supervisor's options")?;
    let opts: Options = match serde_json::from_slice(&json) {
        Ok(o) => o,
        Err(e) => {
            fail(&mut ready, &format!("malformed supervisor options: {e}"));
            return Err(e).context("malformed supervisor options");
        }
    };
    if opts.name != a.name.name {
        let e = format!(
            "options for fabric '{}' given to '{}'",
            opts.name, a.name.name
        );
        fail(&mut ready, &e);
        anyhow::bail!(e);
    }
    let cfg = match opts.config() {
        Ok(c) => c,
        Err(e) => {
            fail(&mut ready, &e);
            return Err(e.into());
        }
    };
    let lock = match supervisor::lock_fabric(&cfg.name) {
        Ok(l) => l,
        Err(e) => {
            fail(&mut ready, &e);
            return Err(e.into());
        }
    };
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(backplane::fabric::fabric_dir(&cfg.name).join(LOG_FILE))?;
    // The verbs registry lives with the verbs; the supervisor hosts it.
    let verbs = Box::new(backplane::verbs::registry::Registry::new());
    supervisor::run(cfg, lock, Some(ready), log, verbs)?;
    Ok(())
}
