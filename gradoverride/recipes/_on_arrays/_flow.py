"""The gradient-flow recipes on TensorFlow tensors and JAX arrays: `reverse_grad`,
`scale_grad` (constant or scheduled), `clip_grad_value`, `clip_grad_norm`, `sanitize_grad`,
a user's own `GradientTransform`, and the constant `ScaledGradientModule`.

`recipe(x)` is the identity whose gradient is `recipe.transform(dy)`
(`b.identity_with_gradient`), and `recipe.transform(grad)` applies the formula
(`gradoverride.recipes._formulas.flow`) to a gradient directly.

* A schedule is evaluated at `step=` (a Python int, or an integer array of the framework:
  a TensorFlow counter variable, a JAX int array, so a traced step follows it) when the
  recipe is called; `ganin_ramp` with the backend's ops, any other callable receives the
  step as the framework's integer array. A torch tensor as the `scale` is refused: a traced
  function would keep the value it held when traced.
* `sanitize_grad(mode="raise")`: where the gradient's values can be read (TensorFlow
  eagerly, JAX outside `jax.jit`) it raises `GradOverrideError` with the counts, as in
  torch; under `tf.function` the check is `tf.debugging.Assert` (an `InvalidArgumentError`
  with the same text); under TensorFlow's `jit_compile=True` and JAX's `jax.jit` and
  `jax.vmap`, where no assertion stops the computation, tracing it raises
  `GradOverrideError` naming `mode='replace'`, rather than letting a NaN pass silently.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from ..._errors import GradOverrideError, GradOverrideTypeError
from ..._ops import Backend
from .._base import GradientTransform
from .._flow import (
    ScaledGradientModule,
    _ScaledGradient,
    clip_grad_norm,
    clip_grad_value,
    ganin_ramp,
    sanitize_grad,
)
from .._formulas import flow

__all__ = ["CALLS", "TRANSFORMS"]

#: What each framework's arrays are called in the messages.
_ARRAY = {"TensorFlow": "TensorFlow tensor", "JAX": "JAX array"}


def _transform(recipe: object, grad: Any) -> Any:
    from . import transform  # the dispatcher (this module is one of its tables)

    return transform(recipe, grad)


def _gradient_transform(b: Backend, recipe: GradientTransform, x: Any, *args: Any,
                        **kwargs: Any) -> Any:
    """A gradient transform's call: the identity whose gradient is its `transform` (a
    user's own subclass receives the framework's dense gradient)."""
    if args or kwargs:
        msg = f"{recipe!r} takes one tensor; got {len(args) + 1} positional and {sorted(kwargs)}."
        raise TypeError(msg)
    return b.identity_with_gradient(x, lambda dy: _transform(recipe, dy))


# ---- reversal and scaling -------------------------------------------------------------------


def _factor(b: Backend, recipe: _ScaledGradient, step: Any) -> Any:
    """The signed multiplier: a Python number, or the schedule's value at `step` (an array
    of the framework)."""
    scale = recipe.scale
    if not isinstance(scale, int | float) and not recipe.scheduled:
        msg = (
            f"{recipe!r} has a torch tensor as its `scale` and got a {_ARRAY[b.name]}; a traced "
            f"{b.name} function would keep the value the torch tensor held when it was "
            "traced. Pass a number, or a schedule called with `step=` (a step counter of "
            "your framework follows the training step)."
        )
        raise GradOverrideTypeError(msg)
    if not recipe.scheduled or step is None:
        # A number, or the torch recipe's own error (a schedule without a step, a step
        # without a schedule); neither touches an array.
        return recipe.factor(step)
    if isinstance(step, numbers.Real) and not isinstance(step, numbers.Integral):
        step = b.asarray(float(step))  # a fractional step stays one (torch divides it as is)
    elif isinstance(step, numbers.Integral):
        # A Python or numpy integer: as float32, which is what torch's true division of a
        # step count computes with (an int32 array would wrap past 2**31 without JAX's x64).
        step = b.asarray(float(step))
    elif b.dtype_kind(b.asarray(step)) != "floating":
        step = b.integer_array(step)  # a step counter (a variable) follows the training
    if isinstance(scale, ganin_ramp):
        value = flow.ganin_ramp(b, step, scale.total_steps, scale.gamma, scale.max_scale)
    else:
        value = scale(step)  # type: ignore[operator]
    return -value if recipe._sign < 0 else value


def _scaled_call(b: Backend, recipe: _ScaledGradient, x: Any, *, step: Any = None) -> Any:
    factor = _factor(b, recipe, step)  # evaluated in the forward, as the torch recipe does
    if isinstance(factor, int | float):
        return b.identity_with_gradient(x, lambda dy: flow.multiply(b, dy, factor))
    return b.identity_with_gradient(
        x, lambda dy, f: flow.multiply(b, dy, f), b.asarray(factor)
    )


def _scaled_transform(b: Backend, recipe: _ScaledGradient, grad: Any, *, step: Any = None
                      ) -> Any:
    return flow.multiply(b, grad, _factor(b, recipe, step))


def _refuse_scheduled_module(b: Backend, module: ScaledGradientModule, x: Any) -> None:
    if module.scheduled:
        from . import unsupported

        raise unsupported(b, module, x, name="ScaledGradientModule with a schedule")


def _scaled_module_call(b: Backend, module: ScaledGradientModule, x: Any) -> Any:
    """The module form: a constant scale works as the recipe; a schedule's step count is a
    torch buffer, which a traced function would freeze."""
    _refuse_scheduled_module(b, module, x)
    return _scaled_call(b, module.recipe, x)


def _scaled_module_transform(b: Backend, module: ScaledGradientModule, grad: Any) -> Any:
    _refuse_scheduled_module(b, module, grad)
    return _scaled_transform(b, module.recipe, grad)


# ---- clipping -------------------------------------------------------------------------------


def _loss_scale(b: Backend, recipe: clip_grad_value | clip_grad_norm, grad: Any) -> Any:
    if recipe.scaler is None:
        return None
    return b.loss_scale(recipe.scaler, b.compute_dtype(b.dtype(grad)), type(recipe).__name__)


def _clip_value_transform(b: Backend, recipe: clip_grad_value, grad: Any) -> Any:
    return flow.clip_by_value(b, grad, recipe.clip_value, _loss_scale(b, recipe, grad))


def _clip_norm_transform(b: Backend, recipe: clip_grad_norm, grad: Any) -> Any:
    return flow.clip_by_norm(
        b, grad, recipe.max_norm, recipe.dim, recipe.norm_type, recipe.eps,
        _loss_scale(b, recipe, grad),
    )


# ---- NaN / inf ------------------------------------------------------------------------------


def _sanitize_transform(b: Backend, recipe: sanitize_grad, grad: Any) -> Any:
    if recipe.mode == "replace":
        return flow.replace_non_finite(b, grad, recipe.nan, recipe.posinf, recipe.neginf)
    finite = b.all_true(b.isfinite(grad))
    if b.concrete(finite):
        if not bool(finite):
            counts = flow.non_finite_counts(b, grad)
            raise GradOverrideError(flow.non_finite_message(b, recipe, counts))
        return grad
    checked = b.runtime_assert(finite, flow.non_finite_message(b, recipe), grad)
    if checked is None:
        where = (
            "a jit_compile=True function: XLA compiles TensorFlow's assertions "
            "(tf.debugging.Assert, check_numerics) to nothing"
            if b.name == "TensorFlow" else
            "a traced JAX function (jax.jit, jax.vmap): nothing there stops the computation"
        )
        outside = (
            "without jit_compile (eagerly or in a plain tf.function)"
            if b.name == "TensorFlow" else "eagerly, outside jax.jit and jax.vmap"
        )
        msg = (
            f"{recipe!r} cannot check a gradient inside {where}, so a NaN or infinite "
            "gradient would pass silently. Use `sanitize_grad(mode='replace')` there, or "
            f"look for the source {outside}."
        )
        raise GradOverrideError(msg)
    return checked


#: recipe class -> implementation(b, recipe, x, *args, **kwargs)
CALLS: dict[type, Callable[..., Any]] = {
    _ScaledGradient: _scaled_call,
    GradientTransform: _gradient_transform,
    ScaledGradientModule: _scaled_module_call,
}
#: recipe class -> implementation(b, recipe, grad, **kwargs)
TRANSFORMS: dict[type, Callable[..., Any]] = {
    _ScaledGradient: _scaled_transform,
    ScaledGradientModule: _scaled_module_transform,
    clip_grad_value: _clip_value_transform,
    clip_grad_norm: _clip_norm_transform,
    sanitize_grad: _sanitize_transform,
}
