"""The fused paths as ``torch.library`` custom ops, so that ``torch.compile`` traces a call as opaque
ops: no graph break, ``fullgraph=True`` works, and ``mode="reduce-overhead"`` captures the kernels
in its CUDA graphs. The fake implementations give the outputs' shapes and dtypes without running
anything.

Inference is one op. Training (``compiled_training="traced"``, opt-in) is a forward op and a
backward op tied by ``register_autograd``. The backward overwrites what the forward kept, in place,
and declares it: in eager mode autograd's version check then refuses a second walk, and a compiled
backward copies the kept tensor before the op mutates it (NOTES.md item 34), so a second walk is
correct there, at the cost of that copy's time and memory. By default training runs eagerly behind a
graph break instead (functional.py), where nothing is copied.
"""

from __future__ import annotations

import torch

from .dispatch import linear_2d, mlp_2d, mlp_train_backward_2d_, mlp_train_forward_2d


@torch.library.custom_op("fused_swiglu::swiglu_mlp_inference", mutates_args=())
def swiglu_mlp_inference(
    x2d: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_multiplier: float,
    down_multiplier: float,
) -> torch.Tensor:
    """The MLP without autograd on validated x [M, H], packed [2I, H] and down [H, I]: [M, H]."""
    with torch.no_grad():
        return mlp_2d(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, "factors")


@swiglu_mlp_inference.register_fake
def _(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier):
    return x2d.new_empty(x2d.shape[0], down_weight.shape[0])


@torch.library.custom_op("fused_swiglu::swiglu_linear_inference", mutates_args=())
def swiglu_linear_inference(
    x2d: torch.Tensor, gate_up_weight: torch.Tensor, gate_multiplier: float
) -> torch.Tensor:
    """The GLU half without autograd on validated x [M, H] and a packed [2I, H] weight: [M, I]."""
    with torch.no_grad():
        return linear_2d(x2d, gate_up_weight, gate_multiplier, "factors")


@swiglu_linear_inference.register_fake
def _(x2d, gate_up_weight, gate_multiplier):
    return x2d.new_empty(x2d.shape[0], gate_up_weight.shape[0] // 2)


@torch.library.custom_op("fused_swiglu::swiglu_mlp_train_forward", mutates_args=())
def swiglu_mlp_train_forward(
    x2d: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_multiplier: float,
    down_multiplier: float,
    save: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MLP's training forward on validated 2-D inputs: y [M, H], the saved packed [M, 2I] tensor
    and ``a`` [M, I]; the last two are empty where the save mode keeps neither (a custom op returns
    tensors only)."""
    y, saved, a = mlp_train_forward_2d(
        x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save
    )
    return y, _or_empty(saved, x2d), _or_empty(a, x2d)


@swiglu_mlp_train_forward.register_fake
def _(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save):
    m, inter = x2d.shape[0], down_weight.shape[1]
    saved = x2d.new_empty(m, 2 * inter) if save != "recompute" else x2d.new_empty(0)
    a = x2d.new_empty(m, inter) if save == "factors" else x2d.new_empty(0)
    return x2d.new_empty(m, down_weight.shape[0]), saved, a


@torch.library.custom_op("fused_swiglu::swiglu_mlp_train_backward", mutates_args=("saved",))
def swiglu_mlp_train_backward(
    dy: torch.Tensor,
    x2d: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    saved: torch.Tensor,
    a: torch.Tensor,
    gate_multiplier: float,
    down_multiplier: float,
    save: str,
    need_dx: bool,
    need_dw_gate_up: bool,
    need_dw_down: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dX, the packed dW_gate_up and dW_down (empty where not needed); overwrites ``saved``."""
    needs = (need_dx, need_dw_gate_up, need_dw_down)
    grads = mlp_train_backward_2d_(
        x2d, gate_up_weight, down_weight, dy, saved if saved.numel() else None, a if a.numel() else None,
        gate_multiplier, down_multiplier, save, needs,
    )  # fmt: skip
    return tuple(_or_empty(g, x2d) for g in grads)


@swiglu_mlp_train_backward.register_fake
def _(dy, x2d, gate_up_weight, down_weight, saved, a, gate_multiplier, down_multiplier, save, *needs):
    shapes = (x2d.shape, gate_up_weight.shape, down_weight.shape)
    return tuple(x2d.new_empty(shape if need else (0,)) for shape, need in zip(shapes, needs, strict=True))


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t


def _setup_training_context(ctx, inputs, output) -> None:
    x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save = inputs
    _, saved, a = output
    ctx.save_for_backward(x2d, gate_up_weight, down_weight, saved, a)
    ctx.scalars = gate_multiplier, down_multiplier, save
    ctx.mark_non_differentiable(saved, a)


def _training_backward(ctx, dy, _saved_grad, _a_grad):
    if torch.is_grad_enabled():
        raise RuntimeError(
            "fused_swiglu: create_graph=True (double backward) is not supported: the backward is not "
            "differentiable. Use fused_swiglu.reference for higher-order gradients."
        )
    needs = ctx.needs_input_grad[:3]
    grads = swiglu_mlp_train_backward(dy, *ctx.saved_tensors, *ctx.scalars, *needs)
    return *(g if need else None for g, need in zip(grads, needs, strict=True)), None, None, None


swiglu_mlp_train_forward.register_autograd(_training_backward, setup_context=_setup_training_context)


def swiglu_mlp_training(
    x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save
) -> torch.Tensor:
    """The traced training call: y of the forward op, whose backward is the backward op."""
    return swiglu_mlp_train_forward(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save)[
        0
    ]
