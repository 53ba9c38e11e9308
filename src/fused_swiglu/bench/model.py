"""``bench --model``: whole Hugging Face models training, stock against Liger-Kernel and the fused MLP.

A ``LlamaForCausalLM`` built from a config (no download), trained with AdamW on random tokens, eager
and under ``torch.compile`` (training.py: one run). Every variant runs in a fresh process of its
own: a class-level patch (Liger's) or a compile cache must not leak into the next one. The processes
time their windows side by side, in turn (side_by_side.py), and each variant is compared with stock
window by window.
Each process reports ms per step, peak memory, compile seconds, Dynamo's graphs, graph breaks and
recompiles, and the first steps' losses, which are compared with stock eager's.
"""

from __future__ import annotations

import itertools
import os
import statistics

from .side_by_side import run_side_by_side
from .training import RunSpec

#: Whole-model sizes: hidden, intermediate, layers, tokens per step (sequences of ``SEQUENCE``).
MODEL_SIZES = {
    "1024x4": (1024, 2816, 4, 4096),
    "1024x32": (1024, 2816, 32, 4096),
    "2048x16": (2048, 8192, 16, 8192),
    "4096x2": (4096, 14336, 2, 8192),
}

#: Variants: what is patched or swapped, and whether it is compiled (``-ro``: ``mode="reduce-overhead"``).
VARIANTS = (
    "stock-eager",
    "stock-compiled",
    "liger-eager",
    "liger-compiled",
    "fused-eager",
    "fused-compiled",
    "fused-compiled-preact",
    "fused-compiled-recompute",
)
EXTRA_VARIANTS = ("stock-compiled-ro", "fused-compiled-ro", "liger-compiled-ro", "stock-grouped-compiled")
#: FP8: torchao's float8 training on every Linear but the output layer (tensorwise, rowwise); the
#: fused MLP in FP8, alone or with torchao's tensorwise float8 on the other Linears.
FP8_VARIANTS = (
    "stock-torchao-compiled",
    "stock-torchao-rowwise-compiled",
    "fused-fp8-compiled",
    "fused-fp8-torchao-compiled",
)
PRECISIONS = ("autocast", "bf16", "fp32")
#: The variants others are compared with, window by window (``vs stock compiled``, ``vs stock eager``).
BASES = ("stock-compiled", "stock-eager")


def host_profile_table(result: dict) -> str:
    """One run's host profile as a plain table (``bench --model --host-profile``)."""
    from ..tables import format_table

    profile = result["host_ops"]
    cells = [[r["name"][:60], r["calls"], r["self_us"], r["total_us"]] for r in profile["top"]]
    title = f"{result['variant']}: {profile['self_us']:.0f} us of operator host time per step"
    table = title + "\n" + format_table(["operator", "calls/step", "self us/step", "total us/step"], cells)
    if "by_shape" in profile:
        cells = [[r["name"], str(r["shapes"]), r["calls"], r["total_us"]] for r in profile["by_shape"]]
        table += "\n" + format_table(["operator", "input shapes", "calls/step", "total us/step"], cells)
    return table


