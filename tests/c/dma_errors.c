/*
 * Raw DMA through the C boundary: multi-segment copies between local regions and to and from
 * a region of node 2 (through a grant), then the error paths: NULL, stale and foreign
 * handles, bad arguments, a bad lkey and an out-of-bounds segment (completions naming the
 * segment), cancel, fence and chain. Run under AddressSanitizer/UBSan by scripts/test-c.sh
 * against a 2-node fabric ($BACKPLANE_FABRIC).
 */
#include <backplane/dma.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The layouts the Rust side asserts too (crates/backplane-capi/src/dma.rs). */
_Static_assert(sizeof(struct bp_dma_config) == 32, "bp_dma_config");
_Static_assert(offsetof(struct bp_dma_config, inline_threshold) == 16, "bp_dma_config.it");
_Static_assert(sizeof(struct bp_dma_seg) == 40, "bp_dma_seg");
_Static_assert(offsetof(struct bp_dma_seg, dst_node) == 16, "bp_dma_seg.dst_node");
_Static_assert(offsetof(struct bp_dma_seg, len) == 32, "bp_dma_seg.len");
_Static_assert(sizeof(struct bp_dma_job) == 24, "bp_dma_job");
_Static_assert(offsetof(struct bp_dma_job, num_segs) == 16, "bp_dma_job.num_segs");
_Static_assert(sizeof(struct bp_dma_wc) == 24, "bp_dma_wc");
_Static_assert(offsetof(struct bp_dma_wc, status) == 16, "bp_dma_wc.status");
_Static_assert(BP_DMA_REGION_GONE == 8, "one status per Rust DmaStatus variant");

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

#define MiB (1u << 20)

/* Waits for and takes exactly one completion. */
static struct bp_dma_wc one(struct bp_dma_queue *q)
{
	struct bp_dma_wc wc;
	memset(&wc, 0xee, sizeof wc);
	CHECK(bp_dma_wait(q, 1, 10000) >= 1);
	CHECK(bp_dma_poll(q, 1, &wc) == 1);
	return wc;
}

static struct bp_dma_seg local_seg(uint32_t src, uint64_t so, uint32_t dst, uint64_t d_off,
				   uint64_t len)
{
	struct bp_dma_seg s = { .src_node = 0, .src_key = src, .src_off = so,
				.dst_node = 0, .dst_key = dst, .dst_off = d_off, .len = len };
	return s;
}

struct foreign {
	struct bp_dma_queue *q;
	int submit_rc, poll_rc, destroy_rc;
};

static void *from_other_thread(void *arg)
{
	struct foreign *f = arg;
	struct bp_dma_seg s = local_seg(1, 0, 2, 0, 1);
	struct bp_dma_job job = { .wr_id = 1, .segs = &s, .num_segs = 1 };
	struct bp_dma_wc wc;
	f->submit_rc = bp_dma_submit(f->q, &job);
	f->poll_rc = bp_dma_poll(f->q, 1, &wc);
	f->destroy_rc = bp_dma_queue_destroy(f->q);
	return NULL;
}

