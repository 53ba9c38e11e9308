"""Backward variants that run the weight-gradient GEMMs on a second CUDA stream beside the data path.

The data path of the MLP backward is the fused dA kernel, then dX; the weight gradients (dW_down,
then dW_gate_up) need only what is ready before each, so they can run beside it. Both kinds of kernel
fill every SM, so what this can win is the tail of each kernel (its last, partly empty wave) and the
epilogue stalls of the fused kernel. Two placements:

- ``side``: the data path on the current stream, the weight gradients on a side stream;
- ``priority``: the data path on a high-priority stream, the weight gradients on the current one,
  so the block scheduler hands free SMs to the data path first.

Used by ``ab_step.py --only weight-grad-stream``; the library itself runs one stream.
"""

from __future__ import annotations

import contextlib
import functools

import torch

import fused_swiglu.autograd as autograd_mod
from fused_swiglu.bench.glu import GLUFloor
from fused_swiglu.bench.impls import GemmFloor
from fused_swiglu.kernels.common import Saved, empty, tma_ready
from fused_swiglu.kernels.glu_grad import glu_grad_


@functools.cache
def _extra_stream(device: int, high_priority: bool) -> torch.cuda.Stream:
    return torch.cuda.Stream(device, priority=-1 if high_priority else 0)


def _streams(placement: str, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(data stream, weight stream); one of them is the current stream."""
    current = torch.cuda.current_stream(device)
    if placement == "side":
        return current, _extra_stream(device.index, False)
    return _extra_stream(device.index, True), current


def _record(stream: torch.cuda.Stream, *tensors) -> None:
    """Tell the allocator these tensors are in use on ``stream`` (their memory is not reused early)."""
    if stream != torch.cuda.current_stream():
        for t in tensors:
            if t is not None:
                t.record_stream(stream)


def _mlp_backward(placement: str, ctx, dy):
    if ctx.kept == Saved.NOTHING:
        return _original_mlp_backward(ctx, dy)
    autograd_mod._start_backward(ctx)
    x, w_gate_up, w_down, saved, a = ctx.saved_tensors
    dy = tma_ready(dy)
    scales = {"gate_scale": ctx.gate_multiplier, "out_scale": ctx.down_multiplier}
    current = torch.cuda.current_stream(dy.device)
    data, weights = _streams(placement, dy.device)
    for s in (data, weights):
        s.wait_stream(current)
    dw_down = empty(tuple(w_down.shape), dy)
    with torch.cuda.stream(data):
        recomputed = autograd_mod._backward_(dy, w_down, saved, kind=ctx.kept, **scales)
        fused_done = data.record_event()
    if ctx.kept == Saved.FACTORS:
        with torch.cuda.stream(weights):
            torch.mm(dy.t(), a, out=dw_down)
        _record(weights, a)
        a.untyped_storage().resize_(0)
    else:
        weights.wait_event(fused_done)
        with torch.cuda.stream(weights):
            torch.mm(dy.t(), recomputed, out=dw_down)
        _record(weights, recomputed)
    del a, recomputed
    dx, dw_gate_up = empty(tuple(x.shape), x), empty(tuple(w_gate_up.shape), x)
    with torch.cuda.stream(data):
        torch.mm(saved, w_gate_up, out=dx)
    weights.wait_event(fused_done)
    with torch.cuda.stream(weights):
        torch.mm(saved.t(), x, out=dw_gate_up)
    for s in (data, weights):
        current.wait_stream(s)
    for s in (data, weights):
        _record(s, dy, saved, x, w_down, w_gate_up, dw_down, dx, dw_gate_up)
    return dx, dw_gate_up, dw_down, None, None, None


def _glu_backward(placement: str, ctx, da):
    if ctx.kept == Saved.NOTHING:
        return _original_glu_backward(ctx, da)
    autograd_mod._start_backward(ctx)
    x, w_gate_up, factors = ctx.saved_tensors
    da = da.contiguous()
    grad = glu_grad_(da, factors)
    current = torch.cuda.current_stream(da.device)
    data, weights = _streams(placement, da.device)
    for s in (data, weights):
        s.wait_stream(current)
    dx, dw = empty(tuple(x.shape), x), empty(tuple(w_gate_up.shape), x)
    with torch.cuda.stream(data):
        torch.mm(grad, w_gate_up, out=dx)
    with torch.cuda.stream(weights):
        torch.mm(grad.t(), x, out=dw)
    for s in (data, weights):
        current.wait_stream(s)
        _record(s, grad, x, w_gate_up, dx, dw)
    return dx, dw, None, None


_original_mlp_backward = autograd_mod.SwiGLUMLPFunction.backward
_original_glu_backward = autograd_mod.SwiGLULinearFunction.backward


@contextlib.contextmanager
def weight_grads_beside(placement: str):
    """Both autograd functions' backwards with the weight gradients on a second stream."""
    autograd_mod.SwiGLUMLPFunction.backward = staticmethod(functools.partial(_mlp_backward, placement))
    autograd_mod.SwiGLULinearFunction.backward = staticmethod(functools.partial(_glu_backward, placement))
    try:
        yield
    finally:
        autograd_mod.SwiGLUMLPFunction.backward = staticmethod(_original_mlp_backward)
        autograd_mod.SwiGLULinearFunction.backward = staticmethod(_original_glu_backward)


def floor_step_beside(floor: GemmFloor | GLUFloor, placement: str):
    """The floor's GEMMs placed as the variant places the library's: what two streams win on cuBLAS."""
    mlp = isinstance(floor, GemmFloor)
    w_gate_up, dw_gate_up = (floor.w_gate_up, floor.dw_gate_up) if mlp else (floor.w, floor.dw)

    def step() -> None:
        current = torch.cuda.current_stream()
        data, weights = _streams(placement, floor.x.device)
        data.wait_stream(current)
        with torch.cuda.stream(data):
            floor.forward()
        weights.wait_stream(data)  # x, a and gate_up are ready
        with torch.cuda.stream(data):
            if mlp:
                torch.mm(floor.dy, floor.w_down, out=floor.da)  # stands for the fused dA kernel
            grad_done = data.record_event()
        if mlp:
            with torch.cuda.stream(weights):
                torch.mm(floor.dy.t(), floor.a, out=floor.dw_down)
        with torch.cuda.stream(data):
            torch.mm(floor.gate_up, w_gate_up, out=floor.dx)
        weights.wait_event(grad_done)
        with torch.cuda.stream(weights):
            torch.mm(floor.gate_up.t(), floor.x, out=dw_gate_up)
        current.wait_stream(data)
        current.wait_stream(weights)

    return step
