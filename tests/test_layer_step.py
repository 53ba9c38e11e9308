"""The decoder-layer benchmark's wiring (benchmarks/layer_step.py): transformers' layer and the same layer
with the fused MLP swapped in, eager and compiled, give the same gradients, compared name by name with
the packed gate/up gradient unpacked. On CPU through the interpreter, with Dynamo's eager backend."""

import importlib
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")


@pytest.fixture
def layer_step(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    return importlib.import_module("layer_step")


def test_every_variant_trains_to_the_same_gradients(layer_step, device):
    if device.type != "cpu":
        pytest.skip("wiring only; the GPU run is the benchmark itself")
    torch.manual_seed(0)
    batch, seq, hidden = 2, 8, 64
    layer, rotary = layer_step.decoder_layer(hidden, 136, 4, 2, seq, dtype=torch.float32)
    x = torch.randn(batch, seq, hidden, requires_grad=True)
    dy = torch.randn(batch, seq, hidden)
    pos = rotary(x, torch.arange(seq).expand(batch, seq))
    mods = layer_step.variants(layer, backend="aot_eager", traced=True)
    expected = {"transformers eager", "fused MLP eager", "transformers compiled", "fused MLP traced compiled"}
    assert list(mods)[0] == "transformers eager" and expected <= set(mods)
    reference = None
    for name, mod in mods.items():
        x.grad = None
        layer_step.step_fn(mod, x, pos, dy)()
        got = layer_step.grads(mod, x)
        assert "mlp.gate_proj.weight" in got and "mlp.gate_up_proj" not in got, name
        assert all(torch.isfinite(g).all() for g in got.values()), name
        if reference is None:  # transformers eager, the first variant
            reference = got
        assert layer_step.max_relative_difference(got, reference) < 1e-5, name
    # The traced layer is compiled in a process where the graph-break layer is not: one graph per step.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer_step.step_fn(mods["fused MLP traced compiled"], x, pos, dy)()
    graphs = sum(e.count for e in prof.key_averages() if e.key == "CompiledFunction")
    assert graphs == 1


def test_without_traced_the_fused_layer_compiles_behind_its_graph_break(layer_step):
    layer, _ = layer_step.decoder_layer(64, 136, 4, 2, 8, dtype=torch.float32)
    mods = layer_step.variants(layer, backend="aot_eager")
    assert "fused MLP compiled" in mods and not any("traced" in name for name in mods)
    assert mods["fused MLP compiled"].mlp.compiled_training == "graph_break"


def test_gradients_with_other_names_are_refused(layer_step):
    g = {"input": torch.ones(2), "w": torch.ones(2)}
    with pytest.raises(RuntimeError, match="differ in names"):
        layer_step.max_relative_difference(g, {"input": torch.ones(2), "v": torch.ones(2)})
    assert layer_step.max_relative_difference(
        {"input": torch.ones(2) * 1.5, "w": torch.ones(2)}, g
    ) == pytest.approx(0.5)


def test_the_log_filter_drops_only_the_kernel_analysis_tracebacks(layer_step):
    def record(path, msg):
        return logging.LogRecord("torch._dynamo", logging.WARNING, path, 1, msg, None, None)

    wrap = "/site-packages/torch/_higher_order_ops/triton_kernel_wrap.py"
    keep = layer_step._drop_kernel_analysis_tracebacks  # a logging filter: False drops
    assert not keep(record(wrap, "Encountered an exception in identify_mutated_tensors, assuming ..."))
    assert not keep(record(wrap, "Encountered an exception in identify_accessed_tensors, assuming ..."))
    assert keep(record(wrap, "another warning"))
    assert keep(
        record("/site-packages/torch/_dynamo/convert_frame.py", "Encountered an exception in identify_x")
    )
