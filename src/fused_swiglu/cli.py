"""``python -m fused_swiglu check``: run the fused kernels, check them against the reference, time them.

On a GPU it checks a realistic shape (default LLaMA-3-8B's MLP, 8192 tokens, bf16) and times the fused
training step and inference forward beside eager PyTorch. Without a GPU it runs the same kernels
under the Triton interpreter on a small problem, says so, and still checks them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MLP_SAVES = ("factors", "preact", "recompute")
GLU_SAVES = ("factors", "recompute")
TIMING_ROUNDS = 4


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(args: argparse.Namespace) -> int:
    # Imported late: Triton fixes interpreter mode when the kernels are defined.
    from .functional import swiglu_linear, swiglu_mlp
    from .reference import reference_swiglu_mlp
    from .tables import format_table
    from .testing import (
        accuracy_rows,
        glu_oracle_step,
        make_problem,
        oracle_step,
        run_eager_glu_step,
        run_eager_step,
        run_glu_step,
        run_step,
    )

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    m, hidden, inter = args.shape or ((8192, 4096, 14336) if on_gpu else (96, 64, 136))
    dtypes = (
        [DTYPES[args.dtype]]
        if args.dtype
        else ([torch.bfloat16] if on_gpu else [torch.float32, torch.float16])
    )
    if on_gpu:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    else:
        print(
            "No CUDA device: running the real Triton kernels on CPU under the Triton interpreter "
            "(TRITON_INTERPRET=1), on a small problem. Timings there are not meaningful and are skipped."
        )
    gm, dm = args.gate_multiplier, args.down_multiplier
    print(f"shape: M={m} hidden={hidden} intermediate={inter}, gate_multiplier={gm}, down_multiplier={dm}\n")

    all_ok = True
    for dtype in dtypes:
        problem = make_problem(
            m, hidden, inter, dtype=dtype, device=device, gate_multiplier=gm, down_multiplier=dm
        )
        rows = []
        oracle, eager = oracle_step(problem), run_eager_step(problem)
        for save in MLP_SAVES:

            def fused(x, w, wd, save=save):
                return swiglu_mlp(x, w, wd, gate_multiplier=gm, down_multiplier=dm, save=save)

            rows += [
                ("swiglu_mlp", save, r) for r in accuracy_rows(run_step(fused, problem), eager, oracle, dtype)
            ]
        oracle, eager = glu_oracle_step(problem), run_eager_glu_step(problem)
        for save in GLU_SAVES:

            def fused_glu(x, w, save=save):
                return swiglu_linear(x, w, gate_multiplier=gm, save=save)

            glu = run_glu_step(fused_glu, problem)
            rows += [("swiglu_linear", save, r) for r in accuracy_rows(glu, eager, oracle, dtype)]
        del oracle, eager
        all_ok &= all(r.ok for _, _, r in rows)
        table = [
            [
                op,
                save,
                r.name,
                r.fused,
                r.eager,
                r.fused / r.eager if r.eager else None,
                "ok" if r.ok else "FAIL",
            ]
            for op, save, r in rows
        ]
        print(f"accuracy, {str(dtype).removeprefix('torch.')}: relative error against the float64 reference")
        print(
            format_table(["op", "save", "tensor", "fused", "eager", "fused/eager", "within 2x eager"], table)
        )
        print()
        if on_gpu:
            _print_timings(problem, swiglu_mlp, reference_swiglu_mlp, format_table)
    print("check passed" if all_ok else "check FAILED: fused error above 2x eager's")
    return 0 if all_ok else 1


def _print_timings(problem, swiglu_mlp, reference_swiglu_mlp, format_table) -> None:
    from triton.testing import do_bench

    gm, dm = problem.gate_multiplier, problem.down_multiplier
    x = problem.x.detach().requires_grad_()
    w_gate_up = problem.w_gate_up.detach().requires_grad_()
    w_gate = problem.w_gate.detach().requires_grad_()
    w_up = problem.w_up.detach().requires_grad_()
    w_down = problem.w_down.detach().requires_grad_()

    def fused(save):
        return lambda: swiglu_mlp(x, w_gate_up, w_down, gate_multiplier=gm, down_multiplier=dm, save=save)

    def eager():
        return reference_swiglu_mlp(x, w_gate, w_up, w_down, gate_multiplier=gm, down_multiplier=dm)

    impls = {f"fused ({s})": fused(s) for s in MLP_SAVES} | {"eager PyTorch": eager}
    first: dict[str, float] = {}
    for name, forward in impls.items():
        t0 = time.perf_counter()
        forward().backward(problem.dy)
        torch.cuda.synchronize()
        first[name] = time.perf_counter() - t0
    # One timing of each, back to back, moves with what ran just before, so the order rotates every
    # round and each figure is the median over the rounds.
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in impls}
    names = list(impls)
    for rotation in range(TIMING_ROUNDS):
        shift = rotation % len(names)
        for name in names[shift:] + names[:shift]:
            forward = impls[name]
            step_ms = do_bench(
                lambda forward=forward: forward().backward(problem.dy),
                return_mode="median",
                grad_to_none=[x, w_gate_up, w_gate, w_up, w_down],
            )
            with torch.no_grad():
                fwd_ms = do_bench(forward, return_mode="median")
            samples[name].append((step_ms, fwd_ms))
    rows = [
        [name, statistics.median(s for s, _ in runs), statistics.median(f for _, f in runs), first[name]]
        for name, runs in samples.items()
    ]
    print(f"timings (ms, CUDA events, median of {TIMING_ROUNDS} rounds in rotating order; peers: `bench`)")
    print(format_table(["impl", "fwd+bwd", "no_grad fwd", "first call s"], rows))
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fused_swiglu",
        description=(
            "fused-swiglu: Triton kernels for the SwiGLU MLP of LLaMA/Mistral/Qwen-class models "
            "(also installed as the `fused-swiglu` command)"
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="check the fused kernels against the reference and time them",
        description="Check the fused MLP and GLU operator in every save mode against a float64 reference "
        "(the rule: within 2x eager PyTorch's own error) and, on a GPU, time them beside eager PyTorch. "
        "Without a GPU the same kernels run under the Triton interpreter on a small problem.",
    )
    check.add_argument(
        "--shape",
        type=int,
        nargs=3,
        metavar=("M", "HIDDEN", "INTERMEDIATE"),
        help="tokens, hidden and intermediate size (default: 8192 4096 14336 on a GPU, 96 64 136 on CPU)",
    )
    check.add_argument(
        "--dtype", choices=sorted(DTYPES), help="one dtype (default: bf16 on a GPU, fp32 and fp16 on CPU)"
    )
    check.add_argument("--gate-multiplier", type=float, default=1.0, help="Falcon-H1 style gate multiplier")
    check.add_argument("--down-multiplier", type=float, default=1.0, help="Falcon-H1 style output multiplier")
    from .bench.run import add_arguments as add_bench_arguments

    bench = sub.add_parser(
        "bench",
        help="benchmark against peers and the GEMM-only floor (GPU)",
        description="Time the fused MLP against eager PyTorch, torch.compile, Liger-Kernel, flash-swiglu-mlp "
        "and the six-GEMM cuBLAS floor, interleaved in one process (a peer not installed is reported as "
        "missing); with --experts routed SwiGLU experts against the grouped-GEMM floor and transformers' "
        "and Liger-Kernel's experts; with --model whole LlamaForCausalLM training steps, every variant "
        "in a fresh process. Writes a table, JSON, Markdown and PNG plots under --out.",
    )
    add_bench_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "bench":
        from .bench.run import run as run_bench

        return run_bench(args)

    if not torch.cuda.is_available() and not _interpreter_requested():
        # Re-run with the interpreter on: Triton decides interpreter mode when kernels are defined,
        # and importing this package has defined them already.
        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.call(
            [sys.executable, "-m", "fused_swiglu", *(argv if argv is not None else sys.argv[1:])], env=env
        )
    if args.command == "check":
        return _check(args)
    return 2
