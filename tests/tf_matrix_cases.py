"""One case per op kind of the TensorFlow support matrix (`gradoverride._support_matrix`,
`TF_KINDS`), shared by `test_support_matrix_tensorflow.py` and the strategy worker.

A case is a Keras layer of one input `x` (shape (4, 3), float32) doing one op of its kind,
with at least one trainable variable; an op (a `custom_backward`, a recipe, a bridge) runs
inside `OpLayer`, on `x * scale`, so that `model.fit` has a variable to update through the
op's rule. Every variable starts at a fixed value (no random initializer), so that two
processes build the same layer.

`reference(layer, x, up)` gives the gradients of `sum(layer(x) * up)` with respect to `x` and
each variable (by its short name: `"scale"`, `"kernel"`), worked out by hand in numpy from
the rule's math: independent of the library.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import tensorflow as tf

import gradoverride as go
from gradoverride import recipes
from gradoverride.keras import Layer

Grads = dict[str, np.ndarray]

# Inputs away from the ops' kinks (rounding ties at odd multiples of 1/8, the clip bound at
# 1 for x * scale, 0 for the sign and the spike).
X = np.array(
    [[0.31, -0.52, 0.66], [-0.9, 0.18, -0.29], [0.44, 0.95, -0.71], [-0.14, -0.61, 0.87]],
    dtype=np.float32,
)
UP = np.array(
    [[0.5, -1.2, 0.8], [1.5, 0.3, -0.7], [-0.4, 0.9, 1.1], [0.6, -0.8, -1.3]], dtype=np.float32
)
KERNEL = np.linspace(-1.0, 1.0, 9, dtype=np.float32).reshape(3, 3)
BIAS = np.array([0.1, -0.2, 0.3], dtype=np.float32)
SCALE = 1.25
#: The clip bound of the `grad_hook variables` case: some entries of its gradients clip.
CLIP = 1.0


def short(variable: Any) -> str:
    """A variable's name relative to its layer (`"kernel"` of `"dense/kernel"`)."""
    return str(variable.path).rsplit("/", 1)[-1]


# ---- the ops -----------------------------------------------------------------------------


@go.custom_backward
def quantized(x: Any) -> Any:
    return tf.round(x * 4) / 4


@quantized.backward
def _(grad: Any, *, x: Any) -> Any:
    return grad * tf.cast(tf.abs(x) <= 1, grad.dtype)


@go.custom_backward(owns="x")
def weighted(x: Any, w: Any) -> Any:
    return tf.round(x * 4) / 4 * w


@weighted.backward
def _(grad: Any, *, w: Any) -> Any:
    return grad * w * 2


def _sine(x: np.ndarray) -> np.ndarray:
    return np.sin(x)


def sine_rule(grad: np.ndarray, *, x: np.ndarray) -> np.ndarray:
    return grad * np.cos(x)


#: The op of each op kind, by the name `OpLayer` keeps in its config.
OPS: dict[str, Callable[..., Any]] = {
    "quantized": quantized,
    "sign": go.straight_through(tf.sign),
    "spike": recipes.spike("arctan"),
    "reverse": recipes.reverse_grad(scale=0.5),
    # `outputs=`: in a functional Keras model and in a while loop, the output's shape is
    # known before numpy runs.
    "sine": go.bridge(_sine, backward=sine_rule, outputs=tf.TensorSpec([None, 3], tf.float32)),
}


@keras.saving.register_keras_serializable(package="tf_matrix_cases")
class OpLayer(keras.layers.Layer):  # type: ignore[misc]
    """`OPS[op](x * scale)`, with `scale` a trainable scalar."""

    def __init__(self, op: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.op = op

    def build(self, input_shape: Any) -> None:
        self.scale = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(SCALE), name="scale"
        )

    def call(self, x: Any) -> Any:
        return OPS[self.op](x * self.scale)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "op": self.op}


