"""The shared recipes on TensorFlow tensors: the same formulas as the torch recipes, written
with TensorFlow ops and `tf.custom_gradient`.

A recipe object (`go.recipes.ste_round()`, `go.recipes.spike("erf")`, ...) is the same for
both frameworks. Its `__call__` (and a gradient transform's `transform`) starts with one cheap
check: an argument that is not a torch tensor but is a TensorFlow one is handed to `call` (or
`transform`) here, which finds this module's implementation by the recipe's class. This
module is imported only then, so `import gradoverride` never imports TensorFlow.

How they mirror the torch recipes:

* the same formula, in the same order of operations, with the same defaults, the same
  windows (both ends inclusive, compared in the input's dtype), the same value at 0
  (`ste_sign(0) = 0`, `binarize(0) = +1`, `spike`'s `at_zero`), the same reduction dtypes
  (float32 for float16/bfloat16 inputs where torch does so) and the same output and gradient
  dtype: the input's. Where a torch op's edge behaviour is not TensorFlow's, the torch one is
  written out: `torch.sign(NaN)` is 0 (`tf.sign` gives NaN), so `ste_sign` and `ternarize`
  use `_torch_sign`; a Python number multiplying a float16/bfloat16 gradient is applied in
  float32 and rounded once, as torch's CPU and CUDA kernels do (TensorFlow would round the
  number to the half type first); `lsq` follows torch's type promotion (a 0-d step does not
  widen a float16 input); and a division by a Python number is correctly rounded in every
  mode (see `_divide`: TensorFlow's graph optimizer and XLA multiply by the reciprocal);
* every forward and backward is TensorFlow ops only, with no Python branch on a tensor's
  value and no numpy, so each recipe runs eagerly, under `tf.function` and under
  `jit_compile=True` (XLA);
* the recipe's settings are Python values closed over by the forward and its gradient
  function, never arguments of the `tf.custom_gradient` function: under `tf.function` an
  argument becomes a tensor that needs a gradient slot;
* variables (`tf.Variable`, Keras 3 variables) are read before the `tf.custom_gradient`
  function, so it never reads one (which would oblige its gradient function to take
  `variables=`), and the variable still gets its gradient through the read;
* an upstream gradient that arrives as `tf.IndexedSlices` (the output fed to `tf.gather`) is
  made dense (`tf.convert_to_tensor`) before any formula sees it, in `transform` as well;
* `keep="input"` / `keep="mask"` choose what the gradient function closes over, which is
  what TensorFlow keeps for the backward: the input (the window recomputed from it), or the
  boolean mask computed in the forward (one byte per element). The gradients are the same.

Gradient transforms: `recipe(x)` is the identity whose gradient is `recipe.transform(dy)`,
and `recipe.transform(grad)` works on a TensorFlow gradient (dense or `IndexedSlices`). A
user's own `GradientTransform` subclass gets the same identity forward, its `transform` then
receiving a TensorFlow gradient.

Differences that cannot be avoided, each documented where it applies:

* `reverse_grad` / `scale_grad` with a schedule: the schedule is evaluated with TensorFlow
  ops at `step=` (a Python int or a TensorFlow integer tensor, such as a counter variable, so
  a compiled step follows it); `ganin_ramp` has its TensorFlow form here, any other callable
  receives the step as a TensorFlow int64 tensor. A torch tensor as the `scale` is refused: a
  traced function would keep the value it held when traced. (A TensorFlow tensor as the
  `scale` cannot be given: the recipe's constructor accepts numbers, torch tensors and
  schedules.)
* `sanitize_grad(mode="raise")`: eagerly it raises `GradOverrideError` with the counts, as in
  torch; under `tf.function` the check is `tf.debugging.Assert` (an `InvalidArgumentError`
  with the same text, as torch.compile's `_assert_async` gives a `RuntimeError`); under
  `jit_compile=True` XLA compiles TensorFlow's assertions to nothing, so the check would pass
  every gradient silently: tracing it there raises `GradOverrideError` instead.
* Under XLA, `tf.reduce_max` / `tf.reduce_min` skip NaN, where torch's `amax` / `amin` and
  eager TensorFlow propagate it: `quantize` with a range taken from an input that contains
  NaN, and `clip_grad_norm(norm_type=inf)` of a gradient that contains NaN, differ there.
* Rounding: TensorFlow's `exp`, `sigmoid` and reductions are not torch's, so surrogate
  gradients and norms agree to a few float32 ulps, not to the bit (most others are
  bit-equal). torch's `sub(..., alpha=)` and `addcmul` fuse a multiply-add (one rounding);
  TensorFlow has no fused multiply-add op, so where the triangle surrogate cancels (near
  |x| = 1/alpha) the two differ by an ulp of its peak. In float16/bfloat16 the surrogates
  round their constants to the input's dtype where torch computes each op in float32: equal
  within the half type's rounding.

Not supported on TensorFlow tensors (a `GradOverrideTypeError` that names the recipe and
lists those that are): `rotation_trick`, `blackbox_solver` and `perturbed_optimizer` (these
call a Python solver between the forward and the backward, which `tf.function` and XLA
cannot trace), and
the `nn.Module` forms that hold torch state: `lsq(...).module()` (its step is a torch
parameter; call `lsq(bits)(x, step)` with a `tf.Variable` step instead) and the scheduled
module of `reverse_grad` / `scale_grad` (its step count is a torch buffer; call the recipe
with `step=`). `lsq` itself is supported: its step may be a TensorFlow tensor or variable and
gets LSQ's gradient, summed to its shape.
"""

from __future__ import annotations

import importlib
import math
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._errors import GradOverrideError, GradOverrideTypeError
from .._frameworks import autograph_artifact
from ..recipes._base import GradientTransform
from ..recipes._discrete import gumbel_softmax, rotation_trick, ste_argmax
from ..recipes._flow import (
    ScaledGradientModule,
    _ScaledGradient,
    clip_grad_norm,
    clip_grad_value,
    ganin_ramp,
    sanitize_grad,
)
from ..recipes._solvers import blackbox_solver, perturbed_optimizer
from ..recipes._ste import (
    LearnedStepQuantizer,
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
from ..recipes._surrogate import _canonical, _refuse_noise, _set, spike
from ._tracing import refuse_vectorized_map

# TensorFlow has no type stubs: its values are typed `Any` throughout.
tf: Any = importlib.import_module("tensorflow")

__all__ = ["SUPPORTED", "call", "transform"]

#: The public recipes that take TensorFlow tensors (named in the unsupported-recipe error).
SUPPORTED: tuple[str, ...] = (
    "abs_subgradient",
    "binarize",
    "clip_grad_norm",
    "clip_grad_value",
    "gumbel_softmax",
    "lsq",
    "quantize",
    "reverse_grad",
    "sanitize_grad",
    "scale_grad",
    "spike",
    "ste_argmax",
    "ste_ceil",
    "ste_clamp",
    "ste_floor",
    "ste_round",
    "ste_sign",
    "ternarize",
)

_HALF = (tf.float16, tf.bfloat16)


# ---- shared pieces --------------------------------------------------------------------------


def _custom_gradient(fn: Callable[..., tuple[Any, Callable[..., Any]]]) -> Callable[..., Any]:
    """`tf.custom_gradient`, typed (TensorFlow has no stubs)."""
    decorated: Callable[..., Any] = tf.custom_gradient(fn)
    return decorated


def _as_tensor(x: Any) -> Any:
    """`x` as a tensor: a variable is read here, outside any `tf.custom_gradient` function."""
    return x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x)


