"""Row-wise dot products of two [M, N] tensors in one pass, accumulated in fp32: the routing weights'
gradient of the routed experts (the gradient of ``a * w`` times ``a``, row by row).

Without it the products are either rounded to the inputs' dtype before the sum, or both operands
are first copied to fp32 ([M, N] each, the largest transient of the experts' backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, interpreting
from .launch import KernelLauncher


@triton.jit
def _row_dot_kernel(a_ptr, b_ptr, out_ptr, M, N, stride_a, stride_b, BM: tl.constexpr, BN: tl.constexpr):
    o_rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    m_rows = o_rows < M
    b_acc = tl.zeros((BM,), dtype=tl.float32)
    for o_n in range(0, N, BN):
        o_cols = o_n + tl.arange(0, BN)
        mask = m_rows[:, None] & (o_cols[None, :] < N)
        b_a = tl.load(a_ptr + o_rows[:, None] * stride_a + o_cols[None, :], mask=mask, other=0.0)
        b_b = tl.load(b_ptr + o_rows[:, None] * stride_b + o_cols[None, :], mask=mask, other=0.0)
        b_acc += tl.sum(b_a.to(tl.float32) * b_b.to(tl.float32), axis=1)
    tl.store(out_ptr + o_rows, b_acc, mask=m_rows)


_launch_row_dot = KernelLauncher(_row_dot_kernel)

#: Rows and columns of one program's block: on the GPU, 16 rows of 256 columns per load of each input.
GPU_BLOCK = (16, 256)


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` in fp32 for ``a``, ``b`` [M, N] with unit column stride: [M] fp32."""
    if a.shape != b.shape or a.dim() != 2 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"expected two [M, N] row-major tensors, got {tuple(a.shape)} and {tuple(b.shape)}")
    m, n = a.shape
    out = torch.empty(m, dtype=torch.float32, device=a.device)
    if m == 0:
        return out
    block_m, block_n = (4, 16) if interpreting() else GPU_BLOCK
    _launch_row_dot(
        (cdiv(m, block_m),), a, b, out, m, n, a.stride(0), b.stride(0), BM=block_m, BN=block_n, num_warps=4
    )
    return out
