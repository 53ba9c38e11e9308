"""Backward stage 1 as a warp-specialized kernel (Gluon, Hopper), for saved factors or pre-activations.

The same result as ``glu_backward_(...)``: dA = down_multiplier * dY @ W_down, tile by tile, meets the saved
packed tile and overwrites it with [dU | dG], in place (or writes that to a tensor of its own, given
``grad``); with saved pre-activations it also writes the recomputed ``a`` (for dW_down). Besides the
operand loader and the consumers (``hopper_ws``), each program has a saved-tile loader (one warp):
TMA copies of the saved tile, one epilogue piece at a time, into ``saved_buffers`` buffers as soon
as one is free, so a tile's pieces arrive during its main loop. The consumers then multiply each
piece of dA by its saved piece, write the gradient over the saved piece in shared memory and store
it from there by TMA (through the saved tensor's descriptor in place, else the gradient's).

In the Triton kernel the warps that multiply also issue every load and wait for each saved piece at
the start of the epilogue; here they issue none. On the H200 that measured faster than the Triton
kernel at every benchmark shape (docs/design/kernel-choice.md).

Two launch shapes. Cooperative: both consumer warpgroups work on one [128, 256] tile, so the tensor
cores idle while they run its epilogue. Ping-pong (saved factors): each consumer warpgroup owns whole
[128, 128] tiles, alternate ones, and the two take turns at the main loop, so one's epilogue runs
while the other multiplies. The epilogue's share of a tile grows as the hidden size shrinks, and
so does what ping-pong gains (docs/design/kernel-choice.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import hopper_ws as ws
from .common import Saved, cdiv, empty, gradient_target, persistent_programs
from .configs import EXPERT_ROWS, PING_PONG_MAX_HIDDEN
from .hopper_ws import AVAILABLE, gluon_descriptor
from .launch import KernelLauncher, Tma

if AVAILABLE:
    from .hopper_ws import fence_async_shared, gl, gluon, mbarrier, tma


@dataclass(frozen=True)
class WSConfig(ws.WSLaunch):
    """One launch shape of the warp-specialized backward: [128, 256] tiles, the epilogue in 16
    pieces of [128, 32] saved columns (8 KB each), so 8 saved buffers (64 KB) fit beside 3 stages."""

    saved_buffers: int = 8
    # Saved pre-activations also stage ``a`` (4 KB a piece) in this many buffers of its own.
    a_buffers: int = 0

    def staging_rings(self) -> dict[str, int]:
        rings = {"saved_buffers": self.saved_buffers}
        return rings | ({"a_buffers": self.a_buffers} if self.a_buffers else {})


#: Per saved tensor (``Saved``), chosen among drafts on the H200 (docs/design/kernel-choice.md); with
#: saved pre-activations half the saved buffers are handed to ``a``.
CONFIGS = {Saved.FACTORS: WSConfig(), Saved.PREACT: WSConfig(saved_buffers=4, a_buffers=4)}


@dataclass(frozen=True)
class PingPongConfig(WSConfig, ws.PingPongLaunch):
    """The ping-pong launch shape (saved factors): one [128, 128] tile per consumer warpgroup, the
    epilogue in 8 pieces of [128, 32] saved columns; 5 stages (160 KB) and 4 saved buffers per
    consumer (64 KB). Besides the two consumers, the operand loader and one saved-tile loader per
    consumer (1 warp each)."""

    block_n: int = 128
    stages: int = 5
    pieces: int = 8
    saved_buffers: int = 4


@dataclass(frozen=True)
class RoutedPingPongConfig(PingPongConfig):
    """The routed experts' ping-pong launch: as ``PingPongConfig``, each saved buffer paired with a
    buffer of ``a``'s piece ([128, 16], 4 KB), so 4 stages (128 KB) beside the 96 KB of staging."""

    stages: int = 4


ROUTED_PING_PONG = RoutedPingPongConfig()


PING_PONG = PingPongConfig()


