"""The straight-through family on TensorFlow tensors and JAX arrays: `ste_round`,
`ste_floor`, `ste_ceil`, `ste_sign`, `ste_clamp`, `binarize`, `abs_subgradient`,
`ternarize`, `quantize` and `lsq`.

The forwards and gradients are the torch recipes' formulas (`_formulas.ste`); what is here
is the plumbing: `b.custom_gradient`, what the gradient function closes over (which is what
the framework keeps for the backward: the input, or with `keep="mask"` the boolean mask
computed in the forward, one byte per element) and the argument checks. A variable (a
`tf.Variable`) is read before the custom-gradient function, so it still gets its gradient
through the read; an upstream gradient is made dense (`b.asarray`) before any formula sees
it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._errors import GradOverrideTypeError
from ..._ops import Backend, foreign
from .._formulas import ste as F
from .._ste import (
    abs_subgradient,
    binarize,
    lsq,
    quantize,
    ste_ceil,
    ste_clamp,
    ste_floor,
    ste_round,
    ste_sign,
    ternarize,
)

__all__ = ["CALLS", "TRANSFORMS"]


def _straight_through(b: Backend, x: Any, forward: Callable[[Any], Any]) -> Any:
    """`forward(x)` whose gradient is the upstream gradient itself."""

    def op(x: Any) -> Any:
        def gradient(dy: Any) -> Any:
            return b.asarray(dy)

        return forward(x), gradient

    return b.custom_gradient(op)(b.asarray(x))


def _windowed(
    b: Backend,
    x: Any,
    forward: Callable[[Any, Any, Any], Any],
    bounds: tuple[Any, Any] | None,
    zero_outside: bool,
    keep: str,
    inclusive: tuple[bool, bool],
    broadcast: bool = False,
) -> Any:
    """`forward(x, low, high)` whose gradient is the upstream gradient inside the window
    from `low` to `high`, else 0 (everywhere unless `zero_outside`). With `broadcast`
    (array bounds) the output has the broadcast shape of x and the bounds, and the gradient
    is summed back to x's shape.

    Array bounds are arguments of the custom gradient (which gives them none, as torch
    does), never values it closes over: a bound being differentiated (a learned clip) is a
    tracer under JAX's transforms, which must not leak out of the custom gradient."""
    by_mask = zero_outside and keep == "mask"
    given = () if bounds is None else bounds
    arrays = tuple(v for v in given if not isinstance(v, (int, float)))

    def op(x: Any, *bound_arrays: Any) -> Any:
        it = iter(bound_arrays)
        low, high = (None, None) if bounds is None else tuple(
            v if isinstance(v, (int, float)) else next(it) for v in bounds
        )
        kept = F.window_outside(b, x, low, high, inclusive) if by_mask else x

        def gradient(dy: Any) -> Any:
            dy = b.asarray(dy)
            if zero_outside:
                outside = kept if by_mask else F.window_outside(b, kept, low, high, inclusive)
                dy = b.select(outside, 0, dy)
            grad = b.sum_to_shape(dy, x) if broadcast else dy
            return (grad, *(None for _ in bound_arrays)) if bound_arrays else grad

        return forward(x, low, high), gradient

    return b.custom_gradient(op)(b.asarray(x), *arrays)


# ---- rounding and sign ---------------------------------------------------------------------


def _ste_round(b: Backend, recipe: ste_round, x: Any) -> Any:
    return _straight_through(b, x, b.round)


def _ste_floor(b: Backend, recipe: ste_floor, x: Any) -> Any:
    return _straight_through(b, x, b.floor)


def _ste_ceil(b: Backend, recipe: ste_ceil, x: Any) -> Any:
    return _straight_through(b, x, b.ceil)


def _ste_sign(b: Backend, recipe: ste_sign, x: Any) -> Any:
    return _straight_through(b, x, b.sign)


# ---- clamp and binarize --------------------------------------------------------------------


def _bound(b: Backend, recipe: ste_clamp, name: str, value: Any, x: Any) -> Any:
    """A bound of `ste_clamp` for `b`'s input: a number, or an array of the same framework
    (a variable is read here, outside the custom-gradient function)."""
    if isinstance(value, (int, float)):
        return value
    framework = "torch" if isinstance(value, torch.Tensor) else foreign(value) or ""
    if framework != foreign(x):
        kind = "torch tensor" if framework == "torch" else _KINDS.get(framework, "")
        msg = (
            f"{recipe!r}: `{name}` is a {kind}, and the input a {b.name} "
            f"{_ARRAY[b.name]}; give {b.name} {_ARRAY[b.name]}s (or numbers) as the bounds "
            f"of a {b.name} input."
        )
        raise GradOverrideTypeError(msg)
    return b.asarray(value)


_KINDS = {"tensorflow": "TensorFlow tensor", "jax": "JAX array"}
_ARRAY = {"TensorFlow": "tensor", "JAX": "array"}


def _clamped(b: Backend) -> Callable[[Any, Any, Any], Any]:
    """`torch.clamp(v, low, high)`: number bounds rounded once to v's dtype, array bounds
    cast to it and broadcast against v (the maximum with low first: high where low > high)."""

    def clamp(v: Any, low: Any, high: Any) -> Any:
        if isinstance(low, (int, float)) and isinstance(high, (int, float)):
            return b.clamp(v, low, high)
        dtype = b.dtype(v)
        lo = b.constant(low, dtype) if isinstance(low, (int, float)) else b.cast(low, dtype)
        hi = b.constant(high, dtype) if isinstance(high, (int, float)) else b.cast(high, dtype)
        return b.minimum(b.maximum(v, lo), hi)

    return clamp


