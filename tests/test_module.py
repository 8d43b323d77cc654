"""`go.Module`: a module whose subclass defines `backward`, parameters included."""

from __future__ import annotations

import copy
import io
import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pytest
import saved_models
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import parametrize

import gradoverride as go
from gradoverride._decorators import arm_all
from gradoverride.recipes import reverse_grad


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


# ==== edges of module rules =================================================================
# Silent wrong or lost gradients of `go.Module` and `override_backward`, each fixed or refused.
#
# Expected gradients come from plain autograd of the same math or are written out by hand.


pytestmark = pytest.mark.filterwarnings(
    # Dynamo instantiates `torch.autograd.Function()` for a traced Function's ctx and warns.
    "ignore:.*should not be instantiated:DeprecationWarning",
    # TorchScript is deprecated in torch; these tests check that it is refused clearly.
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning",
    "ignore:`torch.jit.trace` is deprecated:DeprecationWarning",
    "ignore:`torch.jit.trace_method` is deprecated:DeprecationWarning",
)

EXPECTED_MODEL_GRAD = torch.tensor([[-300.0, -600.0, -900.0]])  # see saved_models


# ---- functional_call: the rule sees the parameters the forward saw ----------------------------


class OwnsInput(go.Module, owns="x"):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w

    def backward(self, grad, *, x):
        return {"x": grad * self.w * 10}  # reads `self.w`, which it does not own


def test_functional_call_with_partial_owns_gives_the_rule_the_passed_parameter() -> None:
    layer = OwnsInput()
    x = torch.randn(3)

    def loss(params, x):
        return functional_call(layer, params, (x,)).sum()

    got = grad(loss, argnums=1)({"w": torch.full((3,), 2.0)}, x)
    torch.testing.assert_close(got, torch.full((3,), 20.0))


def test_a_vmapped_ensemble_gives_each_member_its_own_gradient() -> None:
    layer = OwnsInput()
    x = torch.randn(3)
    members = torch.stack([torch.full((3,), float(k)) for k in range(4)])

    def member_grad(w):
        return grad(lambda w, x: functional_call(layer, {"w": w}, (x,)).sum(), argnums=1)(w, x)

    got = vmap(member_grad)(members)
    torch.testing.assert_close(got, members * 10)


def test_override_backward_with_owns_under_functional_call() -> None:
    linear = nn.Linear(3, 2)

    def rule(grad, *, module):
        return grad @ module.weight * 10

    go.override_backward(linear, rule, owns="input")
    weight, bias = torch.randn(2, 3), torch.zeros(2)
    x = torch.randn(3, requires_grad=True)
    functional_call(linear, {"weight": weight, "bias": bias}, (x,)).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(2) @ weight * 10)


class ReturnsItsInput(go.Module, owns="x"):
    """Owns `x`, which its forward returns as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x

    def backward(self, grad, *, x):
        return grad * 2


def _returns_input_override():
    class Identity(nn.Module):
        def forward(self, x):
            return x

    layer = Identity()
    go.override_backward(layer, lambda grad, *, x: grad * 2, owns="x")
    return layer


@pytest.mark.parametrize("build", [ReturnsItsInput, _returns_input_override],
                         ids=["go.Module", "override_backward"])
def test_partial_ownership_output_that_is_the_input_cannot_change_it_in_place(build) -> None:
    # The forward sees `x` detached and returns it: the output shares `x`'s memory, so an
    # in-place op on it would change the caller's `x` behind autograd's back. It is a view,
    # refused as any view of an input (first call and warm calls alike).
    layer = build()
    leaf = torch.zeros(3, requires_grad=True)
    for _ in range(3):
        x = leaf * 1
        y = layer(x)
        with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
            y.add_(1)
        torch.testing.assert_close(x.detach(), torch.zeros(3))
    y = layer(leaf * 1)
    y.sum().backward()
    torch.testing.assert_close(leaf.grad, torch.full((3,), 2.0))


# ---- a module that changes its input in place ---------------------------------------------


def test_override_on_an_inplace_relu_gives_the_rule_the_input_it_was_called_with() -> None:
    relu = nn.ReLU(inplace=True)

    def rule(grad, *, input):
        return grad * torch.sigmoid(input)  # uses the input's value

    go.override_backward(relu, rule)
    x = torch.tensor([-3.0, 0.5], requires_grad=True)
    h = x * 1.0
    y = relu(h)
    assert y is h, "the module still changes its input in place, as without the override"
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.sigmoid(torch.tensor([-3.0, 0.5])))


def test_an_inplace_module_input_used_again_after_it_has_the_rules_history() -> None:
    relu = nn.ReLU(inplace=True)
    go.override_backward(relu, lambda grad, *, input: grad * 10)
    x = torch.tensor([-1.0, 2.0], requires_grad=True)
    h = x * 1.0
    relu(h)
    (h * 100).sum().backward()  # h is the module's output now: its gradient goes through the rule
    torch.testing.assert_close(x.grad, torch.full((2,), 1000.0))


def test_an_unknown_module_changing_its_input_in_place_is_refused() -> None:
    class Doubler(nn.Module):
        def forward(self, x):
            return x.mul_(2)

    doubler = Doubler()
    go.override_backward(doubler, lambda grad, *, x: grad * 2)
    with pytest.raises(go.GradOverrideError, match=r"changed its input `x` in place"):
        doubler(torch.randn(3, requires_grad=True) * 1.0)


# ---- a go.Module without backward ------------------------------------------------------------


def test_a_go_module_without_backward_is_an_error_at_class_creation() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"defines no `backward`.*abstract=True"):

        class Plain(go.Module):
            def forward(self, x):
                return torch.round(x)


def test_a_misspelled_backward_is_named() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"did you mean `backwards`\?"):

        class Typo(go.Module):
            def forward(self, x):
                return torch.round(x)

            def backwards(self, grad, *, x):
                return grad


def test_a_misspelled_backward_in_a_subclass_is_named_too() -> None:
    class Base(go.Module):
        def forward(self, x):
            return torch.round(x)

        def backward(self, grad, *, x):
            return grad

    with pytest.raises(go.GradOverrideTypeError, match=r"did you mean `Backward`\?"):

        class Child(Base):
            def Backward(self, grad, *, x):
                return grad * 2


# ---- save, load, copy -----------------------------------------------------------------------


def test_a_saved_model_with_overrides_loads_in_a_fresh_process(tmp_path: Path) -> None:
    model = saved_models.make_model()
    torch.testing.assert_close(saved_models.input_gradient(model), EXPECTED_MODEL_GRAD)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    script = textwrap.dedent(
        f"""
        import torch, saved_models
        import gradoverride as go
        model = torch.load({str(path)!r}, weights_only=False)
        print(saved_models.input_gradient(model).tolist())
        print(go.OverrideHandle.of(model[0]).active)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(saved_models.__file__).parent)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-2] == str(EXPECTED_MODEL_GRAD.tolist())
    assert lines[-1] == "True"


