"""The ``bench`` command: measure, print, and write JSON, Markdown and plots."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..functional import DEFAULT_SAVE
from .coldstart import cold_start_seconds, experts_cold_start_seconds
from .decode import DECODE_ROWS, decode_table, measure_decode
from .experts import EXPERT_IMPLS, EXPERT_SHAPES, ROUTINGS, experts_table, measure_experts
from .fp8 import FP8_IMPLS, OUTLIERS, fp8_accuracy, measure_fp8_passes, measure_fp8_shape
from .glu import GLU_IMPL_NAMES, measure_factor_gradient, measure_glu_shape
from .host import HOST_PRECISIONS, measure_host_time
from .impls import EXTRA_IMPL_NAMES, IMPL_NAMES
from .measure import measure_shape
from .model import (
    EXTRA_VARIANTS,
    FP8_VARIANTS,
    MODEL_SIZES,
    PRECISIONS,
    VARIANTS,
    core_shares,
    model_table,
    plot_model,
    run_model_bench,
    side_by_side_groups,
)
from .report import provenance, provenance_header, shape_table, write_json, write_markdown, write_plots
from .training import GROUPED_VARIANTS

#: Half-precision dtypes the benchmark runs in (fp32 runs cuBLAS GEMMs: docs/design/kernel-choice.md).
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


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser)
    add_experts_arguments(parser)
    parser.add_argument(
        "--impls",
        nargs="*",
        default=list(IMPL_NAMES),
        choices=[*IMPL_NAMES, *EXTRA_IMPL_NAMES],
        metavar="IMPL",
        help=f"implementations (default: all of {', '.join(IMPL_NAMES)}; also {', '.join(EXTRA_IMPL_NAMES)})",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="dtype of every tensor")
    parser.add_argument(
        "--reps",
        type=positive_int,
        default=5,
        help="interleaved repetitions per metric (with --model: side-by-side runs, fresh processes each)",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    parser.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots")
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
        help="also time a new shape's first call in fresh processes (empty, then warm kernel cache); "
        "with --experts, each experts shape's",
    )
    parser.add_argument(
        "--host-time",
        type=int,
        nargs="*",
        metavar="N",
        help="also time the host side of one training call of each MLP, eager and compiled, bf16 and "
        "under autocast, at HIDDEN INTER ROWS "
        "(default: 1024 2816 16, small enough that the GPU waits for the host)",
    )
    parser.add_argument(
        "--fp8",
        nargs="*",
        choices=list(FP8_IMPLS),
        metavar="IMPL",
        help="benchmark the FP8 training step instead, against the bf16 and FP8 floors and torchao's "
        f"float8 recipes, with each one's accuracy (none named: all of {', '.join(FP8_IMPLS)})",
    )
    model = parser.add_argument_group(
        "whole model", "bench --model: train LlamaForCausalLM (built from a config) instead of the MLP alone"
    )
    model.add_argument(
        "--model",
        nargs="*",
        choices=list(MODEL_SIZES),
        metavar="SIZE",
        help=f"train whole models of these sizes (default with no SIZE: {', '.join(MODEL_SIZES)}; "
        "hidden x layers), each variant in a fresh process",
    )
    model.add_argument(
        "--model-size",
        type=int,
        nargs=4,
        action="append",
        default=[],
        metavar=("HIDDEN", "INTER", "LAYERS", "TOKENS"),
        help="an extra model size (tokens per step); repeatable",
    )
    model.add_argument(
        "--variants",
        nargs="*",
        default=list(VARIANTS),
        choices=[*VARIANTS, *EXTRA_VARIANTS, *FP8_VARIANTS],
        metavar="VARIANT",
        help=f"model variants (default: {', '.join(VARIANTS)}; also {', '.join(EXTRA_VARIANTS)}, "
        f'under mode="reduce-overhead", and in FP8 {", ".join(FP8_VARIANTS)})',
    )
    model.add_argument(
        "--precisions",
        nargs="*",
        default=["autocast"],
        choices=list(PRECISIONS),
        help="autocast: fp32 weights under bf16 autocast (default); bf16: every tensor bf16; fp32: no "
        "autocast (on CPU the interpreter's bf16 dot is wrong, so bf16 calls take the reference there)",
    )
    model.add_argument("--steps", type=positive_int, default=20, help="training steps per timing window")
    model.add_argument(
        "--windows",
        type=positive_int,
        default=10,
        help="timing windows per variant, taken in turn by the variants' processes (default 10)",
    )
    model.add_argument(
        "--at-once",
        type=positive_int,
        default=4,
        help="variants' processes alive side by side at most, each holding its model on the GPU "
        "(default 4); stock compiled and stock eager, where asked for, run in every group",
    )
    model.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        metavar="R",
        help="fine-tune with PEFT LoRA of rank R on every linear layer (base frozen; fused: PEFT, then swap)",
    )
    model.add_argument(
        "--moe",
        type=int,
        nargs=2,
        metavar=("EXPERTS", "TOP_K"),
        help="train Qwen3-MoE models instead: every layer's MLP EXPERTS routed experts of the size's "
        "intermediate size, TOP_K per token (Liger: apply_liger_kernel_to_qwen3_moe)",
    )
    model.add_argument(
        "--host-profile",
        action="store_true",
        help="also profile one more window per run on the host (torch.profiler): the operators that took "
        "the most host time per step, printed after each run and kept in results.json",
    )
    model.add_argument(
        "--pin-cores",
        action="store_true",
        help="run each of the processes side by side on its own share of the CPU cores (Linux)",
    )
    model.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (Triton interpreter)")
    model.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled variants")
    model.add_argument("--timeout", type=float, default=1200, help="seconds one variant's process may take")


def run(args: argparse.Namespace) -> int:
    if args.model is not None or args.model_size:
        return run_model(args)
    if args.fp8 is not None:
        return run_fp8(args)
    if args.experts is not None:
        return run_experts(args)
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
    if args.host_time is not None:
        extra_md += _host_time_section(args, extra_json)
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


def _host_time_section(args: argparse.Namespace, extra_json: dict) -> list[str]:
    hidden, inter, rows = args.host_time or (1024, 2816, 16)
    title = f"Host time of one training call (hidden={hidden}, intermediate={inter}, {rows} rows)"
    print(f"\n{title}", flush=True)
    found = [
        row
        for precision in HOST_PRECISIONS
        for row in measure_host_time(
            hidden, inter, rows, precision=precision, reps=args.reps, log=lambda s: print(s, flush=True)
        )
    ]
    extra_json["host_time"] = found
    from ..tables import format_table

    # Each against stock PyTorch run the same way: compiled against torch.compile, eager against eager.
    stock = {(r["impl"], r["precision"]): r["host_us"] for r in found}
    cells = [
        [
            r["impl"],
            r["precision"],
            r["host_us"],
            f"{r['host_us_min']:.1f}-{r['host_us_max']:.1f}",
            r["host_us"] / stock[("torch.compile" if "compile" in r["impl"] else "eager", r["precision"])],
        ]
        for r in found
    ]
    table = format_table(["impl", "precision", "us per call", "min-max", "vs stock"], cells, True)
    return [
        f"## {title}",
        "",
        "Calls back to back, wall time per call (host-bound at this size); each call's gradients set to "
        "None after it, as `zero_grad` does. `bf16`: every tensor bf16; `autocast`: fp32 weights under "
        "bf16 autocast, as in `bench --model`. vs stock: over eager PyTorch's call, compiled ones over "
        "`torch.compile`'s.",
        "",
        table,
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


FP8_COLUMNS = [
    ("impl", "impl"),
    ("step_ms", "fwd+bwd ms"),
    ("step_vs_floor", "vs bf16 floor"),
    ("step_vs_fp8_floor", "vs fp8 floor"),
    ("fwd_ms", "fwd ms"),
    ("no_grad_fwd_ms", "no_grad fwd ms"),
    ("kept_mib", "kept MiB"),
    ("peak_mib", "peak MiB"),
    ("first_call_s", "first call s"),
]
FP8_ACCURACY_COLUMNS = [
    ("impl", "impl"),
    ("sqnr_y", "y dB"),
    ("sqnr_dx", "dx dB"),
    ("sqnr_dw_gate_up", "dW_gate_up dB"),
    ("sqnr_dw_down", "dW_down dB"),
]


def _rows_table(rows: list[dict], columns: list[tuple[str, str]], markdown: bool = False) -> str:
    from ..tables import format_table

    body = [
        [row["impl"], f"missing: {row['missing']}"] + [None] * (len(columns) - 2)
        if "missing" in row
        else [row.get(key) for key, _ in columns]
        for row in rows
    ]
    return format_table([title for _, title in columns], body, markdown)


def _passes_table(rows: list[dict], markdown: bool = False) -> str:
    from ..tables import format_table

    headers = ["pass", "ms", "MB", "GB/s", "of copy"]
    return format_table(headers, [[r[h] for h in headers] for r in rows], markdown)


def run_fp8(args: argparse.Namespace) -> int:
    """``bench --fp8``: the FP8 step at each shape (a table per shape), and at the first shape the
    accuracy of each implementation on Gaussian inputs and with outlier channels; JSON, Markdown and
    a plot under ``OUT/fp8``."""
    if not torch.cuda.is_available():
        print("bench --fp8 needs a CUDA GPU (tests/test_fp8.py checks the FP8 path on CPU)")
        return 2
    impls = args.fp8 or list(FP8_IMPLS)
    meta = provenance(args.commit) | {"torchao": _version_of("torchao")}
    print(
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, torchao {meta['torchao']}, "
        f"commit {meta['commit'][:12]}"
    )
    out = args.out / "fp8"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    accuracy: dict[str, list[dict]] = {}
    pass_times: dict[str, list[dict]] = {}
    lines = [
        "# FP8 training step of the MLP",
        "",
        provenance_header(meta) + f", torchao {meta['torchao']}. bf16 inputs and weights; "
        "`triton.testing.do_bench` medians of medians, every implementation interleaved in one process. "
        "floor: the six bf16 cuBLAS GEMMs; fp8-floor: the FP8 path's six blockwise-scaled cuBLAS GEMMs "
        "(1 x 128 / 128 x 128, precise accumulation); fp8-floor-tensorwise: six FP8 GEMMs with one scale "
        "per tensor and fast accumulation. torchao's recipes and fused-fp8-compiled under torch.compile.",
        "",
    ]

    def save() -> None:
        (out / "results.json").write_text(
            json.dumps(
                {"meta": meta, "results": results, "passes": pass_times, "accuracy": accuracy}, indent=1
            )
        )
        (out / "results.md").write_text("\n".join(lines) + "\n")

    shapes = chosen_shapes(args)
    for name, (m, h, i) in shapes.items():
        print(f"\n{name}: M={m} hidden={h} intermediate={i}", flush=True)
        rows = measure_fp8_shape(m, h, i, impls, reps=args.reps, log=lambda s: print(s, flush=True))
        results[name] = rows
        print(_rows_table(rows, FP8_COLUMNS), flush=True)
        lines += [
            f"## {name} (M={m}, hidden={h}, intermediate={i})",
            "",
            _rows_table(rows, FP8_COLUMNS, True),
            "",
        ]
        passes = measure_fp8_passes(m, h, i, reps=args.reps)
        pass_times[name] = passes
        print(_passes_table(passes), flush=True)
        lines += ["Each pass alone, against a device copy's rate:", "", _passes_table(passes, True), ""]
        save()
    name, (m, h, i) = next(iter(shapes.items()))
    lines += [
        f"## Accuracy at {name}: SQNR against float64 (higher is better)",
        "",
        "The same bf16 inputs, weights and output gradient for every implementation; outliers: four of "
        "x's channels scaled by 100 or 1000.",
        "",
    ]
    for kind, scale in OUTLIERS.items():
        rows = fp8_accuracy(m, h, i, impls, scale)
        accuracy[kind] = rows
        print(f"\naccuracy, {kind}:", _rows_table(rows, FP8_ACCURACY_COLUMNS), sep="\n", flush=True)
        lines += [f"{kind}:", "", _rows_table(rows, FP8_ACCURACY_COLUMNS, True), ""]
        save()
    if not args.no_plots:
        write_plots(out, results, bottom=0.0)
    print(f"\nwrote {out}")
    return 0


def _version_of(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_model(args: argparse.Namespace) -> int:
    """``bench --model``: whole models, every variant in a fresh process; a table, JSON, Markdown, PNG."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench --model needs a CUDA GPU (or --device cpu for a smoke run under the Triton interpreter)")
        return 2
    grouped = [v for v in args.variants if v in GROUPED_VARIANTS]
    if grouped and not args.moe:
        print(f"{', '.join(grouped)}: transformers' grouped experts, for --moe models only")
        return 2
    try:
        groups = side_by_side_groups(args.variants, args.at_once)
    except ValueError as error:
        print(f"bench --model --at-once: {error}")
        return 2
    if args.pin_cores:
        try:
            core_shares(max(len(group) for group in groups))
        except ValueError as error:
            print(f"bench --model --pin-cores: {error}")
            return 2
    sizes = {name: MODEL_SIZES[name] for name in (args.model or ([] if args.model_size else MODEL_SIZES))}
    sizes |= {f"{h}/{i}x{n}-{t}": (h, i, n, t) for h, i, n, t in args.model_size}
    meta = provenance(args.commit, args.device)
    print(f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit'][:12]}")
    results, rows = run_model_bench(
        sizes,
        args.variants,
        args.precisions,
        reps=args.reps,
        steps=args.steps,
        windows=args.windows,
        at_once=args.at_once,
        device=args.device,
        backend=args.backend,
        timeout=args.timeout,
        lora_rank=args.lora_rank,
        moe=tuple(args.moe) if args.moe else None,
        host_profile=args.host_profile,
        pin_cores=args.pin_cores,
        log=lambda line: print(line, flush=True),
    )
    print(model_table(rows), flush=True)
    out = args.out / "model"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": results}, indent=1))
    header = (
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, transformers "
        f"{meta.get('transformers')}, liger-kernel {meta.get('liger_kernel')}, commit {meta['commit'][:12]}, "
        f"{meta['date']}. Each variant in a fresh process, {args.reps} time(s), at most {args.at_once} "
        "processes side by side (stock's variants in every group"
        f"{'; each on its own CPU cores' if args.pin_cores else ''}) taking turns: "
        f"{args.windows} rounds of one window of {args.steps} steps each. ms/step: "
        "median (min-max) of the windows; vs stock: median (min-max) of the window-by-window ratios to "
        "stock's window of the same round."
    )
    (out / "results.md").write_text(f"# Whole-model training step\n\n{header}\n\n{model_table(rows, True)}\n")
    written = [out / "results.json", out / "results.md"]
    if not args.no_plots:
        plot_model(rows, out / "step_vs_stock.png")
        written.append(out / "step_vs_stock.png")
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0 if all("error" not in r for r in results) else 1


def add_experts_arguments(parser: argparse.ArgumentParser) -> None:
    experts = parser.add_argument_group("routed experts (bench --experts)")
    experts.add_argument(
        "--experts",
        nargs="*",
        choices=list(EXPERT_SHAPES),
        metavar="NAME",
        help=f"routed SwiGLU experts at these shapes (none named: all of {', '.join(EXPERT_SHAPES)})",
    )
    experts.add_argument(
        "--expert-impls",
        nargs="*",
        default=list(EXPERT_IMPLS),
        choices=list(EXPERT_IMPLS),
        metavar="IMPL",
        help=f"implementations (default: all of {', '.join(EXPERT_IMPLS)})",
    )
    experts.add_argument(
        "--routing", nargs="*", default=list(ROUTINGS), choices=list(ROUTINGS), help="routings of the tokens"
    )
    experts.add_argument("--tokens", type=int, default=8192, help="tokens per step")


def run_experts(args: argparse.Namespace) -> int:
    """``bench --experts``: a table per shape and routing; JSON, Markdown and PNG under ``OUT/experts``."""
    if not torch.cuda.is_available():
        print("bench --experts needs a CUDA GPU (tests/test_experts.py checks the experts on CPU)")
        return 2
    meta = provenance(args.commit) | {"dtype": args.dtype, "tokens": args.tokens}
    print(f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit'][:12]}")
    out = args.out / "experts"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    lines = [f"# Routed experts, training step ({args.tokens} tokens, {args.dtype})", ""]
    for name in args.experts or list(EXPERT_SHAPES):
        shape = EXPERT_SHAPES[name]
        for kind in args.routing:
            title = f"{name}-{kind}"
            hidden, inter, experts, top_k = shape
            print(
                f"\n{title}: hidden={hidden} intermediate={inter} experts={experts} top-{top_k}", flush=True
            )
            rows = measure_experts(
                shape, kind, args.expert_impls, tokens=args.tokens, reps=args.reps, dtype=DTYPES[args.dtype]
            )
            results[title] = rows
            print(experts_table(rows), flush=True)
            lines += [
                f"## {title} (hidden {hidden}, intermediate {inter}, {experts} experts, top-{top_k})",
                "",
            ]
            lines += [experts_table(rows, True), ""]
            (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
            (out / "results.md").write_text(provenance_header(meta) + "\n\n" + "\n".join(lines))
    if args.cold_start:
        cold_start = {}
        for name in args.experts or list(EXPERT_SHAPES):
            cold, warm = experts_cold_start_seconds(
                args.tokens, EXPERT_SHAPES[name], "factors", DTYPES[args.dtype]
            )
            cold_start[name] = {"empty_cache_s": cold, "warm_cache_s": warm}
            print(
                f"{name}: first call {cold:.2f} s with an empty Triton cache, {warm:.2f} s reusing it",
                flush=True,
            )
        lines += ['## First call in a fresh process (training step, `save="factors"`)', ""]
        lines += [
            f"- {n}: {c['empty_cache_s']:.2f} s with an empty Triton cache, {c['warm_cache_s']:.2f} s in a "
            "second process reusing it"
            for n, c in cold_start.items()
        ]
        results_json = {"meta": meta, "results": results, "cold_start": cold_start}
        (out / "results.json").write_text(json.dumps(results_json, indent=1))
        (out / "results.md").write_text(provenance_header(meta) + "\n\n" + "\n".join(lines) + "\n")
    if not args.no_plots and results:
        write_plots(out, results)
    print(f"\nwrote {out}")
    return 0
