"""The routed rows' gather (x's and dy's rows in the experts' backward): the combine kernel with one
row per output against indexing, alone and in the training step.

Run on a Hopper GPU: ``python benchmarks/experts_gather.py [--shapes NAME ...] [--tokens N]
[--commit SHA]``. At each ``bench --experts`` shape (bf16), balanced and skewed routing: the gather
alone (microseconds and TB/s written, for indexing and for the kernel at several blocks, checked
equal to indexing), then the fused step (``save="factors"``) with the gathers by the kernel and by
indexing, beside the floor; ``triton.testing.do_bench`` medians, interleaved, five rounds, the
median round, and whether both give bit-identical gradients.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

import fused_swiglu.experts as experts_module
import fused_swiglu.experts_ops as ops_module
from fused_swiglu.bench.experts import EXPERT_SHAPES, ROUTINGS, build_step, routing
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.kernels import combine as combine_module
from fused_swiglu.kernels.common import cdiv
from fused_swiglu.routing import route

ROUNDS = 5
#: (tokens, columns, warps) of the blocks tried for the gather.
BLOCKS = [
    (*combine_module.GPU_BLOCK, 4),
    (16, 256, 4),
    (32, 256, 4),
    (32, 256, 8),
    (16, 512, 4),
]
GATHERED, COMBINE_OP = ops_module._gathered, experts_module.experts_combine


def kernel_gather(src, rows, block_t, block_h, warps):
    out = torch.empty(rows.numel(), src.shape[1], dtype=src.dtype, device=src.device)
    grid = (cdiv(rows.numel(), block_t), cdiv(src.shape[1], block_h))
    combine_module._launch_combine(
        grid, src, rows, rows, out, rows.numel(), src.shape[1], src.stride(0), out.stride(0),
        K=1, WEIGHTED=False, BT=block_t, BH=block_h, num_warps=warps,
    )  # fmt: skip
    return out


def median_rounds(calls: dict) -> dict:
    """{name: (median, min, max) over ROUNDS rounds of do_bench medians, the calls interleaved}."""
    times = {name: [] for name in calls}
    for r in range(ROUNDS):
        for name in list(calls)[r % len(calls) :] + list(calls)[: r % len(calls)]:
            fn, params = calls[name]
            times[name].append(triton.testing.do_bench(fn, grad_to_none=params, return_mode="median"))
    return {name: (statistics.median(t), min(t), max(t)) for name, t in times.items()}


def gathers_by_indexing(on: bool) -> None:
    """The experts' gathers (the ops' helper and the backward's gather of dy) by indexing, or back."""
    if on:
        ops_module._gathered = lambda t, r: t[r]
        experts_module.experts_combine = lambda t, r, k, w: (
            t[r] if k == 1 and w is None else COMBINE_OP(t, r, k, w)
        )
    else:
        ops_module._gathered, experts_module.experts_combine = GATHERED, COMBINE_OP


def gather_alone(label: str, x: torch.Tensor, rows: torch.Tensor) -> None:
    want = x[rows]
    calls = {"indexing": (lambda: x[rows], None)}
    for block in BLOCKS:
        assert torch.equal(kernel_gather(x, rows, *block), want), block
        calls["kernel " + "x".join(map(str, block))] = (lambda b=block: kernel_gather(x, rows, *b), None)
    written = want.numel() * want.element_size() / 1e6  # MB
    for call, (ms, lo, hi) in median_rounds(calls).items():
        us = ms * 1e3
        print(
            f"{label} gather {tuple(want.shape)} {call:18s} {us:7.1f} us "
            f"({lo * 1e3:.1f}-{hi * 1e3:.1f}), {written / us:.2f} TB/s written"
        )


def step_side_by_side(label: str, x, index, weights, gate_up, down, dy) -> None:
    floor, _, _ = build_step("floor", x, index, weights, gate_up, down, dy)
    step, _, params = build_step("fused", x, index, weights, gate_up, down, dy)
    grads = []
    for by_indexing in (False, True):
        gathers_by_indexing(by_indexing)
        step()
        grads.append([p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    same = all(torch.equal(a, b) for a, b in zip(*grads, strict=True))

    def with_gathers(by_indexing: bool) -> None:
        gathers_by_indexing(by_indexing)
        step()

    calls = {
        "floor": (floor, None),
        "fused, kernel gathers": (lambda: with_gathers(False), params),
        "fused, indexed gathers": (lambda: with_gathers(True), params),
    }
    result = median_rounds(calls)
    gathers_by_indexing(False)
    for call, (ms, lo, hi) in result.items():
        print(f"{label} step {call:24s} {ms:.3f} ms ({lo:.3f}-{hi:.3f})")
    kernel, indexed = result["fused, kernel gathers"][0], result["fused, indexed gathers"][0]
    print(
        f"{label} step: kernel / indexed gathers {kernel / indexed:.4f}, kernel gathers "
        f"{kernel / result['floor'][0]:.3f}x floor; gradients bit-identical: {same}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=list(EXPERT_SHAPES), choices=EXPERT_SHAPES)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--commit")
    args = parser.parse_args()
    if start_gpu_log(args.commit, "experts_gather.py needs a CUDA GPU") is None:
        return
    device = torch.device("cuda")
    for name in args.shapes:
        hidden, inter, experts, top_k = EXPERT_SHAPES[name]
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(args.tokens, hidden, device=device, generator=g, dtype=torch.bfloat16)
        gate_up = torch.randn(experts, 2 * inter, hidden, device=device, generator=g, dtype=x.dtype)
        down = torch.randn(experts, hidden, inter, device=device, generator=g, dtype=x.dtype)
        gate_up, down = gate_up * hidden**-0.5, down * inter**-0.5
        dy = torch.randn_like(x)
        for kind in ROUTINGS:
            index, weights = routing(args.tokens, experts, top_k, kind, device)
            gather_alone(f"{name} {kind}", x, route(index, experts).tokens)
            leaf = x.detach().requires_grad_()
            step_side_by_side(f"{name} {kind}", leaf, index, weights.requires_grad_(), gate_up, down, dy)


if __name__ == "__main__":
    main()
