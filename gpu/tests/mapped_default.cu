// mapped_default: page-locked memory that was not allocated "mapped" used as mapped memory,
// as unified addressing allows. With unified addressing every page-locked allocation is
// mapped: cudaPointerGetAttributes says type host, device pointer = host pointer, and a kernel
// reads and writes it through cudaHostGetDevicePointer's answer or through the host pointer
// itself. Registered memory is mapped too; its device pointer comes from
// cudaHostGetDevicePointer (canUseHostPointerForRegisteredMem says whether the host pointer
// works as well, so the program asks). Through Remora over shared memory cudaMallocHost memory
// lies in the data area; over sockets, and for registered memory everywhere, the device keeps
// a copy made coherent at launches and synchronizations.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include "test_rt.h"

int main() {
  const size_t n = (8u << 20) / 4 + 123;
  CHECK(cudaSetDeviceFlags(cudaDeviceMapHost));

  // 1. cudaMallocHost, through cudaHostGetDevicePointer.
  uint32_t *m = nullptr;
  CHECK(cudaMallocHost((void **)&m, n * 4));
  cudaPointerAttributes a;
  CHECK(cudaPointerGetAttributes(&a, m));
  void *dm = nullptr;
  CHECK(cudaHostGetDevicePointer(&dm, m, 0));
  printf("1. cudaMallocHost: type %d, device pointer %s host pointer, cudaHostGetDevicePointer %s\n",
         (int)a.type, a.devicePointer == (void *)m ? "==" : "!=", dm == a.devicePointer ? "agrees" : "differs");
  fill_seq(m, n, 3);
  affine32<<<264, 256>>>((uint32_t *)dm, n, 9, 4);
  CHECK(cudaDeviceSynchronize());
  if (check_affine("cudaMallocHost", m, n, 3, 9, 4)) return 1;
  // The host changes it again; the next kernel sees the change.
  fill_seq(m, n, 5);
  affine32<<<264, 256>>>((uint32_t *)dm, n, 3, 1);
  CHECK(cudaDeviceSynchronize());
  if (check_affine("cudaMallocHost again", m, n, 5, 3, 1)) return 1;
  CHECK(cudaFreeHost(m));

  // 2. cudaMallocHost, the host pointer handed to kernels directly; copies in and out too.
  uint32_t *h = nullptr, *d = nullptr;
  CHECK(cudaMallocHost((void **)&h, n * 4));
  CHECK(cudaMalloc((void **)&d, n * 4));
  fill_seq(h, n, 7);
  CHECK(cudaMemcpy(d, h, n * 4, cudaMemcpyHostToDevice));
  affine32<<<264, 256>>>(h, n, 5, 2);
  CHECK(cudaDeviceSynchronize());
  if (check_affine("cudaMallocHost direct", h, n, 7, 5, 2)) return 1;
  CHECK(cudaMemcpy(h, d, n * 4, cudaMemcpyDeviceToHost));
  if (check_affine("copied back", h, n, 7, 1, 0)) return 1;
  affine32<<<264, 256>>>(h, n, 2, 9);
  CHECK(cudaDeviceSynchronize());
  if (check_affine("cudaMallocHost direct after a copy", h, n, 7, 2, 9)) return 1;
  printf("2. cudaMallocHost used directly by kernels and copies: ok\n");
  CHECK(cudaFree(d));
  CHECK(cudaFreeHost(h));

  // 3. cudaHostRegister (mapped), through cudaHostGetDevicePointer.
  uint32_t *r = (uint32_t *)malloc(n * 4 + 64);
  uint32_t *ru = r + 3;  // not page-aligned
  CHECK(cudaHostRegister(ru, n * 4, cudaHostRegisterMapped));
  void *dr = nullptr;
  CHECK(cudaHostGetDevicePointer(&dr, ru, 0));
  fill_seq(ru, n, 11);
  affine32<<<264, 256>>>((uint32_t *)dr, n, 7, 3);
  CHECK(cudaDeviceSynchronize());
  if (check_affine("cudaHostRegister", ru, n, 11, 7, 3)) return 1;
  printf("3. cudaHostRegister mapped: ok\n");
  CHECK(cudaHostUnregister(ru));
  free(r);

  printf("mapped_default: all checks passed\n");
  return 0;
}
