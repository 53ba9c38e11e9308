"""The step breakdown's trace handling (benchmarks/step_breakdown.py): GPU activities in start order, split
into identical steps, refused when the steps differ. Runs anywhere: synthetic traces, no profiler."""

import importlib
from pathlib import Path

import pytest


@pytest.fixture
def breakdown(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    return importlib.import_module("step_breakdown")


def _trace(*events):
    """Chrome-trace events: (category, name, start us, duration us), plus a host event and a flow
    event that must be ignored."""
    rows = [{"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur} for cat, name, ts, dur in events]
    rows.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.5, "dur": 9.0})
    rows.append({"ph": "s", "cat": "ac2g", "name": "flow", "ts": 0.7})
    return {"traceEvents": rows}


def test_device_events_keeps_gpu_activity_in_start_order(breakdown):
    trace = _trace(
        ("kernel", "gemm", 30.0, 4.0), ("gpu_memset", "memset", 10.0, 1.0), ("kernel", "glu", 20.0, 2.5)
    )
    assert breakdown.device_events(trace) == [(10.0, "memset", 1.0), (20.0, "glu", 2.5), (30.0, "gemm", 4.0)]


def test_per_step_splits_identical_steps_and_medians_by_position(breakdown):
    durations = [(5.0, 7.0), (6.0, 9.0), (100.0, 8.0)]  # one slow outlier at position 0
    events, ts = [], 0.0
    for fwd, gemm in durations:
        for name, dur in (("fwd", fwd), ("gemm", gemm)):
            events.append((ts, name, dur))
            ts += 10.0
    seqs = breakdown.per_step(events, 3)
    assert seqs == [[("fwd", f), ("gemm", g)] for f, g in durations]
    assert breakdown.median_sequence([seqs[:2], seqs[2:]]) == [("fwd", 6.0), ("gemm", 8.0)]


def test_per_step_refuses_steps_that_differ(breakdown):
    events = [(0.0, "fwd", 1.0), (1.0, "gemm", 1.0), (2.0, "fwd", 1.0), (3.0, "copy", 1.0)]
    with pytest.raises(ValueError, match="step 1 launches other kernels"):
        breakdown.per_step(events, 2)
    with pytest.raises(ValueError, match="do not split into 3 steps"):
        breakdown.per_step(events, 3)


def test_short_name_drops_arguments_and_fits_the_column(breakdown):
    assert breakdown.short_name("void gemm_kernel<float>(Params)") == "void gemm_kernel<float>"
    long = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute"
    assert len(breakdown.short_name(long)) == breakdown.NAME_WIDTH
    assert breakdown.short_name(long).endswith("...")


def test_median_sequence_sums_by_name_when_steps_differ(breakdown):
    rounds = [[[("fwd", 4.0), ("gemm", 6.0)]], [[("fwd", 2.0), ("copy", 1.0), ("gemm", 8.0)]]]
    assert breakdown.median_sequence(rounds) == [("fwd", 3.0), ("gemm", 7.0), ("copy", 0.5)]


def test_print_pair_pairs_kernels_and_sums_memsets_apart(breakdown, capsys):
    floor = [("Memset", 1.0), ("gemm_a", 100.0), ("Memset", 2.0), ("gemm_b", 50.0)]
    step = [("fused", 110.0), ("Memset", 1.0), ("gemm_b", 45.0)]
    breakdown.print_pair(floor, step)
    out = capsys.readouterr().out.splitlines()
    assert "gemm_a" in out[1] and "fused" in out[1] and out[1].endswith("1.100")
    assert out[2].count("gemm_b") == 2 and out[2].endswith("0.900")
    assert out[3] == "  memsets: floor 3.0 us, library 1.0 us"


def test_print_pair_lists_sequences_that_do_not_pair(breakdown, capsys):
    breakdown.print_pair([("gemm", 10.0)], [("fused", 8.0), ("grad", 1.0)])
    out = capsys.readouterr().out
    assert "floor kernels:" in out and "library kernels:" in out and "ratio" not in out
