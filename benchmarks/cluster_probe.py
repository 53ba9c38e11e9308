"""Can Triton put a GEMM tile on a 2-CTA cluster that shares its operand loads, as cuBLAS does?

cuBLAS's GEMMs on the H200 (the floor) run as 2-CTA clusters (``_2x1_``/``_1x2_`` in their names), in
which one TMA load feeds both CTAs' shared memory (multicast): less operand traffic per multiply, which
is what sets the step's time at the power cap (NOTES.md item 37). Compiled for sm_90 (no GPU needed):

- a Triton TMA matmul with ``num_ctas`` 1 and 2, per tile: whether it compiles, its shared memory per
  CTA, its TMA load instructions and how many of them multicast (``.multicast::cluster`` in the PTX);
- a Gluon TMA copy into a shared buffer that two CTAs of a cluster hold alike (a broadcast
  ``cga_layout``), which is where a multicast load would belong.

    python benchmarks/cluster_probe.py

Must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from fused_swiglu.bench.resources import _descriptor_type

SM90 = GPUTarget("cuda", 90, 32)
TILES = [(128, 128, 64), (128, 256, 64), (256, 128, 64), (256, 256, 64)]


@triton.jit
def _matmul(a_desc, b_desc, c_desc, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        acc = tl.dot(a_desc.load([pid_m * BM, k]), b_desc.load([pid_n * BN, k]).T, acc)
    c_desc.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))


def _tma_loads(ptx: str) -> str:
    """How many TMA loads (global to shared) the PTX has, and how many of them multicast."""
    loads = [
        line
        for line in ptx.splitlines()
        if "cp.async.bulk.tensor" in line and "shared::cluster.global" in line
    ]
    multicast = sum(".multicast::cluster" in line for line in loads)
    return f"{len(loads)} TMA load instructions, {multicast} multicast"


@contextlib.contextmanager
def _stderr_to(path: str):
    """Sends file descriptor 2 to ``path``: the compiler prints its diagnostics there, not to Python."""
    saved = os.dup(2)
    with open(path, "w") as sink:
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _first_error(path: str) -> str:
    with open(path) as log:
        lines = [line.strip() for line in log if "ERROR" in line or "error:" in line]
    return lines[0][:90] if lines else "no diagnostic printed"


def probe(bm: int, bn: int, bk: int, num_ctas: int) -> str:
    signature = {
        "a_desc": _descriptor_type([bm, bk], torch.bfloat16),
        "b_desc": _descriptor_type([bn, bk], torch.bfloat16),
        "c_desc": _descriptor_type([bm, bn], torch.bfloat16),
        "K": "i32",
        **dict.fromkeys(("BM", "BN", "BK"), "constexpr"),
    }
    source = ASTSource(_matmul, signature, {"BM": bm, "BN": bn, "BK": bk})
    options = {"num_warps": 8, "num_stages": 3, "num_ctas": num_ctas}
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        try:
            with _stderr_to(log.name):
                kernel = triton.compile(source, target=SM90, options=options)
        except RuntimeError:  # the pass manager failed; its diagnostic went to stderr
            return f"does not compile: {_first_error(log.name)}"
    return f"{kernel.metadata.shared:>7} B shared, {_tma_loads(kernel.asm['ptx'])}"


@gluon.jit
def _copy_tile(in_desc, out_desc):
    tile = gl.allocate_shared_memory(in_desc.dtype, in_desc.block_type.shape, in_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.expect(ready, in_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(in_desc, [0, 0], ready, tile)
    mbarrier.wait(ready, 0)
    tma.async_copy_shared_to_global(out_desc, [0, 0], tile)
    tma.store_wait(0)


def probe_gluon(cga_layout: list[list[int]], num_ctas: int) -> str:
    layout = gl.NVMMASharedLayout(128, 16, rank=2, cga_layout=cga_layout)
    t = torch.empty(256, 512, dtype=torch.bfloat16)
    desc = GluonDescriptor(t, list(t.shape), list(t.stride()), [128, 64], layout)
    desc_type = native_specialize_impl(BaseBackend, desc, False, True, True)[0]
    source = GluonASTSource(_copy_tile, {"in_desc": desc_type, "out_desc": desc_type}, {})
    kernel = triton.compile(source, target=SM90, options={"num_warps": 4, "num_ctas": num_ctas})
    return _tma_loads(kernel.asm["ptx"])


def main() -> None:
    print(f"triton {triton.__version__}, sm_90")
    for bm, bn, bk in TILES:
        for num_ctas in (1, 2):
            print(f"tile [{bm}, {bn}] x {bk}, num_ctas {num_ctas}: {probe(bm, bn, bk, num_ctas)}", flush=True)
    for cga_layout, num_ctas in (([], 1), ([[0, 0]], 2)):
        found = probe_gluon(cga_layout, num_ctas)
        print(f"Gluon TMA copy, cga_layout {cga_layout}, num_ctas {num_ctas}: {found}")


if __name__ == "__main__":
    main()
