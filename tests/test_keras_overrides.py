"""`go.overrides` on Keras 3 models and layers: a model built with a known set of overrides
(nested layers, a shared layer, removed ones) gives exactly those rows, at the paths written
out here by hand; and the errors of `go.overrides` and `go.monitor` on Keras values."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import pytest
from tf_support import tf

# isort: split
import keras  # after tf_support, which skips this module without TensorFlow

import gradoverride as go
from gradoverride import recipes
from gradoverride.diagnostics._inventory import OverrideRecord
from gradoverride.keras import GradientReversal, Layer, Quantize, Spike

Record = OverrideRecord


class Scale(Layer, owns="x", residuals="twice"):
    """A layer with its own backward (owning its input only, with a residual)."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x: Any) -> Any:
        return x * self.w, {"twice": 2 * self.w}

    def backward(self, grad: Any, *, twice: Any) -> Any:
        return {"x": grad * twice}


@go.custom_backward
def doubled_grad(x: Any) -> Any:
    return tf.identity(x)


@doubled_grad.backward
def _(grad: Any) -> Any:
    return 2 * grad


def dense_rule(grad: Any, *, inputs: Any, layer: Any) -> Any:
    return {"inputs": grad @ tf.transpose(layer.kernel), "kernel": None, "bias": None}


def halve(grad: Any) -> Any:
    return grad / 2


class Block(keras.layers.Layer):  # type: ignore[misc]  # Keras is untyped
    """A subclassed layer: sublayers in attributes, a list, a dict and a Sequential."""

    def __init__(self, shared: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.scale = Scale()
        self.parts = [Spike(threshold=0.5), keras.layers.Dense(4)]
        self.heads = {"q": Quantize(bits=4)}
        self.inner = keras.Sequential(
            [keras.layers.Dense(4, name="first"), GradientReversal(0.5, name="rev")]
        )
        self.shared = shared  # also called at the model's top: listed there, once
        self._gate = Spike()  # a private attribute is a path too, as in torch
        self.surrogate = recipes.spike(surrogate="fast_sigmoid")
        self.op = doubled_grad

    def call(self, x: Any) -> Any:
        x = self.op(self.scale(self.dense(x)))
        x = self.surrogate(self.parts[1](self.parts[0](x)))
        return self._gate(self.shared(self.inner(self.heads["q"](x))))


def _model() -> tuple[Any, Block]:
    shared = keras.layers.Dense(4, name="shared")
    inputs = keras.Input((4,))
    block = Block(shared, name="block")
    frozen = keras.layers.Dense(4, name="frozen", trainable=False)
    outputs = keras.layers.Dense(1, name="head")(frozen(block(shared(inputs))))
    return keras.Model(inputs, outputs, name="net"), block


SPIKE = "spike(surrogate='arctan', alpha=2.0, scale=1.0, at_zero=0.0)"
FAST_SIGMOID = "spike(surrogate='fast_sigmoid', alpha=2.0, scale=1.0, at_zero=0.0)"
QUANTIZE = "quantize(bits=4, symmetric=True, bound=None, keep='input')"
CLIP_NORM = "clip_grad_norm(max_norm=1.0, dim=None, norm_type=2.0, eps=1e-06)"


def test_a_model_lists_each_override_once_at_its_path() -> None:
    model, block = _model()
    go.grad_hook(model.get_layer("shared"), halve, at="outputs")
    go.grad_hook(block.dense, recipes.clip_grad_value(0.5), at="inputs")  # before the override
    go.override_backward(block.dense, dense_rule)
    go.grad_hook(block.dense, halve, at="outputs")
    go.grad_hook(model.get_layer("frozen"), halve, at="variables")  # no trainable variable
    go.grad_hook(model.get_layer("head"), recipes.clip_grad_norm(1.0), at="variables")
    removed_override = go.override_backward(model.get_layer("head"), dense_rule)
    removed_hook = go.grad_hook(block.parts[1], halve, at="inputs")
    removed_override.remove()
    removed_hook.remove()

    assert list(go.overrides(model)) == [
        Record("shared", "grad_hook", "halve", "at outputs", True),
        Record("block", "recipe", FAST_SIGMOID, "attribute `surrogate`", None),
        Record("block", "op", "doubled_grad", "attribute `op`", None),
        Record("block.dense", "override_backward", "Dense", "backward=dense_rule", True),
        Record("block.dense", "grad_hook", "clip_grad_value(clip_value=0.5)", "at inputs", True),
        Record("block.dense", "grad_hook", "halve", "at outputs", True),
        Record("block.scale", "keras.Layer", "Scale",
               "backward=Scale.backward; owns=x; residuals=twice", True),
        Record("block.parts.0", "recipe layer", SPIKE, "threshold=0.5", True),
        Record("block.heads.q", "recipe layer", QUANTIZE, "", True),
        Record("block.inner.rev", "recipe layer", "reverse_grad(scale=0.5)", "", True),
        Record("block._gate", "recipe layer", SPIKE, "", True),
        Record("frozen", "grad_hook", "halve", "at variables", False),
        Record("head", "grad_hook", CLIP_NORM, "at variables", True),
    ]


def test_a_layer_is_listed_under_its_first_path_only() -> None:
    """The shared layer is reached at the top and as `block.shared`; a Sequential reached
    twice lists its layers once."""
    model, block = _model()
    go.grad_hook(block.shared, halve, at="outputs")
    twice = keras.Sequential([keras.Input((4,)), model, model])
    assert [(r.path, r.kind) for r in go.overrides(twice)] == [
        ("net.shared", "grad_hook"),
        ("net.block", "recipe"),
        ("net.block", "op"),
        ("net.block.scale", "keras.Layer"),
        ("net.block.parts.0", "recipe layer"),
        ("net.block.heads.q", "recipe layer"),
        ("net.block.inner.rev", "recipe layer"),
        ("net.block._gate", "recipe layer"),
    ]


class Net(keras.Model):  # type: ignore[misc]  # Keras is untyped
    def __init__(self) -> None:
        super().__init__()
        self.encoder = keras.layers.Dense(3)
        self.layers_by_role = {"act": Spike(), "out": keras.layers.Dense(1)}

    def call(self, x: Any) -> Any:
        return self.layers_by_role["out"](self.layers_by_role["act"](self.encoder(x)))


def test_a_subclassed_model_names_layers_by_attribute_and_lists_its_own_hooks() -> None:
    net = Net()
    go.grad_hook(net, halve, at="outputs")  # on the model itself: path ""
    go.grad_hook(net.encoder, halve, at="variables")  # not built yet: unknown
    with go.grad_hook(net.layers_by_role["out"], halve, at="inputs"):
        assert [(r.path, r.kind, r.settings, r.active) for r in go.overrides(net)] == [
            ("", "grad_hook", "at outputs", True),
            ("encoder", "grad_hook", "at variables", None),
            ("layers_by_role.act", "recipe layer", "", True),
            ("layers_by_role.out", "grad_hook", "at inputs", True),
        ]
    net(tf.ones((2, 4)))  # built: the encoder's kernel and bias are trainable
    assert [(r.path, r.active) for r in go.overrides(net)] == [
        ("", True), ("encoder", True), ("layers_by_role.act", True),
    ]


def test_the_table_has_a_title_and_a_header() -> None:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="dense"),
                              GradientReversal(2.0, name="reverse")], name="seq")
    go.grad_hook(model, halve, at="inputs")
    go.grad_hook(model.get_layer("dense"), halve, at="outputs")
    lines = str(go.overrides(model)).splitlines()
    assert lines[0] == "3 gradient overrides in Sequential"
    assert lines[1].split() == ["path", "kind", "override", "settings", "active"]
    assert [line.split() for line in lines[3:]] == [
        ["(model)", "grad_hook", "halve", "at", "inputs", "yes"],
        ["dense", "grad_hook", "halve", "at", "outputs", "yes"],
        ["reverse", "recipe", "layer", "reverse_grad(scale=2.0)", "yes"],
    ]


