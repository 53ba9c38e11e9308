"""The fused calls under torch.compile: the forward and backward of the MLP and of the GLU operator as
custom ops inside autograd Functions, no graph break, the same results as the eager fused step, and
never silently wrong on a second backward or a double backward."""

import shutil

import pytest
import torch
from launch_spies import FORWARD_LAUNCHERS, record_launches

from fused_swiglu import SwiGLULinear, SwiGLUMLP, ops, swap_swiglu_mlps, swiglu_linear, swiglu_mlp
from fused_swiglu.kernels import plans
from fused_swiglu.testing import make_problem, relative_error

SAVES = ["factors", "preact", "recompute"]
#: Inductor compiles CPU code with a C++ compiler; on the GPU it generates Triton.
NEEDS_INDUCTOR = pytest.mark.skipif(
    not torch.cuda.is_available() and shutil.which("c++") is None,
    reason="inductor on CPU needs a C++ compiler",
)
INDUCTOR = pytest.param("inductor", marks=NEEDS_INDUCTOR)


def step(fn, p, x):
    """Gradients of one step through ``fn(x, w_gate_up, w_down)``, from fresh leaves."""
    x = x.detach().requires_grad_()
    w_gate_up, w_down = p.w_gate_up.detach().requires_grad_(), p.w_down.detach().requires_grad_()
    y = fn(x, w_gate_up, w_down)
    y.backward(p.dy.reshape(y.shape))
    return [y.detach(), x.grad, w_gate_up.grad, w_down.grad]


@pytest.mark.parametrize("backend", ["eager", "aot_eager", INDUCTOR])
@pytest.mark.parametrize("save", SAVES)
def test_compiled_step_matches_the_eager_fused_step(device, save, backend, monkeypatch):
    torch._dynamo.reset()
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    x = p.x.reshape(1, 37, 40)
    expected = step(lambda x, w, wd: swiglu_mlp(x, w, wd, save=save), p, x)
    launches = record_launches(monkeypatch, dict.fromkeys(FORWARD_LAUNCHERS, lambda kwargs: 1))
    traced = torch.compile(
        lambda x, w, wd: swiglu_mlp(x, w, wd, save=save),
        backend=backend,
        fullgraph=True,  # raises on a graph break
    )
    got = step(traced, p, x)
    assert launches, "the traced step did not run the fused forward"
    for name, g, e in zip(("y", "dx", "dW_gate_up", "dW_down"), got, expected, strict=True):
        assert torch.isfinite(g).all(), name
        assert relative_error(g, e) < 1e-6, name


def walk_twice(y, seed, leaves):
    """Gradients of two backward walks of one graph, the first retaining it."""
    y.backward(seed, retain_graph=True)
    first = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    y.backward(seed)
    return first, [t.grad for t in leaves]


#: The library's refusal of a second walk, or PyTorch's own check of saved tensors, which the
#: backward op marks as changed (or PyTorch's refusal where inductor donated the saved buffers).
SECOND_WALK_REFUSED = "already walked backward once|modified by an inplace operation|retain_graph=False"


def mlp_or_glu(p, glu, save):
    """The traced MLP or GLU call on ``p``, its backward seed and fresh leaves."""
    if glu:
        fn, seed = (lambda x, w: swiglu_linear(x, w, save=save)), p.da
        return fn, seed, [t.detach().requires_grad_() for t in (p.x, p.w_gate_up)]
    fn, seed = (lambda x, w, wd: swiglu_mlp(x, w, wd, save=save)), p.dy
    return fn, seed, [t.detach().requires_grad_() for t in (p.x, p.w_gate_up, p.w_down)]


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
@pytest.mark.parametrize("save", ["factors", "preact"])
@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
def test_compiled_second_backward_is_refused(device, save, backend, glu):
    """The backward overwrote what the forward kept, so a second walk of a retained graph raises."""
    if glu and save == "preact":
        pytest.skip("the GLU operator keeps the factors or nothing")
    torch._dynamo.reset()
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    fn, seed, leaves = mlp_or_glu(p, glu, save)
    y = torch.compile(fn, backend=backend)(*leaves)
    with pytest.raises(RuntimeError, match=SECOND_WALK_REFUSED):
        walk_twice(y, seed, leaves)


