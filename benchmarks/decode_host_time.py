"""Host time of one no_grad call at decode sizes, against the time the GPU needs for it.

Run on the GPU: ``python benchmarks/decode_host_time.py [--commit SHA]``. For each layer of the inference path
(the public call, the path under it, its cuBLAS + activation pieces), 300 calls are issued without
waiting ("host issue" per call) and then waited for ("wall" per call): where host issue is close
to wall, the host, not the GPU, sets the pace. "graph" is the same call replayed from a CUDA graph
(the GPU's own time, plus a replay's small host cost). Eager PyTorch and Liger's module (if
installed) are timed the same way for reference. Ends with profiles of the public call at 16 and
256 rows.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

from fused_swiglu import ops, swiglu_mlp
from fused_swiglu.bench.impls import EagerSwiGLUMLP, peer_module
from fused_swiglu.bench.measure import cuda_graph_replay
from fused_swiglu.bench.report import provenance
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.glu_activation import glu_activation
from fused_swiglu.kernels.glu_forward import glu_forward
from fused_swiglu.testing import make_problem

HIDDEN, INTER = 4096, 14336  # llama3-8b
CALLS = 300


def per_call_us(fn) -> tuple[float, float]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return 1e6 * (issued - start) / CALLS, 1e6 * (done - start) / CALLS


def layers(m: int) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inference path at ``m`` rows, layer by layer, and the tensors of its public call."""
    p = make_problem(m, HIDDEN, INTER, dtype=torch.bfloat16, device="cuda", seed=1)
    w_gate_up, w_down, x = p.w_gate_up.contiguous(), p.w_down, p.x
    h = torch.mm(x, w_gate_up.t())
    fns = {
        "swiglu_mlp": lambda: swiglu_mlp(x, w_gate_up, w_down),
        "no_grad_path": lambda: torch.mm(
            ops.glu_forward(x, w_gate_up, 1.0, 1.0, ops.INFERENCE, None, None)[0], w_down.t()
        ),
        "mm+act+mm": lambda: torch.mm(
            glu_activation(torch.mm(x, w_gate_up.t()), gate_multiplier=1.0, down_multiplier=1.0), w_down.t()
        ),
        "act_only": lambda: glu_activation(h, gate_multiplier=1.0, down_multiplier=1.0),
        "fused_kernel": lambda: glu_forward(
            x, w_gate_up, gate_multiplier=1.0, down_multiplier=1.0, save=Saved.NOTHING
        ),
        "mm+mm": lambda: torch.mm(torch.mm(x, w_gate_up.t())[:, :INTER], w_down.t()),
    }
    eager = EagerSwiGLUMLP(HIDDEN, INTER, device="cuda", dtype=torch.bfloat16)
    fns["eager"] = lambda: eager(x)
    liger = peer_module("liger", eager)
    if isinstance(liger, str):
        print(f"# no Liger row: {liger}", flush=True)
    else:
        fns["liger"] = lambda: liger(x)
    return fns, x, w_gate_up, w_down


@torch.no_grad()
def main() -> None:
    for m in (1, 16, 64, 256):
        fns, x, w_gate_up, w_down = layers(m)
        for name, fn in fns.items():
            host, wall = per_call_us(fn)
            _, graph = per_call_us(cuda_graph_replay(fn))
            print(
                f"M={m} {name:14s} host issue {host:7.1f} us/call, wall {wall:7.1f} us/call, "
                f"graph {graph:7.1f} us/call",
                flush=True,
            )
        if m in (16, 256):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(CALLS):
                swiglu_mlp(x, w_gate_up, w_down)
            profile.disable()
            torch.cuda.synchronize()
            pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    meta = provenance(ap.parse_args().commit)
    print(
        f"# {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}",
        flush=True,
    )
    main()
