"""Training and inference paths of the fused operators over 2-D, TMA-ready tensors.

What is kept between forward and backward, per token (x and the weights not counted):

* ``"factors"``: [silu(g) | gate_multiplier * u * silu'(g)] (2I), plus a (I) for the MLP's dW_down;
* ``"preact"``: [u | g] (2I); the MLP backward recomputes the sigmoid and ``a``;
* ``"recompute"``: nothing; the backward first re-runs the fused gate/up GEMM (one more GEMM).

The backward overwrites the saved packed tensor with the packed pre-activation gradient, so a graph
that kept one can be walked backward exactly once; a second walk (``retain_graph=True``) raises
instead of reading overwritten memory. Double backward (``create_graph=True``) is not supported.

Inference saves nothing. At decode sizes (``CUBLAS_DECODE_ROWS`` rows or fewer) it runs the gate/up GEMM
on cuBLAS plus one activation pass, which measured faster there than the fused kernel.

fp32 on a GPU runs both GLU GEMMs on cuBLAS with the SwiGLU in in-place passes beside them
(``kernels/glu_split.py``): same saved tensors, same in-place contract, cuBLAS's fp32 speed.
"""

from __future__ import annotations

import torch

from .kernels.common import Saved, interpreting, tma_ready
from .kernels.configs import gemms_on_cublas, inference_uses_cublas
from .kernels.glu_activation import glu_activation
from .kernels.glu_backward import glu_backward_
from .kernels.glu_forward import glu_forward
from .kernels.glu_grad import glu_grad_
from .kernels.glu_split import glu_backward_split_, glu_forward_split

#: What the forward kernel writes in training, per save mode.
KEPT = {"factors": Saved.FACTORS, "preact": Saved.PREACT, "recompute": Saved.NOTHING}


def _forward(x: torch.Tensor, w_gate_up: torch.Tensor, **kwargs):
    """The fused forward kernel, or for fp32 on a GPU cuBLAS plus an in-place pass (same contract)."""
    split = gemms_on_cublas(x.dtype, not interpreting())
    return (glu_forward_split if split else glu_forward)(x, w_gate_up, **kwargs)


def _backward_(dy: torch.Tensor, w_down: torch.Tensor, saved: torch.Tensor, **kwargs):
    """The fused backward kernel, or for fp32 on a GPU cuBLAS plus an in-place pass (same contract)."""
    split = gemms_on_cublas(dy.dtype, not interpreting())
    return (glu_backward_split_ if split else glu_backward_)(dy, w_down, saved, **kwargs)


def _glu_no_grad(x: torch.Tensor, w_gate_up: torch.Tensor, gate_scale: float, out_scale: float):
    """``out_scale * a`` [M, I]: the fused kernel, or at decode sizes cuBLAS plus an activation pass."""
    if inference_uses_cublas(x.shape[0]):
        h = torch.mm(x, w_gate_up.t())  # [M, 2I]: small at decode sizes
        return glu_activation(h, gate_scale=gate_scale, out_scale=out_scale)
    a, _ = _forward(x, w_gate_up, gate_scale=gate_scale, out_scale=out_scale, save=Saved.NOTHING)
    return a


def swiglu_mlp_no_grad(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    gate_multiplier: float,
    down_multiplier: float,
) -> torch.Tensor:
    """Inference: nothing is saved."""
    return torch.mm(_glu_no_grad(x, w_gate_up, gate_multiplier, down_multiplier), w_down.t())


def swiglu_linear_no_grad(x: torch.Tensor, w_gate_up: torch.Tensor, gate_multiplier: float) -> torch.Tensor:
    """Inference of the GLU half."""
    return _glu_no_grad(x, w_gate_up, gate_multiplier, 1.0)


def _start_backward(ctx) -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            "fused_swiglu: create_graph=True (double backward) is not supported: the backward is not "
            "differentiable. Use fused_swiglu.reference for higher-order gradients."
        )
    if ctx.kept == Saved.NOTHING:
        return  # recompute mode: the saved inputs are untouched, walking again is fine
    if ctx.saved_buffers_consumed:
        raise RuntimeError(
            "fused_swiglu: this graph was already walked backward once. Its saved activations were "
            "overwritten in place by that backward, so a second backward (retain_graph=True) would be "
            "wrong. Run the forward again, or use save='recompute', which keeps nothing to overwrite."
        )
    ctx.saved_buffers_consumed = True