@pytest.mark.parametrize("save", ["factors", "preact"])
@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
@NEEDS_INDUCTOR
def test_compiled_second_backward_is_refused_where_pytorch_does_not_refuse(device, save, glu):
    """Inductor can hand the backward op the saved tensor itself (a donated buffer) without PyTorch's
    donated-buffer refusal of a retained graph (seen once with torch 2.13). Forced here: a backward
    compiled with donated buffers, then that refusal switched off, then a retained graph walked twice:
    the second walk is still refused (the backward op marked the kept tensor changed)."""
    if glu and save == "preact":
        pytest.skip("the GLU operator keeps the factors or nothing")
    torch._dynamo.reset()
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    fn, seed, leaves = mlp_or_glu(p, glu, save)
    traced = torch.compile(fn, backend="inductor")
    traced(*leaves).backward(seed)  # compiles the backward, with donated buffers where inductor takes them
    y = traced(*leaves)
    refused = pytest.raises(RuntimeError, match=SECOND_WALK_REFUSED)
    with torch._functorch.config.patch(donated_buffer=False), refused:
        walk_twice(y, seed, leaves)


def copy_saved_tensors(at_unpack: bool):
    """Saved-tensor hooks that hand the backward a copy of each saved tensor: made anew at every
    unpack, as ``save_on_cpu`` does, or made once at pack time and handed out at every unpack."""
    if at_unpack:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t.clone())
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


def hooked_step(device, save, backend, glu, at_unpack):
    torch._dynamo.reset()
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    fn, seed, leaves = mlp_or_glu(p, glu, save)
    run = fn if backend is None else torch.compile(fn, backend=backend)
    eager_leaves = [t.detach().requires_grad_() for t in leaves]
    (swiglu_linear if glu else swiglu_mlp)(*eager_leaves, save=save).backward(seed)
    with copy_saved_tensors(at_unpack):
        y = run(*leaves)
    return y, seed, leaves, eager_leaves


@pytest.mark.parametrize("backend", [None, "aot_eager", INDUCTOR])
@pytest.mark.parametrize("save", ["factors", "preact"])
@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
def test_hooked_copy_made_at_unpack_walks_twice(device, save, backend, glu):
    """Offloading hooks (``save_on_cpu``) hand the backward a fresh copy of what the forward kept on
    every walk: overwriting it loses nothing, so a retained graph walked twice gives the eager step's
    gradients both times, eagerly (``backend`` None) and compiled."""
    if glu and save == "preact":
        pytest.skip("the GLU operator keeps the factors or nothing")
    y, seed, leaves, eager_leaves = hooked_step(device, save, backend, glu, at_unpack=True)
    first, second = walk_twice(y, seed, leaves)
    for f, g, e in zip(first, second, eager_leaves, strict=True):
        assert torch.isfinite(f).all()
        assert relative_error(f, e.grad) < 1e-6
        assert torch.equal(g, f)


@pytest.mark.parametrize("backend", [None, "aot_eager", INDUCTOR])
@pytest.mark.parametrize("save", ["factors", "preact"])
@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
def test_hooked_copy_made_at_pack_is_walked_once(device, save, backend, glu):
    """A hook that hands out the same copy on every walk: the first walk is right, the second is
    refused (the copy was overwritten), not silently wrong."""
    if glu and save == "preact":
        pytest.skip("the GLU operator keeps the factors or nothing")
    y, seed, leaves, eager_leaves = hooked_step(device, save, backend, glu, at_unpack=False)
    y.backward(seed, retain_graph=True)
    for t, e in zip(leaves, eager_leaves, strict=True):
        assert relative_error(t.grad, e.grad) < 1e-6
    with pytest.raises(RuntimeError, match="already walked backward once"):
        y.backward(seed)


