"""`spike`'s formulas, written once over a backend `b`: the surrogate derivatives (the
backward), the step (the forward), and the smooth steps that are the probabilities of a
sampled spike.

Each derivative takes the upstream gradient g, the centred input x and the recipe r, and
returns g * scale * sg(x) in as few passes over memory as the formula allows, with no
intermediate that can overflow into NaN. The compositions `b.times`, `b.plus`, `b.square`,
`b.power`, `b.apply`, `b.minus`, `b.clamp_min`, `b.divide` (its divisor) and `b.blend` (its
mask) may reuse their first array for the result (torch, outside autograd's recording), so a
formula passes them only temporaries it made itself, never g, x or the noise. The torch recipe
blends with 0/1 factors (`b.indicator`, `b.blend`) where a `torch.where` would be slow on the
CPU; on the other frameworks the blend gives the same values.

The probabilities take the centred input in the compute dtype and may receive a torch tensor
alpha (a learned width, through `spike.proxy`): they use operators and `b` only, never
`math` on alpha.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..._ops._protocol import Backend
    from .._surrogate import spike

__all__ = ["DERIVATIVES", "PROBABILITIES", "leaky_relu", "sample", "step"]

_SQRT_PI = math.sqrt(math.pi)


def _set(value: Any) -> float:
    """A surrogate parameter `spike` has resolved (None only for the surrogates that do not
    take it)."""
    assert value is not None
    result: float = value
    return result


# ---- the derivatives ----------------------------------------------------------------------


def arctan(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s * (a/2) / (1 + (pi*a*x/2)^2) = g / (k0 + k1 * x^2)
    a, s = _set(r.alpha), r.scale
    k = s * a / 2
    c = math.pi * a / 2
    return b.divide(g, b.addcmul(1 / k, x, x, c * c / k))


def sigmoid(b: Backend, g: Any, x: Any, r: spike) -> Any:
    a = _set(r.alpha)
    return b.sigmoid_product(g, x, a, r.scale * a)


def fast_sigmoid(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s * (a/2) / (1 + a|x|)^2 = g / d^2 with d = k (1 + a|x|), k = sqrt(2 / (s a))
    a, s = _set(r.alpha), r.scale
    k = math.sqrt(2 / (s * a))
    d = b.plus(b.times(b.abs(x), a * k), k)
    return b.divide(g, b.square(d))


def erf(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s * a / sqrt(pi) * exp(-(a x)^2) = exp(log(s a / sqrt(pi)) - a^2 x^2)
    a, s = _set(r.alpha), r.scale
    log_k = math.log(s * a / _SQRT_PI)
    return b.times(b.apply(b.addcmul(log_k, x, x, -a * a), "exp"), g)


def triangle(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s * max(0, a - a^2 |x|)
    a, s = _set(r.alpha), r.scale
    k = s * a
    return b.times(b.apply(b.minus(k, b.abs(x), k * a), "relu"), g)


def rectangular(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s * a where |x| < 1/(2a), else s * leak (strict). A NaN input is outside, as
    # SpikingJelly's `alpha * (x.abs() < 0.5 / alpha) * grad` has it, eager and compiled
    # alike (torch's fused `hardtanh_backward` of the clip windows would pass it).
    a, s, leak = _set(r.alpha), r.scale, _set(r.leak)
    h = 0.5 / a
    k = s * a
    if leak != 0:
        inside = b.indicator("lt", b.abs(x), h)
        return b.times(b.blend(inside, k, s * leak), g)
    out = b.select(b.abs(x) < h, g, 0)
    return out if k == 1 else b.times(out, k)


def piecewise_exp(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s * (a/2) * exp(-a|x|) = exp(log(s a / 2) - a|x|)
    a, s = _set(r.alpha), r.scale
    log_k = math.log(s * a / 2)
    return b.times(b.apply(b.minus(log_k, b.abs(x), a), "exp"), g)


def straight(b: Backend, g: Any, x: Any, r: spike) -> Any:
    s = r.scale
    return g if s == 1 else g * s


def circ(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s (a/2) (1 + (a x)^2)^(-3/2) = g * rsqrt(d)^3 with d = c (1 + a^2 x^2) and
    # c = (s a / 2)^(-2/3). The root comes first: d may overflow to inf (giving 0), its cube
    # is never formed (in float16 it would overflow from |a x| = 40 on).
    a, s = _set(r.alpha), r.scale
    # c as exp(log): dynamo's guard on a float ** float of the recipe's numbers fails
    c = math.exp(math.log(s * a / 2) * (-2 / 3))
    d = b.addcmul(c, x, x, c * a * a)
    return b.times(b.power(b.apply(d, "rsqrt"), 3), g)


def q_pseudo_spike(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s (1 + 2|x| / (a - 1))^(-a) = g * d^(-a), d = k + k c |x|, c = 2/(a-1), k = s^(-1/a)
    a, s = _set(r.alpha), r.scale
    k = math.exp(-math.log(s) / a)  # s ** (-1/a), written so that dynamo's guard holds
    d = b.minus(k, b.abs(x), -k * 2 / (a - 1))
    return b.times(b.power(d, -a), g)


def s2nn(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # x < 0: s a sigmoid(a x) sigmoid(-a x), the sigmoid surrogate; x >= 0: s b / (1 + x),
    # written with |x| so that the side not taken is finite too (no inf at x = -1, which the
    # 0/1 blend, or a second derivative, would turn into NaN)
    a, s, beta = _set(r.alpha), r.scale, _set(r.beta)
    negative = b.indicator("lt", x, 0.0)
    left = b.sigmoid_product(g, x, a, s * a)
    if beta == 0:
        return b.times(left, negative)
    right = b.divide(g, b.plus(b.abs(x), 1))
    if s * beta != 1:
        right = b.times(right, s * beta)
    return b.blend(negative, left, right)


def squarewave_fourier(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s (2a/pi) sum_{i=1..terms} cos((2i - 1) a x), the sum first, then the constant, then g
    # (SpikingJelly's order, so its preset rounds as it does). A float16/bfloat16 input is
    # computed in float32: a harmonic's argument would overflow float16 (|x| 1e4, a = 25) or
    # lose the phase in bfloat16's 8 bits.
    dtype = b.dtype(x)
    if b.is_half(dtype):
        wide = b.compute_dtype(dtype)
        result = squarewave_fourier(b, b.cast(g, wide), b.cast(x, wide), r)
        return b.cast(result, b.dtype(g))
    a, s, n = _set(r.alpha), r.scale, int(_set(r.terms))
    total = b.apply(x * a, "cos")
    for i in range(2, n + 1):
        total = b.plus(total, b.apply(x * ((2 * i - 1) * a), "cos"))
    return b.times(b.times(total, s * 2 * a / math.pi), g)


def nonzero_sign_log_abs(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s a / (1 + a|x|) = g / d, d = |x| / s + 1 / (s a)
    a, s = _set(r.alpha), r.scale
    d = b.abs(x)
    if s != 1:
        d = b.times(d, 1 / s)
    return b.divide(g, b.plus(d, 1 / (s * a)))


def fake_numerical_gradient(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s min(a, 1/|x|) = g / d, d = max(|x|, 1/a) / s: a at x = 0 and at x = -0 (where
    # sign(x)/x, as SpikingJelly writes it, is -inf)
    a, s = _set(r.alpha), r.scale
    d = b.clamp_min(b.abs(x), 1 / a)
    if s != 1:
        d = b.times(d, 1 / s)
    return b.divide(g, d)


def log_tailed_relu(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # s * (leak where x <= 0; 1 where 0 < x <= 1; 1/x where x > 1): 1/max(x, 1) on the right
    s, leak = r.scale, _set(r.leak)
    inverse = b.clamp(x, 1, None)
    if s != 1:
        inverse = b.times(inverse, 1 / s)
    right = b.times(b.apply(inverse, "reciprocal"), g)  # finite for every x but NaN
    positive = b.indicator("gt", x, 0.0)
    if leak == 0:
        return b.times(right, positive)
    return b.blend(positive, right, g * (s * leak))


def leaky_factor(b: Backend, x: Any, r: spike, silent: Any) -> Any:
    """scale * (1 where the step fires, `silent` where it does not), and at x == 0 with a
    fractional `at_zero` the blend at_zero * 1 + (1 - at_zero) * silent."""
    s, z = r.scale, r.at_zero
    fired = b.indicator("ge" if z == 1 else "gt", x, 0.0)
    off = s * silent if isinstance(silent, float) else b.times(silent, s)
    if isinstance(off, float) and off == 0:
        factor = fired if s == 1 else b.times(fired, s)
    else:
        factor = b.blend(fired, s, off)
    if 0 < z < 1:
        factor = b.select(x == 0, off * (1 - z) + z * s, factor)
    return factor


def leaky_relu(b: Backend, g: Any, x: Any, r: spike, noise: Any = None) -> Any:
    # s * (1 where the step fires; leak + spread (u - 1/2) where it does not, u ~ U[0, 1))
    leak, spread = _set(r.leak), _set(r.spread)
    silent: Any = leak
    if noise is not None and spread != 0:
        silent = b.affine(leak - spread / 2, noise, spread)
    return b.times(leaky_factor(b, x, r, silent), g)


def sparse_fast_sigmoid(b: Backend, g: Any, x: Any, r: spike) -> Any:
    # the fast sigmoid's where x > bound, else 0 (a product, so a NaN input stays NaN)
    return b.times(fast_sigmoid(b, g, x, r), b.indicator("gt", x, _set(r.bound)))


Derivative = Callable[["Backend", Any, Any, "spike"], Any]

#: The surrogate derivatives by canonical name (aliases resolve through the recipe's table).
DERIVATIVES: dict[str, Derivative] = {
    "arctan": arctan,
    "sigmoid": sigmoid,
    "fast_sigmoid": fast_sigmoid,
    "erf": erf,
    "triangle": triangle,
    "rectangular": rectangular,
    "piecewise_exp": piecewise_exp,
    "straight_through": straight,
    "circ": circ,
    "q_pseudo_spike": q_pseudo_spike,
    "s2nn": s2nn,
    "squarewave_fourier": squarewave_fourier,
    "nonzero_sign_log_abs": nonzero_sign_log_abs,
    "fake_numerical_gradient": fake_numerical_gradient,
    "log_tailed_relu": log_tailed_relu,
    "leaky_relu": leaky_relu,
    "sparse_fast_sigmoid": sparse_fast_sigmoid,
}


# ---- the forward: the step, and a sampled spike --------------------------------------------


def step(b: Backend, x: Any, at_zero: float) -> Any:
    """H(x) with H(0) = `at_zero`, in x's dtype."""
    if at_zero == 0:
        return b.indicator("gt", x, 0)
    if at_zero == 1:
        return b.indicator("ge", x, 0)
    dtype = b.dtype(x)
    return b.cast(b.select(x == 0, at_zero, b.cast(x > 0, dtype)), dtype)


