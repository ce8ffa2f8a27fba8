// capture_probe: cuBLAS calls outside and inside stream capture on a created stream and on the
// default stream, printing each stream's handle, to observe under gpu/tools/export_spy.c which
// arguments cuBLAS passes to the private TOOLS_CONTEXT slots (51, 39) in each case. Not part
// of the pass/fail suite.
//   nvcc -o capture_probe capture_probe.cu -lcublas
#include <cstdio>
#include <cuda_runtime.h>
#include <cublas_v2.h>

int main() {
  const int n = 1024;
  float *x = nullptr, *r = nullptr;
  cudaMalloc(&x, n * sizeof(float));
  cudaMalloc(&r, 4 * sizeof(float));
  cudaMemset(x, 0, n * sizeof(float));
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cublasHandle_t h;
  printf("cublasCreate: %d\n", (int)cublasCreate(&h));
  cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE);
  fprintf(stderr, "PROBE default stream, no capture\n");
  printf("sdot default stream: %d\n", (int)cublasSdot(h, n, x, 1, x, 1, r));
  cublasSetStream(h, s);
  fprintf(stderr, "PROBE stream %p, no capture\n", (void *)s);
  printf("sdot created stream: %d\n", (int)cublasSdot(h, n, x, 1, x, 1, r + 1));
  cudaStreamSynchronize(s);
  fprintf(stderr, "PROBE stream %p, capturing\n", (void *)s);
  printf("begin capture: %d\n", (int)cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  printf("sdot in capture: %d\n", (int)cublasSdot(h, n, x, 1, x, 1, r + 2));
  cudaGraph_t g;
  printf("end capture: %d\n", (int)cudaStreamEndCapture(s, &g));
  cudaGraphExec_t e;
  printf("instantiate: %d\n", (int)cudaGraphInstantiate(&e, g, 0));
  printf("launch: %d\n", (int)cudaGraphLaunch(e, s));
  printf("sync: %d\n", (int)cudaStreamSynchronize(s));
  fprintf(stderr, "PROBE done\n");
  return 0;
}
