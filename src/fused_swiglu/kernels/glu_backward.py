"""Backward stage 1: dA = dY @ W_down, tile by tile, turned into [dU | dG] in the epilogue.

dA is never written to memory: each [BM, BN] tile of it meets the saved packed tensor of the same
rows and intermediate columns in registers, and the resulting gradients overwrite that saved tensor
(or, given ``grad``, go to a tensor of its own, leaving the saved one as it was), which thereby
becomes the packed grad of the gate/up pre-activation, ready for the two cuBLAS GEMMs
dX = dGU @ W_packed and dW_packed = dGU^T @ x. With saved pre-activations the epilogue also
recomputes ``a`` (times the down multiplier) for dW_down, so ``a`` is not kept between passes.

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
    tile_coords,
    unpack_columns,
)
from .configs import TileConfig, backward_config
from .launch import KernelLauncher, Tma


@triton.jit
def _backward_epilogue(
    b_da,  # [BM, W] fp32: d loss / d a for intermediate columns [o_n, o_n + W)
    s_desc,
    g_desc,
    a_desc,
    o_m,
    o_n,
    gate_multiplier,
    down_multiplier,
    SAVE: tl.constexpr,
    BM: tl.constexpr,
    W: tl.constexpr,
    CHUNK_: tl.constexpr,
):
    b_first, b_second = unpack_columns(s_desc.load([o_m, 2 * o_n]).to(tl.float32), BM, 2 * W, CHUNK_)
    if SAVE == 1:
        # Saved factors: silu(g) and gate_multiplier * u * silu'(g). Two multiplies, no sigmoid.
        b_dup = b_da * b_first
        b_dgate = b_da * b_second
    else:
        # Saved pre-activations: u and the unscaled gate accumulator.
        b_g = b_second * gate_multiplier
        b_silu, b_slope = silu_and_slope(b_g)
        b_dup = b_da * b_silu
        b_dgate = b_da * b_first * b_slope * gate_multiplier
        a_desc.store([o_m, o_n], (b_silu * b_first * down_multiplier).to(a_desc.dtype))
    b_grad = pack_columns(b_dup, b_dgate, BM, 2 * W, CHUNK_).to(s_desc.dtype)
    if g_desc is None:  # in place
        s_desc.store([o_m, 2 * o_n], b_grad)
    else:
        g_desc.store([o_m, 2 * o_n], b_grad)


@triton.jit
def _glu_backward_kernel(
    dy_desc,  # [M, K]: grad of y, K = hidden
    wd_desc,  # [K, N]: W_down
    s_desc,  # [M, 2N] packed: saved tensor in
    g_desc,  # [M, 2N] packed gradient out, or None: over the saved tensor (in place)
    a_desc,  # [M, N] recomputed a (SAVE == 2), else None
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
):
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    num_k = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        i_m, i_n = tile_coords(tile, num_m, num_n, GROUP_M)
        o_m = i_m * BM
        o_n = i_n * BN
        b_acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i_k in range(num_k):
            b_dy = dy_desc.load([o_m, i_k * BK])  # [BM, BK]
            b_wd = wd_desc.load([i_k * BK, o_n])  # [BK, BN]
            b_acc = tl.dot(b_dy, b_wd, b_acc, input_precision=DOT_PRECISION)
        b_acc = b_acc * down_multiplier  # y carries the down multiplier, so dA does too
        W: tl.constexpr = BN // EPI_SPLIT
        if EPI_SPLIT == 1:
            _backward_epilogue(
                b_acc,
                s_desc,
                g_desc,
                a_desc,
                o_m,
                o_n,
                gate_multiplier,
                down_multiplier,
                SAVE,
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
                    o_m,
                    o_n,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    BM,
                    W,
                    CHUNK_,
                )
                _backward_epilogue(
                    b_hi,
                    s_desc,
                    g_desc,
                    a_desc,
                    o_m,
                    o_n + W,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
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
                    o_m,
                    o_n,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    BM,
                    W,
                    CHUNK_,
                )
                _backward_epilogue(
                    b_1,
                    s_desc,
                    g_desc,
                    a_desc,
                    o_m,
                    o_n + W,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    BM,
                    W,
                    CHUNK_,
                )
                _backward_epilogue(
                    b_2,
                    s_desc,
                    g_desc,
                    a_desc,
                    o_m,
                    o_n + 2 * W,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
                    BM,
                    W,
                    CHUNK_,
                )
                _backward_epilogue(
                    b_3,
                    s_desc,
                    g_desc,
                    a_desc,
                    o_m,
                    o_n + 3 * W,
                    gate_multiplier,
                    down_multiplier,
                    SAVE,
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
    caller_key=None,
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
    precision = dot_precision(dy.dtype)
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
        m,
        inter,
        hidden,
        float(gate_multiplier),
        float(down_multiplier),
        SAVE=int(save),
        CHUNK_=CHUNK,
        DOT_PRECISION=precision,
        **cfg.kernel_meta(),
        caller_key=caller_key,
    )
    return a
