"""The gradient-flow recipes' formulas (`reverse_grad`, `scale_grad`, `ganin_ramp`,
`clip_grad_value`, `clip_grad_norm`, `sanitize_grad`), written once over a backend `b`.

Arithmetic with a Python number is written with Python operators (`max_norm / (norm +
eps)`), so each framework computes it as its own recipes always have (torch: a reciprocal
times the number; TensorFlow and JAX: a division); a division by a setting goes through
`b.divide_by_number` (`b.true_divide` for a step count), correctly rounded on every
backend.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "clip_by_norm",
    "clip_by_value",
    "ganin_ramp",
    "multiply",
    "non_finite_counts",
    "non_finite_message",
    "replace_non_finite",
]


def ganin_ramp(b: Any, step: Any, total_steps: int, gamma: float, max_scale: float) -> Any:
    """max_scale * (2 / (1 + exp(-gamma p)) - 1), p = clamp(step / total_steps, 0, 1): the
    progress in float32 for an integer step (true division, as torch divides its int64 step
    tensor)."""
    p = b.clamp(b.true_divide(step, total_steps), 0.0, 1.0)
    return max_scale * (2.0 / (1.0 + b.exp(-gamma * p)) - 1.0)


def multiply(b: Any, grad: Any, factor: Any) -> Any:
    """`grad * factor` in grad's dtype, with torch's dtype rules: a Python number (or a 0-d
    factor) is applied in float32 to a float16/bfloat16 gradient and rounded once; -1 is a
    negation (the cheapest kernel, and exact)."""
    if isinstance(factor, int | float) and factor == -1.0:
        return -grad
    return b.cast(b.times_number(grad, factor), b.dtype(grad))


def clip_by_value(b: Any, grad: Any, clip_value: float, scale: Any = None) -> Any:
    """`clamp(grad, -bound, bound)` with bound = clip_value (times the loss scale, when the
    gradient arrives scaled), never beyond the dtype's largest value: a bound beyond it
    clamps nothing there, and cannot be a constant of the dtype."""
    dtype = b.dtype(grad)
    top = b.finfo(dtype).max
    if scale is None:
        bound = min(float(clip_value), top)
        return b.clamp(grad, -bound, bound)
    if isinstance(scale, float):  # a scaler that has not scaled a loss yet
        bound = min(float(clip_value) * scale, top)
        return b.clamp(grad, -bound, bound)
    # The scale is an array read where the backward runs (no synchronization).
    bound_t = b.cast(b.clamp(clip_value * scale, None, top), dtype)
    return b.clamp(grad, -bound_t, bound_t)


def clip_by_norm(
    b: Any, grad: Any, max_norm: float, dim: Any, norm_type: float, eps: float,
    scale: Any = None,
) -> Any:
    """`grad * clamp(max_norm / (norm + eps), max=1)`, the norm
    `vector_norm(grad, norm_type, dim, keepdim=True)` taken in at least float32 (a float16
    gradient's sum of squares cannot overflow). Branch-free: the coefficient is 1 where the
    norm is within bounds; a NaN norm gives a NaN coefficient (a poisoned slice stays
    visible). With a loss scale s, the scaled gradient s*g is clipped as g would be:
    max_norm*s / (|s*g| + eps*s) = max_norm / (|g| + eps)."""
    dtype = b.dtype(grad)
    norm = b.vector_norm(grad, norm_type, dim, b.compute_dtype(dtype))
    if scale is None:
        coefficient = max_norm / (norm + eps)
    else:
        coefficient = max_norm * scale / (norm + eps * scale)
    coefficient = b.clamp(coefficient, None, 1.0)
    return grad * b.cast(coefficient, dtype)


def replace_non_finite(
    b: Any, grad: Any, nan: float, posinf: float | None, neginf: float | None
) -> Any:
    """`nan_to_num(grad, nan, posinf, neginf)`: +-inf default to the dtype's largest and
    lowest finite values."""
    info = b.finfo(b.dtype(grad))
    return b.nan_to_num(
        grad, nan, info.max if posinf is None else posinf,
        info.min if neginf is None else neginf,
    )


def non_finite_counts(b: Any, grad: Any) -> str:
    """" (n NaN and m infinite of k values)": read back from a concrete gradient."""
    n_nan = b.number_true(b.isnan(grad))
    n_inf = b.number_true(b.isinf(grad))
    return f" ({n_nan} NaN and {n_inf} infinite of {b.size(grad)} values)"


#: How to find the op that makes a non-finite gradient, in each framework.
_FIND_THE_OP = {
    "torch": "`torch.autograd.set_detect_anomaly(True)`",
    "TensorFlow": "`tf.debugging.enable_check_numerics()`",
    "JAX": "`jax.config.update('jax_debug_nans', True)`",
}


def non_finite_message(b: Any, recipe: Any, counts: str = "") -> str:
    """sanitize_grad(mode='raise')'s error: the gradient, the recipe, the counts (when they
    could be read) and the two ways out."""
    name = recipe.name
    what = f"the gradient of `{name}`" if name else "a gradient"
    return (
        f"{what} passing through {recipe!r} is not finite{counts}. Find the op that makes it "
        f"with {_FIND_THE_OP.get(b.name, 'your framework')}, or replace the values with "
        "`sanitize_grad(mode='replace')`."
    )
