//! Link models: what a PCIe or Ethernet backplane link delivers, step by step.
//!
//! Pure arithmetic, no I/O: a model takes a link's parameters and says how many bytes per second
//! survive each layer of overhead, what a switch hop adds to latency, and the latency slope
//! (µs per byte) a benchmark should see. Every step carries the assumption it rests on as text,
//! so the CLI (`backplane model pcie|eth`) and the `--json` documents can show it next to the
//! number. Rates are per direction; `MB/s` and `GB/s` are decimal (10^6, 10^9 bytes/s).
//!
//! **PCIe** ([`PcieLink`]) follows the chain of the IDT switch report (seed 002, Section I):
//! raw bits → line encoding → TLP framing and headers → DLLPs and flow control.
//!
//! - *Raw*: 2.5, 5, 8, 16, 32, 64 GT/s per lane for generations 1–6, times the lanes.
//!   Widths are the ones the base specification defines: x1, x2, x4, x8, x12, x16, x32
//!   (the seed's "x1 to x32 in powers of two", plus x12); anything else is rejected.
//! - *Encoding*: 8b/10b for gen 1–2, 128b/130b for gen 3–5 (SKP ordered sets, about 0.3 %,
//!   ignored). Gen 6 is PAM4 with FLIT mode: of every 256-byte flit, 8 bytes of CRC and 6 of
//!   FEC carry no link-layer data, so 242/256 is counted here. The result is the "maximum
//!   theoretical bandwidth" of Figure 1 in seed 000, which rounds gen 3's 0.985 GB/s per lane
//!   up to 1 GB/s.
//! - *TLP overhead*: a stream of posted memory writes, each carrying a full max payload size
//!   (MPS) of data. Gen 1–2 wrap each TLP in STP (1 B) + sequence number (2 B) + header + LCRC
//!   (4 B) + END (1 B); gen 3–5 in a 4-byte STP token that holds the sequence number + header +
//!   LCRC (4 B) — 8 bytes of framing either way. The header is 4DW (16 B) by default, because
//!   fabric addresses lie above 4 GiB (64-bit addressing); 3DW (12 B) is the 32-bit form. ECRC
//!   (4 B) is off by default. In FLIT mode (gen 6) sequence numbers and CRC belong to the flit,
//!   so a TLP costs only its header (and ECRC if on).
//! - *DLLPs / flow control*: gen 1–5 send one 8-byte Ack DLLP and one 8-byte UpdateFC DLLP per
//!   [`TLPS_PER_DLLP`] TLPs (4 B per TLP on average). Posted writes need no completions. Gen 6
//!   carries DLLPs in the 6 data-link bytes of every flit, so 236 of 242 bytes remain for TLPs.
//!   Seed 002 advises budgeting "about 15 %" for this layer in real systems, because it also
//!   counts TLPs without user data (interrupts, messages); this model counts only what a write
//!   stream must pay, so it is an upper bound.
//!
//! **Ethernet** ([`EthLink`]) follows RFC 2544's conventions: a frame size counts the MAC
//! header and the 4-byte FCS (64 to 1518 bytes untagged; up to 9216 accepted as jumbo frames),
//! and every frame also costs 8 bytes of preamble + SFD and a 12-byte inter-frame gap on the
//! wire. The line rate is the MAC data rate (1, 10, 25, 40, 100 Gb/s); the PHY's own line code
//! (8b/10b, 64b/66b) runs faster underneath and costs the MAC nothing. Payload is the frame
//! minus 18 bytes (14-byte MAC header + FCS).
//!
//! **Latency per hop** ([`Forwarding`]): a cut-through switch starts forwarding once the part
//! of the packet it routes on has arrived (the TLP header; the Ethernet MAC header; in FLIT mode
//! the first flit, whose FEC and CRC must be checked first). A store-and-forward switch waits for
//! the whole packet, which for a link model means a maximum-size one. Only this wire-derived
//! term is modelled; a switch's internal latency ("typically low hundreds of nanoseconds", seed
//! 002) is the switch's own and must be added by the caller.
//!
//! **Latency slope**: 1 / effective bandwidth, in µs per byte — the per-byte term of seed 003's
//! "expected slope" (memory + PCIe + wire + PCIe + memory), so a bench can put a line under its
//! measured latency-vs-size points.
//!
//! [`LinkModel`] is what `backplane up --link MODEL` parses: `pcie-gen3x4`, `eth-10g`, ….
#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Version of the `--json` documents ([`PcieReport`], [`EthReport`]).
pub const VERSION: u32 = 1;

/// PCIe generations modelled.
pub const PCIE_GENERATIONS: std::ops::RangeInclusive<u32> = 1..=6;
/// PCIe link widths the base specification defines.
pub const PCIE_WIDTHS: [u32; 7] = [1, 2, 4, 8, 12, 16, 32];
/// Smallest and largest max payload size (a power of two in between).
pub const PCIE_MPS_RANGE: std::ops::RangeInclusive<u32> = 128..=4096;
/// Max payload size used when none is given (the usual setting of x86 root ports).
pub const DEFAULT_MPS: u32 = 256;
/// Bytes of one DLLP on the wire, framing and CRC included (gen 1–5).
pub const DLLP_BYTES: u32 = 8;
/// TLPs per Ack DLLP, and per UpdateFC DLLP (gen 1–5).
pub const TLPS_PER_DLLP: u32 = 4;
/// Bytes of a flit (gen 6 FLIT mode).
pub const FLIT_BYTES: u32 = 256;
/// TLP bytes in a flit.
pub const FLIT_TLP_BYTES: u32 = 236;
/// TLP + data-link-payload bytes in a flit (the rest is CRC and FEC).
pub const FLIT_LINK_BYTES: u32 = 242;

/// Ethernet preamble (7 B) + start-of-frame delimiter (1 B).
pub const ETH_PREAMBLE_SFD: u32 = 8;
/// Ethernet minimum inter-frame gap, in bytes.
pub const ETH_IFG: u32 = 12;
/// Wire bytes per frame beyond the frame itself.
pub const ETH_FRAME_OVERHEAD: u32 = ETH_PREAMBLE_SFD + ETH_IFG;
/// Destination + source MAC + EtherType.
pub const ETH_MAC_HEADER: u32 = 14;
/// Frame check sequence (counted inside the frame size, as RFC 2544 does).
pub const ETH_FCS: u32 = 4;
/// Smallest Ethernet frame.
pub const ETH_MIN_FRAME: u32 = 64;
/// Largest untagged standard frame (1500-byte MTU).
pub const ETH_MAX_FRAME: u32 = 1518;
/// Largest jumbo frame accepted.
pub const ETH_MAX_JUMBO: u32 = 9216;
/// The frame sizes of RFC 2544 §9.1 for Ethernet.
pub const RFC2544_FRAME_SIZES: [u32; 7] = [64, 128, 256, 512, 1024, 1280, 1518];