def test_pickle_and_deepcopy_keep_every_override() -> None:
    model = saved_models.make_model()
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        torch.testing.assert_close(saved_models.input_gradient(copied), EXPECTED_MODEL_GRAD)
        assert go.OverrideHandle.of(copied[0]).active


def test_a_loaded_override_can_be_removed() -> None:
    buffer = io.BytesIO()
    torch.save(saved_models.make_model(), buffer)
    buffer.seek(0)
    model = torch.load(buffer, weights_only=False)
    go.OverrideHandle.of(model[0]).remove()
    assert "forward" not in model[0].__dict__


def test_ops_made_from_builtins_pickle() -> None:
    for op in (saved_models.sign_times_three, saved_models.clipped_sign):
        again = pickle.loads(pickle.dumps(op))
        x = torch.tensor([0.5, -2.0], requires_grad=True)
        again(x).sum().backward()
        want = torch.full((2,), 3.0) if op is saved_models.sign_times_three else torch.tensor(
            [1.0, 0.0]
        )
        torch.testing.assert_close(x.grad, want)


def test_saving_an_override_with_a_lambda_rule_says_why() -> None:
    linear = nn.Linear(2, 2)
    go.override_backward(linear, lambda grad, *, input, module: grad @ module.weight, owns="input")
    with pytest.raises(go.GradOverrideError, match=r"cannot be pickled.*not a lambda"):
        torch.save(linear, io.BytesIO())


# ---- the first call compiled ----------------------------------------------------------------


@pytest.mark.compile
def test_the_first_call_of_a_go_module_may_be_compiled_with_fullgraph() -> None:
    class Fresh(saved_models.Scaled):  # a fresh class: no call of it ran eagerly before
        def forward(self, x):
            return x * self.weights

        def backward(self, grad, *, x):
            return {"x": grad * self.weights * 10, "weights": grad * x * 10}

    layer = Fresh()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.tensor([0.5, 1.0, -1.0], requires_grad=True)
    compiled(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([10.0, 20.0, 30.0]))
    torch.testing.assert_close(layer.weights.grad, x.detach() * 10)


@pytest.mark.compile
def test_the_first_call_of_an_overridden_module_may_be_compiled_with_fullgraph() -> None:
    linear = nn.Linear(3, 2)
    go.override_backward(linear, saved_models.linear_rule)
    compiled = torch.compile(linear, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 3, requires_grad=True)
    compiled(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4, 2) @ linear.weight.detach() * 10)


# ---- lazy modules, no-grad calls -----------------------------------------------------------


class HoldsLazy(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.LazyLinear(2)

    def forward(self, x):
        return self.inner(x)

    def backward(self, grad, *, x):
        return {
            "x": grad @ self.inner.weight,
            "inner.weight": grad.T @ x,
            "inner.bias": grad.sum(0),
        }


def test_a_lazy_submodule_asks_for_a_dry_run_and_then_works() -> None:
    layer = HoldsLazy()
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(go.GradOverrideError, match=r"`inner\.weight`.*torch\.no_grad"):
        layer(x)
    with torch.no_grad():
        layer(x)  # the dry run materializes the parameters
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4, 2) @ layer.inner.weight.detach())
    torch.testing.assert_close(layer.inner.weight.grad, torch.ones(2, 4) @ x.detach())


# ---- TorchScript -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        saved_models.Scaled,
        lambda: saved_models.make_model()[0],
        lambda: reverse_grad().module(),
        lambda: saved_models.sign_times_three.module(),
        lambda: nn.Sequential(nn.Linear(3, 3), saved_models.Scaled()),
    ],
    ids=["go.Module", "override_backward", "recipe module", "op module", "inside Sequential"],
)
def test_torch_jit_script_refuses_instead_of_dropping_the_rule(make) -> None:
    with pytest.raises(go.GradOverrideError, match=r"torch\.jit\.script cannot keep the backward"):
        torch.jit.script(make())


def test_torch_jit_trace_refuses_instead_of_dropping_the_rule() -> None:
    with pytest.raises(go.GradOverrideError, match=r"torch\.jit\.trace cannot keep the backward"):
        torch.jit.trace(saved_models.Scaled(), torch.randn(3))


def test_a_traced_function_calling_an_op_is_refused_with_grad_and_traces_without() -> None:
    # The traced graph would hold the rule as an opaque Python op, which no LibTorch runtime
    # can run; without gradients the forward alone is recorded, as for deployment.
    def fn(x: torch.Tensor) -> torch.Tensor:
        return saved_models.sign_times_three(x) * 2

    with pytest.raises(go.GradOverrideError, match=r"trace under `torch\.no_grad\(\)`"):
        torch.jit.trace(fn, torch.randn(3))
    with torch.no_grad():
        traced = torch.jit.trace(fn, torch.randn(3))
    x = torch.randn(5)
    torch.testing.assert_close(traced(x), torch.sign(x) * 2)
    assert "sign" in str(traced.graph) and "CustomBackward" not in str(traced.graph)


# ---- messages for the module return forms ------------------------------------------------------


