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

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ._errors import GradOverrideError

if TYPE_CHECKING:
    from ._decorators import CustomBackward

__all__ = ["arm_all", "audit_call", "audited", "register"]

# Calls whose result carries no gradient of their tensor arguments, so reading a captured
# tensor through them loses nothing: metadata (`.shape` and other property reads, `size()`)
# and explicit detaching.
_NO_GRADIENT_NAMES = frozenset(
    {"__get__", "detach", "detach_", "size", "dim", "numel", "stride", "data_ptr",
     "is_floating_point", "is_complex", "is_contiguous", "element_size", "storage_offset",
     "item", "tolist", "__len__", "__bool__", "__repr__", "__format__", "requires_grad_"}
)


class _ForwardAudit(TorchFunctionMode):
    """Records the tensors a forward reads that require grad but are neither its inputs nor
    made inside it. Inside an owning Function's forward grad mode is off, which is how a
    read from the forward is told apart from the op's own bookkeeping."""

    def __init__(self, inputs: set[int]) -> None:
        super().__init__()
        self.known = inputs
        self.captured: list[Tensor] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if (
            not torch.is_grad_enabled()
            and getattr(func, "__name__", "") not in _NO_GRADIENT_NAMES
            and _carries_gradient(result)
        ):
            for leaf in pytree.tree_leaves((args, kwargs)):
                if (
                    isinstance(leaf, Tensor)
                    and leaf.requires_grad
                    and id(leaf) not in self.known
                    and not any(leaf is c for c in self.captured)
                ):
                    self.captured.append(leaf)
        for leaf in pytree.tree_leaves(result):
            if isinstance(leaf, Tensor):
                self.known.add(id(leaf))
        return result


def _carries_gradient(result: Any) -> bool:
    """Whether a call's result holds a floating or complex tensor (one a gradient flows to)."""
    return any(
        isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.is_complex())
        for leaf in pytree.tree_leaves(result)
    )


def audit_call(op: CustomBackward[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run `op(*args, **kwargs)` and check it for captured tensors and in-place changes."""
    leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)]
    versions = [leaf._version for leaf in leaves]
    run = op._run
    assert run is not None
    rule = op._rule
    assert rule is not None
    if not rule.owns_all:
        # The forward runs on the ordinary graph: a captured tensor gets its autograd
        # gradient there, so only in-place changes are checked.
        result = run(op, *args, **kwargs)
    else:
        audit = _ForwardAudit({id(leaf) for leaf in leaves})
        with audit:
            result = run(op, *args, **kwargs)
        if audit.captured:
            raise GradOverrideError(_captured_message(op, audit.captured[0], args, kwargs))
    if not op._tracks_inplace:
        for leaf, version in zip(leaves, versions, strict=True):
            if leaf._version != version and _matters(op, leaf, args, kwargs):
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
            return name
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
    return (
        f"the forward of `{name}` changed {which} in place (its version counter moved "
        "during the call): the rule would read the changed value, and autograd would not "
        "see the caller's tensor change. Change it out of place (`x = x.relu()` instead of "
        "`x.relu_()`, or `x = x.clone()` first); for a module built with `inplace=True`, "
        "build it with `inplace=False`."
    )


# ---- which ops check their next call --------------------------------------------------------

_OPS: weakref.WeakSet[CustomBackward[..., Any]] = weakref.WeakSet()


def register(op: CustomBackward[..., Any]) -> None:
    """Remember `op`, so `arm_all` can make it check its next call."""
    _OPS.add(op)


def arm_all() -> None:
    """Make every op check its next eager call (what the testing tools do before each run)."""
    for op in list(_OPS):
        op._arm_audit()


@contextmanager
def audited() -> Iterator[None]:
    """Within the block, every op's next eager call is checked."""
    arm_all()
    yield
