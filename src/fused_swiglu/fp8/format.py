"""The FP8 format of the library's FP8 path, in one place: e4m3 values with fp32 scales, in groups
local to a 128-wide tile, and the scaled GEMM that reads them.

* **Rows** (activations and gradients, the GEMM's A operand and the weight-gradient GEMMs' B):
  ``data`` [R, C] e4m3, one scale per row and group of ``GROUP`` columns, the reduction dimension
  of the GEMM that reads it; ``scales`` stored [ceil(C / GROUP), R] (column-major as a [R, C/GROUP]
  matrix: the layout cuBLAS reads for both operands of a blockwise GEMM).
* **Blocks** (weights): ``data`` [R, C] e4m3, one scale per ``GROUP`` x ``GROUP`` block; ``scales``
  [ceil(R / GROUP), ceil(C / GROUP)]. A block scale serves the weight and its transpose alike.

**Halves** (the packed [up | gate] tensors of width 2I: the gate/up GEMM's output h, what training
keeps, the packed gradient): a group of ``GROUP`` packed columns holds ``HALF`` intermediate columns,
their up values then their gate values (``pack_halves``), so a pass reads up and gate as two tiles
and writes them back as two; the intermediate size is padded with zeros to whole groups
(``halves_width``). The weights' own packing (layout.py) is this order's source and destination:
the gate/up weight's blocks are read in halves, and the gate/up weight gradient's operand is
written in the weight's order.

The operands of a GEMM whose B is in blocks are zero-padded along the reduction dimension to
``reduction_width(K)``, a multiple of 4 groups: cuBLAS reads block scales at 16-byte row strides,
and torch 2.11 takes them only unpadded, so at other widths its blockwise GEMM returns wrong products
without an error (CUDA 13.0, H100: hidden 896, intermediate 4864 or 11008). Zero columns add
nothing to the products.

A group's scale is ``amax / 448`` (e4m3's largest finite value), 1 for an all-zero group: the
group's largest magnitude becomes 448 with no rounding, which is what a group holding an outlier
channel needs (power-of-two scales rounded the outlier itself and lost 1 to 2.6 dB SQNR with x100
and x1000 outlier channels; docs/design/fp8.md). A group is scaled by multiplying by
``448 / amax``; the scale and its inverse are each rounded once, to nearest, and the cast to e4m3
rounds to nearest even. NaN does not enter the amax and stays NaN; an infinity makes its group's
scale infinite, so the GEMMs that read the group return NaN where it contributes. The functions
here are the PyTorch reference of the kernels (kernels.py), the tests' oracle, and the GEMM.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.common import cdiv
from ..layout import pack_gate_up, unpack_gate_up

#: Elements per scale along a GEMM's reduction dimension (and the weight blocks' side).
GROUP = 128
#: Intermediate columns per group of a packed tensor in halves: up's and gate's share of a group.
HALF = GROUP // 2
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
#: The smallest amax a scale is made from (scale 2^-126, fp32's smallest normal): below it, 448 / amax
#: would overflow.
MIN_AMAX = E4M3_MAX * 2.0**-126


class Fp8(NamedTuple):
    """An e4m3 tensor and its scales (``blocks``: 128 x 128 blocks; else 1 x 128 rows)."""

    data: torch.Tensor
    scales: torch.Tensor
    blocks: bool = False


def reduction_width(k: int) -> int:
    """The reduction dimension of a GEMM with blocks, padded to a multiple of 4 groups."""
    return cdiv(k, 4 * GROUP) * 4 * GROUP


def padded_rows(m: int) -> int:
    """Rows of the FP8 path's activations: tokens rounded up to a whole group, so that the weight
    gradients' reduction over tokens runs over whole groups (the padding rows are zeros)."""
    return cdiv(m, GROUP) * GROUP


def halves_width(inter: int) -> int:
    """The width of a packed tensor in halves: 2I, with I padded to a multiple of ``HALF``."""
    return 2 * cdiv(inter, HALF) * HALF


