//! The report of a bench run: the versioned JSON document (its types are the schema), CSV
//! tables, the Figure-12 style summary table and the Markdown summary that embeds the plots.
//!
//! JSON version 1. New fields may be added within version 1; a change of meaning or a removed
//! field bumps `version`. Units are in the field names: `_us` microseconds, `_mb_per_s`
//! 10^6 bytes per second, `_pct` percent, `bytes` bytes.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use crate::cpu::{MachineCpu, SideCpu};
use crate::memcpy::Memcpy;
use crate::stats::LineFit;

/// The JSON document's version.
pub const VERSION: u32 = 1;

/// A whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Document version ([`VERSION`]).
    pub version: u32,
    /// Always "backplane bench".
    pub tool: String,
    /// backplane's version.
    pub backplane_version: String,
    /// When the run started, UTC, RFC 3339.
    pub started_utc: String,
    /// How long the whole run took, seconds.
    pub elapsed_s: f64,
    /// The machine.
    pub host: Host,
    /// What was asked for.
    pub config: ConfigOut,
    /// Single-thread memcpy bandwidth, measured at the start and at the end of the run.
    pub memcpy: MemcpyOut,
    /// One entry per path, measured or not.
    pub paths: Vec<PathReport>,
    /// The link model the fabric was emulating (`bench --link`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub link_model: Option<LinkModelOut>,
    /// The Figure-12 style summary, one row per measured path.
    pub summary: Vec<SummaryRow>,
    /// With `--link`: the seed documents' published figures for that link beside this run's.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub published: Vec<crate::published::PublishedRow>,
    /// Everything asked for that was not measured, with the reason.
    pub skipped: Vec<Skip>,
    /// Remarks on methods that apply to the whole report.
    pub notes: Vec<String>,
}

/// The machine the run was on.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Host {
    /// Processors online.
    pub cpus: u32,
    /// `model name` from /proc/cpuinfo.
    pub cpu_model: String,
    /// Kernel release.
    pub kernel: String,
}

/// The run's parameters.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigOut {
    /// Message sizes swept, bytes.
    pub sizes: Vec<u64>,
    /// Measurement time per point, seconds.
    pub duration_s: f64,
    /// Warm-up time before each point (discarded), seconds.
    pub warmup_s: f64,
    /// Runs per point.
    pub repeat: usize,
    /// Whether the background memory writer ran.
    pub load: bool,
    /// Datagram size of the loss and zero-loss-rate measurements, bytes.
    pub loss_bytes: u64,
    /// Paths asked for (after `--paths`).
    pub paths_requested: Vec<String>,
}

/// memcpy measurements.
#[derive(Debug, Clone, Serialize)]
pub struct MemcpyOut {
    /// At the start of the run.
    pub start: Memcpy,
    /// At the end of the run.
    pub end: Option<Memcpy>,
    /// A buffer that stays in cache (L2), for context: a path whose working set stays in
    /// cache (a 1 MiB fabric ring) can beat the out-of-cache reference, i.e. a ratio above 1.
    pub in_cache: Memcpy,
    /// The reference used for ratios: the better of start and end, MB/s.
    pub reference_mb_per_s: f64,
    /// µs per byte of one copy at the reference bandwidth.
    pub slope_us_per_byte: f64,
}

/// State of one path.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    /// Every point measured.
    Measured,
    /// Some points measured, then it failed (see `reason`).
    Partial,
    /// Nothing measured: it failed (see `reason`).
    Failed,
    /// Not run here (see `reason`: a missing tool, no root, ...).
    Skipped,
    /// The path does not exist in backplane yet.
    NotAvailable,
}

/// One path's results.
#[derive(Debug, Clone, Serialize)]
pub struct PathReport {
    /// Path name (as `--paths` takes it).
    pub name: String,
    /// What it is.
    pub title: String,
    /// "datagram", "stream" or "ucx".
    pub kind: String,
    /// Measured, partial, failed, skipped or not-available.
    pub status: Status,
    /// Why it is not fully measured.
    pub reason: Option<String>,
    /// Copies of the payload one message costs on this path (for the expected latency slope).
    pub copies: f64,
    /// Throughput over the size sweep.
    pub throughput: Vec<ThroughputPoint>,
    /// Ping-pong latency over the size sweep.
    pub latency: Vec<LatencyPoint>,
    /// Least-squares fit of median latency against size.
    pub latency_fit: Option<FitOut>,
    /// Loss against offered rate, and the highest zero-loss rate (datagram paths).
    pub loss: Option<LossReport>,
    /// Sizes of the sweep this path cannot carry (not measured, "n/a" in the tables).
    pub not_applicable: Vec<NotApplicable>,
    /// Remarks specific to this path.
    pub notes: Vec<String>,
}

/// A size of the sweep a path cannot carry.
#[derive(Debug, Clone, Serialize)]
pub struct NotApplicable {
    /// Message size.
    pub bytes: u64,
    /// Why the path cannot carry it.
    pub reason: String,
}

impl PathReport {
    /// A path with no results yet.
    pub fn new(name: &str, title: &str, kind: &str, copies: f64) -> Self {
        PathReport {
            name: name.into(),
            title: title.into(),
            kind: kind.into(),
            status: Status::Measured,
            reason: None,
            copies,
            throughput: Vec::new(),
            latency: Vec::new(),
            latency_fit: None,
            loss: None,
            not_applicable: Vec::new(),
            notes: Vec::new(),
        }
    }
}

