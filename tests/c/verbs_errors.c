/*
 * The error paths of the verbs C API, through the C boundary: NULL, destroyed and foreign
 * handles; objects destroyed while in use; bad lkeys and rkeys; a CQ overrun; wrong QP state
 * transitions; calls from the wrong thread. Two contexts (nodes 1 and 2) in one thread.
 * Run under AddressSanitizer/UBSan by scripts/test-c.sh against a 2-node fabric
 * ($BACKPLANE_FABRIC).
 */
#include <backplane/verbs.h>
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The layouts the Rust side asserts too (crates/backplane-capi/src/verbs.rs). */
_Static_assert(sizeof(struct bp_sge) == 16, "bp_sge");
_Static_assert(sizeof(struct bp_send_wr) == 72, "bp_send_wr");
_Static_assert(offsetof(struct bp_send_wr, wr) == 40, "bp_send_wr.wr");
_Static_assert(sizeof(struct bp_recv_wr) == 32, "bp_recv_wr");
_Static_assert(sizeof(struct bp_wc) == 48, "bp_wc");
_Static_assert(sizeof(struct bp_qp_attr) == 72, "bp_qp_attr");
_Static_assert(sizeof(struct bp_qp_init_attr) == 64, "bp_qp_init_attr");
_Static_assert(sizeof(struct bp_mr) == 48, "bp_mr");
_Static_assert(sizeof(struct bp_qp) == 64, "bp_qp");
_Static_assert(sizeof(struct bp_conn_param) == 40, "bp_conn_param");
_Static_assert(sizeof(struct bp_peer_info) == 96, "bp_peer_info");

static int checks, failures;

#define CHECK(cond)                                                                           \
	do {                                                                                  \
		checks++;                                                                     \
		if (!(cond)) {                                                                \
			failures++;                                                           \
			fprintf(stderr, "%s:%d: CHECK(%s) failed (errno %d: %s)\n", __FILE__, \
				__LINE__, #cond, errno, bp_last_error());                     \
		}                                                                             \
	} while (0)

#define ALL (BP_ACCESS_LOCAL_WRITE | BP_ACCESS_REMOTE_WRITE | BP_ACCESS_REMOTE_READ | \
	     BP_ACCESS_REMOTE_ATOMIC)

struct side {
	struct bp_context *ctx;
	struct bp_pd *pd;
	struct bp_cq *cq;
	struct bp_qp *qp;
	struct bp_mr *mr;
};

static struct bp_qp *make_qp(struct bp_pd *pd, struct bp_cq *cq, enum bp_qp_type type)
{
	struct bp_qp_init_attr init = {
		.send_cq = cq, .recv_cq = cq, .qp_type = type,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16 },
	};
	struct bp_qp *qp = bp_create_qp(pd, &init);
	CHECK(qp != NULL);
	CHECK(init.cap.max_send_wr == 16 && init.cap.max_send_sge == 4);
	return qp;
}

static void make_side(struct bp_fabric *f, uint32_t node, struct side *s)
{
	s->ctx = bp_open_device(f, node);
	CHECK(s->ctx != NULL && s->ctx->node == node);
	s->pd = bp_alloc_pd(s->ctx);
	s->cq = bp_create_cq(s->ctx, 64, NULL, NULL, 0);
	s->mr = bp_reg_mr(s->pd, NULL, 8192, ALL);
	CHECK(s->pd && s->cq && s->mr);
	s->qp = make_qp(s->pd, s->cq, BP_QPT_RC);
}

/* RESET -> INIT -> RTR -> RTS by hand, towards (node, qpn). */
static int connect_qp(struct bp_qp *qp, uint16_t node, uint32_t qpn)
{
	/* Fields outside the mask are never read: fill them with garbage to show it. */
	struct bp_qp_attr a;
	memset(&a, 0xff, sizeof a);
	a.qp_state = BP_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = 1;
	a.qp_access_flags = ALL;
	int rc = bp_modify_qp(qp, &a, BP_QP_STATE | BP_QP_PKEY_INDEX | BP_QP_PORT |
					     BP_QP_ACCESS_FLAGS);
	if (rc)
		return rc;
	memset(&a, 0, sizeof a);
	a.qp_state = BP_QPS_RTR;
	a.path_mtu = BP_MTU_4096;
	a.dest_qp_num = qpn;
	a.ah_attr.dlid = node;
	a.ah_attr.port_num = 1;
	a.max_dest_rd_atomic = 16;
	a.min_rnr_timer = 12;
	rc = bp_modify_qp(qp, &a, BP_QP_STATE | BP_QP_AV | BP_QP_PATH_MTU | BP_QP_DEST_QPN |
					  BP_QP_RQ_PSN | BP_QP_MAX_DEST_RD_ATOMIC |
					  BP_QP_MIN_RNR_TIMER);
	if (rc)
		return rc;
	memset(&a, 0, sizeof a);
	a.qp_state = BP_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 16;
	return bp_modify_qp(qp, &a, BP_QP_STATE | BP_QP_SQ_PSN | BP_QP_TIMEOUT | BP_QP_RETRY_CNT |
					    BP_QP_RNR_RETRY | BP_QP_MAX_QP_RD_ATOMIC);
}

