"""What the library's Python above its ops costs per call: the module, ``swiglu_mlp`` and the
autograd Function, with the ops replaced by stand-ins that only make their outputs' shapes.

Runs on the CPU, any machine: ``python benchmarks/python_layers_host_time.py [--rows N]``. The fused
path is taken as on a GPU (the kernels' availability check answers yes), and the two ops return empty
tensors of the right shapes, so what is timed is the Python, the dispatcher and the small CPU GEMMs
of the Functions; transformers' ``LlamaMLP`` as written (eager PyTorch) is timed beside it, with its
own small CPU GEMMs. No-grad calls (as in decoding) and training calls (forward and backward), at a
tiny size where the GEMMs cost little; the best of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import platform
import timeit

import torch

import fused_swiglu.support as support
from fused_swiglu import ops, swiglu_mlp
from fused_swiglu.bench.impls import EagerSwiGLUMLP
from fused_swiglu.bench.report import provenance, provenance_header
from fused_swiglu.nn import SwiGLUMLP

#: Calls of each stand-in: a case that never reached them timed the PyTorch reference instead.
STAND_IN_CALLS = {"glu_forward": 0, "mlp_gradient": 0}


def _glu_forward_shapes(x2d, gate_up_weight, gate_multiplier, down_multiplier, save, u, v):
    STAND_IN_CALLS["glu_forward"] += 1
    m, two_inter = x2d.shape[0], gate_up_weight.shape[0]
    keeps = save not in ("recompute", ops.INFERENCE)
    return x2d.new_empty(m, two_inter // 2), x2d.new_empty(m, two_inter) if keeps else x2d.new_empty(0)


def _mlp_gradient_shapes(dy, down_weight, saved, gate_multiplier, down_multiplier, save):
    STAND_IN_CALLS["mlp_gradient"] += 1
    return saved.new_empty(saved.shape), saved.new_empty(0)


def stand_in_ops() -> torch.library.Library:
    """The ops' CPU implementations replaced by shape-only stand-ins, and the fused path taken on the CPU."""
    support.kernels_run_on = lambda dtype, device: True
    library = torch.library.Library("fused_swiglu", "IMPL")
    library.impl("glu_forward", _glu_forward_shapes, "CPU")
    library.impl("mlp_gradient", _mlp_gradient_shapes, "CPU")
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--inter", type=int, default=128)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    meta = provenance(args.commit, device="cpu")
    meta["gpu"] = f"CPU ({platform.machine()}), the ops replaced by shape-only stand-ins"
    print(provenance_header(meta), flush=True)
    torch.set_num_threads(1)
    library = stand_in_ops()  # noqa: F841 (kept alive: the registrations last as long as it does)
    torch.manual_seed(0)
    eager = EagerSwiGLUMLP(args.hidden, args.inter)
    fused = SwiGLUMLP.from_mlp(eager)
    one_token = torch.randn(1, 1, args.hidden)
    x = torch.randn(args.rows, args.hidden, requires_grad=True)
    dy = torch.randn(args.rows, args.hidden)
    x3, dy3 = x.detach().view(1, args.rows, -1).requires_grad_(), dy.view(1, args.rows, -1)
    gate_up, down = fused.gate_up_proj, fused.down_proj.weight

    def train(module, batch=False) -> None:
        module(x3).backward(dy3) if batch else module(x).backward(dy)

    def op_and_gemm() -> None:
        a, _ = ops.glu_forward(one_token.view(1, -1), gate_up, 1.0, 1.0, ops.INFERENCE, None, None)
        torch.mm(a, down.t())

    no_grad = {
        "SwiGLUMLP, one token": lambda: fused(one_token),
        "swiglu_mlp, one token": lambda: swiglu_mlp(one_token, gate_up, down),
        "the op and the down GEMM": op_and_gemm,
        "LlamaMLP, one token": lambda: eager(one_token),
    }
    training = {
        f"SwiGLUMLP, training call ({args.rows} rows)": lambda: train(fused),
        f"LlamaMLP, training call ({args.rows} rows)": lambda: train(eager),
        f"SwiGLUMLP, training call ([1, {args.rows}, hidden])": lambda: train(fused, batch=True),
        f"LlamaMLP, training call ([1, {args.rows}, hidden])": lambda: train(eager, batch=True),
    }
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, fn in (no_grad | training).items():
            calls = args.calls if name in no_grad else max(1, args.calls // 4)
            before = dict(STAND_IN_CALLS)
            with torch.set_grad_enabled(name in training):
                us = timeit.timeit(fn, number=calls) / calls * 1e6
            best[name] = min(best.get(name, us), us)
            if name.startswith(("SwiGLUMLP", "swiglu_mlp")) and before == STAND_IN_CALLS:
                raise SystemExit(f"{name}: the fused path was not taken; the timing would be the reference's")
    print(f"hidden {args.hidden}, intermediate {args.inter}; us per call, best of {args.rounds} rounds")
    for name, us in best.items():
        print(f"{name:44s} {us:7.2f}")


if __name__ == "__main__":
    main()
