"""The shared recipes on TensorFlow tensors: torch-vs-TensorFlow parity of forward values and
gradients, in TensorFlow's three modes (eager, tf.function, jit_compile=True).

Each parity test runs the same recipe object on the same float32 inputs (values exactly at
window edges and their neighbours, 0 and -0, halves for the round-to-even ties, negatives,
large values) through torch and through TensorFlow, with the same non-uniform upstream
weighting (tf_support.gradients'), and compares both. The tolerance is a few float32 ulps:
the recipes are the same formulas in the same order, and what remains is TensorFlow's
`exp`/`sigmoid`/reductions against torch's (and TensorFlow's graph modes dividing the
weighting by a constant through its reciprocal). Also: half-precision dtypes are kept, the
gradient transforms work on TensorFlow gradients (dense and IndexedSlices), variables get
their gradients, and the recipes without a TensorFlow form say so.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tf_support import MODES, gradients, in_mode, tf

import gradoverride as go
from gradoverride.recipes import (
    SPIKE_PRESETS,
    SURROGATES,
    GradientTransform,
    _on_arrays,
    abs_subgradient,
    binarize,
    blackbox_solver,
    clip_grad_norm,
    clip_grad_value,
    ganin_ramp,
    gumbel_softmax,
    lsq,
    perturbed_optimizer,
    quantize,
    reverse_grad,
    rotation_trick,
    sanitize_grad,
    scale_grad,
    spike,
    ste_argmax,
    ste_ceil,
    ste_clamp,
    ste_floor,
    ste_round,
    ste_sign,
    ternarize,
)
from gradoverride.recipes._surrogate import _canonical

# A few float32 ulps: see the module docstring.
TOLERANCE = {"rtol": 2e-6, "atol": 1e-12}


def _f32(value: float) -> np.float32:
    return np.float32(value)


def _around(*edges: float) -> list[np.float32]:
    """Each edge and its float32 neighbours on both sides."""
    out = []
    for edge in edges:
        e = _f32(edge)
        out += [np.nextafter(e, _f32(-np.inf)), e, np.nextafter(e, _f32(np.inf))]
    return out


#: The shared input, shape (6, 8): 0 and -0; the window edges used below (±1, -0.5, 2, the
#: rectangular surrogate's 0.5) with their neighbours; round-half-to-even ties; negatives;
#: large values (the asymmetric quantizer's range then puts a code exactly at a tie).
X = np.array(
    [0.0, -0.0, 0.25, -0.25, 0.75, -0.75, 1.5, -1.5, 2.5, -2.5, 3.7, -7.2, 1e4, -1e4, 0.3,
     -0.3, 1e-3, -1e-3, 0.1, 0.125, 40.0, -40.0, -0.9, 5.0, 6.5, -3.0, 1e3,
     *_around(1.0, -1.0, -0.5, 2.0, 0.5, -2.0, 0.05)],
    dtype=np.float32,
).reshape(6, 8)

#: An upstream factor multiplied into the weighting: signs, zeros, large and small values,
#: so the gradient transforms see gradients of every kind.
UPSTREAM = np.array(
    [1.0, -1.0, 0.0, 4.0, -4.0, 0.25, -0.25, 100.0, -100.0, 1e-3, 2.0, -2.0, 7.5, -0.5, 3.0,
     -3.0] * 3,
    dtype=np.float32,
).reshape(6, 8)


# ---- the two frameworks side by side ---------------------------------------------------------


def _torch_gradients(fn: Callable[..., Any], *inputs: np.ndarray) -> tuple[Any, list[Any]]:
    """As tf_support.gradients, in torch: the output of `fn` and the gradients of
    sum(out * weights) with the same weighting, as numpy arrays."""
    leaves = [torch.tensor(a, requires_grad=True) for a in inputs]
    out = fn(*leaves)
    n = out.numel()
    weights = (torch.arange(1, n + 1, dtype=out.dtype) / n).reshape(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    return out.detach().numpy(), [g.numpy() for g in grads]


def _tf_gradients(
    fn: Callable[..., Any], *inputs: np.ndarray, mode: str
) -> tuple[Any, list[Any]]:
    out, grads = gradients(fn, *[tf.constant(a) for a in inputs], mode=mode)
    return out.numpy(), [g.numpy() for g in grads]


def assert_parity(
    call: Callable[..., Any],
    *inputs: np.ndarray,
    mode: str,
    upstream: np.ndarray | None = None,
    atol: float = TOLERANCE["atol"],
) -> None:
    """`call(*xs)` gives the same output and gradients in torch and in TensorFlow (`mode`).
    With `upstream`, the output is multiplied by it (so the recipe's upstream gradient is the
    weighting times `upstream`)."""
    tolerance = {**TOLERANCE, "atol": atol}

    def in_torch(*xs: Any) -> Any:
        out = call(*xs)
        return out if upstream is None else out * torch.tensor(upstream)

    def in_tf(*xs: Any) -> Any:
        out = call(*xs)
        return out if upstream is None else out * tf.constant(upstream)

    expected_out, expected_grads = _torch_gradients(in_torch, *inputs)
    out, grads = _tf_gradients(in_tf, *inputs, mode=mode)
    assert out.dtype == expected_out.dtype
    np.testing.assert_allclose(out, expected_out, err_msg="forward", **tolerance)
    for i, (got, expected) in enumerate(zip(grads, expected_grads, strict=True)):
        assert got.dtype == inputs[i].dtype
        np.testing.assert_allclose(got, expected, err_msg=f"gradient {i}", **tolerance)


# ---- parity: straight-through estimators -----------------------------------------------------

STE_RECIPES = [
    ste_round(),
    ste_floor(),
    ste_ceil(),
    ste_sign(),
    ste_clamp(-0.5, 2.0, outside="zero"),
    ste_clamp(-0.5, 2.0, outside="pass"),
    ste_clamp(-1.0, 1.0, outside="zero", keep="mask"),
    binarize(),
    binarize(clip=None),
    binarize(clip=(-0.5, 2.0), keep="mask"),
    binarize(inclusive=False),
    binarize(clip=(-0.5, 2.0), inclusive=(True, False), keep="mask"),
    ste_clamp(-0.5, 2.0, outside="zero", inclusive=(False, True)),
    ste_clamp.preset("torch.nn.functional.hardtanh", -1.0, 1.0, keep="mask"),
    abs_subgradient(),
    abs_subgradient(at_zero=0.0),
    abs_subgradient(at_zero=0.5),
    ternarize(),
    ternarize(delta_factor=0.05, scaled=False),
    quantize(),
    quantize(bits=3, bound=1.5),  # scale 0.5: x = ±0.25, ±0.75 are exact code ties
    quantize(bits=4, bound=2.0, keep="mask"),
    quantize(bits=3, symmetric=False),  # from x: its zero point is a tie (3.5 -> 4)
    quantize(bits=4, symmetric=False, bound=(-1.0, 3.0), keep="mask"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", STE_RECIPES, ids=repr)
def test_ste_parity(recipe: go.recipes.Recipe, mode: str) -> None:
    assert_parity(recipe, X, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("outside", "inclusive", "keep"),
    [("pass", True, "input"), ("zero", True, "input"), ("zero", False, "mask"),
     ("zero", (True, False), "input")],
)
@pytest.mark.parametrize("high_shape", [(6, 1), (2, 6, 8)], ids=["per-row", "wider"])
def test_ste_clamp_tensor_bounds_parity(
    outside: Any, inclusive: Any, keep: Any, high_shape: tuple[int, ...], mode: str
) -> None:
    """Tensor bounds: torch tensors for the torch recipe, TensorFlow tensors (a variable
    for one) for the TensorFlow one, broadcast against x (the wider bound makes the output
    wider than x: the gradient is summed back to x's shape)."""
    high = np.linspace(-0.5, 2.0, math.prod(high_shape), dtype=np.float32).reshape(high_shape)
    low = np.float32(-1.0)
    torch_recipe = ste_clamp(torch.tensor(low), torch.tensor(high), outside=outside,
                             inclusive=inclusive, keep=keep)
    tf_recipe = ste_clamp(tf.constant(low), tf.Variable(high), outside=outside,
                          inclusive=inclusive, keep=keep)

    def call(x: Any) -> Any:
        return torch_recipe(x) if isinstance(x, torch.Tensor) else tf_recipe(x)

    assert_parity(call, X, mode=mode)


def test_ste_clamp_bounds_of_the_other_framework_are_refused() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"`low` is a torch tensor, and the input "
                       r"a TensorFlow tensor; give TensorFlow tensors \(or numbers\)"):
        ste_clamp(torch.tensor(-1.0), 1.0, outside="pass")(tf.constant(X))
    with pytest.raises(go.GradOverrideTypeError, match=r"`high` is a TensorFlow tensor, and the "
                       r"input a torch tensor; give torch tensors \(or numbers\)"):
        ste_clamp(-1.0, tf.constant(1.0), outside="pass")(torch.tensor(X))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("recipe", "step_shape"),
    [(lsq(), ()), (lsq(bits=3, grad_scale=0.5), (6, 1)), (lsq(bits=4, signed=False), (1, 8)),
     (lsq(bits=3, window="rounded"), ()), (lsq(bits=3, window="closed"), (6, 1))],
    ids=repr,
)
def test_lsq_parity(recipe: lsq, step_shape: tuple[int, ...], mode: str) -> None:
    """The input's and the learned step's gradients (LSQ's, summed to the step's shape)."""
    step = np.full(step_shape, 0.37, dtype=np.float32)
    assert_parity(recipe, X, step, mode=mode)


