"""The power-state benchmark's reading of nvidia-smi (benchmarks/power_state.py). Runs anywhere:
synthetic sample rows, no GPU."""

import importlib
from pathlib import Path

import pytest


@pytest.fixture
def power(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    return importlib.import_module("power_state")


def test_throttle_names_reads_the_bits(power):
    assert power.throttle_names(0x0) == []
    assert power.throttle_names(0x4) == ["power cap"]
    assert power.throttle_names(0x24) == ["power cap", "thermal (software)"]
    assert power.throttle_names(0x104) == ["power cap", "0x100"]


def test_summarize_drops_the_edges_and_takes_medians(power):
    lines = [
        "1980, 120.0, 0x0000000000000000",  # the loop starting: dropped
        "1485, 692.0, 0x0000000000000004",
        "1500, 690.0, 0x0000000000000004",
        "1455, 691.0, 0x0000000000000004",
        "",
        "1980, 100.0, 0x0000000000000001",  # the loop stopping: dropped
    ]
    got = power.summarize(lines)
    assert got == {"sm_clock_mhz": 1485.0, "power_w": 691.0, "throttle": ["power cap"], "samples": 3}


def test_summarize_refuses_too_few_samples(power):
    with pytest.raises(ValueError, match="too few"):
        power.summarize(["1980, 120.0, 0x0", "1980, 120.0, 0x0"])


def test_variants_are_checked_against_the_experiments(power):
    import argparse

    import ab_step

    parser = argparse.ArgumentParser()
    ab_step.add_variants_argument(parser, "the step")
    ok = parser.parse_args(["--variants", "ping-pong-factors:ping-pong"])
    assert ab_step.chosen_variants(parser, ok) == [("ping-pong-factors", "ping-pong")]
    for bad in ("ping-pong-factors:bogus", "no-such-experiment:x", "missing-colon"):
        with pytest.raises(SystemExit):
            ab_step.chosen_variants(parser, parser.parse_args(["--variants", bad]))
