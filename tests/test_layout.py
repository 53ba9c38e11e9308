import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fused_swiglu.layout import CHUNK, pack_gate_up, split_packed_columns, unpack_gate_up


@settings(max_examples=30, deadline=None)
@given(chunks=st.integers(1, 9), hidden=st.integers(1, 33), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip_is_exact(chunks, hidden, seed):
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(chunks * CHUNK, hidden, generator=gen)
    up = torch.randn(chunks * CHUNK, hidden, generator=gen)
    gate2, up2 = unpack_gate_up(pack_gate_up(gate, up))
    assert torch.equal(gate2, gate) and torch.equal(up2, up)


def test_packed_row_order_interleaves_up_then_gate_chunks():
    inter, hidden = 3 * CHUNK, 4
    gate = torch.arange(inter).float()[:, None].expand(inter, hidden)
    up = -1 - torch.arange(inter).float()[:, None].expand(inter, hidden)
    packed = pack_gate_up(gate, up)[:, 0]
    for c in range(3):
        rows = torch.arange(c * CHUNK, (c + 1) * CHUNK).float()
        assert torch.equal(packed[2 * c * CHUNK : (2 * c + 1) * CHUNK], -1 - rows)  # up chunk c
        assert torch.equal(packed[(2 * c + 1) * CHUNK : (2 * c + 2) * CHUNK], rows)  # gate chunk c


def test_split_packed_columns_matches_separate_projections():
    x = torch.randn(5, 12, dtype=torch.float64)
    gate, up = torch.randn(2, 4 * CHUNK, 12, dtype=torch.float64)
    up_cols, gate_cols = split_packed_columns(x @ pack_gate_up(gate, up).t())
    torch.testing.assert_close(up_cols, x @ up.t())
    torch.testing.assert_close(gate_cols, x @ gate.t())


def test_pack_is_differentiable():
    gate = torch.randn(2 * CHUNK, 3, requires_grad=True)
    up = torch.randn(2 * CHUNK, 3, requires_grad=True)
    weights = torch.randn(4 * CHUNK, 3)
    (pack_gate_up(gate, up) * weights).sum().backward()
    expect_gate, expect_up = unpack_gate_up(weights)
    assert torch.equal(gate.grad, expect_gate) and torch.equal(up.grad, expect_up)


@pytest.mark.parametrize(
    "gate_shape, up_shape, dtypes, error",
    [
        pytest.param(
            (12, 4), (12, 4), (torch.float32, torch.float32), ValueError, id="I-not-multiple-of-chunk"
        ),
        pytest.param((16, 4), (16, 5), (torch.float32, torch.float32), ValueError, id="shape-mismatch"),
        pytest.param((16,), (16,), (torch.float32, torch.float32), ValueError, id="not-2d"),
        pytest.param((16, 4), (16, 4), (torch.float32, torch.float16), TypeError, id="dtype-mismatch"),
    ],
)
def test_pack_rejects_bad_weights(gate_shape, up_shape, dtypes, error):
    with pytest.raises(error):
        pack_gate_up(torch.zeros(gate_shape, dtype=dtypes[0]), torch.zeros(up_shape, dtype=dtypes[1]))
