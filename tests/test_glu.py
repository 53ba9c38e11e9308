"""The GLU operator alone: swiglu_linear, its in-place gradient kernel, and the SwiGLULinear module."""

import weakref

import pytest
import torch
from launch_spies import FORWARD_LAUNCHERS, record_launches, wrap_launchers

import fused_swiglu.passes as passes_mod
from fused_swiglu import SwiGLULinear, fused_path_available, pack_gate_up, swiglu_linear
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.glu_forward import glu_forward
from fused_swiglu.kernels.glu_grad import glu_grad_
from fused_swiglu.layout import CHUNK, split_packed_columns
from fused_swiglu.testing import (
    accuracy_rows,
    glu_oracle_step,
    make_problem,
    relative_error,
    run_eager_glu_step,
    run_glu_step,
    unit_roundoff,
)

MULTIPLIERS = [pytest.param(1.0, id="gm1"), pytest.param(0.5, id="gm0.5")]


def test_glu_grad_kernel_needs_something_saved(device):
    with pytest.raises(ValueError, match="needs saved"):
        glu_grad_(torch.zeros(4, 32, device=device), torch.zeros(4, 64, device=device), save=Saved.NOTHING)


def test_glu_grad_kernel_multiplies_both_halves_in_place(shape, dtype, device):
    p = make_problem(*shape, dtype=dtype, device=device)
    _, factors = glu_forward(p.x, p.w_gate_up, gate_multiplier=1.0, down_multiplier=1.0, save=Saved.FACTORS)
    f_up, f_gate = (t.double() for t in split_packed_columns(factors))
    out = glu_grad_(p.da, factors)
    assert out.data_ptr() == factors.data_ptr()
    d_up, d_gate = split_packed_columns(factors)
    da = p.da.double()
    # One rounding of an exact product: at most one unit roundoff per element.
    assert relative_error(d_up, da * f_up) <= unit_roundoff(dtype)
    assert relative_error(d_gate, da * f_gate) <= unit_roundoff(dtype)


@pytest.mark.parametrize("gate_multiplier", MULTIPLIERS)
@pytest.mark.parametrize("save", ["factors", "recompute"])
@pytest.mark.parametrize("cublas", [False, True], ids=["default-gemms", "fp32-gemms-on-cublas"])
def test_training_step_matches_reference(shape, dtype, device, save, gate_multiplier, cublas, monkeypatch):
    """Both GEMM paths: the default for the device, and the fp32 one of a GPU forced on any device."""
    if cublas:
        monkeypatch.setattr(passes_mod, "gemms_on_cublas", lambda dtype, on_gpu: dtype == torch.float32)
    launches = record_launches(monkeypatch, dict.fromkeys(FORWARD_LAUNCHERS, lambda kwargs: kwargs["save"]))
    p = make_problem(*shape, dtype=dtype, device=device, gate_multiplier=gate_multiplier)

    def fused(x, w):
        return swiglu_linear(x, w, gate_multiplier=gate_multiplier, save=save)

    rows = accuracy_rows(run_glu_step(fused, p), run_eager_glu_step(p), glu_oracle_step(p), dtype)
    failed = [f"{r.name}: {r.fused:.3e} > {r.bound:.3e} (eager {r.eager:.3e})" for r in rows if not r.ok]
    assert not failed, failed
    if save == "factors":
        assert launches == [Saved.FACTORS]
    else:  # the backward recomputes the factors piece by piece where the pieces are whole chunks
        pieces = passes_mod.RECOMPUTE_PIECES if shape[2] % (2 * CHUNK) == 0 else 1
        assert launches == [Saved.NOTHING] + [Saved.FACTORS] * pieces


@pytest.mark.parametrize("needs", ["x", "weight", "both"])
@pytest.mark.parametrize("cublas", [False, True], ids=["default-gemms", "fp32-gemms-on-cublas"])
def test_recompute_backward_keeps_one_piece_of_factors_alive(device, needs, cublas, monkeypatch):
    """Each recomputed piece of factors is released before the next is made, and the pieces' dW
    rows and dX terms add up to the reference gradients."""
    if cublas:
        monkeypatch.setattr(passes_mod, "gemms_on_cublas", lambda dtype, on_gpu: dtype == torch.float32)
    alive, pieces_alive_at_launch = weakref.WeakSet(), []

    def around(real, *args, **kwargs):
        pieces_alive_at_launch.append(len(alive))
        a, saved = real(*args, **kwargs)
        if saved is not None:
            alive.add(saved)
        return a, saved

    wrap_launchers(monkeypatch, FORWARD_LAUNCHERS, around)
    p = make_problem(45, 40, 96, dtype=torch.float32, device=device, gate_multiplier=0.5)
    x = p.x.detach().requires_grad_(needs in ("x", "both"))
    w = p.w_gate_up.detach().requires_grad_(needs in ("weight", "both"))
    swiglu_linear(x, w, gate_multiplier=0.5, save="recompute").backward(p.da)
    assert pieces_alive_at_launch == [0] * (1 + passes_mod.RECOMPUTE_PIECES)
    assert len(alive) == 0
    want = glu_oracle_step(p)
    assert (x.grad is None) == (needs == "weight") and (w.grad is None) == (needs == "x")
    if x.grad is not None:
        assert relative_error(x.grad, want["dx"]) < 1e-5
    if w.grad is not None:
        assert relative_error(w.grad, want["dw_gate_up"]) < 1e-5


def test_inference_matches_reference(device):
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device, gate_multiplier=0.5)
    with torch.no_grad():
        a = swiglu_linear(p.x.reshape(1, 37, 40), (p.w_gate, p.w_up), gate_multiplier=0.5)
    assert a.shape == (1, 37, 72) and a.grad_fn is None
    assert relative_error(a.reshape(37, 72), glu_oracle_step(p)["out"]) < 1e-5


def test_reference_fallback_for_unaligned_rows(device):
    p = make_problem(37, 12, 72, dtype=torch.float16, device=device)
    assert not fused_path_available(p.x, p.w_gate_up)
    got, want = run_glu_step(swiglu_linear, p), glu_oracle_step(p)
    for name in got:
        assert relative_error(got[name], want[name]) < 2e-3, name


def test_second_backward_raises_with_saved_factors(device):
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    a = swiglu_linear(p.x.requires_grad_(), p.w_gate_up)
    a.backward(p.da, retain_graph=True)
    with pytest.raises(RuntimeError, match="already walked backward"):
        a.backward(p.da)


@pytest.mark.parametrize(
    "save, error",
    [pytest.param("preact", ValueError, id="preact"), pytest.param("all", ValueError, id="unknown")],
)
def test_rejects_save_modes_it_does_not_have(save, error):
    with pytest.raises(error, match="save must be one of"):
        swiglu_linear(torch.randn(4, 16), torch.randn(32, 16), save=save)


def test_module_state_dict_and_training(device):
    glu = SwiGLULinear(40, 72, device=device, gate_multiplier=0.5)
    state = glu.state_dict()
    assert set(state) == {"gate_proj.weight", "up_proj.weight"}
    other = SwiGLULinear(40, 72, device=device, gate_multiplier=0.5, save="recompute")
    other.load_state_dict(state)
    assert torch.equal(other.gate_up_proj, pack_gate_up(state["gate_proj.weight"], state["up_proj.weight"]))
    x = torch.randn(3, 5, 40, device=device, requires_grad=True)
    glu(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    other(x).sum().backward()
    assert relative_error(x.grad, expected) < 1e-5
    assert "gate_multiplier=0.5" in repr(glu)