# ---- parity: gradient flow -------------------------------------------------------------------

FLOW_RECIPES = [
    reverse_grad(),
    reverse_grad(scale=0.3),
    scale_grad(scale=2.5),
    scale_grad(scale=-1.0),
    clip_grad_value(clip_value=0.5),  # some upstream values are ±0.5: at the bound
    clip_grad_value(clip_value=0.0),
    clip_grad_norm(max_norm=1.0),
    clip_grad_norm(max_norm=0.5, dim=1, norm_type=math.inf),
    clip_grad_norm(max_norm=2.0, dim=(0,), norm_type=1.0, eps=1e-3),
    clip_grad_norm(max_norm=0.7, dim=-1, norm_type=3.0),
    sanitize_grad(),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", FLOW_RECIPES, ids=repr)
def test_flow_parity(recipe: GradientTransform, mode: str) -> None:
    assert_parity(recipe, X, mode=mode, upstream=UPSTREAM)


def _non_finite_upstream() -> np.ndarray:
    upstream = UPSTREAM.copy()
    upstream[0, :3] = [np.nan, np.inf, -np.inf]
    return upstream


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "recipe",
    [sanitize_grad(), sanitize_grad(nan=1.0, posinf=5.0, neginf=-6.0)],
    ids=repr,
)
def test_sanitize_parity_non_finite(recipe: sanitize_grad, mode: str) -> None:
    assert_parity(recipe, X, mode=mode, upstream=_non_finite_upstream())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "recipe",
    [reverse_grad(scale=ganin_ramp(total_steps=100)),
     scale_grad(scale=ganin_ramp(total_steps=7, gamma=3.0, max_scale=0.5))],
    ids=repr,
)
def test_scheduled_parity(recipe: GradientTransform, mode: str) -> None:
    """A schedule at `step=`: a Python int here, a TensorFlow step below."""
    assert_parity(lambda x: recipe(x, step=3), X, mode=mode, upstream=UPSTREAM)


