"""SwiGLU of a packed pre-activation already in memory: a = down_multiplier * silu(gate_multiplier * g) * u.

The pass that finishes a cuBLAS x @ W_packed^T where the fused kernel is not used:

* decode-sized inference (a few rows streams the whole packed weight for very little arithmetic,
  and cuBLAS reads it faster than the fused kernel's tiles, docs/design/kernel-choice.md): ``a`` only;
* fp32 (``kernels/glu_split.py``): for training it also turns the pre-activation into the saved
  factors [silu(g) | gate_multiplier * u * silu'(g)] in place, as the fused kernel's epilogue would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import CHUNK, cdiv, empty, interpreting, next_power_of_2, silu_and_slope
from .launch import KernelLauncher


@triton.jit
def _glu_activation_kernel(
    h_ptr,  # [M, 2N] packed [u | g] chunks (factors out when FACTORS_IN_PLACE)
    a_ptr,  # [M, N], or None
    M,
    N,
    stride_h,
    stride_a,
    gate_multiplier,
    down_multiplier,
    FACTORS_IN_PLACE: tl.constexpr,
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
    b_g = tl.load(p_up + CHUNK_, mask=mask).to(tl.float32) * gate_multiplier
    b_silu, b_slope = silu_and_slope(b_g)
    if a_ptr is not None:
        b_a = b_silu * b_up * down_multiplier
        tl.store(
            a_ptr + o_rows[:, None] * stride_a + o_cols[None, :], b_a.to(a_ptr.dtype.element_ty), mask=mask
        )
    if FACTORS_IN_PLACE:
        tl.store(p_up, b_silu.to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(p_up + CHUNK_, (b_up * b_slope * gate_multiplier).to(h_ptr.dtype.element_ty), mask=mask)


_launch_activation = KernelLauncher(_glu_activation_kernel)


def glu_activation(
    h: torch.Tensor,
    *,
    gate_multiplier: float,
    down_multiplier: float,
    factors_in_place: bool = False,
    write_a: bool = True,
) -> torch.Tensor | None:
    """``a`` [M, I] from the packed pre-activation ``h`` [M, 2I] (unit column stride).

    With ``factors_in_place``, ``h`` is overwritten with the packed factors the backward reads.
    ``write_a=False`` (only with ``factors_in_place``) skips ``a`` and returns ``None``.
    """
    m, two_inter = h.shape
    if two_inter % (2 * CHUNK) or h.stride(-1) != 1:
        raise ValueError(f"expected a row-major packed [M, 2I] tensor, got {tuple(h.shape)}")
    if not (write_a or factors_in_place):
        raise ValueError("the activation pass must write a, the factors, or both")
    inter = two_inter // 2
    a = empty((m, inter), h) if write_a else None
    block_m = 16 if interpreting() else min(16, next_power_of_2(m))
    block_n = 16 if interpreting() else 256
    _launch_activation(
        (cdiv(m, block_m), cdiv(inter, block_n)),
        h,
        a,
        m,
        inter,
        h.stride(0),
        inter if a is None else a.stride(0),
        float(gate_multiplier),
        float(down_multiplier),
        FACTORS_IN_PLACE=factors_in_place,
        BM=block_m,
        BN=block_n,
        CHUNK_=CHUNK,
        num_warps=4,
    )
    return a
