"""The gradient-flow and discrete-choice recipes on JAX arrays.

Each recipe on JAX arrays (eagerly, under `jax.jit`, `jax.grad`, `jax.vmap`) is compared
with the torch recipe on the same float32 inputs (values and gradients; tolerance 1e-6
relative: the same float32 arithmetic in another library), and a few with an independent
computation (a `jax.custom_vjp` written here, or `jax.vjp` of the softmax the
straight-through gradient is). Then `recipe.transform(grad)` on a JAX gradient, a user's
own `GradientTransform`, the module form, and the errors' text.

Without JAX the module skips, unless `GRADOVERRIDE_REQUIRE_JAX=1` (set by `.ci/run`),
where a missing JAX is an import error, so CI cannot pass by skipping it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
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

import gradoverride as go
from gradoverride import GradOverrideError, GradOverrideTypeError
from gradoverride.recipes import GradientTransform

R: Any = go.recipes  # torch-typed signatures; here called on JAX arrays
RTOL = 1e-6

_rng = np.random.default_rng(0)
X = _rng.standard_normal((4, 5)).astype(np.float32) * 2
UP = _rng.standard_normal((4, 5)).astype(np.float32) * 3
NON_FINITE_UP = UP.copy()
NON_FINITE_UP[0, 1], NON_FINITE_UP[1, 2], NON_FINITE_UP[3, 0] = np.nan, np.inf, -np.inf


def _torch(recipe: Any, x: np.ndarray, up: np.ndarray, **kw: Any) -> tuple[Any, Any]:
    t = torch.tensor(x, requires_grad=True)
    y = recipe(t, **kw)
    y.backward(torch.tensor(up))
    assert t.grad is not None
    return y.detach().numpy(), t.grad.numpy()


def _jax(recipe: Any, x: np.ndarray, up: np.ndarray, jit: bool = False, **kw: Any
         ) -> tuple[Any, Any]:
    def f(x: Any) -> Any:
        return recipe(x, **kw)

    def value_and_grad(x: Any, up: Any) -> tuple[Any, Any]:
        y, vjp = jax.vjp(f, x)
        return y, vjp(up)[0]

    run = jax.jit(value_and_grad) if jit else value_and_grad
    y, g = run(jnp.asarray(x), jnp.asarray(up))
    return np.asarray(y), np.asarray(g)


def _close(a: Any, b: Any, rtol: float = RTOL) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-30)


def _close_softmax(a: Any, b: Any) -> None:
    """A softmax gradient, soft * (g - sum(g * soft)), cancels where g is near the sum:
    there the two libraries' float32 sums differ by an ulp of the largest term, so the
    error is bounded relative to the largest gradient, not to each."""
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=2e-6 * np.abs(b).max())


# ---- gradient flow: JAX against torch -------------------------------------------------------

FLOW = [
    R.reverse_grad(),
    R.reverse_grad(scale=0.3),
    R.scale_grad(scale=2.5),
    R.scale_grad(scale=0),
    R.clip_grad_value(clip_value=0.5),
    R.clip_grad_norm(max_norm=1.0),
    R.clip_grad_norm(max_norm=1.0, dim=1),
    R.clip_grad_norm(max_norm=0.5, dim=(0,)),
    R.clip_grad_norm(max_norm=2.0, norm_type=1.0),
    R.clip_grad_norm(max_norm=2.0, norm_type=math.inf),
    R.clip_grad_norm(max_norm=2.0, norm_type=3.0, eps=1e-3),
    R.clip_grad_norm(max_norm=2.0, norm_type=0.0),
    R.sanitize_grad(),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("recipe", FLOW, ids=repr)
def test_flow_recipes_match_torch(recipe: Any, jit: bool) -> None:
    y_t, g_t = _torch(recipe, X, UP)
    y_j, g_j = _jax(recipe, X, UP, jit=jit)
    np.testing.assert_array_equal(y_j, X)  # the identity, as torch's
    np.testing.assert_array_equal(y_t, X)
    _close(g_j, g_t)


@pytest.mark.parametrize("recipe", [
    R.sanitize_grad(), R.sanitize_grad(nan=1.0, posinf=5.0, neginf=-6.0),
    R.clip_grad_value(clip_value=2.0),
], ids=repr)
def test_non_finite_upstream_matches_torch(recipe: Any) -> None:
    _, g_t = _torch(recipe, X, NON_FINITE_UP)
    _, g_j = _jax(recipe, X, NON_FINITE_UP, jit=True)
    np.testing.assert_array_equal(g_j, g_t)  # the same selects: bit for bit, NaN included


def test_clip_grad_norm_matches_a_hand_written_custom_vjp() -> None:
    max_norm, eps = 1.0, 1e-6

    @jax.custom_vjp
    def clip(x: Any) -> Any:
        return x

    def fwd(x: Any) -> tuple[Any, None]:
        return x, None

    def bwd(_: None, g: Any) -> tuple[Any]:
        norm = jnp.sqrt(jnp.sum(g * g, axis=1, keepdims=True))
        return (g * jnp.minimum(max_norm / (norm + eps), 1.0),)

    clip.defvjp(fwd, bwd)
    recipe = R.clip_grad_norm(max_norm=max_norm, dim=1, eps=eps)
    _, g = _jax(recipe, X, UP)
    (expected,) = jax.vjp(clip, jnp.asarray(X))[1](jnp.asarray(UP))
    _close(g, expected)
    norms = np.linalg.norm(g, axis=1)
    assert np.all(norms <= max_norm * (1 + 1e-6))


def test_reverse_grad_under_grad_and_vmap() -> None:
    def loss(x: Any) -> Any:
        return jnp.sum(R.reverse_grad(scale=0.5)(x) * jnp.asarray(UP[0]))

    g = jax.vmap(jax.grad(loss))(jnp.asarray(X))
    _close(g, np.broadcast_to(-0.5 * UP[0], X.shape))


def test_clip_grad_norm_under_vmap_clips_each_sample_as_torch_clips_it() -> None:
    recipe = R.clip_grad_norm(max_norm=1.0)

    def vjp_one(x: Any, up: Any) -> Any:
        return jax.vjp(recipe, x)[1](up)[0]

    g = jax.jit(jax.vmap(vjp_one))(jnp.asarray(X), jnp.asarray(UP))
    for i in range(len(X)):
        _, g_t = _torch(recipe, X[i], UP[i])
        _close(g[i], g_t)


def test_half_precision_scaling_rounds_once_as_torch() -> None:
    x16, up16 = X.astype(np.float16), UP.astype(np.float16)
    t = torch.tensor(x16, requires_grad=True)
    R.scale_grad(scale=0.1)(t).backward(torch.tensor(up16))
    assert t.grad is not None
    _, g = _jax(R.scale_grad(scale=0.1), x16, up16, jit=True)
    assert g.dtype == np.float16
    np.testing.assert_array_equal(g, t.grad.numpy())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_ganin_ramp_schedule_takes_a_jax_step(jit: bool) -> None:
    recipe = R.reverse_grad(scale=R.ganin_ramp(total_steps=100))
    for step in (0, 30, 100, 250):
        _, g_t = _torch(recipe, X, UP, step=step)
        _, g_j = _jax(recipe, X, UP, jit=jit, step=jnp.asarray(step))
        _close(g_j, g_t)
        # independent: the paper's formula in float64
        p = min(step / 100, 1.0)
        _close(g_j, -(2 / (1 + math.exp(-10 * p)) - 1) * UP, rtol=1e-5)


def test_a_schedule_receives_the_step_as_a_jax_integer_array() -> None:
    seen: list[Any] = []

    def schedule(step: Any) -> Any:
        seen.append(step)
        return 0.5 + step * 0.25

    recipe = R.scale_grad(scale=schedule)
    g = jax.jit(jax.grad(lambda x, s: jnp.sum(recipe(x, step=s) * UP)))(jnp.asarray(X), 2)
    _close(g, UP)
    assert isinstance(seen[0], jax.Array) and jnp.issubdtype(seen[0].dtype, jnp.integer)
    # transform with a schedule too
    _close(R.scale_grad(scale=schedule).transform(jnp.asarray(UP), step=6), 2 * UP)


@pytest.mark.parametrize("recipe", [*FLOW, R.sanitize_grad(nan=2.0, posinf=3.0)], ids=repr)
def test_transform_on_a_jax_gradient_matches_torch(recipe: Any) -> None:
    expected = recipe.transform(torch.tensor(NON_FINITE_UP if isinstance(
        recipe, R.sanitize_grad) else UP)).numpy()
    up = NON_FINITE_UP if isinstance(recipe, R.sanitize_grad) else UP
    got = recipe.transform(jnp.asarray(up))
    assert isinstance(got, jax.Array)
    _close(got, expected)
    _close(jax.jit(recipe.transform)(jnp.asarray(up)), expected)


@dataclasses.dataclass(frozen=True, repr=False)
class _Tripled(GradientTransform):
    def transform(self, grad: Any) -> Any:
        return grad * 3


def test_a_users_gradient_transform_runs_on_jax() -> None:
    for jit in (False, True):
        y, g = _jax(_Tripled(), X, UP, jit=jit)
        np.testing.assert_array_equal(y, X)
        _close(g, 3 * UP)
    _close(_Tripled().transform(jnp.asarray(UP)), 3 * UP)
    with pytest.raises(TypeError, match=re.escape("takes one tensor; got 2 positional")):
        _Tripled()(jnp.asarray(X), 1)  # type: ignore[arg-type]


def test_the_constant_module_form_runs_on_jax_and_the_scheduled_one_is_refused() -> None:
    module = R.reverse_grad(scale=0.5).module()
    _, g = _jax(module, X, UP)
    _close(g, -0.5 * UP)
    _close(module.transform(jnp.asarray(UP)), -0.5 * UP)
    scheduled = R.reverse_grad(scale=R.ganin_ramp(total_steps=10)).module()
    with pytest.raises(GradOverrideTypeError, match=re.escape(
        "ScaledGradientModule with a schedule supports torch tensors only; got a JAX"
    )) as info:
        scheduled(jnp.asarray(X))
    assert "`recipe(x, step=step)`" in str(info.value)


# ---- sanitize_grad(mode="raise") ------------------------------------------------------------


def test_sanitize_raise_counts_eagerly() -> None:
    recipe = R.sanitize_grad(mode="raise", name="encoder output")
    with pytest.raises(GradOverrideError, match=re.escape(
        "the gradient of `encoder output` passing through sanitize_grad(mode='raise', "
        "nan=0.0, posinf=None, neginf=None, name='encoder output') is not finite (1 NaN and "
        "2 infinite of 20 values). Find the op that makes it with "
        "`jax.config.update('jax_debug_nans', True)`, or replace the values with "
        "`sanitize_grad(mode='replace')`."
    )):
        _jax(recipe, X, NON_FINITE_UP)
    with pytest.raises(GradOverrideError, match=re.escape("(1 NaN and 2 infinite of 20")):
        recipe.transform(jnp.asarray(NON_FINITE_UP))
    _, g = _jax(recipe, X, UP)  # a finite gradient passes unchanged
    np.testing.assert_array_equal(g, UP)


def test_sanitize_raise_is_refused_under_jit_rather_than_passing_silently() -> None:
    recipe = R.sanitize_grad(mode="raise")
    with pytest.raises(GradOverrideError, match=re.escape(
        "cannot check a gradient inside a traced JAX function (jax.jit, jax.vmap): nothing "
        "there stops the computation, so a NaN or infinite gradient would pass silently. Use "
        "`sanitize_grad(mode='replace')` there, or look for the source eagerly, outside "
        "jax.jit and jax.vmap."
    )):
        _jax(recipe, X, UP, jit=True)
    with pytest.raises(GradOverrideError, match=re.escape("(jax.jit, jax.vmap)")):
        jax.vmap(recipe.transform)(jnp.asarray(UP))


# ---- errors ---------------------------------------------------------------------------------


def test_a_torch_tensor_scale_is_refused_on_jax() -> None:
    recipe = R.scale_grad(scale=torch.tensor(2.0))
    with pytest.raises(GradOverrideTypeError, match=re.escape(
        "has a torch tensor as its `scale` and got a JAX array; a traced JAX function would "
        "keep the value"
    )):
        recipe(jnp.asarray(X))


def test_schedule_and_step_errors_on_jax() -> None:
    with pytest.raises(GradOverrideError, match=re.escape("it needs the step count")):
        R.reverse_grad(scale=R.ganin_ramp(total_steps=10))(jnp.asarray(X))
    with pytest.raises(GradOverrideTypeError, match=re.escape("has a constant scale, so it "
                                                              "takes no `step`")):
        R.reverse_grad()(jnp.asarray(X), step=3)


def test_a_torch_grad_scaler_is_refused_on_jax() -> None:
    recipe = R.clip_grad_norm(max_norm=1.0, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(GradOverrideError, match=re.escape(
        "clip_grad_norm(scaler=...) got torch's GradScaler"
    )):
        recipe.transform(jnp.asarray(UP))


# ---- discrete choices -----------------------------------------------------------------------

DISCRETE = [
    R.ste_argmax(),
    R.ste_argmax(temperature=0.5),
    R.ste_argmax(dim=0, temperature=3.0),
    R.ste_argmax(backward="identity"),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("recipe", DISCRETE, ids=repr)
def test_ste_argmax_matches_torch(recipe: Any, jit: bool) -> None:
    y_t, g_t = _torch(recipe, X, UP)
    y_j, g_j = _jax(recipe, X, UP, jit=jit)
    np.testing.assert_array_equal(y_j, y_t)
    _close_softmax(g_j, g_t)


def test_ste_argmax_gradient_is_the_softmax_gradient() -> None:
    temperature = 0.7
    _, g = _jax(R.ste_argmax(temperature=temperature), X, UP)
    expected = jax.vjp(lambda x: jax.nn.softmax(x / temperature, axis=-1),
                       jnp.asarray(X))[1](jnp.asarray(UP))[0]
    _close_softmax(g, expected)


def test_ste_argmax_ties_go_to_the_first_index_and_vmap() -> None:
    x = jnp.asarray([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]])
    np.testing.assert_array_equal(R.ste_argmax()(x), [[0, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(jax.vmap(R.ste_argmax())(x), [[0, 1, 0], [1, 0, 0]])


GUMBEL = [
    R.gumbel_softmax(),
    R.gumbel_softmax(temperature=0.5),
    R.gumbel_softmax(temperature=2.0, hard=False),
    R.gumbel_softmax(dim=0, temperature=0.3),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("recipe", GUMBEL, ids=repr)
def test_gumbel_softmax_matches_torch_with_the_same_noise(recipe: Any, jit: bool) -> None:
    noise = np.asarray(jax.random.gumbel(jax.random.PRNGKey(1), X.shape))
    x_t, n_t = torch.tensor(X, requires_grad=True), torch.tensor(noise, requires_grad=True)
    y_t = recipe(x_t, noise=n_t)
    y_t.backward(torch.tensor(UP))
    assert x_t.grad is not None and n_t.grad is not None

    def run(x: Any, n: Any, up: Any) -> Any:
        y, vjp = jax.vjp(lambda x, n: recipe(x, noise=n), x, n)
        return y, *vjp(up)

    if jit:
        run = jax.jit(run)
    y, g_x, g_n = run(jnp.asarray(X), jnp.asarray(noise), jnp.asarray(UP))
    _close(y, y_t.detach().numpy(), rtol=1e-5)
    _close_softmax(g_x, x_t.grad.numpy())
    _close_softmax(g_n, n_t.grad.numpy())


def test_gumbel_softmax_under_vmap_with_noise() -> None:
    noise = jax.random.gumbel(jax.random.PRNGKey(2), X.shape)
    recipe = R.gumbel_softmax(temperature=0.5, hard=False)
    batched = jax.vmap(lambda x, n: recipe(x, noise=n))(jnp.asarray(X), noise)
    _close(batched, recipe(jnp.asarray(X), noise=noise), rtol=1e-6)
    expected = jax.nn.softmax((jnp.asarray(X) + noise) / 0.5, axis=-1)  # independent
    _close(batched, expected, rtol=1e-5)


def test_gumbel_softmax_on_jax_needs_noise() -> None:
    with pytest.raises(GradOverrideError, match=re.escape(
        "on a JAX array needs its Gumbel draws as `noise=`: JAX has no global random "
        "generator for the recipe to draw from. Pass `noise=jax.random.gumbel(key, x.shape)`"
    )):
        R.gumbel_softmax()(jnp.asarray(X))


def test_gumbel_softmax_noise_errors_on_jax() -> None:
    x = jnp.asarray(X)
    with pytest.raises(GradOverrideError, match=re.escape(
        "`noise` must have the scores' shape (4, 5); got (4, 4). Draw one value per score: "
        "`jax.random.gumbel(key, x.shape)`"
    )):
        R.gumbel_softmax()(x, noise=jnp.zeros((4, 4)))
    with pytest.raises(GradOverrideTypeError, match=re.escape(
        "`noise` must be a floating-point JAX array of Gumbel draws shaped like the scores; "
        "got Tensor"
    )):
        R.gumbel_softmax()(x, noise=torch.zeros(4, 5))
    with pytest.raises(GradOverrideTypeError, match=re.escape(
        "`generator` is a torch.Generator, which cannot draw JAX noise; pass the draws as "
        "`noise=jax.random.gumbel(key, x.shape)`"
    )):
        R.gumbel_softmax()(x, generator=torch.Generator())


def test_discrete_input_errors_on_jax() -> None:
    with pytest.raises(GradOverrideTypeError, match=re.escape(
        "`x` must be a floating-point array (float16, bfloat16, float32 or float64); got a "
        "JAX int32 array, which gets no gradient. Convert it first: `x.astype(jnp.float32)`"
    )):
        R.ste_argmax()(jnp.arange(3))
    with pytest.raises(GradOverrideError, match=re.escape(
        "got a tensor with 2 dimensions (shape (4, 5)), so `dim=2` is out of range; pass a "
        "dim in [-2, 1]"
    )):
        R.ste_argmax(dim=2)(jnp.asarray(X))


def test_rotation_trick_is_refused_on_jax() -> None:
    with pytest.raises(GradOverrideTypeError, match=re.escape(
        "rotation_trick supports torch tensors only; got a JAX"
    )):
        R.rotation_trick()(jnp.asarray(X), jnp.asarray(X))


def test_a_torch_grad_scaler_on_a_jax_gradient_says_to_unscale_first() -> None:
    from gradoverride.recipes import clip_grad_norm

    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(GradOverrideError, match=(
        r"^clip_grad_norm\(scaler=\.\.\.\) got torch's GradScaler, and this gradient is a JAX "
        r"array: a GradScaler scales torch losses only\. Unscale the JAX gradients before the "
        r"recipe sees them, and give no scaler\.$"
    )):
        clip_grad_norm(1.0, scaler=scaler)(jnp.ones(3))


def test_a_transform_written_without_dataclass_works_on_jax() -> None:
    class Double(GradientTransform):  # no @dataclass: a user's plain subclass
        def transform(self, grad: Any) -> Any:
            return grad * 2

    np.testing.assert_array_equal(jax.grad(lambda v: Double()(v).sum())(jnp.ones(3)), [2.0] * 3)
    assert repr(Double()) == "Double()"


@pytest.mark.parametrize("step", [37, 37.5, np.int64(2**40)], ids=["int", "float", "large"])
def test_a_schedule_takes_the_step_as_torch_does(step: Any) -> None:
    # A fractional step is not truncated, a large numpy integer does not wrap: the same
    # factor as torch's recipe, and as the closed form with the progress in float32.
    recipe = go.recipes.scale_grad(go.recipes.ganin_ramp(total_steps=100))
    got = float(jax.grad(lambda u: recipe(u, step=step))(1.0))
    p = min(max(float(np.float32(float(step)) / np.float32(100)), 0.0), 1.0)
    closed = 2.0 / (1.0 + math.exp(-10.0 * p)) - 1.0
    x = torch.tensor(1.0, requires_grad=True)
    recipe(x, step=int(step) if isinstance(step, np.integer) else step).backward()
    assert x.grad is not None
    np.testing.assert_allclose(got, float(x.grad), rtol=1e-6)
    np.testing.assert_allclose(got, closed, rtol=1e-6)
