"""Plain-text tables: what `go.overrides(...)` and a monitor's summary print."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table", "one_line"]


def one_line(text: str, limit: int = 120) -> str:
    """`text` on one line for a table cell: runs of whitespace (a tensor's multi-line repr
    in a recipe's) made one space, and cut at `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 right: Sequence[bool] | None = None) -> str:
    """`rows` under `headers`, columns padded to their widest cell; a column with
    `right[k]` set is right-aligned (numbers)."""
    right = right or [False] * len(headers)
    widths = [len(h) for h in headers]
    for row in rows:
        for k, cell in enumerate(row):
            widths[k] = max(widths[k], len(cell))

    def line(cells: Sequence[str]) -> str:
        padded = (
            cell.rjust(widths[k]) if right[k] else cell.ljust(widths[k])
            for k, cell in enumerate(cells)
        )
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])
