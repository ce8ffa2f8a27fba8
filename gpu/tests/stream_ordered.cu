// stream_ordered: stream-ordered allocation and memory pools, as a CUDA runtime program uses
// them (cudaMallocAsync, PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, NVIDIA's
// streamOrderedAllocation sample).
//
//   1. cudaMallocAsync / cudaFreeAsync on four streams: a kernel fills each allocation, a
//      device-to-device copy and a memset work on it, cudaMemcpyAsync brings it back.
//   2. An allocation made on one stream, used and freed on another after an event wait.
//   3. The default pool: its release threshold, used and reserved memory, cudaMemPoolTrimTo.
//   4. A created pool (cudaMemPoolCreate): reuse flags, release threshold, high-water marks,
//      access, cudaMallocFromPoolAsync, the device's current pool (cudaDeviceSetMemPool),
//      cudaMemPoolTrimTo, cudaMemPoolDestroy.
//   5. Stream capture of cudaMallocAsync / cudaFreeAsync (graph memory nodes), launched
//      three times.
// Output is deterministic (checksums and relations, never addresses or byte counts the
// driver picks), so a native and a remoted run compare byte for byte. Any mismatch prints
// FAIL and exits 1.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
#include "test_rt.h"

__global__ void iota(uint32_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = (uint32_t)(i * 2654435761u) ^ seed;
}

static int verify(const char *what, const uint32_t *p, size_t n, uint32_t seed, uint32_t mul, uint32_t add) {
  for (size_t i = 0; i < n; i++) {
    uint32_t want = ((uint32_t)(i * 2654435761u) ^ seed) * mul + add;
    if (p[i] != want) {
      printf("FAIL %s: element %zu is %u, want %u\n", what, i, p[i], want);
      return 1;
    }
  }
  return 0;
}

static uint64_t attr64(cudaMemPool_t pool, cudaMemPoolAttr a) {
  uint64_t v = 0;
  if (cudaMemPoolGetAttribute(pool, a, &v) != cudaSuccess) return ~0ull;
  return v;
}

static const char *yes(bool b) { return b ? "yes" : "no"; }

