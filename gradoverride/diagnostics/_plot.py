"""Drawing a monitor's history: the gradient flow through the overrides over training."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from .._errors import GradOverrideError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ._monitor import StepRecord

__all__ = ["plot_history"]


def plot_history(history: dict[str, list[StepRecord]], path: Path | None,
                 model: str) -> Figure:
    """Two panels over the steps: above, each override's returned gradient norm (solid)
    and arriving norm (dashed, same colour), log scale; below, its zeroed fraction. Written
    to `path` as a PNG when given."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        msg = (
            "Monitor.plot needs matplotlib, which is not installed; install it with "
            "`pip install 'gradoverride[plot]'` (or `pip install matplotlib`). The numbers "
            "are in `monitor.history` and `monitor.summary()` without it."
        )
        raise GradOverrideError(msg) from None
    if path is not None and path.suffix.lower() != ".png":
        msg = f"Monitor.plot writes a PNG; got the path {str(path)!r}. End it with `.png`."
        raise GradOverrideError(msg)
    # A Figure of its own, drawn on the Agg canvas without pyplot: no global backend
    # switched, nothing shown, nothing left open.
    figure = Figure(figsize=(8, 6), layout="constrained")
    norms, zeroed = figure.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    for k, (label, records) in enumerate(history.items()):
        colour = f"C{k % 10}"
        steps = [r.step for r in records]
        norms.plot(steps, [_positive(r.grad_out) for r in records], color=colour,
                   label=label)
        norms.plot(steps, [_positive(r.grad_in) for r in records], color=colour,
                   linestyle="--", alpha=0.6)
        shares = [math.nan if r.zeroed is None else r.zeroed for r in records]
        zeroed.plot(steps, shares, color=colour)
    if history:
        norms.set_yscale("log")
        norms.legend(fontsize="small", loc="best")
    else:
        norms.text(0.5, 0.5, "nothing recorded", ha="center", va="center",
                   transform=norms.transAxes)
    norms.set_ylabel("gradient norm\n(solid: returned, dashed: arriving)")
    norms.set_title(f"Gradient flow through the overrides of {model}")
    zeroed.set_ylabel("zeroed fraction")
    zeroed.set_ylim(-0.02, 1.02)
    zeroed.set_xlabel("step")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=100)
    return figure


def _positive(value: float) -> float:
    """A norm as a log axis can draw it (a zero norm leaves a gap)."""
    return value if value > 0 else math.nan
