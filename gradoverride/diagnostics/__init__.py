"""Seeing what every gradient override in a model does: `go.overrides` lists them,
`go.monitor` records the gradients each one gets and gives while training.

`gradoverride.diagnostics` holds them and the hookups to the trainers people use
(`LightningMonitor`, a PyTorch Lightning callback, and `HuggingFaceMonitor`, a `Trainer`
callback; each imports its framework at first use). The monitor and the inventory are also
at the top level (`go.monitor`, `go.overrides`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._huggingface import HuggingFaceMonitor
    from ._inventory import OverrideRecord, Overrides, overrides
    from ._lightning import LightningMonitor
    from ._monitor import Monitor, MonitorSummary, StepRecord, SummaryRow, monitor

# Imported at first use, as the package's top level does: importing gradoverride stays cheap.
_LAZY = {
    "Monitor": "_monitor",
    "MonitorSummary": "_monitor",
    "StepRecord": "_monitor",
    "SummaryRow": "_monitor",
    "monitor": "_monitor",
    "OverrideRecord": "_inventory",
    "Overrides": "_inventory",
    "overrides": "_inventory",
    "LightningMonitor": "_lightning",
    "HuggingFaceMonitor": "_huggingface",
}

__all__ = [
    "HuggingFaceMonitor",
    "LightningMonitor",
    "Monitor",
    "MonitorSummary",
    "OverrideRecord",
    "Overrides",
    "StepRecord",
    "SummaryRow",
    "monitor",
    "overrides",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    msg = f"module 'gradoverride.diagnostics' has no attribute {name!r}"
    raise AttributeError(msg)


def __dir__() -> list[str]:
    return sorted(__all__)
