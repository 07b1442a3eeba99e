//! Plots of a report, each as SVG and PNG: one line per path, message size on a logarithmic
//! axis (powers of two), labelled axes with units.
//!
//! Text is drawn with DejaVu Sans embedded in the binary (the `dejavu` crate, through
//! plotters' `ab_glyph` backend), so no system fonts are needed and PNGs look the same on
//! every machine. SVGs name the font family `sans-serif` and carry text as text.

use std::path::Path;
use std::sync::Once;

use anyhow::{anyhow, Context};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::{human_bytes, Report};

const W: u32 = 1000;
const H: u32 = 620;

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text (the path name).
    pub name: String,
    /// Points (x, y); points with y ≤ 0 are left out of logarithmic charts.
    pub points: Vec<(f64, f64)>,
}

/// What a chart shows.
#[derive(Debug, Clone)]
pub struct Chart {
    /// Title above the plot.
    pub title: String,
    /// X axis description, with unit.
    pub x_label: String,
    /// Y axis description, with unit.
    pub y_label: String,
    /// X is a message size in bytes (log2 axis, labelled 64 B, 4 KiB, ...); otherwise a
    /// logarithmic rate axis.
    pub x_is_size: bool,
    /// Logarithmic Y axis (else linear from 0).
    pub log_y: bool,
    /// The lines.
    pub series: Vec<Series>,
}

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

const COLORS: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plotting failed: {e:?}")
}

/// Bounds of the data, padded; logarithmic bounds ignore non-positive values.
fn bounds(vals: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let v: Vec<f64> = vals
        .filter(|v| v.is_finite() && (!log || *v > 0.0))
        .collect();
    if v.is_empty() {
        return if log { (1.0, 10.0) } else { (0.0, 1.0) };
    }
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if log {
        let (lo, hi) = (lo / 1.5, hi * 1.5);
        if hi / lo < 10.0 {
            (lo / 2.0, hi * 2.0)
        } else {
            (lo, hi)
        }
    } else {
        (0.0, if hi > 0.0 { hi * 1.1 } else { 1.0 })
    }
}

/// Draws `c` on any plotters backend.
pub fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, c: &Chart) -> anyhow::Result<()> {
    register_font();
    root.fill(&WHITE).map_err(err)?;
    let all_x = || c.series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let all_y = || c.series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let (x0, x1) = if c.x_is_size {
        let (a, b) = bounds(all_x(), true);
        let (a, b) = (a * 1.5, b / 1.5); // sizes are exact: pad by half a power of two
        ((a.log2() - 0.5).floor(), (b.log2() + 0.5).ceil())
    } else {
        bounds(all_x(), true)
    };
    let (y0, y1) = bounds(all_y(), c.log_y);
    let font = ("sans-serif", 15).into_font();
    let mut b = ChartBuilder::on(root);
    b.caption(&c.title, ("sans-serif", 22))
        .margin(14)
        .margin_right(36)
        .x_label_area_size(52)
        .y_label_area_size(84);
    let to_x = |x: f64| if c.x_is_size { x.log2() } else { x };
    let x_fmt = |x: &f64| {
        if c.x_is_size {
            human_bytes(2f64.powf(x.round()) as u64)
        } else {
            short_num(*x)
        }
    };
    let y_fmt = |y: &f64| short_num(*y);
    // The four combinations of axis kinds share the series drawing below through a macro.
    macro_rules! plot {
        ($chart:expr, $xn:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(&c.x_label)
                .y_desc(&c.y_label)
                .x_labels($xn)
                .y_labels(10)
                .x_label_formatter(&x_fmt)
                .y_label_formatter(&y_fmt)
                .label_style(font.clone())
                .axis_desc_style(("sans-serif", 17))
                .light_line_style(RGBColor(235, 235, 235))
                .draw()
                .map_err(err)?;
            for (i, s) in c.series.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                let pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .filter(|p| p.1.is_finite() && (!c.log_y || p.1 > 0.0) && p.0 > 0.0)
                    .map(|p| (to_x(p.0), p.1))
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                    .map_err(err)?
                    .label(s.name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                    });
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(err)?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(font.clone())
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .map_err(err)?;
        }};
    }
    let xn = if c.x_is_size {
        ((x1 - x0) as usize + 1).min(24)
    } else {
        10
    };
    match (c.x_is_size, c.log_y) {
        (true, true) => plot!(
            b.build_cartesian_2d(x0..x1, (y0..y1).log_scale())
                .map_err(err)?,
            xn
        ),
        (true, false) => plot!(b.build_cartesian_2d(x0..x1, y0..y1).map_err(err)?, xn),
        (false, true) => plot!(
            b.build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
                .map_err(err)?,
            xn
        ),
        (false, false) => plot!(
            b.build_cartesian_2d((x0..x1).log_scale(), y0..y1)
                .map_err(err)?,
            xn
        ),
    }
    root.present().map_err(err)?;
    Ok(())
}