/// Throughput at one message size.
#[derive(Debug, Clone, Serialize, Default)]
pub struct ThroughputPoint {
    /// Message size.
    pub bytes: u64,
    /// Runs averaged.
    pub repeats: usize,
    /// Received payload per second (goodput), mean over runs.
    pub mb_per_s: f64,
    /// 95 % confidence interval of `mb_per_s` over runs ([mean, mean] for one run).
    pub mb_per_s_ci95: [f64; 2],
    /// Messages per second received.
    pub msgs_per_s: f64,
    /// `mb_per_s` / memcpy reference.
    pub ratio_to_memcpy: f64,
    /// Sending side's CPU, percent of one processor (getrusage of its thread or process).
    pub client_cpu: SideCpu,
    /// Receiving side's CPU, percent of one processor (getrusage of the peer process).
    pub server_cpu: SideCpu,
    /// The whole machine over the point (/proc/stat; includes whatever else ran).
    pub machine_cpu: Option<MachineCpu>,
    /// CPU time of both sides per MB moved, µs/MB.
    pub service_demand_us_per_mb: f64,
    /// Busy time of the whole machine per MB moved, µs/MB.
    pub machine_service_demand_us_per_mb: Option<f64>,
    /// Datagram paths: datagrams sent, over the whole point (warm-up included).
    pub sent_dgrams: Option<u64>,
    /// Datagram paths: datagrams lost.
    pub lost_dgrams: Option<u64>,
    /// Datagram paths: lost / sent, percent.
    pub loss_pct: Option<f64>,
    /// Datagram paths: duplicates received.
    pub duplicates: Option<u64>,
    /// Datagram paths: datagrams received after a later one.
    pub reordered: Option<u64>,
}

/// Latency at one message size. One-way = round trip / 2, as perftest reports it.
#[derive(Debug, Clone, Serialize, Default)]
pub struct LatencyPoint {
    /// Message size.
    pub bytes: u64,
    /// Runs merged.
    pub repeats: usize,
    /// Round trips recorded (after warm-up).
    pub samples: u64,
    /// Round trips that never completed (datagram loss), over all runs.
    pub lost: u64,
    /// Median one-way latency.
    pub p50_us: f64,
    /// 95 % confidence interval of the median over runs.
    pub p50_ci95_us: [f64; 2],
    /// Mean.
    pub mean_us: f64,
    /// Minimum (absent where the tool does not give the distribution, as for UCX).
    pub min_us: Option<f64>,
    /// 90th percentile.
    pub p90_us: Option<f64>,
    /// 99th percentile.
    pub p99_us: Option<f64>,
    /// 99.9th percentile.
    pub p999_us: Option<f64>,
    /// 99.99th percentile.
    pub p9999_us: Option<f64>,
    /// Maximum.
    pub max_us: Option<f64>,
    /// Jitter: full width at half maximum of the latency histogram.
    pub jitter_fwhm_us: Option<f64>,
}

/// Latency against size, fitted, next to what memcpy predicts.
#[derive(Debug, Clone, Serialize)]
pub struct FitOut {
    /// Latency at size 0, µs.
    pub intercept_us: f64,
    /// µs per byte.
    pub slope_us_per_byte: f64,
    /// Coefficient of determination.
    pub r2: f64,
    /// Sizes fitted.
    pub points: usize,
    /// One memcpy's µs per byte in this run.
    pub memcpy_slope_us_per_byte: f64,
    /// `copies` × memcpy slope: the slope if copying were the only cost.
    pub expected_slope_us_per_byte: f64,
    /// Measured slope / memcpy slope: how many memcpys one byte costs.
    pub memcpy_equivalents: f64,
}

impl FitOut {
    /// From a fit of µs against bytes.
    pub fn new(f: LineFit, memcpy_slope: f64, copies: f64) -> Self {
        FitOut {
            intercept_us: f.intercept,
            slope_us_per_byte: f.slope,
            r2: f.r2,
            points: f.points,
            memcpy_slope_us_per_byte: memcpy_slope,
            expected_slope_us_per_byte: copies * memcpy_slope,
            memcpy_equivalents: f.slope / memcpy_slope,
        }
    }
}

/// One loss trial at an offered rate.
#[derive(Debug, Clone, Serialize)]
pub struct LossTrial {
    /// Rate asked for, datagrams/s (`null`: as fast as the sender can).
    pub target_msgs_per_s: Option<f64>,
    /// Rate actually offered, datagrams/s.
    pub offered_msgs_per_s: f64,
    /// Offered, MB/s.
    pub offered_mb_per_s: f64,
    /// Datagrams offered.
    pub offered: u64,
    /// Offered but refused by the sender side without waiting (full ring or socket buffer).
    pub not_accepted: u64,
    /// Accepted and never received.
    pub lost: u64,
    /// Received more than once.
    pub duplicates: u64,
    /// Received after a later one.
    pub reordered: u64,
    /// Received (distinct).
    pub received: u64,
    /// (not accepted + lost) / offered, percent.
    pub loss_pct: f64,
}

impl LossTrial {
    /// Whether nothing offered went missing.
    pub fn zero_loss(&self) -> bool {
        self.not_accepted == 0 && self.lost == 0 && self.offered > 0
    }
}

/// Loss against offered rate, and an RFC 2544-style search for the highest zero-loss rate.
#[derive(Debug, Clone, Serialize)]
pub struct LossReport {
    /// Datagram size, bytes.
    pub bytes: u64,
    /// Received rate when offering as fast as possible, datagrams/s.
    pub capacity_msgs_per_s: f64,
    /// Trials at fractions of that capacity.
    pub sweep: Vec<LossTrial>,
    /// The binary search's trials, in order.
    pub search: Vec<LossTrial>,
    /// Highest offered rate with zero loss, datagrams/s.
    pub zero_loss_msgs_per_s: Option<f64>,
    /// The same in MB/s.
    pub zero_loss_mb_per_s: Option<f64>,
    /// How loss is counted on this path.
    pub method: String,
}

