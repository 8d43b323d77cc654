"""Silent wrong or lost gradients of `go.Module` and `override_backward`, each fixed or refused.

Expected gradients come from plain autograd of the same math or are written out by hand.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import saved_models
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import gradoverride as go
from gradoverride.recipes import reverse_grad

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
