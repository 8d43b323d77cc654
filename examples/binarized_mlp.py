"""A binarized MLP: ±1 weights and activations, trained through the straight-through sign.

`torch.sign` has a zero gradient almost everywhere, so a network whose weights and
activations are binarized cannot learn through them. `go.recipes.binarize()` keeps the ±1
forward and passes the gradient where |x| <= 1 (the hardtanh window of BinaryConnect and
XNOR-Net), so the real-valued "latent" weights behind the binary ones learn. Runs in a few
seconds on a CPU, on two interleaved spirals it makes itself.

After training it prints the gradient mismatch of each binarization for two clip settings:
how far the straight-through gradient at each binarize is from the true gradient of the
relaxed network, where each binarize is replaced by its proxy (clamp to its window:
hardtanh for clip=1), as a cosine similarity and a norm ratio
(`gradoverride.testing.gradient_report`).

    python examples/binarized_mlp.py
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gradoverride import recipes
from gradoverride.testing import gradient_report


class BinaryLinear(nn.Linear):
    """A linear layer whose weights are binarized to ±1 in the forward, scaled by 1/sqrt(in)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.binarize = recipes.binarize()  # the gradient passes where |w| <= 1
        self.scale = 1 / math.sqrt(n_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.binarize(self.weight) * self.scale, self.bias)


def make_spirals(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaved spirals in the plane, labels 0 and 1."""
    t = torch.rand(n, generator=generator) * 3 * math.pi
    label = torch.randint(0, 2, (n,), generator=generator)
    angle = t + math.pi * label
    radius = t / (3 * math.pi)
    x = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    x = x + 0.02 * torch.randn(n, 2, generator=generator)
    return x, label


def make_model(clip: float = 1.0) -> nn.Sequential:
    """Binary activations (the gradient passes where the pre-activation is within `clip`)
    and binary weights."""
    return nn.Sequential(
        nn.Linear(2, 96),  # the input layer stays real-valued, as is usual
        nn.BatchNorm1d(96),
        recipes.binarize(clip=clip).module(),  # binary activations
        BinaryLinear(96, 96),
        nn.BatchNorm1d(96),
        recipes.binarize(clip=clip).module(),
        BinaryLinear(96, 2),
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main(steps: int = 300) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x, y = make_spirals(512, generator)
    model = make_model()
    print(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = accuracy(model, x, y)
    for step in range(steps + 1):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():  # BinaryConnect keeps the latent weights in [-1, 1]
            for module in model:
                if isinstance(module, BinaryLinear):
                    module.weight.clamp_(-1, 1)
        if step % 100 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  accuracy {accuracy(model, x, y):.3f}")
    model.eval()
    last = accuracy(model, x, y)
    weights = {w.item() for w in model[3].binarize(model[3].weight).flatten()}
    print(f"binary weights take the values {sorted(weights)}")
    print(f"accuracy rose from {first:.3f} to {last:.3f}")
    for clip in (1.0, 3.0):  # the trained weights, with the activations' window at +-clip
        clipped = make_model(clip)
        clipped.load_state_dict(model.state_dict())
        clipped.eval()
        print(f"\ngradient mismatch, activations clipped at {clip}:")
        print(gradient_report(clipped, nn.functional.cross_entropy, (x, y)))
    return first, last


if __name__ == "__main__":
    main()
