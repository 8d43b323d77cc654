"""`gradoverride.keras.Layer` on Keras' JAX and torch backends.

Keras fixes its backend when it is first imported, so each backend runs in one fresh
interpreter (a module-scoped fixture, one per backend) that does every check and prints the
numbers; the tests here compare them with the rule worked out by hand in numpy (the
layer's forward is `sin(x) * w + b`, its rule treats `sin` as the identity, so the true
gradient, through `cos`, would fail them). The page's example (docs/keras.md) runs in the
same interpreters and must print what the page shows.

JAX: skipped without JAX (an error under GRADOVERRIDE_REQUIRE_JAX=1, as tests/test_jax.py);
both skip without Keras, unless GRADOVERRIDE_REQUIRE_TENSORFLOW=1 (Keras comes with the
`tensorflow` extra), as tests/tf_support.py does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "keras.md"

_HAS_KERAS = importlib.util.find_spec("keras") is not None
_HAS_JAX = importlib.util.find_spec("jax") is not None


def _require_keras() -> None:
    if not _HAS_KERAS:
        if os.environ.get("GRADOVERRIDE_REQUIRE_TENSORFLOW") == "1":
            pytest.fail("GRADOVERRIDE_REQUIRE_TENSORFLOW=1 but Keras is not installed")
        pytest.skip("Keras is not installed (pip install 'gradoverride[tensorflow]')")


def _require_jax() -> None:
    _require_keras()
    if not _HAS_JAX:
        if os.environ.get("GRADOVERRIDE_REQUIRE_JAX") == "1":
            pytest.fail("GRADOVERRIDE_REQUIRE_JAX=1 but JAX is not installed")
        pytest.skip("JAX is not installed (pip install 'gradoverride[jax]')")


# ---- the numbers every backend must give ---------------------------------------------------

X = np.array([[1.0, 2.0], [3.0, -1.0]], np.float32)
C = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)  # the loss is sum(y * C)
W0 = np.array([1.5, -0.5], np.float32)
KERNEL = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
LR = 0.1


def _rule(x: np.ndarray, grad: np.ndarray, w: np.ndarray) -> dict[str, np.ndarray]:
    """The layer's rule, by hand: sin taken as the identity."""
    return {"x": grad * w, "w": (grad * x).sum(0), "b": grad.sum(0)}


def _fit_step() -> dict[str, np.ndarray]:
    """One SGD step of `Dense(2) -> SineSTE` on (X, 0) with the mean squared error."""
    h = X @ KERNEL
    y = np.sin(h) * W0
    grad = 2 * y / y.size
    rule = _rule(h, grad, W0)
    return {
        "kernel": KERNEL - LR * X.T @ rule["x"],
        "dense_bias": -LR * rule["x"].sum(0),
        "w": W0 - LR * rule["w"],
        "b": -LR * rule["b"],
    }


# ---- the script each backend runs ----------------------------------------------------------

_COMMON = """
import contextlib, io, json, os, sys
import numpy as np
import keras
from keras import ops
import gradoverride as go
from gradoverride.keras import GradientReversal, Layer, Quantize, Spike

RESULTS = {}

def put(name, value):
    RESULTS[name] = value.tolist() if hasattr(value, "tolist") else value

def numpy(value):
    return np.asarray(ops.convert_to_numpy(value), np.float64)

def error_text(run):
    try:
        run()
    except go.GradOverrideError as error:
        return str(error)
    return "no error"

class SineSTE(Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],),
                                 initializer=keras.initializers.Constant(W0), name="w")
        self.b = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="b")

    def call(self, x):
        return ops.sin(x) * self.w + self.b

    def backward(self, grad, *, x):
        return {"x": grad * self.w, "w": ops.sum(grad * x, axis=0), "b": ops.sum(grad, axis=0)}

class OwnsX(SineSTE, owns="x"):  # the variables keep their ordinary gradient
    def backward(self, grad, *, x):
        return {"x": grad * self.w}

class LeavesOutW(SineSTE):
    def backward(self, grad, *, x):
        return {"x": grad, "b": ops.sum(grad, axis=0)}

class Misnamed(SineSTE):
    def backward(self, grad, *, x):
        return {"x": grad, "weight": grad, "b": ops.sum(grad, axis=0)}

class Extra(SineSTE):
    def backward(self, grad, *, x):
        return {"x": grad, "w": ops.sum(grad, axis=0), "b": ops.sum(grad, axis=0), "c": grad}

class Stat(SineSTE):  # reads a non-trainable variable, in call and in backward
    def build(self, input_shape):
        super().build(input_shape)
        self.m = self.add_weight(shape=(input_shape[-1],), initializer="ones",
                                 trainable=False, name="m")

    def call(self, x):
        return ops.sin(x) * self.w * self.m + self.b

    def backward(self, grad, *, x):
        return {"x": grad * self.w * self.m, "w": ops.sum(grad * x * self.m, axis=0),
                "b": ops.sum(grad, axis=0)}

def fit_step():
    dense = keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(KERNEL))
    layer = SineSTE()
    model = keras.Sequential([keras.Input((2,)), dense, layer])
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    model.fit(X, np.zeros_like(X), batch_size=2, epochs=1, verbose=0)
    put("fit", {"kernel": numpy(dense.kernel).tolist(), "dense_bias": numpy(dense.bias).tolist(),
                "w": numpy(layer.w).tolist(), "b": numpy(layer.b).tolist()})

def run_docs_example():
    page = open(PAGE, encoding="utf-8").read()
    section = page.split("## Keras on the JAX and torch backends", 1)[1]
    block = section.split("```python\\n", 1)[1].split("```", 1)[0]
    shown = [line.strip()[3:] for line in block.splitlines() if line.strip().startswith("#> ")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, str(PAGE), "exec"), {"__name__": "docs_keras"})
    put("docs", {"shown": shown, "printed": printed.getvalue().splitlines()})
"""