/// The emulated link model of a run, as the model predicts it.
#[derive(Debug, Clone, Serialize)]
pub struct LinkModelOut {
    /// Model name, e.g. `pcie-gen3x4`.
    pub model: String,
    /// Effective payload bandwidth per direction, MB/s.
    pub effective_mb_per_s: f64,
    /// Expected latency slope (1 / effective bandwidth), µs per byte.
    pub latency_slope_us_per_byte: f64,
    /// Per-hop latency of the switch (cut-through), ns.
    pub hop_ns: f64,
}

impl LinkModelOut {
    /// What the model named `name` predicts.
    pub fn new(name: &str) -> anyhow::Result<Self> {
        let m: backplane::model::LinkModel = name.parse()?;
        Ok(Self {
            model: name.to_ascii_lowercase(),
            effective_mb_per_s: m.effective_bandwidth_bytes_per_s() / 1e6,
            latency_slope_us_per_byte: m.latency_slope_us_per_byte(),
            hop_ns: m
                .per_hop_latency(backplane::model::Forwarding::CutThrough)
                .ns,
        })
    }
}

/// One row of the summary table.
#[derive(Debug, Clone, Serialize)]
pub struct SummaryRow {
    /// Path name.
    pub path: String,
    /// Highest throughput over the sweep, MB/s.
    pub sustained_mb_per_s: f64,
    /// At which size.
    pub at_bytes: u64,
    /// CPU load of both sides at that point, percent of one processor.
    pub cpu_pct: f64,
    /// Service demand at that point, µs of CPU per MB.
    pub service_demand_us_per_mb: f64,
    /// Median one-way latency at the smallest size, µs.
    pub latency_us: Option<f64>,
    /// The smallest size.
    pub latency_bytes: Option<u64>,
    /// Sustained bandwidth / single-thread memcpy bandwidth.
    pub ratio_to_memcpy: f64,
    /// Highest zero-loss rate, MB/s (datagram paths).
    pub zero_loss_mb_per_s: Option<f64>,
    /// Measured latency slope, µs per byte (from the least-squares fit).
    pub slope_us_per_byte: Option<f64>,
    /// With `--link`: the model's effective bandwidth, MB/s (fabric paths).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_mb_per_s: Option<f64>,
    /// With `--link`: the model's expected latency slope, µs per byte (fabric paths).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_slope_us_per_byte: Option<f64>,
}

/// Something asked for and not measured.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Skip {
    /// What (a path name, a size, a measurement).
    pub what: String,
    /// Why.
    pub reason: String,
}

/// Builds the summary rows from the paths.
pub fn summarize(paths: &[PathReport]) -> Vec<SummaryRow> {
    paths
        .iter()
        .filter_map(|p| {
            let best = p
                .throughput
                .iter()
                .max_by(|a, b| a.mb_per_s.total_cmp(&b.mb_per_s))?;
            let lat = p.latency.iter().find(|l| l.samples > 0 || l.p50_us > 0.0);
            Some(SummaryRow {
                path: p.name.clone(),
                sustained_mb_per_s: best.mb_per_s,
                at_bytes: best.bytes,
                cpu_pct: best.client_cpu.total_pct() + best.server_cpu.total_pct(),
                service_demand_us_per_mb: best.service_demand_us_per_mb,
                latency_us: lat.map(|l| l.p50_us),
                latency_bytes: lat.map(|l| l.bytes),
                ratio_to_memcpy: best.ratio_to_memcpy,
                zero_loss_mb_per_s: p.loss.as_ref().and_then(|l| l.zero_loss_mb_per_s),
                slope_us_per_byte: p.latency_fit.as_ref().map(|f| f.slope_us_per_byte),
                model_mb_per_s: None,
                model_slope_us_per_byte: None,
            })
        })
        .collect()
}

/// Formats a byte count: 64 B, 4 KiB, 8 MiB.
pub fn human_bytes(n: u64) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

/// A figure with as many decimals as its size needs: 4400, 22.0, 0.0028.
fn num(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.5}")
    }
}

fn opt(x: Option<f64>, prec: usize) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{v:.prec$}"))
}

/// The summary table's columns: the terminal's short heading and the Markdown one.
const SUMMARY_HEADERS: [(&str, &str); 8] = [
    ("PATH", "path"),
    ("SUSTAINED MB/s", "sustained bandwidth (MB/s)"),
    ("AT", "at size"),
    ("CPU %", "CPU load (% of one CPU, both sides)"),
    ("CPU us/MB", "service demand (µs CPU/MB)"),
    ("LATENCY p50 us", "latency p50 (µs, one-way)"),
    ("/MEMCPY", "bandwidth / memcpy"),
    ("0-LOSS MB/s", "zero-loss rate (MB/s)"),
];

/// The summary table's cells, one row per summarised path, in [`SUMMARY_HEADERS`] order: the
/// terminal and the Markdown summary show the same columns from the same strings.
fn summary_cells(r: &Report) -> Vec<Vec<String>> {
    r.summary
        .iter()
        .map(|s| {
            let lat = match (s.latency_us, s.latency_bytes) {
                (Some(l), Some(b)) => format!("{l:.2} at {}", human_bytes(b)),
                _ => "-".into(),
            };
            vec![
                s.path.clone(),
                format!("{:.0}", s.sustained_mb_per_s),
                human_bytes(s.at_bytes),
                format!("{:.0}", s.cpu_pct),
                format!("{:.1}", s.service_demand_us_per_mb),
                lat,
                format!("{:.2}", s.ratio_to_memcpy),
                opt(s.zero_loss_mb_per_s, 0),
            ]
        })
        .collect()
}

