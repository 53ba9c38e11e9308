"""Routed experts (mixtures of experts) whose experts are SwiGLU MLPs, fused: the module and function
(routed.py), the custom ops around the kernels (ops.py), the routing of token slots into groups of
rows by expert (routing.py), the swap of transformers' expert modules (swap.py), and the kernels of
their own (kernels/: the routes, the combine). The gate/up and backward kernels are the dense
MLP's, in their routed variants (fused_swiglu/kernels/)."""

from .routed import SwiGLUExperts, reference_swiglu_experts, swiglu_experts

__all__ = ["SwiGLUExperts", "reference_swiglu_experts", "swiglu_experts"]
