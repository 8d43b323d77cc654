"""`go.Module`: a module whose subclass defines `backward`, parameters included."""

from __future__ import annotations

import copy
import io
import pickle
import re

import pytest
import torch
from torch import nn

import gradoverride as go


class LayerWithCustomGrad(go.Module):
    """The original question's layer: its backward is twice / three times the true one."""

    def __init__(self, n: int = 5) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.linspace(-1.0, 1.0, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weights

    def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": 2 * grad * self.weights, "weights": 3 * grad * x}


class OwnsX(go.Module, owns="x"):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * self.weights

    def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
        return 100 * grad


class Nested(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "x": grad @ self.inner.weight,
            "inner.weight": grad.T @ x,
            "inner.bias": grad.sum(0) * 0,  # visibly not the true gradient
        }


def _x(*shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=gen).requires_grad_()


def test_layer_with_custom_grad_gets_its_rules_gradients() -> None:
    layer = LayerWithCustomGrad()
    x = _x(4, 5)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * layer.weights.detach().expand(4, 5))
    torch.testing.assert_close(layer.weights.grad, 3 * x.detach().sum(0))


def test_parameter_gradients_accumulate_and_fire_hooks() -> None:
    layer = LayerWithCustomGrad()
    seen: list[torch.Tensor] = []
    layer.weights.register_hook(lambda g: seen.append(g.clone()))
    x = _x(2, 5)
    layer(x).sum().backward()
    layer(x).sum().backward()
    torch.testing.assert_close(layer.weights.grad, 2 * 3 * x.detach().sum(0))
    assert len(seen) == 2


def test_partial_ownership_keeps_autograd_for_parameters() -> None:
    layer = OwnsX()
    x = _x(3, 5)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3, 5), 100.0))
    torch.testing.assert_close(layer.weights.grad, torch.sin(x.detach()).sum(0))


def test_nested_parameters_by_dotted_name() -> None:
    layer = Nested()
    x = _x(2, 4)
    layer(x).sum().backward()
    grad = torch.ones(2, 3)
    torch.testing.assert_close(x.grad, grad @ layer.inner.weight.detach())
    torch.testing.assert_close(layer.inner.weight.grad, grad.T @ x.detach())
    torch.testing.assert_close(layer.inner.bias.grad, torch.zeros(3))


