// bandwidth: the CUDA samples' bandwidth test: H2D and D2H from pageable and pinned
// (cudaMallocHost) memory and D2D, 64 KiB to 64 MiB. Every copy is verified (stdout, compared
// with native); the bandwidths go to stderr as `bandwidth <kind> <bytes> <GB/s>` lines.
#include <cstring>
#include <vector>
#include "common_rt.h"

int main() {
  const size_t sizes[] = {64u << 10, 1u << 20, 16u << 20, 64u << 20};
  const size_t max = 64u << 20;
  std::vector<unsigned char> pageable(max), back(max);
  unsigned char *pinned, *d0, *d1;
  CK(cudaMallocHost(&pinned, max));
  CK(cudaMalloc(&d0, max));
  CK(cudaMalloc(&d1, max));
  for (size_t i = 0; i < max; i++) pageable[i] = pinned[i] = (unsigned char)(i * 131 + (i >> 16));
  int bad = 0;
  for (size_t n : sizes) {
    const int reps = n >= (16u << 20) ? 4 : 20;
    struct Kind {
      const char *name;
      void *dst;
      const void *src;
      cudaMemcpyKind kind;
    } kinds[] = {
        {"h2d-pageable", d0, pageable.data(), cudaMemcpyHostToDevice},
        {"d2h-pageable", back.data(), d0, cudaMemcpyDeviceToHost},
        {"h2d-pinned", d1, pinned, cudaMemcpyHostToDevice},
        {"d2h-pinned", pinned, d1, cudaMemcpyDeviceToHost},
        {"d2d", d1, d0, cudaMemcpyDeviceToDevice},
    };
    for (const Kind &k : kinds) {
      CK(cudaMemcpy(k.dst, k.src, n, k.kind));  // warm-up
      double t0 = now_s();
      for (int r = 0; r < reps; r++) CK(cudaMemcpy(k.dst, k.src, n, k.kind));
      double dt = (now_s() - t0) / reps;
      fprintf(stderr, "bandwidth %s %zu %.2f\n", k.name, n, n / dt / 1e9);
    }
    // Verify: d2h-pageable brought back what h2d-pageable sent; d2d then d2h-pinned did too.
    int ok1 = memcmp(back.data(), pageable.data(), n) == 0;
    int ok2 = memcmp(pinned, pageable.data(), n) == 0;
    printf("bandwidth %zu bytes: pageable round trip %s, pinned/d2d round trip %s\n", n, ok1 ? "ok" : "WRONG",
           ok2 ? "ok" : "WRONG");
    bad += !ok1 + !ok2;
  }
  CK(cudaFreeHost(pinned));
  printf("bandwidth: %s\n", bad ? "FAIL" : "PASS");
  return bad ? 1 : 0;
}