@pytest.mark.parametrize("save", ["factors", "preact"])
@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
def test_eager_second_backward_is_refused(device, save, glu):
    if glu and save == "preact":
        pytest.skip("the GLU operator keeps the factors or nothing")
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    fn, seed, leaves = mlp_or_glu(p, glu, save)
    with pytest.raises(RuntimeError, match=SECOND_WALK_REFUSED):
        walk_twice(fn(*leaves), seed, leaves)


def kept_and_gradient_op(p, glu, save):
    """What the forward op kept on ``p``, and the gradient op with its arguments."""
    _, kept = ops.glu_forward(p.x, p.w_gate_up, 0.5, 1.0 if glu else 2.0, save, None, None)
    if glu:
        return kept, ops.glu_gradient, (p.da, kept)
    return kept, ops.mlp_gradient, (p.dy, p.w_down, kept, 0.5, 2.0, save)


@pytest.mark.parametrize("save", ["factors", "preact"])
@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
def test_gradient_op_writes_over_what_the_forward_kept_once(device, save, glu):
    """The gradient op returns the packed gradient in the kept tensor's memory, and refuses a kept
    tensor it has overwritten, whatever hands it over again."""
    if glu and save == "preact":
        pytest.skip("the GLU operator keeps the factors or nothing")
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    kept, op, args = kept_and_gradient_op(p, glu, save)
    out = op(*args)
    grad = out if glu else out[0]
    assert grad.data_ptr() == kept.data_ptr() and grad.shape == kept.shape
    assert torch.isfinite(grad).all()
    with pytest.raises(RuntimeError, match="already walked backward once"):
        op(*args)


@pytest.mark.parametrize("backend", [None, "aot_eager", INDUCTOR])
@pytest.mark.parametrize("save", ["factors", "preact"])
@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
def test_backward_overwrites_what_the_forward_kept(device, save, backend, glu, monkeypatch):
    """No gradient buffer of its own: the backward writes the packed gradient over the kept tensor
    the forward op returned, eagerly and compiled."""
    if glu and save == "preact":
        pytest.skip("the GLU operator keeps the factors or nothing")
    torch._dynamo.reset()
    name = "glu_grad_" if glu else "mlp_gradient_"
    kept_at_forward, kept_at_backward = [], []
    forward, backward = ops.glu_pass, getattr(ops, name)

    def forward_spy(*args):
        out = forward(*args)
        kept_at_forward.append(out[1].data_ptr())
        return out

    def backward_spy(*args, **kwargs):
        kept_at_backward.append(args[1 if glu else 2].data_ptr())
        return backward(*args, **kwargs)

    monkeypatch.setattr(plans, "REPLAY", False)  # a replay goes past the spies
    monkeypatch.setattr(ops, "glu_pass", forward_spy)
    monkeypatch.setattr(ops, name, backward_spy)
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    fn, seed, leaves = mlp_or_glu(p, glu, save)
    run = fn if backend is None else torch.compile(fn, backend=backend)
    run(*leaves).backward(seed)
    assert kept_at_forward and kept_at_backward == kept_at_forward


