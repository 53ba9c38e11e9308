"""Configs of the warp-specialized backward kernel against the Triton kernel and cuBLAS's dY @ W_down.

Run on the GPU: ``python benchmarks/sweep_ws_backward.py [--shapes NAME ...] [--reps N] [--out F]
[--shape M H I] [--commit SHA]``. For each shape (bf16), every launch shape below (cooperative and
ping-pong) and the Triton kernel overwrite the same saved factors (restored by a copy before each
launch, whose time is subtracted); each is checked against the float64 gradient of those factors,
then all are timed in one loop with the order rotating between repetitions (``do_bench`` medians),
next to the GEMM they replace.
"""

from __future__ import annotations

import statistics
import sys

import per_shape
import torch

from fused_swiglu.bench.measure import median_ms, rotation
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.glu_backward import glu_backward_
from fused_swiglu.kernels.glu_backward_ws import (
    CONFIGS,
    PING_PONG,
    PingPongConfig,
    WSConfig,
    glu_backward_ws_,
)
from fused_swiglu.kernels.glu_forward import glu_forward
from fused_swiglu.layout import CHUNK
from fused_swiglu.testing import make_problem, relative_error

SWEPT = {
    "cooperative": CONFIGS[Saved.FACTORS],
    "ping-pong": PING_PONG,
    "ping-pong, group 16": PingPongConfig(group_m=16),
    "ping-pong, [64, 256] tiles": PingPongConfig(
        block_m=64, block_n=256, stages=4, pieces=16, saved_buffers=6
    ),
    "pieces 8, buffers 4": WSConfig(pieces=8, saved_buffers=4),
    "pieces 8, buffers 4, lag 2": WSConfig(pieces=8, saved_buffers=4, store_lag=2),
    "pieces 16, buffers 8, lag 3": WSConfig(store_lag=3),
    "pieces 16, buffers 4, 4 stages": WSConfig(saved_buffers=4, stages=4),
    "pieces 4, buffers 2": WSConfig(pieces=4, saved_buffers=2),
}


def run_shape(name: str, shape: tuple[int, int, int], reps: int) -> list[dict]:
    m, hidden, inter = shape
    p = make_problem(m, hidden, inter, dtype=torch.bfloat16, device="cuda", seed=1)
    _, pristine = glu_forward(p.x, p.w_gate_up, gate_multiplier=1.0, down_multiplier=1.0, save=Saved.FACTORS)
    da = p.dy.double() @ p.w_down.double()
    exact = (pristine.double().view(m, -1, 2, CHUNK) * da.view(m, -1, 1, CHUNK)).view(m, 2 * inter)
    work = pristine.clone()
    fns = {
        "triton": lambda: glu_backward_(
            p.dy, p.w_down, work, gate_multiplier=1.0, down_multiplier=1.0, save=Saved.FACTORS
        )
    }
    fns |= {
        label: (
            lambda c=c: glu_backward_ws_(
                p.dy, p.w_down, work, save=Saved.FACTORS, gate_multiplier=1.0, down_multiplier=1.0, config=c
            )
        )
        for label, c in SWEPT.items()
    }
    errors = {}
    for label, fn in fns.items():
        work.copy_(pristine)
        fn()
        errors[label] = relative_error(work, exact)
    copy_ms = statistics.median(median_ms(lambda: work.copy_(pristine), warmup=25, rep=100) for _ in range(3))
    gemm_ms = statistics.median(
        median_ms(lambda: torch.mm(p.dy, p.w_down), warmup=25, rep=100) for _ in range(3)
    )
    times: dict[str, list[float]] = {label: [] for label in fns}
    order = list(fns)
    for rep in range(reps):
        for label in rotation(order, rep):
            restore_and_run = lambda fn=fns[label]: (work.copy_(pristine), fn())  # noqa: E731
            times[label].append(median_ms(restore_and_run, warmup=25, rep=100) - copy_ms)
    print(f"\n{name} (M={m}, H={hidden}, I={inter}): cuBLAS dY @ W_down {gemm_ms:.3f} ms", flush=True)
    rows = []
    for label, values in times.items():
        ms = statistics.median(values)
        rows.append(
            {"shape": name, "kernel": label, "ms": ms, "vs_cublas": ms / gemm_ms, "rel_err": errors[label]}
        )
        print(f"  {label:<34} {ms:7.3f} ms  {ms / gemm_ms:.3f}x cuBLAS  err {errors[label]:.1e}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(per_shape.main(run_shape, "sweep-ws-backward.json", __doc__.splitlines()[0]))
