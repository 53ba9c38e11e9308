"""Routed experts: where each token's expert slots go in the expert-grouped rows the kernels read.

Token ``t``'s ``j``-th choice is slot ``t * k + j``. The slots are grouped by expert, in slot order
within an expert, one row per slot and no padding: expert ``e``'s group is rows
``[ends[e-1], ends[e])``, the offsets ``torch._grouped_mm`` takes. The forward kernel walks each
group in tiles of ``EXPERT_ROWS`` rows (kernels/configs.py), so that every tile belongs to one
expert; a table gives each tile its expert and rows, and a group's last tile is cut at the group's
end. The table's size is fixed by the slot and expert counts alone (``max_tiles``), so nothing here
waits for the GPU and a compiled graph has static shapes; the entries past the tiles in use are
never read. Around the sort, the keys, the rows and the table are three kernel launches
(kernels/routes.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.common import cdiv, interpreting
from ..kernels.configs import EXPERT_ROWS
from ..library import define
from .kernels.routes import route_keys as route_keys_kernel
from .kernels.routes import route_rows as route_rows_kernel
from .kernels.routes import route_table as route_table_kernel


class Routes(NamedTuple):
    """Where the slots go; every tensor on the routing's device."""

    rows: torch.Tensor  # [S] int32: the grouped row of each slot
    sources: torch.Tensor  # [S] int64: the slot of each grouped row
    tokens: torch.Tensor  # [S] int32: the token of each grouped row
    tiles: torch.Tensor  # [max_tiles, 3] int32: each row tile's expert, first row and its group's end row
    used_tiles: torch.Tensor  # [1] int32: the tiles in use (the first entries of ``tiles``)
    ends: torch.Tensor  # [E] int32: the end row of each expert's group


def max_tiles(slots: int, num_experts: int) -> int:
    """Row tiles for ``slots`` slots over ``num_experts`` experts: enough for any routing (each
    expert that receives a slot may end in a part tile)."""
    return cdiv(slots, EXPERT_ROWS) + min(slots, num_experts)


def route(top_k_index: torch.Tensor, num_experts: int) -> Routes:
    """The grouped rows of ``top_k_index`` [T, k] (expert ids in ``[0, num_experts)``)."""
    slots = top_k_index.numel()
    # The narrowest key that holds every expert id and one past them: a radix sort's passes.
    key = torch.uint8 if num_experts < 2**8 else torch.int16 if num_experts < 2**15 else torch.int32
    keys = route_keys(top_k_index.reshape(-1), num_experts, key)  # an id outside: past every group
    sorted_ids, order = torch.sort(keys, stable=True)  # order: the slot of each row
    rows, tokens = route_rows(order, top_k_index.shape[1])
    tiles, used_tiles, ends = route_table(sorted_ids, num_experts, max_tiles(slots, num_experts))
    # Refused on the device, without waiting for it (on a GPU a device-side assert, as an index out
    # of bounds raises): with an id outside the experts, the last group ends before the last slot.
    if slots:
        in_range = ends[-1] == slots
        torch._assert_async(in_range, f"top_k_index holds expert ids outside [0, {num_experts})")
    return Routes(rows, order, tokens, tiles, used_tiles, ends)


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def _route_keys(ids, num_experts, key):
    """The sort keys of the expert ids (``key``): one kernel (kernels/routes.py) where Triton runs,
    else the same in PyTorch."""
    if _triton_runs_on(ids.device):
        return route_keys_kernel(ids.contiguous(), num_experts, key)
    return torch.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(key)


def _route_keys_fake(ids, num_experts, key):
    return ids.new_empty(ids.shape, dtype=key)


route_keys = define(
    "route_keys(Tensor ids, int num_experts, ScalarType key) -> Tensor", _route_keys, _route_keys_fake
)


def _route_rows(order, k):
    """Each slot's row and each row's token (int32) of the sort's ``order``: one kernel
    (kernels/routes.py) where Triton runs, else the same in PyTorch."""
    if _triton_runs_on(order.device):
        return route_rows_kernel(order.contiguous(), k)
    rows = order.new_empty(order.shape).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return rows.int(), (order // k).int()


def _route_rows_fake(order, k):
    return order.new_empty(order.shape, dtype=torch.int32), order.new_empty(order.shape, dtype=torch.int32)


route_rows = define("route_rows(Tensor order, int k) -> (Tensor, Tensor)", _route_rows, _route_rows_fake)


def _route_table(sorted_ids, num_experts, num_tiles):
    """The row-tile table of the sorted expert ids: one kernel (kernels/routes.py) where Triton
    runs, else the same in PyTorch."""
    if _triton_runs_on(sorted_ids.device):
        return route_table_kernel(sorted_ids.contiguous(), num_experts, num_tiles, EXPERT_ROWS)
    return _route_table_reference(sorted_ids, num_experts, num_tiles)


def _route_table_reference(sorted_ids, num_experts, num_tiles):
    device = sorted_ids.device
    ids = sorted_ids.long()
    expert_ids = torch.arange(num_experts, device=device)
    ends = torch.searchsorted(ids, expert_ids, right=True)
    counts = ends - torch.searchsorted(ids, expert_ids)
    tiles_of_expert = (counts + EXPERT_ROWS - 1) // EXPERT_ROWS
    tile_ends = torch.cumsum(tiles_of_expert, 0)
    tile = torch.arange(num_tiles, device=device)
    # The expert of each tile; entries past the tiles in use point at the last expert (never read).
    expert = torch.searchsorted(tile_ends, tile, right=True).clamp_(max=num_experts - 1)
    first_tile = tile_ends[expert] - tiles_of_expert[expert]
    first_row = ends[expert] - counts[expert] + (tile - first_tile) * EXPERT_ROWS
    tiles = torch.stack((expert, first_row, ends[expert]), dim=1).int()
    return tiles, tile_ends[-1:].int(), ends.int()


def _route_table_fake(sorted_ids, num_experts, num_tiles):
    new = {"dtype": torch.int32, "device": sorted_ids.device}
    return torch.empty(num_tiles, 3, **new), torch.empty(1, **new), torch.empty(num_experts, **new)


route_table = define(
    "route_table(Tensor sorted_ids, int num_experts, int num_tiles) -> (Tensor, Tensor, Tensor)",
    _route_table,
    _route_table_fake,
)
