"""Two small PyTorch figures issue 11 sets goals for, as one JSON line on stdout.

  python3 micro.py          init_s: wall time of `import torch` + `torch.cuda.init()` (plus a
                            first tiny op, so the context is really up); cuda_s: the part
                            after `import torch` (what the driver, or Remora, costs: the
                            import alone varies by half a second between runs on a busy
                            file system); tiny_op_us: median
                            microseconds per tiny eager op (x.add_(1) on 16 floats), 20 rounds
                            of 2,000 ops each followed by a synchronize; tiny_op_sync_us: one
                            tiny op plus torch.cuda.synchronize(), median of 2,000.

Run natively and through `remora run`; micro.sh compares them.
"""
import json
import statistics
import time

t0 = time.perf_counter()
import torch  # noqa: E402

t1 = time.perf_counter()
torch.cuda.init()
x = torch.ones(16, device="cuda")
x.add_(1)
torch.cuda.synchronize()
init_s = time.perf_counter() - t0
cuda_s = time.perf_counter() - t1

for _ in range(200):  # warm-up
    x.add_(1)
torch.cuda.synchronize()
rounds = []
for _ in range(20):
    t = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    torch.cuda.synchronize()
    rounds.append((time.perf_counter() - t) / 2000 * 1e6)
synced = []
for _ in range(2000):
    t = time.perf_counter()
    x.add_(1)
    torch.cuda.synchronize()
    synced.append((time.perf_counter() - t) * 1e6)
check = float(x[0].item())
print(json.dumps({
    "init_s": round(init_s, 4),
    "cuda_s": round(cuda_s, 4),
    "tiny_op_us": round(statistics.median(rounds), 3),
    "tiny_op_sync_us": round(statistics.median(synced), 3),
    "x0": check,
}))
