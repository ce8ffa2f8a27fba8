// occupancy kernels: light, register-heavy, static shared memory, dynamic shared memory.
extern "C" {
__global__ void light(float *p) { p[blockIdx.x * blockDim.x + threadIdx.x] += 1.0f; }

__global__ void __launch_bounds__(256) heavy(const float *in, float *out, int n) {
  float acc[32];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
#pragma unroll
  for (int k = 0; k < 32; k++) acc[k] = in[(i + k * 97) % n];
#pragma unroll
  for (int r = 0; r < 8; r++)
#pragma unroll
    for (int k = 0; k < 32; k++) acc[k] = acc[k] * acc[(k + r + 1) % 32] + 0.5f;
  float s = 0;
#pragma unroll
  for (int k = 0; k < 32; k++) s += acc[k];
  if (i < n) out[i] = s;
}

__global__ void static_smem(float *p) {
  __shared__ float buf[4096];  // 16 KiB
  buf[threadIdx.x] = p[threadIdx.x];
  __syncthreads();
  p[threadIdx.x] = buf[(threadIdx.x + 1) % blockDim.x];
}

__global__ void dyn_smem(int *p, int words) {
  extern __shared__ int sbuf[];
  for (int i = threadIdx.x; i < words; i += blockDim.x) sbuf[i] = i * 3;
  __syncthreads();
  int s = 0;
  for (int i = threadIdx.x; i < words; i += blockDim.x) s += sbuf[words - 1 - i];
  atomicAdd(p, s);
}
}
