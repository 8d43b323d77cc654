"""End to end: a training step of a two-layer spiking network with a spike recipe.

A leaky integrate-and-fire network, 784 -> 256 -> 10, stepped over 25 time steps on a batch
of 64 (snnTorch's tutorial network), its spikes from `recipes.spike.preset("snntorch.atan")`,
trained with Adam on the cross entropy of the output spike counts. The baseline is the same
network whose spike is a hand-written `torch.autograd.Function` running exactly the recipe's
kernels (`x > 0` written into a float tensor forward; `grad / (1/k + c^2/k x^2)` backward,
one `addcmul` and one `div`): what is left is the cost of the recipe object and the op's
route, about 2 x 25 calls per step. Interleaved, shuffled rounds on one thread; the ratio is
the median, over rounds, of the recipe's step over the baseline's in that round.

    python benchmarks/spiking.py [--quick] [--device cuda] [--rounds N]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradoverride import recipes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import add_device_argument, compare, synchronizer

STEPS, BATCH, BETA = 25, 64, 0.9
ALPHA = 2.0  # snnTorch's atan default
_K = ALPHA / 2
_C = math.pi * ALPHA / 2


class AtanSpike(torch.autograd.Function):
    """Heaviside forward, arctan surrogate backward, with the recipe's own kernels."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return torch.gt(x, 0, out=torch.empty_like(x))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        denominator = torch.addcmul(x.new_full((), 1 / _K), x, x, value=_C * _C / _K)
        return torch.div(grad, denominator, out=denominator)


class Network(nn.Module):
    def __init__(self, spike: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 10)
        self.spike = spike

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mem1 = torch.zeros(x.shape[0], 256, device=x.device)
        mem2 = torch.zeros(x.shape[0], 10, device=x.device)
        counts = torch.zeros(x.shape[0], 10, device=x.device)
        current = self.fc1(x)
        for _ in range(STEPS):
            mem1 = BETA * mem1 + current
            spk1 = self.spike(mem1 - 1.0)
            mem1 = mem1 - spk1
            mem2 = BETA * mem2 + self.fc2(spk1)
            spk2 = self.spike(mem2 - 1.0)
            mem2 = mem2 - spk2
            counts = counts + spk2
        return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for the test suite)")
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (default 21)")
    add_device_argument(parser)
    args = parser.parse_args()
    sync = synchronizer(args.device)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    rounds, number = (3, 2) if args.quick else (args.rounds, 10)
    print(f"torch {torch.__version__}, device {args.device}, 1 thread, "
          f"784 -> 256 -> 10, {STEPS} steps, batch {BATCH}")
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(BATCH, 784, generator=gen).to(device) * 0.1
    y = torch.randint(0, 10, (BATCH,), generator=gen).to(device)

    def trainer(spike: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        torch.manual_seed(0)
        network = Network(spike).to(device)
        optimizer = torch.optim.Adam(network.parameters(), lr=1e-3)

        def step() -> None:
            optimizer.zero_grad()
            nn.functional.cross_entropy(network(x), y).backward()
            optimizer.step()

        return step

    recipe = recipes.spike.preset("snntorch.atan")
    by_hand: Callable[[torch.Tensor], torch.Tensor] = AtanSpike.apply
    # The two networks compute the same step: the same loss and gradients.
    gradients = []
    for spike in (by_hand, recipe):
        torch.manual_seed(0)
        network = Network(spike).to(device)
        nn.functional.cross_entropy(network(x), y).backward()
        gradients.append([p.grad for p in network.parameters()])
    for ours, theirs in zip(*gradients, strict=True):
        torch.testing.assert_close(ours, theirs)
    result = compare(
        {"hand-written Function": trainer(by_hand), "spike.preset('snntorch.atan')":
         trainer(recipe)},
        rounds=rounds, number=number, sync=sync,
    )
    print("\ntraining step (forward, backward, Adam):")
    for name, (seconds, ratio) in result.items():
        print(f"  {name:32s} {seconds * 1e3:8.2f} ms   ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
