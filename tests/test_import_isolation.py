"""`import gradoverride` never imports TensorFlow, Keras or JAX (DESIGN §2.8, §2.11); only
`import gradoverride.keras` imports TensorFlow and Keras, and only a JAX array reaching an
op loads gradoverride's JAX backend.

Each check runs in a fresh interpreter, since this pytest process may already hold
TensorFlow (imported by the TensorFlow tests). The first test needs no TensorFlow at all;
the second skips without it, unless `GRADOVERRIDE_REQUIRE_TENSORFLOW=1` (set by `.ci/run`),
where a missing TensorFlow fails it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: The top-level packages that must stay out of `sys.modules` (tf_keras: Keras 2, which
#: TensorFlow loads for `TF_USE_LEGACY_KERAS=1`; jaxlib: JAX's compiled half).
FRAMEWORKS = ("tensorflow", "keras", "tf_keras", "jax", "jaxlib")

_REPORT = """
import json, sys
frameworks = {frameworks!r}
loaded = sorted(
    {{m.split(".")[0] for m in sys.modules if m.split(".")[0] in frameworks}}
    | ({{"gradoverride._tensorflow", "gradoverride._jax"}} & set(sys.modules))
)
print("REPORT " + json.dumps(loaded))
"""

_IMPORTS = """
import gradoverride
import gradoverride.recipes
import gradoverride.testing
"""

_TORCH_USE = """
import torch
import gradoverride as go
from gradoverride import recipes

@go.custom_backward
def quantize(x, bits=2):
    s = 2 ** bits
    return torch.round(x * s) / s

@quantize.backward
def _(grad, *, x):
    return grad * (x.abs() <= 1)

x = torch.linspace(-2.0, 2.0, 9, requires_grad=True)
quantize(x).sum().backward()
assert torch.equal(x.grad, (x.abs() <= 1).float()), x.grad
for recipe in (
    recipes.reverse_grad(scale=0.5),
    recipes.spike(surrogate="fast_sigmoid"),
    recipes.quantize(bits=4),
    recipes.ste_round(),
):
    x.grad = None
    recipe(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all(), (recipe, x.grad)
assert gradoverride.testing.saved_bytes(quantize, x) > 0
"""


def _loaded_after(*codes: str) -> list[list[str]]:
    """The frameworks (top-level packages) and gradoverride's TensorFlow and JAX backends
    that one fresh interpreter holds after running each of `codes`, in turn."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    report = _REPORT.format(frameworks=FRAMEWORKS)
    result = subprocess.run(
        [sys.executable, "-c", "".join(code + report for code in codes)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, (
        f"the subprocess exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert len(lines) == len(codes), result.stdout
    loaded: list[list[str]] = [json.loads(line.removeprefix("REPORT ")) for line in lines]
    return loaded


HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str]]:
    """What one fresh interpreter holds after the imports, after torch calls, and (with
    TensorFlow installed) after `import gradoverride.keras`: one interpreter for all three,
    since each start imports torch (and the last one TensorFlow), seconds each."""
    stages = {"imports": _IMPORTS, "torch calls": _TORCH_USE}
    if HAS_TENSORFLOW:
        stages["gradoverride.keras"] = "import gradoverride.keras\n"
    return dict(zip(stages, _loaded_after(*stages.values()), strict=True))


def test_gradoverride_and_torch_ops_do_not_import_tensorflow(
    loaded: dict[str, list[str]],
) -> None:
    # The imports alone, and then every kind of call on torch tensors: a custom_backward op,
    # recipes (forward and backward) and gradoverride.testing. None may reach for TensorFlow,
    # Keras, JAX or gradoverride's TensorFlow and JAX backends, installed or not.
    assert loaded["imports"] == []
    assert loaded["torch calls"] == []


def test_gradoverride_keras_imports_tensorflow_and_keras(loaded: dict[str, list[str]]) -> None:
    if not HAS_TENSORFLOW:
        if os.environ.get("GRADOVERRIDE_REQUIRE_TENSORFLOW") == "1":
            pytest.fail("GRADOVERRIDE_REQUIRE_TENSORFLOW=1 but TensorFlow is not installed")
        pytest.skip("TensorFlow is not installed (pip install 'gradoverride[tensorflow]')")
    assert "tensorflow" in loaded["gradoverride.keras"]
    assert "keras" in loaded["gradoverride.keras"]


_SUBPACKAGES_AS_ATTRIBUTES = """
import json, sys
import gradoverride as go
seen = {"after import": sorted(m for m in ("torch._dynamo", "tensorflow", "keras", "jax",
                                            "gradoverride.recipes", "gradoverride.testing")
                               if m in sys.modules)}
seen["in dir"] = [name for name in ("recipes", "testing", "keras") if name in dir(go)]
seen["recipes"] = repr(go.recipes.spike())
seen["testing"] = go.testing.check_backward.__module__
seen["after recipes and testing"] = sorted(m for m in ("tensorflow", "keras") if m in sys.modules)
if HAS_TENSORFLOW:
    seen["keras"] = go.keras.Spike.__module__
try:
    go.recipe
except AttributeError as error:
    seen["misspelled"] = str(error)
print("SEEN " + json.dumps(seen))
"""


def test_subpackages_are_attributes_loaded_on_first_use() -> None:
    # `go.recipes.X`, `go.testing.X` and `go.keras.X` work after a bare `import gradoverride`,
    # which itself loads none of them, nor torch._dynamo, TensorFlow or Keras.
    code = f"HAS_TENSORFLOW = {HAS_TENSORFLOW!r}\n" + _SUBPACKAGES_AS_ATTRIBUTES
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("SEEN "))
    seen = json.loads(line.removeprefix("SEEN "))
    assert seen["after import"] == []
    # (`keras` is listed only where it can be imported: help() imports what is listed)
    assert seen["in dir"] == ["recipes", "testing", *(["keras"] if HAS_TENSORFLOW else [])]
    assert seen["recipes"].startswith("spike(surrogate='arctan'")
    assert seen["testing"].startswith("gradoverride.testing")
    assert seen["after recipes and testing"] == []
    if HAS_TENSORFLOW:
        assert seen["keras"] == "gradoverride.keras"
    assert seen["misspelled"] == "module 'gradoverride' has no attribute 'recipe'"


def test_gradoverride_keras_without_tensorflow_says_what_to_install(tmp_path: Path) -> None:
    # A `tensorflow` package that fails to import stands in for a machine without TensorFlow.
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text("raise ImportError('no tensorflow')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-c", "import gradoverride.keras"], cwd=ROOT, env=env,
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 1
    assert ("ImportError: gradoverride.keras needs TensorFlow and Keras 3: pip install "
            "'gradoverride[tensorflow]'") in result.stderr, result.stderr[-2000:]


def test_help_works_without_the_optional_frameworks() -> None:
    # help() imports every name a module lists: without TensorFlow (or a trainer), the
    # pages of gradoverride and gradoverride.diagnostics still render.
    code = (
        "import sys\n"
        "for name in ('tensorflow', 'keras', 'lightning', 'pytorch_lightning', "
        "'transformers'):\n"
        "    sys.modules[name] = None\n"
        "import pydoc, gradoverride\n"
        "top = pydoc.render_doc(gradoverride)\n"
        "diagnostics = pydoc.render_doc(gradoverride.diagnostics)\n"
        "print('custom_backward' in top, 'monitor' in diagnostics, "
        "'class LightningMonitor' in diagnostics)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.split() == ["True", "True", "False"], result.stderr
