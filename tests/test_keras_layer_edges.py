"""`go.override_backward` and `go.grad_hook` on Keras layers at the edges: a tensor passed as
two arguments, transforms returning the wrong thing, sparse gradients, mixed precision,
copies, removal next to someone else's `call`, installing after tracing, a leak, and the
texts of the errors. Expected gradients are plain TensorFlow autograd of the same math or
worked out by hand."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import textwrap
import tracemalloc
import warnings
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
from tf_support import tf

# isort: split
import keras  # after tf_support, which skips this module without TensorFlow

import gradoverride as go
import gradoverride.keras
from gradoverride import recipes
from gradoverride.keras import Layer

X = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]], dtype=np.float32)


def _dense(units: int = 2) -> Any:
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(units)
    layer(tf.constant(X))
    return layer


def _kernel_grad(layer: Any, x: Any = X) -> Any:
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant(x)))
    return tape.gradient(loss, layer.kernel)


# ---- silently wrong gradients ----------------------------------------------------------


def test_a_tensor_fed_to_two_arguments_is_not_counted_twice_at_the_variables() -> None:
    keras.utils.set_random_seed(1)
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    h = tf.constant(np.random.default_rng(0).normal(size=(2, 3, 4)), tf.float32)
    mha(h, h)

    def grads() -> list[Any]:
        with tf.GradientTape() as tape:
            tape.watch(h)
            loss = tf.reduce_sum(mha(h, h) ** 2)
        return tape.gradient(loss, [h, *mha.trainable_variables])

    want = grads()  # TensorFlow's own: no hook
    with go.grad_hook(mha, lambda g: g, at="variables"):
        got = grads()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (lambda g: tf.cast(g, tf.int32), r"the transform .* of the grad_hook at 'variables' of "
         r"the Dense `dense\w*` returned a gradient of dtype int32 for `kernel`, which has "
         r"dtype float32"),
        (lambda g: np.zeros(3), r"the transform .* of the grad_hook at 'variables' of the "
         r"Dense `dense\w*` returned a ndarray for `(kernel|bias)`; expected a tensor"),
        (lambda g: tf.zeros((7,)), r"returned a gradient of shape \(7,\) for `(kernel|bias)`"),
    ],
)
def test_a_variables_transform_result_is_checked(result: Any, match: str) -> None:
    layer = _dense()
    go.grad_hook(layer, result, at="variables")
    with pytest.raises(go.GradOverrideError, match=match):
        _kernel_grad(layer)


def test_an_inputs_transform_error_names_the_layer_and_the_hook() -> None:
    layer = _dense()

    def first_row(grad: Any) -> Any:
        return grad[0]

    go.grad_hook(layer, first_row, at="inputs")
    x = tf.constant(X)
    with pytest.raises(go.GradOverrideError, match=r"the transform .*first_row of the "
                       r"grad_hook at 'inputs' of the Dense `dense\w*` returned a gradient of "
                       r"shape \(3,\) for `argument 0`, which has shape \(2, 3\)"):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        tape.gradient(y, x)


# ---- sparse gradients --------------------------------------------------------------------


def _embedding_grad(hook: Any) -> Any:
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(6, 2)
    ids = tf.constant([[1, 2, 1]])
    embedding(ids)
    with go.grad_hook(embedding, hook, at="variables"):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(embedding(ids) * tf.constant([[[1.0], [0.25], [1.0]]]))
        grad = tape.gradient(loss, embedding.embeddings)
    return tf.convert_to_tensor(grad).numpy()


def test_an_embeddings_sparse_gradient_reaches_a_function_dense() -> None:
    seen = []

    def half(grad: Any) -> Any:
        seen.append(type(grad))
        return grad * 0.5

    got = _embedding_grad(half)
    # Row 1 is used twice (1 + 1), row 2 once (0.25); every other row gets nothing.
    want = np.zeros((6, 2), np.float32)
    want[1], want[2] = 0.5 * 2.0, 0.5 * 0.25
    np.testing.assert_allclose(got, want)
    assert all(issubclass(t, tf.Tensor) for t in seen)


def test_a_recipe_clips_an_embeddings_whole_gradient() -> None:
    got = _embedding_grad(recipes.clip_grad_value(0.5))
    # The sum over repeated rows is clipped (2.0 -> 0.5), not each occurrence (1.0 -> 0.5
    # twice, 1.0).
    want = np.zeros((6, 2), np.float32)
    want[1], want[2] = 0.5, 0.25
    np.testing.assert_allclose(got, want)


# ---- mixed precision ---------------------------------------------------------------------


@pytest.fixture
def mixed_float16() -> Iterator[None]:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_an_override_rule_reads_variables_in_the_compute_dtype(mixed_float16: None) -> None:
    dense = keras.layers.Dense(2)
    x = tf.constant([[1.0, 2.0, 3.0]])
    dense(x)
    dtypes = []

    def ten_times_kernel(grad: Any, *, inputs: Any, layer: Any) -> Any:
        dtypes.append(layer.kernel.dtype)
        return {
            "inputs": grad @ tf.transpose(layer.kernel),
            "kernel": 10 * tf.transpose(inputs) @ grad,
            "bias": tf.reduce_sum(grad, axis=0),
        }

    with go.override_backward(dense, ten_times_kernel):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(dense(x), tf.float32))
        kernel_grad = tape.gradient(loss, dense.kernel)
    assert dtypes == ["float16"]
    assert kernel_grad.dtype == tf.float32  # the variable's dtype
    np.testing.assert_allclose(kernel_grad.numpy()[:, 0], [10.0, 20.0, 30.0])


def test_a_keras_layer_backward_reads_variables_in_the_compute_dtype(
    mixed_float16: None,
) -> None:
    class Scale(Layer):
        def build(self, input_shape: Any) -> None:
            self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

        def call(self, x: Any) -> Any:
            return x * self.w

        def backward(self, grad: Any, *, x: Any) -> Any:
            return {"x": grad * self.w, "w": tf.reduce_sum(3 * grad * x, axis=0)}

    layer = Scale()
    x = tf.constant([[1.0, 2.0]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.cast(layer(x), tf.float32))
    np.testing.assert_allclose(tape.gradient(loss, layer.w).numpy(), [3.0, 6.0])


# ---- copies and removal ------------------------------------------------------------------


@pytest.mark.parametrize("copier", ["deepcopy", "clone_model"])
def test_copy_overrides_installs_them_again_on_a_keras_copy(copier: str) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="hidden"),
                              keras.layers.Dense(1, name="head")])
    hidden, head = model.layers

    def ten_times_kernel(grad: Any, *, inputs: Any, layer: Any) -> Any:
        return {"inputs": grad @ tf.transpose(layer.kernel),
                "kernel": 10 * tf.transpose(inputs) @ grad, "bias": None}

    go.override_backward(hidden, ten_times_kernel)
    go.grad_hook(head, lambda g: -g, at="variables")
    if copier == "deepcopy":
        with warnings.catch_warnings():
            # Keras' own saving, under numpy 2: not ours.
            warnings.simplefilter("ignore", DeprecationWarning)
            twin = copy.deepcopy(model)
    else:
        twin = keras.models.clone_model(model)
        twin.set_weights(model.get_weights())
    # Keras copies by saving and loading: nothing installed on the instances comes along.
    assert len(go.overrides(twin)) == 0
    handles = go.keras.copy_overrides(model, twin)
    assert [h.active for h in handles] == [True, True]
    assert [r.kind for r in go.overrides(twin)] == [r.kind for r in go.overrides(model)]

    def grads(m: Any) -> list[Any]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(m(tf.constant(X)))
        return tape.gradient(loss, [m.layers[0].kernel, m.layers[1].kernel])

    # Independent: plain autograd of the same model, then the rule's and the hook's factors.
    plain = keras.models.clone_model(model)
    plain.set_weights(model.get_weights())
    want = grads(plain)
    got = grads(twin)
    np.testing.assert_allclose(got[0].numpy(), 10 * want[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1].numpy(), -want[1].numpy(), rtol=1e-5, atol=1e-5)


def test_copy_overrides_names_a_layer_the_target_lacks() -> None:
    source = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="hidden")])
    go.grad_hook(source.layers[0], lambda g: g, at="outputs")
    target = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="other")])
    with pytest.raises(go.GradOverrideError, match=r"copy_overrides: `hidden` is a Dense with "
                       r"overrides or hooks in the source, and nothing in the target"):
        go.keras.copy_overrides(source, target)


def test_removal_puts_back_the_layers_own_instance_call() -> None:
    layer = _dense()

    def own_call(inputs: Any, training: Any = None) -> Any:
        return 2 * keras.layers.Dense.call(layer, inputs)

    object.__setattr__(layer, "call", own_call)
    handle = go.grad_hook(layer, lambda g: g, at="outputs")
    handle.remove()
    assert layer.__dict__["call"] is own_call
    np.testing.assert_allclose(_kernel_grad(layer).numpy(), 2 * _kernel_grad(_dense()).numpy())


def test_removal_under_someone_elses_wrapper_stops_the_hook() -> None:
    layer = _dense()
    want = _kernel_grad(_dense()).numpy()
    handle = go.grad_hook(layer, lambda g: 5 * g, at="outputs")
    below = layer.call
    object.__setattr__(layer, "call", lambda *a, **k: below(*a, **k))  # a wrapper on top
    handle.remove()
    assert not handle.active
    np.testing.assert_allclose(_kernel_grad(layer).numpy(), want, rtol=1e-6)
    assert len(go.overrides(layer)) == 0
    again = go.grad_hook(layer, lambda g: 7 * g, at="outputs")  # reuses the pass-through
    np.testing.assert_allclose(_kernel_grad(layer).numpy(), 7 * want, rtol=1e-6)
    assert again.active


# ---- tracing -----------------------------------------------------------------------------


def test_installing_after_fit_traced_the_layer_warns() -> None:
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((3,)), dense])
    model.compile("sgd", "mse", jit_compile=False)
    first = go.grad_hook(dense, lambda g: g, at="outputs")
    model.fit(X, np.ones((2, 1)), verbose=0)
    with pytest.warns(go.GradOverrideWarning, match=r"grad_hook\(Dense `dense\w*`, .*at="
                      r"'variables'\) was installed after the Dense `dense\w*` was traced into "
                      r"a `tf.function`.*`model.compile\(...\)` again before the next `fit`"):
        go.grad_hook(dense, recipes.reverse_grad(), at="variables")
    with pytest.warns(go.GradOverrideWarning, match=r"was removed after"):
        first.remove()


def test_building_a_functional_model_is_not_a_trace() -> None:
    dense = keras.layers.Dense(1)
    go.grad_hook(dense, lambda g: g, at="outputs")
    inputs = keras.Input((3,))
    keras.Model(inputs, dense(inputs))  # Keras runs the call on symbolic tensors
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        go.grad_hook(dense, lambda g: 2 * g, at="outputs")


# ---- leak --------------------------------------------------------------------------------


def test_installing_and_removing_around_each_step_keeps_nothing() -> None:
    layer = _dense()
    x = tf.constant(X)

    def step() -> None:
        with go.grad_hook(layer, lambda g: 2 * g, at="outputs"):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(x))
            tape.gradient(loss, layer.trainable_variables)

    for _ in range(20):
        step()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(200):
            step()
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    ours = tracemalloc.Filter(True, "*gradoverride*")
    grown = sum(
        stat.size_diff
        for stat in after.filter_traces([ours]).compare_to(
            before.filter_traces([ours]), "filename"
        )
    )
    assert grown < 200 * 64, f"{grown} bytes kept by gradoverride over 200 steps"


# ---- layers and backends -----------------------------------------------------------------


def test_a_layer_inheriting_call_from_a_keras_layer_gets_its_backward() -> None:
    keras.utils.set_random_seed(0)

    class QDense(Layer, keras.layers.Dense):
        def backward(self, grad: Any, *, inputs: Any) -> Any:
            return {
                "inputs": grad @ tf.transpose(self.kernel),
                "kernel": 4 * tf.transpose(inputs) @ grad,
                "bias": None,
            }

    layer = QDense(2)
    x = tf.constant(X)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x))
    kernel_grad, bias_grad = tape.gradient(loss, [layer.kernel, layer.bias])
    np.testing.assert_allclose(kernel_grad.numpy(), 4 * X.T @ np.ones((2, 2), np.float32))
    assert bias_grad is None


def test_a_keras_layer_on_the_torch_backend_is_refused_by_name() -> None:
    pytest.importorskip("keras")
    script = textwrap.dedent(
        """
        import os
        os.environ["KERAS_BACKEND"] = "torch"
        import keras, torch
        import gradoverride as go
        layer = keras.layers.Dense(3)
        layer(torch.ones(2, 4))
        for call in (lambda: go.grad_hook(layer, lambda g: g, at="variables"),
                     lambda: go.override_backward(layer, lambda g, *, inputs: g)):
            try:
                call()
            except go.GradOverrideError as error:
                print(error)
        """
    )
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 2, done.stdout + done.stderr
    assert lines[0].startswith("grad_hook: the Keras layer Dense `dense` runs on Keras' "
                               "'torch' backend; gradoverride supports Keras layers on the "
                               "TensorFlow backend only for installing a rule or a hook on "
                               "an existing layer. Set KERAS_BACKEND=tensorflow")
    assert "write the layer as a `gradoverride.keras.Layer` subclass" in lines[0]
    assert lines[1].startswith("override_backward: the Keras layer Dense `dense` runs on")


def test_a_clip_under_a_mirrored_strategy_warns_and_a_scale_does_not() -> None:
    # Logical devices must be set before TensorFlow first uses the CPU: a fresh process.
    script = textwrap.dedent(
        """
        import os, warnings
        import numpy as np
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import keras
        import gradoverride as go
        from gradoverride import recipes
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        for transform in (recipes.clip_grad_value(0.05), recipes.reverse_grad()):
            with strategy.scope():
                dense = keras.layers.Dense(1)
                model = keras.Sequential([keras.Input((3,)), dense])
                model.compile("sgd", "mse", jit_compile=False)
            go.grad_hook(dense, transform, at="variables")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=4, verbose=0)
            print("WARNED", sum(issubclass(w.category, go.GradOverrideWarning)
                                for w in caught))
            for w in caught:
                if issubclass(w.category, go.GradOverrideWarning):
                    print("TEXT", w.message)
        """
    )
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = [line for line in done.stdout.splitlines() if line.startswith("WARNED")]
    assert counts == ["WARNED 1", "WARNED 0"], done.stdout
    text = next(line for line in done.stdout.splitlines() if line.startswith("TEXT"))
    assert "runs on each replica's share of the gradient, before MirroredStrategy sums the 2 " \
        "shares: clip_grad_value(clip_value=0.05) bounds each share" in text, text
    assert "`clipvalue=`, `clipnorm=` or `global_clipnorm=`" in text


# ---- frozen layers and the texts naming what a rule returns ------------------------------


class _Scale(Layer):
    """x * w, whose rule gives the variables by `self.trainable_variables` (the documented
    idiom) and twice the true gradient to x."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x: Any) -> Any:
        return x * self.w

    def backward(self, grad: Any, *, x: Any) -> Any:
        rest = {v.path.rsplit("/", 1)[-1]: tf.reduce_sum(grad * x, axis=0)
                for v in self.trainable_variables}
        return {"x": 2 * grad * self.w, **rest}


