// managed_memory: cudaMallocManaged as ordinary programs use it, keeping to the rules CUDA
// sets for devices without concurrent managed access (the host touches managed memory only
// while no kernel runs), which Remora's managed memory follows.
//
//   1. host writes -> kernel -> cudaDeviceSynchronize -> host reads, several rounds;
//   2. the same on a non-blocking stream, completed by cudaStreamSynchronize, by a polled
//      cudaStreamQuery and by cudaEventSynchronize;
//   3. managed memory as source and destination of cudaMemcpy and cudaMemset;
//   4. hints: cudaMemPrefetchAsync, cudaMemAdvise, cudaStreamAttachMemAsync;
//   5. cudaPointerGetAttributes, and the managedMemory device property;
//   6. a flag the kernel sets only on a mismatch (the pattern of NVIDIA's graphMemoryNodes);
//   7. host functions (cudaLaunchHostFunc, a graph's host node) that read what kernels
//      before them wrote and write what kernels enqueued after them (before they ran) read.
// Each section prints one line with a hash; any mismatch prints FAIL and exits 1.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <cuda_runtime.h>
#include "test_rt.h"

__global__ void scale_add(uint32_t *v, size_t n, uint32_t k) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) v[i] = v[i] * 3 + k;
}

struct HostStep {
  uint32_t *v;
  size_t n;
  uint64_t seen;  // hash of what the function read
};

// Sleeps first, so that the kernels after it are enqueued before it runs.
static void CUDART_CB host_step(void *p) {
  HostStep *s = (HostStep *)p;
  struct timespec t = {0, 50 * 1000 * 1000};
  nanosleep(&t, nullptr);
  s->seen = hash32(s->v, s->n);
  for (size_t i = 0; i < s->n; i += 7) s->v[i] ^= 0x5a5a;
}

__global__ void flag_mismatch(const uint32_t *a, const uint32_t *b, size_t n, bool *failed) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n && a[i] != b[i]) *failed = true;
}

