"""The routed experts' gate/up forward kernel against cuBLAS's grouped GEMM of the same rows.

Run on the GPU: ``python benchmarks/experts_gate_up.py [--tokens N] [--reps N] [--commit SHA]``.
At each ``bench --experts`` shape (bf16, balanced routing), on x's rows grouped by expert: the
library's forward kernel with the SwiGLU in its epilogue (saving the factors, as ``save="factors"``
does) reading the gathered rows through TMA; the same kernel reading x's rows by index (what the
experts run); the gather followed by the kernel (what they ran before); ``torch._grouped_mm``
alone (the floor's GEMM); and ``torch._grouped_mm`` followed by the library's activation pass
writing the factors over the pre-activations (what a cuBLAS path would run instead). ``a`` of the
kernel is compared with the cuBLAS path's (relative difference) and with the kernel's by index
(which must be equal); all are timed in one loop, the order rotating between repetitions
(``do_bench`` medians), as ratios to ``torch._grouped_mm``.
"""

from __future__ import annotations

import argparse

import torch

from fused_swiglu.bench.experts import EXPERT_SHAPES, routing
from fused_swiglu.bench.measure import interleaved_medians
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.glu_activation import glu_activation
from fused_swiglu.kernels.glu_forward import glu_forward
from fused_swiglu.routing import route
from fused_swiglu.testing import relative_error

ONE = {"gate_multiplier": 1.0, "down_multiplier": 1.0}  # experts carry no multipliers


def variants(hidden: int, inter: int, experts: int, top_k: int, tokens: int) -> dict:
    index, _ = routing(tokens, experts, top_k, "balanced", "cuda")
    routes = route(index, experts)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    token_of_row = routes.tokens
    x_rows = x[token_of_row].contiguous()
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    gate_up /= hidden**0.5
    table = (routes.tiles, routes.used_tiles, experts)
    w_t = gate_up.transpose(1, 2)

    def kernel():
        return glu_forward(x_rows, gate_up, save=Saved.FACTORS, experts=table, **ONE)[0]

    def by_index():
        return glu_forward(x, gate_up, save=Saved.FACTORS, experts=table, row_index=token_of_row, **ONE)[0]

    def gather_and_kernel():
        return glu_forward(x[token_of_row], gate_up, save=Saved.FACTORS, experts=table, **ONE)[0]

    def gemm():
        return torch._grouped_mm(x_rows, w_t, offs=routes.ends)

    def gemm_and_pass():  # the factors over the pre-activations, as the kernel saves them
        return glu_activation(gemm(), factors_in_place=True, **ONE)

    return {
        "kernel": kernel,
        "by index": by_index,
        "gather + kernel": gather_and_kernel,
        "grouped_mm": gemm,
        "grouped_mm + activation": gemm_and_pass,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--commit")
    args = parser.parse_args()
    if start_gpu_log(args.commit, "experts_gate_up.py needs a CUDA GPU") is None:
        return
    columns = ("kernel", "by index", "gather + kernel", "grouped_mm + activation")
    print(f"{'shape':16s} {'grouped_mm ms':>14s} " + " ".join(f"{c:>12s}" for c in columns) + "  a rel. diff")
    for name, (hidden, inter, experts, top_k) in EXPERT_SHAPES.items():
        fns = variants(hidden, inter, experts, top_k, args.tokens)
        diff = relative_error(fns["kernel"]().float(), fns["grouped_mm + activation"]().float())
        if not torch.equal(fns["kernel"](), fns["by index"]()):
            raise SystemExit(f"{name}: the kernel by index differs from the kernel on the gathered rows")
        ms = interleaved_medians(fns, args.reps)
        floor = ms["grouped_mm"]
        ratios = " ".join(f"{ms[c] / floor:12.3f}" for c in columns)
        print(f"{name:16s} {floor:14.3f} {ratios} {diff:12.2e}", flush=True)


if __name__ == "__main__":
    main()
