"""First-call cost of a new shape in a fresh process: with an empty Triton cache, then reusing it
(the dense MLP, or the routed experts)."""

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


_EXPERTS_CHILD = """
import time, torch
from fused_swiglu import SwiGLUExperts
t, h, i, e, k, save, dtype = {t}, {h}, {i}, {e}, {k}, {save!r}, getattr(torch, {dtype!r})
experts = SwiGLUExperts(e, h, i, save=save, device="cuda", dtype=dtype)
x = torch.randn(t, h, device="cuda", dtype=dtype, requires_grad=True)
weights, index = torch.topk(torch.randn(t, e, device="cuda").softmax(-1), k)
torch.cuda.synchronize()
t0 = time.perf_counter()
experts(x, index, weights.to(dtype)).backward(torch.randn_like(x))
torch.cuda.synchronize()
print(time.perf_counter() - t0)
"""


def _twice_in_fresh_processes(code: str) -> tuple[float, float]:
    """Seconds printed by ``code`` run in a process with an empty kernel cache, then in a second one
    reusing that cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        times = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            )
            times.append(float(out.stdout.strip().splitlines()[-1]))
    return times[0], times[1]


def cold_start_seconds(
    m: int, hidden: int, inter: int, save: str, dtype: torch.dtype = torch.bfloat16
) -> tuple[float, float]:
    """(seconds with an empty kernel cache, seconds in a second process reusing that cache)."""
    code = _CHILD.format(m=m, h=hidden, i=inter, save=save, dtype=str(dtype).removeprefix("torch."))
    return _twice_in_fresh_processes(code)


def experts_cold_start_seconds(
    tokens: int, shape: tuple[int, int, int, int], save: str, dtype: torch.dtype = torch.bfloat16
) -> tuple[float, float]:
    """The same for one training step of routed experts of ``shape`` (hidden, intermediate, experts,
    top-k)."""
    hidden, inter, experts, top_k = shape
    dtype_name = str(dtype).removeprefix("torch.")
    code = _EXPERTS_CHILD.format(t=tokens, h=hidden, i=inter, e=experts, k=top_k, save=save, dtype=dtype_name)
    return _twice_in_fresh_processes(code)