_JAX_CHECKS = """
put("tensorflow imported", "tensorflow" in sys.modules)
import jax, jax.numpy as jnp

layer = SineSTE()
layer(jnp.asarray(X))
trainable = [v.value for v in layer.trainable_variables]

def loss(trainable, x, layer=layer):
    out, _ = layer.stateless_call(trainable, [], x)
    return jnp.sum(out * C)

for mode, grad_fn in (("eager", jax.grad(loss, argnums=(0, 1))),
                      ("jit", jax.jit(jax.grad(loss, argnums=(0, 1))))):
    (gw, gb), gx = grad_fn(trainable, jnp.asarray(X))
    put(f"stateless {mode}", {"x": numpy(gx).tolist(), "w": numpy(gw).tolist(),
                              "b": numpy(gb).tolist()})

owns = OwnsX()
owns(jnp.asarray(X))
(gw, gb), gx = jax.grad(lambda t, x: loss(t, x, owns), argnums=(0, 1))(
    [v.value for v in owns.trainable_variables], jnp.asarray(X))
put("owns", {"x": numpy(gx).tolist(), "w": numpy(gw).tolist(), "b": numpy(gb).tolist()})

for name, cls in (("leaves out", LeavesOutW), ("misnamed", Misnamed), ("extra", Extra)):
    bad = cls()
    bad(jnp.asarray(X))
    put(name, error_text(lambda: jax.grad(lambda t: loss(t, jnp.asarray(X), bad))(
        [v.value for v in bad.trainable_variables])))

# The values stateless_call passes (m = 3; the variable holds 1) are what call and backward
# read; a frozen layer's variables get no gradient, its input still the rule's.
stat = Stat()
stat.build((2, 2))
m3 = [jnp.full((2,), 3.0)]
(gw, gb), gx = jax.jit(jax.grad(
    lambda t, x: jnp.sum(stat.stateless_call(t, m3, x)[0] * C), argnums=(0, 1)))(
    [v.value for v in stat.trainable_variables], jnp.asarray(X))
put("statistic", {"x": numpy(gx).tolist(), "w": numpy(gw).tolist(), "b": numpy(gb).tolist()})
stat.trainable = False
gx = jax.jit(jax.grad(
    lambda x: jnp.sum(stat.stateless_call([], [v.value for v in stat.variables[:2]] + m3,
                                          x)[0] * C)))(jnp.asarray(X))
put("frozen", numpy(gx).tolist())

class Counts(SineSTE):
    def build(self, input_shape):
        super().build(input_shape)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="calls")

    def call(self, x):
        self.calls.assign_add(1.0)
        return ops.sin(x) * self.w + self.b

counts = Counts()
counts.build((2, 2))
put("assigns", error_text(lambda: counts.stateless_call(
    [v.value for v in counts.trainable_variables], [counts.calls.value], jnp.asarray(X))))
put("grad_hook", error_text(lambda: go.grad_hook(layer, lambda g: g, at="variables")))
put("override_backward", error_text(
    lambda: go.override_backward(layer, lambda g, *, inputs: g)))
put("copy_overrides", error_text(lambda: go.keras.copy_overrides(layer, layer)))

for name, recipe_layer in (("reversal", GradientReversal(0.5)), ("quantize", Quantize(bits=8)),
                           ("spike", Spike())):
    gx = jax.jit(jax.grad(lambda x: jnp.sum(recipe_layer(x) * C)))(jnp.asarray(X))
    put(name, {"out": numpy(recipe_layer(jnp.asarray(X))).tolist(), "x": numpy(gx).tolist()})

ramp = GradientReversal(go.recipes.ganin_ramp(total_steps=10))
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2), Spike(), Quantize(),
                          ramp, SineSTE(), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((4, 2), "float32"), np.zeros((4, 1), "float32"), batch_size=2, verbose=0)
put("ramp steps", float(numpy(ramp.steps)))

fit_step()
run_docs_example()
"""

