/* The extended API as rdma-core documents it, in one process.
 * The post API (ibv_create_qp_ex with send_ops_flags, ibv_qp_to_qp_ex, ibv_wr_*; see
 * ibv_wr_post(3)): a pair of RC QPs connected to each other (this node to itself) made with
 * every operation the fabric offers, and a pair of UD QPs. Each builder and setter moves the
 * right bytes; a batch of several requests completes in order; the errors are the documented
 * ones (ibv_wr_complete answers what a builder or setter met and posts nothing; the QPs that
 * cannot be made are refused with EOPNOTSUPP).
 * The poll API (ibv_create_cq_ex, ibv_start_poll/next_poll/end_poll, ibv_wc_read_*; see
 * ibv_create_cq_ex(3)) with completion timestamps (ibv_query_device_ex's clock).
 * Exit 0 and one line when everything held; otherwise the first failure on stderr. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "connect_rc.h"
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#define SIZE 256
#define FAIL(...) do { fprintf(stderr, "ibv_extended: " __VA_ARGS__); fputc('\n', stderr); exit(1); } while (0)

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static uint16_t lid;

static int ready_ud(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = 0x11111111 };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
		return -1;
	a.qp_state = IBV_QPS_RTR;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE))
		return -1;
	a.qp_state = IBV_QPS_RTS;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN);
}

static struct ibv_qp *make_qp(enum ibv_qp_type t, uint64_t ops)
{
	struct ibv_qp_init_attr_ex ia = { .send_cq = cq, .recv_cq = cq, .qp_type = t,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2, .max_recv_sge = 1,
			 .max_inline_data = 64 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = pd, .send_ops_flags = ops };
	return ibv_create_qp_ex(ctx, &ia);
}

/* One completion: its opcode and wr_id checked; the completion returned. */
static struct ibv_wc one(enum ibv_wc_opcode op, uint64_t id, const char *what)
{
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	if (n < 0 || wc.status != IBV_WC_SUCCESS || wc.opcode != op || wc.wr_id != id)
		FAIL("%s: completion n=%d status=%s opcode=%d wr_id=%llu (want %d, %llu)", what, n,
		     n > 0 ? ibv_wc_status_str(wc.status) : "-", n > 0 ? (int)wc.opcode : -1,
		     n > 0 ? (unsigned long long)wc.wr_id : 0ULL, op, (unsigned long long)id);
	return wc;
}

static void none_left(const char *what)
{
	struct ibv_wc wc;
	for (int i = 0; i < 1000; i++)
		if (ibv_poll_cq(cq, 1, &wc) != 0)
			FAIL("%s: a completion (wr_id %llu) where none was due", what,
			     (unsigned long long)wc.wr_id);
}

static void check(const unsigned char *p, unsigned char v, int n, const char *what)
{
	for (int k = 0; k < n; k++)
		if (p[k] != v)
			FAIL("%s: byte %d is %u, not %u", what, k, p[k], v);
}

/* Reads the current completion of an extended CQ field by field: the SEND (wr_id 301) of
 * QP `from` or the receive (wr_id 300) on QP `to` of its 100 bytes with immediate 77; each
 * counted, the timestamps never going back. */
