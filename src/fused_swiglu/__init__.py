"""fused-swiglu: Triton kernels for the SwiGLU MLP of LLaMA/Mistral/Qwen-class models."""

from .experts import SwiGLUExperts, swiglu_experts
from .functional import fused_path_available, swiglu_linear, swiglu_mlp
from .integrations import swap_swiglu_mlps
from .layout import CHUNK, pack_gate_up, unpack_gate_up
from .nn import SwiGLULinear, SwiGLUMLP
from .reference import reference_swiglu, reference_swiglu_mlp

__all__ = [
    "CHUNK",
    "SwiGLUExperts",
    "SwiGLULinear",
    "SwiGLUMLP",
    "fused_path_available",
    "pack_gate_up",
    "reference_swiglu",
    "reference_swiglu_mlp",
    "swiglu_linear",
    "swap_swiglu_mlps",
    "swiglu_experts",
    "swiglu_mlp",
    "unpack_gate_up",
]
__version__ = "0.1.0"