def _ste_clamp(b: Backend, recipe: ste_clamp, x: Any) -> Any:
    low = _bound(b, recipe, "low", recipe.low, x)
    high = _bound(b, recipe, "high", recipe.high, x)
    return _windowed(b, x, _clamped(b), (low, high), recipe.outside == "zero", recipe.keep,
                     recipe._ends, broadcast=recipe._window is None)


def _binarize(b: Backend, recipe: binarize, x: Any) -> Any:
    window = recipe._window
    return _windowed(b, x, lambda v, low, high: F.binary_sign(b, v), window,
                     window is not None, recipe.keep, recipe._ends)


def _abs_subgradient(b: Backend, recipe: abs_subgradient, x: Any) -> Any:
    """|x|, whose gradient is dy * s(x): sign(x), and `at_zero` at ±0."""
    at_zero = recipe.at_zero

    def op(x: Any) -> Any:
        def gradient(dy: Any) -> Any:
            return b.asarray(dy) * F.slope(b, x, at_zero)

        return b.abs(x), gradient

    return b.custom_gradient(op)(b.asarray(x))


def _ternarize(b: Backend, recipe: ternarize, x: Any) -> Any:
    return _straight_through(
        b, x, lambda v: F.ternary(b, v, recipe.delta_factor, recipe.scaled)
    )


# ---- uniform n-bit quantize -----------------------------------------------------------------


def _quantize(b: Backend, recipe: quantize, x: Any) -> Any:
    code_range, symmetric, bound = recipe._codes, recipe.symmetric, recipe.bound
    by_mask = recipe.keep == "mask"

    def outside_of(x: Any) -> Any:
        return F.codes_outside(b, F.codes(b, x, code_range, symmetric, bound)[0], code_range)

    def op(x: Any) -> Any:
        q, s, z = F.codes(b, x, code_range, symmetric, bound)
        y = F.dequantize(b, q, s, z, code_range, b.dtype(x))
        # keep="input": the codes are recomputed from x, as the torch recipe does.
        kept = F.codes_outside(b, q, code_range) if by_mask else x

        def gradient(dy: Any) -> Any:
            return b.select(kept if by_mask else outside_of(kept), 0, b.asarray(dy))

        return y, gradient

    return b.custom_gradient(op)(b.asarray(x))


# ---- LSQ ------------------------------------------------------------------------------------


def _check_step(b: Backend, recipe: lsq, step: object, x: Any) -> None:
    if foreign(step) != foreign(x) or isinstance(step, torch.Tensor):
        what = "a TensorFlow tensor or variable" if b.name == "TensorFlow" else "a JAX array"
        hint = "`tf.Variable(0.1)`" if b.name == "TensorFlow" else "`jnp.asarray(0.1)`"
        msg = (
            f"{recipe!r}: `step` must be {what} (the learnable step) when `x` is a {b.name} "
            f"{_ARRAY[b.name]}; got {type(step).__name__} {step!r}. Hold it in one, e.g. "
            f"{hint}."
        )
        raise GradOverrideTypeError(msg)


def _lsq(b: Backend, recipe: lsq, x: Any, step: Any) -> Any:
    from . import check_floating

    _check_step(b, recipe, step, x)
    x, step = b.asarray(x), b.asarray(step)
    check_floating(b, recipe, step, "step")
    code_range, window = recipe.code_range, recipe.window
    g = F.grad_scale(b, x, code_range, recipe.grad_scale)

    def op(x: Any, step: Any) -> Any:
        def gradient(dy: Any) -> Any:
            # v recomputed from x and step, which are what the gradient keeps (as in torch).
            grad_x, grad_step = F.lsq_gradients(b, b.asarray(dy), x, step, code_range, window,
                                                g)
            # Summed to the step's shape (a per-channel step) as torch sums: in float32 for
            # float16/bfloat16, rounded once; then in the step's dtype.
            dtype = b.dtype(grad_step)
            wide = b.cast(grad_step, b.compute_dtype(dtype))
            grad_step = b.cast(b.cast(b.sum_to_shape(wide, step), dtype), b.dtype(step))
            # x's gradient summed to its shape too: a step may broadcast x to a larger shape.
            return b.cast(b.sum_to_shape(grad_x, x), b.dtype(x)), grad_step

        return F.lsq_forward(b, x, step, code_range), gradient

    return b.custom_gradient(op)(x, step)


#: recipe class -> implementation(b, recipe, x, *args, **kwargs)
CALLS: dict[type, Callable[..., Any]] = {
    ste_round: _ste_round,
    ste_floor: _ste_floor,
    ste_ceil: _ste_ceil,
    ste_sign: _ste_sign,
    ste_clamp: _ste_clamp,
    binarize: _binarize,
    abs_subgradient: _abs_subgradient,
    ternarize: _ternarize,
    quantize: _quantize,
    lsq: _lsq,
}
#: recipe class -> implementation(b, recipe, grad, **kwargs)
TRANSFORMS: dict[type, Callable[..., Any]] = {}
