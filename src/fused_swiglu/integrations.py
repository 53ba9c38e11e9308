"""One call to put ``SwiGLUMLP`` into an existing model (Hugging Face LLaMA, Mistral, Qwen2, Falcon-H1
and the like): every module with the LlamaMLP pattern is swapped for the fused module, weights
copied; every module that looks like one but is left alone is reported with the reason."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Literal

import torch
from torch import nn

from .distributed import DISTRIBUTED, is_distributed
from .experts import SwiGLUExperts
from .experts.ops import EXPERTS_SAVE_MODES
from .experts.swap import experts_forward_differs, experts_mismatch, has_expert_weights
from .functional import DEFAULT_SAVE, SaveMode, check_save_mode
from .layout import CHUNK, pack_gate_up
from .lora import base_of, is_lora_layer
from .lora import refusal as lora_refusal
from .mlp_layouts import (
    ACTIVATIONS,
    PROJECTIONS,
    activation_of,
    gate_up_weights,
    is_silu,
    layout_of,
)
from .nn import SwiGLUMLP, fused_forward

_LOG = logging.getLogger("fused_swiglu")


class SwapReport(list):
    """The names of the swapped modules (a list, in model order; a module shared by several places
    is listed under each), and ``skipped``: ``{name: why}`` for the modules that have gate, up and
    down projections but were left alone."""

    def __init__(self, swapped: list[str], skipped: dict[str, str]) -> None:
        super().__init__(swapped)
        self.skipped = skipped


def llama_mlp_pattern(module: nn.Module) -> bool:
    """Whether ``module`` is a SwiGLU MLP that can be fused as it is: bias-free ``gate_proj``/``up_proj``
    [I, H] (or one ``gate_up_proj`` [2I, H] = [gate; up]) and ``down_proj`` [H, I] ``nn.Linear`` (not
    subclasses), a SiLU ``act_fn``/``activation_fn``, no other submodule, and I a multiple of 8."""
    return _mismatch(module) is None


def _has_projections(module: nn.Module) -> bool:
    return not isinstance(module, SwiGLUMLP) and layout_of(module) is not None


def _mismatch(module: nn.Module) -> str | None:
    """Why ``module`` cannot be fused as it is, or None."""
    if not _has_projections(module):
        return "no gate and up projections"
    layout = layout_of(module)
    names = PROJECTIONS[layout]
    linears = [getattr(module, name) for name in names]
    for name, m in zip(names, linears, strict=True):
        if is_lora_layer(m):
            if layout == "stacked":
                return f"{name} carries LoRA adapters on a stacked gate_up_proj, which is not fused"
            why = lora_refusal(m)
            if why is not None:
                return f"{name}: {why}"
        # Exactly nn.Linear: subclasses (quantized layers, other adapter wrappers) hold weights that
        # are not a plain floating-point matrix, or compute more than x @ W^T.
        base = base_of(m)
        if type(base) is not nn.Linear:
            kind = f"{type(base).__module__}.{type(base).__qualname__}"
            return f"{name} is a {kind}, not a plain nn.Linear (quantized layers are not fused)"
        if base.bias is not None:
            return f"{name} has a bias"
        if not base.weight.is_floating_point():
            return f"{name} holds {base.weight.dtype} weights"
    act = activation_of(module)
    if not is_silu(act):
        return f"the activation is {type(act).__name__}, not SiLU"
    dropout = {k: v for k, v in vars(module).items() if "dropout" in k and isinstance(v, float) and v > 0}
    if dropout:
        # Applied functionally in training only: an eval-mode comparison cannot see it.
        return f"it applies dropout ({', '.join(f'{k}={v}' for k, v in dropout.items())})"
    extra = [name for name, _ in module.named_children() if name not in {*names, *ACTIVATIONS}]
    if extra:
        # A dropout (or any other submodule) would be lost, also when the model is in eval mode now.
        return f"it has submodules beyond the SwiGLU ({', '.join(extra)}) that the fused module would drop"
    if layout == "stacked" and module.gate_up_proj.weight.shape[0] % 2:
        return "gate_up_proj has an odd number of rows"
    gate, up = gate_up_weights(module, layout)
    down = module.down_proj.weight
    inter, hidden = gate.shape
    if up.shape != gate.shape or down.shape != (hidden, inter):
        return (
            f"gate {tuple(gate.shape)}, up {tuple(up.shape)} and down {tuple(down.shape)} do not fit together"
        )
    if inter % CHUNK:
        return f"intermediate size {inter} is not a multiple of {CHUNK}"
    if gate.requires_grad != up.requires_grad:
        return "gate_proj and up_proj must both be trainable or both frozen to be packed"
    if any(is_distributed(base_of(m).weight) for m in linears):
        return DISTRIBUTED
    if any(hasattr(m, "_hf_hook") for m in (module, *linears)):
        return "its weights are managed by accelerate hooks (offloading); swap before dispatching the model"
    return None


def _forward_differs(module: nn.Module) -> str | None:
    """Compare the module with the fused function on a few random rows (one module at a time, so the
    extra memory is one packed weight): a module can match the pattern and still compute something
    else in its forward. None where they agree or where there is nothing to compare (meta weights)."""
    weight = module.down_proj.weight
    if weight.device.type == "meta":  # weights not materialised yet: checked by nothing, swapped as built
        return None
    # A private generator: swapping must not move the caller's random stream.
    generator = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(4, weight.shape[0], device=weight.device, dtype=weight.dtype, generator=generator)
    was_training = module.training
    # In training mode: a dropout, or anything else that acts in training only, shows as a difference.
    # The same seed for both: adapters' dropout draws the same masks in the same order.
    with torch.no_grad(), torch.random.fork_rng(devices=[weight.device] if weight.is_cuda else []):
        torch.manual_seed(0)
        expected = module.train()(x).float()
        packed = pack_gate_up(*gate_up_weights(module, layout_of(module)))
        torch.manual_seed(0)
        got = fused_forward(module, x, packed, DEFAULT_SAVE).float()
        module.train(was_training)
    error = ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    # Loose enough for TF32 and 16-bit rounding on either side; a different function is off by O(1).
    tolerance = {torch.float64: 1e-6, torch.float32: 5e-3}.get(weight.dtype, 3e-2)
    if error <= tolerance:
        return None
    return f"its forward differs from SwiGLU (relative difference {error:.2e})"


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The weights the fused module takes over, by name."""
    if has_expert_weights(module):
        return {name: getattr(module, name) for name in ("gate_up_proj", "down_proj")}
    return {f"{p}.weight": getattr(module, p).weight for p in PROJECTIONS[layout_of(module)]}