int main() {
  int pools = 0;
  CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, 0));
  printf("memory pools supported: %d\n", pools);
  if (!pools) {
    printf("SKIPPED: no memory pools on device 0\n");
    return 0;
  }

  // 1. Four streams, each with its own stream-ordered allocations.
  const int S = 4;
  const size_t n = (1u << 20) + 77;  // a little over 4 MiB per allocation, odd length
  cudaStream_t st[S];
  std::vector<std::vector<uint32_t>> host(S, std::vector<uint32_t>(n));
  for (int s = 0; s < S; s++) CHECK(cudaStreamCreate(&st[s]));
  for (int round = 0; round < 3; round++) {
    for (int s = 0; s < S; s++) {
      uint32_t *a = nullptr, *b = nullptr;
      CHECK(cudaMallocAsync((void **)&a, n * 4, st[s]));
      CHECK(cudaMallocAsync((void **)&b, n * 4, st[s]));
      iota<<<128, 256, 0, st[s]>>>(a, n, 100 * round + s);
      CHECK(cudaGetLastError());
      CHECK(cudaMemsetAsync(b, 0xff, n * 4, st[s]));
      CHECK(cudaMemcpyAsync(b, a, (n - 5) * 4, cudaMemcpyDeviceToDevice, st[s]));
      affine32<<<128, 256, 0, st[s]>>>(b, n - 5, 3, (uint32_t)s);
      CHECK(cudaGetLastError());
      CHECK(cudaMemcpyAsync(host[s].data(), b, n * 4, cudaMemcpyDeviceToHost, st[s]));
      CHECK(cudaFreeAsync(a, st[s]));
      CHECK(cudaFreeAsync(b, st[s]));
    }
    for (int s = 0; s < S; s++) {
      CHECK(cudaStreamSynchronize(st[s]));
      if (verify("stream allocation", host[s].data(), n - 5, 100 * round + s, 3, (uint32_t)s)) return 1;
      for (size_t i = n - 5; i < n; i++) EXPECT(host[s][i] == 0xffffffffu);
    }
    uint64_t all = 0;
    for (int s = 0; s < S; s++) all ^= hash32(host[s].data(), n) + (uint64_t)s;
    printf("1. round %d on %d streams: %016llx\n", round, S, (unsigned long long)all);
  }

  // 2. Allocated on one stream, used and freed on another after an event.
  {
    cudaEvent_t made;
    CHECK(cudaEventCreateWithFlags(&made, cudaEventDisableTiming));
    uint32_t *p = nullptr;
    CHECK(cudaMallocAsync((void **)&p, n * 4, st[0]));
    iota<<<64, 256, 0, st[0]>>>(p, n, 42);
    CHECK(cudaEventRecord(made, st[0]));
    CHECK(cudaStreamWaitEvent(st[1], made, 0));
    affine32<<<64, 256, 0, st[1]>>>(p, n, 5, 9);
    CHECK(cudaMemcpyAsync(host[1].data(), p, n * 4, cudaMemcpyDeviceToHost, st[1]));
    CHECK(cudaFreeAsync(p, st[1]));
    CHECK(cudaStreamSynchronize(st[1]));
    if (verify("cross-stream allocation", host[1].data(), n, 42, 5, 9)) return 1;
    printf("2. across streams: %016llx\n", (unsigned long long)hash32(host[1].data(), n));
    CHECK(cudaEventDestroy(made));
  }

  // 3. The default pool.
  cudaMemPool_t def;
  CHECK(cudaDeviceGetDefaultMemPool(&def, 0));
  {
    cudaMemPool_t cur;
    CHECK(cudaDeviceGetMemPool(&cur, 0));
    printf("3. the default pool is current: %s\n", yes(cur == def));
    uint64_t keep = UINT64_MAX;
    CHECK(cudaMemPoolSetAttribute(def, cudaMemPoolAttrReleaseThreshold, &keep));
    printf("3. release threshold set to max: %s\n", yes(attr64(def, cudaMemPoolAttrReleaseThreshold) == UINT64_MAX));
    uint32_t *p = nullptr;
    CHECK(cudaMallocAsync((void **)&p, 8u << 20, st[2]));
    CHECK(cudaStreamSynchronize(st[2]));
    uint64_t used = attr64(def, cudaMemPoolAttrUsedMemCurrent);
    uint64_t reserved = attr64(def, cudaMemPoolAttrReservedMemCurrent);
    printf("3. used >= 8 MiB: %s, reserved >= used: %s\n", yes(used >= (8u << 20) && used != ~0ull),
           yes(reserved >= used && reserved != ~0ull));
    CHECK(cudaFreeAsync(p, st[2]));
    CHECK(cudaStreamSynchronize(st[2]));
    printf("3. after the free: used 0: %s, memory kept: %s\n", yes(attr64(def, cudaMemPoolAttrUsedMemCurrent) == 0),
           yes(attr64(def, cudaMemPoolAttrReservedMemCurrent) >= (8u << 20)));
    CHECK(cudaMemPoolTrimTo(def, 0));
    printf("3. trimmed to 0: reserved 0: %s\n", yes(attr64(def, cudaMemPoolAttrReservedMemCurrent) == 0));
    uint64_t zero = 0;
    CHECK(cudaMemPoolSetAttribute(def, cudaMemPoolAttrReleaseThreshold, &zero));
  }

  // 4. A pool of our own.
  {
    cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    cudaMemPool_t pool;
    CHECK(cudaMemPoolCreate(&pool, &props));
    int follow = -1, opportunistic = -1, internal = -1;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolReuseFollowEventDependencies, &follow));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolReuseAllowOpportunistic, &opportunistic));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &internal));
    printf("4. reuse flags: follow %d, opportunistic %d, internal %d\n", follow, opportunistic, internal);
    int off = 0;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowOpportunistic, &off));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolReuseAllowOpportunistic, &opportunistic));
    printf("4. opportunistic reuse after clearing it: %d\n", opportunistic);
    uint64_t threshold = 64ull << 20;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    printf("4. release threshold 64 MiB: %s\n", yes(attr64(pool, cudaMemPoolAttrReleaseThreshold) == threshold));

    cudaMemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location.type = cudaMemLocationTypeDevice;
    access.location.id = 0;
    access.flags = cudaMemAccessFlagsProtReadWrite;
    // The owning device always has read-write access; asking for it again is answered as
    // the driver answers it (printed, not required).
    printf("4. set device 0 read-write: %s\n", cudaGetErrorName(cudaMemPoolSetAccess(pool, &access, 1)));
    cudaGetLastError();
    cudaMemAccessFlags flags = cudaMemAccessFlagsProtNone;
    cudaMemLocation here;
    memset(&here, 0, sizeof here);
    here.type = cudaMemLocationTypeDevice;
    here.id = 0;
    CHECK(cudaMemPoolGetAccess(&flags, pool, &here));
    printf("4. device 0 access: %d\n", (int)flags);

    const int K = 6;
    uint32_t *a[K];
    for (int i = 0; i < K; i++) {
      CHECK(cudaMallocFromPoolAsync((void **)&a[i], n * 4, pool, st[i % 2]));
      iota<<<64, 256, 0, st[i % 2]>>>(a[i], n, 7000 + i);
    }
    CHECK(cudaDeviceSynchronize());
    uint64_t high = attr64(pool, cudaMemPoolAttrUsedMemHigh);
    printf("4. used >= %d allocations: %s\n", K, yes(attr64(pool, cudaMemPoolAttrUsedMemCurrent) >= K * n * 4));
    uint64_t check = 0;
    for (int i = 0; i < K; i++) {
      CHECK(cudaMemcpyAsync(host[0].data(), a[i], n * 4, cudaMemcpyDeviceToHost, st[i % 2]));
      CHECK(cudaStreamSynchronize(st[i % 2]));
      if (verify("pool allocation", host[0].data(), n, 7000 + i, 1, 0)) return 1;
      check ^= hash32(host[0].data(), n) + (uint64_t)i;
      CHECK(cudaFreeAsync(a[i], st[i % 2]));
    }
    CHECK(cudaDeviceSynchronize());
    printf("4. %d pool allocations: %016llx\n", K, (unsigned long long)check);
    uint64_t reserved = attr64(pool, cudaMemPoolAttrReservedMemCurrent);
    printf("4. after the frees: used 0: %s, kept under the threshold: %s\n",
           yes(attr64(pool, cudaMemPoolAttrUsedMemCurrent) == 0), yes(reserved > 0 && reserved != ~0ull));
    uint64_t zero = 0;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    printf("4. used high-water mark reset: %s (was at least the use: %s)\n",
           yes(attr64(pool, cudaMemPoolAttrUsedMemHigh) == 0), yes(high >= K * n * 4));

    // The device's current pool serves cudaMallocAsync.
    CHECK(cudaDeviceSetMemPool(0, pool));
    cudaMemPool_t cur;
    CHECK(cudaDeviceGetMemPool(&cur, 0));
    uint32_t *p = nullptr;
    CHECK(cudaMallocAsync((void **)&p, n * 4, st[3]));
    CHECK(cudaStreamSynchronize(st[3]));
    printf("4. current pool set: %s, serves cudaMallocAsync: %s\n", yes(cur == pool),
           yes(attr64(pool, cudaMemPoolAttrUsedMemCurrent) >= n * 4));
    CHECK(cudaFreeAsync(p, st[3]));
    CHECK(cudaStreamSynchronize(st[3]));
    CHECK(cudaDeviceSetMemPool(0, def));

    CHECK(cudaMemPoolTrimTo(pool, 0));
    printf("4. trimmed to 0: reserved 0: %s\n", yes(attr64(pool, cudaMemPoolAttrReservedMemCurrent) == 0));
    CHECK(cudaMemPoolDestroy(pool));
    printf("4. pool destroyed\n");
  }

  // 5. Stream capture: graph memory nodes.
  {
    uint32_t *out = nullptr;
    CHECK(cudaMalloc((void **)&out, n * 4));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(st[0], cudaStreamCaptureModeGlobal));
    uint32_t *tmp = nullptr;
    CHECK(cudaMallocAsync((void **)&tmp, n * 4, st[0]));
    iota<<<64, 256, 0, st[0]>>>(tmp, n, 555);
    affine32<<<64, 256, 0, st[0]>>>(tmp, n, 7, 1);
    CHECK(cudaMemcpyAsync(out, tmp, n * 4, cudaMemcpyDeviceToDevice, st[0]));
    CHECK(cudaFreeAsync(tmp, st[0]));
    CHECK(cudaStreamEndCapture(st[0], &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; i++) {
      CHECK(cudaMemset(out, 0, n * 4));
      CHECK(cudaGraphLaunch(exec, st[0]));
      CHECK(cudaStreamSynchronize(st[0]));
      CHECK(cudaMemcpy(host[2].data(), out, n * 4, cudaMemcpyDeviceToHost));
      if (verify("graph allocation", host[2].data(), n, 555, 7, 1)) return 1;
    }
    printf("5. captured allocation, 3 launches: %016llx\n", (unsigned long long)hash32(host[2].data(), n));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaFree(out));
  }

  for (int s = 0; s < S; s++) CHECK(cudaStreamDestroy(st[s]));
  printf("stream_ordered: all checks passed\n");
  return 0;
}
