/* perftest's latency and bandwidth loops over plain libibverbs, with the knobs that tell where
 * the time goes — the probe behind the README's "Unmodified libibverbs programs" findings. Run it
 * with backplane's drop-in library (`backplane exec --verbs`) or any other provider.
 *
 *   server: backplane exec --name F --verbs 1 -- perftest_loops -t write
 *   client: backplane exec --name F --verbs 2 -- perftest_loops -t write localhost
 *
 * -t write  run_iter_lat_write: wait for the peer's byte, TSC read, store the byte, post a
 *           signaled 8-byte inline RDMA WRITE, poll its completion (the server sends first)
 * -t send   run_iter_lat_send: poll the receive CQ for the peer's message, post the receive
 *           again, TSC read, post a signaled 8-byte inline SEND, poll its completion (the
 *           client sends first; receives on a CQ of their own)
 * -t post   no ping-pong: the client posts signaled 8-byte operations (-o write|read|fadd)
 *           and polls each one's completion, and prints the time per post + poll
 * -t bw     run_iter_bw: the client keeps 128 requests outstanding, every 100th (and the
 *           last) signaled (perftest's --cq-mod), 8-byte inline RDMA WRITEs (-o write) or
 *           4 KiB SENDs (-o send; the server reposts its receives); it prints what the first
 *           post took, the time per post over the first 100 and over the rest, and the rate
 *           from the first post to the last completion (what perftest reports) — the
 *           first-time costs of a short run (README, "Short runs pay two first-time costs")
 * -P        write: PAUSE in the wait for the peer's byte (perftest's wait has none)
 * -n N      iterations (default 100000)
 * -p PORT   TCP port of the exchange (default 18515, perftest's)
 *
 * The client prints the median one-way latency (half the time between consecutive TSC reads,
 * as perftest computes it) in nanoseconds, the TSC calibrated against CLOCK_MONOTONIC. Build:
 * cc -O2 perftest_loops.c -libverbs -o perftest_loops */
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <x86intrin.h>

struct dest {
	uint32_t lid, qpn, rkey;
	uint64_t addr;
};

static void die(const char *what)
{
	fprintf(stderr, "perftest_loops: %s\n", what);
	exit(1);
}

/* Exchanges `me` for the peer's over TCP; the socket stays open to say "done". */
static int exchange(const char *host, int port, const struct dest *me, struct dest *peer)
{
	int fd = -1;
	if (host) {
		struct addrinfo hints = { .ai_family = AF_INET, .ai_socktype = SOCK_STREAM }, *ai;
		char p[16];
		snprintf(p, sizeof p, "%d", port);
		if (getaddrinfo(host, p, &hints, &ai))
			die("cannot resolve the server's name");
		for (int i = 0;; i++) {
			fd = socket(AF_INET, SOCK_STREAM, 0);
			if (!connect(fd, ai->ai_addr, ai->ai_addrlen))
				break;
			close(fd);
			if (i > 250)
				die("cannot reach the server");
			usleep(20000);
		}
		freeaddrinfo(ai);
	} else {
		struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
		int one = 1, l = socket(AF_INET, SOCK_STREAM, 0);
		setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
		if (bind(l, (void *)&a, sizeof a) || listen(l, 1))
			die("cannot listen on the port");
		fd = accept(l, NULL, NULL);
		close(l);
	}
	if (fd < 0 || write(fd, me, sizeof *me) != sizeof *me || read(fd, peer, sizeof *peer) != sizeof *peer)
		die("the exchange with the peer failed");
	return fd;
}

static void sync_peer(int fd)
{
	char c = 'x';
	if (write(fd, &c, 1) != 1 || read(fd, &c, 1) != 1)
		die("the peer went away");
}

static void poll_one(struct ibv_cq *cq, enum ibv_wc_opcode op)
{
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	if (n < 0 || wc.status != IBV_WC_SUCCESS || wc.opcode != op)
		die("a work request failed");
}

static int cmp(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* TSC ticks per nanosecond, measured over 50 ms. */
static double tsc_per_ns(void)
{
	struct timespec a, b;
	clock_gettime(CLOCK_MONOTONIC, &a);
	uint64_t t0 = __rdtsc();
	do
		clock_gettime(CLOCK_MONOTONIC, &b);
	while ((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec) < 50000000L);
	uint64_t t1 = __rdtsc();
	return (double)(t1 - t0) / ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec));
}

