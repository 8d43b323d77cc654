"""The output of a forward that passes its input through unchanged (an identity forward).

Gradient transforms (reversal, scaling, clipping), `grad_hook`, and the partial-override form of
`custom_backward` are all `autograd.Function`s whose forward returns its input's value. Returned
as a view (`x.view_as(x)`), such an output may not be changed in place afterwards: PyTorch
forbids an in-place op on a view made inside a custom Function ("Output 0 of ... is a view and
is being modified inplace"), because its view replay would bypass the custom backward. So the
common block `Linear -> reverse_grad -> ReLU(inplace=True)` would fail.

`passthrough(x)` returns a tensor that shares `x`'s memory and version counter but is not an
autograd view (`x.detach()`): an in-place op on it is recorded on the Function's output, and the
gradient still flows through the Function's backward. A view is kept where PyTorch's view
tracking matters: for an `x` that is a leaf requiring grad (a parameter: changing its memory in
place must stay an error) and for an `x` that is itself a view (its base must see the change).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["as_output", "passthrough", "shows_input"]


def passthrough(x: Tensor) -> Tensor:
    """`x`'s value as a new Function output that may be changed in place afterwards."""
    # `x._base`, not `x._is_view()`: dynamo traces the attribute, not the method.
    if x._base is not None or (x.is_leaf and x.requires_grad):
        return x.view_as(x)
    return x.detach()


def shows_input(t: Tensor, inputs: tuple[object, ...]) -> bool:
    """Whether `t` is one of `inputs` or a view sharing a base with one of them."""
    base = t._base
    for item in inputs:
        if item is t:
            return True
        if base is not None and isinstance(item, Tensor) and (base is item or base is item._base):
            return True
    return False


def as_output(t: object, inputs: tuple[object, ...], dirty: tuple[int, ...] = ()) -> object:
    """What a Function whose forward ran inside it (the rule owning every input) returns for
    the forward's result `t`, given the Function's inputs.

    * an input returned as-is becomes a view of it: PyTorch treats it as one anyway, but the
      `setup_context` form (`torch.func`, `torch.compile`) refuses to save it otherwise; an
      input changed in place (`dirty`, by index) is returned as itself, for `mark_dirty`;
    * a view of something made inside the forward (`(x * 2).view(-1)`) becomes a plain
      tensor sharing its memory (nothing else can see its base), so an in-place op may
      follow; a view of an input stays a view, and changing it in place stays an error.
    """
    if not isinstance(t, Tensor):
        return t
    for i, item in enumerate(inputs):
        if item is t:
            return t if i in dirty else t.view_as(t)
    if t._base is not None and not shows_input(t, inputs):
        return t.detach()
    return t
