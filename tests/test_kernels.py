"""The two kernel launchers against formulas in float64, with eager PyTorch's same-dtype error as the bar."""

import threading

import pytest
import torch
import torch.nn.functional as F
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from shapes import MULTIPLIER_VALUES

from fused_swiglu.kernels import glu_backward_ws as glu_backward_ws_mod
from fused_swiglu.kernels import glu_forward_ws as glu_forward_ws_mod
from fused_swiglu.kernels import hopper_ws, launch
from fused_swiglu.kernels.common import Saved, cdiv, next_power_of_2
from fused_swiglu.kernels.configs import (
    PING_PONG_MAX_HIDDEN,
    TileConfig,
    backward_is_warp_specialized,
    forward_is_warp_specialized,
)
from fused_swiglu.kernels.glu_activation import glu_activation
from fused_swiglu.kernels.glu_backward import glu_backward_
from fused_swiglu.kernels.glu_backward_ws import (
    CONFIGS,
    PING_PONG,
    WSConfig,
    backward_config,
    glu_backward_ws_,
)
from fused_swiglu.kernels.glu_forward import glu_forward
from fused_swiglu.kernels.glu_forward_ws import WSForwardConfig, glu_forward_ws
from fused_swiglu.kernels.glu_split import glu_backward_split_, glu_forward_split
from fused_swiglu.layout import CHUNK, split_packed_columns
from fused_swiglu.testing import make_problem, relative_error, unit_roundoff

MULTIPLIERS = [pytest.param((1.0, 1.0), id="mult1"), pytest.param((0.7, 1.3), id="mult0.7-1.3")]


def _backward_launch(pick):
    """The Gluon backward with the launch shape ``pick(save)`` (None: the library's choice)."""
    return lambda *args, save, **kwargs: glu_backward_ws_(*args, save=save, config=pick(save), **kwargs)


# Three implementations of one contract: the fused Triton kernels, the warp-specialized Gluon ones
# (Hopper GPUs, 16-bit), and cuBLAS GEMMs with in-place SwiGLU passes (what fp32 runs on a GPU). The
# Gluon backward has two launch shapes, each tested whatever the shape would pick.
FORWARDS = {"fused": glu_forward, "warp-specialized": glu_forward_ws, "split": glu_forward_split}
BACKWARDS = {
    "fused": glu_backward_,
    "warp-specialized cooperative": _backward_launch(CONFIGS.get),
    "warp-specialized ping-pong": _backward_launch(lambda save: PING_PONG),
    "split": glu_backward_split_,
}


def skip_unless_runs(impl, device, dtype):
    """The Gluon kernels run on an sm_90 GPU, in bf16/fp16, with the Triton release they were tested with."""
    if not impl.startswith("warp-specialized"):
        return
    if device.type != "cuda" or not hopper_ws.AVAILABLE:
        pytest.skip("the warp-specialized kernels need a Hopper GPU and Triton 3.6")
    if dtype == torch.float32:
        pytest.skip("the warp-specialized kernels take bf16/fp16 (fp32 runs its GEMMs on cuBLAS)")


def swiglu_terms(x, w_gate, w_up, gm):
    """silu(g), u * silu'(g) * gm, u, g for g = gm * x @ Wg^T, computed in x's dtype (eager)."""
    g = gm * (x @ w_gate.t())
    u = x @ w_up.t()
    s = torch.sigmoid(g)
    return F.silu(g), u * s * (1 + g * (1 - s)) * gm, u, g


def assert_like_eager(fused, eager, exact, dtype, what):
    fused_err, eager_err = relative_error(fused, exact), relative_error(eager, exact)
    assert fused_err <= 2 * eager_err + unit_roundoff(dtype), (
        f"{what}: {fused_err:.3e} vs eager {eager_err:.3e}"
    )


