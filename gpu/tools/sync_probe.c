// Times the pieces of a synchronous round trip on the driver this process loads (the real one,
// or Remora's shim under `remora run`): an empty kernel launched and then waited for in
// several ways.
//
//   cc -O2 -I"$CUDA_INCLUDE" -o sync_probe gpu/tools/sync_probe.c -lcuda
//   ./sync_probe [ITERATIONS]          (default 5000)
//
// Prints one line per measurement: "name p50_us p99_us [extra]".
//   launch_only      cuLaunchKernel alone (the stream drained every 64 launches, not timed)
//   launch_sync      cuLaunchKernel + cuStreamSynchronize
//   launch_query     cuLaunchKernel + cuStreamQuery until CUDA_SUCCESS (extra: mean queries)
//   query_idle       cuStreamQuery on an idle stream
//   sync_idle        cuStreamSynchronize on an idle stream
//   launch_word      cuLaunchKernel + cuStreamWriteValue64 into page-locked, device-mapped
//                    host memory + the host spinning on that word (the completion-word idea)
//   launch_event     cuLaunchKernel + cuEventRecord + cuEventSynchronize
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *PTX =
    ".version 8.0\n.target sm_80\n.address_size 64\n"
    ".visible .entry sync_probe_empty()\n{\n\tret;\n}\n";

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

#define CHECK(call)                                                        \
  do {                                                                     \
    CUresult r_ = (call);                                                  \
    if (r_ != CUDA_SUCCESS) {                                              \
      fprintf(stderr, "%s failed: %d (line %d)\n", #call, (int)r_, __LINE__); \
      exit(1);                                                             \
    }                                                                      \
  } while (0)

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void report(const char *name, double *v, int n, const char *extra) {
  qsort(v, n, sizeof *v, cmp);
  printf("%-14s %8.2f %8.2f %s\n", name, v[n / 2], v[(int)(n * 0.99)], extra ? extra : "");
  fflush(stdout);
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 5000;
  if (n < 100) n = 100;
  double *t = calloc(n, sizeof *t);
  CUdevice dev;
  CUcontext ctx;
  CUmodule mod;
  CUfunction f;
  CUstream s;
  CUevent ev;
  CHECK(cuInit(0));
  CHECK(cuDeviceGet(&dev, 0));
  CHECK(cuCtxCreate(&ctx, NULL, 0, dev));
  CHECK(cuModuleLoadData(&mod, PTX));
  CHECK(cuModuleGetFunction(&f, mod, "sync_probe_empty"));
  CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CHECK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
#define LAUNCH() CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL))
  for (int i = 0; i < 200; i++) LAUNCH();
  CHECK(cuStreamSynchronize(s));

  for (int i = 0; i < n; i++) {
    double a = now_us();
    LAUNCH();
    t[i] = now_us() - a;
    if (i % 64 == 63) CHECK(cuStreamSynchronize(s));
  }
  CHECK(cuStreamSynchronize(s));
  report("launch_only", t, n, NULL);

  for (int i = 0; i < n; i++) {
    double a = now_us();
    LAUNCH();
    CHECK(cuStreamSynchronize(s));
    t[i] = now_us() - a;
  }
  report("launch_sync", t, n, NULL);

  long queries = 0;
  for (int i = 0; i < n; i++) {
    double a = now_us();
    LAUNCH();
    CUresult r;
    while ((r = cuStreamQuery(s)) == CUDA_ERROR_NOT_READY) queries++;
    CHECK(r);
    queries++;
    t[i] = now_us() - a;
  }
  char extra[64];
  snprintf(extra, sizeof extra, "queries/iter %.1f", (double)queries / n);
  report("launch_query", t, n, extra);

  for (int i = 0; i < n; i++) {
    double a = now_us();
    CHECK(cuStreamQuery(s));
    t[i] = now_us() - a;
  }
  report("query_idle", t, n, NULL);

  for (int i = 0; i < n; i++) {
    double a = now_us();
    CHECK(cuStreamSynchronize(s));
    t[i] = now_us() - a;
  }
  report("sync_idle", t, n, NULL);

  for (int i = 0; i < n; i++) {
    double a = now_us();
    LAUNCH();
    CHECK(cuEventRecord(ev, s));
    CHECK(cuEventSynchronize(ev));
    t[i] = now_us() - a;
  }
  report("launch_event", t, n, NULL);

  volatile uint64_t *word = NULL;
  CUdeviceptr dword = 0;
  CUresult hr = cuMemHostAlloc((void **)&word, 4096, CU_MEMHOSTALLOC_DEVICEMAP);
  if (hr == CUDA_SUCCESS) hr = cuMemHostGetDevicePointer(&dword, (void *)word, 0);
  if (hr != CUDA_SUCCESS) {
    printf("launch_word    skipped: mapped host memory: error %d\n", (int)hr);
  } else {
    *word = 0;
    long spins = 0;
    int ok = 1;
    for (int i = 0; i < n && ok; i++) {
      double a = now_us();
      LAUNCH();
      CUresult w = cuStreamWriteValue64(s, dword, (uint64_t)(i + 1), 0);
      if (w != CUDA_SUCCESS) {
        printf("launch_word    skipped: cuStreamWriteValue64: error %d\n", (int)w);
        ok = 0;
        break;
      }
      while (*word != (uint64_t)(i + 1)) {
        spins++;
        if (now_us() - a > 1e6) {
          printf("launch_word    FAILED: the word did not change within 1 s\n");
          return 1;
        }
      }
      t[i] = now_us() - a;
    }
    if (ok) {
      snprintf(extra, sizeof extra, "spins/iter %.0f", (double)spins / n);
      report("launch_word", t, n, extra);
    }
  }
  return 0;
}
