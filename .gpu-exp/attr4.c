#include <cuda.h>
#include <stdio.h>
int main(void) {
  CUdevice d; CUcontext c; CUdeviceptr p; void *h = 0;
  cuInit(0); cuDeviceGet(&d, 0); cuCtxCreate(&c, NULL, 0, d);
  cuMemAlloc(&p, 1 << 20);
  CUresult r = cuPointerGetAttribute(&h, CU_POINTER_ATTRIBUTE_HOST_POINTER, p);
  printf("HOST_POINTER of device memory: %d %p\n", r, h);
  for (int a = 1; a <= 20; a++) { unsigned long long v = 0; r = cuPointerGetAttribute(&v, a, p); printf("attr %d: %d %llx\n", a, r, v); }
  return 0;
}
