"""`spike` on JAX arrays: every surrogate's forward and gradient equal the torch recipe's on
the same inputs (float32 tolerance), eagerly, under `jax.jit`, `jax.grad` and `jax.vmap`;
a few against a hand-written `jax.custom_vjp` of the closed-form surrogate; sampled spikes and
the noisy leaky_relu with `noise=`; and the mistakes, with their messages.

Without JAX the module skips, unless `GRADOVERRIDE_REQUIRE_JAX=1`, where a missing JAX is an
import error.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest
import torch

if os.environ.get("GRADOVERRIDE_REQUIRE_JAX") == "1":
    import jax
else:
    jax = pytest.importorskip(
        "jax", reason="JAX is not installed (pip install 'gradoverride[jax]')"
    )
import jax.numpy as jnp

from gradoverride import GradOverrideError, GradOverrideTypeError
from gradoverride.recipes import SPIKE_PRESETS, SURROGATES, spike
from gradoverride.recipes._surrogate import _canonical

X = np.array(
    [0.0, -0.0, 0.25, -0.25, 0.75, -0.75, 1.5, -1.5, 2.5, -2.5, 3.7, -7.2, 1e4, -1e4, 0.3,
     -0.3, 1e-3, -1e-3, 0.1, 0.125, 40.0, -40.0, -0.9, 5.0, 6.5, -3.0, 1e3, 0.5, -0.5, 1.0,
     -1.0, 2.0, -2.0, 0.05, 0.4999, -0.5001, 0.9999, -1.0001, 1.2, -0.2],
    dtype=np.float32,
).reshape(5, 8)
#: The upstream gradient: distinct weights, so a gradient in the wrong place shows.
WEIGHTS = (np.arange(1, X.size + 1, dtype=np.float32) / X.size).reshape(X.shape)
NOISE = np.random.default_rng(3).random(X.shape, dtype=np.float32)

SPIKES = [spike(surrogate) for surrogate in SURROGATES] + [
    spike("arctan", alpha=1.7, scale=0.8, at_zero=0.5),
    spike("sigmoid", alpha=2.5, scale=1.5, at_zero=1.0),
    spike("fast_sigmoid", alpha=5.0, scale=0.25),
    spike("erf", alpha=0.7, scale=2.0, at_zero=1.0),
    spike("triangle", alpha=2.0, scale=0.5),
    spike("rectangular", alpha=1.0, scale=3.0),
    spike("rectangular", alpha=0.5),
    spike("rectangular", alpha=1.0, leak=0.2),
    spike("piecewise_exp", alpha=0.3, scale=0.9, at_zero=0.25),
    spike("straight_through", scale=0.5),
    spike("circ", alpha=0.7, scale=3.0, center=0.25),
    spike("q_pseudo_spike", alpha=1.5, scale=2.0),
    spike("s2nn", alpha=2.0, beta=0.5, scale=1.5, at_zero=1.0),
    spike("s2nn", beta=0.0),
    spike("squarewave_fourier", alpha=1.3, terms=3, scale=0.5),
    spike("nonzero_sign_log_abs", alpha=2.0, scale=0.5),
    spike("fake_numerical_gradient", alpha=0.5, scale=2.0),
    spike("log_tailed_relu", leak=0.2, scale=0.5),
    spike("leaky_relu", leak=0.1, scale=2.0, at_zero=1.0),
    spike("leaky_relu", leak=-0.3, at_zero=0.5),
    spike("sparse_fast_sigmoid", alpha=5.0, bound=-0.5, scale=0.4),
]

STOCHASTIC = [
    spike("circ", alpha=1.5, sample=True),
    spike("straight_through", sample=True),
    spike("fast_sigmoid", center=0.5, sample=True),
    spike("q_pseudo_spike", alpha=3.0, sample=True),
    spike("arctan", sample=True),
    spike("erf", sample=True),
    spike("triangle", alpha=2.0, sample=True),
    spike("piecewise_exp", sample=True),
    spike("rectangular", sample=True),
    spike("sigmoid", sample=True),
    spike("leaky_relu", leak=0.1, spread=0.4, scale=2.0),
    spike("leaky_relu", leak=0.1, spread=0.4, at_zero=0.5),
]


def _atol(recipe: spike) -> float:
    """The triangle's k - (k a)|x| cancels near its edge |x| = 1/a, where torch fuses the
    multiply-add (one rounding) and JAX eagerly rounds the product first: they differ there
    by an ulp of the peak k, not of the (tiny) result."""
    if _canonical(recipe.surrogate) == "triangle":
        return 4e-7 * recipe.scale * recipe.alpha  # type: ignore[operator]
    return 1e-12


def _torch(recipe: spike, x: np.ndarray, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    leaf = torch.tensor(x, requires_grad=True)
    out = recipe(leaf, **{k: torch.tensor(v) for k, v in kwargs.items()})
    (grad,) = torch.autograd.grad(out, leaf, torch.tensor(WEIGHTS).reshape(out.shape))
    return out.detach().numpy(), grad.numpy()


def _jax(recipe: spike, x: Any, mode: str, **kwargs: Any) -> tuple[Any, Any]:
    kwargs = {k: jnp.asarray(v) for k, v in kwargs.items()}

    def loss(t: Any) -> Any:
        return (recipe(t, **kwargs) * jnp.asarray(WEIGHTS).reshape(t.shape)).sum()

    def both(t: Any) -> tuple[Any, Any]:
        return recipe(t, **kwargs), jax.grad(loss)(t)

    return jax.jit(both)(x) if mode == "jit" else both(x)


def _close(got: Any, expected: np.ndarray, atol: float = 1e-12) -> None:
    np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-6, atol=atol)


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("recipe", SPIKES, ids=repr)
def test_spike_on_jax_equals_torch(recipe: spike, mode: str) -> None:
    out, grad = _jax(recipe, jnp.asarray(X), mode)
    expected_out, expected_grad = _torch(recipe, X)
    assert out.dtype == jnp.float32 and grad.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), expected_out)
    _close(grad, expected_grad, _atol(recipe))


@pytest.mark.parametrize("name", sorted(SPIKE_PRESETS))
def test_every_preset_on_jax_equals_torch(name: str) -> None:
    recipe = spike.preset(name)
    kwargs = {"noise": NOISE} if recipe.stochastic else {}
    out, grad = _jax(recipe, jnp.asarray(X), "eager", **kwargs)
    expected_out, expected_grad = _torch(recipe, X, **kwargs)
    np.testing.assert_array_equal(np.asarray(out), expected_out)
    _close(grad, expected_grad, _atol(recipe))


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("recipe", STOCHASTIC, ids=repr)
def test_stochastic_spike_with_noise_equals_torch(recipe: spike, mode: str) -> None:
    out, grad = _jax(recipe, jnp.asarray(X), mode, noise=NOISE)
    expected_out, expected_grad = _torch(recipe, X, noise=NOISE)
    np.testing.assert_array_equal(np.asarray(out), expected_out)
    _close(grad, expected_grad, _atol(recipe))


# ---- against independent computations ------------------------------------------------------


def _reference(sg: Any) -> Any:
    """A spike (H(0) = 0) whose backward is sg, as a user would write it in JAX."""

    @jax.custom_vjp
    def step(x: Any) -> Any:
        return (x > 0).astype(x.dtype)

    def forward(x: Any) -> tuple[Any, Any]:
        return step(x), x

    def backward(x: Any, g: Any) -> tuple[Any]:
        return (g * sg(x),)

    step.defvjp(forward, backward)
    return step


REFERENCES = {
    "arctan": (spike("arctan", alpha=1.7),
               lambda x: (1.7 / 2) / (1 + (math.pi * 1.7 * x / 2) ** 2)),
    "sigmoid": (spike("sigmoid", alpha=2.5),
                lambda x: 2.5 * jax.nn.sigmoid(2.5 * x) * jax.nn.sigmoid(-2.5 * x)),
    "fast_sigmoid": (spike("fast_sigmoid", alpha=5.0),
                     lambda x: (5.0 / 2) / (1 + 5.0 * jnp.abs(x)) ** 2),
    "erf": (spike("erf", alpha=0.7, scale=2.0),
            lambda x: 2.0 * 0.7 / math.sqrt(math.pi) * jnp.exp(-((0.7 * x) ** 2))),
    "circ": (spike("circ", alpha=0.7),
             lambda x: (0.7 / 2) * (1 + (0.7 * x) ** 2) ** -1.5),
    "piecewise_exp": (spike("piecewise_exp", alpha=0.3),
                      lambda x: (0.3 / 2) * jnp.exp(-0.3 * jnp.abs(x))),
}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_gradient_equals_a_hand_written_custom_vjp(name: str) -> None:
    recipe, sg = REFERENCES[name]
    reference = _reference(sg)
    x = jnp.asarray(X.clip(-100, 100))  # the closed forms overflow beyond (the recipe's don't)
    w = jnp.asarray(WEIGHTS)
    got = jax.jit(jax.grad(lambda t: (recipe(t) * w).sum()))(x)
    expected = jax.grad(lambda t: (reference(t) * w).sum())(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-10)


def test_sampled_spike_is_the_noise_below_the_smooth_step() -> None:
    """circ's probability in float64 numpy: 1/2 + u / (2 sqrt(1 + u^2)), u = a x."""
    x = X.clip(-100, 100)
    u = 1.5 * x.astype(np.float64)
    p = 0.5 + u / (2 * np.sqrt(1 + u * u))
    margin = np.abs(NOISE - p) > 1e-6  # away from ties, where float32 rounding decides
    out = spike("circ", alpha=1.5, sample=True)(jnp.asarray(x), noise=jnp.asarray(NOISE))
    np.testing.assert_array_equal(np.asarray(out)[margin], (p > NOISE).astype(np.float32)[margin])
    assert margin.mean() > 0.9


