"""The FP8 path's passes between its GEMMs, each one read and one write per element (format.py
defines what they write; it is their reference):

* ``quantize_activation``: x or dY [M, F] -> rows [Mp, F] for the GEMM that reduces over F and,
  from the same tile, rows of the transpose [F, Mp] for the weight gradient that reduces over tokens;
* ``quantize_weight``: a weight [R, C] -> 128 x 128 blocks, as it is or transposed; the packed
  gate/up weight's rows read in halves (format.py), so that the gate/up GEMM writes h in halves;
* ``glu_forward``: the gate/up GEMM's output h [Mp, 2I] in halves -> ``a`` as rows for the down
  GEMM and what training keeps (factors or pre-activations, in halves, as rows), with the factors
  also ``a``'s transpose as rows for dW_down, all in FP8;
* ``glu_backward``: dA [Mp, I] and the kept tensor -> the packed gradient [dU | dG] in halves as
  rows for dX and its transpose, in the weight's packing, as rows for dW_gate_up, and from kept
  pre-activations ``a``'s transpose (the forward did not keep it: I bytes a token less, for a pass
  that reads the same bytes);
* ``dequantize``: rows -> their values in 16 or 32 bits, for LoRA's terms beside the FP8 GEMMs.

A tile is 128 rows (one group of tokens) by one group of columns, so each tile finds its own
scales; up and gate come and go as two [128, 64] tiles of a group in halves, so nothing is
de-interleaved in registers. Tiles move through TMA descriptors: no pointer per element in registers
(a [128, 128] tile stored through pointers spilled on sm_90), reads past a tensor's edge are zeros
(the padding rows and columns) and writes past it are dropped. Under Triton's interpreter (CPU
tests), which rounds to e4m3 wrongly (triton 3.6: ties away from even, 127 to 64, NaN to 384) and
reads NaN codes as 480, the kernels encode and decode e4m3 in integer arithmetic and store bytes
(``SOFTWARE``), to the same result as the GPU's conversion (round to nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.common import (
    CHUNK,
    cdiv,
    descriptor,
    empty,
    interpreting,
    silu_and_slope,
    tma_ready,
)
from ..kernels.configs import FP8_PASS_WARPS, fp8_forward_pass, fp8_gradient_pass
from ..kernels.launch import KernelLauncher, Tma
from .format import E4M3, GROUP, HALF, MIN_AMAX, Fp8, halves_width, reduction_width

#: Interpreter: encode and decode e4m3 in integer arithmetic (see the module docstring).
SOFTWARE = interpreting()
MIN_AMAX_ = tl.constexpr(MIN_AMAX)


@triton.jit
def _group_scale(amax):
    """(scale, 1 / scale) of a group, as format.group_scale makes them: amax / 448 and 448 / amax,
    each rounded to nearest (``div_rn``, not the GPU's approximate division), amax at least
    ``MIN_AMAX``; 1 and 1 for a group of zeros (or of NaN only), inf and 0 for inf."""
    clamped = tl.maximum(amax, MIN_AMAX_)
    scale = tl.div_rn(clamped, 448.0)
    inverse = tl.div_rn(tl.full(clamped.shape, 448.0, tl.float32), clamped)
    none = (amax == 0.0) | (amax != amax)
    return tl.where(none, 1.0, scale), tl.where(none, 1.0, inverse)


@triton.jit
def _amax(b, axis: tl.constexpr, SOFTWARE_: tl.constexpr):
    """The largest magnitude along ``axis``, NaN left out (it stays NaN in the data): the GPU's
    max.f32 returns the number of a number and NaN; the interpreter's propagates NaN."""
    if SOFTWARE_:
        b = tl.where(b != b, 0.0, b)
    return tl.max(tl.abs(b), axis=axis)


@triton.jit
def _e4m3_bits(v):
    """The e4m3 code (uint8) of fp32 ``v`` (|v| <= 448 or NaN), rounded to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    mag = bits & 0x7FFFFFFF
    # Normal e4m3 (|v| >= 2^-6): keep 3 of fp32's 23 mantissa bits, ties to even.
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0x7FF00000
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    # Subnormal e4m3: multiples of 2^-9, ties to even (adding 2^23 rounds to an integer).
    tiny = (tl.abs(v) * 512.0 + 8388608.0) - 8388608.0
    code = tl.where(mag >= 0x3C800000, normal, tiny.to(tl.int32))
    code = tl.where(code > 0x7E, 0x7E, code)  # saturate at 448
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def _e4m3(v, SOFTWARE_: tl.constexpr):
    """fp32 ``v`` (|v| at most 448 before rounding, or NaN) as stored: e4m3 (sm_90's conversion
    saturates at 448 and keeps NaN), or its code under the interpreter."""
    if SOFTWARE_:
        return _e4m3_bits(tl.where(v > 448.0, 448.0, tl.where(v < -448.0, -448.0, v)))  # keeps NaN
    return v.to(tl.float8e4nv)


@triton.jit
def _from_e4m3(b, SOFTWARE_: tl.constexpr):
    """Loaded e4m3 values (codes under the interpreter) as fp32."""
    if SOFTWARE_:
        code = b.to(tl.int32)
        exponent = (code >> 3) & 0xF
        mantissa = code & 7
        normal = ((exponent + 120) << 23 | mantissa << 20).to(tl.float32, bitcast=True)
        mag = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
        mag = tl.where((code & 0x7F) == 0x7F, float("nan"), mag)
        return tl.where((code & 0x80) != 0, -mag, mag)
    return b.to(tl.float32)


@triton.jit
def _quantized_rows(b, SOFTWARE_: tl.constexpr):
    """``b`` [R, G] in e4m3 (codes under the interpreter), one scale per row."""
    scale, inverse = _group_scale(_amax(b, 1, SOFTWARE_))
    return _e4m3(b * inverse[:, None], SOFTWARE_), scale


@triton.jit
def _quantized_columns(b, SOFTWARE_: tl.constexpr):
    """``b`` [BM, W] quantized down its columns, transposed: [W, BM] e4m3, one scale per column."""
    scale, inverse = _group_scale(_amax(b, 0, SOFTWARE_))
    return tl.trans(_e4m3(b * inverse[None, :], SOFTWARE_)), scale


@triton.jit
def _quantize_activation_kernel(
    x_desc,  # [M, F], tiles [BM, G]
    q_desc,  # [Mp, Fp]: F padded with zeros to the GEMM's reduction width
    s_ptr,  # [Fp / G, Mp]
    qt_desc,  # [F, Mp], tiles [G, BM]; or None
    st_ptr,  # [Mp / G, F], or None
    F,
    Mp,
    BM: tl.constexpr,
    G: tl.constexpr,
    SOFTWARE_: tl.constexpr,
):
    i_m, i_f = tl.program_id(0), tl.program_id(1)
    o_m, o_f = i_m * BM, i_f * G
    b_x = x_desc.load([o_m, o_f]).to(tl.float32)
    q, scale = _quantized_rows(b_x, SOFTWARE_)
    q_desc.store([o_m, o_f], q)
    tl.store(s_ptr + i_f.to(tl.int64) * Mp + o_m + tl.arange(0, BM), scale)
    if qt_desc is not None:  # noqa: SIM102 - a compile-time branch around a run-time one
        if o_f < F:  # the transpose has no padding columns
            q_t, scale_t = _quantized_columns(b_x, SOFTWARE_)
            qt_desc.store([o_f, o_m], q_t)
            o_c = o_f + tl.arange(0, G)
            tl.store(st_ptr + i_m.to(tl.int64) * F + o_c, scale_t, mask=o_c < F)


@triton.jit
def _quantize_weight_kernel(
    w_desc,  # [R, C], tiles [G / 2, G]; the gate/up weight (HALVES): in chunk pairs (_chunk_pairs)
    q_desc,  # [R', Cp] tiles [G / 2, G], or [C, Rp] tiles [G, G / 2] transposed: R' = halves_width(I)
    s_ptr,  # [R' / G, Cp / G], or [C / G, Rp / G] transposed
    TRANSPOSED: tl.constexpr,
    HALVES: tl.constexpr,  # the packed gate/up weight, its rows read in halves (format.py)
    G: tl.constexpr,
    CHUNK_: tl.constexpr,
    SOFTWARE_: tl.constexpr,
):
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    b_first = _weight_half(w_desc, i_r, i_c, 0, HALVES, G, CHUNK_)
    b_second = _weight_half(w_desc, i_r, i_c, 1, HALVES, G, CHUNK_)
    scale, inverse = _group_scale(
        tl.maximum(tl.max(_amax(b_first, 1, SOFTWARE_), 0), tl.max(_amax(b_second, 1, SOFTWARE_), 0))
    )
    q_first, q_second = _e4m3(b_first * inverse, SOFTWARE_), _e4m3(b_second * inverse, SOFTWARE_)
    if TRANSPOSED:
        q_desc.store([i_c * G, i_r * G], tl.trans(q_first))
        q_desc.store([i_c * G, i_r * G + G // 2], tl.trans(q_second))
        tl.store(s_ptr + i_c * tl.num_programs(0) + i_r, scale)
    else:
        q_desc.store([i_r * G, i_c * G], q_first)
        q_desc.store([i_r * G + G // 2, i_c * G], q_second)
        tl.store(s_ptr + i_r * tl.num_programs(1) + i_c, scale)


@triton.jit
def _weight_half(w_desc, i_r, i_c, half, HALVES: tl.constexpr, G: tl.constexpr, CHUNK_: tl.constexpr):
    """Rows [G / 2, G] of block (i_r, i_c): of the packed gate/up weight, one half of group i_r."""
    if HALVES:  # the layout's chunks, [up | gate] in pairs: one half is every other chunk
        b = w_desc.load([i_r * (G // (2 * CHUNK_)), half * CHUNK_, i_c * G])
        b = tl.reshape(b, (G // 2, G))
    else:
        b = w_desc.load([i_r * G + half * (G // 2), i_c * G])
    return b.to(tl.float32)


@triton.jit
def _store_halves(first, second, desc, s_ptr, o_m, i_g, Mp, G: tl.constexpr, SOFTWARE_: tl.constexpr):
    """Group ``i_g`` of a tensor in halves, [first | second] ([BM, G / 2] each), stored as rows:
    e4m3 and one scale per row."""
    scale, inverse = _group_scale(tl.maximum(_amax(first, 1, SOFTWARE_), _amax(second, 1, SOFTWARE_)))
    desc.store([o_m, i_g * G], _e4m3(first * inverse[:, None], SOFTWARE_))
    desc.store([o_m, i_g * G + G // 2], _e4m3(second * inverse[:, None], SOFTWARE_))
    tl.store(s_ptr + i_g.to(tl.int64) * Mp + o_m + tl.arange(0, first.shape[0]), scale)


@triton.jit
def _store_transposed(b, desc, offsets, s_row, columns, mask, SOFTWARE_: tl.constexpr):
    """``b`` [BM, G / 2] stored transposed, as rows: the tile at ``offsets`` of ``desc`` ([G / 2, BM],
    or the same split in chunks), and its columns' scales at ``s_row + columns``."""
    q_t, scale_t = _quantized_columns(b, SOFTWARE_)
    desc.store(offsets, tl.reshape(q_t, desc.block_shape))
    tl.store(s_row + columns, scale_t, mask=mask)


@triton.jit
def _store_a_t(b_a, at_desc, ats_ptr, o_m, i_m, o_n, N, G: tl.constexpr, SOFTWARE_: tl.constexpr):
    """``a`` [BM, G / 2] (intermediate columns ``o_n`` on) stored transposed, as rows of [N, Mp]."""
    o_c = o_n + tl.arange(0, G // 2)
    _store_transposed(b_a, at_desc, [o_n, o_m], ats_ptr + i_m.to(tl.int64) * N, o_c, o_c < N, SOFTWARE_)


@triton.jit
def _glu_group(
    h_desc, k_desc, ks_ptr, at_desc, ats_ptr, o_m, i_m, i_g, Mp, N, gate_multiplier, down_multiplier,
    SAVE: tl.constexpr, G: tl.constexpr, SOFTWARE_: tl.constexpr
):  # fmt: skip
    """One group of h (``i_g``: G / 2 intermediate columns) through the forward pass: the kept
    tensor's group and ``a``'s transposed columns stored; ``down_multiplier * a`` [BM, G / 2]
    returned for ``a``'s rows."""
    inside = i_g * (G // 2) < N  # else a group past I: zeros in, nothing of it kept
    b_up = h_desc.load([o_m, i_g * G]).to(tl.float32)
    b_gate = h_desc.load([o_m, i_g * G + G // 2]).to(tl.float32)
    if k_desc is not None and SAVE == 2:  # noqa: SIM102 - a compile-time branch around a run-time one
        if inside:  # the pre-activations as they are, before the SwiGLU takes registers
            _store_halves(b_up, b_gate, k_desc, ks_ptr, o_m, i_g, Mp, G, SOFTWARE_)
    b_silu, b_slope = silu_and_slope(b_gate * gate_multiplier)
    b_a = b_silu * b_up * down_multiplier
    if k_desc is not None:  # noqa: SIM102
        if inside:
            if SAVE == 1:
                b_up_factor = b_up * b_slope * gate_multiplier
                _store_halves(b_silu, b_up_factor, k_desc, ks_ptr, o_m, i_g, Mp, G, SOFTWARE_)
            if at_desc is not None:
                _store_a_t(b_a, at_desc, ats_ptr, o_m, i_m, i_g * (G // 2), N, G, SOFTWARE_)
    return b_a


@triton.jit
def _glu_forward_kernel(  # N: the intermediate size
    h_desc,  # [Mp, halves_width(N)] in halves, the gate/up GEMM's output; tiles [BM, G / 2]
    a_desc,  # [Mp, Np] e4m3: N padded with zeros to the down GEMM's reduction width; tiles [BM, G / 2]
    as_ptr,  # [Np / G, Mp]
    at_desc,  # [N, Mp] e4m3, tiles [G / 2, BM]; or None (inference, pre-activations kept)
    ats_ptr,  # [Mp / G, N]
    k_desc,  # [Mp, halves_width(N)] e4m3 in halves: factors or pre-activations, tiles [BM, G / 2]; or None
    ks_ptr,  # [halves_width(N) / G, Mp]
    Mp,
    N,
    gate_multiplier,
    down_multiplier,
    SAVE: tl.constexpr,  # 1: factors [silu(g) | gate_multiplier * u * silu'(g)]; 2: [u | unscaled g]
    BM: tl.constexpr,
    G: tl.constexpr,
    GROUPS_: tl.constexpr,  # groups of a's rows a program makes, one after another
    STAGES_: tl.constexpr,  # loads in flight ahead of the group being made
    SOFTWARE_: tl.constexpr,
):
    # A program makes GROUPS_ groups of a's rows (G intermediate columns each), each from two groups
    # of h; the loop lets the next groups' loads run while one is made.
    i_m, i_p = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM
    if GROUPS_ == 1:  # no loop, whose counter costs registers
        _a_group(
            h_desc, a_desc, as_ptr, k_desc, ks_ptr, at_desc, ats_ptr, o_m, i_m, i_p, Mp, N,
            gate_multiplier, down_multiplier, SAVE, G, SOFTWARE_,
        )  # fmt: skip
    else:
        first = i_p * GROUPS_
        last = tl.minimum(first + GROUPS_, tl.cdiv(N, 4 * G) * 4)  # a's groups: reduction_width(N) / G
        for i in tl.range(first, last, num_stages=STAGES_):
            i_n = tl.cast(i, tl.int32)  # the interpreter's loop counts in Python ints
            _a_group(
                h_desc, a_desc, as_ptr, k_desc, ks_ptr, at_desc, ats_ptr, o_m, i_m, i_n, Mp, N,
                gate_multiplier, down_multiplier, SAVE, G, SOFTWARE_,
            )  # fmt: skip


@triton.jit
def _a_group(
    h_desc, a_desc, as_ptr, k_desc, ks_ptr, at_desc, ats_ptr, o_m, i_m, i_n, Mp, N, gate_multiplier,
    down_multiplier, SAVE: tl.constexpr, G: tl.constexpr, SOFTWARE_: tl.constexpr
):  # fmt: skip
    """Group ``i_n`` of a's rows (G intermediate columns) from two groups of h, and what they keep."""
    b_lo = _glu_group(
        h_desc, k_desc, ks_ptr, at_desc, ats_ptr, o_m, i_m, 2 * i_n, Mp, N,
        gate_multiplier, down_multiplier, SAVE, G, SOFTWARE_,
    )  # fmt: skip
    b_hi = _glu_group(
        h_desc, k_desc, ks_ptr, at_desc, ats_ptr, o_m, i_m, 2 * i_n + 1, Mp, N,
        gate_multiplier, down_multiplier, SAVE, G, SOFTWARE_,
    )  # fmt: skip
    _store_halves(b_lo, b_hi, a_desc, as_ptr, o_m, i_n, Mp, G, SOFTWARE_)


@triton.jit
def _gradient_group(
    da_desc, k_desc, ks_ptr, g_desc, gs_ptr, gt_desc, gts_ptr, at_desc, ats_ptr, i_m, i_g, Mp, N,
    gate_multiplier, down_multiplier,
    SAVE: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, CHUNK_: tl.constexpr, SOFTWARE_: tl.constexpr,
):  # fmt: skip
    """Group ``i_g`` of the packed gradient (G / 2 intermediate columns) of row block ``i_m``: its
    rows, its transpose's rows and a's transpose stored, each where asked."""
    o_m, o_n = i_m * BM, i_g * (G // 2)
    inside = o_n < N  # else a padding group: dA and the kept tensor read as zeros
    b_da = da_desc.load([o_m, o_n]).to(tl.float32) * down_multiplier
    row_scale = tl.load(ks_ptr + i_g.to(tl.int64) * Mp + o_m + tl.arange(0, BM), mask=inside, other=1.0)
    b_first = _from_e4m3(k_desc.load([o_m, i_g * G]), SOFTWARE_) * row_scale[:, None]
    b_second = _from_e4m3(k_desc.load([o_m, i_g * G + G // 2]), SOFTWARE_) * row_scale[:, None]
    if SAVE == 1:
        b_du, b_dg = b_da * b_first, b_da * b_second
    else:
        b_silu, b_slope = silu_and_slope(b_second * gate_multiplier)
        b_du, b_dg = b_da * b_silu, b_da * b_first * b_slope * gate_multiplier
        if at_desc is not None:  # noqa: SIM102 - a compile-time branch around a run-time one
            if inside:
                _store_a_t(
                    b_silu * b_first * down_multiplier, at_desc, ats_ptr, o_m, i_m, o_n, N, G, SOFTWARE_
                )
    if g_desc is not None:
        _store_halves(b_du, b_dg, g_desc, gs_ptr, o_m, i_g, Mp, G, SOFTWARE_)
    if gt_desc is not None:  # noqa: SIM102
        if inside:  # dU's and dG's rows of the transpose in the weight's packing: alternate chunks
            o_c = o_n + tl.arange(0, G // 2)
            packed = (o_c // CHUNK_) * (2 * CHUNK_) + o_c % CHUNK_
            s_row = gts_ptr + i_m.to(tl.int64) * (2 * N)
            pair = i_g * (G // (2 * CHUNK_))
            _store_transposed(b_du, gt_desc, [pair, 0, o_m], s_row, packed, o_c < N, SOFTWARE_)
            _store_transposed(b_dg, gt_desc, [pair, CHUNK_, o_m], s_row, packed + CHUNK_, o_c < N, SOFTWARE_)


@triton.jit
def _glu_backward_kernel(  # N: the intermediate size
    da_desc,  # [Mp, N] dA = dY @ W_down (before the down multiplier), tiles [BM, G / 2]
    k_desc,  # [Mp, halves_width(N)] e4m3 in halves, kept by the forward, tiles [BM, G / 2]
    ks_ptr,  # [halves_width(N) / G, Mp]
    g_desc,  # [Mp, Wp] e4m3 [dU | dG] in halves, zeros up to dX's reduction width Wp; or None
    gs_ptr,  # [Wp / G, Mp]
    gt_desc,  # [2N, Mp] e4m3 in the weight's packing, in chunk pairs (_chunk_pairs); or None
    gts_ptr,  # [Mp / G, 2N]
    at_desc,  # [N, Mp] e4m3, tiles [G / 2, BM]: a's transpose from the kept pre-activations; or None
    ats_ptr,  # [Mp / G, N]
    Mp,
    N,
    n_groups,
    gate_multiplier,
    down_multiplier,
    SAVE: tl.constexpr,
    BM: tl.constexpr,
    G: tl.constexpr,
    GROUPS_: tl.constexpr,  # groups of the packed gradient a program makes, one after another
    STAGES_: tl.constexpr,  # loads in flight ahead of the group being made
    CHUNK_: tl.constexpr,
    SOFTWARE_: tl.constexpr,
):
    # A program makes GROUPS_ of the packed gradient's groups of one row block (n_groups in all).
    i_m, i_p = tl.program_id(0), tl.program_id(1)
    if GROUPS_ == 1:  # no loop: a loop's counter costs registers the pass spills without
        _gradient_group(
            da_desc, k_desc, ks_ptr, g_desc, gs_ptr, gt_desc, gts_ptr, at_desc, ats_ptr, i_m, i_p, Mp, N,
            gate_multiplier, down_multiplier, SAVE, BM, G, CHUNK_, SOFTWARE_,
        )  # fmt: skip
    else:
        first = i_p * GROUPS_
        for i in tl.range(first, tl.minimum(first + GROUPS_, n_groups), num_stages=STAGES_):
            i_g = tl.cast(i, tl.int32)  # the interpreter's loop counts in Python ints
            _gradient_group(
                da_desc, k_desc, ks_ptr, g_desc, gs_ptr, gt_desc, gts_ptr, at_desc, ats_ptr, i_m, i_g, Mp,
                N, gate_multiplier, down_multiplier, SAVE, BM, G, CHUNK_, SOFTWARE_,
            )  # fmt: skip


@triton.jit
def _dequantize_kernel(
    q_desc,  # [Mp, W] e4m3 rows, tiles [BM, G]
    s_ptr,  # [W / G, Mp]
    out_desc,  # [M, C] with M <= Mp and C <= W, tiles [BM, G]: writes past its edge are dropped
    Mp,
    BM: tl.constexpr,
    G: tl.constexpr,
    SOFTWARE_: tl.constexpr,
):
    i_m, i_g = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM
    scale = tl.load(s_ptr + i_g.to(tl.int64) * Mp + o_m + tl.arange(0, BM))
    b = _from_e4m3(q_desc.load([o_m, i_g * G]), SOFTWARE_) * scale[:, None]
    out_desc.store([o_m, i_g * G], b.to(out_desc.dtype))


_launch_quantize_activation = KernelLauncher(_quantize_activation_kernel, descriptor)
_launch_quantize_weight = KernelLauncher(_quantize_weight_kernel, descriptor)
_launch_glu_forward = KernelLauncher(_glu_forward_kernel, descriptor)
_launch_glu_backward = KernelLauncher(_glu_backward_kernel, descriptor)
_launch_dequantize = KernelLauncher(_dequantize_kernel, descriptor)


def _stored(t: torch.Tensor) -> torch.Tensor:
    """What a kernel writes through: e4m3, or its bytes under the interpreter."""
    return t.view(torch.uint8) if SOFTWARE else t


def _tma(t: torch.Tensor | None, block: tuple[int, int]) -> Tma | None:
    return None if t is None else Tma(_stored(t) if t.dtype == E4M3 else t, block)


def _chunk_pairs(t: torch.Tensor) -> Tma:
    """A tensor [2I, C] in the weight's packing (layout.py) as [I / CHUNK, 2 * CHUNK, C], each row of
    chunks an up chunk then a gate chunk, with tiles of one half of a group in halves: every other
    chunk, [HALF / CHUNK, CHUNK, GROUP]."""
    rows, cols = t.shape
    return Tma(t.view(rows // (2 * CHUNK), 2 * CHUNK, cols), (HALF // CHUNK, CHUNK, GROUP))


def quantize_activation(
    x: torch.Tensor, rows: int, transposed: bool, width: int, warps: int | None = None
) -> tuple[Fp8, Fp8 | None]:
    """x [M, F] as rows [rows, width] (``rows`` >= M, ``width`` >= F: zeros past x), and with
    ``transposed`` its transpose as rows [F, rows]."""
    m, f = x.shape
    x = tma_ready(x)
    q, s = empty((rows, width), x, E4M3), empty((cdiv(width, GROUP), rows), x, torch.float32)
    qt = st = None
    if transposed:
        qt, st = empty((f, rows), x, E4M3), empty((rows // GROUP, f), x, torch.float32)
    _launch_quantize_activation(
        (rows // GROUP, cdiv(width, GROUP)),
        _tma(x, (GROUP, GROUP)),
        _tma(q, (GROUP, GROUP)),
        s,
        _tma(qt, (GROUP, GROUP)),
        st,
        f,
        rows,
        BM=GROUP,
        G=GROUP,
        SOFTWARE_=SOFTWARE,
        num_warps=warps or FP8_PASS_WARPS,
    )
    return Fp8(q, s), (Fp8(qt, st) if transposed else None)


def quantize_weight(w: torch.Tensor, transposed: bool, halves: bool = False, warps: int | None = None) -> Fp8:
    """w [R, C] in 128 x 128 blocks, as it is ([R, Cp]) or transposed ([C, Rp]), the reduction
    dimension padded with zeros to ``reduction_width`` (format.py); with ``halves``, w is the packed
    gate/up weight [2I, C] and its rows come in halves ([halves_width(I), Cp], or columns so
    transposed)."""
    r, c = w.shape
    w = tma_ready(w)
    rows = halves_width(r // 2) if halves else r  # the rows' extent in the output's order
    rp, cp = (reduction_width(rows), c) if transposed else (rows, reduction_width(c))
    shape = (c, rp) if transposed else (rows, cp)
    q = empty(shape, w, E4M3)
    s = empty((cdiv(shape[0], GROUP), shape[1] // GROUP), w, torch.float32)
    source = _chunk_pairs(w) if halves else _tma(w, (HALF, GROUP))
    _launch_quantize_weight(
        (cdiv(rp, GROUP), cdiv(cp, GROUP)),
        source,
        _tma(q, (GROUP, HALF) if transposed else (HALF, GROUP)),
        s,
        TRANSPOSED=transposed,
        HALVES=halves,
        G=GROUP,
        CHUNK_=CHUNK,
        SOFTWARE_=SOFTWARE,
        num_warps=warps or FP8_PASS_WARPS,
    )
    return Fp8(q, s, blocks=True)


def glu_forward(
    h: torch.Tensor,
    inter: int,
    save: int,
    gate_multiplier: float,
    down_multiplier: float,
    warps: int | None = None,
    groups: int | None = None,
    stages: int | None = None,
):
    """From the pre-activation h [Mp, halves_width(inter)] in halves: ``a`` as rows [Mp,
    reduction_width(inter)], and for training the kept tensor (rows, in halves; ``save`` 1: factors,
    2: pre-activations) and with the factors ``a``'s transpose (rows); ``save`` 0 (inference): ``a``
    only."""
    mp = h.shape[0]
    width = reduction_width(inter)
    a = Fp8(empty((mp, width), h, E4M3), empty((width // GROUP, mp), h, torch.float32))
    at = kept = Fp8(None, None)
    if save == 1:
        at = _a_t(inter, mp, h)
    if save:
        kept = Fp8(empty(h.shape, h, E4M3), empty((h.shape[1] // GROUP, mp), h, torch.float32))
    pipeline = fp8_forward_pass(save)
    warps, groups, stages = warps or pipeline.warps, groups or pipeline.groups, stages or pipeline.stages
    _launch_glu_forward(
        (mp // GROUP, cdiv(width // GROUP, groups)),
        _tma(h, (GROUP, HALF)),
        _tma(a.data, (GROUP, HALF)),
        a.scales,
        _tma(at.data, (HALF, GROUP)),
        at.scales,
        _tma(kept.data, (GROUP, HALF)),
        kept.scales,
        mp,
        inter,
        float(gate_multiplier),
        float(down_multiplier),
        SAVE=save,
        BM=GROUP,
        G=GROUP,
        GROUPS_=groups,
        STAGES_=stages,
        SOFTWARE_=SOFTWARE,
        num_warps=warps,
    )
    return a, (at if save == 1 else None), (kept if save else None)


def _a_t(inter: int, mp: int, like: torch.Tensor) -> Fp8:
    return Fp8(empty((inter, mp), like, E4M3), empty((mp // GROUP, inter), like, torch.float32))


def glu_backward(
    da: torch.Tensor,
    kept: Fp8,
    save: int,
    gate_multiplier: float,
    down_multiplier: float,
    rows: bool,
    transposed: bool,
    a_t: bool = False,
    warps: int | None = None,
    groups: int | None = None,
    stages: int | None = None,
) -> tuple[Fp8 | None, Fp8 | None, Fp8 | None]:
    """The packed gradient [dU | dG] from dA [Mp, I] and the forward's kept tensor: as rows in
    halves [Mp, reduction_width(halves_width(I))] (for dX) and its transpose as rows [2I, Mp] in
    the weight's packing (for dW_gate_up), and ``a``'s transpose as rows [I, Mp] (for dW_down) from
    kept pre-activations, each where asked."""
    if a_t and save != 2:
        raise ValueError("a's transpose comes from the backward only where the pre-activations were kept")
    mp, inter = da.shape
    packed = halves_width(inter)
    width = reduction_width(packed)
    grad = grad_t = at = Fp8(None, None)
    if a_t:
        at = _a_t(inter, mp, da)
    if rows:
        grad = Fp8(empty((mp, width), da, E4M3), empty((width // GROUP, mp), da, torch.float32))
    if transposed:
        grad_t = Fp8(empty((2 * inter, mp), da, E4M3), empty((mp // GROUP, 2 * inter), da, torch.float32))
    n_groups = (width if rows else packed) // GROUP
    pipeline = fp8_gradient_pass(save)
    warps, groups, stages = warps or pipeline.warps, groups or pipeline.groups, stages or pipeline.stages
    _launch_glu_backward(
        (mp // GROUP, cdiv(n_groups, groups)),
        _tma(tma_ready(da), (GROUP, HALF)),
        _tma(kept.data, (GROUP, HALF)),
        kept.scales,
        _tma(grad.data, (GROUP, HALF)),
        grad.scales,
        None if grad_t.data is None else _chunk_pairs(_stored(grad_t.data)),
        grad_t.scales,
        _tma(at.data, (HALF, GROUP)),
        at.scales,
        mp,
        inter,
        n_groups,
        float(gate_multiplier),
        float(down_multiplier),
        SAVE=save,
        BM=GROUP,
        G=GROUP,
        GROUPS_=groups,
        STAGES_=stages,
        CHUNK_=CHUNK,
        SOFTWARE_=SOFTWARE,
        num_warps=warps,
    )
    return (grad if rows else None), (grad_t if transposed else None), (at if a_t else None)


def dequantize(
    t: Fp8, rows: int, cols: int, out_dtype: torch.dtype, warps: int | None = None
) -> torch.Tensor:
    """The values of rows ``t`` [Mp, W] (format.dequantize) in ``out_dtype``, its first ``rows`` rows
    and ``cols`` columns, in one pass: for the 16-bit operands that LoRA's terms take from ``a`` and
    the packed gradient."""
    mp, width = t.data.shape
    if rows > mp or cols > width or t.blocks:
        raise ValueError(f"dequantize takes rows [{mp}, {width}] to at most that size, got [{rows}, {cols}]")
    # The interpreter rounds fp32 to bf16 toward zero: there the pass writes fp32, rounded after.
    rounds_after = SOFTWARE and out_dtype == torch.bfloat16
    out = empty((rows, cols), t.scales, torch.float32 if rounds_after else out_dtype)
    _launch_dequantize(
        (mp // GROUP, cdiv(cols, GROUP)),
        _tma(t.data, (GROUP, GROUP)),
        t.scales,
        _tma(out, (GROUP, GROUP)),
        mp,
        BM=GROUP,
        G=GROUP,
        SOFTWARE_=SOFTWARE,
        num_warps=warps or FP8_PASS_WARPS,
    )
    return out.to(out_dtype)
