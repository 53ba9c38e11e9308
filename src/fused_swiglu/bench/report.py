"""Benchmark output: JSON (with provenance), a Markdown table, and PNG plots."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton

from ..tables import format_table

COLUMNS = [
    ("impl", "impl"),
    ("step_ms", "fwd+bwd ms"),
    ("step_vs_floor", "vs floor"),
    ("sustained_ms", "sustained ms"),
    ("sustained_vs_floor", "vs floor"),
    ("fwd_ms", "fwd ms"),
    ("no_grad_fwd_ms", "no_grad fwd ms"),
    ("no_grad_fwd_vs_floor", "vs floor"),
    ("tflops", "TFLOP/s"),
    ("kept_mib", "kept MiB"),
    ("peak_mib", "peak MiB"),
    ("first_call_s", "first call s"),
]


def provenance(commit: str | None, device: str = "cuda") -> dict:
    if commit is None:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    meta = {
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    for package in ("liger_kernel", "flash_swiglu_mlp", "transformers"):
        try:
            from importlib.metadata import version

            meta[package] = version(package.replace("_", "-"))
        except Exception:  # noqa: BLE001 - absent peers are reported as missing elsewhere
            meta[package] = None
    return meta


def provenance_header(meta: dict) -> str:
    """The one line a benchmark log starts with, so every raw log says where it was measured."""
    return f"# {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}"


def start_gpu_log(commit: str | None, needs: str) -> dict | None:
    """For a benchmark script: its run's provenance, with the header line printed; or, without a CUDA
    GPU, ``None`` after printing ``needs`` (what the script needs, said in its own words)."""
    if not torch.cuda.is_available():
        print(needs)
        return None
    meta = provenance(commit)
    print(provenance_header(meta), flush=True)
    return meta


#: Columns shown only when some row has them (``bench --sustained``).
OPTIONAL_COLUMNS = {"sustained_ms", "sustained_vs_floor"}


def shape_table(rows: list[dict], markdown: bool = False) -> str:
    columns = [(k, t) for k, t in COLUMNS if k not in OPTIONAL_COLUMNS or any(k in row for row in rows)]
    body = []
    for row in rows:
        if "missing" in row:
            body.append([row["impl"], f"missing: {row['missing']}"] + [None] * (len(columns) - 2))
        else:
            body.append([row.get(key) for key, _ in columns])
    return format_table([title for _, title in columns], body, markdown=markdown)


def write_markdown(path: Path, meta: dict, shapes: dict[str, list[dict]], extra: list[str]) -> None:
    lines = [
        "# Benchmark results",
        "",
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit `{meta['commit'][:12]}`, "
        f"{meta['date']}. liger-kernel {meta['liger_kernel']}, flash-swiglu-mlp {meta['flash_swiglu_mlp']}.",
        f"{meta.get('dtype', 'bf16')}, `triton.testing.do_bench` medians of medians, all implementations "
        "interleaved in one process.",
        "floor = the six cuBLAS GEMMs of a step on preallocated tensors. kept = memory held between forward",
        "and backward (output excluded); peak = extra memory of one step over weights and inputs.",
        "",
    ]
    if meta.get("sustained_s"):
        lines[-1:-1] = [
            f"sustained = the step run back to back for {meta['sustained_s']:g} s per repetition (median "
            "over repetitions), as a training loop runs it: L2 warm, the clock where the power limit "
            "puts it.",
        ]
    for name, rows in shapes.items():
        first = rows[0]
        lines += [
            f"## {name} (M={first['M']}, hidden={first['hidden']}, intermediate={first['intermediate']})",
            "",
        ]
        lines += [shape_table(rows, markdown=True), ""]
    lines += extra
    path.write_text("\n".join(lines) + "\n")


def write_json(path: Path, meta: dict, shapes: dict[str, list[dict]], extra: dict) -> None:
    path.write_text(json.dumps({"meta": meta, "shapes": shapes, **extra}, indent=1))


def write_plots(directory: Path, shapes: dict[str, list[dict]], bottom: float = 0.8) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = [r["impl"] for r in next(iter(shapes.values())) if r["impl"] != "floor"]
    names = list(shapes)
    width = 0.8 / max(1, len(impls))
    paths = []

    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(names)), 4.5))
    for k, impl in enumerate(impls):
        values = [next((r.get("step_vs_floor") for r in shapes[s] if r["impl"] == impl), None) for s in names]
        xs = [i + (k - (len(impls) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [v or 0 for v in values], width, label=impl)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("fwd+bwd time / GEMM-only floor (lower is better)")
    ax.set_ylim(bottom, None)
    ax.legend(fontsize=8, ncols=3)
    fig.tight_layout()
    paths.append(directory / "step_vs_floor.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(max(10, 3 * len(names)), 4.5))
    for ax, key, title in zip(
        axes, ("kept_mib", "peak_mib"), ("kept between fwd and bwd", "peak of a step"), strict=True
    ):
        for k, impl in enumerate(impls):
            values = [next((r.get(key) for r in shapes[s] if r["impl"] == impl), None) for s in names]
            xs = [i + (k - (len(impls) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, [v or 0 for v in values], width, label=impl)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel("MiB (lower is better)")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(directory / "memory.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
