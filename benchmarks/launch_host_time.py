"""Host time of the library's calls with the cached direct launch (``kernels/launch.py``) and with
every launch through Triton's JIT path, side by side in one process.

Run on the GPU: ``python benchmarks/launch_host_time.py [--commit SHA] [--out FILE.json]``. Cases: a
training step (forward and backward, gradients set to None between steps) at three sizes, and the
no_grad call at decode sizes. Per case and launch mode, alternating, seven repetitions (medians):
- "host": microseconds to issue one call while a GPU sleep keeps the GPU busy, so issuing never
  waits for it: the host's own cost;
- "wall": microseconds per call over 50 calls back to back from an idle GPU: where the host is
  slower than the GPU, this is what a user sees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fused_swiglu import swiglu_mlp
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.kernels import launch
from fused_swiglu.testing import make_problem

REPS = 7
CALLS = 50


def host_and_wall_us(fn) -> tuple[float, float]:
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU work queued ahead of the calls
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return 1e6 * host / CALLS, 1e6 * wall / CALLS


def training_step(m: int, hidden: int, inter: int):
    p = make_problem(m, hidden, inter, dtype=torch.bfloat16, device="cuda", seed=1)
    x, wgu, wd = (t.detach().requires_grad_() for t in (p.x, p.w_gate_up, p.w_down))

    def step():
        for t in (x, wgu, wd):
            t.grad = None
        swiglu_mlp(x, wgu, wd).backward(p.dy)

    return step


def no_grad_call(m: int, hidden: int, inter: int):
    p = make_problem(m, hidden, inter, dtype=torch.bfloat16, device="cuda", seed=1)

    @torch.no_grad()
    def call():
        swiglu_mlp(p.x, p.w_gate_up, p.w_down)

    return call


CASES = {
    "train qwen2.5-0.5b, 4096 tokens": (training_step, (4096, 896, 4864)),
    "train qwen2.5-0.5b, 8192 tokens": (training_step, (8192, 896, 4864)),
    "train llama3-8b, 8192 tokens": (training_step, (8192, 4096, 14336)),
    "no_grad llama3-8b, 1 row": (no_grad_call, (1, 4096, 14336)),
    "no_grad llama3-8b, 16 rows": (no_grad_call, (16, 4096, 14336)),
    "no_grad llama3-8b, 256 rows": (no_grad_call, (256, 4096, 14336)),
}
MODES = {"direct": True, "through triton": False}


def main(out: str | None, commit: str | None) -> None:
    meta = start_gpu_log(commit, "launch_host_time needs a CUDA GPU")
    if meta is None:
        raise SystemExit(1)
    if not launch.DIRECT:
        raise SystemExit("the direct launch is off here (it needs triton 3.6 on a GPU): nothing to compare")
    results = {}
    for case, (make, shape) in CASES.items():
        fn = make(*shape)
        samples = {mode: ([], []) for mode in MODES}
        for direct in MODES.values():  # warm both paths: compile, fill the launch caches
            launch.DIRECT = direct
            for _ in range(3):
                fn()
        for rep in range(REPS):
            order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
            for mode in order:
                launch.DIRECT = MODES[mode]
                host, wall = host_and_wall_us(fn)
                samples[mode][0].append(host)
                samples[mode][1].append(wall)
        launch.DIRECT = True
        row = {
            mode: {"host_us": statistics.median(h), "wall_us": statistics.median(w)}
            for mode, (h, w) in samples.items()
        }
        results[case] = {"shape": shape, **row}
        d, t = row["direct"], row["through triton"]
        print(
            f"{case:34s} host us: direct {d['host_us']:7.1f}  through triton {t['host_us']:7.1f}"
            f"  ({t['host_us'] - d['host_us']:+6.1f})   wall us: direct {d['wall_us']:7.1f}"
            f"  through triton {t['wall_us']:7.1f}  (ratio {t['wall_us'] / d['wall_us']:.3f})",
            flush=True,
        )
    if out:
        with open(out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--out", help="JSON file for the results")
    args = ap.parse_args()
    main(args.out, args.commit)
