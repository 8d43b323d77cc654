"""The clipping recipes under Keras' loss scaling: `scaler=` takes the Keras
`LossScaleOptimizer` (`model.optimizer` after `model.compile` under `mixed_float16`) for
TensorFlow gradients and clips the true gradient, as it takes torch's `GradScaler` for torch
ones. Every expected gradient is the true gradient (plain TensorFlow autograd of the same
loss, no loss scale) clipped by hand with numpy."""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
import torch
from tf_support import MODES, in_mode, tf

# isort: split
import keras  # after tf_support, which skips this module without TensorFlow

import gradoverride as go
from gradoverride import recipes

# True gradients of at most 0.2: times the scale 32768 they stay within float16's range.
X = np.array([[0.5, 1.0, -0.25], [-0.5, 0.25, 1.0]], dtype=np.float32)
TARGET = np.array([[0.5, 0.25], [-0.5, 0.5]], dtype=np.float32)
KERNEL = np.array([[0.5, -0.25], [0.125, 0.25], [-0.5, 0.375]], dtype=np.float32)
BIAS = np.array([0.25, -0.125], dtype=np.float32)


@pytest.fixture
def mixed_float16() -> Iterator[None]:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _true_gradients() -> list[np.ndarray]:
    """d/d(kernel, bias) of Keras' mean squared error, in float32 with no loss scale."""
    kernel, bias = tf.Variable(KERNEL), tf.Variable(BIAS)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.constant(X) @ kernel + bias - TARGET))
    return [g.numpy() for g in tape.gradient(loss, [kernel, bias])]


def _by_value(c: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda g: np.clip(g, -c, c)


def _by_norm(c: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda g: g * min(1.0, c / (float(np.linalg.norm(g)) + 1e-6))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("make", "by_hand"),
    [
        (lambda c, s: recipes.clip_grad_value(c, scaler=s), _by_value),
        (lambda c, s: recipes.clip_grad_norm(c, scaler=s), _by_norm),
    ],
    ids=["clip_grad_value", "clip_grad_norm"],
)
def test_a_hook_in_fit_under_mixed_float16_clips_the_true_gradient(
    mixed_float16: None, make: Any, by_hand: Any, mode: str
) -> None:
    c = 0.1
    true = _true_gradients()
    clipped = [by_hand(c)(g) for g in true]
    # The data make both kinds of entries: some beyond the bound, some within it.
    assert any(not np.allclose(g, k) for g, k in zip(true, clipped, strict=True))
    assert np.abs(true[0]).min() < c

    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(2)
    model = keras.Sequential([keras.Input((3,)), dense])
    dense.set_weights([KERNEL, BIAS])
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=1.0),
        loss="mse",
        run_eagerly=mode == "eager",
        jit_compile=mode == "xla",
    )
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    go.grad_hook(dense, make(c, model.optimizer), at="variables")
    model.fit(X, TARGET, batch_size=2, epochs=1, shuffle=False, verbose=0)

    assert float(model.optimizer.dynamic_scale.numpy()) == 32768.0  # the step was taken
    updates = [before - after for before, after in zip(
        [KERNEL, BIAS], [w.numpy() for w in dense.weights], strict=True)]
    # float16 forward and backward: the entries within the bound agree to float16 rounding;
    # scaled gradients clipped at 0.1/32768 would move each weight by at most 3.1e-6.
    for got, want in zip(updates, clipped, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3)


W = np.array([0.05, 0.5, -2.0, 3.0], dtype=np.float32)


def _scaled_gradient(clip: Any, optimizer: Any) -> Callable[[Any], Any]:
    """The gradient of `sum(clip(x) * W)` as Keras computes it under loss scaling: the loss
    multiplied by the optimizer's scale (`scale_loss`), the gradient divided by it."""

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = optimizer.scale_loss(tf.reduce_sum(clip(x) * W))
        return tape.gradient(loss, x) / tf.cast(optimizer.dynamic_scale, tf.float32)

    return step


def _loss_scale_optimizer() -> Any:
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    optimizer.build([keras.Variable(np.zeros(4, np.float32))])
    return optimizer


