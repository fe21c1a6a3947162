/*
 * osu_peer: the OSU Micro-Benchmarks' latency, bw, bibw and message rate
 * loops over MPI, for the comparison report of xdev-bench (`xdev-bench
 * report`), which builds it with each installed MPI's mpicc and runs it on
 * two ranks.
 *
 * The loops, iteration counts and window are those of xdev-bench (and of
 * osu_latency, osu_bw, osu_bibw, osu_mbw_mr): latency is half the round trip of a
 * blocking pingpong; bw is a window of 64 MPI_Isend answered by a zero-byte
 * acknowledgement; bibw has both ranks post 64 MPI_Irecv and 64 MPI_Isend
 * and wait for all; rate is osu_mbw_mr's loop with one pair (rank 0 posts 64
 * MPI_Isend, rank 1 64 MPI_Irecv, both wait for all, then a zero-byte
 * acknowledgement: the bw loop, timed on its own) in messages per second,
 * 64 * iterations / time, with bw's counts. Like xdev-bench, each size is
 * measured ROUNDS times and the best round is kept (OSU's average per
 * round, best round).
 *
 * Usage: mpirun -np 2 osu_peer NAME MAX_SIZE ROUNDS QUICK WARM_UP_BYTES [MIN_SIZE TESTS]
 * MIN_SIZE and TESTS (a comma list of latency, bw, bibw and rate) narrow
 * the run, as xdev-bench's --min-size and --test do; by default every test
 * from the smallest size (0 bytes for latency, 1 for the others). The
 * buffers are MAX_SIZE bytes either way, page-aligned from 4 KiB up.
 * Prints one JSON record per test and size on rank 0, in xdev-bench's
 * schema ("floor" is 0: the report divides by the floors xdev-bench
 * measured in the same run).
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define WINDOW 64
/* From this size up buffers are huge-page backed (xdev's HUGE_MIN_BYTES). */
#define HUGE_MIN ((size_t)256 << 10)

/* A buffer of `max` bytes: page-aligned from one page up, as OSU's
 * posix_memalign'ed buffers and xdev-bench's (`bench_buffer`) are, so that
 * both sides of a comparison copy between memory placed alike; malloc'ed
 * below a page. From 256 KiB up it is also aligned to 2 MiB and advised
 * MADV_HUGEPAGE before its first touch, as xdev's page-aligned buffers of
 * that size are backed by huge pages (unless XDEV_HUGE_PAGES=0 turns both
 * off). Exits on failure. */
static char *buffer(size_t max) {
  const size_t huge = (size_t)2 << 20;
  const char *off = getenv("XDEV_HUGE_PAGES");
  int thp = max >= HUGE_MIN && !(off && strcmp(off, "0") == 0);
  /* Huge-page backed: whole 2 MiB pages, so that the advice covers only
   * memory this buffer owns. */
  size_t bytes = thp ? (max + huge - 1) & ~(huge - 1) : max;
  void *p = NULL;
  if (max >= 4096) {
    if (posix_memalign(&p, thp ? huge : 4096, bytes) != 0)
      p = NULL;
    else if (thp)
      (void)madvise(p, bytes, MADV_HUGEPAGE);
  } else {
    p = malloc(max > 0 ? max : 1);
  }
  if (p == NULL) {
    fprintf(stderr, "osu_peer: cannot allocate %zu bytes\n", max);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return p;
}

/* The buffers of one class of sizes: one for the pingpong, a window each
 * to send from and receive into. */
struct set {
  char *one;
  char *s[WINDOW], *r[WINDOW];
};

/* Fills `b` with buffers of `max` bytes (see `buffer`), touched. */
static void make_set(struct set *b, size_t max) {
  b->one = buffer(max);
  memset(b->one, 0xa5, max);
  for (int w = 0; w < WINDOW; w++) {
    b->s[w] = buffer(max);
    b->r[w] = buffer(max);
    memset(b->s[w], 0x5a, max);
    memset(b->r[w], 1, max);
  }
}

/* The set a message of `size` bytes uses. */
static struct set *set_for(struct set *small, struct set *large, size_t size) {
  return size < HUGE_MIN ? small : large;
}

/* Whether `tests` (a comma list, or NULL for all) names `test`. */
static int wanted(const char *tests, const char *test) {
  if (tests == NULL)
    return 1;
  size_t n = strlen(test);
  for (const char *p = tests; *p;) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len == n && strncmp(p, test, n) == 0)
      return 1;
    if (!end)
      break;
    p = end + 1;
  }
  return 0;
}

