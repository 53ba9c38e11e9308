"""What every public entry point does with bad and edge input: either the float64 reference's result
within the accuracy rule, with its inputs (and ``grad_output``) left as they were, or an error of the
library's that names the problem. Nothing silently wrong.

Each case is one row with a readable id; ``test_fuzz_against_the_reference`` then draws shapes,
strides, dtypes, multipliers and save modes at random.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shapes import MULTIPLIER_VALUES
from torch import nn

from fused_swiglu import (
    SwiGLULinear,
    SwiGLUMLP,
    fused_path_available,
    pack_gate_up,
    swap_swiglu_mlps,
    swiglu_linear,
    swiglu_mlp,
    unpack_gate_up,
)
from fused_swiglu.cli import main
from fused_swiglu.reference import reference_swiglu_mlp_packed, reference_swiglu_packed
from fused_swiglu.testing import relative_error, unit_roundoff

HIDDEN, INTER = 16, 32


def tensors(dtype=torch.float32, rows=4, hidden=HIDDEN, inter=INTER, device="cpu"):
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    return (
        randn(rows, hidden),
        randn(2 * inter, hidden, scale=hidden**-0.5),
        randn(hidden, inter, scale=inter**-0.5),
    )


@dataclass
class Raises:
    error: type[Exception]
    match: str


def within_rule(got: torch.Tensor | list, reference: Callable, inputs: tuple | list) -> None:
    """``got`` against the float64 reference on ``inputs``, within 2x eager's own error (the same
    reference computed in the inputs' dtype) plus the unit roundoff. ``got`` and ``inputs`` may be
    lists of several problems' results and inputs, judged side by side: a result of a few elements
    alone is decided by the rounding of single elements, in either implementation."""
    gots, problems = (got, inputs) if isinstance(got, list) else ([got], [inputs])
    oracles = [reference(*(t.double() for t in p)) for p in problems]
    for result, oracle, p in zip(gots, oracles, problems, strict=True):
        assert result.dtype == p[0].dtype and result.shape == oracle.shape
    oracle = torch.cat([o.flatten() for o in oracles])
    eager = torch.cat([reference(*p).flatten() for p in problems])
    bound = 2 * relative_error(eager, oracle) + unit_roundoff(problems[0][0].dtype)
    assert relative_error(torch.cat([g.flatten() for g in gots]), oracle) <= bound


def mlp_reference(gm=1.0, dm=1.0):
    return lambda x, w, wd: reference_swiglu_mlp_packed(x, w, wd, gate_multiplier=gm, down_multiplier=dm)


def glu_reference(gm=1.0):
    return lambda x, w: reference_swiglu_packed(x, w, gate_multiplier=gm)


# Calls expected to raise: (id, call, error, what the message must name) -------------------------------

x, w, wd = tensors()


def _module_with_half_state_dict():
    module = SwiGLUMLP(HIDDEN, INTER)
    state = module.state_dict()
    del state["up_proj.weight"]
    return module.load_state_dict(state)


def _module_with_wrong_half():
    module = SwiGLUMLP(HIDDEN, INTER)
    state = module.state_dict()
    state["up_proj.weight"] = torch.randn(INTER - 8, HIDDEN)
    return module.load_state_dict(state)


class GeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = (
            nn.Linear(HIDDEN, INTER, bias=False),
            nn.Linear(HIDDEN, INTER, bias=False),
        )
        self.down_proj, self.act_fn = nn.Linear(INTER, HIDDEN, bias=False), nn.GELU()


class BiasMLP(GeluMLP):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.act_fn = nn.Linear(HIDDEN, INTER, bias=True), nn.SiLU()


RAISES = [
    # swiglu_mlp: types, dtypes, devices, layouts
    ("mlp-dtype-mismatch", lambda: swiglu_mlp(x.half(), w, wd), Raises(TypeError, "share a dtype")),
    ("mlp-integer-x", lambda: swiglu_mlp(x.long(), w.long(), wd.long()), Raises(TypeError, "floating")),
    ("mlp-complex-x", lambda: swiglu_mlp(x.cfloat(), w.cfloat(), wd.cfloat()), Raises(TypeError, "floating")),
    ("mlp-device-mismatch", lambda: swiglu_mlp(x, w.to("meta"), wd), Raises(ValueError, "one device")),
    ("mlp-not-a-tensor", lambda: swiglu_mlp(x, w, wd.numpy()), Raises(TypeError, "down_weight")),
    ("mlp-sparse-x", lambda: swiglu_mlp(x.to_sparse(), w, wd), Raises(TypeError, "dense")),
    # shapes
    ("mlp-0d-x", lambda: swiglu_mlp(torch.tensor(1.0), w, wd), Raises(ValueError, "expected x")),
    ("mlp-hidden-mismatch", lambda: swiglu_mlp(x[:, :8], w, wd), Raises(ValueError, "hidden size")),
    ("mlp-packed-odd-rows", lambda: swiglu_mlp(x, w[:-1], wd), Raises(ValueError, "even first dim")),
    (
        "mlp-packed-3d",
        lambda: swiglu_mlp(x, w.reshape(2, INTER, HIDDEN), wd),
        Raises(ValueError, "expected x"),
    ),
    ("mlp-down-shape", lambda: swiglu_mlp(x, w, wd[:, :24]), Raises(ValueError, "down weight")),
    ("mlp-zero-hidden", lambda: swiglu_mlp(x[:, :0], w[:, :0], wd[:0]), Raises(ValueError, "hidden size")),
    ("mlp-inter-not-8", lambda: swiglu_mlp(x, w[:24], wd[:, :12]), Raises(ValueError, "multiple of 8")),
    ("mlp-one-weight-pair", lambda: swiglu_mlp(x, (w,), wd), Raises(ValueError, "pair")),
    (
        "mlp-pair-shapes",
        lambda: swiglu_mlp(x, (w[:INTER], w[: INTER - 8]), wd),
        Raises(ValueError, "equal shape"),
    ),
    (
        "mlp-pair-dtypes",
        lambda: swiglu_mlp(x, (w[:INTER], w[INTER:].half()), wd),
        Raises(TypeError, "share a dtype"),
    ),
    # options
    ("mlp-save-unknown", lambda: swiglu_mlp(x, w, wd, save="all"), Raises(ValueError, "save must be")),
    ("mlp-multiplier-str", lambda: swiglu_mlp(x, w, wd, gate_multiplier="2"), Raises(TypeError, "gate_mult")),
    (
        "mlp-multiplier-bool",
        lambda: swiglu_mlp(x, w, wd, down_multiplier=True),
        Raises(TypeError, "down_mult"),
    ),
    (
        "mlp-multiplier-nan",
        lambda: swiglu_mlp(x, w, wd, gate_multiplier=float("nan")),
        Raises(ValueError, "finite"),
    ),
    (
        "mlp-multiplier-inf",
        lambda: swiglu_mlp(x, w, wd, down_multiplier=float("inf")),
        Raises(ValueError, "finite"),
    ),
    (
        "mlp-unknown-option",
        lambda: swiglu_mlp(x, w, wd, compiled_training="traced"),
        Raises(TypeError, "compiled_training"),
    ),
    # swiglu_linear
    ("glu-save-preact", lambda: swiglu_linear(x, w, save="preact"), Raises(ValueError, "save must be")),
    ("glu-hidden-mismatch", lambda: swiglu_linear(x[:, :8], w), Raises(ValueError, "hidden size")),
    ("glu-not-a-tensor", lambda: swiglu_linear(x.tolist(), w), Raises(TypeError, "x must be")),
    # layout
    ("pack-not-a-tensor", lambda: pack_gate_up([1.0], [2.0]), Raises(TypeError, "gate weight")),
    ("pack-1d", lambda: pack_gate_up(w[0], w[1]), Raises(ValueError, "2-D")),
    ("pack-inter-not-8", lambda: pack_gate_up(w[:12], w[12:24]), Raises(ValueError, "multiple of 8")),
    ("pack-device", lambda: pack_gate_up(w[:INTER], w[INTER:].to("meta")), Raises(ValueError, "device")),
    ("unpack-1d", lambda: unpack_gate_up(w[0]), Raises(ValueError, "2-D")),
    ("unpack-odd-width", lambda: unpack_gate_up(w[:24]), Raises(ValueError, "multiple of 16")),
    # modules
    ("module-size-str", lambda: SwiGLUMLP("16", INTER), Raises(TypeError, "hidden_size must be an int")),
    (
        "module-size-bool",
        lambda: SwiGLUMLP(HIDDEN, True),
        Raises(TypeError, "intermediate_size must be an int"),
    ),
    (
        "module-size-negative",
        lambda: SwiGLUMLP(-16, INTER),
        Raises(ValueError, "hidden_size must be positive"),
    ),
    ("module-size-zero", lambda: SwiGLULinear(0, INTER), Raises(ValueError, "hidden_size must be positive")),
    ("module-inter-not-8", lambda: SwiGLUMLP(HIDDEN, 12), Raises(ValueError, "multiple of 8")),
    ("module-save-unknown", lambda: SwiGLUMLP(HIDDEN, INTER, save="x"), Raises(ValueError, "save must be")),
    (
        "module-glu-save-preact",
        lambda: SwiGLULinear(HIDDEN, INTER, save="preact"),
        Raises(ValueError, "save must be"),
    ),
    (
        "module-input-hidden",
        lambda: SwiGLUMLP(HIDDEN, INTER)(torch.randn(3, 8)),
        Raises(ValueError, "hidden size"),
    ),
    ("state-dict-half-missing", _module_with_half_state_dict, Raises(RuntimeError, '"up_proj.weight"')),
    ("state-dict-half-wrong-shape", _module_with_wrong_half, Raises(ValueError, "equal shape")),
    (
        "from-mlp-not-an-mlp",
        lambda: SwiGLUMLP.from_mlp(nn.Linear(HIDDEN, INTER)),
        Raises(TypeError, "gate_proj"),
    ),
    ("from-mlp-gelu", lambda: SwiGLUMLP.from_mlp(GeluMLP()), Raises(ValueError, "GELU")),
    ("from-mlp-bias", lambda: SwiGLUMLP.from_mlp(BiasMLP()), Raises(ValueError, "biases")),
    # the swap
    ("swap-not-a-module", lambda: swap_swiglu_mlps("model"), Raises(TypeError, "nn.Module")),
    (
        "swap-save-unknown",
        lambda: swap_swiglu_mlps(nn.Sequential(), save="x"),
        Raises(ValueError, "save must be"),
    ),
    ("fused-path-not-a-tensor", lambda: fused_path_available([1.0], w), Raises(TypeError, "x must be")),
    # the command line: argparse refuses with exit status 2 and a usage message naming the option
    ("cli-unknown-command", lambda: main(["train"]), Raises(SystemExit, "2")),
    ("cli-check-dtype", lambda: main(["check", "--dtype", "fp64"]), Raises(SystemExit, "2")),
    ("cli-check-shape-count", lambda: main(["check", "--shape", "8", "16"]), Raises(SystemExit, "2")),
    ("cli-bench-impl", lambda: main(["bench", "--impls", "cublas"]), Raises(SystemExit, "2")),
    (
        "cli-bench-model-size-count",
        lambda: main(["bench", "--model-size", "64", "128"]),
        Raises(SystemExit, "2"),
    ),
    ("cli-bench-variant", lambda: main(["bench", "--model", "--variants", "fast"]), Raises(SystemExit, "2")),
    ("cli-bench-windows-zero", lambda: main(["bench", "--model", "--windows", "0"]), Raises(SystemExit, "2")),
    ("cli-bench-reps-negative", lambda: main(["bench", "--reps", "-1"]), Raises(SystemExit, "2")),
]


def test_cli_refuses_too_few_processes_at_once_for_the_stock_variants(capsys):
    args = ["bench", "--model-size", "64", "128", "1", "32", "--device", "cpu", "--at-once", "1"]
    assert main([*args, "--variants", "stock-compiled", "fused-compiled"]) == 2
    assert "no room beside stock-compiled" in capsys.readouterr().out


def test_cli_refuses_a_glu_shape_of_the_wrong_length(capsys):
    if torch.cuda.is_available():
        assert main(["bench", "--shapes", "--glu", "1", "2"]) == 2
        assert "three integers" in capsys.readouterr().out
    else:  # without a GPU, bench says so first
        assert main(["bench", "--shapes", "--glu", "1", "2"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("call, expected", [pytest.param(c, e, id=i) for i, c, e in RAISES])
def test_bad_input_raises_an_error_that_names_it(call, expected):
    with pytest.raises(expected.error, match=expected.match):
        call()


def test_a_present_half_of_a_state_dict_loads_without_strict():
    module, source = SwiGLUMLP(HIDDEN, INTER), SwiGLUMLP(HIDDEN, INTER)
    up_before = unpack_gate_up(module.gate_up_proj.detach())[1].clone()
    state = source.state_dict()
    del state["up_proj.weight"]
    result = module.load_state_dict(state, strict=False)
    assert result.missing_keys == ["up_proj.weight"] and result.unexpected_keys == []
    gate, up = unpack_gate_up(module.gate_up_proj.detach())
    assert torch.equal(gate, state["gate_proj.weight"]) and torch.equal(up, up_before)


# Calls expected to give the reference's result ------------------------------------------------------

x16, w16, wd16 = tensors(torch.float16)
xb, wb, wdb = tensors(torch.bfloat16)
x64, w64, wd64 = tensors(torch.float64)
x_odd, w_odd, wd_odd = tensors(hidden=12, inter=40)  # fp16 rows of 24 bytes: not 16-byte aligned

RESULTS = [
    ("mlp-fp32", (x, w, wd), {}, mlp_reference()),
    ("mlp-fp16", (x16, w16, wd16), {}, mlp_reference()),
    ("mlp-bf16-on-cpu-takes-the-reference", (xb, wb, wdb), {}, mlp_reference()),
    ("mlp-fp64", (x64, w64, wd64), {}, mlp_reference()),
    (
        "mlp-multipliers",
        (x, w, wd),
        {"gate_multiplier": -0.5, "down_multiplier": 3.0},
        mlp_reference(-0.5, 3.0),
    ),
    (
        "mlp-zero-multipliers",
        (x, w, wd),
        {"gate_multiplier": 0.0, "down_multiplier": 0.0},
        mlp_reference(0.0, 0.0),
    ),
    ("mlp-transposed-x", (torch.randn(HIDDEN, 5).t(), w, wd), {}, mlp_reference()),
    ("mlp-expanded-x", (torch.randn(1, HIDDEN).expand(6, HIDDEN), w, wd), {}, mlp_reference()),
    ("mlp-transposed-weights", (x, w.t().contiguous().t(), wd.t().contiguous().t()), {}, mlp_reference()),
    ("mlp-unaligned-rows", (x_odd.half(), w_odd.half(), wd_odd.half()), {}, mlp_reference()),
    ("mlp-one-row", (x[:1], w, wd), {}, mlp_reference()),
]


@pytest.mark.parametrize("args, kwargs, reference", [pytest.param(a, k, r, id=i) for i, a, k, r in RESULTS])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "train"])
def test_edge_input_gives_the_reference_result(args, kwargs, reference, grad, device):
    args = tuple(t.to(device) for t in args)
    before = [t.clone() for t in args]
    leaves = [t.detach().requires_grad_(grad) for t in args]
    y = swiglu_mlp(*leaves, **kwargs)
    within_rule(y.detach(), reference, tuple(args))
    if grad:
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
        dy_before = dy.clone()
        y.backward(dy)
        assert torch.equal(dy, dy_before)
        oracle_leaves = [t.detach().double().requires_grad_() for t in args]
        reference(*oracle_leaves).backward(dy.double())
        eager_leaves = [t.detach().requires_grad_() for t in args]
        reference(*eager_leaves).backward(dy)
        for got, want, eager in zip(leaves, oracle_leaves, eager_leaves, strict=True):
            bound = 2 * relative_error(eager.grad, want.grad) + unit_roundoff(got.dtype)
            assert relative_error(got.grad, want.grad) <= bound
    for t, b in zip(args, before, strict=True):
        assert torch.equal(t, b)


def test_empty_batch_gives_an_empty_result_and_gradients():
    rows = x[:0].clone().requires_grad_()
    y = swiglu_mlp(rows, w, wd)
    assert y.shape == (0, HIDDEN)
    y.sum().backward()
    assert rows.grad.shape == (0, HIDDEN)
    assert swiglu_linear(x[:0], w).shape == (0, INTER)


def test_meta_tensors_give_meta_results():
    """Shape inference on the meta device (e.g. a model built before its weights exist)."""
    meta = [t.to("meta") for t in (x, w, wd)]
    assert swiglu_mlp(*meta).shape == (4, HIDDEN) and swiglu_mlp(*meta).device.type == "meta"
    assert SwiGLUMLP(HIDDEN, INTER, device="meta")(meta[0]).shape == (4, HIDDEN)


def test_glu_edge_inputs_give_the_reference_result(device):
    for args in [(x, w), (x16, w16), (xb, wb), (torch.randn(HIDDEN, 5).t(), w)]:
        args = tuple(t.to(device) for t in args)
        within_rule(swiglu_linear(*args, gate_multiplier=0.5), glu_reference(0.5), args)


# Fuzz -----------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(0, 40),
    hidden=st.sampled_from([8, 12, 16, 24, 40]),
    inter=st.sampled_from([8, 16, 24, 40]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    gm=MULTIPLIER_VALUES,
    dm=MULTIPLIER_VALUES,
    save=st.sampled_from(["factors", "preact", "recompute"]),
    transposed=st.booleans(),
    lead=st.sampled_from([(), (1,), (2,)]),
)
def test_fuzz_against_the_reference(rows, hidden, inter, dtype, gm, dm, save, transposed, lead):
    gen = torch.Generator().manual_seed(rows * 131 + hidden)
    results, problems = [], []
    for _ in range(3):  # independent problems of this shape, judged side by side (within_rule)
        x = torch.randn(*lead, rows, hidden, generator=gen).to(dtype)
        if transposed:
            x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
        w = (torch.randn(2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
        wd = (torch.randn(hidden, inter, generator=gen) * inter**-0.5).to(dtype)
        leaves = [t.detach().requires_grad_() for t in (x, w, wd)]
        y = swiglu_mlp(*leaves, gate_multiplier=gm, down_multiplier=dm, save=save)
        results.append(y.detach().reshape(-1, hidden))
        problems.append((x.reshape(-1, hidden), w, wd))
        y.backward(torch.ones_like(y))
        assert all(torch.isfinite(t.grad).all() for t in leaves)
    within_rule(results, mlp_reference(gm, dm), problems)
