"""README examples run: the first ```python block under each listed heading is executed, and
where a ```text block follows it, that is what the code prints (tiny float values masked)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
# Headings whose example must run; add yours.
_NO_TENSORFLOW = (
    importlib.util.find_spec("tensorflow") is None
    and os.environ.get("GRADOVERRIDE_REQUIRE_TENSORFLOW") != "1"
)
SECTIONS = [
    "Testing your rule",
    "Gradient flow, bridges and black-box solvers",
    "Straight-through estimators and surrogate gradients",
    pytest.param(
        "TensorFlow",
        marks=pytest.mark.skipif(
            _NO_TENSORFLOW,
            reason="TensorFlow is not installed (pip install 'gradoverride[tensorflow]')",
        ),
    ),
]
_SMALL_FLOAT = re.compile(r"\d(?:\.\d+)?e-\d+")


def _section(heading: str) -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def _blocks(section: str) -> list[tuple[str, str]]:
    """The fenced blocks of a section, as (language, code)."""
    return re.findall(r"^```(\w*)\n(.*?)^```", section, re.M | re.S)


@pytest.mark.parametrize("heading", SECTIONS)
def test_readme_example_runs(heading: str) -> None:
    blocks = _blocks(_section(heading))
    languages = [language for language, _ in blocks]
    assert "python" in languages, f"the '{heading}' section has no ```python block"
    index = languages.index("python")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[index][1], f"README.md ({heading})", "exec"), {})
    if index + 1 < len(blocks) and blocks[index + 1][0] == "text":
        shown = _SMALL_FLOAT.sub("<small>", blocks[index + 1][1]).rstrip()
        printed = _SMALL_FLOAT.sub("<small>", out.getvalue()).rstrip()
        assert printed == shown, f"the README shows:\n{shown}\nthe code prints:\n{printed}"
