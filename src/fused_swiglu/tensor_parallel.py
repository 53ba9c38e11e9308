"""Tensor parallelism for ``SwiGLUMLP`` and ``SwiGLULinear`` over a 1-D device mesh (PyTorch's DTensor).

The packed gate/up weight is sharded by rows (``Shard(0)``). Its 8-row up and gate chunks alternate,
so when every rank's share is a whole number of chunk pairs (the intermediate size a multiple of
8 x the mesh size), rank r holds exactly the up and gate rows of intermediate columns
``[r * I / n, (r + 1) * I / n)``: a packed weight of its own, which the fused kernels take as they
are. The down weight is sharded by columns (``Shard(1)``), the same intermediate columns. Each rank
runs the fused MLP on its shard; one all-reduce of the output sums the ranks' parts (the GLU
operator alone returns its columns sharded, for a row-parallel down projection of the caller's).

Checkpoints keep the Hugging Face keys: the state-dict hooks hand out ``gate_proj.weight`` and
``up_proj.weight`` sharded by rows (as transformers' ``colwise`` plan shards them) and
``down_proj.weight`` by columns (``rowwise``).
"""

from __future__ import annotations

from torch import nn

from .layout import CHUNK
from .nn import SwiGLULinear, SwiGLUMLP


def parallelize_swiglu(module: nn.Module, mesh) -> nn.Module:
    """Shard ``module`` (a ``SwiGLUMLP`` or ``SwiGLULinear``) over the 1-D ``mesh``, in place, and
    return it. Its forward then takes the same input on every rank and returns the MLP's output on
    every rank (the GLU operator: its intermediate columns, a DTensor sharded on the last dim)."""
    if not isinstance(module, (SwiGLUMLP, SwiGLULinear)):
        raise TypeError(f"parallelize_swiglu takes a SwiGLUMLP or SwiGLULinear, got {type(module).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"parallelize_swiglu takes a 1-D mesh (the tensor-parallel dim), got {mesh.ndim}-D")
    ranks, inter = mesh.size(), module.gate_up_proj.shape[0] // 2
    if inter % (CHUNK * ranks):
        raise ValueError(
            f"intermediate size {inter} does not split into whole packed chunk pairs over {ranks} ranks: it "
            f"must be a multiple of {CHUNK} x {ranks} = {CHUNK * ranks}"
        )
    if isinstance(module, SwiGLUMLP) and type(module.down_proj) is not nn.Linear:
        raise TypeError(
            f"down_proj is a {type(module.down_proj).__name__}: only a plain nn.Linear is sharded"
        )
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if isinstance(module.gate_up_proj, DTensor):
        raise ValueError("the module's parameters are already distributed")

    def shard(parameter: nn.Parameter, dim: int) -> nn.Parameter:
        return nn.Parameter(distribute_tensor(parameter.data, mesh, [Shard(dim)]), parameter.requires_grad)

    module.gate_up_proj = shard(module.gate_up_proj, 0)
    if isinstance(module, SwiGLUMLP):
        module.down_proj.weight = shard(module.down_proj.weight, 1)
    return module
