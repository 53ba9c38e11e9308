"""PEFT's LoRA layers on the projections of a fused MLP.

A model given LoRA adapters by PEFT and then swapped (``swap_swiglu_mlps``) keeps each adapter layer:
the gate and up layers become children of the ``SwiGLUMLP`` with their frozen base weight packed in
``gate_up_proj`` (the layer's ``base_layer`` is then a ``PackedBase``, which holds nothing), and the
down layer stays as it is. The fused forward adds the gate and up adapters inside the fused GEMM as
one low-rank term of the packed pre-activation (``swiglu_linear(low_rank=...)``):

    u = [s_1 * A_1 dropout_1(x), ...]           one block of columns per adapter, gate's then up's
    v = pack_gate_up([B_1, 0, ...], [0, B_2, ...])   each B in the rows of its projection

so ``u @ v^T`` is exactly what the adapters add to gate and up. Autograd takes the gradients of the
A, B and dropout from dU and dV. Parameter names and state-dict keys stay PEFT's, so adapters save
in PEFT's format and load onto a stock base model.

In an ``fp8=True`` module the adapters stay in 16 bits beside the FP8 GEMMs: gate's and up's the same
low-rank term of h, down's on ``a`` as the FP8 down GEMM reads it (``adapter_output``; fp8/ops.py).

Layers are recognised by what PEFT's LoRA layers have (``lora_A``, ``lora_B``, ``scaling``,
``base_layer``); variants the fused forward does not compute (DoRA and other variants, LoRA biases,
merged weights, non-Linear bases) are refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

from .layout import pack_gate_up


def is_lora_layer(module: nn.Module | None) -> bool:
    return module is not None and all(
        hasattr(module, name) for name in ("lora_A", "lora_B", "scaling", "base_layer")
    )


def base_of(module: nn.Module) -> nn.Module:
    """The layer an adapter wraps (the module itself if it is no adapter)."""
    return module.base_layer if is_lora_layer(module) else module


def refusal(module: nn.Module) -> str | None:
    """Why the fused forward cannot compute this LoRA layer, or None."""
    kind = f"{type(module).__module__}.{type(module).__qualname__}"
    if getattr(module, "merged", False):
        return f"its adapters are merged into the base weight ({kind}); unmerge them first"
    if any(getattr(module, "use_dora", {}).values()) or getattr(module, "lora_variant", None):
        return f"it is a LoRA variant (DoRA or another) the fused MLP does not compute ({kind})"
    if any(getattr(module, "lora_bias", {}).values()):
        return f"its adapters have a bias ({kind})"
    if any(type(m) is not nn.Linear for d in (module.lora_A, module.lora_B) for m in d.values()):
        return f"its adapters are not plain nn.Linear ({kind})"
    return None


def _active(layer: nn.Module | None) -> list[str]:
    if layer is None or not is_lora_layer(layer) or layer.disable_adapters:
        return []
    return [name for name in layer.active_adapters if name in layer.lora_A]


def low_rank_term(x: torch.Tensor, gate: nn.Module | None, up: nn.Module | None, inter: int):
    """``(u, v)`` of the active adapters of the gate and up layers (``None`` where there are none)."""
    columns, gate_rows, up_rows = [], [], []
    for is_gate, layer in ((True, gate), (False, up)):
        for name in _active(layer):
            a, b = layer.lora_A[name], layer.lora_B[name]
            # PEFT casts the adapter's input to the adapter's dtype; the sum is in x's dtype.
            u = a(layer.lora_dropout[name](x.to(a.weight.dtype))) * layer.scaling[name]
            columns.append(u.to(x.dtype))
            weight = b.weight.to(x.dtype)
            zeros = weight.new_zeros(inter, weight.shape[1])  # the other projection's rows of this block
            gate_rows.append(weight if is_gate else zeros)
            up_rows.append(zeros if is_gate else weight)
    if not columns:
        return None
    return torch.cat(columns, dim=-1), pack_gate_up(torch.cat(gate_rows, dim=1), torch.cat(up_rows, dim=1))


def has_active_adapters(layer: nn.Module | None) -> bool:
    return bool(_active(layer))


def adapter_output(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """What the active adapters of ``layer`` add to its base layer's output for input ``x``, as
    PEFT's LoRA forward adds it (None where none is active): the down projection's adapters of an
    FP8 module, whose base GEMM runs in the FP8 path."""
    total = None
    for name in _active(layer):
        a, b = layer.lora_A[name], layer.lora_B[name]
        term = b(a(layer.lora_dropout[name](x.to(a.weight.dtype)))) * layer.scaling[name]
        total = term if total is None else total + term
    return None if total is None else total.to(x.dtype)


class PackedBase(nn.Module):
    """What an adapter layer of a fused MLP wraps: its base weight lives packed in the MLP's
    ``gate_up_proj``. Reading the weight here (merging adapters, for one) is refused: a copy would
    take changes silently away from the weight the MLP computes with."""

    def __init__(self, projection: str) -> None:
        super().__init__()
        self.projection = projection

    @property
    def weight(self):
        raise RuntimeError(
            f"fused_swiglu: the base weight of {self.projection} is packed in the fused MLP's gate_up_proj; "
            "merging or re-creating adapters is not supported after the swap. Merge (or add adapters) "
            "before swap_swiglu_mlps, or load the saved adapters onto a stock model to merge them."
        )

    def forward(self, x):
        raise RuntimeError(f"fused_swiglu: {self.projection} runs inside the fused MLP, not on its own")

    def extra_repr(self) -> str:
        return f"packed in gate_up_proj ({self.projection})"
