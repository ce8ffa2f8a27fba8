// async_visibility: asynchronous device-to-host copies must be in host memory, every byte of
// them, at every point where CUDA guarantees their completion. A CUDA *runtime* program built
// like graphs.cu (nvcc's default static cudart).
//
// Every copy is preceded, on its stream, by kernels that produce its bytes: usually a kernel
// that spins ~2 ms (so that the copy really completes late, after the call that issued it has
// returned), then a kernel that fills the device buffer with a value that depends on the byte's
// index and a per-copy seed. The host buffer is filled with a sentinel (0xAB) first, including
// GUARD bytes past its end, which must still hold the sentinel afterwards. After the completion
// point every byte is checked. Sizes: 4 KiB, 4 MiB + 1000 and 40 MiB + 3 (below 64 KiB and
// above Remora's 32 MiB copy chunk; odd lengths). Host memory: plain malloc (pageable),
// malloc + cudaHostRegister (default flags), malloc + cudaHostRegister(cudaHostRegisterMapped)
// (required to work, as natively), and cudaMallocHost. Each (size, memory) pair gets several
// rounds with different seeds.
//
// Sections (the completion points), one line each:
//   1. cudaStreamSynchronize on the copy's stream;
//   2. cudaEventRecord on the copy's stream + cudaEventSynchronize (default event and a
//      blocking-sync event);
//   3. copies on 3 blocking streams (cudaStreamCreate), then cudaEventRecord(ev, 0) on the
//      legacy stream + cudaEventSynchronize(ev): 3 buffers, and one buffer split in 3 parts at
//      odd offsets (NVIDIA's simpleStreams with cudaHostRegister);
//   4. cudaStreamSynchronize(0) after copies on blocking streams (and one on the legacy stream);
//   5. cudaDeviceSynchronize after copies on 2 blocking streams and a non-blocking one;
//   6. polling: cudaStreamQuery until cudaSuccess; cudaEventQuery until cudaSuccess;
//   7. cudaStreamWaitEvent chain: copy on A, event on A, B waits for it, event2 on B,
//      cudaEventSynchronize(event2); and the same chain with cudaStreamSynchronize(B);
//   8. a host function (cudaLaunchHostFunc, and cudaStreamAddCallback) enqueued after the copy
//      checks the bytes inside the callback (no CUDA calls there); the main thread, and 3
//      std::threads with their own streams and buffers (pinned and pageable);
//   9. cudaStreamPerThread: copies on it + cudaStreamSynchronize(cudaStreamPerThread), in the
//      main thread and in 3 std::threads;
//  10. cudaHostUnregister right after an async copy into the registered range (it waits for
//      the copy, natively), with no other synchronization before the check; and a
//      non-blocking stream (cudaStreamNonBlocking) with cudaStreamSynchronize;
//  11. a synchronous cudaMemcpy (device to host, 4 bytes, legacy stream) after async copies on
//      blocking streams: it runs after them and returns after it completes.
// First, a self-check of the checker (it rejects a sentinel buffer, another copy's bytes and a
// clobbered guard byte). Not checked: cudaFreeHost with a copy pending (the bytes are gone).
// On an H100 natively: ~6 s, ~650 MB of host memory; with the completion points left out,
// every section but 8 fails (pageable copies alone pass, being synchronous natively).
// stdout is deterministic (counts only); on a mismatch the section's line gives the number of
// bad bytes and the first bad one, stderr the details and each section's run time; the exit
// status is 1 on any mismatch.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#include <time.h>
#include <cuda_runtime.h>

