"""A whole LLaMA decoder layer (attention, norms, residuals and the MLP), training step, with the fused MLP
swapped in against transformers' own and Liger's, eager and under ``torch.compile``.

Run on the GPU: ``python benchmarks/layer_step.py [--shapes llama3-8b ...] [--batch 4 --seq 2048]
--out layer.json``. Needs transformers. A shape gives the hidden and intermediate sizes (and the
model's heads); the tokens are ``batch * seq`` (8192 by default), causal attention over each
sequence.

The MLP benchmark (``bench``) compares MLPs alone. A model compiled whole is another question: in
training the fused MLP runs behind a graph break (README, Limits), so the compiler cannot fuse the
RMSNorm before it or the residual add after it into neighbouring kernels, which it can do with the
stock MLP. Here one ``LlamaDecoderLayer`` (SDPA attention) trains as transformers' layer, the same
layer after ``swap_swiglu_mlps``, and with Liger-Kernel's ``LigerSwiGLUMLP`` in place of its MLP
where Liger is installed, each eager and compiled. Every variant holds the same weights and gets
the same input and output gradient, so their gradients must agree (the largest relative difference
to the eager layer's, over the input and every parameter, is printed). Per variant: the fwd+bwd
step (``do_bench`` medians, the order rotating between repetitions), the extra peak memory of a
step, and the first call. ``--traced`` compiles the fused layer with its training traced into the
graph (``compiled_training="traced"``: no graph break) instead of behind the graph break.
``--triton-launch`` adds the fused layers with every kernel launched through Triton's JIT path
instead of the library's cached direct launch (``kernels/launch.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time

import torch

from fused_swiglu import swap_swiglu_mlps
from fused_swiglu.bench.impls import peer_module
from fused_swiglu.bench.measure import median_ms, peak_mib
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.bench.run import SHAPES
from fused_swiglu.kernels import launch
from fused_swiglu.layout import unpack_gate_up

#: Attention heads and key/value heads of the models the MLP shapes come from.
HEADS = {
    "llama3-8b": (32, 8),
    "qwen2.5-7b": (28, 4),
    "llama2-7b": (32, 32),
    "qwen2.5-0.5b": (14, 2),
}


def decoder_layer(hidden: int, inter: int, heads: int, kv_heads: int, seq: int, **factory):
    """transformers' ``LlamaDecoderLayer`` and its rotary embedding for ``seq`` positions."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
    )
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, layer_idx=0).to(**factory)
    rotary = LlamaRotaryEmbedding(config).to(factory.get("device"))  # its inverse frequencies stay fp32
    return layer, rotary


def _drop_kernel_analysis_tracebacks(record: logging.LogRecord) -> bool:
    """Dynamo's analysis of which tensors a user Triton kernel writes cannot parse Liger's SwiGLU
    kernels (a float argument used as a tensor); it logs a traceback per kernel, then treats every
    input as written, which is still correct. Those screens of text are about the peer, not the
    measurement. A logging filter (False drops the record) on the logger, because torch resets the
    levels of its loggers."""
    return not (
        record.pathname.endswith("triton_kernel_wrap.py")
        and record.getMessage().startswith("Encountered an exception in identify_")
    )


def variants(
    layer: torch.nn.Module, backend: str = "inductor", traced: bool = False
) -> dict[str, torch.nn.Module]:
    """The layer as given, with the fused MLP swapped in, and with Liger-Kernel's MLP where it is
    installed, each eager and compiled (own copies of the same weights). With ``traced``, the fused
    layer is compiled with its training traced into the graph (``compiled_training="traced"``)
    instead of behind the graph break: not both in one process, because Dynamo would run the traced
    layer through the graph-break layer's compiled code (its guards stop at the break), in three
    graphs instead of one."""
    fused = copy.deepcopy(layer)
    swapped = swap_swiglu_mlps(fused)
    if swapped != ["mlp"]:
        raise RuntimeError(f"expected to swap the layer's one MLP, swapped {swapped}")
    layers = {"transformers": layer, "fused MLP": fused}
    liger = peer_module("liger", layer.mlp)
    if isinstance(liger, str):
        print(f"  Liger MLP: missing ({liger})")
    else:
        layers["Liger MLP"] = copy.deepcopy(layer)
        layers["Liger MLP"].mlp = liger
        logging.getLogger("torch._dynamo").addFilter(_drop_kernel_analysis_tracebacks)
    compiled = {name: copy.deepcopy(mod) for name, mod in layers.items()}
    if traced:
        compiled["fused MLP traced"] = compiled.pop("fused MLP")
        compiled["fused MLP traced"].mlp.compiled_training = "traced"
    return {f"{name} eager": mod for name, mod in layers.items()} | {
        f"{name} compiled": torch.compile(mod, backend=backend) for name, mod in compiled.items()
    }


