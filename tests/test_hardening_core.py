"""Silent wrong or lost gradients at the edges of `custom_backward`, each fixed or refused.

Every expected gradient here comes from an independent computation: plain autograd of the
same math, or a value written out by hand.
"""

from __future__ import annotations

import gc
import linecache
import re

import pytest
import torch
from torch import nn

import gradoverride as go
from gradoverride.recipes import reverse_grad, scale_grad
from gradoverride.testing import check_backward

# Dynamo instantiates `torch.autograd.Function()` for the ctx of a Function it traces, and
# torch warns about that itself (its own DeprecationWarning, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")

# ---- a tensor the forward reads without being given it ---------------------------------------

CAPTURED = torch.randn(3, requires_grad=True)


@go.custom_backward
def times_captured(x):
    return x * CAPTURED


@times_captured.backward
def _(grad, *, x):
    return grad * 2


def test_a_global_read_by_the_forward_is_named_at_the_first_call() -> None:
    with pytest.raises(go.GradOverrideError, match=r"reads `CAPTURED` \(a global\).*lost"):
        times_captured(torch.randn(3, requires_grad=True))


def test_a_closure_variable_is_named_and_the_fixes_are_given() -> None:
    weight = torch.randn(3, requires_grad=True)

    @go.custom_backward
    def scaled(x):
        return x * weight

    @scaled.backward
    def _(grad):
        return grad

    with pytest.raises(go.GradOverrideError) as info:
        scaled(torch.randn(3))
    text = str(info.value)
    assert "`weight` (a variable of an enclosing function)" in text
    for fix in ("Pass it as an argument", "go.Module", "owns=", ".detach()"):
        assert fix in text


def test_self_weight_in_a_decorated_method_is_named() -> None:
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        @go.custom_backward
        def apply(self, x):
            return x * self.weight

        @apply.backward
        def _(grad, *, self):
            return None, grad * self.weight

    with pytest.raises(go.GradOverrideError, match=r"reads `self\.weight`"):
        Layer().apply(torch.randn(3))


def test_a_captured_tensor_that_needs_no_gradient_is_fine() -> None:
    frozen = torch.randn(3)  # requires_grad=False: nothing is lost

    @go.custom_backward
    def shifted(x):
        return x + frozen

    @shifted.backward
    def _(grad):
        return grad

    x = torch.randn(3, requires_grad=True)
    shifted(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3))


def test_with_owns_a_captured_tensor_keeps_its_autograd_gradient() -> None:
    weight = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)

    @go.custom_backward(owns="x")
    def scaled(x, bias):
        return x * weight + bias

    @scaled.backward
    def _(grad):
        return grad * 10

    x = torch.tensor([4.0, 5.0, 6.0], requires_grad=True)
    scaled(x, torch.zeros(3)).sum().backward()
    torch.testing.assert_close(weight.grad, x.detach())  # d(sum(x * w))/dw = x
    torch.testing.assert_close(x.grad, torch.full((3,), 10.0))


def test_check_backward_checks_every_time_not_only_the_first_call() -> None:
    weight = torch.randn(3, requires_grad=True)

    @go.custom_backward
    def scaled(x):
        return x * weight.detach() if scaled.calls == 0 else x * weight

    scaled.calls = 0

    @scaled.backward
    def _(grad):
        return grad

    scaled(torch.randn(3, requires_grad=True))  # the first call is clean, and checked
    scaled.calls = 1
    scaled(torch.randn(3, requires_grad=True))  # not checked any more: the op is fast now
    with pytest.raises(go.GradOverrideError, match=r"reads `weight`"):
        check_backward(scaled, torch.randn(3))


def test_a_forward_changing_its_input_in_place_is_refused() -> None:
    @go.custom_backward
    def doubled(x):
        return x.mul_(2)

    @doubled.backward
    def _(grad):
        return grad * 2

    with pytest.raises(go.GradOverrideError, match=r"changed its input `x` in place"):
        doubled(torch.randn(3, requires_grad=True) * 1)


def test_a_forward_updating_a_statistic_it_is_given_is_fine() -> None:
    @go.custom_backward
    def tracked(x, running):
        running.mul_(0.5).add_(x.detach().mean())
        return x * 2

    @tracked.backward
    def _(grad):
        return grad * 2, None

    running = torch.zeros(())
    x = torch.ones(3, requires_grad=True)
    tracked(x, running).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(running, torch.tensor(1.0))


