//! Statistics for measurements: latency percentiles from an HDR histogram, jitter as the
//! histogram's full width at half maximum, least-squares line fits, and 95 % confidence
//! intervals over repeated runs (Student's t).
//!
//! Every function here is pure and tested against data whose answer is known.

use hdrhistogram::Histogram;
use serde::Serialize;

/// A histogram of latencies in nanoseconds: 1 ns to 60 s, 3 significant digits.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("static histogram bounds are valid")
}

/// The median of the finite values (the mean of the middle two for an even count); `None`
/// when there are none.
pub fn median(v: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = v.filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The distribution of one latency measurement, in microseconds.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct LatencySummary {
    /// Samples recorded (after warm-up trimming).
    pub samples: u64,
    /// Smallest sample.
    pub min_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// 99.99th percentile.
    pub p9999_us: f64,
    /// Largest sample.
    pub max_us: f64,
    /// Arithmetic mean.
    pub mean_us: f64,
    /// Standard deviation.
    pub stdev_us: f64,
    /// Jitter: full width at half maximum of the histogram.
    pub jitter_fwhm_us: f64,
}

impl LatencySummary {
    /// Summarises a histogram of nanosecond values. `None` when it is empty.
    pub fn from_histogram(h: &Histogram<u64>) -> Option<Self> {
        if h.is_empty() {
            return None;
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        let q = |x: f64| us(h.value_at_quantile(x));
        Some(LatencySummary {
            samples: h.len(),
            min_us: us(h.min()),
            p50_us: q(0.5),
            p90_us: q(0.9),
            p99_us: q(0.99),
            p999_us: q(0.999),
            p9999_us: q(0.9999),
            max_us: us(h.max()),
            mean_us: h.mean() / 1000.0,
            stdev_us: h.stdev() / 1000.0,
            jitter_fwhm_us: histogram_fwhm(h) / 1000.0,
        })
    }
}

/// Full width at half maximum of a histogram of nanosecond values, in nanoseconds.
///
/// The samples are binned linearly with a bin width of a fortieth of the 10–90 percentile
/// range, but at least the smallest gap between recorded values (a clock that ticks in 5 ns
/// steps has no narrower peaks), which resolves a peak finely while keeping enough samples
/// per bin.
pub fn histogram_fwhm(h: &Histogram<u64>) -> f64 {
    if h.is_empty() {
        return 0.0;
    }
    let lo = h.value_at_quantile(0.10);
    let hi = h.value_at_quantile(0.90);
    // Never finer than the data's own quantum (the clock's resolution, or the histogram's at
    // large values): narrower bins would split one spike of equal values into a comb.
    let mut quantum = u64::MAX;
    let mut prev: Option<u64> = None;
    for v in h.iter_recorded() {
        let x = h.median_equivalent(v.value_iterated_to());
        if let Some(p) = prev {
            quantum = quantum.min(x.saturating_sub(p).max(1));
        }
        prev = Some(x);
    }
    let quantum = if quantum == u64::MAX { 1 } else { quantum };
    let width = ((hi.saturating_sub(lo)) / 40).max(quantum).max(1);
    let start = h.min() - h.min() % width;
    let end = h.value_at_quantile(0.9999).max(start + width);
    let n = ((end - start) / width + 1) as usize;
    let mut counts = vec![0u64; n];
    for v in h.iter_recorded() {
        let x = h.median_equivalent(v.value_iterated_to());
        if x < start {
            continue;
        }
        let i = ((x - start) / width) as usize;
        if i < n {
            counts[i] += v.count_at_value();
        }
    }
    let centers: Vec<f64> = (0..n)
        .map(|i| start as f64 + (i as f64 + 0.5) * width as f64)
        .collect();
    let counts: Vec<f64> = counts.into_iter().map(|c| c as f64).collect();
    fwhm(&centers, &counts)
}

/// Full width at half maximum of a binned distribution: the distance between the two points,
/// either side of the highest bin, where the count falls below half the peak (linearly
/// interpolated between bin centres). A single tall bin has the width of one bin.
pub fn fwhm(centers: &[f64], counts: &[f64]) -> f64 {
    assert_eq!(centers.len(), counts.len());
    if counts.is_empty() {
        return 0.0;
    }
    let bin = if centers.len() > 1 {
        centers[1] - centers[0]
    } else {
        0.0
    };
    let (peak_i, &peak) = counts
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .expect("non-empty");
    if peak <= 0.0 {
        return 0.0;
    }
    let half = peak / 2.0;
    // Walk outwards from the peak to the first bin below half; interpolate the crossing.
    let cross = |from: usize, to: usize| -> f64 {
        let (x0, y0, x1, y1) = (centers[from], counts[from], centers[to], counts[to]);
        x0 + (y0 - half) / (y0 - y1) * (x1 - x0)
    };
    let mut l = peak_i;
    while l > 0 && counts[l - 1] >= half {
        l -= 1;
    }
    let left = if l == 0 {
        centers[0] - bin / 2.0
    } else {
        cross(l, l - 1)
    };
    let mut r = peak_i;
    while r + 1 < counts.len() && counts[r + 1] >= half {
        r += 1;
    }
    let right = if r + 1 == counts.len() {
        centers[r] + bin / 2.0
    } else {
        cross(r, r + 1)
    };
    (right - left).max(0.0)
}

/// A straight line `y = intercept + slope * x` fitted by least squares.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct LineFit {
    /// Value at x = 0.
    pub intercept: f64,
    /// Change of y per unit of x.
    pub slope: f64,
    /// Coefficient of determination (1 = every point on the line).
    pub r2: f64,
    /// Points fitted.
    pub points: usize,
}

/// Ordinary least-squares fit of `ys` against `xs`. `None` with fewer than two distinct xs.
pub fn least_squares(xs: &[f64], ys: &[f64]) -> Option<LineFit> {
    assert_eq!(xs.len(), ys.len());
    let n = xs.len();
    if n < 2 {
        return None;
    }
    let nf = n as f64;
    let mx = xs.iter().sum::<f64>() / nf;
    let my = ys.iter().sum::<f64>() / nf;
    let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    let sxy: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let syy: f64 = ys.iter().map(|y| (y - my) * (y - my)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let slope = sxy / sxx;
    let intercept = my - slope * mx;
    let r2 = if syy > 0.0 {
        (sxy * sxy) / (sxx * syy)
    } else {
        1.0
    };
    Some(LineFit {
        intercept,
        slope,
        r2,
        points: n,
    })
}

/// Mean of repeated measurements with its 95 % confidence interval.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Estimate {
    /// Sample mean.
    pub mean: f64,
    /// Lower end of the 95 % confidence interval (equal to `mean` for one run).
    pub ci95_low: f64,
    /// Upper end of the 95 % confidence interval.
    pub ci95_high: f64,
    /// Runs.
    pub n: usize,
}

/// Two-sided 95 % critical value of Student's t with `df` degrees of freedom.
pub fn t_critical_95(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => T[df - 1],
        31..=40 => 2.021,
        41..=60 => 2.000,
        61..=120 => 1.980,
        _ => 1.960,
    }
}