def test_rule_can_name_a_top_level_parameter() -> None:
    class Named(go.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor([2.0, 3.0]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

        def backward(self, grad: torch.Tensor, *, x: torch.Tensor, w: torch.Tensor) -> object:
            return {"x": grad * w, "w": grad * x}

    layer = Named()
    x = torch.tensor([5.0, 7.0], requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(layer.w.grad, torch.tensor([5.0, 7.0]))


def test_state_dict_save_load_deepcopy_pickle_and_to() -> None:
    layer = LayerWithCustomGrad()
    assert list(layer.state_dict()) == ["weights"]
    clone = LayerWithCustomGrad(5)
    clone.load_state_dict(layer.state_dict())
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (clone, loaded, copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        x = _x(2, 5)
        other(x).sum().backward()
        torch.testing.assert_close(other.weights.grad, 3 * x.detach().sum(0))
    moved = layer.to(torch.float64)
    x64 = _x(2, 5).double()
    moved(x64).sum().backward()
    assert moved.weights.grad.dtype == torch.float64


def test_nests_in_sequential() -> None:
    model = nn.Sequential(nn.Linear(5, 5), LayerWithCustomGrad(), nn.Tanh())
    x = _x(3, 5)
    model(x).sum().backward()
    assert model[0].weight.grad is not None
    assert model[1].weights.grad is not None


def test_functional_call_uses_the_parameters_passed_in() -> None:
    layer = LayerWithCustomGrad()
    weights = torch.full((5,), 7.0, requires_grad=True)
    x = _x(2, 5)
    out = torch.func.functional_call(layer, {"weights": weights}, (x,))
    torch.testing.assert_close(out, x.detach() * 7.0)
    out.sum().backward()
    # The rule reads `self.weights` as the forward saw it: the 7s, not the module's own.
    torch.testing.assert_close(x.grad, torch.full((2, 5), 14.0))
    torch.testing.assert_close(weights.grad, 3 * x.detach().sum(0))
    assert layer.weights.grad is None


def test_torch_func_grad_over_parameters() -> None:
    layer = LayerWithCustomGrad()
    params = {"weights": layer.weights.detach()}
    x = _x(2, 5).detach()

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(layer, p, (x,)).sum()

    grads = torch.func.grad(loss)(params)
    torch.testing.assert_close(grads["weights"], 3 * x.sum(0))


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_compile_fullgraph_matches_eager() -> None:
    torch._dynamo.reset()
    eager, compiled = LayerWithCustomGrad(), LayerWithCustomGrad()
    x1, x2 = _x(3, 5), _x(3, 5)
    eager(x1).sum().backward()
    torch.compile(compiled, fullgraph=True, backend="aot_eager")(x2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(eager.weights.grad, compiled.weights.grad)


def test_rule_that_writes_grad_itself_is_an_error() -> None:
    class Writes(go.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weights

        def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> object:
            self.weights.grad = grad * x
            return {"x": grad * self.weights, "weights": None}

    x = _x(3)
    with pytest.raises(
        go.GradOverrideError,
        match=re.escape("the backward of `test_rule_that_writes_grad_itself_is_an_error.<locals>."
                        "Writes` wrote `weights.grad` itself; return the gradient instead"),
    ):
        Writes()(x).sum().backward()


def test_unknown_returned_name_lists_valid_names() -> None:
    class Typo(go.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weights

        def backward(self, grad: torch.Tensor) -> object:
            return {"x": grad, "weight": grad}

    with pytest.raises(go.GradOverrideError, match=r"gradient for `weight`, which is neither an "
                       r"input nor a parameter; the names it can return are `x`, `weights`"):
        Typo()(_x(3)).sum().backward()


def test_owned_parameter_left_out_shows_both_fixes() -> None:
    class LeavesOut(go.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weights

        def backward(self, grad: torch.Tensor) -> object:
            return {"x": grad}

    with pytest.raises(
        go.GradOverrideError,
        match=re.escape("returned a dict without `weights`, which it owns; return "
                        "{'weights': None, ...} if it gets no gradient, or leave `weights` out "
                        "of `owns`"),
    ):
        LeavesOut()(_x(3)).sum().backward()


def test_wrong_shaped_parameter_gradient_names_both_shapes() -> None:
    class BadShape(go.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weights

        def backward(self, grad: torch.Tensor) -> object:
            return {"x": grad, "weights": torch.ones(4)}

    with pytest.raises(go.GradOverrideError, match=re.escape(
        "returned a gradient of shape (4,) for `weights`, which has shape (3,)"
    )):
        BadShape()(_x(3)).sum().backward()


def test_rule_naming_a_missing_parameter_fails_at_construction() -> None:
    class Missing(go.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weights

        def backward(self, grad: torch.Tensor, *, wieghts: torch.Tensor) -> object:
            return {"x": grad, "weights": grad}

    with pytest.raises(go.GradOverrideTypeError, match=re.escape(
        "names `wieghts`, which is neither an input of its forward nor one of its parameters; "
        "it may name `x`, `weights`"
    )):
        Missing()


def test_backward_without_forward_is_an_error() -> None:
    with pytest.raises(go.GradOverrideTypeError, match="defines `backward` but no `forward`"):

        class NoForward(go.Module):
            def backward(self, grad: torch.Tensor) -> torch.Tensor:
                return grad


def test_an_abstract_module_without_backward_is_an_ordinary_module() -> None:
    class Plain(go.Module, abstract=True):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    x = torch.tensor([3.0, 4.0], requires_grad=True)
    module = Plain()
    module(x).sum().backward()
    torch.testing.assert_close(module.w.grad, torch.tensor([3.0, 4.0]))
