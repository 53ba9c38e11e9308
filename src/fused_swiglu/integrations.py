"""One call to put ``SwiGLUMLP`` into an existing model (Hugging Face LLaMA, Mistral, Qwen2 and the
like): every module with the LlamaMLP pattern is swapped for the fused module, weights copied."""

from __future__ import annotations

import torch
from torch import nn

from .functional import (
    DEFAULT_SAVE,
    SaveMode,
    check_save_mode,
    swiglu_mlp,
)
from .layout import CHUNK, pack_gate_up
from .nn import SwiGLUMLP, is_silu


def llama_mlp_pattern(module: nn.Module) -> bool:
    """Whether ``module`` looks like transformers' ``LlamaMLP``: bias-free ``gate_proj``/``up_proj``
    [I, H] and ``down_proj`` [H, I] ``nn.Linear`` (not subclasses), an ``act_fn`` that is SiLU, and I
    a multiple of 8."""
    linears = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    # Exactly nn.Linear: subclasses (quantized layers, adapter wrappers) hold weights that are not a
    # plain floating-point matrix, or compute more than x @ W^T.
    plain = all(type(m) is nn.Linear and m.bias is None and m.weight.is_floating_point() for m in linears)
    if isinstance(module, SwiGLUMLP) or not plain:
        return False
    gate, up, down = (m.weight for m in linears)
    inter, hidden = gate.shape
    return (
        up.shape == gate.shape
        and down.shape == (hidden, inter)
        and inter % CHUNK == 0
        and is_silu(getattr(module, "act_fn", None))
    )


def _check_swappable(name: str, module: nn.Module, check: bool) -> None:
    """Everything that could refuse a swap, checked before any module is replaced, so that a refusal
    leaves the model as it was. A module can match the pattern and still compute something else in
    its forward (an extra term, a dropout): with ``check``, compare it with the fused function on a
    few random rows (one module at a time, so the extra memory is one packed weight)."""
    if module.gate_proj.weight.requires_grad != module.up_proj.weight.requires_grad:
        raise ValueError(f"fused_swiglu: {name}: gate_proj and up_proj must both be trainable or both frozen")
    weight = module.down_proj.weight
    if not check or weight.device.type == "meta":  # meta weights hold no values to compare
        return
    # A private generator: swapping must not move the caller's random stream.
    generator = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(4, weight.shape[0], device=weight.device, dtype=weight.dtype, generator=generator)
    with torch.no_grad():
        expected = module(x).float()
        packed = pack_gate_up(module.gate_proj.weight, module.up_proj.weight)
        got = swiglu_mlp(x, packed, weight).float()
    error = ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    # Loose enough for TF32 and 16-bit rounding on either side; a different function is off by O(1).
    tolerance = {torch.float64: 1e-6, torch.float32: 5e-3}.get(weight.dtype, 3e-2)
    if not error <= tolerance:
        raise ValueError(
            f"fused_swiglu: {name} ({type(module).__name__}) matches the LlamaMLP pattern but its forward "
            f"differs from SwiGLU (relative difference {error:.2e}); nothing was swapped"
        )


def swap_swiglu_mlps(
    model: nn.Module,
    *,
    save: SaveMode = DEFAULT_SAVE,
    check: bool = True,
) -> list[str]:
    """Replace, in place, every submodule of ``model`` with the LlamaMLP pattern by a ``SwiGLUMLP``
    holding the same weights (same device and dtype, frozen where they were), and return their names.

    Swap before building the optimizer (the parameters are new objects) and before wrapping the model
    in FSDP/DDP. With ``check`` (default), every candidate is first compared with the fused function
    on a few random rows; if any forward is not plain SwiGLU, ``ValueError`` is raised and nothing is
    swapped. Modules on the meta device (weights not materialised yet) cannot be compared and are
    swapped unchecked. Modules that do not match the pattern (GELU gates, biases, Linear subclasses,
    odd sizes) are left as they are. ``save`` goes to every ``SwiGLUMLP``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"swap_swiglu_mlps takes an nn.Module, got {type(model).__name__}")
    check_save_mode(save)
    candidates = [(name, module) for name, module in model.named_modules() if llama_mlp_pattern(module)]
    if any(not name for name, _ in candidates):
        raise ValueError("fused_swiglu: the model itself is an MLP; use SwiGLUMLP.from_mlp(model)")
    for name, module in candidates:
        _check_swappable(name, module, check)
    for name, module in candidates:
        parent_name, _, child = name.rpartition(".")
        setattr(
            model.get_submodule(parent_name),
            child,
            SwiGLUMLP.from_mlp(module, save=save),
        )
    return [name for name, _ in candidates]
