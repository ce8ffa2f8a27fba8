// occupancy: cuFuncGetAttribute values for four kernels, cuOccupancyMaxActiveBlocksPerMultiprocessor
// over block sizes x dynamic shared memory, cuOccupancyMaxPotentialBlockSize, a few device
// attributes, and cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) followed by a launch that uses
// more than 48 KiB of dynamic shared memory (checked). All values are deterministic for one device
// and one build.
#include "../common.h"

int main() {
  CUdevice dev;
  init_primary(&dev);
  CUmodule mod = load_module("occupancy.fatbin");
  struct { CUdevice_attribute a; const char *n; } dattrs[] = {
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "cc_major"},
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "cc_minor"},
      {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "sm_count"},
      {CU_DEVICE_ATTRIBUTE_WARP_SIZE, "warp_size"},
      {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "max_threads_per_block"},
      {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, "max_threads_per_sm"},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, "max_smem_per_block_optin"},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, "max_smem_per_sm"},
      {CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR, "max_regs_per_sm"},
      {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, "unified_addressing"},
  };
  for (auto &d : dattrs) {
    int v;
    CK(cuDeviceGetAttribute(&v, d.a, dev));
    printf("device %s = %d\n", d.n, v);
  }
  const char *names[] = {"light", "heavy", "static_smem", "dyn_smem"};
  struct { CUfunction_attribute a; const char *n; } fattrs[] = {
      {CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "max_threads_per_block"},
      {CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, "shared_size_bytes"},
      {CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES, "const_size_bytes"},
      {CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, "local_size_bytes"},
      {CU_FUNC_ATTRIBUTE_NUM_REGS, "num_regs"},
      {CU_FUNC_ATTRIBUTE_PTX_VERSION, "ptx_version"},
      {CU_FUNC_ATTRIBUTE_BINARY_VERSION, "binary_version"},
      {CU_FUNC_ATTRIBUTE_CACHE_MODE_CA, "cache_mode_ca"},
      {CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, "max_dynamic_shared_size_bytes"},
      {CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, "preferred_shared_memory_carveout"},
  };
  int blocks[] = {32, 64, 128, 256, 512, 1024};
  size_t smems[] = {0, 1024, 8192, 32768, 49152};
  for (int f = 0; f < 4; f++) {
    CUfunction fn;
    CK(cuModuleGetFunction(&fn, mod, names[f]));
    for (auto &a : fattrs) {
      int v;
      CK(cuFuncGetAttribute(&v, a.a, fn));
      printf("%s %s = %d\n", names[f], a.n, v);
    }
    int maxt;
    CK(cuFuncGetAttribute(&maxt, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn));
    for (int b : blocks) {
      if (b > maxt) continue;
      printf("%s block %4d:", names[f], b);
      for (size_t sm : smems) {
        int nb;
        CK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, b, sm));
        int nb2;
        CK(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&nb2, fn, b, sm, CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE));
        printf(" smem %5zu -> %2d/%2d", sm, nb, nb2);
      }
      printf("\n");
    }
    int minGrid, blockSize;
    CK(cuOccupancyMaxPotentialBlockSize(&minGrid, &blockSize, fn, NULL, 0, 0));
    printf("%s potential block size %d, min grid %d\n", names[f], blockSize, minGrid);
    size_t avail;
    CK(cuOccupancyAvailableDynamicSMemPerBlock(&avail, fn, 2, 256));
    printf("%s available dynamic smem (2 blocks of 256) %zu\n", names[f], avail);
  }
  // opt in to 100 KiB of dynamic shared memory and use it
  CUfunction dyn;
  CK(cuModuleGetFunction(&dyn, mod, "dyn_smem"));
  int big = 100 * 1024, words = big / 4;
  void *p[] = {NULL, &words};
  CUdeviceptr out;
  CK(cuMemAlloc(&out, 4));
  CK(cuMemsetD32(out, 0, 1));
  p[0] = &out;
  CK(cuFuncSetAttribute(dyn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, big));
  int v;
  CK(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dyn));
  printf("dyn_smem max_dynamic_shared_size_bytes after set = %d\n", v);
  int nb;
  CK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&nb, dyn, 256, big));
  printf("dyn_smem block 256 smem %d -> %d\n", big, nb);
  CK(cuLaunchKernel(dyn, 1, 1, 1, 256, 1, 1, big, NULL, p, NULL));
  int got;
  CK(cuMemcpyDtoH(&got, out, 4));
  int want = 0;
  for (int i = 0; i < words; i++) want += i * 3;
  printf("dyn_smem sum %d (%s)\n", got, got == want ? "ok" : "FAIL");
  CK(cuMemFree(out));
  CK(cuModuleUnload(mod));
  printf("occupancy: %s\n", got == want ? "PASS" : "FAIL");
  return got == want ? 0 : 1;
}
