"""The inference paths as custom ops (library.py), so that ``torch.compile`` traces a no-grad call as
one opaque op: no graph break, ``fullgraph=True`` works, and ``mode="reduce-overhead"`` captures the
kernels in its CUDA graphs. The fake implementations give the output's shape and dtype without
running anything. Training calls are traced only on request (``training_ops.py``).
"""

from __future__ import annotations

import torch

from .dispatch import linear_2d, mlp_2d
from .library import define


def _mlp_inference(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier):
    """The MLP without autograd on validated x [M, H], packed [2I, H] and down [H, I]: [M, H]."""
    with torch.no_grad():
        return mlp_2d(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, "factors")


def _mlp_inference_fake(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier):
    return x2d.new_empty(x2d.shape[0], down_weight.shape[0])


swiglu_mlp_inference = define(
    "swiglu_mlp_inference(Tensor x2d, Tensor gate_up_weight, Tensor down_weight, float gate_multiplier, "
    "float down_multiplier) -> Tensor",
    _mlp_inference,
    _mlp_inference_fake,
)


def _linear_inference(x2d, gate_up_weight, gate_multiplier):
    """The GLU half without autograd on validated x [M, H] and a packed [2I, H] weight: [M, I]."""
    with torch.no_grad():
        return linear_2d(x2d, gate_up_weight, gate_multiplier, "factors")


def _linear_inference_fake(x2d, gate_up_weight, gate_multiplier):
    return x2d.new_empty(x2d.shape[0], gate_up_weight.shape[0] // 2)


swiglu_linear_inference = define(
    "swiglu_linear_inference(Tensor x2d, Tensor gate_up_weight, float gate_multiplier) -> Tensor",
    _linear_inference,
    _linear_inference_fake,
)
