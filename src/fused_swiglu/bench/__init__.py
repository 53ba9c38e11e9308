"""``python -m fused_swiglu bench``: this library beside its peers and the GEMM-only floor, on a GPU."""
