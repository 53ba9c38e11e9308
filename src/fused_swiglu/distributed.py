"""DTensor helpers of the fused modules' forward and of the swap: whether a weight is distributed or
sharded for tensor parallelism (tensor_parallel.py shards it), and the fused call on each rank's
shards."""

from __future__ import annotations

import torch
from torch import nn


def _dtensor_api():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import local_map

    return DTensor, Partial, Replicate, Shard, local_map


#: Why the swap leaves a module with distributed weights alone.
DISTRIBUTED = (
    "its weights are already distributed (DTensor: FSDP2 or a tensor-parallel plan such as transformers' "
    "tp_plan); swap before sharding, then shard the fused modules (fused_swiglu.tensor_parallel."
    "parallelize_swiglu for tensor parallelism, fully_shard for FSDP2)"
)


def is_distributed(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a DTensor."""
    if type(weight) in (nn.Parameter, torch.Tensor) or not torch.distributed.is_available():
        return False
    return isinstance(weight, _dtensor_api()[0])


def is_tensor_parallel(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (a module's packed parameter) was sharded by ``parallelize_swiglu``."""
    if type(weight) in (nn.Parameter, torch.Tensor) or not torch.distributed.is_available():
        return False  # every call asks: the common answer without an import
    DTensor, _, _, Shard, _ = _dtensor_api()
    return isinstance(weight, DTensor) and weight.placements == (Shard(0),)


def tensor_parallel_mlp(fn, x: torch.Tensor, gate_up_weight, down_weight) -> torch.Tensor:
    """``fn(x, gate_up, down)`` (the fused MLP) on each rank's shards, the parts summed over the mesh."""
    DTensor, Partial, Replicate, Shard, local_map = _dtensor_api()
    mesh = gate_up_weight.device_mesh
    local = local_map(
        fn,
        out_placements=[Partial()],
        in_placements=([Replicate()], [Shard(0)], [Shard(1)]),
        in_grad_placements=([Partial()], [Shard(0)], [Shard(1)]),
        device_mesh=mesh,
    )
    plain = not isinstance(x, DTensor)
    x = DTensor.from_local(x, mesh, [Replicate()], run_check=False) if plain else x
    y = local(x, gate_up_weight, down_weight).redistribute(mesh, [Replicate()])
    return y.to_local() if plain else y


def tensor_parallel_glu(fn, x: torch.Tensor, gate_up_weight) -> torch.Tensor:
    """``fn(x, gate_up)`` (the GLU operator) on each rank's shard: ``a`` sharded on its last dim."""
    DTensor, Partial, Replicate, Shard, local_map = _dtensor_api()
    mesh = gate_up_weight.device_mesh
    local = local_map(
        fn,
        out_placements=[Shard(x.dim() - 1)],
        in_placements=([Replicate()], [Shard(0)]),
        in_grad_placements=([Partial()], [Shard(0)]),
        device_mesh=mesh,
    )
    x = DTensor.from_local(x, mesh, [Replicate()], run_check=False) if not isinstance(x, DTensor) else x
    return local(x, gate_up_weight)
