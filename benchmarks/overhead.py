"""Per-call overhead of a `custom_backward` op against hand-written autograd.Functions.

Forward + backward of the same quantize op, written four ways, interleaved in one run on one
thread: a classic `forward(ctx, ...)` Function (the baseline), a `setup_context` Function
(what `torch.func` needs), and `go.custom_backward` (rule naming `x`). Prints per-call
medians and the median of paired ratios to the classic Function, at (1, 256) (pure overhead)
and (2048, 2048). Then the bytes saved for backward, counted with
`torch.autograd.graph.saved_tensors_hooks`: a rule that names nothing must keep 0 bytes.

    python benchmarks/overhead.py [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

import gradoverride as go
from gradoverride.testing import saved_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import add_device_argument, compare, synchronizer


class Classic(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bits: int = 8) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        s = 2**bits
        return torch.round(x * s) / s

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1), None


class SetupContext(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, bits: int = 8) -> torch.Tensor:  # type: ignore[override]
        s = 2**bits
        return torch.round(x * s) / s

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1), None


@go.custom_backward
def quantize(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    s = 2**bits
    return torch.round(x * s) / s


@quantize.backward
def _quantize_backward(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad * (x.abs() <= 1)


@go.custom_backward
def passthrough_sign(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x)


@passthrough_sign.backward
def _sign_backward(grad: torch.Tensor) -> torch.Tensor:
    return grad


def import_cost(repeats: int = 5) -> float:
    """Median seconds `import gradoverride` adds after `import torch`, in fresh processes."""
    code = (
        "import time, torch; t = time.perf_counter(); import gradoverride; "
        "print(time.perf_counter() - t)"
    )
    runs = [
        float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                             text=True).stdout)
        for _ in range(repeats)
    ]
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for the test suite)")
    add_device_argument(parser)
    args = parser.parse_args()
    synchronizer(args.device)  # a clear exit where the device is a GPU torch cannot use
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, device {args.device}, 1 thread")

    for shape, number in (((1, 256), 200), ((2048, 2048), 3)):
        x = torch.randn(*shape, device=args.device, requires_grad=True)

        def step(
            op: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor = x
        ) -> Callable[[], None]:
            def run() -> None:
                op(x, 8).sum().backward()
                if args.device != "cpu":
                    torch.cuda.synchronize()

            return run

        cases = {
            "classic Function": step(Classic.apply),
            "setup_context Function": step(SetupContext.apply),
            "go.custom_backward": step(quantize),
        }
        rounds = 5 if args.quick else (41 if shape == (1, 256) else 11)
        result = compare(cases, rounds=rounds, number=2 if args.quick else number)
        print(f"\nforward+backward per call, shape {shape}:")
        for name, (seconds, ratio) in result.items():
            print(f"  {name:24s} {seconds * 1e6:10.1f} us   ratio {ratio:.3f}")

    x = torch.randn(64, 64, device=args.device, requires_grad=True)
    print("\nbytes saved for backward, (64, 64) float32:")
    print(f"  rule naming nothing (passthrough_sign): {saved_bytes(passthrough_sign, x)}")
    print(f"  rule naming x (quantize):               {saved_bytes(quantize, x)}")
    print(f"  classic Function saving x:              {saved_bytes(Classic.apply, x)}")
    cost = import_cost(2 if args.quick else 5)
    print(f"\nimport gradoverride after import torch: {cost * 1e3:.1f} ms (contract: at most 50)")


if __name__ == "__main__":
    main()
