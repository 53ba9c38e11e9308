"""Where the fused kernels run: which calls take them, and which the PyTorch reference computes."""

from __future__ import annotations

import functools
import warnings

import torch

from .kernels.common import interpreting

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _kernels_built_for(device_index: int) -> bool:
    """Whether the fused kernels' tiles are built for this GPU: Hopper (compute capability 9.x).

    They are sized for Hopper's 227 KB of shared memory per block and tested there; compiled for
    Blackwell, tiles overflow its shared memory or spill (docs/design/kernel-choice.md), so newer GPUs
    take the PyTorch reference, with a warning once; older ones have no TMA. Cached: this runs on
    every call.
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

    They need fp16/bf16/fp32 on a Hopper GPU (compute capability 9.x), or fp16/fp32 CPU tensors under
    the Triton interpreter; rows 16-byte aligned (hidden and intermediate times the item size
    multiples of 16) and at least one token. Otherwise the PyTorch reference runs.
    """
    for name, t in (("x", x), ("gate_up_weight", gate_up_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.numel() == 0:
        return False
    hidden, inter, itemsize = x.shape[-1], gate_up_weight.shape[0] // 2, x.dtype.itemsize
    # The alignment is tested here, not in the constant-marked check below: compiled with dynamic
    # shapes, Dynamo may make the widths symbolic (torch 2.11 does), and that check takes constants.
    aligned = (hidden * itemsize) % 16 == 0 and (inter * itemsize) % 16 == 0
    return aligned and kernels_run_on(x.dtype, x.device)


def kernels_run_on(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the library's kernels run for tensors of ``dtype`` on ``device`` (the rows'
    alignment aside)."""
    if dtype not in FUSED_DTYPES:
        return False
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _kernels_built_for(index)
    # The interpreter multiplies bf16 x bf16 wrongly in tl.dot (triton 3.6: off by orders of magnitude,
    # no error), so a bf16 call on CPU takes the reference.
    return device.type == "cpu" and interpreting() and dtype != torch.bfloat16


def fp8_runs_on(device: torch.device) -> bool:
    """Whether ``fp8=True`` takes the FP8 path on ``device``: a Hopper GPU (cuBLAS's blockwise-scaled
    FP8 GEMMs, compute capability 9.x), or the CPU under the Triton interpreter (the GEMMs emulated,
    for the tests). Elsewhere the call runs without FP8, with a warning once."""
    if device.type == "cuda":
        if _is_hopper(device.index if device.index is not None else torch.cuda.current_device()):
            return True
    elif device.type == "cpu" and interpreting():
        return True
    _warn_no_fp8(str(device))
    return False


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


@functools.cache
def _warn_no_fp8(device: str) -> None:
    warnings.warn(
        f"fused_swiglu: fp8=True needs a Hopper GPU (sm_90: cuBLAS's blockwise-scaled FP8 GEMMs); on "
        f"{device} the MLP runs without FP8.",
        stacklevel=7,
    )


# A call traced by Dynamo (functional.py) decides while Dynamo traces it, from these constants: Dynamo
# calls a function so marked and keeps its result as a constant instead of tracing the device query.
# This is what torch.compiler.assume_constant_result does, which would import Dynamo with the library
# (about a second, which an eager user never pays). Were the mark ignored, Dynamo would trace it.
kernels_run_on._dynamo_marked_constant = True
fp8_runs_on._dynamo_marked_constant = True
