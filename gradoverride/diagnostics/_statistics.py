"""Reducing each override's gradients of one backward pass to the numbers `go.monitor`
keeps: sums of squares, nonzero counts (for the zeroed fraction), NaN/inf counts.

This runs at every recorded step, so it is built for few calls and few passes over memory:

* the gradients of an override called many times in a step (a spiking neuron at each time
  step) are stacked into one tensor per side;
* on a CPU (float64, and float32 below `_EXACT_FLOAT32` elements, whose larger sums are
  taken in float64 by torch), numpy reduces them on the same memory: each sum of
  squares is a dot product (BLAS, at memory speed, more precise than a float32 norm), and
  each count the count of a boolean mask (vectorized comparisons; counting a float array's
  nonzeros branches on each element, several times slower for gradients with many zeros).
  A call into numpy costs a fraction of a torch kernel's launch, and a recorded step of a
  small model spends most on launches: in a training step, each of a dozen launches per
  override costs several times what it does in a loop of its own;
* elsewhere (an accelerator, other dtypes, large float32 gradients) torch does the same
  with dot products, a count being the dot product of signs with themselves; the results
  of all overrides of the pass are read back once;
* on a CPU, large temporaries (the masks, the stacked calls) go to buffers kept for the
  monitor's lifetime: a fresh one would be faulted in page by page, which costs more than
  the arithmetic. On an accelerator the caching allocator already reuses memory.

A compiled (fused) reduction is not used: on a CPU, a `torch.compile`d reduction of one
override's gradients costs more per call than these few calls, after seconds of
compilation at the first recorded step.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from ._recorder import Gradients

__all__ = ["FIELDS", "GradientStatistics"]

#: The numbers kept per (override, step), in order.
FIELDS = ("calls", "in_sq", "out_sq", "zeroed", "paired", "nan_in", "inf_in", "nan_out",
          "inf_out")

# From this many elements, float32 gradients are reduced in float64: below it, a count read
# as a float32 dot product of signs is exact once rounded, and a float32 sum of squares
# keeps six digits; above it, 2**26 elements lost 3e-4 of their sum.
_EXACT_FLOAT32 = 2**22
# Below this float32 sum of squares, some elements' squares may have been denormal or zero
# (float32's smallest normal number is about 1.2e-38): such a sum is taken again in float64.
# From here up, what underflowed is below 2**-60 of the sum for any realistic element count.
_UNDERFLOW_FLOAT32 = 2.0**-60
# From this many elements, a CPU temporary goes to a kept buffer.
_SCRATCH_FROM = 2**14

K = TypeVar("K", bound=Hashable)

# The dtypes `_on_cpu` reduces with numpy (its float32 and float64 dot products are BLAS's).
_NUMPY_DTYPES = frozenset({torch.float32, torch.float64})


class GradientStatistics:
    """`statistics(groups)`: the `FIELDS` numbers of each group of gradients."""

    def __init__(self) -> None:
        self._scratch: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}
        self._buffers: tuple[Any, Any] | None = None  # (numpy's, see `_masks`)
        self._kept_masks: tuple[int, Any, Any] | None = None

    def release(self) -> None:
        self._scratch = {}
        self._buffers = self._kept_masks = None

    def __call__(self, groups: dict[K, Gradients]) -> dict[K, list[float]]:
        if not torch.is_grad_enabled():
            return self._reduce(groups)  # (what a pass's end runs in, but create_graph)
        # (Gradients of a pass run with create_graph=True have a graph of their own: the
        # reduction records none, and writes into buffers, which autograd refuses.)
        with torch.no_grad():
            return self._reduce(groups)

    # (numpy's dot products overflow to infinity for gradients past 1e19, read as such, see
    # `_on_cpu`, and underflow for vanishing ones, taken again in float64, see
    # `_unless_underflowed`: neither is warned of, nor raised under a user's
    # `np.seterr(all="raise")`. `errstate` as a decorator: one Python call a reduction, where
    # the `with` form makes three.)
    @np.errstate(all="ignore")
    def _reduce(self, groups: dict[K, Gradients]) -> dict[K, list[float]]:
        results: dict[K, list[float]] = {}
        aligned: list[tuple[K, Tensor, Tensor]] = []
        for key, given in groups.items():
            tried = given.aligned and len(given.arriving) == 1
            if tried:
                # One call (most overrides of a step): numpy reads its two gradients as
                # they are, where it can (complex and sparse ones it refuses).
                numbers = self._on_cpu(given.arriving[0], given.returned[0])
                if numbers is not None:
                    results[key] = [float(given.calls), *numbers]
                    continue
            grads = _plain(given)
            if grads.aligned and grads.arriving:
                got = self._stack("got", grads.arriving, len(aligned))
                gave = self._stack("gave", grads.returned, len(aligned))
                # (not again for the same two tensors)
                numbers = None if tried and grads is given else self._on_cpu(got, gave)
                if numbers is None:
                    aligned.append((key, *_common(got, gave)))
                else:
                    results[key] = [float(grads.calls), *numbers]
            else:
                results[key] = [float(grads.calls), *_general(grads)]
        if aligned:
            for (key, _, _), values in zip(aligned, self._aligned(aligned), strict=True):
                results[key] = [float(groups[key].calls), *values]
        return results

    def _aligned(self, groups: list[tuple[K, Tensor, Tensor]]) -> list[list[float]]:
        """Each call: one gradient in, one of its shape out (flattened, one dtype)."""
        dots: list[Tensor] = []
        for k, (_, got, gave) in enumerate(groups):
            # Sums of squares and counts as dot products (one BLAS call each, a few
            # microseconds on a CPU, and more precise than a float32 norm: the BLAS keeps
            # several partial sums). A count is the dot product of signs with themselves.
            signs = torch.sign(got, out=self._temporary("signs", k, got))
            # The nonzero elements of got * gave: where neither is zero. Their count
            # subtracted from got's is what the override zeroed. The product of the signs,
            # not of the values: two float32 gradients of 1e-23 multiply to an exact zero.
            both = torch.sign(gave, out=self._temporary("both", k, gave)).mul_(signs)
            dots += [torch.dot(got, got), torch.dot(gave, gave), torch.dot(signs, signs),
                     torch.dot(both, both)]
        values = torch.stack(dots).tolist()  # one read back for every group
        out = []
        for k, (_, got, gave) in enumerate(groups):
            in_sq, out_sq, nonzero, kept = values[4 * k: 4 * k + 4]
            if math.isfinite(in_sq) and math.isfinite(out_sq):
                out.append(_finite(in_sq, out_sq, round(nonzero), round(kept), got, gave))
            else:
                # NaN or infinity in them: the general reduction, which counts them.
                out.append(_general(Gradients(arriving=[got], returned=[gave],
                                              pairs=[(gave, got)])))
        return out

    def _on_cpu(self, got: Tensor, gave: Tensor) -> list[float] | None:
        """`_aligned`'s numbers of one group on a CPU, by numpy on the same memory (see
        the module docstring). None, for `_aligned` to take: off a CPU; where numpy cannot
        read the tensors (another dtype, a tensor subclass, a gradient with a graph); for
        float32 ones of `_EXACT_FLOAT32` elements or more (whose float32 sums of squares
        would lose digits: `_aligned` takes them in float64); or where a sum of squares is
        not finite (NaN or infinity in them, or squares past float32's range, not warned
        of, see `_reduce`: the general reduction counts them, in float64)."""
        dtype = got.dtype
        if not got.is_cpu or dtype not in _NUMPY_DTYPES or gave.dtype != dtype:
            return None
        try:
            a = got.numpy()
            b = gave.numpy()
        except (RuntimeError, TypeError):
            return None  # (sparse, on another device, or a gradient with a graph)
        if dtype == torch.float32 and a.size >= _EXACT_FLOAT32:
            return None
        a = a.reshape(-1)
        b = b.reshape(-1)
        in_sq = float(np.dot(a, a))
        out_sq = float(np.dot(b, b))
        if not (math.isfinite(in_sq) and math.isfinite(out_sq)):
            return None
        # Nonzero masks, counted (comparisons and counts of booleans are vectorized in
        # numpy, where counting a float array's nonzeros branches on each element); where
        # both are nonzero, a mask, not the product: two float32 gradients of 1e-23
        # multiply to an exact zero. Into kept buffers (see `_masks`).
        size = a.size
        masks = self._kept_masks
        if masks is None or masks[0] != size:
            masks = self._masks(size)
        _, nonzero_a, nonzero_b = masks
        np.not_equal(a, 0, out=nonzero_a)
        np.not_equal(b, 0, out=nonzero_b)
        nonzero = int(np.count_nonzero(nonzero_a))
        kept = int(np.count_nonzero(np.logical_and(nonzero_a, nonzero_b, out=nonzero_b)))
        return _finite(in_sq, out_sq, nonzero, kept, got, gave)

    def _masks(self, size: int) -> tuple[int, Any, Any]:
        """Two boolean numpy arrays of `size` elements, views of buffers kept (one pair, of
        the largest size met), with `size`: kept as they are while the next gradients
        have that size too (most recorded steps: no view made again)."""
        buffers = self._buffers
        if buffers is None or buffers[0].size < size:
            buffers = self._buffers = (np.empty(size, dtype=np.bool_),
                                       np.empty(size, dtype=np.bool_))
        masks = self._kept_masks = (size, buffers[0][:size], buffers[1][:size])
        return masks

    def _temporary(self, name: str, k: int, like: Tensor) -> Tensor:
        """A tensor of `like`'s size (flat) to write into: a kept buffer on a CPU from
        `_SCRATCH_FROM` elements, else a new one."""
        if like.device.type != "cpu" or like.numel() < _SCRATCH_FROM:
            return torch.empty_like(like)
        return self._scratch_for(f"{name}{k}", like.numel(), like)

    def _stack(self, name: str, tensors: list[Tensor], k: int) -> Tensor:
        if len(tensors) == 1:
            return tensors[0]
        first = tensors[0]
        if first.device.type != "cpu" or first.numel() * len(tensors) < _SCRATCH_FROM:
            return torch.stack(tensors)
        out = self._scratch_for(f"{name}{k}", first.numel() * len(tensors), first)
        return torch.stack(tensors, out=out.view(len(tensors), *first.shape))

    def _scratch_for(self, name: str, numel: int, like: Tensor) -> Tensor:
        key = (name, like.dtype, like.device)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch[key] = torch.empty(numel, dtype=like.dtype,
                                                      device=like.device)
        return buffer[:numel]


def _plain(grads: Gradients) -> Gradients:
    """`grads` with complex gradients as their elements' magnitudes (the same sums of
    squares, zeros, NaN and infinities) and sparse ones as their stored values (the same
    sums of squares; a pair is compared where both store the same elements, else dense)."""
    # (loops, not `any(map(...))`: no Python call per tensor at each recorded step)
    for tensors in (grads.arriving, grads.returned):
        for t in tensors:
            if t.layout != torch.strided or t.is_complex():
                return _plain_values(grads)
    return grads


def _plain_values(grads: Gradients) -> Gradients:
    """`_plain` of gradients some of which are complex or sparse."""
    pairs = [_stored_pair(gave, got) for gave, got in grads.pairs]
    sparse = any(t.layout != torch.strided for t in (*grads.arriving, *grads.returned))
    return Gradients(
        calls=grads.calls,
        arriving=[_values(t) for t in grads.arriving],
        returned=[_values(t) for t in grads.returned],
        pairs=pairs,
        aligned=grads.aligned and not sparse,
    )


def _values(t: Tensor) -> Tensor:
    """A sparse tensor's stored values (summed where an index repeats); a complex tensor's
    magnitudes."""
    if t.layout == torch.sparse_coo:
        t = t.coalesce().values()
    elif t.layout != torch.strided:
        t = t.values()
    return t.abs() if t.is_complex() else t


def _stored_pair(gave: Tensor, got: Tensor) -> tuple[Tensor, Tensor]:
    """A (returned, arriving) pair as plain tensors compared element by element: the stored
    values of two sparse tensors storing the same elements, else both dense."""
    if gave.layout == got.layout == torch.sparse_coo:
        gave, got = gave.coalesce(), got.coalesce()
        if torch.equal(gave.indices(), got.indices()):
            return _values(gave), _values(got)
    if gave.layout != torch.strided:
        gave = gave.to_dense()
    if got.layout != torch.strided:
        got = got.to_dense()
    return _values(gave), _values(got)


def _common(got: Tensor, gave: Tensor) -> tuple[Tensor, Tensor]:
    """`got` and `gave` flattened, in one dtype that keeps sums of squares and counts exact
    (float32, or float64 for other dtypes and from `_EXACT_FLOAT32` elements)."""
    got, gave = got.reshape(-1), gave.reshape(-1)
    if got.dtype not in (torch.float32, torch.float64) or (
        got.dtype == torch.float32 and got.numel() >= _EXACT_FLOAT32
    ):
        got = got.double()
    if gave.dtype != got.dtype:
        gave = gave.to(got.dtype)
    return got, gave


def _general(grads: Gradients) -> list[float]:
    """Any other override (several outputs, a module's parameters, shapes that change)."""
    in_sq, nan_in, inf_in = _sum_squares(grads.arriving)
    out_sq, nan_out, inf_out = _sum_squares(grads.returned)
    zeroed = paired = 0
    for gave, got in grads.pairs:
        paired += int(torch.count_nonzero(got))
        zeroed += int(((gave == 0) & (got != 0)).sum())
    return [in_sq, out_sq, float(zeroed), float(paired), float(nan_in), float(inf_in),
            float(nan_out), float(inf_out)]


def _finite(in_sq: float, out_sq: float, nonzero: int, kept: int, got: Tensor,
            gave: Tensor) -> list[float]:
    """The numbers after `calls` of an aligned group whose sums of squares are finite:
    `nonzero` elements of `got` are nonzero, `kept` of them nonzero in `gave` too."""
    # (a sum below `_UNDERFLOW_FLOAT32` is looked at again: no call for the others)
    if in_sq < _UNDERFLOW_FLOAT32:
        in_sq = _unless_underflowed(in_sq, got)
    if out_sq < _UNDERFLOW_FLOAT32:
        out_sq = _unless_underflowed(out_sq, gave)
    return [in_sq, out_sq, float(nonzero - kept), float(nonzero), 0.0, 0.0, 0.0, 0.0]


def _unless_underflowed(squares: float, x: Tensor) -> float:
    """`squares`, the float32 sum of squares of `x`, or that sum taken again in float64 when
    it is small enough that squares of `x`'s elements may have underflowed (a vanishing
    gradient, below about 1e-19 per element, would read as a zero or a rounded norm). A
    gradient that is all zeros is taken again too (one more pass over it, in float64)."""
    if x.dtype != torch.float32 or squares >= _UNDERFLOW_FLOAT32:
        return squares
    return float(_dot(x))


def _dot(x: Tensor) -> Tensor:
    """The sum of squares of `x`, in float64 (0-d)."""
    flat = x.reshape(-1).double()
    return torch.dot(flat, flat)


def _nonfinite(x: Tensor) -> tuple[int, int, float]:
    """NaN elements, infinite elements, and the sum of squares of the finite ones."""
    finite = x.nan_to_num(0.0, 0.0, 0.0)
    return int(x.isnan().sum()), int(x.isinf().sum()), float(_dot(finite))


def _sum_squares(tensors: list[Tensor]) -> tuple[float, int, int]:
    """The sum of squares over `tensors` (their finite elements) and their NaN and infinite
    elements."""
    if not tensors:
        return 0.0, 0, 0
    squares = torch.stack([_dot(t) for t in tensors]).tolist()
    if all(map(math.isfinite, squares)):
        return sum(squares), 0, 0
    total, nan, inf = 0.0, 0, 0
    for t in tensors:
        n, i, s = _nonfinite(t)
        total, nan, inf = total + s, nan + n, inf + i
    return total, nan, inf
