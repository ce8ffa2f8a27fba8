// graphs: CUDA graphs through stream capture, a CUDA *runtime* program built like
// runtime_api.cu (nvcc's default static cudart). Captures, on two non-blocking streams joined
// by events, a device-to-device cudaMemcpyAsync, cudaMemsetAsync and three kernels;
// instantiates the graph, uploads it and launches it 10 times on a third stream; checks every
// element. Also: capture status queries (cudaStreamIsCapturing, cudaStreamGetCaptureInfo) on
// the origin stream, a joined stream and one outside the capture; the node count;
// cudaThreadExchangeStreamCaptureMode; a stream synchronize inside a capture (refused, the
// capture invalidated, as CUDA defines). Output is deterministic.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(call)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      printf("FAIL %s: %d %s\n", #call, (int)e_, cudaGetErrorName(e_));                   \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

__global__ void inc(int *x, int n, int by) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += by;
}

__global__ void add_twice(int *c, const int *b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] += 2 * b[i];
}

__global__ void accumulate(long long *acc, const int *c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) acc[i] += c[i];
}

static const char *status_name(cudaStreamCaptureStatus s) {
  switch (s) {
    case cudaStreamCaptureStatusNone: return "none";
    case cudaStreamCaptureStatusActive: return "active";
    case cudaStreamCaptureStatusInvalidated: return "invalidated";
  }
  return "?";
}

static void print_status(const char *what, cudaStream_t s) {
  cudaStreamCaptureStatus st;
  CK(cudaStreamIsCapturing(s, &st));
  printf("%s %s\n", what, status_name(st));
}

int main() {
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  printf("devices>0 %s\n", ndev > 0 ? "yes" : "no");
  const int N = 1 << 18, T = 256, B = (N + T - 1) / T, LAUNCHES = 10;
  int *a, *b, *c;
  long long *acc;
  CK(cudaMalloc(&a, N * sizeof(int)));
  CK(cudaMalloc(&b, N * sizeof(int)));
  CK(cudaMalloc(&c, N * sizeof(int)));
  CK(cudaMalloc(&acc, N * sizeof(long long)));
  int *ha = (int *)malloc(N * sizeof(int));
  long long *hacc = (long long *)malloc(N * sizeof(long long));
  for (int i = 0; i < N; i++) ha[i] = (int)((i * 2654435761u) % 1000) - 500;
  CK(cudaMemcpy(a, ha, N * sizeof(int), cudaMemcpyHostToDevice));
  CK(cudaMemset(acc, 0, N * sizeof(long long)));

  cudaStream_t s1, s2, s3;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s3, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));

  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  CK(cudaThreadExchangeStreamCaptureMode(&mode));
  printf("capture mode was %d\n", (int)mode);
  CK(cudaThreadExchangeStreamCaptureMode(&mode));
  printf("capture mode restored from %d\n", (int)mode);

  print_status("s1 before capture", s1);
  CK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  print_status("s1 capturing", s1);
  print_status("s2 before joining", s2);
  // s1: b = a + 1; fork to s2.
  CK(cudaMemcpyAsync(b, a, N * sizeof(int), cudaMemcpyDeviceToDevice, s1));
  inc<<<B, T, 0, s1>>>(b, N, 1);
  CK(cudaGetLastError());
  CK(cudaEventRecord(fork, s1));
  CK(cudaStreamWaitEvent(s2, fork, 0));
  print_status("s2 joined", s2);
  // s2: c = 2 * b; join back into s1.
  CK(cudaMemsetAsync(c, 0, N * sizeof(int), s2));
  add_twice<<<B, T, 0, s2>>>(c, b, N);
  CK(cudaGetLastError());
  CK(cudaEventRecord(join, s2));
  CK(cudaStreamWaitEvent(s1, join, 0));
  // s1: acc += c.
  accumulate<<<B, T, 0, s1>>>(acc, c, N);
  CK(cudaGetLastError());
  {
    cudaStreamCaptureStatus st;
    unsigned long long id1 = 0, id2 = 0;
    CK(cudaStreamGetCaptureInfo(s1, &st, &id1));
    CK(cudaStreamGetCaptureInfo(s2, &st, &id2));
    printf("same capture id on both streams %s\n", id1 == id2 && id1 != 0 ? "yes" : "no");
  }
  cudaGraph_t graph;
  CK(cudaStreamEndCapture(s1, &graph));
  print_status("s1 after capture", s1);
  print_status("s2 after capture", s2);
  size_t nodes = 0;
  CK(cudaGraphGetNodes(graph, nullptr, &nodes));
  printf("graph nodes %zu\n", nodes);

  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaGraphUpload(exec, s3));
  for (int l = 0; l < LAUNCHES; l++) CK(cudaGraphLaunch(exec, s3));
  CK(cudaStreamSynchronize(s3));
  CK(cudaMemcpy(hacc, acc, N * sizeof(long long), cudaMemcpyDeviceToHost));
  long long bad = 0, sum = 0;
  for (int i = 0; i < N; i++) {
    long long want = (long long)LAUNCHES * 2 * (ha[i] + 1);
    if (hacc[i] != want) bad++;
    sum += hacc[i];
  }
  printf("graph launched %d times: %lld wrong elements, sum %lld\n", LAUNCHES, bad, sum);

  // A synchronize inside a capture is refused and invalidates the capture.
  CK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  inc<<<B, T, 0, s1>>>(b, N, 1);
  cudaError_t e = cudaStreamSynchronize(s1);
  printf("synchronize while capturing: %s\n", cudaGetErrorName(e));
  print_status("s1 after the synchronize", s1);
  cudaGraph_t broken = nullptr;
  e = cudaStreamEndCapture(s1, &broken);
  printf("end of the invalidated capture: %s, graph %s\n", cudaGetErrorName(e),
         broken ? "set" : "null");
  (void)cudaGetLastError();
  print_status("s1 after it", s1);

  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaEventDestroy(fork));
  CK(cudaEventDestroy(join));
  CK(cudaStreamDestroy(s1));
  CK(cudaStreamDestroy(s2));
  CK(cudaStreamDestroy(s3));
  CK(cudaFree(a));
  CK(cudaFree(b));
  CK(cudaFree(c));
  CK(cudaFree(acc));
  CK(cudaDeviceSynchronize());
  free(ha);
  free(hacc);
  printf("graphs %s\n", bad == 0 ? "PASS" : "FAIL");
  return bad == 0 ? 0 : 1;
}
