"""``python -m fused_swiglu.bench.convergence``: does a small Llama train the same in FP8 as in bf16?

Each variant trains the same model (``LlamaForCausalLM`` from a config, fp32 master weights under
bf16 autocast, AdamW with warmup and cosine decay, gradients clipped at 1.0, compiled) on the same
byte-level text, in a process of its own; the processes run side by side on one GPU. The text is
the Python standard library's source (every ``.py`` file, sorted by path): offline, deterministic,
tens of megabytes of structured text a model must learn; its last 2% is held out for validation.

Variants: ``bf16`` (the fused MLP in bf16; with seeds 0, 1, 2 their spread is the bar), ``fused-fp8``
(the fused MLP in FP8, the rest bf16), ``torchao-rowwise`` (torchao's float8 rowwise on every
Linear but the output layer), ``torchao-tensorwise`` (per-tensor scales: the control). Each reports
the training loss and gradient norm every ``LOG_EVERY`` steps and the validation loss at the end;
the coordinator writes a table, JSON and a plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

VARIANTS = ("bf16", "fused-fp8", "torchao-rowwise", "torchao-tensorwise")
LOG_EVERY = 10
#: The model: hidden, intermediate, layers (heads of 128, a quarter as many key/value heads).
MODEL = (1024, 2816, 8)
VOCAB = 256
HELD_OUT = 0.02


def corpus() -> torch.Tensor:
    """The standard library's Python source as bytes (uint8), files in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    data = b"\n".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _batches(data: torch.Tensor, steps: int, batch: int, sequence: int, seed: int):
    """``steps`` batches of random windows of ``data`` (the same for every variant of a seed)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - sequence - 1, (batch,), generator=gen)
        yield torch.stack([data[s : s + sequence + 1] for s in starts.tolist()]).long()


def _model(variant: str, seed: int, device: str, size: tuple[int, int, int]):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..fp8 import torchao_filter
    from ..integrations import swap_swiglu_mlps

    hidden, inter, layers = size
    heads = max(1, hidden // 128)
    kv_heads = max(1, heads // 4)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device)
    if variant in ("bf16", "fused-fp8"):
        swap_swiglu_mlps(model, fp8=variant == "fused-fp8")
    else:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = variant.removeprefix("torchao-")

        def convert(module, fqn: str) -> bool:
            return torchao_filter(module, fqn) and not fqn.endswith("lm_head")

        convert_to_float8_training(
            model, module_filter_fn=convert, config=Float8LinearConfig.from_recipe_name(recipe)
        )
    return model


def train(
    variant: str, seed: int, steps: int, batch: int, sequence: int, lr: float, device: str, size: tuple
) -> dict:
    """One run: the loss and gradient norm every ``LOG_EVERY`` steps, the final validation loss."""
    data = corpus()
    split = int(len(data) * (1 - HELD_OUT))
    train_data, val_data = data[:split], data[split:]
    model = _model(variant, seed, device, size)
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    log, losses, norms = [], [], []
    start = time.perf_counter()
    for step, tokens in enumerate(_batches(train_data, steps, batch, sequence, seed=1000)):
        tokens = tokens.to(device, non_blocking=True)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            loss = compiled(input_ids=tokens[:, :-1], labels=tokens[:, 1:].contiguous()).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.detach())
        norms.append(norm.detach())
        if (step + 1) % LOG_EVERY == 0:
            log.append(
                {
                    "step": step + 1,
                    "loss": torch.stack(losses).mean().item(),
                    "grad_norm": torch.stack(norms).mean().item(),
                }
            )
            losses, norms = [], []
    seconds = time.perf_counter() - start
    model.eval()
    val = []
    with torch.no_grad(), torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
        for tokens in _batches(val_data, 20, batch, sequence, seed=2000):
            tokens = tokens.to(device)
            val.append(compiled(input_ids=tokens[:, :-1], labels=tokens[:, 1:].contiguous()).loss.item())
    return {"variant": variant, "seed": seed, "log": log, "val_loss": sum(val) / len(val), "seconds": seconds}


def _final(run: dict, last: int) -> float:
    """The training loss averaged over the last ``last`` logged points."""
    return sum(point["loss"] for point in run["log"][-last:]) / len(run["log"][-last:])


def report(runs: list[dict], out: Path, meta: dict) -> str:
    """A Markdown table (final train and validation loss, against the bf16 seeds' spread), JSON and a
    plot of the loss and gradient-norm curves."""
    from ..tables import format_table

    bf16 = [r for r in runs if r["variant"] == "bf16"]
    lo = min(_final(r, 10) for r in bf16) if bf16 else math.nan
    hi = max(_final(r, 10) for r in bf16) if bf16 else math.nan
    val_lo = min(r["val_loss"] for r in bf16) if bf16 else math.nan
    val_hi = max(r["val_loss"] for r in bf16) if bf16 else math.nan
    cells = [
        [
            f"{r['variant']} (seed {r['seed']})",
            _final(r, 10),
            r["val_loss"],
            "yes" if val_lo - 1e-9 <= r["val_loss"] <= val_hi + 1e-9 else f"{r['val_loss'] - val_hi:+.4f}",
            max(p["grad_norm"] for p in r["log"]),
            r["seconds"],
        ]
        for r in runs
    ]
    headers = [
        "run",
        "train loss (last 100 steps)",
        "val loss",
        "val within bf16 spread",
        "max grad norm",
        "s",
    ]
    table = format_table(headers, cells, markdown=True)
    lines = [
        "# Convergence: a small Llama in bf16 and in FP8",
        "",
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, torchao {meta.get('torchao')}, "
        f"commit `{meta['commit'][:12]}`, {meta['date']}. `python -m fused_swiglu.bench.convergence "
        f"--steps {meta['steps']}`: hidden {meta['model'][0]}, intermediate {meta['model'][1]}, "
        f"{meta['model'][2]} layers, byte "
        f"vocabulary, {meta['batch']} x {meta['sequence']} tokens per step, lr {meta['lr']}; the Python "
        "standard library's source, 2% held out.",
        "",
        f"bf16 seeds' spread: train {lo:.4f}-{hi:.4f}, validation {val_lo:.4f}-{val_hi:.4f}.",
        "",
        table,
        "",
    ]
    (out / "convergence.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    (out / "convergence.md").write_text("\n".join(lines))
    _plot(runs, out / "convergence.png")
    return "\n".join(lines)


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, norm_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        steps = [p["step"] for p in r["log"]]
        label = f"{r['variant']} (seed {r['seed']})"
        loss_ax.plot(steps, [p["loss"] for p in r["log"]], label=label, linewidth=1)
        norm_ax.plot(steps, [p["grad_norm"] for p in r["log"]], label=label, linewidth=1)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("training loss (nats per byte)")
    loss_ax.set_ylim(None, min(3.0, loss_ax.get_ylim()[1]))
    norm_ax.set_xlabel("step")
    norm_ax.set_ylabel("gradient norm before clipping")
    norm_ax.set_yscale("log")
    loss_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--model", type=int, nargs=3, default=list(MODEL), metavar=("HIDDEN", "INTER", "LAYERS")
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="the bf16 runs' seeds")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/fp8"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--commit")
    parser.add_argument("--run", nargs=2, metavar=("VARIANT", "SEED"), help=argparse.SUPPRESS)  # a worker
    args = parser.parse_args(argv)
    settings = (args.steps, args.batch, args.sequence, args.lr, args.device, tuple(args.model))
    if args.run:
        print(json.dumps(train(args.run[0], int(args.run[1]), *settings)))
        return 0
    from .report import provenance

    meta = provenance(args.commit, args.device) | {"steps": args.steps, "batch": args.batch}
    meta["sequence"], meta["model"] = args.sequence, args.model
    meta["lr"] = args.lr
    jobs = [("bf16", s) for s in args.seeds if "bf16" in args.variants]
    jobs += [(v, args.seeds[0]) for v in args.variants if v != "bf16"]
    print(f"{len(jobs)} runs side by side: " + ", ".join(f"{v} seed {s}" for v, s in jobs), flush=True)
    passed = [
        "--steps", str(args.steps), "--batch", str(args.batch), "--sequence", str(args.sequence),
        "--lr", str(args.lr), "--device", args.device, "--model", *map(str, args.model),
    ]  # fmt: skip
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "fused_swiglu.bench.convergence", *passed, "--run", v, str(s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ,
        )
        for v, s in jobs
    ]
    runs = []
    for (variant, seed), process in zip(jobs, processes, strict=True):
        stdout, stderr = process.communicate()
        if process.returncode:
            print(f"{variant} seed {seed} failed: {stderr.strip().splitlines()[-3:]}", flush=True)
            continue
        runs.append(json.loads(stdout.strip().splitlines()[-1]))
        print(
            f"{variant} seed {seed}: val loss {runs[-1]['val_loss']:.4f}, {runs[-1]['seconds']:.0f} s",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        import torchao

        meta["torchao"] = torchao.__version__
    except ImportError:
        meta["torchao"] = None
    print(report(runs, args.out, meta))
    return 0 if len(runs) == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
