"""The routed experts' weight-gradient GEMMs: the library's kernel reading rows by index against
cuBLAS's grouped GEMM on gathered rows.

Run on the GPU: ``python benchmarks/experts_weight_grad.py [--tokens N] [--reps N] [--configs ...]
[--commit SHA]``. At each ``bench --experts`` shape (bf16, balanced routing), the two weight
gradients of a step: the packed dW = [dU | dG]^T @ x's rows (x read by index, each row's token)
and dW_down = dy's rows^T @ (a * w) (dy read by index). Timed side by side (``do_bench`` medians,
the order rotating between repetitions), as ratios to ``torch._grouped_mm`` on rows gathered
beforehand (the floor's GEMM): the gather followed by ``torch._grouped_mm`` (what the experts
ran before), and the kernel by index in each tile configuration (BM, BN, BK, warps, stages). Each
kernel's output is compared with cuBLAS's (relative difference).
"""

from __future__ import annotations

import argparse

import torch

from fused_swiglu.bench.experts import EXPERT_SHAPES, routing
from fused_swiglu.bench.measure import interleaved_medians
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.kernels.weight_grad import grouped_weight_grad
from fused_swiglu.routing import route
from fused_swiglu.testing import relative_error

CONFIGS = ["128,128,64,8,4", "128,128,64,4,4", "128,256,64,8,3", "256,128,64,8,3", "128,128,32,4,5"]


def variants(hidden, inter, experts, top_k, tokens, configs) -> dict[str, dict]:
    index, _ = routing(tokens, experts, top_k, "balanced", "cuda")
    routes = route(index, experts)
    token_of_row = (routes.sources // top_k).int()
    rows = token_of_row.shape[0]
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    x, dy = randn(tokens, hidden), randn(tokens, hidden)
    grad, scaled_a = randn(rows, 2 * inter), randn(rows, inter)
    x_rows, dy_rows, ends = x[token_of_row], dy[token_of_row], routes.ends
    gemms = {
        "packed dW": {
            "grouped_mm": lambda: torch._grouped_mm(grad.t(), x_rows, offs=ends),
            "gather + grouped_mm": lambda: torch._grouped_mm(grad.t(), x[token_of_row], offs=ends),
        },
        "dW_down": {
            "grouped_mm": lambda: torch._grouped_mm(dy_rows.t(), scaled_a, offs=ends),
            "gather + grouped_mm": lambda: torch._grouped_mm(dy[token_of_row].t(), scaled_a, offs=ends),
        },
    }
    for config in configs:
        c = tuple(int(v) for v in config.split(","))
        gemms["packed dW"][config] = lambda c=c: grouped_weight_grad(
            grad, x, ends, right_index=token_of_row, config=c
        )
        gemms["dW_down"][config] = lambda c=c: grouped_weight_grad(
            dy, scaled_a, ends, left_index=token_of_row, config=c
        )
    return gemms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--configs", nargs="*", default=CONFIGS)
    parser.add_argument("--shapes", nargs="*", default=list(EXPERT_SHAPES), choices=EXPERT_SHAPES)
    parser.add_argument("--commit")
    args = parser.parse_args()
    if start_gpu_log(args.commit, "experts_weight_grad.py needs a CUDA GPU") is None:
        return
    for name in args.shapes:
        for gemm, fns in variants(*EXPERT_SHAPES[name], args.tokens, args.configs).items():
            want = fns["grouped_mm"]().float()
            diffs = {c: relative_error(fns[c]().float(), want) for c in args.configs}
            ms = interleaved_medians(fns, args.reps)
            floor = ms["grouped_mm"]
            print(f"{name} {gemm}: grouped_mm {floor:.3f} ms", flush=True)
            for variant, t in ms.items():
                diff = f"  rel. diff {diffs[variant]:.2e}" if variant in diffs else ""
                print(f"  {variant:20s} {t / floor:6.3f}{diff}", flush=True)


if __name__ == "__main__":
    main()
