"""Surrogate gradients for spiking networks: a Heaviside step whose backward is a smooth
surrogate's derivative.

One convention for the whole catalogue, so that names mean one formula:

* the forward is the step H(x): 1 where x > 0, 0 where x < 0, and `at_zero` at x == 0
  (default 0: a neuron spikes when its input *exceeds* the threshold, as in snnTorch and
  norse; SpikingJelly uses 1). Subtract the threshold first: `spike(v - v_th)`. The output
  has the input's dtype;
* the backward is `scale * sg(x - center)`, where sg is the derivative of a smooth step from
  0 to 1 (so it integrates to 1) whose sharpness is `alpha`. Each default alpha puts the
  peak at sg(0) = 1: right at the threshold the gradient passes unchanged, as a
  straight-through estimator's does. The surrogates whose formula cannot follow this (a
  one-sided, leaky, periodic or heavy-tailed gradient from a paper or a library) say so in
  the table;
* where the formula is finite, so is the gradient (no `exp` overflow turning into NaN at
  large |x|, no cancellation into 0 or noise in float16 and bfloat16).

Stochastic spikes take their uniform noise as an argument (`noise=`) or draw it from a
`generator`: deterministic given either. `sample=True` draws the forward from Bernoulli(p)
with p the surrogate's smooth step; `leaky_relu` with a `spread` gives the silent side a
random gradient.

The libraries' conventions, with their own parameter names and defaults, are presets:
`spike.preset("snntorch.fast_sigmoid", slope=25)` returns the `spike` whose forward and
gradients equal snnTorch's (see `SPIKE_PRESETS`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._decorators import custom_backward
from .._errors import GradOverrideError, GradOverrideTypeError
from .._ops import TORCH, foreign
from ._base import Recipe, RecipeModule, array_call, finite, positive_number
from ._formulas import surrogate as F
from ._surrogate_width import (
    LearnedAlphaSpike,
    alpha_repr,
    check_learned_alpha,
    learned_gradient,
    learned_spike,
)

__all__ = ["SPIKE_PRESETS", "SURROGATES", "spike"]

_SQRT_PI = math.sqrt(math.pi)
_HALF = (torch.float16, torch.bfloat16)


# ---- the surrogates: derivative (fast backward) and proxy (its smooth step) -------------------
#
# The derivatives, the step and the probabilities of a sampled spike are the formulas of
# `_formulas.surrogate`, written once over a backend: here they run with torch's (`TORCH`),
# whose compositions are the fused kernels and in-place temporaries that keep the backward
# as fast as hand-written code. A tensor alpha (a learned width) reaches only the proxies and
# probabilities, whose ops take a tensor as well as a float; the derivatives are never called
# with one (`_surrogate_width` has its own).


def _set(value: float | Tensor | None) -> float:
    """A surrogate parameter `spike` has resolved (it is None only for the surrogates that do
    not take it)."""
    assert value is not None
    return value  # type: ignore[return-value]


def _torch_step(name: str) -> _Proxy:
    """The formula's smooth step `name` on torch tensors: a proxy that is also the
    probability of a sampled spike."""
    formula = F.PROBABILITIES[name]

    def proxy(x: Tensor, r: spike) -> Tensor:
        result: Tensor = formula(TORCH, x, r)
        return result

    return proxy


# ---- proxies: the smooth function whose derivative is sg (autograd checks the backward) -------


def _proxy_fast_sigmoid(x: Tensor, r: spike) -> Tensor:
    a = _set(r.alpha)
    return 0.5 + 0.5 * (a * x) / (1 + a * x.abs())


def _proxy_erf(x: Tensor, r: spike) -> Tensor:
    return 0.5 + 0.5 * torch.erf(_set(r.alpha) * x)


def _proxy_straight(x: Tensor, r: spike) -> Tensor:
    return x


def _proxy_circ(x: Tensor, r: spike) -> Tensor:
    u = _set(r.alpha) * x
    return 0.5 + 0.5 * u / torch.sqrt(1 + u * u)


def _proxy_s2nn(x: Tensor, r: spike) -> Tensor:
    a, b = _set(r.alpha), _set(r.beta)
    left = torch.sigmoid(a * x.clamp(max=0))
    right = 0.5 + b * torch.log1p(x.clamp(min=0))
    return torch.where(x < 0, left, right)


def _proxy_squarewave_fourier(x: Tensor, r: spike) -> Tensor:
    a, n = _set(r.alpha), int(_set(r.terms))
    total = sum(torch.sin((2 * i - 1) * a * x) / (2 * i - 1) for i in range(1, n + 1))
    return 0.5 + (2 / math.pi) * total  # type: ignore[return-value]


def _proxy_nonzero_sign_log_abs(x: Tensor, r: spike) -> Tensor:
    a = _set(r.alpha)
    left = -torch.log1p(-a * x.clamp(max=0))
    right = torch.log1p(a * x.clamp(min=0))
    return torch.where(x < 0, left, right)


def _proxy_fake_numerical_gradient(x: Tensor, r: spike) -> Tensor:
    a = _set(r.alpha)
    m = 1 / a
    tail = torch.sign(x) * (1 + torch.log(a * x.abs().clamp(min=m)))  # clamped: finite at 0
    return torch.where(x.abs() <= m, a * x, tail)


def _proxy_log_tailed_relu(x: Tensor, r: spike) -> Tensor:
    leak = _set(r.leak)
    tail = 1 + torch.log(x.clamp(min=1))
    return torch.where(x <= 0, leak * x, torch.where(x <= 1, x, tail))


def _proxy_leaky_relu(x: Tensor, r: spike) -> Tensor:
    # x times the piecewise-constant sg (without noise: its mean, leak): autograd gives sg,
    # at x == 0 too
    leak = _set(r.leak)
    sg = torch.where(x > 0, x.new_full((), 1.0), x.new_full((), leak))
    sg = torch.where(x == 0, x.new_full((), r.at_zero + (1 - r.at_zero) * leak), sg)
    return x * sg


def _proxy_sparse_fast_sigmoid(x: Tensor, r: spike) -> Tensor:
    bound = _set(r.bound)
    step = _proxy_fast_sigmoid(x, r) - _proxy_fast_sigmoid(x.new_full((), bound), r)
    return torch.where(x > bound, step, 0.0)


_Proxy = Callable[[Tensor, "spike"], Tensor]


class _Surrogate(NamedTuple):
    derivative: F.Derivative
    proxy: _Proxy
    alpha: float | None  # the default alpha (sg(0) = 1 where the formula allows); None: unused
    formula: str  # sg(x) at scale 1
    params: tuple[str, ...] = ()  # its parameters besides alpha
    probability: F.Step | None = None  # its step from 0 to 1, for sample=True
    alpha_above: float = 0.0  # alpha must exceed this


_D, _P = F.DERIVATIVES, F.PROBABILITIES

_SHAPES: dict[str, _Surrogate] = {
    "arctan": _Surrogate(_D["arctan"], _torch_step("arctan"), 2.0,
                         "(a/2) / (1 + (pi a x / 2)^2)", probability=_P["arctan"]),
    "sigmoid": _Surrogate(_D["sigmoid"], _torch_step("sigmoid"), 4.0,
                          "a sigmoid(a x) (1 - sigmoid(a x))", probability=_P["sigmoid"]),
    "fast_sigmoid": _Surrogate(_D["fast_sigmoid"], _proxy_fast_sigmoid, 2.0,
                               "(a/2) / (1 + a|x|)^2", probability=_P["fast_sigmoid"]),
    "erf": _Surrogate(_D["erf"], _proxy_erf, _SQRT_PI, "(a / sqrt(pi)) exp(-(a x)^2)",
                      probability=_P["erf"]),
    "triangle": _Surrogate(_D["triangle"], _torch_step("triangle"), 1.0, "max(0, a - a^2 |x|)",
                           probability=_P["triangle"]),
    "rectangular": _Surrogate(_D["rectangular"], _torch_step("rectangular"), 1.0,
                              "a if |x| < 1/(2a) else leak", ("leak",),
                              probability=_P["rectangular"]),
    "piecewise_exp": _Surrogate(_D["piecewise_exp"], _torch_step("piecewise_exp"), 2.0,
                                "(a/2) exp(-a|x|)", probability=_P["piecewise_exp"]),
    "straight_through": _Surrogate(_D["straight_through"], _proxy_straight, 1.0, "1",
                                   probability=_P["straight_through"]),
    "circ": _Surrogate(_D["circ"], _proxy_circ, 2.0, "(a/2) / (1 + (a x)^2)^(3/2)",
                       probability=_P["circ"]),
    "q_pseudo_spike": _Surrogate(_D["q_pseudo_spike"], _torch_step("q_pseudo_spike"), 2.0,
                                 "(1 + 2|x| / (a - 1))^(-a)", probability=_P["q_pseudo_spike"],
                                 alpha_above=1.0),
    "s2nn": _Surrogate(_D["s2nn"], _proxy_s2nn, 4.0,
                       "a sigmoid(a x) (1 - sigmoid(a x)) if x < 0 else beta / (1 + x)",
                       ("beta",)),
    "squarewave_fourier": _Surrogate(_D["squarewave_fourier"], _proxy_squarewave_fourier,
                                     math.pi / 2, "(2a/pi) sum_{i=1..terms} cos((2i - 1) a x)",
                                     ("terms",)),
    "nonzero_sign_log_abs": _Surrogate(_D["nonzero_sign_log_abs"], _proxy_nonzero_sign_log_abs,
                                       1.0, "a / (1 + a|x|)"),
    "fake_numerical_gradient": _Surrogate(_D["fake_numerical_gradient"],
                                          _proxy_fake_numerical_gradient, 1.0,
                                          "min(a, 1/|x|)"),
    "log_tailed_relu": _Surrogate(_D["log_tailed_relu"], _proxy_log_tailed_relu, None,
                                  "leak if x <= 0, 1 if x <= 1, else 1/x", ("leak",)),
    "leaky_relu": _Surrogate(_D["leaky_relu"], _proxy_leaky_relu, None,
                             "1 where the step fires, else leak + spread (u - 1/2)",
                             ("leak", "spread")),
    "sparse_fast_sigmoid": _Surrogate(_D["sparse_fast_sigmoid"], _proxy_sparse_fast_sigmoid,
                                      2.0, "(a/2) / (1 + a|x|)^2 if x > bound else 0",
                                      ("bound",)),
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
    "circ",
    "q_pseudo_spike",
    "s2nn",
    "squarewave_fourier",
    "nonzero_sign_log_abs",
    "fake_numerical_gradient",
    "log_tailed_relu",
    "leaky_relu",
    "sparse_fast_sigmoid",
)

#: The parameters some surrogates take besides alpha: (default, what it must be).
_PARAMETERS: dict[str, tuple[float, str]] = {
    "beta": (1.0, "non-negative"),
    "leak": (0.0, "finite"),
    "spread": (0.0, "non-negative"),
    "terms": (1, "integer"),
    "bound": (1.0, "finite"),
}


# What the peer libraries call the surrogates (snnTorch's functions, SpikingJelly's classes,
# norse's methods), lowercased with `_` and `-` dropped, where that is not one of ours with
# `_` dropped: the name to suggest here.
_PEER_NAMES = {
    "atan": "arctan",
    "arctangent": "arctan",
    "triangular": "triangle",
    "tri": "triangle",
    "rect": "rectangular",
    "rectangle": "rectangular",
    "boxcar": "rectangular",
    "ste": "straight_through",
    "straightthroughestimator": "straight_through",
    "squarewavefourierseries": "squarewave_fourier",
    "leakykrelu": "leaky_relu",
}


def _suggestion(surrogate: object) -> str:
    """'did you mean ...? ' for a peer library's name of a surrogate, or a near spelling."""
    if not isinstance(surrogate, str):
        return ""
    key = surrogate.lower().replace("_", "").replace("-", "").replace(" ", "")
    found = _PEER_NAMES.get(key)
    if found is None:
        by_key = {s.replace("_", ""): s for s in SURROGATES}
        found = by_key.get(key)
    if found is None:
        close = difflib.get_close_matches(surrogate.lower(), SURROGATES, n=1, cutoff=0.75)
        found = close[0] if close else None
    if found is None:  # a peer's surrogate with no name here: its preset
        preset = next((name for name in _PRESETS
                       if name.partition(".")[2].lower().replace("_", "") == key), None)
        if preset is not None:
            return f"did you mean spike.preset({preset!r})? "
    return f"did you mean {found!r}? " if found is not None else ""


