"""``bench --fp8``: the MLP's FP8 training step against the bf16 floor, the FP8 floors, torchao's
float8 recipes under ``torch.compile`` and the bf16 fused MLP, in one run; and each one's accuracy
against float64 on the same inputs (Gaussian, and with outlier channels).

Floors, on preallocated operands, nothing but the six GEMMs of a step: ``floor`` in bf16 (cuBLAS);
``fp8-floor`` the FP8 path's own GEMMs (cuBLAS blockwise scaling, 1 x 128 activations and
gradients, 128 x 128 weights, precise accumulation); ``fp8-floor-tensorwise`` one scale per
tensor with fast accumulation, the fastest FP8 GEMMs there are.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable

import torch
from torch import nn

from ..fp8.format import mm as fp8_mm
from ..fp8.format import quantize_blocks, quantize_rows, reduction_width
from ..layout import unpack_gate_up
from ..nn import SwiGLUMLP
from .impls import EagerSwiGLUMLP, Impl, _module_impl, build_impl
from .measure import interleaved_medians, measure_impls

FP8_IMPLS = (
    "floor",
    "fp8-floor",
    "fp8-floor-tensorwise",
    "fused",
    "fused-fp8",
    "fused-fp8-compiled",
    "fused-fp8-preact",
    "torchao-tensorwise",
    "torchao-rowwise",
    "torchao-rowwise-gw-hp",
    "torchao-blockwise",
)
#: torchao's float8 training recipes by their names here.
TORCHAO_RECIPES = {
    "torchao-tensorwise": "tensorwise",
    "torchao-rowwise": "rowwise",
    "torchao-rowwise-gw-hp": "rowwise_with_gw_hp",
}
#: The inputs of the accuracy table: x's columns as drawn, or a few of them scaled up.
OUTLIERS = {"gaussian": 1.0, "outliers-x100": 100.0, "outliers-x1000": 1000.0}


class Fp8BlockwiseFloor:
    """The FP8 path's six GEMMs (fp8/format.py's ``mm``) on operands quantized once, in the path's
    layouts: a GEMM with a blocks operand reads K padded to ``reduction_width``."""

    def __init__(self, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, dy: torch.Tensor):
        m, inter = x.shape[0], w_down.shape[1]
        a = torch.randn(m, inter, device=x.device)
        grad = torch.randn(m, 2 * inter, device=x.device)

        def rows(t):
            return quantize_rows(t, width=reduction_width(t.shape[1]))

        def blocks(w):
            return quantize_blocks(w, reduction_width(w.shape[1]))

        self.x, self.w_gate_up, self.a, self.w_down = rows(x), blocks(w_gate_up), rows(a), blocks(w_down)
        self.dy, self.w_down_t = rows(dy), blocks(w_down.t())
        self.dy_t, self.a_t = quantize_rows(dy.t()), quantize_rows(a.t())
        self.grad, self.w_gate_up_t = rows(grad), blocks(w_gate_up.t())
        self.grad_t, self.x_t = quantize_rows(grad.t()), quantize_rows(x.t())
        self.dtype = x.dtype

    def forward(self) -> torch.Tensor:
        fp8_mm(self.x, self.w_gate_up, self.dtype)
        return fp8_mm(self.a, self.w_down, self.dtype)

    def step(self) -> None:
        self.forward()
        fp8_mm(self.dy, self.w_down_t, self.dtype)
        fp8_mm(self.dy_t, self.a_t, self.dtype)
        fp8_mm(self.grad, self.w_gate_up_t, self.dtype)
        fp8_mm(self.grad_t, self.x_t, self.dtype)


class Fp8TensorwiseFloor:
    """Six FP8 GEMMs with one scale per tensor and fast accumulation, each operand cast once into the
    layout cuBLAS takes (row-major A, column-major B)."""

    def __init__(self, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, dy: torch.Tensor):
        m, inter = x.shape[0], w_down.shape[1]
        one = torch.ones((), device=x.device)
        self.one, self.dtype = one, x.dtype
        f8 = lambda t: t.contiguous().to(torch.float8_e4m3fn)  # noqa: E731 - unit-variance data, no scale
        a, grad = torch.randn(m, inter, device=x.device), torch.randn(m, 2 * inter, device=x.device)
        # (A row-major, B^T row-major) for each GEMM: out = A @ B.
        self.pairs = [
            (f8(x), f8(w_gate_up)),  # h = x W^T
            (f8(a), f8(w_down)),  # y = a Wd^T
            (f8(dy), f8(w_down.t())),  # dA = dy Wd
            (f8(dy.t()), f8(a.t())),  # dWd = dy^T a
            (f8(grad), f8(w_gate_up.t())),  # dX = grad W
            (f8(grad.t()), f8(x.t())),  # dW = grad^T x
        ]

    def _mm(self, a, bt) -> torch.Tensor:
        return torch._scaled_mm(a, bt.t(), self.one, self.one, out_dtype=self.dtype, use_fast_accum=True)

    def forward(self) -> torch.Tensor:
        self._mm(*self.pairs[0])
        return self._mm(*self.pairs[1])

    def step(self) -> None:
        for pair in self.pairs:
            self._mm(*pair)


def torchao_module(name: str, reference: EagerSwiGLUMLP, compiled: bool = True) -> nn.Module | str:
    """``reference``'s MLP with torchao's float8 Linears (compiled), or why there is none."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed"
    weight = reference.gate_proj.weight
    inter, hidden = weight.shape
    module = EagerSwiGLUMLP(hidden, inter, device=weight.device, dtype=weight.dtype)
    module.load_state_dict(reference.state_dict())
    if name == "torchao-blockwise":
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

        for child in ("gate_proj", "up_proj", "down_proj"):
            setattr(module, child, Float8BlockwiseLinear.from_float(getattr(module, child)))
    else:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[name])
        convert_to_float8_training(module, config=config)
    return torch.compile(module, dynamic=False) if compiled else module


