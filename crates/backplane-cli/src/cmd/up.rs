//! `backplane up`: start a supervisor for a new fabric and wait until every node is READY.

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use backplane::fabric::supervisor::{self, Config};

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

/// Builds the supervisor configuration `up` would run with.
pub fn config(
    name: &str,
    nodes: u32,
    window_size: u64,
    restart_delay_ms: u64,
) -> anyhow::Result<Config> {
    let exe = std::env::current_exe().context("cannot find the backplane executable")?;
    Ok(Config {
        name: name.to_owned(),
        nodes,
        window_size,
        restart_delay: (restart_delay_ms > 0).then(|| Duration::from_millis(restart_delay_ms)),
        agent_cmd: vec![exe.to_string_lossy().into_owned(), "agent".into()],
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
    let cfg = config(name, nodes, window_size, restart_delay_ms)?;
    supervisor::check_config(&cfg)?;
    if supervisor::is_running(name) {
        bail!("fabric '{name}' is already running (stop it with `backplane down --name {name}`)");
    }
    let (rd, wr) = rustix::pipe::pipe().context("cannot create a pipe")?;
    let wr_raw = wr.as_raw_fd();
    let mut cmd = Command::new(&cfg.agent_cmd[0]);
    cmd.args([
        "supervisor",
        "--name",
        name,
        "--nodes",
        &nodes.to_string(),
        "--window-size",
        &window_size.to_string(),
        "--restart-delay-ms",
        &restart_delay_ms.to_string(),
        "--ready-fd",
        "3",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    // SAFETY: only async-signal-safe calls (setsid, dup2) run between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            if libc::dup2(wr_raw, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("cannot start the fabric supervisor")?;
    drop(wr);
    let mut line = String::new();
    let _ = BufReader::new(std::fs::File::from(rd)).read_line(&mut line);
    // The supervisor keeps running; reap it only if it already exited (failure).
    let _ = std::thread::spawn(move || child.wait());
    match line.trim() {
        "ready" => Ok(()),
        l if l.starts_with("error: ") => bail!("{}", &l[7..]),
        _ => bail!("the fabric supervisor exited during start-up"),
    }
}
