"""A/B of the recompute backward in one piece and in ``RECOMPUTE_PIECES``, inside the training step.

Run on the GPU: ``python benchmarks/ab_recompute_pieces.py --out ab.json``. For each MLP shape, and
the GLU operator at (11136, 3584, 14336), the ``save="recompute"`` step is timed with the factors
recomputed whole and in pieces (``do_bench`` median per repetition, the order rotating between
repetitions, the six-GEMM or three-GEMM floor timed in the same loop), and the extra peak memory
of one step is taken for each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
from triton.testing import do_bench

import fused_swiglu.autograd as autograd_mod
from fused_swiglu.bench.glu import GLUFloor
from fused_swiglu.bench.impls import GemmFloor
from fused_swiglu.bench.run import SHAPES
from fused_swiglu.nn import SwiGLULinear, SwiGLUMLP

PIECES = {"whole": 1, "pieces": autograd_mod.RECOMPUTE_PIECES}
GLU_SHAPE = (11136, 3584, 14336)


def with_pieces(pieces: int, step):
    def run() -> None:
        autograd_mod.RECOMPUTE_PIECES = pieces
        step()

    return run


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def problems():
    """(label, floor step, fused step, leaves) per shape: the MLP shapes, then the GLU operator."""
    for name, (m, h, i) in SHAPES.items():
        torch.manual_seed(0)
        module = SwiGLUMLP(h, i, save="recompute", device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        floor = GemmFloor(x, module.gate_up_proj, module.down_proj.weight, dy)
        yield (
            f"mlp {name}",
            floor.step,
            lambda module=module, x=x, dy=dy: module(x).backward(dy),
            [x, *module.parameters()],
        )
    m, h, i = GLU_SHAPE
    torch.manual_seed(0)
    glu = SwiGLULinear(h, i, save="recompute", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    da = torch.randn(m, i, device="cuda", dtype=torch.bfloat16)
    floor = GLUFloor(x, glu.gate_up_proj.detach())
    yield "glu M11136-H3584-I14336", floor.step, lambda: glu(x).backward(da), [x, glu.gate_up_proj]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="ab.json")
    args = ap.parse_args()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    rows = []
    default = autograd_mod.RECOMPUTE_PIECES
    for label, floor_step, step, leaves in problems():
        fns = {"floor": floor_step} | {name: with_pieces(n, step) for name, n in PIECES.items()}
        peaks = {name: peak_mib(fn) for name, fn in fns.items() if name != "floor"}
        times: dict[str, list[float]] = {name: [] for name in fns}
        names = list(fns)
        for rep in range(args.reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                times[name].append(do_bench(fns[name], warmup=25, rep=200, grad_to_none=leaves))
        floor_ms = statistics.median(times["floor"])
        print(f"\n== {label}: floor {floor_ms:.3f} ms", flush=True)
        for name, values in times.items():
            ms = statistics.median(values)
            peak = peaks.get(name)
            rows.append(
                {"problem": label, "variant": name, "ms": ms, "vs_floor": ms / floor_ms, "peak_mib": peak}
            )
            peak_text = "" if peak is None else f"  peak +{peak:.0f} MiB"
            print(f"  {name:<8} {ms:8.3f} ms  {ms / floor_ms:.3f}x floor{peak_text}", flush=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    autograd_mod.RECOMPUTE_PIECES = default
    return 0


if __name__ == "__main__":
    sys.exit(main())
