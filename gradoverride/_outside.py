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
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from ._internals import tracing_state, transforms_active

__all__ = [
    "NotLiteral", "Owner", "call", "flatten", "owner", "rebuild", "register", "tensors_in",
]

_LITERALS = (bool, int, str, type(None))


class NotLiteral(Exception):
    """A value in a call is neither a tensor nor a Python literal: `args` are its path and
    its type's name (strings only, and no `__init__` of its own: dynamo traces raising it)."""

    @property
    def path(self) -> str:
        return str(self.args[0])

    @property
    def kind(self) -> str:
        return str(self.args[1])


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
    global _OPERATOR, _result_structure
    if _OPERATOR is None:
        _OPERATOR = _define_operator()
        _result_structure = torch.compiler.assume_constant_result(  # type: ignore[no-untyped-call]
            _read_structure)
    return key


# ---- the structure of a call, as tensors and a literal ------------------------------------------


def flatten(value: Any, tensors: list[Tensor], tokens: list[Any], path: str = "") -> None:
    """Append `value`'s tensors to `tensors` and its structure to `tokens`: "T" per tensor,
    ("tuple"|"list", n) or ("dict", keys) per container, ("C", v) per literal, ("N", kind)
    per number carried as a 0-d tensor. Plain Python, so that dynamo traces it into
    constants.

    A float (and, while compiling, an int) travels as a 0-d CPU tensor, not in the string:
    a value that changes every call (a temperature) then neither recompiles a graph nor
    makes a new string, and a symbolic one has no literal to write. The real kernel hands
    the owner's code the Python number again; the fake kernel, the 0-d tensor."""
    if isinstance(value, Tensor):
        tensors.append(value)
        tokens.append("T")
    elif isinstance(value, float | torch.SymFloat) and not isinstance(value, bool):
        tensors.append(torch.tensor(value, dtype=torch.float64))
        tokens.append(("N", "float"))
    elif type(value) is bool or type(value) is str or value is None or (
        type(value) is int and not torch.compiler.is_compiling()
    ):
        tokens.append(("C", value))
    elif isinstance(value, int | torch.SymInt):
        # Traced, an int may be symbolic (dynamo gives no way to tell it from a constant),
        # so it travels as a number too.
        tensors.append(torch.tensor(value, dtype=torch.int64))
        tokens.append(("N", "int"))
    elif type(value) is tuple or type(value) is list:
        tokens.append((type(value).__name__, len(value)))
        for i, item in enumerate(value):
            flatten(item, tensors, tokens, f"{path}[{i}]")
    elif type(value) is dict:
        keys = tuple(value)
        if not all(isinstance(k, _LITERALS) for k in keys):
            raise NotLiteral(path, type(value).__name__)
        tokens.append(("dict", keys))
        for k in keys:
            flatten(value[k], tensors, tokens, f"{path}[{k!r}]")
    else:
        raise NotLiteral(path, type(value).__name__)


def rebuild(tokens: Sequence[Any], tensors: Sequence[Any], numbers: bool = False) -> Any:
    """The value `flatten` took apart, with `tensors` in the tensors' places; with
    `numbers`, a number carried as a 0-d tensor is the Python number again (for real
    tensors; a fake kernel leaves it a 0-d tensor)."""
    value, _, _ = _rebuild(tokens, 0, tensors, 0, numbers)
    return value


def _rebuild(tokens: Sequence[Any], at: int, tensors: Sequence[Any], used: int,
             numbers: bool) -> tuple[Any, int, int]:
    token = tokens[at]
    at += 1
    if token == "T":
        return tensors[used], at, used + 1
    kind, payload = token
    if kind == "C":
        return payload, at, used
    if kind == "N":
        held = tensors[used]
        if numbers:
            return (float(held.item()) if payload == "float" else int(held.item())), at, used + 1
        return held, at, used + 1
    if kind == "dict":
        out: dict[Any, Any] = {}
        for key in payload:
            out[key], at, used = _rebuild(tokens, at, tensors, used, numbers)
        return out, at, used
    items = []
    for _ in range(payload):
        item, at, used = _rebuild(tokens, at, tensors, used, numbers)
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
            "or recipe first, in the same order as where the graph was made, and keep it "
            "(import the module that defines it at module level)."
        )
        raise GradOverrideError(msg)
    return found


# ---- the operator -------------------------------------------------------------------------------

