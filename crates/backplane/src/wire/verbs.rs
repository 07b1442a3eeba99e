//! Shared-memory layouts of the RDMA verbs path (see [`crate::verbs`]).
//!
//! - the **memory region header**: the first page of every MR memfd (data starts at
//!   [`MR_DATA_OFF`]); its `state` word says whether the owner still has the region registered;
//! - the **QP block**: one per RC/UC queue pair, in the owner's window: a static header, the
//!   line the connected peer writes (acks, credits, NAKs), and the QP's inbound ring;
//! - the **context event block**: the doorbell a context's completion channel sleeps on;
//! - the **message header** at the start of every ring record a QP sends, the **UD header**
//!   of every UD datagram, and the **CM message** the connection helper exchanges.
//!
//! Same conventions as the rest of [`crate::wire`]: `Packet` + `Repr`, little-endian, magic +
//! version + `initialized` marker on the static headers. **If `check_len` passed, no accessor
//! panics.** Everything here is read from memory a peer can write, so every parse validates.

use super::{check, rd_u32, rd_u64, wr_u32, wr_u64, LayoutError, CACHE_LINE, INIT_MARK};

// ---------------------------------------------------------------------------------------------
// Memory region header (first page of an MR memfd).
// ---------------------------------------------------------------------------------------------

/// Magic of a memory region: `BPMEMREG`.
pub const MR_MAGIC: u64 = u64::from_le_bytes(*b"BPMEMREG");
/// Layout version of the memory region header (2: `skew` and `iova`).
pub const MR_VERSION: u32 = 2;
/// Where the region's data begins in its memfd (one page of header).
pub const MR_DATA_OFF: u64 = 4096;
/// The registration state word (u32), on its own cache line; written by the owner only.
pub const MR_STATE_OFF: usize = 64;
/// `state` value of a registered region. Any other value means deregistered.
pub const MR_STATE_VALID: u32 = 0x4D52_0001;
/// `state` value written by the owner when it deregisters the region.
pub const MR_STATE_DEREGISTERED: u32 = 0x4D52_DEAD;
/// Offset of the MR header's `initialized` marker.
pub const MR_INIT_OFF: usize = mr_field::INITIALIZED;

mod mr_field {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const HEADER_LEN: usize = 12;
    pub const LEN: usize = 16;
    pub const INITIALIZED: usize = 24;
    pub const SKEW: usize = 28;
    pub const IOVA: usize = 32;
}

packet!(
    /// The static header of a memory region memfd.
    MrHeader,
    64
);

/// Parsed memory region header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrRepr {
    /// Data bytes (the registered length).
    pub len: u64,
    /// Where the registered bytes begin after [`MR_DATA_OFF`] (below a page): a region made
    /// under memory the program allocated keeps that memory's place in its page.
    pub skew: u32,
    /// The address of the first registered byte in the owner's address space (0 for a region
    /// the library allocated: zero-based). Peers name remote bytes by it (`remote_addr`).
    pub iova: u64,
}

impl MrRepr {
    /// Parses and validates a region header against the size actually mapped.
    pub fn parse<T: AsRef<[u8]>>(p: &MrHeader<T>, mapped: u64) -> Result<Self, LayoutError> {
        p.check_len()?;
        let b = p.buffer.as_ref();
        let magic = rd_u64(b, mr_field::MAGIC);
        if magic != MR_MAGIC {
            return Err(LayoutError::BadMagic(magic));
        }
        let version = rd_u32(b, mr_field::VERSION);
        if version != MR_VERSION {
            return Err(LayoutError::BadVersion(version));
        }
        if rd_u32(b, mr_field::INITIALIZED) != INIT_MARK {
            return Err(LayoutError::NotInitialized);
        }
        let hl = rd_u32(b, mr_field::HEADER_LEN);
        if u64::from(hl) != MR_DATA_OFF {
            return Err(LayoutError::BadField {
                field: "header_len",
                value: hl.into(),
            });
        }
        let skew = rd_u32(b, mr_field::SKEW);
        if u64::from(skew) >= MR_DATA_OFF {
            return Err(LayoutError::BadField {
                field: "skew",
                value: skew.into(),
            });
        }
        let len = rd_u64(b, mr_field::LEN);
        if len == 0
            || len
                .checked_add(MR_DATA_OFF + u64::from(skew))
                .is_none_or(|e| e > mapped)
        {
            return Err(LayoutError::BadField {
                field: "len",
                value: len,
            });
        }
        let iova = rd_u64(b, mr_field::IOVA);
        if iova.checked_add(len).is_none() {
            return Err(LayoutError::BadField {
                field: "iova",
                value: iova,
            });
        }
        Ok(Self { len, skew, iova })
    }

