"""`go.override_backward` and `go.grad_hook` on an existing Keras 3 layer.

Keras 3 offers no call hooks: `Layer.__call__` runs `self.call` (see Keras'
`ops/operation.py`), so an instance attribute `call` is the one per-instance entry point it
has. The first override or hook on a layer sets one `LayerCall` there; it holds the layer's
attachments (at most one override, innermost, then the hooks in the order made) and runs
them around the call it replaced. Installing and removing only change that list; removing
the last one puts back exactly what was there (the instance's own `call`, or none: the
class's). If code outside gradoverride wrapped the layer's `call` on top of ours, ours stays
under it as a plain pass-through, since taking it out would drop the outer wrapper too.

- The override runs the class's call inside a `custom_backward` op whose first argument is
  the layer; its rule names the call's arguments (`inputs` for `Dense`), `layer` for the
  layer itself, and returns the gradients of the variables the call reads by their names
  relative to the layer (`"kernel"`, `"bias"`). The rule runs under the layer's autocast
  scope, as its call does, so under mixed precision it reads the variables in the dtype the
  call computed with.
- A hook at the inputs or outputs applies an identity with the transform as its gradient; a
  recipe (`reverse_grad()`, `clip_grad_norm(...)`) is applied as it is, since recipes take
  TensorFlow tensors. A hook at the variables runs the call inside `tf.custom_gradient`
  under an inner tape, which gives the variables' true gradients in backward without
  running the call again; the transform is applied to each. Every transform's result is
  checked as a rule's is (`check_gradient`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.common.symbolic_scope import in_symbolic_scope

from .._decorators import CustomBackward, custom_backward
from .._errors import GradOverrideError, GradOverrideTypeError, GradOverrideWarning
from .._frameworks import autograph_artifact
from ..diagnostics._recorder import describe_transform
from ._backend import (
    _control_flow_graph,
    _dense,
    _Meta,
    _variable_name,
    _while_body_graph,
    check_gradient,
)
from ._layer import Layer, _relative_names, autocast_scope, frozen_in, with_layer_slot
from ._tracing import refuse_vectorized_map

_KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_PLACES = ("inputs", "outputs", "variables")
#: The layers a `tf.function` (fit's step, the user's own) traced with something installed:
#: that trace keeps running what was installed then. Whether it is still in use cannot be
#: told: TensorFlow keeps every traced graph holding a custom gradient alive (in its gradient
#: registry), so a function traced once and dropped looks like a live one.
_TRACED: weakref.WeakSet[Any] = weakref.WeakSet()
#: Where a layer's `LayerCall` is kept (the instance's `call` may be someone else's wrapper).
_SLOT = "_gradoverride_layer_call"


# ---- the one wrapper per layer -------------------------------------------------------------


@autograph_artifact
class LayerCall:
    """A layer instance's `call` while gradoverride has something installed on it."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        # What the instance had before (its own `call`), or None: the class's.
        self.previous: Callable[..., Any] | None = layer.__dict__.get("call")
        self.override: _Override | None = None
        self.hooks: list[_Hook] = []
        # Keras reads `call`'s signature; `updated=()`: the replaced call's attributes must
        # not be copied onto this one.
        functools.update_wrapper(self, self.below(), updated=())

    def below(self) -> Callable[..., Any]:
        """The call this one replaced, bound to the layer."""
        if self.previous is not None:
            return self.previous
        return type(self.layer).call.__get__(self.layer)  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not tf.executing_eagerly() and not _keras_scratch():
            refuse_vectorized_map(f"{_layer_name(self.layer)} (with an override or hook)")
            _TRACED.add(self.layer)
        # A snapshot: a hook removed while this call runs does not shift the others.
        return self._through(tuple(self.hooks), args, kwargs)

    def _through(self, hooks: tuple[_Hook, ...], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        if hooks:
            inner = functools.partial(_call_with, self._through, hooks[:-1])
            return hooks[-1].run(self.layer, inner, args, kwargs)
        if self.override is not None:
            return self.override.op(self.layer, *args, **kwargs)
        return self.below()(*args, **kwargs)

    # ---- installing and removing ---------------------------------------------------------

    @classmethod
    def of(cls, layer: Any, *, create: bool) -> LayerCall | None:
        found = layer.__dict__.get(_SLOT)
        if isinstance(found, LayerCall):
            return found
        if not create:
            return None
        made = cls(layer)
        object.__setattr__(layer, _SLOT, made)  # not Keras' __setattr__: nothing to track
        object.__setattr__(layer, "call", made)
        return made

    def attach(self, attachment: _Override | _Hook) -> None:
        self._warn_if_traced(attachment, "installed", stacklevel=5)
        if isinstance(attachment, _Override):
            self.override = attachment
        else:
            self.hooks.append(attachment)

    def detach(self, attachment: _Override | _Hook) -> None:
        if not self.holds(attachment):
            return
        self._warn_if_traced(attachment, "removed", stacklevel=4)
        if isinstance(attachment, _Override):
            self.override = None
        else:
            self.hooks.remove(attachment)
        if self.override is None and not self.hooks:
            self._leave()

    def holds(self, attachment: _Override | _Hook) -> bool:
        return attachment is self.override or any(h is attachment for h in self.hooks)

    def attachments(self) -> list[_Override | _Hook]:
        """Innermost first: the override, then the hooks in the order made."""
        return [*([self.override] if self.override is not None else []), *self.hooks]

    def _leave(self) -> None:
        """Put back what the layer had, unless someone else's wrapper sits on top of this
        one (then this stays, a pass-through, and is reused by a later install)."""
        layer = self.layer
        if layer.__dict__.get("call") is not self:
            return
        if self.previous is None:
            object.__delattr__(layer, "call")
        else:
            object.__setattr__(layer, "call", self.previous)
        object.__delattr__(layer, _SLOT)

    def _warn_if_traced(self, attachment: _Override | _Hook, done: str, stacklevel: int) -> None:
        if self.layer not in _TRACED:
            return
        name = _layer_name(self.layer)
        msg = (
            f"{attachment.description} was {done} after {name} was traced into a "
            "`tf.function` (`model.fit` traces its step on the first call); that traced "
            "function keeps running the layer as it was when traced. Install and remove "
            "overrides and hooks before the first traced call, or make the traced function "
            "again afterwards: `model.compile(...)` again before the next `fit`, or a new "
            "`tf.function` for your own step."
        )
        warnings.warn(msg, GradOverrideWarning, stacklevel=stacklevel)


def _call_with(through: Callable[..., Any], hooks: tuple[Any, ...], *args: Any,
               **kwargs: Any) -> Any:
    return through(hooks, args, kwargs)


def _keras_scratch() -> bool:
    """Whether Keras runs the call only to learn its output's shape (building a functional
    model, `compute_output_spec`): a graph that is thrown away, not a traced function."""
    return bool(in_symbolic_scope() or in_stateless_scope())


def _layer_name(layer: Any) -> str:
    return f"the {type(layer).__name__} `{layer.name}`"


class LayerHandle:
    """Returned by `override_backward` and `grad_hook` for a Keras layer; `.remove()` takes
    the override or the transform away (twice is a no-op). Also a context manager."""

    def __init__(self, layer_call: LayerCall, attachment: _Override | _Hook) -> None:
        self._layer_call = layer_call
        self._attachment = attachment

    @property
    def active(self) -> bool:
        """Whether the override or transform is still installed."""
        return self._layer_call.holds(self._attachment)

    def remove(self) -> None:
        self._layer_call.detach(self._attachment)

    def __enter__(self) -> LayerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<{type(self).__name__} {self._attachment.description} ({state})>"


def attachments_of(layer: Any) -> list[Any]:
    """What gradoverride installed on `layer`, innermost first (for `go.overrides`)."""
    layer_call = LayerCall.of(layer, create=False)
    return [] if layer_call is None else layer_call.attachments()


# ---- override_backward -------------------------------------------------------------------


class _Override:
    def __init__(self, op: CustomBackward[..., Any], description: str) -> None:
        self.op = op
        self.description = description


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
    existing = LayerCall.of(layer, create=False)
    if existing is not None and existing.override is not None:
        msg = (
            f"override_backward: {_layer_name(layer)} already has an override; call "
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

    @autograph_artifact
    def forward(*args: Any, **kwargs: Any) -> Any:
        # The op's first argument is the layer; below the override is the replaced call.
        layer_call = LayerCall.of(args[0], create=False)
        assert layer_call is not None  # the op runs only from the layer's LayerCall
        return layer_call.below()(*args[1:], **kwargs)

    forward.__signature__ = call_signature  # type: ignore[attr-defined]
    forward.__name__ = forward.__qualname__ = f"{name}.call"
    op: CustomBackward[..., Any] = custom_backward(
        forward,
        owns=_owned(where, owns, inputs),
        once_differentiable=once_differentiable,
        materialize_grads=materialize_grads,
    )
    op.backward(_layer_rule(where, rule, layer_param, inputs))
    op._tensorflow_variable_names = lambda named, variable: _relative_names(
        named[layer_param]
    ).get(id(variable))
    op._tensorflow_variable_frozen = frozen_in(forward)
    override = _Override(
        op, f"override_backward({name} `{layer.name}`, {getattr(rule, '__name__', rule)})"
    )
    layer_call = LayerCall.of(layer, create=True)
    assert layer_call is not None
    layer_call.attach(override)
    return LayerHandle(layer_call, override)


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


def _layer_rule(
    where: str, rule: Callable[..., Any], layer_param: str, call_inputs: list[str]
) -> Callable[..., Any]:
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
    n_inputs = len(call_inputs)

    @autograph_artifact
    def wrapped(*grads: Any, **named: Any) -> Any:
        layer = named.pop(layer_param)
        if wants_layer:
            named["layer"] = layer
        with autocast_scope(layer):
            return with_layer_slot(rule(*grads, **named), n_inputs)

    positional = [p for p in params if p.kind in _POSITIONAL or p.kind is p.VAR_POSITIONAL]
    keyword = [p for p in params if p.kind is _KEYWORD_ONLY and p.name != "layer"]
    wrapped.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*positional, inspect.Parameter(layer_param, _KEYWORD_ONLY), *keyword]
    )
    wrapped.__name__ = getattr(rule, "__name__", "rule")
    wrapped.__qualname__ = getattr(rule, "__qualname__", wrapped.__name__)
    return wrapped


