"""The table `benchmarks/gpu.sh` prints: one row per timed case of each step's log (its
section, time and ratio), or the step's summary lines, with each step's status and time.

    python benchmarks/_gpu_table.py LOG_FOLDER STEP...
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# `  name   12.3 us   ratio 1.000`, `  name  1.2 ms   ratio to idiom 0.32 ...`, and ste's
# `  label  peer 1.0 ms   ours 0.9 ms   ratio 0.95`: the name, the first time, the ratio.
_TIMED = re.compile(
    r"^\s+(?P<name>.*?)\s+(?:peer\s+)?(?P<time>[\d.]+ (?:us|ms)).*?"
    r"ratio(?: to \w+)? (?P<ratio>[\d.]+)"
)
_SUMMARY = re.compile(
    r"\d+ (passed|failed|error)|grew by|held in linecache|^import gradoverride|"
    r"CUDA initialized|worst ratio"
)


def rows(step: str, log: str) -> list[tuple[str, str, str, str]]:
    """(section, case, time, ratio) per line of `log` worth a row."""
    found: list[tuple[str, str, str, str]] = []
    section = ""
    for line in log.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith(":"):
            section = line.strip().rstrip(":")
            continue
        timed = _TIMED.match(line)
        if timed and step != "tests":
            found.append((section, timed["name"].strip(), timed["time"], timed["ratio"]))
        elif _SUMMARY.search(line):
            found.append((section, line.strip().strip("="), "", ""))
    return found


def main() -> None:
    folder, steps = Path(sys.argv[1]), sys.argv[2:]
    print("\n| step | section | case | time | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for step in steps:
        status_file = folder / f"{step}.status"
        status, took = (status_file.read_text().split() if status_file.exists()
                        else ("not run", "0"))
        label = f"{step} ({status}, {took}s)"
        log_file = folder / f"{step}.log"
        log = log_file.read_text(errors="replace") if log_file.exists() else ""
        found = rows(step, log)
        if status != "ok" or not found:
            # Why it did not give figures: its last lines.
            tail = [x.strip() for x in log.splitlines() if x.strip()][-2:]
            found += [("", line.replace("|", "/"), "", "") for line in tail]
        for section, case, time, ratio in found:
            print(f"| {label} | {section} | {case} | {time} | {ratio} |")
            label = ""
    print(f"\nfull logs: {folder}")


if __name__ == "__main__":
    main()
