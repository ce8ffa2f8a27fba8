// multikernel: one module with 13 kernels; each is launched and its result checked on the host.
// Covers scalar parameters of every width, a padded struct by value, 12 parameters, dynamic and
// static shared memory, 2D and 3D grids, __constant__ and __device__ globals through
// cuModuleGetGlobal, and a launch through the `extra` buffer (CU_LAUNCH_PARAM_BUFFER_POINTER).
#include "../common.h"
#include <stddef.h>

struct Mixed { char c; double d; int i; short s; };

static CUmodule mod;
static CUfunction get(const char *name) {
  CUfunction f;
  CK(cuModuleGetFunction(&f, mod, name));
  return f;
}
static int failures = 0;
static void report(const char *name, int ok, uint64_t sum) {
  printf("%-12s %s checksum=%016llx\n", name, ok ? "ok" : "FAIL", (unsigned long long)sum);
  if (!ok) failures++;
}

int main() {
  init_primary(NULL);
  mod = load_module("multikernel.fatbin");
  const int n = 10000;
  unsigned grid = (n + 255) / 256;
  CUdeviceptr d1, d2, d3;
  CK(cuMemAlloc(&d1, 8 * n));
  CK(cuMemAlloc(&d2, 8 * n));
  CK(cuMemAlloc(&d3, 8 * n));
  void *h = malloc(8 * n), *h2 = malloc(8 * n);

  { // 1 fill_i32
    int v = -5000, nn = n; void *p[] = {&d1, &v, &nn};
    CK(cuLaunchKernel(get("fill_i32"), grid, 1, 1, 256, 1, 1, 0, 0, p, 0));
    CK(cuMemcpyDtoH(h, d1, 4 * n));
    int *r = (int *)h, ok = 1;
    for (int i = 0; i < n; i++) ok &= r[i] == v + i;
    report("fill_i32", ok, checksum(h, 4 * n));
  }
  { // 2 iota_u64
    unsigned long long base = 0x123456789abcull; int nn = n; void *p[] = {&d1, &base, &nn};
    CK(cuLaunchKernel(get("iota_u64"), grid, 1, 1, 256, 1, 1, 0, 0, p, 0));
    CK(cuMemcpyDtoH(h, d1, 8 * n));
    unsigned long long *r = (unsigned long long *)h; int ok = 1;
    for (int i = 0; i < n; i++) ok &= r[i] == base + 3ull * i;
    report("iota_u64", ok, checksum(h, 8 * n));
  }
  { // 3 saxpy
    float *x = (float *)h, *y = (float *)h2;
    for (int i = 0; i < n; i++) { x[i] = (float)i; y[i] = (float)(n - i); }
    CK(cuMemcpyHtoD(d1, x, 4 * n)); CK(cuMemcpyHtoD(d2, y, 4 * n));
    float a = 2.0f; int nn = n; void *p[] = {&a, &d1, &d2, &nn};
    CK(cuLaunchKernel(get("saxpy"), grid, 1, 1, 256, 1, 1, 0, 0, p, 0));
    CK(cuMemcpyDtoH(y, d2, 4 * n));
    int ok = 1;
    for (int i = 0; i < n; i++) ok &= y[i] == 2.0f * i + (float)(n - i);
    report("saxpy", ok, checksum(y, 4 * n));
  }
  { // 4 daxpy
    double *x = (double *)h, *y = (double *)h2;
    for (int i = 0; i < n; i++) { x[i] = i * 0.5; y[i] = 1.0; }
    CK(cuMemcpyHtoD(d1, x, 8 * n)); CK(cuMemcpyHtoD(d2, y, 8 * n));
    double a = -4.0; int nn = n; void *p[] = {&a, &d1, &d2, &nn};
    CK(cuLaunchKernel(get("daxpy"), grid, 1, 1, 256, 1, 1, 0, 0, p, 0));
    CK(cuMemcpyDtoH(y, d2, 8 * n));
    int ok = 1;
    for (int i = 0; i < n; i++) ok &= y[i] == -4.0 * (i * 0.5) + 1.0;
    report("daxpy", ok, checksum(y, 8 * n));
  }
  { // 5 small_types
    signed char c = -7; short s = 3; unsigned char u = 200; int nn = n;
    void *p[] = {&c, &s, &u, &d1, &d2, &nn};
    CK(cuLaunchKernel(get("small_types"), grid, 1, 1, 256, 1, 1, 0, 0, p, 0));
    signed char *pc = (signed char *)h; short *ps = (short *)h2;
    CK(cuMemcpyDtoH(pc, d1, n)); CK(cuMemcpyDtoH(ps, d2, 2 * n));
    int ok = 1;
    for (int i = 0; i < n; i++) ok &= pc[i] == (signed char)(c + i) && ps[i] == (short)(s * i + u);
    report("small_types", ok, checksum(pc, n) ^ checksum(ps, 2 * n));
  }
  { // 6 by_struct
    Mixed m = {5, 0.25, -100000, 1234}; void *p[] = {&m, &d3};
    CK(cuLaunchKernel(get("by_struct"), 1, 1, 1, 32, 1, 1, 0, 0, p, 0));
    double r; CK(cuMemcpyDtoH(&r, d3, 8));
    report("by_struct", r == 5 + 0.25 - 100000 + 1234, checksum(&r, 8));
  }
  { // 7 many_params
    int a = 1; long long b = 2; float c = 3.5f; double d = 4.25; char e = 5; short f = 6; unsigned g = 7;
    unsigned long long hh = 8; float i = 9.5f; int j = 10;
    void *p[] = {&a, &b, &c, &d, &e, &f, &g, &hh, &i, &d1, &d2, &j};
    CK(cuLaunchKernel(get("many_params"), 1, 1, 1, 1, 1, 1, 0, 0, p, 0));
    int r1; double r2; CK(cuMemcpyDtoH(&r1, d1, 4)); CK(cuMemcpyDtoH(&r2, d2, 8));
    report("many_params", r1 == 39 && r2 == 3.5 + 4.25 + 9.5, checksum(&r1, 4) ^ checksum(&r2, 8));
  }
  { // 8 reduce_sum: dynamic shared memory, atomics
    unsigned *in = (unsigned *)h; unsigned long long want = 0;
    for (int i = 0; i < n; i++) { in[i] = (unsigned)(i * 2654435761u) >> 8; want += in[i]; }
    CK(cuMemcpyHtoD(d1, in, 4 * n)); CK(cuMemsetD8(d3, 0, 8));
    int nn = n; void *p[] = {&d1, &d3, &nn};
    CK(cuLaunchKernel(get("reduce_sum"), 8, 1, 1, 256, 1, 1, 256 * 8, 0, p, 0));
    unsigned long long r; CK(cuMemcpyDtoH(&r, d3, 8));
    report("reduce_sum", r == want, checksum(&r, 8));
  }
  { // 9 transpose: 2D grid, static shared memory
    int w = 100, hh = 77; float *in = (float *)h, *out = (float *)h2;
    for (int i = 0; i < w * hh; i++) in[i] = (float)i;
    CK(cuMemcpyHtoD(d1, in, 4 * w * hh));
    void *p[] = {&d1, &d2, &w, &hh};
    CK(cuLaunchKernel(get("transpose"), (w + 31) / 32, (hh + 31) / 32, 1, 32, 32, 1, 0, 0, p, 0));
    CK(cuMemcpyDtoH(out, d2, 4 * w * hh));
    int ok = 1;
    for (int y = 0; y < hh; y++) for (int x = 0; x < w; x++) ok &= out[x * hh + y] == in[y * w + x];
    report("transpose", ok, checksum(out, 4 * w * hh));
  }
  { // 10 grid3d: 3D grid and 3D blocks
    unsigned gx = 3, gy = 2, gz = 4, bx = 8, by = 4, bz = 2, total = gx * gy * gz * bx * by * bz;
    void *p[] = {&d1};
    CK(cuLaunchKernel(get("grid3d"), gx, gy, gz, bx, by, bz, 0, 0, p, 0));
    unsigned *r = (unsigned *)h; CK(cuMemcpyDtoH(r, d1, 4 * total));
    int ok = 1;
    for (unsigned z = 0; z < gz; z++) for (unsigned y = 0; y < gy; y++) for (unsigned x = 0; x < gx; x++)
      for (unsigned tz = 0; tz < bz; tz++) for (unsigned ty = 0; ty < by; ty++) for (unsigned tx = 0; tx < bx; tx++) {
        unsigned id = (x + gx * (y + gy * z)) * (bx * by * bz) + tx + bx * (ty + by * tz);
        ok &= r[id] == ((z << 24) | (y << 16) | (tz << 12) | (ty << 8) | (x << 4) | tx);
      }
    report("grid3d", ok, checksum(r, 4 * total));
  }
  { // 11 use_constant: __constant__ through cuModuleGetGlobal
    CUdeviceptr tab; size_t sz;
    CK(cuModuleGetGlobal(&tab, &sz, mod, "k_table"));
    CHECK(sz == 64, "k_table size %zu", sz);
    int t[16]; for (int i = 0; i < 16; i++) t[i] = i * i - 7;
    CK(cuMemcpyHtoD(tab, t, sizeof t));
    int nn = n; void *p[] = {&d1, &nn};
    CK(cuLaunchKernel(get("use_constant"), grid, 1, 1, 256, 1, 1, 0, 0, p, 0));
    int *r = (int *)h; CK(cuMemcpyDtoH(r, d1, 4 * n));
    int ok = 1;
    for (int i = 0; i < n; i++) ok &= r[i] == t[i % 16] * (i + 1);
    printf("k_table size %zu\n", sz);
    report("use_constant", ok, checksum(r, 4 * n));
  }
  { // 12 count_global: __device__ variable, launched through the `extra` parameter buffer
    CUdeviceptr cnt; size_t sz;
    CK(cuModuleGetGlobal(&cnt, &sz, mod, "g_counter"));
    CK(cuMemsetD8(cnt, 0, sz));
    int per = 3; size_t argsz = sizeof per;
    void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &per, CU_LAUNCH_PARAM_BUFFER_SIZE, &argsz, CU_LAUNCH_PARAM_END};
    CK(cuLaunchKernel(get("count_global"), 10, 1, 1, 128, 1, 1, 0, 0, NULL, extra));
    unsigned long long r; CK(cuMemcpyDtoH(&r, cnt, 8));
    printf("g_counter size %zu\n", sz);
    report("count_global", r == 10ull * 128 * 3, checksum(&r, 8));
  }
  { // 13 reverse_dyn: dynamic shared memory sized at launch
    int m = 1000; int *v = (int *)h;
    for (int i = 0; i < m; i++) v[i] = i * 7 + 1;
    CK(cuMemcpyHtoD(d1, v, 4 * m));
    void *p[] = {&d1, &m};
    CK(cuLaunchKernel(get("reverse_dyn"), 1, 1, 1, 1024, 1, 1, 4 * m, 0, p, 0));
    int *r = (int *)h2; CK(cuMemcpyDtoH(r, d1, 4 * m));
    int ok = 1;
    for (int i = 0; i < m; i++) ok &= r[i] == v[m - 1 - i];
    report("reverse_dyn", ok, checksum(r, 4 * m));
  }
  CK(cuCtxSynchronize());
  CK(cuMemFree(d1)); CK(cuMemFree(d2)); CK(cuMemFree(d3));
  CK(cuModuleUnload(mod));
  free(h); free(h2);
  printf("multikernel: %d kernels, %d failed: %s\n", 13, failures, failures ? "FAIL" : "PASS");
  return failures ? 1 : 0;
}
