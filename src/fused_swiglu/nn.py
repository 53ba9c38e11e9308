"""Modules: ``SwiGLUMLP``, a drop-in replacement for Hugging Face ``LlamaMLP``-style modules, and
``SwiGLULinear``, the GLU half alone.

Both own the packed gate/up parameter ``gate_up_proj`` (the optimizer updates it packed; nothing is
repacked per step). Their ``state_dict`` speaks Hugging Face: ``gate_proj.weight``, ``up_proj.weight``
(and ``down_proj.weight``), so checkpoints load and save with no renaming; the packing happens in
the state-dict hooks.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .functional import (
    DEFAULT_SAVE,
    LINEAR_SAVE_MODES,
    SaveMode,
    check_save_mode,
    swiglu_linear,
    swiglu_mlp,
)
from .layout import check_intermediate_size, pack_gate_up, unpack_gate_up

_GATE, _UP, _PACKED = "gate_proj.weight", "up_proj.weight", "gate_up_proj"


def _dtensor():
    """torch's DTensor class (parameters under FSDP2 / tensor parallel), or None without distributed."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _full(t: torch.Tensor) -> torch.Tensor:
    dtensor = _dtensor()
    return t.full_tensor() if dtensor is not None and isinstance(t, dtensor) else t


def _distributed_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (the same full tensor on every rank) spread the way ``like`` is, if ``like`` is a DTensor.

    The packed layout interleaves 8-row chunks, so a row-sharded packed weight cannot be unpacked
    shard by shard: the state-dict hooks go through the full tensor (checkpointing, not the step).
    """
    dtensor = _dtensor()
    if dtensor is None or not isinstance(like, dtensor):
        return t
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, like.device_mesh, like.placements)


def _unpack_state_dict(module, state_dict, prefix, local_metadata) -> None:
    packed = state_dict.pop(prefix + _PACKED)
    gate, up = unpack_gate_up(_full(packed.detach()))
    state_dict[prefix + _GATE], state_dict[prefix + _UP] = (
        _distributed_like(gate, packed),
        _distributed_like(up, packed),
    )


def _pack_state_dict(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """Packs the Hugging Face ``gate_proj.weight`` and ``up_proj.weight`` into ``gate_up_proj``. A half
    that is absent keeps the module's current values and is reported missing under its own name (an
    error with ``strict``, as any missing key is); a half that is there is loaded."""
    keys = prefix + _GATE, prefix + _UP
    present = [key in state_dict for key in keys]
    if prefix + _PACKED in state_dict:
        return
    missing.extend(key for key, there in zip(keys, present, strict=True) if not there)
    if not any(present):
        state_dict[prefix + _PACKED] = module.gate_up_proj.detach()  # nothing to load: left as it is
        return
    current = (None, None) if all(present) else unpack_gate_up(_full(module.gate_up_proj.detach()))
    gate, up = (
        _full(state_dict.pop(key)) if there else mine
        for key, there, mine in zip(keys, present, current, strict=True)
    )
    state_dict[prefix + _PACKED] = _distributed_like(pack_gate_up(gate, up), module.gate_up_proj)


def _add_packed_gate_up(module: nn.Module, hidden_size: int, intermediate_size: int, factory: dict) -> None:
    for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(size).__name__}")
        if size <= 0:
            raise ValueError(f"{name} must be positive, got {size}")
    check_intermediate_size(intermediate_size)
    module.hidden_size = hidden_size
    module.intermediate_size = intermediate_size
    module.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, **factory))
    module.register_state_dict_post_hook(_unpack_state_dict)
    module.register_load_state_dict_pre_hook(_pack_state_dict)


def _reset_packed_gate_up(weight: nn.Parameter) -> None:
    # nn.Linear's default; every packed row has fan-in hidden_size, as in the two separate Linears.
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


# Activation modules that compute SiLU: torch's, and the name transformers has used for its own.
_SILU_TYPES = ("SiLU", "SiLUActivation")


def is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in _SILU_TYPES


def multiplier_of(mlp: nn.Module, name: str) -> float:
    """The module's ``gate_multiplier`` or ``down_multiplier`` (Falcon-H1 sets them), else 1.0."""
    value = getattr(mlp, name, 1.0)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"from_mlp: {type(mlp).__name__}.{name} must be a number, got {type(value).__name__}")
    return float(value)


def _check_llama_mlp(mlp) -> None:
    """Refuse, naming the problem, a module ``SwiGLUMLP.from_mlp`` would copy into another function."""
    names = ("gate_proj", "up_proj", "down_proj")
    linears = [getattr(mlp, name, None) for name in names]
    if not all(isinstance(m, nn.Linear) for m in linears):
        found = ", ".join(f"{n}: {type(m).__name__}" for n, m in zip(names, linears, strict=True))
        raise TypeError(f"from_mlp needs nn.Linear gate_proj, up_proj and down_proj children; got {found}")
    if any(m.bias is not None for m in linears):
        raise ValueError("from_mlp: the fused MLP has no biases; this module's projections have one")
    act = getattr(mlp, "act_fn", None)
    if act is not None and not is_silu(act):
        raise ValueError(
            f"from_mlp: the fused MLP computes SiLU; this module's act_fn is {type(act).__name__}"
        )
    (gate, up, down) = (m.weight for m in linears)
    if up.shape != gate.shape or down.shape != gate.shape[::-1]:
        raise ValueError(
            f"from_mlp: gate {tuple(gate.shape)}, up {tuple(up.shape)} and down {tuple(down.shape)} "
            "weights must be [I, H], [I, H] and [H, I]"
        )


