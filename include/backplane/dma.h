/*
 * backplane C API: raw DMA (the Rust `backplane::dma` module). Scatter/gather copy jobs between
 * memory regions of any nodes, executed by DMA engine threads so the submitting thread does no
 * copying. Regions are verbs memory regions (verbs.h: bp_reg_mr); a queue belongs to a verbs
 * context and follows its thread rules.
 *
 * Link with: cc prog.c $(pkg-config --cflags --libs backplane)
 *
 * Return conventions (note: unlike verbs.h's libibverbs style, errors are NEGATIVE):
 *   - bp_dma_engines_start and bp_dma_queue_create return NULL on error and set errno;
 *   - every other function returns 0 or a count on success, or -errno on failure (errno is
 *     set as well, and bp_last_error() gives the message);
 *   - a NULL, stopped/destroyed or made-up handle is -EBADF, never a crash; a queue used from
 *     a thread other than its context's owner is -EPERM.
 *
 * errno values:
 *   EBADF   NULL, destroyed or unknown handle
 *   EPERM   the queue or context belongs to another thread
 *   EINVAL  bad argument: NULL or misaligned pointer, 0 or more than BP_DMA_MAX_SEGMENTS
 *           segments, unknown flags, bad configuration, negative count or timeout
 *   ENOMEM  the queue holds `depth` outstanding jobs: poll completions first (as verbs.h)
 *   EBUSY   stopping engines that queues still use
 *   EAGAIN  an engine thread could not be started
 *
 * What a job is: segments, each copying `len` bytes from (region, offset) to (region, offset).
 * A region is named by (node, key): node 0 is a region of the queue's own context by lkey;
 * node N >= 1 is a region registered on node N (by any process, this one included) by rkey,
 * mapped through a grant of the supervisor (read-only unless the region has REMOTE_WRITE).
 * Offsets are zero-based. Only a malformed job is refused by bp_dma_submit: a bad key, an
 * out-of-bounds range, a missing access right, overlapping segments or a node going down
 * complete the job with an error status naming the segment to blame. Every segment is checked
 * before any byte moves, so a job failing the checks copies nothing; BP_DMA_NODE_DOWN,
 * BP_DMA_REGION_GONE and BP_DMA_CANCELLED can also stop a running job part-way (wc.bytes
 * says how much was copied).
 *
 * Ordering: jobs of a queue run concurrently unless flagged: BP_DMA_FENCE starts a job after
 * every job submitted before it completed; BP_DMA_CHAIN (implies FENCE) runs it only if the job
 * submitted just before succeeded, else it completes BP_DMA_CANCELLED.
 */
#ifndef BACKPLANE_DMA_H
#define BACKPLANE_DMA_H

#include <stddef.h>
#include <stdint.h>

#include <backplane/verbs.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Defaults of struct bp_dma_config (the values of the Rust DmaConfig::default()). */
#define BP_DMA_DEFAULT_INLINE_THRESHOLD (16u << 10)
#define BP_DMA_DEFAULT_MAX_PIECE (8u << 20)
/* Most segments in one job. */
#define BP_DMA_MAX_SEGMENTS (1u << 20)
/* Largest queue depth. */
#define BP_DMA_MAX_DEPTH (1 << 20)

struct bp_dma_engines; /* opaque: a set of engine threads, usable from any thread */
struct bp_dma_queue;   /* opaque: a queue of one context, used from that context's thread */

struct bp_dma_config {
	uint32_t engines;          /* engine threads, 1..64 (0: 1) */
	uint32_t npin;             /* entries in pin (0: engines not pinned) */
	const uint32_t *pin;       /* engine i runs on CPU pin[i % npin] */
	uint64_t inline_threshold; /* jobs of at most this many bytes that may start at once are
				    * copied by the submitter (0: never; the default is
				    * BP_DMA_DEFAULT_INLINE_THRESHOLD) */
	uint64_t max_piece;        /* largest piece an engine copies at once, >= 64 KiB
				    * (0: BP_DMA_DEFAULT_MAX_PIECE) */
};

