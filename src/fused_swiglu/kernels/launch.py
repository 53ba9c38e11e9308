"""Launch a compiled kernel again without Triton's per-call argument binding.

``kernel[grid](...)`` binds and specializes every argument, builds the kernel cache key from them and
validates every host TMA descriptor, on every call: most of the host time of issuing a fused call
(docs/design/one-path.md, "Host time per call").

A ``KernelLauncher`` lets Triton do that once per *launch key*: everything Triton specializes on, read
from the arguments directly (tensor dtypes and 16-byte alignment, integers equal to 1 or divisible by
16, descriptor blocks, ``None``, the constexprs and launch options, the device and Triton's debug
switches). Later calls with the same key go straight to the compiled kernel's launcher. The key
must be at least as fine as Triton's own: two calls that Triton would compile differently may never
share one. With ``VERIFY`` set (the GPU tests set it), every call also goes through Triton, which
must pick the compiled kernel the key points to.

The direct launch calls the compiled kernel's C launcher itself, past Triton's Python wrappers around
it, and encodes a host TMA descriptor once per tensor address, shape and strides (a descriptor is a
function of them and the kernel's tile, so a reused one is the one Triton would encode; a training
loop's caching allocator hands the same addresses back step after step). It uses Triton's internals
(``CompiledKernel.run`` and the launcher's arguments), so it is used with triton 3.6 only, where it
was built and tested. With other releases, under the interpreter, and while a launch hook is
installed (a profiler), every call goes through ``kernel[grid]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton

from .common import RECORDING, bind_cuda_context, interpreting

#: Whether a cached launch may call the compiled kernel directly (see the module docstring).
DIRECT = triton.__version__.startswith("3.6.") and not interpreting()

#: Every call also goes through Triton, which must choose the compiled kernel the launch key points
#: to (else RuntimeError). For tests: it costs Triton's full launch path and launches twice.
VERIFY = False


class Tma(NamedTuple):
    """A tensor the kernel takes as a host TMA descriptor, with tiles of ``block``."""

    tensor: torch.Tensor
    block: tuple[int, ...]


class _HostTma(NamedTuple):
    """What Triton's launcher reads of a host descriptor (the checks ran at the key's first call)."""

    base: torch.Tensor
    shape: list[int]
    strides: list[int]
    padding: str = "zero"


def _key_of(arg: Any) -> Any:
    """What Triton's specialization can see of one runtime argument (and a little more: a finer key
    only costs another first call)."""
    if isinstance(arg, Tma):
        t = arg.tensor
        shape, strides, size = t.shape, t.stride(), t.dtype.itemsize
        return (
            "tma",
            t.device,
            t.dtype,
            arg.block,
            t.data_ptr() % 16 == 0,
            tuple(stride * size % 16 == 0 for stride in strides),
            strides[-1] == 1,
            min(shape) > 0,
        )
    if arg is None:
        return None
    if isinstance(arg, torch.Tensor):
        return ("ptr", arg.device, arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):
        return ("bool", arg)
    if isinstance(arg, int):
        return ("int", arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31)
    if isinstance(arg, float):
        return "float"
    raise TypeError(f"no launch key for a {type(arg).__name__} argument")


def _host_tma(t: torch.Tensor) -> _HostTma:
    return _HostTma(t, list(t.shape), list(t.stride()))


def _launch_arg(arg: Any) -> Any:
    """The argument as the compiled kernel's Python launcher takes it."""
    return _host_tma(arg.tensor) if type(arg) is Tma else arg


def _current_device() -> int:
    return torch.cuda.current_device()  # where Triton launches too


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def _runtime() -> tuple:
    """Triton's switches that change what it compiles (part of every launch key)."""
    return triton.knobs.runtime.debug, triton.knobs.compilation.instrumentation_mode


def _hooks_installed() -> bool:
    hooks = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
    return any(getattr(hook, "calls", hook) for hook in hooks)


def _encode(host: _HostTma, meta: dict | None) -> list:
    """A descriptor argument as the C launcher takes it (Triton's own expansion)."""
    return _nvidia_driver().make_tensordesc_arg(host, meta)


def _nvidia_driver():
    from triton.backends.nvidia import driver  # imported on first use: only the direct launch needs it

    return driver


class _Descriptor:
    """One descriptor parameter of a compiled kernel: its expansion for the C launcher, kept per
    tensor address, shape and strides where it holds an encoded descriptor (nothing of the tensor)."""

    CACHED = 512  # expansions kept per parameter; then the cache starts over

    def __init__(self, meta: dict | None):
        self.meta = meta
        self.expanded: dict[tuple, tuple] = {}

    def expand(self, t: torch.Tensor) -> tuple:
        if self.meta is None:  # not lowered to a TMA descriptor: the expansion holds the tensor itself
            return tuple(_encode(_host_tma(t), None))
        key = (t.data_ptr(), t.shape, t.stride())
        found = self.expanded.get(key)
        if found is None:
            if len(self.expanded) >= self.CACHED:
                self.expanded.clear()
            if t.is_cuda:
                bind_cuda_context(t.device)  # the encoding calls the driver: a context must be current
            found = self.expanded[key] = tuple(_encode(_host_tma(t), self.meta))
        return found


