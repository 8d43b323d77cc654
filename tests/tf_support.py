"""Shared by the TensorFlow tests: importing TensorFlow (or skipping), and its three modes.

Without TensorFlow every TensorFlow test module skips with a reason, unless
`GRADOVERRIDE_REQUIRE_TENSORFLOW=1` (set by `.ci/run`), where a missing TensorFlow is an
import error, so CI cannot pass by skipping them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REQUIRED = os.environ.get("GRADOVERRIDE_REQUIRE_TENSORFLOW") == "1"

try:
    import tensorflow as tf
except ImportError:
    if REQUIRED:
        raise
    pytest.skip(
        "TensorFlow is not installed (pip install 'gradoverride[tensorflow]')",
        allow_module_level=True,
    )

__all__ = ["MODES", "in_mode", "tf"]

#: The three ways TensorFlow runs a function: eagerly, traced by `tf.function`, and
#: compiled by XLA (`jit_compile=True`).
MODES = ("eager", "function", "xla")


def in_mode(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
    """`fn` as it runs in `mode` (one of MODES)."""
    if mode == "eager":
        return fn
    if mode == "function":
        return tf.function(fn)
    if mode == "xla":
        return tf.function(fn, jit_compile=True)
    raise ValueError(mode)


def gradients(fn: Callable[..., Any], *inputs: Any, mode: str = "eager") -> Any:
    """Gradients of `sum(fn(*inputs) * weights)` with a fixed non-uniform weighting, per input,
    in `mode`."""

    def step(*xs: Any) -> Any:
        with tf.GradientTape() as tape:
            for x in xs:
                tape.watch(x)
            out = fn(*xs)
            weights = tf.reshape(
                tf.range(1, tf.size(out) + 1, dtype=out.dtype), tf.shape(out)
            ) / tf.cast(tf.size(out), out.dtype)
            loss = tf.reduce_sum(out * weights)
        return out, tape.gradient(loss, list(xs))

    return in_mode(step, mode)(*inputs)