class ReturnsTuple(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return x * self.w

    def backward(self, grad, *, x):
        return (grad * self.w,)


class ReturnsNone(ReturnsTuple):
    def backward(self, grad, *, x):
        return None


@pytest.mark.parametrize(
    ("cls", "form"), [(ReturnsTuple, "a tuple"), (ReturnsNone, "None")], ids=["tuple", "None"]
)
def test_a_module_rule_without_parameter_gradients_is_told_the_dict_form(cls, form) -> None:
    x = torch.randn(2, requires_grad=True)
    y = cls()(x)
    with pytest.raises(go.GradOverrideError) as info:
        y.sum().backward()
    text = str(info.value)
    assert f"returned {form}" in text
    assert "owns the parameter `w`" in text
    assert "{'x': grad_x, 'w': grad_w}" in text


# ---- compiled calls that leave the fast path ----------------------------------------------


class KeywordLayer(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x, scale=1.0):
        return x * self.w * scale

    def backward(self, grad, *, x, scale):
        return {"x": grad * self.w * scale * 10, "w": grad * x * scale}


class OnceLayer(go.Module, once_differentiable=True):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x):
        return x * self.w

    def backward(self, grad, *, x):
        return {"x": grad * self.w * 10, "w": grad * x}


@pytest.mark.compile
@pytest.mark.parametrize(
    ("layer", "call", "factor"),
    [(KeywordLayer, lambda m, x: m(x, scale=3.0), 30.0), (OnceLayer, lambda m, x: m(x), 10.0)],
    ids=["keyword argument", "once_differentiable"],
)
def test_module_calls_off_the_fast_path_compile_with_fullgraph(layer, call, factor) -> None:
    torch._dynamo.reset()
    module = layer()
    compiled = torch.compile(lambda x: call(module, x), fullgraph=True, backend="aot_eager")
    x = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    compiled(x).sum().backward()
    torch.testing.assert_close(x.grad, module.w.detach() * factor)


@pytest.mark.compile
def test_an_inplace_module_override_under_fullgraph_compile_says_why() -> None:
    torch._dynamo.reset()
    relu = nn.ReLU(inplace=True)
    go.override_backward(relu, lambda grad, *, input: grad * (input > 0))
    compiled = torch.compile(lambda x: relu(x * 1.0), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"Build the module with inplace=False"):
        compiled(torch.randn(3, requires_grad=True))


def test_an_inplace_module_override_on_a_view_input_is_refused() -> None:
    relu = nn.ReLU(inplace=True)
    go.override_backward(relu, lambda grad, *, input: grad * torch.sigmoid(input))
    h = torch.randn(4, requires_grad=True) * 1.0
    with pytest.raises(go.GradOverrideError, match=r"a view of another tensor.*clone\(\)"):
        relu(h[1:3])


# ---- buffers ------------------------------------------------------------------------------


class WithBuffer(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.register_buffer("s", torch.ones(3))

    def forward(self, x):
        return x * self.w * self.s

    def backward(self, grad, *, x):
        return {"x": grad * self.w * self.s, "w": (grad * x * self.s)}


def test_buffers_passed_to_functional_call_reach_the_rule() -> None:
    layer = WithBuffer()
    x = torch.randn(3, requires_grad=True)
    functional_call(layer, {"s": torch.full((3,), 3.0)}, (x,)).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))


def test_buffers_wrapped_by_vmap_are_refused_by_name() -> None:
    layers = [WithBuffer() for _ in range(2)]
    params, buffers = torch.func.stack_module_state(layers)
    base = WithBuffer()

    def loss(p, b, x):
        return functional_call(base, {**p, **b}, (x,)).sum()

    with pytest.raises(go.GradOverrideError, match=r"the buffer `s`.*only the parameters"):
        vmap(grad(loss, argnums=2), in_dims=(0, 0, None))(params, buffers, torch.randn(3))


def test_an_inplace_module_override_on_a_keyword_view_input_is_refused() -> None:
    relu = nn.ReLU(inplace=True)
    go.override_backward(relu, lambda grad, *, input: grad * (input > 0))
    h = torch.randn(2, 2, requires_grad=True) * 1.0
    with pytest.raises(go.GradOverrideError, match=r"a view of another tensor"):
        relu(input=h[:, 1:])


# ==== a module changed between calls ========================================================
# What a module rule keeps between calls, and when it is made again.
#
# `go.Module` and `override_backward` keep, per module, what walking its parameters and
# buffers gave (`gradoverride/_layout.py`) and, for a module without submodules, a generated
# entry that checks the module's structure on every call (`gradoverride/_module_fastpath.py`).
# Each test here warms a module up (its first call is checked and takes the op's own path;
# the later ones take the kept layout), changes what the layout describes, and compares the
# next call's gradients with plain autograd of the same math: a layout kept past that change
# would give the old parameters, names or buffers.


X = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])
UP = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.7, -1.1]])


def grads_of(module: nn.Module, x: Tensor = X, call: object = None) -> dict[str, Tensor]:
    """d sum(module(x) * UP) / d(x and each parameter), by backward."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = module(x) if call is None else call(x)  # type: ignore[operator]
    (out * UP.to(out.device, out.dtype)).sum().backward()
    got = {"x": x.grad}
    got.update({n: p.grad for n, p in module.named_parameters()})
    return got


def assert_grads(got: dict[str, Tensor | None], expected: dict[str, Tensor]) -> None:
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for name, value in expected.items():
        assert got[name] is not None, f"{name} got no gradient"
        torch.testing.assert_close(got[name], value, msg=lambda m, n=name: f"{n}: {m}")


def warm(module: nn.Module, times: int = 2) -> nn.Module:
    for _ in range(times):
        grads_of(module, X * 0.5)
    module.zero_grad(set_to_none=True)
    return module


# ---- go.Module: x * w + b, the rule doubling x's gradient ---------------------------------


class Affine(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, -1.0]))
        self.b = nn.Parameter(torch.tensor([0.1, 0.2, 0.3]))

    def forward(self, x):
        out = x * self.w
        if self.b is not None:
            out = out + self.b
        extra = self._parameters.get("c")
        return out if extra is None else out + extra * x

    def backward(self, grad, *, x):
        params = dict(self.named_parameters())
        out = {"x": grad * self.w * 2, "w": (grad * x).sum(0)}
        if "b" in params:
            out["b"] = grad.sum(0)
        elif self.b is self.w:  # tied: one parameter, named `w`
            out["w"] = out["w"] + grad.sum(0)
        if "c" in params:
            out["x"] = out["x"] + grad * params["c"] * 2
            out["c"] = (grad * x).sum(0)
        return out


def affine_reference(w: Tensor, b: Tensor | None, c: Tensor | None = None,
                     tied: bool = False) -> dict[str, Tensor]:
    """The gradients Affine's rule gives, from plain autograd of x * w (+ b) (+ c * x), with
    x's doubled."""
    x = X.clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    out = x * w
    leaves = {"x": x, "w": w}
    if tied:
        out = out + w
    elif b is not None:
        b = b.detach().clone().requires_grad_()
        leaves["b"] = b
        out = out + b
    if c is not None:
        c = c.detach().clone().requires_grad_()
        leaves["c"] = c
        out = out + c * x
    (out * UP).sum().backward()
    got = {n: t.grad for n, t in leaves.items()}
    got["x"] = got["x"] * 2
    return got  # type: ignore[return-value]


