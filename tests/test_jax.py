"""`custom_backward` and `straight_through` on JAX arrays (DESIGN §2.11).

The ops here are written with Python operators only, so one decorated op (one forward, one
rule) serves both frameworks; gradients on JAX arrays (eager, under `jax.jit`, under
`jax.vmap`) are compared with torch's on the same float32 inputs (tolerance 1e-6 relative:
the same float32 arithmetic, in another library) and with a `jax.custom_vjp` written here by
hand. Then the contract's edges: return forms, ownership, integer and Python arguments,
residuals, second derivatives, and the error messages.

Without JAX the module skips, unless `GRADOVERRIDE_REQUIRE_JAX=1` (set by `.ci/run`),
where a missing JAX is an import error, so CI cannot pass by skipping it.
"""

from __future__ import annotations

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

import gradoverride as go
from gradoverride import GradOverrideError, GradOverrideTypeError

RTOL = 1e-6  # float32 on both sides: the same operations, summed in the same order

X = np.array([-1.5, -1.0, -0.25, 0.0, 0.5, 1.0, 2.0], dtype=np.float32)


# ---- ops written once, for both frameworks ------------------------------------------------


@go.custom_backward
def cube(x: Any) -> Any:
    return x * x * x


@cube.backward
def _(grad: Any, *, x: Any) -> Any:
    return grad * 2 * x  # not the true derivative (3x²), so the rule is visible


@go.custom_backward(owns="x")
def scale(x: Any, w: Any) -> Any:
    """Partial override: the rule owns `x`; `w` keeps its ordinary gradient (grad * x)."""
    return x * w


@scale.backward
def _(grad: Any, *, w: Any) -> Any:
    return grad * 2 * w


@go.custom_backward
def pair(xs: Any, *, shift: float = 0.0) -> Any:
    """A container input, and a Python number that must not become a gradient slot."""
    a, b = xs
    return a * b + shift


@pair.backward
def _(grad: Any, *, xs: Any) -> Any:
    a, b = xs
    return (grad * b * 3, grad * a * 5)  # the tuple is the container's gradient


def _hand_cube() -> Any:
    """`cube` as a `jax.custom_vjp` written by hand: the independent reference."""

    @jax.custom_vjp
    def f(x: Any) -> Any:
        return x * x * x

    f.defvjp(lambda x: (x * x * x, x), lambda x, g: (g * 2 * x,))
    return f


def _torch_grad(fn: Any, *inputs: np.ndarray) -> list[np.ndarray]:
    leaves = [torch.tensor(v, requires_grad=True) for v in inputs]
    fn(*leaves).sum().backward()
    return [leaf.grad.numpy() for leaf in leaves]  # type: ignore[union-attr]


def _close(a: Any, b: Any) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=1e-7)


# ---- the contract, compared with torch and with a hand-written custom_vjp -----------------


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_an_op_gives_the_rules_gradient_as_in_torch(mode: str) -> None:
    def loss(x: Any) -> Any:
        return cube(x).sum()

    grad = jax.grad(loss) if mode == "eager" else jax.jit(jax.grad(loss))
    got = grad(jnp.asarray(X))
    (torch_grad,) = _torch_grad(cube, X)
    _close(got, torch_grad)
    _close(got, jax.grad(lambda x: _hand_cube()(x).sum())(jnp.asarray(X)))
    _close(cube(jnp.asarray(X)), X**3)  # the forward itself is untouched


def test_an_op_under_vmap_gives_per_example_gradients() -> None:
    batch = jnp.asarray(np.stack([X, 2 * X, -X]))
    got = jax.vmap(jax.grad(lambda x: cube(x).sum()))(batch)
    hand = jax.vmap(jax.grad(lambda x: _hand_cube()(x).sum()))(batch)
    _close(got, hand)
    _close(got, 2 * np.asarray(batch))


def test_second_derivatives_differentiate_the_rule() -> None:
    # The rule is written in jnp-compatible ops, so JAX differentiates it again: d/dx of
    # (2x) is 2, as with the hand-written custom_vjp (and not 6x, the true cube's).
    x = jnp.asarray(0.75)
    second = jax.grad(jax.grad(cube))(x)
    hand = jax.grad(jax.grad(_hand_cube()))(x)
    assert float(second) == float(hand) == 2.0
    xt = torch.tensor(0.75, requires_grad=True)
    (g,) = torch.autograd.grad(cube(xt), xt, create_graph=True)
    (gg,) = torch.autograd.grad(g, xt)
    assert float(gg) == float(second)


