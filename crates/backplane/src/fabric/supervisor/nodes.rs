//! Node life cycle as the supervisor applies it: agents spawned and watched, node table
//! entries written, windows initialised, a node brought DOWN (its rings and endpoints torn
//! down). The decisions themselves are the sans-IO [`NodeLife`]'s.

use super::*;

impl Sup {
    pub(super) fn spawn_agent(&mut self, slot: u32) -> Result<(), StartError> {
        let (prog, args) = self
            .cfg
            .agent_cmd
            .split_first()
            .ok_or_else(|| StartError::Boot("no agent command".into()))?;
        let log = self.log.try_clone().map_err(os("log"))?;
        let log2 = self.log.try_clone().map_err(os("log"))?;
        let agent_cfg = crate::fabric::launch::AgentConfig {
            fabric: self.cfg.name.clone(),
            slot,
            net: self
                .cfg
                .net
                .map(|p| (format!("{}/{}", p.network, p.prefix), p.mtu)),
        };
        let mut line = serde_json::to_vec(&agent_cfg).expect("plain data serialises");
        line.push(b'\n');
        let mut cmd = Command::new(prog);
        cmd.args(args)
            .args([self.cfg.name.as_str(), &slot.to_string()])
            .stdin(Stdio::piped())
            .stdout(log)
            .stderr(log2);
        // SAFETY: the closure only makes the prctl and close_range system calls
        // (async-signal-safe, no allocation) between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                rustix::process::set_parent_process_death_signal(Some(
                    rustix::process::Signal::KILL,
                ))?;
                // The agent inherits its standard streams only: descriptors the supervisor's
                // libraries opened without close-on-exec (UCX's sockets and event fds, across
                // hosts) stay here. Best effort: before Linux 5.11 they are inherited.
                libc::syscall(
                    libc::SYS_close_range,
                    3u32,
                    u32::MAX,
                    libc::CLOSE_RANGE_CLOEXEC,
                );
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(os(format!("cannot start the agent of node {slot}")))?;
        // One line into an empty pipe never blocks; the agent reads it first. If the agent
        // died already, it is seen DOWN like any other dead agent.
        if let Some(mut stdin) = child.stdin.take() {
            let _ = std::io::Write::write_all(&mut stdin, &line);
        }
        let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("child pid > 0");
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
            .map_err(|e| os("pidfd_open")(e.into()))?;
        self.agents[slot as usize - 1] = Some(Agent { child, pidfd });
        let t = self.life[slot as usize - 1].spawned(Instant::now());
        self.apply(slot, t);
        Ok(())
    }

    pub(super) fn agent_pid(&self, slot: u32) -> u32 {
        self.agents[slot as usize - 1]
            .as_ref()
            .map_or(0, |a| a.child.id())
    }

    pub(super) fn first_down_during_boot(&self) -> Option<u32> {
        self.cfg
            .local_slots()
            .into_iter()
            .find(|&s| self.life[s as usize - 1].state() == NodeState::Down)
    }

    /// Writes slot's node table entry under the seqlock and bumps the fabric epoch.
    pub(super) fn write_entry(&mut self, slot: u32, reason: DownReason) {
        let l = &self.life[slot as usize - 1];
        let repr = NodeEntryRepr {
            slot,
            state: l.state(),
            generation: l.generation(),
            pid: self.agent_pid(slot),
            window_size: self.cfg.window_size,
            since_ms: self.since[slot as usize - 1],
            reason,
        };
        let mut b = [0u8; 64];
        repr.emit(&mut NodeEntry::new_unchecked(&mut b[..]));
        let off = (NODE_TABLE_OFF + (slot as usize - 1) * 64) as u64;
        let seq = self.control.u32_at(off).expect("entry in region");
        let s = seq.load(Ordering::Relaxed);
        // SYNC POINT node-seqlock (release): odd seq, body, even seq.
        seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        self.control
            .write(off + 4, &b[4..])
            .expect("entry in region");
        seq.store(s.wrapping_add(2), Ordering::Release);
        let epoch = self.control.u32_at(FABRIC_EPOCH_OFF as u64).expect("epoch");
        sync::ring(epoch);
        if let Some(n) = &self.accel_nodes {
            n.set(slot, repr.state as u32, repr.generation);
        }
    }

    pub(super) fn apply(&mut self, slot: u32, t: Option<Transition>) {
        let Some(t) = t else { return };
        self.since[slot as usize - 1] = now_ms();
        // The other hosts hear of a change of our own nodes now, not at the next heartbeat
        // (a host's `up` returns when its nodes are READY: the others see them so at once).
        if let Some(h) = self.hosts.as_mut().filter(|h| h.plan.is_local(slot)) {
            h.report_soon();
        }
        self.say(&format!(
            "node {slot}: {} (generation {}{})",
            t.state,
            t.generation,
            match t.reason {
                DownReason::None => "",
                DownReason::Exited => ", agent exited",
                DownReason::Hung => ", heartbeat stopped",
                DownReason::Shutdown => ", shutdown",
                DownReason::HostLost => ", its host stopped answering",
            }
        ));
        match t.state {
            // DOWN is published before its consequences (regions marked gone, rings torn
            // down): a peer that sees one of them and then reads the node table must find the
            // node DOWN, or it reports "region deregistered" for a dead node.
            NodeState::Down => {
                self.write_entry(slot, t.reason);
                self.node_down(slot);
            }
            // A window is initialised before READY says it may be used.
            NodeState::Ready => {
                self.init_window(slot, t.generation);
                self.write_entry(slot, t.reason);
            }
            _ => self.write_entry(slot, t.reason),
        }
    }

    pub(super) fn init_window(&mut self, slot: u32, generation: u32) {
        let w = self.windows[slot as usize - 1].clone();
        w.u32_at(WIN_INIT_OFF as u64)
            .expect("hdr")
            .store(0, Ordering::Release);
        w.zero(
            WIN_DOORBELL_BITS_OFF as u64,
            (4096 - WIN_DOORBELL_BITS_OFF) as u64,
        )
        .expect("hdr");
        let mut h = [0u8; 64];
        WindowHeaderRepr {
            slot,
            generation,
            size: self.cfg.window_size,
        }
        .emit(&mut WindowHeader::new_unchecked(&mut h[..]));
        publish(&w, 0, &h, WIN_INIT_OFF);
    }

    pub(super) fn node_down(&mut self, slot: u32) {
        self.net_ready[slot as usize - 1] = false;
        // Traffic forwarded through this node has lost its path: its senders must re-route.
        let through: Vec<u64> = self
            .rings
            .iter()
            .filter(|(_, r)| r.via.contains(&slot))
            .map(|(&id, _)| id)
            .collect();
        for id in through {
            self.teardown_ring(id);
        }
        self.with_service(|s, h| s.node_down(h, slot));
        let eps: Vec<(u32, u32)> = self
            .endpoints
            .keys()
            .filter(|k| k.0 == slot)
            .copied()
            .collect();
        for key in eps {
            self.close_endpoint(key);
        }
        // Wake anything sleeping on this node's doorbell so it re-checks the node state.
        if let Ok(seq) = self.win(slot).u32_at(WIN_DOORBELL_SEQ_OFF as u64) {
            sync::ring(seq);
        }
    }
}
