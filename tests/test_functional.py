"""swiglu_mlp end to end: training and inference paths, dispatch, fallback, and every error path."""

import dataclasses
import subprocess
import sys
import warnings
import weakref

import pytest
import torch
from launch_spies import BACKWARD_LAUNCHERS, FORWARD_LAUNCHERS, record_launches, wrap_launchers

import fused_swiglu.passes as passes_mod
import fused_swiglu.support as support_mod
from fused_swiglu import fused_path_available, pack_gate_up, swiglu_mlp
from fused_swiglu.kernels.common import Saved
from fused_swiglu.kernels.configs import (
    backward_is_warp_specialized,
    forward_is_warp_specialized,
    gemms_on_cublas,
    inference_uses_cublas,
)
from fused_swiglu.layout import CHUNK
from fused_swiglu.reference import reference_swiglu_mlp
from fused_swiglu.testing import (
    accuracy_rows,
    make_problem,
    oracle_step,
    relative_error,
    run_eager_step,
    run_step,
)

MULTIPLIERS = [pytest.param((1.0, 1.0), id="mult1"), pytest.param((0.5, 2.0), id="mult0.5-2")]
SAVES = ["factors", "preact", "recompute"]


def kernel_saves(save: str, inter: int) -> list[Saved]:
    """What the forward writes besides a, per launch: recompute runs it again in the backward, once
    per piece of the intermediate columns."""
    if save != "recompute":
        return [Saved.of(save)]
    pieces = passes_mod.RECOMPUTE_PIECES if inter % (passes_mod.RECOMPUTE_PIECES * CHUNK) == 0 else 1
    return [Saved.NOTHING] + [Saved.FACTORS] * pieces


@pytest.fixture
def forward_saves(monkeypatch):
    """The ``save`` argument of every forward GEMM launch, fused or (fp32 on a GPU) on cuBLAS with
    its in-place pass; NOTHING means inference."""
    return record_launches(monkeypatch, dict.fromkeys(FORWARD_LAUNCHERS, lambda kwargs: kwargs["save"]))


#: What each launcher in launch_spies' lists is called in the launch records, in the lists' order.
KERNEL_LABELS = ("triton", "warp-specialized", "cublas")


def kernel_labels(monkeypatch, launchers) -> list:
    """Which kernel each launch took: Triton, warp-specialized (Gluon), or (fp32 on a GPU) cuBLAS
    with its in-place pass."""
    record = {
        name: (lambda kwargs, label=label: label)
        for name, label in zip(launchers, KERNEL_LABELS, strict=True)
    }
    return record_launches(monkeypatch, record)


@pytest.fixture
def forward_launches(monkeypatch):
    return kernel_labels(monkeypatch, FORWARD_LAUNCHERS)


@pytest.fixture
def backward_launches(monkeypatch):
    return kernel_labels(monkeypatch, BACKWARD_LAUNCHERS)


def test_launch_spies_cover_every_launcher():
    """A launcher autograd calls but the spies do not wrap would go unrecorded (it happened once: a
    launch list came back empty on the GPU only)."""
    names = set(vars(passes_mod))
    assert {n for n in names if n.startswith("glu_forward")} == set(FORWARD_LAUNCHERS)
    assert {n for n in names if n.startswith("glu_backward")} == set(BACKWARD_LAUNCHERS)


def expected_launches(save: str, shape, dtype, device) -> tuple[list[str], list[str]]:
    """The kernels the library's selection rules pick, per forward and per backward launch of the
    save mode (the MLP's forwards all write ``a``)."""
    m, _, inter = shape
    on_gpu = device.type == "cuda"
    backward_save = Saved.PREACT if save == "preact" else Saved.FACTORS
    saves = kernel_saves(save, inter)

    def label(warp_specialized: bool) -> str:
        if gemms_on_cublas(dtype, on_gpu):
            return "cublas"
        return "warp-specialized" if warp_specialized else "triton"

    forwards = [label(forward_is_warp_specialized(m, dtype, on_gpu, s, True)) for s in saves]
    backward = label(backward_is_warp_specialized(m, dtype, on_gpu, backward_save))
    return forwards, [backward] * (len(saves) - 1 if save == "recompute" else 1)


