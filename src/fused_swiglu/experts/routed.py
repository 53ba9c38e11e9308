"""Routed experts whose experts are SwiGLU MLPs (Mixtral, Qwen-MoE, DeepSeek, OLMoE, ...), fused:

    y[t] = sum_j  w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),   e = index[t, j]

Each token's slots are grouped by expert (routing.py); the gate/up projections of every expert run as
one fused kernel with the SwiGLU in its epilogue (ops.py), the down projections as one grouped
GEMM; the routing weights scale the down projections' rows as each token's rows are summed (the
combine), and their gradient is the row sum of ``a`` times its gradient. What is saved per routed
slot between forward and backward, as for the dense MLP: the factors and ``a`` (3I,
``save="factors"``), the pre-activations (2I, ``"preact"``) or nothing (``"recompute"``, which
reruns the gate/up kernel in the backward); x's rows are gathered again in the backward rather
than kept.

Weights: ``gate_up_weight`` [E, 2I, H], each expert's rows packed as the dense MLP's (layout.py), and
``down_weight`` [E, H, I]. ``SwiGLUExperts`` holds them and reads and writes the checkpoint layout of
transformers' expert modules (``gate_up_proj`` [E, 2I, H] as ``[gate; up]``, ``down_proj`` [E, H, I]).
"""

from __future__ import annotations

import torch
from torch import nn

from ..functional import _autocast, check_save_mode
from ..layout import CHUNK, check_intermediate_size
from ..ops import _refuse_double_backward, _saved_tensors
from .ops import (
    EXPERTS_SAVE_MODES,
    experts_backward_down,
    experts_backward_gate_up,
    experts_combine,
    experts_forward,
    experts_inference,
)
from .routing import route

__all__ = ["SwiGLUExperts", "reference_swiglu_experts", "swiglu_experts"]


class RoutedExpertsFunction(torch.autograd.Function):
    """y [T, H]: each token's routed slots through their experts' SwiGLU MLPs, weighted and summed.

    The experts run in the ops (ops.py), which read x's rows by each row's token; the
    gradient's rows are gathered from dy here. Saved for the backward besides x, the weights and the
    routing: what the forward op saved for ``save``, per routed slot."""

    @staticmethod
    def forward(
        ctx,
        x,
        slot_weights,
        gate_up_weight,
        down_weight,
        rows,
        sources,
        token_of_row,
        tiles,
        used_tiles,
        ends,
        k,
        save,
    ):
        # Kept for the backward: each row's token (int32) and routing weight, not the slot order.
        w_rows = slot_weights[sources]
        weights = (gate_up_weight, down_weight)
        table = (tiles, used_tiles, ends)
        y_rows, saved, a = experts_forward(x, token_of_row, *weights, *table, save)
        ctx.save_for_backward(x, w_rows, *weights, rows, token_of_row, *table, saved, a)
        ctx.k, ctx.save, ctx.weights_dtype = k, save, slot_weights.dtype
        return experts_combine(y_rows, rows, k, slot_weights)

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        x, w_rows, gate_up_weight, down_weight, rows, token_of_row, *table, saved, a = _saved_tensors(ctx)
        if not torch.compiler.is_compiling():
            # Eagerly, what was saved is freed as the two ops finish with it, as a compiled backward does.
            ctx.maybe_clear_saved_tensors()  # only where the graph is not retained
        need_dx, need_dw, need_dgate_up, need_ddown = ctx.needs_input_grad[:4]
        weights = (gate_up_weight, down_weight)
        dw_rows, ddown, made = experts_backward_down(
            experts_combine(dy, token_of_row, 1, None),  # dy's rows, gathered
            x,
            token_of_row,
            w_rows,
            *weights,
            saved,
            a,
            *table,
            ctx.save,
            need_dw,
            need_ddown,
        )
        del a, w_rows  # with dy's rows, freed before the packed dW is made
        grad, ends = (made if ctx.save == "recompute" else saved), table[2]
        del saved, made
        dx_rows, dgate_up = experts_backward_gate_up(
            grad, x, token_of_row, gate_up_weight, ends, dw_rows, need_dx, need_dgate_up
        )
        del grad
        dx = experts_combine(dx_rows, rows, ctx.k, None) if need_dx else None
        dw = dw_rows[rows].to(ctx.weights_dtype) if need_dw else None  # back to slot order
        return dx, dw, (dgate_up if need_dgate_up else None), (ddown if need_ddown else None), *(None,) * 8


