"""Forward signatures: builtins documented in several forms, `signature=`, `out=`, ops over
staticmethods and classmethods, and a rule's positional parameter named like a forward one.

Expected outputs come from calling torch itself; expected gradients are written out by hand
(a rule that returns `k * upstream` gives `k` times what plain autograd gives, which
`torch.autograd.grad` of the same torch call computes independently).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradoverride as go
from gradoverride.testing import assert_consistent


def _leaf(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def _autograd(fn: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Plain autograd of `fn(*inputs).sum()`, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out = out.values if hasattr(out, "values") and not isinstance(out, torch.Tensor) else out
    return torch.autograd.grad(out.sum(), leaves)


# ---- builtins documented in several forms -------------------------------------------------


def _scaled_sum_rule(seen: dict[str, Any]) -> Any:
    def rule(grad: torch.Tensor, *, input: torch.Tensor, dim: Any, keepdim: Any) -> Any:
        seen["dim"], seen["keepdim"] = dim, keepdim
        if dim is not None and not keepdim:
            grad = grad.unsqueeze(dim)
        return 3 * grad.expand_as(input)

    return rule


@pytest.mark.parametrize(
    ("args", "kwargs", "dim", "keepdim"),
    [
        ((), {}, None, None),  # sum(input): the slots of the other form hold None
        ((1,), {}, 1, False),
        ((0, True), {}, 0, True),
        ((), {"dim": 1, "keepdim": True}, 1, True),
        ((), {"dtype": torch.float64}, None, None),
    ],
)
def test_torch_sum_binds_each_call_to_the_form_that_takes_it(
    args: tuple[Any, ...], kwargs: dict[str, Any], dim: Any, keepdim: Any
) -> None:
    seen: dict[str, Any] = {}
    op = go.custom_backward(torch.sum, backward=_scaled_sum_rule(seen))
    assert op.parameters == ("input", "dim", "keepdim", "dtype")
    x = _leaf(3, 4)
    y = op(x, *args, **kwargs)
    torch.testing.assert_close(y, torch.sum(x.detach(), *args, **kwargs))
    (grad,) = torch.autograd.grad(y.sum(), x)
    (expected,) = _autograd(lambda t: torch.sum(t, *args, **kwargs), x)
    torch.testing.assert_close(grad, 3 * expected)
    assert (seen["dim"], seen["keepdim"]) == (dim, keepdim)


def test_a_call_back_keeps_a_default_that_tells_the_forms_apart() -> None:
    # median(input) reduces over every element; median(input, dim=-1) along the last dim.
    # Leaving out the "default" -1 would call the other form.
    op = go.custom_backward(torch.median, backward=lambda grad, *, input: torch.zeros_like(input))
    x = _leaf(3, 4)
    torch.testing.assert_close(op(x), torch.median(x.detach()))
    torch.testing.assert_close(op(x, -1).values, torch.median(x.detach(), -1).values)
    torch.testing.assert_close(op(x, 0).values, torch.median(x.detach(), 0).values)


def test_torch_where_in_both_forms() -> None:
    def rule(grad: torch.Tensor, *, condition: torch.Tensor, other: Any) -> Any:
        assert other is not None
        return {"condition": None, "input": grad * condition * 5, "other": grad * ~condition * 7}

    op = go.custom_backward(torch.where, backward=rule)
    assert op.parameters == ("condition", "input", "other")
    x, w = _leaf(5), _leaf(5, seed=1)
    cond = x.detach() > 0
    for got, want in zip(op(cond), torch.where(cond), strict=True):  # where(condition)
        torch.testing.assert_close(got, want)
    gx, gw = torch.autograd.grad(op(cond, x, w).sum(), (x, w))
    torch.testing.assert_close(gx, 5.0 * cond.double())
    torch.testing.assert_close(gw, 7.0 * (~cond).double())


def test_a_call_two_forms_read_differently_is_refused_with_the_fix() -> None:
    op = go.custom_backward(torch.max, backward=lambda grad, *, input: grad)
    x = _leaf(3, 4)
    with pytest.raises(go.GradOverrideTypeError) as info:
        op(x, 1)
    message = str(info.value)
    assert "`torch.max` is documented in several forms" in message
    assert "2nd positional argument" in message
    assert "`torch.max(input, dim, keepdim=False)` reads it as `dim`" in message
    assert "`torch.max(input, other)` as `other`" in message
    assert "(`dim=...` or `other=...`)" in message
    assert 'signature="(input, dim, keepdim=False)"' in message


def test_torch_max_by_keyword_in_each_form() -> None:
    def rule(grad: torch.Tensor, *, input: torch.Tensor, dim: Any, other: Any) -> Any:
        if other is not None:
            return {"input": 2 * grad * (input > other), "other": 2 * grad * (input <= other)}
        if dim is None:
            return 2 * grad * (input == input.max())
        # max(input, dim) returns (values, indices): the gradient has that structure
        values_grad = grad[0].unsqueeze(dim)
        return 2 * values_grad * (input == input.max(dim, keepdim=True).values)

    op = go.custom_backward(torch.max, backward=rule)
    assert op.parameters == ("input", "dim", "keepdim", "other")
    x, w = _leaf(3, 4), _leaf(3, 4, seed=1)
    (g,) = torch.autograd.grad(op(x), x)
    torch.testing.assert_close(g, 2 * _autograd(torch.max, x)[0])
    out = op(x, dim=1)
    torch.testing.assert_close(out.values, torch.max(x.detach(), dim=1).values)
    (g,) = torch.autograd.grad(out.values.sum(), x)
    torch.testing.assert_close(g, 2 * _autograd(lambda t: torch.max(t, dim=1), x)[0])
    gx, gw = torch.autograd.grad(op(x, other=w).sum(), (x, w))
    ex, ew = _autograd(lambda a, b: torch.max(a, other=b), x, w)
    torch.testing.assert_close((gx, gw), (2 * ex, 2 * ew))


def test_a_call_no_form_takes_lists_the_forms() -> None:
    op = go.custom_backward(torch.sum, backward=lambda grad: grad)
    with pytest.raises(go.GradOverrideTypeError, match=(
        r"`torch.sum` was called with arguments none of its documented forms takes "
        r"\(`torch.sum\(input, \*, dtype=None\)`: too many positional arguments; "
        r"`torch.sum\(input, dim, keepdim=False, \*, dtype=None\)`: too many positional"
    )):
        op(_leaf(3), 0, False, 1)


def test_a_rule_may_name_a_parameter_of_any_form() -> None:
    go.custom_backward(torch.max, backward=lambda grad, *, other, keepdim: grad)
    with pytest.raises(go.GradOverrideTypeError, match=(
        r"names `dimension`, which `torch.max` does not have; a rule may name `input`, `dim`, "
        r"`keepdim`, `other`"
    )):
        go.custom_backward(torch.max, backward=lambda grad, *, dimension: grad)


def _sum_rule(grad: torch.Tensor, *, input: torch.Tensor, dim: Any, keepdim: Any) -> Any:
    if dim is not None and not keepdim:
        grad = grad.unsqueeze(dim)
    return 3 * grad.expand_as(input)


@pytest.mark.compile
def test_an_overloaded_builtin_compiles_and_vmaps() -> None:
    op = go.custom_backward(torch.sum, backward=_sum_rule)
    # Both forms in one graph: sum(input, dim) and sum(input).
    assert_consistent(lambda x: op(x, 1) * op(x), torch.linspace(-2.0, 2.0, 12).reshape(3, 4))


# ---- documented forms read as torch writes them -------------------------------------------


@pytest.mark.parametrize(
    ("fn", "names"),
    [
        # `abs(input: Tensor, *, out: Optional[Tensor])`: optional, though written without a
        # default; `out` is not a slot.
        (torch.abs, ("input",)),
        # `prod(input: Tensor, *, dtype: Optional[_dtype])`
        (torch.prod, ("input", "dim", "keepdim", "dtype")),
        # `squeeze(input: Tensor, dim: Optional[Union[int, List[int]]])`
        (torch.squeeze, ("input", "dim")),
        # documented as `erf(input, *, out=None)`, known to Python as `special_erf`
        (torch.special.erf, ("input",)),
    ],
    ids=["abs", "prod", "squeeze", "special.erf"],
)
def test_documented_parameters(fn: Any, names: tuple[str, ...]) -> None:
    # The upstream gradient is all ones; the rule gives 4 for every element of the input.
    op = go.custom_backward(fn, backward=lambda grad, *, input: torch.full_like(input, 4.0))
    assert op.parameters == names
    x = _leaf(2, 1, 3)
    y = op(x)
    torch.testing.assert_close(y, fn(x.detach()))
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, torch.full_like(x, 4.0))


def test_messages_name_torch_functions_as_users_call_them() -> None:
    op = go.custom_backward(torch.sign, backward=lambda grad, *, input: grad)
    with pytest.raises(go.GradOverrideTypeError, match=r"^`torch.sign` was called with"):
        op(_leaf(3), 1, 2)


# ---- signature= -----------------------------------------------------------------------------


def test_signature_option_picks_the_form() -> None:
    def rule(grad: torch.Tensor, *, input: torch.Tensor, other: torch.Tensor) -> Any:
        return 2 * grad * (input > other), 2 * grad * (input <= other)

    op = go.custom_backward(torch.max, signature="(input, other)", backward=rule)
    assert op.parameters == ("input", "other")
    x, w = _leaf(5), _leaf(5, seed=1)
    y = op(x, w)  # no longer ambiguous: the one form reads `w` as `other`
    torch.testing.assert_close(y, torch.max(x.detach(), w.detach()))
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    ex, ew = _autograd(torch.max, x, w)
    torch.testing.assert_close((gx, gw), (2 * ex, 2 * ew))


def test_signature_option_as_documented_text_and_several_forms() -> None:
    seen: dict[str, Any] = {}
    op = go.custom_backward(
        torch.sum,
        signature=("sum(input) -> Tensor", "sum(input, dim, keepdim=False) -> Tensor"),
        backward=_scaled_sum_rule(seen),
    )
    assert op.parameters == ("input", "dim", "keepdim")
    x = _leaf(3, 4)
    (grad,) = torch.autograd.grad(op(x, 0).sum(), x)
    torch.testing.assert_close(grad, torch.full_like(x, 3.0))
    assert seen == {"dim": 0, "keepdim": False}


def test_signature_option_for_a_function_python_reads_as_star_args() -> None:
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.mul(*args, **kwargs)

    op = go.custom_backward(
        forward, signature="(input, other)", backward=lambda g, *, other: (g * other * 3, None)
    )
    x, w = _leaf(4), _leaf(4, seed=1)
    (grad,) = torch.autograd.grad(op(x, w).sum(), x)
    torch.testing.assert_close(grad, 3 * w.detach())


@pytest.mark.parametrize(
    ("signature", "match"),
    [
        ("input, dim", r"cannot read signature='input, dim': it has no parameter list"),
        ("(input, dim=torch.nope)", r"cannot read .*: its default `torch.nope` is neither"),
        ("(input, dim) tensor", r"cannot read .*: `tensor` follows the parameter list"),
        ("(input, dim=1, keep)", r"cannot read signature='\(input, dim=1, keep\)'"),
        ("(input, *, out=None)", r"signature=.* has an `out` parameter; .* Leave `out` out"),
        (3, r"`signature` must be the parameter list as a string"),
    ],
)
def test_signature_option_errors(signature: Any, match: str) -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"^custom_backward\(torch.sum\): " + match):
        go.custom_backward(torch.sum, signature=signature)


# ---- out= -------------------------------------------------------------------------------------


def test_out_is_not_a_parameter_of_a_builtin() -> None:
    op = go.custom_backward(torch.sign, backward=lambda grad, *, input: (grad * 3,))
    assert op.parameters == ("input",)
    x = _leaf(5)
    (grad,) = torch.autograd.grad(op(x).sum(), x)
    torch.testing.assert_close(grad, torch.full_like(x, 3.0))
    # `alpha` is a parameter (it has a slot); `out` is not.
    add = go.custom_backward(torch.add, backward=lambda grad, *, alpha: (grad, grad * alpha, None))
    assert add.parameters == ("input", "other", "alpha")
    w = _leaf(5, seed=1)
    gx, gw = torch.autograd.grad(add(x, w, alpha=2.0).sum(), (x, w))
    torch.testing.assert_close((gx, gw), (torch.ones_like(x), torch.full_like(w, 2.0)))


@pytest.mark.parametrize(
    ("fn", "signature"),
    [(torch.sign, None), (torch.sum, None), (torch.sign, "(*args, **kwargs)")],
    ids=["one form", "several forms", "given as star args"],
)
def test_calling_with_out_is_refused(fn: Any, signature: str | None) -> None:
    options = {} if signature is None else {"signature": signature}
    op = go.custom_backward(fn, **options, backward=lambda grad: grad)
    x = _leaf(3)
    with pytest.raises(go.GradOverrideTypeError, match=(
        r"was called with `out=`, which an op with a custom backward does not support: .*"
        r"Use the result instead"
    )):
        op(x, out=torch.empty(3, dtype=x.dtype))


# ---- ops over staticmethods and classmethods ------------------------------------------------


def _static_scaler() -> type:
    """A class with an op over a staticmethod (built per test, so that a version which
    mishandles it fails only these tests)."""

    class Scaler:
        @go.custom_backward
        @staticmethod
        def triple(x: torch.Tensor) -> torch.Tensor:
            return x * 3

        @triple.backward
        def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
            return grad * 30  # ten times the true gradient: visibly the rule's

    return Scaler


def _class_scalers() -> tuple[type, type]:
    """A class with an op over a classmethod, and a subclass with another factor."""

    class Scaler:
        factor = 2.0

        @go.custom_backward
        @classmethod
        def scale(cls, x: torch.Tensor) -> torch.Tensor:
            return x * cls.factor

        @scale.backward
        def _(grad: torch.Tensor, *, cls: type) -> Any:
            return {"x": grad * cls.factor * 10}

    class BigScaler(Scaler):
        factor = 5.0

    return Scaler, BigScaler


@pytest.mark.parametrize("through", ["instance", "class"])
def test_op_over_staticmethod_binds_nothing(through: str) -> None:
    scaler = _static_scaler()
    owner = scaler() if through == "instance" else scaler
    x = _leaf(4)
    y = owner.triple(x)
    torch.testing.assert_close(y, 3 * x.detach())
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, torch.full_like(x, 30.0))


@pytest.mark.parametrize(
    ("through", "factor"),
    [("instance", 2.0), ("class", 2.0), ("subclass instance", 5.0), ("subclass", 5.0)],
)
def test_op_over_classmethod_binds_the_class(through: str, factor: float) -> None:
    scaler, big = _class_scalers()
    cls = big if through.startswith("subclass") else scaler
    owner = cls() if through.endswith("instance") else cls
    x = _leaf(4)
    y = owner.scale(x)
    torch.testing.assert_close(y, factor * x.detach())
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, torch.full_like(x, factor * 10))


# ---- a rule's positional parameter named like a forward parameter ---------------------------


@go.custom_backward
def _mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


def test_a_forgotten_star_is_caught_at_registration() -> None:
    op = go.custom_backward(_mul.__wrapped__)

    def _(grad: torch.Tensor, x: torch.Tensor) -> Any:
        return grad

    with pytest.raises(go.GradOverrideTypeError, match=(
        r"the backward rule `.*_` of `.*_mul` takes `x` as a positional parameter, but "
        r"positional parameters receive the upstream gradients \(one per output of `.*_mul`\)"
        r".* Did you mean `def _\(grad, \*, x\)`\?"
    )):
        op.backward(_)


def test_a_forgotten_star_message_shows_the_fixed_signature() -> None:
    op = go.custom_backward(_mul.__wrapped__)

    def rule(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, output: Any) -> Any:
        return g

    with pytest.raises(go.GradOverrideTypeError, match=(
        r"takes `x` and `w` as positional parameters, .* they name what .* provides\. "
        r"Did you mean `def rule\(g, \*, x, w, output\)`\?"
    )):
        op.backward(rule)
    with pytest.raises(go.GradOverrideTypeError, match=r"Did you mean `lambda g, \*, w: \.\.\.`"):
        go.custom_backward(_mul.__wrapped__, backward=lambda g, w: g)
    residual = go.custom_backward(lambda x: (x, {"n": x.norm()}), residuals="n")
    with pytest.raises(go.GradOverrideTypeError, match=r"Did you mean `lambda g, \*, n: \.\.\.`"):
        residual.backward(lambda g, n: g)


def test_several_upstream_gradients_still_register() -> None:
    @go.custom_backward
    def two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x * 3

    @two.backward
    def _(g1: torch.Tensor, g2: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
        return g1 * 20 + g2 * 30

    x = _leaf(3)
    a, b = two(x)
    (grad,) = torch.autograd.grad((a + b).sum(), x)
    torch.testing.assert_close(grad, torch.full_like(x, 50.0))