def test_schedule_follows_a_step_variable_in_a_compiled_function() -> None:
    """The step is read each call, not frozen when the function was traced."""
    recipe = reverse_grad(scale=ganin_ramp(total_steps=10))
    counter = tf.Variable(0, dtype=tf.int64)
    x = tf.constant(X)

    @tf.function(jit_compile=True)
    def step() -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = recipe(x, step=counter)
        return tape.gradient(y, x)

    for count in (0, 4, 20):
        counter.assign(count)
        expected = float(recipe.factor(count))
        np.testing.assert_allclose(step().numpy(), np.full(X.shape, expected), rtol=1e-6)


def test_custom_schedule_gets_a_tensorflow_step() -> None:
    recipe = scale_grad(scale=lambda step: 1.0 / (tf.cast(step, tf.float32) + 1.0))
    _, (grad,) = gradients(lambda x: recipe(x, step=3), tf.constant(X[0]), mode="function")
    upstream = gradients(tf.identity, tf.constant(X[0]))[1][0]
    np.testing.assert_allclose(grad.numpy(), upstream.numpy() / 4, **TOLERANCE)


# ---- parity: spike and its surrogates --------------------------------------------------------

SPIKES = [spike(surrogate) for surrogate in SURROGATES] + [
    spike("arctan", alpha=1.7, scale=0.8, at_zero=0.5),
    spike("sigmoid", alpha=2.5, scale=1.5, at_zero=1.0),
    spike("fast_sigmoid", alpha=5.0, scale=0.25),
    spike("erf", alpha=0.7, scale=2.0, at_zero=1.0),
    spike("triangle", alpha=2.0, scale=0.5),  # zero at |x| = 0.5: an edge in X
    spike("rectangular", alpha=1.0, scale=3.0),  # the window |x| < 0.5, strict
    spike("rectangular", alpha=0.5),  # |x| < 1
    spike("piecewise_exp", alpha=0.3, scale=0.9, at_zero=0.25),
    spike("straight_through", scale=0.5),
    spike("rectangular", alpha=1.0, leak=0.2),  # the leak outside |x| < 0.5
    spike("circ", alpha=0.7, scale=3.0, center=0.25),
    spike("q_pseudo_spike", alpha=1.5, scale=2.0),
    spike("s2nn", alpha=2.0, beta=0.5, scale=1.5, at_zero=1.0),
    spike("squarewave_fourier", alpha=1.3, terms=3, scale=0.5),
    spike("nonzero_sign_log_abs", alpha=2.0, scale=0.5),
    spike("fake_numerical_gradient", alpha=0.5, scale=2.0),  # the cap ends at |x| = 2
    spike("log_tailed_relu", leak=0.2, scale=0.5),
    spike("leaky_relu", leak=0.1, scale=2.0, at_zero=1.0),
    spike("leaky_relu", leak=-0.3, at_zero=0.5),
    spike("sparse_fast_sigmoid", alpha=5.0, bound=-0.5, scale=0.4),
]

