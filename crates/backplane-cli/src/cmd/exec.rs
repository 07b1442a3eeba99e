//! `backplane exec NODE -- CMD...`: run a program inside a node — in its network namespace
//! (where `bp0` and the names `node1`..`nodeN` live), with `BACKPLANE_FABRIC` and
//! `BACKPLANE_NODE` set so programs using the library know where they are. With `--verbs`,
//! the program finds backplane's drop-in `libibverbs.so.1` first on its library search path,
//! so unmodified libibverbs programs (ibverbs-utils, perftest) run on the fabric. With
//! `--host-net`, the program stays in the host's network namespace (see [`Args::host_net`]).
//! On a fabric across hosts, `exec` enters the node's namespace itself rather than through
//! `ip netns exec`, leaving `/sys` the host's (where the library's UCX finds the host's
//! interfaces: see `backplane::dgram`'s `reach_hosts_from`).

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use anyhow::{bail, Context};
use backplane::fabric::Fabric;
use backplane::net;

use super::NameArg;

/// The libraries a program runs with in a node (`exec`'s and `rsh`'s flags).
#[derive(clap::Args, Debug, Clone, Copy)]
pub(super) struct Libs {
    /// Run the program with backplane's `libibverbs.so.1` (the `backplane-ibverbs` crate,
    /// found beside this executable) first on its library search path.
    #[arg(long)]
    pub verbs: bool,
    /// Accelerate the program's TCP connections to other nodes' `bp0` addresses: preload
    /// backplane's `libbackplane_sockets.so` (the `backplane-sockets` crate, found beside this
    /// executable), which moves the byte stream of a connection whose other end is
    /// accelerated too onto shared-memory rings. `BACKPLANE_ACCEL=0` turns it off;
    /// `BACKPLANE_ACCEL_LOG=1` prints a line per connection.
    #[arg(long)]
    pub accel: bool,
    /// For MPI (OpenMPI over UCX's InfiniBand transports, on the fabric): `--verbs`, and the
    /// settings an `mpirun` needs to run its ranks in the fabric's nodes, over what the
    /// environment says (a `UCX_TLS` there is most often the hosts' links'; `mpirun`'s own
    /// `--mca` and `-x` still win) — ranks started on other nodes through `backplane rsh
    /// --mpi` (`OMPI_MCA_plm_rsh_agent`), UCX for messages and windows (`OMPI_MCA_pml`,
    /// `OMPI_MCA_osc`: Debian turns them off), no binding (`OMPI_MCA_hwloc_base_binding_policy
    /// =none`: every node would bind its first rank to core 0), OpenMPI's `rtc hwloc` off
    /// (`OMPI_MCA_rtc=^hwloc`: it puts a shared topology in the biggest hole of the address
    /// space and crashed `mpirun`/`orted` now and then with every node a host on one machine),
    /// and UCX on the fabric's device (`UCX_TLS=rc_verbs,ud_verbs,self`,
    /// `UCX_NET_DEVICES=bp_FABRIC:1`, `UCX_ATOMIC_MODE=device`).
    #[arg(long)]
    pub mpi: bool,
}

/// The environment `--mpi` gives a program in fabric `name` (see [`Libs::mpi`]).
fn mpi_env(name: &str) -> Vec<(&'static str, String)> {
    let me = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "backplane".to_owned());
    [
        ("OMPI_MCA_plm_rsh_agent", format!("{me} rsh --mpi")),
        ("OMPI_MCA_pml", "ucx".to_owned()),
        ("OMPI_MCA_osc", "ucx".to_owned()),
        ("OMPI_MCA_hwloc_base_binding_policy", "none".to_owned()),
        ("OMPI_MCA_rtc", "^hwloc".to_owned()),
        ("UCX_TLS", "rc_verbs,ud_verbs,self".to_owned()),
        ("UCX_NET_DEVICES", format!("bp_{name}:1")),
        ("UCX_ATOMIC_MODE", "device".to_owned()),
    ]
    .into()
}

