"""What an op call costs while `go.monitor` records, counted rather than timed: the Python
calls of gradoverride's own code that a recorded call adds, and the generated fast path a
module's rule owning some inputs keeps while recorded (its gradients measured as tensor
hooks see them)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradoverride as go
from gradoverride import recipes
from gradoverride._function import CallState

_PACKAGE = go.__file__.rsplit("__init__.py", 1)[0]


def _calls(run: Any, counted: Callable[[Any], bool]) -> int:
    """Python calls that `run()` makes of the functions whose code `counted` accepts."""
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and counted(frame.f_code):
            calls[0] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls[0]


def _own_calls(run: Any) -> int:
    """Python calls of gradoverride's code (not torch's, not the test's) that `run()` makes."""
    return _calls(run, lambda code: code.co_filename.startswith(_PACKAGE))


class _Steps(nn.Module):
    """Two recipes called at each of `n` steps (one held, one made at each call)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.act = recipes.spike("arctan", alpha=2.0)
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for _ in range(self.n):
            out = self.act(self.fc(out) - 0.5) + recipes.ste_round()(out)
        return out


@pytest.mark.parametrize("every", [1, 10])
def test_a_recorded_op_call_adds_a_few_calls_of_gradoverride(every: int) -> None:
    # With JAX imported where it is installed (as in a suite that ran its tests before):
    # a call on torch tensors must not search its arguments for another framework's values.
    if importlib.util.find_spec("jax") is not None:
        importlib.import_module("jax")
    # Per op call while recording: the recipe's call told to the recorder, the op's watched
    # entry, the recorder's consult, and the snapshot of the call that is its node's hook.
    # (Each read of the stack, each check of another framework's values, each helper is
    # one more: what a change to the path would add.)
    torch.manual_seed(0)
    model = _Steps(n=6)
    x = torch.randn(4, 6, requires_grad=True)

    def forward() -> None:
        model(x)

    model(x).sum().backward()  # (the first call of each op is checked: done before)
    plain = _own_calls(forward)
    with go.monitor(model, every=every):
        for _ in range(2):
            model(x).sum().backward()
        recorded = _own_calls(forward)
    ops = 2 * model.n  # (each a recipe's call, which calls one op)
    # (and per forward, the model's module hooks: its entry, its exit, a new forward)
    assert recorded - plain <= 4 * ops + 3, (recorded, plain)


def test_a_rule_owning_some_inputs_keeps_its_fast_path_while_recorded() -> None:
    # The module's rule owns the input only; the weight keeps autograd's gradient, passed on
    # through the forward's graph, which is not what the rule returned.
    torch.manual_seed(0)
    layer = nn.Linear(5, 3, bias=False)
    go.override_backward(layer, lambda g, *, module: 0.5 * (g @ module.weight), owns="input")
    model = nn.Sequential(layer)
    x = torch.randn(4, 5, requires_grad=True)
    with go.monitor(model) as mon:
        for step in range(2):
            x.grad = None
            y = model(x)
            # The generated twin (no CallState kept on the node), as without the monitor.
            assert not isinstance(y.grad_fn.gradoverride[0], CallState)
            y.retain_grad()
            (y * torch.arange(3.0)).square().sum().backward()
            assert y.grad is not None and x.grad is not None
            record = mon.history["0: Linear"][step]
            assert record.calls == 1
            assert record.grad_in == pytest.approx(float(y.grad.norm()), rel=1e-6)
            # Returned: the input's gradient only (0.5 * g @ W), computed here from y.grad.
            expected = 0.5 * (y.grad @ layer.weight.detach())
            assert torch.allclose(x.grad, expected)
            assert record.grad_out == pytest.approx(float(expected.norm()), rel=1e-6)
            assert record.zeroed is None  # (the input's shape is not the output's)


def _torch_hook_registrations(run: Any) -> int:
    """Calls of torch's registration of a hook on a backward node that `run()` makes."""
    return _calls(run, lambda code: code.co_name == "_register_hook"
                  and code.co_filename.endswith("function.py"))


