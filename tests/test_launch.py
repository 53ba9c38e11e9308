"""The cached kernel launch: a call goes straight to the compiled kernel only when Triton would have
chosen that compiled kernel for it, with the arguments in the kernel's order.

Most tests drive ``KernelLauncher`` with a stand-in kernel, so they run anywhere; the last one runs the
library's kernels on the GPU with every launch checked against Triton's own choice.
"""

import gc
from types import SimpleNamespace

import pytest
import torch
import triton
from triton.backends.nvidia import driver as nvidia_driver

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


class PythonLauncher(nvidia_driver.CudaLauncher):
    """Triton's Python launcher, counting its calls."""

    calls = 0

    def __call__(self, *args):
        self.calls += 1
        return super().__call__(*args)


class TritonCompiled:
    """A compiled kernel laid out as triton 3.6 lays one out: Triton's own Python launcher
    (``CudaLauncher`` and the closure that expands descriptors) around a C launcher that records
    its arguments."""

    function = "function-handle"
    packed_metadata = "packed-metadata"

    def __init__(self, signature: dict, tensordesc_meta, scratch: int = 0):
        self.src = SimpleNamespace(signature=signature)
        self.metadata = SimpleNamespace(tensordesc_meta=tensordesc_meta)
        self.c_calls = Recorder()
        run = object.__new__(PythonLauncher)
        run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, False
        run.global_scratch_size, run.global_scratch_align = scratch, 128
        run.profile_scratch_size, run.profile_scratch_align = 0, 1
        run.launch = nvidia_driver.wrap_handle_tensordesc(
            self.c_calls.append_args, signature, tensordesc_meta
        )
        self.run = run


class Recorder(list):
    def append_args(self, *args):
        self.append(args)


class TritonStandIn(StandIn):
    """Compiles a ``TritonCompiled`` of the stand-in's signature per specialization."""

    arg_names = ["desc", "ptr", "n", "scale", "BLOCK"]
    signature = {
        "desc": "tensordesc<fp32[16, 8]>",
        "ptr": "*fp32",
        "n": "i32",
        "scale": "fp32",
        "BLOCK": "constexpr",
    }

    def __init__(self, tensordesc_meta, scratch=0):
        super().__init__(lambda args, kwargs: triton_like(args, kwargs))
        self.make = lambda: TritonCompiled(self.signature, tensordesc_meta, scratch)

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.compiled.setdefault(self.specialize(args, kwargs), self.make())

        return call


META = [{"swizzle": 3, "elem_size": 4, "elem_type": 7, "block_size": [16, 8], "fp4_padded": False}]


@pytest.fixture
def encodes(monkeypatch):
    """Triton's descriptor encoding replaced by a stand-in (the real one needs the CUDA driver),
    for Triton's launcher and the direct launch alike; the list of encodings made."""
    made = []

    def encode(arg, meta):
        if meta is None:
            return [arg.base, *arg.shape, *arg.strides, False, *arg.shape, *arg.strides]
        made.append((arg.base.data_ptr(), tuple(arg.shape)))
        return [("tensor-map", arg.base.data_ptr(), tuple(arg.shape)), *arg.shape, *arg.strides]

    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", encode)
    return made


def triton_launch(compiled, grid, t, ptr, n, scale, tail):
    """The arguments Triton's own launcher hands the C launcher for this call."""
    before = len(compiled.c_calls)
    compiled.run(*grid, 7, compiled.function, compiled.packed_metadata, None, None, None,
                 launch._host_tma(t), ptr, n, scale, *tail)  # fmt: skip
    return compiled.c_calls.pop(before)


@pytest.mark.parametrize("meta", [META, None], ids=["tma", "no-tma-lowering"])
def test_the_c_launcher_gets_what_tritons_launcher_gives_it(direct, encodes, meta):
    kernel = TritonStandIn(meta)
    launcher = KernelLauncher(kernel, Descriptor)
    ptr = torch.zeros(8)
    run(launcher, torch.zeros(40, 24), ptr, 33)
    [compiled] = kernel.compiled.values()
    for t in (torch.ones(56, 24), torch.ones(56, 24)[:40]):
        python_launches = compiled.run.calls
        run(launcher, t, ptr, 17)
        assert compiled.run.calls == python_launches  # straight to the C launcher
        direct_args = compiled.c_calls[-1]
        assert direct_args == triton_launch(compiled, (3, 1, 1), t, ptr, 17, 0.5, (32,))
    assert len(kernel.calls) == 1


def test_a_descriptor_is_encoded_once_per_address_shape_and_strides(direct, encodes):
    kernel = TritonStandIn(META)
    launcher = KernelLauncher(kernel, Descriptor)
    a, b = torch.zeros(40, 24), torch.zeros(40, 24)
    run(launcher, a, None, 33)  # through Triton: nothing encoded here
    for t in (a, a, b, a, a[:20], b):
        run(launcher, t, None, 33)
    assert encodes == [(a.data_ptr(), (40, 24)), (b.data_ptr(), (40, 24)), (a.data_ptr(), (20, 24))]
    [compiled] = kernel.compiled.values()
    assert [c[13][1] for c in compiled.c_calls] == [a.data_ptr(), a.data_ptr(), b.data_ptr(), a.data_ptr(),
                                                    a.data_ptr(), b.data_ptr()]  # fmt: skip


def test_a_kernel_with_scratch_memory_goes_through_tritons_launcher(direct, encodes, monkeypatch):
    allocated = []
    monkeypatch.setattr(
        triton.runtime._allocation, "_allocator", SimpleNamespace(get=lambda: lambda *a: allocated.append(a))
    )
    kernel = TritonStandIn(META, scratch=64)
    launcher = KernelLauncher(kernel, Descriptor)
    for _ in range(2):
        run(launcher, torch.zeros(40, 24), None, 33)
    assert allocated == [(3 * 64, 128, 7)]


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
    # type(), not isinstance(): isinstance on another library's dead weakref.proxy raises ReferenceError
    ours = [o for o in gc.get_objects() if type(o) is KernelLauncher]
    ours = [o for o in ours if getattr(o._kernel, "__module__", "").startswith("fused_swiglu.")]
    entries = [e for o in ours for e in o._compiled.values()]
    assert entries and all(e.launch is not None for e in entries), "every kernel launched by its C launcher"
    for a, b in zip(verified, direct, strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
