"""JAX's `Backend`: the primitives as `jax.numpy` and `jax.lax` ops, which run eagerly and
under `jax.jit`, `jax.grad` and `jax.vmap`.

Where a JAX op's edge behaviour is not torch's, torch's is written out here, once, so every
formula computes what the torch recipe computes.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import GradOverrideError
from .._ops._protocol import Backend

__all__ = ["OPS", "JaxBackend"]

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_FINFO: Any = jnp.finfo  # (untyped in JAX's stubs)


class JaxBackend(Backend):
    name = "JAX"

    # ---- values -------------------------------------------------------------------------

    def asarray(self, x: Any) -> Any:
        return jnp.asarray(x)

    def dtype_kind(self, x: Any) -> str:
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.floating):
            return "floating"
        return "complex" if jnp.issubdtype(dtype, jnp.complexfloating) else "other"

    def dtype_name(self, x: Any) -> str:
        return str(jnp.result_type(x))

    def cast_hint(self, argument: str) -> str:
        return f"{argument}.astype(jnp.float32)"

    def cast(self, x: Any, dtype: Any) -> Any:
        return x.astype(dtype)

    def constant(self, value: float, dtype: Any) -> Any:
        return jnp.asarray(value, dtype)

    def zeros_like(self, x: Any) -> Any:
        return jnp.zeros_like(x)

    def is_half(self, dtype: Any) -> bool:
        return jnp.dtype(dtype) in _HALF

    def compute_dtype(self, dtype: Any) -> Any:
        return jnp.float32 if jnp.dtype(dtype) in _HALF else dtype

    # ---- elementwise --------------------------------------------------------------------

    def abs(self, x: Any) -> Any:
        return jnp.abs(x)

    def exp(self, x: Any) -> Any:
        return jnp.exp(x)

    def sigmoid(self, x: Any) -> Any:
        return jax.nn.sigmoid(x)

    def relu(self, x: Any) -> Any:
        return jax.nn.relu(x)

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        return jnp.where(condition, x, y)

    def maximum(self, x: Any, y: Any) -> Any:
        return jnp.maximum(x, y)

    def minimum(self, x: Any, y: Any) -> Any:
        return jnp.minimum(x, y)

    # ---- reductions and shapes ----------------------------------------------------------

    def sum_to_shape(self, grad: Any, like: Any) -> Any:
        shape = jnp.shape(like)
        if grad.shape == shape:
            return grad
        lead = grad.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(
            lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1
        )
        return jnp.sum(grad, axis=axes).reshape(shape)

    # ---- the custom gradient ------------------------------------------------------------

    def custom_gradient(self, fn: Callable[..., tuple[Any, Callable[..., Any]]]
                        ) -> Callable[..., Any]:
        """`jax.custom_gradient` (a `jax.custom_vjp` whose closure is converted, so arrays
        the gradient function closes over become residuals, under `jax.jit` and
        `jax.vmap` too); the gradient function returns one gradient per argument."""

        def tupled(*args: Any) -> tuple[Any, Callable[..., Any]]:
            out, gradient = fn(*args)

            def vjp(upstream: Any) -> tuple[Any, ...]:
                grads = gradient(upstream)
                return grads if isinstance(grads, tuple) else (grads,)

            return out, vjp

        decorated: Callable[..., Any] = jax.custom_gradient(tupled)  # type: ignore[no-untyped-call]
        return decorated


    # ---- more elementwise ops, random draws, shapes ------------------------------------------

    def atan(self, x: Any) -> Any:
        return jnp.arctan(x)

    def erfc(self, x: Any) -> Any:
        return jax.lax.erfc(x)

    def cos(self, x: Any) -> Any:
        return jnp.cos(x)

    def rsqrt(self, x: Any) -> Any:
        return jax.lax.rsqrt(x)

    def reciprocal(self, x: Any) -> Any:
        return jnp.reciprocal(x)

    def sign(self, x: Any) -> Any:
        return jnp.where(jnp.isnan(x), 0, jnp.sign(x))  # jnp.sign(NaN) is NaN

    def uniform_hint(self, argument: str) -> str:
        return f"jax.random.uniform(key, {argument}.shape)"

    def static_shape(self, x: Any) -> tuple[int | None, ...] | None:
        return tuple(jnp.shape(x))

    # ---- rounding, whole-array reductions, torch's dtype rules -------------------------------

    def round(self, x: Any) -> Any:
        return jnp.round(x)  # halves to even, as torch.round

    def floor(self, x: Any) -> Any:
        return jnp.floor(x)

    def ceil(self, x: Any) -> Any:
        return jnp.ceil(x)

    def sqrt(self, x: Any) -> Any:
        return jnp.sqrt(x)

    def amax(self, x: Any) -> Any:
        return jnp.max(x)

    def amin(self, x: Any) -> Any:
        return jnp.min(x)

    def sum(self, x: Any) -> Any:
        return jnp.sum(x)

    def mean(self, x: Any) -> Any:
        return jnp.mean(x)

    def count_true(self, mask: Any, dtype: Any) -> Any:
        return jnp.count_nonzero(mask).astype(dtype)

    def dynamic_size(self, x: Any) -> Any:  # pragma: no cover - JAX shapes are static
        return jnp.asarray(jnp.size(x), jnp.float32)

    def divide_by_number(self, x: Any, number: Any) -> Any:
        """XLA rewrites a division by a broadcast scalar, a constant or not, into a
        multiplication by its reciprocal, eagerly too (each op is compiled): one ulp off
        for about a quarter of all inputs, which moves quantize codes at a tie. So the
        divisor is broadcast through a select on a test of x that always holds (`v == v or
        v != v`), elementwise: a full-size divisor XLA cannot fold, fused into the
        division. A float16/bfloat16 x is divided in float32 and rounded once."""
        dtype = jnp.result_type(x)
        if jnp.dtype(dtype) in _HALF:
            return self.divide_by_number(x.astype(jnp.float32), number).astype(dtype)
        if isinstance(number, (int, float)):
            divisor = float(np.asarray(number, dtype))
            tiny = float(np.finfo(dtype).tiny)
            if 0 < abs(divisor) < tiny:
                # A subnormal divisor may be flushed to 0: both scaled by 2^64.
                x, divisor = x * 2.0**64, divisor * 2.0**64
            number = jnp.asarray(divisor, dtype)
        return _exact_divide(x, number)

    def times_number(self, x: Any, number: Any) -> Any:
        """In float32 for float16/bfloat16 (a Python number would otherwise be rounded to
        the half type first), rounded once to x's dtype."""
        dtype = jnp.result_type(x)
        compute = self.compute_dtype(dtype)
        factor = number if isinstance(number, (int, float)) else number.astype(compute)
        return (x.astype(compute) * factor).astype(dtype)

    def div(self, a: Any, c: Any) -> Any:
        result = _torch_result_dtype(a, c)
        compute = self.compute_dtype(result)
        return _exact_divide(a.astype(compute), c.astype(compute)).astype(result)

    def mul(self, a: Any, c: Any) -> Any:
        result = _torch_result_dtype(a, c)
        compute = self.compute_dtype(result)
        return (a.astype(compute) * c.astype(compute)).astype(result)

    # ---- limits, reductions along an axis, checks, the identity with a gradient --------------

    def finfo(self, dtype: Any) -> Any:
        info: Any = _FINFO(dtype)
        # Python floats: a numpy scalar of a half dtype would round what it is compared with.
        return SimpleNamespace(max=float(info.max), min=float(info.min),
                               tiny=float(info.tiny), eps=float(info.eps))


    def size(self, x: Any) -> int:
        return int(jnp.size(x))

    def log(self, x: Any) -> Any:
        return jnp.log(x)

    def isnan(self, x: Any) -> Any:
        return jnp.isnan(x)

    def isinf(self, x: Any) -> Any:
        return jnp.isinf(x)

    def isfinite(self, x: Any) -> Any:
        return jnp.isfinite(x)

    def ones_like(self, x: Any, dtype: Any) -> Any:
        return jnp.ones_like(x, dtype=dtype)

    def clamp(self, x: Any, low: Any, high: Any) -> Any:
        # lax.max and lax.min propagate NaN; a Python bound stays weakly typed (x's dtype).
        dtype = jnp.result_type(x)
        if low is not None:
            x = jnp.maximum(x, low if isinstance(low, (int, float)) else low.astype(dtype))
        if high is not None:
            x = jnp.minimum(x, high if isinstance(high, (int, float)) else high.astype(dtype))
        return x

    def true_divide(self, x: Any, number: float, *, temporary: bool = False) -> Any:
        if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            x = jnp.asarray(x).astype(jnp.float32)
        return self.divide_by_number(x, number)

    def amax_along(self, x: Any, axis: Any) -> Any:
        return jnp.max(x, axis=axis, keepdims=True)

    def amin_along(self, x: Any, axis: Any) -> Any:
        return jnp.min(x, axis=axis, keepdims=True)

    def sum_along(self, x: Any, axis: Any) -> Any:
        return jnp.sum(x, axis=axis, keepdims=True)

    def all_true(self, x: Any) -> Any:
        return jnp.all(x)

    def number_true(self, x: Any) -> int:
        return int(jnp.count_nonzero(x))

    def argmax(self, x: Any, dim: int) -> Any:
        return jnp.argmax(x, axis=dim, keepdims=True)

    def positions(self, x: Any, dim: int) -> Any:
        rank = jnp.ndim(x)
        d = dim % rank
        return jnp.arange(jnp.shape(x)[d]).reshape([-1] + [1] * (rank - d - 1))

    def softmax(self, x: Any, dim: int) -> Any:
        return jax.nn.softmax(x, axis=dim)

    def integer_array(self, value: Any) -> Any:
        # int64 with jax_enable_x64, else int32 (asked for int64, JAX would warn)
        return jnp.asarray(value, dtype=jax.dtypes.canonicalize_dtype(jnp.int64))

    def concrete(self, x: Any) -> bool:
        return not isinstance(x, jax.core.Tracer)

    def runtime_assert(self, condition: Any, message: str, x: Any) -> Any:
        """None: a traced JAX function has no assertion that stops it (`checkify` makes the
        caller unpack an error value), so the caller refuses instead."""
        return None

    def identity_with_gradient(self, x: Any, backward: Callable[..., Any], *operands: Any
                               ) -> Any:
        """A `jax.custom_vjp` (not `jax.custom_gradient`, which traces its gradient function
        to a jaxpr when the forward runs: its backward would never see concrete values);
        the operands pass as arguments, so a traced one is a residual under `jax.jit` and
        `jax.vmap`, and get zero cotangents."""

        @jax.custom_vjp
        def identity(x: Any, operands: tuple[Any, ...]) -> Any:
            return x

        def forward(x: Any, operands: tuple[Any, ...]) -> tuple[Any, Any]:
            return x, operands

        def gradient(operands: tuple[Any, ...], dy: Any) -> tuple[Any, Any]:
            zeros = tuple(jnp.zeros_like(o) for o in operands)
            return backward(dy, *operands), zeros

        identity.defvjp(forward, gradient)
        return identity(jnp.asarray(x), tuple(jnp.asarray(o) for o in operands))

    def loss_scale(self, scaler: Any, dtype: Any, recipe: str) -> Any:
        msg = (
            f"{recipe}(scaler=...) got a {type(scaler).__name__}, and this gradient is a JAX "
            "array: the scaler scales torch or Keras-on-TensorFlow losses, whose scale a "
            "traced JAX function cannot follow. Unscale the JAX gradients before the "
            "recipe sees them (divide the loss scale out, as `jmp`'s `loss_scale.unscale` "
            "does) and give no scaler."
        )
        raise GradOverrideError(msg)


