"""The FP8 path as a graph sees it: custom ops around the passes (kernels.py), and the autograd
Function whose forward and backward issue the six scaled GEMMs (format.mm) between them, so that a
compiled graph issues them itself, as it issues the bf16 path's GEMMs (ops.py).

The recipe (DeepSeek-V3's): activations and gradients in 1 x 128 groups along each GEMM's
reduction dimension, weights in 128 x 128 blocks, fp32 accumulation promoted group by group.

* forward: x -> rows and rows of x^T (one pass); h = x W_gate_up^T; one pass turns h into ``a``
  (rows) and what training keeps; y = a W_down^T;
* backward: dY -> rows and rows of dY^T (one pass); dA = dY W_down; one pass turns dA and the kept
  tensor into the packed gradient (rows) and its transpose (rows); dW_down = dY^T a;
  dX = grad W_gate_up; dW_gate_up = grad^T x.

Kept between forward and backward, per token, with their scales: ``x^T`` (H bytes, in place of x)
and either the FP8 factors (2I bytes) and ``a^T`` (I bytes, from the forward's pass), or the FP8
pre-activations (2I bytes), from which the backward's pass also writes ``a^T``. The weights are
quantized in each forward (as they are) and each backward (transposed) from the parameters
themselves: nothing is cached across calls, so an FP8 weight is never older than its parameter,
whoever updates it (an optimizer, FSDP's all-gather into a reused buffer, a load).

Tokens are padded to a whole group of 128 rows inside the path (zero rows), so that the weight
gradients reduce over whole groups; y and dX drop the padding rows.
"""

from __future__ import annotations

import torch

from ..kernels.plans import planned
from ..library import define
from ..ops import _empty_if_none, _on_tensor_device, _refuse_double_backward
from . import kernels
from .format import (
    GROUP,
    Fp8,
    gate_up_from_halves,
    gate_up_in_halves,
    halves_width,
    mm,
    padded_rows,
    reduction_width,
)

#: What training keeps, by save mode, as the passes' constexpr (0: nothing, inference).
KEPT = {"factors": 1, "preact": 2}