# ---- residuals ---------------------------------------------------------------------------------


@go.custom_backward(residuals="cosh")
def sinh(x):
    e = torch.exp(x)
    return (e - 1 / e) / 2, {"cosh": (e + 1 / e) / 2}


@sinh.backward
def _(grad, *, cosh):
    return grad * cosh


def test_a_residual_gives_the_first_derivative() -> None:
    x = torch.tensor([0.5, -1.0], requires_grad=True)
    (gx,) = torch.autograd.grad(sinh(x).sum(), x)
    torch.testing.assert_close(gx, torch.cosh(x.detach()))


def test_a_second_differentiation_through_a_residual_is_refused() -> None:
    # PyTorch's "SinhBad": the residual cosh(x) is a constant to autograd, so the second
    # derivative would be 0 where sinh(x) is right.
    x = torch.tensor([0.5, -1.0], requires_grad=True)
    (gx,) = torch.autograd.grad(sinh(x).sum(), x, create_graph=True)
    with pytest.raises(go.GradOverrideError, match=r"reached its residual `cosh`"):
        torch.autograd.grad(gx.sum(), x)


def test_a_second_differentiation_through_a_residual_is_refused_under_torch_func() -> None:
    def first(x):
        return torch.func.grad(lambda y: sinh(y).sum())(x).sum()

    with pytest.raises(go.GradOverrideError, match=r"reached its residual `cosh`"):
        torch.func.grad(first)(torch.tensor([0.5, -1.0]))


def test_differentiating_a_residual_rule_again_in_the_upstream_direction_works() -> None:
    # d(grad_x)/d(upstream) does not go through the residual: it is exact.
    x = torch.tensor([0.5, -1.0], requires_grad=True)
    v = torch.ones(2, requires_grad=True)
    (gx,) = torch.autograd.grad(sinh(x), x, grad_outputs=v, create_graph=True)
    (gv,) = torch.autograd.grad(gx.sum(), v)
    torch.testing.assert_close(gv, torch.cosh(x.detach()))


@go.custom_backward(residuals="doubled")
def doubled_with_itself(x):
    y = x * 2
    return y, {"doubled": y}


@doubled_with_itself.backward
def _(grad, *, doubled):
    return grad * doubled


def _residual_output_grad(fn) -> torch.Tensor:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    out = fn(x)
    assert out.requires_grad, "the output must stay differentiable"
    (gx,) = torch.autograd.grad(out.sum(), x)
    return gx


def test_a_residual_that_is_the_output_keeps_the_output_differentiable() -> None:
    torch.testing.assert_close(_residual_output_grad(doubled_with_itself), torch.tensor([2.0, 4.0]))


def test_a_residual_that_is_the_output_under_torch_func_and_compile() -> None:
    x = torch.tensor([1.0, 2.0])
    expected = torch.tensor([2.0, 4.0])
    got = torch.func.grad(lambda t: doubled_with_itself(t).sum())(x)
    torch.testing.assert_close(got, expected)
    compiled = torch.compile(doubled_with_itself, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(_residual_output_grad(compiled), expected)


@go.custom_backward(residuals="source")
def kept_input(x):
    return x * 3, {"source": x}


@kept_input.backward
def _(grad, *, source):
    return grad * source


def test_a_residual_that_is_an_input_is_saved_as_the_input() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    kept_input(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 2.0]))


# ---- identity forwards and in-place ops right after -------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "factor"),
    [(reverse_grad(), -1.0), (scale_grad(scale=0.5), 0.5)],
    ids=["reverse_grad", "scale_grad"],
)
def test_an_inplace_relu_right_after_a_gradient_recipe(recipe, factor) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(3, 3)
    model = nn.Sequential(linear, recipe.module(), nn.ReLU(inplace=True))
    x = torch.randn(4, 3, requires_grad=True)
    model(x).sum().backward()

    # Independent: the same math in plain autograd, the factor applied by hand.
    x2 = x.detach().clone().requires_grad_()
    h = nn.functional.linear(x2, linear.weight.detach(), linear.bias.detach())
    (gh,) = torch.autograd.grad(torch.relu(h).sum(), h)
    torch.testing.assert_close(x.grad, (gh * factor) @ linear.weight.detach())


