"""The routed experts' backward kernel (dA = dy's rows times each expert's down weight, with the
SwiGLU gradient, the routing weights' gradient and ``a * w`` in its epilogue): the Triton kernel
and the warp-specialized one against the grouped GEMM alone.

Run on a Hopper GPU: ``python benchmarks/experts_backward_kernels.py [--shapes NAME ...]
[--tokens N] [--commit SHA]``. At each ``bench --experts`` shape (bf16, saved factors), balanced
and skewed routing: microseconds per call (``triton.testing.do_bench`` medians, the three
interleaved, three rounds, the median round), and each kernel over ``torch._grouped_mm`` on the
same grouped rows.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from fused_swiglu.bench.experts import EXPERT_SHAPES, ROUTINGS, routing
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.glu_backward import routed_glu_backward_
from fused_swiglu.kernels.glu_backward_ws import routed_glu_backward_ws_
from fused_swiglu.kernels.glu_forward import glu_forward
from fused_swiglu.routing import route

ROUNDS = 3


def calls(hidden, inter, experts, top_k, kind, tokens):
    """{name: call} on one routing: the grouped GEMM, the Triton kernel, the warp-specialized one."""
    device = torch.device("cuda")
    index, weights = routing(tokens, experts, top_k, kind, device)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, hidden, device=device, generator=g, dtype=torch.bfloat16)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=device, generator=g, dtype=torch.bfloat16)
    down = torch.randn(experts, hidden, inter, device=device, generator=g, dtype=torch.bfloat16)
    gate_up, down = gate_up / hidden**0.5, down / inter**0.5
    routes = route(index, experts)
    rows = routes.tokens.long()
    x_rows, dy_rows = x[rows].contiguous(), torch.randn_like(x)[rows].contiguous()
    w_rows = weights.reshape(-1)[routes.sources].contiguous()
    table = (routes.tiles, routes.used_tiles, experts)
    a, saved = glu_forward(
        x_rows, gate_up, save=Saved.FACTORS, experts=table, gate_multiplier=1.0, down_multiplier=1.0
    )
    args = (dy_rows, down, saved, a, w_rows, routes.tiles, routes.used_tiles)
    needs = {"need_row_grad": True, "write_scaled_a": True}
    # Each call overwrites the saved tensor and a: values drift over the repetitions, the work does not.
    return {
        "grouped_mm": lambda: torch._grouped_mm(dy_rows, down, offs=routes.ends),
        "triton": lambda: routed_glu_backward_(*args, save=Saved.FACTORS, **needs),
        "warp-specialized": lambda: routed_glu_backward_ws_(*args, **needs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=list(EXPERT_SHAPES), choices=EXPERT_SHAPES)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--commit")
    args = parser.parse_args()
    if start_gpu_log(args.commit, "needs a Hopper GPU: the warp-specialized kernel runs there only") is None:
        return
    header = ("shape", "routing", "grouped_mm us", "triton us", "ws us", "triton/mm", "ws/mm")
    print("{:16} {:9} {:>14} {:>10} {:>8} {:>10} {:>7}".format(*header))
    for name in args.shapes:
        for kind in ROUTINGS:
            fns = calls(*EXPERT_SHAPES[name], kind, args.tokens)
            rounds = {key: [] for key in fns}
            for _ in range(ROUNDS):
                for key, fn in fns.items():
                    rounds[key].append(triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3)
            us = {key: statistics.median(v) for key, v in rounds.items()}
            mm = us["grouped_mm"]
            print(
                f"{name:16} {kind:9} {mm:14.1f} {us['triton']:10.1f} {us['warp-specialized']:8.1f}"
                f" {us['triton'] / mm:10.3f} {us['warp-specialized'] / mm:7.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
