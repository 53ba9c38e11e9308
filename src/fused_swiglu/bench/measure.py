"""Measure every implementation at one shape: first call, memory, then interleaved timings.

Timings are ``triton.testing.do_bench`` medians (CUDA events, L2 flushed between runs). Every
repetition visits all implementations in turn, starting one further along each time, and each metric
is the median over repetitions, so clock drift, thermal state and position hit all implementations
alike.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch
from triton.testing import do_bench

from .impls import EagerSwiGLUMLP, Impl, build_impl

MIB = 2**20


def rotation(names: list, rep: int) -> list:
    """``names`` starting at index ``rep`` (mod its length): the order of one interleaved repetition."""
    shift = rep % len(names)
    return names[shift:] + names[:shift]


class GarbageCollections:
    """Python's garbage collections from its making on: ``runs`` holds (generation, seconds) of each."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, float]] = []
        self._start: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.runs.append((info["generation"], time.perf_counter() - self._start))
            self._start = None


def median_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100, grad_to_none=None) -> float:
    """``do_bench``'s median time of one call of ``fn``, in ms. Its default is the mean, which one
    slow call (an allocator or clock hiccup) can move by percents."""
    return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


#: How many calls ``sustained_ms`` keeps queued ahead of the GPU.
SUSTAINED_QUEUE = 8


