"""`spike` on TensorFlow tensors and JAX arrays: the forward and the surrogate derivative
of `_formulas.surrogate`, under the framework's custom gradient.

Stochastic spikes take their U[0, 1) noise as `noise=`, an array of the input's shape (it gets
no gradient). Without it TensorFlow draws from its global generator, in the forward for a
sampled spike and in the backward for a leaky_relu spread, as the torch recipe draws from
torch's; JAX has no global random state, so on JAX arrays `noise=` is required (drawn by the
caller from a key: `jax.random.uniform(key, x.shape)`). A `torch.Generator` drives neither.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._errors import GradOverrideTypeError
from ..._ops import Backend
from .._formulas import surrogate as F
from .._surrogate import _canonical, _refuse_noise, spike
from .._surrogate_width import refuse_foreign

__all__ = ["CALLS", "TRANSFORMS"]

_FRAMEWORKS = {"TensorFlow": "tensorflow", "JAX": "jax"}


def _noise(b: Backend, recipe: spike, x: Any, noise: Any, generator: Any) -> Any:
    """The uniform noise a stochastic spike was given, checked (or None: draw it)."""
    hint = b.uniform_hint("x")
    if generator is not None:
        msg = (
            f"{recipe!r}: a torch.Generator cannot drive {b.name}'s random numbers; on "
            f"{b.name} arrays pass `noise=` (U[0, 1) samples of x's shape, e.g. `{hint}`)"
            + (", or neither to draw with TensorFlow's own." if b.global_random else ".")
        )
        raise GradOverrideTypeError(msg)
    if noise is None:
        if b.global_random:
            return None
        msg = (
            f"{recipe!r} on a {b.name} array needs `noise=`: {b.name} has no global random "
            "state to draw from. Pass U[0, 1) samples of x's shape drawn from a key, "
            f"`noise={hint}`, with a new key for each call (or step)."
        )
        raise GradOverrideTypeError(msg)
    problem = None
    try:
        noise = b.asarray(noise)
    except (TypeError, ValueError):
        problem = f"got {type(noise).__name__}"
    if problem is None:
        shape, wanted = b.static_shape(noise), b.static_shape(x)
        compatible = shape is None or wanted is None or (
            len(shape) == len(wanted)
            and all(m is None or n is None or m == n for m, n in zip(shape, wanted, strict=True))
        )
        if b.dtype_kind(noise) != "floating" or not compatible:
            problem = (
                f"got a {b.name} {b.dtype_name(noise)} tensor of shape {_shape_text(shape)} "
                f"for an input of shape {_shape_text(wanted)}"
            )
    if problem is not None:
        msg = (
            f"{recipe!r}: `noise` must be a floating tensor of U[0, 1) samples with the "
            f"input's shape; {problem}. Pass `noise={hint}`."
        )
        raise GradOverrideTypeError(msg)
    return noise


def _shape_text(shape: tuple[int | None, ...] | None) -> str:
    return "(unknown)" if shape is None else str(tuple(shape))


def _spike(b: Backend, recipe: spike, x: Any, noise: Any = None, generator: Any = None
           ) -> Any:
    if not isinstance(recipe.alpha, float):  # a torch tensor: a learned width
        refuse_foreign(recipe, _FRAMEWORKS.get(b.name, b.name))
    x = b.asarray(x)
    if not recipe.stochastic and (noise is not None or generator is not None):
        _refuse_noise(recipe)
    noise = _noise(b, recipe, x, noise, generator) if recipe.stochastic else None
    name = _canonical(recipe.surrogate)
    derivative = F.DERIVATIVES[name]
    probability = F.PROBABILITIES.get(name)
    center = recipe.center

    def forward(x: Any, *noise_given: Any) -> tuple[Any, Callable[..., Any]]:
        u = noise_given[0] if noise_given else None
        xc = x - center if center else x
        if recipe.sample:
            assert probability is not None  # the recipe refuses sample=True without one
            wide = b.compute_dtype(b.dtype(x))
            xw = b.cast(x, wide)  # cast, then centred: as the torch recipe's `probability`
            p = probability(b, xw - center if center else xw, recipe)
            drawn = b.uniform(x, wide) if u is None else b.cast(u, wide)
            out = F.sample(b, drawn, p, b.dtype(x))
        else:
            out = F.step(b, x, recipe.at_zero)

        def gradient(dy: Any) -> Any:
            dy = b.asarray(dy)
            if recipe.spread:
                drawn = b.uniform(x, b.dtype(x)) if u is None else b.cast(u, b.dtype(x))
                dx = F.leaky_relu(b, dy, xc, recipe, drawn)
            else:
                dx = derivative(b, dy, xc, recipe)
            return (dx, None) if noise_given else dx

        return out, gradient

    op = b.custom_gradient(forward)
    return op(x) if noise is None else op(x, noise)


CALLS: dict[type, Callable[..., Any]] = {spike: _spike}
TRANSFORMS: dict[type, Callable[..., Any]] = {}
