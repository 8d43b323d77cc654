"""A learned surrogate width: `spike` with a tensor `alpha` (typically an `nn.Parameter`),
whose backward gives alpha a gradient as well as x.

The forward is still the step, which does not depend on alpha; in the backward the
surrogate's smooth step sigma(x; alpha) (`spike.proxy`) stands in for the forward, for both
inputs: dL/dx = dL/dy * scale * d sigma/dx (the usual surrogate gradient) and dL/dalpha =
sum of dL/dy * scale * d sigma/dalpha over the elements alpha was broadcast to. This is the
Learnable Surrogate Gradient of Lian et al. (IJCAI 2023), and what autograd gives a
surrogate written as "forward = step, backward = derivative of a smooth sigma(x; alpha)".

Each surrogate's d sigma/dx and d sigma/dalpha are written out below (closed forms, no
autograd inside the rule, so the rule compiles and differentiates again like any torch
code). Most surrogates are sigma(x; a) = f(a x), whose width derivative is x f'(a x) =
x sg(x) / a; each is still written without the division by a, and where sg underflows to 0
so does its width term.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .._decorators import custom_backward
from .._errors import GradOverrideError, GradOverrideTypeError
from .._jit import refuse_scripting
from .._ops import foreign

if TYPE_CHECKING:
    from ._surrogate import spike

__all__ = [
    "WIDTH_SURROGATES",
    "LearnedAlphaSpike",
    "alpha_repr",
    "check_learned_alpha",
    "learned_gradient",
    "learned_spike",
    "refuse_foreign",
]

_SQRT_PI = math.sqrt(math.pi)

# Each formula takes the centred input x, alpha a (both in the compute dtype, a broadcast
# against x) and the recipe, and returns (sg, d sigma/d alpha) at scale 1.
_Formula = Callable[[Tensor, Tensor, "spike"], tuple[Tensor, Tensor]]


def _arctan(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = 1/2 + atan(pi a x / 2) / pi
    q = 1 + (x * a * (math.pi / 2)).square()
    return a / (2 * q), x / (2 * q)


def _sigmoid(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = sigmoid(a x); its two factors each computed directly (no 1 - s cancelling)
    ax = a * x
    both = torch.sigmoid(ax) * torch.sigmoid(-ax)
    return a * both, x * both


def _fast_sigmoid(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = 1/2 + (a x / 2) / (1 + a|x|)
    d = (1 + a * x.abs()).square()
    return a / (2 * d), x / (2 * d)


def _erf(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = 1/2 + erf(a x) / 2
    e = torch.exp(-(a * x).square()) / _SQRT_PI
    return a * e, x * e


def _triangle(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = a x - (a x)|a x| / 2 + 1/2 where |a x| < 1, else 0 or 1
    inside = torch.relu(1 - a * x.abs())
    return a * inside, x * inside


def _rectangular(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = a x + 1/2 inside |x| < h = 1/(2a); outside 1 + leak (x - h) or leak (x + h),
    # whose alpha derivative is sign(x) leak h / a
    leak = r.leak
    assert leak is not None
    h = 0.5 / a
    inside = x.abs() < h
    if leak == 0:
        return torch.where(inside, a, 0.0), torch.where(inside, x, 0.0)
    return (torch.where(inside, a, leak),
            torch.where(inside, x, torch.sign(x) * (leak * h / a)))


def _piecewise_exp(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = exp(a x) / 2 for x < 0, 1 - exp(-a x) / 2 for x >= 0
    e = torch.exp(-a * x.abs()) / 2
    return a * e, x * e


def _circ(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = 1/2 + (a x / 2) / sqrt(1 + (a x)^2); the root before the cube (no overflow)
    c = torch.rsqrt(1 + (a * x).square()).pow(3) / 2
    return a * c, x * c


def _q_pseudo_spike(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = w^(1-a) / 2 for x < 0, 1 - w^(1-a) / 2 for x >= 0, w = 1 + c|x|, c = 2/(a-1);
    # d sigma/da = -sign(x) w^(1-a) (c|x| / w - log w) / 2 (dc/da (1 - a) |x| = c|x|)
    cx = (2 / (a - 1)) * x.abs()
    log_w = torch.log1p(cx)
    width = torch.exp((1 - a) * log_w) * (cx / (1 + cx) - log_w) / 2
    return torch.exp(-a * log_w), -torch.sign(x) * width


def _s2nn(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = sigmoid(a x) for x < 0, 1/2 + beta log(1 + x) for x >= 0 (no alpha there)
    beta = r.beta
    assert beta is not None
    sg, width = _sigmoid(x, a, r)
    negative = x < 0
    return (torch.where(negative, sg, beta / (1 + x.abs())),
            torch.where(negative, width, 0.0))


def _squarewave_fourier(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = 1/2 + (2/pi) sum_i sin((2i - 1) a x) / (2i - 1)
    terms = r.terms
    assert terms is not None
    ax = a * x
    total = sum((torch.cos((2 * i - 1) * ax) for i in range(2, terms + 1)), torch.cos(ax))
    total = total * (2 / math.pi)
    return a * total, x * total


def _nonzero_sign_log_abs(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = sign(x) log(1 + a|x|)
    d = 1 / (1 + a * x.abs())
    return a * d, x * d


def _fake_numerical_gradient(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = a x where |x| <= 1/a, else sign(x) (1 + log(a|x|)): sg = min(a, 1/|x|)
    d = 1 / torch.clamp(a * x.abs(), min=1)
    return a * d, x * d


def _sparse_fast_sigmoid(x: Tensor, a: Tensor, r: spike) -> tuple[Tensor, Tensor]:
    # sigma = F(x) - F(bound) where x > bound, else 0, with F the fast sigmoid's step (as
    # `spike.proxy` has it): the alpha derivative of F(bound) is part of it
    bound = r.bound
    assert bound is not None
    sg, width = _fast_sigmoid(x, a, r)
    at_bound = bound / (2 * (1 + a * abs(bound)).square())
    above = x > bound
    return torch.where(above, sg, 0.0), torch.where(above, width - at_bound, 0.0)


_FORMULAS: dict[str, _Formula] = {
    "arctan": _arctan,
    "sigmoid": _sigmoid,
    "fast_sigmoid": _fast_sigmoid,
    "erf": _erf,
    "triangle": _triangle,
    "rectangular": _rectangular,
    "piecewise_exp": _piecewise_exp,
    "circ": _circ,
    "q_pseudo_spike": _q_pseudo_spike,
    "s2nn": _s2nn,
    "squarewave_fourier": _squarewave_fourier,
    "nonzero_sign_log_abs": _nonzero_sign_log_abs,
    "fake_numerical_gradient": _fake_numerical_gradient,
    "sparse_fast_sigmoid": _sparse_fast_sigmoid,
}

#: The surrogates (canonical names) whose formula has a width alpha can be learned in.
WIDTH_SURROGATES = frozenset(_FORMULAS)


def _compute_dtype(x: Tensor, alpha: Tensor) -> torch.dtype:
    """float32 at least (float16/bfloat16 inputs and widths), else the wider of the two."""
    return torch.promote_types(torch.promote_types(x.dtype, alpha.dtype), torch.float32)


def _parts(x: Tensor, alpha: Tensor, recipe: spike, surrogate: str
           ) -> tuple[Tensor, Tensor, torch.dtype]:
    dtype = _compute_dtype(x, alpha)
    xc = x.to(dtype)
    if recipe.center != 0:
        xc = xc - recipe.center
    sg, width = _FORMULAS[surrogate](xc, alpha.to(dtype), recipe)
    return sg, width, dtype


@custom_backward
def _spike_learned_alpha(x: Tensor, alpha: Tensor, recipe: spike, surrogate: str) -> Tensor:
    return recipe.step(x)


@_spike_learned_alpha.backward
def _(grad: Tensor, *, x: Tensor, alpha: Tensor, recipe: spike, surrogate: str) -> Any:
    sg, width, dtype = _parts(x, alpha, recipe, surrogate)
    g = grad.to(dtype)
    if recipe.scale != 1:
        g = g * recipe.scale
    grad_alpha = (g * width).sum_to_size(alpha.shape)  # summed in the compute dtype
    # alpha's own device too: a CPU 0-d alpha may scale a CUDA input, as torch ops allow
    return {"x": (g * sg).to(x.dtype),
            "alpha": grad_alpha.to(device=alpha.device, dtype=alpha.dtype)}


def learned_gradient(x: Tensor, alpha: Tensor, recipe: spike, surrogate: str) -> Tensor:
    """scale * sg(x - center) for a tensor alpha, in x's dtype (`spike.gradient`)."""
    _check_broadcast(recipe, x, alpha)
    sg, _, _ = _parts(x, alpha, recipe, surrogate)
    return (sg * recipe.scale).to(x.dtype)


