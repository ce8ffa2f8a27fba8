"""PyTorch checks through Remora.

    python3 gpu/torch/smoke.py CHECK

runs one check and prints `CHECK <checksum>` (`--list` prints the checks' names, without
importing torch); run it natively and under `remora run` and
compare the lines (each check in its own process, so that one crash hides nothing else).
Checks: see CHECKS below. Deterministic: fixed seeds, deterministic algorithms,
CUBLAS_WORKSPACE_CONFIG; what varies between runs (timings, addresses) is printed only as a
yes/no property.
"""
import hashlib
import os
import sys

CHECKS = [
    "device", "fp32_matmul", "bf16_matmul", "lt_gemms", "eager_dtypes", "fft", "linalg_solve",
    "conv2d", "cudnn_train", "sparse_rand_cub", "amp", "pinned_nonblocking", "streams_events",
    "cuda_graphs", "expandable_segments", "malloc_async", "memory_stats", "train_step",
    "compile", "bulk_copies",
]
if sys.argv[1:] == ["--list"]:
    print(" ".join(CHECKS))
    sys.exit(0)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
if len(sys.argv) > 1 and sys.argv[1] == "expandable_segments":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
if len(sys.argv) > 1 and sys.argv[1] == "malloc_async":
    # PyTorch's allocator on cudaMallocAsync (stream-ordered allocation and pools).
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
import torch  # noqa: E402

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def digest(t):
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def run(check):
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    if check == "device":
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} {p.major}.{p.minor} {torch.cuda.device_count()}"
    if check == "fp32_matmul":
        a = torch.randn(512, 512, generator=g).to(dev)
        return digest(a @ a.T)
    if check == "bf16_matmul":
        a = torch.randn(512, 512, generator=g).to(dev, torch.bfloat16)
        return digest(a @ a.T)
    if check == "lt_gemms":
        # cuBLASLt: fp16 and bf16 GEMMs, batched, and addmm with a bias epilogue
        a = torch.randn(256, 384, generator=g).to(dev)
        b = torch.randn(384, 128, generator=g).to(dev)
        bias = torch.randn(128, generator=g).to(dev)
        x = torch.randn(4, 64, 96, generator=g).to(dev)
        outs = [
            a.half() @ b.half(),
            torch.bmm(x.bfloat16(), x.bfloat16().transpose(1, 2)),
            torch.addmm(bias.bfloat16(), a.bfloat16(), b.bfloat16()),
            torch.addmm(bias, a, b),
            torch.nn.functional.relu(torch.nn.functional.linear(a.half(), b.t().half(), bias.half())),
        ]
        return " ".join(digest(o) for o in outs)
    if check == "fft":
        x = torch.randn(4096, generator=g).to(dev)
        return digest(torch.fft.rfft(x).abs())
    if check == "linalg_solve":
        a = torch.randn(64, 64, generator=g).to(dev) + 64 * torch.eye(64, device=dev)
        b = torch.randn(64, 8, generator=g).to(dev)
        return digest(torch.linalg.solve(a, b))
    if check == "conv2d":
        x = torch.randn(4, 3, 32, 32, generator=g).to(dev)
        w = torch.randn(8, 3, 3, 3, generator=g).to(dev)
        return digest(torch.nn.functional.conv2d(x, w))
    if check == "train_step":
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(32, 64, generator=g).to(dev)
        y = torch.randint(0, 10, (32,), generator=g).to(dev)
        for _ in range(20):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
        return f"{loss.item():.6f}"
    if check == "eager_dtypes":
        x = torch.randn(1000, generator=g).to(dev)
        outs = []
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            y = x.to(dt)
            outs.append((torch.sin(y) * y + y.exp().clamp(max=4) - y.abs().sqrt()).sum(0, keepdim=True))
        torch.backends.cuda.matmul.allow_tf32 = True
        a = torch.randn(256, 256, generator=g).to(dev)
        outs.append(a @ a)
        torch.backends.cuda.matmul.allow_tf32 = False
        return " ".join(digest(o) for o in outs)
    if check == "cudnn_train":
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 4, 3), torch.nn.AvgPool2d(2),
        ).to(dev)
        x = torch.randn(4, 3, 32, 32, generator=g).to(dev).requires_grad_()
        out = m(x)
        out.square().mean().backward()
        return " ".join(digest(t) for t in (out, x.grad, m[0].weight.grad, m[1].running_var))
    if check == "sparse_rand_cub":
        i = torch.tensor([[0, 1, 1, 3], [2, 0, 3, 1]])
        v = torch.tensor([3.0, 4.0, 5.0, 6.0])
        sp = torch.sparse_coo_tensor(i, v, (4, 4)).to(dev)
        d = torch.randn(4, 5, generator=g).to(dev)
        gen = torch.Generator(device=dev).manual_seed(3)
        r = torch.rand(10000, device=dev, generator=gen)
        n = torch.randn(1000, device=dev, generator=gen)
        s_, idx = torch.sort(r)
        u = torch.unique(torch.randint(0, 50, (1000,), generator=g).to(dev))
        return " ".join(digest(t) for t in (torch.sparse.mm(sp, d), r, n, s_, idx, r.cumsum(0), u))
    if check == "amp":
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cuda")
        x = torch.randn(32, 64, generator=g).to(dev)
        y = torch.randint(0, 10, (32,), generator=g).to(dev)
        for _ in range(10):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(m(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return f"{loss.item():.6f} {scaler.get_scale()}"
    if check == "pinned_nonblocking":
        src = torch.randn(1 << 20, generator=g).pin_memory()
        assert src.is_pinned()
        d = src.to(dev, non_blocking=True)
        d = d * 2 + 1
        back = torch.empty_like(src).pin_memory()
        back.copy_(d, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return digest(back)
    if check == "bulk_copies":
        # 256 MiB each way, pageable and pinned: over a socket such copies are striped over
        # the session's lanes (REMORA_LANES), so every byte and its order is checked.
        n = 64 << 20
        src = torch.randint(-(1 << 30), 1 << 30, (n,), dtype=torch.int32, generator=g)
        d = src.to(dev)
        d = d * 3 + 1
        back = d.cpu()
        pinned = src.pin_memory()
        d2 = pinned.to(dev) - 7
        back2 = torch.empty_like(pinned).pin_memory()
        back2.copy_(d2)
        ok = torch.equal(back, src * 3 + 1) and torch.equal(back2, src - 7)
        return f"{ok} {digest(back)} {digest(back2)}"
    if check == "streams_events":
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a = torch.randn(1024, 1024, generator=g).to(dev)
        start.record()
        with torch.cuda.stream(s1):
            s1.wait_event(start)
            b = a @ a
            mid.record(s1)
        with torch.cuda.stream(s2):
            s2.wait_event(mid)
            c = b.relu() + 1
            end.record(s2)
        end.synchronize()
        ok = start.elapsed_time(end) > 0 and mid.query() and end.query()
        return f"{digest(c)} timing-ok={ok}"
    if check == "cuda_graphs":
        static_in = torch.randn(256, 256, generator=g).to(dev)
        w = torch.randn(256, 256, generator=g).to(dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                (static_in @ w).relu()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = (static_in @ w).relu().sum(1)
        outs = []
        for k in range(3):
            static_in.copy_(torch.full((256, 256), float(k)).to(dev) + static_in)
            graph.replay()
            outs.append(static_out.clone())
        torch.cuda.synchronize()
        return " ".join(digest(o) for o in outs)
    if check == "expandable_segments":
        xs = [torch.randn(1 << 18, generator=g).to(dev) * k for k in range(8)]
        del xs[::2]
        big = torch.cat(xs) + torch.randn(4 << 20, generator=g).to(dev)[: 4 << 18]
        # Grow the segment past several of its 20 MiB pages, give them back, grow again.
        ys = [torch.full((5 << 20,), float(k), device=dev) for k in range(6)]
        total = sum(float(y.sum()) for y in ys)
        del ys
        torch.cuda.empty_cache()
        zs = [torch.arange(3 << 20, device=dev, dtype=torch.float32) * k for k in range(4)]
        total += sum(float(z[::4096].sum()) for z in zs)
        return f"{digest(big.sum(0, keepdim=True))} total={total}"
    if check == "malloc_async":
        s = torch.cuda.Stream()
        a = torch.randn(1024, 1024, generator=g).to(dev)
        with torch.cuda.stream(s):
            b = a @ a.t()
            c = [torch.full((1 << 20,), float(k), device=dev) for k in range(8)]
            del c[::2]
            total = float(sum(x.sum() for x in c))
        s.synchronize()
        del a
        torch.cuda.empty_cache()
        return f"{digest(b)} total={total} backend={torch.cuda.get_allocator_backend()}"
    if check == "memory_stats":
        free, total = torch.cuda.mem_get_info()
        x = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
        st = torch.cuda.memory_stats()
        ok = 0 < free <= total and st["allocated_bytes.all.current"] >= 64 << 20
        del x
        return f"stats-ok={ok} allocated-after-free={torch.cuda.memory_allocated()}"
    if check == "compile":
        def f(a, b):
            return torch.sin(a) * torch.cos(b) + a * b
        cf = torch.compile(f)
        a = torch.randn(4096, generator=g).to(dev)
        b = torch.randn(4096, generator=g).to(dev)
        out = cf(a, b)
        return f"max-err-ok={(out - f(a, b)).abs().max().item() < 1e-5}"
    raise SystemExit(f"unknown check {check!r}")


if __name__ == "__main__":
    name = sys.argv[1]
    print(name, run(name), flush=True)
