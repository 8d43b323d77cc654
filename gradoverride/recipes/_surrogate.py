"""Surrogate gradients for spiking networks: a Heaviside step whose backward is a smooth
surrogate's derivative.

One convention for the whole catalogue, so that names mean one formula:

* the forward is the step H(x): 1 where x > 0, 0 where x < 0, and `at_zero` at x == 0
  (default 0: a neuron spikes when its input *exceeds* the threshold, as in snnTorch and
  norse; SpikingJelly uses 1). Subtract the threshold first: `spike(v - v_th)`. The output
  has the input's dtype;
* the backward is `scale * sg(x)`, where sg is the derivative of a smooth step from 0 to 1
  (so it integrates to 1) whose sharpness is `alpha`. Each default alpha puts the peak at
  sg(0) = 1: right at the threshold the gradient passes unchanged, as a straight-through
  estimator's does;
* where the formula is finite, so is the gradient (no `exp` overflow turning into NaN at
  large |x|, in float16 as in float32).

The libraries' conventions, with their own parameter names and defaults, are presets:
`spike.preset("snntorch.fast_sigmoid", slope=25)` returns the `spike` whose forward and
gradients equal snnTorch's (see `SPIKE_PRESETS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from .._decorators import custom_backward
from .._errors import GradOverrideError, GradOverrideTypeError
from .._frameworks import is_tensorflow
from .._internals import transforms_active
from ._base import Recipe, positive_number, tensorflow_call

__all__ = ["SPIKE_PRESETS", "SURROGATES", "spike"]

_SQRT_PI = math.sqrt(math.pi)


# ---- the surrogates: derivative (fast backward) and proxy (its smooth step) -------------------
#
# Each derivative takes the upstream gradient and returns upstream * scale * sg(x) in as few
# passes over memory as the formula allows, out of place (so a rule stays differentiable
# again), with no intermediate that can overflow into NaN.


def _in_place() -> bool:
    """Whether a backward may reuse its own temporaries: not while compiling (functionalized
    anyway), not under a `torch.func` transform (an unbatched temporary cannot take a
    batched gradient in place), not while recording a graph for a second derivative."""
    if torch.compiler.is_compiling():
        return False
    return not torch.is_grad_enabled() and not transforms_active()


def _times(t: Tensor, g: Tensor | float) -> Tensor:
    """t * g, in place on the temporary t when that is safe."""
    return t.mul_(g) if _in_place() else t * g


def _arctan(g: Tensor, x: Tensor, a: float, s: float) -> Tensor:
    # s * (a/2) / (1 + (pi*a*x/2)^2) = g / (k0 + k1 * x^2)
    k = s * a / 2
    c = math.pi * a / 2
    return g / torch.addcmul(x.new_full((), 1 / k), x, x, value=c * c / k)


def _sigmoid(g: Tensor, x: Tensor, a: float, s: float) -> Tensor:
    # s * a * sigmoid(a x) * (1 - sigmoid(a x)), written sigmoid(a x) * sigmoid(-a x): the
    # same value without the cancellation of t - t^2 near t = 1 (bfloat16 gave 0 for x > 1.4).
    ax = x * a
    return _times(_times(torch.sigmoid(ax) * torch.sigmoid(-ax), g), s * a)


def _fast_sigmoid(g: Tensor, x: Tensor, a: float, s: float) -> Tensor:
    # s * (a/2) / (1 + a|x|)^2 = g / d^2 with d = k (1 + a|x|), k = sqrt(2 / (s a))
    k = math.sqrt(2 / (s * a))
    d = torch.abs(x).mul_(a * k).add_(k)
    return g / (d * d)


def _erf(g: Tensor, x: Tensor, a: float, s: float) -> Tensor:
    # s * a / sqrt(pi) * exp(-(a x)^2) = exp(log(s a / sqrt(pi)) - a^2 x^2)
    log_k = math.log(s * a / _SQRT_PI)
    return _times(torch.exp(torch.addcmul(x.new_full((), log_k), x, x, value=-a * a)), g)


def _triangle(g: Tensor, x: Tensor, a: float, s: float) -> Tensor:
    # s * max(0, a - a^2 |x|)
    k = s * a
    return _times(torch.relu(torch.sub(x.new_full((), k), torch.abs(x), alpha=k * a)), g)


def _rectangular(g: Tensor, x: Tensor, a: float, s: float) -> Tensor:
    # s * a where |x| < 1/(2a), else 0 (strict): one fused kernel, as for clip windows
    h = 0.5 / a
    if g.dtype == x.dtype and not torch.compiler.is_compiling():
        out = torch.ops.aten.hardtanh_backward(g, x, -h, h)
    else:
        out = torch.where(x.abs() < h, g, 0)
    k = s * a
    return out if k == 1 else _times(out, k)


def _piecewise_exp(g: Tensor, x: Tensor, a: float, s: float) -> Tensor:
    # s * (a/2) * exp(-a|x|) = exp(log(s a / 2) - a|x|)
    log_k = math.log(s * a / 2)
    return _times(torch.exp(torch.sub(x.new_full((), log_k), torch.abs(x), alpha=a)), g)


def _straight(g: Tensor, x: Tensor, a: float, s: float) -> Tensor:
    return g if s == 1 else g * s


def _proxy_arctan(x: Tensor, a: float) -> Tensor:
    return 0.5 + torch.atan(x * (math.pi * a / 2)) / math.pi


def _proxy_sigmoid(x: Tensor, a: float) -> Tensor:
    return torch.sigmoid(x * a)


def _proxy_fast_sigmoid(x: Tensor, a: float) -> Tensor:
    return 0.5 + 0.5 * (a * x) / (1 + a * x.abs())


def _proxy_erf(x: Tensor, a: float) -> Tensor:
    return 0.5 + 0.5 * torch.erf(a * x)


def _proxy_triangle(x: Tensor, a: float) -> Tensor:
    inner = a * x - 0.5 * a * a * x * x.abs() + 0.5
    return torch.where(x < -1 / a, 0.0, torch.where(x > 1 / a, 1.0, inner))


def _proxy_rectangular(x: Tensor, a: float) -> Tensor:
    return torch.clamp(a * x + 0.5, 0, 1)


def _proxy_piecewise_exp(x: Tensor, a: float) -> Tensor:
    # Each branch clamped to its side, so autograd gives a/2 at 0 (not |x|'s 0) and the
    # branch not taken never overflows.
    left = 0.5 * torch.exp(a * x.clamp(max=0))
    right = 1 - 0.5 * torch.exp(-a * x.clamp(min=0))
    return torch.where(x < 0, left, right)


def _proxy_straight(x: Tensor, a: float) -> Tensor:
    return x


_Derivative = Callable[[Tensor, Tensor, float, float], Tensor]
_Proxy = Callable[[Tensor, float], Tensor]

# name -> (derivative, proxy, default alpha (peak 1), formula of sg at scale 1)
_SHAPES: dict[str, tuple[_Derivative, _Proxy, float, str]] = {
    "arctan": (_arctan, _proxy_arctan, 2.0, "(a/2) / (1 + (pi a x / 2)^2)"),
    "sigmoid": (_sigmoid, _proxy_sigmoid, 4.0, "a sigmoid(a x) (1 - sigmoid(a x))"),
    "fast_sigmoid": (_fast_sigmoid, _proxy_fast_sigmoid, 2.0, "(a/2) / (1 + a|x|)^2"),
    "erf": (_erf, _proxy_erf, _SQRT_PI, "(a / sqrt(pi)) exp(-(a x)^2)"),
    "triangle": (_triangle, _proxy_triangle, 1.0, "max(0, a - a^2 |x|)"),
    "rectangular": (_rectangular, _proxy_rectangular, 1.0, "a if |x| < 1/(2a) else 0"),
    "piecewise_exp": (_piecewise_exp, _proxy_piecewise_exp, 2.0, "(a/2) exp(-a|x|)"),
    "straight_through": (_straight, _proxy_straight, 1.0, "1"),
}

#: Other names for the same formula: SuperSpike's surrogate (Zenke & Ganguli, 2018) is the
#: fast sigmoid's derivative, and so is SpikingJelly's soft sign; the piecewise quadratic
#: step's derivative is the triangle.
_ALIASES = {
    "super_spike": "fast_sigmoid",
    "soft_sign": "fast_sigmoid",
    "piecewise_quadratic": "triangle",
}

#: Every surrogate `spike` accepts, aliases included.
SURROGATES: tuple[str, ...] = (
    "arctan",
    "sigmoid",
    "fast_sigmoid",
    "super_spike",
    "soft_sign",
    "erf",
    "triangle",
    "piecewise_quadratic",
    "rectangular",
    "piecewise_exp",
    "straight_through",
)


@custom_backward
def _spike(x: Tensor, recipe: spike) -> Tensor:
    return recipe.step(x)


@_spike.backward
def _(grad: Tensor, *, x: Tensor, recipe: spike) -> Tensor:
    derivative = _SHAPES[_canonical(recipe.surrogate)][0]
    return derivative(grad, x, recipe.alpha, recipe.scale)  # type: ignore[arg-type]


def _canonical(surrogate: str) -> str:
    return _ALIASES.get(surrogate, surrogate)


@dataclass(frozen=True, repr=False)
class spike(Recipe):
    """A Heaviside spike whose backward is a surrogate gradient.

    Forward: H(x) = 1 where x > 0, 0 where x < 0, `at_zero` where x == 0, in x's dtype.
    Backward: dL/dx = dL/dy * scale * sg(x), with sg (a = `alpha`; default alpha gives
    sg(0) = 1; every sg integrates to 1, except straight-through):

    ===================  ==================================  =======  ========================
    surrogate            sg(x)                               alpha    matches
    ===================  ==================================  =======  ========================
    arctan (default)     (a/2) / (1 + (pi a x / 2)^2)        2        Fang et al. 2021
    sigmoid              a sigmoid(a x) (1 - sigmoid(a x))   4        SpikingJelly Sigmoid
    fast_sigmoid         (a/2) / (1 + a|x|)^2                2        SpikingJelly SoftSign
    super_spike          the fast sigmoid's                  2        Zenke & Ganguli 2018
    soft_sign            the fast sigmoid's                  2        SpikingJelly SoftSign
    erf                  (a / sqrt(pi)) exp(-(a x)^2)        sqrt(pi) SpikingJelly Erf
    triangle             max(0, a - a^2 |x|)                 1        Esser et al. 2016
    piecewise_quadratic  the triangle's                      1        SpikingJelly
    rectangular          a where |x| < 1/(2a), else 0        1        SpikingJelly Rect
    piecewise_exp        (a/2) exp(-a|x|)                    2        SpikingJelly PiecewiseExp
    straight_through     1                                   (unused) snnTorch STE
    ===================  ==================================  =======  ========================

    `spike.preset(name, **params)` gives each library's convention (see `SPIKE_PRESETS`).
    `recipe.proxy(x)` is the smooth step whose derivative (times `scale`) is the
    surrogate. Example::

        spk = go.recipes.spike()                      # arctan, alpha=2, H(0) = 0
        out = spk(v - 1.0)                            # spikes where v > 1
    """

    surrogate: str = "arctan"
    alpha: float | None = None
    scale: float = 1.0
    at_zero: float = 0.0

    def __post_init__(self) -> None:
        name = _canonical(self.surrogate) if isinstance(self.surrogate, str) else None
        if name not in _SHAPES:
            msg = (
                f"spike: unknown surrogate {self.surrogate!r}; choose one of "
                f"{', '.join(repr(s) for s in SURROGATES)}."
            )
            raise GradOverrideError(msg)
        default = _SHAPES[name][2]
        alpha = default if self.alpha is None else self.alpha
        for arg, value in (("alpha", alpha), ("scale", self.scale)):
            positive_number(f"spike(surrogate={self.surrogate!r})", arg, value)
        at_zero = self.at_zero
        if (
            not isinstance(at_zero, (int, float))
            or isinstance(at_zero, bool)
            or not 0 <= at_zero <= 1
        ):
            msg = (
                "spike: `at_zero`, the step's value at x == 0, must be a number from 0 to 1 "
                f"(0: spike when x > 0; 1: when x >= 0); got {at_zero!r}."
            )
            raise GradOverrideError(msg)
        object.__setattr__(self, "alpha", float(alpha))
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(self, "at_zero", float(at_zero))

    def step(self, x: Tensor) -> Tensor:
        """The forward: H(x) with H(0) = `at_zero`, in x's dtype (no gradient)."""
        if self.at_zero == 0:
            return (x > 0).to(x.dtype)
        if self.at_zero == 1:
            return (x >= 0).to(x.dtype)
        return torch.where(x == 0, self.at_zero, (x > 0).to(x.dtype)).to(x.dtype)

    def gradient(self, x: Tensor) -> Tensor:
        """The surrogate gradient scale * sg(x), what the backward multiplies into."""
        derivative = _SHAPES[_canonical(self.surrogate)][0]
        return derivative(torch.ones_like(x), x, self.alpha, self.scale)  # type: ignore[arg-type]

    def proxy(self, x: Tensor) -> Tensor:
        """The smooth step whose derivative is sg (from 0 to 1; identity for
        straight-through), times `scale`: `torch.func.grad` of it equals `gradient`."""
        proxy = _SHAPES[_canonical(self.surrogate)][1]
        return proxy(x, self.alpha) * self.scale  # type: ignore[arg-type]

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and is_tensorflow(x):
            return tensorflow_call(self, x)
        return _spike(x, self)

    @classmethod
    def preset(cls, name: str, /, **params: float) -> spike:
        """The `spike` that reproduces a library's surrogate, in that library's parameter
        names and defaults: `spike.preset("snntorch.atan", alpha=2.0)`. See `SPIKE_PRESETS`.
        """
        entry = _PRESETS.get(name)
        if entry is None:
            msg = (
                f"spike.preset: unknown preset {name!r}; the presets are "
                f"{', '.join(repr(n) for n in _PRESETS)}."
            )
            raise GradOverrideError(msg)
        param, default, build, _ = entry
        unknown = sorted(set(params) - ({param} if param else set()))
        if unknown:
            takes = f"takes `{param}` (default {default})" if param else "takes no parameter"
            msg = f"spike.preset({name!r}) {takes}; got {', '.join(unknown)}."
            raise GradOverrideTypeError(msg)
        value = float(params.get(param, default)) if param else 0.0
        if param and not (math.isfinite(value) and value > 0):
            msg = (
                f"spike.preset({name!r}): `{param}` must be a positive finite number; got "
                f"{params.get(param)!r}."
            )
            raise GradOverrideError(msg)
        return cls(**build(value))


