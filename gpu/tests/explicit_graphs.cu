// explicit_graphs: CUDA graphs built node by node, as a runtime program builds them.
//
//   1. A graph: a memset node, two kernel nodes (the second after the first), a device-to-
//      device memcpy node after both, a host node that checksums a counter, a child graph
//      (a memset and a kernel), an event record node; queried (node count, root nodes,
//      edges, node types), instantiated, launched three times on a stream.
//   2. cudaGraphExecKernelNodeSetParams changes one launch's parameters; the graph keeps its.
//   3. cudaGraphKernelNodeSetParams on the graph, cudaGraphExecUpdate into the executable
//      graph; cudaGraphClone launched on its own.
//   4. (built with -DPINNED_NODES, the program explicit_graphs_pinned) memcpy nodes between
//      pinned host memory (cudaMallocHost) and the device: the host bytes are written after
//      the graph is built and read after each launch, so stale data shows.
// Output is deterministic (checksums), so a native and a remoted run compare byte for byte.
// Any mismatch prints FAIL and exits 1.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
#include "test_rt.h"

static const int N = 1 << 16;

__global__ void affine(int *p, int mul, int add, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = p[i] * mul + add + i;
}

__global__ void bump(int *p, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] += 1;
}

static uint64_t checksum(const std::vector<int> &v) {
  uint64_t h = 1469598103934665603ull;
  for (int x : v) h = (h ^ (uint32_t)x) * 1099511628211ull;
  return h;
}

struct HostState {
  int calls;
};

static void CUDART_CB host_fn(void *data) { ((HostState *)data)->calls += 1; }

static cudaKernelNodeParams affine_params(void **args) {
  cudaKernelNodeParams p = {};
  p.func = (void *)affine;
  p.gridDim = dim3((N + 255) / 256);
  p.blockDim = dim3(256);
  p.sharedMemBytes = 0;
  p.kernelParams = args;
  p.extra = nullptr;
  return p;
}

static int read_back(int *d, const char *what, int round) {
  std::vector<int> h(N);
  if (cudaMemcpy(h.data(), d, N * sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) {
    printf("FAIL read back %s\n", what);
    return 1;
  }
  printf("%s round %d checksum %016llx\n", what, round, (unsigned long long)checksum(h));
  return 0;
}

int main() {
  int *a, *b, *c;
  CHECK(cudaMalloc(&a, N * sizeof(int)));
  CHECK(cudaMalloc(&b, N * sizeof(int)));
  CHECK(cudaMalloc(&c, N * sizeof(int)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t done;
  CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));

  // 1. The graph.
  cudaGraph_t graph;
  CHECK(cudaGraphCreate(&graph, 0));
  cudaMemsetParams ms = {};
  ms.dst = a;
  ms.value = 3;
  ms.elementSize = 4;
  ms.width = N;
  ms.height = 1;
  cudaGraphNode_t n_memset, n_k1, n_k2, n_copy, n_host, n_child, n_record;
  CHECK(cudaGraphAddMemsetNode(&n_memset, graph, nullptr, 0, &ms));
  int n = N, mul = 5, add = 7;
  void *args1[] = {&a, &mul, &add, &n};
  cudaKernelNodeParams k1 = affine_params(args1);
  CHECK(cudaGraphAddKernelNode(&n_k1, graph, &n_memset, 1, &k1));
  int mul2 = 3, add2 = -11;
  void *args2[] = {&a, &mul2, &add2, &n};
  cudaKernelNodeParams k2 = affine_params(args2);
  CHECK(cudaGraphAddKernelNode(&n_k2, graph, &n_k1, 1, &k2));
  CHECK(cudaGraphAddMemcpyNode1D(&n_copy, graph, &n_k2, 1, b, a, N * sizeof(int),
                                 cudaMemcpyDeviceToDevice));
  HostState hs = {0};
  cudaHostNodeParams hp = {host_fn, &hs};
  CHECK(cudaGraphAddHostNode(&n_host, graph, &n_copy, 1, &hp));

  cudaGraph_t child;
  CHECK(cudaGraphCreate(&child, 0));
  cudaMemsetParams cms = ms;
  cms.dst = c;
  cms.value = 100;
  cudaGraphNode_t c_memset, c_bump;
  CHECK(cudaGraphAddMemsetNode(&c_memset, child, nullptr, 0, &cms));
  void *bargs[] = {&c, &n};
  cudaKernelNodeParams bk = {};
  bk.func = (void *)bump;
  bk.gridDim = dim3((N + 255) / 256);
  bk.blockDim = dim3(256);
  bk.kernelParams = bargs;
  CHECK(cudaGraphAddKernelNode(&c_bump, child, &c_memset, 1, &bk));
  CHECK(cudaGraphAddChildGraphNode(&n_child, graph, nullptr, 0, child));
  cudaGraphNode_t after[] = {n_host, n_child};
  CHECK(cudaGraphAddEventRecordNode(&n_record, graph, after, 2, done));

  size_t count = 0;
  CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  printf("nodes %zu\n", count);
  EXPECT(count == 7);
  size_t roots = 0;
  CHECK(cudaGraphGetRootNodes(graph, nullptr, &roots));
  printf("roots %zu\n", roots);
  EXPECT(roots == 2);
  size_t edges = 0;
  CHECK(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &edges));
  printf("edges %zu\n", edges);
  EXPECT(edges == 6);
  cudaGraphNodeType t;
  CHECK(cudaGraphNodeGetType(n_k1, &t));
  EXPECT(t == cudaGraphNodeTypeKernel);
  CHECK(cudaGraphNodeGetType(n_host, &t));
  EXPECT(t == cudaGraphNodeTypeHost);
  CHECK(cudaGraphNodeGetType(n_child, &t));
  EXPECT(t == cudaGraphNodeTypeGraph);
  cudaKernelNodeParams got = {};
  CHECK(cudaGraphKernelNodeGetParams(n_k2, &got));
  EXPECT(got.func == (void *)affine);
  EXPECT(*(int *)got.kernelParams[1] == 3 && *(int *)got.kernelParams[2] == -11);

  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 3; round++) {
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventSynchronize(done));
    if (read_back(b, "copy", round) || read_back(c, "child", round)) return 1;
    printf("host node calls %d\n", hs.calls);
    EXPECT(hs.calls == round + 1);
  }

  // 2. One executable graph's kernel parameters.
  int mul3 = -2, add3 = 9;
  void *args3[] = {&a, &mul3, &add3, &n};
  cudaKernelNodeParams k3 = affine_params(args3);
  CHECK(cudaGraphExecKernelNodeSetParams(exec, n_k2, &k3));
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  if (read_back(b, "exec-set", 0)) return 1;
  CHECK(cudaGraphKernelNodeGetParams(n_k2, &got));
  EXPECT(*(int *)got.kernelParams[1] == 3);

  // 3. The graph's parameters, an update, a clone.
  int mul4 = 7, add4 = 1;
  void *args4[] = {&a, &mul4, &add4, &n};
  cudaKernelNodeParams k4 = affine_params(args4);
  CHECK(cudaGraphKernelNodeSetParams(n_k1, &k4));
  cudaMemsetParams ms2 = ms;
  ms2.value = 11;
  CHECK(cudaGraphMemsetNodeSetParams(n_memset, &ms2));
  cudaGraph_t clone;
  CHECK(cudaGraphClone(&clone, graph));
  cudaGraphExecUpdateResultInfo info = {};
  CHECK(cudaGraphExecUpdate(exec, graph, &info));
  EXPECT(info.result == cudaGraphExecUpdateSuccess);
  for (int round = 0; round < 2; round++) {
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaStreamSynchronize(stream));
    if (read_back(b, "updated", round)) return 1;
  }
  cudaGraphExec_t cexec;
  CHECK(cudaGraphInstantiate(&cexec, clone, 0));
  CHECK(cudaMemset(b, 0, N * sizeof(int)));
  CHECK(cudaGraphLaunch(cexec, stream));
  CHECK(cudaStreamSynchronize(stream));
  if (read_back(b, "clone", 0)) return 1;
  printf("host node calls %d\n", hs.calls);