    /// Writes the header, `initialized` included.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut MrHeader<T>) {
        let b = p.buffer.as_mut();
        wr_u64(b, mr_field::MAGIC, MR_MAGIC);
        wr_u32(b, mr_field::VERSION, MR_VERSION);
        wr_u32(b, mr_field::HEADER_LEN, MR_DATA_OFF as u32);
        wr_u64(b, mr_field::LEN, self.len);
        wr_u32(b, mr_field::SKEW, self.skew);
        wr_u64(b, mr_field::IOVA, self.iova);
        wr_u32(b, mr_field::INITIALIZED, INIT_MARK);
    }
}

// ---------------------------------------------------------------------------------------------
// QP block (in the owner's window).
// ---------------------------------------------------------------------------------------------

/// Magic of a QP block: `BPQPBLK1`.
pub const QP_MAGIC: u64 = u64::from_le_bytes(*b"BPQPBLK1");
/// Layout version of a QP block.
pub const QP_VERSION: u32 = 1;
/// Offset of a QP block header's `initialized` marker.
pub const QP_INIT_OFF: usize = qp_field::INITIALIZED;

/// Written by the connected peer (its consumer): how far it consumed our outbound ring, i.e.
/// the acknowledgement of everything we sent before that ring position (u64, Release).
pub const QP_ACK_OFF: usize = 64;
/// Written by the connected peer: receives it has posted so far (u64, cumulative, Release).
/// Our credits: an RC requester sends a message that needs a receive only when one is posted.
pub const QP_CREDITS_OFF: usize = 72;
/// Written by the connected peer: a negative acknowledgement, `(message seq + 1) << 8 |
/// syndrome` (u64; 0 = none). Published before the ack that passes the refused message.
pub const QP_NAK_OFF: usize = 80;
/// Written by the connected peer or the supervisor: the peer QP is in error, destroyed, or its
/// process or node is gone (u32; non-zero = gone).
pub const QP_PEER_ERR_OFF: usize = 88;
/// Written by the connected peer at its RTR: its `min_rnr_timer` + 1 (u32; 0 = not yet).
pub const QP_PEER_RNR_OFF: usize = 92;
/// Written by the owner: the QP's `qp_access_flags` (u32), which remote operations it accepts
/// as a responder. Requesters check it before every one-sided operation.
pub const QP_ACCESS_OFF: usize = 128;
/// Producer index of the inbound ring (u64), written by the peer (Release).
pub const QP_TAIL_OFF: usize = 192;
/// Start of the inbound ring's data area.
pub const QP_RING_OFF: u64 = 256;

/// NAK syndrome: the responder's receive buffer was too small (requester: REM_INV_REQ_ERR).
pub const NAK_INV_REQ: u8 = 1;
/// NAK syndrome: the responder could not place the message (requester: REM_OP_ERR).
pub const NAK_REM_OP: u8 = 2;
/// NAK syndrome: a message arrived with no receive posted (requester: RNR_RETRY_EXC_ERR).
pub const NAK_RNR: u8 = 3;

mod qp_field {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const QP_TYPE: usize = 12;
    pub const QPN: usize = 16;
    pub const SLOT: usize = 20;
    pub const GENERATION: usize = 24;
    pub const RING_LEN: usize = 28;
    pub const EVENT_OFF: usize = 32;
    pub const INITIALIZED: usize = 40;
}

packet!(
    /// The static header of a QP block (supervisor-written).
    QpBlockHeader,
    64
);

/// Parsed QP block header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpBlockRepr {
    /// Transport: 2 = RC, 3 = UC (libibverbs `IBV_QPT_*` numbers).
    pub qp_type: u32,
    /// QP number.
    pub qpn: u32,
    /// Owner's slot.
    pub slot: u32,
    /// Owner node's generation when the QP was made.
    pub generation: u32,
    /// Bytes in the inbound ring's data area.
    pub ring_len: u32,
    /// Offset of the owner context's event block in the owner's window.
    pub event_off: u64,
}

/// Smallest ring a QP block may have: two largest fragments plus headers.
pub const QP_MIN_RING: u32 = 256 * 1024;
/// The QPN bit of a *DMA pair* across hosts (a process's DMA engines reaching a region on
/// another host, with no QP): the one-sided area of a shadow with such a number, which no QP
/// may connect to (QPNs of queue pairs are 24-bit).
pub const DMA_PAIR_QPN: u32 = 1 << 31;
/// Largest ring a QP block may have.
pub const QP_MAX_RING: u32 = 64 << 20;