def fp8_module(name: str, reference: EagerSwiGLUMLP, compiled: bool = True) -> nn.Module | str:
    """The named implementation's module (not a floor), with ``reference``'s weights (compiled where
    its name or torchao's recipes say), or why it is missing."""
    if name.startswith("fused"):
        save = "preact" if "preact" in name else "factors"
        fused = SwiGLUMLP.from_mlp(reference, fp8=name.startswith("fused-fp8"), save=save)
        return torch.compile(fused, dynamic=False) if compiled and name.endswith("compiled") else fused
    return torchao_module(name, reference, compiled)


def build_fp8_impl(name: str, reference: EagerSwiGLUMLP, x: torch.Tensor, dy: torch.Tensor) -> Impl | str:
    """The named implementation for this shape, or why it is missing."""
    if name == "floor":
        return build_impl("floor", reference, x, dy)
    if name in ("fp8-floor", "fp8-floor-tensorwise"):
        w_gate_up = SwiGLUMLP.from_mlp(reference).gate_up_proj.detach()
        floor_type = Fp8BlockwiseFloor if name == "fp8-floor" else Fp8TensorwiseFloor
        floor = floor_type(x.detach(), w_gate_up, reference.down_proj.weight.detach(), dy)
        return Impl(name, floor.forward, floor.step, measures_memory=False)
    module = fp8_module(name, reference)
    return module if isinstance(module, str) else _module_impl(name, module, x, dy)


