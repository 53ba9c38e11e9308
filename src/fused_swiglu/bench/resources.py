"""Compile the fused kernels for sm_90 on any machine (no GPU needed) and report their resources.

For each benchmark shape and save mode this compiles the tile config the library would pick, with
Triton's own compiler and the ptxas it ships, and prints registers per thread, spilled bytes and
shared memory. A config that needs more shared memory than an H100/H200 block may use, or that
spills registers, fails here instead of on the GPU.

    python -m fused_swiglu.bench.resources [--check] [--show-ir DIR] [--arch 90|100|120]

``--check`` exits non-zero if any kernel exceeds the shared-memory limit or a tensor-core variant
spills registers. ``--show-ir``
writes each kernel's TTGIR (where the epilogue's TMA copies and their waits can be read).
Must run without ``TRITON_INTERPRET``: the interpreter replaces the kernels this compiles.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.tools.tensor_descriptor import TensorDescriptor

from ..experts.kernels.combine import GPU_WARPS as COMBINE_WARPS
from ..experts.kernels.combine import _combine_kernel, combine_block
from ..experts.kernels.routes import (
    FILL_BLOCK,
    ROUTE_WARPS,
    ROWS_BLOCK,
    _route_keys_kernel,
    _route_table_kernel,
    expert_lanes,
    route_block,
)
from ..kernels import glu_backward_ws, glu_forward_ws, hopper_ws
from ..kernels.common import CHUNK, Saved
from ..kernels.configs import (
    EXPERT_ROWS,
    FP8_PASS_WARPS,
    TileConfig,
    backward_config,
    forward_config,
    fp8_forward_pass,
    fp8_gradient_pass,
)
from ..kernels.glu_backward import _glu_backward_kernel
from ..kernels.glu_forward import _glu_forward_kernel
from .run import SHAPES

#: Shared memory one block may use, per compute capability: Hopper and datacenter Blackwell 227 KB,
#: consumer Blackwell 99 KB. The library runs its kernels on sm_90 only; the others are here to show why.
SHARED_LIMIT = {90: 232448, 100: 232448, 120: 101376}
SM90 = GPUTarget("cuda", 90, 32)


def _descriptor_type(block: list[int], dtype: torch.dtype) -> str:
    """Triton's signature string of a host descriptor, taken from Triton itself."""
    shape = [256] * (len(block) - 1) + [512]  # any tensor of the block's rank: only dtype and block enter
    t = torch.empty(shape, dtype=dtype)
    return native_specialize_impl(
        BaseBackend, TensorDescriptor(t, shape, list(t.stride()), block), False, True, True
    )[0]


def _compile(
    fn,
    descriptors: dict,
    scalars: dict,
    constants: dict,
    cfg: TileConfig,
    target: GPUTarget,
    divisible: tuple[str, ...] = (),
):
    """``divisible``: integer arguments that Triton specializes as multiples of 16 at the library's
    shapes (pointers always are: the library's tensors are 16-byte aligned)."""
    meta = cfg.kernel_meta()
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    constants = {**constants, **meta}
    signature = {**descriptors, **scalars, **dict.fromkeys(constants, "constexpr")}
    signature = {name: signature[name] for name in fn.arg_names}
    aligned = [i for i, n in enumerate(fn.arg_names) if signature[n].startswith("*") or n in divisible]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=target, options=options)


