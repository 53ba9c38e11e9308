"""The passes of the fused operators over 2-D, TMA-ready tensors: the fused forward (inference and
training), the packed pre-activation gradient, the GEMMs on it, and the recompute backward. The
kernel choice is in ``kernels/configs.py``; the custom ops and Functions (ops.py) call these.

What is kept between forward and backward, per token (x and the weights not counted):

* ``"factors"``: [silu(g) | gate_multiplier * u * silu'(g)] (2I), plus a (I) for the MLP's dW_down;
* ``"preact"``: [u | g] (2I); the MLP backward recomputes the sigmoid and ``a``;
* ``"recompute"``: nothing; the backward first re-runs the fused gate/up GEMM (one more GEMM), in
  ``RECOMPUTE_PIECES`` column pieces, so that only one piece of what it recomputes is alive at a time.

The backward overwrites the saved packed tensor with the packed pre-activation gradient (ops.py
guards that it happens once).

A low-rank term ``u @ v^T`` (LoRA adapters on gate and up: ``u`` [M, R], ``v`` [2I, R] packed like
the weight) enters the GLU operator's pre-activation inside the forward GEMM; its gradients are two
more small GEMMs on the packed pre-activation gradient.

Inference saves nothing. At decode sizes (``CUBLAS_DECODE_ROWS`` rows or fewer) it runs the gate/up GEMM
on cuBLAS plus one activation pass, which measured faster there than the fused kernel.

fp32 on a GPU runs both GLU GEMMs on cuBLAS with the SwiGLU in in-place passes beside them
(``kernels/glu_split.py``): same saved tensors, same in-place contract, cuBLAS's fp32 speed.
"""

from __future__ import annotations

import torch

from .kernels.common import CHUNK, Saved, empty, interpreting
from .kernels.configs import (
    backward_is_warp_specialized,
    forward_is_warp_specialized,
    gemms_on_cublas,
    inference_uses_cublas,
    low_rank_in_kernel,
)
from .kernels.glu_activation import glu_activation
from .kernels.glu_backward import glu_backward_
from .kernels.glu_backward_ws import glu_backward_ws_
from .kernels.glu_forward import glu_forward
from .kernels.glu_forward_ws import glu_forward_ws
from .kernels.glu_grad import glu_grad_
from .kernels.glu_split import glu_backward_split_, glu_forward_split

#: The recompute backward redoes the [M, 2I] factors (and, for the MLP, ``a``) in this many column
#: pieces, each released before the next is made, so only one piece is alive beside the gradients.
#: Two, because dX is then the sum of two partial products rounded to x's dtype, as in eager
#: PyTorch, which adds its two projections' input gradients; more pieces would add roundings to dX.
RECOMPUTE_PIECES = 2


