"""Where a training step's time goes: every GPU kernel of the library's step beside the floor's six GEMMs.

Run on the GPU: ``python benchmarks/step_breakdown.py [--saves factors preact] [--glu] [--shapes ...]
[--shape M H I] [--variants EXPERIMENT:VARIANT ...] --out breakdown.json``. ``--variants`` adds the
library step inside variants of ``ab_step.py``'s experiments (a launch shape forced, say), each
beside the floor, so a step A/B can be read kernel by kernel.

The step over the floor (``ab_step.py``, ``bench``) says how much slower the library is, not where:
in its own kernels, in the cuBLAS GEMMs it leaves to cuBLAS (another algorithm for the packed
gradient's layout, a colder L2), in extra kernels, or in idle time between kernels. Here each step
and the floor run under ``torch.profiler`` for ``--steps`` steps, in alternating rounds; every
kernel's device duration is taken from the trace, and each position of the step's launch sequence
gets the median over all steps. The two sequences' kernels are paired position by position when
they have as many (the MLP with saved factors or pre-activations: the fused forward, the down GEMM,
the fused backward, dW_down, dX, dW_gate_up); the memsets cuBLAS issues before its GEMMs are summed
apart. CUDA events around the profiled steps give their
wall time; less the sum of their kernels, that is the time the GPU sat idle between kernels. The
``do_bench`` step time (the same rotation, the L2 cache cleared before each call, as in ``bench``)
is printed beside it but not subtracted: on the H200 a step runs at the 700 W power cap with its SM
clock near 1.5 of 1.98 GHz, so separate runs of the same kernels differ by a few percent
(``raw/power-df4a6e4.log``), and a difference of two runs would read that as idle time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from ab_step import EXPERIMENTS, MLP_ONLY, add_variants_argument, chosen_variants, problems, variant
from torch.profiler import ProfilerActivity, profile

from fused_swiglu.bench.measure import median_ms
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.bench.run import add_shape_arguments, chosen_shapes

#: Trace categories that occupy the GPU: kernels, and the memsets/copies a step might add.
DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
NAME_WIDTH = 44


def short_name(name: str) -> str:
    """A kernel's name without its argument list, cut to fit a table column."""
    base = name.split("(")[0].strip()
    return base if len(base) <= NAME_WIDTH else base[: NAME_WIDTH - 3] + "..."


def device_events(trace: dict) -> list[tuple[float, str, float]]:
    """(start us, name, duration us) of every GPU activity in a Chrome trace, in start order."""
    events = [
        (float(e["ts"]), e["name"], float(e["dur"]))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
    ]
    return sorted(events)


def per_step(events: list[tuple[float, str, float]], steps: int) -> list[list[tuple[str, float]]]:
    """The launch sequence of each of ``steps`` identical steps: [(name, duration us)] per step.

    Raises ``ValueError`` when the events do not split into ``steps`` sequences with the same kernel
    names, position by position: then the steps differ and a position-wise median would mix kernels.
    """
    if steps < 1 or len(events) % steps:
        raise ValueError(f"{len(events)} GPU activities do not split into {steps} steps")
    k = len(events) // steps
    seqs = [[(name, dur) for _, name, dur in events[s * k : (s + 1) * k]] for s in range(steps)]
    names = [n for n, _ in seqs[0]]
    for s, seq in enumerate(seqs[1:], 1):
        if [n for n, _ in seq] != names:
            raise ValueError(f"step {s} launches other kernels than step 0")
    return seqs


def profiled_steps(fn, leaves: list[torch.Tensor], steps: int) -> tuple[list[list[tuple[str, float]]], float]:
    """Run ``fn`` ``steps`` times under the profiler (gradients reset before each, so no
    accumulation kernel joins the step); return each step's kernels and the wall ms per step."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            for leaf in leaves:
                leaf.grad = None
            fn()
        end.record()
        torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / steps
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = device_events(trace)
    try:
        return per_step(events, steps), wall_ms
    except ValueError as e:  # steps that differ are a finding to print, not a crash
        print(f"  note: {e}; kernels summed by name instead of by position", flush=True)
        return [by_name([[(name, dur / steps) for _, name, dur in events]])], wall_ms


def by_name(seqs: list[list[tuple[str, float]]]) -> list[tuple[str, float]]:
    """Each kernel name's time per sequence, averaged over the sequences, in first-launch order."""
    totals: dict[str, float] = {}
    for seq in seqs:
        for name, dur in seq:
            totals[name] = totals.get(name, 0.0) + dur / len(seqs)
    return list(totals.items())


def median_sequence(rounds: list[list[list[tuple[str, float]]]]) -> list[tuple[str, float]]:
    """Position by position, the median duration over every step of every round; by name when the
    steps' launch sequences differ."""
    steps = [seq for r in rounds for seq in r]
    if any([n for n, _ in seq] != [n for n, _ in steps[0]] for seq in steps):
        return by_name(steps)
    return [(steps[0][i][0], statistics.median(seq[i][1] for seq in steps)) for i in range(len(steps[0]))]


