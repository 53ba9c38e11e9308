"""Functional API: packing, autocast and validation, then one of three paths: the training Function
or the forward op with nothing kept (ops.py), or the PyTorch reference where the fused kernels cannot run
(support.py says where they run). Eager calls and ``torch.compile`` take the same path; compiled, all
of this runs once while Dynamo traces it, and the graph keeps only the ops.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal

import torch

from . import ops
from .fp8.format import GROUP
from .fp8.ops import SwiGLUMLPFp8Function
from .fp8.ops import mlp_inference as fp8_mlp_inference
from .kernels.configs import inference_uses_cublas
from .layout import check_intermediate_size, pack_gate_up
from .ops import SwiGLULinearFunction, SwiGLUMLPFunction, cast_for_autocast, dtype_under_autocast
from .reference import reference_swiglu_mlp_packed, reference_swiglu_packed
from .support import fp8_runs_on, fused_path_available

__all__ = ["fused_path_available", "swiglu_linear", "swiglu_mlp"]

SaveMode = Literal["factors", "preact", "recompute"]
MLP_SAVE_MODES = ("factors", "preact", "recompute")
# The GLU operator's backward receives dA from outside; pre-activations would only add a sigmoid.
LINEAR_SAVE_MODES = ("factors", "recompute")
# The faster training step at most shapes, with preact's peak (docs/design/kernel-choice.md).
DEFAULT_SAVE: SaveMode = "factors"
#: The FP8 path keeps its factors or pre-activations in FP8 (fp8/ops.py); it has no recompute mode.
FP8_SAVE_MODES = ("factors", "preact")


def check_save_mode(save: str, allowed: tuple[str, ...] = MLP_SAVE_MODES) -> str:
    if save not in allowed:
        raise ValueError(f"save must be one of {list(allowed)}, got {save!r}")
    return save


def _check_multiplier(name: str, value) -> float:
    if type(value) is float and math.isfinite(value):  # the common case, before the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _as_packed(gate_up_weight) -> torch.Tensor:
    if isinstance(gate_up_weight, (tuple, list)):
        if len(gate_up_weight) != 2:
            raise ValueError(f"expected a (gate_weight, up_weight) pair, got {len(gate_up_weight)} tensors")
        return pack_gate_up(*gate_up_weight)
    return gate_up_weight


_TENSOR_NAMES = ("x", "gate_up_weight", "down_weight")


def _validate(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> None:
    """Raises for bad input; ``compute_dtype``: the autocast dtype the weights are cast to later."""
    tensors = (x, gate_up_weight) if down_weight is None else (x, gate_up_weight, down_weight)
    names = _TENSOR_NAMES[: len(tensors)]
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense tensor, got layout {t.layout}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    dtype, device = dtype_under_autocast(x, compute_dtype), x.device
    if any(dtype_under_autocast(t, compute_dtype) != dtype for t in tensors[1:]):
        got = ", ".join(f"{n} {t.dtype}" for n, t in zip(names, tensors, strict=True))
        raise TypeError(f"x and the weights must share a dtype outside torch.autocast, got {got}")
    if any(t.device != device for t in tensors[1:]):
        got = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors, strict=True))
        raise ValueError(f"x and the weights must be on one device, got {got}")
    if gate_up_weight.dim() != 2 or x.dim() < 1 or (down_weight is not None and down_weight.dim() != 2):
        got = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, tensors, strict=True))
        raise ValueError(
            "expected x [..., hidden], packed gate/up weight [2 * intermediate, hidden] and down weight "
            f"[hidden, intermediate]; got shapes {got}"
        )
    two_inter, hidden = gate_up_weight.shape
    if hidden == 0:
        raise ValueError(
            f"the hidden size must be positive, got weights of shape {tuple(gate_up_weight.shape)}"
        )
    if x.shape[-1] != hidden or two_inter % 2:
        raise ValueError(
            f"packed gate/up weight {tuple(gate_up_weight.shape)} needs an even first dim and x's last dim "
            f"equal to its hidden size {hidden}; x is {tuple(x.shape)}"
        )
    if down_weight is not None and down_weight.shape != (hidden, two_inter // 2):
        raise ValueError(
            f"down weight {tuple(down_weight.shape)} needs shape ({hidden}, {two_inter // 2}) to fit the "
            f"packed gate/up weight {tuple(gate_up_weight.shape)}"
        )
    check_intermediate_size(two_inter // 2)


def autocast_dtype(x) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts a matmul's inputs to on ``x``'s device; None outside it, for
    meta tensors (which have no autocast) and for arguments that are not tensors (validation
    reports those)."""
    if not isinstance(x, torch.Tensor) or x.is_meta or not torch.is_autocast_enabled(x.device.type):
        return None
    return torch.get_autocast_dtype(x.device.type)


