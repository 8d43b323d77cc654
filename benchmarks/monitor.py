"""What `go.monitor(model, every=N)` adds to a training step of a small MLP with binarized
activations (width 96, batch 128) and of the spiking and binarized examples
(`examples/spiking_neuron.py`, `examples/binarized_mlp.py`): forward, backward and the
optimizer's step, with and without the monitor recording.

The same model runs in both cases. Each round times a block of steps without the monitor
and a block inside `with go.monitor(model, every=N)`, in a shuffled order (seeded). The
monitored block is a monitor's steady state, what a training run of many steps pays per
step: entering the monitor and its first steps (the first forward, which also learns which
modules to hook, and the first recorded step, which makes the rows) run before the timed
block, and leaving it after. The ratio is the median, over rounds, of the monitored
block's time over the plain block's in that round. What a monitor's first step costs once
is reported on its own: the median, over rounds, of the first step's time under a new
monitor less a plain step's.

    python benchmarks/monitor.py [--quick] [--device cuda] [--rounds N] [--calls]
                                 [--instructions] [--phases]

`--calls` counts instead of timing: the Python function calls (and calls of C functions from
Python) a step makes, plain and under the monitor, as `sys.setprofile` sees them. The counts
do not depend on the machine's load, so they show a change to the monitor's own code where
the timings of a shared machine cannot.

`--instructions` counts the machine instructions of a step (CPU only; needs valgrind): each
case runs in a process of its own under `valgrind --tool=callgrind`, which counts only
while the steps run (from `callgrind_control -i on` to `-i off`: not the imports, the
warm-up, or a monitor's first steps), plain and in a monitor's steady state; the ratio is
monitored over plain. Deterministic at any load, and weighted as the timings are (a C++
hook costs what it costs), unlike the call counts; about 10 minutes in all.

`--phases` splits a step of `every=10` into its forward (the model and the loss), its
backward (`zero_grad` and `backward`, with what the monitor does at the pass's end) and the
optimizer's step, timed one step at a time: the median of each phase over plain steps and
over the monitored steps recorded and not recorded (told apart by whether the step left
records), so that what a step not recorded costs is seen apart from what a recorded one
adds; and the ratio those medians give for one step recorded in ten. `--rounds` sets its
rounds (default 40, 2 with `--quick`), each a block of 20 steps of each case.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradoverride as go

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import binarized_mlp
import spiking_neuron
from _timing import _time_block, add_device_argument, synchronizer


def _training(make_data: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]],
              n: int, model: nn.Module, lr: float, device: str,
              phased: bool = False) -> tuple[nn.Module, Callable[..., Any]]:
    """`model` and one training step of it (cross-entropy, Adam) on `make_data`'s data.
    `phased`: the step takes a list, to which it appends the nanoseconds of its forward,
    backward and optimizer's step (see `--phases`)."""
    x, y = make_data(n, torch.Generator().manual_seed(0))
    x, y = x.to(device), y.to(device)
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    if not phased:
        return model, step
    sync = synchronizer(device)
    clock = time.perf_counter_ns

    def phased_step(times: list[tuple[int, int, int]]) -> None:
        sync()
        t0 = clock()
        loss = nn.functional.cross_entropy(model(x), y)
        sync()
        t1 = clock()
        optimizer.zero_grad()
        loss.backward()
        sync()
        t2 = clock()
        optimizer.step()
        sync()
        times.append((t1 - t0, t2 - t1, clock() - t2))

    return model, phased_step


def spiking(device: str, phased: bool = False) -> tuple[nn.Module, Callable[..., Any]]:
    torch.manual_seed(0)
    return _training(spiking_neuron.make_data, 256, spiking_neuron.SpikingNet(), 5e-3, device,
                     phased)


def binarized(device: str, phased: bool = False) -> tuple[nn.Module, Callable[..., Any]]:
    torch.manual_seed(0)
    return _training(binarized_mlp.make_spirals, 512, binarized_mlp.make_model(), 1e-2, device,
                     phased)


