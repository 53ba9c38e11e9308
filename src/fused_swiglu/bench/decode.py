"""Inference at decode batch sizes: the no_grad forward of every implementation at a few rows.

At a few rows the MLP reads its three weights for almost no arithmetic, so the time is weight
bandwidth plus launch overhead, and the floor is the forward's two cuBLAS GEMMs. Each call is timed
twice: issued from Python (``do_bench`` between CUDA events: when the host issues kernels more
slowly than the GPU runs them, that host time is part of the figure, as it is for an eager caller),
and replayed from a CUDA graph (GPU time only, as for a server that captures its decode step).
Every fused save mode runs the same inference path, so the library appears once, as ``fused``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..tables import format_table
from .impls import EagerSwiGLUMLP, build_impl
from .measure import measure_impls

DECODE_ROWS = (1, 16, 64, 256)
DECODE_IMPL_NAMES = ("floor", "fused", "eager", "torch.compile", "liger", "flash-swiglu-mlp")


def measure_decode(
    hidden: int,
    inter: int,
    rows: list[int],
    *,
    dtype: torch.dtype = torch.bfloat16,
    reps: int,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """One row per implementation and batch size: no_grad forward ms and its ratio to the floor's."""
    torch.manual_seed(0)
    reference = EagerSwiGLUMLP(hidden, inter, device="cuda", dtype=dtype)
    results = []
    for m in rows:
        log(f"  M={m}")
        x = torch.randn(m, hidden, device="cuda", dtype=dtype)
        dy = torch.randn(m, hidden, device="cuda", dtype=dtype)
        impls = []
        for name in DECODE_IMPL_NAMES:
            if name == "torch.compile":
                torch._dynamo.reset()  # a fresh static graph per batch size, as a fixed-shape server would
            built = build_impl("fused-factors" if name == "fused" else name, reference, x, dy)
            if isinstance(built, str):
                impls.append((name, built))
                continue
            built.name = name
            impls.append(built)
        for row in measure_impls(impls, dy, 0.0, reps=reps, log=log, inference_only=True, graphs=True):
            results.append({"M": m, "hidden": hidden, "intermediate": inter, **row})
    return results


def decode_table(rows: list[dict], markdown: bool = False, metric: str = "no_grad_fwd") -> str:
    """Implementations down, batch sizes across: microseconds and the ratio to the floor, of the
    forward issued from Python (``metric="no_grad_fwd"``) or replayed from a CUDA graph
    (``"graph_fwd"``)."""
    sizes = sorted({r["M"] for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cell = {(r["impl"], r["M"]): r for r in rows}
    body = []
    for impl in impls:
        line = [impl]
        for m in sizes:
            r = cell.get((impl, m))
            if r is None or "missing" in r:
                line.append("missing" if r is not None else None)
            elif metric == "graph_fwd" and "graph_failed" in r:
                line.append("capture failed")
            elif f"{metric}_vs_floor" in r:
                line.append(f"{r[f'{metric}_ms'] * 1e3:.1f} ({r[f'{metric}_vs_floor']:.2f}x)")
            else:
                line.append(f"{r[f'{metric}_ms'] * 1e3:.1f}")
        body.append(line)
    return format_table(["impl"] + [f"M={m} us (vs floor)" for m in sizes], body, markdown=markdown)
