"""Explicit test shapes with readable ids (no cartesian products)."""

import pytest
import torch
from hypothesis import strategies as st

# (M, hidden, intermediate). Hidden and intermediate are multiples of 8 but not of the interpreter
# tile (16) or the GPU tiles (64/128), M includes 1 and sizes that leave ragged row tiles.
CPU_SHAPES = [
    pytest.param((1, 40, 72), id="M1-H40-I72"),
    pytest.param((37, 24, 56), id="M37-H24-I56"),
    pytest.param((130, 40, 72), id="M130-H40-I72"),
    pytest.param((64, 64, 64), id="M64-H64-I64"),
]
GPU_SHAPES = CPU_SHAPES + [
    pytest.param((257, 264, 328), id="M257-H264-I328"),
    pytest.param((1000, 1032, 2760), id="M1000-H1032-I2760"),
    pytest.param((4100, 2048, 5632), id="M4100-H2048-I5632"),
]


def shapes_for(device: torch.device):
    return GPU_SHAPES if device.type == "cuda" else CPU_SHAPES


def dtypes_for(device: torch.device):
    # bf16 x bf16 tl.dot is wrong under the Triton interpreter; bf16 is tested on the GPU.
    if device.type == "cuda":
        return [torch.bfloat16, torch.float16, torch.float32]
    return [torch.float32, torch.float16]


#: Scalar multipliers for the fuzz tests: away from zero, where the products underflow to subnormals
#: (a multiplier of 1e-38 makes fp32 outputs of 1e-39) and no relative-error rule holds.
MULTIPLIER_VALUES = st.floats(-2, 2).filter(lambda v: abs(v) > 1e-3)
