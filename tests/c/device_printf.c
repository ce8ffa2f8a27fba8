/*
 * Device-side printf through Remora's libcuda.so.1, for CI machines without a GPU: run under
 * `remora run --server` against `remora serve --backend emulated --isolation process` with
 * REMORA_EMULATED_DEVICE_PRINTF set, every synchronize brings that text, which must appear on
 * this program's stdout between the host lines flushed before and after the call, as NVIDIA's
 * driver writes kernel printf output.
 */
#include <cuda.h>
#include <stdio.h>

#define CK(call)                                                   \
    do {                                                           \
        CUresult rc_ = (call);                                     \
        if (rc_ != CUDA_SUCCESS) {                                 \
            fprintf(stderr, "%s failed: %d\n", #call, (int)rc_);   \
            return 1;                                              \
        }                                                          \
    } while (0)

int main(void) {
    CUdevice dev;
    CUcontext ctx;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    printf("host before\n");
    fflush(stdout);
    CK(cuCtxSynchronize());
    printf("host between\n");
    fflush(stdout);
    CK(cuStreamSynchronize(NULL));
    printf("host after\n");
    fflush(stdout);
    CK(cuDevicePrimaryCtxRelease(dev));
    return 0;
}