#: U[0, 1) noise for the stochastic spikes, the same in both frameworks.
NOISE = np.random.default_rng(3).random(X.shape, dtype=np.float32)


class _WithNoise:
    """`recipe(x, noise=NOISE)` in either framework (the noise is not an input: it gets no
    gradient)."""

    def __init__(self, recipe: spike) -> None:
        self.recipe = recipe

    def __call__(self, x: Any) -> Any:
        noise = torch.tensor(NOISE) if isinstance(x, torch.Tensor) else tf.constant(NOISE)
        return self.recipe(x, noise=noise)

    def __repr__(self) -> str:
        return f"{self.recipe!r} with noise"


STOCHASTIC_SPIKES = [
    _WithNoise(spike("circ", alpha=1.5, sample=True)),
    _WithNoise(spike("straight_through", sample=True)),  # p = x clipped to [0, 1]
    _WithNoise(spike("fast_sigmoid", center=0.5, sample=True)),
    _WithNoise(spike("q_pseudo_spike", alpha=3.0, sample=True)),
    _WithNoise(spike("leaky_relu", leak=0.1, spread=0.4, scale=2.0)),
]


def _spike_atol(recipe: spike) -> float:
    """The triangle's k - (k a)|x| cancels near its edge |x| = 1/a, where torch's
    `torch.sub(..., alpha=)` rounds once (a fused multiply-add) and TensorFlow rounds the
    product first: they differ there by an ulp of the peak k, not of the (tiny) result."""
    if _canonical(recipe.surrogate) == "triangle":
        return 4e-7 * recipe.scale * recipe.alpha  # type: ignore[operator]
    return TOLERANCE["atol"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", SPIKES, ids=repr)
def test_spike_parity(recipe: spike, mode: str) -> None:
    assert_parity(recipe, X, mode=mode, atol=_spike_atol(recipe))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", STOCHASTIC_SPIKES, ids=repr)
def test_stochastic_spike_parity_given_the_noise(recipe: _WithNoise, mode: str) -> None:
    assert_parity(recipe, X, mode=mode)


@pytest.mark.parametrize("name", sorted(SPIKE_PRESETS))
def test_spike_preset_parity(name: str) -> None:
    """Every library preset (with its default parameters), eagerly: a preset is a `spike`,
    whose three modes are checked above."""
    recipe = spike.preset(name)
    call = _WithNoise(recipe) if recipe.stochastic else recipe
    assert_parity(call, X, mode="eager", atol=_spike_atol(recipe))


@pytest.mark.parametrize("mode", MODES)
def test_stochastic_spike_draws_its_own_noise(mode: str) -> None:
    """Without `noise=`: TensorFlow's random numbers, spikes that are 0 or 1, the gradient
    the surrogate's (a sample's backward is deterministic)."""
    recipe = spike("circ", alpha=1.5, sample=True)
    out, (grad,) = gradients(recipe, tf.constant(X), mode=mode)
    assert set(np.unique(out.numpy())) <= {0.0, 1.0}
    _, (expected,) = gradients(spike("circ", alpha=1.5), tf.constant(X), mode=mode)
    np.testing.assert_allclose(grad.numpy(), expected.numpy(), **TOLERANCE)


def test_stochastic_spike_mistakes_on_tensorflow() -> None:
    x = tf.constant(X)
    with pytest.raises(go.GradOverrideTypeError, match=r"a torch\.Generator cannot drive"):
        spike("circ", sample=True)(x, generator=torch.Generator())
    with pytest.raises(go.GradOverrideTypeError, match=r"got a TensorFlow float32 tensor of "
                       r"shape \(3,\) for an input of shape \(6, 8\)"):
        spike("circ", sample=True)(x, noise=tf.zeros(3))
    with pytest.raises(go.GradOverrideTypeError, match="is deterministic: it takes no"):
        spike("circ")(x, noise=tf.constant(NOISE))


def test_every_surrogate_has_a_derivative_formula() -> None:
    from gradoverride.recipes._formulas.surrogate import DERIVATIVES

    assert {_canonical(s) for s in SURROGATES} == set(DERIVATIVES)


# ---- dtypes ----------------------------------------------------------------------------------

HALF_RECIPES = [
    ste_round(),
    ste_clamp(-0.5, 2.0, outside="zero"),
    binarize(keep="mask"),
    binarize(inclusive=False),
    abs_subgradient(),
    ternarize(),
    quantize(bits=8),
    quantize(bits=16, symmetric=False),  # codes beyond float16's range: float32 codes
    reverse_grad(scale=0.3),
    clip_grad_value(clip_value=1e6),  # a bound beyond float16's range clamps nothing
    clip_grad_norm(max_norm=1.0),
    sanitize_grad(),
    spike("fast_sigmoid"),
    spike("erf", at_zero=0.5),
    spike("circ"),
    spike("s2nn", beta=0.5),
    spike("squarewave_fourier", alpha=25.0, terms=2),  # computed in float32: no overflow
    spike("leaky_relu", leak=0.1),
]


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("recipe", HALF_RECIPES, ids=repr)
def test_half_precision_keeps_its_dtype(recipe: Any, dtype: Any) -> None:
    """Output and gradient in the input's dtype, and close to torch's (in the same dtype)."""
    x = X.clip(-100, 100)
    out, (grad,) = gradients(recipe, tf.constant(x, dtype=dtype), mode="eager")
    assert out.dtype == dtype and grad.dtype == dtype
    torch_dtype = getattr(torch, dtype.name)
    leaf = torch.tensor(x, dtype=torch_dtype, requires_grad=True)
    expected = recipe(leaf)
    n = expected.numel()
    weights = (torch.arange(1, n + 1, dtype=torch_dtype) / n).reshape(expected.shape)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), leaf)
    close = {"rtol": 1e-2, "atol": 1e-2}
    np.testing.assert_allclose(out.numpy().astype(np.float32),
                               expected.detach().float().numpy(), **close)
    np.testing.assert_allclose(grad.numpy().astype(np.float32), expected_grad.float().numpy(),
                               **close)


