"""Backward stage 1 with saved factors as a warp-specialized kernel (Gluon, Hopper).

The same result as ``glu_backward_(..., kind=Saved.FACTORS)``: dA = out_scale * dY @ W_down, tile by
tile, meets the saved packed factors and overwrites them with [dU | dG], in place. What differs is
who waits for what. Each persistent program runs three partitions:

- an operand loader (one warp): TMA copies of dY and W_down into a ring of ``stages`` slots, running
  ahead across tiles, held back only by slots the consumers have not released;
- a saved-tile loader (one warp): TMA copies of the saved factors, one epilogue piece at a time, into
  ``saved_buffers`` buffers as soon as one is free, so a tile's pieces arrive during its main loop;
- the consumers (the default partition, two warpgroups): wgmma over the ring, then the epilogue, each
  piece of dA times its saved piece written back over the saved piece in shared memory and stored
  from there by TMA.

In the Triton kernel the warps that multiply also issue every load and wait for each saved piece at
the start of the epilogue; here the consumers issue no loads, and the next tile's operands and saved
pieces are in flight while they run the epilogue. On the H200 that measured 1-13% faster than the
Triton kernel at four shapes (docs/benchmarks/NOTES.md, item 30). Saved pre-activations keep the
Triton kernel.

Gluon kernels do not run under the Triton interpreter; there, and with any Triton release other than
the one this kernel was built and tested with, the Triton kernel runs (``kernels/configs.py``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import triton

from .common import CHUNK, bind_cuda_context, persistent_programs

#: Gluon is experimental and its API changes between releases (``warp_specialize`` took other
#: arguments before 3.6), so this kernel runs only on the Triton minor release it was tested with.
TESTED_TRITON = (3, 6)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    _release = re.match(r"(\d+)\.(\d+)", triton.__version__)
    AVAILABLE = _release is not None and tuple(map(int, _release.groups())) == TESTED_TRITON
except ImportError:  # a Triton without Gluon: the Triton kernel runs instead
    AVAILABLE = False


@dataclass(frozen=True)
class WSConfig:
    """One launch shape of the warp-specialized backward (``block_n`` counts intermediate columns)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    stages: int = 3
    # The epilogue walks the tile in this many column pieces, each through one of ``saved_buffers``
    # shared buffers: 16 pieces of [128, 32] use 8 KB each, so 8 buffers (64 KB) fit beside 3 stages.
    pieces: int = 16
    saved_buffers: int = 8
    # A buffer goes back to the saved-tile loader once the store this many pieces back has read it.
    store_lag: int = 1
    # Registers per thread of each loader warp; the consumers get the rest of the register file.
    loader_regs: int = 40
    # The launch's register limit: 12 warps (8 consumers, the loaders' warpgroup) share 64K registers.
    max_registers: int = 168


#: Chosen on the H200 from seven drafts at four shapes (raw/ws-backward-draft-2.log): the fastest or
#: within about 2% of the fastest at each, and faster than the Triton kernel at all four; the library
#: kernel's sweep agreed (raw/sweep-ws-backward-d03770a.log, benchmarks/sweep_ws_backward.py).
CONFIG = WSConfig()