@pytest.mark.parametrize("impl", FORWARDS)
@pytest.mark.parametrize("multipliers", MULTIPLIERS)
@pytest.mark.parametrize("save", [Saved.NOTHING, Saved.FACTORS, Saved.PREACT], ids=lambda s: s.name)
def test_forward_kernel(shape, dtype, device, save, multipliers, impl):
    skip_unless_runs(impl, device, dtype)
    gm, dm = multipliers
    p = make_problem(*shape, dtype=dtype, device=device)
    a, saved = FORWARDS[impl](p.x, p.w_gate_up, gate_multiplier=gm, down_multiplier=dm, save=save)

    silu64, fgate64, u64, g64 = swiglu_terms(p.x.double(), p.w_gate.double(), p.w_up.double(), gm)
    silu, fgate, u, g = swiglu_terms(p.x, p.w_gate, p.w_up, gm)
    assert_like_eager(a, dm * silu * u, dm * silu64 * u64, dtype, "a")
    if save == Saved.NOTHING:
        assert saved is None
        return
    first, second = split_packed_columns(saved)
    if save == Saved.FACTORS:
        assert_like_eager(first, silu, silu64, dtype, "silu(g)")
        assert_like_eager(second, fgate, fgate64, dtype, "gm * u * silu'(g)")
    else:
        assert_like_eager(first, u, u64, dtype, "u")
        assert_like_eager(second, g / gm, g64 / gm, dtype, "x @ Wg^T")


@pytest.mark.parametrize("impl", BACKWARDS)
@pytest.mark.parametrize("multipliers", MULTIPLIERS)
@pytest.mark.parametrize("save", [Saved.FACTORS, Saved.PREACT], ids=lambda s: s.name)
def test_backward_kernel_overwrites_saved_with_packed_gradient(shape, dtype, device, save, multipliers, impl):
    if impl.endswith("ping-pong") and save == Saved.PREACT:
        pytest.skip("the ping-pong launch reads saved factors only")
    skip_unless_runs(impl, device, dtype)
    gm, dm = multipliers
    p = make_problem(*shape, dtype=dtype, device=device)
    _, saved = glu_forward(p.x, p.w_gate_up, gate_multiplier=gm, down_multiplier=dm, save=save)
    # The exact gradient of the saved (rounded) tensors, so only the backward kernel's error is measured.
    first, second = (t.double() for t in split_packed_columns(saved))
    if save == Saved.FACTORS:
        silu64, fgate64 = first, second
        a64 = None
    else:
        u64, g64 = first, gm * second
        s64 = torch.sigmoid(g64)
        silu64, fgate64 = g64 * s64, u64 * s64 * (1 + g64 * (1 - s64)) * gm
        a64 = dm * silu64 * u64
    da64 = dm * p.dy.double() @ p.w_down.double()
    da = dm * p.dy @ p.w_down  # eager rounds dA to the dtype before the multiplies
    eager_first, eager_second = (t.to(dtype) for t in (silu64, fgate64))

    recomputed = BACKWARDS[impl](p.dy, p.w_down, saved, gate_multiplier=gm, down_multiplier=dm, save=save)

    d_up, d_gate = split_packed_columns(saved)
    assert_like_eager(d_up, da * eager_first, da64 * silu64, dtype, "dU")
    assert_like_eager(d_gate, da * eager_second, da64 * fgate64, dtype, "dG")
    if save == Saved.FACTORS:
        assert recomputed is None
    else:
        eager_a = (dm * silu64 * u64).to(dtype)
        assert_like_eager(recomputed, eager_a, a64, dtype, "recomputed a")


def test_routed_backward_is_warp_specialized_where_it_runs():
    """Saved factors in 16 bits on the GPU at hidden sizes up to the ping-pong launch's; never
    pre-activations, fp32, decode sizes, wider hidden sizes or the interpreter."""
    from fused_swiglu.kernels.configs import routed_backward_is_warp_specialized as chosen

    bf16 = torch.bfloat16
    assert chosen(4096, 4096, bf16, True, Saved.FACTORS) == hopper_ws.AVAILABLE
    assert chosen(65, 2048, torch.float16, True, Saved.FACTORS) == hopper_ws.AVAILABLE
    assert not chosen(4096, 4096, bf16, True, Saved.PREACT)
    assert not chosen(4096, 4096 + 64, bf16, True, Saved.FACTORS)
    assert not chosen(64, 2048, bf16, True, Saved.FACTORS)
    assert not chosen(4096, 2048, torch.float32, True, Saved.FACTORS)
    assert not chosen(4096, 2048, bf16, False, Saved.FACTORS)


