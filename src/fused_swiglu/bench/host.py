"""``bench --host-time``: the host time of one eager training call (forward + backward) of each MLP.

At a handful of rows the GPU finishes each kernel long before the host issues the next, so the wall
time of calls issued back to back is the host time of the call: the Python, dispatch and launch
overhead a small or deep model pays per MLP per step when it is not captured in a CUDA graph.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..nn import SwiGLUMLP
from .impls import EagerSwiGLUMLP, peer_module
from .measure import rotation

HOST_IMPLS = ("fused-factors", "fused-preact", "liger", "eager")


def _module(name: str, reference: EagerSwiGLUMLP):
    if name.startswith("fused-"):
        return SwiGLUMLP.from_mlp(reference, save=name.removeprefix("fused-"))
    return peer_module(name, reference)


def measure_host_time(
    hidden: int, inter: int, rows: int, *, calls: int = 200, reps: int = 5, log=print
) -> list[dict]:
    """Microseconds per training call of each implementation, medians of ``reps`` rotating rounds."""
    torch.manual_seed(0)
    factory = {"device": "cuda", "dtype": torch.bfloat16}
    reference = EagerSwiGLUMLP(hidden, inter, **factory)
    x = torch.randn(rows, hidden, **factory, requires_grad=True)
    dy = torch.randn(rows, hidden, **factory)
    modules = {name: _module(name, reference) for name in HOST_IMPLS}
    modules = {name: m for name, m in modules.items() if not isinstance(m, str)}
    samples: dict[str, list[float]] = {name: [] for name in modules}
    names = list(modules)
    for rep in range(reps + 1):  # the first round warms up (compiles, caches)
        for name in rotation(names, rep):
            module = modules[name]
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                module(x).backward(dy)
            torch.cuda.synchronize()
            if rep:
                samples[name].append((time.perf_counter() - start) / calls * 1e6)
    rows_out = [{"impl": name, "host_us": statistics.median(s), "rows": rows} for name, s in samples.items()]
    for row in rows_out:
        log(f"{row['impl']}: {row['host_us']:.1f} us per training call ({rows} rows)")
    return rows_out
