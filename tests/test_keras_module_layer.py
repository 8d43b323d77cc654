"""`gradoverride.keras.Layer`: a Keras layer whose subclass defines `backward`, its variables
included. Every expected gradient is written out by hand or taken by a plain `GradientTape`
over the same math without the rule, in eager mode, `tf.function` and XLA."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
from tf_support import MODES, in_mode, tf

# isort: split
import keras  # after tf_support, which skips this module without TensorFlow

import gradoverride as go
from gradoverride.keras import Layer


class LayerWithCustomGrad(Layer):
    """The forum's layer: `x * weights`, with a rule for both."""

    def __init__(self, weight_scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.weight_scale = weight_scale

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(
            shape=(input_shape[-1],), initializer=keras.initializers.Constant([0.5, -2.0, 3.0]),
            name="weights",
        )

    def call(self, x: Any) -> Any:
        return x * self.w

    def backward(self, grad: Any, *, x: Any) -> Any:
        # `weight_scale` != 1 makes the rule differ from the true gradient, so a test can
        # tell the rule's gradient from TensorFlow's.
        return {"x": grad * self.w, "weights": self.weight_scale * grad * x}

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "weight_scale": self.weight_scale}


X = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]], dtype=np.float32)
UPSTREAM = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=np.float32) / 6


def _grads(layer: Any, mode: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """dL/dx and dL/d(each trainable variable) for L = sum(layer(x) * UPSTREAM)."""
    x = tf.constant(X)
    layer(x)  # build

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x) * UPSTREAM)
        return tape.gradient(loss, [x, *layer.trainable_variables])

    gx, *gv = in_mode(step, mode)(x)
    return gx.numpy(), [g.numpy() for g in gv]


@pytest.mark.parametrize("mode", MODES)
def test_the_forum_layer_gives_the_rules_gradients(mode: str) -> None:
    w = np.array([0.5, -2.0, 3.0], dtype=np.float32)
    gx, (gw,) = _grads(LayerWithCustomGrad(), mode)
    np.testing.assert_allclose(gx, UPSTREAM * w, rtol=1e-6)
    np.testing.assert_allclose(gw, (UPSTREAM * X).sum(0), rtol=1e-6)
    # A rule that is not the true gradient is what the variable gets.
    _, (gw3,) = _grads(LayerWithCustomGrad(weight_scale=3.0), mode)
    np.testing.assert_allclose(gw3, 3 * (UPSTREAM * X).sum(0), rtol=1e-6)


class Outer(Layer):
    """A sublayer's variables, by their names relative to this layer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(2, name="inner")

    def call(self, x: Any) -> Any:
        return self.inner(x)

    def backward(self, grad: Any, *, x: Any) -> Any:
        return {
            "x": grad @ tf.transpose(self.inner.kernel),
            "inner/kernel": tf.transpose(x) @ grad,
            "inner/bias": 2 * tf.reduce_sum(grad, axis=0),  # twice the true bias gradient
        }


@pytest.mark.parametrize("mode", MODES)
def test_sublayer_variables_are_named_relative_to_the_layer(mode: str) -> None:
    keras.utils.set_random_seed(0)
    outer = Outer(name="outer")
    upstream = tf.constant([[1.0, -1.0], [0.5, 2.0]])
    x = tf.constant(X)
    outer(x)

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(outer(x) * upstream)
        return tape.gradient(loss, [x, outer.inner.kernel, outer.inner.bias])

    gx, gk, gb = (g.numpy() for g in in_mode(step, mode)(x))
    kernel = outer.inner.kernel.numpy()
    np.testing.assert_allclose(gx, upstream.numpy() @ kernel.T, rtol=1e-6)
    np.testing.assert_allclose(gk, X.T @ upstream.numpy(), rtol=1e-6)
    np.testing.assert_allclose(gb, 2 * upstream.numpy().sum(0), rtol=1e-6)


class RoundedScale(Layer, owns="x"):
    """Owns only `x` (straight-through of the rounding); `w` keeps TensorFlow's gradient."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x: Any) -> Any:
        return tf.round(x) * self.w

    def backward(self, grad: Any) -> Any:
        return grad * self.w