def step_fn(module, x, position_embeddings, dy):
    def step() -> None:
        out = module(x, position_embeddings=position_embeddings)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dy)

    return step


def through_triton(step):
    """``step`` with the library's kernels launched through Triton's JIT path."""

    def run() -> None:
        launch.DIRECT = False
        try:
            step()
        finally:
            launch.DIRECT = True

    return run


def grads(module, x) -> dict[str, torch.Tensor]:
    """The input's gradient and every parameter's, named as in transformers' layer: the fused MLP's
    packed gate/up gradient is unpacked into ``mlp.gate_proj.weight`` and ``mlp.up_proj.weight``."""
    module = getattr(module, "_orig_mod", module)  # under torch.compile
    named = {"input": x.grad} | {n: p.grad for n, p in module.named_parameters()}
    if "mlp.gate_up_proj" in named:
        named["mlp.gate_proj.weight"], named["mlp.up_proj.weight"] = unpack_gate_up(
            named.pop("mlp.gate_up_proj")
        )
    return named


def max_relative_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest relative difference (by norm) between same-named gradients; every name must match."""
    if got.keys() != want.keys():
        raise RuntimeError(f"gradients differ in names: {sorted(got.keys() ^ want.keys())}")
    return max(((got[n].float() - want[n].float()).norm() / want[n].float().norm()).item() for n in want)


def run_shape(
    name: str,
    m_hidden_inter,
    batch: int,
    seq: int,
    reps: int,
    triton_launch: bool = False,
    traced: bool = False,
) -> dict:
    _, hidden, inter = m_hidden_inter
    heads, kv_heads = HEADS[name]
    factory = {"device": "cuda", "dtype": torch.bfloat16}
    torch.manual_seed(0)
    layer, rotary = decoder_layer(hidden, inter, heads, kv_heads, seq, **factory)
    x = torch.randn(batch, seq, hidden, requires_grad=True, **factory)
    dy = torch.randn(batch, seq, hidden, **factory)
    position_ids = torch.arange(seq, device="cuda").expand(batch, seq)
    pos = rotary(x, position_ids)
    mods = variants(layer, traced=traced)
    steps = {v: step_fn(mod, x, pos, dy) for v, mod in mods.items()}
    if triton_launch and launch.DIRECT:
        for v in ("fused MLP eager", "fused MLP compiled"):
            mods[f"{v}, Triton launch"] = mods[v]
            steps[f"{v}, Triton launch"] = through_triton(steps[v])
    leaves = lambda mod: [x, *mod.parameters()]  # noqa: E731

    first, diffs, peaks, reference = {}, {}, {}, None
    for v, step in steps.items():
        for leaf in leaves(mods[v]):
            leaf.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first[v] = time.perf_counter() - start
        got = grads(mods[v], x)
        if reference is None:  # the first variant, transformers' eager layer
            reference = got
        diffs[v] = max_relative_difference(got, reference)
        for leaf in leaves(mods[v]):
            leaf.grad = None
        peaks[v] = peak_mib(step)
        print(f"  {v}: first call {first[v]:.2f} s, gradients vs eager {diffs[v]:.1e}", flush=True)
    times: dict[str, list[float]] = {v: [] for v in steps}
    order = list(steps)
    for rep in range(reps):
        for v in order[rep % len(order) :] + order[: rep % len(order)]:
            times[v].append(median_ms(steps[v], warmup=10, rep=200, grad_to_none=leaves(mods[v])))
    ms = {v: statistics.median(t) for v, t in times.items()}
    base = ms["transformers compiled"]
    print(f"\n== {name} layer: batch {batch} x seq {seq}, hidden {hidden}, intermediate {inter}")
    print(f"  {'variant':<22} {'fwd+bwd ms':>10} {'vs compiled':>11} {'peak MiB':>9} {'first s':>8}")
    for v in steps:
        print(f"  {v:<22} {ms[v]:10.3f} {ms[v] / base:11.3f} {peaks[v]:9.0f} {first[v]:8.2f}")
    return {
        "shape": name,
        "batch": batch,
        "seq": seq,
        "step_ms": ms,
        "peak_mib": peaks,
        "first_call_s": first,
        "grad_rel_diff": diffs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama3-8b"], choices=sorted(HEADS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="layer.json")
    ap.add_argument("--traced", action="store_true", help="compile the fused layer with traced training")
    ap.add_argument("--triton-launch", action="store_true", help="also the fused layers via Triton launches")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    args = ap.parse_args()
    meta = start_gpu_log(args.commit, "layer_step needs a CUDA GPU")
    if meta is None:
        return 1
    rows = []
    for name in args.shapes:
        rows.append(
            run_shape(
                name,
                SHAPES[name],
                args.batch,
                args.seq,
                args.reps,
                triton_launch=args.triton_launch,
                traced=args.traced,
            )
        )
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
