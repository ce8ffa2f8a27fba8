// memcpy2d3d: cuMemcpy2D, cuMemcpy2DUnaligned, cuMemcpy2DAsync, cuMemcpy3D, cuMemcpy3DAsync in
// every direction (host→device, device→device, device→host, host→host) with pitched
// allocations (cuMemAllocPitch), odd host pitches and non-zero x/y/z offsets on every side;
// CU_MEMORYTYPE_UNIFIED for some sides; then cuMemcpyPeer, cuMemcpyPeerAsync, cuMemcpy3DPeer and
// cuMemcpy3DPeerAsync between two contexts of device 0. Every result is checked against a
// reference computed on the host (bytes outside the region must stay untouched) and a checksum
// of the whole destination buffer is printed, so native and remoted outputs compare byte for byte.
#include "../common.h"

static int failures = 0;
static void verdict(const char *what, int ok) {
  printf(" %s=%s", what, ok ? "ok" : "FAIL");
  if (!ok) failures++;
}

struct Region {
  size_t x, y, z, pitch, height;
};

// What a copy of w x h x d bytes from region s of `src` to region r of `dst` does.
static void reference(const unsigned char *src, Region s, unsigned char *dst, Region r, size_t w,
                      size_t h, size_t d) {
  for (size_t k = 0; k < d; k++)
    for (size_t j = 0; j < h; j++)
      memcpy(dst + ((r.z + k) * r.height + r.y + j) * r.pitch + r.x,
             src + ((s.z + k) * s.height + s.y + j) * s.pitch + s.x, w);
}

static CUDA_MEMCPY3D desc3d(CUmemorytype st, const void *sh, CUdeviceptr sd, Region s,
                            CUmemorytype dt, void *dh, CUdeviceptr dd, Region r, size_t w, size_t h,
                            size_t d) {
  CUDA_MEMCPY3D c;
  memset(&c, 0, sizeof c);
  c.srcMemoryType = st; c.srcHost = sh; c.srcDevice = sd;
  c.srcXInBytes = s.x; c.srcY = s.y; c.srcZ = s.z; c.srcPitch = s.pitch; c.srcHeight = s.height;
  c.dstMemoryType = dt; c.dstHost = dh; c.dstDevice = dd;
  c.dstXInBytes = r.x; c.dstY = r.y; c.dstZ = r.z; c.dstPitch = r.pitch; c.dstHeight = r.height;
  c.WidthInBytes = w; c.Height = h; c.Depth = d;
  return c;
}

static CUDA_MEMCPY2D desc2d(const CUDA_MEMCPY3D &c) {
  CUDA_MEMCPY2D m;
  memset(&m, 0, sizeof m);
  m.srcMemoryType = c.srcMemoryType; m.srcHost = c.srcHost; m.srcDevice = c.srcDevice;
  m.srcXInBytes = c.srcXInBytes; m.srcY = c.srcY; m.srcPitch = c.srcPitch;
  m.dstMemoryType = c.dstMemoryType; m.dstHost = c.dstHost; m.dstDevice = c.dstDevice;
  m.dstXInBytes = c.dstXInBytes; m.dstY = c.dstY; m.dstPitch = c.dstPitch;
  m.WidthInBytes = c.WidthInBytes; m.Height = c.Height;
  return m;
}

enum Mode { SYNC2D, UNALIGNED2D, ASYNC2D, SYNC3D, ASYNC3D };
static const char *mode_name[] = {"2d", "2d-unaligned", "2d-async", "3d", "3d-async"};

static void run(const CUDA_MEMCPY3D &c, Mode mode, CUstream s) {
  CUDA_MEMCPY2D m = desc2d(c);
  switch (mode) {
    case SYNC2D: CK(cuMemcpy2D(&m)); break;
    case UNALIGNED2D: CK(cuMemcpy2DUnaligned(&m)); break;
    case ASYNC2D: CK(cuMemcpy2DAsync(&m, s)); break;
    case SYNC3D: CK(cuMemcpy3D(&c)); break;
    case ASYNC3D: CK(cuMemcpy3DAsync(&c, s)); break;
  }
}