def measure_fp8_shape(
    m: int, hidden: int, inter: int, impl_names: list[str], *, reps: int, log: Callable[[str], None] = print
) -> list[dict]:
    """The MLP's training step at one shape: one row per implementation (bf16 operands), with its
    ratio to the bf16 floor and to the FP8 floor."""
    torch.manual_seed(0)
    reference = EagerSwiGLUMLP(hidden, inter, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    impls = []
    for name in impl_names:
        torch._dynamo.reset()  # every compiled implementation compiles afresh, timed as its first call
        built = build_fp8_impl(name, reference, x, dy)
        impls.append((name, built) if isinstance(built, str) else built)
    rows = measure_impls(impls, dy, 18 * m * hidden * inter, reps=reps, log=log)
    fp8_floor = next((r for r in rows if r["impl"] == "fp8-floor" and "step_ms" in r), None)
    for row in rows:
        row.update({"M": m, "hidden": hidden, "intermediate": inter})
        if fp8_floor and "step_ms" in row:
            row["step_vs_fp8_floor"] = row["step_ms"] / fp8_floor["step_ms"]
    return rows


def measure_fp8_passes(m: int, hidden: int, inter: int, *, reps: int, warps: int | None = None) -> list[dict]:
    """Each pass of the FP8 path alone (fp8/kernels.py) at one shape, bf16 inputs: ms, the bytes it
    must move (each input read once, each output written once) and the rate that makes, beside a
    device copy's (the memory-bound floor); ``warps``: every pass with that many warps a program
    (default: the library's choice, kernels/configs.py)."""
    from ..fp8 import kernels
    from ..fp8.format import halves_width, padded_rows

    rows = padded_rows(m)
    new = functools.partial(torch.randn, device="cuda", dtype=torch.bfloat16)
    x, w_gate_up, w_down, h, da = (
        new(m, hidden),
        new(2 * inter, hidden),
        new(hidden, inter),
        new(rows, halves_width(inter)),
        new(rows, inter),
    )
    _, _, kept = kernels.glu_forward(h, inter, 1, 1.0, 1.0)
    _, _, kept_preact = kernels.glu_forward(h, inter, 2, 1.0, 1.0)
    width = reduction_width
    passes = {
        # name: (call, bytes read, bytes written)
        "x: rows and transpose": (
            lambda: kernels.quantize_activation(x, rows, True, width(hidden), warps),
            2 * m * hidden,
            2 * rows * hidden,
        ),
        "W_gate_up: blocks": (
            lambda: kernels.quantize_weight(w_gate_up, False, halves=True, warps=warps),
            4 * inter * hidden,
            2 * inter * hidden,
        ),
        "W_gate_up: blocks, transposed": (
            lambda: kernels.quantize_weight(w_gate_up, True, halves=True, warps=warps),
            4 * inter * hidden,
            2 * inter * hidden,
        ),
        "W_down: blocks": (
            lambda: kernels.quantize_weight(w_down, False, warps=warps),
            2 * inter * hidden,
            inter * hidden,
        ),
        "SwiGLU, training": (
            lambda: kernels.glu_forward(h, inter, 1, 1.0, 1.0, warps),
            4 * rows * inter,
            4 * rows * inter,
        ),
        "SwiGLU, training, preact": (
            lambda: kernels.glu_forward(h, inter, 2, 1.0, 1.0, warps),
            4 * rows * inter,
            3 * rows * inter,
        ),
        "SwiGLU, inference": (
            lambda: kernels.glu_forward(h, inter, 0, 1.0, 1.0, warps),
            4 * rows * inter,
            rows * inter,
        ),
        "SwiGLU gradient": (
            lambda: kernels.glu_backward(da, kept, 1, 1.0, 1.0, True, True, warps=warps),
            4 * rows * inter,
            4 * rows * inter,
        ),
        "SwiGLU gradient, preact": (
            lambda: kernels.glu_backward(da, kept_preact, 2, 1.0, 1.0, True, True, a_t=True, warps=warps),
            4 * rows * inter,
            5 * rows * inter,
        ),
    }
    copy_source = new(rows, 2 * inter)
    fns = {name: call for name, (call, _, _) in passes.items()} | {"copy": copy_source.clone}
    times = interleaved_medians(fns, reps)
    copy_rate = 2 * copy_source.numel() * 2 / (times["copy"] * 1e-3)
    out = []
    for name, (_, read, written) in passes.items():
        rate = (read + written) / (times[name] * 1e-3)
        out.append({"pass": name, "ms": times[name], "MB": (read + written) / 1e6, "GB/s": rate / 1e9,
                    "of copy": rate / copy_rate})  # fmt: skip
    out.append({"pass": "copy (clone of h)", "ms": times["copy"], "MB": 4 * copy_source.numel() / 1e6,
                "GB/s": copy_rate / 1e9, "of copy": 1.0})  # fmt: skip
    return out


def _grads(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(dW_gate_up as [gate; up], dW_down) of an implementation's module."""
    module = getattr(module, "_orig_mod", module)
    if isinstance(module, SwiGLUMLP):
        gate, up = unpack_gate_up(module.gate_up_proj.grad)
        return torch.cat((gate, up)), module.down_proj.weight.grad
    return torch.cat((module.gate_proj.weight.grad, module.up_proj.weight.grad)), module.down_proj.weight.grad


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal to quantization noise in dB, against a float64 ``expected``; -inf for non-finite output."""
    actual = actual.double()
    if not torch.isfinite(actual).all():
        return -math.inf
    noise = (actual - expected).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(expected.norm().item() / noise)


def fp8_accuracy(m: int, hidden: int, inter: int, impl_names: list[str], outliers: float) -> list[dict]:
    """SQNR of y, dX, dW_gate_up and dW_down of each implementation (floors excluded) against the
    step in float64 on the same bf16 inputs and weights; eagerly (the recipes compute the same
    compiled)."""
    torch.manual_seed(1)
    reference = EagerSwiGLUMLP(hidden, inter, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, hidden, device="cuda")
    if outliers != 1.0:
        x[:, torch.randperm(hidden, device="cuda")[:4]] *= outliers
    x = x.bfloat16()
    dy = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    exact = EagerSwiGLUMLP(hidden, inter, device="cuda", dtype=torch.float64)
    exact.load_state_dict(reference.state_dict())
    x64 = x.double().requires_grad_()
    y64 = exact(x64)
    y64.backward(dy.double())
    want = {
        "y": y64.detach(),
        "dx": x64.grad,
        "dw_gate_up": torch.cat((exact.gate_proj.weight.grad, exact.up_proj.weight.grad)),
        "dw_down": exact.down_proj.weight.grad,
    }
    rows = []
    for name in impl_names:
        if "floor" in name:
            continue
        module = fp8_module(name, reference, compiled=False)
        if isinstance(module, str):
            rows.append({"impl": name, "missing": module})
            continue
        leaf = x.clone().requires_grad_()
        try:
            y = module(leaf)
            y.backward(dy)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the run goes on
            rows.append({"impl": name, "missing": f"failed: {type(e).__name__}: {e}"[:200]})
            continue
        dw_gate_up, dw_down = _grads(module)
        got = {"y": y.detach(), "dx": leaf.grad, "dw_gate_up": dw_gate_up, "dw_down": dw_down}
        rows.append({"impl": name} | {f"sqnr_{k}": sqnr_db(got[k], want[k]) for k in want})
    return rows
