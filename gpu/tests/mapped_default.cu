// mapped_default: cudaMallocHost memory (default flags) used as mapped memory. With unified
// addressing every page-locked allocation is mapped: cudaPointerGetAttributes says type host,
// device pointer = host pointer, and a kernel given cudaHostGetDevicePointer's answer reads
// and writes it. Through Remora this works over shared memory (the allocation lies in the
// data area); over sockets only cudaHostAllocMapped memory is mapped (mapped_memory.cu), and
// this program's cudaHostGetDevicePointer is refused with cudaErrorNotSupported, loudly.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include "test_rt.h"

static int check(const char *what, const uint32_t *p, size_t n, uint32_t seed, uint32_t mul, uint32_t add) {
  for (size_t i = 0; i < n; i++) {
    uint32_t want = (uint32_t)(i * 2654435761u + seed) * mul + add;
    if (p[i] != want) {
      printf("FAIL %s: element %zu is %u, want %u\n", what, i, p[i], want);
      return 1;
    }
  }
  return 0;
}

static void fill(uint32_t *p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint32_t)(i * 2654435761u + seed);
}

int main() {
  const size_t n = (8u << 20) / 4 + 123;
  CHECK(cudaSetDeviceFlags(cudaDeviceMapHost));
  uint32_t *m = nullptr;
  CHECK(cudaMallocHost((void **)&m, n * 4));
  cudaPointerAttributes a;
  CHECK(cudaPointerGetAttributes(&a, m));
  void *dm = nullptr;
  CHECK(cudaHostGetDevicePointer(&dm, m, 0));
  printf("3. cudaMallocHost: type %d, device pointer %s host pointer, cudaHostGetDevicePointer %s\n",
         (int)a.type, a.devicePointer == (void *)m ? "==" : "!=", dm == a.devicePointer ? "agrees" : "differs");
  fill(m, n, 3);
  affine32<<<264, 256>>>((uint32_t *)dm, n, 9, 4);
  CHECK(cudaDeviceSynchronize());
  if (check("cudaMallocHost", m, n, 3, 9, 4)) return 1;

  CHECK(cudaFreeHost(m));
  printf("mapped_default: all checks passed\n");
  return 0;
}