@NEEDS_INDUCTOR
def test_compiled_factors_step_frees_a_before_the_gradient_op(device, monkeypatch):
    """dW_down is made before the gradient op, so inductor's backward drops ``a`` before the
    gradient GEMMs allocate dX and dW_gate_up, as the eager backward releases it (the compiled
    step's peak)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    torch._dynamo.reset()
    forward, backward = ops.glu_pass, ops.mlp_gradient_
    a_storages, a_alive_at_backward = [], []
    other = make_problem(5, 16, 24, dtype=torch.float32, device=device)

    def forward_spy(*args):
        a, kept = forward(*args)
        a_storages.append(StorageWeakRef(a.untyped_storage()))
        # The Triton interpreter (CPU) keeps a tensor of its last launch alive until the next launch
        # (triton 3.6): launch once more on other tensors, so that only the graph can hold ``a``.
        forward(other.x, other.w_gate_up, *args[2:4])
        return a, kept

    def backward_spy(*args):
        a_alive_at_backward.append(not a_storages[-1].expired())
        return backward(*args)

    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    fn, seed, leaves = mlp_or_glu(p, False, "factors")
    expected = step(lambda x, w, wd: swiglu_mlp(x, w, wd, save="factors"), p, p.x)
    monkeypatch.setattr(plans, "REPLAY", False)  # a replay goes past the spies
    monkeypatch.setattr(ops, "glu_pass", forward_spy)
    monkeypatch.setattr(ops, "mlp_gradient_", backward_spy)
    torch.compile(fn, backend="inductor")(*leaves).backward(seed)
    assert a_alive_at_backward == [False]
    grads = (t.grad for t in leaves)
    for name, g, e in zip(("dx", "dW_gate_up", "dW_down"), grads, expected[1:], strict=True):
        assert relative_error(g, e) < 1e-6, name


def test_compiled_double_backward_raises(device):
    """Differentiating the traced backward again raises, as for any compiled graph: torch 2.13 refuses
    double backward by name; torch 2.11 returns a gradient with no graph, whose backward raises."""
    torch._dynamo.reset()
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    traced = torch.compile(lambda x, w, wd: swiglu_mlp(x, w, wd), backend="aot_eager")
    x = p.x.detach().requires_grad_()
    y = traced(x, p.w_gate_up, p.w_down)
    (dx,) = torch.autograd.grad(y, x, p.dy, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward|does not require grad"):
        dx.sum().backward()


def test_compiled_fallback_traces_the_reference(device):
    """Where the fused kernels cannot run (float64 here), the traced call is plain PyTorch."""
    torch._dynamo.reset()
    p = make_problem(37, 40, 72, dtype=torch.float64, device=device)
    expected = step(lambda x, w, wd: swiglu_mlp(x, w, wd), p, p.x)
    traced = torch.compile(lambda x, w, wd: swiglu_mlp(x, w, wd), backend="aot_eager", fullgraph=True)
    for g, e in zip(step(traced, p, p.x), expected, strict=True):
        assert relative_error(g, e) < 1e-12


def test_swapped_module_compiles_whole(device):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=40, intermediate_size=72, num_attention_heads=4)
    model = torch.nn.Sequential(transformers.models.llama.modeling_llama.LlamaMLP(config)).to(device)
    swap_swiglu_mlps(model)
    torch._dynamo.reset()
    x = torch.randn(2, 5, 40, device=device, requires_grad=True)
    y = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(model[0].gate_up_proj.grad).all()


# The GLU operator ------------------------------------------------------------------------------------


def glu_step(fn, p, x):
    x = x.detach().requires_grad_()
    w_gate_up = p.w_gate_up.detach().requires_grad_()
    a = fn(x, w_gate_up)
    a.backward(p.da.reshape(a.shape))
    return [a.detach(), x.grad, w_gate_up.grad]


@pytest.mark.parametrize("backend", ["eager", "aot_eager", INDUCTOR])
@pytest.mark.parametrize("save", ["factors", "recompute"])
def test_compiled_glu_step_matches_the_eager_fused_step(device, save, backend):
    torch._dynamo.reset()
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    expected = glu_step(lambda x, w: swiglu_linear(x, w, gate_multiplier=0.7, save=save), p, p.x)
    traced = torch.compile(
        lambda x, w: swiglu_linear(x, w, gate_multiplier=0.7, save=save),
        backend=backend,
        fullgraph=True,
    )
    for name, g, e in zip(("a", "dx", "dW_gate_up"), glu_step(traced, p, p.x), expected, strict=True):
        assert torch.isfinite(g).all(), name
        assert relative_error(g, e) < 1e-6, name


def test_compiled_glu_module(device):
    torch._dynamo.reset()
    glu = SwiGLULinear(40, 72, device=device)
    x = torch.randn(2, 5, 40, device=device, requires_grad=True)
    torch.compile(glu, backend="aot_eager", fullgraph=True)(x).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(glu.gate_up_proj.grad).all()


@pytest.mark.parametrize("save", SAVES)
def test_ops_pass_opcheck(device, save):
    """Schema (no input changed), fake implementations and AOT dispatch of the forward op (inference
    and training) and of the recompute backward ops, by torch's own checker."""
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    x, w, wd = p.x, p.w_gate_up, p.w_down
    u, v = torch.randn(37, 16, device=device), torch.randn(144, 16, device=device)  # a low-rank term
    checks = [
        (ops.glu_forward, (x, w, 0.5, 2.0, ops.INFERENCE, None, None)),
        (ops.glu_forward, (x, w, 0.5, 1.0, ops.INFERENCE, u, v)),
        (ops.glu_forward, (x, w, 0.5, 2.0, save, None, None)),
    ]
    if save != "preact":
        checks.append((ops.glu_forward, (x, w, 0.5, 1.0, save, u, v)))
    if save == "recompute":
        for grad_dtype in (x.dtype, torch.float64):  # the weights' gradients in x's dtype, and in another
            needs = (True, True, True)
            checks.append(
                (ops.mlp_backward_recomputed, (p.dy, x, w, wd, 0.5, 2.0, *needs, grad_dtype, grad_dtype))
            )
            checks.append(
                (
                    ops.mlp_backward_recomputed,
                    (p.dy, x, w, wd, 0.5, 2.0, True, False, False, *(grad_dtype,) * 2),
                )
            )
            checks.append(
                (ops.glu_backward_recomputed, (p.da, x, w, u, v, 0.5, True, True, True, True, grad_dtype))
            )
            checks.append(
                (
                    ops.glu_backward_recomputed,
                    (p.da, x, w, None, None, 0.5, False, True, False, False, grad_dtype),
                )
            )
    for op, args in checks:
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, (op, results)