def _dense(grad: Any) -> Any:
    """An upstream gradient as a dense tensor (`IndexedSlices` come from `tf.gather`)."""
    return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad


def _compute_dtype(dtype: Any) -> Any:
    """float32 for float16/bfloat16, else `dtype`: where torch computes a scalar op (its
    "opmath" type) and where the recipes reduce."""
    return tf.float32 if dtype in _HALF else dtype


def _times_number(grad: Any, number: float) -> Any:
    """`grad * number` as torch computes a tensor times a Python number: in float32 for a
    float16/bfloat16 tensor, rounded once to its dtype."""
    compute = _compute_dtype(grad.dtype)
    return tf.cast(tf.cast(grad, compute) * number, grad.dtype)


def _divide(x: Any, number: float) -> Any:
    """`x / number` as torch divides a float32 tensor by a Python number on the CPU: the
    number rounded to float32, then one correctly rounded float32 division.

    Under `tf.function` (Grappler), XLA and the TFLite converter, TensorFlow turns a division
    by a constant into a multiplication by its reciprocal, one ulp off for about a quarter of
    all inputs: quantize's scale 2e4 / 7 became 2857.1431 (not 2857.1428), and a code at a
    rounding tie, 3.5, became 3.4999998 and rounded to 3 instead of 4. A float64 quotient
    avoids that but does not convert to TFLite's builtin ops (TFLite has no float64
    division). So the divisor is made a value none of them can fold: the number where a
    test on x's first element that always holds holds (`v >= 0 or v < 0 or v is NaN`),
    else 1 (only for an empty x, which has nothing to divide). A division by a tensor is
    left as a division, and TensorFlow's, XLA's and TFLite's float32 division kernels are
    correctly rounded: checked against torch on 5.9 million values (random bit patterns and
    near-ties of quantize codes, 52 divisors) eagerly, under `tf.function`, XLA and TFLite,
    with no difference where x and the quotient are normal numbers (TensorFlow's CPU kernels
    flush subnormals to zero in places).
    An exact float32 emulation from multiplications and additions gives the same values
    but costs 12 times the old float64 division under `tf.function` (20 times eagerly);
    this costs a slice, three comparisons and a select of a scalar.

    A float16/bfloat16 `x` is divided in float32 and rounded once to its dtype, as torch
    computes it; a float64 `x` is divided as it is (where the reciprocal rewrite remains)."""
    if x.dtype == tf.float64:
        return x / number
    if x.dtype in _HALF:
        return tf.cast(_divide(tf.cast(x, tf.float32), number), x.dtype)
    divisor = struct.unpack("f", struct.pack("f", number))[0]  # rounded to float32
    if 0 < abs(divisor) < 2.0**-126:
        # A subnormal divisor would be flushed to 0: both scaled by 2^64 (x * 2^64 is exact,
        # or infinite where the quotient is too).
        x, divisor = x * 2.0**64, divisor * 2.0**64
    first = tf.reshape(x, [-1])[:1]
    always = tf.reduce_any((first >= 0) | (first < 0) | tf.math.is_nan(first))
    return x / tf.where(always, tf.constant(divisor, x.dtype), tf.ones((), x.dtype))


def _torch_sign(x: Any) -> Any:
    """`torch.sign`: -1, 0 or +1, and 0 for NaN (where `tf.sign` gives NaN)."""
    return tf.where(tf.math.is_nan(x), tf.zeros_like(x), tf.sign(x))


def _outside(x: Any, low: Any, high: Any, inclusive: tuple[bool, bool]) -> Any:
    """Where `x` is outside the window from `low` to `high` (each end included or not, as
    `inclusive` says: the torch recipes' windows); the bounds are rounded to x's dtype, as
    torch compares a tensor with a Python number (or a tensor bound cast to x's dtype)."""
    low, high = _bound_in(low, x.dtype), _bound_in(high, x.dtype)
    below = x < low if inclusive[0] else x <= low
    above = x > high if inclusive[1] else x >= high
    return below | above


def _zero_where(mask: Any, grad: Any) -> Any:
    """`grad` with zeros where `mask` is true (`grad.masked_fill(mask, 0)`)."""
    return tf.where(mask, tf.zeros((), grad.dtype), grad)


def _in_xla() -> bool:
    """Whether the code being traced is compiled by XLA (`jit_compile=True`), as TensorFlow
    itself tells (`tf.function` enters an XLA context while tracing such a function)."""
    try:
        control_flow_util: Any = importlib.import_module(
            "tensorflow.python.ops.control_flow_util"
        )
    except ImportError:  # pragma: no cover - a TensorFlow without the module: cannot tell
        return False
    graph = tf.compat.v1.get_default_graph()
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def _straight_through(x: Any, forward: Callable[[Any], Any]) -> Any:
    """`forward(x)` whose gradient is the upstream gradient itself."""

    @_custom_gradient
    def op(x: Any) -> Any:
        def gradient(dy: Any) -> Any:
            return _dense(dy)

        return forward(x), gradient

    return op(_as_tensor(x))


def _windowed(
    x: Any,
    forward: Callable[[Any], Any],
    window: tuple[Any, Any] | None,
    keep: str,
    inclusive: tuple[bool, bool] = (True, True),
) -> Any:
    """`forward(x)` whose gradient is the upstream gradient inside the window (low <= x <=
    high, or with an end left out, as `inclusive` says), else 0 (straight-through everywhere
    when `window` is None). `keep` picks what the gradient function closes over (what
    TensorFlow keeps for it): x, or the mask of the window."""
    if window is None:
        return _straight_through(x, forward)
    low, high = window
    by_mask = keep == "mask"

    @_custom_gradient
    def op(x: Any) -> Any:
        kept = _outside(x, low, high, inclusive) if by_mask else x

        def gradient(dy: Any) -> Any:
            outside = kept if by_mask else _outside(kept, low, high, inclusive)
            return _zero_where(outside, _dense(dy))

        return forward(x), gradient

    return op(_as_tensor(x))


# ---- straight-through estimators ------------------------------------------------------------


def _ste_round(recipe: ste_round, x: Any) -> Any:
    return _straight_through(x, tf.round)  # halves to even, as torch.round


def _ste_floor(recipe: ste_floor, x: Any) -> Any:
    return _straight_through(x, tf.floor)


def _ste_ceil(recipe: ste_ceil, x: Any) -> Any:
    return _straight_through(x, tf.math.ceil)


def _ste_sign(recipe: ste_sign, x: Any) -> Any:
    return _straight_through(x, _torch_sign)


def _clamp(x: Any, low: Any, high: Any) -> Any:
    """`torch.clamp(x, low, high)`, the bounds cast to x's dtype and broadcast against it;
    NaN stays NaN, and where low > high the result is high (torch.clamp's order: max with
    low, then min with high)."""
    return tf.minimum(tf.maximum(x, _bound_in(low, x.dtype)), _bound_in(high, x.dtype))


