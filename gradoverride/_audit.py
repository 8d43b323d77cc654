"""Checking a call for the two mistakes that silently lose or corrupt gradients.

* **A captured tensor.** When a rule owns every input (the default), the forward runs inside
  an `autograd.Function`, where autograd records nothing; a tensor that requires grad and
  that the forward reads without being given it (a closure variable, a global, `self.weight`
  inside a decorated method) then gets no gradient at all. Only the inputs get gradients,
  from the rule.
* **An input changed in place.** A forward that changes a tensor input in place (`x.relu_()`)
  hands the rule the changed value, and autograd never learns that the caller's tensor
  changed.

Each op checks its first eager call with grad enabled, and each module with a rule
(`go.Module`, `override_backward`) the first of each instance, a copy included (one call:
the check runs the forward under a `TorchFunctionMode`, which costs a little, once);
`gradoverride.testing` checks every call it makes (`check_backward`, `assert_consistent`).
A module's checked call also checks its rule, in backward, for a write to a parameter's
`.grad`. A finding is a `GradOverrideError` naming the op, the tensor and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ._errors import GradOverrideError
from ._function import wrote_grad_message
from ._passthrough import AUDITS

if TYPE_CHECKING:
    from ._decorators import CustomBackward
    from ._function import CallState
    from ._module_op import ModuleOp

__all__ = [
    "ModuleAudit", "RuleResultCheck", "audit_call", "audit_module_call", "watching_grads",
]

# Calls whose result carries no gradient of their tensor arguments, so reading a captured
# tensor through them loses nothing: metadata (`.shape` and other property reads, `size()`),
# explicit detaching, factories that take only a shape and dtype from a tensor (`zeros_like`,
# `new_ones`), and steps whose derivative is zero (`sign`, `round`, ...), as plain autograd
# would give them.
_NO_GRADIENT_NAMES = frozenset(
    {"detach", "detach_", "size", "dim", "numel", "stride", "data_ptr",
     "is_floating_point", "is_complex", "is_contiguous", "element_size", "storage_offset",
     "item", "tolist", "__len__", "__bool__", "__float__", "__int__", "__index__", "__repr__",
     "__format__", "requires_grad_",
     "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
     "randint_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
     "sign", "sgn", "round", "floor", "ceil", "trunc", "fix", "heaviside",
     "argmax", "argmin", "argsort"}
)


# Calls whose other tensor arguments give only a shape, dtype or device (`x.to(w)`).
_METADATA_ARGUMENTS = frozenset({"view_as", "type_as", "expand_as", "reshape_as", "to"})
# Properties read as `__get__` whose result carries no gradient even when it is a tensor.
_NO_GRADIENT_PROPERTIES = frozenset({"data", "grad", "shape", "dtype", "device", "layout"})

def _carries_gradient(result: Any) -> bool:
    """Whether a call's result holds a floating or complex tensor (one a gradient flows to)."""
    return any(
        isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.is_complex())
        for leaf in pytree.tree_leaves(result)
    )




def _root(t: Tensor) -> Tensor:
    base = t._base
    return t if base is None else base


