"""Each warp-specialized (Gluon) kernel against the Triton kernel it replaces and the cuBLAS GEMM inside both.

Run on the GPU: ``python benchmarks/ws_kernels.py [--shapes NAME ...] [--reps N] [--out F] [--commit SHA]``.
Per benchmark shape (bf16): the forward for each save mode (GEMM: x @ W_packed^T) and the backward
for saved factors and pre-activations (GEMM: dY @ W_down; the saved tensor is restored by a copy
before each launch, and the copy's time is subtracted), the backward in each of its launch shapes
(cooperative; ping-pong for saved factors) whichever the library would pick there. Every kernel's
outputs are compared with the Triton kernel's (relative difference); then the GEMM and every kernel
of a family are timed in one loop, the order rotating between repetitions (``do_bench`` medians).
"""

from __future__ import annotations

import functools
import statistics
import sys

import per_shape
import torch

from fused_swiglu.bench.measure import median_ms, rotation
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.glu_backward import glu_backward_
from fused_swiglu.kernels.glu_backward_ws import CONFIGS, PING_PONG, glu_backward_ws_
from fused_swiglu.kernels.glu_forward import glu_forward
from fused_swiglu.kernels.glu_forward_ws import glu_forward_ws
from fused_swiglu.testing import make_problem, relative_error

MULTIPLIERS = {"gate_multiplier": 0.7, "down_multiplier": 1.3}


def forward_family(p, save: Saved):
    """(GEMM, {kernel: launch}, outputs of a launch, time to subtract) for the forward with this
    save mode."""
    kernels = {
        "triton": lambda: glu_forward(p.x, p.w_gate_up, save=save, **MULTIPLIERS),
        "warp-specialized": lambda: glu_forward_ws(p.x, p.w_gate_up, save=save, **MULTIPLIERS),
    }
    outputs = lambda fn: [t for t in fn() if t is not None]  # noqa: E731
    return (lambda: torch.mm(p.x, p.w_gate_up.t())), kernels, outputs, 0.0


def backward_family(p, save: Saved):
    _, pristine = glu_forward(p.x, p.w_gate_up, save=save, **MULTIPLIERS)
    work = pristine.clone()

    def restored(launch):
        def run():
            work.copy_(pristine)
            return launch(p.dy, p.w_down, work, save=save, **MULTIPLIERS)

        return run

    kernels = {"triton": restored(glu_backward_)}
    launches = {"cooperative": CONFIGS[save]} | ({"ping-pong": PING_PONG} if save == Saved.FACTORS else {})
    for label, config in launches.items():
        kernels[f"ws {label}"] = restored(functools.partial(glu_backward_ws_, config=config))

    def outputs(fn):
        recomputed = fn()
        return [work.clone()] + ([] if recomputed is None else [recomputed])

    copy_ms = statistics.median(median_ms(lambda: work.copy_(pristine), warmup=25, rep=100) for _ in range(3))
    return (lambda: torch.mm(p.dy, p.w_down)), kernels, outputs, copy_ms


def run_shape(name: str, shape: tuple[int, int, int], reps: int) -> list[dict]:
    m, hidden, inter = shape
    p = make_problem(m, hidden, inter, dtype=torch.bfloat16, device="cuda", seed=1)
    families = {f"forward {s.name}": forward_family(p, s) for s in Saved}
    families |= {f"backward {k.name}": backward_family(p, k) for k in (Saved.FACTORS, Saved.PREACT)}
    rows = []
    print(f"\n{name} (M={m}, H={hidden}, I={inter})", flush=True)
    for family, (gemm, kernels, outputs, copy_ms) in families.items():
        expected = outputs(kernels["triton"])
        diffs = {label: max(map(relative_error, outputs(fn), expected)) for label, fn in kernels.items()}
        fns = {"cuBLAS GEMM": gemm, **kernels}
        subtract = {"cuBLAS GEMM": 0.0} | dict.fromkeys(kernels, copy_ms)
        times: dict[str, list[float]] = {label: [] for label in fns}
        order = list(fns)
        for rep in range(reps):
            for label in rotation(order, rep):
                times[label].append(median_ms(fns[label], warmup=25, rep=100) - subtract[label])
        gemm_ms = statistics.median(times["cuBLAS GEMM"])
        print(f"  {family}: cuBLAS GEMM {gemm_ms:.3f} ms", flush=True)
        for label in kernels:
            ms = statistics.median(times[label])
            rows.append(
                {
                    "shape": name,
                    "family": family,
                    "kernel": label,
                    "ms": ms,
                    "gemm_ms": gemm_ms,
                    "vs_gemm": ms / gemm_ms,
                    "diff_vs_triton": diffs[label],
                }
            )
            print(
                f"    {label:<18} {ms:7.3f} ms  {ms / gemm_ms:.3f}x GEMM  diff vs triton {diffs[label]:.1e}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    sys.exit(per_shape.main(run_shape, "ws-kernels.json", __doc__.splitlines()[0]))
