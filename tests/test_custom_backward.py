"""Behaviour of `go.custom_backward`: decoration forms, the rule contract, return forms,
partial override, residuals, higher order, the module form, binding, pickling and errors
raised by rules.

Every expected gradient is computed by hand or by torch's own autograd on an equivalent
smooth function, never by the code under test.
"""

from __future__ import annotations

import copy
import gc
import inspect
import linecache
import pickle
import re

import pytest
import torch
from torch import nn

import gradoverride as go
from gradoverride import recipes
from gradoverride.recipes import reverse_grad, scale_grad
from gradoverride.testing import assert_consistent, check_backward, saved_bytes

# ---- module-level ops (pickling needs them importable by name) ---------------------------


@go.custom_backward
def scaled(x, factor=2.0):
    """Multiply `x` by `factor`; the rule passes `factor * grad`."""
    return x * factor


@scaled.backward
def _scaled_rule(grad, *, factor):
    return grad * factor


@go.custom_backward
def quantize(x, bits=8):
    """Round `x` to `bits` fractional bits."""
    s = 2**bits
    return torch.round(x * s) / s


@quantize.backward
def _quantize_rule(grad, *, x):
    return grad * (x.abs() <= 1)


def _leaf(*shape, device="cpu", dtype=torch.float32, requires_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=dtype).to(device)
    return t.requires_grad_(requires_grad)


# ---- decoration forms and the object they return ----------------------------------------


def test_bare_decorator_uses_the_rule(device):
    @go.custom_backward
    def clip_ste(x, bits=8):
        s = 2**bits
        return torch.round(x * s) / s

    @clip_ste.backward
    def _(grad, *, x):
        return grad * (x.abs() <= 1)

    x = torch.tensor([-2.0, -0.5, 0.25, 0.9, 1.5], device=device, requires_grad=True)
    y = clip_ste(x)
    torch.testing.assert_close(y, torch.round(x.detach() * 256) / 256)
    y.backward(torch.arange(1.0, 6.0, device=device))
    torch.testing.assert_close(x.grad, torch.tensor([0.0, 2.0, 3.0, 4.0, 0.0], device=device))


def test_backward_decorator_returns_the_rule_unchanged():
    op = go.custom_backward(lambda x: x * 2)

    def rule(grad, *, x):
        return grad * 3

    assert op.rule is None
    assert op.backward(rule) is rule
    assert op.rule is rule
    # The rule can still be called on its own.
    torch.testing.assert_close(rule(torch.ones(2), x=torch.ones(2)), torch.full((2,), 3.0))


def test_decorator_with_options_owns_x():
    @go.custom_backward(owns="x")
    def mul(x, w):
        return x * w

    @mul.backward
    def _(grad):
        return grad * 100

    x = _leaf(4, seed=1)
    w = _leaf(4, seed=2)
    mul(x, w).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 100.0))
    torch.testing.assert_close(w.grad, x.detach())


def test_call_form_with_backward():
    def cube(x):
        return x**3

    def rule(grad, *, x):
        return grad * 7

    op = go.custom_backward(cube, backward=rule)
    assert op.rule is rule
    x = _leaf(5)
    y = op(x)
    torch.testing.assert_close(y, x.detach() ** 3)
    y.backward(torch.ones(5))
    torch.testing.assert_close(x.grad, torch.full((5,), 7.0))


def test_call_form_options_without_function():
    def rule(grad, *, x):
        return grad * -1

    decorate = go.custom_backward(backward=rule)

    def neg_identity(x):
        return x.clone()

    op = decorate(neg_identity)
    x = _leaf(3)
    op(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), -1.0))


def test_wrapper_keeps_name_doc_wrapped_signature():
    def forward(x, bits=8, *, scale: float = 1.0):
        """Forward docstring."""
        return x * scale

    op = go.custom_backward(forward)
    assert op.__name__ == "forward"
    assert op.__doc__ == "Forward docstring."
    assert op.__wrapped__ is forward
    assert inspect.signature(op) == inspect.signature(forward)
    assert list(inspect.signature(op).parameters) == ["x", "bits", "scale"]
    assert op.__module__ == forward.__module__
    assert op.parameters == ("x", "bits", "scale")


def test_repr_names_the_function_and_rule():
    assert "quantize" in repr(quantize)
    assert "_quantize_rule" in repr(quantize)

    def fresh(x):
        return x

    op = go.custom_backward(fresh)
    text = repr(op)
    assert "fresh" in text
    assert "no rule" in text


def test_function_is_a_named_autograd_function_built_once():
    fn = quantize.function
    assert isinstance(fn, type)
    assert issubclass(fn, torch.autograd.Function)
    assert fn.__name__ == "CustomBackward_quantize"
    assert quantize.function is fn

    x = _leaf(3)
    quantize(x)  # the first call is checked, through the general steps
    y1 = quantize(x)
    y2 = quantize(x, bits=4)
    assert "CustomBackward_quantize" in type(y1.grad_fn).__name__
    assert type(y1.grad_fn) is type(y2.grad_fn)
    assert quantize.function is fn


def test_function_before_rule_raises():
    op = go.custom_backward(lambda x: x)
    with pytest.raises(go.GradOverrideError):
        op.function  # noqa: B018


# ---- builtins ------------------------------------------------------------------------------