/// 1234567 → "1.2M", 0.25 → "0.25".
fn short_num(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{:.3}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.3}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3).replace(".0k", "k")
    } else if a >= 10.0 || a == 0.0 {
        format!("{v:.0}")
    } else {
        let t = if a >= 0.1 {
            format!("{v:.2}")
        } else {
            format!("{v:.3}")
        };
        t.trim_end_matches('0').trim_end_matches('.').to_string()
    }
    .replace(".000", "")
}

/// Renders a chart to SVG text.
pub fn to_svg(c: &Chart) -> anyhow::Result<String> {
    let mut s = String::new();
    {
        let root = SVGBackend::with_string(&mut s, (W, H)).into_drawing_area();
        draw(&root, c)?;
    }
    Ok(s)
}

/// Renders a chart to PNG bytes.
pub fn to_png(c: &Chart) -> anyhow::Result<Vec<u8>> {
    let mut rgb = vec![0u8; (W * H * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (W, H)).into_drawing_area();
        draw(&root, c)?;
    }
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, W, H);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().context("PNG header")?;
        w.write_image_data(&rgb).context("PNG data")?;
    }
    Ok(out)
}

/// The charts of a report.
pub fn charts(r: &Report) -> Vec<(String, Chart)> {
    let mut out = Vec::new();
    let size_series = |f: &dyn Fn(&crate::report::PathReport) -> Vec<(f64, f64)>| {
        r.paths
            .iter()
            .map(|p| Series {
                name: p.name.clone(),
                points: f(p),
            })
            .filter(|s| !s.points.is_empty())
            .collect::<Vec<_>>()
    };
    let tp = size_series(&|p| {
        p.throughput
            .iter()
            .map(|t| (t.bytes as f64, t.mb_per_s))
            .collect()
    });
    if !tp.is_empty() {
        let mut series = tp;
        let sizes: Vec<f64> = r.config.sizes.iter().map(|&s| s as f64).collect();
        series.push(Series {
            name: "memcpy (1 thread)".into(),
            points: sizes
                .iter()
                .map(|&s| (s, r.memcpy.reference_mb_per_s))
                .collect(),
        });
        out.push((
            "throughput".into(),
            Chart {
                title: "Throughput against message size".into(),
                x_label: "message size (bytes, log scale)".into(),
                y_label: "throughput (MB/s, log scale)".into(),
                x_is_size: true,
                log_y: true,
                series,
            },
        ));
    }
    let lat = size_series(&|p| {
        p.latency
            .iter()
            .filter(|l| l.p50_us > 0.0)
            .map(|l| (l.bytes as f64, l.p50_us))
            .collect()
    });
    if !lat.is_empty() {
        out.push((
            "latency".into(),
            Chart {
                title: "Median one-way latency against message size".into(),
                x_label: "message size (bytes, log scale)".into(),
                y_label: "one-way latency p50 (µs, log scale)".into(),
                x_is_size: true,
                log_y: true,
                series: lat,
            },
        ));
    }
    let p99 = size_series(&|p| {
        p.latency
            .iter()
            .filter_map(|l| l.p99_us.map(|v| (l.bytes as f64, v)))
            .collect()
    });
    if !p99.is_empty() {
        out.push((
            "latency-p99".into(),
            Chart {
                title: "99th percentile one-way latency against message size".into(),
                x_label: "message size (bytes, log scale)".into(),
                y_label: "one-way latency p99 (µs, log scale)".into(),
                x_is_size: true,
                log_y: true,
                series: p99,
            },
        ));
    }
    let cpu = size_series(&|p| {
        p.throughput
            .iter()
            .map(|t| (t.bytes as f64, t.service_demand_us_per_mb))
            .collect()
    });
    if !cpu.is_empty() {
        out.push((
            "cpu".into(),
            Chart {
                title: "CPU cost per megabyte (both sides) against message size".into(),
                x_label: "message size (bytes, log scale)".into(),
                y_label: "service demand (µs CPU per MB, log scale)".into(),
                x_is_size: true,
                log_y: true,
                series: cpu,
            },
        ));
    }
    let loss: Vec<Series> = r
        .paths
        .iter()
        .filter_map(|p| {
            let l = p.loss.as_ref()?;
            let mut pts: Vec<(f64, f64)> = l
                .sweep
                .iter()
                .chain(&l.search)
                .filter(|t| t.offered_mb_per_s > 0.0)
                .map(|t| (t.offered_mb_per_s, t.loss_pct))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            Some(Series {
                name: p.name.clone(),
                points: pts,
            })
        })
        .filter(|s| !s.points.is_empty())
        .collect();
    if !loss.is_empty() {
        out.push((
            "loss".into(),
            Chart {
                title: format!(
                    "Loss against offered load ({} datagrams)",
                    human_bytes(r.config.loss_bytes)
                ),
                x_label: "offered load (MB/s, log scale)".into(),
                y_label: "loss: not accepted + lost (% of offered)".into(),
                x_is_size: false,
                log_y: false,
                series: loss,
            },
        ));
    }
    out
}

