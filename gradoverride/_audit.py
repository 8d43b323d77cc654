"""Checking a call for the two mistakes that silently lose or corrupt gradients.

* **A captured tensor.** When a rule owns every input (the default), the forward runs inside
  an `autograd.Function`, where autograd records nothing; a tensor that requires grad and
  that the forward reads without being given it (a closure variable, a global, `self.weight`
  inside a decorated method) then gets no gradient at all. Only the inputs get gradients,
  from the rule.
* **An input changed in place.** A forward that changes a tensor input in place (`x.relu_()`)
  hands the rule the changed value, and autograd never learns that the caller's tensor
  changed.

Each op checks its first eager call with grad enabled (one call: the check runs the forward
under a `TorchFunctionMode`, which costs a little, once), and `gradoverride.testing` checks
every call it makes (`check_backward`, `assert_consistent`). A finding is a
`GradOverrideError` naming the op, the tensor and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ._errors import GradOverrideError
from ._passthrough import AUDITS

if TYPE_CHECKING:
    from ._decorators import CustomBackward

__all__ = ["audit_call"]

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
        carries = name not in _NO_GRADIENT_NAMES and not (
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
        targets = [written] if written is not None else []
        targets += [leaf for leaf in pytree.tree_leaves(result) if isinstance(leaf, Tensor)]
        for leaf in targets:
            if leaf.is_floating_point() or leaf.is_complex():
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


def audit_call(op: CustomBackward[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run `op(*args, **kwargs)` and check it for captured tensors and in-place changes."""
    leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)]
    versions = [leaf._version for leaf in leaves]
    run = op._run
    assert run is not None
    rule = op._rule
    assert rule is not None
    audit = None
    if not rule.owns_all:
        # The forward runs on the ordinary graph: a captured tensor gets its autograd
        # gradient there, so only in-place changes are checked.
        result = run(op, *args, **kwargs)
    else:
        audit = _ForwardAudit(leaves)
        with audit:
            result = run(op, *args, **kwargs)
        captured = audit.lost(result)
        if captured is not None:
            raise GradOverrideError(_captured_message(op, captured, args, kwargs))
    if not op._tracks_inplace:
        for leaf, version in zip(leaves, versions, strict=True):
            if leaf._version == version or not _matters(op, leaf, args, kwargs):
                continue
            # A parameter changed under no_grad before the forward reads it (a constraint,
            # `w.clamp_(min=0)`) has no history to lose, and the rule reads what the forward
            # used: allowed. Changed after it was read, or a tensor with a history: refused.
            if leaf.is_leaf and audit is not None and id(leaf) not in audit.changed_after_read:
                continue
            raise GradOverrideError(_inplace_message(op, leaf, args, kwargs))
    return result


def _matters(op: CustomBackward[..., Any], t: Tensor, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> bool:
    """An input changed in place matters when it needs a gradient or the rule reads it."""
    if t.requires_grad:
        return True
    rule = op._rule
    assert rule is not None
    name = _slot_of(op, t, args, kwargs)
    return name is not None and name in rule.requested


def _slot_of(op: CustomBackward[..., Any], t: Tensor, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> str | None:
    """The forward parameter holding `t` in this call, if any."""
    sig = op._signature
    try:
        values = sig.bind(args, kwargs)
    except GradOverrideError:
        return None
    for name, value in zip(sig.names, values, strict=True):
        if any(leaf is t for leaf in pytree.tree_leaves(value)):
            return op._labels.get(name, name) or None
    return None


def _describe(t: Tensor, op: CustomBackward[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> str:
    """Where a captured tensor comes from, as far as the forward's code tells."""
    fn = getattr(op, "__wrapped__", None)
    code = getattr(fn, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):  # type: ignore[union-attr]
            try:
                if cell.cell_contents is t:
                    return f"`{name}` (a variable of an enclosing function)"
            except ValueError:  # an empty cell
                continue
        namespace = getattr(fn, "__globals__", {})
        for name in code.co_names:
            if namespace.get(name) is t:
                return f"`{name}` (a global)"
    sig = op._signature
    try:
        values = sig.bind(args, kwargs)
    except GradOverrideError:
        values = ()
    for name, value in zip(sig.names, values, strict=False):
        if isinstance(value, nn.Module):
            for pname, p in value.named_parameters():
                if p is t:
                    return f"`{name}.{pname}` (a parameter of the module passed as `{name}`)"
        else:
            for attr, item in getattr(value, "__dict__", {}).items():
                if item is t:
                    return f"`{name}.{attr}`"
    return f"a tensor of shape {tuple(t.shape)}, dtype {t.dtype}"


def _captured_message(op: CustomBackward[..., Any], t: Tensor, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> str:
    name = op._name
    return (
        f"the forward of `{name}` reads {_describe(t, op, args, kwargs)}, which requires grad "
        f"but is not one of its inputs; its gradient would be silently lost, because the "
        f"rule of `{name}` gives the gradients of the inputs only (the forward runs where "
        "autograd records nothing). Pass it as an argument (the rule then returns its "
        "gradient, or None), use `go.Module` for a module's parameters, register the rule "
        "with `owns=` naming the inputs it owns (the rest, captured tensors included, keep "
        "their autograd gradient), or `.detach()` it if it should get no gradient."
    )


def _inplace_message(op: CustomBackward[..., Any], t: Tensor, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> str:
    name = op._name
    slot = _slot_of(op, t, args, kwargs)
    which = f"its input `{slot}`" if slot is not None else "one of its tensor inputs"
    if t.is_leaf:
        return (
            f"the forward of `{name}` changed {which} in place after reading it (its "
            "version counter moved during the call): the rule would read the changed value, "
            "not the one the forward used. Change it before the forward reads it (a "
            "constraint such as `w.clamp_(min=0)` first), or outside the forward, after "
            "the optimizer step."
        )
    return (
        f"the forward of `{name}` changed {which} in place (its version counter moved "
        "during the call): the rule would read the changed value, and autograd would not "
        "see the caller's tensor change. Change it out of place (`x = x.relu()` instead of "
        "`x.relu_()`, or `x = x.clone()` first); for a module built with `inplace=True`, "
        "build it with `inplace=False`."
    )
