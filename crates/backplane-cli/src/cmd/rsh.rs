//! `backplane rsh [--verbs] HOST COMMAND...`: what `ssh HOST COMMAND...` does, for a node of a
//! fabric on this host — for the launchers that start a program's remote parts over ssh
//! (OpenMPI's `mpirun --mca plm_rsh_agent`, pdsh, scripts). HOST is a node's name as `bp0`'s
//! hosts file gives it (`node2`), its number, or its `bp0` address; COMMAND's words are
//! joined with spaces and run by `sh -c`, as ssh has the remote shell run them. The fabric
//! is `--name`, or, from inside a node (where the launcher itself runs), the node's own.

use anyhow::{bail, Context};
use backplane::fabric::Fabric;

use super::exec::{run_in, Libs};
use super::NameArg;

/// Arguments of `rsh`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
    /// `--verbs` (MPI over UCX's InfiniBand transports, perftest) and `--accel`, as for `exec`.
    #[command(flatten)]
    libs: Libs,
    /// The node: `nodeN`, `N`, or its `bp0` address.
    host: String,
    /// The command, run by `sh -c` with its words joined by spaces (as ssh runs it).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    command: Vec<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let name = &a.name.name;
    let fabric = Fabric::attach(name)?;
    let node = node_of(&fabric, name, &a.host)?;
    drop(fabric);
    let cmd = ["sh".to_owned(), "-c".to_owned(), a.command.join(" ")];
    run_in(name, node, (a.libs, false), &cmd)
}

/// The node HOST names on `fabric`: `nodeN` or `N` (checked against the fabric's size), or a
/// name or address in the nodes' hosts file.
fn node_of(fabric: &Fabric, name: &str, host: &str) -> anyhow::Result<u32> {
    let nodes = fabric.nodes();
    let number = |s: &str| s.parse::<u32>().ok().filter(|n| (1..=nodes).contains(n));
    if let Some(n) = number(host).or_else(|| host.strip_prefix("node").and_then(number)) {
        return Ok(n);
    }
    // A bp0 address or another name the hosts file gives a node (the same file in every node).
    let hosts = backplane::fabric::netns::netns_etc(name, 1).join("hosts");
    let text = std::fs::read_to_string(&hosts)
        .with_context(|| format!("'{host}' is not a node of fabric '{name}' (nodeN or N, 1..{nodes}); no hosts file to look it up in"))?;
    for l in text.lines() {
        let w: Vec<&str> = l.split_whitespace().collect();
        if w.contains(&host) {
            if let Some(n) = w
                .iter()
                .find_map(|n| n.strip_prefix("node").and_then(number))
            {
                return Ok(n);
            }
        }
    }
    bail!("'{host}' is not a node of fabric '{name}': give nodeN, N (1..{nodes}) or a node's bp0 address")
}
