/*
 * Prints every CUresult the real driver names, as "code name text" lines: the source of
 * crates/client/src/cu_results.txt, so that the shim's cuGetErrorName/cuGetErrorString answer
 * exactly as NVIDIA's driver does. Build: cc error_strings.c -lcuda; needs no GPU context.
 */
#include <cuda.h>
#include <stdio.h>

int main(void) {
    int drv = 0;
    cuDriverGetVersion(&drv);
    printf("# Captured from NVIDIA's libcuda.so.1 (driver API %d) by gpu/tools/error_strings.c. Do not edit.\n", drv);
    for (int code = 0; code < 10000; code++) {
        const char *name = NULL, *text = NULL;
        if (cuGetErrorName((CUresult)code, &name) != CUDA_SUCCESS || !name) continue;
        if (cuGetErrorString((CUresult)code, &text) != CUDA_SUCCESS || !text) text = "";
        printf("%d %s %s\n", code, name, text);
    }
    return 0;
}
