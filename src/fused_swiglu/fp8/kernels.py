"""The FP8 path's passes between its GEMMs, each one read and one write per element (format.py
defines what they write; it is their reference):

* ``quantize_activation``: x or dY [M, F] -> rows [Mp, F] for the GEMM that reduces over F and,
  from the same tile, rows of the transpose [F, Mp] for the weight gradient that reduces over tokens;
* ``quantize_weight``: a weight [R, C] -> 128 x 128 blocks, as it is or transposed;
* ``glu_forward``: the gate/up GEMM's output [Mp, 2I] (packed) -> ``a`` as rows for the down GEMM,
  ``a``'s transpose as rows for dW_down, and what training keeps (factors or pre-activations,
  packed, as rows), all in FP8;
* ``glu_backward``: dA [Mp, I] and the kept tensor -> the packed gradient [dU | dG] as rows for dX
  and its transpose as rows for dW_gate_up.

A tile is 128 rows (one group of tokens) by one group of columns, so each tile finds its own
scales. Under Triton's interpreter (CPU tests), which rounds to e4m3 wrongly (triton 3.6: ties
away from even, 127 to 64, NaN to 384) and reads NaN codes as 480, the kernels encode and decode
e4m3 in integer arithmetic and store bytes (``SOFTWARE``), to the same result as the GPU's
conversion (round to nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.common import (
    CHUNK,
    cdiv,
    empty,
    interpreting,
    pack_columns,
    silu_and_slope,
    unpack_columns,
)
from ..kernels.launch import KernelLauncher
from .format import E4M3, GROUP, Fp8, reduction_width

#: Interpreter: encode and decode e4m3 in integer arithmetic (see the module docstring).
SOFTWARE = interpreting()


@triton.jit
def _pow2_scale(amax):
    """(scale, 1 / scale): the smallest power of two with amax / scale <= 448, from amax's bits
    (448 = 1.75 x 2^8: the exponent less 8, plus one where the mantissa passes 1.75); at least
    2^-126, 1 for a group of zeros, inf for inf. Exact: no division."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exponent = tl.where(exponent < 1, 1, exponent)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(amax == 0.0, 1.0, tl.where(amax == float("inf"), float("inf"), scale))
    inverse = tl.where(amax == 0.0, 1.0, tl.where(amax == float("inf"), 0.0, inverse))
    return scale, inverse


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
def _store_rows(q_ptr, s_ptr, b, o_m, o_c, i_g, stride_q, stride_s, cols, SOFTWARE_: tl.constexpr):
    """``b`` [BM, G] (one group of columns per row) quantized: data at rows ``o_m``, columns
    ``o_c`` of a [*, stride_q] tensor, scales at [i_g, o_m] of [*, stride_s]."""
    scale, inverse = _pow2_scale(_amax(b, 1))  # [BM]
    q = _e4m3(b * inverse[:, None], SOFTWARE_)
    mask = o_c[None, :] < cols
    tl.store(q_ptr + o_m[:, None] * stride_q + o_c[None, :], q, mask=mask)
    tl.store(s_ptr + i_g * stride_s + o_m, scale)


@triton.jit
def _store_columns(q_ptr, s_ptr, b, o_m, o_c, i_m, stride_q, stride_s, cols, SOFTWARE_: tl.constexpr):
    """``b`` [BM, W] quantized down its columns (one group of rows): the transpose's data at rows
    ``o_c``, columns ``o_m`` of a [cols, stride_q] tensor; scales at [i_m, o_c] of [*, stride_s]."""
    scale, inverse = _pow2_scale(_amax(b, 0))  # [W]
    q = _e4m3(b * inverse[None, :], SOFTWARE_)
    mask = o_c[None, :] < cols
    tl.store(q_ptr + o_c[None, :].to(tl.int64) * stride_q + o_m[:, None], q, mask=mask)
    tl.store(s_ptr + i_m * stride_s + o_c, scale, mask=o_c < cols)


@triton.jit
def _quantize_activation_kernel(
    x_ptr,  # [M, F]
    q_ptr,  # [Mp, Fp]: F padded with zeros to the GEMM's reduction width
    s_ptr,  # [Fp / G, Mp]
    qt_ptr,  # [F, Mp], or None
    st_ptr,  # [Mp / G, F], or None
    M,
    F,
    Fp,
    Mp,
    stride_x,
    BM: tl.constexpr,
    G: tl.constexpr,
    SOFTWARE_: tl.constexpr,
):
    i_m, i_f = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_f = i_f * G + tl.arange(0, G)
    mask = (o_m[:, None] < M) & (o_f[None, :] < F)
    b_x = tl.load(x_ptr + o_m[:, None] * stride_x + o_f[None, :], mask=mask, other=0.0).to(tl.float32)
    _store_rows(q_ptr, s_ptr, b_x, o_m, o_f, i_f, Fp, Mp, Fp, SOFTWARE_)
    if qt_ptr is not None:  # noqa: SIM102 - a compile-time branch around a run-time one
        if i_f * G < F:  # the transpose has no padding columns
            _store_columns(qt_ptr, st_ptr, b_x, o_m, o_f, i_m, Mp, F, F, SOFTWARE_)


