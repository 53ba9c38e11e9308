"""The fp32 path: both GLU GEMMs on cuBLAS, the SwiGLU as in-place passes next to them.

Same contract as ``glu_forward`` / ``glu_backward_`` (what is saved, what is overwritten, what is
returned), so the autograd layer swaps one pair for the other by dtype. The pre-activation is
computed in the buffer that is then kept (factors overwrite it in place), so the memory kept between
forward and backward is the fused kernels'; the backward holds dA [M, I] for the length of one pass.
"""

from __future__ import annotations

import torch

from .common import Saved
from .glu_activation import glu_activation
from .glu_grad import glu_grad_


def glu_forward_split(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    *,
    gate_multiplier: float,
    down_multiplier: float,
    save: Saved,
    write_a: bool = True,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``glu_forward`` with cuBLAS's x @ W_packed^T (+ u @ v^T): returns ``(a or None, saved or None)``."""
    if not write_a and save == Saved.NOTHING:
        raise ValueError("the forward must write a, the saved tensor, or both")
    h = torch.mm(x, w_packed.t())  # [M, 2I] packed [u | g]: the pre-activation, as saved by "preact"
    if low_rank is not None:
        # h leaves here at version 0, as the fused kernel's output (the backward op checks it).
        with torch.autograd._unsafe_preserve_version_counter(h):
            h.addmm_(low_rank[0], low_rank[1].t())
    factors = save == Saved.FACTORS
    a = None
    if write_a or factors:
        a = glu_activation(
            h,
            gate_multiplier=gate_multiplier,
            down_multiplier=down_multiplier,
            factors_in_place=factors,
            write_a=write_a,
        )
    return a, (None if save == Saved.NOTHING else h)


def glu_backward_split_(
    dy: torch.Tensor,
    w_down: torch.Tensor,
    saved: torch.Tensor,
    *,
    gate_multiplier: float,
    down_multiplier: float,
    save: Saved,
    grad: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``glu_backward_`` with cuBLAS's dY @ W_down: [dU | dG] over ``saved`` or into ``grad``;
    returns the recomputed ``down_multiplier * a`` for ``Saved.PREACT`` (in dA's memory), else ``None``."""
    da = torch.mm(dy, w_down)
    glu_grad_(
        da,
        saved,
        save=save,
        gate_multiplier=gate_multiplier,
        down_multiplier=down_multiplier,
        grad=grad,
    )
    return da if save == Saved.PREACT else None
