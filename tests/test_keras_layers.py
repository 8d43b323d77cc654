"""`gradoverride.keras`: the Keras 3 layers for reversal, spike and quantize.

Each layer's forward and gradient equal the torch recipe's on the same inputs (eagerly,
traced and under XLA); a small model with all three trains with `model.fit` under
`jit_compile=True` and `run_eagerly=True`, and the custom gradients are what reach the
weights before the layers; configs round-trip and a saved `.keras` model loads back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
import torch
from tf_support import MODES, gradients, tf

# isort: split
import keras  # after tf_support, which skips this module without TensorFlow

from gradoverride import recipes
from gradoverride.keras import GradientReversal, Quantize, Spike

# A grid with the values where the formulas change: 0, the window ends, halves.
X = np.linspace(-2.0, 2.0, 18, dtype=np.float32).reshape(2, 9)
X[0, 4] = 0.0
X[1, 3] = 0.5


def _torch_reference(recipe: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The torch recipe's output and input gradient, for the weighting tf_support.gradients
    uses: sum(out * (1..n) / n)."""
    leaf = torch.tensor(x, requires_grad=True)
    out = recipe(leaf)
    n = out.numel()
    weights = torch.arange(1, n + 1, dtype=out.dtype).reshape(out.shape) / n
    (out * weights).sum().backward()
    assert leaf.grad is not None
    return out.detach().numpy(), leaf.grad.numpy()


def _check_parity(layer: Any, recipe: Any, mode: str, shift: float = 0.0) -> None:
    out, (grad,) = gradients(layer, tf.constant(X), mode=mode)
    want_out, want_grad = _torch_reference(lambda t: recipe(t - shift), X)
    assert out.dtype == tf.float32 and grad.dtype == tf.float32
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-6, atol=1e-7)


# ---- forward and gradient: the torch recipe's ------------------------------------------------

# The recipes' own parity in TensorFlow's three modes is tested with the recipes; here each
# layer's settings reach its recipe (eagerly, every case), and one case of each layer runs
# traced and under XLA (one compiled function per mode).
SPIKES = [
    ({}, 0.0),
    ({"surrogate": "fast_sigmoid", "alpha": 3.0, "scale": 0.5}, 0.0),
    ({"surrogate": "triangle", "at_zero": 1.0}, 0.5),
    ({"surrogate": "rectangular", "alpha": 0.5}, -1.0),
]
QUANTIZERS: list[dict[str, Any]] = [
    {"bits": 3},
    {"bits": 3, "bound": 1.0},  # codes clamped beyond |x| = 1: gradient zero there
    {"bits": 2, "symmetric": False, "bound": (-0.5, 1.5), "keep": "mask"},
]


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.0])
def test_gradient_reversal_matches_torch(scale: float) -> None:
    _check_parity(GradientReversal(scale=scale), recipes.reverse_grad(scale=scale), "eager")


@pytest.mark.parametrize(("kwargs", "threshold"), SPIKES)
def test_spike_matches_torch(kwargs: dict[str, Any], threshold: float) -> None:
    layer = Spike(**kwargs, threshold=threshold)
    _check_parity(layer, recipes.spike(**kwargs), "eager", shift=threshold)


@pytest.mark.parametrize("kwargs", QUANTIZERS)
def test_quantize_matches_torch(kwargs: dict[str, Any]) -> None:
    _check_parity(Quantize(**kwargs), recipes.quantize(**kwargs), "eager")


