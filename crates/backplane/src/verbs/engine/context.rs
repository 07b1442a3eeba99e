//! The context: its node, transport, window and engine tables; creating QPs, polling CQs.

use super::*;

// ---------------------------------------------------------------------------------------------
// The context.
// ---------------------------------------------------------------------------------------------

/// What a QP is made of (checked by the caller).
pub(crate) struct QpSpec {
    pub(crate) pd: u32,
    pub(crate) ty: QpType,
    pub(crate) send_cq: usize,
    pub(crate) recv_cq: usize,
    pub(crate) cap: QpCap,
    pub(crate) sig_all: bool,
    pub(crate) ring_len: u32,
    /// The shared receive queue it takes receives from, if any.
    pub(crate) srq: Option<Rc<RefCell<SrqEngine>>>,
}

/// A device context's shared state: its node, its window, its engine.
pub(crate) struct Ctx {
    pub(crate) node: Node,
    /// How the context reaches peers' memory and learns whether they live.
    pub(crate) transport: Arc<dyn Transport>,
    /// How the context's queue pairs connect (the same transport, by its concrete type: the
    /// fast paths are compiled against it).
    pub(crate) links: ShmTransport,
    pub(crate) win: Arc<Region>,
    pub(crate) event_off: u64,
    /// A poll loop that finds nothing gives the CPU away every this many polls (0: never):
    /// on a fabric across hosts, the bridge thread that carries the completions needs one.
    pub(crate) yield_every: u32,
    pub(crate) eng: RefCell<Engine>,
}

#[derive(Default)]
pub(crate) struct Engine {
    pub(crate) next_pd: u32,
    pub(crate) mrs: MrTable,
    pub(crate) cqs: Cqs,
    pub(crate) qps: Vec<Option<QpEngine>>,
    pub(super) epoch: u32,
    /// Polls of this context's CQs that found nothing (see [`Ctx::yield_every`]).
    pub(super) empty_polls: u32,
    /// The last poll of a completion queue found it empty (see [`Ctx::poll_each`]).
    pub(super) waited: bool,
}

impl Ctx {
    pub(crate) fn env<'a>(&'a self, mrs: &'a MrTable) -> CtxParts<'a> {
        CtxParts {
            node: &self.node,
            transport: &*self.transport,
            links: &self.links,
            mrs,
        }
    }

    /// Creates a QP's engine state (and, for RC/UC, its block through the supervisor).
    pub(crate) fn create_qp(&self, spec: QpSpec) -> Result<(usize, u32), VerbsError> {
        let QpSpec {
            pd,
            ty,
            send_cq,
            recv_cq,
            cap,
            sig_all,
            ring_len,
            srq,
        } = spec;
        let (qpn, own, ud) = match ty {
            QpType::Ud => {
                // Datagrams from other hosts straight from its own UCX worker (a channel's
                // watch has the worker's waker ring the doorbell): `ib_send_lat -c UD`
                // between two hosts 62 -> 4.2 us typical against the bridges.
                let ep = self
                    .node
                    .bind(0)
                    .map_err(|e| VerbsError::inval(e.to_string()))?;
                (ep.local_addr().port, None, Some(ep))
            }
            _ => {
                let (qpn, home) = self.links.create_qp_home(
                    self.node.slot(),
                    pd,
                    ty as u32,
                    ring_len,
                    self.event_off,
                )?;
                (qpn, Some(home), None)
            }
        };
        let st = QpEngine {
            write_hint: WriteHint::NONE,
            send_hint: [std::ptr::null(); 2],
            qpn,
            ty,
            state: QpState::Reset,
            pd,
            send_cq,
            recv_cq,
            sig_all,
            cap,
            attr: QpAttr {
                cap,
                ..QpAttr::default()
            },
            own,
            peer: None,
            sq: VecDeque::new(),
            exec: 0,
            rq_posted: if srq.is_some() { SRQ_CREDITS } else { 0 },
            rq: match srq {
                Some(s) => RecvQueue::Shared(s),
                None => RecvQueue::Own(VecDeque::new()),
            },
            credits: 0,
            used_credits: 0,
            rel: Reliability::default(),
            inbound: None,
            msgs_in: 0,
            msgs_out: 0,
            bell_pending: false,
            took_ahead: false,
            peer_gone: false,
            gone_since: None,
            ud,
            remote: Vec::new(),
            drops: 0,
            error: None,
            idle: 0,
            settle_later: false,
            published: 0,
            fetching: 0,
        };
        let mut eng = self.eng.borrow_mut();
        let id = match eng.qps.iter().position(|q| q.is_none()) {
            Some(i) => {
                eng.qps[i] = Some(st);
                i
            }
            None => {
                eng.qps.push(Some(st));
                eng.qps.len() - 1
            }
        };
        for cq in [send_cq, recv_cq] {
            if let Some(Some(c)) = eng.cqs.get_mut(cq) {
                if !c.qps.contains(&id) {
                    c.qps.push(id);
                }
            }
        }
        Ok((id, qpn))
    }

