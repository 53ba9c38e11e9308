"""The fused operators as a graph sees them: custom ops (``fused_swiglu::``, library.py) and the
autograd Functions around them. Every fused call, eager or under ``torch.compile``, runs through
them. The compiler sees each op as one opaque call with a fake implementation (shapes only) and
traces the Functions' forward and backward into the graph, so a model that calls the library
compiles to one graph whose code calls the ops without the library's Python above them.

Per operator there are three ops: inference (nothing saved), the training forward (returns what it
saves as outputs, empty where the save mode saves nothing) and the training backward, which the
Functions call; passes.py says what each save mode saves.

The backward overwrites the tensor the forward saved with the packed pre-activation gradient, without
declaring it: declared, the compiler copies the saved tensor first (time and memory the overwrite is
there to save). Nothing else reads that tensor after the backward op, and ``_overwrite_once`` makes
the overwrite happen at most once; a graph can be walked backward once, and ``create_graph=True``
(double backward) is refused.
"""

from __future__ import annotations

import functools

import torch

from .kernels.common import Saved, bind_cuda_context, tma_ready
from .library import define
from .passes import (
    linear_backward_,
    linear_forward,
    mlp_backward_,
    mlp_forward,
    mm_as,
    swiglu_linear_no_grad,
    swiglu_mlp_no_grad,
)


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


