// vecadd kernel: built as a cubin (sm_90), as PTX (compute_80) and as a multi-arch fatbin.
extern "C" __global__ void vecadd(const float *a, const float *b, float *c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}
