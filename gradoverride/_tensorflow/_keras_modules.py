"""`go.override_backward` and `go.grad_hook` on an existing Keras 3 layer.

Both install a wrapper as the layer instance's own `call` (Keras' `__call__` runs
`self.call`), which runs the call it replaced: the layer keeps its class, its variables and
their paths. Wrappers stack: a hook may wrap an overridden call and the other way round, and
each handle removes its own wrapper wherever it sits in the stack.

- The override runs the replaced call inside a `custom_backward` op whose first argument is
  the layer; its rule names the call's arguments (`inputs` for `Dense`), `layer` for the
  layer itself, and returns the gradients of the variables the call reads by their names
  relative to the layer (`"kernel"`, `"bias"`).
- A hook at the inputs or outputs applies an identity op whose backward is the transform; a
  recipe (`reverse_grad()`, `clip_grad_norm(...)`) is applied as it is, since recipes take
  TensorFlow tensors. A hook at the variables runs the call inside `tf.custom_gradient`
  under an inner tape, which gives the variables' true gradients in backward without
  running the call again; the transform is applied to each.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import keras
import tensorflow as tf

from .._decorators import CustomBackward, custom_backward
from .._errors import GradOverrideError, GradOverrideTypeError
from .._frameworks import autograph_artifact
from ._layer import Layer, _relative_names

_KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_PLACES = ("inputs", "outputs", "variables")


@autograph_artifact
class _CallWrapper:
    """A layer instance's `call`, running `previous` (the call it replaced)."""

    def __init__(self, layer: Any, kind: str) -> None:
        self.layer = layer
        self.kind = kind
        self.previous: Callable[..., Any] = layer.call
        # Keras reads call's signature; `updated=()`: an inner wrapper's attributes must
        # not be copied onto this one.
        functools.update_wrapper(self, self.previous, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def install(self) -> None:
        """On top of the stack: hooks see what the layer's call (overridden or not) does."""
        object.__setattr__(self.layer, "call", self)

    def install_innermost(self) -> None:
        """At the bottom of the stack, right above the class's own call: an override
        replaces the layer's backward, and hooks stay outside it, whenever they came."""
        stack = _wrappers(self.layer)
        if not stack:
            self.install()
            return
        self.previous = stack[-1].previous
        stack[-1].previous = self

    def uninstall(self) -> bool:
        """Take this wrapper out of the layer's stack of wrappers; False if it is not there."""
        top = self.layer.__dict__.get("call")
        if top is self:
            if isinstance(self.previous, _CallWrapper):
                object.__setattr__(self.layer, "call", self.previous)
            else:
                object.__delattr__(self.layer, "call")  # the class's own call again
            return True
        while isinstance(top, _CallWrapper):
            if top.previous is self:
                top.previous = self.previous
                return True
            top = top.previous
        return False


def _wrappers(layer: Any) -> list[_CallWrapper]:
    found = []
    top = layer.__dict__.get("call")
    while isinstance(top, _CallWrapper):
        found.append(top)
        top = top.previous
    return found


class LayerHandle:
    """Returned by `override_backward` and `grad_hook` for a Keras layer; `.remove()` takes
    the override or the transform away (twice is a no-op). Also a context manager."""

    def __init__(self, wrapper: _CallWrapper, description: str) -> None:
        self._wrapper = wrapper
        self._description = description

    @property
    def active(self) -> bool:
        """Whether the override or transform is still installed."""
        return self._wrapper in _wrappers(self._wrapper.layer)

    def remove(self) -> None:
        self._wrapper.uninstall()

    def __enter__(self) -> LayerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<{type(self).__name__} {self._description} ({state})>"


# ---- override_backward -------------------------------------------------------------------


@autograph_artifact
class _OverriddenCall(_CallWrapper):
    def __init__(self, layer: Any, op: CustomBackward[..., Any]) -> None:
        super().__init__(layer, "override_backward")
        self.op = op

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(self.layer, *args, **kwargs)


def override_layer(
    layer: Any,
    rule: Callable[..., Any],
    *,
    owns: str | Iterable[str] | None,
    once_differentiable: bool,
    materialize_grads: bool,
) -> LayerHandle:
    """`go.override_backward` for a Keras layer (see there)."""
    name = type(layer).__name__
    if isinstance(layer, Layer):
        msg = (
            f"`{name}` is a gradoverride.keras.Layer with its own backward; change that "
            "method instead of overriding it."
        )
        raise GradOverrideError(msg)
    if any(w.kind == "override_backward" for w in _wrappers(layer)):
        msg = (
            f"this {name} already has an override from `go.override_backward`; call "
            "`.remove()` on its handle before overriding again."
        )
        raise GradOverrideError(msg)
    if not callable(rule):
        msg = f"override_backward: `rule` must be a function, got {type(rule).__name__}."
        raise GradOverrideTypeError(msg)
    call_signature = inspect.signature(type(layer).call)
    layer_param = next(iter(call_signature.parameters))
    inputs = list(call_signature.parameters)[1:]
    where = f"the override of {name}"
    wrapper_box: list[_OverriddenCall] = []

    @autograph_artifact
    def forward(*args: Any, **kwargs: Any) -> Any:
        # The op's first argument is the layer; the call it replaced is already bound.
        return wrapper_box[0].previous(*args[1:], **kwargs)

    forward.__signature__ = call_signature  # type: ignore[attr-defined]
    forward.__name__ = forward.__qualname__ = f"{name}.call"
    op: CustomBackward[..., Any] = custom_backward(
        forward,
        owns=_owned(where, owns, inputs),
        once_differentiable=once_differentiable,
        materialize_grads=materialize_grads,
    )
    op.backward(_layer_rule(where, rule, layer_param))
    op._tensorflow_variable_names = lambda named, variable: _relative_names(
        named[layer_param]
    ).get(id(variable))
    wrapper = _OverriddenCall(layer, op)
    wrapper_box.append(wrapper)
    wrapper.install_innermost()
    return LayerHandle(wrapper, f"override_backward({name}, {getattr(rule, '__name__', rule)})")


def _owned(where: str, owns: Any, inputs: list[str]) -> Any:
    if owns is None:
        return None
    names = (owns,) if isinstance(owns, str) else tuple(owns)
    unknown = [n for n in names if n not in inputs]
    if unknown:
        msg = (
            f"{where}: `owns=` names {', '.join(f'`{n}`' for n in unknown)}, which the layer's "
            f"`call` does not take; `owns=` names call inputs ({', '.join(inputs)}). The "
            "layer's variables are owned together: leave `owns=` out for the rule to give "
            "every variable's gradient, or give it to leave them their TensorFlow gradient."
        )
        raise GradOverrideTypeError(msg)
    return names


def _layer_rule(where: str, rule: Callable[..., Any], layer_param: str) -> Callable[..., Any]:
    """The user's rule with `layer` (the reserved name) fed from the op's first argument,
    which the rule always receives so the variables can be named relative to the layer."""
    params = list(inspect.signature(rule).parameters.values())
    if any(p.name == layer_param and layer_param != "layer" for p in params):
        msg = (
            f"{where}: the rule names `{layer_param}`; name the layer `layer` (a reserved "
            "name) instead."
        )
        raise GradOverrideTypeError(msg)
    wants_layer = any(p.name == "layer" and p.kind is _KEYWORD_ONLY for p in params)

    @autograph_artifact
    def wrapped(*grads: Any, **named: Any) -> Any:
        layer = named.pop(layer_param)
        if wants_layer:
            named["layer"] = layer
        return rule(*grads, **named)

    positional = [p for p in params if p.kind in _POSITIONAL or p.kind is p.VAR_POSITIONAL]
    keyword = [p for p in params if p.kind is _KEYWORD_ONLY and p.name != "layer"]
    wrapped.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*positional, inspect.Parameter(layer_param, _KEYWORD_ONLY), *keyword]
    )
    wrapped.__name__ = getattr(rule, "__name__", "rule")
    wrapped.__qualname__ = getattr(rule, "__qualname__", wrapped.__name__)
    return wrapped


