"""The backward rules of `go.straight_through`, in JAX ops.

The same meaning as the torch rules: the window includes the ends `inclusive` names (both
by default) and is compared in the input's dtype (JAX converts the Python bound to it, as
torch does); a surrogate's derivative is taken by `jax.vjp` and so must be written in JAX
ops (`jnp.tanh`, not `torch.tanh`); `derivative=` is called on the input as given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import _straight_through_formula as formula
from .._errors import GradOverrideError

__all__ = ["gradient", "window_mask"]


def window_mask(x: Any, low: float, high: float, inclusive: tuple[bool, bool]) -> Any:
    """Where `x` is outside the window (a bool array, one byte per element)."""
    return formula.window_mask(jnp, x, low, high, inclusive)


def gradient(upstream: Any, saved: dict[str, Any], **settings: Any) -> Any:
    """The gradient for the forward's first argument, as the torch rule computes it (the
    one formula in `gradoverride/_straight_through_formula.py`)."""
    return formula.gradient(jnp, _surrogate_gradient, upstream, saved, **settings)


def _surrogate_gradient(upstream: Any, x: Any, surrogate: Callable[..., Any], op: str) -> Any:
    name = getattr(surrogate, "__name__", repr(surrogate))
    try:
        value, vjp = jax.vjp(surrogate, x)
    except Exception as exc:
        exc.add_note(
            f"(the surrogate `{name}` of `{op}` got a JAX array: for JAX inputs write the "
            "surrogate in JAX ops, e.g. `surrogate=jnp.tanh`)"
        )
        raise
    if not isinstance(value, jax.Array) or value.shape != upstream.shape:
        got = tuple(value.shape) if isinstance(value, jax.Array) else type(value).__name__
        msg = (
            f"the surrogate `{name}` of `{op}` returned {got}, but the forward's output has "
            f"shape {tuple(upstream.shape)}; a surrogate maps the input to an array shaped "
            "like the forward's output."
        )
        raise GradOverrideError(msg)
    (grad,) = vjp(upstream.astype(value.dtype))
    return grad
