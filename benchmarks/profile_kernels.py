"""Launch each fused kernel and the cuBLAS GEMM it replaces once, for Nsight Compute to profile.

Run on the GPU under ncu (counters need the Firecracker machines; leave the clocks alone)::

    ncu --clock-control none --profile-from-start off --csv --page details \\
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python benchmarks/profile_kernels.py [--shapes NAME ...] > profile.csv

Per shape, after a warm-up outside the profiled range: the training forward (factors), the
inference forward, the backward with factors and with pre-activations, and cuBLAS's x @ W_packed^T
and dY @ W_down, each launched once between ``cudaProfilerStart`` and ``cudaProfilerStop``. ncu
replays every kernel and restores the memory it writes, so the in-place backward is profiled on
the same input in every pass. Prints which kernel is which, in launch order, so the CSV rows can
be matched to them.
"""

from __future__ import annotations

import argparse

import torch

from fused_swiglu.bench.run import SHAPES
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.glu_backward import glu_backward_
from fused_swiglu.kernels.glu_forward import glu_forward
from fused_swiglu.testing import make_problem


def launches(m: int, h: int, i: int) -> dict:
    p = make_problem(m, h, i, dtype=torch.bfloat16, device="cuda", seed=1)
    w = p.w_gate_up.contiguous()
    multipliers = {"gate_multiplier": 1.0, "down_multiplier": 1.0}
    _, factors = glu_forward(p.x, w, save=Saved.FACTORS, **multipliers)
    _, preact = glu_forward(p.x, w, save=Saved.PREACT, **multipliers)
    return {
        "forward factors": lambda: glu_forward(p.x, w, save=Saved.FACTORS, **multipliers),
        "forward inference": lambda: glu_forward(p.x, w, save=Saved.NOTHING, **multipliers),
        "cuBLAS x @ W_packed^T": lambda: torch.mm(p.x, w.t()),
        "backward factors": lambda: glu_backward_(p.dy, p.w_down, factors, save=Saved.FACTORS, **multipliers),
        "backward preact": lambda: glu_backward_(p.dy, p.w_down, preact, save=Saved.PREACT, **multipliers),
        "cuBLAS dY @ W_down": lambda: torch.mm(p.dy, p.w_down),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["llama3-8b", "qwen2.5-0.5b"], choices=list(SHAPES))
    args = ap.parse_args()
    order = []
    for name in args.shapes:
        fns = launches(*SHAPES[name])
        for fn in fns.values():  # compile and warm up outside the profiled range
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for label, fn in fns.items():
            fn()
            order.append(f"{name}: {label}")
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print("# launch order (the backward runs are in place, on the warm-up's output):")
    for k, label in enumerate(order):
        print(f"# {k}: {label}")


if __name__ == "__main__":
    main()
