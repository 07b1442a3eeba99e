/* Registering memory that is shared already, in one process (two RC QPs connected to each
 * other): a memfd mapped MAP_SHARED, a SysV segment, shared anonymous memory, and a range
 * registered twice (inside another live registration, as UCX and MPI register). Each is
 * registered where it is — a peer's RDMA WRITE lands at the program's address *and* in the
 * object's other mappings (the pages were not moved) — and READ returns it. Deregistering the
 * inner registration revokes its rkey (REM_ACCESS_ERR) while the outer one still works;
 * deregistering the outer one first leaves the inner one reaching the program's memory.
 * A MAP_SHARED mapping of a file on a disk file system is refused with EINVAL.
 * Exit 0 and one line when everything held; otherwise the first failure on stderr. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "connect_rc.h"

#define SIZE 8192
#define FAIL(...) do { fprintf(stderr, "ibv_shared_mr: " __VA_ARGS__); fputc('\n', stderr); exit(1); } while (0)
#define RW (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static struct ibv_qp *qa, *qb;
static uint16_t lid;
static unsigned char *src;
static struct ibv_mr *src_mr;

static void qps(void)
{
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 } };
	if (qa)
		ibv_destroy_qp(qa);
	if (qb)
		ibv_destroy_qp(qb);
	qa = ibv_create_qp(pd, &ia);
	qb = ibv_create_qp(pd, &ia);
	if (!qa || !qb || connect_rc(qa, qb->qp_num, lid) || connect_rc(qb, qa->qp_num, lid))
		FAIL("cannot make and connect two RC QPs");
}

/* One RDMA operation from QP a on `len` bytes of `src` at `off`, to `raddr` of region `rkey`;
 * its completion's status. */
static enum ibv_wc_status rdma(enum ibv_wr_opcode op, uint32_t off, uint32_t len, uint64_t raddr,
			       uint32_t rkey)
{
	struct ibv_sge sge = { .addr = (uintptr_t)src + off, .length = len, .lkey = src_mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 7, .sg_list = &sge, .num_sge = 1, .opcode = op,
		.send_flags = IBV_SEND_SIGNALED }, *bad;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	if (ibv_post_send(qa, &wr, &bad))
		FAIL("post failed");
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	if (n < 0)
		FAIL("poll failed");
	return wc.status;
}

static void check(const unsigned char *p, unsigned char v, int n, const char *what)
{
	for (int k = 0; k < n; k++)
		if (p[k] != v)
			FAIL("%s: byte %d is %#x, want %#x", what, k, p[k], v);
}

/* Registers `len` bytes at `p` (already shared memory), WRITEs a pattern into them through the
 * region and checks it at `p` and at `alias` (another mapping of the same object), READs it
 * back, writes from the program's side and READs that; returns the region. */
static struct ibv_mr *written(unsigned char *p, unsigned char *alias, size_t len, unsigned char v,
			      const char *what)
{
	struct ibv_mr *mr = ibv_reg_mr(pd, p, len, RW);
	if (!mr)
		FAIL("%s: ibv_reg_mr: %s", what, strerror(errno));
	if (mr->addr != p || mr->length != len)
		FAIL("%s: the region is not where it was registered", what);
	memset(src, v, len);
	if (rdma(IBV_WR_RDMA_WRITE, 0, len, (uintptr_t)p, mr->rkey) != IBV_WC_SUCCESS)
		FAIL("%s: WRITE did not succeed", what);
	check(p, v, len, what);
	if (alias)
		check(alias, v, len, what);
	memset(p, v + 1, len);
	memset(src, 0, len);
	if (rdma(IBV_WR_RDMA_READ, 0, len, (uintptr_t)p, mr->rkey) != IBV_WC_SUCCESS)
		FAIL("%s: READ did not succeed", what);
	check(src, v + 1, len, what);
	return mr;
}

