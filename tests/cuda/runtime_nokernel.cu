// A CUDA runtime program without kernels, run through `remora run` on the emulated test backend
// (crates/cli/tests/run_runtime.rs). Prints one line per check; the test compares them.
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>

static int failures = 0;
#define CHECK(call)                                                                       \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    printf("%s %d %s\n", #call, (int)e_, cudaGetErrorName(e_));                           \
    if (e_ != cudaSuccess) failures++;                                                    \
  } while (0)

int main() {
  int n = -1;
  CHECK(cudaGetDeviceCount(&n));
  if (failures) return 2;  // no device: nothing else to check
  printf("device count %d\n", n);
  cudaDeviceProp prop;
  memset(&prop, 0, sizeof prop);
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("name %s\n", prop.name);
  printf("totalGlobalMem %zu\n", prop.totalGlobalMem);
  CHECK(cudaSetDevice(0));

  const size_t N = 1 << 20;
  unsigned *host = nullptr, *back = nullptr;
  CHECK(cudaMallocHost((void **)&host, N * sizeof(unsigned)));
  back = (unsigned *)malloc(N * sizeof(unsigned));
  for (size_t i = 0; i < N; i++) host[i] = (unsigned)(i * 2654435761u);
  unsigned *a = nullptr, *b = nullptr, *c = nullptr;
  CHECK(cudaMalloc((void **)&a, N * sizeof(unsigned)));
  CHECK(cudaMalloc((void **)&b, N * sizeof(unsigned)));
  CHECK(cudaMalloc((void **)&c, N * sizeof(unsigned)));
  CHECK(cudaMemcpy(a, host, N * sizeof(unsigned), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(b, a, N * sizeof(unsigned), cudaMemcpyDeviceToDevice));
  CHECK(cudaMemcpy(c, b, N * sizeof(unsigned), cudaMemcpyDefault));
  CHECK(cudaMemcpy(back, c, N * sizeof(unsigned), cudaMemcpyDeviceToHost));
  printf("roundtrip %s\n", memcmp(host, back, N * sizeof(unsigned)) == 0 ? "equal" : "DIFFERENT");
  memset(back, 0, N * sizeof(unsigned));
  CHECK(cudaMemcpy(back, b, N * sizeof(unsigned), cudaMemcpyDefault));
  printf("default d2h %s\n", memcmp(host, back, N * sizeof(unsigned)) == 0 ? "equal" : "DIFFERENT");

  CHECK(cudaMemset(c, 0xAB, N * sizeof(unsigned)));
  CHECK(cudaMemcpy(back, c, N * sizeof(unsigned), cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < N; i++) bad += back[i] != 0xABABABABu;
  printf("memset mismatches %zu\n", bad);

  cudaStream_t s;
  cudaEvent_t e0, e1;
  CHECK(cudaStreamCreate(&s));
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventRecord(e0, s));
  CHECK(cudaMemcpyAsync(a, host, N * sizeof(unsigned), cudaMemcpyHostToDevice, s));
  CHECK(cudaMemsetAsync(b, 0, N * sizeof(unsigned), s));
  CHECK(cudaMemcpyAsync(back, a, N * sizeof(unsigned), cudaMemcpyDeviceToHost, s));
  CHECK(cudaEventRecord(e1, s));
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaEventSynchronize(e1));
  float ms = -1;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  printf("elapsed non-negative %s\n", ms >= 0 ? "yes" : "no");
  printf("async roundtrip %s\n", memcmp(host, back, N * sizeof(unsigned)) == 0 ? "equal" : "DIFFERENT");
  CHECK(cudaStreamQuery(s));
  CHECK(cudaDeviceSynchronize());

  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  CHECK(cudaStreamDestroy(s));
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  CHECK(cudaFree(c));
  CHECK(cudaFreeHost(host));
  free(back);
  printf("error string %s\n", cudaGetErrorString(cudaErrorInvalidValue));
  printf("error name %s\n", cudaGetErrorName(cudaErrorMemoryAllocation));
  printf("bad free %d\n", (int)cudaFree((void *)0x10));
  cudaGetLastError();
  printf("failures %d\n", failures);
  return failures == 0 ? 0 : 1;
}