# ---- grad_hook ---------------------------------------------------------------------------


@autograph_artifact
class _HookedCall(_CallWrapper):
    def __init__(self, layer: Any, at: str, transform: Callable[[Any], Any], fn: Any) -> None:
        super().__init__(layer, f"grad_hook {at}")
        self.at = at
        self.transform = transform
        self.fn = fn  # what the user gave, which `go.overrides` names (`transform` wraps it)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.at == "inputs":
            args, kwargs = tf.nest.map_structure(_if_float(self.transform), (args, kwargs))
            return self.previous(*args, **kwargs)
        if self.at == "outputs":
            return tf.nest.map_structure(_if_float(self.transform), self.previous(*args, **kwargs))
        return self._variables(args, kwargs)

    def _variables(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves = [v for v in tf.nest.flatten((args, kwargs)) if _is_float_tensor(v)]
        transform = self.transform
        previous = self.previous
        structure: list[Any] = []

        @tf.custom_gradient  # type: ignore[untyped-decorator]
        @autograph_artifact
        def run(*tensors: Any) -> Any:
            it = iter(tensors)
            flat = [next(it) if _is_float_tensor(v) else v for v in tf.nest.flatten((args, kwargs))]
            call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), flat)
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(tensors)
                output = previous(*call_args, **call_kwargs)
            outputs = tf.nest.flatten(output)
            structure.append(output)

            @autograph_artifact
            def gradient(*upstream: Any, variables: Any = None) -> Any:
                variables = list(variables or [])
                grads = tape.gradient(
                    outputs, [*tensors, *variables], output_gradients=list(upstream)
                )
                n = len(tensors)
                var_grads = [None if g is None else _keep(transform, g) for g in grads[n:]]
                return (grads[:n], var_grads) if variables else grads[:n]

            return outputs, gradient

        outputs = run(*leaves)
        return tf.nest.pack_sequence_as(structure[0], outputs)


