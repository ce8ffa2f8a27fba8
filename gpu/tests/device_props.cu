// device_props: every field of CUDA 13's cudaDeviceProp as cudaGetDeviceProperties fills it,
// plus cudaDeviceGetAttribute for a few attributes, cudaFuncGetAttributes, occupancy and a
// cooperative launch, printed one per line; remoted output must equal native byte for byte.
// Excluded on purpose: concurrentManagedAccess and canUseHostPointerForRegisteredMem, which
// Remora reports as 0 by design: managed memory follows CUDA's model for devices without
// concurrent managed access, and the device copy of registered host memory lies at another
// address (docs/architecture.md, the client side: managed memory, mapped memory).
// The field list was generated from the CUDA 13.0 driver_types.h (reserved[] left out).
#include <cstdio>
#include <cstdlib>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#define CK(call)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      printf("FAIL %s: %d %s\n", #call, (int)e_, cudaGetErrorName(e_));                   \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

__global__ void coop_sum(int *data, int *out, int n) {
  cooperative_groups::grid_group g = cooperative_groups::this_grid();
  for (int i = g.thread_rank(); i < n; i += g.size()) data[i] = i;
  g.sync();
  if (g.thread_rank() == 0) {
    long long s = 0;
    for (int i = 0; i < n; i++) s += data[i];
    *out = (int)(s % 1000003);
  }
}

