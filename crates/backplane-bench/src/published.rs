//! The seeds beside us: figures the seed documents publish for a link (VXFabric's Figure 12,
//! the IDT switch report's tables, the Manchester 10 GigE study, Critical I/O's RoCE paper),
//! set row by row beside what a `bench --link MODEL` run measured on the emulated link and
//! what the link model predicts, so a reader sees whether the emulation reproduces the
//! published hardware.
//!
//! The figures live in one data file, `data/published.toml`, each with its source (seed file,
//! section, the words quoted) and any conversion made.

use serde::{Deserialize, Serialize};

use crate::report::{LinkModelOut, Report};

/// The data file, built into the binary.
const DATA: &str = include_str!("../data/published.toml");

/// One published figure.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Figure {
    /// Link model it was measured on (`pcie-gen3x8`, `eth-10g`, ...).
    pub link: String,
    /// What was measured.
    pub what: String,
    /// The bench path that measures the same thing.
    pub path: String,
    /// Which figure of that path (see [`Metric`]).
    pub metric: Metric,
    /// Message size, for [`Metric::MbPerSAt`].
    pub bytes: Option<u64>,
    /// The published value, in the metric's unit.
    pub value: f64,
    /// Seed file, section and the words quoted.
    pub source: String,
    /// Conversions made, or how the workloads differ.
    pub note: Option<String>,
}

/// What a figure measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Best throughput over the sweep, MB/s.
    SustainedMbPerS,
    /// Throughput at one size, MB/s.
    MbPerSAt,
    /// CPU of one side, % of one core (the bench's both-sides figure halved).
    CpuPctPerSide,
    /// Median one-way latency at the smallest size, µs.
    LatencyUs,
    /// Latency slope, µs per byte.
    SlopeUsPerByte,
    /// Throughput with a switch over without: not measurable in one run.
    WithOverWithout,
}

