//! `backplane supervisor` (internal): the process that keeps a fabric.

use std::fs::File;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::fs::OpenOptionsExt;

use backplane::fabric::{supervisor, LOG_FILE};

use super::NameArg;

/// Arguments of the supervisor.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
    #[arg(long)]
    nodes: u32,
    #[arg(long)]
    window_size: u64,
    #[arg(long, default_value_t = 1000)]
    restart_delay_ms: u64,
    /// File descriptor that receives "ready" or "error: ...".
    #[arg(long)]
    ready_fd: Option<i32>,
    #[command(flatten)]
    net: super::NetArgs,
    #[arg(long)]
    link: Option<String>,
    #[arg(long)]
    topology: Option<std::path::PathBuf>,
    #[arg(long, value_enum, default_value = "cut-through")]
    forwarding: super::up::Fwd,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mut ready = a.ready_fd.map(|fd| {
        // SAFETY: `up` passes us the write end of a pipe as this fd; we own it from here on.
        let f = unsafe { File::from_raw_fd(fd) };
        // SAFETY: FD_CLOEXEC keeps the pipe out of the agents we spawn.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        f
    });
    let net = a.net.plan(a.nodes)?;
    let mut opts = super::up::options(
        &a.name.name,
        a.nodes,
        a.window_size,
        a.restart_delay_ms,
        net,
    )?;
    opts.link = a.link.map(|l| (l, a.forwarding.into()));
    opts.topology = a.topology;
    let cfg = match opts.config() {
        Ok(c) => c,
        Err(e) => {
            if let Some(r) = ready.as_mut() {
                let _ = writeln!(r, "error: {e}");
            }
            return Err(e.into());
        }
    };
    let lock = match supervisor::lock_fabric(&cfg.name) {
        Ok(l) => l,
        Err(e) => {
            if let Some(r) = ready.as_mut() {
                let _ = writeln!(r, "error: {e}");
            }
            return Err(e.into());
        }
    };
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(backplane::fabric::fabric_dir(&cfg.name).join(LOG_FILE))?;
    supervisor::run(cfg, lock, ready, log)?;
    Ok(())
}
