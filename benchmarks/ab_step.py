"""Side-by-side A/B of library variants inside the whole training step, against the GEMM floor.

Run on the GPU: ``python benchmarks/ab_step.py --out ab.json [--commit SHA] [--only NAME]``. Two
experiments, each over the five benchmark shapes and the GLU operator at (11136, 3584, 14336):

- ``recompute-pieces``: the ``save="recompute"`` step with the factors recomputed whole and in
  ``RECOMPUTE_PIECES`` column pieces (time and extra peak memory);
- ``forward-epilogue``: the ``save="factors"`` step with the Triton training forward tile as configured,
  and with its epilogue stored in quarters (three and four pipeline stages);
- ``weight-grad-stream-factors`` / ``-preact``: the step with the weight-gradient GEMMs on one
  stream and beside the data path on a second (``stream_variants.py``), and the floor's GEMMs
  placed the same ways;
- ``warp-specialized-factors`` / ``-preact`` / ``-recompute``: the MLP step with the Triton kernels,
  with the warp-specialized (Gluon) backward only, and with the Gluon forward and backward, each
  where the library picks it;
- ``ping-pong-factors`` / ``-recompute``: the MLP step with the Gluon backward (saved factors) in
  each of its launch shapes, cooperative and ping-pong, at every shape.

``--shapes NAME ...`` picks benchmark shapes and ``--shape M H I`` adds one, for every experiment.

Per problem, the floor and every variant are timed in one loop (``do_bench`` median per repetition,
the order rotating between repetitions), so the ratios compare runs taken side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys

import torch
from stream_variants import floor_step_beside, weight_grads_beside

import fused_swiglu.autograd as autograd_mod
import fused_swiglu.kernels.glu_backward_ws as glu_backward_ws_mod
import fused_swiglu.kernels.glu_forward as glu_forward_mod
from fused_swiglu.bench.glu import GLUFloor
from fused_swiglu.bench.impls import GemmFloor
from fused_swiglu.bench.measure import median_ms, peak_mib
from fused_swiglu.bench.report import provenance, provenance_header
from fused_swiglu.bench.run import add_shape_arguments, chosen_shapes
from fused_swiglu.functional import LINEAR_SAVE_MODES
from fused_swiglu.kernels.common import Saved
from fused_swiglu.nn import SwiGLULinear, SwiGLUMLP

GLU_SHAPE = (11136, 3584, 14336)


@contextlib.contextmanager
def recompute_pieces(pieces: int):
    default = autograd_mod.RECOMPUTE_PIECES
    autograd_mod.RECOMPUTE_PIECES = pieces
    try:
        yield
    finally:
        autograd_mod.RECOMPUTE_PIECES = default


@contextlib.contextmanager
def training_forward_tile(**changes):
    """Replace fields of the Triton training forward tile (saves something, large M), the Triton
    forward running where the library picks the warp-specialized one; inference keeps its own."""
    configured = glu_forward_mod.forward_config
    chosen = autograd_mod.forward_is_warp_specialized

    def patched(m, hidden, inter, dtype, on_gpu, save=Saved.NOTHING, precision="tf32"):
        cfg = configured(m, hidden, inter, dtype, on_gpu, save, precision)
        if save == Saved.NOTHING or m <= 64:
            return cfg
        return dataclasses.replace(cfg, **changes)

    glu_forward_mod.forward_config = patched
    autograd_mod.forward_is_warp_specialized = lambda *args: False
    try:
        yield
    finally:
        glu_forward_mod.forward_config = configured
        autograd_mod.forward_is_warp_specialized = chosen


@contextlib.contextmanager
def gluon_kernels(forward: bool, backward: bool):
    """The MLP step with the warp-specialized forward and backward kernels where the library picks
    them, or with the Triton kernel in their place (each switch on its own)."""
    chosen = autograd_mod.forward_is_warp_specialized, autograd_mod.backward_is_warp_specialized
    if not forward:
        autograd_mod.forward_is_warp_specialized = lambda *args: False
    if not backward:
        autograd_mod.backward_is_warp_specialized = lambda *args: False
    try:
        yield
    finally:
        autograd_mod.forward_is_warp_specialized, autograd_mod.backward_is_warp_specialized = chosen


@contextlib.contextmanager
def backward_launch(config):
    """The Gluon backward with this launch shape for saved factors, whatever the shape would pick."""
    chosen = glu_backward_ws_mod.backward_config
    glu_backward_ws_mod.backward_config = lambda kind, hidden: (
        config if kind == Saved.FACTORS else chosen(kind, hidden)
    )
    try:
        yield
    finally:
        glu_backward_ws_mod.backward_config = chosen


EXPERIMENTS = {
    "recompute-pieces": (
        "recompute",
        {
            "whole": lambda: recompute_pieces(1),
            "pieces": lambda: recompute_pieces(autograd_mod.RECOMPUTE_PIECES),
        },
    ),
    "forward-epilogue": (
        "factors",
        {
            "configured": training_forward_tile,
            "e4 s3": lambda: training_forward_tile(epilogue_split=4),
            "e4 s4": lambda: training_forward_tile(epilogue_split=4, num_stages=4),
        },
    ),
    **{
        f"weight-grad-stream-{save}": (
            save,
            {
                "one stream": contextlib.nullcontext,
                "side": lambda: weight_grads_beside("side"),
                "priority": lambda: weight_grads_beside("priority"),
            },
        )
        for save in ("factors", "preact")
    },
    **{
        f"warp-specialized-{save}": (
            save,
            {
                "triton": lambda: gluon_kernels(forward=False, backward=False),
                "gluon backward": lambda: gluon_kernels(forward=False, backward=True),
                "gluon both": lambda: gluon_kernels(forward=True, backward=True),
            },
        )
        for save in ("factors", "preact", "recompute")
    },
    **{
        f"ping-pong-{save}": (
            save,
            {
                "cooperative": lambda: backward_launch(glu_backward_ws_mod.CONFIGS[Saved.FACTORS]),
                "ping-pong": lambda: backward_launch(glu_backward_ws_mod.PING_PONG),
            },
        )
        for save in ("factors", "recompute")
    },
}

#: Experiments about a kernel the GLU operator does not run.
MLP_ONLY = {name for name in EXPERIMENTS if name.startswith(("warp-specialized", "ping-pong"))}

#: Experiments that also time the floor's GEMMs placed on two streams as their variants place them.
FLOOR_PLACEMENTS = {
    name: ("side", "priority") for name in EXPERIMENTS if name.startswith("weight-grad-stream")
}


def add_variants_argument(parser, what: str) -> None:
    """``--variants EXPERIMENT:VARIANT ...``: ``what`` runs inside these variants too."""
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[],
        metavar="EXPERIMENT:VARIANT",
        help=f"also {what} inside these variants of EXPERIMENTS (e.g. ping-pong-factors:ping-pong)",
    )


def chosen_variants(parser, args) -> list[tuple[str, str]]:
    """The (experiment, variant) pairs of ``--variants``; an unknown one is a usage error."""
    variants = [tuple(v.split(":", 1)) for v in args.variants]
    for v in variants:
        if len(v) != 2 or v[0] not in EXPERIMENTS or v[1] not in EXPERIMENTS[v[0]][1]:
            parser.error(f"unknown variant {':'.join(v)}; see ab_step.py's EXPERIMENTS")
    return variants


def variant(context, step):
    def run() -> None:
        with context():
            step()

    return run


def problems(save: str, shapes: dict, glu: bool = True):
    """(label, floor, library step, leaves): the MLP at ``shapes``, then the GLU operator if it has
    ``save``."""
    for name, (m, h, i) in shapes.items():
        torch.manual_seed(0)
        module = SwiGLUMLP(h, i, save=save, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        floor = GemmFloor(x, module.gate_up_proj, module.down_proj.weight, dy)
        step = lambda module=module, x=x, dy=dy: module(x).backward(dy)  # noqa: E731
        yield f"mlp {name}", floor, step, [x, *module.parameters()]
    if not glu or save not in LINEAR_SAVE_MODES:
        return  # the GLU operator has no such mode, or the experiment is not about it
    m, h, i = GLU_SHAPE
    torch.manual_seed(0)
    glu = SwiGLULinear(h, i, save=save, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    da = torch.randn(m, i, device="cuda", dtype=torch.bfloat16)
    floor = GLUFloor(x, glu.gate_up_proj.detach())
    yield "glu M11136-H3584-I14336", floor, lambda: glu(x).backward(da), [x, glu.gate_up_proj]


def run_experiment(name: str, reps: int, shapes: dict) -> list[dict]:
    save, variants = EXPERIMENTS[name]
    rows = []
    for label, floor, step, leaves in problems(save, shapes, glu=name not in MLP_ONLY):
        fns = {"floor": floor.step}
        fns |= {f"floor {p}": floor_step_beside(floor, p) for p in FLOOR_PLACEMENTS.get(name, ())}
        fns |= {v: variant(ctx, step) for v, ctx in variants.items()}
        peaks, grad_diffs, first_grads = {}, {}, None
        for v in [v for v in fns if not v.startswith("floor")]:
            try:
                # Measured on the second call: the process's first step also allocates what is set
                # up once (the first variant of the first shape read 64 MiB above the others in
                # two runs, raw/ab-pp4096-c69e360.log), which is not the variant's own.
                for _ in range(2):
                    for leaf in leaves:
                        leaf.grad = None
                    peaks[v] = peak_mib(fns[v])
                # Every variant computes the same gradients; how far each lands from the first one's.
                grads = [leaf.grad.float() for leaf in leaves]
                if first_grads is None:
                    first_grads = grads
                grad_diffs[v] = max(
                    ((g - f).norm() / f.norm()).item() for g, f in zip(grads, first_grads, strict=True)
                )
            except Exception as e:  # noqa: BLE001 - a variant that fails to build is a result, not a crash
                print(f"  {v}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
                rows.append({"experiment": name, "problem": label, "variant": v, "error": str(e)[:500]})
                del fns[v]
        times: dict[str, list[float]] = {v: [] for v in fns}
        order = list(fns)
        for rep in range(reps):
            for v in order[rep % len(order) :] + order[: rep % len(order)]:
                times[v].append(median_ms(fns[v], warmup=25, rep=200, grad_to_none=leaves))
        floor_ms = statistics.median(times["floor"])
        print(f"\n== {name} / {label} (save={save}): floor {floor_ms:.3f} ms", flush=True)
        for v, values in times.items():
            ms = statistics.median(values)
            peak, diff = peaks.get(v), grad_diffs.get(v)
            rows.append(
                {"experiment": name, "problem": label, "variant": v, "ms": ms, "vs_floor": ms / floor_ms}
                | {"peak_mib": peak, "grad_rel_diff": diff, "spread_ms": [min(values), max(values)]}
            )
            peak_text = "" if peak is None else f"  peak +{peak:.0f} MiB  grads vs first {diff:.1e}"
            print(f"  {v:<14} {ms:8.3f} ms  {ms / floor_ms:.3f}x floor{peak_text}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="ab.json")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--only", choices=sorted(EXPERIMENTS), action="append", help="run only these experiments")
    add_shape_arguments(ap)
    args = ap.parse_args()
    meta = provenance(args.commit)
    print(provenance_header(meta))
    rows: list[dict] = []
    for name in args.only or list(EXPERIMENTS):
        rows += run_experiment(name, args.reps, chosen_shapes(args))
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