def _autocast(*tensors):
    """Inside ``torch.autocast``, cast like autocast casts a matmul's inputs (``cast_for_autocast``;
    gradients flow back through the casts to the original dtype). Outside it nothing changes."""
    dtype = autocast_dtype(tensors[0])
    return tuple(cast_for_autocast(t, dtype) for t in tensors)


def _needs_autograd(*args) -> bool:
    """Whether a call records a backward: grad mode on and some argument (a tensor, or None) requiring
    grad. Weight pairs are packed before: the packed weight requires grad where either half does."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args)


def swiglu_mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    down_weight: torch.Tensor,
    *,
    gate_multiplier: float = 1.0,
    down_multiplier: float = 1.0,
    save: SaveMode = DEFAULT_SAVE,
    fp8: bool = False,
) -> torch.Tensor:
    """The SwiGLU MLP ``down_multiplier * down(silu(gate_multiplier * gate(x)) * up(x))``.

    Args:
        x: ``[..., hidden]``.
        gate_up_weight: the packed ``[2 * intermediate, hidden]`` weight (see :mod:`fused_swiglu.layout`),
            or a ``(gate_weight, up_weight)`` pair of ``[intermediate, hidden]`` tensors as in Hugging Face
            ``LlamaMLP`` (packed on every call, and gradients flow back to both).
        down_weight: ``[hidden, intermediate]``.
        gate_multiplier, down_multiplier: scalar multipliers (Falcon-H1 style); 1.0 for LLaMA-class models.
        save: what training keeps for the backward, per token: ``"factors"`` (default; 3 * intermediate
            elements, the fastest backward), ``"preact"`` (2 * intermediate; the backward recomputes
            the sigmoid and ``a``) or ``"recompute"`` (nothing; the backward re-runs the gate/up GEMM).
        fp8: run the six GEMMs in FP8 on Hopper (e4m3 with fp32 amax / 448 scales: 1 x 128 groups for
            activations and gradients, 128 x 128 blocks for weights, as DeepSeek-V3 trains;
            fused_swiglu.fp8). ``save`` ``"factors"`` or ``"preact"`` then keeps them in FP8 with x
            transposed (and, for the factors, ``a`` transposed): 3I + H or 2I + H bytes per token.
            Hidden and intermediate sizes must be multiples of 128. Inference at decode sizes (24
            rows or fewer) stays in 16 bits.

    Returns:
        ``[..., hidden]``, the dtype of ``x``.

    Under ``torch.autocast``, x and the weights are cast to the autocast dtype, like a matmul's
    inputs, and the weights' gradients come back in their own dtype. Under ``torch.no_grad()`` /
    ``torch.inference_mode()``, or when nothing requires grad, nothing is saved. With
    ``"preact"``/``"factors"`` the result can be walked backward once (the backward overwrites what
    was saved); ``create_graph`` is not supported.
    """
    gate_up_weight = _as_packed(gate_up_weight)
    compute_dtype = autocast_dtype(x)
    x = cast_for_autocast(x, compute_dtype)
    _validate(x, gate_up_weight, down_weight, compute_dtype)
    check_save_mode(save)
    gate_multiplier = _check_multiplier("gate_multiplier", gate_multiplier)
    down_multiplier = _check_multiplier("down_multiplier", down_multiplier)
    hidden = gate_up_weight.shape[1]
    x2d = x if x.dim() == 2 else x.reshape(-1, hidden)

    scalars = (gate_multiplier, down_multiplier)
    if check_fp8(fp8, hidden, gate_up_weight.shape[0] // 2) and _takes_fp8(x2d, save):
        y = _fp8_call(x2d, gate_up_weight, down_weight, None, None, scalars, save, False)
        if y is not None:
            return y if x.dim() == 2 else y.reshape(x.shape)
    fused = fused_path_available(x2d, gate_up_weight)
    if fused and _needs_autograd(x2d, gate_up_weight, down_weight):
        # The Function casts the weights itself, so that their gradients come back in their own dtype.
        y = SwiGLUMLPFunction.apply(x2d, gate_up_weight, down_weight, *scalars, save, compute_dtype)
    else:
        gate_up_weight, down_weight = (
            cast_for_autocast(w, compute_dtype) for w in (gate_up_weight, down_weight)
        )
        if fused:
            a, _ = ops.glu_forward(x2d, gate_up_weight, *scalars, ops.INFERENCE, None, None)
            y = torch.mm(a, down_weight.t())
        else:
            y = reference_swiglu_mlp_packed(
                x2d,
                gate_up_weight,
                down_weight,
                gate_multiplier=gate_multiplier,
                down_multiplier=down_multiplier,
            )
    return y if x.dim() == 2 else y.reshape(x.shape)  # y's last dim is hidden, as x's


def _fp8_call(x2d, gate_up_weight, down_weight, u, v, scalars, save, with_a):
    """The FP8 path's output (``(y, a)`` with ``with_a``): the training Function where autograd
    records, else the inference pass; None at decode sizes without autograd (16 bits run those). The
    weights are quantized from their own dtype; the output is in x's (the autocast dtype)."""
    if _needs_autograd(x2d, gate_up_weight, down_weight, u, v):
        return SwiGLUMLPFp8Function.apply(
            x2d, gate_up_weight, down_weight, u, v, *scalars, save, x2d.dtype, with_a
        )
    if inference_uses_cublas(x2d.shape[0]):
        return None
    return fp8_mlp_inference(x2d, gate_up_weight, down_weight, *scalars, x2d.dtype, u, v, with_a)


