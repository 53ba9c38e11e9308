"""Does a whole-model window's time depend on what the process did before it, or on Python's garbage
collector? One variant per process.

Run on the GPU: ``python benchmarks/window_conditions.py VARIANT [--size H I LAYERS TOKENS] [--rounds N]``.
After ``bench --model``'s first steps, the process times windows of 20 steps (3 untimed steps before
each) under four conditions, in rotating order: plain; after a 0.5 s sleep (as a side-by-side worker
waits while the others time theirs); with the garbage collector off; both. Per condition it prints
the median synced ms/step, the median and largest host issue time of one step, and the collections
per window by generation with their total time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from fused_swiglu.bench.measure import GarbageCollections, rotation
from fused_swiglu.bench.model import RunSpec, Training
from fused_swiglu.bench.report import start_gpu_log

CONDITIONS = ("plain", "sleep", "no gc", "no gc, sleep")
STEPS, WARMUP, SLEEP_S = 20, 3, 0.5


def window(training: Training, condition: str, collections: GarbageCollections) -> dict:
    if "sleep" in condition:
        time.sleep(SLEEP_S)
    if "no gc" in condition:
        gc.disable()
    try:
        for _ in range(WARMUP):
            training.step()
        torch.cuda.synchronize()
        collections.runs.clear()
        marks = [time.perf_counter()]
        for _ in range(STEPS):
            training.step()
            marks.append(time.perf_counter())
        torch.cuda.synchronize()
        end = time.perf_counter()
    finally:
        gc.enable()
    issue = [(b - a) * 1e3 for a, b in zip(marks, marks[1:], strict=False)]
    return {
        "ms": (end - marks[0]) * 1e3 / STEPS,
        "issue_median": statistics.median(issue),
        "issue_max": max(issue),
        "collections": [sum(1 for g, _ in collections.runs if g == k) for k in range(3)],
        "gc_ms": sum(s for _, s in collections.runs) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="A whole-model window's time under four conditions")
    parser.add_argument("variant", help="a `bench --model` variant, e.g. stock-compiled")
    size = {"type": int, "nargs": 4, "default": (1024, 2816, 4, 4096), "metavar": ("H", "I", "L", "T")}
    parser.add_argument("--size", **size)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    if start_gpu_log(args.commit, "window_conditions.py needs a CUDA GPU") is None:
        return
    training = Training(RunSpec(args.variant, *args.size))
    collections = GarbageCollections()
    windows: dict[str, list[dict]] = {c: [] for c in CONDITIONS}
    for round_ in range(args.rounds):
        for condition in rotation(list(CONDITIONS), round_):
            windows[condition].append(window(training, condition, collections))
    print(f"{args.variant}, size {args.size}, {args.rounds} windows of {STEPS} steps per condition")
    for condition, ws in windows.items():
        ms = [w["ms"] for w in ws]
        per_window = [sum(w["collections"][k] for w in ws) / len(ws) for k in range(3)]
        print(
            f"{condition:13s} ms/step {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}); "
            f"issue per step {statistics.median(w['issue_median'] for w in ws):.2f}, "
            f"largest {statistics.median(w['issue_max'] for w in ws):.2f}; "
            f"collections per window (gen 0, 1, 2) {per_window}, "
            f"{statistics.mean(w['gc_ms'] for w in ws):.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
