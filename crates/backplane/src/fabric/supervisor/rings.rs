//! The ring broker: endpoints bound on ports, datagram rings made between them on the first
//! send (in the receiver's window, credits in the sender's), routes through forwarding
//! nodes, and rings torn down when an end goes.
#![forbid(unsafe_code)]

use super::*;

impl Sup {
    /// Closes an endpoint: receivers' rings are torn down (their senders see peer-closed),
    /// senders' rings are marked sender-closed and left for their receivers to drain.
    pub(super) fn close_endpoint(&mut self, key: (u32, u32)) {
        let Some(ep) = self.endpoints.remove(&key) else {
            return;
        };
        let now = Instant::now();
        let w = self.windows[key.0 as usize - 1].clone();
        let rec = ep.record_off;
        if let Ok(c) = w.u32_at(rec + EP_CLOSED_OFF as u64) {
            c.store(1, Ordering::Release);
        }
        let mut counters = [0u64; 5];
        for (i, c) in counters.iter_mut().enumerate() {
            *c = w
                .u64_at(rec + (EP_COUNTERS_OFF + 8 * i) as u64)
                .map(|a| a.load(Ordering::Relaxed))
                .unwrap_or(0);
        }
        let t = &mut self.totals[key.0 as usize - 1];
        for i in 0..5 {
            t[i] = t[i].saturating_add(counters[i]);
        }
        if let Ok(d) = w.u32_at(rec + EP_DOORBELL_OFF as u64) {
            sync::ring(d);
        }
        for id in ep.rings_in {
            self.teardown_ring(id);
        }
        for id in ep.rings_out {
            self.close_ring_sender(id);
        }
        self.allocs[key.0 as usize - 1].free(rec, ENDPOINT_LEN, now);
        if let Some(c) = self.clients.get_mut(&ep.client) {
            c.endpoints.retain(|&k| k != key);
        }
    }

    /// Marks ring `id` sender-closed and wakes its receiver, which reads what is left and
    /// retires it.
    pub(super) fn close_ring_sender(&self, id: u64) {
        let Some(r) = self.rings.get(&id) else {
            return;
        };
        let dst_w = &self.windows[r.dst.0 as usize - 1];
        if let Ok(c) = dst_w.u32_at(r.ring_off + RING_SENDER_CLOSED_OFF as u64) {
            c.store(1, Ordering::Release);
        }
        if let Some(dst) = self.endpoints.get(&r.dst) {
            if let Ok(d) = dst_w.u32_at(dst.record_off + EP_DOORBELL_OFF as u64) {
                sync::ring(d);
            }
        }
    }

    pub(super) fn bind(
        &mut self,
        id: u64,
        slot: u32,
        port: u32,
        direct: Option<u16>,
    ) -> Result<Response, (ErrorKind, String)> {
        self.ready_slot(slot)?;
        let port = if port == 0 {
            let mut p = self.next_ephemeral;
            let mut tries = 0;
            while self.endpoints.contains_key(&(slot, p)) {
                p = if p == u32::MAX { EPHEMERAL_BASE } else { p + 1 };
                tries += 1;
                if tries > 1_000_000 {
                    return Err((ErrorKind::NoSpace, "no free port".into()));
                }
            }
            self.next_ephemeral = p.wrapping_add(1).max(EPHEMERAL_BASE);
            p
        } else {
            port
        };
        if self.endpoints.contains_key(&(slot, port)) {
            return Err((
                ErrorKind::InUse,
                format!("port {port} on node {slot} is already bound"),
            ));
        }
        let (rec, generation) = self.create_endpoint(id, slot, port)?;
        if let Some(e) = self.endpoints.get_mut(&(slot, port)) {
            e.direct = direct.filter(|&p| p != 0 && self.hosts.is_some());
        }
        Ok(Response::Bound {
            port,
            record_off: rec,
            generation,
        })
    }

