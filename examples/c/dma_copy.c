/*
 * A scattered copy with the DMA engines, beside a memcpy of the same bytes in the same run.
 *
 *   dma_copy NODE [MiB] [ENGINES] [PIECE_KiB]
 *
 * Copies MiB (default 64) from one region to another on NODE as PIECE_KiB (default 64) pieces
 * in a shuffled destination order (one job, one segment per piece), ITERS times, and the same
 * pieces with memcpy from this thread. Prints both bandwidths and their ratio, then checks
 * every destination byte.
 */
#include <backplane/dma.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ITERS 10

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static int die(const char *what)
{
	fprintf(stderr, "dma_copy: %s: %s\n", what, bp_last_error());
	return 1;
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: dma_copy NODE [MiB] [ENGINES] [PIECE_KiB]\n");
		return 2;
	}
	uint32_t node = (uint32_t)atoi(argv[1]);
	size_t mib = argc > 2 ? (size_t)atoi(argv[2]) : 64;
	uint32_t engines = argc > 3 ? (uint32_t)atoi(argv[3]) : 1;
	size_t piece = (argc > 4 ? (size_t)atoi(argv[4]) : 64) << 10;
	size_t size = mib << 20;
	if (!size || !piece || size % piece)
		return 2;
	size_t n = size / piece;

	struct bp_fabric *f = bp_fabric_attach(NULL);
	if (!f)
		return die("attach");
	struct bp_context *ctx = bp_open_device(f, node);
	if (!ctx)
		return die("open");
	struct bp_pd *pd = bp_alloc_pd(ctx);
	struct bp_mr *src = pd ? bp_reg_mr(pd, NULL, size, BP_ACCESS_LOCAL_WRITE) : NULL;
	struct bp_mr *dst = pd ? bp_reg_mr(pd, NULL, size, BP_ACCESS_LOCAL_WRITE) : NULL;
	if (!src || !dst)
		return die("reg_mr");
	struct bp_dma_config cfg = { .engines = engines,
				     .inline_threshold = BP_DMA_DEFAULT_INLINE_THRESHOLD };
	struct bp_dma_engines *eng = bp_dma_engines_start(&cfg);
	struct bp_dma_queue *q = eng ? bp_dma_queue_create(ctx, eng, 4) : NULL;
	if (!q)
		return die("dma");

	unsigned char *s = src->addr, *d = dst->addr;
	for (size_t i = 0; i < size; i += 8) {
		uint64_t v = i * 0x9e3779b97f4a7c15ull;
		memcpy(s + i, &v, 8);
	}
	memset(d, 0, size); /* fault the pages in before either timing */
	/* Piece i goes to slot perm[i]: a shuffled, one-to-one destination order. */
	size_t *perm = malloc(n * sizeof *perm);
	struct bp_dma_seg *segs = calloc(n, sizeof *segs);
	if (!perm || !segs)
		return 1;
	for (size_t i = 0; i < n; i++)
		perm[i] = i;
	srand(1);
	for (size_t i = n - 1; i > 0; i--) {
		size_t j = (size_t)rand() % (i + 1), t = perm[i];
		perm[i] = perm[j];
		perm[j] = t;
	}
	for (size_t i = 0; i < n; i++)
		segs[i] = (struct bp_dma_seg){ .src_key = src->lkey, .src_off = i * piece,
					       .dst_key = dst->lkey, .dst_off = perm[i] * piece,
					       .len = piece };
	struct bp_dma_job job = { .segs = segs, .num_segs = (uint32_t)n };

	double best_dma = 1e9, best_mc = 1e9;
	for (int it = 0; it < ITERS; it++) {
		job.wr_id = (uint64_t)it;
		double t0 = now();
		if (bp_dma_submit(q, &job) != 0)
			return die("submit");
		struct bp_dma_wc wc;
		while (bp_dma_poll(q, 1, &wc) == 0)
			bp_dma_wait(q, 1, 1000);
		double t = now() - t0;
		if (wc.status != BP_DMA_SUCCESS) {
			fprintf(stderr, "dma_copy: job %d: %s (segment %d)\n", it,
				bp_dma_status_str(wc.status), wc.segment);
			return 1;
		}
		best_dma = t < best_dma ? t : best_dma;
		t0 = now();
		for (size_t i = 0; i < n; i++)
			memcpy(d + perm[i] * piece, s + i * piece, piece);
		t = now() - t0;
		best_mc = t < best_mc ? t : best_mc;
	}
	/* Check the last DMA's bytes (memcpy wrote the same ones): run it once more on a clean
	 * destination. */
	memset(d, 0, size);
	job.wr_id = ITERS;
	struct bp_dma_wc wc;
	if (bp_dma_submit(q, &job) != 0 || bp_dma_wait(q, 1, 10000) < 1 ||
	    bp_dma_poll(q, 1, &wc) != 1 || wc.status != BP_DMA_SUCCESS)
		return die("check job");
	for (size_t i = 0; i < n; i++)
		if (memcmp(d + perm[i] * piece, s + i * piece, piece) != 0) {
			fprintf(stderr, "dma_copy: piece %zu differs\n", i);
			return 1;
		}
	double mb = (double)size / 1e6;
	printf("dma_copy: %zu MiB as %zu x %zu KiB scattered segments, %u engine(s), best of %d\n",
	       mib, n, piece >> 10, engines, ITERS);
	printf("  DMA engines: %8.0f MB/s\n", mb / best_dma);
	printf("  memcpy     : %8.0f MB/s (same pieces, this thread)\n", mb / best_mc);
	printf("  DMA/memcpy : %.2f; %zu bytes checked\n", best_mc / best_dma, size);

	free(perm);
	free(segs);
	if (bp_dma_queue_destroy(q) || bp_dma_engines_stop(eng) || bp_dereg_mr(src) ||
	    bp_dereg_mr(dst) || bp_dealloc_pd(pd) || bp_close_device(ctx) || bp_fabric_detach(f))
		return die("teardown");
	return 0;
}
