"""``bench --experts``: routed SwiGLU experts, a training step (forward and backward of x, the routing
weights and both expert weights), every implementation side by side in one process:

* ``floor``: the six grouped GEMMs alone (``torch._grouped_mm`` on the slots sorted by expert, no
  padding, no SiLU, no gather or combine);
* ``fused`` / ``fused-preact`` / ``fused-recompute``: ``SwiGLUExperts`` (``save="factors"`` /
  ``"preact"`` / ``"recompute"``);
* ``hf-eager``: transformers' expert module as it runs by default (expert by expert);
* ``hf-grouped`` and ``hf-grouped-compiled``: the same module with transformers' ``grouped_mm``
  implementation (``torch._grouped_mm`` plus a separate SiLU-mul), eager and under ``torch.compile``;
* ``liger``: Liger-Kernel's ``LigerExperts`` (what ``apply_liger_kernel_to_mixtral`` puts in), where
  liger-kernel is installed.

Times are medians of ``do_bench`` medians over interleaved repetitions; "kept" is the memory a forward
leaves allocated for its backward (its output included), "peak" the most a step allocates beyond the
inputs and weights, the gradients included (none exist before the step).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from .measure import MIB, median_ms, peak_mib, rotation

#: hidden, intermediate, experts, top-k
EXPERT_SHAPES = {
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe-1b-7b": (2048, 1024, 64, 8),
}
ROUTINGS = ("balanced", "skewed")
EXPERT_IMPLS = (
    "floor",
    "fused",
    "fused-preact",
    "fused-recompute",
    "hf-eager",
    "hf-grouped",
    "hf-grouped-compiled",
    "liger",
)


def routing(tokens: int, experts: int, top_k: int, kind: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of random scores; ``"skewed"``: expert e about 1/(e+1) as likely as expert 0."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, experts, device=device, generator=g)
    if kind == "skewed":
        logits = logits - 2.0 * torch.log1p(torch.arange(experts, device=device, dtype=logits.dtype))
    weights, index = torch.topk(logits.softmax(-1), top_k)
    return index, (weights / weights.sum(-1, keepdim=True)).float()


def _hf_module(hidden, inter, experts, implementation):
    """transformers' Mixtral expert module (the standard expert layout) with ``implementation``."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts)
    config._experts_implementation = implementation
    return MixtralExperts(config)


