"""Is a whole-model training step bound by the host or by the GPU, and is the host itself steady?
One fresh process per variant.

Run on the GPU: ``python benchmarks/step_host_vs_gpu.py [--size H I LAYERS TOKENS] [--variants ...]``.
Each variant (``bench --model``'s names and model) trains five steps, then prints:

* a host speed probe (a fixed Python loop and the issue time of a tiny CUDA op) before the model
  is built, after warm-up, after the windows and at the end: how fast this host ran at the time;
* five windows of ten steps: wall time and the host's issue time per step (until the last step's
  Python returns), and the busiest threads of the process during them (share of one CPU);
* the host time of one step issued on an idle GPU (synchronized before and after), ten times;
* from a torch.profiler trace of three steps: the GPU's busy and idle time per step, the idle gaps
  grouped by the host operator that launched the work after them, and the CUDA runtime and driver
  calls by time. ``--trace DIR`` also writes the trace (gzipped Chrome JSON) there.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.bench.training import RunSpec, build_model

PROFILED_STEPS = 3
GAP_US = 5  # GPU idle shorter than this is not counted as a gap


def probe(variant: str, when: str) -> None:
    start = time.perf_counter()
    sum(i * i for i in range(300_000))
    python_ms = (time.perf_counter() - start) * 1e3
    a = torch.ones(8, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3000):
        a.add_(1)
    issue_us = (time.perf_counter() - start) / 3000 * 1e6
    torch.cuda.synchronize()
    print(
        f"{variant}: host probe {when}: Python loop {python_ms:.1f} ms, tiny CUDA op issued in "
        f"{issue_us:.2f} us, load {' '.join(pathlib.Path('/proc/loadavg').read_text().split()[:3])}",
        flush=True,
    )


def thread_cpu_ticks() -> dict[str, tuple[str, int]]:
    """tid -> (name, user + system clock ticks) of this process's threads (Linux)."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = pathlib.Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks[tid] = (stat[stat.index("(") + 1 : stat.rindex(")")], int(fields[11]) + int(fields[12]))
    return ticks


def analyse_trace(variant: str, path: str) -> None:
    events = json.loads(pathlib.Path(path).read_text())["traceEvents"]
    gpu = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
        key=lambda e: e["ts"],
    )
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e]
    by_correlation = {e["args"].get("correlation"): e for e in runtime if "args" in e}
    host_ops = sorted(
        (e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e),
        key=lambda e: e["ts"],
    )
    starts = [e["ts"] for e in host_ops]

    def launched_by(ts: float) -> str:
        """The innermost host operators running at ``ts``."""
        j = bisect.bisect_right(starts, ts)
        around = [e for e in host_ops[max(0, j - 400) : j] if e["ts"] + e["dur"] >= ts]
        return " | ".join(e["name"][:48] for e in sorted(around, key=lambda e: e["dur"])[:2])

    busy = sum(e["dur"] for e in gpu)
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    per = PROFILED_STEPS * 1e3
    print(
        f"{variant}: GPU per step {span / per:.2f} ms, busy {busy / per:.2f}, idle {(span - busy) / per:.2f}"
    )
    gaps: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    end = gpu[0]["ts"] + gpu[0]["dur"]
    for e in gpu[1:]:
        if e["ts"] - end > GAP_US:
            launch = by_correlation.get(e["args"].get("correlation"))
            name = f"{launched_by(launch['ts'])} <{launch['name']}>" if launch else "?"
            gaps[name][0] += 1
            gaps[name][1] += e["ts"] - end
        end = max(end, e["ts"] + e["dur"])
    print(f"{variant}: GPU idle gaps by the host operator that launched the work after them (per step):")
    for name, (count, us) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:20]:
        print(f"   {count / PROFILED_STEPS:7.1f} gaps {us / per:8.3f} ms  {name}")
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in runtime:
        row = calls[e["name"]]
        row[0], row[1], row[2] = row[0] + 1, row[1] + e["dur"], max(row[2], e["dur"])
    print(f"{variant}: CUDA runtime and driver calls (per step: count, ms; longest us):")
    for name, (count, us, longest) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"   {count / PROFILED_STEPS:8.1f} {us / per:8.3f} ms {longest:9.1f}  {name}")


def run(spec: RunSpec, trace_dir: str | None) -> None:
    """Train ``spec``'s model in this process and print what it measured."""
    probe(spec.variant, "before the model")
    model = build_model(spec)
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
    probe(spec.variant, "after warm-up")
    before, started = thread_cpu_ticks(), time.perf_counter()
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
    elapsed, after = time.perf_counter() - started, thread_cpu_ticks()
    print(
        f"{spec.variant}: wall ms/step {[round(w, 2) for w in walls]}, median {statistics.median(walls):.2f}"
    )
    print(f"{spec.variant}: issue ms/step {[round(w, 2) for w in issues]}")
    tick = os.sysconf("SC_CLK_TCK")
    shares = sorted(
        ((ticks - before.get(tid, ("", 0))[1]) / tick / elapsed, name) for tid, (name, ticks) in after.items()
    )
    print(
        f"{spec.variant}: busiest threads (CPU share): "
        f"{[(name, round(share, 2)) for share, name in shares[::-1][:4]]}"
    )
    probe(spec.variant, "after the windows")
    alone = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        alone.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    print(f"{spec.variant}: host ms of one step issued on an idle GPU {sorted(round(a, 2) for a in alone)}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        analyse_trace(spec.variant, path)
        if trace_dir:
            with (
                open(path, "rb") as raw,
                gzip.open(os.path.join(trace_dir, f"{spec.variant}.json.gz"), "wb") as out,
            ):
                shutil.copyfileobj(raw, out)
    probe(spec.variant, "at the end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", type=int, nargs=4, default=[1024, 2816, 32, 4096], metavar=("H", "I", "L", "T")
    )
    parser.add_argument("--variants", nargs="*", default=["stock-compiled", "fused-compiled"])
    parser.add_argument("--trace", metavar="DIR", help="also write each variant's trace here")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--spec", help=argparse.SUPPRESS)  # one variant, in a fresh process
    args = parser.parse_args()
    if args.spec:
        run(RunSpec(**json.loads(args.spec)), args.trace)
        return
    if start_gpu_log(args.commit, "step_host_vs_gpu.py needs a CUDA GPU") is None:
        return
    hidden, inter, layers, tokens = args.size
    for variant in args.variants:
        spec = RunSpec(variant=variant, hidden=hidden, intermediate=inter, layers=layers, tokens=tokens)
        command = [sys.executable, __file__, "--spec", json.dumps(spec.__dict__)]
        subprocess.run(command + (["--trace", args.trace] if args.trace else []), check=False)


if __name__ == "__main__":
    main()
