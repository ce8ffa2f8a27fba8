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
