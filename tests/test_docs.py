"""Every Python block on the docs site and in the README runs as written, on its own, and
prints what the page shows: each `print(...)` is followed by its output as `#> ` lines (or a
string block for long output), which pytest-examples compares with what the block printed.

`pytest tests/test_docs.py --update-examples` writes the printed output into the pages
(check the diff: that is the page changing, not the test passing).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pytest_examples import CodeExample, EvalExample, find_examples

import gradoverride

ROOT = Path(__file__).resolve().parent.parent
# The package being tested (the installed one, where the source tree is not importable).
PACKAGE = Path(gradoverride.__file__).resolve().parent
# The docs pages, the README, and the docstrings (the API reference renders their blocks).
PAGES = [ROOT / "README.md", ROOT / "docs", PACKAGE]
EXAMPLES = list(find_examples(*PAGES))

_NO_TENSORFLOW = (
    importlib.util.find_spec("tensorflow") is None
    and os.environ.get("GRADOVERRIDE_REQUIRE_TENSORFLOW") != "1"
)
_TENSORFLOW_MARKERS = ("import tensorflow", "gradoverride.keras", "import keras")
# The JAX page's blocks (the `jax` extra): they skip without JAX, unless CI requires it.
_NO_JAX = (
    importlib.util.find_spec("jax") is None
    and os.environ.get("GRADOVERRIDE_REQUIRE_JAX") != "1"
)
_JAX_MARKERS = ("import jax",)
# The trainers and loggers the diagnostics page hooks the monitor into (the `integrations`
# extra): their blocks skip where the package is missing, unless CI requires them.
_INTEGRATIONS = {
    "from torch.utils.tensorboard": "tensorboard",
    "import lightning": "lightning",
    "import transformers": "transformers",
}
# The spiking peers (the `peers` extra, not required anywhere): their blocks skip without them.
_PEERS = {"import snntorch": "snntorch", "import spikingjelly": "spikingjelly"}
_REQUIRE_INTEGRATIONS = os.environ.get("GRADOVERRIDE_REQUIRE_INTEGRATIONS") == "1"
# The ONNX exporters' packages (the `export` extra; the deployment page): their blocks skip
# where a package is missing, unless CI requires them.
_EXPORT = {
    "import onnxruntime": "onnxruntime",
    "torch.onnx.export": "onnx",
    "dynamo=True": "onnxscript",
}
_REQUIRE_EXPORT = os.environ.get("GRADOVERRIDE_REQUIRE_EXPORT") == "1"


def _relative(path: Path) -> str:
    base = ROOT if path.is_relative_to(ROOT) else PACKAGE.parent
    return path.relative_to(base).as_posix()


def _id(example: CodeExample) -> str:
    return f"{_relative(example.path)}:{example.start_line}"


def test_the_pages_have_examples() -> None:
    pages = {_relative(example.path) for example in EXAMPLES}
    assert "README.md" in pages
    assert len(pages) >= 8, sorted(pages)


# torch.compile itself instantiates autograd Functions (a DeprecationWarning inside torch),
# as the compile tests also allow.
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
# Lightning's, about torch's pytree, and the HuggingFace Trainer's DataLoader on a CPU.
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
# torch deprecates TorchScript (the deployment page; inductor uses it internally too) and
# its ONNX exporter, on every call.
@pytest.mark.filterwarnings("ignore:`torch.jit.[a-z_]*` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(
    "ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning"
)
@pytest.mark.filterwarnings("ignore:The feature will be removed:DeprecationWarning")
# TensorFlow 2.21 deprecates `tf.lite.Interpreter` (for LiteRT) on every use.
@pytest.mark.filterwarnings("ignore:\\s*Warning. tf.lite.Interpreter is deprecated:UserWarning")
@pytest.mark.parametrize("example", EXAMPLES, ids=_id)
def test_example_runs_and_prints_what_the_page_shows(
    example: CodeExample, eval_example: EvalExample
) -> None:
    if _NO_TENSORFLOW and any(marker in example.source for marker in _TENSORFLOW_MARKERS):
        pytest.skip("TensorFlow is not installed (pip install 'gradoverride[tensorflow]')")
    if _NO_JAX and any(marker in example.source for marker in _JAX_MARKERS):
        pytest.skip("JAX is not installed (pip install 'gradoverride[jax]')")
    for marker, package in _INTEGRATIONS.items():
        if (marker in example.source and not _REQUIRE_INTEGRATIONS
                and importlib.util.find_spec(package) is None):
            pytest.skip(f"{package} is not installed (pip install 'gradoverride[integrations]')")
    for marker, package in _EXPORT.items():
        if (marker in example.source and not _REQUIRE_EXPORT
                and importlib.util.find_spec(package) is None):
            pytest.skip(f"{package} is not installed (pip install 'gradoverride[export]')")
    if "aoti_compile_and_package" in example.source and not any(
        map(shutil.which, ("c++", "g++", "clang++"))
    ):
        pytest.skip("AOTInductor needs a C++ compiler, and this machine has none")
    for marker, package in _PEERS.items():
        if marker in example.source and importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (pip install 'gradoverride[peers]')")
    eval_example.set_config(line_length=100)
    try:
        if eval_example.update_examples:
            eval_example.run_print_update(example)
        else:
            eval_example.run_print_check(example)
    except Exception as error:
        # pytest-examples re-raises with frames rewritten to the page's lines, which pytest
        # cannot render on Python 3.11 (an INTERNALERROR that ends the session): say where it
        # failed from the frames' line numbers alone.
        raise AssertionError(_where_it_failed(error)) from None


def _numpy_dispatch() -> list[str]:
    """The SIMD code paths numpy chose on this CPU beyond its baseline (`AVX512_SKX`, ...)."""
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # numpy 1.x
        from numpy.core import _multiarray_umath as umath  # type: ignore[no-redef]
    return [f for f in umath.__cpu_dispatch__ if umath.__cpu_features__.get(f)]


_NUMPY_EXAMPLES = [e for e in EXAMPLES if "import numpy" in e.source]


def test_numpy_examples_print_the_same_on_any_cpu() -> None:
    # numpy's float32 transcendental functions (`arctan2`, `degrees`, `exp`) take a SIMD path
    # chosen by the CPU, and their last bits differ between paths: a page printing them would
    # pass on one machine and fail on another. Run every example that uses numpy again with
    # numpy held to its baseline path (what an older CPU runs).
    dispatched = _numpy_dispatch()
    if not dispatched:
        pytest.skip("numpy runs its baseline code path on this CPU already")
    assert _NUMPY_EXAMPLES, "no docs example imports numpy: update this test"
    here = Path(__file__).resolve()
    node = f"{here}::test_example_runs_and_prints_what_the_page_shows"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *(f"{node}[{_id(e)}]" for e in _NUMPY_EXAMPLES)],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env={**os.environ, "NPY_DISABLE_CPU_FEATURES": " ".join(dispatched)},
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def _where_it_failed(error: BaseException) -> str:
    lines = []
    tb = error.__traceback__
    while tb is not None:
        lines.append(f"  {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}")
        tb = tb.tb_next
    frames = "\n".join(lines)
    return f"the example raised {type(error).__name__}: {error}\n{frames}"


def _slug(heading: str) -> str:
    """The anchor MkDocs' toc extension gives a heading (its default slugify)."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_readme_links_reach_files_and_headings() -> None:
    # The README is read on a forge, outside the docs site: its relative links must work.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#:]+)(?:#([^)]+))?\)", readme)
    assert len(links) >= 10, links
    for target, anchor in links:
        path = ROOT / target
        assert path.exists(), f"README.md links to {target}, which does not exist"
        if anchor:
            assert anchor in _anchors(path), f"README.md links to {target}#{anchor}: no heading"


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("a module with its own backward", "go.Module"),
        ("connect two broken graphs", "go.bridge"),
        ("numpy or a solver in the middle", "go.bridge"),
        ("a module or model you did not write", "go.override_backward"),
        ("a module or model you did not write", "go.grad_hook"),
        ("the gradient of a tensor already computed", "register_hook"),
        ("the gradient of a tensor already computed", "recipes.reverse_grad()(y)"),
        ("the same in TensorFlow", "gradoverride.keras"),
        ("see every override in a model", "go.overrides(model)"),
        ("what each one does while training", "go.monitor(model)"),
    ],
)
def test_readme_table_answers_what_people_ask(question: str, answer: str) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme.splitlines() if line.startswith("|") and question in line]
    assert rows, f"the README's table has no row for {question!r}"
    assert any(answer in row for row in rows), f"{question!r} does not point to {answer}"


