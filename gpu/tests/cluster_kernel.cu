// cluster kernels (sm_90): thread block clusters, distributed shared memory, cluster registers.
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

__device__ __forceinline__ unsigned sreg_ctarank() {
  unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
__device__ __forceinline__ unsigned sreg_nctarank() {
  unsigned r; asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r)); return r;
}
__device__ __forceinline__ unsigned sreg_clusterid_x() {
  unsigned r; asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r)); return r;
}
__device__ __forceinline__ unsigned sreg_nclusterid_x() {
  unsigned r; asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r)); return r;
}

// Each block publishes a value in its shared memory; after cluster.sync() it reads the next
// block's value through distributed shared memory. out: 8 words per block.
__device__ void body(unsigned *out) {
  cg::cluster_group cluster = cg::this_cluster();
  __shared__ unsigned mine;
  unsigned bid = blockIdx.x + gridDim.x * blockIdx.y;
  unsigned rank = cluster.block_rank();
  if (threadIdx.x == 0) mine = 1000000u + rank * 1000u + bid;
  cluster.sync();
  unsigned nb = cluster.num_blocks();
  unsigned *peer = cluster.map_shared_rank(&mine, (rank + 1) % nb);
  unsigned v = *peer;
  dim3 bi = cluster.block_index();
  cluster.sync();  // the peer's shared memory must outlive our read
  if (threadIdx.x == 0) {
    unsigned *o = out + 8 * bid;
    o[0] = rank; o[1] = nb; o[2] = v; o[3] = sreg_ctarank(); o[4] = sreg_nctarank();
    o[5] = sreg_clusterid_x(); o[6] = sreg_nclusterid_x(); o[7] = bi.x | (bi.y << 8);
  }
}
extern "C" __global__ void cluster_info(unsigned *out) { body(out); }
extern "C" __global__ void __cluster_dims__(2, 1, 1) cluster_fixed(unsigned *out) { body(out); }