int main() {
  const size_t n = (4u << 20) / 4 + 77;  // a little over 4 MiB, odd length
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("managedMemory %d\n", prop.managedMemory);

  // 1. rounds on the legacy stream
  uint32_t *m = nullptr;
  CHECK(cudaMallocManaged(&m, n * 4));
  uint64_t acc = 0;
  for (uint32_t r = 0; r < 4; r++) {
    fill_seq(m, n, r);
    affine32<<<264, 256>>>(m, n, 2 * r + 3, r);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    if (check_affine("legacy round", m, n, r, 2 * r + 3, r)) return 1;
    acc ^= hash32(m, n) + r;
  }
  printf("1. 4 rounds, cudaDeviceSynchronize: %016llx\n", (unsigned long long)acc);

  // 2. a non-blocking stream and three ways to see completion
  cudaStream_t s;
  cudaEvent_t e;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CHECK(cudaEventCreate(&e));
  acc = 0;
  for (uint32_t r = 0; r < 6; r++) {
    fill_seq(m, n, 10 + r);
    affine32<<<132, 512, 0, s>>>(m, n, 5, r);
    switch (r % 3) {
      case 0: CHECK(cudaStreamSynchronize(s)); break;
      case 1: {
        cudaError_t q;
        while ((q = cudaStreamQuery(s)) == cudaErrorNotReady) {}
        CHECK(q);
        break;
      }
      default: CHECK(cudaEventRecord(e, s)); CHECK(cudaEventSynchronize(e)); break;
    }
    if (check_affine("stream round", m, n, 10 + r, 5, r)) return 1;
    acc ^= hash32(m, n) + r;
  }
  printf("2. 6 rounds on a stream: %016llx\n", (unsigned long long)acc);

  // 3. copies and memsets
  uint32_t *d = nullptr, *h = (uint32_t *)malloc(n * 4);
  CHECK(cudaMalloc(&d, n * 4));
  fill_seq(m, n, 99);
  CHECK(cudaMemcpy(d, m, n * 4, cudaMemcpyDefault));  // managed -> device
  affine32<<<264, 256>>>(d, n, 3, 1);
  CHECK(cudaMemcpy(m, d, n * 4, cudaMemcpyDeviceToDevice));  // device -> managed
  if (check_affine("copy back", m, n, 99, 3, 1)) return 1;
  CHECK(cudaMemset(m + 100, 0xab, 4000));
  CHECK(cudaMemcpy(h, m, n * 4, cudaMemcpyDefault));  // managed -> host
  for (size_t i = 0; i < n; i++) {
    uint32_t want = (i >= 100 && i < 1100) ? 0xabababab : (uint32_t)(i * 2654435761u + 99) * 3 + 1;
    if (m[i] != want || h[i] != want) { printf("FAIL memset/copy element %zu\n", i); return 1; }
  }
  printf("3. copies and memsets: %016llx\n", (unsigned long long)hash32(m, n));

  // 4. hints change nothing a program can see
  cudaMemLocation loc = {cudaMemLocationTypeDevice, 0};
  CHECK(cudaMemAdvise(m, n * 4, cudaMemAdviseSetReadMostly, loc));
  CHECK(cudaMemPrefetchAsync(m, n * 4, loc, 0, s));
  CHECK(cudaStreamAttachMemAsync(s, m, 0, cudaMemAttachGlobal));
  affine32<<<132, 512, 0, s>>>(m, n, 1, 1);
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaMemAdvise(m, n * 4, cudaMemAdviseUnsetReadMostly, loc));
  printf("4. after hints: %016llx\n", (unsigned long long)hash32(m, n));

  // 5. pointer attributes
  cudaPointerAttributes a;
  CHECK(cudaPointerGetAttributes(&a, m + 3));
  printf("5. type %d (managed %d), device pointer %s, host pointer %s\n", (int)a.type,
         (int)cudaMemoryTypeManaged, a.devicePointer == (void *)(m + 3) ? "same" : "other",
         a.hostPointer == (void *)(m + 3) ? "same" : "other");

  // 6. a flag set by the kernel only on a mismatch
  bool *failed = nullptr;
  CHECK(cudaMallocManaged(&failed, sizeof(bool)));
  *failed = false;
  CHECK(cudaMemcpy(d, m, n * 4, cudaMemcpyDefault));
  flag_mismatch<<<(n + 255) / 256, 256>>>(d, m, n, failed);
  CHECK(cudaDeviceSynchronize());
  int first = *failed;
  m[n / 2] ^= 1;
  flag_mismatch<<<(n + 255) / 256, 256>>>(d, m, n, failed);
  CHECK(cudaDeviceSynchronize());
  printf("6. mismatch flag: %d then %d\n", first, (int)*failed);
  EXPECT(first == 0 && *failed);

  // 7. host functions between kernels on one stream, then a graph with a host node
  {
    HostStep step = {m, n, 0};
    for (size_t i = 0; i < n; i++) m[i] = (uint32_t)i;
    uint64_t seen = 0;
    for (int r = 0; r < 3; r++) {
      scale_add<<<(n + 255) / 256, 256, 0, s>>>(m, n, r);
      CHECK(cudaLaunchHostFunc(s, host_step, &step));
      scale_add<<<(n + 255) / 256, 256, 0, s>>>(m, n, 100 + r);
      CHECK(cudaStreamSynchronize(s));
      seen ^= step.seen;
    }
    printf("7a. host functions on a stream: read %016llx, after %016llx\n",
           (unsigned long long)seen, (unsigned long long)hash32(m, n));
    cudaGraph_t g;
    cudaGraphNode_t node;
    cudaHostNodeParams hp = {host_step, &step};
    CHECK(cudaGraphCreate(&g, 0));
    CHECK(cudaGraphAddHostNode(&node, g, nullptr, 0, &hp));
    cudaGraphExec_t ge;
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    seen = 0;
    for (int r = 0; r < 2; r++) {
      CHECK(cudaGraphLaunch(ge, s));
      scale_add<<<(n + 255) / 256, 256, 0, s>>>(m, n, 200 + r);
      CHECK(cudaStreamSynchronize(s));
      seen ^= step.seen;
    }
    printf("7b. a graph host node: read %016llx, after %016llx\n", (unsigned long long)seen,
           (unsigned long long)hash32(m, n));
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
  }

  CHECK(cudaFree(failed));
  CHECK(cudaFree(d));
  CHECK(cudaFree(m));
  CHECK(cudaEventDestroy(e));
  CHECK(cudaStreamDestroy(s));
  free(h);
  printf("managed_memory: all checks passed\n");
  return 0;
}
