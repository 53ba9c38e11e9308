"""The FP8 path (fused_swiglu.fp8): the quantizers against format.py's reference, bit for bit
(amax / 448 scales, groups of zeros, saturation, NaN and Inf, the transposed stores, the padding
rows); the passes between the GEMMs against reference.py; the scaled GEMM against the fp32 product
of its dequantized operands; the MLP's output and gradients against the recipe in PyTorch and
against float64, on Gaussian inputs and with outlier channels; autocast, compile, the module, the
swap and the errors. On CPU the kernels run under the Triton interpreter (the GEMMs emulated), on a
GPU as they run for users (cuBLAS's blockwise-scaled GEMMs)."""

import copy
import math

import pytest
import torch

import fused_swiglu
from fused_swiglu import SwiGLUMLP, swap_swiglu_mlps, swiglu_mlp
from fused_swiglu.fp8 import kernels, torchao_filter
from fused_swiglu.fp8 import reference as fp8_reference
from fused_swiglu.fp8.format import (
    E4M3_MAX,
    GROUP,
    MIN_AMAX,
    Fp8,
    dequantize,
    group_scale,
    halves_width,
    mm,
    pack_halves,
    padded_rows,
    quantize_blocks,
    quantize_rows,
    reduction_width,
    unpack_halves,
    uses_cublas,
)
from fused_swiglu.testing import relative_error, unit_roundoff

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (M, hidden, intermediate): ragged token counts, sizes multiples of the group.
SHAPES = [
    pytest.param((1, 128, 128), id="M1-H128-I128"),
    pytest.param((200, 256, 384), id="M200-H256-I384"),
    pytest.param((256, 384, 256), id="M256-H384-I256"),
]
GPU_SHAPES = [pytest.param((1000, 1024, 2816), id="M1000-H1024-I2816")]


def _gpu_only(device):
    if device.type != "cuda":
        pytest.skip("needs a CUDA device")