static void read_ex(struct ibv_cq_ex *cqx, uint32_t from, uint32_t to, int *sends, int *recvs,
		    uint64_t *last_ts)
{
	if (cqx->status != IBV_WC_SUCCESS)
		FAIL("extended CQ: status %s", ibv_wc_status_str(cqx->status));
	uint64_t ts = ibv_wc_read_completion_ts(cqx);
	if (ts < *last_ts || !ibv_wc_read_completion_wallclock_ns(cqx))
		FAIL("extended CQ: timestamp %llu after %llu", (unsigned long long)ts,
		     (unsigned long long)*last_ts);
	*last_ts = ts;
	if (cqx->wr_id == 301) {
		if (ibv_wc_read_opcode(cqx) != IBV_WC_SEND || ibv_wc_read_qp_num(cqx) != from)
			FAIL("extended CQ: the SEND's completion reads wrong");
		++*sends;
	} else if (cqx->wr_id == 300) {
		if (ibv_wc_read_opcode(cqx) != IBV_WC_RECV || ibv_wc_read_byte_len(cqx) != 100 ||
		    !(ibv_wc_read_wc_flags(cqx) & IBV_WC_WITH_IMM) ||
		    ntohl(ibv_wc_read_imm_data(cqx)) != 77 || ibv_wc_read_qp_num(cqx) != to ||
		    ibv_wc_read_src_qp(cqx) != from || ibv_wc_read_slid(cqx) != lid)
			FAIL("extended CQ: the receive's completion reads wrong (len %u imm %u)",
			     ibv_wc_read_byte_len(cqx), ntohl(ibv_wc_read_imm_data(cqx)));
		++*recvs;
	} else
		FAIL("extended CQ: wr_id %llu", (unsigned long long)cqx->wr_id);
}

/* This process's threads. */
static int threads(void)
{
	int n = 0;
	DIR *d = opendir("/proc/self/task");
	struct dirent *e;
	while (d && (e = readdir(d)))
		n += e->d_name[0] != '.';
	if (d)
		closedir(d);
	return n;
}

