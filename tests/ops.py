"""Ops shared by several test files: one of each shape the library handles differently."""

from __future__ import annotations

from typing import Any

import torch

import gradoverride as go


@go.custom_backward
def quantize(x: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """Straight-through rounding: the fast path (one tensor in, one out, rule names `x`)."""
    s = 2**bits
    return torch.round(x * s) / s


@quantize.backward
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad * (x.abs() <= 1)


@go.custom_backward(owns="x")
def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Partial override: the rule owns `x`; `w` keeps its autograd gradient (`grad * x`)."""
    return x * w


@scale.backward
def _(grad: torch.Tensor, *, w: torch.Tensor) -> torch.Tensor:
    return grad * 2 * w  # twice the true derivative, so the rule is visible


@go.custom_backward
def pair_product(xs: tuple[torch.Tensor, torch.Tensor], *, shift: float = 0.0) -> torch.Tensor:
    """A container input, gradient returned by name with the container's structure."""
    a, b = xs
    return a * b + shift


@pair_product.backward
def _(grad: torch.Tensor, *, xs: tuple[torch.Tensor, torch.Tensor]) -> Any:
    a, b = xs
    return {"xs": (grad * b + 1, grad * a - 1)}


@go.custom_backward
def sin_cos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two outputs: the rule takes one upstream gradient for each."""
    return x.sin(), x.cos()


@sin_cos.backward
def _(grad_sin: torch.Tensor, grad_cos: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad_sin * x.cos() - grad_cos * x.sin() + 0.5
