/*
 * Device-side printf through Remora's libcuda.so.1, for CI machines without a GPU: run under
 * `remora run --server` against `remora serve --backend emulated --isolation process` with
 * REMORA_EMULATED_DEVICE_PRINTF set, every synchronize brings that text, which must appear on
 * this program's stdout after the host lines printed before the call, as NVIDIA's driver
 * (which writes it through C stdout and flushes that) writes kernel printf output.
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
    /* Not flushed: natively the driver appends device output to C stdout and flushes it, so
     * this line still comes out first. */
    printf("host between\n");
    CK(cuStreamSynchronize(NULL));
    printf("host after\n");
    fflush(stdout);
    CK(cuDevicePrimaryCtxRelease(dev));
    return 0;
}
