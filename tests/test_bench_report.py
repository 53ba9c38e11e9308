"""The benchmark's report writers, on synthetic rows (measuring needs a GPU)."""

import json

import pytest

from fused_swiglu.bench.report import shape_table, write_json, write_markdown

SHAPE = {"M": 8, "hidden": 16, "intermediate": 32}
ROWS = [
    {"impl": "floor", **SHAPE, "step_ms": 1.0, "fwd_ms": 0.4, "no_grad_fwd_ms": 0.4},
    {
        "impl": "fused-preact",
        **SHAPE,
        "step_ms": 0.9,
        "step_vs_floor": 0.9,
        "fwd_ms": 0.5,
        "no_grad_fwd_ms": 0.3,
        "kept_mib": 1.0,
        "peak_mib": 2.5,
        "first_call_s": 1.5,
        "tflops": 700.0,
    },
    {"impl": "liger", "missing": "liger-kernel is not installed"},
]
META = {
    "gpu": "GPU",
    "torch": "t",
    "triton": "tr",
    "commit": "abcdef1234567890",
    "date": "d",
    "liger_kernel": None,
    "flash_swiglu_mlp": "0.4.3",
}


def test_table_lists_every_impl_and_marks_missing_peers():
    table = shape_table(ROWS)
    assert "fused-preact" in table and "0.900" in table
    assert "missing: liger-kernel is not installed" in table


def test_markdown_and_json_carry_provenance(tmp_path):
    write_markdown(tmp_path / "r.md", META, {"tiny": ROWS}, ["note"])
    write_json(tmp_path / "r.json", META, {"tiny": ROWS}, {})
    text = (tmp_path / "r.md").read_text()
    assert "commit `abcdef123456`" in text and "## tiny (M=8, hidden=16, intermediate=32)" in text
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["gpu"] == "GPU"


