//! A fabric across hosts (issue 19): which host runs which slots, and what the hosts'
//! supervisors say to each other. Sans-IO: parsing, checks and messages; the supervisor
//! carries the messages over UCX (`backplane-ucx`) and applies what they say.
//!
//! A hosts file is TOML, the same file on every host:
//!
//! ```toml
//! [[hosts]]
//! name = "a"                     # this host's name (`up --host a`)
//! address = "10.77.0.1:13400"    # where its supervisor listens for the others (IPv4:port)
//! slots = [1, 2]                 # the node slots it runs
//!
//! [[hosts]]
//! name = "b"
//! address = "10.77.0.2:13400"
//! slots = [3, 4]
//! ```
//!
//! Slots are global: every slot 1..=N belongs to exactly one host. Each host listens on its
//! address; a host dials every host listed before it and is dialled by every host after it, so
//! each pair has one connection and the first host needs nobody to start.
#![forbid(unsafe_code)]

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::wire::MAX_NODES;

/// What the supervisors of one fabric speak to each other; bumped on any change.
pub const HOSTS_PROTOCOL: u32 = 6;
/// How often a host reports its slots to every joined host (the heartbeat).
pub const REPORT_PERIOD_MS: u64 = 100;
/// A joined host not heard from for this long is lost: its nodes go DOWN (`host-lost`).
pub const LOST_AFTER_MS: u64 = 600;
/// How long `up` waits by default to join every host listed before this one.
pub const JOIN_TIMEOUT_MS: u64 = 10_000;

/// One host of the fabric.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostSpec {
    /// Its name (`up --host NAME`).
    pub name: String,
    /// Where its supervisor listens for the others.
    pub address: SocketAddr,
    /// The slots it runs, ascending.
    pub slots: Vec<u32>,
}

/// The fabric's hosts and which one this is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPlan {
    /// Every host, in the file's order.
    pub hosts: Vec<HostSpec>,
    /// Index of this host in `hosts`.
    pub me: usize,
    /// The file it came from (for messages).
    pub file: String,
    /// How long `up` waits to join every host listed before this one.
    #[serde(default = "default_join_timeout")]
    pub join_timeout_ms: u64,
}

fn default_join_timeout() -> u64 {
    JOIN_TIMEOUT_MS
}

/// Why a hosts file or `--host` was refused (line 1 for whole-file problems).
pub type HostsError = super::topology::FileError;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    hosts: Vec<Spanned<RawHost>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHost {
    name: String,
    address: String,
    slots: Vec<u32>,
}

