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


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from fused_swiglu.bench.report import write_plots

    paths = write_plots(tmp_path, {"tiny": ROWS, "tiny2": ROWS})
    assert [p.name for p in paths] == ["step_vs_floor.png", "memory.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
