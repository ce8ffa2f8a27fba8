// Where stream_ordered's time goes, call by call: the pattern of its first part (four
// streams, three rounds; per stream two cudaMallocAsync of a little over 4 MiB, a kernel, a
// memset, a device-to-device copy, a kernel, a copy back into pageable host memory, two
// cudaFreeAsync; then a synchronize of each stream), repeated REMORA_POOL_ROUNDS times
// (default 20), each runtime call timed on the host. Run natively and under `remora run`
// (gpu/tools/device_calls.sh's programs step) to split a remoted run's extra time between the
// calls: one line per call, "pool_probe CALL calls N mean_us M max_us X total_ms T".
//
// nvcc -O2 -o pool_probe pool_probe.cu
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <vector>

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      fprintf(stderr, "pool_probe: %s failed: %s\n", #x, cudaGetErrorString(e_));   \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

__global__ void iota(unsigned *p, size_t n, unsigned base) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = base + (unsigned)i;
}

__global__ void affine(unsigned *p, size_t n, unsigned a, unsigned b) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = p[i] * a + b;
}

static double now_us() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

// One call's figures.
struct Row {
  const char *name;
  long calls = 0;
  double total = 0, max = 0;
  void add(double us) {
    calls++;
    total += us;
    if (us > max) max = us;
  }
};

enum { MALLOC, KERNEL, MEMSET, DTOD, DTOH, FREE, SYNC, ROWS };

#define TIMED(row, call)           \
  do {                             \
    double t0_ = now_us();         \
    CHECK(call);                   \
    rows[row].add(now_us() - t0_); \
  } while (0)

int main() {
  const char *env = getenv("REMORA_POOL_ROUNDS");
  int rounds = env ? atoi(env) : 20;
  if (rounds <= 0) rounds = 20;
  Row rows[ROWS];
  const char *names[ROWS] = {"cudaMallocAsync",     "kernel_launch",        "cudaMemsetAsync",
                             "cudaMemcpyAsync_DtoD", "cudaMemcpyAsync_DtoH", "cudaFreeAsync",
                             "cudaStreamSynchronize"};
  for (int i = 0; i < ROWS; i++) rows[i].name = names[i];
  const int S = 4;
  const size_t n = (1u << 20) + 77;
  cudaStream_t st[S];
  std::vector<std::vector<unsigned>> host(S, std::vector<unsigned>(n));
  CHECK(cudaFree(0));
  for (int s = 0; s < S; s++) CHECK(cudaStreamCreate(&st[s]));
  double start = now_us();
  unsigned check = 0;
  for (int round = 0; round < rounds; round++) {
    for (int s = 0; s < S; s++) {
      unsigned *a = nullptr, *b = nullptr;
      TIMED(MALLOC, cudaMallocAsync((void **)&a, n * 4, st[s]));
      TIMED(MALLOC, cudaMallocAsync((void **)&b, n * 4, st[s]));
      {
        double t0 = now_us();
        iota<<<128, 256, 0, st[s]>>>(a, n, 100 * round + s);
        CHECK(cudaGetLastError());
        rows[KERNEL].add(now_us() - t0);
      }
      TIMED(MEMSET, cudaMemsetAsync(b, 0xff, n * 4, st[s]));
      TIMED(DTOD, cudaMemcpyAsync(b, a, (n - 5) * 4, cudaMemcpyDeviceToDevice, st[s]));
      {
        double t0 = now_us();
        affine<<<128, 256, 0, st[s]>>>(b, n - 5, 3, (unsigned)s);
        CHECK(cudaGetLastError());
        rows[KERNEL].add(now_us() - t0);
      }
      TIMED(DTOH, cudaMemcpyAsync(host[s].data(), b, n * 4, cudaMemcpyDeviceToHost, st[s]));
      TIMED(FREE, cudaFreeAsync(a, st[s]));
      TIMED(FREE, cudaFreeAsync(b, st[s]));
    }
    for (int s = 0; s < S; s++) {
      TIMED(SYNC, cudaStreamSynchronize(st[s]));
      check ^= host[s][7] ^ host[s][n - 1];
    }
  }
  double whole = now_us() - start;
  for (int i = 0; i < ROWS; i++) {
    const Row &r = rows[i];
    printf("pool_probe %s calls %ld mean_us %.1f max_us %.1f total_ms %.2f\n", r.name, r.calls,
           r.calls ? r.total / r.calls : 0.0, r.max, r.total / 1e3);
  }
  printf("pool_probe whole_ms %.2f rounds %d check %08x\n", whole / 1e3, rounds, check);
  for (int s = 0; s < S; s++) CHECK(cudaStreamDestroy(st[s]));
  return 0;
}
