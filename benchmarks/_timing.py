"""Timing shared by the benchmarks: interleaved, shuffled rounds and paired ratios."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["compare"]


def _time_block(fn: Callable[[], Any], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def compare(
    cases: dict[str, Callable[[], Any]], *, rounds: int, number: int
) -> dict[str, tuple[float, float]]:
    """Median seconds per call and median paired ratio to the first case.

    Each round times every case once, in a shuffled order (seeded), so no case always runs
    right after another one: which case ran just before measurably changes small-tensor
    timings (caches), and a fixed order would bias the ratios.
    """
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    order = random.Random(0)
    for fn in cases.values():  # warm up
        _time_block(fn, number)
    for _ in range(rounds):
        shuffled = names[:]
        order.shuffle(shuffled)
        block = {n: _time_block(cases[n], number) for n in shuffled}
        for n in names:
            times[n].append(block[n])
            ratios[n].append(block[n] / block[names[0]])
    return {n: (statistics.median(times[n]), statistics.median(ratios[n])) for n in names}