class SwiGLUMLP(nn.Module):
    """``down_multiplier * down_proj(silu(gate_multiplier * gate_proj(x)) * up_proj(x))``, fused.

    Args:
        hidden_size: model width ``H``.
        intermediate_size: MLP width ``I`` (a multiple of 8).
        save: training memory mode: ``"factors"`` (default, fastest; 3I elements kept per token),
            ``"preact"`` (2I) or ``"recompute"`` (none; one more GEMM in the backward); may be changed
            on the instance.
        gate_multiplier, down_multiplier: Falcon-H1 style scalar multipliers.
        device, dtype: of the parameters.

    Parameters: ``gate_up_proj`` ``[2I, H]`` (packed, see :mod:`fused_swiglu.layout`) and
    ``down_proj.weight`` ``[H, I]``, initialised like ``nn.Linear``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        save: SaveMode = DEFAULT_SAVE,
        gate_multiplier: float = 1.0,
        down_multiplier: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_save_mode(save)
        factory = {"device": device, "dtype": dtype}
        _add_packed_gate_up(self, hidden_size, intermediate_size, factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)
        self.save = save
        self.gate_multiplier = gate_multiplier
        self.down_multiplier = down_multiplier
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_packed_gate_up(self.gate_up_proj)
        self.down_proj.reset_parameters()

    @classmethod
    def from_mlp(cls, mlp: nn.Module, **kwargs) -> SwiGLUMLP:
        """Build from a module with ``gate_proj``/``up_proj``/``down_proj`` ``nn.Linear`` children
        (e.g. ``LlamaMLP``), copying its weights, whether each is trainable, and its
        ``gate_multiplier``/``down_multiplier`` attributes where it has them (Falcon-H1). ``kwargs`` go
        to the constructor and take precedence."""
        _check_llama_mlp(mlp)
        for name in ("gate_multiplier", "down_multiplier"):
            kwargs.setdefault(name, multiplier_of(mlp, name))
        inter, hidden = mlp.gate_proj.weight.shape
        weight = mlp.gate_proj.weight
        # Built on the meta device and then given memory: no random initialisation that the copy
        # would overwrite anyway (it would cost time and move the caller's random stream).
        new = cls(hidden, inter, device="meta", dtype=weight.dtype, **kwargs).to_empty(device=weight.device)
        new.load_state_dict(mlp.state_dict())
        # Frozen weights stay frozen; one packed parameter cannot hold a frozen and a trainable half.
        gate_trains, up_trains = mlp.gate_proj.weight.requires_grad, mlp.up_proj.weight.requires_grad
        if gate_trains != up_trains:
            raise ValueError("gate_proj and up_proj must both be trainable or both frozen to be packed")
        new.gate_up_proj.requires_grad_(gate_trains)
        new.down_proj.weight.requires_grad_(mlp.down_proj.weight.requires_grad)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.down_proj) is not nn.Linear:
            # Wrapped after the swap (e.g. a PEFT LoRA layer): run it as a module, so that what it
            # adds to the projection is computed and trained, not bypassed by reading its weight.
            save = "recompute" if self.save == "recompute" else "factors"
            a = swiglu_linear(x, self.gate_up_proj, gate_multiplier=self.gate_multiplier, save=save)
            y = self.down_proj(a)
            return y if self.down_multiplier == 1.0 else y * self.down_multiplier
        return swiglu_mlp(
            x,
            self.gate_up_proj,
            self.down_proj.weight,
            gate_multiplier=self.gate_multiplier,
            down_multiplier=self.down_multiplier,
            save=self.save,
        )

    def extra_repr(self) -> str:
        parts = [f"hidden_size={self.hidden_size}", f"intermediate_size={self.intermediate_size}"]
        parts.append(f"save={self.save!r}")
        if self.gate_multiplier != 1.0 or self.down_multiplier != 1.0:
            parts.append(f"gate_multiplier={self.gate_multiplier}, down_multiplier={self.down_multiplier}")
        return ", ".join(parts)


class SwiGLULinear(nn.Module):
    """The GLU half ``silu(gate_multiplier * gate_proj(x)) * up_proj(x)``, ``[..., H] -> [..., I]``, fused.

    For blocks that own their down projection (Megatron-style stacks, MoE experts). ``save`` is
    ``"factors"`` (2I elements kept per token, an in-place two-multiply backward) or ``"recompute"``.
    Parameter: ``gate_up_proj`` ``[2I, H]``, packed; state-dict keys ``gate_proj.weight``,
    ``up_proj.weight``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        save: str = "factors",
        gate_multiplier: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_save_mode(save, LINEAR_SAVE_MODES)
        _add_packed_gate_up(self, hidden_size, intermediate_size, {"device": device, "dtype": dtype})
        self.save = save
        self.gate_multiplier = gate_multiplier
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_packed_gate_up(self.gate_up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_linear(
            x,
            self.gate_up_proj,
            gate_multiplier=self.gate_multiplier,
            save=self.save,
        )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, save={self.save!r}"
            + (f", gate_multiplier={self.gate_multiplier}" if self.gate_multiplier != 1.0 else "")
        )