def test_a_parameter_replaced_between_calls_gets_the_gradient() -> None:
    layer = warm(Affine())
    old = layer.w
    layer.w = nn.Parameter(torch.tensor([3.0, -2.0, 0.5]))
    assert_grads(grads_of(layer), affine_reference(layer.w, layer.b))
    assert old.grad is None


def test_load_state_dict_assign_between_calls() -> None:
    layer = warm(Affine())
    state = {"w": torch.tensor([0.5, 0.5, 4.0]), "b": torch.tensor([1.0, 1.0, 1.0])}
    layer.load_state_dict(state, assign=True)
    assert_grads(grads_of(layer), affine_reference(state["w"], state["b"]))


def test_a_parameter_set_to_none_between_calls() -> None:
    layer = warm(Affine())
    layer.b = None
    assert_grads(grads_of(layer), affine_reference(layer.w, None))


def test_a_parameter_registered_between_calls() -> None:
    layer = warm(Affine())
    layer.c = nn.Parameter(torch.tensor([0.5, -1.0, 1.0]))
    assert_grads(grads_of(layer), affine_reference(layer.w, layer.b, layer.c))


def test_parameters_tied_between_calls() -> None:
    layer = warm(Affine())
    layer.b = layer.w  # now one parameter, named once
    assert_grads(grads_of(layer), affine_reference(layer.w, None, tied=True))


def test_functional_call_between_calls_gives_the_passed_parameters_their_gradient() -> None:
    layer = warm(Affine())
    params = {"w": torch.tensor([2.0, 1.0, 0.5], requires_grad=True),
              "b": torch.tensor([0.0, 1.0, 2.0], requires_grad=True)}
    x = X.clone().requires_grad_()
    (functional_call(layer, params, (x,)) * UP).sum().backward()
    expected = affine_reference(params["w"], params["b"])
    assert_grads({"x": x.grad, "w": params["w"].grad, "b": params["b"].grad}, expected)
    assert layer.w.grad is None
    # And the module's own parameters again afterwards.
    assert_grads(grads_of(layer), affine_reference(layer.w, layer.b))


def test_functional_call_with_parameter_objects_between_calls() -> None:
    # nn.Parameter objects pass the structure check; the rule must still see them, not the
    # module's own parameters it holds again by the time backward runs.
    layer = warm(Affine())
    params = {"w": nn.Parameter(torch.tensor([2.0, 1.0, 0.5])),
              "b": nn.Parameter(torch.tensor([0.0, 1.0, 2.0]))}
    x = X.clone().requires_grad_()
    (functional_call(layer, params, (x,)) * UP).sum().backward()
    expected = affine_reference(params["w"], params["b"])
    assert_grads({"x": x.grad, "w": params["w"].grad, "b": params["b"].grad}, expected)
    assert layer.w.grad is None


def test_to_float64_between_calls() -> None:
    layer = warm(Affine()).to(torch.float64)
    got = grads_of(layer, X.double())
    assert all(g.dtype == torch.float64 for g in got.values())
    expected = affine_reference(layer.w.float(), layer.b.float())
    assert_grads({n: g.float() for n, g in got.items()}, expected)


@pytest.fixture
def overwrite_on_conversion() -> Iterator[None]:
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    yield
    torch.__future__.set_overwrite_module_params_on_conversion(before)


def test_to_with_new_parameters_between_calls(overwrite_on_conversion: None) -> None:
    layer = warm(Affine())
    old = layer.w
    layer.to(torch.float64)
    assert layer.w is not old  # `.to()` made new parameters
    got = grads_of(layer, X.double())
    assert_grads({n: g.float() for n, g in got.items()},
                 affine_reference(layer.w.float(), layer.b.float()))
    assert old.grad is None


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_warm_module_gives_its_own_parameters_the_gradient(how: str) -> None:
    layer = warm(Affine())
    copied = copy.deepcopy(layer) if how == "deepcopy" else pickle.loads(pickle.dumps(layer))
    with torch.no_grad():
        copied.w.mul_(3)
    for _ in range(2):
        assert_grads(grads_of(copied), affine_reference(copied.w, copied.b))
    assert layer.w.grad is None
    assert_grads(grads_of(layer), affine_reference(layer.w, layer.b))


# ---- buffers --------------------------------------------------------------------------