def test_builtin_torch_sign_named_from_docstring(device):
    def rule(grad, *, input):
        return grad * torch.cos(input)

    op = go.custom_backward(torch.sign, backward=rule)
    assert op.parameters[0] == "input"
    x = torch.tensor([-1.5, -0.2, 0.0, 0.7, 2.0], device=device, requires_grad=True)
    y = op(x)
    torch.testing.assert_close(y, torch.sign(x.detach()))
    up = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], device=device)
    y.backward(up)
    torch.testing.assert_close(x.grad, up * torch.cos(x.detach()))


# ---- the rule's names ---------------------------------------------------------------------


def test_positional_grads_one_per_output():
    @go.custom_backward
    def two(x):
        return x * 2, x**2

    seen = {}

    @two.backward
    def _(g1, g2, *, x):
        seen["shapes"] = (g1.shape, g2.shape)
        return g1 * 2 + g2 * 2 * x

    x = _leaf(4)
    a, b = two(x)
    u1, u2 = _leaf(4, seed=5, requires_grad=False), _leaf(4, seed=6, requires_grad=False)
    ((a * u1).sum() + (b * u2).sum()).backward()
    xr = x.detach().clone().requires_grad_(True)
    ((xr * 2 * u1).sum() + (xr**2 * u2).sum()).backward()
    torch.testing.assert_close(x.grad, xr.grad)
    assert seen["shapes"] == (torch.Size([4]), torch.Size([4]))


def test_star_grads_takes_all_outputs():
    @go.custom_backward
    def three(x):
        return x, x * 2, x * 3

    @three.backward
    def _(*grads):
        return grads[0] + 2 * grads[1] + 3 * grads[2]

    x = _leaf(3)
    a, b, c = three(x)
    (a + b + c).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 6.0))


def test_rule_receives_forward_params_and_output():
    @go.custom_backward
    def affine(x, a, *, b=1.0):
        return x * a + b

    seen = {}

    @affine.backward
    def _(grad, *, a, b, output):
        seen.update(a=a, b=b, output=output.detach().clone())
        return (grad * a, None, None)

    x = _leaf(3)
    y = affine(x, 3.0, b=0.5)
    y.sum().backward()
    assert seen["a"] == 3.0
    assert seen["b"] == 0.5
    torch.testing.assert_close(seen["output"], x.detach() * 3.0 + 0.5)
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))


def test_needs_grad_reports_which_inputs_need_a_gradient():
    @go.custom_backward
    def mul(x, w, bits=8):
        return x * w

    seen = []

    @mul.backward
    def _(grad, *, w, needs_grad):
        seen.append(dict(needs_grad))
        return {"x": grad * w if needs_grad["x"] else None, "w": None, "bits": None}

    x = _leaf(3)
    w = _leaf(3, seed=1, requires_grad=False)
    mul(x, w).sum().backward()
    assert seen[-1] == {"x": True, "w": False, "bits": False}
    torch.testing.assert_close(x.grad, w)


def test_needs_grad_false_for_a_non_owned_parameter():
    @go.custom_backward(owns="x")
    def mul(x, w):
        return x * w

    seen = []

    @mul.backward
    def _(grad, *, w, needs_grad):
        seen.append(dict(needs_grad))
        return grad * w.detach() * 10

    x = _leaf(3)
    w = _leaf(3, seed=1)
    mul(x, w).sum().backward()
    assert seen[-1] == {"x": True, "w": False}
    torch.testing.assert_close(x.grad, w.detach() * 10)
    torch.testing.assert_close(w.grad, x.detach())


def test_rule_naming_nothing_saves_nothing():
    @go.custom_backward
    def double(x):
        return x * 2

    @double.backward
    def _(grad):
        return grad * 2

    x = _leaf(64, 32)
    assert saved_bytes(double, x) == 0
    y = double(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((64, 32), 2.0))


def test_rule_naming_x_saves_exactly_x():
    @go.custom_backward
    def square(x, w):
        return x * x + w

    @square.backward
    def _(grad, *, x):
        return (grad * 2 * x, grad)

    x = _leaf(64, 32)
    w = _leaf(64, 32, seed=1)
    assert saved_bytes(square, x, w) == x.numel() * x.element_size()
    y = square(x, w)
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())
    torch.testing.assert_close(w.grad, torch.ones(64, 32))


# ---- return forms -------------------------------------------------------------------------


def test_return_single_tensor():
    x = _leaf(4)
    scaled(x, 3.0).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 3.0))


def test_return_tuple_aligned_with_params():
    @go.custom_backward
    def q(x, bits=8):
        return torch.round(x * 2**bits) / 2**bits

    @q.backward
    def _(grad, *, x):
        return (grad * 5, None)

    x = _leaf(4)
    q(x, 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 5.0))


def test_return_tuple_with_two_tensor_inputs():
    @go.custom_backward
    def mul(x, w):
        return x * w

    @mul.backward
    def _(grad, *, x, w):
        return grad * w, grad * x

    x, w = _leaf(5), _leaf(5, seed=1)
    mul(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.detach())
    torch.testing.assert_close(w.grad, x.detach())


def test_return_dict_by_name():
    @go.custom_backward
    def mul(x, w):
        return x * w

    @mul.backward
    def _(grad, *, x, w):
        return {"w": grad * x * 2, "x": None}

    x, w = _leaf(5), _leaf(5, seed=1)
    mul(x, w).sum().backward()
    assert x.grad is None
    torch.testing.assert_close(w.grad, 2 * x.detach())


def test_return_none_gives_no_gradient():
    @go.custom_backward
    def ident(x):
        return x.clone()

    @ident.backward
    def _(grad):
        return None

    x = _leaf(3)
    w = _leaf(3, seed=1)
    (ident(x) + w).sum().backward()
    assert x.grad is None
    torch.testing.assert_close(w.grad, torch.ones(3))


