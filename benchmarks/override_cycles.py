"""Memory kept by override/remove cycles: what `go.override_backward` leaves behind.

Each cycle overrides an `nn.Linear`'s backward (a rule owning every input, so the op gets its
generated fast path), runs forward and backward once, and removes the override. After a warm-up,
prints how much the process's resident memory grew over the measured cycles and how much
generated source `linecache` still holds. Both should stay flat: an op's generated source is
dropped with the op.

    python benchmarks/override_cycles.py [--quick] [--cycles N] [--device cuda]

On a GPU it also prints how much the CUDA allocator's memory grew.
"""

from __future__ import annotations

import argparse
import gc
import linecache
import os
import sys

import torch
from torch import nn

import gradoverride as go

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import add_device_argument, synchronizer


def rule(grad, *, input, module):  # `input`: nn.Linear.forward's parameter name
    return {"input": grad @ module.weight, "weight": grad.T @ input, "bias": grad.sum(0)}


def cycle(device: str = "cpu") -> None:
    linear = nn.Linear(4, 4, device=device)
    handle = go.override_backward(linear, rule)
    for _ in range(2):  # the first call is checked; the second takes the fast path
        linear(torch.randn(2, 4, device=device, requires_grad=True)).sum().backward()
    handle.remove()


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * 4096 / 2**20


def generated_source_mb() -> float:
    held = sum(
        len("".join(entry[2]))
        for name, entry in list(linecache.cache.items())
        if name.startswith("<gradoverride generated")
    )
    return held / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 cycles (a smoke test)")
    parser.add_argument("--cycles", type=int, default=1000)
    add_device_argument(parser)
    args = parser.parse_args()
    sync = synchronizer(args.device)
    on_gpu = args.device != "cpu"
    cycles = 100 if args.quick else args.cycles
    for _ in range(50):
        cycle(args.device)
    gc.collect()
    sync()
    before = resident_mb()
    allocated = torch.cuda.memory_allocated() if on_gpu else 0
    for _ in range(cycles):
        cycle(args.device)
    gc.collect()
    sync()
    print(f"{cycles} override/remove cycles of an nn.Linear(4, 4) on {args.device}:")
    print(f"  resident memory grew by {resident_mb() - before:.1f} MB")
    if on_gpu:
        grown = (torch.cuda.memory_allocated() - allocated) / 2**20
        print(f"  CUDA memory allocated grew by {grown:.2f} MB")
    print(f"  generated source held in linecache: {generated_source_mb():.2f} MB")


if __name__ == "__main__":
    main()