impl QpBlockRepr {
    /// Parses and validates a QP block header.
    pub fn parse<T: AsRef<[u8]>>(p: &QpBlockHeader<T>) -> Result<Self, LayoutError> {
        p.check_len()?;
        let b = p.buffer.as_ref();
        let magic = rd_u64(b, qp_field::MAGIC);
        if magic != QP_MAGIC {
            return Err(LayoutError::BadMagic(magic));
        }
        let version = rd_u32(b, qp_field::VERSION);
        if version != QP_VERSION {
            return Err(LayoutError::BadVersion(version));
        }
        if rd_u32(b, qp_field::INITIALIZED) != INIT_MARK {
            return Err(LayoutError::NotInitialized);
        }
        let qp_type = rd_u32(b, qp_field::QP_TYPE);
        if qp_type != 2 && qp_type != 3 {
            return Err(LayoutError::BadField {
                field: "qp_type",
                value: qp_type.into(),
            });
        }
        let ring_len = rd_u32(b, qp_field::RING_LEN);
        if !ring_len.is_power_of_two() || !(QP_MIN_RING..=QP_MAX_RING).contains(&ring_len) {
            return Err(LayoutError::BadField {
                field: "ring_len",
                value: ring_len.into(),
            });
        }
        let event_off = rd_u64(b, qp_field::EVENT_OFF);
        if !event_off.is_multiple_of(CACHE_LINE as u64) {
            return Err(LayoutError::BadField {
                field: "event_off",
                value: event_off,
            });
        }
        Ok(Self {
            qp_type,
            qpn: rd_u32(b, qp_field::QPN),
            slot: rd_u32(b, qp_field::SLOT),
            generation: rd_u32(b, qp_field::GENERATION),
            ring_len,
            event_off,
        })
    }

    /// Writes the header, `initialized` included.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut QpBlockHeader<T>) {
        let b = p.buffer.as_mut();
        wr_u64(b, qp_field::MAGIC, QP_MAGIC);
        wr_u32(b, qp_field::VERSION, QP_VERSION);
        wr_u32(b, qp_field::QP_TYPE, self.qp_type);
        wr_u32(b, qp_field::QPN, self.qpn);
        wr_u32(b, qp_field::SLOT, self.slot);
        wr_u32(b, qp_field::GENERATION, self.generation);
        wr_u32(b, qp_field::RING_LEN, self.ring_len);
        wr_u64(b, qp_field::EVENT_OFF, self.event_off);
        wr_u32(b, qp_field::INITIALIZED, INIT_MARK);
    }

    /// Bytes a QP block with this ring occupies in a window.
    pub const fn footprint(ring_len: u32) -> u64 {
        QP_RING_OFF + ring_len as u64
    }
}

// ---------------------------------------------------------------------------------------------
// One-sided area of a shadow QP (a QP of another host, mirrored here): the local QP connected
// to it puts its RDMA WRITE / READ / atomic requests into the request ring; this host's bridge
// ships them to the owner's host, whose bridge carries them out on the region, and writes the
// answers back here (READ data and atomic values into the response ring, the rest as words).
// ---------------------------------------------------------------------------------------------

/// Every request with an id up to this one is finished (u64, the bridge writes, release).
pub const RDMA_DONE_OFF: usize = 0;
/// The first request that failed (u64; 0 none), written before `done` passes it.
pub const RDMA_FAILED_OFF: usize = 8;
/// Non-zero once the pair is cut (u32): no answer will come.
pub const RDMA_GONE_OFF: usize = 16;
/// Request ring: producer index (the requesting process).
pub const RDMA_REQ_TAIL_OFF: usize = 64;
/// Request ring: consumer index (the bridge).
pub const RDMA_REQ_HEAD_OFF: usize = 128;
/// Response ring: producer index (the bridge).
pub const RDMA_RESP_TAIL_OFF: usize = 192;
/// Response ring: consumer index (the requesting process).
pub const RDMA_RESP_HEAD_OFF: usize = 256;
/// The request ring's data, then the response ring's, each of the shadow's ring size.
pub const RDMA_RING_OFF: u64 = 4096;
/// Bytes of a request record before its data: op (u8, 7 pad), id (u64), rkey (u32), length
/// (u32), offset in the region (u64), two operands (u64 each: add / compare, swap).
pub const RDMA_REQ_HEAD: usize = 48;
/// Bytes of a response record before its data: id (u64), status (u32, 0 done, else the
/// `ibv_wc_status`), pad (u32), value (u64: an atomic's old value).
pub const RDMA_RESP_HEAD: usize = 24;
/// At most this many data bytes in one request or response.
pub const RDMA_PIECE: usize = 64 * 1024;
/// RDMA WRITE of the record's data.
pub const RDMA_OP_WRITE: u8 = 1;
/// RDMA READ of `length` bytes.
pub const RDMA_OP_READ: u8 = 2;
/// Fetch and add.
pub const RDMA_OP_FETCH_ADD: u8 = 3;
/// Compare and swap.
pub const RDMA_OP_CMP_SWAP: u8 = 4;

/// Each one-sided ring of a shadow whose QP ring is `ring_len` bytes: as large, up to 1 MiB
/// (sixteen 64 KiB pieces in flight: more only costs window space, the bridge keeps up).
pub const fn rdma_ring_len(ring_len: u32) -> u32 {
    if ring_len < (1 << 20) {
        ring_len
    } else {
        1 << 20
    }
}

/// Where a shadow's one-sided area starts, from the start of its QP block: after the block,
/// page-aligned (the registry lays shadows out so, and a process carrying a pair itself
/// finds the area there).
pub fn rdma_area_at(ring_len: u32) -> u64 {
    QpBlockRepr::footprint(ring_len).next_multiple_of(4096)
}

