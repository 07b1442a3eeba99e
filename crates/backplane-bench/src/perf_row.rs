//! One row of a `backplane perf` table (perftest's columns) and what is computed on rows: a
//! latency row from a histogram, a row from a `ucx_perftest` run, and the median of each
//! column over `--rounds`. `perf` renders them; the statistics are [`crate::stats`]'.

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::stats::median;
use crate::ucx::UcxResult;

/// One row of results: a message size and what was measured at it (latency tests fill the
/// `t_*`/`p*` columns, bandwidth tests the `bw_*`/`msg_rate` ones).
#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct Row {
    /// Message size.
    pub bytes: u64,
    /// Iterations measured.
    pub iterations: u64,
    /// Fastest, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_min_us: Option<f64>,
    /// Slowest, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_max_us: Option<f64>,
    /// Median, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_typical_us: Option<f64>,
    /// Mean, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_avg_us: Option<f64>,
    /// Standard deviation, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t_stdev_us: Option<f64>,
    /// 99th percentile, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99_us: Option<f64>,
    /// 99.9th percentile, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p999_us: Option<f64>,
    /// Best interval's bandwidth, MB/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bw_peak_mbps: Option<f64>,
    /// Whole run's bandwidth, MB/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bw_avg_mbps: Option<f64>,
    /// Messages per second, millions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub msg_rate_mpps: Option<f64>,
    /// Single-thread memcpy of the same size, measured in the same run (bandwidth tests).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memcpy_mbps: Option<f64>,
}

impl Row {
    /// A latency row from a histogram of times in ns; `halve` for round trips (ping-pong
    /// tests report one way).
    pub fn latency(h: &Histogram<u64>, bytes: u64, iterations: u64, halve: bool) -> Self {
        let k = if halve { 2.0 } else { 1.0 };
        let us = |ns: f64| ns / k / 1000.0;
        Self {
            bytes,
            iterations,
            t_min_us: Some(us(h.min() as f64)),
            t_max_us: Some(us(h.max() as f64)),
            t_typical_us: Some(us(h.value_at_quantile(0.5) as f64)),
            t_avg_us: Some(us(h.mean())),
            t_stdev_us: Some(us(h.stdev())),
            p99_us: Some(us(h.value_at_quantile(0.99) as f64)),
            p999_us: Some(us(h.value_at_quantile(0.999) as f64)),
            ..Self::default()
        }
    }

    /// A `ucx_perftest` run at `bytes` as a row: its latencies for a latency test, its
    /// bandwidth and message rate otherwise.
    pub fn from_ucx(r: &UcxResult, bytes: u64, latency: bool) -> Self {
        let mut row = Self {
            bytes,
            iterations: r.iterations,
            ..Self::default()
        };
        if latency {
            row.t_typical_us = Some(r.typical_lat_us);
            row.t_avg_us = Some(r.avg_lat_us);
        } else {
            row.bw_avg_mbps = Some(r.bw_mb_per_s);
            row.msg_rate_mpps = Some(r.msg_rate / 1e6);
        }
        row
    }
}

/// Each column's median over rounds, size by size: row `i` of the result is the median of
/// row `i` of every round that has one (a column no round filled stays empty).
pub fn median_rows(rounds: &[&[Row]]) -> Vec<Row> {
    let Some(first) = rounds.first() else {
        return Vec::new();
    };
    first
        .iter()
        .enumerate()
        .map(|(i, r0)| {
            let rows: Vec<&Row> = rounds.iter().filter_map(|r| r.get(i)).collect();
            let med = |get: fn(&Row) -> Option<f64>| median(rows.iter().filter_map(|r| get(r)));
            Row {
                bytes: r0.bytes,
                iterations: r0.iterations,
                t_min_us: med(|r| r.t_min_us),
                t_max_us: med(|r| r.t_max_us),
                t_typical_us: med(|r| r.t_typical_us),
                t_avg_us: med(|r| r.t_avg_us),
                t_stdev_us: med(|r| r.t_stdev_us),
                p99_us: med(|r| r.p99_us),
                p999_us: med(|r| r.p999_us),
                bw_peak_mbps: med(|r| r.bw_peak_mbps),
                bw_avg_mbps: med(|r| r.bw_avg_mbps),
                msg_rate_mpps: med(|r| r.msg_rate_mpps),
                memcpy_mbps: med(|r| r.memcpy_mbps),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_are_per_size_and_per_column_and_skip_empty_columns() {
        let row = |t: f64, bw: Option<f64>| Row {
            bytes: 8,
            iterations: 10,
            t_typical_us: Some(t),
            bw_avg_mbps: bw,
            ..Row::default()
        };
        let (a, b, c) = (
            [row(1.0, None), row(5.0, None)],
            [row(3.0, Some(7.0)), row(4.0, None)],
            [row(2.0, None)],
        );
        let m = median_rows(&[&a, &b, &c]);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].t_typical_us, Some(2.0));
        assert_eq!(m[0].bw_avg_mbps, Some(7.0));
        assert_eq!(m[1].t_typical_us, Some(4.5), "round c has no second size");
        assert_eq!(m[1].t_min_us, None);
        assert!(median_rows(&[]).is_empty());
    }

    #[test]
    fn a_latency_row_halves_round_trips_into_one_way_microseconds() {
        let mut h = crate::stats::new_histogram();
        for ns in [1000u64, 2000, 3000] {
            h.record(ns).unwrap();
        }
        let one_way = Row::latency(&h, 64, 3, true);
        let whole = Row::latency(&h, 64, 3, false);
        let t = |r: &Row| r.t_typical_us.unwrap();
        assert!((t(&whole) - 2.0).abs() < 0.01, "{whole:?}");
        assert!((t(&one_way) - 1.0).abs() < 0.01, "{one_way:?}");
        assert!(
            one_way.t_min_us.unwrap() <= t(&one_way) && t(&one_way) <= one_way.t_max_us.unwrap()
        );
        assert_eq!(one_way.bw_avg_mbps, None);
    }

    #[test]
    fn ucx_results_become_latency_or_bandwidth_rows() {
        let text = "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n\
                    100000,0.135,0.140,0.140,54.65,54.65,7162588,7162588\n";
        let u = crate::ucx::parse_csv(text).unwrap();
        let r = Row::from_ucx(&u, 8, true);
        assert_eq!((r.bytes, r.iterations), (8, 100000));
        assert_eq!(r.t_typical_us, Some(0.135));
        assert_eq!(r.bw_avg_mbps, None);
        let r = Row::from_ucx(&u, 8, false);
        assert!((r.bw_avg_mbps.unwrap() - 54.65 * 1.048576).abs() < 1e-6);
        assert_eq!(r.msg_rate_mpps, Some(7.162588));
    }
}