class Scaled(go.Module):
    """x * w * s, with s an optional buffer (1 without it); the rule reads `self.s`."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))

    def forward(self, x):
        s = self._buffers.get("s")
        return x * self.w * (1.0 if s is None else s)

    def backward(self, grad, *, x):
        s = self._buffers.get("s")
        s = 1.0 if s is None else s
        return {"x": grad * self.w * s * 2, "w": (grad * x * s).sum(0)}


def scaled_reference(w: Tensor, s: Tensor | float) -> dict[str, Tensor]:
    x = X.clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    (x * w * s * UP).sum().backward()
    return {"x": x.grad * 2, "w": w.grad}  # type: ignore[operator,dict-item]


def test_a_buffer_registered_between_calls_and_passed_to_functional_call() -> None:
    layer = warm(Scaled())
    layer.register_buffer("s", torch.full((3,), 2.0))
    assert_grads(grads_of(layer), scaled_reference(layer.w, layer.s))
    warm(layer)
    # Only the buffer passed: the module keeps its own parameter, and the rule must see the
    # buffer the forward saw, not the module's own.
    passed = torch.full((3,), 3.0)
    got = grads_of(layer, call=lambda x: functional_call(layer, {"s": passed}, (x,)))
    assert_grads(got, scaled_reference(layer.w, passed))


def test_a_buffer_replaced_between_calls() -> None:
    layer = Scaled()
    layer.register_buffer("s", torch.full((3,), 2.0))
    warm(layer)
    layer.s = torch.full((3,), -1.5)
    assert_grads(grads_of(layer), scaled_reference(layer.w, layer.s))


# ---- submodules -----------------------------------------------------------------------


class MaybeInner(go.Module):
    """x * w, then `inner` (an nn.Linear) when there is one; the rule gives its gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, -1.0]))

    def forward(self, x):
        h = x * self.w
        inner = self._modules.get("inner")
        return h if inner is None else inner(h)

    def backward(self, grad, *, x):
        inner = self._modules.get("inner")
        out = {}
        if inner is not None:
            h = x * self.w
            out["inner.weight"] = grad.T @ h
            out["inner.bias"] = grad.sum(0)
            grad = grad @ inner.weight
        out["x"] = grad * self.w * 2
        out["w"] = (grad * x).sum(0)
        return out


def test_a_submodule_added_between_calls_gets_its_gradients() -> None:
    layer = warm(MaybeInner())
    layer.inner = nn.Linear(3, 3)
    x = X.clone().requires_grad_()
    w = layer.w.detach().clone().requires_grad_()
    inner = copy.deepcopy(layer.inner)
    (inner(x * w) * UP).sum().backward()
    expected = {"x": x.grad * 2, "w": w.grad, "inner.weight": inner.weight.grad,
                "inner.bias": inner.bias.grad}
    for _ in range(2):
        assert_grads(grads_of(layer), expected)  # type: ignore[arg-type]


def test_a_submodule_replaced_between_calls() -> None:
    layer = MaybeInner()
    layer.inner = nn.Linear(3, 3)
    warm(layer)
    layer.inner = nn.Linear(3, 3)
    x = X.clone().requires_grad_()
    w = layer.w.detach().clone().requires_grad_()
    inner = copy.deepcopy(layer.inner)
    (inner(x * w) * UP).sum().backward()
    expected = {"x": x.grad * 2, "w": w.grad, "inner.weight": inner.weight.grad,
                "inner.bias": inner.bias.grad}
    assert_grads(grads_of(layer), expected)  # type: ignore[arg-type]


def linear_rule(grad: Tensor, *, input: Tensor, module: nn.Module) -> dict[str, Tensor]:
    """nn.Linear's gradients, the input's doubled; for whichever parameters it has now."""
    out = {"input": grad @ module.weight * 2, "weight": grad.T @ input}
    if module.bias is not None:
        out["bias"] = grad.sum(0)
    return out


def linear_reference(weight: Tensor, bias: Tensor | None) -> dict[str, Tensor]:
    x = X.clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    leaves = {"x": x, "weight": w}
    out = x @ w.T
    if bias is not None:
        b = bias.detach().clone().requires_grad_()
        leaves["bias"] = b
        out = out + b
    (out * UP).sum().backward()
    got = {n: t.grad for n, t in leaves.items()}
    got["x"] = got["x"] * 2
    return got  # type: ignore[return-value]


def test_override_backward_bias_removed_between_calls() -> None:
    linear = nn.Linear(3, 3)
    go.override_backward(linear, linear_rule)
    warm(linear)
    linear.bias = None
    assert_grads(grads_of(linear), linear_reference(linear.weight, None))


def test_override_backward_weight_replaced_between_calls() -> None:
    linear = nn.Linear(3, 3)
    go.override_backward(linear, linear_rule)
    warm(linear)
    linear.weight = nn.Parameter(torch.randn(3, 3))
    assert_grads(grads_of(linear), linear_reference(linear.weight, linear.bias))


def test_override_removed_and_another_installed_between_calls() -> None:
    linear = nn.Linear(3, 3)
    handle = go.override_backward(linear, linear_rule)
    warm(linear)
    handle.remove()

    def tripled(grad, *, input, module):
        return {"input": grad @ module.weight * 3, "weight": grad.T @ input,
                "bias": grad.sum(0)}

    go.override_backward(linear, tripled)
    expected = linear_reference(linear.weight, linear.bias)
    expected["x"] = expected["x"] / 2 * 3
    for _ in range(2):
        assert_grads(grads_of(linear), expected)


def test_a_nested_override_rewalks_a_structure_changed_between_calls() -> None:
    # A module with submodules takes the kept layout, checked by its key on every call.
    block = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))

    def rule(grad, *, input, module):
        first, second = module[0], module[1]
        h = first(input)
        out = {"input": grad @ second.weight @ first.weight * 2}
        out["1.weight"] = grad.T @ h
        out["1.bias"] = grad.sum(0)
        g = grad @ second.weight
        out["0.weight"] = g.T @ input
        out["0.bias"] = g.sum(0)
        return {k: v for k, v in out.items() if k in dict(module.named_parameters())
                or k == "input"}

    go.override_backward(block, rule)
    warm(block)
    block[1].bias = None  # a name gone from named_parameters()
    x = X.clone().requires_grad_()
    ref = copy.deepcopy(block)
    go.OverrideHandle.of(ref).remove()
    (ref(x) * UP).sum().backward()
    expected = {"x": x.grad * 2, "0.weight": ref[0].weight.grad, "0.bias": ref[0].bias.grad,
                "1.weight": ref[1].weight.grad}
    assert_grads(grads_of(block), expected)  # type: ignore[arg-type]


