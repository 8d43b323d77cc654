"""`transformed(x, fn)`: `x`'s value, with `fn` applied to the gradient flowing back into `x`.

The identity op under `grad_hook`: unlike a view with a tensor hook, its output may be changed
in place by the module it feeds (the hook on a view is lost when the view is changed in
place), and it works under `torch.func` transforms, where tensor hooks do not.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ._decorators import custom_backward
from ._passthrough import passthrough

__all__ = ["transformed"]


@custom_backward
def transformed(x: Tensor, fn: Callable[[Tensor], Tensor | None]) -> Tensor:
    """`x`'s value; its gradient is `fn(grad)` (`grad` itself where `fn` returns None)."""
    return passthrough(x)


@transformed.backward
def _(grad: Tensor, *, fn: Callable[[Tensor], Tensor | None]) -> tuple[Tensor, None]:
    out = fn(grad)
    return (grad if out is None else out), None