// Host → device → device → host, then host → host, in one mode. Device buffers are pitched
// (cuMemAllocPitch) except for the unaligned mode, which uses odd pitches in plain allocations.
static void chain(Mode mode, CUstream s, int pinned) {
  const int three = mode == SYNC3D || mode == ASYNC3D;
  const int async = mode == ASYNC2D || mode == ASYNC3D;
  const size_t w = 301, h = 37, d = three ? 5 : 1;
  // Host regions: odd pitches, offsets on every side.
  Region hs = {3, 2, three ? 1u : 0u, w + 13, h + 5};
  Region hd = {7, 1, three ? 2u : 0u, w + 29, h + 4};
  size_t hs_len = hs.pitch * hs.height * (hs.z + d + 1), hd_len = hd.pitch * hd.height * (hd.z + d + 1);
  // Device regions.
  Region da = {5, 3, three ? 1u : 0u, 0, h + 6};
  Region db = {11, 4, three ? 2u : 0u, 0, h + 7};
  size_t arows = da.height * (da.z + d + 1), brows = db.height * (db.z + d + 1);
  CUdeviceptr a, b;
  if (mode == UNALIGNED2D) {
    da.pitch = w + 5 + 17;
    db.pitch = w + 11 + 23;
    CK(cuMemAlloc(&a, da.pitch * arows));
    CK(cuMemAlloc(&b, db.pitch * brows));
  } else {
    CK(cuMemAllocPitch(&a, &da.pitch, w + da.x, arows, 4));
    CK(cuMemAllocPitch(&b, &db.pitch, w + db.x, brows, 4));
  }
  size_t alen = da.pitch * arows, blen = db.pitch * brows;
  unsigned char *src, *dst;
  if (pinned) {
    CK(cuMemHostAlloc((void **)&src, hs_len, 0));
    CK(cuMemHostAlloc((void **)&dst, hd_len, 0));
  } else {
    src = (unsigned char *)malloc(hs_len);
    dst = (unsigned char *)malloc(hd_len);
  }
  fill_pattern(src, hs_len, 1000 + mode);
  memset(dst, 0, hd_len);
  CK(cuMemsetD8(a, 0x11, alen));
  CK(cuMemsetD8(b, 0x22, blen));
  CK(cuCtxSynchronize());

  // Device images the reference keeps, starting as the memsets left them.
  unsigned char *ra = (unsigned char *)malloc(alen), *rb = (unsigned char *)malloc(blen);
  unsigned char *rd = (unsigned char *)calloc(hd_len, 1);
  memset(ra, 0x11, alen);
  memset(rb, 0x22, blen);
  // host → device (host side as CU_MEMORYTYPE_UNIFIED in 3-D: a host pointer by unified addressing)
  run(desc3d(three ? CU_MEMORYTYPE_UNIFIED : CU_MEMORYTYPE_HOST, src, (CUdeviceptr)(uintptr_t)src, hs,
             CU_MEMORYTYPE_DEVICE, NULL, a, da, w, h, d), mode, s);
  reference(src, hs, ra, da, w, h, d);
  // device → device (destination as CU_MEMORYTYPE_UNIFIED)
  run(desc3d(CU_MEMORYTYPE_DEVICE, NULL, a, da, CU_MEMORYTYPE_UNIFIED, NULL, b, db, w, h, d), mode, s);
  reference(ra, da, rb, db, w, h, d);
  // device → host
  run(desc3d(CU_MEMORYTYPE_DEVICE, NULL, b, db, CU_MEMORYTYPE_HOST, dst, 0, hd, w, h, d), mode, s);
  reference(rb, db, rd, hd, w, h, d);
  if (async) CK(cuStreamSynchronize(s));
  unsigned char *ga = (unsigned char *)malloc(alen), *gb = (unsigned char *)malloc(blen);
  CK(cuMemcpyDtoH(ga, a, alen));
  CK(cuMemcpyDtoH(gb, b, blen));
  printf("%s%s: htod=%016llx dtod=%016llx dtoh=%016llx", mode_name[mode], pinned ? "-pinned" : "",
         (unsigned long long)checksum(ga, alen), (unsigned long long)checksum(gb, blen),
         (unsigned long long)checksum(dst, hd_len));
  verdict("htod", !memcmp(ga, ra, alen));
  verdict("dtod", !memcmp(gb, rb, blen));
  verdict("dtoh", !memcmp(dst, rd, hd_len));
  // host → host, back into a fresh destination
  memset(dst, 0, hd_len);
  memset(rd, 0, hd_len);
  run(desc3d(CU_MEMORYTYPE_HOST, src, 0, hs, CU_MEMORYTYPE_HOST, dst, 0, hd, w, h, d), mode, s);
  if (async) CK(cuStreamSynchronize(s));
  reference(src, hs, rd, hd, w, h, d);
  printf(" htoh=%016llx", (unsigned long long)checksum(dst, hd_len));
  verdict("htoh", !memcmp(dst, rd, hd_len));
  printf("\n");
  free(ra); free(rb); free(rd); free(ga); free(gb);
  if (pinned) {
    CK(cuMemFreeHost(src));
    CK(cuMemFreeHost(dst));
  } else {
    free(src);
    free(dst);
  }
  CK(cuMemFree(a));
  CK(cuMemFree(b));
}

