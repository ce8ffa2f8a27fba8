// What an MPS client process sees of its SM share (issue 13 §3): run on a GPU host with and
// without the MPS control daemon and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE.
//
//   cc -O2 -I"$CUDA_INCLUDE" -o mps_probe gpu/tools/mps_probe.c -lcuda
//   ./mps_probe [late]
//
// Prints the device's SM count and the context's execution affinity (cuCtxGetExecAffinity,
// CU_EXEC_AFFINITY_TYPE_SM_COUNT: answered under MPS only). With "late", the process sets
// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 itself after cuInit and before making its context: does
// the driver read the variable at cuInit or at the context's creation?
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
  int late = argc > 1 && strcmp(argv[1], "late") == 0;
  const char *env = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
  CUresult r = cuInit(0);
  if (r != CUDA_SUCCESS) {
    printf("cuInit failed: %d\n", (int)r);
    return 1;
  }
  if (late) setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25", 1);
  CUdevice dev;
  cuDeviceGet(&dev, 0);
  int sms = 0;
  cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
  CUcontext ctx;
  r = cuCtxCreate(&ctx, NULL, 0, dev);
  if (r != CUDA_SUCCESS) {
    printf("cuCtxCreate failed: %d\n", (int)r);
    return 1;
  }
  CUexecAffinityParam aff;
  memset(&aff, 0, sizeof aff);
  r = cuCtxGetExecAffinity(&aff, CU_EXEC_AFFINITY_TYPE_SM_COUNT);
  printf("env=%s late=%d device_sms=%d exec_affinity_rc=%d context_sms=%u\n",
         env ? env : "(unset)", late, sms, (int)r,
         r == CUDA_SUCCESS ? aff.param.smCount.val : 0u);
  cuCtxDestroy(ctx);
  return 0;
}
