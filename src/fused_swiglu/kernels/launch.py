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

The direct launch uses Triton's internals (``CompiledKernel.run`` and its arguments), so it is used
with triton 3.6 only, where it was built and tested. With other releases, under the interpreter, and
while a launch hook is installed (a profiler), every call goes through ``kernel[grid]``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch
import triton

from .common import bind_cuda_context, interpreting

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


def _key_and_launch_arg(arg: Any) -> tuple[Any, Any]:
    """What Triton's specialization can see of one runtime argument (and a little more: a finer key
    only costs another first call), and the argument as the compiled kernel's launcher takes it.
    One pass, since the host time of this is the point."""
    if isinstance(arg, Tma):
        t = arg.tensor
        shape, strides, size = t.shape, t.stride(), t.dtype.itemsize
        key = (
            "tma",
            t.device,
            t.dtype,
            arg.block,
            t.data_ptr() % 16 == 0,
            tuple(stride * size % 16 == 0 for stride in strides),
            strides[-1] == 1,
            min(shape) > 0,
        )
        return key, _HostTma(t, list(shape), list(strides))
    if arg is None:
        return None, None
    if isinstance(arg, torch.Tensor):
        return ("ptr", arg.device, arg.dtype, arg.data_ptr() % 16 == 0), arg
    if isinstance(arg, bool):
        return ("bool", arg), arg
    if isinstance(arg, int):
        return ("int", arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31), arg
    if isinstance(arg, float):
        return "float", arg
    raise TypeError(f"no launch key for a {type(arg).__name__} argument")


def _launch_arg(arg: Any) -> Any:
    """The argument as the compiled kernel's launcher takes it (``_key_and_launch_arg``'s second half)."""
    if type(arg) is Tma:
        t = arg.tensor
        return _HostTma(t, list(t.shape), list(t.stride()))
    return arg


def _current_device() -> int:
    return torch.cuda.current_device()  # where Triton launches too


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def _hooks_installed() -> bool:
    hooks = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
    return any(getattr(hook, "calls", hook) for hook in hooks)


class KernelLauncher:
    """Launches one Triton or Gluon kernel; ``make_descriptor(tensor, block)`` builds the host
    descriptor class it takes for ``Tma`` arguments (Triton's or Gluon's)."""

    def __init__(self, kernel, make_descriptor: Callable[[torch.Tensor, list[int]], Any] | None = None):
        self._kernel = kernel
        self._make_descriptor = make_descriptor
        # launch key -> (compiled kernel, the constexpr arguments after the runtime ones, in order)
        self._compiled: dict[tuple, tuple[Any, tuple]] = {}
        # (device, runtime switches, caller key, constexprs) -> the same entries
        self._by_caller_key: dict[tuple, tuple[Any, tuple]] = {}

    def _through_triton(self, grid: tuple[int, ...], args: tuple, constexprs: dict):
        real = [self._make_descriptor(a.tensor, list(a.block)) if isinstance(a, Tma) else a for a in args]
        return self._kernel[grid](*real, **constexprs)

    def __call__(
        self, grid: tuple[int, ...], *args: Any, caller_key: Hashable = None, **constexprs: Any
    ) -> None:
        """``kernel[grid](*args, **constexprs)``, with tensors the kernel reads through TMA given as
        ``Tma(tensor, block)``. Runtime arguments are positional, constexprs and options by name.

        ``caller_key``, where given, stands for what Triton specializes on in the runtime arguments
        (the caller's input shapes, strides, dtypes and alignments, from which it makes the rest):
        a later call with the same key and constexprs skips the key built argument by argument, the
        larger part of this launch's host time. ``VERIFY`` checks it against that key."""
        if not DIRECT or _hooks_installed():
            self._through_triton(grid, args, constexprs)
            return
        device = _current_device()
        runtime = triton.knobs.runtime.debug, triton.knobs.compilation.instrumentation_mode
        fast_key = None if caller_key is None else (device, runtime, caller_key, tuple(constexprs.items()))
        entry = None if fast_key is None or VERIFY else self._by_caller_key.get(fast_key)
        if entry is not None:
            self._run(entry, grid, device, [_launch_arg(a) for a in args])
            return
        keys, launch_args = zip(*map(_key_and_launch_arg, args), strict=True) if args else ((), ())
        key = (device, runtime, keys, tuple(constexprs.items()))
        entry = self._compiled.get(key)
        if entry is None or VERIFY:
            compiled = self._through_triton(grid, args, constexprs)
            if entry is None:
                names = self._kernel.arg_names[len(args) :]
                missing = [n for n in names if n not in constexprs]
                if missing:
                    raise TypeError(f"{self._kernel.__name__} launched without {missing}")
                entry = self._compiled[key] = (compiled, tuple(constexprs[n] for n in names))
            elif compiled is not entry[0]:
                raise RuntimeError(
                    f"{self._kernel.__name__}: Triton compiled this call differently from an earlier one "
                    "with the same launch key; the key misses something Triton specializes on"
                )
            self._remember(fast_key, entry)
            return
        self._remember(fast_key, entry)
        self._run(entry, grid, device, launch_args)

    def _remember(self, fast_key, entry) -> None:
        if fast_key is None:
            return
        known = self._by_caller_key.setdefault(fast_key, entry)
        if known is not entry:
            raise RuntimeError(
                f"{self._kernel.__name__}: two calls with the same caller key launched different "
                "kernels; the caller key misses something Triton specializes on"
            )

    def _run(self, entry, grid: tuple[int, ...], device: int, launch_args) -> None:
        compiled, tail = entry
        for a in launch_args:
            if isinstance(a, _HostTma) and a.base.is_cuda:
                # The launcher encodes the descriptors through the driver: a context must be current.
                bind_cuda_context(a.base.device)
                break
        grid3 = (*grid, 1, 1)[:3]
        compiled.run(
            *grid3,
            _current_stream(device),
            compiled.function,
            compiled.packed_metadata,
            None,  # launch metadata: only read by launch hooks, and none is installed
            None,
            None,
            *launch_args,
            *tail,
        )


__all__ = ["DIRECT", "VERIFY", "KernelLauncher", "Tma"]
