"""The package's layout: the torch side never imports a framework backend (it asks
`gradoverride._backends`), and the import graph has no cycle, counting the imports inside
functions too. Read from the source, so it holds whatever is installed."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from pathlib import Path

import pytest

import gradoverride

# The package being tested (the installed one, where the source tree is not importable).
PACKAGE = Path(gradoverride.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those under `if TYPE_CHECKING:` (never imported at run time)."""
    nodes: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def _imports(path: Path) -> set[str]:
    """The gradoverride modules `path` imports at run time, anywhere in it (functions too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            targets = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found.update(t for t in targets if t.startswith("gradoverride"))
    return found


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {
    name: {t for t in _imports(path) if t in MODULES and t != name}
    for name, path in MODULES.items()
}


def test_the_torch_side_never_imports_a_framework_backend() -> None:
    offenders = {
        name: sorted(t for t in targets if t.startswith("gradoverride._tensorflow"))
        for name, targets in GRAPH.items()
        if not name.startswith(("gradoverride._tensorflow", "gradoverride.keras"))
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_import_graph_has_no_cycle() -> None:
    # Parent packages are left out: `gradoverride.x` imports `gradoverride` implicitly.
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(GRAPH[name]):
            if name.startswith(target + ".") or target == "gradoverride":
                continue
            if state.get(target) == 1:
                cycle = [*path[path.index(target):], target] if target in path else [name, target]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if state.get(target) is None:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(GRAPH):
        if state.get(name) is None:
            visit(name, [name])


def test_the_tensorflow_backend_provides_every_entry_point() -> None:
    from gradoverride import _backends

    if importlib.util.find_spec("tensorflow") is None:
        if os.environ.get("GRADOVERRIDE_REQUIRE_TENSORFLOW") == "1":
            pytest.fail("GRADOVERRIDE_REQUIRE_TENSORFLOW=1 but TensorFlow is not installed")
        pytest.skip("TensorFlow is not installed (pip install 'gradoverride[tensorflow]')")
    backend = _backends.backend("tensorflow")
    from gradoverride._ops import Backend

    missing = [
        name for name in _backends.ENTRY_POINTS
        if not (callable(getattr(backend, name)) or isinstance(getattr(backend, name), Backend))
    ]
    assert not missing, missing


ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def _layout_entries() -> dict[str, str]:
    """The package's entries in the layout block of docs/architecture.md: each file or
    subpackage named at the start of a line, with the text describing it."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    block = text.split("```text\ngradoverride/\n", 1)[1].split("\ntests/", 1)[0]
    entries: dict[str, str] = {}
    name = ""
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            name, _, rest = line.strip().partition(" ")
            entries[name] = rest
        elif name:
            entries[name] += " " + line.strip()
    return entries


def test_the_architecture_page_names_every_module_and_nothing_else() -> None:
    if not ARCHITECTURE.exists():
        pytest.skip("docs/architecture.md is not here (an installed package)")
    entries = _layout_entries()
    top = {p.name for p in PACKAGE.glob("*.py")} | {
        f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()
    }
    assert set(entries) == top, (
        f"docs/architecture.md lists {sorted(set(entries) - top)} that are not in the package "
        f"and misses {sorted(top - set(entries))}"
    )
    for name, described in entries.items():
        if not name.endswith("/"):
            continue
        files = {p.name for p in (PACKAGE / name).glob("*.py")} - {"__init__.py"}
        named = set(re.findall(r"\b\w+\.py\b", described))
        assert named == files, (
            f"docs/architecture.md's {name} lists {sorted(named - files)} that are not there "
            f"and misses {sorted(files - named)}"
        )


def test_every_subpackage_is_in_the_distributions() -> None:
    # setuptools lists the packages by hand: a subpackage missing there is missing from the
    # wheel and the sdist's install (its imports fail only after installing).
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    package = Path(gradoverride.__file__).resolve().parent  # (the installed one, in CI's sdist run)
    found = {
        ".".join(init.parent.relative_to(package.parent).parts)
        for init in package.rglob("__init__.py")
    }
    assert found == listed
