"""Routed experts: where each token's expert slots go in the expert-grouped rows the kernels read.

Token ``t``'s ``j``-th choice is slot ``t * k + j``. The slots are grouped by expert, in slot order
within an expert, and each expert's group starts on a block of ``EXPERT_ROWS`` rows (kernels/configs.py),
so that every tile of the forward kernel belongs to one expert. The rows between groups are padding
(zero inputs, zero routing weight). The number of rows is fixed by the slot and expert counts alone,
``capacity``, so nothing here waits for the GPU and a compiled graph has static shapes: the rows
past the last group are spare room that no kernel computes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kernels.common import cdiv
from .kernels.configs import EXPERT_ROWS


class Routes(NamedTuple):
    """Where the slots go; every tensor on the routing's device."""

    rows: torch.Tensor  # [S] int64: the grouped row of each slot
    sources: torch.Tensor  # [capacity] int64: the slot of each grouped row, S for padding and spare rows
    tile_experts: torch.Tensor  # [capacity / EXPERT_ROWS] int32: the expert of each block of rows
    used_rows: torch.Tensor  # [1] int32: rows up to the end of the last expert's group
    ends: torch.Tensor  # [E] int32: the end row of each expert's group (torch._grouped_mm's offsets)


def capacity(slots: int, num_experts: int) -> int:
    """Grouped rows for ``slots`` slots over ``num_experts`` experts: enough for any routing."""
    groups = min(slots, num_experts)  # experts that can receive a slot, each padded to whole blocks
    return (cdiv(slots, EXPERT_ROWS) + groups) * EXPERT_ROWS


def route(top_k_index: torch.Tensor, num_experts: int) -> Routes:
    """The grouped rows of ``top_k_index`` [T, k] (expert ids in ``[0, num_experts)``)."""
    experts = top_k_index.reshape(-1).long()
    slots = experts.numel()
    device = experts.device
    order = torch.argsort(experts, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    blocks = (counts + EXPERT_ROWS - 1) // EXPERT_ROWS
    ends = torch.cumsum(blocks, 0) * EXPERT_ROWS
    starts = ends - blocks * EXPERT_ROWS
    firsts = torch.cumsum(counts, 0) - counts  # where each expert's slots start in ``order``
    grouped = experts[order]
    index = torch.arange(slots, device=device)
    rows = order.new_empty(order.shape).scatter_(0, order, starts[grouped] + index - firsts[grouped])
    size = capacity(slots, num_experts)
    sources = torch.full((size,), slots, dtype=torch.long, device=device).scatter_(0, rows, index)
    block_rows = torch.arange(0, size, EXPERT_ROWS, device=device)
    # The expert whose group holds each block; blocks past the last group point at the last expert
    # (never run: past used_rows).
    tile_experts = torch.searchsorted(ends, block_rows, right=True).clamp_(max=num_experts - 1)
    return Routes(rows, sources, tile_experts.int(), ends[-1:].int(), ends.int())
