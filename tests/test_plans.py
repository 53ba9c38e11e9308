"""Launch plans: a later call with the same signature makes the first call's allocations, launches and
torch operations on its own tensors, and nothing else; a call that did what a replay cannot repeat, or
returned what a plan cannot name, is never replayed.

The stand-in kernels of test_launch.py show what reaches the C launcher; the library's ops then run
under the interpreter (on the GPU, the last test of test_launch.py replays them against Triton's choice).
"""

import contextlib

import pytest
import torch
import triton
from test_launch import Descriptor, TritonStandIn, direct, encodes, triton_launch  # noqa: F401 (fixtures)

from fused_swiglu import ops
from fused_swiglu.kernels import launch
from fused_swiglu.kernels.common import empty
from fused_swiglu.kernels.launch import KernelLauncher, Tma
from fused_swiglu.kernels.plans import planned
from fused_swiglu.testing import make_problem

#: The stand-in tests run with test_launch's direct launch and descriptor encoding.
STAND_IN = pytest.mark.usefixtures("direct", "encodes")

META = [{"swizzle": 3, "elem_size": 4, "elem_type": 7, "block_size": [16, 8], "fp4_padded": False}]


class Body:
    """A planned op body: allocates ``out`` [rows], launches the stand-in on (x, out, n, scale),
    returns ``out`` (or what ``result`` makes of it), and counts its runs."""

    def __init__(self, extra=None, result=lambda out: out, meta=META):
        self.kernel = TritonStandIn(meta)
        self.launcher = KernelLauncher(self.kernel, Descriptor)
        self.extra, self.result, self.runs = extra, result, 0
        self.call = planned(self.body)

    def body(self, x, n, scale):
        self.runs += 1
        out = empty((x.shape[0],), x)
        if self.extra is not None:
            self.extra(x)
        self.launcher((3,), Tma(x, (16, 8)), out, n, scale, BLOCK=32)
        return self.result(out)

    @property
    def compiled(self):
        [compiled] = self.kernel.compiled.values()
        return compiled


@STAND_IN
@pytest.mark.parametrize("meta", [META, None], ids=["tma", "no-tma-lowering"])
def test_a_later_call_replays_the_allocations_and_launches_on_its_own_tensors(meta):
    body = Body(meta=meta)
    first = body.call(torch.zeros(40, 24), 33, 0.5)
    x = torch.ones(40, 24)
    out = body.call(x, 33, 0.5)
    assert body.runs == 1 and len(body.kernel.calls) == 1  # the body ran once, Triton launched once
    assert out is not first and out.shape == (40,) and out.dtype == x.dtype
    assert body.compiled.c_calls[-1] == triton_launch(body.compiled, (3, 1, 1), x, out, 33, 0.5, (32,))
    y = torch.full((40, 24), 2.0)
    again = body.call(y, 33, 0.5)  # the argument list made once, filled anew on each call
    assert body.compiled.c_calls[-1] == triton_launch(body.compiled, (3, 1, 1), y, again, 33, 0.5, (32,))


#: A tensor made outside every body: a plan cannot name it.
OUTSIDE = torch.ones(24)


@STAND_IN
@pytest.mark.parametrize(
    "extra",
    [
        lambda x: x.sum().item(),  # a value, which the body could branch on
        lambda x: x.add(OUTSIDE),  # a tensor that is neither an argument nor made by the body
        lambda x: torch.cat([x, x]),  # tensors inside a list
    ],
    ids=["value", "outside-tensor", "tensor-list"],
)
def test_a_call_that_does_what_a_replay_cannot_repeat_is_never_replayed(extra):
    body = Body(extra=extra)
    for _ in range(3):
        body.call(torch.zeros(40, 24), 33, 0.5)
    assert body.runs == 3


@STAND_IN
def test_a_result_the_plan_cannot_name_leaves_the_signature_unplanned():
    body = Body(result=lambda out: (out, OUTSIDE))
    for _ in range(2):
        assert body.call(torch.zeros(40, 24), 33, 0.5)[1] is OUTSIDE
    assert body.runs == 2


def _operating_body():
    """A planned body of torch operations only (a view, a GEMM, in-place ones, a reduction), which
    returns a view, a new tensor and an argument, and counts its runs."""
    runs = []

    def body(x, w, scale):
        runs.append(1)
        h = torch.mm(x, w.t())
        h.mul_(scale)
        x.add_(1.0)
        return h[:, :3], h.sum(0), x

    return planned(body), runs


