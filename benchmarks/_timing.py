"""Timing shared by the benchmarks: interleaved, shuffled rounds and paired ratios, and the
`--device` option every benchmark takes."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["add_device_argument", "compare", "synchronizer", "tensorflow_device"]


def _time_block(fn: Callable[[], Any], number: int, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(number):
        fn()
    sync()
    return (time.perf_counter() - start) / number


def compare(
    cases: dict[str, Callable[[], Any]],
    *,
    rounds: int,
    number: int,
    baselines: Sequence[str] | None = None,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, tuple[float, float]]:
    """Median seconds per call and median paired ratio to the baseline.

    Each round times every case once, in a shuffled order (seeded), so no case always runs
    right after another one: which case ran just before measurably changes small-tensor
    timings (caches), and a fixed order would bias the ratios. The baseline of a round is
    the fastest of the cases named in `baselines` in that round (default: the first case),
    so a ratio is to the cheapest way measured. `sync` runs before and after each timed
    block (`torch.cuda.synchronize` on a GPU, so a block's time includes its kernels).
    """
    names = list(cases)
    reference = list(baselines) if baselines is not None else names[:1]
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    order = random.Random(0)
    for fn in cases.values():  # warm up
        _time_block(fn, number, sync)
    for _ in range(rounds):
        shuffled = names[:]
        order.shuffle(shuffled)
        block = {n: _time_block(cases[n], number, sync) for n in shuffled}
        floor = min(block[n] for n in reference)
        for n in names:
            times[n].append(block[n])
            ratios[n].append(block[n] / floor)
    return {n: (statistics.median(times[n]), statistics.median(ratios[n])) for n in names}


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """`--device cpu|cuda|cuda:N` (default cpu)."""
    parser.add_argument("--device", default="cpu", help="where the tensors live (default cpu)")


def synchronizer(device: str) -> Callable[[], None]:
    """What `compare` runs around each block on `device`; exits with a clear message when
    the device is a GPU this torch cannot use."""
    import torch

    kind = torch.device(device).type
    if kind == "cpu":
        return lambda: None
    if kind == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"--device {device}: CUDA is not available to this torch "
                     f"({torch.__version__}); run on a machine with a GPU, or use --device cpu.")
        return torch.cuda.synchronize
    sys.exit(f"--device {device}: only cpu and cuda are supported by the benchmarks.")


def tensorflow_device(device: str) -> str:
    """TensorFlow's name for --device; where TensorFlow has no GPU, says so and exits with
    status 3 (cannot run here: what benchmarks/gpu.sh marks skipped)."""
    import tensorflow as tf

    kind, _, index = device.partition(":")
    if kind == "cpu":
        return "/CPU:0"
    if kind != "cuda":
        sys.exit(f"--device {device}: only cpu and cuda are supported by the benchmarks.")
    if not tf.config.list_physical_devices("GPU"):
        print(
            f"--device {device}: TensorFlow {tf.__version__} sees no GPU (a CPU-only build such "
            "as tensorflow-cpu, or no CUDA libraries for it); install a TensorFlow with GPU "
            "support, or use --device cpu.",
            file=sys.stderr,
        )
        sys.exit(3)
    return f"/GPU:{index or 0}"
