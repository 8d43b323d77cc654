"""Models and rules defined at module level, so a checkpoint of them loads in a fresh process
(pickle stores classes and functions by module and name). Used by the save/load tests."""

from __future__ import annotations

import torch
from torch import nn

import gradoverride as go
from gradoverride.recipes import reverse_grad


class Scaled(go.Module):
    """The forum's layer: its rule gives the input and the parameter a gradient (times 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weights

    def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": grad * self.weights * 10, "weights": grad * x * 10}


def linear_rule(grad, *, input, module):
    """nn.Linear's true gradients, times 10 for the input (so the override is visible)."""
    return {"input": grad @ module.weight * 10, "weight": grad.T @ input, "bias": grad.sum(0)}


def sign_rule(grad, *, input):
    return grad * 3


sign_times_three = go.custom_backward(torch.sign, backward=sign_rule)
clipped_sign = go.straight_through(clip=1.0)(torch.sign)


def make_model() -> nn.Module:
    """A model with every kind of override that lives in a checkpoint."""
    linear = nn.Linear(3, 3)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(3) * 2)
        linear.bias.zero_()
    go.override_backward(linear, linear_rule)
    return nn.Sequential(
        linear, Scaled(), sign_times_three.module(), clipped_sign.module(),
        reverse_grad(scale=0.5).module(),
    )


def input_gradient(model: nn.Module) -> torch.Tensor:
    x = torch.tensor([[0.1, -0.2, 0.3]], requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None
    return x.grad