#define CK(call)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "FAIL %s:%d: %s -> %d %s\n", __FILE__, __LINE__, #call, (int)e_,    \
              cudaGetErrorName(e_));                                                      \
      printf("FAIL %s: %d %s\n", #call, (int)e_, cudaGetErrorName(e_));                   \
      fflush(stdout);                                                                     \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

enum Kind { PAGEABLE, REGISTERED, MAPPED, PINNED, NKIND };
static const char *const KIND_NAME[NKIND] = {"pageable", "registered", "registered-mapped",
                                             "pinned"};
static const std::vector<Kind> ALL_KINDS = {PAGEABLE, REGISTERED, MAPPED, PINNED};
static const std::vector<Kind> THREAD_KINDS = {PINNED, PAGEABLE};

enum { NSIZE = 3, NSLOT = 3, NTHREAD = 3, GUARD = 64 };
static const size_t SIZES[NSIZE] = {4096, (size_t(4) << 20) + 1000, (size_t(40) << 20) + 3};
static const size_t MAXN = (size_t(40) << 20) + 3;
static const unsigned char SENTINEL = 0xAB;
static const unsigned long long SPIN_NS = 2000000;  // the slow kernel: ~2 ms

// 40 MiB copies get 2 rounds, the others 3; round 1 has no slow kernel before it.
static int rounds_for(int si) { return si == NSIZE - 1 ? 2 : 3; }
static bool slow_round(int r) { return r != 1; }

// The value of byte g: byte (g % 4) of the little-endian word (g / 4) * STEP + seed. Seeds are
// well mixed and differ for every copy, so a word left from another copy never matches, nor one
// from elsewhere in the same copy; the host check is one add and one compare per word.
static const uint32_t STEP = 0x9E3779B1u;
__host__ __device__ static inline unsigned char byte_at(size_t g, uint32_t seed) {
  return (unsigned char)(((uint32_t)(g >> 2) * STEP + seed) >> (8 * (g & 3)));
}

// d[i] = byte_at(base + i): a part of a larger buffer whose byte 0 is at d - base.
__global__ void fill(unsigned char *d, size_t base, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    d[i] = byte_at(base + i, seed);
}

// Spins for `ns` nanoseconds of %globaltimer (wall time, whatever the SM clock is), bounded by
// clock64 so that it ends even if the timer did not advance.
__global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  long long c0 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns && clock64() - c0 < 100000000LL);
}

static void produce(unsigned char *d, size_t base, size_t n, uint32_t seed, cudaStream_t s,
                    bool slow) {
  if (slow) spin<<<1, 1, 0, s>>>(SPIN_NS);
  unsigned blocks = (unsigned)std::min<size_t>((n + 255) / 256, 4096);
  fill<<<blocks, 256, 0, s>>>(d, base, n, seed);
  CK(cudaGetLastError());
}

static void sentinel(unsigned char *h, size_t n) { memset(h, SENTINEL, n + GUARD); }

struct Bad {
  long long bytes = 0;  // wrong bytes, guard bytes included
  size_t first = 0;     // index of the first wrong byte
  unsigned got = 0, want = 0;
};

// Checks h[0..n) against the fill of `seed` and h[n..n+GUARD) against the sentinel.
// Pure host code: callable from a host function.
static Bad check_bytes(const unsigned char *h, size_t n, uint32_t seed) {
  Bad b;
  auto bad = [&b](size_t i, unsigned got, unsigned want) {
    if (b.bytes++ == 0) b.first = i, b.got = got, b.want = want;
  };
  size_t nw = n / 4;
  uint32_t want = seed;
  for (size_t w = 0; w < nw; w++, want += STEP) {
    uint32_t got;
    memcpy(&got, h + 4 * w, 4);
    if (got != want)
      for (int k = 0; k < 4; k++)
        if (h[4 * w + k] != byte_at(4 * w + k, seed))
          bad(4 * w + k, h[4 * w + k], byte_at(4 * w + k, seed));
  }
  for (size_t i = nw * 4; i < n; i++)
    if (h[i] != byte_at(i, seed)) bad(i, h[i], byte_at(i, seed));
  for (size_t i = n; i < n + GUARD; i++)
    if (h[i] != SENTINEL) bad(i, h[i], SENTINEL);
  return b;
}

