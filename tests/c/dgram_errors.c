/*
 * The C boundary's error paths: every bad call returns an error with the documented errno,
 * nothing crashes, nothing leaks (run under AddressSanitizer/UBSan by scripts/test-c.sh).
 * Needs a running fabric of at least 2 nodes named by $BACKPLANE_FABRIC.
 */
#include <backplane/dgram.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int passed, failed;

#define CHECK(cond, what)                                                                    \
	do {                                                                                 \
		if (cond) {                                                                  \
			passed++;                                                            \
		} else {                                                                     \
			failed++;                                                            \
			fprintf(stderr, "FAIL %s:%d %s (errno %d: %s)\n", __FILE__, __LINE__, what, \
				errno, bp_last_error());                                     \
		}                                                                            \
	} while (0)

#define EXPECT_ERR(call, err) CHECK((call) == -1 && errno == (err), #call " -> " #err)

/* What bp_dgram_recv_many's reader saw. */
struct seen {
	int n;
	size_t lens[8];
	unsigned char first[8];
	uint32_t src_node;
};

static int take_all(void *ctx, const struct bp_addr *src, const void *payload, size_t len)
{
	struct seen *s = ctx;
	if (s && s->n < 8) {
		s->lens[s->n] = len;
		s->first[s->n] = len ? *(const unsigned char *)payload : 0;
		s->src_node = src->node;
		s->n++;
	}
	return 0;
}

static int leave_all(void *ctx, const struct bp_addr *src, const void *payload, size_t len)
{
	(void)ctx, (void)src, (void)payload, (void)len;
	return 1;
}