def _canonical(surrogate: str) -> str:
    return _ALIASES.get(surrogate, surrogate)


def _shape(recipe: spike) -> _Surrogate:
    return _SHAPES[_canonical(recipe.surrogate)]


# ---- the ops ----------------------------------------------------------------------------------


@custom_backward
def _spike(x: Tensor, recipe: spike) -> Tensor:
    return recipe.step(x)


@_spike.backward
def _(grad: Tensor, *, x: Tensor, recipe: spike) -> Tensor:
    result: Tensor = _shape(recipe).derivative(TORCH, grad, recipe._centred(x), recipe)
    return result


@custom_backward
def _spike_noisy_gradient(
    x: Tensor, recipe: spike, noise: Tensor | None, generator: torch.Generator | None
) -> Tensor:
    return recipe.step(x)


@_spike_noisy_gradient.backward
def _(grad: Tensor, *, x: Tensor, recipe: spike, noise: Tensor | None,
      generator: torch.Generator | None) -> tuple[Tensor, None, None, None]:
    # Drawn here, in the backward, when not given: as snnTorch's SSO draws it.
    u = noise if noise is not None else _uniform(x, generator, x.dtype)
    return F.leaky_relu(TORCH, grad, recipe._centred(x), recipe, u), None, None, None


@custom_backward
def _spike_sampled(
    x: Tensor, recipe: spike, noise: Tensor | None, generator: torch.Generator | None
) -> Tensor:
    return recipe._sample(x, noise, generator)


@_spike_sampled.backward
def _(grad: Tensor, *, x: Tensor, recipe: spike) -> tuple[Tensor, None, None, None]:
    return _shape(recipe).derivative(TORCH, grad, recipe._centred(x), recipe), None, None, None


