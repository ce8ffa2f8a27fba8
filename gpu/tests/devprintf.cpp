// devprintf: printf inside a kernel. The driver flushes the device printf buffer to the process's
// stdout at synchronizing calls; under Remora that output must reach the client's stdout, in
// order with the host's own lines.
#include "../common.h"

int main() {
  init_primary(NULL);
  CUmodule mod = load_module("devprintf.fatbin");
  CUfunction fn;
  CK(cuModuleGetFunction(&fn, mod, "talk"));
  for (int round = 0; round < 3; round++) {
    printf("host before round %d\n", round);
    fflush(stdout);
    double x = 1.5 * (round + 1);
    const char *tag = NULL;
    void *p[] = {&round, &x, &tag};
    CK(cuLaunchKernel(fn, 2, 1, 1, 64, 1, 1, 0, NULL, p, NULL));
    CK(cuCtxSynchronize());
    fflush(stdout);
    printf("host after round %d\n", round);
    fflush(stdout);
  }
  CK(cuModuleUnload(mod));
  printf("devprintf: PASS\n");
  return 0;
}
