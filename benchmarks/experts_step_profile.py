"""Where the routed experts' training step spends its GPU time, kernel by kernel, against the floor's.

Run on the GPU: ``python benchmarks/experts_step_profile.py [--shapes NAME ...] [--impls fused ...]
[--steps N] [--commit SHA]``. At each ``bench --experts`` shape (bf16, 8192 tokens, balanced
routing), the steps of ``bench --experts`` (the floor's six grouped GEMMs, ``SwiGLUExperts`` in its
save modes) run ``--steps`` times under ``torch.profiler`` after a warm-up; printed per step: each
kernel's calls and GPU microseconds (largest first), the sum of kernel time and the step's wall
time between its first and last kernel (their difference is time the GPU sat idle within a step),
and the longest idle stretches by the kernels on either side of them.
"""

from __future__ import annotations

import argparse
import collections
import itertools

import torch
from torch.profiler import ProfilerActivity, profile

from fused_swiglu.bench.experts import EXPERT_SHAPES, build_step, routing
from fused_swiglu.bench.report import start_gpu_log


def kernel_times(step, params, steps: int) -> tuple[list, list, float, float]:
    """(name, calls per step, us per step) largest first; (kernel before, kernel after, idle us per
    step) largest first; kernel us per step; wall us per step."""
    for _ in range(3):
        step()
        for p in params:
            p.grad = None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
            for p in params:
                p.grad = None
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in kernels if not e.name.startswith(("Memset", "Memcpy"))] or kernels
    calls, us = collections.Counter(), collections.Counter()
    for e in kernels:
        calls[e.name] += 1
        us[e.name] += e.time_range.elapsed_us()
    rows = sorted(((n, calls[n] / steps, us[n] / steps) for n in us), key=lambda r: -r[2])
    idle = collections.Counter()
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    for before, after in itertools.pairwise(ordered):
        idle[before.name, after.name] += max(0, after.time_range.start - before.time_range.end)
    gaps = sorted(((b, a, t / steps) for (b, a), t in idle.items()), key=lambda r: -r[2])
    span = ordered[-1].time_range.end - ordered[0].time_range.start
    return rows, gaps, sum(us.values()) / steps, span / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shapes = ["qwen3-30b-a3b", "olmoe-1b-7b"]
    parser.add_argument("--shapes", nargs="*", default=shapes, choices=EXPERT_SHAPES)
    parser.add_argument("--impls", nargs="*", default=["fused"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--commit")
    args = parser.parse_args()
    if start_gpu_log(args.commit, "experts_step_profile.py needs a CUDA GPU") is None:
        return
    for name in args.shapes:
        hidden, inter, experts, top_k = EXPERT_SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(1)
        dtype = torch.bfloat16
        x = torch.randn(args.tokens, hidden, device="cuda", dtype=dtype, generator=g).requires_grad_()
        index, weights = routing(args.tokens, experts, top_k, "balanced", "cuda")
        weights.requires_grad_()
        gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dtype, generator=g)
        down = torch.randn(experts, hidden, inter, device="cuda", dtype=dtype, generator=g)
        gate_up, down = gate_up * hidden**-0.5, down * inter**-0.5
        dy = torch.randn(args.tokens, hidden, device="cuda", dtype=dtype, generator=g)
        for impl in ["floor", *args.impls]:
            step, _, params = build_step(impl, x, index, weights, gate_up, down, dy)
            rows, gaps, busy, wall = kernel_times(step, params, args.steps)
            print(f"\n{name} {impl}: kernels {busy:.0f} us per step, first to last kernel {wall:.0f} us")
            print(f"  {'us':>8s} {'calls':>6s}  kernel")
            for kernel, calls, us in rows:
                print(f"  {us:8.1f} {calls:6.1f}  {kernel[:110]}")
            print(f"  {'idle us':>8s}  between")
            for before, after, us in gaps[:8]:
                print(f"  {us:8.1f}  {before[:60]}  ->  {after[:60]}")


if __name__ == "__main__":
    main()
