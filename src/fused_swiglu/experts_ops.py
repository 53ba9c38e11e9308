"""The custom ops of the routed experts' GLU half (``fused_swiglu::``, as ops.py for the dense MLP): x's
rows grouped by expert (routing.py) times every expert's packed gate/up weight, the SwiGLU in the
forward kernel's epilogue.

* forward: the forward kernel with a table of row tiles, each of one expert (routing.py); keeps the
  factors (``"factors"``) or nothing (``"recompute"``, where the backward runs the forward kernel
  again);
* backward: the SwiGLU gradient over the saved factors in place (kernels/glu_grad.py), then dX and
  the packed dW as grouped GEMMs (``torch._grouped_mm``) over the experts' groups of rows.

One row per routed slot, grouped by expert with no padding, so every row is written and read.
"""

from __future__ import annotations

import functools
import itertools

import torch

from .kernels.common import Saved, tma_ready
from .kernels.glu_forward import glu_forward
from .kernels.glu_grad import glu_grad_
from .kernels.row_dot import row_dot as _row_dot_kernel
from .library import define, register_autograd
from .ops import _empty_if_none, _on_tensor_device, _overwrite_once
from .support import kernels_run_on

EXPERTS_SAVE_MODES = ("factors", "recompute")


def _grouped_mm(a, b, ends):
    """Per expert ``e``, rows ``[ends[e-1], ends[e])``: ``a`` [P, K] @ ``b[e]`` [K, N] -> [P, N], or
    ``a`` [M, P] @ ``b`` [P, N] over those rows -> [E, M, N]. ``torch._grouped_mm`` for bf16 on a GPU
    (the dtype it takes; Hopper and newer); otherwise expert by expert, which waits for the GPU to
    read ``ends``."""
    if a.is_cuda and a.dtype == torch.bfloat16 and _grouped_gemm_hardware(a.device.index):
        return torch._grouped_mm(a, b, offs=ends)
    bounds = [0, *ends.tolist()]
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            torch.mm(a[lo:hi], b[e], out=out[lo:hi])
        return out
    out = a.new_empty(len(bounds) - 1, a.shape[0], b.shape[1])
    for e, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        torch.mm(a[:, lo:hi], b[lo:hi], out=out[e])
    return out


def _grouped_mm_fake(a, b, ends):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(ends.shape[0], a.shape[0], b.shape[1])


#: The grouped GEMMs of the routed experts, an op of its own so that the compiler takes every dtype.
grouped_mm = define("grouped_mm(Tensor a, Tensor b, Tensor ends) -> Tensor", _grouped_mm, _grouped_mm_fake)


@functools.cache
def _grouped_gemm_hardware(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _grouped_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad):
    """The gradients of ``a`` [P, K] @ ``b[e]`` (the form the unfused experts differentiate)."""
    a, b, ends = ctx.saved_tensors
    if b.dim() != 3:
        raise RuntimeError("fused_swiglu::grouped_mm is differentiable in its [P, K] x [E, K, N] form only")
    grad = grad.contiguous()
    da = grouped_mm(grad, b.transpose(1, 2), ends) if ctx.needs_input_grad[0] else None
    db = grouped_mm(a.t(), grad, ends) if ctx.needs_input_grad[1] else None
    return da, db, None


register_autograd(grouped_mm, _grouped_mm_backward, _grouped_mm_setup)


@_on_tensor_device
def _row_dot(a, b):
    """Row-wise ``(a * b).sum(-1)`` of [P, N] tensors, accumulated in fp32 or wider: the kernel where
    the fused kernels run, else in PyTorch on copies in fp32 (float64 stays float64)."""
    if kernels_run_on(a.dtype, a.device):
        return _row_dot_kernel(a.contiguous(), b.contiguous())
    wide = torch.promote_types(a.dtype, torch.float32)
    return torch.linalg.vecdot(a.to(wide), b.to(wide))


def _row_dot_fake(a, b):
    return a.new_empty(a.shape[0], dtype=torch.promote_types(a.dtype, torch.float32))