def test_sampled_gradient_is_the_surrogate() -> None:
    x, w = jnp.asarray(X), jnp.asarray(WEIGHTS)
    sampled = jax.grad(lambda t: (spike("circ", sample=True)(t, noise=NOISE) * w).sum())(x)
    plain = jax.grad(lambda t: (spike("circ")(t) * w).sum())(x)
    np.testing.assert_array_equal(np.asarray(sampled), np.asarray(plain))


# ---- transforms --------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [spike("arctan"), spike("s2nn", beta=0.5),
                                    spike("leaky_relu", leak=0.1, at_zero=0.5)], ids=repr)
def test_vmap_of_grad_equals_torch_row_by_row(recipe: spike) -> None:
    def row_grad(t: Any) -> Any:
        return jax.grad(lambda r: (recipe(r) * jnp.arange(1.0, 9.0)).sum())(t)

    got = jax.jit(jax.vmap(row_grad))(jnp.asarray(X))
    for i, row in enumerate(X):
        leaf = torch.tensor(row, requires_grad=True)
        (recipe(leaf) * torch.arange(1.0, 9.0)).sum().backward()
        assert leaf.grad is not None
        _close(got[i], leaf.grad.numpy())


def test_vmap_with_batched_noise() -> None:
    recipe = spike("leaky_relu", leak=0.1, spread=0.4)

    def row_grad(t: Any, u: Any) -> Any:
        return jax.grad(lambda r: recipe(r, noise=u).sum())(t)

    got = jax.vmap(row_grad)(jnp.asarray(X), jnp.asarray(NOISE))
    for i in range(X.shape[0]):
        leaf = torch.tensor(X[i], requires_grad=True)
        recipe(leaf, noise=torch.tensor(NOISE[i])).sum().backward()
        assert leaf.grad is not None
        _close(got[i], leaf.grad.numpy())