def _uniform(like: Tensor, generator: torch.Generator | None, dtype: torch.dtype) -> Tensor:
    """U[0, 1) noise of like's shape, from `generator` or torch's default one: the numbers
    `torch.rand_like` draws (and, on the CPU in float32 and float64, `torch.bernoulli`)."""
    return torch.rand(like.shape, generator=generator, dtype=dtype, device=like.device)


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in _HALF else x.dtype


# ---- the recipe -------------------------------------------------------------------------------


def _number(owner: str, name: str, value: object, kind: str) -> float:
    """`value` as a float if it is a number of the `kind` `_PARAMETERS` names."""
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and finite(value)
        and {
            "positive": value > 0,
            "non-negative": value >= 0,
            "finite": True,
            "integer": float(value).is_integer() and value >= 1,
            "integer >= 2": float(value).is_integer() and value >= 2,
        }[kind]
    )
    if not ok:
        what = {
            "positive": "a positive finite number",
            "non-negative": "a finite number >= 0",
            "finite": "a finite number",
            "integer": "an integer >= 1",
            "integer >= 2": "an integer >= 2",
        }[kind]
        msg = f"{owner}: `{name}` must be {what}; got {type(value).__name__} {value!r}."
        raise GradOverrideError(msg)
    return float(value)  # type: ignore[arg-type]