/// What is wrong with a PCIe link description.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PcieError {
    /// Occurs when the generation is outside 1..=6.
    #[error("PCIe generation {0} is not modelled: use 1 to 6")]
    BadGeneration(u32),
    /// Occurs when the lane count is not one of the widths the specification defines.
    #[error("x{0} is not a PCIe link width: use 1, 2, 4, 8, 12, 16 or 32 lanes")]
    BadLanes(u32),
    /// Occurs when the max payload size is not a power of two from 128 to 4096.
    #[error("max payload size {0} B is not valid: use 128, 256, 512, 1024, 2048 or 4096")]
    BadMps(u32),
}

/// What is wrong with an Ethernet link description.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EthError {
    /// Occurs when the speed is not one of the modelled ones.
    #[error("unknown Ethernet speed '{0}': use 1g, 10g, 25g, 40g or 100g")]
    BadSpeed(String),
    /// Occurs when a frame size is outside 64..=9216 bytes.
    #[error(
        "frame size {0} B is out of range: use 64 to 1518 (RFC 2544), or up to 9216 for jumbo frames"
    )]
    BadFrame(u32),
}

/// Why a link model name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkModelError {
    /// Occurs when the name has neither the `pcie-genGxL` nor the `eth-SPEED` form.
    #[error(
        "unknown link model '{0}': use pcie-genGxL (G 1-6, L 1, 2, 4, 8, 12, 16 or 32) or eth-SPEED (1g, 10g, 25g, 40g, 100g)"
    )]
    Unknown(String),
    /// Occurs when a `pcie-genGxL` name has a generation or width that does not exist.
    #[error("link model '{name}': {reason}")]
    Pcie {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: PcieError,
    },
    /// Occurs when an `eth-SPEED` name has an unknown speed.
    #[error("link model '{name}': {reason}")]
    Eth {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: EthError,
    },
}

/// When a switch forwards a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Forwarding {
    /// Start sending once the routing information has arrived.
    CutThrough,
    /// Start sending once the whole packet has arrived (and been checked).
    StoreAndForward,
}

impl Forwarding {
    /// Both modes, cut-through first.
    pub const ALL: [Forwarding; 2] = [Forwarding::CutThrough, Forwarding::StoreAndForward];

    /// `cut-through` or `store-and-forward`.
    pub fn name(self) -> &'static str {
        match self {
            Forwarding::CutThrough => "cut-through",
            Forwarding::StoreAndForward => "store-and-forward",
        }
    }
}

/// The latency one switch hop adds because of its forwarding mode (wire time only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HopLatency {
    /// The forwarding mode.
    pub mode: Forwarding,
    /// Wire bytes that must arrive before the switch starts sending.
    pub wait_bytes: u32,
    /// Time those bytes take on the link, in nanoseconds.
    pub ns: f64,
    /// What the bytes are.
    pub assumption: String,
}

/// One step of a bandwidth chain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// `raw`, `encoding`, `tlp` or `dllp`.
    pub step: String,
    /// Bytes per second per direction left after this step.
    pub bytes_per_s: f64,
    /// `bytes_per_s` as a fraction of the raw rate.
    pub fraction_of_raw: f64,
    /// The assumption this step rests on.
    pub assumption: String,
}

/// TLP header size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum TlpHeader {
    /// 3 doublewords (12 B): 32-bit addresses.
    #[serde(rename = "3dw")]
    ThreeDw,
    /// 4 doublewords (16 B): 64-bit addresses (the fabric's windows lie above 4 GiB).
    #[default]
    #[serde(rename = "4dw")]
    FourDw,
}

impl TlpHeader {
    /// Header bytes.
    pub fn bytes(self) -> u32 {
        match self {
            TlpHeader::ThreeDw => 12,
            TlpHeader::FourDw => 16,
        }
    }

    fn name(self) -> &'static str {
        match self {
            TlpHeader::ThreeDw => "3DW",
            TlpHeader::FourDw => "4DW",
        }
    }
}

/// A PCIe line code, as the ratio of data bits to line bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// 8b/10b (gen 1–2).
    B8B10,
    /// 128b/130b (gen 3–5).
    B128B130,
    /// PAM4 FLIT mode (gen 6): 242 link bytes per 256-byte flit.
    Flit,
}

impl Encoding {
    /// (data, line) — the fraction of line bits that carry link-layer bytes.
    pub fn ratio(self) -> (u64, u64) {
        match self {
            Encoding::B8B10 => (8, 10),
            Encoding::B128B130 => (128, 130),
            Encoding::Flit => (FLIT_LINK_BYTES as u64, FLIT_BYTES as u64),
        }
    }

    /// `8b/10b`, `128b/130b` or `flit 242/256`.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::B8B10 => "8b/10b",
            Encoding::B128B130 => "128b/130b",
            Encoding::Flit => "PAM4 flit 242/256",
        }
    }
}

/// A PCIe link: generation, width, max payload size, header form, ECRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PcieLink {
    generation: u32,
    lanes: u32,
    mps: u32,
    header: TlpHeader,
    ecrc: bool,
}

impl PcieLink {
    /// A link with 4DW headers and no ECRC. Rejects generations outside 1..=6, widths other
    /// than x1, x2, x4, x8, x12, x16, x32 and max payload sizes that are not a power of two
    /// from 128 to 4096.
    pub fn new(generation: u32, lanes: u32, mps: u32) -> Result<PcieLink, PcieError> {
        if !PCIE_GENERATIONS.contains(&generation) {
            return Err(PcieError::BadGeneration(generation));
        }
        if !PCIE_WIDTHS.contains(&lanes) {
            return Err(PcieError::BadLanes(lanes));
        }
        if !PCIE_MPS_RANGE.contains(&mps) || !mps.is_power_of_two() {
            return Err(PcieError::BadMps(mps));
        }
        Ok(PcieLink {
            generation,
            lanes,
            mps,
            header: TlpHeader::default(),
            ecrc: false,
        })
    }

    /// The same link with another header form.
    pub fn with_header(self, header: TlpHeader) -> PcieLink {
        PcieLink { header, ..self }
    }

    /// The same link with ECRC on or off.
    pub fn with_ecrc(self, ecrc: bool) -> PcieLink {
        PcieLink { ecrc, ..self }
    }

    /// Generation, 1..=6.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Lanes.
    pub fn lanes(&self) -> u32 {
        self.lanes
    }

    /// Max payload size, bytes.
    pub fn mps(&self) -> u32 {
        self.mps
    }

    /// `pcie-genGxL`.
    pub fn name(&self) -> String {
        format!("pcie-gen{}x{}", self.generation, self.lanes)
    }

    /// Per-lane raw rate in megatransfers per second (one bit per transfer per lane).
    pub fn mt_per_s_per_lane(&self) -> u64 {
        match self.generation {
            1 => 2_500,
            2 => 5_000,
            3 => 8_000,
            4 => 16_000,
            5 => 32_000,
            _ => 64_000,
        }
    }