int main(void)
{
	char buf[256];
	struct bp_addr a;

	errno = 0;
	CHECK(bp_fabric_attach("no-such-fabric-c") == NULL && errno == ENOENT, "attach unknown");
	CHECK(bp_fabric_attach("bad/name") == NULL && errno == EINVAL, "attach bad name");
	EXPECT_ERR(bp_fabric_nodes(NULL), EBADF);
	CHECK(bp_dgram_bind(NULL, 1, 1) == NULL && errno == EBADF, "bind on NULL fabric");
	EXPECT_ERR(bp_dgram_close(NULL), EBADF);
	EXPECT_ERR(bp_dgram_close((struct bp_endpoint *)0x12345678), EBADF);
	EXPECT_ERR(bp_dgram_send(NULL, a, buf, 1, 0), EBADF);
	EXPECT_ERR(bp_dgram_recv(NULL, buf, sizeof buf, NULL, NULL, 0), EBADF);
	EXPECT_ERR(bp_dgram_stats(NULL, NULL), EBADF);
	CHECK(strlen(bp_last_error()) > 0, "bp_last_error says why");

	struct bp_fabric *f = bp_fabric_attach(NULL);
	CHECK(f != NULL, "attach $BACKPLANE_FABRIC");
	if (!f)
		return 1;
	CHECK(bp_fabric_nodes(f) >= 2, "nodes");
	CHECK(bp_dgram_bind(f, 999, 1) == NULL && errno == EINVAL, "bind on a node that does not exist");
	/* A fabric handle is not an endpoint handle. */
	EXPECT_ERR(bp_dgram_close((struct bp_endpoint *)f), EBADF);
	CHECK(bp_fabric_nodes(f) >= 2, "fabric still valid after the bogus close");

	struct bp_endpoint *rx = bp_dgram_bind(f, 2, 4242);
	struct bp_endpoint *tx = bp_dgram_bind(f, 1, 0);
	CHECK(rx && tx, "bind");
	CHECK(bp_dgram_bind(f, 2, 4242) == NULL && errno == EADDRINUSE, "port bound twice");
	EXPECT_ERR(bp_fabric_detach(f), EBUSY);
	EXPECT_ERR(bp_dgram_local_addr(rx, NULL), EINVAL);
	CHECK(bp_dgram_local_addr(rx, &a) == 0 && a.node == 2 && a.port == 4242, "local addr");

	struct bp_addr nobody = { 2, 777 };
	EXPECT_ERR(bp_dgram_send(tx, nobody, "x", 1, BP_NO_WAIT), ECONNREFUSED);
	EXPECT_ERR(bp_dgram_send(tx, a, NULL, 5, BP_NO_WAIT), EINVAL);
	EXPECT_ERR(bp_dgram_send(tx, a, "x", 1, -7), EINVAL);
	char *big = calloc(1, BP_MAX_DGRAM + 1);
	EXPECT_ERR(bp_dgram_send(tx, a, big, BP_MAX_DGRAM + 1, BP_NO_WAIT), EMSGSIZE);
	free(big);
	EXPECT_ERR(bp_dgram_recv(rx, buf, sizeof buf, NULL, NULL, BP_NO_WAIT), EAGAIN);
	EXPECT_ERR(bp_dgram_recv(rx, buf, sizeof buf, NULL, NULL, 20), ETIMEDOUT);

	memset(buf, 'z', 200);
	CHECK(bp_dgram_send(tx, a, buf, 200, BP_WAIT_FOREVER) == 0, "send 200");
	size_t needed = 0;
	char small[16];
	CHECK(bp_dgram_recv(rx, small, sizeof small, NULL, &needed, BP_NO_WAIT) == -1 &&
		      errno == EMSGSIZE && needed == 200,
	      "too small a buffer: EMSGSIZE and the size");
	struct bp_addr src;
	CHECK(bp_dgram_recv(rx, buf, sizeof buf, &src, NULL, BP_NO_WAIT) == 200 && src.node == 1,
	      "the datagram stayed queued");
	struct bp_dgram_stats st;
	CHECK(bp_dgram_stats(tx, &st) == 0 && st.sent == 1 && st.dropped == 1, "sender stats");
	CHECK(bp_dgram_stats(rx, &st) == 0 && st.received == 1 && st.received_bytes == 200,
	      "receiver stats");

	/* Many at once, in place: at most `max`, a datagram left stays next. */
	EXPECT_ERR(bp_dgram_recv_many(NULL, 4, BP_NO_WAIT, take_all, NULL), EBADF);
	EXPECT_ERR(bp_dgram_recv_many(rx, 4, BP_NO_WAIT, NULL, NULL), EINVAL);
	EXPECT_ERR(bp_dgram_recv_many(rx, 0, BP_NO_WAIT, take_all, NULL), EINVAL);
	EXPECT_ERR(bp_dgram_recv_many(rx, 4, BP_NO_WAIT, take_all, NULL), EAGAIN);
	for (int i = 1; i <= 3; i++) {
		memset(buf, i, (size_t)i);
		CHECK(bp_dgram_send(tx, a, buf, (size_t)i, BP_WAIT_FOREVER) == 0, "send for many");
	}
	struct seen s = { 0 };
	CHECK(bp_dgram_recv_many(rx, 2, BP_NO_WAIT, take_all, &s) == 2 && s.n == 2 &&
		      s.lens[0] == 1 && s.lens[1] == 2 && s.first[1] == 2,
	      "recv_many: the first two, in order");
	EXPECT_ERR(bp_dgram_recv_many(rx, 4, BP_NO_WAIT, leave_all, NULL), ECANCELED);
	CHECK(bp_dgram_recv_many(rx, 4, 1000, take_all, &s) == 1 && s.n == 3 && s.lens[2] == 3 &&
		      s.first[2] == 3 && s.src_node == 1,
	      "recv_many: the one left, still next");

	CHECK(bp_dgram_close(rx) == 0, "close");
	EXPECT_ERR(bp_dgram_close(rx), EBADF); /* stale handle */
	EXPECT_ERR(bp_dgram_send(rx, a, "x", 1, 0), EBADF);
	/* A stale handle never names an endpoint made after it was closed. */
	for (int i = 0; i < 100; i++) {
		struct bp_endpoint *again = bp_dgram_bind(f, 2, 4242);
		CHECK(again != NULL && again != rx, "a new endpoint gets a new handle");
		EXPECT_ERR(bp_dgram_close(rx), EBADF);
		CHECK(bp_dgram_close(again) == 0, "close the new endpoint");
	}
	CHECK(bp_dgram_close(tx) == 0, "close tx");
	CHECK(bp_fabric_detach(f) == 0, "detach");
	EXPECT_ERR(bp_fabric_detach(f), EBADF);
	struct bp_fabric *f2 = bp_fabric_attach(NULL);
	CHECK(f2 != NULL && f2 != f, "a new attach gets a new handle");
	EXPECT_ERR(bp_fabric_detach(f), EBADF);
	CHECK(bp_fabric_detach(f2) == 0, "detach the new one");

	printf("%d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
