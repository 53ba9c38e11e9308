"""The FP8 path's passes between its GEMMs, each one read and one write per element (format.py
defines what they write; it is their reference):

* ``quantize_activation``: x or dY [M, F] -> rows [Mp, F] for the GEMM that reduces over F and,
  from the same tile, rows of the transpose [F, Mp] for the weight gradient that reduces over tokens;
* ``quantize_weight``: a weight [R, C] -> 128 x 128 blocks, as it is or transposed;
* ``glu_forward``: the gate/up GEMM's output [Mp, 2I] (packed) -> ``a`` as rows for the down GEMM
  and what training keeps (factors or pre-activations, packed, as rows), with the factors also
  ``a``'s transpose as rows for dW_down, all in FP8;
* ``glu_backward``: dA [Mp, I] and the kept tensor -> the packed gradient [dU | dG] as rows for dX
  and its transpose as rows for dW_gate_up, and from kept pre-activations ``a``'s transpose (the
  forward did not keep it: I bytes a token less, for a pass that reads the same bytes).

A tile is 128 rows (one group of tokens) by one group of columns, so each tile finds its own
scales. Tiles move through TMA descriptors: no pointer per element in registers (a [128, 128] tile
stored through pointers spilled on sm_90), reads past a tensor's edge are zeros (the padding rows
and columns) and writes past it are dropped. Under Triton's interpreter (CPU tests), which rounds
to e4m3 wrongly (triton 3.6: ties away from even, 127 to 64, NaN to 384) and reads NaN codes as
480, the kernels encode and decode e4m3 in integer arithmetic and store bytes (``SOFTWARE``), to
the same result as the GPU's conversion (round to nearest even).
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
    pack_columns,
    silu_and_slope,
    tma_ready,
    unpack_columns,
)
from ..kernels.configs import FP8_FORWARD_PASS_WARPS, FP8_PASS_WARPS
from ..kernels.launch import KernelLauncher, Tma
from .format import E4M3, GROUP, MIN_AMAX, Fp8, reduction_width

#: Interpreter: encode and decode e4m3 in integer arithmetic (see the module docstring).
SOFTWARE = interpreting()
MIN_AMAX_ = tl.constexpr(MIN_AMAX)


@triton.jit
def _group_scale(amax):
    """(scale, 1 / scale) of a group, as format.group_scale makes them: amax / 448 and 448 / amax,
    each rounded to nearest (``div_rn``, not the GPU's approximate division), amax at least
    ``MIN_AMAX``; 1 and 1 for a group of zeros, inf and 0 for inf."""
    clamped = tl.maximum(amax, MIN_AMAX_)
    scale = tl.div_rn(clamped, 448.0)
    inverse = tl.div_rn(tl.full(clamped.shape, 448.0, tl.float32), clamped)
    return tl.where(amax == 0.0, 1.0, scale), tl.where(amax == 0.0, 1.0, inverse)


@triton.jit
def _amax(b, axis: tl.constexpr):
    """The largest magnitude along ``axis``, NaN left out (it stays NaN in the data)."""
    return tl.max(tl.where(b != b, 0.0, tl.abs(b)), axis=axis)


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
    """fp32 ``v`` (|v| <= 448 or NaN) as stored: e4m3, or its code under the interpreter."""
    v = tl.where(v > 448.0, 448.0, tl.where(v < -448.0, -448.0, v))  # comparisons keep NaN
    if SOFTWARE_:
        return _e4m3_bits(v)
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
    scale, inverse = _group_scale(_amax(b, 1))
    return _e4m3(b * inverse[:, None], SOFTWARE_), scale


@triton.jit
def _quantized_columns(b, SOFTWARE_: tl.constexpr):
    """``b`` [BM, W] quantized down its columns, transposed: [W, BM] e4m3, one scale per column."""
    scale, inverse = _group_scale(_amax(b, 0))
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
    w_desc,  # [R, C], tiles [G, G]
    q_desc,  # [R, Cp], or [C, Rp] transposed: the reduction dimension padded with zeros
    s_ptr,  # [R / G, Cp / G], or [C / G, Rp / G] transposed
    TRANSPOSED: tl.constexpr,
    G: tl.constexpr,
    SOFTWARE_: tl.constexpr,
):
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    b_w = w_desc.load([i_r * G, i_c * G]).to(tl.float32)
    scale, inverse = _group_scale(tl.max(_amax(b_w, 1), 0))
    q = _e4m3(b_w * inverse, SOFTWARE_)
    if TRANSPOSED:
        q_desc.store([i_c * G, i_r * G], tl.trans(q))
        tl.store(s_ptr + i_c * tl.num_programs(0) + i_r, scale)
    else:
        q_desc.store([i_r * G, i_c * G], q)
        tl.store(s_ptr + i_r * tl.num_programs(1) + i_c, scale)


@triton.jit
def _glu_half(
    h_desc, k_desc, ks_ptr, at_desc, ats_ptr, o_m, i_m, i_p, Mp, N, gate_multiplier, down_multiplier,
    SAVE: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, CHUNK_: tl.constexpr, SOFTWARE_: tl.constexpr
):  # fmt: skip
    """One group of G packed columns (``i_p``: G / 2 intermediate columns) of the forward pass: the
    kept tensor's group and ``a``'s transposed columns stored; ``down_multiplier * a`` [BM, G / 2]
    returned for ``a``'s rows."""
    b_h = h_desc.load([o_m, i_p * G]).to(tl.float32)
    if k_desc is not None and SAVE == 2:  # noqa: SIM102 - a compile-time branch around a run-time one
        if i_p * G < 2 * N:  # the pre-activations as packed, before the SwiGLU takes registers
            _store_rows(b_h, k_desc, ks_ptr, o_m, i_p, Mp, G, SOFTWARE_)
    b_up, b_gate = unpack_columns(b_h, BM, G, CHUNK_)
    b_silu, b_slope = silu_and_slope(b_gate * gate_multiplier)
    b_a = b_silu * b_up * down_multiplier
    if k_desc is not None:  # noqa: SIM102
        if i_p * G < 2 * N:  # not a padding group
            if SAVE == 1:
                b_kept = pack_columns(b_silu, b_up * b_slope * gate_multiplier, BM, G, CHUNK_)
                _store_rows(b_kept, k_desc, ks_ptr, o_m, i_p, Mp, G, SOFTWARE_)
            if at_desc is not None:
                _store_a_t(b_a, at_desc, ats_ptr, o_m, i_m, i_p, N, G, SOFTWARE_)
    return b_a


@triton.jit
def _store_rows(b, desc, s_ptr, o_m, i_c, Mp, G: tl.constexpr, SOFTWARE_: tl.constexpr):
    """``b`` [BM, G] (column group ``i_c``) stored as rows: e4m3 and one scale per row."""
    q, scale = _quantized_rows(b, SOFTWARE_)
    desc.store([o_m, i_c * G], q)
    tl.store(s_ptr + i_c.to(tl.int64) * Mp + o_m + tl.arange(0, b.shape[0]), scale)


@triton.jit
def _store_a_t(b_a, at_desc, ats_ptr, o_m, i_m, i_p, N, G: tl.constexpr, SOFTWARE_: tl.constexpr):
    """``a`` [BM, G / 2] (packed group ``i_p``'s intermediate columns) stored transposed, as rows."""
    q_t, scale_t = _quantized_columns(b_a, SOFTWARE_)
    at_desc.store([i_p * (G // 2), o_m], q_t)
    o_n = i_p * (G // 2) + tl.arange(0, G // 2)
    tl.store(ats_ptr + i_m.to(tl.int64) * N + o_n, scale_t, mask=o_n < N)


@triton.jit
def _glu_forward_kernel(  # N: the intermediate size
    h_desc,  # [Mp, 2N] packed [u | g] chunks, the gate/up GEMM's output; tiles [BM, G]
    a_desc,  # [Mp, Np] e4m3: N padded with zeros to the down GEMM's reduction width; tiles [BM, G]
    as_ptr,  # [Np / G, Mp]
    at_desc,  # [N, Mp] e4m3, tiles [G / 2, BM]; or None (inference, pre-activations kept)
    ats_ptr,  # [Mp / G, N]
    k_desc,  # [Mp, 2N] e4m3 packed: factors or pre-activations, tiles [BM, G]; or None
    ks_ptr,  # [2N / G, Mp]
    Mp,
    N,
    gate_multiplier,
    down_multiplier,
    SAVE: tl.constexpr,  # 1: factors [silu(g) | gate_multiplier * u * silu'(g)]; 2: [u | unscaled g]
    BM: tl.constexpr,
    G: tl.constexpr,
    CHUNK_: tl.constexpr,
    SOFTWARE_: tl.constexpr,
):
    # A tile is G intermediate columns (one group of a's rows), done in two halves of G packed
    # columns (one group of the kept tensor's rows each): half the registers of the whole tile.
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM
    b_lo = _glu_half(
        h_desc, k_desc, ks_ptr, at_desc, ats_ptr, o_m, i_m, 2 * i_n, Mp, N, gate_multiplier, down_multiplier,
        SAVE, BM, G, CHUNK_, SOFTWARE_,
    )  # fmt: skip
    b_hi = _glu_half(
        h_desc, k_desc, ks_ptr, at_desc, ats_ptr, o_m, i_m, 2 * i_n + 1, Mp, N, gate_multiplier,
        down_multiplier, SAVE, BM, G, CHUNK_, SOFTWARE_,
    )  # fmt: skip
    b_a = tl.reshape(tl.permute(tl.join(b_lo, b_hi), (0, 2, 1)), (BM, G))  # [lo | hi]
    _store_rows(b_a, a_desc, as_ptr, o_m, i_n, Mp, G, SOFTWARE_)


@triton.jit
def _glu_backward_kernel(  # N: the intermediate size
    da_desc,  # [Mp, N] dA = dY @ W_down (before the down multiplier), tiles [BM, G / 2]
    k_desc,  # [Mp, 2N] e4m3 packed, kept by the forward, tiles [BM, G]
    ks_ptr,  # [2N / G, Mp]
    g_desc,  # [Mp, 2Np] e4m3 packed [dU | dG], 2N padded with zeros to dX's reduction width; or None
    gs_ptr,  # [2Np / G, Mp]
    gt_desc,  # [2N, Mp] e4m3, tiles [G, BM]; or None
    gts_ptr,  # [Mp / G, 2N]
    at_desc,  # [N, Mp] e4m3, tiles [G / 2, BM]: a's transpose from the kept pre-activations; or None
    ats_ptr,  # [Mp / G, N]
    Mp,
    N,
    gate_multiplier,
    down_multiplier,
    SAVE: tl.constexpr,
    BM: tl.constexpr,
    G: tl.constexpr,
    CHUNK_: tl.constexpr,
    SOFTWARE_: tl.constexpr,
):
    i_m, i_p = tl.program_id(0), tl.program_id(1)  # i_p: a group of G packed columns
    o_m, o_p = i_m * BM, i_p * G
    b_da = da_desc.load([o_m, i_p * (G // 2)]).to(tl.float32) * down_multiplier
    b_k = _from_e4m3(k_desc.load([o_m, o_p]), SOFTWARE_)
    inside = o_p < 2 * N  # else a padding group: dA and the kept tensor read as zeros
    b_k = (
        b_k
        * tl.load(ks_ptr + i_p.to(tl.int64) * Mp + o_m + tl.arange(0, BM), mask=inside, other=1.0)[:, None]
    )
    b_first, b_second = unpack_columns(b_k, BM, G, CHUNK_)
    if SAVE == 1:
        b_du, b_dg = b_da * b_first, b_da * b_second
    else:
        b_silu, b_slope = silu_and_slope(b_second * gate_multiplier)
        b_du, b_dg = b_da * b_silu, b_da * b_first * b_slope * gate_multiplier
        if at_desc is not None:  # noqa: SIM102 - a compile-time branch around a run-time one
            if inside:
                _store_a_t(
                    b_silu * b_first * down_multiplier, at_desc, ats_ptr, o_m, i_m, i_p, N, G, SOFTWARE_
                )
    b_grad = pack_columns(b_du, b_dg, BM, G, CHUNK_)
    if g_desc is not None:
        _store_rows(b_grad, g_desc, gs_ptr, o_m, i_p, Mp, G, SOFTWARE_)
    if gt_desc is not None:  # noqa: SIM102 - a compile-time branch around a run-time one
        if inside:
            q_t, scale_t = _quantized_columns(b_grad, SOFTWARE_)
            gt_desc.store([o_p, o_m], q_t)
            tl.store(gts_ptr + i_m.to(tl.int64) * (2 * N) + o_p + tl.arange(0, G), scale_t)


_launch_quantize_activation = KernelLauncher(_quantize_activation_kernel, descriptor)
_launch_quantize_weight = KernelLauncher(_quantize_weight_kernel, descriptor)
_launch_glu_forward = KernelLauncher(_glu_forward_kernel, descriptor)
_launch_glu_backward = KernelLauncher(_glu_backward_kernel, descriptor)


def _stored(t: torch.Tensor) -> torch.Tensor:
    """What a kernel writes through: e4m3, or its bytes under the interpreter."""
    return t.view(torch.uint8) if SOFTWARE else t


def _tma(t: torch.Tensor | None, block: tuple[int, int]) -> Tma | None:
    return None if t is None else Tma(_stored(t) if t.dtype == E4M3 else t, block)


def quantize_activation(x: torch.Tensor, rows: int, transposed: bool, width: int) -> tuple[Fp8, Fp8 | None]:
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
        num_warps=FP8_PASS_WARPS,
    )
    return Fp8(q, s), (Fp8(qt, st) if transposed else None)


def quantize_weight(w: torch.Tensor, transposed: bool) -> Fp8:
    """w [R, C] in 128 x 128 blocks, as it is ([R, Cp]) or transposed ([C, Rp]), the reduction
    dimension padded with zeros to ``reduction_width`` (format.py)."""
    r, c = w.shape
    w = tma_ready(w)
    rp, cp = (reduction_width(r), c) if transposed else (r, reduction_width(c))
    shape = (c, rp) if transposed else (r, cp)
    q = empty(shape, w, E4M3)
    s = empty((cdiv(shape[0], GROUP), shape[1] // GROUP), w, torch.float32)
    _launch_quantize_weight(
        (cdiv(rp, GROUP), cdiv(cp, GROUP)),
        _tma(w, (GROUP, GROUP)),
        _tma(q, (GROUP, GROUP)),
        s,
        TRANSPOSED=transposed,
        G=GROUP,
        SOFTWARE_=SOFTWARE,
        num_warps=FP8_PASS_WARPS,
    )
    return Fp8(q, s, blocks=True)


def glu_forward(h: torch.Tensor, save: int, gate_multiplier: float, down_multiplier: float):
    """From the packed pre-activation h [Mp, 2I]: ``a`` as rows [Mp, reduction_width(I)], and for
    training the kept tensor (rows, packed; ``save`` 1: factors, 2: pre-activations) and with the
    factors ``a``'s transpose (rows); ``save`` 0 (inference): ``a`` only."""
    mp, two_inter = h.shape
    inter = two_inter // 2
    width = reduction_width(inter)
    a = Fp8(empty((mp, width), h, E4M3), empty((width // GROUP, mp), h, torch.float32))
    at = kept = Fp8(None, None)
    if save == 1:
        at = _a_t(inter, mp, h)
    if save:
        kept = Fp8(empty((mp, two_inter), h, E4M3), empty((two_inter // GROUP, mp), h, torch.float32))
    _launch_glu_forward(
        (mp // GROUP, width // GROUP),
        _tma(h, (GROUP, GROUP)),
        _tma(a.data, (GROUP, GROUP)),
        a.scales,
        _tma(at.data, (GROUP // 2, GROUP)),
        at.scales,
        _tma(kept.data, (GROUP, GROUP)),
        kept.scales,
        mp,
        inter,
        float(gate_multiplier),
        float(down_multiplier),
        SAVE=save,
        BM=GROUP,
        G=GROUP,
        CHUNK_=CHUNK,
        SOFTWARE_=SOFTWARE,
        num_warps=FP8_FORWARD_PASS_WARPS,
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
) -> tuple[Fp8 | None, Fp8 | None, Fp8 | None]:
    """The packed gradient [dU | dG] from dA [Mp, I] and the forward's kept tensor: as rows
    [Mp, reduction_width(2I)] (for dX) and its transpose as rows [2I, Mp] (for dW_gate_up), and
    ``a``'s transpose as rows [I, Mp] (for dW_down) from kept pre-activations, each where asked."""
    if a_t and save != 2:
        raise ValueError("a's transpose comes from the backward only where the pre-activations were kept")
    mp, inter = da.shape
    width = reduction_width(2 * inter)
    grad = grad_t = at = Fp8(None, None)
    if a_t:
        at = _a_t(inter, mp, da)
    if rows:
        grad = Fp8(empty((mp, width), da, E4M3), empty((width // GROUP, mp), da, torch.float32))
    if transposed:
        grad_t = Fp8(empty((2 * inter, mp), da, E4M3), empty((mp // GROUP, 2 * inter), da, torch.float32))
    _launch_glu_backward(
        (mp // GROUP, (width if rows else 2 * inter) // GROUP),
        _tma(tma_ready(da), (GROUP, GROUP // 2)),
        _tma(kept.data, (GROUP, GROUP)),
        kept.scales,
        _tma(grad.data, (GROUP, GROUP)),
        grad.scales,
        _tma(grad_t.data, (GROUP, GROUP)),
        grad_t.scales,
        _tma(at.data, (GROUP // 2, GROUP)),
        at.scales,
        mp,
        inter,
        float(gate_multiplier),
        float(down_multiplier),
        SAVE=save,
        BM=GROUP,
        G=GROUP,
        CHUNK_=CHUNK,
        SOFTWARE_=SOFTWARE,
        num_warps=FP8_PASS_WARPS,
    )
    return (grad if rows else None), (grad_t if transposed else None), (at if a_t else None)
