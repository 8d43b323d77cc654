"""The straight-through recipes on JAX arrays: `ste_round`, `ste_floor`, `ste_ceil`,
`ste_sign`, `ste_clamp`, `binarize`, `abs_subgradient`, `ternarize`, `quantize`, `lsq`.

Each recipe's values and gradients on JAX (eagerly and under `jax.jit`) are compared with
the torch recipe's on the same float32 inputs, and a few with computations written here
independently (a `jax.custom_vjp` by hand, `jax.grad` of LSQ's proxy). Then `jax.vmap`,
half-precision dtypes, quantize's codes at rounding ties under `jax.jit` (XLA multiplies by
the reciprocal of a scalar divisor unless kept from it), and the error messages.

Without JAX the module skips, unless `GRADOVERRIDE_REQUIRE_JAX=1` (set by `.ci/run`),
where a missing JAX is an import error, so CI cannot pass by skipping it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
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

R: Any = go.recipes  # the recipes' signatures name torch tensors; here they take JAX arrays
RTOL = 1e-6  # float32 on both sides: the same operations (reductions summed in another order)

_RNG = np.random.default_rng(0)
X = (_RNG.standard_normal((16, 9)) * 2).astype(np.float32)
X[0, :7] = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.5]  # ties, bounds and zeros
G = _RNG.standard_normal((16, 9)).astype(np.float32)
LOW = (-_RNG.random((16, 1)) - 0.5).astype(np.float32)  # per-row tensor bounds
HIGH = (_RNG.random((16, 1)) + 0.5).astype(np.float32)


def _recipes() -> list[tuple[str, Callable[[Any], Any]]]:
    """(id, make(array constructor) -> recipe): tensor bounds in the framework's arrays."""
    return [
        ("ste_round", lambda a: R.ste_round()),
        ("ste_floor", lambda a: R.ste_floor()),
        ("ste_ceil", lambda a: R.ste_ceil()),
        ("ste_sign", lambda a: R.ste_sign()),
        ("binarize", lambda a: R.binarize()),
        ("binarize_mask", lambda a: R.binarize(keep="mask")),
        ("binarize_open", lambda a: R.binarize(clip=(-0.5, 1.0), inclusive=(False, True))),
        ("binarize_pass", lambda a: R.binarize(clip=None)),
        ("abs_1", lambda a: R.abs_subgradient()),
        ("abs_0", lambda a: R.abs_subgradient(0.0)),
        ("abs_half", lambda a: R.abs_subgradient(0.5)),
        ("ternarize", lambda a: R.ternarize()),
        ("ternarize_unscaled", lambda a: R.ternarize(scaled=False)),
        ("quantize", lambda a: R.quantize()),
        ("quantize_mask", lambda a: R.quantize(4, keep="mask")),
        ("quantize_asym", lambda a: R.quantize(4, symmetric=False)),
        ("quantize_bound", lambda a: R.quantize(3, bound=2.0)),
        ("quantize_asym_bound", lambda a: R.quantize(5, symmetric=False, bound=(-1.0, 3.0))),
        ("clamp_zero", lambda a: R.ste_clamp(-1.0, 1.0, outside="zero")),
        ("clamp_zero_mask", lambda a: R.ste_clamp(-1.0, 0.5, outside="zero", keep="mask")),
        ("clamp_open", lambda a: R.ste_clamp(-1.0, 1.0, outside="zero", inclusive=False)),
        ("clamp_pass", lambda a: R.ste_clamp(-1.0, 1.0, outside="pass")),
        ("clamp_tensor", lambda a: R.ste_clamp(a(LOW), a(HIGH), outside="zero")),
        ("clamp_tensor_mask",
         lambda a: R.ste_clamp(a(LOW), 1.0, outside="zero", keep="mask", inclusive=False)),
        ("clamp_tensor_pass", lambda a: R.ste_clamp(a(LOW), a(HIGH), outside="pass")),
    ]


RECIPES = _recipes()


