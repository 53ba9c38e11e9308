"""Backward stage 1: dA = dY @ W_down, tile by tile, turned into [dU | dG] in the epilogue.

dA is never written to memory: each [BM, BN] tile of it meets the saved packed tensor of the same
rows and intermediate columns in registers, and the resulting gradients overwrite that saved tensor
(or, given ``grad``, go to a tensor of its own, leaving the saved one as it was), which thereby
becomes the packed grad of the gate/up pre-activation, ready for the two cuBLAS GEMMs
dX = dGU @ W_packed and dW_packed = dGU^T @ x. With saved pre-activations the epilogue also
recomputes ``a`` (times the down multiplier) for dW_down, so ``a`` is not kept between passes.

Routed experts (``routed_glu_backward_``; a tile table as the forward kernel's, experts/routing.py): dy's
rows grouped by expert, each tile times its expert's down weight, y's rows having been computed from
``a * w`` (``w`` each row's routing weight). The epilogue also makes the routing weights' gradient
(the row sum of ``a`` times the tile, one partial sum per row and piece, summed after the kernel:
the same result every run), scales the tile by ``w`` before the SwiGLU gradient and writes ``a * w``
for dW_down (over ``a`` with saved factors). A group's last tile is stored with masks, as the
forward's.

Never autotune this kernel: in place, a second launch would read gradients where it expects saved
tensors.
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
    gradient_target,
    interpreting,
    pack_columns,
    persistent_programs,
    silu_and_slope,
    split_halves,
    store_tile,
    tile_coords,
    unpack_columns,
)
from .configs import EXPERT_ROWS, TileConfig, backward_config
from .launch import KernelLauncher, Tma


@triton.jit
def _backward_epilogue(
    b_da,  # [BM, W] fp32: d loss / d a for intermediate columns [o_n, o_n + W) (routed: of a * w)
    s_desc,
    g_desc,
    a_desc,
    s_ptr,  # the saved tensor, a and the rows' routing weights as pointers (routed experts), else None
    a_ptr,
    r_ptr,
    p_ptr,  # [pieces, M] fp32 partial row sums of the routing weights' gradient, or None
    o_m,
    o_n,
    end,  # the end row of the tile's group (routed experts)
    N,
    P_STRIDE,
    gate_multiplier,
    down_multiplier,
    SAVE: tl.constexpr,
    WRITE_A: tl.constexpr,
    BM: tl.constexpr,
    W: tl.constexpr,
    CHUNK_: tl.constexpr,
):
    if r_ptr is not None:
        # Routed experts: the routing weight's gradient is the row sum of a times this gradient (one
        # partial sum per piece, summed after the kernel); the gradient of a is it times the weight.
        rows = o_m + tl.arange(0, BM)
        live = rows < end
        b_w = tl.load(r_ptr + rows, mask=live, other=0.0).to(tl.float32)
    if SAVE == 1 and a_desc is not None:
        # Routed experts, saved factors: a as the forward wrote it, done with before the saved tile
        # is loaded (fewer registers live at once).
        b_a = a_desc.load([o_m, o_n]).to(tl.float32)
        if p_ptr is not None:
            tl.store(p_ptr + (o_n // W).to(tl.int64) * P_STRIDE + rows, tl.sum(b_da * b_a, axis=1), mask=live)
        if WRITE_A:
            store_tile(a_desc, a_ptr, (b_a * b_w[:, None]).to(a_desc.dtype), o_m, o_n, end, N, BM, W)
    b_first, b_second = unpack_columns(s_desc.load([o_m, 2 * o_n]).to(tl.float32), BM, 2 * W, CHUNK_)
    if SAVE == 2:
        # Saved pre-activations: u and the unscaled gate accumulator.
        b_g = b_second * gate_multiplier
        b_silu, b_slope = silu_and_slope(b_g)
        b_a = b_silu * b_first * down_multiplier
        if p_ptr is not None:
            tl.store(p_ptr + (o_n // W).to(tl.int64) * P_STRIDE + rows, tl.sum(b_da * b_a, axis=1), mask=live)
        if r_ptr is not None:
            b_a = b_a * b_w[:, None]  # a * w, what dW_down reads
        if WRITE_A:
            store_tile(a_desc, a_ptr, b_a.to(a_desc.dtype), o_m, o_n, end, N, BM, W)
    if r_ptr is not None:
        b_da = b_da * b_w[:, None]
    if SAVE == 1:
        # Saved factors: silu(g) and gate_multiplier * u * silu'(g). Two multiplies, no sigmoid.
        b_dup = b_da * b_first
        b_dgate = b_da * b_second
    else:
        b_dup = b_da * b_silu
        b_dgate = b_da * b_first * b_slope * gate_multiplier
    b_grad = pack_columns(b_dup, b_dgate, BM, 2 * W, CHUNK_).to(s_desc.dtype)
    if g_desc is None:  # in place
        store_tile(s_desc, s_ptr, b_grad, o_m, 2 * o_n, end, 2 * N, BM, 2 * W)
    else:
        g_desc.store([o_m, 2 * o_n], b_grad)


@triton.jit
def _glu_backward_kernel(
    dy_desc,  # [M, K]: grad of y, K = hidden
    wd_desc,  # [K, N]: W_down (routed experts: [E * K, N], each expert's in turn)
    s_desc,  # [M, 2N] packed: saved tensor in
    g_desc,  # [M, 2N] packed gradient out, or None: over the saved tensor (in place)
    a_desc,  # [M, N] a: written (WRITE_A) or, routed with saved factors, read; else None
    t_ptr,  # [T, 3] int32 tile table (expert, first row, group end row), or None (one weight)
    used_ptr,  # [1] int32 tiles in use (with t_ptr)
    s_ptr,  # the saved tensor and a again, for the masked stores (with t_ptr)
    a_ptr,
    r_ptr,  # [M] routing weight of each row (with t_ptr)
    p_ptr,  # [pieces, M] fp32 partial sums of the routing weights' gradient, or None
    M,
    N,
    K,
    P_STRIDE,
    gate_multiplier,
    down_multiplier,
    SAVE: tl.constexpr,
    WRITE_A: tl.constexpr,
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
    if t_ptr is not None:
        M = tl.load(used_ptr) * ROWS  # the table's tiles in use: their kernel tiles run, no others
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    num_k = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        i_m, i_n = tile_coords(tile, num_m, num_n, GROUP_M)
        o_m = i_m * BM
        o_n = i_n * BN
        o_w = 0  # the tile's first W_down row
        end = M
        if t_ptr is not None:
            entry = t_ptr + 3 * (i_m // SUB)
            o_w = tl.load(entry) * K
            o_m = tl.load(entry + 1) + (i_m % SUB) * BM
            end = tl.load(entry + 2)
        b_acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i_k in range(num_k):
            b_dy = dy_desc.load([o_m, i_k * BK])  # [BM, BK]
            b_wd = wd_desc.load([o_w + i_k * BK, o_n])  # [BK, BN]
            b_acc = tl.dot(b_dy, b_wd, b_acc, input_precision=DOT_PRECISION)
        b_acc = b_acc * down_multiplier  # y carries the down multiplier, so dA does too
        W: tl.constexpr = BN // EPI_SPLIT
        if EPI_SPLIT == 1:
            _backward_epilogue(
                b_acc,
                s_desc,
                g_desc,
                a_desc,
                s_ptr,
                a_ptr,
                r_ptr,
                p_ptr,
                o_m,
                o_n,
                end,
                N,
                P_STRIDE,
                gate_multiplier,
                down_multiplier,
                SAVE,
                WRITE_A,
                BM,
                W,
                CHUNK_,
            )
        else:
            # Column pieces, each whole packed chunks: smaller staging buffers for the saved tile.
            b_lo, b_hi = split_halves(b_acc, BM, BN)
            if EPI_SPLIT == 2:
                _backward_epilogue(
                    b_lo,
                    s_desc,
                    g_desc,
                    a_desc,
                    s_ptr,
                    a_ptr,
                    r_ptr,
                    p_ptr,
                    o_m,
                    o_n,
                    end,
                    N,
                    P_STRIDE,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    WRITE_A,
                    BM,
                    W,
                    CHUNK_,
                )
                _backward_epilogue(
                    b_hi,
                    s_desc,
                    g_desc,
                    a_desc,
                    s_ptr,
                    a_ptr,
                    r_ptr,
                    p_ptr,
                    o_m,
                    o_n + W,
                    end,
                    N,
                    P_STRIDE,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    WRITE_A,
                    BM,
                    W,
                    CHUNK_,
                )
            else:
                b_0, b_1 = split_halves(b_lo, BM, BN // 2)
                b_2, b_3 = split_halves(b_hi, BM, BN // 2)
                _backward_epilogue(
                    b_0,
                    s_desc,
                    g_desc,
                    a_desc,
                    s_ptr,
                    a_ptr,
                    r_ptr,
                    p_ptr,
                    o_m,
                    o_n,
                    end,
                    N,
                    P_STRIDE,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    WRITE_A,
                    BM,
                    W,
                    CHUNK_,
                )
                _backward_epilogue(
                    b_1,
                    s_desc,
                    g_desc,
                    a_desc,
                    s_ptr,
                    a_ptr,
                    r_ptr,
                    p_ptr,
                    o_m,
                    o_n + W,
                    end,
                    N,
                    P_STRIDE,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    WRITE_A,
                    BM,
                    W,
                    CHUNK_,
                )
                _backward_epilogue(
                    b_2,
                    s_desc,
                    g_desc,
                    a_desc,
                    s_ptr,
                    a_ptr,
                    r_ptr,
                    p_ptr,
                    o_m,
                    o_n + 2 * W,
                    end,
                    N,
                    P_STRIDE,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    WRITE_A,
                    BM,
                    W,
                    CHUNK_,
                )
                _backward_epilogue(
                    b_3,
                    s_desc,
                    g_desc,
                    a_desc,
                    s_ptr,
                    a_ptr,
                    r_ptr,
                    p_ptr,
                    o_m,
                    o_n + 3 * W,
                    end,
                    N,
                    P_STRIDE,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    WRITE_A,
                    BM,
                    W,
                    CHUNK_,
                )


_launch_backward = KernelLauncher(_glu_backward_kernel, descriptor)


def glu_backward_(
    dy: torch.Tensor,
    w_down: torch.Tensor,
    saved: torch.Tensor,
    *,
    gate_multiplier: float,
    down_multiplier: float,
    save: Saved,
    config: TileConfig | None = None,
    grad: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Write the packed pre-activation gradient [dU | dG] over ``saved`` [M, 2I], in place, or into
    ``grad`` (the same shape) where given, leaving ``saved`` as it was.

    ``dy`` [M, H] and ``w_down`` [H, I] must be TMA-addressable. Returns the recomputed
    ``down_multiplier * a`` [M, I] when ``save`` is ``Saved.PREACT``, else ``None``.
    """
    if save == Saved.NOTHING:
        raise ValueError("the backward needs saved factors or pre-activations")
    m, hidden = dy.shape
    inter = w_down.shape[1]
    cfg = config or backward_config(m, hidden, inter, dy.dtype, not interpreting(), save)
    width = cfg.block_n // cfg.epilogue_split
    a = empty((m, inter), dy) if save == Saved.PREACT else None
    num_tiles = cdiv(m, cfg.block_m) * cdiv(inter, cfg.block_n)
    _launch_backward(
        (persistent_programs(num_tiles, dy.device, cfg.ctas_per_sm),),
        Tma(dy, (cfg.block_m, cfg.block_k)),
        Tma(w_down, (cfg.block_k, cfg.block_n)),
        Tma(saved, (cfg.block_m, 2 * width)),
        None if grad is None else Tma(gradient_target(saved, grad), (cfg.block_m, 2 * width)),
        None if a is None else Tma(a, (cfg.block_m, width)),
        *(None,) * 6,  # not routed
        m,
        inter,
        hidden,
        0,
        float(gate_multiplier),
        float(down_multiplier),
        SAVE=int(save),
        WRITE_A=a is not None,
        CHUNK_=CHUNK,
        DOT_PRECISION=dot_precision(dy.dtype),
        ROWS=EXPERT_ROWS,
        **cfg.kernel_meta(),
    )
    return a


