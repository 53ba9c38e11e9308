"""swiglu_linear with a low-rank term u @ v^T in the pre-activation (LoRA on gate and up): outputs and
the gradients of x, the packed weight, u and v against the float64 reference, by the accuracy rule
(within 2x eager PyTorch's own error), through the kernel's extra dot and (wide ranks) cuBLAS."""

import pytest
import torch

from fused_swiglu import swiglu_linear
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.configs import (
    LOW_RANK_IN_KERNEL,
    fit_low_rank,
    forward_config,
    forward_shared_memory,
)
from fused_swiglu.reference import reference_swiglu_packed
from fused_swiglu.testing import accuracy_rows

#: Ranks: padded to 16, to 32, the widest the kernel takes, and one beyond it (cuBLAS plus a pass).
RANKS = [3, 24, LOW_RANK_IN_KERNEL, LOW_RANK_IN_KERNEL + 8]


def _problem(shape, rank, dtype, device, seed=0):
    m, hidden, inter = shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dtype)

    return {
        "x": randn(m, hidden),
        "w": randn(2 * inter, hidden, scale=hidden**-0.5),
        "u": randn(m, rank, scale=0.5),
        "v": randn(2 * inter, rank, scale=rank**-0.5),
        "da": randn(m, inter),
    }


def _step(fn, p, dtype=None):
    leaves = {k: p[k].detach().to(dtype or p[k].dtype).requires_grad_() for k in ("x", "w", "u", "v")}
    a = fn(leaves)
    a.backward(p["da"].to(a.dtype))
    return {"a": a.detach(), **{f"d{k}": t.grad for k, t in leaves.items()}}


def _reference(leaves, compute_dtype=None):
    low_rank = (leaves["u"], leaves["v"])
    return reference_swiglu_packed(
        leaves["x"], leaves["w"], gate_multiplier=0.7, low_rank=low_rank, compute_dtype=compute_dtype
    )


#: Independent problems per case, their results side by side: at one row the output has a few dozen
#: elements, and a single one whose pre-activation cancels can decide a relative error on its own
#: (in either implementation), which compares two roundings of one element rather than two methods.
PROBLEMS = 3


def _steps(fn, shape, rank, dtype, device, compute_dtype=None):
    steps = [_step(fn, _problem(shape, rank, dtype, device, seed), compute_dtype) for seed in range(PROBLEMS)]
    return {name: torch.cat([step[name].flatten() for step in steps]) for name in steps[0]}


@pytest.mark.parametrize("save", ["factors", "recompute"])
@pytest.mark.parametrize("rank", RANKS)
def test_low_rank_term_trains_like_the_reference(device, shape, dtype, rank, save):
    def fused(t):
        return swiglu_linear(t["x"], t["w"], gate_multiplier=0.7, save=save, low_rank=(t["u"], t["v"]))

    got = _steps(fused, shape, rank, dtype, device)
    oracle = _steps(_reference, shape, rank, dtype, device, torch.float64)
    eager = _steps(_reference, shape, rank, dtype, device)
    for row in accuracy_rows(got, eager, oracle, dtype):
        assert row.fused <= row.bound, row


def test_low_rank_inference_matches_training(device):
    p = _problem((37, 24, 56), 5, torch.float32, device)
    with torch.no_grad():
        inferred = swiglu_linear(p["x"], p["w"], low_rank=(p["u"], p["v"]))
    trained = swiglu_linear(p["x"], p["w"].requires_grad_(), low_rank=(p["u"], p["v"]))
    assert torch.equal(inferred, trained.detach())


def test_low_rank_leading_dims_follow_x(device):
    p = _problem((12, 24, 56), 4, torch.float32, device)
    x, u = p["x"].reshape(3, 4, 24), p["u"].reshape(3, 4, 4)
    a = swiglu_linear(x, p["w"], low_rank=(u, p["v"]))
    assert a.shape == (3, 4, 56)
    expected = reference_swiglu_packed(p["x"], p["w"], low_rank=(p["u"], p["v"]), compute_dtype=torch.float64)
    assert (a.reshape(12, 56).double() - expected).norm() / expected.norm() < 1e-5


@pytest.mark.parametrize(
    "u_shape, v_shape, match",
    [
        ((12, 4), (100, 4), "v \\[112, R\\]"),
        ((11, 4), (112, 4), "leading dims"),
        ((12, 4), (112, 5), "u \\[..., R\\]"),
        ((12, 0), (112, 0), "u \\[..., R\\]"),
    ],
)
def test_low_rank_shapes_are_checked(device, u_shape, v_shape, match):
    p = _problem((12, 24, 56), 4, torch.float32, device)
    u, v = torch.zeros(u_shape, device=device), torch.zeros(v_shape, device=device)
    with pytest.raises(ValueError, match=match):
        swiglu_linear(p["x"], p["w"], low_rank=(u, v))


def test_low_rank_dtype_is_checked(device):
    p = _problem((12, 24, 56), 4, torch.float32, device)
    with pytest.raises(TypeError, match="low_rank u must match x's dtype"):
        swiglu_linear(p["x"], p["w"], low_rank=(p["u"].double(), p["v"]))


def test_low_rank_compiles_to_one_graph(device):
    """Under torch.compile (fullgraph) the step equals the eager fused step."""
    p = _problem((37, 24, 56), 6, torch.float32, device)

    def fused(t):
        return swiglu_linear(t["x"], t["w"], gate_multiplier=0.7, low_rank=(t["u"], t["v"]))

    torch._dynamo.reset()
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    eager, traced = _step(fused, p), _step(compiled, p)
    for name in eager:
        assert torch.allclose(traced[name], eager[name], rtol=1e-6, atol=1e-6), name


#: Shared memory one program may use on Hopper (sm_90, opt-in).
HOPPER_SHARED_MEMORY = 232448


@pytest.mark.parametrize("m", [16, 4096])
@pytest.mark.parametrize("save", [Saved.NOTHING, Saved.FACTORS, Saved.PREACT])
@pytest.mark.parametrize("rank", [16, 32, 48, LOW_RANK_IN_KERNEL])
def test_low_rank_tiles_fit_in_shared_memory(m, save, rank):
    # Every GPU tile the forward kernel may run with a term it takes keeps its buffers within the
    # limit, losing pipeline stages only where the term's buffers do not fit beside them.
    cfg = forward_config(m, 4096, 14336, torch.bfloat16, True, save, "ieee")
    fitted = fit_low_rank(cfg, 2, rank, save, True, HOPPER_SHARED_MEMORY)
    assert forward_shared_memory(fitted, 2, rank, save, True) < HOPPER_SHARED_MEMORY
    assert 2 <= fitted.num_stages <= cfg.num_stages
    if forward_shared_memory(cfg, 2, rank, save, True) + 1024 <= HOPPER_SHARED_MEMORY:
        assert fitted == cfg
    else:
        assert fitted.num_stages < cfg.num_stages