/// A plain-text table whose columns are as wide as their widest cell: the first column left
/// aligned (names), the others right aligned (numbers), two spaces between columns.
pub fn aligned(headers: &[&str], rows: &[Vec<String>]) -> String {
    let width = |c: &str| c.chars().count();
    let mut w: Vec<usize> = headers.iter().map(|h| width(h)).collect();
    for row in rows {
        for (i, c) in row.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(width(c));
            }
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, c) in cells.enumerate().take(w.len()) {
            let pad = " ".repeat(w[i] - width(c));
            if i == 0 {
                l += c;
                l += &pad;
            } else {
                l += "  ";
                l += &pad;
                l += c;
            }
        }
        l.truncate(l.trim_end().len());
        l + "\n"
    };
    let mut o = line(&mut headers.iter().copied());
    for row in rows {
        o += &line(&mut row.iter().map(String::as_str));
    }
    o
}

/// A Markdown table of one figure per (size, path): `cell` gives the figure where the path
/// measured that size; a size the path cannot carry reads "n/a", one it did not reach "-".
/// Notes under the table say why each "n/a" is one.
fn size_grid(r: &Report, title: &str, cell: impl Fn(&PathReport, u64) -> Option<String>) -> String {
    let paths: Vec<&PathReport> = r
        .paths
        .iter()
        .filter(|p| !p.throughput.is_empty() || !p.latency.is_empty())
        .collect();
    let mut o = String::new();
    if paths.is_empty() {
        return o;
    }
    let _ = writeln!(o, "## {title}\n");
    let names: Vec<&str> = paths.iter().map(|p| p.name.as_str()).collect();
    let _ = writeln!(o, "| size | {} |", names.join(" | "));
    let _ = writeln!(o, "| ---: |{}", " ---: |".repeat(paths.len()));
    let mut why: Vec<(String, String)> = Vec::new();
    for &b in &r.config.sizes {
        let cells: Vec<String> = paths
            .iter()
            .map(|p| {
                if let Some(v) = cell(p, b) {
                    v
                } else if let Some(na) = p.not_applicable.iter().find(|n| n.bytes == b) {
                    if !why.iter().any(|(n, _)| *n == p.name) {
                        why.push((p.name.clone(), na.reason.clone()));
                    }
                    "n/a".into()
                } else {
                    "-".into()
                }
            })
            .collect();
        let _ = writeln!(o, "| {} | {} |", human_bytes(b), cells.join(" | "));
    }
    let _ = writeln!(o);
    for (name, reason) in why {
        let _ = writeln!(o, "n/a on {name}: {reason}.  ");
    }
    let _ = writeln!(o);
    o
}

/// The summary table as plain text (what the command prints).
pub fn summary_text(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "memcpy (single thread, {}): {:.0} MB/s — the physical limit the ratios refer to \
         ({:.0} MB/s in cache)",
        human_bytes(r.memcpy.start.bytes),
        r.memcpy.reference_mb_per_s,
        r.memcpy.in_cache.mb_per_s
    );
    o += &aligned(&SUMMARY_HEADERS.map(|(t, _)| t), &summary_cells(r));
    if let Some(m) = &r.link_model {
        let _ = writeln!(
            o,
            "link model {}: {:.0} MB/s effective, latency slope {:.6} us/B, hop {:.0} ns",
            m.model, m.effective_mb_per_s, m.latency_slope_us_per_byte, m.hop_ns
        );
        for s in r.summary.iter().filter(|s| s.model_mb_per_s.is_some()) {
            let _ = writeln!(
                o,
                "  {:<12} measured {:.0} MB/s = {:.2} x model; slope {} us/B vs model {:.6}",
                s.path,
                s.sustained_mb_per_s,
                s.sustained_mb_per_s / m.effective_mb_per_s,
                opt(s.slope_us_per_byte, 6),
                m.latency_slope_us_per_byte
            );
        }
    }
    if !r.published.is_empty() {
        let _ = writeln!(
            o,
            "published figures for {} (the seeds' hardware) beside this run:",
            r.published[0].link
        );
        for x in &r.published {
            let _ = writeln!(
                o,
                "  {}: published {} {}, here {}",
                x.what,
                num(x.published),
                x.unit,
                x.measured.map_or_else(
                    || format!(
                        "not measured ({})",
                        x.not_measured.as_deref().unwrap_or("-")
                    ),
                    |m| format!("{} ({:.2}x) on {}", num(m), m / x.published, x.path)
                )
            );
        }
    }
    for p in &r.paths {
        if p.status != Status::Measured {
            let _ = writeln!(
                o,
                "{:<14} {}: {}",
                p.name,
                status_word(p.status),
                p.reason.as_deref().unwrap_or("")
            );
        }
    }
    for s in &r.skipped {
        if !r.paths.iter().any(|p| p.name == s.what) {
            let _ = writeln!(o, "skipped {}: {}", s.what, s.reason);
        }
    }
    o
}

fn status_word(s: Status) -> &'static str {
    match s {
        Status::Measured => "measured",
        Status::Partial => "partly measured",
        Status::Failed => "failed",
        Status::Skipped => "skipped",
        Status::NotAvailable => "not available yet",
    }
}

