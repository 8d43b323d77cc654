"""Every user mistake raises `go.GradOverrideError` (or its `TypeError` subclass
`go.GradOverrideTypeError`) with a message that names the function, the argument, what was
expected, what was got, and the fix.

The forwards are module-level functions so messages name them plainly (`quantize`, not
`test_x.<locals>.quantize`); each test decorates them afresh, since a rule is registered once.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import gradoverride as go

# ---- forwards ----------------------------------------------------------------------------


def quantize(x, bits=8):
    s = 2**bits
    return torch.round(x * s) / s


def mul(x, w):
    return x * w


def pair(xs):
    return xs[0] * xs[1]


def two_outputs(x):
    return x * 2, x * 3


def normalize(x):
    n = x.norm()
    return x / n, {"norm": n}


def normalize_bare(x):
    return x / x.norm()


def normalize_misnamed(x):
    n = x.norm()
    return x / n, {"nrm": n}


def _x(n=10):
    return torch.linspace(-1.0, 1.0, n).requires_grad_()


def _raises(exc_type, message):
    """`pytest.raises` matching `message` literally (regex characters escaped)."""
    return pytest.raises(exc_type, match=re.escape(message))


def _check_fragments(info, *fragments):
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"


# ---- the error classes --------------------------------------------------------------------


def test_error_classes_are_public_and_typed():
    assert go.GradOverrideError.__module__ == "gradoverride"
    assert go.GradOverrideTypeError.__module__ == "gradoverride"
    assert issubclass(go.GradOverrideError, Exception)
    assert issubclass(go.GradOverrideTypeError, go.GradOverrideError)
    assert issubclass(go.GradOverrideTypeError, TypeError)


# ---- what a rule returns: checked in backward ----------------------------------------------


def test_gradient_of_wrong_shape():
    def rule(grad, *, x):
        return grad[:3]

    op = go.custom_backward(quantize, backward=rule)
    y = op(_x())
    with _raises(
        go.GradOverrideError,
        "backward of `quantize` returned a gradient of shape (3,) for `x`, which has shape (10,)",
    ) as info:
        y.sum().backward()
    _check_fragments(info, "return a gradient of the input's shape")


def test_gradient_of_wrong_shape_with_two_inputs():
    def rule(grad):
        return grad, grad.reshape(2, 5)

    op = go.custom_backward(mul, backward=rule)
    y = op(_x(), _x())
    with _raises(
        go.GradOverrideError,
        "backward of `mul` returned a gradient of shape (2, 5) for `w`, which has shape (10,)",
    ):
        y.sum().backward()


def test_bool_mask_returned_instead_of_gradient():
    def rule(grad, *, x):
        return x.abs() <= 0.5

    op = go.custom_backward(quantize, backward=rule)
    y = op(_x())
    with _raises(
        go.GradOverrideError,
        "backward of `quantize` returned a gradient of dtype torch.bool for `x`, "
        "which has dtype torch.float32",
    ) as info:
        y.sum().backward()
    _check_fragments(info, "`grad * mask`")


def test_integer_gradient_for_float_input():
    def rule(grad):
        return torch.ones(10, dtype=torch.int64)

    op = go.custom_backward(quantize, backward=rule)
    y = op(_x())
    with _raises(
        go.GradOverrideError,
        "backward of `quantize` returned a gradient of dtype torch.int64 for `x`",
    ) as info:
        y.sum().backward()
    _check_fragments(info, "floating-point", ".to(x.dtype)")


def test_gradient_on_another_device():
    def rule(grad):
        return torch.empty(grad.shape, dtype=grad.dtype, device="meta")

    op = go.custom_backward(quantize, backward=rule)
    y = op(_x())
    with _raises(
        go.GradOverrideError,
        "backward of `quantize` returned a gradient on meta for `x`, which is on cpu",
    ) as info:
        y.sum().backward()
    _check_fragments(info, ".to(x.device)")


def test_tuple_with_wrong_number_of_gradients():
    def rule(grad, *, x, w):
        return grad * w, grad * x, None

    op = go.custom_backward(mul, backward=rule)
    y = op(_x(), _x())
    with _raises(
        go.GradOverrideError,
        "backward of `mul` returned 3 gradients, but `mul` has 2 parameters (x, w)",
    ) as info:
        y.sum().backward()
    _check_fragments(info, "one entry per parameter", "dict by parameter name")


def test_float_returned_instead_of_tensor():
    def rule(grad):
        return 1.0

    op = go.custom_backward(quantize, backward=rule)
    y = op(_x())
    with _raises(go.GradOverrideError, "backward of `quantize` returned a float for `x`") as info:
        y.sum().backward()
    _check_fragments(info, "expected a tensor")


def test_numpy_array_returned_instead_of_tensor():
    def rule(grad):
        return np.ones(10, dtype=np.float32)

    op = go.custom_backward(quantize, backward=rule)
    y = op(_x())
    with _raises(go.GradOverrideError, "backward of `quantize` returned a ndarray for `x`") as info:
        y.sum().backward()
    _check_fragments(info, "expected a tensor")


def test_gradient_for_input_the_rule_does_not_own():
    def rule(grad, *, x, w):
        return grad * w, grad * x

    op = go.custom_backward(mul, backward=rule, owns="x")
    y = op(_x(), _x())
    with _raises(
        go.GradOverrideError,
        "backward of `mul` returned a gradient for `w`, which the rule does not own (it owns `x`)",
    ) as info:
        y.sum().backward()
    _check_fragments(info, "return None for `w`", "add it to `owns`")


def test_dict_missing_an_owned_input():
    def rule(grad, *, w):
        return {"x": grad * w}

    op = go.custom_backward(mul, backward=rule)
    y = op(_x(), _x())
    with _raises(
        go.GradOverrideError,
        "backward of `mul` returned a dict without `w`, which it owns",
    ) as info:
        y.sum().backward()
    _check_fragments(info, "{'w': None, ...}", "`owns`")


def test_dict_with_unknown_key_lists_valid_names():
    def rule(grad):
        return {"x": grad, "w": grad, "z": grad}

    op = go.custom_backward(mul, backward=rule)
    y = op(_x(), _x())
    with _raises(
        go.GradOverrideError,
        "backward of `mul` returned a gradient for `z`, which is not a parameter of `mul`",
    ) as info:
        y.sum().backward()
    _check_fragments(info, "`x`", "`w`")


def test_single_tensor_for_two_owned_tensor_inputs():
    def rule(grad):
        return grad

    op = go.custom_backward(mul, backward=rule)
    y = op(_x(), _x())
    with _raises(
        go.GradOverrideError,
        "backward of `mul` returned a single Tensor, but it owns 2 tensor inputs (`x`, `w`)",
    ) as info:
        y.sum().backward()
    _check_fragments(info, "return a tuple", "dict by name")


def test_gradient_for_non_tensor_argument():
    def rule(grad):
        return grad, grad

    op = go.custom_backward(quantize, backward=rule)
    y = op(_x(), 4)
    with _raises(
        go.GradOverrideError,
        "backward of `quantize` returned a gradient for `bits`, which takes no gradient in "
        "this call",
    ) as info:
        y.sum().backward()
    _check_fragments(info, "return None for it")


def test_container_gradient_of_wrong_structure():
    def rule(grad, *, xs):
        return [grad * xs[1], grad * xs[0], grad]

    op = go.custom_backward(pair, backward=rule)
    y = op((_x(), _x()))
    with _raises(go.GradOverrideError, "backward of `pair` returned a gradient for `xs`") as info:
        y.sum().backward()
    _check_fragments(info, "`xs`", "same structure")


# ---- the rule's signature: checked at registration ----------------------------------------


def test_rule_naming_a_parameter_the_forward_lacks():
    def typo_rule(grad, *, y):
        return grad

    op = go.custom_backward(quantize)
    with _raises(go.GradOverrideTypeError, "names `y`, which `quantize` does not have") as info:
        op.backward(typo_rule)
    _check_fragments(info, "typo_rule", "`x`", "`bits`", "`output`", "`needs_grad`")
    assert isinstance(info.value, TypeError)
    # The failed registration leaves the op without a rule.
    assert op.rule is None


def test_rule_without_positional_parameter():
    def no_grad_rule(*, x):
        return x

    op = go.custom_backward(quantize)
    with _raises(
        go.GradOverrideTypeError, "has no positional parameter for the upstream gradient"
    ) as info:
        op.backward(no_grad_rule)
    _check_fragments(info, "no_grad_rule", "`quantize`", "def no_grad_rule(grad, *, ...)")


def test_rule_with_var_keyword():
    def greedy_rule(grad, **kwargs):
        return grad

    op = go.custom_backward(quantize)
    with _raises(go.GradOverrideTypeError, "takes `**kwargs`") as info:
        op.backward(greedy_rule)
    _check_fragments(info, "greedy_rule", "`quantize`", "keyword-only", "def rule(grad, *, x)")


def test_rule_taking_one_grad_for_two_outputs():
    def one_grad_rule(grad, *, x):
        return grad

    op = go.custom_backward(two_outputs, backward=one_grad_rule)
    with _raises(
        go.GradOverrideTypeError,
        "takes 1 upstream gradient(s), but `two_outputs` returned 2 output(s)",
    ) as info:
        op(_x())
    _check_fragments(info, "one_grad_rule", "one positional parameter per output", "*grads")


def test_owns_naming_a_missing_parameter():
    def rule(grad):
        return grad

    op = go.custom_backward(mul)
    with _raises(go.GradOverrideError, "but `mul` has no parameter `y`") as info:
        op.backward(rule, owns="y")
    _check_fragments(info, "owns=('y',)", "`x`", "`w`")


def test_owns_missing_parameter_in_decorator_options():
    def rule(grad):
        return grad

    with _raises(go.GradOverrideError, "but `mul` has no parameter `v`"):
        go.custom_backward(mul, backward=rule, owns=("x", "v"))


def test_owns_not_a_name():
    def rule(grad):
        return grad

    op = go.custom_backward(mul)
    with _raises(go.GradOverrideTypeError, "`owns` must be a name or a tuple of names") as info:
        op.backward(rule, owns=3)
    _check_fragments(info, "`mul`", "got int 3")


def test_rule_not_callable():
    op = go.custom_backward(mul)
    with _raises(go.GradOverrideTypeError, "the backward of `mul` must be a callable"):
        op.backward("not a rule")


def test_second_rule():
    def first(grad):
        return grad, None

    def second(grad):
        return grad, None

    op = go.custom_backward(mul, backward=first)
    with _raises(go.GradOverrideError, "`mul` already has the backward rule") as info:
        op.backward(second)
    _check_fragments(info, "first", "go.custom_backward(mul.__wrapped__, backward=new_rule)")
    assert op.rule is first


def test_call_before_rule():
    op = go.custom_backward(quantize)
    with _raises(go.GradOverrideError, "`quantize` has no backward rule yet") as info:
        op(_x())
    _check_fragments(info, "@quantize.backward")


# ---- residuals ----------------------------------------------------------------------------


def test_residual_forward_returning_bare_output():
    def rule(grad, *, norm):
        return grad / norm

    op = go.custom_backward(normalize_bare, residuals=("norm",), backward=rule)
    with _raises(
        go.GradOverrideError,
        "`normalize_bare` declares residuals=('norm',), so its forward must return "
        "`(output, {'norm': ...})`, got Tensor.",
    ):
        op(_x())


def test_residual_forward_returning_wrong_names():
    def rule(grad, *, norm):
        return grad / norm

    op = go.custom_backward(normalize_misnamed, residuals=("norm",), backward=rule)
    with _raises(
        go.GradOverrideError,
        "the forward of `normalize_misnamed` returned residuals ['nrm'], but it declares "
        "residuals=('norm',)",
    ) as info:
        op(_x())
    _check_fragments(info, "return exactly the declared names")


def test_residual_named_like_a_parameter():
    with _raises(
        go.GradOverrideTypeError, "`normalize` declares a residual `x`, which is also one of"
    ):
        go.custom_backward(normalize, residuals=("x",))


def test_rule_naming_undeclared_residual():
    def rule(grad, *, nrm):
        return grad

    op = go.custom_backward(normalize, residuals=("norm",))
    with _raises(go.GradOverrideTypeError, "names `nrm`, which `normalize` does not have") as info:
        op.backward(rule)
    _check_fragments(info, "`norm`")


# ---- calls --------------------------------------------------------------------------------


def test_call_with_wrong_keyword_argument():
    def rule(grad, *, x):
        return grad

    op = go.custom_backward(quantize, backward=rule)
    with _raises(
        go.GradOverrideTypeError,
        "`quantize` was called with arguments its signature does not take",
    ) as info:
        op(_x(), bitz=4)
    _check_fragments(info, "bitz", "quantize(x, bits=8)")
    assert isinstance(info.value, TypeError)


def test_call_with_too_many_arguments_partial_override():
    def rule(grad):
        return grad

    op = go.custom_backward(mul, backward=rule, owns="x")
    with _raises(
        go.GradOverrideTypeError, "`mul` was called with arguments its signature does not take"
    ) as info:
        op(_x(), _x(), _x())
    _check_fragments(info, "mul(x, w)")


def test_custom_backward_of_non_callable():
    with _raises(
        go.GradOverrideTypeError, "custom_backward needs a forward function to decorate, got int 3"
    ) as info:
        go.custom_backward(3)
    assert isinstance(info.value, TypeError)


def test_module_with_unknown_fixed_argument():
    op = go.custom_backward(quantize)
    with _raises(
        go.GradOverrideTypeError, "`quantize.module()` got `bitz`, which `quantize` does not take"
    ) as info:
        op.module(bitz=4)
    _check_fragments(info, "x, bits")


def test_once_differentiable_second_derivative():
    def rule(grad, *, x):
        return grad * 2 * x

    op = go.custom_backward(quantize, backward=rule, once_differentiable=True)
    x = _x()
    (g,) = torch.autograd.grad(op(x).sum(), x, create_graph=True)
    with _raises(
        go.GradOverrideError,
        "backward of `quantize` runs without recording a graph (once_differentiable=True; "
        "a go.bridge always is)",
    ) as info:
        torch.autograd.grad(g.sum(), x)
    _check_fragments(info, "without once_differentiable")