    /// The line code of this generation.
    pub fn encoding(&self) -> Encoding {
        match self.generation {
            1 | 2 => Encoding::B8B10,
            3..=5 => Encoding::B128B130,
            _ => Encoding::Flit,
        }
    }

    fn flit_mode(&self) -> bool {
        self.encoding() == Encoding::Flit
    }

    /// Raw bit rate of the link per direction, bits/s.
    pub fn raw_bits_per_s(&self) -> u64 {
        self.mt_per_s_per_lane() * 1_000_000 * u64::from(self.lanes)
    }

    /// Raw rate in bytes/s (bits / 8, before any line code).
    pub fn raw_bytes_per_s(&self) -> f64 {
        self.raw_bits_per_s() as f64 / 8.0
    }

    /// Maximum theoretical bandwidth per direction after the line code (Figure 1 of seed 000).
    pub fn theoretical_bytes_per_s(&self) -> f64 {
        let (data, line) = self.encoding().ratio();
        (self.raw_bits_per_s() * data) as f64 / (line * 8) as f64
    }

    /// Per-TLP framing bytes in front of the header: STP + sequence number (gen 1–5), none in
    /// FLIT mode.
    fn framing_before_header(&self) -> u32 {
        match self.encoding() {
            Encoding::B8B10 => 1 + 2, // STP symbol, sequence number
            Encoding::B128B130 => 4,  // STP token, sequence number inside
            Encoding::Flit => 0,      // per flit, not per TLP
        }
    }

    /// Per-TLP framing bytes after the payload (ECRC aside): LCRC (+ END for 8b/10b).
    fn framing_after_payload(&self) -> u32 {
        match self.encoding() {
            Encoding::B8B10 => 4 + 1, // LCRC, END symbol
            Encoding::B128B130 => 4,  // LCRC; the length in STP replaces END
            Encoding::Flit => 0,
        }
    }

    /// Bytes a TLP adds to its payload on the link: framing, sequence number, header, LCRC,
    /// ECRC if on.
    pub fn tlp_overhead_bytes(&self) -> u32 {
        self.framing_before_header()
            + self.header.bytes()
            + if self.ecrc { 4 } else { 0 }
            + self.framing_after_payload()
    }

    /// Average DLLP bytes per TLP (gen 1–5); 0 in FLIT mode, where DLLPs have their own bytes
    /// in every flit.
    pub fn dllp_bytes_per_tlp(&self) -> f64 {
        if self.flit_mode() {
            0.0
        } else {
            // One Ack and one UpdateFC per TLPS_PER_DLLP TLPs.
            f64::from(2 * DLLP_BYTES) / f64::from(TLPS_PER_DLLP)
        }
    }

    /// Bandwidth left for payload after TLP overhead, before DLLPs.
    fn after_tlp_bytes_per_s(&self) -> f64 {
        let p = f64::from(self.mps);
        self.theoretical_bytes_per_s() * p / (p + f64::from(self.tlp_overhead_bytes()))
    }

    /// Payload bandwidth per direction after encoding, TLP and DLLP overhead, for a stream of
    /// max-payload writes.
    pub fn effective_bytes_per_s(&self) -> f64 {
        if self.flit_mode() {
            self.after_tlp_bytes_per_s() * f64::from(FLIT_TLP_BYTES) / f64::from(FLIT_LINK_BYTES)
        } else {
            let p = f64::from(self.mps);
            let t = f64::from(self.tlp_overhead_bytes());
            self.theoretical_bytes_per_s() * p / (p + t + self.dllp_bytes_per_tlp())
        }
    }

    /// The bandwidth chain, each step with its assumption.
    pub fn steps(&self) -> Vec<Step> {
        let raw = self.raw_bytes_per_s();
        let step = |name: &str, bytes_per_s: f64, assumption: String| Step {
            step: name.to_string(),
            bytes_per_s,
            fraction_of_raw: bytes_per_s / raw,
            assumption,
        };
        let gt = self.mt_per_s_per_lane() as f64 / 1000.0;
        let encoding = match self.encoding() {
            Encoding::B8B10 => "8b/10b line code: 8 data bits in every 10".to_string(),
            Encoding::B128B130 => {
                "128b/130b line code: 2 sync bits per 128 (SKP ordered sets ignored)".to_string()
            }
            Encoding::Flit => format!(
                "PAM4 FLIT mode: {FLIT_LINK_BYTES} of every {FLIT_BYTES} flit bytes carry TLPs and DLLPs (8 B CRC + 6 B FEC)"
            ),
        };
        let ecrc = if self.ecrc {
            " + 4 B ECRC"
        } else {
            ", no ECRC"
        };
        let (hdr_name, hdr) = (self.header.name(), self.header.bytes());
        let tlp = match self.encoding() {
            Encoding::B8B10 => format!(
                "per {} B payload: 1 B STP + 2 B seq + {hdr} B {hdr_name} header + 4 B LCRC + 1 B END{ecrc} = {} B",
                self.mps,
                self.tlp_overhead_bytes()
            ),
            Encoding::B128B130 => format!(
                "per {} B payload: 4 B STP token (with seq) + {hdr} B {hdr_name} header + 4 B LCRC{ecrc} = {} B",
                self.mps,
                self.tlp_overhead_bytes()
            ),
            Encoding::Flit => format!(
                "per {} B payload: {hdr} B {hdr_name} header{ecrc} = {} B (seq and CRC are per flit)",
                self.mps,
                self.tlp_overhead_bytes()
            ),
        };
        let dllp = if self.flit_mode() {
            format!(
                "{} of the {FLIT_LINK_BYTES} link bytes of every flit are data-link payload (flit seq, Ack/Nak, UpdateFC)",
                FLIT_LINK_BYTES - FLIT_TLP_BYTES
            )
        } else {
            format!(
                "one {DLLP_BYTES} B Ack + one {DLLP_BYTES} B UpdateFC DLLP per {TLPS_PER_DLLP} TLPs = {} B per TLP (posted writes, no completions)",
                self.dllp_bytes_per_tlp()
            )
        };
        vec![
            step(
                "raw",
                raw,
                format!(
                    "{gt} GT/s per lane x {} lanes = {} Gb/s per direction",
                    self.lanes,
                    self.raw_bits_per_s() as f64 / 1e9
                ),
            ),
            step("encoding", self.theoretical_bytes_per_s(), encoding),
            step("tlp", self.after_tlp_bytes_per_s(), tlp),
            step("dllp", self.effective_bytes_per_s(), dllp),
        ]
    }

    /// Nanoseconds `bytes` link-layer bytes take on the wire (after the line code).
    fn wire_ns(&self, bytes: u32) -> f64 {
        f64::from(bytes) / self.theoretical_bytes_per_s() * 1e9
    }

