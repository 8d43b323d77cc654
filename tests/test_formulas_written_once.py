"""Each recipe formula is written once, in `gradoverride/recipes/_formulas/`, and every
framework runs that one copy: the backends (`gradoverride/_ops/`, `gradoverride/_tensorflow/`,
`gradoverride/_jax/`) hold array primitives and plumbing, no recipe math.

Read from the source (the laws below), so a formula copied back into a backend fails here
even when its values agree.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gradoverride
from gradoverride._ops._protocol import Backend

PACKAGE = Path(gradoverride.__file__).resolve().parent
FORMULAS = sorted((PACKAGE / "recipes" / "_formulas").glob("*.py"))
BACKEND_FILES = sorted(
    [*(PACKAGE / "_ops").glob("*.py"), *(PACKAGE / "_tensorflow").glob("*.py"),
     *(PACKAGE / "_jax").glob("*.py")]
)
#: What the Keras module side reads of the recipes (whether a transform is linear, a
#: schedule's step): class checks, no formula.
MODULE_SIDE_NAMES = {"GradientTransform", "_ScaledGradient", "_is_schedule"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _functions(tree: ast.AST) -> set[str]:
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def _formula_names() -> set[str]:
    names: set[str] = set()
    for path in FORMULAS:
        names |= {n for n in _functions(_tree(path)) if not n.startswith("_")}
    return names


def test_the_formulas_are_there() -> None:
    names = _formula_names()
    # one family each: a surrogate's derivative, quantize's codes, the norm clip, the
    # softmax backward of the straight-through argmax
    assert {"arctan", "codes", "clip_by_norm", "softmax_grad"} <= names, sorted(names)


def test_there_is_no_tensorflow_copy_of_the_recipes() -> None:
    assert not (PACKAGE / "_tensorflow" / "recipes.py").exists()


@pytest.mark.parametrize("path", BACKEND_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_backend_file_defines_a_formula(path: Path) -> None:
    primitives = {name for name in dir(Backend) if not name.startswith("_")}
    copied = (_functions(_tree(path)) & _formula_names()) - primitives
    assert not copied, (
        f"{path.name} defines {sorted(copied)}, the name of a formula in recipes/_formulas: "
        "write the math once there, over the backend's primitives"
    )


@pytest.mark.parametrize("path", BACKEND_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_backend_file_reads_a_recipe(path: Path) -> None:
    """A backend that imports a recipe class (other than the module side's class checks) is
    computing that recipe's math."""
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module and "recipes" in node.module:
            names = {alias.name for alias in node.names}
            assert names <= MODULE_SIDE_NAMES, (
                f"{path.name} imports {sorted(names - MODULE_SIDE_NAMES)} from "
                f"{node.module}: recipe math belongs in recipes/_formulas"
            )


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run (not those under `if TYPE_CHECKING:`, which only name types)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        found += [n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)]
    return found


@pytest.mark.parametrize("path", FORMULAS, ids=lambda p: p.name)
def test_a_formula_module_imports_no_framework(path: Path) -> None:
    allowed = {"__future__", "math", "typing", "collections.abc", "dataclasses"}
    for node in _runtime_imports(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.level:
            # the package's own: the backend protocol, or another formula module
            assert node.module == "_ops._protocol" or node.level == 1, (
                f"{path.name} imports {'.' * node.level}{node.module}"
            )
            continue
        modules = ({alias.name for alias in node.names} if isinstance(node, ast.Import)
                   else {node.module or ""})
        assert modules <= allowed, f"{path.name} imports {sorted(modules - allowed)}"
