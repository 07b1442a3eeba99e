/*
 * backplane C API: RDMA verbs over a fabric, named and numbered after libibverbs so that
 * `s/ibv_/bp_/; s/IBV_/BP_/` ports most code. The differences that remain are listed here and,
 * function by function, in the README's "C API" section.
 *
 * Link with: cc prog.c $(pkg-config --cflags --libs backplane)
 *
 * Return conventions (those of libibverbs):
 *   - create/alloc/reg/open functions return NULL on error and set errno;
 *   - other int functions return 0 on success or the errno value on failure (and set errno),
 *     except bp_close_device and bp_get_cq_event, which return -1 and set errno;
 *   - bp_poll_cq returns the number of completions, or -1 with errno set;
 *   - bp_last_error() (dgram.h) gives this thread's last error as one line.
 *   A NULL, destroyed or made-up handle is EBADF, never a crash: every handle is looked up in
 *   a registry of live objects before it is touched. Nothing aborts: Rust panics stop at the
 *   boundary (EIO).
 *
 * errno values:
 *   EBADF      NULL, destroyed or unknown handle
 *   EPERM      the object belongs to another thread (see "Threads")
 *   EINVAL     bad argument, attribute mask or QP state transition
 *   ENOMEM     a queue is full (too many outstanding work requests), or no memory
 *   EBUSY      destroying an object others still use (a PD with MRs/QPs/AHs, a CQ with QPs or
 *              unacknowledged events, a channel with CQs, a context with any object)
 *   EOVERFLOW  the CQ overran (see bp_poll_cq)
 *   ETIMEDOUT  bp_accept / bp_connect ran out of time
 *   ECONNREFUSED the connection helper's peer refused, or nobody listened
 *   ENETDOWN, ENOENT, EIO  the fabric: node not READY, fabric not running, supervisor gone
 *
 * Threads: every verbs object belongs to the thread that opened its context (bp_open_device),
 * because the engine behind a context takes no lock on the data path. A call from another
 * thread fails with EPERM and changes nothing. Open one context per thread (several threads
 * may open contexts on the same node). A completion channel's fd may be watched by any thread
 * (poll/epoll), but bp_get_cq_event runs on the owner thread. Objects still alive when their
 * thread exits are destroyed with it.
 *
 * Memory: registered memory is memory the library allocates, because peers map it: call
 * bp_reg_mr(pd, NULL, length, access) and use mr->addr (zero-filled, page-aligned).
 * Addresses in work requests:
 *   - bp_sge.addr is an offset into the region named by lkey (zero-based, as with
 *     IBV_ACCESS_ZERO_BASED); a pointer inside [mr->addr, mr->addr + mr->length] is accepted
 *     too and turned into that offset, so `sge.addr = (uintptr_t)mr->addr + off` still works;
 *   - with BP_SEND_INLINE the sg_list addresses are pointers to any memory (copied at post);
 *   - remote_addr (RDMA and atomics) is always an offset in the peer's region: exchange
 *     offsets (usually 0), not the peer's mr->addr.
 * imm_data is in network byte order in both bp_send_wr and bp_wc, as in libibverbs.
 *
 * Progress happens in your calls: bp_poll_cq, bp_post_send, bp_post_recv and bp_req_notify_cq
 * move work along (there is no adapter working in the background); a completion channel's
 * helper thread only wakes you.
 */
#ifndef BACKPLANE_VERBS_H
#define BACKPLANE_VERBS_H

#include <stddef.h>
#include <stdint.h>

#include <backplane/dgram.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- enums (values as libibverbs) ---------------------------------------------------- */

enum bp_access_flags {
	BP_ACCESS_LOCAL_WRITE = 1,
	BP_ACCESS_REMOTE_WRITE = 1 << 1,
	BP_ACCESS_REMOTE_READ = 1 << 2,
	BP_ACCESS_REMOTE_ATOMIC = 1 << 3,
	/* Accepted and implied: remote addresses are always offsets. */
	BP_ACCESS_ZERO_BASED = 1 << 5,
};

enum bp_qp_type { BP_QPT_RC = 2, BP_QPT_UC = 3, BP_QPT_UD = 4 };

