"""Time candidate tile configs of the two fused kernels against the cuBLAS GEMM each one replaces.

Run on the GPU: ``python benchmarks/sweep_configs.py --out sweep.json``. Per shape, in one process:
the cuBLAS floor of each kernel's GEMM, then every candidate (median of ``--reps`` repetitions of
``do_bench`` medians), each checked against eager PyTorch; configs that fail to compile (e.g. out of
shared memory) are recorded, not fatal. The backward kernel overwrites its input, so each timed run
first restores it from a pristine copy and the copy's own time is subtracted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton

from fused_swiglu.bench.measure import median_ms
from fused_swiglu.bench.run import SHAPES
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.configs import TileConfig
from fused_swiglu.kernels.glu_activation import glu_activation
from fused_swiglu.kernels.glu_backward import glu_backward_
from fused_swiglu.kernels.glu_forward import glu_forward
from fused_swiglu.layout import split_packed_columns
from fused_swiglu.testing import make_problem, relative_error

C = TileConfig
FORWARD_CANDIDATES = [
    C(128, 128, 64, num_warps=8, num_stages=3, epilogue_split=2, flatten=True),
    C(128, 128, 64, num_warps=8, num_stages=3, epilogue_split=4, flatten=True),
    C(128, 128, 128, num_warps=8, num_stages=2, epilogue_split=2, flatten=True),
    C(64, 128, 64, num_warps=4, num_stages=4, epilogue_split=2, flatten=True),
    C(128, 64, 64, num_warps=4, num_stages=3, epilogue_split=1, flatten=True, ctas_per_sm=2),
    C(128, 64, 64, num_warps=8, num_stages=4, epilogue_split=1, flatten=True),
    # The whole [128, 256] epilogue in one piece, with fewer or shorter stages to fit shared memory:
    # two TMA stores per tile instead of four, and the wait before reusing a staging buffer falls in
    # the next tile (Triton waits for every outstanding store before each staging write).
    C(128, 128, 64, num_warps=8, num_stages=2, epilogue_split=1, flatten=True),
    C(128, 128, 32, num_warps=8, num_stages=4, epilogue_split=1, flatten=True),
    C(128, 128, 32, num_warps=8, num_stages=3, epilogue_split=1, flatten=True),
]
BACKWARD_CANDIDATES = [
    C(128, 128, 64, num_warps=8, num_stages=3, epilogue_split=2, flatten=True),
    C(128, 256, 64, num_warps=8, num_stages=3, epilogue_split=4, flatten=True),
    C(128, 256, 64, num_warps=8, num_stages=3, epilogue_split=2, flatten=True),
    C(128, 256, 64, num_warps=8, num_stages=3, epilogue_split=4),
    C(256, 128, 64, num_warps=8, num_stages=3, epilogue_split=2, flatten=True),
    C(256, 128, 64, num_warps=8, num_stages=3, epilogue_split=4, flatten=True),
]
# Decode-sized batches read the whole weight for a few rows: more, narrower tiles spread that read
# over every SM.
DECODE_ROWS = (1, 16, 64)
DECODE_CANDIDATES = [
    C(64, 64, 128, num_warps=4, num_stages=4),
    C(64, 32, 128, num_warps=4, num_stages=4),
]


def bench(fn, reps: int) -> float:
    return statistics.median(median_ms(fn, warmup=25, rep=100) for _ in range(reps))


def label(cfg: TileConfig) -> str:
    s = f"{cfg.block_m}x{2 * cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
    s += f" e{cfg.epilogue_split}" + (" flat" if cfg.flatten else "")
    return s + (f" x{cfg.ctas_per_sm}/SM" if cfg.ctas_per_sm > 1 else "")


def attempt(row: dict, fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a config that fails is a result, not a crash
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:140]}"


def sweep_decode(name: str, h: int, i: int, reps: int, rows: list, batch_sizes) -> None:
    """Inference forward at decode batch sizes against cuBLAS x @ W_packed^T alone, and + silu * mul."""
    for m in batch_sizes:
        p = make_problem(m, h, i, dtype=torch.bfloat16, device="cuda", seed=1)
        wp = p.w_gate_up.contiguous()
        ref_a = F.silu(p.x.float() @ p.w_gate.float().t()) * (p.x.float() @ p.w_up.float().t())
        gemm = bench(lambda p=p, wp=wp: torch.mm(p.x, wp.t()), reps)
        eager = bench(lambda p=p: F.silu(p.x @ p.w_gate.t()) * (p.x @ p.w_up.t()), reps)
        print(f"\n== decode {name} M={m}: cuBLAS x@Wp^T {gemm * 1e3:.1f} us, eager {eager * 1e3:.1f} us")
        rows.append({"shape": f"{name}/M={m}", "kernel": "cublas", "fwd_ms": gemm, "eager_ms": eager})
        shape = f"{name}/M={m}"
        row = {"shape": shape, "kernel": "forward", "config": "cuBLAS + activation", "save": "NOTHING"}

        def unfused(p=p, wp=wp):
            return glu_activation(torch.mm(p.x, wp.t()), gate_multiplier=1.0, down_multiplier=1.0)

        row["a_err"] = relative_error(unfused(), ref_a)
        row["ms"] = bench(unfused, reps)
        row["ratio"] = row["ms"] / gemm
        rows.append(row)
        report(row)
        for cfg in DECODE_CANDIDATES:
            row = {"shape": f"{name}/M={m}", "kernel": "forward", "config": label(cfg), "save": "NOTHING"}

            def run(cfg=cfg, row=row, p=p, wp=wp, ref_a=ref_a, gemm=gemm):
                def launch():
                    return glu_forward(
                        p.x, wp, gate_multiplier=1.0, down_multiplier=1.0, save=Saved.NOTHING, config=cfg
                    )

                row["a_err"] = relative_error(launch()[0], ref_a)
                row["ms"] = bench(launch, reps)
                row["ratio"] = row["ms"] / gemm

            attempt(row, run)
            rows.append(row)
            report(row)


def sweep_shape(name: str, m: int, h: int, i: int, reps: int, rows: list, kernels: set) -> None:
    p = make_problem(m, h, i, dtype=torch.bfloat16, device="cuda", seed=1)
    wp = p.w_gate_up.contiguous()
    ref_a = F.silu(p.x.float() @ p.w_gate.float().t()) * (p.x.float() @ p.w_up.float().t())
    ref_da = p.dy.float() @ p.w_down.float()
    gemm_fwd = bench(lambda: torch.mm(p.x, wp.t()), reps)
    gemm_bwd = bench(lambda: torch.mm(p.dy, p.w_down), reps)
    print(
        f"\n== {name} M={m} H={h} I={i}: cuBLAS x@Wp^T {gemm_fwd:.3f} ms, dY@Wd {gemm_bwd:.3f} ms", flush=True
    )
    rows.append({"shape": name, "kernel": "cublas", "fwd_ms": gemm_fwd, "bwd_ms": gemm_bwd})

    for cfg in FORWARD_CANDIDATES if "forward" in kernels else []:
        for save in Saved:
            row = {"shape": name, "kernel": "forward", "config": label(cfg), "save": save.name}

            def run(cfg=cfg, save=save, row=row):
                def launch():
                    return glu_forward(
                        p.x, wp, gate_multiplier=1.0, down_multiplier=1.0, save=save, config=cfg
                    )

                t0 = time.time()
                a, _ = launch()
                torch.cuda.synchronize()
                row["first_s"] = time.time() - t0
                row["a_err"] = relative_error(a, ref_a)
                row["ms"] = bench(launch, reps)
                row["ratio"] = row["ms"] / gemm_fwd

            attempt(row, run)
            rows.append(row)
            report(row)

    for save in (Saved.FACTORS, Saved.PREACT) if "backward" in kernels else ():
        _, pristine = glu_forward(p.x, wp, gate_multiplier=1.0, down_multiplier=1.0, save=save)
        first, second = split_packed_columns(pristine.float())
        silu = first if save == Saved.FACTORS else F.silu(second)
        work = pristine.clone()
        copy_ms = bench(lambda work=work, pristine=pristine: work.copy_(pristine), reps)
        if save == Saved.FACTORS:
            # The unfused bar: dA through cuBLAS, then one broadcast multiply of the packed factors in place.
            def unfused(work=work, pristine=pristine):
                work.copy_(pristine)
                da = torch.mm(p.dy, p.w_down)
                work.view(m, i // 8, 2, 8).mul_(da.view(m, i // 8, 1, 8))

            row = {
                "shape": name,
                "kernel": "backward",
                "config": "unfused: cuBLAS dA + in-place mul",
                "save": save.name,
            }
            row["ms"] = bench(unfused, reps) - copy_ms
            row["ratio"] = row["ms"] / gemm_bwd
            row["dU_err"] = float("nan")
            rows.append(row)
            report(row)
        for cfg in BACKWARD_CANDIDATES:
            row = {"shape": name, "kernel": "backward", "config": label(cfg), "save": save.name}

            def run(cfg=cfg, save=save, row=row, work=work, pristine=pristine, silu=silu, copy_ms=copy_ms):
                def launch():
                    work.copy_(pristine)
                    glu_backward_(
                        p.dy, p.w_down, work, gate_multiplier=1.0, down_multiplier=1.0, save=save, config=cfg
                    )

                t0 = time.time()
                launch()
                torch.cuda.synchronize()
                row["first_s"] = time.time() - t0
                row["dU_err"] = relative_error(split_packed_columns(work.float())[0], ref_da * silu)
                row["ms"] = bench(launch, reps) - copy_ms
                row["ratio"] = row["ms"] / gemm_bwd

            attempt(row, run)
            rows.append(row)
            report(row)


def report(row: dict) -> None:
    head = f"{row['kernel']:<8} {row['config']:<40} {row['save']:<8}"
    if "error" in row:
        print(f"{head} ERR {row['error']}", flush=True)
        return
    err = row.get("a_err", row.get("dU_err"))
    print(f"{head} {row['ms']:.3f} ms ({row['ratio']:.3f}x cuBLAS) err={err:.1e}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--kernels", nargs="*", default=["forward", "backward"], choices=["forward", "backward"])
    ap.add_argument("--decode", nargs="*", default=[], choices=list(SHAPES), help="shapes at decode sizes")
    ap.add_argument("--decode-rows", nargs="+", type=int, default=list(DECODE_ROWS), help="decode rows")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="sweep.json")
    args = ap.parse_args()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    rows: list[dict] = []
    for name in args.shapes:
        sweep_shape(name, *SHAPES[name], args.reps, rows, set(args.kernels))
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for name in args.decode:
        sweep_decode(name, *SHAPES[name][1:], args.reps, rows, args.decode_rows)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
