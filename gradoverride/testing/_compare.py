"""Comparing one gradient with another: tolerances by dtype, and the numbers a report shows.

Default tolerances are those of `torch.testing.assert_close`, by the dtype of the input the
gradient belongs to: an element passes when `|got - expected| <= atol + rtol * |expected|`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Difference", "compare", "describe_dtype", "format_index", "tolerances"]

# (rtol, atol), as torch.testing.assert_close chooses them.
_DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def tolerances(
    dtype: torch.dtype,
    rtol: float | None,
    atol: float | None,
    *,
    at_least: tuple[float, float] = (0.0, 0.0),
) -> tuple[float, float]:
    """`(rtol, atol)`: the given ones, else `torch.testing`'s defaults for `dtype`, raised
    to `at_least` (finite differences are only so accurate)."""
    default_rtol, default_atol = _DEFAULT_TOLERANCES.get(dtype, (1e-7, 1e-7))
    return (
        max(default_rtol, at_least[0]) if rtol is None else rtol,
        max(default_atol, at_least[1]) if atol is None else atol,
    )


@dataclass(frozen=True)
class Difference:
    """How far a gradient is from the one it is compared with.

    `max_rel` is the largest `|got - expected| / |expected|` (infinite where the expected
    value is 0 and the gradient is not); equal values, infinities and NaNs included, differ
    by 0. `cosine` is the cosine similarity of the two, flattened, over the places where
    both are finite (1 when both are zero there, 0 when only one is). `worst` is the index of the
    element furthest outside the tolerance (or of the largest difference, when all pass),
    with the two values there.
    """

    max_abs: float
    max_rel: float
    cosine: float
    close: bool
    worst: tuple[int, ...]
    got: float
    expected: float


def _unravel(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    index: list[int] = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))


def compare(got: Tensor, expected: Tensor, rtol: float, atol: float) -> Difference:
    """Compare two gradients of the same shape (in float64, on their device)."""
    g = got.detach().to(torch.float64)
    e = expected.detach().to(device=g.device, dtype=torch.float64)
    if g.numel() == 0:
        return Difference(0.0, 0.0, 1.0, True, (), 0.0, 0.0)
    both_nan = g.isnan() & e.isnan()
    # Equal infinities (both gradients infinite at the same place, with allow_nonfinite)
    # count as equal, so the row reads a difference of the finite values, not `inf`.
    same = (g == e) | both_nan
    diff = (g - e).abs()
    diff = torch.where(same, 0.0, torch.where(diff.isnan(), math.inf, diff))
    rel = torch.where(diff == 0, 0.0, diff / e.abs())
    rel = torch.where(rel.isnan(), math.inf, rel)
    if math.isinf(atol):
        # An infinite tolerance accepts anything (a direction-only check with min_cosine);
        # torch.isclose would compute inf * 0 = NaN where the expected value is 0.
        within = torch.ones_like(same)
    elif math.isinf(rtol):
        within = same | (e != 0) | (diff <= atol)
    else:
        within = torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
    close = bool(within.all())
    score = diff if close else torch.where(within, -1.0, diff)
    flat = int(score.flatten().argmax())
    worst = _unravel(flat, g.shape)
    # The direction over the places where both are finite (an infinity has none).
    finite = g.isfinite() & e.isfinite()
    g, e = torch.where(finite, g, 0.0), torch.where(finite, e, 0.0)
    g_norm = float(torch.linalg.vector_norm(g))
    e_norm = float(torch.linalg.vector_norm(e))
    if g_norm == 0 and e_norm == 0:
        cosine = 1.0
    elif g_norm == 0 or e_norm == 0:
        cosine = 0.0
    else:
        cosine = float((g.flatten() @ e.flatten()) / (g_norm * e_norm))
    return Difference(
        max_abs=float(diff.max()),
        max_rel=float(rel.max()),
        cosine=cosine,
        close=close,
        worst=worst,
        got=float(got.detach().flatten()[flat]),
        expected=float(expected.detach().flatten()[flat]),
    )


def format_index(index: tuple[int, ...]) -> str:
    """` at index (3, 1)` for an element of a tensor with dimensions; empty for a 0-d one."""
    return f" at index {index}" if index else ""


def describe_dtype(dtype: torch.dtype) -> str:
    """`float32` for `torch.float32`."""
    return str(dtype).removeprefix("torch.")


def difference_problems(difference: Difference, description: str, atol: float, rtol: float,
                        min_cosine: float | None) -> list[str]:
    """A report row's problems from comparing a gradient with `description` (the proxy,
    finite differences, the given gradient): the same texts for every framework."""
    problems: list[str] = []
    if not difference.close:
        problems.append(
            f"it differs from {description}: the largest difference is "
            f"{difference.max_abs:.3g}{format_index(difference.worst)} (got "
            f"{difference.got:.6g}, expected {difference.expected:.6g}), over "
            f"atol={atol:g} + rtol={rtol:g} * |expected|; max relative difference "
            f"{difference.max_rel:.3g}, cosine similarity {difference.cosine:.6f}."
        )
    if min_cosine is not None and difference.cosine < min_cosine:
        problems.append(
            f"its cosine similarity with {description} is {difference.cosine:.6f}, "
            f"below min_cosine={min_cosine:g}."
        )
    return problems