def _floor_step(x, index, weights, gate_up, down, dy) -> Callable[[], None]:
    """The six grouped GEMMs of a step on the same grouped shapes: forward x @ Wgu^T and a @ Wd^T;
    backward dy @ Wd, dy^T @ a, dG @ Wgu, dG^T @ x (operands prepared, outputs discarded)."""
    experts = gate_up.shape[0]
    order = torch.argsort(index.reshape(-1), stable=True)
    ends = torch.cumsum(torch.bincount(index.reshape(-1), minlength=experts), 0).int()
    xs = x[order // index.shape[1]].detach().contiguous()
    inter = down.shape[2]
    a = torch.randn(xs.shape[0], inter, device=x.device, dtype=x.dtype)
    dys = dy[order // index.shape[1]].contiguous()
    dg = torch.randn(xs.shape[0], 2 * inter, device=x.device, dtype=x.dtype)
    w_gu, w_d = gate_up.detach(), down.detach()

    def step():
        torch._grouped_mm(xs, w_gu.transpose(1, 2), offs=ends)
        torch._grouped_mm(a, w_d.transpose(1, 2), offs=ends)
        torch._grouped_mm(dys, w_d, offs=ends)
        torch._grouped_mm(dys.t(), a, offs=ends)
        torch._grouped_mm(dg, w_gu, offs=ends)
        torch._grouped_mm(dg.t(), xs, offs=ends)

    return step


def _module(impl, hidden, inter, experts, stock_gate_up, stock_down):
    from ..experts import SwiGLUExperts

    if impl.startswith("fused"):
        source = _hf_module(hidden, inter, experts, "eager")
        save = {"fused": "factors", "fused-preact": "preact", "fused-recompute": "recompute"}[impl]
        module = SwiGLUExperts(experts, hidden, inter, save=save)
    elif impl == "liger":
        from liger_kernel.transformers.swiglu import LigerExperts

        source = module = LigerExperts(_hf_module(hidden, inter, experts, "eager").config)
    else:
        module = source = _hf_module(hidden, inter, experts, "eager" if impl == "hf-eager" else "grouped_mm")
    module = module.to(device=stock_gate_up.device, dtype=stock_gate_up.dtype)
    del source
    module.load_state_dict({"gate_up_proj": stock_gate_up, "down_proj": stock_down})
    return torch.compile(module) if impl.endswith("compiled") else module


def build_step(impl, x, index, weights, stock_gate_up, stock_down, dy):
    """(step, forward or None, parameters) of ``impl``, or why it cannot run here."""
    hidden, inter, experts = x.shape[1], stock_down.shape[2], stock_gate_up.shape[0]
    if impl == "floor":
        return _floor_step(x, index, weights, stock_gate_up, stock_down, dy), None, []
    try:
        module = _module(impl, hidden, inter, experts, stock_gate_up, stock_down)
    except ImportError as error:
        return f"not installed ({error.name})"
    params = [*module.parameters(), x, weights]

    def forward():
        return module(x, index, weights)

    def step():
        forward().backward(dy)

    return step, forward, params


def kept_mib(forward: Callable[[], torch.Tensor]) -> float:
    """What a forward leaves allocated for its backward (its output included), in MiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = forward()
    torch.cuda.synchronize()
    kept = (torch.cuda.memory_allocated() - base) / MIB
    del y
    return kept


def step_inputs(shape: tuple[int, int, int, int], kind: str, tokens: int, dtype: torch.dtype):
    """(x, top-k index, top-k weights, stock gate/up and down weights, dy) of one step on the GPU, from
    fixed seeds; x and the routing weights require gradients."""
    hidden, inter, experts, top_k = shape
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g).requires_grad_()
    index, weights = routing(tokens, experts, top_k, kind, device)
    weights.requires_grad_()
    gate_up = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=g) * inter**-0.5
    dy = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
    return x, index, weights, gate_up, down, dy


def measure_experts(
    shape: tuple[int, int, int, int],
    kind: str,
    impls: list[str],
    *,
    tokens: int = 8192,
    reps: int = 3,
    dtype: torch.dtype = torch.bfloat16,
    log: Callable[[str], None] = print,
) -> list[dict]:
    x, index, weights, gate_up, down, dy = step_inputs(shape, kind, tokens, dtype)
    steps, rows = {}, {}
    for impl in impls:
        built = build_step(impl, x, index, weights, gate_up, down, dy)
        if isinstance(built, str):
            log(f"  {impl}: {built}")
            continue
        step, forward, params = built

        def clear(params=params):
            for p in params:
                p.grad = None

        clear()
        if impl == "liger" and os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1") not in ("0", "false", "no"):
            # liger-kernel 0.8.5's fused MoE: 4 GEMM kernels x 32 configs, 2 x 16, a gather x 40
            log(
                "  liger: its first call autotunes 200 kernel variants (LIGER_FUSED_MOE_AUTOTUNE=0: one each)"
            )
        start = time.perf_counter()
        step()  # the first call compiles
        torch.cuda.synchronize()
        log(f"  {impl}: first call {time.perf_counter() - start:.1f} s")
        clear()  # as a training loop's zero_grad(set_to_none=True): the step allocates the gradients
        peak = peak_mib(step)
        clear()
        kept = kept_mib(forward) if forward is not None else None
        steps[impl] = (step, params, clear)
        rows[impl] = {"impl": impl, "kept_mib": kept, "peak_mib": peak, "times": []}
    for rep in range(reps):
        names = list(steps)
        for impl in rotation(names, rep):
            step, params, clear = steps[impl]
            rows[impl]["times"].append(median_ms(step, grad_to_none=params or None))
            clear()
    floor = statistics.median(rows["floor"]["times"]) if "floor" in rows else None
    out = []
    for impl, row in rows.items():
        ms = statistics.median(row.pop("times"))
        row |= {"step_ms": ms, "step_vs_floor": ms / floor if floor else None}
        log(
            f"  {impl}: {ms:.3f} ms"
            + (f" ({ms / floor:.3f}x floor)" if floor else "")
            + f", peak {row['peak_mib']:.0f} MiB"
        )
        out.append(row)
    return out


def experts_table(rows: list[dict], markdown: bool = False) -> str:
    from ..tables import format_table

    headers = ["impl", "fwd+bwd ms", "vs floor", "kept MiB", "peak MiB"]
    cells = [[r["impl"], r["step_ms"], r["step_vs_floor"], r["kept_mib"], r["peak_mib"]] for r in rows]
    return format_table(headers, cells, markdown)


__all__ = ["EXPERT_IMPLS", "EXPERT_SHAPES", "ROUTINGS", "experts_table", "measure_experts"]