    /// Bytes of a max-payload TLP on the link.
    fn max_tlp_bytes(&self) -> u32 {
        self.mps + self.tlp_overhead_bytes()
    }

    /// The latency a switch hop adds in `mode` (wire time only; add the switch's own latency).
    pub fn per_hop_latency(&self, mode: Forwarding) -> HopLatency {
        let (wait_bytes, ns, assumption) = match (self.flit_mode(), mode) {
            (false, Forwarding::CutThrough) => {
                let b = self.framing_before_header() + self.header.bytes();
                (
                    b,
                    self.wire_ns(b),
                    format!(
                        "forwards once framing + {} header ({b} B) arrived",
                        self.header.name()
                    ),
                )
            }
            (false, Forwarding::StoreAndForward) => {
                let b = self.max_tlp_bytes();
                (
                    b,
                    self.wire_ns(b),
                    format!("waits for a whole {} B-payload TLP ({b} B)", self.mps),
                )
            }
            // In FLIT mode a flit is received whole (FEC, CRC) before anything in it is used;
            // the flit's time on the wire includes its CRC and FEC bytes.
            (true, Forwarding::CutThrough) => (
                FLIT_BYTES,
                f64::from(FLIT_BYTES) / self.raw_bytes_per_s() * 1e9,
                format!("forwards after the first {FLIT_BYTES} B flit (FEC and CRC are per flit)"),
            ),
            (true, Forwarding::StoreAndForward) => {
                let flits = self.max_tlp_bytes().div_ceil(FLIT_TLP_BYTES);
                let b = flits * FLIT_BYTES;
                (
                    b,
                    f64::from(b) / self.raw_bytes_per_s() * 1e9,
                    format!(
                        "waits for a whole {} B-payload TLP ({} B over {flits} flits of {FLIT_BYTES} B)",
                        self.mps,
                        self.max_tlp_bytes()
                    ),
                )
            }
        };
        HopLatency {
            mode,
            wait_bytes,
            ns,
            assumption,
        }
    }

    /// 1 / effective bandwidth, µs per byte.
    pub fn latency_slope_us_per_byte(&self) -> f64 {
        1e6 / self.effective_bytes_per_s()
    }

    /// The `--json` document.
    pub fn report(&self) -> PcieReport {
        PcieReport {
            version: VERSION,
            model: self.name(),
            generation: self.generation,
            lanes: self.lanes,
            max_payload_size: self.mps,
            header: self.header,
            ecrc: self.ecrc,
            gt_per_s_per_lane: self.mt_per_s_per_lane() as f64 / 1000.0,
            encoding: self.encoding().name().to_string(),
            tlp_overhead_bytes: self.tlp_overhead_bytes(),
            dllp_bytes_per_tlp: self.dllp_bytes_per_tlp(),
            steps: self.steps(),
            theoretical_bytes_per_s: self.theoretical_bytes_per_s(),
            effective_bytes_per_s: self.effective_bytes_per_s(),
            latency_slope_us_per_byte: self.latency_slope_us_per_byte(),
            per_hop: Forwarding::ALL
                .iter()
                .map(|m| self.per_hop_latency(*m))
                .collect(),
        }
    }
}

/// `backplane model pcie --json` (version 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PcieReport {
    /// Document version, 1.
    pub version: u32,
    /// Link model name, `pcie-genGxL`.
    pub model: String,
    /// Generation 1..=6.
    pub generation: u32,
    /// Lanes.
    pub lanes: u32,
    /// Max payload size, bytes.
    pub max_payload_size: u32,
    /// TLP header form: `3dw` or `4dw`.
    pub header: TlpHeader,
    /// Whether TLPs carry an ECRC.
    pub ecrc: bool,
    /// Raw rate per lane, GT/s.
    pub gt_per_s_per_lane: f64,
    /// Line code.
    pub encoding: String,
    /// Bytes each TLP adds to its payload.
    pub tlp_overhead_bytes: u32,
    /// Average DLLP bytes per TLP (0 in FLIT mode).
    pub dllp_bytes_per_tlp: f64,
    /// raw → encoding → tlp → dllp.
    pub steps: Vec<Step>,
    /// After the line code (Figure 1 of seed 000), bytes/s.
    pub theoretical_bytes_per_s: f64,
    /// After every overhead, bytes/s.
    pub effective_bytes_per_s: f64,
    /// 1 / effective bandwidth, µs per byte.
    pub latency_slope_us_per_byte: f64,
    /// Cut-through, then store-and-forward.
    pub per_hop: Vec<HopLatency>,
}

/// An Ethernet speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EthSpeed {
    /// 1 Gb/s.
    #[serde(rename = "1g")]
    G1,
    /// 10 Gb/s.
    #[serde(rename = "10g")]
    G10,
    /// 25 Gb/s.
    #[serde(rename = "25g")]
    G25,
    /// 40 Gb/s.
    #[serde(rename = "40g")]
    G40,
    /// 100 Gb/s.
    #[serde(rename = "100g")]
    G100,
}

impl EthSpeed {
    /// Every speed, slowest first.
    pub const ALL: [EthSpeed; 5] = [
        EthSpeed::G1,
        EthSpeed::G10,
        EthSpeed::G25,
        EthSpeed::G40,
        EthSpeed::G100,
    ];

    /// MAC data rate, bits/s.
    pub fn bits_per_s(self) -> u64 {
        match self {
            EthSpeed::G1 => 1_000_000_000,
            EthSpeed::G10 => 10_000_000_000,
            EthSpeed::G25 => 25_000_000_000,
            EthSpeed::G40 => 40_000_000_000,
            EthSpeed::G100 => 100_000_000_000,
        }
    }

    /// `1g`, `10g`, ….
    pub fn name(self) -> &'static str {
        match self {
            EthSpeed::G1 => "1g",
            EthSpeed::G10 => "10g",
            EthSpeed::G25 => "25g",
            EthSpeed::G40 => "40g",
            EthSpeed::G100 => "100g",
        }
    }

    /// The PHY's line code, which runs below the MAC rate.
    pub fn phy(self) -> &'static str {
        match self {
            EthSpeed::G1 => "1000BASE-X: 8b/10b at 1.25 GBd",
            EthSpeed::G10 => "10GBASE-R: 64b/66b at 10.3125 GBd",
            EthSpeed::G25 => "25GBASE-R: 64b/66b at 25.78125 GBd",
            EthSpeed::G40 => "40GBASE-R: 4 lanes of 64b/66b at 10.3125 GBd",
            EthSpeed::G100 => "100GBASE-R: 64b/66b, e.g. 4 lanes at 25.78125 GBd",
        }
    }
}

impl FromStr for EthSpeed {
    type Err = EthError;

    fn from_str(s: &str) -> Result<EthSpeed, EthError> {
        let t = s.trim().to_ascii_lowercase();
        let t = t.strip_suffix("bps").unwrap_or(&t);
        EthSpeed::ALL
            .into_iter()
            .find(|e| e.name() == t || e.name().trim_end_matches('g') == t)
            .ok_or_else(|| EthError::BadSpeed(s.to_string()))
    }
}