    /// Polls completion queue `cq`: up to `out.len()` completions; when it holds none, its QPs
    /// are moved along first (so completions already there come back at once).
    pub(crate) fn poll(&self, cq: usize, out: &mut [Wc]) -> usize {
        self.poll_each(cq, out.len(), |i, w| out[i] = *w)
    }

    /// As [`Ctx::poll`], handing each of up to `max` completions to `sink` (its index, the
    /// completion) straight from the queue, without a buffer in between.
    #[inline]
    pub(crate) fn poll_each(
        &self,
        cq: usize,
        max: usize,
        mut sink: impl FnMut(usize, &Wc),
    ) -> usize {
        let mut eng = self.eng.borrow_mut();
        let eng = &mut *eng;
        let need = eng
            .cqs
            .get(cq)
            .and_then(|c| c.as_ref())
            .map_or(0, |c| c.entries.len());
        // Pairs with other hosts that this process carries (none on one host: this path
        // stays two loads longer than before them).
        let carries = crate::verbs::direct::carries_pairs();
        if carries {
            // (A queue whose channel is armed is polled by a program that may sleep on the
            // channel next: its polls do not keep the pairs' threads resting. One with a
            // channel but nothing armed is polled in a loop like any other — UCX makes every
            // CQ with a channel and arms it only before it sleeps: taken for a sleeper, its
            // busy polls left the pairs' threads pumping beside it, ~16 000 wake-ups a second
            // of each process's pair thread and the program preempted ~20 000 times a
            // second, `ucx_perftest tag_lat` between hosts 2-5x `ib_send_lat`.)
            let sleeps_between = eng
                .cqs
                .get(cq)
                .and_then(|c| c.as_ref())
                .and_then(|c| c.channel.as_ref())
                .is_some_and(|ch| ch.armed_any());
            if need == 0 {
                // What came, what to ship; a whole SEND for one of this context's QPs goes
                // from the message that brought it into the posted receive.
                let slot = self.node.slot();
                let Engine { mrs, cqs, qps, .. } = &mut *eng;
                let env = CtxParts {
                    node: &self.node,
                    transport: &*self.transport,
                    links: &self.links,
                    mrs,
                };
                let mut deliver = |(node, qpn): (u32, u32), at: u64, bytes: &[u8]| {
                    if node != slot {
                        return 0;
                    }
                    let n = qps
                        .iter_mut()
                        .flatten()
                        .find(|q| q.qpn == qpn)
                        .map_or(0, |q| q.deliver_ahead(at, bytes, &env, cqs));
                    if n != 0 {
                        crate::verbs::direct::delivered_one();
                    }
                    n
                };
                crate::verbs::direct::progress_all(!sleeps_between, &mut deliver);
            } else if !sleeps_between {
                crate::verbs::direct::app_polled();
            }
        }
        if need == 0 && !self.all_quiet(eng, cq) {
            self.progress_cq(eng, cq);
            // A channel armed before this progress may not watch what its QPs wait for now.
            let event_mode = eng
                .cqs
                .get(cq)
                .and_then(|c| c.as_ref())
                .is_some_and(|c| c.channel.is_some());
            if event_mode && self.waits_in_background(eng, cq) {
                self.rearm_if_armed(eng, cq);
            }
        }
        let Some(Some(c)) = eng.cqs.get_mut(cq) else {
            return 0;
        };
        let mut n = 0;
        let mut wrote = false;
        while n < max {
            let Some(wc) = c.entries.pop_front() else {
                break;
            };
            wrote |= wc.opcode == WcOpcode::RdmaWrite;
            sink(n, &wc);
            n += 1;
        }
        if carries {
            // (This poll or the last found the queue empty: the program waited for these.)
            let waited = std::mem::replace(&mut eng.waited, n == 0) || need == 0;
            if n != 0 && waited && wrote && !Self::sends_outstanding(eng, cq) {
                // The program waited for its RDMA WRITE to land: it may poll memory next for
                // the peer's (`ib_write_lat`). (Not after READs and atomics: a program
                // waiting for those goes on posting and polling, and ringing for them cost
                // atomic-lat ~15 %.)
                crate::verbs::direct::app_may_wait_for_write();
            }
        }
        if n == 0 && self.yield_every != 0 {
            eng.empty_polls = eng.empty_polls.wrapping_add(1);
            if eng.empty_polls.is_multiple_of(self.yield_every) {
                std::thread::yield_now();
            }
        }
        n
    }

    /// Arms `cq`'s completion channel with what its QPs wait for now (`ibv_req_notify_cq`).
    pub(crate) fn arm_cq(&self, eng: &mut Engine, cq: usize) -> Result<(), VerbsError> {
        let (ch, armed) = self.watch_of(eng, cq)?;
        ch.arm(armed);
        // A CQ armed while it holds completions fires at once, as a NIC's does (mlx5 arms
        // with its consumer index): a poll of one CQ can make another's completions (a
        // progress that takes both an ack and a message), and a program that takes an event
        // for a CQ it did not wait for re-arms that CQ with its completion still in it —
        // `ib_send_lat -e`, one channel for both CQs, then waited for that event for ever.
        if holds_completions(&eng.cqs, cq) {
            ch.completion_added(cq as u32);
        }
        // The program is about to sleep on the channel: the pairs' threads take over now
        // (unless it sleeps in `get_cq_event`, which watches the pairs itself).
        crate::verbs::direct::app_arms_channel();
        Ok(())
    }

