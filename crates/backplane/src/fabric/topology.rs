//! Fabric topologies (seed 000 §3): **star** — a central switch, any node reaches any node in
//! one switch hop — and **distributed** — only the point-to-point links declared, as in the
//! OpenVPX 2-slot and 3-slot layouts; traffic between nodes without a direct link is forwarded
//! by intermediate nodes, and every such hop is counted.
//!
//! A topology file is TOML:
//!
//! ```toml
//! kind = "distributed"          # or "star"
//! link = "pcie-gen2x4"          # model of every link unless a link says otherwise
//! forwarding = "cut-through"    # or "store-and-forward"
//! nodes = 3                     # optional: defaults to the highest slot a link names
//!
//! [[links]]
//! a = 1
//! b = 2
//!
//! [[links]]
//! a = 1
//! b = 3
//! model = "pcie-gen2x8"
//! ```
//!
//! Errors name the line. Sans-IO: parsing and routing only.
#![forbid(unsafe_code)]

use std::collections::VecDeque;

use serde::Deserialize;
use toml::Spanned;

use crate::model::{Forwarding, LinkModel};
use crate::wire::{LinkRepr, MAX_NODES};

/// Star or distributed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A central switch.
    Star,
    /// Point-to-point links only.
    Distributed,
}

/// One declared link (undirected; both directions have the model's bandwidth).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// One end.
    pub a: u32,
    /// The other end.
    pub b: u32,
    /// Its model.
    pub model: LinkRepr,
}

/// A parsed, checked topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Star or distributed.
    pub kind: Kind,
    /// Node count.
    pub nodes: u32,
    /// The model of every node's link to the switch (star), or the default (distributed).
    pub link: LinkRepr,
    /// Declared links (distributed only).
    pub links: Vec<Link>,
}

/// Why one of the fabric's TOML files (a topology, a hosts file) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: {message}")]
pub struct FileError {
    /// File name as given.
    pub file: String,
    /// 1-based line of the offending entry.
    pub line: usize,
    /// What is wrong and what to do.
    pub message: String,
}

/// Why a topology file was refused.
pub type TopologyError = FileError;

impl FileError {
    /// The error at byte `offset` of `text` (named by its line).
    pub(crate) fn at(file: &str, text: &str, offset: usize, message: String) -> Self {
        Self {
            file: file.to_owned(),
            line: text[..offset.min(text.len())].matches('\n').count() + 1,
            message,
        }
    }

