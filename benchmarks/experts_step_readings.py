"""Why one routed-experts step reads differently in two harnesses: the fused step against its floor
under the timing conditions that differ between ``bench --experts`` and ``experts_gather.py``.

Run on a Hopper GPU: ``python benchmarks/experts_step_readings.py [--shape NAME] [--routing KIND]
[--commit SHA]``. At one ``bench --experts`` shape (default Mixtral-8x7B, whose fused step read
1.12-1.16x its floor in ``bench --experts`` and 1.02x in ``experts_gather.py``), with
``bench --experts``' data, the floor and the fused step (``save="factors"``) are timed:

* as ``bench --experts`` times them (``do_bench`` medians of 100 ms, two interleaved rounds);
* in five interleaved rounds, as ``experts_gather.py``;
* with ``do_bench`` windows of 1000 ms (about 30 steps each at Mixtral-8x7B, not 3);
* with dy drawn from the global generator, as ``experts_gather.py`` draws it;
* with the fused step timed twice per round (``experts_gather.py`` times two fused variants).

Each condition prints the medians, their spread and fused / floor.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from triton.testing import do_bench

from fused_swiglu.bench.experts import EXPERT_SHAPES, ROUTINGS, build_step, step_inputs
from fused_swiglu.bench.measure import rotation
from fused_swiglu.bench.report import start_gpu_log


def timed(calls: dict, rounds: int, rep_ms: int) -> dict[str, list[float]]:
    times = {name: [] for name in calls}
    for r in range(rounds):
        for name in rotation(list(calls), r):
            fn, params = calls[name]
            times[name].append(do_bench(fn, warmup=25, rep=rep_ms, grad_to_none=params, return_mode="median"))
    return times


def condition(label: str, shape, kind, tokens, *, rounds=2, rep_ms=100, global_dy=False, twice=False):
    x, index, weights, gate_up, down, dy = step_inputs(shape, kind, tokens, torch.bfloat16)
    if global_dy:
        dy = torch.randn_like(dy)  # as experts_gather.py draws it
    floor, _, _ = build_step("floor", x, index, weights, gate_up, down, dy)
    fused, _, params = build_step("fused", x, index, weights, gate_up, down, dy)
    fused()  # the first call compiles
    calls = {"floor": (floor, None), "fused": (fused, params)}
    if twice:
        calls["fused again"] = (fused, params)
    times = timed(calls, rounds, rep_ms)
    med = {name: statistics.median(t) for name, t in times.items()}
    spread = "  ".join(f"{n} {min(t):.2f}-{max(t):.2f}" for n, t in times.items())
    print(
        f"{label:44s} floor {med['floor']:.3f} ms  fused {med['fused']:.3f} ms  "
        f"fused / floor {med['fused'] / med['floor']:.3f}   ({spread})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral-8x7b", choices=EXPERT_SHAPES)
    parser.add_argument("--routing", default="balanced", choices=ROUTINGS)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--commit")
    args = parser.parse_args()
    if start_gpu_log(args.commit, "experts_step_readings.py needs a CUDA GPU") is None:
        return
    shape, kind, tokens = EXPERT_SHAPES[args.shape], args.routing, args.tokens
    print(f"{args.shape}, {kind} routing, {tokens} tokens")
    condition("bench --experts (2 rounds, 100 ms windows)", shape, kind, tokens)
    condition("5 rounds, 100 ms windows", shape, kind, tokens, rounds=5)
    condition("5 rounds, 1000 ms windows", shape, kind, tokens, rounds=5, rep_ms=1000)
    condition("5 rounds, dy from the global generator", shape, kind, tokens, rounds=5, global_dy=True)
    condition("5 rounds, the fused step twice a round", shape, kind, tokens, rounds=5, twice=True)
    condition("bench --experts again", shape, kind, tokens)


if __name__ == "__main__":
    main()
