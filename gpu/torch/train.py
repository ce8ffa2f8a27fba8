"""Small deterministic training runs, to compare Remora with native bit for bit and in speed.

    python3 gpu/torch/train.py {gpt,cnn} [--steps N] [--log-every K] [--warmup W] [--device cuda|cpu]

gpt: a GPT-style decoder (4 layers, d=256, 4 heads, vocab 512, context 128, batch 16, AdamW,
gradient clipping) on synthetic token sequences; cnn: a CIFAR-sized CNN (5 conv/BN/ReLU layers,
max pooling, 3x32x32 inputs, 10 classes, batch 64, SGD with Nesterov momentum) on synthetic
images. The data come from a fixed-seed CPU generator (no downloads), live in pinned memory and
are copied to the device each step with non_blocking, as a DataLoader with pin_memory does.

stdout holds only what must be identical between runs and between native and remoted runs: one
line per K steps with the loss exactly (`float.hex`) and a final SHA-256 over every parameter
and buffer. stderr gets one `train-stats {json}` line: per-step wall times (the device
synchronized at both ends of each step), warmup steps excluded: median, mean, p90 in ms and
steps/s. `--device cpu` is for testing without a GPU.
"""
import argparse
import ctypes
import hashlib
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


def deterministic():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # fp32 everywhere: no TF32 in cuBLAS or cuDNN, whatever the defaults are.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.set_float32_matmul_precision("highest")


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        # Attention written out (batched GEMMs, masked softmax): deterministic forward and
        # backward, unlike the fused kernels' backward.
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=512, ctx=128, d=256, heads=4, layers=4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.register_buffer("mask", torch.ones(ctx, ctx, dtype=torch.bool).triu(1), persistent=False)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x, self.mask)
        return self.head(self.ln(x))


def cnn():
    def unit(i, o):
        return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]
    return nn.Sequential(
        *unit(3, 32), *unit(32, 32), nn.MaxPool2d(2),
        *unit(32, 64), *unit(64, 64), nn.MaxPool2d(2),
        *unit(64, 128),
        nn.Flatten(2), Mean(), nn.Linear(128, 10),
    )


class Mean(nn.Module):
    """Global average pooling as a mean (AdaptiveAvgPool2d's CUDA backward is nondeterministic)."""
    def forward(self, x):
        return x.mean(2)


def gpt_data(n_batches, batch, ctx, vocab, g):
    """Token streams with learnable structure: a fixed random permutation gives each token's
    successor, and 15% of the tokens are replaced by random ones."""
    perm = torch.randperm(vocab, generator=g)
    x = torch.empty(n_batches * batch, ctx + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (x.shape[0],), generator=g)
    noise = torch.rand(x.shape, generator=g) < 0.15
    rand = torch.randint(0, vocab, x.shape, generator=g)
    for t in range(1, ctx + 1):
        x[:, t] = torch.where(noise[:, t], rand[:, t], perm[x[:, t - 1]])
    return x.view(n_batches, batch, ctx + 1)


def cnn_data(n_batches, batch, g, classes=10):
    """Images: a smooth random template per class, shifted and scaled, plus noise."""
    templates = F.interpolate(torch.randn(classes, 3, 8, 8, generator=g), size=32, mode="bilinear",
                              align_corners=False)
    y = torch.randint(0, classes, (n_batches * batch,), generator=g)
    scale = 0.5 + torch.rand(n_batches * batch, 1, 1, 1, generator=g)
    x = templates[y] * scale + 2.0 * torch.randn(n_batches * batch, 3, 32, 32, generator=g)
    return x.view(n_batches, batch, 3, 32, 32), y.view(n_batches, batch)


def checksum(module):
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name} {tuple(t.shape)} {t.dtype};".encode())
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=["gpt", "cnn"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    a.warmup = max(0, min(a.warmup, a.steps - 1))  # at least one timed step
    deterministic()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    g = torch.Generator(device="cpu").manual_seed(1234)
    n_batches = 32  # distinct batches, cycled
    if a.model == "gpt":
        model = GPT()
        data = (gpt_data(n_batches, 16, 128, 512, g),)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        model = cnn()
        data = cnn_data(n_batches, 64, g)
        opt = None
    model.to(dev)
    if opt is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    if cuda:
        data = tuple(d.pin_memory() for d in data)
    params = sum(p.numel() for p in model.parameters())
    print(f"{a.model} steps={a.steps} params={params}", flush=True)

    def step(i):
        batch = [d[i % n_batches].to(dev, non_blocking=True) for d in data]
        if a.model == "gpt":
            inp, target = batch[0][:, :-1], batch[0][:, 1:]
            logits = model(inp)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        else:
            loss = F.cross_entropy(model(batch[0]), batch[1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.model == "gpt":
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model.train()
    times = []
    sync()
    start = time.perf_counter()
    for i in range(1, a.steps + 1):
        t0 = time.perf_counter()
        loss = step(i - 1)
        sync()
        times.append(time.perf_counter() - t0)
        if i % a.log_every == 0 or i == a.steps:
            v = loss.item()
            print(f"step {i} loss {v:.6f} {v.hex()}", flush=True)
        if i == a.warmup:
            start = time.perf_counter()
    total = time.perf_counter() - start
    print(f"params sha256 {checksum(model)}", flush=True)

    timed = times[a.warmup:]
    ms = sorted(t * 1e3 for t in timed)
    stats = {
        "model": a.model, "device": a.device, "steps": a.steps, "warmup": a.warmup,
        "timed_steps": len(ms), "median_step_ms": round(statistics.median(ms), 4),
        "mean_step_ms": round(statistics.fmean(ms), 4), "p90_step_ms": round(ms[int(0.9 * (len(ms) - 1))], 4),
        "min_step_ms": round(ms[0], 4), "steps_per_s": round(len(timed) / total, 2) if total > 0 else None,
        "torch": torch.__version__,
    }
    print("train-stats " + json.dumps(stats), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