def test_a_later_call_repeats_the_bodys_operations_on_its_own_tensors():
    import weakref

    call, runs = _operating_body()
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(5, 8, generator=gen), torch.randn(6, 8, generator=gen)
    refs = [weakref.ref(t) for t in (*first, *call(*first, 0.5))]
    del first
    assert all(r() is None for r in refs)  # the plan keeps none of the first call's tensors
    x, w = torch.randn(5, 8, generator=gen), torch.randn(6, 8, generator=gen)
    x_before = x.clone()
    view, total, same = call(x, w, 0.5)
    assert len(runs) == 1 and next(iter(call.plans.values())).steps  # replayed
    expected = torch.mm(x_before, w.t()).mul_(0.5)
    assert torch.equal(view, expected[:, :3]) and view._base is not None
    assert torch.equal(total, expected.sum(0))
    assert same is x and torch.equal(x, x_before + 1.0)


def test_a_replay_lets_go_of_each_tensor_after_its_last_use():
    """As the body frees ``t`` before making ``w``, a replay holds it no longer than that."""

    def body(x):
        t = x.mul(2.0)
        u = t.add(1.0)
        del t
        return u.mul(3.0)

    call = planned(body)
    call(torch.ones(7, 13))
    [(key, plan)] = call.plans.items()
    assert plan.drops == ((), (1,), (2,))  # t (place 1) after the add, u (place 2) after the last mul
    alive = []
    last = plan.steps[2]
    steps = (*plan.steps[:2], lambda pool: (alive.append(pool[1]), last(pool)))
    call.plans[key] = plan._replace(steps=steps)
    assert torch.equal(call(torch.ones(7, 13)), torch.full((7, 13), 9.0)) and alive == [None]


@pytest.mark.parametrize("hidden", [True, False], ids=["hidden-from-autograd", "seen"])
def test_a_replayed_tensor_leaves_at_the_version_the_body_left_it(hidden):
    """A body may hide its in-place work on a tensor it made from autograd (the split forward's
    low-rank term), which the dispatch mode cannot see; a replay leaves the same version."""

    def body(x):
        h = x.mul(2.0)
        hide = hidden and not torch.is_inference_mode_enabled()  # inference tensors have no version
        with torch.autograd._unsafe_preserve_version_counter(h) if hide else contextlib.nullcontext():
            h.add_(1.0)
        return h

    call = planned(body)
    versions = [call(torch.ones(3))._version for _ in range(3)]
    assert versions == [0 if hidden else 1] * 3
    with torch.inference_mode():  # a signature of its own, whose tensors have no version
        assert all(call(torch.ones(3)).is_inference() for _ in range(2))
    assert call(torch.ones(3))._version == (0 if hidden else 1)