def loss_agreement(results: list[dict]) -> None:
    """Adds ``loss_rel_diff``: the largest relative difference of a run's first losses from stock
    eager's, in the same size and precision (``None`` where stock eager did not run)."""
    stock = {
        (r["hidden"], r["intermediate"], r["layers"], r["tokens"], r["precision"]): r["losses"]
        for r in results
        if r["variant"] == "stock-eager" and "losses" in r
    }
    for r in results:
        key = (r["hidden"], r["intermediate"], r["layers"], r["tokens"], r["precision"])
        if "losses" in r and key in stock:
            pairs = zip(r["losses"], stock[key], strict=True)
            r["loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in pairs)


def _summary(results: list[dict]) -> list[dict]:
    """One row per (size, precision, variant): the median and range of its windows over every
    repetition, and the median and range of its window-by-window ratios to stock compiled and stock
    eager (``window_ratios``)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        key = (r["hidden"], r["intermediate"], r["layers"], r["tokens"], r["precision"], r["variant"])
        groups.setdefault(key + (r.get("lora_rank", 0), r.get("experts", 0), r.get("top_k", 2)), []).append(r)
    rows = []
    for (
        hidden,
        inter,
        layers,
        tokens,
        precision,
        variant,
        lora_rank,
        experts,
        top_k,
    ), runs in groups.items():
        ok = [r for r in runs if "error" not in r]
        row = {
            "size": f"{hidden}/{inter} x {layers}, {tokens} tokens"
            + (f", LoRA r={lora_rank}" if lora_rank else "")
            + (f", {experts} experts top-{top_k}" if experts else ""),
            "precision": precision,
            "variant": variant,
            "runs": len(ok),
            "error": next((r["error"] for r in runs if "error" in r), None),
        }
        if ok:
            ms = [w for r in ok for w in r["window_ms"]]
            row |= {
                "step_ms": statistics.median(ms),
                "step_ms_min": min(ms),
                "step_ms_max": max(ms),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
                "peak_mib": max((r["peak_mib"] for r in ok if r["peak_mib"] is not None), default=None),
                "compile_s": statistics.median(r["compile_s"] for r in ok)
                if ok[0]["compile_s"] is not None
                else None,
                "graphs": max(r["graphs"] for r in ok),
                "graph_breaks": max(r["graph_breaks"] for r in ok),
                "recompiles": max(r["recompiles"] for r in ok),
                "loss_rel_diff": max((r["loss_rel_diff"] for r in ok if "loss_rel_diff" in r), default=None),
            }
            for base in BASES:
                ratios = [x for r in ok for x in r.get(_ratio_key(base), ())]
                if ratios:
                    row[f"vs_{base.replace('-', '_')}"] = statistics.median(ratios)
                    row[f"vs_{base.replace('-', '_')}_spread"] = (min(ratios), max(ratios))
        rows.append(row)
    return rows


def _ratio_key(base: str) -> str:
    return f"window_ratios_vs_{base.replace('-', '_')}"


def window_ratios(results: list[dict]) -> None:
    """Adds each run's window-by-window ratios to each base variant's run of the same size, precision
    and repetition: its i-th window over the base's i-th, timed in the same round seconds apart."""
    runs = {_run_key(r) + (r["variant"],): r for r in results if "window_ms" in r}
    for r in results:
        for base in BASES:
            other = runs.get(_run_key(r) + (base,))
            if "window_ms" in r and other is not None:
                pairs = zip(r["window_ms"], other["window_ms"], strict=True)
                r[_ratio_key(base)] = [mine / theirs for mine, theirs in pairs]


_RUN_FIELDS = ("hidden", "intermediate", "layers", "tokens", "precision", "lora_rank", "experts", "top_k")


def _run_key(r: dict) -> tuple:
    """What the runs of one side-by-side call share."""
    return (*(r.get(field) for field in _RUN_FIELDS), r.get("rep", 0), r.get("group", 0))


MODEL_COLUMNS = [
    ("size", "model"),
    ("precision", "precision"),
    ("variant", "variant"),
    ("step_ms", "ms/step"),
    ("spread", "min-max"),
    ("vs_stock_compiled", "vs stock compiled"),
    ("ratio_spread", "ratio min-max"),
    ("vs_stock_eager", "vs stock eager"),
    ("tokens_per_s", "tokens/s"),
    ("peak_mib", "peak MiB"),
    ("compile_s", "compile s"),
    ("graphs", "graphs"),
    ("graph_breaks", "breaks"),
    ("recompiles", "recompiles"),
    ("loss_rel_diff", "loss diff"),
]


def _cells(row: dict) -> list:
    if row.get("step_ms") is None:
        return [row["size"], row["precision"], row["variant"], f"failed: {row['error']}"] + [""] * (
            len(MODEL_COLUMNS) - 4
        )
    ratios = row.get("vs_stock_compiled_spread")
    spreads = {
        "spread": f"{row['step_ms_min']:.2f}-{row['step_ms_max']:.2f}",
        "ratio_spread": f"{ratios[0]:.3f}-{ratios[1]:.3f}" if ratios else None,
    }
    return [spreads[key] if key in spreads else row.get(key) for key, _ in MODEL_COLUMNS]


def model_table(rows: list[dict], markdown: bool = False) -> str:
    from ..tables import format_table

    return format_table([title for _, title in MODEL_COLUMNS], [_cells(row) for row in rows], markdown)


def plot_model(rows: list[dict], path) -> None:
    """Bars of ms/step over stock compiled (stock eager where stock compiled did not run), one group
    per model size and precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = "vs_stock_compiled" if any(r.get("vs_stock_compiled") for r in rows) else "vs_stock_eager"
    groups = list(dict.fromkeys((r["size"], r["precision"]) for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows if r.get(base)))
    by_key = {(r["size"], r["precision"], r["variant"]): r.get(base) for r in rows}
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(groups)), 4))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        values = [by_key.get((*g, variant)) or 0.0 for g in groups]
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{s}\n{p}" for s, p in groups], fontsize=7)
    ax.set_ylabel(f"ms/step over {base.removeprefix('vs_').replace('_', ' ')} (lower is faster)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def side_by_side_groups(variants: list[str], at_once: int) -> list[list[str]]:
    """The variants in groups of at most ``at_once`` (each process holds its model and optimizer on
    the GPU while the others run), every group with the bases among them, whose windows the others
    are compared with."""
    bases = [v for v in variants if v in BASES]
    others = [v for v in variants if v not in BASES]
    if not others:
        return [bases]
    room = at_once - len(bases)
    if room < 1:
        raise ValueError(f"{at_once} processes at once leave no room beside {', '.join(bases)}")
    chunks = [others[i : i + room] for i in range(0, len(others), room)]
    return [[v for v in variants if v in bases or v in chunk] for chunk in chunks]


def core_shares(processes: int) -> list[tuple[int, ...]]:
    """This process's CPU cores in ``processes`` disjoint, equal, contiguous shares."""
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("pinning processes to cores needs os.sched_setaffinity (Linux)")
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // processes
    if share < 1:
        raise ValueError(f"{len(cores)} CPU cores cannot give {processes} processes one each")
    return [tuple(cores[i * share : (i + 1) * share]) for i in range(processes)]


def run_model_bench(
    sizes: dict[str, tuple[int, int, int, int]],
    variants: list[str],
    precisions: list[str],
    *,
    reps: int,
    steps: int,
    windows: int = 10,
    at_once: int = 4,
    device: str = "cuda",
    backend: str = "inductor",
    timeout: float | None = None,
    lora_rank: int = 0,
    moe: tuple[int, int] | None = None,
    host_profile: bool = False,
    pin_cores: bool = False,
    log=print,
) -> tuple[list[dict], list[dict]]:
    """Every (size, precision) ``reps`` times: its variants side by side, each in a fresh process,
    ``windows`` windows of ``steps`` steps each in turn (side_by_side.py), at most ``at_once``
    processes at a time (``side_by_side_groups``); with ``pin_cores``, each process of a group on a
    share of the CPU cores of its own (``core_shares``). Returns every run and the summary rows."""
    groups = side_by_side_groups(variants, at_once)
    results = []
    for name, (hidden, inter, layers, tokens) in sizes.items():
        for precision in precisions:
            for rep, (group, group_variants) in itertools.product(range(reps), enumerate(groups)):
                log(f"[{name} {precision} rep {rep + 1}/{reps}] side by side: {', '.join(group_variants)}")
                shares = core_shares(len(group_variants)) if pin_cores else [()] * len(group_variants)
                specs = [
                    RunSpec(
                        variant,
                        hidden,
                        inter,
                        layers,
                        tokens,
                        precision,
                        steps,
                        windows=windows,
                        device=device,
                        backend=backend,
                        lora_rank=lora_rank,
                        experts=moe[0] if moe else 0,
                        top_k=moe[1] if moe else 2,
                        host_profile=host_profile,
                        cores=cores,
                    )
                    for variant, cores in zip(group_variants, shares, strict=True)
                ]
                for r in run_side_by_side(specs, windows, timeout, log):
                    results.append({**r, "rep": rep, "group": group})
                    what = r.get("error") or f"{r['step_ms']:.2f} ms/step, peak {r['peak_mib'] or 0:.0f} MiB"
                    log(f"[{name} {precision} rep {rep + 1}/{reps}] {r['variant']}: {what}")
                    if "host_ops" in r:
                        log(host_profile_table(r))
    loss_agreement(results)
    window_ratios(results)
    return results, _summary(results)