def _none_to_empty(*tensors, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(_empty_if_none(t, like) for t in tensors)


@_on_tensor_device
@planned
def _quantize(x, rows, transposed):
    data, t = kernels.quantize_activation(x, rows, transposed, reduction_width(x.shape[1]))
    rest = (t.data, t.scales) if transposed else (None, None)
    return _none_to_empty(data.data, data.scales, *rest, like=x)


def _quantize_fake(x, rows, transposed):
    f = x.shape[1]
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    rest = (
        (x.new_empty(f, rows, dtype=e4m3), x.new_empty(rows // GROUP, f, dtype=f32))
        if transposed
        else (None, None)
    )
    width = reduction_width(f)
    data = (x.new_empty(rows, width, dtype=e4m3), x.new_empty(width // GROUP, rows, dtype=f32))
    return _none_to_empty(*data, *rest, like=x)


quantize = define(
    "fp8_quantize(Tensor x, int rows, bool transposed) -> (Tensor, Tensor, Tensor, Tensor)",
    _quantize,
    _quantize_fake,
)


@_on_tensor_device
@planned
def _quantize_weight(w, transposed, halves):
    q = kernels.quantize_weight(w, transposed, halves)
    return q.data, q.scales


def _quantize_weight_fake(w, transposed, halves):
    r, c = w.shape
    if halves:
        r = halves_width(r // 2)
    r, c = (c, r) if transposed else (r, c)
    width = reduction_width(c)
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    return w.new_empty(r, width, dtype=e4m3), w.new_empty(-(-r // GROUP), width // GROUP, dtype=f32)


quantize_weight = define(
    "fp8_quantize_weight(Tensor w, bool transposed, bool halves) -> (Tensor, Tensor)",
    _quantize_weight,
    _quantize_weight_fake,
)


@_on_tensor_device
@planned
def _glu_forward(h, inter, kept, gate_multiplier, down_multiplier):
    a, a_t, saved = kernels.glu_forward(h, inter, kept, gate_multiplier, down_multiplier)
    rest = (None, None) if a_t is None else (a_t.data, a_t.scales)
    rest += (None, None) if saved is None else (saved.data, saved.scales)
    return _none_to_empty(a.data, a.scales, *rest, like=h)


def _glu_forward_fake(h, inter, kept, gate_multiplier, down_multiplier):
    mp, packed = h.shape
    width = reduction_width(inter)
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    a = (h.new_empty(mp, width, dtype=e4m3), h.new_empty(width // GROUP, mp, dtype=f32))
    if not kept:
        return _none_to_empty(*a, None, None, None, None, like=h)
    a_t = _a_t_fake(inter, mp, h) if kept == 1 else (None, None)
    saved = (h.new_empty(mp, packed, dtype=e4m3), h.new_empty(packed // GROUP, mp, dtype=f32))
    return _none_to_empty(*a, *a_t, *saved, like=h)


def _a_t_fake(inter, mp, like):
    return like.new_empty(inter, mp, dtype=torch.float8_e4m3fn), like.new_empty(
        mp // GROUP, inter, dtype=torch.float32
    )


glu_forward = define(
    "fp8_glu_forward(Tensor h, int inter, int kept, float gate_multiplier, float down_multiplier) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _glu_forward,
    _glu_forward_fake,
)


@_on_tensor_device
@planned
def _dequantize(data, scales, rows, cols, dtype):
    return kernels.dequantize(Fp8(data, scales), rows, cols, dtype)


def _dequantize_fake(data, scales, rows, cols, dtype):
    return data.new_empty(rows, cols, dtype=dtype)


dequantize = define(
    "fp8_dequantize(Tensor data, Tensor scales, int rows, int cols, ScalarType dtype) -> Tensor",
    _dequantize,
    _dequantize_fake,
)


@_on_tensor_device
@planned
def _glu_backward(da, kept_data, kept_scales, kept, gate_multiplier, down_multiplier, rows, transposed, a_t):
    multipliers = (gate_multiplier, down_multiplier)
    grad, grad_t, at = kernels.glu_backward(
        da, Fp8(kept_data, kept_scales), kept, *multipliers, rows, transposed, a_t
    )
    pieces = (grad.data, grad.scales) if rows else (None, None)
    pieces += (grad_t.data, grad_t.scales) if transposed else (None, None)
    pieces += (at.data, at.scales) if a_t else (None, None)
    return _none_to_empty(*pieces, like=da)


def _glu_backward_fake(
    da, kept_data, kept_scales, kept, gate_multiplier, down_multiplier, rows, transposed, a_t
):
    mp, inter = da.shape
    width = reduction_width(halves_width(inter))
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    pieces = (
        (da.new_empty(mp, width, dtype=e4m3), da.new_empty(width // GROUP, mp, dtype=f32))
        if rows
        else (None, None)
    )
    pieces += (
        (da.new_empty(2 * inter, mp, dtype=e4m3), da.new_empty(mp // GROUP, 2 * inter, dtype=f32))
        if transposed
        else (None, None)
    )
    pieces += _a_t_fake(inter, mp, da) if a_t else (None, None)
    return _none_to_empty(*pieces, like=da)


glu_backward = define(
    "fp8_glu_backward(Tensor da, Tensor kept_data, Tensor kept_scales, int kept, float gate_multiplier, "
    "float down_multiplier, bool rows, bool transposed, bool a_t) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _glu_backward,
    _glu_backward_fake,
)


def _weight(w: torch.Tensor, transposed: bool, halves: bool = False) -> Fp8:
    data, scales = quantize_weight(w, transposed, halves)
    return Fp8(data, scales, blocks=True)


def _unpadded(t: torch.Tensor, m: int) -> torch.Tensor:
    return t if t.shape[0] == m else t[:m]


def _pre_activation(x_data, x_scales, gate_up_weight, u, v, out_dtype):
    """h [Mp, halves_width(I)] in halves: the gate/up GEMM, plus u v^T (LoRA's term) where given."""
    h = mm(Fp8(x_data, x_scales), _weight(gate_up_weight, False, halves=True), out_dtype)
    if u is not None:  # u v^T in fp32, added and rounded once (a 16-bit addmm_ missed that on CUDA)
        with torch.autocast(h.device.type, enabled=False):
            h[: u.shape[0]] += u.float() @ gate_up_in_halves(v).float().t()
    return h


def _a_as_read(a_data, a_scales, m, inter, out_dtype):
    """``a`` [M, I] as the down GEMM reads it: the FP8 ``a`` dequantized, in ``out_dtype``."""
    return dequantize(a_data, a_scales, m, inter, out_dtype)


def mlp_inference(
    x2d,
    gate_up_weight,
    down_weight,
    gate_multiplier,
    down_multiplier,
    out_dtype,
    u=None,
    v=None,
    with_a=False,
):
    """y [M, H] in ``out_dtype``, nothing kept; with LoRA's terms as the Function takes them, and
    with ``with_a`` (y, a)."""
    m, inter = x2d.shape[0], down_weight.shape[1]
    x_data, x_scales, _, _ = quantize(x2d, padded_rows(m), False)
    h = _pre_activation(x_data, x_scales, gate_up_weight, u, v, out_dtype)
    a_data, a_scales, *_ = glu_forward(h, inter, 0, gate_multiplier, down_multiplier)
    del h
    y = _unpadded(mm(Fp8(a_data, a_scales), _weight(down_weight, False), out_dtype), m)
    return (y, _a_as_read(a_data, a_scales, m, inter, out_dtype)) if with_a else y


class SwiGLUMLPFp8Function(torch.autograd.Function):
    """The MLP's FP8 training step (module docstring). Under autocast, x and the weights are quantized
    from their own dtype, the forward's output is in the autocast dtype, and each gradient comes back
    in its input's dtype (fp32 weights: from the GEMM's fp32 result).

    LoRA's terms (lora.py), in 16 bits beside the FP8 GEMMs: ``u`` [M, R] and ``v`` [2I, R] (the
    weight's packing) add u v^T to h; dU and dV come from the packed gradient as the dX and
    dW_gate_up GEMMs read it (dequantized). With ``with_a`` the forward also returns ``a`` as the
    down GEMM reads it (dequantized, [M, I]) for the down projection's adapters, and the gradient
    that comes back to it joins dA."""

    @staticmethod
    def forward(
        ctx, x2d, gate_up_weight, down_weight, u, v, gate_multiplier, down_multiplier, save, out_dtype, with_a
    ):
        m, inter = x2d.shape[0], down_weight.shape[1]
        rows = padded_rows(m)
        kept = KEPT[save]
        x_data, x_scales, xt_data, xt_scales = quantize(x2d, rows, True)
        h = _pre_activation(x_data, x_scales, gate_up_weight, u, v, out_dtype)
        a_data, a_scales, at_data, at_scales, kept_data, kept_scales = glu_forward(
            h, inter, kept, gate_multiplier, down_multiplier
        )
        del h
        y = _unpadded(mm(Fp8(a_data, a_scales), _weight(down_weight, False), out_dtype), m)
        ctx.save_for_backward(
            gate_up_weight, down_weight, xt_data, xt_scales, at_data, at_scales, kept_data, kept_scales, u, v
        )
        ctx.scalars = (m, kept, gate_multiplier, down_multiplier, out_dtype)
        ctx.grad_dtypes = (x2d.dtype, gate_up_weight.dtype, down_weight.dtype)
        if not with_a:
            return y
        return y, _a_as_read(a_data, a_scales, m, inter, out_dtype)

    @staticmethod
    def backward(ctx, dy, da_out=None):
        _refuse_double_backward()
        gate_up_weight, down_weight, xt_data, xt_scales, at_data, at_scales, kept_data, kept_scales, u, v = (
            ctx.saved_tensors
        )
        m, kept, gate_multiplier, down_multiplier, out_dtype = ctx.scalars
        x_dtype, gate_up_dtype, down_dtype = ctx.grad_dtypes
        need_dx, need_dw_gate_up, need_dw_down, need_du, need_dv = ctx.needs_input_grad[:5]
        rows = padded_rows(m)
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        dy_data, dy_scales, dyt_data, dyt_scales = quantize(dy, rows, need_dw_down)
        dx = dw_gate_up = dw_down = du = dv = None
        a_t_from_backward = need_dw_down and kept == KEPT["preact"]  # the forward did not keep a^T
        grad_rows = need_dx or need_du or need_dv
        if grad_rows or need_dw_gate_up or a_t_from_backward:
            da = mm(Fp8(dy_data, dy_scales), _weight(down_weight, True), out_dtype)
            if da_out is not None:
                da[:m] += da_out
            multipliers = (gate_multiplier, down_multiplier)
            g_data, g_scales, gt_data, gt_scales, bt_data, bt_scales = glu_backward(
                da, kept_data, kept_scales, kept, *multipliers, grad_rows, need_dw_gate_up, a_t_from_backward
            )
            del da
            if a_t_from_backward:
                at_data, at_scales = bt_data, bt_scales
        if need_dw_down:
            dw_down = mm(Fp8(dyt_data, dyt_scales), Fp8(at_data, at_scales), down_dtype)
        if need_dx:
            dx = _unpadded(mm(Fp8(g_data, g_scales), _weight(gate_up_weight, True, halves=True), x_dtype), m)
        if need_dw_gate_up:
            dw_gate_up = mm(Fp8(gt_data, gt_scales), Fp8(xt_data, xt_scales), gate_up_dtype)
        if need_du or need_dv:
            inter = down_weight.shape[1]
            dh = dequantize(g_data, g_scales, m, halves_width(inter), u.dtype)
            du = dh @ gate_up_in_halves(v) if need_du else None
            dv = gate_up_from_halves(dh.t() @ u, inter) if need_dv else None
        return dx, dw_gate_up, dw_down, du, dv, None, None, None, None, None