impl fmt::Display for EthSpeed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An Ethernet link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EthLink {
    speed: EthSpeed,
}

/// Frame rate and goodput of an Ethernet link at one frame size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrameRate {
    /// Frame size, MAC header and FCS included.
    pub frame_bytes: u32,
    /// Maximum frames per second.
    pub frames_per_s: f64,
    /// Frame bits per second (what RFC 2544 testers call layer-2 throughput).
    pub l2_bits_per_s: f64,
    /// Payload bytes per second (frame − 14 B header − 4 B FCS).
    pub payload_bytes_per_s: f64,
    /// frame / (frame + 20): the share of the wire frames get.
    pub wire_efficiency: f64,
}

impl EthLink {
    /// A link of this speed.
    pub fn new(speed: EthSpeed) -> EthLink {
        EthLink { speed }
    }

    /// The speed.
    pub fn speed(&self) -> EthSpeed {
        self.speed
    }

    /// `eth-SPEED`.
    pub fn name(&self) -> String {
        format!("eth-{}", self.speed)
    }

    /// Frame rate and goodput for frames of `frame_bytes` (64..=9216), back to back.
    pub fn frame(&self, frame_bytes: u32) -> Result<FrameRate, EthError> {
        if !(ETH_MIN_FRAME..=ETH_MAX_JUMBO).contains(&frame_bytes) {
            return Err(EthError::BadFrame(frame_bytes));
        }
        let wire_bits = u64::from(frame_bytes + ETH_FRAME_OVERHEAD) * 8;
        let frames_per_s = self.speed.bits_per_s() as f64 / wire_bits as f64;
        Ok(FrameRate {
            frame_bytes,
            frames_per_s,
            l2_bits_per_s: frames_per_s * f64::from(frame_bytes) * 8.0,
            payload_bytes_per_s: frames_per_s * f64::from(frame_bytes - ETH_MAC_HEADER - ETH_FCS),
            wire_efficiency: f64::from(frame_bytes) / f64::from(frame_bytes + ETH_FRAME_OVERHEAD),
        })
    }

    /// The RFC 2544 table: [`RFC2544_FRAME_SIZES`].
    pub fn rfc2544(&self) -> Vec<FrameRate> {
        RFC2544_FRAME_SIZES
            .iter()
            .map(|f| self.frame(*f).expect("RFC 2544 sizes are in range"))
            .collect()
    }

    /// Payload bandwidth with maximum standard frames (1518 B), bytes/s.
    pub fn effective_bytes_per_s(&self) -> f64 {
        self.frame(ETH_MAX_FRAME)
            .expect("1518 is in range")
            .payload_bytes_per_s
    }

    /// 1 / effective bandwidth, µs per byte.
    pub fn latency_slope_us_per_byte(&self) -> f64 {
        1e6 / self.effective_bytes_per_s()
    }

    /// The latency a switch hop adds in `mode` (wire time only; add the switch's own latency).
    pub fn per_hop_latency(&self, mode: Forwarding) -> HopLatency {
        let (wait_bytes, assumption) = match mode {
            Forwarding::CutThrough => (
                ETH_PREAMBLE_SFD + ETH_MAC_HEADER,
                "forwards once preamble + SFD + MAC header (22 B) arrived".to_string(),
            ),
            Forwarding::StoreAndForward => (
                ETH_PREAMBLE_SFD + ETH_MAX_FRAME,
                format!(
                    "waits for preamble + SFD + a whole {ETH_MAX_FRAME} B frame ({} B)",
                    ETH_PREAMBLE_SFD + ETH_MAX_FRAME
                ),
            ),
        };
        HopLatency {
            mode,
            wait_bytes,
            ns: f64::from(wait_bytes) * 8.0 / self.speed.bits_per_s() as f64 * 1e9,
            assumption,
        }
    }

    /// The `--json` document: one frame size, or the RFC 2544 table when `frame` is `None`.
    pub fn report(&self, frame: Option<u32>) -> Result<EthReport, EthError> {
        let frames = match frame {
            Some(f) => vec![self.frame(f)?],
            None => self.rfc2544(),
        };
        Ok(EthReport {
            version: VERSION,
            model: self.name(),
            speed: self.speed,
            line_rate_bits_per_s: self.speed.bits_per_s(),
            phy: self.speed.phy().to_string(),
            per_frame_overhead_bytes: ETH_FRAME_OVERHEAD,
            overhead_assumption: format!(
                "each frame also costs {ETH_PREAMBLE_SFD} B preamble + SFD and a {ETH_IFG} B inter-frame gap; frame sizes include the {ETH_MAC_HEADER} B MAC header and {ETH_FCS} B FCS (RFC 2544); payload = frame - {} B (untagged)",
                ETH_MAC_HEADER + ETH_FCS
            ),
            frames,
            effective_bytes_per_s: self.effective_bytes_per_s(),
            latency_slope_us_per_byte: self.latency_slope_us_per_byte(),
            per_hop: Forwarding::ALL
                .iter()
                .map(|m| self.per_hop_latency(*m))
                .collect(),
        })
    }
}

/// `backplane model eth --json` (version 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EthReport {
    /// Document version, 1.
    pub version: u32,
    /// Link model name, `eth-SPEED`.
    pub model: String,
    /// `1g`, `10g`, `25g`, `40g` or `100g`.
    pub speed: EthSpeed,
    /// MAC data rate, bits/s.
    pub line_rate_bits_per_s: u64,
    /// The PHY line code underneath (costs the MAC rate nothing).
    pub phy: String,
    /// Wire bytes per frame beyond the frame: 20.
    pub per_frame_overhead_bytes: u32,
    /// How frame sizes and overheads are counted.
    pub overhead_assumption: String,
    /// The frame size asked for, or the RFC 2544 table.
    pub frames: Vec<FrameRate>,
    /// Payload bytes/s with 1518 B frames (the link model's effective bandwidth).
    pub effective_bytes_per_s: f64,
    /// 1 / effective bandwidth, µs per byte.
    pub latency_slope_us_per_byte: f64,
    /// Cut-through, then store-and-forward.
    pub per_hop: Vec<HopLatency>,
}

/// A named link model, as `backplane up --link MODEL` takes it: `pcie-gen3x4`, `eth-10g`.
///
/// PCIe models use a [`DEFAULT_MPS`] max payload size, 4DW headers and no ECRC; Ethernet models
/// use 1518-byte frames for their effective bandwidth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkModel {
    /// A PCIe link.
    Pcie(PcieLink),
    /// An Ethernet link.
    Eth(EthLink),
}