enum bp_qp_state {
	BP_QPS_RESET,
	BP_QPS_INIT,
	BP_QPS_RTR,
	BP_QPS_RTS,
	BP_QPS_SQD, /* not supported as a target state */
	BP_QPS_SQE, /* not used: errors take the whole QP to ERR */
	BP_QPS_ERR,
};

enum bp_mtu {
	BP_MTU_256 = 1,
	BP_MTU_512 = 2,
	BP_MTU_1024 = 3,
	BP_MTU_2048 = 4,
	BP_MTU_4096 = 5,
};

enum bp_port_state { BP_PORT_DOWN = 1, BP_PORT_ACTIVE = 4 };

enum bp_atomic_cap { BP_ATOMIC_NONE, BP_ATOMIC_HCA, BP_ATOMIC_GLOB };

enum bp_wr_opcode {
	BP_WR_RDMA_WRITE,
	BP_WR_RDMA_WRITE_WITH_IMM,
	BP_WR_SEND,
	BP_WR_SEND_WITH_IMM,
	BP_WR_RDMA_READ,
	BP_WR_ATOMIC_CMP_AND_SWP,
	BP_WR_ATOMIC_FETCH_AND_ADD,
};

enum bp_send_flags {
	BP_SEND_FENCE = 1,
	BP_SEND_SIGNALED = 1 << 1,
	BP_SEND_SOLICITED = 1 << 2,
	BP_SEND_INLINE = 1 << 3,
};

enum bp_wc_status {
	BP_WC_SUCCESS,
	BP_WC_LOC_LEN_ERR,
	BP_WC_LOC_QP_OP_ERR,
	BP_WC_LOC_EEC_OP_ERR,
	BP_WC_LOC_PROT_ERR,
	BP_WC_WR_FLUSH_ERR,
	BP_WC_MW_BIND_ERR,
	BP_WC_BAD_RESP_ERR,
	BP_WC_LOC_ACCESS_ERR,
	BP_WC_REM_INV_REQ_ERR,
	BP_WC_REM_ACCESS_ERR,
	BP_WC_REM_OP_ERR,
	BP_WC_RETRY_EXC_ERR,
	BP_WC_RNR_RETRY_EXC_ERR,
	BP_WC_LOC_RDD_VIOL_ERR,
	BP_WC_REM_INV_RD_REQ_ERR,
	BP_WC_REM_ABORT_ERR,
	BP_WC_INV_EECN_ERR,
	BP_WC_INV_EEC_STATE_ERR,
	BP_WC_FATAL_ERR,
	BP_WC_RESP_TIMEOUT_ERR,
	BP_WC_GENERAL_ERR,
};

enum bp_wc_opcode {
	BP_WC_SEND,
	BP_WC_RDMA_WRITE,
	BP_WC_RDMA_READ,
	BP_WC_COMP_SWAP,
	BP_WC_FETCH_ADD,
	BP_WC_RECV = 1 << 7,
	BP_WC_RECV_RDMA_WITH_IMM,
};

enum bp_wc_flags { BP_WC_GRH = 1, BP_WC_WITH_IMM = 1 << 1 };

enum bp_qp_attr_mask {
	BP_QP_STATE = 1 << 0,
	BP_QP_CUR_STATE = 1 << 1,
	BP_QP_EN_SQD_ASYNC_NOTIFY = 1 << 2,
	BP_QP_ACCESS_FLAGS = 1 << 3,
	BP_QP_PKEY_INDEX = 1 << 4,
	BP_QP_PORT = 1 << 5,
	BP_QP_QKEY = 1 << 6,
	BP_QP_AV = 1 << 7,
	BP_QP_PATH_MTU = 1 << 8,
	BP_QP_TIMEOUT = 1 << 9,
	BP_QP_RETRY_CNT = 1 << 10,
	BP_QP_RNR_RETRY = 1 << 11,
	BP_QP_RQ_PSN = 1 << 12,
	BP_QP_MAX_QP_RD_ATOMIC = 1 << 13,
	BP_QP_ALT_PATH = 1 << 14,
	BP_QP_MIN_RNR_TIMER = 1 << 15,
	BP_QP_SQ_PSN = 1 << 16,
	BP_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
	BP_QP_PATH_MIG_STATE = 1 << 18,
	BP_QP_CAP = 1 << 19,
	BP_QP_DEST_QPN = 1 << 20,
};

/* ---- objects (the fields shown are read-only for the application, except *_context) -- */