static void print_props(const cudaDeviceProp &p) {
  printf("name %s\n", p.name);
  printf("uuid"); for (int i = 0; i < 16; i++) printf(" %02x", (unsigned char)p.uuid.bytes[i]); printf("\n");
  printf("luid"); for (int i = 0; i < 8; i++) printf(" %02x", (unsigned char)p.luid[i]); printf("\n");
  printf("luidDeviceNodeMask %u\n", p.luidDeviceNodeMask);
  printf("totalGlobalMem %zu\n", p.totalGlobalMem);
  printf("sharedMemPerBlock %zu\n", p.sharedMemPerBlock);
  printf("regsPerBlock %d\n", p.regsPerBlock);
  printf("warpSize %d\n", p.warpSize);
  printf("memPitch %zu\n", p.memPitch);
  printf("maxThreadsPerBlock %d\n", p.maxThreadsPerBlock);
  printf("maxThreadsDim"); for (int i = 0; i < 3; i++) printf(" %d", p.maxThreadsDim[i]); printf("\n");
  printf("maxGridSize"); for (int i = 0; i < 3; i++) printf(" %d", p.maxGridSize[i]); printf("\n");
  printf("totalConstMem %zu\n", p.totalConstMem);
  printf("major %d\n", p.major);
  printf("minor %d\n", p.minor);
  printf("textureAlignment %zu\n", p.textureAlignment);
  printf("texturePitchAlignment %zu\n", p.texturePitchAlignment);
  printf("multiProcessorCount %d\n", p.multiProcessorCount);
  printf("integrated %d\n", p.integrated);
  printf("canMapHostMemory %d\n", p.canMapHostMemory);
  printf("maxTexture1D %d\n", p.maxTexture1D);
  printf("maxTexture1DMipmap %d\n", p.maxTexture1DMipmap);
  printf("maxTexture2D"); for (int i = 0; i < 2; i++) printf(" %d", p.maxTexture2D[i]); printf("\n");
  printf("maxTexture2DMipmap"); for (int i = 0; i < 2; i++) printf(" %d", p.maxTexture2DMipmap[i]); printf("\n");
  printf("maxTexture2DLinear"); for (int i = 0; i < 3; i++) printf(" %d", p.maxTexture2DLinear[i]); printf("\n");
  printf("maxTexture2DGather"); for (int i = 0; i < 2; i++) printf(" %d", p.maxTexture2DGather[i]); printf("\n");
  printf("maxTexture3D"); for (int i = 0; i < 3; i++) printf(" %d", p.maxTexture3D[i]); printf("\n");
  printf("maxTexture3DAlt"); for (int i = 0; i < 3; i++) printf(" %d", p.maxTexture3DAlt[i]); printf("\n");
  printf("maxTextureCubemap %d\n", p.maxTextureCubemap);
  printf("maxTexture1DLayered"); for (int i = 0; i < 2; i++) printf(" %d", p.maxTexture1DLayered[i]); printf("\n");
  printf("maxTexture2DLayered"); for (int i = 0; i < 3; i++) printf(" %d", p.maxTexture2DLayered[i]); printf("\n");
  printf("maxTextureCubemapLayered"); for (int i = 0; i < 2; i++) printf(" %d", p.maxTextureCubemapLayered[i]); printf("\n");
  printf("maxSurface1D %d\n", p.maxSurface1D);
  printf("maxSurface2D"); for (int i = 0; i < 2; i++) printf(" %d", p.maxSurface2D[i]); printf("\n");
  printf("maxSurface3D"); for (int i = 0; i < 3; i++) printf(" %d", p.maxSurface3D[i]); printf("\n");
  printf("maxSurface1DLayered"); for (int i = 0; i < 2; i++) printf(" %d", p.maxSurface1DLayered[i]); printf("\n");
  printf("maxSurface2DLayered"); for (int i = 0; i < 3; i++) printf(" %d", p.maxSurface2DLayered[i]); printf("\n");
  printf("maxSurfaceCubemap %d\n", p.maxSurfaceCubemap);
  printf("maxSurfaceCubemapLayered"); for (int i = 0; i < 2; i++) printf(" %d", p.maxSurfaceCubemapLayered[i]); printf("\n");
  printf("surfaceAlignment %zu\n", p.surfaceAlignment);
  printf("concurrentKernels %d\n", p.concurrentKernels);
  printf("ECCEnabled %d\n", p.ECCEnabled);
  printf("pciBusID %d\n", p.pciBusID);
  printf("pciDeviceID %d\n", p.pciDeviceID);
  printf("pciDomainID %d\n", p.pciDomainID);
  printf("tccDriver %d\n", p.tccDriver);
  printf("asyncEngineCount %d\n", p.asyncEngineCount);
  printf("unifiedAddressing %d\n", p.unifiedAddressing);
  printf("memoryBusWidth %d\n", p.memoryBusWidth);
  printf("l2CacheSize %d\n", p.l2CacheSize);
  printf("persistingL2CacheMaxSize %d\n", p.persistingL2CacheMaxSize);
  printf("maxThreadsPerMultiProcessor %d\n", p.maxThreadsPerMultiProcessor);
  printf("streamPrioritiesSupported %d\n", p.streamPrioritiesSupported);
  printf("globalL1CacheSupported %d\n", p.globalL1CacheSupported);
  printf("localL1CacheSupported %d\n", p.localL1CacheSupported);
  printf("sharedMemPerMultiprocessor %zu\n", p.sharedMemPerMultiprocessor);
  printf("regsPerMultiprocessor %d\n", p.regsPerMultiprocessor);
  printf("isMultiGpuBoard %d\n", p.isMultiGpuBoard);
  printf("multiGpuBoardGroupID %d\n", p.multiGpuBoardGroupID);
  printf("hostNativeAtomicSupported %d\n", p.hostNativeAtomicSupported);
  printf("pageableMemoryAccess %d\n", p.pageableMemoryAccess);
  printf("computePreemptionSupported %d\n", p.computePreemptionSupported);
  printf("cooperativeLaunch %d\n", p.cooperativeLaunch);
  printf("sharedMemPerBlockOptin %zu\n", p.sharedMemPerBlockOptin);
  printf("pageableMemoryAccessUsesHostPageTables %d\n", p.pageableMemoryAccessUsesHostPageTables);
  printf("directManagedMemAccessFromHost %d\n", p.directManagedMemAccessFromHost);
  printf("maxBlocksPerMultiProcessor %d\n", p.maxBlocksPerMultiProcessor);
  printf("accessPolicyMaxWindowSize %d\n", p.accessPolicyMaxWindowSize);
  printf("reservedSharedMemPerBlock %zu\n", p.reservedSharedMemPerBlock);
  printf("hostRegisterSupported %d\n", p.hostRegisterSupported);
  printf("sparseCudaArraySupported %d\n", p.sparseCudaArraySupported);
  printf("hostRegisterReadOnlySupported %d\n", p.hostRegisterReadOnlySupported);
  printf("timelineSemaphoreInteropSupported %d\n", p.timelineSemaphoreInteropSupported);
  printf("memoryPoolsSupported %d\n", p.memoryPoolsSupported);
  printf("gpuDirectRDMASupported %d\n", p.gpuDirectRDMASupported);
  printf("gpuDirectRDMAFlushWritesOptions %u\n", p.gpuDirectRDMAFlushWritesOptions);
  printf("gpuDirectRDMAWritesOrdering %d\n", p.gpuDirectRDMAWritesOrdering);
  printf("memoryPoolSupportedHandleTypes %u\n", p.memoryPoolSupportedHandleTypes);
  printf("deferredMappingCudaArraySupported %d\n", p.deferredMappingCudaArraySupported);
  printf("ipcEventSupported %d\n", p.ipcEventSupported);
  printf("clusterLaunch %d\n", p.clusterLaunch);
  printf("unifiedFunctionPointers %d\n", p.unifiedFunctionPointers);
  printf("deviceNumaConfig %d\n", p.deviceNumaConfig);
  printf("deviceNumaId %d\n", p.deviceNumaId);
  printf("mpsEnabled %d\n", p.mpsEnabled);
  printf("hostNumaId %d\n", p.hostNumaId);
  printf("gpuPciDeviceID %u\n", p.gpuPciDeviceID);
  printf("gpuPciSubsystemID %u\n", p.gpuPciSubsystemID);
  printf("hostNumaMultinodeIpcSupported %d\n", p.hostNumaMultinodeIpcSupported);
  printf("managedMemory %d\n", p.managedMemory);
  printf("concurrentManagedAccess, canUseHostPointerForRegisteredMem: not compared (0 under Remora "
         "by design)\n");
}