/// Rows as CSV with a header named after the row's fields (empty when there are no rows).
/// Figures are rounded to what the measurement supports.
fn to_csv<R: Serialize>(rows: impl IntoIterator<Item = R>) -> String {
    let mut w = csv::Writer::from_writer(Vec::new());
    for row in rows {
        // Names and numbers into memory: nothing can fail.
        w.serialize(row).expect("a CSV row in memory");
    }
    String::from_utf8(w.into_inner().expect("CSV in memory")).expect("CSV of UTF-8 fields")
}

/// `x` rounded to `digits` decimals.
fn round(x: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (x * m).round() / m
}

#[derive(Serialize)]
struct ThroughputCsv<'a> {
    path: &'a str,
    bytes: u64,
    repeats: usize,
    mb_per_s: f64,
    mb_per_s_ci95_low: f64,
    mb_per_s_ci95_high: f64,
    msgs_per_s: f64,
    ratio_to_memcpy: f64,
    client_user_pct: f64,
    client_system_pct: f64,
    server_user_pct: f64,
    server_system_pct: f64,
    machine_user_pct: Option<f64>,
    machine_system_pct: Option<f64>,
    machine_irq_pct: Option<f64>,
    machine_softirq_pct: Option<f64>,
    service_demand_us_per_mb: f64,
    machine_service_demand_us_per_mb: Option<f64>,
    sent_dgrams: Option<u64>,
    lost_dgrams: Option<u64>,
    loss_pct: Option<f64>,
    duplicates: Option<u64>,
    reordered: Option<u64>,
}

/// The throughput table as CSV.
pub fn throughput_csv(r: &Report) -> String {
    let r4 = |x: Option<f64>| x.map(|v| round(v, 4));
    to_csv(r.paths.iter().flat_map(|p| {
        p.throughput.iter().map(move |t| {
            let m = t.machine_cpu;
            ThroughputCsv {
                path: &p.name,
                bytes: t.bytes,
                repeats: t.repeats,
                mb_per_s: round(t.mb_per_s, 3),
                mb_per_s_ci95_low: round(t.mb_per_s_ci95[0], 3),
                mb_per_s_ci95_high: round(t.mb_per_s_ci95[1], 3),
                msgs_per_s: round(t.msgs_per_s, 1),
                ratio_to_memcpy: round(t.ratio_to_memcpy, 5),
                client_user_pct: round(t.client_cpu.user_pct, 2),
                client_system_pct: round(t.client_cpu.system_pct, 2),
                server_user_pct: round(t.server_cpu.user_pct, 2),
                server_system_pct: round(t.server_cpu.system_pct, 2),
                machine_user_pct: r4(m.map(|m| m.user_pct)),
                machine_system_pct: r4(m.map(|m| m.system_pct)),
                machine_irq_pct: r4(m.map(|m| m.irq_pct)),
                machine_softirq_pct: r4(m.map(|m| m.softirq_pct)),
                service_demand_us_per_mb: round(t.service_demand_us_per_mb, 3),
                machine_service_demand_us_per_mb: r4(t.machine_service_demand_us_per_mb),
                sent_dgrams: t.sent_dgrams,
                lost_dgrams: t.lost_dgrams,
                loss_pct: r4(t.loss_pct),
                duplicates: t.duplicates,
                reordered: t.reordered,
            }
        })
    }))
}

#[derive(Serialize)]
struct LatencyCsv<'a> {
    path: &'a str,
    bytes: u64,
    repeats: usize,
    samples: u64,
    lost: u64,
    min_us: Option<f64>,
    p50_us: f64,
    p50_ci95_low_us: f64,
    p50_ci95_high_us: f64,
    p90_us: Option<f64>,
    p99_us: Option<f64>,
    p999_us: Option<f64>,
    p9999_us: Option<f64>,
    max_us: Option<f64>,
    mean_us: f64,
    jitter_fwhm_us: Option<f64>,
}

/// The latency table as CSV.
pub fn latency_csv(r: &Report) -> String {
    let r3 = |x: Option<f64>| x.map(|v| round(v, 3));
    to_csv(r.paths.iter().flat_map(|p| {
        p.latency.iter().map(move |l| LatencyCsv {
            path: &p.name,
            bytes: l.bytes,
            repeats: l.repeats,
            samples: l.samples,
            lost: l.lost,
            min_us: r3(l.min_us),
            p50_us: round(l.p50_us, 3),
            p50_ci95_low_us: round(l.p50_ci95_us[0], 3),
            p50_ci95_high_us: round(l.p50_ci95_us[1], 3),
            p90_us: r3(l.p90_us),
            p99_us: r3(l.p99_us),
            p999_us: r3(l.p999_us),
            p9999_us: r3(l.p9999_us),
            max_us: r3(l.max_us),
            mean_us: round(l.mean_us, 3),
            jitter_fwhm_us: r3(l.jitter_fwhm_us),
        })
    }))
}

#[derive(Serialize)]
struct LossCsv<'a> {
    path: &'a str,
    bytes: u64,
    phase: &'static str,
    target_msgs_per_s: Option<f64>,
    offered_msgs_per_s: f64,
    offered_mb_per_s: f64,
    offered: u64,
    not_accepted: u64,
    lost: u64,
    duplicates: u64,
    reordered: u64,
    received: u64,
    loss_pct: f64,
}

