"""fp32 training step of every save mode against eager PyTorch, with TF32 on and off.

Run on the GPU: ``python benchmarks/fp32_step.py [--shape M HIDDEN INTERMEDIATE] [--commit SHA]``
(default shape 4096 4096 11008; the commit defaults to ``git rev-parse HEAD``).
Per TF32 setting, each implementation's fwd+bwd is timed (``do_bench`` median) in three rounds and
reported as the median, with its ratio to eager's and the extra peak memory of one step.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fused_swiglu import swiglu_mlp
from fused_swiglu.bench.measure import median_ms, peak_mib
from fused_swiglu.bench.report import provenance
from fused_swiglu.reference import reference_swiglu_mlp
from fused_swiglu.testing import make_problem

ROUNDS = 3


def step_fns(p) -> dict:
    """One fwd+bwd per implementation, on fresh leaves (the switch is read at call time)."""
    x, w_gate_up, w_down, w_gate, w_up = (
        t.detach().requires_grad_() for t in (p.x, p.w_gate_up.contiguous(), p.w_down, p.w_gate, p.w_up)
    )
    fns = {"eager": lambda: reference_swiglu_mlp(x, w_gate, w_up, w_down).backward(p.dy)}
    for save in ("factors", "preact", "recompute"):
        fns[save] = lambda save=save: swiglu_mlp(x, w_gate_up, w_down, save=save).backward(p.dy)
    return fns


def main(m: int, hidden: int, inter: int) -> None:
    p = make_problem(m, hidden, inter, dtype=torch.float32, device="cuda", seed=3)
    for tf32 in (True, False):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        fns = step_fns(p)
        peaks = {name: peak_mib(fn) for name, fn in fns.items()}
        times = {name: [] for name in fns}
        for _ in range(ROUNDS):
            for name, fn in fns.items():
                times[name].append(median_ms(fn, warmup=10, rep=60))
        med = {name: statistics.median(t) for name, t in times.items()}
        eager = med["eager"]
        cells = [f"{n} {t:.3f} ms ({t / eager:.3f}x eager, peak +{peaks[n]:.0f} MiB)" for n, t in med.items()]
        print(f"fp32 M={m} H={hidden} I={inter} allow_tf32={tf32}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=3, default=[4096, 4096, 11008], metavar=("M", "H", "I"))
    ap.add_argument("--commit")
    args = ap.parse_args()
    meta = provenance(args.commit)
    print(
        f"# {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}",
        flush=True,
    )
    main(*args.shape)
