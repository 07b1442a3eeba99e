//! Messages of the verbs registry, the service the supervisor hosts for the RDMA verbs path
//! ([`crate::verbs::registry`]). The control protocol carries them opaquely as
//! `Request::Service` / `Response::Service` (JSON), so `fabric` does not know them; clients
//! send them with `Fabric::call_service`.
//!
//! The supervisor keeps the fabric's registries of verbs objects that peers must find or be
//! allowed to touch: memory regions (the memfd of each, by key), QP blocks (by node and QP
//! number) and context event blocks. Data never passes here.
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// A verbs request from a process to the supervisor.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "verb", rename_all = "snake_case")]
pub enum VerbsRequest {
    /// A device context opens on `slot`: allocate its event block. Reply: `ContextOpened`.
    OpenContext {
        /// Node slot.
        slot: u32,
    },
    /// A context closes: free its event block.
    CloseContext {
        /// Node slot.
        slot: u32,
        /// The event block's offset.
        event_off: u64,
    },
    /// Register a memory region; its memfd travels with the request. Reply: `MrRegistered`.
    RegMr {
        /// Node slot of the registering process.
        slot: u32,
        /// Protection domain (the process's own number for it).
        pd: u32,
        /// Data bytes (the memfd holds a header page plus these).
        len: u64,
        /// `IBV_ACCESS_*` flags.
        access: u32,
        /// A region over memory another object backs (a shared mapping's file, another
        /// region's memfd): a second fd comes with the header memfd (then one page), and its
        /// data starts at this page-aligned offset of that file (plus the header's `skew`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_off: Option<u64>,
    },
    /// Deregister a region: no new grants; peers that mapped it see its state word change.
    DeregMr {
        /// The region's key.
        key: u32,
    },
    /// Ask for a region of the peer of QP (slot, qpn), by rkey. Reply: `MrGranted` + memfd
    /// (read-only unless the region allows remote writes or atomics).
    MrGrant {
        /// Requester's slot.
        slot: u32,
        /// Requester's connected QP.
        qpn: u32,
        /// The rkey.
        rkey: u32,
    },
    /// Ask for region `rkey` of node `node` for the DMA engines of a process with a device
    /// context on `slot`. Reply: `MrGranted` + memfd (read-only unless the region allows remote
    /// writes or atomics).
    DmaGrant {
        /// Requester's slot (it must have a context open there).
        slot: u32,
        /// The node the region belongs to.
        node: u32,
        /// The rkey.
        rkey: u32,
    },
    /// Make an RC or UC QP block in `slot`'s window. Reply: `QpCreated`.
    CreateQp {
        /// Node slot.
        slot: u32,
        /// Protection domain.
        pd: u32,
        /// 2 = RC, 3 = UC.
        qp_type: u32,
        /// Inbound ring bytes (power of two).
        ring_len: u32,
        /// The owner context's event block.
        event_off: u64,
        /// The datagram port on `slot` through which the owner process carries the QP's
        /// traffic with a peer on another host itself (`verbs::direct`), if it does.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        direct: Option<u32>,
    },
    /// Destroy a QP block; its peer is told.
    DestroyQp {
        /// Node slot.
        slot: u32,
        /// QP number.
        qpn: u32,
    },
    /// Connect QP (slot, qpn) to (dest_slot, dest_qpn) at RTR. Reply: `QpConnected`.
    ConnectQp {
        /// Node slot.
        slot: u32,
        /// Local QP number.
        qpn: u32,
        /// Remote node.
        dest_slot: u32,
        /// Remote QP number.
        dest_qpn: u32,
    },
}

/// The supervisor's reply to a [`VerbsRequest`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "verb", rename_all = "snake_case")]
pub enum VerbsResponse {
    /// Reply to `OpenContext`.
    ContextOpened {
        /// Event block offset in the node's window.
        event_off: u64,
    },
    /// Reply to `RegMr`.
    MrRegistered {
        /// lkey and rkey (one key names the region locally and remotely).
        key: u32,
    },
    /// Reply to `MrGrant` (the memfd is attached; a second fd, the data's file, if
    /// `data_off` is set: as in `RegMr`).
    MrGranted {
        /// Data bytes.
        len: u64,
        /// `IBV_ACCESS_*` flags of the region.
        access: u32,
        /// Whether the attached fd may be mapped writable.
        writable: bool,
        /// Where the data starts in the second fd (`RegMr`'s `data_off`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_off: Option<u64>,
    },
    /// Reply to `MrGrant` when the QP's peer is on another host: no fd — the region is
    /// reached through the one-sided request ring of the peer's shadow (`wire::verbs::RDMA_*`),
    /// which the bridges carry to the owner's host.
    MrAcross {
        /// Data bytes.
        len: u64,
        /// `IBV_ACCESS_*` flags of the region.
        access: u32,
        /// Whether the region may be written (remote writes or atomics allowed).
        writable: bool,
        /// The owner's address of the region's first byte.
        iova: u64,
        /// The peer QP's node (its shadow window holds the rings).
        peer_slot: u32,
        /// The peer QP's number.
        peer_qpn: u32,
        /// The one-sided area's offset in that shadow window.
        rdma_off: u64,
        /// Each of its two rings' size.
        ring_len: u32,
        /// The shadow's event block (the bridge sleeps on its bell).
        event_off: u64,
    },
    /// Reply to `CreateQp`.
    QpCreated {
        /// QP number.
        qpn: u32,
        /// Block offset in the node's window.
        block_off: u64,
    },
    /// Reply to `ConnectQp`.
    QpConnected {
        /// The remote QP's block offset in its node's window.
        block_off: u64,
        /// The remote node's generation.
        generation: u32,
        /// The remote QP is on another host and both processes carry the pair themselves:
        /// the datagram port of the remote QP's process there.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        direct: Option<u32>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_replies_round_trip_through_json_tagged_by_verb() {
        let reqs = [
            VerbsRequest::MrGrant {
                slot: 1,
                qpn: 7,
                rkey: 0xabcd,
            },
            VerbsRequest::DmaGrant {
                slot: 1,
                node: 2,
                rkey: 9,
            },
            VerbsRequest::OpenContext { slot: 3 },
        ];
        for r in reqs {
            let v = serde_json::to_value(&r).unwrap();
            assert!(v["verb"].is_string(), "{v}");
            assert_eq!(serde_json::from_value::<VerbsRequest>(v).unwrap(), r);
        }
        let v = serde_json::to_value(VerbsResponse::MrRegistered { key: 5 }).unwrap();
        assert!(matches!(
            serde_json::from_value(v).unwrap(),
            VerbsResponse::MrRegistered { key: 5 }
        ));
        // A body that is not one of ours is an error, never a default.
        assert!(
            serde_json::from_value::<VerbsRequest>(serde_json::json!({"verb": "reg_mr"})).is_err()
        );
        assert!(serde_json::from_value::<VerbsRequest>(serde_json::json!([1, 2])).is_err());
    }
}