def forward_kernel(
    m: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    save: Saved,
    precision: str,
    cfg: TileConfig | None = None,
    target: GPUTarget = SM90,
    experts: bool = False,
):
    """The Triton forward as the library launches it; ``experts``: with the routed experts' tile
    table, x read by index and the pointers of its masked stores."""
    cfg = cfg or forward_config(m, hidden, inter, dtype, True, save, precision, experts)
    width = cfg.block_n // cfg.epilogue_split
    descriptors = {
        "x_desc": _descriptor_type([cfg.block_m, cfg.block_k], dtype),
        "w_desc": _descriptor_type([2 * cfg.block_n, cfg.block_k], dtype),
        "a_desc": _descriptor_type([cfg.block_m, width], dtype),
    }
    constants = {"SAVE": int(save), "CHUNK_": CHUNK, "DOT_PRECISION": precision}
    constants |= {"u_desc": None, "v_desc": None, "ROWS": EXPERT_ROWS}
    if save == Saved.NOTHING:
        constants["s_desc"] = None
    else:
        descriptors["s_desc"] = _descriptor_type([cfg.block_m, 2 * width], dtype)
    scalars = {"M": "i32", "N": "i32", "K": "i32", "gate_multiplier": "fp32", "down_multiplier": "fp32"}
    pointer = "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    scalars["stride_x"] = "i32"
    routed = {"t_ptr": "*i32", "used_ptr": "*i32", "a_ptr": pointer, "x_ptr": pointer, "r_ptr": "*i32"}
    routed["s_ptr"] = pointer if save != Saved.NOTHING else None
    for name, kind in routed.items():
        if experts and kind is not None:
            scalars[name] = kind
        else:
            constants[name] = None
    if experts:
        del descriptors["x_desc"]
        constants["x_desc"] = None  # x read by index
    compiled = _compile(
        _glu_forward_kernel, descriptors, scalars, constants, cfg, target, ("stride_x", "N", "K")
    )
    return cfg, compiled


def backward_kernel(
    m: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    save: Saved,
    precision: str,
    cfg: TileConfig | None = None,
    target: GPUTarget = SM90,
    own_grad: bool = False,
    experts: bool = False,
):
    """In place (the eager path), or with ``own_grad`` storing into a gradient buffer of its own;
    ``experts``: the routed experts' variant (the tile table, the routing weights, their gradient's
    partial sums, a read and a * w written, the masked stores)."""
    cfg = cfg or backward_config(m, hidden, inter, dtype, True, save, experts)
    width = cfg.block_n // cfg.epilogue_split
    descriptors = {
        "dy_desc": _descriptor_type([cfg.block_m, cfg.block_k], dtype),
        "wd_desc": _descriptor_type([cfg.block_k, cfg.block_n], dtype),
        "s_desc": _descriptor_type([cfg.block_m, 2 * width], dtype),
    }
    constants = {"SAVE": int(save), "CHUNK_": CHUNK, "DOT_PRECISION": precision, "ROWS": EXPERT_ROWS}
    constants["WRITE_A"] = experts or save == Saved.PREACT
    if own_grad:
        descriptors["g_desc"] = descriptors["s_desc"]
    else:
        constants["g_desc"] = None
    if save == Saved.PREACT or experts:
        descriptors["a_desc"] = _descriptor_type([cfg.block_m, width], dtype)
    else:
        constants["a_desc"] = None
    scalars = {"M": "i32", "N": "i32", "K": "i32", "P_STRIDE": "i32", "gate_multiplier": "fp32"}
    scalars["down_multiplier"] = "fp32"
    pointer = "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    routed = {"t_ptr": "*i32", "used_ptr": "*i32", "s_ptr": pointer, "a_ptr": pointer, "r_ptr": pointer}
    routed["p_ptr"] = "*fp32"  # the routing weights come in x's dtype, their gradient in fp32
    for name, kind in routed.items():
        if experts:
            scalars[name] = kind
        else:
            constants[name] = None
    return cfg, _compile(_glu_backward_kernel, descriptors, scalars, constants, cfg, target)


def _gluon_descriptor_type(block: list[int], dtype: torch.dtype) -> str:
    """Triton's signature string of a Gluon host descriptor, with the shared layout the launchers use."""
    t = torch.empty(256, 512, dtype=dtype)
    return native_specialize_impl(BaseBackend, hopper_ws.gluon_descriptor(t, block), False, True, True)[0]


_DENSE_SCALARS = dict.fromkeys(("M", "N", "K"), "i32") | dict.fromkeys(
    ("gate_multiplier", "down_multiplier"), "fp32"
)


