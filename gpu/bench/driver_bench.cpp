// driver_bench: driver API latencies and bandwidths, printed as one JSON object on stdout.
//   null call            cuDeviceGetCount p50/p99
//   alloc+free           cuMemAlloc + cuMemFree of 1 MiB p50/p99
//   launch throughput    N empty launches (and N seven-parameter launches) then one synchronize,
//                        microseconds per launch
//   launch submit        the same N empty launches, time until the last cuLaunchKernel returns
//   launch + sync        one empty launch + cuStreamSynchronize, p50/p99
//   idle synchronize     cuCtxSynchronize with nothing queued: remoted, a full round trip
//   memcpy               H2D/D2H, pageable/pinned (cuMemHostAlloc), 4 KiB to 512 MiB: GB/s and
//                        microseconds per copy
//   driver_bench [SCALE]   SCALE (default 1) divides the iteration counts, for quick runs.
#include "../common.h"
#include <time.h>
#include <algorithm>
#include <vector>

static double now_us() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}
static void pct(const char *key, std::vector<double> &t, bool comma = true) {
  std::sort(t.begin(), t.end());
  printf("  \"%s\": {\"p50\": %.3f, \"p99\": %.3f, \"n\": %zu}%s\n", key, t[t.size() / 2], t[t.size() * 99 / 100],
         t.size(), comma ? "," : "");
}

int main(int argc, char **argv) {
  int scale = argc > 1 ? atoi(argv[1]) : 1;
  if (scale < 1) scale = 1;
  CUdevice dev;
  init_primary(&dev);
  char name[256];
  CK(cuDeviceGetName(name, sizeof name, dev));
  int sms, drv;
  CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
  CK(cuDriverGetVersion(&drv));
  CUmodule mod = load_module("driver_bench.fatbin");
  CUfunction empty, seven;
  CK(cuModuleGetFunction(&empty, mod, "empty"));
  CK(cuModuleGetFunction(&seven, mod, "seven"));
  printf("{\n  \"device\": \"%s\", \"sms\": %d, \"driver_version\": %d,\n", name, sms, drv);
  { // null call
    int n;
    std::vector<double> t;
    for (int i = 0; i < 100000 / scale; i++) {
      double s = now_us();
      CK(cuDeviceGetCount(&n));
      t.push_back(now_us() - s);
    }
    pct("null_call_cuDeviceGetCount_us", t);
  }
  { // alloc + free 1 MiB
    std::vector<double> t;
    for (int i = 0; i < 5000 / scale; i++) {
      CUdeviceptr d;
      double s = now_us();
      CK(cuMemAlloc(&d, 1 << 20));
      CK(cuMemFree(d));
      t.push_back(now_us() - s);
    }
    pct("alloc_free_1MiB_us", t);
  }
  CUstream st = NULL;  // the legacy default stream, like <<<>>> without a stream
  { // launch throughput
    const int N = 10000 / scale;
    // Warm-up as long as the measured loops, so that neither measurement pays for clocks
    // ramping up or the driver's queues growing (seen natively: the first loop measured
    // ran up to 30% slower than the second).
    for (int i = 0; i < N; i++) CK(cuLaunchKernel(empty, 1, 1, 1, 1, 1, 1, 0, st, NULL, NULL));
    CK(cuCtxSynchronize());
    double s = now_us();
    for (int i = 0; i < N; i++) CK(cuLaunchKernel(empty, 1, 1, 1, 1, 1, 1, 0, st, NULL, NULL));
    double submitted = now_us();
    CK(cuCtxSynchronize());
    printf("  \"empty_launch_throughput_us_per_launch\": %.3f,\n", (now_us() - s) / N);
    printf("  \"empty_launch_submit_us_per_launch\": %.3f,\n", (submitted - s) / N);
    CUdeviceptr p;
    CK(cuMemAlloc(&p, 64));
    int b = 2, c = 3; double d = 1.0; long long e = 5;
    s = now_us();
    for (int i = 0; i < N; i++) {
      void *args[] = {&i, &b, &c, &p, &p, &d, &e};
      CK(cuLaunchKernel(seven, 1, 1, 1, 32, 1, 1, 0, st, args, NULL));
    }
    CK(cuCtxSynchronize());
    printf("  \"param7_launch_throughput_us_per_launch\": %.3f,\n", (now_us() - s) / N);
    CK(cuMemFree(p));
  }
  { // launch + synchronize
    std::vector<double> t;
    for (int i = 0; i < 5000 / scale; i++) {
      double s = now_us();
      CK(cuLaunchKernel(empty, 1, 1, 1, 1, 1, 1, 0, st, NULL, NULL));
      CK(cuStreamSynchronize(st));
      t.push_back(now_us() - s);
    }
    pct("launch_sync_us", t);
  }
  { // synchronize with nothing queued
    std::vector<double> t;
    for (int i = 0; i < 20000 / scale; i++) {
      double s = now_us();
      CK(cuCtxSynchronize());
      t.push_back(now_us() - s);
    }
    pct("idle_ctx_synchronize_us", t);
  }
  printf("  \"memcpy\": [\n");
  size_t sizes[] = {4096, 65536, 1 << 20, 16 << 20, 64 << 20, 512 << 20};
  int first = 1;
  for (size_t sz : sizes) {
    CUdeviceptr d;
    CK(cuMemAlloc(&d, sz));
    void *h = malloc(sz), *hp;
    memset(h, 1, sz);
    CK(cuMemHostAlloc(&hp, sz, 0));
    memset(hp, 1, sz);
    size_t budget = (512u << 20) / scale;
    int reps = (int)std::min<size_t>(1000, std::max<size_t>(3, budget / sz));
    for (int k = 0; k < 4; k++) {
      int h2d = k % 2 == 0, pinned = k >= 2;
      void *host = pinned ? hp : h;
      auto copy = [&]() {
        if (h2d) CK(cuMemcpyHtoD(d, host, sz));
        else CK(cuMemcpyDtoH(host, d, sz));
      };
      copy();
      double s = now_us();
      for (int i = 0; i < reps; i++) copy();
      double u = (now_us() - s) / reps;
      printf("%s    {\"dir\": \"%s\", \"mem\": \"%s\", \"bytes\": %zu, \"reps\": %d, \"gbps\": %.3f, \"us_per_copy\": %.3f}",
             first ? "" : ",\n", h2d ? "H2D" : "D2H", pinned ? "pinned" : "pageable", sz, reps, sz / u / 1e3, u);
      first = 0;
    }
    CK(cuMemFree(d));
    CK(cuMemFreeHost(hp));
    free(h);
  }
  printf("\n  ]\n}\n");
  CK(cuModuleUnload(mod));
  return 0;
}