@pytest.mark.parametrize(("mode", "dtype"), [("function", tf.float16), ("xla", tf.bfloat16)],
                         ids=["function-float16", "xla-bfloat16"])
@pytest.mark.parametrize(
    "recipe",
    [quantize(bits=4, symmetric=False), spike("erf"), reverse_grad(scale=0.3),
     clip_grad_norm(max_norm=1.0)],
    ids=repr,
)
def test_half_precision_keeps_its_dtype_when_traced(recipe: Any, mode: str, dtype: Any) -> None:
    """As above, traced and compiled (with a plain sum: tf_support.gradients' weighting uses
    tf.range, which has no half-precision kernel in graph mode)."""

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = recipe(x)
            total = tf.reduce_sum(tf.cast(out, tf.float32))
        return out, tape.gradient(total, x)

    out, grad = in_mode(step, mode)(tf.constant(X.clip(-100, 100), dtype=dtype))
    assert out.dtype == dtype and grad.dtype == dtype


@pytest.mark.parametrize("mode", MODES)
def test_lsq_half_input_with_a_float32_step(mode: str) -> None:
    """x float16, step float32: computed in float32 (torch's promotion), each gradient in its
    own input's dtype, and torch's values. (tf_support.gradients' weighting uses tf.range,
    which has no float16 kernel in graph mode: a plain sum here.)"""
    x, step = tf.constant(X.clip(-10, 10), dtype=tf.float16), tf.constant(0.25)

    def tf_step(x: Any, step: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch([x, step])
            out = lsq(bits=4)(x, step)
            total = tf.reduce_sum(tf.cast(out, tf.float32))
        return (out, *tape.gradient(total, [x, step]))

    out, gx, gstep = in_mode(tf_step, mode)(x, step)
    assert (out.dtype, gx.dtype, gstep.dtype) == (tf.float16, tf.float16, tf.float32)
    leaves = (torch.tensor(x.numpy(), requires_grad=True), torch.tensor(0.25, requires_grad=True))
    expected = lsq(bits=4)(*leaves)
    expected_gx, expected_gstep = torch.autograd.grad(expected.float().sum(), leaves)
    np.testing.assert_array_equal(out.numpy(), expected.detach().numpy())
    np.testing.assert_array_equal(gx.numpy(), expected_gx.numpy())
    np.testing.assert_allclose(gstep.numpy(), expected_gstep.numpy(), rtol=1e-6)


# ---- gradient transforms on TensorFlow gradients ---------------------------------------------

TRANSFORMS = [
    reverse_grad(scale=0.3),
    clip_grad_value(clip_value=0.3),
    clip_grad_norm(max_norm=1.0, dim=1),
    sanitize_grad(posinf=9.0),
    reverse_grad(scale=0.5).module(),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", TRANSFORMS, ids=repr)
def test_transform_parity(recipe: Any, mode: str) -> None:
    grad = _non_finite_upstream() if isinstance(recipe, sanitize_grad) else UPSTREAM
    expected = recipe.transform(torch.tensor(grad)).numpy()
    got = in_mode(recipe.transform, mode)(tf.constant(grad)).numpy()
    np.testing.assert_allclose(got, expected, **TOLERANCE)


def test_scheduled_transform_takes_a_tensorflow_step() -> None:
    recipe = reverse_grad(scale=ganin_ramp(total_steps=50))
    expected = recipe.transform(torch.tensor(UPSTREAM), step=12).numpy()
    got = recipe.transform(tf.constant(UPSTREAM), step=tf.constant(12)).numpy()
    np.testing.assert_allclose(got, expected, **TOLERANCE)


@pytest.mark.parametrize("mode", MODES)
def test_clip_grad_value_gradient_stays_within_bounds(mode: str) -> None:
    bound = 0.4
    upstream = UPSTREAM * 1000
    _, (grad,) = gradients(
        lambda x: clip_grad_value(clip_value=bound)(x) * tf.constant(upstream),
        tf.constant(X), mode=mode,
    )
    grad = grad.numpy()
    assert np.all(np.abs(grad) <= _f32(bound))
    assert np.any(grad == _f32(bound)) and np.any(grad == -_f32(bound))


@given(
    values=st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=12),
    scale=st.floats(-4.0, 4.0, width=32),
)
@settings(max_examples=20, deadline=None)
def test_reverse_grad_negates(values: list[float], scale: float) -> None:
    """The gradient is exactly -scale times the upstream gradient; the forward is x."""
    x = tf.constant(values, dtype=tf.float32)
    upstream = gradients(tf.identity, x)[1][0].numpy()
    out, (grad,) = gradients(reverse_grad(scale=scale), x)
    np.testing.assert_array_equal(out.numpy(), x.numpy())
    np.testing.assert_array_equal(grad.numpy(), upstream * _f32(-scale))


# ---- IndexedSlices, variables, composition ---------------------------------------------------


#: Calls through which to test IndexedSlices: `call(x, const)`, `const` making a tensor of the
#: framework at hand (lsq takes its step as one).
GATHERED: dict[str, Callable[[Any, Callable[[Any], Any]], Any]] = {
    "reverse_grad": lambda x, const: reverse_grad(scale=2.0)(x),
    "ste_clamp": lambda x, const: ste_clamp(-0.5, 2.0, outside="zero")(x),
    "spike": lambda x, const: spike("erf")(x),
    "lsq": lambda x, const: lsq()(x, const(np.float32(0.37))),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(GATHERED))
def test_indexed_slices_upstream(name: str, mode: str) -> None:
    """The output fed to tf.gather: the upstream gradient arrives as IndexedSlices."""
    call = GATHERED[name]
    rows = [0, 2, 2, 5]
    expected_out, (expected,) = _torch_gradients(lambda x: call(x, torch.tensor)[rows], X)
    out, (grad,) = _tf_gradients(lambda x: tf.gather(call(x, tf.constant), rows), X, mode=mode)
    np.testing.assert_allclose(out, expected_out, **TOLERANCE)
    np.testing.assert_allclose(grad, expected, **TOLERANCE)


def test_transform_of_indexed_slices() -> None:
    grad = tf.IndexedSlices(tf.constant(UPSTREAM[:2]), tf.constant([1, 4]), tf.constant([6, 8]))
    dense = np.zeros((6, 8), np.float32)
    dense[[1, 4]] = UPSTREAM[:2]
    got = clip_grad_value(clip_value=0.3).transform(grad)
    np.testing.assert_array_equal(got.numpy(), np.clip(dense, -0.3, 0.3))


@pytest.mark.parametrize("mode", MODES)
def test_variables_get_their_gradients(mode: str) -> None:
    """A tf.Variable as the input and as lsq's learned step: read outside the custom
    gradient, so no `variables=` is needed, and both get the torch recipes' gradients."""
    x, step = tf.Variable(X), tf.Variable(0.37)

    def loss(a: Any, s: Any, total: Callable[[Any], Any]) -> Any:
        return total(ste_round()(a)) + total(lsq(bits=4)(a, s) * 3.0)

    def tf_step() -> Any:
        with tf.GradientTape() as tape:
            value = loss(x, step, tf.reduce_sum)
        return tape.gradient(value, [x, step])

    gx, gstep = in_mode(tf_step, mode)()
    leaves = (torch.tensor(X, requires_grad=True), torch.tensor(0.37, requires_grad=True))
    expected = torch.autograd.grad(loss(*leaves, torch.sum), leaves)
    np.testing.assert_allclose(gx.numpy(), expected[0].numpy(), **TOLERANCE)
    np.testing.assert_allclose(gstep.numpy(), expected[1].numpy(), rtol=1e-5)


def test_keras_variable_input() -> None:
    keras = pytest.importorskip("keras")
    w = keras.Variable(X)
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(binarize()(w))
    (grad,) = tape.gradient(y, [w.value])
    np.testing.assert_array_equal(grad.numpy(), (np.abs(X) <= 1).astype(np.float32))


def test_constant_scale_module_works_on_tensorflow() -> None:
    _, (grad,) = gradients(reverse_grad(scale=0.5).module(), tf.constant(X))
    upstream = gradients(tf.identity, tf.constant(X))[1][0]
    np.testing.assert_array_equal(grad.numpy(), upstream.numpy() * _f32(-0.5))


def test_user_gradient_transform_gets_a_tensorflow_gradient() -> None:
    @dataclasses.dataclass(frozen=True, repr=False)
    class triple_grad(GradientTransform):
        def transform(self, grad: Any) -> Any:
            return grad * 3

    _, (grad,) = gradients(triple_grad(), tf.constant(X), mode="xla")
    upstream = gradients(tf.identity, tf.constant(X), mode="xla")[1][0]
    np.testing.assert_array_equal(grad.numpy(), upstream.numpy() * 3)


# ---- sanitize_grad(mode="raise") ---------------------------------------------------------


def _raise_step(mode: str) -> Callable[[], Any]:
    recipe = sanitize_grad(mode="raise", name="h")
    upstream = tf.constant(_non_finite_upstream())
    x = tf.constant(X)

    def step() -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(recipe(x) * upstream)
        return tape.gradient(y, x)

    return in_mode(step, mode)


def test_sanitize_raise_eagerly_counts() -> None:
    with pytest.raises(
        go.GradOverrideError,
        match=re.escape("the gradient of `h` passing through sanitize_grad(mode='raise'")
        + r".* is not finite \(1 NaN and 2 infinite of 48 values\)\. Find the op .*"
        r"tf\.debugging\.enable_check_numerics\(\)",
    ):
        _raise_step("eager")()


def test_sanitize_raise_in_a_function_asserts() -> None:
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"the gradient of `h`.*not finite"):
        _raise_step("function")()