def sample(b: Backend, u: Any, p: Any, dtype: Any) -> Any:
    """A spike (1, in `dtype`) where the uniform sample u is below the probability p."""
    return b.cast(b.indicator("lt", u, p), dtype)


# ---- the probabilities of a sampled spike: each surrogate's smooth step, finite everywhere --


def arctan_step(b: Backend, x: Any, r: spike) -> Any:
    a: Any = r.alpha
    return 0.5 + b.atan(x * (math.pi * a / 2)) / math.pi


def sigmoid_step(b: Backend, x: Any, r: spike) -> Any:
    return b.sigmoid(x * r.alpha)


def fast_sigmoid_step(b: Backend, x: Any, r: spike) -> Any:
    tail = 0.5 / (1 + r.alpha * b.abs(x))  # a x / (1 + a|x|) would be inf / inf at inf
    return b.where(x < 0, tail, 1 - tail)


def erf_step(b: Backend, x: Any, r: spike) -> Any:
    a: Any = r.alpha
    return 0.5 * b.erfc(-a * x)


def triangle_step(b: Backend, x: Any, r: spike) -> Any:
    a: Any = r.alpha
    inner = a * x - 0.5 * a * a * x * b.abs(x) + 0.5
    return b.select(x < -1 / a, 0.0, b.select(x > 1 / a, 1.0, inner))