impl LinkModel {
    /// Payload bytes per second per direction.
    pub fn effective_bandwidth_bytes_per_s(&self) -> f64 {
        match self {
            LinkModel::Pcie(p) => p.effective_bytes_per_s(),
            LinkModel::Eth(e) => e.effective_bytes_per_s(),
        }
    }

    /// The latency one switch hop adds in `mode` (wire time only).
    pub fn per_hop_latency(&self, mode: Forwarding) -> HopLatency {
        match self {
            LinkModel::Pcie(p) => p.per_hop_latency(mode),
            LinkModel::Eth(e) => e.per_hop_latency(mode),
        }
    }

    /// 1 / effective bandwidth, µs per byte.
    pub fn latency_slope_us_per_byte(&self) -> f64 {
        1e6 / self.effective_bandwidth_bytes_per_s()
    }
}

impl FromStr for LinkModel {
    type Err = LinkModelError;

    fn from_str(s: &str) -> Result<LinkModel, LinkModelError> {
        let lower = s.trim().to_ascii_lowercase();
        let unknown = || LinkModelError::Unknown(s.to_string());
        if let Some(rest) = lower.strip_prefix("pcie-gen") {
            let (g, l) = rest.split_once('x').ok_or_else(unknown)?;
            let number = |t: &str| -> Option<u32> {
                if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                t.parse().ok()
            };
            let (g, l) = (
                number(g).ok_or_else(unknown)?,
                number(l).ok_or_else(unknown)?,
            );
            PcieLink::new(g, l, DEFAULT_MPS)
                .map(LinkModel::Pcie)
                .map_err(|reason| LinkModelError::Pcie {
                    name: s.to_string(),
                    reason,
                })
        } else if let Some(speed) = lower.strip_prefix("eth-") {
            if speed.is_empty() {
                return Err(unknown());
            }
            speed
                .parse::<EthSpeed>()
                .map(|sp| LinkModel::Eth(EthLink::new(sp)))
                .map_err(|_| LinkModelError::Eth {
                    name: s.to_string(),
                    reason: EthError::BadSpeed(speed.to_string()),
                })
        } else {
            Err(unknown())
        }
    }
}

