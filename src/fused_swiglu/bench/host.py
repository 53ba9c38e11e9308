"""``bench --host-time``: the host time of one training call (forward + backward) of each MLP, eager
and compiled.

At a handful of rows the GPU finishes each kernel long before the host issues the next, so the wall
time of calls issued back to back is the host time of the call: the Python, dispatch and launch
overhead a small or deep model pays per MLP per step when it is not captured in a CUDA graph. Each
call ends as a training step does (the gradients set to None, as ``zero_grad`` sets them), so no
call adds into the last one's gradients.

Two precisions: ``"bf16"``, every tensor bf16; ``"autocast"``, fp32 weights under bf16 autocast as
in the whole-model benchmark (``bench --model``), where the casts of the weights run on every call.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..nn import SwiGLUMLP
from .impls import EagerSwiGLUMLP, peer_module
from .measure import rotation

HOST_IMPLS = ("fused-factors", "fused-preact", "fused-compiled", "liger", "eager", "torch.compile")
HOST_PRECISIONS = ("bf16", "autocast")


def _module(name: str, reference: EagerSwiGLUMLP):
    if name == "fused-compiled":
        return torch.compile(SwiGLUMLP.from_mlp(reference), dynamic=False)
    if name.startswith("fused-"):
        return SwiGLUMLP.from_mlp(reference, save=name.removeprefix("fused-"))
    return peer_module(name, reference)


def measure_host_time(
    hidden: int,
    inter: int,
    rows: int,
    *,
    precision: str = "bf16",
    calls: int = 200,
    reps: int = 5,
    log=print,
) -> list[dict]:
    """Microseconds per training call of each implementation, medians of ``reps`` rotating rounds."""
    if precision not in HOST_PRECISIONS:
        raise ValueError(f"precision must be one of {HOST_PRECISIONS}, got {precision!r}")
    torch.manual_seed(0)
    weight_dtype = torch.float32 if precision == "autocast" else torch.bfloat16
    reference = EagerSwiGLUMLP(hidden, inter, device="cuda", dtype=weight_dtype)
    x = torch.randn(rows, hidden, device="cuda", dtype=weight_dtype, requires_grad=True)
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast")
    modules = {name: _module(name, reference) for name in HOST_IMPLS}
    modules = {name: m for name, m in modules.items() if not isinstance(m, str)}

    def call(module) -> None:
        with autocast:
            y = module(x)
        y.backward(dy)
        x.grad = None
        for p in module.parameters():
            p.grad = None

    samples: dict[str, list[float]] = {name: [] for name in modules}
    names = list(modules)
    for rep in range(reps + 1):  # the first round warms up (compiles, caches)
        for name in rotation(names, rep):
            module = modules[name]
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                call(module)
            torch.cuda.synchronize()
            if rep:
                samples[name].append((time.perf_counter() - start) / calls * 1e6)
    rows_out = [
        {
            "impl": name,
            "precision": precision,
            "host_us": statistics.median(s),
            "host_us_min": min(s),
            "host_us_max": max(s),
            "rows": rows,
        }
        for name, s in samples.items()
    ]
    for row in rows_out:
        log(f"{row['impl']} ({precision}): {row['host_us']:.1f} us per training call ({rows} rows)")
    return rows_out
