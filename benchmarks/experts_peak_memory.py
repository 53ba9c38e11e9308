"""What is allocated at the peak of one routed-experts training step, allocation by allocation.

Run on the GPU: ``python benchmarks/experts_peak_memory.py [--shape mixtral-8x7b] [--impls ...]``.
One step of each implementation of ``bench --experts`` (8192 tokens, bf16, balanced routing) runs
under PyTorch's allocator history; the trace is replayed to find the step's peak, and the blocks
live at that moment are printed largest first, each with the library's or transformers' frames
that allocated it (the first three).
"""

from __future__ import annotations

import argparse

import torch

from fused_swiglu.bench.experts import EXPERT_IMPLS, EXPERT_SHAPES, build_step, routing
from fused_swiglu.bench.report import start_gpu_log

MIB = 2**20
TOKENS = 8192


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """(the most bytes allocated at once, the allocations live then) of one allocator trace."""
    live, now, peak, at_peak = {}, 0, -1, []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            now += event["size"]
            if now > peak:
                peak, at_peak = now, list(live.values())
        elif event["action"] == "free_completed" and event["addr"] in live:
            now -= live.pop(event["addr"])["size"]
    return peak, at_peak


def where(event: dict) -> str:
    frames = event["frames"]
    ours = [f for f in frames if "fused_swiglu" in f["filename"] or "transformers" in f["filename"]]
    named = (f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in (ours or frames)[:3])
    return " <- ".join(named)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(EXPERT_SHAPES), default="mixtral-8x7b")
    parser.add_argument("--impls", nargs="*", choices=EXPERT_IMPLS, default=["fused", "hf-grouped-compiled"])
    parser.add_argument("--commit")
    args = parser.parse_args()
    if start_gpu_log(args.commit, "experts_peak_memory.py needs a CUDA GPU") is None:
        return
    hidden, inter, experts, top_k = EXPERT_SHAPES[args.shape]
    torch.manual_seed(0)
    index, weights = routing(TOKENS, experts, top_k, "balanced", "cuda")
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    for impl in args.impls:
        x = torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16)
        built = build_step(impl, x, index, weights.clone().requires_grad_(True), gate_up, down, dy)
        if isinstance(built, str):
            print(f"\n{impl}: {built}")
            continue
        step = built[0]
        step(), step()  # compiled, gradients allocated: the step as it repeats
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        step()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, blocks = live_at_peak(trace)
        print(f"\n{impl}: {peak / MIB:.0f} MiB at the step's peak over {base / MIB:.0f} MiB before it")
        for block in sorted(blocks, key=lambda b: -b["size"])[:14]:
            print(f"  {block['size'] / MIB:8.1f} MiB  {where(block)}")
        del built, step, x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
