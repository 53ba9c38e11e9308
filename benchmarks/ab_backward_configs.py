"""A/B of backward-kernel tile configs inside the whole training step, interleaved in one process.

Run on the GPU: ``python benchmarks/ab_backward_configs.py --out ab.json``. For each shape and save
mode, every variant's fwd+bwd step is timed (``do_bench`` median) once per repetition, the variant
order rotating from one repetition to the next so that none always runs first; each variant's
result is the median over repetitions, reported with the six-GEMM floor timed in the same loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton

import fused_swiglu.kernels.glu_backward as glu_backward
from fused_swiglu.bench.impls import GemmFloor
from fused_swiglu.bench.measure import median_ms
from fused_swiglu.bench.run import SHAPES
from fused_swiglu.kernels.configs import TileConfig
from fused_swiglu.nn import SwiGLUMLP

C = TileConfig
VARIANTS = {
    "128x128 e2 flat": C(128, 128, 64, num_warps=8, num_stages=3, epilogue_split=2, flatten=True),
    "128x256 e4 flat": C(128, 256, 64, num_warps=8, num_stages=3, epilogue_split=4, flatten=True),
    "128x256 e4": C(128, 256, 64, num_warps=8, num_stages=3, epilogue_split=4),
}
DEFAULT_CONFIG = glu_backward.backward_config


def step_fn(module: SwiGLUMLP, x: torch.Tensor, dy: torch.Tensor, config: TileConfig | None):
    def step() -> None:
        glu_backward.backward_config = (lambda *a, **k: config) if config else DEFAULT_CONFIG
        module(x).backward(dy)

    return step


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--saves", nargs="*", default=["factors", "preact"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="ab.json")
    args = ap.parse_args()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    rows = []
    for shape in args.shapes:
        m, h, i = SHAPES[shape]
        torch.manual_seed(0)
        module = SwiGLUMLP(h, i, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        floor = GemmFloor(x, module.gate_up_proj, module.down_proj.weight, dy)
        params = [x, *module.parameters()]
        for save in args.saves:
            module.save = save
            fns = {"floor": floor.step} | {
                name: step_fn(module, x, dy, cfg) for name, cfg in (VARIANTS | {"default": None}).items()
            }
            for fn in fns.values():
                fn()  # compile outside the timed loop
            times: dict[str, list[float]] = {name: [] for name in fns}
            names = list(fns)
            for rep in range(args.reps):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    times[name].append(median_ms(fns[name], warmup=25, rep=200, grad_to_none=params))
            floor_ms = statistics.median(times["floor"])
            print(f"\n== {shape} M={m} H={h} I={i} save={save}: floor {floor_ms:.3f} ms", flush=True)
            for name, values in times.items():
                ms = statistics.median(values)
                rows.append(
                    {"shape": shape, "save": save, "variant": name, "ms": ms, "vs_floor": ms / floor_ms}
                )
                spread = f"{min(values):.3f}-{max(values):.3f}"
                print(f"  {name:<18} {ms:8.3f} ms  {ms / floor_ms:.3f}x floor  (reps {spread})")
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    glu_backward.backward_config = DEFAULT_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