class _ForwardAudit(TorchFunctionMode):
    """Follows, through the calls of one forward, the tensors that require grad without being
    its inputs or made inside it (captured), what is computed from them (tainted), and the
    inputs it changes in place after reading them.

    Inside an owning Function's forward grad mode is off, which is how a read from the
    forward is told apart from the op's own bookkeeping. Only a captured tensor that reaches
    the forward's result through calls that carry a gradient is a lost gradient."""

    def __init__(self, inputs: list[Tensor]) -> None:
        super().__init__()
        self.inputs = {id(t): t for t in inputs}
        self.known = set(self.inputs)
        # tainted tensor's id -> (the captured tensor, the tainted tensor, kept alive for the
        # call so that its id is not reused)
        self.tainted: dict[int, tuple[Tensor, Tensor]] = {}
        self.read: set[int] = set()  # inputs read by a call that carries a gradient
        self.changed_after_read: set[int] = set()

    def __enter__(self) -> _ForwardAudit:
        AUDITS.append(self)
        enter: Any = super().__enter__
        enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        leave: Any = super().__exit__
        leave(*exc)
        AUDITS.remove(self)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = "." + getattr(getattr(func, "__self__", None), "__name__", "")
        result = func(*args, **kwargs)
        if not torch.is_grad_enabled():
            self._follow(name, args, kwargs, result)
        for leaf in pytree.tree_leaves(result):
            if isinstance(leaf, Tensor):
                self.known.add(id(leaf))
        return result

    def _input_of(self, t: Tensor) -> int | None:
        """The input `t` is, or is a view of."""
        for candidate in (t, _root(t)):
            if id(candidate) in self.inputs:
                return id(candidate)
        return None

    def _source(self, t: Tensor) -> Tensor | None:
        if t.requires_grad and id(t) not in self.known:
            return t  # captured
        found = self.tainted.get(id(t))
        return None if found is None else found[0]

    def _follow(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                result: Any) -> None:
        carries = (
            name not in _NO_GRADIENT_NAMES
            # The sign of a complex number (z / |z|) is smooth: only a real one is a step.
            or (name == "sgn" and bool(args) and isinstance(args[0], Tensor)
                and args[0].is_complex())
        ) and not (
            name.startswith(".") and (name[1:] in _NO_GRADIENT_PROPERTIES or
                                      not _carries_gradient(result))
        )
        leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)]
        written = None  # the tensor an in-place call writes
        if name == "__setitem__" or (name.endswith("_") and not name.endswith("__")):
            written = args[0] if args and isinstance(args[0], Tensor) else None
        elif isinstance(kwargs.get("out"), Tensor):
            written = kwargs["out"]
        # Inputs read, and inputs changed after they were read.
        for k, leaf in enumerate(leaves):
            index = self._input_of(leaf)
            if index is None:
                continue
            if written is not None and k == 0 and leaf is written:
                if index in self.read:
                    self.changed_after_read.add(index)
            elif carries:
                self.read.add(index)
        if not carries:
            return
        # What is computed from a captured tensor.
        sources = leaves[:1] if name in _METADATA_ARGUMENTS else leaves
        if written is not None:
            sources = [leaf for leaf in sources if leaf is not written]
        source = next((s for s in map(self._source, sources) if s is not None), None)
        if source is None:
            return
        # A write into a view (`y[0].mul_(w)`) changes its base too.
        targets = [written, _root(written)] if written is not None else []
        targets += [leaf for leaf in pytree.tree_leaves(result) if isinstance(leaf, Tensor)]
        for leaf in targets:
            if leaf.is_floating_point() or leaf.is_complex():
                self.tainted[id(leaf)] = (source, leaf)

    def carry(self, inputs: Any, result: Any) -> None:
        """An op with its own backward ran inside the forward (a recipe, a bridge, another
        `custom_backward`): its result carries a gradient from each of its tensor inputs,
        whatever its forward's own calls look like (`torch.sign` has a zero derivative, a
        straight-through sign passes the gradient; a bridge's numpy calls are not seen)."""
        leaves = [leaf for leaf in pytree.tree_leaves(inputs) if isinstance(leaf, Tensor)]
        for leaf in leaves:
            index = self._input_of(leaf)
            if index is not None:
                self.read.add(index)
        source = next((s for s in map(self._source, leaves) if s is not None), None)
        if source is None:
            return
        for leaf in pytree.tree_leaves(result):
            if isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
                self.tainted[id(leaf)] = (source, leaf)

    def alias(self, original: Tensor, alias: Tensor) -> None:
        """`alias` shares `original`'s memory (gradoverride made it): the same taint."""
        found = self.tainted.get(id(original))
        if found is not None:
            self.tainted[id(alias)] = (found[0], alias)

    def lost(self, result: Any) -> Tensor | None:
        """The captured tensor the op's result was computed from (or is), if any."""
        for leaf in pytree.tree_leaves(result):
            if isinstance(leaf, Tensor):
                source = self._source(leaf)
                if source is not None:
                    return source
        return None


