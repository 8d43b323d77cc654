"""How a gradoverride op travels through TensorFlow's tracing: `tf.function`'s argument
tracing (`OpTraceType`) and the loop body of `tf.vectorized_map` (`in_vectorized_map`).

`tf.function` builds a trace type for every argument, and for an object with `__wrapped__`
it builds the type of the wrapped function instead (TensorFlow's
`trace_type_builder.from_value`). Inside the traced function the argument is then the
wrapped, undecorated forward, so `def step(x, f=op)` would run `op`'s forward with its true
gradient and without any error. A decorated op keeps `__wrapped__` (as `functools.wraps`
gives it), and declares this trace type instead: the op itself, compared by identity.

`tf.vectorized_map` (any `pfor`: also `jacobian` and `batch_jacobian`, around their
backward pass) traces its function once on one example, in a name scope `loop_body`
(`loop_body_1`, ... for later loops in the same graph) whose first op is the loop index, a
`PlaceholderWithDefault`; it then rewrites every op of that body into a batched op of the
same type. The rewrite keeps op types but not the attribute by which `tf.custom_gradient`
names its gradient function, so a custom gradient is silently replaced by the gradient of
the ops under it. `in_vectorized_map` reads those two marks of TensorFlow's loop body from
the graph being built.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .._errors import GradOverrideError

__all__ = ["OpTraceType", "in_vectorized_map", "refuse_vectorized_map"]

#: A name scope component of a `pfor` loop body (TensorFlow's `_pfor_impl`).
_LOOP_BODY = re.compile(r"loop_body(_\d+)?")


def in_vectorized_map() -> bool:
    """Whether ops being built now are in the loop body of `tf.vectorized_map` (or another
    `pfor`), which TensorFlow will vectorize, dropping custom gradients (module docstring)."""
    if tf.executing_eagerly():
        return False  # pfor always traces its loop body into a graph
    graph = tf.compat.v1.get_default_graph()
    parts = graph.get_name_scope().split("/")
    for end in range(len(parts), 0, -1):
        if not _LOOP_BODY.fullmatch(parts[end - 1]):
            continue
        try:
            index = graph.get_operation_by_name("/".join(parts[:end]) + "/PlaceholderWithDefault")
        except KeyError:
            continue
        if index.type == "PlaceholderWithDefault":
            return True
    return False


def refuse_vectorized_map(what: str) -> None:
    """Raise when `what` (an op, a recipe, in backticks) is called inside `tf.vectorized_map`,
    which would silently drop its gradient override."""
    if in_vectorized_map():
        msg = (
            f"{what} is called inside `tf.vectorized_map`, which rewrites each op of its "
            "function into a batched op and drops custom gradients on the way: the override "
            f"would be replaced by the derivative of the forward's own ops, without an error. "
            f"Call {what} on the whole batch instead (it takes batched tensors), or use "
            "`tf.map_fn` in place of `tf.vectorized_map`, which keeps the override."
        )
        raise GradOverrideError(msg)


class OpTraceType(tf.types.experimental.TraceType):  # type: ignore[misc]
    """The trace type of one op: equal only to itself, its placeholder is the op."""

    def __init__(self, op: object) -> None:
        # A weak reference, as TensorFlow keeps for other Python objects: a cached trace
        # does not keep an op alive.
        self._ref = weakref.ref(op)

    def is_subtype_of(self, other: Any) -> bool:
        return bool(self == other)

    def most_specific_common_supertype(self, others: Sequence[Any]) -> Any:
        return self if all(self == other for other in others) else None

    def placeholder_value(self, placeholder_context: Any = None) -> Any:
        return self._ref()

    def cast(self, value: Any, cast_context: Any) -> Any:
        return value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpTraceType) and self._ref() is other._ref()

    def __hash__(self) -> int:
        return id(self._ref())

    def __repr__(self) -> str:
        return f"OpTraceType({self._ref()!r})"