@triton.jit
def _quantize_weight_kernel(
    w_ptr,  # [R, C]
    q_ptr,  # [R, Cp], or [C, Rp] transposed: the reduction dimension padded with zeros
    s_ptr,  # [R / G, Cp / G], or [C / G, Rp / G] transposed
    R,
    C,
    Rp,
    Cp,
    stride_w,
    TRANSPOSED: tl.constexpr,
    G: tl.constexpr,
    SOFTWARE_: tl.constexpr,
):
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    o_r = (i_r * G + tl.arange(0, G)).to(tl.int64)
    o_c = i_c * G + tl.arange(0, G)
    mask = (o_r[:, None] < R) & (o_c[None, :] < C)
    b_w = tl.load(w_ptr + o_r[:, None] * stride_w + o_c[None, :], mask=mask, other=0.0).to(tl.float32)
    scale, inverse = _pow2_scale(tl.max(_amax(b_w, 1), 0))
    q = _e4m3(b_w * inverse, SOFTWARE_)
    if TRANSPOSED:
        keep = (o_r[:, None] < Rp) & (o_c[None, :] < C)
        tl.store(q_ptr + o_c[None, :].to(tl.int64) * Rp + o_r[:, None], q, mask=keep)
        tl.store(s_ptr + i_c * (Rp // G) + i_r, scale)
    else:
        keep = (o_r[:, None] < R) & (o_c[None, :] < Cp)
        tl.store(q_ptr + o_r[:, None] * Cp + o_c[None, :], q, mask=keep)
        tl.store(s_ptr + i_r * (Cp // G) + i_c, scale)


@triton.jit
def _glu_half(
    h_ptr, k_ptr, ks_ptr, at_ptr, ats_ptr, o_m, i_m, i_p, Mp, N, gate_multiplier, down_multiplier,
    SAVE: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, CHUNK_: tl.constexpr, SOFTWARE_: tl.constexpr
):  # fmt: skip
    """One group of G packed columns (``i_p``: G / 2 intermediate columns) of the forward pass: the
    kept tensor's group and ``a``'s transposed columns stored; ``down_multiplier * a`` [BM, G / 2]
    returned for ``a``'s rows."""
    o_p = i_p * G + tl.arange(0, G)
    o_n = i_p * (G // 2) + tl.arange(0, G // 2)
    b_h = tl.load(h_ptr + o_m[:, None] * (2 * N) + o_p[None, :], mask=o_p[None, :] < 2 * N, other=0.0)
    b_up, b_gate = unpack_columns(b_h.to(tl.float32), BM, G, CHUNK_)
    b_silu, b_slope = silu_and_slope(b_gate * gate_multiplier)
    b_a = b_silu * b_up * down_multiplier
    if k_ptr is not None:  # noqa: SIM102 - a compile-time branch around a run-time one
        if i_p * G < 2 * N:  # not a padding group
            if SAVE == 1:
                b_kept = pack_columns(b_silu, b_up * b_slope * gate_multiplier, BM, G, CHUNK_)
            else:
                b_kept = pack_columns(b_up, b_gate, BM, G, CHUNK_)
            _store_rows(k_ptr, ks_ptr, b_kept, o_m, o_p, i_p, 2 * N, Mp, 2 * N, SOFTWARE_)
            _store_columns(at_ptr, ats_ptr, b_a, o_m, o_n, i_m, Mp, N, N, SOFTWARE_)
    return b_a


@triton.jit
def _glu_forward_kernel(  # N: the intermediate size
    h_ptr,  # [Mp, 2N] packed [u | g] chunks, the gate/up GEMM's output
    a_ptr,  # [Mp, Np] e4m3: N padded with zeros to the down GEMM's reduction width
    as_ptr,  # [Np / G, Mp]
    at_ptr,  # [N, Mp] e4m3, or None (inference)
    ats_ptr,  # [Mp / G, N]
    k_ptr,  # [Mp, 2N] e4m3 packed: factors or pre-activations, or None
    ks_ptr,  # [2N / G, Mp]
    Mp,
    N,
    Np,
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
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    meta = (Mp, N, gate_multiplier, down_multiplier, SAVE, BM, G, CHUNK_, SOFTWARE_)
    b_lo = _glu_half(h_ptr, k_ptr, ks_ptr, at_ptr, ats_ptr, o_m, i_m, 2 * i_n, *meta)
    b_hi = _glu_half(h_ptr, k_ptr, ks_ptr, at_ptr, ats_ptr, o_m, i_m, 2 * i_n + 1, *meta)
    b_a = tl.reshape(tl.permute(tl.join(b_lo, b_hi), (0, 2, 1)), (BM, G))  # [lo | hi]
    o_n = i_n * G + tl.arange(0, G)
    _store_rows(a_ptr, as_ptr, b_a, o_m, o_n, i_n, Np, Mp, Np, SOFTWARE_)


@triton.jit
def _glu_backward_kernel(  # N: the intermediate size
    da_ptr,  # [Mp, N] dA = dY @ W_down (before the down multiplier)
    k_ptr,  # [Mp, 2N] e4m3 packed, kept by the forward
    ks_ptr,  # [2N / G, Mp]
    g_ptr,  # [Mp, 2Np] e4m3 packed [dU | dG], 2N padded with zeros to dX's reduction width; or None
    gs_ptr,  # [2Np / G, Mp]
    gt_ptr,  # [2N, Mp] e4m3, or None
    gts_ptr,  # [Mp / G, 2N]
    Mp,
    N,
    Np2,
    gate_multiplier,
    down_multiplier,
    SAVE: tl.constexpr,
    BM: tl.constexpr,
    G: tl.constexpr,
    CHUNK_: tl.constexpr,
    SOFTWARE_: tl.constexpr,
):
    i_m, i_p = tl.program_id(0), tl.program_id(1)  # i_p: a group of G packed columns
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_n = i_p * (G // 2) + tl.arange(0, G // 2)  # its G / 2 intermediate columns
    o_p = i_p * G + tl.arange(0, G)
    inside = o_p[None, :] < 2 * N
    b_da = tl.load(da_ptr + o_m[:, None] * N + o_n[None, :], mask=o_n[None, :] < N, other=0.0)
    b_da = b_da.to(tl.float32) * down_multiplier
    b_k = _from_e4m3(tl.load(k_ptr + o_m[:, None] * (2 * N) + o_p[None, :], mask=inside, other=0), SOFTWARE_)
    b_k = b_k * tl.load(ks_ptr + i_p * Mp + o_m, mask=i_p * G < 2 * N, other=1.0)[:, None]
    b_first, b_second = unpack_columns(b_k, BM, G, CHUNK_)
    if SAVE == 1:
        b_du, b_dg = b_da * b_first, b_da * b_second
    else:
        b_silu, b_slope = silu_and_slope(b_second * gate_multiplier)
        b_du, b_dg = b_da * b_silu, b_da * b_first * b_slope * gate_multiplier
    b_grad = pack_columns(b_du, b_dg, BM, G, CHUNK_)
    if g_ptr is not None:
        _store_rows(g_ptr, gs_ptr, b_grad, o_m, o_p, i_p, Np2, Mp, Np2, SOFTWARE_)
    if gt_ptr is not None:  # noqa: SIM102 - a compile-time branch around a run-time one
        if i_p * G < 2 * N:  # not a padding group
            _store_columns(gt_ptr, gts_ptr, b_grad, o_m, o_p, i_m, Mp, 2 * N, 2 * N, SOFTWARE_)


_launch_quantize_activation = KernelLauncher(_quantize_activation_kernel)
_launch_quantize_weight = KernelLauncher(_quantize_weight_kernel)
_launch_glu_forward = KernelLauncher(_glu_forward_kernel)
_launch_glu_backward = KernelLauncher(_glu_backward_kernel)

#: Warps per program of the passes ([128, 128] tiles; the forward pass holds [128, 256]).
PASS_WARPS = 8


def _fp8_empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return empty(shape, like, E4M3)


def _stored(t: torch.Tensor | None) -> torch.Tensor | None:
    """What a kernel writes through: e4m3, or its bytes under the interpreter."""
    return t.view(torch.uint8) if SOFTWARE and t is not None else t


def quantize_activation(x: torch.Tensor, rows: int, transposed: bool, width: int) -> tuple[Fp8, Fp8 | None]:
    """x [M, F] as rows [rows, width] (``rows`` >= M, ``width`` >= F: zeros past x), and with
    ``transposed`` its transpose as rows [F, rows]."""
    m, f = x.shape
    q, s = empty((rows, width), x, E4M3), empty((cdiv(width, GROUP), rows), x, torch.float32)
    qt = st = None
    if transposed:
        qt, st = empty((f, rows), x, E4M3), empty((rows // GROUP, f), x, torch.float32)
    _launch_quantize_activation(
        (rows // GROUP, cdiv(width, GROUP)),
        x,
        _stored(q),
        s,
        _stored(qt),
        st,
        m,
        f,
        width,
        rows,
        x.stride(0),
        BM=GROUP,
        G=GROUP,
        SOFTWARE_=SOFTWARE,
        num_warps=PASS_WARPS,
    )
    return Fp8(q, s), (Fp8(qt, st) if transposed else None)


def quantize_weight(w: torch.Tensor, transposed: bool) -> Fp8:
    """w [R, C] in 128 x 128 blocks, as it is ([R, Cp]) or transposed ([C, Rp]), the reduction
    dimension padded with zeros to ``reduction_width`` (format.py)."""
    r, c = w.shape
    rp, cp = (reduction_width(r), c) if transposed else (r, reduction_width(c))
    shape = (c, rp) if transposed else (r, cp)
    q = empty(shape, w, E4M3)
    s = empty((cdiv(shape[0], GROUP), shape[1] // GROUP), w, torch.float32)
    _launch_quantize_weight(
        (cdiv(rp, GROUP), cdiv(cp, GROUP)),
        w,
        _stored(q),
        s,
        r,
        c,
        rp,
        cp,
        w.stride(0),
        TRANSPOSED=transposed,
        G=GROUP,
        SOFTWARE_=SOFTWARE,
        num_warps=PASS_WARPS,
    )
    return Fp8(q, s, blocks=True)


def glu_forward(h: torch.Tensor, save: int, gate_multiplier: float, down_multiplier: float):
    """From the packed pre-activation h [Mp, 2I]: ``a`` as rows [Mp, reduction_width(I)], and for
    training (``save`` 1: factors, 2: pre-activations) ``a``'s transpose (rows) and the kept tensor
    (rows, packed); ``save`` 0 (inference): ``a`` only."""
    mp, two_inter = h.shape
    inter = two_inter // 2
    width = reduction_width(inter)
    a = Fp8(empty((mp, width), h, E4M3), empty((width // GROUP, mp), h, torch.float32))
    at = kept = None
    if save:
        at = Fp8(empty((inter, mp), h, E4M3), empty((mp // GROUP, inter), h, torch.float32))
        kept = Fp8(empty((mp, two_inter), h, E4M3), empty((two_inter // GROUP, mp), h, torch.float32))
    _launch_glu_forward(
        (mp // GROUP, width // GROUP),
        h,
        _stored(a.data),
        a.scales,
        _stored(at.data) if save else None,
        at.scales if save else None,
        _stored(kept.data) if save else None,
        kept.scales if save else None,
        mp,
        inter,
        width,
        float(gate_multiplier),
        float(down_multiplier),
        SAVE=save,
        BM=GROUP,
        G=GROUP,
        CHUNK_=CHUNK,
        SOFTWARE_=SOFTWARE,
        num_warps=PASS_WARPS,
    )
    return a, at, kept


def glu_backward(
    da: torch.Tensor,
    kept: Fp8,
    save: int,
    gate_multiplier: float,
    down_multiplier: float,
    rows: bool,
    transposed: bool,
) -> tuple[Fp8 | None, Fp8 | None]:
    """The packed gradient [dU | dG] from dA [Mp, I] and the forward's kept tensor: as rows
    [Mp, reduction_width(2I)] (for dX) and its transpose as rows [2I, Mp] (for dW_gate_up), each
    where asked."""
    mp, inter = da.shape
    width = reduction_width(2 * inter)
    grad = grad_t = None
    if rows:
        grad = Fp8(empty((mp, width), da, E4M3), empty((width // GROUP, mp), da, torch.float32))
    if transposed:
        grad_t = Fp8(empty((2 * inter, mp), da, E4M3), empty((mp // GROUP, 2 * inter), da, torch.float32))
    _launch_glu_backward(
        (mp // GROUP, (width if rows else 2 * inter) // GROUP),
        da,
        _stored(kept.data),
        kept.scales,
        _stored(grad.data) if rows else None,
        grad.scales if rows else None,
        _stored(grad_t.data) if transposed else None,
        grad_t.scales if transposed else None,
        mp,
        inter,
        width,
        float(gate_multiplier),
        float(down_multiplier),
        SAVE=save,
        BM=GROUP,
        G=GROUP,
        CHUNK_=CHUNK,
        SOFTWARE_=SOFTWARE,
        num_warps=PASS_WARPS,
    )
    return grad, grad_t
