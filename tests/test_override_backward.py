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
    # device's copies of the parameters (tensors computed from the originals, not leaves:
    # plain attributes, listed in `_former_parameters`).
    replica = linear._replicate_for_data_parallel()
    replica._former_parameters = {}
    weight = torch.ones(2, 3, requires_grad=True)
    for name, value in (("weight", weight * 1), ("bias", linear.bias * 1)):
        setattr(replica, name, value)
        replica._former_parameters[name] = value
    assert list(replica.named_parameters()) == []
    x = torch.ones(1, 3, requires_grad=True)
    out = replica(x)
    torch.testing.assert_close(out, x.detach() @ torch.ones(3, 2) + linear.bias.detach())
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((1, 3), 4.0))  # twice ones^T @ ones
    torch.testing.assert_close(weight.grad, torch.ones(2, 3))
    assert linear.weight.grad is None



def _doubling_linear_rule(grad, *, input, module):
    return {"input": grad @ module.weight * 2, "weight": grad.T @ input, "bias": grad.sum(0)}


# ---- found by review: hook order, identity and partial parameters compiled ------------------


def _true_linear_rule(grad, *, input, module):
    return {"input": grad @ module.weight, "weight": grad.T @ input, "bias": grad.sum(0)}


def test_a_pre_hook_registered_after_the_override_is_refused() -> None:
    linear = nn.Linear(3, 2)
    go.override_backward(linear, _true_linear_rule)
    linear.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    with pytest.raises(go.GradOverrideError,
                       match=r"`Linear` has an override_backward, and a forward pre-hook "
                             r"registered after it.*Register that hook before calling"):
        linear(torch.ones(1, 3, requires_grad=True))


def test_a_forward_hook_prepended_after_the_override_is_refused() -> None:
    linear = nn.Linear(3, 2)
    go.override_backward(linear, _true_linear_rule)
    linear.register_forward_hook(lambda module, args, out: None, prepend=True)
    with pytest.raises(go.GradOverrideError, match=r"registered after it with prepend=True"):
        linear(torch.ones(1, 3, requires_grad=True))


def test_hooks_registered_before_the_override_keep_their_gradient() -> None:
    linear = nn.Linear(3, 2)
    linear.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    go.override_backward(linear, _true_linear_rule)
    x = torch.ones(1, 3, requires_grad=True)
    linear(x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.ones(1, 2) @ linear.weight.detach())


# (torch's own warnings while dynamo traces a Function and resumes after a graph break)
TORCH_COMPILE_WARNINGS = (
    pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
)


@pytest.mark.compile
@TORCH_COMPILE_WARNINGS[0]
def test_an_overridden_identity_compiles_whole() -> None:
    identity = nn.Identity()
    go.override_backward(identity, lambda grad, *, input: -grad)  # gradient reversal
    x = torch.ones(3, requires_grad=True)
    torch.compile(identity, fullgraph=True, backend="aot_eager")(x).sum().backward()
    torch.testing.assert_close(x.grad, -torch.ones(3))


def _weight_rule(grad, *, input):
    return {"weight": 3 * grad.T @ input}


@pytest.mark.compile
@TORCH_COMPILE_WARNINGS[0]
@TORCH_COMPILE_WARNINGS[1]
def test_owning_some_parameters_compiles_with_a_graph_break_that_says_why() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(3, 2)
    go.override_backward(linear, _weight_rule, owns="weight")
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(Exception, match=r"owns some of its parameters but not all"):
        torch.compile(linear, fullgraph=True, backend="aot_eager")(x)
    torch.compile(linear, backend="aot_eager")(x).sum().backward()
    torch.testing.assert_close(linear.weight.grad, 3 * torch.ones(4, 2).T @ x.detach())
    torch.testing.assert_close(x.grad, torch.ones(4, 2) @ linear.weight.detach())