def rectangular_step(b: Backend, x: Any, r: spike) -> Any:
    # The window is strict, as the derivative's |x| < 1/(2a): a clamp would count its ends
    # in (gradient a at x = ±1/(2a), where the derivative gives the leak).
    a: Any = r.alpha
    leak = _set(r.leak)
    h = 0.5 / a
    inside = b.abs(x) < h
    outside = b.where(x > 0, 1 + leak * (x - h), leak * (x + h))
    return b.where(inside, a * x + 0.5, outside)


def piecewise_exp_step(b: Backend, x: Any, r: spike) -> Any:
    # Each branch clamped to its side, so the derivative is a/2 at 0 (not |x|'s 0) and the
    # branch not taken never overflows.
    a: Any = r.alpha
    left = 0.5 * b.exp(a * b.clamp(x, None, 0))
    right = 1 - 0.5 * b.exp(-a * b.clamp(x, 0, None))
    return b.where(x < 0, left, right)


def straight_step(b: Backend, x: Any, r: spike) -> Any:
    return b.clamp(x, 0, 1)  # the input is the probability, as SpikingJelly's PoissonPass takes


def circ_step(b: Backend, x: Any, r: spike) -> Any:
    u = r.alpha * x  # u / sqrt(1 + u^2) written so that no u^2 overflows
    return 0.5 + 0.5 * b.sign(u) * b.rsqrt(1 + 1 / (u * u))


def q_pseudo_spike_step(b: Backend, x: Any, r: spike) -> Any:
    a: Any = r.alpha
    c = 2 / (a - 1)
    left = 0.5 * (1 - c * b.clamp(x, None, 0)) ** (1 - a)
    right = 1 - 0.5 * (1 + c * b.clamp(x, 0, None)) ** (1 - a)
    return b.where(x < 0, left, right)


Step = Callable[["Backend", Any, "spike"], Any]

#: The probability of a sampled spike (`sample=True`) by canonical name: the surrogate's
#: smooth step from 0 to 1 at the centred input (the input clipped to [0, 1] for
#: straight_through). The surrogates not listed have no such step.
PROBABILITIES: dict[str, Step] = {
    "arctan": arctan_step,
    "sigmoid": sigmoid_step,
    "fast_sigmoid": fast_sigmoid_step,
    "erf": erf_step,
    "triangle": triangle_step,
    "rectangular": rectangular_step,
    "piecewise_exp": piecewise_exp_step,
    "straight_through": straight_step,
    "circ": circ_step,
    "q_pseudo_spike": q_pseudo_spike_step,
}
