// mapped_memory: mapped (zero-copy) host memory, as a CUDA runtime program uses it.
//
//   1. cudaHostAlloc(cudaHostAllocMapped) + cudaHostGetDevicePointer: a kernel reads and
//      writes the host buffer through the device pointer; after cudaDeviceSynchronize the host
//      sees every byte the kernel wrote, and the kernel saw every byte the host wrote before
//      the launch.
//   2. Unified addressing: the same kernel given the host pointer itself.
//   4. Several rounds of host write → kernel → host read on the same buffer, on a stream.
//   (3., cudaMallocHost memory used as mapped memory, is mapped_default.cu.)
// Each section prints one line with a checksum; any mismatch prints FAIL and exits 1.
// Through Remora this works over shared memory (the buffer lies in the session's data area,
// page-locked by the server with DEVICEMAP) and over sockets (the client mirrors the
// allocation on the device at the same address, coherent at launches and synchronizations).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include "test_rt.h"

int main() {
  const size_t n = (8u << 20) / 4 + 123;  // a little over 8 MiB, odd length
  CHECK(cudaSetDeviceFlags(cudaDeviceMapHost));
  int uva = 0, canMap = 0;
  CHECK(cudaDeviceGetAttribute(&uva, cudaDevAttrUnifiedAddressing, 0));
  CHECK(cudaDeviceGetAttribute(&canMap, cudaDevAttrCanMapHostMemory, 0));
  printf("unified addressing %d, can map host memory %d\n", uva, canMap);

  // 1. cudaHostAllocMapped + cudaHostGetDevicePointer
  uint32_t *h = nullptr, *d = nullptr;
  CHECK(cudaHostAlloc((void **)&h, n * 4, cudaHostAllocMapped));
  CHECK(cudaHostGetDevicePointer((void **)&d, h, 0));
  fill_seq(h, n, 1);
  affine32<<<264, 256>>>(d, n, 3, 7);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  if (check_affine("device pointer", h, n, 1, 3, 7)) return 1;
  printf("1. mapped through the device pointer: %016llx\n", (unsigned long long)hash32(h, n));

  // 2. the host pointer itself (unified addressing)
  if (uva) {
    fill_seq(h, n, 2);
    affine32<<<264, 256>>>(h, n, 5, 1);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    if (check_affine("host pointer", h, n, 2, 5, 1)) return 1;
    printf("2. mapped through the host pointer: %016llx\n", (unsigned long long)hash32(h, n));
  }

  // 4. rounds on a stream
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint64_t acc = 0;
  for (uint32_t r = 0; r < 8; r++) {
    fill_seq(h, n, 100 + r);
    affine32<<<132, 512, 0, s>>>(d, n, 2 * r + 1, r);
    CHECK(cudaStreamSynchronize(s));
    if (check_affine("stream round", h, n, 100 + r, 2 * r + 1, r)) return 1;
    acc ^= hash32(h, n) + r;
  }
  printf("4. 8 rounds on a stream: %016llx\n", (unsigned long long)acc);
  CHECK(cudaStreamDestroy(s));
  CHECK(cudaFreeHost(h));
  printf("mapped_memory: all checks passed\n");
  return 0;
}
