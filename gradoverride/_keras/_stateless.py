"""`gradoverride.keras.Layer` on Keras' JAX and torch backends: the variables' values are
an argument of the op.

On these backends no tape finds the variables a call reads, so the op built from the
subclass's `call` takes the layer's trainable variables' values as a parameter of its own,
a dict by the variable's name relative to the layer, and its forward runs `call` in a
`keras.StatelessScope` that maps each variable to the value passed in. Then:

* JAX: the values are arguments of the `jax.custom_vjp` under `go.custom_backward`, so
  `jax.grad` over `model.stateless_call` (and `model.fit`, which trains that way) gives the
  variables the rule's gradients, and a traced value is never closed over.
* torch: the values are the variables' `torch.nn.Parameter`s, inputs of the op's
  `autograd.Function`, so `loss.backward()` (and `model.fit`) fills their `.grad`.

The rule runs in a scope mapping the variables to the values the forward read (on JAX,
`model.fit` keeps the trained values outside the variables until the epoch ends), reads
them as `self.w` the way `call` did, and its dict is split here: the call's inputs by
parameter name, the variables into the op's variables parameter.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import keras
from keras.src import backend
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope

from .._decorators import custom_backward
from .._errors import GradOverrideError, GradOverrideTypeError

__all__ = ["autocast_scope", "variables_op"]

_KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
# The residual carrying what the forward saw to the rule (a Python value, not an array).
_FACTS = "_gradoverride_layer_facts"


class _Facts(NamedTuple):
    """What one forward saw: the variables it read, and the call's inputs holding tensors."""

    read: tuple[str, ...]
    tensors: tuple[str, ...]


class _Reads(dict):  # type: ignore[type-arg]  # id(variable) -> value
    """A scope's state mapping that records which variables were read (Keras looks a
    variable's value up with `state_mapping.get(id(variable))`)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: set[int] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)


def _variables(layer: Any, *, trainable: bool = False) -> dict[str, Any]:
    """The layer's variables (or its trainable ones) by their path relative to the layer."""
    prefix = f"{layer.path}/"
    named: dict[str, Any] = {}
    for variable in layer.trainable_variables if trainable else layer.variables:
        path = str(variable.path)
        named[path[len(prefix):] if path.startswith(prefix) else path] = variable
    return named


def _current_value(variable: Any) -> Any:
    """The variable's value as the running step has it (a stateless scope's, in
    `stateless_call` and JAX's `fit`), not cast by an autocast scope: the op's argument, a
    gradient for which is one for the variable itself."""
    scope = get_stateless_scope()
    if scope is not None:
        value = scope.get_current_value(variable)
        if value is not None:
            return value
    value = getattr(variable, "_value", None)
    return variable.value if value is None else value


class _Scope:
    """A stateless scope where `values` (name -> value) stand for the layer's variables, on
    top of the mapping of the scope already open (if any); records what was read."""

    def __init__(self, layer: Any, values: dict[str, Any]) -> None:
        outer = get_stateless_scope()
        self.variables = _variables(layer)
        base = dict(outer.state_mapping) if outer is not None else {}
        self.given = {id(self.variables[n]): v for n, v in values.items() if n in self.variables}
        base.update(self.given)
        self.before = dict(base)
        self.scope = StatelessScope(initialize_variables=False)
        self.scope.state_mapping = _Reads(base)
        if outer is not None:
            self.scope.collect_losses = outer.collect_losses
            self.scope.losses = outer.losses  # `add_loss` in the call reaches the outer scope

    def __enter__(self) -> _Scope:
        self.previous = get_stateless_scope()
        global_state.set_global_attribute("stateless_scope", self.scope)
        return self

    def __exit__(self, *exc: object) -> None:
        global_state.set_global_attribute("stateless_scope", self.previous)

    def read(self) -> tuple[str, ...]:
        seen = self.scope.state_mapping.seen
        return tuple(n for n, v in self.variables.items() if id(v) in seen)

    def updates(self) -> Iterator[tuple[int, Any]]:
        """(id(variable), new value) for each variable the call assigned."""
        for key, value in self.scope.state_mapping.items():
            if self.before.get(key, _MISSING) is not value:
                yield key, value


_MISSING = object()