def _tied_outside(model: nn.Module, names: list[str], module: nn.Module) -> str | None:
    """Why packing would untie a weight the module shares with a parameter elsewhere, or None."""
    owners = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        owners[id(param)].append(name)
    prefixes = tuple(f"{n}." for n in names)
    for weight_name, weight in _weights(module).items():
        others = [n for n in owners[id(weight)] if not n.startswith(prefixes)]
        if others:
            return f"{weight_name} is tied to {others[0]}, and packing would untie it"
    return None


def _is_candidate(module: nn.Module) -> bool:
    return _has_projections(module) or has_expert_weights(module)


def _judge(
    module: nn.Module, model: nn.Module, names: list[str], check: bool, on_mismatch: str
) -> str | None:
    """Why a candidate is left alone, or None; raises for a forward that differs with ``"raise"``."""
    experts = has_expert_weights(module)
    why = (experts_mismatch(module) if experts else _mismatch(module)) or _tied_outside(model, names, module)
    if why is None and check:
        why = experts_forward_differs(module) if experts else _forward_differs(module)
        if why is not None and on_mismatch == "raise":
            pattern = "routed SwiGLU experts" if experts else "LlamaMLP"
            raise ValueError(
                f"fused_swiglu: {names[0]} ({type(module).__name__}) matches the {pattern} pattern but "
                f"{why}; nothing was swapped (on_mismatch='skip' leaves it alone and swaps the rest)"
            )
    return why


def _fused(module: nn.Module, save: str, fp8: bool) -> nn.Module:
    if has_expert_weights(module):
        return SwiGLUExperts.from_experts(module, save=save if save in EXPERTS_SAVE_MODES else "factors")
    return SwiGLUMLP.from_mlp(module, save=save, fp8=fp8)