@pytest.mark.parametrize("mode", MODES)
def test_clip_grad_norm_with_a_loss_scale_optimizer_clips_the_true_gradient(mode: str) -> None:
    optimizer = _loss_scale_optimizer()
    step = in_mode(_scaled_gradient(recipes.clip_grad_norm(1.0, scaler=optimizer), optimizer),
                   mode)
    x = tf.zeros(4)
    want = W / (np.linalg.norm(W) + 1e-6)  # the true gradient W has norm > 1: rescaled
    np.testing.assert_allclose(step(x).numpy(), want, rtol=1e-5)
    # The scale is read in the graph: a traced step follows it as Keras changes it.
    optimizer.dynamic_scale.assign(1024.0)
    np.testing.assert_allclose(step(x).numpy(), want, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_clip_grad_value_with_a_loss_scale_optimizer_clips_the_true_gradient(mode: str) -> None:
    optimizer = _loss_scale_optimizer()
    step = in_mode(_scaled_gradient(recipes.clip_grad_value(0.1, scaler=optimizer), optimizer),
                   mode)
    x = tf.zeros(4)
    want = np.clip(W, -0.1, 0.1)
    np.testing.assert_allclose(step(x).numpy(), want, rtol=1e-6)
    optimizer.dynamic_scale.assign(65536.0)
    np.testing.assert_allclose(step(x).numpy(), want, rtol=1e-6)


def test_an_unbuilt_loss_scale_optimizer_clips_at_its_initial_scale() -> None:
    # Before its first step the optimizer scales the loss by `initial_scale`.
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0),
                                                    initial_scale=256.0)
    clip = recipes.clip_grad_value(0.1, scaler=optimizer)
    x = tf.zeros(4)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = optimizer.scale_loss(tf.reduce_sum(clip(x) * W))
    np.testing.assert_allclose((tape.gradient(loss, x) / 256.0).numpy(),
                               np.clip(W, -0.1, 0.1), rtol=1e-6)


# ---- the scalers mixed up -------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [recipes.clip_grad_value, recipes.clip_grad_norm])
def test_a_loss_scale_optimizer_on_a_torch_gradient_is_refused(recipe: Any) -> None:
    clip = recipe(1.0, scaler=_loss_scale_optimizer())
    x = torch.zeros(3, requires_grad=True)
    with pytest.raises(go.GradOverrideError, match=rf"{recipe.__name__}\(scaler=\.\.\.\) got a "
                       r"Keras LossScaleOptimizer, and this gradient is a torch tensor.*give "
                       r"the `torch.amp.GradScaler`"):
        clip(x).sum().backward()


@pytest.mark.parametrize("recipe", [recipes.clip_grad_value, recipes.clip_grad_norm])
def test_a_grad_scaler_on_a_tensorflow_gradient_names_the_keras_optimizer(recipe: Any) -> None:
    clip = recipe(1.0, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(go.GradOverrideError, match=rf"{recipe.__name__}\(scaler=\.\.\.\) got "
                       r"torch's GradScaler, and this gradient is TensorFlow's.*"
                       r"`scaler=model.optimizer`"):
        clip(tf.constant([1.0, 2.0]))


def test_a_plain_keras_optimizer_as_the_scaler_is_refused() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"clip_grad_value needs `scaler` to be "
                       r"the Keras LossScaleOptimizer.*got the Keras optimizer SGD, which "
                       r"scales no loss.*`mixed_float16`"):
        recipes.clip_grad_value(1.0, scaler=keras.optimizers.SGD(1.0))


def test_a_clip_holding_a_loss_scale_optimizer_copied_shares_it_and_saved_is_refused() -> None:
    optimizer = _loss_scale_optimizer()
    clip = recipes.clip_grad_norm(1.0, scaler=optimizer)
    assert copy.deepcopy(clip).scaler is optimizer  # an EMA copy: the same loss scale
    with pytest.raises(go.GradOverrideError, match=r"clip_grad_norm\(max_norm=1.0.*\) holds a "
                       r"LossScaleOptimizer and cannot be saved with it.*give the scaler"):
        pickle.dumps(clip)


def test_a_loss_scale_optimizer_of_another_keras_backend_is_refused_on_tensorflow() -> None:
    # Keras' backend is fixed at its import: a fresh interpreter runs it on torch.
    import subprocess
    import sys

    script = """
import numpy as np, tensorflow as tf, keras
from gradoverride import recipes
optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0))
optimizer.build([keras.Variable(np.zeros(2, np.float32))])
clip = recipes.clip_grad_value(0.1, scaler=optimizer)
x = tf.zeros(2)
with tf.GradientTape() as tape:
    tape.watch(x)
    y = tf.reduce_sum(clip(x))
tape.gradient(y, x)
"""
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode != 0
    assert ("GradOverrideError: clip_grad_value(scaler=...) got a Keras LossScaleOptimizer "
            "whose scale lives in Keras' 'torch' backend, and this gradient is TensorFlow's"
            ) in done.stderr
    assert "KERAS_BACKEND=tensorflow" in done.stderr
