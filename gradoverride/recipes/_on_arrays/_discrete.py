"""The discrete-choice recipes on TensorFlow tensors and JAX arrays: `ste_argmax` and
`gumbel_softmax`, their formulas those of the torch recipes
(`gradoverride.recipes._formulas.discrete`) under `b.custom_gradient`.

The noise of `gumbel_softmax`: TensorFlow draws it from its global generator (seed it with
`tf.random.set_seed`), as uniform draws turned into Gumbel ones; JAX has no global generator,
so on JAX the draws are an argument, `noise=jax.random.gumbel(key, x.shape)`. A
`torch.Generator` draws no noise for either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._errors import GradOverrideError, GradOverrideTypeError
from ..._ops import Backend, foreign
from .._discrete import gumbel_softmax, ste_argmax
from .._formulas import discrete

__all__ = ["CALLS", "TRANSFORMS"]

#: Gumbel draws shaped like the scores `x`, in each framework.
_GUMBEL_HINT = {
    "TensorFlow": "-tf.math.log(-tf.math.log(tf.random.uniform(tf.shape(x))))",
    "JAX": "jax.random.gumbel(key, x.shape)",
}


def _check_scores(b: Backend, recipe: Any, x: Any) -> None:
    from . import check_floating

    check_floating(b, recipe, x)
    shape = b.static_shape(x)
    if shape is None:
        return  # a TensorFlow rank unknown while tracing: checked where it runs
    rank = max(len(shape), 1)
    if not -rank <= recipe.dim < rank:
        msg = (
            f"{recipe!r} got a tensor with {len(shape)} dimensions (shape {shape}), so "
            f"`dim={recipe.dim}` is out of range; pass a dim in [{-rank}, {rank - 1}]."
        )
        raise GradOverrideError(msg)
    if shape and shape[recipe.dim] == 0:
        msg = (
            f"{recipe!r} got a tensor with no entries along dim {recipe.dim} (shape "
            f"{shape}); there is nothing to choose from."
        )
        raise GradOverrideError(msg)


def _ste_argmax(b: Backend, recipe: ste_argmax, x: Any) -> Any:
    x = b.asarray(x)
    _check_scores(b, recipe, x)
    dim, temperature = recipe.dim, recipe.temperature

    @b.custom_gradient
    def op(x: Any) -> Any:
        dtype = b.dtype(x)
        out = discrete.one_hot_argmax(b, x, dim, dtype)

        def gradient(grad: Any) -> Any:
            grad = b.asarray(grad)
            if recipe.backward == "identity":
                return grad
            # In float32 for half inputs; p recomputed from x (only x is kept).
            soft = discrete.tempered_softmax(
                b, b.cast(x, b.compute_dtype(dtype)), dim, temperature
            )
            return b.cast(discrete.softmax_grad(b, grad, soft, dim, temperature), dtype)

        return out, gradient

    return op(x)


def _check_noise(b: Backend, recipe: gumbel_softmax, x: Any, noise: Any) -> Any:
    if noise is None:
        if b.global_random:
            return None
        msg = (
            f"{recipe!r} on a {b.name} array needs its Gumbel draws as `noise=`: {b.name} has "
            "no global random generator for the recipe to draw from. Pass "
            "`noise=jax.random.gumbel(key, x.shape)` with a key you split per call."
        )
        raise GradOverrideError(msg)
    if foreign(noise) != foreign(x) or b.dtype_kind(noise) != "floating":
        msg = (
            f"{recipe!r}: `noise` must be a floating-point {b.name} array of Gumbel draws "
            f"shaped like the scores; got {type(noise).__name__}."
        )
        raise GradOverrideTypeError(msg)
    noise = b.asarray(noise)
    shape, noise_shape = b.static_shape(x), b.static_shape(noise)
    if (
        shape is not None and noise_shape is not None and None not in shape + noise_shape
        and shape != noise_shape
    ):
        msg = (
            f"{recipe!r}: `noise` must have the scores' shape {shape}; got {noise_shape}. "
            f"Draw one value per score: `{_GUMBEL_HINT.get(b.name, '')}`."
        )
        raise GradOverrideError(msg)
    return noise


def _gumbel_softmax(
    b: Backend, recipe: gumbel_softmax, x: Any, *, generator: Any = None, noise: Any = None
) -> Any:
    x = b.asarray(x)
    _check_scores(b, recipe, x)
    if generator is not None:
        msg = (
            f"{recipe!r}: `generator` is a torch.Generator, which cannot draw {b.name} noise; "
            + ("seed TensorFlow (`tf.random.set_seed`) or pass the draws as `noise=`."
               if b.global_random else
               "pass the draws as `noise=jax.random.gumbel(key, x.shape)`.")
        )
        raise GradOverrideTypeError(msg)
    dim, temperature, hard = recipe.dim, recipe.temperature, recipe.hard
    work = b.compute_dtype(b.dtype(x))
    noise = _check_noise(b, recipe, x, noise)
    if noise is None:  # drawn in the work dtype from the global generator
        noise = discrete.gumbel_from_uniform(b, b.uniform(x, work))

    @b.custom_gradient
    def op(x: Any, noise: Any) -> Any:
        scores = b.cast(x, work) + b.cast(noise, work)
        soft = discrete.tempered_softmax(b, scores, dim, temperature)
        dtype = b.dtype(x)
        out = discrete.one_hot_argmax(b, soft, dim, dtype) if hard else b.cast(soft, dtype)

        def gradient(grad: Any) -> Any:
            g = discrete.softmax_grad(b, b.asarray(grad), soft, dim, temperature)
            # The scores are x + noise, so the noise gets x's gradient (in its own dtype).
            return b.cast(g, dtype), b.cast(g, b.dtype(noise))

        return out, gradient

    return op(x, noise)


#: recipe class -> implementation(b, recipe, x, *args, **kwargs)
CALLS: dict[type, Callable[..., Any]] = {
    ste_argmax: _ste_argmax,
    gumbel_softmax: _gumbel_softmax,
}
#: recipe class -> implementation(b, recipe, grad, **kwargs)
TRANSFORMS: dict[type, Callable[..., Any]] = {}