class SwiGLUMLPFunction(torch.autograd.Function):
    """y = down_multiplier * (silu(gate_multiplier * x @ Wg^T) * (x @ Wu^T)) @ Wd^T, weights packed."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, gate_multiplier: float, down_multiplier: float, save: str):
        kept = KEPT[save]
        a, saved = _forward(x, w_gate_up, gate_scale=gate_multiplier, out_scale=down_multiplier, save=kept)
        y = torch.mm(a, w_down.t())
        # a already carries the down multiplier, so dW_down = dY^T @ a needs no extra scaling.
        ctx.save_for_backward(x, w_gate_up, w_down, saved, a if kept == Saved.FACTORS else None)
        ctx.gate_multiplier, ctx.down_multiplier = gate_multiplier, down_multiplier
        ctx.kept = kept
        ctx.saved_buffers_consumed = False
        return y

    @staticmethod
    def backward(ctx, dy):
        _start_backward(ctx)
        x, w_gate_up, w_down, grad_gate_up, a = ctx.saved_tensors
        need_dx, need_dw_gate_up, need_dw_down = ctx.needs_input_grad[:3]
        kind = ctx.kept
        if kind == Saved.NOTHING:
            # Factors rather than pre-activations: the forward kernel writes a and the factors at the
            # cost of one, and the factors make the backward epilogue cheaper.
            a, grad_gate_up = _forward(
                x,
                w_gate_up,
                gate_scale=ctx.gate_multiplier,
                out_scale=ctx.down_multiplier,
                save=Saved.FACTORS,
            )
            kind = Saved.FACTORS
        dy = tma_ready(dy)  # e.g. the expanded (stride 0) gradient of y.sum()
        recomputed = _backward_(
            dy, w_down, grad_gate_up, gate_scale=ctx.gate_multiplier, out_scale=ctx.down_multiplier, kind=kind
        )
        # From here on grad_gate_up holds [dU | dG] in packed column order.
        dw_down = torch.mm(dy.t(), a if recomputed is None else recomputed) if need_dw_down else None
        if ctx.kept == Saved.FACTORS:
            # Autograd holds saved tensors until this function returns; release a's memory now, before
            # the two largest GEMMs allocate their outputs (the backward consumes what was saved).
            a.untyped_storage().resize_(0)
        del a, recomputed
        dx = torch.mm(grad_gate_up, w_gate_up) if need_dx else None
        dw_gate_up = torch.mm(grad_gate_up.t(), x) if need_dw_gate_up else None
        return dx, dw_gate_up, dw_down, None, None, None


class SwiGLULinearFunction(torch.autograd.Function):
    """a = silu(gate_multiplier * x @ Wg^T) * (x @ Wu^T) from the packed weight: the GLU half alone."""

    @staticmethod
    def forward(ctx, x, w_gate_up, gate_multiplier: float, save: str):
        kept = KEPT[save]
        a, factors = _forward(x, w_gate_up, gate_scale=gate_multiplier, out_scale=1.0, save=kept)
        ctx.save_for_backward(x, w_gate_up, factors)
        ctx.gate_multiplier = gate_multiplier
        ctx.kept = kept
        ctx.saved_buffers_consumed = False
        return a

    @staticmethod
    def backward(ctx, da):
        _start_backward(ctx)
        x, w_gate_up, factors = ctx.saved_tensors
        if ctx.kept == Saved.NOTHING:
            _, factors = _forward(
                x, w_gate_up, gate_scale=ctx.gate_multiplier, out_scale=1.0, save=Saved.FACTORS, write_a=False
            )
        grad_gate_up = glu_grad_(da.contiguous(), factors)  # in place: factors become [dU | dG]
        dx = torch.mm(grad_gate_up, w_gate_up) if ctx.needs_input_grad[0] else None
        dw_gate_up = torch.mm(grad_gate_up.t(), x) if ctx.needs_input_grad[1] else None
        return dx, dw_gate_up, None, None