@dataclass(frozen=True, repr=False)
class spike(Recipe):
    """A Heaviside spike whose backward is a surrogate gradient.

    Forward: H(x) = 1 where x > 0, 0 where x < 0, `at_zero` where x == 0, in x's dtype.
    Backward: dL/dx = dL/dy * scale * sg(x - center), with sg below (a = `alpha`, the
    column its default). The rows down to q_pseudo_spike are a smooth step's derivative:
    they integrate to 1, and their default alpha gives sg(0) = 1.

    | surrogate | sg(x) | alpha | sg(0) |
    | --- | --- | --- | --- |
    | arctan (default) | (a/2) / (1 + (pi a x / 2)^2) | 2 | 1 |
    | sigmoid | a sigmoid(a x) (1 - sigmoid(a x)) | 4 | 1 |
    | fast_sigmoid | (a/2) / (1 + a abs(x))^2 | 2 | 1 |
    | super_spike, soft_sign | the fast sigmoid's | 2 | 1 |
    | erf | (a / sqrt(pi)) exp(-(a x)^2) | sqrt(pi) | 1 |
    | triangle | max(0, a - a^2 abs(x)) | 1 | 1 |
    | piecewise_quadratic | the triangle's | 1 | 1 |
    | rectangular | a where abs(x) < 1/(2a), else leak (default 0) | 1 | 1 |
    | piecewise_exp | (a/2) exp(-a abs(x)) | 2 | 1 |
    | circ | (a/2) / (1 + (a x)^2)^(3/2) | 2 | 1 |
    | q_pseudo_spike | (1 + 2 abs(x) / (a - 1))^(-a), a > 1: the tail | 2 | 1 |
    | straight_through | 1 | unused | 1 |
    | s2nn | a s(a x) s(-a x) for x < 0, beta / (1 + x) | 4 | beta |
    | squarewave_fourier | (2a/pi) sum_{i<=terms} cos((2i - 1) a x) | pi/2 | 1* |
    | nonzero_sign_log_abs | a / (1 + a abs(x)) | 1 | a |
    | fake_numerical_gradient | min(a, 1/abs(x)) | 1 | a |
    | log_tailed_relu | leak for x <= 0, 1 up to x = 1, then 1/x | unused | leak |
    | leaky_relu | 1 where the step fires, leak where it does not | unused | ** |
    | sparse_fast_sigmoid | the fast sigmoid's where x > bound, else 0 | 2 | 0 |

    (s = sigmoid; * 2a terms / pi; ** at_zero + (1 - at_zero) * leak.) straight_through is
    the constant 1, and from s2nn down the formula cannot follow the convention: their
    gradients do not integrate to 1 (a 1/x or constant tail, a periodic sum) or are
    one-sided by design; their columns give what alpha and sg(0) are instead.

    Parameters besides alpha, each taken only by the surrogates that use it (None: the
    surrogate's default, as for alpha; the repr shows those that differ from it):

    * `leak` (rectangular, log_tailed_relu, leaky_relu; default 0): the gradient, before
      `scale`, outside the window or on the silent side;
    * `spread` (leaky_relu; default 0): noise on the silent side: leak + spread * (u - 1/2)
      with u ~ U[0, 1) per element, drawn in the backward (`noise=` gives u);
    * `beta` (s2nn; default 1): the height of its right branch, beta / (1 + x);
    * `terms` (squarewave_fourier; default 1): how many odd harmonics;
    * `bound` (sparse_fast_sigmoid; default 1): the gradient flows only where x > bound.

    And for every surrogate: `center` (default 0) moves the surrogate, not the step: the
    gradient is scale * sg(x - center); `sample=True` draws the forward from Bernoulli(p)
    with p the surrogate's smooth step from 0 to 1 (`recipe.probability(x)`; the input
    itself, clipped to [0, 1], for straight_through) instead of H(x): `at_zero` does not
    apply, and the backward is the same scale * sg.

    Where the formulas come from: arctan, Fang et al. 2021 (snnTorch `atan`, SpikingJelly
    `ATan`); sigmoid, SpikingJelly `Sigmoid`, snnTorch `sigmoid`, norse `tanh`; fast
    sigmoid, Zenke & Ganguli 2018 (SuperSpike; SpikingJelly `SoftSign`); erf, SpikingJelly
    `Erf`, norse `heavi_erfc`; triangle, Esser et al. 2016; rectangular, SpikingJelly `Rect`
    and, with a leak, `PiecewiseLeakyReLU` (Wu et al. 2018); circ, norse `circ`, the step
    1/2 + x / (2 sqrt(x^2 + (1/a)^2)); q_pseudo_spike, Herranz-Celotti & Rouat 2022;
    s2nn, Suetake et al. 2022; squarewave_fourier, nonzero_sign_log_abs and
    fake_numerical_gradient, SpikingJelly; log_tailed_relu, Cai et al. 2017 (HWGQ);
    leaky_relu, snnTorch `LSO`/`SSO`/`heaviside` and SpikingJelly `LeakyKReLU`;
    sparse_fast_sigmoid, snnTorch `SFS` (after Perez-Nieves & Goodman 2021, whose window
    is |x| < bound instead).

    A learned width: `alpha` may be a floating torch tensor, typically an `nn.Parameter`:
    one value (shape ()) or one per channel (broadcastable to x without enlarging it, as
    (C, 1, 1) for an (N, C, H, W) input). Or let the module hold it:
    `spike("arctan", alpha=2.0).module(learn_alpha=True)` (a shape instead of True for one
    alpha per element of it) has `module.alpha`, an `nn.Parameter` initialised to 2.0 and
    saved in its `state_dict`. The forward is still the step, which does not depend on
    alpha (its true gradient is 0); as in the Learnable Surrogate Gradient (Lian et al.,
    IJCAI 2023), the backward treats the smooth step sigma = `proxy` as the forward for
    both inputs: dL/dx is the surrogate gradient above, unchanged, and dL/dalpha =
    sum(dL/dy * scale * d sigma/dalpha) over the elements alpha was broadcast to (x sg / a
    for the surrogates where sigma is a function of a x), computed in float32 at least and
    returned in alpha's dtype. Every surrogate with an alpha in its formula takes one
    (sparse_fast_sigmoid's sigma is 0 up to `bound`, so its width derivative subtracts
    that of its value at the bound); straight_through, log_tailed_relu and leaky_relu have
    no width and refuse a tensor, as does `sample=True`. Its values are used as given, not
    checked (a check would make every call wait for the GPU): keep alpha > 0 (> 1 for
    q_pseudo_spike), e.g. by `alpha.clamp_(min=...)` under `torch.no_grad()` after each
    step. Presets whose parameter is alpha unchanged take a tensor too
    (`spike.preset("spikingjelly.ATan", alpha=param)`). A tensor alpha runs on torch
    tensors only; the float-alpha path is unchanged.

    `spike.preset(name, **params)` gives each library's convention (see `SPIKE_PRESETS`).
    `recipe.gradient(x)` is scale * sg(x - center); `recipe.proxy(x)` is the function whose
    derivative (times `scale`) it is: a smooth step from 0 to 1 for the top rows.

    ```python
    import torch
    import gradoverride as go

    spk = go.recipes.spike()  # arctan, alpha=2, H(0) = 0
    v = torch.tensor([0.5, 1.0, 1.5], requires_grad=True)
    out = spk(v - 1.0)  # spikes where v > 1
    out.sum().backward()
    print(out.tolist(), [round(g, 3) for g in v.grad.tolist()])
    #> [0.0, 0.0, 1.0] [0.288, 1.0, 0.288]
    ```

    A stochastic spike (`sample=True`, or leaky_relu with a spread) takes `noise=` (U[0, 1)
    samples of x's shape: the spike is noise < p; for the spread, the u above) or
    `generator=` (a torch.Generator); with neither it draws from torch's default generator
    as `torch.rand_like` does (on the CPU in float32 and float64 also what `torch.bernoulli`
    draws), so a seed reproduces a peer's run. Under `torch.compile` and `torch.func` pass
    `noise=`: a compiled graph draws its own numbers, and `vmap` refuses random draws.
    On TensorFlow tensors it draws from TensorFlow's generator without `noise=`; on JAX
    arrays, which have no global random state, `noise=` is required:
    `noise=jax.random.uniform(key, x.shape)`, with a new key each step.
    """

    surrogate: str = "arctan"
    alpha: float | Tensor | None = None
    scale: float = 1.0
    at_zero: float = 0.0
    _: KW_ONLY
    leak: float | None = None
    spread: float | None = None
    beta: float | None = None
    terms: int | None = None
    bound: float | None = None
    center: float = 0.0
    sample: bool = False

    def __post_init__(self) -> None:
        name = _canonical(self.surrogate) if isinstance(self.surrogate, str) else None
        if name not in _SHAPES:
            hint = _suggestion(self.surrogate)
            msg = (
                f"spike: unknown surrogate {self.surrogate!r}; "
                f"{hint}choose one of {', '.join(repr(s) for s in SURROGATES)}."
            )
            raise GradOverrideError(msg)
        shape = _SHAPES[name]
        owner = f"spike(surrogate={self.surrogate!r})"
        default = shape.alpha if shape.alpha is not None else 1.0
        alpha = default if self.alpha is None else self.alpha
        if isinstance(alpha, Tensor):  # a learned width: its values are not read (see above)
            check_learned_alpha(owner, name, alpha, self.sample)
        else:
            positive_number(owner, "alpha", alpha, "(Or a floating torch tensor, to learn "
                            "the width: see `spike`.)")
            if alpha <= shape.alpha_above:
                msg = (
                    f"{owner}: `alpha` must be greater than {shape.alpha_above:g} (the "
                    f"formula divides by a - {shape.alpha_above:g}); got {alpha!r}."
                )
                raise GradOverrideError(msg)
        positive_number(owner, "scale", self.scale)
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
        object.__setattr__(self, "alpha", alpha if isinstance(alpha, Tensor) else float(alpha))
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(self, "at_zero", float(at_zero))
        object.__setattr__(self, "center", _number(owner, "center", self.center, "finite"))
        self._resolve_parameters(name, shape, owner)
        self._check_sample(name, shape, owner)

    def _resolve_parameters(self, name: str, shape: _Surrogate, owner: str) -> None:
        for param, (default, kind) in _PARAMETERS.items():
            value = getattr(self, param)
            if param not in shape.params:
                if value is not None:
                    takers = [s for s, entry in _SHAPES.items() if param in entry.params]
                    msg = (
                        f"{owner} takes no `{param}`: it is a parameter of "
                        f"{', '.join(repr(s) for s in takers)}."
                    )
                    raise GradOverrideTypeError(msg)
                continue
            number = _number(owner, param, default if value is None else value, kind)
            object.__setattr__(self, param, int(number) if param == "terms" else number)

    def _check_sample(self, name: str, shape: _Surrogate, owner: str) -> None:
        if not isinstance(self.sample, bool):
            msg = f"{owner}: `sample` must be True or False; got {self.sample!r}."
            raise GradOverrideTypeError(msg)
        if not self.sample:
            return
        sampled = [s for s in SURROGATES if _SHAPES[_canonical(s)].probability is not None]
        problem = None
        if shape.probability is None or (name == "rectangular" and self.leak != 0):
            problem = (
                "its proxy is not a step from 0 to 1, so it is no probability; sample with "
                f"one of {', '.join(repr(s) for s in sampled)} (rectangular without a leak)"
            )
        elif self.at_zero != 0:
            problem = "a sampled spike has no value at 0 (`at_zero` does not apply); leave it 0"
        if problem is not None:
            msg = f"{owner}, sample=True: {problem}."
            raise GradOverrideError(msg)

    def __repr__(self) -> str:
        alpha = alpha_repr(self.alpha) if isinstance(self.alpha, Tensor) else repr(self.alpha)
        fields = [f"surrogate={self.surrogate!r}", f"alpha={alpha}",
                  f"scale={self.scale!r}", f"at_zero={self.at_zero!r}"]
        fields += [
            f"{p}={getattr(self, p)!r}"
            for p in _shape(self).params
            if getattr(self, p) != _PARAMETERS[p][0]
        ]
        if self.center != 0:
            fields.append(f"center={self.center!r}")
        if self.sample:
            fields.append("sample=True")
        return f"spike({', '.join(fields)})"

    @property
    def stochastic(self) -> bool:
        """Whether calls draw noise: a sampled forward, or a leaky_relu spread."""
        return self.sample or bool(self.spread)

    def _centred(self, x: Tensor) -> Tensor:
        return x if self.center == 0 else x - self.center

    def step(self, x: Tensor) -> Tensor:
        """H(x) with H(0) = `at_zero`, in x's dtype (no gradient): the forward, unless
        `sample=True`."""
        result: Tensor = F.step(TORCH, x, self.at_zero)
        return result

    def probability(self, x: Tensor) -> Tensor:
        """The probability of a spike when `sample=True`: the surrogate's smooth step from 0
        to 1 at x - center (the input clipped to [0, 1] for straight_through), computed in
        float32 for float16/bfloat16 inputs, finite everywhere."""
        shape = _shape(self)
        if shape.probability is None:
            msg = (
                f"{self!r}.probability: the surrogate {self.surrogate!r} has no step from 0 "
                "to 1 to sample from."
            )
            raise GradOverrideError(msg)
        xc = self._centred(x.detach().to(_compute_dtype(x)))
        result: Tensor = shape.probability(TORCH, xc, self)
        return result

    def _sample(self, x: Tensor, noise: Tensor | None, generator: torch.Generator | None
                ) -> Tensor:
        p = self.probability(x)
        u = _uniform(p, generator, p.dtype) if noise is None else noise.to(p.dtype)
        result: Tensor = F.sample(TORCH, u, p, x.dtype)
        return result

    def gradient(self, x: Tensor, *, noise: Tensor | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """The surrogate gradient scale * sg(x - center), what the backward multiplies into
        (for leaky_relu with a spread, with the noise `noise=` or `generator=` gives)."""
        ones = torch.ones_like(x)
        xc = self._centred(x)
        if self.spread:
            u = _uniform(x, generator, x.dtype) if noise is None else _check_noise(self, x, noise)
            result: Tensor = F.leaky_relu(TORCH, ones, xc, self, u)
            return result
        if isinstance(self.alpha, Tensor):
            return learned_gradient(x, self.alpha, self, _canonical(self.surrogate))
        result = _shape(self).derivative(TORCH, ones, xc, self)
        return result

    def proxy(self, x: Tensor) -> Tensor:
        """The function whose derivative is sg (a smooth step from 0 to 1 for the surrogates
        that integrate to 1; the identity for straight-through), times `scale`:
        `torch.func.grad` of it equals `gradient` (for leaky_relu, at its mean leak)."""
        return _shape(self).proxy(self._centred(x), self) * self.scale

    def __call__(self, x: Tensor, *, noise: Tensor | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):  # a learned alpha is refused there
            return array_call(self, x, noise=noise, generator=generator)
        if not (self.sample or self.spread):
            if noise is not None or generator is not None:
                _refuse_noise(self)
            if isinstance(self.alpha, Tensor):  # a learned width (never sampled or spread)
                return learned_spike(x, self.alpha, self, _canonical(self.surrogate))
            return _spike(x, self)
        if noise is not None:
            noise = _check_noise(self, x, noise)
        if generator is not None and not isinstance(generator, torch.Generator):
            msg = (
                f"{self!r}: `generator` must be a torch.Generator (or None); got "
                f"{type(generator).__name__} {generator!r}."
            )
            raise GradOverrideTypeError(msg)
        if self.sample:
            result: Tensor = _spike_sampled(x, self, noise, generator)
        else:
            result = _spike_noisy_gradient(x, self, noise, generator)
        return result

    def module(  # type: ignore[override]
        self, learn_alpha: bool | tuple[int, ...] = False
    ) -> RecipeModule | LearnedAlphaSpike:
        """This spike as an `nn.Module`. With `learn_alpha=True` the module holds alpha as
        its own `nn.Parameter` (`module.alpha`, in its `state_dict`), initialised to this
        recipe's alpha; a shape (`learn_alpha=(C, 1, 1)`) gives one alpha per element of
        it, broadcast against the input (per channel of an (N, C, H, W) input)."""
        owner = f"{self!r}.module"
        if isinstance(self.alpha, Tensor):
            msg = (
                f"{owner}(): this spike's `alpha` is a tensor, which a module would not own "
                "(not in its parameters() nor its state_dict). Let the module hold it: "
                f"`spike({self.surrogate!r}, alpha=<initial float>, ...)"
                ".module(learn_alpha=True)`."
            )
            raise GradOverrideError(msg)
        if learn_alpha is False:
            return RecipeModule(self)
        shape: tuple[int, ...] = ()
        if learn_alpha is not True:
            if not (
                isinstance(learn_alpha, tuple)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                        for n in learn_alpha)
            ):
                msg = (
                    f"{owner}: `learn_alpha` must be True (one alpha), False, or the shape "
                    f"of the alphas, a tuple of positive ints like (C, 1, 1); got "
                    f"{learn_alpha!r}."
                )
                raise GradOverrideTypeError(msg)
            shape = learn_alpha
        name = _canonical(self.surrogate)
        check_learned_alpha(f"{owner}(learn_alpha=...)", name, torch.empty(()), self.sample)
        return LearnedAlphaSpike(self, name, shape)

    @classmethod
    def preset(cls, name: str, /, **params: float | Tensor) -> spike:
        """The `spike` that reproduces a library's surrogate, in that library's parameter
        names and defaults: `spike.preset("snntorch.atan", alpha=2.0)`. See `SPIKE_PRESETS`.

        A parameter may be a tensor (a learned width, see `spike`) where the preset passes
        it unchanged to spike's alpha, as `spike.preset("spikingjelly.ATan", alpha=param)`
        and `spike.preset("snntorch.sigmoid", slope=param)` do; a preset whose parameter
        also sets the scale (snnTorch's `fast_sigmoid`, SpikingJelly's `SuperSpike`, norse's
        functions) or is not the width refuses one.
        """
        entry = _PRESETS.get(name)
        if entry is None:
            msg = (
                f"spike.preset: unknown preset {name!r}; the presets are "
                f"{', '.join(repr(n) for n in _PRESETS)}."
            )
            raise GradOverrideError(msg)
        unknown = sorted(set(params) - set(entry.params))
        if unknown:
            if entry.params:
                listed = ", ".join(f"`{p}` (default {d[0]})" for p, d in entry.params.items())
                takes = f"takes {listed}"
            else:
                takes = "takes no parameter"
            msg = f"spike.preset({name!r}) {takes}; got {', '.join(unknown)}."
            raise GradOverrideTypeError(msg)
        tensors = [p for p, v in params.items() if isinstance(v, Tensor)]
        values: dict[str, float | Tensor] = {
            p: _number(f"spike.preset({name!r})", p, params.get(p, default), kind)
            for p, (default, kind) in entry.params.items() if p not in tensors
        }
        if tensors:
            return cls(**_preset_with_tensor(name, entry, values, tensors, params))
        try:
            return cls(**entry.build(*values.values()))
        except GradOverrideError as error:
            given = ", ".join(f"{p}={v!r}" for p, v in values.items())
            msg = f"spike.preset({name!r}, {given}) has no spike equal to it: {error}"
            raise GradOverrideError(msg) from None