def test_warp_specialized_kernels_are_chosen_where_they_run():
    """Bulk-sized 16-bit problems on the GPU; never fp32, decode sizes or the interpreter (Gluon
    kernels need a GPU), nor inference or the forward that skips ``a``."""
    bf16, fp16 = torch.bfloat16, torch.float16
    for save in (Saved.FACTORS, Saved.PREACT):
        assert backward_is_warp_specialized(4096, bf16, True, save) == hopper_ws.AVAILABLE
        assert backward_is_warp_specialized(65, fp16, True, save) == hopper_ws.AVAILABLE
        assert not backward_is_warp_specialized(64, bf16, True, save)
        assert not backward_is_warp_specialized(4096, torch.float32, True, save)
        assert not backward_is_warp_specialized(4096, bf16, False, save)
    for save in (Saved.FACTORS, Saved.PREACT):
        assert forward_is_warp_specialized(4096, bf16, True, save, True) == hopper_ws.AVAILABLE
        assert forward_is_warp_specialized(65, fp16, True, save, True) == hopper_ws.AVAILABLE
        assert not forward_is_warp_specialized(64, bf16, True, save, True)
        assert not forward_is_warp_specialized(4096, torch.float32, True, save, True)
        assert not forward_is_warp_specialized(4096, bf16, False, save, True)
    assert not forward_is_warp_specialized(4096, bf16, True, Saved.FACTORS, False)
    assert not forward_is_warp_specialized(4096, bf16, True, Saved.NOTHING, True)


def test_backward_launch_shape_follows_the_hidden_size():
    """Ping-pong where the epilogue is a large share of a tile (small hidden sizes), saved factors only."""
    assert backward_config(Saved.FACTORS, PING_PONG_MAX_HIDDEN) is PING_PONG
    assert backward_config(Saved.FACTORS, 896) is PING_PONG
    assert backward_config(Saved.FACTORS, PING_PONG_MAX_HIDDEN + 8) is CONFIGS[Saved.FACTORS]
    assert backward_config(Saved.PREACT, 896) is CONFIGS[Saved.PREACT]
    assert backward_config(Saved.PREACT, 4096) is CONFIGS[Saved.PREACT]


def test_ping_pong_launch_runs_two_tiles_a_program_on_one_warpgroup_each():
    assert PING_PONG.meta()["num_warps"] == 4 and CONFIGS[Saved.FACTORS].meta()["num_warps"] == 8
    assert PING_PONG.programs(128 * 3, 128, torch.device("cpu")) == 2  # three tiles, two a program


@pytest.mark.parametrize(
    "make, changes",
    [
        (WSConfig, {"pieces": 3}),
        (WSConfig, {"pieces": 64}),  # 4 columns a piece: less than one packed chunk
        (WSConfig, {"saved_buffers": 1}),  # not deeper than the store lag: would deadlock
        (WSConfig, {"a_buffers": 2, "store_lag": 2}),
        (WSConfig, {"store_lag": 0}),
        (WSForwardConfig, {"buffers": 2, "store_lag": 2}),
        (WSForwardConfig, {"pieces": 32}),
    ],
)
def test_warp_specialized_configs_reject_what_cannot_run(make, changes):
    with pytest.raises(ValueError):
        make(**changes)


