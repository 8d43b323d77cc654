"""How a gradoverride op travels through `tf.function`'s argument tracing.

`tf.function` builds a trace type for every argument, and for an object with `__wrapped__`
it builds the type of the wrapped function instead (TensorFlow's
`trace_type_builder.from_value`). Inside the traced function the argument is then the
wrapped, undecorated forward, so `def step(x, f=op)` would run `op`'s forward with its true
gradient and without any error. A decorated op keeps `__wrapped__` (as `functools.wraps`
gives it), and declares this trace type instead: the op itself, compared by identity.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

__all__ = ["OpTraceType"]


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
