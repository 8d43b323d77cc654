"""Reducing one override's gradients of one step to the numbers `go.monitor` keeps.

An override called at every time step of a recurrent model gives many small gradients: one
kernel per tensor per statistic would cost more than the training step's own backward, so
gradients of one shape are stacked and reduced at once. On a CPU every large temporary is a
fresh allocation the kernel must fault in page by page (several times the arithmetic), so
the stacks and temporaries go to scratch buffers kept for the monitor's lifetime; on an
accelerator the caching allocator already reuses memory.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._recorder import Gradients

__all__ = ["FIELDS", "GradientStatistics"]

#: What the numbers of one (override, step) are, in order.
FIELDS = ("calls", "in_sq", "out_sq", "zeroed", "paired", "nan_in", "inf_in", "nan_out",
          "inf_out")

# Below this many elements, a float32 sum of ones (a count) is exact.
_EXACT_FLOAT32 = 2**24
# From this many elements, a CPU temporary goes to a kept buffer (a fresh one would be
# faulted in page by page).
_SCRATCH_FROM = 2**14


class GradientStatistics:
    """`statistics(grads)`: the `FIELDS` numbers of one override's gradients in one pass."""

    def __init__(self) -> None:
        self._scratch: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}

    def release(self) -> None:
        self._scratch = {}

    def __call__(self, grads: Gradients) -> list[float]:
        if grads.aligned and grads.arriving:
            values = self._aligned(grads.arriving, grads.returned)
        else:
            values = self._general(grads)
        return [float(grads.calls), *map(float, values)]

    def _aligned(self, arriving: list[Tensor], returned: list[Tensor]) -> list[float]:
        """Each call: one gradient in, one of its shape out, all calls alike. As few kernel
        launches as possible: this runs at every recorded step, for each override."""
        got = self._stack("got", arriving).reshape(-1)
        gave = self._stack("gave", returned).reshape(-1)
        if got.dtype not in (torch.float32, torch.float64) or (
            got.dtype == torch.float32 and got.numel() >= _EXACT_FLOAT32
        ):
            got = got.double()  # counts of signs below stay exact
        if gave.dtype != got.dtype:
            gave = gave.to(got.dtype)
        # Nonzero elements, as the dot product of the signs with themselves (`count_nonzero`
        # branches on each element, several times slower on a CPU for gradients with many
        # zeros): of `got`, and of `got * gave`; their difference is what the override
        # zeroed.
        signs = torch.sign(got, out=self._buffer("signs", got))
        both = torch.mul(got, gave, out=self._buffer("both", got)).sign_()
        values = torch.stack([
            torch.dot(got, got), torch.dot(gave, gave),
            torch.dot(signs, signs), torch.dot(both, both),
        ]).tolist()
        in_sq, out_sq, nonzero, kept = values
        if math.isfinite(in_sq) and math.isfinite(out_sq):
            return [in_sq, out_sq, nonzero - kept, nonzero, 0, 0, 0, 0]
        nan_in, inf_in, in_sq = _nonfinite(got)
        nan_out, inf_out, out_sq = _nonfinite(gave)
        nonzero = int(torch.count_nonzero(got))
        zeroed = int(((gave == 0) & (got != 0)).sum())
        return [in_sq, out_sq, zeroed, nonzero, nan_in, inf_in, nan_out, inf_out]

    def _general(self, grads: Gradients) -> list[float]:
        in_sq, nan_in, inf_in = _sum_squares(grads.arriving)
        out_sq, nan_out, inf_out = _sum_squares(grads.returned)
        zeroed = paired = 0
        for gave, got in grads.pairs:
            nonzero = int(torch.count_nonzero(got))
            paired += nonzero
            zeroed += int(((gave == 0) & (got != 0)).sum())
        return [in_sq, out_sq, zeroed, paired, nan_in, inf_in, nan_out, inf_out]

    def _stack(self, name: str, tensors: list[Tensor]) -> Tensor:
        if len(tensors) == 1:
            return tensors[0]
        first = tensors[0]
        if first.device.type != "cpu" or first.numel() * len(tensors) < _SCRATCH_FROM:
            return torch.stack(tensors)
        out = self._scratch_for(name, first.numel() * len(tensors), first)
        return torch.stack(tensors, out=out.view(len(tensors), *first.shape))

    def _buffer(self, name: str, like: Tensor) -> Tensor:
        """A 1-d tensor of `like`'s size, dtype and device, for a temporary result."""
        if like.device.type != "cpu" or like.numel() < _SCRATCH_FROM:
            return torch.empty_like(like)
        return self._scratch_for(name, like.numel(), like)

    def _scratch_for(self, name: str, numel: int, like: Tensor) -> Tensor:
        key = (name, like.dtype, like.device)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch[key] = torch.empty(numel, dtype=like.dtype,
                                                      device=like.device)
        return buffer[:numel]


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
