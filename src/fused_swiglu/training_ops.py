"""Training calls as custom ops (library.py), for ``compiled_training="traced"`` (opt-in): under
``torch.compile`` a training call is traced into the graph as a forward op and a backward op tied by
``register_autograd``, with no graph break, so ``fullgraph=True`` works.

The backward op overwrites what the forward kept with the packed gradient, as the eager backward does,
yet declares no mutation: declared, the compiler copies the kept tensor first (torch 2.11), or where it
hands the op the tensor autograd saved (a donated buffer) a retained graph walked twice came out wrong
without a refusal (torch 2.13, NOTES.md item 48). Undeclared, the overwrite is made safe by a ledger
(single_use.py): the forward op issues its kept storage, the backward op overwrites it only if issued
and unspent, refuses a second walk, and gives a copy made by saved-tensor hooks a gradient buffer of
its own. The op does not release ``a`` (``"factors"``) the way the eager backward does: ``a`` is an
output the compiler sees, and anything reading it after a release would read freed memory. Instead
dW_down, ``a``'s last use, is made before the op, so the compiled backward drops ``a`` itself before
the op allocates the two largest gradients (NOTES.md item 53). By default training runs eagerly
behind a graph break instead (functional.py).

Custom ops return tensors only, so what a save mode does not keep is returned as an empty tensor.

torch.compile's caches are keyed by the forward graph and do not notice a changed registered backward
formula of a custom op (pytorch/pytorch#144344): after an upgrade that changed one, a cached compile
would run the old backward. So every forward op takes ``REVISION``, a fingerprint of this file (which
holds every registered backward formula and every schema), as an argument it ignores: it is a
constant of the traced graph, so a changed formula gets a fresh compile.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from . import single_use
from .autograd import refuse_double_backward, refuse_second_walk
from .dispatch import (
    linear_train_backward_2d,
    linear_train_forward_2d,
    mlp_train_backward_2d,
    mlp_train_forward_2d,
)
from .library import define, register_autograd

#: Fingerprint of this file, passed to the forward ops (see the module docstring).
REVISION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _or_empty(t, like):
    return like.new_empty(0) if t is None else t


def _or_none(t):
    return t if t is not None and t.numel() else None


def _issue(kept):
    """``kept``, issued to the backward op to overwrite once (nothing to issue where it is empty)."""
    if kept.numel():
        single_use.issue(kept)
    return kept


def _spend(kept) -> bool:
    """Whether the backward op may overwrite ``kept``: the forward op's own, not walked before. Refuses
    a second walk; a tensor the forward did not make (e.g. a saved-tensor hook's copy) is read only."""
    if not kept.numel():
        return False
    ticket = single_use.spend(kept)
    if ticket is single_use.Ticket.SPENT:
        refuse_second_walk()
    return ticket is single_use.Ticket.UNSPENT


# The MLP ---------------------------------------------------------------------------------------------


def _mlp_forward(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save, revision):
    """y [M, H], the saved packed [M, 2I] tensor and ``a`` [M, I] (the last two empty where the save
    mode keeps neither), on validated 2-D inputs."""
    scalars = (gate_multiplier, down_multiplier, save)
    y, saved, a = mlp_train_forward_2d(x2d, gate_up_weight, down_weight, *scalars)
    return y, _issue(_or_empty(saved, x2d)), _or_empty(a, x2d)


def _mlp_forward_fake(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save, revision):
    m, inter = x2d.shape[0], down_weight.shape[1]
    saved = x2d.new_empty(m, 2 * inter) if save != "recompute" else x2d.new_empty(0)
    a = x2d.new_empty(m, inter) if save == "factors" else x2d.new_empty(0)
    return x2d.new_empty(m, down_weight.shape[0]), saved, a


swiglu_mlp_train_forward = define(
    "swiglu_mlp_train_forward(Tensor x2d, Tensor gate_up_weight, Tensor down_weight, float gate_multiplier, "
    "float down_multiplier, str save, str revision) -> (Tensor, Tensor, Tensor)",
    _mlp_forward,
    _mlp_forward_fake,
)


def _mlp_backward_op(
    dy, x2d, gate_up_weight, down_weight, saved, a, after, gate_multiplier, down_multiplier, save, *needs
):
    """dX, the packed dW_gate_up and dW_down (empty where not needed); overwrites ``saved`` where the
    ledger allows it. ``after`` is not read: it is what the op must run after (see ``_mlp_backward``)."""
    weights = (gate_up_weight, down_weight)
    scalars = (gate_multiplier, down_multiplier, save, needs)
    kept = (_or_none(saved), _or_none(a))
    grads = mlp_train_backward_2d(x2d, *weights, dy, *kept, *scalars, in_place=_spend(saved))
    return tuple(_or_empty(g, x2d) for g in grads)


def _mlp_backward_fake(
    dy, x2d, gate_up_weight, down_weight, saved, a, after, gate_multiplier, down_multiplier, save, *needs
):
    shapes = (x2d.shape, gate_up_weight.shape, down_weight.shape)
    return tuple(x2d.new_empty(shape if need else (0,)) for shape, need in zip(shapes, needs, strict=True))


swiglu_mlp_train_backward = define(
    "swiglu_mlp_train_backward(Tensor dy, Tensor x2d, Tensor gate_up_weight, Tensor down_weight, "
    "Tensor saved, Tensor? a, Tensor? after, float gate_multiplier, float down_multiplier, str save, "
    "bool need_dx, bool need_dw_gate_up, bool need_dw_down) -> (Tensor, Tensor, Tensor)",
    _mlp_backward_op,
    _mlp_backward_fake,
)


def _setup_mlp(ctx, inputs, output) -> None:
    x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save, _revision = inputs
    _, saved, a = output
    ctx.save_for_backward(x2d, gate_up_weight, down_weight, saved, a)
    ctx.scalars = gate_multiplier, down_multiplier, save
    ctx.mark_non_differentiable(saved, a)


def _mlp_backward(ctx, dy, _saved_grad, _a_grad):
    refuse_double_backward()
    x2d, gate_up_weight, down_weight, saved, a = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    dw_down = None
    if needs[2] and a.numel():
        # dW_down first, as the eager backward makes it: the last use of ``a``, so the compiled backward
        # drops ``a`` here, before the backward op allocates the two largest gradients. The op takes
        # dW_down as ``after`` only so that the compiler cannot run this GEMM after it. (None, not an
        # empty tensor, stands for what is not passed: a tensor made here would be traced into the graph.)
        dw_down = torch.mm(dy.t(), a)
        a, needs = None, (*needs[:2], False)
    weights = (gate_up_weight, down_weight)
    grads = swiglu_mlp_train_backward(dy, x2d, *weights, saved, a, dw_down, *ctx.scalars, *needs)
    dx, dw_gate_up, op_dw_down = (g if need else None for g, need in zip(grads, needs, strict=True))
    return dx, dw_gate_up, op_dw_down if dw_down is None else dw_down, None, None, None, None


register_autograd(swiglu_mlp_train_forward, _mlp_backward, _setup_mlp)


def swiglu_mlp_training(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save):
    """The traced MLP training call: y of the forward op, whose backward is the backward op."""
    scalars = (gate_multiplier, down_multiplier, save)
    return swiglu_mlp_train_forward(x2d, gate_up_weight, down_weight, *scalars, REVISION)[0]


# The GLU operator ------------------------------------------------------------------------------------


def _linear_forward(x2d, gate_up_weight, gate_multiplier, save, revision):
    """``a`` [M, I] and the saved factors [M, 2I] (empty for ``"recompute"``), on validated inputs."""
    a, factors = linear_train_forward_2d(x2d, gate_up_weight, gate_multiplier, save)
    return a, _issue(_or_empty(factors, x2d))


def _linear_forward_fake(x2d, gate_up_weight, gate_multiplier, save, revision):
    m, two_inter = x2d.shape[0], gate_up_weight.shape[0]
    factors = x2d.new_empty(m, two_inter) if save != "recompute" else x2d.new_empty(0)
    return x2d.new_empty(m, two_inter // 2), factors


swiglu_linear_train_forward = define(
    "swiglu_linear_train_forward(Tensor x2d, Tensor gate_up_weight, float gate_multiplier, str save, "
    "str revision) -> (Tensor, Tensor)",
    _linear_forward,
    _linear_forward_fake,
)


def _linear_backward_op(da, x2d, gate_up_weight, factors, gate_multiplier, save, need_dx, need_dw):
    """dX and the packed dW_gate_up (empty where not needed); overwrites ``factors`` where the ledger
    allows it."""
    scalars = (gate_multiplier, save, (need_dx, need_dw))
    in_place = _spend(factors)
    grads = linear_train_backward_2d(x2d, gate_up_weight, da, _or_none(factors), *scalars, in_place=in_place)
    return tuple(_or_empty(g, x2d) for g in grads)


def _linear_backward_fake(da, x2d, gate_up_weight, factors, gate_multiplier, save, need_dx, need_dw):
    return x2d.new_empty(x2d.shape if need_dx else (0,)), x2d.new_empty(
        gate_up_weight.shape if need_dw else (0,)
    )


swiglu_linear_train_backward = define(
    "swiglu_linear_train_backward(Tensor da, Tensor x2d, Tensor gate_up_weight, Tensor factors, "
    "float gate_multiplier, str save, bool need_dx, bool need_dw) -> (Tensor, Tensor)",
    _linear_backward_op,
    _linear_backward_fake,
)


def _setup_linear(ctx, inputs, output) -> None:
    x2d, gate_up_weight, gate_multiplier, save, _revision = inputs
    _, factors = output
    ctx.save_for_backward(x2d, gate_up_weight, factors)
    ctx.scalars = gate_multiplier, save
    ctx.mark_non_differentiable(factors)


def _linear_backward(ctx, da, _factors_grad):
    refuse_double_backward()
    needs = ctx.needs_input_grad[:2]
    grads = swiglu_linear_train_backward(da, *ctx.saved_tensors, *ctx.scalars, *needs)
    return *(g if need else None for g, need in zip(grads, needs, strict=True)), None, None, None


register_autograd(swiglu_linear_train_forward, _linear_backward, _setup_linear)


def swiglu_linear_training(x2d, gate_up_weight, gate_multiplier, save):
    """The traced GLU training call: ``a`` of the forward op, whose backward is the backward op."""
    return swiglu_linear_train_forward(x2d, gate_up_weight, gate_multiplier, save, REVISION)[0]