def _codes(t: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes, -0 (0x80) read as 0: the sign of a zero product is not part of the contract."""
    codes = t.view(torch.uint8)
    return torch.where(codes == 0x80, 0, codes)


def assert_same_fp8(got: Fp8, want: Fp8, exact: bool = True) -> None:
    """Equal bytes and scales; with ``exact=False`` (passes that compute what they quantize, whose
    SiLU may differ from PyTorch's in the last bit, and a group's amax / 448 scale with it), codes
    at most one step apart in at most 1 in 1000 elements and scales within 2^-18 of each other."""
    assert got.data.shape == want.data.shape and got.scales.shape == want.scales.shape
    if exact:
        assert torch.equal(_codes(got.data), _codes(want.data))
        assert torch.equal(got.scales.nan_to_num(nan=-1.0), want.scales.nan_to_num(nan=-1.0))
        return
    steps = (_codes(got.data).int() - _codes(want.data).int()).abs()
    assert steps.max() <= 1 and (steps > 0).float().mean() <= 1e-3
    assert torch.allclose(got.scales, want.scales, rtol=2.0**-18, atol=0)


# The format ---------------------------------------------------------------------------------------------


def test_a_groups_largest_magnitude_becomes_448_exactly():
    amax = torch.tensor([448.0, 1.0, 3.0, 1e-3, 7e5, 0.0, 1e-45, float("inf")])
    scale, inverse = group_scale(amax)
    assert scale[0] == 1 and scale[1] == torch.tensor(1 / 448) and inverse[:2].tolist() == [1.0, 448.0]
    assert scale[5] == inverse[5] == 1  # a group of zeros
    assert scale[6] == 2.0**-126 and inverse[6] == 2.0**126  # tiny amax: clamped at MIN_AMAX, no overflow
    assert MIN_AMAX / scale[6] == E4M3_MAX
    assert scale[7] == float("inf") and inverse[7] == 0  # inf: every product it reaches is NaN
    finite = amax[:5]
    scaled = finite * inverse[:5]
    assert torch.equal(scaled.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float(), torch.full((5,), E4M3_MAX))
    assert torch.allclose(scale[:5] * E4M3_MAX, finite, rtol=2**-23, atol=0)


def test_reference_quantizers_round_to_nearest_even_within_a_group():
    t = torch.randn(3, 300) * torch.logspace(-4, 4, 300)
    q = quantize_rows(t)
    assert q.scales.shape == (3, 3)  # [groups, rows]
    back = dequantize(q)
    per_element = q.scales.t().repeat_interleave(GROUP, 1)[:, :300]
    # e4m3 keeps 3 mantissa bits: within half a step (2^-4 relative) of normal values, and fp32 rounding.
    normal = t.abs() >= 2.0**-6 * per_element
    assert ((back - t).abs()[normal] <= t.abs()[normal] * (2.0**-4 + 2.0**-20)).all()
    # Each group's largest magnitude is 448 exactly.
    codes = q.data.float().abs().view(3, -1)
    for group in range(3):
        assert codes[:, group * GROUP : (group + 1) * GROUP].amax(1).eq(E4M3_MAX).all()


# The kernels against the reference, bit for bit ---------------------------------------------------------


def _awkward(m: int, f: int, dtype, device) -> torch.Tensor:
    """Gaussian rows spanning eight decades, with a row of zeros, a NaN, an Inf, a subnormal and a
    group of NaN only (scale 1, as a group of zeros)."""
    t = torch.randn(m, f) * torch.logspace(-4, 4, f)
    if m > 13:
        t[9] = 0
        t[5, 7], t[11, 3], t[12, 4] = float("nan"), float("inf"), 1e-40
        t[13, :GROUP] = float("nan")
    return t.to(device=device, dtype=dtype)


@pytest.mark.parametrize("precision", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 200, 256])
def test_activation_quantizer_matches_the_reference(device, precision, m):
    x = _awkward(m, 384, precision, device)
    rows, width = padded_rows(m), reduction_width(384)
    got, got_t = kernels.quantize_activation(x, rows, transposed=True, width=width)
    assert_same_fp8(got, quantize_rows(x, rows, width))
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, rows - m))
    assert_same_fp8(got_t, quantize_rows(padded.t()))
    assert (_codes(got.data[m:]) == 0).all() and (got.scales[:, m:] == 1).all()  # padding rows: zeros
    assert width == 512 and (_codes(got.data[:, 384:]) == 0).all() and (got.scales[3:] == 1).all()
    if m > 13:  # the group of NaN only: NaN codes, scale 1
        assert (_codes(got.data[13, :GROUP]) & 0x7F == 0x7F).all() and got.scales[0, 13] == 1
    got_rows_only, none = kernels.quantize_activation(x, rows, transposed=False, width=width)
    assert none is None
    assert_same_fp8(got_rows_only, got)


@pytest.mark.parametrize("precision", DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["as-is", "transposed"])
@pytest.mark.parametrize("halves", [False, True], ids=["plain", "gate-up-in-halves"])
def test_weight_quantizer_matches_the_reference(device, precision, transposed, halves):
    w = (torch.randn(400, 256) * 0.02).to(device=device, dtype=precision)  # I = 200: a group half past I
    w[:128, :128] = 0  # a block of zeros (in halves too: rows 0-127 are intermediate columns 0-63)
    w[200, 17] = 1e4  # one block scaled for its outlier
    got = kernels.quantize_weight(w, transposed, halves)
    ordered = fp8_reference.gate_up_in_halves(w) if halves else w
    assert ordered.shape[0] == (512 if halves else 400)
    oriented = ordered.t() if transposed else ordered
    width = reduction_width(oriented.shape[1])  # zero columns up to 4 groups (format.py)
    assert_same_fp8(got, quantize_blocks(oriented, width))
    assert got.data.shape[1] == width == 512 and (_codes(got.data[:, oriented.shape[1] :]) == 0).all()
    if not transposed:
        assert got.scales[0, 0] == 1 and (_codes(got.data[:128, :128]) == 0).all()


def test_halves_are_the_packing_regrouped():
    gate, up = torch.randn(200, 3), torch.randn(200, 3)
    w = fused_swiglu.pack_gate_up(gate, up)
    halves = fp8_reference.gate_up_in_halves(w)
    assert halves.shape == (halves_width(200), 3) == (512, 3)
    assert torch.equal(halves[:64], up[:64]) and torch.equal(halves[64:128], gate[:64])
    assert torch.equal(halves[384:392], up[192:]) and torch.equal(halves[448:456], gate[192:])
    assert (halves[392:448] == 0).all() and (halves[456:] == 0).all()
    assert all(
        torch.equal(a, b) for a, b in zip(unpack_halves(halves.t(), 200), (up.t(), gate.t()), strict=True)
    )


def test_nan_and_inf_reach_every_output_they_touch(device):
    x = torch.randn(130, 256, device=device)
    x[3, 5] = float("nan")
    x[7, 200] = float("inf")
    q, q_t = kernels.quantize_activation(x, padded_rows(130), transposed=True, width=512)
    w = quantize_blocks(torch.randn(256, 256, device=device), 512)
    y = mm(q, w, torch.float32)
    assert not torch.isfinite(y[[3, 7]]).any()  # the inf's group: an inf scale
    others = torch.ones(256, dtype=torch.bool)
    others[[3, 7]] = False
    assert torch.isfinite(y[:130][others[:130]]).all()
    back = dequantize(q_t)
    assert back[5, 3].isnan() and not torch.isfinite(back[200, :128]).any()


@pytest.mark.parametrize("precision", DTYPES, ids=str)
@pytest.mark.parametrize("kept", [0, 1, 2], ids=["inference", "factors", "preact"])
@pytest.mark.parametrize("inter", [384, 200], ids=["I384", "I200"])  # 200: the last group part padding
def test_glu_passes_match_the_reference(device, precision, kept, inter):
    mp = 256
    up, gate = torch.randn(mp, inter) * 2, torch.randn(mp, inter) * 2
    h = pack_halves(up, gate).to(device=device, dtype=precision)  # zeros past I, as the GEMM makes them
    a, a_t, saved = kernels.glu_forward(h, inter, kept, 0.7, 1.3)
    want_a, want_a_t, want_saved = fp8_reference.glu_forward(h, inter, kept, 0.7, 1.3)
    assert_same_fp8(a, want_a, exact=False)
    if not kept:
        assert a_t is None and saved is None
        return
    assert_same_fp8(saved, want_saved, exact=False)
    preact = kept == 2  # a^T comes from the backward's pass
    if preact:
        assert a_t is None and want_a_t is None
    else:
        assert_same_fp8(a_t, want_a_t, exact=False)
    da = torch.randn(mp, inter, device=device).to(precision)
    grad, grad_t, back_a_t = kernels.glu_backward(
        da, saved, kept, 0.7, 1.3, rows=True, transposed=True, a_t=preact
    )
    want_grad, want_grad_t, want_back_a_t = fp8_reference.glu_backward(da, saved, kept, 0.7, 1.3)
    assert_same_fp8(grad, want_grad, exact=False)
    assert_same_fp8(grad_t, want_grad_t, exact=False)
    if preact:
        assert_same_fp8(back_a_t, want_back_a_t, exact=False)
        # From the FP8 pre-activations: a^T within a step or two of e4m3 of the forward's own.
        forward_a_t = fp8_reference.glu_forward(h, inter, 1, 0.7, 1.3)[1]
        assert relative_error(dequantize(back_a_t), dequantize(forward_a_t)) < 0.1
    else:
        assert back_a_t is None and want_back_a_t is None
    only_t = kernels.glu_backward(da, saved, kept, 0.7, 1.3, rows=False, transposed=True)
    assert only_t[0] is None and only_t[2] is None
    assert_same_fp8(only_t[1], grad_t)
    if preact:  # a^T alone: neither gradient asked
        only_a_t = kernels.glu_backward(da, saved, kept, 0.7, 1.3, rows=False, transposed=False, a_t=True)
        assert only_a_t[:2] == (None, None)
        assert_same_fp8(only_a_t[2], back_a_t)
    else:
        with pytest.raises(ValueError, match="pre-activations"):
            kernels.glu_backward(da, saved, kept, 0.7, 1.3, rows=False, transposed=False, a_t=True)


@pytest.mark.parametrize("kept", [0, 1, 2], ids=["inference", "factors", "preact"])
@pytest.mark.parametrize(("groups", "stages"), [(5, 2), (12, 3)])
def test_glu_passes_in_a_loop_are_the_same_passes(device, kept, groups, stages):
    """A program making several groups one after another, loads ahead (configs.fp8_forward_pass and
    fp8_gradient_pass), stores exactly what one group a program does; 12 groups of a, 20 of the
    gradient's rows and 19 of its transpose in programs of 5 or 12: ragged last ones."""
    mp, inter = 128, 1200
    h = pack_halves(torch.randn(mp, inter) * 2, torch.randn(mp, inter) * 2).to(device=device)
    one = kernels.glu_forward(h, inter, kept, 0.7, 1.3, groups=1, stages=1)
    looped = kernels.glu_forward(h, inter, kept, 0.7, 1.3, groups=groups, stages=stages)
    if kept:
        da = torch.randn(mp, inter, device=device)
        for rows, transposed in ((True, True), (False, True)):
            flags = {"rows": rows, "transposed": transposed, "a_t": kept == 2}
            one += kernels.glu_backward(da, one[2], kept, 0.7, 1.3, **flags, groups=1, stages=1)
            looped += kernels.glu_backward(da, one[2], kept, 0.7, 1.3, **flags, groups=groups, stages=stages)
    for got, want in zip(looped, one, strict=True):
        if want is None:
            assert got is None
        else:
            assert_same_fp8(got, want)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("rows", "cols"), [(256, 512), (200, 384), (129, 136)])