/// Arguments of `exec`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
    #[command(flatten)]
    libs: Libs,
    /// Run the program in this host's network namespace instead of the node's (it keeps the
    /// node's identity: `BACKPLANE_FABRIC`, `BACKPLANE_NODE`); its own sockets use the host's
    /// addresses, not `bp0` (perftest's exchange then connects to the other host's address).
    /// Its queue pairs and endpoints to other hosts go straight between the processes, as
    /// they do from the node's namespace on a fabric across hosts (the library's UCX makes its
    /// sockets in the host's namespace). No effect on a fabric without IP (no node
    /// namespaces).
    #[arg(long, conflicts_with = "accel")]
    host_net: bool,
    /// Node (slot) to run in.
    node: u32,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    cmd: Vec<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    run_in(&a.name.name, a.node, (a.libs, a.host_net), &a.cmd)
}

/// Runs `cmd` in node `node` of fabric `name` with `libs`, in the host's network namespace
/// if `host_net`, and exits with its status.
pub(super) fn run_in(
    name: &str,
    node: u32,
    (libs, host_net): (Libs, bool),
    cmd: &[String],
) -> anyhow::Result<()> {
    let a = Resolved {
        node,
        verbs: libs.verbs || libs.mpi,
        accel: libs.accel,
        host_net,
        cmd,
    };
    if libs.mpi && name.len() > 12 {
        // UCX keeps 15 characters of a device's name: `bp_` and 12.
        bail!(
            "--mpi: UCX cannot name fabric '{name}'s device (bp_{name}: UCX keeps 15 \
             characters of a device name): use a fabric name of 12 characters or fewer"
        );
    }
    let fabric = Fabric::attach(name)?;
    fabric.node_info(a.node)?; // unknown node: a clear error
    super::require_local(&fabric, &[a.node])?;
    let accel = if a.accel {
        Some(accel_env(name, &fabric)?)
    } else {
        None
    };
    let across_hosts = fabric.spans_hosts();
    drop(fabric);
    let in_node_ns = !a.host_net && net::has_netns(name, a.node);
    let mut cmd = if in_node_ns && across_hosts {
        // On a fabric across hosts the program's endpoints and queue pairs reach the other
        // hosts straight from its process, with UCX working in the host's namespace
        // (`dgram::reach_hosts_from`), which finds the host's interfaces in /sys/class/net:
        // the node's namespace, but /sys left as the host's.
        let mut c = Command::new(&a.cmd[0]);
        c.args(&a.cmd[1..]);
        let ns_name = net::netns_name(name, a.node);
        let ns = std::fs::File::open(format!("/run/netns/{ns_name}"))
            .with_context(|| format!("cannot open node {}'s network namespace", a.node))?;
        crate::sys::child_in_netns(&mut c, ns.into(), etc_binds(&ns_name));
        c
    } else if in_node_ns {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &net::netns_name(name, a.node)]);
        c.args(a.cmd);
        c
    } else {
        let mut c = Command::new(&a.cmd[0]);
        c.args(&a.cmd[1..]);
        c
    };
    cmd.env("BACKPLANE_FABRIC", name)
        .env("BACKPLANE_NODE", a.node.to_string());
    if a.verbs {
        let dir = verbs_lib_dir(name)?;
        let mut path = std::ffi::OsString::from(dir.as_os_str());
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
            path.push(":");
            path.push(old);
        }
        cmd.env("LD_LIBRARY_PATH", path);
    }
    if let Some(env) = accel {
        cmd.envs(env);
    }
    if libs.mpi {
        cmd.envs(mpi_env(name));
    }
    crate::sys::child_default_sigpipe(&mut cmd);
    let status = cmd.status().map_err(|e| {
        // (Entering the node's namespaces needs root: say so rather than blame the program.)
        if in_node_ns && across_hosts && e.raw_os_error() == Some(libc::EPERM) {
            anyhow::anyhow!(
                "cannot enter node {}'s network namespace: {e} (exec into a node needs root)",
                a.node
            )
        } else {
            anyhow::Error::new(e).context(format!("cannot run '{}'", a.cmd[0]))
        }
    })?;
    if let Some(code) = status.code() {
        std::process::exit(code);
    }
    if let Some(sig) = status.signal() {
        std::process::exit(128 + sig);
    }
    bail!("'{}' ended abnormally", a.cmd[0])
}