@go.custom_backward
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


@_scaled.backward
def _(grad: torch.Tensor) -> torch.Tensor:
    return grad / 2.0  # (not the true gradient: the monitor must see this one)


@go.custom_backward
def _quartered(x: torch.Tensor) -> torch.Tensor:
    return x * 4.0


@_quartered.backward(once_differentiable=True)
def _(grad: torch.Tensor) -> torch.Tensor:
    return grad / 4.0


class _Both(nn.Module):
    """An op whose backward is generated, one whose backward is the route's general one
    (`once_differentiable`), and a recipe."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(x) + _quartered(x) + recipes.ste_round()(x)


def test_a_recorded_step_registers_no_hook_on_an_override_node() -> None:
    # Each override's backward hands the recorder what it got and returned: no hook is
    # registered on its node at each call (torch's node hooks, a handle and a dict made per
    # call and the gradients wrapped for the hook, cost as much as the rest of a recorded
    # call). The numbers are the rules' own, computed here by hand.
    torch.manual_seed(0)
    model = _Both()
    x = torch.randn(3, 4, requires_grad=True)
    weights = torch.randn(3, 4)

    def step() -> None:
        (model(x) * weights).sum().backward()

    step()
    with go.monitor(model) as mon:
        step()
        assert _torch_hook_registrations(step) == 0
    norm = float(weights.norm())
    expected = {"(model): _scaled": norm / 2, "(model): _quartered": norm / 4,
                "(model): ste_round()": norm}
    assert sorted(mon.history) == sorted(expected), mon.history
    for label, records in mon.history.items():
        assert [(r.step, r.calls) for r in records] == [(0, 1), (1, 1)], label
        for r in records:
            assert r.grad_in == pytest.approx(norm, rel=1e-6)
            assert r.grad_out == pytest.approx(expected[label], rel=1e-6)


@go.custom_backward
def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x * 3


@_split.backward
def _(grad_a: torch.Tensor, grad_b: torch.Tensor) -> torch.Tensor:
    # Zeroes the first element's gradient from `a`.
    return grad_a * torch.tensor([0.0, 1.0, 1.0, 1.0]) + grad_b


class _FirstOfTwo(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = _split(x)  # (the second output unused: torch gives the rule zeros for it)
        return a


def test_an_output_that_got_no_gradient_is_not_paired() -> None:
    # The rule is given zeros for the unused output; the zeroed fraction pairs what arrived
    # at the one output that got a gradient with what the rule returned: 1 of 4 elements.
    x = torch.ones(1, 4, requires_grad=True)
    upstream = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    model = _FirstOfTwo()
    with go.monitor(model) as mon:
        (model(x) * upstream).sum().backward()
    (record,) = mon.history["(model): _split"]
    assert record.zeroed == 0.25
    assert record.grad_in == pytest.approx(float(upstream.norm()), rel=1e-6)
    assert record.grad_out == pytest.approx(float(upstream[:, 1:].norm()), rel=1e-6)


def test_a_pass_with_create_graph_is_recorded() -> None:
    # A gradient penalty: the first pass keeps a graph of its gradients (create_graph=True),
    # which the monitor reduces without recording a graph of its own.
    x = torch.tensor([[0.5, -2.0, 0.25]], requires_grad=True)
    model = nn.Sequential(recipes.binarize().module())
    with go.monitor(model) as mon:
        (gx,) = torch.autograd.grad((model(x) ** 2).sum(), x, create_graph=True)
        gx.sum().backward()
    records = mon.history["0: binarize(clip=1.0, inclusive=True, keep='input')"]
    assert [r.step for r in records] == [0, 1]
    # d/dy of sum(y**2) is 2y, y = sign(x) = [1, -1, 1]; the window keeps |x| <= 1.
    assert records[0].grad_in == pytest.approx(float(torch.tensor([2.0, -2.0, 2.0]).norm()))
    assert records[0].grad_out == pytest.approx(float(torch.tensor([2.0, 2.0]).norm()))
    assert records[0].zeroed == pytest.approx(1 / 3)