impl HostPlan {
    /// Parses and checks a hosts file's text; `me` names this host. `file` names it in errors.
    pub fn parse(file: &str, text: &str, me: &str) -> Result<Self, HostsError> {
        let err = |offset: usize, message: String| HostsError::at(file, text, offset, message);
        let raw: RawFile = toml::from_str(text).map_err(|e| HostsError::toml(file, text, &e))?;
        if raw.hosts.is_empty() {
            return Err(err(0, "no [[hosts]] declared".into()));
        }
        let mut hosts: Vec<HostSpec> = Vec::new();
        let mut owner: Vec<Option<String>> = vec![None; MAX_NODES as usize + 1];
        for h in &raw.hosts {
            let at = h.span().start;
            let r = h.get_ref();
            let name_ok = !r.name.is_empty()
                && r.name.len() <= 32
                && r.name
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_');
            if !name_ok {
                return Err(err(
                    at,
                    format!(
                        "host name '{}' must be 1-32 letters, digits, '-' or '_'",
                        r.name
                    ),
                ));
            }
            if hosts.iter().any(|x| x.name == r.name) {
                return Err(err(at, format!("host '{}' is declared twice", r.name)));
            }
            let address: SocketAddr = r.address.parse().map_err(|_| {
                err(
                    at,
                    format!(
                        "host '{}': address '{}' is not IPv4:PORT (e.g. 10.0.0.1:13400)",
                        r.name, r.address
                    ),
                )
            })?;
            if !address.is_ipv4() || address.port() == 0 {
                return Err(err(
                    at,
                    format!(
                        "host '{}': address {address} must be IPv4 with a port other than 0",
                        r.name
                    ),
                ));
            }
            if let Some(o) = hosts.iter().find(|x| x.address == address) {
                return Err(err(
                    at,
                    format!(
                        "hosts '{}' and '{}' both listen on {address}",
                        o.name, r.name
                    ),
                ));
            }
            if r.slots.is_empty() {
                return Err(err(at, format!("host '{}' runs no slots", r.name)));
            }
            let mut slots = r.slots.clone();
            slots.sort_unstable();
            for &s in &slots {
                if s == 0 || s > MAX_NODES {
                    return Err(err(
                        at,
                        format!(
                            "host '{}': slot {s} is out of range 1..={MAX_NODES}",
                            r.name
                        ),
                    ));
                }
                if let Some(o) = &owner[s as usize] {
                    return Err(err(
                        at,
                        format!("hosts '{o}' and '{}' both claim slot {s}", r.name),
                    ));
                }
                owner[s as usize] = Some(r.name.clone());
            }
            hosts.push(HostSpec {
                name: r.name.clone(),
                address,
                slots,
            });
        }
        let nodes = hosts
            .iter()
            .flat_map(|h| h.slots.iter().copied())
            .max()
            .unwrap_or(0);
        if let Some(gap) = (1..=nodes).find(|&s| owner[s as usize].is_none()) {
            return Err(err(
                0,
                format!("no host runs slot {gap}: slots 1..={nodes} must each belong to a host"),
            ));
        }
        let Some(me) = hosts.iter().position(|h| h.name == me) else {
            let names: Vec<&str> = hosts.iter().map(|h| h.name.as_str()).collect();
            return Err(err(
                0,
                format!(
                    "--host {me} is not one of the hosts declared here ({})",
                    names.join(", ")
                ),
            ));
        };
        Ok(Self {
            hosts,
            me,
            file: file.to_owned(),
            join_timeout_ms: JOIN_TIMEOUT_MS,
        })
    }

    /// The fabric's node count: the highest slot.
    pub fn nodes(&self) -> u32 {
        self.hosts
            .iter()
            .flat_map(|h| h.slots.iter().copied())
            .max()
            .unwrap_or(0)
    }

    /// This host.
    pub fn this(&self) -> &HostSpec {
        &self.hosts[self.me]
    }

    /// True if this host runs `slot`.
    pub fn is_local(&self, slot: u32) -> bool {
        self.this().slots.contains(&slot)
    }

    /// The index of the host that runs `slot`.
    pub fn owner(&self, slot: u32) -> Option<usize> {
        self.hosts.iter().position(|h| h.slots.contains(&slot))
    }

    /// True if this host dials host `i` (it is listed before this one); otherwise `i` dials us.
    pub fn dials(&self, i: usize) -> bool {
        i < self.me
    }

    /// What this host says when it joins another (`net`: IP over the fabric's subnet and
    /// MTU, as `up` was given them, or None for `--no-net`).
    /// `link`: the emulated link model as `up --link` named it (None: memory speed).
    pub fn join(
        &self,
        fabric: &str,
        window_size: u64,
        net: Option<String>,
        link: Option<String>,
    ) -> HostMsg {
        HostMsg::Join {
            protocol: HOSTS_PROTOCOL,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            fabric: fabric.to_owned(),
            host: self.this().name.clone(),
            window_size,
            net,
            link,
            hosts: self.hosts.clone(),
        }
    }

