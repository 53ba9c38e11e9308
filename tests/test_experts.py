"""Routed SwiGLU experts (experts/: routed.py, routing.py, ops.py): outputs and every gradient (x, the
routing weights, both expert weights) against a float64 reference by the accuracy rule, on ragged
routings with empty experts and top-k from 1 to 8; the module against transformers' expert modules,
their checkpoint layout, and a compiled model as one graph."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fused_swiglu import SwiGLUExperts, swiglu_experts
from fused_swiglu.experts.routed import pack_experts, reference_swiglu_experts, unpack_experts
from fused_swiglu.experts.routing import max_tiles, route
from fused_swiglu.kernels.configs import EXPERT_ROWS
from fused_swiglu.layout import CHUNK
from fused_swiglu.testing import accuracy_rows, relative_error

NAMES = ("y", "x", "weights", "gate_up", "down")
MULTIPLIERS = {"gate_multiplier": 1.0, "down_multiplier": 1.0}


def routing(tokens, experts, top_k, *, skew=False, empty=(), generator=None):
    """Top-k routing of random scores; ``skew`` sends most tokens to expert 0, ``empty`` experts get none."""
    scores = torch.rand(tokens, experts, generator=generator)
    if skew:
        scores[:, 0] += 2.0
    for e in empty:
        scores[:, e] = -1.0
    weights, index = torch.topk(scores.softmax(-1), top_k)
    return index, weights


def problem(tokens, hidden, inter, experts, top_k, device, **routing_options):
    g = torch.Generator().manual_seed(1)
    index, weights = routing(tokens, experts, top_k, generator=g, **routing_options)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    dy = torch.randn(tokens, hidden, generator=g)
    return [t.to(device) for t in (x, index, weights, gate_up, down, dy)]


def step(fn, x, index, weights, gate_up, down, dy, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, weights, gate_up, down)]
    y = fn(leaves[0], index, leaves[1], leaves[2], leaves[3])
    y.backward(dy.to(dtype))
    return dict(zip(NAMES, (y.detach(), *(t.grad for t in leaves)), strict=True))


CASES = [
    # tokens, hidden, intermediate, experts, top-k, routing
    (37, 32, 48, 5, 2, {"empty": (4,)}),
    (50, 48, 24, 8, 1, {"skew": True}),
    (19, 32, 16, 16, 8, {}),
    (64, 16, 32, 3, 3, {"empty": (0, 2)}),
    (7, 32, 16, 1, 1, {}),
]


@pytest.mark.parametrize("save", ["factors", "preact", "recompute"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])))
def test_experts_match_float64_reference(device, case, save):
    *sizes, options = case
    args = problem(*sizes, device, **options)

    def fused(*a):
        return swiglu_experts(*a, save=save)

    got = step(fused, *args, torch.float32)
    oracle = step(reference_swiglu_experts, *args, torch.float64)
    for name in NAMES:
        assert relative_error(got[name], oracle[name]) < 1e-5, name


@pytest.mark.parametrize("by_index", [True, False], ids=["rows-by-index", "rows-gathered"])
@pytest.mark.parametrize("save", ["factors", "preact", "recompute"])
def test_experts_half_precision_within_twice_eager_error(device, save, by_index, monkeypatch):
    """Both ways the gate/up kernel takes x's rows (kernels/configs.py chooses by the experts' width)."""
    from fused_swiglu.experts import ops as experts_ops

    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16  # bf16 tl.dot is wrong on CPU
    args = problem(96, 64, 48, 8, 2, device, skew=True)
    monkeypatch.setattr(experts_ops, "expert_rows_by_index", lambda inter: by_index)
    launches = []

    def spy(*a, **kw):
        launches.append("row_index" in kw)
        return glu_forward(*a, **kw)

    glu_forward = experts_ops.glu_forward
    monkeypatch.setattr(experts_ops, "glu_forward", spy)

    def fused(*a):
        return swiglu_experts(*a, save=save)

    got = step(fused, *args, dtype)
    assert launches and set(launches) == {by_index}
    eager = step(reference_swiglu_experts, *args, dtype)
    oracle = step(reference_swiglu_experts, *args, torch.float64)
    rows = accuracy_rows(got, eager, oracle, dtype)
    assert all(row.ok for row in rows), rows


def test_routes_group_slots_by_expert_with_no_padding():
    index = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0]])
    routes = route(index, 4)
    slots = index.numel()
    assert routes.sources.numel() == slots and torch.equal(routes.sources[routes.rows], torch.arange(slots))
    assert routes.ends.tolist() == [3, 4, 8, 8]  # expert 3: none
    starts = [0, 3, 4, 8]
    for slot, row in enumerate(routes.rows.tolist()):
        e = index.reshape(-1)[slot].item()
        assert starts[e] <= row < routes.ends[e]
    assert torch.equal(routes.sources[:3], torch.tensor([1, 4, 7]))  # slot order within an expert
    assert routes.used_tiles.tolist() == [3] and routes.tiles.shape == (max_tiles(slots, 4), 3)
    assert routes.tiles[:3].tolist() == [[0, 0, 3], [1, 3, 4], [2, 4, 8]]


def test_routes_cut_large_groups_into_tiles():
    rows = 2 * EXPERT_ROWS + 5  # expert 1: two whole tiles and a part tile; expert 0: one part tile
    index = torch.tensor([[1]] * rows + [[0]] * 3)
    routes = route(index, 3)
    assert routes.used_tiles.tolist() == [4]
    expected = [[0, 0, 3], *([1, 3 + t * EXPERT_ROWS, 3 + rows] for t in range(3))]
    assert routes.tiles[:4].tolist() == expected
    assert routes.tiles.shape[0] == max_tiles(rows + 3, 3) >= 4


@pytest.mark.parametrize(
    "tokens, k, experts",
    [(37, 2, 4), (5, 8, 256), (64, 1, 3), (100, 4, 300), (1, 1, 1), (15, 1, 5), (8, 2, 2)],
    ids=str,
)
def test_route_table_kernel_matches_pytorch(device, tokens, k, experts):
    """The table from the sorted ids in one kernel equals the PyTorch construction entry for entry
    (the unused entries too), with experts that receive nothing, ids wider than a byte, ids keyed
    past the experts, and slot counts at and beside powers of two (the binary search's step count)."""
    from fused_swiglu.experts.kernels.routes import route_table
    from fused_swiglu.experts.routing import _route_table_reference

    g = torch.Generator().manual_seed(tokens)
    index = torch.randint(0, experts, (tokens, k), generator=g)
    index[index % 3 == 1] = 0  # every third expert id empty, expert 0 large
    ids = torch.sort(index.reshape(-1).to(torch.int16 if experts > 256 else torch.uint8), stable=True)[0]
    if experts < 256 or ids.dtype == torch.int16:  # ids outside the experts, keyed past them
        ids = torch.cat([ids, torch.full((3,), experts, dtype=ids.dtype)])
    num_tiles = max_tiles(ids.numel(), experts)
    want = _route_table_reference(ids, experts, num_tiles)
    got = route_table(ids.to(device), experts, num_tiles, EXPERT_ROWS)
    for name, g_, w in zip(("tiles", "used_tiles", "ends"), got, want, strict=True):
        assert g_.dtype == torch.int32 and torch.equal(g_.cpu(), w), name


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize(
    "experts, key", [(5, torch.uint8), (255, torch.uint8), (256, torch.int16), (40000, torch.int32)], ids=str
)
def test_route_keys_kernel_matches_pytorch(device, experts, key, index_dtype):
    """The sort keys in one kernel equal PyTorch's: ids in range kept, ids outside (negative, at and
    past the expert count) made the expert count, over more slots than a program's block."""
    from fused_swiglu.experts.kernels.routes import route_keys

    g = torch.Generator().manual_seed(experts)
    ids = torch.randint(0, experts, (2500,), generator=g, dtype=torch.int64)
    ids[::7], ids[3::11], ids[5::13] = -1, experts, experts + 300
    want = torch.where((ids >= 0) & (ids < experts), ids, experts).to(key)
    got = route_keys(ids.to(device=device, dtype=index_dtype), experts, key)
    assert got.dtype == key and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_route_rows_kernel_matches_pytorch(device, k):
    """Each slot's row and each row's token from the sort's order, in one kernel, equal to the
    PyTorch scatter and division (rows past a program's block included: 1500 slots)."""
    from fused_swiglu.experts.kernels.routes import route_rows

    order = torch.randperm(1500 // k * k, generator=torch.Generator().manual_seed(k)).to(device)
    rows, tokens = route_rows(order, k)
    want_rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
    assert rows.dtype == tokens.dtype == torch.int32
    assert torch.equal(rows.long(), want_rows) and torch.equal(tokens.long(), order // k)


def test_routes_in_pytorch_equal_the_kernels(device, monkeypatch):
    """Where Triton does not run, route() builds the same routes in PyTorch."""
    from fused_swiglu.experts import routing

    index = torch.randint(0, 7, (300, 2), generator=torch.Generator().manual_seed(3)).to(device)
    index[index == 4] = 0  # expert 4 empty
    kernels = routing.route(index, 7)
    monkeypatch.setattr(routing, "_triton_runs_on", lambda device: False)
    for name, got, want in zip(routing.Routes._fields, routing.route(index, 7), kernels, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_route_of_no_slots(device):
    routes = route(torch.zeros(0, 2, dtype=torch.long, device=device), 4)
    assert routes.tiles.shape == (0, 3) and routes.used_tiles.tolist() == [0]
    assert routes.ends.tolist() == [0, 0, 0, 0] and routes.rows.numel() == routes.tokens.numel() == 0


def test_route_ops_pass_opcheck(device):
    from fused_swiglu.experts.routing import route_keys, route_rows, route_table

    ids = torch.sort(torch.randint(0, 5, (40,), dtype=torch.uint8, device=device), stable=True)[0]
    results = torch.library.opcheck(route_table, (ids, 6, max_tiles(40, 6)))
    assert set(results.values()) == {"SUCCESS"}, results
    order = torch.randperm(40, device=device)
    results = torch.library.opcheck(route_rows, (order, 4))
    assert set(results.values()) == {"SUCCESS"}, results
    ids = torch.randint(-1, 7, (40,), device=device)
    results = torch.library.opcheck(route_keys, (ids, 6, torch.uint8))
    assert set(results.values()) == {"SUCCESS"}, results


def test_no_grad_and_recorded_forward_agree(device):
    x, index, weights, gate_up, down, _ = problem(33, 32, 24, 6, 2, device)
    with torch.no_grad():
        inference = swiglu_experts(x, index, weights, gate_up, down)
    training = swiglu_experts(x, index, weights, gate_up.requires_grad_(), down)
    assert relative_error(inference, reference_swiglu_experts(x, index, weights, gate_up, down)) < 1e-6
    assert torch.equal(inference, training.detach())


@pytest.mark.parametrize("precision", [torch.bfloat16, torch.float64], ids=["bf16-on-cpu", "fp64"])
def test_without_the_kernels_the_same_steps_run_in_pytorch(precision):
    """bf16 on CPU (the interpreter's bf16 dot is wrong) and float64 take the unfused path: the
    reference's values and gradients, and one graph under torch.compile."""
    args = problem(20, 32, 16, 4, 2, torch.device("cpu"))

    def fused(*a):
        return swiglu_experts(*a)

    got = step(fused, *args, precision)
    eager = step(reference_swiglu_experts, *args, precision)
    oracle = step(reference_swiglu_experts, *args, torch.float64)
    if precision == torch.float64:
        assert all(relative_error(got[name], oracle[name]) < 1e-12 for name in NAMES)
    else:
        rows = accuracy_rows(got, eager, oracle, precision)
        assert all(row.ok for row in rows), rows
    x, index, weights, gate_up, down, _ = (t.to(precision) if t.is_floating_point() else t for t in args)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(swiglu_experts)(x, index, weights, gate_up.requires_grad_(), down)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (lambda a: {**a, "x": a["x"][:, :-1]}, ValueError, "do not fit"),
        (lambda a: {**a, "top_k_index": a["top_k_index"][:-1]}, ValueError, "top_k_index"),
        (lambda a: {**a, "top_k_index": a["top_k_index"].float()}, TypeError, "expert ids"),
        (lambda a: {**a, "down_weight": a["down_weight"].double()}, TypeError, "share a floating-point"),
        (
            lambda a: {**a, "gate_up_weight": a["gate_up_weight"][0]},
            ValueError,
            r"\[experts, 2 \* intermediate",
        ),
        (lambda a: {**a, "x": a["x"].tolist()}, TypeError, "torch.Tensor"),
    ],
)
def test_bad_input_is_refused_by_name(device, change, error, words):
    x, index, weights, gate_up, down, _ = problem(9, 32, 16, 4, 2, device)
    args = {
        "x": x,
        "top_k_index": index,
        "top_k_weights": weights,
        "gate_up_weight": gate_up,
        "down_weight": down,
    }
    with pytest.raises(error, match=words):
        swiglu_experts(**change(args))
    with pytest.raises(ValueError, match="save must be one of"):
        swiglu_experts(**args, save="activations")


@pytest.mark.parametrize("bad_id", [4, 300, -1])
def test_expert_ids_outside_the_experts_are_refused(bad_id):
    """On the CPU (on a GPU the same check is a device-side assert, which ends the process's CUDA
    context): an id that a narrow sort key would wrap onto another expert is refused."""
    x, index, weights, gate_up, down, _ = problem(9, 32, 16, 4, 2, torch.device("cpu"))
    index[3, 1] = bad_id
    with pytest.raises(RuntimeError, match=r"expert ids outside \[0, 4\)"):
        swiglu_experts(x, index, weights, gate_up, down)


def test_packing_round_trips():
    stock = torch.randn(3, 2 * 24, 8)
    packed = pack_experts(stock)
    assert torch.equal(unpack_experts(packed), stock)
    gate, up = stock.chunk(2, dim=1)
    assert torch.equal(packed[:, :8], up[:, :8]) and torch.equal(packed[:, 8:16], gate[:, :8])


transformers = pytest.importorskip("transformers")


def tiny_moe(family, device, seed=0):
    torch.manual_seed(seed)
    sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}
    if family == "mixtral":
        config = transformers.MixtralConfig(
            **sizes, intermediate_size=48, num_local_experts=6, vocab_size=128
        )
        return transformers.MixtralForCausalLM(config).to(device)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**sizes, moe_intermediate_size=32, num_experts=8, vocab_size=128)
        config.num_experts_per_tok = 3
        return transformers.Qwen3MoeForCausalLM(config).to(device)
    if family == "olmoe":
        config = transformers.OlmoeConfig(**sizes, intermediate_size=32, num_experts=8, vocab_size=128)
        config.eos_token_id = config.pad_token_id = 0
        return transformers.OlmoeForCausalLM(config).to(device)
    config = transformers.Qwen2MoeConfig(**sizes, moe_intermediate_size=32, num_experts=6, vocab_size=128)
    config.shared_expert_intermediate_size = 48
    return transformers.Qwen2MoeForCausalLM(config).to(device)


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:  # the fused experts' gate_up_proj gradient in the stock layout
            owner, _, weight = name.rpartition(".")
            packed = weight == "gate_up_proj" and isinstance(model.get_submodule(owner), SwiGLUExperts)
            grads[name] = unpack_experts(p.grad) if packed else p.grad
    return out.logits.detach(), grads


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_swapped_moe_model_trains_like_stock(device, family):
    from fused_swiglu import swap_swiglu_mlps

    stock = tiny_moe(family, device)
    fused = tiny_moe(family, device)
    report = swap_swiglu_mlps(fused)
    experts = [name for name in report if name.endswith("experts")]
    assert len(experts) == 2 and not report.skipped
    assert all(isinstance(fused.get_submodule(name), SwiGLUExperts) for name in experts)
    assert fused.state_dict().keys() == stock.state_dict().keys()
    for key, value in fused.state_dict().items():
        assert torch.equal(value, stock.state_dict()[key]), key
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0)).to(device)
    logits, grads = train_step(stock, ids)
    fused_logits, fused_grads = train_step(fused, ids)
    assert relative_error(fused_logits, logits) < 1e-5
    router = [n for n in grads if n.endswith("gate.weight")]
    assert router and all(n in fused_grads for n in router)  # the routing weights' gradient arrives
    for name, grad in grads.items():
        if name in fused_grads:  # a shared expert's dense MLP holds its gate and up packed
            assert relative_error(fused_grads[name], grad) < 1e-4, name