/// The loss trials as CSV.
pub fn loss_csv(r: &Report) -> String {
    to_csv(r.paths.iter().flat_map(|p| {
        p.loss.iter().flat_map(move |l| {
            [("sweep", &l.sweep), ("search", &l.search)]
                .into_iter()
                .flat_map(move |(phase, trials)| {
                    trials.iter().map(move |t| LossCsv {
                        path: &p.name,
                        bytes: l.bytes,
                        phase,
                        target_msgs_per_s: t.target_msgs_per_s.map(|v| round(v, 1)),
                        offered_msgs_per_s: round(t.offered_msgs_per_s, 1),
                        offered_mb_per_s: round(t.offered_mb_per_s, 3),
                        offered: t.offered,
                        not_accepted: t.not_accepted,
                        lost: t.lost,
                        duplicates: t.duplicates,
                        reordered: t.reordered,
                        received: t.received,
                        loss_pct: round(t.loss_pct, 4),
                    })
                })
        })
    }))
}

/// The Markdown summary, embedding the plots written beside it.
pub fn markdown(r: &Report, plots: &[(String, String)]) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# backplane bench — {}\n", r.started_utc);
    let _ = writeln!(
        o,
        "{} processors ({}), kernel {}. {} sizes from {} to {}, {:.2} s per point after {:.2} s \
         of warm-up, {} run(s) per point{}. The whole run took {:.0} s.\n",
        r.host.cpus,
        r.host.cpu_model,
        r.host.kernel,
        r.config.sizes.len(),
        human_bytes(*r.config.sizes.first().unwrap_or(&0)),
        human_bytes(*r.config.sizes.last().unwrap_or(&0)),
        r.config.duration_s,
        r.config.warmup_s,
        r.config.repeat,
        if r.config.load {
            ", with a background memory writer (--load)"
        } else {
            ""
        },
        r.elapsed_s
    );
    let _ = writeln!(
        o,
        "Physical limit: single-thread memcpy of {} at **{:.0} MB/s** (start {:.0}, end {}), \
         i.e. {:.6} µs/byte per copy. In cache ({}) memcpy runs at {:.0} MB/s: a path whose \
         working set stays in cache can exceed a ratio of 1.\n",
        human_bytes(r.memcpy.start.bytes),
        r.memcpy.reference_mb_per_s,
        r.memcpy.start.mb_per_s,
        r.memcpy
            .end
            .map_or("-".into(), |m| format!("{:.0}", m.mb_per_s)),
        r.memcpy.slope_us_per_byte,
        human_bytes(r.memcpy.in_cache.bytes),
        r.memcpy.in_cache.mb_per_s
    );
    let _ = writeln!(o, "## Summary\n");
    let _ = writeln!(o, "| {} |", SUMMARY_HEADERS.map(|(_, md)| md).join(" | "));
    let _ = writeln!(o, "| --- |{}", " ---: |".repeat(SUMMARY_HEADERS.len() - 1));
    for row in summary_cells(r) {
        let _ = writeln!(o, "| {} |", row.join(" | "));
    }
    let _ = writeln!(o);
    let _ = writeln!(o, "## Paths\n");
    let _ = writeln!(o, "| path | what | status |");
    let _ = writeln!(o, "| --- | --- | --- |");
    for p in &r.paths {
        let st = match &p.reason {
            Some(why) => format!("{}: {why}", status_word(p.status)),
            None => status_word(p.status).to_string(),
        };
        let _ = writeln!(o, "| {} | {} | {} |", p.name, p.title, st);
    }
    let _ = writeln!(o);
    if !r.skipped.is_empty() {
        let _ = writeln!(o, "## Skipped\n");
        for s in &r.skipped {
            let _ = writeln!(o, "- **{}**: {}", s.what, s.reason);
        }
        let _ = writeln!(o);
    }
    o += &size_grid(r, "Throughput by size (MB/s)", |p, b| {
        p.throughput
            .iter()
            .find(|t| t.bytes == b)
            .map(|t| format!("{:.0}", t.mb_per_s))
    });
    o += &size_grid(r, "Median one-way latency by size (µs)", |p, b| {
        p.latency
            .iter()
            .find(|l| l.bytes == b && l.p50_us > 0.0)
            .map(|l| format!("{:.2}", l.p50_us))
    });
    if !r.published.is_empty() {
        let _ = writeln!(
            o,
            "## Published figures for {}\n\nWhat the seed documents measured on this link's \
             hardware, beside what this run measured on the emulated link and what the link \
             model predicts. Each row names its source; `data/published.toml` in the \
             backplane-bench crate holds them all.\n",
            r.published[0].link
        );
        let _ = writeln!(
            o,
            "| published figure | published | here (path) | here / published | model | source | note |"
        );
        let _ = writeln!(o, "| --- | ---: | --- | ---: | ---: | --- | --- |");
        for x in &r.published {
            let _ = writeln!(
                o,
                "| {} | {} {} | {} | {} | {} | {} | {} |",
                x.what,
                num(x.published),
                x.unit,
                x.measured.map_or_else(
                    || format!("not measured: {}", x.not_measured.as_deref().unwrap_or("-")),
                    |m| format!("{} ({})", num(m), x.path)
                ),
                opt(x.ratio, 2),
                x.model.map_or("-".into(), num),
                x.source,
                x.note.as_deref().unwrap_or("")
            );
        }
        let _ = writeln!(o);
    }
    let _ = writeln!(o, "## Plots\n");
    for (title, file) in plots {
        let _ = writeln!(o, "### {title}\n\n![{title}]({file})\n");
    }
    let fits: Vec<_> = r
        .paths
        .iter()
        .filter_map(|p| p.latency_fit.as_ref().map(|f| (p, f)))
        .collect();
    if !fits.is_empty() {
        let _ = writeln!(o, "## Latency slope\n");
        let _ = writeln!(
            o,
            "Least-squares fit of the median one-way latency against message size, next to the \
             slope copying alone would give (copies per message × one memcpy's µs/byte).\n"
        );
        let _ = writeln!(
            o,
            "| path | intercept (µs) | slope (µs/byte) | r² | copies | expected slope (µs/byte) | memcpy equivalents |"
        );
        let _ = writeln!(o, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
        for (p, f) in fits {
            let _ = writeln!(
                o,
                "| {} | {:.2} | {:.6} | {:.3} | {} | {:.6} | {:.2} |",
                p.name,
                f.intercept_us,
                f.slope_us_per_byte,
                f.r2,
                p.copies,
                f.expected_slope_us_per_byte,
                f.memcpy_equivalents
            );
        }
        let _ = writeln!(o);
    }
    let _ = writeln!(o, "## Latency distribution\n");
    let _ = writeln!(
        o,
        "| path | size | samples | lost | min | p50 | p90 | p99 | p99.9 | p99.99 | max | jitter (FWHM) |"
    );
    let _ = writeln!(
        o,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for p in &r.paths {
        for l in &p.latency {
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {:.2} | {} | {} | {} | {} | {} | {} |",
                p.name,
                human_bytes(l.bytes),
                l.samples,
                l.lost,
                opt(l.min_us, 2),
                l.p50_us,
                opt(l.p90_us, 2),
                opt(l.p99_us, 2),
                opt(l.p999_us, 2),
                opt(l.p9999_us, 2),
                opt(l.max_us, 2),
                opt(l.jitter_fwhm_us, 2)
            );
        }
    }
    let _ = writeln!(o, "\nAll latencies in µs, one-way (round trip / 2).\n");
    let losses: Vec<_> = r
        .paths
        .iter()
        .filter_map(|p| p.loss.as_ref().map(|l| (p, l)))
        .collect();
    if !losses.is_empty() {
        let _ = writeln!(o, "## Loss and zero-loss rate\n");
        for (p, l) in losses {
            let _ = writeln!(
                o,
                "**{}** ({} datagrams; capacity {:.0} datagrams/s). {}\n",
                p.name,
                human_bytes(l.bytes),
                l.capacity_msgs_per_s,
                l.method
            );
            let _ = writeln!(
                o,
                "| offered (datagrams/s) | offered (MB/s) | not accepted | lost | duplicates | reordered | loss % |"
            );
            let _ = writeln!(o, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
            for t in l.sweep.iter().chain(&l.search) {
                let _ = writeln!(
                    o,
                    "| {:.0} | {:.1} | {} | {} | {} | {} | {:.3} |",
                    t.offered_msgs_per_s,
                    t.offered_mb_per_s,
                    t.not_accepted,
                    t.lost,
                    t.duplicates,
                    t.reordered,
                    t.loss_pct
                );
            }
            let _ = writeln!(
                o,
                "\nHighest zero-loss rate (RFC 2544-style binary search): {}\n",
                match (l.zero_loss_msgs_per_s, l.zero_loss_mb_per_s) {
                    (Some(m), Some(b)) => format!("**{m:.0} datagrams/s = {b:.1} MB/s**"),
                    _ => "none found (loss even at the lowest rate tried)".into(),
                }
            );
        }
    }
    let notes: Vec<String> = r
        .notes
        .iter()
        .cloned()
        .chain(
            r.paths
                .iter()
                .flat_map(|p| p.notes.iter().map(move |n| format!("{}: {n}", p.name))),
        )
        .collect();
    if !notes.is_empty() {
        let _ = writeln!(o, "## Notes\n");
        for n in notes {
            let _ = writeln!(o, "- {n}");
        }
        let _ = writeln!(o);
    }
    let _ = writeln!(
        o,
        "Files: `report.json` (everything, version {}), `throughput.csv`, `latency.csv`, `loss.csv`, and each plot as SVG and PNG.",
        r.version
    );
    o
}

/// Writes `report.json`, the CSV tables, the plots and `summary.md` into `dir`.
pub fn write_all(r: &Report, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let w = |name: &str, data: &[u8]| {
        std::fs::write(dir.join(name), data)
            .with_context(|| format!("cannot write {}", dir.join(name).display()))
    };
    w("report.json", &serde_json::to_vec_pretty(r)?)?;
    w("throughput.csv", throughput_csv(r).as_bytes())?;
    w("latency.csv", latency_csv(r).as_bytes())?;
    w("loss.csv", loss_csv(r).as_bytes())?;
    let plots = crate::plot::write_plots(r, dir)?;
    w("summary.md", markdown(r, &plots).as_bytes())?;
    Ok(())
}

/// UTC time as RFC 3339 (`2025-01-31T12:34:56Z`) and as a folder name (`20250131-123456`).
pub fn utc_now() -> (String, String) {
    let rfc = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    (rfc.clone(), folder_name(&rfc))
}

/// `2025-01-31T12:34:56Z` → `20250131-123456`.
fn folder_name(rfc3339: &str) -> String {
    let (date, time) = rfc3339.split_once('T').unwrap_or((rfc3339, ""));
    let keep = |s: &str| s.chars().filter(char::is_ascii_digit).collect::<String>();
    format!("{}-{}", keep(date), keep(time))
}

/// The machine's description.
pub fn host() -> Host {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    Host {
        cpus: std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1),
        cpu_model,
        kernel,
    }
}

