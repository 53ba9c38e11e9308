"""The custom ops of the fused operators (``fused_swiglu::``, library.py): every fused call, eager or
under ``torch.compile``, runs through them. The compiler sees each op as one opaque call with a fake
implementation (shapes only), so a model that calls the library compiles to one graph, and its
compiled code calls the op without running any of the library's Python above it.

Per operator there are three ops: inference (nothing kept), the training forward (returns what it
keeps as outputs, empty where the save mode keeps none) and the training backward, which the
autograd Functions (autograd.py) call.

The backward overwrites the tensor the forward kept with the packed pre-activation gradient, without
declaring it: declared, the compiler copies the kept tensor first (time and memory the overwrite is
there to save). Nothing else reads that tensor after the backward op, and ``_overwrite_once`` makes
the overwrite happen at most once.
"""

from __future__ import annotations

import functools

import torch

from .kernels.common import Saved, tma_ready
from .library import define
from .passes import (
    KEPT,
    linear_backward_,
    linear_forward,
    mlp_backward_,
    mlp_forward,
    swiglu_linear_no_grad,
    swiglu_mlp_no_grad,
)


def refuse_second_walk() -> None:
    """Raise in a backward whose kept activations an earlier walk of the graph overwrote."""
    raise RuntimeError(
        "fused_swiglu: this graph was already walked backward once. Its saved activations were "
        "overwritten in place by that backward, so a second backward (retain_graph=True) would be "
        "wrong. Run the forward again, or use save='recompute', which keeps nothing to overwrite."
    )


def _overwrite_once(kept: torch.Tensor) -> None:
    """Mark ``kept`` as overwritten, refusing if it already was.

    The forward op makes ``kept`` new, at version 0; the backward marks it changed. A second walk of a
    retained graph hands the backward the same tensor (autograd's own check of saved tensors usually
    refuses it first). A saved-tensor hook's copy (``save_on_cpu``) is made anew for every walk, and
    overwriting it loses nothing.
    """
    if kept._version:
        refuse_second_walk()
    torch.autograd.graph.increment_version(kept)


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
    """x [M, H], packed [2I, H], down [H, I] -> y [M, H]; nothing kept."""
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
    """y [M, H], the kept packed [M, 2I] tensor and ``a`` [M, I] (each empty where ``save`` keeps none)."""
    scales = {"gate_scale": gate_multiplier, "out_scale": down_multiplier}
    args = (tma_ready(x2d), tma_ready(gate_up_weight), tma_ready(down_weight))
    y, kept, a = mlp_forward(*args, KEPT[save], scales, ("mlp", *_signature(*args)))
    return y, _empty_if_none(kept, x2d), _empty_if_none(a, x2d)


def _mlp_forward_fake(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save):
    m, inter = x2d.shape[0], down_weight.shape[1]
    kept = x2d.new_empty(m, 2 * inter) if save != "recompute" else x2d.new_empty(0)
    a = x2d.new_empty(m, inter) if save == "factors" else x2d.new_empty(0)
    return x2d.new_empty(m, down_weight.shape[0]), kept, a


swiglu_mlp_forward = define(
    "swiglu_mlp_forward(Tensor x2d, Tensor gate_up_weight, Tensor down_weight, float gate_multiplier, "
    "float down_multiplier, str save) -> (Tensor, Tensor, Tensor)",
    _mlp_forward,
    _mlp_forward_fake,
)


@_on_tensor_device
def _mlp_backward(
    dy, x2d, gate_up_weight, down_weight, kept, after, gate_multiplier, down_multiplier, save, *needs
):
    """dX, the packed dW_gate_up and dW_down (empty where not needed); overwrites ``kept``. ``after``
    is not read: it is what the op must run after (autograd.py)."""
    if KEPT[save] != Saved.NOTHING:
        _overwrite_once(kept)
    scales = {"gate_scale": gate_multiplier, "out_scale": down_multiplier}
    args = (tma_ready(dy), tma_ready(x2d), tma_ready(gate_up_weight), tma_ready(down_weight), kept)
    grads = mlp_backward_(*args, KEPT[save], scales, needs, ("mlp", *_signature(*args)))
    return tuple(_empty_if_none(g, x2d) for g in grads)


def _mlp_backward_fake(
    dy, x2d, gate_up_weight, down_weight, kept, after, gate_multiplier, down_multiplier, save, *needs
):
    shapes = (x2d.shape, gate_up_weight.shape, down_weight.shape)
    return tuple(x2d.new_empty(shape if need else (0,)) for shape, need in zip(shapes, needs, strict=True))


swiglu_mlp_backward = define(
    "swiglu_mlp_backward(Tensor dy, Tensor x2d, Tensor gate_up_weight, Tensor down_weight, Tensor kept, "
    "Tensor? after, float gate_multiplier, float down_multiplier, str save, bool need_dx, "
    "bool need_dw_gate_up, bool need_dw_down) -> (Tensor, Tensor, Tensor)",
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
    """x [M, H], packed [2I, H] -> a [M, I]; nothing kept."""
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
    """``a`` [M, I] and the kept factors [M, 2I] (empty for ``"recompute"``)."""
    args = (tma_ready(x2d), tma_ready(gate_up_weight))
    low_rank = _low_rank(u, v)
    key = ("glu", *_signature(*args, *(low_rank or ())))
    a, factors = linear_forward(*args, gate_multiplier, KEPT[save], key, low_rank)
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
def _linear_backward(da, x2d, gate_up_weight, factors, u, v, gate_multiplier, save, *needs):
    """dX, the packed dW_gate_up, dU and dV (empty where not needed); overwrites ``factors``."""
    if KEPT[save] != Saved.NOTHING:
        _overwrite_once(factors)
    args = (da.contiguous(), tma_ready(x2d), tma_ready(gate_up_weight), factors)
    low_rank = _low_rank(u, v)
    key = ("glu", *_signature(*args, *(low_rank or ())))
    grads = linear_backward_(*args, KEPT[save], gate_multiplier, needs, key, low_rank)
    return tuple(_empty_if_none(g, x2d) for g in grads)


def _linear_backward_fake(da, x2d, gate_up_weight, factors, u, v, gate_multiplier, save, *needs):
    shapes = (x2d.shape, gate_up_weight.shape, None if u is None else u.shape, None if v is None else v.shape)
    return tuple(
        x2d.new_empty(shape if need and shape is not None else (0,))
        for shape, need in zip(shapes, needs, strict=True)
    )


swiglu_linear_backward = define(
    "swiglu_linear_backward(Tensor da, Tensor x2d, Tensor gate_up_weight, Tensor factors, Tensor? u, "
    "Tensor? v, float gate_multiplier, str save, bool need_dx, bool need_dw, bool need_du, bool need_dv) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    _linear_backward,
    _linear_backward_fake,
)
