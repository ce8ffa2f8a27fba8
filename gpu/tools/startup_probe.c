// Times the driver steps a Remora session can add to a program's start-up, on the real driver:
// dlopen, cuInit, context creation, and page-locking a session's shared data area (a memfd
// region, as the server makes it) at several sizes, populated first or not.
//
//   cc -O2 -I"$CUDA_INCLUDE" -o startup_probe gpu/tools/startup_probe.c -ldl
//   ./startup_probe [AREA_MIB...]      (default: 16 64 256)
//
// With STARTUP_PROBE_LIVE=1 in the environment the context is not destroyed: the process
// exits with it alive, and the exit's time is the driver's whole teardown (what a session
// worker's exit would cost if it left its context to the exit). STARTUP_PROBE_LIVE=_exit
// leaves by _exit(2) instead of returning from main: no atexit handler of the driver's runs,
// only the kernel's teardown of its files.
//
// Prints one line per step: "step milliseconds", then "exit_at_ms T": CLOCK_MONOTONIC in
// milliseconds just before main returns, so that a parent reading the same clock when its wait
// returns sees how long the process's exit took (the driver's teardown at exit), e.g.
//   python3 -c 'import subprocess,time; o=subprocess.run(["./startup_probe","16"],
//     capture_output=True,text=True).stdout; print(time.monotonic()*1e3 - float(o.split()[-1]))'
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

#define LOAD(name) name##_t name = (name##_t)dlsym(lib, #name)
#define CHECK(what, call)                                            \
  do {                                                               \
    CUresult r_ = (call);                                            \
    if (r_ != CUDA_SUCCESS) {                                        \
      fprintf(stderr, "%s failed: %d\n", what, (int)r_);             \
      return 1;                                                      \
    }                                                                \
  } while (0)

typedef CUresult (*cuInit_t)(unsigned);
typedef CUresult (*cuDeviceGet_t)(CUdevice *, int);
typedef CUresult (*cuCtxCreate_v2_t)(CUcontext *, unsigned, CUdevice);
typedef CUresult (*cuCtxDestroy_v2_t)(CUcontext);
typedef CUresult (*cuMemHostRegister_v2_t)(void *, size_t, unsigned);
typedef CUresult (*cuMemHostUnregister_t)(void *);
typedef CUresult (*cuMemAlloc_v2_t)(CUdeviceptr *, size_t);
typedef CUresult (*cuMemcpyHtoD_v2_t)(CUdeviceptr, const void *, size_t);

int main(int argc, char **argv) {
  double t = now_ms();
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  printf("dlopen %.2f\n", now_ms() - t);
  LOAD(cuInit);
  LOAD(cuDeviceGet);
  LOAD(cuCtxCreate_v2);
  LOAD(cuCtxDestroy_v2);
  LOAD(cuMemHostRegister_v2);
  LOAD(cuMemHostUnregister);
  LOAD(cuMemAlloc_v2);
  LOAD(cuMemcpyHtoD_v2);
  t = now_ms();
  CHECK("cuInit", cuInit(0));
  printf("cuInit %.2f\n", now_ms() - t);
  CUdevice dev;
  CHECK("cuDeviceGet", cuDeviceGet(&dev, 0));
  CUcontext ctx;
  t = now_ms();
  CHECK("cuCtxCreate", cuCtxCreate_v2(&ctx, 0, dev));
  printf("cuCtxCreate %.2f\n", now_ms() - t);
  CUdeviceptr d;
  t = now_ms();
  CHECK("cuMemAlloc", cuMemAlloc_v2(&d, 1 << 20));
  printf("first_cuMemAlloc_1MiB %.2f\n", now_ms() - t);
  int sizes[16] = {16, 64, 256};
  int n = 3;
  if (argc > 1) {
    n = 0;
    for (int i = 1; i < argc && n < 16; i++) sizes[n++] = atoi(argv[i]);
  }
  for (int i = 0; i < n; i++) {
    size_t len = (size_t)sizes[i] << 20;
    for (int populate = 0; populate < 2; populate++) {
      t = now_ms();
      int fd = memfd_create("probe", MFD_CLOEXEC);
      if (fd < 0 || ftruncate(fd, len) != 0) return 1;
      void *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
                     MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
      if (p == MAP_FAILED) return 1;
      printf("area_%dMiB_%s_memfd_mmap %.2f\n", sizes[i], populate ? "populated" : "lazy",
             now_ms() - t);
      t = now_ms();
      CHECK("cuMemHostRegister",
            cuMemHostRegister_v2(p, len, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP));
      printf("area_%dMiB_%s_register %.2f\n", sizes[i], populate ? "populated" : "lazy",
             now_ms() - t);
      t = now_ms();
      CHECK("cuMemcpyHtoD", cuMemcpyHtoD_v2(d, p, 1 << 20));
      printf("area_%dMiB_%s_first_copy_1MiB %.2f\n", sizes[i], populate ? "populated" : "lazy",
             now_ms() - t);
      t = now_ms();
      CHECK("cuMemHostUnregister", cuMemHostUnregister(p));
      printf("area_%dMiB_%s_unregister %.2f\n", sizes[i], populate ? "populated" : "lazy",
             now_ms() - t);
      t = now_ms();
      munmap(p, len);
      close(fd);
      printf("area_%dMiB_%s_unmap %.2f\n", sizes[i], populate ? "populated" : "lazy", now_ms() - t);
    }
  }
  const char *live = getenv("STARTUP_PROBE_LIVE");
  int quick = live && strcmp(live, "_exit") == 0;
  if (live && (strcmp(live, "1") == 0 || quick)) {
    printf("cuCtxDestroy skipped\n");
  } else {
    t = now_ms();
    CHECK("cuCtxDestroy", cuCtxDestroy_v2(ctx));
    printf("cuCtxDestroy %.2f\n", now_ms() - t);
  }
  printf("exit_at_ms %.3f\n", now_ms());
  fflush(stdout);
  if (quick) _exit(0);
  return 0;
}