def test_forward_mode_is_refused_by_jax() -> None:
    # jax.custom_vjp defines reverse mode only; JAX itself says so.
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(cube, (jnp.asarray(X),), (jnp.ones(7),))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_partial_ownership_keeps_jaxs_gradient_for_the_rest(mode: str) -> None:
    w = np.linspace(0.5, 2.0, 7).astype(np.float32)

    def loss(x: Any, w: Any) -> Any:
        return scale(x, w).sum()

    grad = jax.grad(loss, argnums=(0, 1))
    if mode == "jit":
        grad = jax.jit(grad)
    gx, gw = grad(jnp.asarray(X), jnp.asarray(w))
    tx, tw = _torch_grad(scale, X, w)
    _close(gx, tx)
    _close(gw, tw)
    _close(gx, 2 * w)  # the rule's
    _close(gw, X)  # the product's own


def test_a_container_input_and_a_python_number() -> None:
    a, b = jnp.asarray(X), jnp.asarray(X[::-1].copy())
    ga, gb = jax.jit(jax.grad(lambda a, b: pair((a, b), shift=2.5).sum(), argnums=(0, 1)))(a, b)
    ta, tb = _torch_grad(lambda a, b: pair((a, b), shift=2.5), X, X[::-1].copy())
    _close(ga, ta)
    _close(gb, tb)
    _close(ga, 3 * np.asarray(b))
    _close(pair((a, b), shift=2.5), X * X[::-1] + 2.5)


def test_return_forms_dict_tuple_single() -> None:
    def make(form: str) -> Any:
        @go.custom_backward
        def mul(x: Any, y: Any, bits: int = 4) -> Any:
            return x * y

        @mul.backward
        def _(grad: Any, *, x: Any, y: Any) -> Any:
            if form == "dict":
                return {"x": grad * y * 2, "y": None}
            return (grad * y * 2, None, None)

        return mul

    x, y = jnp.asarray(X), jnp.asarray(np.full(7, 3.0, np.float32))
    for form in ("dict", "tuple"):
        op = make(form)
        gx, gy = jax.grad(lambda x, y, op=op: op(x, y).sum(), argnums=(0, 1))(x, y)
        _close(gx, np.full(7, 6.0))
        _close(gy, np.zeros(7))  # None: a zero cotangent


def test_integer_array_and_unused_inputs_get_no_gradient() -> None:
    @go.custom_backward
    def pick(x: Any, index: Any) -> Any:
        return x[index]

    @pick.backward
    def _(grad: Any, *, x: Any, index: Any) -> Any:
        return jnp.zeros_like(x).at[index].add(grad * 10)

    x = jnp.asarray(X)
    index = jnp.asarray([0, 0, 3])
    gx, gi = jax.grad(lambda x, i: pick(x, i).sum(), argnums=(0, 1), allow_int=True)(x, index)
    _close(gx, [20.0, 0, 0, 10.0, 0, 0, 0])
    assert gi.dtype == jax.dtypes.float0  # JAX's "no gradient" for an integer input
    _close(jax.jit(jax.grad(lambda x: pick(x, index).sum()))(x), gx)


def test_residuals_output_and_needs_grad() -> None:
    @go.custom_backward(residuals=("scale",))
    def norm(x: Any, eps: float = 1e-3) -> Any:
        s = jnp.sqrt((x * x).sum() + eps)
        return x / s, {"scale": s}

    seen: dict[str, Any] = {}

    @norm.backward
    def _(grad: Any, *, scale: Any, output: Any, needs_grad: Any) -> Any:
        seen["needs_grad"] = needs_grad
        return grad / scale - output * (grad * output).sum() / scale

    x = jnp.asarray(X)
    got = jax.jit(jax.grad(lambda x: (norm(x) * jnp.arange(7.0)).sum()))(x)
    true = jax.grad(lambda x: (x / jnp.sqrt((x * x).sum() + 1e-3) * jnp.arange(7.0)).sum())(x)
    np.testing.assert_allclose(got, true, rtol=1e-5, atol=1e-6)  # the rule is the true one
    assert seen["needs_grad"] == {"x": True, "eps": False}


def test_several_outputs_and_an_unused_one_sends_zeros() -> None:
    @go.custom_backward
    def split(x: Any) -> Any:
        return x * 2, x * 3

    upstream: list[Any] = []

    @split.backward
    def _(g1: Any, g2: Any, *, x: Any) -> Any:
        upstream.append((g1, g2))
        return g1 + 10 * g2

    got = jax.grad(lambda x: split(x)[0].sum())(jnp.asarray(X))
    _close(got, np.ones(7))
    _close(upstream[0][1], np.zeros(7))  # JAX materializes the unused output's zeros