def test_dequantize_pass_is_the_format_values(device, out_dtype, rows, cols):
    """Rows [Mp, W] in one pass to ``out_dtype``, cut to [rows, cols]: the format's fp32 values
    rounded once; a NaN and an infinite group come through."""
    x = torch.randn(256, 512, device=device) * torch.logspace(-3, 3, 512, device=device)
    x[5, 7], x[9, 300] = float("nan"), float("inf")
    q = quantize_rows(x, width=512)
    got = kernels.dequantize(q, rows, cols, out_dtype)
    want = dequantize(q)[:rows, :cols].to(out_dtype)
    assert got.dtype == out_dtype and got.shape == (rows, cols)
    assert torch.equal(got.nan_to_num(nan=7.0), want.nan_to_num(nan=7.0)) and got[5, 7].isnan()
    with pytest.raises(ValueError, match="dequantize"):
        kernels.dequantize(q, 257, cols, out_dtype)


@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "rows"])
@pytest.mark.parametrize("k", [384, 512, 896])
def test_scaled_gemm_is_the_product_of_its_dequantized_operands(device, blocks, k):
    width = reduction_width(k)  # a GEMM with blocks reads K padded with zeros
    a = quantize_rows(torch.randn(256, k, device=device), width=width)
    w = torch.randn(384, k, device=device)
    b = quantize_blocks(w, width) if blocks else quantize_rows(w, width=width)
    want = dequantize(a).double() @ dequantize(b).double().t()
    # Hopper's FP8 tensor cores sum a group's products in about 14 bits before cuBLAS promotes them to
    # fp32 (measured 1.3e-4 relative on an H100 with either kind of scale); the emulation sums in fp32.
    accumulation = 2.0**-12 if uses_cublas(a.data.device) else 1e-6
    for out_dtype in (torch.float32, torch.bfloat16):
        got = mm(a, b, out_dtype)
        assert got.dtype == out_dtype
        assert relative_error(got, want) <= 2 * unit_roundoff(out_dtype) + accumulation