# ---- in-place, and the first-call check --------------------------------------------------


def relu_rule(grad, *, input):
    return grad * (input > 0) * 2


def test_inplace_turned_on_between_calls() -> None:
    relu = nn.ReLU()
    go.override_backward(relu, relu_rule)
    warm(relu)
    relu.inplace = True
    x = X.clone().requires_grad_()
    h = x * 1.0
    out = relu(h)
    assert out is h  # changed in place, as the module does
    (out * UP).sum().backward()
    torch.testing.assert_close(x.grad, UP * (X > 0) * 2)


CAPTURED = torch.tensor([1.0, 1.0, 1.0], requires_grad=True)


class Capturing(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.capture = False

    def forward(self, x):
        return x * self.w + (CAPTURED if self.capture else 0)

    def backward(self, grad, *, x):
        return {"x": grad * self.w, "w": (grad * x).sum(0)}


def test_a_warm_module_is_checked_again_when_the_checks_are_armed() -> None:
    layer = warm(Capturing())
    layer.capture = True
    arm_all()  # what gradoverride.testing does before each of its runs
    with pytest.raises(go.GradOverrideError, match=r"the forward of `Capturing` reads `CAPTURED`"):
        layer(X.clone().requires_grad_())


# ---- forward parameters named like Python builtins -----------------------------------------


class Builtins(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, type, len=2.0):
        return type * self.w * len

    def backward(self, grad, *, type, len):
        return {"type": grad * self.w * len * 2, "len": None, "w": (grad * type * len).sum(0)}


def test_forward_parameters_named_like_builtins() -> None:
    layer = Builtins()
    for _ in range(3):
        x = X.clone().requires_grad_()
        layer.zero_grad()
        (layer(x, 2.0) * UP).sum().backward()
        torch.testing.assert_close(x.grad, UP * layer.w.detach() * 4)
        torch.testing.assert_close(layer.w.grad, (UP * X * 2).sum(0))


# ---- between forward and backward, and the rule's mistakes on a warm module ----------------


def test_a_parameter_replaced_between_forward_and_backward() -> None:
    # The rule reads `self.w`: it must be the tensor the forward saw, not the new one.
    layer = warm(Affine())
    seen = layer.w
    x = X.clone().requires_grad_()
    out = layer(x)
    layer.w = nn.Parameter(torch.tensor([9.0, 9.0, 9.0]))
    (out * UP).sum().backward()
    expected = affine_reference(seen, layer.b)
    torch.testing.assert_close(x.grad, expected["x"])
    torch.testing.assert_close(seen.grad, expected["w"])


class WritesGrad(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.mistake: str | None = None

    def forward(self, x):
        return x * self.w

    def backward(self, grad, *, x):
        if self.mistake == "grad":
            self.w.grad = torch.zeros(3)
        if self.mistake == "shape":
            return {"x": grad * self.w, "w": torch.ones(2)}
        if self.mistake == "missing":
            return {"x": grad * self.w}
        return {"x": grad * self.w, "w": (grad * x).sum(0)}


@pytest.mark.parametrize(
    ("mistake", "match"),
    [
        ("grad", r"wrote `w\.grad` itself"),
        ("shape", r"`WritesGrad`.*`w`"),
        ("missing", r"returned a dict without `w`, which it owns"),
    ],
)
def test_a_rule_mistake_on_a_warm_module_is_refused(mistake: str, match: str) -> None:
    layer = warm(WritesGrad())
    layer.mistake = mistake
    with pytest.raises(go.GradOverrideError, match=match):
        grads_of(layer)


@go.custom_backward
def _fails_in_backward(x: Tensor) -> Tensor:
    return x * 1


@_fails_in_backward.backward
def _(grad: Tensor) -> Tensor:
    raise ValueError("this pass fails")


@pytest.mark.parametrize("before", ["nothing", "failed passes"])
def test_a_warm_rule_writing_grad_is_refused_while_an_idle_thread_lives(before: str) -> None:
    # Threads that do not train the module (a data loader, a compile worker) do not turn
    # the check off; nor do passes that ran the module's rule, then failed, in threads of
    # their own (autograd drops a failed pass's callbacks: its end is never called).
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait)
    idle.start()
    try:
        layer = warm(WritesGrad())
        failed: list[str] = []

        def failing_pass() -> None:
            try:
                layer(_fails_in_backward(X.clone().requires_grad_())).sum().backward()
            except ValueError as e:
                failed.append(str(e))

        for _ in range(2 if before == "failed passes" else 0):
            other = threading.Thread(target=failing_pass)
            other.start()
            other.join()
        assert len(failed) == (2 if before == "failed passes" else 0)
        layer.mistake = "grad"
        with pytest.raises(go.GradOverrideError, match=r"wrote `w\.grad` itself"):
            grads_of(layer)
    finally:
        stop.set()
        idle.join()


def test_warm_rules_and_hooks_on_each_device(device: torch.device) -> None:
    """The fast paths on each device (CUDA where there is one): three calls each, against
    plain autograd of the same math."""
    x0, up = X.to(device), UP.to(device)
    layer = Affine().to(device)
    linear = nn.Linear(3, 3).to(device)
    go.override_backward(linear, linear_rule)
    hooked = {}
    for at in ("inputs", "outputs", "parameters"):
        hooked[at] = copy.deepcopy(linear)
        handle = go.OverrideHandle.of(hooked[at])
        handle.remove()
        go.grad_hook(hooked[at], triple_negated, at=at)  # type: ignore[arg-type]

    def linear_grads(scale_in: float, scale_out: float, scale_p: float) -> dict[str, Tensor]:
        # d sum(linear(x) * up * scale_out) / d(x, weight, bias), each then scaled.
        x = x0.clone().requires_grad_()
        w = linear.weight.detach().clone().requires_grad_()
        b = linear.bias.detach().clone().requires_grad_()
        (nn.functional.linear(x, w, b) * up * scale_out).sum().backward()
        return {"x": x.grad * scale_in, "weight": w.grad * scale_p,  # type: ignore[operator]
                "bias": b.grad * scale_p}  # type: ignore[operator]

    expected = {
        "inputs": linear_grads(-3.0, 1.0, 1.0),
        "outputs": linear_grads(1.0, -3.0, 1.0),
        "parameters": linear_grads(1.0, 1.0, -3.0),
    }
    for _ in range(3):
        w = layer.w.detach()
        assert_grads(grads_of(layer, x0), {"x": up * w * 2, "w": (up * x0).sum(0), "b": up.sum(0)})
        assert_grads(grads_of(linear, x0), linear_grads(2.0, 1.0, 1.0))
        for at, module in hooked.items():
            assert_grads(grads_of(module, x0), expected[at])


def triple_negated(grad: Tensor) -> Tensor:
    return grad * -3


# ==== a backward assigned later, each instance checked, a parameter renamed, returned or ====
# ==== changed before backward, two threads ===================================================


class Scale(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0]))

    def forward(self, x):
        return x * self.w

    def backward(self, grad, *, x):
        return {"x": grad * self.w, "w": grad * x}