impl fmt::Display for LinkModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkModel::Pcie(p) => f.write_str(&p.name()),
            LinkModel::Eth(e) => f.write_str(&e.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// |a - b| <= rel * |b|.
    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs()
    }

    fn pcie(g: u32, l: u32, mps: u32) -> PcieLink {
        PcieLink::new(g, l, mps).unwrap()
    }

    /// Parses a cell of Figure 1 as printed in seed 000 ("250MB/s", "1GB/s").
    fn figure_cell(s: &str) -> f64 {
        if let Some(n) = s.strip_suffix("GB/s") {
            n.parse::<f64>().unwrap() * 1e9
        } else {
            s.strip_suffix("MB/s").unwrap().parse::<f64>().unwrap() * 1e6
        }
    }

    #[test]
    fn figure_1_of_seed_000_is_reproduced_to_its_rounding() {
        // Figure 1 "PCIe Maximum theoretical bandwidth", copied cell by cell from the seed:
        // rows x1, x2, x4, x8; columns gen 1 (2.5 Gb/s), gen 2 (5 Gb/s), gen 3 (8 Gb/s).
        let figure: [(u32, [&str; 3]); 4] = [
            (1, ["250MB/s", "500MB/s", "1GB/s"]),
            (2, ["500MB/s", "1GB/s", "2GB/s"]),
            (4, ["1GB/s", "2GB/s", "4GB/s"]),
            (8, ["2GB/s", "4GB/s", "8GB/s"]),
        ];
        for (lanes, cells) in figure {
            for (i, cell) in cells.iter().enumerate() {
                let generation = i as u32 + 1;
                let fig = figure_cell(cell);
                let ours = pcie(generation, lanes, 256).theoretical_bytes_per_s();
                if generation < 3 {
                    // 8b/10b: e.g. gen 1 x1 = 2.5e9 b/s * 8/10 / 8 = 250e6 B/s, exactly.
                    assert_eq!(ours, fig, "gen{generation} x{lanes}");
                } else {
                    // 128b/130b: gen 3 x1 = 8e9 * 128/130 / 8 = 984.6e6 B/s; the figure
                    // drops the 128/130 (1.5 %) and writes 1GB/s.
                    assert!(close(ours, fig * 128.0 / 130.0, 1e-12), "gen3 x{lanes}");
                    assert_eq!((ours / 1e9).round() * 1e9, fig, "gen3 x{lanes}");
                }
            }
        }
    }

    #[test]
    fn raw_rates_and_line_codes_follow_the_generations() {
        let gts: Vec<u64> = (1..=6)
            .map(|g| pcie(g, 1, 256).mt_per_s_per_lane())
            .collect();
        assert_eq!(gts, [2_500, 5_000, 8_000, 16_000, 32_000, 64_000]);
        assert_eq!(pcie(2, 1, 256).encoding(), Encoding::B8B10);
        assert_eq!(pcie(5, 1, 256).encoding(), Encoding::B128B130);
        assert_eq!(pcie(6, 1, 256).encoding(), Encoding::Flit);
        // gen 4 x16: 16e9 * 16 / 8 = 32e9 raw; * 128/130 = 31.508e9.
        let g4 = pcie(4, 16, 256);
        assert_eq!(g4.raw_bytes_per_s(), 32e9);
        assert!(close(g4.theoretical_bytes_per_s(), 31.5077e9, 1e-5));
        // gen 6 x1: 64e9 / 8 = 8e9 raw; * 242/256 = 7.5625e9.
        assert_eq!(pcie(6, 1, 256).theoretical_bytes_per_s(), 7.5625e9);
    }

    #[test]
    fn gen1_x4_with_128_byte_payloads_delivers_820_mb_per_s() {
        // Seed 002's setting (MPS 128). After 8b/10b: 2.5e9 * 4 * 0.8 / 8 = 1000e6 B/s.
        // TLP: 1 STP + 2 seq + 16 header + 4 LCRC + 1 END = 24 B per 128 B.
        //   1000e6 * 128 / 152 = 842.105e6 B/s.
        // DLLP: (8 + 8) / 4 = 4 B per TLP.
        //   1000e6 * 128 / 156 = 820.513e6 B/s.
        let l = pcie(1, 4, 128);
        assert_eq!(l.tlp_overhead_bytes(), 24);
        assert_eq!(l.dllp_bytes_per_tlp(), 4.0);
        let s = l.steps();
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].bytes_per_s, 1250e6);
        assert_eq!(s[1].bytes_per_s, 1000e6);
        assert!(close(s[2].bytes_per_s, 842.105e6, 1e-6));
        assert!(close(s[3].bytes_per_s, 820.513e6, 1e-6));
        assert!(close(s[3].fraction_of_raw, 820.513 / 1250.0, 1e-6));
        assert_eq!(l.effective_bytes_per_s(), s[3].bytes_per_s);
    }

    #[test]
    fn gen3_x8_with_256_byte_payloads_and_3dw_headers() {
        // After 128b/130b: 8e9 * 8 * 128/130 / 8 = 7876.923e6 B/s.
        // TLP: 4 STP token + 12 header + 4 LCRC = 20 B; DLLP 4 B. Total 24 B per 256 B.
        //   7876.923e6 * 256 / 276 = 7306.132e6 (after TLP)
        //   7876.923e6 * 256 / 280 = 7201.758e6 (after DLLP)
        let l = pcie(3, 8, 256).with_header(TlpHeader::ThreeDw);
        assert_eq!(l.tlp_overhead_bytes(), 20);
        let s = l.steps();
        assert!(close(s[2].bytes_per_s, 7306.132e6, 1e-6));
        assert!(close(s[3].bytes_per_s, 7201.758e6, 1e-6));
        // ECRC adds 4 B: 256 / 284 -> 7100.325e6.
        assert!(close(
            l.with_ecrc(true).effective_bytes_per_s(),
            7100.325e6,
            1e-6
        ));
    }

    #[test]
    fn gen6_counts_flit_bytes_instead_of_per_tlp_framing() {
        // x4: 64e9 * 4 / 8 = 32e9 raw; * 242/256 = 30.25e9.
        // TLP: 16 B header only: 30.25e9 * 256 / 272 = 28.4706e9.
        // DLP: 236 of 242 bytes: 28.4706e9 * 236/242 = 27.7647e9.
        let l = pcie(6, 4, 256);
        assert_eq!(l.tlp_overhead_bytes(), 16);
        assert_eq!(l.dllp_bytes_per_tlp(), 0.0);
        let s = l.steps();
        assert_eq!(s[1].bytes_per_s, 30.25e9);
        assert!(close(s[2].bytes_per_s, 28.470_588e9, 1e-6));
        assert!(close(s[3].bytes_per_s, 27.764_706e9, 1e-6));
    }

    #[test]
    fn larger_payloads_and_newer_generations_only_ever_help() {
        for g in 1..=6 {
            let mut last = 0.0;
            for mps in [128, 256, 512, 1024, 2048, 4096] {
                let e = pcie(g, 4, mps).effective_bytes_per_s();
                assert!(e > last, "gen{g} mps {mps}");
                assert!(e < pcie(g, 4, mps).theoretical_bytes_per_s());
                last = e;
            }
        }
        for g in 1..6 {
            assert!(
                pcie(g + 1, 8, 256).effective_bytes_per_s()
                    > pcie(g, 8, 256).effective_bytes_per_s()
            );
        }
    }

    #[test]
    fn figure_12_sustained_raw_bandwidth_never_beats_the_model() {
        // Seed 000, Figure 12, "Sustained raw bandwidth": measured DMA throughput must stay
        // under the model even at the smallest payload size.
        for (g, l, measured) in [(3, 8, 5.6e9), (3, 4, 2.8e9), (2, 4, 1.5e9), (1, 4, 0.8e9)] {
            let model = pcie(g, l, 128).effective_bytes_per_s();
            assert!(measured < model, "gen{g} x{l}: {measured} vs {model}");
        }
    }

    #[test]
    fn the_expected_latency_slope_of_seed_003_is_reproduced() {
        // Seed 003: B2B expected 0.00268 µs/byte = mem 0.0004 + PCIe 0.00054 + 10GigE 0.0008
        // + PCIe 0.00054 + mem 0.0004, with a gen 1 x8 NIC; measured 0.0028.
        let pcie = pcie(1, 8, 256).latency_slope_us_per_byte();
        // 2000e6 * 256/284 = 1802.8e6 B/s -> 0.000555 µs/B.
        assert!(close(pcie, 0.000_554_7, 1e-3), "{pcie}");
        let eth = EthLink::new(EthSpeed::G10).latency_slope_us_per_byte();
        // 1500 B of payload per 1538 B on the wire at 1.25e9 B/s -> 0.00082 µs/B.
        assert!(close(eth, 0.000_820_3, 1e-3), "{eth}");
        let expected = 0.0004 + pcie + eth + pcie + 0.0004;
        assert!(close(expected, 0.00268, 0.03), "{expected}");
        assert!(expected < 0.0028);
    }

    #[test]
    fn store_and_forward_waits_for_a_max_size_packet_and_cut_through_for_the_header() {
        // gen 3 x4: 3938.46e6 B/s after encoding -> 0.2539 ns per byte.
        let l = pcie(3, 4, 256);
        let ct = l.per_hop_latency(Forwarding::CutThrough);
        assert_eq!(ct.wait_bytes, 4 + 16);
        assert!(close(ct.ns, 20.0 / 3.938_461_5, 1e-6));
        let sf = l.per_hop_latency(Forwarding::StoreAndForward);
        assert_eq!(sf.wait_bytes, 256 + 24);
        assert!(close(sf.ns, 280.0 / 3.938_461_5, 1e-6));
        // gen 6 x1: a 272 B TLP spans 2 flits = 512 B at 8e9 B/s = 64 ns; one flit 32 ns.
        let g6 = pcie(6, 1, 256);
        assert_eq!(g6.per_hop_latency(Forwarding::StoreAndForward).ns, 64.0);
        assert_eq!(g6.per_hop_latency(Forwarding::CutThrough).ns, 32.0);
        // 10GbE: (8 + 1518) B * 8 / 10e9 = 1220.8 ns; (8 + 14) B = 17.6 ns.
        let e = EthLink::new(EthSpeed::G10);
        assert!(close(
            e.per_hop_latency(Forwarding::StoreAndForward).ns,
            1220.8,
            1e-9
        ));
        assert!(close(
            e.per_hop_latency(Forwarding::CutThrough).ns,
            17.6,
            1e-9
        ));
    }

    #[test]
    fn rfc_2544_frame_rates_match_the_well_known_numbers() {
        let fps =
            |s: EthSpeed, f: u32| EthLink::new(s).frame(f).unwrap().frames_per_s.floor() as u64;
        // 10e9 / ((64 + 20) * 8) = 14,880,952.38
        assert_eq!(fps(EthSpeed::G10, 64), 14_880_952);
        // 1e9 / ((1518 + 20) * 8) = 81,274.38
        assert_eq!(fps(EthSpeed::G1, 1518), 81_274);
        // The 1 GbE column of the RFC 2544 table.
        let g1: Vec<u64> = RFC2544_FRAME_SIZES
            .iter()
            .map(|f| fps(EthSpeed::G1, *f))
            .collect();
        assert_eq!(
            g1,
            [1_488_095, 844_594, 452_898, 234_962, 119_731, 96_153, 81_274]
        );
        assert_eq!(fps(EthSpeed::G100, 64), 148_809_523);
        assert_eq!(fps(EthSpeed::G25, 64), 37_202_380);
        assert_eq!(fps(EthSpeed::G40, 64), 59_523_809);
        let table = EthLink::new(EthSpeed::G10).rfc2544();
        assert_eq!(table.len(), 7);
        // 64 B frames: 64 / 84 of the wire; payload 46 B each.
        assert!(close(table[0].wire_efficiency, 64.0 / 84.0, 1e-12));
        assert!(close(
            table[0].payload_bytes_per_s,
            14_880_952.38 * 46.0,
            1e-9
        ));
        assert!(close(table[0].l2_bits_per_s, 7.619_047_6e9, 1e-8));
    }

    #[test]
    fn jumbo_frames_are_accepted_and_sizes_outside_64_to_9216_are_not() {
        let e = EthLink::new(EthSpeed::G10);
        // 10e9 / (9236 * 8) = 135,339.98
        assert_eq!(e.frame(9216).unwrap().frames_per_s.floor(), 135_339.0);
        assert_eq!(e.frame(63), Err(EthError::BadFrame(63)));
        assert_eq!(e.frame(9217), Err(EthError::BadFrame(9217)));
        assert!(e.report(Some(0)).is_err());
        assert_eq!(e.report(None).unwrap().frames.len(), 7);
    }

    #[test]
    fn bad_pcie_parameters_are_rejected_with_what_to_use() {
        assert_eq!(PcieLink::new(7, 4, 256), Err(PcieError::BadGeneration(7)));
        assert_eq!(PcieLink::new(0, 4, 256), Err(PcieError::BadGeneration(0)));
        assert_eq!(PcieLink::new(3, 3, 256), Err(PcieError::BadLanes(3)));
        assert_eq!(PcieLink::new(3, 0, 256), Err(PcieError::BadLanes(0)));
        assert_eq!(PcieLink::new(3, 64, 256), Err(PcieError::BadLanes(64)));
        assert_eq!(PcieLink::new(3, 4, 100), Err(PcieError::BadMps(100)));
        assert_eq!(PcieLink::new(3, 4, 64), Err(PcieError::BadMps(64)));
        assert_eq!(PcieLink::new(3, 4, 8192), Err(PcieError::BadMps(8192)));
        assert_eq!(PcieLink::new(3, 4, 384), Err(PcieError::BadMps(384)));
        for w in PCIE_WIDTHS {
            assert!(PcieLink::new(3, w, 4096).is_ok());
        }
        assert!(PcieError::BadLanes(3)
            .to_string()
            .contains("1, 2, 4, 8, 12, 16 or 32"));
        assert!(PcieError::BadMps(100).to_string().contains("128"));
    }

    #[test]
    fn link_model_names_parse_and_print_back() {
        for name in [
            "pcie-gen3x4",
            "pcie-gen2x8",
            "pcie-gen6x16",
            "pcie-gen1x1",
            "eth-1g",
            "eth-10g",
            "eth-100g",
        ] {
            let m: LinkModel = name.parse().unwrap();
            assert_eq!(m.to_string(), name);
        }
        let m: LinkModel = "PCIe-Gen3x4".parse().unwrap();
        assert_eq!(m, LinkModel::Pcie(pcie(3, 4, DEFAULT_MPS)));
        assert_eq!(
            "eth-25g".parse::<LinkModel>().unwrap(),
            LinkModel::Eth(EthLink::new(EthSpeed::G25))
        );
        let m: LinkModel = "pcie-gen3x4".parse().unwrap();
        // 3938.46e6 * 256 / (256 + 24 + 4) = 3550.16e6 B/s.
        assert!(close(m.effective_bandwidth_bytes_per_s(), 3550.16e6, 1e-6));
        assert!(close(m.latency_slope_us_per_byte(), 1.0 / 3550.16, 1e-6));
        assert_eq!(m.per_hop_latency(Forwarding::CutThrough).wait_bytes, 20);
    }

    #[test]
    fn bad_link_model_names_say_what_to_use() {
        for bad in [
            "x",
            "",
            "pcie",
            "pcie-gen",
            "pcie-genx4",
            "pcie-gen3x",
            "pcie-gen3x+4",
            "pcie-gen3",
            "eth-",
            "ib-100g",
            "pcie-gen3x4x",
        ] {
            let e = bad.parse::<LinkModel>().unwrap_err();
            assert_eq!(e, LinkModelError::Unknown(bad.to_string()), "{bad}");
        }
        assert_eq!(
            "x".parse::<LinkModel>().unwrap_err().to_string(),
            "unknown link model 'x': use pcie-genGxL (G 1-6, L 1, 2, 4, 8, 12, 16 or 32) or eth-SPEED (1g, 10g, 25g, 40g, 100g)"
        );
        assert_eq!(
            "pcie-gen7x4".parse::<LinkModel>().unwrap_err().to_string(),
            "link model 'pcie-gen7x4': PCIe generation 7 is not modelled: use 1 to 6"
        );
        assert!(matches!(
            "pcie-gen3x3".parse::<LinkModel>(),
            Err(LinkModelError::Pcie {
                reason: PcieError::BadLanes(3),
                ..
            })
        ));
        assert_eq!(
            "eth-2g".parse::<LinkModel>().unwrap_err().to_string(),
            "link model 'eth-2g': unknown Ethernet speed '2g': use 1g, 10g, 25g, 40g or 100g"
        );
    }

    #[test]
    fn ethernet_speeds_parse_loosely_and_reject_the_rest() {
        assert_eq!("10g".parse(), Ok(EthSpeed::G10));
        assert_eq!("10G".parse(), Ok(EthSpeed::G10));
        assert_eq!("100".parse(), Ok(EthSpeed::G100));
        assert_eq!("40gbps".parse(), Ok(EthSpeed::G40));
        assert_eq!(
            "2g".parse::<EthSpeed>(),
            Err(EthError::BadSpeed("2g".into()))
        );
        assert_eq!("".parse::<EthSpeed>(), Err(EthError::BadSpeed("".into())));
    }

    #[test]
    fn json_documents_carry_version_1_and_every_step() {
        let v = serde_json::to_value(pcie(3, 4, 256).report()).unwrap();
        assert_eq!(v["version"], 1);
        assert_eq!(v["model"], "pcie-gen3x4");
        assert_eq!(v["header"], "4dw");
        let steps: Vec<&str> = v["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["step"].as_str().unwrap())
            .collect();
        assert_eq!(steps, ["raw", "encoding", "tlp", "dllp"]);
        assert_eq!(v["per_hop"][1]["mode"], "store-and-forward");
        let back: PcieReport = serde_json::from_value(v).unwrap();
        assert_eq!(back, pcie(3, 4, 256).report());
        let e =
            serde_json::to_value(EthLink::new(EthSpeed::G10).report(Some(64)).unwrap()).unwrap();
        assert_eq!(e["version"], 1);
        assert_eq!(e["speed"], "10g");
        assert_eq!(e["frames"][0]["frame_bytes"], 64);
    }
}
