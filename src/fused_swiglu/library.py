"""The library's operator namespace, ``fused_swiglu::``: its custom ops (ops.py) are
defined and implemented here through ``torch.library.Library``, with fake implementations for tracing.

Why not the ``torch.library.custom_op`` decorator: on every call its wrapper checks each output for
aliasing and routes even an op with no backward through a Python autograd layer, several times the
cost of an op defined here (docs/design/one-path.md), and a compiled graph calls these ops on every
step. What the decorator checks at run time
(outputs are new tensors, inputs are not changed), ``torch.library.opcheck`` checks in the tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("fused_swiglu", "DEF")


def define(schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Defines ``fused_swiglu::<schema>``, run by ``impl`` on every device (``impl`` picks the kernels
    or the reference itself) and traced through ``fake``; returns the op to call."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fused_swiglu::{name}", fake, lib=_LIB)
    return getattr(torch.ops.fused_swiglu, name).default