    /// The channel of `cq` and what arming it watches now.
    fn watch_of(
        &self,
        eng: &mut Engine,
        cq: usize,
    ) -> Result<(Arc<ChannelShared>, crate::verbs::channel::Armed), VerbsError> {
        let Engine { qps, cqs, .. } = eng;
        let Some(Some(c)) = cqs.get(cq) else {
            return Err(VerbsError::inval("CQ is gone"));
        };
        let Some(ch) = c.channel.clone() else {
            return Err(VerbsError::inval("the CQ has no completion channel"));
        };
        let mut watch = Vec::new();
        let mut nodes = vec![(self.node.slot(), self.node.generation())];
        let mut deadline = None;
        for &id in &c.qps {
            if let Some(Some(q)) = qps.get_mut(id) {
                q.flush_bell_pub();
                q.watches(cq, &mut watch);
                if let Some(p) = q.peer_slot() {
                    nodes.push(p);
                }
                deadline = earlier(deadline, q.deadline());
            }
        }
        let armed = crate::verbs::channel::Armed {
            cq: cq as u32,
            watch,
            deadline,
            nodes,
        };
        Ok((ch, armed))
    }

    /// If `cq` is armed, adds to its watch what its QPs wait for now: work may have started
    /// waiting since it was armed (for an RNR timer and the peer's credits, or for a WRITE to
    /// land on another host), which the channel would otherwise not see.
    pub(crate) fn rearm_if_armed(&self, eng: &mut Engine, cq: usize) {
        let armed = eng
            .cqs
            .get(cq)
            .and_then(|c| c.as_ref())
            .and_then(|c| c.channel.as_ref())
            .is_some_and(|ch| ch.armed_any());
        if armed {
            if let Ok((ch, more)) = self.watch_of(eng, cq) {
                ch.extend(more);
            }
        }
    }

    /// Whether a QP of `cq` waits for something besides messages (see `rearm_if_armed`).
    fn waits_in_background(&self, eng: &Engine, cq: usize) -> bool {
        eng.cqs.get(cq).and_then(|c| c.as_ref()).is_some_and(|c| {
            c.qps
                .iter()
                .any(|&id| matches!(eng.qps.get(id), Some(Some(q)) if q.waits_in_background()))
        })
    }

    /// Whether a QP of `cq` still has send work outstanding (the program will poll for it).
    fn sends_outstanding(eng: &Engine, cq: usize) -> bool {
        eng.cqs.get(cq).and_then(|c| c.as_ref()).is_some_and(|c| {
            c.qps
                .iter()
                .any(|&id| matches!(eng.qps.get(id), Some(Some(q)) if !q.sq.is_empty()))
        })
    }

    /// Nothing can have happened for `cq`: the fabric's epoch has not moved (no node came or
    /// went) and every QP on it is [`QpEngine::quiet`].
    #[inline]
    pub(super) fn all_quiet(&self, eng: &Engine, cq: usize) -> bool {
        if self.node.fabric().epoch().load(Ordering::Relaxed) != eng.epoch {
            return false;
        }
        let Some(Some(c)) = eng.cqs.get(cq) else {
            return false;
        };
        c.qps
            .iter()
            .all(|&id| matches!(eng.qps.get(id), Some(Some(q)) if q.quiet()))
    }

    pub(crate) fn progress_cq(&self, eng: &mut Engine, cq: usize) {
        let epoch = self.node.fabric().epoch().load(Ordering::Relaxed);
        let epoch_moved = epoch != eng.epoch;
        eng.epoch = epoch;
        let env = CtxParts {
            node: &self.node,
            transport: &*self.transport,
            links: &self.links,
            mrs: &eng.mrs,
        };
        let own_ok = !epoch_moved || self.node.check_current().is_ok();
        for k in 0.. {
            let Some(id) = eng
                .cqs
                .get(cq)
                .and_then(|c| c.as_ref())
                .and_then(|c| c.qps.get(k).copied())
            else {
                break;
            };
            let Some(Some(q)) = eng.qps.get_mut(id) else {
                continue;
            };
            if epoch_moved {
                if !own_ok && q.state != QpState::Err && q.state != QpState::Reset {
                    q.fail_why(
                        "this node went DOWN or restarted",
                        WcStatus::WrFlushErr,
                        &mut eng.cqs,
                    );
                    continue;
                }
                q.check_peer_node(&env);
            }
            q.progress(&env, &mut eng.cqs);
        }
    }
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("node", &self.node.slot())
            .finish()
    }
}
