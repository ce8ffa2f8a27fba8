// streams_events: S streams (blocking, non-blocking, prioritized) each doing async H2D from pinned
// memory, a kernel and async D2H concurrently; events recorded around the work and timed with
// cuEventElapsedTime (only ">= 0" is printed); a chain across streams with cuStreamWaitEvent
// where stream i's combine kernel reads stream i-1's output; cuEventQuery/cuStreamQuery after the
// work; the NULL stream and CU_STREAM_PER_THREAD used as well. Every result checked on the host.
#include "../common.h"

enum { S = 6 };
static unsigned lcg(unsigned v, unsigned salt, int iters) {
  for (int k = 0; k < iters; k++) v = v * 1664525u + 1013904223u + salt;
  return v;
}

int main() {
  init_primary(NULL);
  CUmodule mod = load_module("streams_events.fatbin");
  CUfunction step, combine;
  CK(cuModuleGetFunction(&step, mod, "step"));
  CK(cuModuleGetFunction(&combine, mod, "combine"));
  const int n = 1 << 18, iters = 200;
  size_t bytes = (size_t)n * 4;
  CUstream st[S];
  int lo, hi;
  CK(cuCtxGetStreamPriorityRange(&lo, &hi));
  for (int i = 0; i < S; i++) {
    if (i == 0) CK(cuStreamCreate(&st[i], CU_STREAM_DEFAULT));
    else if (i == 1) CK(cuStreamCreateWithPriority(&st[i], CU_STREAM_NON_BLOCKING, hi));
    else CK(cuStreamCreate(&st[i], CU_STREAM_NON_BLOCKING));
  }
  unsigned flags; int prio;
  CK(cuStreamGetFlags(st[1], &flags));
  CK(cuStreamGetPriority(st[1], &prio));
  printf("stream 1: flags=%u priority=%s\n", flags, prio == hi ? "greatest" : "other");
  unsigned *hin[S], *hout[S], *hres[S];
  CUdeviceptr din[S], dout[S], dres[S];
  CUevent start[S], afterStep[S], stop[S];
  for (int i = 0; i < S; i++) {
    CK(cuMemHostAlloc((void **)&hin[i], bytes, 0));
    CK(cuMemHostAlloc((void **)&hout[i], bytes, CU_MEMHOSTALLOC_PORTABLE));
    CK(cuMemAllocHost((void **)&hres[i], bytes));
    CK(cuMemAlloc(&din[i], bytes)); CK(cuMemAlloc(&dout[i], bytes)); CK(cuMemAlloc(&dres[i], bytes));
    for (int k = 0; k < n; k++) hin[i][k] = (unsigned)(k * 2654435761u) ^ (unsigned)(i * 0x9e3779b9u);
    memset(hout[i], 0, bytes); memset(hres[i], 0, bytes);
    CK(cuEventCreate(&start[i], CU_EVENT_DEFAULT));
    CK(cuEventCreate(&afterStep[i], CU_EVENT_DISABLE_TIMING));
    CK(cuEventCreate(&stop[i], CU_EVENT_BLOCKING_SYNC));
  }
  CK(cuCtxSynchronize());
  // phase 1: independent work on every stream, issued breadth-first so that streams overlap
  int nn = n, it = iters;
  for (int i = 0; i < S; i++) {
    CK(cuEventRecord(start[i], st[i]));
    CK(cuMemcpyHtoDAsync(din[i], hin[i], bytes, st[i]));
  }
  for (int i = 0; i < S; i++) {
    unsigned salt = 17u * i;
    void *p[] = {&din[i], &dout[i], &salt, &it, &nn};
    CK(cuLaunchKernel(step, n / 256, 1, 1, 256, 1, 1, 0, st[i], p, 0));
    CK(cuEventRecord(afterStep[i], st[i]));
  }
  for (int i = 0; i < S; i++) CK(cuMemcpyDtoHAsync(hout[i], dout[i], bytes, st[i]));
  // phase 2: a chain across streams: stream i combines its output with stream i-1's
  for (int i = 0; i < S; i++) {
    int prev = (i + S - 1) % S;
    if (i > 0) CK(cuStreamWaitEvent(st[i], afterStep[prev], 0));
    // stream 0 uses its own output twice (nothing earlier to wait for)
    CUdeviceptr b = i > 0 ? dout[prev] : dout[0];
    void *p[] = {&dout[i], &b, &dres[i], &nn};
    CK(cuLaunchKernel(combine, n / 256, 1, 1, 256, 1, 1, 0, st[i], p, 0));
    CK(cuMemcpyDtoHAsync(hres[i], dres[i], bytes, st[i]));
    CK(cuEventRecord(stop[i], st[i]));
  }
  for (int i = S - 1; i >= 0; i--) CK(cuEventSynchronize(stop[i]));
  int failures = 0;
  for (int i = 0; i < S; i++) {
    float ms = -1;
    CK(cuEventElapsedTime(&ms, start[i], stop[i]));
    CK(cuEventQuery(stop[i]));
    CK(cuStreamQuery(st[i]));
    int ok = ms >= 0;
    for (int k = 0; k < n; k++) {
      unsigned a = lcg(hin[i][k], 17u * i, iters);
      int prev = i > 0 ? i - 1 : 0;
      unsigned b = lcg(hin[prev][k], 17u * prev, iters);
      if (hout[i][k] != a || hres[i][k] != (a ^ (b >> 3) ^ (unsigned)k)) { ok = 0; break; }
    }
    printf("stream %d: elapsed>=0 %s, step+combine %s, checksums %016llx %016llx\n", i,
           ms >= 0 ? "yes" : "no", ok ? "ok" : "FAIL", (unsigned long long)checksum(hout[i], bytes),
           (unsigned long long)checksum(hres[i], bytes));
    failures += !ok;
  }
  // the NULL (legacy) stream and the per-thread default stream
  CK(cuMemsetD32Async(dres[0], 0x01020304u, n, NULL));
  CK(cuStreamSynchronize(NULL));
  CK(cuMemsetD32Async(dres[1], 0x0a0b0c0du, n, CU_STREAM_PER_THREAD));
  CK(cuStreamSynchronize(CU_STREAM_PER_THREAD));
  CK(cuMemcpyDtoH(hres[0], dres[0], bytes));
  CK(cuMemcpyDtoH(hres[1], dres[1], bytes));
  int ok = 1;
  for (int k = 0; k < n; k++) ok &= hres[0][k] == 0x01020304u && hres[1][k] == 0x0a0b0c0du;
  printf("null and per-thread streams: %s\n", ok ? "ok" : "FAIL");
  failures += !ok;
  for (int i = 0; i < S; i++) {
    CK(cuEventDestroy(start[i])); CK(cuEventDestroy(afterStep[i])); CK(cuEventDestroy(stop[i]));
    CK(cuStreamDestroy(st[i]));
    CK(cuMemFreeHost(hin[i])); CK(cuMemFreeHost(hout[i])); CK(cuMemFreeHost(hres[i]));
    CK(cuMemFree(din[i])); CK(cuMemFree(dout[i])); CK(cuMemFree(dres[i]));
  }
  CK(cuModuleUnload(mod));
  printf("streams_events: %s\n", failures ? "FAIL" : "PASS");
  return failures ? 1 : 0;
}