# The MLP ----------------------------------------------------------------------------------------------------


def _problem(shape, dtype, device, outliers: float = 1.0):
    m, hidden, inter = shape
    x = torch.randn(m, hidden)
    if outliers != 1.0:
        x[:, torch.randperm(hidden)[:4]] *= outliers  # a few outlier channels, as LLM activations have
    w_gate_up = torch.randn(2 * inter, hidden) * hidden**-0.5
    w_down = torch.randn(hidden, inter) * inter**-0.5
    dy = torch.randn(m, hidden)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, w_gate_up, w_down, dy))


def _fused_step(x, w_gate_up, w_down, dy, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_gate_up, w_down)]
    y = swiglu_mlp(*leaves, fp8=True, **kwargs)
    y.backward(dy)
    return y.detach(), tuple(t.grad for t in leaves)


def _exact_step(x, w_gate_up, w_down, dy, gate_multiplier, down_multiplier):
    leaves = [t.detach().double().requires_grad_() for t in (x, w_gate_up, w_down)]
    y = swiglu_mlp(*leaves, gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)
    y.backward(dy.double())
    return y.detach(), tuple(t.grad for t in leaves)


#: The passes' codes that may sit a step from PyTorch's (assert_same_fp8): a fraction f of one
#: tensor's elements moved by a step (at most 2^-3 relative) moves a product by about 2^-3 sqrt(f).
CODE_STEPS_BOUND = 2.0**-3 * math.sqrt(1e-3)


def recipe_bound(dtype: torch.dtype, device: torch.device) -> float:
    """How far the FP8 path may be from the recipe in PyTorch: the rounding of h and dA to ``dtype``
    and of the outputs, and the passes' codes a step apart now and then (their SiLU and, with it, a
    group's amax / 448 scale may differ from PyTorch's in the last bit; on a GPU cuBLAS also sums in
    another order, which moves a few of h's roundings)."""
    if device.type == "cuda":
        return 4 * unit_roundoff(torch.bfloat16)
    return max(4 * unit_roundoff(dtype), CODE_STEPS_BOUND)


def sqnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal to quantization noise, dB."""
    return -20 * math.log10(max(relative_error(actual, expected), 1e-30))


#: The recipe's own SQNR against float64 on these problems is 22.5-24 dB (every GEMM reads two
#: e4m3 operands: about 3% noise each; torchao's blockwise recipe measures the same on an MLP). A
#: broken scale or layout costs far more.
RECIPE_SQNR_DB = 20.0


@pytest.mark.parametrize("precision", DTYPES, ids=str)
@pytest.mark.parametrize("save", ["factors", "preact"])
@pytest.mark.parametrize("size", SHAPES)
def test_fp8_step_is_the_recipe(device, precision, save, size):
    """Output and every gradient equal the recipe in PyTorch (reference.py) up to the rounding of
    the path's intermediates, and are as accurate against float64 as the recipe is."""
    problem = _problem(size, precision, device)
    multipliers = {"gate_multiplier": 0.8, "down_multiplier": 1.25}
    y, grads = _fused_step(*problem, save=save, **multipliers)
    kept = 1 if save == "factors" else 2
    want_y, want_grads = fp8_reference.swiglu_mlp_fp8(*problem, **multipliers, save=kept)
    exact_y, exact_grads = _exact_step(*problem, *multipliers.values())
    bound = recipe_bound(precision, device)
    for name, got, want, exact in zip(
        ("y", "dx", "dw_gate_up", "dw_down"),
        (y, *grads),
        (want_y, *want_grads),
        (exact_y, *exact_grads),
        strict=True,
    ):
        assert got.dtype == precision and got.shape == exact.shape, name
        assert relative_error(got, want) <= bound, name
        if size[0] > 1:  # one token: too few numbers for a noise figure
            assert sqnr(got, exact) >= min(sqnr(want, exact) - 0.1, RECIPE_SQNR_DB), name
            assert sqnr(want, exact) >= RECIPE_SQNR_DB, name


