//! The status report: every slot's state, counters, addresses and interface statistics.
#![forbid(unsafe_code)]

use super::*;

impl Sup {
    pub(super) fn status(&mut self) -> StatusReport {
        let hosts = match self.hosts.as_mut() {
            Some(h) => h.status(Instant::now()),
            None => Vec::new(),
        };
        let now = now_ms();
        let slots = (1..=self.cfg.nodes)
            .map(|slot| {
                let i = slot as usize - 1;
                // A node of another host: the traffic its host reported (here only shadow
                // endpoints, the bridge's).
                let (c, endpoints) = match &self.hosts {
                    Some(h) if !self.cfg.is_local(slot) => h.remote_counters(slot),
                    _ => self.slot_counters(slot),
                };
                let entry_reason = self.read_reason(slot);
                // Forwarded through the node: by this host's senders (its window here, or
                // the shadow of a node of another host) and by every other host's.
                let fwd = {
                    let (m, b) = self.own_forwarded(slot);
                    let (om, ob) = self
                        .hosts
                        .as_ref()
                        .map_or((0, 0), |h| h.forwarded_elsewhere(slot));
                    [m.saturating_add(om), b.saturating_add(ob)]
                };
                let ifstats = self.cfg.net.map(|_| {
                    let mut v = [0u64; 6];
                    for (k, x) in v.iter_mut().enumerate() {
                        *x = self
                            .win(slot)
                            .u64_at((WIN_IFSTATS_OFF + 8 * k) as u64)
                            .map(|a| a.load(Ordering::Relaxed))
                            .unwrap_or(0);
                    }
                    ctl::IfStats {
                        name: net::IFNAME.to_string(),
                        up: self.net_ready[i],
                        rx_packets: v[0],
                        rx_bytes: v[1],
                        tx_packets: v[2],
                        tx_bytes: v[3],
                        rx_dropped: v[4],
                        tx_dropped: v[5],
                    }
                });
                SlotStatus {
                    slot,
                    state: self.life[i].state(),
                    down_reason: entry_reason,
                    generation: self.life[i].generation(),
                    pid: match &self.hosts {
                        Some(h) if !self.cfg.is_local(slot) => h.remote_pid(slot),
                        _ => self.agent_pid(slot),
                    },
                    procs: 0, // counted by the asking process
                    window_base: wire::window_base(slot),
                    window_size: self.cfg.window_size,
                    doorbell: wire::window_base(slot) + WIN_DOORBELL_BITS_OFF as u64,
                    uptime_s: now.saturating_sub(self.since[i]) as f64 / 1000.0,
                    endpoints,
                    tx_msgs: c[0],
                    tx_bytes: c[1],
                    rx_msgs: c[2],
                    rx_bytes: c[3],
                    drops: c[4],
                    fwd_msgs: fwd[0],
                    fwd_bytes: fwd[1],
                    address: self.cfg.net.map(|p| p.cidr(slot)),
                    mac: self.cfg.net.map(|_| net::Mac::of_slot(slot).to_string()),
                    interface: ifstats,
                    accel: None,
                    host: self
                        .hosts
                        .as_ref()
                        .and_then(|h| h.plan.owner(slot).map(|o| h.plan.hosts[o].name.clone())),
                }
            })
            .collect();
        StatusReport {
            topology: self.cfg.topology.as_ref().map(|t| ctl::TopologyStatus {
                kind: match t.kind {
                    crate::fabric::topology::Kind::Star => "star".into(),
                    crate::fabric::topology::Kind::Distributed => "distributed".into(),
                },
                links: t
                    .links
                    .iter()
                    .map(|l| format!("{}-{} {}", l.a, l.b, l.model.name))
                    .collect(),
            }),
            link: self.cfg.link.as_ref().map(|l| ctl::LinkStatus {
                model: l.name.clone(),
                bytes_per_s: l.bytes_per_s,
                hop_ns: l.hop_ns,
                forwarding: if l.store_and_forward {
                    "store-and-forward".into()
                } else {
                    "cut-through".into()
                },
            }),
            version: ctl::STATUS_VERSION,
            fabric: self.cfg.name.clone(),
            nodes: self.cfg.nodes,
            window_size: self.cfg.window_size,
            supervisor_pid: std::process::id(),
            uptime_s: self.created.elapsed().as_secs_f64(),
            slots,
            hosts,
        }
    }

    /// Node `slot`'s datagram counters (sent msgs/bytes, received msgs/bytes, drops: those
    /// of its closed endpoints and of its open ones) and its open endpoints.
    pub(super) fn slot_counters(&self, slot: u32) -> ([u64; 5], u32) {
        let mut c = self.totals[slot as usize - 1];
        let mut endpoints = 0;
        for (_, e) in self.endpoints.iter().filter(|(k, _)| k.0 == slot) {
            endpoints += 1;
            for (k, v) in c.iter_mut().enumerate() {
                let x = self
                    .win(slot)
                    .u64_at(e.record_off + (EP_COUNTERS_OFF + 8 * k) as u64)
                    .map(|a| a.load(Ordering::Relaxed))
                    .unwrap_or(0);
                *v = v.saturating_add(x);
            }
        }
        (c, endpoints)
    }

    pub(super) fn read_reason(&self, slot: u32) -> DownReason {
        let off = (NODE_TABLE_OFF + (slot as usize - 1) * 64) as u64;
        let mut b = [0u8; 64];
        if self.control.read(off, &mut b).is_err() {
            return DownReason::None;
        }
        NodeEntryRepr::parse(&NodeEntry::new_unchecked(&b[..]))
            .map(|e| e.reason)
            .unwrap_or(DownReason::None)
    }

    /// What this host's senders forwarded through `slot` (datagrams, bytes): the counters in
    /// the node's window here (a shadow for a node of another host).
    pub(super) fn own_forwarded(&self, slot: u32) -> (u64, u64) {
        let word = |k: usize| {
            self.win(slot)
                .u64_at((WIN_FWD_OFF + 8 * k) as u64)
                .map(|a| a.load(Ordering::Relaxed))
                .unwrap_or(0)
        };
        (word(0), word(1))
    }
}
