"""gradoverride: override gradients in PyTorch with a one-line decision next to the forward.

    import gradoverride as go

    @go.custom_backward
    def quantize(x, bits=8):
        s = 2 ** bits
        return torch.round(x * s) / s

    @quantize.backward
    def _(grad, *, x):
        return grad * (x.abs() <= 1)
"""

from typing import TYPE_CHECKING, Any

from ._decorators import CustomBackward, CustomBackwardModule, custom_backward
from ._errors import GradOverrideError, GradOverrideTypeError, GradOverrideWarning
from ._module import Module
from ._override import OverrideHandle, override_backward
from ._rule import RESERVED_NAMES
from ._straight_through import straight_through

if TYPE_CHECKING:
    from . import keras as keras
    from . import recipes as recipes
    from . import testing as testing
    from ._bridge import Bridge, bridge, finite_differences, spsa
    from ._hooks import HookHandle, grad_hook
    from .diagnostics._inventory import OverrideRecord, Overrides, overrides
    from .diagnostics._monitor import Monitor, MonitorSummary, StepRecord, SummaryRow, monitor

__version__ = "0.2.0.dev0"

# Loaded on first use (`import gradoverride` has a budget of 50 ms on top of `import torch`,
# and must import neither TensorFlow nor torch._dynamo): `go.bridge` and its estimators,
# `go.grad_hook`, the diagnostics, and the subpackages `go.recipes`, `go.testing`,
# `go.diagnostics` and `go.keras` (which imports TensorFlow and Keras).
_LAZY = {
    "Bridge": "_bridge", "bridge": "_bridge", "finite_differences": "_bridge", "spsa": "_bridge",
    "HookHandle": "_hooks", "grad_hook": "_hooks",
    "Monitor": "diagnostics._monitor", "MonitorSummary": "diagnostics._monitor",
    "StepRecord": "diagnostics._monitor", "SummaryRow": "diagnostics._monitor",
    "monitor": "diagnostics._monitor",
    "OverrideRecord": "diagnostics._inventory", "Overrides": "diagnostics._inventory",
    "overrides": "diagnostics._inventory",
}
_SUBPACKAGES = ("recipes", "testing", "keras", "diagnostics")


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        msg = f"module 'gradoverride' has no attribute {name!r}"
        raise AttributeError(msg)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # `keras` only where it can be imported: `help(gradoverride)` imports what is listed.
    listed = {*__all__, *_SUBPACKAGES}
    if not _keras_importable():
        listed.discard("keras")
    return sorted(listed)


def _keras_importable() -> bool:
    from importlib.util import find_spec

    try:
        return find_spec("tensorflow") is not None and find_spec("keras") is not None
    except (ImportError, ValueError):  # (a module set to None in sys.modules)
        return False

__all__ = [
    "RESERVED_NAMES",
    "Bridge",
    "CustomBackward",
    "CustomBackwardModule",
    "GradOverrideError",
    "GradOverrideTypeError",
    "GradOverrideWarning",
    "HookHandle",
    "Module",
    "Monitor",
    "MonitorSummary",
    "OverrideHandle",
    "OverrideRecord",
    "Overrides",
    "StepRecord",
    "SummaryRow",
    "__version__",
    "bridge",
    "custom_backward",
    "finite_differences",
    "grad_hook",
    "monitor",
    "override_backward",
    "overrides",
    "spsa",
    "straight_through",
]
