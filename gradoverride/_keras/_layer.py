"""`gradoverride.keras.Layer`: a Keras 3 layer whose subclass defines `backward` next to
`call`, the layer's trainable variables included.

The subclass's `call` becomes a `custom_backward` op whose first parameter is the layer
itself (a non-tensor argument, kept on the rule's side as any other), and whose rule calls
the subclass's `backward`. The rule writes the variables' gradients by the name Keras gives
them relative to the layer (`"kernel"`, `"inner/kernel"` for a sublayer's).

How the variables reach their gradients depends on Keras' backend. On TensorFlow, the
backend hands the rule's gradients for the variables the call read to TensorFlow by each
variable's path, translated here, where the layer is known. On JAX and torch the op takes
the variables' values as an argument of their own (see `_stateless.py`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import keras

from .._decorators import CustomBackward, custom_backward
from .._errors import GradOverrideTypeError
from .._frameworks import autograph_artifact
from .._module import require_backward
from ._stateless import autocast_scope, variables_op

_KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Layer(keras.layers.Layer):  # type: ignore[misc]  # Keras is untyped (Any)
    """A Keras 3 layer whose subclass defines `backward` next to `call`.

    ```python
    import tensorflow as tf
    import gradoverride.keras

    class LayerWithCustomGrad(gradoverride.keras.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="weights")

        def call(self, x):
            return x * self.w

        def backward(self, grad, *, x):  # names what it needs: here the input x
            return {"x": grad * self.w, "weights": grad * x}  # variables by name

    layer = LayerWithCustomGrad()
    x = tf.constant([[1.0, 2.0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(layer(x))
    print(tape.gradient(loss, layer.w).numpy().tolist())
    #> [1.0, 2.0]
    ```

    `backward(self, *upstream_grads, *, names...)` follows the `custom_backward` contract: one
    positional parameter per output of `call`, keyword-only parameters naming the call's
    arguments (and `output`, `needs_grad`, declared residuals) it needs. It returns the
    gradients of the call's tensor inputs and of the layer's trainable variables that the
    call reads, by name: the call's parameter names, and each variable's name relative to the
    layer (its `path` without the layer's own path: `"kernel"`, or `"inner/kernel"` for a
    sublayer's). `None` means no gradient. A variable the call reads that the rule leaves out
    is an error naming it. Gradient shapes and dtypes are checked as for `custom_backward`.

    Class keywords: `owns="x"` makes the rule own only those call inputs; the layer's
    variables then keep their ordinary TensorFlow gradient (the rule owns either every
    variable the call reads, by default, or none). `once_differentiable`,
    `materialize_grads` and `residuals` are those of `custom_backward`. A subclass without a
    `backward` (or with a misspelled one) is an error when the class is created; a base class
    meant only to be subclassed says `class Base(gradoverride.keras.Layer, abstract=True)`.

    It runs eagerly, inside `tf.function`, under XLA (`jit_compile=True`) and in
    `model.fit`. The same subclass works on Keras' JAX backend (`model.fit`, and `jax.grad`
    over `model.stateless_call`: the variables' values are arguments of the op's
    `jax.custom_vjp`) and torch backend (`model.fit`, `loss.backward()`: the variables'
    parameters are inputs of its `autograd.Function`); there, `backward` reads `self.w` as
    `call` read it, and a call that assigns a variable is refused on JAX.

    Saving is Keras' as for any layer: give the subclass a `get_config` when its
    `__init__` takes arguments, and register it (`keras.saving.register_keras_serializable`)
    to load a saved model.
    """

    _gradoverride_op: Any = None
    _gradoverride_call: Callable[..., Any] | None = None

    def __init_subclass__(
        cls,
        *,
        owns: str | Iterable[str] | None = None,
        once_differentiable: bool = False,
        materialize_grads: bool = True,
        residuals: str | Iterable[str] | None = None,
        abstract: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        where = f"`{cls.__qualname__}`"
        backward = require_backward(
            cls, abstract, base="gradoverride.keras.Layer", plain="keras.layers.Layer"
        )
        if backward is None or ("call" not in cls.__dict__ and "backward" not in cls.__dict__):
            return  # abstract, or inherits its parent's op unchanged
        call: Callable[..., Any] | None = (
            cls.__dict__.get("call") or getattr(cls, "_gradoverride_call", None)
            or _inherited_call(cls)
        )
        if call is None:
            msg = (
                f"{where} defines `backward` but no `call`; define `call` too, or inherit "
                "one from a Keras layer (`class QDense(gradoverride.keras.Layer, "
                "keras.layers.Dense)`)."
            )
            raise GradOverrideTypeError(msg)
        if keras.backend.backend() != "tensorflow":
            owned = _owned_inputs(where, call, owns)
            cls.call = variables_op(
                cls, call, backward, owns=owned, residuals=tuple(_names(residuals)),
                once_differentiable=once_differentiable, materialize_grads=materialize_grads,
            )
            cls._gradoverride_call = call
            return
        op: CustomBackward[..., Any] = custom_backward(
            call,
            residuals=residuals or (),
            owns=_owned_inputs(where, call, owns),
            once_differentiable=once_differentiable,
            materialize_grads=materialize_grads,
        )
        rule, variable_name = _rule_calling(where, call, backward)
        op.backward(rule)
        op._tensorflow_variable_names = variable_name
        op._tensorflow_variable_frozen = frozen_in(call)
        cls._gradoverride_op = op
        cls._gradoverride_call = call

        @autograph_artifact
        def call_with_rule(self: Layer, *args: Any, **kwargs: Any) -> Any:
            return op(self, *args, **kwargs)

        # Keras reads `call`'s signature (for `training=` and `mask=`): keep the subclass's.
        functools.update_wrapper(call_with_rule, call)
        call_with_rule.__qualname__ = f"{cls.__qualname__}.call"
        cls.call = call_with_rule


def _names(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _inherited_call(cls: type) -> Callable[..., Any] | None:
    """The `call` a subclass inherits from a Keras layer class it also derives from
    (`Dense.call` for `class QDense(gradoverride.keras.Layer, keras.layers.Dense)`); None
    when it only has Keras' abstract `Layer.call`."""
    for base in cls.__mro__[1:]:
        call = base.__dict__.get("call")
        if call is not None:
            return None if base is keras.layers.Layer else call
    return None