def _bound_in(bound: Any, dtype: Any) -> Any:
    """A window bound in `dtype`: a Python number converted to it directly (rounded once,
    as torch rounds it), a tensor cast."""
    if isinstance(bound, (int, float)):
        return tf.constant(bound, dtype)
    return tf.cast(bound, dtype)


def _ste_clamp(recipe: ste_clamp, x: Any) -> Any:
    low = _tensorflow_bound(recipe, "low", recipe.low)
    high = _tensorflow_bound(recipe, "high", recipe.high)
    window = (low, high) if recipe.outside == "zero" else None
    if recipe._window is None:  # tensor bounds: the output broadcasts x against them
        return _windowed_broadcast(x, low, high, window, recipe.keep, recipe._ends)
    return _windowed(x, lambda v: _clamp(v, low, high), window, recipe.keep, recipe._ends)


def _tensorflow_bound(recipe: ste_clamp, name: str, value: Any) -> Any:
    """A bound of `ste_clamp` for a TensorFlow input: a number, or a TensorFlow tensor (a
    variable is read here, outside the `tf.custom_gradient` function)."""
    if isinstance(value, torch.Tensor):
        msg = (
            f"{recipe!r}: `{name}` is a torch tensor, and the input a TensorFlow tensor; give "
            "TensorFlow tensors (or numbers) as the bounds of a TensorFlow input."
        )
        raise GradOverrideTypeError(msg)
    return value if isinstance(value, (int, float)) else _as_tensor(value)


def _windowed_broadcast(
    x: Any, low: Any, high: Any, window: tuple[Any, Any] | None, keep: str,
    inclusive: tuple[bool, bool],
) -> Any:
    """`ste_clamp` with tensor bounds: the output has the broadcast shape of x and the
    bounds, so the gradient is summed back to x's shape; the bounds get none."""

    @_custom_gradient
    def op(x: Any) -> Any:
        y = _clamp(x, low, high)
        by_mask = window is not None and keep == "mask"
        kept = _outside(x, low, high, inclusive) if by_mask else x

        def gradient(dy: Any) -> Any:
            dy = _dense(dy)
            if window is not None:
                outside = kept if by_mask else _outside(kept, low, high, inclusive)
                dy = _zero_where(outside, dy)
            return _sum_to_shape(dy, x)

        return y, gradient

    return op(_as_tensor(x))


def _binary_sign(x: Any) -> Any:
    """-1 where x < 0, else +1 (0, -0 and NaN included), in x's dtype."""
    return tf.where(x < 0, tf.constant(-1, x.dtype), tf.constant(1, x.dtype))


def _binarize(recipe: binarize, x: Any) -> Any:
    return _windowed(x, _binary_sign, recipe._window, recipe.keep, recipe._ends)


def _abs_subgradient(recipe: abs_subgradient, x: Any) -> Any:
    """|x|, whose gradient is dy * s(x): sign(x), and `at_zero` at ±0 (as the torch
    recipe: at_zero = 1 is -1 below 0 and +1 elsewhere, NaN included)."""
    at_zero = recipe.at_zero

    @_custom_gradient
    def op(x: Any) -> Any:
        def gradient(dy: Any) -> Any:
            dy = _dense(dy)
            if at_zero == 1:
                return tf.where(x < 0, -dy, dy)
            sign = _torch_sign(x)
            if at_zero != 0:
                sign = sign + tf.constant(at_zero, x.dtype) * (1 - tf.abs(sign))
            return dy * sign

        return tf.abs(x), gradient

    return op(_as_tensor(x))


def _ternary(recipe: ternarize, x: Any) -> Any:
    """TWN's forward (see `ternarize`): threshold and scale reduced in float32 for half
    inputs. An empty input gives an empty output (its NaN mean multiplies nothing)."""
    work = _compute_dtype(x.dtype)
    magnitude = tf.cast(tf.abs(x), work)
    delta = tf.reduce_mean(magnitude) * recipe.delta_factor
    keep = tf.cast(magnitude > delta, work)
    ternary = tf.cast(_torch_sign(x), work) * keep
    if not recipe.scaled:
        return tf.cast(ternary, x.dtype)
    count = tf.maximum(tf.reduce_sum(keep), 1.0)
    alpha = tf.reduce_sum(magnitude * keep) / count
    return tf.cast(ternary * alpha, x.dtype)


def _ternarize(recipe: ternarize, x: Any) -> Any:
    return _straight_through(x, lambda v: _ternary(recipe, v))


# ---- uniform n-bit quantize -----------------------------------------------------------------


def _scale_and_zero_point(recipe: quantize, x: Any) -> tuple[Any, Any]:
    """quantize's scale s and zero point z for `x` (already in the dtype of the codes)."""
    qmin, qmax = recipe._codes
    if recipe.bound is not None:
        # A given range gives Python numbers; the torch recipe's own arithmetic (it does not
        # read x then), so both frameworks use the same s and z to the last bit.
        return recipe.scale_and_zero_point(x)
    one = tf.ones((), x.dtype)
    if recipe.symmetric:
        top = tf.reduce_max(tf.abs(x))
        return _divide(tf.where(top > 0, top, one), qmax), 0.0
    lo = tf.minimum(tf.reduce_min(x), 0.0)
    hi = tf.maximum(tf.reduce_max(x), 0.0)
    span = hi - lo
    s = _divide(tf.where(span > 0, span, one), qmax)
    return s, tf.clip_by_value(tf.round(-lo / s), float(qmin), float(qmax))


def _codes(recipe: quantize, x: Any) -> tuple[Any, Any, Any]:
    """(q, s, z): the unclamped codes round(x / s) + z, in float32 for half inputs (which
    cannot hold every code), and the scale and zero point."""
    x = tf.cast(x, _compute_dtype(x.dtype))
    s, z = _scale_and_zero_point(recipe, x)
    # s is a tensor (a true division), or a Python number (a constant divisor).
    quotient = x / s if tf.is_tensor(s) else _divide(x, s)
    return tf.round(quotient) + z, s, z


def _codes_outside(recipe: quantize, q: Any) -> Any:
    qmin, qmax = recipe._codes
    return (q < qmin) | (q > qmax)


def _quantize(recipe: quantize, x: Any) -> Any:
    qmin, qmax = recipe._codes
    by_mask = recipe.keep == "mask"

    @_custom_gradient
    def op(x: Any) -> Any:
        q, s, z = _codes(recipe, x)
        y = tf.cast((_clamp(q, qmin, qmax) - z) * s, x.dtype)
        kept = _codes_outside(recipe, q) if by_mask else x

        def gradient(dy: Any) -> Any:
            # keep="input": the codes are recomputed from x, as the torch recipe does.
            outside = kept if by_mask else _codes_outside(recipe, _codes(recipe, kept)[0])
            return _zero_where(outside, _dense(dy))

        return y, gradient

    return op(_as_tensor(x))


# ---- LSQ ------------------------------------------------------------------------------------


def _promoted(a: Any, b: Any) -> Any:
    """The floating dtype torch promotes dtypes `a` and `b` to (two different 16-bit types
    give float32)."""
    if a == b:
        return a
    if a.size == b.size:
        return tf.float32
    return a if a.size > b.size else b


