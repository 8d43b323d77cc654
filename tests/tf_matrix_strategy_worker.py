"""Run by tests/test_support_matrix_tensorflow.py in a fresh process (logical devices must be
set up before TensorFlow first touches the CPU): every kind of the TensorFlow support
matrix under `tf.distribute.MirroredStrategy` over two logical CPUs. Each replica takes the
gradient of `sum(layer(x * m) * up)` (`m` a variable of ones, whose gradient shows the one
the layer gives `x`) over its half of the batch; the strategy sums them. Prints one JSON
line: per kind, the summed variable gradients, the error raised (if any) and the warnings
given."""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)

import tf_matrix_cases as cases  # noqa: E402  (after the device setup)


def run(strategy: Any, case: cases.Case) -> dict[str, Any]:
    with strategy.scope():
        layer = case.build()
        # `x * m` before the layer: m's gradient shows the gradient the layer gives x.
        m = tf.Variable(tf.ones(3), name="m")

    def shard(ctx: Any) -> Any:
        k = 2 * ctx.replica_id_in_sync_group
        return tf.constant(cases.X[k : k + 2]), tf.constant(cases.UP[k : k + 2])

    inputs = strategy.experimental_distribute_values_from_function(shard)

    @tf.function
    def step(inputs: Any) -> Any:
        def replica(inputs: Any) -> Any:
            x, up = inputs
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.cast(layer(x * m), tf.float32) * up)
            return tape.gradient(loss, [m, *layer.trainable_variables])

        per_replica = strategy.run(replica, args=(inputs,))
        return [strategy.reduce("SUM", g, axis=None) for g in per_replica]

    grads = step(inputs)
    names = ["m", *(cases.short(v) for v in layer.trainable_variables)]
    return {name: g.numpy().tolist() for name, g in zip(names, grads, strict=True)}


def main() -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    report: dict[str, Any] = {"replicas": strategy.num_replicas_in_sync}
    for kind, case in cases.CASES.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                grads, error = run(strategy, case), None
            except Exception as exc:  # reported to the test, which checks it
                grads, error = {}, f"{type(exc).__name__}: {exc}"
        report[kind] = {
            "grads": grads,
            "error": error,
            "warnings": [str(w.message) for w in caught
                         if w.category.__name__ == "GradOverrideWarning"],
        }
    print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