def with_layer_slot(result: Any, n_inputs: int) -> Any:
    """A rule's tuple of gradients, one per call input, with the layer's slot (the op's
    first parameter, which takes no gradient) put in front: the user counts the call's
    inputs, not the layer."""
    if type(result) is tuple and len(result) == n_inputs:
        return (None, *result)
    return result


def _owned_inputs(where: str, call: Callable[..., Any], owns: Any) -> Any:
    """`owns=` for the op: the layer (`self`) is never owned; naming a variable is refused,
    since the rule owns every variable the call reads or none."""
    if owns is None:
        return None
    names = (owns,) if isinstance(owns, str) else tuple(owns)
    params = list(inspect.signature(call).parameters)[1:]
    unknown = [n for n in names if n not in params]
    if unknown:
        msg = (
            f"{where}: `owns=` names {', '.join(f'`{n}`' for n in unknown)}, which `call` does "
            f"not take; `owns=` names call inputs ({', '.join(params)}). The layer's variables "
            "are owned together: leave `owns=` out for the rule to give every variable's "
            "gradient, or give it to leave them their ordinary TensorFlow gradient."
        )
        raise GradOverrideTypeError(msg)
    return names


def _rule_calling(
    where: str, call: Callable[..., Any], backward: Callable[..., Any]
) -> tuple[Callable[..., Any], Callable[[dict[str, Any], Any], str | None]]:
    """The op's rule, the subclass's `backward` bound to the layer (the op's first
    argument), and how the op names the variables the call reads: relative to the layer."""
    layer_param = next(iter(inspect.signature(call).parameters))
    params = list(inspect.signature(backward).parameters.values())[1:]
    if any(p.name == layer_param for p in params):
        msg = (
            f"{where}: `backward` names `{layer_param}`, the layer itself; it is `backward`'s "
            f"own first parameter already. Remove `{layer_param}` from its keyword-only "
            "parameters."
        )
        raise GradOverrideTypeError(msg)

    n_inputs = len(inspect.signature(call).parameters) - 1

    @autograph_artifact
    def rule(*grads: Any, **named: Any) -> Any:
        layer = named.pop(layer_param)
        with autocast_scope(layer):
            return with_layer_slot(backward(layer, *grads, **named), n_inputs)

    positional = [p for p in params if p.kind in _POSITIONAL or p.kind is p.VAR_POSITIONAL]
    keyword = [p for p in params if p.kind is _KEYWORD_ONLY]
    rule.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*positional, inspect.Parameter(layer_param, _KEYWORD_ONLY), *keyword]
    )
    rule.__name__ = getattr(backward, "__name__", "backward")
    rule.__qualname__ = f"{where.strip('`')}.backward"

    def variable_name(named: dict[str, Any], variable: Any) -> str | None:
        return _relative_names(named[layer_param]).get(id(variable))

    return rule, variable_name


def frozen_in(call: Callable[..., Any]) -> Callable[[dict[str, Any], Any], bool]:
    """For an op whose first parameter is a Keras layer: whether a variable its forward reads
    is not among the layer's trainable variables (a frozen layer, `trainable=False`), whose
    gradient a rule built from `self.trainable_variables` leaves out."""
    layer_param = next(iter(inspect.signature(call).parameters))

    def frozen(named: dict[str, Any], variable: Any) -> bool:
        layer = named[layer_param]
        trainable = {id(v) for v in layer.trainable_variables}
        trainable |= {id(getattr(v, "_value", None)) for v in layer.trainable_variables}
        return id(variable) not in trainable and any(
            variable is v or variable is getattr(v, "_value", None) for v in layer.variables
        )

    return frozen


def _relative_names(layer: Any) -> dict[int, str]:
    """The layer's variables by identity (the Keras variable and the TensorFlow variable
    under it, which is what TensorFlow hands the gradient function), named by their path
    relative to the layer: `"kernel"`, `"inner/kernel"`."""
    prefix = f"{layer.path}/"
    names: dict[int, str] = {}
    for variable in layer.variables:
        path = str(variable.path)
        relative = path[len(prefix):] if path.startswith(prefix) else path
        names[id(variable)] = relative
        tf_variable = getattr(variable, "_value", None)
        if tf_variable is not None:
            names[id(tf_variable)] = relative
    return names