def fused(problem, save):
    def fn(x, w_gate_up, w_down):
        return swiglu_mlp(
            x,
            w_gate_up,
            w_down,
            gate_multiplier=problem.gate_multiplier,
            down_multiplier=problem.down_multiplier,
            save=save,
        )

    return fn


@pytest.mark.parametrize("multipliers", MULTIPLIERS)
@pytest.mark.parametrize("save", SAVES)
def test_training_step_matches_reference(
    shape, dtype, device, save, multipliers, forward_saves, forward_launches, backward_launches
):
    p = make_problem(
        *shape, dtype=dtype, device=device, gate_multiplier=multipliers[0], down_multiplier=multipliers[1]
    )
    rows = accuracy_rows(run_step(fused(p, save), p), run_eager_step(p), oracle_step(p), dtype)
    failed = [f"{r.name}: {r.fused:.3e} > {r.bound:.3e} (eager {r.eager:.3e})" for r in rows if not r.ok]
    assert not failed, failed
    assert forward_saves == kernel_saves(save, shape[2])
    assert (forward_launches, backward_launches) == expected_launches(save, shape, dtype, device)


@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("multipliers", MULTIPLIERS)
def test_float32_gemms_on_cublas_match_reference(device, save, multipliers, forward_saves, monkeypatch):
    """The fp32 path of a GPU (cuBLAS GEMMs, SwiGLU passes in place), forced here on any device."""
    monkeypatch.setattr(passes_mod, "gemms_on_cublas", lambda dtype, on_gpu: dtype == torch.float32)
    fused_launches = []
    for name in ("glu_backward_", "glu_backward_ws_"):  # the fused ones: fp32 takes neither
        monkeypatch.setattr(passes_mod, name, lambda *a, **k: fused_launches.append(k))
    gm, dm = multipliers
    p = make_problem(70, 48, 96, dtype=torch.float32, device=device, gate_multiplier=gm, down_multiplier=dm)
    rows = accuracy_rows(run_step(fused(p, save), p), run_eager_step(p), oracle_step(p), torch.float32)
    failed = [f"{r.name}: {r.fused:.3e} > {r.bound:.3e} (eager {r.eager:.3e})" for r in rows if not r.ok]
    assert not failed, failed
    assert forward_saves == kernel_saves(save, p.w_down.shape[1])
    assert fused_launches == []


@pytest.mark.parametrize("needs", ["x", "weights", "all"])
@pytest.mark.parametrize("cublas", [False, True], ids=["default-gemms", "fp32-gemms-on-cublas"])
def test_recompute_backward_keeps_one_piece_alive(device, needs, cublas, monkeypatch):
    """Each recomputed piece (its factors and its part of a) is released before the next is made,
    and the pieces' gradient blocks and dX terms add up to the reference gradients."""
    if cublas:
        monkeypatch.setattr(passes_mod, "gemms_on_cublas", lambda dtype, on_gpu: dtype == torch.float32)
    alive, alive_at_launch = weakref.WeakSet(), []

    def around(real, *args, **kwargs):
        alive_at_launch.append(len(alive))
        a, saved = real(*args, **kwargs)
        if saved is not None:
            alive.update([a, saved])
        return a, saved

    wrap_launchers(monkeypatch, FORWARD_LAUNCHERS, around)
    multipliers = {"gate_multiplier": 0.5, "down_multiplier": 2.0}
    p = make_problem(45, 40, 96, dtype=torch.float32, device=device, **multipliers)
    x = p.x.detach().requires_grad_(needs in ("x", "all"))
    w_gate_up = p.w_gate_up.detach().requires_grad_(needs in ("weights", "all"))
    w_down = p.w_down.detach().requires_grad_(needs in ("weights", "all"))
    swiglu_mlp(x, w_gate_up, w_down, save="recompute", **multipliers).backward(p.dy)
    assert alive_at_launch == [0] * (1 + passes_mod.RECOMPUTE_PIECES)
    assert len(alive) == 0
    want = oracle_step(p)
    for name, got in (("dx", x.grad), ("dw_gate_up", w_gate_up.grad), ("dw_down", w_down.grad)):
        assert (got is None) == (needs == ("weights" if name == "dx" else "x")), name
        if got is not None:
            assert relative_error(got, want[name]) < 1e-5, name


