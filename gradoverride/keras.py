"""Keras 3 layers: `Layer`, a base class whose subclass defines `backward` next to `call`
(its variables included), and ready-made layers for reversal, spike and quantize.

```python
import keras
import numpy as np
from gradoverride.keras import GradientReversal, Layer, Quantize, Spike

class LayerWithCustomGrad(Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="weights")

    def call(self, x):
        return x * self.w

    def backward(self, grad, *, x):
        return {"x": grad * self.w, "weights": grad * x}

model = keras.Sequential([
    keras.Input((16,)),
    keras.layers.Dense(32),
    Quantize(bits=4),  # n-bit fake quantization, straight-through
    LayerWithCustomGrad(),  # its own backward
    Spike(surrogate="fast_sigmoid"),  # Heaviside forward, surrogate backward
    GradientReversal(scale=0.5),  # identity forward, -0.5 * grad backward
    keras.layers.Dense(1),
])
model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((4, 16), "float32"), np.zeros((4, 1), "float32"), epochs=1, verbose=0)
print(len(model.layers))
#> 6
```

The recipe layers run their `gradoverride.recipes` object inside `call`, so forward and gradient are
the recipe's documented formula, the same as on torch tensors:

* `GradientReversal(scale)`: `reverse_grad(scale)`, identity forward, ``-scale * grad``
  backward; `scale` may be a `ganin_ramp` schedule, whose step count the layer keeps;
* `Spike(surrogate, alpha, scale, at_zero, threshold)`: `spike(...)` of ``x - threshold``,
  a Heaviside step forward, the surrogate's derivative backward; `Spike.preset(...)` too;
* `Quantize(bits, symmetric, bound, keep)`: `quantize(...)`, n-bit fake quantization
  forward, straight-through backward (zero where the code was clamped).

They work in `model.fit` eagerly (`run_eagerly=True`), traced by `tf.function`
(`jit_compile=False`) and compiled by XLA (`jit_compile=True`, what Keras' default "auto"
picks on TensorFlow); their `get_config` round-trips and they are registered with
Keras (package "gradoverride"), so a model saved with `model.save("m.keras")` loads back
with `keras.models.load_model("m.keras")` once `gradoverride.keras` is imported. None of
them has a trainable weight.

Dtypes follow Keras: a floating input is cast to the layer's compute dtype (float32 by
default, float16 under `keras.mixed_precision.set_global_policy("mixed_float16")`), and the
output has that dtype; its gradient flows back through the cast in the input's dtype. Pass
`autocast=False` to keep whatever floating dtype arrives (float64, say).

Requires Keras 3 (`pip install 'gradoverride[tensorflow]'`). On Keras' TensorFlow backend
(`KERAS_BACKEND=tensorflow`, Keras' default) importing `gradoverride.keras` imports
TensorFlow and Keras; `import gradoverride` does not. `Layer` works on Keras' JAX and
torch backends too (there `gradoverride.keras` does not import TensorFlow itself); the
recipe layers call their recipe on the backend's tensors (torch's recipes, or the recipes
that take JAX arrays); `copy_overrides` and `LayerHandle`, like `go.override_backward` and
`go.grad_hook` on Keras layers, need the TensorFlow backend.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

try:
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
except ImportError as error:
    raise ImportError(
        "gradoverride.keras needs TensorFlow and Keras 3: pip install 'gradoverride[tensorflow]' "
        "(from a clone: pip install -e '.[tensorflow]')."
    ) from error

from ._errors import GradOverrideError
from ._keras._layer import Layer
from ._straight_through import Keep
from .recipes import ganin_ramp, quantize, reverse_grad, spike

_BACKEND: str = keras.backend.backend()

if _BACKEND == "tensorflow":
    from ._tensorflow._inventory import copy_overrides
    from ._tensorflow._keras_modules import LayerHandle
elif _BACKEND not in ("jax", "torch"):
    raise ImportError(
        "gradoverride.keras needs Keras' TensorFlow, JAX or torch backend; this Keras runs on "
        f"{_BACKEND!r}. Set KERAS_BACKEND before Keras is imported."
    )
else:

    def copy_overrides(source: Any, target: Any) -> list[Any]:  # type: ignore[misc]
        """Refused on Keras' JAX and torch backends (see `go.override_backward`)."""
        msg = (
            f"copy_overrides: the Keras model {getattr(source, 'name', source)!r} runs on "
            f"Keras' {_BACKEND!r} backend; go.override_backward and go.grad_hook (whose "
            "overrides this copies) support Keras layers on the TensorFlow backend only. Set "
            "KERAS_BACKEND=tensorflow before Keras is imported, or write the gradient as a "
            "gradoverride.keras.Layer subclass, which works on every backend."
        )
        raise GradOverrideError(msg)

    def __getattr__(name: str) -> Any:
        if name == "LayerHandle":
            msg = (
                "gradoverride.keras.LayerHandle is what go.override_backward and go.grad_hook "
                f"return for a Keras layer, which they support on Keras' TensorFlow backend "
                f"only; this Keras runs on {_BACKEND!r}."
            )
            raise AttributeError(msg)
        msg = f"module 'gradoverride.keras' has no attribute {name!r}"
        raise AttributeError(msg)