def _torch_result_dtype(a: Any, b: Any) -> Any:
    """The dtype of `a / b` in torch for floating tensors: a 0-d operand does not promote a
    dimensioned one (a float16 x divided by a 0-d float32 step is float16), otherwise the
    dtypes promote. TensorFlow does not promote at all: both operands are cast to it."""
    a_rank, b_rank = a.shape.rank, b.shape.rank
    if a_rank is not None and b_rank is not None and (a_rank == 0) != (b_rank == 0):
        return a.dtype if b_rank == 0 else b.dtype
    return _promoted(a.dtype, b.dtype)


def _sum_to_shape(grad: Any, like: Any) -> Any:
    """`grad` summed over the dimensions `like` was broadcast along, in `like`'s shape."""
    _, axes = tf.raw_ops.BroadcastGradientArgs(s0=tf.shape(grad), s1=tf.shape(like))
    return tf.reshape(tf.reduce_sum(grad, axis=axes), tf.shape(like))


def _lsq_grad_scale(recipe: lsq, x: Any) -> Any:
    """LSQ's gradient scale g = 1/sqrt(N * Qp) (or `grad_scale`), from the static size of x
    in Python float64 arithmetic, as in torch; from its dynamic size otherwise."""
    if recipe.grad_scale is not None:
        return recipe.grad_scale
    qp = recipe.code_range[1]
    n = x.shape.num_elements()
    if n is not None:
        return 1.0 / math.sqrt(max(n, 1) * qp)
    size = tf.cast(tf.maximum(tf.size(x), 1), tf.float64)
    return 1.0 / tf.sqrt(size * qp)


def _check_step(recipe: lsq, step: object) -> None:
    if not tf.is_tensor(step) and not isinstance(step, tf.Variable):
        msg = (
            f"{recipe!r}: `step` must be a TensorFlow tensor or variable (the learnable step) "
            f"when `x` is a TensorFlow tensor; got {type(step).__name__} {step!r}. Hold it "
            "in a `tf.Variable`, e.g. `tf.Variable(0.1)`."
        )
        raise GradOverrideTypeError(msg)


def _lsq(recipe: lsq, x: Any, step: Any) -> Any:
    _check_step(recipe, step)
    x, step = _as_tensor(x), _as_tensor(step)
    qn, qp = recipe.code_range
    # torch's arithmetic: values in its result dtype, each operation computed in float32 for
    # float16/bfloat16 and rounded once (its "opmath"), as written out by `rounded(wide...)`.
    compute = _torch_result_dtype(x, step)
    work = _compute_dtype(compute)
    g = _lsq_grad_scale(recipe, x)
    # A Python g multiplies as a constant of the work dtype (tf.cast would round it to
    # float32 first); a dynamic one is a float64 tensor.
    g_work = tf.cast(g, work) if tf.is_tensor(g) else g

    def wide(t: Any) -> Any:
        return tf.cast(t, work)

    def rounded(t: Any) -> Any:
        return tf.cast(t, compute)

    def quotient(x: Any, step: Any) -> Any:
        return rounded(wide(x) / wide(step))

    @_custom_gradient
    def op(x: Any, step: Any) -> Any:
        codes = tf.round(_clamp(quotient(x, step), -qn, qp))
        y = tf.cast(rounded(wide(codes) * wide(step)), x.dtype)

        def gradient(dy: Any) -> Any:
            # v recomputed from x and step, which are what the gradient keeps (as in torch).
            v = quotient(x, step)
            dy = _dense(dy)
            if recipe.window == "rounded":  # the window conventions of torch's `lsq`
                below, above = tf.round(v) < -qn, tf.round(v) > qp
            elif recipe.window == "closed":
                below, above = v < -qn, v > qp
            else:
                below, above = v <= -qn, v >= qp
            inside = ~(below | above)
            grad_x = _zero_where(~inside, dy)
            # Esser et al. (2020), eq. 3: round(v) - v inside, -Qn below, Qp above.
            ends = tf.where(below, tf.constant(-qn, compute), tf.constant(qp, compute))
            ds = tf.where(inside, rounded(wide(tf.round(v)) - wide(v)), ends)
            grad_step = rounded(wide(rounded(wide(dy) * wide(ds))) * g_work)
            # Summed to the step's shape (a per-channel step), then in the step's dtype.
            grad_step = rounded(_sum_to_shape(wide(grad_step), step))
            return tf.cast(grad_x, x.dtype), tf.cast(grad_step, step.dtype)

        return y, gradient

    return op(x, step)


# ---- gradient flow --------------------------------------------------------------------------


def _identity_with(x: Any, backward: Callable[[Any], Any]) -> Any:
    """The identity whose gradient is `backward(dy)` (dy made dense first)."""

    @_custom_gradient
    def op(x: Any) -> Any:
        def gradient(dy: Any) -> Any:
            return backward(_dense(dy))

        return tf.identity(x), gradient

    return op(_as_tensor(x))


