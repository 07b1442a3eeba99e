//! Unreliable datagram QPs: sends as fabric datagrams (with a GRH-like header), receives
//! from the QP's endpoint.

use super::*;

impl QpEngine {
    pub(super) fn exec_ud(&mut self, op: &OpView<'_>, env: &CtxParts<'_>) -> Exec {
        let (total, src) = match prepare(env.mrs, self.pd, op.src) {
            Ok(t) => t,
            Err(s) => return Exec::Fatal(s),
        };
        let op = &op.with_src(src);
        let Some((slot, qpn, qkey)) = op.ud else {
            return Exec::Fatal(WcStatus::LocQpOpErr);
        };
        if total > u64::from(Mtu::Mtu4096.bytes()) {
            // Only this request fails; the UD QP goes on (as from SQE back to RTS).
            return Exec::Done(WcStatus::LocLenErr);
        }
        let qkey = if qkey & 0x8000_0000 != 0 {
            self.attr.qkey
        } else {
            qkey
        };
        let hdr = UdRepr {
            op: if op.opcode == WrOpcode::SendWithImm {
                MsgOp::SendImm
            } else {
                MsgOp::Send
            },
            flags: if op.solicited { MSG_SOLICITED } else { 0 },
            imm: op.imm,
            qkey,
            src_qpn: self.qpn,
        };
        let (mrs, pd, src) = (env.mrs, self.pd, op.src);
        let Some(ep) = self.ud.as_mut() else {
            return Exec::Fatal(WcStatus::LocQpOpErr);
        };
        let r = ep.send_with(
            Addr::new(slot, qpn),
            16 + total as usize,
            Wait::Never,
            |buf| {
                hdr.emit(&mut UdHeader::new_unchecked(&mut buf[..16]));
                // `buf` holds 16 + total bytes; the source was validated by `prepare`.
                src.gather_into(mrs, pd, &mut buf[16..]);
            },
        );
        match r {
            Ok(()) => Exec::Done(WcStatus::Success),
            Err(DgramError::WouldBlock) => Exec::Full,
            // A datagram to nowhere is lost silently, as on a real UD QP.
            Err(DgramError::Unreachable(_))
            | Err(DgramError::NodeDown(_))
            | Err(DgramError::NoRoute(_))
            | Err(DgramError::Corrupt { .. }) => Exec::Done(WcStatus::Success),
            // No room in a window for the route to that QP (memory freed less than a second
            // ago is reusable only then): the datagram is lost, as a UD datagram may be, and
            // the QP goes on — a sender that needs it again sends it again (UCX's UD does). It
            // took the QP to ERR, its receives flushed: UCX aborted ("receive completion with
            // error … Work Request Flushed Error") while MPI made and ended endpoints in 8 MiB
            // windows.
            Err(DgramError::Fabric(crate::fabric::FabricError::Refused {
                kind: crate::fabric::ctl::ErrorKind::NoSpace,
                message,
            })) => {
                ud_dropped_for_room(slot, &message);
                Exec::Done(WcStatus::Success)
            }
            Err(_) => Exec::Fatal(WcStatus::LocQpOpErr),
        }
    }

    pub(super) fn drain_ud_dropping(&mut self) {
        let Some(ep) = self.ud.as_mut() else { return };
        let mut n = 0;
        while ep.recv_with(Wait::Never, |_, _| Ok(())).is_ok() {
            n += 1;
        }
        self.drops += n;
    }

    pub(super) fn drive_rx_ud(&mut self, env: &CtxParts<'_>, cqs: &mut Cqs) {
        let Some(mut ep) = self.ud.take() else { return };
        loop {
            if !cq_room(cqs, self.recv_cq) {
                break;
            }
            // Every datagram that is there, in place (from another host, every one a look at
            // the network brings: one a call copied the others out of UCX's buffer first),
            // while the completion queue has room; the one that finds it full stays next.
            let r = ep.recv_many_with(Wait::Never, usize::MAX, |src, payload| {
                if !cq_room(cqs, self.recv_cq) {
                    return Err(DgramError::WouldBlock);
                }
                self.accept_datagram(src, payload, env, cqs);
                Ok(())
            });
            match r {
                Ok(_) => {}
                Err(DgramError::WouldBlock) => break,
                Err(DgramError::Closed(_)) => {
                    self.ud = Some(ep);
                    self.fail_why(
                        "the QP's datagram endpoint was closed (node down?)",
                        WcStatus::LocQpOpErr,
                        cqs,
                    );
                    return;
                }
                Err(_) => break,
            }
        }
        self.ud = Some(ep);
    }

    pub(super) fn accept_datagram(
        &mut self,
        src: Addr,
        payload: &[u8],
        env: &CtxParts<'_>,
        cqs: &mut Cqs,
    ) {
        let Ok(h) = UdHeader::new_checked(payload)
            .map_err(|_| ())
            .and_then(|p| UdRepr::parse(&p).map_err(|_| ()))
        else {
            self.drops += 1;
            return;
        };
        if h.qkey != self.attr.qkey || h.src_qpn != src.port {
            self.drops += 1; // Q_Key violation or forged source: dropped, as on hardware
            return;
        }
        let Some(w) = self.rq.pop_front() else {
            self.drops += 1;
            return;
        };
        let rpd = self.rq.pd(self.pd);
        let data = &payload[16..];
        let need = (GRH_LEN + data.len()) as u64;
        let imm = h.op == MsgOp::SendImm;
        let mut wc = Wc {
            wr_id: w.wr_id,
            opcode: WcOpcode::Recv,
            byte_len: need as u32,
            imm_data: if imm { h.imm } else { 0 },
            qp_num: self.qpn,
            src_qp: src.port,
            wc_flags: if imm {
                WcFlags::GRH | WcFlags::WITH_IMM
            } else {
                WcFlags::GRH
            },
            slid: src.node as u16,
            ..Wc::default()
        };
        if need > w.total {
            wc.status = WcStatus::LocLenErr;
        } else if check_sges(env.mrs, rpd, w.sges.as_slice(), true).is_err() {
            wc.status = WcStatus::LocProtErr;
        } else {
            let mut grh = [0u8; GRH_LEN];
            grh[0] = 0x60; // IPv6-style version nibble, as a RoCE GRH
            grh[8] = 0xfe;
            grh[9] = 0x80; // source GID fe80::<slot>
            grh[20..24].copy_from_slice(&src.node.to_be_bytes());
            // The entries were validated writable and hold at least `need` bytes.
            let sges = w.sges.as_slice();
            scatter(env.mrs, rpd, sges, 0, Bytes::Slice(&grh));
            scatter(env.mrs, rpd, sges, GRH_LEN as u64, Bytes::Slice(data));
        }
        push_cqe(cqs, self.recv_cq, wc);
    }
}

/// Says once a process that a UD datagram was lost for want of room in a window (the
/// fabric's own line: what to do).
#[cold]
fn ud_dropped_for_room(slot: u32, why: &str) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        eprintln!(
            "backplane: a UD datagram to node {slot} was dropped (UD may lose datagrams; later \
             ones go when there is room): {why}"
        );
    }
}