def is_memset(name: str) -> bool:
    """cuBLAS clears a few bytes before most of its GEMMs; those memsets are not kernels to pair."""
    return name.startswith("Memset")


def print_pair(floor: list[tuple[str, float]], step: list[tuple[str, float]]) -> None:
    """The two launch sequences' kernels (memsets summed apart) side by side when they pair up, one
    after the other otherwise."""
    w = NAME_WIDTH
    kernels = [[(n, d) for n, d in seq if not is_memset(n)] for seq in (floor, step)]
    memsets = [sum(d for n, d in seq if is_memset(n)) for seq in (floor, step)]
    if len(kernels[0]) == len(kernels[1]):
        print(f"  {'#':>2}  {'floor kernel':<{w}} {'us':>9}   {'library kernel':<{w}} {'us':>9} {'ratio':>6}")
        for i, ((fn, fd), (sn, sd)) in enumerate(zip(*kernels, strict=True)):
            print(
                f"  {i:>2}  {short_name(fn):<{w}} {fd:9.1f}   {short_name(sn):<{w}} {sd:9.1f} {sd / fd:6.3f}"
            )
    else:
        for title, seq in zip(("floor", "library"), kernels, strict=True):
            print(f"  {title} kernels:")
            for i, (n, d) in enumerate(seq):
                print(f"  {i:>2}  {short_name(n):<{w}} {d:9.1f}")
    print(f"  memsets: floor {memsets[0]:.1f} us, library {memsets[1]:.1f} us")


def breakdown(label: str, fns: dict, leaves, steps: int, reps: int) -> dict:
    """Profile and time the floor (``fns["floor"]``) and each library step of ``fns``, the order
    rotating between rounds, and print every library step's kernels beside the floor's."""
    for fn in fns.values():  # compile, tune and warm up outside the measurement
        for leaf in leaves:
            leaf.grad = None
        fn()
    rounds: dict[str, list] = {v: [] for v in fns}
    profiled: dict[str, list[float]] = {v: [] for v in fns}
    wall: dict[str, list[float]] = {v: [] for v in fns}
    order = list(fns)
    for rep in range(reps):
        for v in order[rep % len(order) :] + order[: rep % len(order)]:
            seq, profiled_ms = profiled_steps(fns[v], [] if v == "floor" else leaves, steps)
            rounds[v].append(seq)
            profiled[v].append(profiled_ms)
            wall[v].append(median_ms(fns[v], warmup=10, rep=100, grad_to_none=leaves))
    seqs = {v: median_sequence(r) for v, r in rounds.items()}
    ms = {v: statistics.median(w) for v, w in wall.items()}
    prof_ms = {v: statistics.median(w) for v, w in profiled.items()}
    busy = {v: sum(d for _, d in seqs[v]) / 1e3 for v in fns}
    print(f"\n== {label}")
    width = max(map(len, fns))
    for v in fns:
        print(
            f"  {v:<{width}} step {ms[v]:8.3f} ms ({ms[v] / ms['floor']:.3f}x the floor)  profiled"
            f" {prof_ms[v]:8.3f} ms = kernels {busy[v]:8.3f} + idle {prof_ms[v] - busy[v]:+7.3f}"
        )
    for v in order[1:]:
        print(f"  -- {v}")
        print_pair(seqs["floor"], seqs[v])
    return {
        "problem": label,
        "step_ms": ms,
        "profiled_ms": prof_ms,
        "kernels_ms": busy,
        "kernels": {v: [{"name": n, "us": d} for n, d in s] for v, s in seqs.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", nargs="+", default=["factors"], choices=["factors", "preact", "recompute"])
    ap.add_argument("--glu", action="store_true", help="also the GLU operator at (11136, 3584, 14336)")
    ap.add_argument("--steps", type=int, default=10, help="profiled steps per round")
    ap.add_argument("--reps", type=int, default=4, help="rounds per implementation, alternating")
    add_variants_argument(ap, "the library step, at each problem the experiment applies to,")
    ap.add_argument("--out", default="breakdown.json")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    add_shape_arguments(ap)
    args = ap.parse_args()
    variants = chosen_variants(ap, args)
    meta = start_gpu_log(
        args.commit, "step_breakdown needs a CUDA GPU: it reads kernel times from the profiler's CUDA trace"
    )
    if meta is None:
        return 1
    rows = []
    for save in args.saves:
        for label, floor, step, leaves in problems(save, chosen_shapes(args), glu=args.glu):
            fns = {"floor": floor.step, "library": step}
            for name, var in variants:
                mlp_only = name in MLP_ONLY and not label.startswith("mlp")
                if EXPERIMENTS[name][0] == save and not mlp_only:
                    fns[f"{name}:{var}"] = variant(EXPERIMENTS[name][1][var], step)
            rows.append(
                {"save": save} | breakdown(f"{label} (save={save})", fns, leaves, args.steps, args.reps)
            )
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