int main() {
  int count = 0;
  CK(cudaGetDeviceCount(&count));
  printf("devices %d\n", count);
  for (int d = 0; d < count; d++) {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, d));
    printf("== device %d\n", d);
    print_props(p);
    int v;
    const cudaDeviceAttr attrs[] = {cudaDevAttrMaxSharedMemoryPerBlockOptin, cudaDevAttrClockRate,
                                    cudaDevAttrMemoryClockRate, cudaDevAttrComputeMode,
                                    cudaDevAttrCooperativeLaunch, cudaDevAttrClusterLaunch};
    for (cudaDeviceAttr a : attrs) {
      CK(cudaDeviceGetAttribute(&v, a, d));
      printf("attribute %d = %d\n", (int)a, v);
    }
  }
  CK(cudaSetDevice(0));
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, coop_sum));
  printf("coop_sum: regs %d, maxThreadsPerBlock %d, sharedSizeBytes %zu, localSizeBytes %zu, "
         "constSizeBytes %zu, ptxVersion %d, binaryVersion %d\n",
         fa.numRegs, fa.maxThreadsPerBlock, fa.sharedSizeBytes, fa.localSizeBytes, fa.constSizeBytes,
         fa.ptxVersion, fa.binaryVersion);
  int blocks = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, coop_sum, 128, 0));
  printf("occupancy at 128 threads: %d blocks/SM\n", blocks);
  int min_grid = 0, best_block = 0;
  CK(cudaOccupancyMaxPotentialBlockSize(&min_grid, &best_block, coop_sum, 0, 0));
  printf("potential block size %d (min grid %d)\n", best_block, min_grid);
  // Cooperative launch: the whole grid resident at once, a grid-wide barrier.
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int n = 1 << 20;
  int *data, *out, result = 0;
  CK(cudaMalloc(&data, n * sizeof(int)));
  CK(cudaMalloc(&out, sizeof(int)));
  int nn = n;
  void *args[] = {&data, &out, &nn};
  CK(cudaLaunchCooperativeKernel((void *)coop_sum, dim3(sms * blocks), dim3(128), args, 0, 0));
  CK(cudaMemcpy(&result, out, sizeof(int), cudaMemcpyDeviceToHost));
  printf("cooperative sum mod 1000003 = %d (expected %lld)\n", result,
         ((long long)n * (n - 1) / 2) % 1000003);
  CK(cudaFree(data));
  CK(cudaFree(out));
  printf("device_props: %s\n", result == (int)(((long long)n * (n - 1) / 2) % 1000003) ? "PASS" : "FAIL");
  return 0;
}
