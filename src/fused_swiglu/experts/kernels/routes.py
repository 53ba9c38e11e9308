"""The routed experts' routes (routing.py) in three kernel launches around the sort of the slots'
expert ids:

* the keys: each slot's expert id in the sort's narrow key, an id outside the experts made the
  key past the last expert (so that the sort moves it past every group, where the groups' last end
  shows it);
* the rows: each slot's grouped row, and each row's token, from the sort's order;
* the row-tile table: every expert's group of rows is a run of equal sorted ids, so one program
  finds each group by binary search and writes the groups' end rows, the tiles in use and, for
  every tile, its expert, first row and group end (the table the forward and backward kernels
  walk).

They replace some twenty-five small PyTorch kernels (counts, cumulative sums, a search, gathers,
casts) whose launches, not their work, cost the step its time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernels.common import cdiv, next_power_of_2
from ...kernels.launch import KernelLauncher


@triton.jit
def _group_bounds(ids_ptr, S, offs_e, steps):
    """Per lane expert ``e``: the numbers of sorted ids below ``e`` and at most ``e`` (its group's
    first and end rows), two binary searches in one loop, so that their loads overlap."""
    lo_first = tl.zeros_like(offs_e)
    hi_first = tl.zeros_like(offs_e) + S
    lo_end = tl.zeros_like(offs_e)
    hi_end = tl.zeros_like(offs_e) + S
    # A loop, not unrolled: unrolled, some step counts failed to compile for sm_90 (triton 3.6).
    for _ in range(steps):  # this many halvings bring [0, S] to one point
        on_first = lo_first < hi_first
        on_end = lo_end < hi_end
        mid_first = (lo_first + hi_first) // 2
        mid_end = (lo_end + hi_end) // 2
        v_first = tl.load(ids_ptr + mid_first, mask=on_first, other=0).to(tl.int32)
        v_end = tl.load(ids_ptr + mid_end, mask=on_end, other=0).to(tl.int32)
        lo_first = tl.where(on_first & (v_first < offs_e), mid_first + 1, lo_first)
        hi_first = tl.where(on_first & (v_first >= offs_e), mid_first, hi_first)
        lo_end = tl.where(on_end & (v_end <= offs_e), mid_end + 1, lo_end)
        hi_end = tl.where(on_end & (v_end > offs_e), mid_end, hi_end)
    return lo_first, lo_end


@triton.jit
def _route_table_kernel(
    ids_ptr,  # [S] expert ids, sorted
    tiles_ptr,  # [T, 3] int32 out: expert, first row, group end row
    used_ptr,  # [1] int32 out: the tiles in use
    ends_ptr,  # [E] int32 out: each expert's group end row
    S,
    E,
    T,
    steps,  # binary-search steps: S's bit length
    ROWS: tl.constexpr,  # rows per tile
    E_P2: tl.constexpr,
    BT: tl.constexpr,  # tiles of every expert per step
    FILL: tl.constexpr,  # unused entries per step
):
    offs_e = tl.arange(0, E_P2)
    m_e = offs_e < E
    firsts, ends = _group_bounds(ids_ptr, S, offs_e, steps)
    counts = tl.where(m_e, ends - firsts, 0)
    tl.store(ends_ptr + offs_e, ends, mask=m_e)
    tiles_of_expert = (counts + ROWS - 1) // ROWS
    first_entry = tl.cumsum(tiles_of_expert, 0) - tiles_of_expert
    used = tl.sum(tiles_of_expert)
    tl.store(used_ptr, used)
    # Each expert writes its own tiles, BT at a time: stores only, no selection across experts.
    offs_i = tl.arange(0, BT)[:, None]
    for i0 in range(0, tl.max(tiles_of_expert), BT):
        i = i0 + offs_i
        live = i < tiles_of_expert[None, :]
        entry = tiles_ptr + 3 * (first_entry[None, :] + i)
        tl.store(entry, tl.broadcast_to(offs_e[None, :], (BT, E_P2)), mask=live)
        tl.store(entry + 1, firsts[None, :] + i * ROWS, mask=live)
        tl.store(entry + 2, tl.broadcast_to(ends[None, :], (BT, E_P2)), mask=live)
    # Entries past the tiles in use continue the last expert's (never read).
    last = offs_e == E - 1
    last_end = tl.sum(tl.where(last, ends, 0))
    row_of_entry_0 = tl.sum(tl.where(last, firsts - first_entry * ROWS, 0))
    for t0 in range(used, T, FILL):
        offs_t = t0 + tl.arange(0, FILL)
        m_t = offs_t < T
        tl.store(tiles_ptr + 3 * offs_t, tl.zeros_like(offs_t) + (E - 1), mask=m_t)
        tl.store(tiles_ptr + 3 * offs_t + 1, row_of_entry_0 + offs_t * ROWS, mask=m_t)
        tl.store(tiles_ptr + 3 * offs_t + 2, tl.zeros_like(offs_t) + last_end, mask=m_t)


@triton.jit
def _route_keys_kernel(ids_ptr, keys_ptr, S, E, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    m = offs < S
    ids = tl.load(ids_ptr + offs, mask=m, other=0)
    keys = tl.where((ids >= 0) & (ids < E), ids, E)
    tl.store(keys_ptr + offs, keys.to(keys_ptr.dtype.element_ty), mask=m)


@triton.jit
def _route_rows_kernel(order_ptr, rows_ptr, tokens_ptr, S, K, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    m = offs < S
    slot = tl.load(order_ptr + offs, mask=m, other=0)
    tl.store(rows_ptr + slot, offs.to(tl.int32), mask=m)
    tl.store(tokens_ptr + offs, (slot // K).to(tl.int32), mask=m)


_launch = KernelLauncher(_route_table_kernel)
_launch_rows = KernelLauncher(_route_rows_kernel)
_launch_keys = KernelLauncher(_route_keys_kernel)

#: Slots per program of the keys and rows kernels.
ROWS_BLOCK = 1024

ROUTE_WARPS = 4


def expert_lanes(num_experts: int) -> int:
    """The table kernel's lanes, one per expert: a power of two, at least 16 (narrower vectors and
    the selections built on them fail to compile for sm_90 or spill)."""
    return max(16, next_power_of_2(num_experts))


def route_block(num_experts: int) -> int:
    """Tiles of every expert per step of the table loop: [BT, lanes] stores of at most 2048 entries
    (registers; 4096 spilled at 1024 experts), at most 32 tiles (4096 rows) an expert."""
    return max(1, min(32, 2048 // expert_lanes(num_experts)))


#: Unused table entries per step.
FILL_BLOCK = 256


def route_table(
    sorted_ids: torch.Tensor, num_experts: int, num_tiles: int, rows_per_tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tiles [num_tiles, 3], used_tiles [1], ends [num_experts]), int32, of the sorted expert ids
    ``sorted_ids`` [S] (contiguous, each in ``[0, num_experts)``) in tiles of ``rows_per_tile``
    rows, as routing.py defines them."""
    if sorted_ids.dim() != 1 or sorted_ids.stride(0) != 1 or num_experts < 1:
        raise ValueError(f"expected contiguous [S] ids and experts >= 1, got {tuple(sorted_ids.shape)}")
    new = {"dtype": torch.int32, "device": sorted_ids.device}
    tiles, used, ends = (torch.empty(shape, **new) for shape in ((num_tiles, 3), (1,), (num_experts,)))
    _launch(
        (1,),
        sorted_ids,
        tiles,
        used,
        ends,
        sorted_ids.shape[0],
        num_experts,
        num_tiles,
        max(1, sorted_ids.shape[0].bit_length()),
        ROWS=rows_per_tile,
        E_P2=expert_lanes(num_experts),
        BT=route_block(num_experts),
        FILL=FILL_BLOCK,
        num_warps=ROUTE_WARPS,
    )
    return tiles, used, ends


