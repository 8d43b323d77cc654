"""`go.grad_hook`: transforms at a module's inputs, outputs and parameters."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import gradoverride as go
from gradoverride.recipes import GradientTransform


@dataclass(frozen=True, repr=False)
class negate(GradientTransform):
    scale: float = 1.0

    def transform(self, grad: torch.Tensor) -> torch.Tensor:
        return -self.scale * grad


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).requires_grad_()


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 3)


def test_outputs_with_an_inplace_op_right_after_the_module() -> None:
    linear = _linear()
    model = nn.Sequential(linear, nn.ReLU(inplace=True))
    x = _x(4, 3)
    handle = go.grad_hook(linear, lambda g: g + 1, at="outputs")
    model(x).sum().backward()
    # The hook sees the gradient with respect to the Linear's output (the ReLU mask) and
    # adds one; the Linear's backward then maps it to the input.
    mask = (linear(x.detach()) > 0).to(x.dtype)
    torch.testing.assert_close(x.grad, (mask + 1) @ linear.weight.detach())
    handle.remove()


def test_register_full_backward_hook_fails_where_grad_hook_works() -> None:
    # The reason grad_hook exists: the full backward hook refuses this model.
    linear = _linear()
    model = nn.Sequential(linear, nn.ReLU(inplace=True))
    linear.register_full_backward_hook(lambda m, gi, go_: None)
    with pytest.raises(RuntimeError, match="inplace"):
        model(_x(2, 3)).sum().backward()


def test_inputs_positional_and_keyword_only_on_this_path() -> None:
    class Mul(nn.Module):
        def forward(self, a: torch.Tensor, *, b: torch.Tensor) -> torch.Tensor:
            return a * b

    module = Mul()
    a, b = _x(3), _x(3) * 2
    b.retain_grad()
    handle = go.grad_hook(module, lambda g: 10 * g, at="inputs")
    (module(a, b=b) + a).sum().backward()
    # a's gradient through the module is scaled, its direct use (+ a) is not.
    torch.testing.assert_close(a.grad, 10 * b.detach() + 1)
    torch.testing.assert_close(b.grad, 10 * a.detach())
    handle.remove()


def test_several_inputs_and_outputs() -> None:
    class Split(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return a + b, a - b

    module = Split()
    a, b = _x(3), _x(3)
    go.grad_hook(module, negate(), at="outputs")
    s, d = module(a, b)
    (s + 2 * d).sum().backward()
    torch.testing.assert_close(a.grad, torch.full((3,), -3.0))
    torch.testing.assert_close(b.grad, torch.full((3,), 1.0))


def test_parameters_see_the_transform_before_accumulation() -> None:
    linear = _linear()
    go.grad_hook(linear, lambda g: torch.zeros_like(g), at="parameters")
    linear(_x(2, 3)).sum().backward()
    torch.testing.assert_close(linear.weight.grad, torch.zeros(3, 3))
    torch.testing.assert_close(linear.bias.grad, torch.zeros(3))


@pytest.mark.parametrize("at", ["inputs", "outputs"])
def test_hooks_stack_in_registration_order(at: str) -> None:
    seen: list[str] = []
    linear = _linear()

    def first(g: torch.Tensor) -> torch.Tensor:
        seen.append("first")
        return g * 2

    def second(g: torch.Tensor) -> torch.Tensor:
        seen.append("second")
        return g + 1

    go.grad_hook(linear, first, at=at)  # type: ignore[arg-type]
    go.grad_hook(linear, second, at=at)  # type: ignore[arg-type]
    x = _x(2, 3)
    linear(x).sum().backward()
    assert seen == ["first", "second"]
    ones = torch.ones(2, 3)
    expected = (
        (ones * 2 + 1) @ linear.weight.detach() if at == "outputs"
        else (ones @ linear.weight.detach()) * 2 + 1
    )
    torch.testing.assert_close(x.grad, expected)


def test_remove_restores_bitwise_gradients() -> None:
    linear = _linear()
    x = _x(2, 3)
    linear(x).sum().backward()
    before = x.grad.clone()
    x.grad = None
    handles = [go.grad_hook(linear, negate(3.0), at=at) for at in ("inputs", "outputs")]
    handles.append(go.grad_hook(linear, negate(), at="parameters"))
    for handle in handles:
        handle.remove()
        handle.remove()  # twice is a no-op
    linear(x).sum().backward()
    assert torch.equal(x.grad, before)


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_compile_fullgraph_without_compiled_autograd() -> None:
    torch._dynamo.reset()
    linear = _linear()
    model = nn.Sequential(linear, nn.ReLU(inplace=True))
    go.grad_hook(linear, lambda g: g * 3, at="outputs")
    go.grad_hook(linear, lambda g: g.clamp(-0.1, 0.1), at="inputs")
    x1, x2 = _x(4, 3), _x(4, 3)
    model(x1).sum().backward()
    torch.compile(model, fullgraph=True, backend="aot_eager")(x2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)


def test_errors_name_the_argument_and_the_fix() -> None:
    with pytest.raises(go.GradOverrideError, match=re.escape(
        "grad_hook got at='input'; expected one of 'inputs', 'outputs', 'parameters'."
    )):
        go.grad_hook(_linear(), negate(), at="input")  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideTypeError, match=re.escape(
        "grad_hook needs a transform `fn(grad) -> grad`"
    )):
        go.grad_hook(_linear(), 3.0)  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideTypeError, match=re.escape(
        "grad_hook needs an nn.Module instance, got Tensor"
    )):
        go.grad_hook(torch.ones(2), negate())  # type: ignore[arg-type]


def test_a_recipe_module_form_uses_its_transform_and_other_modules_are_refused() -> None:
    linear = _linear()
    go.grad_hook(linear, negate(2.0).module(), at="inputs")
    x = _x(2, 3)
    linear(x).sum().backward()
    torch.testing.assert_close(x.grad, -2 * torch.ones(2, 3) @ linear.weight.detach())
    with pytest.raises(go.GradOverrideTypeError, match=re.escape(
        "grad_hook got the module Tanh as its transform; a module's forward is not a gradient map"
    )):
        go.grad_hook(_linear(), nn.Tanh())  # type: ignore[arg-type]