def test_a_model_without_overrides_says_so() -> None:
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    hook = go.grad_hook(model.layers[0], halve, at="outputs")
    hook.remove()
    found = go.overrides(model)
    assert len(found) == 0
    assert str(found) == "no gradient overrides in Sequential"


def test_example_inputs_for_a_keras_model_are_refused() -> None:
    model = keras.Sequential([keras.Input((2,)), Spike()])
    with pytest.raises(go.GradOverrideError,
                       match=r"go.overrides got example inputs for the Keras model Sequential; "
                             r".*for torch models only. Call `go.overrides\(model\)` without"):
        go.overrides(model, tf.ones((1, 2)))


@pytest.mark.parametrize("value", [tf.Module(name="module"), tf.Variable(1.0)],
                         ids=["tf.Module", "tf.Variable"])
def test_something_neither_torch_nor_keras_is_named(value: Any) -> None:
    with pytest.raises(go.GradOverrideTypeError,
                       match=rf"go.overrides needs a model \(an nn.Module or a Keras model\); "
                             rf"got {type(value).__name__} "):
        go.overrides(value)


def test_monitor_on_a_keras_model_points_to_overrides() -> None:
    model = keras.Sequential([keras.Input((2,)), Spike()])
    with pytest.raises(go.GradOverrideError,
                       match=r"go.monitor records PyTorch models; got the Keras model "
                             r"Sequential. `go.overrides\(model\)` lists a Keras model's "
                             r"overrides.*register a `go.grad_hook` whose transform writes "
                             r"`tf.summary.scalar"):
        go.monitor(model)
