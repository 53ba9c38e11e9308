"""Training and inference paths of the fused MLP over 2-D, TMA-ready tensors.

What is kept between forward and backward, per token (x and the weights not counted):

* ``Saved.FACTORS``: [silu(g) | gate_multiplier * u * silu'(g)] (2I) and a (I) = 3I elements;
* ``Saved.PREACT``: [u | g] (2I) elements; the backward recomputes the sigmoid and ``a``.

The backward overwrites the saved packed tensor with the packed pre-activation gradient, so a graph
can be walked backward exactly once; a second walk (``retain_graph=True``) or a differentiable one
(``create_graph=True``) raises instead of reading overwritten memory.
"""

from __future__ import annotations

import torch

from .kernels.common import Saved, tma_ready
from .kernels.glu_backward import glu_backward_
from .kernels.glu_forward import glu_forward


def swiglu_mlp_no_grad(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    gate_multiplier: float,
    down_multiplier: float,
) -> torch.Tensor:
    """Inference: only ``a`` [M, I] is allocated, nothing is saved."""
    a, _ = glu_forward(
        x, w_gate_up, gate_scale=gate_multiplier, out_scale=down_multiplier, save=Saved.NOTHING
    )
    return torch.mm(a, w_down.t())


def _claim_saved_buffers(ctx) -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            "fused_swiglu: create_graph=True (double backward) is not supported: the backward overwrites "
            "its saved activations in place. Use the reference implementation "
            "(fused_swiglu.reference) for higher-order gradients."
        )
    if ctx.saved_buffers_consumed:
        raise RuntimeError(
            "fused_swiglu: this graph was already walked backward once. Its saved activations were "
            "overwritten in place by that backward, so a second backward (retain_graph=True) would be "
            "wrong. Run the forward again instead."
        )
    ctx.saved_buffers_consumed = True


class SwiGLUMLPFunction(torch.autograd.Function):
    """y = down_multiplier * (silu(gate_multiplier * x @ Wg^T) * (x @ Wu^T)) @ Wd^T, weights packed."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, gate_multiplier: float, down_multiplier: float, save: Saved):
        a, saved = glu_forward(x, w_gate_up, gate_scale=gate_multiplier, out_scale=down_multiplier, save=save)
        y = torch.mm(a, w_down.t())
        # a already carries the down multiplier, so dW_down = dY^T @ a needs no extra scaling.
        ctx.save_for_backward(x, w_gate_up, w_down, saved, a if save == Saved.FACTORS else None)
        ctx.gate_multiplier = gate_multiplier
        ctx.down_multiplier = down_multiplier
        ctx.saved_kind = save
        ctx.saved_buffers_consumed = False
        return y

    @staticmethod
    def backward(ctx, dy):
        _claim_saved_buffers(ctx)
        x, w_gate_up, w_down, grad_gate_up, a = ctx.saved_tensors
        need_dx, need_dw_gate_up, need_dw_down = ctx.needs_input_grad[:3]
        # dy may be an expanded or otherwise strided view (e.g. from y.sum()).
        dy = tma_ready(dy)
        recomputed = glu_backward_(
            dy,
            w_down,
            grad_gate_up,
            gate_scale=ctx.gate_multiplier,
            out_scale=ctx.down_multiplier,
            kind=ctx.saved_kind,
        )
        # From here on grad_gate_up holds [dU | dG] in packed column order.
        dw_down = torch.mm(dy.t(), a if recomputed is None else recomputed) if need_dw_down else None
        del a, recomputed
        dx = torch.mm(grad_gate_up, w_gate_up) if need_dx else None
        dw_gate_up = torch.mm(grad_gate_up.t(), x) if need_dw_gate_up else None
        return dx, dw_gate_up, dw_down, None, None, None