@pytest.mark.parametrize("save", ["factors", "preact"])
@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
def test_gradient_ops_fake_implementations_match(device, save, glu):
    """The gradient ops return the gradient in the kept tensor's memory without declaring it (ops.py
    says why), which opcheck's schema test would flag, and refuse a second call on one kept tensor,
    which opcheck makes: their fake implementations are checked here against one real call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if glu and save == "preact":
        pytest.skip("the GLU operator keeps the factors or nothing")
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    _, op, args = kept_and_gradient_op(p, glu, save)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args)
    real = op(*args)
    real, fake = ((real,), (fake,)) if glu else (real, fake)
    for r, f in zip(real, fake, strict=True):
        assert (r.shape, r.dtype, r.device, r.stride()) == (f.shape, f.dtype, f.device, f.stride())
        assert r.numel() == 0 or torch.isfinite(r).all()


@NEEDS_INDUCTOR
@pytest.mark.parametrize(
    "compiled, eager", [("fused-compiled", "fused-factors"), ("fused-compiled-preact", "fused-preact")]
)
def test_bench_compiled_fused_impl_trains_like_the_eager_one(device, compiled, eager):
    """``bench``'s ``fused-compiled`` (and ``-preact``): the fused module under torch.compile with
    traced training, in that save mode."""
    from fused_swiglu.bench.impls import EagerSwiGLUMLP, build_impl

    torch._dynamo.reset()
    reference = EagerSwiGLUMLP(40, 72, device=device)
    x = torch.randn(37, 40, device=device, requires_grad=True)
    dy = torch.randn(37, 40, device=device)
    grads = {}
    for name in (eager, compiled):
        impl = build_impl(name, reference, x, dy)
        for t in impl.params:
            t.grad = None
        impl.step()
        grads[name] = [t.grad.clone() for t in impl.params]
    for got, want in zip(grads[compiled], grads[eager], strict=True):
        assert relative_error(got, want) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("save", SAVES)
def test_compiled_training_replayed_from_cuda_graphs(device, save):
    """mode="reduce-overhead" records the traced training step (forward and backward ops) in CUDA
    graphs and replays it: each replay, with new data in place, gives the eager fused step's result."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = SwiGLUMLP(256, 512, save=save, device=device, dtype=torch.bfloat16)
    compiled = torch.compile(mlp, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(300, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(300, 256, device=device, dtype=torch.bfloat16)

    def step(fn):
        for t in (x, *mlp.parameters()):
            t.grad = None
        y = fn(x)
        y.backward(dy)
        return [
            y.detach().clone(),
            x.grad.clone(),
            mlp.gate_up_proj.grad.clone(),
            mlp.down_proj.weight.grad.clone(),
        ]

    for _ in range(4):  # warm-up, record, replays
        with torch.no_grad():
            x.normal_()
            dy.normal_()
        torch.compiler.cudagraph_mark_step_begin()
        got = step(compiled)
        expected = step(mlp)
        for g, e in zip(got, expected, strict=True):
            assert torch.isfinite(g).all()
            assert torch.equal(g, e)


@pytest.mark.parametrize("trainable", ["x", "weights", "down"], ids=lambda v: f"only-{v}")
def test_compiled_step_with_some_inputs_frozen(device, trainable):
    """Only the gradients asked for are made, and they equal the eager fused step's."""
    torch._dynamo.reset()
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    grads_of = {"x": (True, False, False), "weights": (False, True, True), "down": (False, False, True)}[
        trainable
    ]

    def run(fn):
        leaves = [
            t.detach().requires_grad_(g) for t, g in zip((p.x, p.w_gate_up, p.w_down), grads_of, strict=True)
        ]
        fn(*leaves).backward(p.dy)
        return [t.grad for t in leaves]

    expected = run(lambda x, w, wd: swiglu_mlp(x, w, wd))
    traced = torch.compile(lambda x, w, wd: swiglu_mlp(x, w, wd), backend="aot_eager", fullgraph=True)
    for got, want, asked in zip(run(traced), expected, grads_of, strict=True):
        assert (got is None) == (not asked)
        if asked:
            assert relative_error(got, want) < 1e-6


def test_compiled_step_with_dynamic_rows(device):
    """Compiled with ``dynamic=True``, the fake implementations carry a symbolic row count: two
    different batch sizes run through one graph and each matches the eager fused step."""
    torch._dynamo.reset()
    traced = torch.compile(lambda x, w, wd: swiglu_mlp(x, w, wd), backend="aot_eager", dynamic=True)
    for rows in (37, 130):
        p = make_problem(rows, 40, 72, dtype=torch.float32, device=device)
        expected = step(lambda x, w, wd: swiglu_mlp(x, w, wd), p, p.x)
        for g, e in zip(step(traced, p, p.x), expected, strict=True):
            assert relative_error(g, e) < 1e-6


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
@pytest.mark.parametrize("save", SAVES)
def test_compiled_step_under_autocast_matches_the_eager_fused_step(device, save, backend):
    """fp32 leaves under torch.autocast, traced: the autocast dtype out, fp32 gradients, and the eager
    fused step's values (the traced backward makes dW_down itself, in the autocast dtype)."""
    torch._dynamo.reset()
    low = torch.float16 if device.type == "cpu" else torch.bfloat16  # the interpreter's bf16 dot is wrong
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)

    def autocast_step(fn):
        leaves = [t.detach().requires_grad_() for t in (p.x, p.w_gate_up, p.w_down)]
        with torch.autocast(device.type, dtype=low):
            y = fn(*leaves)
        assert y.dtype == low
        y.backward(p.dy.to(low))
        return [y.detach().float(), *(t.grad for t in leaves)]

    expected = autocast_step(lambda x, w, wd: swiglu_mlp(x, w, wd, save=save))
    traced = torch.compile(
        lambda x, w, wd: swiglu_mlp(x, w, wd, save=save),
        backend=backend,
        fullgraph=True,
    )
    got = autocast_step(traced)
    for name, g, e in zip(("y", "dx", "dW_gate_up", "dW_down"), got, expected, strict=True):
        assert g.dtype == torch.float32, name
        assert torch.isfinite(g).all(), name
        assert relative_error(g, e) < 1e-3, name


def test_an_input_changed_in_place_is_reported_as_such(device):
    """PyTorch's own error for an input changed in place before the backward, not the library's
    second-walk message."""
    p = make_problem(37, 40, 72, dtype=torch.float32, device=device)
    x = p.x.clone().requires_grad_()
    w = p.w_gate_up.clone()
    y = swiglu_mlp(x * 1.0, w.requires_grad_(), p.w_down)
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        y.backward(p.dy)
    assert "already walked" not in str(raised.value)
