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

// The test pattern: p[i] = i * 2654435761 + seed (32-bit wrap-around).
static inline void fill_seq(uint32_t *p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint32_t)(i * 2654435761u + seed);
}

// Whether p holds fill_seq(seed) after affine32(mul, add); prints FAIL with the first wrong
// element and returns 1 if not.
static inline int check_affine(const char *what, const uint32_t *p, size_t n, uint32_t seed, uint32_t mul,
                               uint32_t add) {
  for (size_t i = 0; i < n; i++) {
    uint32_t want = (uint32_t)(i * 2654435761u + seed) * mul + add;
    if (p[i] != want) {
      printf("FAIL %s: element %zu is %u, want %u\n", what, i, p[i], want);
      return 1;
    }
  }
  return 0;
}

// FNV-1a over n 32-bit words (word-wise, as the tests have always printed it).
static inline uint64_t hash32(const uint32_t *p, size_t n) {
  uint64_t s = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) s = (s ^ p[i]) * 1099511628211ull;
  return s;
}
