"""Quickstart: train a small network whose hidden layer is quantized to 4 bits.

`torch.round` has a zero gradient almost everywhere, so a network that rounds its
activations cannot learn through them. `go.custom_backward` keeps the rounding in the
forward and gives it a straight-through backward (the upstream gradient, zeroed where the
input is outside the quantizer's range). Runs in a few seconds on a CPU, on data it makes.

    python examples/quickstart.py
"""

from __future__ import annotations

import torch
from torch import nn

import gradoverride as go


@go.custom_backward
def quantize(x: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Round `x` (clamped to [-1, 1]) to a grid of 2**bits steps per unit."""
    scale = 2**bits
    return torch.round(x.clamp(-1, 1) * scale) / scale


@quantize.backward
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    # Straight-through inside the quantizer's range, zero outside it.
    return grad * (x.abs() <= 1)


def make_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth 2-D regression target the network has to learn."""
    x = torch.rand(n, 2, generator=generator) * 4 - 2
    y = torch.sin(x[:, :1]) * torch.cos(x[:, 1:]) + 0.5 * x[:, :1]
    return x, y


def main(steps: int = 300) -> list[float]:
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x, y = make_data(512, generator)
    model = nn.Sequential(
        nn.Linear(2, 64),
        nn.Tanh(),
        quantize.module(bits=4),  # the op as an nn.Module, with `bits` fixed
        nn.Linear(64, 1),
    )
    print(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps + 1):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