enum bp_dma_flags {
	BP_DMA_FENCE = 1,      /* start after every earlier job of the queue completed */
	BP_DMA_CHAIN = 1 << 1, /* fenced, and run only if the previous job succeeded */
};

/* One copy. (node, key) name a region: node 0 = this context's region by lkey, node N >= 1 =
 * a region of node N by rkey. */
struct bp_dma_seg {
	uint32_t src_node;
	uint32_t src_key;
	uint64_t src_off;
	uint32_t dst_node;
	uint32_t dst_key;
	uint64_t dst_off;
	uint64_t len;
};

struct bp_dma_job {
	uint64_t wr_id;               /* returned in the completion; need not be unique */
	const struct bp_dma_seg *segs; /* read during bp_dma_submit only */
	uint32_t num_segs;            /* 1..BP_DMA_MAX_SEGMENTS */
	uint32_t flags;               /* enum bp_dma_flags */
};

/* How a job ended (one per Rust DmaStatus variant, same order). */
enum bp_dma_status {
	BP_DMA_SUCCESS,
	BP_DMA_CANCELLED,      /* cancelled, or chained to a job that did not succeed */
	BP_DMA_INVALID_REGION, /* an lkey this context does not have, or a node outside the fabric */
	BP_DMA_NO_GRANT,       /* the rkey names no region on that node, or no remote access */
	BP_DMA_OUT_OF_BOUNDS,  /* a range reaches past the end of its region */
	BP_DMA_ACCESS_DENIED,  /* the region does not allow the direction */
	BP_DMA_OVERLAP,        /* a destination overlaps another range of the job */
	BP_DMA_NODE_DOWN,      /* a node of the job is not READY (or restarted) */
	BP_DMA_REGION_GONE,    /* a region was deregistered */
};

struct bp_dma_wc {
	uint64_t wr_id;
	uint64_t bytes;   /* bytes copied */
	uint32_t status;  /* enum bp_dma_status */
	int32_t segment;  /* the segment to blame (the lowest not run for CANCELLED); -1 on success */
};

/* Starts a set of engine threads (cfg NULL: one engine, defaults). Any thread may use it. */
struct bp_dma_engines *bp_dma_engines_start(const struct bp_dma_config *cfg);
/* Stops the threads: -EBUSY while a queue made with them is alive. */
int bp_dma_engines_stop(struct bp_dma_engines *engines);

/* A queue of `context` feeding `engines`, with at most `depth` (1..BP_DMA_MAX_DEPTH) jobs
 * outstanding. Owned by the context's thread; destroy it before closing the context. */
struct bp_dma_queue *bp_dma_queue_create(struct bp_context *context,
					 struct bp_dma_engines *engines, int depth);
/* Cancels what is outstanding, waits for pieces already running (milliseconds), frees the
 * queue; completions not polled are lost. */
int bp_dma_queue_destroy(struct bp_dma_queue *queue);

/* Submits a job: 0, or -errno when refused (nothing submitted). The segment array is copied. */
int bp_dma_submit(struct bp_dma_queue *queue, const struct bp_dma_job *job);
/* Cancels every outstanding job with this wr_id; returns how many there were. Pieces not yet
 * started are skipped: such a job completes BP_DMA_CANCELLED naming its lowest skipped
 * segment; a job whose pieces had all started completes normally. */
int bp_dma_cancel(struct bp_dma_queue *queue, uint64_t wr_id);
/* Takes up to n completions into wc (n 0: returns 0, wc may be NULL); returns the count. */
int bp_dma_poll(struct bp_dma_queue *queue, int n, struct bp_dma_wc *wc);
/* Sleeps until at least `min` completions can be polled (fewer if fewer jobs are outstanding)
 * or timeout_ms passes (-1: forever, 0: no wait); returns how many can be polled. */
int bp_dma_wait(struct bp_dma_queue *queue, int min, int timeout_ms);
/* Jobs submitted and not yet completed, or -errno. */
int bp_dma_outstanding(struct bp_dma_queue *queue);

/* "success", "out of bounds", ... (the Rust Display texts); "unknown" otherwise. */
const char *bp_dma_status_str(enum bp_dma_status status);

#ifdef __cplusplus
}
#endif

#endif /* BACKPLANE_DMA_H */