def fp8_mlp_with_adapters(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None,
    with_a: bool,
    *,
    gate_multiplier: float,
    down_multiplier: float,
    save: str,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The FP8 MLP with LoRA's terms (an ``fp8=True`` module with adapters, lora.py): ``low_rank``
    added to the packed pre-activation as ``swiglu_linear`` adds it, and with ``with_a`` also ``a``
    as the down GEMM reads it, for the down projection's adapters (fp8/ops.py). Returns ``(y, a)``
    (``a`` None without ``with_a``), or None where the FP8 path does not take the call (then the
    adapters run in 16 bits), as ``swiglu_mlp`` decides it (decode sizes without autograd included)."""
    compute_dtype = autocast_dtype(x)
    x = cast_for_autocast(x, compute_dtype)
    _validate(x, gate_up_weight, down_weight, compute_dtype)
    hidden = gate_up_weight.shape[1]
    x2d = x if x.dim() == 2 else x.reshape(-1, hidden)
    if not (check_fp8(True, hidden, gate_up_weight.shape[0] // 2) and _takes_fp8(x2d, save)):
        return None
    u = v = None
    if low_rank is not None:
        u, v = _low_rank_2d(x, gate_up_weight, *(cast_for_autocast(t, compute_dtype) for t in low_rank))
    scalars = (
        _check_multiplier("gate_multiplier", gate_multiplier),
        _check_multiplier("down_multiplier", down_multiplier),
    )
    out = _fp8_call(x2d, gate_up_weight, down_weight, u, v, scalars, save, with_a)
    if out is None:
        return None
    y, a = out if with_a else (out, None)
    if x.dim() != 2:
        y = y.reshape(x.shape)
        a = None if a is None else a.reshape(*x.shape[:-1], a.shape[-1])
    return y, a


def check_fp8(fp8, hidden: int, intermediate: int) -> bool:
    """``fp8`` checked: a bool, and True only for sizes the FP8 path takes."""
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
    if fp8 and (hidden % GROUP or intermediate % GROUP):
        raise ValueError(
            f"fp8=True needs hidden and intermediate sizes that are multiples of {GROUP} (the scale "
            f"group); got hidden {hidden} and intermediate {intermediate}"
        )
    return fp8


def _takes_fp8(x2d: torch.Tensor, save: str) -> bool:
    """Whether an ``fp8=True`` call takes the FP8 path (the device and dtype); raises for a save mode
    it has not."""
    if save not in FP8_SAVE_MODES:
        raise ValueError(
            f"fp8=True keeps its activations in FP8: save must be one of {list(FP8_SAVE_MODES)}, got {save!r}"
        )
    if x2d.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x2d.shape[0] == 0:
        return False
    return fp8_runs_on(x2d.device)


def swiglu_linear(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    *,
    gate_multiplier: float = 1.0,
    save: Literal["factors", "recompute"] = "factors",
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The GLU half alone: ``silu(gate_multiplier * x @ Wg^T) * (x @ Wu^T)``, for callers that own the
    down projection (Megatron-style blocks, MoE experts, LoRA on the down projection).

    It returns the intermediate activation ``a``; it is not a SwiGLU followed by a linear layer (what
    flash-linear-attention's ``swiglu_linear`` computes): no down projection runs here.

    Args:
        x: ``[..., hidden]``.
        gate_up_weight: packed ``[2 * intermediate, hidden]``, or a ``(gate_weight, up_weight)`` pair.
        gate_multiplier: scalar multiplier of the gate pre-activation.
        save: ``"factors"`` keeps [silu(g) | u * silu'(g)] (2 * intermediate per token; the backward is
            two multiplies, in place) or ``"recompute"`` keeps nothing and re-runs the fused GEMM.
        low_rank: ``(u, v)``, ``u`` ``[..., R]`` and ``v`` ``[2 * intermediate, R]`` packed like the weight
            (:func:`fused_swiglu.layout.pack_gate_up`): ``u @ v^T`` is added to the packed
            pre-activation inside the fused GEMM, and gradients flow to both. LoRA adapters on gate and
            up are this term: ``u`` the scaled ``A x`` of each adapter side by side, ``v`` their ``B``
            (``fused_swiglu.lora``).

    Returns:
        ``[..., intermediate]``.
    """
    gate_up_weight = _as_packed(gate_up_weight)
    u, v = (None, None) if low_rank is None else low_rank
    compute_dtype = autocast_dtype(x)
    x, u, v = (cast_for_autocast(t, compute_dtype) for t in (x, u, v))
    _validate(x, gate_up_weight, compute_dtype=compute_dtype)
    check_save_mode(save, LINEAR_SAVE_MODES)
    gate_multiplier = _check_multiplier("gate_multiplier", gate_multiplier)
    two_inter, hidden = gate_up_weight.shape
    x2d = x if x.dim() == 2 else x.reshape(-1, hidden)
    if low_rank is not None:
        u, v = _low_rank_2d(x, gate_up_weight, u, v)
    fused = fused_path_available(x2d, gate_up_weight)
    if fused and _needs_autograd(x2d, gate_up_weight, u, v):
        # As in swiglu_mlp: the Function casts the weight, whose gradient comes back in its own dtype.
        a = SwiGLULinearFunction.apply(x2d, gate_up_weight, gate_multiplier, save, u, v, compute_dtype)
    else:
        gate_up_weight = cast_for_autocast(gate_up_weight, compute_dtype)
        if fused:
            a, _ = ops.glu_forward(x2d, gate_up_weight, gate_multiplier, 1.0, ops.INFERENCE, u, v)
        else:
            low = None if u is None else (u, v)
            a = reference_swiglu_packed(x2d, gate_up_weight, gate_multiplier=gate_multiplier, low_rank=low)
    return a if x.dim() == 2 else a.reshape(*x.shape[:-1], two_inter // 2)


def _low_rank_2d(x, gate_up_weight, u, v) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u, v)`` checked against x and the weight, u made 2-D, and both zero-padded to a multiple of
    16 columns (the kernel's smallest dot; zeros add nothing, and their gradients are cut off)."""
    for name, t in (("u", u), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"low_rank {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != x.dtype or t.device != x.device:
            raise TypeError(
                f"low_rank {name} must match x's dtype and device ({x.dtype} on {x.device}), got "
                f"{t.dtype} on {t.device}"
            )
    rank = v.shape[-1] if v.dim() == 2 else -1
    if v.dim() != 2 or v.shape[0] != gate_up_weight.shape[0] or u.shape != (*x.shape[:-1], rank) or rank < 1:
        raise ValueError(
            f"low_rank needs u [..., R] with x's leading dims {tuple(x.shape[:-1])} and v "
            f"[{gate_up_weight.shape[0]}, R]; got u {tuple(u.shape)} and v {tuple(v.shape)}"
        )
    pad = -rank % 16
    u2d = u.reshape(-1, rank)
    if pad:
        u2d, v = torch.nn.functional.pad(u2d, (0, pad)), torch.nn.functional.pad(v, (0, pad))
    return u2d, v
