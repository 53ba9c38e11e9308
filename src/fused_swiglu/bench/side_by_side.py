"""Whole-model variants timed side by side: one fresh process per variant, taking turns on the GPU.

Every variant needs a process of its own (a class-level patch such as Liger's, or Dynamo's caches
and recompile budgets, must not leak into the next variant), and a host's speed drifts by tens of
percent within a minute, more than the differences measured. So the processes are started one after
another (each compiles and trains its first steps alone, so its compile time is its own), stay
alive, and then time one window of steps each, in turn, round after round, the order rotating; the
others wait on their pipe meanwhile. Windows of the same round ran seconds apart, and their ratios
are what the benchmark compares.

A worker (``python -m fused_swiglu.bench.side_by_side SPEC``) reads one command per line: ``window``
(time one window, answer its ms per step) or ``finish`` (answer the run's result and exit). Answers
are JSON lines after ``ANSWER``; anything else the process prints is ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

from .training import RunSpec, Training

ANSWER = "@@fused-swiglu-worker "


class WorkerFailed(RuntimeError):
    """A worker that exited, answered nothing in time, or reported an error."""


class Worker:
    """One variant's process, driven through its pipes."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - open while the process runs
        command = [sys.executable, "-m", "fused_swiglu.bench.side_by_side", json.dumps(asdict(spec))]
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1
        )
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._process.stdout:
            if line.startswith(ANSWER):
                self._answers.put(json.loads(line[len(ANSWER) :]))
        self._answers.put(None)  # the process closed its output: it exited

    def ask(self, command: str | None, timeout: float | None) -> dict:
        """Sends ``command`` (None: sends nothing, waits for the first answer) and returns the answer."""
        if command is not None:
            try:
                self._process.stdin.write(command + "\n")
                self._process.stdin.flush()
            except OSError:  # the process is gone; its error is read below
                pass
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            self.stop(grace=0)
            raise WorkerFailed(f"no answer within {timeout} s") from None
        if answer is None:
            self._process.wait()
            raise WorkerFailed(self._error_tail() or f"exit code {self._process.returncode}")
        if "error" in answer:
            raise WorkerFailed(answer["error"])
        return answer

    def _error_tail(self) -> str:
        self._stderr.seek(0)
        return " / ".join(self._stderr.read().strip().splitlines()[-3:])

    def stop(self, grace: float = 10.0) -> None:
        """Ends the process: its input closed, ``grace`` seconds to exit, then killed."""
        with contextlib.suppress(OSError):  # already gone
            self._process.stdin.close()
        try:
            self._process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._stderr.close()


def run_side_by_side(
    specs: list[RunSpec], windows: int, timeout: float | None = None, log: Callable[[str], None] = print
) -> list[dict]:
    """Each spec's variant in its own process, started one after another, then ``windows`` rounds of
    one window each, in turn (the order rotating each round); returns each run's result, or its error."""
    by_variant = {spec.variant: spec for spec in specs}
    if len(by_variant) != len(specs):
        raise ValueError("each variant runs once side by side; repeat the call for repetitions")
    workers: dict[str, Worker] = {}
    results: dict[str, dict] = {}
    spans: dict[str, list[tuple[float, float]]] = {}  # each window's start and end, wall clock
    for spec in specs:
        worker = Worker(spec)
        try:
            ready = worker.ask(None, timeout)
            workers[spec.variant] = worker
            log(f"  {spec.variant}: ready, first step {ready['first_step_s']:.1f} s")
        except WorkerFailed as error:
            worker.stop()
            results[spec.variant] = {**asdict(spec), "error": str(error)}
            log(f"  {spec.variant}: failed: {error}")
    for round_ in range(windows):
        names = list(workers)
        shift = round_ % max(1, len(names))
        times = []
        for name in names[shift:] + names[:shift]:
            try:
                answer = workers[name].ask("window", timeout)
                spans.setdefault(name, []).append((answer["started"], answer["ended"]))
                times.append(f"{name} {answer['window_ms']:.2f}")
            except WorkerFailed as error:
                workers.pop(name).stop()
                results[name] = {**asdict(by_variant[name]), "error": str(error)}
                times.append(f"{name} failed")
        log(f"  round {round_ + 1}/{windows}, ms/step: " + ", ".join(times))
    for name, worker in workers.items():
        try:
            results[name] = {**worker.ask("finish", timeout), "window_spans": spans.get(name, [])}
        except WorkerFailed as error:
            results[name] = {**asdict(worker.spec), "error": str(error)}
        worker.stop()
    return [results[spec.variant] for spec in specs]


def _answer(message: dict) -> None:
    print(ANSWER + json.dumps(message), flush=True)


def serve(spec: RunSpec) -> None:
    """The worker: prepares ``spec``'s training, then answers commands from stdin until ``finish``."""
    if spec.cores:
        os.sched_setaffinity(0, spec.cores)  # before any thread starts: each one inherits it
    try:
        training = Training(spec)
    except Exception as error:  # reported to the coordinator, which reports it per variant
        _answer({"error": f"{type(error).__name__}: {error}"})
        raise
    _answer({"first_step_s": training.first_step_s})
    for line in sys.stdin:
        command = line.strip()
        if command == "window":
            started = time.time()
            window_ms = training.window()
            _answer({"window_ms": window_ms, "started": started, "ended": time.time()})
        elif command == "finish":
            _answer(training.result())
            return
        else:
            _answer({"error": f"unknown command {command!r}"})


if __name__ == "__main__":
    fields = json.loads(sys.argv[1])
    serve(RunSpec(**{**fields, "cores": tuple(fields.get("cores", ()))}))
