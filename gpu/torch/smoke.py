"""A first PyTorch check through Remora (issue 11 will grow it into a suite).

    python3 gpu/torch/smoke.py CHECK

runs one check and prints `CHECK <checksum>`; run it natively and under `remora run` and
compare the lines (each check in its own process, so that one crash hides nothing else).
Checks: device, fp32_matmul, bf16_matmul, lt_gemms, fft, linalg_solve, conv2d, train_step.
Deterministic: fixed seeds, deterministic algorithms, CUBLAS_WORKSPACE_CONFIG.
"""
import hashlib
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
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
    raise SystemExit(f"unknown check {check!r}")


if __name__ == "__main__":
    name = sys.argv[1]
    print(name, run(name), flush=True)
