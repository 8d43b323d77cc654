"""Module-side overhead: `grad_hook` vs `register_full_backward_hook`, and `go.Module` vs the
same layer written with a hand-made autograd.Function. Interleaved, shuffled rounds; paired
ratios to the baseline of each comparison; one thread.

    python benchmarks/modules.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from torch import nn

import gradoverride as go

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import compare
from flow import ReverseFunction  # the same hand-written baseline as benchmarks/flow.py


class Scale(go.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weights

    def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": grad * self.weights, "weights": (grad * x).sum(0)}


class ScaleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class ScaleByHand(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = ScaleFunction.apply(x, self.weights)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for the test suite)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rounds, number = (3, 5) if args.quick else (41, 200)
    x = torch.randn(1, 256, requires_grad=True)

    def reversal_module() -> nn.Linear:
        torch.manual_seed(0)
        return nn.Linear(256, 256)

    plain, hooked, full, by_function = (reversal_module() for _ in range(4))
    go.grad_hook(hooked, lambda g: -g, at="inputs")
    full.register_full_backward_hook(lambda m, gi, go_: tuple(-g for g in gi))
    cases = {
        "Function doing reversal": lambda: full_step(by_function, ReverseFunction.apply(x)),
        "register_full_backward_hook": lambda: full_step(full, x),
        "go.grad_hook(at='inputs')": lambda: full_step(hooked, x),
        "no hook (reference)": lambda: full_step(plain, x),
    }
    print("gradient reversal at an nn.Linear(256, 256)'s input, (1, 256), forward+backward:")
    for name, (seconds, ratio) in compare(cases, rounds=rounds, number=number).items():
        print(f"  {name:30s} {seconds * 1e6:8.1f} us   ratio {ratio:.3f}")

    layer, by_hand = Scale(256), ScaleByHand(256)
    cases = {
        "hand-made Function module": lambda: full_step(by_hand, x),
        "go.Module": lambda: full_step(layer, x),
    }
    print("\nx * weights with a custom backward for both, (1, 256), forward+backward:")
    for name, (seconds, ratio) in compare(cases, rounds=rounds, number=number).items():
        print(f"  {name:30s} {seconds * 1e6:8.1f} us   ratio {ratio:.3f}")


def full_step(module: nn.Module, x: torch.Tensor) -> None:
    module(x).sum().backward()


if __name__ == "__main__":
    main()
