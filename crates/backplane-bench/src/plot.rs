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

const W: u32 = 1200;
const H: u32 = 640;
/// Width of the legend column right of the plot (the legend never covers data).
const LEGEND_W: u32 = 250;

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
    /// A labelled horizontal band behind the lines (the memcpy reference), not a path.
    pub band: Option<Band>,
}

/// A horizontal reference band: from `lo` to `hi` on the Y axis, labelled on the plot.
#[derive(Debug, Clone)]
pub struct Band {
    /// Lower edge.
    pub lo: f64,
    /// Upper edge.
    pub hi: f64,
    /// Text drawn on the band.
    pub label: String,
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

/// How a path's line looks: a colour of its own, solid for the fabric's paths and dashed for
/// the baselines (kernel sockets, UCX), and a marker per family (fabric ●, kernel ▲, UCX ✕),
/// so lines stay apart in colour, in grey print and for colour-blind readers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LineStyle {
    /// Line and marker colour.
    pub color: RGBColor,
    /// Dashed line (a baseline) or solid (the fabric).
    pub dashed: bool,
    /// Marker shape.
    pub marker: Marker,
}

/// Marker shapes, one per family of paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    /// The fabric's own paths.
    Circle,
    /// The kernel's sockets.
    Triangle,
    /// UCX.
    Cross,
}

/// Okabe & Ito's colour-blind-safe palette without its yellow (too light on white), then Paul
/// Tol's "muted" palette: fourteen colours no two of which are confused by the common forms
/// of colour blindness, in the order the paths are listed.
const PALETTE: [RGBColor; 14] = [
    RGBColor(0x00, 0x72, 0xB2), // blue
    RGBColor(0xD5, 0x5E, 0x00), // vermillion
    RGBColor(0x00, 0x9E, 0x73), // bluish green
    RGBColor(0xCC, 0x79, 0xA7), // reddish purple
    RGBColor(0xE6, 0x9F, 0x00), // orange
    RGBColor(0x56, 0xB4, 0xE9), // sky blue
    RGBColor(0x00, 0x00, 0x00), // black
    RGBColor(0x88, 0x22, 0x55), // wine
    RGBColor(0x33, 0x22, 0x88), // indigo
    RGBColor(0x44, 0xAA, 0x99), // teal
    RGBColor(0x99, 0x99, 0x33), // olive
    RGBColor(0xAA, 0x44, 0x99), // purple
    RGBColor(0x88, 0x88, 0x88), // grey
    RGBColor(0xCC, 0x66, 0x77), // rose
];

/// Paths in the order their colours are handed out: a path keeps its colour in every plot and
/// every run, whichever paths a run measures.
const KNOWN: [&str; 14] = [
    "fabric-dgram",
    "fabric-verbs-write",
    "fabric-verbs-read",
    "fabric-verbs-send",
    "fabric-raw",
    "fabric-tcp",
    "fabric-udp",
    "ucx-shm",
    "tcp-veth",
    "udp-veth",
    "tcp-loopback",
    "udp-loopback",
    "unix-stream",
    "fabric-tcp-accel",
];

/// The style of the line of path `name`.
pub fn style_of(name: &str) -> LineStyle {
    let color = match KNOWN.iter().position(|&k| k == name) {
        Some(i) => PALETTE[i],
        // Another name (tests, future paths): a stable pick from the palette.
        None => PALETTE[name.bytes().map(usize::from).sum::<usize>() % PALETTE.len()],
    };
    let (dashed, marker) = if name.starts_with("fabric-") {
        (false, Marker::Circle)
    } else if name.starts_with("ucx") {
        (true, Marker::Cross)
    } else {
        (true, Marker::Triangle)
    };
    LineStyle {
        color,
        dashed,
        marker,
    }
}

/// Every `step`-th power of two gets a label on a size axis, so that `ticks` labels of about
/// 60 px (e.g. "128 KiB" in 15 px type) fit side by side in `width_px` with room between.
pub fn size_label_step(ticks: usize, width_px: u32) -> usize {
    const LABEL_PX: usize = 70;
    let fit = (width_px as usize / LABEL_PX).max(1);
    ticks.div_ceil(fit).max(1)
}

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

