//! `backplane bench`: the characterization lab. Brings up a temporary 2-node fabric and
//! measures every available path side by side (fabric datagrams, kernel TCP/UDP over loopback
//! and over a veth pair between two namespaces, Unix stream sockets, UCX over shared memory),
//! prints the summary table and writes a report folder (JSON, CSV, SVG/PNG plots, Markdown).
//! The engine lives in the `backplane-bench` crate; this file is argument handling.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use backplane_bench::engine::{self, Config};
use backplane_bench::peer;
use backplane_bench::report;

use super::parse_size;

/// Arguments of `bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Paths to measure, comma separated (default: all): fabric-dgram, fabric-verbs-write,
    /// fabric-verbs-read, fabric-verbs-send, fabric-raw, fabric-tcp, fabric-tcp-accel,
    /// fabric-udp, ucx-shm, tcp-loopback, udp-loopback, unix-stream, tcp-veth, udp-veth.
    #[arg(long, value_delimiter = ',')]
    paths: Option<Vec<String>>,
    /// Message sizes, comma separated (e.g. 64,4K,1M; 8 B to 64 MiB). Default: 64 B to 8 MiB
    /// in powers of two.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Option<Vec<u64>>,
    /// Seconds of measurement per point (per size, per repeat).
    #[arg(long, default_value = "0.1", value_parser = parse_secs)]
    duration: f64,
    /// Seconds of warm-up before each point, discarded (default: a quarter of --duration, at
    /// least 0.02).
    #[arg(long, value_parser = parse_secs_or_zero)]
    warmup: Option<f64>,
    /// Runs per point; from 2 on, the report gives 95 % confidence intervals.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100))]
    repeat: u64,
    /// Run a background thread writing 8 MB blocks in a loop, to measure interference.
    #[arg(long)]
    load: bool,
    /// Datagram size of the loss sweep and zero-loss search (16 B to 65507 B).
    #[arg(long, default_value = "1K", value_parser = parse_size)]
    loss_size: u64,
    /// Report folder (default: `bench-report/<UTC timestamp>/`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the JSON report (version 1) on stdout instead of the summary table.
    #[arg(long)]
    json: bool,
    /// No progress output on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// Emulate a link model on the temporary fabric (as `up --link`) and show the model's
    /// bandwidth and latency slope beside the fabric's measurements.
    #[arg(long, value_name = "MODEL")]
    link: Option<String>,
}

fn parse_secs(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 3600.0 => Ok(v),
        _ => Err(format!("'{s}' is not a number of seconds in (0, 3600]")),
    }
}

fn parse_secs_or_zero(s: &str) -> Result<f64, String> {
    if s.trim().parse::<f64>() == Ok(0.0) {
        return Ok(0.0);
    }
    parse_secs(s)
}

/// Arguments of the far side (`bench-peer`): none that configure it — its configuration is
/// the first line (JSON) on its standard input, written by the bench.
#[derive(clap::Args, Debug)]
pub struct PeerArgs {
    /// The peer's kind, as a label for `ps` (the configuration on stdin decides).
    label: Option<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let (_, stamp) = report::utc_now();
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("bench-report").join(stamp));
    if let Some(m) = &a.link {
        m.parse::<backplane::model::LinkModel>()?;
    }
    let user_sizes = a.sizes.is_some();
    let cfg = Config {
        paths: a.paths,
        sizes: a.sizes.unwrap_or_else(engine::default_sizes),
        duration: Duration::from_secs_f64(a.duration),
        warmup: Duration::from_secs_f64(a.warmup.unwrap_or((a.duration / 4.0).max(0.02))),
        repeat: a.repeat as usize,
        load: a.load,
        loss_bytes: a.loss_size,
        exe: std::env::current_exe().context("cannot find the backplane executable")?,
        quiet: a.quiet,
        link: a.link,
    };
    // Fail before measuring for a minute if the report cannot be written.
    std::fs::create_dir_all(&out)
        .with_context(|| format!("cannot create the report folder {}", out.display()))?;
    let r = engine::run(&cfg)?;
    // Write the report, but show the measurements whatever happens to the folder.
    let written = report::write_all(&r, &out);
    let text = if a.json {
        format!("{}\n", serde_json::to_string_pretty(&r)?)
    } else if written.is_ok() {
        format!(
            "{}report: {}\n",
            report::summary_text(&r),
            out.join("summary.md").display()
        )
    } else {
        report::summary_text(&r)
    };
    // The engine catches SIGPIPE (see teardown): a closed stdout is an error to end quietly on.
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
        r => r.context("cannot write to stdout")?,
    }
    written.with_context(|| {
        format!(
            "the measurements above were taken, but the report folder {} could not be written",
            out.display()
        )
    })?;
    if r.summary.is_empty() {
        bail!(
            "no path could be measured (see {})",
            out.join("summary.md").display()
        );
    }
    if let Some(why) = partial(&r, user_sizes) {
        eprintln!(
            "backplane: partial run: {why} (see {})",
            out.join("summary.md").display()
        );
        std::process::exit(PARTIAL_EXIT);
    }
    Ok(())
}

/// Exit status of a run that measured something but not everything it was asked for.
pub const PARTIAL_EXIT: i32 = 3;

/// Why the run is partial, if it is: a path failed or stopped part-way, or (when the user
/// chose the sizes) a size was out of range or one a path cannot carry. Paths skipped for a
/// missing tool or privilege, and the sizes of the default sweep a path cannot carry, are
/// reported but do not make a run partial.
fn partial(r: &report::Report, user_sizes: bool) -> Option<String> {
    use report::Status;
    let mut why = Vec::new();
    for p in &r.paths {
        match p.status {
            Status::Partial | Status::Failed => why.push(format!(
                "{} {}",
                p.name,
                if p.status == Status::Partial {
                    "stopped part-way"
                } else {
                    "failed"
                }
            )),
            _ if user_sizes && !p.not_applicable.is_empty() => why.push(format!(
                "{} cannot carry {}",
                p.name,
                p.not_applicable
                    .iter()
                    .map(|n| report::human_bytes(n.bytes))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            _ => {}
        }
    }
    if user_sizes {
        why.extend(
            r.skipped
                .iter()
                .filter(|s| s.what.starts_with("size "))
                .map(|s| format!("{} not measured", s.what)),
        );
    }
    (!why.is_empty()).then(|| why.join("; "))
}

pub fn run_peer(_: PeerArgs) -> anyhow::Result<()> {
    peer::run_peer_from_stdin()
}