def _compile_gluon(
    fn, blocks: dict, constants: dict, c: hopper_ws.WSLaunch, dtype, target, scalars: dict = _DENSE_SCALARS
):
    """Compile a warp-specialized kernel like its launcher does; a block of None is a None argument;
    ``scalars``: the other arguments' types (pointers 16-byte aligned, as the library's tensors are)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    meta = c.meta()
    options = {"num_warps": meta["num_warps"], "maxnreg": meta.pop("maxnreg")}
    constants = {**constants, **meta}
    constants |= {name: None for name, block in blocks.items() if block is None}
    signature = {name: _gluon_descriptor_type(block, dtype) for name, block in blocks.items() if block}
    signature |= scalars | dict.fromkeys(constants, "constexpr")
    signature = {name: signature[name] for name in fn.arg_names}
    aligned = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if signature[n].startswith("*")
    }
    return triton.compile(GluonASTSource(fn, signature, constants, aligned), target=target, options=options)


def warp_specialized_backward_kernel(
    dtype: torch.dtype, save: Saved, target: GPUTarget = SM90, own_grad: bool = False
):
    """The Gluon backward for one saved tensor (its one config), in place or ``own_grad``."""
    c = glu_backward_ws.CONFIGS[save]
    width = c.piece_width
    a_block = [c.block_m, width] if save == Saved.PREACT else None
    blocks = {"dy_desc": [c.block_m, c.block_k], "wd_desc": [c.block_k, c.block_n]}
    blocks |= {"s_desc": [c.block_m, 2 * width], "a_desc": a_block}
    blocks["g_desc"] = blocks["s_desc"] if own_grad else None
    constants = {"NSAVED": c.saved_buffers, "NA": max(c.a_buffers, 1)}
    return c, _compile_gluon(glu_backward_ws._glu_backward_ws_kernel, blocks, constants, c, dtype, target)


def ping_pong_backward_kernel(
    dtype: torch.dtype, save: Saved, target: GPUTarget = SM90, own_grad: bool = False
):
    """The Gluon backward's ping-pong launch (saved factors, small hidden sizes), in place or ``own_grad``."""
    c = glu_backward_ws.PING_PONG
    blocks = {"dy_desc": [c.block_m, c.block_k], "wd_desc": [c.block_k, c.block_n]}
    blocks |= {"s_desc": [c.block_m, 2 * c.piece_width]}
    blocks["g_desc"] = blocks["s_desc"] if own_grad else None
    constants = {"NSAVED": c.saved_buffers}
    return c, _compile_gluon(glu_backward_ws._glu_backward_pp_kernel, blocks, constants, c, dtype, target)


def routed_ping_pong_backward_kernel(
    dtype: torch.dtype, save: Saved, target: GPUTarget = SM90, row_grad: bool = True
):
    """The routed experts' Gluon backward (saved factors, ping-pong), writing ``a * w`` and, with
    ``row_grad``, the routing weights' partial gradients."""
    c = glu_backward_ws.ROUTED_PING_PONG
    width = c.piece_width
    blocks = {"dy_desc": [c.block_m, c.block_k], "wd_desc": [c.block_k, c.block_n]}
    blocks |= {"s_desc": [c.block_m, 2 * width], "a_desc": [c.block_m, width]}
    element = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    scalars = {"t_ptr": "*i32", "used_ptr": "*i32", "r_ptr": "*fp32", "s_ptr": element, "a_ptr": element}
    scalars |= dict.fromkeys(("N", "K", "P_STRIDE"), "i32")
    constants = {"NSAVED": c.saved_buffers, "WRITE_A": True}
    if row_grad:
        scalars["p_ptr"] = "*fp32"
    else:
        constants["p_ptr"] = None
    kernel = glu_backward_ws._routed_backward_pp_kernel
    return c, _compile_gluon(kernel, blocks, constants, c, dtype, target, scalars)


def warp_specialized_forward_kernel(dtype: torch.dtype, save: Saved, target: GPUTarget = SM90):
    """The Gluon forward for one save mode (its one config)."""
    c = glu_forward_ws.CONFIG
    width = c.piece_width
    s_block = None if save == Saved.NOTHING else [c.block_m, 2 * width]
    blocks = {"x_desc": [c.block_m, c.block_k], "w_desc": [2 * c.block_n, c.block_k]}
    blocks |= {"a_desc": [c.block_m, width], "s_desc": s_block}
    constants = {"NBUF": c.buffers, "SAVE": int(save)}
    return c, _compile_gluon(glu_forward_ws._glu_forward_ws_kernel, blocks, constants, c, dtype, target)


