//! A veth pair between two network namespaces the bench creates for itself: the reference for
//! TCP and UDP through the kernel's full network path (as iperf3 between two hosts would see
//! it, minus the wire). Addresses are 10.255.0.1/30 and 10.255.0.2/30, which exist only inside
//! those two namespaces. Needs root; everything is deleted when the [`VethPair`] drops.

use std::os::fd::AsFd;
use std::process::{Command, Stdio};

use anyhow::{bail, Context};

use crate::teardown::{self, Guard};

/// Address of the bench's side (namespace A).
pub const ADDR_A: &str = "10.255.0.1";
/// Address of the peer's side (namespace B).
pub const ADDR_B: &str = "10.255.0.2";

/// Two namespaces joined by a veth pair.
pub struct VethPair {
    /// Namespace of the bench's sockets.
    pub ns_a: String,
    /// Namespace of the peer process.
    pub ns_b: String,
    _guard: Guard,
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("cannot run ip (Debian package iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Why the veth paths cannot run here, if they cannot.
pub fn unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("needs root to create network namespaces (run as root)".into());
    }
    if crate::ucx::which("ip").is_none() {
        return Some("the ip command is missing (Debian package iproute2)".into());
    }
    None
}

impl VethPair {
    /// Creates namespaces `bpb-<tag>-a` / `-b` and a veth pair between them, addressed and up.
    pub fn create(tag: &str) -> anyhow::Result<VethPair> {
        if let Some(why) = unavailable() {
            bail!("{why}");
        }
        let ns_a = format!("bpb-{tag}-a");
        let ns_b = format!("bpb-{tag}-b");
        let (a, b) = (ns_a.clone(), ns_b.clone());
        let guard = teardown::register(format!("network namespaces {ns_a}, {ns_b}"), move || {
            // Deleting a namespace deletes the veth end inside it, and with it the pair.
            let _ = ip(&["netns", "del", &a]);
            let _ = ip(&["netns", "del", &b]);
        });
        ip(&["netns", "add", &ns_a])?;
        ip(&["netns", "add", &ns_b])?;
        // Interface names are at most 15 characters.
        let short: String = tag.chars().filter(|c| c.is_ascii_alphanumeric()).collect();
        let short = &short[short.len().saturating_sub(9)..];
        let (if_a, if_b) = (format!("bpb{short}a"), format!("bpb{short}b"));
        ip(&[
            "link", "add", &if_a, "netns", &ns_a, "type", "veth", "peer", "name", &if_b, "netns",
            &ns_b,
        ])?;
        for (ns, dev, addr) in [(&ns_a, &if_a, ADDR_A), (&ns_b, &if_b, ADDR_B)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(VethPair {
            ns_a,
            ns_b,
            _guard: guard,
        })
    }

    /// Runs `f` on a fresh thread that has entered namespace A, so sockets it creates live
    /// there (a socket stays in its namespace whichever thread uses it later).
    pub fn in_a<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
    ) -> anyhow::Result<T> {
        in_ns(&self.ns_a, f)
    }
}

/// Runs `f` on a fresh thread that has entered the network namespace `/run/netns/NS`, so
/// sockets it creates live there (a socket stays in its namespace whichever thread uses it
/// later); the calling thread stays where it is.
pub fn in_ns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).with_context(|| format!("cannot open {path}"))?;
        rustix::thread::move_into_link_name_space(
            ns.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .with_context(|| format!("setns into {path}"))?;
        f()
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the namespace thread panicked"))?
}

/// Whether a network namespace of this name exists.
pub fn exists(ns: &str) -> bool {
    std::path::Path::new("/run/netns").join(ns).exists()
}
