"""How existing SwiGLU MLP modules hold their weights, as ``SwiGLUMLP.from_mlp`` and the swap read them.

Two layouts of the gate and up projections are known:

* ``"separate"``: ``gate_proj`` and ``up_proj`` Linears (LlamaMLP, Mistral, Qwen2, Falcon-H1, ...);
* ``"stacked"``: one ``gate_up_proj`` Linear whose output rows are ``[gate; up]`` (Phi-3, GLM-4).

Either way a ``down_proj`` Linear follows, and the activation is the ``act_fn`` or ``activation_fn``
attribute. The fused module keeps the same state-dict keys as the layout it came from.
"""

from __future__ import annotations

import numbers
from typing import Literal

import torch
from torch import nn

from .lora import base_of

CheckpointKeys = Literal["separate", "stacked"]
CHECKPOINT_KEYS = ("separate", "stacked")
PROJECTIONS = {"separate": ("gate_proj", "up_proj", "down_proj"), "stacked": ("gate_up_proj", "down_proj")}
ACTIVATIONS = ("act_fn", "activation_fn")

# Activation modules that compute SiLU: torch's, and the name transformers has used for its own.
_SILU_TYPES = ("SiLU", "SiLUActivation")


def is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in _SILU_TYPES


def layout_of(mlp: nn.Module) -> CheckpointKeys | None:
    """The layout whose projections ``mlp`` has as submodules, or None."""
    for layout, names in PROJECTIONS.items():
        if all(isinstance(getattr(mlp, name, None), nn.Module) for name in names):
            return layout
    return None


def activation_of(mlp: nn.Module):
    """The module's activation (``act_fn`` or ``activation_fn``), or None."""
    return next((getattr(mlp, name) for name in ACTIVATIONS if hasattr(mlp, name)), None)


def gate_up_weights(mlp: nn.Module, layout: CheckpointKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up weights, ``[I, H]`` each (views of the stacked weight where it is one)."""
    if layout == "stacked":
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        return gate, up
    return mlp.gate_proj.weight, mlp.up_proj.weight


def multiplier_of(mlp: nn.Module, name: str) -> float:
    """The module's ``gate_multiplier`` or ``down_multiplier`` (Falcon-H1 sets them), else 1.0."""
    value = getattr(mlp, name, 1.0)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{type(mlp).__name__}.{name} must be a number, got {type(value).__name__}")
    return float(value)


def check_swiglu_mlp(mlp: nn.Module) -> CheckpointKeys:
    """The module's layout; raises, naming the problem, where the fused MLP would compute another
    function (no projections, biases, an activation that is not SiLU, shapes that do not fit)."""
    layout = layout_of(mlp)
    if layout is None:
        raise TypeError(
            f"{type(mlp).__name__} has neither gate_proj, up_proj and down_proj nor gate_up_proj and "
            "down_proj nn.Linear children"
        )
    # PEFT's LoRA layers count as the Linears they wrap (lora.py says what of them is fused).
    linears = [base_of(getattr(mlp, name)) for name in PROJECTIONS[layout]]
    if not all(isinstance(m, nn.Linear) for m in linears):
        found = ", ".join(
            f"{n}: {type(m).__name__}" for n, m in zip(PROJECTIONS[layout], linears, strict=True)
        )
        raise TypeError(f"the projections must be nn.Linear; got {found}")
    if any(m.bias is not None for m in linears):
        raise ValueError("the fused MLP has no biases; this module's projections have one")
    act = activation_of(mlp)
    if act is not None and not is_silu(act):
        raise ValueError(f"the fused MLP computes SiLU; this module's activation is {type(act).__name__}")
    if layout == "stacked" and mlp.gate_up_proj.weight.shape[0] % 2:
        raise ValueError(f"gate_up_proj has an odd number of rows: {tuple(mlp.gate_up_proj.weight.shape)}")
    gate, up = gate_up_weights(mlp, layout)
    down = mlp.down_proj.weight
    if up.shape != gate.shape or down.shape != gate.shape[::-1]:
        raise ValueError(
            f"gate {tuple(gate.shape)}, up {tuple(up.shape)} and down {tuple(down.shape)} weights must be "
            "[I, H], [I, H] and [H, I]"
        )
    return layout