def _preset_with_tensor(name: str, entry: _Preset, values: dict[str, float | Tensor],
                        tensors: list[str], params: Mapping[str, float | Tensor]
                        ) -> dict[str, Any]:
    """The preset's spike fields with the tensor parameter as alpha, if the preset passes
    that parameter unchanged to alpha and to nothing else."""
    first = tensors[0]
    fields, follow = _following(entry, values, first)
    problem = None
    if follow != ["alpha"]:
        problem = f"it sets {', '.join(follow) or 'no width'} from it"
    elif len(tensors) > 1:
        first, problem = tensors[1], f"only alpha can be a tensor, and `{first}` is alpha"
    if problem is not None:
        learnable = [n for n, e in _PRESETS.items()
                     if any(_following(e, {}, p)[1] == ["alpha"] for p in e.params)]
        msg = (
            f"spike.preset({name!r}): `{first}` cannot be a tensor (a learned width): this "
            f"preset does not pass it unchanged to spike's alpha ({problem}). Give a float, "
            "learn the width with spike(surrogate, alpha=tensor, ...), or use a preset "
            f"that takes one: {', '.join(repr(n) for n in learnable)}."
        )
        raise GradOverrideError(msg)
    return {**fields, "alpha": params[first]}


def _following(entry: _Preset, values: Mapping[str, float | Tensor], param: str
               ) -> tuple[dict[str, Any], list[str]]:
    """The preset's fields with `param` at its default (the others at `values` or theirs),
    and the fields that follow `param`: those that differ when it is 2 * default + 1
    instead (only alpha, equal to the probe, counts as "alpha"; any other change is listed
    by name)."""
    default = entry.params[param][0]
    built = []
    for probe in (default, 2 * default + 1):
        given = {**values, param: probe}
        built.append(entry.build(*(given.get(p, d) for p, (d, _) in entry.params.items())))
    first, second = built
    follow = sorted(k for k in first.keys() | second.keys() if first.get(k) != second.get(k))
    if follow == ["alpha"] and first["alpha"] != default:
        follow = ["alpha by a formula"]
    return first, follow


