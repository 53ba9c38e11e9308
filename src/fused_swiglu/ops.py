"""The fused operators as a graph sees them: custom ops (``fused_swiglu::``, library.py) and the
autograd Functions around them. Every fused call, eager or under ``torch.compile``, runs through
them. The compiler sees each op as one opaque call with a fake implementation (shapes only) and
traces the Functions' forward and backward into the graph, so a model that calls the library
compiles to one graph whose code calls the ops without the library's Python above them.

The ops hold the fused kernels only; the GEMMs before and after them (the MLP's down projection,
the backward's input and weight gradients) are written in the Functions, so that a compiled graph
issues them itself, as it issues a stock model's GEMMs (docs/design/one-path.md says what that
saves). The ops: ``glu_forward`` (the fused gate/up GEMM and SwiGLU, for inference and training),
``mlp_gradient`` and ``glu_gradient`` (the packed pre-activation gradient from what the forward
kept), and for ``save="recompute"``, which frees what it recomputes piece by piece, the whole
backward (``mlp_backward_recomputed``, ``glu_backward_recomputed``). passes.py says what each save
mode keeps. The first three run their body once per signature and replay it after
(kernels/plans.py): a compiled graph calls them with the same few signatures every step.

The gradient ops write the packed pre-activation gradient over the tensor the forward kept and
return it in that tensor's memory, without declaring the alias: a declared mutation of a tensor
the backward graph receives makes the compiler copy it first (time and memory the overwrite is
there to save), and the returned tensor orders the graph's GEMMs after the op. Nothing reads the
kept tensor itself after the op (the compiler hands a graph input's memory to another buffer only
through a kernel that reads it, and none does), and ``_overwrite_once`` makes the overwrite happen
at most once: a graph can be walked backward once, and ``create_graph=True`` (double backward) is
refused.
"""

from __future__ import annotations

import functools

import torch

from .kernels.common import Saved, bind_cuda_context, empty, tma_ready
from .kernels.glu_grad import glu_grad_
from .kernels.plans import planned
from .library import define
from .passes import glu_grads, glu_grads_recomputed, glu_pass, mlp_gradient_, mlp_grads_recomputed, mm_as


def refuse_second_walk() -> None:
    """Raise in a backward whose saved activations an earlier walk of the graph overwrote."""
    raise RuntimeError(
        "fused_swiglu: this graph was already walked backward once. Its saved activations were "
        "overwritten in place by that backward, so a second backward (retain_graph=True) would be "
        "wrong. Run the forward again, or use save='recompute', which keeps nothing to overwrite."
    )


def _overwrite_once(saved: torch.Tensor) -> None:
    """Mark ``saved`` as overwritten, refusing if it already was.

    The forward op makes ``saved`` new, at version 0; the backward marks it changed. A second walk of a
    retained graph hands the backward the same tensor (autograd's own check of saved tensors usually
    refuses it first). A saved-tensor hook's copy (``save_on_cpu``) is made anew for every walk, and
    overwriting it loses nothing.
    """
    if saved._version:
        refuse_second_walk()
    torch.autograd.graph.increment_version(saved)


def _on_tensor_device(fn):
    """Triton launches on the current CUDA device whatever device the tensors are on: a call with
    tensors on another GPU (no ``torch.cuda.set_device`` first) makes their device current."""

    @functools.wraps(fn)
    def call(x2d, *args):
        if x2d.is_cuda and x2d.device.index != torch.cuda.current_device():
            with torch.cuda.device(x2d.device):
                return fn(x2d, *args)
        return fn(x2d, *args)

    return call


def _fake_grads(like: torch.Tensor, shapes, needs, dtypes) -> tuple[torch.Tensor, ...]:
    """A recompute backward op's gradients as its fake implementation makes them: empty where not
    needed (or, shape None, where there is no such input)."""
    return tuple(
        like.new_empty(shape, dtype=dtype) if need and shape is not None else like.new_empty(0)
        for shape, need, dtype in zip(shapes, needs, dtypes, strict=True)
    )