def mm_as(
    a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b`` in ``dtype``, a weight gradient in its parameter's dtype: on a GPU, 16-bit operands
    and an fp32 result, cuBLAS writes it from its fp32 accumulator (no rounding to 16 bits, no cast
    pass after); elsewhere the product is cast."""
    if dtype == a.dtype:
        return torch.mm(a, b, out=out)
    if a.is_cuda and dtype == torch.float32:
        return torch.mm(a, b, out_dtype=dtype, out=out)
    product = torch.mm(a, b)
    return product.to(dtype) if out is None else out.copy_(product)


def _recompute_pieces(inter: int) -> tuple[int, int]:
    """How many pieces of how many intermediate columns: whole packed chunks each, else one piece."""
    pieces = RECOMPUTE_PIECES if inter % (RECOMPUTE_PIECES * CHUNK) == 0 else 1
    return pieces, inter // pieces


def _forward(x, w_gate_up, *, save: Saved, write_a: bool = True, low_rank=None, **multipliers):
    """The fused forward kernel (warp-specialized where it is faster), or for fp32 on a GPU cuBLAS
    plus an in-place pass (same contract)."""
    on_gpu = not interpreting()
    if low_rank is None and forward_is_warp_specialized(x.shape[0], x.dtype, on_gpu, save, write_a):
        return glu_forward_ws(x, w_gate_up, save=save, **multipliers)
    split = gemms_on_cublas(x.dtype, on_gpu) or not low_rank_in_kernel(low_rank)
    launch = glu_forward_split if split else glu_forward
    options = {"save": save, "write_a": write_a, "low_rank": low_rank}
    return launch(x, w_gate_up, **options, **multipliers)


def _backward_(dy, w_down, saved, *, save, **multipliers):
    """The fused backward kernel (warp-specialized where it is faster), or for fp32 on a GPU cuBLAS
    plus a gradient pass (same contract: the gradient over ``saved``)."""
    on_gpu = not interpreting()
    if backward_is_warp_specialized(dy.shape[0], dy.dtype, on_gpu, save):
        return glu_backward_ws_(dy, w_down, saved, save=save, **multipliers)
    launch = glu_backward_split_ if gemms_on_cublas(dy.dtype, on_gpu) else glu_backward_
    return launch(dy, w_down, saved, save=save, **multipliers)


def _glu_no_grad(x, w_gate_up, multipliers: dict, low_rank=None):
    """``down_multiplier * a`` [M, I]: the fused kernel, or at decode sizes cuBLAS plus an activation pass."""
    if inference_uses_cublas(x.shape[0]):
        h = torch.mm(x, w_gate_up.t())  # [M, 2I]: small at decode sizes
        if low_rank is not None:
            h.addmm_(low_rank[0], low_rank[1].t())
        return glu_activation(h, **multipliers)
    a, _ = _forward(x, w_gate_up, save=Saved.NOTHING, low_rank=low_rank, **multipliers)
    return a


def glu_pass(x, w_gate_up, save: Saved | None, multipliers: dict, low_rank=None):
    """``a`` = down_multiplier * silu(gate_multiplier * g) * u [M, I] and what ``save`` keeps for the
    backward (``None`` where it keeps nothing); ``save=None``: inference, which at decode sizes runs
    cuBLAS plus an activation pass."""
    if save is None:
        return _glu_no_grad(x, w_gate_up, multipliers, low_rank), None
    return _forward(x, w_gate_up, save=save, low_rank=low_rank, **multipliers)


def mlp_gradient_(dy, w_down, saved, save: Saved, multipliers: dict):
    """Writes the MLP's packed pre-activation gradient [dU | dG] over ``saved``; returns ``a`` (with
    the down multiplier) recomputed for saved pre-activations, ``None`` for saved factors."""
    return _backward_(dy, w_down, saved, save=save, **multipliers)


def glu_grads(grad, x, w_gate_up, needs, dw_dtype, low_rank, out=None):
    """dX, dW_gate_up (in ``dw_dtype``), dU, dV from the packed pre-activation gradient ``grad`` (of
    the weight rows ``w_gate_up`` and ``low_rank``'s v cover). With ``out`` = (dX, dW, dU, dV)
    buffers, dX and dU are accumulated into and dW and dV written (the recompute pieces); the results
    are returned."""
    need_dx, need_dw, need_du, need_dv = needs
    u, v = low_rank if low_rank is not None else (None, None)
    dx, dw, du, dv = out if out is not None else (None,) * 4
    if need_dx:
        dx = torch.mm(grad, w_gate_up) if dx is None else dx.addmm_(grad, w_gate_up)
    if need_dw:
        dw = mm_as(grad.t(), x, dw_dtype, out=dw)
    if u is not None and need_du:
        du = torch.mm(grad, v) if du is None else du.addmm_(grad, v)
    if u is not None and need_dv:
        dv = torch.mm(grad.t(), u, out=dv)
    return dx, dw, du, dv


def mlp_grads_recomputed(
    x, w_gate_up, w_down, dy, multipliers, need_dx, need_dw_gate_up, need_dw_down, grad_dtypes
):
    """dX and the packed dW_gate_up and dW_down of the MLP, ``a`` and the factors recomputed piece by
    piece: piece k covers intermediate columns [k * width, (k + 1) * width), packed weight rows
    [2k * width, 2(k + 1) * width) (whole chunks). Factors rather than pre-activations: the forward
    kernel writes a and the factors at the cost of one, and they make the backward epilogue cheaper."""
    pieces, width = _recompute_pieces(w_down.shape[1])
    dx = None
    gate_up_dtype, down_dtype = grad_dtypes
    dw_gate_up = empty(tuple(w_gate_up.shape), x, gate_up_dtype) if need_dw_gate_up else None
    dw_down = empty(tuple(w_down.shape), x, down_dtype) if need_dw_down else None
    for k in range(pieces):
        rows, cols = slice(2 * k * width, 2 * (k + 1) * width), slice(k * width, (k + 1) * width)
        w_piece = w_gate_up[rows]  # row and column blocks of TMA-ready weights stay TMA-ready
        a, grad = _forward(x, w_piece, save=Saved.FACTORS, **multipliers)
        _backward_(
            dy, w_down[:, cols], grad, save=Saved.FACTORS, **multipliers
        )  # grad: the piece's [dU | dG]
        if need_dw_down:
            mm_as(dy.t(), a, down_dtype, out=dw_down[:, cols])  # a carries the down multiplier
        del a
        if need_dw_gate_up:
            mm_as(grad.t(), x, gate_up_dtype, out=dw_gate_up[rows])
        if need_dx:
            dx = torch.mm(grad, w_piece) if dx is None else dx.addmm_(grad, w_piece)
        del grad  # before the next piece is made
    return dx, dw_gate_up, dw_down


def glu_grads_recomputed(x, w_gate_up, da, gate_multiplier: float, needs, dw_dtype, low_rank):
    """dX, the packed dW, dU and dV of the GLU operator, its factors recomputed piece by piece (as
    above): each piece's factors become its packed gradient in place, give dW's (and dV's) rows of the
    piece and add the piece's terms to dX (and dU), and are released."""
    pieces, width = _recompute_pieces(da.shape[1])
    need_dx, need_dw, need_du, need_dv = needs
    u, v = low_rank if low_rank is not None else (None, None)
    dw_gate_up = empty(tuple(w_gate_up.shape), x, dw_dtype) if need_dw else None
    dv = empty(tuple(v.shape), u) if u is not None and need_dv else None
    dx = du = None
    for k in range(pieces):
        rows = slice(2 * k * width, 2 * (k + 1) * width)
        piece_low_rank = None if u is None else (u, v[rows])
        _, grad = _forward(
            x,
            w_gate_up[rows],
            gate_multiplier=gate_multiplier,
            down_multiplier=1.0,
            save=Saved.FACTORS,
            write_a=False,
            low_rank=piece_low_rank,
        )
        glu_grad_(da[:, k * width : (k + 1) * width], grad)  # in place: the piece's [dU | dG]
        out = (dx, None if dw_gate_up is None else dw_gate_up[rows], du, None if dv is None else dv[rows])
        dx, _, du, _ = glu_grads(grad, x, w_gate_up[rows], needs, dw_dtype, piece_low_rank, out)
        del grad  # before the next piece is made
    return dx, dw_gate_up, du, dv