_TORCH_CHECKS = """
import torch

layer = SineSTE()
x = torch.tensor(X, requires_grad=True)
(layer(x) * torch.tensor(C)).sum().backward()
put("manual", {"x": numpy(x.grad).tolist(), "w": numpy(layer.w.value.grad).tolist(),
               "b": numpy(layer.b.value.grad).tolist()})

owns = OwnsX()
x = torch.tensor(X, requires_grad=True)
(owns(x) * torch.tensor(C)).sum().backward()
put("owns", {"x": numpy(x.grad).tolist(), "w": numpy(owns.w.value.grad).tolist(),
             "b": numpy(owns.b.value.grad).tolist()})

for name, cls in (("leaves out", LeavesOutW), ("misnamed", Misnamed), ("extra", Extra)):
    bad = cls()
    put(name, error_text(lambda: bad(torch.tensor(X, requires_grad=True)).sum().backward()))

class Counts(SineSTE):
    def build(self, input_shape):
        super().build(input_shape)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="calls")

    def call(self, x):
        self.calls.assign_add(1.0)
        return ops.sin(x) * self.w + self.b

counts = Counts()
counts(torch.tensor(X))
counts(torch.tensor(X))

stat = Stat()
stat.build((2, 2))
stat.m.assign(np.full((2,), 3.0, np.float32))
x = torch.tensor(X, requires_grad=True)
(stat(x) * torch.tensor(C)).sum().backward()
put("statistic", {"x": numpy(x.grad).tolist(), "w": numpy(stat.w.value.grad).tolist(),
                  "b": numpy(stat.b.value.grad).tolist()})
stat.trainable = False
stat.w.value.grad = None
x = torch.tensor(X, requires_grad=True)
(stat(x) * torch.tensor(C)).sum().backward()
put("frozen", numpy(x.grad).tolist())
put("frozen w grad", stat.w.value.grad is None)
put("assigns", float(numpy(counts.calls)))
put("grad_hook", error_text(lambda: go.grad_hook(stat, lambda g: g, at="variables")))
put("override_backward", error_text(
    lambda: go.override_backward(stat, lambda g, *, inputs: g)))

for name, recipe_layer in (("reversal", GradientReversal(0.5)), ("quantize", Quantize(bits=8)),
                           ("spike", Spike())):
    x = torch.tensor(X, requires_grad=True)
    out = recipe_layer(x)
    (out * torch.tensor(C)).sum().backward()
    put(name, {"out": numpy(out).tolist(), "x": numpy(x.grad).tolist()})

ramp = GradientReversal(go.recipes.ganin_ramp(total_steps=10))
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2), Spike(), Quantize(),
                          ramp, SineSTE(), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((4, 2), "float32"), np.zeros((4, 1), "float32"), batch_size=2, verbose=0)
put("ramp steps", float(numpy(ramp.steps)))

fit_step()
run_docs_example()
"""


def _run(backend: str, checks: str) -> dict[str, Any]:
    constants = (
        f"X = np.array({X.tolist()}, np.float32)\nC = np.array({C.tolist()}, np.float32)\n"
        f"W0 = np.array({W0.tolist()}, np.float32)\n"
        f"KERNEL = np.array({KERNEL.tolist()}, np.float32)\nLR = {LR}\nPAGE = {str(PAGE)!r}\n"
    )
    code = "import numpy as np\n" + constants + textwrap.dedent(_COMMON) + textwrap.dedent(
        checks
    ) + "print('RESULTS ' + json.dumps(RESULTS))\n"
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2",
           "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULTS "))
    results: dict[str, Any] = json.loads(line.removeprefix("RESULTS "))
    return results


@pytest.fixture(scope="module")
def on_jax() -> dict[str, Any]:
    _require_jax()
    return _run("jax", _JAX_CHECKS)