def test_warp_specialized_backward_needs_buffers_for_a_with_saved_preactivations(device):
    p = make_problem(128, 64, 256, dtype=torch.float16, device=device)
    saved = torch.zeros(128, 512, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="a_buffers"):
        glu_backward_ws_(
            p.dy,
            p.w_down,
            saved,
            save=Saved.PREACT,
            gate_multiplier=1.0,
            down_multiplier=1.0,
            config=WSConfig(),
        )
    with pytest.raises(ValueError, match="saved factors only"):
        glu_backward_ws_(
            p.dy,
            p.w_down,
            saved,
            save=Saved.PREACT,
            gate_multiplier=1.0,
            down_multiplier=1.0,
            config=PING_PONG,
        )
    with pytest.raises(ValueError, match="saved factors or pre-activations"):
        glu_backward_ws_(p.dy, p.w_down, saved, save=Saved.NOTHING, gate_multiplier=1.0, down_multiplier=1.0)


@pytest.mark.parametrize("impl", BACKWARDS)
@pytest.mark.parametrize("save", [Saved.FACTORS, Saved.PREACT], ids=lambda s: s.name)
def test_backward_kernel_writes_a_gradient_of_its_own(shape, dtype, device, save, impl):
    """Given ``grad``, the backward writes there what it writes in place, and the saved tensor stays
    as it was (the traced backward op keeps what autograd saved)."""
    if impl.endswith("ping-pong") and save == Saved.PREACT:
        pytest.skip("the ping-pong launch reads saved factors only")
    skip_unless_runs(impl, device, dtype)
    p = make_problem(*shape, dtype=dtype, device=device)
    _, saved = glu_forward(p.x, p.w_gate_up, gate_multiplier=0.7, down_multiplier=1.3, save=save)
    kept, in_place = saved.clone(), saved.clone()
    a_in_place = BACKWARDS[impl](
        p.dy, p.w_down, in_place, gate_multiplier=0.7, down_multiplier=1.3, save=save
    )
    grad = torch.full_like(saved, float("nan"))
    a = BACKWARDS[impl](p.dy, p.w_down, saved, gate_multiplier=0.7, down_multiplier=1.3, save=save, grad=grad)
    assert torch.equal(saved, kept)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, in_place, rtol=0, atol=0)  # the same launch otherwise: bitwise
    if save == Saved.PREACT:
        torch.testing.assert_close(a, a_in_place, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make_grad, message",
    [
        (lambda saved: saved[:, :-8].clone(), "must match the saved tensor"),
        (lambda saved: saved.double(), "must match the saved tensor"),
        (lambda saved: saved.t().contiguous().t(), "must match the saved tensor"),
        (lambda saved: saved, "shares memory"),
    ],
    ids=["shape", "dtype", "strides", "aliased"],
)
@pytest.mark.parametrize("impl", ["fused", "split"])
def test_backward_kernel_refuses_a_gradient_buffer_that_does_not_fit(device, impl, make_grad, message):
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    _, saved = glu_forward(p.x, p.w_gate_up, gate_multiplier=1.0, down_multiplier=1.0, save=Saved.FACTORS)
    kept = saved.clone()
    with pytest.raises(ValueError, match=message):
        BACKWARDS[impl](
            p.dy,
            p.w_down,
            saved,
            gate_multiplier=1.0,
            down_multiplier=1.0,
            save=Saved.FACTORS,
            grad=make_grad(saved),
        )
    assert torch.equal(saved, kept)


