"""`go.bridge` at TensorFlow's edges: as a `tf.function` argument, differentiated twice,
under `tape.jacobian` and `tf.vectorized_map`, in a SavedModel, in a functional Keras model,
and its errors inside a `tf.function`; and the TensorFlow `ste_argmax` / `gumbel_softmax`
recipes along a leading axis. Expected values come from plain TensorFlow autograd of the
same math, or from numpy."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from tf_support import tf

import gradoverride as go

keras = pytest.importorskip("keras", reason="the Keras cases need Keras 3")


def _twice(grad: Any, *, x: Any) -> Any:
    return 2.0 * grad  # deliberately not sin's derivative: shows the rule was used


_SINE_RULE_2 = go.bridge(np.sin, backward=_twice)


def _scaled(x: Any) -> Any:
    """x * sum(x): every output depends on every input."""
    return x * np.sum(x)


def _scaled_rule(grad: Any, *, x: Any) -> Any:
    return grad * np.sum(x) + np.sum(grad * x)


_SCALED = go.bridge(_scaled, backward=_scaled_rule)


def _scaled_tf(x: Any) -> Any:
    return x * tf.reduce_sum(x)


# ---- a bridge as a tf.function argument ---------------------------------------------------


def test_a_bridge_passed_to_a_tf_function_keeps_its_rule() -> None:
    @tf.function
    def step(x: Any, f: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(f(x))
        return y, tape.gradient(y, x)

    x = tf.constant([0.0, 0.5, 2.0])
    y, g = step(x, _SINE_RULE_2)
    np.testing.assert_allclose(float(y), np.sum(np.sin(x.numpy())), rtol=1e-6)
    np.testing.assert_allclose(g.numpy(), [2.0, 2.0, 2.0])


# ---- differentiating the gradient again --------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_the_gradient_of_a_bridge_cannot_be_differentiated_again(mode: str) -> None:
    sine = go.bridge(np.sin, backward=lambda grad, *, x: grad * np.cos(x))

    def second(x: Any) -> Any:
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(sine(x))
            g = inner.gradient(y, x)
        return outer.gradient(g, x)

    run = second if mode == "eager" else tf.function(second)
    with pytest.raises(go.GradOverrideError, match=r"`sin` is a go.bridge, whose backward "
                       r"runs numpy code and records no graph, so its gradient cannot be "
                       r"differentiated again \(the backward is once-differentiable\)"):
        run(tf.constant([0.0, 0.5]))


# ---- tape.jacobian and tf.vectorized_map ---------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_the_jacobian_of_a_bridge(mode: str) -> None:
    def jacobian(f: Any, x: Any, use_pfor: bool) -> Any:
        # persistent: eagerly, TensorFlow's jacobian without pfor needs it
        with tf.GradientTape(persistent=not use_pfor) as tape:
            tape.watch(x)
            y = f(x)
        return tape.jacobian(y, x, experimental_use_pfor=use_pfor)

    x = tf.constant([0.5, -1.0, 2.0])
    run = jacobian if mode == "eager" else tf.function(jacobian)
    expected = jacobian(_scaled_tf, x, True).numpy()
    for use_pfor in (True, False):  # pfor (vectorized, the default) and a while loop
        got = run(_SCALED, x, use_pfor)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, err_msg=f"{use_pfor=}")


@pytest.mark.parametrize("backward", ["rule", "finite_differences"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_vectorized_map_over_a_bridge_gives_the_gradient(mode: str, backward: str) -> None:
    bridged = _SCALED if backward == "rule" else go.bridge(_scaled, backward=backward)
    weights = tf.constant([[1.0, 2.0, 3.0], [-1.0, 0.5, 4.0]], tf.float64)

    def step(f: Any, x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.vectorized_map(f, x)
            loss = tf.reduce_sum(y * weights)
        return y, tape.gradient(loss, x)

    x = tf.constant([[0.5, -1.0, 2.0], [1.0, 3.0, -0.25]], tf.float64)
    run = step if mode == "eager" else tf.function(step)
    y, g = run(bridged, x)
    y_expected, g_expected = step(_scaled_tf, x)
    np.testing.assert_allclose(y.numpy(), y_expected.numpy(), rtol=1e-12)
    np.testing.assert_allclose(g.numpy(), g_expected.numpy(), rtol=1e-6)


# ---- SavedModel -----------------------------------------------------------------------------

_EXPORT_REFUSAL = (
    r"`sin` is a go.bridge, which runs numpy code through `tf.numpy_function`, a callback "
    r"into this Python process: a SavedModel \(`model.export`, `tf.saved_model.save`\) "
    r"cannot hold it"
)


class _Sine(keras.layers.Layer):  # type: ignore[misc]
    def call(self, x: Any) -> Any:
        return _SINE_SPEC(x)


_SINE_SPEC = go.bridge(np.sin, backward=lambda grad, *, x: grad * np.cos(x),
                       outputs=tf.TensorSpec([None, 3], tf.float32))


def test_exporting_a_keras_model_with_a_bridge_is_refused(tmp_path: Any) -> None:
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(_Sine()(inputs)))
    model(np.ones((2, 3), np.float32))
    with pytest.raises(go.GradOverrideError, match=_EXPORT_REFUSAL):
        model.export(os.fspath(tmp_path / "model"))
    assert not (tmp_path / "model" / "saved_model.pb").exists()


def test_saving_a_traced_tf_function_with_a_bridge_is_refused(tmp_path: Any) -> None:
    class Holder(tf.Module):  # type: ignore[misc]
        @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)])
        def sine(self, x: Any) -> Any:
            return _SINE_SPEC(x)

    holder = Holder()
    holder.sine(tf.ones(3))  # traced before saving
    for options in (None, tf.saved_model.SaveOptions(experimental_custom_gradients=False)):
        with pytest.raises(go.GradOverrideError, match=_EXPORT_REFUSAL):
            tf.saved_model.save(holder, os.fspath(tmp_path / "saved"), options=options)


# ---- errors inside a tf.function -------------------------------------------------------------


def test_an_error_inside_a_tf_function_says_how_to_get_it_as_itself() -> None:
    def unbounded(x: Any) -> Any:
        return np.where(x > 0.5, np.inf, x)

    bridged = go.bridge(unbounded, backward=lambda grad, *, x: grad)
    with pytest.raises(tf.errors.OpError) as caught:
        tf.function(bridged)(tf.constant([0.0, 1.0]))
    text = str(caught.value)
    assert "GradOverrideError: `" in text
    assert "unbounded` returned non-finite values in output 0" in text
    assert (
        "(Raised inside a tf.function by go.bridge `" in text
        and "call it eagerly (`tf.config.run_functions_eagerly(True)`) to get this "
        "GradOverrideError itself.)" in text
    )


# ---- functional Keras models ---------------------------------------------------------------


def test_a_bridge_on_a_keras_input_asks_for_a_layer_and_outputs() -> None:
    with pytest.raises(go.GradOverrideError, match=r"`sin` is a go.bridge, and its argument "
                       r"`x` is a symbolic KerasTensor .* pass `outputs=` to go.bridge"):
        _SINE_RULE_2(keras.Input((3,)))


def test_a_layer_calling_a_bridge_without_outputs_asks_for_them() -> None:
    sine = go.bridge(np.sin, backward=lambda grad, *, x: grad * np.cos(x))

    class Sine(keras.layers.Layer):  # type: ignore[misc]
        def call(self, x: Any) -> Any:
            return sine(x)

    with pytest.raises(go.GradOverrideError, match=r"`sin` is a go.bridge, and Keras is "
                       r"inferring the output shape .* Pass `outputs=` to go.bridge"):
        Sine()(keras.Input((3,)))

    # With `outputs=`, the model builds and its gradient is the rule's.
    inputs = keras.Input((3,))
    model = keras.Model(inputs, _Sine()(inputs))
    x = tf.constant([[0.0, 0.5, 2.0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(model(x))
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), np.cos(x.numpy()), rtol=1e-6)


# ---- discrete recipes along a leading axis ---------------------------------------------------


def _one_hot_np(scores: np.ndarray[Any, Any], dim: int) -> np.ndarray[Any, Any]:
    out = np.zeros_like(scores)
    np.put_along_axis(out, np.expand_dims(np.argmax(scores, axis=dim), dim), 1.0, axis=dim)
    return out


_WEIGHTS3 = np.arange(1, 25, dtype=np.float32).reshape(2, 3, 4) / 24


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_ste_argmax_along_a_leading_axis(mode: str) -> None:
    x = tf.constant(np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32))

    def step(f: Any, x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = f(x)
            loss = tf.reduce_sum(y * _WEIGHTS3)
        return y, tape.gradient(loss, x)

    run = step if mode == "eager" else tf.function(step)
    for dim in (-2, 0, 1):
        y, g = run(go.recipes.ste_argmax(dim=dim, temperature=0.5), x)
        _, g_expected = step(lambda v, dim=dim: tf.nn.softmax(v / 0.5, axis=dim), x)
        np.testing.assert_array_equal(y.numpy(), _one_hot_np(x.numpy(), dim), f"{dim=}")
        np.testing.assert_allclose(g.numpy(), g_expected.numpy(), rtol=1e-5, atol=1e-7,
                                   err_msg=f"{dim=}")


def test_gumbel_softmax_along_a_leading_axis() -> None:
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(2, 3, 4)).astype(np.float32))
    noise = tf.constant(rng.gumbel(size=(2, 3, 4)).astype(np.float32))
    for dim in (-2, 0):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = go.recipes.gumbel_softmax(temperature=2.0, dim=dim)(x, noise=noise)
            loss = tf.reduce_sum(y * _WEIGHTS3)
        g = tape.gradient(loss, x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            soft = tf.nn.softmax((x + noise) / 2.0, axis=dim)
            loss = tf.reduce_sum(soft * _WEIGHTS3)
        np.testing.assert_array_equal(y.numpy(), _one_hot_np((x + noise).numpy(), dim),
                                      f"{dim=}")
        np.testing.assert_allclose(g.numpy(), tape.gradient(loss, x).numpy(), rtol=1e-5,
                                   atol=1e-7, err_msg=f"{dim=}")