@pytest.mark.parametrize("save", ["factors", "preact"])
@pytest.mark.parametrize("asked", [(2,), (0,), (1, 2)], ids=["down", "x", "gate_up-down"])
def test_fp8_step_gives_each_gradient_alone(device, save, asked):
    """Leaves that need no gradient are left out of the backward, and the gradients asked are the
    full step's (dW_down alone from kept pre-activations still has a^T made by the backward's pass)."""
    problem = _problem((200, 256, 384), torch.float32, device)
    _, full = _fused_step(*problem, save=save)
    leaves = [t.detach().clone().requires_grad_(i in asked) for i, t in enumerate(problem[:3])]
    swiglu_mlp(*leaves, fp8=True, save=save).backward(problem[3])
    for i, leaf in enumerate(leaves):
        if i in asked:
            assert torch.equal(leaf.grad, full[i]), i
        else:
            assert leaf.grad is None, i


#: Outlier channels widen the packed gradient's range within a group (the saturated SiLU's zeros
#: beside the outliers' large products): the gate/up gradients lose up to 3 dB (19.5-19.7 at x1000 on
#: these problems), in the recipe itself.
OUTLIER_SQNR_DB = RECIPE_SQNR_DB - 3


@pytest.mark.parametrize("outliers", [100.0, 1000.0], ids=["x100", "x1000"])
def test_fp8_step_with_outlier_channels(device, outliers):
    """Scales local to a group: a few channels 100 or 1000 times the rest cost little accuracy, and
    the fused path is exactly as accurate as the recipe."""
    problem = _problem((256, 256, 384), torch.bfloat16, device, outliers)
    y, grads = _fused_step(*problem)
    want_y, want_grads = fp8_reference.swiglu_mlp_fp8(*problem)
    exact_y, exact_grads = _exact_step(*problem, 1.0, 1.0)
    names = ("y", "dx", "dw_gate_up", "dw_down")
    for name, got, want, exact in zip(
        names, (y, *grads), (want_y, *want_grads), (exact_y, *exact_grads), strict=True
    ):
        assert relative_error(got, want) <= recipe_bound(torch.bfloat16, device), name
        assert sqnr(got, exact) >= min(sqnr(want, exact) - 0.1, RECIPE_SQNR_DB), name
        assert sqnr(want, exact) >= OUTLIER_SQNR_DB, name


def _low_rank_problem(shape, dtype, device, rank=8):
    m, _, inter = shape
    u = torch.randn(m, rank)
    v = torch.randn(2 * inter, rank) * rank**-0.5  # u v^T as large as x W^T
    da = torch.randn(m, inter)
    return tuple(t.to(device=device, dtype=dtype) for t in (u, v, da))


@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("save", ["factors", "preact"])
def test_fp8_step_with_lora_terms_is_the_recipe(device, precision, save):
    """LoRA's terms beside the FP8 GEMMs (fp8_mlp_with_adapters): u v^T in h, ``a`` returned as the
    down GEMM reads it and its gradient joined to dA; y, a and the five gradients equal the recipe
    in PyTorch and are as accurate against float64 as it is."""
    from fused_swiglu.functional import fp8_mlp_with_adapters

    size = (200, 256, 384)
    x, w_gate_up, w_down, dy = _problem(size, precision, device)
    u, v, da = _low_rank_problem(size, precision, device)
    multipliers = {"gate_multiplier": 0.8, "down_multiplier": 1.25}
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_gate_up, w_down, u, v)]
    y, a = fp8_mlp_with_adapters(*leaves[:3], tuple(leaves[3:]), True, **multipliers, save=save)
    torch.autograd.backward((y, a), (dy, da))
    kept = 1 if save == "factors" else 2
    want_y, want_a, want_grads = fp8_reference.swiglu_mlp_fp8_adapted(
        x, w_gate_up, w_down, dy, **multipliers, save=kept, low_rank=(u, v), da=da
    )
    exact = [t.detach().double().requires_grad_() for t in (x, w_gate_up, w_down, u, v)]
    exact_a = 1.25 * fused_swiglu.swiglu_linear(exact[0], exact[1], gate_multiplier=0.8, low_rank=exact[3:])
    exact_y = exact_a @ exact[2].t()
    torch.autograd.backward((exact_y, exact_a), (dy.double(), da.double()))
    bound = recipe_bound(precision, device)
    for name, got, want, best in zip(
        ("y", "a", "dx", "dw_gate_up", "dw_down", "du", "dv"),
        (y, a, *(t.grad for t in leaves)),
        (want_y, want_a, *want_grads),
        (exact_y, exact_a, *(t.grad for t in exact)),
        strict=True,
    ):
        assert got.dtype == precision and got.shape == best.shape, name
        assert relative_error(got, want) <= bound, name
        assert sqnr(got, best) >= min(sqnr(want, best) - 0.1, RECIPE_SQNR_DB), name
        assert sqnr(want, best) >= RECIPE_SQNR_DB, name


