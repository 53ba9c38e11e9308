"""The custom ops of the routed experts (``fused_swiglu::``, as ops.py for the dense MLP), over x's rows
grouped by expert, one row per routed slot (routing.py), each row given by its token:

* forward: every expert's gate/up GEMM as the forward kernel with a table of row tiles and the
  SwiGLU in its epilogue, reading x's rows by index for narrow experts (no gathered copy of x),
  then every expert's down projection as one grouped GEMM (the routing weights scale its rows in
  the combine). Saved
  for the backward, per row: the factors and ``a`` (``"factors"``, 3I), the pre-activations
  (``"preact"``, 2I) or nothing (``"recompute"``);
* backward, in two ops so that ``a`` and dy's rows are freed before the largest gradient is made:
  ``a`` again where it was not saved (by the forward kernel, with ``"recompute"``), then one kernel
  (kernels/glu_backward.py, routed) for the down projections' input gradient with, in its epilogue,
  the routing weights' gradient, ``a * w`` for dW_down and the SwiGLU gradient over what was saved,
  and dW_down as a grouped GEMM; then the packed dW and dX's rows as grouped GEMMs, x's rows gathered
  for dW and freed before dX's rows are made (the ops take x and each row's token, not x's rows);
* inference: the forward, nothing saved;
* combine: each token's ``k`` rows summed into one (y's rows, each times its routing weight; dX's
  rows), in one pass (kernels/combine.py).

Where the fused kernels do not run (support.py: bf16 on CPU, other GPUs, float64, unaligned rows),
the same ops compute the SwiGLU and its gradient in PyTorch beside the grouped GEMMs, and keep the
pre-activations where the kernels keep the factors.
"""

from __future__ import annotations

import functools
import itertools

import torch

from ..kernels.common import Saved, interpreting, tma_ready
from ..kernels.configs import expert_rows_by_index, routed_backward_is_warp_specialized
from ..kernels.glu_backward import routed_glu_backward_
from ..kernels.glu_backward_ws import routed_glu_backward_ws_
from ..kernels.glu_forward import glu_forward
from ..layout import CHUNK, split_packed_columns
from ..library import define
from ..ops import _empty_if_none, _on_tensor_device, _overwrite_once
from ..support import fused_path_available, kernels_run_on
from .kernels.combine import combine

EXPERTS_SAVE_MODES = ("factors", "preact", "recompute")


def _grouped_mm(a, b, ends):
    """Per expert ``e``, rows ``[ends[e-1], ends[e])``: ``a`` [P, K] @ ``b[e]`` [K, N] -> [P, N], or
    ``a`` [M, P] @ ``b`` [P, N] over those rows -> [E, M, N]. ``torch._grouped_mm`` for bf16 on a GPU
    (the dtype it takes; Hopper and newer); otherwise expert by expert, which waits for the GPU to
    read ``ends``."""
    if a.is_cuda and a.dtype == torch.bfloat16 and _grouped_gemm_hardware(a.device.index):
        return torch._grouped_mm(a, b, offs=ends)
    # New tensors, never written after (at version 0: what the backward may overwrite, ops.py).
    bounds = [0, *ends.tolist()]
    groups = enumerate(itertools.pairwise(bounds))
    if b.dim() == 3:
        past = a.new_zeros(a.shape[0] - bounds[-1], b.shape[2])  # rows past the groups (grouped.py)
        return torch.cat([*(torch.mm(a[lo:hi], b[e]) for e, (lo, hi) in groups), past])
    return torch.stack([torch.mm(a[:, lo:hi], b[lo:hi]) for _, (lo, hi) in groups])


