"""The fused MLP under the autograd tools training stacks wrap around it: activation checkpointing
(both flavours) and saved-tensor hooks such as CPU offload."""

import pytest
import torch
from launch_spies import FORWARD_LAUNCHERS, record_launches
from torch.utils.checkpoint import checkpoint

from fused_swiglu import (
    SwiGLULinear,
    SwiGLUMLP,
    reference_swiglu,
    swiglu_linear,
    swiglu_mlp,
    unpack_gate_up,
)
from fused_swiglu.reference import reference_swiglu_mlp
from fused_swiglu.testing import (
    accuracy_rows,
    glu_oracle_step,
    make_problem,
    oracle_step,
    relative_error,
    run_eager_step,
    run_glu_step,
    run_step,
)

SAVES = ["factors", "preact", "recompute"]


def wrapped(save: str, wrapper: str):
    def fn(x, w_gate_up, w_down):
        def mlp(x):
            return swiglu_mlp(x, w_gate_up, w_down, gate_multiplier=0.5, down_multiplier=2.0, save=save)

        if wrapper == "checkpoint":
            return checkpoint(mlp, x, use_reentrant=False)
        if wrapper == "checkpoint-reentrant":
            return checkpoint(mlp, x, use_reentrant=True)
        with torch.autograd.graph.save_on_cpu():
            return mlp(x)

    return fn


@pytest.mark.parametrize("wrapper", ["checkpoint", "checkpoint-reentrant", "save_on_cpu"])
@pytest.mark.parametrize("save", SAVES)
def test_step_under_autograd_wrappers(device, dtype, save, wrapper):
    p = make_problem(37, 40, 72, dtype=dtype, device=device, gate_multiplier=0.5, down_multiplier=2.0)
    rows = accuracy_rows(run_step(wrapped(save, wrapper), p), run_eager_step(p), oracle_step(p), dtype)
    failed = [f"{r.name}: {r.fused:.3e} > {r.bound:.3e} (eager {r.eager:.3e})" for r in rows if not r.ok]
    assert not failed, failed


def test_factors_backward_releases_a_before_returning(device):
    """The memory claim of the factors mode: ``a`` [M, I] is freed once dW_down is computed, not when
    autograd drops the graph."""
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    unpacked = []

    def unpack(t):
        unpacked.append(t)
        return t

    x, w_down = p.x.clone().requires_grad_(), p.w_down.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = swiglu_mlp(x, p.w_gate_up, w_down, save="factors")
    y.backward(p.dy)
    (a,) = [t for t in unpacked if t.shape == (37, 72)]
    assert a.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("save", SAVES)