def test_fp8_low_rank_term_joins_h_with_one_rounding(device):
    """u v^T is added to the gate/up GEMM's h in fp32 and rounded once. Rounding u v^T to 16 bits
    first moves over a quarter of h's elements and the output by 1.6%, which is what a 16-bit
    addmm_ missed the recipe by on an H100."""
    from fused_swiglu.fp8 import ops

    size = (200, 256, 384)
    x, w_gate_up, _, _ = _problem(size, torch.bfloat16, device)
    u, v, _ = _low_rank_problem(size, torch.bfloat16, device)
    x_data, x_scales, _, _ = ops.quantize(x, padded_rows(200), False)
    plain = ops._pre_activation(x_data, x_scales, w_gate_up, None, None, torch.bfloat16)
    h = ops._pre_activation(x_data, x_scales, w_gate_up, u, v, torch.bfloat16)
    low_rank = u.float() @ fp8_reference.gate_up_in_halves(v).float().t()
    assert torch.equal(h[:200], (plain[:200].float() + low_rank).to(torch.bfloat16))
    assert torch.equal(h[200:], plain[200:])


def test_fp8_inference_with_lora_terms_is_the_training_forward(device):
    """Without autograd the LoRA terms take the FP8 inference path (nothing kept); at decode sizes,
    as swiglu_mlp, none (the adapters then run in 16 bits)."""
    from fused_swiglu.functional import fp8_mlp_with_adapters

    size = (200, 256, 384)
    x, w_gate_up, w_down, dy = _problem(size, torch.bfloat16, device)
    u, v, _ = _low_rank_problem(size, torch.bfloat16, device)
    scalars = {"gate_multiplier": 0.8, "down_multiplier": 1.25, "save": "factors"}
    with torch.no_grad():
        y, a = fp8_mlp_with_adapters(x, w_gate_up, w_down, (u, v), True, **scalars)
        assert fp8_mlp_with_adapters(x[:8], w_gate_up, w_down, (u[:8], v), True, **scalars) is None
    want_y, want_a, _ = fp8_reference.swiglu_mlp_fp8_adapted(
        x, w_gate_up, w_down, dy, gate_multiplier=0.8, down_multiplier=1.25, low_rank=(u, v)
    )
    bound = recipe_bound(torch.bfloat16, device)
    assert relative_error(y, want_y) <= bound and relative_error(a, want_a) <= bound


def test_fp8_under_autocast_keeps_each_dtype(device):
    """fp32 master weights under bf16 autocast: quantized from fp32, the output in bf16, each
    gradient in its leaf's dtype, equal to the same step with the weights cast by hand."""
    x, w_gate_up, w_down, dy = _problem((200, 256, 256), torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in (x, w_gate_up, w_down)]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = swiglu_mlp(*leaves, fp8=True)
    assert y.dtype == torch.bfloat16
    y.backward(dy.bfloat16())
    assert all(t.grad.dtype == torch.float32 for t in leaves)
    want_y, want_grads = fp8_reference.swiglu_mlp_fp8(x.bfloat16(), w_gate_up, w_down, dy.bfloat16())
    bound = recipe_bound(torch.bfloat16, device)
    assert relative_error(y, want_y) <= bound
    for got, want in zip((t.grad for t in leaves), want_grads, strict=True):
        assert relative_error(got, want) <= bound


def test_fp8_inference_is_the_training_forward(device):
    x, w_gate_up, w_down, _ = _problem((200, 256, 256), torch.bfloat16, device)
    with torch.no_grad():
        y = swiglu_mlp(x, w_gate_up, w_down, fp8=True)
    want, _ = fp8_reference.swiglu_mlp_fp8(x, w_gate_up, w_down, torch.zeros_like(x))
    assert relative_error(y, want) <= recipe_bound(torch.bfloat16, device)


def test_fp8_backward_can_walk_twice(device):
    """Nothing kept is overwritten: retain_graph gives the same gradients again."""
    x, w_gate_up, w_down, dy = _problem((130, 128, 256), torch.bfloat16, device)
    leaf = x.clone().requires_grad_()
    y = swiglu_mlp(leaf, w_gate_up, w_down, fp8=True)
    y.backward(dy, retain_graph=True)
    first = leaf.grad.clone()
    leaf.grad = None
    y.backward(dy)
    assert torch.equal(leaf.grad, first)


