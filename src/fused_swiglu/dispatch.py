"""Which path computes a call on validated 2-D inputs: the fused kernels (training or inference) or
the PyTorch reference where they cannot run, with the tensors' device made current for the launches."""

from __future__ import annotations

import functools
import warnings

import torch

from .autograd import (
    KEPT,
    SwiGLULinearFunction,
    SwiGLUMLPFunction,
    linear_backward_,
    linear_forward,
    mlp_backward_,
    mlp_forward,
    swiglu_linear_no_grad,
    swiglu_mlp_no_grad,
)
from .kernels.common import interpreting, tma_ready
from .reference import reference_swiglu_mlp_packed, reference_swiglu_packed

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _kernels_built_for(device_index: int) -> bool:
    """Whether the fused kernels' tiles are built for this GPU: Hopper (compute capability 9.x).

    They are sized for Hopper's 227 KB of shared memory per block and tested there. Compiled for
    Blackwell, the pre-activation backward tile needs 256 KB on sm_100, and on sm_120 (99 KB) 28 of
    the 30 tiles picked at llama3-8b do not fit or spill (benchmarks/kernel_resources.py --arch), so
    newer GPUs take the PyTorch reference, with a warning once; older ones have no TMA. Cached: this
    runs on every call.
    """
    major, minor = torch.cuda.get_device_capability(device_index)
    if major > 9:
        warnings.warn(
            f"fused_swiglu: the fused kernels are built and tested for Hopper (sm_90); on this GPU "
            f"(sm_{major}{minor}) the PyTorch reference runs instead, at eager speed and memory.",
            stacklevel=6,
        )
    return major == 9


def fused_path_available(x: torch.Tensor, gate_up_weight: torch.Tensor) -> bool:
    """Whether ``swiglu_mlp``/``swiglu_linear`` take the fused kernels for this input and packed weight.

    They need fp16/bf16/fp32 on a Hopper GPU (compute capability 9.x), or CPU tensors under
    the Triton interpreter; rows 16-byte aligned (hidden and intermediate times the item size
    multiples of 16) and at least one token. Otherwise the PyTorch reference runs.
    """
    if x.numel() == 0:
        return False
    hidden, inter, itemsize = x.shape[-1], gate_up_weight.shape[0] // 2, x.dtype.itemsize
    # The alignment is tested here, not in the constant-marked check below: compiled with dynamic
    # shapes, Dynamo may make the widths symbolic (torch 2.11 does), and that check takes constants.
    aligned = (hidden * itemsize) % 16 == 0 and (inter * itemsize) % 16 == 0
    return aligned and _kernels_run_on(x.dtype, x.device)


def _kernels_run_on(dtype: torch.dtype, device: torch.device) -> bool:
    if dtype not in FUSED_DTYPES:
        return False
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _kernels_built_for(index)
    return device.type == "cpu" and interpreting()


# A traced training call (functional.py) decides while Dynamo traces it, from these constants: Dynamo
# calls a function so marked and keeps its result as a constant instead of tracing the device query.
# This is what torch.compiler.assume_constant_result does, which would import Dynamo with the library
# (about a second, which an eager user never pays). Were the mark ignored, Dynamo would trace it.
_kernels_run_on._dynamo_marked_constant = True


