"""What `import gradoverride` adds on top of `import torch`, and that it imports no TensorFlow.

Each case runs in fresh interpreters, which time their own imports with `time.perf_counter`
(the interpreter's start-up is not counted); the cases take turns in a shuffled order each
round (seeded), so a slow moment of the machine does not land on one case only. Prints the
median over the rounds (and min, max) of:

* `import gradoverride` after `import torch` (the contract: at most 50 ms), and
  `import gradoverride.recipes` after that; neither may load a `tensorflow` or `keras`
  module, whether TensorFlow is installed or not;
* for context, when TensorFlow is installed (not with `--quick`): `import gradoverride.keras`
  after `import gradoverride` (it loads TensorFlow and Keras), and after
  `import tensorflow, keras` (gradoverride's own share).

Then, from one `python -X importtime` run, the slowest imports of gradoverride and its
recipes (cumulative), which is where to look when a number grows.

With `--device cuda`, also whether any of the imports initialized CUDA (none may: a
process that only imports gradoverride must not take a GPU context).

    python benchmarks/import_cost.py [--quick] [--rounds N] [--device cuda]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import add_device_argument, synchronizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = ("tensorflow", "keras", "tf_keras")

# Times `after` once `before` is imported; reports which framework modules are loaded.
_PROBE = """
import json, sys, time
t0 = time.perf_counter()
{before}
t1 = time.perf_counter()
{after}
t2 = time.perf_counter()
frameworks = {frameworks!r}
loaded = sorted({{m.split(".")[0] for m in sys.modules if m.split(".")[0] in frameworks}})
cuda = bool(sys.modules["torch"].cuda.is_initialized()) if "torch" in sys.modules else False
print("PROBE " + json.dumps({{"before": t1 - t0, "after": t2 - t1, "loaded": loaded,
                             "cuda": cuda}}))
"""

# name -> (imported first, untimed; timed). The cases without "keras" must load no framework.
CASES: dict[str, tuple[str, str]] = {
    "import gradoverride (after torch)": ("import torch", "import gradoverride"),
    "import gradoverride.recipes (after gradoverride)": (
        "import torch, gradoverride",
        "import gradoverride.recipes",
    ),
    "import gradoverride.keras (after gradoverride)": (
        "import torch, gradoverride",
        "import gradoverride.keras",
    ),
    "import gradoverride.keras (after tensorflow, keras)": (
        "import torch, gradoverride, tensorflow, keras",
        "import gradoverride.keras",
    ),
}


def _env() -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def probe(before: str, after: str) -> dict[str, Any]:
    """One fresh interpreter: seconds for `before` and for `after`, and the frameworks
    loaded at the end."""
    code = _PROBE.format(before=before, after=after, frameworks=FRAMEWORKS)
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"the probe failed:\n{code}\n{result.stderr[-3000:]}")
    line = next(x for x in result.stdout.splitlines() if x.startswith("PROBE "))
    report: dict[str, Any] = json.loads(line.removeprefix("PROBE "))
    return report


def slowest_imports(statement: str, package: str, count: int) -> list[tuple[float, str]]:
    """The `count` largest cumulative import times (seconds) of `package`'s modules in one
    `python -X importtime -c statement` run."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    rows = []
    for line in result.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        name = parts[2].strip()
        if name == package or name.startswith(package + "."):
            rows.append((int(parts[1]) / 1e6, name))
    return sorted(rows, reverse=True)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for the test suite)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 15; 3 quick)")
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device != "cpu":
        synchronizer(args.device)  # a clear exit where torch cannot use that GPU
    rounds = args.rounds or (3 if args.quick else 15)
    has_tf = importlib.util.find_spec("tensorflow") is not None
    # Each TensorFlow case takes seconds (TensorFlow's own import): left out when quick.
    names = [n for n in CASES if "keras" not in n or (has_tf and not args.quick)]
    torch_only = [n for n in names if "keras" not in n]
    print(f"python {sys.version.split()[0]}; fresh interpreters per case: {rounds}")
    if not has_tf:
        print("TensorFlow is not installed: the gradoverride.keras cases are skipped")
    elif args.quick:
        print("--quick: the gradoverride.keras cases are skipped")

    seconds: dict[str, list[float]] = {n: [] for n in names}
    loaded: dict[str, set[str]] = {n: set() for n in names}
    cuda_initialized: set[str] = set()
    torch_seconds: list[float] = []
    order = random.Random(0)
    for _ in range(rounds):
        shuffled = names[:]
        order.shuffle(shuffled)
        for name in shuffled:
            report = probe(*CASES[name])
            seconds[name].append(report["after"])
            loaded[name].update(report["loaded"])
            if report["cuda"]:
                cuda_initialized.add(name)
            if name == names[0]:
                torch_seconds.append(report["before"])

    print(f"\nimport torch (for scale): {statistics.median(torch_seconds) * 1e3:.1f} ms")
    for name in names:
        times = sorted(seconds[name])
        frameworks = ", ".join(sorted(loaded[name])) or "none"
        print(
            f"{name}: {statistics.median(times) * 1e3:.1f} ms "
            f"(min {times[0] * 1e3:.1f}, max {times[-1] * 1e3:.1f}); "
            f"tensorflow/keras modules loaded: {frameworks}"
        )
    leaked = set().union(*(loaded[n] for n in torch_only))
    print(
        "no tensorflow/keras module imported by `import gradoverride` or "
        f"`import gradoverride.recipes`: "
        f"{'yes' if not leaked else 'NO (' + ', '.join(sorted(leaked)) + ')'}"
    )

    if args.device != "cpu":
        found = ", ".join(sorted(cuda_initialized))
        print(f"CUDA initialized by any of these imports: {'YES: ' + found if found else 'no'}")
    print(
        "\nslowest imports of gradoverride and its recipes after torch (cumulative, one "
        "-X importtime run):"
    )
    statement = "import torch; import gradoverride, gradoverride.recipes"
    for took, module in slowest_imports(statement, "gradoverride", 6):
        print(f"  {took * 1e3:8.1f} ms  {module}")
    if leaked:
        raise SystemExit("`import gradoverride` or its recipes imported TensorFlow or Keras")
    if cuda_initialized:
        raise SystemExit("an import initialized CUDA: " + ", ".join(sorted(cuda_initialized)))


if __name__ == "__main__":
    main()
