"""The backward of `go.straight_through` on another framework's arrays, written once.

TensorFlow (`tf`) and JAX (`jax.numpy`) name the four array functions it needs as numpy
does (`where`, `zeros_like`, `logical_and`, `logical_not`), so each backend passes its
module as `xp` (the array-API convention) and its own surrogate derivative (a
`tf.GradientTape`, a `jax.vjp`): the window, the mask and the order of the steps are one
formula, the one the torch rule computes. (Torch's own rule stays in
`gradoverride/_straight_through.py`: a fused `hardtanh_backward` kernel and `torch.func.vjp`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["ArrayModule", "gradient", "window_mask"]


class ArrayModule(Protocol):
    """What the formula calls on a backend's array module."""

    def where(self, condition: Any, x: Any, y: Any, /) -> Any: ...

    def zeros_like(self, x: Any, /) -> Any: ...

    def logical_and(self, x: Any, y: Any, /) -> Any: ...

    def logical_not(self, x: Any, /) -> Any: ...


def _inside(xp: ArrayModule, x: Any, low: float, high: float, inclusive: tuple[bool, bool]
            ) -> Any:
    """Where `x` is inside the window from `low` to `high`, each end included or not."""
    above = x >= low if inclusive[0] else x > low
    below = x <= high if inclusive[1] else x < high
    return xp.logical_and(above, below)


def window_mask(xp: ArrayModule, x: Any, low: float, high: float,
                inclusive: tuple[bool, bool]) -> Any:
    """Where `x` is outside the window (a bool array, one byte per element)."""
    return xp.logical_not(_inside(xp, x, low, high, inclusive))


def gradient(
    xp: ArrayModule,
    surrogate_gradient: Callable[[Any, Any, Callable[..., Any], str], Any],
    upstream: Any,
    saved: dict[str, Any],
    *,
    first: str,
    window: tuple[float, float] | None,
    inclusive: tuple[bool, bool],
    surrogate: Callable[..., Any] | None,
    derivative: Callable[..., Any] | None,
    op: str,
) -> Any:
    """The gradient for the forward's first argument, as the torch rule computes it;
    `surrogate_gradient(upstream, x, surrogate, op)` is the backend's vector-Jacobian
    product of the surrogate."""
    if "mask" in saved:  # keep="mask": the forward stored where the input is outside
        return xp.where(saved["mask"], xp.zeros_like(upstream), upstream)
    if surrogate is None and derivative is None and window is None:
        return upstream
    x = saved[first]
    if surrogate is not None:
        grad = surrogate_gradient(upstream, x, surrogate, op)
    elif derivative is not None:
        grad = upstream * derivative(x)
    else:
        grad = upstream
    if window is None:
        return grad
    return xp.where(_inside(xp, x, *window, inclusive), grad, xp.zeros_like(grad))
