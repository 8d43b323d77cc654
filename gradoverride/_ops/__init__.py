"""The array primitives the recipes' formulas are written with: one `Backend` per framework,
found by the type of the arrays that arrive.

A recipe's formula (a surrogate's derivative, quantize's codes, a gradient's clipping
coefficient) is written once, in `gradoverride.recipes._formulas`, as a function of a
backend `b` and arrays: `b.exp(...)`, `b.where(...)`, `b.times(...)`. Each framework gives
the primitives their meaning in `Backend` subclasses: torch's here (`_torch.py`), with its
fused and in-place kernels; TensorFlow's in `gradoverride._tensorflow._ops` and JAX's in
`gradoverride._jax._ops`, each imported the first time one of that framework's arrays
reaches a recipe, never by `import gradoverride` (the way einops finds its backends).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .._backends import backend
from .._errors import GradOverrideTypeError
from .._frameworks import is_jax, is_tensorflow
from ._protocol import Backend
from ._torch import TORCH

__all__ = ["TORCH", "Backend", "backend_for", "foreign"]


def foreign(value: object) -> str | None:
    """The framework of a value that is another framework's array ("tensorflow", "jax"),
    or None (a torch tensor, a number, anything else). Imports nothing."""
    if isinstance(value, Tensor):
        return None
    if is_tensorflow(value):
        return "tensorflow"
    if is_jax(value):
        return "jax"
    return None


def backend_for(value: Any) -> Backend:
    """The backend whose arrays `value` is (imported on first use)."""
    if isinstance(value, Tensor):
        return TORCH
    framework = foreign(value)
    if framework is None:
        msg = (
            f"expected a torch tensor, a TensorFlow tensor or a JAX array; got "
            f"{type(value).__name__}."
        )
        raise GradOverrideTypeError(msg)
    ops: Backend = backend(framework).OPS
    return ops