def test_tuple_input_gets_tuple_gradient_with_none():
    @go.custom_backward
    def prod(xs):
        return xs[0] * xs[1]

    @prod.backward
    def _(grad, *, xs):
        return (grad * xs[1], None)

    a, b = _leaf(3), _leaf(3, seed=1)
    prod((a, b)).sum().backward()
    torch.testing.assert_close(a.grad, b.detach())
    assert b.grad is None


def test_list_input_gets_list_gradient():
    @go.custom_backward
    def total(xs, scale=1.0):
        return sum(xs) * scale

    @total.backward
    def _(grad, *, xs, scale):
        return [grad * scale * (i + 1) for i in range(len(xs))]

    xs = [_leaf(2, seed=i) for i in range(3)]
    total(xs, scale=2.0).sum().backward()
    for i, x in enumerate(xs):
        torch.testing.assert_close(x.grad, torch.full((2,), 2.0 * (i + 1)))


def test_dict_input_gets_dict_gradient():
    @go.custom_backward
    def combine(d):
        return d["a"] * d["b"]

    @combine.backward
    def _(grad, *, d):
        return {"a": grad * d["b"], "b": grad * d["a"]}

    a, b = _leaf(4), _leaf(4, seed=1)
    combine({"a": a, "b": b}).sum().backward()
    torch.testing.assert_close(a.grad, b.detach())
    torch.testing.assert_close(b.grad, a.detach())


def test_container_gradient_by_parameter_name():
    @go.custom_backward
    def f(xs, w):
        return xs[0] * w + xs[1]

    @f.backward
    def _(grad, *, xs, w):
        return {"xs": (grad * w, grad), "w": grad * xs[0]}

    a, b, w = _leaf(3), _leaf(3, seed=1), _leaf(3, seed=2)
    f((a, b), w).sum().backward()
    torch.testing.assert_close(a.grad, w.detach())
    torch.testing.assert_close(b.grad, torch.ones(3))
    torch.testing.assert_close(w.grad, a.detach())


def test_dict_output_gets_dict_gradient():
    @go.custom_backward
    def stats(x):
        return {"double": x * 2, "square": x**2}

    @stats.backward
    def _(grad, *, x):
        assert isinstance(grad, dict)
        assert set(grad) == {"double", "square"}
        return grad["double"] * 2 + grad["square"] * 2 * x

    x = _leaf(4)
    out = stats(x)
    assert set(out) == {"double", "square"}
    (out["double"].sum() + (out["square"] * 3).sum()).backward()
    torch.testing.assert_close(x.grad, 2 + 6 * x.detach())


def test_list_output_gets_list_gradient():
    @go.custom_backward
    def parts(x):
        return [x * 2, x * 3]

    @parts.backward
    def _(grad, *, x):
        assert isinstance(grad, list)
        return grad[0] * 2 + grad[1] * 3

    x = _leaf(4)
    out = parts(x)
    assert isinstance(out, list)
    (out[0].sum() + (out[1] * 5).sum()).backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0 + 15.0))


def test_unused_output_gets_zero_gradient_by_default():
    @go.custom_backward
    def two(x):
        return x * 2, x * 3

    seen = []

    @two.backward
    def _(g1, g2, *, x):
        seen.append(g2)
        return g1 * 2 + g2 * 3

    x = _leaf(4)
    a, _b = two(x)
    a.sum().backward()
    assert isinstance(seen[0], torch.Tensor)
    torch.testing.assert_close(seen[0], torch.zeros(4))
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))


def test_unused_output_gets_none_with_materialize_grads_false():
    @go.custom_backward
    def two(x):
        return x * 2, x * 3

    seen = []

    @two.backward(materialize_grads=False)
    def _(g1, g2):
        seen.append((g1, g2))
        total = 0
        if g1 is not None:
            total = total + g1 * 2
        if g2 is not None:
            total = total + g2 * 3
        return total

    x = _leaf(4)
    _a, b = two(x)
    b.sum().backward()
    assert seen[0][0] is None
    torch.testing.assert_close(seen[0][1], torch.ones(4))
    torch.testing.assert_close(x.grad, torch.full((4,), 3.0))


# ---- broadcast and dtype ------------------------------------------------------------------


def test_extra_leading_batch_dim_is_summed(device):
    @go.custom_backward
    def ident(x):
        return x.clone()

    @ident.backward
    def _(grad):
        return torch.stack([grad, 2 * grad, 3 * grad, 4 * grad])

    x = torch.zeros(3, device=device, requires_grad=True)
    ident(x).backward(torch.tensor([1.0, 2.0, 3.0], device=device))
    torch.testing.assert_close(x.grad, torch.tensor([10.0, 20.0, 30.0], device=device))


def test_size_one_dim_is_summed_with_keepdim():
    @go.custom_backward
    def add(x, y):
        return x + y

    @add.backward
    def _(grad):
        return grad, grad

    x = _leaf(3, 1)
    y = _leaf(3, 5, seed=1)
    up = _leaf(3, 5, seed=2, requires_grad=False)
    add(x, y).backward(up)

    xr, yr = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    (xr + yr).backward(up)
    assert x.grad.shape == (3, 1)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(y.grad, yr.grad)


def test_float64_gradient_cast_to_float32_input():
    @go.custom_backward
    def ident(x):
        return x.clone()

    @ident.backward
    def _(grad):
        return grad.double() * 2

    x = _leaf(4)
    ident(x).sum().backward()
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))


# ---- non-tensor and keyword arguments ----------------------------------------------------