def torch_run(recipe: Any, x: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xt = torch.tensor(x, requires_grad=True)
    y = recipe(xt)
    y.backward(torch.tensor(g, dtype=y.dtype))
    assert xt.grad is not None
    return y.detach().float().numpy(), xt.grad.float().numpy()


def jax_run(recipe: Any, x: Any, g: Any, mode: str) -> tuple[np.ndarray, np.ndarray]:
    def vjp(x: Any, g: Any) -> tuple[Any, Any]:
        y, pullback = jax.vjp(recipe, x)
        return y, pullback(g.astype(y.dtype))[0]

    y, grad = (jax.jit(vjp) if mode == "jit" else vjp)(x, g)
    return np.asarray(y.astype(jnp.float32)), np.asarray(grad.astype(jnp.float32))


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize(("name", "make"), RECIPES, ids=[name for name, _ in RECIPES])
def test_recipe_on_jax_matches_torch(name: str, make: Callable[[Any], Any], mode: str) -> None:
    y_t, g_t = torch_run(make(torch.tensor), X, G)
    y_j, g_j = jax_run(make(jnp.asarray), jnp.asarray(X), jnp.asarray(G), mode)
    np.testing.assert_allclose(y_j, y_t, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(g_j, g_t, rtol=RTOL, atol=1e-7)


LSQ_CASES = [
    (window, bits, signed, shape)
    for window in ("open", "closed", "rounded")
    for bits, signed in ((4, True), (3, False))
    for shape in ((), (16, 1))
]


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize(("window", "bits", "signed", "shape"), LSQ_CASES)
def test_lsq_on_jax_matches_torch_step_gradient_included(
    window: str, bits: int, signed: bool, shape: tuple[int, ...], mode: str
) -> None:
    recipe = R.lsq(bits, signed, window=window)
    step = (np.full(shape, 0.25) + _RNG.random(shape) * 0.1).astype(np.float32)
    # codes at the ends of the range and at rounding ties, exactly
    x = X.copy()
    x[1, :3] = np.array([7.0, -8.0, 2.5], np.float32) * step.reshape(-1)[0]
    xt, st = torch.tensor(x, requires_grad=True), torch.tensor(step, requires_grad=True)
    y_t = recipe(xt, st)
    y_t.backward(torch.tensor(G))

    def vjp(x: Any, s: Any) -> Any:
        y, pullback = jax.vjp(recipe, x, s)
        return (y, *pullback(jnp.asarray(G)))

    y, gx, gs = (jax.jit(vjp) if mode == "jit" else vjp)(jnp.asarray(x), jnp.asarray(step))
    assert gs.shape == step.shape and gs.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), y_t.detach().numpy(), rtol=RTOL)
    np.testing.assert_allclose(np.asarray(gx), xt.grad.numpy(), rtol=RTOL)  # type: ignore[union-attr]
    np.testing.assert_allclose(np.asarray(gs), st.grad.numpy(), rtol=1e-5)  # type: ignore[union-attr]


# ---- independent computations ------------------------------------------------------------


def test_binarize_matches_a_hand_written_custom_vjp() -> None:
    @jax.custom_vjp
    def sign(x: Any) -> Any:
        return jnp.where(x < 0, -1.0, 1.0)

    def forward(x: Any) -> tuple[Any, Any]:
        return sign(x), x

    def backward(x: Any, g: Any) -> tuple[Any]:
        return (jnp.where(jnp.abs(x) <= 1.0, g, 0.0),)

    sign.defvjp(forward, backward)
    x, g = jnp.asarray(X), jnp.asarray(G)
    ours = jax.vjp(R.binarize(), x)
    theirs = jax.vjp(sign, x)
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_array_equal(ours[1](g)[0], theirs[1](g)[0])


