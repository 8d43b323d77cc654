"""A module's parameters and buffers as `named_parameters()` / `named_buffers()` give them,
kept per module instance until its structure changes.

Walking a module's parameters and buffers with `named_parameters()` and `named_buffers()`
costs a few microseconds per call (generators over `named_modules()`), a large share of a
small layer's step. A `Layout` keeps what those walks gave, together with a *key*: the
module tree as plain values, read straight from each module's `_parameters`, `_buffers` and
`_modules` dicts. Every call reads the key again (a handful of C-level tuple builds for a
module without children) and uses the layout only when the key is equal, so it is never
stale:

* a parameter or buffer replaced (`module.weight = nn.Parameter(...)`,
  `load_state_dict(assign=True)`, `.to()` where it makes new tensors, what
  `torch.func.functional_call` puts in place for its call) changes an id in the key;
* a parameter or buffer registered, deleted or set to None, a submodule added, replaced or
  removed, changes the names or ids in the key;
* a lazy parameter materialized changes its type (`UninitializedParameter` to `Parameter`);
* `copy.deepcopy` and pickling give a module without a layout (`go.Module.__getstate__`
  drops it; `override_backward` keeps it on its forward object, which copies and pickles as
  a fresh override), and a layout read by another module instance (a shallow copy sharing
  its `__dict__`) does not match that instance's id.

The layout holds no tensors and no modules (ids only, so no memory is kept alive by it and
no reference cycle is made); the values used by a call are read from the module at that
call. What is not structure is read per call too: whether a buffer is floating-point, the
module's `inplace` attribute.

For a module without submodules, the layout also holds its owner's generated *entry*
(`_module_fastpath.generate_entry`), which checks the same structure from the same dicts
itself, written out for it, and covers the common call; the key is read only when the entry
does not cover a call.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.nn.parameter import UninitializedParameter

__all__ = ["Layout", "make_layout", "snapshot"]

Snapshot = tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]


def snapshot(module: nn.Module) -> Snapshot:
    """(key, parameters, buffers): the module tree as plain values, and every entry of its
    modules' `_parameters` and `_buffers` dicts (None and shared ones included), in the order
    `named_parameters()` walks them."""
    children = module._modules
    if not children:
        params = module._parameters
        buffers = module._buffers
        p = tuple(params.values())
        b = tuple(buffers.values())
        key = (
            id(module), type(module), tuple(params), tuple(map(id, p)), tuple(map(type, p)),
            tuple(buffers), tuple(map(id, b)),
        )
        return key, p, b
    return _snapshot_tree(module)


def _snapshot_tree(module: nn.Module) -> Snapshot:
    """`snapshot` for a module with submodules: preorder, each module once, as
    `named_modules()` visits them."""
    key: list[Any] = [id(module), type(module)]
    p_all: list[Any] = []
    b_all: list[Any] = []
    seen: set[int] = set()
    todo: list[nn.Module] = [module]
    while todo:
        m = todo.pop()
        if id(m) in seen:
            key.append(None)  # a module met again: named_modules() skips it and its children
            continue
        seen.add(id(m))
        params, buffers, children = m._parameters, m._buffers, m._modules
        p = tuple(params.values())
        b = tuple(buffers.values())
        c = tuple(children.values())
        key += (
            tuple(params), tuple(map(id, p)), tuple(map(type, p)),
            tuple(buffers), tuple(map(id, b)), tuple(children), tuple(map(id, c)),
        )
        p_all += p
        b_all += b
        todo += [child for child in reversed(c) if child is not None]
    return tuple(key), tuple(p_all), tuple(b_all)


def _picks(raw: tuple[Any, ...], named: list[tuple[str, Any]]) -> tuple[int, ...] | None:
    """For each named value, its index among the raw entries, or None when the named ones
    are not exactly the first occurrences of the raw values that are not None (a class
    that overrides `named_parameters`, say: such a module is walked on every call)."""
    first: dict[int, int] = {}
    for i, value in enumerate(raw):
        if value is not None:
            first.setdefault(id(value), i)
    picks = tuple(first.get(id(value), -1) for _, value in named)
    expected = tuple(sorted(first.values()))
    if picks != expected:
        return None
    if any(raw[i] is not value for i, (_, value) in zip(picks, named, strict=True)):
        return None
    return picks


class Layout:
    """What the walks gave for one module at one structure (see the module docstring).

    `picks` index the parameters among the snapshot's raw entries (None: all of them, in
    order); `buffer_picks` likewise for the buffers. `owner` is the rule object the layout
    was made for (a module may be overridden again after a `remove()`), `extra` whatever
    that owner derives from the names (its op)."""

    __slots__ = (
        "buffer_names", "buffer_picks", "entry", "extra", "inplace_in_dict", "key", "names",
        "owner", "parameter_ids", "picks",
    )

    def __init__(
        self, owner: object, key: tuple[Any, ...], names: tuple[str, ...],
        picks: tuple[int, ...] | None, parameter_ids: tuple[int, ...],
        buffer_names: tuple[str, ...], buffer_picks: tuple[int, ...],
        inplace_in_dict: bool,
    ) -> None:
        self.owner = owner
        self.key = key
        self.names = names
        self.picks = picks
        self.parameter_ids = parameter_ids
        self.buffer_names = buffer_names
        self.buffer_picks = buffer_picks
        # Whether the module's `inplace` attribute can be read from its `__dict__` alone
        # (absent there, it is False: nn.Module's `__getattr__` returns parameters, buffers
        # or modules, never True); not when its class defines `inplace` (a class attribute,
        # a property) or its own `__getattr__`, which getattr then reads on every call.
        self.inplace_in_dict = inplace_in_dict
        self.extra: Any = None
        # The owner's generated entry for this structure (see `_module_fastpath`), if any.
        self.entry: Any = None

    def parameters(self, raw: tuple[Any, ...]) -> tuple[Tensor, ...]:
        picks = self.picks
        return raw if picks is None else tuple(raw[i] for i in picks)

    def floating_buffers(self, raw: tuple[Any, ...]) -> dict[str, Tensor] | None:
        """The floating-point (or complex) buffers, by name; None when there are none."""
        if not self.buffer_names:
            return None
        found = {
            name: b
            for name, b in zip(self.buffer_names, (raw[i] for i in self.buffer_picks),
                               strict=True)
            if b.is_floating_point() or b.is_complex()
        }
        return found or None

    def inplace(self, module: nn.Module) -> bool:
        """`getattr(module, "inplace", False) is True`, read cheaply where that is exact."""
        if self.inplace_in_dict:
            return module.__dict__.get("inplace", False) is True
        return getattr(module, "inplace", False) is True

    def __reduce__(self) -> tuple[Any, ...]:
        # Only reached where a subclass's own __getstate__ keeps it: load as no layout.
        return (_no_layout, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None


def _no_layout() -> None:
    return None


def make_layout(owner: object, module: nn.Module, snap: Snapshot) -> Layout | None:
    """A layout for `module` at its current structure (`snap`), read with the reference walks;
    None when the walks cannot be matched to the snapshot (the module is then walked on
    every call). A lazy module's uninitialized parameter is left to the caller's check: its
    type is in the key, so the layout is remade once it is materialized."""
    key, raw_params, raw_buffers = snap
    named = list(module.named_parameters())
    picks = _picks(raw_params, named)
    named_buffers = list(module.named_buffers())
    buffer_picks = _picks(raw_buffers, named_buffers)
    if picks is None or buffer_picks is None:
        return None
    if any(isinstance(p, UninitializedParameter) for _, p in named):
        return None
    all_in_order = picks == tuple(range(len(raw_params)))
    return Layout(
        owner,
        key,
        tuple(n for n, _ in named),
        None if all_in_order else picks,
        tuple(id(p) for _, p in named),
        tuple(n for n, _ in named_buffers),
        buffer_picks,
        _inplace_in_dict(type(module)),
    )


def _inplace_in_dict(cls: type) -> bool:
    if getattr(cls, "__getattr__", None) is not nn.Module.__getattr__:
        return False
    return not any("inplace" in klass.__dict__ for klass in cls.__mro__)
