/*
 * RDMA_WRITE_WITH_IMM ping-pong between two nodes, printing latency as perftest's
 * ib_write_lat does (half the round trip; t_typical is the median).
 *
 *   verbs_pingpong server NODE PORT ITERS SIZE            on one node
 *   verbs_pingpong client NODE SERVER_NODE PORT ITERS SIZE  on another
 *
 * Each side registers a region, the connection helper exchanges the rkeys and readies the RC
 * QPs, then the client writes SIZE bytes with an immediate into the server's region; the
 * server's receive completes (BP_WC_RECV_RDMA_WITH_IMM) and it writes back. The fabric is
 * $BACKPLANE_FABRIC (or "default"). Build:
 *   cc verbs_pingpong.c $(pkg-config --cflags --libs backplane) -o verbs_pingpong
 */
#include <backplane/verbs.h>
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define WARMUP 1000
#define RECV_DEPTH 16

static int die(const char *what)
{
	fprintf(stderr, "verbs_pingpong: %s: %s (errno %d)\n", what, bp_last_error(), errno);
	exit(1);
}

static double now_us(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

struct conn {
	struct bp_context *ctx;
	struct bp_pd *pd;
	struct bp_cq *cq;
	struct bp_qp *qp;
	struct bp_mr *mr;
	struct bp_peer_info peer;
};

/* Receives for WRITE_WITH_IMM carry no data: an empty scatter list is enough. */
static void post_recv(struct conn *c, uint64_t id)
{
	struct bp_recv_wr wr = { .wr_id = id }, *bad;
	int rc = bp_post_recv(c->qp, &wr, &bad);
	if (rc) {
		errno = rc;
		die("post_recv");
	}
}

static void write_imm(struct conn *c, size_t size, uint32_t seq, int signaled)
{
	struct bp_sge sge = { .addr = 0, .length = size, .lkey = c->mr->lkey };
	struct bp_send_wr wr = {
		.wr_id = seq,
		.sg_list = &sge,
		.num_sge = 1,
		.opcode = BP_WR_RDMA_WRITE_WITH_IMM,
		.send_flags = signaled ? BP_SEND_SIGNALED : 0,
		.imm_data = htonl(seq),
	};
	wr.wr.rdma.remote_addr = c->peer.addr;
	wr.wr.rdma.rkey = c->peer.rkey;
	struct bp_send_wr *bad;
	int rc = bp_post_send(c->qp, &wr, &bad);
	if (rc) {
		errno = rc;
		die("post_send");
	}
}

/* Waits for the peer's WRITE_WITH_IMM (send completions seen meanwhile are counted). */
static uint32_t wait_imm(struct conn *c, int *sends)
{
	double idle = now_us() + 10e6;
	for (;;) {
		struct bp_wc wc[4];
		int n = bp_poll_cq(c->cq, 4, wc);
		if (n < 0)
			die("poll_cq");
		if (n == 0 && now_us() > idle) {
			fprintf(stderr, "verbs_pingpong: no answer for 10 s\n");
			exit(1);
		}
		uint32_t imm = 0;
		int got = 0;
		for (int i = 0; i < n; i++) {
			if (wc[i].status != BP_WC_SUCCESS) {
				fprintf(stderr, "verbs_pingpong: completion %llu: %s\n",
					(unsigned long long)wc[i].wr_id,
					bp_wc_status_str(wc[i].status));
				exit(1);
			}
			if (wc[i].opcode == BP_WC_RECV_RDMA_WITH_IMM) {
				imm = ntohl(wc[i].imm_data);
				got = 1;
				post_recv(c, wc[i].wr_id);
			} else if (sends) {
				(*sends)++;
			}
		}
		if (got)
			return imm;
	}
}

int main(int argc, char **argv)
{
	int server = argc == 6 && strcmp(argv[1], "server") == 0;
	int client = argc == 7 && strcmp(argv[1], "client") == 0;
	if (!server && !client) {
		fprintf(stderr, "usage: %s server NODE PORT ITERS SIZE | "
				"client NODE SERVER_NODE PORT ITERS SIZE\n",
			argv[0]);
		return 2;
	}
	uint32_t node = atoi(argv[2]);
	uint32_t port = atoi(argv[server ? 3 : 4]);
	long iters = atol(argv[server ? 4 : 5]);
	size_t size = atol(argv[server ? 5 : 6]);
	if (iters < 1 || size < 1)
		return 2;

	struct bp_fabric *f = bp_fabric_attach(NULL);
	if (!f)
		die("attach");
	struct conn c = { 0 };
	if (!(c.ctx = bp_open_device(f, node)))
		die("open_device");
	if (!(c.pd = bp_alloc_pd(c.ctx)))
		die("alloc_pd");
	if (!(c.cq = bp_create_cq(c.ctx, 2 * RECV_DEPTH + 16, NULL, NULL, 0)))
		die("create_cq");
	if (!(c.mr = bp_reg_mr(c.pd, NULL, size,
			       BP_ACCESS_LOCAL_WRITE | BP_ACCESS_REMOTE_WRITE)))
		die("reg_mr");
	struct bp_qp_init_attr init = {
		.send_cq = c.cq, .recv_cq = c.cq, .qp_type = BP_QPT_RC,
		.cap = { .max_send_wr = 64, .max_recv_wr = RECV_DEPTH },
	};
	if (!(c.qp = bp_create_qp(c.pd, &init)))
		die("create_qp");
	/* INIT first, so the receives are there before the peer can write. */
	struct bp_qp_attr a = { .qp_state = BP_QPS_INIT, .port_num = 1,
				.qp_access_flags = BP_ACCESS_REMOTE_WRITE };
	if (bp_modify_qp(c.qp, &a, BP_QP_STATE | BP_QP_PKEY_INDEX | BP_QP_PORT |
					   BP_QP_ACCESS_FLAGS))
		die("modify_qp INIT");
	for (int i = 0; i < RECV_DEPTH; i++)
		post_recv(&c, i);
	struct bp_conn_param mine = { .rkey = c.mr->rkey, .addr = 0, .len = size };
	long total = iters + WARMUP;

	if (server) {
		struct bp_listener *l = bp_listen(c.ctx, port);
		if (!l)
			die("listen");
		if (bp_accept(l, c.qp, &mine, &c.peer, 30000))
			die("accept");
		bp_destroy_listener(l);
		for (long i = 0; i < total; i++) {
			uint32_t seq = wait_imm(&c, NULL);
			/* The last reply is signaled: wait until the client took it. */
			write_imm(&c, size, seq, i == total - 1 || i % 32 == 31);
		}
		int sends = 0;
		double end = now_us() + 10e6;
		while (sends == 0 && now_us() < end) {
			struct bp_wc wc;
			int n = bp_poll_cq(c.cq, 1, &wc);
			if (n < 0)
				die("poll_cq");
			if (n == 1 && wc.opcode == BP_WC_RDMA_WRITE && wc.wr_id == (uint64_t)total - 1)
				sends = 1;
		}
		if (!sends) {
			fprintf(stderr, "verbs_pingpong: the last reply was not taken\n");
			return 1;
		}
		printf("server: answered %ld round trips of %zu B\n", total, size);
	} else {
		if (bp_connect(c.ctx, atoi(argv[3]), port, c.qp, &mine, &c.peer, 30000))
			die("connect");
		double *lat = malloc(iters * sizeof *lat);
		if (!lat)
			return 1;
		int sends = 0;
		for (long i = 0; i < total; i++) {
			double t0 = now_us();
			write_imm(&c, size, (uint32_t)i, i % 32 == 31);
			uint32_t seq = wait_imm(&c, &sends);
			double t1 = now_us();
			if (seq != (uint32_t)i) {
				fprintf(stderr, "verbs_pingpong: reply %u to ping %ld\n", seq, i);
				return 1;
			}
			if (i >= WARMUP)
				lat[i - WARMUP] = (t1 - t0) / 2;
		}
		qsort(lat, iters, sizeof *lat, cmp);
		double sum = 0, sq = 0;
		for (long i = 0; i < iters; i++)
			sum += lat[i];
		double avg = sum / iters;
		for (long i = 0; i < iters; i++)
			sq += (lat[i] - avg) * (lat[i] - avg);
		printf(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]"
		       "    t_avg[usec]    t_stdev[usec]   99%% percentile[usec]"
		       "   99.9%% percentile[usec]\n");
		printf(" %-6zu %-10ld     %-10.2f     %-10.2f     %-10.2f       %-10.2f     "
		       "%-10.2f       %-10.2f              %-10.2f\n",
		       size, iters, lat[0], lat[iters - 1], lat[iters / 2], avg, sqrt(sq / iters),
		       lat[(long)(iters * 0.99)], lat[(long)(iters * 0.999)]);
		free(lat);
	}
	if (bp_destroy_qp(c.qp) || bp_dereg_mr(c.mr) || bp_destroy_cq(c.cq) ||
	    bp_dealloc_pd(c.pd) || bp_close_device(c.ctx) || bp_fabric_detach(f))
		die("teardown");
	return 0;
}
