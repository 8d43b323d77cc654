"""`go.overrides` for a Keras 3 model or layer: the gradient overrides of every layer reachable
from it, found without running it.

A layer's path is dotted, as torch's `encoder.block1.act`: in a subclassed layer or model, the
attribute that holds a sublayer (`self.encoder = ...` is `encoder`; an item of a list or dict
attribute is `blocks.0`, `heads.age`); in a functional or Sequential model, which holds its
layers in its graph rather than in attributes, the layer's name (what `model.get_layer` takes).
A sublayer Keras tracks but no attribute holds is named by its layer name too.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import keras
from keras.src.models.functional import Functional  # not exported by `keras` itself

from .._decorators import CustomBackward
from .._errors import GradOverrideError
from ..diagnostics._inventory import OverrideRecord, _held, _held_record
from ..diagnostics._recorder import describe_transform
from ._keras_modules import LayerCall, LayerHandle, _Hook, _Override, attachments_of, hook_layer
from ._layer import Layer

__all__ = ["copy_overrides", "keras_overrides", "named_layers"]


def keras_overrides(model: Any) -> list[OverrideRecord]:
    """Every gradient override reachable from the Keras `model`, one record each, layer by
    layer (parents before their sublayers)."""
    records: list[OverrideRecord] = []
    for path, layer in named_layers(model):
        records += _layer_records(path, layer)
    return records


def copy_overrides(source: Any, target: Any) -> list[LayerHandle]:
    """Install on `target` (a copy of the Keras model or layer `source`) the overrides and
    hooks `go.override_backward` and `go.grad_hook` installed on `source`, layer by layer.

    Keras copies a layer by saving and loading it (`copy.deepcopy`, `keras.models.
    clone_model`, a `.keras` file), which keeps its config and weights but not what was
    installed on the instance. Layers are matched by their path in the model (as
    `go.overrides` names them: in a functional or Sequential model, the layer's name), so a
    copy with other layer names is refused and one with the names swapped between layers of
    the same class gets each override where the name says; the override's rule and the
    hooks' functions are shared.
    Returns the new handles.
    """
    targets = dict(named_layers(target))
    handles = []
    for path, layer in named_layers(source):
        attachments = attachments_of(layer)
        if not attachments:
            continue
        twin = targets.get(path)
        if twin is None or type(twin) is not type(layer):
            where = f"`{path}`" if path else "the model itself"
            found = "nothing" if twin is None else f"a {type(twin).__name__}"
            msg = (
                f"copy_overrides: {where} is a {type(layer).__name__} with overrides or "
                f"hooks in the source, and {found} in the target. Layers are matched by path "
                "(the attribute holding them, or their name in a functional or Sequential "
                "model): give a copy that keeps the layer names, as `copy.deepcopy(source)` "
                "and `keras.models.clone_model(source)` do, or install on the copy yourself."
            )
            raise GradOverrideError(msg)
        for attachment in attachments:
            if isinstance(attachment, _Override):
                override = _Override(attachment.op, attachment.description.replace(
                    f"`{layer.name}`", f"`{twin.name}`", 1))
                layer_call = LayerCall.of(twin, create=True)
                assert layer_call is not None
                layer_call.attach(override)
                handles.append(LayerHandle(layer_call, override))
            else:
                handles.append(hook_layer(twin, attachment.fn, attachment.at))
    return handles


def named_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """`model` (path `""`) and each layer under it, once, with its path; a layer reached
    twice (shared) keeps its first path."""
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", model)]
    while stack:
        path, layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield path, layer
        children = [(f"{path}.{name}" if path else name, child)
                    for name, child in _children(layer)]
        stack += reversed(children)  # popped in order: depth first, as named_modules()


def _children(layer: Any) -> list[tuple[str, Any]]:
    """The layer's direct sublayers with their names: by attribute, else by layer name."""
    sublayers: list[Any] = list(layer._layers)  # what Keras tracks, in order
    named: list[tuple[str, Any]] = []
    if not isinstance(layer, keras.Sequential | Functional):
        tracked = {id(sublayer) for sublayer in sublayers}
        named = [(n, s) for n, s in _attribute_layers(vars(layer)) if id(s) in tracked]
    found = {id(sublayer) for _, sublayer in named}
    return named + [(s.name, s) for s in sublayers if id(s) not in found]


def _attribute_layers(attributes: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The layers held by a layer's attributes, in the order they were set, each named by its
    attribute (and index or key, for an item of a list, tuple or dict)."""
    for name, value in attributes.items():
        # Keras' and TensorFlow's own bookkeeping, which lists the sublayers again.
        if name == "_layers" or name.startswith("_self_"):
            continue
        yield from _layers_in(name, value)


def _layers_in(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, keras.layers.Layer):
        yield name, value
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _layers_in(f"{name}.{index}", item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _layers_in(f"{name}.{key}", item)


def _layer_records(path: str, layer: Any) -> list[OverrideRecord]:
    records = []
    op = getattr(type(layer), "_gradoverride_op", None)
    if isinstance(layer, Layer) and op is not None:
        records.append(OverrideRecord(
            path, "keras.Layer", type(layer).__name__,
            _op_settings(f"{type(layer).__qualname__}.backward", op), True,
        ))
    # Innermost first: the override (always innermost), then the hooks in the order made.
    for attachment in attachments_of(layer):
        if isinstance(attachment, _Override):
            assert attachment.op._rule is not None  # registered when the override was made
            records.append(OverrideRecord(
                path, "override_backward", type(layer).__name__,
                _op_settings(attachment.op._rule.name, attachment.op), True,
            ))
        elif isinstance(attachment, _Hook):
            records.append(_hook_record(path, layer, attachment))
    recipe_layer = _recipe_layer_record(path, layer)
    if recipe_layer is not None:
        records.append(recipe_layer)
    else:
        records += [_held_record(path, attribute, value, None)
                    for attribute, value in _held(layer)]
    return records


def _op_settings(rule: str, op: CustomBackward[..., Any]) -> str:
    """As torch's `go.Module` row: the rule, and what it owns and keeps if set."""
    parts = [f"backward={rule}"]
    owns = op._rule_options.get("owns")
    if owns is not None:
        parts.append(f"owns={', '.join(owns)}")
    if op._residuals:
        parts.append(f"residuals={', '.join(op._residuals)}")
    if op._rule_options.get("once_differentiable"):
        parts.append("once_differentiable")
    return "; ".join(parts)


def _hook_record(path: str, layer: Any, hook: _Hook) -> OverrideRecord:
    active: bool | None = True
    if hook.at == "variables" and not layer.trainable_variables:
        # None until built: the variables it will make may be trainable.
        active = False if layer.built else None
    return OverrideRecord(path, "grad_hook", describe_transform(hook.fn), f"at {hook.at}",
                          active)


def _recipe_layer_record(path: str, layer: Any) -> OverrideRecord | None:
    """The row of one of `gradoverride.keras`' recipe layers (`Spike`, ...), or None."""
    layers = sys.modules.get("gradoverride.keras")  # none exists unless it was imported
    if layers is None or not isinstance(layer, layers._RecipeLayer):
        return None
    threshold = getattr(layer, "threshold", 0.0)
    settings = f"threshold={threshold!r}" if threshold else ""
    return OverrideRecord(path, "recipe layer", repr(layer.recipe), settings, True)
