"""SwiGLU experts over rows already grouped by expert: the interface of torchtitan's
``GroupedExperts`` (``forward(x_RD, num_tokens_per_expert_E)``). No routing, no routing weights, no
combine: the routed experts' ops (ops.py) and kernels, each row its own token. ``swiglu_experts``
(routed.py) is routing, then the same ops, then the combine.

Expert ``e``'s rows are ``[ends[e-1], ends[e])``, ``ends`` the running sum of the counts. Rows past
the last group (padding, as expert parallelism leaves it) take part in nothing: their output and
their input gradient are zeros.
"""

from __future__ import annotations

import torch

from ..functional import check_save_mode
from ..layout import check_intermediate_size
from ..ops import _refuse_double_backward, _saved_tensors
from .ops import (
    EXPERTS_SAVE_MODES,
    experts_backward_down,
    experts_backward_gate_up,
    experts_forward,
    experts_inference,
)
from .routing import max_tiles, route_table


def _grouped_table(counts: torch.Tensor, rows: int, num_experts: int):
    """(tiles, used_tiles, ends) of ``rows`` rows grouped by ``counts`` [E]: each row's expert found
    by a search of the groups' ends (past the last group: ``num_experts``), then the routes' table."""
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    row = torch.arange(rows, device=counts.device, dtype=torch.int32)
    experts_of_rows = torch.searchsorted(ends, row, right=True).to(torch.int32)
    return route_table(experts_of_rows, num_experts, max_tiles(rows, num_experts))


def _zero_padding(rows_tensor: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``rows_tensor`` with its rows past the last group zeroed (the grouped GEMMs leave them)."""
    row = torch.arange(rows_tensor.shape[0], device=rows_tensor.device)
    return torch.where((row < ends[-1])[:, None], rows_tensor, 0)


class GroupedExpertsFunction(torch.autograd.Function):
    """[R, H] rows grouped by expert through their experts' SwiGLU MLPs (module docstring)."""

    @staticmethod
    def forward(ctx, x, gate_up_weight, down_weight, token_of_row, tiles, used_tiles, ends, save):
        weights = (gate_up_weight, down_weight)
        table = (tiles, used_tiles, ends)
        y, saved, a = experts_forward(x, token_of_row, *weights, *table, save)
        ctx.save_for_backward(x, *weights, token_of_row, *table, saved, a)
        ctx.save = save
        return _zero_padding(y, ends)

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        x, gate_up_weight, down_weight, token_of_row, *table, saved, a = _saved_tensors(ctx)
        if not torch.compiler.is_compiling():
            ctx.maybe_clear_saved_tensors()  # freed as the ops finish with them, as in routed.py
        need_dx, need_dgate_up, need_ddown = ctx.needs_input_grad[:3]
        ones = torch.ones(x.shape[0], device=x.device, dtype=x.dtype)  # no routing weights
        after, ddown, made = experts_backward_down(
            dy.contiguous(), x, token_of_row, ones, gate_up_weight, down_weight, saved, a, *table,
            ctx.save, False, need_ddown,
        )  # fmt: skip
        del a
        grad, ends = (made if ctx.save == "recompute" else saved), table[2]
        del saved, made
        dx, dgate_up = experts_backward_gate_up(
            grad, x, token_of_row, gate_up_weight, ends, after, need_dx, need_dgate_up
        )
        dx = _zero_padding(dx, ends) if need_dx else None
        return dx, (dgate_up if need_dgate_up else None), (ddown if need_ddown else None), *(None,) * 5


def swiglu_grouped_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    save: str = "factors",
) -> torch.Tensor:
    """``x`` [R, H], its rows grouped by expert, ``counts`` [E] rows per expert (integers, summing to
    at most R), ``gate_up_weight`` [E, 2I, H] packed per expert (layout.py), ``down_weight`` [E, H, I]
    -> [R, H] in x's dtype, each row through its expert's SwiGLU MLP; rows past the groups are zeros.
    ``save``: ``"factors"``, ``"preact"`` or ``"recompute"``, as for ``swiglu_experts``."""
    check_save_mode(save, EXPERTS_SAVE_MODES)
    for name, t in {
        "x": x,
        "counts": counts,
        "gate_up_weight": gate_up_weight,
        "down_weight": down_weight,
    }.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or gate_up_weight.dim() != 3 or down_weight.dim() != 3 or counts.dim() != 1:
        raise ValueError(
            "expected x [rows, hidden], counts [experts], gate_up_weight [experts, 2 * intermediate, "
            f"hidden] and down_weight [experts, hidden, intermediate]; got {tuple(x.shape)}, "
            f"{tuple(counts.shape)}, {tuple(gate_up_weight.shape)} and {tuple(down_weight.shape)}"
        )
    experts, two_inter, hidden = gate_up_weight.shape
    fits = down_weight.shape == (experts, hidden, two_inter // 2) and x.shape[1] == hidden
    if two_inter % 2 or not fits or counts.shape[0] != experts:
        raise ValueError(
            f"x {tuple(x.shape)}, counts {tuple(counts.shape)}, gate_up_weight {tuple(gate_up_weight.shape)} "
            f"and down_weight {tuple(down_weight.shape)} do not fit [R, H], [E], [E, 2I, H] and [E, H, I]"
        )
    check_intermediate_size(two_inter // 2)
    if counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise TypeError(f"counts must hold integers, got {counts.dtype}")
    if len({t.device for t in (x, counts, gate_up_weight, down_weight)}) > 1:
        raise ValueError("x, counts and the weights must be on one device")
    if not x.dtype.is_floating_point or {gate_up_weight.dtype, down_weight.dtype} != {x.dtype}:
        raise TypeError(
            f"x and the weights must share a floating-point dtype, got x {x.dtype}, gate_up_weight "
            f"{gate_up_weight.dtype}, down_weight {down_weight.dtype}"
        )
    rows = x.shape[0]
    tiles, used_tiles, ends = _grouped_table(counts, rows, experts)
    token_of_row = torch.arange(rows, device=x.device, dtype=torch.int32)
    table = (token_of_row, tiles, used_tiles, ends)
    with torch.autocast(x.device.type, enabled=False):  # the ops' grouped GEMMs in x's dtype
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate_up_weight, down_weight)):
            return GroupedExpertsFunction.apply(x, gate_up_weight, down_weight, *table, save)
        return _zero_padding(
            experts_inference(x, token_of_row, gate_up_weight, down_weight, *table[1:]), ends
        )