    /// Checks another host's `Join` against this host's view of the fabric: the index of the
    /// joining host, or the one-line refusal naming the mismatch (sent back and logged).
    pub fn check_join(
        &self,
        msg: &HostMsg,
        fabric: &str,
        window_size: u64,
        net: &Option<String>,
        link: &Option<String>,
    ) -> Result<usize, String> {
        let HostMsg::Join {
            protocol,
            version,
            fabric: f,
            host,
            window_size: w,
            net: n,
            link: l,
            hosts,
        } = msg
        else {
            return Err("the first message must be a join".into());
        };
        let me = &self.this().name;
        if *protocol != HOSTS_PROTOCOL || version != env!("CARGO_PKG_VERSION") {
            return Err(format!(
                "host '{host}' runs backplane {version} (host protocol {protocol}) but host \
                 '{me}' runs {} (protocol {HOSTS_PROTOCOL}): run the same version on every host",
                env!("CARGO_PKG_VERSION")
            ));
        }
        if f != fabric {
            return Err(format!(
                "host '{host}' belongs to fabric '{f}', host '{me}' to '{fabric}'"
            ));
        }
        let Some(i) = self.hosts.iter().position(|h| &h.name == host) else {
            return Err(format!(
                "host '{host}' is not in host '{me}''s hosts file ({})",
                self.file
            ));
        };
        if i == self.me {
            return Err(format!(
                "host '{host}' is this host's own name: give each host its own --host"
            ));
        }
        if *w != window_size {
            return Err(format!(
                "host '{host}' has {w}-byte windows, host '{me}' {window_size}: use the same --window-size on every host"
            ));
        }
        if n != net {
            let say = |x: &Option<String>| x.clone().unwrap_or_else(|| "--no-net".into());
            return Err(format!(
                "host '{host}' runs IP over the fabric as {}, host '{me}' as {}: use the same \
                 --subnet and --mtu (or --no-net) on every host",
                say(n),
                say(net)
            ));
        }
        if l != link {
            let say = |x: &Option<String>| match x {
                None => "no link model".into(),
                Some(m) if m.starts_with("topology:") => format!("a {m}"),
                Some(m) => format!("--link {m}"),
            };
            return Err(format!(
                "host '{host}' emulates {}, host '{me}' {}: use the same --link and \
                 --forwarding or the same --topology file (or none) on every host",
                say(l),
                say(link)
            ));
        }
        if hosts != &self.hosts {
            // (join_timeout_ms is each host's own business: not compared.)
            let diff = describe_difference(&self.hosts, hosts);
            return Err(format!(
                "host '{host}''s hosts file differs from host '{me}''s: {diff}; use the same file on every host"
            ));
        }
        Ok(i)
    }
}

/// The first difference between two host tables, in words.
fn describe_difference(ours: &[HostSpec], theirs: &[HostSpec]) -> String {
    for h in ours {
        match theirs.iter().find(|t| t.name == h.name) {
            None => return format!("it does not list host '{}'", h.name),
            Some(t) if t.slots != h.slots => {
                return format!(
                    "it gives host '{}' slots {:?}, we give it {:?}",
                    h.name, t.slots, h.slots
                )
            }
            Some(t) if t.address != h.address => {
                return format!(
                    "it puts host '{}' at {}, we at {}",
                    h.name, t.address, h.address
                )
            }
            _ => {}
        }
    }
    if let Some(t) = theirs
        .iter()
        .find(|t| !ours.iter().any(|h| h.name == t.name))
    {
        return format!("it lists host '{}', which we do not", t.name);
    }
    "the hosts are listed in another order".into()
}

/// One slot as its host reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotReport {
    /// Slot.
    pub slot: u32,
    /// `NodeState` as its number.
    pub state: u32,
    /// The generation on its own host.
    pub generation: u32,
    /// `DownReason` as its number.
    pub reason: u32,
    /// The agent's pid on its host (0: none).
    pub pid: u32,
    /// Its datagram counters on its host: sent msgs, sent bytes, received msgs, received
    /// bytes, drops.
    #[serde(default)]
    pub counters: [u64; 5],
    /// Its open endpoints on its host.
    #[serde(default)]
    pub endpoints: u32,
}

