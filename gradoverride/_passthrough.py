"""What the Functions gradoverride generates return, so that in-place ops and views stay right.

PyTorch forbids an in-place op on a view made inside a custom Function ("Output 0 of ... is a
view and is being modified inplace"), because its view replay would bypass the custom
backward. A tensor that shares memory with a user's tensor without being a view (`detach()`)
would let the in-place op through, but then the user's tensor changes behind autograd's back:
its later uses get the gradient of the value it had before. So:

* an identity forward on a tensor the caller holds (`passthrough`: gradient transforms,
  `grad_hook` at inputs) returns a view, as PyTorch's own identity ops do, and an in-place
  op right after is PyTorch's usual error; or, with `fresh=True` (the recipes' module forms,
  made for `nn.Sequential` blocks such as `Linear -> reverse_grad().module() ->
  ReLU(inplace=True)`), a copy, which an in-place op may change freely;
* a result the forward made itself (`as_output`) is returned so that an in-place op may
  follow, except where it shows one of the inputs or another output (those stay views).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["AUDITS", "as_output", "passthrough", "related", "shows_input"]

#: The first-call checks in progress (innermost last; see `_audit`): `as_output` reports the
#: aliases it makes, so the check follows what a result is computed from through them.
AUDITS: list[Any] = []


def passthrough(x: Tensor, fresh: bool = False) -> Tensor:
    """`x`'s value as an identity forward's output: a view of `x`, or (`fresh`) a copy."""
    return x.clone() if fresh else x.view_as(x)


def shows_input(t: Tensor, inputs: tuple[object, ...]) -> bool:
    """Whether `t` is one of `inputs` or a view sharing a base with one of them."""
    base = t._base
    for item in inputs:
        if item is t:
            return True
        if base is not None and isinstance(item, Tensor) and (base is item or base is item._base):
            return True
    return False


def as_output(
    t: object,
    inputs: tuple[object, ...],
    dirty: tuple[int, ...] = (),
    outputs: tuple[object, ...] = (),
) -> object:
    """What a Function whose forward ran inside it (the rule owning every input) returns for
    the forward's result `t`, given the Function's inputs.

    * an input returned as-is becomes a view of it: PyTorch treats it as one anyway, but the
      `setup_context` form (`torch.func`, `torch.compile`) refuses to save it otherwise; an
      input changed in place (`dirty`, by index) is returned as itself, for `mark_dirty`;
    * a view of something made inside the forward (`(x * 2).view(-1)`) becomes a plain
      tensor sharing its memory (nothing else can see its base), so an in-place op may
      follow; a view of an input, or one sharing its base with another of the `outputs`
      (`return y, y[0]`), stays a view, and changing it in place stays an error.
    """
    if not isinstance(t, Tensor):
        return t
    for i, item in enumerate(inputs):
        if item is t:
            return t if i in dirty else t.view_as(t)
    if t._base is not None and not shows_input(t, inputs) and not _shares_base(t, outputs):
        alias = t.detach()
        if AUDITS:
            AUDITS[-1].alias(t, alias)
        return alias
    return t


def _shares_base(t: Tensor, outputs: tuple[object, ...]) -> bool:
    """Whether `t` and another of the `outputs` share memory through a view."""
    return any(isinstance(o, Tensor) and o is not t and related(t, o) for o in outputs)


def related(a: Tensor, b: Tensor) -> bool:
    """Whether `a` and `b` are one tensor, or one is a view of the other, or both views of one
    base: what an in-place op on either changes in the other."""
    if a is b:
        return True
    base_a, base_b = a._base, b._base
    return base_a is b or base_b is a or (base_a is not None and base_a is base_b)
