"""Is a whole-model training step bound by the host or by the GPU? Wall time, host issue time and GPU
kernel time per step, one fresh process per variant.

Run on the GPU: ``python benchmarks/step_host_vs_gpu.py [--size H I LAYERS TOKENS] [--variants ...]``.
Each variant (``bench --model``'s names and model) trains five steps, then five windows of ten steps:
the wall time per step; the host's issue time per step (until the last step's Python returns,
before the synchronize: equal to the wall time where the GPU waits for the host); the GPU's kernel
time per step (torch.profiler over five steps: the sum of the kernels' durations) and its kernels
by time; and a cProfile of five steps, the host's Python by own and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import time

import torch

from fused_swiglu.bench.model import RunSpec, _build_model
from fused_swiglu.bench.report import start_gpu_log


def _profile_gpu(step, steps: int = 5) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:70]] = by_name.get(e.name[:70], 0.0) + e.device_time / steps
    total = sum(by_name.values())
    print(f"GPU kernel time per step {total / 1e3:.2f} ms, kernels per step {len(kernels) / steps:.0f}")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]:
        print(f"   {us / 1e3:8.3f} ms  {name}")


def run(spec: RunSpec) -> None:
    """Train ``spec``'s model in this process and print what it measured."""
    model = _build_model(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = max(1, spec.tokens // spec.sequence)
    data = torch.randint(0, spec.vocab, (batch, spec.tokens // batch), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=data, labels=data).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    walls, issues = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            step()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 100)
        issues.append((issued - start) * 100)
    print(
        f"{spec.variant}: wall ms/step {[round(w, 2) for w in walls]}, median {statistics.median(walls):.2f}"
    )
    print(f"{spec.variant}: issue ms/step {[round(w, 2) for w in issues]}")
    _profile_gpu(step)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(45)
    print(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", type=int, nargs=4, default=[1024, 2816, 32, 4096], metavar=("H", "I", "L", "T")
    )
    parser.add_argument("--variants", nargs="*", default=["stock-compiled", "fused-compiled"])
    parser.add_argument("--commit", default=None)
    parser.add_argument("--spec", help=argparse.SUPPRESS)  # one variant, in a fresh process
    args = parser.parse_args()
    if args.spec:
        run(RunSpec(**json.loads(args.spec)))
        return
    if start_gpu_log(args.commit, "step_host_vs_gpu.py needs a CUDA GPU") is None:
        return
    hidden, inter, layers, tokens = args.size
    for variant in args.variants:
        spec = RunSpec(variant=variant, hidden=hidden, intermediate=inter, layers=layers, tokens=tokens)
        subprocess.run([sys.executable, __file__, "--spec", json.dumps(spec.__dict__)], check=False)


if __name__ == "__main__":
    main()