def learned_spike(x: Tensor, alpha: Tensor, recipe: spike, surrogate: str) -> Tensor:
    """The spike with a tensor alpha: `recipe.step(x)`, with gradients for x and alpha."""
    _check_broadcast(recipe, x, alpha)
    result: Tensor = _spike_learned_alpha(x, alpha, recipe, surrogate)
    return result


def _check_broadcast(recipe: spike, x: Tensor, alpha: Tensor) -> None:
    """alpha must broadcast to x without enlarging it (its gradient is summed back to it)."""
    if not isinstance(x, Tensor):
        return  # the op's own check names the problem
    ok = alpha.dim() <= x.dim() and all(
        a == 1 or a == b for a, b in zip(reversed(alpha.shape), reversed(x.shape), strict=False)
    )
    if not ok:
        msg = (
            f"{recipe!r}: `alpha` of shape {tuple(alpha.shape)} does not broadcast to the "
            f"input's shape {tuple(x.shape)}; give one alpha (shape ()) or one per channel "
            "with 1 for the other axes (shape (C, 1, 1) for an (N, C, H, W) input)."
        )
        raise GradOverrideError(msg)


def check_learned_alpha(owner: str, surrogate: str, alpha: Tensor, sample: object) -> None:
    """Refuse a tensor alpha where it cannot be learned: a surrogate without a width, a
    sampled spike, a tensor that is not floating."""
    if surrogate not in WIDTH_SURROGATES:
        takers = ", ".join(repr(s) for s in _FORMULAS)
        msg = (
            f"{owner}: `alpha` cannot be learned (a tensor alpha or learn_alpha): the "
            f"surrogate {surrogate!r} has no width in its formula. Leave alpha out, or "
            f"learn it with one of {takers}."
        )
        raise GradOverrideError(msg)
    if not alpha.is_floating_point():
        msg = (
            f"{owner}: a tensor `alpha` must be floating (float32 for an nn.Parameter); got "
            f"{alpha.dtype}."
        )
        raise GradOverrideTypeError(msg)
    if sample is True:
        msg = (
            f"{owner}, sample=True: `alpha` cannot be learned (a tensor alpha or "
            "learn_alpha) for a sampled spike, whose forward draws from the probability "
            "alpha shapes; give a float alpha, or learn it with sample=False."
        )
        raise GradOverrideError(msg)