def test_non_tensor_keyword_argument_reaches_forward_and_rule():
    @go.custom_backward
    def q(x, bits=8):
        s = 2**bits
        return torch.round(x * s) / s

    seen = []

    @q.backward
    def _(grad, *, bits):
        seen.append(bits)
        return grad * bits

    x = _leaf(6)
    y = q(x, bits=4)
    torch.testing.assert_close(y, torch.round(x.detach() * 16) / 16)
    y.sum().backward()
    assert seen == [4]
    torch.testing.assert_close(x.grad, torch.full((6,), 4.0))


def test_default_value_reaches_rule():
    @go.custom_backward
    def q(x, bits=8):
        return x * bits

    seen = []

    @q.backward
    def _(grad, *, bits):
        seen.append(bits)
        return grad * bits

    x = _leaf(2)
    q(x).sum().backward()
    assert seen == [8]
    torch.testing.assert_close(x.grad, torch.full((2,), 8.0))


def test_keyword_only_forward_params():
    @go.custom_backward
    def scale(x, *, factor=2.0, shift=0.0):
        return x * factor + shift

    seen = []

    @scale.backward
    def _(grad, *, factor, shift):
        seen.append((factor, shift))
        return grad * factor

    x = _leaf(3)
    y = scale(x, factor=5.0)
    torch.testing.assert_close(y, x.detach() * 5.0)
    y.sum().backward()
    assert seen == [(5.0, 0.0)]
    torch.testing.assert_close(x.grad, torch.full((3,), 5.0))


def test_tensor_passed_by_keyword():
    @go.custom_backward
    def mul(x, w):
        return x * w

    @mul.backward
    def _(grad, *, x, w):
        return {"x": grad * w, "w": grad * x}

    x, w = _leaf(3), _leaf(3, seed=1)
    mul(w=w, x=x).sum().backward()
    torch.testing.assert_close(x.grad, w.detach())
    torch.testing.assert_close(w.grad, x.detach())


# ---- partial override ---------------------------------------------------------------------


def _partial_mul():
    @go.custom_backward(owns="x")
    def mul(x, w):
        return x * w

    @mul.backward
    def _(grad):
        return grad * 100

    return mul


def test_partial_override_both_require_grad(device):
    mul = _partial_mul()
    x = _leaf(5, device=device)
    w = _leaf(5, device=device, seed=1)
    up = _leaf(5, device=device, seed=2, requires_grad=False)
    y = mul(x, w)
    torch.testing.assert_close(y, x.detach() * w.detach())
    y.backward(up)
    torch.testing.assert_close(x.grad, up * 100)
    # w keeps torch's own gradient of x * w.
    wr = w.detach().clone().requires_grad_()
    (x.detach() * wr).backward(up)
    torch.testing.assert_close(w.grad, wr.grad)


def test_partial_override_only_w_requires_grad():
    mul = _partial_mul()
    x = _leaf(5, requires_grad=False)
    w = _leaf(5, seed=1)
    mul(x, w).sum().backward()
    assert x.grad is None
    torch.testing.assert_close(w.grad, x)


def test_partial_override_only_x_requires_grad():
    mul = _partial_mul()
    x = _leaf(5)
    w = _leaf(5, seed=1, requires_grad=False)
    mul(x, w).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((5,), 100.0))
    assert w.grad is None


def test_partial_override_owns_on_backward_with_dict_return():
    @go.custom_backward
    def f(x, w, b):
        return torch.tanh(x * w + b)

    @f.backward(owns=("x", "b"))
    def _(grad):
        return {"x": grad * -1, "b": None}

    x, w, b = _leaf(4), _leaf(4, seed=1), _leaf(4, seed=2)
    f(x, w, b).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), -1.0))
    assert b.grad is None
    wr = w.detach().clone().requires_grad_()
    torch.tanh(x.detach() * wr + b.detach()).sum().backward()
    torch.testing.assert_close(w.grad, wr.grad)


def test_partial_override_with_two_outputs():
    @go.custom_backward(owns="x")
    def f(x, w):
        return x * w, x + w

    @f.backward
    def _(g1, g2):
        return g1 * 10 + g2 * 20

    x, w = _leaf(3), _leaf(3, seed=1)
    a, b = f(x, w)
    (a.sum() + 2 * b.sum()).backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 10.0 + 40.0))
    wr = w.detach().clone().requires_grad_()
    ((x.detach() * wr).sum() + 2 * (x.detach() + wr).sum()).backward()
    torch.testing.assert_close(w.grad, wr.grad)


# ---- residuals ----------------------------------------------------------------------------


def test_residuals_reach_rule_without_recomputation(device):
    calls = []

    @go.custom_backward(residuals=("norm",))
    def normalize(x):
        calls.append(1)
        n = x.norm()
        return x / n, {"norm": n}

    seen = []

    @normalize.backward
    def _(grad, *, norm):
        seen.append(norm.detach().clone())
        return grad / norm

    x = torch.tensor([3.0, 4.0], device=device, requires_grad=True)
    y = normalize(x)
    assert isinstance(y, torch.Tensor)
    torch.testing.assert_close(y, torch.tensor([0.6, 0.8], device=device))
    y.backward(torch.tensor([1.0, 2.0], device=device))
    assert len(calls) == 1
    torch.testing.assert_close(seen[0], torch.tensor(5.0, device=device))
    torch.testing.assert_close(x.grad, torch.tensor([0.2, 0.4], device=device))


def test_residual_non_tensor_value():
    @go.custom_backward(residuals=("k",))
    def f(x):
        return x * 3, {"k": 3}

    @f.backward
    def _(grad, *, k):
        return grad * k

    x = _leaf(2)
    y = f(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 3.0))


