"""The ``bench`` command: measure, print, and write JSON, Markdown and plots."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..functional import DEFAULT_SAVE
from .coldstart import cold_start_seconds
from .decode import DECODE_ROWS, decode_table, measure_decode
from .glu import GLU_IMPL_NAMES, measure_factor_gradient, measure_glu_shape
from .impls import EXTRA_IMPL_NAMES, IMPL_NAMES
from .measure import measure_shape
from .report import provenance, shape_table, write_json, write_markdown, write_plots

#: Half-precision dtypes the benchmark runs in (fp32 runs cuBLAS GEMMs, see ``benchmarks/fp32_step.py``).
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

SHAPES = {
    "llama3-8b": (8192, 4096, 14336),
    "qwen2.5-7b": (8192, 3584, 18944),
    "M11136-H3584-I14336": (11136, 3584, 14336),
    "llama2-7b": (4096, 4096, 11008),
    "qwen2.5-0.5b": (16384, 896, 4864),
}


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """``--shapes NAME ...`` (benchmark shapes) and ``--shape M H I`` (repeatable extra shapes)."""
    parser.add_argument(
        "--shapes",
        nargs="*",
        default=list(SHAPES),
        choices=list(SHAPES),
        metavar="NAME",
        help=f"named shapes (default: all of {', '.join(SHAPES)})",
    )
    parser.add_argument(
        "--shape",
        type=int,
        nargs=3,
        action="append",
        default=[],
        metavar=("M", "HIDDEN", "INTER"),
        help="an extra shape; repeatable",
    )


def chosen_shapes(args: argparse.Namespace) -> dict[str, tuple[int, int, int]]:
    """The named shapes, then the extra ones (named ``M{m}-H{h}-I{i}``), from ``add_shape_arguments``."""
    return {name: SHAPES[name] for name in args.shapes} | {
        f"M{m}-H{h}-I{i}": (m, h, i) for m, h, i in args.shape
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser)
    parser.add_argument(
        "--impls",
        nargs="*",
        default=list(IMPL_NAMES),
        choices=[*IMPL_NAMES, *EXTRA_IMPL_NAMES],
        metavar="IMPL",
        help=f"implementations (default: all of {', '.join(IMPL_NAMES)}; also {', '.join(EXTRA_IMPL_NAMES)})",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="dtype of every tensor")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions per metric")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    parser.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--glu",
        type=int,
        nargs="*",
        metavar="N",
        help="also benchmark the GLU operator alone at M H I (default: 11136 3584 14336)",
    )
    parser.add_argument(
        "--decode",
        type=int,
        nargs="*",
        metavar="M",
        help="also time the no_grad forward at these batch sizes (default: "
        f"{' '.join(map(str, DECODE_ROWS))}) with the first shape's hidden and intermediate sizes",
    )
    parser.add_argument(
        "--sustained",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also run each training step back to back for this long per repetition, as a training "
        "loop runs it (warm L2, the clock where the power limit puts it); off by default",
    )
    parser.add_argument(
        "--cold-start",
        action="store_true",
        help="also time a new shape's first call in fresh processes (empty, then warm kernel cache)",
    )


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU (use `python -m fused_swiglu check` to check the kernels on CPU)")
        return 2
    if args.glu and len(args.glu) != 3:
        print(f"--glu takes M H I (three integers) or nothing, got {args.glu}")
        return 2
    shapes = chosen_shapes(args)
    meta = provenance(args.commit) | {"dtype": args.dtype}
    if args.sustained > 0:
        meta["sustained_s"] = args.sustained
    dtype = DTYPES[args.dtype]
    print(f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit'][:12]}")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    extra_json: dict = {}
    extra_md: list[str] = []

    def save() -> list[Path]:
        # After every stage, so a later failure or time-out keeps what was measured.
        write_json(args.out / "results.json", meta, results, extra_json)
        write_markdown(args.out / "results.md", meta, results, extra_md)
        written = [args.out / "results.json", args.out / "results.md"]
        if not args.no_plots and results:
            written += write_plots(args.out, results)
        return written

    for name, (m, h, i) in shapes.items():
        print(f"\n{name}: M={m} hidden={h} intermediate={i}", flush=True)
        results[name] = measure_shape(
            m,
            h,
            i,
            args.impls,
            dtype=dtype,
            reps=args.reps,
            log=lambda s: print(s, flush=True),
            sustained_s=args.sustained,
        )
        print(shape_table(results[name]), flush=True)
        save()
    if args.glu is not None:
        extra_md += _glu_section(args, dtype, extra_json)
        save()
    if args.decode is not None:
        extra_md += _decode_section(args, dtype, shapes, extra_json)
        save()
    if args.cold_start:
        extra_md += _cold_start_section(shapes, dtype, extra_json)
    print("\nwrote " + ", ".join(str(p) for p in save()))
    return 0


def _glu_section(args: argparse.Namespace, dtype: torch.dtype, extra_json: dict) -> list[str]:
    m, h, i = args.glu or (11136, 3584, 14336)
    name = f"GLU operator M{m}-H{h}-I{i}"
    print(f"\n{name}", flush=True)
    rows = measure_glu_shape(
        m, h, i, list(GLU_IMPL_NAMES), dtype=dtype, reps=args.reps, log=lambda s: print(s, flush=True)
    )
    print(shape_table(rows), flush=True)
    grad = measure_factor_gradient(m, h, i, dtype)
    extra_json["glu"] = {"shape": [m, h, i], "rows": rows, "factor_gradient": grad}
    line = (
        f"In-place factor gradient alone ([f_up | f_gate] * dA, M={m}, I={i}): Triton kernel "
        f"{grad['kernel_ms']:.3f} ms ({grad['kernel_tb_s']:.2f} TB/s), broadcast mul_ "
        f"{grad['torch_mul_ms']:.3f} ms ({grad['torch_mul_tb_s']:.2f} TB/s)."
    )
    print(line, flush=True)
    return [
        f"## {name}",
        "",
        "floor = x @ W^T, grad @ W, grad^T @ x (cuBLAS).",
        "",
        shape_table(rows, True),
        "",
        line,
        "",
    ]


def _decode_section(
    args: argparse.Namespace, dtype: torch.dtype, shapes: dict, extra_json: dict
) -> list[str]:
    name, (_, h, i) = next(iter(shapes.items()), ("llama3-8b", SHAPES["llama3-8b"]))
    title = f"Decode sizes, no_grad forward ({name}: hidden={h}, intermediate={i})"
    print(f"\n{title}", flush=True)
    rows = measure_decode(
        h,
        i,
        args.decode or list(DECODE_ROWS),
        dtype=dtype,
        reps=args.reps,
        log=lambda s: print(s, flush=True),
    )
    print("Issued from Python:", decode_table(rows), sep="\n", flush=True)
    print("Replayed from a CUDA graph:", decode_table(rows, metric="graph_fwd"), sep="\n", flush=True)
    extra_json["decode"] = {"shape": name, "rows": rows}
    note = (
        "floor = the forward's two cuBLAS GEMMs. Issued from Python, host launch time is included "
        "wherever it exceeds the GPU time, as it is for an eager caller; replayed from a CUDA graph, "
        "only the GPU time counts, as for a server that captures its decode step."
    )
    return [
        f"## {title}",
        "",
        note,
        "",
        "Issued from Python:",
        "",
        decode_table(rows, markdown=True),
        "",
        "Replayed from a CUDA graph:",
        "",
        decode_table(rows, markdown=True, metric="graph_fwd"),
        "",
    ]


def _cold_start_section(shapes: dict, dtype: torch.dtype, extra_json: dict) -> list[str]:
    name, (m, h, i) = next(iter(shapes.items()), ("llama3-8b", SHAPES["llama3-8b"]))
    cold, warm = cold_start_seconds(m, h, i, DEFAULT_SAVE, dtype)
    extra_json["cold_start"] = {
        "shape": name,
        "save": DEFAULT_SAVE,
        "empty_cache_s": cold,
        "reused_cache_s": warm,
    }
    dtype_name = str(dtype).removeprefix("torch.")
    line = (
        f"First fwd+bwd ({DEFAULT_SAVE}, {dtype_name}) of a new shape ({name}) in a fresh process: "
        f"{cold:.2f} s with an empty Triton cache, {warm:.2f} s in a second process reusing it "
        "(process start excluded)."
    )
    print("\n" + line, flush=True)
    return [line, ""]