#: The routing weights' gradient (experts.py): an op of its own, so that the compiler calls the kernel.
row_dot = define("row_dot(Tensor a, Tensor b) -> Tensor", _row_dot, _row_dot_fake)


def _forward(x_rows, gate_up_weight, tiles, used_tiles, save: Saved, write_a: bool = True):
    """The forward kernel over every expert's rows (experts carry no multipliers)."""
    experts = (tiles, used_tiles, gate_up_weight.shape[0])
    options = {
        "save": save,
        "write_a": write_a,
        "experts": experts,
        "gate_multiplier": 1.0,
        "down_multiplier": 1.0,
    }
    return glu_forward(x_rows, gate_up_weight, **options)


@_on_tensor_device
def _experts_glu_forward(x_rows, gate_up_weight, tiles, used_tiles, save):
    """``a`` [P, I] and the saved factors [P, 2I] (empty for ``"recompute"``)."""
    x_rows, gate_up_weight = tma_ready(x_rows), gate_up_weight.contiguous()
    a, saved = _forward(x_rows, gate_up_weight, tiles, used_tiles, Saved.of(save))
    return a, _empty_if_none(saved, x_rows)


def _experts_glu_forward_fake(x_rows, gate_up_weight, tiles, used_tiles, save):
    rows, two_inter = x_rows.shape[0], gate_up_weight.shape[1]
    saved = x_rows.new_empty(rows, two_inter) if save == "factors" else x_rows.new_empty(0)
    return x_rows.new_empty(rows, two_inter // 2), saved


experts_glu_forward = define(
    "experts_glu_forward(Tensor x_rows, Tensor gate_up_weight, Tensor tiles, Tensor used_tiles, "
    "str save) -> (Tensor, Tensor)",
    _experts_glu_forward,
    _experts_glu_forward_fake,
)


@_on_tensor_device
def _experts_glu_backward(da, x_rows, gate_up_weight, saved, tiles, used_tiles, ends, save, need_dx, need_dw):
    """dX [P, H] and the packed dW [E, 2I, H] (empty where not needed); overwrites ``saved``."""
    x_rows, gate_up_weight = tma_ready(x_rows), gate_up_weight.contiguous()
    if Saved.of(save) == Saved.NOTHING:
        _, saved = _forward(x_rows, gate_up_weight, tiles, used_tiles, Saved.FACTORS, write_a=False)
    else:
        _overwrite_once(saved)
    grad = glu_grad_(da.contiguous(), saved)  # [dU | dG] per row, packed, over the factors
    dx = grouped_mm(grad, gate_up_weight, ends) if need_dx else None
    dw = grouped_mm(grad.t(), x_rows, ends) if need_dw else None
    return _empty_if_none(dx, x_rows), _empty_if_none(dw, x_rows)


def _experts_glu_backward_fake(
    da, x_rows, gate_up_weight, saved, tiles, used_tiles, ends, save, need_dx, need_dw
):
    dx = x_rows.new_empty(x_rows.shape if need_dx else (0,))
    return dx, x_rows.new_empty(gate_up_weight.shape if need_dw else (0,))


experts_glu_backward = define(
    "experts_glu_backward(Tensor da, Tensor x_rows, Tensor gate_up_weight, Tensor saved, "
    "Tensor tiles, Tensor used_tiles, Tensor ends, str save, bool need_dx, bool need_dw) "
    "-> (Tensor, Tensor)",
    _experts_glu_backward,
    _experts_glu_backward_fake,
)


@_on_tensor_device
def _experts_glu_inference(x_rows, gate_up_weight, tiles, used_tiles):
    a, _ = _experts_glu_forward(x_rows, gate_up_weight, tiles, used_tiles, "recompute")
    return a


def _experts_glu_inference_fake(x_rows, gate_up_weight, tiles, used_tiles):
    return x_rows.new_empty(x_rows.shape[0], gate_up_weight.shape[1] // 2)


experts_glu_inference = define(
    "experts_glu_inference(Tensor x_rows, Tensor gate_up_weight, Tensor tiles, Tensor used_tiles) -> Tensor",
    _experts_glu_inference,
    _experts_glu_inference_fake,
)
