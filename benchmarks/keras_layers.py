"""Keras: the module side of gradoverride against the same layers written by hand, in one run.

- `gradoverride.keras.Layer` (the forum's `x * w` layer, its rule giving both gradients)
  against a Keras layer whose `call` runs a hand-written `tf.custom_gradient` returning the
  variable's gradient;
- `go.override_backward` on a `Dense` (a rule for inputs, kernel and bias) against a
  `tf.custom_gradient` around the same `Dense` math;
- `go.grad_hook(at="outputs")` (a gradient reversal) against a hand-written identity
  `tf.custom_gradient` after the layer.

One step is forward + backward under a `tf.GradientTape`, timed eagerly and inside a
`tf.function`; interleaved, shuffled rounds; medians and the median of paired ratios.

    pip install -e ".[tensorflow]"
    python benchmarks/keras_layers.py [--quick] [--device cuda]

`--device cuda` runs on TensorFlow's first GPU (a TensorFlow build with GPU support).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

try:
    import keras
    import tensorflow as tf
except ImportError:
    # Exit status 3: this benchmark cannot run here (what benchmarks/gpu.sh marks skipped).
    print("TensorFlow is not installed (pip install -e '.[tensorflow]')", file=sys.stderr)
    sys.exit(3)

import gradoverride as go
from gradoverride import recipes
from gradoverride.keras import Layer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import add_device_argument, compare, tensorflow_device


class ScaleWithRule(Layer):
    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x: Any) -> Any:
        return x * self.w

    def backward(self, grad: Any, *, x: Any) -> Any:
        return {"x": grad * self.w, "w": tf.reduce_sum(grad * x, axis=0)}


class ScaleByHand(keras.layers.Layer):  # type: ignore[misc]
    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x: Any) -> Any:
        w = self.w

        @tf.custom_gradient
        def op(x: Any) -> Any:
            def grad(upstream: Any, variables: Any = None) -> Any:
                return upstream * w, [tf.reduce_sum(upstream * x, axis=0)]

            return x * w, grad

        return op(x)


def dense_rule(grad: Any, *, inputs: Any, layer: Any) -> Any:
    return {
        "inputs": grad @ tf.transpose(layer.kernel),
        "kernel": tf.transpose(inputs) @ grad,
        "bias": tf.reduce_sum(grad, axis=0),
    }


class DenseByHand(keras.layers.Layer):  # type: ignore[misc]
    def __init__(self, units: int) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(units)

    def build(self, input_shape: Any) -> None:
        self.dense.build(input_shape)

    def call(self, x: Any) -> Any:
        kernel, bias = self.dense.kernel, self.dense.bias

        @tf.custom_gradient
        def op(x: Any) -> Any:
            def grad(upstream: Any, variables: Any = None) -> Any:
                return upstream @ tf.transpose(kernel), [
                    tf.transpose(x) @ upstream, tf.reduce_sum(upstream, axis=0)]

            return x @ kernel + bias, grad

        return op(x)


@tf.custom_gradient
def reverse_by_hand(x: Any) -> Any:
    return tf.identity(x), lambda upstream: -upstream


class ReversedByHand(keras.layers.Layer):  # type: ignore[misc]
    def __init__(self, units: int) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(units)

    def call(self, x: Any) -> Any:
        return reverse_by_hand(self.dense(x))


def _step(layer: Any) -> Callable[[Any, Any], Any]:
    def step(x: Any, upstream: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, [x, *layer.trainable_variables], output_gradients=upstream)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for the test suite)")
    add_device_argument(parser)
    args = parser.parse_args()
    placement = tensorflow_device(args.device)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}, {placement}, 1 thread")
    with tf.device(placement):
        run_all(args.quick)


def run_all(quick: bool) -> None:
    x = tf.random.stateless_normal((1, 256), seed=(0, 1))
    keras.utils.set_random_seed(0)
    overridden = keras.layers.Dense(256)
    go.override_backward(overridden, dense_rule)
    hooked = keras.layers.Dense(256)
    go.grad_hook(hooked, recipes.reverse_grad(), at="outputs")
    pairs = {
        "gradoverride.keras.Layer": (ScaleByHand(), ScaleWithRule()),
        "override_backward(Dense)": (DenseByHand(256), overridden),
        "grad_hook(Dense, outputs)": (ReversedByHand(256), hooked),
    }
    for mode in ("eager", "tf.function"):
        for title, (by_hand, ours) in pairs.items():
            cases: dict[str, Callable[[], Any]] = {}
            for name, layer in (("by hand", by_hand), ("gradoverride", ours)):
                layer(x)  # build
                upstream = tf.ones_like(layer(x))
                step = _step(layer)
                if mode == "tf.function":
                    step = tf.function(step)

                def run(step: Callable[[Any, Any], Any] = step,
                        upstream: Any = upstream) -> None:
                    [g.numpy() for g in step(x, upstream)]

                cases[name] = run
            result = compare(cases, rounds=3 if quick else 21,
                             number=2 if quick else 50)
            print(f"\n{title}, forward+backward per step, (1, 256), {mode}:")
            for name, (seconds, ratio) in result.items():
                print(f"  {name:14s} {seconds * 1e6:10.1f} us   ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