def refuse_foreign(recipe: object, framework: str) -> None:
    """The error for a learned (torch tensor) alpha with a TensorFlow or JAX input."""
    name, array = {"tensorflow": ("TensorFlow", "tensor"), "jax": ("JAX", "array")}.get(
        framework, (framework, "array"))
    msg = (
        f"{recipe!r} has a torch tensor `alpha` (a learned width), and its input is a "
        f"{name} {array}: a torch parameter cannot take {name}'s gradient. On {name} give a "
        "float alpha (or learn the width with torch tensors)."
    )
    raise GradOverrideError(msg)


def alpha_repr(alpha: Tensor) -> str:
    """A tensor alpha in a repr: its kind, shape and dtype, never its values (reading a GPU
    tensor's values waits for the GPU)."""
    kind = "Parameter" if isinstance(alpha, nn.Parameter) else "tensor"
    return f"<{kind} of shape {tuple(alpha.shape)}, {alpha.dtype}>"


class LearnedAlphaSpike(nn.Module):
    """The `nn.Module` form of `spike` with a learned width: `spike(...).module(learn_alpha=
    True)`. `forward(x)` is the spike with `self.alpha` (an `nn.Parameter`, initialised to
    the recipe's alpha: one value, or one per element of the shape `learn_alpha` gave) as
    its alpha; `state_dict` holds it as `alpha`."""

    def __init__(self, recipe: spike, surrogate: str, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.recipe = recipe
        self._surrogate = surrogate
        assert isinstance(recipe.alpha, float)
        self.alpha = nn.Parameter(torch.full(shape, recipe.alpha))

    def __prepare_scriptable__(self) -> nn.Module:
        # torch.jit.script calls this on every module it scripts.
        refuse_scripting(f"the module form of {self.recipe!r}")

    def forward(self, x: Tensor) -> Tensor:
        framework = None if isinstance(x, Tensor) else foreign(x)
        if framework is not None:
            refuse_foreign(self, framework)
        return learned_spike(x, self.alpha, self.recipe, self._surrogate)

    def extra_repr(self) -> str:
        return f"{self.recipe!r}, learn_alpha={tuple(self.alpha.shape) or True}"