def small_mlp(device: str, phased: bool = False) -> tuple[nn.Module, Callable[..., Any]]:
    """A small MLP with two binarized activations (width 96, batch 128): where the
    monitor's fixed cost per step weighs most."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 96), go.recipes.binarize().module(), nn.Linear(96, 96),
        go.recipes.binarize().module(), nn.Linear(96, 10),
    )

    def make_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 32, generator=generator), torch.randint(0, 10, (n,),
                                                                     generator=generator)

    return _training(make_data, 128, model, 1e-2, device, phased)


# Steps run inside a new monitor before its timed block: its first forward and first
# recorded step, and one more of each kind (`every=10`: a step not recorded).
_SETTLE = 3


def measure(model: nn.Module, step: Callable[[], Any], every: int, *, rounds: int,
            number: int, sync: Callable[[], None]) -> tuple[float, float, float]:
    """Median seconds per plain step, the median monitored / plain ratio in a monitor's
    steady state, and the median extra seconds of a new monitor's first step."""
    for _ in range(3):
        step()
    with go.monitor(model, every=every):
        for _ in range(3):
            step()
    order = random.Random(0)
    plain, ratios, first = [], [], []
    for _ in range(rounds):
        cases = ["plain", "monitored"]
        order.shuffle(cases)
        block = {}
        for case in cases:
            if case == "plain":
                block[case] = _time_block(step, number, sync)
            else:
                with go.monitor(model, every=every):
                    first.append(_time_block(step, 1, sync))
                    for _ in range(_SETTLE - 1):
                        step()
                    block[case] = _time_block(step, number, sync)
        plain.append(block["plain"])
        ratios.append(block["monitored"] / block["plain"])
    extra = statistics.median(f - p for f, p in zip(first, plain, strict=True))
    return statistics.median(plain), statistics.median(ratios), extra


def count_calls(model: nn.Module, step: Callable[[], Any], every: int,
                steps: int = 20) -> tuple[float, float, float, float]:
    """Python calls and C calls a step makes, plain and monitored with `every` (means over
    `steps` steps, after some steps of each to warm up)."""

    def count() -> tuple[float, float]:
        calls = [0, 0]

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                calls[0] += 1
            elif event == "c_call":
                calls[1] += 1

        sys.setprofile(profile)
        try:
            for _ in range(steps):
                step()
        finally:
            sys.setprofile(None)
        return calls[0] / steps, calls[1] / steps

    for _ in range(3):
        step()
    with go.monitor(model, every=every):
        for _ in range(3):
            step()
    plain = count()
    with go.monitor(model, every=every):
        for _ in range(2):
            step()
        monitored = count()
    return (*plain, *monitored)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--calls", action="store_true",
                        help="count the Python calls of a step instead of timing it")
    parser.add_argument("--instructions", action="store_true",
                        help="count the instructions of a step under valgrind (CPU)")
    parser.add_argument("--phases", action="store_true",
                        help="time the forward, backward and optimizer of every=10's steps")
    # (what one `--instructions` case runs, under valgrind: MODEL EVERY STEPS, EVERY 0 plain)
    parser.add_argument("--counted-steps", nargs=3, help=argparse.SUPPRESS)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if args.calls:
        return _main_calls(args.device)
    if args.counted_steps:
        name, every, steps = args.counted_steps
        _counted_steps(name, int(every), int(steps))
        return {}
    if args.instructions:
        return _main_instructions()
    if args.phases:
        return _main_phases(args.device, rounds=args.rounds or (2 if args.quick else 40))
    rounds = args.rounds or (3 if args.quick else 15)
    number = 3 if args.quick else 20
    sync = synchronizer(args.device)
    torch.set_num_threads(1)  # steadier timings; the ratio is what is reported
    results: dict[str, float] = {}
    print(f"torch {torch.__version__}, device {args.device}, {rounds} rounds of {number} steps")
    print(f"{'model':<12} {'every':>5} {'plain step':>12} {'monitored / plain':>18} "
          f"{'first step adds':>16}")
    for name, make in (("small MLP", small_mlp), ("spiking", spiking), ("binarized", binarized)):
        for every in (1, 10):
            model, step = make(args.device)
            seconds, ratio, extra = measure(model, step, every, rounds=rounds, number=number,
                                            sync=sync)
            results[f"{name} every={every}"] = ratio
            results[f"{name} every={every} first step"] = extra
            print(f"{name:<12} {every:>5} {seconds * 1e3:>9.2f} ms {ratio:>17.3f}x "
                  f"{extra * 1e3:>13.2f} ms")
    return results


def _main_calls(device: str) -> dict[str, float]:
    torch.set_num_threads(1)
    results: dict[str, float] = {}
    print(f"torch {torch.__version__}, device {device}: calls per step (Python + C from "
          "Python), and what the monitor adds")
    print(f"{'model':<12} {'every':>5} {'plain':>13} {'monitored':>13} {'added':>13}")
    for name, make in (("small MLP", small_mlp), ("spiking", spiking), ("binarized", binarized)):
        for every in (1, 10):
            model, step = make(device)
            py, c, monitored_py, monitored_c = count_calls(model, step, every)
            results[f"{name} every={every} python"] = monitored_py - py
            results[f"{name} every={every} c"] = monitored_c - c
            print(f"{name:<12} {every:>5} {py:>6.0f} +{c:>5.0f} {monitored_py:>6.0f} +"
                  f"{monitored_c:>5.0f} {monitored_py - py:>6.0f} +{monitored_c - c:>5.0f}")
    return results