def swap_swiglu_mlps(
    model: nn.Module,
    *,
    save: SaveMode = DEFAULT_SAVE,
    check: bool = True,
    on_mismatch: Literal["raise", "skip"] = "raise",
    fp8: bool = False,
) -> SwapReport:
    """Replace, in place, every submodule of ``model`` with the LlamaMLP pattern by a ``SwiGLUMLP``
    holding the same weights (same device and dtype, frozen where they were, Falcon-H1 multipliers
    carried), and return their names as a ``SwapReport`` (a list, with ``.skipped``).

    Swap before building the optimizer (the parameters are new objects) and before wrapping the model in
    FSDP/DDP or dispatching it with accelerate. A module shared by several places is replaced by one
    fused module in all of them. PEFT's LoRA adapters on gate, up and down are kept and computed inside
    the fused call (apply PEFT first, then swap; lora.py). Modules that have gate, up and down
    projections but cannot be fused as they are (DoRA and other LoRA variants, biases, other
    activations, extra submodules such as a dropout, weights tied elsewhere, offloaded weights, odd
    sizes) are left alone and reported in ``.skipped`` with the reason, and in a warning of the
    ``fused_swiglu`` logger. With ``check`` (default), every candidate is first compared with the fused
    function on a few random rows; a module whose forward differs raises ``ValueError`` and nothing is
    swapped, or with ``on_mismatch="skip"`` is left alone and reported. Modules on the meta device
    (weights not materialised yet) cannot be compared and are swapped as built. ``save`` and ``fp8``
    (the MLP's six GEMMs in FP8 on Hopper; ``swiglu_mlp``) go to every ``SwiGLUMLP``; with torchao's
    float8 training on the model's other Linears, swap first and convert after, with
    ``module_filter_fn=fused_swiglu.fp8.torchao_filter``.

    Routed experts in transformers' standard layout (experts/swap.py: Mixtral, Qwen2/3-MoE,
    DeepSeek-V3, OLMoE, ...) become ``SwiGLUExperts`` with the same weights and checkpoint layout, their
    router left as it is; with ``save="preact"`` they keep the factors (the experts have no
    pre-activation mode).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"swap_swiglu_mlps takes an nn.Module, got {type(model).__name__}")
    check_save_mode(save)
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
    if on_mismatch not in ("raise", "skip"):
        raise ValueError(f"on_mismatch must be 'raise' or 'skip', got {on_mismatch!r}")
    places: dict[int, list[str]] = defaultdict(list)
    modules: dict[int, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if _is_candidate(module):
            places[id(module)].append(name)
            modules[id(module)] = module
    if any(not name for names in places.values() for name in names):
        raise ValueError("fused_swiglu: the model itself is an MLP; use SwiGLUMLP.from_mlp(model)")
    skipped: dict[str, str] = {}
    chosen = []
    for key, module in modules.items():
        names = places[key]
        why = _judge(module, model, names, check, on_mismatch)
        if why is None:
            chosen.append(key)
        else:
            skipped.update(dict.fromkeys(names, why))
    for key in chosen:
        fused = _fused(modules[key], save, fp8)
        for name in places[key]:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, fused)
    swapped = [
        name
        for name, _ in model.named_modules(remove_duplicate=False)
        if name in {n for key in chosen for n in places[key]}
    ]
    _log(swapped, skipped, save, fp8)
    return SwapReport(swapped, skipped)


def _log(swapped: list[str], skipped: dict[str, str], save: str, fp8: bool) -> None:
    mode = f"save={save!r}" + (", fp8=True: dense MLPs in FP8, routed experts in 16 bits" if fp8 else "")
    line = f"fused_swiglu: swapped {len(swapped)} SwiGLU MLP(s) and routed expert module(s) ({mode})"
    if skipped:
        reasons = "; ".join(f"{name}: {why}" for name, why in skipped.items())
        _LOG.warning(f"{line}; left {len(skipped)} alone: {reasons}")
    elif not swapped:
        _LOG.warning(
            f"{line}: no module with gate, up and down projection Linears or routed expert weights was found"
        )
    else:
        _LOG.info(line)
