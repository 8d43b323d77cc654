"""The straight-through family's formulas, written once against a backend `b`: the rounding
and sign forwards, the window tests, ternarize's threshold and scale, quantize's scale,
zero point and codes, and LSQ's forward and gradients.

Each is a plain function of `b` and arrays (or Python numbers): the torch recipes call them
with `TORCH`, the TensorFlow and JAX recipes with their backends (see
`gradoverride.recipes._on_arrays._ste`), so every framework computes the torch recipe's
values. Settings are Python values read from the recipe.
"""

from __future__ import annotations

import math
from typing import Any

from ..._ops._protocol import Backend

__all__ = [
    "binary_sign",
    "codes",
    "codes_outside",
    "dequantize",
    "grad_scale",
    "lsq_forward",
    "lsq_gradients",
    "quotient",
    "scale_and_zero_point",
    "slope",
    "ternary",
    "window_inside",
    "window_outside",
]


# ---- signs -----------------------------------------------------------------------------------


def binary_sign(b: Backend, x: Any) -> Any:
    """-1 where x < 0, else +1 (0, -0 and NaN included), in x's dtype: sign(x) + 0.5 is
    -0.5, 0.5 or 1.5 (sign(NaN) is 0), so its sign is the binary sign."""
    return b.apply(b.plus(b.sign(x), 0.5), "sign")


def slope(b: Backend, x: Any, at_zero: float) -> Any:
    """abs_subgradient's s(x): sign(x), and `at_zero` at ±0, in x's dtype."""
    if at_zero == 1:
        return binary_sign(b, x)
    sign = b.sign(x)
    if at_zero == 0:
        return sign
    return sign + b.times_number(1 - b.abs(sign), at_zero)


# ---- windows ---------------------------------------------------------------------------------


def _ends(x: Any, low: Any, high: Any, inclusive: tuple[bool, bool]) -> tuple[Any, Any]:
    below = x >= low if inclusive[0] else x > low
    above = x <= high if inclusive[1] else x < high
    return below, above


def window_inside(b: Backend, x: Any, low: Any, high: Any, inclusive: tuple[bool, bool]
                  ) -> Any:
    """Where low <= x <= high (an end left out where `inclusive` says so), the bounds in x's
    dtype: False at NaN."""
    above_low, below_high = _ends(x, low, high, inclusive)
    return above_low & below_high


def window_outside(b: Backend, x: Any, low: Any, high: Any, inclusive: tuple[bool, bool]
                   ) -> Any:
    """Where x is below `low` or above `high` (each end in the window as `inclusive` says),
    the bounds numbers (rounded once to x's dtype, as torch compares a tensor with a number)
    or arrays (cast to x's dtype): False at NaN, whose gradient passes (as hardtanh's
    backward passes it)."""
    dtype = b.dtype(x)
    low = b.constant(low, dtype) if isinstance(low, (int, float)) else b.cast(low, dtype)
    high = b.constant(high, dtype) if isinstance(high, (int, float)) else b.cast(high, dtype)
    below = x < low if inclusive[0] else x <= low
    above = x > high if inclusive[1] else x >= high
    return below | above


# ---- ternarize -------------------------------------------------------------------------------


def ternary(b: Backend, x: Any, delta_factor: float, scaled: bool) -> Any:
    """TWN's forward: t = sign(x) where |x| > delta = delta_factor * mean(|x|), else 0;
    alpha * t with alpha = mean(|x_i|) over the kept i (0 when none) if `scaled`. The
    threshold and the scale are reductions: in float32 for float16/bfloat16 inputs, where a
    sum over many elements overflows or loses its low digits."""
    dtype = b.dtype(x)
    work = b.compute_dtype(dtype)
    magnitude = b.cast(b.abs(x), work)
    delta = b.mean(magnitude) * delta_factor
    keep = magnitude > delta
    kept = b.cast(keep, work)
    signs = b.cast(b.sign(x), work) * kept
    if not scaled:
        return b.cast(signs, dtype)
    count = b.clamp(b.count_true(keep, work), 1, None)
    alpha = b.sum(magnitude * kept) / count
    return b.cast(signs * alpha, dtype)


# ---- quantize --------------------------------------------------------------------------------