@pytest.mark.parametrize("mode", MODES)
def test_owns_leaves_the_variables_their_tensorflow_gradient(mode: str) -> None:
    gx, (gw,) = _grads(RoundedScale(), mode)
    np.testing.assert_allclose(gx, UPSTREAM, rtol=1e-6)  # w == 1
    np.testing.assert_allclose(gw, (UPSTREAM * np.round(X)).sum(), rtol=1e-6)


@pytest.mark.parametrize("jit_compile", [True, False])
def test_model_fit_takes_the_rules_gradient(jit_compile: bool) -> None:
    # One full-batch SGD step (lr 1) on L = mean over the batch of sum(layer(x) * UPSTREAM):
    # the weights move by the rule's gradient, which is 3x the true one here.
    layer = LayerWithCustomGrad(weight_scale=3.0)
    model = keras.Sequential([keras.Input((3,)), layer])

    def loss(y_true: Any, y_pred: Any) -> Any:
        return tf.reduce_sum(y_pred * y_true, axis=-1)

    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss, jit_compile=jit_compile,
                  run_eagerly=not jit_compile)
    before = layer.w.numpy().copy()
    model.fit(X, UPSTREAM, batch_size=2, epochs=1, verbose=0, shuffle=False)
    expected = before - 3 * (UPSTREAM * X).sum(0) / 2
    np.testing.assert_allclose(layer.w.numpy(), expected, rtol=1e-5)


# Keras' saving calls np.array on TensorFlow variables, whose __array__ takes no `copy`.
@pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)
def test_a_saved_model_loads_with_its_rule(tmp_path: Path) -> None:
    keras.saving.register_keras_serializable("gradoverride_tests")(LayerWithCustomGrad)
    model = keras.Sequential([keras.Input((3,)), LayerWithCustomGrad(weight_scale=3.0)])
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    layer = loaded.layers[0]
    assert isinstance(layer, LayerWithCustomGrad) and layer.weight_scale == 3.0
    _, (gw,) = _grads(layer, "eager")
    np.testing.assert_allclose(gw, 3 * (UPSTREAM * X).sum(0), rtol=1e-6)


# ---- mistakes ----------------------------------------------------------------------------


def test_a_missing_or_misspelled_variable_is_named() -> None:
    class Forgets(LayerWithCustomGrad):
        def backward(self, grad: Any, *, x: Any) -> Any:
            return {"x": grad, "wieghts": grad * x}

    with pytest.raises(
        go.GradOverrideError,
        match=r"returned a dict without `weights`, a variable its forward reads \(it returned "
        r"`wieghts`, which names no variable the forward reads\); add \{'weights': gradient\}",
    ):
        _grads(Forgets(), "eager")


def test_a_gradient_for_something_else_is_named() -> None:
    class Extra(LayerWithCustomGrad):
        def backward(self, grad: Any, *, x: Any) -> Any:
            return {"x": grad, "weights": grad * x, "bias": grad}

    with pytest.raises(go.GradOverrideError, match=r"returned a gradient for `bias`, which is "
                       r"neither a parameter of `.*` nor a variable its forward reads"):
        _grads(Extra(), "eager")


def test_a_misspelled_backward_fails_when_the_class_is_made() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"`.*Doubler` subclasses "
                       r"gradoverride.keras.Layer but defines no `backward` \(did you mean "
                       r"`backwards`\? name it `backward`\)"):

        class Doubler(Layer):
            def call(self, x: Any) -> Any:
                return 2 * x

            def backwards(self, grad: Any) -> Any:
                return 2 * grad

    class Base(Layer, abstract=True):  # a base meant to be subclassed is fine
        pass

    assert issubclass(Base, keras.layers.Layer)


def test_owns_naming_a_variable_is_refused() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"`owns=` names `weights`, which "
                       r"`call` does not take; `owns=` names call inputs \(x\)"):

        class OwnsWeights(Layer, owns=("x", "weights")):
            def call(self, x: Any) -> Any:
                return x

            def backward(self, grad: Any) -> Any:
                return grad


def test_backward_naming_the_layer_is_refused() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"`backward` names `self`, the layer "
                       r"itself"):

        class NamesSelf(Layer):
            def call(self, x: Any) -> Any:
                return x

            def backward(this: Any, grad: Any, *, self: Any) -> Any:
                return grad
