// devprintf kernel: device-side printf from one thread (one thread, so the order is fixed).
#include <cstdio>
extern "C" __global__ void talk(int round, double x, const char *tag) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    for (int i = 0; i < 3; i++) printf("device round %d line %d: x=%.3f i*x=%g %s\n", round, i, x, i * x, "fixed");
  }
  (void)tag;
}