int main(void)
{
	struct bp_fabric *f = bp_fabric_attach(NULL);
	CHECK(f != NULL);
	if (!f)
		return 1;
	struct bp_context *c1 = bp_open_device(f, 1), *c2 = bp_open_device(f, 2);
	CHECK(c1 && c2);
	struct bp_pd *pd1 = bp_alloc_pd(c1), *pd2 = bp_alloc_pd(c2);
	struct bp_mr *a = bp_reg_mr(pd1, NULL, 64 * MiB, BP_ACCESS_LOCAL_WRITE);
	struct bp_mr *b = bp_reg_mr(pd1, NULL, 64 * MiB, BP_ACCESS_LOCAL_WRITE);
	struct bp_mr *r2 = bp_reg_mr(pd2, NULL, 1 * MiB,
				     BP_ACCESS_LOCAL_WRITE | BP_ACCESS_REMOTE_WRITE |
					     BP_ACCESS_REMOTE_READ);
	struct bp_mr *ro2 = bp_reg_mr(pd2, NULL, 4096, BP_ACCESS_REMOTE_READ);
	CHECK(pd1 && pd2 && a && b && r2 && ro2);
	if (!a || !b || !r2 || !ro2)
		return 1;
	unsigned char *pa = a->addr, *pb = b->addr, *pr = r2->addr;
	for (size_t i = 0; i < 1 * MiB; i++)
		pa[i] = (unsigned char)(i * 7 + 3);

	/* Constructors: NULL handles and bad arguments. */
	struct bp_dma_engines *eng = bp_dma_engines_start(NULL);
	CHECK(eng != NULL);
	uint32_t pins[2] = { 0, 1 };
	struct bp_dma_config cfg = { .engines = 65 };
	CHECK(bp_dma_engines_start(&cfg) == NULL && errno == EINVAL);
	cfg = (struct bp_dma_config){ .engines = 1, .max_piece = 4096 };
	CHECK(bp_dma_engines_start(&cfg) == NULL && errno == EINVAL);
	cfg = (struct bp_dma_config){ .engines = 2, .npin = 2, .pin = NULL };
	CHECK(bp_dma_engines_start(&cfg) == NULL && errno == EINVAL);
	cfg = (struct bp_dma_config){ .engines = 2, .npin = 2, .pin = pins,
				      .inline_threshold = 0 };
	struct bp_dma_engines *eng2 = bp_dma_engines_start(&cfg);
	CHECK(eng2 != NULL);
	CHECK(bp_dma_queue_create(NULL, eng, 8) == NULL && errno == EBADF);
	CHECK(bp_dma_queue_create(c1, NULL, 8) == NULL && errno == EBADF);
	CHECK(bp_dma_queue_create(c1, (struct bp_dma_engines *)pd1, 8) == NULL && errno == EBADF);
	CHECK(bp_dma_queue_create(c1, eng, 0) == NULL && errno == EINVAL);
	CHECK(bp_dma_queue_create(c1, eng, BP_DMA_MAX_DEPTH + 1) == NULL && errno == EINVAL);
	struct bp_dma_queue *q = bp_dma_queue_create(c1, eng, 16);
	struct bp_dma_queue *q2 = bp_dma_queue_create(c1, eng2, 16);
	CHECK(q && q2);
	if (!q || !q2)
		return 1;

	/* A multi-segment job between two local regions, scattered, through the engines. */
	struct bp_dma_seg segs[4] = {
		local_seg(a->lkey, 0, b->lkey, 3 * 65536, 65536),
		local_seg(a->lkey, 65536, b->lkey, 0, 65536),
		local_seg(a->lkey, 2 * 65536, b->lkey, 2 * 65536, 65536),
		local_seg(a->lkey, 3 * 65536 + 5, b->lkey, 65536, 65536 - 5),
	};
	struct bp_dma_job job = { .wr_id = 42, .segs = segs, .num_segs = 4 };
	CHECK(bp_dma_submit(q2, &job) == 0);
	struct bp_dma_wc wc = one(q2);
	CHECK(wc.wr_id == 42 && wc.status == BP_DMA_SUCCESS && wc.segment == -1);
	CHECK(wc.bytes == 4 * 65536 - 5);
	for (int s = 0; s < 4; s++)
		CHECK(memcmp(pb + segs[s].dst_off, pa + segs[s].src_off, segs[s].len) == 0);

	/* To a region of node 2 (through a grant) and back from it. */
	struct bp_dma_seg rs[2] = {
		{ .src_node = 0, .src_key = a->lkey, .src_off = 100,
		  .dst_node = 2, .dst_key = r2->rkey, .dst_off = 4096, .len = 300000 },
		{ .src_node = 0, .src_key = a->lkey, .src_off = 500000,
		  .dst_node = 2, .dst_key = r2->rkey, .dst_off = 600000, .len = 1000 },
	};
	job = (struct bp_dma_job){ .wr_id = 43, .segs = rs, .num_segs = 2 };
	CHECK(bp_dma_submit(q, &job) == 0);
	wc = one(q);
	CHECK(wc.wr_id == 43 && wc.status == BP_DMA_SUCCESS && wc.bytes == 301000);
	CHECK(memcmp(pr + 4096, pa + 100, 300000) == 0);
	CHECK(memcmp(pr + 600000, pa + 500000, 1000) == 0);
	struct bp_dma_seg back = { .src_node = 2, .src_key = r2->rkey, .src_off = 4096,
				   .dst_node = 0, .dst_key = b->lkey, .dst_off = 8 * MiB,
				   .len = 300000 };
	job = (struct bp_dma_job){ .wr_id = 44, .segs = &back, .num_segs = 1 };
	CHECK(bp_dma_submit(q, &job) == 0);
	wc = one(q);
	CHECK(wc.status == BP_DMA_SUCCESS && memcmp(pb + 8 * MiB, pa + 100, 300000) == 0);
	/* A read-only remote region as a destination: access denied, segment 0. */
	back = (struct bp_dma_seg){ .src_node = 0, .src_key = a->lkey, .dst_node = 2,
				    .dst_key = ro2->rkey, .len = 64 };
	CHECK(bp_dma_submit(q, &job) == 0);
	wc = one(q);
	CHECK(wc.status == BP_DMA_ACCESS_DENIED && wc.segment == 0);
	/* An rkey node 2 does not have: no grant. */
	back.dst_key = 0xdead;
	CHECK(bp_dma_submit(q, &job) == 0);
	wc = one(q);
	CHECK(wc.status == BP_DMA_NO_GRANT && wc.segment == 0);
	CHECK(strcmp(bp_dma_status_str(wc.status), "no grant") == 0);

	/* A bad lkey in segment 1, an out-of-bounds segment 2: nothing copied, segment named. */
	memset(pb, 0, 4 * 65536);
	struct bp_dma_seg bad[3] = {
		local_seg(a->lkey, 0, b->lkey, 0, 4096),
		local_seg(0xbad, 0, b->lkey, 8192, 4096),
		local_seg(a->lkey, 0, b->lkey, 64 * MiB - 100, 101),
	};
	job = (struct bp_dma_job){ .wr_id = 50, .segs = bad, .num_segs = 3 };
	CHECK(bp_dma_submit(q, &job) == 0);
	wc = one(q);
	CHECK(wc.wr_id == 50 && wc.status == BP_DMA_INVALID_REGION && wc.segment == 1);
	CHECK(wc.bytes == 0 && pb[0] == 0 && pb[4095] == 0);
	bad[1] = local_seg(a->lkey, 4096, b->lkey, 8192, 4096);
	CHECK(bp_dma_submit(q, &job) == 0);
	wc = one(q);
	CHECK(wc.status == BP_DMA_OUT_OF_BOUNDS && wc.segment == 2 && pb[0] == 0);
	CHECK(strcmp(bp_dma_status_str(BP_DMA_OUT_OF_BOUNDS), "out of bounds") == 0);
	CHECK(strcmp(bp_dma_status_str((enum bp_dma_status)99), "unknown") == 0);
	/* Overlapping destinations: segment 1 overlaps segment 0's destination. */
	bad[2] = local_seg(a->lkey, 0, b->lkey, 100, 4096);
	bad[1] = local_seg(a->lkey, 8192, b->lkey, 1000, 10);
	job.num_segs = 2;
	CHECK(bp_dma_submit(q, &job) == 0);
	wc = one(q);
	CHECK(wc.status == BP_DMA_OVERLAP && wc.segment >= 0 && wc.segment <= 1);

	/* Refused submissions: nothing is queued. */
	job = (struct bp_dma_job){ .wr_id = 60, .segs = segs, .num_segs = 4 };
	CHECK(bp_dma_submit(NULL, &job) == -EBADF && errno == EBADF);
	CHECK(bp_dma_submit((struct bp_dma_queue *)c1, &job) == -EBADF);
	CHECK(bp_dma_submit(q, NULL) == -EINVAL && errno == EINVAL);
	job.num_segs = 0;
	CHECK(bp_dma_submit(q, &job) == -EINVAL);
	job.num_segs = BP_DMA_MAX_SEGMENTS + 1;
	CHECK(bp_dma_submit(q, &job) == -EINVAL);
	job.num_segs = 4;
	job.segs = NULL;
	CHECK(bp_dma_submit(q, &job) == -EINVAL);
	job.segs = (const struct bp_dma_seg *)((const char *)segs + 4);
	CHECK(bp_dma_submit(q, &job) == -EINVAL); /* misaligned */
	job.segs = segs;
	job.flags = 1u << 7;
	CHECK(bp_dma_submit(q, &job) == -EINVAL);
	_Alignas(8) char raw[sizeof job + 8];
	memcpy(raw + 4, &job, sizeof job);
	CHECK(bp_dma_submit(q, (const struct bp_dma_job *)(raw + 4)) == -EINVAL);
	CHECK(bp_dma_outstanding(q) == 0);

	/* Poll and wait arguments. */
	CHECK(bp_dma_poll(q, 0, NULL) == 0);
	CHECK(bp_dma_poll(q, 1, NULL) == -EINVAL);
	CHECK(bp_dma_poll(q, -1, &wc) == -EINVAL);
	struct bp_dma_wc wcs[2];
	CHECK(bp_dma_poll(q, 1, (struct bp_dma_wc *)((char *)wcs + 4)) == -EINVAL);
	CHECK(bp_dma_poll(q, 2, wcs) == 0);
	CHECK(bp_dma_wait(q, -1, 0) == -EINVAL);
	CHECK(bp_dma_wait(q, 1, -2) == -EINVAL);
	CHECK(bp_dma_wait(q, 1, 0) == 0); /* nothing outstanding: returns at once */
	CHECK(bp_dma_cancel(q, 12345) == 0);

	/* Fence: job 71 reads what job 70 writes; with the fence it sees all of it. */
	for (int round = 0; round < 20; round++) {
		memset(pb, 0, 2 * MiB);
		struct bp_dma_seg w = local_seg(a->lkey, 0, b->lkey, 0, 1 * MiB);
		struct bp_dma_seg r = local_seg(b->lkey, 0, b->lkey, 1 * MiB, 1 * MiB);
		struct bp_dma_job j1 = { .wr_id = 70, .segs = &w, .num_segs = 1 };
		struct bp_dma_job j2 = { .wr_id = 71, .segs = &r, .num_segs = 1,
					 .flags = BP_DMA_FENCE };
		CHECK(bp_dma_submit(q, &j1) == 0 && bp_dma_submit(q, &j2) == 0);
		CHECK(bp_dma_wait(q, 2, 10000) == 2);
		CHECK(bp_dma_poll(q, 2, wcs) == 2);
		CHECK(wcs[0].status == BP_DMA_SUCCESS && wcs[1].status == BP_DMA_SUCCESS);
		CHECK(memcmp(pb + 1 * MiB, pa, 1 * MiB) == 0);
	}

	/* Chain: a job chained to a failed one is cancelled, naming its segment 0. */
	{
		struct bp_dma_seg f1 = local_seg(0xbad, 0, b->lkey, 0, 10);
		struct bp_dma_seg ok = local_seg(a->lkey, 0, b->lkey, 0, 10);
		struct bp_dma_job j1 = { .wr_id = 80, .segs = &f1, .num_segs = 1 };
		struct bp_dma_job j2 = { .wr_id = 81, .segs = &ok, .num_segs = 1,
					 .flags = BP_DMA_CHAIN };
		memset(pb, 0, 10);
		CHECK(bp_dma_submit(q, &j1) == 0 && bp_dma_submit(q, &j2) == 0);
		CHECK(bp_dma_wait(q, 2, 10000) == 2);
		CHECK(bp_dma_poll(q, 2, wcs) == 2);
		struct bp_dma_wc *w81 = wcs[0].wr_id == 81 ? &wcs[0] : &wcs[1];
		CHECK(w81->wr_id == 81 && w81->status == BP_DMA_CANCELLED && w81->segment == 0);
		CHECK(pb[0] == 0);
	}

	/* Cancel: a fenced job parked behind a 64 MiB copy never runs. */
	{
		struct bp_dma_seg big = local_seg(a->lkey, 0, b->lkey, 0, 64 * MiB);
		struct bp_dma_seg small = local_seg(a->lkey, 0, a->lkey, 32 * MiB, 4096);
		struct bp_dma_job j1 = { .wr_id = 90, .segs = &big, .num_segs = 1 };
		struct bp_dma_job j2 = { .wr_id = 91, .segs = &small, .num_segs = 1,
					 .flags = BP_DMA_FENCE };
		CHECK(bp_dma_submit(q, &j1) == 0 && bp_dma_submit(q, &j2) == 0);
		int n = bp_dma_cancel(q, 91);
		CHECK(bp_dma_wait(q, 2, 20000) == 2);
		CHECK(bp_dma_poll(q, 2, wcs) == 2);
		struct bp_dma_wc *w91 = wcs[0].wr_id == 91 ? &wcs[0] : &wcs[1];
		/* The 64 MiB copy takes milliseconds, the cancel microseconds: if the copy was
		 * done first after all, the small job ran normally. */
		if (n == 1)
			CHECK(w91->status == BP_DMA_CANCELLED && w91->segment == 0 &&
			      w91->bytes == 0);
		else
			CHECK(n == 0 && w91->status == BP_DMA_SUCCESS);
		if (n != 1)
			fprintf(stderr, "dma_errors: the cancel came too late (not a failure)\n");
	}

	/* Foreign thread: EPERM, and nothing changes. */
	{
		struct foreign fo = { .q = q };
		pthread_t t;
		CHECK(pthread_create(&t, NULL, from_other_thread, &fo) == 0);
		pthread_join(t, NULL);
		CHECK(fo.submit_rc == -EPERM && fo.poll_rc == -EPERM && fo.destroy_rc == -EPERM);
		CHECK(bp_dma_outstanding(q) == 0);
	}

	/* In-use and stale handles. */
	CHECK(bp_dma_engines_stop(eng) == -EBUSY && errno == EBUSY);
	CHECK(bp_close_device(c1) == -1 && errno == EBUSY);
	CHECK(bp_dma_queue_destroy(q2) == 0);
	CHECK(bp_dma_submit(q2, &job) == -EBADF);
	CHECK(bp_dma_poll(q2, 1, &wc) == -EBADF);
	CHECK(bp_dma_wait(q2, 1, 0) == -EBADF);
	CHECK(bp_dma_cancel(q2, 1) == -EBADF);
	CHECK(bp_dma_queue_destroy(q2) == -EBADF);
	CHECK(bp_dma_engines_stop(eng2) == 0);
	CHECK(bp_dma_engines_stop(eng2) == -EBADF);
	CHECK(bp_dma_queue_create(c1, eng2, 8) == NULL && errno == EBADF);
	/* A region deregistered while a queue knows it: the next job names it gone or invalid. */
	{
		struct bp_mr *tmp = bp_reg_mr(pd1, NULL, 4096, BP_ACCESS_LOCAL_WRITE);
		CHECK(tmp != NULL);
		struct bp_dma_seg s = local_seg(a->lkey, 0, tmp->lkey, 0, 4096);
		struct bp_dma_job j = { .wr_id = 95, .segs = &s, .num_segs = 1 };
		CHECK(bp_dma_submit(q, &j) == 0);
		CHECK(one(q).status == BP_DMA_SUCCESS);
		CHECK(bp_dereg_mr(tmp) == 0);
		CHECK(bp_dma_submit(q, &j) == 0);
		wc = one(q);
		CHECK((wc.status == BP_DMA_REGION_GONE || wc.status == BP_DMA_INVALID_REGION) &&
		      wc.segment == 0);
	}
	CHECK(bp_dma_queue_destroy(q) == 0);
	CHECK(bp_dma_engines_stop(eng) == 0);

	CHECK(bp_dereg_mr(a) == 0 && bp_dereg_mr(b) == 0);
	CHECK(bp_dereg_mr(r2) == 0 && bp_dereg_mr(ro2) == 0);
	CHECK(bp_dealloc_pd(pd1) == 0 && bp_dealloc_pd(pd2) == 0);
	CHECK(bp_close_device(c1) == 0 && bp_close_device(c2) == 0);
	CHECK(bp_fabric_detach(f) == 0);
	printf("dma_errors: %d checks, %d failed\n", checks, failures);
	return failures != 0;
}