static void pair(struct bp_fabric *f, struct side *a, struct side *b)
{
	make_side(f, 1, a);
	make_side(f, 2, b);
	CHECK(connect_qp(a->qp, 2, b->qp->qp_num) == 0);
	CHECK(connect_qp(b->qp, 1, a->qp->qp_num) == 0);
	CHECK(a->qp->state == BP_QPS_RTS);
}

static void free_side(struct side *s)
{
	CHECK(bp_destroy_qp(s->qp) == 0);
	CHECK(bp_dereg_mr(s->mr) == 0);
	CHECK(bp_destroy_cq(s->cq) == 0);
	CHECK(bp_dealloc_pd(s->pd) == 0);
	CHECK(bp_close_device(s->ctx) == 0);
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* Polls `want` for one completion, moving `other` (the peer, in this thread) along too:
 * bp_poll_cq with 0 entries makes progress without taking completions. */
static int next_wc(struct bp_cq *want, struct bp_cq *other, struct bp_wc *wc)
{
	double end = now() + 10;
	while (now() < end) {
		int n = bp_poll_cq(want, 1, wc);
		if (n != 0)
			return n;
		if (other)
			(void)bp_poll_cq(other, 0, NULL);
	}
	return 0;
}

static void *other_thread(void *arg)
{
	struct bp_context *ctx = arg;
	struct bp_pd *pd = bp_alloc_pd(ctx);
	int e = errno;
	return (void *)(intptr_t)(pd == NULL && e == EPERM);
}

static void *leaky_thread(void *arg)
{
	struct side s;
	make_side(arg, 2, &s);
	return (void *)(intptr_t)(s.qp != NULL);
}

/* Two QPs on node 2 take their receives from one shared receive queue. */
static void shared_receive_queue(struct bp_fabric *f)
{
	struct side a, b;
	struct bp_recv_wr *bad_r;
	struct bp_send_wr *bad_s;
	struct bp_wc wc;
	make_side(f, 1, &a);
	make_side(f, 2, &b);
	struct bp_qp *a2 = make_qp(a.pd, a.cq, BP_QPT_RC);
	struct bp_srq_init_attr si = { .attr = { .max_wr = 0, .max_sge = 1 } };
	CHECK(bp_create_srq(b.pd, &si) == NULL && errno == EINVAL);
	si.attr.max_wr = 4;
	si.attr.srq_limit = 2;
	CHECK(bp_create_srq(b.pd, &si) == NULL && errno == EINVAL); /* no limit event */
	si.attr.srq_limit = 0;
	CHECK(bp_create_srq(NULL, &si) == NULL && errno == EBADF);
	struct bp_srq *srq = bp_create_srq(b.pd, &si);
	CHECK(srq != NULL && srq->pd == b.pd && srq->context == b.ctx);
	struct bp_srq_attr sa;
	CHECK(bp_query_srq(srq, &sa) == 0 && sa.max_wr == 4 && sa.max_sge == 1 &&
	      sa.srq_limit == 0);
	struct bp_qp_init_attr init = {
		.send_cq = b.cq, .recv_cq = b.cq, .qp_type = BP_QPT_RC, .srq = srq,
		.cap = { .max_send_wr = 16 },
	};
	struct bp_qp *b1 = bp_create_qp(b.pd, &init);
	struct bp_qp *b2 = bp_create_qp(b.pd, &init);
	CHECK(b1 != NULL && b2 != NULL && b1->srq == srq);
	struct bp_qp_init_attr got;
	struct bp_qp_attr qa;
	CHECK(bp_query_qp(b1, &qa, 0, &got) == 0 && got.srq == srq);
	CHECK(bp_destroy_srq(srq) == EBUSY);
	CHECK(bp_dealloc_pd(b.pd) == EBUSY);
	CHECK(connect_qp(a.qp, 2, b1->qp_num) == 0 && connect_qp(b1, 1, a.qp->qp_num) == 0);
	CHECK(connect_qp(a2, 2, b2->qp_num) == 0 && connect_qp(b2, 1, a2->qp_num) == 0);
	char *rb = b.mr->addr;
	struct bp_sge rs[2] = {
		{ .addr = (uintptr_t)rb, .length = 64, .lkey = b.mr->lkey },
		{ .addr = (uintptr_t)rb + 64, .length = 64, .lkey = b.mr->lkey },
	};
	struct bp_recv_wr r1 = { .wr_id = 101, .sg_list = &rs[1], .num_sge = 1 };
	struct bp_recv_wr r0 = { .wr_id = 100, .next = &r1, .sg_list = &rs[0], .num_sge = 1 };
	CHECK(bp_post_srq_recv(srq, &r0, &bad_r) == 0 && bad_r == NULL);
	CHECK(bp_post_recv(b1, &r0, &bad_r) == EINVAL && bad_r == &r0);
	CHECK(bp_post_srq_recv(NULL, &r0, &bad_r) == EBADF);
	memcpy(a.mr->addr, "one.two.", 8);
	struct bp_sge s0 = { .addr = (uintptr_t)a.mr->addr, .length = 4, .lkey = a.mr->lkey };
	struct bp_sge s1 = { .addr = (uintptr_t)a.mr->addr + 4, .length = 4, .lkey = a.mr->lkey };
	struct bp_send_wr w0 = { .wr_id = 1, .sg_list = &s0, .num_sge = 1, .opcode = BP_WR_SEND };
	struct bp_send_wr w1 = { .wr_id = 2, .sg_list = &s1, .num_sge = 1, .opcode = BP_WR_SEND };
	CHECK(bp_post_send(a.qp, &w0, &bad_s) == 0 && bp_post_send(a2, &w1, &bad_s) == 0);
	int seen = 0;
	for (int i = 0; i < 2; i++) {
		CHECK(next_wc(b.cq, a.cq, &wc) == 1 && wc.status == BP_WC_SUCCESS &&
		      wc.opcode == BP_WC_RECV && wc.byte_len == 4);
		const char *at = rb + (wc.wr_id - 100) * 64;
		if (wc.qp_num == b1->qp_num && memcmp(at, "one.", 4) == 0)
			seen |= 1;
		if (wc.qp_num == b2->qp_num && memcmp(at, "two.", 4) == 0)
			seen |= 2;
	}
	CHECK(seen == 3);
	CHECK(bp_destroy_qp(b1) == 0 && bp_destroy_qp(b2) == 0);
	CHECK(bp_destroy_srq(srq) == 0 && bp_destroy_srq(srq) == EBADF);
	CHECK(bp_query_srq(srq, &sa) == EBADF);
	CHECK(bp_destroy_qp(a2) == 0);
	free_side(&a);
	free_side(&b);
}

int main(void)
{
	struct bp_fabric *f = bp_fabric_attach(NULL);
	CHECK(f != NULL);
	if (!f)
		return 1;

	/* ---- NULL and made-up handles ---- */
	errno = 0;
	CHECK(bp_open_device(NULL, 1) == NULL && errno == EBADF);
	CHECK(bp_open_device(f, 99) == NULL && errno == EINVAL);
	CHECK(bp_alloc_pd(NULL) == NULL && errno == EBADF);
	CHECK(bp_dealloc_pd(NULL) == EBADF && errno == EBADF);
	CHECK(bp_close_device(NULL) == -1 && errno == EBADF);
	CHECK(bp_close_device((struct bp_context *)(uintptr_t)0x1000) == -1 && errno == EBADF);
	struct bp_wc wc;
	CHECK(bp_poll_cq(NULL, 1, &wc) == -1 && errno == EBADF);
	CHECK(bp_req_notify_cq(NULL, 0) == EBADF);
	CHECK(bp_destroy_qp(NULL) == EBADF && bp_destroy_cq(NULL) == EBADF);
	CHECK(bp_dereg_mr(NULL) == EBADF && bp_destroy_ah(NULL) == EBADF);
	CHECK(bp_destroy_comp_channel(NULL) == EBADF && bp_destroy_listener(NULL) == EBADF);
	struct bp_send_wr swr = { .opcode = BP_WR_SEND };
	struct bp_send_wr *bad_s = &swr;
	CHECK(bp_post_send(NULL, &swr, &bad_s) == EBADF && bad_s == NULL);
	struct bp_recv_wr rwr = { 0 };
	struct bp_recv_wr *bad_r = &rwr;
	CHECK(bp_post_recv(NULL, &rwr, &bad_r) == EBADF && bad_r == NULL);
	bp_ack_cq_events(NULL, 1); /* void: must simply not crash */
	CHECK(bp_get_cq_event(NULL, NULL, NULL) == -1 && errno == EBADF);
	CHECK(strlen(bp_last_error()) > 0);

	/* ---- device queries, argument checks, EBUSY, destroyed handles ---- */
	struct bp_context *ctx = bp_open_device(f, 1);
	CHECK(ctx != NULL);
	struct bp_device_attr dev;
	CHECK(bp_query_device(ctx, &dev) == 0 && dev.phys_port_cnt == 1 && dev.max_sge == 32);
	CHECK(bp_query_device(ctx, NULL) == EINVAL);
	struct bp_port_attr port;
	CHECK(bp_query_port(ctx, 1, &port) == 0 && port.state == BP_PORT_ACTIVE && port.lid == 1 &&
	      port.active_mtu == BP_MTU_4096);
	CHECK(bp_query_port(ctx, 2, &port) == EINVAL);
	CHECK(bp_fabric_detach(f) == -1 && errno == EBUSY);
	/* A destroyed object's handle never names an object made after it (the allocator would
	 * otherwise hand the same address to the next PD at once). */
	enum { N_STALE = 64 };
	struct bp_pd *gone[N_STALE], *fresh[N_STALE];
	for (int i = 0; i < N_STALE; i++)
		CHECK((gone[i] = bp_alloc_pd(ctx)) != NULL);
	for (int i = 0; i < N_STALE; i++)
		CHECK(bp_dealloc_pd(gone[i]) == 0);
	int aliased = 0;
	for (int i = 0; i < N_STALE; i++) {
		CHECK((fresh[i] = bp_alloc_pd(ctx)) != NULL);
		for (int j = 0; j < N_STALE; j++)
			aliased += fresh[i] == gone[j];
	}
	CHECK(aliased == 0);
	for (int i = 0; i < N_STALE; i++)
		CHECK(bp_dealloc_pd(gone[i]) == EBADF);
	for (int i = 0; i < N_STALE; i++)
		CHECK(bp_dealloc_pd(fresh[i]) == 0);
	struct bp_pd *pd = bp_alloc_pd(ctx);
	CHECK(pd != NULL);
	char buf[64];
	CHECK(bp_reg_mr(pd, buf, sizeof buf, BP_ACCESS_LOCAL_WRITE) == NULL && errno == EINVAL);
	CHECK(bp_reg_mr(pd, NULL, 64, BP_ACCESS_REMOTE_WRITE) == NULL && errno == EINVAL);
	CHECK(bp_reg_mr(pd, NULL, 64, 1 << 12) == NULL && errno == EINVAL);
	CHECK(bp_reg_mr(pd, NULL, 0, BP_ACCESS_LOCAL_WRITE) == NULL && errno == EINVAL);
	struct bp_mr *mr = bp_reg_mr(pd, NULL, 4096, ALL | BP_ACCESS_ZERO_BASED);
	CHECK(mr != NULL && mr->length == 4096 && mr->lkey == mr->rkey && mr->pd == pd);
	memset(mr->addr, 0xab, mr->length); /* the region is ours to write */
	CHECK(bp_create_cq(ctx, 0, NULL, NULL, 0) == NULL && errno == EINVAL);
	CHECK(bp_create_cq(ctx, 8, NULL, NULL, 1) == NULL && errno == EINVAL);
	struct bp_comp_channel *ch = bp_create_comp_channel(ctx);
	CHECK(ch != NULL && ch->fd >= 0);
	int tag = 42;
	struct bp_cq *cq = bp_create_cq(ctx, 8, &tag, ch, 0);
	CHECK(cq != NULL && cq->channel == ch && ch->refcnt == 1);
	struct bp_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = 9 };
	CHECK(bp_create_qp(pd, &ia) == NULL && errno == EINVAL);
	ia.qp_type = BP_QPT_RC;
	ia.srq = (struct bp_srq *)&tag; /* not an SRQ this library made */
	CHECK(bp_create_qp(pd, &ia) == NULL && errno == EBADF);
	ia.srq = NULL;
	ia.cap.max_send_wr = 1 << 20;
	CHECK(bp_create_qp(pd, &ia) == NULL && errno == EINVAL);
	CHECK(bp_create_qp(pd, NULL) == NULL && errno == EINVAL);
	struct bp_qp *qp = make_qp(pd, cq, BP_QPT_RC);

	CHECK(bp_dealloc_pd(pd) == EBUSY);
	CHECK(bp_destroy_cq(cq) == EBUSY);
	CHECK(bp_destroy_comp_channel(ch) == EBUSY);
	CHECK(bp_close_device(ctx) == -1 && errno == EBUSY);

	/* ---- wrong QP state transitions and posting in the wrong state ---- */
	struct bp_qp_attr qa = { .qp_state = BP_QPS_RTS };
	CHECK(bp_modify_qp(qp, &qa, BP_QP_STATE) == EINVAL); /* RESET -> RTS */
	qa.qp_state = BP_QPS_INIT;
	qa.port_num = 1;
	CHECK(bp_modify_qp(qp, &qa, BP_QP_STATE | BP_QP_PORT) == EINVAL); /* missing attributes */
	qa.qp_state = 17;
	CHECK(bp_modify_qp(qp, &qa, BP_QP_STATE) == EINVAL);
	CHECK(bp_modify_qp(qp, NULL, BP_QP_STATE) == EINVAL);
	struct bp_sge sge = { .addr = 0, .length = 8, .lkey = mr->lkey };
	struct bp_send_wr s1 = { .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = BP_WR_SEND };
	bad_s = NULL;
	CHECK(bp_post_send(qp, &s1, &bad_s) == EINVAL && bad_s == &s1); /* RESET */
	CHECK(bp_post_send(qp, NULL, &bad_s) == EINVAL);
	struct bp_qp_attr got;
	struct bp_qp_init_attr gi;
	CHECK(bp_query_qp(qp, &got, BP_QP_STATE, &gi) == 0 && got.qp_state == BP_QPS_RESET &&
	      gi.send_cq == cq && gi.qp_type == BP_QPT_RC && gi.cap.max_recv_wr == 16);
	qa = (struct bp_qp_attr){ .qp_state = BP_QPS_ERR };
	CHECK(bp_modify_qp(qp, &qa, BP_QP_STATE) == 0 && qp->state == BP_QPS_ERR);
	qa.qp_state = BP_QPS_RTR;
	CHECK(bp_modify_qp(qp, &qa, BP_QP_STATE) == EINVAL); /* ERR -> RTR */

	/* ---- the owner-thread rule ---- */
	pthread_t th;
	void *ok = NULL;
	CHECK(pthread_create(&th, NULL, other_thread, ctx) == 0 && pthread_join(th, &ok) == 0);
	CHECK(ok == (void *)1);

	/* ---- completion channel: an event, cq_context, ack before destroy ---- */
	{
		struct side a, b;
		pair(f, &a, &b);
		/* A second QP on node 2 reporting to the channel's CQ... */
		struct bp_comp_channel *bch = bp_create_comp_channel(b.ctx);
		struct bp_cq *bcq = bp_create_cq(b.ctx, 8, &tag, bch, 0);
		struct bp_qp *bqp = make_qp(b.pd, bcq, BP_QPT_RC);
		struct bp_qp *aqp = make_qp(a.pd, a.cq, BP_QPT_RC);
		CHECK(connect_qp(aqp, 2, bqp->qp_num) == 0 && connect_qp(bqp, 1, aqp->qp_num) == 0);
		struct bp_sge rs = { .addr = 0, .length = 64, .lkey = b.mr->lkey };
		struct bp_recv_wr r = { .wr_id = 7, .sg_list = &rs, .num_sge = 1 };
		CHECK(bp_post_recv(bqp, &r, &bad_r) == 0 && bad_r == NULL);
		CHECK(bp_req_notify_cq(bcq, 0) == 0);
		CHECK(bp_req_notify_cq(a.cq, 0) == EINVAL); /* no channel */
		struct bp_sge ss = { .addr = (uintptr_t)a.mr->addr, .length = 5, .lkey = a.mr->lkey };
		memcpy(a.mr->addr, "hello", 5);
		struct bp_send_wr s = { .wr_id = 8, .sg_list = &ss, .num_sge = 1,
					.opcode = BP_WR_SEND_WITH_IMM, .imm_data = htonl(0xc0ffee) };
		CHECK(bp_post_send(aqp, &s, &bad_s) == 0);
		struct pollfd pfd = { .fd = bch->fd, .events = POLLIN };
		CHECK(poll(&pfd, 1, 5000) == 1);
		struct bp_cq *evcq = NULL;
		void *evctx = NULL;
		CHECK(bp_get_cq_event(bch, &evcq, &evctx) == 0 && evcq == bcq && evctx == &tag);
		CHECK(bp_poll_cq(bcq, 1, &wc) == 1 && wc.wr_id == 7 && wc.status == BP_WC_SUCCESS &&
		      wc.opcode == BP_WC_RECV && wc.byte_len == 5 && (wc.wc_flags & BP_WC_WITH_IMM) &&
		      ntohl(wc.imm_data) == 0xc0ffee && wc.slid == 1 &&
		      memcmp(b.mr->addr, "hello", 5) == 0);
		CHECK(bp_destroy_qp(bqp) == 0);
		CHECK(bp_destroy_cq(bcq) == EBUSY); /* event not acknowledged */
		bp_ack_cq_events(bcq, 1);
		CHECK(bp_destroy_cq(bcq) == 0 && bp_destroy_comp_channel(bch) == 0);
		CHECK(bp_destroy_qp(aqp) == 0);
		free_side(&a);
		free_side(&b);
	}

	/* ---- RDMA_WRITE_WITH_IMM lands, and sge.addr may be a pointer into the region ---- */
	{
		struct side a, b;
		pair(f, &a, &b);
		struct bp_sge rs = { .addr = 0, .length = 0, .lkey = b.mr->lkey };
		struct bp_recv_wr r = { .wr_id = 70, .sg_list = &rs, .num_sge = 1 };
		CHECK(bp_post_recv(b.qp, &r, &bad_r) == 0);
		memcpy((char *)a.mr->addr + 100, "payload!", 8);
		struct bp_sge ss = { .addr = (uintptr_t)a.mr->addr + 100, .length = 8,
				     .lkey = a.mr->lkey };
		struct bp_send_wr w = { .wr_id = 71, .sg_list = &ss, .num_sge = 1,
					.opcode = BP_WR_RDMA_WRITE_WITH_IMM,
					.send_flags = BP_SEND_SIGNALED, .imm_data = htonl(5) };
		w.wr.rdma.remote_addr = 200;
		w.wr.rdma.rkey = b.mr->rkey;
		CHECK(bp_post_send(a.qp, &w, &bad_s) == 0);
		/* It completes when node 2 takes it: move node 2 along while waiting. */
		CHECK(next_wc(a.cq, b.cq, &wc) == 1 && wc.wr_id == 71 && wc.status == BP_WC_SUCCESS &&
		      wc.opcode == BP_WC_RDMA_WRITE);
		CHECK(next_wc(b.cq, NULL, &wc) == 1 && wc.wr_id == 70 &&
		      wc.opcode == BP_WC_RECV_RDMA_WITH_IMM && ntohl(wc.imm_data) == 5 &&
		      memcmp((char *)b.mr->addr + 200, "payload!", 8) == 0);
		/* A list with a bad opcode second: the first is posted, bad_wr names the second. */
		w.opcode = BP_WR_RDMA_WRITE;
		struct bp_send_wr w2 = w;
		w.next = &w2;
		w2.opcode = 77;
		w.wr_id = 72;
		bad_s = NULL;
		CHECK(bp_post_send(a.qp, &w, &bad_s) == EINVAL && bad_s == &w2);
		CHECK(next_wc(a.cq, b.cq, &wc) == 1 && wc.wr_id == 72 && wc.status == BP_WC_SUCCESS);
		/* Too many receives: the one past max_recv_wr (16) is refused, those before posted. */
		struct bp_recv_wr rr[17];
		for (int i = 0; i < 17; i++)
			rr[i] = (struct bp_recv_wr){ .wr_id = 100 + i, .sg_list = &rs, .num_sge = 1,
						     .next = i < 16 ? &rr[i + 1] : NULL };
		rs.length = 8;
		CHECK(bp_post_recv(b.qp, rr, &bad_r) == ENOMEM && bad_r == &rr[16]);
		struct bp_sge many[33];
		rr[0].sg_list = many;
		rr[0].num_sge = 33;
		rr[0].next = NULL;
		CHECK(bp_post_recv(b.qp, rr, &bad_r) == EINVAL && bad_r == &rr[0]);
		free_side(&a);
		free_side(&b);
	}

	/* ---- a bad lkey is LOC_PROT_ERR, and what follows is flushed ---- */
	{
		struct side a, b;
		pair(f, &a, &b);
		struct bp_sge bad = { .addr = 0, .length = 8, .lkey = a.mr->lkey ^ 0x77 };
		struct bp_sge good = { .addr = 0, .length = 8, .lkey = a.mr->lkey };
		struct bp_send_wr w2 = { .wr_id = 2, .sg_list = &good, .num_sge = 1,
					 .opcode = BP_WR_SEND };
		struct bp_send_wr w1 = { .wr_id = 1, .sg_list = &bad, .num_sge = 1,
					 .opcode = BP_WR_RDMA_WRITE, .next = &w2 };
		w1.wr.rdma.rkey = b.mr->rkey;
		CHECK(bp_post_send(a.qp, &w1, &bad_s) == 0);
		CHECK(next_wc(a.cq, b.cq, &wc) == 1 && wc.wr_id == 1 &&
		      wc.status == BP_WC_LOC_PROT_ERR);
		CHECK(strcmp(bp_wc_status_str(wc.status), "local protection error") == 0);
		CHECK(next_wc(a.cq, b.cq, &wc) == 1 && wc.wr_id == 2 &&
		      wc.status == BP_WC_WR_FLUSH_ERR);
		/* Past the end of its own region, too. */
		free_side(&a);
		free_side(&b);
		pair(f, &a, &b);
		good.lkey = a.mr->lkey;
		good.addr = 8190;
		w2.next = NULL;
		CHECK(bp_post_send(a.qp, &w2, &bad_s) == 0);
		CHECK(next_wc(a.cq, b.cq, &wc) == 1 && wc.status == BP_WC_LOC_PROT_ERR);
		free_side(&a);
		free_side(&b);
	}

	/* ---- a bad rkey is REM_ACCESS_ERR: the QP goes to ERR and the rest is flushed ---- */
	{
		struct side a, b;
		pair(f, &a, &b);
		struct bp_sge g = { .addr = 0, .length = 8, .lkey = a.mr->lkey };
		struct bp_send_wr w2 = { .wr_id = 2, .sg_list = &g, .num_sge = 1,
					 .opcode = BP_WR_RDMA_WRITE, .send_flags = BP_SEND_SIGNALED };
		w2.wr.rdma.rkey = b.mr->rkey;
		struct bp_send_wr w1 = w2;
		w1.wr_id = 1;
		w1.wr.rdma.rkey = b.mr->rkey ^ 0x5a5a0001;
		w1.next = &w2;
		CHECK(bp_post_send(a.qp, &w1, &bad_s) == 0);
		CHECK(next_wc(a.cq, b.cq, &wc) == 1 && wc.wr_id == 1 &&
		      wc.status == BP_WC_REM_ACCESS_ERR);
		CHECK(next_wc(a.cq, b.cq, &wc) == 1 && wc.wr_id == 2 &&
		      wc.status == BP_WC_WR_FLUSH_ERR);
		CHECK(bp_query_qp(a.qp, &got, BP_QP_STATE, NULL) == 0 && got.qp_state == BP_QPS_ERR &&
		      a.qp->state == BP_QPS_ERR);
		w2.wr_id = 3;
		CHECK(bp_post_send(a.qp, &w2, &bad_s) == 0); /* posted in ERR: flushed at once */
		CHECK(next_wc(a.cq, b.cq, &wc) == 1 && wc.wr_id == 3 &&
		      wc.status == BP_WC_WR_FLUSH_ERR);
		/* Out of bounds of a good region, and a misaligned atomic, fail the same way. */
		free_side(&a);
		free_side(&b);
		pair(f, &a, &b);
		struct bp_send_wr at = { .wr_id = 4, .sg_list = &g, .num_sge = 1,
					 .opcode = BP_WR_ATOMIC_FETCH_AND_ADD,
					 .send_flags = BP_SEND_SIGNALED };
		g.lkey = a.mr->lkey;
		at.wr.atomic.remote_addr = 4;
		at.wr.atomic.rkey = b.mr->rkey;
		at.wr.atomic.compare_add = 1;
		CHECK(bp_post_send(a.qp, &at, &bad_s) == 0);
		CHECK(next_wc(a.cq, b.cq, &wc) == 1 && wc.status == BP_WC_REM_ACCESS_ERR);
		free_side(&a);
		free_side(&b);
	}

	/* ---- CQ overrun: more completions than the CQ holds is EOVERFLOW, not corruption ---- */
	{
		struct side a, b;
		pair(f, &a, &b);
		struct bp_cq *small = bp_create_cq(a.ctx, 4, NULL, NULL, 0);
		struct bp_qp *sq = make_qp(a.pd, small, BP_QPT_RC);
		CHECK(connect_qp(sq, 2, b.qp->qp_num) == 0);
		struct bp_sge g = { .addr = 0, .length = 8, .lkey = a.mr->lkey };
		struct bp_send_wr w = { .sg_list = &g, .num_sge = 1, .opcode = BP_WR_RDMA_WRITE,
					.send_flags = BP_SEND_SIGNALED };
		w.wr.rdma.rkey = b.mr->rkey;
		for (int i = 0; i < 4; i++) {
			w.wr_id = i;
			CHECK(bp_post_send(sq, &w, &bad_s) == 0);
		}
		struct bp_wc four[4];
		CHECK(bp_poll_cq(small, 4, four) == 4 && four[3].wr_id == 3); /* full is fine */
		for (int i = 0; i < 6; i++) {
			w.wr_id = 10 + i;
			CHECK(bp_post_send(sq, &w, &bad_s) == 0);
		}
		CHECK(bp_poll_cq(small, 4, four) == -1 && errno == EOVERFLOW &&
		      strstr(bp_last_error(), "overrun") != NULL);
		CHECK(bp_poll_cq(small, 4, four) == -1 && errno == EOVERFLOW); /* stays in error */
		CHECK(bp_poll_cq(a.cq, -1, four) == -1 && errno == EINVAL);
		CHECK(bp_destroy_qp(sq) == 0 && bp_destroy_cq(small) == 0);
		free_side(&a);
		free_side(&b);
	}

	/* ---- UD: a datagram through an address handle; a destroyed AH is refused ---- */
	{
		struct side a, b;
		make_side(f, 1, &a);
		make_side(f, 2, &b);
		struct bp_qp *uq[2] = { make_qp(a.pd, a.cq, BP_QPT_UD), make_qp(b.pd, b.cq, BP_QPT_UD) };
		for (int i = 0; i < 2; i++) {
			struct bp_qp_attr u = { .qp_state = BP_QPS_INIT, .port_num = 1, .qkey = 0x77 };
			CHECK(bp_modify_qp(uq[i], &u, BP_QP_STATE | BP_QP_PKEY_INDEX | BP_QP_PORT |
							      BP_QP_QKEY) == 0);
			u.qp_state = BP_QPS_RTR;
			CHECK(bp_modify_qp(uq[i], &u, BP_QP_STATE) == 0);
			u.qp_state = BP_QPS_RTS;
			CHECK(bp_modify_qp(uq[i], &u, BP_QP_STATE | BP_QP_SQ_PSN) == 0);
		}
		struct bp_sge rs = { .addr = 0, .length = 128, .lkey = b.mr->lkey };
		struct bp_recv_wr r = { .wr_id = 5, .sg_list = &rs, .num_sge = 1 };
		CHECK(bp_post_recv(uq[1], &r, &bad_r) == 0);
		struct bp_ah_attr to2 = { .dlid = 2, .port_num = 1 };
		struct bp_ah *ah2 = bp_create_ah(a.pd, &to2);
		CHECK(ah2 != NULL);
		memcpy(a.mr->addr, "udmsg", 5);
		struct bp_sge ss = { .addr = 0, .length = 5, .lkey = a.mr->lkey };
		struct bp_send_wr w = { .wr_id = 6, .sg_list = &ss, .num_sge = 1,
					.opcode = BP_WR_SEND, .send_flags = BP_SEND_SIGNALED };
		w.wr.ud.ah = ah2;
		w.wr.ud.remote_qpn = uq[1]->qp_num;
		w.wr.ud.remote_qkey = 0x77;
		CHECK(bp_post_send(uq[0], &w, &bad_s) == 0);
		CHECK(next_wc(a.cq, b.cq, &wc) == 1 && wc.wr_id == 6 && wc.status == BP_WC_SUCCESS);
		CHECK(next_wc(b.cq, a.cq, &wc) == 1 && wc.wr_id == 5 && wc.status == BP_WC_SUCCESS &&
		      wc.byte_len == 40 + 5 && (wc.wc_flags & BP_WC_GRH) && wc.slid == 1 &&
		      wc.src_qp == uq[0]->qp_num &&
		      memcmp((char *)b.mr->addr + 40, "udmsg", 5) == 0);
		CHECK(bp_destroy_ah(ah2) == 0);
		bad_s = NULL;
		CHECK(bp_post_send(uq[0], &w, &bad_s) == EBADF && bad_s == &w);
		CHECK(bp_destroy_qp(uq[0]) == 0 && bp_destroy_qp(uq[1]) == 0);
		free_side(&a);
		free_side(&b);
	}

	/* ---- a thread that exits with objects alive takes them with it ---- */
	CHECK(pthread_create(&th, NULL, leaky_thread, f) == 0 && pthread_join(th, &ok) == 0);
	CHECK(ok == (void *)1);

	/* ---- address handles ---- */
	struct bp_ah_attr aa = { .dlid = 9, .port_num = 1 };
	CHECK(bp_create_ah(pd, &aa) == NULL && errno == EINVAL);
	aa.dlid = 2;
	struct bp_ah *ah = bp_create_ah(pd, &aa);
	CHECK(ah != NULL);
	CHECK(bp_dealloc_pd(pd) == EBUSY);
	CHECK(bp_destroy_ah(ah) == 0);

	/* ---- connection helper errors ---- */
	struct bp_conn_param cp = { .private_data_len = 57 };
	CHECK(bp_connect(ctx, 2, 9999, qp, &cp, NULL, 10) == EINVAL);
	CHECK(bp_connect(ctx, 2, 9999, qp, NULL, NULL, -5) == EINVAL);

	/* ---- shared receive queues ---- */
	shared_receive_queue(f);

	/* ---- tear down; then every handle is stale ---- */
	CHECK(bp_destroy_qp(qp) == 0);
	CHECK(bp_destroy_qp(qp) == EBADF);
	CHECK(bp_dereg_mr(mr) == 0 && bp_dereg_mr(mr) == EBADF);
	CHECK(bp_destroy_cq(cq) == 0 && ch->refcnt == 0);
	CHECK(bp_poll_cq(cq, 1, &wc) == -1 && errno == EBADF);
	CHECK(bp_destroy_comp_channel(ch) == 0);
	CHECK(bp_dealloc_pd(pd) == 0 && bp_dealloc_pd(pd) == EBADF);
	CHECK(bp_close_device(ctx) == 0);
	CHECK(bp_alloc_pd(ctx) == NULL && errno == EBADF);
	CHECK(bp_fabric_detach(f) == 0);

	printf("verbs_errors: %d checks, %d failed\n", checks, failures);
	return failures != 0;
}
