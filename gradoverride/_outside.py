"""Calls outside PyTorch as one opaque operator, `gradoverride::outside`.

A bridge's function and backward, and a black-box solver, run numpy (or any Python) code,
which neither `torch.compile` nor `torch.export` can trace and which `torch.func`'s wrapped
tensors cannot feed. Each such call goes through this one custom operator
(`torch.library.custom_op`):

* its real kernel hands the owner (a bridge, a solver recipe) real tensors and returns what
  the owner computed;
* its fake kernel asks the owner what would come out (shapes and dtypes) without running
  the code, which is all the compiler and the exporter need: the call is one node of their
  graph, with no graph break;
* its vmap rule runs the real kernel once per batch entry and stacks the results, so
  `torch.func.vmap`, and `jacrev` (a vmap over the backward), work without a rule of the
  user's.

The operator takes the tensors and one string, which names the owner (by a key registered
here: its function's name, with a count when several owners share it), its role (forward,
backward, ...), and the structure of the arguments with every non-tensor value written out
as a Python literal. So a compiled graph or an exported program holds nothing but tensors
and a string, and an owner made again at import (in a fresh process, in the same order)
gets the same key. A value that is no literal (a numpy array, an arbitrary object) cannot be
written so: `flatten` raises `NotLiteral`, and the owner calls its code directly instead
(eager mode only; see the bridge).
"""

from __future__ import annotations

import ast
import functools
import math
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["NotLiteral", "Owner", "call", "flatten", "owner", "rebuild", "register"]

_LITERALS = (bool, int, str, type(None))


class NotLiteral(Exception):
    """A value in a call is neither a tensor nor a Python literal; `path` says where."""

    def __init__(self, path: str, value: object) -> None:
        super().__init__(path)
        self.path = path
        self.value = value


class Owner(Protocol):
    """What the operator calls: the real computation, and the shapes of its result."""

    def outside_run(self, role: str, value: Any) -> Any: ...

    def outside_fake(self, role: str, value: Any) -> Any: ...

    def outside_describe(self, role: str) -> str:
        """Who ran, for messages: "the go.bridge of `f`"."""
        ...

    def outside_promise(self, role: str) -> str:
        """What described the result to the compiler, for messages: "its `outputs=`"."""
        ...


# Owners by key, held weakly: an owner lives as long as its user keeps it (a bridge made per
# step does not pile up here); the count keeps the keys of later owners distinct.
_OWNERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_COUNTS: dict[str, int] = {}


def register(owner: Owner, name: str) -> str:
    """A key for `owner`, unique in this process and the same in every process that makes
    its owners in the same order."""
    base = name.replace("|", "/")
    count = _COUNTS.get(base, 0) + 1
    _COUNTS[base] = count
    key = base if count == 1 else f"{base}#{count}"
    _OWNERS[key] = owner
    global _OPERATOR
    if _OPERATOR is None:
        _OPERATOR = _define_operator()
    return key


# ---- the structure of a call, as tensors and a literal ------------------------------------------


def flatten(value: Any, tensors: list[Tensor], tokens: list[Any], path: str = "") -> None:
    """Append `value`'s tensors to `tensors` and its structure to `tokens`: "T" per tensor,
    ("tuple"|"list", n) or ("dict", keys) per container, ("C", v) per literal. Plain Python,
    so that dynamo traces it into constants."""
    if isinstance(value, Tensor):
        tensors.append(value)
        tokens.append("T")
    elif type(value) is tuple or type(value) is list:
        tokens.append((type(value).__name__, len(value)))
        for i, item in enumerate(value):
            flatten(item, tensors, tokens, f"{path}[{i}]")
    elif type(value) is dict:
        keys = tuple(value)
        if not all(isinstance(k, _LITERALS) for k in keys):
            raise NotLiteral(path, value)
        tokens.append(("dict", keys))
        for k in keys:
            flatten(value[k], tensors, tokens, f"{path}[{k!r}]")
    elif isinstance(value, _LITERALS):
        tokens.append(("C", value))
    elif type(value) is float:
        # repr of a finite float reads back exactly; inf and nan are written by name.
        tokens.append(("C", value) if math.isfinite(value) else ("F", repr(value)))
    else:
        raise NotLiteral(path, value)


def rebuild(tokens: Sequence[Any], tensors: Sequence[Any]) -> Any:
    """The value `flatten` took apart, with `tensors` in the tensors' places."""
    value, _, _ = _rebuild(tokens, 0, tensors, 0)
    return value


def _rebuild(tokens: Sequence[Any], at: int, tensors: Sequence[Any], used: int
             ) -> tuple[Any, int, int]:
    token = tokens[at]
    at += 1
    if token == "T":
        return tensors[used], at, used + 1
    kind, payload = token
    if kind == "C":
        return payload, at, used
    if kind == "F":
        return float(payload), at, used
    if kind == "dict":
        out: dict[Any, Any] = {}
        for key in payload:
            out[key], at, used = _rebuild(tokens, at, tensors, used)
        return out, at, used
    items = []
    for _ in range(payload):
        item, at, used = _rebuild(tokens, at, tensors, used)
        items.append(item)
    return (tuple(items) if kind == "tuple" else items), at, used


@functools.lru_cache(maxsize=4096)
def _parse(call_string: str) -> tuple[str, str, tuple[Any, ...]]:
    key, role, tokens = call_string.split("|", 2)
    return key, role, tuple(ast.literal_eval(tokens))