# ---- grad_hook ---------------------------------------------------------------------------


class _Hook:
    def __init__(self, layer: Any, at: str, fn: Any) -> None:
        self.at = at
        self.fn = fn  # what the user gave, which `go.overrides` names
        self.layer_name = _layer_name(layer)
        # A recipe known not to be linear in the gradient (a clip): a scale gives the same
        # total however the gradient is split (over replicas, over calls); decided once.
        self.nonlinear = _nonlinear(fn)
        self.warned_replicas = not self.nonlinear
        self.warned_calls = not self.nonlinear or at != "variables"
        # The traced graphs it ran in, with the replicas (of a strategy) it ran for.
        self.graphs: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()
        self.description = f"grad_hook({type(layer).__name__} `{layer.name}`, " \
            f"{describe_transform(fn)}, at={at!r})"

    def run(self, layer: Any, inner: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        if not self.warned_replicas:
            self._warn_per_replica()
        if not self.warned_calls and not tf.executing_eagerly():
            self._warn_per_call()
        if self.at == "inputs":
            names = _argument_names(args, kwargs)
            args, kwargs = tf.nest.map_structure(
                lambda value, name: self._on_tensor(value, name) if _is_float_tensor(value)
                else value,
                (args, kwargs), names,
            )
            return inner(*args, **kwargs)
        if self.at == "outputs":
            output = inner(*args, **kwargs)
            return tf.nest.map_structure(
                lambda value: self._on_tensor(value, "the output") if _is_float_tensor(value)
                else value,
                output,
            )
        return self._variables(layer, inner, args, kwargs)

    def _warn_per_call(self) -> None:
        """At the variables, the transform applies to each call's share of a variable's
        gradient; a layer called twice in a traced step, or in a loop (an RNN cell), has
        several shares, and a clip then bounds each one, not the total."""
        graph = tf.compat.v1.get_default_graph()
        # A strategy traces each replica's step into the same graph: once per replica.
        context = tf.distribute.get_replica_context()
        index = None if context is None else tf.get_static_value(
            context.replica_id_in_sync_group)
        replica = -1 if index is None else int(index)
        seen = self.graphs.setdefault(graph, set())
        again = replica in seen
        seen.add(replica)
        in_loop = False
        while isinstance(graph, _control_flow_graph()):
            in_loop = in_loop or isinstance(graph, _while_body_graph())
            graph = graph.outer_graph
        if not (again or in_loop):
            return
        self.warned_calls = True
        where = "in a loop" if in_loop else "more than once in one traced step"
        msg = (
            f"{self.description} applies {self.fn!r} to the gradient of each call of "
            f"{self.layer_name}, which runs {where}: each call's share is transformed, not "
            "the variables' total gradient, so a clip bounds each share. To clip the total, "
            "give the optimizer `clipnorm=`, `global_clipnorm=` or `clipvalue=`. If "
            "transforming each call's share is what you mean, silence this warning: "
            "`warnings.filterwarnings('ignore', message='.*each call', "
            "category=go.GradOverrideWarning)`."
        )
        warnings.warn(msg, GradOverrideWarning, stacklevel=3)

    def _warn_per_replica(self) -> None:
        """A transform runs in the graph of each replica, on its share of the gradient,
        before the strategy sums them: the same for a linear transform (a scale), not for a
        clip (two shares clipped at c may sum to 2c)."""
        context = tf.distribute.get_replica_context()
        replicas = 1 if context is None else int(context.num_replicas_in_sync)
        fn = self.fn
        if replicas < 2:
            return
        self.warned_replicas = True
        strategy = type(tf.distribute.get_strategy()).__name__
        msg = (
            f"{self.description} runs on each replica's share of the gradient, before "
            f"{strategy} sums the {replicas} shares: {fn!r} bounds each share, so the summed "
            "gradient is not what it would clip on one device. To clip the summed gradient, "
            "give the optimizer `clipvalue=`, `clipnorm=` or `global_clipnorm=` instead. If "
            "clipping each share is what you mean, silence this warning: "
            "`warnings.filterwarnings('ignore', message='.*each replica', "
            "category=go.GradOverrideWarning)`."
        )
        warnings.warn(msg, GradOverrideWarning, stacklevel=2)

    def _on_tensor(self, value: Any, name: str) -> Any:
        from ..recipes import GradientTransform

        if isinstance(self.fn, GradientTransform):
            return self.fn(value)  # recipes take TensorFlow tensors: their own backward
        meta = _Meta(value)

        @tf.custom_gradient  # type: ignore[untyped-decorator]
        @autograph_artifact
        def identity(x: Any) -> Any:
            @autograph_artifact
            def gradient(upstream: Any) -> Any:
                return self.checked(self.fn, _dense(upstream), meta, name)

            return tf.identity(x), gradient

        return identity(value)

    def checked(self, fn: Callable[[Any], Any], grad: Any, meta: Any, name: str) -> Any:
        """`fn(grad)` (`grad` itself where it returns None), checked as a rule's gradient."""
        result = fn(grad)
        if result is None:
            return grad
        op = f"the {self.at} grad_hook of {self.layer_name}"
        try:
            return check_gradient(result, meta, op, name)
        except GradOverrideError as error:
            # The checks speak of a rule ("backward of `op` returned ..."); here it is the
            # hook's transform.
            text = str(error).replace(
                f"backward of `{op}`",
                f"the transform {describe_transform(self.fn)} of the grad_hook at {self.at!r} "
                f"of {self.layer_name}",
                1,
            )
            raise GradOverrideError(text) from None

    def _variables(self, layer: Any, inner: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        flat = tf.nest.flatten((args, kwargs))
        leaves = [v for v in flat if _is_float_tensor(v)]
        gradient_of = self._gradient_function(layer)
        structure: list[Any] = []

        @tf.custom_gradient  # type: ignore[untyped-decorator]
        @autograph_artifact
        def run(*tensors: Any) -> Any:
            with tf.GradientTape(persistent=True) as tape:
                # One copy per argument, made on the inner tape: a tensor passed as two
                # arguments (`mha(h, h)`) gets each argument's share as that argument's
                # gradient, which TensorFlow then sums once, instead of the whole gradient
                # twice.
                copies = [tf.identity(t) for t in tensors]
                tape.watch(copies)
                it = iter(copies)
                values = [next(it) if _is_float_tensor(v) else v for v in flat]
                call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), values)
                output = inner(*call_args, **call_kwargs)
            flat_out = tf.nest.flatten(output)
            picked = [k for k, v in enumerate(flat_out) if _is_float_tensor(v)]
            outputs = [flat_out[k] for k in picked]
            structure.append((output, flat_out, picked))

            @autograph_artifact
            def gradient(*upstream: Any, variables: Any = None) -> Any:
                variables = list(variables or [])
                grads = tape.gradient(
                    outputs, [*copies, *variables], output_gradients=list(upstream)
                )
                n = len(copies)
                var_grads = [
                    None if g is None else gradient_of(g, v)
                    for g, v in zip(grads[n:], variables, strict=True)
                ]
                return (grads[:n], var_grads) if variables else grads[:n]

            return outputs, gradient

        results = run(*leaves)
        output, flat_out, picked = structure[0]
        flat_out = list(flat_out)  # what is no float tensor (None, a number) as it came
        for k, result in zip(picked, tf.nest.flatten(results), strict=True):
            flat_out[k] = result
        return tf.nest.pack_sequence_as(output, flat_out)

    def _gradient_function(self, layer: Any) -> Callable[[Any, Any], Any]:
        """The transform of one variable's gradient. A sparse gradient (an `Embedding`'s
        `IndexedSlices`) is made dense first: a transform is a function of the variable's
        whole gradient (a norm, a clip), which the rows alone do not give where they
        repeat."""
        from ..recipes import GradientTransform

        fn = self.fn
        if isinstance(fn, GradientTransform):
            fn = fn.transform  # the recipe's backward, as a function of the gradient
        # Weakly: TensorFlow keeps a traced gradient function for good (its gradient
        # registry), which would keep the layer and its weights alive with it.
        layer_ref = weakref.ref(layer)

        def on_variable(grad: Any, variable: Any) -> Any:
            owner = layer_ref()
            name = _relative_name(owner, variable) if owner is not None else (
                _variable_name(variable))
            return self.checked(fn, _dense(grad), _Meta(variable), name)

        return on_variable


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
    _refuse_scheduled(layer, fn)
    hook = _Hook(layer, at, fn)
    layer_call = LayerCall.of(layer, create=True)
    assert layer_call is not None
    layer_call.attach(hook)
    return LayerHandle(layer_call, hook)


