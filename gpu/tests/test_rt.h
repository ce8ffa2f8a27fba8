// Shared helpers of the runtime-API test programs in gpu/tests: error checks that print FAIL
// and return 1 from the calling function, an element-wise kernel and a hash of 32-bit words
// (stdout must be identical between native and remoted runs, so only hashes are printed).
#pragma once
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      printf("FAIL %s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                      \
    }                                                                                \
  } while (0)

#define EXPECT(cond)                                                 \
  do {                                                               \
    if (!(cond)) {                                                   \
      printf("FAIL %s:%d expected %s\n", __FILE__, __LINE__, #cond); \
      return 1;                                                      \
    }                                                                \
  } while (0)

// p[i] = p[i] * mul + add over n 32-bit words, grid-stride.
__global__ void affine32(uint32_t *p, size_t n, uint32_t mul, uint32_t add) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = p[i] * mul + add;
}

// FNV-1a over n 32-bit words (word-wise, as the tests have always printed it).
static inline uint64_t hash32(const uint32_t *p, size_t n) {
  uint64_t s = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) s = (s ^ p[i]) * 1099511628211ull;
  return s;
}