def test_module_under_torch_compile(device, save, backend):
    """torch.compile traces the fused training step and inference as the library's custom ops, with
    the eager results."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = SwiGLUMLP(40, 72, save=save, device=device)
    x = torch.randn(2, 37, 40, device=device, requires_grad=True)
    y = module(x)
    y.backward(torch.ones_like(y))
    expected = (y.detach(), x.grad, module.gate_up_proj.grad, module.down_proj.weight.grad)
    x.grad = module.gate_up_proj.grad = module.down_proj.weight.grad = None

    compiled = torch.compile(module, backend=backend)
    y = compiled(x)
    y.backward(torch.ones_like(y))
    got = (y.detach(), x.grad, module.gate_up_proj.grad, module.down_proj.weight.grad)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    with torch.no_grad():
        assert torch.equal(compiled(x), expected[0])


@pytest.mark.parametrize("save", SAVES)
def test_compiled_training_after_dynamo_gave_up_on_a_call(device, save):
    """After an error while tracing a call (a caught shape mismatch in inference), a later compiled
    training step still traces the library into its own graph, with the eager step's results and none
    of the library's functions compiled as frames of their own."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from fused_swiglu import functional, ops

    torch._dynamo.reset()
    torch.manual_seed(0)
    module = SwiGLUMLP(40, 72, save=save, device=device)
    x = torch.randn(2, 37, 40, device=device, requires_grad=True)
    bad = torch.compile(
        lambda x: swiglu_mlp(x, module.gate_up_proj, module.down_proj.weight[:, :64]), backend="eager"
    )
    with torch.no_grad(), pytest.raises(ValueError, match="down weight"):  # raised while tracing
        bad(x)

    def step(fn):
        for t in (x, *module.parameters()):
            t.grad = None
        y = fn(x)
        y.backward(torch.ones_like(y))
        return [y.detach(), x.grad, module.gate_up_proj.grad, module.down_proj.weight.grad]

    expected = step(module)
    got = step(torch.compile(module, backend="eager"))
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    for internal in (
        functional.swiglu_mlp,
        ops.SwiGLUMLPFunction.forward,
        ops.SwiGLUMLPFunction.backward,
    ):
        assert not _debug_get_cache_entry_list(internal.__code__), internal.__qualname__
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_inference_compiles_without_a_graph_break(device, backend, grad_off):
    """fullgraph=True (which fails on any graph break) around both modules and a (gate, up) pair call,
    with exactly the eager results: the same kernels run inside the custom ops."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = SwiGLUMLP(40, 72, device=device, gate_multiplier=0.5, down_multiplier=2.0)
    glu = SwiGLULinear(40, 72, device=device)
    gate, up = unpack_gate_up(glu.gate_up_proj.detach())

    def block(x):
        return mlp(x) + swiglu_mlp(glu(x)[..., :40].contiguous(), (gate, up), mlp.down_proj.weight)

    x = torch.randn(2, 37, 40, device=device)
    with grad_off():
        expected = block(x)
        got = torch.compile(block, backend=backend, fullgraph=True)(x)
    assert torch.equal(got, expected)


def test_compiled_inference_under_autocast_and_with_bad_shapes(device):
    """Under torch.compile, inference casts like eager under autocast, and a shape mismatch raises the
    library's ValueError."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = SwiGLUMLP(40, 72, device=device)
    x = torch.randn(37, 40, device=device)
    dtype = (
        torch.bfloat16 if device.type == "cuda" else torch.float16
    )  # bf16 dots are wrong in the interpreter
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
        expected = mlp(x)
        got = torch.compile(mlp, backend="aot_eager", fullgraph=True)(x)
    assert got.dtype == expected.dtype == dtype and torch.equal(got, expected)
    torch._dynamo.reset()
    bad = torch.compile(
        lambda x: swiglu_mlp(x, mlp.gate_up_proj, mlp.down_proj.weight[:, :64]), backend="eager"
    )
    with torch.no_grad(), pytest.raises(ValueError, match="down weight"):
        bad(x)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [5, 300])  # the decode path (cuBLAS + activation) and the fused kernel