def test_markdown_names_the_dtype(tmp_path):
    write_markdown(tmp_path / "bf16.md", META, {"tiny": ROWS}, [])
    write_markdown(tmp_path / "fp16.md", META | {"dtype": "fp16"}, {"tiny": ROWS}, [])
    assert "\nbf16, `triton.testing.do_bench`" in (tmp_path / "bf16.md").read_text()
    assert "\nfp16, `triton.testing.do_bench`" in (tmp_path / "fp16.md").read_text()


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from fused_swiglu.bench.report import write_plots

    paths = write_plots(tmp_path, {"tiny": ROWS, "tiny2": ROWS})
    assert [p.name for p in paths] == ["step_vs_floor.png", "memory.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_decode_table_puts_batch_sizes_across():
    from fused_swiglu.bench.decode import decode_table

    rows = [
        {"M": 1, "impl": "floor", "no_grad_fwd_ms": 0.1, "no_grad_fwd_vs_floor": 1.0},
        {"M": 1, "impl": "fused", "no_grad_fwd_ms": 0.105, "no_grad_fwd_vs_floor": 1.05},
        {"M": 16, "impl": "floor", "no_grad_fwd_ms": 0.2, "no_grad_fwd_vs_floor": 1.0},
        {"M": 16, "impl": "fused", "no_grad_fwd_ms": 0.19, "no_grad_fwd_vs_floor": 0.95},
        {"M": 1, "impl": "liger", "missing": "liger-kernel is not installed"},
    ]
    lines = decode_table(rows, markdown=True).splitlines()
    assert "M=1 us (vs floor)" in lines[0] and "M=16 us (vs floor)" in lines[0]
    fused = next(line for line in lines if line.startswith("| fused"))
    assert "105.0 (1.05x)" in fused and "190.0 (0.95x)" in fused
    assert "missing" in next(line for line in lines if line.startswith("| liger"))


def test_inference_only_measures_the_no_grad_forward_in_rotating_order(monkeypatch):
    """The timing loop without a GPU: do_bench replaced by a call that returns each impl's cost."""
    import torch

    from fused_swiglu.bench import measure
    from fused_swiglu.bench.impls import Impl

    calls = []

    def fake(name, ms):
        def forward():
            calls.append((name, torch.is_grad_enabled()))
            return torch.tensor(ms)

        return Impl(name, forward, step=lambda: pytest.fail("an inference-only run ran a backward"))

    monkeypatch.setattr(measure, "do_bench", lambda fn, **_: float(fn()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    impls = [fake("floor", 2.0), fake("fused", 1.0), ("liger", "not installed")]
    rows = measure.measure_impls(impls, None, 0.0, reps=3, log=lambda _: None, inference_only=True)

    by_name = {r["impl"]: r for r in rows}
    assert by_name["fused"]["no_grad_fwd_ms"] == 1.0 and by_name["fused"]["no_grad_fwd_vs_floor"] == 0.5
    assert "step_ms" not in by_name["fused"] and "peak_mib" not in by_name["fused"]
    assert by_name["liger"]["missing"] == "not installed"
    assert not any(grad for _, grad in calls)
    timed = [name for name, _ in calls[2:]]  # after the two first calls
    assert timed == ["floor", "fused", "fused", "floor", "floor", "fused"]


def test_inference_only_also_times_cuda_graph_replays(monkeypatch):
    """With ``graphs``, each forward is also timed from its CUDA graph replay; an implementation that
    cannot be captured is reported as such and the others are still timed."""
    import torch

    from fused_swiglu.bench import measure
    from fused_swiglu.bench.decode import decode_table
    from fused_swiglu.bench.impls import Impl

    costs = {"floor": 2.0, "fused": 3.0, "peer": 4.0}
    replay_costs = {"floor": 1.0, "fused": 0.9}

    def capture(fn):
        name = fn()  # the captured call
        if name not in replay_costs:
            raise RuntimeError("operation not permitted when stream is capturing")
        return lambda: ("replay", name)

    def do_bench(fn, **_):
        out = fn()
        return replay_costs[out[1]] if isinstance(out, tuple) else costs[out]

    monkeypatch.setattr(measure, "cuda_graph_replay", capture)
    monkeypatch.setattr(measure, "do_bench", do_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    impls = [Impl(name, (lambda name=name: name), step=lambda: None) for name in costs]
    rows = measure.measure_impls(
        impls, None, 0.0, reps=2, log=lambda _: None, inference_only=True, graphs=True
    )

    by_name = {r["impl"]: r for r in rows}
    assert by_name["fused"]["graph_fwd_ms"] == 0.9 and by_name["fused"]["graph_fwd_vs_floor"] == 0.9
    assert by_name["fused"]["no_grad_fwd_vs_floor"] == 1.5
    assert "graph_fwd_ms" not in by_name["peer"] and "capturing" in by_name["peer"]["graph_failed"]
    assert by_name["peer"]["no_grad_fwd_ms"] == 4.0
    for row in rows:
        row["M"] = 1
    lines = decode_table(rows, markdown=True, metric="graph_fwd").splitlines()
    assert "900.0 (0.90x)" in next(line for line in lines if line.startswith("| fused"))
    assert "capture failed" in next(line for line in lines if line.startswith("| peer"))


def test_median_ms_asks_do_bench_for_the_median(monkeypatch):
    """``do_bench`` returns the mean unless told otherwise; every benchmark times through this."""
    from fused_swiglu.bench import measure

    seen = {}
    monkeypatch.setattr(measure, "do_bench", lambda fn, **kw: seen.update(kw) or 1.5)
    assert measure.median_ms(lambda: None, warmup=3, rep=7, grad_to_none=["g"]) == 1.5
    assert seen == {"warmup": 3, "rep": 7, "grad_to_none": ["g"], "return_mode": "median"}


def test_provenance_header_names_gpu_versions_and_commit():
    from fused_swiglu.bench.report import provenance_header

    meta = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "commit": "abc1234", "date": "x"}
    assert provenance_header(meta) == "# NVIDIA H200, torch 2.11.0, triton 3.6.0, commit abc1234"


def test_sustained_columns_and_note_appear_only_when_measured(tmp_path):
    assert "sustained" not in shape_table(ROWS)
    rows = [ROWS[0] | {"sustained_ms": 1.1}, ROWS[1] | {"sustained_ms": 1.2, "sustained_vs_floor": 1.091}]
    table = shape_table(rows + ROWS[2:])
    assert "sustained ms" in table and "1.091" in table
    assert "missing: liger-kernel is not installed" in table
    write_markdown(tmp_path / "r.md", META | {"sustained_s": 2.5}, {"tiny": rows}, [])
    assert "back to back for 2.5 s per repetition" in (tmp_path / "r.md").read_text()
    write_markdown(tmp_path / "plain.md", META, {"tiny": ROWS}, [])
    assert "back to back" not in (tmp_path / "plain.md").read_text()


def test_sustained_step_is_timed_in_the_rotation_and_compared_to_the_floor(monkeypatch):
    """``sustained_s`` adds one back-to-back run per implementation and repetition."""
    import torch

    from fused_swiglu.bench import measure
    from fused_swiglu.bench.impls import Impl

    costs = {"floor": 2.0, "fused": 2.2}
    order = []

    def sustained(step, params, seconds):
        assert seconds == 0.5
        order.append(step())
        return costs[order[-1]]

    monkeypatch.setattr(measure, "median_ms", lambda fn, **_: 1.0)
    monkeypatch.setattr(measure, "sustained_ms", sustained)
    monkeypatch.setattr(measure, "_memory", lambda impl, grad_out: (0.0, 0.0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    impls = [Impl(name, forward=lambda: None, step=lambda name=name: name) for name in costs]
    rows = measure.measure_impls(impls, None, 1.0, reps=2, log=lambda _: None, sustained_s=0.5)

    by_name = {r["impl"]: r for r in rows}
    assert by_name["fused"]["sustained_ms"] == 2.2
    assert by_name["fused"]["sustained_vs_floor"] == pytest.approx(1.1)
    assert order == ["floor", "fused", "fused", "floor"]  # rotated, once per repetition


def test_sustained_ms_waits_only_for_the_call_a_queue_back(monkeypatch):
    """The loop never drains the GPU: before call n it waits for call n - SUSTAINED_QUEUE alone."""
    import torch

    from fused_swiglu.bench import measure

    log = []

    class Event:
        count = 0

        def __init__(self, enable_timing=False):
            self.id, Event.count = Event.count, Event.count + 1
            self.recorded_at = None

        def record(self):
            self.recorded_at = len([e for e in log if e[0] == "call"])

        def synchronize(self):
            log.append(("wait", self.recorded_at))

        def elapsed_time(self, other):
            return 30.0

    clock = iter(range(1000))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append(("drain", None)))
    monkeypatch.setattr(measure.time, "perf_counter", lambda: float(next(clock)))
    param = torch.zeros(1, requires_grad=True)
    param.grad = torch.ones(1)

    def step():
        assert param.grad is None  # gradients cleared before every call
        log.append(("call", None))

    ms = measure.sustained_ms(step, [param], seconds=20.5)
    calls = [e for e in log if e[0] == "call"]
    assert len(calls) == 20 and ms == 30.0 / 20
    q = measure.SUSTAINED_QUEUE
    waits = [at for kind, at in log if kind == "wait"]
    # The first q waits are on events never recorded; then call n waits for the end of call n - q.
    assert waits[:q] == [None] * q and waits[q:] == [n - q + 1 for n in range(q, 20)]
    assert [kind for kind, _ in log].count("drain") == 1 and log[-1] == ("drain", None)


def test_start_gpu_log_says_what_a_script_needs_without_a_gpu(monkeypatch, capsys):
    from fused_swiglu.bench import report

    monkeypatch.setattr(report.torch.cuda, "is_available", lambda: False)
    assert report.start_gpu_log("abc", "this script needs a CUDA GPU") is None
    assert capsys.readouterr().out == "this script needs a CUDA GPU\n"


def test_host_time_section_compares_each_call_with_stock_run_the_same_way(monkeypatch):
    import argparse

    from fused_swiglu.bench import run
    from fused_swiglu.bench.host import HOST_IMPLS

    us = {"eager": 500.0, "torch.compile": 800.0, "fused-factors": 600.0, "fused-compiled": 1000.0}

    def fake(hidden, inter, rows, *, precision, reps, log):
        scale = 2.0 if precision == "autocast" else 1.0  # the two precisions must not be mixed up
        return [
            {"impl": i, "precision": precision, "host_us": us.get(i, 700.0) * scale, "host_us_min": 1.0,
             "host_us_max": 2.0, "rows": rows}
            for i in HOST_IMPLS
        ]  # fmt: skip

    monkeypatch.setattr(run, "measure_host_time", fake)
    extra: dict = {}
    lines = run._host_time_section(argparse.Namespace(host_time=[64, 128, 16], reps=1), extra)
    text = "\n".join(lines).splitlines()
    table = [line.split("|")[1:-1] for line in text if line.startswith("| ")][1:]
    ratios = {(cells[0].strip(), cells[1].strip()): float(cells[4]) for cells in table}
    for precision in ("bf16", "autocast"):
        assert ratios[("fused-factors", precision)] == pytest.approx(1.2)
        assert ratios[("fused-compiled", precision)] == pytest.approx(1.25)
        assert ratios[("torch.compile", precision)] == pytest.approx(1.0)
    assert len(extra["host_time"]) == 2 * len(HOST_IMPLS)


def _run(variant: str, seed: int, losses: list[float], val: float) -> dict:
    log = [{"step": 10 * (i + 1), "loss": loss, "grad_norm": 1.0 + i} for i, loss in enumerate(losses)]
    return {"variant": variant, "seed": seed, "log": log, "val_loss": val, "seconds": 1.0}


def test_convergence_report_measures_each_run_against_the_bf16_spread(tmp_path):
    pytest.importorskip("matplotlib")
    from fused_swiglu.bench.convergence import report

    runs = [
        _run("bf16", 0, [3.0, 2.0, 1.50], 1.60),
        _run("bf16", 1, [3.0, 2.0, 1.52], 1.64),
        _run("fused-fp8", 0, [3.0, 2.0, 1.51], 1.62),
        _run("torchao-tensorwise", 0, [3.0, 2.5, 2.40], 2.00),
    ]
    meta = META | {"steps": 30, "batch": 2, "sequence": 8, "lr": 1e-3, "model": [64, 128, 2], "torchao": "x"}
    text = report(runs, tmp_path, meta)
    assert "validation 1.6000-1.6400" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "yes" in rows["fused-fp8 (seed 0)"] and "+0.3600" in rows["torchao-tensorwise (seed 0)"]
    assert json.loads((tmp_path / "convergence.json").read_text())["runs"][2]["variant"] == "fused-fp8"
    assert (tmp_path / "convergence.png").stat().st_size > 0