impl Metric {
    fn unit(self) -> &'static str {
        match self {
            Metric::SustainedMbPerS | Metric::MbPerSAt => "MB/s",
            Metric::CpuPctPerSide => "% of a core",
            Metric::LatencyUs => "µs",
            Metric::SlopeUsPerByte => "µs/B",
            Metric::WithOverWithout => "ratio",
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    figure: Vec<Figure>,
}

/// Every figure of the data file.
pub fn figures() -> Vec<Figure> {
    toml::from_str::<File>(DATA)
        .expect("data/published.toml is checked by this module's tests")
        .figure
}

/// One row of the comparison.
#[derive(Debug, Clone, Serialize)]
pub struct PublishedRow {
    /// Link model.
    pub link: String,
    /// What the document measured.
    pub what: String,
    /// The published value.
    pub published: f64,
    /// Its unit.
    pub unit: String,
    /// Where it comes from.
    pub source: String,
    /// The bench path compared.
    pub path: String,
    /// What this run measured on the emulated link, if it did.
    pub measured: Option<f64>,
    /// Why nothing was measured, when nothing was.
    pub not_measured: Option<String>,
    /// What the link model predicts for the metric, where it predicts something.
    pub model: Option<f64>,
    /// measured / published.
    pub ratio: Option<f64>,
    /// Conversions and differences.
    pub note: Option<String>,
}

/// The rows for the run's link model (none without `--link`).
pub fn rows(r: &Report) -> Vec<PublishedRow> {
    let Some(model) = &r.link_model else {
        return Vec::new();
    };
    rows_for(&figures(), r, model)
}

fn rows_for(figs: &[Figure], r: &Report, model: &LinkModelOut) -> Vec<PublishedRow> {
    figs.iter()
        .filter(|f| f.link.eq_ignore_ascii_case(&model.model))
        .map(|f| {
            let (measured, not_measured) = measure(f, r);
            let predicted = match f.metric {
                Metric::SustainedMbPerS | Metric::MbPerSAt => Some(model.effective_mb_per_s),
                Metric::SlopeUsPerByte => Some(model.latency_slope_us_per_byte),
                Metric::WithOverWithout => Some(1.0),
                Metric::CpuPctPerSide | Metric::LatencyUs => None,
            };
            PublishedRow {
                link: f.link.clone(),
                what: f.what.clone(),
                published: f.value,
                unit: f.metric.unit().into(),
                source: f.source.clone(),
                path: f.path.clone(),
                ratio: measured.map(|m| m / f.value),
                measured,
                not_measured,
                model: predicted,
                note: if f.path == "fabric-raw" {
                    // Said here too, where the comparison is read.
                    Some(
                        [f.note.as_deref(), Some("DMA jobs are not paced by the link model: the emulation does not cover this path yet")]
                            .into_iter()
                            .flatten()
                            .collect::<Vec<_>>()
                            .join("; "),
                    )
                } else {
                    f.note.clone()
                },
            }
        })
        .collect()
}

/// What the run measured for figure `f`, or why it did not.
fn measure(f: &Figure, r: &Report) -> (Option<f64>, Option<String>) {
    if f.metric == Metric::WithOverWithout {
        return (None, Some("a run measures with the switch only".into()));
    }
    let Some(p) = r.paths.iter().find(|p| p.name == f.path) else {
        return (None, Some(format!("{} not in this run (--paths)", f.path)));
    };
    let row = r.summary.iter().find(|s| s.path == f.path);
    let got = match f.metric {
        Metric::SustainedMbPerS => row.map(|s| s.sustained_mb_per_s),
        Metric::CpuPctPerSide => row.map(|s| s.cpu_pct / 2.0),
        Metric::LatencyUs => row.and_then(|s| s.latency_us),
        Metric::SlopeUsPerByte => p.latency_fit.as_ref().map(|f| f.slope_us_per_byte),
        Metric::MbPerSAt => p
            .throughput
            .iter()
            .find(|t| Some(t.bytes) == f.bytes)
            .map(|t| t.mb_per_s),
        Metric::WithOverWithout => None,
    };
    match got {
        Some(v) => (Some(v), None),
        None if p.reason.is_some() => (None, p.reason.clone()),
        None if f.metric == Metric::MbPerSAt => (
            None,
            Some(format!(
                "size {} not in the sweep (--sizes)",
                f.bytes.unwrap_or(0)
            )),
        ),
        None => (None, Some("not measured in this run".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests_support::report_with_paths;

    #[test]
    fn the_data_file_parses_and_every_figure_has_a_source_and_a_known_link() {
        let figs = figures();
        assert!(figs.len() >= 15, "{}", figs.len());
        for f in &figs {
            assert!(f.source.starts_with("seeds/"), "{}: {}", f.what, f.source);
            assert!(f.value > 0.0, "{}", f.what);
            f.link
                .parse::<backplane::model::LinkModel>()
                .unwrap_or_else(|e| panic!("{}: {e}", f.link));
            assert!(
                crate::engine::PATHS.iter().any(|d| d.name == f.path),
                "{}: unknown path {}",
                f.what,
                f.path
            );
            assert_eq!(
                f.metric == Metric::MbPerSAt,
                f.bytes.is_some(),
                "{}",
                f.what
            );
        }
        // VXFabric's Figure 12 as the issue quotes it.
        let tcp = figs
            .iter()
            .find(|f| {
                f.link == "pcie-gen3x8"
                    && f.path == "fabric-tcp"
                    && f.metric == Metric::SustainedMbPerS
            })
            .unwrap();
        assert_eq!(tcp.value, 4400.0);
    }

    #[test]
    fn rows_match_the_link_and_set_measured_published_and_model_side_by_side() {
        let mut r = report_with_paths(&["fabric-tcp"]);
        let model = LinkModelOut::new("pcie-gen3x8").unwrap();
        r.link_model = Some(model.clone());
        let rows = rows(&r);
        // Figure 12's gen3 x8 row: TCP bandwidth, TCP CPU, raw bandwidth; nothing of other links.
        assert_eq!(rows.len(), 3, "{rows:?}");
        assert!(rows.iter().all(|x| x.link == "pcie-gen3x8"));
        let bw = rows
            .iter()
            .find(|x| x.what.contains("TCP bandwidth"))
            .unwrap();
        // The synthetic path's best point: 10 MB/s per KiB at 1 MiB.
        assert_eq!(bw.measured, Some(10240.0));
        assert_eq!(bw.ratio, Some(10240.0 / 4400.0));
        assert_eq!(bw.model, Some(model.effective_mb_per_s));
        let raw = rows.iter().find(|x| x.path == "fabric-raw").unwrap();
        assert_eq!(raw.measured, None);
        assert!(raw
            .not_measured
            .as_deref()
            .unwrap()
            .contains("not in this run"));
        // Without --link: no rows.
        r.link_model = None;
        assert!(super::rows(&r).is_empty());
    }
}
