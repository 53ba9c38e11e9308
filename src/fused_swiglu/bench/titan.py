"""``python -m fused_swiglu.bench.titan``: torchtitan's own trainer (``torchtitan.train``, one GPU,
compiled as torchtitan compiles) with its stock modules, with torchtitan's fused SwiGLU override
and with this library's overrides: one fresh process per variant, variants interleaved in rounds;
tokens/s, peak memory and the loss read from torchtitan's own log; a table, JSON and a loss plot.

The configs (titan_configs.py, what ``--module``/``--config`` name) train on offline data: the
Python standard library's source as bytes (convergence.py's corpus), random windows of it, the
same for every variant; the tokenizer maps bytes to ids 0-255 (the model keeps its config's
vocabulary). A variant's overrides are named on torchtitan's command line, as a user names them;
a run whose log shows fewer replacements than asked for fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

from .convergence import corpus

_TORCHTITAN_FUSED = "torchtitan.overrides.fused_swiglu"
_FUSED = "fused_swiglu.torchtitan"
#: Each variant's ``--override.imports`` tokens.
VARIANTS = {
    "stock": [],
    "torchtitan-fused": [f"{_TORCHTITAN_FUSED}.fused_swiglu,{_TORCHTITAN_FUSED}.fused_grouped_experts"],
    "fused": [f"{_FUSED}.fused_feed_forward,{_FUSED}.fused_grouped_experts"],
    "fused-sac": [f"{_FUSED}.fused_feed_forward,{_FUSED}.fused_grouped_experts,{_FUSED}.fused_selective_ac"],
    "fused-recompute": [
        f'{_FUSED}.fused_feed_forward={{"save": "recompute"}}',
        f'{_FUSED}.fused_grouped_experts={{"save": "recompute"}}',
    ],
}
#: torchtitan's line for each logged step (colour codes removed).
_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-\d.naif]+)\s+grad_norm:\s*(?P<grad_norm>[-\d.naif]+)\s+"
    r"memory:\s*(?P<memory>[\d.]+)GiB\([\d.]+%\)\s+tps:\s*(?P<tps>[\d,]+)"
)
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


class ByteTokenizer(BaseTokenizer):
    """Text as its UTF-8 bytes, ids 0-255; BOS 256, EOS 257."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None):
        super().__init__()
        self.bos_id, self.eos_id = 256, 257

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode())
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return 258