def test_inference_captured_in_cuda_graphs_by_torch_compile(device, rows):
    """mode="reduce-overhead" records the compiled forward in a CUDA graph and replays it: the replays
    give the eager result, also after the input changes in place."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = SwiGLUMLP(256, 512, device=device, dtype=torch.bfloat16)
    compiled = torch.compile(mlp, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(rows, 256, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(4):  # warm-up, record, replays
            x.normal_()
            assert torch.equal(compiled(x).clone(), mlp(x))


@pytest.mark.gpu
def test_block_under_inductor(device, monkeypatch):
    """The default torch.compile backend around the fused MLP, with a norm before and a residual after:
    inductor compiles those, the fused kernels still run (behind their graph break), and the step
    matches the uncompiled block. fp32 without TF32, so only summation order differs."""
    launches = record_launches(monkeypatch, dict.fromkeys(FORWARD_LAUNCHERS, lambda kwargs: 1))
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = SwiGLUMLP(256, 512, device=device)
    norm = torch.nn.RMSNorm(256, device=device)
    x = torch.randn(4, 100, 256, device=device, requires_grad=True)
    dy = torch.randn_like(x)

    def block(x):
        return x + mlp(norm(x))

    def step(fn):
        for t in (x, norm.weight, *mlp.parameters()):
            t.grad = None
        y = fn(x)
        y.backward(dy)
        return [y.detach(), x.grad, norm.weight.grad, mlp.gate_up_proj.grad, mlp.down_proj.weight.grad]

    expected = step(block)
    launches.clear()
    got = step(torch.compile(block))
    assert launches, "the compiled block did not run the library's forward"
    for name, g, e in zip(("y", "dx", "dnorm", "dW_gate_up", "dW_down"), got, expected, strict=True):
        assert relative_error(g, e) < 1e-5, name


@pytest.mark.parametrize("save", SAVES)
def test_autocast_casts_like_a_matmul(device, save):
    """fp32 weights and input under torch.autocast: the fused path runs in the autocast dtype,
    returns it, and sends fp32 gradients back, as accurate as eager PyTorch under the same autocast."""
    low = torch.float16 if device.type == "cpu" else torch.bfloat16  # the interpreter's bf16 dot is wrong
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)

    def under_autocast(fn):
        def run(x, w_gate_up, w_down):
            with torch.autocast(device.type, dtype=low):
                y = fn(x, w_gate_up, w_down)
            assert y.dtype == low
            return y

        return run

    def eager(x, w_gate_up, w_down):
        w_gate, w_up = unpack_gate_up(w_gate_up)
        return reference_swiglu_mlp(x, w_gate, w_up, w_down)

    fused = run_step(under_autocast(lambda x, w, wd: swiglu_mlp(x, w, wd, save=save)), p)
    reference = run_step(under_autocast(eager), p)
    assert all(t.dtype == torch.float32 for k, t in fused.items() if k != "out")
    rows = accuracy_rows(fused, reference, oracle_step(p), low)
    failed = [f"{r.name}: {r.fused:.3e} > {r.bound:.3e} (eager {r.eager:.3e})" for r in rows if not r.ok]
    assert not failed, failed


def _nodes_feeding_the_weights(out: torch.Tensor, count: int) -> list[str]:
    """The autograd nodes that take the fused Function's weight gradients (its inputs 1..count)."""
    node = out.grad_fn
    while not type(node).__name__.startswith("SwiGLU"):
        node = node.next_functions[0][0]
    return [type(n).__name__ for n, _ in node.next_functions[1 : 1 + count]]


@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
def test_weight_gradients_come_from_the_gemms_in_the_weights_dtype(device, save, glu):
    """Under autocast the fp32 weights reach the fused Function uncast: its GEMMs make their
    gradients in fp32 (no cast node between the op and the leaves, no 16-bit rounding of dW)."""
    if glu and save == "preact":
        pytest.skip("the GLU operator keeps the factors or nothing")
    low = torch.float16 if device.type == "cpu" else torch.bfloat16
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    x, w, wd = (t.detach().requires_grad_() for t in (p.x, p.w_gate_up, p.w_down))
    with torch.autocast(device.type, dtype=low):
        out = swiglu_linear(x, w, save=save) if glu else swiglu_mlp(x, w, wd, save=save)
    count = 1 if glu else 2
    assert _nodes_feeding_the_weights(out, count) == ["AccumulateGrad"] * count
    out.float().square().sum().backward()
    for leaf in (w,) if glu else (w, wd):
        assert leaf.grad.dtype == torch.float32 and torch.isfinite(leaf.grad).all()


def test_glu_operator_under_autocast(device):
    """The GLU operator under autocast: the autocast dtype out, fp32 gradients, eager's accuracy."""
    low = torch.float16 if device.type == "cpu" else torch.bfloat16
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)

    def under_autocast(fn):
        def run(x, w_gate_up):
            with torch.autocast(device.type, dtype=low):
                a = fn(x, w_gate_up)
            assert a.dtype == low
            return a

        return run

    def eager(x, w_gate_up):
        return reference_swiglu(x, *unpack_gate_up(w_gate_up))

    fused = run_glu_step(under_autocast(swiglu_linear), p)
    reference = run_glu_step(under_autocast(eager), p)
    assert fused["dx"].dtype == torch.float32 and fused["dw_gate_up"].dtype == torch.float32
    rows = accuracy_rows(fused, reference, glu_oracle_step(p), low)
    failed = [f"{r.name}: {r.fused:.3e} > {r.bound:.3e} (eager {r.eager:.3e})" for r in rows if not r.ok]
    assert not failed, failed