#ifdef PINNED_NODES
  // 4. Memcpy nodes with a pinned host side.
  int *hin, *hout;
  CHECK(cudaMallocHost(&hin, N * sizeof(int)));
  CHECK(cudaMallocHost(&hout, N * sizeof(int)));
  memset(hout, 0, N * sizeof(int));
  cudaGraph_t pg;
  CHECK(cudaGraphCreate(&pg, 0));
  cudaGraphNode_t up, kern, down;
  CHECK(cudaGraphAddMemcpyNode1D(&up, pg, nullptr, 0, a, hin, N * sizeof(int),
                                 cudaMemcpyHostToDevice));
  int pm = 2, pa = 1;
  void *pargs[] = {&a, &pm, &pa, &n};
  cudaKernelNodeParams pk = affine_params(pargs);
  CHECK(cudaGraphAddKernelNode(&kern, pg, &up, 1, &pk));
  CHECK(cudaGraphAddMemcpyNode1D(&down, pg, &kern, 1, hout, a, N * sizeof(int),
                                 cudaMemcpyDeviceToHost));
  cudaGraphExec_t pexec;
  CHECK(cudaGraphInstantiate(&pexec, pg, 0));
  for (int round = 0; round < 3; round++) {
    for (int i = 0; i < N; i++) hin[i] = i * (round + 1) - 17;  // after the graph was built
    CHECK(cudaGraphLaunch(pexec, stream));
    CHECK(cudaStreamSynchronize(stream));
    std::vector<int> h(hout, hout + N);
    for (int i = 0; i < N; i++) EXPECT(h[i] == (i * (round + 1) - 17) * 2 + 1 + i);
    printf("pinned round %d checksum %016llx\n", round, (unsigned long long)checksum(h));
  }
  CHECK(cudaGraphExecDestroy(pexec));
  CHECK(cudaGraphDestroy(pg));
  CHECK(cudaFreeHost(hin));
  CHECK(cudaFreeHost(hout));
#endif

  CHECK(cudaGraphExecDestroy(cexec));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(clone));
  CHECK(cudaGraphDestroy(child));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaEventDestroy(done));
  CHECK(cudaStreamDestroy(stream));
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  CHECK(cudaFree(c));
  printf("explicit_graphs OK\n");
  return 0;
}
