//! `backplane down`: stop a fabric and remove every OS resource it created.

use std::time::{Duration, Instant};

use anyhow::bail;
use backplane::fabric::{self, supervisor, Fabric};

use super::NameArg;

/// Arguments of `down`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let name = &a.name.name;
    match stop(name)? {
        Stopped::Clean => println!("fabric '{name}' is down"),
        Stopped::Stale => println!(
            "fabric '{name}' was not running; removed what a crashed supervisor left behind"
        ),
    }
    Ok(())
}

/// How a fabric was stopped.
pub enum Stopped {
    /// The supervisor shut down and cleaned up.
    Clean,
    /// Only leftovers of a dead supervisor were found and removed.
    Stale,
}

/// Stops fabric `name`, waiting until its supervisor has removed everything.
pub fn stop(name: &str) -> anyhow::Result<Stopped> {
    fabric::validate_name(name)?;
    let dir = fabric::fabric_dir(name);
    if !supervisor::is_running(name) {
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
            return Ok(Stopped::Stale);
        }
        bail!("no fabric named '{name}' is running");
    }
    let f = Fabric::attach(name)?;
    let pid = f.status()?.supervisor_pid;
    f.shutdown()?;
    drop(f);
    let deadline = Instant::now() + Duration::from_secs(10);
    while supervisor::is_running(name) || dir.exists() {
        if Instant::now() > deadline {
            if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            std::thread::sleep(Duration::from_millis(100));
            let _ = std::fs::remove_dir_all(&dir);
            bail!("the supervisor of '{name}' did not stop within 10 s; it was killed");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(Stopped::Clean)
}
