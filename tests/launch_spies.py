"""Spies on the kernel launchers that ``fused_swiglu.passes`` calls, for tests that check which
launcher ran, with what, and what was alive around it.

Every forward launcher and every backward launcher is listed here once, so that a new launcher is
added in one place; ``test_functional.test_launch_spies_cover_every_launcher`` fails if passes
calls one that is not listed.
"""

import fused_swiglu.passes as passes_mod
from fused_swiglu.kernels import plans

FORWARD_LAUNCHERS = ("glu_forward", "glu_forward_ws", "glu_forward_split")
BACKWARD_LAUNCHERS = ("glu_backward_", "glu_backward_ws_", "glu_backward_split_")


def wrap_launchers(monkeypatch, names, around) -> None:
    """Replace each launcher in ``names`` with ``around(real, *args, **kwargs)``; no launch plan
    replays meanwhile (a replay goes past them)."""
    monkeypatch.setattr(plans, "REPLAY", False)
    for name in names:
        real = getattr(passes_mod, name)
        monkeypatch.setattr(
            passes_mod, name, lambda *args, real=real, **kwargs: around(real, *args, **kwargs)
        )


def record_launches(monkeypatch, record: dict) -> list:
    """Wrap the launchers named in ``record`` ({name: what to record from the call's keyword
    arguments}) so that each call appends that to the returned list, then runs as before."""
    calls = []
    for name, what in record.items():

        def around(real, *args, what=what, **kwargs):
            calls.append(what(kwargs))
            return real(*args, **kwargs)

        wrap_launchers(monkeypatch, [name], around)
    return calls