def test_quantize_matches_a_hand_written_custom_vjp() -> None:
    s = 2.0 / 7

    @jax.custom_vjp
    def fake_quantize(x: Any) -> Any:
        return jnp.clip(jnp.round(x / s), -7, 7) * s

    def forward(x: Any) -> tuple[Any, Any]:
        return fake_quantize(x), x

    def backward(x: Any, g: Any) -> tuple[Any]:
        q = jnp.round(x / s)
        return (jnp.where((q >= -7) & (q <= 7), g, 0.0),)

    fake_quantize.defvjp(forward, backward)
    x = jnp.asarray(X * 0.9 + 0.013)  # no code at a tie: jnp's x / s multiplies by 1/s
    g = jnp.asarray(G)
    ours = jax.vjp(R.quantize(4, bound=2.0), x)
    theirs = jax.vjp(fake_quantize, x)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(ours[1](g)[0], theirs[1](g)[0])


def test_lsq_closed_is_the_gradient_of_the_round_pass_proxy() -> None:
    """`window="closed"`, `grad_scale=1`: the gradients of round_pass(clamp(x / s)) * s,
    by `jax.grad` (the input keeps clear of the range's ends, where clip splits)."""
    x = jnp.asarray(X * 1.37 + 0.011)
    s = jnp.asarray(0.3)

    def proxy(x: Any, s: Any) -> Any:
        v = jnp.clip(x / s, -8, 7)
        return (v + jax.lax.stop_gradient(jnp.round(v) - v)) * s

    def loss(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        return lambda x, s: jnp.sum(fn(x, s) * jnp.asarray(G))

    ours = jax.grad(loss(R.lsq(4, window="closed", grad_scale=1.0)), argnums=(0, 1))(x, s)
    theirs = jax.grad(loss(proxy), argnums=(0, 1))(x, s)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-5)


# ---- transforms and dtypes ----------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe",
    [R.ste_round(), R.binarize(keep="mask"), R.ste_clamp(-1.0, 1.0, outside="zero"),
     R.abs_subgradient(), R.quantize(4, bound=2.0)],
    ids=repr,
)
def test_vmap_of_an_elementwise_recipe_is_the_recipe(recipe: Any) -> None:
    x, g = jnp.asarray(X), jnp.asarray(G)

    def vjp(x: Any, g: Any) -> tuple[Any, Any]:
        y, pullback = jax.vjp(recipe, x)
        return y, pullback(g)[0]

    batched = jax.jit(jax.vmap(vjp))(x, g)
    whole = vjp(x, g)
    np.testing.assert_array_equal(batched[0], whole[0])
    np.testing.assert_array_equal(batched[1], whole[1])


def test_vmap_of_quantize_takes_each_rows_range() -> None:
    recipe = R.quantize(4)
    y = jax.vmap(recipe)(jnp.asarray(X))
    rows = np.stack([torch_run(recipe, row, row)[0] for row in X])
    np.testing.assert_allclose(np.asarray(y), rows, rtol=RTOL)


HALF = [("float16", torch.float16), ("bfloat16", torch.bfloat16)]
HALF_RECIPES = [R.ste_round(), R.ste_sign(), R.binarize(), R.abs_subgradient(0.3),
                R.ternarize(), R.quantize(8), R.quantize(12, symmetric=False),
                R.ste_clamp(-0.3, 0.7, outside="zero")]


@pytest.mark.parametrize(("jax_dtype", "torch_dtype"), HALF, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("recipe", HALF_RECIPES, ids=repr)
def test_half_precision_matches_torch(recipe: Any, jax_dtype: str, torch_dtype: Any) -> None:
    x = torch.tensor(X).to(torch_dtype)
    g = torch.tensor(G).to(torch_dtype)
    xt = x.clone().requires_grad_(True)
    y_t = recipe(xt)
    y_t.backward(g)
    y, pullback = jax.vjp(recipe, jnp.asarray(X).astype(jax_dtype))
    grad = pullback(jnp.asarray(G).astype(jax_dtype))[0]
    assert y.dtype == jnp.dtype(jax_dtype) and grad.dtype == jnp.dtype(jax_dtype)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), y_t.detach().float())
    np.testing.assert_array_equal(np.asarray(grad.astype(jnp.float32)), xt.grad.float())  # type: ignore[union-attr]