def fp8_kernels(target: GPUTarget = SM90):
    """The FP8 path's passes (fp8/kernels.py) as launched, every variant: (label, tile, kernel)."""
    from ..fp8 import kernels as fp8

    def compile_(fn, descriptors: dict, scalars: dict, constants: dict, warps: int = FP8_PASS_WARPS):
        signature = {**descriptors, **scalars, **dict.fromkeys(constants, "constexpr")}
        signature = {name: signature[name] for name in fn.arg_names}
        aligned = [i for i, n in enumerate(fn.arg_names) if signature[n].startswith("*")]
        attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
        source = ASTSource(fn, signature, constants, attrs)
        return triton.compile(source, target=target, options={"num_warps": warps})

    g = 128
    e4m3 = "tensordesc<fp8e4nv[{}, {}]>"
    shared = {"G": g, "SOFTWARE_": False}
    for dtype, transposed in itertools.product((torch.bfloat16, torch.float32), (False, True)):
        descriptors = {"x_desc": _descriptor_type([g, g], dtype), "q_desc": e4m3.format(g, g)}
        scalars = {"s_ptr": "*fp32", "F": "i32", "Mp": "i32"}
        constants = {"BM": g, **shared}
        if transposed:
            descriptors["qt_desc"], scalars["st_ptr"] = e4m3.format(g, g), "*fp32"
        else:
            constants |= {"qt_desc": None, "st_ptr": None}
        kernel = compile_(fp8._quantize_activation_kernel, descriptors, scalars, constants)
        name = str(dtype).removeprefix("torch.")
        yield f"{name} fp8 quantize activation{' and transpose' if transposed else ''}", f"{g}x{g}", kernel
        for halves in (False, True):
            w_block = [g // 2 // CHUNK, CHUNK, g] if halves else [g // 2, g]
            descriptors = {
                "w_desc": _descriptor_type(w_block, dtype),
                "q_desc": e4m3.format(*((g, g // 2) if transposed else (g // 2, g))),
            }
            constants = {"TRANSPOSED": transposed, "HALVES": halves, "CHUNK_": CHUNK, **shared}
            kernel = compile_(fp8._quantize_weight_kernel, descriptors, {"s_ptr": "*fp32"}, constants)
            what = f"{' transposed' if transposed else ''}{' in halves' if halves else ''}"
            yield f"{name} fp8 quantize weight{what}", f"{g}x{g}", kernel
    for save in (0, 1, 2):
        descriptors = {
            "h_desc": _descriptor_type([g, g // 2], torch.bfloat16),
            "a_desc": e4m3.format(g, g // 2),
        }
        scalars = {
            "as_ptr": "*fp32",
            "Mp": "i32",
            "N": "i32",
            "gate_multiplier": "fp32",
            "down_multiplier": "fp32",
        }
        launch = fp8_forward_pass(save)  # as kernels.glu_forward launches it
        constants = {"SAVE": save, "BM": g, "GROUPS_": launch.groups, "STAGES_": launch.stages, **shared}
        if save:
            descriptors["k_desc"], scalars["ks_ptr"] = e4m3.format(g, g // 2), "*fp32"
        else:
            constants |= dict.fromkeys(("k_desc", "ks_ptr"))
        a_t = {"at_desc": e4m3.format(g // 2, g)}, {"ats_ptr": "*fp32"}  # a^T: from the pass that sees a
        if save == 1:
            descriptors |= a_t[0]
            scalars |= a_t[1]
        else:
            constants |= dict.fromkeys(("at_desc", "ats_ptr"))
        kernel = compile_(fp8._glu_forward_kernel, descriptors, scalars, constants, launch.warps)
        yield f"bfloat16 fp8 SwiGLU pass {Saved(save).name}", f"{g}x{g}", kernel
        if save:
            descriptors = {
                "da_desc": _descriptor_type([g, g // 2], torch.bfloat16),
                "k_desc": e4m3.format(g, g // 2),
            }
            descriptors |= {
                "g_desc": e4m3.format(g, g // 2),
                "gt_desc": _descriptor_type([g // 2 // CHUNK, CHUNK, g], torch.float8_e4m3fn),
            }
            scalars = {"ks_ptr": "*fp32", "gs_ptr": "*fp32", "gts_ptr": "*fp32", "Mp": "i32", "N": "i32"}
            scalars |= {"n_groups": "i32", "gate_multiplier": "fp32", "down_multiplier": "fp32"}
            launch = fp8_gradient_pass(save)  # as kernels.glu_backward launches it
            constants = {"SAVE": save, "BM": g, "CHUNK_": CHUNK, "GROUPS_": launch.groups, **shared}
            constants |= {"STAGES_": launch.stages}
            if save == 2:
                descriptors |= a_t[0]
                scalars |= a_t[1]
            else:
                constants |= dict.fromkeys(("at_desc", "ats_ptr"))
            kernel = compile_(fp8._glu_backward_kernel, descriptors, scalars, constants, launch.warps)
            yield f"bfloat16 fp8 SwiGLU gradient pass {Saved(save).name}", f"{g}x{g}", kernel


def resources(kernel) -> dict:
    """Registers per thread and spilled bytes from the cubin, shared memory from the compiler."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", out))
    return {
        "registers": int(fields["REG"]),
        "spilled_bytes": int(fields["STACK"]) + int(fields["LOCAL"]),
        "shared_bytes": kernel.metadata.shared,
    }


def _tile(cfg: TileConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} e{cfg.epilogue_split}"


#: Bytes a thread of the routed experts' backward may spill: its [128, 256] tile spills in the
#: epilogue and measured faster than the [128, 128] one that does not (docs/design/experts.md).
ROUTED_BACKWARD_SPILL = 1536


#: Bytes a thread of the FP8 SwiGLU gradient pass with kept pre-activations may spill: at 4 warps it
#: spills a little and ran 0.63x its time at 8 warps, which do not spill (H100, round FP8-3).
FP8_PREACT_GRADIENT_SPILL = 64

#: Bytes a thread of the FP8 SwiGLU forward pass with factors may spill: two loads deep it spills 392
#: and ran 0.95x its time one group at a time, which does not spill (H100, round FP8-5).
FP8_FACTORS_FORWARD_SPILL = 400

#: The FP8 kernels allowed to spill, by the end of their label.
FP8_SPILLS = {
    "gradient pass PREACT": FP8_PREACT_GRADIENT_SPILL,
    "SwiGLU pass FACTORS": FP8_FACTORS_FORWARD_SPILL,
}


def _report(label: str, tile: str, r: dict, precision: str, limit: int, spill_limit: int = 0) -> bool:
    """Print one kernel; False if it cannot launch (shared memory) or a tensor-core variant spills
    more than ``spill_limit`` bytes a thread.

    The fp32 "ieee" variant (TF32 off) runs its dot on the FMA units, and every tile measured here
    spills there; it is reported, not failed.
    """
    fits = r["shared_bytes"] <= limit
    spills = r["spilled_bytes"] > 0
    ok = fits and (r["spilled_bytes"] <= spill_limit or precision == "ieee")
    note = "" if ok else "  <-- FAILS"
    if ok and spills:
        note = "  (spills: FMA dot)" if precision == "ieee" else "  (spills: within the allowance)"
    print(
        f"{label:<52} {tile:<16} {r['registers']:>3} regs, {r['spilled_bytes']} B spilled, "
        f"{r['shared_bytes'] / 1024:.0f} KB shared{note}",
        flush=True,
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail on shared memory over the limit or spills")
    ap.add_argument("--show-ir", type=Path, help="write each kernel's TTGIR into this folder")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT), help="compute capability")
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels this compiles")
        return 2
    kernels = [(forward_kernel, save) for save in (Saved.NOTHING, Saved.FACTORS, Saved.PREACT)]
    kernels += [(backward_kernel, save) for save in (Saved.FACTORS, Saved.PREACT)]
    seen: dict[tuple, dict] = {}
    failed = []
    # fp32 follows torch.backends.cuda.matmul.allow_tf32 (kernels.common.dot_precision): the three-pass
    # TF32 and the ieee dots need different registers and shared memory, so both are compiled.
    precisions = [(torch.bfloat16, "tf32"), (torch.float32, "ieee"), (torch.float32, "tf32x3")]
    for name, (dtype, precision), bulk, (build, save) in itertools.product(
        args.shapes, precisions, (True, False), kernels
    ):
        m, hidden, inter = SHAPES[name]
        rows = m if bulk else 1  # the bulk tile, or the decode-sized one
        cfg, kernel = build(rows, hidden, inter, dtype, save, precision, target=target)
        family = build.__name__.removesuffix("_kernel")
        key = (family, save, dtype, precision, cfg)
        if key not in seen:
            seen[key] = resources(kernel)
            if args.show_ir:
                args.show_ir.mkdir(parents=True, exist_ok=True)
                (args.show_ir / f"{family}-{save.name}-{len(seen)}.ttgir").write_text(kernel.asm["ttgir"])
        dtype_name = str(dtype).removeprefix("torch.") + (f"/{precision}" if dtype == torch.float32 else "")
        label = f"{name} M={rows} {dtype_name} {family} {save.name}"
        if not _report(label, _tile(cfg), seen[key], precision, SHARED_LIMIT[args.arch]):
            failed.append(label)
    # The routed experts' forward: the tile table and the masked stores of each group's last tile.
    for name, save, bulk in itertools.product(args.shapes, tuple(Saved), (True, False)):
        m, hidden, inter = SHAPES[name]
        rows = m if bulk else 1
        cfg, kernel = forward_kernel(
            rows, hidden, inter, torch.bfloat16, save, "tf32", target=target, experts=True
        )
        label = f"{name} M={rows} bfloat16 forward {save.name} (routed experts)"
        if not _report(label, _tile(cfg), resources(kernel), "tf32", SHARED_LIMIT[args.arch]):
            failed.append(label)
    # The routed experts' backward: every output at once (the largest epilogue).
    for name, save, bulk in itertools.product(args.shapes, (Saved.FACTORS, Saved.PREACT), (True, False)):
        m, hidden, inter = SHAPES[name]
        rows = m if bulk else 1
        cfg, kernel = backward_kernel(
            rows, hidden, inter, torch.bfloat16, save, "tf32", target=target, experts=True
        )
        label = f"{name} M={rows} bfloat16 backward {save.name} (routed experts)"
        limits = SHARED_LIMIT[args.arch], ROUTED_BACKWARD_SPILL
        if not _report(label, _tile(cfg), resources(kernel), "tf32", *limits):
            failed.append(label)
    limit = SHARED_LIMIT[args.arch]
    # The routed experts' combine of each token's rows (weighted: y's; not: dX's), at every top-k
    # the tests take (top-1 unweighted: the gather of x's and dy's rows).
    for top_k, weighted in itertools.product((1, 2, 8), (True, False)):
        signature = {"src_ptr": "*bf16", "rows_ptr": "*i32", "w_ptr": "*bf16", "out_ptr": "*bf16"}
        signature |= dict.fromkeys(("T", "H", "stride_src", "stride_out"), "i32")
        signature |= dict.fromkeys(("K", "WEIGHTED", "BT", "BH"), "constexpr")
        signature = {name: signature[name] for name in _combine_kernel.arg_names}
        block = combine_block()
        constants = {"K": top_k, "WEIGHTED": weighted, "BT": block[0], "BH": block[1]}
        source = ASTSource(_combine_kernel, signature, constants)
        kernel = triton.compile(source, target=target, options={"num_warps": COMBINE_WARPS})
        tile = "x".join(map(str, block))
        label = f"bfloat16 combine top-{top_k}{' weighted' if weighted else ''} (routed experts)"
        if not _report(label, tile, resources(kernel), "tf32", limit):
            failed.append(label)
    # The routed experts' row-tile table, from 1 to 1024 experts (its [BT, E] stores in registers).
    for experts in (1, 3, 8, 64, 128, 256, 512, 1024):
        ids = "*u8" if experts < 256 else "*i16"  # the sort's key (experts/routing.py)
        signature = {"ids_ptr": ids, "tiles_ptr": "*i32", "used_ptr": "*i32", "ends_ptr": "*i32"}
        signature |= dict.fromkeys(("S", "E", "T", "steps"), "i32")
        signature |= dict.fromkeys(("ROWS", "E_P2", "BT", "FILL"), "constexpr")
        constants = {"ROWS": EXPERT_ROWS, "E_P2": expert_lanes(experts), "BT": route_block(experts)}
        constants["FILL"] = FILL_BLOCK
        signature = {name: signature[name] for name in _route_table_kernel.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # the pointers, as launched
        source = ASTSource(_route_table_kernel, signature, constants, aligned)
        kernel = triton.compile(source, target=target, options={"num_warps": ROUTE_WARPS})
        label = f"route table, {experts} experts (routed experts)"
        if not _report(label, f"{constants['BT']}x{constants['E_P2']}", resources(kernel), "tf32", limit):
            failed.append(label)
    # The routed experts' sort keys, from int32 and int64 ids into each key the routing picks.
    for ids, keys in itertools.product(("*i32", "*i64"), ("*u8", "*i16", "*i32")):
        signature = {"ids_ptr": ids, "keys_ptr": keys, "S": "i32", "E": "i32", "B": "constexpr"}
        source = ASTSource(_route_keys_kernel, signature, {"B": ROWS_BLOCK})
        kernel = triton.compile(source, target=target, options={"num_warps": 4})
        label = f"route keys, {ids[1:]} ids to {keys[1:]} (routed experts)"
        if not _report(label, str(ROWS_BLOCK), resources(kernel), "tf32", limit):
            failed.append(label)
    # The traced backward op's variant, storing into a gradient buffer of its own (one more descriptor).
    for name, save in itertools.product(args.shapes, (Saved.FACTORS, Saved.PREACT)):
        m, hidden, inter = SHAPES[name]
        problem = (m, hidden, inter, torch.bfloat16, save, "tf32")
        cfg, kernel = backward_kernel(*problem, target=target, own_grad=True)
        label = f"{name} M={m} bfloat16 backward {save.name} (own grad)"
        if not _report(label, _tile(cfg), resources(kernel), "tf32", SHARED_LIMIT[args.arch]):
            failed.append(label)
    if args.arch == 90 and hopper_ws.AVAILABLE:  # wgmma: Hopper only
        gluon_kernels = [(warp_specialized_forward_kernel, "forward", save) for save in Saved]
        gluon_kernels += [(warp_specialized_backward_kernel, "backward", k) for k in glu_backward_ws.CONFIGS]
        gluon_kernels += [(ping_pong_backward_kernel, "backward ping-pong", Saved.FACTORS)]
        own_grad = functools.partial(warp_specialized_backward_kernel, own_grad=True)
        gluon_kernels += [(own_grad, "backward own grad", k) for k in glu_backward_ws.CONFIGS]
        own_grad_pp = functools.partial(ping_pong_backward_kernel, own_grad=True)
        gluon_kernels += [(own_grad_pp, "backward ping-pong own grad", Saved.FACTORS)]
        gluon_kernels += [(routed_ping_pong_backward_kernel, "routed experts backward", Saved.FACTORS)]
        no_row_grad = functools.partial(routed_ping_pong_backward_kernel, row_grad=False)
        gluon_kernels += [(no_row_grad, "routed experts backward, no weights' gradient", Saved.FACTORS)]
        for (build, family, save), dtype in itertools.product(gluon_kernels, (torch.bfloat16, torch.float16)):
            c, kernel = build(dtype, save, target)
            tile = f"{c.block_m}x{c.block_n}x{c.block_k} s{c.stages} e{c.pieces}"
            label = f"M>64 {str(dtype).removeprefix('torch.')} {family} {save.name} (warp-specialized)"
            if not _report(label, tile, resources(kernel), "tf32", SHARED_LIMIT[args.arch]):
                failed.append(label)
    for label, tile, kernel in fp8_kernels(target):
        allowance = next((b for end, b in FP8_SPILLS.items() if label.endswith(end)), 0)
        if not _report(label, tile, resources(kernel), "tf32", SHARED_LIMIT[args.arch], allowance):
            failed.append(label)
    if failed and args.check:
        print(f"{len(failed)} kernel(s) exceed {SHARED_LIMIT[args.arch]} bytes of shared memory or spill")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
