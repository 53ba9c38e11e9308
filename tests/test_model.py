"""Whole Hugging Face models with the fused MLP swapped in (``bench --model``'s workers, run here in
this process): compiled by default as one graph, with no graph break and no recompile after the first
step, however deep, and the first losses of stock eager."""

import itertools
import json
import os

import pytest
import torch

from fused_swiglu.bench.training import RunSpec, host_profile, run_variant

pytest.importorskip("transformers")

TINY = {"hidden": 64, "intermediate": 128, "tokens": 32, "sequence": 32, "vocab": 128}


def tiny_run(variant: str, layers: int, device, backend: str = "eager") -> dict:
    torch._dynamo.reset()
    spec = RunSpec(
        variant,
        layers=layers,
        precision="fp32",
        steps=1,
        windows=1,
        device=str(device),
        backend=backend,
        **TINY,
    )
    return run_variant(spec)


def test_swapped_model_compiles_to_one_graph(device):
    """Dynamo's view (backend "eager"): one graph, no break, no recompile after the first step, at
    Llama 70B's depth (80 layers: a model as deep as any the library serves)."""
    layers = 80
    fused = tiny_run("fused-compiled", layers, device)
    assert (fused["graphs"], fused["graph_breaks"], fused["recompiles"]) == (1, 0, 0)
    stock = tiny_run("stock-eager", layers, device)
    for got, want in zip(fused["losses"], stock["losses"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)


def test_swapped_model_trains_under_aot_autograd(device):
    """The compiled forward and backward graphs (AOTAutograd) train as stock eager does."""
    fused = tiny_run("fused-compiled", 2, device, backend="aot_eager")
    stock = tiny_run("stock-eager", 2, device)
    assert fused["graph_breaks"] == 0
    for got, want in zip(fused["losses"], stock["losses"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)


def test_bench_model_command_writes_its_results(device, tmp_path):
    """``bench --model`` end to end: fresh processes, table, JSON, Markdown and PNG."""
    from fused_swiglu.cli import main

    if device.type != "cpu":
        pytest.skip("the CPU smoke run of the command; on the GPU the benchmark itself runs")
    args = ["bench", "--model-size", "64", "128", "1", "32", "--variants", "stock-eager", "fused-compiled"]
    args += ["--precisions", "fp32", "--device", "cpu", "--backend", "eager", "--reps", "1", "--steps", "1"]
    assert main([*args, "--windows", "3", "--host-profile", "--out", str(tmp_path)]) == 0
    out = tmp_path / "model"
    results = json.loads((out / "results.json").read_text())
    assert all(run["host_ops"]["top"] for run in results["runs"])
    stock, fused = results["runs"]
    assert len(stock["window_ms"]) == len(fused["window_ms"]) == 3
    # window by window, against the stock window of the same round
    want = [f / s for f, s in zip(fused["window_ms"], stock["window_ms"], strict=True)]
    assert fused["window_ratios_vs_stock_eager"] == pytest.approx(want)
    summary = results["summary"]
    assert [row["variant"] for row in summary] == ["stock-eager", "fused-compiled"]
    assert summary[1]["vs_stock_eager"] == pytest.approx(sorted(want)[1])
    assert summary[1]["graph_breaks"] == 0 and summary[1]["loss_rel_diff"] < 1e-4
    assert "fused-compiled" in (out / "results.md").read_text()
    assert (out / "step_vs_stock.png").stat().st_size > 0


def test_side_by_side_processes_take_turns_and_report_a_failed_variant():
    """The variants' processes time their windows one at a time, in rotating order; a variant whose
    process fails is reported with its error and the others still run."""
    from fused_swiglu.bench.side_by_side import run_side_by_side

    common = {"layers": 1, "precision": "fp32", "steps": 1, "device": "cpu", **TINY}
    specs = [RunSpec(v, **common) for v in ("stock-eager", "stock-grouped-compiled", "fused-eager")]
    log = []
    stock, failed, fused = run_side_by_side(specs, windows=4, timeout=600, log=log.append)
    assert "needs --moe" in failed["error"]
    spans = sorted((*span, run["variant"]) for run in (stock, fused) for span in run["window_spans"])
    assert len(spans) == 8
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in itertools.pairwise(spans))
    firsts = [name for _, _, name in spans[::2]]  # who went first in each round: the order rotates
    assert firsts == ["stock-eager", "fused-eager", "stock-eager", "fused-eager"]
    assert len(stock["window_ms"]) == 4 and stock["losses"] and fused["graphs"] == 0
    assert any("round 4/4" in line for line in log)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores"
)
def test_pinned_workers_run_on_disjoint_shares_of_the_cores():
    from fused_swiglu.bench.model import core_shares
    from fused_swiglu.bench.side_by_side import run_side_by_side

    shares = core_shares(2)
    assert len(shares) == 2 and not set(shares[0]) & set(shares[1]) and all(shares)
    common = {"layers": 1, "precision": "fp32", "steps": 1, "device": "cpu", **TINY}
    variants = ("stock-eager", "fused-eager")
    specs = [RunSpec(v, **common, cores=c) for v, c in zip(variants, shares, strict=True)]
    runs = run_side_by_side(specs, windows=1, timeout=600, log=lambda line: None)
    assert [tuple(run["affinity"]) for run in runs] == shares
    with pytest.raises(ValueError, match="cannot give"):
        core_shares(len(os.sched_getaffinity(0)) + 1)


