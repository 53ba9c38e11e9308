"""Functional API: validation, then dispatch to the fused training path, the fused inference path, or
the PyTorch reference where the fused kernels cannot run."""

from __future__ import annotations

import numbers
from typing import Literal

import torch

from .autograd import SwiGLUMLPFunction, swiglu_mlp_no_grad
from .kernels.common import Saved, interpreting, tma_ready
from .layout import check_intermediate_size, pack_gate_up
from .reference import reference_swiglu_mlp_packed

SaveMode = Literal["factors", "preact"]
SAVE_MODES: dict[str, Saved] = {"factors": Saved.FACTORS, "preact": Saved.PREACT}
DEFAULT_SAVE: SaveMode = "preact"

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_save_mode(save: str) -> Saved:
    if save not in SAVE_MODES:
        raise ValueError(f"save must be one of {sorted(SAVE_MODES)}, got {save!r}")
    return SAVE_MODES[save]


def fused_path_available(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> bool:
    """Whether the fused kernels can run on these (already validated) tensors.

    They need fp16/bf16/fp32 on a CUDA device with TMA (compute capability 9.0+), or CPU tensors under
    the Triton interpreter; rows 16-byte aligned (hidden * itemsize a multiple of 16) and at least one token.
    """
    if x.dtype not in FUSED_DTYPES or x.numel() == 0:
        return False
    if x.device.type == "cuda":
        if torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif not (x.device.type == "cpu" and interpreting()):
        return False
    hidden = x.shape[-1]
    inter = down_weight.shape[1]
    return (hidden * x.element_size()) % 16 == 0 and (inter * x.element_size()) % 16 == 0


def _check_multiplier(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _validate(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> None:
    for name, t in (("x", x), ("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if not (x.dtype == gate_up_weight.dtype == down_weight.dtype):
        raise TypeError(
            f"x, gate/up weight and down weight must share a dtype, got {x.dtype}, "
            f"{gate_up_weight.dtype} and {down_weight.dtype}"
        )
    if not (x.device == gate_up_weight.device == down_weight.device):
        raise ValueError(
            f"x, gate/up weight and down weight must be on one device, got {x.device}, "
            f"{gate_up_weight.device} and {down_weight.device}"
        )
    if gate_up_weight.dim() != 2 or down_weight.dim() != 2 or x.dim() < 1:
        raise ValueError(
            f"expected x [..., hidden], packed gate/up weight [2 * intermediate, hidden] and down weight "
            f"[hidden, intermediate]; got shapes {tuple(x.shape)}, {tuple(gate_up_weight.shape)} "
            f"and {tuple(down_weight.shape)}"
        )
    hidden, inter = down_weight.shape
    if gate_up_weight.shape != (2 * inter, hidden) or x.shape[-1] != hidden:
        raise ValueError(
            f"shapes do not fit hidden={hidden}, intermediate={inter} (from the down weight): x "
            f"{tuple(x.shape)} needs last dim {hidden}, packed gate/up weight {tuple(gate_up_weight.shape)} "
            f"needs ({2 * inter}, {hidden})"
        )
    check_intermediate_size(inter)


def swiglu_mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    down_weight: torch.Tensor,
    *,
    gate_multiplier: float = 1.0,
    down_multiplier: float = 1.0,
    save: SaveMode = DEFAULT_SAVE,
) -> torch.Tensor:
    """The SwiGLU MLP ``down_multiplier * down(silu(gate_multiplier * gate(x)) * up(x))``.

    Args:
        x: ``[..., hidden]``.
        gate_up_weight: the packed ``[2 * intermediate, hidden]`` weight (see :mod:`fused_swiglu.layout`),
            or a ``(gate_weight, up_weight)`` pair of ``[intermediate, hidden]`` tensors as in Hugging Face
            ``LlamaMLP`` (packed on every call, and gradients flow back to both).
        down_weight: ``[hidden, intermediate]``.
        gate_multiplier, down_multiplier: scalar multipliers (Falcon-H1 style); 1.0 for LLaMA-class models.
        save: what training keeps for the backward: ``"preact"`` (2 * intermediate elements per token)
            or ``"factors"`` (3 * intermediate per token, a cheaper backward epilogue).

    Returns:
        ``[..., hidden]``, the dtype of ``x``.

    Under ``torch.no_grad()`` / ``torch.inference_mode()``, or when nothing requires grad, nothing is
    saved. The result can be walked backward once (no ``retain_graph`` re-walk, no ``create_graph``).
    """
    if isinstance(gate_up_weight, (tuple, list)):
        if len(gate_up_weight) != 2:
            raise ValueError(f"expected a (gate_weight, up_weight) pair, got {len(gate_up_weight)} tensors")
        gate_up_weight = pack_gate_up(*gate_up_weight)
    _validate(x, gate_up_weight, down_weight)
    kind = check_save_mode(save)
    gate_multiplier = _check_multiplier("gate_multiplier", gate_multiplier)
    down_multiplier = _check_multiplier("down_multiplier", down_multiplier)
    hidden = down_weight.shape[0]
    x2d = x.reshape(-1, hidden)

    if not fused_path_available(x2d, gate_up_weight, down_weight):
        y = reference_swiglu_mlp_packed(
            x2d, gate_up_weight, down_weight, gate_multiplier=gate_multiplier, down_multiplier=down_multiplier
        )
    else:
        x2d = tma_ready(x2d)
        gate_up_weight = tma_ready(gate_up_weight)
        down_weight = tma_ready(down_weight)
        training = torch.is_grad_enabled() and (
            x.requires_grad or gate_up_weight.requires_grad or down_weight.requires_grad
        )
        if training:
            y = SwiGLUMLPFunction.apply(
                x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, kind
            )
        else:
            y = swiglu_mlp_no_grad(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier)
    return y.reshape(*x.shape[:-1], hidden)
