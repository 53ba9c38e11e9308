"""Where the host time of one fused MLP training call goes, inside a training call and alone.

Run on the GPU: ``python benchmarks/mlp_call_host_breakdown.py [--rows N] [--hidden H] [--inter I]
[--layers L]``. At a few rows the GPU waits for the host, so wall time per call is host time. Timers
wrap the fused ops' passes (``ops.glu_pass``, ``ops.mlp_gradient_``), the direct kernel launch
(``KernelLauncher._run``), the host descriptor encoder (called only when a descriptor is not
cached), Python's garbage collections and the GEMMs the Functions issue (``torch.mm`` as ``ops``
and ``passes`` see it), and count launches that went through Triton's own launcher. Cases, in
rotating rounds: the eager ``SwiGLUMLP`` training call under bf16 autocast with fp32 weights (as
``bench --model`` trains); the same module compiled, alone and as ``--layers`` residual layers in
one graph (the ops' bodies are not traced, so their timers stay in; a timer on the Functions'
``torch.mm`` would take the GEMMs out of the graph and is left out there); the two ops and the
Functions' three GEMMs called alone in a loop, as they are, under autocast, under ``no_grad`` and
with new input tensors every call. Launch plans (kernels/plans.py) replay an op's later calls with a
signature past the passes, so the passes' timers count first calls only; the wall time per call
is the measure.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import types

import torch

import fused_swiglu.kernels.launch as launch
import fused_swiglu.ops as ops
import fused_swiglu.passes as passes
from fused_swiglu.bench.impls import EagerSwiGLUMLP, ResidualMLPs
from fused_swiglu.bench.measure import GarbageCollections, rotation
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.nn import SwiGLUMLP

seconds: dict[str, float] = collections.defaultdict(float)
calls: collections.Counter = collections.Counter()


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
            calls[name] += 1

    return wrapper


class _TorchWithTimedMm(types.ModuleType):
    """``torch`` as ``ops`` and ``passes`` see it, its ``mm`` timed."""

    def __getattr__(self, name):
        return getattr(torch, name)


ORIGINAL = {
    "forward": ops.glu_pass,
    "backward": ops.mlp_gradient_,
    "run": launch.KernelLauncher._run,
    "through_triton": launch.KernelLauncher._through_triton,
    "encode": launch._encode,
}
TIMED_TORCH = _TorchWithTimedMm("torch")
TIMED_TORCH.mm = _timed("torch.mm", torch.mm)


def timers(on: bool, mm: bool = True) -> None:
    """Install (or remove) the timers; ``mm=False`` leaves ``torch.mm`` untimed."""
    ops.glu_pass = _timed("forward pass", ORIGINAL["forward"]) if on else ORIGINAL["forward"]
    ops.mlp_gradient_ = _timed("gradient pass", ORIGINAL["backward"]) if on else ORIGINAL["backward"]
    launch.KernelLauncher._run = _timed("direct launch", ORIGINAL["run"]) if on else ORIGINAL["run"]
    slow = _timed("through Triton's launcher", ORIGINAL["through_triton"])
    launch.KernelLauncher._through_triton = slow if on else ORIGINAL["through_triton"]
    launch._encode = _timed("descriptor encoded", ORIGINAL["encode"]) if on else ORIGINAL["encode"]
    passes.torch = ops.torch = TIMED_TORCH if on and mm else torch


def cases(rows: int, hidden: int, inter: int, layers: int) -> dict[str, tuple[object, str]]:
    """name -> (one call, which timers run while it does: "all", "no mm" or "none")."""
    torch.manual_seed(0)
    reference = EagerSwiGLUMLP(hidden, inter, device="cuda", dtype=torch.float32)
    x = torch.randn(rows, hidden, device="cuda", requires_grad=True)
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    eager = SwiGLUMLP.from_mlp(reference)
    compiled = torch.compile(SwiGLUMLP.from_mlp(reference), dynamic=False)
    mlps = [SwiGLUMLP.from_mlp(EagerSwiGLUMLP(hidden, inter, device="cuda")) for _ in range(layers)]
    stack = ResidualMLPs(mlps)
    compiled_stack = torch.compile(stack, dynamic=False)

    def training_call(module) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(x)
        y.backward(dy)
        x.grad = None
        for p in module.parameters():
            p.grad = None

    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    inputs = {
        "x": torch.randn(rows, hidden, **bf16),
        "gate_up": torch.randn(2 * inter, hidden, **bf16) * 0.02,
        "down": torch.randn(hidden, inter, **bf16) * 0.02,
    }

    def ops_alone() -> None:
        x2d, gate_up, down = inputs["x"], inputs["gate_up"], inputs["down"]
        a, saved = ops.glu_forward(x2d, gate_up, 1.0, 1.0, "factors", None, None)
        y = torch.mm(a, down.t())
        grad, _ = ops.mlp_gradient(y, down, saved, 1.0, 1.0, "factors")
        torch.mm(grad, gate_up)
        passes.mm_as(grad.t(), x2d, torch.float32)

    def ops_under_autocast() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ops_alone()

    def ops_no_grad() -> None:
        with torch.no_grad():
            ops_alone()

    def ops_new_inputs() -> None:
        for name, t in list(inputs.items()):
            inputs[name] = t.clone()
        ops_alone()

    return {
        "eager SwiGLUMLP call, autocast": (lambda: training_call(eager), "all"),
        "compiled SwiGLUMLP call, autocast": (lambda: training_call(compiled), "no mm"),
        f"compiled {layers} layers, autocast": (lambda: training_call(compiled_stack), "no mm"),
        "ops alone": (ops_alone, "all"),
        "ops alone, under autocast": (ops_under_autocast, "all"),
        "ops alone, no_grad": (ops_no_grad, "all"),
        "ops alone, new inputs each call": (ops_new_inputs, "all"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8, help="layers of the compiled stack")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    if start_gpu_log(args.commit, "mlp_call_host_breakdown.py needs a CUDA GPU") is None:
        return
    found = cases(args.rows, args.hidden, args.inter, args.layers)
    collected = GarbageCollections()  # timed as one more part of a call
    for call, _ in found.values():
        for _ in range(20):  # compiles, caches, the allocator's steady state
            call()
    torch.cuda.synchronize()
    walls: dict[str, list[float]] = {name: [] for name in found}
    inside: dict[str, list[dict]] = {name: [] for name in found}
    names = list(found)
    for round_ in range(args.rounds):
        for name in rotation(names, round_):
            call, timed = found[name]
            timers(timed != "none", mm=timed == "all")
            seconds.clear()
            calls.clear()
            collected.runs.clear()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
            walls[name].append((time.perf_counter() - start) / args.calls * 1e6)
            timers(False)
            if collected.runs:
                seconds["garbage collection"] = sum(s for _, s in collected.runs)
                calls["garbage collection"] = len(collected.runs)
            inside[name].append({k: (seconds[k] / args.calls * 1e6, calls[k] / args.calls) for k in calls})
    print(
        f"rows {args.rows}, hidden {args.hidden}, intermediate {args.inter}; medians of {args.rounds} rounds"
    )
    for name in names:
        parts = collections.defaultdict(list)
        for sample in inside[name]:
            for k, value in sample.items():
                parts[k].append(value)
        detail = ", ".join(
            f"{k} {statistics.median(u for u, _ in v):.1f} us x{statistics.median(c for _, c in v):.2f}"
            for k, v in sorted(parts.items())
        )
        print(f"{name:36s} {statistics.median(walls[name]):8.1f} us/call  {detail}")


if __name__ == "__main__":
    main()
