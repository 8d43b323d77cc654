"""`go.bridge` on TensorFlow tensors: the same bridge, eagerly and inside `tf.function`
(through `tf.numpy_function`), with a numpy rule or an estimator; refused under XLA with a
message that says why. Expected gradients are the derivatives written out by hand."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tf_support import MODES, gradients, in_mode, tf

import gradoverride as go

_SINE = go.bridge(np.sin, backward=lambda grad, *, x: grad * np.cos(x))
_WEIGHTS = np.arange(1, 4, dtype=np.float32) / 3  # tf_support.gradients' upstream weights


def energy(v: Any, k: float = 1.0) -> Any:
    return np.sum(np.cos(k * v) * v)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_numpy_rule_gives_the_gradient(mode: str) -> None:
    x = tf.constant([0.0, 0.5, 2.0])
    out, (g,) = gradients(_SINE, x, mode=mode)
    assert out.dtype == tf.float32
    np.testing.assert_allclose(out.numpy(), np.sin(x.numpy()), rtol=1e-6)
    np.testing.assert_allclose(g.numpy(), _WEIGHTS * np.cos(x.numpy()), rtol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("backward", ["finite_differences", go.spsa(samples=2000, seed=0)])
def test_an_estimator_gives_the_gradient(mode: str, backward: Any) -> None:
    bridged = go.bridge(energy, backward=backward)
    v = tf.constant([0.0, 0.5, 1.0], dtype=tf.float64)

    def step(v: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(v)
            y = bridged(v, k=2.0)
        return y, tape.gradient(y, v)

    y, g = in_mode(step, mode)(v)
    exact = np.cos(2 * v.numpy()) - 2 * v.numpy() * np.sin(2 * v.numpy())
    np.testing.assert_allclose(float(y), energy(v.numpy(), 2.0), rtol=1e-12)
    tolerance = 1e-6 if backward == "finite_differences" else 0.1
    np.testing.assert_allclose(g.numpy(), exact, atol=tolerance)


def test_containers_and_variables_get_their_gradients() -> None:
    def total(xs: list[Any], scale: float, *, w: Any) -> Any:
        return (sum(np.sum(v**2) for v in xs) + np.sum(w)) * scale

    def rule(grad: Any, *, xs: list[Any], scale: float, w: Any) -> Any:
        return {"xs": [2 * scale * grad * v for v in xs], "w": scale * grad * np.ones_like(w)}

    bridged = go.bridge(total, backward=rule)
    a, b = tf.constant([1.0, 2.0]), tf.constant([3.0])
    w = tf.Variable([1.0, 1.0, 1.0])
    with tf.GradientTape() as tape:
        tape.watch([a, b])
        y = bridged([a, b], 2.0, w=w)
    ga, gb, gw = tape.gradient(y, [a, b, w])
    assert float(y) == pytest.approx((1 + 4 + 9 + 3) * 2)
    np.testing.assert_allclose(ga.numpy(), [4.0, 8.0])
    np.testing.assert_allclose(gb.numpy(), [12.0])
    np.testing.assert_allclose(gw.numpy(), [2.0, 2.0, 2.0])


def test_several_outputs_inside_a_tf_function_take_outputs() -> None:
    def polar(x: Any, y: Any) -> Any:
        return np.hypot(x, y), np.arctan2(y, x)

    def polar_rule(grad_r: Any, grad_phi: Any, *, x: Any, y: Any) -> Any:
        r2 = x**2 + y**2
        r = np.sqrt(r2)
        return grad_r * x / r - grad_phi * y / r2, grad_r * y / r + grad_phi * x / r2

    spec = tf.TensorSpec([2], tf.float32)
    bridged = go.bridge(polar, backward=polar_rule, outputs=(spec, spec))
    x, y = tf.constant([1.0, 0.0]), tf.constant([1.0, 2.0])

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch([x, y])
            r, phi = bridged(x, y)
            loss = tf.reduce_sum(r + phi)
        assert r.shape == (2,)
        return tape.gradient(loss, [x, y])

    gx, gy = step(x, y)
    xn, yn = x.numpy(), y.numpy()
    r2 = xn**2 + yn**2
    np.testing.assert_allclose(gx.numpy(), xn / np.sqrt(r2) - yn / r2, rtol=1e-6)
    np.testing.assert_allclose(gy.numpy(), yn / np.sqrt(r2) + xn / r2, rtol=1e-6)


def test_xla_is_refused_by_name() -> None:
    x = tf.constant([0.0, 1.0])
    with pytest.raises(go.GradOverrideError, match=r"`sin` is a go.bridge, which runs numpy "
                       r"code, so it cannot be compiled by XLA \(`jit_compile=True`\)"):
        in_mode(_SINE, "xla")(x)


def test_a_non_finite_output_is_named() -> None:
    def unbounded(x: Any) -> Any:
        return np.where(x > 0.5, np.inf, x)

    bridged = go.bridge(unbounded, backward=lambda grad, *, x: grad)
    with pytest.raises(go.GradOverrideError, match=r"`[^`]*unbounded` returned non-finite "
                       r"values in output 0"):
        bridged(tf.constant([0.0, 1.0]))


@go.custom_backward
def _numpy_sine(x: Any) -> Any:
    return tf.numpy_function(np.sin, [x], x.dtype)


@_numpy_sine.backward
def _(grad: Any, *, x: Any) -> Any:
    return grad * tf.cos(x)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "xla"])  # numpy cannot run in XLA
def test_tf_numpy_function_inside_custom_backward_works_too(mode: str) -> None:
    x = tf.constant([0.0, 0.5, 2.0])
    out, (g,) = gradients(_numpy_sine, x, mode=mode)
    np.testing.assert_allclose(out.numpy(), np.sin(x.numpy()), rtol=1e-6)
    np.testing.assert_allclose(g.numpy(), _WEIGHTS * np.cos(x.numpy()), rtol=1e-6)
