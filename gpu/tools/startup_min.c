// The smallest whole CUDA program: a context, one allocation, a copy each way, teardown. It
// measures what Remora itself adds to a program's start and end, without a GPU: built against
// Remora's shim (which is all it loads) and run under `remora bench startup` with the emulated
// backend, e.g.
//
//   cc -O2 -I"$CUDA_INCLUDE" -o startup_min gpu/tools/startup_min.c -Ltarget/release -lcuda
//   remora bench startup --modes embedded,standing --serve-arg=--backend \
//     --serve-arg=emulated --serve-arg=--isolation --serve-arg=process -- ./startup_min
//
// On a GPU host it runs natively too. Prints "ok 1".
#include <cuda.h>
#include <stdio.h>
int main(void) {
  CUdevice d; CUcontext c; CUdeviceptr p; char buf[4096] = {1};
  if (cuInit(0) || cuDeviceGet(&d, 0) || cuCtxCreate(&c, NULL, 0, d)) { printf("init failed\n"); return 1; }
  if (cuMemAlloc(&p, sizeof buf) || cuMemcpyHtoD(p, buf, sizeof buf) || cuMemcpyDtoH(buf, p, sizeof buf)) { printf("copy failed\n"); return 1; }
  cuMemFree(p); cuCtxDestroy(c);
  printf("ok %d\n", buf[0]);
  return 0;
}