def test_operations_under_autocast_are_not_replayed_and_autocast_is_part_of_the_signature():
    call, runs = _operating_body()
    x, w = torch.randn(5, 8), torch.randn(6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert [call(x, w, 0.5)[1].dtype for _ in range(2)] == [torch.bfloat16] * 2
    assert len(runs) == 2  # autocast chose the GEMM's dtype: the body runs every time
    assert [call(x, w, 0.5)[1].dtype for _ in range(2)] == [torch.float32] * 2
    assert len(runs) == 3  # outside autocast, a signature of its own, recorded and replayed


@STAND_IN
@pytest.mark.parametrize(
    "other",
    [
        lambda x, n, s: (torch.zeros(48, 24), n, s),  # shape
        lambda x, n, s: (torch.zeros(24, 40).t(), n, s),  # strides
        lambda x, n, s: (torch.zeros(40, 24, dtype=torch.float16), n, s),  # dtype
        lambda x, n, s: (torch.zeros(40 * 24 + 1)[1:].view(40, 24), n, s),  # alignment
        lambda x, n, s: (x, 32, s),  # an integer
        lambda x, n, s: (x, n, 0.25),  # a float
    ],
    ids=["shape", "strides", "dtype", "alignment", "int", "float"],
)
def test_each_signature_gets_its_own_plan(other):
    body = Body()
    args = (torch.zeros(40, 24), 33, 0.5)
    body.call(*args)
    body.call(*other(*args))
    assert body.runs == 2
    body.call(*other(*args))
    assert body.runs == 2


@STAND_IN
def test_the_tf32_switch_is_part_of_the_signature():
    body = Body()
    body.call(torch.zeros(40, 24), 33, 0.5)
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = not allowed
    try:
        body.call(torch.zeros(40, 24), 33, 0.5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert body.runs == 2


@STAND_IN
def test_a_tensor_passed_twice_is_not_recorded_but_replays_by_position():
    def twice(launcher):
        def body(x, y):
            launcher((3,), Tma(x, (16, 8)), y, 33, 0.5, BLOCK=32)
            return y

        return planned(body)

    kernel = TritonStandIn(META)
    alias = twice(KernelLauncher(kernel, Descriptor))
    t = torch.zeros(40, 24)
    alias(t, t)
    assert alias.plans and not hasattr(next(iter(alias.plans.values())), "replay")
    distinct = twice(KernelLauncher(kernel, Descriptor))
    distinct(torch.zeros(40, 24), torch.zeros(40, 24))  # recorded
    assert distinct(t, t) is t  # replayed: both places get the one tensor


@STAND_IN
def test_a_launch_hook_or_verify_sends_a_replay_through_triton(monkeypatch):
    body = Body()
    body.call(torch.zeros(40, 24), 33, 0.5)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    body.call(torch.zeros(40, 24), 33, 0.5)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(launch, "VERIFY", True)
    body.call(torch.zeros(40, 24), 33, 0.5)
    assert body.runs == 1 and len(body.kernel.calls) == 3


@pytest.mark.parametrize("save", ["factors", "preact"])
def test_replayed_ops_give_what_a_first_call_gives(device, save):
    """The training ops (the recompute backward's included), and inference at a decode size, on new
    inputs of a recorded signature (replayed; outputs NaN-poisoned at allocation) against the same
    inputs in a first call (plans cleared), bit for bit."""
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16
    problems = [make_problem(37, 48, 80, dtype=dtype, device=device, seed=s) for s in range(2)]

    def calls(p):
        a, saved = ops.glu_forward(p.x, p.w_gate_up, 0.7, 1.3, save, None, None)
        kept = saved.clone()
        grad, recomputed = ops.mlp_gradient(p.dy, p.w_down, saved, 0.7, 1.3, save)
        da = torch.randn_like(a)
        factors = ops.glu_forward(p.x, p.w_gate_up, 0.7, 1.0, "factors", None, None)[1]
        # Decode-sized inference: a GEMM (with a low-rank term added in place) and the activation pass.
        rows = p.x[:5]
        u, v = (torch.randn(n, 16, dtype=dtype, device=device) for n in (5, 160))
        decode = ops.glu_forward(rows, p.w_gate_up, 0.7, 1.3, ops.INFERENCE, None, None)[0]
        adapted = ops.glu_forward(rows, p.w_gate_up, 0.7, 1.3, ops.INFERENCE, u, v)[0]
        # The recompute backward, two pieces of 40 columns: GEMMs into slices, in-place sums.
        mlp = ops.mlp_backward_recomputed(
            p.dy, p.x, p.w_gate_up, p.w_down, 0.7, 1.3, True, True, True, dtype, dtype
        )
        u, v = (torch.randn(n, 16, dtype=dtype, device=device) for n in (37, 160))
        glu = ops.glu_backward_recomputed(da, p.x, p.w_gate_up, u, v, 0.7, True, True, True, True, dtype)
        return [a, kept, grad, recomputed, ops.glu_gradient(da, factors), da, decode, adapted, *mlp, *glu]

    planned_ops = (
        ops._glu_forward,
        ops._mlp_gradient_pass,
        ops._glu_gradient_pass,
        ops._mlp_backward_recomputed,
        ops._glu_backward_recomputed,
    )
    for op in planned_ops:
        op.plans.clear()
    calls(problems[0])
    assert all(hasattr(plan, "replay") for op in planned_ops for plan in op.plans.values())
    torch.manual_seed(1)
    replayed = calls(problems[1])
    for op in planned_ops:
        op.plans.clear()
    torch.manual_seed(1)
    first = calls(problems[1])
    for r, f in zip(replayed, first, strict=True):
        assert torch.isfinite(r).all()
        assert torch.equal(r, f)


@STAND_IN
@pytest.mark.parametrize("meta", [META, None], ids=["tma", "no-tma-lowering"])
def test_a_plan_keeps_no_tensor_alive(meta):
    """A plan names tensors by their place in a call: the recorded call's own tensors are freed."""
    import weakref

    body = Body(meta=meta)
    x = torch.zeros(40, 24)
    out = body.call(x, 33, 0.5)
    refs = [weakref.ref(x), weakref.ref(out)]
    body.kernel.calls.clear()  # the stand-in's own record of what it was called with
    del x, out
    assert all(r() is None for r in refs)
    assert body.call(torch.zeros(40, 24), 33, 0.5).shape == (40,) and body.runs == 1