class _Check:
    """One checked call: what `_ForwardAudit` follows, and the findings said for the op.

    `names` and `values`: the call's slots, by name (a module op's slot 0 holds the module);
    `fn`: the forward, whose closure and globals name a captured tensor."""

    def __init__(self, op: str, names: tuple[str, ...], values: tuple[Any, ...],
                 fn: Any, owns_all: bool, tracks_inplace: bool,
                 requested: tuple[str, ...], labels: dict[str, str]) -> None:
        self.op = op
        self.names = names
        self.values = values
        self.fn = fn
        self.owns_all = owns_all
        self.tracks_inplace = tracks_inplace
        self.requested = requested
        self.labels = labels
        self.leaves = [
            leaf for leaf in pytree.tree_leaves(values) if isinstance(leaf, Tensor)
        ]
        self.versions: list[int] = []
        self.audit: _ForwardAudit | None = None

    def begin(self) -> None:
        self.versions = [leaf._version for leaf in self.leaves]
        if self.owns_all:
            # A rule owning only some inputs lets the forward run on the ordinary graph: a
            # captured tensor gets its autograd gradient there, so only in-place changes are
            # checked.
            self.audit = _ForwardAudit(self.leaves)
            self.audit.__enter__()

    def end(self) -> None:
        if self.audit is not None and self.audit in AUDITS:
            self.audit.__exit__(None, None, None)

    def finish(self, result: Any) -> None:
        audit = self.audit
        if audit is not None:
            captured = audit.lost(result)
            if captured is not None:
                raise GradOverrideError(self._captured_message(captured))
        if self.tracks_inplace:
            return
        for leaf, version in zip(self.leaves, self.versions, strict=True):
            if leaf._version == version or not self._matters(leaf):
                continue
            # A parameter changed under no_grad before the forward reads it (a constraint,
            # `w.clamp_(min=0)`) has no history to lose, and the rule reads what the forward
            # used: allowed. Changed after it was read, or a tensor with a history: refused.
            if leaf.is_leaf and audit is not None and id(leaf) not in audit.changed_after_read:
                continue
            raise GradOverrideError(self._inplace_message(leaf))

    def run(self, call: Callable[[], Any]) -> Any:
        self.begin()
        try:
            result = call()
        finally:
            self.end()
        self.finish(result)
        return result

    def _matters(self, t: Tensor) -> bool:
        """An input changed in place matters when it needs a gradient or the rule reads it."""
        if t.requires_grad:
            return True
        name = self._slot_of(t)
        return name is not None and name in self.requested

    def _slot_of(self, t: Tensor) -> str | None:
        """The forward parameter holding `t` in this call, if any."""
        for name, value in zip(self.names, self.values, strict=False):
            if any(leaf is t for leaf in pytree.tree_leaves(value)):
                return self.labels.get(name, name) or None
        return None

    def _describe(self, t: Tensor) -> str:
        """Where a captured tensor comes from, as far as the forward's code tells."""
        fn = self.fn
        code = getattr(fn, "__code__", None)
        if code is not None:
            found: list[tuple[str, Any, str]] = []  # (name, value, what it is)
            for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
                try:
                    found.append((name, cell.cell_contents, "a variable of an enclosing function"))
                except ValueError:  # an empty cell
                    continue
            namespace = getattr(fn, "__globals__", {})
            found += [(name, namespace.get(name), "a global") for name in code.co_names]
            for name, value, what in found:
                if value is t:
                    return f"`{name}` ({what})"
            for name, value, what in found:
                # A module the forward reaches (`layer(x)` for a global `layer`).
                if isinstance(value, nn.Module):
                    for pname, p in value.named_parameters():
                        if p is t:
                            return f"`{name}.{pname}` (a parameter of `{name}`, {what})"
        for name, value in zip(self.names, self.values, strict=False):
            if isinstance(value, nn.Module):
                for pname, p in value.named_parameters():
                    if p is t:
                        return f"`{name}.{pname}` (a parameter of the module passed as `{name}`)"
                for mname, sub in value.named_modules():
                    for attr, item in vars(sub).items():
                        if item is t:
                            path = f"{name}.{mname + '.' if mname else ''}{attr}"
                            return f"`{path}` (a tensor attribute, not a parameter)"
            else:
                for attr, item in getattr(value, "__dict__", {}).items():
                    if item is t:
                        return f"`{name}.{attr}`"
        return f"a tensor of shape {tuple(t.shape)}, dtype {t.dtype}"

    def _captured_message(self, t: Tensor) -> str:
        name = self.op
        return (
            f"the forward of `{name}` reads {self._describe(t)}, which requires grad but is "
            f"not one of its inputs; its gradient would be silently lost, because the rule of "
            f"`{name}` gives the gradients of the inputs only (the forward runs where "
            "autograd records nothing). Pass it as an argument (the rule then returns its "
            "gradient, or None), use `go.Module` for a module's parameters, register the rule "
            "with `owns=` naming the inputs it owns (the rest, captured tensors included, keep "
            "their autograd gradient), or `.detach()` it if it should get no gradient."
        )

    def _inplace_message(self, t: Tensor) -> str:
        name = self.op
        slot = self._slot_of(t)
        which = f"its input `{slot}`" if slot is not None else "one of its tensor inputs"
        if t.is_leaf:
            return (
                f"the forward of `{name}` changed {which} in place after reading it (its "
                "version counter moved during the call): the rule would read the changed "
                "value, not the one the forward used. Change it before the forward reads it "
                "(a constraint such as `w.clamp_(min=0)` first), or outside the forward, after "
                "the optimizer step."
            )
        return (
            f"the forward of `{name}` changed {which} in place (its version counter moved "
            "during the call): the rule would read the changed value, and autograd would not "
            "see the caller's tensor change. Change it out of place (`x = x.relu()` instead "
            "of `x.relu_()`, or `x = x.clone()` first); for a module built with "
            "`inplace=True`, build it with `inplace=False`."
        )