def test_a_frozen_layer_with_its_own_backward_trains_in_fit() -> None:
    keras.utils.set_random_seed(0)
    scale = _Scale()
    head = keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")
    model = keras.Sequential([keras.Input((3,)), scale, head])
    scale.trainable = False
    model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False)
    x = np.array([[1.0, 2.0, 3.0]], np.float32)
    y = np.array([[0.0]], np.float32)
    model.fit(x, y, epochs=1, verbose=0)
    np.testing.assert_allclose(scale.w.numpy(), [1.0, 1.0, 1.0])  # frozen: unchanged
    # The head's update is plain SGD on the mse: prediction 6, d(loss)/d(kernel) = 2*6*x.
    np.testing.assert_allclose(head.kernel.numpy()[:, 0], 1.0 - 0.1 * 12.0 * x[0], rtol=1e-6)


def test_a_rule_missing_variables_is_told_the_names_it_can_return() -> None:
    class Partial(_Scale):
        def backward(self, grad: Any, *, x: Any) -> Any:
            return grad * self.w  # a tensor: the variable `w` is not given

    layer = Partial()
    x = tf.constant(X)
    with pytest.raises(go.GradOverrideError) as caught:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        tape.gradient(y, x)
    text = str(caught.value)
    assert "in a dict by name: {'x': ..., 'w': ...}; or declare what the rule owns " \
        "(`owns='x'`, say)" in text, text
    assert "'self'" not in text


