"""Launch plans: an op's later calls with a signature replayed from its first call with it.

An op's body (ops.py) checks its inputs, picks the kernel (configs.py), allocates its outputs and
launches. All of that depends on the call's *signature* only: each tensor's shape, strides, dtype,
device and 16-byte alignment, the other arguments' values, and PyTorch's TF32 switch. A compiled
graph calls each op once per layer and step with the same few signatures, and that Python was most
of the op's host time (docs/design/one-path.md, "Host time per call").

``planned(body)`` runs the first call of each signature while recording what the body does: each
buffer it allocates (``common.empty``) and each kernel it launches (``KernelLauncher``). A dispatch
mode watches for any other torch operation (a copy, a GEMM, a fill), which a replay would not
repeat: a signature whose first call did other work is never replayed and runs the body every time.
Otherwise the record is the signature's plan: a later call makes the same allocations and the same
launches on its own tensors, each straight to its compiled kernel (``BoundLaunch``), and returns
the tensors in the places the body returned them.

A planned body may check only what the signature holds (a replay skips its checks), and returns a
tensor or a tuple of tensors, each an argument or a buffer it allocated.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .common import RECORDING
from .launch import BoundLaunch

#: Plans kept per op; then its plans start over.
PLANS_KEPT = 1024

#: Whether a plan replays. Tests that spy on the Python between an op and its launches turn it off.
REPLAY = True

_UNPLANNED = object()  # a signature whose first call did more than allocate and launch
_EVERY_OP: list[dict] = []  # each planned op's plans


def forget() -> None:
    """Drops every plan: for a change the signatures do not show (a test patching the kernel choice)."""
    for plans in _EVERY_OP:
        plans.clear()


def signature(args: tuple) -> tuple:
    """What a planned body's work depends on, of its arguments ``args``."""
    key = [torch.backends.cuda.matmul.allow_tf32]  # the fp32 dot precision follows it
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16))
        else:
            key.append(a)
    return tuple(key)


class _Allocation(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def __call__(self, pool: list) -> None:
        pool.append(torch.empty(self.shape, dtype=self.dtype, device=self.device))


class _Plan(NamedTuple):
    steps: tuple  # _Allocation and BoundLaunch, in the order the body made them
    results: tuple[int, ...]  # pool index of each tensor the body returned
    single: bool  # the body returned one tensor, not a tuple

    def replay(self, tensors: list) -> torch.Tensor | tuple[torch.Tensor, ...]:
        pool = tensors  # the call's tensors, then each allocation
        for step in self.steps:
            step(pool)
        if self.single:
            return pool[self.results[0]]
        return tuple(pool[i] for i in self.results)


class _Recording:
    """What one call of a planned body allocated and launched, and whether it did anything else."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.pool = list(tensors)
        self.steps: list = []
        self.other_work = False
        self.in_step = False  # inside an allocation or a launch, which a replay repeats whole

    @contextlib.contextmanager
    def step(self):
        """What runs inside (a test's NaN fill of a new buffer, the interpreter's copies) is the step's."""
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    def allocate(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with self.step():
            t = torch.empty(shape, dtype=dtype, device=device)
        self.steps.append(_Allocation(tuple(shape), dtype, device))
        self.pool.append(t)
        return t

    def index_of(self, t: torch.Tensor) -> int | None:
        """``t``'s place in the pool; None where it is not there once (a tensor a plan cannot name)."""
        found = [i for i, p in enumerate(self.pool) if p is t]
        return found[0] if len(found) == 1 else None

    def launched(self, bound: BoundLaunch) -> None:
        self.steps.append(bound)
        if not bound.resolved:
            self.other_work = True

    def plan(self, result) -> _Plan | object:
        single = isinstance(result, torch.Tensor)
        results = [
            self.index_of(t) if isinstance(t, torch.Tensor) else None
            for t in ((result,) if single else result)
        ]
        if self.other_work or None in results:
            return _UNPLANNED
        return _Plan(tuple(self.steps), tuple(results), single)


class _Watch(TorchDispatchMode):
    """Marks the recording at any torch operation outside its allocations and launches."""

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self.recording = recording

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # It runs inside op bodies only, never under Dynamo; left True, TorchDispatchMode wraps it in
        # torch._disable_dynamo, whose first call imports Dynamo (a second for an eager user).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.recording.in_step:
            self.recording.other_work = True
        return func(*args, **(kwargs or {}))


def _record(body: Callable, args: tuple, tensors: list[torch.Tensor]):
    recording = _Recording(tensors)
    outer = getattr(RECORDING, "active", None)
    RECORDING.active = recording
    try:
        with _Watch(recording):
            result = body(*args)
    finally:
        RECORDING.active = outer
    return result, recording.plan(result)


def planned(body: Callable) -> Callable:
    """``body``, its later calls with a signature replayed from the first (see the module docstring)."""
    plans: dict[tuple, _Plan | object] = {}
    _EVERY_OP.append(plans)

    @functools.wraps(body)
    def call(*args):
        key = signature(args)
        plan = plans.get(key)
        if plan is _UNPLANNED or not REPLAY:
            return body(*args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if plan is not None:
            return plan.replay(tensors)
        result, plan = _record(body, args, tensors)
        if len(plans) >= PLANS_KEPT:
            plans.clear()
        plans[key] = plan
        return result

    call.plans = plans  # for the tests
    return call


__all__ = ["PLANS_KEPT", "REPLAY", "forget", "planned", "signature"]