def test_stock_checkpoint_loads_into_the_fused_module(device):
    stock = tiny_moe("mixtral", device).model.layers[0].mlp.experts
    fused = SwiGLUExperts(6, 64, 48, device=device)
    fused.load_state_dict(stock.state_dict())
    assert torch.equal(fused.state_dict()["gate_up_proj"], stock.gate_up_proj)
    x = torch.randn(10, 64, device=device)
    index, weights = routing(10, 6, 2)
    index, weights = index.to(device), weights.to(device)
    with torch.no_grad():
        assert relative_error(fused(x, index, weights), stock(x, index, weights)) < 1e-5


def test_generate_gives_stock_tokens(device):
    from fused_swiglu import swap_swiglu_mlps

    stock, fused = tiny_moe("qwen3_moe", device), tiny_moe("qwen3_moe", device)
    swap_swiglu_mlps(fused)
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(0)).to(device)
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(fused.generate(ids, **options), stock.generate(ids, **options))


def test_compiled_moe_model_is_one_graph_and_matches_eager(device):
    from fused_swiglu import swap_swiglu_mlps

    model = tiny_moe("mixtral", device)
    swap_swiglu_mlps(model)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0)).to(device)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    eager_logits, eager_grads = train_step(model, ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    logits, grads = train_step(compiled, ids)
    assert relative_error(logits, eager_logits) < 1e-6
    for name, grad in grads.items():
        assert relative_error(grad, eager_grads[name.removeprefix("_orig_mod.")]) < 1e-5, name


def test_experts_that_compute_something_else_are_left_alone(device):
    from fused_swiglu import swap_swiglu_mlps

    model = tiny_moe("mixtral", device)
    model.model.layers[0].mlp.experts.act_fn = torch.nn.GELU()
    report = swap_swiglu_mlps(model)
    assert "model.layers.0.mlp.experts" in report.skipped
    assert "not SiLU" in report.skipped["model.layers.0.mlp.experts"]
    assert "model.layers.1.mlp.experts" in report

    model = tiny_moe("mixtral", device)
    experts = model.model.layers[1].mlp.experts
    original = experts.forward  # the layout fits, the forward computes something else

    def doubled(hidden_states, top_k_index, top_k_weights):
        return 2 * original(hidden_states, top_k_index, top_k_weights)

    experts.forward = doubled
    with pytest.raises(ValueError, match="relative difference"):
        swap_swiglu_mlps(model)
    report = swap_swiglu_mlps(model, on_mismatch="skip")
    assert "differs" in report.skipped["model.layers.1.mlp.experts"]


def test_second_backward_is_refused_or_right(device):
    """Factors are overwritten by the first backward (refused after); recompute keeps nothing to
    overwrite, and a second walk gives the first one's gradients again."""
    x, index, weights, gate_up, down, dy = problem(21, 32, 16, 4, 2, device)
    y = swiglu_experts(x, index, weights, gate_up.requires_grad_(), down, save="factors")
    y.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError):
        y.backward(dy)
    y = swiglu_experts(x, index, weights, gate_up, down, save="preact")
    y.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="already walked backward once"):
        y.backward(dy)
    gate_up.grad = None
    y = swiglu_experts(x, index, weights, gate_up, down, save="recompute")
    (first,) = torch.autograd.grad(y, gate_up, dy, retain_graph=True)
    (second,) = torch.autograd.grad(y, gate_up, dy)
    assert torch.equal(first, second)