def _training(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _on_tensor_device(fn):
    """Triton launches on the current CUDA device whatever device the tensors are on, so a call with
    tensors elsewhere (no ``torch.cuda.set_device`` first) makes their device current around the
    forward. Autograd already runs the backward with the tensors' device current."""

    @functools.wraps(fn)
    def call(x2d, *args, **kwargs):
        if x2d.is_cuda and x2d.device.index != torch.cuda.current_device():
            with torch.cuda.device(x2d.device):
                return fn(x2d, *args, **kwargs)
        return fn(x2d, *args, **kwargs)

    return call


@_on_tensor_device
def _fused_mlp(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save):
    x2d, gate_up_weight, down_weight = tma_ready(x2d), tma_ready(gate_up_weight), tma_ready(down_weight)
    if _training(x2d, gate_up_weight, down_weight):
        args = (gate_multiplier, down_multiplier, save)
        return SwiGLUMLPFunction.apply(x2d, gate_up_weight, down_weight, *args)
    return swiglu_mlp_no_grad(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier)


@_on_tensor_device
def _fused_linear(x2d, gate_up_weight, gate_multiplier, save):
    x2d, gate_up_weight = tma_ready(x2d), tma_ready(gate_up_weight)
    if _training(x2d, gate_up_weight):
        return SwiGLULinearFunction.apply(x2d, gate_up_weight, gate_multiplier, save)
    return swiglu_linear_no_grad(x2d, gate_up_weight, gate_multiplier)


def mlp_2d(x2d, gate_up_weight, down_weight, gate_multiplier: float, down_multiplier: float, save: str):
    """The MLP on x [M, H], packed [2I, H] and down [H, I] weights (validated): [M, H]."""
    if not fused_path_available(x2d, gate_up_weight):
        return reference_swiglu_mlp_packed(
            x2d, gate_up_weight, down_weight, gate_multiplier=gate_multiplier, down_multiplier=down_multiplier
        )
    return _fused_mlp(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save)


def linear_2d(x2d, gate_up_weight, gate_multiplier: float, save: str):
    """The GLU half on x [M, H] and a packed [2I, H] weight (validated): [M, I]."""
    if not fused_path_available(x2d, gate_up_weight):
        return reference_swiglu_packed(x2d, gate_up_weight, gate_multiplier=gate_multiplier)
    return _fused_linear(x2d, gate_up_weight, gate_multiplier, save)


@_on_tensor_device
def mlp_train_forward_2d(x2d, gate_up_weight, down_weight, gate_multiplier, down_multiplier, save):
    """The fused MLP's training forward without autograd (the traced training path, training_ops.py):
    y, the saved packed tensor and ``a`` (``None`` where the save mode keeps neither)."""
    x2d, gate_up_weight, down_weight = tma_ready(x2d), tma_ready(gate_up_weight), tma_ready(down_weight)
    scales = {"gate_scale": gate_multiplier, "out_scale": down_multiplier}
    with torch.no_grad():
        return mlp_forward(x2d, gate_up_weight, down_weight, KEPT[save], scales)


@_on_tensor_device
def mlp_train_backward_2d(
    x2d, gate_up_weight, down_weight, dy, saved, a, gate_multiplier, down_multiplier, save, needs, *, in_place
):
    """Its backward: (dX, packed dW_gate_up, dW_down), ``None`` where not needed. With ``in_place`` it
    overwrites ``saved`` (the caller guarantees nothing reads it again), else the gradient gets a buffer
    of its own. ``a`` is left as it was: the compiler sees it as the forward op's output, and whatever
    reads it later would read freed memory if it were released (a crash, not an error)."""
    x2d, gate_up_weight, down_weight = tma_ready(x2d), tma_ready(gate_up_weight), tma_ready(down_weight)
    scales = {"gate_scale": gate_multiplier, "out_scale": down_multiplier}
    args = (dy, x2d, gate_up_weight, down_weight, saved, a, KEPT[save], scales, needs)
    with torch.no_grad():
        return mlp_backward_(*args, release_a=False, keep_saved=not in_place)


@_on_tensor_device
def linear_train_forward_2d(x2d, gate_up_weight, gate_multiplier, save):
    """The GLU operator's training forward without autograd (training_ops.py): ``a`` and the saved
    factors (``None`` for ``"recompute"``)."""
    x2d, gate_up_weight = tma_ready(x2d), tma_ready(gate_up_weight)
    with torch.no_grad():
        return linear_forward(x2d, gate_up_weight, gate_multiplier, KEPT[save])


@_on_tensor_device
def linear_train_backward_2d(x2d, gate_up_weight, da, factors, gate_multiplier, save, needs, *, in_place):
    """Its backward: (dX, packed dW_gate_up), ``None`` where not needed. With ``in_place`` it overwrites
    ``factors``; else the gradient gets a buffer of its own and ``factors`` are left as they were."""
    x2d, gate_up_weight = tma_ready(x2d), tma_ready(gate_up_weight)
    args = (da, x2d, gate_up_weight, factors, KEPT[save], gate_multiplier, needs)
    with torch.no_grad():
        return linear_backward_(*args, keep_saved=not in_place)