/// Bytes a shadow's one-sided area occupies (after its QP block, page-aligned).
pub const fn rdma_footprint(ring_len: u32) -> u64 {
    RDMA_RING_OFF + 2 * rdma_ring_len(ring_len) as u64
}

// ---------------------------------------------------------------------------------------------
// Context event block (in the owner's window).
// ---------------------------------------------------------------------------------------------

/// The bell (u32 futex word), bumped by peers after they publish work for an armed context.
pub const EV_BELL_OFF: usize = 0;
/// The armed flag (u32), written by the context's completion channel before it sleeps.
pub const EV_ARMED_OFF: usize = 64;
/// Size of a context event block.
pub const EV_LEN: u64 = 128;

// ---------------------------------------------------------------------------------------------
// Message header (start of every QP ring record).
// ---------------------------------------------------------------------------------------------

/// Opcode of a QP message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgOp {
    /// SEND: the payload goes into the next posted receive.
    Send = 1,
    /// SEND_WITH_IMM: as SEND, with 32 bits of immediate data in the completion.
    SendImm = 2,
    /// The notification of an RDMA_WRITE_WITH_IMM: consumes a receive, carries no payload.
    WriteImm = 3,
}

/// Message flag: first fragment of a message.
pub const MSG_FIRST: u8 = 1;
/// Message flag: last fragment of a message.
pub const MSG_LAST: u8 = 2;
/// Message flag: the sender asked for a solicited event.
pub const MSG_SOLICITED: u8 = 4;
/// Largest message the verbs path carries (SEND or WRITE), as `max_msg_sz`.
pub const MAX_MSG: u32 = 1 << 30;

mod msg_field {
    pub const OPCODE: usize = 0;
    pub const FLAGS: usize = 1;
    pub const IMM: usize = 4;
    pub const MSG_LEN: usize = 8;
    pub const FRAG_OFF: usize = 12;
    pub const ACK: usize = 16;
    pub const CREDITS: usize = 24;
}

packet!(
    /// The header of one fragment of a QP message.
    MsgHeader,
    32
);

/// Parsed message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsgRepr {
    /// Opcode.
    pub op: MsgOp,
    /// `MSG_*` flags.
    pub flags: u8,
    /// Immediate data (SendImm, WriteImm).
    pub imm: u32,
    /// Whole message length (for WriteImm: the length of the RDMA write).
    pub msg_len: u32,
    /// Offset of this fragment's payload in the message.
    pub frag_off: u32,
    /// Piggybacked acknowledgement: how far the sender consumed the reverse ring.
    pub ack: u64,
    /// Piggybacked credits: receives the sender has posted so far.
    pub credits: u64,
}

impl MsgRepr {
    /// Parses a header and checks it against the fragment's payload length `frag_len`.
    #[inline]
    pub fn parse<T: AsRef<[u8]>>(p: &MsgHeader<T>, frag_len: usize) -> Result<Self, LayoutError> {
        p.check_len()?;
        let b = p.buffer.as_ref();
        let op = match b[msg_field::OPCODE] {
            1 => MsgOp::Send,
            2 => MsgOp::SendImm,
            3 => MsgOp::WriteImm,
            v => {
                return Err(LayoutError::BadField {
                    field: "opcode",
                    value: v.into(),
                })
            }
        };
        let flags = b[msg_field::FLAGS];
        if flags & !(MSG_FIRST | MSG_LAST | MSG_SOLICITED) != 0 {
            return Err(LayoutError::BadField {
                field: "flags",
                value: flags.into(),
            });
        }
        let msg_len = rd_u32(b, msg_field::MSG_LEN);
        let frag_off = rd_u32(b, msg_field::FRAG_OFF);
        let bad = |field, value: u64| Err(LayoutError::BadField { field, value });
        if msg_len > MAX_MSG {
            return bad("msg_len", msg_len.into());
        }
        let end = u64::from(frag_off) + frag_len as u64;
        if op == MsgOp::WriteImm {
            if frag_len != 0
                || frag_off != 0
                || flags & (MSG_FIRST | MSG_LAST) != MSG_FIRST | MSG_LAST
            {
                return bad("write_imm", frag_len as u64);
            }
        } else if end > u64::from(msg_len)
            || (flags & MSG_FIRST != 0) != (frag_off == 0)
            || (flags & MSG_LAST != 0) != (end == u64::from(msg_len))
        {
            return bad("frag_off", frag_off.into());
        }
        Ok(Self {
            op,
            flags,
            imm: rd_u32(b, msg_field::IMM),
            msg_len,
            frag_off,
            ack: rd_u64(b, msg_field::ACK),
            credits: rd_u64(b, msg_field::CREDITS),
        })
    }

