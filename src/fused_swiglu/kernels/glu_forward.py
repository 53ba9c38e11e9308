"""Forward: x @ W_packed^T with the SwiGLU in the epilogue, one persistent TMA kernel.

Each tile reads one contiguous [2*BN, BK] slab of the packed weight per step, so a single wide
``tl.dot`` into one [BM, 2*BN] accumulator produces the up and gate columns of the same BN
intermediate columns: x is loaded once for both projections. The epilogue de-interleaves the
accumulator in registers and writes

* ``a = down_multiplier * silu(gate_multiplier * gate) * up`` (folding the down multiplier here makes
  both down-projection GEMMs plain ``mm`` calls), and, for training, one of
* the factors ``[silu(g) | gate_multiplier * up * silu'(g)]`` (backward is two multiplies), or
* the raw accumulator ``[up | gate]`` (backward recomputes the sigmoid; ``a`` need not be kept).

With a low-rank term (LoRA adapters on gate and up), one more ``tl.dot`` per tile adds
``u @ v^T`` (``u`` [M, R], ``v`` [2I, R] packed like the weight) to the accumulator before the epilogue.

Routed experts (a tile table given, experts/routing.py): the rows of every expert, grouped by expert with no
padding, are either x's rows or, with a row index, x's rows read by index (each grouped row the
index's row of x: no gathered copy of x is made); the weight holds every expert's packed rows one
after another ([E * 2I, H]).
Entry ``t`` of the table is a tile of up to ``EXPERT_ROWS`` rows of one expert: (expert, first row,
end row of its group); only the first ``used_tiles[0]`` entries are run. A tile that reaches past its
group's end is stored with masks, row by row up to the end, since a TMA store clips only at the
tensor's edge and would write the next expert's rows; every other tile is stored through TMA.

The [M, 2I] pre-activation never reaches memory unless it is what is saved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    CHUNK,
    Saved,
    cdiv,
    descriptor,
    dot_precision,
    empty,
    interpreting,
    pack_columns,
    persistent_programs,
    shared_memory_limit,
    silu_and_slope,
    split_halves,
    store_tile,
    tile_coords,
    unpack_columns,
)
from .configs import EXPERT_ROWS, TileConfig, fit_low_rank, forward_config
from .launch import KernelLauncher, Tma


@triton.jit
def _forward_epilogue(
    b_acc,  # [BM, W] fp32, packed columns starting at packed column 2 * o_n
    a_desc,
    s_desc,
    a_ptr,  # a and the saved tensor as pointers (routed experts), else None
    s_ptr,
    o_m,
    o_n,
    end,  # the end row of the tile's group (routed experts)
    N,
    gate_multiplier,
    down_multiplier,
    SAVE: tl.constexpr,
    BM: tl.constexpr,
    W: tl.constexpr,
    CHUNK_: tl.constexpr,
):
    b_up, b_gate = unpack_columns(b_acc, BM, W, CHUNK_)  # [BM, W/2] each
    b_g = b_gate * gate_multiplier
    b_silu, b_slope = silu_and_slope(b_g)
    if a_desc is not None:
        b_a = (b_silu * b_up * down_multiplier).to(a_desc.dtype)
        store_tile(a_desc, a_ptr, b_a, o_m, o_n, end, N, BM, W // 2)
    if SAVE == 1:
        b_factors = pack_columns(b_silu, b_up * b_slope * gate_multiplier, BM, W, CHUNK_)
        store_tile(s_desc, s_ptr, b_factors.to(s_desc.dtype), o_m, 2 * o_n, end, 2 * N, BM, W)
    elif SAVE == 2:
        store_tile(s_desc, s_ptr, b_acc.to(s_desc.dtype), o_m, 2 * o_n, end, 2 * N, BM, W)


@triton.jit
def _glu_forward_kernel(
    x_desc,  # [M, K], or None (x read by index)
    x_ptr,  # [T, K] read by index, or None
    r_ptr,  # [M] int32 x's row of each row (with x_ptr)
    stride_x,  # x's row stride (with x_ptr)
    w_desc,  # [2N, K] packed
    a_desc,  # [M, N], or None
    s_desc,  # [M, 2N] packed, or None
    u_desc,  # [M, R] low-rank input, or None
    v_desc,  # [2N, R] packed low-rank weight, or None
    t_ptr,  # [T, 3] int32 tile table (expert, first row, group end row), or None (one weight)
    used_ptr,  # [1] int32 tiles in use (with t_ptr)
    a_ptr,  # a and the saved tensor again, for the masked stores (with t_ptr)
    s_ptr,
    M,
    N,
    K,
    gate_multiplier,
    down_multiplier,
    SAVE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
    FLATTEN: tl.constexpr,
    CHUNK_: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROWS: tl.constexpr,  # rows per table tile, a multiple of BM (with t_ptr)
):
    SUB: tl.constexpr = ROWS // BM  # kernel tiles per table tile
    rows = M  # the rows there are, before M becomes the rows the table's tiles cover
    if t_ptr is not None:
        M = tl.load(used_ptr) * ROWS  # the table's tiles in use: their kernel tiles run, no others
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    num_k = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        i_m, i_n = tile_coords(tile, num_m, num_n, GROUP_M)
        o_m = i_m * BM
        o_n = i_n * BN
        o_w = 2 * o_n  # the tile's first packed weight row
        end = M
        if t_ptr is not None:
            entry = t_ptr + 3 * (i_m // SUB)
            o_w += tl.load(entry) * 2 * N
            o_m = tl.load(entry + 1) + (i_m % SUB) * BM
            end = tl.load(entry + 2)
        b_acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        if x_ptr is not None:
            offs_m = o_m + tl.arange(0, BM)
            # Rows past the last read row 0 (no result uses them), as a TMA load past the edge reads zeros.
            b_rows = tl.load(r_ptr + offs_m, mask=offs_m < rows, other=0).to(tl.int64)
            x_row_ptrs = x_ptr + b_rows[:, None] * stride_x  # [BM, 1]
        for i_k in range(num_k):
            if x_ptr is not None:
                offs_k = i_k * BK + tl.arange(0, BK)
                b_x = tl.load(x_row_ptrs + offs_k[None, :], mask=offs_k[None, :] < K, other=0.0)
            else:
                b_x = x_desc.load([o_m, i_k * BK])  # [BM, BK]
            b_w = w_desc.load([o_w, i_k * BK])  # [2BN, BK]
            b_acc = tl.dot(b_x, b_w.T, b_acc, input_precision=DOT_PRECISION)
        if u_desc is not None:
            b_u = u_desc.load([o_m, 0])  # [BM, R]
            b_v = v_desc.load([2 * o_n, 0])  # [2BN, R]
            b_acc = tl.dot(b_u, b_v.T, b_acc, input_precision=DOT_PRECISION)
        W: tl.constexpr = 2 * BN // EPI_SPLIT  # packed columns per epilogue piece
        N_W: tl.constexpr = W // 2  # intermediate columns per piece
        if EPI_SPLIT == 1:
            _forward_epilogue(
                b_acc,
                a_desc,
                s_desc,
                a_ptr,
                s_ptr,
                o_m,
                o_n,
                end,
                N,
                gate_multiplier,
                down_multiplier,
                SAVE,
                BM,
                W,
                CHUNK_,
            )
        else:
            # Column pieces, each still whole packed chunks: smaller epilogue staging buffers.
            b_lo, b_hi = split_halves(b_acc, BM, 2 * BN)
            if EPI_SPLIT == 2:
                _forward_epilogue(
                    b_lo,
                    a_desc,
                    s_desc,
                    a_ptr,
                    s_ptr,
                    o_m,
                    o_n,
                    end,
                    N,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    BM,
                    W,
                    CHUNK_,
                )
                _forward_epilogue(
                    b_hi,
                    a_desc,
                    s_desc,
                    a_ptr,
                    s_ptr,
                    o_m,
                    o_n + N_W,
                    end,
                    N,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    BM,
                    W,
                    CHUNK_,
                )
            else:
                b_0, b_1 = split_halves(b_lo, BM, BN)
                b_2, b_3 = split_halves(b_hi, BM, BN)
                _forward_epilogue(
                    b_0,
                    a_desc,
                    s_desc,
                    a_ptr,
                    s_ptr,
                    o_m,
                    o_n,
                    end,
                    N,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    BM,
                    W,
                    CHUNK_,
                )
                _forward_epilogue(
                    b_1,
                    a_desc,
                    s_desc,
                    a_ptr,
                    s_ptr,
                    o_m,
                    o_n + N_W,
                    end,
                    N,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    BM,
                    W,
                    CHUNK_,
                )
                _forward_epilogue(
                    b_2,
                    a_desc,
                    s_desc,
                    a_ptr,
                    s_ptr,
                    o_m,
                    o_n + 2 * N_W,
                    end,
                    N,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    BM,
                    W,
                    CHUNK_,
                )
                _forward_epilogue(
                    b_3,
                    a_desc,
                    s_desc,
                    a_ptr,
                    s_ptr,
                    o_m,
                    o_n + 3 * N_W,
                    end,
                    N,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    BM,
                    W,
                    CHUNK_,
                )


_launch_forward = KernelLauncher(_glu_forward_kernel, descriptor)


def glu_forward(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    *,
    gate_multiplier: float,
    down_multiplier: float,
    save: Saved,
    write_a: bool = True,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: TileConfig | None = None,
    experts: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    row_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch the forward kernel. ``x`` [M, H] and ``w_packed`` [2I, H] must be TMA-addressable, as
    must ``low_rank`` = (u [M, R], v [2I, R]) if given (R a multiple of 16): ``u @ v^T`` is added to
    the pre-activation. With ``experts`` = (tiles, used_tiles, E) (experts/routing.py), ``w_packed`` is
    [E, 2I, H] (contiguous) and rows are routed as the module docstring says (the tile's rows must
    divide ``EXPERT_ROWS``). With ``experts``, ``row_index`` [M] (int32) may give x's row of each
    grouped row: x is then [T, H] with unit last stride, read by index.

    Returns ``a`` [M, I] (scaled by ``down_multiplier``; ``None`` with ``write_a=False``, for a backward that
    only needs the factors) and the saved packed [M, 2I] tensor (or ``None``).
    """
    if not write_a and save == Saved.NOTHING:
        raise ValueError("the forward kernel must write a, the saved tensor, or both")
    m, hidden = x.shape
    if row_index is not None:
        if experts is None or row_index.dtype != torch.int32 or x.stride(1) != 1:
            raise ValueError("a row index needs a tile table, int32 indices and x with unit last stride")
        m = row_index.shape[0]
    if experts is not None:
        w_packed = w_packed.flatten(0, 1)  # [E, 2I, H] -> [E * 2I, H]: each expert's rows in turn
    inter = w_packed.shape[0] // 2 if experts is None else w_packed.shape[0] // (2 * experts[2])
    precision = dot_precision(x.dtype)
    on_gpu = not interpreting()
    cfg = config or forward_config(m, hidden, inter, x.dtype, on_gpu, save, precision, experts is not None)
    if low_rank is not None and config is None and on_gpu:
        limit = shared_memory_limit(x.device)
        cfg = fit_low_rank(cfg, x.dtype.itemsize, low_rank[0].shape[1], save, write_a, limit)
    if experts is not None and EXPERT_ROWS % cfg.block_m:
        raise ValueError(
            f"expert tiles of {EXPERT_ROWS} rows need a kernel tile of rows dividing it, not {cfg.block_m}"
        )
    width = cfg.block_n // cfg.epilogue_split  # intermediate columns per epilogue piece
    a = empty((m, inter), x) if write_a else None
    saved = empty((m, 2 * inter), x) if save != Saved.NOTHING else None
    # Routed experts: as many row tiles as the table may hold (each group's last may be a part tile).
    row_tiles = (
        cdiv(m, cfg.block_m) if experts is None else experts[0].shape[0] * (EXPERT_ROWS // cfg.block_m)
    )
    num_tiles = row_tiles * cdiv(inter, cfg.block_n)
    _launch_forward(
        (persistent_programs(num_tiles, x.device, cfg.ctas_per_sm),),
        Tma(x, (cfg.block_m, cfg.block_k)) if row_index is None else None,
        None if row_index is None else x,
        row_index,
        x.stride(0),
        Tma(w_packed, (2 * cfg.block_n, cfg.block_k)),
        None if a is None else Tma(a, (cfg.block_m, width)),
        None if saved is None else Tma(saved, (cfg.block_m, 2 * width)),
        None if low_rank is None else Tma(low_rank[0], (cfg.block_m, low_rank[0].shape[1])),
        None if low_rank is None else Tma(low_rank[1], (2 * cfg.block_n, low_rank[1].shape[1])),
        None if experts is None else experts[0],
        None if experts is None else experts[1],
        None if experts is None else a,
        None if experts is None else saved,
        m,
        inter,
        hidden,
        float(gate_multiplier),
        float(down_multiplier),
        SAVE=int(save),
        CHUNK_=CHUNK,
        DOT_PRECISION=precision,
        ROWS=EXPERT_ROWS,
        **cfg.kernel_meta(),
    )
    return a, saved