def test_an_override_rule_is_not_told_to_return_the_layer_or_training() -> None:
    layer = _dense()
    go.override_backward(layer, lambda grad, *, inputs, layer: grad @ tf.transpose(
        layer.kernel))
    with pytest.raises(go.GradOverrideError) as caught:
        _kernel_grad(layer)
    text = str(caught.value)
    assert "{'inputs': ..., 'kernel': ..., 'bias': ...}" in text, text
    assert "(`owns='inputs'`, say)" in text
    assert "'self'" not in text and "'training'" not in text


# ---- found by a hostile review -----------------------------------------------------------


def test_a_keras_variable_passed_as_an_argument_to_a_hooked_layer() -> None:
    class Scale(keras.layers.Layer):
        def call(self, x: Any, w: Any) -> Any:
            return x * w

    layer = Scale()
    w = keras.Variable([[2.0, 4.0]])
    x = tf.constant([[3.0, 2.0]])
    for at in ("inputs", "variables"):
        with go.grad_hook(layer, lambda g: 2 * g, at=at):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.reduce_sum(layer(x, w))
            gx = tape.gradient(y, x)
        want = [[4.0, 8.0]] if at == "inputs" else [[2.0, 4.0]]  # the variable is read
        np.testing.assert_allclose(gx.numpy(), want)