struct bp_context {
	struct bp_fabric *fabric;
	uint32_t node; /* the node's slot, which is also its LID */
};

struct bp_pd {
	struct bp_context *context;
	uint32_t handle;
};

struct bp_mr {
	struct bp_context *context;
	struct bp_pd *pd;
	void *addr;    /* the region's bytes: fill and read them here */
	size_t length;
	uint32_t handle;
	uint32_t lkey;
	uint32_t rkey;
};

struct bp_comp_channel {
	struct bp_context *context;
	int fd; /* readable when an event is queued: poll/epoll/select it */
	int refcnt;
};

struct bp_cq {
	struct bp_context *context;
	struct bp_comp_channel *channel;
	void *cq_context;
	uint32_t handle;
	int cqe;
};

/* A shared receive queue: receives every QP made with it takes in turn. */
struct bp_srq {
	struct bp_context *context;
	void *srq_context;
	struct bp_pd *pd;
	uint32_t handle;
};

struct bp_qp {
	struct bp_context *context;
	void *qp_context;
	struct bp_pd *pd;
	struct bp_cq *send_cq;
	struct bp_cq *recv_cq;
	struct bp_srq *srq; /* or NULL */
	uint32_t handle;
	uint32_t qp_num;
	enum bp_qp_state state; /* as of the last bp_modify_qp; bp_query_qp has the live state */
	enum bp_qp_type qp_type;
};

struct bp_ah {
	struct bp_context *context;
	struct bp_pd *pd;
	uint32_t handle;
};

/* ---- attributes ------------------------------------------------------------------------ */

struct bp_device_attr {
	char fw_ver[64];
	uint64_t node_guid;
	uint64_t max_mr_size;
	uint64_t page_size_cap;
	int max_qp_wr;
	int max_sge;
	int max_cqe;
	int max_qp_rd_atom;
	enum bp_atomic_cap atomic_cap;
	uint8_t phys_port_cnt;
};

struct bp_port_attr {
	enum bp_port_state state;
	enum bp_mtu max_mtu;
	enum bp_mtu active_mtu;
	uint32_t max_msg_sz;
	uint16_t lid; /* the node's slot */
};

struct bp_qp_cap {
	uint32_t max_send_wr;
	uint32_t max_recv_wr;
	uint32_t max_send_sge;
	uint32_t max_recv_sge;
	uint32_t max_inline_data;
};

/* No GRH: one fabric is one subnet. */
struct bp_ah_attr {
	uint16_t dlid; /* destination node's slot */
	uint8_t sl;
	uint8_t src_path_bits;
	uint8_t static_rate;
	uint8_t is_global;
	uint8_t port_num; /* 1 */
};

struct bp_qp_init_attr {
	void *qp_context;
	struct bp_cq *send_cq;
	struct bp_cq *recv_cq;
	struct bp_srq *srq; /* take receives from this SRQ (max_recv_wr/sge then ignored), or NULL */
	struct bp_qp_cap cap; /* WR and SGE counts of 0 take the defaults (128, 4) */
	enum bp_qp_type qp_type;
	int sq_sig_all;
	/* Extension: bytes of an RC/UC QP's inbound ring (power of two, 256 KiB..64 MiB;
	 * 0 = 512 KiB). Larger rings keep more SEND data in flight. Not in libibverbs: zero the
	 * whole struct (= {0} or memset) when porting. */
	uint32_t ring_bytes;
};

struct bp_srq_attr {
	uint32_t max_wr;    /* 1..65536 */
	uint32_t max_sge;   /* 1..32 */
	uint32_t srq_limit; /* must be 0: the limit event is not offered */
};

struct bp_srq_init_attr {
	void *srq_context;
	struct bp_srq_attr attr;
};

struct bp_qp_attr {
	enum bp_qp_state qp_state;
	enum bp_qp_state cur_qp_state;
	enum bp_mtu path_mtu;
	uint32_t qkey;
	uint32_t rq_psn;
	uint32_t sq_psn;
	uint32_t dest_qp_num;
	unsigned int qp_access_flags;
	struct bp_qp_cap cap;
	struct bp_ah_attr ah_attr;
	uint16_t pkey_index;
	uint8_t en_sqd_async_notify;
	uint8_t max_rd_atomic;
	uint8_t max_dest_rd_atomic;
	uint8_t min_rnr_timer;
	uint8_t port_num;
	uint8_t timeout;
	uint8_t retry_cnt;
	uint8_t rnr_retry;
};

