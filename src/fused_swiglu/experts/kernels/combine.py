"""Each token's routed rows summed into one row in one pass, accumulated in fp32: the routed experts'
combine (of y's rows in the forward, each scaled by its routing weight, and of dX's rows in the
backward). With one row per output (``k = 1``) it is the routed rows' gather (x's and dy's rows in
the backward).

Without it the ``k`` rows of every token are first gathered into a [tokens * k, H] copy and then
summed: one more tensor of the size of all the routed rows, and one more pass over it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernels.common import cdiv, interpreting
from ...kernels.launch import KernelLauncher


@triton.jit
def _combine_kernel(
    src_ptr,
    rows_ptr,
    w_ptr,
    out_ptr,
    T,
    H,
    stride_src,
    stride_out,
    K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
):
    o_tokens = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    o_cols = tl.program_id(1) * BH + tl.arange(0, BH)
    m_tokens = o_tokens < T
    mask = m_tokens[:, None] & (o_cols[None, :] < H)
    b_acc = tl.zeros((BT, BH), dtype=tl.float32)
    for j in tl.static_range(K):  # in slot order, as a sum over the gathered rows adds them
        o_rows = tl.load(rows_ptr + o_tokens * K + j, mask=m_tokens, other=0).to(tl.int64)
        b_row = tl.load(src_ptr + o_rows[:, None] * stride_src + o_cols[None, :], mask=mask, other=0.0)
        if WEIGHTED:
            b_w = tl.load(w_ptr + o_tokens * K + j, mask=m_tokens, other=0.0).to(tl.float32)
            b_acc += b_row.to(tl.float32) * b_w[:, None]
        else:
            b_acc += b_row.to(tl.float32)
    tl.store(
        out_ptr + o_tokens[:, None] * stride_out + o_cols[None, :],
        b_acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


_launch_combine = KernelLauncher(_combine_kernel)

#: Tokens and columns of one program's block on the GPU, and its warps: at top-8 the eight rows'
#: loads in flight stay within 128 registers a thread, which a 16-token block exceeded (it spilled).
GPU_BLOCK = (8, 256)
GPU_WARPS = 4


def combine_block() -> tuple[int, int]:
    """(tokens, columns) of one program's block, at every number of rows per token (the gather's
    one included: larger blocks copied no faster)."""
    return (4, 16) if interpreting() else GPU_BLOCK


def combine(
    src: torch.Tensor, rows: torch.Tensor, k: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[t] = sum(weights[t * k + j] * src[rows[t * k + j]] for j < k)`` (without ``weights``, each
    weight 1), summed in fp32, for ``src`` [P, H] with unit column stride, ``rows`` [T * k] int32 or
    int64 row indices and ``weights`` [T * k] contiguous: [T, H] in ``src``'s dtype."""
    if src.dim() != 2 or src.stride(-1) != 1 or rows.dim() != 1 or k < 1 or rows.numel() % k:
        raise ValueError(
            f"expected a row-major [P, H] tensor and [T * k] rows with k >= 1, got {tuple(src.shape)}, "
            f"{tuple(rows.shape)} and k={k}"
        )
    if weights is not None and (weights.shape != rows.shape or weights.stride(0) != 1):
        raise ValueError(
            f"expected contiguous weights of the rows' shape {tuple(rows.shape)}, got {tuple(weights.shape)}"
        )
    tokens, hidden = rows.numel() // k, src.shape[1]
    out = torch.empty(tokens, hidden, dtype=src.dtype, device=src.device)
    if tokens == 0 or hidden == 0:
        return out
    block_t, block_h = combine_block()
    grid = (cdiv(tokens, block_t), cdiv(hidden, block_h))
    _launch_combine(
        grid,
        src,
        rows,
        rows if weights is None else weights,  # not read without weights
        out,
        tokens,
        hidden,
        src.stride(0),
        out.stride(0),
        K=k,
        WEIGHTED=weights is not None,
        BT=block_t,
        BH=block_h,
        num_warps=GPU_WARPS,
    )
    return out
