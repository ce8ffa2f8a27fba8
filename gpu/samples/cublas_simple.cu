// cublas_simple: the CUDA samples' simpleCUBLAS: C = alpha*A*B + beta*C with cublasSgemm on
// 256x256 matrices, the result checked against a host GEMM and hashed.
#include <cmath>
#include <vector>
#include <cublas_v2.h>
#include "common_rt.h"

int main() {
  const int n = 256;
  const float alpha = 1.0f, beta = 0.5f;
  std::vector<float> a(n * n), b(n * n), c(n * n), ref(n * n);
  for (int i = 0; i < n * n; i++) {
    a[i] = (float)((i * 13) % 29) / 29.0f;
    b[i] = (float)((i * 17) % 31) / 31.0f;
    c[i] = (float)((i * 19) % 23) / 23.0f;
  }
  for (int j = 0; j < n; j++)
    for (int i = 0; i < n; i++) {
      double s = 0;
      for (int k = 0; k < n; k++) s += (double)a[k * n + i] * b[j * n + k];
      ref[j * n + i] = (float)(alpha * s + beta * c[j * n + i]);
    }
  float *da, *db, *dc;
  CK(cudaMalloc(&da, n * n * 4));
  CK(cudaMalloc(&db, n * n * 4));
  CK(cudaMalloc(&dc, n * n * 4));
  cublasHandle_t h;
  cublasStatus_t st = cublasCreate(&h);
  if (st != CUBLAS_STATUS_SUCCESS) {
    printf("FAIL cublasCreate: %d\n", (int)st);
    return 1;
  }
  double t0 = now_s();
  cublasSetVector(n * n, 4, a.data(), 1, da, 1);
  cublasSetVector(n * n, 4, b.data(), 1, db, 1);
  cublasSetVector(n * n, 4, c.data(), 1, dc, 1);
  st = cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, da, n, db, n, &beta, dc, n);
  cublasGetVector(n * n, 4, dc, 1, c.data(), 1);
  double t1 = now_s();
  double worst = 0;
  for (int i = 0; i < n * n; i++) worst = std::fmax(worst, std::fabs(c[i] - ref[i]) / (std::fabs(ref[i]) + 1e-6));
  printf("cublas_simple: sgemm status %d, hash %016llx, error %s\n", (int)st,
         (unsigned long long)fnv1a(c.data(), c.size() * 4), worst < 1e-4 ? "small" : "LARGE");
  fprintf(stderr, "cublas_simple: %.3f ms\n", (t1 - t0) * 1e3);
  cublasDestroy(h);
  int ok = st == CUBLAS_STATUS_SUCCESS && worst < 1e-4;
  printf("cublas_simple: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
