"""Plain-text and Markdown tables for the command-line reports (no dependency beyond the stdlib)."""

from __future__ import annotations

from collections.abc import Sequence


def _cell(value) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "nan"
        if value == 0 or 1e-2 <= abs(value) < 1e5:
            return f"{value:.3f}"
        return f"{value:.2e}"
    return "-" if value is None else str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence], markdown: bool = False) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values):
        padded = [
            v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return ("| " + " | ".join(padded) + " |") if markdown else "  ".join(padded)

    sep = (
        ("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        if markdown
        else "  ".join("-" * w for w in widths)
    )
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])