def routed_glu_backward_(
    dy_rows: torch.Tensor,
    w_down: torch.Tensor,
    saved: torch.Tensor,
    a: torch.Tensor | None,
    row_weights: torch.Tensor,
    tiles: torch.Tensor,
    used_tiles: torch.Tensor,
    *,
    save: Saved,
    need_row_grad: bool,
    write_scaled_a: bool,
    config: TileConfig | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The routed experts' backward of the down projections' input and the SwiGLU, one launch: rows
    grouped by expert as the forward kernel's (experts/routing.py), y's rows computed from ``a * w`` (``w``
    the row's routing weight, ``row_weights`` [P]).

    ``dy_rows`` [P, H] (TMA-addressable) and ``w_down`` [E, H, I] (contiguous); ``saved`` [P, 2I],
    the factors (with ``a`` [P, I] as the forward kernel wrote it) or the pre-activations (``a``
    None). Writes the packed gradient [dU | dG] over ``saved``. Returns the routing weights'
    gradient [P] in fp32 (``need_row_grad``, else None) and, with ``write_scaled_a``, ``a * w``
    [P, I] for dW_down: over ``a`` with saved factors, a new tensor with pre-activations.
    """
    if save == Saved.NOTHING or (save == Saved.FACTORS) != (a is not None):
        raise ValueError("the routed backward needs the factors and a, or the pre-activations alone")
    m, hidden = dy_rows.shape
    experts, _, inter = w_down.shape
    cfg = config or backward_config(m, hidden, inter, dy_rows.dtype, not interpreting(), save, routed=True)
    if EXPERT_ROWS % cfg.block_m:
        raise ValueError(
            f"expert tiles of {EXPERT_ROWS} rows need a kernel tile of rows dividing it, not {cfg.block_m}"
        )
    width = cfg.block_n // cfg.epilogue_split
    if save == Saved.PREACT:
        a = empty((m, inter), dy_rows) if write_scaled_a else None
    elif not (need_row_grad or write_scaled_a):
        a = None  # the factors alone make the gradient
    # One partial sum per row and epilogue piece, summed after the kernel: no atomics, the same
    # result every run.
    pieces = cdiv(inter, cfg.block_n) * cfg.epilogue_split
    partials = torch.empty((pieces, m), dtype=torch.float32, device=dy_rows.device) if need_row_grad else None
    row_tiles = tiles.shape[0] * (EXPERT_ROWS // cfg.block_m)
    num_tiles = row_tiles * cdiv(inter, cfg.block_n)
    _launch_backward(
        (persistent_programs(num_tiles, dy_rows.device, cfg.ctas_per_sm),),
        Tma(dy_rows, (cfg.block_m, cfg.block_k)),
        Tma(w_down.view(experts * hidden, inter), (cfg.block_k, cfg.block_n)),
        Tma(saved, (cfg.block_m, 2 * width)),
        None,
        None if a is None else Tma(a, (cfg.block_m, width)),
        tiles,
        used_tiles,
        saved,
        a,
        row_weights,
        partials,
        m,
        inter,
        hidden,
        m,  # the partials: one row of m per piece
        1.0,
        1.0,
        SAVE=int(save),
        WRITE_A=write_scaled_a,
        CHUNK_=CHUNK,
        DOT_PRECISION=dot_precision(dy_rows.dtype),
        ROWS=EXPERT_ROWS,
        **cfg.kernel_meta(),
    )
    return (None if partials is None else partials.sum(0)), (a if write_scaled_a else None)
