"""Does the GEMM floor time the same on its random stand-ins as on a real step's tensors?

Run on the GPU: ``python benchmarks/floor_data.py [--shapes ...] --out floor_data.json``.

The floor (``GemmFloor``) feeds its backward GEMMs random normal tensors where a real step has
``a = silu(g) * u`` and the packed ``grad_de``. At the power cap a GEMM's speed depends on how much
power its operands make the multipliers draw, so the data could move the floor, and with it every
ratio to it. Here one fused step (saved factors) runs first; its ``a`` and its ``grad_de`` (the
saved tensor, overwritten in place by the backward) replace the stand-ins in a second floor. Both
floors' steps and each of their backward-side GEMMs are timed, interleaved (``do_bench`` medians).
The gate/up GEMM is left out: it reads the same ``x`` and weight in both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from fused_swiglu import SwiGLUMLP
from fused_swiglu.bench.impls import GemmFloor
from fused_swiglu.bench.measure import median_ms
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.bench.run import add_shape_arguments, chosen_shapes

#: The floor's GEMMs that read a stand-in tensor, as in ``GemmFloor.step``.
GEMMS = {
    "down fwd": lambda f: torch.mm(f.a, f.w_down.t(), out=f.y),
    "dY @ W_down": lambda f: torch.mm(f.dy, f.w_down, out=f.da),
    "dW_down": lambda f: torch.mm(f.dy.t(), f.a, out=f.dw_down),
    "dX": lambda f: torch.mm(f.gate_up, f.w_gate_up, out=f.dx),
    "dW_gate_up": lambda f: torch.mm(f.gate_up.t(), f.x, out=f.dw_gate_up),
}


def function_node(out: torch.Tensor):
    """The library's autograd node behind ``out`` (past the reshapes the module adds)."""
    node = out.grad_fn
    while "SwiGLUMLPFunction" not in type(node).__name__:
        node = node.next_functions[0][0]
    return node


def real_tensors(module: SwiGLUMLP, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and the packed ``grad_de`` of one fused training step with saved factors."""
    out = module(x)
    saved = function_node(out).saved_tensors  # (x, w_gate_up, w_down, packed factors, a)
    packed, a = saved[3], saved[4].clone()  # the backward releases a's storage
    out.backward(dy)
    return a, packed


def describe(t: torch.Tensor) -> str:
    f = t.float()
    return f"std {f.std():.3g}, |v| < 1e-3: {(f.abs() < 1e-3).float().mean():.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(ap)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="floor_data.json")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    args = ap.parse_args()
    meta = start_gpu_log(args.commit, "floor_data needs a CUDA GPU")
    if meta is None:
        return 1
    rows = []
    for shape, (m, hidden, inter) in chosen_shapes(args).items():
        torch.manual_seed(0)
        module = SwiGLUMLP(hidden, inter, save="factors", device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        a, grad_de = real_tensors(module, x, dy)
        floors = {
            "random": GemmFloor(x, module.gate_up_proj, module.down_proj.weight, dy),
            "real": GemmFloor(x, module.gate_up_proj, module.down_proj.weight, dy),
        }
        floors["real"].a, floors["real"].gate_up = a, grad_de
        print(f"\n== {shape}: real a {describe(a)}; real grad_de {describe(grad_de)}")
        times: dict[tuple[str, str], list[float]] = {}
        for rep in range(args.reps):
            for kind in ("random", "real") if rep % 2 == 0 else ("real", "random"):
                f = floors[kind]
                times.setdefault(("step", kind), []).append(median_ms(f.step, warmup=10, rep=100))
                for gemm, fn in GEMMS.items():
                    t = median_ms(lambda fn=fn, f=f: fn(f), warmup=5, rep=40)
                    times.setdefault((gemm, kind), []).append(t)
        ms = {key: statistics.median(v) for key, v in times.items()}
        print(f"  {'':<12} {'random ms':>10} {'real ms':>10} {'real/random':>12}")
        for what in ("step", *GEMMS):
            rnd, real = ms[(what, "random")], ms[(what, "real")]
            print(f"  {what:<12} {rnd:10.4f} {real:10.4f} {real / rnd:12.4f}", flush=True)
            rows.append({"shape": shape, "what": what, "random_ms": rnd, "real_ms": real})
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        del module, x, dy, a, grad_de, floors
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