/// A message between the supervisors of one fabric (JSON in one UCX active message).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum HostMsg {
    /// The dialling host introduces itself.
    Join {
        /// [`HOSTS_PROTOCOL`].
        protocol: u32,
        /// The backplane version.
        version: String,
        /// The fabric's name.
        fabric: String,
        /// The dialling host's name.
        host: String,
        /// Window size of every node.
        window_size: u64,
        /// IP over the fabric: subnet and MTU (None: `--no-net`).
        net: Option<String>,
        /// The emulated link model and forwarding mode (None: memory speed). (Absent in an
        /// older host's join, which is then refused for its version, not as malformed.)
        #[serde(default)]
        link: Option<String>,
        /// The whole hosts table as the dialling host read it.
        hosts: Vec<HostSpec>,
    },
    /// The join is accepted.
    Welcome {
        /// The accepting host's name.
        host: String,
        /// The port its datagram bridge listens on (same address): the joining host's
        /// bridge dials it.
        data_port: u16,
    },
    /// The join is refused, with the reason (one line).
    Refuse {
        /// Why.
        reason: String,
    },
    /// The sender's slots (sent every [`REPORT_PERIOD_MS`]: also the heartbeat).
    Slots {
        /// The sender's name.
        host: String,
        /// Its slots.
        slots: Vec<SlotReport>,
        /// A distributed topology: the datagrams and bytes its senders had forwarded through
        /// each node (of any host; its copy of the node's counters), where not zero: `status`
        /// adds every host's.
        #[serde(default)]
        forwarded: Vec<(u32, u64, u64)>,
    },
    /// The sender is shutting down (`down`): its nodes go DOWN at once, not after a timeout.
    Bye {
        /// The sender's name.
        host: String,
    },
    /// Asks for a datagram route from endpoint `src` (a node of the asking host) to endpoint
    /// `dst` (a node of the asked host): a ring into `dst` that the asked host's bridge feeds.
    OpenRoute {
        /// The asking host's number for the route.
        route: u64,
        /// Sender (node, port).
        src: (u32, u32),
        /// Receiver (node, port).
        dst: (u32, u32),
        /// The sender sends datagrams straight to a receiver that takes them so (its endpoint
        /// has a worker of its own): the ring then only marks the route's life.
        #[serde(default)]
        direct: bool,
    },
    /// The route is open; at most `window` bytes may be in flight on it.
    RouteOpened {
        /// The route.
        route: u64,
        /// The destination ring's size.
        window: u64,
        /// The receiver takes datagrams straight from the sender's process: the TCP port of
        /// its listener, on this host's address.
        #[serde(default)]
        direct: Option<u16>,
    },
    /// The route cannot be opened: the fabric's error class (`not_found`, `node_down`,
    /// `no_space`, `invalid`) and why, in one line.
    RouteRefused {
        /// The route.
        route: u64,
        /// Error class.
        kind: crate::fabric::ctl::ErrorKind,
        /// Why.
        message: String,
    },
    /// The receiving side tore its ring down (the receiver closed, or its node went DOWN):
    /// the sender must see its channel closed.
    RouteClosed {
        /// The route.
        route: u64,
    },
    /// The asking side gave a route up before it was used (its sender went away meanwhile).
    CloseRoute {
        /// The route.
        route: u64,
    },
    /// Connects queue pair `from` (node, QPN: the asking host's, of type `qp_type`, inbound
    /// ring `ring_len` bytes) to queue pair `to` (the asked host's): the asked host checks
    /// `to` exists and is of that type, makes a shadow of `from` for it to write to, and its
    /// bridge starts mirroring the two.
    OpenQp {
        /// The asking host's number for the request.
        tag: u64,
        /// The asking host's QP (node, QPN).
        from: (u32, u32),
        /// Its transport (2 RC, 3 UC).
        qp_type: u32,
        /// Its inbound ring's size.
        ring_len: u32,
        /// The asked host's QP (node, QPN).
        to: (u32, u32),
        /// The datagram port of the asking QP's process, if it carries its pairs itself.
        #[serde(default)]
        direct: Option<u32>,
    },
    /// The asked QP exists: its inbound ring's size (the shadow the asking host makes).
    QpOpened {
        /// The request.
        tag: u64,
        /// The asked QP's inbound ring size.
        ring_len: u32,
        /// The datagram port of the asked QP's process, if it carries its pairs itself (the
        /// pair is direct when both ports are named).
        #[serde(default)]
        direct: Option<u32>,
    },
    /// The asked QP does not exist or does not match: the error class and why, in one line.
    QpRefused {
        /// The request.
        tag: u64,
        /// Error class.
        kind: crate::fabric::ctl::ErrorKind,
        /// Why.
        message: String,
    },
    /// Asks for region `rkey` of the asked host's QP `peer`, for the asking host's QP `qp`
    /// connected to it (RDMA WRITE, READ, atomics): the asked host checks the region is in
    /// the peer's protection domain and its bridge maps it to carry out `qp`'s requests.
    GrantMr {
        /// The asking host's number for the request.
        tag: u64,
        /// The asking QP (node, QPN).
        qp: (u32, u32),
        /// Its peer on the asked host.
        peer: (u32, u32),
        /// The region.
        rkey: u32,
    },
    /// Asks for region `rkey` of the asked host's node `node` for the DMA engines of a
    /// process on the asking host's node `from.0`, through the DMA pair `from` (node, a QPN
    /// with [`crate::wire::verbs::DMA_PAIR_QPN`]): checked as a DMA grant on one host (the
    /// region allows remote access), mapped by the asked host's bridge. `MrOpened` or
    /// `MrRefused` answers.
    GrantDma {
        /// The asking host's number for the request.
        tag: u64,
        /// The DMA pair on the asking host (its node, its number).
        from: (u32, u32),
        /// The region's node (the asked host's).
        node: u32,
        /// The region.
        rkey: u32,
    },
    /// The region is granted: its size, access flags, whether writable, the owner's address.
    MrOpened {
        /// The request.
        tag: u64,
        /// Data bytes.
        len: u64,
        /// `IBV_ACCESS_*` flags.
        access: u32,
        /// Remote writes or atomics allowed.
        writable: bool,
        /// The owner's address of its first byte.
        iova: u64,
    },
    /// The region is refused: the error class and why, in one line.
    MrRefused {
        /// The request.
        tag: u64,
        /// Error class.
        kind: crate::fabric::ctl::ErrorKind,
        /// Why.
        message: String,
    },
    /// The sender's queue pair `qp` (node, QPN) was destroyed: every QP of the receiving host
    /// connected to it sees its peer gone, and its shadow goes.
    QpGone {
        /// The destroyed QP.
        qp: (u32, u32),
    },
}

