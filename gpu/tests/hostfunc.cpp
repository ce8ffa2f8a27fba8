// hostfunc: cuLaunchHostFunc and cuStreamAddCallback on several streams with kernels between
// them. Host functions run in the calling process (under Remora: in the client, not the
// server) and later work in their stream waits for them:
//  1. order: 3 non-blocking streams, each 40 rounds of (kernel, host function); every host
//     function appends its round to its stream's list: each list is 0..39 in order, and the
//     device counter the kernels add to is right;
//  2. a blocked stream: a host function that waits for the main thread holds back a kernel
//     queued after it (another stream reads the value meanwhile: unchanged), cuStreamQuery
//     says NOT_READY; once released, the kernel runs;
//  3. an event recorded after a host function completes only after it returned;
//  4. cuEventRecord + cuStreamWaitEvent make a host function on one stream wait for one on
//     another;
//  5. cuStreamAddCallback gets the stream as passed and CUDA_SUCCESS; the legacy stream too.
// Everything printed is deterministic (no timings, no pointers).
#include "../common.h"
#include <atomic>
#include <pthread.h>
#include <vector>

enum { S = 3, ROUNDS = 40 };

struct Rec {
  std::vector<int> *list;
  int round;
};

static void CUDA_CB append(void *p) {
  Rec *r = (Rec *)p;
  r->list->push_back(r->round);
}

static std::atomic<int> gate{0};
static std::atomic<int> entered{0};
static void CUDA_CB wait_gate(void *) {
  entered.store(1);
  while (gate.load() == 0) usleep(1000);
}

static std::atomic<int> slow_done{0};
static void CUDA_CB slow(void *) {
  usleep(100 * 1000);
  slow_done.store(1);
}

static std::vector<int> sequence;
static pthread_mutex_t seq_lock = PTHREAD_MUTEX_INITIALIZER;
static void CUDA_CB mark(void *p) {
  usleep(20 * 1000);
  pthread_mutex_lock(&seq_lock);
  sequence.push_back((int)(intptr_t)p);
  pthread_mutex_unlock(&seq_lock);
}

struct CbSeen {
  CUstream expected;
  int calls;
  int stream_ok;
  CUresult status;
};
static void CUDA_CB stream_cb(CUstream s, CUresult status, void *p) {
  CbSeen *seen = (CbSeen *)p;
  seen->calls++;
  seen->stream_ok = (s == seen->expected);
  seen->status = status;
}

