// errors kernels: a write through a bad pointer, a trap, a failed assert, and a no-op.
#include <assert.h>
extern "C" {
__global__ void bad_write(int *p) { p[threadIdx.x * 1024] = 42; }
__global__ void do_trap(int *p) { if (threadIdx.x == 0) __trap(); p[threadIdx.x] = 1; }
__global__ void do_assert(const int *p) { assert(p[threadIdx.x] == 12345); }
__global__ void noop(int *p) { if (p && threadIdx.x == 1u << 30) p[0] = 0; }
}
