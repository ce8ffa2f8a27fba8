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
  fill_seq(m, n, 3);
  affine32<<<264, 256>>>((uint32_t *)dm, n, 9, 4);
  CHECK(cudaDeviceSynchronize());
  if (check_affine("cudaMallocHost", m, n, 3, 9, 4)) return 1;

  CHECK(cudaFreeHost(m));
  printf("mapped_default: all checks passed\n");
  return 0;
}