def scale_and_zero_point(b: Backend, x: Any, code_range: tuple[int, int], symmetric: bool,
                         bound: float | tuple[float, float] | None) -> tuple[Any, Any]:
    """quantize's scale s and zero point z for x (in the dtype of the codes): Python numbers
    for a given `bound`, else 0-d arrays from x's range (a range that includes 0)."""
    qmin, qmax = code_range
    if symmetric:
        if bound is not None:
            return float(bound) / qmax, 0.0  # type: ignore[arg-type]
        top = b.amax(b.abs(x))
        return b.divide_by_number(b.select(top > 0, top, 1), qmax), 0.0
    if bound is not None:
        low, high = bound  # type: ignore[misc]
        # Widened to include 0, which must be a code (as for PyTorch's observers and
        # fake_quantize); otherwise the zero point would be clamped and cut the range.
        low, high = min(low, 0.0), max(high, 0.0)
        s = (high - low) / qmax
        return s, float(min(max(round(-low / s), qmin), qmax))
    lo = b.clamp(b.amin(x), None, 0)
    hi = b.clamp(b.amax(x), 0, None)
    span = hi - lo
    s = b.divide_by_number(b.select(span > 0, span, 1), qmax)
    return s, b.clamp(b.round(-lo / s), qmin, qmax)


def codes(b: Backend, x: Any, code_range: tuple[int, int], symmetric: bool,
          bound: float | tuple[float, float] | None) -> tuple[Any, Any, Any]:
    """(q, s, z): the unclamped codes round(x / s) + z and the scale and zero point, in
    float32 for float16/bfloat16 inputs (which cannot hold every code: 65535 > float16's
    max), otherwise in x's dtype."""
    x = b.cast(x, b.compute_dtype(b.dtype(x)))
    s, z = scale_and_zero_point(b, x, code_range, symmetric, bound)
    return b.round(b.divide_by_number(x, s)) + z, s, z


def codes_outside(b: Backend, q: Any, code_range: tuple[int, int]) -> Any:
    """Where the code q is outside [qmin, qmax] (where quantize zeroes the gradient)."""
    qmin, qmax = code_range
    return (q < qmin) | (q > qmax)


def dequantize(b: Backend, q: Any, s: Any, z: Any, code_range: tuple[int, int], dtype: Any
               ) -> Any:
    """(clamp(q, qmin, qmax) - z) * s, in `dtype`."""
    qmin, qmax = code_range
    return b.cast((b.clamp(q, qmin, qmax) - z) * s, dtype)


# ---- LSQ -------------------------------------------------------------------------------------


def quotient(b: Backend, x: Any, step: Any) -> Any:
    """v = x / s with torch's type promotion (a 0-d step does not widen x)."""
    return b.div(x, step)


def lsq_forward(b: Backend, x: Any, step: Any, code_range: tuple[int, int]) -> Any:
    """round(clamp(x / s, -Qn, Qp)) * s, in x's dtype."""
    qn, qp = code_range
    return b.cast(b.mul(b.round(b.clamp(quotient(b, x, step), -qn, qp)), step), b.dtype(x))


def grad_scale(b: Backend, x: Any, code_range: tuple[int, int], given: float | None) -> Any:
    """LSQ's gradient scale g = 1/sqrt(N * Qp) (or `given`): a Python number from x's
    static size, in float64 arithmetic as in torch; a 0-d array from a dynamic size."""
    if given is not None:
        return given
    qp = code_range[1]
    shape = b.static_shape(x)
    if shape is not None and None not in shape:
        return 1.0 / math.sqrt(max(math.prod(shape), 1) * qp)  # type: ignore[arg-type]
    size = b.dynamic_size(x)
    return 1.0 / b.sqrt(b.maximum(size, b.constant(1, b.dtype(size))) * qp)


def lsq_gradients(b: Backend, grad: Any, x: Any, step: Any, code_range: tuple[int, int],
                  window: str, g: Any) -> tuple[Any, Any]:
    """(dL/dx, dL/ds) in the shape of the broadcast of x and s (the step's still to be
    summed to its shape): the upstream gradient where v = x / s is inside the code range,
    and Esser et al. (2020)'s eq. 3 times g: round(v) - v inside, -Qn below, Qp above."""
    qn, qp = code_range
    v = quotient(b, x, step)
    if window == "rounded":  # torch.ao's fake quantize: the rounded code decides
        code = b.round(v)
        below, above = code < -qn, code > qp
    elif window == "closed":
        below, above = v < -qn, v > qp
    else:
        below, above = v <= -qn, v >= qp
    inside = ~(below | above)
    grad_x = b.select(inside, grad, 0)
    ds = b.select(below, -qn, b.select(above, qp, b.round(v) - v))
    return grad_x, b.times_number(b.mul(grad, ds), g)