@keras.saving.register_keras_serializable(package="tf_matrix_cases")
class OwnsLayer(keras.layers.Layer):  # type: ignore[misc]
    """`weighted(x, w)`: the rule owns `x`; the variable `w` keeps its TensorFlow gradient."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(
            shape=(3,), initializer=keras.initializers.Constant(np.linspace(0.5, 1.5, 3)),
            name="w",
        )

    def call(self, x: Any) -> Any:
        return weighted(x, self.w)


@keras.saving.register_keras_serializable(package="tf_matrix_cases")
class RoundScale(Layer):
    """The forum's layer in Keras: its own backward gives both gradients."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(
            shape=(3,), initializer=keras.initializers.Constant(np.linspace(0.5, 1.5, 3)),
            name="w",
        )

    def call(self, x: Any) -> Any:
        return tf.round(x * 4) / 4 * self.w

    def backward(self, grad: Any, *, x: Any) -> Any:
        return {"x": grad * self.w * 2, "w": tf.reduce_sum(grad * x, axis=0)}


@keras.saving.register_keras_serializable(package="tf_matrix_cases")
class Rescale(keras.layers.Layer):  # type: ignore[misc]
    """`x * m`, with `m` a trainable vector of ones: put before a case's layer in a model,
    its gradient is `sum(x * (the gradient the case gives its input), axis=0)`, so that
    training shows the input's gradient too."""

    def build(self, input_shape: Any) -> None:
        self.m = self.add_weight(shape=(3,), initializer="ones", name="m")

    def call(self, x: Any) -> Any:
        return x * self.m


def rescale_gradient(x: np.ndarray, grads: Grads) -> np.ndarray:
    """The gradient of `Rescale`'s `m` (all ones) before a layer with these gradients."""
    return np.asarray((np.asarray(x, np.float64) * grads["x"]).sum(0))


def dense_rule(grad: Any, *, inputs: Any, layer: Any) -> Any:
    """Dense's own gradients, the input's doubled (so the override shows)."""
    return {
        "inputs": 2 * grad @ tf.transpose(layer.kernel),
        "kernel": tf.transpose(inputs) @ grad,
        "bias": tf.reduce_sum(grad, axis=0),
    }


def triple(grad: Any) -> Any:
    """The grad_hook transform of the matrix (module level: copy_overrides shares it)."""
    return grad * 3


CLIPPED = recipes.clip_grad_value(CLIP)


def dense() -> Any:
    layer = keras.layers.Dense(
        3, kernel_initializer=keras.initializers.Constant(KERNEL),
        bias_initializer=keras.initializers.Constant(BIAS),
    )
    layer.build((None, 3))
    return layer


def _built(layer: Any) -> Any:
    layer.build((None, 3))
    return layer


# ---- the references ------------------------------------------------------------------------


def values(layer: Any) -> dict[str, np.ndarray]:
    return {short(v): np.asarray(v.numpy(), np.float64)
            for v in layer.trainable_variables}


def _before(gz: np.ndarray, x: np.ndarray, s: float) -> Grads:
    """Gradients of x and scale from the gradient at z = x * scale."""
    return {"x": gz * s, "scale": np.array((gz * x).sum())}


def _op_reference(dz: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., Grads]:
    """For an `OpLayer`: `dz(z, up)` is the rule's gradient at z = x * scale."""

    def reference(layer: Any, x: np.ndarray, up: np.ndarray) -> Grads:
        s = float(values(layer)["scale"])
        x, up = np.asarray(x, np.float64), np.asarray(up, np.float64)
        return _before(dz(x * s, up), x, s)

    return reference


def _ref_owns(layer: Any, x: np.ndarray, up: np.ndarray) -> Grads:
    w = values(layer)["w"]
    return {"x": up * w * 2, "w": (up * np.round(x * 4) / 4).sum(0)}


def _ref_layer(layer: Any, x: np.ndarray, up: np.ndarray) -> Grads:
    w = values(layer)["w"]
    return {"x": up * w * 2, "w": (up * x).sum(0)}


