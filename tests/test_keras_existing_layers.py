"""`go.override_backward` and `go.grad_hook` on existing Keras 3 layers. Every expected
gradient is written out by hand (the rules here differ from the true gradient on purpose, so
the rule's gradient cannot be mistaken for TensorFlow's), in eager mode, `tf.function` and
XLA."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
from tf_support import MODES, in_mode, tf

# isort: split
import keras  # after tf_support, which skips this module without TensorFlow

import gradoverride as go
from gradoverride import recipes
from gradoverride.keras import Layer

X = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]], dtype=np.float32)
UP = np.array([[1.0, -2.0], [0.5, 3.0]], dtype=np.float32)


def _dense() -> Any:
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(2)
    layer(tf.constant(X))
    return layer


def _grads(layer: Any, mode: str = "eager") -> list[np.ndarray]:
    """dL/dx, dL/dkernel, dL/dbias for L = sum(layer(x) * UP)."""

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x) * UP)
        return tape.gradient(loss, [x, layer.kernel, layer.bias])

    return [g.numpy() for g in in_mode(step, mode)(tf.constant(X))]


def _true(layer: Any) -> list[np.ndarray]:
    kernel = layer.kernel.numpy()
    return [UP @ kernel.T, X.T @ UP, UP.sum(0)]


def ten_times_kernel(grad: Any, *, inputs: Any, layer: Any) -> Any:
    """Dense's gradients, the kernel's ten times the true one."""
    return {
        "inputs": grad @ tf.transpose(layer.kernel),
        "kernel": 10 * tf.transpose(inputs) @ grad,
        "bias": tf.reduce_sum(grad, axis=0),
    }


# Each `_grads` call in "function" or "xla" mode traces a fresh `tf.function` and drops it;
# removing the hook afterwards is then safe, though gradoverride cannot tell (it warns).
_FRESH_TRACES = pytest.mark.filterwarnings(
    "ignore:.*was removed after .* was traced:gradoverride.GradOverrideWarning"
)


@_FRESH_TRACES
@pytest.mark.parametrize("mode", MODES)
def test_override_backward_gives_a_dense_layer_the_rules_gradients(mode: str) -> None:
    layer = _dense()
    variables = list(layer.trainable_variables)
    gx, gk, gb = _true(layer)
    handle = go.override_backward(layer, ten_times_kernel)
    got = _grads(layer, mode)
    np.testing.assert_allclose(got[0], gx, rtol=1e-5)
    np.testing.assert_allclose(got[1], 10 * gk, rtol=1e-5)
    np.testing.assert_allclose(got[2], gb, rtol=1e-5)
    assert type(layer) is keras.layers.Dense and list(layer.trainable_variables) == variables
    assert handle.active
    handle.remove()
    handle.remove()  # twice: nothing
    assert not handle.active and "call" not in layer.__dict__
    for g, want in zip(_grads(layer, mode), (gx, gk, gb), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-5)


def test_override_owns_the_inputs_only() -> None:
    layer = _dense()
    gx, gk, gb = _true(layer)
    with go.override_backward(layer, lambda grad, *, inputs: -grad @ tf.transpose(
            layer.kernel), owns="inputs"):
        got = _grads(layer)
    np.testing.assert_allclose(got[0], -gx, rtol=1e-5)
    np.testing.assert_allclose(got[1], gk, rtol=1e-5)  # TensorFlow's own
    np.testing.assert_allclose(got[2], gb, rtol=1e-5)


@pytest.mark.parametrize("jit_compile", [True, False])
def test_override_inside_a_model_trains_with_the_rule(jit_compile: bool) -> None:
    layer = _dense()
    inputs = keras.Input((3,))
    model = keras.Model(inputs, layer(inputs))
    go.override_backward(layer, ten_times_kernel)

    def loss(y_true: Any, y_pred: Any) -> Any:
        return tf.reduce_sum(y_pred * y_true, axis=-1)

    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss, jit_compile=jit_compile,
                  run_eagerly=not jit_compile)
    kernel = layer.kernel.numpy().copy()
    model.fit(X, UP, batch_size=2, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(layer.kernel.numpy(), kernel - 10 * (X.T @ UP) / 2, rtol=1e-5)


@_FRESH_TRACES
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("at", ["inputs", "outputs", "variables"])
def test_grad_hook_transforms_at_each_place(mode: str, at: str) -> None:
    layer = _dense()
    gx, gk, gb = _true(layer)
    with go.grad_hook(layer, lambda g: 3 * g, at=at):
        got = _grads(layer, mode)
    want = {
        "inputs": (3 * gx, gk, gb),
        "outputs": (3 * gx, 3 * gk, 3 * gb),  # the upstream of the whole layer
        "variables": (gx, 3 * gk, 3 * gb),
    }[at]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5)
    assert "call" not in layer.__dict__


@_FRESH_TRACES
@pytest.mark.parametrize("at", ["inputs", "outputs", "variables"])
def test_a_recipe_is_a_grad_hook_transform(at: str) -> None:
    layer = _dense()
    gx, gk, gb = _true(layer)
    with go.grad_hook(layer, recipes.reverse_grad(scale=0.5), at=at):
        got = _grads(layer, "function")
    k = -0.5
    want = {"inputs": (k * gx, gk, gb), "outputs": (k * gx, k * gk, k * gb),
            "variables": (gx, k * gk, k * gb)}[at]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5)


def test_hooks_stay_outside_an_override_and_come_off_in_any_order() -> None:
    layer = _dense()
    gx, gk, gb = _true(layer)
    hook = go.grad_hook(layer, lambda g: 2 * g, at="outputs")
    override = go.override_backward(layer, ten_times_kernel)  # installed after the hook
    got = _grads(layer)
    # The hook doubles the upstream gradient the rule receives.
    for g, w in zip(got, (2 * gx, 20 * gk, 2 * gb), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5)
    hook.remove()
    for g, w in zip(_grads(layer), (gx, 10 * gk, gb), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5)
    inner = go.grad_hook(layer, lambda g: -g, at="variables")
    override.remove()
    for g, w in zip(_grads(layer), (gx, -gk, -gb), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5)
    inner.remove()
    assert "call" not in layer.__dict__


# ---- mistakes ----------------------------------------------------------------------------


def test_overriding_twice_is_refused() -> None:
    layer = _dense()
    go.override_backward(layer, ten_times_kernel)
    with pytest.raises(go.GradOverrideError, match=r"override_backward: the Dense `dense\w*` "
                       r"already has an override; call `.remove\(\)` on its handle"):
        go.override_backward(layer, ten_times_kernel)


def test_a_gradoverride_layer_is_not_overridden() -> None:
    class Own(Layer):
        def call(self, x: Any) -> Any:
            return x

        def backward(self, grad: Any) -> Any:
            return grad

    with pytest.raises(go.GradOverrideError, match=r"`Own` is a gradoverride.keras.Layer with "
                       r"its own backward; change that method"):
        go.override_backward(Own(), ten_times_kernel)


def test_a_rule_missing_a_variable_names_it() -> None:
    layer = _dense()
    go.override_backward(layer, lambda grad, *, inputs, layer: {
        "inputs": grad @ tf.transpose(layer.kernel), "kernel": tf.transpose(inputs) @ grad})
    with pytest.raises(go.GradOverrideError, match=r"returned a dict without `bias`, a "
                       r"variable its forward reads"):
        _grads(layer)


def test_owns_naming_a_variable_is_refused() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"`owns=` names `kernel`, which the "
                       r"layer's `call` does not take; `owns=` names call inputs "
                       r"\(inputs, training\)"):
        go.override_backward(_dense(), ten_times_kernel, owns=("inputs", "kernel"))


def test_grad_hook_at_parameters_on_a_keras_layer_says_variables() -> None:
    with pytest.raises(go.GradOverrideError, match=r"grad_hook got at='parameters' for the "
                       r"Keras layer Dense \(on a Keras layer, the parameters are its "
                       r"variables\); expected one of 'inputs', 'outputs', 'variables'"):
        go.grad_hook(_dense(), lambda g: g, at="parameters")  # type: ignore[arg-type]
