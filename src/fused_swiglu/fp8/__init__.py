"""The FP8 training path of the dense MLP (``fp8=True``): e4m3 operands for the step's six GEMMs with
amax / 448 fp32 scales local to a 128-wide group (format.py), the passes between the GEMMs that
make them (kernels.py), the custom ops and autograd Function (ops.py), and the same in plain
PyTorch (reference.py)."""

from torch import nn


def torchao_filter(module: nn.Module, fqn: str) -> bool:
    """For torchao's ``convert_to_float8_training(model, module_filter_fn=torchao_filter)`` after the
    swap: every Linear but a fused MLP's down projection, which the fused MLP runs itself (in FP8
    with ``fp8=True``; a converted one would take it off the fused path)."""
    return not getattr(module, "fused_swiglu_down", False)


__all__ = ["torchao_filter"]