def test_noise_gets_no_gradient() -> None:
    recipe = spike("leaky_relu", spread=0.4)
    grad = jax.grad(lambda u: recipe(jnp.asarray(X), noise=u).sum())(jnp.asarray(NOISE))
    np.testing.assert_array_equal(np.asarray(grad), np.zeros_like(NOISE))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("recipe", [spike("fast_sigmoid"), spike("erf", at_zero=0.5),
                                    spike("circ"), spike("s2nn", beta=0.5),
                                    spike("squarewave_fourier", alpha=25.0, terms=2),
                                    spike("circ", sample=True)], ids=repr)
def test_half_precision_keeps_its_dtype(recipe: spike, dtype: str) -> None:
    x = X.clip(-100, 100)
    kwargs = {"noise": NOISE} if recipe.stochastic else {}
    out, grad = _jax(recipe, jnp.asarray(x, dtype=dtype), "eager", **kwargs)
    assert out.dtype == jnp.dtype(dtype) and grad.dtype == jnp.dtype(dtype)
    leaf = torch.tensor(x, dtype=getattr(torch, dtype), requires_grad=True)
    expected = recipe(leaf, **{k: torch.tensor(v) for k, v in kwargs.items()})
    weights = torch.tensor(WEIGHTS, dtype=leaf.dtype)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), leaf)
    close = {"rtol": 1e-2, "atol": 1e-2}
    np.testing.assert_allclose(np.asarray(out, np.float32), expected.detach().float().numpy(),
                               **close)
    np.testing.assert_allclose(np.asarray(grad, np.float32), expected_grad.float().numpy(),
                               **close)


