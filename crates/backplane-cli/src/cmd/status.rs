//! `backplane status`: one row per slot, in the spirit of the `vxfabric` table.

use backplane::fabric::ctl::StatusReport;
use backplane::fabric::Fabric;

use super::{human_size, NameArg};

/// Arguments of `status`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
    /// Print the versioned JSON document instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let report = Fabric::attach(&a.name.name)?.status()?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

/// The human table.
pub fn render(r: &StatusReport) -> String {
    let link = r.link.as_ref().map_or(String::new(), |l| {
        format!(
            ", link {} ({:.0} MB/s, hop {} ns, {})",
            l.model,
            l.bytes_per_s as f64 / 1e6,
            l.hop_ns,
            l.forwarding
        )
    });
    let mut out = format!(
        "fabric '{}': {} nodes, {} windows, up {:.1}s, supervisor pid {}{link}\n",
        r.fabric,
        r.nodes,
        human_size(r.window_size),
        r.uptime_s,
        r.supervisor_pid
    );
    if let Some(t) = &r.topology {
        out += &format!("topology {}: {}\n", t.kind, t.links.join(", "));
    }
    // A fabric across hosts: a HOST column, and room for DOWN(host-lost).
    let hw = if r.hosts.is_empty() {
        0
    } else {
        r.hosts
            .iter()
            .map(|h| h.name.len())
            .max()
            .unwrap_or(0)
            .max(4)
    };
    let host_cell = |h: &str| {
        if hw == 0 {
            String::new()
        } else {
            format!("{h:<hw$} ")
        }
    };
    let state_of = |s: &backplane::fabric::ctl::SlotStatus| match s.down_reason {
        backplane::wire::DownReason::Hung => "DOWN(h)".to_string(),
        backplane::wire::DownReason::HostLost => "DOWN(host-lost)".to_string(),
        _ => s.state.to_string(),
    };
    let sw = r
        .slots
        .iter()
        .map(|s| state_of(s).len())
        .max()
        .unwrap_or(0)
        .max(8);
    out += &format!(
        "{:>4} {}{:<sw$} {:>3} {:>7} {:>5} {:<26} {:<13} {:>9} {:>3} {:>10} {:>12} {:>10} {:>12} {:>6} {:>8}\n",
        "SLOT",
        host_cell("HOST"),
        "STATE",
        "GEN",
        "PID",
        "PROCS",
        "WINDOW(SIZE)",
        "DOORBELL",
        "UPTIME",
        "EPS",
        "TX-MSGS",
        "TX-BYTES",
        "RX-MSGS",
        "RX-BYTES",
        "DROPS",
        "FWD"
    );
    let net = r.slots.iter().any(|s| s.address.is_some());
    for s in &r.slots {
        let state = state_of(s);
        out += &format!(
            "{:>4} {}{:<sw$} {:>3} {:>7} {:>5} {:<26} {:<13} {:>8.1}s {:>3} {:>10} {:>12} {:>10} {:>12} {:>6} {:>8}\n",
            s.slot,
            host_cell(s.host.as_deref().unwrap_or("-")),
            state,
            s.generation,
            s.pid,
            s.procs,
            format!("{:#011x}({:#x})", s.window_base, s.window_size),
            format!("{:#x}", s.doorbell),
            s.uptime_s,
            s.endpoints,
            s.tx_msgs,
            s.tx_bytes,
            s.rx_msgs,
            s.rx_bytes,
            s.drops,
            s.fwd_msgs
        );
    }
    if net {
        out += &format!(
            "\n{:>4} {:<20} {:<18} {:<5} {:>10} {:>12} {:>10} {:>12} {:>8}\n",
            "SLOT", "ADDRESS", "MAC", "IF", "RX-PKTS", "RX-BYTES", "TX-PKTS", "TX-BYTES", "DROPPED"
        );
        for s in &r.slots {
            let (Some(addr), Some(mac), Some(i)) = (&s.address, &s.mac, &s.interface) else {
                continue;
            };
            out += &format!(
                "{:>4} {:<20} {:<18} {:<5} {:>10} {:>12} {:>10} {:>12} {:>8}\n",
                s.slot,
                addr,
                mac,
                if i.up { "up" } else { "down" },
                i.rx_packets,
                i.rx_bytes,
                i.tx_packets,
                i.tx_bytes,
                i.rx_dropped + i.tx_dropped
            );
        }
    }
    if !r.hosts.is_empty() {
        let aw = r
            .hosts
            .iter()
            .map(|h| h.address.len())
            .max()
            .unwrap_or(0)
            .max(7);
        out += &format!(
            "\n{:<hw$} {:<aw$} {:<12} {:<9} {:<24} {}\n",
            "HOST", "ADDRESS", "SLOTS", "STATE", "TRANSPORT (UCX)", "HEARD"
        );
        for h in &r.hosts {
            let slots: Vec<String> = h.slots.iter().map(u32::to_string).collect();
            let transport = if h.transport.is_empty() {
                "-".to_string()
            } else {
                h.transport.join(",")
            };
            let heard = match (h.heard_ms_ago, &h.error) {
                (Some(ms), _) => format!("{ms} ms ago"),
                (None, Some(e)) => format!("({e})"),
                (None, None) => "-".to_string(),
            };
            out += &format!(
                "{:<hw$} {:<aw$} {:<12} {:<9} {:<24} {heard}\n",
                h.name,
                h.address,
                slots.join(","),
                h.state,
                transport
            );
        }
    }
    if r.slots.iter().any(|s| s.accel.is_some()) {
        out += &format!(
            "\n{:>4} {:>11} {:>6} {:>14} {:>14} {:>8}  {}\n",
            "SLOT", "ACCEL-CONNS", "OPEN", "TX-BYTES", "RX-BYTES", "CORRUPT", "FALLBACKS"
        );
        for s in &r.slots {
            let Some(a) = &s.accel else {
                continue;
            };
            let fb = if a.fallbacks.is_empty() {
                "-".to_owned()
            } else {
                a.fallbacks
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            out += &format!(
                "{:>4} {:>11} {:>6} {:>14} {:>14} {:>8}  {fb}\n",
                s.slot, a.connections, a.open, a.tx_bytes, a.rx_bytes, a.corrupt
            );
        }
    }
    out
}
