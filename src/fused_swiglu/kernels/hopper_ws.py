"""What the warp-specialized Gluon kernels (Hopper) share: the release gate, tile order, packed-column
shuffles, the operand loader partition and the consumers' main loop, and host TMA descriptors.

Every warp-specialized kernel here has the same shape. Each persistent program splits its warps into
an operand loader (one warp: TMA copies of both GEMM operands into a ring of ``STAGES`` slots,
running ahead across tiles, held back only by slots not yet released), one or two more single-warp
partitions of its own (loading saved tiles, or storing results), and the consumers (wgmma over the
ring, then the epilogue): the default partition's two warpgroups on one tile, or, in a ping-pong
launch, two one-warpgroup partitions on alternate tiles taking turns at the main loop. The consumers
issue no operand loads, so the next tile's operands are in flight while they run an epilogue.

The partitions share shared memory passed as tuples: the ring is (A slots, B slots, "ready" barriers,
"free" barriers); the problem is (M, N, K, program id, number of programs). Tile sizes are read from
the descriptors and ring depths from the buffers.

Gluon kernels do not run under the Triton interpreter; there, and with any Triton release other than
the one these kernels were built and tested with, the Triton kernels run (``kernels/configs.py``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import triton

from .common import CHUNK, bind_cuda_context, cdiv, persistent_programs

#: Gluon is experimental and its API changes between releases (``warp_specialize`` took other
#: arguments before 3.6), so these kernels run only on the Triton minor release they were tested with.
TESTED_TRITON = (3, 6)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,  # noqa: F401 (for the kernel modules)
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    _release = re.match(r"(\d+)\.(\d+)", triton.__version__)
    AVAILABLE = _release is not None and tuple(map(int, _release.groups())) == TESTED_TRITON
except ImportError:  # a Triton without Gluon: the Triton kernels run instead
    AVAILABLE = False


if AVAILABLE:

    @gluon.jit
    def tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr):
        # kernels.common.tile_coords, again: a Gluon kernel cannot call a triton.jit function.
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        group_m = gl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m

    @gluon.jit
    def split_pieces(x, PIECES: gl.constexpr):
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
    def unpack(b, CHUNK_: gl.constexpr):
        """Packed [ROWS, WIDTH] -> (up, gate), [ROWS, WIDTH / 2] each, in intermediate-column order."""
        ROWS: gl.constexpr = b.shape[0]
        WIDTH: gl.constexpr = b.shape[1]
        b4 = gl.permute(gl.reshape(b, [ROWS, WIDTH // (2 * CHUNK_), 2, CHUNK_]), [0, 1, 3, 2])
        b_up, b_gate = gl.split(b4)
        return gl.reshape(b_up, [ROWS, WIDTH // 2]), gl.reshape(b_gate, [ROWS, WIDTH // 2])

    @gluon.jit
    def pack(b_up, b_gate, CHUNK_: gl.constexpr):
        """(up, gate) [ROWS, W] each -> packed [ROWS, 2W]: the inverse of ``unpack``."""
        ROWS: gl.constexpr = b_up.shape[0]
        W: gl.constexpr = b_up.shape[1]
        b_up = gl.reshape(b_up, [ROWS, W // CHUNK_, CHUNK_])
        b_gate = gl.reshape(b_gate, [ROWS, W // CHUNK_, CHUNK_])
        return gl.reshape(gl.permute(gl.join(b_up, b_gate), [0, 1, 3, 2]), [ROWS, 2 * W])

    @gluon.jit
    def silu_and_slope(b_g):
        """silu(g) and silu'(g) = s (1 + g (1 - s)), s = sigmoid(g), in fp32."""
        b_s = 1.0 / (1.0 + gl.exp(-b_g))
        return b_g * b_s, b_s * (1.0 + b_g * (1.0 - b_s))

    @gluon.jit
    def row_tile(i_m, BM: gl.constexpr, table):
        """(first row, expert, group end row) of row tile ``i_m``: from the routed experts' tile
        table (``[T, 3]`` int32: expert, first row, end row; experts/kernels/routes.py), else one weight."""
        if table is None:
            first, expert, end = i_m * BM, 0, 2147483647
        else:
            first, expert, end = (
                gl.load(table + 3 * i_m + 1),
                gl.load(table + 3 * i_m),
                gl.load(table + 3 * i_m + 2),
            )
        return first, expert, end

    @gluon.jit
    def operand_loader(
        a_desc, b_desc, ring, problem, BN: gl.constexpr, GROUP_M: gl.constexpr, B_K_MAJOR: gl.constexpr,
        table
    ):  # fmt: skip
        """Fill the ring with A [BM, BK] and B tiles for every tile of this program.

        B is either K-major, [B_ROWS, BK] at rows ``i_n * B_ROWS`` (the forward's packed weight, whose
        tile of BN intermediate columns is 2 * BN rows), or [BK, BN] at columns ``i_n * BN`` (W_down).
        With a tile ``table`` (routed experts) the row tiles are the table's, and B the tile's
        expert's: [E * K, N] read at rows ``expert * K`` (W_down; K-major B is not routed here).
        """
        a_bufs, b_bufs, ready, free = ring
        M, N, K, pid, nprog = problem
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        j = 0
        for tile in range(pid, num_m * num_n, nprog):
            i_m, i_n = tile_coords(tile, num_m, num_n, GROUP_M)
            o_m, expert, _ = row_tile(i_m, BM, table)
            for k in range(gl.cdiv(K, BK)):
                s = j % STAGES
                # A fresh barrier counts as released once, so the first lap does not wait.
                mbarrier.wait(free.index(s), ((j // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [o_m, k * BK], bar, a_bufs.index(s))
                if B_K_MAJOR:
                    b_at = [i_n * b_desc.block_type.shape[0], k * BK]
                else:
                    b_at = [expert * K + k * BK, i_n * BN]
                tma.async_copy_global_to_shared(b_desc, b_at, bar, b_bufs.index(s))
                j += 1

    @gluon.jit
    def mainloop(ring, acc, j, K, B_K_MAJOR: gl.constexpr):
        """acc += A @ B over K from the ring, slot ``j`` onward; returns (acc, the next slot count).

        One wgmma stays in flight: a slot goes back to the loader once the wgmma after it has
        started, i.e. once the one that read it has finished.
        """
        a_bufs, b_bufs, ready, free = ring
        BK: gl.constexpr = a_bufs.type.shape[2]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        for k in range(gl.cdiv(K, BK)):
            s = j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            b = b_bufs.index(s).permute((1, 0)) if B_K_MAJOR else b_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(free.index((j + STAGES - 1) % STAGES), count=1, pred=k > 0)
            j += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(free.index((j + STAGES - 1) % STAGES), count=1)
        return acc, j

    @gluon.jit
    def barriers(count: gl.constexpr):
        """``count`` mbarriers, each completing on one arrival (plus the TMA bytes it expects)."""
        bars = gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(count):
            mbarrier.init(bars.index(i), count=1)
        return bars

    @gluon.jit
    def ring_buffers(a_desc, b_desc, STAGES: gl.constexpr):
        """The operand ring: STAGES slots of A and B tiles, with their "ready" and "free" barriers."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        return a_bufs, b_bufs, barriers(STAGES), barriers(STAGES)


def check_pipeline(block_n: int, pieces: int, buffers: dict[str, int], store_lag: int) -> None:
    """Raise on a launch shape the kernels cannot run: epilogue pieces must be whole packed chunks,
    and every staging buffer ring must be deeper than the store lag, or a partition would wait for a
    buffer that is only released after its own wait (a deadlock, not an error, on the GPU)."""
    if pieces <= 0 or pieces & (pieces - 1) or block_n % pieces or (block_n // pieces) % CHUNK:
        raise ValueError(
            f"pieces must be a power of two that splits block_n {block_n} into multiples of {CHUNK} "
            f"columns, got {pieces}"
        )
    if store_lag < 1:
        raise ValueError(f"store_lag must be at least 1, got {store_lag}")
    for name, count in buffers.items():
        if count <= store_lag:
            raise ValueError(f"{name} must exceed store_lag ({store_lag}), got {count}")


@dataclass(frozen=True)
class WSLaunch:
    """What every warp-specialized launch shape has (``block_n`` counts intermediate columns)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    stages: int = 3
    # The epilogue walks the tile in this many column pieces, each through staging buffers.
    pieces: int = 16
    # A staging buffer is reused once the stores this many pieces back have read it.
    store_lag: int = 1
    # Registers per thread of each single-warp partition; the consumers get the rest of the file.
    worker_regs: int = 40
    # The launch's register limit: 12 warps (8 consumers, the workers' warpgroup) share 64K registers.
    max_registers: int = 168

    def staging_rings(self) -> dict[str, int]:
        """The depth of each ring of staging buffers, by field name."""
        return {}

    def __post_init__(self) -> None:
        check_pipeline(self.block_n, self.pieces, self.staging_rings(), self.store_lag)

    @property
    def piece_width(self) -> int:
        """Intermediate columns per epilogue piece."""
        return self.block_n // self.pieces

    def programs(self, m: int, inter: int, device: torch.device) -> int:
        """The persistent grid: one program per multiprocessor, never more than there are tiles."""
        return persistent_programs(cdiv(m, self.block_m) * cdiv(inter, self.block_n), device)

    def meta(self) -> dict:
        """The launch arguments every warp-specialized kernel takes."""
        return {
            "GROUP_M": self.group_m,
            "STAGES": self.stages,
            "LAG": self.store_lag,
            "CHUNK_": CHUNK,
            "WORKER_REGS": self.worker_regs,
            "num_warps": 8,
            "maxnreg": self.max_registers,
        }


@dataclass(frozen=True)
class PingPongLaunch(WSLaunch):
    """A ping-pong launch shape: two consumer partitions of one warpgroup each (consumer 0 is the
    default partition) on alternate tiles, so a program runs two tiles at a time.

    Combine it after a kernel's own config class (``class C(KernelConfig, PingPongLaunch)``): as a
    dataclass it carries every ``WSLaunch`` field with ``WSLaunch``'s default, and a base listed
    before the kernel's class would put those defaults back over the kernel's own."""

    # Registers per thread of consumer 1, a worker partition.
    consumer_regs: int = 232

    def programs(self, m: int, inter: int, device: torch.device) -> int:
        tiles = cdiv(m, self.block_m) * cdiv(inter, self.block_n)
        return persistent_programs(cdiv(tiles, 2), device)

    def meta(self) -> dict:
        return super().meta() | {"CONSUMER_REGS": self.consumer_regs, "num_warps": 4}


@functools.cache
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared layout of a TMA tile: a few per launch, the same ones every launch."""
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


def gluon_descriptor(t: torch.Tensor, block: list[int]):
    """A host TMA descriptor with the swizzled shared layout the kernels' buffers use."""
    if t.is_cuda:
        bind_cuda_context(t.device)
    return GluonDescriptor(t, list(t.shape), list(t.stride()), block, _shared_layout(tuple(block), t.dtype))