/* ---- work requests and completions ------------------------------------------------------ */

struct bp_sge {
	uint64_t addr; /* offset in the region (or a pointer into mr->addr; see above) */
	uint32_t length;
	uint32_t lkey;
};

struct bp_send_wr {
	uint64_t wr_id;
	struct bp_send_wr *next;
	struct bp_sge *sg_list;
	int num_sge;
	enum bp_wr_opcode opcode;
	unsigned int send_flags;
	uint32_t imm_data; /* network byte order */
	union {
		struct {
			uint64_t remote_addr; /* offset in the peer's region */
			uint32_t rkey;
		} rdma;
		struct {
			uint64_t remote_addr; /* offset, 8-aligned */
			uint64_t compare_add;
			uint64_t swap;
			uint32_t rkey;
		} atomic;
		struct {
			struct bp_ah *ah;
			uint32_t remote_qpn;
			uint32_t remote_qkey;
		} ud;
	} wr;
};

struct bp_recv_wr {
	uint64_t wr_id;
	struct bp_recv_wr *next;
	struct bp_sge *sg_list;
	int num_sge;
};

struct bp_wc {
	uint64_t wr_id;
	enum bp_wc_status status;
	enum bp_wc_opcode opcode;
	uint32_t vendor_err;
	uint32_t byte_len;
	uint32_t imm_data; /* network byte order, valid with BP_WC_WITH_IMM */
	uint32_t qp_num;
	uint32_t src_qp;
	unsigned int wc_flags;
	uint16_t pkey_index;
	uint16_t slid; /* the sending node's slot */
	uint8_t sl;
	uint8_t dlid_path_bits;
};

/* ---- device, PD, MR --------------------------------------------------------------------- */

/* Opens the verbs device of `node` (ibv_get_device_list + ibv_open_device). */
struct bp_context *bp_open_device(struct bp_fabric *fabric, uint32_t node);
/* 0, or -1 with errno (EBUSY while any object of the context is alive). */
int bp_close_device(struct bp_context *context);
int bp_query_device(struct bp_context *context, struct bp_device_attr *device_attr);
int bp_query_port(struct bp_context *context, uint8_t port_num, struct bp_port_attr *port_attr);

struct bp_pd *bp_alloc_pd(struct bp_context *context);
int bp_dealloc_pd(struct bp_pd *pd);

/* Allocates `length` bytes of shareable memory and registers them: `addr` must be NULL
 * (EINVAL otherwise); the memory is mr->addr. */
struct bp_mr *bp_reg_mr(struct bp_pd *pd, void *addr, size_t length, int access);
int bp_dereg_mr(struct bp_mr *mr);

/* ---- completion channels and CQs -------------------------------------------------------- */

struct bp_comp_channel *bp_create_comp_channel(struct bp_context *context);
int bp_destroy_comp_channel(struct bp_comp_channel *channel);
/* Waits for the next event (blocks; poll channel->fd first to wait with a timeout).
 * 0, or -1 with errno. Acknowledge every event with bp_ack_cq_events. */
int bp_get_cq_event(struct bp_comp_channel *channel, struct bp_cq **cq, void **cq_context);
void bp_ack_cq_events(struct bp_cq *cq, unsigned int nevents);

/* comp_vector must be 0. */
struct bp_cq *bp_create_cq(struct bp_context *context, int cqe, void *cq_context,
			   struct bp_comp_channel *channel, int comp_vector);
int bp_destroy_cq(struct bp_cq *cq);
/* solicited_only is treated as "any completion" (events may be spurious, as allowed). */
int bp_req_notify_cq(struct bp_cq *cq, int solicited_only);
/*
 * Takes up to num_entries completions; moves the CQ's QPs along first when it holds none.
 * Returns the count, or -1 with errno. A CQ that received more completions than `cqe` while
 * full has overrun: from the next call on bp_poll_cq fails with EOVERFLOW (the CQ is in error,
 * as after IBV_EVENT_CQ_ERR; destroy it). Only send completions can overrun a CQ: while it is
 * full, inbound messages wait in the QP's ring instead of completing receives.
 */
int bp_poll_cq(struct bp_cq *cq, int num_entries, struct bp_wc *wc);

