"""Launch plans: an op's later calls with a signature replayed from its first call with it.

An op's body (ops.py) checks its inputs, picks the kernel (configs.py), allocates its outputs and
launches. All of that depends on the call's *signature* only: each tensor's shape, strides, dtype,
device and 16-byte alignment, the other arguments' values, and PyTorch's TF32 switch. A compiled
graph calls each op once per layer and step with the same few signatures, and that Python was most
of the op's host time (docs/design/one-path.md, "Host time per call").

``planned(body)`` runs the first call of each signature while recording what the body does: each
buffer it allocates (``common.empty``), each kernel it launches (``KernelLauncher``) and, through a
dispatch mode, each other torch operation (a GEMM, a view, a copy). The record is the signature's
plan: a later call makes the same allocations, launches and operations on its own tensors, each
launch straight to its compiled kernel (``BoundLaunch``), each operation straight to its ATen
operator, and returns the tensors in the places the body returned them. A signature whose first
call did what a replay cannot repeat is never replayed and runs the body every time: an operation
that returns something other than tensors (``.item()``: a value the body could branch on), one on a
tensor that is neither an argument nor made by the body, or any operation under autocast (whose
casts the signature's dtypes do not fix; whether autocast and inference mode are on is part of the
signature).

A replay lets go of each tensor after the last step that reads it, unless the body returned it, so
a body that frees as it goes (the recompute backward, piece by piece) keeps no more alive replayed.

A planned body may check only what the signature holds (a replay skips its checks), and returns a
tensor or a tuple of tensors, each an argument or one the body made.
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

_UNPLANNED = object()  # a signature whose first call did what a replay cannot repeat
_EVERY_OP: list[dict] = []  # each planned op's plans


def forget() -> None:
    """Drops every plan: for a change the signatures do not show (a test patching the kernel choice)."""
    for plans in _EVERY_OP:
        plans.clear()


def signature(args: tuple) -> tuple:
    """What a planned body's work depends on, of its arguments ``args``."""
    # The fp32 dot precision follows the TF32 switch; under autocast, operations are not recorded;
    # in inference mode, tensors have no version to restore.
    key = [
        torch.backends.cuda.matmul.allow_tf32,
        torch._C._is_any_autocast_enabled(),
        torch.is_inference_mode_enabled(),
    ]
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


def _is_constant(a) -> bool:
    """An operation's argument a plan keeps as it is: no tensor in it (a size list, a dtype, a float)."""
    if isinstance(a, (tuple, list)):
        return all(_is_constant(e) for e in a)
    return not isinstance(a, torch.Tensor)


class _Operation(NamedTuple):
    """A torch operation of the body, called again with the pool's tensors in the places recorded."""

    op: Callable  # the ATen operator overload
    args: tuple  # its positional arguments, None where a pool tensor goes
    kwargs: dict  # its keyword arguments, likewise
    places: tuple[tuple[int, int], ...]  # (position, pool index) of each positional tensor argument
    keyword_places: tuple[tuple[str, int], ...]  # (keyword, pool index) of each keyword tensor argument
    appended: tuple[int, ...]  # which of its outputs are new tensors, added to the pool in order
    single: bool  # it returns one tensor, not a tuple

    def __call__(self, pool: list) -> None:
        args = list(self.args)
        for position, index in self.places:
            args[position] = pool[index]
        kwargs = self.kwargs
        if self.keyword_places:
            kwargs = {**kwargs, **{keyword: pool[index] for keyword, index in self.keyword_places}}
        out = self.op(*args, **kwargs)
        if self.single:
            if self.appended:
                pool.append(out)
        else:
            pool.extend(out[i] for i in self.appended)


def _reads(step) -> set[int]:
    """The pool places a step takes its tensors from."""
    if isinstance(step, BoundLaunch):
        return {slot.index for slot in step.slots if slot.index is not None}
    if isinstance(step, _Operation):
        return {index for _, index in (*step.places, *step.keyword_places)}
    return set()


def _made(step) -> int:
    """How many tensors a step adds to the pool."""
    if isinstance(step, _Allocation):
        return 1
    return len(step.appended) if isinstance(step, _Operation) else 0


