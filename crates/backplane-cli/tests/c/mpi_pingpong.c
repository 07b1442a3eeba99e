/* MPI between two nodes of a fabric: ping-pong of 8 B .. 256 KiB with every byte checked,
 * one-sided put, get and accumulate through a window, an allreduce. Each rank says which
 * node it runs in (BACKPLANE_NODE, set by `backplane exec`/`rsh`). Exit status 0 only if
 * every check holds. Usage: mpirun -np 2 ... mpi_pingpong [ITERS] */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static void fail(const char *what, size_t size, long at)
{
    fprintf(stderr, "mpi_pingpong: %s (size %zu, at %ld)\n", what, size, at);
    MPI_Abort(MPI_COMM_WORLD, 3);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, ranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    if (ranks != 2) {
        fprintf(stderr, "mpi_pingpong: run it as two ranks\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const char *node = getenv("BACKPLANE_NODE");
    printf("rank %d in node %s\n", rank, node ? node : "(none)");
    fflush(stdout);
    int iters = argc > 1 ? atoi(argv[1]) : 1000;
    const size_t max = 256 * 1024;
    unsigned char *buf = malloc(max);
    if (!buf)
        fail("no memory", max, 0);
    for (size_t s = 8; s <= max; s *= 8) {
        int n = s > 65536 ? (iters + 9) / 10 : iters;
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < n; i++) {
            if (rank == 0) {
                for (size_t j = 0; j < s; j++)
                    buf[j] = (unsigned char)(i + j);
                MPI_Send(buf, (int)s, MPI_BYTE, 1, 1, MPI_COMM_WORLD);
                MPI_Recv(buf, (int)s, MPI_BYTE, 1, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                for (size_t j = 0; j < s; j++)
                    if (buf[j] != (unsigned char)(i + j + 1))
                        fail("a wrong byte came back", s, (long)j);
            } else {
                MPI_Recv(buf, (int)s, MPI_BYTE, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                for (size_t j = 0; j < s; j++)
                    buf[j]++;
                MPI_Send(buf, (int)s, MPI_BYTE, 0, 2, MPI_COMM_WORLD);
            }
        }
        double t = MPI_Wtime() - t0;
        if (rank == 0)
            printf("pingpong %7zu B: %9.2f us one way, bytes checked\n", s, t / n / 2 * 1e6);
    }
    long *w;
    MPI_Win win;
    MPI_Win_allocate(4096 * sizeof(long), sizeof(long), MPI_INFO_NULL, MPI_COMM_WORLD, &w, &win);
    for (int i = 0; i < 4096; i++)
        w[i] = rank * 1000000L + i;
    MPI_Win_fence(0, win);
    long out[512], in[512];
    if (rank == 0) {
        for (int i = 0; i < 512; i++)
            out[i] = 7000000L + i;
        MPI_Put(out, 512, MPI_LONG, 1, 100, 512, MPI_LONG, win);
    }
    MPI_Win_fence(0, win);
    if (rank == 0)
        MPI_Get(in, 512, MPI_LONG, 1, 100, 512, MPI_LONG, win);
    MPI_Win_fence(0, win);
    if (rank == 1)
        for (int i = 0; i < 4096; i++)
            if (w[i] != (i >= 100 && i < 612 ? 7000000L + i - 100 : 1000000L + i))
                fail("the window holds a wrong word after the put", 512, i);
    if (rank == 0) {
        for (int i = 0; i < 512; i++)
            if (in[i] != 7000000L + i)
                fail("the get brought a wrong word", 512, i);
        printf("put and get: 512 words right\n");
    }
    long one = 1;
    MPI_Accumulate(&one, 1, MPI_LONG, 0, 0, 1, MPI_LONG, MPI_SUM, win);
    MPI_Win_fence(0, win);
    if (rank == 0) {
        if (w[0] != 2)
            fail("accumulate", 1, w[0]);
        printf("accumulate: 2\n");
    }
    MPI_Win_free(&win);
    long v = rank + 1, sum = 0;
    MPI_Allreduce(&v, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (sum != 3)
        fail("allreduce", 1, sum);
    if (rank == 0)
        printf("allreduce: 3\n");
    free(buf);
    MPI_Finalize();
    return 0;
}
