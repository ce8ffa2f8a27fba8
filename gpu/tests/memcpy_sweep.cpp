// memcpy_sweep: every copy direction, sync and async, pageable and pinned, from 1 B to 1 GiB
// (powers of 4 and odd sizes), plus cuMemsetD8/D16/D32 sync and async; every byte verified
// (memcmp against the source pattern, or a scan for memsets) and a checksum printed per size.
//
//   memcpy_sweep [MAX_BYTES]     (default 1 GiB)
#include "../common.h"

static int failures = 0;
static void verdict(const char *what, int ok) {
  printf(" %s=%s", what, ok ? "ok" : "FAIL");
  if (!ok) failures++;
}
// bytes [0, n) of p must be `fill` repeated (of width w bytes, little-endian), then tail bytes up
// to `total` must equal `rest`
static int scan(const unsigned char *p, size_t n, uint32_t fill, int w, size_t total, unsigned char rest) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != (unsigned char)(fill >> (8 * (i % w)))) return 0;
  for (size_t i = n; i < total; i++)
    if (p[i] != rest) return 0;
  return 1;
}

int main(int argc, char **argv) {
  size_t maxb = argc > 1 ? strtoull(argv[1], NULL, 0) : (1ull << 30);
  init_primary(NULL);
  // A blocking stream: it is ordered with the legacy NULL stream that the synchronous calls use.
  // That matters: cuMemcpyDtoD and cuMemsetD* return before the device is done, so async work on
  // a non-blocking stream could overtake them (the first version of this test did exactly that).
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_DEFAULT));
  size_t sizes[] = {1, 2, 3, 4, 7, 16, 61, 64, 256, 1000, 1024, 4093, 4096, 16384, 65536, 65539,
                    262144, 1048576, 1048583, 4194304, 16777216, 16777259, 67108864, 268435456,
                    1073741824};
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
    size_t n = sizes[si];
    if (n > maxb) break;
    const size_t pad = 64;
    unsigned char *src = (unsigned char *)malloc(n + pad), *dst = (unsigned char *)malloc(n + pad);
    unsigned char *psrc, *pdst;
    CK(cuMemHostAlloc((void **)&psrc, n + pad, 0));
    CK(cuMemHostAlloc((void **)&pdst, n + pad, 0));
    CUdeviceptr a, b;
    CK(cuMemAlloc(&a, n + pad));
    CK(cuMemAlloc(&b, n + pad));
    fill_pattern(src, n + pad, n);
    memcpy(psrc, src, n + pad);
    printf("size %zu: checksum=%016llx", n, (unsigned long long)checksum(src, n));