/// `exec`'s arguments once the fabric is known.
struct Resolved<'a> {
    node: u32,
    verbs: bool,
    accel: bool,
    host_net: bool,
    cmd: &'a [String],
}

/// The files of a node's `/etc/netns/NAME` (its `hosts`) and the `/etc` files they go over,
/// as `ip netns exec` binds them.
fn etc_binds(ns_name: &str) -> Vec<(std::ffi::CString, std::ffi::CString)> {
    let dir = std::path::Path::new("/etc/netns").join(ns_name);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            use std::os::unix::ffi::OsStrExt;
            let file = std::ffi::CString::new(e.path().as_os_str().as_bytes()).ok()?;
            let over = std::path::Path::new("/etc").join(e.file_name());
            let over = std::ffi::CString::new(over.as_os_str().as_bytes()).ok()?;
            Some((file, over))
        })
        .collect()
}

/// A library built beside this executable (by the workspace's crate `krate`), or the error
/// that says how to build it.
fn lib_beside_exe(file: &str, flag: &str, krate: &str) -> anyhow::Result<std::path::PathBuf> {
    let exe = std::env::current_exe().context("cannot find the backplane executable")?;
    let lib = exe.with_file_name(file);
    if !lib.is_file() {
        bail!(
            "{flag} needs {} (build it: cargo build -p {krate}{})",
            lib.display(),
            if exe.parent().is_some_and(|d| d.ends_with("release")) {
                " --release"
            } else {
                ""
            }
        );
    }
    Ok(lib)
}

/// A directory in the fabric's run directory (gone with `down`) holding `libibverbs.so.1`, a
/// link to the `libibverbs.so` built beside this executable.
pub(crate) fn verbs_lib_dir(name: &str) -> anyhow::Result<std::path::PathBuf> {
    let lib = lib_beside_exe("libibverbs.so", "--verbs", "backplane-ibverbs")?;
    let dir = backplane::fabric::fabric_dir(name).join("verbs-lib");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let link = dir.join("libibverbs.so.1");
    if std::fs::read_link(&link).ok().as_deref() != Some(lib.as_path()) {
        // Another exec may be making it at the same moment: make ours aside, rename over.
        let tmp = dir.join(format!(".libibverbs.so.1.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&lib, &tmp)
            .and_then(|()| std::fs::rename(&tmp, &link))
            .with_context(|| format!("cannot link {} to {}", link.display(), lib.display()))?;
    }
    Ok(dir)
}

/// The environment `--accel` gives the program: the preload, the fabric's directory for the
/// agreement's files (gone with `down`) and its IPv4 plan.
pub(crate) fn accel_env(
    name: &str,
    fabric: &Fabric,
) -> anyhow::Result<Vec<(String, std::ffi::OsString)>> {
    let lib = lib_beside_exe("libbackplane_sockets.so", "--accel", "backplane-sockets")?;
    let report = fabric.status()?;
    let Some(first) = report.slots.first().and_then(|s| s.address.clone()) else {
        bail!("--accel needs IP over the fabric, and fabric '{name}' was started with --no-net");
    };
    let (ip, prefix) = first
        .split_once('/')
        .with_context(|| format!("fabric '{name}' reports a bad address {first}"))?;
    let ip: std::net::Ipv4Addr = ip
        .parse()
        .with_context(|| format!("fabric '{name}' reports a bad address {first}"))?;
    let prefix: u32 = prefix
        .parse()
        .with_context(|| format!("fabric '{name}' reports a bad address {first}"))?;
    let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
    let network = std::net::Ipv4Addr::from(u32::from(ip) & mask);
    let dir = backplane::fabric::fabric_dir(name).join("accel");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut preload = std::ffi::OsString::from(lib.as_os_str());
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|p| !p.is_empty()) {
        preload.push(":");
        preload.push(old);
    }
    Ok(vec![
        ("LD_PRELOAD".into(), preload),
        ("BACKPLANE_ACCEL_DIR".into(), dir.into_os_string()),
        (
            "BACKPLANE_ACCEL_NET".into(),
            format!("{network}/{prefix},{}", report.nodes).into(),
        ),
    ])
}
