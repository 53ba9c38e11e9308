"""The packed gate/up weight format.

Gate and up rows are interleaved in chunks of ``CHUNK`` rows::

    [up_0 | gate_0 | up_1 | gate_1 | ...]      each block CHUNK rows of width hidden

so ``packed`` has shape ``[2 * intermediate, hidden]``. A kernel tile that covers packed rows
``[2 * n0, 2 * n0 + 2 * BN)`` (``n0`` and ``BN`` multiples of ``CHUNK``) holds the up and gate rows of the
same ``BN`` intermediate columns, so one wide ``tl.dot`` yields both halves of the SwiGLU input.

``CHUNK`` is a constant of the stored format, not of any kernel tile: a kernel whose tile is a multiple of
``CHUNK`` de-interleaves its accumulator in registers. The same order applies to every ``[*, 2I]`` tensor
the library keeps (saved factors, saved pre-activations, the packed gradient).

8 rows is the smallest chunk for which de-interleaving stays inside a thread's registers on the tensor
core accumulator layouts (columns come in groups of 8), and it lets every intermediate size that is a
multiple of 8 use the fused kernels.
"""

from __future__ import annotations

import torch

CHUNK = 8


def check_intermediate_size(intermediate_size: int) -> None:
    if intermediate_size <= 0 or intermediate_size % CHUNK:
        raise ValueError(
            f"intermediate size must be a positive multiple of {CHUNK} (the packed chunk width), "
            f"got {intermediate_size}"
        )


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Interleave ``gate`` and ``up`` ``[I, H]`` into the packed ``[2I, H]`` weight.

    Differentiable: gradients flow back to ``gate`` and ``up``.
    """
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} weight must be a torch.Tensor, got {type(t).__name__}")
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(
            f"gate and up weights must be 2-D of equal shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.dtype != up.dtype:
        raise TypeError(f"gate and up weights must share a dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate and up weights must share a device, got {gate.device} and {up.device}")
    inter, hidden = gate.shape
    check_intermediate_size(inter)
    chunks = inter // CHUNK
    packed = torch.stack((up.reshape(chunks, CHUNK, hidden), gate.reshape(chunks, CHUNK, hidden)), dim=1)
    return packed.reshape(2 * inter, hidden)


def unpack_gate_up(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a packed ``[2I, H]`` weight into contiguous ``(gate, up)``, each ``[I, H]``."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed weight must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != 2:
        raise ValueError(f"packed weight must be 2-D, got shape {tuple(packed.shape)}")
    up, gate = split_packed_columns(packed.t())
    return gate.t().contiguous(), up.t().contiguous()


def split_packed_columns(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the last dim (``2I``, packed order) of ``t`` into ``(up, gate)``, each ``[..., I]``.

    The results are copies only where a view cannot express the de-interleave.
    """
    width = t.shape[-1]
    if width % (2 * CHUNK):
        raise ValueError(f"packed width must be a multiple of {2 * CHUNK}, got {width}")
    inter = width // 2
    check_intermediate_size(inter)
    grouped = t.reshape(*t.shape[:-1], inter // CHUNK, 2, CHUNK)
    lead = t.shape[:-1]
    return grouped[..., 0, :].reshape(*lead, inter), grouped[..., 1, :].reshape(*lead, inter)