@pytest.mark.parametrize(("jax_dtype", "torch_dtype"), HALF, ids=["float16", "bfloat16"])
def test_lsq_half_input_with_a_float32_step_follows_torchs_promotion(
    jax_dtype: str, torch_dtype: Any
) -> None:
    """A 0-d float32 step does not widen a float16 input in torch (JAX would give float32):
    the output is in x's dtype, the step's gradient in float32."""
    recipe = R.lsq(4, grad_scale=0.5)
    xt = torch.tensor(X).to(torch_dtype).requires_grad_(True)
    st = torch.tensor(0.25, requires_grad=True)
    recipe(xt, st).backward(torch.tensor(G).to(torch_dtype))
    y, pullback = jax.vjp(recipe, jnp.asarray(X).astype(jax_dtype), jnp.asarray(0.25))
    gx, gs = pullback(jnp.asarray(G).astype(jax_dtype))
    assert y.dtype == jnp.dtype(jax_dtype) and gs.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(gx.astype(jnp.float32)), xt.grad.float())  # type: ignore[union-attr]
    np.testing.assert_allclose(float(gs), float(st.grad), rtol=1e-3)  # type: ignore[arg-type]


# ---- division by a scalar: quantize's codes at rounding ties ----------------------------------


def _near_ties(s: np.float32, qmax: int) -> np.ndarray:
    k = np.arange(-qmax, qmax, dtype=np.float32)
    tie = ((k + np.float32(0.5)) * s).astype(np.float32)
    return np.concatenate([tie, np.nextafter(tie, np.float32(np.inf)),
                           np.nextafter(tie, np.float32(-np.inf))])


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("bound", [2e4, 3.0, 1.0e-3])
def test_quantize_codes_at_ties_are_numpys_float32_division(bound: float, mode: str) -> None:
    """XLA turns x / s (a scalar s, constant or not) into x * (1/s), one ulp off for about a
    quarter of all inputs, which moves a code at a tie: the recipe keeps a true division."""
    recipe = R.quantize(8, bound=bound)
    s = np.float32(bound / 127)
    x = _near_ties(s, 127)
    expected = (np.clip(np.round(x / s), -127, 127) * s).astype(np.float32)
    fn = jax.jit(recipe) if mode == "jit" else recipe
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x))), expected)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_quantize_codes_with_a_range_from_the_input_are_torchs(mode: str) -> None:
    recipe = R.quantize(8)
    s = np.float32(np.float32(20.0) / 127)
    x = np.concatenate([_near_ties(s, 127), [np.float32(20.0)]])
    fn = jax.jit(recipe) if mode == "jit" else recipe
    ours = np.asarray(fn(jnp.asarray(x)))
    np.testing.assert_array_equal(ours, recipe(torch.tensor(x)).numpy())


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_lsq_codes_at_ties_are_torchs(mode: str) -> None:
    step = np.float32(0.1)
    x = _near_ties(step, 7)
    recipe = R.lsq(4)
    fn = jax.jit(recipe) if mode == "jit" else recipe
    ours = np.asarray(fn(jnp.asarray(x), jnp.asarray(step)))
    np.testing.assert_array_equal(ours, recipe(torch.tensor(x), torch.tensor(step)).numpy())


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [R.ste_round(), R.binarize(), R.quantize(), R.ternarize()],
                         ids=repr)
def test_integer_input_is_refused(recipe: Any) -> None:
    with pytest.raises(GradOverrideTypeError,
                       match=r"`x` must be a floating-point array .* got a JAX int32 array, "
                             r"which gets no gradient\. Convert it first: "
                             r"`x\.astype\(jnp\.float32\)`"):
        recipe(jnp.arange(4))