def test_sanitize_raise_under_xla_refuses_to_trace() -> None:
    with pytest.raises(go.GradOverrideError, match="cannot check a gradient inside a "
                       "jit_compile=True function: XLA compiles TensorFlow's assertions"):
        _raise_step("xla")()


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_sanitize_raise_passes_a_finite_gradient(mode: str) -> None:
    assert_parity(sanitize_grad(mode="raise"), X, mode=mode, upstream=UPSTREAM)


# ---- discrete choices ------------------------------------------------------------------------

_SCORES = np.array([[0.3, 1.2, -0.5, 0.9], [2.0, -1.0, 0.1, 1.9]], dtype=np.float32)
_GUMBEL = np.array([[0.1, -0.4, 1.3, 0.2], [-0.2, 0.5, 0.0, 0.7]], dtype=np.float32)
_CHOICE_UPSTREAM = np.array([[1.0, -2.0, 0.5, 3.0], [0.25, 1.0, -1.0, 2.0]], dtype=np.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", [ste_argmax(), ste_argmax(temperature=0.5),
                                    ste_argmax(backward="identity"), ste_argmax(dim=0)],
                         ids=repr)
def test_ste_argmax_matches_torch(recipe: Any, mode: str) -> None:
    # The softmax gradient subtracts sum(grad * p) from grad: where they nearly cancel, the
    # few-ulp differences of TensorFlow's exp (and XLA's) show in absolute terms only.
    assert_parity(recipe, _SCORES, mode=mode, upstream=_CHOICE_UPSTREAM, atol=1e-7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", [gumbel_softmax(), gumbel_softmax(temperature=0.3),
                                    gumbel_softmax(hard=False)], ids=repr)
