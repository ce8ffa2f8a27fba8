/*
 * A driver-API program for CI machines without a GPU: run through `remora run`, Remora's
 * libcuda.so.1 must answer cleanly that there is no device (no crash, no hang).
 * Prints one line per call: "<call> <CUresult name>".
 */
#include <cuda.h>
#include <stdio.h>

static void show(const char *call, CUresult rc) {
    const char *name = NULL;
    if (cuGetErrorName(rc, &name) != CUDA_SUCCESS || name == NULL) name = "?";
    printf("%s %s\n", call, name);
}

int main(void) {
    int version = 0, count = -1;
    CUdevice dev;
    show("cuDriverGetVersion", cuDriverGetVersion(&version));
    printf("driver version %d\n", version);
    show("cuInit", cuInit(0));
    CUresult rc = cuDeviceGetCount(&count);
    show("cuDeviceGetCount", rc);
    printf("device count %d\n", rc == CUDA_SUCCESS ? count : -1);
    show("cuDeviceGet", cuDeviceGet(&dev, 0));
    return 0;
}
