"""SwiGLU experts over rows already grouped by expert (experts/grouped.py, torchtitan's interface):
output and every gradient against a float64 reference, expert by expert, with empty experts and
padding rows past the groups; the same kernels as the routed experts."""

import pytest
import torch

from fused_swiglu.experts.grouped import swiglu_grouped_experts
from fused_swiglu.reference import reference_swiglu_mlp_packed
from fused_swiglu.testing import accuracy_rows, relative_error

NAMES = ("y", "x", "gate_up", "down")

CASES = [
    # rows, hidden, intermediate, counts (their sum at most rows: the rest padding)
    pytest.param((37, 32, 48, [10, 0, 20, 7]), id="R37-E4-empty"),
    pytest.param((50, 48, 24, [30, 12]), id="R50-E2-padding8"),
    pytest.param((19, 32, 16, [19]), id="R19-E1"),
    pytest.param((140, 16, 32, [0, 130, 0]), id="R140-E3-two-tiles-padding10"),
    pytest.param((8, 32, 16, [0, 0]), id="R8-all-padding"),
]


def reference_grouped(x, counts, gate_up, down):
    """Expert by expert in PyTorch; rows past the groups zero."""
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = slice(start, start + n)
        out[rows] = reference_swiglu_mlp_packed(x[rows], gate_up[e], down[e])
        start += n
    return out


def problem(case, device):
    rows, hidden, inter, counts = case
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, hidden, generator=g)
    experts = len(counts)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    dy = torch.randn(rows, hidden, generator=g)
    return [t.to(device) for t in (x, gate_up, down, dy)], torch.tensor(counts, device=device)


def step(fn, x, gate_up, down, dy, counts, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, gate_up, down)]
    y = fn(leaves[0], counts, leaves[1], leaves[2])
    y.backward(dy.to(dtype))
    return dict(zip(NAMES, (y.detach(), *(t.grad for t in leaves)), strict=True))


@pytest.mark.parametrize("save", ["factors", "preact", "recompute"])
@pytest.mark.parametrize("case", CASES)
def test_grouped_experts_match_float64_reference(device, case, save):
    tensors, counts = problem(case, device)

    def fused(x, c, gate_up, down):
        return swiglu_grouped_experts(x, c, gate_up, down, save=save)

    got = step(fused, *tensors, counts, torch.float32)
    oracle = step(reference_grouped, *tensors, counts, torch.float64)
    padding = sum(case[3])
    assert (got["y"][padding:] == 0).all() and (got["x"][padding:] == 0).all()
    for name in NAMES:
        assert relative_error(got[name], oracle[name]) < 1e-5, name


@pytest.mark.parametrize("save", ["factors", "preact", "recompute"])
def test_grouped_experts_half_precision_within_twice_eager_error(device, save):
    tensors, counts = problem((140, 32, 48, [60, 0, 70]), device)

    def fused(x, c, gate_up, down):
        return swiglu_grouped_experts(x, c, gate_up, down, save=save)

    got = step(fused, *tensors, counts, torch.float16)
    eager = step(reference_grouped, *tensors, counts, torch.float16)
    oracle = step(reference_grouped, *tensors, counts, torch.float64)
    rows = accuracy_rows(got, eager, oracle, torch.float16)
    assert all(row.ok for row in rows), rows


def test_grouped_no_grad_is_the_training_forward(device):
    tensors, counts = problem((50, 48, 24, [30, 12]), device)
    x, gate_up, down, _ = tensors
    with torch.no_grad():
        y = swiglu_grouped_experts(x, counts, gate_up, down)
    want = step(swiglu_grouped_experts, *tensors, counts, torch.float32)["y"]
    assert torch.equal(y, want)


def test_grouped_experts_compile_to_one_graph(device):
    from torch._dynamo.utils import counters

    tensors, counts = problem((37, 32, 48, [10, 0, 20, 7]), device)
    want = step(swiglu_grouped_experts, *tensors, counts, torch.float32)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(swiglu_grouped_experts, backend="aot_eager", fullgraph=True)
    got = step(compiled, *tensors, counts, torch.float32)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for name in NAMES:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda a: {**a, "counts": a["counts"].float()}, TypeError, "counts must hold integers"),
        (lambda a: {**a, "counts": a["counts"][:1]}, ValueError, "do not fit"),
        (lambda a: {**a, "x": a["x"][:, :8]}, ValueError, "do not fit"),
        (lambda a: {**a, "x": a["x"].double()}, TypeError, "share a floating-point dtype"),
        (lambda a: {**a, "x": [1.0]}, TypeError, "x must be a torch.Tensor"),
    ],
    ids=["float-counts", "counts-per-expert", "hidden", "dtype", "not-a-tensor"],
)
def test_bad_input_is_refused_by_name(device, change, error, words):
    (x, gate_up, down, _), counts = problem((37, 32, 48, [10, 0, 20, 7]), device)
    args = change({"x": x, "counts": counts, "gate_up_weight": gate_up, "down_weight": down})
    with pytest.raises(error, match=words):
        swiglu_grouped_experts(**args)
