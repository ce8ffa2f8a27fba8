// multikernel: many kernels in one module, with varied parameter types and launch shapes.
struct Mixed { char c; double d; int i; short s; };  // padded struct passed by value

__constant__ int k_table[16];
__device__ unsigned long long g_counter;

extern "C" {
__global__ void fill_i32(int *p, int v, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = v + i;
}
__global__ void iota_u64(unsigned long long *p, unsigned long long base, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = base + (unsigned long long)i * 3ull;
}
__global__ void saxpy(float a, const float *x, float *y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
__global__ void daxpy(double a, const double *x, double *y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
__global__ void small_types(signed char c, short s, unsigned char u, signed char *pc, short *ps, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { pc[i] = (signed char)(c + i); ps[i] = (short)(s * i + u); }
}
__global__ void by_struct(Mixed m, double *out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = m.c + m.d + m.i + m.s;
}
__global__ void many_params(int a, long long b, float c, double d, char e, short f, unsigned g,
                            unsigned long long h, float i, int *p1, double *p2, int j) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    p1[0] = a + (int)b + e + f + (int)g + (int)h + j;
    p2[0] = c + d + i;
  }
}
__global__ void reduce_sum(const unsigned *in, unsigned long long *out, int n) {
  extern __shared__ unsigned long long sdata[];
  unsigned t = threadIdx.x;
  unsigned long long v = 0;
  for (int i = blockIdx.x * blockDim.x + t; i < n; i += blockDim.x * gridDim.x) v += in[i];
  sdata[t] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) sdata[t] += sdata[t + s];
    __syncthreads();
  }
  if (t == 0) atomicAdd(out, sdata[0]);
}
__global__ void transpose(const float *in, float *out, int w, int h) {
  __shared__ float tile[32][33];
  int x = blockIdx.x * 32 + threadIdx.x, y = blockIdx.y * 32 + threadIdx.y;
  if (x < w && y < h) tile[threadIdx.y][threadIdx.x] = in[y * w + x];
  __syncthreads();
  x = blockIdx.y * 32 + threadIdx.x;
  y = blockIdx.x * 32 + threadIdx.y;
  if (x < h && y < w) out[y * h + x] = tile[threadIdx.x][threadIdx.y];
}
__global__ void grid3d(unsigned *out) {
  unsigned bx = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  unsigned tx = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  unsigned id = bx * (blockDim.x * blockDim.y * blockDim.z) + tx;
  out[id] = (blockIdx.z << 24) | (blockIdx.y << 16) | (threadIdx.z << 12) | (threadIdx.y << 8) |
            (blockIdx.x << 4) | threadIdx.x;
}
__global__ void use_constant(int *out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = k_table[i % 16] * (i + 1);
}
__global__ void count_global(int per_thread) {
  for (int k = 0; k < per_thread; k++) atomicAdd(&g_counter, 1ull);
}
__global__ void reverse_dyn(int *p, int n) {
  extern __shared__ int s[];
  int t = threadIdx.x;
  if (t < n) s[t] = p[t];
  __syncthreads();
  if (t < n) p[t] = s[n - 1 - t];
}
}