@pytest.mark.skipif(not hopper_ws.AVAILABLE, reason="the Gluon kernels need Triton 3.6")
@pytest.mark.parametrize(
    "name, save, config",
    [
        ("_launch_forward_ws", Saved.NOTHING, None),
        ("_launch_forward_ws", Saved.FACTORS, None),
        ("_launch_forward_ws", Saved.PREACT, None),
        ("_launch_backward_ws", Saved.FACTORS, CONFIGS[Saved.FACTORS]),
        ("_launch_backward_ws", Saved.PREACT, None),
        ("_launch_backward_pp", Saved.FACTORS, None),  # a small hidden size picks ping-pong
    ],
    ids=lambda v: v.name if isinstance(v, Saved) else v if isinstance(v, str) else None,
)
def test_warp_specialized_launchers_pass_every_kernel_argument(name, save, config, monkeypatch):
    """Each launcher hands its kernel exactly the kernel's parameters (checked on any machine: the
    launch is intercepted, so no GPU is needed), plus the register limit."""
    module = glu_forward_ws_mod if "forward" in name else glu_backward_ws_mod
    launcher, launches = getattr(module, name), []
    kernel = launcher._kernel
    monkeypatch.setattr(launch, "DIRECT", False)  # every call reaches the intercepted Triton launch

    class Intercepted:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(launcher, "_kernel", Intercepted())
    p = make_problem(300, 64, 512, dtype=torch.bfloat16, device=torch.device("cpu"))
    if module is glu_forward_ws_mod:
        glu_forward_ws(p.x, p.w_gate_up, gate_multiplier=0.7, down_multiplier=1.3, save=save)
    else:
        saved = torch.zeros(300, 1024, dtype=torch.bfloat16)
        glu_backward_ws_(
            p.dy, p.w_down, saved, save=save, gate_multiplier=0.7, down_multiplier=1.3, config=config
        )
    [(grid, args, kwargs)] = launches
    assert grid == (3,)  # persistent: three programs on CPU (the interpreter's count)
    # The positional arguments fill the kernel's first parameters, the keywords all the others
    # (num_warps is a parameter of these kernels); maxnreg is a launch option.
    assert set(kwargs) == set(kernel.arg_names[len(args) :]) | {"maxnreg"}


@pytest.mark.gpu
def test_backward_kernel_runs_first_in_a_fresh_thread(device):
    """Autograd runs the backward on a thread of its own, where the fused kernel may be the first CUDA
    work: its host TMA descriptors need a current CUDA context there too."""
    p = make_problem(64, 40, 72, dtype=torch.float32, device=device)
    _, saved = glu_forward(p.x, p.w_gate_up, gate_multiplier=1.0, down_multiplier=1.0, save=Saved.FACTORS)
    expected = saved.clone()
    glu_backward_(p.dy, p.w_down, expected, gate_multiplier=1.0, down_multiplier=1.0, save=Saved.FACTORS)
    errors = []

    def launch():
        try:
            glu_backward_(p.dy, p.w_down, saved, gate_multiplier=1.0, down_multiplier=1.0, save=Saved.FACTORS)
        except Exception as e:  # noqa: BLE001 - reported by the test's own thread below
            errors.append(e)

    thread = threading.Thread(target=launch)
    thread.start()
    thread.join()
    assert not errors, errors
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(saved, expected, rtol=0, atol=0)  # same kernel, same config: bitwise


def test_backward_kernel_needs_something_saved(device):
    p = make_problem(4, 16, 16, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="saved"):
        glu_backward_(
            p.dy, p.w_down, torch.zeros(4, 32), gate_multiplier=1.0, down_multiplier=1.0, save=Saved.NOTHING
        )


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(TileConfig(16, 16, 16, group_m=2, num_stages=1, ctas_per_sm=2), id="two-per-sm"),
        pytest.param(TileConfig(32, 16, 16, num_stages=1, epilogue_split=1), id="split1"),
        pytest.param(TileConfig(16, 32, 16, group_m=1, num_stages=1, flatten=True), id="flatten"),
        pytest.param(TileConfig(16, 32, 16, num_stages=1, epilogue_split=4), id="split4"),
    ],
)
@pytest.mark.parametrize("save", [Saved.FACTORS, Saved.PREACT], ids=lambda s: s.name)
def test_backward_kernel_variants_agree(device, save, config):
    """Other tilings, epilogue splits and tile orders give the default config's result."""
    if device.type == "cuda":
        pytest.skip("interpreter-sized tiles")
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    _, saved = glu_forward(p.x, p.w_gate_up, gate_multiplier=0.7, down_multiplier=1.3, save=save)
    expected = saved.clone()
    a_expected = glu_backward_(p.dy, p.w_down, expected, gate_multiplier=0.7, down_multiplier=1.3, save=save)
    a = glu_backward_(
        p.dy, p.w_down, saved, gate_multiplier=0.7, down_multiplier=1.3, save=save, config=config
    )
    assert relative_error(saved, expected) < 1e-6
    if save == Saved.PREACT:
        assert relative_error(a, a_expected) < 1e-6


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(TileConfig(32, 16, 16, num_stages=1, epilogue_split=1), id="split1"),
        pytest.param(TileConfig(16, 32, 16, group_m=1, num_stages=1, epilogue_split=4), id="split4"),
        pytest.param(TileConfig(16, 16, 32, num_stages=1, flatten=True), id="flatten-bk32"),
    ],
)
@pytest.mark.parametrize("save", [Saved.NOTHING, Saved.FACTORS, Saved.PREACT], ids=lambda s: s.name)
def test_forward_kernel_variants_agree(device, save, config):
    """Other tilings and epilogue splits give the default config's outputs."""
    if device.type == "cuda":
        pytest.skip("interpreter-sized tiles")
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    a_expected, saved_expected = glu_forward(
        p.x, p.w_gate_up, gate_multiplier=0.7, down_multiplier=1.3, save=save
    )
    a, saved = glu_forward(
        p.x, p.w_gate_up, gate_multiplier=0.7, down_multiplier=1.3, save=save, config=config
    )
    assert relative_error(a, a_expected) < 1e-6
    if save != Saved.NOTHING:
        assert relative_error(saved, saved_expected) < 1e-6


