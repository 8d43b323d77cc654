"""`go.overrides(model)`: every gradient override reachable from a model, as a table."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch import nn

from .._decorators import CustomBackward, CustomBackwardModule
from .._errors import GradOverrideError, GradOverrideTypeError
from .._frameworks import is_keras_layer
from .._signature import describe
from .._table import format_table, one_line

__all__ = ["OverrideRecord", "Overrides", "overrides"]


@dataclass(frozen=True)
class OverrideRecord:
    """One gradient override in a model (a row of `go.overrides(model)`).

    Attributes:
        path: the module's path in the model, as `named_modules()` gives it (`""` for the
            model itself); for a Keras layer, the attributes or layer names leading to it
            (see `go.overrides`).
        kind: `"go.Module"`, `"override_backward"`, `"grad_hook"`, `"recipe module"`,
            `"op module"`, `"recipe"` or `"op"` (a recipe or op held by a module or called
            in its forward); on Keras, `"keras.Layer"` and `"recipe layer"` too.
        name: what it is: the module's class, the recipe's repr, the op's name.
        settings: how it is set: the rule and what it owns, a hook's place and transform,
            an op module's fixed arguments.
        active: whether it acts on the next backward: False for a hook at parameters none
            of which requires grad, or a recipe or op held by a module that the example
            forward did not call; None when that is unknown (no example forward ran).
    """

    path: str
    kind: str
    name: str
    settings: str
    active: bool | None


class Overrides(Sequence[OverrideRecord]):
    """What `go.overrides(model)` returns: a sequence of `OverrideRecord`s that prints as a
    table."""

    def __init__(self, model: str, records: Sequence[OverrideRecord]) -> None:
        self.model = model
        self._records = list(records)

    @overload
    def __getitem__(self, index: int) -> OverrideRecord: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[OverrideRecord]: ...

    def __getitem__(self, index: int | slice) -> OverrideRecord | Sequence[OverrideRecord]:
        return self._records[index]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[OverrideRecord]:
        return iter(self._records)

    def __str__(self) -> str:
        if not self._records:
            return f"no gradient overrides in {self.model}"
        headers = ("path", "kind", "override", "settings", "active")
        rows = [
            (r.path or "(model)", r.kind, r.name, r.settings,
             "?" if r.active is None else "yes" if r.active else "no")
            for r in self._records
        ]
        n = len(self._records)
        title = f"{n} gradient override{'s' if n != 1 else ''} in {self.model}"
        return f"{title}\n{format_table(headers, rows)}"

    __repr__ = __str__


def overrides(model: Any, *example_args: Any, **example_kwargs: Any) -> Overrides:
    """Every gradient override reachable from `model`, one record each.

    ```python
    from torch import nn
    import gradoverride as go

    model = nn.Sequential(nn.Linear(4, 4), go.recipes.binarize().module())
    go.grad_hook(model[0], go.recipes.clip_grad_value(0.5), at="parameters")
    hook, module = go.overrides(model)
    print(hook.path, hook.kind, hook.name)
    #> 0 grad_hook clip_grad_value(clip_value=0.5)
    print(module.path, module.kind, module.name)
    #> 1 recipe module binarize(clip=1.0, inclusive=True, keep='input')
    ```

    Found without running the model: `go.Module`s, modules with `override_backward` or
    `grad_hook` (one record per hook), recipe and op modules, and recipes or ops held as a
    module's attributes (`self.spike = go.recipes.spike()`). Cheap: one walk of the
    modules, no tensor touched, so it can run every epoch. A removed override or hook is
    not listed.

    With example inputs, `go.overrides(model, x)` also runs `model(x)` once under
    `torch.no_grad()` to find the `custom_backward` / `straight_through` ops and recipes
    called in the forward (a function at module level included), each listed at the module
    whose forward called it. That forward is a real call: a module that keeps state
    (batch-norm statistics, a neuron's membrane) sees it.

    Args:
        model: an `nn.Module`, or a Keras 3 model or layer. On Keras the records are the
            layers' own rules (`gradoverride.keras.Layer`), `override_backward`s,
            `grad_hook`s (one at variables is inactive on a layer without trainable
            variables, unknown before it is built), recipe layers (`Spike`, ...) and
            recipes or ops held as attributes. A layer's path is dotted, each part the
            attribute that holds it in a subclassed layer or model (`block.parts.0`) or its
            layer name in a functional or Sequential model (`head`), so a functional model
            holding a subclassed `block` whose `inner` is a Sequential gives
            `block.inner.dense`. Example inputs are for torch models only.
        *example_args: inputs for one forward call (optional).
        **example_kwargs: keyword inputs for it.

    Returns:
        An `Overrides`: a sequence of `OverrideRecord` (path, kind, name, settings, active)
        that prints as a table, or as `no gradient overrides in <Model>` when empty.
    """
    if not isinstance(model, nn.Module):
        if is_keras_layer(model):
            if example_args or example_kwargs:
                msg = (
                    f"go.overrides got example inputs for the Keras model "
                    f"{type(model).__name__}; finding the ops called in a forward is for "
                    "torch models only. Call `go.overrides(model)` without inputs: it lists "
                    "the overrides of the model's layers."
                )
                raise GradOverrideError(msg)
            from .._backends import backend

            layers: list[OverrideRecord] = backend("tensorflow").keras_overrides(model)
            return Overrides(type(model).__name__, layers)
        msg = (
            f"go.overrides needs a model (an nn.Module or a Keras model); got "
            f"{type(model).__name__} {model!r:.60}. Pass the module whose overrides to list."
        )
        raise GradOverrideTypeError(msg)
    seen = _called_in_forward(model, example_args, example_kwargs) if (
        example_args or example_kwargs) else None
    records: list[OverrideRecord] = []
    listed: set[tuple[str, object]] = set()
    covered: set[str] = set()  # recipe and op modules: their own row shows what they call
    for path, module in model.named_modules():
        records += _module_records(path, module)
        if _is_recipe_or_op_module(module):
            covered.add(path)
            continue
        for attribute, value in _held(module):
            listed.add((path, _identity(value)))
            active = None if seen is None else (path, _identity(value)) in seen
            records.append(_held_record(path, attribute, value, active))
    if seen is not None:
        for (path, key), (value, calls) in seen.items():
            if (path, key) not in listed and path not in covered:
                records.append(OverrideRecord(path, _kind_of(value), _name_of(value),
                                              f"called {calls}x in forward", True))
    return Overrides(type(model).__name__, records)


def _module_records(path: str, module: nn.Module) -> list[OverrideRecord]:
    from .._module import Module
    from .._override import overrides_of

    records = []
    rule = getattr(type(module), "_gradoverride_rule", None)
    if isinstance(module, Module) and rule is not None:
        records.append(OverrideRecord(path, "go.Module", type(module).__name__,
                                      _rule_settings(f"{type(module).__qualname__}.backward",
                                                     rule), True))
    for override in overrides_of(module):
        records.append(OverrideRecord(
            path, "override_backward", type(module).__name__,
            _rule_settings(describe(override.rule), override.module_rule), True,
        ))
    records += _hook_records(path, module)
    recipes = sys.modules.get("gradoverride.recipes._base")
    if recipes is not None and isinstance(module, recipes.RecipeModule):
        records.append(OverrideRecord(path, "recipe module", one_line(repr(module.recipe)), "",
                                      True))
    elif recipes is not None and type(module).__module__.startswith("gradoverride.recipes"):
        recipe = getattr(module, "recipe", None)
        records.append(OverrideRecord(path, "recipe module", type(module).__name__,
                                      "" if recipe is None else one_line(repr(recipe)), True))
    if isinstance(module, CustomBackwardModule):
        fixed = ", ".join(f"{k}={v!r}" for k, v in module.fixed.items())
        records.append(OverrideRecord(path, "op module", _name_of(module.op), fixed, True))
    return records


def _is_recipe_or_op_module(module: nn.Module) -> bool:
    return isinstance(module, CustomBackwardModule) or (
        type(module).__module__.startswith("gradoverride.recipes")
    )


def _rule_settings(rule: str, spec: Any) -> str:
    parts = [f"backward={rule}"]
    if spec.owns is not None:
        parts.append(f"owns={', '.join(spec.owns)}")
    if spec.residuals:
        parts.append(f"residuals={', '.join(spec.residuals)}")
    if spec.once_differentiable:
        parts.append("once_differentiable")
    return "; ".join(parts)


def _hook_records(path: str, module: nn.Module) -> list[OverrideRecord]:
    hooks = sys.modules.get("gradoverride._hooks")
    if hooks is None:
        return []  # no grad_hook was ever made
    from ._recorder import describe_transform

    return [
        OverrideRecord(
            path, "grad_hook", describe_transform(hook.transform), f"at {place}",
            # At parameters none of which requires grad, it acts on nothing.
            place != "parameters" or any(p.requires_grad for p in module.parameters()),
        )
        for place, hook in hooks.grad_hooks_on(module)
    ]


# What every nn.Module holds in its `__dict__` itself (its parameters, hooks, ...).
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _held(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """The recipes, ops and bridges a module holds as attributes (not submodules), or as
    items of a list, tuple or dict attribute, named as its code reads them."""
    for attribute, value in vars(module).items():
        if attribute in _MODULE_INTERNALS:
            continue
        if _is_override(value):
            yield attribute, value
        elif isinstance(value, list | tuple):
            for k, item in enumerate(value):
                if _is_override(item):
                    yield f"{attribute}[{k}]", item
        elif isinstance(value, dict):
            for key, item in value.items():
                if _is_override(item):
                    yield f"{attribute}[{key!r}]", item


def _is_override(value: Any) -> bool:
    if isinstance(value, CustomBackward):
        return True
    recipes = sys.modules.get("gradoverride.recipes._base")
    if recipes is not None and isinstance(value, recipes.Recipe):
        return True
    bridges = sys.modules.get("gradoverride._bridge")
    return bridges is not None and isinstance(value, bridges.Bridge)


def _held_record(path: str, attribute: str, value: Any,
                 active: bool | None) -> OverrideRecord:
    return OverrideRecord(path, _kind_of(value), _name_of(value), f"attribute `{attribute}`",
                          active)


def _kind_of(value: Any) -> str:
    if isinstance(value, CustomBackward):
        return "op"
    return "recipe" if _is_recipe(value) else "bridge"


def _is_recipe(value: Any) -> bool:
    recipes = sys.modules.get("gradoverride.recipes._base")
    return recipes is not None and isinstance(value, recipes.Recipe)


def _name_of(value: Any) -> str:
    if isinstance(value, CustomBackward):
        return str(getattr(value, "__name__", value._name))
    if not _is_recipe(value):
        return f"bridge({value._name})"
    return one_line(repr(value))


def _identity(value: Any) -> object:
    """What tells two ops, recipes or bridges apart: an op by identity, a bridge by its op's
    (what its calls run), a recipe by its settings (one made at each call of a forward is
    one row)."""
    if isinstance(value, CustomBackward):
        return id(value)
    return repr(value) if _is_recipe(value) else id(value.op)


def _called_in_forward(model: nn.Module, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> dict[tuple[str, object], tuple[Any, int]]:
    """The ops and recipes called during one `model(*args, **kwargs)` under no_grad, by
    (module path, id): the value and its number of calls."""
    from ._recorder import Recorder

    seen: dict[tuple[str, object], tuple[Any, int]] = {}

    def called(path: str, subject: Any) -> None:
        key = (path, _identity(subject))
        previous = seen.get(key)
        seen[key] = (subject, 1 if previous is None else previous[1] + 1)

    recorder = Recorder(model, lambda groups: None, on_call=called,
                        purpose=f"go.overrides({type(model).__name__}, example inputs)")
    recorder.start()
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        recorder.stop()
    return seen
