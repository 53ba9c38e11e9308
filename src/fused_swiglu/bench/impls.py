"""The implementations the benchmark compares, built for one shape from the same weights.

Each is a callable forward plus its parameters. Peers are optional: one that is not installed is
reported as missing, not an error.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..nn import SwiGLUMLP

FUSED_SAVES = ("factors", "preact", "recompute")
IMPL_NAMES = (
    "floor",
    *(f"fused-{s}" for s in FUSED_SAVES),
    # The fused module ("factors") under torch.compile.
    "fused-compiled",
    "eager",
    "torch.compile",
    "liger",
    "flash-swiglu-mlp",
)
#: On request only (``--impls``): the compiled module with pre-activations kept.
EXTRA_IMPL_NAMES = ("fused-compiled-preact",)


class EagerSwiGLUMLP(nn.Module):
    """Hugging Face ``LlamaMLP`` as written: three bias-free Linears and a SiLU gate."""

    def __init__(self, hidden: int, inter: int, **factory) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, **factory)
        self.up_proj = nn.Linear(hidden, inter, bias=False, **factory)
        self.down_proj = nn.Linear(inter, hidden, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ResidualMLPs(nn.Module):
    """``x + mlp(x)``, layer after layer: a stack of MLPs with no attention between them, for timing
    several calls in one compiled graph."""

    def __init__(self, mlps) -> None:
        super().__init__()
        self.mlps = nn.ModuleList(mlps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mlp in self.mlps:
            x = x + mlp(x)
        return x


@dataclass
class Impl:
    name: str
    forward: Callable[[], torch.Tensor]
    step: Callable[[], None]
    params: list[torch.Tensor] = field(default_factory=list)
    # Kept/peak memory mean nothing for the floor, which works on preallocated buffers.
    measures_memory: bool = True


class GemmFloor:
    """The six cuBLAS GEMMs of one training step on preallocated tensors, nothing else."""

    def __init__(self, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, dy: torch.Tensor):
        m, hidden = x.shape
        inter = w_down.shape[1]
        self.x, self.w_gate_up, self.w_down, self.dy = x.detach(), w_gate_up.detach(), w_down.detach(), dy
        new = lambda *shape: torch.randn(*shape, device=x.device, dtype=x.dtype)  # noqa: E731 - never zeros
        self.gate_up, self.a, self.y, self.da = (
            new(m, 2 * inter),
            new(m, inter),
            new(m, hidden),
            new(m, inter),
        )
        self.dw_down, self.dx, self.dw_gate_up = new(hidden, inter), new(m, hidden), new(2 * inter, hidden)

    def forward(self) -> torch.Tensor:
        torch.mm(self.x, self.w_gate_up.t(), out=self.gate_up)
        return torch.mm(self.a, self.w_down.t(), out=self.y)

    def step(self) -> None:
        self.forward()
        torch.mm(self.dy, self.w_down, out=self.da)
        torch.mm(self.dy.t(), self.a, out=self.dw_down)
        torch.mm(self.gate_up, self.w_gate_up, out=self.dx)
        torch.mm(self.gate_up.t(), self.x, out=self.dw_gate_up)


def _module_impl(name: str, module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Impl:
    # flash-swiglu-mlp takes [batch, seq, hidden] only; the view is taken per call so x stays the leaf.
    batched = name == "flash-swiglu-mlp"

    def forward() -> torch.Tensor:
        return module(x[None]) if batched else module(x)

    def step() -> None:
        forward().backward(dy[None] if batched else dy)

    return Impl(name, forward, step, list(module.parameters()) + [x])


def peer_module(name: str, reference: EagerSwiGLUMLP) -> nn.Module | str:
    """Build a peer module loaded with ``reference``'s weights, or return why it is missing."""
    weight = reference.gate_proj.weight
    inter, hidden = weight.shape
    factory = {"device": weight.device, "dtype": weight.dtype}
    if name == "eager" or name == "torch.compile":
        module = EagerSwiGLUMLP(hidden, inter, **factory)
    elif name == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed"
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

        config = SimpleNamespace(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")
        module = LigerSwiGLUMLP(config).to(**factory)
    elif name == "flash-swiglu-mlp":
        if importlib.util.find_spec("flash_swiglu_mlp") is None:
            return "flash-swiglu-mlp is not installed"
        from flash_swiglu_mlp import FlashSwiGLUMLP

        module = FlashSwiGLUMLP(hidden, inter, **factory)
    else:
        raise ValueError(f"unknown implementation {name!r}")
    module.load_state_dict(reference.state_dict())
    if name == "torch.compile":
        # dynamic=False: each shape gets its own static graph, as a fixed-shape training run would.
        module = torch.compile(module, dynamic=False)
    return module


def build_impl(name: str, reference: EagerSwiGLUMLP, x: torch.Tensor, dy: torch.Tensor) -> Impl | str:
    """The named implementation for this shape, or a string saying why it is missing."""
    if name == "floor":
        floor = GemmFloor(x, SwiGLUMLP.from_mlp(reference).gate_up_proj, reference.down_proj.weight, dy)
        return Impl(name, floor.forward, floor.step, measures_memory=False)
    if name.startswith("fused-compiled"):
        save = name.removeprefix("fused-compiled").removeprefix("-") or "factors"
        module = SwiGLUMLP.from_mlp(reference, save=save)
        return _module_impl(name, torch.compile(module, dynamic=False), x, dy)
    if name.startswith("fused-"):
        return _module_impl(name, SwiGLUMLP.from_mlp(reference, save=name.removeprefix("fused-")), x, dy)
    module = peer_module(name, reference)
    return module if isinstance(module, str) else _module_impl(name, module, x, dy)
