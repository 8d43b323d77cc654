"""Module-side overhead: `go.Module`, `go.override_backward` and `go.grad_hook` against the
cheapest hand-written way to do the same, forward+backward at (1, 256), where the per-call
work is all there is to measure.

* `go.Module` (`x * weights`, its rule giving both gradients) against the same layer
  calling a hand-made autograd.Function, with the default ownership, with `owns=`, and
  with the rule naming `weights` as a keyword instead of reading `self.weights`;
* a `go.Module` holding a submodule (an `nn.Linear(256, 256)`), its rule giving the input's
  and the submodule's parameters' gradients, against a hand-made Function whose forward
  calls that submodule;
* a `go.Module` whose rule owns only `x` (`owns="x"`: the parameter keeps autograd's
  gradient) against the hand-made Function computing both;
* `go.override_backward` on an `nn.Linear(256, 256)`, a rule giving the input, weight and
  bias gradients, against a module calling a hand-made Function for the same three;
* `go.grad_hook` reversing the gradient (`-g`) at an `nn.Linear`'s inputs, outputs and
  parameters, against the cheapest of a hand-written Function and tensor hooks doing the
  same reversal (for the parameters: hooks registered once).

Interleaved, shuffled rounds on one thread; each ratio is the median, over rounds, of the
case's time over the fastest baseline's in that round. A dense upstream gradient
(`out.backward(upstream)`), as behind any layer.

    python benchmarks/modules.py [--quick] [--device cuda] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradoverride as go

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import add_device_argument, compare, synchronizer
from flow import ReverseFunction  # the same hand-written baseline as benchmarks/flow.py

N = 256


class Scale(go.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weights

    def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": grad * self.weights, "weights": (grad * x).sum(0)}


class ScaleOwning(Scale, owns=("x", "weights")):
    def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": grad * self.weights, "weights": (grad * x).sum(0)}


class ScaleNaming(Scale):
    """The rule receives the parameter as a keyword, as the hand-made Function's backward
    has its saved tensor (`self.weights` is a call of nn.Module's Python `__getattr__`)."""

    def backward(  # type: ignore[override]
        self, grad: torch.Tensor, *, x: torch.Tensor, weights: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        return {"x": grad * weights, "weights": (grad * x).sum(0)}


class ScalePartial(Scale, owns="x"):
    """The rule gives `x`'s gradient; `weights` keeps its ordinary autograd gradient."""

    def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * self.weights


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


class Block(go.Module):
    """A go.Module holding a submodule: its rule gives the submodule's parameters' gradients
    by their dotted names."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.inner = nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        return out

    def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": grad @ self.inner.weight, "inner.weight": grad.T @ x,
                "inner.bias": grad.sum(0)}


class BlockFunction(torch.autograd.Function):
    """The hand-made baseline: its forward calls the submodule (recording nothing there)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,  # type: ignore[override]
                inner: nn.Module) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        out: torch.Tensor = inner(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return grad @ w, grad.T @ x, grad.sum(0), None


class BlockByHand(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.inner = nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = BlockFunction.apply(x, self.inner.weight, self.inner.bias, self.inner)
        return out


def linear_rule(
    grad: torch.Tensor, *, input: torch.Tensor, weight: torch.Tensor
) -> dict[str, torch.Tensor]:
    """nn.Linear's own gradients, written out: what the override benchmark's rule returns."""
    return {"input": grad @ weight, "weight": grad.T @ input, "bias": grad.sum(0)}


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return torch.nn.functional.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return grad @ w, grad.T @ x, grad.sum(0)


class LinearByHand(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = LinearFunction.apply(input, self.weight, self.bias)
        return out


def negate(grad: torch.Tensor) -> torch.Tensor:
    return -grad


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for the test suite)")
    parser.add_argument("--rounds", type=int, default=41, help="timed rounds (default 41)")
    add_device_argument(parser)
    args = parser.parse_args()
    sync = synchronizer(args.device)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rounds, number = (3, 5) if args.quick else (args.rounds, 200)
    print(f"torch {torch.__version__}, device {args.device}, 1 thread, shape (1, {N})")
    x = torch.randn(1, N, device=device, requires_grad=True)
    upstream = torch.randn(1, N, device=device)

    def step(module: Callable[[torch.Tensor], torch.Tensor],
             before: Callable[[torch.Tensor], torch.Tensor] | None = None,
             after: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Callable[[], None]:
        def run() -> None:
            out = module(x if before is None else before(x))
            (out if after is None else after(out)).backward(upstream)

        return run

    def report(title: str, cases: dict[str, Callable[[], None]], baselines: list[str]) -> None:
        result = compare(cases, rounds=rounds, number=number, baselines=baselines, sync=sync)
        print(f"\n{title}")
        print(f"  (ratio to the fastest of: {', '.join(baselines)})")
        for name, (seconds, ratio) in result.items():
            print(f"  {name:36s} {seconds * 1e6:8.1f} us   ratio {ratio:.3f}")

    # go.Module --------------------------------------------------------------------------
    torch.manual_seed(0)
    layer, owning, naming, by_hand = (
        m.to(device) for m in (Scale(N), ScaleOwning(N), ScaleNaming(N), ScaleByHand(N))
    )
    report(
        "go.Module: x * weights, its rule giving both gradients, forward+backward:",
        {
            "hand-made Function module": step(by_hand),
            "go.Module": step(layer),
            "go.Module, owns=('x', 'weights')": step(owning),
            "go.Module, rule naming `weights`": step(naming),
        },
        ["hand-made Function module"],
    )

    torch.manual_seed(0)
    block, block_by_hand = Block(N).to(device), BlockByHand(N).to(device)
    report(
        "go.Module holding an nn.Linear(256, 256), its rule giving the submodule's "
        "gradients:",
        {
            "hand-made Function calling it": step(block_by_hand),
            "go.Module with a submodule": step(block),
        },
        ["hand-made Function calling it"],
    )

    torch.manual_seed(0)
    partial = ScalePartial(N).to(device)
    report(
        "go.Module owning only x (the parameter keeps autograd's gradient):",
        {
            "hand-made Function module": step(by_hand),
            "go.Module, owns='x'": step(partial),
        },
        ["hand-made Function module"],
    )

    # override_backward ------------------------------------------------------------------
    def linear() -> nn.Linear:
        torch.manual_seed(0)
        return nn.Linear(N, N).to(device)

    overridden, overridden_owns = linear(), linear()
    go.override_backward(overridden, linear_rule)
    go.override_backward(overridden_owns, linear_rule, owns=("input", "weight", "bias"))
    function_linear = LinearByHand(N, N).to(device)
    report(
        "go.override_backward: nn.Linear(256, 256), a rule for input, weight and bias:",
        {
            "hand-made Function module": step(function_linear),
            "go.override_backward": step(overridden),
            "go.override_backward, owns=(all 3)": step(overridden_owns),
            "nn.Linear, no override (reference)": step(linear()),
        },
        ["hand-made Function module"],
    )

    # grad_hook --------------------------------------------------------------------------
    def tensor_hook(t: torch.Tensor) -> torch.Tensor:
        t = t.view_as(t)
        t.register_hook(negate)
        return t

    def output_hook(t: torch.Tensor) -> torch.Tensor:
        t.register_hook(negate)
        return t

    plain, at_inputs, full = linear(), linear(), linear()
    go.grad_hook(at_inputs, negate, at="inputs")
    full.register_full_backward_hook(lambda m, gi, go_: tuple(-g for g in gi))
    report(
        "go.grad_hook(at='inputs'): gradient reversal at an nn.Linear(256, 256)'s input:",
        {
            "Function doing reversal": step(plain, before=ReverseFunction.apply),
            "tensor hook on a view of the input": step(plain, before=tensor_hook),
            "go.grad_hook(at='inputs')": step(at_inputs),
            "register_full_backward_hook": step(full),
            "no hook (reference)": step(plain),
        },
        ["Function doing reversal", "tensor hook on a view of the input"],
    )

    at_outputs = linear()
    go.grad_hook(at_outputs, negate, at="outputs")
    report(
        "go.grad_hook(at='outputs'): gradient reversal at an nn.Linear(256, 256)'s output:",
        {
            "Function doing reversal": step(plain, after=ReverseFunction.apply),
            "tensor hook on the output": step(plain, after=output_hook),
            "go.grad_hook(at='outputs')": step(at_outputs),
            "no hook (reference)": step(plain),
        },
        ["Function doing reversal", "tensor hook on the output"],
    )

    at_parameters, hooked = linear(), linear()
    go.grad_hook(at_parameters, negate, at="parameters")
    for p in hooked.parameters():
        p.register_hook(negate)
    reversing = linear()

    def reversed_parameters(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(
            t, ReverseFunction.apply(reversing.weight), ReverseFunction.apply(reversing.bias)
        )

    report(
        "go.grad_hook(at='parameters'): reversal of an nn.Linear(256, 256)'s parameter "
        "gradients:",
        {
            "tensor hooks registered once": step(hooked),
            "Function doing reversal": step(reversed_parameters),
            "go.grad_hook(at='parameters')": step(at_parameters),
            "no hook (reference)": step(plain),
        },
        ["tensor hooks registered once", "Function doing reversal"],
    )


if __name__ == "__main__":
    main()