def test_residuals_with_tuple_output_unused_output_gets_zeros():
    @go.custom_backward(residuals=("s",))
    def f(x):
        s = x.sum()
        return (x * s, x + s), {"s": s}

    seen = []

    @f.backward
    def _(g1, g2, *, s):
        seen.append(g2)
        return g1 * s + g2

    x = _leaf(3)
    a, _b = f(x)
    a.sum().backward()
    torch.testing.assert_close(seen[0], torch.zeros(3))
    torch.testing.assert_close(x.grad, torch.full((3,), 1.0) * x.detach().sum())


def test_residuals_with_partial_override():
    calls = []

    @go.custom_backward(residuals=("s",), owns="x")
    def f(x, w):
        calls.append(1)
        s = (x * x).sum()
        return x * w, {"s": s}

    @f.backward
    def _(grad, *, s):
        return grad * s

    x, w = _leaf(3), _leaf(3, seed=1)
    y = f(x, w)
    y.sum().backward()
    assert len(calls) == 1
    torch.testing.assert_close(x.grad, torch.full((3,), 1.0) * (x.detach() ** 2).sum())
    torch.testing.assert_close(w.grad, x.detach())


# ---- higher order -------------------------------------------------------------------------


def test_rule_in_torch_ops_is_differentiable_again():
    @go.custom_backward
    def cube(x):
        return x**3

    @cube.backward
    def _(grad, *, x):
        return grad * 3 * x**2

    x = _leaf(5)
    (g,) = torch.autograd.grad(cube(x).sum(), x, create_graph=True)
    torch.testing.assert_close(g, 3 * x.detach() ** 2)
    (g2,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(g2, 6 * x.detach())


def test_once_differentiable_raises_on_second_derivative():
    @go.custom_backward
    def cube(x):
        return x**3

    @cube.backward(once_differentiable=True)
    def _(grad, *, x):
        return grad * 3 * x**2

    x = _leaf(5)
    (g,) = torch.autograd.grad(cube(x).sum(), x, create_graph=True)
    torch.testing.assert_close(g, 3 * x.detach() ** 2)
    with pytest.raises(go.GradOverrideError, match="runs without recording a graph"):
        torch.autograd.grad(g.sum(), x)


# ---- module form --------------------------------------------------------------------------


def test_module_form_in_sequential():
    m = quantize.module(bits=4)
    assert isinstance(m, nn.Module)
    assert repr(m) == "quantize(bits=4)"
    lin = nn.Linear(3, 3)
    net = nn.Sequential(lin, m)
    assert "quantize(bits=4)" in repr(net)
    x = torch.tensor([[0.1, -0.3, 0.2]])
    y = net(x)
    pre = lin(x)
    torch.testing.assert_close(y, torch.round(pre * 16) / 16)
    y.sum().backward()
    mask = (pre.detach().abs() <= 1).float()
    torch.testing.assert_close(lin.bias.grad, mask[0])


def test_module_unknown_fixed_name_raises():
    with pytest.raises(go.GradOverrideTypeError, match="bitz"):
        quantize.module(bitz=4)


# ---- method binding -----------------------------------------------------------------------


class Scaler:
    def __init__(self, factor):
        self.factor = factor

    @go.custom_backward
    def op(self, x):
        return x * self.factor

    @op.backward
    def _(grad, *, self):
        return (None, grad * self.factor * 10)


def test_method_binding_passes_instance():
    s = Scaler(2.0)
    x = _leaf(3)
    y = s.op(x)
    torch.testing.assert_close(y, x.detach() * 2)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 20.0))
    assert Scaler.op is Scaler.__dict__["op"]


# ---- pickling and copying -----------------------------------------------------------------


def test_module_level_op_pickles_by_reference():
    assert pickle.loads(pickle.dumps(scaled)) is scaled
    assert pickle.loads(pickle.dumps(quantize)) is quantize


def test_deepcopy_of_module_holding_op_module():
    net = nn.Sequential(nn.Linear(2, 2), scaled.module(factor=3.0))
    clone = copy.deepcopy(net)
    assert clone[1].op is scaled
    assert clone[1].fixed == {"factor": 3.0}
    assert clone[0].weight is not net[0].weight
    x = torch.ones(1, 2)
    clone(x).sum().backward()
    torch.testing.assert_close(clone[0].bias.grad, torch.full((2,), 3.0))
    restored = pickle.loads(pickle.dumps(net))
    assert restored[1].op is scaled


# ---- registration and rule errors ---------------------------------------------------------


def test_second_rule_raises():
    def f(x):
        return x

    op = go.custom_backward(f, backward=lambda grad: grad)
    with pytest.raises(go.GradOverrideError, match="already has the backward rule"):

        @op.backward
        def _(grad):
            return grad


def test_call_before_rule_shows_how_to_register():
    def g(x):
        return x

    op = go.custom_backward(g)
    with pytest.raises(go.GradOverrideError, match=r"@g\.backward"):
        op(torch.ones(2))


def test_rule_raising_propagates_with_note():
    def boom(x):
        return x * 2

    op = go.custom_backward(boom)

    @op.backward
    def failing_rule(grad):
        raise ValueError("rule failed on purpose")

    x = _leaf(3)
    y = op(x)
    with pytest.raises(ValueError, match="rule failed on purpose") as info:
        y.sum().backward()
    assert type(info.value) is ValueError
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "failing_rule" in notes
    assert "boom" in notes