def test_fp8_compiles_to_one_graph_that_matches_eager(device):
    from torch._dynamo.utils import counters

    problem = _problem((200, 256, 256), torch.bfloat16, device)
    want_y, want_grads = _fused_step(*problem)
    torch._dynamo.reset()
    counters.clear()

    def step(x, w_gate_up, w_down):
        return swiglu_mlp(x, w_gate_up, w_down, fp8=True)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in problem[:3]]
    y = compiled(*leaves)
    y.backward(problem[3])
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert torch.equal(y, want_y)
    for leaf, want in zip(leaves, want_grads, strict=True):
        assert torch.equal(leaf.grad, want)


def test_fp8_with_lora_terms_compiles_to_one_graph_that_matches_eager(device):
    from torch._dynamo.utils import counters

    from fused_swiglu.functional import fp8_mlp_with_adapters

    size = (200, 256, 256)
    x, w_gate_up, w_down, dy = _problem(size, torch.bfloat16, device)
    u, v, da = _low_rank_problem(size, torch.bfloat16, device)

    def step(*leaves):
        return fp8_mlp_with_adapters(
            *leaves[:3], leaves[3:], True, gate_multiplier=1.0, down_multiplier=1.0, save="factors"
        )

    results = []
    for run in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        torch._dynamo.reset()
        counters.clear()
        leaves = [t.detach().clone().requires_grad_() for t in (x, w_gate_up, w_down, u, v)]
        y, a = run(*leaves)
        torch.autograd.backward((y, a), (dy, da))
        results.append((y, a, *(t.grad for t in leaves)))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_fp8_ops_pass_opcheck(device):
    from fused_swiglu.fp8 import ops

    # Not the schema check: it compares outputs by arithmetic that float8 tensors have not on CPU.
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")

    x = torch.randn(200, 256, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(ops.quantize, (x, 256, True), test_utils=checks)
    w_gate_up = torch.randn(400, 256, device=device, dtype=torch.bfloat16)  # I = 200
    for halves in (False, True):
        torch.library.opcheck(ops.quantize_weight, (w_gate_up, True, halves), test_utils=checks)
    h = torch.randn(256, 512, device=device, dtype=torch.bfloat16)
    da = torch.randn(256, 200, device=device, dtype=torch.bfloat16)
    for save, a_t in ((1, False), (2, True)):  # factors; pre-activations, a^T from the backward
        torch.library.opcheck(ops.glu_forward, (h, 200, save, 1.0, 1.0), test_utils=checks)
        kept = ops.glu_forward(h, 200, save, 1.0, 1.0)[4:]
        args = (da, *kept, save, 1.0, 1.0, True, False, a_t)
        torch.library.opcheck(ops.glu_backward, args, test_utils=checks)
    a_data, a_scales = ops.glu_forward(h, 200, 0, 1.0, 1.0)[:2]
    torch.library.opcheck(ops.dequantize, (a_data, a_scales, 200, 200, torch.bfloat16), test_utils=checks)


# The module, the swap, bad input ---------------------------------------------------------------------------


def test_module_in_fp8_keeps_its_checkpoint(device):
    mlp = SwiGLUMLP(256, 256, device=device, dtype=torch.bfloat16)
    fp8 = SwiGLUMLP(256, 256, fp8=True, device=device, dtype=torch.bfloat16)
    fp8.load_state_dict(mlp.state_dict())
    assert list(fp8.state_dict()) == list(mlp.state_dict())
    assert all(p.dtype == torch.bfloat16 for p in fp8.parameters())
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    assert "fp8=True" in repr(fp8)
    assert relative_error(fp8(x), mlp(x)) <= 0.1  # the same function, in FP8
    assert not torchao_filter(fp8.down_proj, "down_proj") and torchao_filter(torch.nn.Linear(2, 2), "x")


def _small_llama_config(transformers):
    """Two layers whose MLPs the FP8 path takes (sizes in whole groups of 128)."""
    return transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )


def test_swap_with_fp8_trains_a_llama(device):
    transformers = pytest.importorskip("transformers")
    config = _small_llama_config(transformers)
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(config).to(device)
    fused = transformers.LlamaForCausalLM(config).to(device)
    fused.load_state_dict(stock.state_dict())
    swapped = swap_swiglu_mlps(fused, fp8=True)
    assert len(swapped) == 2 and all(fused.get_submodule(name).fp8 for name in swapped)
    ids = torch.randint(0, 64, (2, 64), device=device)
    losses = [model(input_ids=ids, labels=ids).loss for model in (stock, fused)]
    assert abs(losses[0].item() - losses[1].item()) <= 0.01 * losses[0].item()
    losses[1].backward()
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for p in fused.parameters() if p.requires_grad
    )
    assert set(fused.state_dict()) == set(stock.state_dict())