def test_a_worker_that_does_not_answer_in_time_is_stopped_and_reported():
    from fused_swiglu.bench.side_by_side import run_side_by_side

    spec = RunSpec("stock-eager", layers=1, precision="fp32", steps=1, device="cpu", **TINY)
    (run,) = run_side_by_side([spec], windows=1, timeout=0.01, log=lambda line: None)
    assert run["error"] == "no answer within 0.01 s" and run["variant"] == "stock-eager"


def test_side_by_side_groups_hold_the_stock_variants_in_each():
    from fused_swiglu.bench.model import side_by_side_groups

    variants = ["stock-eager", "fused-eager", "stock-compiled", "liger-compiled", "fused-compiled"]
    assert side_by_side_groups(variants, 4) == [
        ["stock-eager", "fused-eager", "stock-compiled", "liger-compiled"],
        ["stock-eager", "stock-compiled", "fused-compiled"],
    ]
    assert side_by_side_groups(variants, 9) == [variants]
    assert side_by_side_groups(["stock-compiled"], 1) == [["stock-compiled"]]
    with pytest.raises(ValueError, match="no room"):
        side_by_side_groups(variants, 2)


def test_moe_model_compiles_to_one_graph_and_trains_like_stock(device):
    """``bench --model --moe``: a Qwen3-MoE model whose routed experts are swapped, compiled."""
    torch._dynamo.reset()
    common = {"layers": 4, "precision": "fp32", "steps": 1, "windows": 1, "device": str(device)}
    moe = {"experts": 4, "top_k": 2, **TINY, "intermediate": 32}
    fused = run_variant(RunSpec("fused-compiled", backend="eager", **common, **moe))
    assert (fused["graphs"], fused["graph_breaks"], fused["recompiles"]) == (1, 0, 0)
    stock = run_variant(RunSpec("stock-eager", **common, **moe))
    # transformers' grouped_mm experts: how they compile is transformers' (5.17 breaks the graph on CUDA)
    grouped = run_variant(RunSpec("stock-grouped-compiled", backend="eager", **common, **moe))
    for run in (fused, grouped):
        for got, want in zip(run["losses"], stock["losses"], strict=True):
            assert abs(got - want) <= 1e-4 * abs(want)


def test_grouped_experts_variant_needs_a_moe_model():
    from fused_swiglu.cli import main

    with pytest.raises(ValueError, match="needs --moe"):
        run_variant(RunSpec("stock-grouped-compiled", layers=1, precision="fp32", steps=1, **TINY))
    args = ["bench", "--model-size", "64", "128", "1", "32", "--variants", "stock-grouped-compiled"]
    assert main([*args, "--device", "cpu"]) == 2


def test_host_profile_names_the_fused_ops(device):
    """``bench --model --host-profile``: the operators' host time per step, the fused ops among them."""
    torch._dynamo.reset()
    common = {"layers": 2, "precision": "fp32", "steps": 2, "windows": 1, "device": str(device)}
    result = run_variant(RunSpec("fused-compiled", backend="eager", host_profile=True, **common, **TINY))
    profile = result["host_ops"]
    names = [row["name"] for row in profile["top"]]
    assert any(name.startswith("fused_swiglu::") for name in names), names
    forward = next(row for row in profile["top"] if row["name"] == "fused_swiglu::glu_forward")
    assert forward["calls"] == 2  # one per layer and step
    assert 0 < forward["self_us"] <= forward["total_us"] and profile["self_us"] >= forward["self_us"]


def test_host_profile_by_shape_lists_each_shape_of_the_named_operators():
    a, b, c = torch.randn(4, 8), torch.randn(8, 3), torch.randn(8, 5)

    def step():
        torch.mm(a, b)
        torch.mm(a, c)
        torch.mm(a, c)
        torch.add(a, 1)

    profile = host_profile(step, 2, by_shape=("aten::mm",))
    found = {str(row["shapes"]): row["calls"] for row in profile["by_shape"]}
    assert found == {"[[4, 8], [8, 3]]": 1, "[[4, 8], [8, 5]]": 2}
    assert {row["name"] for row in profile["by_shape"]} == {"aten::mm"}
    totals = [row["total_us"] for row in profile["by_shape"]]
    assert totals == sorted(totals, reverse=True)
    assert "by_shape" not in host_profile(step, 1)
