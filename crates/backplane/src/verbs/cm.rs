//! The connection helper (what `rdma_cm` does for libibverbs programs): two processes on two
//! nodes exchange QP number, starting PSN, an rkey + offset + length and private data over
//! datagram endpoints, and each side's QP is taken RESET → INIT → RTR → RTS with sensible
//! attributes. The listener binds a datagram port of its choice on its node ([`DEFAULT_PORT`]
//! is 4791, RoCE v2's UDP port); the client sends a request there and waits for the reply.
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use super::{
    AccessFlags, AhAttr, Context, Mtu, Qp, QpAttr, QpAttrMask as M, QpState, QpType, VerbsError,
};
use crate::dgram::{Addr, DgramError, Endpoint, Wait};
use crate::wire::verbs::{CmKind, CmMsg, CmRepr};

/// The CM service port used when the application has no port of its own.
pub const DEFAULT_PORT: u32 = 4791;
/// Q_Key the helper gives UD QPs when the application does not choose one.
pub const DEFAULT_QKEY: u32 = 0x1111_1111;

/// What one side offers the other.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnParam {
    /// rkey of a region the peer may use (0: none).
    pub rkey: u32,
    /// Offset in that region.
    pub addr: u64,
    /// Bytes of it.
    pub len: u64,
    /// Starting PSN (informational).
    pub psn: u32,
    /// Q_Key for UD QPs (0: [`DEFAULT_QKEY`]).
    pub qkey: u32,
    /// Up to 56 bytes for the application.
    pub private_data: Vec<u8>,
}

/// What the other side offered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's node (its LID).
    pub node: u32,
    /// The peer's QP number.
    pub qpn: u32,
    /// The peer's starting PSN.
    pub psn: u32,
    /// rkey of the region the peer offers (0: none).
    pub rkey: u32,
    /// Offset in that region.
    pub addr: u64,
    /// Bytes of it.
    pub len: u64,
    /// The peer QP's Q_Key (UD).
    pub qkey: u32,
    /// The peer's private data.
    pub private_data: Vec<u8>,
}

fn msg(kind: CmKind, qp: &Qp, node: u32, p: &ConnParam) -> Vec<u8> {
    let mut b = vec![0u8; CmMsg::<&[u8]>::LEN];
    CmRepr {
        kind,
        qp_type: qp.qp_type() as u8,
        node,
        qpn: qp.qp_num(),
        psn: p.psn,
        rkey: p.rkey,
        addr: p.addr,
        len: p.len,
        qkey: qkey(p),
        private_data: p.private_data.clone(),
    }
    .emit(&mut CmMsg::new_unchecked(&mut b[..]));
    b
}

fn qkey(p: &ConnParam) -> u32 {
    if p.qkey == 0 {
        DEFAULT_QKEY
    } else {
        p.qkey
    }
}

fn parse(b: &[u8]) -> Option<CmRepr> {
    CmRepr::parse(&CmMsg::new_checked(b).ok()?).ok()
}

fn info(r: CmRepr) -> PeerInfo {
    PeerInfo {
        node: r.node,
        qpn: r.qpn,
        psn: r.psn,
        rkey: r.rkey,
        addr: r.addr,
        len: r.len,
        qkey: r.qkey,
        private_data: r.private_data,
    }
}

/// Takes `qp` to RTS towards `peer` with the attributes rdma_cm would choose: all remote
/// accesses allowed on the QP, MTU 4096, `min_rnr_timer` 12 (0.64 ms), `rnr_retry` 7
/// (forever), `retry_cnt` 7, `timeout` 14.
pub fn ready_qp(qp: &Qp, peer: &PeerInfo, mine: &ConnParam) -> Result<(), VerbsError> {
    let state = qp.state();
    if state != QpState::Reset && state != QpState::Init {
        return Err(VerbsError::inval(format!(
            "the connection helper needs a QP in Reset or Init, not {state:?}"
        )));
    }
    let ty = qp.qp_type();
    if state == QpState::Reset {
        init_qp(qp, mine)?;
    }
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        path_mtu: Mtu::Mtu4096,
        dest_qp_num: peer.qpn,
        rq_psn: peer.psn,
        max_dest_rd_atomic: 16,
        min_rnr_timer: 12,
        ah_attr: AhAttr {
            dlid: peer.node as u16,
            port_num: 1,
            ..AhAttr::default()
        },
        ..QpAttr::default()
    };
    let m = match ty {
        QpType::Rc => {
            M::STATE
                | M::AV
                | M::PATH_MTU
                | M::DEST_QPN
                | M::RQ_PSN
                | M::MAX_DEST_RD_ATOMIC
                | M::MIN_RNR_TIMER
        }
        QpType::Uc => M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
        QpType::Ud => M::STATE,
    };
    qp.modify(&rtr, m)?;
    let rts = QpAttr {
        qp_state: QpState::Rts,
        sq_psn: mine.psn,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 16,
        ..QpAttr::default()
    };
    let m = match ty {
        QpType::Rc => {
            M::STATE | M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC
        }
        _ => M::STATE | M::SQ_PSN,
    };
    qp.modify(&rts, m)
}

