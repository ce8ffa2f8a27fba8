// Shared helpers of the runtime-API sample programs (gpu/samples): error checks, a hash of
// result bytes, and a wall-clock timer whose figures go to stderr (stdout must be identical
// between native and remoted runs; timings are not).
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <cuda_runtime.h>

#define CK(call)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      printf("FAIL %s:%d %s: %d %s\n", __FILE__, __LINE__, #call, (int)e_, cudaGetErrorName(e_)); \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

static inline uint64_t fnv1a(const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

static inline double now_s() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}
