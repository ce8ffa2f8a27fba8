// Page-locked host memory used by a kernel through its host pointer alone, as unified
// addressing allows, without cudaHostGetDevicePointer or cudaPointerGetAttributes first:
// cudaMallocHost then a kernel that writes through the pointer, then the host reads it.
//
//   nvcc -O2 -o uva_direct_probe gpu/tools/uva_direct_probe.cu && ./uva_direct_probe
//
// Prints "uva_direct: ok <sum>" or the first mismatch / CUDA error.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

__global__ void fill(uint32_t *p, size_t n, uint32_t k) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) p[i] = (uint32_t)i * 3u + k;
}

int main() {
  const size_t n = (6u << 20) / 4 + 17;
  uint32_t *a = nullptr, *b = nullptr;
  cudaError_t e = cudaMallocHost((void **)&a, n * 4);
  if (e == cudaSuccess) e = cudaMallocHost((void **)&b, n * 4);
  if (e != cudaSuccess) { printf("uva_direct: cudaMallocHost: %s\n", cudaGetErrorString(e)); return 1; }
  fill<<<(n + 255) / 256, 256>>>(b, n, 7);
  e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("uva_direct: kernel on a host pointer: %s\n", cudaGetErrorString(e)); return 1; }
  uint64_t sum = 0;
  for (size_t i = 0; i < n; i++) {
    if (b[i] != (uint32_t)i * 3u + 7u) { printf("uva_direct: b[%zu] = %u, expected %u\n", i, b[i], (uint32_t)i * 3u + 7u); return 1; }
    sum += b[i];
  }
  printf("uva_direct: ok %llu\n", (unsigned long long)sum);
  cudaFreeHost(a); cudaFreeHost(b);
  return 0;
}