def _empty_if_none(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    # Custom ops return tensors only: what a save mode does not keep is an empty tensor.
    return empty((0,), like) if t is None else t


# The ops ---------------------------------------------------------------------------------------------
# ``u`` [M, R] and ``v`` [2I, R]: an optional low-rank term u @ v^T of the packed pre-activation (LoRA
# adapters on gate and up), R a multiple of 16; both given or neither.


#: ``glu_forward``'s save mode for a call that records no backward.
INFERENCE = "inference"


def _low_rank(u, v) -> tuple[torch.Tensor, torch.Tensor] | None:
    return None if u is None else (tma_ready(u), tma_ready(v))


@_on_tensor_device
@planned
def _glu_forward(x2d, gate_up_weight, gate_multiplier, down_multiplier, save, u, v):
    """x [M, H], packed [2I, H] -> ``a`` [M, I] (with the down multiplier) and what the save mode
    ``save`` keeps (empty for ``"recompute"``); ``save="inference"`` keeps nothing either."""
    multipliers = {"gate_multiplier": gate_multiplier, "down_multiplier": down_multiplier}
    args = (tma_ready(x2d), tma_ready(gate_up_weight))
    a, saved = glu_pass(*args, None if save == INFERENCE else Saved.of(save), multipliers, _low_rank(u, v))
    return a, _empty_if_none(saved, x2d)


def _glu_forward_fake(x2d, gate_up_weight, gate_multiplier, down_multiplier, save, u, v):
    m, two_inter = x2d.shape[0], gate_up_weight.shape[0]
    saved = x2d.new_empty(m, two_inter) if save not in ("recompute", INFERENCE) else x2d.new_empty(0)
    return x2d.new_empty(m, two_inter // 2), saved


glu_forward = define(
    "glu_forward(Tensor x2d, Tensor gate_up_weight, float gate_multiplier, float down_multiplier, "
    "str save, Tensor? u, Tensor? v) -> (Tensor, Tensor)",
    _glu_forward,
    _glu_forward_fake,
)


@_on_tensor_device
def _mlp_gradient(dy, down_weight, saved, gate_multiplier, down_multiplier, save):
    """The MLP's packed pre-activation gradient [dU | dG], written over ``saved`` and returned in its
    memory, and ``a`` recomputed for saved pre-activations (empty for saved factors)."""
    _overwrite_once(saved)
    return _mlp_gradient_pass(dy, down_weight, saved, gate_multiplier, down_multiplier, save)


@planned
def _mlp_gradient_pass(dy, down_weight, saved, gate_multiplier, down_multiplier, save):
    multipliers = {"gate_multiplier": gate_multiplier, "down_multiplier": down_multiplier}
    args = (tma_ready(dy), tma_ready(down_weight))
    a = mlp_gradient_(*args, saved, Saved.of(save), multipliers)
    return saved, _empty_if_none(a, saved)


def _mlp_gradient_fake(dy, down_weight, saved, gate_multiplier, down_multiplier, save):
    a = saved.new_empty(saved.shape[0], saved.shape[1] // 2) if save == "preact" else saved.new_empty(0)
    return torch.empty_like(saved), a


mlp_gradient = define(
    "mlp_gradient(Tensor dy, Tensor down_weight, Tensor saved, float gate_multiplier, "
    "float down_multiplier, str save) -> (Tensor, Tensor)",
    _mlp_gradient,
    _mlp_gradient_fake,
)


@_on_tensor_device
def _glu_gradient(da, factors):
    """The GLU operator's packed pre-activation gradient [dU | dG] from dA and the saved factors,
    written over ``factors`` and returned in its memory."""
    _overwrite_once(factors)
    return _glu_gradient_pass(da, factors)


@planned
def _glu_gradient_pass(da, factors):
    da = da.contiguous()
    glu_grad_(da, factors)
    return factors


def _glu_gradient_fake(da, factors):
    return torch.empty_like(factors)


glu_gradient = define("glu_gradient(Tensor da, Tensor factors) -> Tensor", _glu_gradient, _glu_gradient_fake)


@_on_tensor_device
@planned
def _mlp_backward_recomputed(
    dy, x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, *needs_and_dtypes
):
    """dX, the packed dW_gate_up and dW_down of ``save="recompute"`` (empty where not needed; the
    weights' gradients in the dtypes given): the forward GEMM again, piece by piece, inside the op."""
    needs, grad_dtypes = needs_and_dtypes[:3], needs_and_dtypes[3:]
    multipliers = {"gate_multiplier": gate_multiplier, "down_multiplier": down_multiplier}
    args = (tma_ready(x2d), tma_ready(gate_up_weight), tma_ready(down_weight), tma_ready(dy))
    grads = mlp_grads_recomputed(*args, multipliers, *needs, grad_dtypes)
    return tuple(_empty_if_none(g, x2d) for g in grads)


def _mlp_backward_recomputed_fake(
    dy, x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, *needs_and_dtypes
):
    needs, (gate_up_dtype, down_dtype) = needs_and_dtypes[:3], needs_and_dtypes[3:]
    shapes = (x2d.shape, gate_up_weight.shape, down_weight.shape)
    return _fake_grads(x2d, shapes, needs, (x2d.dtype, gate_up_dtype, down_dtype))


mlp_backward_recomputed = define(
    "mlp_backward_recomputed(Tensor dy, Tensor x2d, Tensor gate_up_weight, Tensor down_weight, "
    "float gate_multiplier, float down_multiplier, bool need_dx, bool need_dw_gate_up, bool need_dw_down, "
    "ScalarType dw_gate_up_dtype, ScalarType dw_down_dtype) -> (Tensor, Tensor, Tensor)",
    _mlp_backward_recomputed,
    _mlp_backward_recomputed_fake,
)


@_on_tensor_device
@planned
def _glu_backward_recomputed(da, x2d, gate_up_weight, u, v, gate_multiplier, *needs_and_dtype):
    """dX, the packed dW_gate_up (in the dtype given), dU and dV of the GLU operator's ``"recompute"``
    (empty where not needed), its factors made again piece by piece inside the op."""
    needs, dw_dtype = needs_and_dtype[:4], needs_and_dtype[4]
    args = (tma_ready(x2d), tma_ready(gate_up_weight), da.contiguous())
    grads = glu_grads_recomputed(*args, gate_multiplier, needs, dw_dtype, _low_rank(u, v))
    return tuple(_empty_if_none(g, x2d) for g in grads)


def _glu_backward_recomputed_fake(da, x2d, gate_up_weight, u, v, gate_multiplier, *needs_and_dtype):
    needs, dw_dtype = needs_and_dtype[:4], needs_and_dtype[4]
    shapes = (x2d.shape, gate_up_weight.shape, None if u is None else u.shape, None if v is None else v.shape)
    return _fake_grads(x2d, shapes, needs, (x2d.dtype, dw_dtype, x2d.dtype, x2d.dtype))


glu_backward_recomputed = define(
    "glu_backward_recomputed(Tensor da, Tensor x2d, Tensor gate_up_weight, Tensor? u, Tensor? v, "
    "float gate_multiplier, bool need_dx, bool need_dw, bool need_du, bool need_dv, ScalarType dw_dtype) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    _glu_backward_recomputed,
    _glu_backward_recomputed_fake,
)


# The autograd Functions -------------------------------------------------------------------------------


def _refuse_double_backward() -> None:
    if torch.is_grad_enabled():  # grad mode is on inside a backward only with create_graph=True
        raise RuntimeError(
            "fused_swiglu: create_graph=True (double backward) is not supported: the backward is not "
            "differentiable. Use fused_swiglu.reference for higher-order gradients."
        )


def _saved_tensors(ctx) -> tuple[torch.Tensor, ...]:
    """``ctx.saved_tensors``; eagerly, a second walk, which autograd's own check of the saved tensors
    finds (the backward op marked the saved tensor changed), gets the library's message."""
    if torch.compiler.is_compiling():
        return ctx.saved_tensors
    try:
        saved = ctx.saved_tensors
    except RuntimeError as error:
        # Only after a first walk: anything else changed in place is the caller's, and PyTorch says so.
        if getattr(ctx, "walked", False) and "modified by an inplace operation" in str(error):
            refuse_second_walk()
        raise
    ctx.walked = True
    return saved


def dtype_under_autocast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``torch.autocast`` casts a matmul's input ``t`` to, ``dtype`` the autocast dtype:
    floating tensors other than float64 go to it; anything else, or any ``t`` when ``dtype`` is None
    (outside autocast), keeps its own."""
    castable = dtype is not None and t.is_floating_point() and t.dtype != torch.float64
    return dtype if castable else t.dtype


def cast_for_autocast(t, dtype: torch.dtype | None):
    """``t`` cast as ``dtype_under_autocast`` says (arguments that are not tensors unchanged). Outside
    autocast it returns at once: every eager call passes here three times."""
    if dtype is None or not isinstance(t, torch.Tensor):
        return t
    target = dtype_under_autocast(t, dtype)
    return t if target == t.dtype else t.to(target)


class SwiGLUMLPFunction(torch.autograd.Function):
    """y = down_multiplier * (silu(gate_multiplier * x @ Wg^T) * (x @ Wu^T)) @ Wd^T, weights packed.

    The fused kernels run in the ops; the GEMMs around them (the down projection and the backward's
    weight and input gradients) run here, so that a compiled graph issues them itself.

    Under autocast the weights come in their own dtype and are cast here (``compute_dtype``), so
    that the backward's GEMMs make their gradients in that dtype (``mm_as``): with fp32 weights,
    straight from the fp32 accumulator rather than rounded to 16 bits and cast by autograd after."""

    @staticmethod
    def forward(
        ctx,
        x2d,
        gate_up_weight,
        down_weight,
        gate_multiplier: float,
        down_multiplier: float,
        save,
        compute_dtype,
    ):
        ctx.grad_dtypes = (gate_up_weight.dtype, down_weight.dtype)
        gate_up_weight, down_weight = (
            cast_for_autocast(w, compute_dtype) for w in (gate_up_weight, down_weight)
        )
        a, saved = glu_forward(x2d, gate_up_weight, gate_multiplier, down_multiplier, save, None, None)
        y = torch.mm(a, down_weight.t())  # a carries the down multiplier
        # a is saved for dW_down only (with saved factors): not saved when the down weight is frozen.
        keep_a = save == "factors" and ctx.needs_input_grad[2]
        ctx.save_for_backward(x2d, gate_up_weight, down_weight, saved, a if keep_a else None)
        ctx.scalars = (gate_multiplier, down_multiplier, save)
        return y

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        x2d, gate_up_weight, down_weight, saved, a = _saved_tensors(ctx)
        need_dx, need_dw_gate_up, need_dw_down = ctx.needs_input_grad[:3]
        gate_up_dtype, down_dtype = ctx.grad_dtypes
        gate_multiplier, down_multiplier, save = ctx.scalars
        eager = not torch.compiler.is_compiling()
        if eager and dy.is_cuda:
            bind_cuda_context(dy.device)  # autograd's device thread may have no CUDA context yet
        if save == "recompute":
            needs = (need_dx, need_dw_gate_up, need_dw_down)
            weights = (gate_up_weight, down_weight)
            multipliers = (gate_multiplier, down_multiplier)
            grads = mlp_backward_recomputed(dy, x2d, *weights, *multipliers, *needs, *ctx.grad_dtypes)
            dx, dw_gate_up, dw_down = (g if need else None for g, need in zip(grads, needs, strict=True))
            return dx, dw_gate_up, dw_down, None, None, None, None
        if eager and saved._version:  # refused before a is read (the op refuses it too, compiled)
            refuse_second_walk()
        dw_down = None
        if need_dw_down and save == "factors":
            # dW_down = dY^T @ a first: a's last use, so that it is released before the larger gradients.
            dw_down = mm_as(dy.t(), a, down_dtype)
            if eager:
                # Autograd holds saved tensors until the backward returns: release a now.
                a.untyped_storage().resize_(0)
        del a
        dx = dw_gate_up = None
        if need_dx or need_dw_gate_up or (need_dw_down and save == "preact"):
            grad, recomputed_a = mlp_gradient(dy, down_weight, saved, gate_multiplier, down_multiplier, save)
            if need_dw_down and save == "preact":
                dw_down = mm_as(dy.t(), recomputed_a, down_dtype)
            del recomputed_a
            dx = torch.mm(grad, gate_up_weight) if need_dx else None  # grad: [dU | dG], packed
            dw_gate_up = mm_as(grad.t(), x2d, gate_up_dtype) if need_dw_gate_up else None
        return dx, dw_gate_up, dw_down, None, None, None, None


class SwiGLULinearFunction(torch.autograd.Function):
    """a = silu(gate_multiplier * g) * u from the packed pre-activation [u | g] = x @ W^T (+ u_lr @ v^T,
    a low-rank term, if given): the GLU half alone. The fused kernels run in the ops and the backward's
    GEMMs here, and the weight is cast here under autocast, as in ``SwiGLUMLPFunction``."""

    @staticmethod
    def forward(
        ctx, x2d, gate_up_weight, gate_multiplier: float, save: str, u=None, v=None, compute_dtype=None
    ):
        ctx.dw_dtype = gate_up_weight.dtype
        gate_up_weight = cast_for_autocast(gate_up_weight, compute_dtype)
        a, factors = glu_forward(x2d, gate_up_weight, gate_multiplier, 1.0, save, u, v)
        ctx.save_for_backward(x2d, gate_up_weight, factors, u, v)
        ctx.scalars = (gate_multiplier, save)
        return a

    @staticmethod
    def backward(ctx, da):
        _refuse_double_backward()
        x2d, gate_up_weight, factors, u, v = _saved_tensors(ctx)
        needs = (*ctx.needs_input_grad[:2], *ctx.needs_input_grad[4:6])
        gate_multiplier, save = ctx.scalars
        if save == "recompute":
            grads = glu_backward_recomputed(
                da, x2d, gate_up_weight, u, v, gate_multiplier, *needs, ctx.dw_dtype
            )
        else:
            if not torch.compiler.is_compiling() and factors._version:
                refuse_second_walk()
            low_rank = None if u is None else (u, v)
            grads = glu_grads(glu_gradient(da, factors), x2d, gate_up_weight, needs, ctx.dw_dtype, low_rank)
        dx, dw, du, dv = (g if need else None for g, need in zip(grads, needs, strict=True))
        return dx, dw, None, None, du, dv, None
