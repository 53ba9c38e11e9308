"""The routed experts' backward kernel per tile config, against cuBLAS's grouped GEMM it replaces.

Run on the GPU: ``python benchmarks/experts_backward_tiles.py [--tokens N] [--reps N] [--commit SHA]``.
At each ``bench --experts`` shape (bf16, balanced routing), on dy's rows grouped by expert: the
routed backward kernel (kernels/glu_backward.py, saved factors; the routing weights' gradient and
``a * w`` written) with each candidate tile, and ``torch._grouped_mm`` of dy's rows and the down
weights alone, the GEMM the kernel does before its epilogue. The kernel replaces that GEMM and two
passes over [slots, I] (the routing weights' gradient with the scalings, then the SwiGLU gradient).
The kernel works in place, so repeated calls read gradients where it expects factors: the times
are the launches', the values are not checked here (tests/test_experts.py checks them).
"""

from __future__ import annotations

import argparse

import torch

from fused_swiglu.bench.experts import EXPERT_SHAPES, routing
from fused_swiglu.bench.measure import interleaved_medians
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.experts.routing import route
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.configs import TileConfig, backward_config
from fused_swiglu.kernels.glu_backward import routed_glu_backward_
from fused_swiglu.kernels.glu_forward import glu_forward

CANDIDATES = {
    "128x256 s3 e4": TileConfig(128, 256, 64, num_warps=8, num_stages=3, epilogue_split=4),
    "128x128 s4 e4": TileConfig(128, 128, 64, num_warps=8, num_stages=4, epilogue_split=4),
    "128x128 s3 e4": TileConfig(128, 128, 64, num_warps=8, num_stages=3, epilogue_split=4),
    "64x256 s4 e4": TileConfig(64, 256, 64, num_warps=8, num_stages=4, epilogue_split=4),
}


def variants(hidden: int, inter: int, experts: int, top_k: int, tokens: int) -> dict:
    index, _ = routing(tokens, experts, top_k, "balanced", "cuda")
    routes = route(index, experts)
    rows = tokens * top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    x_rows, dy_rows = torch.randn(rows, hidden, **bf16), torch.randn(rows, hidden, **bf16)
    gate_up = torch.randn(experts, 2 * inter, hidden, **bf16) / hidden**0.5
    down = torch.randn(experts, hidden, inter, **bf16) / inter**0.5
    w_rows = torch.rand(rows, device="cuda", generator=g)
    table = (routes.tiles, routes.used_tiles, experts)
    a, factors = glu_forward(
        x_rows, gate_up, save=Saved.FACTORS, experts=table, gate_multiplier=1.0, down_multiplier=1.0
    )

    def kernel(config):
        return lambda: routed_glu_backward_(
            dy_rows,
            down,
            factors,
            a,
            w_rows,
            routes.tiles,
            routes.used_tiles,
            save=Saved.FACTORS,
            need_row_grad=True,
            write_scaled_a=True,
            config=config,
        )

    fns = {"grouped_mm": lambda: torch._grouped_mm(dy_rows, down, offs=routes.ends)}
    return fns | {name: kernel(config) for name, config in CANDIDATES.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--commit")
    args = parser.parse_args()
    if start_gpu_log(args.commit, "experts_backward_tiles.py needs a CUDA GPU") is None:
        return
    header = " ".join(f"{n:>14s}" for n in CANDIDATES)
    print(f"{'shape':16s} {'grouped_mm ms':>14s} {header}  (x grouped_mm)")
    for name, (hidden, inter, experts, top_k) in EXPERT_SHAPES.items():
        rows = args.tokens * top_k
        chosen = backward_config(rows, hidden, inter, torch.bfloat16, True, Saved.FACTORS, routed=True)
        fns = variants(hidden, inter, experts, top_k, args.tokens)
        ms = interleaved_medians(fns, args.reps)
        ratios = " ".join(f"{ms[n] / ms['grouped_mm']:14.3f}" for n in CANDIDATES)
        print(f"{name:16s} {ms['grouped_mm']:14.3f} {ratios}  library: {chosen}", flush=True)


if __name__ == "__main__":
    main()
