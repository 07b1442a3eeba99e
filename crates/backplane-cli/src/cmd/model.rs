//! `backplane model pcie|eth`: what a PCIe or Ethernet backplane link delivers, step by step,
//! with the assumption behind each step. The arithmetic lives in `backplane::model`; this file
//! only parses arguments and prints the report (a table, or the versioned JSON document).

use backplane::model::{
    EthLink, EthReport, EthSpeed, HopLatency, PcieLink, PcieReport, TlpHeader, DEFAULT_MPS,
};

/// Arguments of `model`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    link: Link,
}

#[derive(clap::Subcommand, Debug)]
enum Link {
    /// A PCIe link: raw rate, line code, TLP and DLLP overhead, latency per switch hop.
    Pcie(PcieArgs),
    /// An Ethernet link: line rate, frame rate and goodput (the RFC 2544 table by default).
    Eth(EthArgs),
}

#[derive(clap::Args, Debug)]
struct PcieArgs {
    /// Generation, 1 to 6.
    #[arg(long = "gen", value_name = "G")]
    generation: u32,
    /// Lanes: 1, 2, 4, 8, 12, 16 or 32.
    #[arg(long, value_name = "L")]
    lanes: u32,
    /// Max payload size in bytes: 128, 256, 512, 1024, 2048 or 4096.
    #[arg(long, value_name = "B", default_value_t = DEFAULT_MPS)]
    mps: u32,
    /// TLP header: 4dw (64-bit addresses) or 3dw (32-bit addresses).
    #[arg(long, value_enum, default_value = "4dw")]
    header: Header,
    /// Count a 4-byte ECRC in every TLP.
    #[arg(long)]
    ecrc: bool,
    /// Print the JSON document (version 1) instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
struct EthArgs {
    /// Speed: 1g, 10g, 25g, 40g or 100g.
    #[arg(long, value_name = "S")]
    speed: String,
    /// Frame size in bytes, FCS included (64 to 1518; up to 9216 for jumbo frames).
    /// Without it: the RFC 2544 table.
    #[arg(long, value_name = "B")]
    frame: Option<u32>,
    /// Print the JSON document (version 1) instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Header {
    /// 12-byte header (32-bit addresses).
    #[value(name = "3dw")]
    ThreeDw,
    /// 16-byte header (64-bit addresses).
    #[value(name = "4dw")]
    FourDw,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    match a.link {
        Link::Pcie(p) => {
            let header = match p.header {
                Header::ThreeDw => TlpHeader::ThreeDw,
                Header::FourDw => TlpHeader::FourDw,
            };
            let report = PcieLink::new(p.generation, p.lanes, p.mps)?
                .with_header(header)
                .with_ecrc(p.ecrc)
                .report();
            if p.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", render_pcie(&report));
            }
        }
        Link::Eth(e) => {
            let speed: EthSpeed = e.speed.parse()?;
            let report = EthLink::new(speed).report(e.frame)?;
            if e.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", render_eth(&report));
            }
        }
    }
    Ok(())
}

/// The human table for a PCIe link.
fn render_pcie(r: &PcieReport) -> String {
    let mut out = format!(
        "PCIe gen{} x{} ({}): max payload {} B, {} headers{}, per direction\n",
        r.generation,
        r.lanes,
        r.model,
        r.max_payload_size,
        match r.header {
            TlpHeader::ThreeDw => "3DW",
            TlpHeader::FourDw => "4DW",
        },
        if r.ecrc { ", ECRC" } else { "" }
    );
    out += &format!(
        "{:<24} {:>10} {:>7}  ASSUMPTION\n",
        "STEP", "MB/s", "OF RAW"
    );
    for s in &r.steps {
        let label = match s.step.as_str() {
            "raw" => "raw",
            "encoding" => "after encoding",
            "tlp" => "after TLP overhead",
            "dllp" => "after DLLP/flow control",
            other => other,
        };
        out += &format!(
            "{:<24} {:>10.1} {:>6.1}%  {}\n",
            label,
            s.bytes_per_s / 1e6,
            s.fraction_of_raw * 100.0,
            s.assumption
        );
    }
    out += &latency_lines(r.latency_slope_us_per_byte, "", &r.per_hop);
    out
}

