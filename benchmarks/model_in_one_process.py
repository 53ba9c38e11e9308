"""Whole-model variants trained in one process, their windows interleaved, with a host profile each.

`bench --model` gives every variant a fresh process, which a user's run is, but each process gets the
host's speed of its own moment. Here the variants share one process and one host state, so a ratio
says what the library's own host path costs; the profile lists each variant's busiest host operators
per step and `aten::mm` by input shapes. Liger's patch replaces transformers classes globally: name
a liger variant last, or not at all. Writes the per-window ms/step as JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from fused_swiglu.bench.model import RunSpec, Training, host_profile, host_profile_table

PROFILED_STEPS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", nargs=4, type=int, help="HIDDEN INTER LAYERS TOKENS")
    parser.add_argument("variants", help="comma-separated bench --model variants; the first is the base")
    parser.add_argument("--rounds", type=int, default=12, help="windows per variant, taken in turn")
    parser.add_argument("--steps", type=int, default=20, help="training steps per window")
    parser.add_argument("--top", type=int, default=25, help="host operators listed per variant")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (interpreter)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    hidden, inter, layers, tokens = args.size
    variants = args.variants.split(",")
    runs = {}
    for name in variants:
        start = time.perf_counter()
        spec = RunSpec(name, hidden, inter, layers, tokens, steps=args.steps, device=args.device)
        runs[name] = Training(spec)
        print(f"{name}: ready in {time.perf_counter() - start:.1f} s, losses {runs[name].losses}", flush=True)
    ms: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        shift = r % len(variants)
        for name in variants[shift:] + variants[:shift]:  # the order rotates round by round
            ms[name].append(runs[name].window())
        print(f"round {r + 1}: " + ", ".join(f"{n} {ms[n][-1]:.2f}" for n in variants), flush=True)
    base = variants[0]
    for name in variants:
        ratios = [a / b for a, b in zip(ms[name], ms[base], strict=True)]
        print(
            f"{name:22s} median {statistics.median(ms[name]):7.2f} ms/step  min {min(ms[name]):7.2f}  "
            f"vs {base} {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        )
    for name in variants:
        profile = host_profile(runs[name].step, PROFILED_STEPS, args.top, by_shape=("aten::mm",))
        print(host_profile_table({"variant": name, "host_ops": profile}))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"in-one-process-{hidden}x{layers}.json"
    path.write_text(json.dumps(ms, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