// A distinct, well-mixed seed per copy (a bijection of the distinct inputs).
static uint32_t seed_of(int sec, int variant, int kind, int si, int round, int part) {
  uint32_t x = (uint32_t)((((((sec * 16 + variant) * 8 + kind) * 4 + si) * 8 + round) * 8) + part);
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// One section's results; record() may be called from several threads.
struct Section {
  int id;
  const char *what;
  long long copies = 0, bad_copies = 0, bad_bytes = 0;
  std::string first;
  std::mutex m;
  timespec t0;

  Section(int id_, const char *what_) : id(id_), what(what_) {
    clock_gettime(CLOCK_MONOTONIC, &t0);
  }

  void record(const char *variant, Kind k, size_t n, int round, int part, const Bad &b) {
    std::lock_guard<std::mutex> g(m);
    copies++;
    if (b.bytes == 0) return;
    char line[320];
    snprintf(line, sizeof line,
             "%s, %s memory, %zu bytes, round %d, part %d: byte %zu is 0x%02x, want 0x%02x%s",
             variant, KIND_NAME[k], n, round, part, b.first, b.got, b.want,
             b.first >= n ? " (guard byte past the end)" : "");
    if (bad_copies < 20)
      fprintf(stderr, "section %d: %lld bad bytes: %s\n", id, b.bytes, line);
    if (first.empty()) first = line;
    bad_copies++;
    bad_bytes += b.bytes;
  }

  // A failure that is not about bytes (a callback that did not run once).
  void fail(const char *msg) {
    std::lock_guard<std::mutex> g(m);
    fprintf(stderr, "section %d: %s\n", id, msg);
    if (first.empty()) first = msg;
    bad_copies++;
  }

  int finish() {
    timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    fprintf(stderr, "section %d: %.3f s\n", id,
            (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9);
    if (bad_copies == 0) {
      printf("section %d: ok (%s; %lld copies checked)\n", id, what, copies);
    } else {
      printf("section %d: FAIL %lld bad bytes in %lld of %lld copies (%s); first: %s\n", id,
             bad_bytes, bad_copies, copies, what, first.c_str());
    }
    fflush(stdout);
    return bad_copies == 0 ? 0 : 1;
  }
};

// Buffers: slot j has a device buffer and a host buffer of each kind, MAXN + GUARD bytes.
struct Slot {
  unsigned char *d = nullptr;
  unsigned char *h[NKIND] = {};
};
static Slot slots[NSLOT];

static void alloc_slots() {
  for (Slot &s : slots) {
    CK(cudaMalloc(&s.d, MAXN));
    size_t len = MAXN + GUARD;
    s.h[PAGEABLE] = (unsigned char *)malloc(len);
    s.h[REGISTERED] = (unsigned char *)malloc(len);
    s.h[MAPPED] = (unsigned char *)malloc(len);
    if (!s.h[PAGEABLE] || !s.h[REGISTERED] || !s.h[MAPPED]) {
      printf("FAIL malloc\n");
      exit(1);
    }
    // Touch every page before registering, as a program that fills its buffer first would.
    for (Kind k : {PAGEABLE, REGISTERED, MAPPED}) memset(s.h[k], 0, len);
    CK(cudaHostRegister(s.h[REGISTERED], len, cudaHostRegisterDefault));
    CK(cudaHostRegister(s.h[MAPPED], len, cudaHostRegisterMapped));
    CK(cudaMallocHost(&s.h[PINNED], len));
  }
}

static void free_slots() {
  for (Slot &s : slots) {
    CK(cudaHostUnregister(s.h[REGISTERED]));
    CK(cudaHostUnregister(s.h[MAPPED]));
    free(s.h[PAGEABLE]);
    free(s.h[REGISTERED]);
    free(s.h[MAPPED]);
    CK(cudaFreeHost(s.h[PINNED]));
    CK(cudaFree(s.d));
  }
}

// For each memory kind, size and round: f(kind, size index, round).
static void each(const std::vector<Kind> &kinds,
                 const std::function<void(Kind, int, int)> &f) {
  for (Kind k : kinds)
    for (int si = 0; si < NSIZE; si++)
      for (int r = 0; r < rounds_for(si); r++) f(k, si, r);
}

// One copy on `s` from slot `slot`, then `complete()`, then the check.
static void single(Section &S, int variant, const char *vname, const std::vector<Kind> &kinds,
                   int slot, cudaStream_t s, const std::function<void()> &complete) {
  each(kinds, [&](Kind k, int si, int r) {
    size_t n = SIZES[si];
    unsigned char *h = slots[slot].h[k], *d = slots[slot].d;
    uint32_t seed = seed_of(S.id, variant, k, si, r, slot);
    sentinel(h, n);
    produce(d, 0, n, seed, s, slow_round(r));
    CK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, s));
    complete();
    S.record(vname, k, n, r, slot, check_bytes(h, n, seed));
  });
}