def test_rule_raising_in_general_path_propagates_with_note():
    def boom2(x):
        return x * 2, x * 3

    op = go.custom_backward(boom2)

    @op.backward
    def failing_rule2(g1, g2):
        raise ValueError("second rule failed")

    x = _leaf(3)
    a, b = op(x)
    with pytest.raises(ValueError, match="second rule failed") as info:
        (a + b).sum().backward()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "failing_rule2" in notes
    assert "boom2" in notes


# ---- devices ------------------------------------------------------------------------------


def test_tuple_return_and_two_inputs_on_device(device):
    @go.custom_backward
    def mul(x, w):
        return x * w

    @mul.backward
    def _(grad, *, x, w):
        return grad * w, grad * x

    x = torch.tensor([1.0, 2.0], device=device, requires_grad=True)
    w = torch.tensor([3.0, 4.0], device=device, requires_grad=True)
    y = mul(x, w)
    assert y.device.type == device.type
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([3.0, 4.0], device=device))
    torch.testing.assert_close(w.grad, torch.tensor([1.0, 2.0], device=device))


# ---- more shapes of forward and call ------------------------------------------------------


def test_rule_equal_to_true_derivative_passes_gradcheck_and_gradgradcheck():
    @go.custom_backward
    def smooth(x, w):
        return torch.sin(x) * w

    @smooth.backward
    def _(grad, *, x, w):
        return grad * torch.cos(x) * w, grad * torch.sin(x)

    x = _leaf(5, dtype=torch.float64)
    w = _leaf(5, dtype=torch.float64, seed=1)
    assert torch.autograd.gradcheck(smooth, (x, w))
    assert torch.autograd.gradgradcheck(smooth, (x, w))


def test_partial_override_with_true_derivative_passes_gradcheck():
    @go.custom_backward(owns="x")
    def smooth(x, w):
        return torch.sin(x) * w

    @smooth.backward
    def _(grad, *, x, w):
        return grad * torch.cos(x) * w

    x = _leaf(4, dtype=torch.float64)
    w = _leaf(4, dtype=torch.float64, seed=1)
    assert torch.autograd.gradcheck(smooth, (x, w))


def test_partial_override_second_derivative():
    @go.custom_backward(owns="x")
    def f(x, w):
        return x**3 * w

    @f.backward
    def _(grad, *, x, w):
        return grad * 3 * x**2 * w

    x, w = _leaf(4), _leaf(4, seed=1)
    gx, gw = torch.autograd.grad(f(x, w).sum(), (x, w), create_graph=True)
    torch.testing.assert_close(gx, 3 * x.detach() ** 2 * w.detach())
    torch.testing.assert_close(gw, x.detach() ** 3)
    (gxx,) = torch.autograd.grad(gx.sum(), x)
    torch.testing.assert_close(gxx, 6 * x.detach() * w.detach())


def test_partial_override_mixed_second_derivative_comes_from_the_rule():
    # f = x**3 * w, the rule owns x. Second derivatives involving x come from the rule's
    # graph: d(df/dx)/dw = 3 x**2. The ordinary gradient of w is computed with x held
    # constant (the documented limit of partial override), so it does not depend on x.
    @go.custom_backward(owns="x")
    def f(x, w):
        return x**3 * w

    @f.backward
    def _(grad, *, x, w):
        return grad * 3 * x**2 * w

    x, w = _leaf(4), _leaf(4, seed=1)
    gx, gw = torch.autograd.grad(f(x, w).sum(), (x, w), create_graph=True)
    torch.testing.assert_close(gw, x.detach() ** 3)
    (gxw,) = torch.autograd.grad(gx.sum(), w)
    torch.testing.assert_close(gxw, 3 * x.detach() ** 2)
    assert not gw.requires_grad


def test_op_applied_twice_in_one_graph():
    x = _leaf(3)
    y = scaled(scaled(x, 2.0), 5.0)
    torch.testing.assert_close(y, x.detach() * 10)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 10.0))


def test_identity_forward_returning_its_input():
    @go.custom_backward
    def ident(x):
        return x

    @ident.backward
    def _(grad):
        return grad * 2

    x = _leaf(3)
    y = ident(x)
    torch.testing.assert_close(y, x.detach())
    (y * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 6.0))


def test_var_positional_forward():
    @go.custom_backward
    def total(*xs):
        return sum(xs)

    @total.backward
    def _(grad, *, xs):
        assert isinstance(xs, tuple)
        return tuple(grad * (i + 1) for i in range(len(xs)))

    a, b = _leaf(2), _leaf(2, seed=1)
    total(a, b).sum().backward()
    torch.testing.assert_close(a.grad, torch.full((2,), 1.0))
    torch.testing.assert_close(b.grad, torch.full((2,), 2.0))


def test_positional_only_and_keyword_only_tensor_params():
    @go.custom_backward
    def f(x, /, w, *, b):
        return x * w + b

    @f.backward
    def _(grad, *, x, w):
        return {"x": grad * w, "w": grad * x, "b": grad}

    x, w, b = _leaf(3), _leaf(3, seed=1), _leaf(3, seed=2)
    f(x, w=w, b=b).sum().backward()
    torch.testing.assert_close(x.grad, w.detach())
    torch.testing.assert_close(w.grad, x.detach())
    torch.testing.assert_close(b.grad, torch.ones(3))


