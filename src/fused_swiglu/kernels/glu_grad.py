"""The SwiGLU gradient between two GEMMs: saved packed tensor and dA -> [dU | dG], one pass, written
over the saved tensor or into a tensor of its own.

Used where dA is in memory rather than in the fused backward kernel's registers:

* the GLU operator alone: dA arrives from the caller's down projection, and the only work between
  the two backward GEMMs is this product of the saved factors with dA (the same dA multiplies both
  halves of a packed chunk). A broadcast ``mul_`` in PyTorch does the same in place but reaches
  about half the copy bandwidth on the packed chunk layout;
* fp32 (``kernels/glu_split.py``): dA = dY @ W_down comes from cuBLAS, saved factors or saved
  pre-activations; with the latter the pass also recomputes ``a`` for dW_down, over dA's memory.

It is memory-bound: read dA and the saved tensor, write the gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    CHUNK,
    Saved,
    cdiv,
    gradient_target,
    interpreting,
    pack_columns,
    silu_and_slope,
    unpack_columns,
)
from .launch import KernelLauncher


@triton.jit
def _glu_grad_kernel(
    da_ptr,  # [M, N]: dA in; down_multiplier * a out when SAVE == 2
    s_ptr,  # [M, 2N] packed saved tensor in
    g_ptr,  # [M, 2N] packed gradient out, with s_ptr's strides: s_ptr itself (in place) or its own
    M,
    N,
    stride_da,
    stride_s,
    gate_multiplier,
    down_multiplier,
    SAVE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    CHUNK_: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    o_rows = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_cols = i_n * BN + tl.arange(0, BN)
    o_packed = 2 * i_n * BN + tl.arange(0, 2 * BN)
    m_rows = o_rows[:, None] < M
    p_da = da_ptr + o_rows[:, None] * stride_da + o_cols[None, :]
    m_da = m_rows & (o_cols[None, :] < N)
    b_da = tl.load(p_da, mask=m_da).to(tl.float32) * down_multiplier  # y carries the down multiplier
    p_s = s_ptr + o_rows[:, None] * stride_s + o_packed[None, :]
    m_s = m_rows & (o_packed[None, :] < 2 * N)
    b_s = tl.load(p_s, mask=m_s).to(tl.float32)
    if SAVE == 1:
        # Factors: [BM, chunks, 2, CHUNK] * [BM, chunks, 1, CHUNK], the same dA scales both halves.
        b_grad = tl.reshape(
            tl.reshape(b_s, (BM, BN // CHUNK_, 2, CHUNK_)) * tl.reshape(b_da, (BM, BN // CHUNK_, 1, CHUNK_)),
            (BM, 2 * BN),
        )
    else:
        # Pre-activations [u | unscaled gate]: the fused backward epilogue's arithmetic.
        b_up, b_gate = unpack_columns(b_s, BM, 2 * BN, CHUNK_)
        b_g = b_gate * gate_multiplier
        b_silu, b_slope = silu_and_slope(b_g)
        b_grad = pack_columns(b_da * b_silu, b_da * b_up * b_slope * gate_multiplier, BM, 2 * BN, CHUNK_)
        tl.store(p_da, (b_silu * b_up * down_multiplier).to(da_ptr.dtype.element_ty), mask=m_da)
    p_g = g_ptr + o_rows[:, None] * stride_s + o_packed[None, :]
    tl.store(p_g, b_grad.to(g_ptr.dtype.element_ty), mask=m_s)


_launch_grad = KernelLauncher(_glu_grad_kernel)


def glu_grad_(
    da: torch.Tensor,
    saved: torch.Tensor,
    *,
    save: Saved = Saved.FACTORS,
    gate_multiplier: float = 1.0,
    down_multiplier: float = 1.0,
    grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """[dU | dG] for ``down_multiplier * da`` from ``saved`` [M, 2I] (packed, from the forward), written
    over ``saved``, or into ``grad`` (the same shape and strides) where given. Returns the gradient.

    ``save`` says what ``saved`` holds. With ``Saved.PREACT``, ``da`` [M, I] is overwritten with the
    recomputed ``down_multiplier * a``.
    """
    if save == Saved.NOTHING:
        raise ValueError("the gradient pass needs saved factors or pre-activations")
    m, inter = da.shape
    if saved.shape != (m, 2 * inter) or saved.stride(-1) != 1 or da.stride(-1) != 1:
        raise ValueError(
            f"expected row-major dA [M, I] and a packed saved [M, 2I], got {da.shape} and {saved.shape}"
        )
    grad = gradient_target(saved, grad)
    block_m, block_n = (16, 16) if interpreting() else (32, 128)
    _launch_grad(
        (cdiv(m, block_m), cdiv(inter, block_n)),
        da,
        saved,
        grad,
        m,
        inter,
        da.stride(0),
        saved.stride(0),
        float(gate_multiplier),
        float(down_multiplier),
        SAVE=int(save),
        BM=block_m,
        BN=block_n,
        CHUNK_=CHUNK,
        num_warps=4,
    )
    return grad