# ---- mistakes -----------------------------------------------------------------------------------


def test_a_stochastic_spike_needs_noise_on_jax() -> None:
    x = jnp.asarray(X)
    for recipe in (spike("circ", sample=True), spike("leaky_relu", spread=0.4)):
        with pytest.raises(GradOverrideTypeError,
                           match=r"on a JAX array needs `noise=`: JAX has no global random "
                                 r"state.*`noise=jax\.random\.uniform\(key, x\.shape\)`"):
            recipe(x)


def test_noise_mistakes_on_jax() -> None:
    x = jnp.asarray(X)
    with pytest.raises(GradOverrideTypeError,
                       match=r"a torch\.Generator cannot drive JAX's random numbers.*"
                             r"jax\.random\.uniform\(key, x\.shape\)"):
        spike("circ", sample=True)(x, generator=torch.Generator())
    with pytest.raises(GradOverrideTypeError,
                       match=r"`noise` must be a floating tensor .* got a JAX float32 tensor "
                             r"of shape \(3,\) for an input of shape \(5, 8\)"):
        spike("circ", sample=True)(x, noise=jnp.zeros(3))
    with pytest.raises(GradOverrideTypeError, match=r"got a JAX int32 tensor of shape"):
        spike("circ", sample=True)(x, noise=jnp.zeros(X.shape, jnp.int32))
    with pytest.raises(GradOverrideTypeError, match="is deterministic: it takes no"):
        spike("circ")(x, noise=jnp.asarray(NOISE))


def test_a_learned_alpha_is_refused_on_jax() -> None:
    alpha = torch.nn.Parameter(torch.tensor(2.0))
    with pytest.raises(GradOverrideError,
                       match=r"has a torch tensor `alpha` \(a learned width\), and its input "
                             r"is a JAX array: a torch parameter cannot take JAX's gradient"):
        spike("arctan", alpha=alpha)(jnp.asarray(X))
    module = spike("arctan").module(learn_alpha=True)
    with pytest.raises(GradOverrideError, match=r"its input is a JAX array"):
        module(jnp.asarray(X))
