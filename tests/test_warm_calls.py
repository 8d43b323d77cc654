"""Every cell of the support matrix again, on modules already called once.

An op's first eager call is checked (captured tensors, inputs changed in place) and takes
the op's own path; a module rule's later calls take the generated fast path
(`gradoverride/_module_fastpath.py`) through a cached layout (`gradoverride/_layout.py`),
and grad_hook's later calls its eager fast paths. `test_support_matrix.py` builds a fresh
module for each cell, so here each cell's module is first called once (forward and
backward, with other inputs), and the cell must still give what the matrix says: the same
gradients as plain eager mode, or the same refusal.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import re
from collections.abc import Iterator

import pytest
import torch
from matrix_cases import CASES
from test_support_matrix import (
    KINDS,
    RUN,
    UP,
    X,
    _marks,
    assert_same,
    gradients,
)
from torch import nn

from gradoverride import _support_matrix as matrix

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated:DeprecationWarning",
    "ignore:The .grad attribute of a Tensor that is not a leaf",
)

# What a warm module changes: every context but scripting and export (no backward there);
# save/load and deepcopy are below, on the copy called twice.
CONTEXTS = [
    "eager", "compile", "compile dynamic", "torch.func.grad", "vmap", "functional_call",
    "checkpoint", "in-place after", "autocast", "threads",
]


def warm(module: nn.Module) -> nn.Module:
    """`module` after one forward and backward (other inputs, so nothing is reused)."""
    x = (X * 0.7).requires_grad_()
    (module(x) * UP).sum().backward()
    module.zero_grad()
    return module


@pytest.fixture
def warm_builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for kind, case in CASES.items():
        build = case.build
        monkeypatch.setitem(
            CASES, kind, dataclasses.replace(case, build=lambda build=build: warm(build()))
        )
    yield


@pytest.mark.parametrize(
    ("kind", "context"),
    [pytest.param(k, c, id=f"{k} | {c}", marks=_marks(c)) for k in KINDS for c in CONTEXTS],
)
def test_cell_on_a_warm_module(kind: str, context: str, warm_builds: None) -> None:
    if context.startswith("compile"):
        torch._dynamo.reset()
    refusal = matrix.REFUSED.get((kind, context))
    if refusal is None:
        RUN[context](kind)
        return
    with pytest.raises(Exception) as info:
        RUN[context](kind)
    names = {cls.__name__ for cls in type(info.value).__mro__}
    assert refusal.error in names, f"raised {type(info.value).__name__}: {info.value}"
    assert re.search(refusal.match, str(info.value), re.DOTALL), str(info.value)


@pytest.mark.parametrize("how", ["save/load", "deepcopy"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_copy_of_a_warm_module_called_twice(kind: str, how: str) -> None:
    saved = CASES[kind].saved
    expected = gradients(saved, X, UP)
    gradients(saved, X, UP)  # the original is warm too
    if how == "deepcopy":
        copied = copy.deepcopy(saved)
    else:
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    for _ in range(2):
        assert_same(gradients(copied, X, UP), expected)
    assert_same(gradients(saved, X, UP), expected)
