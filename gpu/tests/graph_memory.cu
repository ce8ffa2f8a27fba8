// Graphs and memory (Remora protocol revision 12), natively and remoted with identical output:
//  1. memory allocation and free nodes: alloc -> kernel -> copy out -> free, launched several
//     times; an allocation without a free node stays usable after the launch until cudaFree;
//     the used graph memory is 0 after a launch that frees;
//  2. memcpy nodes whose host sides are pageable (malloc) memory, 1-D and 2-D, re-launched
//     with new host data every time, on two streams, every byte checked (the gaps between
//     destination rows must stay untouched);
//  3. cudaMemcpyAsync of pageable memory inside stream capture (the jacobiCudaGraphs
//     pattern): a device sum copied back to a host scalar at every launch;
//  4. stream-ordered allocation captured into a graph (cudaMallocAsync / cudaFreeAsync).
// Only hashes and checked facts are printed.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "test_rt.h"

__global__ void sum32(const uint32_t *p, size_t n, uint32_t *out) {
  uint32_t s = 0;
  for (size_t i = 0; i < n; i++) s += p[i];
  *out = s;
}

static int mem_nodes() {
  const size_t n = 1 << 16, bytes = n * sizeof(uint32_t);
  uint32_t *out;
  CHECK(cudaMalloc(&out, bytes));
  cudaGraph_t g;
  CHECK(cudaGraphCreate(&g, 0));
  cudaMemAllocNodeParams ap = {};
  ap.poolProps.allocType = cudaMemAllocationTypePinned;
  ap.poolProps.location.type = cudaMemLocationTypeDevice;
  ap.poolProps.location.id = 0;
  ap.bytesize = bytes;
  cudaGraphNode_t a, set, k, cp, f;
  CHECK(cudaGraphAddMemAllocNode(&a, g, nullptr, 0, &ap));
  uint32_t *p = (uint32_t *)ap.dptr;
  cudaMemsetParams ms = {};
  ms.dst = p; ms.value = 3; ms.elementSize = 4; ms.width = n; ms.height = 1;
  CHECK(cudaGraphAddMemsetNode(&set, g, &a, 1, &ms));
  cudaKernelNodeParams kp = {};
  size_t nn = n;
  uint32_t mul = 7, add = 1;
  void *args[] = {&p, &nn, &mul, &add};
  kp.func = (void *)affine32; kp.gridDim = dim3(64); kp.blockDim = dim3(256); kp.kernelParams = args;
  CHECK(cudaGraphAddKernelNode(&k, g, &set, 1, &kp));
  CHECK(cudaGraphAddMemcpyNode1D(&cp, g, &k, 1, out, p, bytes, cudaMemcpyDeviceToDevice));
  CHECK(cudaGraphAddMemFreeNode(&f, g, &cp, 1, p));
  cudaGraphNodeType t;
  CHECK(cudaGraphNodeGetType(a, &t));
  EXPECT(t == cudaGraphNodeTypeMemAlloc);
  CHECK(cudaGraphNodeGetType(f, &t));
  EXPECT(t == cudaGraphNodeTypeMemFree);
  void *freed = nullptr;
  CHECK(cudaGraphMemFreeNodeGetParams(f, &freed));
  EXPECT(freed == p);
  cudaGraphExec_t e;
  CHECK(cudaGraphInstantiate(&e, g, 0));
  std::vector<uint32_t> h(n);
  for (int round = 0; round < 3; round++) {
    CHECK(cudaMemset(out, 0, bytes));
    CHECK(cudaGraphLaunch(e, 0));
    CHECK(cudaStreamSynchronize(0));
    CHECK(cudaMemcpy(h.data(), out, bytes, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) EXPECT(h[i] == 22u);
  }
  size_t used = 1;
  CHECK(cudaDeviceGetGraphMemAttribute(0, cudaGraphMemAttrUsedMemCurrent, &used));
  printf("mem nodes: out %016llx, used after free %s\n", (unsigned long long)hash32(h.data(), n),
         used == 0 ? "0" : "nonzero");
  CHECK(cudaGraphExecDestroy(e));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaDeviceGraphMemTrim(0));

  // No free node: the allocation outlives the launch and the graph until cudaFree.
  CHECK(cudaGraphCreate(&g, 0));
  CHECK(cudaGraphAddMemAllocNode(&a, g, nullptr, 0, &ap));
  p = (uint32_t *)ap.dptr;
  CHECK(cudaGraphInstantiate(&e, g, 0));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaGraphLaunch(e, 0));
  CHECK(cudaStreamSynchronize(0));
  for (size_t i = 0; i < n; i++) h[i] = (uint32_t)(i * 2654435761u);
  CHECK(cudaMemcpy(p, h.data(), bytes, cudaMemcpyHostToDevice));
  std::vector<uint32_t> back(n);
  CHECK(cudaMemcpy(back.data(), p, bytes, cudaMemcpyDeviceToHost));
  EXPECT(back == h);
  CHECK(cudaGraphExecDestroy(e));
  CHECK(cudaFree(p));
  CHECK(cudaDeviceGraphMemTrim(0));
  CHECK(cudaFree(out));
  printf("mem nodes: unfreed allocation ok\n");
  return 0;
}

