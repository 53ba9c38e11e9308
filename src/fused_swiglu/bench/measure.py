"""Measure every implementation at one shape: first call, memory, then interleaved timings.

Timings are ``triton.testing.do_bench`` medians (CUDA events, L2 flushed between runs). Every
repetition visits all implementations in turn, and each metric is the median over repetitions, so
clock drift and thermal state hit all implementations alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from triton.testing import do_bench

from .impls import EagerSwiGLUMLP, Impl, build_impl

MIB = 2**20


def _clear_grads(impl: Impl) -> None:
    for p in impl.params:
        p.grad = None


def _memory(impl: Impl, dy: torch.Tensor) -> tuple[float, float]:
    """(kept, peak) MiB over what was allocated before: kept between forward and backward (output
    excluded), and the peak of the whole step (weight gradients included)."""
    _clear_grads(impl)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = impl.forward()
    kept = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    y.backward(dy)
    del y
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    _clear_grads(impl)
    return kept / MIB, peak / MIB


def _no_grad(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.no_grad():
            return fn()

    return run


def measure_shape(
    m: int,
    hidden: int,
    inter: int,
    impl_names: list[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    reps: int = 5,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """One row per implementation (``{"impl", "missing"}`` for a peer that is not installed)."""
    torch.manual_seed(0)
    reference = EagerSwiGLUMLP(hidden, inter, device="cuda", dtype=dtype)
    x = torch.randn(m, hidden, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(m, hidden, device="cuda", dtype=dtype)

    rows: dict[str, dict] = {}
    impls: list[Impl] = []
    for name in impl_names:
        if name == "torch.compile":
            torch._dynamo.reset()  # a fresh compile per shape, timed as its first call
        built = build_impl(name, reference, x, dy)
        if isinstance(built, str):
            rows[name] = {"impl": name, "missing": built}
            log(f"  {name}: missing ({built})")
            continue
        t0 = time.perf_counter()
        built.step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        _clear_grads(built)
        row = {"impl": name, "first_call_s": first}
        if built.measures_memory:
            row["kept_mib"], row["peak_mib"] = _memory(built, dy)
        rows[name] = row
        impls.append(built)
        log(f"  {name}: first call {first:.2f} s")

    samples: dict[tuple[str, str], list[float]] = {}
    for rep in range(reps):
        for impl in impls:
            metrics = {
                "step_ms": (impl.step, impl.params),
                "fwd_ms": (impl.forward, []),
                "no_grad_fwd_ms": (_no_grad(impl.forward), []),
            }
            for metric, (fn, grads) in metrics.items():
                t = do_bench(fn, warmup=25, rep=100, grad_to_none=grads or None, return_mode="median")
                samples.setdefault((impl.name, metric), []).append(t)
        log(f"  timing repetition {rep + 1}/{reps} done")
    for (name, metric), values in samples.items():
        rows[name][metric] = statistics.median(values)

    flops = 18 * m * hidden * inter  # six GEMMs: 6 MHI forward, 12 MHI backward
    floor = rows.get("floor", {})
    for row in rows.values():
        row.update({"M": m, "hidden": hidden, "intermediate": inter})
        if "step_ms" in row:
            row["tflops"] = flops / (row["step_ms"] * 1e-3) / 1e12
            for metric in ("step_ms", "fwd_ms", "no_grad_fwd_ms"):
                if metric in floor:
                    row[metric.removesuffix("_ms") + "_vs_floor"] = row[metric] / floor[metric]
    return [rows[name] for name in impl_names if name in rows]
