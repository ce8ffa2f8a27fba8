// Shared helpers for the GPU test and benchmark programs (driver API only, no cudart).
//
// Every program prints deterministic text to stdout (results and checksums, never timings or
// pointers), so that a native run and a run under Remora can be compared byte for byte, and exits
// non-zero on failure. Diagnostics go to stderr.
#pragma once
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <libgen.h>
#include <limits.h>

static inline const char *cu_name(CUresult r) {
  const char *n = NULL;
  if (cuGetErrorName(r, &n) != CUDA_SUCCESS || !n) return "UNKNOWN_CUresult";
  return n;
}

#define CK(x)                                                                                   \
  do {                                                                                          \
    CUresult r_ = (x);                                                                          \
    if (r_ != CUDA_SUCCESS) {                                                                   \
      fprintf(stderr, "FAIL %s:%d: %s -> %s (%d)\n", __FILE__, __LINE__, #x, cu_name(r_),       \
              (int)r_);                                                                         \
      printf("FAIL %s -> %s\n", #x, cu_name(r_));                                               \
      fflush(stdout);                                                                           \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

#define CHECK(cond, ...)                                                                        \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                           \
      fprintf(stderr, __VA_ARGS__);                                                             \
      fprintf(stderr, "\n");                                                                    \
      printf("FAIL %s\n", #cond);                                                               \
      fflush(stdout);                                                                           \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

// Kernel images are built next to the programs: find them through /proc/self/exe, or
// REMORA_GPU_KERNELS when set.
static inline void image_path(const char *file, char *out, size_t cap) {
  const char *dir = getenv("REMORA_GPU_KERNELS");
  char exe[PATH_MAX];
  if (!dir) {
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n < 0) { perror("readlink /proc/self/exe"); exit(1); }
    exe[n] = 0;
    dir = dirname(exe);
  }
  snprintf(out, cap, "%s/%s", dir, file);
}

// Reads a whole kernel image; `nul` appends a terminating NUL (PTX is loaded as C text).
static inline void *load_file(const char *file, size_t *len, int nul) {
  char path[PATH_MAX + 256];
  image_path(file, path, sizeof path);
  FILE *f = fopen(path, "rb");
  if (!f) { fprintf(stderr, "cannot open %s\n", path); exit(1); }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = (char *)malloc((size_t)n + 1);
  if (fread(buf, 1, (size_t)n, f) != (size_t)n) { fprintf(stderr, "short read %s\n", path); exit(1); }
  fclose(f);
  buf[n] = 0;
  if (len) *len = (size_t)n + (nul ? 1 : 0);
  return buf;
}

static inline CUmodule load_module(const char *file) {
  size_t len;
  void *img = load_file(file, &len, 1);
  CUmodule m;
  CK(cuModuleLoadData(&m, img));
  free(img);
  return m;
}

// Initializes the driver and makes device 0's primary context current.
static inline CUcontext init_primary(CUdevice *devp) {
  CUdevice dev;
  CUcontext ctx;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  if (devp) *devp = dev;
  return ctx;
}

// A 64-bit checksum over bytes, fast enough for 1 GiB (8 bytes per step, then a byte tail).
static inline uint64_t checksum(const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  uint64_t h = 0xcbf29ce484222325ull ^ (uint64_t)n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, b + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  for (; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h ^ (h >> 32);
}

// Deterministic pattern: xorshift64* seeded by `seed`.
static inline void fill_pattern(void *p, size_t n, uint64_t seed) {
  unsigned char *b = (unsigned char *)p;
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    uint64_t w = x * 0x2545f4914f6cdd1dull;
    memcpy(b + i, &w, 8);
  }
  for (; i < n; i++) { x ^= x >> 12; x ^= x << 25; x ^= x >> 27; b[i] = (unsigned char)(x >> 56); }
}
