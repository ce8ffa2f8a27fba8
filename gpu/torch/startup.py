"""PyTorch's start-up, for `remora bench startup` (gpu/bench-startup.sh): import torch, make
the CUDA context, run one small elementwise kernel and a reduction, check the result, exit.

    python3 gpu/torch/startup.py

Exits 1 (with the figures on standard error) when the sum is wrong.
"""
import sys

import torch

x = torch.arange(1024, device="cuda", dtype=torch.float32)
got = float((x * 2).sum().item())
want = 2.0 * 1023 * 1024 / 2
if got != want:
    print(f"startup.py: sum {got} != {want}", file=sys.stderr)
    sys.exit(1)
print(f"startup.py: torch {torch.__version__} on {torch.cuda.get_device_name(0)}: ok")