    /// Writes the header.
    #[inline]
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut MsgHeader<T>) {
        let b = p.buffer.as_mut();
        b[msg_field::OPCODE] = self.op as u8;
        b[msg_field::FLAGS] = self.flags;
        b[2] = 0;
        b[3] = 0;
        wr_u32(b, msg_field::IMM, self.imm);
        wr_u32(b, msg_field::MSG_LEN, self.msg_len);
        wr_u32(b, msg_field::FRAG_OFF, self.frag_off);
        wr_u64(b, msg_field::ACK, self.ack);
        wr_u64(b, msg_field::CREDITS, self.credits);
    }
}

// ---------------------------------------------------------------------------------------------
// UD header (start of every UD datagram).
// ---------------------------------------------------------------------------------------------

/// Magic byte pair of a UD datagram.
pub const UD_MAGIC: u16 = 0x5544;
/// Bytes of Global Routing Header a UD receive buffer starts with (as on RoCE).
pub const GRH_LEN: usize = 40;

mod ud_field {
    pub const MAGIC: usize = 0;
    pub const OPCODE: usize = 2;
    pub const FLAGS: usize = 3;
    pub const IMM: usize = 4;
    pub const QKEY: usize = 8;
    pub const SRC_QPN: usize = 12;
}

packet!(
    /// The header of a UD datagram.
    UdHeader,
    16
);

/// Parsed UD header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdRepr {
    /// Send or SendImm.
    pub op: MsgOp,
    /// `MSG_SOLICITED` or 0.
    pub flags: u8,
    /// Immediate data.
    pub imm: u32,
    /// Q_Key the sender addressed.
    pub qkey: u32,
    /// Sender's QP number (cross-checked against the datagram's source port).
    pub src_qpn: u32,
}

impl UdRepr {
    /// Parses and validates a UD header.
    pub fn parse<T: AsRef<[u8]>>(p: &UdHeader<T>) -> Result<Self, LayoutError> {
        p.check_len()?;
        let b = p.buffer.as_ref();
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != UD_MAGIC {
            return Err(LayoutError::BadMagic(magic.into()));
        }
        let op = match b[ud_field::OPCODE] {
            1 => MsgOp::Send,
            2 => MsgOp::SendImm,
            v => {
                return Err(LayoutError::BadField {
                    field: "opcode",
                    value: v.into(),
                })
            }
        };
        let flags = b[ud_field::FLAGS];
        if flags & !MSG_SOLICITED != 0 {
            return Err(LayoutError::BadField {
                field: "flags",
                value: flags.into(),
            });
        }
        Ok(Self {
            op,
            flags,
            imm: rd_u32(b, ud_field::IMM),
            qkey: rd_u32(b, ud_field::QKEY),
            src_qpn: rd_u32(b, ud_field::SRC_QPN),
        })
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut UdHeader<T>) {
        let b = p.buffer.as_mut();
        b[ud_field::MAGIC..ud_field::MAGIC + 2].copy_from_slice(&UD_MAGIC.to_le_bytes());
        b[ud_field::OPCODE] = self.op as u8;
        b[ud_field::FLAGS] = self.flags;
        wr_u32(b, ud_field::IMM, self.imm);
        wr_u32(b, ud_field::QKEY, self.qkey);
        wr_u32(b, ud_field::SRC_QPN, self.src_qpn);
    }
}

// ---------------------------------------------------------------------------------------------
// Connection manager message (a datagram between CM endpoints).
// ---------------------------------------------------------------------------------------------

/// Magic of a CM message: `BPCM`.
pub const CM_MAGIC: u32 = u32::from_le_bytes(*b"BPCM");
/// Version of the CM message layout.
pub const CM_VERSION: u16 = 1;
/// Largest private data a CM message carries (as rdma_cm's 56 bytes for RC).
pub const CM_PRIVATE_MAX: usize = 56;

/// Kind of a CM message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmKind {
    /// Connection request (client → listener).
    Req = 1,
    /// Accept (listener → client).
    Rep = 2,
    /// Reject (listener → client).
    Rej = 3,
}

mod cm_field {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 4;
    pub const KIND: usize = 6;
    pub const QP_TYPE: usize = 7;
    pub const NODE: usize = 8;
    pub const QPN: usize = 12;
    pub const PSN: usize = 16;
    pub const RKEY: usize = 20;
    pub const ADDR: usize = 24;
    pub const LEN: usize = 32;
    pub const QKEY: usize = 40;
    pub const PRIV_LEN: usize = 44;
    pub const PRIV: usize = 48;
}

packet!(
    /// A connection manager message.
    CmMsg,
    cm_field::PRIV + CM_PRIVATE_MAX
);

/// Parsed CM message: what one side tells the other about its QP and its region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmRepr {
    /// Message kind.
    pub kind: CmKind,
    /// QP transport (2 RC, 3 UC, 4 UD).
    pub qp_type: u8,
    /// Sender's node (its LID).
    pub node: u32,
    /// Sender's QP number.
    pub qpn: u32,
    /// Sender's starting packet sequence number.
    pub psn: u32,
    /// rkey of the region the sender offers (0: none).
    pub rkey: u32,
    /// Offset in that region the peer may use.
    pub addr: u64,
    /// Bytes of that region the peer may use.
    pub len: u64,
    /// Q_Key (UD).
    pub qkey: u32,
    /// Application private data (≤ [`CM_PRIVATE_MAX`] bytes).
    pub private_data: Vec<u8>,
}

