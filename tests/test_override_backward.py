"""`go.override_backward`: a backward rule for an existing module instance, in place."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import gradoverride as go


def _linear_rule(grad: torch.Tensor, *, input: torch.Tensor, module: nn.Linear) -> object:
    # The true gradients, with the input's scaled by 10 so the rule is visible.
    return {
        "input": 10 * grad @ module.weight,
        "weight": grad.T @ input,
        "bias": grad.sum(0),
    }


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = module(x)
    first = out[0] if isinstance(out, tuple) else out
    (first.pow(2).sum()).backward()
    assert x.grad is not None
    return [x.grad.clone(), *(p.grad.clone() for p in module.parameters())]


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def test_linear_in_place_same_object_parameters_and_state_dict() -> None:
    linear = nn.Linear(4, 3)
    params = list(linear.parameters())
    keys = list(linear.state_dict())
    x = _x(5, 4)
    true = _grads(linear, x)
    true_out = linear(x)
    handle = go.override_backward(linear, _linear_rule)
    assert isinstance(linear, nn.Linear)
    assert list(linear.parameters()) == params
    assert list(linear.state_dict()) == keys
    overridden = _grads(linear, x)
    torch.testing.assert_close(overridden[0], 10 * true[0])
    torch.testing.assert_close(overridden[1:], true[1:])
    torch.testing.assert_close(linear(x), true_out)
    handle.remove()
    restored = _grads(linear, x)
    for a, b in zip(restored, true, strict=True):
        assert torch.equal(a, b)  # bitwise
    assert torch.equal(linear(x), true_out)


def test_remove_twice_is_a_no_op_and_override_twice_is_an_error() -> None:
    linear = nn.Linear(2, 2)
    handle = go.override_backward(linear, _linear_rule)
    with pytest.raises(go.GradOverrideError, match=re.escape(
        "this Linear already has an override (an earlier `override_backward`); "
        "call `.remove()` on its handle before overriding again."
    )):
        go.override_backward(linear, _linear_rule)
    handle.remove()
    handle.remove()
    assert not handle.active
    assert not linear._forward_hooks and not linear._forward_pre_hooks
    assert "__prepare_scriptable__" not in linear.__dict__
    go.override_backward(linear, _linear_rule).remove()  # allowed again after removal


def test_conv2d_rule_owning_only_the_input() -> None:
    conv = nn.Conv2d(2, 3, 3)
    x = _x(1, 2, 6, 6)
    true = _grads(conv, x)

    def rule(grad: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1, 2, 6, 6)

    with go.override_backward(conv, rule, owns="input"):
        overridden = _grads(conv, x)
    torch.testing.assert_close(overridden[0], torch.zeros(1, 2, 6, 6))
    torch.testing.assert_close(overridden[1:], true[1:])  # parameters keep autograd's
    assert "forward" not in conv.__dict__


def test_lstm_with_several_outputs() -> None:
    lstm = nn.LSTM(3, 4, batch_first=True)
    x = _x(2, 5, 3)
    seen: list[object] = []

    def rule(grad_out: torch.Tensor, grad_state: object, *, input: torch.Tensor) -> object:
        seen.append(grad_state)
        return {"input": torch.ones_like(input)}

    with go.override_backward(lstm, rule, owns="input"):
        grads = _grads(lstm, x)
    torch.testing.assert_close(grads[0], torch.ones(2, 5, 3))
    assert isinstance(seen[0], tuple) and len(seen[0]) == 2
    assert all(p.grad is not None for p in lstm.parameters())


def test_nested_block_with_dotted_parameter_names() -> None:
    block = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    x = _x(4, 3)

    def rule(grad: torch.Tensor, *, input: torch.Tensor, module: nn.Sequential) -> object:
        grads = {name: torch.zeros_like(p) for name, p in module.named_parameters()}
        grads["input"] = torch.zeros_like(input)
        grads["2.bias"] = torch.ones(2)
        return grads

    with go.override_backward(block, rule):
        grads = _grads(block, x)
    torch.testing.assert_close(grads[-1], torch.ones(2))
    torch.testing.assert_close(grads[0], torch.zeros(4, 3))


def test_deepcopy_keeps_the_override_on_the_copy() -> None:
    linear = nn.Linear(4, 3)
    go.override_backward(linear, _linear_rule)
    clone = copy.deepcopy(linear)
    x = _x(2, 4).requires_grad_()
    clone(x).sum().backward()
    torch.testing.assert_close(x.grad, 10 * torch.ones(2, 3) @ clone.weight.detach())
    assert linear.weight.grad is None  # the copy's rule used the copy's parameters


def test_not_a_module_is_a_type_error() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=re.escape(
        "override_backward needs an nn.Module instance, got builtin_function_or_method"
    )):
        go.override_backward(torch.sin, _linear_rule)  # type: ignore[arg-type]


def test_rule_naming_a_missing_parameter_fails_when_overriding() -> None:
    def rule(grad: torch.Tensor, *, weights: torch.Tensor) -> object:
        return None

    with pytest.raises(go.GradOverrideTypeError, match=re.escape(
        "names `weights`, which is neither an input of its forward nor one of its parameters; "
        "it may name `input`, `weight`, `bias`"
    )):
        go.override_backward(nn.Linear(2, 2), rule)


def test_returning_a_parameter_it_does_not_own() -> None:
    def rule(grad: torch.Tensor, *, module: nn.Linear) -> object:
        return {"input": grad @ module.weight, "weight": grad}

    linear = nn.Linear(2, 2)
    with go.override_backward(linear, rule, owns="input"), pytest.raises(
        go.GradOverrideError,
        match=re.escape("gradient for `weight`, which is a parameter the rule does not own"),
    ):
        linear(_x(3, 2).requires_grad_()).sum().backward()


# ==== copies and replicas run themselves ====================================================


def test_a_copy_of_an_overridden_module_runs_itself() -> None:
    dropout = nn.Dropout(0.5)
    go.override_backward(dropout, lambda grad, *, input: grad)
    evaluated = copy.copy(dropout).eval()  # its own `training`, False
    x = torch.ones(1000, requires_grad=True)
    torch.testing.assert_close(evaluated(x), x.detach(), msg="an eval() copy drops nothing")
    assert dropout.training


def test_a_data_parallel_style_replica_uses_its_own_weight() -> None:
    linear = nn.Linear(3, 2)
    go.override_backward(linear, _doubling_linear_rule)
    # What `nn.parallel.replicate` does on each device: a shallow copy holding the
    # device's copies of the parameters (tensors computed from the originals).
    replica = linear._replicate_for_data_parallel()
    weight = torch.ones(2, 3, requires_grad=True)
    replica._parameters["weight"] = weight * 1
    replica._parameters["bias"] = linear.bias * 1
    x = torch.ones(1, 3, requires_grad=True)
    out = replica(x)
    torch.testing.assert_close(out, x.detach() @ torch.ones(3, 2) + linear.bias.detach())
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((1, 3), 4.0))  # twice ones^T @ ones
    torch.testing.assert_close(weight.grad, torch.ones(2, 3))
    assert linear.weight.grad is None



def _doubling_linear_rule(grad, *, input, module):
    return {"input": grad @ module.weight * 2, "weight": grad.T @ input, "bias": grad.sum(0)}
