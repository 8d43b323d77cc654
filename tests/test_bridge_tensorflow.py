"""`go.bridge` given TensorFlow tensors: refused at the call until a TensorFlow bridge exists,
and the alternative the message gives (tf.numpy_function in a custom_backward op) works."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tf_support import MODES, gradients, in_mode, tf

import gradoverride as go

_SINE = go.bridge(np.sin, backward=lambda grad, *, x: grad * np.cos(x))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_bridge_refuses_tensorflow_tensors(mode: str) -> None:
    x = tf.constant([0.0, 1.0])
    with pytest.raises(go.GradOverrideTypeError, match=(
        r"^`sin` is a go.bridge, which takes torch tensors, and its argument `x` is "
        r"TensorFlow's; go.bridge has no TensorFlow support yet \(it would hand torch tensors "
        r"to TensorFlow\)\. Pass torch tensors, or on TensorFlow call the numpy function "
        r"through tf.numpy_function inside a go.custom_backward op, whose rule gives the "
        r"gradient\.$"
    )):
        in_mode(_SINE, mode)(x)

    def total(xs: list[Any], scale: float) -> Any:
        return sum(np.sum(v) for v in xs) * scale

    with pytest.raises(go.GradOverrideTypeError, match=r"^`[^`]*total` is a go.bridge, which "
                       r"takes torch tensors, and its argument `xs` is TensorFlow's"):
        go.bridge(total, backward="spsa")([np.ones(2), tf.ones(2)], 2.0)
    with pytest.raises(go.GradOverrideTypeError, match=r"`w` is TensorFlow's"):
        go.bridge(lambda x, w: x * w, backward="spsa")(np.ones(2), w=tf.Variable([1.0, 2.0]))


@go.custom_backward
def _numpy_sine(x: Any) -> Any:
    return tf.numpy_function(np.sin, [x], x.dtype)


@_numpy_sine.backward
def _(grad: Any, *, x: Any) -> Any:
    return grad * tf.cos(x)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "xla"])  # numpy cannot run in XLA
def test_the_suggested_tensorflow_alternative_works(mode: str) -> None:
    x = tf.constant([0.0, 0.5, 2.0])
    out, (g,) = gradients(_numpy_sine, x, mode=mode)
    np.testing.assert_allclose(out.numpy(), np.sin(x.numpy()), rtol=1e-6)
    weights = np.arange(1, 4, dtype=np.float32) / 3
    np.testing.assert_allclose(g.numpy(), weights * np.cos(x.numpy()), rtol=1e-6)