/// Writes every chart of `r` as `NAME.svg` and `NAME.png` into `dir`; returns (title, SVG
/// file name) for the Markdown summary.
pub fn write_plots(r: &Report, dir: &Path) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (name, c) in charts(r) {
        std::fs::write(dir.join(format!("{name}.svg")), to_svg(&c)?)?;
        std::fs::write(dir.join(format!("{name}.png")), to_png(&c)?)?;
        out.push((c.title.clone(), format!("{name}.svg")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart() -> Chart {
        Chart {
            title: "t".into(),
            x_label: "message size (bytes, log scale)".into(),
            y_label: "throughput (MB/s, log scale)".into(),
            x_is_size: true,
            log_y: true,
            series: vec![
                Series {
                    name: "alpha-path".into(),
                    points: vec![(64.0, 10.0), (4096.0, 1000.0), (1048576.0, 5000.0)],
                },
                Series {
                    name: "beta-path".into(),
                    points: vec![(64.0, 0.0), (4096.0, 500.0)],
                },
            ],
        }
    }

    #[test]
    fn svg_has_axis_labels_legend_and_power_of_two_ticks() {
        let s = to_svg(&chart()).unwrap();
        assert!(s.starts_with("<svg"), "{}", &s[..100.min(s.len())]);
        for want in [
            "message size (bytes, log scale)",
            "throughput (MB/s, log scale)",
            "alpha-path",
            "beta-path",
            "4 KiB",
            "1 MiB",
        ] {
            assert!(s.contains(want), "SVG lacks {want:?}");
        }
    }

    #[test]
    fn png_is_a_png_with_text_drawn_in_it() {
        let p = to_png(&chart()).unwrap();
        assert_eq!(&p[..8], b"\x89PNG\r\n\x1a\n");
        // Not blank: the embedded font and the lines put many non-white pixels down.
        let dec = png::Decoder::new(std::io::Cursor::new(&p));
        let mut r = dec.read_info().unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        r.next_frame(&mut buf).unwrap();
        let dark = buf.chunks(3).filter(|c| c.iter().all(|&v| v < 100)).count();
        assert!(dark > 2000, "{dark} dark pixels");
    }

    #[test]
    fn a_linear_rate_chart_and_an_empty_one_render_too() {
        let mut c = chart();
        c.x_is_size = false;
        c.log_y = false;
        assert!(to_svg(&c).unwrap().contains("beta-path"));
        c.series.clear();
        assert!(to_svg(&c).unwrap().starts_with("<svg"));
    }

    #[test]
    fn numbers_on_axes_are_short() {
        assert_eq!(short_num(1_500_000.0), "1.500M");
        assert_eq!(short_num(2_000_000.0), "2M");
        assert_eq!(short_num(25_000.0), "25k");
        assert_eq!(short_num(12_500.0), "12.5k");
        assert_eq!(short_num(250.0), "250");
        assert_eq!(short_num(0.25), "0.25");
        assert_eq!(short_num(5.0), "5");
        assert_eq!(short_num(0.5), "0.5");
    }
}
