"""The GLU operator alone (x -> a), against its GEMM floor and the usual ways to write it."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from ..kernels.common import Saved
from ..kernels.glu_forward import glu_forward
from ..kernels.glu_grad import glu_grad_
from ..nn import SwiGLULinear
from .impls import Impl
from .measure import measure_impls

GLU_IMPL_NAMES = ("floor", "fused-factors", "fused-recompute", "eager-one-linear", "liger-two-linears")


class GLUFloor:
    """The three cuBLAS GEMMs of the GLU half (x @ W^T, grad @ W, grad^T @ x), preallocated."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor):
        m, (two_inter, hidden) = x.shape[0], w.shape
        self.x, self.w = x.detach(), w.detach()
        new = lambda *shape: torch.randn(*shape, device=x.device, dtype=x.dtype)  # noqa: E731 - never zeros
        self.gate_up, self.dx, self.dw = new(m, two_inter), new(m, hidden), new(two_inter, hidden)

    def forward(self) -> torch.Tensor:
        return torch.mm(self.x, self.w.t(), out=self.gate_up)

    def step(self) -> None:
        self.forward()
        torch.mm(self.gate_up, self.w, out=self.dx)
        torch.mm(self.gate_up.t(), self.x, out=self.dw)


def _impl(name: str, forward: Callable[[], torch.Tensor], da: torch.Tensor, params: list) -> Impl:
    return Impl(name, forward, lambda: forward().backward(da), params)


def build_glu_impl(name: str, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, da: torch.Tensor):
    inter, hidden = w_gate.shape
    if name == "floor":
        floor = GLUFloor(x, torch.cat([w_gate, w_up]))
        return Impl(name, floor.forward, floor.step, measures_memory=False)
    if name.startswith("fused-"):
        glu = SwiGLULinear(hidden, inter, save=name.removeprefix("fused-"), device=x.device, dtype=x.dtype)
        glu.load_state_dict({"gate_proj.weight": w_gate, "up_proj.weight": w_up})
        return _impl(name, lambda: glu(x), da, [glu.gate_up_proj, x])
    if name == "eager-one-linear":
        w = torch.cat([w_gate, w_up]).requires_grad_()

        def forward() -> torch.Tensor:
            gate, up = F.linear(x, w).chunk(2, dim=-1)
            return F.silu(gate) * up

        return _impl(name, forward, da, [w, x])
    if name == "liger-two-linears":
        if importlib.util.find_spec("liger_kernel") is None:
            return (name, "liger-kernel is not installed")
        from liger_kernel.ops import LigerSiLUMulFunction

        wg, wu = w_gate.clone().requires_grad_(), w_up.clone().requires_grad_()
        return _impl(
            name, lambda: LigerSiLUMulFunction.apply(F.linear(x, wg), F.linear(x, wu)), da, [wg, wu, x]
        )
    raise ValueError(f"unknown GLU implementation {name!r}")


def measure_glu_shape(
    m: int, hidden: int, inter: int, impl_names, *, dtype: torch.dtype = torch.bfloat16, reps: int, log=print
) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(m, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w_gate, w_up = (torch.randn(inter, hidden, device="cuda", dtype=dtype) * hidden**-0.5 for _ in range(2))
    da = torch.randn(m, inter, device="cuda", dtype=dtype)
    impls = [build_glu_impl(name, x, w_gate, w_up, da) for name in impl_names]
    rows = measure_impls(impls, da, 12 * m * hidden * inter, reps=reps, log=log)  # three GEMMs of 4 MHI
    for row in rows:
        row.update({"M": m, "hidden": hidden, "intermediate": inter})
    return rows


def measure_factor_gradient(m: int, hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The in-place [f_up | f_gate] * dA step alone: the Triton kernel against a broadcast ``mul_``."""
    x = torch.randn(m, hidden, device="cuda", dtype=dtype)
    w = torch.randn(2 * inter, hidden, device="cuda", dtype=dtype) * hidden**-0.5
    _, pristine = glu_forward(x, w, gate_multiplier=1.0, down_multiplier=1.0, save=Saved.FACTORS)
    da = torch.randn(m, inter, device="cuda", dtype=dtype)
    work = pristine.clone()
    chunk = 8
    copy = do_bench(lambda: work.copy_(pristine), return_mode="median")
    kernel = do_bench(lambda: (work.copy_(pristine), glu_grad_(da, work)), return_mode="median") - copy
    torch_mul = (
        do_bench(
            lambda: (work.copy_(pristine), work.view(m, -1, 2, chunk).mul_(da.view(m, -1, 1, chunk))),
            return_mode="median",
        )
        - copy
    )
    moved = (da.numel() + 2 * pristine.numel()) * 2  # read dA and the factors, write the gradient
    return {
        "kernel_ms": kernel,
        "torch_mul_ms": torch_mul,
        "kernel_tb_s": moved / kernel / 1e9,
        "torch_mul_tb_s": moved / torch_mul / 1e9,
    }