/// Synthetic reports for the tests of this crate's formatting and plots.
#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    /// A report over sizes 64 B, 4 KiB and 1 MiB in which every path measured 10 MB/s × size
    /// in KiB and 1 µs × size in KiB, except that paths named `udp-*` cannot carry 1 MiB.
    pub(crate) fn report_with_paths(names: &[&str]) -> Report {
        let sizes = vec![64u64, 4096, 1 << 20];
        let mc = Memcpy {
            bytes: 64 << 20,
            mb_per_s: 10_000.0,
            median_mb_per_s: 9_900.0,
            slope_us_per_byte: 1e-4,
        };
        let paths: Vec<PathReport> = names
            .iter()
            .map(|&n| {
                let mut p = PathReport::new(n, n, "stream", 1.0);
                for &b in &sizes {
                    if n.starts_with("udp") && b > 65507 {
                        p.not_applicable.push(NotApplicable {
                            bytes: b,
                            reason: "larger than the largest UDP datagram".into(),
                        });
                        continue;
                    }
                    let kib = (b as f64 / 1024.0).max(1.0);
                    p.throughput.push(ThroughputPoint {
                        bytes: b,
                        repeats: 1,
                        mb_per_s: 10.0 * kib,
                        ratio_to_memcpy: 10.0 * kib / 10_000.0,
                        ..ThroughputPoint::default()
                    });
                    p.latency.push(LatencyPoint {
                        bytes: b,
                        repeats: 1,
                        samples: 100,
                        p50_us: kib,
                        ..LatencyPoint::default()
                    });
                }
                p
            })
            .collect();
        Report {
            version: VERSION,
            tool: "backplane bench".into(),
            backplane_version: "test".into(),
            started_utc: "2026-01-01T00:00:00Z".into(),
            elapsed_s: 1.0,
            host: Host::default(),
            config: ConfigOut {
                sizes,
                duration_s: 0.1,
                warmup_s: 0.02,
                repeat: 1,
                load: false,
                loss_bytes: 1024,
                paths_requested: names.iter().map(|n| n.to_string()).collect(),
            },
            memcpy: MemcpyOut {
                start: mc,
                end: Some(Memcpy {
                    mb_per_s: 11_000.0,
                    ..mc
                }),
                in_cache: mc,
                reference_mb_per_s: 11_000.0,
                slope_us_per_byte: 1e-4,
            },
            summary: summarize(&paths),
            published: Vec::new(),
            paths,
            link_model: None,
            skipped: Vec::new(),
            notes: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc_3339_and_folder_names_follow_them() {
        assert_eq!(folder_name("2024-12-31T23:59:59Z"), "20241231-235959");
        let (rfc, folder) = utc_now();
        assert_eq!(rfc.len(), 20, "{rfc}");
        assert!(rfc.ends_with('Z') && rfc.as_bytes()[10] == b'T', "{rfc}");
        assert_eq!(folder, folder_name(&rfc));
    }

    #[test]
    fn csv_tables_have_named_columns_and_empty_fields_for_what_was_not_measured() {
        let r = tests_support::report_with_paths(&["fabric-dgram", "udp-veth"]);
        let t = throughput_csv(&r);
        let mut lines = t.lines();
        let head = lines.next().unwrap();
        assert!(
            head.starts_with("path,bytes,repeats,mb_per_s,mb_per_s_ci95_low,"),
            "{head}"
        );
        assert!(head.ends_with(",loss_pct,duplicates,reordered"), "{head}");
        let row = lines.next().unwrap();
        assert!(row.starts_with("fabric-dgram,64,1,10.0,"), "{row}");
        assert!(
            row.ends_with(",,,,,"),
            "no datagram counts on this path: {row}"
        );
        assert_eq!(t.lines().count(), 1 + 3 + 2, "{t}");
        let l = latency_csv(&r);
        assert!(l.contains("\nudp-veth,4096,1,100,0,,4.0,"), "{l}");
        assert!(loss_csv(&r).is_empty());
    }

    #[test]
    fn byte_counts_read_like_sizes() {
        assert_eq!(human_bytes(64), "64 B");
        assert_eq!(human_bytes(4096), "4 KiB");
        assert_eq!(human_bytes(8 << 20), "8 MiB");
        assert_eq!(human_bytes(1000), "1000 B");
    }

    #[test]
    fn a_long_path_name_does_not_push_the_columns_of_the_terminal_table() {
        let rows = vec![
            vec!["fabric-verbs-write".into(), "31000".into(), "1 MiB".into()],
            vec!["tcp".into(), "2".into(), "64 B".into()],
        ];
        let t = aligned(&["PATH", "SUSTAINED MB/s", "AT"], &rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        // Right-aligned columns end at the same offset on every line.
        let ends = |l: &str| l.chars().count();
        assert!(lines.iter().all(|l| ends(l) == ends(lines[0])), "{t}");
        let col = |l: &str, cell: &str| l.find(cell).unwrap() + cell.len();
        assert_eq!(
            col(lines[0], "SUSTAINED MB/s"),
            col(lines[1], "31000"),
            "{t}"
        );
        assert_eq!(col(lines[1], "31000"), col(lines[2], " 2"), "{t}");
        assert!(lines[1].starts_with("fabric-verbs-write  "), "{t}");
    }

    #[test]
    fn sizes_a_path_cannot_carry_read_n_a_in_the_tables_with_the_reason() {
        let r = tests_support::report_with_paths(&["fabric-dgram", "udp-veth"]);
        let md = markdown(&r, &[]);
        let grid = md
            .split("## Throughput by size (MB/s)")
            .nth(1)
            .expect("throughput grid");
        let row = grid
            .lines()
            .find(|l| l.starts_with("| 1 MiB |"))
            .expect("1 MiB row");
        assert_eq!(row, "| 1 MiB | 10240 | n/a |", "{grid}");
        assert!(grid.contains("n/a on udp-veth: larger than the largest UDP datagram"));
        let small = grid.lines().find(|l| l.starts_with("| 4 KiB |")).unwrap();
        assert_eq!(small, "| 4 KiB | 40 | 40 |");
    }
}
