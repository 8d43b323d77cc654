"""`go.grad_hook`: transforms at a module's inputs, outputs and parameters."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

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


# ==== in-place modules at the inputs; parameters changing after registration ================
# `grad_hook` where it used to lose the transform silently: in-place modules at the inputs,
# parameters that change after registration or that `functional_call` passes in.


pytestmark = pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")


def times_ten(grad: torch.Tensor) -> torch.Tensor:
    return grad * 10


def test_inputs_of_an_inplace_module_are_transformed() -> None:
    relu = nn.ReLU(inplace=True)
    go.grad_hook(relu, times_ten, at="inputs")
    x = torch.tensor([-1.0, 2.0], requires_grad=True)
    h = x * 1.0
    relu(h).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.0, 10.0]))


def test_the_input_transform_changes_only_this_modules_path() -> None:
    linear = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(2))
    go.grad_hook(linear, times_ten, at="inputs")
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    (linear(x).sum() + x.sum()).backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 11.0))  # 10 through linear, 1 direct


def test_a_parameter_unfrozen_after_registration_is_transformed() -> None:
    linear = nn.Linear(2, 1)
    linear.weight.requires_grad_(False)
    go.grad_hook(linear, times_ten, at="parameters")
    linear.weight.requires_grad_(True)
    linear(torch.ones(1, 2)).sum().backward()
    torch.testing.assert_close(linear.weight.grad, torch.full((1, 2), 10.0))
    torch.testing.assert_close(linear.bias.grad, torch.full((1,), 10.0))


def test_a_parameter_replaced_by_load_state_dict_assign_is_transformed() -> None:
    linear = nn.Linear(2, 1)
    go.grad_hook(linear, times_ten, at="parameters")
    linear.load_state_dict(
        {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}, assign=True
    )
    linear(torch.ones(1, 2)).sum().backward()
    torch.testing.assert_close(linear.weight.grad, torch.full((1, 2), 10.0))


def test_parameters_passed_to_functional_call_get_their_total_gradient_transformed() -> None:
    # As a parameter's own tensor hook does eagerly: every use of the tensor standing as the
    # parameter, the direct one included, before it is accumulated.
    linear = nn.Linear(2, 1)
    go.grad_hook(linear, times_ten, at="parameters")
    weight = torch.ones(1, 2, requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    out = functional_call(linear, {"weight": weight, "bias": bias}, (torch.ones(1, 2),))
    (out.sum() + weight.sum()).backward()
    torch.testing.assert_close(weight.grad, torch.full((1, 2), 20.0))
    assert linear.weight is not weight, "functional_call restored the module's own parameter"
    eager = nn.Linear(2, 1)
    go.grad_hook(eager, times_ten, at="parameters")
    with torch.no_grad():
        eager.weight.fill_(1.0)
    (eager(torch.ones(1, 2)).sum() + eager.weight.sum()).backward()
    torch.testing.assert_close(eager.weight.grad, weight.grad)


def test_parameters_under_torch_func_grad_are_transformed() -> None:
    linear = nn.Linear(2, 1)
    go.grad_hook(linear, times_ten, at="parameters")
    params = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}

    def loss(params):
        return functional_call(linear, params, (torch.ones(1, 2),)).sum()

    grads = torch.func.grad(loss)(params)
    torch.testing.assert_close(grads["weight"], torch.full((1, 2), 10.0))
    torch.testing.assert_close(grads["bias"], torch.full((1,), 10.0))


def test_removing_a_parameter_hook_removes_hooks_added_later() -> None:
    linear = nn.Linear(2, 1)
    linear.weight.requires_grad_(False)
    handle = go.grad_hook(linear, times_ten, at="parameters")
    linear.weight.requires_grad_(True)
    linear(torch.ones(1, 2)).sum().backward()  # hooks the unfrozen weight
    handle.remove()
    linear.weight.grad = None
    linear(torch.ones(1, 2)).sum().backward()
    torch.testing.assert_close(linear.weight.grad, torch.ones(1, 2))


# Dynamo reads `.grad` of the non-leaf tensors it resumes with after a graph break (torch's own
# warning, hidden from users, not from `filterwarnings = error`).
@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_parameter_unfrozen_later_under_compile_is_transformed_or_refused() -> None:
    linear = nn.Linear(2, 1)
    linear.weight.requires_grad_(False)
    go.grad_hook(linear, times_ten, at="parameters")
    linear.weight.requires_grad_(True)
    with pytest.raises(Exception, match=r"grad_hook\(at='parameters'\)"):
        torch.compile(linear, fullgraph=True, backend="aot_eager")(torch.ones(1, 2))
    compiled = torch.compile(linear, backend="aot_eager")  # without fullgraph: a graph break
    compiled(torch.ones(1, 2)).sum().backward()
    torch.testing.assert_close(linear.weight.grad, torch.full((1, 2), 10.0))


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_submodule_replaced_under_compile_is_transformed_or_refused() -> None:
    # Replacing a layer after compiling (a new head): its parameters get the transform, or
    # fullgraph=True says why it cannot.
    model = nn.Sequential(nn.Linear(2, 1))
    go.grad_hook(model, times_ten, at="parameters")
    x = torch.ones(1, 2)
    step = torch.compile(lambda t: model(t), backend="aot_eager")
    step(x).sum().backward()
    model[0] = nn.Linear(2, 1)
    with pytest.raises(Exception, match=r"added or replaced in the model"):
        torch.compile(lambda t: model(t), fullgraph=True, backend="aot_eager")(x)
    model[0] = nn.Linear(2, 1)
    step(x).sum().backward()  # without fullgraph: a graph break
    torch.testing.assert_close(model[0].weight.grad, torch.full((1, 2), 10.0))
    torch.testing.assert_close(model[0].bias.grad, torch.full((1,), 10.0))


@pytest.mark.parametrize("at", ["inputs", "outputs", "parameters"])
def test_a_module_with_grad_hooks_saves_loads_and_copies_with_them(at) -> None:
    import copy
    import io

    linear = nn.Linear(2, 1)
    go.grad_hook(linear, times_ten, at=at)
    buffer = io.BytesIO()
    torch.save(linear, buffer)
    buffer.seek(0)
    for again in (torch.load(buffer, weights_only=False), copy.deepcopy(linear)):
        x = torch.ones(1, 2, requires_grad=True)
        again(x).sum().backward()
        if at == "parameters":
            torch.testing.assert_close(again.weight.grad, torch.full((1, 2), 10.0))
        else:
            torch.testing.assert_close(x.grad, again.weight.detach() * 10)
        go.HookHandle.of(again).remove()
        x.grad = None
        again.zero_grad()
        again(x).sum().backward()
        torch.testing.assert_close(x.grad, again.weight.detach())
        torch.testing.assert_close(again.weight.grad, torch.ones(1, 2))


def test_saving_a_module_with_a_lambda_transform_says_why() -> None:
    import io

    linear = nn.Linear(2, 1)
    go.grad_hook(linear, lambda g: g * 2, at="outputs")
    with pytest.raises(go.GradOverrideError, match=r"cannot be pickled.*not a lambda"):
        torch.save(linear, io.BytesIO())


def test_inputs_of_an_inplace_module_reused_after_it_match_plain_autograd() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(3, 3).double()
    relu = nn.ReLU(inplace=True)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def grads(transform_scale: float | None) -> torch.Tensor:
        x.grad = None
        h = linear(x)
        y = relu(h)  # changes h in place
        ((y * 3).sum() + (h * 5).sum()).backward()  # h is relu(h) now: both through relu
        assert x.grad is not None
        return x.grad.clone()

    plain = grads(None)
    handle = go.grad_hook(relu, lambda g: g * 10, at="inputs")
    hooked = grads(10.0)
    handle.remove()
    # The module's output and the input's later uses are one tensor: both get the transform.
    torch.testing.assert_close(hooked, plain * 10)


def test_an_output_that_is_a_view_keeps_its_transform_through_an_inplace_op() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).view(-1, 2, 3)

    head = Head()
    go.grad_hook(head, times_ten, at="outputs")
    x = torch.randn(3, 4, requires_grad=True)
    torch.relu_(head(x)).sum().backward()
    got = x.grad.clone()
    x.grad = None
    (torch.relu(Head.forward(head, x)).sum() * 10).backward()  # plain, the factor by hand
    torch.testing.assert_close(got, x.grad)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace.*` is deprecated:DeprecationWarning")
def test_torch_jit_trace_of_a_hooked_module_refuses() -> None:
    linear = nn.Linear(3, 3)
    go.grad_hook(linear, times_ten, at="outputs")
    with pytest.raises(go.GradOverrideError, match=r"torch\.jit\.trace cannot keep"):
        torch.jit.trace(linear, (torch.randn(4, 3),))


def test_parameters_replaced_in_a_loop_are_always_transformed() -> None:
    # A replaced parameter's id may be reused by the next one: the hook must not mistake it.
    linear = nn.Linear(3, 3)
    go.grad_hook(linear, lambda g: g.clamp(-1, 1), at="parameters")
    for _ in range(60):
        linear.weight = nn.Parameter(torch.randn(3, 3))
        linear(torch.randn(4, 3) * 100).sum().backward()
        assert linear.weight.grad is not None
        assert linear.weight.grad.abs().max() <= 1.0


# ---- the second review ----------------------------------------------------------------------


def test_two_input_hooks_on_an_inplace_module_both_apply() -> None:
    relu = nn.ReLU(inplace=True)
    go.grad_hook(relu, times_ten, at="inputs")
    go.grad_hook(relu, lambda g: g * 2, at="inputs")
    x = torch.tensor([-1.0, 2.0], requires_grad=True)
    relu(x * 1.0).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.0, 20.0]))


def test_an_inplace_module_input_that_is_a_view_keeps_the_transform() -> None:
    relu = nn.ReLU(inplace=True)
    go.grad_hook(relu, times_ten, at="inputs")
    x = torch.tensor([[-1.0, 2.0], [3.0, -4.0]], requires_grad=True)
    weights = torch.tensor([[5.0, 7.0]])
    h = x * 1.0
    relu(h.t())  # changes h through the view
    (h * weights).sum().backward()
    # Independent: h is relu(h) now; every use of it goes through the module (x10).
    torch.testing.assert_close(x.grad, (x.detach() > 0).float() * weights * 10)


def test_one_tensor_passed_twice_to_an_inplace_module_stays_one_tensor() -> None:
    class Twice(nn.Module):
        inplace = True

        def forward(self, a, b):
            a.relu_()
            return a + b  # a and b are one tensor: both are relu(h)

    module = Twice()
    go.grad_hook(module, times_ten, at="inputs")
    x = torch.tensor([-1.0, 2.0], requires_grad=True)
    h = x * 1.0
    module(h, h).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.0, 20.0]))


def test_a_module_returning_its_input_then_an_inplace_op_is_refused_not_silent() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Identity(), nn.ReLU(inplace=True))
    go.grad_hook(model[1], times_ten, at="inputs")
    with pytest.raises(RuntimeError, match="view"):
        model(torch.randn(3, 2, requires_grad=True))


def test_an_undeclared_inplace_module_with_an_input_hook_is_refused() -> None:
    class Doubler(nn.Module):
        def forward(self, x):
            return x.mul_(2)

    module = Doubler()
    go.grad_hook(module, times_ten, at="inputs")
    with pytest.raises(go.GradOverrideError, match=r"`Doubler` \(or a module inside it\) changed"):
        module(torch.randn(3, requires_grad=True) * 1.0)


def test_input_hooks_of_an_inplace_module_from_two_threads() -> None:
    import threading
    import time

    class Slow(nn.Module):
        inplace = True

        def forward(self, x):
            time.sleep(0.02)
            return x.relu_()

    module = Slow()
    go.grad_hook(module, times_ten, at="inputs")
    results: list[torch.Tensor] = []

    def work() -> None:
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        module(x * 1.0).sum().backward()
        assert x.grad is not None
        results.append(x.grad)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    for got in results:
        torch.testing.assert_close(got, torch.full((2,), 10.0))


def test_an_override_and_an_input_hook_on_one_inplace_module() -> None:
    relu = nn.ReLU(inplace=True)
    go.override_backward(relu, lambda grad, *, input: grad * (input > 0) * 3)
    go.grad_hook(relu, lambda g: g * 2, at="inputs")
    x = torch.tensor([-1.0, 2.0, -3.0, 4.0], requires_grad=True)
    relu(x * 1.0).mul(10).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.0, 60.0, 0.0, 60.0]))


class _Dup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x):
        h = self.linear(x)
        return h, h * 2  # the second output is computed from the first


def test_outputs_that_derive_from_one_another_are_transformed_once_each() -> None:
    module = _Dup()
    go.grad_hook(module, times_ten, at="outputs")
    x = torch.randn(3, 2, requires_grad=True)
    a, b = module(x)
    (a.sum() + b.sum()).backward()
    got = x.grad.clone()
    x.grad = None
    a, b = _Dup.forward(module, x)
    ((a.sum() + b.sum()) * 10).backward()
    torch.testing.assert_close(got, x.grad)


def test_a_parameter_returned_as_output_is_transformed_once_per_call_and_removable() -> None:
    class Embedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.ones(3))

        def forward(self):
            return self.table

    module = Embedding()
    handle = go.grad_hook(module, times_ten, at="outputs")
    for _ in range(3):
        module.table.grad = None
        module().sum().backward()
        torch.testing.assert_close(module.table.grad, torch.full((3,), 10.0))
    handle.remove()
    module.table.grad = None
    module().sum().backward()
    torch.testing.assert_close(module.table.grad, torch.ones(3))


def test_hooked_parameters_load_with_weights_only_and_swap() -> None:
    import io

    linear = nn.Linear(2, 2)
    go.grad_hook(linear, times_ten, at="parameters")
    buffer = io.BytesIO()
    torch.save(linear.state_dict(keep_vars=True), buffer)
    buffer.seek(0)
    torch.load(buffer)  # weights_only=True, the default
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        linear.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    linear(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(linear.weight.grad, torch.full((2, 2), 10.0, dtype=torch.float64))


@pytest.mark.parametrize(
    "module",
    [nn.Dropout(0.0, inplace=True), nn.Dropout(0.5, inplace=True).eval()],
    ids=["p=0", "eval"],
)
def test_an_inplace_module_that_leaves_its_input_unchanged_keeps_the_transform(module) -> None:
    go.grad_hook(module, times_ten, at="inputs")
    x = torch.tensor([-1.0, 2.0, 3.0], requires_grad=True)
    (module(x * 1.0) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([10.0, 20.0, 30.0]))


def test_an_inplace_module_returning_none_changes_the_callers_tensor_with_the_transform() -> None:
    class Doubling(nn.Module):
        inplace = True

        def forward(self, x):
            x.mul_(2)

    module = Doubling()
    go.grad_hook(module, times_ten, at="inputs")
    x = torch.tensor([-1.0, 2.0, 3.0], requires_grad=True)
    h = x * 1.0
    module(h)
    torch.testing.assert_close(h.detach(), torch.tensor([-2.0, 4.0, 6.0]))  # as without hook
    h.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 20.0))


def test_a_block_holding_an_inplace_module_keeps_the_input_transform() -> None:
    block = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(3, 1))
    go.grad_hook(block, times_ten, at="inputs")
    x = torch.tensor([-1.0, 2.0, 3.0], requires_grad=True)
    block(x * 1.0).sum().backward()
    expected = (x.detach() > 0).float() * block[1].weight.detach()[0] * 10
    torch.testing.assert_close(x.grad, expected)


def test_a_view_returning_module_then_an_inplace_op_is_refused_not_silent() -> None:
    flatten = nn.Flatten(0)
    go.grad_hook(flatten, times_ten, at="inputs")
    with pytest.raises(RuntimeError, match="view"):
        nn.ReLU(inplace=True)(flatten(torch.randn(3, 2, requires_grad=True) * 1.0))


def test_inputs_sharing_memory_to_an_inplace_module_are_refused() -> None:
    class Two(nn.Module):
        inplace = True

        def forward(self, x, y):
            x.mul_(2)
            return x + y

    module = Two()
    go.grad_hook(module, times_ten, at="inputs")
    h = torch.tensor([1.0, 2.0], requires_grad=True) * 1.0
    with pytest.raises(go.GradOverrideError, match="share memory"):
        module(h, h[0])


def test_deepcopy_of_a_module_with_lambda_hooks_works() -> None:
    import copy

    linear = nn.Linear(2, 2)
    go.grad_hook(linear, lambda g: g * 10, at="inputs")
    copied = copy.deepcopy(linear)
    x = torch.ones(1, 2, requires_grad=True)
    copied(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(1, 2) @ copied.weight.detach() * 10)


# ==== parameters: the total gradient in every mode; parts of a model never called ===========


def clip(g):
    return g.clamp(-1.0, 1.0)  # nonlinear: per-use and total transforms differ


class Step(nn.Module):
    """One step of an RNN-like cell."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5, -2.0, 3.0]))

    def forward(self, h):
        return torch.tanh(h * self.w) + h


