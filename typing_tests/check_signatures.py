"""Checked by mypy in CI (not run): decorators keep the forward's parameter and return types.

Each `assert_type` fails type checking if a signature is lost; each `type: ignore[...]` line
must stay an error (mypy's `warn_unused_ignores` under --strict reports it if it stops being one).
"""

from __future__ import annotations

from typing import assert_type

import torch

import gradoverride as go


@go.custom_backward
def quantize(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    rounded: torch.Tensor = torch.round(x * 2**bits) / 2**bits
    return rounded


@quantize.backward
def _quantize_backward(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad * (x.abs() <= 1)


@go.custom_backward(owns="x")
def scale(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * w, x + w


x = torch.ones(3)
assert_type(quantize(x), torch.Tensor)
assert_type(quantize(x, bits=4), torch.Tensor)
assert_type(scale(x, x), tuple[torch.Tensor, torch.Tensor])
assert_type(_quantize_backward(x, x=x), torch.Tensor)  # `.backward` returns the rule as is
quantize(x, bits="4")  # type: ignore[arg-type]
quantize(x, nbits=4)  # type: ignore[call-arg]
scale(x)  # type: ignore[call-arg]
