// A CUDA runtime program with a kernel. On the emulated test backend the module registration
// reaches the server but the image has no functions there, so the launch must fail loudly
// (crates/cli/tests/run_runtime.rs); on a GPU it prints "sum 499500".
#include <cstdio>
#include <cuda_runtime.h>

__global__ void fill(int *out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = i;
}

int main() {
  int n = 1000;
  int *d = nullptr;
  cudaError_t e = cudaMalloc((void **)&d, n * sizeof(int));
  printf("malloc %d\n", (int)e);
  fill<<<(n + 255) / 256, 256>>>(d, n);
  e = cudaGetLastError();
  printf("launch %d %s\n", (int)e, cudaGetErrorName(e));
  e = cudaDeviceSynchronize();
  printf("sync %d %s\n", (int)e, cudaGetErrorName(e));
  int h[1000];
  e = cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
  long sum = 0;
  for (int i = 0; i < n; i++) sum += h[i];
  if (e == cudaSuccess) printf("sum %ld\n", sum);
  return 0;
}