def test_non_tensor_tuple_argument():
    @go.custom_backward
    def total(x, dims=(0,)):
        return x.sum(dim=dims)

    seen = []

    @total.backward
    def _(grad, *, x, dims):
        seen.append(dims)
        return grad.reshape(1, -1).expand_as(x) * 2

    x = _leaf(4, 3)
    y = total(x, (0,))
    torch.testing.assert_close(y, x.detach().sum(0))
    y.sum().backward()
    assert seen == [(0,)]
    torch.testing.assert_close(x.grad, torch.full((4, 3), 2.0))


def test_zero_dim_input_gets_summed_gradient():
    @go.custom_backward
    def mul(x, w):
        return x * w

    @mul.backward
    def _(grad, *, x, w):
        return grad * w, grad * x

    x = _leaf(5)
    w = torch.tensor(3.0, requires_grad=True)
    up = _leaf(5, seed=3, requires_grad=False)
    mul(x, w).backward(up)
    assert w.grad.shape == ()
    torch.testing.assert_close(w.grad, (up * x.detach()).sum())
    torch.testing.assert_close(x.grad, up * 3.0)


def test_partial_override_with_container_input():
    @go.custom_backward(owns="xs")
    def f(xs, w):
        return (xs[0] + xs[1]) * w

    @f.backward
    def _(grad):
        return (grad * 7, None)

    a, b, w = _leaf(3), _leaf(3, seed=1), _leaf(3, seed=2)
    f((a, b), w).sum().backward()
    torch.testing.assert_close(a.grad, torch.full((3,), 7.0))
    assert b.grad is None
    torch.testing.assert_close(w.grad, a.detach() + b.detach())


def test_partial_override_unused_output_gets_zero_gradient():
    @go.custom_backward(owns="x")
    def f(x, w):
        return x * w, x + w

    seen = []

    @f.backward
    def _(g1, g2):
        seen.append(g2)
        return g1 * 10 + g2 * 20

    x, w = _leaf(3), _leaf(3, seed=1)
    a, _b = f(x, w)
    a.sum().backward()
    assert isinstance(seen[0], torch.Tensor)
    torch.testing.assert_close(seen[0], torch.zeros(3))
    torch.testing.assert_close(x.grad, torch.full((3,), 10.0))
    torch.testing.assert_close(w.grad, x.detach())


def test_partial_override_unused_output_none_without_materialize():
    @go.custom_backward(owns="x", materialize_grads=False)
    def f(x, w):
        return x * w, x + w

    seen = []

    @f.backward
    def _(g1, g2):
        seen.append((g1, g2))
        return g2 * 20

    x, w = _leaf(3), _leaf(3, seed=1)
    _a, b = f(x, w)
    b.sum().backward()
    assert seen[0][0] is None
    torch.testing.assert_close(x.grad, torch.full((3,), 20.0))
    torch.testing.assert_close(w.grad, torch.ones(3))


def test_partial_override_rule_receives_output():
    @go.custom_backward(owns="x")
    def f(x, w):
        return torch.exp(x) * w

    @f.backward
    def _(grad, *, output):
        return grad * output

    x, w = _leaf(3), _leaf(3, seed=1)
    f(x, w).sum().backward()
    torch.testing.assert_close(x.grad, torch.exp(x.detach()) * w.detach())
    torch.testing.assert_close(w.grad, torch.exp(x.detach()))


def test_rule_output_for_tuple_forward():
    @go.custom_backward
    def two(x):
        return x * 2, x * 3

    seen = []

    @two.backward
    def _(g1, g2, *, output):
        seen.append(output)
        return g1 * 2 + g2 * 3

    x = _leaf(3)
    a, b = two(x)
    (a + b).sum().backward()
    assert isinstance(seen[0], tuple)
    assert len(seen[0]) == 2
    torch.testing.assert_close(seen[0][0], x.detach() * 2)
    torch.testing.assert_close(seen[0][1], x.detach() * 3)
    torch.testing.assert_close(x.grad, torch.full((3,), 5.0))


def test_builtin_with_two_inputs_dict_return():
    def rule(grad, *, input, other):
        return {"input": grad * other * 2, "other": grad * input * 2}

    op = go.custom_backward(torch.mul, backward=rule)
    x, w = _leaf(3), _leaf(3, seed=1)
    y = op(x, w)
    torch.testing.assert_close(y, x.detach() * w.detach())
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * w.detach())
    torch.testing.assert_close(w.grad, 2 * x.detach())


def test_many_parameters_beyond_the_unrolled_fast_path():
    # The generated fast path writes out up to six parameters; more take a loop.
    @go.custom_backward
    def weighted_sum(a, b, c, d, e, f, g):
        return a + 2 * b + 3 * c + 4 * d + 5 * e + 6 * f + 7 * g

    @weighted_sum.backward
    def _(grad):
        return tuple(grad * k for k in (10, 20, 30, 40, 50, 60, 70))

    xs = [torch.ones(2, requires_grad=True) for _ in range(7)]
    weighted_sum(*xs).sum().backward()
    for k, x in zip((10, 20, 30, 40, 50, 60, 70), xs, strict=True):
        torch.testing.assert_close(x.grad, torch.full((2,), float(k)))


# ==== edges of the core: captured tensors, in-place inputs, residuals, outputs ==============
# Silent wrong or lost gradients at the edges of `custom_backward`, each fixed or refused.
#
# Every expected gradient here comes from an independent computation: plain autograd of the
# same math, or a value written out by hand.


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


def test_a_parameter_of_a_module_the_forward_reaches_is_named() -> None:
    lin = nn.Linear(2, 2)

    @go.custom_backward
    def through_lin(x):
        return lin(x)

    @through_lin.backward
    def _(grad):
        return grad

    with pytest.raises(go.GradOverrideError,
                       match=r"reads `lin.weight` \(a parameter of `lin`, a variable of an "
                             r"enclosing function\)"):
        through_lin(torch.randn(2))


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