def test_readme_is_a_short_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 200, len(lines)
    assert lines[0] == "# gradoverride"


def test_every_output_line_follows_a_print() -> None:
    # pytest-examples compares only the `#>` lines right after a print: a `#>` line after
    # any other statement would be shown on the page and never checked.
    for example in EXAMPLES:
        lines = example.source.splitlines()
        print_ends = {
            node.end_lineno
            for node in ast.walk(ast.parse(example.source))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"
        }
        previous = 0
        for number, line in enumerate(lines, start=1):
            stripped = line.strip()
            if stripped.startswith("#>"):
                assert previous in print_ends, (
                    f"{_id(example)}: the `#>` line {example.start_line + number} does not "
                    "follow a print"
                )
            elif stripped and not stripped.startswith("#"):
                previous = number


def _api_names(page: str) -> set[str]:
    text = (ROOT / "docs" / "api" / page).read_text(encoding="utf-8")
    return set(re.findall(r"^::: ([\w.]+)$", text, re.M))


@pytest.mark.parametrize(
    ("module_name", "page"),
    [("gradoverride", "core.md"), ("gradoverride.recipes", "recipes.md"),
     ("gradoverride.testing", "testing.md"), ("gradoverride.keras", "keras.md")],
)
def test_the_api_reference_has_every_public_name(module_name: str, page: str) -> None:
    import importlib

    if module_name == "gradoverride.keras" and _NO_TENSORFLOW:
        pytest.skip("TensorFlow is not installed (pip install 'gradoverride[tensorflow]')")
    module = importlib.import_module(module_name)
    public = {n for n in module.__all__ if not n.startswith("__")}
    documented = {name.rsplit(".", 1)[-1] for name in _api_names(page)
                  if name.startswith(module_name + ".")}
    missing = sorted(public - documented)
    assert not missing, f"docs/api/{page} lacks {missing}: add `::: {module_name}.<name>`"


def test_docstrings_fence_their_code() -> None:
    # An rst literal block (`Example::` and an indented block) renders as a paragraph ending in
    # "::" on the docs site and is never run; a fenced ```python block is both highlighted and
    # run by the test above.
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            code = line.split("#", 1)[0]
            assert not code.rstrip().endswith("::"), (
                f"{_relative(path)}:{number} starts an rst literal block; fence it"
            )
    docstring_examples = [e for e in EXAMPLES if e.path.suffix == ".py"]
    assert len(docstring_examples) >= 30, len(docstring_examples)