/// Takes `qp` from RESET to INIT as `rdma_create_qp` leaves it: port 1, every remote access
/// allowed on the QP (REMOTE_WRITE only on UC), the Q_Key of `mine` on UD. Receives may be
/// posted from INIT on, before the connection exists.
pub fn init_qp(qp: &Qp, mine: &ConnParam) -> Result<(), VerbsError> {
    let ty = qp.qp_type();
    let mut a = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC,
        qkey: qkey(mine),
        ..QpAttr::default()
    };
    let mut m = M::STATE | M::PKEY_INDEX | M::PORT;
    if ty == QpType::Ud {
        m |= M::QKEY;
    } else {
        m |= M::ACCESS_FLAGS;
        if ty == QpType::Uc {
            a.qp_access_flags = AccessFlags::REMOTE_WRITE;
        }
    }
    qp.modify(&a, m)
}

/// A CM listener on a port of its node (`rdma_listen`).
#[derive(Debug)]
pub struct Listener {
    ep: Endpoint,
}

impl Listener {
    /// Listens on `port` of the context's node.
    pub fn bind(ctx: &Context, port: u32) -> Result<Self, VerbsError> {
        let ep = ctx
            .node()
            .bind(port)
            .map_err(|e| VerbsError::Refused(format!("cannot listen on port {port}: {e}")))?;
        Ok(Self { ep })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> Addr {
        self.ep.local_addr()
    }

    /// Waits for one connection request for `qp`'s transport, readies `qp` towards the
    /// requester and answers with `mine` (`rdma_get_request` + `rdma_accept`).
    pub fn accept(
        &mut self,
        qp: &Qp,
        mine: &ConnParam,
        timeout: Option<Duration>,
    ) -> Result<PeerInfo, VerbsError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut buf = [0u8; 256];
        loop {
            let wait = match deadline {
                None => Wait::Forever,
                Some(d) => Wait::For(d.saturating_duration_since(Instant::now())),
            };
            let (n, from) = match self.ep.recv(&mut buf, wait) {
                Ok(x) => x,
                Err(DgramError::TimedOut) => return Err(VerbsError::TimedOut),
                Err(e) => return Err(VerbsError::Refused(e.to_string())),
            };
            let Some(req) = parse(&buf[..n]).filter(|r| r.kind == CmKind::Req) else {
                continue; // not a request: ignore, as a listener ignores garbage
            };
            let me = self.ep.local_addr().node;
            if req.qp_type != qp.qp_type() as u8 || req.node != from.node {
                let _ = self.ep.try_send_to(from, &msg(CmKind::Rej, qp, me, mine));
                continue;
            }
            let peer = info(req);
            ready_qp(qp, &peer, mine)?;
            self.ep
                .send(
                    from,
                    &msg(CmKind::Rep, qp, me, mine),
                    Wait::For(Duration::from_secs(5)),
                )
                .map_err(|e| VerbsError::Refused(e.to_string()))?;
            return Ok(peer);
        }
    }
}

/// Connects `qp` to the listener at (`node`, `port`) (`rdma_connect`): retries while nobody
/// listens there yet, readies `qp` with the reply, returns what the listener offered.
pub fn connect(
    ctx: &Context,
    node: u32,
    port: u32,
    qp: &Qp,
    mine: &ConnParam,
    timeout: Duration,
) -> Result<PeerInfo, VerbsError> {
    let deadline = Instant::now() + timeout;
    let mut ep = ctx
        .node()
        .bind(0)
        .map_err(|e| VerbsError::Refused(e.to_string()))?;
    let me = ctx.node().slot();
    let req = msg(CmKind::Req, qp, me, mine);
    let to = Addr::new(node, port);
    loop {
        match ep.send(to, &req, Wait::For(Duration::from_secs(1))) {
            Ok(()) => break,
            Err(DgramError::Unreachable(_)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(DgramError::Unreachable(_)) => return Err(VerbsError::TimedOut),
            Err(e) => return Err(VerbsError::Refused(e.to_string())),
        }
    }
    let mut buf = [0u8; 256];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let (n, from) = match ep.recv(&mut buf, Wait::For(left)) {
            Ok(x) => x,
            Err(DgramError::TimedOut) => return Err(VerbsError::TimedOut),
            Err(e) => return Err(VerbsError::Refused(e.to_string())),
        };
        if from != to {
            continue;
        }
        match parse(&buf[..n]) {
            Some(r) if r.kind == CmKind::Rep && r.node == node => {
                let peer = info(r);
                ready_qp(qp, &peer, mine)?;
                return Ok(peer);
            }
            Some(r) if r.kind == CmKind::Rej => {
                return Err(VerbsError::Refused(format!(
                    "the listener at {to} rejected a {:?} QP",
                    qp.qp_type()
                )))
            }
            _ => continue,
        }
    }
}