impl CmRepr {
    /// Parses and validates a CM message.
    pub fn parse<T: AsRef<[u8]>>(p: &CmMsg<T>) -> Result<Self, LayoutError> {
        p.check_len()?;
        let b = p.buffer.as_ref();
        let magic = rd_u32(b, cm_field::MAGIC);
        if magic != CM_MAGIC {
            return Err(LayoutError::BadMagic(magic.into()));
        }
        let version = u16::from_le_bytes([b[cm_field::VERSION], b[cm_field::VERSION + 1]]);
        if version != CM_VERSION {
            return Err(LayoutError::BadVersion(version.into()));
        }
        let kind = match b[cm_field::KIND] {
            1 => CmKind::Req,
            2 => CmKind::Rep,
            3 => CmKind::Rej,
            v => {
                return Err(LayoutError::BadField {
                    field: "kind",
                    value: v.into(),
                })
            }
        };
        let qp_type = b[cm_field::QP_TYPE];
        if !(2..=4).contains(&qp_type) {
            return Err(LayoutError::BadField {
                field: "qp_type",
                value: qp_type.into(),
            });
        }
        let priv_len = rd_u32(b, cm_field::PRIV_LEN) as usize;
        if priv_len > CM_PRIVATE_MAX {
            return Err(LayoutError::BadField {
                field: "private_len",
                value: priv_len as u64,
            });
        }
        Ok(Self {
            kind,
            qp_type,
            node: rd_u32(b, cm_field::NODE),
            qpn: rd_u32(b, cm_field::QPN),
            psn: rd_u32(b, cm_field::PSN),
            rkey: rd_u32(b, cm_field::RKEY),
            addr: rd_u64(b, cm_field::ADDR),
            len: rd_u64(b, cm_field::LEN),
            qkey: rd_u32(b, cm_field::QKEY),
            private_data: b[cm_field::PRIV..cm_field::PRIV + priv_len].to_vec(),
        })
    }

    /// Writes the message. Private data beyond [`CM_PRIVATE_MAX`] bytes is cut.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut CmMsg<T>) {
        let b = p.buffer.as_mut();
        wr_u32(b, cm_field::MAGIC, CM_MAGIC);
        b[cm_field::VERSION..cm_field::VERSION + 2].copy_from_slice(&CM_VERSION.to_le_bytes());
        b[cm_field::KIND] = self.kind as u8;
        b[cm_field::QP_TYPE] = self.qp_type;
        wr_u32(b, cm_field::NODE, self.node);
        wr_u32(b, cm_field::QPN, self.qpn);
        wr_u32(b, cm_field::PSN, self.psn);
        wr_u32(b, cm_field::RKEY, self.rkey);
        wr_u64(b, cm_field::ADDR, self.addr);
        wr_u64(b, cm_field::LEN, self.len);
        wr_u32(b, cm_field::QKEY, self.qkey);
        let n = self.private_data.len().min(CM_PRIVATE_MAX);
        wr_u32(b, cm_field::PRIV_LEN, n as u32);
        let area = &mut b[cm_field::PRIV..cm_field::PRIV + CM_PRIVATE_MAX];
        area.fill(0);
        area[..n].copy_from_slice(&self.private_data[..n]);
    }
}