def hook_layer(layer: Any, fn: Any, at: str) -> LayerHandle:
    """`go.grad_hook` for a Keras layer (see there)."""
    name = type(layer).__name__
    if at not in _PLACES:
        hint = " (on a Keras layer, the parameters are its variables)" if at == "parameters" else ""
        msg = (
            f"grad_hook got at={at!r} for the Keras layer {name}{hint}; expected one of "
            f"{', '.join(repr(p) for p in _PLACES)}."
        )
        raise GradOverrideError(msg)
    if not callable(fn):
        msg = f"grad_hook: `fn` must be a function of the gradient, got {type(fn).__name__}."
        raise GradOverrideTypeError(msg)
    transform = _transform_of(fn) if at != "variables" else _gradient_function_of(fn)
    wrapper = _HookedCall(layer, at, transform, fn)
    wrapper.install()
    return LayerHandle(wrapper, f"grad_hook({name}, {fn!r}, at={at!r})")


def _transform_of(fn: Any) -> Callable[[Any], Any]:
    """A function of a tensor that is the identity forward and `fn` on the gradient."""
    from ..recipes import GradientTransform

    if isinstance(fn, GradientTransform):
        return fn  # recipes take TensorFlow tensors: identity forward, their backward

    @custom_backward
    def transformed(x: Any) -> Any:
        return tf.identity(x)

    @transformed.backward
    def _(grad: Any) -> Any:
        return _keep(fn, grad)

    return transformed


def _gradient_function_of(fn: Any) -> Callable[[Any], Any]:
    """`fn` applied to a gradient tensor: a recipe's own transform of its gradient."""
    from ..recipes import GradientTransform

    if isinstance(fn, GradientTransform):
        recipe = fn

        def on_gradient(grad: Any) -> Any:
            # The recipe's backward, taken on an identity forward of the gradient.
            with tf.GradientTape() as tape:
                tape.watch(grad)
                y = recipe(grad)
            return tape.gradient(y, grad, output_gradients=grad)

        return on_gradient
    return fn  # type: ignore[no-any-return]


def _keep(fn: Callable[[Any], Any], grad: Any) -> Any:
    """`fn(grad)`, or `grad` when `fn` returns None (the gradient is kept)."""
    result = fn(grad)
    return grad if result is None else result


def _is_float_tensor(value: Any) -> bool:
    return bool(tf.is_tensor(value) and value.dtype.is_floating and not isinstance(
        value, keras.Variable
    ))


def _if_float(transform: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def apply(value: Any) -> Any:
        return transform(value) if _is_float_tensor(value) else value

    return apply
