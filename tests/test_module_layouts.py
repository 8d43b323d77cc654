"""What a module rule keeps between calls, and when it is made again.

`go.Module` and `override_backward` keep, per module, what walking its parameters and
buffers gave (`gradoverride/_layout.py`) and, for a module without submodules, a generated
entry that checks the module's structure on every call (`gradoverride/_module_fastpath.py`).
Each test here warms a module up (its first call is checked and takes the op's own path;
the later ones take the kept layout), changes what the layout describes, and compares the
next call's gradients with plain autograd of the same math: a layout kept past that change
would give the old parameters, names or buffers.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

import gradoverride as go
from gradoverride._decorators import arm_all

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
