"""The FP8 path in plain PyTorch: the kernels' passes (kernels.py) and the whole training step, each
quantization from format.py's reference and each GEMM the product of the dequantized operands in
fp32. The tests' oracle for the FP8 kernels and ops, step by step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout import pack_gate_up
from .format import (
    Fp8,
    dequantize,
    gate_up_from_halves,
    gate_up_in_halves,
    halves_width,
    pack_halves,
    padded_rows,
    quantize_blocks,
    quantize_rows,
    reduction_width,
    unpack_halves,
)


def _silu_and_slope(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(g)
    return g * s, s * (1.0 + g * (1.0 - s))


def _packed(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[M, I] and [M, I] -> [M, 2I] in the weight's packing (layout.py; up's place first)."""
    return pack_gate_up(second.t(), first.t()).t()


def glu_forward(h: torch.Tensor, inter: int, save: int, gate_multiplier: float, down_multiplier: float):
    """kernels.glu_forward: h [Mp, halves_width(I)] in halves -> (a, a^T, kept) as rows (a^T None
    unless the factors are kept, kept None for ``save`` 0)."""
    up, gate = (t.float() for t in unpack_halves(h, inter))
    silu, slope = _silu_and_slope(gate * gate_multiplier)
    a = silu * up * down_multiplier
    a_rows = quantize_rows(a, width=reduction_width(a.shape[1]))
    if not save:
        return a_rows, None, None
    if save == 1:
        return a_rows, quantize_rows(a.t()), quantize_rows(pack_halves(silu, up * slope * gate_multiplier))
    return a_rows, None, quantize_rows(pack_halves(up, gate))


def glu_backward(da: torch.Tensor, kept: Fp8, save: int, gate_multiplier: float, down_multiplier: float):
    """kernels.glu_backward: (grad, grad^T, a^T) as rows, grad = [dU | dG] in halves, grad^T in the
    weight's packing, a^T (recomputed from kept pre-activations) None for kept factors."""
    first, second = unpack_halves(dequantize(kept), da.shape[1])
    da = da.float() * down_multiplier
    a_t = None
    if save == 1:
        du, dg = da * first, da * second
    else:
        silu, slope = _silu_and_slope(second * gate_multiplier)
        du, dg = da * silu, da * first * slope * gate_multiplier
        a_t = quantize_rows((silu * first * down_multiplier).t())
    grad = pack_halves(du, dg)
    grad_rows = quantize_rows(grad, width=reduction_width(grad.shape[1]))
    return grad_rows, quantize_rows(_packed(du, dg).t()), a_t


def _mm(a: Fp8, b: Fp8) -> torch.Tensor:
    return dequantize(a) @ dequantize(b).t()


def swiglu_mlp_fp8(x, gate_up_weight, down_weight, dy, *, gate_multiplier=1.0, down_multiplier=1.0, save=1):
    """The FP8 step in PyTorch: y and (dX, dW_gate_up, dW_down) for the output gradient ``dy``,
    every GEMM's output rounded to ``x``'s dtype where the path rounds it (h, dA)."""
    multipliers = {"gate_multiplier": gate_multiplier, "down_multiplier": down_multiplier}
    y, _, grads = swiglu_mlp_fp8_adapted(x, gate_up_weight, down_weight, dy, **multipliers, save=save)
    return y, grads


def swiglu_mlp_fp8_adapted(
    x,
    gate_up_weight,
    down_weight,
    dy,
    *,
    gate_multiplier=1.0,
    down_multiplier=1.0,
    save=1,
    low_rank=None,
    da=None,
):
    """The FP8 step with LoRA's terms (ops.SwiGLUMLPFp8Function with ``u, v`` and ``with_a``): y, ``a``
    as the down GEMM reads it (dequantized, in x's dtype) and the gradients (dX, dW_gate_up, dW_down,
    then dU, dV with ``low_rank``). ``low_rank`` (u [M, R], v [2I, R] in the weight's packing) adds
    u v^T to h, rounded once more; ``da`` is the gradient of a's other use, added to dA."""
    (m, hidden), inter = x.shape, down_weight.shape[1]
    rows, hidden_width, inter_width = padded_rows(m), reduction_width(hidden), reduction_width(inter)
    x_pad = F.pad(x.float(), (0, 0, 0, rows - m))
    w_gate_up = gate_up_in_halves(gate_up_weight)
    h = _mm(quantize_rows(x_pad, width=hidden_width), quantize_blocks(w_gate_up, hidden_width)).to(x.dtype)
    if low_rank is not None:
        u, v_halves = low_rank[0].float(), gate_up_in_halves(low_rank[1]).float()
        h = (h.float() + F.pad(u, (0, 0, 0, rows - m)) @ v_halves.t()).to(x.dtype)
    a, a_t, kept = glu_forward(h, inter, save, gate_multiplier, down_multiplier)
    y = _mm(a, quantize_blocks(down_weight, inter_width))[:m]
    dy_pad = F.pad(dy.float(), (0, 0, 0, rows - m))
    d_a = _mm(quantize_rows(dy_pad, width=hidden_width), quantize_blocks(down_weight.t(), hidden_width)).to(
        x.dtype
    )
    if da is not None:
        d_a = (d_a.float() + F.pad(da.float(), (0, 0, 0, rows - m))).to(x.dtype)
    grad, grad_t, recomputed_a_t = glu_backward(d_a, kept, save, gate_multiplier, down_multiplier)
    dw_down = _mm(quantize_rows(dy_pad.t()), a_t if save == 1 else recomputed_a_t)
    dx = _mm(grad, quantize_blocks(w_gate_up.t(), reduction_width(halves_width(inter))))[:m]
    dw_gate_up = _mm(grad_t, quantize_rows(x_pad.t()))
    grads = (dx, dw_gate_up, dw_down)
    if low_rank is not None:
        dh = dequantize(grad)[:m, : halves_width(inter)].to(x.dtype).float()
        grads += (dh @ v_halves, gate_up_from_halves(dh.t() @ u, inter))
    return y, dequantize(a)[:m, :inter].to(x.dtype), grads
