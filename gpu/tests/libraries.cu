// libraries: CUDA math libraries linked normally (their own static runtimes reach the driver
// through cuGetProcAddress and the private export tables): cuBLAS cublasSgemm and
// cublasGemmEx, cuRAND (Philox uniform), cuFFT (1-D C2C forward), cuSOLVER cusolverDnSgetrf +
// cusolverDnSgetrs on a 64x64 system. Prints the library status codes and FNV-1a hashes of
// the raw result bytes, so native and remoted outputs must be bit-identical; also checks the
// LU solution's residual. Each section prints its status and goes on, so one failing library
// does not hide the others.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cufft.h>
#include <curand.h>
#include <cusolverDn.h>

static uint64_t fnv(const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

static int failures = 0;
#define REPORT(name, status)                              \
  do {                                                    \
    int s_ = (int)(status);                               \
    printf("%s: status %d\n", name, s_);                  \
    if (s_ != 0) failures++;                              \
  } while (0)

int main() {
  const int n = 64;
  std::vector<float> a(n * n), b(n * n), c(n * n);
  for (int i = 0; i < n * n; i++) {
    a[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
    b[i] = (float)((i * 53) % 97) / 97.0f - 0.5f;
  }
  for (int i = 0; i < n; i++) a[i * n + i] += (float)n;  // diagonally dominant: LU is stable
  float *da, *db, *dc;
  REPORT("cudaMalloc", cudaMalloc(&da, n * n * sizeof(float)) | cudaMalloc(&db, n * n * sizeof(float)) |
                           cudaMalloc(&dc, n * n * sizeof(float)));
  cudaMemcpy(da, a.data(), n * n * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), n * n * sizeof(float), cudaMemcpyHostToDevice);

  // cuBLAS
  cublasHandle_t blas;
  cublasStatus_t bs = cublasCreate(&blas);
  REPORT("cublasCreate", bs);
  if (bs == CUBLAS_STATUS_SUCCESS) {
    float one = 1.0f, zero = 0.0f;
    REPORT("cublasSgemm", cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, da, n, db, n, &zero, dc, n));
    cudaMemcpy(c.data(), dc, n * n * sizeof(float), cudaMemcpyDeviceToHost);
    printf("cublasSgemm: hash %016llx c[0]=%.6f c[last]=%.6f\n", (unsigned long long)fnv(c.data(), c.size() * 4),
           c[0], c[n * n - 1]);
    REPORT("cublasGemmEx", cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, da, CUDA_R_32F, n, db,
                                        CUDA_R_32F, n, &zero, dc, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT));
    cudaMemcpy(c.data(), dc, n * n * sizeof(float), cudaMemcpyDeviceToHost);
    printf("cublasGemmEx: hash %016llx c[0]=%.6f\n", (unsigned long long)fnv(c.data(), c.size() * 4), c[0]);
    cublasDestroy(blas);
  }

  // cuRAND
  curandGenerator_t gen;
  curandStatus_t rs = curandCreateGenerator(&gen, CURAND_RNG_PSEUDO_PHILOX4_32_10);
  REPORT("curandCreateGenerator", rs);
  if (rs == CURAND_STATUS_SUCCESS) {
    REPORT("curandSetSeed", curandSetPseudoRandomGeneratorSeed(gen, 1234ull));
    REPORT("curandGenerateUniform", curandGenerateUniform(gen, dc, n * n));
    cudaMemcpy(c.data(), dc, n * n * sizeof(float), cudaMemcpyDeviceToHost);
    printf("curand: hash %016llx u[0]=%.6f\n", (unsigned long long)fnv(c.data(), c.size() * 4), c[0]);
    curandDestroyGenerator(gen);
  }

  // cuFFT: 1-D complex-to-complex forward transform of 256 points
  {
    const int m = 256;
    std::vector<cufftComplex> x(m);
    for (int i = 0; i < m; i++) {
      x[i].x = (float)std::cos(2.0 * 3.14159265358979323846 * 5 * i / m);
      x[i].y = 0.25f * (float)((i * 7) % 13) / 13.0f;
    }
    cufftComplex *dx;
    cudaMalloc(&dx, m * sizeof(cufftComplex));
    cudaMemcpy(dx, x.data(), m * sizeof(cufftComplex), cudaMemcpyHostToDevice);
    cufftHandle plan;
    cufftResult fr = cufftPlan1d(&plan, m, CUFFT_C2C, 1);
    REPORT("cufftPlan1d", fr);
    if (fr == CUFFT_SUCCESS) {
      REPORT("cufftExecC2C", cufftExecC2C(plan, dx, dx, CUFFT_FORWARD));
      cudaMemcpy(x.data(), dx, m * sizeof(cufftComplex), cudaMemcpyDeviceToHost);
      printf("cufft: hash %016llx X[5]=(%.4f,%.4f)\n", (unsigned long long)fnv(x.data(), m * 8), x[5].x, x[5].y);
      cufftDestroy(plan);
    }
    cudaFree(dx);
  }

  // cuSOLVER: LU factorization and solve of a * X = b (64 right-hand sides)
  cusolverDnHandle_t sol;
  cusolverStatus_t ss = cusolverDnCreate(&sol);
  REPORT("cusolverDnCreate", ss);
  if (ss == CUSOLVER_STATUS_SUCCESS) {
    int lwork = 0, *dpiv, *dinfo, info = -1;
    REPORT("cusolverDnSgetrf_bufferSize", cusolverDnSgetrf_bufferSize(sol, n, n, da, n, &lwork));
    float *dwork;
    cudaMalloc(&dwork, (lwork > 0 ? lwork : 1) * sizeof(float));
    cudaMalloc(&dpiv, n * sizeof(int));
    cudaMalloc(&dinfo, sizeof(int));
    REPORT("cusolverDnSgetrf", cusolverDnSgetrf(sol, n, n, da, n, dwork, dpiv, dinfo));
    cudaMemcpy(&info, dinfo, sizeof(int), cudaMemcpyDeviceToHost);
    printf("getrf info %d\n", info);
    REPORT("cusolverDnSgetrs", cusolverDnSgetrs(sol, CUBLAS_OP_N, n, n, da, n, dpiv, db, n, dinfo));
    cudaMemcpy(&info, dinfo, sizeof(int), cudaMemcpyDeviceToHost);
    std::vector<float> xs(n * n);
    cudaMemcpy(xs.data(), db, n * n * sizeof(float), cudaMemcpyDeviceToHost);
    double worst = 0;  // max |a * x - b| over every right-hand side
    for (int col = 0; col < n; col++)
      for (int row = 0; row < n; row++) {
        double r = -b[col * n + row];
        for (int k = 0; k < n; k++) r += (double)a[k * n + row] * xs[col * n + k];
        worst = std::fmax(worst, std::fabs(r));
      }
    printf("getrs info %d: hash %016llx residual %s\n", info, (unsigned long long)fnv(xs.data(), xs.size() * 4),
           worst < 1e-3 ? "small" : "LARGE");
    if (worst >= 1e-3) failures++;
    cusolverDnDestroy(sol);
  }
  printf("sync: %d\n", (int)cudaDeviceSynchronize());
  printf("libraries: %s\n", failures ? "FAIL" : "PASS");
  return failures ? 1 : 0;
}
