"""Which framework a value belongs to, without importing any framework.

`import gradoverride` never imports TensorFlow or JAX: a TensorFlow tensor or a JAX array
can only exist once the user has imported its framework, so `sys.modules` is asked first
and nothing is imported here. A framework's backend (`gradoverride._tensorflow`,
`gradoverride._jax`) is imported the first time one of its values reaches a gradoverride
function.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch.compiler import is_dynamo_compiling

__all__ = [
    "any_jax", "any_tensorflow", "autograph_artifact", "is_jax", "is_keras_layer", "is_tensorflow",
]

F = TypeVar("F", bound=Callable[..., Any])


def autograph_artifact(fn: F) -> F:
    """Mark `fn` as AutoGraph's own, so that a `tf.function` calling it (to make an op inside
    the traced function, say) runs it as plain Python instead of converting it, which fails
    on gradoverride's code and logs a warning asking users to report it to TensorFlow. On a
    class, every method is marked (AutoGraph looks at the bound method's function)."""
    mark = frozenset(("autograph_artifact",))
    if isinstance(fn, type):
        for value in vars(fn).values():
            if isinstance(value, (classmethod, staticmethod)):
                value = value.__func__
            if callable(value) and not isinstance(value, type):
                value.autograph_info__ = mark
    fn.autograph_info__ = mark  # type: ignore[attr-defined]
    return fn


def is_keras_layer(value: object) -> bool:
    """Whether `value` is a Keras 3 layer (a model included); imports nothing."""
    keras: Any = sys.modules.get("keras")
    return keras is not None and isinstance(value, keras.layers.Layer)


def require_tensorflow_keras(layer: Any, api: str) -> None:
    """Refuse a Keras layer on a backend other than TensorFlow (with `KERAS_BACKEND=torch`
    a Keras layer is also an `nn.Module`, whose torch-side handling would name Keras'
    internals instead of the layer's variables)."""
    from ._errors import GradOverrideError

    keras: Any = sys.modules["keras"]
    name = keras.backend.backend()
    if name != "tensorflow":
        msg = (
            f"{api}: the Keras layer {type(layer).__name__} `{layer.name}` runs on Keras' "
            f"{name!r} backend; gradoverride supports Keras layers on the TensorFlow backend "
            "only for installing a rule or a hook on an existing layer. Set "
            "KERAS_BACKEND=tensorflow before Keras is imported, or, staying on "
            f"{name!r}, write the layer as a `gradoverride.keras.Layer` subclass with its own "
            "`backward` (or the gradient with `go.custom_backward` on the layer's tensors)."
        )
        raise GradOverrideError(msg)


def is_tensorflow(value: object) -> bool:
    """Whether `value` is a TensorFlow tensor, variable (Keras 3 variables included) or
    composite tensor (`IndexedSlices`, ...)."""
    tf: Any = sys.modules.get("tensorflow")
    if tf is None or not type(value).__module__.startswith(("tensorflow", "keras", "tf_keras")):
        return False
    return bool(tf.is_tensor(value))


def any_tensorflow(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> bool:
    """Whether any argument (tuples, lists and dicts are searched) is TensorFlow's.

    Free when TensorFlow was never imported: one lookup in `sys.modules`. False while
    dynamo traces (a TensorFlow tensor cannot reach a compiled torch function).
    """
    # Dynamo traces torch code only (and cannot trace the type checks below): first.
    if is_dynamo_compiling() or "tensorflow" not in sys.modules:
        return False
    return _search(args) or (kwargs is not None and _search(kwargs.values()))


def is_jax(value: object) -> bool:
    """Whether `value` is a JAX array (a tracer of `jax.jit`, `jax.grad`, `jax.vmap`
    included)."""
    jax: Any = sys.modules.get("jax")
    # The module name first: a torch tensor is told apart without JAX's isinstance check.
    if jax is None or not type(value).__module__.startswith(("jax", "jaxlib")):
        return False
    return isinstance(value, jax.Array)


def any_jax(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> bool:
    """Whether any argument (tuples, lists and dicts are searched) is a JAX array.

    Free when JAX was never imported: one lookup in `sys.modules`. False while dynamo
    traces (a JAX array cannot reach a compiled torch function).
    """
    if is_dynamo_compiling() or "jax" not in sys.modules:
        return False
    return _search(args, is_jax) or (kwargs is not None and _search(kwargs.values(), is_jax))


def _search(values: Any, found: Callable[[object], bool] = is_tensorflow) -> bool:
    for value in values:
        if isinstance(value, (tuple, list)):
            if _search(value, found):
                return True
        elif isinstance(value, dict):
            if _search(value.values(), found):
                return True
        elif found(value):
            return True
    return False
