"""The command line and JSON output shared by the per-shape kernel benchmarks (``ws_kernels.py``,
``sweep_ws_backward.py``): run a function over benchmark shapes, print the provenance line first, and
rewrite the JSON after each shape, so that a run cut short keeps what it measured."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from fused_swiglu.bench.report import provenance, provenance_header
from fused_swiglu.bench.run import add_shape_arguments, chosen_shapes


def main(
    run_shape: Callable[[str, tuple[int, int, int], int], list[dict]], default_out: str, description: str
) -> int:
    ap = argparse.ArgumentParser(description=description)
    add_shape_arguments(ap)
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    ap.add_argument("--out", default=default_out)
    ap.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    args = ap.parse_args()
    meta = provenance(args.commit)
    print(provenance_header(meta))
    rows = []
    for name, shape in chosen_shapes(args).items():
        rows += run_shape(name, shape, args.reps)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0