class SourceWindows(IterableDataset, Stateful):
    """Endless random windows of ``data`` ([seq_len] inputs, the next bytes as labels), each data
    parallel rank its own stream; resumable (the generator's state is the dataset's)."""

    def __init__(self, data: torch.Tensor, seq_len: int, seed: int, dp_rank: int):
        if len(data) <= seq_len + 1:
            raise ValueError(f"the corpus ({len(data)} bytes) is shorter than a window of {seq_len + 1}")
        self.data, self.seq_len = data, seq_len
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + dp_rank)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            start = int(torch.randint(0, len(self.data) - self.seq_len - 1, (), generator=self.generator))
            window = self.data[start : start + self.seq_len + 1].long()
            # One document per window: positions 0.. make torchtitan's block-causal mask causal.
            yield {"input": window[:-1], "positions": torch.arange(self.seq_len)}, window[1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.generator.set_state(state_dict["generator"])


class SourceDataLoader(ParallelAwareDataloader):
    """torchtitan's dataloader over ``SourceWindows`` of the standard library's source."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "python-stdlib-source"
        seed: int = 0

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs,
    ):
        windows = SourceWindows(corpus(), seq_len, config.seed, dp_rank)
        super().__init__(
            windows,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            num_workers=config.num_workers,
            pin_memory=config.pin_memory,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )


# The runs ---------------------------------------------------------------------------------------------


def parse_log(text: str) -> dict:
    """torchtitan's logged steps (step, loss, grad_norm, reserved memory GiB, tokens/s) and the
    number of modules its overrides replaced."""
    steps = []
    for line in _COLOUR.sub("", text).splitlines():
        match = _STEP.search(line)
        if match:
            row = match.groupdict()
            steps.append(
                {
                    "step": int(row["step"]),
                    "loss": float(row["loss"]),
                    "grad_norm": float(row["grad_norm"]),
                    "memory_gib": float(row["memory"]),
                    "tps": int(row["tps"].replace(",", "")),
                }
            )
    replaced = sum("[Override]" in line for line in text.splitlines())
    return {"steps": steps, "replaced": replaced}


def summarize(steps: list[dict], skip: int) -> dict:
    """tokens/s (median of the logged windows past the first ``skip``, which hold the compile and
    warm-up), the peak reserved memory of those windows and the last loss."""
    timed = [s for s in steps if s["step"] > skip]
    if not timed:
        raise ValueError(f"no logged step past step {skip}: run more steps")
    return {
        "tps": statistics.median(s["tps"] for s in timed),
        "memory_gib": max(s["memory_gib"] for s in timed),
        "final_loss": steps[-1]["loss"],
    }


def command(
    config: str, variant: str, steps: int, log_every: int, folder: str, extra: list[str]
) -> list[str]:
    overrides = ["--override.imports", *VARIANTS[variant]] if VARIANTS[variant] else []
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        "-m", "torchtitan.train",
        "--module", "fused_swiglu.bench.titan_configs", "--config", config,
        "--training.steps", str(steps), "--metrics.log_freq", str(log_every), "--dump_folder", folder,
        *overrides, *extra,
    ]  # fmt: skip


def run_variant(
    config: str, variant: str, steps: int, log_every: int, extra: list[str], log_path: Path
) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        cmd = command(config, variant, steps, log_every, folder, extra)
        done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    log_path.write_text(" ".join(cmd) + "\n" + done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{variant}: torchtitan exited with {done.returncode}; its log: {log_path}")
    parsed = parse_log(done.stdout + done.stderr)
    if VARIANTS[variant] and not parsed["replaced"]:
        raise RuntimeError(f"{variant}: its overrides replaced nothing; its log: {log_path}")
    return parsed


def report(results: dict[str, list[dict]], skip: int) -> list[dict]:
    """One row per variant: the median of its rounds' tokens/s, their spread, the ratio to stock's
    median, the peak reserved memory (the largest of its rounds) and the last loss of its first round."""
    rows = []
    for variant, runs in results.items():
        summaries = [summarize(run["steps"], skip) for run in runs]
        tps = [s["tps"] for s in summaries]
        rows.append(
            {
                "variant": variant,
                "tokens/s": statistics.median(tps),
                "spread": (max(tps) - min(tps)) / statistics.median(tps),
                "peak reserved GiB": max(s["memory_gib"] for s in summaries),
                "last loss": summaries[0]["final_loss"],
                "modules replaced": runs[0]["replaced"],
            }
        )
    stock = next((r["tokens/s"] for r in rows if r["variant"] == "stock"), None)
    for row in rows:
        row["vs stock"] = row["tokens/s"] / stock if stock else float("nan")
    return rows


def markdown(rows: list[dict]) -> str:
    head = ["variant", "tokens/s", "vs stock", "spread", "peak reserved GiB", "last loss", "modules replaced"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["variant"], f"{r['tokens/s']:,.0f}", f"{r['vs stock']:.3f}", f"{r['spread']:.1%}"]
        cells += [f"{r['peak reserved GiB']:.2f}", f"{r['last loss']:.4f}", str(r["modules replaced"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_losses(results: dict[str, list[dict]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, runs in results.items():
        steps = runs[0]["steps"]
        ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], label=variant, linewidth=1)
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a config of fused_swiglu.bench.titan_configs")
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=["stock", "torchtitan-fused", "fused"]
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every variant in turn")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument(
        "--skip", type=int, default=10, help="steps left out of the timing (compile, warm-up)"
    )
    parser.add_argument("--out", type=Path, default=Path("titan-results"))
    parser.add_argument("--card", default=None, help="the GPU's name for the table (default: torch's)")
    parser.add_argument(
        "extra", nargs="*", help="after --: more of torchtitan's arguments, for every variant"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    for round_ in range(args.rounds):
        for variant in args.variants:
            print(f"round {round_ + 1}/{args.rounds}: {variant} ...", flush=True)
            log = args.out / f"{args.config}-{variant}-{round_}.log"
            results[variant].append(
                run_variant(args.config, variant, args.steps, args.log_every, args.extra, log)
            )
            print(f"  {summarize(results[variant][-1]['steps'], args.skip)}", flush=True)
    rows = report(results, args.skip)
    card = args.card or (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
    header = f"{args.config}, {card}, torch {torch.__version__}, {args.steps} steps, {args.rounds} rounds\n\n"
    table = header + markdown(rows)
    print(table)
    (args.out / f"{args.config}.md").write_text(table)
    (args.out / f"{args.config}.json").write_text(json.dumps({"rows": rows, "runs": results}, indent=1))
    plot_losses(results, f"{args.config} ({card})", args.out / f"{args.config}-loss.png")


if __name__ == "__main__":
    main()