@pytest.mark.parametrize("rows", [5, 37, 130], ids=["decode-rows", "small-rows", "large-rows"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_inference_path_saves_nothing(device, mode, rows, forward_saves):
    """Decode-sized batches take cuBLAS plus the activation pass, larger ones the fused kernel."""
    multipliers = {"gate_multiplier": 0.5, "down_multiplier": 2.0}
    p = make_problem(rows, 40, 72, dtype=torch.float32, device=device, **multipliers)
    w_gate_up = p.w_gate_up.requires_grad_(mode != "nothing_requires_grad")
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    with context():
        y = swiglu_mlp(p.x, w_gate_up, p.w_down, gate_multiplier=0.5, down_multiplier=2.0)
    assert y.grad_fn is None
    assert forward_saves == ([] if inference_uses_cublas(rows) else [Saved.NOTHING])
    expected = oracle_step(p)["out"]
    assert relative_error(y, expected) < 1e-5


def test_separate_gate_and_up_weights_get_their_own_gradients(device):
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    w_gate = p.w_gate.clone().requires_grad_()
    w_up = p.w_up.clone().requires_grad_()
    y = swiglu_mlp(p.x, (w_gate, w_up), p.w_down)
    y.backward(p.dy)
    eager = run_eager_step(p)
    expected_gate_up = eager["dw_gate_up"]
    assert relative_error(y, eager["out"]) < 1e-5
    assert relative_error(pack_gate_up(w_gate.grad, w_up.grad), expected_gate_up) < 1e-5


def test_leading_dims_and_non_contiguous_input(device):
    p = make_problem(24, 40, 72, dtype=torch.float32, device=device)
    # [40, 2, 12] transposed to [2, 12, 40]: last dim has stride 24, so it must be copied for TMA.
    x = p.x.reshape(2, 12, 40).permute(2, 0, 1).contiguous().permute(1, 2, 0).requires_grad_()
    w_gate_up = p.w_gate_up.requires_grad_()
    y = swiglu_mlp(x, w_gate_up, p.w_down)
    assert y.shape == (2, 12, 40)
    y.sum().backward()  # an expanded (stride 0) dy
    expected = oracle_step(dataclasses.replace(p, dy=torch.ones_like(p.dy)))
    assert relative_error(y.reshape(24, 40), expected["out"]) < 1e-5
    assert relative_error(x.grad.reshape(24, 40), expected["dx"]) < 1e-5
    assert relative_error(w_gate_up.grad, expected["dw_gate_up"]) < 1e-5


def test_only_weights_require_grad(device):
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    w_down = p.w_down.requires_grad_()
    swiglu_mlp(p.x, p.w_gate_up, w_down).backward(p.dy)
    assert relative_error(w_down.grad, oracle_step(p)["dw_down"]) < 1e-5


@pytest.mark.parametrize(
    "hidden, fallback_dtype",
    [
        pytest.param(12, torch.float16, id="rows-not-16-byte-aligned"),
        pytest.param(40, torch.float64, id="float64"),
    ],
)
def test_reference_fallback_is_correct(device, hidden, fallback_dtype, forward_saves):
    p = make_problem(37, hidden, 72, dtype=fallback_dtype, device=device)
    assert not fused_path_available(p.x, p.w_gate_up)
    got = run_step(fused(p, "preact"), p)
    want = oracle_step(p)
    assert forward_saves == []
    for name in got:
        assert relative_error(got[name], want[name]) < 2e-3, name


def test_fused_path_is_taken_where_supported(device):
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    assert fused_path_available(p.x, p.w_gate_up)


def test_second_backward_raises(device):
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    x = p.x.requires_grad_()
    y = swiglu_mlp(x, p.w_gate_up, p.w_down)
    y.backward(p.dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="already walked backward"):
        y.backward(p.dy)


def test_recompute_mode_allows_a_second_backward(device):
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    x = p.x.requires_grad_()
    y = swiglu_mlp(x, p.w_gate_up, p.w_down, save="recompute")
    y.backward(p.dy, retain_graph=True)
    first = x.grad.clone()
    y.backward(p.dy)
    assert relative_error(x.grad, 2 * first) < 1e-6


def test_create_graph_raises(device):
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    x = p.x.requires_grad_()
    y = swiglu_mlp(x, p.w_gate_up, p.w_down)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(y, x, p.dy, create_graph=True)


def test_import_and_call_leave_dynamo_unloaded():
    """Importing torch._dynamo costs about a second: an eager user of the library never pays it."""
    code = (
        "import sys, torch; from fused_swiglu import swiglu_mlp; "
        "swiglu_mlp(torch.randn(4, 16), torch.randn(32, 16), torch.randn(16, 16)); "
        "print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("save", SAVES)
def test_tensors_on_a_device_that_is_not_current(save):
    """Training and inference with every tensor on the second GPU while the first is current."""
    multipliers = {"gate_multiplier": 0.5, "down_multiplier": 2.0}
    p = make_problem(37, 40, 72, dtype=torch.float32, device=torch.device("cuda", 1), **multipliers)
    assert torch.cuda.current_device() == 0
    rows = accuracy_rows(run_step(fused(p, save), p), run_eager_step(p), oracle_step(p), torch.float32)
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
    with torch.no_grad():
        for m in (5, 37):  # the decode path and the fused inference kernel
            y = swiglu_mlp(p.x[:m], p.w_gate_up, p.w_down, **multipliers)
            expected = reference_swiglu_mlp(p.x[:m], p.w_gate, p.w_up, p.w_down, **multipliers)
            assert relative_error(y, expected) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("rows", [300, 40])  # the bulk tile and the small-batch one
def test_float32_with_tf32_matmuls(device, save, rows, monkeypatch):
    """fp32 follows torch's TF32 switch; its tensor-core tiles must fit shared memory, and be at least
    as accurate as eager PyTorch under the same switch (one truncating TF32 pass was 3x less so)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    multipliers = {"gate_multiplier": 0.5, "down_multiplier": 2.0}
    p = make_problem(rows, 256, 512, dtype=torch.float32, device=device, **multipliers)
    rows = accuracy_rows(run_step(fused(p, save), p), run_eager_step(p), oracle_step(p), torch.float32)
    failed = [f"{r.name}: {r.fused:.3e} > {r.bound:.3e} (eager {r.eager:.3e})" for r in rows if not r.ok]
    assert not failed, failed


@pytest.mark.parametrize(
    ("capability", "fused", "warns"),
    [((9, 0), True, False), ((8, 9), False, False), ((10, 0), False, True), ((12, 0), False, True)],
    ids=["hopper", "ada", "blackwell-sm100", "blackwell-sm120"],
)
def test_fused_kernels_only_where_their_tiles_are_built(monkeypatch, capability, fused, warns):
    """Hopper takes the fused kernels; newer GPUs, whose shared memory the tiles do not fit, take the
    reference with a warning; older ones (no TMA) take it silently."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    support_mod._kernels_built_for.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert support_mod._kernels_built_for(0) is fused
            assert support_mod._kernels_built_for(0) is fused  # cached: one warning per device
        messages = [str(w.message) for w in caught]
        assert len(messages) == int(warns)
        if warns:
            assert f"sm_{capability[0]}{capability[1]}" in messages[0] and "reference" in messages[0]
    finally:
        support_mod._kernels_built_for.cache_clear()