int main(void)
{
	struct ibv_device **dl = ibv_get_device_list(NULL);
	if (!dl || !dl[0])
		FAIL("no device");
	ctx = ibv_open_device(dl[0]);
	pd = ctx ? ibv_alloc_pd(ctx) : NULL;
	cq = ctx ? ibv_create_cq(ctx, 64, NULL, NULL, 0) : NULL;
	struct ibv_port_attr pa;
	if (!pd || !cq || ibv_query_port(ctx, 1, &pa))
		FAIL("cannot open the device");
	lid = pa.lid;
	/* [0, SIZE) source, [SIZE, 2 SIZE) the peer's target, [2 SIZE, 3 SIZE) READ results and
	 * receives, [3 SIZE, 3 SIZE + 8) the atomic word, then the atomics' results. */
	unsigned char *buf = aligned_alloc(4096, 4096);
	struct ibv_mr *mr = buf ? ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE |
			IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC) : NULL;
	if (!mr)
		FAIL("no MR");
	uint64_t all = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
		IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ |
		IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;
	struct ibv_qp *a = make_qp(IBV_QPT_RC, all), *b = make_qp(IBV_QPT_RC, IBV_QP_EX_WITH_SEND);
	if (!a || !b || connect_rc(a, b->qp_num, lid) || connect_rc(b, a->qp_num, lid))
		FAIL("cannot make and connect the RC QPs: %s", strerror(errno));
	struct ibv_qp_ex *x = ibv_qp_to_qp_ex(a), *y = ibv_qp_to_qp_ex(b);
	if (!x || !y)
		FAIL("ibv_qp_to_qp_ex gave NULL for a QP made with send_ops_flags");
	uint64_t base = (uintptr_t)buf;
	struct ibv_recv_wr *rbad;

	/* RDMA WRITE from a gather list entry. */
	memset(buf, 0x11, SIZE);
	ibv_wr_start(x);
	x->wr_id = 1;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, mr->rkey, base + SIZE);
	ibv_wr_set_sge(x, mr->lkey, base, SIZE);
	if (ibv_wr_complete(x))
		FAIL("WRITE: ibv_wr_complete failed");
	one(IBV_WC_RDMA_WRITE, 1, "WRITE");
	check(buf + SIZE, 0x11, SIZE, "WRITE");

	/* RDMA WRITE of inline bytes (the program's buffer changed right after the setter). */
	unsigned char in[48];
	memset(in, 0x22, sizeof in);
	ibv_wr_start(x);
	x->wr_id = 2;
	x->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	ibv_wr_rdma_write(x, mr->rkey, base + SIZE);
	ibv_wr_set_inline_data(x, in, sizeof in);
	memset(in, 0x99, sizeof in);
	if (ibv_wr_complete(x))
		FAIL("inline WRITE: ibv_wr_complete failed");
	one(IBV_WC_RDMA_WRITE, 2, "inline WRITE");
	check(buf + SIZE, 0x22, sizeof in, "inline WRITE");
	check(buf + SIZE + sizeof in, 0x11, SIZE - sizeof in, "inline WRITE (the rest)");

	/* The setter decides what is sent, not IBV_SEND_INLINE in wr_flags (as on mlx5): a gather
	 * entry with the flag set sends the entry's bytes. */
	memset(buf, 0x12, 16);
	ibv_wr_start(x);
	x->wr_id = 6;
	x->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	ibv_wr_rdma_write(x, mr->rkey, base + 3 * SIZE + 64);
	ibv_wr_set_sge(x, mr->lkey, base, 16);
	if (ibv_wr_complete(x))
		FAIL("WRITE with the INLINE flag and a gather entry: ibv_wr_complete failed");
	one(IBV_WC_RDMA_WRITE, 6, "WRITE with the INLINE flag and a gather entry");
	check(buf + 3 * SIZE + 64, 0x12, 16, "WRITE with the INLINE flag and a gather entry");

	/* RDMA READ back into [2 SIZE, 3 SIZE). */
	memset(buf + 2 * SIZE, 0, SIZE);
	ibv_wr_start(x);
	x->wr_id = 3;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_read(x, mr->rkey, base + SIZE);
	ibv_wr_set_sge(x, mr->lkey, base + 2 * SIZE, SIZE);
	if (ibv_wr_complete(x))
		FAIL("READ: ibv_wr_complete failed");
	one(IBV_WC_RDMA_READ, 3, "READ");
	check(buf + 2 * SIZE, 0x22, sizeof in, "READ");
	check(buf + 2 * SIZE + sizeof in, 0x11, SIZE - sizeof in, "READ");

	/* The atomics on the word at [3 SIZE]. */
	uint64_t *word = (uint64_t *)(buf + 3 * SIZE), *old = word + 1;
	*word = 40;
	ibv_wr_start(x);
	x->wr_id = 4;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_atomic_fetch_add(x, mr->rkey, base + 3 * SIZE, 2);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)old, 8);
	if (ibv_wr_complete(x))
		FAIL("FETCH_AND_ADD: ibv_wr_complete failed");
	one(IBV_WC_FETCH_ADD, 4, "FETCH_AND_ADD");
	if (*old != 40 || *word != 42)
		FAIL("FETCH_AND_ADD: old %llu word %llu (want 40, 42)", (unsigned long long)*old,
		     (unsigned long long)*word);
	ibv_wr_start(x);
	x->wr_id = 5;
	ibv_wr_atomic_cmp_swp(x, mr->rkey, base + 3 * SIZE, 42, 7);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)old, 8);
	if (ibv_wr_complete(x))
		FAIL("CMP_AND_SWP: ibv_wr_complete failed");
	one(IBV_WC_COMP_SWAP, 5, "CMP_AND_SWP");
	if (*old != 42 || *word != 7)
		FAIL("CMP_AND_SWP: old %llu word %llu (want 42, 7)", (unsigned long long)*old,
		     (unsigned long long)*word);

	/* A batch: SEND from a two-entry gather list, WRITE_WITH_IMM, then SEND_WITH_IMM of an
	 * inline list, all in one region; the receiver's completions in order. */
	memset(buf, 0x33, SIZE / 2);
	memset(buf + SIZE / 2, 0x44, SIZE / 2);
	/* Each receive into its own SIZE bytes from 1024 on. */
	memset(buf + 1024, 0, 3 * SIZE);
	for (int i = 0; i < 3; i++) {
		struct ibv_sge at = { base + 1024 + i * SIZE, SIZE, mr->lkey };
		struct ibv_recv_wr r = { .wr_id = 100 + i, .sg_list = &at, .num_sge = 1 };
		if (ibv_post_recv(b, &r, &rbad))
			FAIL("post_recv");
	}
	struct ibv_sge two[2] = { { base, SIZE / 2, mr->lkey }, { base + SIZE / 2, SIZE / 2, mr->lkey } };
	char h1[] = "head-", h2[] = "tail";
	struct ibv_data_buf parts[2] = { { h1, 5 }, { h2, 4 } };
	ibv_wr_start(x);
	x->wr_id = 10;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(x);
	ibv_wr_set_sge_list(x, 2, two);
	x->wr_id = 11;
	ibv_wr_rdma_write_imm(x, mr->rkey, base + SIZE, htonl(0xabc));
	ibv_wr_set_sge(x, mr->lkey, base, 8);
	x->wr_id = 12;
	x->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	ibv_wr_send_imm(x, htonl(0x1234));
	ibv_wr_set_inline_data_list(x, 2, parts);
	if (ibv_wr_complete(x))
		FAIL("batch: ibv_wr_complete failed");
	int sends = 0, recvs = 0;
	while (sends < 3 || recvs < 3) {
		struct ibv_wc wc;
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n == 0)
			continue;
		if (n < 0 || wc.status != IBV_WC_SUCCESS)
			FAIL("batch: completion status %s", n < 0 ? "-" : ibv_wc_status_str(wc.status));
		if (wc.opcode & IBV_WC_RECV) {
			int want_len[3] = { SIZE, 8, 9 }; /* WRITE_WITH_IMM: the bytes written */
			uint32_t want_imm[3] = { 0, 0xabc, 0x1234 };
			int want_op[3] = { IBV_WC_RECV, IBV_WC_RECV_RDMA_WITH_IMM, IBV_WC_RECV };
			if ((int)wc.opcode != want_op[recvs] || (int)wc.byte_len != want_len[recvs] ||
			    wc.wr_id != (uint64_t)(100 + recvs) ||
			    (recvs > 0 && (!(wc.wc_flags & IBV_WC_WITH_IMM) || ntohl(wc.imm_data) != want_imm[recvs])))
				FAIL("batch: receive %d: opcode %d len %u imm %#x", recvs, wc.opcode,
				     wc.byte_len, ntohl(wc.imm_data));
			if (recvs == 0) {
				check(buf + 1024, 0x33, SIZE / 2, "batch SEND");
				check(buf + 1024 + SIZE / 2, 0x44, SIZE / 2, "batch SEND");
			} else if (recvs == 2 && memcmp(buf + 1024 + 2 * SIZE, "head-tail", 9))
				FAIL("batch: inline SEND brought '%.9s'", buf + 1024 + 2 * SIZE);
			recvs++;
		} else {
			uint64_t want[3] = { 10, 11, 12 };
			if (wc.wr_id != want[sends])
				FAIL("batch: send completion %d has wr_id %llu", sends,
				     (unsigned long long)wc.wr_id);
			sends++;
		}
	}
	check(buf + SIZE, 0x33, 8, "batch WRITE_WITH_IMM");

	/* Errors: nothing is posted. */
	if (ibv_wr_complete(x) != EINVAL)
		FAIL("ibv_wr_complete outside ibv_wr_start is not EINVAL");
	ibv_wr_start(x);
	ibv_wr_set_sge(x, mr->lkey, base, 8); /* a setter before any builder */
	if (ibv_wr_complete(x) != EINVAL)
		FAIL("a setter before any builder is not EINVAL");
	ibv_wr_start(y);
	y->wr_id = 20;
	ibv_wr_rdma_read(y, mr->rkey, base + SIZE); /* b was made for SEND only */
	ibv_wr_set_sge(y, mr->lkey, base, 8);
	if (ibv_wr_complete(y) != EINVAL)
		FAIL("an operation the QP was not made for is not EINVAL");
	ibv_wr_start(x);
	x->wr_id = 21;
	ibv_wr_local_inv(x, mr->rkey);
	if (ibv_wr_complete(x) != EOPNOTSUPP)
		FAIL("ibv_wr_local_inv is not EOPNOTSUPP");
	ibv_wr_start(x);
	x->wr_id = 22;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, mr->rkey, base + SIZE);
	ibv_wr_set_sge(x, mr->lkey, base, 8);
	ibv_wr_abort(x);
	none_left("errors and abort");

	/* A QP of ibv_create_qp has no extended API; what a QP cannot be made for is refused. */
	struct ibv_qp_init_attr li = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *legacy = ibv_create_qp(pd, &li);
	if (!legacy || ibv_qp_to_qp_ex(legacy))
		FAIL("a QP of ibv_create_qp: %s", legacy ? "ibv_qp_to_qp_ex is not NULL" : "not made");
	errno = 0;
	if (make_qp(IBV_QPT_UC, IBV_QP_EX_WITH_RDMA_READ) || errno != EOPNOTSUPP)
		FAIL("a UC QP for RDMA READ: not refused with EOPNOTSUPP (errno %d)", errno);
	if (make_qp(IBV_QPT_RC, IBV_QP_EX_WITH_BIND_MW) || errno != EOPNOTSUPP)
		FAIL("a QP for BIND_MW: not refused with EOPNOTSUPP (errno %d)", errno);
	struct ibv_qp_init_attr_ex flags = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS, .pd = pd,
		.create_flags = IBV_QP_CREATE_SCATTER_FCS };
	errno = 0;
	if (ibv_create_qp_ex(ctx, &flags) || errno != EOPNOTSUPP)
		FAIL("creation flags: not refused with EOPNOTSUPP (errno %d)", errno);

	/* UD: SEND with its address; without one, EINVAL. */
	struct ibv_qp *u = make_qp(IBV_QPT_UD, IBV_QP_EX_WITH_SEND), *v = make_qp(IBV_QPT_UD, IBV_QP_EX_WITH_SEND);
	if (!u || !v || ready_ud(u) || ready_ud(v))
		FAIL("cannot make the UD QPs: %s", strerror(errno));
	struct ibv_ah *ah = ibv_create_ah(pd, &(struct ibv_ah_attr){ .dlid = lid, .port_num = 1 });
	struct ibv_qp_ex *ux = ibv_qp_to_qp_ex(u);
	if (!ah || !ux)
		FAIL("no AH or UD qp_ex");
	struct ibv_recv_wr urwr = { .wr_id = 200, .sg_list = &(struct ibv_sge){ base + 2 * SIZE, SIZE, mr->lkey },
		.num_sge = 1 };
	if (ibv_post_recv(v, &urwr, &rbad))
		FAIL("UD post_recv");
	memset(buf, 0x55, 64);
	memset(buf + 2 * SIZE, 0, SIZE);
	ibv_wr_start(ux);
	ux->wr_id = 30;
	ux->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(ux);
	ibv_wr_set_sge(ux, mr->lkey, base, 64);
	if (ibv_wr_complete(ux) != EINVAL)
		FAIL("a UD SEND without its address is not EINVAL");
	ibv_wr_start(ux);
	ibv_wr_send(ux);
	ibv_wr_set_ud_addr(ux, ah, v->qp_num, 0x11111111);
	ibv_wr_set_sge(ux, mr->lkey, base, 64);
	if (ibv_wr_complete(ux))
		FAIL("UD SEND: ibv_wr_complete failed");
	one(IBV_WC_SEND, 30, "UD SEND");
	struct ibv_wc wc = one(IBV_WC_RECV, 200, "UD RECV");
	if (wc.byte_len != 64 + 40)
		FAIL("UD RECV: %u bytes (want 64 and the 40-byte GRH)", wc.byte_len);
	check(buf + 2 * SIZE + 40, 0x55, 64, "UD SEND");

	/* The poll API: a CQ with timestamps, two QPs on it, three completions read field by
	 * field between ibv_start_poll and ibv_end_poll. */
	struct ibv_device_attr_ex dx;
	if (ibv_query_device_ex(ctx, NULL, &dx) || !dx.completion_timestamp_mask || !dx.hca_core_clock)
		FAIL("ibv_query_device_ex: no completion timestamp clock");
	if (dx.orig_attr.max_qp_wr <= 0)
		FAIL("ibv_query_device_ex: the legacy attributes are missing");
	struct ibv_cq_init_attr_ex cx = { .cqe = 16,
		.wc_flags = IBV_WC_STANDARD_FLAGS | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP |
			    IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK };
	struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &cx);
	if (!cqx)
		FAIL("ibv_create_cq_ex: %s", strerror(errno));
	struct ibv_cq_init_attr_ex bad_cx = { .cqe = 16, .wc_flags = IBV_WC_EX_WITH_CVLAN };
	errno = 0;
	if (ibv_create_cq_ex(ctx, &bad_cx) || errno != EOPNOTSUPP)
		FAIL("ibv_create_cq_ex with CVLAN: not refused with EOPNOTSUPP (errno %d)", errno);
	struct ibv_poll_cq_attr pattr = {};
	if (ibv_start_poll(cqx, &pattr) != ENOENT)
		FAIL("ibv_start_poll on an empty CQ is not ENOENT");
	struct ibv_qp_init_attr_ex ci = { .send_cq = ibv_cq_ex_to_cq(cqx), .recv_cq = ibv_cq_ex_to_cq(cqx),
		.qp_type = IBV_QPT_RC, .cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1,
		.max_recv_sge = 1 }, .comp_mask = IBV_QP_INIT_ATTR_PD, .pd = pd };
	struct ibv_qp *c1 = ibv_create_qp_ex(ctx, &ci), *c2 = ibv_create_qp_ex(ctx, &ci);
	if (!c1 || !c2 || connect_rc(c1, c2->qp_num, lid) || connect_rc(c2, c1->qp_num, lid))
		FAIL("cannot make and connect the QPs on the extended CQ");
	struct ibv_sge rs = { base + 1024, SIZE, mr->lkey }, ss = { base, 100, mr->lkey };
	struct ibv_recv_wr cr = { .wr_id = 300, .sg_list = &rs, .num_sge = 1 };
	struct ibv_send_wr cs = { .wr_id = 301, .sg_list = &ss, .num_sge = 1,
		.opcode = IBV_WR_SEND_WITH_IMM, .send_flags = IBV_SEND_SIGNALED,
		.imm_data = htonl(77) }, *sbad;
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	if (ibv_post_recv(c2, &cr, &rbad) || ibv_post_send(c1, &cs, &sbad))
		FAIL("post on the extended CQ");
	int ret, seen_send = 0, seen_recv = 0;
	uint64_t last_ts = 0;
	while ((ret = ibv_start_poll(cqx, &pattr)) == ENOENT)
		;
	for (;;) {
		if (ret)
			FAIL("extended CQ: poll failed %d", ret);
		read_ex(cqx, c1->qp_num, c2->qp_num, &seen_send, &seen_recv, &last_ts);
		if (seen_send + seen_recv == 2)
			break;
		/* The other completion may not be made yet: poll on within the region. */
		while ((ret = ibv_next_poll(cqx)) == ENOENT)
			;
	}
	ibv_end_poll(cqx);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	if (seen_send != 1 || seen_recv != 1)
		FAIL("extended CQ: %d SEND and %d receive completions (want one each)", seen_send, seen_recv);
	uint64_t lo = t0.tv_sec * 1000000000ull + t0.tv_nsec, hi = t1.tv_sec * 1000000000ull + t1.tv_nsec;
	if (last_ts < lo || last_ts > hi)
		FAIL("extended CQ: timestamp %llu outside the run [%llu, %llu] (1 GHz, CLOCK_MONOTONIC)",
		     (unsigned long long)last_ts, (unsigned long long)lo, (unsigned long long)hi);
	if (ibv_next_poll(cqx) != EINVAL)
		FAIL("ibv_next_poll after ibv_end_poll is not EINVAL");
	if (ibv_destroy_qp(c1) || ibv_destroy_qp(c2) || ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)))
		FAIL("cannot tear the extended CQ down");

	/* Asynchronous events: none yet (async_fd made non-blocking: EAGAIN), then a CQ that
	 * overruns (one entry, four signaled WRITEs) reports IBV_EVENT_CQ_ERR for itself. */
	fcntl(ctx->async_fd, F_SETFL, fcntl(ctx->async_fd, F_GETFL) | O_NONBLOCK);
	struct ibv_async_event aev;
	errno = 0;
	if (ibv_get_async_event(ctx, &aev) != -1 || errno != EAGAIN)
		FAIL("ibv_get_async_event with no event on a non-blocking async_fd: errno %d", errno);
	struct ibv_cq *small = ibv_create_cq(ctx, 1, NULL, NULL, 0);
	struct ibv_qp_init_attr oi = { .send_cq = small, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 8, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *o1 = small ? ibv_create_qp(pd, &oi) : NULL, *o2 = small ? ibv_create_qp(pd, &oi) : NULL;
	if (!o1 || !o2 || connect_rc(o1, o2->qp_num, lid) || connect_rc(o2, o1->qp_num, lid))
		FAIL("cannot make the overrun's QPs");
	for (int i = 0; i < 4; i++) {
		struct ibv_send_wr ow = { .wr_id = 400 + i, .sg_list = &ss, .num_sge = 1,
			.opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED }, *obad;
		ow.wr.rdma.remote_addr = base + SIZE;
		ow.wr.rdma.rkey = mr->rkey;
		if (ibv_post_send(o1, &ow, &obad))
			FAIL("post for the overrun");
	}
	int polled = 0, r = 0;
	for (int i = 0; i < 100000 && r >= 0; i++) {
		struct ibv_wc w;
		r = ibv_poll_cq(small, 1, &w);
		polled += r > 0;
	}
	if (r != -1)
		FAIL("the overrun CQ never answered -1 (%d completions taken)", polled);
	if (ibv_get_async_event(ctx, &aev) || aev.event_type != IBV_EVENT_CQ_ERR || aev.element.cq != small)
		FAIL("no IBV_EVENT_CQ_ERR for the overrun CQ (errno %d, event %d)", errno, aev.event_type);
	ibv_ack_async_event(&aev);
	errno = 0;
	if (ibv_get_async_event(ctx, &aev) != -1 || errno != EAGAIN)
		FAIL("a second event after the CQ error: %d", aev.event_type);
	if (ibv_destroy_qp(o1) || ibv_destroy_qp(o2) || ibv_destroy_cq(small))
		FAIL("cannot tear the overrun down");

	if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_destroy_qp(u) || ibv_destroy_qp(v) ||
	    ibv_destroy_qp(legacy) || ibv_destroy_ah(ah) || ibv_destroy_cq(cq) || ibv_dereg_mr(mr) ||
	    ibv_dealloc_pd(pd) || ibv_close_device(ctx))
		FAIL("cannot tear down");
	/* Each context has a thread for its asynchronous events: closing it ends the thread. */
	for (int i = 0; i < 50; i++) {
		struct ibv_context *c = ibv_open_device(dl[0]);
		if (!c || ibv_close_device(c))
			FAIL("open and close %d", i);
	}
	/* (At once, even for a thread between two looks — each of these started a moment
	 * before its close: it sleeps on a word the close moves. Before that word, such a
	 * thread lived on for up to a second. 400 ms: time to exit on a loaded CI machine.) */
	for (int i = 0; i < 8 && threads() != 1; i++)
		usleep(50000);
	if (threads() != 1)
		FAIL("%d threads left 400 ms after the contexts were closed (want 1)", threads());
	ibv_free_device_list(dl);
	free(buf);
	printf("ibv_extended: ibv_wr_* WRITE, inline WRITE, READ, FETCH_AND_ADD, CMP_AND_SWP, a batch "
	       "of SEND, WRITE_WITH_IMM and inline SEND_WITH_IMM, UD SEND, the errors; an extended CQ "
	       "with timestamps; a CQ overrun's asynchronous event; no thread left: all as documented\n");
	return 0;
}
