"""Modules: ``SwiGLUMLP``, a drop-in replacement for Hugging Face ``LlamaMLP``-style modules, and
``SwiGLULinear``, the GLU half alone.

Both own the packed gate/up parameter ``gate_up_proj`` (the optimizer updates it packed; nothing is
repacked per step). Their ``state_dict`` speaks Hugging Face: ``gate_proj.weight``, ``up_proj.weight``
(and ``down_proj.weight``), so checkpoints load and save with no renaming; the packing happens in
the state-dict hooks.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers

import torch
from torch import nn

from .distributed import is_tensor_parallel, tensor_parallel_glu, tensor_parallel_mlp
from .functional import (
    DEFAULT_SAVE,
    LINEAR_SAVE_MODES,
    SaveMode,
    check_fp8,
    check_save_mode,
    fp8_mlp_with_adapters,
    swiglu_linear,
    swiglu_mlp,
)
from .layout import check_intermediate_size, pack_gate_up, unpack_gate_up
from .lora import PackedBase, adapter_output, base_of, has_active_adapters, is_lora_layer, low_rank_term
from .mlp_layouts import CHECKPOINT_KEYS, CheckpointKeys, check_swiglu_mlp, gate_up_weights, multiplier_of

_PACKED, _STACKED = "gate_up_proj", "gate_up_proj.weight"


def _base_keys(module) -> tuple[str, str]:
    """The checkpoint keys of the gate and up weights: PEFT's ``<proj>.base_layer.weight`` where the
    projection carries a LoRA layer (lora.py), else ``<proj>.weight``."""
    return tuple(
        f"{name}.base_layer.weight" if is_lora_layer(getattr(module, name, None)) else f"{name}.weight"
        for name in ("gate_proj", "up_proj")
    )


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
    if module.checkpoint_keys == "stacked":
        state_dict[prefix + _STACKED] = _distributed_like(torch.cat((gate, up)), packed)
        return
    gate_key, up_key = _base_keys(module)
    state_dict[prefix + gate_key] = _distributed_like(gate, packed)
    state_dict[prefix + up_key] = _distributed_like(up, packed)


def _pack_state_dict(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """Packs the Hugging Face ``gate_proj.weight`` and ``up_proj.weight`` into ``gate_up_proj``. A half
    that is absent keeps the module's current values and is reported missing under its own name (an
    error with ``strict``, as any missing key is); a half that is there is loaded."""
    if prefix + _PACKED in state_dict:
        return
    if module.checkpoint_keys == "stacked":
        _pack_stacked(module, state_dict, prefix, missing)
        return
    keys = tuple(prefix + key for key in _base_keys(module))
    present = [key in state_dict for key in keys]
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


def _pack_stacked(module, state_dict, prefix, missing) -> None:
    """``gate_up_proj.weight`` = [gate; up] (Phi-3, GLM-4) into the packed parameter; absent, the
    parameter keeps its values and the key is reported missing."""
    if prefix + _STACKED not in state_dict:
        missing.append(prefix + _STACKED)
        state_dict[prefix + _PACKED] = module.gate_up_proj.detach()  # nothing to load: left as it is
        return
    stacked = _full(state_dict.pop(prefix + _STACKED))
    if stacked.dim() != 2 or stacked.shape[0] % 2:
        raise ValueError(
            f"{prefix + _STACKED} must be [2 * intermediate, hidden], got {tuple(stacked.shape)}"
        )
    state_dict[prefix + _PACKED] = _distributed_like(pack_gate_up(*stacked.chunk(2)), module.gate_up_proj)


def _add_packed_gate_up(
    module: nn.Module, hidden_size: int, intermediate_size: int, checkpoint_keys: str, factory: dict
) -> None:
    for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(size).__name__}")
        if size <= 0:
            raise ValueError(f"{name} must be positive, got {size}")
    check_intermediate_size(intermediate_size)
    if checkpoint_keys not in CHECKPOINT_KEYS:
        raise ValueError(f"checkpoint_keys must be one of {list(CHECKPOINT_KEYS)}, got {checkpoint_keys!r}")
    module.checkpoint_keys = checkpoint_keys
    module.hidden_size = hidden_size
    module.intermediate_size = intermediate_size
    module.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, **factory))
    module.register_state_dict_post_hook(_unpack_state_dict)
    module.register_load_state_dict_pre_hook(_pack_state_dict)


def _reset_packed_gate_up(weight: nn.Parameter) -> None:
    # nn.Linear's default; every packed row has fan-in hidden_size, as in the two separate Linears.
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def _warn_adapters_after_swap(mlp: nn.Module) -> None:
    """PEFT applied after the swap adapts ``down_proj`` only (gate and up are packed): said once."""
    if not getattr(mlp, "_warned_adapters_after_swap", False) and getattr(mlp, "gate_proj", None) is None:
        mlp._warned_adapters_after_swap = True
        logging.getLogger("fused_swiglu").warning(
            "fused_swiglu: this fused MLP has a LoRA adapter on down_proj but none on gate and up: PEFT "
            "was applied after the swap, where gate_proj and up_proj are packed and cannot be targeted. "
            "Apply PEFT first, then swap_swiglu_mlps, to adapt them."
        )


def _warn_fp8_not_taken(mlp: nn.Module) -> None:
    """An FP8 module whose down projection is not an nn.Linear (or LoRA's over one) runs in 16 bits:
    said once."""
    if not getattr(mlp, "_warned_fp8_not_taken", False):
        mlp._warned_fp8_not_taken = True
        logging.getLogger("fused_swiglu").warning(
            "fused_swiglu: this MLP has fp8=True but a down projection other than nn.Linear or a LoRA "
            "layer over one (%s): it runs in 16 bits, the down projection as it is.",
            type(mlp._modules["down_proj"]).__name__,
        )


def fused_forward(
    mlp: nn.Module, x: torch.Tensor, gate_up_weight: torch.Tensor, save: str, fp8: bool = False
) -> torch.Tensor:
    """The fused forward of ``mlp`` (a ``SwiGLUMLP``, or a module the swap is about to replace) with
    its gate and up weights packed in ``gate_up_weight``: one fused call (in FP8 with ``fp8``), or
    with adapters (lora.py) or a down projection wrapped after the swap, the GLU operator with the
    gate and up adapters in its GEMM and the down projection run as the module it is, so that
    nothing it adds is bypassed. In FP8 the adapters join the FP8 MLP (``fp8_mlp_with_adapters``);
    another down projection than LoRA's over an nn.Linear runs the module in 16 bits."""
    gate_multiplier = multiplier_of(mlp, "gate_multiplier")
    down_multiplier = multiplier_of(mlp, "down_multiplier")
    submodules = mlp._modules  # read directly: a missing name through getattr costs a raised error
    gate, up, down = submodules.get("gate_proj"), submodules.get("up_proj"), submodules["down_proj"]
    low_rank = low_rank_term(x, gate, up, gate_up_weight.shape[0] // 2)
    if low_rank is None and type(down) is nn.Linear:
        weights = (gate_up_weight, down.weight)
        scalars = {"gate_multiplier": gate_multiplier, "down_multiplier": down_multiplier, "save": save}
        if fp8:
            scalars["fp8"] = True
        if is_tensor_parallel(gate_up_weight):  # each rank its shards, the parts summed (tensor_parallel.py)
            return tensor_parallel_mlp(functools.partial(swiglu_mlp, **scalars), x, *weights)
        return swiglu_mlp(x, *weights, **scalars)
    if is_tensor_parallel(gate_up_weight):
        raise TypeError("fused_swiglu: a tensor-parallel SwiGLUMLP runs without adapters on its projections")
    if low_rank is None and is_lora_layer(down) and not torch.compiler.is_compiling():
        _warn_adapters_after_swap(mlp)
    down_base = base_of(down)
    if fp8 and type(down_base) is nn.Linear:
        multipliers = {"gate_multiplier": gate_multiplier, "down_multiplier": down_multiplier}
        with_a = has_active_adapters(down)
        taken = fp8_mlp_with_adapters(
            x, gate_up_weight, down_base.weight, low_rank, with_a, **multipliers, save=save
        )
        if taken is not None:
            y, a = taken
            extra = None if a is None else adapter_output(down, a)  # a carries down_multiplier
            return y if extra is None else y + extra
    elif fp8 and not torch.compiler.is_compiling():
        _warn_fp8_not_taken(mlp)
    linear_save = "recompute" if save == "recompute" else "factors"
    a = swiglu_linear(x, gate_up_weight, gate_multiplier=gate_multiplier, save=linear_save, low_rank=low_rank)
    y = down(a)
    return y if down_multiplier == 1.0 else y * down_multiplier


class SwiGLUMLP(nn.Module):
    """``down_multiplier * down_proj(silu(gate_multiplier * gate_proj(x)) * up_proj(x))``, fused.

    Args:
        hidden_size: model width ``H``.
        intermediate_size: MLP width ``I`` (a multiple of 8).
        save: training memory mode: ``"factors"`` (default, fastest; 3I elements kept per token),
            ``"preact"`` (2I) or ``"recompute"`` (none; one more GEMM in the backward); may be changed
            on the instance.
        fp8: run the MLP's six GEMMs in FP8 (``swiglu_mlp``'s ``fp8``: Hopper, hidden and
            intermediate sizes multiples of 128); may be changed on the instance. The parameters
            keep their dtype, and checkpoints are the same.
        gate_multiplier, down_multiplier: Falcon-H1 style scalar multipliers.
        checkpoint_keys: the state-dict keys of gate and up: ``"separate"`` (default;
            ``gate_proj.weight`` and ``up_proj.weight``, as LlamaMLP) or ``"stacked"``
            (``gate_up_proj.weight`` = [gate; up], as Phi-3 and GLM-4).
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
        checkpoint_keys: CheckpointKeys = "separate",
        fp8: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_save_mode(save)
        factory = {"device": device, "dtype": dtype}
        _add_packed_gate_up(self, hidden_size, intermediate_size, checkpoint_keys, factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)
        self.down_proj.fused_swiglu_down = True  # torchao's float8 conversion leaves it (fp8.torchao_filter)
        self.save = save
        self.fp8 = check_fp8(fp8, hidden_size, intermediate_size)
        self.gate_multiplier = gate_multiplier
        self.down_multiplier = down_multiplier
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_packed_gate_up(self.gate_up_proj)
        self.down_proj.reset_parameters()

    @classmethod
    def from_mlp(cls, mlp: nn.Module, **kwargs) -> SwiGLUMLP:
        """Build from a SwiGLU MLP module with ``gate_proj``/``up_proj``/``down_proj`` ``nn.Linear``
        children (e.g. ``LlamaMLP``) or ``gate_up_proj``/``down_proj`` (Phi-3, GLM-4), copying its
        weights, whether each is trainable, its state-dict keys, and its ``gate_multiplier`` /
        ``down_multiplier`` attributes where it has them (Falcon-H1). ``kwargs`` go to the
        constructor and take precedence."""
        try:
            layout = check_swiglu_mlp(mlp)
        except (TypeError, ValueError) as error:
            raise type(error)(f"from_mlp: {error}") from None
        for name in ("gate_multiplier", "down_multiplier"):
            kwargs.setdefault(name, multiplier_of(mlp, name))
        kwargs.setdefault("checkpoint_keys", layout)
        weight = mlp.down_proj.weight
        hidden, inter = weight.shape
        # Built on the meta device and then given memory: no random initialisation that the copy
        # would overwrite anyway (it would cost time and move the caller's random stream).
        new = cls(hidden, inter, device="meta", dtype=weight.dtype, **kwargs).to_empty(device=weight.device)
        gate, up = gate_up_weights(mlp, layout)
        if any(is_lora_layer(getattr(mlp, name, None)) for name in ("gate_proj", "up_proj", "down_proj")):
            # PEFT's adapter layers move in; the gate and up base weights are packed (lora.py).
            with torch.no_grad():
                new.gate_up_proj.copy_(pack_gate_up(gate, up))
            new.down_proj = mlp.down_proj
            for name in ("gate_proj", "up_proj"):
                layer = getattr(mlp, name)
                if is_lora_layer(layer):
                    layer.base_layer = PackedBase(name)
                    setattr(new, name, layer)
        else:
            asked, new.checkpoint_keys = new.checkpoint_keys, layout  # loaded in the module's own keys
            new.load_state_dict(mlp.state_dict())
            new.checkpoint_keys = asked
        # Frozen weights stay frozen; one packed parameter cannot hold a frozen and a trainable half.
        if gate.requires_grad != up.requires_grad:
            raise ValueError("gate_proj and up_proj must both be trainable or both frozen to be packed")
        new.gate_up_proj.requires_grad_(gate.requires_grad)
        new.down_proj.weight.requires_grad_(mlp.down_proj.weight.requires_grad)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_forward(self, x, self.gate_up_proj, self.save, self.fp8)

    def extra_repr(self) -> str:
        parts = [f"hidden_size={self.hidden_size}", f"intermediate_size={self.intermediate_size}"]
        parts.append(f"save={self.save!r}")
        if self.fp8:
            parts.append("fp8=True")
        if self.gate_multiplier != 1.0 or self.down_multiplier != 1.0:
            parts.append(f"gate_multiplier={self.gate_multiplier}, down_multiplier={self.down_multiplier}")
        if self.checkpoint_keys != "separate":
            parts.append(f"checkpoint_keys={self.checkpoint_keys!r}")
        return ", ".join(parts)


class SwiGLULinear(nn.Module):
    """The GLU half ``silu(gate_multiplier * gate_proj(x)) * up_proj(x)``, ``[..., H] -> [..., I]``, fused.

    For blocks that own their down projection (Megatron-style stacks, MoE experts). ``save`` is
    ``"factors"`` (2I elements kept per token, an in-place two-multiply backward) or ``"recompute"``.
    Parameter: ``gate_up_proj`` ``[2I, H]``, packed; state-dict keys ``gate_proj.weight`` and
    ``up_proj.weight``, or with ``checkpoint_keys="stacked"`` ``gate_up_proj.weight``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        save: str = "factors",
        gate_multiplier: float = 1.0,
        checkpoint_keys: CheckpointKeys = "separate",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_save_mode(save, LINEAR_SAVE_MODES)
        factory = {"device": device, "dtype": dtype}
        _add_packed_gate_up(self, hidden_size, intermediate_size, checkpoint_keys, factory)
        self.save = save
        self.gate_multiplier = gate_multiplier
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_packed_gate_up(self.gate_up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scalars = {"gate_multiplier": self.gate_multiplier, "save": self.save}
        if is_tensor_parallel(self.gate_up_proj):  # a DTensor sharded on its last dim (tensor_parallel.py)
            return tensor_parallel_glu(functools.partial(swiglu_linear, **scalars), x, self.gate_up_proj)
        return swiglu_linear(x, self.gate_up_proj, **scalars)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, save={self.save!r}"
            + (f", gate_multiplier={self.gate_multiplier}" if self.gate_multiplier != 1.0 else "")
        )