/* ---- queue pairs and address handles ---------------------------------------------------- */

/* Created in RESET; attr->cap receives the actual capabilities. */
struct bp_qp *bp_create_qp(struct bp_pd *pd, struct bp_qp_init_attr *qp_init_attr);
int bp_destroy_qp(struct bp_qp *qp);
/* EINVAL for a transition the state machine does not have or a mask missing what it needs.
 * Only the fields attr_mask names are read. */
int bp_modify_qp(struct bp_qp *qp, struct bp_qp_attr *attr, int attr_mask);
/* Fills every attribute whatever attr_mask says; init_attr may be NULL. */
int bp_query_qp(struct bp_qp *qp, struct bp_qp_attr *attr, int attr_mask,
		struct bp_qp_init_attr *init_attr);
/* Posts a NULL-terminated list; on failure *bad_wr is the first refused request (those before
 * it were posted). Problems with keys, remote access or the peer end as completions. */
int bp_post_send(struct bp_qp *qp, struct bp_send_wr *wr, struct bp_send_wr **bad_wr);
int bp_post_recv(struct bp_qp *qp, struct bp_recv_wr *wr, struct bp_recv_wr **bad_wr);

/* Shared receive queues. bp_post_recv on a QP made with one is EINVAL. An RC message that
 * finds the SRQ empty waits in its QP, in order and unacknowledged, until a receive is posted
 * (an RNR retried without limit); a UC or UD message is dropped. Receive buffers are checked
 * against the SRQ's PD. bp_destroy_srq is EBUSY while a QP made with it exists. */
struct bp_srq *bp_create_srq(struct bp_pd *pd, struct bp_srq_init_attr *srq_init_attr);
int bp_destroy_srq(struct bp_srq *srq);
int bp_query_srq(struct bp_srq *srq, struct bp_srq_attr *srq_attr);
int bp_post_srq_recv(struct bp_srq *srq, struct bp_recv_wr *wr, struct bp_recv_wr **bad_wr);

struct bp_ah *bp_create_ah(struct bp_pd *pd, struct bp_ah_attr *attr);
int bp_destroy_ah(struct bp_ah *ah);

/* "local length error", ... as ibv_wc_status_str. */
const char *bp_wc_status_str(enum bp_wc_status status);

/* ---- connection helper (the role of rdma_cm) ---------------------------------------------
 * Two processes exchange QP number, PSN, an rkey + offset + length and private data over a
 * datagram port, and each side's QP goes RESET -> INIT -> RTR -> RTS (all remote accesses
 * allowed, MTU 4096, rnr_retry 7 = forever). */

#define BP_CM_DEFAULT_PORT 4791

struct bp_conn_param {
	uint32_t rkey; /* a region the peer may use (0: none) */
	uint32_t psn;
	uint64_t addr; /* offset in that region */
	uint64_t len;
	uint32_t qkey; /* UD (0: the default) */
	uint8_t private_data_len; /* at most 56 */
	const void *private_data;
};

struct bp_peer_info {
	uint32_t node;
	uint32_t qpn;
	uint32_t psn;
	uint32_t rkey;
	uint64_t addr;
	uint64_t len;
	uint32_t qkey;
	uint8_t private_data_len;
	uint8_t private_data[56];
};

struct bp_listener {
	struct bp_context *context;
	uint32_t node;
	uint32_t port;
};

/* Listens on `port` of the context's node (rdma_listen). */
struct bp_listener *bp_listen(struct bp_context *context, uint32_t port);
int bp_destroy_listener(struct bp_listener *listener);
/* Waits up to timeout_ms (-1: forever) for a request, readies `qp` towards the requester and
 * answers with `mine` (may be NULL); `peer` (may be NULL) gets what the requester offered. */
int bp_accept(struct bp_listener *listener, struct bp_qp *qp, const struct bp_conn_param *mine,
	      struct bp_peer_info *peer, int timeout_ms);
/* Connects `qp` to the listener at (node, port), retrying while nobody listens yet, for up to
 * timeout_ms (-1: forever). */
int bp_connect(struct bp_context *context, uint32_t node, uint32_t port, struct bp_qp *qp,
	       const struct bp_conn_param *mine, struct bp_peer_info *peer, int timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* BACKPLANE_VERBS_H */
