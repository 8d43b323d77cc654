"""The quickstart in Keras: a small network whose hidden layer is quantized to 4 bits.

The same `go.custom_backward` decorator as in `quickstart.py`, with the forward and the rule
written in TensorFlow ops: `tf.round` has a zero gradient almost everywhere, so the rule
passes the upstream gradient straight through inside the quantizer's range. The op lives in
a three-line Keras layer and trains with `model.fit`, compiled by XLA (`jit_compile=True`).
`gradoverride.keras.Quantize` is the ready-made layer for the recipe form of this quantizer.
Needs the `tensorflow` extra; runs in a few seconds on a CPU, on data it makes.

    pip install -e ".[tensorflow]"
    python examples/tensorflow_ste.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow's first import

import sys
from typing import Any

try:
    import keras
    import tensorflow as tf
except ImportError:
    sys.exit(
        "tensorflow_ste needs TensorFlow and Keras 3: pip install 'gradoverride[tensorflow]' "
        "(from a clone: pip install -e '.[tensorflow]')"
    )
import numpy as np

import gradoverride as go


@go.custom_backward
def quantize(x: Any, bits: int = 4) -> Any:
    """Round `x` (clipped to [-1, 1]) to a grid of 2**bits steps per unit."""
    scale = 2.0**bits
    return tf.round(tf.clip_by_value(x, -1.0, 1.0) * scale) / scale


@quantize.backward
def _(grad: Any, *, x: Any) -> Any:
    # Straight-through inside the quantizer's range, zero outside it.
    return grad * tf.cast(tf.abs(x) <= 1, grad.dtype)


class Quantized(keras.layers.Layer):
    """`quantize` as a Keras layer, with the bit width fixed."""

    def __init__(self, bits: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bits = bits

    def call(self, x: Any) -> Any:
        return quantize(x, bits=self.bits)


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The quickstart's smooth 2-D regression target."""
    rng = np.random.default_rng(seed)
    x = (rng.random((n, 2)) * 4 - 2).astype(np.float32)
    y = np.sin(x[:, :1]) * np.cos(x[:, 1:]) + 0.5 * x[:, :1]
    return x, y.astype(np.float32)


def main(epochs: int = 60) -> list[float]:
    keras.utils.set_random_seed(0)
    x, y = make_data(512, seed=0)
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(64),
            keras.layers.Activation("tanh"),
            Quantized(bits=4),  # the custom gradient, inside an XLA-compiled train step
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=True)
    model.summary()
    history = model.fit(x, y, batch_size=128, epochs=epochs, verbose=0)
    losses = [float(v) for v in history.history["loss"]]
    for epoch in range(0, epochs, 10):
        print(f"epoch {epoch:3d}  loss {losses[epoch]:.4f}")
    print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