__all__ = ["GradientReversal", "Layer", "LayerHandle", "Quantize", "Spike", "copy_overrides"]
if _BACKEND != "tensorflow":
    __all__.remove("LayerHandle")


class _RecipeLayer(keras.layers.Layer):  # type: ignore[misc]  # Keras is untyped (Any)
    """Shared by the layers: an elementwise recipe, no weights, masks passed through."""

    recipe: Any

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.supports_masking = True

    def compute_output_spec(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        # The output has the input's shape, and the dtype `call` gives it: the compute dtype
        # for a floating input when autocasting, else the input's own. Answered here so that
        # building a functional model does not trace `call`.
        dtype = inputs.dtype
        if self.autocast and keras.backend.is_float_dtype(dtype):
            dtype = self.compute_dtype
        return keras.KerasTensor(inputs.shape, dtype=dtype)

    def compute_output_shape(self, input_shape: Any) -> Any:
        return input_shape

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        if not self.autocast:  # Keras' Layer.get_config leaves it out
            config["autocast"] = False
        return config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.recipe!r}, name={self.name!r})"


class GradientReversal(_RecipeLayer):
    """Gradient reversal (Ganin & Lempitsky, 2015): identity forward, ``-scale * grad``
    backward; the layer form of `gradoverride.recipes.reverse_grad`.

    Put it between a feature extractor and a domain classifier for domain-adversarial
    training (DANN).

    Args:
        scale: a number (default 1.0; 0 blocks the gradient), or a
            `gradoverride.recipes.ganin_ramp(total_steps=...)` schedule.
        **kwargs: Keras' layer arguments (`name`, `dtype`, `autocast`, ...).

    With a schedule, the layer keeps the step count in a non-trainable int64 variable
    `steps` (saved with the model's weights, restored by `load_model`/`load_weights`). Each
    call with `training=True` (each batch of `model.fit`) uses the scale at the current
    count, then adds 1 to it, as BatchNormalization updates its statistics; other calls
    (`predict`, `evaluate`, a plain `layer(x)`) leave it alone. A layer called k times per
    training step advances k times: give it `total_steps` in calls. Only `ganin_ramp` is
    accepted as a schedule, since the layer must save it in its config. `current_scale()`
    is the scale the next call uses; `layer.steps.assign(n)` sets the count (a custom
    training loop that does not pass `training=True` advances it with
    `layer.steps.assign_add(1)`).
    """

    def __init__(self, scale: float | ganin_ramp | dict[str, Any] = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(scale, dict):  # from get_config
            scale = _ramp_from_config(scale)
        if not isinstance(scale, int | float | ganin_ramp) or isinstance(scale, bool):
            msg = (
                "GradientReversal needs `scale` to be a number or a "
                "gradoverride.recipes.ganin_ramp(...) schedule (the schedules a saved model can "
                f"rebuild), got {type(scale).__name__} {scale!r}."
            )
            raise TypeError(msg)
        if isinstance(scale, int | float):
            scale = float(scale)
        self.recipe = reverse_grad(scale=scale)
        self.scheduled = isinstance(scale, ganin_ramp)
        if self.scheduled:
            self.steps = self.add_weight(
                shape=(),
                dtype="int64",
                initializer="zeros",
                trainable=False,
                name="steps",
                aggregation="only_first_replica",  # as an optimizer's iteration count
            )

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        if not self.scheduled:
            return self.recipe(inputs)
        if _BACKEND != "tensorflow":  # (JAX and torch: the value is an array already)
            outputs = self.recipe(inputs, step=self.steps.value)
            if training:
                self.steps.assign_add(1)
            return outputs
        # Read as a tensor here (`Variable.value` is the tf.Variable itself), so that the
        # increment below is ordered after the read (automatic control dependencies in
        # tf.function) and the backward uses the scale of this forward.
        steps = tf.convert_to_tensor(self.steps.value)
        outputs = self.recipe(inputs, step=steps)
        if training:
            self.steps.assign_add(tf.constant(1, tf.int64))
        return outputs

    def current_scale(self) -> float:
        """The (unsigned) scale the next call uses: the schedule at `steps`, or the number."""
        scale = self.recipe.scale
        if isinstance(scale, ganin_ramp):
            return float(scale(int(self.steps.numpy())))
        return float(scale)

    def get_config(self) -> dict[str, Any]:
        scale = self.recipe.scale
        config = super().get_config()
        if isinstance(scale, ganin_ramp):
            config["scale"] = {
                "schedule": "ganin_ramp",
                "total_steps": scale.total_steps,
                "gamma": scale.gamma,
                "max_scale": scale.max_scale,
            }
        else:
            config["scale"] = scale
        return config


def _ramp_from_config(config: dict[str, Any]) -> ganin_ramp:
    fields = dict(config)
    kind = fields.pop("schedule", None)
    if kind != "ganin_ramp":
        msg = f"GradientReversal: unknown schedule {kind!r} in config {config!r}."
        raise ValueError(msg)
    return ganin_ramp(**fields)


class Spike(_RecipeLayer):
    """A Heaviside spike with a surrogate gradient; the layer form of
    `gradoverride.recipes.spike`.

    Forward: ``H(x - threshold)``: 1 above the threshold, 0 below, `at_zero` at it.
    Backward: ``dL/dx = dL/dy * scale * sg(x - threshold)``, where sg is the surrogate's
    derivative with sharpness `alpha` (see `gradoverride.recipes.spike` for the table).

    Args:
        surrogate: one of `gradoverride.recipes.SURROGATES` (default "arctan").
        alpha: the surrogate's sharpness; None: its default, where sg(0) = 1.
        scale: multiplies the surrogate gradient (default 1).
        at_zero: the step's value at the threshold (0: spike when above, as snnTorch and
            norse; 1: when at or above, as SpikingJelly).
        threshold: subtracted from the input first (default 0), so that a `Sequential`
            needs no extra layer for it; the recipe itself takes ``v - v_th``. A constant,
            not a weight.
        leak: the gradient outside the window or on the silent side (`rectangular`,
            `log_tailed_relu`, `leaky_relu`; see `gradoverride.recipes.spike`).
        spread: the noise on `leaky_relu`'s silent side; such a spike draws TensorFlow's
            random numbers on every call.
        beta: `s2nn`'s right branch height.
        terms: `squarewave_fourier`'s number of harmonics.
        bound: `sparse_fast_sigmoid`'s lower bound.
        center: where the surrogate is centred (the step stays at the threshold).
        sample: draw the spike from Bernoulli(the surrogate's step), with TensorFlow's
            random numbers on every call.
        **kwargs: Keras' layer arguments (`name`, `dtype`, `autocast`, ...).

    `Spike.preset("snntorch.fast_sigmoid", slope=25)` takes a library's convention, as
    `spike.preset` does (see `gradoverride.recipes.SPIKE_PRESETS`).
    """

    def __init__(
        self,
        surrogate: str = "arctan",
        alpha: float | None = None,
        scale: float = 1.0,
        at_zero: float = 0.0,
        threshold: float = 0.0,
        *,
        leak: float | None = None,
        spread: float | None = None,
        beta: float | None = None,
        terms: int | None = None,
        bound: float | None = None,
        center: float = 0.0,
        sample: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.recipe = spike(
            surrogate=surrogate, alpha=alpha, scale=scale, at_zero=at_zero, leak=leak,
            spread=spread, beta=beta, terms=terms, bound=bound, center=center, sample=sample,
        )
        if (
            not isinstance(threshold, int | float)
            or isinstance(threshold, bool)
            or not math.isfinite(threshold)
        ):
            msg = f"Spike needs `threshold` to be a finite number, got {threshold!r}."
            raise TypeError(msg)
        self.threshold = float(threshold)

    @classmethod
    def preset(cls, name: str, /, *, threshold: float = 0.0, **params: Any) -> Spike:
        """The layer whose forward and gradient are a library's surrogate, in that library's
        parameter names: `Spike.preset("snntorch.atan", alpha=2.0)`. Keras' layer arguments
        (`name`, `dtype`, ...) go in `params` too."""
        keras_args = {k: params.pop(k) for k in ("name", "dtype", "autocast") if k in params}
        recipe = spike.preset(name, **params)
        return cls(threshold=threshold, **_spike_fields(recipe), **keras_args)

    def call(self, inputs: Any) -> Any:
        if self.threshold != 0:
            if _BACKEND == "tensorflow":
                inputs = inputs - tf.constant(self.threshold, inputs.dtype)
            else:
                inputs = inputs - keras.ops.cast(self.threshold, inputs.dtype)
        return self.recipe(inputs)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(_spike_fields(self.recipe), threshold=self.threshold)
        return config

    def __repr__(self) -> str:
        extra = f", threshold={self.threshold!r}" if self.threshold else ""
        return f"Spike({self.recipe!r}{extra}, name={self.name!r})"


def _spike_fields(recipe: spike) -> dict[str, Any]:
    """The recipe's fields, those its surrogate does not take (None) left out: what rebuilds
    it (every field, so that no parameter of a preset is dropped)."""
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}
    return {k: v for k, v in fields.items() if v is not None}


class Quantize(_RecipeLayer):
    """Uniform n-bit fake quantization with a straight-through gradient; the layer form of
    `gradoverride.recipes.quantize`.

    Forward: ``y = (clamp(round(x / s) + z, qmin, qmax) - z) * s``; backward: the upstream
    gradient where the code was not clamped, else 0. With ``bound=None`` the range is the
    whole batch tensor's (max|x|, or its min and max), a constant for the gradient.

    The outputs are the torch recipe's, bit for bit, eagerly, under `tf.function` and XLA,
    and in a SavedModel (`model.export`) converted to TFLite with builtin ops only
    (`tf.lite.OpsSet.TFLITE_BUILTINS`), where x / s stays a float32 division (TFLite may
    give -0 where torch gives +0).

    Args:
        bits: the number of bits (2..16 symmetric, 1..16 asymmetric; default 8).
        symmetric: codes -(2^(b-1) - 1) .. 2^(b-1) - 1 around 0 (default), or 0 .. 2^b - 1.
        bound: None (the range from the input), B for [-B, B] (symmetric), or a pair
            (low, high) (asymmetric).
        keep: what the backward keeps: "input" (default) or "mask" (one byte per element).
        **kwargs: Keras' layer arguments (`name`, `dtype`, `autocast`, ...).
    """

    def __init__(
        self,
        bits: int = 8,
        symmetric: bool = True,
        bound: float | tuple[float, float] | list[float] | None = None,
        keep: Keep = "input",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # A pair comes back from a saved config (JSON) as a list; the recipe checks the rest.
        pair: Any = tuple(bound) if isinstance(bound, list) else bound
        self.recipe = quantize(bits=bits, symmetric=symmetric, bound=pair, keep=keep)

    def call(self, inputs: Any) -> Any:
        return self.recipe(inputs)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        recipe = self.recipe
        bound = recipe.bound
        config.update(
            bits=recipe.bits,
            symmetric=recipe.symmetric,
            bound=list(bound) if isinstance(bound, tuple) else bound,
            keep=recipe.keep,
        )
        return config


for _layer in (GradientReversal, Spike, Quantize):
    keras.saving.register_keras_serializable(package="gradoverride")(_layer)
del _layer
