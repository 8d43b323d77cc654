"""The identity ops under `grad_hook`: a tensor's value, with a transform applied to the
gradient flowing back into it.

* `transformed(x, fn)`: a view of `x` (an in-place op on it is PyTorch's error for views made
  in a Function, where a tensor hook on a view would be lost silently);
* `transformed_private(x, fn)`: a tensor sharing `x`'s memory without being a view, which an
  in-place op may change: only for an `x` nobody else holds (a copy `grad_hook` made);
* `transformed_all(fn, keep_view, *xs)`: several tensors through one Function, each output's
  gradient transformed once (a module's outputs may alias or derive from one another, where
  tensor hooks would transform a gradient twice); output `k` is a view of its input where
  `keep_view[k]`, else a tensor sharing its memory.

They work under `torch.compile` and `torch.func` transforms, where tensor hooks do not run as
in eager mode.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ._decorators import custom_backward
from ._passthrough import passthrough

__all__ = ["transformed", "transformed_all", "transformed_private"]

Transform = Callable[[Tensor], "Tensor | None"]


def _apply(fn: Transform, grad: Tensor) -> Tensor:
    out = fn(grad)
    return grad if out is None else out


def _rule(grad: Tensor, *, fn: Transform) -> tuple[Tensor, None]:
    return _apply(fn, grad), None


@custom_backward(backward=_rule)
def transformed(x: Tensor, fn: Transform) -> Tensor:
    """A view of `x`; its gradient is `fn(grad)` (`grad` itself where `fn` returns None)."""
    return passthrough(x)


@custom_backward(backward=_rule)
def transformed_private(x: Tensor, fn: Transform) -> Tensor:
    """`x`'s memory as a new tensor (not a view); its gradient is `fn(grad)`."""
    return x.detach()


@custom_backward(materialize_grads=False)
def transformed_all(fn: Transform, keep_view: tuple[bool, ...], *xs: Tensor) -> tuple[Tensor, ...]:
    """Each of `xs` passed through; each output's gradient is `fn(grad)`."""
    pairs = zip(xs, keep_view, strict=True)
    return tuple(x.view_as(x) if keep else x.detach() for x, keep in pairs)


@transformed_all.backward
def _(*grads: Tensor | None, fn: Transform) -> dict[str, object]:
    return {"xs": tuple(None if g is None else _apply(fn, g) for g in grads)}