def _signature(*tensors: torch.Tensor) -> tuple:
    """What the kernels' launches specialize on in these inputs (KernelLauncher's ``caller_key``): the
    launches' other tensors are new, made from these shapes, and 16-byte aligned."""
    return tuple((t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in tensors)


def _empty_if_none(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    # Custom ops return tensors only: what a save mode does not keep is an empty tensor.
    return like.new_empty(0) if t is None else t


# The MLP ---------------------------------------------------------------------------------------------


@_on_tensor_device
def _mlp_inference(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier):
    """x [M, H], packed [2I, H], down [H, I] -> y [M, H]; nothing saved."""
    args = (tma_ready(x2d), tma_ready(gate_up_weight), tma_ready(down_weight))
    return swiglu_mlp_no_grad(*args, gate_multiplier, down_multiplier, ("mlp", *_signature(*args)))


def _mlp_inference_fake(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier):
    return x2d.new_empty(x2d.shape[0], down_weight.shape[0])


swiglu_mlp_inference = define(
    "swiglu_mlp_inference(Tensor x2d, Tensor gate_up_weight, Tensor down_weight, float gate_multiplier, "
    "float down_multiplier) -> Tensor",
    _mlp_inference,
    _mlp_inference_fake,
)


@_on_tensor_device
def _mlp_forward(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save):
    """y [M, H], the saved packed [M, 2I] tensor and ``a`` [M, I] (each empty where ``save`` keeps none)."""
    multipliers = {"gate_multiplier": gate_multiplier, "down_multiplier": down_multiplier}
    args = (tma_ready(x2d), tma_ready(gate_up_weight), tma_ready(down_weight))
    y, saved, a = mlp_forward(*args, Saved.of(save), multipliers, ("mlp", *_signature(*args)))
    return y, _empty_if_none(saved, x2d), _empty_if_none(a, x2d)


def _mlp_forward_fake(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save):
    m, inter = x2d.shape[0], down_weight.shape[1]
    saved = x2d.new_empty(m, 2 * inter) if save != "recompute" else x2d.new_empty(0)
    a = x2d.new_empty(m, inter) if save == "factors" else x2d.new_empty(0)
    return x2d.new_empty(m, down_weight.shape[0]), saved, a


swiglu_mlp_forward = define(
    "swiglu_mlp_forward(Tensor x2d, Tensor gate_up_weight, Tensor down_weight, float gate_multiplier, "
    "float down_multiplier, str save) -> (Tensor, Tensor, Tensor)",
    _mlp_forward,
    _mlp_forward_fake,
)


@_on_tensor_device
def _mlp_backward(
    dy,
    x2d,
    gate_up_weight,
    down_weight,
    saved,
    after,
    gate_multiplier,
    down_multiplier,
    save,
    *needs_and_dtypes,
):
    """dX, the packed dW_gate_up and dW_down (empty where not needed; the weights' gradients in the
    dtypes given); overwrites ``saved``. ``after`` is not read: it is what the op must run after
    (``SwiGLUMLPFunction.backward``)."""
    needs, grad_dtypes = needs_and_dtypes[:3], needs_and_dtypes[3:]
    kind = Saved.of(save)
    if kind != Saved.NOTHING:
        _overwrite_once(saved)
    multipliers = {"gate_multiplier": gate_multiplier, "down_multiplier": down_multiplier}
    args = (tma_ready(dy), tma_ready(x2d), tma_ready(gate_up_weight), tma_ready(down_weight), saved)
    grads = mlp_backward_(*args, kind, multipliers, needs, grad_dtypes, ("mlp", *_signature(*args)))
    return tuple(_empty_if_none(g, x2d) for g in grads)


def _mlp_backward_fake(
    dy,
    x2d,
    gate_up_weight,
    down_weight,
    saved,
    after,
    gate_multiplier,
    down_multiplier,
    save,
    *needs_and_dtypes,
):
    needs, (gate_up_dtype, down_dtype) = needs_and_dtypes[:3], needs_and_dtypes[3:]
    shapes = (x2d.shape, gate_up_weight.shape, down_weight.shape)
    dtypes = (x2d.dtype, gate_up_dtype, down_dtype)
    return tuple(
        x2d.new_empty(shape, dtype=dtype) if need else x2d.new_empty(0)
        for shape, need, dtype in zip(shapes, needs, dtypes, strict=True)
    )


swiglu_mlp_backward = define(
    "swiglu_mlp_backward(Tensor dy, Tensor x2d, Tensor gate_up_weight, Tensor down_weight, Tensor saved, "
    "Tensor? after, float gate_multiplier, float down_multiplier, str save, bool need_dx, "
    "bool need_dw_gate_up, bool need_dw_down, ScalarType dw_gate_up_dtype, ScalarType dw_down_dtype) "
    "-> (Tensor, Tensor, Tensor)",
    _mlp_backward,
    _mlp_backward_fake,
)


# The GLU operator ------------------------------------------------------------------------------------
# ``u`` [M, R] and ``v`` [2I, R]: an optional low-rank term u @ v^T of the packed pre-activation (LoRA
# adapters on gate and up), R a multiple of 16; both given or neither.


def _low_rank(u, v) -> tuple[torch.Tensor, torch.Tensor] | None:
    return None if u is None else (tma_ready(u), tma_ready(v))


@_on_tensor_device
def _linear_inference(x2d, gate_up_weight, gate_multiplier, u, v):
    """x [M, H], packed [2I, H] -> a [M, I]; nothing saved."""
    args = (tma_ready(x2d), tma_ready(gate_up_weight))
    low_rank = _low_rank(u, v)
    key = ("glu", *_signature(*args, *(low_rank or ())))
    return swiglu_linear_no_grad(*args, gate_multiplier, key, low_rank)


def _linear_inference_fake(x2d, gate_up_weight, gate_multiplier, u, v):
    return x2d.new_empty(x2d.shape[0], gate_up_weight.shape[0] // 2)


swiglu_linear_inference = define(
    "swiglu_linear_inference(Tensor x2d, Tensor gate_up_weight, float gate_multiplier, Tensor? u, "
    "Tensor? v) -> Tensor",
    _linear_inference,
    _linear_inference_fake,
)


@_on_tensor_device
def _linear_forward(x2d, gate_up_weight, gate_multiplier, save, u, v):
    """``a`` [M, I] and the saved factors [M, 2I] (empty for ``"recompute"``)."""
    args = (tma_ready(x2d), tma_ready(gate_up_weight))
    low_rank = _low_rank(u, v)
    key = ("glu", *_signature(*args, *(low_rank or ())))
    a, factors = linear_forward(*args, gate_multiplier, Saved.of(save), key, low_rank)
    return a, _empty_if_none(factors, x2d)


def _linear_forward_fake(x2d, gate_up_weight, gate_multiplier, save, u, v):
    m, two_inter = x2d.shape[0], gate_up_weight.shape[0]
    factors = x2d.new_empty(m, two_inter) if save != "recompute" else x2d.new_empty(0)
    return x2d.new_empty(m, two_inter // 2), factors


swiglu_linear_forward = define(
    "swiglu_linear_forward(Tensor x2d, Tensor gate_up_weight, float gate_multiplier, str save, Tensor? u, "
    "Tensor? v) -> (Tensor, Tensor)",
    _linear_forward,
    _linear_forward_fake,
)


@_on_tensor_device
def _linear_backward(da, x2d, gate_up_weight, factors, u, v, gate_multiplier, save, *needs_and_dtype):
    """dX, the packed dW_gate_up (in the dtype given), dU and dV (empty where not needed); overwrites
    ``factors``."""
    needs, dw_dtype = needs_and_dtype[:4], needs_and_dtype[4]
    kind = Saved.of(save)
    if kind != Saved.NOTHING:
        _overwrite_once(factors)
    args = (da.contiguous(), tma_ready(x2d), tma_ready(gate_up_weight), factors)
    low_rank = _low_rank(u, v)
    key = ("glu", *_signature(*args, *(low_rank or ())))
    grads = linear_backward_(*args, kind, gate_multiplier, needs, dw_dtype, key, low_rank)
    return tuple(_empty_if_none(g, x2d) for g in grads)


def _linear_backward_fake(da, x2d, gate_up_weight, factors, u, v, gate_multiplier, save, *needs_and_dtype):
    needs, dw_dtype = needs_and_dtype[:4], needs_and_dtype[4]
    shapes = (x2d.shape, gate_up_weight.shape, None if u is None else u.shape, None if v is None else v.shape)
    dtypes = (x2d.dtype, dw_dtype, x2d.dtype, x2d.dtype)
    return tuple(
        x2d.new_empty(shape, dtype=dtype) if need and shape is not None else x2d.new_empty(0)
        for shape, need, dtype in zip(shapes, needs, dtypes, strict=True)
    )


swiglu_linear_backward = define(
    "swiglu_linear_backward(Tensor da, Tensor x2d, Tensor gate_up_weight, Tensor factors, Tensor? u, "
    "Tensor? v, float gate_multiplier, str save, bool need_dx, bool need_dw, bool need_du, bool need_dv, "
    "ScalarType dw_dtype) -> (Tensor, Tensor, Tensor, Tensor)",
    _linear_backward,
    _linear_backward_fake,
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
        scalars = (gate_multiplier, down_multiplier, save)
        y, saved, a = swiglu_mlp_forward(x2d, gate_up_weight, down_weight, *scalars)
        # a is saved for dW_down only (with saved factors): not saved when the down weight is frozen.
        ctx.save_for_backward(x2d, gate_up_weight, down_weight, saved, a if ctx.needs_input_grad[2] else None)
        ctx.scalars = scalars
        return y

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        x2d, gate_up_weight, down_weight, saved, a = _saved_tensors(ctx)
        need_dx, need_dw_gate_up, need_dw_down = ctx.needs_input_grad[:3]
        eager = not torch.compiler.is_compiling()
        if eager and saved._version:  # refused before a is read (the op refuses it too, compiled)
            refuse_second_walk()
        if eager and dy.is_cuda:
            bind_cuda_context(dy.device)  # autograd's device thread may have no CUDA context yet
        dw_down = None
        if need_dw_down and ctx.scalars[2] == "factors":
            # dW_down = dY^T @ a (a carries the down multiplier) first: a's last use, so a compiled
            # backward drops a before the backward op allocates the two largest gradients. The op
            # takes dW_down as `after` so that the compiler cannot move this GEMM past it.
            dw_down = mm_as(dy.t(), a, ctx.grad_dtypes[1])
            if eager:
                # Autograd holds saved tensors until the backward returns: release a now.
                a.untyped_storage().resize_(0)
        del a
        needs = (need_dx, need_dw_gate_up, need_dw_down and dw_down is None)
        weights = (gate_up_weight, down_weight)
        grads = swiglu_mlp_backward(dy, x2d, *weights, saved, dw_down, *ctx.scalars, *needs, *ctx.grad_dtypes)
        dx, dw_gate_up, op_dw_down = (g if need else None for g, need in zip(grads, needs, strict=True))
        return dx, dw_gate_up, op_dw_down if dw_down is None else dw_down, None, None, None, None


class SwiGLULinearFunction(torch.autograd.Function):
    """a = silu(gate_multiplier * g) * u from the packed pre-activation [u | g] = x @ W^T (+ u_lr @ v^T,
    a low-rank term, if given): the GLU half alone. The weight is cast here under autocast, as in
    ``SwiGLUMLPFunction``."""

    @staticmethod
    def forward(
        ctx, x2d, gate_up_weight, gate_multiplier: float, save: str, u=None, v=None, compute_dtype=None
    ):
        ctx.dw_dtype = gate_up_weight.dtype
        gate_up_weight = cast_for_autocast(gate_up_weight, compute_dtype)
        a, factors = swiglu_linear_forward(x2d, gate_up_weight, gate_multiplier, save, u, v)
        ctx.save_for_backward(x2d, gate_up_weight, factors, u, v)
        ctx.scalars = (gate_multiplier, save)
        return a

    @staticmethod
    def backward(ctx, da):
        _refuse_double_backward()
        needs = (*ctx.needs_input_grad[:2], *ctx.needs_input_grad[4:6])
        grads = swiglu_linear_backward(da, *_saved_tensors(ctx), *ctx.scalars, *needs, ctx.dw_dtype)
        dx, dw, du, dv = (g if need else None for g, need in zip(grads, needs, strict=True))
        return dx, dw, None, None, du, dv, None
