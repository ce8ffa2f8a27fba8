// library_probe: one call into each CUDA math library (cuBLAS, cuBLASLt through cublasGemmEx,
// cuFFT, cuRAND, cuSOLVER, cuSPARSE), to observe through `REMORA_LOG=info remora run` which
// private export tables (cuGetExportTable UUIDs) and driver entry points each library's own
// static runtime asks for. Prints each library's status; not part of the pass/fail suite.
//   nvcc -o library_probe library_probe.cu -lcublas -lcublasLt -lcufft -lcurand -lcusolver -lcusparse
#include <cstdio>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cufft.h>
#include <curand.h>
#include <cusolverDn.h>
#include <cusparse.h>

int main() {
  float *d = nullptr;
  printf("cudaMalloc: %d\n", (int)cudaMalloc(&d, 64 * 64 * sizeof(float) * 3));
  fflush(stdout);
  cublasHandle_t blas;
  cublasStatus_t bs = cublasCreate(&blas);
  printf("cublasCreate: %d\n", (int)bs);
  fflush(stdout);
  if (bs == CUBLAS_STATUS_SUCCESS) {
    float one = 1.0f, zero = 0.0f;
    printf("cublasSgemm: %d\n", (int)cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, 64, 64, 64, &one, d, 64,
                                                 d + 4096, 64, &zero, d + 8192, 64));
    printf("cublasGemmEx: %d\n",
           (int)cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, 64, 64, 64, &one, d, CUDA_R_32F, 64, d + 4096,
                             CUDA_R_32F, 64, &zero, d + 8192, CUDA_R_32F, 64, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT));
    printf("sync after gemm: %d\n", (int)cudaDeviceSynchronize());
    cublasDestroy(blas);
  }
  fflush(stdout);
  cufftHandle plan;
  printf("cufftPlan1d: %d\n", (int)cufftPlan1d(&plan, 256, CUFFT_C2C, 1));
  fflush(stdout);
  curandGenerator_t gen;
  curandStatus_t rs = curandCreateGenerator(&gen, CURAND_RNG_PSEUDO_DEFAULT);
  printf("curandCreateGenerator: %d\n", (int)rs);
  if (rs == CURAND_STATUS_SUCCESS) printf("curandGenerateUniform: %d\n", (int)curandGenerateUniform(gen, d, 256));
  fflush(stdout);
  cusolverDnHandle_t sol;
  printf("cusolverDnCreate: %d\n", (int)cusolverDnCreate(&sol));
  fflush(stdout);
  cusparseHandle_t sp;
  printf("cusparseCreate: %d\n", (int)cusparseCreate(&sp));
  printf("final sync: %d\n", (int)cudaDeviceSynchronize());
  return 0;
}
