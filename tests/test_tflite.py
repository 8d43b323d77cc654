"""Keras models with gradoverride layers, exported and converted to TFLite's builtin ops.

* a division by a Python number in the TensorFlow recipes (quantize's scale from a given
  range, a softmax temperature) gives torch's float32 quotient bit for bit eagerly, under
  `tf.function`, under XLA and in a TFLite model converted with builtin ops only, on inputs
  next to quantize's rounding ties, where TensorFlow's rewrite of a division by a constant
  into a multiplication by its reciprocal gives other values;
* a Keras model with `Quantize` converts with `TFLITE_BUILTINS` alone, from the Keras model
  and from the SavedModel that `model.export` writes, and the TFLite interpreter gives the
  torch recipe's outputs and the Keras model's, bit for bit; so do models with the other
  layers (`Spike`, `GradientReversal` with a schedule, a `gradoverride.keras.Layer`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
import torch
from tf_support import MODES, in_mode, tf

# isort: split
import keras  # after tf_support, which skips this module without TensorFlow

from gradoverride import recipes
from gradoverride._tensorflow._ops import OPS as TF_OPS
from gradoverride.keras import GradientReversal, Layer, Quantize, Spike

# TensorFlow 2.21 warns on every `tf.lite.Interpreter` that it moves to `ai_edge_litert`.
pytestmark = pytest.mark.filterwarnings(
    "ignore:\\s*Warning. tf.lite.Interpreter is deprecated:UserWarning"
)

#: Divisors: quantize scales (bound / qmax) and other numbers, one negative.
DIVISORS = [2e4 / 7, 3.0 / 7, 1.5 / 3, 0.1, 1.0 / 127, 6.0 / 255, 1e-3, 123.456, -0.37]


def _near_ties(divisors: list[float], codes: int = 60) -> np.ndarray:
    """For each divisor s, the float32 values nearest (k + 0.5) * s and two neighbours on
    each side, k in [-codes, codes): the inputs whose quotients sit at quantize's ties."""
    out = []
    for s in divisors:
        base = ((np.arange(-codes, codes) + 0.5) * np.float64(np.float32(s))).astype(np.float32)
        for steps in (-2, -1, 0, 1, 2):
            value = base
            for _ in range(abs(steps)):
                value = np.nextafter(value, np.float32(np.inf if steps > 0 else -np.inf))
            out.append(value)
    return np.concatenate(out)


X_TIES = _near_ties(DIVISORS)


def _convert(converter: Any) -> bytes:
    """The TFLite flatbuffer, with TFLite's builtin ops only (no TensorFlow fallback)."""
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    flatbuffer: bytes = converter.convert()
    return flatbuffer


def _run_tflite(flatbuffer: bytes, x: np.ndarray) -> np.ndarray:
    interpreter = tf.lite.Interpreter(model_content=flatbuffer)
    interpreter.resize_tensor_input(interpreter.get_input_details()[0]["index"], x.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x)
    interpreter.invoke()
    out: np.ndarray = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
    return out


def _in_mode(fn: Any, x: np.ndarray, mode: str) -> np.ndarray:
    """fn(x) run eagerly, traced, under XLA, or in a TFLite model converted from it."""
    if mode != "tflite":
        out: np.ndarray = in_mode(fn, mode)(tf.constant(x)).numpy()
        return out
    spec = tf.TensorSpec([None] * x.ndim, tf.float32)
    function = tf.function(fn, input_signature=[spec])
    module = tf.Module()
    module.f = function
    converter = tf.lite.TFLiteConverter.from_concrete_functions(
        [function.get_concrete_function()], module
    )
    return _run_tflite(_convert(converter), x)


def _assert_bits_equal(got: np.ndarray, want: np.ndarray, zero_signs: bool = True) -> None:
    """Equal to the last bit, the sign of a zero included unless `zero_signs` is False."""
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    different = got.view(np.int32) != want.view(np.int32)
    if not zero_signs:
        different &= (got != 0) | (want != 0)
    assert not different.any(), (
        f"{int(different.sum())} of {got.size} differ, first at {np.argwhere(different)[0]}: "
        f"{got[different][:3]} vs {want[different][:3]}"
    )


# ---- the division: torch's quotient in every mode ----------------------------------------


@pytest.mark.parametrize("mode", [*MODES, "tflite"])
def test_division_by_a_number_is_torchs_in_every_mode(mode: str) -> None:
    def divide_by_each(x: Any) -> Any:
        return tf.stack([TF_OPS.divide_by_number(x, s) for s in DIVISORS])

    def reciprocal_rewritten(x: Any) -> Any:
        return tf.stack([x / s for s in DIVISORS])

    want = torch.stack([torch.from_numpy(X_TIES) / s for s in DIVISORS]).numpy()
    _assert_bits_equal(_in_mode(divide_by_each, X_TIES, mode), want)
    if mode != "eager":
        # The inputs reach the rewrite: a plain division by the constant differs here.
        plain = _in_mode(reciprocal_rewritten, X_TIES, mode)
        assert (plain.view(np.int32) != want.view(np.int32)).sum() > 100