def test_gumbel_softmax_with_given_noise_matches_torch(recipe: Any, mode: str) -> None:
    # The same draws on both sides; the noise gets x's gradient, as on torch.
    assert_parity(lambda x, noise: recipe(x, noise=noise), _SCORES, _GUMBEL, mode=mode,
                  upstream=_CHOICE_UPSTREAM, atol=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_gumbel_softmax_draws_finite_noise_and_gradients(mode: str) -> None:
    # Its own draws: a one-hot sample; at a tiny temperature and in float16 no NaN appears.
    tf.random.set_seed(0)
    for dtype, temperature in ((tf.float32, 1e-8), (tf.float16, 0.1)):
        x = tf.constant(_SCORES, dtype)

        def step(x: Any, temperature: float = temperature) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = gumbel_softmax(temperature=temperature)(x)
                loss = tf.reduce_sum(y * tf.cast(_CHOICE_UPSTREAM, x.dtype))
            return y, tape.gradient(loss, x)

        y, g = in_mode(step, mode)(x)
        assert y.dtype == dtype and g.dtype == dtype
        np.testing.assert_array_equal(tf.reduce_sum(y, axis=-1).numpy(), [1, 1])
        assert np.isfinite(g.numpy()).all()


def test_gumbel_softmax_refuses_a_torch_generator_on_tensorflow() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"`generator` is a torch.Generator, "
                       r"which cannot draw TensorFlow noise; seed TensorFlow"):
        gumbel_softmax()(tf.constant(_SCORES), generator=torch.Generator())