const _: () = {
    assert!(MR_STATE_OFF / CACHE_LINE != MR_INIT_OFF / CACHE_LINE);
    assert!(MR_DATA_OFF as usize >= MR_STATE_OFF + 4);
    assert!(QP_ACK_OFF / CACHE_LINE != QP_INIT_OFF / CACHE_LINE);
    assert!(QP_PEER_RNR_OFF + 4 <= 128);
    assert!(QP_TAIL_OFF / CACHE_LINE != QP_ACK_OFF / CACHE_LINE);
    assert!(QP_ACCESS_OFF / CACHE_LINE != QP_ACK_OFF / CACHE_LINE);
    assert!(QP_RING_OFF.is_multiple_of(CACHE_LINE as u64));
    assert!(EV_BELL_OFF / CACHE_LINE != EV_ARMED_OFF / CACHE_LINE);
    assert!(QP_MIN_RING as usize >= 2 * (crate::wire::MAX_DGRAM + CACHE_LINE));
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mr_header_round_trips_and_rejects_bad_length_or_marker() {
        let mut b = [0u8; 64];
        let repr = MrRepr {
            len: 8192,
            skew: 0,
            iova: 0,
        };
        repr.emit(&mut MrHeader::new_unchecked(&mut b[..]));
        let p = MrHeader::new_unchecked(&b[..]);
        assert_eq!(MrRepr::parse(&p, 4096 + 8192).unwrap(), repr);
        assert!(
            MrRepr::parse(&p, 4096 + 8191).is_err(),
            "longer than mapped"
        );
        let mut bad = b;
        bad[MR_INIT_OFF] = 0;
        assert_eq!(
            MrRepr::parse(&MrHeader::new_unchecked(&bad[..]), 1 << 20),
            Err(LayoutError::NotInitialized)
        );
        let mut bad = b;
        bad[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(MrRepr::parse(&MrHeader::new_unchecked(&bad[..]), u64::MAX).is_err());
        assert!(MrHeader::new_checked(&b[..63]).is_err());
    }

    #[test]
    fn mr_header_skew_keeps_the_data_inside_the_mapping_and_iova_cannot_wrap() {
        let mut b = [0u8; 64];
        let repr = MrRepr {
            len: 100,
            skew: 4000,
            iova: 0x7f00_0000_0fa0,
        };
        repr.emit(&mut MrHeader::new_unchecked(&mut b[..]));
        let p = MrHeader::new_unchecked(&b[..]);
        assert_eq!(MrRepr::parse(&p, 4096 + 4000 + 100).unwrap(), repr);
        assert!(
            MrRepr::parse(&p, 4096 + 4000 + 99).is_err(),
            "skew + len past the end"
        );
        let mut bad = b;
        bad[28..32].copy_from_slice(&4096u32.to_le_bytes());
        assert!(MrRepr::parse(&MrHeader::new_unchecked(&bad[..]), 1 << 20).is_err());
        let mut bad = b;
        bad[32..40].copy_from_slice(&(u64::MAX - 50).to_le_bytes());
        assert!(MrRepr::parse(&MrHeader::new_unchecked(&bad[..]), 1 << 20).is_err());
    }

    #[test]
    fn qp_block_header_round_trips_and_rejects_bad_type_ring_and_event_offset() {
        let repr = QpBlockRepr {
            qp_type: 2,
            qpn: 0x80_0001,
            slot: 2,
            generation: 1,
            ring_len: 1 << 20,
            event_off: 8192,
        };
        let with = |f: &dyn Fn(&mut QpBlockRepr)| {
            let mut r = repr;
            f(&mut r);
            let mut b = [0u8; 64];
            r.emit(&mut QpBlockHeader::new_unchecked(&mut b[..]));
            QpBlockRepr::parse(&QpBlockHeader::new_unchecked(&b[..]))
        };
        assert_eq!(with(&|_| {}).unwrap(), repr);
        assert!(with(&|r| r.qp_type = 4).is_err());
        assert!(with(&|r| r.ring_len = 3 << 18).is_err());
        assert!(with(&|r| r.ring_len = 4096).is_err());
        assert!(with(&|r| r.event_off = 8193).is_err());
        let mut b = [0u8; 64];
        repr.emit(&mut QpBlockHeader::new_unchecked(&mut b[..]));
        b[0] ^= 1;
        assert!(QpBlockRepr::parse(&QpBlockHeader::new_unchecked(&b[..])).is_err());
    }

    #[test]
    fn message_header_round_trips_and_rejects_inconsistent_fragments() {
        let repr = MsgRepr {
            op: MsgOp::SendImm,
            flags: MSG_FIRST | MSG_LAST,
            imm: 7,
            msg_len: 100,
            frag_off: 0,
            ack: 640,
            credits: 12,
        };
        let emit = |r: MsgRepr| {
            let mut b = [0u8; 32];
            r.emit(&mut MsgHeader::new_unchecked(&mut b[..]));
            b
        };
        let b = emit(repr);
        assert_eq!(
            MsgRepr::parse(&MsgHeader::new_unchecked(&b[..]), 100).unwrap(),
            repr
        );
        // Fragment longer than the message, or flags that disagree with the offsets.
        assert!(MsgRepr::parse(&MsgHeader::new_unchecked(&b[..]), 101).is_err());
        assert!(MsgRepr::parse(&MsgHeader::new_unchecked(&b[..]), 99).is_err());
        let mid = emit(MsgRepr {
            flags: 0,
            frag_off: 40,
            ..repr
        });
        assert!(MsgRepr::parse(&MsgHeader::new_unchecked(&mid[..]), 20).is_ok());
        let lying = emit(MsgRepr {
            flags: MSG_FIRST,
            frag_off: 40,
            ..repr
        });
        assert!(MsgRepr::parse(&MsgHeader::new_unchecked(&lying[..]), 20).is_err());
        let wimm = emit(MsgRepr {
            op: MsgOp::WriteImm,
            ..repr
        });
        assert!(MsgRepr::parse(&MsgHeader::new_unchecked(&wimm[..]), 0).is_ok());
        assert!(MsgRepr::parse(&MsgHeader::new_unchecked(&wimm[..]), 8).is_err());
        let mut bad = b;
        bad[0] = 9;
        assert!(MsgRepr::parse(&MsgHeader::new_unchecked(&bad[..]), 100).is_err());
        let mut bad = b;
        bad[1] = 0x80;
        assert!(MsgRepr::parse(&MsgHeader::new_unchecked(&bad[..]), 100).is_err());
    }

    #[test]
    fn ud_header_round_trips_and_rejects_bad_magic_and_opcode() {
        let repr = UdRepr {
            op: MsgOp::Send,
            flags: 0,
            imm: 0,
            qkey: 0x1111_1111,
            src_qpn: 49152,
        };
        let mut b = [0u8; 16];
        repr.emit(&mut UdHeader::new_unchecked(&mut b[..]));
        assert_eq!(
            UdRepr::parse(&UdHeader::new_unchecked(&b[..])).unwrap(),
            repr
        );
        let mut bad = b;
        bad[0] = 0;
        assert!(UdRepr::parse(&UdHeader::new_unchecked(&bad[..])).is_err());
        let mut bad = b;
        bad[2] = 3; // WriteImm has no UD form
        assert!(UdRepr::parse(&UdHeader::new_unchecked(&bad[..])).is_err());
    }

    #[test]
    fn cm_message_round_trips_and_rejects_oversized_private_data() {
        let repr = CmRepr {
            kind: CmKind::Req,
            qp_type: 2,
            node: 1,
            qpn: 0x80_0002,
            psn: 42,
            rkey: 0xdead_beef,
            addr: 64,
            len: 1 << 20,
            qkey: 0,
            private_data: b"hello".to_vec(),
        };
        let mut b = [0u8; CmMsg::<&[u8]>::LEN];
        repr.emit(&mut CmMsg::new_unchecked(&mut b[..]));
        assert_eq!(CmRepr::parse(&CmMsg::new_unchecked(&b[..])).unwrap(), repr);
        let mut bad = b;
        bad[44..48].copy_from_slice(&57u32.to_le_bytes());
        assert!(CmRepr::parse(&CmMsg::new_unchecked(&bad[..])).is_err());
        let mut bad = b;
        bad[7] = 9;
        assert!(CmRepr::parse(&CmMsg::new_unchecked(&bad[..])).is_err());
        assert!(CmMsg::new_checked(&b[..10]).is_err());
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// Whatever a peer writes into a QP's ring or block, parsing never panics, and what
        /// it accepts keeps its promises: a fragment inside its message, the first and last
        /// flags where they belong, a WRITE_WITH_IMM that carries no payload.
        #[test]
        fn garbage_in_a_qp_ring_never_panics_and_what_parses_is_consistent(
            bytes in proptest::collection::vec(any::<u8>(), 0..160),
            frag_len in 0usize..(1 << 17),
        ) {
            if let Ok(m) = MsgRepr::parse(&MsgHeader::new_unchecked(&bytes[..]), frag_len) {
                prop_assert!(m.msg_len <= MAX_MSG);
                let end = u64::from(m.frag_off) + frag_len as u64;
                if m.op == MsgOp::WriteImm {
                    prop_assert_eq!((frag_len, m.frag_off), (0, 0));
                } else {
                    prop_assert!(end <= u64::from(m.msg_len));
                    prop_assert_eq!(m.flags & MSG_FIRST != 0, m.frag_off == 0);
                    prop_assert_eq!(m.flags & MSG_LAST != 0, end == u64::from(m.msg_len));
                }
            }
            let _ = UdRepr::parse(&UdHeader::new_unchecked(&bytes[..]));
            let _ = CmRepr::parse(&CmMsg::new_unchecked(&bytes[..]));
            let _ = QpBlockRepr::parse(&QpBlockHeader::new_unchecked(&bytes[..]));
            let _ = MrRepr::parse(&MrHeader::new_unchecked(&bytes[..]), frag_len as u64);
        }

        /// Every well-formed fragment header a sender can emit parses back to itself.
        #[test]
        fn every_fragment_header_a_sender_emits_parses_back(
            msg_len in 0u32..=(1 << 20),
            cut in any::<(u32, u32)>(),
            imm in any::<u32>(),
            ack in any::<u64>(),
            credits in any::<u64>(),
            solicited in any::<bool>(),
            op in 0u8..2,
        ) {
            let frag_off = if msg_len == 0 { 0 } else { cut.0 % msg_len };
            let frag_len = (msg_len - frag_off).min(cut.1 % (64 << 10) + 1);
            let end = frag_off + frag_len;
            let mut flags = if solicited { MSG_SOLICITED } else { 0 };
            if frag_off == 0 { flags |= MSG_FIRST; }
            if end == msg_len { flags |= MSG_LAST; }
            let m = MsgRepr {
                op: if op == 0 { MsgOp::Send } else { MsgOp::SendImm },
                flags,
                imm,
                msg_len,
                frag_off,
                ack,
                credits,
            };
            let mut b = [0u8; 64];
            m.emit(&mut MsgHeader::new_unchecked(&mut b[..]));
            prop_assert_eq!(MsgRepr::parse(&MsgHeader::new_unchecked(&b[..]), frag_len as usize), Ok(m));
        }
    }
}
