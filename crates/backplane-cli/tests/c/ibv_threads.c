/* Several threads on one libibverbs context at the same time, as a multi-threaded RDMA
 * program uses it: each thread has its own CQ and a pair of RC QPs connected to each other
 * (this node to itself), and runs RDMA WRITEs, READs and SENDs through them, checking every
 * byte. The drop-in library makes a context's calls one at a time with a lock biased towards
 * the first thread (here the main thread, which opens the context and then works like the
 * others); the other threads revoke the bias while it is running.
 * Exit 0 when every operation completed with success and moved the right bytes.
 *
 * usage: ibv_threads THREADS ITERATIONS */
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "connect_rc.h"

#define SIZE 256

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static uint16_t lid;
static long iters;
static pthread_barrier_t start;

/* Waits for one completion of `op` on `cq`; anything else is a failure. */
static int wait_one(struct ibv_cq *cq, enum ibv_wc_opcode op, long id)
{
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	if (n < 0 || wc.status != IBV_WC_SUCCESS || wc.opcode != op || (long)wc.wr_id != id) {
		fprintf(stderr, "ibv_threads: completion n=%d status=%s opcode=%d wr_id=%ld (want %d, %ld)\n",
			n, n > 0 ? ibv_wc_status_str(wc.status) : "-", n > 0 ? (int)wc.opcode : -1,
			n > 0 ? (long)wc.wr_id : -1, op, id);
		return -1;
	}
	return 0;
}

static void *run(void *arg)
{
	long t = (long)arg;
	/* [0, SIZE): source; [SIZE, 2 SIZE): written and read by the peer QP; [2 SIZE, 3 SIZE):
	 * READ results and receives. */
	unsigned char *buf = aligned_alloc(4096, 4096);
	struct ibv_mr *mr = buf ? ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE |
			IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ) : NULL;
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!mr || !cq) {
		fprintf(stderr, "ibv_threads: thread %ld: no MR or CQ\n", t);
		exit(1);
	}
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *a = ibv_create_qp(pd, &ia), *b = ibv_create_qp(pd, &ia);
	if (!a || !b || connect_rc(a, b->qp_num, lid) || connect_rc(b, a->qp_num, lid)) {
		fprintf(stderr, "ibv_threads: thread %ld: cannot connect its QPs\n", t);
		exit(1);
	}
	struct ibv_sge src = { (uintptr_t)buf, SIZE, mr->lkey };
	struct ibv_sge dst = { (uintptr_t)buf + 2 * SIZE, SIZE, mr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 0, .sg_list = &dst, .num_sge = 1 }, *rbad;
	struct ibv_send_wr *bad;
	/* Every thread set up, then all of them at once. */
	pthread_barrier_wait(&start);
	for (long i = 0; i < iters; i++) {
		unsigned char v = (unsigned char)(t * 31 + i);
		memset(buf, v, SIZE);
		/* WRITE a -> b's [SIZE, 2 SIZE) */
		struct ibv_send_wr w = { .wr_id = 3 * i, .sg_list = &src, .num_sge = 1,
			.opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED };
		w.wr.rdma.remote_addr = (uintptr_t)buf + SIZE;
		w.wr.rdma.rkey = mr->rkey;
		if (ibv_post_send(a, &w, &bad) || wait_one(cq, IBV_WC_RDMA_WRITE, 3 * i))
			return (void *)1;
		/* READ it back through b into [2 SIZE, 3 SIZE) */
		memset(buf + 2 * SIZE, 0, SIZE);
		struct ibv_send_wr r = { .wr_id = 3 * i + 1, .sg_list = &dst, .num_sge = 1,
			.opcode = IBV_WR_RDMA_READ, .send_flags = IBV_SEND_SIGNALED };
		r.wr.rdma.remote_addr = (uintptr_t)buf + SIZE;
		r.wr.rdma.rkey = mr->rkey;
		if (ibv_post_send(b, &r, &bad) || wait_one(cq, IBV_WC_RDMA_READ, 3 * i + 1))
			return (void *)1;
		for (int k = 0; k < SIZE; k++)
			if (buf[SIZE + k] != v || buf[2 * SIZE + k] != v) {
				fprintf(stderr, "ibv_threads: thread %ld iteration %ld: byte %d is %u/%u, not %u\n",
					t, i, k, buf[SIZE + k], buf[2 * SIZE + k], v);
				return (void *)1;
			}
		/* SEND a -> b, received into [2 SIZE, 3 SIZE) */
		memset(buf + 2 * SIZE, 0, SIZE);
		memset(buf, (unsigned char)~v, SIZE);
		struct ibv_send_wr s = { .wr_id = 3 * i + 2, .sg_list = &src, .num_sge = 1,
			.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
		if (ibv_post_recv(b, &rwr, &rbad) || ibv_post_send(a, &s, &bad))
			return (void *)1;
		/* Both completions, in either order. */
		int got_send = 0, got_recv = 0;
		while (!got_send || !got_recv) {
			struct ibv_wc wc;
			int n = ibv_poll_cq(cq, 1, &wc);
			if (n == 0)
				continue;
			if (n < 0 || wc.status != IBV_WC_SUCCESS) {
				fprintf(stderr, "ibv_threads: thread %ld: SEND/RECV failed\n", t);
				return (void *)1;
			}
			got_send |= wc.opcode == IBV_WC_SEND;
			got_recv |= wc.opcode == IBV_WC_RECV && wc.byte_len == SIZE;
		}
		for (int k = 0; k < SIZE; k++)
			if (buf[2 * SIZE + k] != (unsigned char)~v) {
				fprintf(stderr, "ibv_threads: thread %ld iteration %ld: received byte %d wrong\n",
					t, i, k);
				return (void *)1;
			}
	}
	if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_destroy_cq(cq) || ibv_dereg_mr(mr))
		return (void *)1;
	free(buf);
	return NULL;
}

int main(int argc, char **argv)
{
	int threads = argc > 1 ? atoi(argv[1]) : 4;
	iters = argc > 2 ? atol(argv[2]) : 1000;
	struct ibv_device **dl = ibv_get_device_list(NULL);
	if (!dl || !dl[0]) {
		fprintf(stderr, "ibv_threads: no device\n");
		return 1;
	}
	ctx = ibv_open_device(dl[0]);
	pd = ctx ? ibv_alloc_pd(ctx) : NULL;
	struct ibv_port_attr pa;
	if (!pd || ibv_query_port(ctx, 1, &pa)) {
		fprintf(stderr, "ibv_threads: cannot open the device\n");
		return 1;
	}
	lid = pa.lid;
	pthread_t th[64];
	if (threads < 1 || threads > 64)
		return 2;
	pthread_barrier_init(&start, NULL, threads);
	/* The main thread, which opened the context (and so owns the lock's bias), works too. */
	for (long t = 1; t < threads; t++)
		pthread_create(&th[t], NULL, run, (void *)t);
	int bad = run((void *)0) != NULL;
	for (int t = 1; t < threads; t++) {
		void *r;
		pthread_join(th[t], &r);
		bad |= r != NULL;
	}
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(dl);
	if (!bad)
		printf("ibv_threads: %d threads x %ld iterations of WRITE, READ, SEND: all bytes right\n",
		       threads, iters);
	return bad;
}