class Cell(nn.Module):
    """The step called three times, its weight used once more (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = Step()

    def forward(self, x):
        h = x
        for _ in range(3):
            h = self.step(h)
        return (h * self.step.w).sum()


def reference(w, x):
    """The same math on a plain tensor, its total gradient clipped once."""
    w = w.detach().clone().requires_grad_()
    h = x
    for _ in range(3):
        h = torch.tanh(h * w) + h
    (h * w).sum().backward()
    return clip(w.grad)


X = torch.tensor([1.0, 0.7, -0.4])


def test_parameters_see_their_total_gradient_eagerly() -> None:
    cell = Cell()
    go.grad_hook(cell.step, clip, at="parameters")
    cell(X).backward()
    torch.testing.assert_close(cell.step.w.grad, reference(cell.step.w, X))


def test_functional_call_gives_the_total_gradient_too() -> None:
    cell = Cell()
    go.grad_hook(cell.step, clip, at="parameters")
    w = torch.tensor([0.3, 1.5, -1.0], requires_grad=True)
    functional_call(cell, {"step.w": w}, (X,)).backward()
    torch.testing.assert_close(w.grad, reference(w, X))


def test_torch_func_grad_gives_the_total_gradient_too() -> None:
    cell = Cell()
    go.grad_hook(cell.step, clip, at="parameters")
    w = torch.tensor([0.3, 1.5, -1.0])
    got = grad(lambda p: functional_call(cell, {"step.w": p}, (X,)))(w)
    torch.testing.assert_close(got, reference(w, X))


def test_a_vmapped_ensemble_gives_each_member_its_total_gradient() -> None:
    cell = Cell()
    go.grad_hook(cell.step, clip, at="parameters")
    ws = torch.tensor([[0.3, 1.5, -1.0], [2.0, -0.5, 0.1]])
    got = vmap(grad(lambda p: functional_call(cell, {"step.w": p}, (X,))))(ws)
    torch.testing.assert_close(got, torch.stack([reference(w, X) for w in ws]))


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_compiled_functional_call_gives_the_total_gradient_too() -> None:
    torch._dynamo.reset()
    cell = Cell()
    go.grad_hook(cell.step, clip, at="parameters")
    w = torch.tensor([0.3, 1.5, -1.0], requires_grad=True)
    step = torch.compile(lambda p: functional_call(cell, {"step.w": p}, (X,)), fullgraph=True,
                         backend="aot_eager")
    step(w).backward()
    torch.testing.assert_close(w.grad, reference(w, X))


def test_a_container_never_called_covers_parameters_unfrozen_or_replaced_later() -> None:
    layers = nn.ModuleDict({"a": nn.Linear(2, 1), "b": nn.Linear(2, 1)})
    layers["a"].weight.requires_grad_(False)
    go.grad_hook(layers, times_ten, at="parameters")
    layers["a"].weight.requires_grad_(True)
    layers["b"].weight = nn.Parameter(torch.ones(1, 2))
    (layers["a"](torch.ones(1, 2)) + layers["b"](torch.ones(1, 2))).sum().backward()
    torch.testing.assert_close(layers["a"].weight.grad, torch.full((1, 2), 10.0))
    torch.testing.assert_close(layers["b"].weight.grad, torch.full((1, 2), 10.0))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))
        self.proj = nn.Linear(2, 2)

    def encode(self, x):
        return self.proj(x) * self.scale


def test_a_model_used_through_another_method_covers_later_parameters() -> None:
    model = Encoder()
    model.scale.requires_grad_(False)
    go.grad_hook(model, times_ten, at="parameters")
    model.scale.requires_grad_(True)
    model.proj.bias = nn.Parameter(torch.zeros(2))
    model.encode(torch.ones(1, 2)).sum().backward()
    plain = Encoder()
    plain.load_state_dict(model.state_dict())
    plain.encode(torch.ones(1, 2)).sum().backward()
    torch.testing.assert_close(model.scale.grad, plain.scale.grad * 10)
    torch.testing.assert_close(model.proj.bias.grad, plain.proj.bias.grad * 10)