def test_jacobian_through_a_recipe_hooked_at_the_variables() -> None:
    layer = _dense()
    x = tf.constant(X)
    with go.grad_hook(layer, recipes.scale_grad(3.0), at="variables"):
        with tf.GradientTape() as tape:
            y = layer(x)
        jacobian = tape.jacobian(y, layer.kernel)
    # y[b, j] = sum_i x[b, i] k[i, j] + c[j]: d y[b, j] / d k[i, j] = x[b, i], times 3.
    want = np.zeros((2, 2, 3, 2), np.float32)
    for b in range(2):
        for j in range(2):
            want[b, j, :, j] = 3 * X[b]
    np.testing.assert_allclose(jacobian.numpy(), want, rtol=1e-6)


def test_a_variables_hook_on_a_layer_returning_none_beside_a_tensor() -> None:
    class WithAux(keras.layers.Layer):
        def build(self, input_shape: Any) -> None:
            self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

        def call(self, x: Any) -> Any:
            return {"y": x * self.w, "aux": None, "count": 3}

    layer = WithAux()
    x = tf.constant([[1.0, 2.0]])
    layer(x)
    with go.grad_hook(layer, lambda g: -g, at="variables"):
        with tf.GradientTape() as tape:
            out = layer(x)
            loss = tf.reduce_sum(out["y"])
        assert out["aux"] is None and out["count"] == 3
        np.testing.assert_allclose(tape.gradient(loss, layer.w).numpy(), [-1.0, -2.0])


