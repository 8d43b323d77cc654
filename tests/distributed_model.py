"""The model and data shared by the distributed check and its single-process reference."""

from __future__ import annotations

import torch
from torch import nn

import gradoverride as go


class ScaledLayer(go.Module):
    """A layer whose rule gives the true input gradient and half the true weight gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.linspace(-1.0, 1.0, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.weights)

    def backward(self, grad: torch.Tensor, *, x: torch.Tensor, output: torch.Tensor) -> object:
        local = grad * (1 - output**2)
        return {"x": local * self.weights, "weights": 0.5 * (local * x).sum(0)}


def _linear_rule(grad: torch.Tensor, *, input: torch.Tensor, module: nn.Linear) -> object:
    # True gradients, with the bias gradient doubled so the rule is visible.
    return {"input": grad @ module.weight, "weight": grad.T @ input, "bias": 2 * grad.sum(0)}


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    linear = nn.Linear(6, 2)
    go.override_backward(linear, _linear_rule)
    return nn.Sequential(ScaledLayer(), linear)


def full_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)


def rank_batch(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = full_batch()
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
