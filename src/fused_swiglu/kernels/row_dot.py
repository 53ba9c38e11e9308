"""Row-wise dot products of two [M, N] tensors in one pass, accumulated in fp32, and both tensors then
scaled row by row in place: the routed experts' backward, where the routing weights' gradient is
the gradient of ``a * w`` times ``a`` row by row, after which ``a`` becomes ``a * w`` (for dW_down)
and the gradient of ``a * w`` becomes that of ``a``.

Without it the products are either rounded to the inputs' dtype before the sum, or both operands
are first copied to fp32 ([M, N] each, the largest transient of the experts' backward), and the two
scalings read both tensors again. The scaled values are rounded as ``Tensor.mul_`` rounds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, interpreting
from .launch import KernelLauncher


@triton.jit
def _row_dot_kernel(
    a_ptr, b_ptr, scale_ptr, out_ptr, M, N, stride_a, stride_b, BM: tl.constexpr, BN: tl.constexpr
):
    o_rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    m_rows = o_rows < M
    b_scale = tl.load(scale_ptr + o_rows, mask=m_rows, other=0.0).to(tl.float32)
    b_acc = tl.zeros((BM,), dtype=tl.float32)
    for o_n in range(0, N, BN):
        o_cols = o_n + tl.arange(0, BN)
        mask = m_rows[:, None] & (o_cols[None, :] < N)
        p_a = a_ptr + o_rows[:, None] * stride_a + o_cols[None, :]
        p_b = b_ptr + o_rows[:, None] * stride_b + o_cols[None, :]
        b_a = tl.load(p_a, mask=mask, other=0.0).to(tl.float32)
        b_b = tl.load(p_b, mask=mask, other=0.0).to(tl.float32)
        b_acc += tl.sum(b_a * b_b, axis=1)  # of the operands as they came, before the scaling
        tl.store(p_a, (b_a * b_scale[:, None]).to(a_ptr.dtype.element_ty), mask=mask)
        tl.store(p_b, (b_b * b_scale[:, None]).to(b_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + o_rows, b_acc, mask=m_rows)


_launch_row_dot = KernelLauncher(_row_dot_kernel)

#: Rows and columns of one program's block on the GPU: 8 rows keep it at 122 registers a thread for
#: sm_90 (16 rows took 246: python -m fused_swiglu.bench.resources).
GPU_BLOCK = (8, 256)


def row_dot_and_scale_(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` in fp32 for ``a``, ``b`` [M, N] with unit column stride ([M] fp32), then
    ``a`` and ``b`` multiplied row by row by ``scale`` [M] in place."""
    if a.shape != b.shape or a.dim() != 2 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"expected two [M, N] row-major tensors, got {tuple(a.shape)} and {tuple(b.shape)}")
    if scale.shape != (a.shape[0],) or not scale.is_contiguous():
        raise ValueError(f"expected a contiguous scale of {a.shape[0]} rows, got {tuple(scale.shape)}")
    m, n = a.shape
    out = torch.empty(m, dtype=torch.float32, device=a.device)
    if m == 0:
        return out
    block_m, block_n = (4, 16) if interpreting() else GPU_BLOCK
    args = (a, b, scale, out, m, n, a.stride(0), b.stride(0))
    _launch_row_dot((cdiv(m, block_m),), *args, BM=block_m, BN=block_n, num_warps=4)
    return out
