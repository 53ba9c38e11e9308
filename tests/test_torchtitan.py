"""The torchtitan overrides (fused_swiglu/torchtitan.py) on torchtitan's own models, debug configs
with SDPA attention (flex attention has no CPU backward): outputs and every gradient equal stock
torchtitan's, checkpoints load both ways (plain and DCP), the command line's form of the
overrides, a block compiled with ``fullgraph``, activation checkpointing, a converter's projections
left alone, and tensor and expert parallelism over gloo with two processes.

torchtitan is installed apart (``pip install --no-deps "torchtitan==0.3.*"``: its ``datasets`` pin
conflicts with transformers 5); without it these tests skip."""

import logging
import os
import socket
import tempfile
from dataclasses import replace

import pytest
import torch

torchtitan = pytest.importorskip("torchtitan", reason='torchtitan: pip install --no-deps "torchtitan==0.3.*"')

from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402

import fused_swiglu.torchtitan as titan  # noqa: E402
from fused_swiglu.testing import relative_error, unit_roundoff  # noqa: E402

VOCAB = 2048
#: torchtitan's experts compute in bf16 (stock and fused alike): two bf16 roundings apart at most.
BF16_BOUND = 4 * unit_roundoff(torch.bfloat16)


def model_config(kind: str):
    if kind == "llama3":
        from torchtitan.models.llama3 import model_registry

        config = model_registry("debugmodel").model
    else:
        from torchtitan.models.qwen3 import model_registry

        config = model_registry("debugmodel_moe").model
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if kind != "llama3":  # balanced routing: gloo's all-to-all takes equal splits only
            layer.moe.router._debug_force_load_balance = True
    return config


def build(kind: str, fused: bool, seed: int = 0, **options):
    config = model_config(kind)
    if fused:
        titan.apply_fused(config, **options)
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