    /// Where an endpoint may listen for datagrams straight from other hosts: this host's
    /// address on a fabric across hosts, except where the bridge models the links (`--link`,
    /// a topology: it holds each datagram until its modelled delivery).
    pub(super) fn direct_ip(&self) -> Option<std::net::IpAddr> {
        match &self.hosts {
            Some(h) if self.cfg.link.is_none() && self.cfg.topology.is_none() => {
                Some(h.plan.this().address.ip())
            }
            _ => None,
        }
    }

    /// Makes endpoint (slot, port) of client `id` (0: the datagram bridge, for a shadow
    /// endpoint of a node on another host): its record in the node's window.
    pub(super) fn create_endpoint(
        &mut self,
        id: u64,
        slot: u32,
        port: u32,
    ) -> Result<(u64, u32), (ErrorKind, String)> {
        let now = Instant::now();
        let a = &mut self.allocs[slot as usize - 1];
        let Some(rec) = a.alloc(ENDPOINT_LEN, 4096, now) else {
            return Err((ErrorKind::NoSpace, a.full_message(slot, now)));
        };
        let generation = self.life[slot as usize - 1].generation();
        let pid = self.clients.get(&id).map_or(0, |c| c.pid);
        let w = self.windows[slot as usize - 1].clone();
        w.zero(rec, ENDPOINT_LEN)
            .expect("allocated inside the window");
        let mut h = [0u8; 64];
        EndpointRepr {
            slot,
            port,
            owner_pid: pid,
            generation,
        }
        .emit(&mut EndpointHeader::new_unchecked(&mut h[..]));
        publish(&w, rec, &h, EP_INIT_OFF);
        self.endpoints.insert(
            (slot, port),
            Ep {
                record_off: rec,
                client: id,
                generation,
                list: Vec::new(),
                rings_in: Vec::new(),
                rings_out: Vec::new(),
                direct: None,
            },
        );
        if let Some(c) = self.clients.get_mut(&id) {
            c.endpoints.push((slot, port));
        }
        Ok((rec, generation))
    }

    pub(super) fn connect(
        &mut self,
        id: u64,
        src: (u32, u32),
        dst: (u32, u32),
    ) -> Result<Response, (ErrorKind, String)> {
        self.ready_slot(src.0)?;
        self.ready_slot(dst.0)?;
        self.check_owner(id, src)?;
        self.make_ring(src, dst, self.ring_data())
    }

    /// Refuses a client that does not own endpoint `src`.
    pub(super) fn check_owner(&self, id: u64, src: (u32, u32)) -> Result<(), (ErrorKind, String)> {
        match self.endpoints.get(&src) {
            Some(e) if e.client == id => Ok(()),
            _ => Err((
                ErrorKind::Invalid,
                format!("this process does not own port {} on node {}", src.1, src.0),
            )),
        }
    }