#: The one JAX backend.
OPS = JaxBackend()


# ---- module helpers --------------------------------------------------------------------------


def _torch_result_dtype(a: Any, c: Any) -> Any:
    """The dtype of `a / c` in torch for floating arrays: a 0-d operand does not promote a
    dimensioned one (a float16 x divided by a 0-d float32 step is float16, where JAX gives
    float32); otherwise the dtypes promote, two different 16-bit types to float32."""
    a_dtype, c_dtype = jnp.dtype(jnp.result_type(a)), jnp.dtype(jnp.result_type(c))
    if (jnp.ndim(a) == 0) != (jnp.ndim(c) == 0):
        return a_dtype if jnp.ndim(c) == 0 else c_dtype
    if a_dtype == c_dtype:
        return a_dtype
    if a_dtype.itemsize == c_dtype.itemsize:
        return jnp.dtype(jnp.float32)
    return a_dtype if a_dtype.itemsize > c_dtype.itemsize else c_dtype


def _exact_divide(x: Any, divisor: Any) -> Any:
    """x / divisor, correctly rounded where the divisor is broadcast (see
    `JaxBackend.divide_by_number`): the divisor taken through a select on `x == x or
    x != x`, at the broadcast shape, which XLA does not fold."""
    always = (x == x) | (x != x)
    return x / jnp.where(always, divisor, jnp.ones((), jnp.result_type(divisor)))
