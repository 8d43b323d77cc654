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

__all__ = ["passthrough"]


def passthrough(x: Tensor) -> Tensor:
    """`x`'s value as a new Function output that may be changed in place afterwards."""
    # `x._base`, not `x._is_view()`: dynamo traces the attribute, not the method.
    if x._base is not None or (x.is_leaf and x.requires_grad):
        return x.view_as(x)
    return x.detach()