def _resolve(call_string: str) -> tuple[Owner, str, tuple[Any, ...]]:
    key, role, tokens = _parse(call_string)
    return owner(key), role, tokens


def owner(key: str) -> Any:
    """The owner registered as `key`, or the error saying to make it."""
    found = _OWNERS.get(key)
    if found is None:
        from ._errors import GradOverrideError

        msg = (
            f"a graph calls gradoverride's outside operator for `{key}`, which this process "
            "has not made: a graph that calls a go.bridge or a solver (an exported program, "
            "a compiled function) runs the Python function behind it, so make that bridge "
            "or recipe first, in the same order as where the graph was made (import the "
            "module that defines it)."
        )
        raise GradOverrideError(msg)
    return found


# ---- the operator -------------------------------------------------------------------------------

# The structure of each call's result, by call string: written by whichever kernel ran (the
# fake one while tracing, the real one eagerly), read by `call` to put the result together.
# The owner returns the same structure from both (see `Owner`).
_RESULTS: dict[str, tuple[Any, ...]] = {}


def _flat_result(call_string: str, result: Any, inputs: Sequence[Tensor] | None
                 ) -> list[Tensor]:
    """`result`'s tensors, its structure kept for `call`; with `inputs` (real kernels),
    outputs aliasing an input are copied: an operator's outputs may not alias its inputs
    (a rule returning the gradient it was given, say)."""
    tensors: list[Tensor] = []
    tokens: list[Any] = []
    flatten(result, tensors, tokens)
    _RESULTS[call_string] = tuple(tokens)
    if inputs is None:
        return tensors
    held = {t.untyped_storage().data_ptr() for t in inputs}
    return [t.clone() if t.untyped_storage().data_ptr() in held else t for t in tensors]


# What the fake kernel told a compiler or an exporter, by call and input shapes (symbolic
# sizes as None): the real kernel checks its result against it, so that a wrong `outputs=`
# is an error rather than a compiled graph reading memory of another shape.
_PROMISED: dict[tuple[str, tuple[Any, ...]], tuple[Any, ...]] = {}


def _shapes(tensors: Sequence[Tensor]) -> tuple[Any, ...]:
    return tuple(
        (tuple(d if type(d) is int else None for d in t.shape), t.dtype) for t in tensors
    )


def _broken_promise(owner: Owner, role: str, promised: tuple[Any, ...], got: tuple[Any, ...]
                    ) -> Exception:
    from ._errors import GradOverrideError

    def shown(entry: tuple[Any, ...]) -> str:
        return ", ".join(
            f"{tuple(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in entry[1]
        ) or "no tensor"

    msg = (
        f"{owner.outside_describe(role)} returned {shown(got)}, but the compiled or exported "
        f"graph was traced with {shown(promised)}, what {owner.outside_promise(role)} said. "
        "Make it describe what the code returns (the same shapes and dtypes, and the same "
        "structure)."
    )
    return GradOverrideError(msg)


# Defined when the first owner registers, not at import (defining an operator costs time
# that users who never bridge should not pay), and read as a global by `call`, which dynamo
# traces.
_OPERATOR: Any = None


def _define_operator() -> Any:
    """`gradoverride::outside`: its real kernel, fake kernel and vmap rule."""

    @torch.library.custom_op("gradoverride::outside", mutates_args=())
    def outside(tensors: list[Tensor], call: str) -> list[Tensor]:
        owner, role, tokens = _resolve(call)
        outs = _flat_result(call, owner.outside_run(role, rebuild(tokens, tensors)), tensors)
        promised = _PROMISED.get((call, _shapes(tensors)))
        if promised is not None and promised != (_RESULTS[call], _shapes(outs)):
            raise _broken_promise(owner, role, promised, (_RESULTS[call], _shapes(outs)))
        return outs

    @outside.register_fake
    def _(tensors: list[Tensor], call: str) -> list[Tensor]:
        owner, role, tokens = _resolve(call)
        outs = _flat_result(call, owner.outside_fake(role, rebuild(tokens, tensors)), None)
        _PROMISED[(call, _shapes(tensors))] = (_RESULTS[call], _shapes(outs))
        return outs

    def batched(info: Any, in_dims: tuple[Any, ...], tensors: list[Tensor], call: str
                ) -> tuple[list[Tensor], list[int]]:
        # One call per batch entry, stacked: the owner's code sees plain tensors.
        dims = in_dims[0]
        per_entry = [
            outside([t if d is None else t.select(d, b) for t, d in zip(tensors, dims,
                                                                      strict=True)], call)
            for b in range(info.batch_size)
        ]
        outs = [torch.stack(list(column)) for column in zip(*per_entry, strict=True)]
        return outs, [0] * len(outs)

    outside.register_vmap(batched)
    return outside


def call(key: str, role: str, value: Any) -> Any:
    """`owner.outside_run(role, value)` through the operator; `value` must hold a tensor and
    nothing but tensors and literals (else `NotLiteral`)."""
    tensors: list[Tensor] = []
    tokens: list[Any] = []
    flatten(value, tensors, tokens)
    call_string = f"{key}|{role}|{tuple(tokens)!r}"
    outs = _OPERATOR(tensors, call_string)
    return rebuild(_result_structure(call_string), outs)


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def _result_structure(call_string: str) -> tuple[Any, ...]:
    # Read when called (dynamo calls it while tracing, after the fake kernel wrote it, and
    # keeps the answer as a constant) rather than through a dict dynamo would read once.
    return _RESULTS[call_string]