def variables_op(
    cls: type,
    call: Callable[..., Any],
    backward: Callable[..., Any],
    *,
    owns: tuple[str, ...] | None,
    residuals: tuple[str, ...],
    once_differentiable: bool,
    materialize_grads: bool,
) -> Callable[..., Any]:
    """`cls.call` for Keras' JAX or torch backend: `call` as an op taking the layer's
    trainable variables' values, with `backward`'s rule."""
    where = f"`{cls.__qualname__}`"
    on_jax = keras.backend.backend() == "jax"
    call_sig = inspect.signature(call)
    layer_param, *call_params = call_sig.parameters
    values_param = _free_name("variables", call_params, residuals)
    for name in residuals:
        if name in call_params or name == layer_param:
            msg = (
                f"{where} declares a residual `{name}`, which is also a parameter of `call`; "
                "give the residual another name."
            )
            raise GradOverrideTypeError(msg)
    op_name = f"{cls.__qualname__}.call"

    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = op_sig.bind(*args, **kwargs)
        layer = bound.arguments.pop(layer_param)
        values = bound.arguments.pop(values_param)
        tensors = tuple(n for n, v in bound.arguments.items() if _holds_tensor(v))
        call_bound = call_sig.bind_partial()
        call_bound.arguments.update({layer_param: layer, **bound.arguments})
        with _Scope(layer, values) as scope:
            result = call(*call_bound.args, **call_bound.kwargs)
        _apply_updates(op_name, layer, scope, on_jax)
        facts = _Facts(scope.read(), tensors)
        if residuals:
            if type(result) is tuple and len(result) == 2 and isinstance(result[1], dict):
                return result[0], {**result[1], _FACTS: facts}
            return result  # (its residuals are checked, and refused, by the op)
        return result, {_FACTS: facts}

    parameters = [
        # Positional-only, so that a `call` with positional-only parameters can follow.
        inspect.Parameter(layer_param, inspect.Parameter.POSITIONAL_ONLY),
        inspect.Parameter(values_param, inspect.Parameter.POSITIONAL_ONLY),
        *list(call_sig.parameters.values())[1:],
    ]
    op_sig = inspect.Signature(parameters)
    forward.__signature__ = op_sig  # type: ignore[attr-defined]
    forward.__name__ = "call"
    forward.__qualname__ = op_name
    forward.__module__ = cls.__module__
    forward.__doc__ = call.__doc__

    rule_params = list(inspect.signature(backward).parameters.values())[1:]
    if any(p.name == layer_param for p in rule_params):
        msg = (
            f"{where}: `backward` names `{layer_param}`, the layer itself; it is `backward`'s "
            f"own first parameter already. Remove `{layer_param}` from its keyword-only "
            "parameters."
        )
        raise GradOverrideTypeError(msg)
    owned_values = owns is None  # the rule owns every variable the call reads, or none

    def rule(*grads: Any, **named: Any) -> Any:
        layer = named.pop(layer_param)
        values = named.pop(values_param)
        facts: _Facts = named.pop(_FACTS)
        with _Scope(layer, values), autocast_scope(layer):
            result = backward(layer, *grads, **named)
        return _split(op_name, result, facts, values, list(_variables(layer)),
                      set(_variables(layer, trainable=True)), call_params, layer_param,
                      values_param, owned_values)

    positional = [p for p in rule_params if p.kind in _POSITIONAL or p.kind is p.VAR_POSITIONAL]
    keyword = [p for p in rule_params if p.kind is _KEYWORD_ONLY]
    rule.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*positional, inspect.Parameter(layer_param, _KEYWORD_ONLY),
         inspect.Parameter(values_param, _KEYWORD_ONLY),
         inspect.Parameter(_FACTS, _KEYWORD_ONLY), *keyword]
    )
    rule.__name__ = getattr(backward, "__name__", "backward")
    rule.__qualname__ = f"{cls.__qualname__}.backward"

    op = custom_backward(
        forward,
        residuals=(*residuals, _FACTS),
        owns=owns,
        once_differentiable=once_differentiable,
        materialize_grads=materialize_grads,
    )
    op.backward(rule)
    cls._gradoverride_op = op  # type: ignore[attr-defined]

    def call_with_rule(self: Any, *args: Any, **kwargs: Any) -> Any:
        # On JAX every variable: the rule runs after the step's scope is gone, and reads the
        # non-trainable ones (statistics) from the values saved for it. On torch the rule
        # reads them from the variables, and the trainable ones are enough (a call may
        # update a counter in place, which an input of the op must not be).
        variables = _variables(self, trainable=not on_jax)
        values = {name: _current_value(v) for name, v in variables.items()}
        return op(self, values, *args, **kwargs)

    # Keras reads `call`'s signature (for `training=` and `mask=`): keep the subclass's.
    call_with_rule.__wrapped__ = call  # type: ignore[attr-defined]
    call_with_rule.__name__ = "call"
    call_with_rule.__qualname__ = op_name
    call_with_rule.__module__ = cls.__module__
    call_with_rule.__doc__ = call.__doc__
    return call_with_rule


def _free_name(name: str, taken: list[str], residuals: tuple[str, ...]) -> str:
    while name in taken or name in residuals:
        name = f"layer_{name}"
    return name


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return bool(keras.ops.is_tensor(value)) and not isinstance(value, keras.Variable)


def autocast_scope(layer: Any) -> Any:
    """The autocast scope Keras runs `layer`'s call in (mixed precision: variables read in
    the compute dtype, float16 under `mixed_float16`), for a rule that runs later, in
    backward, to read them as the call did; a null context where the dtypes are not mixed."""
    compute, variable = layer.compute_dtype, layer.variable_dtype
    if layer.autocast and compute != variable and backend.is_float_dtype(compute):
        return backend.AutocastScope(compute)
    return contextlib.nullcontext()


