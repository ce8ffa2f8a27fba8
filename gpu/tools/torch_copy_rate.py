"""PyTorch's own host<->device copies, timed: `tensor.to("cuda")` and `.cpu()` (cudaMemcpyAsync
and a stream synchronize underneath) from pageable and pinned memory. Run natively and under
`remora run` (e.g. with REMORA_LANES=0 and 3 over tcp) to compare; prints one line per copy
with the median GB/s of REPS copies and checks the bytes that came back.

    python3 gpu/tools/torch_copy_rate.py [MiB] [reps]
"""
import statistics
import sys
import time

import torch

mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
n = (mib << 20) // 4
src = torch.randint(-(1 << 30), 1 << 30, (n,), dtype=torch.int32)
dev = torch.device("cuda")
torch.cuda.synchronize()
ok = True
for kind, host in (("pageable", src), ("pinned", src.pin_memory())):
    rates = {"htod": [], "dtoh": []}
    out = torch.empty_like(host).pin_memory() if kind == "pinned" else None
    for _ in range(reps + 1):  # the first round warms up
        t = time.perf_counter()
        d = host.to(dev)
        torch.cuda.synchronize()
        rates["htod"].append(mib * (1 << 20) / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        back = d.cpu() if out is None else out.copy_(d)
        rates["dtoh"].append(mib * (1 << 20) / (time.perf_counter() - t) / 1e9)
        ok = ok and torch.equal(back, src)
    for direction, r in rates.items():
        print(f"torch {kind} {direction} {statistics.median(r[1:]):.2f} GB/s")
print("bytes ok" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
