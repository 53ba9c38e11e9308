"""SwiGLU of a packed pre-activation already in memory: a = out_scale * silu(gate_scale * g) * u.

Decode-sized batches (a few rows) stream the whole packed weight for very little arithmetic. There
cuBLAS's x @ W_packed^T reads the weight faster than the fused kernel's tiles do
(docs/benchmarks/NOTES.md), so inference at those sizes runs that GEMM and finishes with this one
small pass over the [M, 2I] result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import CHUNK, empty, interpreting


@triton.jit
def _glu_activation_kernel(
    h_ptr,  # [M, 2N] packed [u | g] chunks
    a_ptr,  # [M, N]
    M,
    N,
    stride_h,
    stride_a,
    gate_scale,
    out_scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    CHUNK_: tl.constexpr,
):
    o_rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    o_cols = tl.program_id(1) * BN + tl.arange(0, BN)
    # Intermediate column j sits in packed chunk j // CHUNK: up first, gate CHUNK columns later.
    o_up = (o_cols // CHUNK_) * (2 * CHUNK_) + o_cols % CHUNK_
    mask = (o_rows[:, None] < M) & (o_cols[None, :] < N)
    p_up = h_ptr + o_rows[:, None] * stride_h + o_up[None, :]
    b_up = tl.load(p_up, mask=mask).to(tl.float32)
    b_g = tl.load(p_up + CHUNK_, mask=mask).to(tl.float32) * gate_scale
    b_a = b_g * tl.sigmoid(b_g) * b_up * out_scale
    tl.store(a_ptr + o_rows[:, None] * stride_a + o_cols[None, :], b_a.to(a_ptr.dtype.element_ty), mask=mask)


def glu_activation(h: torch.Tensor, *, gate_scale: float, out_scale: float) -> torch.Tensor:
    """``a`` [M, I] from the packed pre-activation ``h`` [M, 2I] (unit column stride)."""
    m, two_inter = h.shape
    if two_inter % (2 * CHUNK) or h.stride(-1) != 1:
        raise ValueError(f"expected a row-major packed [M, 2I] tensor, got {tuple(h.shape)}")
    inter = two_inter // 2
    a = empty((m, inter), h)
    block_m = 16 if interpreting() else min(16, triton.next_power_of_2(m))
    block_n = 16 if interpreting() else 256
    grid = (triton.cdiv(m, block_m), triton.cdiv(inter, block_n))
    _glu_activation_kernel[grid](
        h,
        a,
        m,
        inter,
        h.stride(0),
        a.stride(0),
        float(gate_scale),
        float(out_scale),
        BM=block_m,
        BN=block_n,
        CHUNK_=CHUNK,
        num_warps=4,
    )
    return a