int main(void)
{
	struct ibv_device **dl = ibv_get_device_list(NULL);
	if (!dl || !dl[0])
		FAIL("no device");
	ctx = ibv_open_device(dl[0]);
	struct ibv_port_attr pa;
	pd = ctx ? ibv_alloc_pd(ctx) : NULL;
	cq = pd ? ibv_create_cq(ctx, 64, NULL, NULL, 0) : NULL;
	if (!pd || !cq || ibv_query_port(ctx, 1, &pa))
		FAIL("cannot open the device");
	lid = pa.lid;
	qps();
	src = aligned_alloc(4096, 4 * 4096);
	src_mr = src ? ibv_reg_mr(pd, src, 4 * 4096, IBV_ACCESS_LOCAL_WRITE) : NULL;
	if (!src_mr)
		FAIL("cannot register the source buffer");

	/* A memfd mapped twice, MAP_SHARED: the second mapping sees the WRITE. */
	int fd = memfd_create("shared-mr", 0);
	if (fd < 0 || ftruncate(fd, SIZE))
		FAIL("memfd");
	unsigned char *m1 = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	unsigned char *m2 = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (m1 == MAP_FAILED || m2 == MAP_FAILED)
		FAIL("mmap of the memfd");
	/* Half of it, from its second page: the region's data starts inside the object. */
	ibv_dereg_mr(written(m1 + 4096 + 100, m2 + 4096 + 100, 3000, 0x21, "memfd"));
	m2[4096 + 100] = 0x55;
	if (m1[4096 + 100] != 0x55)
		FAIL("memfd: the mappings no longer share their pages after deregistration");

	/* A SysV segment attached twice. */
	int id = shmget(IPC_PRIVATE, SIZE, IPC_CREAT | 0600);
	if (id < 0)
		FAIL("shmget: %s", strerror(errno));
	unsigned char *s1 = shmat(id, NULL, 0), *s2 = shmat(id, NULL, 0);
	shmctl(id, IPC_RMID, NULL);
	if (s1 == (void *)-1 || s2 == (void *)-1)
		FAIL("shmat");
	ibv_dereg_mr(written(s1, s2, SIZE, 0x31, "SysV"));

	/* Shared anonymous memory. */
	unsigned char *an = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (an == MAP_FAILED)
		FAIL("mmap shared anonymous");
	ibv_dereg_mr(written(an, NULL, SIZE, 0x41, "shared anonymous"));

	/* Private memory registered, then a range inside it again, and the same range twice. */
	unsigned char *pv = mmap(NULL, 4 * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (pv == MAP_FAILED)
		FAIL("mmap private");
	struct ibv_mr *outer = written(pv, NULL, 4 * 4096, 0x51, "outer");
	struct ibv_mr *inner = written(pv + 4096 + 8, NULL, 4096, 0x61, "inner");
	struct ibv_mr *twice = written(pv, NULL, 4 * 4096, 0x71, "the same range again");
	if (inner->rkey == outer->rkey || twice->rkey == outer->rkey)
		FAIL("overlapping registrations share a key");
	/* A WRITE through the inner region is seen through the outer one. */
	memset(src, 0x62, 16);
	if (rdma(IBV_WR_RDMA_WRITE, 0, 16, (uintptr_t)pv + 4096 + 8, inner->rkey) != IBV_WC_SUCCESS)
		FAIL("inner: WRITE did not succeed");
	memset(src, 0, 16);
	if (rdma(IBV_WR_RDMA_READ, 0, 16, (uintptr_t)pv + 4096 + 8, outer->rkey) != IBV_WC_SUCCESS)
		FAIL("outer: READ did not succeed");
	check(src, 0x62, 16, "inner seen through outer");
	ibv_dereg_mr(twice);
	uint32_t gone = inner->rkey;
	if (ibv_dereg_mr(inner))
		FAIL("inner: ibv_dereg_mr failed");
	if (rdma(IBV_WR_RDMA_WRITE, 0, 16, (uintptr_t)pv + 4096 + 8, gone) != IBV_WC_REM_ACCESS_ERR)
		FAIL("a deregistered region's rkey still worked");
	qps(); /* (the error took the pair down) */
	memset(src, 0x52, 16);
	if (rdma(IBV_WR_RDMA_WRITE, 0, 16, (uintptr_t)pv + 4096 + 8, outer->rkey) != IBV_WC_SUCCESS)
		FAIL("outer: WRITE after the inner deregistration did not succeed");
	check(pv + 4096 + 8, 0x52, 16, "outer after inner's deregistration");
	ibv_dereg_mr(outer);
	check(pv + 4096 + 8, 0x52, 16, "private again, with its bytes");

	/* The outer registration deregistered first: the inner one still reaches the memory the
	 * program reads (it holds the pages), which keeps its bytes when the inner one goes too. */
	unsigned char *pw = mmap(NULL, 2 * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (pw == MAP_FAILED)
		FAIL("mmap private");
	outer = written(pw, NULL, 2 * 4096, 0x81, "outer, deregistered first");
	inner = written(pw + 4096, NULL, 4096, 0x91, "inside it");
	ibv_dereg_mr(outer);
	memset(src, 0x92, 64);
	if (rdma(IBV_WR_RDMA_WRITE, 0, 64, (uintptr_t)pw + 4096, inner->rkey) != IBV_WC_SUCCESS)
		FAIL("inner: WRITE after the outer deregistration did not succeed");
	check(pw + 4096, 0x92, 64, "inner after outer's deregistration");
	ibv_dereg_mr(inner);
	check(pw + 4096, 0x92, 64, "after both deregistrations");
	pw[4096] = 0x93;
	if (pw[4096] != 0x93)
		FAIL("the pages are not the program's after both deregistrations");

	/* A file on a disk file system, mapped MAP_SHARED: refused. */
	struct statfs fs;
	int file = open("/usr/bin/env", O_RDONLY);
	if (file >= 0 && fstatfs(file, &fs) == 0 && fs.f_type != 0x01021994) {
		void *f = mmap(NULL, 4096, PROT_READ, MAP_SHARED, file, 0);
		if (f == MAP_FAILED)
			FAIL("mmap of a file");
		errno = 0;
		if (ibv_reg_mr(pd, f, 4096, 0) || errno != EINVAL)
			FAIL("a disk file's mapping was not refused with EINVAL (%s)", strerror(errno));
	}
	printf("shared memory registered in place: memfd, SysV, shared anonymous, overlapping ranges\n");
	return 0;
}
