// histogram: 64-bin and 256-bin byte histograms of 64 MiB with per-block shared-memory
// sub-histograms merged by atomics (the CUDA samples' histogram), checked against the host.
#include <vector>
#include "common_rt.h"

template <int BINS>
__global__ void histogram(const unsigned char *data, size_t n, unsigned int *out) {
  __shared__ unsigned int local[BINS];
  for (int i = threadIdx.x; i < BINS; i += blockDim.x) local[i] = 0;
  __syncthreads();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    atomicAdd(&local[data[i] % BINS], 1u);
  __syncthreads();
  for (int i = threadIdx.x; i < BINS; i += blockDim.x) atomicAdd(&out[i], local[i]);
}

template <int BINS>
static int run(const std::vector<unsigned char> &h, unsigned char *d) {
  unsigned int *dout;
  CK(cudaMalloc(&dout, BINS * 4));
  CK(cudaMemset(dout, 0, BINS * 4));
  histogram<BINS><<<264, 256>>>(d, h.size(), dout);
  CK(cudaGetLastError());
  std::vector<unsigned int> got(BINS), want(BINS, 0);
  CK(cudaMemcpy(got.data(), dout, BINS * 4, cudaMemcpyDeviceToHost));
  for (unsigned char c : h) want[c % BINS]++;
  int bad = 0;
  for (int i = 0; i < BINS; i++) bad += got[i] != want[i];
  printf("histogram %d bins: hash %016llx, %d bins wrong, bin[0]=%u bin[%d]=%u\n", BINS,
         (unsigned long long)fnv1a(got.data(), BINS * 4), bad, got[0], BINS - 1, got[BINS - 1]);
  CK(cudaFree(dout));
  return bad;
}

int main() {
  const size_t n = 64u << 20;
  std::vector<unsigned char> h(n);
  uint32_t x = 12345;
  for (size_t i = 0; i < n; i++) {
    x = x * 1664525u + 1013904223u;
    h[i] = (unsigned char)(x >> 24);
  }
  unsigned char *d;
  CK(cudaMalloc(&d, n));
  double t0 = now_s();
  CK(cudaMemcpy(d, h.data(), n, cudaMemcpyHostToDevice));
  int bad = run<64>(h, d) + run<256>(h, d);
  double t1 = now_s();
  fprintf(stderr, "histogram: %.3f ms (64 MiB copy + two histograms)\n", (t1 - t0) * 1e3);
  printf("histogram: %s\n", bad ? "FAIL" : "PASS");
  return bad ? 1 : 0;
}