@pytest.mark.parametrize("retain", [False, True], ids=["freed", "retained"])
def test_a_is_freed_before_the_gate_up_gradients(device, retain):
    """Eagerly, the ``a`` kept with the factors is gone when the packed dW is made, as a compiled
    backward frees it, unless the graph is retained."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    x, index, weights, gate_up, down, dy = problem(21, 32, 16, 4, 2, device)
    y = swiglu_experts(x, index, weights, gate_up.requires_grad_(), down, save="factors")
    kept_a = weakref.ref(y.grad_fn.saved_tensors[-1])
    alive = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.fused_swiglu.experts_backward_gate_up.default:
                alive.append(kept_a() is not None)
            return func(*args, **(kwargs or {}))

    with Watch():
        y.backward(dy, retain_graph=retain)
    assert alive == [retain]


@pytest.mark.parametrize("save", ["factors", "preact", "recompute"])
def test_x_rows_are_freed_before_dx_rows_are_made(device, save, monkeypatch):
    """The backward's two [slots, H] tensors, x's rows (for the packed dW) and dX's rows, are never
    alive together: x's rows are gone when the grouped GEMM making dX's rows runs."""
    import weakref

    from fused_swiglu.experts import ops as experts_ops

    hidden, inter = 48, 16  # x's rows [P, 48], dy's rows [P, 48], [dU | dG] [P, 32]: told apart by width
    x, index, weights, gate_up, down, dy = problem(21, hidden, inter, 4, 2, device)
    x_rows, alive_at_dx = [], []
    real = experts_ops._grouped_mm

    def spy(a, b, ends):
        if b.dim() == 2 and b.shape[1] == hidden:  # grad^T @ x's rows: the packed dW
            x_rows.append(weakref.ref(b))
        if b.dim() == 3 and a.shape[1] == 2 * inter:  # [dU | dG] @ W: dX's rows
            alive_at_dx.append([ref() is not None for ref in x_rows])
        return real(a, b, ends)

    monkeypatch.setattr(experts_ops, "_grouped_mm", spy)
    y = swiglu_experts(x.requires_grad_(), index, weights, gate_up.requires_grad_(), down, save=save)
    y.backward(dy)
    assert len(x_rows) == 1 and alive_at_dx == [[False]]


@pytest.mark.parametrize(("save", "kept"), [("factors", 3), ("preact", 2), ("recompute", 0)])
def test_activations_kept_per_routed_slot(device, save, kept):
    """Between forward and backward, beyond x, the weights and the routing (each row's token and
    routing weight, one number each): ``kept`` x intermediate elements per routed slot (x's rows
    are gathered again in the backward, not kept)."""
    x, index, weights, gate_up, down, _ = problem(40, 32, 24, 6, 2, device)
    y = swiglu_experts(x, index, weights.requires_grad_(), gate_up.requires_grad_(), down, save=save)
    inputs = {t.data_ptr() for t in (x, weights, gate_up, down)}
    saved = [t for t in y.grad_fn.saved_tensors if t.is_floating_point() and t.data_ptr() not in inputs]
    per_row = [t for t in saved if t.dim() == 1 and t.numel()]  # empty: what a mode keeps none of
    assert [t.shape for t in per_row] == [(index.numel(),)]  # the rows' routing weights
    assert sum(t.numel() for t in saved if t.dim() > 1) == index.numel() * kept * 24


def test_a_new_module_is_initialised_like_linear_layers():
    experts = SwiGLUExperts(3, 64, 32)
    for weight in (experts.gate_up_proj, experts.down_proj):
        bound = weight.shape[2] ** -0.5
        assert torch.isfinite(weight).all() and weight.abs().max() <= bound and weight.std() > bound / 3
    assert "num_experts=3" in repr(experts)


def test_autocast_casts_like_a_matmul(device):
    """fp32 leaves under autocast: the autocast dtype out, fp32 gradients, and errors within the
    accuracy rule against the reference run on the same casts."""
    x, index, weights, gate_up, down, dy = problem(24, 32, 16, 4, 2, device)
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16
    gate_up.requires_grad_()
    with torch.autocast(device.type, dtype=dtype):
        y = swiglu_experts(x, index, weights, gate_up, down)
    assert y.dtype == dtype
    y.backward(dy.to(dtype))
    assert gate_up.grad.dtype == torch.float32
    fused = {"y": y.detach(), "gate_up": gate_up.grad}
    eager = step(reference_swiglu_experts, x, index, weights, gate_up, down, dy, dtype)
    oracle = step(reference_swiglu_experts, x, index, weights, gate_up, down, dy, torch.float64)
    rows = accuracy_rows(fused, {k: eager[k] for k in fused}, {k: oracle[k] for k in fused}, dtype)
    assert all(row.ok for row in rows), rows


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.integers(1, 40),
    hidden=st.sampled_from([8, 16, 24]),
    inter=st.sampled_from([8, 16, 24]),
    experts=st.sampled_from([1, 3, 8, 32, 256]),
    top_k=st.integers(1, 8),
    precision=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    save=st.sampled_from(["factors", "preact", "recompute"]),
)
def test_fuzz_against_the_reference(tokens, hidden, inter, experts, top_k, precision, save):
    """Random sizes, expert counts up to 256, top-k up to 8 (at most the expert count), every dtype:
    the output and every gradient against float64 (fp16/bf16 by the accuracy rule, fp32 within 1e-5)."""
    top_k = min(top_k, experts)
    args = problem(tokens, hidden, inter, experts, top_k, torch.device("cpu"))

    def fused(*a):
        return swiglu_experts(*a, save=save)

    got = step(fused, *args, precision)
    oracle = step(reference_swiglu_experts, *args, torch.float64)
    if precision == torch.float32:
        assert all(relative_error(got[name], oracle[name]) < 1e-5 for name in NAMES)
        return
    eager = step(reference_swiglu_experts, *args, precision)
    rows = accuracy_rows(got, eager, oracle, precision)
    scale = routing_weight_gradient_scale(*args)
    bound = torch.finfo(precision).eps * scale.norm()  # two unit roundoffs per product
    within_rounding = (got["weights"].double() - oracle["weights"]).norm() <= bound  # NaN: False
    assert all(row.ok or (row.name == "weights" and within_rounding) for row in rows), (rows, bound)


def routing_weight_gradient_scale(x, index, weights, gate_up, down, dy) -> torch.Tensor:
    """Per routed slot, sum_i |g_i a_i| in float64 (g = dy @ W_down, a the SwiGLU of the slot's
    expert): the scale of the rounding error of that slot's routing-weight gradient, one dot
    product sum_i g_i a_i. Where the products cancel, a 16-bit result's error against float64 is one
    draw of a rounding error this large, for eager PyTorch as for the library; a tensor of one or two
    such gradients is then no fair test of the 2x-eager rule, and the test falls back to the dot
    product's own rounding bound for that gradient only."""
    inter = down.shape[2]
    scale = torch.empty(index.shape, dtype=torch.float64)
    for t, k in torch.cartesian_prod(torch.arange(index.shape[0]), torch.arange(index.shape[1])).tolist():
        e = int(index[t, k])
        packed = gate_up[e].double() @ x[t].double()
        up, gate = packed.view(inter // CHUNK, 2, CHUNK).unbind(1)
        a = (torch.nn.functional.silu(gate) * up).reshape(inter)
        scale[t, k] = ((dy[t].double() @ down[e].double()) * a).abs().sum()
    return scale


def test_forward_kernel_walks_table_tiles_in_smaller_kernel_tiles(device):
    """A kernel tile of fewer rows than a table tile (the GPU's decode-sized tiles): each table tile
    in several kernel tiles, those past a group's end storing nothing; the same a and factors."""
    from fused_swiglu.kernels.common import Saved
    from fused_swiglu.kernels.configs import INTERPRETER_CONFIG, TileConfig
    from fused_swiglu.kernels.glu_forward import glu_forward

    if device.type != "cpu":
        pytest.skip("interpreter-sized tiles")
    x, index, _, gate_up, _, _ = problem(29, 32, 48, 4, 2, device, empty=(1,))
    routes = route(index, 4)
    x_rows = x[routes.sources // 2].contiguous()
    experts = (routes.tiles, routes.used_tiles, 4)
    small = TileConfig(block_m=EXPERT_ROWS // 4, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
    results = [
        glu_forward(x_rows, gate_up, save=Saved.FACTORS, experts=experts, config=config, **MULTIPLIERS)
        for config in (INTERPRETER_CONFIG, small)
    ]
    for got, want in zip(results[1], results[0], strict=True):
        assert relative_error(got, want) < 1e-6  # NaN (a row never written) fails
    packed = torch.bmm(gate_up[index.reshape(-1)[routes.sources]], x_rows[:, :, None])[:, :, 0]
    up, gate = packed.view(-1, 48 // 8, 2, 8).unbind(2)
    assert relative_error(results[1][0], (torch.nn.functional.silu(gate) * up).reshape(-1, 48)) < 1e-5


@pytest.mark.parametrize("hidden", [48, 40], ids=["whole-k-tiles", "part-k-tile"])
@pytest.mark.parametrize("save", ["factors", "preact", "recompute"])
def test_forward_kernel_reads_rows_by_index_as_from_gathered_rows(device, hidden, save):
    """The forward kernel reading x's rows by index (x strided, with more rows than any slot uses)
    makes exactly what it makes from the gathered rows, on a ragged routing with an empty expert;
    every row is written (NaN-poisoned buffers)."""
    from fused_swiglu.kernels.common import Saved
    from fused_swiglu.kernels.glu_forward import glu_forward

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16  # bf16 dots: GPU only
    x, index, _, gate_up, _, _ = problem(29, hidden, 48, 4, 2, device, empty=(1,))
    wide = torch.cat((x, torch.full_like(x[:, :8], float("nan"))), dim=1).to(dtype)  # row stride H + 8
    x, gate_up = wide[:, :hidden], gate_up.to(dtype)
    routes = route(index[:-3], 4)  # the last 3 tokens are routed nowhere
    token_of_row = routes.tokens
    experts = (routes.tiles, routes.used_tiles, 4)
    kind = Saved.of(save)
    by_index = glu_forward(x, gate_up, save=kind, experts=experts, row_index=token_of_row, **MULTIPLIERS)
    gathered = glu_forward(x[token_of_row].contiguous(), gate_up, save=kind, experts=experts, **MULTIPLIERS)
    assert (by_index[1] is None) == (gathered[1] is None) == (kind == Saved.NOTHING)
    for got, want in zip(by_index, gathered, strict=True):
        if want is not None:
            assert got.shape[0] == len(token_of_row) and not got.isnan().any()
            assert torch.equal(got, want)


def test_forward_kernel_refuses_row_index_without_table(device):
    from fused_swiglu.kernels.common import Saved
    from fused_swiglu.kernels.glu_forward import glu_forward

    x, _, _, gate_up, _, _ = problem(8, 32, 16, 1, 1, device)
    rows = torch.zeros(4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="row index needs a tile table"):
        glu_forward(x, gate_up[0], save=Saved.FACTORS, row_index=rows, **MULTIPLIERS)


def _routed_backward_reference(dy_rows, down, preact, weights_of_row, expert_of_row):
    """float64: the gradient of a * w per row, the routing weights' gradient, a * w and [dU | dG]."""
    from fused_swiglu.layout import split_packed_columns

    dy_rows, down, preact, w = (t.double() for t in (dy_rows, down, preact, weights_of_row))
    da_w = torch.bmm(dy_rows[:, None, :], down[expert_of_row])[:, 0]  # [P, I]
    up, gate = split_packed_columns(preact)
    a = torch.nn.functional.silu(gate) * up
    da = da_w * w[:, None]
    sigmoid = torch.sigmoid(gate)
    d_up, d_gate = da * gate * sigmoid, da * up * sigmoid * (1 + gate * (1 - sigmoid))
    grad = torch.stack((d_up.view(len(w), -1, CHUNK), d_gate.view(len(w), -1, CHUNK)), 2).view(len(w), -1)
    return (da_w * a).sum(-1), a * w[:, None], grad


@pytest.mark.parametrize("save", ["factors", "preact"])
@pytest.mark.parametrize("block_m", [None, EXPERT_ROWS // 4], ids=["table-tile", "smaller-tile"])
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True), (False, False)])
def test_routed_backward_kernel_against_float64(device, save, block_m, needs):
    """The routed backward in one kernel (dA = dy's rows times each row's expert's down weight, the
    SwiGLU gradient, the routing weights' gradient and a * w in its epilogue) against float64, on a
    ragged routing with an empty expert; rows past a group's end are never written (each row is
    checked), and every output row is written (NaN-poisoned buffers)."""
    from fused_swiglu.kernels.common import Saved
    from fused_swiglu.kernels.configs import INTERPRETER_CONFIG, TileConfig
    from fused_swiglu.kernels.glu_backward import routed_glu_backward_
    from fused_swiglu.kernels.glu_forward import glu_forward

    if device.type != "cpu":
        pytest.skip("interpreter-sized tiles; the GPU runs it through the experts' tests")
    need_row_grad, write_scaled_a = needs
    x, index, weights, gate_up, down, dy = problem(29, 32, 48, 4, 2, device, empty=(1,))
    routes = route(index, 4)
    token_of_row, expert_of_row = routes.sources // 2, index.reshape(-1)[routes.sources]
    x_rows, dy_rows = x[token_of_row].contiguous(), dy[token_of_row].contiguous()
    w_rows = weights.reshape(-1)[routes.sources].contiguous()
    experts = (routes.tiles, routes.used_tiles, 4)
    kind = Saved.of(save)
    a, saved = glu_forward(x_rows, gate_up, save=kind, experts=experts, **MULTIPLIERS)
    _, preact = glu_forward(x_rows, gate_up, save=Saved.PREACT, experts=experts, **MULTIPLIERS)
    want_dw, want_aw, want_grad = _routed_backward_reference(dy_rows, down, preact, w_rows, expert_of_row)
    config = None if block_m is None else TileConfig(block_m, 16, 16, group_m=2, num_warps=4, num_stages=1)
    assert config is None or INTERPRETER_CONFIG.block_m != block_m
    dw, aw = routed_glu_backward_(
        dy_rows,
        down,
        saved,
        a if kind == Saved.FACTORS else None,
        w_rows,
        routes.tiles,
        routes.used_tiles,
        save=kind,
        need_row_grad=need_row_grad,
        write_scaled_a=write_scaled_a,
        config=config,
    )
    for row in range(len(w_rows)):  # every row its own expert's: a past-end store would show here
        assert relative_error(saved[row], want_grad[row]) < 1e-5, row
    assert (dw is None) == (not need_row_grad) and (aw is None) == (not write_scaled_a)
    if need_row_grad:
        assert dw.dtype == torch.float32 and relative_error(dw, want_dw) < 1e-5
    if write_scaled_a:
        assert relative_error(aw, want_aw) < 1e-5
        assert kind != Saved.FACTORS or aw is a  # over a: a's last use


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize(
    "case",
    [(400, 256, 384, 6, 2, {"skew": True, "empty": (3,)}), (200, 64, 48, 3, 1, {})],
    ids=["several-tiles-an-expert", "narrower-than-a-tile"],
)
def test_warp_specialized_routed_backward_against_float64(device, case, needs):
    """The routed backward's warp-specialized kernel (bf16, the GPU) against float64 row by row, and
    within twice the Triton kernel's error on the same inputs: groups that end inside a tile (their
    masked stores), experts of several tiles and none, a width of part of a tile; in place over
    the factors and ``a``, every row its own expert's."""
    from fused_swiglu.kernels import hopper_ws
    from fused_swiglu.kernels.common import Saved
    from fused_swiglu.kernels.glu_backward import routed_glu_backward_
    from fused_swiglu.kernels.glu_backward_ws import routed_glu_backward_ws_
    from fused_swiglu.kernels.glu_forward import glu_forward

    if device.type != "cuda" or not hopper_ws.AVAILABLE or torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("a Gluon kernel for Hopper GPUs")
    need_row_grad, write_scaled_a = needs
    tokens, hidden, inter, num_experts, k, options = case
    x, index, weights, gate_up, down, dy = problem(tokens, hidden, inter, num_experts, k, device, **options)
    x, weights, gate_up, down, dy = (t.bfloat16() for t in (x, weights, gate_up, down, dy))
    routes = route(index, num_experts)
    token_of_row, expert_of_row = routes.sources // k, index.reshape(-1)[routes.sources]
    x_rows, dy_rows = x[token_of_row].contiguous(), dy[token_of_row].contiguous()
    w_rows = weights.reshape(-1)[routes.sources].contiguous()
    experts = (routes.tiles, routes.used_tiles, num_experts)
    _, preact = glu_forward(x_rows, gate_up, save=Saved.PREACT, experts=experts, **MULTIPLIERS)
    want_dw, want_aw, want_grad = _routed_backward_reference(dy_rows, down, preact, w_rows, expert_of_row)
    results = {}
    for name, kernel in (("ws", routed_glu_backward_ws_), ("triton", routed_glu_backward_)):
        a, saved = glu_forward(x_rows, gate_up, save=Saved.FACTORS, experts=experts, **MULTIPLIERS)
        options = {"save": Saved.FACTORS} if name == "triton" else {}
        args = (dy_rows, down, saved, a, w_rows, routes.tiles, routes.used_tiles)
        dw, aw = kernel(*args, need_row_grad=need_row_grad, write_scaled_a=write_scaled_a, **options)
        results[name] = (saved, dw, aw, a)
    saved, dw, aw, a = results["ws"]
    for row in range(len(w_rows)):  # a store past a group's end would put another expert's row here
        assert relative_error(saved[row], want_grad[row]) < 0.05, row
    assert (dw is None) == (not need_row_grad) and (aw is None) == (not write_scaled_a)
    pairs = [(saved, results["triton"][0], want_grad)]
    if need_row_grad:
        assert dw.dtype == torch.float32
        pairs.append((dw, results["triton"][1], want_dw))
    if write_scaled_a:
        assert aw is a  # over a: a's last use
        pairs.append((aw, results["triton"][2], want_aw))
    for got, triton_got, want in pairs:
        assert relative_error(got, want) <= 2 * relative_error(triton_got, want) + 1e-6


def test_routed_backward_refuses_factors_without_a(device):
    from fused_swiglu.kernels.common import Saved
    from fused_swiglu.kernels.glu_backward import routed_glu_backward_

    x, index, weights, gate_up, down, dy = problem(8, 32, 16, 2, 1, device)
    routes = route(index, 2)
    saved = torch.zeros(8, 32, device=device)
    args = (dy, down, saved, None, weights.reshape(-1), routes.tiles, routes.used_tiles)
    with pytest.raises(ValueError, match="factors and a"):
        routed_glu_backward_(*args, save=Saved.FACTORS, need_row_grad=True, write_scaled_a=True)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize(
    "size", [(1, 8, 1), (37, 24, 2), (19, 300, 8)], ids=lambda s: "T{}-H{}-k{}".format(*s)
)
def test_combine_sums_each_tokens_rows_in_one_pass(device, size, index_dtype, weighted):
    """The combine of y's rows (each times its slot's weight) and dX's rows: each token's k rows
    summed in fp32 and rounded once, as accurate as eager PyTorch's gather-scale-sum against
    float64; every output written."""
    from fused_swiglu.experts.kernels.combine import combine

    tokens, hidden, k = size
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(tokens)
    src = torch.randn(tokens * k + 3, hidden, generator=g).to(device=device, dtype=dtype)  # 3 rows unread
    rows = torch.randperm(tokens * k + 3, generator=g)[: tokens * k].to(device=device, dtype=index_dtype)
    weights = torch.rand(tokens * k, generator=g).to(device=device, dtype=dtype) if weighted else None
    got = combine(src, rows, k, weights)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    scale = weights[:, None] if weighted else torch.ones((), device=device, dtype=dtype)
    want = (src.double()[rows] * scale.double()).view(tokens, k, hidden).sum(1)
    eager = (src[rows] * scale).view(tokens, k, hidden).sum(1)
    assert relative_error(got, want) <= 2 * relative_error(eager, want) + 1e-7  # NaN fails


@pytest.mark.parametrize("size", [(1, 8, 1), (37, 300, 130)], ids=lambda s: "T{}-H{}-P{}".format(*s))
def test_gather_of_routed_rows_is_exact(device, size, dtype):
    """The routed rows' gather (the combine with one row per output, and the ops' helper): each row
    equal to indexing, bit for bit, with rows repeated and unread, over more rows than a block."""
    from fused_swiglu.experts.kernels.combine import combine
    from fused_swiglu.experts.ops import _gathered

    tokens, hidden, rows_out = size
    g = torch.Generator().manual_seed(rows_out)
    src = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    rows = torch.randint(0, tokens, (rows_out,), generator=g).to(device=device, dtype=torch.int32)
    want = src[rows]
    for got in (_gathered(src, rows), combine(src, rows, 1)):
        assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want)


def test_combine_refuses_weights_of_another_shape(device):
    from fused_swiglu.experts.kernels.combine import combine

    src, rows = torch.zeros(6, 8, device=device), torch.arange(6, device=device)
    with pytest.raises(ValueError, match="weights"):
        combine(src, rows, 2, torch.ones(3, device=device))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("k", [1, 2])
def test_combine_op_passes_opcheck(device, k, weighted):
    """Schema (no input changed), fake implementation and AOT dispatch of the combine op."""
    from fused_swiglu.experts.ops import experts_combine

    src = torch.randn(2 * 11 + 1, 24, device=device)
    rows = torch.randperm(2 * 11 + 1, device=device)[: 11 * k]
    weights = torch.rand(11 * k, device=device) if weighted else None
    results = torch.library.opcheck(experts_combine, (src, rows, k, weights))
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("save", ["factors", "preact", "recompute"])
def test_ops_fake_implementations_match(device, save):
    """The experts' forward and backward ops traced (fake tensors) give the shapes, dtypes and devices
    of one real call, output by output (the backward overwrites what was kept: opcheck would flag it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fused_swiglu.experts.ops import experts_backward_down, experts_backward_gate_up, experts_forward

    x, index, weights, gate_up, down, dy = problem(21, 32, 16, 4, 2, device)
    routes = route(index, 4)
    table = (routes.tiles, routes.used_tiles, routes.ends)
    token_of_row = routes.tokens
    w_rows = weights.reshape(-1)[routes.sources]
    y_rows, saved, a = experts_forward(x, token_of_row, gate_up, down, *table, save)
    down_args = (dy[token_of_row], x, token_of_row, w_rows, gate_up, down, saved, a, *table, save, True, True)
    real_down = experts_backward_down(*down_args)
    grad = real_down[2] if save == "recompute" else saved
    gate_up_args = (grad, x, token_of_row, gate_up, routes.ends, real_down[0], True, True)
    real_gate_up = experts_backward_gate_up(*gate_up_args)
    calls = [(experts_forward, (x, token_of_row, gate_up, down, *table, save), (y_rows, saved, a))]
    calls += [
        (experts_backward_down, down_args, real_down),
        (experts_backward_gate_up, gate_up_args, real_gate_up),
    ]
    for op, args, real in calls:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args])
        for r, f in zip(real, fake, strict=True):
            assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device), op
            assert r.numel() == 0 or torch.isfinite(r).all()
