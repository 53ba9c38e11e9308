"""The cached kernel launch: a call goes straight to the compiled kernel only when Triton would have
chosen that compiled kernel for it, with the arguments in the kernel's order.

Most tests drive ``KernelLauncher`` with a stand-in kernel, so they run anywhere; the last one runs the
library's kernels on the GPU with every launch checked against Triton's own choice.
"""

import pytest
import torch
import triton

from fused_swiglu import swiglu_mlp
from fused_swiglu.kernels import launch
from fused_swiglu.kernels.launch import KernelLauncher, Tma
from fused_swiglu.testing import make_problem


class Compiled:
    function = "function-handle"
    packed_metadata = "packed-metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class StandIn:
    """Compiles one ``Compiled`` per specialization, which ``specialize`` computes from the call."""

    __name__ = "stand_in_kernel"
    arg_names = ["desc", "ptr", "n", "scale", "BLOCK", "num_warps"]

    def __init__(self, specialize):
        self.specialize = specialize
        self.compiled = {}
        self.calls = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.compiled.setdefault(self.specialize(args, kwargs), Compiled())

        return call


def triton_like(args, kwargs):
    desc, ptr, n, _scale = args
    return (
        desc.base.dtype,
        tuple(desc.block),
        None if ptr is None else ptr.dtype,
        n == 1,
        n % 16 == 0,
        tuple(kwargs.items()),
    )


class Descriptor:
    def __init__(self, base, block):
        self.base, self.block = base, block


@pytest.fixture
def direct(monkeypatch):
    """The direct launch on, as with triton 3.6 on a GPU; device 0, stream 7."""
    monkeypatch.setattr(launch, "DIRECT", True)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 7)


def run(launcher, t, ptr, n, *, block=(16, 8), grid=(3,), **constexprs):
    launcher(grid, Tma(t, block), ptr, n, 0.5, **({"BLOCK": 32, "num_warps": 4} | constexprs))


def test_second_call_with_the_same_key_launches_the_compiled_kernel_directly(direct):
    kernel = StandIn(triton_like)
    launcher = KernelLauncher(kernel, Descriptor)
    t, ptr = torch.zeros(40, 24), torch.zeros(8)
    run(launcher, t, ptr, 33)
    [(grid, args, kwargs)] = kernel.calls
    assert grid == (3,) and isinstance(args[0], Descriptor) and args[0].block == [16, 8]
    assert kwargs == {"BLOCK": 32, "num_warps": 4}
    [compiled] = kernel.compiled.values()
    assert compiled.runs == []
    other = torch.ones(56, 24)
    run(launcher, other, ptr, 17)  # same key: another tensor, another odd n
    assert len(kernel.calls) == 1
    [launched] = compiled.runs
    assert launched[:10] == (3, 1, 1, 7, "function-handle", "packed-metadata", None, None, None, launched[9])
    host_tma = launched[9]
    assert host_tma.base is other and host_tma.shape == [56, 24] and host_tma.strides == [24, 1]
    assert host_tma.padding == "zero"
    # The runtime arguments, then the constexprs in the kernel's parameter order.
    assert launched[10:] == (ptr, 17, 0.5, 32, 4)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(dict(n=1), id="n-is-1"),
        pytest.param(dict(n=32), id="n-divisible-by-16"),
        pytest.param(dict(t=torch.zeros(40, 24, dtype=torch.float16)), id="descriptor-dtype"),
        pytest.param(dict(t=torch.zeros(40, 24, device="meta")), id="descriptor-device"),
        pytest.param(dict(t=torch.zeros(40 * 24 + 1)[1:].view(40, 24)), id="descriptor-base-misaligned"),
        pytest.param(dict(t=torch.zeros(40, 30)[:, :24]), id="descriptor-row-stride-misaligned"),
        pytest.param(dict(block=(32, 8)), id="descriptor-block"),
        pytest.param(dict(ptr=None), id="pointer-none"),
        pytest.param(dict(ptr=torch.zeros(9)[1:]), id="pointer-misaligned"),
        pytest.param(dict(ptr=torch.zeros(8, dtype=torch.float16)), id="pointer-dtype"),
        pytest.param(dict(BLOCK=64), id="constexpr"),
        pytest.param(dict(num_warps=8), id="launch-option"),
    ],
)
def test_a_call_triton_may_specialize_differently_goes_through_triton(direct, change):
    kernel = StandIn(triton_like)
    launcher = KernelLauncher(kernel, Descriptor)
    first = dict(t=torch.zeros(40, 24), ptr=torch.zeros(8), n=33)
    run(launcher, **first)
    run(launcher, **(first | change))
    assert len(kernel.calls) == 2


def test_triton_debug_switch_is_part_of_the_key(direct, monkeypatch):
    kernel = StandIn(triton_like)
    launcher = KernelLauncher(kernel, Descriptor)
    run(launcher, torch.zeros(40, 24), None, 33)
    monkeypatch.setattr(triton.knobs.runtime, "debug", not triton.knobs.runtime.debug)
    run(launcher, torch.zeros(40, 24), None, 33)
    assert len(kernel.calls) == 2


def test_verify_catches_a_key_coarser_than_triton(direct, monkeypatch):
    """A kernel that specializes on something the key does not see (here n % 32) must be caught."""
    kernel = StandIn(lambda args, kwargs: triton_like(args, kwargs) + (args[2] % 32,))
    launcher = KernelLauncher(kernel, Descriptor)
    run(launcher, torch.zeros(40, 24), None, 33)
    monkeypatch.setattr(launch, "VERIFY", True)
    run(launcher, torch.zeros(40, 24), None, 65)  # same residue mod 32: Triton agrees
    with pytest.raises(RuntimeError, match="the key misses something Triton specializes on"):
        run(launcher, torch.zeros(40, 24), None, 49)