def test_torch_bounds_with_a_jax_input_are_refused() -> None:
    with pytest.raises(GradOverrideTypeError,
                       match=r"`low` is a torch tensor, and the input a JAX array; give JAX "
                             r"arrays \(or numbers\) as the bounds of a JAX input"):
        R.ste_clamp(torch.tensor(-1.0), 1.0, outside="pass")(jnp.asarray(X))
    with pytest.raises(GradOverrideTypeError,
                       match=r"`high` is a JAX array, and the input a torch tensor; give torch "
                             r"tensors \(or numbers\)"):
        R.ste_clamp(-1.0, jnp.asarray(1.0), outside="pass")(torch.tensor(X))


@pytest.mark.parametrize("step", [0.5, torch.tensor(0.5), np.float32(0.5)], ids=repr)
def test_lsq_step_must_be_a_jax_array(step: Any) -> None:
    with pytest.raises(GradOverrideTypeError,
                       match=r"lsq\(.*\): `step` must be a JAX array \(the learnable step\) "
                             r"when `x` is a JAX array; got"):
        R.lsq()(jnp.asarray(X), step)


def test_lsq_integer_step_is_refused() -> None:
    with pytest.raises(GradOverrideTypeError,
                       match=r"`step` must be a floating-point array .* JAX int32"):
        R.lsq()(jnp.asarray(X), jnp.asarray(1))


def test_the_module_form_of_lsq_refuses_jax() -> None:
    with pytest.raises(GradOverrideTypeError,
                       match=r"LearnedStepQuantizer supports torch tensors only; got a JAX "
                             r".*its step is a torch parameter"):
        R.lsq().module()(jnp.asarray(X))


def test_recipe_arguments_are_checked_as_for_torch() -> None:
    with pytest.raises(GradOverrideError, match=r"lsq got window='half'"):
        R.lsq(window="half")


# ---- learned bounds, a step larger than x, complex inputs ---------------------------------


def test_array_bounds_being_differentiated_get_no_gradient_and_leak_no_tracer() -> None:
    # A learned clip (PACT-style): the bounds are traced by jax.grad; torch gives them none.
    low = jnp.asarray([-0.5, -0.1, 0.0, 0.1, 0.2])
    x = jnp.asarray([-1.5, -0.2, 0.0, 0.3, 2.5])
    for outside in ("zero", "pass"):

        def loss(lo: Any, outside: str = outside) -> Any:
            return go.recipes.ste_clamp(lo, 1.0, outside)(x).sum()

        np.testing.assert_array_equal(jax.grad(loss)(low), np.zeros(5, np.float32))
        np.testing.assert_array_equal(jax.jit(jax.grad(loss))(low), np.zeros(5, np.float32))
    # x's gradient: inside [low, 1] (both ends in), by hand
    got = jax.grad(lambda x: go.recipes.ste_clamp(low, 1.0, "zero")(x).sum())(x)
    np.testing.assert_array_equal(got, [0.0, 0.0, 1.0, 1.0, 0.0])


def test_a_step_larger_than_x_gives_x_a_gradient_of_its_own_shape() -> None:
    # The step broadcasts x from (3, 4) to (2, 3, 4): x's gradient is summed back, as
    # torch's autograd does; compared with torch's.
    x = np.full((3, 4), 0.1, np.float32)
    step = np.full((2, 3, 4), 0.1, np.float32)
    got = jax.grad(lambda x: go.recipes.lsq(8)(x, jnp.asarray(step)).sum())(jnp.asarray(x))
    xt = torch.tensor(x, requires_grad=True)
    go.recipes.lsq(8)(xt, torch.tensor(step)).sum().backward()
    assert got.shape == (3, 4)
    np.testing.assert_array_equal(np.asarray(got), xt.grad.numpy())


def test_a_complex_input_is_refused_saying_why() -> None:
    with pytest.raises(GradOverrideTypeError, match=(
        r"^ste_round\(\): `x` must be a floating-point array \(float16, bfloat16, float32 or "
        r"float64\); got a JAX complex64 array \(the recipes are defined on real numbers\)\.$"
    )):
        go.recipes.ste_round()(jnp.ones(2, jnp.complex64))
