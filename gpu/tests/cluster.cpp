// cluster: thread block cluster launches on sm_90 through cuLaunchKernelEx with
// CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (1D sizes 1, 2, 4, 8 and a 2x2 cluster on a 2D grid), and a
// kernel with a compile-time __cluster_dims__ launched with plain cuLaunchKernel. The kernel
// reports cluster_group rank/size, %cluster_ctarank, %cluster_nctarank, %clusterid.x,
// %nclusterid.x and reads its neighbour's shared memory (distributed shared memory); the host
// checks all of it. cuOccupancyMaxActiveClusters and the cluster function attributes are printed.
#include "../common.h"

static int failures = 0;

// grid gx x gy blocks, cluster cx x cy
static int check(const unsigned *o, unsigned gx, unsigned gy, unsigned cx, unsigned cy) {
  unsigned nb = cx * cy;
  for (unsigned y = 0; y < gy; y++)
    for (unsigned x = 0; x < gx; x++) {
      unsigned bid = x + gx * y;
      const unsigned *r = o + 8 * bid;
      unsigned ix = x % cx, iy = y % cy, rank = ix + cx * iy;
      unsigned prank = (rank + 1) % nb, px = x - ix + prank % cx, py = y - iy + prank / cx;
      unsigned want_v = 1000000u + prank * 1000u + (px + gx * py);
      if (r[0] != rank || r[1] != nb || r[2] != want_v || r[3] != rank || r[4] != nb ||
          r[5] != x / cx || r[6] != gx / cx || r[7] != (ix | (iy << 8))) {
        fprintf(stderr, "block (%u,%u): got %u %u %u %u %u %u %u %x\n", x, y, r[0], r[1], r[2], r[3],
                r[4], r[5], r[6], r[7]);
        return 0;
      }
    }
  return 1;
}

int main() {
  CUdevice dev;
  init_primary(&dev);
  int major;
  CK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
  int clusterOk;
  CK(cuDeviceGetAttribute(&clusterOk, CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH, dev));
  printf("cluster launch supported: %d\n", clusterOk);
  if (major < 9 || !clusterOk) { printf("cluster: needs sm_90: FAIL\n"); return 1; }
  CUmodule mod = load_module("cluster.fatbin");
  CUfunction fn, fixed;
  CK(cuModuleGetFunction(&fn, mod, "cluster_info"));
  CK(cuModuleGetFunction(&fixed, mod, "cluster_fixed"));
  struct { CUfunction_attribute a; const char *n; } fattrs[] = {
      {CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET, "cluster_size_must_be_set"},
      {CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH, "required_cluster_width"},
      {CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT, "required_cluster_height"},
      {CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH, "required_cluster_depth"},
      {CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, "non_portable_cluster_size_allowed"},
  };
  for (auto &a : fattrs) {
    int v1, v2;
    CK(cuFuncGetAttribute(&v1, a.a, fn));
    CK(cuFuncGetAttribute(&v2, a.a, fixed));
    printf("%s: cluster_info %d, cluster_fixed %d\n", a.n, v1, v2);
  }
  const unsigned maxBlocks = 64 * 4;
  CUdeviceptr out;
  CK(cuMemAlloc(&out, 8 * 4 * maxBlocks));
  unsigned *h = (unsigned *)malloc(8 * 4 * maxBlocks);
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  struct { unsigned gx, gy, cx, cy; } cases[] = {{64, 1, 1, 1}, {64, 1, 2, 1}, {64, 1, 4, 1}, {64, 1, 8, 1}, {16, 4, 2, 2}};
  for (auto &c : cases) {
    CK(cuMemsetD32(out, 0xffffffffu, 8 * maxBlocks));
    CUlaunchAttribute attr[1];
    memset(attr, 0, sizeof attr);
    attr[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr[0].value.clusterDim.x = c.cx;
    attr[0].value.clusterDim.y = c.cy;
    attr[0].value.clusterDim.z = 1;
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimX = c.gx; cfg.gridDimY = c.gy; cfg.gridDimZ = 1;
    cfg.blockDimX = 128; cfg.blockDimY = 1; cfg.blockDimZ = 1;
    cfg.sharedMemBytes = 0; cfg.hStream = s; cfg.attrs = attr; cfg.numAttrs = 1;
    int nclusters;
    CK(cuOccupancyMaxActiveClusters(&nclusters, fn, &cfg));
    void *p[] = {&out};
    CK(cuLaunchKernelEx(&cfg, fn, p, NULL));
    CK(cuStreamSynchronize(s));
    CK(cuMemcpyDtoH(h, out, 8 * 4 * c.gx * c.gy));
    int ok = check(h, c.gx, c.gy, c.cx, c.cy);
    failures += !ok;
    printf("grid %ux%u cluster %ux%u: max active clusters %d, %s checksum=%016llx\n", c.gx, c.gy, c.cx,
           c.cy, nclusters, ok ? "ok" : "FAIL", (unsigned long long)checksum(h, 8 * 4 * c.gx * c.gy));
  }
  { // compile-time cluster dims, plain launch
    CK(cuMemsetD32(out, 0xffffffffu, 8 * maxBlocks));
    void *p[] = {&out};
    CK(cuLaunchKernel(fixed, 32, 1, 1, 64, 1, 1, 0, s, p, NULL));
    CK(cuStreamSynchronize(s));
    CK(cuMemcpyDtoH(h, out, 8 * 4 * 32));
    int ok = check(h, 32, 1, 2, 1);
    failures += !ok;
    printf("__cluster_dims__(2,1,1) via cuLaunchKernel: %s checksum=%016llx\n", ok ? "ok" : "FAIL",
           (unsigned long long)checksum(h, 8 * 4 * 32));
  }
  CK(cuStreamDestroy(s));
  CK(cuMemFree(out));
  CK(cuModuleUnload(mod));
  free(h);
  printf("cluster: %s\n", failures ? "FAIL" : "PASS");
  return failures ? 1 : 0;
}
