"""Tile configurations of the fused kernels, chosen per problem without run-time autotuning.

Why no autotuning at call time: the backward kernel writes in place (a re-run would corrupt its
input), and autotuning every new batch size costs tens of seconds on the first call. The choice is a
pure function of the problem, so a new shape compiles at most one kernel per family. Where each rule
and tile was measured: docs/design/kernel-choice.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from ..layout import CHUNK
from . import hopper_ws
from .common import Saved, interpreting


@dataclass(frozen=True)
class TileConfig:
    """One launch shape. ``block_n`` counts intermediate columns; the packed tile is ``2 * block_n`` wide."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    # Store the epilogue in this many column pieces: smaller staging buffers leave shared memory to
    # the main loop's pipeline stages.
    epilogue_split: int = 2
    # Pipeline across tiles of the persistent loop (overlaps an epilogue with the next tile's loads).
    flatten: bool = False
    # Resident programs per multiprocessor: with 2, one program's epilogue overlaps the other's
    # main loop (needs at most half the shared memory each).
    ctas_per_sm: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "epilogue_split"):
            value = getattr(self, name)
            if value <= 0 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.epilogue_split > 4:
            raise ValueError(f"epilogue_split is 1, 2 or 4, got {self.epilogue_split}")
        if self.block_n // self.epilogue_split < CHUNK:
            raise ValueError(
                f"block_n / epilogue_split must cover at least one packed chunk ({CHUNK}), "
                f"got {self.block_n} / {self.epilogue_split}"
            )

    def kernel_meta(self) -> dict:
        return {
            "BM": self.block_m,
            "BN": self.block_n,
            "BK": self.block_k,
            "GROUP_M": self.group_m,
            "EPI_SPLIT": self.epilogue_split,
            "FLATTEN": self.flatten,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


#: Inference with at most this many rows runs cuBLAS's x @ W_packed^T plus a small activation pass:
#: cuBLAS streams a weight faster than the fused kernel's tiles at decode sizes (kernel-choice.md).
CUBLAS_DECODE_ROWS = 24


def inference_uses_cublas(m: int) -> bool:
    return m <= CUBLAS_DECODE_ROWS


def gemms_on_cublas(dtype: torch.dtype, on_gpu: bool) -> bool:
    """Whether the GLU GEMMs run on cuBLAS with the SwiGLU in separate passes (kernels/glu_split.py).

    fp32 does: Triton's fp32 tiles run far below cuBLAS's (docs/design/kernel-choice.md). Under the
    interpreter the fused kernels run in every dtype, so that they are tested on CPU.
    """
    return on_gpu and dtype == torch.float32


#: The widest low-rank term (columns of u, a multiple of 16) the forward kernel adds in one extra dot
#: per tile; wider ones (LoRA ranks above 32 on both gate and up) go to cuBLAS plus a pass.
LOW_RANK_IN_KERNEL = 64


def low_rank_in_kernel(low_rank) -> bool:
    """Whether the forward kernel takes this ``(u, v)`` low-rank term (``None``: no term, trivially)."""
    return low_rank is None or low_rank[0].shape[1] <= LOW_RANK_IN_KERNEL


def forward_shared_memory(cfg: TileConfig, itemsize: int, rank: int, save: Saved, write_a: bool) -> int:
    """Bytes of shared memory the forward kernel allocates: the pipeline stages, the low-rank
    operands (loaded once per tile, after the K loop, in buffers of their own) and the epilogue's
    staging pieces."""
    stages = cfg.num_stages * (cfg.block_m + 2 * cfg.block_n) * cfg.block_k
    low_rank = rank * (cfg.block_m + 2 * cfg.block_n)
    piece = cfg.block_m * 2 * cfg.block_n // cfg.epilogue_split  # packed columns of one piece
    epilogue = (piece // 2 if write_a else 0) + (piece if save != Saved.NOTHING else 0)
    return (stages + low_rank + epilogue) * itemsize


def fit_low_rank(
    cfg: TileConfig, itemsize: int, rank: int, save: Saved, write_a: bool, limit: int
) -> TileConfig:
    """``cfg`` with as many pipeline stages as still fit beside a rank-``rank`` low-rank term's buffers
    in ``limit`` bytes (a wide term, e.g. LoRA rank 32 on gate and up, costs the training tile a stage)."""
    margin = 1024  # barriers and alignment
    stages = cfg.num_stages
    while (
        stages > 1
        and forward_shared_memory(replace(cfg, num_stages=stages), itemsize, rank, save, write_a) + margin
        > limit
    ):
        stages -= 1
    return replace(cfg, num_stages=stages)


def _warp_specialized_runs(m: int, dtype: torch.dtype, on_gpu: bool) -> bool:
    """The Gluon kernels take 16-bit inputs and [128, 256] tiles; decode-sized batches (64 rows or
    fewer) keep the Triton kernels' small tiles, measured for them. Gluon kernels need a GPU: under
    the interpreter the Triton kernels run."""
    return on_gpu and hopper_ws.AVAILABLE and dtype in (torch.bfloat16, torch.float16) and m > 64


def forward_is_warp_specialized(m: int, dtype: torch.dtype, on_gpu: bool, save: Saved, write_a: bool) -> bool:
    """Whether the training forward runs the warp-specialized Gluon kernel (kernels/glu_forward_ws.py)
    instead of the Triton one.

    Faster when it saves something, slower in inference, which keeps the Triton kernel
    (docs/design/kernel-choice.md). The one caller that needs no ``a`` (the GLU operator's recompute
    backward) keeps the Triton kernel too, which can skip it.
    """
    return save != Saved.NOTHING and write_a and _warp_specialized_runs(m, dtype, on_gpu)


def backward_is_warp_specialized(m: int, dtype: torch.dtype, on_gpu: bool, save: Saved) -> bool:
    """Whether backward stage 1 runs the warp-specialized Gluon kernel (kernels/glu_backward_ws.py)
    instead of the Triton one.

    Faster for both kinds of saved tensor at the benchmark shapes (docs/design/kernel-choice.md).
    """
    return _warp_specialized_runs(m, dtype, on_gpu) and save in (Saved.FACTORS, Saved.PREACT)


#: Saved factors with at most this hidden size (the GEMM's K) take the warp-specialized backward's
#: ping-pong launch (kernels/glu_backward_ws.py): faster there, and larger hidden sizes are unmeasured
#: (docs/design/kernel-choice.md).
PING_PONG_MAX_HIDDEN = 4096


def routed_backward_is_warp_specialized(
    m: int, hidden: int, dtype: torch.dtype, on_gpu: bool, save: Saved
) -> bool:
    """Whether the routed experts' backward kernel is the warp-specialized ping-pong one
    (kernels/glu_backward_ws.py) rather than the Triton one: saved factors, at the hidden sizes the
    dense ping-pong launch takes (the GEMM's K; larger ones unmeasured)."""
    return (
        save == Saved.FACTORS and hidden <= PING_PONG_MAX_HIDDEN and _warp_specialized_runs(m, dtype, on_gpu)
    )


#: Warps per program of the FP8 path's passes (fp8/kernels.py): 4 (more programs per SM), the
#: fastest of 4, 8 and 16 for every pass on an H100 (docs/benchmarks/fp8/results.md, round FP8-3).
FP8_PASS_WARPS = 4


@dataclass(frozen=True)
class PassLaunch:
    """Launch of an FP8 SwiGLU pass: warps a program, groups (of ``a``'s rows, of the packed
    gradient) a program makes one after another, and the loads in flight ahead of the one being made."""

    warps: int
    groups: int
    stages: int


def fp8_forward_pass(save: int) -> PassLaunch:
    """In training (``save`` 1 or 2) 8 warps (4 spill) and 8 groups two loads deep: one program an SM
    at 8 warps, so the loop is what overlaps one group's loads with another's work (round FP8-5);
    at inference (``save`` 0) one group at 4 warps."""
    return PassLaunch(8, 8, 2) if save else PassLaunch(FP8_PASS_WARPS, 1, 1)


def fp8_gradient_pass(save: int) -> PassLaunch:
    """The FP8 SwiGLU gradient pass: one group a program at 4 warps (the loop untimed)."""
    return PassLaunch(FP8_PASS_WARPS, 1, 1)


# Small tiles under the interpreter: they keep CPU runs fast and make modest test shapes span many
# tiles, ragged edges and several persistent-loop iterations.
INTERPRETER_CONFIG = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)


#: Routed experts: the forward kernel walks each expert's group of rows in tiles of this many rows
#: (experts/routing.py), so that every tile belongs to one expert (a multiple of every forward tile's rows).
EXPERT_ROWS = 128 if not interpreting() else INTERPRETER_CONFIG.block_m


#: Routed experts with at most this many intermediate columns: the gate/up kernel reads x's rows by
#: index; wider ones gather x's rows first and read them through TMA. The gather is one pass over
#: [slots, H]; the indexed loads cost a little in every column tile, so narrow experts gain and wide
#: ones lose (measured at 768, 1024 and 14336 columns, docs/design/experts.md).
EXPERT_ROWS_BY_INDEX_MAX_INTER = 2048


def expert_rows_by_index(inter: int) -> bool:
    return inter <= EXPERT_ROWS_BY_INDEX_MAX_INTER


@functools.lru_cache(maxsize=256)
def forward_config(
    m: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    on_gpu: bool,
    save: Saved = Saved.NOTHING,
    precision: str = "tf32",
    routed: bool = False,
) -> TileConfig:
    """Tile of the gate/up GEMM + SwiGLU kernel for x [m, hidden] and a packed [2 * inter, hidden] weight.

    A [128, 256] packed tile with 3 stages and a flattened persistent loop (measured in
    docs/design/kernel-choice.md). Inference stores only ``a``, whose whole staging tile fits beside
    the three pipeline stages; training also stores the [128, 256] saved tile, so its epilogue goes
    out in two halves to stay inside shared memory. ``routed``: the routed experts' variant.
    """
    if not on_gpu:
        return INTERPRETER_CONFIG
    if routed:
        # Routed experts (a tile table, experts/routing.py): Triton cannot flatten the persistent loop around
        # the branch to a group's cut tile, and the cut tile's masked stores need registers that
        # only four epilogue pieces leave free (python -m fused_swiglu.bench.resources).
        dense = forward_config(m, hidden, inter, dtype, on_gpu, save, precision)
        return replace(dense, flatten=False, epilogue_split=4)
    block_k = 64 if dtype.itemsize == 2 else 32
    # Three-pass TF32 (fp32 with TF32 allowed) splits both operands in registers: the packed
    # [128, 256] tile spills with it (python -m fused_swiglu.bench.resources), a [128, 128] one does not.
    three_pass = precision == "tf32x3"
    if m <= 64:
        # Decode-sized batches stream the weight: a long BK (fewer, larger TMA copies) measured fastest.
        decode_k = block_k if three_pass else 2 * block_k
        return TileConfig(block_m=64, block_n=64, block_k=decode_k, num_warps=4, num_stages=4)
    if three_pass:
        return TileConfig(128, 64, block_k, num_warps=8, num_stages=3, epilogue_split=2, flatten=True)
    # fp32 training stores twice the bytes per piece, so its epilogue goes out in four pieces.
    split = 1 if save == Saved.NOTHING else (2 if dtype.itemsize == 2 else 4)
    return TileConfig(128, 128, block_k, num_warps=8, num_stages=3, epilogue_split=split, flatten=True)


@functools.lru_cache(maxsize=256)
def backward_config(
    m: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    on_gpu: bool,
    save: Saved = Saved.FACTORS,
    routed: bool = False,
) -> TileConfig:
    """Tile of the dY @ W_down + SwiGLU-gradient kernel (reduces over ``hidden``).

    A [128, 256] accumulator, as wide as the forward's (much faster than [128, 128]); its epilogue
    walks the [128, 512] saved tile in four pieces, so three pipeline stages still fit. The flattened
    persistent loop helps with saved pre-activations and at a short reduction (hidden <= 1024), and
    costs with factors over a long one (docs/design/kernel-choice.md). ``routed``: the routed
    experts' variant.
    """
    if not on_gpu:
        return INTERPRETER_CONFIG
    block_k = 64 if dtype.itemsize == 2 else 32
    if routed:
        # Routed experts: no flattened loop around the branch to a group's cut tile (as the routed
        # forward). The dense [128, 256] tile spills in the epilogue here (the routing weights'
        # gradient, a * w, the cut tile's masked stores) and still measured faster than the
        # [128, 128] tile that does not (docs/design/experts.md). 8 warps at decode sizes too.
        if m <= 64:
            return TileConfig(block_m=64, block_n=64, block_k=block_k, num_warps=8, num_stages=4)
        if dtype.itemsize == 4:
            return TileConfig(128, 128, block_k, num_warps=8, num_stages=3, epilogue_split=4)
        return TileConfig(128, 256, block_k, num_warps=8, num_stages=3, epilogue_split=4)
    if m <= 64:
        return TileConfig(block_m=64, block_n=64, block_k=block_k, num_warps=4, num_stages=4)
    flatten = save == Saved.PREACT or hidden <= 1024
    if dtype.itemsize == 4:
        # Twice the bytes per saved piece: a narrower tile, its epilogue in four pieces (in halves the
        # TF32 variant with saved pre-activations needs 241 KB of shared memory). Every fp32 precision
        # fits it without spilling, three-pass TF32 included (python -m fused_swiglu.bench.resources).
        return TileConfig(128, 128, block_k, num_warps=8, num_stages=3, epilogue_split=4, flatten=True)
    return TileConfig(128, 256, block_k, num_warps=8, num_stages=3, epilogue_split=4, flatten=flatten)
