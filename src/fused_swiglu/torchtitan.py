"""torchtitan overrides: the fused SwiGLU MLP and routed experts inside torchtitan's own modules
(torchtitan 0.3; ``pip install "fused-swiglu[torchtitan]"``, then ``pip install --no-deps
"torchtitan==0.3.*"``: its ``datasets`` pin conflicts with transformers 5).

On torchtitan's command line (one token, the two factories comma-separated)::

    --override.imports fused_swiglu.torchtitan.fused_feed_forward,\
fused_swiglu.torchtitan.fused_grouped_experts

with options as JSON (``'fused_swiglu.torchtitan.fused_feed_forward={"save": "preact"}'``), or from
Python for a recipe, on a model config whose sharding is set (after ``update_from_config``)::

    fused_swiglu.torchtitan.apply_fused(model_config, save="factors")

* ``FusedFeedForward`` takes the place of ``FeedForward`` (``w2(silu(w1(x)) * w3(x))``): the gate and
  up weights become one packed parameter ``gate_up`` [2F, D] (layout.py), ``w2`` stays, and the
  whole MLP is one fused call (``swiglu_mlp``). Tensor parallelism shards ``gate_up`` by rows: each
  rank holds whole chunk pairs, the gate and up rows of its intermediate columns, a packed weight of
  its own (F a multiple of 8 x the degree); ``w2`` by columns as before. The module's output is the
  partial sum that ``w2``'s row-parallel output was, reduced (or reduce-scattered) as ``w2``'s was.
* ``FusedGroupedExperts`` takes the place of ``GroupedExperts``: ``gate_up`` [E, 2F, D] packed per
  expert, ``w2_EDF`` as it was, the experts one fused call over the rows torchtitan grouped
  (``swiglu_grouped_experts``), padding rows included. Expert parallelism shards the experts,
  tensor parallelism ``gate_up``'s rows as above.
* Checkpoints keep torchtitan's keys (``w1.weight``, ``w3.weight``; ``w1_EFD``, ``w3_EFD``): a run
  can switch the fused modules on or off and resume from the same checkpoint.
* A ``FeedForward`` whose projections another converter changed first (torchtitan's float8 or
  LoRA) is left as it is, with a warning, never fused silently past the user's choice; exclude it
  from that converter and pass ``fp8=True`` to train it in the library's FP8 recipe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import spmd_types as spmd
import torch
from torch import nn
from torchtitan.config import derive, override
from torchtitan.config.override import OverrideConfig, apply_overrides
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.decoder_sharding import dense_activation_placement, dense_param_placement
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.protocols.sharding import LocalMapConfig, ShardingConfig

from .experts.grouped import swiglu_grouped_experts
from .experts.ops import EXPERTS_SAVE_MODES
from .functional import DEFAULT_SAVE, check_fp8, check_save_mode, swiglu_mlp
from .layout import CHUNK

__all__ = [
    "FusedFeedForward",
    "FusedGroupedExperts",
    "FusedSelectiveAC",
    "apply_fused",
    "fused_feed_forward",
    "fused_grouped_experts",
    "fused_selective_ac",
]

_LOG = logging.getLogger("fused_swiglu")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard (DTensor backends); a plain tensor as it is (spmd_types)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _unpack(packed: torch.Tensor, lead: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a packed [..., 2F, D] weight, views taken along the chunks (a tensor-parallel
    shard of whole chunk pairs stays one)."""
    two_inter, hidden = packed.shape[-2:]
    chunked = packed.view(*lead, two_inter // (2 * CHUNK), 2, CHUNK, hidden)
    up, gate = chunked.unbind(len(lead) + 1)
    return gate.reshape(*lead, two_inter // 2, hidden), up.reshape(*lead, two_inter // 2, hidden)


def _pack(gate: torch.Tensor, up: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    inter, hidden = gate.shape[-2:]
    chunks = (*lead, inter // CHUNK, CHUNK, hidden)
    return torch.stack((up.view(chunks), gate.view(chunks)), dim=len(lead) + 1).reshape(
        *lead, 2 * inter, hidden
    )


def _gate_up_init(gate_init, up_init, experts: int | None = None):
    """``gate_up``'s initialiser from the stock gate and up ones: each draws a whole weight of its
    own shape (replicated, for a sharded parameter: ``new_empty``), then the pair is packed and
    copied in (each rank keeping its shard)."""
    lead = () if experts is None else (experts,)

    def init(t: torch.Tensor) -> None:
        shape = (*lead, t.shape[-2] // 2, t.shape[-1])
        gate, up = t.new_empty(shape), t.new_empty(shape)
        gate_init(gate)
        up_init(up)
        with torch.no_grad():
            t.copy_(_pack(gate, up, lead))

    return init


class FusedFeedForward(FeedForward):
    """torchtitan's ``FeedForward`` as one fused SwiGLU MLP (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        save: str = DEFAULT_SAVE
        fp8: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        inter, hidden = config.w1.out_features, config.w1.in_features
        del self.w1, self.w3
        self.gate_up = nn.Parameter(torch.empty(2 * inter, hidden))
        self.save, self.fp8 = config.save, config.fp8
        self.register_state_dict_post_hook(_save_dense)
        self.register_load_state_dict_pre_hook(_load_dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, _local(self.gate_up), _local(self.w2.weight), save=self.save, fp8=self.fp8)


def _save_dense(module, state_dict, prefix, local_metadata) -> None:
    gate, up = _unpack(state_dict.pop(prefix + "gate_up"), ())
    state_dict[prefix + "w1.weight"], state_dict[prefix + "w3.weight"] = gate.contiguous(), up.contiguous()


def _load_dense(module, state_dict, prefix, *args) -> None:
    gate, up = prefix + "w1.weight", prefix + "w3.weight"
    if gate in state_dict and up in state_dict:
        state_dict[prefix + "gate_up"] = _pack(state_dict.pop(gate), state_dict.pop(up), ())


class FusedGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` as the fused grouped SwiGLU experts (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        save: str = "factors"

    def __init__(self, config: Config):
        super().__init__(config)
        del self.w1_EFD, self.w3_EFD
        self.gate_up = nn.Parameter(torch.empty(config.num_experts, 2 * config.hidden_dim, config.dim))
        self.save = config.save
        self.register_state_dict_post_hook(_save_experts)
        self.register_load_state_dict_pre_hook(_load_experts)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        gate_up, down = _local(self.gate_up), _local(self.w2_EDF)
        # As GroupedExperts: the experts in bf16 (the grouped GEMMs' dtype), the output in x's dtype.
        y = swiglu_grouped_experts(
            x_RD.bfloat16(), num_tokens_per_expert_E, gate_up.bfloat16(), down.bfloat16(), save=self.save
        )
        return y.type_as(x_RD)


def _save_experts(module, state_dict, prefix, local_metadata) -> None:
    packed = state_dict.pop(prefix + "gate_up")
    gate, up = _unpack(packed, (packed.shape[0],))
    state_dict[prefix + "w1_EFD"], state_dict[prefix + "w3_EFD"] = gate.contiguous(), up.contiguous()


def _load_experts(module, state_dict, prefix, *args) -> None:
    gate, up = prefix + "w1_EFD", prefix + "w3_EFD"
    if gate in state_dict and up in state_dict:
        gate, up = state_dict.pop(gate), state_dict.pop(up)
        state_dict[prefix + "gate_up"] = _pack(gate, up, (gate.shape[0],))


def _dense_sharding(cfg: FeedForward.Config) -> tuple[ShardingConfig | None, ShardingConfig | None]:
    """The fused module's sharding and its ``w2``'s: ``gate_up`` by rows under tensor parallelism,
    the stock input layout, and ``w2``'s output contract (a partial sum, then its reduction) moved
    from ``w2`` to the module, whose one call now makes that output; ``w2`` keeps its weight's
    placement. A local region (``local_map``): the module computes on local shards."""
    base, down = cfg.sharding_config, cfg.w2.sharding_config
    if base is None and down is None:
        return None, None
    base = base or ShardingConfig()
    down = down or ShardingConfig()
    module = ShardingConfig(
        state_shardings={"gate_up": dense_param_placement(tp=spmd.S(0))},
        in_src_shardings=base.in_src_shardings,
        in_dst_shardings=base.in_dst_shardings,
        out_src_shardings=down.out_src_shardings,
        out_dst_shardings=down.out_dst_shardings,
        local_map=LocalMapConfig(in_grad_placements=(dense_activation_placement(tp=spmd.P),)),
    )
    return module, ShardingConfig(state_shardings=down.state_shardings)


@override(
    target=FeedForward.Config,
    exact=True,
    description="fused-swiglu: the SwiGLU MLP as one fused call, gate and up packed (FSDP, TP).",
)
def fused_feed_forward(
    cfg: FeedForward.Config, save: str = DEFAULT_SAVE, fp8: bool = False
) -> FeedForward.Config:
    check_save_mode(save)
    check_fp8(fp8, cfg.w1.in_features, cfg.w1.out_features)
    changed = [name for name in ("w1", "w2", "w3") if type(getattr(cfg, name)) is not Linear.Config]
    if changed:
        kinds = ", ".join(f"{name}: {type(getattr(cfg, name)).__qualname__}" for name in changed)
        _LOG.warning(
            "fused_swiglu: a FeedForward whose projections another converter changed (%s) is left as it "
            "is; exclude it from that converter (e.g. float8's filter_fqns) to fuse it (fp8=True for FP8)",
            kinds,
        )
        return cfg
    gate_init = (cfg.w1.param_init or {}).get("weight")
    up_init = (cfg.w3.param_init or {}).get("weight")
    param_init = (
        None if gate_init is None or up_init is None else {"gate_up": _gate_up_init(gate_init, up_init)}
    )
    fused = derive(cfg, FusedFeedForward.Config, param_init=param_init, save=save, fp8=fp8)
    fused.sharding_config, down_sharding = _dense_sharding(cfg)
    if down_sharding is not None:
        fused.w2 = replace(cfg.w2, sharding_config=down_sharding)
    return fused


@override(
    target=GroupedExperts.Config,
    exact=True,
    description="fused-swiglu: the routed experts' SwiGLU MLPs as one fused call over the grouped rows.",
)
def fused_grouped_experts(cfg: GroupedExperts.Config, save: str = "factors") -> GroupedExperts.Config:
    check_save_mode(save, EXPERTS_SAVE_MODES)
    inits = dict(cfg.param_init or {})
    gate_init, up_init = inits.pop("w1_EFD", None), inits.pop("w3_EFD", None)
    if gate_init is not None and up_init is not None:
        inits["gate_up"] = _gate_up_init(gate_init, up_init, cfg.num_experts)
    fused = derive(cfg, FusedGroupedExperts.Config, param_init=inits or None, save=save)
    if cfg.sharding_config is not None:
        # gate_up [E, 2F, D] shards as w1_EFD [E, F, D]: experts on dim 0, rows on dim 1.
        states = dict(cfg.sharding_config.state_shardings)
        states["gate_up"] = states.pop("w1_EFD")
        states.pop("w3_EFD")
        fused.sharding_config = replace(cfg.sharding_config, state_shardings=states)
    return fused


class FusedSelectiveAC(SelectiveAC):
    """torchtitan's selective activation checkpointing with the fused forward ops among the ops whose
    outputs it saves, as it saves matmuls' and attention's: its policy recomputes every other op in
    the backward, a fused forward's GEMMs included."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        ops = torch.ops.fused_swiglu
        return super().get_save_ops() | {ops.glu_forward.default, ops.experts_forward.default}


@override(
    target=SelectiveAC.Config,
    exact=True,
    description="fused-swiglu: selective activation checkpointing that saves the fused forwards' outputs.",
)
def fused_selective_ac(cfg: SelectiveAC.Config) -> SelectiveAC.Config:
    return derive(cfg, FusedSelectiveAC.Config)


def apply_fused(
    config,
    *,
    save: str = DEFAULT_SAVE,
    fp8: bool = False,
    experts: bool = True,
    selective_ac: bool = False,
) -> list[str]:
    """The overrides on ``config`` (a torchtitan model or trainer config, its sharding already set),
    as ``--override.imports`` applies them: the MLPs, the experts unless ``experts`` is false, and
    with ``selective_ac`` (a trainer config) the checkpointing that saves the fused forwards' outputs.
    Returns torchtitan's lines of what was replaced."""
    imports = [(f"{__name__}.fused_feed_forward", {"save": save, "fp8": fp8})]
    if experts:
        imports.append((f"{__name__}.fused_grouped_experts", {"save": save}))
    if selective_ac:
        imports.append((f"{__name__}.fused_selective_ac", {}))
    return apply_overrides(OverrideConfig(imports=imports), config)
