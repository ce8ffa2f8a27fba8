// vmm: virtual memory management as PyTorch's expandable segments and NVIDIA's vectorAddMMAP
// use it (driver API inside a runtime-API program).
//
//   1. Granularity of a pinned device allocation (minimum and recommended).
//   2. An "expandable segment": one large reserved range; physical chunks are created and
//      mapped one after another at its start, access is set on each new chunk only, and a
//      kernel and copies run over the whole mapped part, across chunk boundaries.
//   3. The same physical chunk mapped at a second address: both see the same bytes.
//   4. cuMemRetainAllocationHandle and cuMemGetAllocationPropertiesFromHandle; cuMemGetAccess;
//      cudaPointerGetAttributes on a mapped address.
//   5. cudaMemsetAsync / cudaMemcpyAsync on a stream with pinned host memory.
//   6. Shrinking: unmap and release the last chunk, then everything, in order; a map outside
//      any reservation is refused.
// Each section prints one line with a checksum; any mismatch prints FAIL and exits 1.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda.h>
#include <cuda_runtime.h>
#include "test_rt.h"

#define CU(x)                                                              \
  do {                                                                     \
    CUresult r_ = (x);                                                     \
    if (r_ != CUDA_SUCCESS) {                                              \
      const char *n_ = "?";                                                \
      cuGetErrorName(r_, &n_);                                             \
      printf("FAIL %s:%d %s: %s (%d)\n", __FILE__, __LINE__, #x, n_, (int)r_); \
      return 1;                                                            \
    }                                                                      \
  } while (0)

__global__ void fill(uint32_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = (uint32_t)(i * 2654435761u) + seed;
}

int main() {
  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(0));
  int vmm = 0;
  CU(cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
  if (!vmm) {
    printf("FAIL the device does not support virtual memory management\n");
    return 1;
  }

  // 1. Granularity.
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t gmin = 0, grec = 0;
  CU(cuMemGetAllocationGranularity(&gmin, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CU(cuMemGetAllocationGranularity(&grec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  printf("granularity: minimum %zu KiB, recommended %zu KiB\n", gmin >> 10, grec >> 10);

  // 2. An expandable segment: reserve 64 chunks' worth, grow by 3 chunks of 2 granules.
  const size_t chunk = 2 * gmin, chunks = 3, reserve = 64 * chunk;
  CUdeviceptr base = 0;
  CU(cuMemAddressReserve(&base, reserve, 0, 0, 0));
  CUmemGenericAllocationHandle h[chunks];
  CUmemAccessDesc rw = {};
  rw.location = prop.location;
  rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const size_t total_words = chunks * chunk / 4;
  uint32_t *host = nullptr;
  CHECK(cudaMallocHost(&host, chunks * chunk));
  for (size_t c = 0; c < chunks; c++) {
    CU(cuMemCreate(&h[c], chunk, &prop, 0));
    CU(cuMemMap(base + c * chunk, chunk, 0, h[c], 0));
    CU(cuMemSetAccess(base + c * chunk, chunk, &rw, 1));
    // The whole mapped part so far, across chunk boundaries.
    size_t n = (c + 1) * chunk / 4;
    fill<<<256, 256, 0, st>>>((uint32_t *)base, n, 7 + (uint32_t)c);
    affine32<<<256, 256, 0, st>>>((uint32_t *)base, n, 3, (uint32_t)c);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpyAsync(host, (void *)base, n * 4, cudaMemcpyDeviceToHost, st));
    CHECK(cudaStreamSynchronize(st));
    if (check_affine("segment", host, n, 7 + (uint32_t)c, 3, (uint32_t)c)) return 1;
    printf("segment grown to %zu chunks: %016llx\n", c + 1, (unsigned long long)hash32(host, n));
  }

  // A synchronous copy from the host across the boundary of chunks 0 and 1, read back.
  const size_t off = chunk - 4096, len = 3 * 4096;
  for (size_t i = 0; i < len / 4; i++) host[i] = (uint32_t)(i * 2654435761u) + 99;
  CHECK(cudaMemcpy((char *)base + off, host, len, cudaMemcpyHostToDevice));
  memset(host, 0, len);
  CHECK(cudaMemcpy(host, (char *)base + off, len, cudaMemcpyDeviceToHost));
  if (check_affine("across chunks", host, len / 4, 99, 1, 0)) return 1;
  printf("copy across chunks: %016llx\n", (unsigned long long)hash32(host, len / 4));

  // 3. Chunk 1 mapped again elsewhere.
  CUdeviceptr alias = 0;
  CU(cuMemAddressReserve(&alias, chunk, 0, 0, 0));
  CU(cuMemMap(alias, chunk, 0, h[1], 0));
  CU(cuMemSetAccess(alias, chunk, &rw, 1));
  affine32<<<128, 256, 0, st>>>((uint32_t *)alias, chunk / 4, 5, 1);
  CHECK(cudaMemcpyAsync(host, (void *)(base + chunk), chunk, cudaMemcpyDeviceToHost, st));
  CHECK(cudaStreamSynchronize(st));
  printf("alias: chunk 1 seen through its own mapping: %016llx\n",
         (unsigned long long)hash32(host, chunk / 4));

  // 4. Handles and attributes.
  CUmemGenericAllocationHandle r = 0;
  CU(cuMemRetainAllocationHandle(&r, (void *)(alias + 12345)));
  CUmemAllocationProp got = {};
  CU(cuMemGetAllocationPropertiesFromHandle(&got, r));
  CU(cuMemRelease(r));
  unsigned long long flags = 0;
  CU(cuMemGetAccess(&flags, &prop.location, base + 5));
  cudaPointerAttributes pa = {};
  CHECK(cudaPointerGetAttributes(&pa, (void *)(base + chunk + 8)));
  printf("retained: type %d location %d/%d; access %llu; pointer type %d device %d\n", (int)got.type,
         (int)got.location.type, got.location.id, flags, (int)pa.type, pa.device);

  // 5. Stream-ordered memset and copies with pinned memory over the whole segment.
  CHECK(cudaMemsetAsync((void *)base, 0x5a, chunks * chunk, st));
  for (size_t i = 0; i < total_words; i++) host[i] = (uint32_t)(i * 2654435761u) + 11;
  CHECK(cudaMemcpyAsync((void *)(base + 4), host, chunks * chunk - 8, cudaMemcpyHostToDevice, st));
  affine32<<<256, 256, 0, st>>>((uint32_t *)base, total_words, 1, 0);
  CHECK(cudaMemcpyAsync(host, (void *)base, chunks * chunk, cudaMemcpyDeviceToHost, st));
  CHECK(cudaStreamSynchronize(st));
  bool ok = host[0] == 0x5a5a5a5au && host[total_words - 1] == 0x5a5a5a5au;
  for (size_t i = 1; ok && i + 1 < total_words; i++) ok = host[i] == (uint32_t)((i - 1) * 2654435761u) + 11;
  if (!ok) {
    printf("FAIL stream-ordered memset and copies\n");
    return 1;
  }
  printf("stream-ordered memset and copies: %016llx\n", (unsigned long long)hash32(host, total_words));

  // 6. Shrink, then free everything in order; a map outside any reservation is refused.
  CU(cuMemUnmap(base + 2 * chunk, chunk));
  CU(cuMemRelease(h[2]));
  CHECK(cudaMemcpy(host, (void *)(base + chunk), chunk, cudaMemcpyDeviceToHost));
  printf("shrunk to 2 chunks: %016llx\n", (unsigned long long)hash32(host, chunk / 4));
  CUresult bad = cuMemMap(0x1000, chunk, 0, h[0], 0);
  printf("map outside a reservation: %s\n", bad == CUDA_SUCCESS ? "accepted (wrong)" : "refused");
  CU(cuMemUnmap(alias, chunk));
  CU(cuMemAddressFree(alias, chunk));
  CU(cuMemUnmap(base, 2 * chunk));
  CU(cuMemRelease(h[0]));
  CU(cuMemRelease(h[1]));
  CU(cuMemAddressFree(base, reserve));
  CHECK(cudaFreeHost(host));
  CHECK(cudaStreamDestroy(st));
  CHECK(cudaDeviceSynchronize());
  printf("vmm: all checks passed\n");
  return 0;
}