@pytest.mark.parametrize("kind", ["override", "hook"])
def test_a_traced_layer_is_freed_with_its_model(kind: str) -> None:
    import weakref

    def build() -> Any:
        dense = keras.layers.Dense(2)
        if kind == "override":
            go.override_backward(dense, lambda grad, *, inputs, layer: {
                "inputs": grad @ tf.transpose(layer.kernel),
                "kernel": tf.transpose(inputs) @ grad, "bias": tf.reduce_sum(grad, 0)})
        else:
            go.grad_hook(dense, lambda g: g, at="variables")
        model = keras.Sequential([keras.Input((3,)), dense])
        model.compile("sgd", "mse", jit_compile=False)
        model.fit(X, np.ones((2, 2), np.float32), verbose=0)
        return weakref.ref(dense)

    ref = build()
    keras.backend.clear_session()
    gc.collect()
    assert ref() is None


def test_an_override_rule_returns_a_tuple_by_call_input() -> None:
    layer = keras.layers.Activation("relu")
    x = tf.constant([[-1.0, 2.0]])
    with go.override_backward(layer, lambda grad, *, inputs: (5 * grad,)):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(layer(x))
        np.testing.assert_allclose(tape.gradient(y, x).numpy(), [[5.0, 5.0]])


def test_a_scheduled_reversal_hook_is_refused_with_the_layer_to_use() -> None:
    with pytest.raises(go.GradOverrideError, match=r"has a scheduled scale, whose step count "
                       r"a Keras model has nowhere to keep here. Put a "
                       r"`gradoverride.keras.GradientReversal\(scale=ganin_ramp"):
        go.grad_hook(_dense(), recipes.reverse_grad(scale=recipes.ganin_ramp(100)),
                     at="outputs")


def test_a_clip_at_the_variables_of_a_layer_called_twice_warns() -> None:
    layer = _dense()
    go.grad_hook(layer, recipes.clip_grad_norm(1.0), at="variables")

    @tf.function
    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x)) + tf.reduce_sum(layer(2 * x))
        return tape.gradient(loss, layer.kernel)

    with pytest.warns(go.GradOverrideWarning, match=r"applies clip_grad_norm\(max_norm=1.0"
                      r".* to the gradient of each call of the Dense `dense\w*`, which runs "
                      r"more than once in one traced step"):
        step(tf.constant(X))


def test_a_clip_at_the_variables_of_an_rnn_cell_warns() -> None:
    cell = keras.layers.SimpleRNNCell(3)
    rnn = keras.layers.RNN(cell)
    go.grad_hook(cell, recipes.clip_grad_value(0.1), at="variables")
    model = keras.Sequential([keras.Input((4, 2)), rnn])
    model.compile("sgd", "mse", jit_compile=False)
    with pytest.warns(go.GradOverrideWarning, match=r"which runs in a loop"):
        model.fit(np.ones((2, 4, 2), np.float32), np.ones((2, 3), np.float32), verbose=0)