def _gradient_transform(recipe: GradientTransform, x: Any, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs:
        msg = (
            f"{recipe!r} takes one tensor; got {len(args) + 1} positional and {sorted(kwargs)}."
        )
        raise TypeError(msg)
    return _identity_with(x, lambda dy: transform(recipe, dy))


def _ganin_ramp(schedule: ganin_ramp, step: Any) -> Any:
    """`ganin_ramp` in TensorFlow ops: the progress is step / total_steps in float32, as torch
    divides its int64 step tensor (true division in the default dtype)."""
    p = tf.clip_by_value(_divide(tf.cast(step, tf.float32), schedule.total_steps), 0.0, 1.0)
    return schedule.max_scale * (2.0 / (1.0 + tf.exp(-schedule.gamma * p)) - 1.0)


def _evaluate_schedule(schedule: Callable[[Any], Any], step: Any) -> Any:
    step = tf.cast(_as_tensor(step), tf.int64)
    if isinstance(schedule, ganin_ramp):
        return _ganin_ramp(schedule, step)
    return schedule(step)


def _factor(recipe: _ScaledGradient, step: Any) -> Any:
    """The signed multiplier for the gradient: a Python number, or a TensorFlow scalar for a
    schedule evaluated at `step`."""
    scale = recipe.scale
    if isinstance(scale, torch.Tensor):
        msg = (
            f"{recipe!r} has a torch tensor as its `scale` and got a TensorFlow tensor; a "
            "traced TensorFlow function would keep the value the torch tensor held when it "
            "was traced. Pass a number, or a schedule called with `step=` (a counter "
            "`tf.Variable` follows the training step)."
        )
        raise GradOverrideTypeError(msg)
    if not recipe.scheduled or step is None:
        # A number, or the torch recipe's own error (a schedule without a step, a step
        # without a schedule); neither touches a tensor.
        return recipe.factor(step)
    value = _evaluate_schedule(scale, step)  # type: ignore[arg-type]
    return -value if recipe._sign < 0 else value


def _multiply(grad: Any, factor: Any) -> Any:
    """`grad * factor` in grad's dtype, as torch: a Python number or a 0-d factor is applied
    in float32 for half gradients; -1 is a negation."""
    if isinstance(factor, (int, float)):
        return tf.negative(grad) if factor == -1.0 else _times_number(grad, factor)
    compute = _compute_dtype(grad.dtype)
    return tf.cast(tf.cast(grad, compute) * tf.cast(factor, compute), grad.dtype)


def _scaled_gradient(recipe: _ScaledGradient, x: Any, *, step: Any = None) -> Any:
    factor = _factor(recipe, step)  # evaluated in the forward, as the torch recipe does
    return _identity_with(x, lambda dy: _multiply(dy, factor))


def _scaled_transform(recipe: _ScaledGradient, grad: Any, *, step: Any = None) -> Any:
    return _multiply(grad, _factor(recipe, step))


def _scaled_module(module: ScaledGradientModule, x: Any) -> Any:
    """The module form of reverse_grad / scale_grad: a constant scale works as the recipe;
    a schedule's step count is a torch buffer, which a traced function would freeze."""
    if module.scheduled:
        raise _unsupported(module, x, name="ScaledGradientModule with a schedule")
    return _scaled_gradient(module.recipe, x)


def _scaled_module_transform(module: ScaledGradientModule, grad: Any) -> Any:
    if module.scheduled:
        raise _unsupported(module, grad, name="ScaledGradientModule with a schedule")
    return _scaled_transform(module.recipe, grad)


def _keras_loss_scale(recipe: clip_grad_value | clip_grad_norm, dtype: Any) -> Any:
    """The scale the recipe's `scaler` (a Keras LossScaleOptimizer) multiplies the loss by
    now, as its `scale_loss` does: its `dynamic_scale` variable, read in the graph (so a
    traced or XLA-compiled step follows the scale as it changes) in `dtype`; before the
    optimizer is built, its `initial_scale`, a number."""
    optimizer = recipe.scaler
    keras = sys.modules["keras"]  # imported: the optimizer is a Keras object
    if keras.config.backend() != "tensorflow":
        msg = (
            f"{type(recipe).__name__}(scaler=...) got a Keras {type(optimizer).__name__} "
            f"whose scale lives in Keras' {keras.config.backend()!r} backend, and this "
            "gradient is TensorFlow's: a traced TensorFlow function could not follow it. "
            "Run Keras on TensorFlow (KERAS_BACKEND=tensorflow, set before importing keras) "
            "to clip TensorFlow gradients under its loss scaling."
        )
        raise GradOverrideError(msg)
    if not optimizer.built:
        return float(optimizer.initial_scale)
    return tf.cast(tf.convert_to_tensor(optimizer.dynamic_scale), dtype)


def _clip_value_transform(recipe: clip_grad_value, grad: Any) -> Any:
    # A bound beyond the dtype's range clamps nothing there (and cannot be a constant of it).
    top = float(grad.dtype.max)
    if recipe.scaler is None:
        bound = min(float(recipe.clip_value), top)
        return _clamp(grad, -bound, bound)
    # Under Keras' loss scaling the gradient is the true one times the scale: the bound on
    # the true gradient is clip_value times the scale on this one (as torch's GradScaler).
    scale = _keras_loss_scale(recipe, _compute_dtype(grad.dtype))
    if isinstance(scale, float):
        bound = min(float(recipe.clip_value) * scale, top)
        return _clamp(grad, -bound, bound)
    bound_t = tf.cast(tf.minimum(recipe.clip_value * scale, top), grad.dtype)
    return _clamp(grad, -bound_t, bound_t)


def _vector_norm(x: Any, order: float, axis: Any) -> Any:
    """`torch.linalg.vector_norm(x, ord=order, dim=axis, keepdim=True)`."""
    magnitude = tf.abs(x)
    if order == math.inf:
        return tf.reduce_max(magnitude, axis=axis, keepdims=True)
    if order == -math.inf:
        return tf.reduce_min(magnitude, axis=axis, keepdims=True)
    if order == 0:
        nonzero = tf.cast(tf.not_equal(x, 0), x.dtype)
        return tf.reduce_sum(nonzero, axis=axis, keepdims=True)
    if order == 1:
        return tf.reduce_sum(magnitude, axis=axis, keepdims=True)
    if order == 2:
        return tf.sqrt(tf.reduce_sum(x * x, axis=axis, keepdims=True))
    powered = tf.reduce_sum(tf.pow(magnitude, order), axis=axis, keepdims=True)
    return tf.pow(powered, 1.0 / order)


def _clip_norm_transform(recipe: clip_grad_norm, grad: Any) -> Any:
    # The norm in at least float32, so a float16 gradient's sum of squares cannot overflow.
    compute = _compute_dtype(grad.dtype)
    norm = _vector_norm(tf.cast(grad, compute), recipe.norm_type, recipe.dim)
    if recipe.scaler is None:
        coefficient = recipe.max_norm / (norm + recipe.eps)
    else:
        # A gradient scaled by the Keras loss scale s is clipped as the true one would be:
        # max_norm*s / (|s*g| + eps*s) = max_norm / (|g| + eps), as with torch's GradScaler.
        scale = _keras_loss_scale(recipe, compute)
        coefficient = recipe.max_norm * scale / (norm + recipe.eps * scale)
    # torch.clamp(max=1): NaN stays NaN (a poisoned slice stays visible).
    coefficient = tf.where(coefficient > 1.0, tf.ones_like(coefficient), coefficient)
    return grad * tf.cast(coefficient, grad.dtype)


def _replace_non_finite(recipe: sanitize_grad, grad: Any) -> Any:
    """`torch.nan_to_num(grad, nan, posinf, neginf)`: +-inf default to the dtype's extremes."""
    dtype = grad.dtype
    posinf = float(dtype.max) if recipe.posinf is None else recipe.posinf
    neginf = float(dtype.min) if recipe.neginf is None else recipe.neginf

    out = tf.where(tf.math.is_nan(grad), tf.constant(recipe.nan, dtype), grad)
    out = tf.where(tf.equal(grad, math.inf), tf.constant(posinf, dtype), out)
    return tf.where(tf.equal(grad, -math.inf), tf.constant(neginf, dtype), out)


def _non_finite_message(recipe: sanitize_grad, counts: str) -> str:
    what = f"the gradient of `{recipe.name}`" if recipe.name else "a gradient"
    return (
        f"{what} passing through {recipe!r} is not finite{counts}. Find the op that makes it "
        "with `tf.debugging.enable_check_numerics()`, or replace the values with "
        "`sanitize_grad(mode='replace')`."
    )


def _check_finite(recipe: sanitize_grad, grad: Any) -> Any:
    """The gradient unchanged if finite; else an error (eagerly `GradOverrideError` with the
    counts, under `tf.function` a `tf.debugging.Assert`). Under XLA, where assertions are
    compiled to nothing, tracing the check raises instead of letting it pass silently."""
    finite = tf.reduce_all(tf.math.is_finite(grad))
    if tf.executing_eagerly():
        if not bool(finite):
            n_nan = int(tf.reduce_sum(tf.cast(tf.math.is_nan(grad), tf.int64)))
            n_inf = int(tf.reduce_sum(tf.cast(tf.math.is_inf(grad), tf.int64)))
            counts = f" ({n_nan} NaN and {n_inf} infinite of {int(tf.size(grad))} values)"
            raise GradOverrideError(_non_finite_message(recipe, counts))
        return grad
    if _in_xla():
        msg = (
            f"{recipe!r} cannot check a gradient inside a jit_compile=True function: XLA "
            "compiles TensorFlow's assertions (tf.debugging.Assert, check_numerics) to "
            "nothing, so a NaN or infinite gradient would pass silently. Use "
            "`sanitize_grad(mode='replace')` there, or look for the source without "
            "jit_compile (eagerly or in a plain tf.function)."
        )
        raise GradOverrideError(msg)
    check = tf.debugging.Assert(finite, [_non_finite_message(recipe, "")])
    with tf.control_dependencies([check]):
        return tf.identity(grad)


def _sanitize_transform(recipe: sanitize_grad, grad: Any) -> Any:
    if recipe.mode == "replace":
        return _replace_non_finite(recipe, grad)
    return _check_finite(recipe, grad)


# ---- spike and its surrogates ---------------------------------------------------------------
#
# Each derivative is upstream * scale * sg(x - center), in the same order of operations as
# the torch recipe's (its comments give the closed forms), in x's dtype. The torch recipe
# blends with 0/1 factors where a `torch.where` would be slow on the CPU; `tf.where` gives
# the same values.

_SQRT_PI = math.sqrt(math.pi)


def _arctan(g: Any, x: Any, r: spike) -> Any:
    a, s = _set(r.alpha), r.scale
    k = s * a / 2
    c = math.pi * a / 2
    return g / (1 / k + (c * c / k) * x * x)


def _sigmoid_product(g: Any, x: Any, a: float, k: float) -> Any:
    ax = x * a
    return tf.sigmoid(ax) * tf.sigmoid(-ax) * g * k


def _sigmoid(g: Any, x: Any, r: spike) -> Any:
    a = _set(r.alpha)
    return _sigmoid_product(g, x, a, r.scale * a)


def _fast_sigmoid(g: Any, x: Any, r: spike) -> Any:
    a, s = _set(r.alpha), r.scale
    k = math.sqrt(2 / (s * a))
    d = tf.abs(x) * (a * k) + k
    return g / (d * d)


def _erf(g: Any, x: Any, r: spike) -> Any:
    a, s = _set(r.alpha), r.scale
    log_k = math.log(s * a / _SQRT_PI)
    return tf.exp(log_k + (-a * a) * x * x) * g


def _triangle(g: Any, x: Any, r: spike) -> Any:
    a, s = _set(r.alpha), r.scale
    k = s * a
    return tf.nn.relu(k - (k * a) * tf.abs(x)) * g


def _rectangular(g: Any, x: Any, r: spike) -> Any:
    a, s, leak = _set(r.alpha), r.scale, _set(r.leak)
    h = 0.5 / a
    k = s * a
    inside = tf.abs(x) < h
    if leak:
        # The factor in x's dtype, then times g: as the torch recipe rounds.
        factor = tf.where(inside, tf.constant(k, x.dtype), tf.constant(s * leak, x.dtype))
        return g * factor
    # The documented formula, |x| < h, so a NaN input gets 0 (as torch's compiled path; its
    # eager hardtanh_backward gives 0 or the upstream gradient depending on where the element
    # falls in its vectorized loop).
    out = tf.where(inside, g, tf.zeros((), g.dtype))
    return out if k == 1 else out * k


def _piecewise_exp(g: Any, x: Any, r: spike) -> Any:
    a, s = _set(r.alpha), r.scale
    log_k = math.log(s * a / 2)
    return tf.exp(log_k - a * tf.abs(x)) * g


def _straight(g: Any, x: Any, r: spike) -> Any:
    return g if r.scale == 1 else g * r.scale


def _circ(g: Any, x: Any, r: spike) -> Any:
    a, s = _set(r.alpha), r.scale
    c = (s * a / 2) ** (-2 / 3)
    root = tf.math.rsqrt(c + (c * a * a) * x * x)
    return root * root * root * g


def _q_pseudo_spike(g: Any, x: Any, r: spike) -> Any:
    a, s = _set(r.alpha), r.scale
    k = s ** (-1 / a)
    d = k + (k * 2 / (a - 1)) * tf.abs(x)
    return tf.pow(d, -a) * g


def _s2nn(g: Any, x: Any, r: spike) -> Any:
    a, s, b = _set(r.alpha), r.scale, _set(r.beta)
    left = _sigmoid_product(g, x, a, s * a)
    right = g / (tf.abs(x) + 1)
    if s * b != 1:
        right = right * (s * b)
    return tf.where(x < 0, left, right)


def _squarewave_fourier(g: Any, x: Any, r: spike) -> Any:
    if x.dtype in _HALF:  # in float32, as the torch recipe
        return tf.cast(_squarewave_fourier(tf.cast(g, tf.float32), tf.cast(x, tf.float32), r),
                       g.dtype)
    a, s, n = _set(r.alpha), r.scale, int(_set(r.terms))
    total = tf.cos(x * a)
    for i in range(2, n + 1):
        total = total + tf.cos(x * ((2 * i - 1) * a))
    return total * (s * 2 * a / math.pi) * g


def _nonzero_sign_log_abs(g: Any, x: Any, r: spike) -> Any:
    a, s = _set(r.alpha), r.scale
    d = tf.abs(x)
    if s != 1:
        d = d * (1 / s)
    return g / (d + 1 / (s * a))


def _fake_numerical_gradient(g: Any, x: Any, r: spike) -> Any:
    a, s = _set(r.alpha), r.scale
    d = tf.maximum(tf.abs(x), tf.constant(1 / a, x.dtype))
    if s != 1:
        d = d * (1 / s)
    return g / d


def _log_tailed_relu(g: Any, x: Any, r: spike) -> Any:
    s, leak = r.scale, _set(r.leak)
    inverse = tf.maximum(x, tf.ones((), x.dtype))
    if s != 1:
        inverse = inverse * (1 / s)
    right = (1 / inverse) * g
    left = g * (s * leak) if leak else tf.zeros((), g.dtype)
    return tf.where(x > 0, right, left)


def _leaky_factor(x: Any, r: spike, silent: Any) -> Any:
    s, z = r.scale, r.at_zero
    fired = x >= 0 if z == 1 else x > 0
    off = silent * s if not isinstance(silent, float) else tf.constant(s * silent, x.dtype)
    factor = tf.where(fired, tf.constant(s, x.dtype), off)
    if 0 < z < 1:
        factor = tf.where(tf.equal(x, 0), off * (1 - z) + z * s, factor)
    return factor


def _leaky_relu(g: Any, x: Any, r: spike, noise: Any = None) -> Any:
    leak, spread = _set(r.leak), _set(r.spread)
    silent: Any = float(leak)
    if noise is not None and spread:
        silent = (leak - spread / 2) + spread * noise
    return g * _leaky_factor(x, r, silent)


def _sparse_fast_sigmoid(g: Any, x: Any, r: spike) -> Any:
    return _fast_sigmoid(g, x, r) * tf.cast(x > _set(r.bound), x.dtype)


#: The surrogate derivatives by canonical name (aliases resolve through `_canonical`).
SURROGATE_DERIVATIVES: dict[str, Callable[[Any, Any, spike], Any]] = {
    "arctan": _arctan,
    "sigmoid": _sigmoid,
    "fast_sigmoid": _fast_sigmoid,
    "erf": _erf,
    "triangle": _triangle,
    "rectangular": _rectangular,
    "piecewise_exp": _piecewise_exp,
    "straight_through": _straight,
    "circ": _circ,
    "q_pseudo_spike": _q_pseudo_spike,
    "s2nn": _s2nn,
    "squarewave_fourier": _squarewave_fourier,
    "nonzero_sign_log_abs": _nonzero_sign_log_abs,
    "fake_numerical_gradient": _fake_numerical_gradient,
    "log_tailed_relu": _log_tailed_relu,
    "leaky_relu": _leaky_relu,
    "sparse_fast_sigmoid": _sparse_fast_sigmoid,
}


def _probability_step(x: Any, r: spike) -> Any:
    """The spike's probability when `sample=True` (the torch recipe's `probability`), in
    float32 for float16/bfloat16 inputs."""
    name, a = _canonical(r.surrogate), _set(r.alpha)
    x = tf.cast(x, _compute_dtype(x.dtype))
    if r.center:
        x = x - r.center
    if name == "arctan":
        return 0.5 + tf.atan(x * (math.pi * a / 2)) / math.pi
    if name == "sigmoid":
        return tf.sigmoid(x * a)
    if name == "fast_sigmoid":
        tail = 0.5 / (1 + a * tf.abs(x))
        return tf.where(x < 0, tail, 1 - tail)
    if name == "erf":
        return 0.5 * tf.math.erfc(-a * x)
    if name == "triangle":
        inner = a * x - 0.5 * a * a * x * tf.abs(x) + 0.5
        one, zero = tf.ones((), x.dtype), tf.zeros((), x.dtype)
        return tf.where(x < -1 / a, zero, tf.where(x > 1 / a, one, inner))
    if name == "rectangular":
        return tf.clip_by_value(a * x + 0.5, 0, 1)
    if name == "piecewise_exp":
        left = 0.5 * tf.exp(a * tf.minimum(x, 0))
        right = 1 - 0.5 * tf.exp(-a * tf.maximum(x, 0))
        return tf.where(x < 0, left, right)
    if name == "circ":
        u = a * x
        return 0.5 + 0.5 * tf.sign(u) * tf.math.rsqrt(1 + 1 / (u * u))
    if name == "q_pseudo_spike":
        c = 2 / (a - 1)
        left = 0.5 * tf.pow(1 - c * tf.minimum(x, 0), 1 - a)
        right = 1 - 0.5 * tf.pow(1 + c * tf.maximum(x, 0), 1 - a)
        return tf.where(x < 0, left, right)
    return tf.clip_by_value(x, 0, 1)  # straight_through: the input is the probability


def _step(recipe: spike, x: Any) -> Any:
    """H(x) with H(0) = `at_zero`, in x's dtype."""
    if recipe.at_zero == 0:
        return tf.cast(x > 0, x.dtype)
    if recipe.at_zero == 1:
        return tf.cast(x >= 0, x.dtype)
    at_zero = tf.constant(recipe.at_zero, x.dtype)
    return tf.where(tf.equal(x, 0), at_zero, tf.cast(x > 0, x.dtype))


def _noise(recipe: spike, x: Any, noise: Any, generator: Any) -> Any:
    """The uniform noise a stochastic spike was given, checked (or None: draw it)."""
    if generator is not None:
        msg = (
            f"{recipe!r}: a torch.Generator cannot drive TensorFlow's random numbers; on "
            "TensorFlow tensors pass `noise=` (U[0, 1) samples of x's shape, e.g. "
            "`tf.random.uniform(tf.shape(x))`), or neither to draw with TensorFlow's own."
        )
        raise GradOverrideTypeError(msg)
    if noise is None:
        return None
    noise = _as_tensor(noise)
    if not noise.dtype.is_floating or not noise.shape.is_compatible_with(x.shape):
        msg = (
            f"{recipe!r}: `noise` must be a floating tensor of U[0, 1) samples with the "
            f"input's shape; got a TensorFlow {noise.dtype.name} tensor of shape "
            f"{noise.shape} for an input of shape {x.shape}. Pass "
            "`noise=tf.random.uniform(tf.shape(x))`."
        )
        raise GradOverrideTypeError(msg)
    return noise


def _spike(recipe: spike, x: Any, noise: Any = None, generator: Any = None) -> Any:
    derivative = SURROGATE_DERIVATIVES[_canonical(recipe.surrogate)]
    x = _as_tensor(x)
    if not recipe.stochastic and (noise is not None or generator is not None):
        _refuse_noise(recipe)
    noise = _noise(recipe, x, noise, generator) if recipe.stochastic else None
    center = recipe.center

    @_custom_gradient
    def op(x: Any) -> Any:
        xc = x - center if center else x
        if recipe.sample:
            p = _probability_step(x, recipe)
            u = tf.random.uniform(tf.shape(x), dtype=p.dtype) if noise is None else (
                tf.cast(noise, p.dtype)
            )
            out = tf.cast(u < p, x.dtype)
        else:
            out = _step(recipe, x)

        def gradient(dy: Any) -> Any:
            dy = _dense(dy)
            if recipe.spread:
                u = tf.random.uniform(tf.shape(x), dtype=x.dtype) if noise is None else (
                    tf.cast(noise, x.dtype)
                )
                return _leaky_relu(dy, xc, recipe, u)
            return derivative(dy, xc, recipe)

        return out, gradient

    return op(x)


# ---- dispatch -------------------------------------------------------------------------------

#: The TensorFlow form of `recipe(x, ...)`, by recipe class (looked up along the class's MRO,
#: so `reverse_grad` and `scale_grad` share `_ScaledGradient`'s, and a user's own
#: `GradientTransform` gets the identity whose gradient is its `transform`).
# ---- discrete choices: straight-through argmax and Gumbel-softmax -----------------------------


def _work_dtype(dtype: Any) -> Any:
    """float32 for half inputs (the softmax and the noise), as the torch recipes compute."""
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def _one_hot(scores: Any, dim: int, dtype: Any) -> Any:
    """1 at the first maximum of `scores` along `dim`, 0 elsewhere, shaped like `scores`."""
    index = tf.argmax(scores, axis=dim)
    rank = scores.shape.rank
    if rank is not None:
        # `tf.one_hot` takes `axis` -1 or in [0, rank): `dim` counted from the front.
        axis = dim % rank if dim < 0 else dim
        return tf.one_hot(index, tf.shape(scores)[dim], axis=axis, dtype=dtype)
    # Rank unknown while tracing: compare each position along `dim` with the argmax.
    position = tf.cumsum(tf.ones_like(scores, tf.int64), axis=dim) - 1
    return tf.cast(tf.equal(position, tf.expand_dims(index, dim)), dtype)


def _softmax_backward(grad: Any, soft: Any, dim: int, temperature: float) -> Any:
    """soft * (grad - sum(grad * soft)) / T, multiplied before dividing by T (a one-hot
    `soft` at a tiny T gives 0, not 0 * inf), as the torch recipes compute it."""
    grad = tf.cast(grad, soft.dtype)
    out = soft * (grad - tf.reduce_sum(grad * soft, axis=dim, keepdims=True))
    return out if temperature == 1 else _divide(out, temperature)


def _ste_argmax(recipe: ste_argmax, x: Any) -> Any:
    _check_floating(recipe, x)
    dim, temperature = recipe.dim, recipe.temperature

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    @autograph_artifact
    def op(x: Any) -> Any:
        out = _one_hot(x, dim, x.dtype)

        @autograph_artifact
        def gradient(grad: Any) -> Any:
            if recipe.backward == "identity":
                return grad
            work = tf.cast(x, _work_dtype(x.dtype))
            shifted = work - tf.reduce_max(work, axis=dim, keepdims=True)
            soft = tf.nn.softmax(_divide(shifted, temperature), axis=dim)
            return tf.cast(_softmax_backward(grad, soft, dim, temperature), x.dtype)

        return out, gradient

    return op(x)


def _gumbel_noise(shape: Any, dtype: Any) -> Any:
    """Standard Gumbel samples, always finite (u clamped to [tiny, 1 - eps/2])."""
    info = np.finfo(dtype.as_numpy_dtype)
    u = tf.random.uniform(shape, minval=float(info.tiny), maxval=1.0, dtype=dtype)
    u = tf.clip_by_value(u, float(info.tiny), 1 - float(info.eps) / 2)
    return -tf.math.log(-tf.math.log(u))


def _gumbel_softmax(
    recipe: gumbel_softmax, x: Any, *, generator: Any = None, noise: Any = None
) -> Any:
    _check_floating(recipe, x)
    if generator is not None:
        msg = (
            f"{recipe!r}: `generator` is a torch.Generator, which cannot draw TensorFlow noise; "
            "seed TensorFlow (`tf.random.set_seed`) or pass the draws as `noise=`."
        )
        raise GradOverrideTypeError(msg)
    dim, temperature = recipe.dim, recipe.temperature
    work = _work_dtype(x.dtype)
    if noise is None:
        noise = _gumbel_noise(tf.shape(x), work)
    elif not (tf.is_tensor(noise) and tf.as_dtype(noise.dtype).is_floating):
        msg = (
            f"{recipe!r}: `noise` must be a floating-point tensor of Gumbel draws shaped like "
            f"the scores; got {type(noise).__name__}."
        )
        raise GradOverrideTypeError(msg)

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    @autograph_artifact
    def op(x: Any, noise: Any) -> Any:
        scores = tf.cast(x, work) + tf.cast(noise, work)
        shifted = scores - tf.reduce_max(scores, axis=dim, keepdims=True)
        soft = tf.nn.softmax(_divide(shifted, temperature), axis=dim)
        out = _one_hot(soft, dim, x.dtype) if recipe.hard else tf.cast(soft, x.dtype)

        @autograph_artifact
        def gradient(grad: Any) -> Any:
            g = _softmax_backward(grad, soft, dim, temperature)
            return tf.cast(g, x.dtype), tf.cast(g, noise.dtype)

        return out, gradient

    return op(x, noise)


_CALLS: dict[type, Callable[..., Any]] = {
    ste_argmax: _ste_argmax,
    gumbel_softmax: _gumbel_softmax,
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
    spike: _spike,
    _ScaledGradient: _scaled_gradient,
    GradientTransform: _gradient_transform,
    ScaledGradientModule: _scaled_module,
}

#: The TensorFlow form of `recipe.transform(grad, ...)`, by recipe class.
_TRANSFORMS: dict[type, Callable[..., Any]] = {
    _ScaledGradient: _scaled_transform,
    ScaledGradientModule: _scaled_module_transform,
    clip_grad_value: _clip_value_transform,
    clip_grad_norm: _clip_norm_transform,
    sanitize_grad: _sanitize_transform,
}

#: What to do instead, for each recipe or module with no TensorFlow form.
_INSTEAD: dict[type, str] = {
    rotation_trick: "its rotation has no TensorFlow form yet",
    blackbox_solver: (
        "it calls a Python solver between the forward and the backward, which tf.function "
        "and XLA cannot trace"
    ),
    perturbed_optimizer: (
        "it calls a Python solver between the forward and the backward, which tf.function "
        "and XLA cannot trace"
    ),
    LearnedStepQuantizer: (
        "its step is a torch parameter; call the recipe itself, `lsq(bits)(x, step)`, with "
        "the step in a `tf.Variable`"
    ),
    ScaledGradientModule: (
        "it keeps its step count in a torch buffer, which a traced TensorFlow function would "
        "freeze; call the recipe itself with a TensorFlow step counter, `recipe(x, step=step)`"
    ),
}


def _lookup(table: dict[type, Callable[..., Any]], recipe: object) -> Callable[..., Any] | None:
    for cls in type(recipe).__mro__:
        found = table.get(cls)
        if found is not None:
            return found
    return None


def _unsupported(recipe: object, x: Any, name: str | None = None) -> GradOverrideTypeError:
    name = name or type(recipe).__name__
    why = next((v for k, v in _INSTEAD.items() if isinstance(recipe, k)), "")
    msg = (
        f"{name} supports torch tensors only; got a TensorFlow {type(x).__name__} as its "
        f"input{f' ({why})' if why else ''}. The recipes that support TensorFlow tensors are: "
        f"{', '.join(SUPPORTED)}. Use one of them, or run {name} on torch tensors."
    )
    return GradOverrideTypeError(msg)


#: The recipes that exist for their backward and so refuse an input that gets no gradient.
_FLOATING_ONLY = (
    ste_round, ste_floor, ste_ceil, ste_sign, ste_clamp, binarize, ternarize, quantize, lsq,
    abs_subgradient,
)


def _check_floating(recipe: object, x: Any, argument: str = "x") -> None:
    """The torch recipes' refusal of integer and bool inputs, for a TensorFlow `x`."""
    import tensorflow as tf

    dtype = tf.as_dtype(x.dtype)
    if dtype.is_floating:
        return
    kind = "defined on real numbers" if dtype.is_complex else "gets no gradient"
    msg = (
        f"{recipe!r}: `{argument}` must be a floating-point tensor (float16, bfloat16, "
        f"float32 or float64); got a TensorFlow {dtype.name} tensor, which {kind}."
    )
    if not dtype.is_complex:
        msg += f" Convert it first: `tf.cast({argument}, tf.float32)`."
    raise GradOverrideTypeError(msg)


def call(recipe: object, x: Any, /, *args: Any, **kwargs: Any) -> Any:
    """`recipe(x, ...)` for a TensorFlow `x` (the torch recipe's `__call__` sends it here)."""
    refuse_vectorized_map(f"`{recipe!r}`")
    implementation = _lookup(_CALLS, recipe)
    if implementation is None:
        raise _unsupported(recipe, x)
    if isinstance(recipe, _FLOATING_ONLY):
        _check_floating(recipe, x)
    return implementation(recipe, x, *args, **kwargs)


def transform(recipe: Any, grad: Any, /, **kwargs: Any) -> Any:
    """`recipe.transform(grad, ...)` for a TensorFlow gradient (dense or `IndexedSlices`).
    A user's own `GradientTransform` gets its own `transform`, with a dense gradient."""
    grad = _dense(grad)
    implementation = _lookup(_TRANSFORMS, recipe)
    if implementation is None:
        return recipe.transform(grad, **kwargs)
    return implementation(recipe, grad, **kwargs)
