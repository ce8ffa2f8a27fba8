// Prints where the CUDA driver places device allocations relative to this process's own
// mappings: the anonymous regions cuInit and context creation add (from /proc/self/maps), the
// addresses of cuMemAlloc of several sizes, and where a fresh host mmap lands. Used to see why
// a remoted device range can collide with the client's host mappings (unified addressing).
//   cc -O2 -o va_layout va_layout.c -I$CUDA/include -lcuda
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static void maps(const char *when) {
  FILE *f = fopen("/proc/self/maps", "r");
  char line[512];
  unsigned long long total = 0;
  printf("-- %s: anonymous regions >= 64 MiB\n", when);
  while (f && fgets(line, sizeof line, f)) {
    unsigned long long a, b;
    char perm[8];
    char path[256] = "";
    if (sscanf(line, "%llx-%llx %7s %*s %*s %*s %255s", &a, &b, perm, path) < 3) continue;
    if (b - a >= (64ull << 20) && (path[0] == 0 || path[0] == '[')) {
      printf("   %llx-%llx %s %8.1f GiB %s\n", a, b, perm, (b - a) / 1073741824.0, path);
      total += b - a;
    }
  }
  printf("   total %.1f GiB\n", total / 1073741824.0);
  if (f) fclose(f);
}

int main(void) {
  void *probe = mmap(NULL, 1 << 20, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  printf("host mmap before cuInit: %p, malloc(1M) %p, stack %p\n", probe, malloc(1 << 20), (void *)&probe);
  maps("before cuInit");
  if (cuInit(0)) return 1;
  CUdevice d;
  CUcontext c;
  cuDeviceGet(&d, 0);
  cuCtxCreate(&c, NULL, 0, d);
  maps("after cuInit + cuCtxCreate");
  size_t sizes[] = {256 << 10, 4 << 20, 64 << 20, 1ull << 30, 256 << 10};
  for (int i = 0; i < 5; i++) {
    CUdeviceptr p;
    CUresult r = cuMemAlloc(&p, sizes[i]);
    printf("cuMemAlloc(%zu) = %d -> %llx\n", sizes[i], r, (unsigned long long)p);
  }
  void *h;
  cuMemHostAlloc(&h, 1 << 20, CU_MEMHOSTALLOC_DEVICEMAP);
  printf("cuMemHostAlloc -> %p\n", h);
  CUdeviceptr m;
  cuMemAllocManaged(&m, 1 << 20, CU_MEM_ATTACH_GLOBAL);
  printf("cuMemAllocManaged -> %llx\n", (unsigned long long)m);
  maps("after allocations");
  probe = mmap(NULL, 1 << 20, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  printf("host mmap after: %p\n", probe);
  return 0;
}