def _ref_dense(input_factor: float = 1.0, output_factor: float = 1.0,
               clip: float | None = None) -> Callable[..., Grads]:
    def reference(layer: Any, x: np.ndarray, up: np.ndarray) -> Grads:
        k = values(layer)["kernel"]
        g = np.asarray(up, np.float64) * output_factor
        x = np.asarray(x, np.float64)
        kernel, bias = x.T @ g, g.sum(0)
        if clip is not None:
            kernel, bias = np.clip(kernel, -clip, clip), np.clip(bias, -clip, clip)
        return {"x": g @ k.T * input_factor, "kernel": kernel, "bias": bias}

    return reference


# ---- the cases -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    kind: str
    build: Callable[[], Any]  # a fresh built layer, its override installed if it has one
    reference: Callable[[Any, np.ndarray, np.ndarray], Grads]
    #: For the kinds installed on an existing layer: installs it on a Dense.
    install: Callable[[Any], Any] | None = None


def _installed(install: Callable[[Any], Any]) -> Callable[[], Any]:
    def build() -> Any:
        layer = dense()
        install(layer)
        return layer

    return build


def _install_override(layer: Any) -> Any:
    return go.override_backward(layer, dense_rule)


def _install_hook(at: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda layer: go.grad_hook(layer, fn, at=at)  # type: ignore[arg-type]


def _op_case(kind: str, op: str, dz: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Case:
    return Case(kind, lambda: _built(OpLayer(op)), _op_reference(dz))


CASES: dict[str, Case] = {
    case.kind: case
    for case in (
        _op_case("custom_backward", "quantized", lambda z, up: up * (np.abs(z) <= 1)),
        Case("custom_backward owns=", lambda: _built(OwnsLayer()), _ref_owns),
        _op_case("straight_through", "sign", lambda z, up: up),
        _op_case("recipe: surrogate spike", "spike",
                 # arctan, alpha 2: (alpha / 2) / (1 + (pi alpha z / 2)^2)
                 lambda z, up: up / (1 + (math.pi * z) ** 2)),
        _op_case("recipe: gradient flow", "reverse", lambda z, up: -0.5 * up),
        Case("gradoverride.keras.Layer", lambda: _built(RoundScale()), _ref_layer),
        Case("override_backward", _installed(_install_override), _ref_dense(input_factor=2.0),
             _install_override),
        Case("grad_hook inputs", _installed(_install_hook("inputs", triple)),
             _ref_dense(input_factor=3.0), _install_hook("inputs", triple)),
        Case("grad_hook outputs", _installed(_install_hook("outputs", triple)),
             _ref_dense(output_factor=3.0), _install_hook("outputs", triple)),
        Case("grad_hook variables", _installed(_install_hook("variables", CLIPPED)),
             _ref_dense(clip=CLIP), _install_hook("variables", CLIPPED)),
        _op_case("bridge", "sine", lambda z, up: up * np.cos(z)),
    )
}


# ---- the sparse gradient of an Embedding ---------------------------------------------------

#: Ids looked up in the `grad_hook variables` case's sparse cell: row 2 twice.
IDS = np.array([0, 2, 2, 4], dtype=np.int32)
TABLE = np.linspace(-1.0, 1.0, 15, dtype=np.float32).reshape(5, 3)


def hooked_embedding() -> Any:
    layer = keras.layers.Embedding(5, 3, embeddings_initializer=keras.initializers.Constant(
        TABLE))
    layer.build((None,))
    go.grad_hook(layer, CLIPPED, at="variables")
    return layer


def embedding_reference(up: np.ndarray) -> np.ndarray:
    """The clip of the whole (dense) gradient: a repeated row's sum is clipped once."""
    dense_grad = np.zeros((5, 3))
    np.add.at(dense_grad, IDS, np.asarray(up, np.float64))
    return np.clip(dense_grad, -CLIP, CLIP)
