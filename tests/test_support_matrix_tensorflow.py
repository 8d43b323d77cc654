"""One test per cell of the TensorFlow and Keras support matrix (`gradoverride/_support_matrix.py`,
`TF_KINDS` x `TF_CONTEXTS`).

A supported cell gives the gradients its case's reference works out by hand
(`tf_matrix_cases.py`); a refused cell raises the error the table names; a warning cell
warns as the table says; a cell that does not apply has no test. The strategy cells run in
one fresh process (`tf_matrix_strategy_worker.py`): logical devices must be configured
before TensorFlow first touches the CPU.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
from tf_support import tf  # skips without TensorFlow (an error under the CI flag)

# isort: split
import keras  # after tf_support, which skips this module without TensorFlow
import tf_matrix_cases as cases
from tf_matrix_cases import CASES, IDS, UP, Grads, X

import gradoverride as go
import gradoverride.keras
from gradoverride import _support_matrix as matrix

KINDS = [key for key, _ in matrix.TF_KINDS]
CONTEXTS = [key for key, _ in matrix.TF_CONTEXTS]
WORKER = Path(__file__).resolve().parent / "tf_matrix_strategy_worker.py"

#: float32 against float64 references; float16 gets its own.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
HALF = {"rtol": 2e-2, "atol": 2e-2}


def assert_grads(got: Grads, expected: Grads, keys: Any = None, **tolerance: float) -> None:
    for name in keys or expected:
        np.testing.assert_allclose(np.asarray(got[name], np.float64), expected[name],
                                   err_msg=name, **(tolerance or TOLERANCE))


def _step(layer: Any, call: Callable[[Any], Any] | None = None) -> Callable[..., Any]:
    """d sum(call(x) * up) / d(x and each variable of `layer`), as tensors."""

    def step(x: Any, up: Any) -> list[Any]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = (layer if call is None else call)(x)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * up)
        return list(tape.gradient(loss, [x, *layer.trainable_variables]))

    return step


def _named(layer: Any, grads: list[Any]) -> Grads:
    names = ["x", *(cases.short(v) for v in layer.trainable_variables)]
    return {n: tf.convert_to_tensor(g).numpy() for n, g in zip(names, grads, strict=True)}


def gradients(layer: Any, mode: str = "eager", call: Callable[[Any], Any] | None = None,
              x: np.ndarray = X, up: np.ndarray = UP) -> Grads:
    step = _step(layer, call)
    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    return _named(layer, step(tf.constant(x), tf.constant(up)))


# ---- the contexts --------------------------------------------------------------------------


def run_mode(kind: str, mode: str) -> None:
    case = CASES[kind]
    layer = case.build()
    assert_grads(gradients(layer, mode), case.reference(layer, X, UP))


def _loss(y_true: Any, y_pred: Any) -> Any:
    # Per sample; Keras averages it over the batch of 4.
    return tf.reduce_sum(tf.cast(y_pred, tf.float32) * y_true, axis=-1)


def run_fit(kind: str) -> None:
    case = CASES[kind]
    layer = case.build()
    rescale = cases.Rescale()  # its update shows the gradient `layer` gives its input
    model = keras.Sequential([keras.Input((3,)), rescale, layer])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss, jit_compile=False)
    before = {**cases.values(layer), "m": np.ones(3)}
    expected = case.reference(layer, X, UP)
    expected["m"] = cases.rescale_gradient(X, expected)
    # The loss is the mean over the batch of 4: targets 4 * UP make its upstream gradient UP.
    model.fit(X, 4 * UP, batch_size=4, epochs=1, shuffle=False, verbose=0)
    after = {**cases.values(layer), "m": rescale.m.numpy()}
    assert after.keys() == before.keys()
    for name, value in before.items():
        np.testing.assert_allclose(after[name], value - 0.1 * expected[name],
                                   err_msg=name, **TOLERANCE)


def run_vectorized_map(kind: str) -> None:
    case = CASES[kind]
    layer = case.build()

    def call(x: Any) -> Any:
        return tf.vectorized_map(lambda row: layer(row[None])[0], x)

    assert_grads(gradients(layer, "function", call), case.reference(layer, X, UP))


def run_while_loop(kind: str) -> None:
    case = CASES[kind]
    layer = case.build()

    def call(x: Any) -> Any:
        total = tf.zeros_like(x)
        for _ in tf.range(2):  # a tf.while_loop under tf.function
            total += tf.cast(layer(x), tf.float32)
        return total

    expected = {k: 2 * v for k, v in case.reference(layer, X, UP).items()}
    assert_grads(gradients(layer, "function", call), expected)


def run_mixed_precision(kind: str) -> None:
    case = CASES[kind]
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layer = case.build()  # computes in float16, keeps float32 variables
        assert layer.compute_dtype == "float16"
        assert tf.convert_to_tensor(layer(tf.constant(X))).dtype == tf.float16
        got = gradients(layer)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert_grads(got, case.reference(layer, X, UP), **HALF)


def run_after_tracing(kind: str) -> None:
    # The cell's warning is checked by `test_cell`, from the table.
    case = CASES[kind]
    assert case.install is not None
    layer = cases.dense()
    go.grad_hook(layer, lambda g: g, at="outputs")  # something installed when traced
    tf.function(layer)(tf.constant(X))
    case.install(layer)


def _copies(model: Any) -> Iterator[Any]:
    """`copy.deepcopy(model)`, then `model` saved to a `.keras` file and loaded."""
    with warnings.catch_warnings():
        # Keras' own saving, under numpy 2: not ours.
        warnings.simplefilter("ignore", DeprecationWarning)
        yield copy.deepcopy(model)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.keras")
            model.save(path)
            yield keras.models.load_model(path)


def run_clone(kind: str) -> None:
    case = CASES[kind]
    model = keras.Sequential([keras.Input((3,)), case.build()])
    for twin in _copies(model):
        assert twin.layers[0] is not model.layers[0]
        if case.install is not None:
            # Keras copies config and weights, not what was installed on the instance.
            assert len(go.overrides(twin)) == 0
            assert [h.active for h in go.keras.copy_overrides(model, twin)] == [True]
        layer = twin.layers[0]
        assert_grads(gradients(layer), case.reference(layer, X, UP))


def run_sparse(kind: str) -> None:
    if kind == "grad_hook variables":
        layer = cases.hooked_embedding()
        ids = tf.constant(IDS)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids) * UP)
        (grad,) = tape.gradient(loss, layer.trainable_variables)
        np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy(),
                                   cases.embedding_reference(UP), **TOLERANCE)
        return
    case = CASES[kind]
    layer = case.build()
    rows = [0, 2]

    def call(x: Any) -> Any:
        # Gathered rows: the gradient at the layer's output is an IndexedSlices.
        return tf.gather(layer(x), rows)

    step = _step(layer, call)
    got = _named(layer, step(tf.constant(X), tf.constant(UP[rows])))
    up = np.zeros_like(UP)
    up[rows] = UP[rows]
    assert_grads(got, case.reference(layer, X, up))


def run_strategy(kind: str, report: dict[str, Any]) -> None:
    case = CASES[kind]
    result = report[kind]
    if result["error"] is not None:
        raise AssertionError(f"{kind} under MirroredStrategy raised {result['error']}")
    warns = matrix.TF_WARNS.get((kind, "strategy"))
    if warns is None:
        assert not result["warnings"], result["warnings"]
    else:
        assert any(re.search(warns.match, w, re.DOTALL) for w in result["warnings"]), result
    layer = case.build()
    # The strategy sums the replicas' gradients of their halves of the batch.
    halves = [case.reference(layer, X[k : k + 2], UP[k : k + 2]) for k in (0, 2)]
    for k, half in zip((0, 2), halves, strict=True):
        # The input's gradient, through the worker's `x * m`.
        half["m"] = cases.rescale_gradient(X[k : k + 2], half)
    if warns is None:
        expected = case.reference(layer, X, UP)
        expected["m"] = cases.rescale_gradient(X, expected)
    else:  # each replica's share transformed on its own, then summed
        expected = {n: halves[0][n] + halves[1][n] for n in halves[0] if n != "x"}
    names = [n for n in expected if n != "x"]
    assert set(result["grads"]) == set(names), result["grads"].keys()
    assert_grads({n: np.array(result["grads"][n]) for n in names}, expected, keys=names)


RUN: dict[str, Callable[[str], None]] = {
    "eager": lambda kind: run_mode(kind, "eager"),
    "tf.function": lambda kind: run_mode(kind, "function"),
    "XLA": lambda kind: run_mode(kind, "xla"),
    "model.fit": run_fit,
    "vectorized_map": run_vectorized_map,
    "while loop": run_while_loop,
    "mixed precision": run_mixed_precision,
    "installed after tracing": run_after_tracing,
    "clone/deepcopy": run_clone,
    "sparse gradients": run_sparse,
}


@pytest.fixture(scope="module")
def strategy_report() -> Iterator[dict[str, Any]]:
    """Every kind's strategy cell, computed in one fresh process."""
    root = WORKER.parent.parent
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([str(root), str(WORKER.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(v for v in result.stdout.splitlines() if v.startswith("RESULT "))
    report: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    assert report.pop("replicas") == 2
    yield report


def _cells() -> Iterator[Any]:
    for kind in KINDS:
        for context in CONTEXTS:
            if (kind, context) in matrix.TF_NOT_APPLICABLE:
                continue
            defect = matrix.TF_DEFECTS.get((kind, context))
            # A wrong gradient fails an assertion; should the cell start raising instead
            # (a refusal), the test fails, so that the table is brought up to date.
            marks = [] if defect is None else [
                pytest.mark.xfail(strict=True, raises=AssertionError, reason=defect)]
            yield pytest.param(kind, context, id=f"{kind} | {context}", marks=marks)


@pytest.mark.parametrize(("kind", "context"), list(_cells()))
def test_cell(kind: str, context: str, request: pytest.FixtureRequest) -> None:
    if context == "strategy":
        run: Callable[[str], None] = lambda kind: run_strategy(  # noqa: E731
            kind, request.getfixturevalue("strategy_report"))
    else:
        run = RUN[context]
    refusal = matrix.TF_REFUSED.get((kind, context))
    warns = matrix.TF_WARNS.get((kind, context))
    if refusal is not None:
        with pytest.raises(Exception) as info:
            run(kind)
        names = {cls.__name__ for cls in type(info.value).__mro__}
        assert refusal.error in names, f"raised {type(info.value).__name__}: {info.value}"
        assert re.search(refusal.match, str(info.value), re.DOTALL), str(info.value)
    elif warns is not None and context != "strategy":  # (the worker records strategy's)
        assert warns.error == "GradOverrideWarning"
        with pytest.warns(go.GradOverrideWarning, match=warns.match):
            run(kind)
    else:
        run(kind)


def test_the_table_covers_every_case_and_context() -> None:
    assert set(KINDS) == set(CASES), "every kind has a case in tests/tf_matrix_cases.py"
    assert set(CONTEXTS) == {*RUN, "strategy"}, "every context has a runner here"
    tables = (matrix.TF_REFUSED, matrix.TF_WARNS, matrix.TF_NOTES, matrix.TF_NOT_APPLICABLE,
              matrix.TF_DEFECTS)
    for table in tables:
        for kind, context in table:
            assert kind in KINDS and context in CONTEXTS, (kind, context)
    # A cell is one of: supported, refused, warns, n/a; a note or a defect on a supported one.
    for cell in matrix.TF_NOT_APPLICABLE:
        assert cell not in {*matrix.TF_REFUSED, *matrix.TF_WARNS, *matrix.TF_NOTES}, cell
    for cell in matrix.TF_REFUSED:
        assert cell not in {*matrix.TF_WARNS, *matrix.TF_DEFECTS}, cell
