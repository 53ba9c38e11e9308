"""The routed experts' weight gradients: per expert ``e``, ``out[e] = left[rows]^T @ right[rows]`` over
the expert's grouped rows ``[ends[e-1], ends[e])``, each operand's rows read directly or by index
(row p is the index's row p of the operand: x's and dy's rows by their token, no gathered copy).

One persistent kernel; a tile is one expert's [BM, BN] block of the output, summed over the
expert's rows in steps of BK (the reduction runs along the rows, cut at the group's end by masks).
An expert that receives no row gets zeros. Tiles run expert by expert, so one expert's rows are
read from L2 by all of its tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, dot_precision, empty, interpreting, persistent_programs, tile_coords
from .launch import KernelLauncher


@triton.jit
def _row_pointers(ptr, index_ptr, stride, offs_k, m_k, offs_c):
    """[BK, C] pointers to columns ``offs_c`` of rows ``offs_k`` (through ``index_ptr`` if given)."""
    if index_ptr is not None:
        rows = tl.load(index_ptr + offs_k, mask=m_k, other=0).to(tl.int64)
    else:
        rows = offs_k.to(tl.int64)
    return ptr + rows[:, None] * stride + offs_c[None, :]


@triton.jit
def _weight_grad_kernel(
    l_ptr,  # [*, M] left operand
    l_index_ptr,  # [P] int32 left's row of each grouped row, or None (left's rows are the grouped rows)
    stride_l,
    r_ptr,  # [*, N] right operand
    r_index_ptr,  # as l_index_ptr, for right
    stride_r,
    out_ptr,  # [E, M, N] contiguous
    ends_ptr,  # [E] int32 end row of each expert's group
    E,
    M,
    N,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_expert = num_m * num_n
    for tile in tl.range(tl.program_id(0), E * per_expert, tl.num_programs(0)):
        e = tile // per_expert
        i_m, i_n = tile_coords(tile % per_expert, num_m, num_n, GROUP_M)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
        offs_m = i_m * BM + tl.arange(0, BM)
        offs_n = i_n * BN + tl.arange(0, BN)
        m_m = offs_m < M
        m_n = offs_n < N
        b_acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i_k in range(tl.cdiv(end - start, BK)):
            offs_k = start + i_k * BK + tl.arange(0, BK)
            m_k = offs_k < end
            l_ptrs = _row_pointers(l_ptr, l_index_ptr, stride_l, offs_k, m_k, offs_m)
            r_ptrs = _row_pointers(r_ptr, r_index_ptr, stride_r, offs_k, m_k, offs_n)
            b_l = tl.load(l_ptrs, mask=m_k[:, None] & m_m[None, :], other=0.0)  # [BK, BM]
            b_r = tl.load(r_ptrs, mask=m_k[:, None] & m_n[None, :], other=0.0)  # [BK, BN]
            b_acc = tl.dot(b_l.T, b_r, b_acc, input_precision=DOT_PRECISION)
        out = out_ptr + e.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(out, b_acc.to(out_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


_launch = KernelLauncher(_weight_grad_kernel)

#: (BM, BN, BK, warps, stages) on the GPU; the interpreter walks small tiles.
GPU_CONFIG = (128, 128, 64, 8, 4)
INTERPRETER_CONFIG = (16, 16, 16, 1, 1)


def _check_index(index: torch.Tensor | None, rows: int, name: str) -> None:
    if index is not None and (index.dtype != torch.int32 or index.shape != (rows,) or index.stride(0) != 1):
        raise ValueError(
            f"{name} must be a contiguous int32 [{rows}] row index, got {index.dtype} {tuple(index.shape)}"
        )


def grouped_weight_grad(
    left: torch.Tensor,
    right: torch.Tensor,
    ends: torch.Tensor,
    *,
    left_index: torch.Tensor | None = None,
    right_index: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """[E, M, N] in ``left``'s dtype: ``out[e] = L[lo:hi]^T @ R[lo:hi]`` with ``lo, hi`` expert
    ``e``'s rows (``ends`` [E] int32, the end row of each group), ``L = left[left_index]`` (or
    ``left`` [P, M] itself) and ``R = right[right_index]`` (or ``right`` [P, N]); both operands
    row-major with unit column stride, summed in fp32."""
    rows = left_index.shape[0] if left_index is not None else left.shape[0]  # the grouped rows
    if left.dim() != 2 or right.dim() != 2 or left.stride(-1) != 1 or right.stride(-1) != 1:
        raise ValueError(f"expected row-major 2-D operands, got {tuple(left.shape)} and {tuple(right.shape)}")
    if ends.dtype != torch.int32 or ends.dim() != 1 or left.dtype != right.dtype:
        raise ValueError(f"expected int32 ends [E] and operands of one dtype, got {ends.dtype}, {left.dtype}")
    _check_index(left_index, rows, "left_index")
    _check_index(right_index, rows, "right_index")
    if right_index is None and right.shape[0] != rows or left_index is None and left.shape[0] != rows:
        raise ValueError(f"an operand read directly must have the grouped rows' {rows} rows")
    experts, m, n = ends.shape[0], left.shape[1], right.shape[1]
    out = empty((experts, m, n), left)
    if out.numel() == 0:
        return out
    bm, bn, bk, warps, stages = config or (INTERPRETER_CONFIG if interpreting() else GPU_CONFIG)
    tiles = experts * cdiv(m, bm) * cdiv(n, bn)
    _launch(
        (persistent_programs(tiles, left.device),),
        left,
        left_index,
        left.stride(0),
        right,
        right_index,
        right.stride(0),
        out,
        ends,
        experts,
        m,
        n,
        BM=bm,
        BN=bn,
        BK=bk,
        GROUP_M=8,
        DOT_PRECISION=dot_precision(left.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out
