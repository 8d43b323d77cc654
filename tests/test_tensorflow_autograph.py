"""No AutoGraph warning reaches the user from gradoverride: ops, straight-through estimators,
recipes and the Keras module side made and called inside a `tf.function` (and `model.fit`)
run as plain Python, not converted. And `straight_through` on TensorFlow gives variables
its forward reads or writes no gradient, as `tf.grad_pass_through` does."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
from tf_support import tf

# isort: split
import keras  # after tf_support, which skips this module without TensorFlow

import gradoverride as go
from gradoverride import recipes
from gradoverride.keras import Layer


@pytest.fixture
def tensorflow_log() -> Iterator[io.StringIO]:
    """What TensorFlow logs (AutoGraph's warnings go to the `tensorflow` logger)."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    logger = logging.getLogger("tensorflow")
    logger.addHandler(handler)
    try:
        yield buffer
    finally:
        logger.removeHandler(handler)


def test_ops_made_and_called_inside_a_tf_function_log_nothing(
    tensorflow_log: io.StringIO,
) -> None:
    @tf.function
    def step(x: Any) -> Any:
        plain = go.straight_through(lambda v: tf.round(v))
        clipped = go.straight_through(clip=1.0)(lambda v: tf.sign(v))
        ruled = go.custom_backward(lambda v: v * 2, backward=lambda g, *, v: g)
        owning = go.custom_backward(owns="v")(lambda v: v * 3)
        owning.backward(lambda g: g)
        spike = recipes.spike.preset("snntorch.atan")
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = plain(x) + clipped(x) + ruled(x) + owning(x) + spike(x)
            loss = tf.reduce_sum(y + recipes.reverse_grad()(x))
        return tape.gradient(loss, x)

    grad = step(tf.constant([0.3, 1.7])).numpy()
    # 1 + 1{|x|<=1} + 1 + 1 + arctan surrogate - 1
    sg = 1 / (1 + (np.pi * np.array([0.3, 1.7])) ** 2)
    np.testing.assert_allclose(grad, 1 + np.array([1.0, 0.0]) + 1 + 1 + sg - 1, rtol=1e-5)
    assert "AutoGraph" not in tensorflow_log.getvalue(), tensorflow_log.getvalue()


def test_the_keras_module_side_in_model_fit_logs_nothing(tensorflow_log: io.StringIO) -> None:
    class Scale(Layer):
        def build(self, input_shape: Any) -> None:
            self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

        def call(self, x: Any) -> Any:
            return x * self.w

        def backward(self, grad: Any, *, x: Any) -> Any:
            return {"x": grad * self.w, "w": grad * x}

    keras.utils.set_random_seed(0)
    dense, hooked = keras.layers.Dense(4), keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((3,)), Scale(), dense, hooked])
    go.override_backward(dense, lambda grad, *, inputs, layer: {
        "inputs": grad @ tf.transpose(layer.kernel), "kernel": tf.transpose(inputs) @ grad,
        "bias": tf.reduce_sum(grad, 0)})
    go.grad_hook(hooked, lambda g: 0.5 * g, at="variables")
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    data = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    model.fit(data, data[:, :1], batch_size=8, epochs=1, verbose=0)
    assert "AutoGraph" not in tensorflow_log.getvalue(), tensorflow_log.getvalue()


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_straight_through_of_a_variable_write_passes_the_gradient_through(mode: str) -> None:
    # `tf.grad_pass_through(v.assign)`'s case: the forward writes a variable and returns it;
    # the gradient goes to the input, the variable gets none.
    variable = tf.Variable([0.0, 0.0])

    def write(x: Any) -> Any:
        variable.assign(x)
        return tf.identity(variable)

    def grads(f: Any) -> Any:
        def step(x: Any) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(f(x) * [3.0, 4.0])
            return tape.gradient(loss, [x, variable])

        return step if mode == "eager" else tf.function(step)

    x = tf.constant([1.0, 2.0])
    gx, gv = grads(go.straight_through(write))(x)
    want_x, want_v = grads(tf.grad_pass_through(write))(x)
    np.testing.assert_array_equal(gx.numpy(), want_x.numpy())
    assert gv is None and want_v is None
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])