@pytest.mark.parametrize("mode", [m for m in MODES if m != "eager"])
def test_layers_match_torch_traced_and_compiled(mode: str) -> None:
    (spike_kwargs, threshold), quantize_kwargs = SPIKES[2], QUANTIZERS[2]
    layers = [
        GradientReversal(scale=0.5),
        Spike(**spike_kwargs, threshold=threshold),
        Quantize(**quantize_kwargs),
    ]
    torch_recipes = [
        recipes.reverse_grad(scale=0.5),
        lambda t: recipes.spike(**spike_kwargs)(t - threshold),
        recipes.quantize(**quantize_kwargs),
    ]

    def all_three(x: Any) -> Any:
        return tf.stack([layer(x) for layer in layers])

    out, (grad,) = gradients(all_three, tf.constant(X), mode=mode)
    # The weighting runs over the stacked outputs: layer k's block is weighted
    # (k n + 1 .. (k + 1) n) / 3n.
    n = X.size
    leaf = torch.tensor(X, requires_grad=True)
    stacked = torch.stack([recipe(leaf) for recipe in torch_recipes])
    weights = torch.arange(1, 3 * n + 1, dtype=torch.float32).reshape(stacked.shape) / (3 * n)
    (stacked * weights).sum().backward()
    assert leaf.grad is not None
    np.testing.assert_allclose(out.numpy(), stacked.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad.numpy(), leaf.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_spike_preset_is_the_recipe_preset() -> None:
    layer = Spike.preset("snntorch.fast_sigmoid", slope=10.0, name="lif")
    assert layer.recipe == recipes.spike.preset("snntorch.fast_sigmoid", slope=10.0)
    assert layer.name == "lif"
    _check_parity(layer, layer.recipe, "eager")


@pytest.mark.parametrize(
    ("name", "params"),
    [("spikingjelly.PiecewiseLeakyReLU", {"w": 0.5, "c": 0.1}),
     ("snntorch.spike_rate_escape", {"beta": 2.0}), ("spikingjelly.S2NN", {"beta": 0.5}),
     ("spikingjelly.SquarewaveFourierSeries", {"n": 3})],
)
def test_spike_preset_keeps_every_parameter(name: str, params: dict[str, float]) -> None:
    """A leak, a centre, a second shape parameter: the layer's recipe is the preset's."""
    layer = Spike.preset(name, **params)
    assert layer.recipe == recipes.spike.preset(name, **params)
    _check_parity(layer, layer.recipe, "eager")


def test_scheduled_reversal_uses_the_step_then_advances() -> None:
    ramp = recipes.ganin_ramp(total_steps=4)
    layer = GradientReversal(scale=ramp)
    x = tf.constant(X)
    for step in range(3):
        assert int(layer.steps.numpy()) == step
        assert layer.current_scale() == pytest.approx(float(ramp(step)))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        grad = tape.gradient(y, x, output_gradients=tf.ones_like(x))
        np.testing.assert_allclose(grad.numpy(), -float(ramp(step)), rtol=1e-6)
    layer(x)  # not training: the count stays
    layer(x, training=False)
    assert int(layer.steps.numpy()) == 3


# ---- dtypes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [GradientReversal, Spike, Quantize])
def test_mixed_precision_computes_in_float16(make: Any) -> None:
    layer = make(dtype="mixed_float16")
    x = tf.constant(X)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
    assert y.dtype == tf.float16  # the compute dtype
    grad = tape.gradient(y, x)
    assert grad.dtype == tf.float32  # back through Keras' cast, in the input's dtype
    symbolic = layer(keras.Input((9,), dtype="float32"))
    assert symbolic.dtype == "float16"


@pytest.mark.parametrize("make", [GradientReversal, Spike, Quantize])
def test_autocast_false_keeps_the_input_dtype(make: Any) -> None:
    layer = make(autocast=False)
    y = layer(tf.constant(X, tf.float64))
    assert y.dtype == tf.float64
    assert layer(keras.Input((9,), dtype="float64")).dtype == "float64"
    assert make.from_config(layer.get_config()).autocast is False


# ---- training with model.fit -----------------------------------------------------------------


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = (x[:, :1] - 0.5 * x[:, 1:2] > 0).astype(np.float32)
    return x, y


def _model(middle: keras.layers.Layer) -> keras.Model:
    """Dense -> `middle` -> Quantize -> Dense -> Spike -> Dense, seeded: the first Dense is
    behind all three gradient overrides, and the true gradient of Quantize and Spike is 0."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, name="first")(inputs)
    h = middle(h)
    h = Quantize(bits=4)(h)
    h = keras.layers.Dense(8)(h)
    h = Spike(surrogate="fast_sigmoid", alpha=1.0)(h)
    outputs = keras.layers.Dense(1)(h)
    return keras.Model(inputs, outputs)


# model.compile arguments: XLA (what Keras' "auto" picks on TensorFlow), and eager.
_FIT_MODES = {"jit_compile": {"jit_compile": True}, "run_eagerly": {"run_eagerly": True}}


@pytest.mark.parametrize("fit_mode", list(_FIT_MODES))
def test_fit_trains_through_all_three_layers(fit_mode: str) -> None:
    x, y = _data()
    grl = GradientReversal(scale=recipes.ganin_ramp(total_steps=8, max_scale=0.1))
    model = _model(grl)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", **_FIT_MODES[fit_mode])
    first = model.get_layer("first").kernel
    start = first.numpy().copy()
    last = model.layers[-1].kernel
    last_start = last.numpy().copy()
    # Full batches (the spikes make a mini-batch loss jumpy). The ramp's scale is 0 at
    # step 0: the first batch trains the layers after the reversal and blocks the gradient
    # of the first layer, exactly (Adam moves nothing for a zero gradient).
    losses = model.fit(x, y, batch_size=64, epochs=1, verbose=0).history["loss"]
    assert int(grl.steps.numpy()) == 1
    np.testing.assert_array_equal(first.numpy(), start)
    assert not np.array_equal(last.numpy(), last_start)
    losses += model.fit(x, y, batch_size=64, epochs=7, verbose=0).history["loss"]
    assert int(grl.steps.numpy()) == 8
    assert losses[-1] < 0.7 * losses[0], losses
    # Quantize and Spike have a zero true gradient almost everywhere: the first layer
    # learns only through their straight-through and surrogate gradients.
    assert not np.allclose(first.numpy(), start)
    model(x[:4])  # inference calls leave the count alone
    model(x[:4], training=False)
    assert int(grl.steps.numpy()) == 8


@pytest.mark.parametrize("fit_mode", list(_FIT_MODES))
def test_fit_reverses_the_gradient_before_the_layer(fit_mode: str) -> None:
    # The same layers without the reversal (a second model sharing them) give the plain
    # gradient g of the first kernel; one SGD step of model.fit through the reversal moves
    # that kernel by -lr * (-scale * g).
    x, y = _data()
    x, y = x[:16], y[:16]
    keras.utils.set_random_seed(0)
    first = keras.layers.Dense(8)
    rest = [Quantize(bits=4), keras.layers.Dense(8), Spike(alpha=1.0), keras.layers.Dense(1)]
    inputs = keras.Input((6,))

    def tail(h: Any) -> Any:
        for layer in rest:
            h = layer(h)
        return h

    plain = keras.Model(inputs, tail(first(inputs)))
    model = keras.Model(inputs, tail(GradientReversal(scale=0.5)(first(inputs))))
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, plain(x, training=True))
    g_plain = tape.gradient(loss, first.kernel)
    assert float(tf.reduce_max(tf.abs(g_plain))) > 1e-4  # the kernel gets a gradient

    lr = 0.1
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse", **_FIT_MODES[fit_mode])
    start = first.kernel.numpy().copy()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    step = first.kernel.numpy() - start
    np.testing.assert_allclose(step, lr * 0.5 * g_plain.numpy(), rtol=1e-4, atol=1e-7)


# ---- configs and saving ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "layer",
    [
        GradientReversal(),
        GradientReversal(scale=0.25, name="grl"),
        GradientReversal(scale=recipes.ganin_ramp(total_steps=100, gamma=5.0, max_scale=0.5)),
        Spike(),
        Spike(surrogate="erf", alpha=2.0, scale=0.5, at_zero=1.0, threshold=0.3),
        Spike.preset("norse.super"),
        Spike.preset("spikingjelly.PiecewiseLeakyReLU", w=0.5, c=0.1),
        Spike.preset("snntorch.spike_rate_escape"),
        Spike.preset("norse.circ_dist_fn", k=2.0),
        Spike(surrogate="leaky_relu", leak=0.1, spread=0.2),
        Quantize(),
        Quantize(bits=4, bound=2.0, keep="mask"),
        Quantize(bits=3, symmetric=False, bound=(-1.0, 3.0)),
        Quantize(dtype="mixed_float16"),
    ],
    ids=repr,
)
def test_config_round_trip(layer: Any) -> None:
    config = layer.get_config()
    again = type(layer).from_config(config)
    assert again.recipe == layer.recipe
    assert again.get_config() == config
    assert repr(again) == repr(layer)
    assert keras.saving.get_registered_name(type(layer)) == f"gradoverride>{type(layer).__name__}"


def test_repr_names_the_recipe() -> None:
    assert repr(GradientReversal(scale=0.5, name="grl")) == (
        "GradientReversal(reverse_grad(scale=0.5), name='grl')"
    )
    assert repr(Spike(threshold=1.0, name="lif")) == (
        "Spike(spike(surrogate='arctan', alpha=2.0, scale=1.0, at_zero=0.0), threshold=1.0, "
        "name='lif')"
    )


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="ganin_ramp"):
        GradientReversal(scale=lambda step: 0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="threshold"):
        Spike(threshold=float("nan"))
    with pytest.raises(Exception, match="unknown surrogate"):
        Spike(surrogate="nope")
    with pytest.raises(Exception, match="bits"):
        Quantize(bits=1)


# Keras' saving calls np.array on TensorFlow variables, whose __array__ takes no `copy`
# keyword: numpy 2 warns (keras/src/backend/tensorflow/core.py, convert_to_numpy).
@pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)
def test_save_and_load_give_the_same_model(tmp_path: Path) -> None:
    x, _ = _data()
    model = _model(GradientReversal(scale=recipes.ganin_ramp(total_steps=10), name="grl"))
    model(x, training=True)  # two training calls: the count is 2
    model(x, training=True)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())
    grl = loaded.get_layer("grl")
    assert isinstance(grl, GradientReversal)
    assert int(grl.steps.numpy()) == 2  # the schedule's count is saved with the weights
    assert grl.recipe == model.get_layer("grl").recipe
    kinds = [type(layer).__name__ for layer in loaded.layers]
    assert {"GradientReversal", "Quantize", "Spike"} <= set(kinds)
