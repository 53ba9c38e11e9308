"""The command line: ``check`` runs the real kernels and checks them; ``bench`` needs a GPU."""

import pytest
import torch

from fused_swiglu.cli import main


def test_check_passes_on_a_small_problem(capsys):
    assert main(["check", "--shape", "33", "24", "40", "--dtype", "fp32", "--gate-multiplier", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "check passed" in out
    assert "swiglu_linear" in out and "recompute" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when there is no GPU")
def test_bench_without_gpu_says_so(capsys):
    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert main(["bench", "--dtype", "fp16", "--glu", "--decode"]) == 2  # every option parses
    assert main(["bench", "--fp8", "fused-fp8", "torchao-rowwise"]) == 2
    assert "bench --fp8 needs a CUDA GPU" in capsys.readouterr().out


def test_bench_rejects_an_unsupported_dtype():
    with pytest.raises(SystemExit):
        main(["bench", "--dtype", "fp32"])