def _check_noise(recipe: spike, x: Tensor, noise: object) -> Tensor:
    """`noise` if it is a floating tensor of x's shape on x's device."""
    problem = None
    if not isinstance(noise, Tensor):
        problem = f"got {type(noise).__name__}"
    elif not noise.is_floating_point():
        problem = f"got a {noise.dtype} tensor"
    elif noise.shape != x.shape or noise.device != x.device:
        problem = (
            f"got shape {tuple(noise.shape)} on {noise.device} for an input of shape "
            f"{tuple(x.shape)} on {x.device}"
        )
    if problem is not None:
        msg = (
            f"{recipe!r}: `noise` must be a floating tensor of U[0, 1) samples with the "
            f"input's shape and device; {problem}. Pass `noise=torch.rand_like(x)`."
        )
        raise GradOverrideTypeError(msg)
    assert isinstance(noise, Tensor)
    return noise


def _refuse_noise(recipe: spike) -> None:
    msg = (
        f"{recipe!r} is deterministic: it takes no `noise` or `generator`. A stochastic "
        "spike is `sample=True` (a Bernoulli forward) or surrogate='leaky_relu' with a "
        "`spread` (a noisy gradient)."
    )
    raise GradOverrideTypeError(msg)


# ---- presets: the libraries' functions, in their own names and defaults ------------------------


class _Preset(NamedTuple):
    library: str  # the library's call with its defaults
    params: dict[str, tuple[float, str]]  # its parameters: default, what each must be
    build: Callable[..., dict[str, Any]]  # spike's fields from them, in their order
    formula: str  # what it reproduces


_SJ = "spikingjelly.activation_based.surrogate"
_NORSE = "norse.torch.functional.threshold"
_NORSE_ALPHA = 100.0  # norse's LIFParameters.alpha, what its neurons pass to `threshold`


def _norse_circ(k: float) -> dict[str, Any]:
    # alpha^3 / (alpha^2 + x^2)^(3/2) = 2 alpha * (a/2) / (1 + (a x)^2)^(3/2), a = 1/alpha
    return {"surrogate": "circ", "alpha": 1 / k, "scale": 2 * k}


def _norse_tanh(k: float) -> dict[str, Any]:
    # 1 - tanh(k x)^2 = 4 sigmoid(2 k x) sigmoid(-2 k x): the sigmoid at 2k, times 2/k
    return {"surrogate": "sigmoid", "alpha": 2 * k, "scale": 2 / k}


def _norse_erfc(k: float) -> dict[str, Any]:
    return {"surrogate": "erf", "alpha": k, "scale": 2 / k}


def _spike_rate_escape(beta: float, slope: float) -> dict[str, Any]:
    # slope exp(-beta |x - 1|) = (2 slope / beta) * (beta/2) exp(-beta |x - 1|)
    if beta == 0:
        return {"surrogate": "straight_through", "scale": slope}
    return {"surrogate": "piecewise_exp", "alpha": beta, "scale": 2 * slope / beta,
            "center": 1.0}


def _piecewise_leaky_relu(w: float, c: float) -> dict[str, Any]:
    return {"surrogate": "rectangular", "alpha": 1 / (2 * w), "leak": c, "at_zero": 1.0}