// Copies on 3 streams, then `complete()`, then the checks. `split`: one buffer (slot 0) in 3
// parts at odd offsets, part j on streams[j]; else slot j's buffer on streams[j].
static void multi(Section &S, int variant, const char *vname, bool split,
                  const cudaStream_t (&streams)[NSLOT], const std::function<void()> &complete) {
  each(ALL_KINDS, [&](Kind k, int si, int r) {
    size_t n = SIZES[si];
    uint32_t seeds[NSLOT];
    if (split) {
      unsigned char *h = slots[0].h[k], *d = slots[0].d;
      seeds[0] = seed_of(S.id, variant, k, si, r, 0);
      sentinel(h, n);
      for (int j = 0; j < NSLOT; j++) {
        size_t off = n * j / NSLOT, len = n * (j + 1) / NSLOT - off;
        produce(d + off, off, len, seeds[0], streams[j], slow_round(r));
        CK(cudaMemcpyAsync(h + off, d + off, len, cudaMemcpyDeviceToHost, streams[j]));
      }
      complete();
      S.record(vname, k, n, r, 0, check_bytes(h, n, seeds[0]));
      return;
    }
    for (int j = 0; j < NSLOT; j++) {
      seeds[j] = seed_of(S.id, variant, k, si, r, j);
      sentinel(slots[j].h[k], n);
      produce(slots[j].d, 0, n, seeds[j], streams[j], slow_round(r));
      CK(cudaMemcpyAsync(slots[j].h[k], slots[j].d, n, cudaMemcpyDeviceToHost, streams[j]));
    }
    complete();
    for (int j = 0; j < NSLOT; j++)
      S.record(vname, k, n, r, j, check_bytes(slots[j].h[k], n, seeds[j]));
  });
}

// What a host function sees: it checks the bytes and counts its calls.
struct CbCheck {
  const unsigned char *h;
  size_t n;
  uint32_t seed;
  Bad bad;
  std::atomic<int> calls{0};
  std::atomic<int> status_ok{1};
};

static void CUDART_CB host_check(void *p) {
  CbCheck *c = (CbCheck *)p;
  c->bad = check_bytes(c->h, c->n, c->seed);
  c->calls++;
}

static void CUDART_CB stream_callback(cudaStream_t, cudaError_t status, void *p) {
  if (status != cudaSuccess) ((CbCheck *)p)->status_ok = 0;
  host_check(p);
}

// A host function after the copy on `s` checks it; then cudaStreamSynchronize(s).
static void hostfunc_round(Section &S, int variant, const char *vname, bool add_callback,
                           int slot, cudaStream_t s, Kind k, int si, int r) {
  size_t n = SIZES[si];
  unsigned char *h = slots[slot].h[k], *d = slots[slot].d;
  CbCheck c;
  c.h = h;
  c.n = n;
  c.seed = seed_of(S.id, variant, k, si, r, slot);
  sentinel(h, n);
  produce(d, 0, n, c.seed, s, slow_round(r));
  CK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, s));
  if (add_callback)
    CK(cudaStreamAddCallback(s, stream_callback, &c, 0));
  else
    CK(cudaLaunchHostFunc(s, host_check, &c));
  CK(cudaStreamSynchronize(s));
  if (c.calls.load() != 1 || !c.status_ok.load()) {
    char msg[200];
    snprintf(msg, sizeof msg, "%s, %s memory, %zu bytes, round %d: callback ran %d times%s",
             vname, KIND_NAME[k], n, r, c.calls.load(),
             c.status_ok.load() ? "" : ", status not cudaSuccess");
    S.fail(msg);
    return;
  }
  S.record(vname, k, n, r, slot, c.bad);
}