def test_a_broadcast_gradient_is_summed_and_a_precision_cast() -> None:
    @go.custom_backward
    def shift(x: Any, b: Any) -> Any:
        return x + b

    @shift.backward
    def _(grad: Any) -> Any:
        return (grad.astype(jnp.float16), grad)  # b: shape (3,) summed down to (1,)

    x = jnp.ones(3, jnp.float32)
    gx, gb = jax.grad(lambda x, b: (shift(x, b) * jnp.arange(3.0)).sum(), argnums=(0, 1))(
        x, jnp.ones(1, jnp.float32)
    )
    assert gx.dtype == jnp.float32 and gb.shape == (1,)
    _close(gx, [0.0, 1.0, 2.0])
    _close(gb, [3.0])


def test_once_differentiable_refuses_a_second_derivative() -> None:
    @go.custom_backward
    def square(x: Any) -> Any:
        return x * x

    @square.backward(once_differentiable=True)
    def _(grad: Any, *, x: Any) -> Any:
        return grad * 2 * x

    assert float(jax.grad(square)(jnp.asarray(3.0))) == 6.0
    with pytest.raises(GradOverrideError, match="square` is marked once_differentiable=True"):
        jax.grad(jax.grad(square))(jnp.asarray(3.0))


# ---- straight_through ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{}, {"clip": 1.0}, {"clip": 1.0, "inclusive": False}, {"clip": (-0.25, 1.0), "keep": "mask"}],
    ids=["identity", "clip", "clip-open", "clip-mask"],
)
@pytest.mark.parametrize("mode", ["eager", "jit", "vmap"])
def test_straight_through_matches_torch(options: dict[str, Any], mode: str) -> None:
    def sign(x: Any) -> Any:
        return x * 0 + (x > 0) * 2.0 - 1.0  # sign without 0, in operators both frameworks have

    op = go.straight_through(sign, **options)
    (torch_grad,) = _torch_grad(op, X)

    def loss(x: Any) -> Any:
        return op(x).sum()

    if mode == "eager":
        got = jax.grad(loss)(jnp.asarray(X))
    elif mode == "jit":
        got = jax.jit(jax.grad(loss))(jnp.asarray(X))
    else:
        got = jax.vmap(jax.grad(loss))(jnp.asarray(np.stack([X, X])))[1]
    _close(got, torch_grad)
    _close(op(jnp.asarray(X)), np.where(X > 0, 1.0, -1.0))


def test_straight_through_surrogate_matches_a_hand_written_custom_vjp() -> None:
    @go.straight_through(surrogate=jnp.tanh, clip=1.0)
    def spike(x: Any, threshold: float = 0.0) -> Any:
        return (x > threshold).astype(x.dtype)

    @jax.custom_vjp
    def hand(x: Any) -> Any:
        return (x > 0).astype(x.dtype)

    def hand_bwd(x: Any, g: Any) -> Any:
        return (jnp.where(jnp.abs(x) <= 1, g * (1 - jnp.tanh(x) ** 2), 0.0),)

    hand.defvjp(lambda x: (hand(x), x), hand_bwd)
    x = jnp.asarray(X)
    got = jax.jit(jax.grad(lambda x: (spike(x, 0.0) * jnp.arange(7.0)).sum()))(x)
    _close(got, jax.grad(lambda x: (hand(x) * jnp.arange(7.0)).sum())(x))

    @go.straight_through(surrogate=torch.tanh, clip=1.0)
    def torch_spike(x: Any) -> Any:
        return (x > 0).to(x.dtype)

    xt = torch.tensor(X, requires_grad=True)
    (torch_spike(xt) * torch.arange(7.0)).sum().backward()
    np.testing.assert_allclose(got, xt.grad.numpy(), rtol=1e-5)  # type: ignore[union-attr]


def test_straight_through_derivative() -> None:
    @go.straight_through(derivative=lambda x: 1 / (1 + x * x))
    def step(x: Any) -> Any:
        return (x > 0).astype(x.dtype)

    _close(jax.grad(lambda x: step(x).sum())(jnp.asarray(X)), 1 / (1 + X * X))


# ---- errors --------------------------------------------------------------------------------


def _with_rule(rule_result: Any) -> Any:
    @go.custom_backward
    def quantize(x: Any, bits: int = 4) -> Any:
        return jnp.round(x * 2**bits) / 2**bits

    @quantize.backward
    def _(grad: Any, *, x: Any) -> Any:
        return rule_result(grad, x)

    return quantize


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_gradient_of_the_wrong_shape_names_the_function_and_input(mode: str) -> None:
    op = _with_rule(lambda grad, x: grad[:2])
    grad = jax.grad(lambda x: op(x).sum())
    if mode == "jit":
        grad = jax.jit(grad)
    with pytest.raises(
        GradOverrideError,
        match=r"backward of `.*quantize` returned a gradient of shape \(2,\) for `x`, "
              r"which has shape \(7,\)",
    ):
        grad(jnp.asarray(X))


