"""The JAX support matrix (`gradoverride._support_matrix.JAX_KINDS` x `JAX_CONTEXTS`): one
test per cell.

Each op runs on `z = x * w` (w a fixed array) inside `loss(x) = sum(op(z) * v)`. The expected
gradient is plain JAX autodiff of a *proxy*: a smooth function written here whose true
derivative is the op's rule (for the rule `2 z`, the proxy `z ** 2`; for a straight-through
estimator, the identity; for a surrogate spike, its smooth step), so nothing of gradoverride
computes the expectation. The second-derivative context differentiates the gradient's dot
product with a fixed array, for the op and for the proxy alike. The inputs avoid every
window's ends and every rounding tie, where proxies and rules may legitimately differ.

Without JAX the module skips, unless `GRADOVERRIDE_REQUIRE_JAX=1` (set by `.ci/run`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

if os.environ.get("GRADOVERRIDE_REQUIRE_JAX") == "1":
    import jax
else:
    jax = pytest.importorskip(
        "jax", reason="JAX is not installed (pip install 'gradoverride[jax]')"
    )
import jax.numpy as jnp

import gradoverride as go
from gradoverride import GradOverrideError
from gradoverride._support_matrix import JAX_CONTEXTS, JAX_KINDS, JAX_REFUSED
from gradoverride.recipes import (
    clip_grad_norm,
    lsq,
    quantize,
    reverse_grad,
    spike,
    ste_argmax,
    ste_round,
)

sg = jax.lax.stop_gradient

X = np.array([-1.3, -0.7, -0.2, 0.15, 0.45, 0.8, 1.6, -0.05], dtype=np.float32)
W = np.array([0.9, 1.1, 0.7, 1.3, 0.6, 1.2, 0.5, 1.4], dtype=np.float32)
V = np.array([0.5, -1.0, 2.0, 0.3, -0.7, 1.5, 0.8, -0.4], dtype=np.float32)
U = np.array([1.0, 0.5, -0.5, 2.0, 1.5, -1.0, 0.25, 0.75], dtype=np.float32)
NOISE = np.array([0.1, 0.9, 0.4, 0.6, 0.2, 0.8, 0.3, 0.7], dtype=np.float32)


# ---- the ops, written once for every cell ------------------------------------------------------


@go.custom_backward
def cube(x: Any) -> Any:
    return x * x * x


@cube.backward
def _(grad: Any, *, x: Any) -> Any:
    return grad * 2 * x  # not 3x²: the rule is visible


@go.custom_backward
def cube_once(x: Any) -> Any:
    return x * x * x


@cube_once.backward(once_differentiable=True)
def _(grad: Any, *, x: Any) -> Any:
    return grad * 2 * x


@go.custom_backward(owns="x")
def times(x: Any, y: Any) -> Any:
    return x * y


@times.backward
def _(grad: Any, *, y: Any) -> Any:
    return grad * 2 * y  # y keeps JAX's gradient, x gets twice the true one


@go.custom_backward(residuals=("s",))
def sine_scaled(x: Any) -> Any:
    s = jnp.sin(x)
    return x * 2, {"s": s}


@sine_scaled.backward
def _(grad: Any, *, s: Any) -> Any:
    return grad * s


STEP = np.float32(0.25)
LSQ = lsq(4)  # signed: codes -8..7


def _lsq_proxy(z: Any, s: Any) -> Any:
    """LSQ's gradients (Esser et al. 2020, eq. 3) as a proxy: x passes inside the code
    range, the step gets g * (round(v) - v) inside, -Qn below, Qp above."""
    qn, qp = 8, 7
    g = 1.0 / math.sqrt(z.size * qp)
    v = z / s
    inside = (v > -qn) & (v < qp)
    ds = jnp.where(inside, jnp.round(v) - v, jnp.where(v <= -qn, -qn, qp))
    passed = jnp.where(inside, z, sg(z))
    return passed + g * s * sg(ds) - sg(g * s * ds)


def _arctan_step(z: Any) -> Any:
    return 0.5 + jnp.arctan(z * math.pi) / math.pi  # alpha 2: derivative 1 / (1 + (pi z)^2)


def _leaky(z: Any) -> Any:
    silent = (0.1 - 0.2 / 2) + 0.2 * NOISE
    return z * sg(jnp.where(z > 0, 1.0, silent))


def _clipped(z: Any) -> Any:
    norm = np.linalg.norm(V.astype(np.float64))
    return z * min(1.0, 1.0 / (norm + 1e-6))  # the upstream gradient is V


def _owns_gradient(x: Any) -> Any:
    """times(z, z) with the rule owning its first argument: 2 * upstream * y there, and JAX's
    own upstream * z through the second (no scalar function has these partial derivatives,
    so the expected gradient is written out)."""
    z = x * W
    return W * (2 * V * z) + W * (V * z)


#: kind -> (the op on z, the proxy on z whose autodiff gives the expected gradients, or
#: the expected gradient of the loss itself where no proxy exists).
CASES: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "custom_backward": (cube, lambda z: z * z),
    "custom_backward owns=": (lambda z: times(z, z), _owns_gradient),
    "custom_backward residuals": (sine_scaled, lambda z: -jnp.cos(z)),
    "custom_backward once_differentiable": (cube_once, lambda z: z * z),
    "straight_through": (go.straight_through(jnp.round), lambda z: z),
    "straight_through clip": (
        go.straight_through(jnp.round, clip=(-1.0, 1.0)),
        lambda z: jnp.where(jnp.abs(z) <= 1, z, sg(z)),
    ),
    "straight_through surrogate": (
        go.straight_through(lambda z: jnp.sign(z), surrogate=jnp.tanh), jnp.tanh,
    ),
    "recipe: straight-through estimator": (ste_round(), lambda z: z),
    "recipe: learned step (lsq)": (
        lambda z: LSQ(z, jnp.asarray(STEP)), lambda z: _lsq_proxy(z, jnp.asarray(STEP)),
    ),
    "recipe: quantize": (quantize(4), lambda z: z),
    "recipe: surrogate spike": (spike("arctan"), _arctan_step),
    "recipe: stochastic spike": (
        lambda z: spike("leaky_relu", leak=0.1, spread=0.2)(z, noise=jnp.asarray(NOISE)),
        _leaky,
    ),
    "recipe: gradient flow": (reverse_grad(0.5), lambda z: -0.5 * z),
    "recipe: clipping": (clip_grad_norm(1.0), _clipped),
    "recipe: discrete choice": (
        lambda z: ste_argmax()(z.reshape(2, 4)).reshape(-1),
        lambda z: jax.nn.softmax(z.reshape(2, 4), axis=-1).reshape(-1),
    ),
}


def _loss(op: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda x: jnp.sum(op(x * W) * V)


#: The kinds whose expectation is the gradient itself, not a proxy.
_GRADIENTS = {"custom_backward owns="}


def _run(context: str, loss: Callable[[Any], Any], gradient: Callable[[Any], Any] | None = None
         ) -> Any:
    grad = jax.grad(loss) if gradient is None else gradient
    x = jnp.asarray(X)
    if context == "eager":
        return grad(x)
    if context == "jit":
        return jax.jit(grad)(x)
    if context == "vmap":
        # two examples, each the whole vector: per-example gradients of the same loss
        return jax.vmap(grad)(jnp.stack([x, x * 0.5]))
    assert context == "second derivative"
    return jax.grad(lambda x: jnp.sum(grad(x) * U))(x)


CELLS = [(kind, context) for kind, _ in JAX_KINDS for context, _ in JAX_CONTEXTS]


def test_every_kind_has_a_case() -> None:
    assert set(CASES) == {kind for kind, _ in JAX_KINDS}


@pytest.mark.parametrize(("kind", "context"), CELLS, ids=[f"{k} | {c}" for k, c in CELLS])
def test_cell(kind: str, context: str) -> None:
    op, proxy = CASES[kind]
    refusal = JAX_REFUSED.get((kind, context))
    if refusal is not None:
        with pytest.raises(GradOverrideError, match=refusal.match):
            _run(context, _loss(op))
        return
    got = np.asarray(_run(context, _loss(op)), dtype=np.float64)
    if kind in _GRADIENTS:
        want = np.asarray(_run(context, _loss(op), gradient=proxy), dtype=np.float64)
    else:
        want = np.asarray(_run(context, _loss(proxy)), dtype=np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=f"{kind} | {context}")
    assert np.any(want != 0) or context == "second derivative", "the cell checks nothing"


def test_lsq_step_gets_its_gradient_in_every_context() -> None:
    x = jnp.asarray(X)

    def loss(step: Any, x: Any, op: Callable[..., Any]) -> Any:
        return jnp.sum(op(x * W, step) * V)

    def proxy(z: Any, step: Any) -> Any:
        return _lsq_proxy(z, step)

    step = jnp.asarray(STEP)
    want = jax.grad(loss)(step, x, proxy)
    assert float(want) != 0
    for got in (
        jax.grad(loss)(step, x, LSQ),
        jax.jit(jax.grad(loss), static_argnums=2)(step, x, LSQ),
    ):
        np.testing.assert_allclose(float(got), float(want), rtol=2e-5)


def test_the_page_lists_the_jax_table() -> None:
    from gradoverride._support_matrix import markdown

    page = markdown()
    assert "## JAX" in page
    for kind, _ in JAX_KINDS:
        assert re.search(rf"^\| {re.escape(kind)} \|", page, re.M), kind
