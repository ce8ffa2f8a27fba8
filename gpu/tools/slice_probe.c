// How long a thread woken from a futex sleep waits for a core on a host full of CPU burners,
// with the kernel's default time slice and with a short one asked for (sched_setattr's
// sched_runtime of a SCHED_OTHER thread, Linux 6.12+): the mechanism behind adaptive
// waiting's slow waits under load (issue 12 §4). No GPU, no Remora.
//
//   cc -O2 -pthread -o slice_probe gpu/tools/slice_probe.c
//   ./slice_probe BURNERS SLICE_US SERVER_SPIN_US [ROUND_TRIPS]    (default 20000)
//
// A "client" thread and a "server" thread ping-pong through two words, as a shared-memory
// client and its server do: the client works 20 µs (spinning), publishes a request and wakes
// the server with FUTEX_WAKE when it said it sleeps, then spins on the reply. The server
// spins SERVER_SPIN_US for the next request, then sleeps on a futex. BURNERS processes spin
// beside them. SLICE_US (0: the default) is asked for by the server thread only.
//
// Prints one line: "burners=B slice_us=S server_spin_us=P wake: mean p50 p99 max >1ms=N |
// round trip: mean p50 p99 max >1ms=N". "wake" is from the request's publication to the
// server seeing it (its wake-up or its next look); "round trip" to the client seeing the reply.
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct attr {
  uint32_t size, policy;
  uint64_t flags;
  int32_t nice;
  uint32_t priority;
  uint64_t runtime, deadline, period;
};

static _Atomic uint32_t req, rep, server_sleeping;
static _Atomic uint64_t seen_at;
static long slice_ns, server_spin_ns;

static uint64_t now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void *server(void *unused) {
  (void)unused;
  if (slice_ns) {
    struct attr a;
    memset(&a, 0, sizeof a);
    a.size = sizeof a;
    a.flags = 0x08; /* SCHED_FLAG_KEEP_POLICY */
    a.nice = getpriority(PRIO_PROCESS, 0);
    a.runtime = (uint64_t)slice_ns;
    if (syscall(SYS_sched_setattr, 0, &a, 0) != 0) {
      perror("sched_setattr");
      exit(2);
    }
  }
  uint32_t seen = 0;
  for (;;) {
    uint64_t t0 = now();
    while (atomic_load(&req) == seen && now() - t0 < (uint64_t)server_spin_ns) {
    }
    if (atomic_load(&req) == seen) {
      atomic_store(&server_sleeping, 1);
      while (atomic_load(&req) == seen)
        syscall(SYS_futex, &req, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
      atomic_store(&server_sleeping, 0);
    }
    seen = atomic_load(&req);
    atomic_store(&seen_at, now());
    atomic_store(&rep, seen);
  }
  return NULL;
}

static int cmp(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static void summary(const char *name, uint64_t *v, int n) {
  double sum = 0;
  int over = 0;
  for (int i = 0; i < n; i++) {
    sum += (double)v[i];
    over += v[i] > 1000000;
  }
  qsort(v, (size_t)n, sizeof *v, cmp);
  printf("%s: mean %.1f p50 %.1f p99 %.1f max %.1f >1ms=%d", name, sum / n / 1e3, v[n / 2] / 1e3,
         v[n * 99 / 100] / 1e3, v[n - 1] / 1e3, over);
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s BURNERS SLICE_US SERVER_SPIN_US [ROUND_TRIPS]\n", argv[0]);
    return 1;
  }
  int burners = atoi(argv[1]);
  slice_ns = atol(argv[2]) * 1000;
  server_spin_ns = atol(argv[3]) * 1000;
  int n = argc > 4 ? atoi(argv[4]) : 20000;
  if (burners < 0 || burners > 512 || n < 100) {
    fprintf(stderr, "BURNERS 0-512, ROUND_TRIPS at least 100\n");
    return 1;
  }
  pid_t *pids = calloc((size_t)burners + 1, sizeof *pids);
  for (int i = 0; i < burners; i++) {
    if ((pids[i] = fork()) == 0) {
      volatile unsigned long x = 0;
      for (;;)
        x++;
    }
  }
  usleep(200000);
  pthread_t th;
  pthread_create(&th, NULL, server, NULL);
  uint64_t *rt = malloc(sizeof *rt * (size_t)n), *wake = malloc(sizeof *wake * (size_t)n);
  for (int i = 0; i < n; i++) {
    uint64_t w = now();
    while (now() - w < 20000) {
    }
    uint64_t t0 = now();
    uint32_t r = (uint32_t)i + 1;
    atomic_store(&req, r);
    if (atomic_load(&server_sleeping))
      syscall(SYS_futex, &req, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    while (atomic_load(&rep) != r) {
    }
    rt[i] = now() - t0;
    wake[i] = atomic_load(&seen_at) - t0;
  }
  printf("burners=%d slice_us=%ld server_spin_us=%ld ", burners, slice_ns / 1000,
         server_spin_ns / 1000);
  summary("wake", wake, n);
  printf(" | ");
  summary("round trip", rt, n);
  printf("\n");
  for (int i = 0; i < burners; i++)
    kill(pids[i], SIGKILL);
  while (wait(NULL) > 0) {
  }
  return 0;
}
