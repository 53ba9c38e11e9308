"""Backward of the GLU operator alone: [f_up | f_gate] * dA -> [dU | dG], in place, one pass.

When the caller owns the down projection, dA arrives from outside and the only work left between
the two backward GEMMs is this elementwise product of the saved factors with dA (the same dA
multiplies both halves of a packed chunk). It is memory-bound: read dA and the factors, write the
gradient over the factors. A broadcast ``mul_`` in PyTorch does the same in place but reaches about
half the copy bandwidth on the packed chunk layout (docs/benchmarks/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import CHUNK, interpreting


@triton.jit
def _glu_grad_kernel(
    da_ptr,  # [M, N]
    s_ptr,  # [M, 2N] packed factors in, packed gradient out
    M,
    N,
    stride_da,
    stride_s,
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
    b_da = tl.load(
        da_ptr + o_rows[:, None] * stride_da + o_cols[None, :], mask=m_rows & (o_cols[None, :] < N)
    )
    p_s = s_ptr + o_rows[:, None] * stride_s + o_packed[None, :]
    m_s = m_rows & (o_packed[None, :] < 2 * N)
    b_s = tl.load(p_s, mask=m_s).to(tl.float32)
    # [BM, chunks, 2, CHUNK] * [BM, chunks, 1, CHUNK]: the same dA scales the up and the gate factor.
    b_grad = tl.reshape(b_s, (BM, BN // CHUNK_, 2, CHUNK_)) * tl.reshape(
        b_da.to(tl.float32), (BM, BN // CHUNK_, 1, CHUNK_)
    )
    tl.store(p_s, tl.reshape(b_grad, (BM, 2 * BN)).to(s_ptr.dtype.element_ty), mask=m_s)


def glu_grad_(da: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Overwrite ``factors`` [M, 2I] (packed, from a ``Saved.FACTORS`` forward) with [dU | dG]; returns it."""
    m, inter = da.shape
    if factors.shape != (m, 2 * inter) or factors.stride(-1) != 1 or da.stride(-1) != 1:
        raise ValueError(
            f"expected row-major dA [M, I] and factors [M, 2I], got {da.shape} and {factors.shape}"
        )
    block_m, block_n = (16, 16) if interpreting() else (32, 128)
    grid = (triton.cdiv(m, block_m), triton.cdiv(inter, block_n))
    _glu_grad_kernel[grid](
        da,
        factors,
        m,
        inter,
        da.stride(0),
        factors.stride(0),
        BM=block_m,
        BN=block_n,
        CHUNK_=CHUNK,
        num_warps=4,
    )
    return factors
