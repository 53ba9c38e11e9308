"""What one call of the library's ops costs the host, piece by piece, against the GEMM call a
compiled graph issues beside it.

Run on the GPU: ``python benchmarks/op_call_host_time.py [--rows N] [--commit SHA]``. Each case is
issued ``--calls`` times without waiting for the GPU (the host time per call; at the default 16 rows
the kernels are shorter than their launches), in rotating rounds, medians printed. Cases: the
``aten::mm`` call inductor's code makes (``mm`` with ``out=``); two ``torch.empty`` of the forward
op's outputs; a bare op defined as the library defines its ops (``torch.library.Library``, one
Python implementation) whose body only allocates those two outputs, which is the dispatcher's path
into Python plus the allocations; the forward and gradient ops through the dispatcher, and their
bodies called directly (the replayed launch plan, kernels/plans.py); inside the forward's replay, the
plan alone (no device check), each of its launches as bound, the checks before a direct launch, and
the compiled kernel's C launcher called with its arguments ready; a plan's signature alone. And the
weight-gradient GEMM of the backward three ways: fp32 written by cuBLAS (``mm`` with ``out_dtype``,
as the Functions issue it under autocast), bf16, and bf16 then copied into fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fused_swiglu.kernels.launch as launch
import fused_swiglu.ops as ops
from fused_swiglu.bench.measure import rotation
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.kernels.plans import signature

_PROBE = torch.library.Library("op_call_probe", "DEF")


def _bare(x2d, gate_up_weight, gate_multiplier, down_multiplier, save, u, v):
    m, two_inter = x2d.shape[0], gate_up_weight.shape[0]
    return torch.empty(m, two_inter // 2, dtype=x2d.dtype, device=x2d.device), torch.empty(
        m, two_inter, dtype=x2d.dtype, device=x2d.device
    )


_PROBE.define(
    "bare(Tensor x2d, Tensor gate_up_weight, float gate_multiplier, float down_multiplier, "
    "str save, Tensor? u, Tensor? v) -> (Tensor, Tensor)"
)
_PROBE.impl("bare", _bare, "CompositeExplicitAutograd")
bare_op = torch.ops.op_call_probe.bare.default


def cases(rows: int, hidden: int, inter: int) -> dict:
    torch.manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(rows, hidden, **bf16)
    gate_up = torch.randn(2 * inter, hidden, **bf16) * 0.02
    down = torch.randn(hidden, inter, **bf16) * 0.02
    a_out = torch.empty(rows, hidden, **bf16)
    a, saved = ops.glu_forward(x, gate_up, 1.0, 1.0, "factors", None, None)
    dy = torch.mm(a, down.t())
    forward_args = (x, gate_up, 1.0, 1.0, "factors", None, None)
    gradient_args = (dy, down, saved, 1.0, 1.0, "factors")
    gradient_body = ops._mlp_gradient_pass  # the planned body, past the once-only overwrite check
    planned_forward = ops._glu_forward.__wrapped__  # past the device check
    (plan,) = planned_forward.plans.values()
    tensors = [x, gate_up]
    pool = list(tensors)  # the call's tensors, then each allocation, as a replay makes it
    for step in plan.steps:
        if not isinstance(step, launch.BoundLaunch):
            step(pool)
    bound = [step for step in plan.steps if isinstance(step, launch.BoundLaunch)]
    first = bound[0]
    ready = first.arguments.copy()  # the C launcher's arguments, as the bound launch fills them
    ready[3] = launch._current_stream(0)
    for place, index in first.places:
        ready[place] = pool[index]
    for start, stop, index, descriptor in first.encoded:
        ready[start:stop] = descriptor.expand(pool[index])

    def c_launch():
        first.entry.launch(*ready)

    def launch_checks():
        launch._hooks_installed(), launch._runtime(), launch._current_device(), launch._current_stream(0)

    dw32 = torch.empty(2 * inter, hidden, device="cuda", dtype=torch.float32)
    dw16 = torch.empty(2 * inter, hidden, **bf16)

    def dw_bf16_then_fp32():
        torch.mm(saved.t(), x, out=dw16)
        dw32.copy_(dw16)

    return {
        "aten::mm (out=)": lambda: torch.mm(a, down.t(), out=a_out),
        "torch.empty x2": lambda: _bare(*forward_args),
        "bare op (dispatcher + 2 empty)": lambda: bare_op(*forward_args),
        "glu_forward op": lambda: ops.glu_forward(*forward_args),
        "glu_forward body (plan replay)": lambda: ops._glu_forward(*forward_args),
        "mlp_gradient body (plan replay)": lambda: gradient_body(*gradient_args),
        "forward plan alone": lambda: planned_forward(*forward_args),
        f"forward launches as bound (x{len(bound)})": lambda: [b(pool) for b in bound],
        "forward C launch alone": c_launch,
        "direct-launch checks": launch_checks,
        "dW GEMM, fp32 out_dtype": lambda: torch.mm(saved.t(), x, out_dtype=torch.float32, out=dw32),
        "dW GEMM, bf16": lambda: torch.mm(saved.t(), x, out=dw16),
        "dW GEMM, bf16 then into fp32": dw_bf16_then_fp32,
        "plan signature (forward)": lambda: signature(forward_args),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2816)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    if start_gpu_log(args.commit, "op_call_host_time.py needs a CUDA GPU") is None:
        return
    found = cases(args.rows, args.hidden, args.inter)
    names = list(found)
    for fn in found.values():
        for _ in range(50):  # plans recorded, caches and the allocator warm
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in rotation(names, round_):
            fn = found[name]
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
            torch.cuda.synchronize()
    print(f"rows {args.rows}, hidden {args.hidden}, intermediate {args.inter}; host us per call, "
          f"median (min-max) of {args.rounds} rounds of {args.calls} calls")  # fmt: skip
    for name in names:
        s = samples[name]
        print(f"{name:34s} {statistics.median(s):7.2f}  ({min(s):.2f}-{max(s):.2f})")


if __name__ == "__main__":
    main()
