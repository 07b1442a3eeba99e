//! `backplane down`: stop what runs in the fabric's nodes, then the fabric, and remove every
//! OS resource it created.

use std::time::Duration;

use backplane::fabric::launch::{self, Stopped};
use backplane::fabric::members::{self, Member};
use backplane::fabric::Fabric;

use super::NameArg;

/// Arguments of `down`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
    /// Seconds a program running in a node (started with `exec`) gets to end after SIGTERM
    /// before it is sent SIGKILL.
    #[arg(long, default_value = "2", value_name = "SECS", value_parser = parse_grace)]
    grace: f64,
}

fn parse_grace(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=600.0).contains(&v) => Ok(v),
        _ => Err(format!("'{s}' is not a number of seconds from 0 to 600")),
    }
}

/// "nodes 1, 2" for the members' slots.
fn nodes_of(m: &[Member]) -> String {
    let mut slots: Vec<u32> = m.iter().map(|m| m.slot).collect();
    slots.dedup();
    let list: Vec<String> = slots.iter().map(u32::to_string).collect();
    format!(
        "node{} {}",
        if slots.len() == 1 { "" } else { "s" },
        list.join(", ")
    )
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let name = &a.name.name;
    // Programs left running in the nodes would outlive the fabric, unreachable in deleted
    // namespaces and invisible to `status`: stop them first. Looked for twice: a program caught in the middle of its exec shows no environment yet,
    // and one being stopped may have started another.
    let mut found = Vec::new();
    let mut s = members::Stopped::default();
    for _ in 0..2 {
        let Ok(more) = Fabric::attach(name).and_then(|f| f.members()) else {
            break;
        };
        if more.is_empty() {
            break;
        }
        let stopped = members::stop(&more, Duration::from_secs_f64(a.grace));
        s.terminated.extend(stopped.terminated);
        s.killed.extend(stopped.killed);
        found.extend(more);
    }
    for v in [&mut found, &mut s.terminated, &mut s.killed] {
        v.sort_by_key(|m| (m.slot, m.pid));
        v.dedup_by_key(|m| m.pid); // one SIGKILLed on the first pass may show on the second
    }
    s.terminated
        .retain(|t| !s.killed.iter().any(|k| k.pid == t.pid));
    if !found.is_empty() {
        let mut line = format!(
            "stopped {} process{} running in {}",
            found.len(),
            if found.len() == 1 { "" } else { "es" },
            nodes_of(&found)
        );
        if !s.killed.is_empty() {
            let pids: Vec<String> = s.killed.iter().map(|m| m.pid.to_string()).collect();
            line += &format!(
                " ({} killed after the {}s grace: pid {})",
                s.killed.len(),
                a.grace,
                pids.join(", ")
            );
        }
        println!("{line}");
    }
    match launch::stop(name)? {
        Stopped::Clean => println!("fabric '{name}' is down"),
        Stopped::Stale => println!(
            "fabric '{name}' was not running; removed what a crashed supervisor left behind"
        ),
    }
    Ok(())
}