// Peer copies between two contexts of device 0.
static void peers(CUdevice dev) {
  CUcontext c1, c2;
  CK(cuCtxCreate(&c1, NULL, 0, dev));
  CK(cuCtxCreate(&c2, NULL, 0, dev));
  const size_t n = 1 << 20;
  CUdeviceptr p1, p2;
  CK(cuCtxSetCurrent(c1));
  CK(cuMemAlloc(&p1, n));
  CK(cuCtxSetCurrent(c2));
  CK(cuMemAlloc(&p2, n));
  CUstream s2;
  CK(cuStreamCreate(&s2, CU_STREAM_DEFAULT));
  unsigned char *h1 = (unsigned char *)malloc(n), *h2 = (unsigned char *)malloc(n);
  unsigned char *want = (unsigned char *)malloc(n);
  fill_pattern(h1, n, 77);
  CK(cuMemcpyHtoD(p1, h1, n));
  CK(cuMemsetD8(p2, 0, n));
  CK(cuCtxSynchronize());
  memset(want, 0, n);

  // cuMemcpyPeer c1 → c2, then cuMemcpyPeerAsync c2 → c1 (into another part of p1).
  CK(cuMemcpyPeer(p2 + 100, c2, p1 + 37, c1, 300000));
  memcpy(want + 100, h1 + 37, 300000);
  CK(cuMemcpyPeerAsync(p1 + 500000, c1, p2 + 100, c2, 300000, s2));
  CK(cuStreamSynchronize(s2));
  memcpy(h1 + 500000, h1 + 37, 300000);
  // cuMemcpy3DPeer c1 → c2 and cuMemcpy3DPeerAsync c2 → c1, pitched regions with offsets.
  const size_t w = 123, h = 19, d = 4;
  Region r1 = {9, 2, 1, 257, 23}, r2 = {4, 5, 2, 301, 29};
  Region r3 = {0, 0, 0, 173, 21};
  CUDA_MEMCPY3D_PEER c;
  memset(&c, 0, sizeof c);
  c.srcMemoryType = CU_MEMORYTYPE_DEVICE; c.srcDevice = p1 + 600; c.srcContext = c1;
  c.srcXInBytes = r1.x; c.srcY = r1.y; c.srcZ = r1.z; c.srcPitch = r1.pitch; c.srcHeight = r1.height;
  c.dstMemoryType = CU_MEMORYTYPE_DEVICE; c.dstDevice = p2 + 400000; c.dstContext = c2;
  c.dstXInBytes = r2.x; c.dstY = r2.y; c.dstZ = r2.z; c.dstPitch = r2.pitch; c.dstHeight = r2.height;
  c.WidthInBytes = w; c.Height = h; c.Depth = d;
  CK(cuMemcpy3DPeer(&c));
  reference(h1 + 600, r1, want + 400000, r2, w, h, d);
  CUDA_MEMCPY3D_PEER back = c;
  back.srcDevice = p2 + 400000; back.srcContext = c2;
  back.srcXInBytes = r2.x; back.srcY = r2.y; back.srcZ = r2.z; back.srcPitch = r2.pitch; back.srcHeight = r2.height;
  back.dstDevice = p1 + 900000; back.dstContext = c1;
  back.dstXInBytes = r3.x; back.dstY = r3.y; back.dstZ = r3.z; back.dstPitch = r3.pitch; back.dstHeight = r3.height;
  CK(cuMemcpy3DPeerAsync(&back, s2));
  CK(cuStreamSynchronize(s2));
  reference(want + 400000, r2, h1 + 900000, r3, w, h, d);

  CK(cuMemcpyDtoH(h2, p2, n));
  printf("peer: c2=%016llx", (unsigned long long)checksum(h2, n));
  verdict("peer+3dpeer", !memcmp(h2, want, n));
  CK(cuCtxSetCurrent(c1));
  CK(cuMemcpyDtoH(h2, p1, n));
  printf(" c1=%016llx", (unsigned long long)checksum(h2, n));
  verdict("peer-async+3dpeer-async", !memcmp(h2, h1, n));
  printf("\n");
  free(h1); free(h2); free(want);
  CK(cuCtxSetCurrent(c2));
  CK(cuStreamDestroy(s2));
  CK(cuMemFree(p2));
  CK(cuCtxSetCurrent(c1));
  CK(cuMemFree(p1));
  CK(cuCtxDestroy(c2));
  CK(cuCtxDestroy(c1));
}

int main() {
  CUdevice dev;
  init_primary(&dev);
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_DEFAULT));
  for (int m = SYNC2D; m <= ASYNC3D; m++)
    for (int pinned = 0; pinned <= 1; pinned++) chain((Mode)m, s, pinned);
  CK(cuStreamDestroy(s));
  peers(dev);
  printf("memcpy2d3d: %s\n", failures ? "FAIL" : "ok");
  return failures ? 1 : 0;
}
