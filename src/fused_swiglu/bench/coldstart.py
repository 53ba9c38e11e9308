"""First-call cost of a new shape in a fresh process: with an empty Triton cache, then reusing it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch

_CHILD = """
import time, torch
from fused_swiglu import SwiGLUMLP
m, h, i, save, dtype = {m}, {h}, {i}, {save!r}, getattr(torch, {dtype!r})
mlp = SwiGLUMLP(h, i, save=save, device="cuda", dtype=dtype)
x = torch.randn(m, h, device="cuda", dtype=dtype, requires_grad=True)
torch.cuda.synchronize()
t0 = time.perf_counter()
mlp(x).backward(torch.randn_like(x))
torch.cuda.synchronize()
print(time.perf_counter() - t0)
"""


def cold_start_seconds(
    m: int, hidden: int, inter: int, save: str, dtype: torch.dtype = torch.bfloat16
) -> tuple[float, float]:
    """(seconds with an empty kernel cache, seconds in a second process reusing that cache)."""
    code = _CHILD.format(m=m, h=hidden, i=inter, save=save, dtype=str(dtype).removeprefix("torch."))
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        times = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            )
            times.append(float(out.stdout.strip().splitlines()[-1]))
    return times[0], times[1]