@pytest.mark.parametrize("impl", ["fused", "split"])
@pytest.mark.parametrize("save", [Saved.FACTORS, Saved.PREACT], ids=lambda s: s.name)
def test_forward_kernel_can_skip_a(device, save, impl):
    """A backward that needs only the saved tensor gets it without ``a`` being written."""
    forward = FORWARDS[impl]
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    _, expected = forward(p.x, p.w_gate_up, gate_multiplier=0.7, down_multiplier=1.3, save=save)
    a, saved = forward(p.x, p.w_gate_up, gate_multiplier=0.7, down_multiplier=1.3, save=save, write_a=False)
    assert a is None
    assert torch.equal(saved, expected)
    with pytest.raises(ValueError, match="must write"):
        forward(p.x, p.w_gate_up, gate_multiplier=0.7, down_multiplier=1.3, save=Saved.NOTHING, write_a=False)


@pytest.mark.parametrize("multipliers", MULTIPLIERS)
def test_activation_kernel(shape, dtype, device, multipliers):
    """The decode path's activation pass over a packed pre-activation computed by torch.mm."""
    gm, dm = multipliers
    p = make_problem(*shape, dtype=dtype, device=device)
    a = glu_activation(p.x @ p.w_gate_up.t(), gate_multiplier=gm, down_multiplier=dm)
    silu64, _, u64, _ = swiglu_terms(p.x.double(), p.w_gate.double(), p.w_up.double(), gm)
    silu, _, u, _ = swiglu_terms(p.x, p.w_gate, p.w_up, gm)
    assert_like_eager(a, dm * silu * u, dm * silu64 * u64, dtype, "a")


def test_activation_kernel_rejects_unpacked_input(device):
    with pytest.raises(ValueError, match="packed"):
        glu_activation(torch.zeros(4, 24, device=device), gate_multiplier=1.0, down_multiplier=1.0)


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 40),
    chunks=st.integers(1, 7),
    gate_multiplier=MULTIPLIER_VALUES,
    down_multiplier=MULTIPLIER_VALUES,
)
def test_activation_kernel_on_random_packed_shapes(device, rows, chunks, gate_multiplier, down_multiplier):
    """Any row count and any intermediate size that is whole chunks (tile edges anywhere)."""
    inter = chunks * CHUNK
    h = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows * 31 + chunks)).to(device)
    up, gate = split_packed_columns(h.double())
    g = gate_multiplier * gate
    expected = down_multiplier * F.silu(g) * up
    a = glu_activation(h, gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)
    assert relative_error(a, expected) < 1e-6


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 20))
def test_host_cdiv_is_tritons(a, b):
    assert cdiv(a, b) == triton.cdiv(a, b)


@given(st.integers(1, 1 << 40))
def test_host_next_power_of_2_is_tritons(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)