def test_a_backward_patched_on_the_class_is_used() -> None:
    layer = Scale()
    x = torch.ones(2, requires_grad=True)
    layer(x).sum().backward()

    def tripled(self, grad, *, x):
        return {"x": grad * 3, "w": None}

    with mock.patch.object(Scale, "backward", tripled):
        x.grad = None
        layer(x).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((2,), 3.0))
    x.grad = None
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.w.detach())


def test_a_backward_assigned_on_the_instance_is_used() -> None:
    layer = Scale()
    layer.backward = lambda grad, *, x: {"x": grad * 5, "w": None}
    x = torch.ones(2, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 5.0))


# ---- each instance, a copy included, is checked -------------------------------------------

CAPTURED_PAIR = torch.ones(2, requires_grad=True)


class Captures(go.Module):
    def __init__(self, capture: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.capture = capture

    def forward(self, x):
        return x * self.w * (CAPTURED_PAIR if self.capture else 1.0)

    def backward(self, grad, *, x):
        return {"x": grad * self.w, "w": grad * x}


def test_a_second_instance_reading_a_captured_tensor_is_checked() -> None:
    Captures(False)(torch.ones(2, requires_grad=True))
    with pytest.raises(go.GradOverrideError, match="reads `CAPTURED_PAIR`"):
        Captures(True)(torch.ones(2, requires_grad=True))


def test_a_copy_of_a_checked_instance_is_checked() -> None:
    layer = Captures(False)
    layer(torch.ones(2, requires_grad=True))
    twin = copy.copy(layer)
    twin.capture = True
    with pytest.raises(go.GradOverrideError, match="reads `CAPTURED_PAIR`"):
        twin(torch.ones(2, requires_grad=True))


# ---- two threads ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["go.Module", "override_backward"])
def test_one_module_trained_from_two_threads(kind: str) -> None:
    if kind == "go.Module":
        module: nn.Module = Scale()
        expected_x = lambda m: m.w.detach().expand(1, 2)  # noqa: E731
    else:
        module = nn.Linear(2, 2)
        go.override_backward(module, linear_rule)
        expected_x = lambda m: torch.ones(1, 2) @ m.weight.detach() * 2  # noqa: E731
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work() -> None:
        try:
            barrier.wait()
            for _ in range(200):
                # (No zero_grad here: PyTorch itself does not support clearing `.grad`
                # while another thread's backward accumulates into it.)
                x = torch.ones(1, 2, requires_grad=True)
                module(x).sum().backward()
                torch.testing.assert_close(x.grad, expected_x(module))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class TrainsMeanwhile(go.Module):
    """`x * w`; the first thread's rule waits while another thread runs `meanwhile` on the
    module (trains it through a whole step, or clears its gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0]))
        self.meanwhile: Callable[[nn.Module], object] | None = None

    def forward(self, x):
        return x * self.w

    def backward(self, grad, *, x):
        meanwhile = self.meanwhile
        if meanwhile is not None and threading.current_thread() is threading.main_thread():
            other = threading.Thread(target=lambda: meanwhile(self))
            other.start()
            other.join()
        return {"x": grad * self.w, "w": (grad * x).sum(0)}


def _warm_meanwhile(layer: TrainsMeanwhile) -> None:
    for _ in range(2):
        layer(torch.ones(1, 2)).sum().backward()
    layer.zero_grad(set_to_none=True)


# What another thread does to the module while the first thread's rule runs (the other
# thread's pass ends before the rule does: it no longer runs then, yet it made `w.grad`;
# an optimizer's `zero_grad` between its steps clears an earlier micro-batch's gradient),
# `w.grad` before, and `w.grad` after the first thread's step.
_MEANWHILE = {
    "a whole step": (lambda m: m(torch.ones(1, 2)).sum().backward(), None, [4.0, 5.0]),
    "zero_grad": (lambda m: m.zero_grad(set_to_none=True), torch.ones(2), [3.0, 4.0]),
}


@pytest.mark.parametrize("meanwhile", sorted(_MEANWHILE))
@pytest.mark.parametrize("call", ["first", "warm"])
def test_another_thread_s_write_of_grad_during_a_rule_is_not_the_rule_s(
        call: str, meanwhile: str) -> None:
    layer = TrainsMeanwhile()
    if call == "warm":
        _warm_meanwhile(layer)
    layer.meanwhile, layer.w.grad, expected = _MEANWHILE[meanwhile]
    x = torch.tensor([[3.0, 4.0]], requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(layer.w.grad, torch.tensor(expected))
    torch.testing.assert_close(x.grad, torch.tensor([[1.0, 2.0]]))  # (the rule's)


# ---- a named parameter parametrized or made a buffer -------------------------------------


class Named(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(2))

    def forward(self, x):
        return x @ self.weight

    def backward(self, grad, *, x, weight):
        return {"x": grad @ weight.T, "weight": x.T @ grad}


class Symmetric(nn.Module):
    def forward(self, w):
        return (w + w.T) / 2


def test_a_named_parameter_parametrized_later_is_said() -> None:
    layer = Named()
    parametrize.register_parametrization(layer, "weight", Symmetric())
    with pytest.raises(go.GradOverrideTypeError,
                       match=r"names `weight`, which is parametrized now.*"
                             r"`parametrizations\.weight\.original`"):
        layer(torch.ones(1, 2, requires_grad=True))


def test_a_named_parameter_turned_into_a_buffer_is_said() -> None:
    layer = Named()
    del layer.weight
    layer.register_buffer("weight", torch.eye(2))
    with pytest.raises(go.GradOverrideTypeError, match=r"names `weight`, which is a buffer now"):
        layer(torch.ones(1, 2, requires_grad=True))


# ---- a buffer returned by the forward ----------------------------------------------------


class ReturnsBuffer(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.register_buffer("state", torch.zeros(2))

    def forward(self, x):
        with torch.no_grad():
            self.state.copy_(x * self.w)
        return self.state

    def backward(self, grad, *, x):
        return {"x": grad * self.w, "w": grad * x}


def test_a_buffer_returned_by_the_forward_stays_a_buffer() -> None:
    layer = ReturnsBuffer()
    for _ in range(3):
        x = torch.tensor([2.0, 3.0], requires_grad=True)
        layer(x).sum().backward()
        torch.testing.assert_close(x.grad, torch.ones(2))
        assert layer.state.grad_fn is None and not layer.state.requires_grad


# ---- a parameter changed between forward and backward ------------------------------------


class ShiftedScale(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0]))
        self.b = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return x * self.w + self.b

    def backward(self, grad, *, x):
        return {"x": grad * self.w, "w": grad * x, "b": grad}


def test_a_parameter_the_rule_does_not_read_may_change_before_backward() -> None:
    layer = ShiftedScale()
    x = torch.ones(2, requires_grad=True)
    out = layer(x)
    with torch.no_grad():
        layer.b.add_(1.0)  # as plain autograd allows: `x * w + b` saves no `b`
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 2.0]))


def test_a_parameter_the_rule_reads_changed_before_backward_is_refused() -> None:
    layer = ShiftedScale()
    out = layer(torch.ones(2, requires_grad=True))
    with torch.no_grad():
        layer.w.mul_(2.0)
    with pytest.raises(go.GradOverrideError, match=r"reads the parameter `w`, which was changed"):
        out.sum().backward()


# ---- a forgotten `*` in a go.Module's backward -------------------------------------------


def test_a_forgotten_star_is_said_when_the_class_is_made() -> None:
    with pytest.raises(go.GradOverrideTypeError,
                       match=r"Did you mean `def backward\(self, grad, \*, x\)`"):

        class Forgot(go.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(2))

            def forward(self, x):
                return x * self.w

            def backward(self, grad, x):
                return {"x": grad, "w": grad}


# ---- found by review: names, subclasses, compiled rules, buffers ----------------------------


def test_a_forward_argument_named_like_a_parameter_is_refused() -> None:
    class Clash(go.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(3))

        def forward(self, x, bias):
            return x + bias + self.bias

        def backward(self, grad, *, x):
            return {"x": grad, "bias": grad}

    with pytest.raises(go.GradOverrideError,
                       match=r"Clash`'s forward takes an argument named `bias`, and the module "
                             r"has a parameter of that name.*Rename the forward's argument"):
        Clash()


class Base(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w

    def backward(self, grad, *, x):
        return {"x": grad * 2, "w": grad * x}


class Child(Base):
    def forward(self, x):
        return super().forward(x) + 1  # the base's forward, as a step of the child's


def test_a_subclass_calling_super_forward_runs_its_own_rule() -> None:
    x = torch.ones(3, requires_grad=True)
    child = Child()
    y = child(x)
    torch.testing.assert_close(y.detach(), torch.full((3,), 2.0))
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))  # the rule's, once
    with torch.no_grad():
        torch.testing.assert_close(child(x), torch.full((3,), 2.0))


def triple_by_instance(grad, *, x, module):
    return {"x": 3 * grad * module.w, "w": 3 * grad * x}


def triple_by_class(self, grad, *, x):
    return {"x": 3 * grad * self.w, "w": 3 * grad * x}


@pytest.mark.compile
def test_a_backward_assigned_later_is_the_compiled_rule_or_refused() -> None:
    layer = Base()
    layer.backward = triple_by_instance
    x = torch.ones(3, requires_grad=True)
    layer(x).sum().backward()  # an eager call reads the new rule
    x.grad = None
    torch.compile(layer, fullgraph=True, backend="aot_eager")(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))
    fresh = Base()
    with mock.patch.object(Base, "backward", triple_by_class), pytest.raises(
        Exception, match=r"has a `backward` assigned after its rule was read.*Call the module "
                         r"once outside torch.compile"
    ):
        torch.compile(fresh, fullgraph=True, backend="aot_eager")(x)


class Gate(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.frozen_by_rule = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w * self.frozen_by_rule

    def backward(self, grad, *, x):
        return {"x": grad * self.w, "w": grad * x, "frozen_by_rule": None}


@pytest.mark.compile
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_parameter_the_rule_gives_no_gradient_keeps_grad_none(compiled) -> None:
    # None, not zeros: an optimizer's weight decay would move a zero-gradient parameter.
    layer = Gate()
    run = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    run(torch.ones(3, requires_grad=True)).sum().backward()
    assert layer.frozen_by_rule.grad is None
    torch.testing.assert_close(layer.w.grad, torch.ones(3))


class RunningScale(go.Module):
    """Updates a running scale in its forward, which its rule reads."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.ones(()))

    def forward(self, x):
        self.s.mul_(0.5)
        return x * self.s

    def backward(self, grad, *, x):
        return grad * self.s


def test_a_buffer_changed_after_the_forward_is_refused_where_the_rule_reads_it() -> None:
    layer = RunningScale()
    x = torch.ones(2, requires_grad=True)
    first = layer(x)  # the rule reads s = 0.5, as this forward left it
    first.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 0.5))
    first = layer(x)
    layer(x)  # updates s again before the first call's backward
    with pytest.raises(go.GradOverrideError, match=r"reads the buffer `s`, which was changed"):
        first.sum().backward()