/// Draws `c` on any plotters backend: the plot on the left, the legend in a column of its
/// own on the right.
pub fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, c: &Chart) -> anyhow::Result<()> {
    register_font();
    root.fill(&WHITE).map_err(err)?;
    let (w, _) = root.dim_in_pixel();
    let (plot_area, legend_area) = root.split_horizontally(w.saturating_sub(LEGEND_W));
    let all_x = || c.series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let all_y = || {
        c.series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .chain(c.band.iter().flat_map(|b| [b.lo, b.hi]))
    };
    let (x0, x1) = if c.x_is_size {
        let (a, b) = bounds(all_x(), true);
        let (a, b) = (a * 1.5, b / 1.5); // sizes are exact: pad by half a power of two
        ((a.log2() - 0.5).floor(), (b.log2() + 0.5).ceil())
    } else {
        bounds(all_x(), true)
    };
    let (y0, y1) = bounds(all_y(), c.log_y);
    let font = ("sans-serif", 15).into_font();
    let mut b = ChartBuilder::on(&plot_area);
    b.caption(&c.title, ("sans-serif", 22))
        .margin(14)
        .margin_right(20)
        .x_label_area_size(52)
        .y_label_area_size(84);
    let to_x = |x: f64| if c.x_is_size { x.log2() } else { x };
    let ticks = if c.x_is_size {
        ((x1 - x0) as usize + 1).min(32)
    } else {
        10
    };
    let step = if c.x_is_size {
        size_label_step(ticks, w.saturating_sub(LEGEND_W + 120))
    } else {
        1
    };
    let x_fmt = |x: &f64| {
        if c.x_is_size {
            let e = x.round();
            if (e as i64).rem_euclid(step as i64) == 0 {
                human_bytes(2f64.powf(e) as u64)
            } else {
                String::new()
            }
        } else {
            short_num(*x)
        }
    };
    let y_fmt = |y: &f64| short_num(*y);
    let styles: Vec<LineStyle> = c.series.iter().map(|s| style_of(&s.name)).collect();
    // The four combinations of axis kinds share the drawing below through a macro.
    macro_rules! plot {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(&c.x_label)
                .y_desc(&c.y_label)
                .x_labels(ticks)
                .y_labels(10)
                .x_label_formatter(&x_fmt)
                .y_label_formatter(&y_fmt)
                .label_style(font.clone())
                .axis_desc_style(("sans-serif", 17))
                .light_line_style(RGBColor(235, 235, 235))
                .draw()
                .map_err(err)?;
            if let Some(band) = &c.band {
                let grey = RGBColor(0xBB, 0xBB, 0xBB);
                let (xa, xb) = (x0, x1);
                let (lo, hi) = (band.lo.min(band.hi), band.lo.max(band.hi));
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(xa, lo), (xb, hi)],
                        grey.mix(0.35).filled(),
                    )))
                    .map_err(err)?;
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(xa, hi), (xb, hi)],
                        grey.stroke_width(1),
                    )))
                    .map_err(err)?;
                chart
                    .draw_series(std::iter::once(Text::new(
                        band.label.clone(),
                        (xa + (xb - xa) * 0.02, hi),
                        ("sans-serif", 14)
                            .into_font()
                            .color(&RGBColor(0x55, 0x55, 0x55)),
                    )))
                    .map_err(err)?;
            }
            for (s, st) in c.series.iter().zip(&styles) {
                let color = st.color;
                let pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .filter(|p| p.1.is_finite() && (!c.log_y || p.1 > 0.0) && p.0 > 0.0)
                    .map(|p| (to_x(p.0), p.1))
                    .collect();
                if st.dashed {
                    chart
                        .draw_series(DashedLineSeries::new(
                            pts.clone(),
                            9,
                            6,
                            color.stroke_width(2),
                        ))
                        .map_err(err)?;
                } else {
                    chart
                        .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                        .map_err(err)?;
                }
                match st.marker {
                    Marker::Circle => chart
                        .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
                        .map(|_| ()),
                    Marker::Triangle => chart
                        .draw_series(
                            pts.iter()
                                .map(|&p| TriangleMarker::new(p, 5, color.filled())),
                        )
                        .map(|_| ()),
                    Marker::Cross => chart
                        .draw_series(pts.iter().map(|&p| Cross::new(p, 4, color.stroke_width(2))))
                        .map(|_| ()),
                }
                .map_err(err)?;
            }
        }};
    }
    match (c.x_is_size, c.log_y) {
        (true, true) => plot!(b
            .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
            .map_err(err)?),
        (true, false) => plot!(b.build_cartesian_2d(x0..x1, y0..y1).map_err(err)?),
        (false, true) => plot!(b
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
            .map_err(err)?),
        (false, false) => plot!(b
            .build_cartesian_2d((x0..x1).log_scale(), y0..y1)
            .map_err(err)?),
    }
    draw_legend(&legend_area, c, &styles)?;
    root.present().map_err(err)?;
    Ok(())
}