def test_override_owns_input_then_inplace_relu_gives_the_rule_gradient() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(3, 3)

    def rule(grad, *, module):
        return grad @ module.weight * 10

    go.override_backward(linear, rule, owns="input")
    model = nn.Sequential(linear, nn.ReLU(inplace=True))
    x = torch.randn(4, 3, requires_grad=True)
    out = model(x)
    out.sum().backward()
    mask = (out > 0).to(x.dtype).detach()
    torch.testing.assert_close(x.grad, (mask @ linear.weight.detach()) * 10)
    # The parameters keep their ordinary gradient: d(sum(relu(xW^T + b)))/dW = mask^T x.
    torch.testing.assert_close(linear.weight.grad, mask.T @ x.detach())


def test_inplace_after_a_parameter_passthrough_stays_an_error() -> None:
    # A leaf that requires grad (a parameter) passes through as a view: changing its memory
    # in place stays the error PyTorch gives for any view of a leaf.
    p = nn.Parameter(torch.randn(3))
    with pytest.raises(RuntimeError, match="view"):
        reverse_grad()(p).relu_()


# ---- a forward returning an input unchanged --------------------------------------------------


@go.custom_backward
def maybe_scaled(x, scale=1.0):
    return x if scale == 1.0 else x * scale


@maybe_scaled.backward
def _(grad, *, x, scale):
    return grad * 3 + 0 * x


@go.custom_backward
def pass_pair(x):
    return x, x * 2


@pass_pair.backward
def _(g1, g2, *, x, output):
    return g1 * 3 + g2 * 5 + 0 * x + 0 * output[0]


def _both(pair):
    return pair[0] + pair[1]


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda x: maybe_scaled(x, 1.0), 3.0),
        (lambda x: maybe_scaled(x), 3.0),
        (lambda x: maybe_scaled(x=x), 3.0),
        (lambda x: _both(pass_pair(x)), 3.0 + 5.0),
    ],
    ids=["positional", "default-left-out", "keyword", "tuple"],
)
def test_a_forward_returning_its_input_works_on_every_call_path(call, expected) -> None:
    x = torch.tensor([1.0, 2.0])
    expected = torch.full((2,), expected)
    eager_x = x.clone().requires_grad_()
    call(eager_x).sum().backward()
    torch.testing.assert_close(eager_x.grad, expected)
    torch.testing.assert_close(torch.func.grad(lambda t: call(t).sum())(x), expected)
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    compiled_x = x.clone().requires_grad_()
    compiled(compiled_x).sum().backward()
    torch.testing.assert_close(compiled_x.grad, expected)


def test_an_input_returned_as_is_changed_in_place_is_refused_like_a_view() -> None:
    x = torch.tensor([-1.0, 2.0], requires_grad=True)
    y = maybe_scaled(x * 1.0)
    with pytest.raises(RuntimeError, match="view"):
        y.relu_()


# ---- compiled autograd ---------------------------------------------------------------------


@go.custom_backward(owns="x")
def owns_x(x, w):
    return x * w


@owns_x.backward
def _(grad, *, w):
    return grad * w * 10


@pytest.mark.compile
def test_owns_under_compiled_autograd_with_an_eager_forward() -> None:
    import torch._dynamo.compiled_autograd as compiled_autograd

    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    w = torch.tensor([4.0, 5.0, 6.0], requires_grad=True)
    loss = owns_x(x, w).sum() + w.sum()  # w also gets a gradient from another node
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        loss.backward()
    torch.testing.assert_close(x.grad, w.detach() * 10)
    torch.testing.assert_close(w.grad, x.detach() + 1)


# ---- what a forward returns and which inputs a rule owns ---------------------------------


@pytest.mark.parametrize(
    ("result", "shown"),
    [(1.5, "float 1.5"), (None, "NoneType None"), ("text", "str 'text'")],
)
def test_a_forward_returning_no_tensor_is_refused(result, shown) -> None:
    @go.custom_backward
    def nothing(x):
        return result

    @nothing.backward
    def _(grad):
        return grad

    message = re.escape(f"returned {shown}, which holds no tensor")
    with pytest.raises(go.GradOverrideError, match=message):
        nothing(torch.randn(2, requires_grad=True))


