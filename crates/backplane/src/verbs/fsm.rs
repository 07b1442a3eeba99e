//! The queue pair state machine of `ibv_modify_qp`: which transitions exist and which
//! attributes each one requires or allows, per transport (the table of the IB specification
//! that the kernel's `ib_modify_qp_is_ok` implements). Sans-IO: a pure check.
#![forbid(unsafe_code)]

use super::types::{AccessFlags, QpAttr, QpAttrMask as M, QpState as S, QpType};

/// Attributes (beyond STATE) a transition requires and allows.
fn table(ty: QpType, cur: S, next: S) -> Option<(M, M)> {
    let none = M::empty();
    let rc_uc_init = M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS;
    let ud_init = M::PKEY_INDEX | M::PORT | M::QKEY;
    Some(match (cur, next) {
        (_, S::Reset) | (_, S::Err) => (none, none),
        (S::Reset, S::Init) => match ty {
            QpType::Ud => (ud_init, none),
            _ => (rc_uc_init, none),
        },
        (S::Init, S::Init) => match ty {
            QpType::Ud => (none, ud_init),
            _ => (none, rc_uc_init),
        },
        (S::Init, S::Rtr) => match ty {
            QpType::Rc => (
                M::AV
                    | M::PATH_MTU
                    | M::DEST_QPN
                    | M::RQ_PSN
                    | M::MAX_DEST_RD_ATOMIC
                    | M::MIN_RNR_TIMER,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
            ),
            QpType::Uc => (
                M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
            ),
            QpType::Ud => (none, M::PKEY_INDEX | M::QKEY),
        },
        (S::Rtr, S::Rts) => match ty {
            QpType::Rc => (
                M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::MIN_RNR_TIMER | M::PATH_MIG_STATE,
            ),
            QpType::Uc => (
                M::SQ_PSN,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE,
            ),
            QpType::Ud => (M::SQ_PSN, M::CUR_STATE | M::QKEY),
        },
        (S::Rts, S::Rts) => match ty {
            QpType::Rc => (
                none,
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE | M::MIN_RNR_TIMER,
            ),
            QpType::Uc => (
                none,
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE,
            ),
            QpType::Ud => (none, M::CUR_STATE | M::QKEY),
        },
        _ => return None,
    })
}

/// Checks a modify request against the QP's current state; returns the state to move to.
/// The error text says what is wrong, as a libibverbs user would want to know it (`EINVAL`).
pub fn check(ty: QpType, cur: S, attr: &QpAttr, mask: M) -> Result<S, String> {
    if !mask.contains(M::STATE) {
        // Without STATE, libibverbs modifies attributes in the current state (INIT→INIT,
        // RTS→RTS); treat it as the self-transition.
        let mut m = mask;
        m |= M::STATE;
        let a = QpAttr {
            qp_state: cur,
            ..*attr
        };
        return check(ty, cur, &a, m);
    }
    if mask.contains(M::CUR_STATE) && attr.cur_qp_state != cur {
        return Err(format!(
            "cur_qp_state {:?} does not match the QP's state {cur:?}",
            attr.cur_qp_state
        ));
    }
    let next = attr.qp_state;
    let Some((req, opt)) = table(ty, cur, next) else {
        return Err(format!("{ty:?} QP cannot move from {cur:?} to {next:?}"));
    };
    let given = mask.difference(M::STATE | M::CUR_STATE);
    let missing = req.difference(given);
    if missing != M::empty() {
        return Err(format!(
            "{cur:?} -> {next:?} on a {ty:?} QP needs attributes {missing:?}"
        ));
    }
    let extra = given.difference(req | opt);
    if extra != M::empty() {
        return Err(format!(
            "{cur:?} -> {next:?} on a {ty:?} QP does not take attributes {extra:?}"
        ));
    }
    if mask.contains(M::PORT) && attr.port_num != 1 {
        return Err(format!("port {} does not exist (ports: 1)", attr.port_num));
    }
    if mask.contains(M::PKEY_INDEX) && attr.pkey_index != 0 {
        return Err(format!("pkey index {} does not exist", attr.pkey_index));
    }
    let remote = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC;
    if mask.contains(M::ACCESS_FLAGS) && !remote.contains(attr.qp_access_flags) {
        return Err(format!(
            "unknown access flags {:#x}",
            attr.qp_access_flags.bits()
        ));
    }
    if mask.contains(M::MIN_RNR_TIMER) && attr.min_rnr_timer > 31 {
        return Err(format!("min_rnr_timer {} is not 0..31", attr.min_rnr_timer));
    }
    if mask.contains(M::RNR_RETRY) && attr.rnr_retry > 7 {
        return Err(format!("rnr_retry {} is not 0..7", attr.rnr_retry));
    }
    if mask.contains(M::RETRY_CNT) && attr.retry_cnt > 7 {
        return Err(format!("retry_cnt {} is not 0..7", attr.retry_cnt));
    }
    if mask.contains(M::AV) && (attr.ah_attr.dlid == 0 || attr.ah_attr.port_num > 1) {
        return Err(format!(
            "ah_attr names LID {} port {}; LIDs are node slots, the port is 1",
            attr.ah_attr.dlid, attr.ah_attr.port_num
        ));
    }
    Ok(next)
}

/// The RNR NAK timer of IB encoding `v` (0..31), in microseconds: 0 means 655.36 ms.
pub const fn rnr_timer_us(v: u8) -> u64 {
    const T: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    T[(v & 31) as usize]
}

