"""The inference paths as ``torch.library`` custom ops, so that ``torch.compile`` traces a no-grad call
as one opaque op: no graph break, ``fullgraph=True`` works, and ``mode="reduce-overhead"`` captures the
kernels in its CUDA graphs. The fake implementations give the output's shape and dtype without
running anything. Training calls are traced only on request (``training_ops.py``).
"""

from __future__ import annotations

import torch

from .dispatch import linear_2d, mlp_2d


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