/// The human table for an Ethernet link.
fn render_eth(r: &EthReport) -> String {
    let mut out = format!(
        "Ethernet {} ({}): line rate {} Gb/s per direction ({}, below the MAC rate)\n",
        r.speed,
        r.model,
        r.line_rate_bits_per_s as f64 / 1e9,
        r.phy
    );
    out += &format!("{}\n", r.overhead_assumption);
    out += &format!(
        "{:>6} {:>14} {:>10} {:>13} {:>8}\n",
        "FRAME", "FRAMES/S", "L2 Gb/s", "PAYLOAD MB/s", "OF WIRE"
    );
    for f in &r.frames {
        out += &format!(
            "{:>6} {:>14} {:>10.3} {:>13.1} {:>7.1}%\n",
            f.frame_bytes,
            group(f.frames_per_s.floor() as u64),
            f.l2_bits_per_s / 1e9,
            f.payload_bytes_per_s / 1e6,
            f.wire_efficiency * 100.0
        );
    }
    out += &latency_lines(
        r.latency_slope_us_per_byte,
        " with 1518 B frames",
        &r.per_hop,
    );
    out
}

/// Latency slope and per-hop lines shared by both tables.
fn latency_lines(slope: f64, slope_note: &str, hops: &[HopLatency]) -> String {
    let mut out = format!(
        "latency slope: {} µs/byte{slope_note} (1 / effective bandwidth)\n",
        significant(slope, 3)
    );
    for h in hops {
        out += &format!(
            "per hop, {:<18} {:>11}  {}\n",
            format!("{}:", h.mode.name()),
            format!("+{:.1} ns", h.ns),
            h.assumption
        );
    }
    out += "(wire time only: add the switch's own latency)\n";
    out
}

/// `x` with `digits` significant digits, without an exponent: 0.000282, 0.00000426.
fn significant(x: f64, digits: i32) -> String {
    let decimals = if x > 0.0 && x.is_finite() {
        (digits - 1 - x.log10().floor() as i32).max(0)
    } else {
        0
    };
    format!("{x:.prec$}", prec = decimals as usize)
}

/// 14880952 → "14,880,952".
fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slopes_keep_three_significant_digits() {
        assert_eq!(significant(0.000_281_67, 3), "0.000282");
        assert_eq!(significant(0.000_004_258, 3), "0.00000426");
        assert_eq!(significant(0.0082, 3), "0.00820");
        assert_eq!(significant(12.345, 3), "12.3");
        assert_eq!(significant(1234.5, 3), "1234");
    }

    #[test]
    fn frame_rates_are_grouped_by_thousands() {
        assert_eq!(group(0), "0");
        assert_eq!(group(999), "999");
        assert_eq!(group(1000), "1,000");
        assert_eq!(group(14_880_952), "14,880,952");
        assert_eq!(group(148_809_523), "148,809,523");
    }

    #[test]
    fn the_pcie_table_shows_every_step_with_its_assumption() {
        let t = render_pcie(&PcieLink::new(1, 4, 128).unwrap().report());
        assert!(t.contains("pcie-gen1x4"), "{t}");
        assert!(
            t.contains("raw                          1250.0  100.0%  2.5 GT/s"),
            "{t}"
        );
        assert!(
            t.contains("after encoding               1000.0   80.0%  8b/10b"),
            "{t}"
        );
        assert!(
            t.contains("after DLLP/flow control       820.5   65.6%  one 8 B Ack"),
            "{t}"
        );
        assert!(t.contains("store-and-forward:"), "{t}");
    }

    #[test]
    fn the_eth_table_lists_rfc_2544_sizes_unless_a_frame_is_given() {
        let link = EthLink::new(EthSpeed::G10);
        let t = render_eth(&link.report(None).unwrap());
        assert_eq!(t.lines().filter(|l| l.contains('%')).count(), 7, "{t}");
        assert!(t.contains("14,880,952"), "{t}");
        let t = render_eth(&link.report(Some(1518)).unwrap());
        assert_eq!(t.lines().filter(|l| l.contains('%')).count(), 1, "{t}");
        assert!(t.contains("812,743"), "{t}");
    }
}
