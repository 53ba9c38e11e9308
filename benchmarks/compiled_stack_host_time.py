"""Is a compiled fused MLP layer's host time per training call above stock's, per layer or per call?

Run on the GPU: ``python benchmarks/compiled_stack_host_time.py [--rows N] [--layers 1,4]``. Stacks of
``x + mlp(x)`` layers (transformers' ``LlamaMLP`` as written, and the same weights swapped into
``SwiGLUMLP``), each stack one ``torch.compile`` graph, fp32 weights under bf16 autocast; a training
call is the forward, ``sum().backward()`` and the gradients set to None. At a few rows the GPU waits
for the host, so wall time per call is host time. Stacks of two depths separate what a layer costs
from what a compiled call costs whatever its depth. In rotating rounds, medians; then torch.profiler's
host operators for the shallowest stack of each kind.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
from torch.profiler import ProfilerActivity, profile

from fused_swiglu.bench.impls import EagerSwiGLUMLP, ResidualMLPs
from fused_swiglu.bench.measure import rotation
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.nn import SwiGLUMLP


def _own_code(cls: type) -> type:
    """A subclass whose ``forward`` has a code object of its own: Dynamo keeps one cache per code
    object, and stacks sharing one would each look up the others' compiled entries on every call."""
    forward = types.FunctionType(cls.forward.__code__.replace(), cls.forward.__globals__, "forward")
    return type(cls.__name__, (cls,), {"forward": forward})


def _stack(kind: str, layers: int, hidden: int, inter: int):
    stock = [EagerSwiGLUMLP(hidden, inter, device="cuda") for _ in range(layers)]
    mlps = stock if kind == "stock" else [SwiGLUMLP.from_mlp(m) for m in stock]
    return torch.compile(_own_code(ResidualMLPs)(mlps), dynamic=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2816)
    parser.add_argument("--layers", default="1,4", help="stack depths, comma-separated")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    if start_gpu_log(args.commit, "compiled_stack_host_time.py needs a CUDA GPU") is None:
        return
    torch.manual_seed(0)
    depths = [int(d) for d in args.layers.split(",")]
    stacks = {f"{k} x{d}": _stack(k, d, args.hidden, args.inter) for d in depths for k in ("stock", "fused")}
    x = torch.randn(args.rows, args.hidden, device="cuda", requires_grad=True)

    def call(stack) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = stack(x)
        y.sum().backward()
        x.grad = None
        for p in stack.parameters():
            p.grad = None

    for stack in stacks.values():
        for _ in range(5):  # compiles, plans, the allocator's steady state
            call(stack)
    torch.cuda.synchronize()
    names = list(stacks)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in rotation(names, round_):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.calls):
                call(stacks[name])
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"rows {args.rows}, hidden {args.hidden}, intermediate {args.inter}; us per training call, "
          f"median (min-max) of {args.rounds} rounds of {args.calls} calls")  # fmt: skip
    for name in names:
        s = samples[name]
        print(f"{name:12s} {statistics.median(s):8.1f}  ({min(s):.1f}-{max(s):.1f})")
    for d in depths:
        gap = statistics.median(samples[f"fused x{d}"]) - statistics.median(samples[f"stock x{d}"])
        print(f"x{d}: fused - stock = {gap:.1f} us per call, {gap / d:.1f} us per layer")
    for name in (f"stock x{depths[0]}", f"fused x{depths[0]}"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                call(stacks[name])
        print(f"== host operators, {name} (20 calls)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