def audit_call(op: CustomBackward[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run `op(*args, **kwargs)` and check it for captured tensors and in-place changes."""
    rule = op._rule
    assert rule is not None
    sig = op._signature
    try:
        values = sig.bind(args, kwargs)
    except GradOverrideError:
        return op._run(args, kwargs)  # the call's own error, raised by the call itself
    check = _Check(
        op._name, sig.names, values, getattr(op, "__wrapped__", None), rule.owns_all,
        op._tracks_inplace, rule.requested, op._labels,
    )
    route = op._route
    if route is None:
        return check.run(lambda: op._run(args, kwargs))
    from ._function import CallState

    state = CallState()
    state.rule_check = RuleResultCheck()
    return check.run(lambda: route.run_bound(values, state))


def _module_check(op: ModuleOp, values: tuple[Any, ...]) -> _Check:
    rule = op._rule
    return _Check(
        op._name, op.slots.names, values, op.forward, rule.owns_all, op.inplace,
        rule.requested, {},
    )


def audit_module_call(op: ModuleOp, values: tuple[Any, ...], state: CallState | None) -> Any:
    """Run a module's op on `values` and check it as `audit_call` does; its backward checks
    that the rule writes no parameter's `.grad` (see `watching_grads`)."""
    from ._function import CallState

    if state is None:
        state = CallState()
    state.watch = watching_grads
    return _module_check(op, values).run(lambda: op._route.run_bound(values, state))


class ModuleAudit:
    """The check of a module call whose forward the module runs itself, between its forward
    hooks (`override_backward`): `begin` in the pre-hook, `end` and `finish` after."""

    def __init__(self, op: ModuleOp, values: tuple[Any, ...], state: CallState) -> None:
        self.check = _module_check(op, values)
        state.watch = watching_grads

    def begin(self) -> None:
        self.check.begin()

    def end(self) -> None:
        self.check.end()

    def finish(self, result: Any) -> None:
        self.check.finish(result)


class _GradWrites(TorchFunctionMode):
    """Raises when a rule writes the `.grad` of one of `tensors` (by name): sets it, or
    changes it in place. Thread-local, as every mode is, so another thread's backward
    accumulating into the same `.grad` is not mistaken for the rule's write."""

    def __init__(self, op: str, tensors: dict[str, Tensor]) -> None:
        super().__init__()
        self.op = op
        self.named = {id(t): name for name, t in tensors.items()}
        self.grads: dict[int, str] = {}  # id of a `.grad` read -> its tensor's name

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        if owner == "grad" and args and id(args[0]) in self.named:
            if name == "__set__":
                raise GradOverrideError(wrote_grad_message(self.op, self.named[id(args[0])]))
            result = func(*args, **kwargs)
            if isinstance(result, Tensor):
                self.grads[id(result)] = self.named[id(args[0])]
            return result
        if (
            name.endswith("_") and not name.endswith("__") and args
            and isinstance(args[0], Tensor) and id(args[0]) in self.grads
        ):
            raise GradOverrideError(wrote_grad_message(self.op, self.grads[id(args[0])]))
        return func(*args, **kwargs)


@contextmanager
def watching_grads(op: str, tensors: dict[str, Tensor]) -> Iterator[None]:
    """While a checked call's rule runs: a `.grad` it writes raises (see `_GradWrites`)."""
    with _GradWrites(op, tensors):
        yield


# ---- a checked call's rule: a mask returned instead of `grad * mask` --------------------------


# Calls that hand a tensor's values out of torch.
_LEAVING_TORCH = frozenset(
    {"numpy", "__array__", "tolist", "item", "data_ptr", "untyped_storage", "__dlpack__"}
)


class _Upstream(TorchFunctionMode):
    """Follows which tensors a rule computes from the upstream gradients: a call with one of
    them among its arguments makes its results such tensors too. Holds them, so that no
    followed tensor's id is reused while the rule runs."""

    def __init__(self, grads: Any) -> None:
        super().__init__()
        self.held = [g for g in pytree.tree_leaves(grads) if isinstance(g, Tensor)]
        self.ids = {id(g) for g in self.held}
        # Whether the gradient left torch (numpy, a Python number): what comes back cannot be
        # followed, so nothing is concluded (a go.bridge's rule runs in numpy).
        self.escaped = False

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if any(id(a) in self.ids for a in pytree.tree_leaves((args, kwargs))
               if isinstance(a, Tensor)):
            if getattr(func, "__name__", "") in _LEAVING_TORCH:
                self.escaped = True
            for t in pytree.tree_leaves(result):
                if isinstance(t, Tensor):
                    self.held.append(t)
                    self.ids.add(id(t))
        return result


class RuleResultCheck:
    """The first checked call of an op looks at what its rule returns: a gradient of 0s and
    1s computed without the upstream gradient is, almost always, a mask returned instead of
    `grad * mask` (a float mask passes every dtype and shape check, and trains with the
    mask as the gradient). It is a `GradOverrideWarning`, not an error: a rule may mean to
    inject a constant."""

    def __init__(self) -> None:
        self.mode: _Upstream | None = None

    @contextmanager
    def watching(self, grads: Any) -> Iterator[None]:
        self.mode = _Upstream(grads)
        with self.mode:
            yield

    def inspect(self, op: str, names: tuple[str, ...], result: Any) -> None:
        mode, self.mode = self.mode, None
        if mode is None or mode.escaped:
            return
        if isinstance(result, dict):
            entries = list(result.items())
        elif type(result) is tuple:
            entries = list(zip(names, result, strict=False))
        else:
            entries = [(names[0] if len(names) == 1 else "its input", result)]
        for name, value in entries:
            for leaf in pytree.tree_leaves(value):
                if not (isinstance(leaf, Tensor) and leaf.is_floating_point()
                        and leaf.numel() > 0 and leaf.device.type != "meta"
                        and id(leaf) not in mode.ids):
                    continue
                with torch.no_grad():
                    mask = bool(((leaf == 0) | (leaf == 1)).all()) and bool((leaf == 1).any())
                if mask:
                    import warnings

                    from ._errors import GradOverrideWarning

                    warnings.warn(
                        f"the backward of `{op}` returned a gradient for `{name}` made of 0s "
                        "and 1s and computed without the upstream gradient: a mask returned "
                        "instead of `grad * mask`? Multiply the upstream gradient by the mask "
                        "(`return grad * mask`). If a constant gradient is meant, silence "
                        "this with `warnings.filterwarnings('ignore', 'the backward of')`.",
                        GradOverrideWarning, stacklevel=2,
                    )
                    return
