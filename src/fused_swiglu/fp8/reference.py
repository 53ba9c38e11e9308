"""The FP8 path in plain PyTorch: the kernels' passes (kernels.py) and the whole training step, each
quantization from format.py's reference and each GEMM the product of the dequantized operands in
fp32. The tests' oracle for the FP8 kernels and ops, step by step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout import pack_gate_up, split_packed_columns
from .format import Fp8, dequantize, padded_rows, quantize_blocks, quantize_rows, reduction_width


def _silu_and_slope(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(g)
    return g * s, s * (1.0 + g * (1.0 - s))


def _packed(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[M, I] halves -> [M, 2I] in the packed column order (up's place first)."""
    return pack_gate_up(second.t(), first.t()).t()


def glu_forward(h: torch.Tensor, save: int, gate_multiplier: float, down_multiplier: float):
    """kernels.glu_forward: h [Mp, 2I] packed -> (a, a^T, kept) as rows (a^T None unless the
    factors are kept, kept None for ``save`` 0)."""
    up, gate = (t.float() for t in split_packed_columns(h))
    silu, slope = _silu_and_slope(gate * gate_multiplier)
    a = silu * up * down_multiplier
    a_rows = quantize_rows(a, width=reduction_width(a.shape[1]))
    if not save:
        return a_rows, None, None
    if save == 1:
        return a_rows, quantize_rows(a.t()), quantize_rows(_packed(silu, up * slope * gate_multiplier))
    return a_rows, None, quantize_rows(_packed(up, gate))


def glu_backward(da: torch.Tensor, kept: Fp8, save: int, gate_multiplier: float, down_multiplier: float):
    """kernels.glu_backward: (grad, grad^T, a^T) as rows, grad = [dU | dG] packed, a^T (recomputed
    from kept pre-activations) None for kept factors."""
    first, second = split_packed_columns(dequantize(kept))
    da = da.float() * down_multiplier
    a_t = None
    if save == 1:
        du, dg = da * first, da * second
    else:
        silu, slope = _silu_and_slope(second * gate_multiplier)
        du, dg = da * silu, da * first * slope * gate_multiplier
        a_t = quantize_rows((silu * first * down_multiplier).t())
    grad = _packed(du, dg)
    return quantize_rows(grad, width=reduction_width(grad.shape[1])), quantize_rows(grad.t()), a_t


def _mm(a: Fp8, b: Fp8) -> torch.Tensor:
    return dequantize(a) @ dequantize(b).t()


def swiglu_mlp_fp8(x, gate_up_weight, down_weight, dy, *, gate_multiplier=1.0, down_multiplier=1.0, save=1):
    """The FP8 step in PyTorch: y and (dX, dW_gate_up, dW_down) for the output gradient ``dy``,
    every GEMM's output rounded to ``x``'s dtype where the path rounds it (h, dA)."""
    (m, hidden), inter = x.shape, down_weight.shape[1]
    rows, hidden_width, inter_width = padded_rows(m), reduction_width(hidden), reduction_width(inter)
    x_pad = F.pad(x.float(), (0, 0, 0, rows - m))
    h = _mm(quantize_rows(x_pad, width=hidden_width), quantize_blocks(gate_up_weight, hidden_width)).to(
        x.dtype
    )
    a, a_t, kept = glu_forward(h, save, gate_multiplier, down_multiplier)
    y = _mm(a, quantize_blocks(down_weight, inter_width))[:m]
    dy_pad = F.pad(dy.float(), (0, 0, 0, rows - m))
    da = _mm(quantize_rows(dy_pad, width=hidden_width), quantize_blocks(down_weight.t(), hidden_width))
    grad, grad_t, recomputed_a_t = glu_backward(da.to(x.dtype), kept, save, gate_multiplier, down_multiplier)
    dw_down = _mm(quantize_rows(dy_pad.t()), a_t if save == 1 else recomputed_a_t)
    dx = _mm(grad, quantize_blocks(gate_up_weight.t(), reduction_width(2 * inter)))[:m]
    dw_gate_up = _mm(grad_t, quantize_rows(x_pad.t()))
    return y, (dx, dw_gate_up, dw_down)