# ---- errors ----------------------------------------------------------------------------------

_SUPPORTED_LIST = re.escape(", ".join(_on_arrays.SUPPORTED))


@pytest.mark.parametrize(
    ("recipe", "name"),
    [
        (blackbox_solver(lambda w: w, lambda_=1.0), "blackbox_solver"),
        (perturbed_optimizer(lambda w: w), "perturbed_optimizer"),
        (lsq().module(), "LearnedStepQuantizer"),
        (reverse_grad(scale=ganin_ramp(total_steps=10)).module(),
         "ScaledGradientModule with a schedule"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_unsupported_recipes_say_so(recipe: Any, name: str) -> None:
    with pytest.raises(
        go.GradOverrideTypeError,
        match=rf"^{name} supports torch tensors only; got a TensorFlow EagerTensor as its "
        rf"input \(.+\)\. The recipes that support TensorFlow tensors and JAX arrays are: "
        rf"{_SUPPORTED_LIST}\. "
        rf"Use one of them, or run {name} on torch tensors\.$",
    ):
        recipe(tf.constant(X))


def test_rotation_trick_says_it_has_no_tensorflow_form() -> None:
    with pytest.raises(go.GradOverrideTypeError,
                       match=r"^rotation_trick supports torch tensors only; got a TensorFlow "
                             r"EagerTensor as its input \(its rotation has no form on these "
                             r"arrays yet\)\."):
        rotation_trick()(tf.constant(X), tf.constant(X))


def test_supported_list_names_recipes_with_a_tensorflow_form() -> None:
    tables = _on_arrays._CALLS
    for name in _on_arrays.SUPPORTED:
        recipe_class = getattr(go.recipes, name)
        assert any(issubclass(recipe_class, key) for key in tables), name


def test_lsq_step_must_be_a_tensorflow_tensor() -> None:
    with pytest.raises(go.GradOverrideTypeError,
                       match=r"`step` must be a TensorFlow tensor or variable .* got float 0\.5"):
        lsq()(tf.constant(X), 0.5)


def test_schedule_errors_are_the_torch_recipes() -> None:
    with pytest.raises(go.GradOverrideError, match="needs the step count"):
        reverse_grad(scale=ganin_ramp(total_steps=10))(tf.constant(X))
    with pytest.raises(go.GradOverrideTypeError, match="has a constant scale, so it takes no"):
        reverse_grad(scale=0.5)(tf.constant(X), step=3)


def test_torch_tensor_scale_is_refused() -> None:
    with pytest.raises(go.GradOverrideTypeError,
                       match="has a torch tensor as its `scale` and got a TensorFlow tensor"):
        scale_grad(scale=torch.tensor(0.5))(tf.constant(X))


def test_gradient_transform_takes_one_tensor() -> None:
    with pytest.raises(TypeError, match="takes one tensor; got 2 positional"):
        clip_grad_value(clip_value=1.0)(tf.constant(X), 3)


@pytest.mark.parametrize(
    "recipe", [binarize(), ste_round(), ternarize(), quantize(bits=4)], ids=repr
)
@pytest.mark.parametrize("dtype", ["int32", "int64", "bool"])
def test_integer_tensorflow_inputs_are_refused_as_on_torch(recipe: Any, dtype: str) -> None:
    x = tf.cast(tf.constant([1, 0, 2]), dtype)
    message = rf"`x` must be a floating-point tensor.*{dtype}"
    with pytest.raises(go.GradOverrideTypeError, match=message):
        recipe(x)


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_ste_clamp_with_a_tensor_bound_compiles_with_tensorflow_imported() -> None:
    # TensorFlow is imported here: asking whether the number bound is a TensorFlow tensor
    # reads its type's module name, which dynamo cannot trace (it once broke the graph).
    assert "tensorflow" in __import__("sys").modules

    def loss(x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        return ste_clamp(low, 1.0, outside="zero")(x).sum()

    torch._dynamo.reset()
    try:
        compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
        x = torch.tensor([-2.0, 0.5, 1.0, 3.0], requires_grad=True)
        (got,) = torch.autograd.grad(compiled(x, torch.tensor(-1.0)), x)
    finally:
        torch._dynamo.reset()
    assert got.tolist() == [0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("recipe", [clip_grad_value, clip_grad_norm])
def test_a_torch_scaler_on_a_tensorflow_gradient_is_refused(recipe: Any) -> None:
    clip = recipe(1.0, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(go.GradOverrideError, match=rf"{recipe.__name__}\(scaler=\.\.\.\) got "
                       r"torch's GradScaler, and this gradient is TensorFlow's.*Keras mixed "
                       r"precision give .*LossScaleOptimizer"):
        clip(tf.constant([1.0, 2.0]))