def interleaved_medians(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """``median_ms`` of each function in ``reps`` rounds, the order rotating between rounds; the
    median of its rounds per function."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps):
        for name in rotation(list(fns), rep):
            times[name].append(median_ms(fns[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def sustained_ms(step: Callable[[], object], params: list[torch.Tensor], seconds: float) -> float:
    """ms per call of ``step`` run back to back for ``seconds``, as a training loop runs it: the L2
    cache warm from the previous call, the clock settled where the card's power limit puts it.

    The host waits only for the call ``SUSTAINED_QUEUE`` back, never for the GPU to drain, so the GPU
    never sits idle while the host issues the next call (unless the host is the slower of the two,
    which then is the finding); the queue stays bounded, so the loop's seconds are the GPU's."""
    done = [torch.cuda.Event() for _ in range(SUSTAINED_QUEUE)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < seconds:
        slot = done[calls % SUSTAINED_QUEUE]
        slot.synchronize()  # the call SUSTAINED_QUEUE back (a never-recorded event returns at once)
        for p in params:
            p.grad = None
        step()
        slot.record()
        calls += 1
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def _clear_grads(impl: Impl) -> None:
    for p in impl.params:
        p.grad = None


def peak_mib(fn: Callable[[], object]) -> float:
    """Extra peak memory of one call of ``fn``, in MiB over what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MIB


def _memory(impl: Impl, dy: torch.Tensor) -> tuple[float, float]:
    """(kept, peak) MiB over what was allocated before: kept between forward and backward (output
    excluded), and the peak of the whole step (weight gradients included)."""
    _clear_grads(impl)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = impl.forward()
    kept = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    y.backward(dy.reshape(y.shape))  # some peers return [1, M, H]
    del y
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    _clear_grads(impl)
    return kept / MIB, peak / MIB


def _no_grad(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.no_grad():
            return fn()

    return run


def cuda_graph_replay(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """``fn`` captured once in a CUDA graph; the returned replay runs its GPU work with no host work
    per kernel, as a server that captures its decode step does. Warmed up on a side stream first,
    as PyTorch requires before a capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure_impls(
    impls: list[Impl | tuple[str, str]],
    grad_out: torch.Tensor,
    flops: float,
    *,
    reps: int,
    log: Callable[[str], None] = print,
    inference_only: bool = False,
    graphs: bool = False,
    sustained_s: float = 0.0,
) -> list[dict]:
    """First call, memory and interleaved timings of ``impls`` (a ``(name, reason)`` pair marks a
    missing one); the first implementation named ``floor`` is the reference for the ratios.
    ``inference_only`` times the no_grad forward alone (first call included), without memory.
    ``graphs`` also times that forward replayed from a CUDA graph (``graph_fwd_ms``); an
    implementation that cannot be captured gets ``graph_failed`` instead. ``sustained_s`` > 0 also
    runs each training step back to back for that many seconds per repetition (``sustained_ms``), in
    the same rotation."""
    rows: dict[str, dict] = {}
    ready: list[Impl] = []
    replays: dict[str, Callable[[], None]] = {}
    for impl in impls:
        if isinstance(impl, tuple):
            rows[impl[0]] = {"impl": impl[0], "missing": impl[1]}
            log(f"  {impl[0]}: missing ({impl[1]})")
            continue
        t0 = time.perf_counter()
        try:
            _no_grad(impl.forward)() if inference_only else impl.step()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the run goes on
            rows[impl.name] = {"impl": impl.name, "missing": f"failed: {type(e).__name__}: {e}"[:200]}
            log(f"  {impl.name}: {rows[impl.name]['missing']}")
            continue
        first = time.perf_counter() - t0
        _clear_grads(impl)
        row = {"impl": impl.name, "first_call_s": first}
        if impl.measures_memory and not inference_only:
            row["kept_mib"], row["peak_mib"] = _memory(impl, grad_out)
        rows[impl.name] = row
        ready.append(impl)
        log(f"  {impl.name}: first call {first:.2f} s")
        if graphs:
            try:
                replays[impl.name] = cuda_graph_replay(_no_grad(impl.forward))
            except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
                row["graph_failed"] = f"{type(e).__name__}: {e}"[:200]
                log(f"  {impl.name}: CUDA graph capture failed ({row['graph_failed']})")

    samples: dict[tuple[str, str], list[float]] = {}
    for rep in range(reps):
        # Rotate the order every repetition: whichever runs first after a different workload runs
        # measurably slower (a few percent), and no implementation should always take that place.
        shift = rep % max(1, len(ready))
        for impl in ready[shift:] + ready[:shift]:
            metrics = {}
            if not inference_only:
                metrics = {"step_ms": (impl.step, impl.params), "fwd_ms": (impl.forward, [])}
            metrics["no_grad_fwd_ms"] = (_no_grad(impl.forward), [])
            if impl.name in replays:
                metrics["graph_fwd_ms"] = (replays[impl.name], [])
            for metric, (fn, grads) in metrics.items():
                t = median_ms(fn, warmup=25, rep=100, grad_to_none=grads or None)
                samples.setdefault((impl.name, metric), []).append(t)
            if sustained_s > 0 and not inference_only:
                t = sustained_ms(impl.step, impl.params, sustained_s)
                samples.setdefault((impl.name, "sustained_ms"), []).append(t)
        log(f"  timing repetition {rep + 1}/{reps} done")
    for (name, metric), values in samples.items():
        rows[name][metric] = statistics.median(values)

    floor = rows.get("floor", {})
    for row in rows.values():
        if "step_ms" in row:
            row["tflops"] = flops / (row["step_ms"] * 1e-3) / 1e12
        for metric in ("step_ms", "sustained_ms", "fwd_ms", "no_grad_fwd_ms", "graph_fwd_ms"):
            if metric in row and metric in floor:
                row[metric.removesuffix("_ms") + "_vs_floor"] = row[metric] / floor[metric]
    return list(rows.values())


def measure_shape(
    m: int,
    hidden: int,
    inter: int,
    impl_names: list[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    reps: int = 5,
    log: Callable[[str], None] = print,
    sustained_s: float = 0.0,
) -> list[dict]:
    """The MLP at one shape: one row per implementation."""
    torch.manual_seed(0)
    reference = EagerSwiGLUMLP(hidden, inter, device="cuda", dtype=dtype)
    x = torch.randn(m, hidden, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(m, hidden, device="cuda", dtype=dtype)
    impls = []
    for name in impl_names:
        if name == "torch.compile":
            torch._dynamo.reset()  # a fresh compile per shape, timed as its first call
        built = build_impl(name, reference, x, dy)
        impls.append((name, built) if isinstance(built, str) else built)
    flops = 18 * m * hidden * inter  # 6 MHI fwd + 12 MHI bwd
    rows = measure_impls(impls, dy, flops, reps=reps, log=log, sustained_s=sustained_s)
    for row in rows:
        row.update({"M": m, "hidden": hidden, "intermediate": inter})
    return rows