if AVAILABLE:

    @gluon.jit
    def _tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr):
        # kernels.common.tile_coords, again: a Gluon kernel cannot call a triton.jit function.
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        group_m = gl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m

    @gluon.jit
    def _split_pieces(x, PIECES: gl.constexpr):
        """[ROWS, WIDTH] -> PIECES column pieces, left to right (register-only on the MMA layout)."""
        xs = (x,)
        for _ in gl.static_range(PIECES.bit_length() - 1):
            halves = ()
            for i in gl.static_range(len(xs)):
                y = xs[i]
                halves += y.reshape(y.shape[0], 2, y.shape[1] // 2).permute(0, 2, 1).split()
            xs = halves
        return xs

    @gluon.jit
    def _pack_twice(b, ROWS: gl.constexpr, W: gl.constexpr, CHUNK_: gl.constexpr):
        """[ROWS, W] -> [ROWS, 2W] in packed chunk order, both halves of every chunk equal to ``b``:
        dA lined up with the packed [silu(g) | gate_scale * u * silu'(g)] it multiplies."""
        b3 = gl.reshape(b, [ROWS, W // CHUNK_, CHUNK_])
        return gl.reshape(gl.permute(gl.join(b3, b3), [0, 1, 3, 2]), [ROWS, 2 * W])

    @gluon.jit
    def _operand_loader(
        dy_desc,
        wd_desc,
        a_bufs,
        b_bufs,
        ready,
        free,
        M,
        N,
        K,
        pid,
        nprog,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        num_k = gl.cdiv(K, BK)
        j = 0
        for tile in range(pid, num_m * num_n, nprog):
            i_m, i_n = _tile_coords(tile, num_m, num_n, GROUP_M)
            for k in range(num_k):
                s = j % STAGES
                # A fresh barrier counts as released once, so the first lap does not wait.
                mbarrier.wait(free.index(s), ((j // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, dy_desc.block_type.nbytes + wd_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(dy_desc, [i_m * BM, k * BK], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(wd_desc, [k * BK, i_n * BN], bar, b_bufs.index(s))
                j += 1

    @gluon.jit
    def _saved_loader(
        s_desc,
        s_bufs,
        s_ready,
        s_free,
        M,
        N,
        pid,
        nprog,
        BM: gl.constexpr,
        BN: gl.constexpr,
        PIECES: gl.constexpr,
        NSAVED: gl.constexpr,
        GROUP_M: gl.constexpr,
    ):
        W: gl.constexpr = BN // PIECES
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        g = 0
        for tile in range(pid, num_m * num_n, nprog):
            i_m, i_n = _tile_coords(tile, num_m, num_n, GROUP_M)
            for p in gl.static_range(PIECES):
                idx = g % NSAVED
                mbarrier.wait(s_free.index(idx), ((g // NSAVED) & 1) ^ 1)
                bar = s_ready.index(idx)
                mbarrier.expect(bar, s_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    s_desc, [i_m * BM, 2 * (i_n * BN + p * W)], bar, s_bufs.index(idx)
                )
                g += 1

    @gluon.jit
    def _epilogue_piece(
        b_da,
        g,
        s_desc,
        s_bufs,
        s_ready,
        s_free,
        o_m,
        col,
        BM: gl.constexpr,
        W: gl.constexpr,
        NSAVED: gl.constexpr,
        LAG: gl.constexpr,
        CHUNK_: gl.constexpr,
    ):
        packed_da = _pack_twice(b_da, BM, W, CHUNK_)
        idx = g % NSAVED
        buf = s_bufs.index(idx)
        mbarrier.wait(s_ready.index(idx), (g // NSAVED) & 1)
        b_grad = buf.load(packed_da.type.layout).to(gl.float32) * packed_da  # [dU | dG], packed
        buf.store(b_grad.to(s_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(s_desc, [o_m, col], buf)
        # The store LAG pieces back has read its buffer: hand that buffer back to the saved-tile loader.
        tma.store_wait(pendings=LAG)
        mbarrier.arrive(s_free.index((g + NSAVED - LAG) % NSAVED), count=1, pred=g >= LAG)
        return g + 1

    @gluon.jit
    def _consumers(
        s_desc,
        a_bufs,
        b_bufs,
        ready,
        free,
        s_bufs,
        s_ready,
        s_free,
        M,
        N,
        K,
        out_scale,
        pid,
        nprog,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        PIECES: gl.constexpr,
        NSAVED: gl.constexpr,
        LAG: gl.constexpr,
        CHUNK_: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        W: gl.constexpr = BN // PIECES
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
        )
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        num_k = gl.cdiv(K, BK)
        j = 0
        g = 0
        for tile in range(pid, num_m * num_n, nprog):
            i_m, i_n = _tile_coords(tile, num_m, num_n, GROUP_M)
            o_m = i_m * BM
            o_n = i_n * BN
            acc = gl.zeros([BM, BN], gl.float32, mma_layout)
            for k in range(num_k):
                s = j % STAGES
                mbarrier.wait(ready.index(s), (j // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # The previous step's MMA has finished reading its slot: give it back to the loader.
                mbarrier.arrive(free.index((j + STAGES - 1) % STAGES), count=1, pred=k > 0)
                j += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(free.index((j + STAGES - 1) % STAGES), count=1)
            pieces = _split_pieces(acc * out_scale, PIECES)  # y carries the down multiplier, so dA does too
            for p in gl.static_range(PIECES):
                g = _epilogue_piece(
                    pieces[p],
                    g,
                    s_desc,
                    s_bufs,
                    s_ready,
                    s_free,
                    o_m,
                    2 * (o_n + p * W),
                    BM,
                    W,
                    NSAVED,
                    LAG,
                    CHUNK_,
                )
        tma.store_wait(pendings=0)

    @gluon.jit
    def _glu_backward_ws_kernel(
        dy_desc,
        wd_desc,
        s_desc,
        M,
        N,
        K,
        out_scale,
        BM: gl.constexpr,
        BN: gl.constexpr,
        BK: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        PIECES: gl.constexpr,
        NSAVED: gl.constexpr,
        LAG: gl.constexpr,
        CHUNK_: gl.constexpr,
        LOADER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        W: gl.constexpr = BN // PIECES
        a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BM, BK], dy_desc.layout)
        b_bufs = gl.allocate_shared_memory(wd_desc.dtype, [STAGES, BK, BN], wd_desc.layout)
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [NSAVED, BM, 2 * W], s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        s_ready = gl.allocate_shared_memory(gl.int64, [NSAVED, 1], mbarrier.MBarrierLayout())
        s_free = gl.allocate_shared_memory(gl.int64, [NSAVED, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=1)
        for i in gl.static_range(NSAVED):
            mbarrier.init(s_ready.index(i), count=1)
            mbarrier.init(s_free.index(i), count=1)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        gl.warp_specialize(
            [
                (
                    _consumers,
                    (
                        s_desc,
                        a_bufs,
                        b_bufs,
                        ready,
                        free,
                        s_bufs,
                        s_ready,
                        s_free,
                        M,
                        N,
                        K,
                        out_scale,
                        pid,
                        nprog,
                        BM,
                        BN,
                        BK,
                        GROUP_M,
                        STAGES,
                        PIECES,
                        NSAVED,
                        LAG,
                        CHUNK_,
                        num_warps,
                    ),
                ),
                (
                    _operand_loader,
                    (
                        dy_desc,
                        wd_desc,
                        a_bufs,
                        b_bufs,
                        ready,
                        free,
                        M,
                        N,
                        K,
                        pid,
                        nprog,
                        BM,
                        BN,
                        BK,
                        GROUP_M,
                        STAGES,
                    ),
                ),
                (
                    _saved_loader,
                    (s_desc, s_bufs, s_ready, s_free, M, N, pid, nprog, BM, BN, PIECES, NSAVED, GROUP_M),
                ),
            ],
            [1, 1],
            [LOADER_REGS, LOADER_REGS],
        )


@functools.cache
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared layout of a TMA tile: three per launch, the same ones every launch."""
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


def _gluon_descriptor(t: torch.Tensor, block: list[int]):
    """A host TMA descriptor with the swizzled shared layout the kernel's buffers use."""
    if t.is_cuda:
        bind_cuda_context(t.device)
    return GluonDescriptor(t, list(t.shape), list(t.stride()), block, _shared_layout(tuple(block), t.dtype))


def glu_backward_factors_ws_(
    dy: torch.Tensor,
    w_down: torch.Tensor,
    saved: torch.Tensor,
    *,
    out_scale: float,
    config: WSConfig = CONFIG,
) -> None:
    """Overwrite the saved packed factors [M, 2I] with [dU | dG], in place (bf16/fp16, sm_90).

    ``dy`` [M, H] and ``w_down`` [H, I] must be TMA-addressable.
    """
    m, hidden = dy.shape
    inter = w_down.shape[1]
    c = config
    width = c.block_n // c.pieces
    num_tiles = triton.cdiv(m, c.block_m) * triton.cdiv(inter, c.block_n)
    _glu_backward_ws_kernel[(persistent_programs(num_tiles, dy.device),)](
        _gluon_descriptor(dy, [c.block_m, c.block_k]),
        _gluon_descriptor(w_down, [c.block_k, c.block_n]),
        _gluon_descriptor(saved, [c.block_m, 2 * width]),
        m,
        inter,
        hidden,
        float(out_scale),
        BM=c.block_m,
        BN=c.block_n,
        BK=c.block_k,
        GROUP_M=c.group_m,
        STAGES=c.stages,
        PIECES=c.pieces,
        NSAVED=c.saved_buffers,
        LAG=c.store_lag,
        CHUNK_=CHUNK,
        LOADER_REGS=c.loader_regs,
        num_warps=8,
        maxnreg=c.max_registers,
    )
