// runtime_api: a CUDA *runtime* program (no driver API, kernels registered by the runtime from
// its embedded fatbin), built twice by build.sh: runtime_static (nvcc's default static cudart)
// and runtime_shared (-cudart shared). Under Remora the runtime reaches the shim through
// cuGetProcAddress and the private export tables (docs/export-tables.md).
// Covers: vector add, a shared-memory reduction, __constant__ memory with
// cudaMemcpyToSymbol, a __device__ global read back with cudaMemcpyFromSymbol, a stream with
// async copies and events, cudaMemcpyDefault, cudaDeviceSynchronize. Output is deterministic.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#define CK(call)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      printf("FAIL %s: %d %s\n", #call, (int)e_, cudaGetErrorName(e_));                   \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

__constant__ int scale;
__device__ unsigned long long launches;

__global__ void vadd(const int *a, const int *b, int *c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = scale * a[i] + b[i];
  if (i == 0) atomicAdd(&launches, 1ull);
}

__global__ void reduce(const int *in, unsigned long long *out, int n) {
  __shared__ unsigned long long part[256];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  part[threadIdx.x] = i < n ? (unsigned long long)in[i] : 0;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out, part[0]);
  if (i == 0) atomicAdd(&launches, 1ull);
}

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  printf("devices>0 %s\n", n > 0 ? "yes" : "no");
  const int N = 1 << 20;
  int *ha, *hb, *hc;
  CK(cudaMallocHost((void **)&ha, N * sizeof(int)));
  CK(cudaMallocHost((void **)&hb, N * sizeof(int)));
  hc = (int *)malloc(N * sizeof(int));
  for (int i = 0; i < N; i++) {
    ha[i] = i % 1000;
    hb[i] = (i * 7) % 13;
  }
  int k = 3;
  CK(cudaMemcpyToSymbol(scale, &k, sizeof k));
  unsigned long long zero = 0;
  CK(cudaMemcpyToSymbol(launches, &zero, sizeof zero));

  int *a, *b, *c;
  unsigned long long *sum;
  CK(cudaMalloc((void **)&a, N * sizeof(int)));
  CK(cudaMalloc((void **)&b, N * sizeof(int)));
  CK(cudaMalloc((void **)&c, N * sizeof(int)));
  CK(cudaMalloc((void **)&sum, sizeof *sum));

  cudaStream_t s;
  cudaEvent_t start, stop;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  CK(cudaEventRecord(start, s));
  CK(cudaMemcpyAsync(a, ha, N * sizeof(int), cudaMemcpyHostToDevice, s));
  CK(cudaMemcpyAsync(b, hb, N * sizeof(int), cudaMemcpyDefault, s));
  CK(cudaMemsetAsync(sum, 0, sizeof *sum, s));
  vadd<<<(N + 255) / 256, 256, 0, s>>>(a, b, c, N);
  CK(cudaGetLastError());
  reduce<<<(N + 255) / 256, 256, 0, s>>>(c, sum, N);
  CK(cudaGetLastError());
  CK(cudaEventRecord(stop, s));
  CK(cudaEventSynchronize(stop));
  float ms = -1;
  CK(cudaEventElapsedTime(&ms, start, stop));
  printf("elapsed>=0 %s\n", ms >= 0 ? "yes" : "no");

  CK(cudaMemcpy(hc, c, N * sizeof(int), cudaMemcpyDeviceToHost));
  long long bad = 0, want = 0;
  for (int i = 0; i < N; i++) {
    int v = 3 * ha[i] + hb[i];
    bad += hc[i] != v;
    want += v;
  }
  unsigned long long got = 0, count = 0;
  CK(cudaMemcpy(&got, sum, sizeof got, cudaMemcpyDefault));
  CK(cudaMemcpyFromSymbol(&count, launches, sizeof count));
  CK(cudaDeviceSynchronize());
  printf("vadd mismatches %lld\n", bad);
  printf("sum %llu expected %lld %s\n", got, want, got == (unsigned long long)want ? "ok" : "WRONG");
  printf("kernel launches counted %llu\n", count);

  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
  CK(cudaStreamDestroy(s));
  CK(cudaFree(a));
  CK(cudaFree(b));
  CK(cudaFree(c));
  CK(cudaFree(sum));
  CK(cudaFreeHost(ha));
  CK(cudaFreeHost(hb));
  free(hc);
  int ok = bad == 0 && got == (unsigned long long)want && count == 2;
  printf("%s\n", ok ? "runtime_api PASS" : "runtime_api FAIL");
  return ok ? 0 : 1;
}
