// Synchronous 1-D copies of one size, pinned (cuMemAllocHost) and pageable (malloc), both
// directions, timed with the driver API: a program to run under `remora run --profile` to see
// where a copy's time goes (client call profile and server session profile), beside
// `remora bench copy`, which measures the same copies without profiling.
//
//   cc -O2 -I$CUDA/include -o copy_probe copy_probe.c -lcuda && ./copy_probe [MiB] [reps]
//
// Prints the median GB/s of each (memory, direction) and checks the bytes that came back.
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(x)                                                        \
  do {                                                                  \
    CUresult r_ = (x);                                                  \
    if (r_ != CUDA_SUCCESS) {                                           \
      fprintf(stderr, "%s failed: %d (line %d)\n", #x, r_, __LINE__); \
      exit(1);                                                          \
    }                                                                   \
  } while (0)

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  size_t len = (size_t)(argc > 1 ? atoi(argv[1]) : 64) << 20;
  int reps = argc > 2 ? atoi(argv[2]) : 8;
  if (reps < 1 || reps > 64) reps = 8;
  CUdevice dev;
  CUcontext ctx;
  CUdeviceptr d;
  CHECK(cuInit(0));
  CHECK(cuDeviceGet(&dev, 0));
  CHECK(cuCtxCreate(&ctx, NULL, 0, dev));
  CHECK(cuMemAlloc(&d, len));
  void *pinned;
  CHECK(cuMemAllocHost(&pinned, len));
  unsigned char *pageable = malloc(len);
  if (!pageable) return 1;
  struct {
    const char *name;
    unsigned char *host;
  } kinds[] = {{"pinned", pinned}, {"pageable", pageable}};
  int bad = 0;
  for (int k = 0; k < 2; k++) {
    unsigned char *h = kinds[k].host;
    for (int dir = 0; dir < 2; dir++) {
      double gbps[64];
      for (int r = 0; r <= reps; r++) {
        if (dir == 1) memset(h, 0, len);
        else for (size_t i = 0; i < len; i += 4096) h[i] = (unsigned char)(i / 4096 + r + k);
        double t0 = now();
        if (dir == 0) CHECK(cuMemcpyHtoD(d, h, len));
        else CHECK(cuMemcpyDtoH(h, d, len));
        double t = now() - t0;
        if (r > 0) gbps[r - 1] = len / t / 1e9;  // r = 0 warms up
        if (dir == 1)
          for (size_t i = 0; i < len; i += 4096)
            if (h[i] != (unsigned char)(i / 4096 + reps + k)) {
              bad++;
              break;
            }
      }
      qsort(gbps, reps, sizeof *gbps, cmp);
      printf("%s %s %.2f GB/s\n", kinds[k].name, dir == 0 ? "htod" : "dtoh", gbps[reps / 2]);
    }
  }
  printf("%s\n", bad ? "MISMATCH" : "bytes ok");
  return bad != 0;
}