def _check(x, top_k_index, top_k_weights, gate_up_weight, down_weight) -> None:
    named = {"x": x, "top_k_index": top_k_index, "top_k_weights": top_k_weights}
    named |= {"gate_up_weight": gate_up_weight, "down_weight": down_weight}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if len({t.device for t in named.values()}) > 1:
        raise ValueError(
            "x, the routing and the weights must be on one device, got "
            + ", ".join(f"{n} on {t.device}" for n, t in named.items())
        )
    if x.dim() != 2 or gate_up_weight.dim() != 3 or down_weight.dim() != 3:
        raise ValueError(
            "expected x [tokens, hidden], gate_up_weight [experts, 2 * intermediate, hidden] and "
            f"down_weight [experts, hidden, intermediate]; got {tuple(x.shape)}, "
            f"{tuple(gate_up_weight.shape)} and {tuple(down_weight.shape)}"
        )
    experts, two_inter, hidden = gate_up_weight.shape
    if two_inter % 2 or down_weight.shape != (experts, hidden, two_inter // 2) or x.shape[1] != hidden:
        raise ValueError(
            f"x {tuple(x.shape)}, gate_up_weight {tuple(gate_up_weight.shape)} and down_weight "
            f"{tuple(down_weight.shape)} do not fit [T, H], [E, 2I, H] and [E, H, I]"
        )
    check_intermediate_size(two_inter // 2)
    if (
        top_k_index.dim() != 2
        or top_k_index.shape[0] != x.shape[0]
        or top_k_weights.shape != top_k_index.shape
    ):
        raise ValueError(
            f"top_k_index and top_k_weights must both be [tokens, k] with x's {x.shape[0]} tokens, got "
            f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"top_k_index must hold int32 or int64 expert ids, got {top_k_index.dtype}")
    if not x.dtype.is_floating_point or {gate_up_weight.dtype, down_weight.dtype} != {x.dtype}:
        raise TypeError(
            f"x and the weights must share a floating-point dtype, got x {x.dtype}, gate_up_weight "
            f"{gate_up_weight.dtype}, down_weight {down_weight.dtype}"
        )


def swiglu_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    save: str = "factors",
) -> torch.Tensor:
    """Routed SwiGLU experts: ``x`` [T, H], ``top_k_index`` [T, k] expert ids in ``[0, E)``,
    ``top_k_weights`` [T, k], ``gate_up_weight`` [E, 2I, H] packed per expert, ``down_weight``
    [E, H, I] -> [T, H] in x's dtype (module docstring). ``save``: ``"factors"``, ``"preact"`` or
    ``"recompute"``.

    Where the fused kernels do not run (support.py: e.g. bf16 on CPU, GPUs other than Hopper), the
    same steps run with the SwiGLU in PyTorch beside a grouped GEMM (one graph under
    ``torch.compile`` either way). Under ``torch.autocast``, x and the weights are
    cast to the autocast dtype first, like a matmul's inputs."""
    check_save_mode(save, EXPERTS_SAVE_MODES)
    x, gate_up_weight, down_weight = _autocast(x, gate_up_weight, down_weight)
    _check(x, top_k_index, top_k_weights, gate_up_weight, down_weight)
    if x.shape[0] == 0:
        return reference_swiglu_experts(x, top_k_index, top_k_weights, gate_up_weight, down_weight)
    # Cast once, above; inside, autocast would recast the grouped GEMMs' operands and outputs.
    with torch.autocast(x.device.type, enabled=False):
        return _routed(x, top_k_index, top_k_weights, gate_up_weight, down_weight, save)


def _routed(x, top_k_index, top_k_weights, gate_up_weight, down_weight, save: str) -> torch.Tensor:
    routes = route(top_k_index, gate_up_weight.shape[0])
    k = top_k_index.shape[1]
    slot_weights = top_k_weights.reshape(-1).to(x.dtype)
    table = (routes.tiles, routes.used_tiles, routes.ends)
    leaves = (x, slot_weights, gate_up_weight, down_weight)
    if torch.is_grad_enabled() and any(t.requires_grad for t in leaves):
        rows = (routes.rows, routes.sources, routes.tokens)
        return RoutedExpertsFunction.apply(*leaves, *rows, *table, k, save)
    y_rows = experts_inference(x, routes.tokens, gate_up_weight, down_weight, *table)
    return experts_combine(y_rows, routes.rows, k, slot_weights)


def reference_swiglu_experts(x, top_k_index, top_k_weights, gate_up_weight, down_weight) -> torch.Tensor:
    """The same function in plain PyTorch, expert by expert (it waits for the GPU to learn which
    experts were chosen); ``gate_up_weight`` packed as ``swiglu_experts`` takes it."""
    out = torch.zeros_like(x)
    inter = down_weight.shape[2]
    for expert in torch.unique(top_k_index).tolist():
        token, choice = torch.where(top_k_index == expert)
        packed = gate_up_weight[expert] @ x[token].t()  # [2I, n]
        up, gate = packed.view(inter // CHUNK, 2, CHUNK, -1).unbind(1)
        a = (torch.nn.functional.silu(gate) * up).reshape(inter, -1).t()
        y = (a * top_k_weights[token, choice, None].to(x.dtype)) @ down_weight[expert].t()
        out = out.index_add(0, token, y)
    return out


def pack_experts(gate_up_proj: torch.Tensor) -> torch.Tensor:
    """transformers' [E, 2I, H] ``[gate; up]`` expert weight -> the packed [E, 2I, H] (a new tensor)."""
    experts, two_inter, hidden = gate_up_proj.shape
    gate, up = gate_up_proj.view(experts, 2, two_inter // (2 * CHUNK), CHUNK, hidden).unbind(1)
    return torch.stack((up, gate), dim=2).reshape(experts, two_inter, hidden)


def unpack_experts(packed: torch.Tensor) -> torch.Tensor:
    """The packed [E, 2I, H] weight -> transformers' ``[gate; up]`` layout (a new tensor)."""
    experts, two_inter, hidden = packed.shape
    up, gate = packed.view(experts, two_inter // (2 * CHUNK), 2, CHUNK, hidden).unbind(2)
    return torch.stack((gate, up), dim=1).reshape(experts, two_inter, hidden)


class SwiGLUExperts(nn.Module):
    """The routed experts of a mixture-of-experts layer, fused: ``forward(hidden_states [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, the call of transformers' expert modules.

    Parameters ``gate_up_proj`` [E, 2I, H] (packed per expert) and ``down_proj`` [E, H, I]; the
    state dict holds ``gate_up_proj`` in transformers' ``[gate; up]`` layout, so checkpoints load and
    save with the stock model's keys and layout."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        save="factors",
        device=None,
        dtype=None,
    ):
        super().__init__()
        check_intermediate_size(intermediate_size)
        self.save = check_save_mode(save, EXPERTS_SAVE_MODES)
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_size, intermediate_size
        factory = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))
        self.reset_parameters()
        self._register_state_dict_hook(_state_dict_in_stock_layout)
        self._register_load_state_dict_pre_hook(_load_stock_layout)

    def reset_parameters(self) -> None:
        """Each expert's projections as ``nn.Linear`` initialises its weight: uniform in
        +-1/sqrt(fan_in)."""
        with torch.no_grad():
            for weight in (self.gate_up_proj, self.down_proj):
                bound = weight.shape[2] ** -0.5
                weight.uniform_(-bound, bound)

    @classmethod
    def from_experts(cls, experts: nn.Module, *, save: str = "factors") -> SwiGLUExperts:
        """The fused module of transformers' expert module ``experts``, sharing nothing with it."""
        gate_up, down = experts.gate_up_proj, experts.down_proj
        fused = cls(
            gate_up.shape[0],
            gate_up.shape[2],
            gate_up.shape[1] // 2,
            save=save,
            device=gate_up.device,
            dtype=gate_up.dtype,
        )
        with torch.no_grad():
            fused.gate_up_proj.copy_(pack_experts(gate_up))
            fused.down_proj.copy_(down)
        fused.gate_up_proj.requires_grad_(gate_up.requires_grad)
        fused.down_proj.requires_grad_(down.requires_grad)
        return fused

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return swiglu_experts(
            hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, save=self.save
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_dim}, "
            f"intermediate_size={self.intermediate_dim}, save={self.save!r}"
        )


def _state_dict_in_stock_layout(module, state_dict, prefix, local_metadata):
    key = prefix + "gate_up_proj"
    if key in state_dict:
        state_dict[key] = unpack_experts(state_dict[key])
    return state_dict


def _load_stock_layout(state_dict, prefix, *args):
    key = prefix + "gate_up_proj"
    if key in state_dict and state_dict[key].dim() == 3 and state_dict[key].shape[1] % (2 * CHUNK) == 0:
        state_dict[key] = pack_experts(state_dict[key])