    /// The ring from `src` to endpoint `dst` (made unless it exists), once the asker's right
    /// to it is checked: a local sender's by `connect`, a sender on another host's by the
    /// route it asked for (then `src` has no endpoint here, and its credit line lies in the
    /// shadow window of its node).
    /// `data_len`: its data area's size, if it is made.
    pub(super) fn make_ring(
        &mut self,
        src: (u32, u32),
        dst: (u32, u32),
        data_len: u32,
    ) -> Result<Response, (ErrorKind, String)> {
        let Some(dst_ep) = self.endpoints.get(&dst) else {
            return Err((
                ErrorKind::NotFound,
                format!("nothing is bound to port {} on node {}", dst.1, dst.0),
            ));
        };
        let dst_rec = dst_ep.record_off;
        let dst_gen = dst_ep.generation;
        let route = self.route(src.0, dst.0)?;
        if let Some(r) = self.rings.values().find(|r| r.src == src && r.dst == dst) {
            return Ok(Response::Connected {
                route: route.clone(),
                ring_off: r.ring_off,
                credit_off: r.credit_off,
                dst_record_off: dst_rec,
                dst_generation: dst_gen,
                direct: None,
                ring_data: Some(r.data_len),
            });
        }
        let dst_w = self.windows[dst.0 as usize - 1].clone();
        let src_w = self.windows[src.0 as usize - 1].clone();
        let list = &dst_ep.list;
        let list_index = list.iter().position(|used| !used).unwrap_or(list.len()) as u32;
        let count = list.len() as u32;
        if list_index >= ENDPOINT_MAX_RINGS {
            return Err((
                ErrorKind::NoSpace,
                format!(
                    "port {} on node {} already hears {ENDPOINT_MAX_RINGS} senders",
                    dst.1, dst.0
                ),
            ));
        }
        let now = Instant::now();
        let ring_bytes = RingRepr::footprint(data_len);
        let allocs = &mut self.allocs;
        let no_room = |allocs: &[WindowAlloc], slot: u32| {
            (
                ErrorKind::NoSpace,
                allocs[slot as usize - 1].full_message(slot, now),
            )
        };
        let Some(ring_off) = allocs[dst.0 as usize - 1].alloc(ring_bytes, 4096, now) else {
            return Err(no_room(allocs, dst.0));
        };
        let Some(credit_off) = allocs[src.0 as usize - 1].alloc(CREDIT_LEN, 64, now) else {
            allocs[dst.0 as usize - 1].free(ring_off, ring_bytes, now);
            return Err(no_room(allocs, src.0));
        };
        let ring_id = self.next_ring;
        self.next_ring += 1;
        src_w.zero(credit_off, CREDIT_LEN).expect("allocated");
        src_w
            .u32_at(credit_off + CREDIT_COOKIE_OFF as u64)
            .expect("allocated")
            .store(ring_id as u32, Ordering::Release);
        dst_w.zero(ring_off, RING_DATA_OFF).expect("allocated");
        let mut h = [0u8; 64];
        RingRepr {
            data_len,
            src_slot: src.0,
            src_port: src.1,
            dst_port: dst.1,
            src_generation: self.life[src.0 as usize - 1].generation(),
            credit_off,
        }
        .emit(&mut RingHeader::new_unchecked(&mut h[..]));
        publish(&dst_w, ring_off, &h, RING_INIT_OFF);
        // SYNC POINT ring-list (release): the ring header is initialised before it is listed.
        dst_w
            .u64_at(dst_rec + EP_RING_LIST_OFF as u64 + 8 * list_index as u64)
            .expect("list entry")
            .store(ring_off, Ordering::Release);
        if list_index == count {
            dst_w
                .u32_at(dst_rec + EP_RING_COUNT_OFF as u64)
                .expect("record")
                .store(count + 1, Ordering::Release);
        }
        dst_w
            .u32_at(dst_rec + EP_RING_SEQ_OFF as u64)
            .expect("record")
            .fetch_add(1, Ordering::Release);
        self.rings.insert(
            ring_id,
            RingInfo {
                via: route.iter().skip(1).map(|h| h.from).collect(),
                src,
                dst,
                ring_off,
                data_len,
                credit_off,
                list_index,
            },
        );
        if let Some(e) = self.endpoints.get_mut(&dst) {
            e.rings_in.push(ring_id);
            if list_index == count {
                e.list.push(true);
            } else {
                e.list[list_index as usize] = true;
            }
        }
        if let Some(e) = self.endpoints.get_mut(&src) {
            e.rings_out.push(ring_id);
        }
        Ok(Response::Connected {
            route,
            ring_off,
            credit_off,
            dst_record_off: dst_rec,
            dst_generation: dst_gen,
            direct: None,
            ring_data: Some(data_len),
        })
    }

