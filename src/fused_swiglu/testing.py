"""Accuracy checks shared by the test suite, ``python -m fused_swiglu check`` and the benchmark.

The oracle is the PyTorch reference in float64. A fused result passes when its relative error is
within ``2 * eager + unit roundoff`` of eager PyTorch's own error in the same dtype (the rule of
flash-attention's Triton tests, on norms): as exact as the thing it replaces, never NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .layout import pack_gate_up
from .reference import (
    reference_swiglu,
    reference_swiglu_mlp,
    reference_swiglu_mlp_packed,
    reference_swiglu_packed,
)


@dataclass
class MLPProblem:
    """Random inputs of one step: x [M, H], gate/up [I, H], down [H, I], the MLP's output gradient
    dy [M, H], and da [M, I], the output gradient of the GLU operator alone."""

    x: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    dy: torch.Tensor
    da: torch.Tensor
    gate_multiplier: float = 1.0
    down_multiplier: float = 1.0

    @property
    def w_gate_up(self) -> torch.Tensor:
        return pack_gate_up(self.w_gate, self.w_up)


def make_problem(
    m: int,
    hidden: int,
    inter: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    gate_multiplier: float = 1.0,
    down_multiplier: float = 1.0,
    seed: int = 0,
) -> MLPProblem:
    """Unit-variance activations and nn.Linear-scale weights, so every stage has realistic magnitudes."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    return MLPProblem(
        x=randn(m, hidden),
        w_gate=randn(inter, hidden, scale=hidden**-0.5),
        w_up=randn(inter, hidden, scale=hidden**-0.5),
        w_down=randn(hidden, inter, scale=inter**-0.5),
        dy=randn(m, hidden),
        da=randn(m, inter),
        gate_multiplier=gate_multiplier,
        down_multiplier=down_multiplier,
    )


PackedMLP = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_step(fn: PackedMLP, problem: MLPProblem, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Forward and backward of ``fn(x, w_gate_up, w_down)``; returns output and gradients (packed dW)."""
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    x = cast(problem.x).detach().requires_grad_()
    w_gate_up = cast(problem.w_gate_up).detach().requires_grad_()
    w_down = cast(problem.w_down).detach().requires_grad_()
    out = fn(x, w_gate_up, w_down)
    out.backward(cast(problem.dy))
    return {"out": out.detach(), "dx": x.grad, "dw_gate_up": w_gate_up.grad, "dw_down": w_down.grad}


def run_eager_step(problem: MLPProblem) -> dict[str, torch.Tensor]:
    """Eager PyTorch as users run it (separate gate/up Linears), in the problem's dtype."""
    x = problem.x.detach().requires_grad_()
    w_gate = problem.w_gate.detach().requires_grad_()
    w_up = problem.w_up.detach().requires_grad_()
    w_down = problem.w_down.detach().requires_grad_()
    out = reference_swiglu_mlp(
        x,
        w_gate,
        w_up,
        w_down,
        gate_multiplier=problem.gate_multiplier,
        down_multiplier=problem.down_multiplier,
    )
    out.backward(problem.dy)
    return {
        "out": out.detach(),
        "dx": x.grad,
        "dw_gate_up": pack_gate_up(w_gate.grad, w_up.grad),
        "dw_down": w_down.grad,
    }


def oracle_step(problem: MLPProblem) -> dict[str, torch.Tensor]:
    """The float64 reference."""

    def fn(x, w_gate_up, w_down):
        return reference_swiglu_mlp_packed(
            x,
            w_gate_up,
            w_down,
            gate_multiplier=problem.gate_multiplier,
            down_multiplier=problem.down_multiplier,
        )

    return run_step(fn, problem, dtype=torch.float64)


GLUFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def run_glu_step(fn: GLUFn, problem: MLPProblem, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Forward and backward (with ``problem.da``) of the GLU operator ``fn(x, w_gate_up)``."""
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    x = cast(problem.x).detach().requires_grad_()
    w_gate_up = cast(problem.w_gate_up).detach().requires_grad_()
    out = fn(x, w_gate_up)
    out.backward(cast(problem.da))
    return {"out": out.detach(), "dx": x.grad, "dw_gate_up": w_gate_up.grad}


def run_eager_glu_step(problem: MLPProblem) -> dict[str, torch.Tensor]:
    """The GLU half in eager PyTorch with separate gate/up weights, in the problem's dtype."""
    x = problem.x.detach().requires_grad_()
    w_gate = problem.w_gate.detach().requires_grad_()
    w_up = problem.w_up.detach().requires_grad_()
    out = reference_swiglu(x, w_gate, w_up, gate_multiplier=problem.gate_multiplier)
    out.backward(problem.da)
    return {"out": out.detach(), "dx": x.grad, "dw_gate_up": pack_gate_up(w_gate.grad, w_up.grad)}


def glu_oracle_step(problem: MLPProblem) -> dict[str, torch.Tensor]:
    """The float64 reference of the GLU half."""

    def fn(x, w_gate_up):
        return reference_swiglu_packed(x, w_gate_up, gate_multiplier=problem.gate_multiplier)

    return run_glu_step(fn, problem, dtype=torch.float64)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64; ``inf`` if ``actual`` has NaN or Inf."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    actual = actual.double()
    if not torch.isfinite(actual).all():
        return float("inf")
    expected = expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


@dataclass
class ErrorRow:
    name: str
    fused: float
    eager: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.fused <= self.bound


def accuracy_rows(
    fused: dict[str, torch.Tensor], eager: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor], dtype
) -> list[ErrorRow]:
    rows = []
    for name in oracle:
        fused_err = relative_error(fused[name], oracle[name])
        eager_err = relative_error(eager[name], oracle[name])
        rows.append(ErrorRow(name, fused_err, eager_err, 2 * eager_err + unit_roundoff(dtype)))
    return rows
