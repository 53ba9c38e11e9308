"""Pure PyTorch SwiGLU MLP: the oracle for tests and the fallback where the fused kernels cannot run.

    y = down_multiplier * (silu(gate_multiplier * x @ Wg^T) * (x @ Wu^T)) @ Wd^T

The backward is PyTorch autograd. ``compute_dtype`` upcasts every input first (``torch.float64`` for a
test oracle); left as ``None`` it computes in the inputs' dtype, which is what eager PyTorch users get.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import split_packed_columns


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


def reference_swiglu(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    *,
    gate_multiplier: float = 1.0,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``silu(gate_multiplier * x @ Wg^T) * (x @ Wu^T)``: the GLU half, ``[..., H] -> [..., I]``."""
    x = _cast(x, compute_dtype)
    gate = F.linear(x, _cast(gate_weight, compute_dtype))
    if gate_multiplier != 1.0:
        gate = gate * gate_multiplier
    return F.silu(gate) * F.linear(x, _cast(up_weight, compute_dtype))


def reference_swiglu_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    gate_multiplier: float = 1.0,
    down_multiplier: float = 1.0,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The full MLP with separate weights, as Hugging Face ``LlamaMLP`` computes it."""
    act = reference_swiglu(
        x, gate_weight, up_weight, gate_multiplier=gate_multiplier, compute_dtype=compute_dtype
    )
    y = F.linear(act, _cast(down_weight, compute_dtype))
    return y if down_multiplier == 1.0 else y * down_multiplier


def reference_swiglu_packed(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    *,
    gate_multiplier: float = 1.0,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The GLU half from the packed ``[2I, H]`` weight: one GEMM (plus ``u @ v^T`` for a low-rank term
    ``(u, v)``, ``v`` packed like the weight), then a de-interleave of its columns."""
    x = _cast(x, compute_dtype)
    h = F.linear(x, _cast(gate_up_weight, compute_dtype))
    if low_rank is not None:
        h = h + F.linear(_cast(low_rank[0], compute_dtype), _cast(low_rank[1], compute_dtype))
    up, gate = split_packed_columns(h)
    if gate_multiplier != 1.0:
        gate = gate * gate_multiplier
    return F.silu(gate) * up


def reference_swiglu_mlp_packed(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    gate_multiplier: float = 1.0,
    down_multiplier: float = 1.0,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The full MLP from the packed weight; the fallback path of the functional API."""
    act = reference_swiglu_packed(
        x, gate_up_weight, gate_multiplier=gate_multiplier, compute_dtype=compute_dtype
    )
    y = F.linear(act, _cast(down_weight, compute_dtype))
    return y if down_multiplier == 1.0 else y * down_multiplier
