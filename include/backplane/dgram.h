/*
 * backplane C API: fabrics and datagram endpoints.
 *
 * Link with: cc prog.c $(pkg-config --cflags --libs backplane)
 *
 * Conventions (as libibverbs and POSIX):
 *   - functions returning a pointer return NULL on error and set errno;
 *   - functions returning int/ssize_t return -1 on error and set errno;
 *   - a NULL, closed or foreign handle is an error (EBADF), never a crash;
 *   - bp_last_error() gives the last error's one-line message for this thread.
 *
 * errno values:
 *   ENOENT       no fabric of that name is running
 *   EINVAL       bad argument (name, node, port, size)
 *   EBADF        NULL, closed or unknown handle
 *   EAGAIN       would block (ring full on send, nothing queued on receive)
 *   ETIMEDOUT    a timed wait expired
 *   EMSGSIZE     datagram larger than BP_MAX_DGRAM, or receive buffer too small
 *                (the datagram stays queued; bp_dgram_recv reports its size in *needed)
 *   ENETDOWN     the destination node is down
 *   EHOSTUNREACH no route through the topology
 *   ECONNREFUSED nothing is bound at the destination
 *   ESHUTDOWN    this endpoint is closed (its node went down or restarted)
 *   EADDRINUSE   the port is already bound
 *   EPROTO       a peer corrupted a shared ring (it was retired)
 *   EIO          lost contact with the fabric supervisor
 */
#ifndef BACKPLANE_DGRAM_H
#define BACKPLANE_DGRAM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Largest datagram payload. */
#define BP_MAX_DGRAM (64 * 1024 + 512)

/* Timeouts for bp_dgram_send / bp_dgram_recv, in milliseconds. */
#define BP_WAIT_FOREVER (-1)
#define BP_NO_WAIT 0

/* A datagram address: a node (slot, 1-based) and a port on it. */
struct bp_addr {
	uint32_t node;
	uint32_t port;
};

/* Per-endpoint counters. */
struct bp_dgram_stats {
	uint64_t sent;
	uint64_t sent_bytes;
	uint64_t received;
	uint64_t received_bytes;
	uint64_t dropped;
};

struct bp_fabric;   /* opaque */
struct bp_endpoint; /* opaque */

/* Attaches to the running fabric `name` (NULL: $BACKPLANE_FABRIC, else "default"). */
struct bp_fabric *bp_fabric_attach(const char *name);
/* Detaches; endpoints and verbs devices must be closed first (EBUSY otherwise). */
int bp_fabric_detach(struct bp_fabric *fabric);
/* Node count, or -1. */
int bp_fabric_nodes(const struct bp_fabric *fabric);

/* Binds an endpoint to (node, port); port 0 picks a free one. */
struct bp_endpoint *bp_dgram_bind(struct bp_fabric *fabric, uint32_t node, uint32_t port);
/* Closes an endpoint; the handle is invalid afterwards. */
int bp_dgram_close(struct bp_endpoint *ep);
/* This endpoint's address. */
int bp_dgram_local_addr(const struct bp_endpoint *ep, struct bp_addr *addr);
/* Sends `len` bytes to `dst`; waits up to `timeout_ms` for room (BP_WAIT_FOREVER, BP_NO_WAIT). */
int bp_dgram_send(struct bp_endpoint *ep, struct bp_addr dst, const void *buf, size_t len,
		  int timeout_ms);
/*
 * Receives one datagram into `buf` (up to `len` bytes), waiting up to `timeout_ms`.
 * Returns its length; `src` (may be NULL) gets the sender. On EMSGSIZE the datagram stays
 * queued and `needed` (may be NULL) gets its size.
 */
ssize_t bp_dgram_recv(struct bp_endpoint *ep, void *buf, size_t len, struct bp_addr *src,
		      size_t *needed, int timeout_ms);
/*
 * Called by bp_dgram_recv_many with each datagram in place (`payload`, `len` bytes, valid for
 * the call only): returns 0 to take it, nonzero to leave it (it stays the next datagram).
 * It must not call into the same endpoint.
 */
typedef int (*bp_dgram_reader)(void *ctx, const struct bp_addr *src, const void *payload,
			       size_t len);
/*
 * Zero-copy receive of what is there: gives `read` at least one datagram (waiting up to
 * `timeout_ms` for the first) and at most `max`, each in place, in each sender's order —
 * from another host every datagram one look at the network brings, where bp_dgram_recv
 * copies. Returns how many `read` took; -1 with errno if none: EAGAIN, ETIMEDOUT, ...,
 * ECANCELED if `read` left the first (EINVAL: `read` NULL or `max` 0).
 */
ssize_t bp_dgram_recv_many(struct bp_endpoint *ep, size_t max, int timeout_ms,
			   bp_dgram_reader read, void *ctx);
/* Counters. */
int bp_dgram_stats(const struct bp_endpoint *ep, struct bp_dgram_stats *stats);

/* The last error's message for this thread ("" if none). Valid until the next call. */
const char *bp_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* BACKPLANE_DGRAM_H */
