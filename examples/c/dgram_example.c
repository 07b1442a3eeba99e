/*
 * A datagram receiver and sender over a backplane fabric.
 *
 *   dgram_example recv NODE PORT COUNT          receive COUNT datagrams, print a summary
 *   dgram_example send NODE DSTNODE DSTPORT COUNT SIZE   send COUNT datagrams of SIZE bytes
 *
 * The fabric is $BACKPLANE_FABRIC (or "default"). Build:
 *   cc dgram_example.c $(pkg-config --cflags --libs backplane) -o dgram_example
 */
#include <backplane/dgram.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static int die(const char *what)
{
	fprintf(stderr, "dgram_example: %s: %s (errno %d)\n", what, bp_last_error(), errno);
	return 1;
}

int main(int argc, char **argv)
{
	if (argc < 5) {
		fprintf(stderr, "usage: %s recv NODE PORT COUNT | send NODE DSTNODE DSTPORT COUNT SIZE\n",
			argv[0]);
		return 2;
	}
	struct bp_fabric *f = bp_fabric_attach(NULL);
	if (!f)
		return die("attach");
	int rc = 0;
	if (strcmp(argv[1], "recv") == 0) {
		struct bp_endpoint *ep = bp_dgram_bind(f, atoi(argv[2]), atoi(argv[3]));
		if (!ep)
			return die("bind");
		long count = atol(argv[4]);
		static char buf[BP_MAX_DGRAM];
		unsigned long long bytes = 0, sum = 0;
		double t0 = 0;
		for (long i = 0; i < count; i++) {
			struct bp_addr src;
			ssize_t n = bp_dgram_recv(ep, buf, sizeof buf, &src, NULL, 10000);
			if (n < 0) {
				rc = die("recv");
				break;
			}
			if (i == 0)
				t0 = now();
			bytes += n;
			for (ssize_t k = 0; k < n; k++)
				sum += (unsigned char)buf[k];
		}
		double el = now() - t0;
		printf("received %ld datagrams, %llu bytes, checksum %llu, %.1f MB/s\n", count, bytes,
		       sum, el > 0 ? bytes / el / 1e6 : 0.0);
		bp_dgram_close(ep);
	} else if (strcmp(argv[1], "send") == 0 && argc >= 7) {
		struct bp_endpoint *ep = bp_dgram_bind(f, atoi(argv[2]), 0);
		if (!ep)
			return die("bind");
		struct bp_addr dst = { (uint32_t)atoi(argv[3]), (uint32_t)atoi(argv[4]) };
		long count = atol(argv[5]);
		size_t size = strtoul(argv[6], NULL, 10);
		char *buf = malloc(size ? size : 1);
		unsigned long long sum = 0;
		for (size_t k = 0; k < size; k++) {
			buf[k] = (char)(k * 7);
			sum += (unsigned char)buf[k];
		}
		for (long i = 0; i < count; i++) {
			/* The receiver may not be bound yet: retry a refused first send. */
			while (bp_dgram_send(ep, dst, buf, size, BP_WAIT_FOREVER) < 0) {
				if (errno != ECONNREFUSED || i > 0) {
					rc = die("send");
					goto out;
				}
				struct timespec ms = { 0, 1000000 };
				nanosleep(&ms, NULL);
			}
		}
		printf("sent %ld datagrams, checksum %llu\n", count, sum * count);
out:
		free(buf);
		bp_dgram_close(ep);
	} else {
		fprintf(stderr, "unknown mode %s\n", argv[1]);
		rc = 2;
	}
	bp_fabric_detach(f);
	return rc;
}
