"""Pieces every kernel family shares: allocation, the persistent grid, tile order, packed-column shuffles."""

from __future__ import annotations

import enum
import functools
import threading

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..layout import CHUNK


class Saved(enum.IntEnum):
    """What the forward kernel writes for the backward, besides its output."""

    NOTHING = 0  # inference
    FACTORS = 1  # [silu(g) | gate_multiplier * u * silu'(g)], packed [M, 2I]
    PREACT = 2  # [u | x @ Wg^T] as accumulated (gate_multiplier not applied), packed [M, 2I]

    @classmethod
    def of(cls, save: str) -> Saved:
        """What the training forward writes for the save mode ``save`` (``"recompute"``: nothing)."""
        return _SAVED_BY_MODE[save]


_SAVED_BY_MODE = {"factors": Saved.FACTORS, "preact": Saved.PREACT, "recompute": Saved.NOTHING}


#: Widest masked store of a routed tile in one piece: wider ones go in halves (registers, sm_90).
MASKED_COLUMNS = tl.constexpr(16)

#: Programs of a persistent launch on a CPU tensor (interpreter): small, so tests walk the tile loop.
INTERPRETER_PROGRAMS = 3


# Triton decides at import whether kernels run in its interpreter, so this is read once: launchers
# ask on every call (host time counts at decode sizes), and torch.compile sees a plain constant.
_INTERPRETING = bool(triton.knobs.runtime.interpret)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRETING


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids. Host code uses this rather than ``triton.cdiv``, which triton
    3.6 makes a constexpr function, microseconds a call on the host path of every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1); host-side, like ``cdiv``."""
    return 1 << (n - 1).bit_length()


#: The launch plan this thread is recording (plans.py), if any: told of each allocation and launch.
RECORDING = threading.local()


def empty(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every buffer a launcher hands to a kernel comes from here, on ``like``'s device, in ``dtype``
    (``like``'s by default): ``torch.empty``, which the tests fill with NaN."""
    recording = getattr(RECORDING, "active", None)
    if recording is not None:
        return recording.allocate(shape, dtype or like.dtype, like.device)
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def gradient_target(saved: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    """Where a backward launch writes the packed gradient: over ``saved`` (``grad`` None), or into
    ``grad``, which must match it in shape, dtype, device and strides and must not overlap it."""
    if grad is None:
        return saved
    same = (grad.shape, grad.dtype, grad.device, grad.stride()) == (
        saved.shape,
        saved.dtype,
        saved.device,
        saved.stride(),
    )
    if not same:
        raise ValueError(
            f"grad must match the saved tensor: got {tuple(grad.shape)} {grad.dtype} strides "
            f"{grad.stride()} on {grad.device}, saved is {tuple(saved.shape)} {saved.dtype} strides "
            f"{saved.stride()} on {saved.device}"
        )
    if grad.untyped_storage().data_ptr() == saved.untyped_storage().data_ptr():
        raise ValueError("grad shares memory with the saved tensor: leave grad None to write in place")
    return grad


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _shared_memory_limit(index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def shared_memory_limit(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device`` (the opt-in maximum)."""
    return _shared_memory_limit(device.index if device.index is not None else 0)


def persistent_programs(num_tiles: int, device: torch.device, per_sm: int = 1) -> int:
    """``per_sm`` programs per multiprocessor, never more than there are tiles."""
    if device.type == "cuda":
        return max(1, min(num_tiles, per_sm * _sm_count(device.index if device.index is not None else 0)))
    return max(1, min(num_tiles, INTERPRETER_PROGRAMS))


_thread_state = threading.local()


def bind_cuda_context(device: torch.device) -> None:
    """Make the device's primary CUDA context current in this thread, once per thread and device.

    Triton encodes a host ``TensorDescriptor`` through the CUDA driver before the launch itself makes
    a context current, and a thread that has not called the CUDA runtime yet has none: autograd's
    device thread when the fused backward is the first thing it runs, or any fresh user thread. The
    encode then fails with "invalid device context". Any runtime call binds the primary context.
    """
    bound = getattr(_thread_state, "cuda_devices", None)
    if bound is None:
        bound = _thread_state.cuda_devices = set()
    # A query would invalidate a CUDA graph being captured on this stream, so none is made then (a
    # capture begun from this thread has bound the context already); the thread is marked bound
    # only once a query has run.
    if device.index not in bound and not torch.cuda.is_current_stream_capturing():
        torch.cuda.current_stream(device).query()
        bound.add(device.index)


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A host-side TMA descriptor of ``t`` with tiles of ``block``."""
    if t.is_cuda:
        bind_cuda_context(t.device)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` if TMA can address it as is (unit last stride, 16-byte aligned base and rows), else a copy.

    Only the layout is fixed here; callers check beforehand that the row width itself is 16-byte aligned.
    """
    itemsize = t.element_size()
    if t.stride(-1) == 1 and (t.stride(0) * itemsize) % 16 == 0 and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def dot_precision(dtype: torch.dtype) -> str:
    """How ``tl.dot`` multiplies: fp32 follows PyTorch's TF32 switch, never less exact than ``torch.mm``.

    With TF32 allowed, fp32 runs three TF32 products per step ("tf32x3"), not one: a single TF32 pass
    on Hopper drops the low mantissa bits of each operand (truncation, where cuBLAS rounds), about
    three times eager PyTorch's error (docs/design/kernel-choice.md). Half precision inputs multiply
    exactly on tensor cores whatever the setting.
    """
    if dtype != torch.float32:
        return "tf32"
    return "tf32x3" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


@triton.jit
def tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) order: GROUP_M row-tiles sweep the column tiles together."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    i_m = first_m + (tile % per_group) % group_m
    i_n = (tile % per_group) // group_m
    return i_m, i_n


@triton.jit
def _store_rows(ptr, b, o_m, o_c, end, cols, BM: tl.constexpr, W: tl.constexpr):
    """``b`` [BM, W] at row ``o_m``, column ``o_c``, the rows before ``end`` only (32-bit offsets
    from the tile's first element)."""
    rows = tl.arange(0, BM)
    columns = tl.arange(0, W)
    first = ptr + o_m.to(tl.int64) * cols + o_c
    keep = (rows[:, None] < end - o_m) & (columns[None, :] < cols - o_c)
    tl.store(first + rows[:, None] * cols + columns[None, :], b, mask=keep)


@triton.jit
def _store_rows_in_halves(ptr, b, o_m, o_c, end, cols, BM: tl.constexpr, W: tl.constexpr):
    if W > MASKED_COLUMNS:
        b_lo, b_hi = split_halves(b, BM, W)
        _store_rows(ptr, b_lo, o_m, o_c, end, cols, BM, W // 2)
        _store_rows(ptr, b_hi, o_m, o_c + W // 2, end, cols, BM, W // 2)
    else:
        _store_rows(ptr, b, o_m, o_c, end, cols, BM, W)


@triton.jit
def store_tile(desc, ptr, b, o_m, o_c, end, cols, BM: tl.constexpr, W: tl.constexpr):
    """``b`` [BM, W] at row ``o_m``, column ``o_c`` of a [rows, ``cols``] tensor: through TMA, or,
    with ``ptr`` given (routed experts) and the tile past its group's ``end`` row, with masks."""
    if ptr is None:  # a compile-time branch: the dense kernel has no masked stores
        desc.store([o_m, o_c], b)
    else:
        if o_m + BM > end:
            if W > MASKED_COLUMNS:
                # In column halves (and quarters): one piece's addresses live at a time (registers).
                b_lo, b_hi = split_halves(b, BM, W)
                _store_rows_in_halves(ptr, b_lo, o_m, o_c, end, cols, BM, W // 2)
                _store_rows_in_halves(ptr, b_hi, o_m, o_c + W // 2, end, cols, BM, W // 2)
            else:
                _store_rows(ptr, b, o_m, o_c, end, cols, BM, W)
        else:
            desc.store([o_m, o_c], b)


@triton.jit
def split_halves(b, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """[ROWS, WIDTH] -> left [ROWS, WIDTH/2], right [ROWS, WIDTH/2] (register-only on MMA layouts)."""
    return tl.split(tl.permute(tl.reshape(b, (ROWS, 2, WIDTH // 2)), (0, 2, 1)))


@triton.jit
def unpack_columns(b, ROWS: tl.constexpr, WIDTH: tl.constexpr, CHUNK_: tl.constexpr):
    """Packed [ROWS, WIDTH] -> (up, gate), each [ROWS, WIDTH/2] in intermediate-column order."""
    b = tl.permute(tl.reshape(b, (ROWS, WIDTH // (2 * CHUNK_), 2, CHUNK_)), (0, 1, 3, 2))
    b_up, b_gate = tl.split(b)
    return tl.reshape(b_up, (ROWS, WIDTH // 2)), tl.reshape(b_gate, (ROWS, WIDTH // 2))


@triton.jit
def pack_columns(b_up, b_gate, ROWS: tl.constexpr, WIDTH: tl.constexpr, CHUNK_: tl.constexpr):
    """Inverse of ``unpack_columns``: (up, gate) [ROWS, WIDTH/2] -> packed [ROWS, WIDTH]."""
    b_up = tl.reshape(b_up, (ROWS, WIDTH // (2 * CHUNK_), CHUNK_))
    b_gate = tl.reshape(b_gate, (ROWS, WIDTH // (2 * CHUNK_), CHUNK_))
    b = tl.permute(tl.join(b_up, b_gate), (0, 1, 3, 2))
    return tl.reshape(b, (ROWS, WIDTH))


@triton.jit
def silu_and_slope(b_g):
    """silu(g) and its derivative s * (1 + g * (1 - s)), s = sigmoid(g), in fp32."""
    b_s = tl.sigmoid(b_g)
    return b_g * b_s, b_s * (1.0 + b_g * (1.0 - b_s))


__all__ = [
    "CHUNK",
    "Saved",
    "descriptor",
    "dot_precision",
    "empty",
    "interpreting",
    "pack_columns",
    "persistent_programs",
    "silu_and_slope",
    "split_halves",
    "store_tile",
    "tile_coords",
    "tma_ready",
    "unpack_columns",
]