def _nonlinear(fn: Any) -> bool:
    """Whether `fn` is a recipe known not to be linear in the gradient (a clip)."""
    from ..recipes import GradientTransform
    from ..recipes._flow import _ScaledGradient

    return isinstance(fn, GradientTransform) and not isinstance(fn, _ScaledGradient)


def _refuse_scheduled(layer: Any, fn: Any) -> None:
    """A recipe whose scale follows a schedule counts training steps in torch state (its
    `.module()`); a Keras layer counts them in a variable of its own."""
    from ..recipes._flow import _is_schedule, _ScaledGradient

    if isinstance(fn, _ScaledGradient) and _is_schedule(fn.scale):
        msg = (
            f"grad_hook: {fn!r} on the Keras layer {type(layer).__name__} `{layer.name}` has a "
            "scheduled scale, whose step count a Keras model has nowhere to keep here. Put a "
            "`gradoverride.keras.GradientReversal(scale=ganin_ramp(...))` layer after it "
            "instead (it keeps the count in a variable saved with the model), or hook a "
            "fixed scale."
        )
        raise GradOverrideError(msg)


def _argument_names(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The structure of `(args, kwargs)` with each leaf replaced by the name an error gives
    it: the keyword, or `argument k` for a positional one."""
    positional = tuple(
        tf.nest.map_structure(lambda _, k=k: f"argument {k}", value)
        for k, value in enumerate(args)
    )
    keywords = {key: tf.nest.map_structure(lambda _, key=key: key, value)
                for key, value in kwargs.items()}
    return positional, keywords


def _relative_name(layer: Any, variable: Any) -> str:
    """The variable's name relative to the layer (`"kernel"`), as a rule names it."""
    relative = _relative_names(layer).get(id(variable))
    return relative if relative is not None else _variable_name(variable)


def _is_float_tensor(value: Any) -> bool:
    # A Keras variable first: its dtype is a string, and it is read inside the call.
    if isinstance(value, keras.Variable):
        return False
    return bool(tf.is_tensor(value) and value.dtype.is_floating)
