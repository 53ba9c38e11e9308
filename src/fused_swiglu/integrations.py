"""One call to put ``SwiGLUMLP`` into an existing model (Hugging Face LLaMA, Mistral, Qwen2 and the
like): every module with the LlamaMLP pattern is swapped for the fused module, weights copied."""

from __future__ import annotations

import torch
from torch import nn

from .functional import DEFAULT_SAVE, SaveMode, check_save_mode
from .layout import CHUNK
from .nn import SwiGLUMLP

# Activation modules that compute SiLU: torch's, and the name transformers has used for its own.
_SILU_TYPES = ("SiLU", "SiLUActivation")


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in _SILU_TYPES


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
        and _is_silu(getattr(module, "act_fn", None))
    )


def _check_same_function(name: str, old: nn.Module, new: SwiGLUMLP) -> None:
    """A module can match the pattern and still compute something else in its forward (an extra
    term, a dropout): compare the two on a few random rows and refuse the swap if they disagree."""
    weight = new.down_proj.weight
    # A private generator: swapping must not move the caller's random stream.
    generator = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(4, new.hidden_size, device=weight.device, dtype=weight.dtype, generator=generator)
    with torch.no_grad():
        expected, got = old(x).float(), new(x).float()
    error = ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    tolerance = 1e-4 if weight.dtype in (torch.float32, torch.float64) else 3e-2
    if not error <= tolerance:
        raise ValueError(
            f"fused_swiglu: {name} ({type(old).__name__}) matches the LlamaMLP pattern but its forward "
            f"differs from SwiGLU (relative difference {error:.2e}); it was not swapped"
        )


def swap_swiglu_mlps(model: nn.Module, *, save: SaveMode = DEFAULT_SAVE, check: bool = True) -> list[str]:
    """Replace, in place, every submodule of ``model`` with the LlamaMLP pattern by a ``SwiGLUMLP``
    holding the same weights (same device and dtype), and return their names.

    Swap before building the optimizer (the parameters are new objects) and before wrapping the model
    in FSDP/DDP. With ``check`` (default), each swap is first compared with the original module on a
    few random rows, and a module whose forward is not plain SwiGLU raises ``ValueError``; modules on
    the meta device (weights not materialised yet) cannot be compared and are swapped unchecked.
    Modules that do not match the pattern (GELU gates, biases, odd sizes) are left as they are.
    """
    check_save_mode(save)
    swapped = []
    for name, module in list(model.named_modules()):
        if not llama_mlp_pattern(module):
            continue
        if not name:
            raise ValueError("fused_swiglu: the model itself is an MLP; use SwiGLUMLP.from_mlp(model)")
        fused = SwiGLUMLP.from_mlp(module, save=save)
        if check and fused.down_proj.weight.device.type != "meta":  # meta weights hold no values
            _check_same_function(name, module, fused)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fused)
        swapped.append(name)
    return swapped