/// Mean and 95 % confidence interval of `xs` (t distribution, sample standard deviation).
/// `None` for no data.
pub fn estimate(xs: &[f64]) -> Option<Estimate> {
    let n = xs.len();
    if n == 0 {
        return None;
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return Some(Estimate {
            mean,
            ci95_low: mean,
            ci95_high: mean,
            n,
        });
    }
    let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1) as f64;
    let half = t_critical_95(n - 1) * (var / n as f64).sqrt();
    Some(Estimate {
        mean,
        ci95_low: mean - half,
        ci95_high: mean + half,
        n,
    })
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_takes_the_middle_and_skips_what_is_not_a_number() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), Some(2.0));
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].into_iter()), Some(2.5));
        assert_eq!(median([f64::NAN].into_iter()), None);
        assert_eq!(median(std::iter::empty()), None);
    }

    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn percentiles_of_one_to_ten_thousand_are_where_they_belong() {
        let mut h = new_histogram();
        for v in 1..=10_000u64 {
            h.record(v * 1000).unwrap(); // 1 µs .. 10 ms
        }
        let s = LatencySummary::from_histogram(&h).unwrap();
        assert_eq!(s.samples, 10_000);
        // Three significant digits: each value within 0.1 %.
        assert!(close(s.min_us, 1.0, 0.001), "{s:?}");
        assert!(close(s.p50_us, 5000.0, 5.0), "{s:?}");
        assert!(close(s.p90_us, 9000.0, 9.0), "{s:?}");
        assert!(close(s.p99_us, 9900.0, 10.0), "{s:?}");
        assert!(close(s.p999_us, 9990.0, 10.0), "{s:?}");
        assert!(close(s.p9999_us, 9999.0, 10.0), "{s:?}");
        assert!(close(s.max_us, 10_000.0, 10.0), "{s:?}");
        assert!(close(s.mean_us, 5000.5, 5.0), "{s:?}");
        assert!(s.min_us <= s.p50_us && s.p50_us <= s.p90_us && s.p90_us <= s.p99_us);
        assert!(s.p99_us <= s.p999_us && s.p999_us <= s.p9999_us && s.p9999_us <= s.max_us);
    }

    #[test]
    fn an_empty_histogram_has_no_summary() {
        assert!(LatencySummary::from_histogram(&new_histogram()).is_none());
    }

    #[test]
    fn fwhm_of_a_triangle_is_its_half_base() {
        // Triangle peaking at 50 with base from 0 to 100: half maximum at 25 and 75.
        let centers: Vec<f64> = (0..=100).map(|i| i as f64).collect();
        let counts: Vec<f64> = centers.iter().map(|&x| 50.0 - (x - 50.0).abs()).collect();
        assert!(close(fwhm(&centers, &counts), 50.0, 1e-9));
    }

    #[test]
    fn fwhm_of_a_gaussian_is_2_355_sigma() {
        let sigma = 10.0;
        let centers: Vec<f64> = (0..400).map(|i| i as f64 * 0.5).collect();
        let counts: Vec<f64> = centers
            .iter()
            .map(|&x| 1000.0 * (-(x - 100.0) * (x - 100.0) / (2.0 * sigma * sigma)).exp())
            .collect();
        assert!(close(fwhm(&centers, &counts), 2.3548 * sigma, 0.05));
    }

    #[test]
    fn fwhm_of_a_single_bin_is_one_bin_wide() {
        assert!(close(fwhm(&[1.0, 2.0, 3.0], &[0.0, 9.0, 0.0]), 1.0, 1e-9));
        assert_eq!(fwhm(&[], &[]), 0.0);
    }

    #[test]
    fn histogram_jitter_measures_a_known_uniform_spread() {
        // Uniform from 10 µs to 20 µs: the half-maximum width is the whole 10 µs.
        let mut h = new_histogram();
        for i in 0..100_000u64 {
            h.record(10_000 + (i * 7919) % 10_000).unwrap();
        }
        let w = histogram_fwhm(&h);
        assert!((9_000.0..=11_000.0).contains(&w), "fwhm {w} ns");
        // A narrow spike on a wide floor: the jitter is the spike's width, not the floor's.
        let mut h = new_histogram();
        for i in 0..50_000u64 {
            h.record(5_000 + i % 100).unwrap(); // 5.0–5.1 µs, dense
            if i % 10 == 0 {
                h.record(5_000 + (i * 13) % 20_000).unwrap(); // sparse floor to 25 µs
            }
        }
        let w = histogram_fwhm(&h);
        assert!(w < 1_000.0, "fwhm {w} ns");
        // A clock ticking in 5 ns steps: the jitter is one tick or two, never less than one.
        let mut h = new_histogram();
        for i in 0..10_000u64 {
            h.record([130, 135, 135, 135, 140][(i % 5) as usize])
                .unwrap();
        }
        let w = histogram_fwhm(&h);
        assert!((5.0..=10.0).contains(&w), "fwhm {w} ns");
    }

    #[test]
    fn least_squares_recovers_an_exact_line_and_scores_it_one() {
        let xs = [64.0, 128.0, 1024.0, 65536.0, 1048576.0];
        let ys: Vec<f64> = xs.iter().map(|x| 2.5 + 0.0004 * x).collect();
        let f = least_squares(&xs, &ys).unwrap();
        assert!(close(f.intercept, 2.5, 1e-9), "{f:?}");
        assert!(close(f.slope, 0.0004, 1e-12), "{f:?}");
        assert!(close(f.r2, 1.0, 1e-12));
        assert_eq!(f.points, 5);
    }

    #[test]
    fn least_squares_of_noisy_points_matches_the_textbook_answer() {
        // x = 1..5, y = 2, 4, 5, 4, 5: slope 0.6, intercept 2.2, r² = 0.6.
        let f = least_squares(&[1.0, 2.0, 3.0, 4.0, 5.0], &[2.0, 4.0, 5.0, 4.0, 5.0]).unwrap();
        assert!(close(f.slope, 0.6, 1e-12));
        assert!(close(f.intercept, 2.2, 1e-12));
        assert!(close(f.r2, 0.6, 1e-12));
        assert!(least_squares(&[1.0], &[1.0]).is_none());
        assert!(least_squares(&[3.0, 3.0], &[1.0, 2.0]).is_none());
    }

    #[test]
    fn confidence_interval_uses_students_t() {
        // 10, 12, 14: mean 12, s = 2, t(2) = 4.303, half width 4.303 * 2 / sqrt(3).
        let e = estimate(&[10.0, 12.0, 14.0]).unwrap();
        let half = 4.303 * 2.0 / 3f64.sqrt();
        assert!(close(e.mean, 12.0, 1e-12));
        assert!(close(e.ci95_low, 12.0 - half, 1e-9));
        assert!(close(e.ci95_high, 12.0 + half, 1e-9));
        assert_eq!(e.n, 3);
        let one = estimate(&[7.0]).unwrap();
        assert_eq!((one.ci95_low, one.ci95_high), (7.0, 7.0));
        assert!(estimate(&[]).is_none());
        assert_eq!(t_critical_95(1000), 1.96);
        // Identical runs: no spread, a zero-width interval.
        let same = estimate(&[5.0; 4]).unwrap();
        assert_eq!((same.ci95_low, same.ci95_high), (5.0, 5.0));
    }
}