# ==== captured tensors reaching the result through ops, bridges, views and complex signs ====


W = torch.randn(3, requires_grad=True)
Z = torch.randn(3, dtype=torch.complex64, requires_grad=True)


def _view_write(x):
    y = x * 1.0
    y[0].mul_(W[0])  # an in-place write into a view of the result
    return y


_numpy_scale = go.bridge(lambda a, b: a * b, backward=lambda g, *, a, b: {"a": g * b, "b": g * a})


@pytest.mark.parametrize(
    "read",
    [
        _view_write,
        lambda x: x * recipes.binarize()(W),
        lambda x: x * recipes.ste_round()(W),
        lambda x: x * recipes.quantize(bits=4)(W),
        lambda x: x * _numpy_scale(W, torch.ones(3)),
        lambda x: x * torch.sgn(Z).real,
    ],
    ids=["view write", "binarize", "ste_round", "quantize", "bridge", "sgn complex"],
)
def test_captured_tensors_reaching_the_result_are_refused(read) -> None:
    @go.custom_backward
    def f(x):
        return read(x)

    @f.backward
    def _(grad, *, x):
        return grad

    with pytest.raises(go.GradOverrideError, match="which requires grad"):
        f(torch.randn(3, requires_grad=True))
    with pytest.raises(go.GradOverrideError, match="which requires grad"):
        check_backward(f, torch.randn(3, requires_grad=True))
    with pytest.raises(go.GradOverrideError, match="which requires grad"):
        assert_consistent(f, torch.randn(3, requires_grad=True), modes=("eager",))


def test_sgn_of_a_real_captured_tensor_carries_no_gradient() -> None:
    @go.custom_backward
    def f(x):
        return x * torch.sgn(W)

    @f.backward
    def _(grad, *, x):
        return grad

    x = torch.randn(3, requires_grad=True)
    f(x).sum().backward()
    assert x.grad is not None


# ---- torch.compile around a torch.func transform ---------------------------------------------


@go.custom_backward
def _tenfold_round(x):
    return torch.round(x * 4) / 4


@_tenfold_round.backward
def _(grad, *, x):
    return grad * 10


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
@pytest.mark.parametrize("vmapped", [False, True], ids=["grad", "vmap(grad)"])
def test_compiled_around_a_torch_func_transform_keeps_the_rule_or_says_why(vmapped) -> None:
    # Dynamo drops a custom backward inside a torch.func transform it traces (a hand-written
    # Function's too: it gives round's own derivative, 0); the call runs eagerly instead.
    fn = torch.func.grad(lambda x: _tenfold_round(x).sum())
    if vmapped:
        fn = torch.func.vmap(fn)
    x = torch.randn(2, 3)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager")(x)
    torch.testing.assert_close(got, torch.full((2, 3), 10.0))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"`_tenfold_round` is called inside a torch\.func "
                                        r"transform .* torch\.compile traces"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(x)


# ==== found by review: repeated outputs, forward mode, real gradients of complex inputs ====


@go.custom_backward
def _twice_returned(x):
    y = x * 2
    return y, y


@_twice_returned.backward
def _(g1, g2, *, x):
    return 2 * (g1 + g2)


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_a_tensor_returned_twice_compiles() -> None:
    x = torch.ones(3, requires_grad=True)
    step = torch.compile(lambda a: (lambda p, q: (p + 10 * q).sum())(*_twice_returned(a)),
                         fullgraph=True, backend="aot_eager")
    step(x).backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 22.0))  # 2 * (1 + 10)


@go.custom_backward
def _cube(x):
    return x**3


@_cube.backward
def _(grad, *, x):
    return grad * 3 * x**2


# (torch's own warning: forward mode scripts some of torch's decompositions at first use)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("transform", ["jacfwd", "hessian", "jvp"])
def test_forward_mode_is_refused_naming_the_op(transform) -> None:
    x = torch.tensor([1.0, 2.0])
    run = {
        "jacfwd": lambda: torch.func.jacfwd(_cube)(x),
        "hessian": lambda: torch.func.hessian(lambda v: _cube(v).sum())(x),
        "jvp": lambda: torch.func.jvp(_cube, (x,), (torch.ones(2),)),
    }[transform]
    with pytest.raises(go.GradOverrideError,
                       match=r"`_cube` has a backward \(reverse-mode\) rule only.*jacrev\(jacrev"):
        run()


@go.custom_backward
def _twice_real(z):
    return z.real * 2


@_twice_real.backward
def _(grad, *, z):
    return grad * 2  # real: the imaginary part of the gradient is zero


def test_a_real_gradient_for_a_complex_input_is_taken_as_pytorch_takes_it() -> None:
    z = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    reference = z.detach().clone().requires_grad_()
    (reference.real * 2).sum().backward()
    _twice_real(z).sum().backward()
    torch.testing.assert_close(z.grad, reference.grad)


@go.custom_backward
def _pair_sum(xs, k):
    return xs[0] * k + xs[1]


@_pair_sum.backward
def _(g, *, xs, k):
    return ((g * k, g), None)  # a tuple for the list `xs`


def test_a_gradient_of_another_structure_than_its_container_input_is_named() -> None:
    xs = [torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)]
    with pytest.raises(go.GradOverrideError,
                       match=r"gradient for `xs` whose structure does not match the input's: "
                             r"the input is a list of 2 leaves and the gradient is a tuple"):
        _pair_sum(xs, 2.0).sum().backward()