impl HostMsg {
    /// Decodes a message from another host (untrusted bytes: any error is a refusal).
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("a malformed host message: {e}"))
    }

    /// Encodes a message.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("plain data serialises")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = "[[hosts]]\nname = \"a\"\naddress = \"10.77.0.1:13400\"\nslots = [1, 2]\n\n[[hosts]]\nname = \"b\"\naddress = \"10.77.0.2:13400\"\nslots = [4, 3]\n";

    #[test]
    fn a_two_host_file_gives_global_slots_and_who_dials_whom() {
        let a = HostPlan::parse("h.toml", TWO, "a").unwrap();
        let b = HostPlan::parse("h.toml", TWO, "b").unwrap();
        assert_eq!(a.nodes(), 4);
        assert_eq!(b.this().slots, vec![3, 4]);
        assert!(a.is_local(2) && !a.is_local(3) && b.is_local(3));
        assert_eq!(a.owner(4), Some(1));
        assert!(
            !a.dials(1) && b.dials(0),
            "the later host dials the earlier"
        );
        let join = b.join("f", 1 << 20, None, None);
        assert_eq!(a.check_join(&join, "f", 1 << 20, &None, &None), Ok(1));
        let back = HostMsg::decode(&join.encode()).unwrap();
        assert_eq!(back, join);
    }

    #[test]
    fn every_mismatch_is_refused_naming_it() {
        let a = HostPlan::parse("h.toml", TWO, "a").unwrap();
        let b = HostPlan::parse("h.toml", TWO, "b").unwrap();
        let refuse = |m: HostMsg, w: u64| a.check_join(&m, "f", w, &None, &None).unwrap_err();
        assert!(refuse(b.join("g", 4096, None, None), 4096).contains("belongs to fabric 'g'"));
        assert!(refuse(b.join("f", 8192, None, None), 4096).contains("same --window-size"));
        let mut other = b.clone();
        other.hosts[1].slots = vec![3, 4, 5];
        assert!(refuse(other.join("f", 4096, None, None), 4096)
            .contains("gives host 'b' slots [3, 4, 5]"));
        let mut old = b.join("f", 4096, None, None);
        if let HostMsg::Join { version, .. } = &mut old {
            *version = "0.0.1".into();
        }
        let e = refuse(old, 4096);
        assert!(
            e.contains("runs backplane 0.0.1") && e.contains("same version"),
            "{e}"
        );
        assert!(refuse(a.join("f", 4096, None, None), 4096).contains("own name"));
        assert!(HostMsg::decode(b"{\"msg\":\"nope\"}").is_err());
        let e = refuse(
            b.join("f", 4096, Some("10.9.0.0/24 mtu 9000".into()), None),
            4096,
        );
        assert!(
            e.contains("as 10.9.0.0/24 mtu 9000, host 'a' as --no-net"),
            "{e}"
        );
        let e = refuse(
            b.join("f", 4096, None, Some("eth-1g cut-through".into())),
            4096,
        );
        assert!(
            e.contains("emulates --link eth-1g cut-through, host 'a' no link model"),
            "{e}"
        );
        assert!(!refuse(b.join("g", 4096, None, None), 4096).contains('\n'));
    }

    #[test]
    fn bad_files_are_refused_with_the_line() {
        let cases = [
            ("hosts = []\n", "no [[hosts]]"),
            (
                "[[hosts]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nslots = [1]\n[[hosts]]\nname = \"b\"\naddress = \"10.0.0.2:1\"\nslots = [1, 2]\n",
                "both claim slot 1",
            ),
            (
                "[[hosts]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nslots = [1]\n[[hosts]]\nname = \"a\"\naddress = \"10.0.0.2:1\"\nslots = [2]\n",
                "declared twice",
            ),
            (
                "[[hosts]]\nname = \"a\"\naddress = \"nowhere\"\nslots = [1]\n",
                "not IPv4:PORT",
            ),
            (
                "[[hosts]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nslots = [1, 3]\n",
                "no host runs slot 2",
            ),
            (
                "[[hosts]]\nname = \"a\"\naddress = \"10.0.0.1:0\"\nslots = [1]\n",
                "port other than 0",
            ),
            (
                "[[hosts]]\nname = \"a b\"\naddress = \"10.0.0.1:1\"\nslots = [1]\n",
                "letters, digits",
            ),
            (
                "[[hosts]]\nname = \"a\"\naddress = \"10.0.0.1:1\"\nslots = [1]\ncolour = 2\n",
                "unknown field",
            ),
        ];
        for (text, want) in cases {
            let e = HostPlan::parse("h.toml", text, "a")
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{text:?}: {e}");
            assert!(e.starts_with("h.toml:"), "{e}");
        }
        let e = HostPlan::parse("h.toml", TWO, "c").unwrap_err().to_string();
        assert!(
            e.contains("--host c is not one of the hosts declared here (a, b)"),
            "{e}"
        );
    }
}