int main(int argc, char **argv)
{
	const char *test = "write", *op = "write";
	int pause = 0, c, port = 18515;
	long n = 100000;
	while ((c = getopt(argc, argv, "t:o:n:p:P")) != -1) {
		if (c == 't')
			test = optarg;
		else if (c == 'o')
			op = optarg;
		else if (c == 'n')
			n = atol(optarg);
		else if (c == 'p')
			port = atoi(optarg);
		else if (c == 'P')
			pause = 1;
		else
			die("usage: perftest_loops [-t write|send|post|bw] [-o write|read|fadd|send] [-n N] [-p PORT] [-P] [SERVER]");
	}
	if (n < 2)
		die("-n is at least 2");
	const char *host = optind < argc ? argv[optind] : NULL;
	int client = host != NULL;
	int send = !strcmp(test, "send"), post = !strcmp(test, "post"), bw = !strcmp(test, "bw");
	int bw_send = bw && !strcmp(op, "send");
	if (!send && !post && !bw && strcmp(test, "write"))
		die("-t is write, send, post or bw");
	if (bw && !bw_send && strcmp(op, "write"))
		die("-t bw takes -o write or -o send");
	if (bw && n <= 101)
		die("-t bw needs -n above 101");

	struct ibv_device **dl = ibv_get_device_list(NULL);
	struct ibv_context *ctx = dl && dl[0] ? ibv_open_device(dl[0]) : NULL;
	struct ibv_pd *pd = ctx ? ibv_alloc_pd(ctx) : NULL;
	struct ibv_port_attr pa;
	if (!pd || ibv_query_port(ctx, 1, &pa))
		die("no RDMA device");
	/* Page 0: what we send and write; page 1: what the peer writes and we receive. */
	char *buf = aligned_alloc(4096, 8192);
	memset(buf, 0, 8192);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 8192, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
				       IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	struct ibv_cq *cq = ibv_create_cq(ctx, 1024, NULL, NULL, 0);
	struct ibv_cq *rcq = ibv_create_cq(ctx, 1024, NULL, NULL, 0);
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 128, .max_recv_wr = 512, .max_send_sge = 1, .max_recv_sge = 1,
			 .max_inline_data = 64 } };
	struct ibv_qp *qp = mr && cq && rcq ? ibv_create_qp(pd, &ia) : NULL;
	if (!qp)
		die("cannot create the MR, CQs or QP");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
		.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		die("INIT failed");
	struct ibv_sge rs = { (uintptr_t)buf + 4096, bw_send ? 4096 : 8, mr->lkey };
	struct ibv_recv_wr rw = { .sg_list = &rs, .num_sge = 1 }, *rbad;
	for (int i = 0; (send || bw_send) && i < 512; i++)
		if (ibv_post_recv(qp, &rw, &rbad))
			die("cannot post the receives");
	struct dest me = { pa.lid, qp->qp_num, mr->rkey, (uintptr_t)buf + 4096 }, peer;
	int fd = exchange(host, port, &me, &peer);
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = peer.qpn;
	a.max_dest_rd_atomic = 16;
	a.min_rnr_timer = 12;
	a.ah_attr.dlid = peer.lid;
	a.ah_attr.port_num = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
			  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		die("RTR failed");
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 16;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
			  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		die("RTS failed");
	sync_peer(fd);

	struct ibv_sge ss = { (uintptr_t)buf, 8, mr->lkey };
	struct ibv_send_wr wr = { .sg_list = &ss, .num_sge = 1, .send_flags = IBV_SEND_SIGNALED }, *bad;
	enum ibv_wc_opcode done = IBV_WC_RDMA_WRITE;
	if (send || bw_send) {
		wr.opcode = IBV_WR_SEND;
		done = IBV_WC_SEND;
		if (bw_send)
			ss.length = 4096;
	} else if (post && !strcmp(op, "read")) {
		wr.opcode = IBV_WR_RDMA_READ;
		ss.addr = (uintptr_t)buf + 4096;
		done = IBV_WC_RDMA_READ;
	} else if (post && !strcmp(op, "fadd")) {
		wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
		wr.wr.atomic.remote_addr = peer.addr;
		wr.wr.atomic.rkey = peer.rkey;
		wr.wr.atomic.compare_add = 1;
		ss.addr = (uintptr_t)buf + 4096;
		done = IBV_WC_FETCH_ADD;
	} else {
		wr.opcode = IBV_WR_RDMA_WRITE;
	}
	if (wr.opcode == IBV_WR_RDMA_WRITE || wr.opcode == IBV_WR_RDMA_READ) {
		wr.wr.rdma.remote_addr = peer.addr;
		wr.wr.rdma.rkey = peer.rkey;
	}
	if ((wr.opcode == IBV_WR_RDMA_WRITE || wr.opcode == IBV_WR_SEND) && !bw_send)
		wr.send_flags |= IBV_SEND_INLINE;

	uint64_t *t = calloc(n, sizeof *t), *tc = calloc(n, sizeof *tc);
	volatile char *post_buf = buf + 7, *poll_buf = buf + 4096 + 7;
	if (bw && client) {
		/* run_iter_bw: post while fewer than 128 are outstanding, then poll up to 16. */
		long scnt = 0, ccnt = 0;
		struct ibv_wc wcs[16];
		int base = wr.send_flags & ~IBV_SEND_SIGNALED;
		while (ccnt < n) {
			while (scnt < n && scnt - ccnt < 128) {
				wr.send_flags = base;
				if ((scnt + 1) % 100 == 0 || scnt == n - 1)
					wr.send_flags |= IBV_SEND_SIGNALED;
				t[scnt] = __rdtsc();
				if (ibv_post_send(qp, &wr, &bad))
					die("post failed");
				scnt++;
			}
			int ne = ibv_poll_cq(cq, 16, wcs);
			if (ne < 0)
				die("poll failed");
			for (int k = 0; k < ne; k++) {
				if (wcs[k].status != IBV_WC_SUCCESS)
					die("a work request failed");
				uint64_t now = __rdtsc();
				for (long upto = ccnt + 100 < n ? ccnt + 100 : n; ccnt < upto; ccnt++)
					tc[ccnt] = now;
			}
		}
	} else if (bw) {
		/* The server: receives reposted as they complete (SENDs); nothing for WRITEs. */
		struct ibv_wc wcs[16];
		for (long got = 0; bw_send && got < n;) {
			int ne = ibv_poll_cq(rcq, 16, wcs);
			if (ne < 0)
				die("poll failed");
			for (int k = 0; k < ne; k++)
				if (wcs[k].status != IBV_WC_SUCCESS || ibv_post_recv(qp, &rw, &rbad))
					die("a receive failed");
			got += ne;
		}
	} else if (post) {
		if (client)
			for (long i = 0; i < n; i++) {
				t[i] = __rdtsc();
				if (ibv_post_send(qp, &wr, &bad))
					die("post failed");
				poll_one(cq, done);
			}
	} else if (!send) {
		/* run_iter_lat_write: the server writes first. */
		for (long i = 0; i < n; i++) {
			if (!(i == 0 && !client)) {
				char want = (char)(client ? i + 1 : i);
				if (pause)
					while (*poll_buf != want)
						_mm_pause();
				else
					while (*poll_buf != want)
						;
			}
			t[i] = __rdtsc();
			*post_buf = (char)(i + 1);
			if (ibv_post_send(qp, &wr, &bad))
				die("post failed");
			poll_one(cq, done);
		}
		if (!client)
			while (*poll_buf != (char)n)
				;
	} else {
		/* run_iter_lat_send: the client sends first. */
		for (long i = 0; i < n; i++) {
			if (!(i == 0 && client)) {
				poll_one(rcq, IBV_WC_RECV);
				if (ibv_post_recv(qp, &rw, &rbad))
					die("cannot post a receive");
			}
			t[i] = __rdtsc();
			if (ibv_post_send(qp, &wr, &bad))
				die("post failed");
			poll_one(cq, done);
		}
		if (client) {
			poll_one(rcq, IBV_WC_RECV);
			if (ibv_post_recv(qp, &rw, &rbad))
				die("cannot post a receive");
		}
	}
	sync_peer(fd);
	if (client && bw) {
		double per_us = tsc_per_ns() * 1000;
		long first = 101; /* -n is above it */
		printf("bw %s: first post %.1f us, posts 2-%ld %.2f us each, then %.3f us each, "
		       "%.2f Mpps first post to last completion\n",
		       op, (t[1] - t[0]) / per_us, first, (t[first] - t[1]) / per_us / (first - 1),
		       (t[n - 1] - t[first]) / per_us / (n - 1 - first > 0 ? n - 1 - first : 1),
		       n / ((tc[n - 1] - t[0]) / per_us));
	} else if (client) {
		/* The mean too: this VM's TSC advances in steps of ~10 ns, which the median jumps by. */
		double mean = (t[n - 1] - t[0]) / tsc_per_ns() / (n - 1);
		for (long i = 0; i + 1 < n; i++)
			t[i] = t[i + 1] - t[i];
		qsort(t, n - 1, sizeof *t, cmp);
		double per_ns = tsc_per_ns(), median = t[(n - 1) / 2] / per_ns;
		if (post)
			printf("%s: %.1f ns per post + poll (median of %ld; mean %.1f)\n", op, median,
			       n - 1, mean);
		else
			printf("%s%s: %.1f ns one way (median of %ld round trips / 2)\n", test,
			       pause ? " with PAUSE" : "", median / 2, n - 1);
	}
	ibv_destroy_qp(qp);
	ibv_destroy_cq(cq);
	ibv_destroy_cq(rcq);
	ibv_dereg_mr(mr);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(dl);
	return 0;
}
