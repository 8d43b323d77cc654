"""Every script in examples/ runs, and the overhead benchmark's quick mode reports its lines."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT_S = 120


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, (
        f"{' '.join(args)} exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
    return result


def test_there_are_examples() -> None:
    assert any(p.name == "quickstart.py" for p in EXAMPLES)


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script: Path) -> None:
    result = _run(str(script.relative_to(ROOT)))
    if script.name == "quickstart.py":
        match = re.search(r"loss fell from ([-+0-9.eE]+) to ([-+0-9.eE]+)", result.stdout)
        assert match, f"no 'loss fell from A to B' line in:\n{result.stdout}"
        first, last = float(match.group(1)), float(match.group(2))
        assert last < first, f"loss did not fall: {first} -> {last}"


def test_overhead_benchmark_quick() -> None:
    out = _run("benchmarks/overhead.py", "--quick").stdout
    assert re.search(r"^\s*go\.custom_backward\s+[0-9.]+ us\s+ratio [0-9.]+\s*$", out, re.M), out
    assert re.search(r"^\s*rule naming nothing\b.*:\s*0\s*$", out, re.M), out
