"""Gradient reversal: `go.recipes.reverse_grad` against pytorch-revgrad (when installed) and
against the cheapest hand-written reversal Function, in one run.

Forward+backward of `op(x)` with a dense upstream gradient (as behind any layer; the
stride-0 gradient of `.sum().backward()` makes torch's CPU multiply-by-scalar kernel 3-6x
slower than on a dense tensor, an artifact that would favour whichever side negates instead
of multiplying), interleaved, shuffled rounds on one thread; per-call
medians and the median of paired ratios to the baseline of each comparison, function form
(`revgrad(x, alpha)` vs `reverse_grad()(x)`) and module form (`RevGrad()` vs
`reverse_grad().module()`), at (1, 256) (pure overhead), (64, 1024) and (2048, 2048).
Contract (DESIGN §4): a recipe is never slower than the peer library that ships the same
formula, so every ratio to pytorch-revgrad must be at most 1.0.

    pip install pytorch-revgrad      # optional (the `peers` extra): else the hand-written
                                     # baseline only
    python benchmarks/flow.py [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from gradoverride.recipes import reverse_grad

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import add_device_argument, compare, synchronizer

try:
    import pytorch_revgrad
except ImportError:  # optional: CI does not install it
    pytorch_revgrad = None


class ReverseFunction(torch.autograd.Function):
    """Gradient reversal written by hand as a classic Function (the floor for overhead)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return -grad


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for the test suite)")
    add_device_argument(parser)
    args = parser.parse_args()
    sync = synchronizer(args.device)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    version = "not installed" if pytorch_revgrad is None else pytorch_revgrad.__version__
    print(f"torch {torch.__version__}, pytorch-revgrad {version}, {args.device}, 1 thread")

    for shape, number, rounds in (((1, 256), 200, 41), ((64, 1024), 50, 21),
                                  ((2048, 2048), 3, 11)):
        x = torch.randn(*shape, device=args.device, requires_grad=True)
        upstream = torch.randn(*shape, device=args.device)

        def step(op: Callable[..., torch.Tensor], *extra: Any, x: torch.Tensor = x,
                 upstream: torch.Tensor = upstream) -> Callable[[], None]:
            def run() -> None:
                op(x, *extra).backward(upstream)

            return run

        comparisons: dict[str, dict[str, Callable[[], None]]] = {}
        if pytorch_revgrad is not None:
            alpha = torch.tensor(1.0, device=args.device)
            comparisons["function"] = {
                "pytorch_revgrad.revgrad": step(pytorch_revgrad.functional.revgrad, alpha),
                "reverse_grad()": step(reverse_grad()),
            }
            comparisons["module"] = {
                "pytorch_revgrad.RevGrad()": step(pytorch_revgrad.RevGrad().to(args.device)),
                "reverse_grad().module()": step(reverse_grad().module()),
            }
        comparisons["hand-written"] = {
            "classic Function": step(ReverseFunction.apply),
            "reverse_grad()": step(reverse_grad()),
        }
        print(f"\nforward+backward per call, shape {shape}:")
        for label, cases in comparisons.items():
            result = compare(cases, rounds=5 if args.quick else rounds,
                             number=2 if args.quick else number, sync=sync)
            print(f"  {label}:")
            for name, (seconds, ratio) in result.items():
                print(f"    {name:27s} {seconds * 1e6:10.1f} us   ratio {ratio:.3f}")
    if pytorch_revgrad is None:
        print("\npytorch-revgrad is not installed: no peer comparison (pip install "
              "pytorch-revgrad)")


if __name__ == "__main__":
    main()