    /// The links from `src` to `dst` in a distributed topology, through READY nodes only.
    pub(super) fn route(
        &self,
        src: u32,
        dst: u32,
    ) -> Result<Vec<ctl::RouteHop>, (ErrorKind, String)> {
        let Some(t) = &self.cfg.topology else {
            return Ok(Vec::new());
        };
        if src == dst {
            return Ok(Vec::new());
        }
        let ready = |n: u32| self.life[n as usize - 1].state() == NodeState::Ready;
        let path = t.route(src, dst, ready).ok_or_else(|| {
            let down: Vec<String> = (1..=self.cfg.nodes)
                .filter(|&n| !ready(n))
                .map(|n| n.to_string())
                .collect();
            (
                ErrorKind::NoRoute,
                format!(
                    "no route from node {src} to node {dst}: the nodes that would forward between them are DOWN ({})",
                    down.join(", ")
                ),
            )
        })?;
        Ok(path
            .windows(2)
            .map(|w| {
                let m = t
                    .link_between(w[0], w[1])
                    .expect("routes follow declared links");
                ctl::RouteHop {
                    from: w[0],
                    to: w[1],
                    bytes_per_s: m.bytes_per_s.max(1),
                    hop_ns: m.hop_ns,
                }
            })
            .collect())
    }

    /// The receiver is done with a ring: drained after its sender left, or found corrupted.
    /// Either way it is torn down; a sender still attached sees peer-closed on its next send
    /// and reconnects with a fresh ring.
    pub(super) fn retire_ring(&mut self, id: u64, slot: u32, ring_off: u64) {
        let Some(rid) = self
            .rings
            .iter()
            .find(|(_, r)| r.dst.0 == slot && r.ring_off == ring_off)
            .map(|(&rid, _)| rid)
        else {
            return;
        };
        if self
            .endpoints
            .get(&self.rings[&rid].dst)
            .is_none_or(|e| e.client != id)
        {
            return; // only the receiver may retire its rings
        }
        self.teardown_ring(rid);
    }

    /// Removes a ring: its sender sees peer-closed (and is woken), the receiver's list entry
    /// is cleared if the receiver still exists, and both allocations are freed (quarantined).
    pub(super) fn teardown_ring(&mut self, rid: u64) {
        self.route_ring_gone(rid);
        let Some(r) = self.rings.remove(&rid) else {
            return;
        };
        let now = Instant::now();
        let src_w = self.windows[r.src.0 as usize - 1].clone();
        if let Ok(c) = src_w.u32_at(r.credit_off + CREDIT_PEER_CLOSED_OFF as u64) {
            c.store(1, Ordering::Release);
        }
        if let Ok(s) = src_w.u32_at(r.credit_off + CREDIT_SEQ_OFF as u64) {
            sync::ring(s);
        }
        if let Some(e) = self.endpoints.get_mut(&r.src) {
            e.rings_out.retain(|&x| x != rid);
        }
        let dst_w = self.windows[r.dst.0 as usize - 1].clone();
        if let Some(e) = self.endpoints.get_mut(&r.dst) {
            e.rings_in.retain(|&x| x != rid);
            if let Some(u) = e.list.get_mut(r.list_index as usize) {
                *u = false;
            }
            let rec = e.record_off;
            let _ = dst_w
                .u64_at(rec + EP_RING_LIST_OFF as u64 + 8 * r.list_index as u64)
                .map(|a| a.store(0, Ordering::Release));
            let _ = dst_w
                .u32_at(rec + EP_RING_SEQ_OFF as u64)
                .map(|a| a.fetch_add(1, Ordering::Release));
        }
        let ring_bytes = RingRepr::footprint(r.data_len);
        self.allocs[r.dst.0 as usize - 1].free(r.ring_off, ring_bytes, now);
        self.allocs[r.src.0 as usize - 1].free(r.credit_off, CREDIT_LEN, now);
    }

    /// Ring data size of every datagram ring of this fabric (see [`wire::ring_data_for_window`]).
    pub(super) fn ring_data(&self) -> u32 {
        wire::ring_data_for_window(self.cfg.window_size)
    }
}