def route_rows(order: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [S], tokens [S]), int32, of the sort's ``order`` [S] (contiguous, the slot of each
    grouped row): each slot's row (``rows[order[r]] = r``) and each row's token (its slot // ``k``)."""
    if order.dim() != 1 or order.stride(0) != 1 or k < 1:
        raise ValueError(f"expected a contiguous [S] order and k >= 1, got {tuple(order.shape)}, k={k}")
    slots = order.shape[0]
    rows, tokens = (torch.empty(slots, dtype=torch.int32, device=order.device) for _ in range(2))
    if slots:
        _launch_rows((cdiv(slots, ROWS_BLOCK),), order, rows, tokens, slots, k, B=ROWS_BLOCK)
    return rows, tokens


def route_keys(ids: torch.Tensor, num_experts: int, key_dtype: torch.dtype) -> torch.Tensor:
    """The sort keys [S] (``key_dtype``, which must hold ``num_experts``) of the expert ids ``ids``
    [S] (contiguous, integers): each id in ``[0, num_experts)`` as it is, any other
    ``num_experts``."""
    if ids.dim() != 1 or ids.stride(0) != 1 or num_experts < 1:
        raise ValueError(f"expected contiguous [S] ids and experts >= 1, got {tuple(ids.shape)}")
    keys = torch.empty(ids.shape, dtype=key_dtype, device=ids.device)
    if ids.numel():
        _launch_keys((cdiv(ids.numel(), ROWS_BLOCK),), ids, keys, ids.numel(), num_experts, B=ROWS_BLOCK)
    return keys