@pytest.fixture(scope="module")
def on_torch() -> dict[str, Any]:
    _require_keras()
    return _run("torch", _TORCH_CHECKS)


def _close(got: Any, expected: Any) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


def _close_all(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        _close(got[name], value)


# ---- JAX ---------------------------------------------------------------------------------


def test_jax_grad_over_stateless_call_gives_the_rules_gradients(on_jax: dict[str, Any]) -> None:
    expected = _rule(X, C, W0)
    _close_all(on_jax["stateless eager"], expected)
    _close_all(on_jax["stateless jit"], expected)


def test_jax_fit_trains_with_the_rule(on_jax: dict[str, Any]) -> None:
    _close_all(on_jax["fit"], _fit_step())


def test_jax_owns_leaves_the_variables_their_ordinary_gradient(on_jax: dict[str, Any]) -> None:
    _close_all(on_jax["owns"], {"x": C * W0, "w": (C * np.sin(X)).sum(0), "b": C.sum(0)})


def _statistic_expected() -> dict[str, np.ndarray]:
    return {"x": C * W0 * 3, "w": (C * X * 3).sum(0), "b": C.sum(0)}


def test_jax_rule_reads_the_values_of_the_step(on_jax: dict[str, Any]) -> None:
    _close_all(on_jax["statistic"], _statistic_expected())
    _close(on_jax["frozen"], C * W0 * 3)


def test_jax_mistakes_are_named(on_jax: dict[str, Any]) -> None:
    assert on_jax["leaves out"].startswith(
        "backward of `LeavesOutW.call` returned a dict without `w`, a variable its forward "
        "reads; add {'w': gradient}"
    ), on_jax["leaves out"]
    assert on_jax["misnamed"].startswith(
        "backward of `Misnamed.call` returned a dict without `w`, a variable its forward "
        "reads (it returned `weight`, which names no variable the forward reads)"
    ), on_jax["misnamed"]
    assert on_jax["extra"].startswith(
        "backward of `Extra.call` returned a gradient for `c`, which is neither a "
        "parameter of `Extra.call` nor a variable its forward reads; the names it can "
        "return are `x`, `w`, `b`."
    ), on_jax["extra"]
    assert on_jax["assigns"].startswith(
        "`Counts.call` assigns `counts/calls` in its call; on Keras' JAX backend"
    ), on_jax["assigns"]


def test_jax_keras_module_side_is_refused_by_name(on_jax: dict[str, Any]) -> None:
    assert on_jax["grad_hook"].startswith(
        "grad_hook: the Keras layer SineSTE `sine_ste` runs on Keras' 'jax' backend; "
        "gradoverride supports Keras layers on the TensorFlow backend only for installing a "
        "rule or a hook on an existing layer. Set KERAS_BACKEND=tensorflow"
    ), on_jax["grad_hook"]
    assert on_jax["override_backward"].startswith(
        "override_backward: the Keras layer SineSTE `sine_ste` runs on Keras' 'jax' backend"
    ), on_jax["override_backward"]
    assert on_jax["copy_overrides"].startswith(
        "copy_overrides: the Keras model 'sine_ste' runs on Keras' 'jax' backend"
    ), on_jax["copy_overrides"]
    assert "KERAS_BACKEND=tensorflow" in on_jax["copy_overrides"]


def test_gradoverride_keras_on_jax_does_not_import_tensorflow(on_jax: dict[str, Any]) -> None:
    assert on_jax["tensorflow imported"] is False


def test_jax_recipe_layers_call_the_recipes_on_jax_arrays(on_jax: dict[str, Any]) -> None:
    _check_recipe_layers(on_jax)


def test_jax_page_example_prints_what_the_page_shows(on_jax: dict[str, Any]) -> None:
    assert on_jax["docs"]["shown"], "docs/keras.md's example shows no output"
    assert on_jax["docs"]["printed"] == on_jax["docs"]["shown"]


# ---- torch -------------------------------------------------------------------------------


def test_torch_backward_gives_the_rules_gradients(on_torch: dict[str, Any]) -> None:
    _close_all(on_torch["manual"], _rule(X, C, W0))


def test_torch_fit_trains_with_the_rule(on_torch: dict[str, Any]) -> None:
    _close_all(on_torch["fit"], _fit_step())


def test_torch_owns_leaves_the_variables_their_ordinary_gradient(
    on_torch: dict[str, Any],
) -> None:
    _close_all(on_torch["owns"], {"x": C * W0, "w": (C * np.sin(X)).sum(0), "b": C.sum(0)})


def test_torch_rule_reads_the_variables(on_torch: dict[str, Any]) -> None:
    _close_all(on_torch["statistic"], _statistic_expected())
    _close(on_torch["frozen"], C * W0 * 3)
    assert on_torch["frozen w grad"] is True


def test_torch_mistakes_are_named(on_torch: dict[str, Any]) -> None:
    assert on_torch["leaves out"].startswith(
        "backward of `LeavesOutW.call` returned a dict without `w`, a variable its forward "
        "reads; add {'w': gradient}"
    ), on_torch["leaves out"]
    assert on_torch["misnamed"].startswith(
        "backward of `Misnamed.call` returned a dict without `w`, a variable its forward "
        "reads (it returned `weight`, which names no variable the forward reads)"
    ), on_torch["misnamed"]
    assert on_torch["extra"].startswith(
        "backward of `Extra.call` returned a gradient for `c`, which is neither a "
        "parameter of `Extra.call` nor a variable its forward reads; the names it can "
        "return are `x`, `w`, `b`."
    ), on_torch["extra"]


def test_torch_assignments_in_call_are_applied(on_torch: dict[str, Any]) -> None:
    assert on_torch["assigns"] == 2.0


def test_torch_recipe_layers_call_the_torch_recipes(on_torch: dict[str, Any]) -> None:
    _check_recipe_layers(on_torch)


def _check_recipe_layers(results: dict[str, Any]) -> None:
    """The recipe layers' outputs and input gradients, worked out by hand (the same on
    every backend), and a `fit` counting the schedule's steps."""
    _close(results["reversal"]["out"], X)
    _close(results["reversal"]["x"], -0.5 * C)
    # 8-bit symmetric over max|x| = 3: nothing is clamped, the gradient passes straight.
    step = 3.0 / 127
    _close(results["quantize"]["out"], np.round(X / step) * step)
    _close(results["quantize"]["x"], C)
    # The arctan surrogate at its default sharpness (alpha = 2, sg(0) = 1): 1 / (1 + (pi x)^2).
    _close(results["spike"]["out"], (X > 0).astype(np.float32))
    _close(results["spike"]["x"], C / (1 + (np.pi * X) ** 2))
    assert results["ramp steps"] == 2.0  # two training batches


def test_torch_page_example_prints_what_the_page_shows(on_torch: dict[str, Any]) -> None:
    assert on_torch["docs"]["shown"], "docs/keras.md's example shows no output"
    assert on_torch["docs"]["printed"] == on_torch["docs"]["shown"]


# ---- the support matrix's Keras-backend table ------------------------------------------------


def _matrix_cells() -> list[tuple[str, str]]:
    from gradoverride._support_matrix import KERAS_BACKEND_KINDS, KERAS_BACKENDS

    return [(kind, backend) for kind, _ in KERAS_BACKEND_KINDS for backend, _ in KERAS_BACKENDS
            if backend != "tensorflow"]


@pytest.mark.parametrize(("kind", "backend"), _matrix_cells(),
                         ids=[f"{k} | {b}" for k, b in _matrix_cells()])
def test_keras_backend_matrix_cell(kind: str, backend: str, request: pytest.FixtureRequest
                                   ) -> None:
    """Each cell of the support matrix's Keras-backend table, from the backend's run (the
    TensorFlow column is the TensorFlow table's, tested by
    tests/test_support_matrix_tensorflow.py)."""
    import re

    from gradoverride._support_matrix import KERAS_BACKEND_REFUSED

    results = request.getfixturevalue("on_jax" if backend == "jax" else "on_torch")
    refusal = KERAS_BACKEND_REFUSED.get((kind, backend))
    if refusal is not None:
        assert re.search(refusal.match, results[kind]), results[kind]
    elif kind == "gradoverride.keras.Layer":
        _close_all(results["fit"], _fit_step())
    else:
        assert kind == "recipe layers"
        _check_recipe_layers(results)


def test_the_tensorflow_column_is_the_tensorflow_table() -> None:
    from gradoverride._support_matrix import KERAS_BACKEND_KINDS, TF_KINDS, TF_REFUSED

    tf_kinds = {kind for kind, _ in TF_KINDS}
    for kind, _ in KERAS_BACKEND_KINDS:
        if kind == "recipe layers":
            assert "recipe: surrogate spike" in tf_kinds  # the recipes inside a Keras layer
        elif kind == "grad_hook":
            assert {"grad_hook inputs", "grad_hook variables"} <= tf_kinds
        else:
            assert kind in tf_kinds
            assert (kind, "eager") not in TF_REFUSED
