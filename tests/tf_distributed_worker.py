"""Run by tests/test_keras_distributed.py in a fresh process (logical devices must be set up
before TensorFlow first touches the CPU): one training step of a Keras model holding a
`gradoverride.keras.Layer`, an overridden `Dense` and a hooked `Dense`, under
`tf.distribute.MirroredStrategy` over two logical CPUs and on one device; prints the
largest difference between the two sets of gradients, and between the updated weights."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)

import keras  # noqa: E402  (after the device setup)

import gradoverride as go  # noqa: E402
from gradoverride.keras import Layer  # noqa: E402


class Scale(Layer):
    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x: Any) -> Any:
        return x * self.w

    def backward(self, grad: Any, *, x: Any) -> Any:
        return {"x": grad * self.w, "w": 2 * grad * x}  # twice the true gradient


def dense_rule(grad: Any, *, inputs: Any, layer: Any) -> Any:
    return {
        "inputs": grad @ tf.transpose(layer.kernel),
        "kernel": -(tf.transpose(inputs) @ grad),  # the true gradient, negated
        "bias": tf.reduce_sum(grad, axis=0),
    }


def build() -> tuple[keras.Model, list[Any]]:
    keras.utils.set_random_seed(0)
    dense, hooked = keras.layers.Dense(4), keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((3,)), Scale(), dense, hooked])
    handles = [
        go.override_backward(dense, dense_rule),
        go.grad_hook(hooked, lambda g: 0.5 * g, at="variables"),
    ]
    return model, handles


def gradients(model: keras.Model, x: Any, y: Any, scale: float) -> list[Any]:
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum((model(x) - y) ** 2) * scale
    return tape.gradient(loss, model.trainable_variables)


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")

    model, handles = build()
    single = [g.numpy() for g in gradients(model, x, y, 1.0)]
    for handle in handles:
        handle.remove()
    plain = [g.numpy() for g in gradients(model, x, y, 1.0)]
    # The override negates the dense kernel's gradient; the hook halves the last layer's.
    rules_applied = bool(
        np.allclose(single[1], -plain[1], rtol=1e-5)
        and np.allclose(single[3], 0.5 * plain[3], rtol=1e-5)
        and np.allclose(single[4], 0.5 * plain[4], rtol=1e-5)
    )

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        mirrored, handles = build()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    @tf.function
    def step(inputs: Any) -> Any:
        def replica(inputs: Any) -> Any:
            bx, by = inputs
            return gradients(mirrored, bx, by, 1.0)

        per_replica = strategy.run(replica, args=(inputs,))
        return [strategy.reduce("SUM", g, axis=None) for g in per_replica]

    summed = [g.numpy() for g in step(batch)]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(single, summed, strict=True))
    print("RESULT " + json.dumps({
        "replicas": strategy.num_replicas_in_sync,
        "max_diff": diff,
        "rules_applied": rules_applied,
    }))


if __name__ == "__main__":
    sys.exit(main())
