// How fast threads write host memory of the two kinds a device-to-host copy over a socket
// lands in: a malloc'd buffer (pageable) and what the client maps for cuMemAllocHost without a
// data area (fresh read-write pages mapped MAP_FIXED inside a large PROT_NONE MAP_NORESERVE
// reservation, as for unified addressing). Each of T threads copies 4 MiB chunks (chunk i to
// thread i % T) from its own source into the destination, as the lanes of a striped copy do.
//
//   cc -O2 -pthread -o map_write_bw map_write_bw.c && ./map_write_bw [MiB] [reps]
//
// Prints GB/s per (kind, threads). Not a test: a probe for docs/architecture.md's copy figures.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define CHUNK (4u << 20)

struct job {
  char *dst;
  size_t len;
  int t, threads;
  char *src;
};

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *worker(void *p) {
  struct job *j = p;
  size_t n = (j->len + CHUNK - 1) / CHUNK;
  for (size_t i = (size_t)j->t; i < n; i += (size_t)j->threads) {
    size_t off = i * CHUNK, len = j->len - off < CHUNK ? j->len - off : CHUNK;
    memcpy(j->dst + off, j->src, len);
  }
  return NULL;
}

static double run(char *dst, size_t len, int threads, int reps) {
  pthread_t th[16];
  struct job jobs[16];
  double best = 0;
  for (int t = 0; t < threads; t++) {
    jobs[t] = (struct job){dst, len, t, threads, malloc(CHUNK)};
    memset(jobs[t].src, 0x5a + t, CHUNK);
  }
  for (int r = 0; r < reps; r++) {
    double t0 = now();
    for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, worker, &jobs[t]);
    for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    double gbps = len / (now() - t0) / 1e9;
    if (gbps > best) best = gbps;
  }
  for (int t = 0; t < threads; t++) free(jobs[t].src);
  return best;
}

int main(int argc, char **argv) {
  size_t len = (size_t)(argc > 1 ? atoi(argv[1]) : 64) << 20;
  int reps = argc > 2 ? atoi(argv[2]) : 5;
  char *heap = malloc(len);
  memset(heap, 1, len);
  size_t reserve = (size_t)64 << 30;
  char *res = mmap(NULL, reserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (res == MAP_FAILED) {
    perror("reserve");
    return 1;
  }
  char *fixed = res + ((size_t)1 << 30);
  if (mmap(fixed, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) {
    perror("map fixed");
    return 1;
  }
  memset(fixed, 1, len);
  int counts[] = {1, 2, 4};
  for (unsigned k = 0; k < sizeof counts / sizeof *counts; k++) {
    printf("threads %d: malloc %.2f GB/s, fixed-in-reservation %.2f GB/s\n", counts[k],
           run(heap, len, counts[k], reps), run(fixed, len, counts[k], reps));
  }
  return 0;
}