def _apply_updates(op: str, layer: Any, scope: _Scope, on_jax: bool) -> None:
    """Assignments the call made (a counter, a running statistic): applied after the call
    on torch; refused on JAX, where they would be made inside `jax.custom_vjp`'s trace."""
    updates = list(scope.updates())
    if not updates:
        return
    by_id = {id(v): v for v in layer.variables}
    names = {id(v): str(v.path) for v in layer.variables}
    if on_jax:
        listing = ", ".join(f"`{names.get(k, '?')}`" for k, _ in updates)
        msg = (
            f"`{op}` assigns {listing} in its call; on Keras' JAX backend a layer whose call "
            "has its own backward cannot update variables there (the call runs inside "
            "`jax.custom_vjp`). Update them in another layer, or use Keras' TensorFlow or "
            "torch backend."
        )
        raise GradOverrideError(msg)
    for key, value in updates:
        variable = by_id.get(key)
        if variable is None:
            msg = (
                f"`{op}` assigns a variable that is not the layer's own; create it with "
                "`self.add_weight` in the layer."
            )
            raise GradOverrideError(msg)
        variable.assign(value)


def _split(
    op: str, result: Any, facts: _Facts, values: dict[str, Any], names: list[str],
    trainable: set[str], call_params: list[str], layer_param: str, values_param: str,
    owned_values: bool,
) -> Any:
    """The rule's result in the op's parameters: the layer's slot (no gradient), the
    variables' dict, then the call's inputs. The rule gives the trainable variables their
    gradients; the others (a frozen layer's, statistics, counters) get none, and a gradient
    the rule returns for one is dropped, as TensorFlow drops a frozen variable's."""
    if not owned_values:  # `owns=`: the variables keep their ordinary gradient
        if type(result) is tuple and len(result) == len(call_params):
            return (None, None, *result)
        return result
    trainable_read = [n for n in facts.read if n in trainable]
    if not isinstance(result, dict):
        if trainable_read:
            listing = ", ".join(f"`{n}`" for n in trainable_read)
            example = ", ".join(
                [f"{n!r}: ..." for n in facts.tensors] + [f"{n!r}: ..." for n in trainable_read]
            )
            msg = (
                f"the forward of `{op}` reads the variables {listing}, so its backward must "
                f"return their gradients too, in a dict by name: {{{example}}}; or declare "
                "what the rule owns (`owns=...` on the class): variables it does not name "
                "then keep their ordinary gradient."
            )
            raise GradOverrideError(msg)
        if type(result) is tuple and len(result) == len(call_params):
            return (None, None, *result)
        if type(result) is not tuple and len(facts.tensors) == 1:
            result = {facts.tensors[0]: result}
        else:
            return result
    inputs = {k: v for k, v in result.items() if k in call_params}
    given = {k: v for k, v in result.items() if k not in call_params}
    keys = _variable_keys(names, call_params)
    grads: dict[str, Any] = {name: None for name in values}
    for name in names:
        key = next((k for k in keys[name] if k in given), None)
        if name not in trainable:
            if key is not None:
                given.pop(key)
            continue
        if key is None:
            if name in facts.read:
                strays = [k for k in given if not any(k in ks for ks in keys.values())]
                instead = (
                    f" (it returned `{strays[0]}`, which names no variable the forward reads)"
                    if strays else ""
                )
                msg = (
                    f"backward of `{op}` returned a dict without `{name}`, a variable its "
                    f"forward reads{instead}; add {{'{name}': gradient}} (or None for no "
                    "gradient), or pass `owns=` so the variable keeps its ordinary gradient."
                )
                raise GradOverrideError(msg)
            continue
        grads[name] = given.pop(key)
    if given:
        unknown = next(iter(given))
        valid = ", ".join(f"`{n}`" for n in (*facts.tensors, *trainable_read))
        msg = (
            f"backward of `{op}` returned a gradient for `{unknown}`, which is neither a "
            f"parameter of `{op}` nor a variable its forward reads; the names it can return "
            f"are {valid}."
        )
        raise GradOverrideError(msg)
    if layer_param in inputs:
        inputs.pop(layer_param)
    return {**inputs, values_param: grads} if grads else inputs


def _variable_keys(names: list[str], parameters: list[str]) -> dict[str, tuple[str, ...]]:
    """Per variable, the dict keys that address it: its name relative to the layer, and
    its last path component (`"kernel"` of `"inner/kernel"`) when no other variable shares
    it and no call parameter has it."""
    short = [n.rsplit("/", 1)[-1] for n in names]
    keys: dict[str, tuple[str, ...]] = {}
    for name, s in zip(names, short, strict=True):
        candidates = [name]
        if short.count(s) == 1 and s not in parameters:
            candidates.append(s)
        keys[name] = tuple(dict.fromkeys(candidates))
    return keys