def tokens(batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def loss_of(y: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    """A loss whose sum over tensor-parallel shards of the logits is the whole one."""
    return y.float().pow(2).sum() / (y.shape[0] * y.shape[1] * vocab)


def stock_grads(model) -> dict[str, torch.Tensor]:
    """Each parameter's gradient under stock torchtitan's names (the packed ones unpacked)."""
    grads = {}
    for name, p in model.named_parameters():
        if name.endswith("gate_up"):
            prefix = name.removesuffix("gate_up")
            experts = p.dim() == 3
            gate, up = titan._unpack(p.grad, (p.shape[0],) if experts else ())
            keys = ("w1_EFD", "w3_EFD") if experts else ("w1.weight", "w3.weight")
            grads[prefix + keys[0]], grads[prefix + keys[1]] = gate, up
        else:
            grads[name] = p.grad
    return grads


def compare(stock, fused, bound: float) -> None:
    for name, want in stock_grads(stock).items():
        assert relative_error(stock_grads(fused)[name], want) <= bound, name


@pytest.mark.parametrize(("kind", "bound"), [("llama3", 1e-5), ("qwen3-moe", BF16_BOUND)])
def test_fused_model_computes_what_stock_computes(kind, bound):
    stock, fused = build(kind, False), build(kind, True)
    fused.load_state_dict(stock.state_dict())
    y_stock, y_fused = stock(tokens()), fused(tokens())
    assert relative_error(y_fused, y_stock) <= bound
    loss_of(y_stock).backward()
    loss_of(y_fused).backward()
    compare(stock, fused, bound)
    layer = fused.layers["0"]
    module = layer.feed_forward if kind == "llama3" else layer.moe.routed_experts.inner_experts
    assert isinstance(module, (titan.FusedFeedForward, titan.FusedGroupedExperts))


@pytest.mark.parametrize("kind", ["llama3", "qwen3-moe"])
def test_checkpoints_keep_torchtitans_keys_both_ways(kind):
    stock, fused = build(kind, False, seed=0), build(kind, True, seed=1)
    assert set(fused.state_dict()) == set(stock.state_dict())
    fused.load_state_dict(stock.state_dict())
    back = build(kind, False, seed=2)
    back.load_state_dict(fused.state_dict())
    for name, value in stock.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


def test_a_dcp_checkpoint_of_the_fused_model_loads_into_stock():
    import torch.distributed.checkpoint as dcp

    fused, stock = build("llama3", True, seed=0), build("llama3", False, seed=1)
    with tempfile.TemporaryDirectory() as folder:
        dcp.save(fused.state_dict(), checkpoint_id=folder, no_dist=True)
        state = stock.state_dict()
        dcp.load(state, checkpoint_id=folder, no_dist=True)
        stock.load_state_dict(state)
    for name, value in fused.state_dict().items():
        assert torch.equal(stock.state_dict()[name], value), name


def test_the_command_lines_form_applies_both_overrides():
    config = model_config("qwen3-moe")
    imports = parse_cli_imports(
        [
            'fused_swiglu.torchtitan.fused_feed_forward={"save": "preact"}',
            "fused_swiglu.torchtitan.fused_grouped_experts",
        ]
    )
    lines = apply_overrides(OverrideConfig(imports=imports), config)
    assert len(lines) == len(config.layers)  # the routed experts of every layer (no dense FFN here)
    assert all(
        type(layer.moe.routed_experts.inner_experts) is titan.FusedGroupedExperts.Config
        for layer in config.layers
    )
    dense = model_config("llama3")
    apply_overrides(OverrideConfig(imports=imports), dense)
    assert all(layer.feed_forward.save == "preact" for layer in dense.layers)


def test_a_feed_forward_another_converter_changed_is_left_alone(caplog):
    @__import__("dataclasses").dataclass(kw_only=True, slots=True)
    class ConvertedLinear(Linear.Config):  # what float8 or LoRA leave in a FeedForward's w1
        pass

    config = model_config("llama3")
    for layer in config.layers:
        w1 = layer.feed_forward.w1
        layer.feed_forward.w1 = ConvertedLinear(in_features=w1.in_features, out_features=w1.out_features)
    with caplog.at_level(logging.WARNING, logger="fused_swiglu"):
        titan.apply_fused(config)
    assert all(type(layer.feed_forward) is not titan.FusedFeedForward.Config for layer in config.layers)
    assert "left as it is" in caplog.text and "ConvertedLinear" in caplog.text


def test_options_are_checked_when_the_override_applies():
    with pytest.raises(ValueError, match="save must be one of"):
        titan.apply_fused(model_config("llama3"), save="keep-everything")
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        titan.apply_fused(model_config("llama3"), fp8="yes")
    config = model_config("llama3")
    for layer in config.layers:  # an intermediate size FP8's 128-wide groups cannot tile
        ffn = layer.feed_forward
        ffn.w1, ffn.w3 = replace(ffn.w1, out_features=200), replace(ffn.w3, out_features=200)
    with pytest.raises(ValueError, match="multiples of 128"):
        titan.apply_fused(config, fp8=True)


@pytest.mark.parametrize("kind", ["llama3", "qwen3-moe"])
def test_a_block_compiles_to_one_graph_and_matches_eager(kind):
    """As torchtitan compiles, block by block with ``fullgraph``: no graph break in the fused calls."""
    from torch._dynamo.utils import counters

    model = build(kind, True)
    block = model.layers["0"]
    x = model.tok_embeddings(tokens())
    eager = block(x, None, None)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got = compiled(x, None, None)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert relative_error(got, eager) <= 1e-6


@pytest.mark.parametrize("save", ["factors", "recompute"])
def test_activation_checkpointing_recomputes_the_fused_call(save):
    from torch.utils.checkpoint import checkpoint

    model = build("llama3", True, save=save)
    ffn = model.layers["0"].feed_forward
    x = torch.randn(2, 32, 256, requires_grad=True)
    plain = ffn(x)
    plain.square().sum().backward()
    want = (x.grad.clone(), ffn.gate_up.grad.clone(), ffn.w2.weight.grad.clone())
    x.grad = ffn.gate_up.grad = ffn.w2.weight.grad = None
    checkpointed = checkpoint(ffn, x, use_reentrant=False)
    assert torch.equal(checkpointed, plain)
    checkpointed.square().sum().backward()
    for got, expected in zip((x.grad, ffn.gate_up.grad, ffn.w2.weight.grad), want, strict=True):
        assert torch.equal(got, expected)


def _glu_forward_calls(model, grads_of) -> tuple[int, list[torch.Tensor]]:
    """How often the fused forward op runs in a training step of ``model``, and the gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func is torch.ops.fused_swiglu.glu_forward.default
            return func(*args, **(kwargs or {}))

    with Count():
        loss_of(model(tokens())).backward()
    return Count.calls, [p.grad for p in grads_of(model)]


def test_selective_checkpointing_saves_the_fused_forward_with_its_override():
    """torchtitan's selective checkpointing recomputes the fused forward op (its GEMM too) in the
    backward; with ``fused_selective_ac`` it saves its outputs as it saves a matmul's. The gradients
    are the unchecked model's either way."""
    from dataclasses import dataclass

    from torchtitan.config import Configurable
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    @dataclass(kw_only=True, slots=True)
    class Trainer(Configurable.Config):  # the node of a trainer config that the override replaces
        activation_checkpoint: SelectiveAC.Config

    def two_layers(policy: SelectiveAC.Config | None):
        config = model_config("llama3")
        config.layers = config.layers[:2]
        titan.apply_fused(config)
        torch.manual_seed(0)
        model = config.build()
        model.init_states()
        if policy is not None:
            policy.build(dump_folder="").apply(model)
        return model

    def ffn_params(model):
        return [p for block in model.layers.values() for p in block.feed_forward.parameters()]

    trainer = Trainer(activation_checkpoint=SelectiveAC.Config())
    stock_policy = trainer.activation_checkpoint
    assert len(titan.apply_fused(trainer, selective_ac=True)) == 1
    assert type(trainer.activation_checkpoint) is titan.FusedSelectiveAC.Config
    want_calls, want = _glu_forward_calls(two_layers(None), ffn_params)
    assert want_calls == 2
    for policy, calls in ((stock_policy, 4), (trainer.activation_checkpoint, 2)):
        got_calls, got = _glu_forward_calls(two_layers(policy), ffn_params)
        assert got_calls == calls, type(policy).__qualname__
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


# Tensor and expert parallelism over gloo ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharding(config, kind: str, ep: bool) -> None:
    if kind == "llama3":
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(config, enable_sp=False)
    else:
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(config, enable_sp=False, enable_ep=ep)


def _worker(rank, port, kind, fused, tp, ep, folder):
    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.distributed.utils import get_spmd_context

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        full = build(kind, False).state_dict()
        dims = ParallelDims(dp_replicate=1, dp_shard=ep, cp=1, tp=tp, pp=1, ep=ep, world_size=2)
        dims.build_mesh()
        config = model_config(kind)
        _sharding(config, kind, ep > 1)
        if fused:
            titan.apply_fused(config)
        model = config.build()
        model.load_state_dict(full)
        with get_spmd_context(parallel_dims=dims)():
            model.parallelize(dims)
            inputs, _, _ = annotate_input_spmd_types(dims, tokens(), tokens(), {})
            y = model(inputs)
            loss_of(y).backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        torch.save({"y": y.detach(), "grads": grads}, os.path.join(folder, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_parallel(kind: str, fused: bool, tp: int, ep: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(_free_port(), kind, fused, tp, ep, folder), nprocs=2)
        return [torch.load(os.path.join(folder, f"{rank}.pt")) for rank in range(2)]


def _whole(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Two ranks' shards of a tensor shaped ``like``, joined along the dim they split (or rank 0's)."""
    if parts[0].shape == like.shape:
        return parts[0]
    dim = next(d for d in range(like.dim()) if parts[0].shape[d] != like.shape[d])
    return torch.cat(parts, dim)


def test_tensor_parallel_fused_llama_equals_one_process():
    """gate_up sharded by rows (whole chunk pairs on each rank), w2 by columns, the module's output
    all-reduced: logits and every gradient as in one process of stock torchtitan."""
    ranks = run_parallel("llama3", True, tp=2, ep=1)
    stock = build("llama3", False)
    y = stock(tokens())
    loss_of(y).backward()
    assert relative_error(_whole([r["y"] for r in ranks], y), y) <= 1e-5
    for name, want in stock_grads(stock).items():
        parts = []
        for r in ranks:
            shard = r["grads"]
            if name.endswith(("w1.weight", "w3.weight")):
                prefix = name.removesuffix("w1.weight").removesuffix("w3.weight")
                gate, up = titan._unpack(shard[prefix + "gate_up"], ())
                parts.append(gate if name.endswith("w1.weight") else up)
            else:
                parts.append(shard[name])
        assert relative_error(_whole(parts, want), want) <= 1e-5, name


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_parallel_fused_experts_equal_parallel_stock(tp, ep):
    """The same parallelism for both: logits and every gradient within torchtitan's bf16 experts."""
    stock, fused = run_parallel("qwen3-moe", False, tp, ep), run_parallel("qwen3-moe", True, tp, ep)
    for s, f in zip(stock, fused, strict=True):
        assert relative_error(f["y"], s["y"]) <= BF16_BOUND
        for name, grad in f["grads"].items():
            if name.endswith("gate_up"):
                prefix = name.removesuffix("gate_up")
                gate, up = titan._unpack(grad, (grad.shape[0],))
                assert relative_error(gate, s["grads"][prefix + "w1_EFD"]) <= BF16_BOUND, name
                assert relative_error(up, s["grads"][prefix + "w3_EFD"]) <= BF16_BOUND, name
            else:
                assert relative_error(grad, s["grads"][name]) <= BF16_BOUND, name


def _fsdp_worker(rank, port, folder):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = build("llama3", True)
        for block in model.layers.values():  # as torchtitan shards: each block, then the rest
            fully_shard(block)
        fully_shard(model)
        y = model(tokens())
        loss_of(y).backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        torch.save({"y": y.detach(), "grads": grads}, os.path.join(folder, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_fused_llama_equals_one_process():
    """FSDP2 (``fully_shard`` on each block and the model) shards the packed gate_up by rows: the
    logits and every gradient (averaged over two ranks of the same batch) are one process's."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_fsdp_worker, args=(_free_port(), folder), nprocs=2)
        ranks = [torch.load(os.path.join(folder, f"{rank}.pt")) for rank in range(2)]
    one = build("llama3", True)
    y = one(tokens())
    loss_of(y).backward()
    for r in ranks:
        assert relative_error(r["y"], y) <= 1e-5
        for name, p in one.named_parameters():
            assert relative_error(r["grads"][name], p.grad) <= 1e-5, name


def test_fused_config_keeps_the_stock_fields():
    config = model_config("llama3").layers[0].feed_forward
    fused = titan.fused_feed_forward(replace(config), save="preact")
    assert (fused.w1, fused.w3, fused.save) == (config.w1, config.w3, "preact")
