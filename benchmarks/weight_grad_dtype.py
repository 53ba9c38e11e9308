"""A weight gradient in fp32 from 16-bit operands: cuBLAS writing fp32 itself, or a 16-bit GEMM and a cast.

Run on the GPU: ``python benchmarks/weight_grad_dtype.py [--reps N] [--commit SHA]``. Under autocast
with fp32 weights, each weight gradient of the MLP's backward is a GEMM of bf16 operands whose
result lands in fp32. Stock autograd runs the bf16 GEMM and then casts its result (one more pass
over the gradient, rounded to bf16 first); ``torch.mm(..., out_dtype=torch.float32)`` has cuBLAS
write fp32 from its accumulator, what the library's backward does (``passes.mm_as``). At the whole-model
benchmark's MLP sizes: the three GEMMs of the backward (dW_gate_up, dW_down, and dX for comparison),
each timed as the bf16 GEMM alone, the GEMM plus the cast and the fp32-out GEMM, in rotating order
(``do_bench`` medians), with each one's error against a float64 product of the same operands.
"""

from __future__ import annotations

import argparse

import torch

from fused_swiglu.bench.measure import interleaved_medians
from fused_swiglu.bench.report import start_gpu_log
from fused_swiglu.testing import relative_error

#: (tokens, hidden, intermediate): bench --model's 4096 x 2, 2048 x 16 and 1024 x 4 MLPs.
SHAPES = [(8192, 4096, 14336), (8192, 2048, 8192), (4096, 1024, 2816)]


def gemms(tokens: int, hidden: int, inter: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The operands of the backward's GEMMs, bf16: the packed pre-activation gradient, x, dy, a, W."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    grad, x, dy, a = (
        randn(tokens, 2 * inter),
        randn(tokens, hidden),
        randn(tokens, hidden),
        randn(tokens, inter),
    )
    return {"dW_gate_up": (grad.t(), x), "dW_down": (dy.t(), a), "dX": (grad, randn(2 * inter, hidden))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--commit")
    args = parser.parse_args()
    if start_gpu_log(args.commit, "weight_grad_dtype.py needs a CUDA GPU") is None:
        return
    columns = ("bf16 ms", "+ cast", "fp32 out", "ratio", "err + cast", "err fp32")
    print(f"{'shape':20s} {'gemm':10s} " + " ".join(f"{c:>10s}" for c in columns))
    for tokens, hidden, inter in SHAPES:
        for name, (p, q) in gemms(tokens, hidden, inter).items():
            fns = {
                "bf16": lambda p=p, q=q: torch.mm(p, q),
                "cast": lambda p=p, q=q: torch.mm(p, q).float(),
                "fp32": lambda p=p, q=q: torch.mm(p, q, out_dtype=torch.float32),
            }
            exact = torch.mm(p.double(), q.double())
            errors = [relative_error(fns[k]().double(), exact) for k in ("cast", "fp32")]
            ms = interleaved_medians(fns, args.reps)
            shape = f"{tokens}x{hidden}x{inter}"
            cells = [f"{ms[k]:10.3f}" for k in ("bf16", "cast", "fp32")]
            cells.append(f"{ms['fp32'] / ms['cast']:10.3f}")
            cells += [f"{e:10.2e}" for e in errors]
            print(f"{shape:20s} {name:10s} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