_PRESETS: dict[str, _Preset] = {
    # snnTorch: H(0) = 0, the output always float32 there (here: the input's dtype)
    "snntorch.atan": _Preset(
        "snntorch.surrogate.atan(alpha=2.0)", {"alpha": (2.0, "positive")},
        lambda alpha: {"surrogate": "arctan", "alpha": alpha},
        "snntorch.surrogate.atan(alpha): alpha/2 / (1 + (pi/2 alpha x)^2); H(0) = 0",
    ),
    "snntorch.sigmoid": _Preset(
        "snntorch.surrogate.sigmoid(slope=25)", {"slope": (25.0, "positive")},
        lambda slope: {"surrogate": "sigmoid", "alpha": slope},
        "snntorch.surrogate.sigmoid(slope): k e^(-kx) / (e^(-kx) + 1)^2, finite here at "
        "large -x where snnTorch's gives NaN; H(0) = 0",
    ),
    "snntorch.fast_sigmoid": _Preset(
        "snntorch.surrogate.fast_sigmoid(slope=25)", {"slope": (25.0, "positive")},
        lambda slope: {"surrogate": "fast_sigmoid", "alpha": slope, "scale": 2 / slope},
        "snntorch.surrogate.fast_sigmoid(slope): 1 / (1 + k|x|)^2; H(0) = 0",
    ),
    "snntorch.straight_through_estimator": _Preset(
        "snntorch.surrogate.straight_through_estimator()", {},
        lambda: {"surrogate": "straight_through"},
        "snntorch.surrogate.straight_through_estimator(): 1; H(0) = 0",
    ),
    "snntorch.heaviside": _Preset(
        "snntorch.surrogate.heaviside()", {},
        lambda: {"surrogate": "leaky_relu"},
        "snntorch.surrogate.heaviside(): 1 where the spike fired (x > 0), else 0; H(0) = 0",
    ),
    "snntorch.spike_rate_escape": _Preset(
        "snntorch.surrogate.spike_rate_escape(beta=1, slope=25)",
        {"beta": (1.0, "non-negative"), "slope": (25.0, "positive")},
        _spike_rate_escape,
        "snntorch.surrogate.spike_rate_escape(beta, slope): slope exp(-beta |x - 1|), "
        "centred at x = 1 as snnTorch writes it; H(0) = 0",
    ),
    "snntorch.SSO": _Preset(
        "snntorch.surrogate.SSO(mean=0, variance=0.2)",
        {"mean": (0.0, "finite"), "variance": (0.2, "non-negative")},
        lambda mean, variance: {"surrogate": "leaky_relu", "leak": mean * variance,
                                "spread": variance},
        "snntorch.surrogate.SSO(mean, variance): 1 where the spike fired, else "
        "(u - 0.5 + mean) * variance with u ~ U[0, 1) drawn per element; H(0) = 0",
    ),
    "snntorch.LSO": _Preset(
        "snntorch.surrogate.LSO(slope=0.1)", {"slope": (0.1, "finite")},
        lambda slope: {"surrogate": "leaky_relu", "leak": slope},
        "snntorch.surrogate.LSO(slope): 1 where the spike fired, else slope (snnTorch 1.0's "
        "LSO() itself raises a TypeError; this is its LeakySpikeOperator); H(0) = 0",
    ),
    "snntorch.SFS": _Preset(
        "snntorch.surrogate.SFS(slope=25, B=1)",
        {"slope": (25.0, "positive"), "B": (1.0, "finite")},
        lambda slope, B: {"surrogate": "sparse_fast_sigmoid", "alpha": slope,
                          "scale": 2 / slope, "bound": B},
        "snntorch.surrogate.SFS(slope, B): 1 / (1 + k|x|)^2 where x > B, else 0; H(0) = 0",
    ),
    # SpikingJelly: H(0) = 1 (x >= 0 spikes)
    "spikingjelly.ATan": _Preset(
        f"{_SJ}.ATan(alpha=2.0)", {"alpha": (2.0, "positive")},
        lambda alpha: {"surrogate": "arctan", "alpha": alpha, "at_zero": 1.0},
        "spikingjelly surrogate.ATan(alpha): alpha/2 / (1 + (pi/2 alpha x)^2); H(0) = 1",
    ),
    "spikingjelly.Sigmoid": _Preset(
        f"{_SJ}.Sigmoid(alpha=4.0)", {"alpha": (4.0, "positive")},
        lambda alpha: {"surrogate": "sigmoid", "alpha": alpha, "at_zero": 1.0},
        "spikingjelly surrogate.Sigmoid(alpha): alpha s(ax)(1 - s(ax)); H(0) = 1",
    ),
    "spikingjelly.SoftSign": _Preset(
        f"{_SJ}.SoftSign(alpha=2.0)", {"alpha": (2.0, "positive")},
        lambda alpha: {"surrogate": "soft_sign", "alpha": alpha, "at_zero": 1.0},
        "spikingjelly surrogate.SoftSign(alpha): 1 / (2 alpha (1/alpha + |x|)^2); H(0) = 1",
    ),
    "spikingjelly.SuperSpike": _Preset(
        f"{_SJ}.SuperSpike(alpha=1.0)", {"alpha": (1.0, "positive")},
        lambda alpha: {"surrogate": "super_spike", "alpha": 1.0, "scale": 2 * alpha,
                       "at_zero": 1.0},
        "spikingjelly surrogate.SuperSpike(alpha): alpha / (|x| + 1)^2; H(0) = 1",
    ),
    "spikingjelly.Erf": _Preset(
        f"{_SJ}.Erf(alpha=2.0)", {"alpha": (2.0, "positive")},
        lambda alpha: {"surrogate": "erf", "alpha": alpha, "at_zero": 1.0},
        "spikingjelly surrogate.Erf(alpha): alpha/sqrt(pi) exp(-(alpha x)^2); H(0) = 1",
    ),
    "spikingjelly.PiecewiseQuadratic": _Preset(
        f"{_SJ}.PiecewiseQuadratic(alpha=1.0)", {"alpha": (1.0, "positive")},
        lambda alpha: {"surrogate": "piecewise_quadratic", "alpha": alpha, "at_zero": 1.0},
        "spikingjelly surrogate.PiecewiseQuadratic(alpha): max(0, alpha - alpha^2 |x|); "
        "H(0) = 1",
    ),
    "spikingjelly.PiecewiseExp": _Preset(
        f"{_SJ}.PiecewiseExp(alpha=1.0)", {"alpha": (1.0, "positive")},
        lambda alpha: {"surrogate": "piecewise_exp", "alpha": alpha, "at_zero": 1.0},
        "spikingjelly surrogate.PiecewiseExp(alpha): alpha/2 exp(-alpha |x|); H(0) = 1",
    ),
    "spikingjelly.Rect": _Preset(
        f"{_SJ}.Rect(alpha=1.0)", {"alpha": (1.0, "positive")},
        lambda alpha: {"surrogate": "rectangular", "alpha": alpha, "at_zero": 1.0},
        "spikingjelly surrogate.Rect(alpha): alpha where |x| < 1/(2 alpha); H(0) = 1",
    ),
    "spikingjelly.QPseudoSpike": _Preset(
        f"{_SJ}.QPseudoSpike(alpha=2.0)", {"alpha": (2.0, "positive")},
        lambda alpha: {"surrogate": "q_pseudo_spike", "alpha": alpha, "at_zero": 1.0},
        "spikingjelly surrogate.QPseudoSpike(alpha): (1 + 2|x| / (alpha - 1))^(-alpha), "
        "alpha > 1; H(0) = 1",
    ),
    "spikingjelly.S2NN": _Preset(
        f"{_SJ}.S2NN(alpha=4.0, beta=1.0)",
        {"alpha": (4.0, "positive"), "beta": (1.0, "non-negative")},
        lambda alpha, beta: {"surrogate": "s2nn", "alpha": alpha, "beta": beta, "at_zero": 1.0},
        "spikingjelly surrogate.S2NN(alpha, beta): alpha s(ax)(1 - s(ax)) for x < 0, "
        "beta / (x + 1) for x >= 0; H(0) = 1",
    ),
    "spikingjelly.SquarewaveFourierSeries": _Preset(
        f"{_SJ}.SquarewaveFourierSeries(n=2, T_period=8)",
        {"n": (2, "integer >= 2"), "T_period": (8.0, "positive")},
        lambda n, T_period: {"surrogate": "squarewave_fourier",
                             "alpha": math.pi * 2.0 / T_period, "terms": int(n) - 1,
                             "at_zero": 1.0},
        "spikingjelly surrogate.SquarewaveFourierSeries(n, T_period): (4/T) sum_{i=1..n-1} "
        "cos((2i - 1) 2 pi x / T); H(0) = 1",
    ),
    "spikingjelly.NonzeroSignLogAbs": _Preset(
        f"{_SJ}.NonzeroSignLogAbs(alpha=1.0)", {"alpha": (1.0, "positive")},
        lambda alpha: {"surrogate": "nonzero_sign_log_abs", "alpha": alpha, "at_zero": 1.0},
        "spikingjelly surrogate.NonzeroSignLogAbs(alpha): 1 / (1/alpha + |x|); H(0) = 1",
    ),
    "spikingjelly.FakeNumericalGradient": _Preset(
        f"{_SJ}.FakeNumericalGradient(alpha=0.3)", {"alpha": (0.3, "positive")},
        lambda alpha: {"surrogate": "fake_numerical_gradient", "alpha": alpha,
                       "at_zero": 1.0},
        "spikingjelly surrogate.FakeNumericalGradient(alpha): min(sign(x)/x, alpha), "
        "alpha at x = -0 too (SpikingJelly gives -inf there); H(0) = 1",
    ),
    "spikingjelly.LogTailedReLU": _Preset(
        f"{_SJ}.LogTailedReLU(alpha=0.0)", {"alpha": (0.0, "finite")},
        lambda alpha: {"surrogate": "log_tailed_relu", "leak": alpha, "at_zero": 1.0},
        "spikingjelly surrogate.LogTailedReLU(alpha): alpha for x <= 0, 1 for 0 < x <= 1, "
        "1/x for x > 1; H(0) = 1",
    ),
    "spikingjelly.LeakyKReLU": _Preset(
        f"{_SJ}.LeakyKReLU(leak=0.0, k=1.0)",
        {"leak": (0.0, "finite"), "k": (1.0, "positive")},
        lambda leak, k: {"surrogate": "leaky_relu", "scale": k, "leak": leak / k,
                         "at_zero": 1.0},
        "spikingjelly surrogate.LeakyKReLU(leak, k): k for x >= 0, leak for x < 0; H(0) = 1",
    ),
    "spikingjelly.PiecewiseLeakyReLU": _Preset(
        f"{_SJ}.PiecewiseLeakyReLU(w=1.0, c=0.01)",
        {"w": (1.0, "positive"), "c": (0.01, "finite")},
        _piecewise_leaky_relu,
        "spikingjelly surrogate.PiecewiseLeakyReLU(w, c): 1/(2w) where |x| < w, else c; "
        "H(0) = 1",
    ),
    "spikingjelly.DeterministicPass": _Preset(
        f"{_SJ}.DeterministicPass()", {},
        lambda: {"surrogate": "straight_through", "at_zero": 1.0},
        "spikingjelly surrogate.DeterministicPass(): 1; H(0) = 1",
    ),
    "spikingjelly.PoissonPass": _Preset(
        f"{_SJ}.PoissonPass()", {},
        lambda: {"surrogate": "straight_through", "sample": True},
        "spikingjelly surrogate.PoissonPass(): spikes drawn from Bernoulli(x) (x clipped to "
        "[0, 1] here; SpikingJelly raises outside), gradient 1",
    ),
    # norse: H(0) = 0; `threshold(x, method, alpha)` and the functions it calls
    "norse.super": _Preset(
        f'{_NORSE}.threshold(x, "super", alpha=100.0)', {"alpha": (_NORSE_ALPHA, "positive")},
        lambda alpha: {"surrogate": "super_spike", "alpha": 1.0, "scale": 2.0},
        "norse superspike_fn / threshold(method='super'): 1 / (1 + |x|)^2 (norse does not "
        "use alpha in this formula); H(0) = 0",
    ),
    "norse.triangle": _Preset(
        f'{_NORSE}.threshold(x, "triangle", alpha=100.0)',
        {"alpha": (_NORSE_ALPHA, "positive")},
        lambda alpha: {"surrogate": "triangle", "alpha": 1.0, "scale": alpha},
        "norse threshold(method='triangle'): alpha * max(0, 1 - |x|); H(0) = 0",
    ),
    "norse.heavi_erfc": _Preset(
        f'{_NORSE}.threshold(x, "heavi_erfc", alpha=100.0)',
        {"alpha": (_NORSE_ALPHA, "positive")},
        _norse_erfc,
        "norse threshold(method='heavi_erfc'): 2/sqrt(pi) exp(-(alpha x)^2); H(0) = 0",
    ),
    "norse.tanh": _Preset(
        f'{_NORSE}.threshold(x, "tanh", alpha=100.0)', {"alpha": (_NORSE_ALPHA, "positive")},
        _norse_tanh,
        "norse threshold(method='tanh'): 1 - tanh(alpha x)^2; H(0) = 0",
    ),
    "norse.circ": _Preset(
        f'{_NORSE}.threshold(x, "circ", alpha=100.0)', {"alpha": (_NORSE_ALPHA, "positive")},
        _norse_circ,
        "norse threshold(method='circ'): alpha^3 / (alpha^2 + x^2)^(3/2), finite here at "
        "|x| > 1e19 (float32) where norse's gives NaN; H(0) = 0",
    ),
    "norse.super_fn": _Preset(
        f"{_NORSE}.super_fn(x, alpha=100.0)", {"alpha": (_NORSE_ALPHA, "positive")},
        lambda alpha: {"surrogate": "super_spike", "alpha": 1.0, "scale": 2.0},
        "norse super_fn(x, alpha): 1 / (1 + |x|)^2 (alpha unused); H(0) = 0",
    ),
    "norse.triangle_fn": _Preset(
        f"{_NORSE}.triangle_fn(x, alpha=0.3)", {"alpha": (0.3, "positive")},
        lambda alpha: {"surrogate": "triangle", "alpha": 1.0, "scale": alpha},
        "norse triangle_fn(x, alpha): alpha * max(0, 1 - |x|); H(0) = 0",
    ),
    "norse.heavi_erfc_fn": _Preset(
        f"{_NORSE}.heavi_erfc_fn(x, k=100.0)", {"k": (_NORSE_ALPHA, "positive")},
        _norse_erfc,
        "norse heavi_erfc_fn(x, k): 2/sqrt(pi) exp(-(k x)^2); H(0) = 0",
    ),
    "norse.heavi_tanh_fn": _Preset(
        f"{_NORSE}.heavi_tanh_fn(x, k=100.0)", {"k": (_NORSE_ALPHA, "positive")},
        _norse_tanh,
        "norse heavi_tanh_fn(x, k): 1 - tanh(k x)^2; H(0) = 0",
    ),
    "norse.heavi_circ_fn": _Preset(
        f"{_NORSE}.heavi_circ_fn(x, k=100.0)", {"k": (_NORSE_ALPHA, "positive")},
        _norse_circ,
        "norse heavi_circ_fn(x, k): k^3 / (k^2 + x^2)^(3/2); H(0) = 0",
    ),
    "norse.circ_dist_fn": _Preset(
        f"{_NORSE}.circ_dist_fn(x, k=100.0)", {"k": (_NORSE_ALPHA, "positive")},
        lambda k: {**_norse_circ(k), "sample": True},
        "norse circ_dist_fn(x, k): spikes drawn from Bernoulli(1/2 + x / (2 sqrt(x^2 + "
        "k^2))), gradient k^3 / (k^2 + x^2)^(3/2)",
    ),
    "norse.logistic_fn": _Preset(
        f"{_NORSE}.logistic_fn(x, k=100.0)", {"k": (_NORSE_ALPHA, "positive")},
        lambda k: {**_norse_tanh(k), "sample": True},
        "norse logistic_fn(x, k): spikes drawn from Bernoulli(1/2 + tanh(k x) / 2), "
        "gradient 1 - tanh(k x)^2",
    ),
}

#: Each preset's name and the library formula it reproduces, with the library's parameter
#: names (norse's default alpha or k is `LIFParameters`'s, 100: its functions have none).
#: Not offered: snnTorch's `triangular`, whose gradient is ±threshold (the sign flips at 0),
#: not a triangle, and SpikingJelly's `MultiLevelSpikeCount`, a clamped round, not a spike.
SPIKE_PRESETS: Mapping[str, str] = MappingProxyType(
    {name: entry.formula for name, entry in _PRESETS.items()}
)
