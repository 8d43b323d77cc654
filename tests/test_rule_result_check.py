"""The first checked call of an op warns when its rule returns a float mask instead of
`grad * mask`: a gradient of 0s and 1s computed without the upstream gradient."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import gradoverride as go
from gradoverride import GradOverrideWarning

_MASK = (
    r"^the backward of `[^`]*clipped` returned a gradient for `x` made of 0s and 1s and "
    r"computed without the upstream gradient: a mask returned instead of `grad \* mask`\? "
    r"Multiply the upstream gradient by the mask \(`return grad \* mask`\)\. If a constant "
    r"gradient is meant, silence this with "
    r"`warnings.filterwarnings\('ignore', 'the backward of'\)`\.$"
)


def _clipped(rule: Any) -> Any:
    @go.custom_backward
    def clipped(x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-1, 1)

    clipped.backward(rule)
    return clipped


def _grad(op: Any) -> torch.Tensor:
    x = torch.tensor([0.5, 2.0, -0.2], requires_grad=True)
    (op(x) * torch.tensor([3.0, 3.0, 3.0])).sum().backward()
    assert x.grad is not None
    return x.grad


def test_a_float_mask_returned_instead_of_grad_times_mask_warns_once() -> None:
    op = _clipped(lambda grad, *, x: (x.abs() <= 1).float())
    with pytest.warns(GradOverrideWarning, match=_MASK):
        got = _grad(op)
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 1.0]))  # the mask, as returned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _grad(op)  # checked once


@pytest.mark.parametrize("rule", [
    lambda grad, *, x: grad * (x.abs() <= 1).float(),
    lambda grad, *, x: (x.abs() <= 1).float().mul_(grad),  # in place, with the gradient
    lambda grad, *, x: torch.where(x.abs() <= 1, grad, 0.0),
    lambda grad, *, x: torch.full_like(x, 0.5),  # a constant that is no mask
    lambda grad, *, x: torch.zeros_like(x),  # nothing passes
], ids=["product", "in-place", "where", "constant", "zeros"])
def test_rules_that_use_the_gradient_or_return_no_mask_do_not_warn(rule: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _grad(_clipped(rule))


def test_the_testing_tools_check_every_call_they_make() -> None:
    op = _clipped(lambda grad, *, x: (x.abs() <= 1).float())
    with pytest.warns(GradOverrideWarning, match=_MASK):
        _grad(op)
    with pytest.warns(GradOverrideWarning, match=_MASK):
        go.testing.check_backward(
            op, torch.tensor([0.5, 2.0, -0.2], dtype=torch.float64),
            reference=lambda x: x.clamp(-1, 1), raise_on_mismatch=False,
        )


def test_a_rule_computing_in_numpy_is_not_judged() -> None:
    """The gradient left torch (a go.bridge's rule, a rule in numpy): nothing to follow."""
    op = _clipped(lambda grad, *, x: torch.from_numpy(grad.numpy() * (x.abs() <= 1).numpy()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _grad(op)
    torch.testing.assert_close(got, torch.tensor([3.0, 0.0, 3.0]))
