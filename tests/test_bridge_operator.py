"""A bridge with `outputs=` is one opaque operator to torch.compile, torch.export and
torch.func: compiled with no graph break, exported as one node, transformed (grad, jacrev,
vmap), its backward kept; `residuals=` keeps what the forward computed for the backward.
Gradients are compared with the same math in torch ops."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from bridge_operator_module import SINE, Model

import gradoverride as go
from gradoverride import GradOverrideError

pytestmark = [
    pytest.mark.compile,
    # dynamo's own warning when it traces an autograd.Function's context (not ours)
    pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning"),
]


def _loss(x: torch.Tensor) -> torch.Tensor:
    return (SINE(x * 2) * 3).sum()


def _expected(x: torch.Tensor) -> torch.Tensor:
    return 6 * torch.cos(2 * x)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_with_fullgraph_forward_and_backward(dynamic: bool) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(_loss, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for n in (5, 7):
        x = torch.linspace(-1, 1, n, requires_grad=True)
        out = compiled(x)
        (g,) = torch.autograd.grad(out, x)
        torch.testing.assert_close(out, (torch.sin(2 * x) * 3).sum())
        torch.testing.assert_close(g, _expected(x.detach()))
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_compiled_inference(mode: str) -> None:
    torch._dynamo.reset()
    x = torch.linspace(-1, 1, 4)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        out = torch.compile(Model(), fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, torch.sin(2 * x) + 1)
    torch._dynamo.reset()


def test_torch_func_grad_jacrev_and_per_sample_gradients() -> None:
    x = torch.linspace(-1, 1, 5, dtype=torch.float64)
    torch.testing.assert_close(torch.func.grad(_loss)(x), _expected(x))
    jacobian = torch.func.jacrev(lambda v: SINE(v * 2))(x)
    torch.testing.assert_close(jacobian, torch.diag(2 * torch.cos(2 * x)))
    batch = torch.stack([x, x / 2])
    per_sample = torch.func.vmap(torch.func.grad(_loss))(batch)
    torch.testing.assert_close(per_sample, _expected(batch))


def test_exported_as_one_node_that_a_fresh_process_runs(tmp_path: Path) -> None:
    x = torch.linspace(-1, 1, 5)
    program = torch.export.export(Model(), (x,))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count("gradoverride.outside.default") == 1, targets
    torch.testing.assert_close(program.module()(x), torch.sin(2 * x) + 1)
    path = tmp_path / "model.pt2"
    torch.export.save(program, path)
    script = textwrap.dedent(f"""
        import sys
        import torch
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import bridge_operator_module  # makes the bridge the program calls
        program = torch.export.load({str(path)!r})
        x = torch.linspace(-1, 1, 5)
        print(torch.allclose(program.module()(x), torch.sin(2 * x) + 1))
    """)
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=root, check=False)
    assert done.stdout.strip().endswith("True"), done.stderr[-2000:]


def test_a_graph_calling_a_bridge_this_process_has_not_made() -> None:
    from gradoverride import _outside

    with pytest.raises(GradOverrideError, match=(
        r"a graph calls gradoverride's outside operator for `no_such_bridge`, which this "
        r"process has not made.*import the module that defines it"
    )):
        _outside.owner("no_such_bridge")


def test_without_outputs_compiling_traces_nothing_and_says_what_to_pass() -> None:
    torch._dynamo.reset()
    plain = go.bridge(np.sin, backward=lambda grad, *, x: grad * np.cos(x))
    with pytest.raises(RuntimeError, match=(
        r"(?s)go.bridge of `sin` has no `outputs=`.*Pass `outputs=` to go.bridge"
    )):
        torch.compile(lambda v: plain(v), fullgraph=True, backend="eager")(torch.ones(3))
    torch._dynamo.reset()


def test_outputs_given_for_tensorflow_only_is_named_when_torch_traces_it() -> None:
    torch._dynamo.reset()

    class Spec:  # stands for a tf.TensorSpec: not a function
        def __repr__(self) -> str:
            return "TensorSpec(shape=(3,))"

    described = go.bridge(np.sin, backward="finite_differences", outputs=Spec())
    with pytest.raises(Exception, match=(  # dynamo wraps it in its own error
        r"`sin` is a go.bridge traced by torch.compile or torch.export, which need its "
        r"outputs' shapes and dtypes without running it; pass `outputs=` to go.bridge, a "
        r"function of the same arguments.*Got Spec TensorSpec\(shape=\(3,\)\), which "
        r"describes TensorFlow outputs only\."
    )):
        torch.export.export(_Calls(described), (torch.ones(3),))
    torch._dynamo.reset()


class _Calls(torch.nn.Module):
    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)  # type: ignore[no-any-return]


def test_non_literal_arguments_run_eagerly_and_are_refused_when_traced() -> None:
    torch._dynamo.reset()
    weights = np.array([1.0, 2.0, 3.0])

    def weighted(x: Any, w: Any) -> Any:
        return x * w

    op = go.bridge(weighted, backward=lambda grad, *, w: (grad * w, None),
                   outputs=lambda x, w: torch.empty_like(x))
    x = torch.ones(3, requires_grad=True)
    op(x, weights).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(Exception, match=(
        r"`[^`]*weighted` is a go.bridge, called here under torch.compile, torch.export or a "
        r"torch.func transform, which need it as one operator holding tensors and Python "
        r"literals only; its argument `w` holds a ndarray, which is neither\. Pass it as a "
        r"tensor, or bind it into the function"
    )):
        torch.func.grad(lambda v: op(v, weights).sum())(torch.ones(3))


def test_residuals_keep_the_forwards_values_for_the_rule() -> None:
    torch._dynamo.reset()
    calls: list[int] = []

    def solve(w: Any) -> Any:
        calls.append(1)
        best = (w == w.max()).astype(w.dtype)
        return best, {"chosen": best}

    def rule(grad: Any, *, chosen: Any) -> Any:
        return grad * chosen * 2

    op = go.bridge(solve, backward=rule, residuals="chosen", outputs=lambda w: (
        torch.empty_like(w), {"chosen": torch.empty_like(w)}))
    for call in (op, torch.compile(op, fullgraph=True, backend="aot_eager")):
        calls.clear()
        w = torch.tensor([0.1, 0.9, 0.3], requires_grad=True)
        out = call(w)
        (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 0.0]))
        torch.testing.assert_close(w.grad, torch.tensor([0.0, 4.0, 0.0]))
        assert len(calls) == 1, "the solver ran once: the rule read its residual"
    torch._dynamo.reset()


def test_residuals_errors_name_the_bridge_and_the_fix() -> None:
    with pytest.raises(GradOverrideError, match=(
        r"^bridge of `sin` got residuals=\('kept',\) with the finite_differences estimator, "
        r"which calls `sin` again and reads no residuals; drop `residuals=`"
    )):
        go.bridge(np.sin, backward="finite_differences", residuals="kept")
    op = go.bridge(np.sin, backward=lambda grad, *, kept: grad, residuals="kept")
    with pytest.raises(GradOverrideError, match=(
        r"^`sin` is bridged with residuals=\('kept',\), so it must return "
        r"`\(output, \{'kept': \.\.\.\}\)`: its output and a dict of the values its backward "
        r"rule reads; got ndarray\.$"
    )):
        op(torch.ones(2, requires_grad=True))


def test_a_rule_returning_none_for_an_input_needing_a_gradient_gives_zeros() -> None:
    op = go.bridge(np.sin, backward=lambda grad, *, x: None)
    x = torch.ones(3, requires_grad=True)
    op(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros(3))


def test_a_rule_with_a_misspelled_name_is_refused_at_bridging() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"`y`"):
        go.bridge(np.sin, backward=lambda grad, *, y: grad)


def test_outputs_describing_another_shape_is_an_error_not_a_wrong_graph() -> None:
    torch._dynamo.reset()
    lying = go.bridge(np.sin, backward=lambda grad, *, x: grad * np.cos(x),
                      outputs=lambda x: x.new_empty(x.shape[1:]))
    with pytest.raises(GradOverrideError, match=(
        r"^the function of the go.bridge of `sin` returned \(2, 3\) float32, but the "
        r"compiled or exported graph was traced with \(3,\) float32, what its `outputs=` "
        r"said\. Make it describe what the code returns"
    )):
        torch.compile(lambda v: lying(v), fullgraph=True, backend="aot_eager")(torch.ones(2, 3))
    torch._dynamo.reset()


def test_a_constant_changing_every_call_does_not_grow_the_operators_tables() -> None:
    from gradoverride import _outside

    def scaled(x: Any, k: float = 1.0) -> Any:
        return x * k

    op = go.bridge(scaled, backward=lambda grad, *, k: grad * k)
    x = torch.ones(2)
    for i in range(_outside._KEPT + 500):
        out = op(x, k=float(i))
    torch.testing.assert_close(out, torch.full((2,), float(_outside._KEPT + 499)))
    assert len(_outside._RESULTS) <= _outside._KEPT


@pytest.mark.parametrize("kind", [float, int])
def test_a_number_changing_between_calls_compiles_once_and_is_passed_as_a_number(
    kind: type
) -> None:
    torch._dynamo.reset()
    seen: list[type] = []

    def wave(x: Any, k: Any) -> Any:
        seen.append(type(k))
        return np.sin(k * x)

    def wave_rule(grad: Any, *, x: Any, k: Any) -> Any:
        return grad * k * np.cos(k * x)

    op = go.bridge(wave, backward=wave_rule, outputs=lambda x, k: torch.empty_like(x))
    compiled = torch.compile(lambda x, k: op(x, k).sum(), fullgraph=True, backend="aot_eager")
    for k in (kind(1), kind(2), kind(3)):
        x = torch.linspace(-1, 1, 4, dtype=torch.float64, requires_grad=True)
        (g,) = torch.autograd.grad(compiled(x, k), x)
        torch.testing.assert_close(g, k * torch.cos(k * x.detach()))
    assert set(seen) == {kind}, "the function gets a Python number, not a tensor"
    torch._dynamo.reset()


def test_outputs_with_the_wrong_dtype_is_caught_under_dynamic_shapes() -> None:
    torch._dynamo.reset()
    lying = go.bridge(np.sin, backward=lambda grad, *, x: grad * np.cos(x),
                      outputs=lambda x: x.new_empty(x.shape, dtype=torch.float64))
    compiled = torch.compile(lambda v: lying(v) * 2, fullgraph=True, dynamic=True,
                             backend="aot_eager")
    with pytest.raises(GradOverrideError, match=(
        r"^the function of the go.bridge of `sin` returned \(5,\) float32, but the compiled "
        r"or exported graph was traced with \(5,\) float64, what its `outputs=` said\."
    )):
        compiled(torch.ones(5))
    torch._dynamo.reset()


def test_vmap_over_an_empty_batch_takes_the_shapes_from_outputs() -> None:
    out = torch.func.vmap(SINE)(torch.ones(0, 3))
    assert out.shape == (0, 3)


def test_an_array_argument_breaks_the_graph_and_fullgraph_names_it() -> None:
    torch._dynamo.reset()
    weights = np.array([1.0, 2.0, 3.0])
    op = go.bridge(lambda x, w: x * w, backward=lambda grad, *, w: (grad * w, None),
                   outputs=lambda x, w: torch.empty_like(x))
    out = torch.compile(lambda v: op(v, weights), backend="eager")(torch.ones(3))
    torch.testing.assert_close(out, torch.tensor([1.0, 2.0, 3.0]))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=(  # (dynamo's error, holding ours)
        r"`[^`]*<lambda>` is a go.bridge, called here under torch.compile, torch.export or a "
        r"torch.func transform, which need it as one operator holding tensors and Python "
        r"literals only; its argument at position 1 holds a ndarray, which is neither"
    )):
        torch.compile(lambda v: op(v, weights), fullgraph=True, backend="eager")(torch.ones(3))
    torch._dynamo.reset()