/// How long an RC requester retries an unacknowledged request before it completes with
/// `IBV_WC_RETRY_EXC_ERR`: the local ACK timeout (4.096 µs × 2^`timeout`, IB spec 9.7.6.1.3)
/// for the first transmission and each of `retry_cnt` retries. `timeout` 0 means "infinite" in
/// the specification; here it means no wait (a gone peer fails the work at once), so a program
/// that leaves it unset is told and does not hang.
pub fn retry_wait(timeout: u8, retry_cnt: u8) -> std::time::Duration {
    if timeout == 0 {
        return std::time::Duration::ZERO;
    }
    let ns = 4096u64 << (timeout.min(31));
    std::time::Duration::from_nanos(ns.saturating_mul(u64::from(retry_cnt.min(7)) + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_retry_wait_is_the_ack_timeout_for_the_first_try_and_each_retry() {
        use std::time::Duration;
        assert_eq!(retry_wait(0, 7), Duration::ZERO, "0: no wait");
        assert_eq!(retry_wait(1, 0), Duration::from_nanos(8192));
        // perftest and the pingpong examples: timeout 14, retry_cnt 7 = 8 × 67.1 ms.
        assert_eq!(retry_wait(14, 7), Duration::from_nanos((8 * 4096) << 14));
        assert_eq!(retry_wait(31, 7), retry_wait(31, 9), "retry_cnt is 3 bits");
    }
    use crate::verbs::types::AhAttr;

    fn rtr_attr() -> QpAttr {
        QpAttr {
            qp_state: S::Rtr,
            ah_attr: AhAttr {
                dlid: 2,
                port_num: 1,
                ..AhAttr::default()
            },
            dest_qp_num: 0x10_0000,
            min_rnr_timer: 12,
            ..QpAttr::default()
        }
    }

    const RC_RTR: M = M::from_bits_retain(
        M::STATE.bits()
            | M::AV.bits()
            | M::PATH_MTU.bits()
            | M::DEST_QPN.bits()
            | M::RQ_PSN.bits()
            | M::MAX_DEST_RD_ATOMIC.bits()
            | M::MIN_RNR_TIMER.bits(),
    );

    #[test]
    fn the_rc_path_reset_init_rtr_rts_is_accepted_with_its_attributes() {
        let init = QpAttr {
            qp_state: S::Init,
            port_num: 1,
            ..QpAttr::default()
        };
        let m = M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS;
        assert_eq!(check(QpType::Rc, S::Reset, &init, m), Ok(S::Init));
        assert_eq!(check(QpType::Rc, S::Init, &rtr_attr(), RC_RTR), Ok(S::Rtr));
        let rts = QpAttr {
            qp_state: S::Rts,
            rnr_retry: 7,
            ..QpAttr::default()
        };
        let m =
            M::STATE | M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC;
        assert_eq!(check(QpType::Rc, S::Rtr, &rts, m), Ok(S::Rts));
    }

    #[test]
    fn skipping_states_or_missing_attributes_is_rejected() {
        let rts = QpAttr {
            qp_state: S::Rts,
            ..QpAttr::default()
        };
        assert!(check(QpType::Rc, S::Reset, &rts, M::STATE).is_err());
        assert!(check(QpType::Rc, S::Init, &rts, M::STATE).is_err());
        let missing = M::from_bits_retain(RC_RTR.bits() & !M::MIN_RNR_TIMER.bits());
        let e = check(QpType::Rc, S::Init, &rtr_attr(), missing).unwrap_err();
        assert!(e.contains("MIN_RNR_TIMER"), "{e}");
        // UC does not take the RC-only responder attributes.
        assert!(check(QpType::Uc, S::Init, &rtr_attr(), RC_RTR).is_err());
        // UD needs a Q_Key at INIT.
        let init = QpAttr {
            qp_state: S::Init,
            port_num: 1,
            ..QpAttr::default()
        };
        assert!(check(
            QpType::Ud,
            S::Reset,
            &init,
            M::STATE | M::PKEY_INDEX | M::PORT
        )
        .is_err());
        assert_eq!(
            check(
                QpType::Ud,
                S::Reset,
                &init,
                M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY
            ),
            Ok(S::Init)
        );
    }

    #[test]
    fn any_state_may_go_to_err_or_reset_and_cur_state_must_match() {
        for cur in [S::Reset, S::Init, S::Rtr, S::Rts, S::Err] {
            for next in [S::Err, S::Reset] {
                let a = QpAttr {
                    qp_state: next,
                    ..QpAttr::default()
                };
                assert_eq!(check(QpType::Rc, cur, &a, M::STATE), Ok(next));
            }
        }
        let a = QpAttr {
            qp_state: S::Err,
            cur_qp_state: S::Init,
            ..QpAttr::default()
        };
        assert!(check(QpType::Rc, S::Rts, &a, M::STATE | M::CUR_STATE).is_err());
        // ERR -> RTS is not a transition.
        let a = QpAttr {
            qp_state: S::Rts,
            ..QpAttr::default()
        };
        assert!(check(QpType::Rc, S::Err, &a, M::STATE).is_err());
    }

    #[test]
    fn out_of_range_values_are_rejected() {
        let mut a = rtr_attr();
        a.min_rnr_timer = 32;
        assert!(check(QpType::Rc, S::Init, &a, RC_RTR).is_err());
        let mut a = rtr_attr();
        a.ah_attr.dlid = 0;
        assert!(check(QpType::Rc, S::Init, &a, RC_RTR).is_err());
        let init = QpAttr {
            qp_state: S::Init,
            port_num: 2,
            ..QpAttr::default()
        };
        let m = M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS;
        assert!(check(QpType::Rc, S::Reset, &init, m).is_err());
    }

    #[test]
    fn rnr_timer_encoding_follows_the_ib_table() {
        assert_eq!(rnr_timer_us(0), 655_360);
        assert_eq!(rnr_timer_us(1), 10);
        assert_eq!(rnr_timer_us(12), 640);
        assert_eq!(rnr_timer_us(31), 491_520);
    }
}
