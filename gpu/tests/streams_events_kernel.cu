// streams_events kernels: a deliberately slow elementwise step and a combine of two buffers.
extern "C" {
__global__ void step(const unsigned *in, unsigned *out, unsigned salt, int iters, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned v = in[i];
  for (int k = 0; k < iters; k++) v = v * 1664525u + 1013904223u + salt;
  out[i] = v;
}
__global__ void combine(const unsigned *a, const unsigned *b, unsigned *out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] ^ (b[i] >> 3) ^ (unsigned)i;
}
}