def test_a_gradient_of_the_wrong_dtype_names_the_input() -> None:
    op = _with_rule(lambda grad, x: (jnp.abs(x) <= 1).astype(jnp.int32))
    with pytest.raises(
        GradOverrideError,
        match=r"gradient of dtype int32 for `x`, which has dtype float32.*grad.astype",
    ):
        jax.grad(lambda x: op(x).sum())(jnp.asarray(X))


def test_a_gradient_for_a_python_argument_is_refused() -> None:
    @go.custom_backward
    def quantize(x: Any, bits: int = 4) -> Any:
        return jnp.round(x * 2**bits) / 2**bits

    @quantize.backward
    def _(grad: Any, *, x: Any) -> Any:
        return {"x": grad, "bits": grad}

    with pytest.raises(
        GradOverrideError, match="returned a gradient for `bits`, which takes no gradient"
    ):
        jax.grad(lambda x: quantize(x, 3).sum())(jnp.asarray(X))


def test_a_torch_tensor_in_a_jax_call_or_rule_is_refused() -> None:
    with pytest.raises(GradOverrideTypeError, match="torch tensor for `w` in a call with JAX"):
        scale(jnp.asarray(X), torch.ones(7))
    op = _with_rule(lambda grad, x: torch.ones(7))
    with pytest.raises(GradOverrideError, match="returned a torch tensor for `x`, a JAX array"):
        jax.grad(lambda x: op(x).sum())(jnp.asarray(X))


def test_a_rule_that_raises_is_named() -> None:
    op = _with_rule(lambda grad, x: 1 / 0)
    with pytest.raises(ZeroDivisionError) as info:
        jax.grad(lambda x: op(x).sum())(jnp.asarray(X))
    assert any("raised in backward rule" in note for note in info.value.__notes__)


def test_a_forward_returning_no_array_is_refused() -> None:
    @go.custom_backward
    def count(x: Any) -> Any:
        return 3

    @count.backward
    def _(grad: Any) -> Any:
        return grad

    with pytest.raises(
        GradOverrideError, match=r"the forward of `.*count` returned int, which holds no JAX array"
    ):
        count(jnp.asarray(X))


def test_a_surrogate_of_another_shape_is_refused() -> None:
    @go.straight_through(surrogate=lambda x: jnp.tanh(x).sum())
    def spike(x: Any) -> Any:
        return (x > 0).astype(x.dtype)

    with pytest.raises(GradOverrideError, match=r"returned \(\), but the forward's output has "
                                                 r"shape \(7,\)"):
        jax.grad(lambda x: spike(x).sum())(jnp.asarray(X))


def test_a_recipe_with_no_jax_form_names_the_recipes_that_have_one() -> None:
    from gradoverride import recipes

    with pytest.raises(GradOverrideTypeError, match=(
        r"^rotation_trick supports torch tensors only; got a JAX \w+ as its input \(its "
        r"rotation has no form on these arrays yet\)\. The recipes that support TensorFlow "
        r"tensors and JAX arrays are: abs_subgradient, .*spike.* Use one of them, or run "
        r"rotation_trick on torch tensors\."
    )):
        recipes.rotation_trick()(jnp.ones((2, 3)), jnp.ones((2, 3)))


def test_a_second_derivative_follows_a_residual_through_the_forward() -> None:
    # The rule reads s = sin(x) from the forward: d/dx of the gradient sin(x) is cos(x),
    # which JAX gives by differentiating the forward too (a constant residual would give 0).
    @go.custom_backward(residuals=("s",))
    def doubled(x: Any) -> Any:
        return x * 2, {"s": jnp.sin(x)}

    @doubled.backward
    def _(grad: Any, *, s: Any) -> Any:
        return grad * s

    x = jnp.asarray(X)

    def gradient(x: Any) -> Any:
        return jax.grad(lambda x: doubled(x).sum())(x)

    _close(gradient(x), np.sin(X))  # first order: the rule
    second = jax.grad(lambda x: gradient(x).sum())
    np.testing.assert_allclose(second(x), np.cos(X), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jax.jit(second)(x), np.cos(X), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jax.vmap(second)(jnp.stack([x, x])), np.cos([X, X]),
                               rtol=1e-6, atol=1e-7)
