"""Routed experts: where each token's expert slots go in the expert-grouped rows the kernels read.

Token ``t``'s ``j``-th choice is slot ``t * k + j``. The slots are grouped by expert, in slot order
within an expert, one row per slot and no padding: expert ``e``'s group is rows
``[ends[e-1], ends[e])``, the offsets ``torch._grouped_mm`` takes. The forward kernel walks each
group in tiles of ``EXPERT_ROWS`` rows (kernels/configs.py), so that every tile belongs to one
expert; a table gives each tile its expert and rows, and a group's last tile is cut at the group's
end. The table's size is fixed by the slot and expert counts alone (``max_tiles``), so nothing here
waits for the GPU and a compiled graph has static shapes; the entries past the tiles in use are
never read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kernels.common import cdiv
from .kernels.configs import EXPERT_ROWS


class Routes(NamedTuple):
    """Where the slots go; every tensor on the routing's device."""

    rows: torch.Tensor  # [S] int32: the grouped row of each slot
    sources: torch.Tensor  # [S] int64: the slot of each grouped row
    tiles: torch.Tensor  # [max_tiles, 3] int32: each row tile's expert, first row and its group's end row
    used_tiles: torch.Tensor  # [1] int32: the tiles in use (the first entries of ``tiles``)
    ends: torch.Tensor  # [E] int32: the end row of each expert's group


def max_tiles(slots: int, num_experts: int) -> int:
    """Row tiles for ``slots`` slots over ``num_experts`` experts: enough for any routing (each
    expert that receives a slot may end in a part tile)."""
    return cdiv(slots, EXPERT_ROWS) + min(slots, num_experts)


def route(top_k_index: torch.Tensor, num_experts: int) -> Routes:
    """The grouped rows of ``top_k_index`` [T, k] (expert ids in ``[0, num_experts)``)."""
    experts = top_k_index.reshape(-1).long()
    slots = experts.numel()
    device = experts.device
    # The slot of each row; the narrowest key that holds every expert id (a radix sort's passes).
    key = torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int32
    order = torch.argsort(experts.to(key), stable=True)
    rows = order.new_empty(order.shape).scatter_(0, order, torch.arange(slots, device=device))
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    ends = torch.cumsum(counts, 0)
    tiles_of_expert = (counts + EXPERT_ROWS - 1) // EXPERT_ROWS
    tile_ends = torch.cumsum(tiles_of_expert, 0)
    tile = torch.arange(max_tiles(slots, num_experts), device=device)
    # The expert of each tile; entries past the tiles in use point at the last expert (never read).
    expert = torch.searchsorted(tile_ends, tile, right=True).clamp_(max=num_experts - 1)
    first_tile = tile_ends[expert] - tiles_of_expert[expert]
    first_row = ends[expert] - counts[expert] + (tile - first_tile) * EXPERT_ROWS
    tiles = torch.stack((expert, first_row, ends[expert]), dim=1).int()
    return Routes(rows.int(), order, tiles, tile_ends[-1:].int(), ends.int())