def test_a_forward_returning_a_generator_is_refused() -> None:
    @go.custom_backward
    def lazy(x):
        return (t for t in (x,))

    @lazy.backward
    def _(grad):
        return grad

    with pytest.raises(go.GradOverrideError, match="returned generator"):
        lazy(torch.randn(2, requires_grad=True))


@go.custom_backward
def gather(x, index):
    return x[index]


@gather.backward
def _(grad, *, x, index):
    return torch.zeros_like(x).index_add(0, index, grad)  # a lone tensor: for `x`


def test_an_integer_index_input_is_not_owned_so_a_lone_tensor_is_for_x() -> None:
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    index = torch.tensor([0, 2, 2])
    gather(x, index).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 0.0, 2.0]))


def test_a_gradient_for_an_integer_input_is_refused_by_name() -> None:
    @go.custom_backward
    def pick(x, index):
        return x[index]

    @pick.backward
    def _(grad, *, x, index):
        return {"x": None, "index": torch.ones(3)}

    y = pick(torch.randn(3, requires_grad=True), torch.tensor([0, 1, 2]))
    with pytest.raises(go.GradOverrideError, match=r"for `index`, which takes no gradient"):
        y.sum().backward()


# ---- generated source is freed with its op ------------------------------------------------------


def test_generated_source_leaves_linecache_with_its_op() -> None:
    def generated() -> set[str]:
        return {k for k in linecache.cache if k.startswith("<gradoverride generated")}

    gc.collect()
    before = generated()
    for _ in range(20):
        linear = nn.Linear(2, 2)
        handle = go.override_backward(
            linear,
            lambda grad, *, input, module: {
                "input": grad @ module.weight, "weight": None, "bias": None,
            },
        )
        linear(torch.randn(1, 2, requires_grad=True)).sum().backward()
        handle.remove()
        del linear, handle
    gc.collect()
    # Each override builds a generated fast path (one source each) while it lives.
    assert len(generated() - before) == 0


def test_an_inplace_op_on_a_function_form_recipe_is_refused_not_silent() -> None:
    # The output shares the caller's memory: changing it in place would change `features`
    # behind autograd's back, so it is a view, and PyTorch refuses.
    x = torch.tensor([-1.0, 0.5, 2.0, -3.0], requires_grad=True)
    features = x * 2
    with pytest.raises(RuntimeError, match="view"):
        scale_grad(scale=1.0)(features).relu_()


def test_the_module_form_copies_so_a_shared_input_keeps_its_value_and_gradient() -> None:
    x = torch.tensor([-1.0, 0.5, 2.0, -3.0], requires_grad=True)
    features = x * 2
    head = scale_grad(scale=1.0).module()(features)
    head.relu_()
    ((head * 3).sum() + (features * 5).sum()).backward()
    torch.testing.assert_close(features.detach(), torch.tensor([-2.0, 1.0, 4.0, -6.0]))
    # Independent: the head sees relu(2x) (times 3), the features 2x (times 5).
    torch.testing.assert_close(x.grad, 3 * 2 * (x.detach() > 0).float() + 5 * 2)


@go.custom_backward
def with_its_first(x):
    y = x * 2
    return y, y[0]


@with_its_first.backward
def _(ga, gb, *, x):
    g = ga * 2
    g[0] = g[0] + gb * 2
    return g


def test_outputs_sharing_memory_stay_views_so_an_inplace_change_is_refused() -> None:
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    _, first = with_its_first(x)
    with pytest.raises(RuntimeError, match="view"):
        first.mul_(10)


WEIGHT = torch.randn(3, requires_grad=True)


@pytest.mark.parametrize(
    "read",
    [
        lambda x: x + torch.zeros_like(WEIGHT),
        lambda x: x * WEIGHT.sign(),
        lambda x: x * WEIGHT.max().item(),
        lambda x: x * float(WEIGHT[0]),
        lambda x: x * bool(WEIGHT.norm() > 0),
        lambda x: x + WEIGHT.new_ones(3),
        lambda x: x + WEIGHT.detach(),
    ],
    ids=["zeros_like", "sign", "item", "float", "bool", "new_ones", "detach"],
)
def test_reads_of_a_captured_tensor_that_carry_no_gradient_are_allowed(read) -> None:
    @go.custom_backward
    def f(x):
        return read(x)

    @f.backward
    def _(grad):
        return grad

    x = torch.randn(3, requires_grad=True)
    f(x).sum().backward()  # plain autograd gives WEIGHT no gradient here either
    torch.testing.assert_close(x.grad, torch.ones(3))


