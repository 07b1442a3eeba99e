//! The fabric's own processes as library entry points: the supervisor (with the verbs registry
//! it hosts) and the node agent (with the TAP data path). [`fabric::launch::start`] starts a
//! supervisor from an executable whose `supervisor` and `agent` commands call [`supervisor()`]
//! and [`agent()`]; both read a typed configuration (JSON), never argv.
//!
//! Two executables do: `backplane` (the CLI), and `backplane-fabricd`, this crate's own small
//! binary, which is what the library's integration tests start fabrics with (so the library
//! needs no CLI to run a fabric). [`main`] is all of `backplane-fabricd`.
//!
//! [`fabric::launch::start`]: crate::fabric::launch::start

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use crate::fabric::launch::Options;
use crate::fabric::supervisor::{self, StartError};
use crate::fabric::{fabric_dir, LOG_FILE};

/// Why a fabric process could not run.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Occurs when the supervisor cannot start or fails.
    #[error(transparent)]
    Supervisor(#[from] StartError),
    /// Occurs when the node agent cannot start or fails.
    #[error(transparent)]
    Agent(#[from] crate::net::agent::AgentError),
    /// Occurs when the process was started without what its starter must pass.
    #[error("{0}")]
    Usage(String),
}

/// Takes ownership of descriptor `fd`, inherited from the process that started us, and keeps
/// it out of the programs we spawn (close-on-exec).
fn inherited_fd(fd: RawFd) -> Result<File, DaemonError> {
    if fd <= 2 {
        return Err(DaemonError::Usage(format!(
            "descriptor {fd} is not one a parent passes"
        )));
    }
    // Refuse a descriptor that is not open rather than adopt a number another part of this
    // process may open later.
    let open = std::fs::read_link(format!("/proc/self/fd/{fd}")).is_ok();
    if !open {
        return Err(DaemonError::Usage(format!(
            "descriptor {fd} is not open: the supervisor is started by `launch::start`"
        )));
    }
    // SAFETY: `launch::start` passes this descriptor (a pipe end, checked open above) and
    // nothing else in this process uses it: `supervisor` is called once, at start-up, and the
    // descriptor is owned by the returned File from here on.
    let f = unsafe { File::from_raw_fd(fd) };
    rustix::io::fcntl_setfd(&f, rustix::io::FdFlags::CLOEXEC).map_err(|e| {
        DaemonError::Supervisor(StartError::Os {
            what: format!("cannot keep descriptor {fd}"),
            source: e.into(),
        })
    })?;
    Ok(f)
}

/// Runs fabric `name`'s supervisor until the fabric is stopped: reads its [`Options`] from
/// descriptor `options_fd` (to the end), answers "ready" or "error: …" on `ready_fd`, and hosts
/// the verbs registry. Call it once per process, as its main work.
pub fn supervisor(name: &str, ready_fd: RawFd, options_fd: RawFd) -> Result<(), DaemonError> {
    let mut ready = inherited_fd(ready_fd)?;
    let fail = |ready: &mut File, e: &dyn std::fmt::Display| {
        let _ = writeln!(ready, "error: {e}");
    };
    let mut json = Vec::new();
    if let Err(e) = inherited_fd(options_fd)?.read_to_end(&mut json) {
        let e = format!("cannot read the supervisor's options: {e}");
        fail(&mut ready, &e);
        return Err(DaemonError::Usage(e));
    }
    let opts: Options = match serde_json::from_slice(&json) {
        Ok(o) => o,
        Err(e) => {
            let e = format!("malformed supervisor options: {e}");
            fail(&mut ready, &e);
            return Err(DaemonError::Usage(e));
        }
    };
    if opts.name != name {
        let e = format!("options for fabric '{}' given to '{name}'", opts.name);
        fail(&mut ready, &e);
        return Err(DaemonError::Usage(e));
    }
    let cfg = opts.config().inspect_err(|e| fail(&mut ready, e))?;
    let lock = supervisor::lock_fabric(&cfg.name).inspect_err(|e| fail(&mut ready, e))?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(fabric_dir(&cfg.name).join(LOG_FILE))
        .map_err(|e| StartError::Os {
            what: "cannot open the fabric's log".into(),
            source: e,
        })
        .inspect_err(|e| fail(&mut ready, e))?;
    // The supervisor's own standard error goes to its log too (it was /dev/null): a panic's
    // message and UCX's errors (its log goes to stderr) are what tells why a supervisor died.
    let _ = rustix::stdio::dup2_stderr(&log);
    // The verbs registry lives with the verbs; the supervisor hosts it.
    let verbs = Box::new(crate::verbs::registry::Registry::new());
    supervisor::run(cfg, lock, Some(ready), log, verbs)?;
    Ok(())
}

/// Runs a node's agent: its [`AgentConfig`](crate::fabric::launch::AgentConfig) comes as one
/// JSON line on standard input; arguments are only labels for `ps`.
pub fn agent() -> Result<(), DaemonError> {
    crate::net::agent::run_from_stdin()?;
    Ok(())
}

/// The command line `launch::start` gives a supervisor, parsed: `supervisor --name N
/// --ready-fd R --options-fd O`.
fn parse_supervisor(args: &[String]) -> Result<(String, RawFd, RawFd), DaemonError> {
    let usage = || {
        DaemonError::Usage("usage: supervisor --name NAME --ready-fd N --options-fd N (started by the library, not by hand)".into())
    };
    let (mut name, mut ready, mut opts) = (None, None, None);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let v = it.next().ok_or_else(usage)?;
        match flag.as_str() {
            "--name" => name = Some(v.clone()),
            "--ready-fd" => ready = Some(v.parse().map_err(|_| usage())?),
            "--options-fd" => opts = Some(v.parse().map_err(|_| usage())?),
            _ => return Err(usage()),
        }
    }
    match (name, ready, opts) {
        (Some(n), Some(r), Some(o)) => Ok((n, r, o)),
        _ => Err(usage()),
    }
}

/// All of `backplane-fabricd`: `supervisor …` or `agent LABELS…`. Returns the exit status.
pub fn main(args: &[String]) -> i32 {
    let r = match args.first().map(String::as_str) {
        Some("supervisor") => parse_supervisor(&args[1..]).and_then(|(n, r, o)| supervisor(&n, r, o)),
        Some("agent") => agent(),
        _ => Err(DaemonError::Usage(
            "backplane-fabricd runs a fabric's supervisor and node agents for the library; start fabrics with `backplane up` or `backplane::fabric::launch::start`".into(),
        )),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("backplane-fabricd: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn supervisor_command_line_parses_and_refuses_what_launch_never_passes() {
        let (n, r, o) = parse_supervisor(&args("--name f1 --ready-fd 3 --options-fd 4")).unwrap();
        assert_eq!((n.as_str(), r, o), ("f1", 3, 4));
        for bad in [
            "--name f1 --ready-fd 3",
            "--name f1 --ready-fd x --options-fd 4",
            "--name",
            "--bogus 1",
        ] {
            assert!(parse_supervisor(&args(bad)).is_err(), "{bad}");
        }
        assert!(matches!(inherited_fd(1), Err(DaemonError::Usage(_))));
        assert!(matches!(inherited_fd(999_999), Err(DaemonError::Usage(_))));
    }

    #[test]
    fn unknown_command_is_refused_with_status_1() {
        assert_eq!(main(&args("frobnicate")), 1);
        assert_eq!(main(&[]), 1);
    }
}