#define RESET() do { memset(dst, 0, n + pad); memset(pdst, 0, n + pad); CK(cuMemsetD8(b, 0xaa, n + pad)); CK(cuCtxSynchronize()); } while (0)
    // 1. sync, pageable
    RESET();
    CK(cuMemcpyHtoD(a, src, n)); CK(cuMemcpyDtoD(b, a, n)); CK(cuMemcpyDtoH(dst, b, n));
    verdict("sync-pageable", !memcmp(dst, src, n) && dst[n] == 0);
    // 2. sync, pinned
    RESET();
    CK(cuMemcpyHtoD(a, psrc, n)); CK(cuMemcpyDtoD(b, a, n)); CK(cuMemcpyDtoH(pdst, b, n));
    verdict("sync-pinned", !memcmp(pdst, src, n) && pdst[n] == 0);
    // 3. async, pinned
    RESET();
    CK(cuMemcpyHtoDAsync(a, psrc, n, s)); CK(cuMemcpyDtoDAsync(b, a, n, s)); CK(cuMemcpyDtoHAsync(pdst, b, n, s));
    CK(cuStreamSynchronize(s));
    verdict("async-pinned", !memcmp(pdst, src, n) && pdst[n] == 0);
    // 4. async, pageable
    RESET();
    CK(cuMemcpyHtoDAsync(a, src, n, s)); CK(cuMemcpyDtoDAsync(b, a, n, s)); CK(cuMemcpyDtoHAsync(dst, b, n, s));
    CK(cuStreamSynchronize(s));
    verdict("async-pageable", !memcmp(dst, src, n) && dst[n] == 0);
    // 5. unified addressing: cuMemcpy / cuMemcpyAsync infer the direction from the pointers
    RESET();
    CK(cuMemcpy(a, (CUdeviceptr)(uintptr_t)src, n)); CK(cuMemcpy(b, a, n));
    CK(cuMemcpy((CUdeviceptr)(uintptr_t)dst, b, n));
    CK(cuMemcpyAsync((CUdeviceptr)(uintptr_t)pdst, b, n, s)); CK(cuStreamSynchronize(s));
    verdict("unified", !memcmp(dst, src, n) && !memcmp(pdst, src, n) && dst[n] == 0 && pdst[n] == 0);
    // 6. unaligned offsets on every side
    RESET();
    CK(cuMemcpyHtoD(a + 3, src + 1, n)); CK(cuMemcpyDtoD(b + 1, a + 3, n));
    CK(cuMemcpyDtoHAsync(pdst + 5, b + 1, n, s)); CK(cuStreamSynchronize(s));
    CK(cuMemcpyDtoH(dst + 2, b + 1, n));
    verdict("offsets", !memcmp(dst + 2, src + 1, n) && !memcmp(pdst + 5, src + 1, n) && dst[1] == 0 &&
                           dst[n + 2] == 0 && pdst[4] == 0 && pdst[n + 5] == 0);
    // 7. memsets: D8 over n + pad, then D16/D32 over the first n bytes' worth of elements;
    //    the bytes after them must keep the D8 value
    CK(cuMemsetD8(a, 0x5c, n + pad));
    CK(cuMemcpyDtoH(dst, a, n + pad));
    int ok8 = scan(dst, n + pad, 0x5c, 1, n + pad, 0);
    CK(cuMemsetD8Async(a + 1, 0xe7, n, s));
    CK(cuMemcpyDtoHAsync(pdst, a, n + pad, s)); CK(cuStreamSynchronize(s));
    ok8 &= pdst[0] == 0x5c && scan(pdst + 1, n, 0xe7, 1, n + pad - 1, 0x5c);
    verdict("memsetD8", ok8);
    size_t n16 = n / 2, n32 = n / 4;
    CK(cuMemsetD8(a, 0x11, n + pad));
    if (n16) CK(cuMemsetD16(a, 0xbeef, n16));
    CK(cuMemcpyDtoH(dst, a, n + pad));
    int ok16 = scan(dst, 2 * n16, 0xbeef, 2, n + pad, 0x11);
    CK(cuMemsetD8Async(b, 0x22, n + pad, s));
    if (n16) CK(cuMemsetD16Async(b + 2, 0x1234, n16, s));
    CK(cuMemcpyDtoHAsync(pdst, b, n + pad, s)); CK(cuStreamSynchronize(s));
    ok16 &= pdst[0] == 0x22 && pdst[1] == 0x22 && scan(pdst + 2, 2 * n16, 0x1234, 2, n + pad - 2, 0x22);
    verdict("memsetD16", ok16);
    CK(cuMemsetD8(a, 0x33, n + pad));
    if (n32) CK(cuMemsetD32(a, 0xcafef00du, n32));
    CK(cuMemcpyDtoH(dst, a, n + pad));
    int ok32 = scan(dst, 4 * n32, 0xcafef00du, 4, n + pad, 0x33);
    CK(cuMemsetD8Async(b, 0x44, n + pad, s));
    if (n32) CK(cuMemsetD32Async(b + 4, 0x89abcdefu, n32, s));
    CK(cuMemcpyDtoHAsync(pdst, b, n + pad, s)); CK(cuStreamSynchronize(s));
    ok32 &= scan(pdst, 4, 0x44, 1, 4, 0) && scan(pdst + 4, 4 * n32, 0x89abcdefu, 4, n + pad - 4, 0x44);
    verdict("memsetD32", ok32);
    printf(" final=%016llx\n", (unsigned long long)checksum(pdst, n + pad));
    fflush(stdout);
    CK(cuMemFree(a)); CK(cuMemFree(b));
    CK(cuMemFreeHost(psrc)); CK(cuMemFreeHost(pdst));
    free(src); free(dst);
  }
  CK(cuStreamDestroy(s));
  printf("memcpy_sweep: %d failed: %s\n", failures, failures ? "FAIL" : "PASS");
  return failures ? 1 : 0;
}