# ---- Keras models converted to TFLite builtins ----------------------------------------------

QUANTIZERS: list[dict[str, Any]] = [
    {"bits": 4},  # the scale from the batch: max|x| / 7
    {"bits": 3, "bound": 1.5},  # scale 0.5: x = ±0.25, ±0.75 are exact code ties
    {"bits": 8, "bound": 2e4},  # scale 2e4 / 127, far from a power of two
    {"bits": 3, "symmetric": False},  # zero point from the batch
    {"bits": 4, "symmetric": False, "bound": (-1.0, 3.0), "keep": "mask"},
]


def _quantize_inputs(kwargs: dict[str, Any]) -> np.ndarray:
    """Values next to the quantizer's code ties within its range (the given one, or
    [-3, 3], which the batch then spans), a grid reaching past a given range (clamped
    codes), 0 and -0, as rows of 8."""
    bits, bound = kwargs["bits"], kwargs.get("bound")
    ends = (-3.0, 3.0) if bound is None else bound if isinstance(bound, tuple) else (-bound, bound)
    lo, hi = ends
    if kwargs.get("symmetric", True):
        scale = max(-lo, hi) / (2 ** (bits - 1) - 1)
    else:
        scale = (hi - lo) / (2**bits - 1)  # ties at (k + 0.5) * scale: the zero point is whole
    near = _near_ties([scale], codes=2**bits)
    near = near[(near >= lo) & (near <= hi)]
    reach = 1.0 if bound is None else 1.2
    grid = np.linspace(reach * lo, reach * hi, 40, dtype=np.float32)
    return _pad(np.concatenate([near, grid, np.array([0.0, -0.0], np.float32)]))


def _pad(x: np.ndarray) -> np.ndarray:
    """x as rows of 8 (zeros appended), the shape the models take."""
    rows = -(-x.size // 8)
    return np.concatenate([x, np.zeros(rows * 8 - x.size, np.float32)]).reshape(rows, 8)


def _quantize_model(kwargs: dict[str, Any]) -> keras.Model:
    inputs = keras.Input((8,))
    return keras.Model(inputs, Quantize(**kwargs)(inputs))


@pytest.mark.parametrize("kwargs", QUANTIZERS, ids=repr)
def test_quantize_layer_converts_to_builtin_ops_and_gives_torchs_values(
    kwargs: dict[str, Any],
) -> None:
    x = _quantize_inputs(kwargs)
    model = _quantize_model(kwargs)
    flatbuffer = _convert(tf.lite.TFLiteConverter.from_keras_model(model))
    lite = _run_tflite(flatbuffer, x)
    torch_recipe = recipes.quantize(**{**kwargs, "keep": "input"})
    # The converter drops the `+ 0` of a zero point of 0, by which IEEE arithmetic (torch,
    # TensorFlow) turns round(x / s) = -0 into +0: TFLite outputs -0 there, the same value.
    _assert_bits_equal(lite, torch_recipe(torch.from_numpy(x)).numpy(), zero_signs=False)
    _assert_bits_equal(lite, np.asarray(model(x)), zero_signs=False)


class WeightedIdentity(Layer):
    """A `gradoverride.keras.Layer` with a weight (ones) and its own backward (a class name
    without a leading underscore: Keras makes a layer's name scope from it)."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x: Any) -> Any:
        return x * self.w

    def backward(self, grad: Any, *, x: Any) -> dict[str, Any]:
        return {"x": grad * self.w, "w": grad * x}


def test_exported_saved_model_with_every_layer_kind_converts_and_matches(tmp_path: Path) -> None:
    inputs = keras.Input((8,))
    h = Quantize(bits=4, bound=2.0)(inputs)
    h = WeightedIdentity()(h)
    h = Spike("fast_sigmoid", threshold=0.25)(h)
    outputs = GradientReversal(scale=recipes.ganin_ramp(total_steps=10))(h)
    model = keras.Model(inputs, outputs)
    x = _pad(np.linspace(-2.5, 2.5, 48, dtype=np.float32))
    # Quantize's codes, then a spike of code * 2/7 - 0.25 (torch's values, by hand).
    codes = torch.clamp(torch.round(torch.from_numpy(x) / (2.0 / 7)), -7, 7)
    want = (codes * (2.0 / 7) - 0.25 > 0).float().numpy()
    np.testing.assert_array_equal(np.asarray(model(x)), want)

    model.export(str(tmp_path), format="tf_saved_model", verbose=False)
    loaded = tf.saved_model.load(str(tmp_path))
    _assert_bits_equal(loaded.serve(x).numpy(), want)
    flatbuffer = _convert(tf.lite.TFLiteConverter.from_saved_model(str(tmp_path)))
    _assert_bits_equal(_run_tflite(flatbuffer, x), want)