def test_lora_adapters_on_fp8_mlps(device, monkeypatch, caplog):
    """PEFT's adapters on every projection, then the swap with fp8=True: each MLP runs its FP8 step
    with its adapters beside it (nothing said of 16 bits), the logits and every adapter's gradient
    as close to stock PEFT's as the recipe's own noise, and the adapters count (switched off, the
    logits move by far more than that)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from fused_swiglu.fp8.ops import SwiGLUMLPFp8Function

    torch.manual_seed(0)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    stock = peft.get_peft_model(transformers.LlamaForCausalLM(_small_llama_config(transformers)), lora)
    stock = stock.to(device)
    fused = copy.deepcopy(stock)
    calls = []
    apply = SwiGLUMLPFp8Function.apply
    monkeypatch.setattr(SwiGLUMLPFp8Function, "apply", lambda *args: calls.append(args[-1]) or apply(*args))
    ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    with caplog.at_level("WARNING", logger="fused_swiglu"):
        assert len(swap_swiglu_mlps(fused, fp8=True)) == 2
        results = []
        for model in (stock, fused):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            results.append((out.logits.detach(), grads))
    assert calls == [True, True] and "16 bits" not in caplog.text  # with a for down's adapters
    (logits, grads), (fused_logits, fused_grads) = results
    assert fused_grads.keys() == grads.keys() and len([n for n in grads if ".mlp." in n]) == 2 * 3 * 2
    # Two FP8 MLPs' noise reaches every adapter's gradient (18.6-28.7 dB here; the recipe's own
    # floor with outliers is OUTLIER_SQNR_DB); adapters dropped or a gradient lost costs 0 dB or less.
    assert sqnr(fused_logits, logits) >= RECIPE_SQNR_DB
    for name, grad in grads.items():
        assert sqnr(fused_grads[name], grad) >= OUTLIER_SQNR_DB, name
    with fused.disable_adapter(), torch.no_grad():
        assert sqnr(fused(input_ids=ids).logits, logits) < 0


def test_fp8_mlps_beside_torchaos_float8_linears(device, caplog):
    """Swapped with fp8=True, then torchao's float8 on the other Linears (``torchao_filter`` leaves
    each fused MLP's down projection to it): attention in torchao's Float8Linear, the MLPs fused in
    FP8, a loss as FP8-close to stock's as the fused MLPs alone give; converted first, the MLPs are
    left as they are, with the reason logged, not fused over their Float8Linears."""
    transformers = pytest.importorskip("transformers")
    float8 = pytest.importorskip("torchao.float8")
    config = _small_llama_config(transformers)
    float8_config = float8.Float8LinearConfig(emulate=device.type != "cuda")  # CPU: torchao's emulation
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(config).to(device)
    both = transformers.LlamaForCausalLM(config).to(device)
    both.load_state_dict(stock.state_dict())
    assert len(swap_swiglu_mlps(both, fp8=True)) == 2
    float8.convert_to_float8_training(both, config=float8_config, module_filter_fn=torchao_filter)
    for layer in both.model.layers:
        assert type(layer.self_attn.q_proj).__name__ == "Float8Linear" and layer.mlp.fp8
        assert type(layer.mlp.down_proj) is torch.nn.Linear
    ids = torch.randint(0, 64, (2, 64), device=device)
    losses = [model(input_ids=ids, labels=ids).loss for model in (stock, both)]
    assert abs(losses[0].item() - losses[1].item()) <= 0.01 * losses[0].item()
    losses[1].backward()
    assert all(torch.isfinite(p.grad).all() for p in both.parameters())
    converted_first = transformers.LlamaForCausalLM(config).to(device)
    float8.convert_to_float8_training(converted_first, config=float8_config)
    with caplog.at_level("WARNING", logger="fused_swiglu"):
        assert swap_swiglu_mlps(converted_first, fp8=True) == []
    assert "Float8Linear, not a plain nn.Linear" in caplog.text


def test_fp8_refuses_what_it_cannot_take(device):
    x, w_gate_up, w_down, _ = _problem((8, 128, 128), torch.bfloat16, device)
    with pytest.raises(ValueError, match="save must be one of"):
        swiglu_mlp(x, w_gate_up, w_down, fp8=True, save="recompute")
    with pytest.raises(ValueError, match="multiples of 128"):
        swiglu_mlp(x[:, :64], w_gate_up[:, :64], w_down[:64], fp8=True)
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        swiglu_mlp(x, w_gate_up, w_down, fp8="yes")
    with pytest.raises(ValueError, match="multiples of 128"):
        SwiGLUMLP(64, 128, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("size", GPU_SHAPES)
def test_fp8_step_at_a_larger_shape(device, size):
    _gpu_only(device)
    problem = _problem(size, torch.bfloat16, device)
    y, grads = _fused_step(*problem)
    want_y, want_grads = fp8_reference.swiglu_mlp_fp8(*problem)
    for got, want in zip((y, *grads), (want_y, *want_grads), strict=True):
        assert relative_error(got, want) <= recipe_bound(torch.bfloat16, device)