def _drops(steps: tuple, arguments: int, results: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
    """After each step, the pool places that no later step reads and the body does not return, so
    that a replay frees what the body freed as it went (the recompute backward's pieces); None
    where there are none."""
    last: dict[int, int] = {}
    size = arguments
    for s, step in enumerate(steps):
        for index in range(size, size + _made(step)):
            last[index] = s  # made here, and read by no later step unless one says so below
        size += _made(step)
        last.update(dict.fromkeys(_reads(step), s))
    kept = set(results) | set(range(arguments))
    drops = [[] for _ in steps]
    for index, s in last.items():
        if index not in kept:
            drops[s].append(index)
    return tuple(map(tuple, drops)) if any(drops) else None


class _Plan(NamedTuple):
    steps: tuple  # _Allocation, BoundLaunch and _Operation, in the order the body made them
    results: tuple[int, ...]  # pool index of each tensor the body returned
    single: bool  # the body returned one tensor, not a tuple
    # (pool index, version) of each returned tensor the body made, in a plan with operations: the
    # body may have hidden its own in-place work from autograd (``_unsafe_preserve_version_counter``).
    versions: tuple[tuple[int, int], ...]
    drops: tuple[tuple[int, ...], ...] | None  # per step, the places freed after it (``_drops``)

    def replay(self, tensors: list) -> torch.Tensor | tuple[torch.Tensor, ...]:
        pool = tensors  # the call's tensors, then each buffer and each new tensor an operation returned
        if self.drops is None:
            for step in self.steps:
                step(pool)
        else:
            for step, dropped in zip(self.steps, self.drops, strict=True):
                step(pool)
                for index in dropped:
                    pool[index] = None
        for index, version in self.versions:
            if pool[index]._version != version:
                torch._C._autograd._unsafe_set_version_counter((pool[index],), (version,))
        if self.single:
            return pool[self.results[0]]
        return tuple(pool[i] for i in self.results)


class _Recording:
    """What one call of a planned body allocated, launched and operated on, and whether a replay
    could not repeat it."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.pool = list(tensors)
        self.arguments = len(tensors)
        self.steps: list = []
        self.other_work = False
        self.in_step = False  # inside an allocation or a launch, which a replay repeats whole
        self.autocast = torch._C._is_any_autocast_enabled()  # (a dispatch mode sees it off)

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

    def operated(self, op, args: tuple, kwargs: dict, out) -> None:
        """Records ``op(*args, **kwargs)``, which returned ``out``, or marks what a replay cannot repeat."""
        if self.autocast:  # autocast chose its dtypes: a replay under another would cast again
            self.other_work = True
            return
        single = isinstance(out, torch.Tensor)
        outputs = (out,) if single else out
        if not isinstance(outputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in outputs):
            self.other_work = True  # a value (``.item()``), which the body may have branched on
            return
        template, kw_template, places, keyword_places = list(args), dict(kwargs), [], []
        for place, a in (*enumerate(args), *kwargs.items()):
            if _is_constant(a):
                continue
            index = self.index_of(a) if isinstance(a, torch.Tensor) else None
            if index is None:  # a tensor the pool does not hold once, or tensors inside a list
                self.other_work = True
                return
            if isinstance(place, str):
                keyword_places.append((place, index))
                kw_template[place] = None
            else:
                places.append((place, index))
                template[place] = None
        appended = tuple(i for i, t in enumerate(outputs) if not any(t is p for p in self.pool))
        self.pool.extend(outputs[i] for i in appended)
        template, places, keyword_places = tuple(template), tuple(places), tuple(keyword_places)
        self.steps.append(_Operation(op, template, kw_template, places, keyword_places, appended, single))

    def plan(self, result) -> _Plan | object:
        single = isinstance(result, torch.Tensor)
        results = [
            self.index_of(t) if isinstance(t, torch.Tensor) else None
            for t in ((result,) if single else result)
        ]
        if self.other_work or None in results:
            return _UNPLANNED
        made = range(self.arguments, len(self.pool))
        operated = any(type(step) is _Operation for step in self.steps)
        versions = tuple(
            (i, self.pool[i]._version)
            for i in sorted(set(results))
            if i in made and operated and not self.pool[i].is_inference()
        )
        steps = tuple(self.steps)
        return _Plan(steps, tuple(results), single, versions, _drops(steps, self.arguments, tuple(results)))


class _Watch(TorchDispatchMode):
    """Records each torch operation outside the recording's allocations and launches."""

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self.recording = recording

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # It runs inside op bodies only, never under Dynamo; left True, TorchDispatchMode wraps it in
        # torch._disable_dynamo, whose first call imports Dynamo (a second for an eager user).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.recording.in_step:
            self.recording.operated(func, args, kwargs or {}, out)
        return out


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