def test_without_the_direct_launch_every_call_goes_through_triton(monkeypatch):
    monkeypatch.setattr(launch, "DIRECT", False)
    kernel = StandIn(triton_like)
    launcher = KernelLauncher(kernel, Descriptor)
    for _ in range(3):
        run(launcher, torch.zeros(40, 24), None, 33)
    assert len(kernel.calls) == 3
    assert all(not c.runs for c in kernel.compiled.values())


def test_an_installed_launch_hook_sees_every_launch(direct):
    kernel = StandIn(triton_like)
    launcher = KernelLauncher(kernel, Descriptor)
    run(launcher, torch.zeros(40, 24), None, 33)

    def hook(metadata):
        pass

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        run(launcher, torch.zeros(40, 24), None, 33)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.calls) == 2


def test_a_kernel_parameter_left_out_is_named(direct):
    launcher = KernelLauncher(StandIn(triton_like), Descriptor)
    with pytest.raises(TypeError, match=r"stand_in_kernel launched without \['num_warps'\]"):
        launcher((1,), Tma(torch.zeros(40, 24), (16, 8)), None, 33, 0.5, BLOCK=32)


def test_unknown_argument_types_are_refused(direct):
    launcher = KernelLauncher(StandIn(triton_like), Descriptor)
    with pytest.raises(TypeError, match="no launch key for a str argument"):
        launcher((1,), Tma(torch.zeros(40, 24), (16, 8)), "pointer?", 33, 0.5, BLOCK=32, num_warps=4)


def test_a_caller_key_skips_the_argument_key_on_later_calls(direct, monkeypatch):
    """With a caller key, later calls with that key and the same constexprs run the compiled kernel
    without building the per-argument key; other constexprs are another entry."""
    kernel = StandIn(triton_like)
    launcher = KernelLauncher(kernel, Descriptor)
    ptr = torch.zeros(8)
    launcher((3,), Tma(torch.zeros(40, 24), (16, 8)), ptr, 33, 0.5, caller_key="k", BLOCK=32, num_warps=4)
    built = []
    real = launch._key_and_launch_arg
    monkeypatch.setattr(launch, "_key_and_launch_arg", lambda a: built.append(a) or real(a))
    other = torch.ones(40, 24)
    launcher((3,), Tma(other, (16, 8)), ptr, 33, 0.5, caller_key="k", BLOCK=32, num_warps=4)
    assert built == [] and len(kernel.calls) == 1
    [compiled] = kernel.compiled.values()
    [launched] = compiled.runs
    assert launched[9].base is other and launched[10:] == (ptr, 33, 0.5, 32, 4)
    launcher((3,), Tma(other, (16, 8)), ptr, 33, 0.5, caller_key="k", BLOCK=64, num_warps=4)
    assert len(kernel.calls) == 2


def test_verify_catches_a_caller_key_coarser_than_triton(direct, monkeypatch):
    """A caller key that misses what the arguments' key sees (here n == 1) is caught under VERIFY."""
    kernel = StandIn(triton_like)
    launcher = KernelLauncher(kernel, Descriptor)
    t = torch.zeros(40, 24)
    launcher((3,), Tma(t, (16, 8)), None, 33, 0.5, caller_key="k", BLOCK=32, num_warps=4)
    monkeypatch.setattr(launch, "VERIFY", True)
    launcher((3,), Tma(t, (16, 8)), None, 17, 0.5, caller_key="k", BLOCK=32, num_warps=4)
    with pytest.raises(RuntimeError, match="the caller key misses something Triton specializes on"):
        launcher((3,), Tma(t, (16, 8)), None, 1, 0.5, caller_key="k", BLOCK=32, num_warps=4)


@pytest.mark.gpu
@pytest.mark.parametrize("save", ["factors", "preact", "recompute"])
def test_library_launches_agree_with_triton_on_the_gpu(device, save, monkeypatch):
    """Every kernel of the library, at ragged shapes (each alignment class of M, hidden and
    intermediate, decode sizes included): with ``VERIFY`` Triton confirms each cached launch's choice;
    then the same calls launched directly give bitwise the same results."""
    assert launch.DIRECT, "triton 3.6 on a GPU takes the direct launch"
    shapes = [(1, 64, 128), (37, 136, 264), (257, 264, 328), (1000, 1032, 2760), (4100, 2048, 5632)]
    problems = [make_problem(*s, dtype=torch.bfloat16, device=device, seed=i) for i, s in enumerate(shapes)]

    def results():
        out = []
        for p in problems:
            x, wgu, wd = (t.detach().requires_grad_() for t in (p.x, p.w_gate_up, p.w_down))
            y = swiglu_mlp(x, wgu, wd, gate_multiplier=0.7, save=save)
            y.backward(p.dy)
            with torch.no_grad():
                out += [y, x.grad, wgu.grad, wd.grad, swiglu_mlp(x, wgu, wd, save=save)]
        return out

    monkeypatch.setattr(launch, "VERIFY", True)
    results()  # fills the launch caches
    verified = results()  # every launch both cached and confirmed by Triton
    monkeypatch.setattr(launch, "VERIFY", False)
    direct = results()
    for a, b in zip(verified, direct, strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