int main() {
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  alloc_slots();
  printf("async_visibility: sizes");
  for (size_t n : SIZES) printf(" %zu", n);
  printf(", host memory");
  for (const char *k : KIND_NAME) printf(" %s", k);
  printf(", sentinel 0x%02x, %d guard bytes\n", SENTINEL, GUARD);
  fflush(stdout);

  {
    // The checker itself: it must reject an untouched (sentinel) buffer, another copy's bytes
    // and a clobbered guard byte.
    enum { N = 4096 };
    static unsigned char buf[N + GUARD];
    sentinel(buf, N);
    long long untouched = check_bytes(buf, N, 1).bytes;
    for (size_t i = 0; i < N; i++) buf[i] = byte_at(i, seed_of(0, 0, 0, 0, 0, 1));
    long long stale = check_bytes(buf, N, seed_of(0, 0, 0, 0, 0, 2)).bytes;
    long long right = check_bytes(buf, N, seed_of(0, 0, 0, 0, 0, 1)).bytes;
    buf[N] = 0;
    long long guard = check_bytes(buf, N, seed_of(0, 0, 0, 0, 0, 1)).bytes;
    bool ok = untouched > N * 9 / 10 && stale > N * 9 / 10 && right == 0 && guard == 1;
    printf("checker rejects sentinel, stale and guard bytes: %s\n", ok ? "yes" : "NO");
    if (!ok) {
      fprintf(stderr, "checker: untouched %lld, stale %lld, right %lld, guard %lld\n", untouched,
              stale, right, guard);
      return 1;
    }
  }

  cudaStream_t st[NSLOT], nb;
  for (cudaStream_t &s : st) CK(cudaStreamCreate(&s));
  CK(cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking));
  cudaEvent_t ev, ev_blocking, ev2;
  CK(cudaEventCreate(&ev));
  CK(cudaEventCreateWithFlags(&ev_blocking, cudaEventBlockingSync | cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&ev2, cudaEventDisableTiming));
  int failed = 0;

  {
    Section S(1, "cudaStreamSynchronize on the copy's stream");
    single(S, 0, "stream sync", ALL_KINDS, 0, st[0], [&] { CK(cudaStreamSynchronize(st[0])); });
    failed |= S.finish();
  }
  {
    Section S(2, "cudaEventRecord on the copy's stream + cudaEventSynchronize");
    single(S, 0, "default event", ALL_KINDS, 0, st[0], [&] {
      CK(cudaEventRecord(ev, st[0]));
      CK(cudaEventSynchronize(ev));
    });
    single(S, 1, "blocking-sync event", ALL_KINDS, 1, st[1], [&] {
      CK(cudaEventRecord(ev_blocking, st[1]));
      CK(cudaEventSynchronize(ev_blocking));
    });
    failed |= S.finish();
  }
  {
    Section S(3, "copies on 3 blocking streams, cudaEventRecord on the legacy stream + "
                 "cudaEventSynchronize");
    auto legacy_event = [&](cudaEvent_t e) {
      return [&, e] {
        CK(cudaEventRecord(e, 0));
        CK(cudaEventSynchronize(e));
      };
    };
    multi(S, 0, "3 buffers, blocking-sync event", false, st, legacy_event(ev_blocking));
    multi(S, 1, "1 buffer in 3 parts, blocking-sync event", true, st, legacy_event(ev_blocking));
    multi(S, 2, "1 buffer in 3 parts, default event", true, st, legacy_event(ev));
    failed |= S.finish();
  }
  {
    Section S(4, "cudaStreamSynchronize(0) after copies on blocking streams");
    auto legacy_sync = [] { CK(cudaStreamSynchronize(0)); };
    multi(S, 0, "3 buffers", false, st, legacy_sync);
    multi(S, 1, "1 buffer in 3 parts", true, st, legacy_sync);
    const cudaStream_t with_legacy[NSLOT] = {0, st[1], st[2]};
    multi(S, 2, "3 buffers, one on the legacy stream", false, with_legacy, legacy_sync);
    failed |= S.finish();
  }
  {
    Section S(5, "cudaDeviceSynchronize after copies on 2 blocking streams and a non-blocking one");
    const cudaStream_t mixed[NSLOT] = {st[0], st[1], nb};
    auto device_sync = [] { CK(cudaDeviceSynchronize()); };
    multi(S, 0, "3 buffers", false, mixed, device_sync);
    multi(S, 1, "1 buffer in 3 parts", true, mixed, device_sync);
    failed |= S.finish();
  }
  {
    Section S(6, "polling cudaStreamQuery / cudaEventQuery until cudaSuccess");
    single(S, 0, "cudaStreamQuery", ALL_KINDS, 0, st[0], [&] {
      cudaError_t e;
      while ((e = cudaStreamQuery(st[0])) == cudaErrorNotReady) {
      }
      CK(e);
    });
    single(S, 1, "cudaEventQuery", ALL_KINDS, 1, nb, [&] {
      CK(cudaEventRecord(ev2, nb));
      cudaError_t e;
      while ((e = cudaEventQuery(ev2)) == cudaErrorNotReady) {
      }
      CK(e);
    });
    (void)cudaGetLastError();
    failed |= S.finish();
  }
  {
    Section S(7, "cudaStreamWaitEvent chain: event on the copy's stream A, B waits, then "
                 "cudaEventSynchronize(event2 on B) / cudaStreamSynchronize(B)");
    auto chain = [&](bool sync_stream) {
      return [&, sync_stream] {
        CK(cudaEventRecord(ev, st[0]));
        CK(cudaStreamWaitEvent(nb, ev, 0));
        if (sync_stream) {
          CK(cudaStreamSynchronize(nb));
        } else {
          CK(cudaEventRecord(ev2, nb));
          CK(cudaEventSynchronize(ev2));
        }
      };
    };
    single(S, 0, "event2 synchronize", ALL_KINDS, 0, st[0], chain(false));
    single(S, 1, "stream B synchronize", ALL_KINDS, 0, st[0], chain(true));
    failed |= S.finish();
  }
  {
    Section S(8, "a host function after the copy checks the bytes (cudaLaunchHostFunc, "
                 "cudaStreamAddCallback; 3 threads)");
    each(ALL_KINDS, [&](Kind k, int si, int r) {
      hostfunc_round(S, 0, "cudaLaunchHostFunc", false, 0, st[0], k, si, r);
    });
    each(ALL_KINDS, [&](Kind k, int si, int r) {
      hostfunc_round(S, 1, "cudaStreamAddCallback", true, 1, nb, k, si, r);
    });
    std::vector<std::thread> threads;
    for (int t = 0; t < NTHREAD; t++)
      threads.emplace_back([&S, t] {
        cudaStream_t s;
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        each(THREAD_KINDS, [&](Kind k, int si, int r) {
          hostfunc_round(S, 2 + t, "cudaLaunchHostFunc in a thread", false, t, s, k, si, r);
        });
        CK(cudaStreamDestroy(s));
      });
    for (std::thread &t : threads) t.join();
    failed |= S.finish();
  }
  {
    Section S(9, "cudaStreamPerThread + cudaStreamSynchronize(cudaStreamPerThread), main thread "
                 "and 3 threads");
    auto per_thread_sync = [] { CK(cudaStreamSynchronize(cudaStreamPerThread)); };
    single(S, 0, "main thread", ALL_KINDS, 0, cudaStreamPerThread, per_thread_sync);
    std::vector<std::thread> threads;
    for (int t = 0; t < NTHREAD; t++)
      threads.emplace_back([&S, &per_thread_sync, t] {
        single(S, 1 + t, "thread", THREAD_KINDS, t, cudaStreamPerThread, per_thread_sync);
      });
    for (std::thread &t : threads) t.join();
    failed |= S.finish();
  }
  {
    Section S(10, "cudaHostUnregister right after the copy; a non-blocking stream + "
                  "cudaStreamSynchronize");
    size_t len = (MAXN + GUARD + 4095) / 4096 * 4096;
    unsigned char *u = (unsigned char *)aligned_alloc(4096, len);
    if (!u) {
      printf("FAIL aligned_alloc\n");
      return 1;
    }
    memset(u, 0, len);
    for (int si = 0; si < NSIZE; si++)
      for (int r = 0; r < rounds_for(si); r++) {
        size_t n = SIZES[si];
        uint32_t seed = seed_of(S.id, 0, REGISTERED, si, r, 0);
        sentinel(u, n);
        CK(cudaHostRegister(u, n + GUARD, cudaHostRegisterDefault));
        produce(slots[0].d, 0, n, seed, st[0], true);
        CK(cudaMemcpyAsync(u, slots[0].d, n, cudaMemcpyDeviceToHost, st[0]));
        CK(cudaHostUnregister(u));
        S.record("unregister", REGISTERED, n, r, 0, check_bytes(u, n, seed));
        CK(cudaStreamSynchronize(st[0]));
      }
    free(u);
    single(S, 1, "non-blocking stream", ALL_KINDS, 1, nb, [&] { CK(cudaStreamSynchronize(nb)); });
    failed |= S.finish();
  }
  {
    Section S(11, "a synchronous cudaMemcpy on the legacy stream after copies on blocking streams");
    int *probe;
    CK(cudaMalloc(&probe, sizeof(int)));
    CK(cudaMemset(probe, 0, sizeof(int)));
    auto sync_copy = [probe] {
      int x = -1;
      CK(cudaMemcpy(&x, probe, sizeof x, cudaMemcpyDeviceToHost));
      if (x != 0) {
        printf("FAIL probe %d\n", x);
        exit(1);
      }
    };
    multi(S, 0, "3 buffers", false, st, sync_copy);
    multi(S, 1, "1 buffer in 3 parts", true, st, sync_copy);
    CK(cudaFree(probe));
    failed |= S.finish();
  }

  CK(cudaDeviceSynchronize());
  CK(cudaEventDestroy(ev));
  CK(cudaEventDestroy(ev_blocking));
  CK(cudaEventDestroy(ev2));
  for (cudaStream_t s : st) CK(cudaStreamDestroy(s));
  CK(cudaStreamDestroy(nb));
  free_slots();
  printf("async_visibility %s\n", failed ? "FAIL" : "PASS");
  return failed ? 1 : 0;
}
