// streams_overlap: the CUDA samples' simpleStreams pattern: 8 streams, each copying its
// chunk in (pinned memory, async), running a kernel on it and copying it out, so copies and
// kernels of different streams overlap; events time the whole (stderr) and a cross-stream
// event wait orders a final reduction. Results verified and hashed.
#include <vector>
#include "common_rt.h"

__global__ void work(int *d, int n, int salt) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    unsigned v = (unsigned)d[i];
    for (int k = 0; k < 64; k++) v = v * 1103515245u + 12345u + (unsigned)salt;
    d[i] = (int)v;
  }
}

__global__ void combine(const int *d, int n, unsigned long long *out) {
  unsigned long long s = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) s += (unsigned)d[i];
  atomicAdd(out, s);
}

int main() {
  const int streams = 8, chunk = 1 << 20, n = streams * chunk;
  int *h, *d;
  CK(cudaMallocHost(&h, n * sizeof(int)));
  CK(cudaMalloc(&d, n * sizeof(int)));
  for (int i = 0; i < n; i++) h[i] = i;
  std::vector<cudaStream_t> s(streams);
  std::vector<cudaEvent_t> done(streams);
  for (int k = 0; k < streams; k++) {
    CK(cudaStreamCreateWithFlags(&s[k], cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&done[k], cudaEventDisableTiming));
  }
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  CK(cudaEventRecord(start, s[0]));
  for (int k = 0; k < streams; k++) {
    int *hk = h + k * chunk, *dk = d + k * chunk;
    CK(cudaMemcpyAsync(dk, hk, chunk * sizeof(int), cudaMemcpyHostToDevice, s[k]));
    work<<<chunk / 256, 256, 0, s[k]>>>(dk, chunk, k);
    CK(cudaMemcpyAsync(hk, dk, chunk * sizeof(int), cudaMemcpyDeviceToHost, s[k]));
    CK(cudaEventRecord(done[k], s[k]));
  }
  // Stream 0 waits for all the others, then reduces on the device.
  unsigned long long *dsum, sum = 0;
  CK(cudaMalloc(&dsum, sizeof *dsum));
  CK(cudaMemsetAsync(dsum, 0, sizeof *dsum, s[0]));
  for (int k = 1; k < streams; k++) CK(cudaStreamWaitEvent(s[0], done[k], 0));
  combine<<<264, 256, 0, s[0]>>>(d, n, dsum);
  CK(cudaMemcpyAsync(&sum, dsum, sizeof sum, cudaMemcpyDeviceToHost, s[0]));
  CK(cudaEventRecord(stop, s[0]));
  CK(cudaEventSynchronize(stop));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, start, stop));
  CK(cudaDeviceSynchronize());
  // Host reference.
  unsigned long long want = 0;
  int bad = 0;
  for (int k = 0; k < streams; k++)
    for (int i = 0; i < chunk; i++) {
      unsigned v = (unsigned)(k * chunk + i);
      for (int r = 0; r < 64; r++) v = v * 1103515245u + 12345u + (unsigned)k;
      bad += (unsigned)h[k * chunk + i] != v;
      want += (unsigned)v;
    }
  printf("streams_overlap: %d streams x %d ints, hash %016llx, %d wrong, sum %s\n", streams, chunk,
         (unsigned long long)fnv1a(h, n * sizeof(int)), bad, sum == want ? "matches" : "DIFFERS");
  fprintf(stderr, "streams_overlap: %.3f ms (events)\n", ms);
  for (int k = 0; k < streams; k++) {
    CK(cudaStreamDestroy(s[k]));
    CK(cudaEventDestroy(done[k]));
  }
  int ok = bad == 0 && sum == want;
  printf("streams_overlap: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
