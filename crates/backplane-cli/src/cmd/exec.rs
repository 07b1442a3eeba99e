//! `backplane exec NODE -- CMD...`: run a program inside a node — in its network namespace
//! (where `bp0` and the names `node1`..`nodeN` live), with `BACKPLANE_FABRIC` and
//! `BACKPLANE_NODE` set so programs using the library know where they are.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use anyhow::{bail, Context};
use backplane::fabric::Fabric;
use backplane::net;

use super::NameArg;

/// Arguments of `exec`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
    /// Node (slot) to run in.
    node: u32,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    cmd: Vec<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let name = &a.name.name;
    let fabric = Fabric::attach(name)?;
    fabric.node_info(a.node)?; // unknown node: a clear error
    drop(fabric);
    let mut cmd = if net::has_netns(name, a.node) {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &net::netns_name(name, a.node)]);
        c.args(&a.cmd);
        c
    } else {
        let mut c = Command::new(&a.cmd[0]);
        c.args(&a.cmd[1..]);
        c
    };
    cmd.env("BACKPLANE_FABRIC", name)
        .env("BACKPLANE_NODE", a.node.to_string());
    crate::sys::child_default_sigpipe(&mut cmd);
    let status = cmd
        .status()
        .with_context(|| format!("cannot run '{}'", a.cmd[0]))?;
    if let Some(code) = status.code() {
        std::process::exit(code);
    }
    if let Some(sig) = status.signal() {
        std::process::exit(128 + sig);
    }
    bail!("'{}' ended abnormally", a.cmd[0])
}