def pack_halves(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[M, I] and [M, I] -> [M, halves_width(I)]: per group, ``HALF`` columns of each (zeros past I)."""
    m, inter = first.shape
    groups = cdiv(inter, HALF)
    pad = (0, groups * HALF - inter)
    halves = [torch.nn.functional.pad(t, pad).view(m, groups, 1, HALF) for t in (first, second)]
    return torch.cat(halves, dim=2).view(m, groups * GROUP)


def unpack_halves(packed: torch.Tensor, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack_halves``: (first, second), each [M, inter]."""
    grouped = packed.view(packed.shape[0], -1, 2, HALF)
    return tuple(grouped[:, :, i].reshape(packed.shape[0], -1)[:, :inter] for i in (0, 1))


def gate_up_in_halves(w: torch.Tensor) -> torch.Tensor:
    """Rows in the weight's packing [2I, R] (the gate/up weight, a low-rank term's v) -> the same rows
    in halves [halves_width(I), R]: the order of h and of everything the passes make from it."""
    gate, up = unpack_gate_up(w)
    return pack_halves(up.t(), gate.t()).t()


def gate_up_from_halves(t: torch.Tensor, inter: int) -> torch.Tensor:
    """The inverse of ``gate_up_in_halves``: [halves_width(I), R] -> [2I, R] in the weight's packing."""
    up, gate = unpack_halves(t.t().contiguous(), inter)
    return pack_gate_up(gate.t(), up.t())


def group_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse): ``amax / 448`` and ``448 / amax`` in fp32 (amax at least ``MIN_AMAX``),
    each rounded to nearest; 1 and 1 where ``amax`` is 0, inf and 0 where it is inf."""
    amax = amax.float()
    clamped = amax.clamp_min(MIN_AMAX)
    # Tensors on both sides: with a Python number on either side PyTorch takes a reciprocal and a
    # product (two roundings) on some devices, where the kernels divide once.
    fmax = torch.full_like(clamped, E4M3_MAX)
    scale, inverse = clamped / fmax, fmax / clamped
    zero = amax == 0
    return torch.where(zero, 1.0, scale), torch.where(zero, 1.0, inverse)


def _group_amax(t: torch.Tensor, dims) -> torch.Tensor:
    return torch.nan_to_num(t.abs(), nan=0.0, posinf=torch.inf).amax(dim=dims)


def _to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)  # clamp keeps NaN


def quantize_rows(t: torch.Tensor, rows: int | None = None, width: int | None = None) -> Fp8:
    """``t`` [R, C] in 1 x GROUP groups along C; ``rows`` >= R and ``width`` >= C pad with zeros."""
    r, c = t.shape
    rows, width = (r if rows is None else rows), (c if width is None else width)
    groups = cdiv(width, GROUP)
    padded = torch.nn.functional.pad(t.float(), (0, groups * GROUP - c, 0, rows - r))
    grouped = padded.view(rows, groups, GROUP)
    scales, inverse = group_scale(_group_amax(grouped, -1))  # [rows, groups]
    data = _to_e4m3(grouped * inverse[..., None]).view(rows, groups * GROUP)[:, :width]
    return Fp8(data.contiguous(), scales.t().contiguous())


def quantize_blocks(w: torch.Tensor, width: int | None = None) -> Fp8:
    """``w`` [R, C] in GROUP x GROUP blocks; ``width`` >= C pads with zero columns."""
    r, c = w.shape
    width = c if width is None else width
    rb, cb = cdiv(r, GROUP), cdiv(width, GROUP)
    padded = torch.nn.functional.pad(w.float(), (0, cb * GROUP - c, 0, rb * GROUP - r))
    grouped = padded.view(rb, GROUP, cb, GROUP)
    scales, inverse = group_scale(_group_amax(grouped, (1, 3)))  # [rb, cb]
    data = _to_e4m3(grouped * inverse[:, None, :, None]).view(rb * GROUP, cb * GROUP)[:r, :width]
    return Fp8(data.contiguous(), scales, blocks=True)


def dequantize(t: Fp8) -> torch.Tensor:
    """The fp32 values ``t`` stands for."""
    r, c = t.data.shape
    if t.blocks:
        scales = t.scales.repeat_interleave(GROUP, 0)[:r].repeat_interleave(GROUP, 1)[:, :c]
    else:
        scales = t.scales.t().repeat_interleave(GROUP, 1)[:, :c]
    return t.data.float() * scales


def uses_cublas(device: torch.device) -> bool:
    """Whether the scaled GEMMs run on cuBLAS (a CUDA device; elsewhere they are emulated)."""
    return device.type == "cuda"


def mm(a: Fp8, b: Fp8, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b^T`` [M, N] in ``out_dtype`` from ``a`` [M, K] (rows) and ``b`` [N, K] (rows or blocks),
    both grouped along K: cuBLAS's blockwise-scaled FP8 GEMM with fp32 accumulation, promoted
    group by group (no fast accumulation); off CUDA, the product of the dequantized operands."""
    if not uses_cublas(a.data.device):
        with torch.autocast(a.data.device.type, enabled=False):
            return (dequantize(a) @ dequantize(b).t()).to(out_dtype)
    scale_b = b.scales.t() if b.blocks else b.scales
    return torch._scaled_mm(a.data, b.data.t(), a.scales.t(), scale_b, out_dtype=out_dtype)