# The structure of each call's result, by call string: written by whichever kernel ran (the
# fake one while tracing, the real one eagerly), read by `call` to put the result together.
# The owner returns the same structure from both (see `Owner`).
# Bounded: a bridge called with a constant that changes every step (a temperature) makes a
# new call string each time; the entry is read right after it is written, so the newest
# few thousand are all that is ever needed.
_RESULTS: OrderedDict[str, tuple[Any, ...]] = OrderedDict()
_KEPT = 4096


def _remember(table: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    table[key] = value
    if len(table) > _KEPT:
        table.popitem(last=False)


def _flat_result(call_string: str, result: Any, inputs: Sequence[Tensor] | None
                 ) -> list[Tensor]:
    """`result`'s tensors, its structure kept for `call`; with `inputs` (real kernels),
    outputs aliasing an input are copied: an operator's outputs may not alias its inputs
    (a rule returning the gradient it was given, say)."""
    tensors: list[Tensor] = []
    tokens: list[Any] = []
    flatten(result, tensors, tokens)
    _remember(_RESULTS, call_string, tuple(tokens))
    if inputs is None:
        return tensors
    held = {t.untyped_storage().data_ptr() for t in inputs}
    return [t.clone() if t.untyped_storage().data_ptr() in held else t for t in tensors]


# What the fake kernel told a compiler or an exporter, per call: the real kernel checks its
# result against it, so that a wrong `outputs=` is an error rather than a compiled graph
# reading memory of another shape or dtype. A promise is (the inputs' dtypes and shapes, the
# result's structure, per output its dtype and shape); a size is an int, a symbolic size equal to an
# input's size is ("in", tensor, dim) (as `torch.empty_like(x)` gives), and any other
# symbolic size is None (not checked).
_PROMISED: OrderedDict[str, list[tuple[Any, ...]]] = OrderedDict()


def _promise(tensors: Sequence[Tensor], tokens: tuple[Any, ...], outs: Sequence[Tensor]
             ) -> tuple[Any, ...]:
    sizes: dict[str, tuple[str, int, int]] = {}
    inputs = []
    for i, t in enumerate(tensors):
        dims: list[Any] = []
        for j, d in enumerate(t.shape):
            if type(d) is int:
                dims.append(d)
            else:
                sizes.setdefault(str(d), ("in", i, j))
                dims.append(None)
        inputs.append((t.dtype, tuple(dims)))
    results = tuple(
        (o.dtype, tuple(d if type(d) is int else sizes.get(str(d)) for d in o.shape))
        for o in outs
    )
    return tuple(inputs), tokens, results


def _keeps(promise: tuple[Any, ...], tensors: Sequence[Tensor], tokens: tuple[Any, ...],
           outs: Sequence[Tensor]) -> bool | None:
    """Whether a real call keeps `promise`; None when the promise is for other inputs."""
    inputs, promised_tokens, results = promise
    if len(inputs) != len(tensors) or any(
        dtype != t.dtype or len(dims) != t.dim()
        or any(d is not None and d != n for d, n in zip(dims, t.shape, strict=True))
        for (dtype, dims), t in zip(inputs, tensors, strict=True)
    ):
        return None
    if promised_tokens != tokens or len(results) != len(outs):
        return False
    for (dtype, dims), o in zip(results, outs, strict=True):
        if o.dtype != dtype or o.dim() != len(dims):
            return False
        for d, n in zip(dims, o.shape, strict=True):
            expected = tensors[d[1]].shape[d[2]] if isinstance(d, tuple) else d
            if expected is not None and expected != n:
                return False
    return True


def _broken_promise(owner: Owner, role: str, promise: tuple[Any, ...],
                    tensors: Sequence[Tensor], outs: Sequence[Tensor]) -> Exception:
    from ._errors import GradOverrideError

    def size(d: Any) -> str:
        if isinstance(d, tuple):
            return str(tensors[d[1]].shape[d[2]])
        return "?" if d is None else str(d)

    promised = ", ".join(
        f"({', '.join(map(size, dims))}{',' if len(dims) == 1 else ''}) "
        f"{str(dtype).removeprefix('torch.')}" for dtype, dims in promise[2]
    ) or "no tensor"
    got = ", ".join(
        f"{tuple(o.shape)} {str(o.dtype).removeprefix('torch.')}" for o in outs
    ) or "no tensor"
    msg = (
        f"{owner.outside_describe(role)} returned {got}, but the compiled or exported "
        f"graph was traced with {promised}, what {owner.outside_promise(role)} said. "
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
        result = owner.outside_run(role, rebuild(tokens, tensors, numbers=True))
        outs = _flat_result(call, result, tensors)
        for promise in _PROMISED.get(call, ()):
            kept = _keeps(promise, tensors, _RESULTS[call], outs)
            if kept is False:
                raise _broken_promise(owner, role, promise, tensors, outs)
            if kept:
                break
        return outs

    @outside.register_fake
    def _(tensors: list[Tensor], call: str) -> list[Tensor]:
        owner, role, tokens = _resolve(call)
        outs = _flat_result(call, owner.outside_fake(role, rebuild(tokens, tensors)), None)
        promise = _promise(tensors, _RESULTS[call], outs)
        promises = _PROMISED.get(call, [])
        if promise not in promises:
            _remember(_PROMISED, call, [promise, *promises][:8])
        return outs

    def batched(info: Any, in_dims: tuple[Any, ...], tensors: list[Tensor], call: str
                ) -> tuple[list[Tensor], list[int]]:
        # One call per batch entry, stacked: the owner's code sees plain tensors.
        dims = in_dims[0]
        if info.batch_size == 0:
            return _empty_batch(tensors, dims, call)
        per_entry = [
            outside([t if d is None else t.select(d, b) for t, d in zip(tensors, dims,
                                                                      strict=True)], call)
            for b in range(info.batch_size)
        ]
        outs = [torch.stack(list(column)) for column in zip(*per_entry, strict=True)]
        return outs, [0] * len(outs)

    outside.register_vmap(batched)
    return outside


def _empty_batch(tensors: list[Tensor], dims: Sequence[int | None], call: str
                 ) -> tuple[list[Tensor], list[int]]:
    """vmap over no entries: no call to make, so the result's shapes come from the fake
    kernel (`outputs=` for a bridge) on one entry's shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    owner, role, tokens = _resolve(call)
    with FakeTensorMode() as mode:
        entry = [
            mode.from_tensor(t if d is None else t.select(d, 0) if t.shape[d] else
                             t.new_empty(t.shape[:d] + t.shape[d + 1:]))
            for t, d in zip(tensors, dims, strict=True)
        ]
        fakes = _flat_result(call, owner.outside_fake(role, rebuild(tokens, entry)), None)
    device = tensors[0].device if tensors else torch.device("cpu")
    outs = [torch.empty((0, *f.shape), dtype=f.dtype, device=device) for f in fakes]
    return outs, [0] * len(outs)


def call(key: str, role: str, value: Any) -> Any:
    """`owner.outside_run(role, value)` through the operator; `value` must hold a tensor and
    nothing but tensors and literals (else `NotLiteral`).

    The one fast path: eagerly, with no compiler, exporter, `torch.jit.trace` or
    `torch.func` transform at work and only plain tensors in `value`, nothing needs the
    operator, and the owner runs right here (the operator's dispatch costs more than a
    small bridge's numpy call)."""
    if _plain_eager(value):
        return owner(key).outside_run(role, value)
    tensors: list[Tensor] = []
    tokens: list[Any] = []
    flatten(value, tensors, tokens)
    call_string = f"{key}|{role}|{tuple(tokens)!r}"
    outs = _OPERATOR(tensors, call_string)
    return rebuild(_result_structure(call_string), outs)


def tensors_in(value: Any) -> Iterator[Tensor]:
    """The tensors in `value`'s tuples, lists and dicts (a plain walk: cheaper than torch's
    pytree, which the eager path of a small bridge would spend most of its time in)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def _plain_eager(value: Any) -> bool:
    if torch.compiler.is_compiling() or tracing_state() is not None or transforms_active():
        return False
    return all(
        type(t) is Tensor or type(t) is torch.nn.Parameter for t in tensors_in(value)
    )


def _read_structure(call_string: str) -> tuple[Any, ...]:
    return _RESULTS[call_string]


# `_read_structure` as dynamo calls it while tracing (after the fake kernel wrote the entry)
# and keeps its answer as a constant, rather than reading the table once; wrapped when the
# first owner registers (`assume_constant_result` imports dynamo, over a second).
_result_structure: Any = _read_structure
