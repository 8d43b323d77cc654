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

from ._decorators import CustomBackward, CustomBackwardModule, custom_backward
from ._errors import GradOverrideError, GradOverrideTypeError
from ._rule import RESERVED_NAMES

__version__ = "0.1.0"

__all__ = [
    "RESERVED_NAMES",
    "CustomBackward",
    "CustomBackwardModule",
    "GradOverrideError",
    "GradOverrideTypeError",
    "__version__",
    "custom_backward",
]