_Build = Callable[[float], dict[str, Any]]

# name -> (the library's parameter, its default, spike fields from it, what it matches)
_PRESETS: dict[str, tuple[str | None, float, _Build, str]] = {
    "snntorch.atan": (
        "alpha", 2.0, lambda a: {"surrogate": "arctan", "alpha": a},
        "snntorch.surrogate.atan(alpha): alpha/2 / (1 + (pi/2 alpha x)^2); H(0) = 0",
    ),
    "snntorch.sigmoid": (
        "slope", 25.0, lambda k: {"surrogate": "sigmoid", "alpha": k},
        "snntorch.surrogate.sigmoid(slope): k e^(-kx) / (e^(-kx) + 1)^2, finite here at "
        "large -x where snnTorch's gives NaN; H(0) = 0",
    ),
    "snntorch.fast_sigmoid": (
        "slope", 25.0,
        lambda k: {"surrogate": "fast_sigmoid", "alpha": k, "scale": 2 / k},
        "snntorch.surrogate.fast_sigmoid(slope): 1 / (1 + k|x|)^2; H(0) = 0",
    ),
    "snntorch.straight_through_estimator": (
        None, 0.0, lambda _: {"surrogate": "straight_through"},
        "snntorch.surrogate.straight_through_estimator(): 1; H(0) = 0",
    ),
    "spikingjelly.ATan": (
        "alpha", 2.0, lambda a: {"surrogate": "arctan", "alpha": a, "at_zero": 1.0},
        "spikingjelly surrogate.ATan(alpha): alpha/2 / (1 + (pi/2 alpha x)^2); H(0) = 1",
    ),
    "spikingjelly.Sigmoid": (
        "alpha", 4.0, lambda a: {"surrogate": "sigmoid", "alpha": a, "at_zero": 1.0},
        "spikingjelly surrogate.Sigmoid(alpha): alpha s(ax)(1 - s(ax)); H(0) = 1",
    ),
    "spikingjelly.SoftSign": (
        "alpha", 2.0, lambda a: {"surrogate": "soft_sign", "alpha": a, "at_zero": 1.0},
        "spikingjelly surrogate.SoftSign(alpha): 1 / (2 alpha (1/alpha + |x|)^2); H(0) = 1",
    ),
    "spikingjelly.SuperSpike": (
        "alpha", 1.0,
        lambda a: {"surrogate": "super_spike", "alpha": 1.0, "scale": 2 * a, "at_zero": 1.0},
        "spikingjelly surrogate.SuperSpike(alpha): alpha / (|x| + 1)^2; H(0) = 1",
    ),
    "spikingjelly.Erf": (
        "alpha", 2.0, lambda a: {"surrogate": "erf", "alpha": a, "at_zero": 1.0},
        "spikingjelly surrogate.Erf(alpha): alpha/sqrt(pi) exp(-(alpha x)^2); H(0) = 1",
    ),
    "spikingjelly.PiecewiseQuadratic": (
        "alpha", 1.0,
        lambda a: {"surrogate": "piecewise_quadratic", "alpha": a, "at_zero": 1.0},
        "spikingjelly surrogate.PiecewiseQuadratic(alpha): max(0, alpha - alpha^2 |x|); "
        "H(0) = 1",
    ),
    "spikingjelly.PiecewiseExp": (
        "alpha", 1.0, lambda a: {"surrogate": "piecewise_exp", "alpha": a, "at_zero": 1.0},
        "spikingjelly surrogate.PiecewiseExp(alpha): alpha/2 exp(-alpha |x|); H(0) = 1",
    ),
    "spikingjelly.Rect": (
        "alpha", 1.0, lambda a: {"surrogate": "rectangular", "alpha": a, "at_zero": 1.0},
        "spikingjelly surrogate.Rect(alpha): alpha where |x| < 1/(2 alpha); H(0) = 1",
    ),
    "norse.super": (
        "alpha", 100.0,
        lambda _: {"surrogate": "super_spike", "alpha": 1.0, "scale": 2.0},
        "norse superspike_fn / threshold(method='super'): 1 / (1 + |x|)^2 (norse does not "
        "use alpha in this formula); H(0) = 0",
    ),
    "norse.triangle": (
        "alpha", 100.0, lambda a: {"surrogate": "triangle", "alpha": 1.0, "scale": a},
        "norse threshold(method='triangle'): alpha * max(0, 1 - |x|); H(0) = 0",
    ),
    "norse.heavi_erfc": (
        "alpha", 100.0, lambda k: {"surrogate": "erf", "alpha": k, "scale": 2 / k},
        "norse threshold(method='heavi_erfc'): 2/sqrt(pi) exp(-(alpha x)^2); H(0) = 0",
    ),
    "norse.tanh": (
        "alpha", 100.0, lambda k: {"surrogate": "sigmoid", "alpha": 2 * k, "scale": 2 / k},
        "norse threshold(method='tanh'): 1 - tanh(alpha x)^2; H(0) = 0",
    ),
}

#: Each preset's name and the library formula it reproduces, with the library's parameter
#: names (norse's default alpha is `LIFParameters`'s, 100). Not offered: snnTorch's
#: `triangular`, whose gradient is ±threshold (the sign flips at 0), not a triangle.
SPIKE_PRESETS: Mapping[str, str] = MappingProxyType(
    {name: entry[3] for name, entry in _PRESETS.items()}
)
