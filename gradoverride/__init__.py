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
from ._errors import GradOverrideError, GradOverrideTypeError
from ._module import Module
from ._override import OverrideHandle, override_backward
from ._rule import RESERVED_NAMES
from ._straight_through import straight_through

if TYPE_CHECKING:
    from ._bridge import Bridge, bridge, finite_differences, spsa
    from ._hooks import HookHandle, grad_hook

__version__ = "0.1.0"

# Loaded on first use (`import gradoverride` has a budget of 50 ms on top of `import torch`):
# `go.bridge` and its estimators, and `go.grad_hook`.
_LAZY = {
    "Bridge": "_bridge", "bridge": "_bridge", "finite_differences": "_bridge", "spsa": "_bridge",
    "HookHandle": "_hooks", "grad_hook": "_hooks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    msg = f"module 'gradoverride' has no attribute {name!r}"
    raise AttributeError(msg)

__all__ = [
    "RESERVED_NAMES",
    "Bridge",
    "CustomBackward",
    "CustomBackwardModule",
    "GradOverrideError",
    "GradOverrideTypeError",
    "HookHandle",
    "Module",
    "OverrideHandle",
    "__version__",
    "bridge",
    "custom_backward",
    "finite_differences",
    "grad_hook",
    "override_backward",
    "spsa",
    "straight_through",
]