def test_a_captured_tensor_reaching_the_result_through_a_chain_is_refused() -> None:
    @go.custom_backward
    def f(x):
        scale = WEIGHT.abs().mean()  # a gradient flows through abs and mean
        return (x * scale).view(-1)

    @f.backward
    def _(grad):
        return grad

    with pytest.raises(go.GradOverrideError, match="which requires grad"):
        f(torch.randn(3, requires_grad=True))


def test_a_parameter_constraint_applied_before_use_is_allowed() -> None:
    class Constrained(go.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([-1.0, 2.0, 3.0]))

        def forward(self, x):
            with torch.no_grad():
                self.w.clamp_(min=0)
            return x * self.w

        def backward(self, grad, *, x):
            return {"x": grad * self.w, "w": grad * x}

    layer = Constrained()
    x = torch.tensor([1.0, 1.0, 1.0], requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.0, 2.0, 3.0]))


def test_a_parameter_changed_after_the_forward_read_it_is_refused() -> None:
    class Drifting(go.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

        def forward(self, x):
            out = x * self.w
            with torch.no_grad():
                self.w.mul_(0.5)  # the rule would read the halved weight
            return out

        def backward(self, grad, *, x):
            return {"x": grad * self.w, "w": grad * x}

    with pytest.raises(go.GradOverrideError, match=r"changed .*`w` in place"):
        Drifting()(torch.ones(3, requires_grad=True))


SQUARE = torch.randn(2, 2, requires_grad=True)


def _set_row(x):
    y = torch.zeros(2, 2)
    y[0] = SQUARE[0]
    return x * y


@pytest.mark.parametrize(
    "read",
    [
        lambda x: x @ SQUARE.T,
        lambda x: x @ SQUARE.mT,
        _set_row,
        lambda x: (x * 2, SQUARE)[1] + 0 * x,
    ],
    ids=[".T", ".mT", "setitem", "returned as-is"],
)
def test_captured_tensors_reached_through_properties_and_writes_are_refused(read) -> None:
    @go.custom_backward
    def f(x):
        return read(x)

    @f.backward
    def _(grad, *, x):
        return torch.zeros_like(x)

    with pytest.raises(go.GradOverrideError, match="which requires grad"):
        f(torch.randn(2, 2, requires_grad=True))


@pytest.mark.parametrize(
    "read",
    [
        lambda x: x.view_as(SQUARE),
        lambda x: x.type_as(SQUARE),
        lambda x: x.to(SQUARE),
        lambda x: x.expand_as(SQUARE) * 1,
        lambda x: x * SQUARE[0].detach(),
        lambda x: x @ SQUARE.t().detach(),
        lambda x: x * SQUARE.data,
    ],
    ids=["view_as", "type_as", "to", "expand_as", "index.detach", "t.detach", ".data"],
)
def test_metadata_and_detached_reads_of_a_captured_tensor_are_allowed(read) -> None:
    @go.custom_backward
    def f(x):
        return read(x)

    @f.backward
    def _(grad, *, x):
        return grad if grad.shape == x.shape else torch.zeros_like(x)

    x = torch.randn(2, 2, requires_grad=True)
    f(x).sum().backward()  # plain autograd gives SQUARE no gradient here either
    assert x.grad is not None


@pytest.mark.parametrize(
    "change",
    [
        lambda w: w.__setitem__(1, 0.0),
        lambda w: w[:].clamp_(min=0),
        lambda w: torch.clamp(w, min=0, out=w),
    ],
    ids=["setitem", "view clamp_", "out="],
)
def test_any_write_to_a_parameter_after_the_forward_read_it_is_refused(change) -> None:
    class Layer(go.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([3.0, -4.0]))

        def forward(self, x):
            y = x @ self.w.T if x.dim() > 1 else x * self.w
            with torch.no_grad():
                change(self.w)
            return y

        def backward(self, grad, *, x):
            return {"x": grad * self.w, "w": grad * x}

    with pytest.raises(go.GradOverrideError, match=r"`w` in place after reading it"):
        Layer()(torch.ones(2, requires_grad=True))
