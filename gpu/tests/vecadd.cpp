// vecadd MODE: one vector add, the kernel loaded from a different image kind per mode:
//   cubin   cuModuleLoadData on an sm_90 cubin (ELF), context from cuCtxCreate
//   ptx     cuModuleLoadDataEx on NUL-terminated PTX text (JIT), with a JIT log buffer option
//   fatbin  cuModuleLoadData on a fatbin holding sm_80 + sm_90 SASS and compute_90 PTX
//   library cuLibraryLoadData on the same fatbin, cuLibraryGetKernel, launched as a CUkernel
#include "../common.h"

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "cubin";
  CUdevice dev;
  CUcontext ctx = NULL;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  int use_created = strcmp(mode, "cubin") == 0;
  if (use_created) {
    CK(cuCtxCreate(&ctx, NULL, 0, dev));
  } else {
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
  }
  CUmodule mod = NULL;
  CUlibrary lib = NULL;
  CUfunction fn = NULL;
  if (!strcmp(mode, "cubin")) {
    mod = load_module("vecadd.cubin");
  } else if (!strcmp(mode, "ptx")) {
    size_t len;
    void *ptx = load_file("vecadd.ptx", &len, 1);
    static char errlog[4096];
    CUjit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void *vals[] = {errlog, (void *)(uintptr_t)sizeof errlog};
    CUresult r = cuModuleLoadDataEx(&mod, ptx, 2, opts, vals);
    if (r != CUDA_SUCCESS) fprintf(stderr, "JIT error log: %s\n", errlog);
    CK(r);
    free(ptx);
  } else if (!strcmp(mode, "fatbin")) {
    mod = load_module("vecadd.fatbin");
  } else if (!strcmp(mode, "library")) {
    size_t len;
    void *fb = load_file("vecadd.fatbin", &len, 0);
    CK(cuLibraryLoadData(&lib, fb, NULL, NULL, 0, NULL, NULL, 0));
    free(fb);
  } else {
    fprintf(stderr, "usage: vecadd cubin|ptx|fatbin|library\n");
    return 2;
  }
  CUkernel kern = NULL;
  if (lib) {
    unsigned count = 0;
    CK(cuLibraryGetKernelCount(&count, lib));
    printf("library kernels: %u\n", count);
    CK(cuLibraryGetKernel(&kern, lib, "vecadd"));
    CK(cuKernelGetFunction(&fn, kern));
  } else {
    CK(cuModuleGetFunction(&fn, mod, "vecadd"));
  }
  const char *name = NULL;
  CK(cuFuncGetName(&name, fn));
  printf("vecadd %s: function %s\n", mode, name);

  const int n = (1 << 20) + 3;
  size_t bytes = (size_t)n * sizeof(float);
  float *a = (float *)malloc(bytes), *b = (float *)malloc(bytes), *c = (float *)malloc(bytes);
  for (int i = 0; i < n; i++) { a[i] = (float)(i % 65536) * 0.5f; b[i] = (float)(i % 1000) * 0.25f; }
  CUdeviceptr da, db, dc;
  CK(cuMemAlloc(&da, bytes));
  CK(cuMemAlloc(&db, bytes));
  CK(cuMemAlloc(&dc, bytes));
  CK(cuMemcpyHtoD(da, a, bytes));
  CK(cuMemcpyHtoD(db, b, bytes));
  CK(cuMemsetD32(dc, 0xdeadbeef, n));
  int nn = n;
  void *params[] = {&da, &db, &dc, &nn};
  unsigned block = 256, grid = (n + block - 1) / block;
  if (kern)
    CK(cuLaunchKernel((CUfunction)kern, grid, 1, 1, block, 1, 1, 0, NULL, params, NULL));
  else
    CK(cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, NULL, params, NULL));
  CK(cuCtxSynchronize());
  CK(cuMemcpyDtoH(c, dc, bytes));
  int bad = 0;
  for (int i = 0; i < n; i++)
    if (c[i] != a[i] + b[i]) { if (bad++ < 5) fprintf(stderr, "c[%d]=%g want %g\n", i, c[i], a[i] + b[i]); }
  printf("vecadd %s: n=%d grid=%u block=%u mismatches=%d checksum=%016llx\n", mode, n, grid, block, bad,
         (unsigned long long)checksum(c, bytes));
  CK(cuMemFree(da));
  CK(cuMemFree(db));
  CK(cuMemFree(dc));
  if (lib) CK(cuLibraryUnload(lib));
  else CK(cuModuleUnload(mod));
  if (use_created) CK(cuCtxDestroy(ctx));
  else CK(cuDevicePrimaryCtxRelease(dev));
  free(a); free(b); free(c);
  if (bad) { printf("vecadd %s: FAIL\n", mode); return 1; }
  printf("vecadd %s: PASS\n", mode);
  return 0;
}
