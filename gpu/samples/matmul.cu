// matmul: tiled shared-memory matrix multiply (the CUDA samples' classic), 1024x1024 floats,
// 10 repetitions; checks a sample of entries against the host and prints a hash of C.
#include <cmath>
#include <vector>
#include "common_rt.h"

constexpr int TILE = 32;

__global__ void matmul(const float *a, const float *b, float *c, int n) {
  __shared__ float as[TILE][TILE], bs[TILE][TILE];
  int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
  float acc = 0;
  for (int t = 0; t < n; t += TILE) {
    as[threadIdx.y][threadIdx.x] = a[row * n + t + threadIdx.x];
    bs[threadIdx.y][threadIdx.x] = b[(t + threadIdx.y) * n + col];
    __syncthreads();
    for (int k = 0; k < TILE; k++) acc += as[threadIdx.y][k] * bs[k][threadIdx.x];
    __syncthreads();
  }
  c[row * n + col] = acc;
}

int main() {
  const int n = 1024, reps = 10;
  std::vector<float> a(n * n), b(n * n), c(n * n);
  for (int i = 0; i < n * n; i++) {
    a[i] = (float)((i * 7) % 17) / 17.0f;
    b[i] = (float)((i * 11) % 13) / 13.0f;
  }
  float *da, *db, *dc;
  CK(cudaMalloc(&da, n * n * 4));
  CK(cudaMalloc(&db, n * n * 4));
  CK(cudaMalloc(&dc, n * n * 4));
  double t0 = now_s();
  CK(cudaMemcpy(da, a.data(), n * n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db, b.data(), n * n * 4, cudaMemcpyHostToDevice));
  for (int r = 0; r < reps; r++) matmul<<<dim3(n / TILE, n / TILE), dim3(TILE, TILE)>>>(da, db, dc, n);
  CK(cudaGetLastError());
  CK(cudaMemcpy(c.data(), dc, n * n * 4, cudaMemcpyDeviceToHost));
  double t1 = now_s();
  int bad = 0;
  for (int s = 0; s < 64; s++) {
    int i = (s * 7919) % n, j = (s * 104729) % n;
    double ref = 0;
    for (int k = 0; k < n; k++) ref += (double)a[i * n + k] * b[k * n + j];
    if (std::abs(ref - c[i * n + j]) > 1e-2 * std::abs(ref) + 1e-3) bad++;
  }
  printf("matmul %dx%d x%d: hash %016llx, %d of 64 samples off\n", n, n, reps,
         (unsigned long long)fnv1a(c.data(), c.size() * 4), bad);
  fprintf(stderr, "matmul: %.3f ms (copies + %d multiplies)\n", (t1 - t0) * 1e3, reps);
  printf("matmul: %s\n", bad ? "FAIL" : "PASS");
  return bad ? 1 : 0;
}
