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
    # A trainer's callback only where its framework can be imported: `help()` imports what
    # is listed.
    listed = set(__all__)
    for name, package in (("LightningMonitor", "lightning"),
                          ("HuggingFaceMonitor", "transformers")):
        if not _importable(package) and not (name == "LightningMonitor"
                                             and _importable("pytorch_lightning")):
            listed.discard(name)
    return sorted(listed)


def _importable(package: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(package) is not None
    except (ImportError, ValueError):  # (a module set to None in sys.modules)
        return False
