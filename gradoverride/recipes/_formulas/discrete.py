"""The discrete-choice recipes' formulas (`ste_argmax`, `gumbel_softmax`), written once over
a backend `b`: the one-hot of the first maximum, the tempered softmax and its backward, and
Gumbel noise from uniform draws."""

from __future__ import annotations

from typing import Any

__all__ = [
    "gumbel_from_uniform",
    "one_hot_argmax",
    "softmax_grad",
    "tempered_softmax",
]


def one_hot_argmax(b: Any, scores: Any, dim: int, dtype: Any) -> Any:
    """1 at the first maximum of `scores` along `dim` (ties go to the first index, as
    `torch.argmax`), 0 elsewhere, in `dtype`; by comparing each position with the index
    (torch's `scatter_` has no `vmap` rule). A 0-d score is its own maximum."""
    if b.static_shape(scores) == ():
        return b.ones_like(scores, dtype)
    index = b.argmax(scores, dim)
    return b.cast(b.positions(scores, dim) == index, dtype)


def tempered_softmax(b: Any, scores: Any, dim: int, temperature: float,
                     temporary: bool = False) -> Any:
    """softmax(scores / T, dim), the scores shifted so their largest is 0 before dividing by
    T: a tiny T or large scores then give -inf and 0, never inf - inf. `temporary`: the
    scores are the caller's own (torch reuses them)."""
    shifted = b.difference(scores, b.amax_along(scores, dim), temporary=temporary)
    if temperature != 1:
        shifted = b.true_divide(shifted, temperature, temporary=temporary)
    return b.softmax(shifted, dim)


def softmax_grad(b: Any, grad: Any, soft: Any, dim: int, temperature: float) -> Any:
    """d/dz of softmax(z / T) applied to `grad`: soft * (grad - sum(grad * soft)) / T, in
    soft's dtype. Multiplied before dividing by T, so a one-hot `soft` at a tiny T gives 0,
    not 0 * inf."""
    out = b.softmax_backward(b.cast(grad, b.dtype(soft)), soft, dim)
    return out if temperature == 1 else b.divide_by_number(out, temperature)


def gumbel_from_uniform(b: Any, u: Any) -> Any:
    """Standard Gumbel samples -log(-log(u)) from uniform draws u in (0, 1), always finite:
    u clamped to [tiny, 1 - eps/2] of its dtype."""
    info = b.finfo(b.dtype(u))
    u = b.clamp(u, info.tiny, 1 - info.eps / 2)
    return -b.log(-b.log(u))