@functools.cache
def _grouped_gemm_hardware(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _gate_up(x, token_of_row, gate_up_weight, tiles, used_tiles, ends, save: str, fused: bool):
    """``a`` [P, I] and what the backward reads of the gate/up half for the rows ``x[token_of_row]``:
    the factors (fused ``"factors"``, [P, 2I]), the pre-activations (``"preact"``, and ``"factors"``
    in PyTorch) or ``None``. The fused kernel reads x's rows by index where that is faster
    (kernels/configs.py); else they are gathered first."""
    if fused:
        experts = (tiles, used_tiles, gate_up_weight.shape[0])
        multipliers = {"gate_multiplier": 1.0, "down_multiplier": 1.0}  # experts carry none
        if expert_rows_by_index(gate_up_weight.shape[1] // 2):
            rows = {"row_index": token_of_row}
        else:
            x, rows = tma_ready(_gathered(x, token_of_row)), {}
        return glu_forward(x, gate_up_weight, save=Saved.of(save), experts=experts, **rows, **multipliers)
    packed = _grouped_mm(_gathered(x, token_of_row), gate_up_weight.transpose(1, 2), ends)
    up, gate = split_packed_columns(packed)
    return torch.nn.functional.silu(gate) * up, packed if save != "recompute" else None


def _swiglu_grad_(da, preact):
    """The packed [dU | dG] of ``da`` over the pre-activations ``preact`` [P, 2I], in place (PyTorch)."""
    up, gate = split_packed_columns(preact)
    sigmoid = torch.sigmoid(gate)
    d_up, d_gate = da * gate * sigmoid, da * up * sigmoid * (1 + gate * (1 - sigmoid))
    grouped = preact.view(preact.shape[0], -1, 2, CHUNK)  # written once both are made (up may be a view)
    grouped[:, :, 0] = d_up.view(preact.shape[0], -1, CHUNK)
    grouped[:, :, 1] = d_gate.view(preact.shape[0], -1, CHUNK)
    return preact


def _prepared(x, gate_up_weight, down_weight):
    """The op's inputs as the kernels take them, and whether the fused kernels run for them."""
    x, gate_up_weight = tma_ready(x), gate_up_weight.contiguous()
    fused = fused_path_available(x, gate_up_weight[0])
    return x, gate_up_weight, down_weight.contiguous(), fused


@_on_tensor_device
def _experts_forward(x, token_of_row, gate_up_weight, down_weight, tiles, used_tiles, ends, save):
    """y_rows [P, H] (each row's expert's MLP, before its routing weight; row p is token
    ``token_of_row[p]``'s), the saved gate/up tensor [P, 2I] and ``a`` [P, I] (each empty where
    ``save`` keeps none)."""
    x, gate_up_weight, down_weight, fused = _prepared(x, gate_up_weight, down_weight)
    a, saved = _gate_up(x, token_of_row, gate_up_weight, tiles, used_tiles, ends, save, fused)
    y_rows = _grouped_mm(a, down_weight.transpose(1, 2), ends)
    return y_rows, _empty_if_none(saved, x), a if save == "factors" else x.new_empty(0)


def _experts_forward_fake(x, token_of_row, gate_up_weight, down_weight, tiles, used_tiles, ends, save):
    rows, two_inter = token_of_row.shape[0], gate_up_weight.shape[1]
    saved = x.new_empty(rows, two_inter) if save != "recompute" else x.new_empty(0)
    a = x.new_empty(rows, two_inter // 2) if save == "factors" else x.new_empty(0)
    return x.new_empty(rows, x.shape[1]), saved, a


experts_forward = define(
    "experts_forward(Tensor x, Tensor token_of_row, Tensor gate_up_weight, "
    "Tensor down_weight, Tensor tiles, Tensor used_tiles, Tensor ends, str save) -> (Tensor, Tensor, Tensor)",
    _experts_forward,
    _experts_forward_fake,
)


@_on_tensor_device
def _experts_backward_down(
    dy_rows,
    x,
    token_of_row,
    w_rows,
    gate_up_weight,
    down_weight,
    saved,
    a,
    tiles,
    used_tiles,
    ends,
    save,
    need_dw,
    need_ddown,
):
    """The backward of the down projections and the SwiGLU: the routing weights' gradient per row
    [P] (fp32 or wider), dW_down [E, H, I] (each empty where not needed), and [dU | dG] [P, 2I]
    over ``saved`` (overwritten; then the third output is empty) or, with ``"recompute"``, as the
    third output. ``a`` is not read after this op, nor ``dy_rows``: the gate/up op runs without them.
    Row p is token ``token_of_row[p]``'s."""
    gate_up_weight, down_weight = gate_up_weight.contiguous(), down_weight.contiguous()
    fused = fused_path_available(x, gate_up_weight[0])  # as for the forward's x rows: same dtype and width
    if save == "recompute":
        a, saved = _gate_up(
            tma_ready(x), token_of_row, gate_up_weight, tiles, used_tiles, ends, "factors", fused
        )
    else:
        _overwrite_once(saved)
        if save == "factors":
            _overwrite_once(a)
    dy_rows = tma_ready(dy_rows)
    if fused:
        # One kernel: the gradient of a * w, the routing weights' gradient, a * w over a for dW_down
        # and the SwiGLU gradient over what was saved.
        kind = Saved.PREACT if save == "preact" else Saved.FACTORS
        rows, hidden = dy_rows.shape
        warp_specialized = routed_backward_is_warp_specialized(
            rows, hidden, dy_rows.dtype, not interpreting(), kind
        )
        if warp_specialized and (need_dw or need_ddown):  # it reads a: with neither, the Triton kernel
            dw, a = routed_glu_backward_ws_(
                dy_rows,
                down_weight,
                saved,
                a,
                w_rows.contiguous(),
                tiles,
                used_tiles,
                need_row_grad=need_dw,
                write_scaled_a=need_ddown,
            )
        else:
            dw, a = routed_glu_backward_(
                dy_rows,
                down_weight,
                saved,
                a if kind == Saved.FACTORS else None,
                w_rows.contiguous(),
                tiles,
                used_tiles,
                save=kind,
                need_row_grad=need_dw,
                write_scaled_a=need_ddown,
            )
    else:
        if save == "preact":
            up, gate = split_packed_columns(saved)
            a = torch.nn.functional.silu(gate) * up
        grad = _grouped_mm(dy_rows, down_weight, ends)  # of a * w
        wide = torch.promote_types(a.dtype, torch.float32)
        dw = torch.linalg.vecdot(grad.to(wide), a.to(wide)) if need_dw else None
        grad.mul_(w_rows[:, None])  # the gradient of a
        if need_ddown:
            a.mul_(w_rows[:, None])  # a * w, a's last use
        _swiglu_grad_(grad, saved)  # [dU | dG], over the pre-activations the PyTorch path keeps
        del grad
    ddown = _grouped_mm(dy_rows.t(), a, ends) if need_ddown else None
    del a
    made = saved if save == "recompute" else None
    return tuple(_empty_if_none(g, x) for g in (dw, ddown, made))


def _experts_backward_down_fake(
    dy_rows,
    x,
    token_of_row,
    w_rows,
    gate_up_weight,
    down_weight,
    saved,
    a,
    tiles,
    used_tiles,
    ends,
    save,
    need_dw,
    need_ddown,
):
    wide = torch.promote_types(x.dtype, torch.float32)
    rows = token_of_row.shape[0]
    return (
        x.new_empty((rows,) if need_dw else (0,), dtype=wide),
        x.new_empty(down_weight.shape if need_ddown else (0,)),
        x.new_empty((rows, gate_up_weight.shape[1]) if save == "recompute" else (0,)),
    )


experts_backward_down = define(
    "experts_backward_down(Tensor dy_rows, Tensor x, Tensor token_of_row, Tensor w_rows, "
    "Tensor gate_up_weight, Tensor down_weight, Tensor saved, Tensor a, Tensor tiles, Tensor used_tiles, "
    "Tensor ends, str save, bool need_dw, bool need_ddown) -> (Tensor, Tensor, Tensor)",
    _experts_backward_down,
    _experts_backward_down_fake,
)


@_on_tensor_device
def _experts_backward_gate_up(grad, x, token_of_row, gate_up_weight, ends, after, need_dx, need_dgate_up):
    """dX_rows [P, H] and the packed dW [E, 2I, H] from [dU | dG] [P, 2I] (each empty where not
    needed). x's rows are gathered here for dW and freed before dX's rows are made, so that the
    two [P, H] tensors are never alive together. ``after`` is not read: it is what the op must run
    after (``experts_backward_down``, which wrote ``grad`` unless it made it)."""
    dgate_up = None
    if need_dgate_up:
        x_rows = tma_ready(_gathered(x, token_of_row))
        dgate_up = _grouped_mm(grad.t(), x_rows, ends)
        del x_rows
    dx = _grouped_mm(grad, gate_up_weight.contiguous(), ends) if need_dx else None
    return tuple(_empty_if_none(g, x) for g in (dx, dgate_up))


def _experts_backward_gate_up_fake(
    grad, x, token_of_row, gate_up_weight, ends, after, need_dx, need_dgate_up
):
    return (
        x.new_empty((token_of_row.shape[0], x.shape[1]) if need_dx else (0,)),
        x.new_empty(gate_up_weight.shape if need_dgate_up else (0,)),
    )


experts_backward_gate_up = define(
    "experts_backward_gate_up(Tensor grad, Tensor x, Tensor token_of_row, Tensor gate_up_weight, "
    "Tensor ends, Tensor after, bool need_dx, bool need_dgate_up) -> (Tensor, Tensor)",
    _experts_backward_gate_up,
    _experts_backward_gate_up_fake,
)


def _experts_inference(x, token_of_row, gate_up_weight, down_weight, tiles, used_tiles, ends):
    y_rows, _, _ = _experts_forward(
        x, token_of_row, gate_up_weight, down_weight, tiles, used_tiles, ends, "recompute"
    )
    return y_rows


def _experts_inference_fake(x, token_of_row, gate_up_weight, down_weight, tiles, used_tiles, ends):
    return x.new_empty(token_of_row.shape[0], x.shape[1])


experts_inference = define(
    "experts_inference(Tensor x, Tensor token_of_row, Tensor gate_up_weight, "
    "Tensor down_weight, Tensor tiles, Tensor used_tiles, Tensor ends) -> Tensor",
    _experts_inference,
    _experts_inference_fake,
)


def _experts_combine(rows_tensor, rows, k, weights):
    """[P, H] grouped rows -> [T, H]: each token's ``k`` rows (``rows`` holds the row of each slot),
    each times its slot's weight where ``weights`` [T * k] is given, summed in fp32; gathered rather
    than added with atomics. With ``k`` 1 and no weights, the rows ``rows`` of ``rows_tensor``."""
    if kernels_run_on(rows_tensor.dtype, rows_tensor.device):
        return combine(rows_tensor.contiguous(), rows, k, None if weights is None else weights.contiguous())
    if k == 1 and weights is None:
        return rows_tensor[rows]
    picked = rows_tensor[rows].to(torch.promote_types(rows_tensor.dtype, torch.float32))
    if weights is not None:
        picked *= weights[:, None]
    return picked.view(-1, k, rows_tensor.shape[1]).sum(1).to(rows_tensor.dtype)


def _gathered(rows_tensor, rows):
    """The rows ``rows`` [P] of ``rows_tensor`` [T, H] as a new [P, H] tensor (the combine kernel, one
    row per output: faster than indexing, which also widens int32 rows to int64 first)."""
    return _experts_combine(rows_tensor, rows, 1, None)


def _experts_combine_fake(rows_tensor, rows, k, weights):
    return rows_tensor.new_empty(rows.shape[0] // k, rows_tensor.shape[1])


experts_combine = define(
    "experts_combine(Tensor rows_tensor, Tensor rows, int k, Tensor? weights) -> Tensor",
    _experts_combine,
    _experts_combine_fake,
)
