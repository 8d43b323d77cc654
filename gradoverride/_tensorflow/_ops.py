"""TensorFlow's `Backend`: the primitives as TensorFlow ops, each of which runs eagerly,
under `tf.function` and under `jit_compile=True` (XLA): no Python branch on a tensor's value,
no numpy.

Where a TensorFlow op's edge behaviour is not torch's, torch's is written out here, once
(`sign(NaN)` is 0 where `tf.sign` gives NaN), so every formula computes what the torch
recipe computes.
"""

from __future__ import annotations

import importlib
import struct
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from .._errors import GradOverrideError
from .._frameworks import autograph_artifact
from .._ops._protocol import Backend
from ._tracing import in_vectorized_map, refuse_vectorized_map

# TensorFlow has no type stubs: its values are typed `Any` throughout.
tf: Any = importlib.import_module("tensorflow")

__all__ = ["OPS", "TensorFlowBackend"]

_HALF = (tf.float16, tf.bfloat16)


@autograph_artifact
class TensorFlowBackend(Backend):
    name = "TensorFlow"

    # ---- values -------------------------------------------------------------------------

    def asarray(self, x: Any) -> Any:
        """A variable read (outside any `tf.custom_gradient` function, so the variable
        still gets its gradient through the read); `IndexedSlices` (the gradient of a
        `tf.gather`) made dense."""
        return x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x)

    def dtype_kind(self, x: Any) -> str:
        dtype = tf.as_dtype(x.dtype)
        return "floating" if dtype.is_floating else "complex" if dtype.is_complex else "other"

    def dtype_name(self, x: Any) -> str:
        return str(tf.as_dtype(x.dtype).name)

    def cast_hint(self, argument: str) -> str:
        return f"tf.cast({argument}, tf.float32)"

    def check_call(self, recipe: object) -> None:
        if in_vectorized_map():
            refuse_vectorized_map(f"`{recipe!r}`")

    def cast(self, x: Any, dtype: Any) -> Any:
        return tf.cast(x, dtype)

    def constant(self, value: float, dtype: Any) -> Any:
        return tf.constant(value, dtype)

    def zeros_like(self, x: Any) -> Any:
        return tf.zeros_like(x)

    def is_half(self, dtype: Any) -> bool:
        return dtype in _HALF

    def compute_dtype(self, dtype: Any) -> Any:
        return tf.float32 if dtype in _HALF else dtype

    # ---- elementwise --------------------------------------------------------------------

    def abs(self, x: Any) -> Any:
        return tf.abs(x)

    def exp(self, x: Any) -> Any:
        return tf.exp(x)

    def sigmoid(self, x: Any) -> Any:
        return tf.sigmoid(x)

    def relu(self, x: Any) -> Any:
        return tf.nn.relu(x)

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        return tf.where(condition, x, y)

    def maximum(self, x: Any, y: Any) -> Any:
        return tf.maximum(x, y)

    def minimum(self, x: Any, y: Any) -> Any:
        return tf.minimum(x, y)

    # ---- reductions and shapes ----------------------------------------------------------

    def sum_to_shape(self, grad: Any, like: Any) -> Any:
        _, axes = tf.raw_ops.BroadcastGradientArgs(s0=tf.shape(grad), s1=tf.shape(like))
        return tf.reshape(tf.reduce_sum(grad, axis=axes), tf.shape(like))

    # ---- the custom gradient ------------------------------------------------------------

    def custom_gradient(self, fn: Callable[..., tuple[Any, Callable[..., Any]]]
                        ) -> Callable[..., Any]:
        """`tf.custom_gradient`; the recipe's settings are Python values closed over by
        `fn`, never its arguments (under `tf.function` an argument becomes a tensor that
        needs a gradient slot)."""
        decorated: Callable[..., Any] = tf.custom_gradient(autograph_artifact(fn))
        return decorated


    # ---- more elementwise ops, random draws, shapes ------------------------------------------

    global_random = True

    def atan(self, x: Any) -> Any:
        return tf.atan(x)

    def erfc(self, x: Any) -> Any:
        return tf.math.erfc(x)

    def cos(self, x: Any) -> Any:
        return tf.cos(x)

    def rsqrt(self, x: Any) -> Any:
        return tf.math.rsqrt(x)

    def reciprocal(self, x: Any) -> Any:
        return tf.math.reciprocal(x)

    def sign(self, x: Any) -> Any:
        return tf.where(tf.math.is_nan(x), tf.zeros_like(x), tf.sign(x))  # tf.sign(NaN): NaN

    def uniform(self, like: Any, dtype: Any) -> Any:
        return tf.random.uniform(tf.shape(like), dtype=dtype)

    def uniform_hint(self, argument: str) -> str:
        return f"tf.random.uniform(tf.shape({argument}))"

    def static_shape(self, x: Any) -> tuple[int | None, ...] | None:
        return None if x.shape.rank is None else tuple(x.shape.as_list())

    # ---- rounding, whole-array reductions, torch's dtype rules -------------------------------

    def round(self, x: Any) -> Any:
        return tf.round(x)  # halves to even, as torch.round

    def floor(self, x: Any) -> Any:
        return tf.floor(x)

    def ceil(self, x: Any) -> Any:
        return tf.math.ceil(x)

    def sqrt(self, x: Any) -> Any:
        return tf.sqrt(x)

    def amax(self, x: Any) -> Any:
        return tf.reduce_max(x)

    def amin(self, x: Any) -> Any:
        return tf.reduce_min(x)

    def sum(self, x: Any) -> Any:
        return tf.reduce_sum(x)

    def mean(self, x: Any) -> Any:
        return tf.reduce_mean(x)

    def count_true(self, mask: Any, dtype: Any) -> Any:
        return tf.cast(tf.math.count_nonzero(mask, dtype=tf.int64), dtype)

    def dynamic_size(self, x: Any) -> Any:
        return tf.cast(tf.size(x, out_type=tf.int64), tf.float64)

    def divide_by_number(self, x: Any, number: Any) -> Any:
        """A division by a tensor is left as a division (TensorFlow's, XLA's and TFLite's
        float32 division kernels are correctly rounded). A Python number is rounded to
        float32 and made a divisor none of Grappler, XLA and the TFLite converter can fold:
        the number where a test on x's first element that always holds holds (`v >= 0 or
        v < 0 or v is NaN`), else 1 (only for an empty x, which has nothing to divide).
        Checked against torch on 5.9 million values (random bit patterns and near-ties of
        quantize codes, 52 divisors) eagerly, under `tf.function`, XLA and TFLite, with no
        difference where x and the quotient are normal numbers (TensorFlow's CPU kernels
        flush subnormals to zero in places). A float64 quotient would avoid the rewrite
        but does not convert to TFLite's builtin ops, and an exact float32 emulation from
        multiplications costs 12 times as much; this costs a slice, three comparisons and
        a select of a scalar. A float64 `x` is divided as it is (where the reciprocal
        rewrite remains)."""
        if tf.is_tensor(number):
            return x / number
        if x.dtype == tf.float64:
            return x / number
        if x.dtype in _HALF:
            return tf.cast(self.divide_by_number(tf.cast(x, tf.float32), number), x.dtype)
        divisor = struct.unpack("f", struct.pack("f", number))[0]  # rounded to float32
        if 0 < abs(divisor) < 2.0**-126:
            # A subnormal divisor would be flushed to 0: both scaled by 2^64 (x * 2^64 is
            # exact, or infinite where the quotient is too).
            x, divisor = x * 2.0**64, divisor * 2.0**64
        first = tf.reshape(x, [-1])[:1]
        always = tf.reduce_any((first >= 0) | (first < 0) | tf.math.is_nan(first))
        return x / tf.where(always, tf.constant(divisor, x.dtype), tf.ones((), x.dtype))

    def times_number(self, x: Any, number: Any) -> Any:
        """In float32 for float16/bfloat16 (TensorFlow would round the number to the half
        type first); a tensor number is cast to that dtype."""
        compute = self.compute_dtype(x.dtype)
        factor = tf.cast(number, compute) if tf.is_tensor(number) else number
        return tf.cast(tf.cast(x, compute) * factor, x.dtype)

    def div(self, a: Any, c: Any) -> Any:
        return self._torch_arithmetic(a, c, tf.math.truediv)

    def mul(self, a: Any, c: Any) -> Any:
        return self._torch_arithmetic(a, c, tf.multiply)

    def _torch_arithmetic(self, a: Any, c: Any, op: Callable[[Any, Any], Any]) -> Any:
        """op(a, c) in torch's result dtype (TensorFlow does not promote: both operands are
        cast to it), computed in float32 for float16/bfloat16 and rounded once."""
        result = _torch_result_dtype(a, c)
        compute = self.compute_dtype(result)
        return tf.cast(op(tf.cast(a, compute), tf.cast(c, compute)), result)

    # ---- limits, reductions along an axis, checks, the identity with a gradient --------------

    def finfo(self, dtype: Any) -> Any:
        info = np.finfo(tf.as_dtype(dtype).as_numpy_dtype)
        # Python floats: a numpy scalar of a half dtype would round what it is compared with.
        return SimpleNamespace(max=float(info.max), min=float(info.min),
                               tiny=float(info.tiny), eps=float(info.eps))


    def size(self, x: Any) -> int:
        return int(tf.size(x))

    def log(self, x: Any) -> Any:
        return tf.math.log(x)


    def isnan(self, x: Any) -> Any:
        return tf.math.is_nan(x)

    def isinf(self, x: Any) -> Any:
        return tf.math.is_inf(x)

    def isfinite(self, x: Any) -> Any:
        return tf.math.is_finite(x)

    def ones_like(self, x: Any, dtype: Any) -> Any:
        return tf.ones_like(x, dtype=dtype)

    def clamp(self, x: Any, low: Any, high: Any) -> Any:
        if low is not None:
            x = tf.maximum(x, _in_dtype(low, x.dtype))
        if high is not None:
            x = tf.minimum(x, _in_dtype(high, x.dtype))
        return x

    def true_divide(self, x: Any, number: float, *, temporary: bool = False) -> Any:
        dtype = tf.as_dtype(x.dtype)
        if not (dtype.is_floating or dtype.is_complex):
            x = tf.cast(x, tf.float32)
        return self.divide_by_number(x, number)

    def amax_along(self, x: Any, axis: Any) -> Any:
        return tf.reduce_max(x, axis=axis, keepdims=True)

    def amin_along(self, x: Any, axis: Any) -> Any:
        return tf.reduce_min(x, axis=axis, keepdims=True)

    def sum_along(self, x: Any, axis: Any) -> Any:
        return tf.reduce_sum(x, axis=axis, keepdims=True)

    def all_true(self, x: Any) -> Any:
        return tf.reduce_all(x)

    def number_true(self, x: Any) -> int:
        return int(tf.reduce_sum(tf.cast(x, tf.int64)))

    def argmax(self, x: Any, dim: int) -> Any:
        return tf.expand_dims(tf.argmax(x, axis=dim), dim)

    def positions(self, x: Any, dim: int) -> Any:
        rank = x.shape.rank
        if rank is None:  # rank unknown while tracing: count along dim
            return tf.cumsum(tf.ones_like(x, tf.int64), axis=dim) - 1
        d = dim % rank
        n = tf.shape(x, out_type=tf.int64)[d]
        return tf.reshape(tf.range(n), [-1] + [1] * (rank - d - 1))

    def softmax(self, x: Any, dim: int) -> Any:
        return tf.nn.softmax(x, axis=dim)

    def integer_array(self, value: Any) -> Any:
        return tf.cast(self.asarray(value), tf.int64)

    def concrete(self, x: Any) -> bool:
        return bool(tf.executing_eagerly())

    def runtime_assert(self, condition: Any, message: str, x: Any) -> Any:
        if in_xla():
            return None  # XLA compiles tf.debugging.Assert (and check_numerics) to nothing
        check = tf.debugging.Assert(condition, [message])
        with tf.control_dependencies([check]):
            return tf.identity(x)

    def identity_with_gradient(self, x: Any, backward: Callable[..., Any], *operands: Any
                               ) -> Any:
        """`tf.custom_gradient` over the identity; the operands are closed over (captured
        tensors get no gradient slot)."""

        def identity(x: Any) -> Any:
            def gradient(dy: Any) -> Any:
                return backward(self.asarray(dy), *operands)

            return tf.identity(x), autograph_artifact(gradient)

        return self.custom_gradient(identity)(self.asarray(x))

    def loss_scale(self, scaler: Any, dtype: Any, recipe: str) -> Any:
        """The scale of a Keras `LossScaleOptimizer`, as its `scale_loss` applies it: its
        `dynamic_scale` variable, read in the graph (so a traced or XLA-compiled step
        follows the scale as it changes) in `dtype`; before the optimizer is built, its
        `initial_scale`, a number."""
        keras = sys.modules["keras"]  # imported: the optimizer is a Keras object
        if keras.config.backend() != "tensorflow":
            msg = (
                f"{recipe}(scaler=...) got a Keras {type(scaler).__name__} whose scale lives "
                f"in Keras' {keras.config.backend()!r} backend, and this gradient is "
                "TensorFlow's: a traced TensorFlow function could not follow it. Run Keras on "
                "TensorFlow (KERAS_BACKEND=tensorflow, set before importing keras) to clip "
                "TensorFlow gradients under its loss scaling."
            )
            raise GradOverrideError(msg)
        if not scaler.built:
            return float(scaler.initial_scale)
        return tf.cast(tf.convert_to_tensor(scaler.dynamic_scale), dtype)


#: The one TensorFlow backend.
OPS = TensorFlowBackend()


# ---- module helpers --------------------------------------------------------------------------


def _torch_result_dtype(a: Any, c: Any) -> Any:
    """The dtype of `a / c` in torch for floating tensors: a 0-d operand does not promote a
    dimensioned one (a float16 x divided by a 0-d float32 step is float16); otherwise the
    dtypes promote, two different 16-bit types to float32."""
    a_rank, c_rank = a.shape.rank, c.shape.rank
    if a_rank is not None and c_rank is not None and (a_rank == 0) != (c_rank == 0):
        return a.dtype if c_rank == 0 else c.dtype
    if a.dtype == c.dtype:
        return a.dtype
    if a.dtype.size == c.dtype.size:
        return tf.float32
    return a.dtype if a.dtype.size > c.dtype.size else c.dtype


def _in_dtype(bound: Any, dtype: Any) -> Any:
    """A bound in `dtype`: a Python number converted to it directly (rounded once, as torch
    rounds it), a tensor cast."""
    if isinstance(bound, (int, float)):
        return tf.constant(bound, dtype)
    return tf.cast(bound, dtype)


def in_xla() -> bool:
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
