"""Every tile config the library picks compiles for sm_90 within a block's shared memory, without
register spills on the tensor-core paths. Runs anywhere: Triton's compiler and ptxas need no GPU."""

import os
import subprocess
import sys


def test_chosen_configs_fit_an_sm90_block():
    # A fresh process without the interpreter, which would replace the kernels being compiled.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # hidden 4096 and 896 cover both sides of every shape-dependent choice in the configs.
    cmd = [
        sys.executable,
        "-m",
        "fused_swiglu.bench.resources",
        "--check",
        "--shapes",
        "llama3-8b",
        "qwen2.5-0.5b",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The three-pass fp32 forward, which spills with the wider tile of the other precisions.
    assert "float32/tf32x3 forward FACTORS" in done.stdout
    # The routed experts' forward and backward, with the masked stores of a group's cut tile.
    assert "bfloat16 forward FACTORS (routed experts)" in done.stdout
    assert "bfloat16 backward PREACT (routed experts)" in done.stdout
    assert "bfloat16 combine top-8 weighted (routed experts)" in done.stdout
    assert "route table, 1024 experts (routed experts)" in done.stdout
    assert "route keys, i64 ids to u8 (routed experts)" in done.stdout
    assert "bfloat16 combine top-1 (routed experts)" in done.stdout  # the routed rows' gather
    # The Gluon backward, compiled with its register split between loaders and consumers.
    assert "bfloat16 backward FACTORS (warp-specialized)" in done.stdout
    # The routed experts' Gluon backward over the tile table, with and without the weights' gradient.
    assert "bfloat16 routed experts backward FACTORS (warp-specialized)" in done.stdout
    assert "bfloat16 routed experts backward, no weights' gradient FACTORS (warp-specialized)" in done.stdout
    # The FP8 path's passes, every variant.
    assert "bfloat16 fp8 SwiGLU pass FACTORS" in done.stdout
    assert "float32 fp8 quantize activation and transpose" in done.stdout
    assert "bfloat16 fp8 SwiGLU gradient pass PREACT" in done.stdout