def backward_config(save: Saved, hidden: int) -> WSConfig:
    """The launch shape for this saved tensor and hidden size."""
    if save == Saved.FACTORS and hidden <= PING_PONG_MAX_HIDDEN:
        return PING_PONG
    return CONFIGS[save]


if AVAILABLE:

    @gluon.jit
    def _saved_loader(
        s_desc, saved, problem, BN: gl.constexpr, GROUP_M: gl.constexpr, FIRST: gl.constexpr,
        STEP: gl.constexpr, table, a_desc, a_bufs
    ):  # fmt: skip
        """The saved pieces of tiles ``pid + (FIRST + STEP * n) * nprog``: every tile of this program for
        one consumer group (0, 1), or every other one starting at FIRST for two (FIRST, 2). Routed
        experts (``table``, ``a_desc``): each saved piece with ``a``'s piece, into ``a_bufs`` beside it."""
        s_bufs, s_ready, s_free = saved
        M, N, K, pid, nprog = problem
        BM: gl.constexpr = s_desc.block_type.shape[0]
        W: gl.constexpr = s_desc.block_type.shape[1] // 2  # intermediate columns per piece
        NSAVED: gl.constexpr = s_bufs.type.shape[0]
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        g = 0
        for tile in range(pid + FIRST * nprog, num_m * num_n, STEP * nprog):
            i_m, i_n = ws.tile_coords(tile, num_m, num_n, GROUP_M)
            o_m, _, _ = ws.row_tile(i_m, BM, table)
            for p in gl.static_range(BN // W):
                idx = g % NSAVED
                mbarrier.wait(s_free.index(idx), ((g // NSAVED) & 1) ^ 1)
                bar = s_ready.index(idx)
                o_n = i_n * BN + p * W
                if a_desc is None:
                    mbarrier.expect(bar, s_desc.block_type.nbytes)
                else:
                    mbarrier.expect(bar, s_desc.block_type.nbytes + a_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(a_desc, [o_m, o_n], bar, a_bufs.index(idx))
                tma.async_copy_global_to_shared(s_desc, [o_m, 2 * o_n], bar, s_bufs.index(idx))
                g += 1

    @gluon.jit
    def _gradient_piece(
        b_da, b_saved, gate_multiplier, down_multiplier, PREACT: gl.constexpr, CHUNK_: gl.constexpr
    ):
        """[dU | dG] (packed) of one piece, and down_multiplier * a where the saved piece is [u | g]."""
        if PREACT:
            b_u, b_g = ws.unpack(b_saved, CHUNK_)
            # The same element-to-thread map as b_da, written differently after the reshapes: no data moves.
            b_u = gl.convert_layout(b_u, b_da.type.layout)
            b_silu, b_slope = ws.silu_and_slope(gl.convert_layout(b_g, b_da.type.layout) * gate_multiplier)
            b_grad = ws.pack(b_da * b_silu, b_da * b_u * b_slope * gate_multiplier, CHUNK_)
            b_a = b_silu * b_u * down_multiplier
        else:
            # The saved [silu(g) | gate_multiplier * u * silu'(g)] times dA lined up with both halves.
            b_grad = b_saved * ws.pack(b_da, b_da, CHUNK_)
            b_a = b_da  # unused
        return b_grad, b_a

    @gluon.jit
    def _epilogue_piece(
        b_da, g, s_desc, g_desc, saved, a_desc, a_bufs, o_m, o_n, gate_multiplier, down_multiplier,
        LAG: gl.constexpr, CHUNK_: gl.constexpr
    ):  # fmt: skip
        """Piece ``g`` of this program: ``b_da`` [BM, W] is dA for intermediate columns [o_n, o_n + W)."""
        PREACT: gl.constexpr = a_desc is not None
        s_bufs, s_ready, s_free = saved
        NSAVED: gl.constexpr = s_bufs.type.shape[0]
        packed_layout: gl.constexpr = ws.pack(b_da, b_da, CHUNK_).type.layout
        idx = g % NSAVED
        buf = s_bufs.index(idx)
        mbarrier.wait(s_ready.index(idx), (g // NSAVED) & 1)
        b_saved = buf.load(packed_layout).to(gl.float32)
        b_grad, b_a = _gradient_piece(b_da, b_saved, gate_multiplier, down_multiplier, PREACT, CHUNK_)
        buf.store(b_grad.to(s_desc.dtype))
        if PREACT:
            a_buf = a_bufs.index(g % a_bufs.type.shape[0])
            a_buf.store(b_a.to(a_desc.dtype))
        fence_async_shared()
        if g_desc is None:  # in place
            tma.async_copy_shared_to_global(s_desc, [o_m, 2 * o_n], buf)
        else:
            tma.async_copy_shared_to_global(g_desc, [o_m, 2 * o_n], buf)
        if PREACT:
            tma.async_copy_shared_to_global(a_desc, [o_m, o_n], a_buf)
        # Once at most LAG pieces' stores are in flight, the saved buffer LAG pieces back is free: hand
        # it back to the saved-tile loader. An ``a`` buffer is next written LAG or more pieces later.
        tma.store_wait(pendings=(2 if PREACT else 1) * LAG)
        mbarrier.arrive(s_free.index((g + NSAVED - LAG) % NSAVED), count=1, pred=g >= LAG)
        return g + 1

    @gluon.jit
    def _masked_store(buf, ptr, o_m, o_c, end, stride, num_warps: gl.constexpr):
        """Rows of ``buf`` [BM, C] before ``end`` to ``ptr`` at (o_m, o_c), a contiguous tensor of
        rows ``stride`` wide: a group's cut tile, whose TMA store would also write the next group's
        first rows."""
        BM: gl.constexpr = buf.type.shape[0]
        C: gl.constexpr = buf.type.shape[1]
        ACROSS: gl.constexpr = C // 8  # threads along a row, 16 bytes each
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // ACROSS, ACROSS], [num_warps, 1], [1, 0])
        rows = o_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        cols = o_c + gl.arange(0, C, layout=gl.SliceLayout(0, layout))
        at = ptr + rows[:, None].to(gl.int64) * stride + cols[None, :]
        gl.store(at, buf.load(layout), mask=(rows[:, None] < end) & (cols[None, :] < stride))

    @gluon.jit
    def _routed_piece(
        b_da, g, s_desc, a_desc, saved, a_bufs, o_m, o_n, end, routed, WRITE_A: gl.constexpr,
        LAG: gl.constexpr, CHUNK_: gl.constexpr, num_warps: gl.constexpr
    ):  # fmt: skip
        """Piece ``g`` of a routed tile (saved factors): ``b_da`` [BM, W] is the gradient of ``a * w``
        for intermediate columns [o_n, o_n + W) of rows [o_m, end); its routing weights' gradient
        (a partial row sum), ``a * w`` over ``a`` (``WRITE_A``) and [dU | dG] over the factors."""
        r_ptr, p_ptr, s_ptr, a_ptr, N, P_STRIDE = routed
        s_bufs, s_ready, s_free = saved
        NSAVED: gl.constexpr = s_bufs.type.shape[0]
        BM: gl.constexpr = b_da.shape[0]
        W: gl.constexpr = b_da.shape[1]
        packed_layout: gl.constexpr = ws.pack(b_da, b_da, CHUNK_).type.layout
        idx = g % NSAVED
        buf = s_bufs.index(idx)
        a_buf = a_bufs.index(idx)
        rows = o_m + gl.arange(0, BM, layout=gl.SliceLayout(1, b_da.type.layout))
        live = rows < end
        b_w = gl.load(r_ptr + rows, mask=live, other=0.0).to(gl.float32)
        mbarrier.wait(s_ready.index(idx), (g // NSAVED) & 1)
        b_a = a_buf.load(b_da.type.layout).to(gl.float32)
        if p_ptr is not None:
            # One partial sum per row and piece, summed after the kernel: the same result every run.
            gl.store(p_ptr + (o_n // W).to(gl.int64) * P_STRIDE + rows, gl.sum(b_da * b_a, axis=1), mask=live)
        if WRITE_A:
            a_buf.store((b_a * b_w[:, None]).to(a_desc.dtype))  # a * w, what dW_down reads
        b_da = b_da * b_w[:, None]  # the gradient of a
        b_grad = buf.load(packed_layout).to(gl.float32) * ws.pack(b_da, b_da, CHUNK_)
        buf.store(b_grad.to(s_desc.dtype))
        if end - o_m >= BM:
            fence_async_shared()
            tma.async_copy_shared_to_global(s_desc, [o_m, 2 * o_n], buf)
            if WRITE_A:
                tma.async_copy_shared_to_global(a_desc, [o_m, o_n], a_buf)
            tma.store_wait(pendings=(2 if WRITE_A else 1) * LAG)
        else:
            _masked_store(buf, s_ptr, o_m, 2 * o_n, end, 2 * N, num_warps)
            if WRITE_A:
                _masked_store(a_buf, a_ptr, o_m, o_n, end, N, num_warps)
            # No stores of this piece in flight: those of the pieces before it must be done.
            tma.store_wait(pendings=0)
        mbarrier.arrive(s_free.index((g + NSAVED - LAG) % NSAVED), count=1, pred=g >= LAG)
        return g + 1

    @gluon.jit
    def _consumers(
        s_desc, g_desc, a_desc, ring, saved, a_bufs, turns, problem, gate_multiplier, down_multiplier,
        BN: gl.constexpr, GROUP_M: gl.constexpr, LAG: gl.constexpr, CHUNK_: gl.constexpr, FIRST: gl.constexpr,
        STEP: gl.constexpr, num_warps: gl.constexpr, table, routed, WRITE_A: gl.constexpr
    ):  # fmt: skip
        """One consumer group's tiles, ``pid + (FIRST + STEP * n) * nprog`` (see ``_saved_loader``).
        Routed experts (``table``): the tiles are the table's, and ``_routed_piece`` their epilogue
        (``a_desc`` then is ``a``'s, read with the factors; ``routed`` its other arguments).

        The operand loader fills the ring with every tile of the program in order, so the program's
        t-th tile starts at ring position t * num_k. ``turns`` is None for one group; for two it is
        (mine, other): a group starts the main loop of the program's tile t once the other has
        finished the main loop of tile t - 1, and hands the turn over when its own is done.
        Taking turns is what overlaps one group's epilogue with the other's main loop. It also keeps
        every wait on a ring slot at most one phase ahead of the loader: a parity wait on a slot
        whose barrier is two phases behind reads as complete (untaken turns crashed the kernel).
        """
        M, N, K, pid, nprog = problem
        BM: gl.constexpr = s_desc.block_type.shape[0]
        BK: gl.constexpr = ring[0].type.shape[2]
        W: gl.constexpr = s_desc.block_type.shape[1] // 2
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
        )
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        num_k = gl.cdiv(K, BK)
        g = 0
        for tile in range(pid + FIRST * nprog, num_m * num_n, STEP * nprog):
            i_m, i_n = ws.tile_coords(tile, num_m, num_n, GROUP_M)
            o_m, _, end = ws.row_tile(i_m, BM, table)
            t = (tile - pid) // nprog  # the program's t-th tile
            if turns is not None:
                # The other group has taken (t + 1) // 2 turns before tile t (tile 0 waits for none):
                # wait for that many phases of ``mine`` to complete.
                mbarrier.wait(turns[0], ((t + 1) // 2 + 1) & 1, pred=t > 0)
            acc, _ = ws.mainloop(ring, gl.zeros([BM, BN], gl.float32, mma_layout), t * num_k, K, False)
            if turns is not None:
                mbarrier.arrive(turns[1], count=1)
            # y carries the down multiplier, so dA does too
            pieces = ws.split_pieces(acc * down_multiplier, BN // W)
            for p in gl.static_range(BN // W):
                if table is None:
                    g = _epilogue_piece(
                        pieces[p], g, s_desc, g_desc, saved, a_desc, a_bufs, o_m, i_n * BN + p * W,
                        gate_multiplier, down_multiplier, LAG, CHUNK_
                    )  # fmt: skip
                else:
                    g = _routed_piece(
                        pieces[p], g, s_desc, a_desc, saved, a_bufs, o_m, i_n * BN + p * W, end, routed,
                        WRITE_A, LAG, CHUNK_, num_warps
                    )  # fmt: skip
        tma.store_wait(pendings=0)

    @gluon.jit
    def _saved_staging(s_desc, NSAVED: gl.constexpr):
        """NSAVED buffers for saved pieces with their "ready" and "free" barriers."""
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [NSAVED] + s_desc.block_type.shape, s_desc.layout)
        return s_bufs, ws.barriers(NSAVED), ws.barriers(NSAVED)

    @gluon.jit
    def _glu_backward_ws_kernel(
        dy_desc, wd_desc, s_desc, g_desc, a_desc, M, N, K, gate_multiplier, down_multiplier,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, NSAVED: gl.constexpr, NA: gl.constexpr,
        LAG: gl.constexpr, CHUNK_: gl.constexpr, WORKER_REGS: gl.constexpr, num_warps: gl.constexpr
    ):  # fmt: skip
        """``a_desc`` is None for saved factors (nothing to recompute), ``a``'s descriptor for [u | g]."""
        BN: gl.constexpr = wd_desc.block_type.shape[1]
        ring = ws.ring_buffers(dy_desc, wd_desc, STAGES)
        saved = _saved_staging(s_desc, NSAVED)
        if a_desc is not None:
            a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NA] + a_desc.block_type.shape, a_desc.layout)
        else:
            a_bufs = saved[0]  # unused: nothing to recompute (a partition argument cannot be None)
        problem = (M, N, K, gl.program_id(0), gl.num_programs(0))
        gl.warp_specialize(
            [
                (
                    _consumers,
                    (
                        s_desc,
                        g_desc,
                        a_desc,
                        ring,
                        saved,
                        a_bufs,
                        None,
                        problem,
                        gate_multiplier,
                        down_multiplier,
                        BN,
                        GROUP_M,
                        LAG,
                        CHUNK_,
                        0,
                        1,
                        num_warps,
                        None,
                        None,
                        False,
                    ),
                ),  # fmt: skip
                (ws.operand_loader, (dy_desc, wd_desc, ring, problem, BN, GROUP_M, False, None)),
                (_saved_loader, (s_desc, saved, problem, BN, GROUP_M, 0, 1, None, None, saved[0])),
            ],
            [1, 1],
            [WORKER_REGS, WORKER_REGS],
        )

    @gluon.jit
    def _glu_backward_pp_kernel(
        dy_desc, wd_desc, s_desc, g_desc, M, N, K, down_multiplier, GROUP_M: gl.constexpr,
        STAGES: gl.constexpr, NSAVED: gl.constexpr, LAG: gl.constexpr, CHUNK_: gl.constexpr,
        WORKER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr
    ):  # fmt: skip
        """Saved factors, two consumer groups of ``num_warps`` warps taking turns (ping-pong)."""
        BN: gl.constexpr = wd_desc.block_type.shape[1]
        ring = ws.ring_buffers(dy_desc, wd_desc, STAGES)
        saved0 = _saved_staging(s_desc, NSAVED)
        saved1 = _saved_staging(s_desc, NSAVED)
        turns = ws.barriers(2)
        problem = (M, N, K, gl.program_id(0), gl.num_programs(0))
        turn0 = (turns.index(0), turns.index(1))
        turn1 = (turns.index(1), turns.index(0))
        # gate_multiplier (1.0 here) is already in the saved factors; the saved buffers stand in for
        # the unused a buffers.
        gl.warp_specialize(
            [
                (
                    _consumers,
                    (s_desc, g_desc, None, ring, saved0, saved0[0], turn0, problem, 1.0, down_multiplier, BN,
                     GROUP_M, LAG, CHUNK_, 0, 2, num_warps, None, None, False),
                ),
                (
                    _consumers,
                    (s_desc, g_desc, None, ring, saved1, saved1[0], turn1, problem, 1.0, down_multiplier, BN,
                     GROUP_M, LAG, CHUNK_, 1, 2, num_warps, None, None, False),
                ),
                (ws.operand_loader, (dy_desc, wd_desc, ring, problem, BN, GROUP_M, False, None)),
                (_saved_loader, (s_desc, saved0, problem, BN, GROUP_M, 0, 2, None, None, saved0[0])),
                (_saved_loader, (s_desc, saved1, problem, BN, GROUP_M, 1, 2, None, None, saved1[0])),
            ],
            [num_warps, 1, 1, 1],
            [CONSUMER_REGS, WORKER_REGS, WORKER_REGS, WORKER_REGS],
        )  # fmt: skip

    @gluon.jit
    def _routed_backward_pp_kernel(
        dy_desc, wd_desc, s_desc, a_desc, t_ptr, used_ptr, r_ptr, p_ptr, s_ptr, a_ptr, N, K, P_STRIDE,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, NSAVED: gl.constexpr, LAG: gl.constexpr,
        CHUNK_: gl.constexpr, WRITE_A: gl.constexpr, WORKER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        num_warps: gl.constexpr
    ):  # fmt: skip
        """Routed experts, saved factors, ping-pong: the rows of the tile table's ``used_ptr`` tiles
        (``t_ptr``, one of each kernel tile's rows), W_down [E * K, N] read at each tile's expert."""
        BN: gl.constexpr = wd_desc.block_type.shape[1]
        BM: gl.constexpr = dy_desc.block_type.shape[0]
        ring = ws.ring_buffers(dy_desc, wd_desc, STAGES)
        saved0 = _saved_staging(s_desc, NSAVED)
        saved1 = _saved_staging(s_desc, NSAVED)
        a_bufs0 = gl.allocate_shared_memory(a_desc.dtype, [NSAVED] + a_desc.block_type.shape, a_desc.layout)
        a_bufs1 = gl.allocate_shared_memory(a_desc.dtype, [NSAVED] + a_desc.block_type.shape, a_desc.layout)
        turns = ws.barriers(2)
        problem = (gl.load(used_ptr) * BM, N, K, gl.program_id(0), gl.num_programs(0))
        turn0 = (turns.index(0), turns.index(1))
        turn1 = (turns.index(1), turns.index(0))
        routed = (r_ptr, p_ptr, s_ptr, a_ptr, N, P_STRIDE)
        gl.warp_specialize(
            [
                (
                    _consumers,
                    (s_desc, None, a_desc, ring, saved0, a_bufs0, turn0, problem, 1.0, 1.0, BN, GROUP_M, LAG,
                     CHUNK_, 0, 2, num_warps, t_ptr, routed, WRITE_A),
                ),
                (
                    _consumers,
                    (s_desc, None, a_desc, ring, saved1, a_bufs1, turn1, problem, 1.0, 1.0, BN, GROUP_M, LAG,
                     CHUNK_, 1, 2, num_warps, t_ptr, routed, WRITE_A),
                ),
                (ws.operand_loader, (dy_desc, wd_desc, ring, problem, BN, GROUP_M, False, t_ptr)),
                (_saved_loader, (s_desc, saved0, problem, BN, GROUP_M, 0, 2, t_ptr, a_desc, a_bufs0)),
                (_saved_loader, (s_desc, saved1, problem, BN, GROUP_M, 1, 2, t_ptr, a_desc, a_bufs1)),
            ],
            [num_warps, 1, 1, 1],
            [CONSUMER_REGS, WORKER_REGS, WORKER_REGS, WORKER_REGS],
        )  # fmt: skip

    _launch_backward_ws = KernelLauncher(_glu_backward_ws_kernel, gluon_descriptor)
    _launch_backward_pp = KernelLauncher(_glu_backward_pp_kernel, gluon_descriptor)
    _launch_routed_backward = KernelLauncher(_routed_backward_pp_kernel, gluon_descriptor)


def glu_backward_ws_(
    dy: torch.Tensor,
    w_down: torch.Tensor,
    saved: torch.Tensor,
    *,
    save: Saved,
    gate_multiplier: float,
    down_multiplier: float,
    config: WSConfig | None = None,
    grad: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Write [dU | dG] over the saved packed [M, 2I] tensor, in place, or into ``grad`` (the same
    shape and strides) where given, leaving the saved tensor as it was (bf16/fp16, sm_90).

    Returns the recomputed ``down_multiplier * a`` [M, I] for saved pre-activations, ``None`` for factors.
    ``dy`` [M, H] and ``w_down`` [H, I] must be TMA-addressable.
    """
    if save not in CONFIGS:
        raise ValueError(f"the backward kernel reads saved factors or pre-activations, got {save!r}")
    m, hidden = dy.shape
    inter = w_down.shape[1]
    c = config or backward_config(save, hidden)
    if save == Saved.PREACT and isinstance(c, PingPongConfig):
        raise ValueError("the ping-pong launch reads saved factors only")
    if save == Saved.PREACT and not c.a_buffers:
        raise ValueError("saved pre-activations need a_buffers for the recomputed a")
    width = c.piece_width
    descriptors = (
        Tma(dy, (c.block_m, c.block_k)),
        Tma(w_down, (c.block_k, c.block_n)),
        Tma(saved, (c.block_m, 2 * width)),
        None if grad is None else Tma(gradient_target(saved, grad), (c.block_m, 2 * width)),
    )
    grid = (c.programs(m, inter, dy.device),)
    if isinstance(c, PingPongConfig):
        _launch_backward_pp(
            grid,
            *descriptors,
            m,
            inter,
            hidden,
            float(down_multiplier),
            NSAVED=c.saved_buffers,
            **c.meta(),
        )
        return None
    a = empty((m, inter), dy) if save == Saved.PREACT else None
    _launch_backward_ws(
        grid,
        *descriptors,
        None if a is None else Tma(a, (c.block_m, width)),
        m,
        inter,
        hidden,
        float(gate_multiplier),
        float(down_multiplier),
        NSAVED=c.saved_buffers,
        NA=max(c.a_buffers, 1),
        **c.meta(),
    )
    return a


def routed_glu_backward_ws_(
    dy_rows: torch.Tensor,
    w_down: torch.Tensor,
    saved: torch.Tensor,
    a: torch.Tensor,
    row_weights: torch.Tensor,
    tiles: torch.Tensor,
    used_tiles: torch.Tensor,
    *,
    need_row_grad: bool,
    write_scaled_a: bool,
    config: RoutedPingPongConfig | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``kernels.glu_backward.routed_glu_backward_`` with saved factors (and ``a``), warp-specialized
    (bf16/fp16, sm_90): the same arguments and results, the row tiles of ``tiles`` of
    ``ROUTED_PING_PONG.block_m`` rows (the table's)."""
    c = config or ROUTED_PING_PONG
    if c.block_m != EXPERT_ROWS:
        raise ValueError(f"the kernel's tiles are the table's: {EXPERT_ROWS} rows, not {c.block_m}")
    m, hidden = dy_rows.shape
    experts, _, inter = w_down.shape
    width = c.piece_width
    # Every piece of every column tile has its partial sum (0 past the width), so each is written.
    pieces = cdiv(inter, c.block_n) * c.pieces
    partials = torch.empty((pieces, m), dtype=torch.float32, device=dy_rows.device) if need_row_grad else None
    tile_count = tiles.shape[0] * cdiv(inter, c.block_n)
    _launch_routed_backward(
        (persistent_programs(cdiv(tile_count, 2), dy_rows.device),),
        Tma(dy_rows, (c.block_m, c.block_k)),
        Tma(w_down.view(experts * hidden, inter), (c.block_k, c.block_n)),
        Tma(saved, (c.block_m, 2 * width)),
        Tma(a, (c.block_m, width)),
        tiles,
        used_tiles,
        row_weights,
        partials,
        saved,
        a,
        inter,
        hidden,
        m,  # the partials: one row of m per piece
        NSAVED=c.saved_buffers,
        WRITE_A=write_scaled_a,
        **c.meta(),
    )
    return (None if partials is None else partials.sum(0)), (a if write_scaled_a else None)