_MODELS = {"small MLP": small_mlp, "spiking": spiking, "binarized": binarized}


def _main_phases(device: str, *, rounds: int) -> dict[str, float]:
    torch.set_num_threads(1)
    every, steps = 10, 2 * 10
    order = random.Random(0)
    results: dict[str, float] = {}
    print(f"torch {torch.__version__}, device {device}, every={every}, {rounds} rounds of "
          f"{steps} steps: median microseconds of each phase of a step (forward, backward, "
          "optimizer), plain and monitored, and how many steps each median is over")
    print(f"{'model':<12} {'steps':<14} {'forward':>9} {'backward':>9} {'optimizer':>9} "
          f"{'count':>6}")
    for name, make in _MODELS.items():
        model, step = make(device, phased=True)
        plain: list[tuple[int, int, int]] = []
        recorded: list[tuple[int, int, int]] = []
        skipped: list[tuple[int, int, int]] = []
        for _ in range(5):
            step([])
        for _ in range(rounds):
            cases = ["plain", "monitored"]
            order.shuffle(cases)  # (as `measure` does: neither always runs first)
            for case in cases:
                if case == "plain":
                    for _ in range(steps):
                        step(plain)
                    continue
                times: list[tuple[int, int, int]] = []
                with go.monitor(model, every=every) as mon:
                    for _ in range(_SETTLE):
                        step([])
                    first = mon.steps  # (each step here is one backward pass: one step)
                    for _ in range(steps):
                        step(times)
                # (after the block, nothing run between the timed steps: a step was recorded
                # if it left records)
                kept = {r.step for records in mon.history.values() for r in records}
                for k, row in enumerate(times):
                    (recorded if first + k in kept else skipped).append(row)
        for case, rows in (("plain", plain), ("recorded", recorded), ("not recorded", skipped)):
            medians = [statistics.median(column) / 1e3 for column in zip(*rows, strict=True)]
            results[f"{name} {case}"] = sum(medians)
            print(f"{name:<12} {case:<14} {medians[0]:>9.1f} {medians[1]:>9.1f} "
                  f"{medians[2]:>9.1f} {len(rows):>6}")
        # (one step recorded in `every`, from the medians: what a step costs on average,
        # without the rare slow steps of a shared machine that a block's time holds)
        ratio = (results[f"{name} recorded"] + (every - 1) * results[f"{name} not recorded"]) / (
            every * results[f"{name} plain"])
        results[f"{name} every={every}"] = ratio
        print(f"{name:<12} {'every=10':<14} {ratio:>8.3f}x (one step in {every} recorded)")
    return results


def _counted_steps(name: str, every: int, steps: int) -> None:
    """`steps` steps of model `name` (plain when `every` is 0, else in a monitor's steady
    state), callgrind counting only while they run."""
    import subprocess

    torch.set_num_threads(1)
    model, step = _MODELS[name]("cpu")

    def counting(on: bool) -> None:
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
                       check=True, capture_output=True)

    for _ in range(5):
        step()
    if every == 0:
        counting(True)
        for _ in range(steps):
            step()
        counting(False)
        return
    with go.monitor(model, every=every):
        for _ in range(_SETTLE + 2):
            step()
        counting(True)
        for _ in range(steps):
            step()
        counting(False)


def _main_instructions() -> dict[str, float]:
    import re
    import shutil
    import subprocess

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("--instructions needs valgrind (callgrind and callgrind_control) on PATH.")
    steps = {"small MLP": 20, "spiking": 10, "binarized": 10}

    def per_step(name: str, every: int) -> float:
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   "--callgrind-out-file=/dev/null", sys.executable, os.path.abspath(__file__),
                   "--counted-steps", name, str(every), str(steps[name])]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        match = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
        if match is None:
            sys.exit(f"no instruction count from valgrind:\n{done.stderr[-2000:]}")
        return int(match.group(1).replace(",", "")) / steps[name]

    results: dict[str, float] = {}
    print(f"torch {torch.__version__}, cpu: instructions per step (valgrind), a monitor's "
          "steady state")
    print(f"{'model':<12} {'plain':>12} {'every=1':>9} {'every=10':>9}")
    for name in _MODELS:
        plain = per_step(name, 0)
        ratios = [per_step(name, every) / plain for every in (1, 10)]
        results[f"{name} plain"] = plain
        results[f"{name} every=1"], results[f"{name} every=10"] = ratios
        print(f"{name:<12} {plain / 1e6:>10.2f} M {ratios[0]:>8.3f}x {ratios[1]:>8.3f}x")
    return results


if __name__ == "__main__":
    main()
