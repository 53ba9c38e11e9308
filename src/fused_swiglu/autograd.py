"""The autograd Functions of the fused training calls: a forward op and a backward op (ops.py) each.

``torch.compile`` traces a Function's forward and backward into the graph (no graph break), and the
compiled code calls the two ops directly. Eagerly the same Functions run as written.

What is kept between forward and backward is what the forward op returns besides the output
(``passes.py`` says what each save mode keeps). The backward overwrites it, so a graph can be walked
backward once; ``create_graph=True`` (double backward) is refused.
"""

from __future__ import annotations

import torch

from . import ops
from .kernels.common import bind_cuda_context


def _refuse_double_backward() -> None:
    if torch.is_grad_enabled():  # grad mode is on inside a backward only with create_graph=True
        raise RuntimeError(
            "fused_swiglu: create_graph=True (double backward) is not supported: the backward is not "
            "differentiable. Use fused_swiglu.reference for higher-order gradients."
        )


def _saved_tensors(ctx) -> tuple[torch.Tensor, ...]:
    """``ctx.saved_tensors``; eagerly, a second walk, which autograd's own check of the saved tensors
    finds (the backward op marked the kept tensor changed), gets the library's message."""
    if torch.compiler.is_compiling():
        return ctx.saved_tensors
    try:
        saved = ctx.saved_tensors
    except RuntimeError as error:
        # Only after a first walk: anything else changed in place is the caller's, and PyTorch says so.
        if getattr(ctx, "walked", False) and "modified by an inplace operation" in str(error):
            ops.refuse_second_walk()
        raise
    ctx.walked = True
    return saved


class SwiGLUMLPFunction(torch.autograd.Function):
    """y = down_multiplier * (silu(gate_multiplier * x @ Wg^T) * (x @ Wu^T)) @ Wd^T, weights packed."""

    @staticmethod
    def forward(ctx, x2d, gate_up_weight, down_weight, gate_multiplier: float, down_multiplier: float, save):
        scalars = (gate_multiplier, down_multiplier, save)
        y, kept, a = ops.swiglu_mlp_forward(x2d, gate_up_weight, down_weight, *scalars)
        # a is kept for dW_down only (with saved factors): not kept when the down weight is frozen.
        ctx.save_for_backward(x2d, gate_up_weight, down_weight, kept, a if ctx.needs_input_grad[2] else None)
        ctx.scalars = scalars
        return y

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        x2d, gate_up_weight, down_weight, kept, a = _saved_tensors(ctx)
        need_dx, need_dw_gate_up, need_dw_down = ctx.needs_input_grad[:3]
        eager = not torch.compiler.is_compiling()
        if eager and kept._version:  # refused before a is read (the op refuses it too, compiled)
            ops.refuse_second_walk()
        if eager and dy.is_cuda:
            bind_cuda_context(dy.device)  # autograd's device thread may have no CUDA context yet
        dw_down = None
        if need_dw_down and ctx.scalars[2] == "factors":
            # dW_down = dY^T @ a (a carries the down multiplier) first: a's last use, so a compiled
            # backward drops a before the backward op allocates the two largest gradients. The op
            # takes dW_down as `after` so that the compiler cannot move this GEMM past it.
            dw_down = torch.mm(dy.t(), a)
            if eager:
                # Autograd holds saved tensors until the backward returns: release a now.
                a.untyped_storage().resize_(0)
        del a
        needs = (need_dx, need_dw_gate_up, need_dw_down and dw_down is None)
        weights = (gate_up_weight, down_weight)
        grads = ops.swiglu_mlp_backward(dy, x2d, *weights, kept, dw_down, *ctx.scalars, *needs)
        dx, dw_gate_up, op_dw_down = (g if need else None for g, need in zip(grads, needs, strict=True))
        return dx, dw_gate_up, op_dw_down if dw_down is None else dw_down, None, None, None


class SwiGLULinearFunction(torch.autograd.Function):
    """a = silu(gate_multiplier * g) * u from the packed pre-activation [u | g] = x @ W^T (+ u_lr @ v^T,
    a low-rank term, if given): the GLU half alone."""

    @staticmethod
    def forward(ctx, x2d, gate_up_weight, gate_multiplier: float, save: str, u=None, v=None):
        a, factors = ops.swiglu_linear_forward(x2d, gate_up_weight, gate_multiplier, save, u, v)
        ctx.save_for_backward(x2d, gate_up_weight, factors, u, v)
        ctx.scalars = (gate_multiplier, save)
        return a

    @staticmethod
    def backward(ctx, da):
        _refuse_double_backward()
        needs = (*ctx.needs_input_grad[:2], *ctx.needs_input_grad[4:6])
        grads = ops.swiglu_linear_backward(da, *_saved_tensors(ctx), *ctx.scalars, *needs)
        dx, dw, du, dv = (g if need else None for g, need in zip(grads, needs, strict=True))
        return dx, dw, None, None, du, dv