static int pageable_nodes() {
  const size_t w = 3000, rows = 5, spitch = 4096, dpitch = 5000;
  uint8_t *d;
  size_t dp;
  CHECK(cudaMallocPitch(&d, &dp, w, rows));
  std::vector<uint8_t> src(spitch * rows), dst(dpitch * rows, 0xee);
  uint32_t *src1 = (uint32_t *)malloc(4096 * 4), *dst1 = (uint32_t *)malloc(4096 * 4);
  uint32_t *d1;
  CHECK(cudaMalloc(&d1, 4096 * 4));
  cudaGraph_t g;
  CHECK(cudaGraphCreate(&g, 0));
  cudaGraphNode_t up, down, up1, k1, down1;
  cudaMemcpy3DParms c = {};
  c.srcPtr = make_cudaPitchedPtr(src.data(), spitch, w, rows);
  c.dstPtr = make_cudaPitchedPtr(d, dp, w, rows);
  c.extent = make_cudaExtent(w, rows, 1);
  c.kind = cudaMemcpyHostToDevice;
  CHECK(cudaGraphAddMemcpyNode(&up, g, nullptr, 0, &c));
  c = {};
  c.srcPtr = make_cudaPitchedPtr(d, dp, w, rows);
  c.dstPtr = make_cudaPitchedPtr(dst.data(), dpitch, w, rows);
  c.extent = make_cudaExtent(w, rows, 1);
  c.kind = cudaMemcpyDeviceToHost;
  CHECK(cudaGraphAddMemcpyNode(&down, g, &up, 1, &c));
  CHECK(cudaGraphAddMemcpyNode1D(&up1, g, nullptr, 0, d1, src1, 4096 * 4, cudaMemcpyHostToDevice));
  cudaKernelNodeParams kp = {};
  size_t n1 = 4096;
  uint32_t mul = 3, add = 5;
  void *args[] = {&d1, &n1, &mul, &add};
  kp.func = (void *)affine32; kp.gridDim = dim3(16); kp.blockDim = dim3(256); kp.kernelParams = args;
  CHECK(cudaGraphAddKernelNode(&k1, g, &up1, 1, &kp));
  CHECK(cudaGraphAddMemcpyNode1D(&down1, g, &k1, 1, dst1, d1, 4096 * 4, cudaMemcpyDeviceToHost));
  cudaGraphExec_t e;
  CHECK(cudaGraphInstantiate(&e, g, 0));
  cudaStream_t st[2];
  CHECK(cudaStreamCreateWithFlags(&st[0], cudaStreamNonBlocking));
  CHECK(cudaStreamCreate(&st[1]));
  uint64_t acc = 0;
  for (int round = 0; round < 8; round++) {
    for (size_t i = 0; i < src.size(); i++) src[i] = (uint8_t)(i * 31 + round * 7);
    for (size_t i = 0; i < 4096; i++) src1[i] = (uint32_t)(i + round * 1000);
    CHECK(cudaGraphLaunch(e, st[round % 2]));
    CHECK(cudaStreamSynchronize(st[round % 2]));
    for (size_t r = 0; r < rows; r++)
      for (size_t x = 0; x < dpitch; x++) {
        uint8_t want = x < w ? src[r * spitch + x] : 0xee;
        EXPECT(dst[r * dpitch + x] == want);
      }
    for (size_t i = 0; i < 4096; i++) EXPECT(dst1[i] == src1[i] * 3 + 5);
    acc ^= hash32(dst1, 4096) + round;
  }
  printf("pageable memcpy nodes: %016llx\n", (unsigned long long)acc);
  CHECK(cudaGraphExecDestroy(e));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaStreamDestroy(st[0]));
  CHECK(cudaStreamDestroy(st[1]));
  CHECK(cudaFree(d));
  CHECK(cudaFree(d1));
  free(src1);
  free(dst1);
  return 0;
}

static int captured_pageable() {
  const size_t n = 1 << 12;
  uint32_t *in = (uint32_t *)malloc(n * 4), sum = 0;
  uint32_t *d, *ds;
  CHECK(cudaMalloc(&d, n * 4));
  CHECK(cudaMalloc(&ds, 4));
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  CHECK(cudaMemcpyAsync(d, in, n * 4, cudaMemcpyHostToDevice, s));
  sum32<<<1, 1, 0, s>>>(d, n, ds);
  CHECK(cudaMemcpyAsync(&sum, ds, 4, cudaMemcpyDeviceToHost, s));
  CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t e;
  CHECK(cudaGraphInstantiate(&e, g, 0));
  uint64_t acc = 0;
  for (int round = 0; round < 10; round++) {
    uint32_t want = 0;
    for (size_t i = 0; i < n; i++) want += in[i] = (uint32_t)(i * 7 + round);
    CHECK(cudaGraphLaunch(e, s));
    CHECK(cudaStreamSynchronize(s));
    EXPECT(sum == want);
    acc = acc * 31 + sum;
  }
  printf("captured pageable copies: %016llx\n", (unsigned long long)acc);
  CHECK(cudaGraphExecDestroy(e));
  CHECK(cudaGraphDestroy(g));

  // Stream-ordered allocation captured into the graph.
  uint32_t *tmp;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  CHECK(cudaMallocAsync((void **)&tmp, n * 4, s));
  CHECK(cudaMemcpyAsync(tmp, d, n * 4, cudaMemcpyDeviceToDevice, s));
  sum32<<<1, 1, 0, s>>>(tmp, n, ds);
  CHECK(cudaFreeAsync(tmp, s));
  CHECK(cudaMemcpyAsync(&sum, ds, 4, cudaMemcpyDeviceToHost, s));
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&e, g, 0));
  for (int round = 0; round < 3; round++) {
    sum = 0;
    CHECK(cudaGraphLaunch(e, s));
    CHECK(cudaStreamSynchronize(s));
  }
  printf("captured allocation: %u\n", sum);
  CHECK(cudaGraphExecDestroy(e));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaStreamDestroy(s));
  CHECK(cudaFree(d));
  CHECK(cudaFree(ds));
  free(in);
  return 0;
}

int main() {
  if (mem_nodes() || pageable_nodes() || captured_pageable()) return 1;
  printf("graph_memory: ok\n");
  return 0;
}
