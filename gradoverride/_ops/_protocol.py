"""`Backend`: the primitives the recipes' formulas call, and their default compositions.

A formula takes the backend as its first argument, `b`, and calls only what is defined here,
so one formula runs on torch, TensorFlow and JAX arrays. Two kinds of method:

* primitives every backend defines (`abs`, `exp`, `where`, `cast`, `custom_gradient`, ...),
  named as numpy and the array API name them, with torch's semantics where frameworks
  differ (`sign(NaN)` is 0, `round` halves to even, `clamp` takes the maximum with `low`
  first);
* compositions of them (`times`, `divide`, `addcmul`, `minus`, `indicator`, `blend`,
  `sigmoid_product`, ...), written here once. A backend overrides one only with a kernel
  that computes the same value faster (torch's fused `addcmul`, its in-place temporaries),
  keeping the measured speed of its recipes.

Values a formula receives are arrays of the backend's framework or Python numbers; a
recipe's settings are Python values read from the recipe object.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["Backend"]


class Backend:
    """The array primitives of one framework (subclassed once per framework)."""

    #: The framework's name, as users and error messages say it.
    name: str = ""

    # ---- values -------------------------------------------------------------------------

    def asarray(self, x: Any) -> Any:
        """`x` as an array of this framework (a variable read, a gradient made dense)."""
        raise NotImplementedError

    def dtype(self, x: Any) -> Any:
        return x.dtype

    def dtype_kind(self, x: Any) -> str:
        """"floating", "complex" or "other" (integer, bool) for x's dtype."""
        raise NotImplementedError

    def dtype_name(self, x: Any) -> str:
        """x's dtype as the framework spells it ("float32", "int64")."""
        raise NotImplementedError

    def cast_hint(self, argument: str) -> str:
        """The code that converts `argument` to float32, for error messages."""
        raise NotImplementedError

    def check_call(self, recipe: object) -> None:
        """Refuse a call of `recipe` in a context this framework cannot differentiate it in
        (TensorFlow: `tf.vectorized_map`), naming it only then."""

    def cast(self, x: Any, dtype: Any) -> Any:
        raise NotImplementedError

    def constant(self, value: float, dtype: Any) -> Any:
        """A 0-d array holding `value` rounded once to `dtype`."""
        raise NotImplementedError

    def zeros_like(self, x: Any) -> Any:
        raise NotImplementedError

    def is_half(self, dtype: Any) -> bool:
        """Whether `dtype` is float16 or bfloat16."""
        raise NotImplementedError

    def compute_dtype(self, dtype: Any) -> Any:
        """float32 for float16/bfloat16, else `dtype`: where torch computes a scalar op (its
        "opmath" type) and where the recipes reduce."""
        raise NotImplementedError

    # ---- elementwise --------------------------------------------------------------------

    def abs(self, x: Any) -> Any:
        raise NotImplementedError

    def exp(self, x: Any) -> Any:
        raise NotImplementedError

    def sigmoid(self, x: Any) -> Any:
        raise NotImplementedError

    def relu(self, x: Any) -> Any:
        raise NotImplementedError

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        raise NotImplementedError

    def maximum(self, x: Any, y: Any) -> Any:
        raise NotImplementedError

    def minimum(self, x: Any, y: Any) -> Any:
        raise NotImplementedError

    # ---- reductions and shapes ----------------------------------------------------------

    def sum_to_shape(self, grad: Any, like: Any) -> Any:
        """`grad` summed over the dimensions `like` was broadcast along, in `like`'s shape."""
        raise NotImplementedError

    # ---- the custom gradient ------------------------------------------------------------

    def custom_gradient(self, fn: Callable[..., tuple[Any, Callable[..., Any]]]
                        ) -> Callable[..., Any]:
        """`fn(*arrays)` returns `(output, gradient)`, where `gradient(upstream)` gives one
        gradient per array: the decorated function computes `output` and differentiates
        as `gradient` says (TensorFlow's `tf.custom_gradient`, JAX's `jax.custom_gradient`).
        torch's recipes are `custom_backward` ops instead, so the torch backend has none."""
        raise NotImplementedError

    # ---- compositions (a backend overrides one only with a faster kernel of the same value)

    def times(self, t: Any, g: Any) -> Any:
        """t * g (torch: in place on the temporary t when that is safe)."""
        return t * g

    def divide(self, g: Any, d: Any) -> Any:
        """g / d, d an array (torch: written into the temporary d when that is safe)."""
        return g / d

    def addcmul(self, k: float, a: Any, b: Any, value: float) -> Any:
        """k + value * a * b."""
        return k + (a * b) * value

    def minus(self, k: float, t: Any, alpha: float) -> Any:
        """k - alpha * t."""
        return k - t * alpha

    def indicator(self, compare: str, a: Any, b: Any) -> Any:
        """1 where `a compare b` holds, 0 elsewhere, in a's dtype; `compare` is one of
        "lt", "le", "gt", "ge", "eq"."""
        return self.cast(_COMPARE[compare](a, b), self.dtype(a))

    def blend(self, mask: Any, on: Any, off: Any) -> Any:
        """`on` where the 0/1 `mask` is 1, `off` where it is 0 (exact while both are
        finite: one of the two terms is 0)."""
        return mask * on + (1 - mask) * off

    def apply(self, t: Any, name: str) -> Any:
        """The elementwise primitive `name` ("exp", "relu", ...) of t."""
        result: Any = getattr(self, name)(t)
        return result

    def sigmoid_product(self, g: Any, x: Any, a: float, k: float) -> Any:
        """k * g * sigmoid(a x) * sigmoid(-a x), each factor relative-accurate."""
        ax = x * a
        out = self.sigmoid(ax) * self.sigmoid(-ax) * g
        return out if k == 1 else out * k

    # ---- more elementwise ops, random draws, shapes ------------------------------------------

    #: Whether `uniform` draws from a global generator (TensorFlow's); JAX has none: its
    #: random numbers come from a key the caller holds, so a recipe takes them as an array.
    global_random: bool = False

    def atan(self, x: Any) -> Any:
        raise NotImplementedError

    def erfc(self, x: Any) -> Any:
        raise NotImplementedError

    def cos(self, x: Any) -> Any:
        raise NotImplementedError

    def rsqrt(self, x: Any) -> Any:
        raise NotImplementedError

    def reciprocal(self, x: Any) -> Any:
        raise NotImplementedError

    def sign(self, x: Any) -> Any:
        """-1, 0 or +1, and 0 for NaN (torch's `sign`)."""
        raise NotImplementedError

    def uniform(self, like: Any, dtype: Any) -> Any:
        """U[0, 1) samples of like's shape in `dtype`, from the framework's global generator
        (only where `global_random`)."""
        raise NotImplementedError

    def uniform_hint(self, argument: str) -> str:
        """The code that draws U[0, 1) samples of `argument`'s shape, for error messages."""
        raise NotImplementedError

    def static_shape(self, x: Any) -> tuple[int | None, ...] | None:
        """x's shape as known while tracing (None for an unknown size or rank)."""
        return tuple(x.shape)

    def plus(self, t: Any, u: Any) -> Any:
        """t + u (torch: in place on the temporary t when that is safe)."""
        return t + u

    def square(self, t: Any) -> Any:
        """t * t (torch: in place on the temporary t when that is safe)."""
        return t * t

    def power(self, t: Any, p: float) -> Any:
        """t ** p (torch: in place on the temporary t when that is safe)."""
        return t**p

    def clamp_min(self, t: Any, low: float) -> Any:
        """max(t, low), NaN kept (torch: in place on the temporary t when that is safe)."""
        return self.clamp(t, low, None)

    def affine(self, k: float, t: Any, alpha: float) -> Any:
        """k + alpha * t, a new array (torch: one fused pass)."""
        return k + t * alpha

    def select(self, condition: Any, x: Any, y: Any) -> Any:
        """`where`, either branch possibly a Python number (taken in the other's dtype)."""
        if isinstance(x, (int, float)):
            x = self.constant(x, self.dtype(y))
        if isinstance(y, (int, float)):
            y = self.constant(y, self.dtype(x))
        return self.where(condition, x, y)

    # ---- rounding, whole-array reductions, torch's dtype rules -------------------------------

    def round(self, x: Any) -> Any:
        """Rounded to the nearest integer, halves to even (`torch.round`)."""
        raise NotImplementedError

    def floor(self, x: Any) -> Any:
        raise NotImplementedError

    def ceil(self, x: Any) -> Any:
        raise NotImplementedError

    def sqrt(self, x: Any) -> Any:
        raise NotImplementedError

    def amax(self, x: Any) -> Any:
        """The largest element, a 0-d array (NaN if any element is NaN)."""
        raise NotImplementedError

    def amin(self, x: Any) -> Any:
        raise NotImplementedError

    def sum(self, x: Any) -> Any:
        """The sum of all elements, a 0-d array in x's dtype."""
        raise NotImplementedError

    def mean(self, x: Any) -> Any:
        raise NotImplementedError

    def count_true(self, mask: Any, dtype: Any) -> Any:
        """The number of true elements of a bool array, a 0-d array of `dtype` (counted as
        an integer, then converted)."""
        raise NotImplementedError

    def dynamic_size(self, x: Any) -> Any:
        """x's number of elements as a 0-d float64 array (for a size known only when the
        traced function runs)."""
        raise NotImplementedError

    def divide_by_number(self, x: Any, number: Any) -> Any:
        """x / number for a Python number or a 0-d array, as torch divides: one correctly
        rounded division (in float32 for float16/bfloat16 x, rounded once to its dtype).
        TensorFlow's graph optimizer, XLA and the TFLite converter rewrite a division by a
        scalar into a multiplication by its reciprocal, one ulp off for about a quarter of
        all inputs (a quantize code at a tie, 3.5, becomes 3.4999998 and rounds the other
        way): their backends keep it a division."""
        raise NotImplementedError

    def times_number(self, x: Any, number: Any) -> Any:
        """x * number for a Python number (or a 0-d array), as torch computes a tensor times
        a number: in float32 for a float16/bfloat16 x, rounded once to x's dtype."""
        raise NotImplementedError

    def div(self, a: Any, c: Any) -> Any:
        """a / c for two floating arrays, as torch computes it: torch's type promotion (a 0-d
        operand does not widen a dimensioned one; two different 16-bit types give float32),
        the division in float32 for float16/bfloat16 and rounded once, and correctly rounded
        where c is broadcast (see `divide_by_number`)."""
        raise NotImplementedError

    def mul(self, a: Any, c: Any) -> Any:
        """a * c for two floating arrays, with torch's type promotion (see `div`)."""
        raise NotImplementedError

    # ---- limits, reductions along an axis, checks, the identity with a gradient --------------

    def finfo(self, dtype: Any) -> Any:
        """The limits of a floating dtype as Python floats: `.max`, `.min` (the lowest),
        `.tiny` (the smallest normal number) and `.eps`."""
        raise NotImplementedError


    def size(self, x: Any) -> int:
        """The number of elements of a concrete x."""
        raise NotImplementedError

    def log(self, x: Any) -> Any:
        raise NotImplementedError


    def isnan(self, x: Any) -> Any:
        raise NotImplementedError

    def isinf(self, x: Any) -> Any:
        raise NotImplementedError

    def isfinite(self, x: Any) -> Any:
        raise NotImplementedError

    def ones_like(self, x: Any, dtype: Any) -> Any:
        """Ones of x's shape in `dtype`."""
        raise NotImplementedError

    def clamp(self, x: Any, low: Any, high: Any) -> Any:
        """`torch.clamp(x, low, high)`: each bound an array (cast to x's dtype), a Python
        number or None; NaN stays NaN, and where low > high the result is high."""
        raise NotImplementedError

    def true_divide(self, x: Any, number: float, *, temporary: bool = False) -> Any:
        """`divide_by_number`, an integer x (a step count) divided in float32 as torch's
        true division does; `temporary`: x is the caller's own (torch writes the quotient
        into it when that is safe)."""
        raise NotImplementedError

    def difference(self, t: Any, u: Any, *, temporary: bool = False) -> Any:
        """t - u (torch: in place on t when `temporary` says it is the caller's own and
        that is safe)."""
        return t - u

    def amax_along(self, x: Any, axis: Any) -> Any:
        """The largest value along `axis` (an int, a tuple, or None: all), kept as size-1
        dimensions; NaN where a NaN is (torch's `amax`)."""
        raise NotImplementedError

    def amin_along(self, x: Any, axis: Any) -> Any:
        """`amax_along`'s smallest counterpart."""
        raise NotImplementedError

    def sum_along(self, x: Any, axis: Any) -> Any:
        """The sum along `axis` (an int, a tuple, or None: all), kept as size-1 dimensions."""
        raise NotImplementedError

    def all_true(self, x: Any) -> Any:
        """A 0-d bool array: whether every element of the bool x is true."""
        raise NotImplementedError

    def number_true(self, x: Any) -> int:
        """How many elements of a concrete bool x are true (read back)."""
        raise NotImplementedError

    def argmax(self, x: Any, dim: int) -> Any:
        """The index of the first maximum along `dim`, kept as a size-1 dimension."""
        raise NotImplementedError

    def positions(self, x: Any, dim: int) -> Any:
        """0, 1, ... n-1 along `dim` of x (n its size there), an integer array that
        broadcasts against x (and against `argmax(x, dim)`)."""
        raise NotImplementedError

    def softmax(self, x: Any, dim: int) -> Any:
        raise NotImplementedError

    def integer_array(self, value: Any) -> Any:
        """An integer step (a Python int or an integer array of this framework) as this
        framework's integer array: what a schedule receives (TensorFlow: int64; JAX: its
        default integer)."""
        raise NotImplementedError

    def concrete(self, x: Any) -> bool:
        """Whether x's values can be read now (eagerly), not while a graph is traced."""
        raise NotImplementedError

    def runtime_assert(self, condition: Any, message: str, x: Any) -> Any:
        """x, returned once the 0-d bool `condition` is checked where the traced graph runs
        (failing with `message`); None where this framework compiles such a check to nothing
        or has none (TensorFlow under XLA, `jax.jit`), so the caller refuses instead."""
        raise NotImplementedError

    def identity_with_gradient(self, x: Any, backward: Callable[..., Any], *operands: Any
                               ) -> Any:
        """x unchanged, whose gradient is `backward(dy, *operands)` (dy dense). `operands`
        are arrays the backward reads (a schedule's value: under `jax.jit` a traced one) and
        get no gradient; Python values are closed over by `backward`. Where the framework
        can, the backward runs eagerly on concrete values (JAX outside `jax.jit`), so it can
        read them back."""
        raise NotImplementedError

    def loss_scale(self, scaler: Any, dtype: Any, recipe: str) -> Any:
        """The scale `scaler` multiplies the loss by now, read where the backward runs (an
        array in `dtype`), or a Python float before it has scaled one; `recipe` names the
        caller in the error where this framework's gradients are not scaled by it."""
        raise NotImplementedError


    def vector_norm(self, x: Any, order: float, axis: Any, dtype: Any) -> Any:
        """`torch.linalg.vector_norm(x, ord=order, dim=axis, keepdim=True, dtype=dtype)`
        (torch: its one kernel; here written out, x cast to `dtype` first)."""
        x = self.cast(x, dtype)
        magnitude = self.abs(x)
        if order == math.inf:
            return self.amax_along(magnitude, axis)
        if order == -math.inf:
            return self.amin_along(magnitude, axis)
        if order == 0:
            return self.sum_along(self.cast(x != 0, dtype), axis)
        if order == 1:
            return self.sum_along(magnitude, axis)
        if order == 2:
            return self.sqrt(self.sum_along(x * x, axis))
        return self.sum_along(magnitude**order, axis) ** (1.0 / order)

    def nan_to_num(self, x: Any, nan: float, posinf: float, neginf: float) -> Any:
        """`torch.nan_to_num(x, nan, posinf, neginf)` (torch: its one kernel)."""
        dtype = self.dtype(x)
        out = self.where(self.isnan(x), self.constant(nan, dtype), x)
        out = self.where(x == math.inf, self.constant(posinf, dtype), out)
        return self.where(x == -math.inf, self.constant(neginf, dtype), out)

    def softmax_backward(self, grad: Any, soft: Any, dim: int) -> Any:
        """The gradient of `soft = softmax(z, dim)` with respect to z, given `grad`:
        soft * (grad - sum(grad * soft, dim)) (torch: the fused kernel of its own softmax
        backward)."""
        return soft * (grad - self.sum_along(grad * soft, dim))


_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b,
}
