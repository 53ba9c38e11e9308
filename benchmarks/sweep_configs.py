"""Time every candidate tile config of the two fused kernels against the cuBLAS GEMM each replaces.

Run on the GPU: ``python benchmarks/sweep_configs.py --out results.json``. For each shape it times,
in one process and interleaved, the cuBLAS floor of the kernel's GEMM and each config (median of
``--reps`` repetitions of ``triton.testing.do_bench`` medians), checks each config's output against
eager PyTorch, and records configs that fail to compile (e.g. out of shared memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import triton
import triton.testing

from fused_swiglu.kernels import glu_backward as bwd_mod
from fused_swiglu.kernels import glu_forward as fwd_mod
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.configs import TileConfig
from fused_swiglu.testing import make_problem, relative_error

SHAPES = {
    "llama3-8b": (8192, 4096, 14336),
    "qwen2.5-0.5b": (16384, 896, 4864),
}


def candidate_configs() -> list[TileConfig]:
    c = TileConfig
    return [
        c(128, 128, 64, num_warps=8, num_stages=3, epilogue_split=2),
        c(128, 64, 64, num_warps=8, num_stages=4, epilogue_split=1),
        c(128, 128, 64, num_warps=8, num_stages=3, epilogue_split=1),
        c(128, 128, 64, num_warps=8, num_stages=4, epilogue_split=2),
        c(128, 128, 64, num_warps=8, num_stages=3, epilogue_split=2, flatten=True),
        c(128, 128, 32, num_warps=8, num_stages=5, epilogue_split=2),
        c(128, 64, 64, num_warps=4, num_stages=4, epilogue_split=1),
        c(64, 128, 64, num_warps=4, num_stages=4, epilogue_split=2),
        c(256, 64, 64, num_warps=8, num_stages=3, epilogue_split=1),
    ]


# Wider chunks are timed on the first configs only: enough to see whether the chunk width costs anything.
WIDE_CHUNK_CONFIGS = 2


def bench(fn, reps: int) -> float:
    return statistics.median(triton.testing.do_bench(fn, warmup=25, rep=100) for _ in range(reps))


def label(cfg: TileConfig) -> str:
    s = f"{cfg.block_m}x{2 * cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
    s += f" e{cfg.epilogue_split}"
    if cfg.flatten:
        s += " flat"
    if cfg.group_m != 8:
        s += f" g{cfg.group_m}"
    return s


def sweep_shape(name, m, h, i, reps, chunks, out_rows):
    p = make_problem(m, h, i, dtype=torch.bfloat16, device="cuda", seed=1)
    wp = p.w_gate_up.contiguous()
    ref_a = torch.nn.functional.silu(p.x.float() @ p.w_gate.float().t()) * (p.x.float() @ p.w_up.float().t())
    ref_da = p.dy.float() @ p.w_down.float()
    gemm_fwd = bench(lambda: torch.mm(p.x, wp.t()), reps)
    gemm_bwd = bench(lambda: torch.mm(p.dy, p.w_down), reps)
    print(
        f"\n== {name} M={m} H={h} I={i}: cuBLAS x@Wp^T {gemm_fwd:.3f} ms, dY@Wd {gemm_bwd:.3f} ms", flush=True
    )
    out_rows.append({"shape": name, "kernel": "cublas", "fwd_ms": gemm_fwd, "bwd_ms": gemm_bwd})
    for chunk in chunks:
        fwd_mod.CHUNK = bwd_mod.CHUNK = chunk
        configs = candidate_configs()
        for cfg in configs if chunk == 8 else configs[:WIDE_CHUNK_CONFIGS]:
            if cfg.block_n // cfg.epilogue_split < chunk:
                continue
            for save in (Saved.NOTHING, Saved.FACTORS, Saved.PREACT):
                row = {"shape": name, "chunk": chunk, "config": label(cfg), "save": save.name}
                t0 = time.time()
                try:
                    a, saved = fwd_mod.glu_forward(
                        p.x, wp, gate_scale=1.0, out_scale=1.0, save=save, config=cfg
                    )
                    torch.cuda.synchronize()
                    row["compile_s"] = time.time() - t0
                    if chunk == 8:
                        row["a_err"] = relative_error(a, ref_a)
                    row["fwd_ms"] = bench(
                        lambda cfg=cfg, save=save: fwd_mod.glu_forward(
                            p.x, wp, gate_scale=1.0, out_scale=1.0, save=save, config=cfg
                        ),
                        reps,
                    )
                    if save != Saved.NOTHING:
                        pristine = saved.clone()
                        work = saved.clone()

                        def step(cfg=cfg, save=save, work=work, pristine=pristine):
                            work.copy_(pristine)
                            bwd_mod.glu_backward_(
                                p.dy, p.w_down, work, gate_scale=1.0, out_scale=1.0, kind=save, config=cfg
                            )

                        step()
                        torch.cuda.synchronize()
                        if chunk == 8:
                            from fused_swiglu.layout import split_packed_columns

                            du, _ = split_packed_columns(work.float())
                            fu, _ = split_packed_columns(pristine.float())
                            silu_ref = (
                                fu
                                if save == Saved.FACTORS
                                else torch.nn.functional.silu(split_packed_columns(pristine.float())[1])
                            )
                            row["dU_err"] = relative_error(du, ref_da * silu_ref)
                        copy_ms = bench(lambda work=work, pristine=pristine: work.copy_(pristine), reps)
                        row["bwd_ms"] = bench(step, reps) - copy_ms
                except Exception as e:  # noqa: BLE001 - a failed config is a result, not a crash
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                out_rows.append(row)
                fwd = row.get("fwd_ms")
                msg = (
                    f"C{chunk:<3} {row['config']:<36} {save.name:<8} fwd {fwd:.3f} ({fwd / gemm_fwd:.3f}x)"
                    if fwd
                    else f"C{chunk:<3} {row['config']:<36} {save.name:<8} ERR {row.get('error')}"
                )
                if "bwd_ms" in row:
                    msg += f"  bwd {row['bwd_ms']:.3f} ({row['bwd_ms'] / gemm_bwd:.3f}x)"
                for k in ("a_err", "dU_err"):
                    if k in row:
                        msg += f" {k}={row[k]:.1e}"
                print(msg, flush=True)
    fwd_mod.CHUNK = bwd_mod.CHUNK = 8


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--chunks", nargs="*", type=int, default=[8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="sweep.json")
    args = ap.parse_args()
    rows: list[dict] = []
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    for name in args.shapes:
        sweep_shape(name, *SHAPES[name], args.reps, args.chunks, rows)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
