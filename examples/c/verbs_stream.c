/*
 * A SEND/RECV stream between two nodes over an RC queue pair, printing bandwidth.
 *
 *   verbs_stream server NODE PORT COUNT SIZE              receive COUNT messages of SIZE bytes
 *   verbs_stream client NODE SERVER_NODE PORT COUNT SIZE  send them
 *
 * The server keeps RECV_DEPTH receives posted (each one SIZE bytes of its region) and checks
 * that messages arrive whole and in order; the client sends from a ring of slots, signaling
 * one send in SIGNAL_EVERY and reusing a slot only once the send that used it is complete.
 * The fabric is $BACKPLANE_FABRIC (or "default"). Build:
 *   cc verbs_stream.c $(pkg-config --cflags --libs backplane) -o verbs_stream
 */
#include <backplane/verbs.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RECV_DEPTH 64
#define SEND_DEPTH 64
#define SLOTS (SEND_DEPTH + 1) /* a slot is rewritten only after SEND_DEPTH later posts */
#define SIGNAL_EVERY 16

static int die(const char *what)
{
	fprintf(stderr, "verbs_stream: %s: %s (errno %d)\n", what, bp_last_error(), errno);
	exit(1);
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

struct conn {
	struct bp_context *ctx;
	struct bp_pd *pd;
	struct bp_cq *cq;
	struct bp_qp *qp;
	struct bp_mr *mr;
};

static void post_recv(struct conn *c, uint64_t slot, size_t size)
{
	struct bp_sge sge = { .addr = slot * size, .length = size, .lkey = c->mr->lkey };
	struct bp_recv_wr wr = { .wr_id = slot, .sg_list = &sge, .num_sge = 1 }, *bad;
	int rc = bp_post_recv(c->qp, &wr, &bad);
	if (rc) {
		errno = rc;
		die("post_recv");
	}
}

static void check(const struct bp_wc *wc)
{
	if (wc->status != BP_WC_SUCCESS) {
		fprintf(stderr, "verbs_stream: completion %llu: %s\n",
			(unsigned long long)wc->wr_id, bp_wc_status_str(wc->status));
		exit(1);
	}
}

int main(int argc, char **argv)
{
	int server = argc == 6 && strcmp(argv[1], "server") == 0;
	int client = argc == 7 && strcmp(argv[1], "client") == 0;
	if (!server && !client) {
		fprintf(stderr, "usage: %s server NODE PORT COUNT SIZE | "
				"client NODE SERVER_NODE PORT COUNT SIZE\n",
			argv[0]);
		return 2;
	}
	uint32_t node = atoi(argv[2]);
	uint32_t port = atoi(argv[server ? 3 : 4]);
	long count = atol(argv[server ? 4 : 5]);
	size_t size = atol(argv[server ? 5 : 6]);
	if (count < 1 || size < 2)
		return 2;

	struct bp_fabric *f = bp_fabric_attach(NULL);
	if (!f)
		die("attach");
	struct conn c = { 0 };
	size_t slots = server ? RECV_DEPTH : SLOTS;
	if (!(c.ctx = bp_open_device(f, node)) || !(c.pd = bp_alloc_pd(c.ctx)))
		die("open_device");
	if (!(c.cq = bp_create_cq(c.ctx, 2 * RECV_DEPTH, NULL, NULL, 0)))
		die("create_cq");
	if (!(c.mr = bp_reg_mr(c.pd, NULL, slots * size, BP_ACCESS_LOCAL_WRITE)))
		die("reg_mr");
	struct bp_qp_init_attr init = {
		.send_cq = c.cq, .recv_cq = c.cq, .qp_type = BP_QPT_RC,
		.cap = { .max_send_wr = SEND_DEPTH, .max_recv_wr = RECV_DEPTH },
		.ring_bytes = 4 << 20, /* extension: keep more SEND data in flight */
	};
	if (!(c.qp = bp_create_qp(c.pd, &init)))
		die("create_qp");
	struct bp_qp_attr a = { .qp_state = BP_QPS_INIT, .port_num = 1 };
	if (bp_modify_qp(c.qp, &a, BP_QP_STATE | BP_QP_PKEY_INDEX | BP_QP_PORT | BP_QP_ACCESS_FLAGS))
		die("modify_qp INIT");

	double t0 = 0, t1 = 0;
	if (server) {
		for (int i = 0; i < RECV_DEPTH; i++)
			post_recv(&c, i, size);
		struct bp_listener *l = bp_listen(c.ctx, port);
		if (!l || bp_accept(l, c.qp, NULL, NULL, 30000))
			die("accept");
		bp_destroy_listener(l);
		long got = 0;
		unsigned long long bytes = 0;
		double idle = now() + 10;
		while (got < count) {
			struct bp_wc wc[16];
			int n = bp_poll_cq(c.cq, 16, wc);
			if (n < 0)
				die("poll_cq");
			if (n > 0) {
				idle = now() + 10;
			} else if (now() > idle) {
				fprintf(stderr, "verbs_stream: nothing for 10 s after %ld messages\n", got);
				return 1;
			}
			for (int i = 0; i < n; i++) {
				check(&wc[i]);
				const unsigned char *m =
					(const unsigned char *)c.mr->addr + wc[i].wr_id * size;
				unsigned char want = (unsigned char)got;
				if (wc[i].byte_len != size || m[0] != want || m[size - 1] != want) {
					fprintf(stderr, "verbs_stream: message %ld is not what was sent\n",
						got);
					return 1;
				}
				if (got == 0)
					t0 = now();
				got++;
				bytes += wc[i].byte_len;
				post_recv(&c, wc[i].wr_id, size);
			}
		}
		t1 = now();
		/* The first message starts the clock: count the rest. */
		double mb = (double)(bytes - size) / 1e6;
		printf("server: received %ld x %zu B in order, %.0f MB/s\n", got, size,
		       count > 1 ? mb / (t1 - t0) : 0.0);
	} else {
		if (bp_connect(c.ctx, atoi(argv[3]), port, c.qp, NULL, NULL, 30000))
			die("connect");
		unsigned char *base = c.mr->addr;
		t0 = now();
		for (long i = 0; i < count; i++) {
			unsigned char *m = base + (i % SLOTS) * size;
			m[0] = m[size - 1] = (unsigned char)i;
			struct bp_sge sge = { .addr = (i % SLOTS) * size, .length = size,
					      .lkey = c.mr->lkey };
			int last = i == count - 1;
			struct bp_send_wr wr = {
				.wr_id = i, .sg_list = &sge, .num_sge = 1, .opcode = BP_WR_SEND,
				.send_flags = (i % SIGNAL_EVERY == SIGNAL_EVERY - 1 || last)
						      ? BP_SEND_SIGNALED : 0,
			}, *bad;
			int rc;
			/* ENOMEM: the send queue is full; polling moves it along. */
			while ((rc = bp_post_send(c.qp, &wr, &bad)) == ENOMEM) {
				struct bp_wc wc[8];
				int n = bp_poll_cq(c.cq, 8, wc);
				if (n < 0)
					die("poll_cq");
				for (int k = 0; k < n; k++)
					check(&wc[k]);
			}
			if (rc) {
				errno = rc;
				die("post_send");
			}
			/* Take the completions of signaled sends as they come, so the CQ never
			 * holds more than the few that can be outstanding (an overrun is an error). */
			if (wr.send_flags & BP_SEND_SIGNALED) {
				struct bp_wc wc[8];
				int n = bp_poll_cq(c.cq, 8, wc);
				if (n < 0)
					die("poll_cq");
				for (int k = 0; k < n; k++)
					check(&wc[k]);
			}
		}
		/* RC completes in order: the last (signaled) send done means all are. */
		for (;;) {
			struct bp_wc wc;
			int n = bp_poll_cq(c.cq, 1, &wc);
			if (n < 0)
				die("poll_cq");
			if (n == 1) {
				check(&wc);
				if (wc.wr_id == (uint64_t)count - 1)
					break;
			}
			if (now() - t0 > 60) {
				fprintf(stderr, "verbs_stream: the last send did not complete\n");
				return 1;
			}
		}
		t1 = now();
		printf("client: sent %ld x %zu B in %.3f s, %.0f MB/s\n", count, size, t1 - t0,
		       (double)count * size / 1e6 / (t1 - t0));
	}
	if (bp_destroy_qp(c.qp) || bp_dereg_mr(c.mr) || bp_destroy_cq(c.cq) ||
	    bp_dealloc_pd(c.pd) || bp_close_device(c.ctx) || bp_fabric_detach(f))
		die("teardown");
	return 0;
}