/// The legend, in its own column: a sample of each line (dash and marker) and the path name.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    c: &Chart,
    styles: &[LineStyle],
) -> anyhow::Result<()> {
    let font = ("sans-serif", 15).into_font();
    let (x, mut y) = (8i32, 60i32);
    for (s, st) in c.series.iter().zip(styles) {
        let color = st.color.stroke_width(2);
        if st.dashed {
            for k in 0..3 {
                area.draw(&PathElement::new(
                    vec![(x + k * 12, y), (x + k * 12 + 8, y)],
                    color,
                ))
                .map_err(err)?;
            }
        } else {
            area.draw(&PathElement::new(vec![(x, y), (x + 32, y)], color))
                .map_err(err)?;
        }
        let m = (x + 16, y);
        match st.marker {
            Marker::Circle => area.draw(&Circle::new(m, 4, st.color.filled())),
            Marker::Triangle => area.draw(&TriangleMarker::new(m, 5, st.color.filled())),
            Marker::Cross => area.draw(&Cross::new(m, 4, st.color.stroke_width(2))),
        }
        .map_err(err)?;
        area.draw(&Text::new(s.name.clone(), (x + 42, y - 8), font.clone()))
            .map_err(err)?;
        y += 24;
    }
    if c.band.is_some() {
        area.draw(&Rectangle::new(
            [(x, y - 6), (x + 32, y + 6)],
            RGBColor(0xBB, 0xBB, 0xBB).mix(0.35).filled(),
        ))
        .map_err(err)?;
        area.draw(&Text::new(
            "memcpy, 1 thread",
            (x + 42, y - 8),
            font.clone(),
        ))
        .map_err(err)?;
        y += 24;
    }
    let _ = y;
    let small = ("sans-serif", 13).into_font();
    area.draw(&Text::new("solid ●: the fabric", (x, 14), small.clone()))
        .map_err(err)?;
    area.draw(&Text::new("dashed ▲ kernel, ✕ UCX", (x, 32), small))
        .map_err(err)?;
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
        let series = tp;
        let m = &r.memcpy;
        let (lo, hi) = match m.end {
            Some(e) => (
                m.start.mb_per_s.min(e.mb_per_s),
                m.start.mb_per_s.max(e.mb_per_s),
            ),
            None => (m.start.mb_per_s, m.start.mb_per_s),
        };
        let band = Some(Band {
            lo,
            hi,
            label: format!(
                "memcpy, 1 thread, {}: {:.0} MB/s",
                human_bytes(m.start.bytes),
                m.reference_mb_per_s
            ),
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
                band,
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
                band: None,
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
                band: None,
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
                band: None,
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
                band: None,
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
            band: Some(Band {
                lo: 9000.0,
                hi: 11000.0,
                label: "memcpy reference".into(),
            }),
        }
    }

    #[test]
    fn every_known_path_has_its_own_colour_and_baselines_are_dashed() {
        let styles: Vec<LineStyle> = KNOWN.iter().map(|n| style_of(n)).collect();
        for (i, a) in styles.iter().enumerate() {
            for b in &styles[i + 1..] {
                assert_ne!(
                    a.color, b.color,
                    "{} and another path share a colour",
                    KNOWN[i]
                );
            }
        }
        let fabric = style_of("fabric-dgram");
        assert!(!fabric.dashed && fabric.marker == Marker::Circle);
        let veth = style_of("tcp-veth");
        assert!(veth.dashed && veth.marker == Marker::Triangle);
        let ucx = style_of("ucx-shm");
        assert!(ucx.dashed && ucx.marker == Marker::Cross);
        // Stable: the same path gets the same colour whatever else is plotted.
        assert_eq!(style_of("udp-veth"), style_of("udp-veth"));
    }

    #[test]
    fn size_labels_never_overlap_from_8_bytes_to_64_mib() {
        let plot_px = W - LEGEND_W - 120;
        for ticks in 1..=24usize {
            let step = size_label_step(ticks, plot_px);
            let labels = ticks.div_ceil(step);
            // "128 KiB" in 15 px type is about 60 px wide: each label needs that much room.
            assert!(
                labels * 60 <= plot_px as usize,
                "{ticks} ticks, step {step}"
            );
            assert!(step == 1 || (ticks.div_ceil(step - 1)) * 70 > plot_px as usize);
        }
    }

    #[test]
    fn the_memcpy_band_is_drawn_and_labelled_but_is_not_a_path() {
        let s = to_svg(&chart()).unwrap();
        assert!(s.contains("memcpy reference"));
        let r = crate::report::tests_support::report_with_paths(&["fabric-dgram", "udp-veth"]);
        let c = charts(&r);
        let tp = &c.iter().find(|(n, _)| n == "throughput").unwrap().1;
        assert!(tp.series.iter().all(|s| !s.name.contains("memcpy")));
        assert!(tp.band.as_ref().unwrap().label.contains("memcpy"));
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