    /// A TOML syntax or shape error, in one line.
    pub(crate) fn toml(file: &str, text: &str, e: &toml::de::Error) -> Self {
        let at = e.span().map_or(0, |s| s.start);
        let one_line: Vec<&str> = e.message().lines().map(str::trim).collect();
        Self::at(file, text, at, one_line.join("; "))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    kind: Spanned<String>,
    link: Spanned<String>,
    #[serde(default)]
    forwarding: Option<Spanned<String>>,
    #[serde(default)]
    nodes: Option<Spanned<u32>>,
    #[serde(default)]
    links: Vec<Spanned<RawLink>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLink {
    a: u32,
    b: u32,
    #[serde(default)]
    model: Option<String>,
}

impl Topology {
    /// Parses and checks a topology file's text. `file` names it in errors.
    pub fn parse(file: &str, text: &str) -> Result<Self, TopologyError> {
        let err = |offset: usize, message: String| FileError::at(file, text, offset, message);
        let raw: RawFile = toml::from_str(text).map_err(|e| FileError::toml(file, text, &e))?;
        let kind = match raw.kind.get_ref().as_str() {
            "star" => Kind::Star,
            "distributed" => Kind::Distributed,
            other => {
                return Err(err(
                    raw.kind.span().start,
                    format!("kind '{other}' is not 'star' or 'distributed'"),
                ))
            }
        };
        let forwarding = match raw.forwarding.as_ref().map(|f| f.get_ref().as_str()) {
            None | Some("cut-through") => Forwarding::CutThrough,
            Some("store-and-forward") => Forwarding::StoreAndForward,
            Some(other) => {
                let at = raw.forwarding.as_ref().map_or(0, |f| f.span().start);
                return Err(err(
                    at,
                    format!("forwarding '{other}' is not 'cut-through' or 'store-and-forward'"),
                ));
            }
        };
        let resolve = |name: &str, at: usize| -> Result<LinkRepr, TopologyError> {
            let m: LinkModel = name.parse().map_err(|e| err(at, format!("{e}")))?;
            Ok(LinkRepr {
                name: name.to_ascii_lowercase(),
                bytes_per_s: m.effective_bandwidth_bytes_per_s() as u64,
                hop_ns: m.per_hop_latency(forwarding).ns.round() as u64,
                store_and_forward: forwarding == Forwarding::StoreAndForward,
            })
        };
        let link = resolve(raw.link.get_ref(), raw.link.span().start)?;
        let highest = raw
            .links
            .iter()
            .map(|l| l.get_ref().a.max(l.get_ref().b))
            .max()
            .unwrap_or(0);
        let nodes = match &raw.nodes {
            Some(n) => {
                let v = *n.get_ref();
                if v == 0 || v > MAX_NODES {
                    return Err(err(
                        n.span().start,
                        format!("nodes = {v} is out of range 1..={MAX_NODES}"),
                    ));
                }
                v
            }
            None if highest > 0 => highest,
            None => {
                return Err(err(
                    0,
                    "say how many nodes there are (nodes = N) or declare links".into(),
                ))
            }
        };
        let mut links = Vec::new();
        for l in &raw.links {
            let at = l.span().start;
            let r = l.get_ref();
            if kind == Kind::Star {
                return Err(err(
                    at,
                    "a star topology has no point-to-point links: every node links to the switch \
                     (use kind = \"distributed\" to declare links)"
                        .into(),
                ));
            }
            for end in [r.a, r.b] {
                if end == 0 || end > nodes {
                    return Err(err(
                        at,
                        format!("slot {end} does not exist (nodes 1..={nodes})"),
                    ));
                }
            }
            if r.a == r.b {
                return Err(err(at, format!("slot {} is linked to itself", r.a)));
            }
            if links
                .iter()
                .any(|x: &Link| (x.a, x.b) == (r.a, r.b) || (x.a, x.b) == (r.b, r.a))
            {
                return Err(err(at, format!("link {}-{} is declared twice", r.a, r.b)));
            }
            let model = match &r.model {
                Some(m) => resolve(m, at)?,
                None => link.clone(),
            };
            links.push(Link {
                a: r.a,
                b: r.b,
                model,
            });
        }
        let t = Topology {
            kind,
            nodes,
            link,
            links,
        };
        if kind == Kind::Distributed {
            for n in 2..=nodes {
                if t.route(1, n, |_| true).is_none() {
                    return Err(err(
                        0,
                        format!("slot {n} cannot be reached from slot 1: declare a link to it"),
                    ));
                }
            }
        }
        Ok(t)
    }

    /// The model of the direct link between `a` and `b`, if any.
    pub fn link_between(&self, a: u32, b: u32) -> Option<&LinkRepr> {
        self.links
            .iter()
            .find(|l| (l.a, l.b) == (a, b) || (l.a, l.b) == (b, a))
            .map(|l| &l.model)
    }

    /// The shortest path from `src` to `dst` (both included) through nodes for which
    /// `usable` holds (intermediates only; the ends are the caller's business). Star: direct.
    pub fn route(&self, src: u32, dst: u32, usable: impl Fn(u32) -> bool) -> Option<Vec<u32>> {
        if self.kind == Kind::Star || src == dst {
            return Some(vec![src, dst]);
        }
        let n = self.nodes as usize;
        let mut prev = vec![0u32; n + 1];
        let mut seen = vec![false; n + 1];
        let mut q = VecDeque::from([src]);
        seen[src as usize] = true;
        while let Some(u) = q.pop_front() {
            if u == dst {
                let mut path = vec![dst];
                let mut x = dst;
                while x != src {
                    x = prev[x as usize];
                    path.push(x);
                }
                path.reverse();
                return Some(path);
            }
            if u != src && !usable(u) {
                continue; // cannot forward through it
            }
            for l in &self.links {
                let v = if l.a == u {
                    l.b
                } else if l.b == u {
                    l.a
                } else {
                    continue;
                };
                if !seen[v as usize] {
                    seen[v as usize] = true;
                    prev[v as usize] = u;
                    q.push_back(v);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THREE_SLOT: &str = r#"# OpenVPX 3-slot distributed layout: slot 1 links to 2 and 3
kind = "distributed"
link = "pcie-gen2x4"

[[links]]
a = 1
b = 2

[[links]]
a = 1
b = 3
model = "pcie-gen2x8"
"#;

    #[test]
    fn the_openvpx_three_slot_layout_routes_two_to_three_through_slot_one() {
        let t = Topology::parse("3slot.toml", THREE_SLOT).unwrap();
        assert_eq!((t.kind, t.nodes, t.links.len()), (Kind::Distributed, 3, 2));
        assert_eq!(t.route(2, 3, |_| true), Some(vec![2, 1, 3]));
        assert_eq!(t.route(1, 3, |_| true), Some(vec![1, 3]));
        assert_eq!(t.route(2, 3, |n| n != 1), None, "the hub is down");
        assert_eq!(t.link_between(3, 1).unwrap().name, "pcie-gen2x8");
        assert_eq!(t.link_between(1, 2).unwrap().name, "pcie-gen2x4");
        assert!(t.link_between(2, 3).is_none());
    }

    #[test]
    fn a_chain_takes_every_hop_and_a_star_takes_none() {
        let chain = "kind = \"distributed\"\nlink = \"eth-10g\"\nlinks = [{a = 1, b = 2}, {a = 2, b = 3}, {a = 3, b = 4}]\n";
        let t = Topology::parse("chain", chain).unwrap();
        assert_eq!(t.route(1, 4, |_| true), Some(vec![1, 2, 3, 4]));
        let star = Topology::parse(
            "star",
            "kind = \"star\"\nlink = \"pcie-gen3x4\"\nnodes = 6\n",
        )
        .unwrap();
        assert_eq!(star.route(2, 5, |_| false), Some(vec![2, 5]));
        assert_eq!(star.nodes, 6);
    }

    #[test]
    fn errors_name_the_line_of_the_bad_entry() {
        let cases = [
            ("kind = \"ring\"\nlink = \"eth-10g\"\nnodes = 2\n", 1, "not 'star'"),
            ("kind = \"star\"\n\nlink = \"pcie-gen9x4\"\nnodes = 2\n", 3, "pcie-gen9x4"),
            (
                "kind = \"distributed\"\nlink = \"eth-10g\"\nnodes = 2\n[[links]]\na = 1\nb = 5\n",
                4,
                "slot 5 does not exist",
            ),
            (
                "kind = \"distributed\"\nlink = \"eth-10g\"\n[[links]]\na = 1\nb = 2\n[[links]]\na = 2\nb = 1\n",
                6,
                "declared twice",
            ),
            ("kind = \"star\"\nlink = \"eth-10g\"\nnodes = 2\ncolour = \"red\"\n", 4, "unknown field"),
            ("kind = \"star\"\nlink = \"eth-10g\"\nnodes = 2\n[[links]]\na = 1\nb = 2\n", 4, "star"),
            ("kind = \"distributed\"\nlink = \"eth-10g\"\nnodes = 3\n[[links]]\na = 1\nb = 2\n", 1, "slot 3 cannot be reached"),
            ("kind = \"star\"\nlink = \"eth-10g\"\nnodes = 0\n", 3, "out of range"),
            ("kind = \"star\"\nlink = \"eth-10g\"\nnodes = [\n", 4, "invalid array; expected"),
        ];
        for (text, line, want) in cases {
            let e = Topology::parse("t.toml", text).unwrap_err();
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.to_string().contains(want), "{text:?}: {e}");
            assert!(
                e.to_string().starts_with(&format!("t.toml:{line}: ")),
                "{e}"
            );
        }
    }
}
