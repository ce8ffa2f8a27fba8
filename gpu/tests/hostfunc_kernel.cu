// Kernels of the hostfunc test: tiny, deterministic.
extern "C" __global__ void set_value(int *p, int v) { *p = v; }

extern "C" __global__ void add_value(int *p, int v) { atomicAdd(p, v); }

// Busy for about `cycles` clock cycles, then adds 1: work that is still running when the host
// enqueues what follows it.
extern "C" __global__ void spin_add(int *p, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
  atomicAdd(p, 1);
}