/* xdev-bench's large_warm_up: windows enough to move `warm_up_bytes` per
 * side (its WARM_UP_BYTES, which the report passes), at least 2, before
 * timing a window test of messages above 8 KiB. */
static int large_warm_up(size_t size, size_t warm_up_bytes) {
  size_t per = (size ? size : 1) * WINDOW;
  size_t n = (warm_up_bytes + per - 1) / per;
  return n < 2 ? 2 : (int)n;
}

static void iterations(int bw, size_t size, int quick, size_t warm_up_bytes, int *iters,
                       int *skip) {
  if (bw) {
    *iters = size > 8192 ? 20 : 100;
    *skip = size > 8192 ? large_warm_up(size, warm_up_bytes) : 10;
  } else {
    *iters = size > 8192 ? 1000 : 10000;
    *skip = size > 8192 ? 10 : 100;
  }
  if (quick) {
    *iters = *iters / 10 > 2 ? *iters / 10 : 2;
    *skip = *skip / 10 > 1 ? *skip / 10 : 1;
  }
}

/* Seconds for `iters` timed pingpongs after `skip` untimed ones. */
static double latency(int me, char *buf, size_t size, int iters, int skip) {
  double start = 0;
  for (int i = 0; i < iters + skip; i++) {
    if (i == skip) {
      MPI_Barrier(MPI_COMM_WORLD);
      start = MPI_Wtime();
    }
    if (me == 0) {
      MPI_Send(buf, (int)size, MPI_CHAR, 1, 1, MPI_COMM_WORLD);
      MPI_Recv(buf, (int)size, MPI_CHAR, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else {
      MPI_Recv(buf, (int)size, MPI_CHAR, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      MPI_Send(buf, (int)size, MPI_CHAR, 0, 1, MPI_COMM_WORLD);
    }
  }
  return MPI_Wtime() - start;
}

/* Seconds for `iters` timed windows (osu_bw when !bi, osu_bibw when bi). */
static double bandwidth(int me, int bi, char **sbufs, char **rbufs, size_t size,
                        int iters, int skip) {
  MPI_Request reqs[2 * WINDOW];
  double start = 0;
  int peer = 1 - me;
  for (int i = 0; i < iters + skip; i++) {
    if (i == skip) {
      MPI_Barrier(MPI_COMM_WORLD);
      start = MPI_Wtime();
    }
    if (bi) {
      for (int w = 0; w < WINDOW; w++)
        MPI_Irecv(rbufs[w], (int)size, MPI_CHAR, peer, 4, MPI_COMM_WORLD, &reqs[w]);
      for (int w = 0; w < WINDOW; w++)
        MPI_Isend(sbufs[w], (int)size, MPI_CHAR, peer, 4, MPI_COMM_WORLD,
                  &reqs[WINDOW + w]);
      MPI_Waitall(2 * WINDOW, reqs, MPI_STATUSES_IGNORE);
    } else if (me == 0) {
      for (int w = 0; w < WINDOW; w++)
        MPI_Isend(sbufs[w], (int)size, MPI_CHAR, 1, 2, MPI_COMM_WORLD, &reqs[w]);
      MPI_Waitall(WINDOW, reqs, MPI_STATUSES_IGNORE);
      MPI_Recv(NULL, 0, MPI_CHAR, 1, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else {
      for (int w = 0; w < WINDOW; w++)
        MPI_Irecv(rbufs[w], (int)size, MPI_CHAR, 0, 2, MPI_COMM_WORLD, &reqs[w]);
      MPI_Waitall(WINDOW, reqs, MPI_STATUSES_IGNORE);
      MPI_Send(NULL, 0, MPI_CHAR, 0, 3, MPI_COMM_WORLD);
    }
  }
  return MPI_Wtime() - start;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int me, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if ((argc != 6 && argc != 8) || n != 2) {
    if (me == 0)
      fprintf(stderr, "usage: mpirun -np 2 osu_peer NAME MAX_SIZE ROUNDS QUICK WARM_UP_BYTES "
                      "[MIN_SIZE TESTS]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const char *name = argv[1];
  size_t max = strtoul(argv[2], NULL, 10);
  int rounds = atoi(argv[3]);
  int quick = atoi(argv[4]);
  size_t warm_up_bytes = strtoul(argv[5], NULL, 10);
  size_t min = argc == 8 ? strtoul(argv[6], NULL, 10) : 0;
  const char *tests = argc == 8 ? argv[7] : NULL;
  if (rounds < 1)
    rounds = 1;
  /* Two sets of buffers, as OSU allocates one at the largest size: one for
   * sizes below 256 KiB (4 KiB pages) and one from 256 KiB (huge pages),
   * since xdev-bench allocates each size's buffers apart, and a size below
   * 256 KiB never runs on huge pages there. (One set of the largest size,
   * huge pages from 256 KiB, ran every size on huge pages.) */
  struct set small = {0}, large = {0};
  if (min < HUGE_MIN)
    make_set(&small, max < HUGE_MIN ? max : HUGE_MIN - 1);
  if (max >= HUGE_MIN)
    make_set(&large, max);

  for (size_t size = min; wanted(tests, "latency") && size <= max;
       size = size ? 2 * size : 1) {
    int iters, skip;
    iterations(0, size, quick, warm_up_bytes, &iters, &skip);
    double best = 1e300;
    for (int r = 0; r < rounds; r++) {
      double t = latency(me, set_for(&small, &large, size)->one, size, iters, skip);
      if (t < best)
        best = t;
    }
    if (me == 0)
      printf("{\"device\":\"%s\",\"test\":\"latency\",\"size\":%zu,\"value\":%.4f,"
             "\"unit\":\"us\",\"floor\":0}\n",
             name, size, best * 1e6 / (2.0 * iters));
    fflush(stdout);
  }
  /* bw, bibw, then rate (the bw loop, counted in messages). */
  for (int test = 0; test < 3; test++) {
    int bi = test == 1;
    if (!wanted(tests, test == 0 ? "bw" : bi ? "bibw" : "rate"))
      continue;
    for (size_t size = min > 1 ? min : 1; size <= max; size *= 2) {
      int iters, skip;
      iterations(1, size, quick, warm_up_bytes, &iters, &skip);
      double best = 1e300;
      for (int r = 0; r < rounds; r++) {
        struct set *b = set_for(&small, &large, size);
        double t = bandwidth(me, bi, b->s, b->r, size, iters, skip);
        if (t < best)
          best = t;
      }
      double bytes = (double)size * WINDOW * iters * (bi ? 2 : 1);
      if (me == 0 && test == 2)
        printf("{\"device\":\"%s\",\"test\":\"rate\",\"size\":%zu,\"value\":%.4f,"
               "\"unit\":\"msg/s\",\"floor\":0}\n",
               name, size, (double)WINDOW * iters / best);
      else if (me == 0)
        printf("{\"device\":\"%s\",\"test\":\"%s\",\"size\":%zu,\"value\":%.4f,"
               "\"unit\":\"MB/s\",\"floor\":0}\n",
               name, bi ? "bibw" : "bw", size, bytes / 1e6 / best);
      fflush(stdout);
    }
  }
  MPI_Finalize();
  return 0;
}