class _Entry(NamedTuple):
    """A compiled kernel of one launch key and how it is launched directly."""

    compiled: Any
    tail: tuple  # the constexpr arguments after the runtime ones, in the kernel's order
    launch: Callable | None  # the C launcher, or None: through ``compiled.run``
    head: tuple  # the C launcher's arguments between the function and the kernel's
    descriptors: tuple  # per runtime argument: a _Descriptor, or None where it is not one


def _c_launcher(compiled, runtime_args: int) -> tuple[Callable, tuple, tuple] | None:
    """(the C launcher, the arguments it takes before the kernel's, a _Descriptor or None per runtime
    argument) of a compiled Triton 3.6 kernel, or None where its launch needs Triton's Python
    launcher (scratch memory to allocate) or is not laid out as expected."""
    try:
        run = compiled.run
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        types = list(compiled.src.signature.values())
        metas = iter(getattr(compiled.metadata, "tensordesc_meta", None) or ())
        descriptors = [
            _Descriptor(next(metas, None)) if isinstance(t, str) and t.startswith("tensordesc") else None
            for t in types
        ]
        launch = run.launch
        if any(descriptors):
            # Triton wraps the C launcher in a closure that expands each descriptor on every call.
            cells = dict(zip(launch.__code__.co_freevars, launch.__closure__ or (), strict=True))
            launch = cells["launcher"].cell_contents
        head = (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if any(descriptors[runtime_args:]) or len(descriptors) < runtime_args:
        return None
    # launch metadata and the two hooks: read by launch hooks only, and none is installed
    return launch, (*head, None, None, None), tuple(descriptors[:runtime_args])


class KernelLauncher:
    """Launches one Triton or Gluon kernel; ``make_descriptor(tensor, block)`` builds the host
    descriptor class it takes for ``Tma`` arguments (Triton's or Gluon's)."""

    def __init__(self, kernel, make_descriptor: Callable[[torch.Tensor, list[int]], Any] | None = None):
        self._kernel = kernel
        self._make_descriptor = make_descriptor
        self._compiled: dict[tuple, _Entry] = {}  # launch key -> entry

    def _through_triton(self, grid: tuple[int, ...], args: tuple, constexprs: dict):
        real = [self._make_descriptor(a.tensor, list(a.block)) if isinstance(a, Tma) else a for a in args]
        return self._kernel[grid](*real, **constexprs)

    def __call__(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        """``kernel[grid](*args, **constexprs)``, with tensors the kernel reads through TMA given as
        ``Tma(tensor, block)``. Runtime arguments are positional, constexprs and options by name."""
        recording = getattr(RECORDING, "active", None)
        if recording is None:
            self._launch(grid, args, constexprs)
            return
        with recording.step():
            entry = self._launch(grid, args, constexprs)
        recording.launched(BoundLaunch(self, entry, grid, args, constexprs, recording.index_of))

    def _launch(self, grid, args: tuple, constexprs: dict) -> _Entry | None:
        """Launches; returns the entry launched directly from now on (None: through Triton only)."""
        if not DIRECT or _hooks_installed():
            self._through_triton(grid, args, constexprs)
            return None
        device = _current_device()
        key = (device, _runtime(), tuple(map(_key_of, args)), tuple(constexprs.items()))
        entry = self._compiled.get(key)
        if entry is None or VERIFY:
            compiled = self._through_triton(grid, args, constexprs)
            if entry is None:
                names = self._kernel.arg_names[len(args) :]
                missing = [n for n in names if n not in constexprs]
                if missing:
                    raise TypeError(f"{self._kernel.__name__} launched without {missing}")
                tail = tuple(constexprs[n] for n in names)
                direct = _c_launcher(compiled, len(args))
                entry = _Entry(compiled, tail, *(direct or (None, (), ())))
                self._compiled[key] = entry
            elif compiled is not entry.compiled:
                raise RuntimeError(
                    f"{self._kernel.__name__}: Triton compiled this call differently from an earlier one "
                    "with the same launch key; the key misses something Triton specializes on"
                )
            return entry
        self._run(entry, grid, device, args)
        return entry

    def _run(self, entry: _Entry, grid: tuple[int, ...], device: int, args: tuple) -> None:
        grid3 = (*grid, 1, 1)[:3]
        stream = _current_stream(device)
        compiled = entry.compiled
        if entry.launch is None:
            host_args = [_launch_arg(a) for a in args]
            for a in host_args:
                if isinstance(a, _HostTma) and a.base.is_cuda:
                    # The launcher encodes the descriptors through the driver: a context must be current.
                    bind_cuda_context(a.base.device)
                    break
            # launch metadata and hooks: read by launch hooks only, and none is installed
            compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *host_args, *entry.tail)  # fmt: skip
            return
        _issue(entry, grid3, stream, args)


def _issue(entry: _Entry, grid3: tuple, stream: int, args) -> None:
    """``entry``'s C launch with the runtime ``args``, each descriptor parameter's tensor (bare or in
    a ``Tma``) expanded as the C launcher takes it."""
    flat = []
    for descriptor, a in zip(entry.descriptors, args, strict=True):
        if descriptor is None:
            flat.append(a)
        else:
            flat.extend(descriptor.expand(a.tensor if type(a) is Tma else a))
    entry.launch(*grid3, stream, entry.compiled.function, *entry.head, *flat, *entry.tail)


class _Slot(NamedTuple):
    """One runtime argument of a bound launch: a tensor of the plan's pool, or a constant."""

    index: int | None  # the tensor's place in the pool; None: ``value`` is the argument
    block: tuple[int, ...] | None  # a ``Tma`` argument's tile
    value: Any


class BoundLaunch:
    """One launch of a recorded call (plans.py), issued again on the tensors of a later call.

    Its tensors are named by their place in the plan's pool (``index_of``); ``resolved`` is False
    where one has no place there. A later call launches the compiled kernel directly, with the same
    grid and constants, while what Triton would choose cannot have changed (no hook, no
    verification, the same switches and device); otherwise through the launcher. The C launcher's
    argument list is made once, with a gap wherever a tensor goes: a plan's tensors have the shapes
    and strides of its signature, so only their addresses (and the descriptors encoded from them)
    change from call to call."""

    def __init__(self, launcher: KernelLauncher, entry: _Entry | None, grid, args, constexprs, index_of):
        self.launcher, self.grid, self.constexprs = launcher, grid, constexprs
        self.entry = entry if entry is not None and entry.launch is not None else None
        self.device = _current_device() if self.entry is not None else None
        self.runtime = _runtime()
        slots = []
        self.resolved = True
        for a in args:
            tensor = a.tensor if isinstance(a, Tma) else a if isinstance(a, torch.Tensor) else None
            if tensor is None:
                slots.append(_Slot(None, None, a))
                continue
            index = index_of(tensor)
            self.resolved = self.resolved and index is not None
            slots.append(_Slot(index, a.block if isinstance(a, Tma) else None, None))
        self.slots = tuple(slots)
        if self.entry is not None and self.resolved:
            self._prepare(self.entry, (*grid, 1, 1)[:3], args)

    def _prepare(self, entry: _Entry, grid3: tuple, args: tuple) -> None:
        """The C launcher's arguments, as ``_issue`` lays them out, without this call's tensors:
        ``places`` says where each tensor goes, ``encoded`` where its descriptor's expansion goes."""
        arguments = [*grid3, None, entry.compiled.function, *entry.head]  # [3]: the stream
        places, encoded = [], []
        for slot, descriptor, a in zip(self.slots, entry.descriptors, args, strict=True):
            start = len(arguments)
            if slot.index is None:
                arguments.append(a)
                continue
            if descriptor is None:
                arguments.append(None)
                places.append((start, slot.index))
                continue
            tensor = a.tensor if type(a) is Tma else a
            expansion = descriptor.expand(tensor)
            if descriptor.meta is None:  # the tensor itself and its shape and strides
                places.extend((start + i, slot.index) for i, e in enumerate(expansion) if e is tensor)
                arguments.extend(None if e is tensor else e for e in expansion)
            else:  # a descriptor encoded from the address, then the shape and strides
                encoded.append((start, start + len(expansion), slot.index, descriptor))
                arguments.extend(expansion)
        arguments.extend(entry.tail)
        self.arguments, self.places, self.encoded = arguments, tuple(places), tuple(encoded)

    @staticmethod
    def _argument(slot: _Slot, pool: list) -> Any:
        if slot.index is None:
            return slot.value
        return pool[slot.index] if slot.block is None else Tma(pool[slot.index], slot.block)

    def __call__(self, pool: list) -> None:
        entry = self.entry
        if (
            entry is None
            or VERIFY
            or _hooks_installed()
            or _runtime() != self.runtime
            or _current_device() != self.device
        ):
            self.launcher(self.grid, *map(self._argument, self.slots, [pool] * len(self.slots)),
                          **self.constexprs)  # fmt: skip
            return
        arguments = self.arguments.copy()
        arguments[3] = _current_stream(self.device)
        for place, index in self.places:
            arguments[place] = pool[index]
        for start, stop, index, descriptor in self.encoded:
            arguments[start:stop] = descriptor.expand(pool[index])
        entry.launch(*arguments)


__all__ = ["DIRECT", "VERIFY", "BoundLaunch", "KernelLauncher", "Tma"]
