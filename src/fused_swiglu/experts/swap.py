"""Which routed-expert modules ``swap_swiglu_mlps`` fuses: transformers' standard expert layout (3-D
``gate_up_proj`` [E, 2I, H] as ``[gate; up]`` and ``down_proj`` [E, H, I] parameters, a SiLU ``act_fn``,
called as ``experts(hidden_states, top_k_index, top_k_weights)``: Mixtral, Qwen2/3-MoE, DeepSeek-V3,
OLMoE and most mixtures of experts of transformers 5.x), compared with the fused function on a few
random tokens before it is swapped."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..distributed import DISTRIBUTED, is_distributed
from ..layout import CHUNK
from ..mlp_layouts import is_silu
from .routed import SwiGLUExperts, pack_experts, swiglu_experts

CALL = ("hidden_states", "top_k_index", "top_k_weights")
#: transformers' expert-layout flags (``use_experts_implementation``) and the values the fused experts take.
STOCK_FLAGS = {
    "is_concatenated": True,  # [gate; up], not interleaved rows
    "is_transposed": False,
    "has_bias": False,
    "has_gate": True,
    "has_post_expert_norm": False,
    "_is_expert_parallel": False,
}
#: Attributes with which expert modules of some families change the SwiGLU.
CLAMPS = ("limit", "swiglu_limit", "alpha")


def has_expert_weights(module: nn.Module) -> bool:
    """Whether ``module`` holds 3-D ``gate_up_proj`` and ``down_proj`` parameters (a candidate)."""
    if isinstance(module, SwiGLUExperts):
        return False
    weights = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
    return all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights)


def experts_mismatch(module: nn.Module) -> str | None:
    """Why the expert module cannot be fused as it is, or None."""
    if torch.nn.utils.parametrize.is_parametrized(module):
        return "its expert weights are parametrized (e.g. LoRA on expert parameters), which is not fused"
    params = list(inspect.signature(module.forward).parameters)
    if tuple(params[:3]) != CALL:
        return f"it is called as forward({', '.join(params)}), not forward({', '.join(CALL)})"
    for flag, stock in STOCK_FLAGS.items():
        if getattr(module, flag, stock) != stock:
            return f"its {flag} is {getattr(module, flag)!r} (the fused experts take {stock!r})"
    gate = getattr(type(module), "_apply_gate", None)  # transformers' experts: the gate function
    if gate is not None and gate.__name__ != "_default_apply_gate":  # DeepSeek-V4 clamps its gate
        return "it applies a gate function of its own (_apply_gate), not plain SwiGLU"
    clamps = {name: getattr(module, name) for name in CLAMPS if getattr(module, name, None) is not None}
    if clamps:
        return "it clamps or scales the SwiGLU (" + ", ".join(f"{k}={v}" for k, v in clamps.items()) + ")"
    act = getattr(module, "act_fn", None)
    if not is_silu(act):
        return f"the activation is {type(act).__name__}, not SiLU"
    extra = [name for name, _ in module.named_children() if name != "act_fn"]
    if extra:
        return f"it has submodules beyond the experts' SwiGLU ({', '.join(extra)})"
    own = {name for name, _ in module.named_parameters(recurse=False)}
    if own != {"gate_up_proj", "down_proj"}:
        return f"it holds parameters beyond gate_up_proj and down_proj ({', '.join(sorted(own))})"
    gate_up, down = module.gate_up_proj, module.down_proj
    experts, two_inter, hidden = gate_up.shape
    if two_inter % (2 * CHUNK) or down.shape != (experts, hidden, two_inter // 2):
        return (
            f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
            f"[E, 2I, H] and [E, H, I] with I a multiple of {CHUNK}"
        )
    if not gate_up.is_floating_point() or gate_up.dtype != down.dtype:
        return f"its weights are {gate_up.dtype} and {down.dtype}"
    if gate_up.requires_grad != down.requires_grad:
        return "gate_up_proj and down_proj must both be trainable or both frozen"
    if is_distributed(gate_up) or is_distributed(down):
        return DISTRIBUTED
    if hasattr(module, "_hf_hook"):
        return "its weights are managed by accelerate hooks (offloading); swap before dispatching the model"
    return None


def experts_forward_differs(module: nn.Module) -> str | None:
    """Compare the module with the fused function on a few random tokens and routings; None where they
    agree or where there is nothing to compare (meta weights)."""
    gate_up = module.gate_up_proj
    if gate_up.device.type == "meta":
        return None
    experts, _, hidden = gate_up.shape
    generator = torch.Generator(device=gate_up.device).manual_seed(0)
    options = {"device": gate_up.device, "generator": generator}
    x = torch.randn(8, hidden, dtype=gate_up.dtype, **options)
    top_k = min(2, experts)
    scores = torch.rand(8, experts, **options)
    weights, index = torch.topk(scores.softmax(-1), top_k)
    with torch.no_grad():
        expected = module(x, index, weights).float()
        got = swiglu_experts(x, index, weights, pack_experts(gate_up), module.down_proj).float()
    error = ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    tolerance = {torch.float64: 1e-6, torch.float32: 5e-3}.get(gate_up.dtype, 3e-2)
    if error <= tolerance:
        return None
    return f"its forward differs from the routed SwiGLU experts (relative difference {error:.2e})"
