"""A module that defines its own backward, the same rule on an existing nn.Linear, and a
gradient hook clipping what an encoder sends back to its input.

    python examples/custom_layer.py
"""

from __future__ import annotations

import torch
from torch import nn

import gradoverride as go


class LayerWithCustomGrad(go.Module):
    """y = x * weights, whose backward scales the weights' gradient by 1/2 (a damped layer)."""

    def __init__(self, n: int = 200) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weights

    def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": grad * self.weights, "weights": 0.5 * (grad * x).sum(0)}


def damped_linear_rule(
    grad: torch.Tensor, *, input: torch.Tensor, module: nn.Linear
) -> dict[str, torch.Tensor]:
    """The same idea for an nn.Linear someone else wrote: half the weight gradient."""
    return {
        "input": grad @ module.weight,
        "weight": 0.5 * grad.T @ input,
        "bias": 0.5 * grad.sum(0),
    }


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 200, requires_grad=True)

    layer = LayerWithCustomGrad()
    layer(x).sum().backward()
    true_weight_grad = x.detach().sum(0)
    ratio = (layer.weights.grad / true_weight_grad).mean().item()
    print(f"go.Module: weight gradient / true gradient = {ratio:.2f}")

    linear = nn.Linear(200, 10)
    linear(x).sum().backward()
    true_grad = linear.weight.grad.clone()
    linear.zero_grad()
    with go.override_backward(linear, damped_linear_rule):
        linear(x).sum().backward()
        ratio = (linear.weight.grad / true_grad).mean().item()
        print(f"override_backward on nn.Linear: weight gradient / true gradient = {ratio:.2f}")
    print(f"after remove(): forward is the class's own again: {'forward' not in vars(linear)}")

    encoder = nn.Sequential(nn.Linear(200, 64), nn.ReLU(inplace=True), nn.Linear(64, 8))
    x.grad = None
    encoder(x).pow(2).sum().backward()
    print(f"input gradient without the hook: max |g| = {x.grad.abs().max().item():.3f}")
    x.grad = None
    handle = go.grad_hook(encoder, lambda g: g.clamp(-0.01, 0.01), at="inputs")
    encoder(x).pow(2).sum().backward()
    print(f"input gradient clipped by grad_hook: max |g| = {x.grad.abs().max().item():.3f}")
    handle.remove()


if __name__ == "__main__":
    main()
