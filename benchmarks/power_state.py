"""The GPU's SM clock, power draw and throttle reasons while each implementation's training step runs
back to back: is the step limited by the power cap rather than by cycles?

Run on the GPU: ``python benchmarks/power_state.py [--shapes ...] [--impls ...] [--seconds 3]
[--variants EXPERIMENT:VARIANT ...] --out power.json``. Needs ``nvidia-smi``. ``--variants`` adds
the fused step of the experiment's save mode inside variants of ``ab_step.py``'s experiments (a
launch shape forced, say). Each implementation is warmed up (compiled, tuned), then runs steps back
to back for ``--seconds`` while ``nvidia-smi`` samples every 100 ms; the first and last samples are
dropped (the loop starting and stopping). Per implementation and repetition (the order reversing
between repetitions): ms per step from CUDA events around the loop (``bench.measure.sustained_ms``,
eight steps kept queued), and the median SM clock and power with every throttle reason seen.

The logs ``raw/power-df4a6e4.log``, ``raw/power-all-beaaab9.log`` and ``raw/power-pp4096-beaaab9.log``
were taken with an earlier loop that waited for the GPU to drain every fourth step; the GPU then sat
idle while the host issued the next step's first kernel, which weighs against implementations with
a long host path before it (NOTES item 39).

Why it matters: when a step runs at the power cap, the clock falls until the draw fits, so what
costs time is energy per step, not cycles alone; and a kernel that draws more power slows the
kernels around it. Ratios taken in one process side by side stay comparable; absolute times move
with the card's temperature and power history.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import torch
from ab_step import EXPERIMENTS, add_variants_argument, chosen_variants, variant

from fused_swiglu.bench.impls import IMPL_NAMES, EagerSwiGLUMLP, Impl, build_impl
from fused_swiglu.bench.measure import sustained_ms
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.bench.run import add_shape_arguments, chosen_shapes

#: ``clocks_throttle_reasons.active`` bits (NVML's nvmlClocksEventReasons), the ones that slow a busy GPU.
THROTTLE_REASONS = {
    0x1: "idle",
    0x2: "application clocks setting",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
}
QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def throttle_names(mask: int) -> list[str]:
    """The named reasons set in an ``nvidia-smi`` throttle bit mask (unnamed bits as hex)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    return names + ([hex(rest)] if rest else [])


def summarize(lines: list[str]) -> dict:
    """Median SM clock (MHz) and power (W) and every throttle reason, from ``nvidia-smi`` CSV rows
    (``--format=csv,noheader,nounits``); the first and last rows are dropped."""
    rows = [[field.strip() for field in line.split(",")] for line in lines if line.strip()]
    rows = rows[1:-1]
    if not rows:
        raise ValueError("too few nvidia-smi samples: run for longer")
    reasons = sorted({name for r in rows for name in throttle_names(int(r[2], 16))})
    return {
        "sm_clock_mhz": statistics.median(float(r[0]) for r in rows),
        "power_w": statistics.median(float(r[1]) for r in rows),
        "throttle": reasons,
        "samples": len(rows),
    }


def sample(step, params: list[torch.Tensor], seconds: float) -> dict:
    """Run ``step`` back to back for ``seconds`` (``sustained_ms``) under ``nvidia-smi`` sampling."""
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE,
        text=True,
    )
    ms = sustained_ms(step, params, seconds)
    smi.terminate()
    out, _ = smi.communicate()
    return {"ms_per_step": ms, **summarize(out.splitlines())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(ap)
    ap.add_argument(
        "--impls", nargs="+", default=["floor", "fused-factors", "fused-preact", "eager", "liger"]
    )
    add_variants_argument(ap, "the fused step of the experiment's save mode")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="power.json")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    args = ap.parse_args()
    unknown = sorted(set(args.impls) - set(IMPL_NAMES))
    if unknown:
        ap.error(f"unknown implementations {unknown}; choose from {list(IMPL_NAMES)}")
    variants = chosen_variants(ap, args)
    meta = start_gpu_log(args.commit, "power_state needs a CUDA GPU and nvidia-smi")
    if meta is None:
        return 1
    rows = []
    for shape, (m, hidden, inter) in chosen_shapes(args).items():
        torch.manual_seed(0)
        reference = EagerSwiGLUMLP(hidden, inter, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        impls = {}
        for name in args.impls:
            impl = build_impl(name, reference, x, dy)
            if isinstance(impl, str):
                print(f"  {name}: missing ({impl})")
                continue
            for _ in range(2):  # compile and tune outside the sampling
                impl.step()
            impls[name] = impl
        for experiment, name in variants:
            save, contexts = EXPERIMENTS[experiment]
            base = build_impl(f"fused-{save}", reference, x, dy)
            impl = Impl(f"{experiment}:{name}", base.forward, variant(contexts[name], base.step), base.params)
            for _ in range(2):
                impl.step()
            impls[impl.name] = impl
        print(f"\n== {shape} (M {m}, hidden {hidden}, intermediate {inter})")
        width = max(14, *map(len, impls))
        print(f"  {'impl':<{width}} {'ms/step':>8} {'SM MHz':>7} {'power W':>8}  throttle")
        order = list(impls)
        for rep in range(args.reps):
            for name in order if rep % 2 == 0 else order[::-1]:
                r = sample(impls[name].step, impls[name].params, args.seconds)
                rows.append({"shape": shape, "impl": name, "rep": rep} | r)
                print(
                    f"  {name:<{width}} {r['ms_per_step']:8.3f} {r['sm_clock_mhz']:7.0f} {r['power_w']:8.1f}"
                    f"  {', '.join(r['throttle']) or 'none'}",
                    flush=True,
                )
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
