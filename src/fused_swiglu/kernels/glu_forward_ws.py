"""The forward (x @ W_packed^T with the SwiGLU in the epilogue) as a warp-specialized kernel (Gluon,
Hopper).

The same results as ``glu_forward(...)`` with ``write_a=True``: ``a = down_multiplier *
silu(gate_multiplier * g) * u`` and, for training, the saved factors or the raw packed accumulator.
Besides the operand loader and the consumers (``hopper_ws``), each program has a storer (one warp):
the consumers write each epilogue piece (``a`` and the saved piece) into one of ``buffers`` staging
buffer pairs and go on; the storer sends the pair out by TMA and hands it back once its stores have
read it, ``store_lag`` pieces later. In the Triton kernel the warps that multiply also wait for each
store and issue every load; here they wait only for a free buffer pair. On the H200 that measured
faster than the Triton kernel at every benchmark shape (docs/design/kernel-choice.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import hopper_ws as ws
from .common import Saved, empty
from .hopper_ws import AVAILABLE, gluon_descriptor
from .launch import KernelLauncher, Tma

if AVAILABLE:
    from .hopper_ws import fence_async_shared, gl, gluon, mbarrier, tma


@dataclass(frozen=True)
class WSForwardConfig(ws.WSLaunch):
    """One launch shape of the warp-specialized forward: [128, 256] packed tiles (128 intermediate
    columns), the epilogue in 4 pieces of a [128, 32] and a saved [128, 64] (24 KB a pair), so 3
    staging pairs fit beside 3 stages."""

    block_n: int = 128
    pieces: int = 4
    buffers: int = 3
    store_lag: int = 2

    def staging_rings(self) -> dict[str, int]:
        return {"buffers": self.buffers}


#: Chosen among five drafts on the H200 (docs/design/kernel-choice.md).
CONFIG = WSForwardConfig()

if AVAILABLE:

    @gluon.jit
    def _storer(a_desc, s_desc, staged, problem, BN: gl.constexpr, GROUP_M: gl.constexpr, LAG: gl.constexpr):
        a_bufs, s_bufs, st_ready, st_free = staged
        M, N, K, pid, nprog = problem
        BM: gl.constexpr = a_desc.block_type.shape[0]
        W: gl.constexpr = a_desc.block_type.shape[1]  # intermediate columns per piece
        NBUF: gl.constexpr = a_bufs.type.shape[0]
        STORES: gl.constexpr = 1 if s_desc is None else 2  # TMA stores per piece
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        g = 0
        for tile in range(pid, num_m * num_n, nprog):
            i_m, i_n = ws.tile_coords(tile, num_m, num_n, GROUP_M)
            for p in gl.static_range(BN // W):
                b = g % NBUF
                mbarrier.wait(st_ready.index(b), (g // NBUF) & 1)
                col = i_n * BN + p * W
                tma.async_copy_shared_to_global(a_desc, [i_m * BM, col], a_bufs.index(b))
                if s_desc is not None:
                    tma.async_copy_shared_to_global(s_desc, [i_m * BM, 2 * col], s_bufs.index(b))
                # Once at most LAG pieces' stores are in flight, the pair LAG pieces back is free.
                tma.store_wait(pendings=STORES * LAG)
                mbarrier.arrive(st_free.index((g + NBUF - LAG) % NBUF), count=1, pred=g >= LAG)
                g += 1
        tma.store_wait(pendings=0)

    @gluon.jit
    def _consumers(
        a_desc, s_desc, ring, staged, problem, gate_multiplier, down_multiplier, BN: gl.constexpr,
        GROUP_M: gl.constexpr, SAVE: gl.constexpr, CHUNK_: gl.constexpr, num_warps: gl.constexpr
    ):  # fmt: skip
        a_bufs, s_bufs, st_ready, st_free = staged
        M, N, K, pid, nprog = problem
        BM: gl.constexpr = a_desc.block_type.shape[0]
        W: gl.constexpr = a_desc.block_type.shape[1]
        NBUF: gl.constexpr = a_bufs.type.shape[0]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 2 * BN, 16]
        )
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        j = 0
        g = 0
        for _tile in range(pid, num_m * num_n, nprog):
            acc, j = ws.mainloop(ring, gl.zeros([BM, 2 * BN], gl.float32, mma_layout), j, K, True)
            pieces = ws.split_pieces(acc, BN // W)  # packed pieces: whole chunks of up and gate columns
            for p in gl.static_range(BN // W):
                b_up, b_gate = ws.unpack(pieces[p], CHUNK_)
                b_silu, b_slope = ws.silu_and_slope(b_gate * gate_multiplier)
                b = g % NBUF
                mbarrier.wait(st_free.index(b), ((g // NBUF) & 1) ^ 1)
                a_bufs.index(b).store((b_silu * b_up * down_multiplier).to(a_desc.dtype))
                if SAVE == 1:
                    b_factors = ws.pack(b_silu, b_up * b_slope * gate_multiplier, CHUNK_)
                    s_bufs.index(b).store(b_factors.to(s_desc.dtype))
                elif SAVE == 2:
                    s_bufs.index(b).store(pieces[p].to(s_desc.dtype))
                fence_async_shared()
                mbarrier.arrive(st_ready.index(b), count=1)
                g += 1

    @gluon.jit
    def _glu_forward_ws_kernel(
        x_desc, w_desc, a_desc, s_desc, M, N, K, gate_multiplier, down_multiplier, GROUP_M: gl.constexpr,
        STAGES: gl.constexpr, NBUF: gl.constexpr, LAG: gl.constexpr, SAVE: gl.constexpr, CHUNK_: gl.constexpr,
        WORKER_REGS: gl.constexpr, num_warps: gl.constexpr
    ):  # fmt: skip
        """``s_desc`` is None in inference (``SAVE`` 0), else the saved tensor's (``Saved`` values)."""
        BN: gl.constexpr = w_desc.block_type.shape[0] // 2
        ring = ws.ring_buffers(x_desc, w_desc, STAGES)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NBUF] + a_desc.block_type.shape, a_desc.layout)
        if s_desc is not None:
            s_bufs = gl.allocate_shared_memory(s_desc.dtype, [NBUF] + s_desc.block_type.shape, s_desc.layout)
        else:
            s_bufs = a_bufs  # unused
        staged = (a_bufs, s_bufs, ws.barriers(NBUF), ws.barriers(NBUF))
        problem = (M, N, K, gl.program_id(0), gl.num_programs(0))
        gl.warp_specialize(
            [
                (
                    _consumers,
                    (
                        a_desc,
                        s_desc,
                        ring,
                        staged,
                        problem,
                        gate_multiplier,
                        down_multiplier,
                        BN,
                        GROUP_M,
                        SAVE,
                        CHUNK_,
                        num_warps,
                    ),
                ),  # fmt: skip
                (ws.operand_loader, (x_desc, w_desc, ring, problem, BN, GROUP_M, True, None)),
                (_storer, (a_desc, s_desc, staged, problem, BN, GROUP_M, LAG)),
            ],
            [1, 1],
            [WORKER_REGS, WORKER_REGS],
        )

    _launch_forward_ws = KernelLauncher(_glu_forward_ws_kernel, gluon_descriptor)


def glu_forward_ws(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    *,
    gate_multiplier: float,
    down_multiplier: float,
    save: Saved,
    config: WSForwardConfig = CONFIG,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``a`` [M, I] (scaled by ``down_multiplier``) and the saved packed [M, 2I] tensor (``None`` in
    inference), like ``glu_forward`` with ``write_a=True`` (bf16/fp16, sm_90).

    ``x`` [M, H] and ``w_packed`` [2I, H] must be TMA-addressable.
    """
    m, hidden = x.shape
    inter = w_packed.shape[0] // 2
    c = config
    width = c.piece_width
    a = empty((m, inter), x)
    saved = empty((m, 2 * inter), x) if save != Saved.NOTHING else None
    _launch_forward_ws(
        (c.programs(m, inter, x.device),),
        Tma(x, (c.block_m, c.block_k)),
        Tma(w_packed, (2 * c.block_n, c.block_k)),
        Tma(a, (c.block_m, width)),
        None if saved is None else Tma(saved, (c.block_m, 2 * width)),
        m,
        inter,
        hidden,
        float(gate_multiplier),
        float(down_multiplier),
        NBUF=c.buffers,
        SAVE=int(save),
        **c.meta(),
    )
    return a, saved
