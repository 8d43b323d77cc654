"""The backward rules of `go.straight_through`, in TensorFlow ops.

`straight_through` writes its rules in torch ops (a `hardtanh_backward` kernel for the
window, `torch.func.vjp` for a surrogate); an op it makes keeps these TensorFlow twins for
TensorFlow inputs, with the same meaning: the window includes the ends `inclusive` names
(both by default) and is compared in the input's dtype (TensorFlow converts the Python bound
to it, as torch does), a surrogate's
derivative is taken by `tf.GradientTape` and so must be written in TensorFlow ops, and
`derivative=` is called on the input as given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from .. import _straight_through_formula as formula
from .._errors import GradOverrideError

__all__ = ["gradient", "window_mask"]


def window_mask(x: Any, low: float, high: float, inclusive: tuple[bool, bool]) -> Any:
    """Where `x` is outside the window (a bool array, one byte per element)."""
    return formula.window_mask(tf, x, low, high, inclusive)


def gradient(upstream: Any, saved: dict[str, Any], **settings: Any) -> Any:
    """The gradient for the forward's first argument, as the torch rule computes it (the
    one formula in `gradoverride/_straight_through_formula.py`)."""
    return formula.gradient(tf, _surrogate_gradient, upstream, saved, **settings)


def _surrogate_gradient(upstream: Any, x: Any, surrogate: Callable[..., Any], op: str) -> Any:
    name = getattr(surrogate, "__name__", repr(surrogate))
    with tf.GradientTape() as tape:
        tape.watch(x)
        try:
            value = surrogate(x)
        except Exception as exc:
            exc.add_note(
                f"(the surrogate `{name}` of `{op}` got a TensorFlow tensor: for TensorFlow "
                "inputs write the surrogate in TensorFlow ops, e.g. `surrogate=tf.tanh`)"
            )
            raise
    if not isinstance(value, tf.Tensor) or value.shape != upstream.shape:
        got = tuple(value.shape) if isinstance(value, tf.Tensor) else type(value).__name__
        msg = (
            f"the surrogate `{name}` of `{op}` returned {got}, but the forward's output has "
            f"shape {tuple(upstream.shape)}; a surrogate maps the input to a tensor shaped "
            "like the forward's output."
        )
        raise GradOverrideError(msg)
    grad = tape.gradient(value, x, output_gradients=tf.cast(upstream, value.dtype))
    return tf.zeros_like(x) if grad is None else grad