int main() {
  init_primary(NULL);
  CUmodule mod = load_module("hostfunc.fatbin");
  CUfunction set_value, add_value, spin_add;
  CK(cuModuleGetFunction(&set_value, mod, "set_value"));
  CK(cuModuleGetFunction(&add_value, mod, "add_value"));
  CK(cuModuleGetFunction(&spin_add, mod, "spin_add"));
  CUstream st[S];
  for (int i = 0; i < S; i++) CK(cuStreamCreate(&st[i], CU_STREAM_NON_BLOCKING));
  CUdeviceptr counter[S], value;
  for (int i = 0; i < S; i++) {
    CK(cuMemAlloc(&counter[i], 4));
    CK(cuMemsetD32(counter[i], 0, 1));
  }
  CK(cuMemAlloc(&value, 4));
  CK(cuMemsetD32(value, 0, 1));

  // 1. Order within each stream, kernels in between.
  std::vector<int> lists[S];
  std::vector<Rec> recs(S * ROUNDS);
  for (int r = 0; r < ROUNDS; r++) {
    for (int i = 0; i < S; i++) {
      int v = r + 1;
      void *args[] = {&counter[i], &v};
      CK(cuLaunchKernel(add_value, 1, 1, 1, 1, 1, 1, 0, st[i], args, NULL));
      recs[i * ROUNDS + r] = Rec{&lists[i], r};
      CK(cuLaunchHostFunc(st[i], append, &recs[i * ROUNDS + r]));
    }
  }
  CK(cuCtxSynchronize());
  for (int i = 0; i < S; i++) {
    int in_order = (int)lists[i].size() == ROUNDS;
    for (int r = 0; in_order && r < ROUNDS; r++) in_order = lists[i][r] == r;
    int c = 0;
    CK(cuMemcpyDtoH(&c, counter[i], 4));
    printf("stream %d: %zu host functions, in order: %s, counter %d\n", i, lists[i].size(),
           in_order ? "yes" : "no", c);
    CHECK(in_order, "stream %d out of order", i);
    CHECK(c == ROUNDS * (ROUNDS + 1) / 2, "counter %d", c);
  }

  // 2. A blocked host function holds back the kernel queued after it.
  int seven = 7;
  void *set_args[] = {&value, &seven};
  CK(cuLaunchHostFunc(st[0], wait_gate, NULL));
  CK(cuLaunchKernel(set_value, 1, 1, 1, 1, 1, 1, 0, st[0], set_args, NULL));
  while (entered.load() == 0) usleep(1000);
  int seen = -1;
  CK(cuMemcpyDtoHAsync(&seen, value, 4, st[1]));
  CK(cuStreamSynchronize(st[1]));
  CUresult q = cuStreamQuery(st[0]);
  printf("while blocked: value %d, stream query %s\n", seen, cu_name(q));
  CHECK(seen == 0 && q == CUDA_ERROR_NOT_READY, "the kernel ran before the host function");
  gate.store(1);
  CK(cuStreamSynchronize(st[0]));
  CK(cuMemcpyDtoH(&seen, value, 4));
  printf("after release: value %d\n", seen);
  CHECK(seen == 7, "value %d", seen);

  // 3. An event after a host function completes after it (a kernel first keeps it busy).
  CUevent ev;
  CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  long long cycles = 1000000;
  void *spin_args[] = {&counter[2], &cycles};
  CK(cuLaunchKernel(spin_add, 1, 1, 1, 1, 1, 1, 0, st[2], spin_args, NULL));
  CK(cuLaunchHostFunc(st[2], slow, NULL));
  CK(cuEventRecord(ev, st[2]));
  CK(cuEventSynchronize(ev));
  printf("event after host function: host function done %s\n", slow_done.load() ? "yes" : "no");
  CHECK(slow_done.load() == 1, "the event completed before the host function returned");

  // 4. Across streams: stream 1 waits (event) for stream 0's host function.
  CUevent link;
  CK(cuEventCreate(&link, CU_EVENT_DISABLE_TIMING));
  CK(cuLaunchHostFunc(st[0], mark, (void *)(intptr_t)1));
  CK(cuEventRecord(link, st[0]));
  CK(cuStreamWaitEvent(st[1], link, 0));
  CK(cuLaunchHostFunc(st[1], mark, (void *)(intptr_t)2));
  CK(cuLaunchHostFunc(st[0], mark, (void *)(intptr_t)3));
  CK(cuStreamSynchronize(st[1]));
  CK(cuStreamSynchronize(st[0]));
  // 1 comes first; 2 and 3 may run in either order after it.
  printf("cross-stream: first %d, %zu host functions\n", sequence.empty() ? -1 : sequence[0],
         sequence.size());
  CHECK(sequence.size() == 3 && sequence[0] == 1, "stream 1 did not wait for stream 0");

  // 5. Stream callbacks: the stream as passed, CUDA_SUCCESS; the legacy stream as NULL.
  CbSeen a = {st[2], 0, 0, CUDA_ERROR_UNKNOWN}, b = {NULL, 0, 0, CUDA_ERROR_UNKNOWN};
  CK(cuStreamAddCallback(st[2], stream_cb, &a, 0));
  CK(cuStreamAddCallback(NULL, stream_cb, &b, 0));
  CK(cuStreamSynchronize(st[2]));
  CK(cuStreamSynchronize(NULL));
  printf("stream callback: calls %d, stream matches %s, status %s\n", a.calls,
         a.stream_ok ? "yes" : "no", cu_name(a.status));
  printf("legacy stream callback: calls %d, stream matches %s, status %s\n", b.calls,
         b.stream_ok ? "yes" : "no", cu_name(b.status));
  CHECK(a.calls == 1 && a.stream_ok && a.status == CUDA_SUCCESS, "stream callback");
  CHECK(b.calls == 1 && b.stream_ok && b.status == CUDA_SUCCESS, "legacy stream callback");
  CHECK(cuStreamAddCallback(st[2], stream_cb, &a, 1) == CUDA_ERROR_INVALID_VALUE, "flags");
  CHECK(cuLaunchHostFunc(st[2], NULL, NULL) == CUDA_ERROR_INVALID_VALUE, "NULL function");

  CK(cuEventDestroy(ev));
  CK(cuEventDestroy(link));
  for (int i = 0; i < S; i++) {
    CK(cuStreamDestroy(st[i]));
    CK(cuMemFree(counter[i]));
  }
  CK(cuMemFree(value));
  printf("hostfunc OK\n");
  return 0;
}
