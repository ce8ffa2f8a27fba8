// multithread: T pthreads share the primary context (half bind it with cuCtxSetCurrent, half with
// cuCtxPushCurrent/PopCurrent); each has its own non-blocking stream and, for some, its own module
// loaded concurrently; each runs ITER rounds of cuMemAlloc, async H2D (pinned or pageable), a
// launch, async D2H, cuStreamSynchronize, cuMemFree, checking every word. Per-thread checksums are
// printed in thread order after the join, so the output is deterministic.
#include "../common.h"
#include <pthread.h>

enum { T = 8, ITER = 40 };
static CUcontext ctx;
static CUfunction shared_fn;
static void *image;
static pthread_barrier_t barrier;
struct Result { uint64_t sum; int ok; int own_module; };
static Result results[T];

static void *worker(void *arg) {
  int t = (int)(intptr_t)arg;
  int push = t % 2;
  if (push) CK(cuCtxPushCurrent(ctx)); else CK(cuCtxSetCurrent(ctx));
  CUcontext cur;
  CK(cuCtxGetCurrent(&cur));
  CHECK(cur == ctx, "thread %d: wrong current context", t);
  pthread_barrier_wait(&barrier);
  CUmodule own = NULL;
  CUfunction fn = shared_fn;
  if (t % 4 == 3) {
    CK(cuModuleLoadData(&own, image));
    CK(cuModuleGetFunction(&fn, own, "affine"));
  }
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  int pinned = t % 3 != 0;
  size_t maxn = (size_t)(t + 1) * 20000 + ITER;
  unsigned *h;
  if (pinned) CK(cuMemHostAlloc((void **)&h, maxn * 4, 0));
  else h = (unsigned *)malloc(maxn * 4);
  uint64_t sum = 0;
  int ok = 1;
  for (int it = 0; it < ITER; it++) {
    int n = (t + 1) * 20000 + it;
    CUdeviceptr d;
    CK(cuMemAlloc(&d, (size_t)n * 4));
    for (int i = 0; i < n; i++) h[i] = (unsigned)(i ^ (t << 20) ^ (it << 12));
    CK(cuMemcpyHtoDAsync(d, h, (size_t)n * 4, s));
    unsigned mul = 2 * t + 1, add = (unsigned)it * 7;
    void *p[] = {&d, &mul, &add, &n};
    CK(cuLaunchKernel(fn, (n + 255) / 256, 1, 1, 256, 1, 1, 0, s, p, NULL));
    CK(cuMemcpyDtoHAsync(h, d, (size_t)n * 4, s));
    CK(cuStreamSynchronize(s));
    for (int i = 0; i < n; i++)
      if (h[i] != (unsigned)(i ^ (t << 20) ^ (it << 12)) * mul + add) { ok = 0; break; }
    sum ^= checksum(h, (size_t)n * 4) + (uint64_t)it;
    CK(cuMemFree(d));
  }
  CK(cuStreamDestroy(s));
  if (pinned) CK(cuMemFreeHost(h)); else free(h);
  if (own) CK(cuModuleUnload(own));
  if (push) { CUcontext popped; CK(cuCtxPopCurrent(&popped)); CHECK(popped == ctx, "pop"); }
  results[t].sum = sum; results[t].ok = ok; results[t].own_module = own != NULL;
  return NULL;
}

int main() {
  ctx = init_primary(NULL);
  size_t len;
  image = load_file("multithread.fatbin", &len, 0);
  CUmodule mod;
  CK(cuModuleLoadData(&mod, image));
  CK(cuModuleGetFunction(&shared_fn, mod, "affine"));
  pthread_barrier_init(&barrier, NULL, T);
  pthread_t th[T];
  for (int t = 0; t < T; t++) pthread_create(&th[t], NULL, worker, (void *)(intptr_t)t);
  for (int t = 0; t < T; t++) pthread_join(th[t], NULL);
  int failures = 0;
  for (int t = 0; t < T; t++) {
    printf("thread %d: %s module, %d rounds %s checksum=%016llx\n", t, results[t].own_module ? "own" : "shared",
           ITER, results[t].ok ? "ok" : "FAIL", (unsigned long long)results[t].sum);
    failures += !results[t].ok;
  }
  CK(cuCtxSynchronize());
  CK(cuModuleUnload(mod));
  free(image);
  printf("multithread: %d threads, %s\n", T, failures ? "FAIL" : "PASS");
  return failures ? 1 : 0;
}
