"""`gradoverride.testing.check_backward` on JAX arrays.

The gradients it reports are compared with independent ones: `jax.vjp` of a
`jax.custom_vjp` written here by hand, `jax.grad` of the same math, and the upstream
gradient drawn here from the same seeded generator. Then what it must catch (a rule off by
a factor, one that forgets `grad`, a gradient of the wrong shape or dtype, a NaN), finite
differences computed in float64 without changing JAX's global setting, and the messages for
what has no meaning on JAX (torch modules and tensors).

Without JAX the module skips, unless `GRADOVERRIDE_REQUIRE_JAX=1` (set by `.ci/run`),
where a missing JAX is an import error, so CI cannot pass by skipping it.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

if os.environ.get("GRADOVERRIDE_REQUIRE_JAX") == "1":
    import jax
else:
    jax = pytest.importorskip(
        "jax", reason="JAX is not installed (pip install 'gradoverride[jax]')"
    )
import jax.numpy as jnp

import gradoverride as go
from gradoverride import GradOverrideError
from gradoverride.testing import check_backward

X = np.array([-2.0, -1.0, -0.25, 0.0, 0.5, 1.0, 2.0], dtype=np.float32)


# ---- the ops checked, and their independent references ------------------------------------


def fast_sigmoid(x: Any) -> Any:
    """The smooth function the fast-sigmoid surrogate stands for: d/dx = 1 / (1 + |x|)^2."""
    return x / (1 + jnp.abs(x))


@go.custom_backward
def spike(x: Any) -> Any:
    return (x > 0).astype(x.dtype)


@spike.backward
def _(grad: Any, *, x: Any) -> Any:
    return grad / (1 + jnp.abs(x)) ** 2


@go.custom_backward
def spike_doubled(x: Any) -> Any:
    return (x > 0).astype(x.dtype)


@spike_doubled.backward
def _(grad: Any, *, x: Any) -> Any:
    return 2 * grad / (1 + jnp.abs(x)) ** 2  # the bug: off by a factor of 2


@go.custom_backward
def spike_without_grad(x: Any) -> Any:
    return (x > 0).astype(x.dtype)


@spike_without_grad.backward
def _(grad: Any, *, x: Any) -> Any:
    return 1 / (1 + jnp.abs(x)) ** 2  # the bug: `grad *` is missing


def _hand_spike() -> Any:
    """`spike` as a `jax.custom_vjp` written by hand."""

    @jax.custom_vjp
    def f(x: Any) -> Any:
        return (x > 0).astype(x.dtype)

    f.defvjp(lambda x: (f(x), x), lambda x, g: (g / (1 + jnp.abs(x)) ** 2,))
    return f


def _random_upstream(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """The documented default upstream gradient: seeded normal from torch's generator, in
    float64, then the output's dtype."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).numpy().astype(np.float32)


def _vjp(fn: Any, x: Any, upstream: Any) -> np.ndarray:
    _, pullback = jax.vjp(fn, x)
    return np.asarray(pullback(jnp.asarray(upstream))[0])


@go.custom_backward
def softplus(x: Any, beta: float = 1.0) -> Any:
    return jnp.log1p(jnp.exp(beta * x)) / beta


@softplus.backward
def _(grad: Any, *, x: Any, beta: float) -> Any:
    return grad * jax.nn.sigmoid(beta * x)  # the exact derivative


@go.custom_backward
def softplus_scaled(x: Any, beta: float = 1.0) -> Any:
    return jnp.log1p(jnp.exp(beta * x)) / beta


@softplus_scaled.backward
def _(grad: Any, *, x: Any, beta: float) -> Any:
    return grad * beta * jax.nn.sigmoid(beta * x)  # the bug: the factor beta


@go.custom_backward
def mul(a: Any, b: Any) -> Any:
    return a * b


@mul.backward
def _(grad: Any, *, a: Any, b: Any) -> Any:
    return grad * b, grad * a


@go.custom_backward
def mul_swapped(a: Any, b: Any) -> Any:
    return a * b


@mul_swapped.backward
def _(grad: Any, *, a: Any, b: Any) -> Any:
    return grad * a, grad * b  # the bug: each input gets its own value


# ---- a right rule passes, with the gradients of an independent computation -------------------


def test_a_right_rule_passes_with_the_hand_written_custom_vjps_gradient() -> None:
    x = jnp.asarray(X)
    report = check_backward(spike, x, reference=fast_sigmoid)
    assert report.ok and report.mismatches == ()
    upstream = _random_upstream(X.shape)
    hand = _vjp(_hand_spike(), x, upstream)
    np.testing.assert_allclose(np.asarray(report["x"].grad), hand, rtol=1e-6, atol=0)
    # The proxy's gradient, by jax.grad of its own math: upstream * 1 / (1 + |x|)^2.
    proxy = _vjp(fast_sigmoid, x, upstream)
    np.testing.assert_allclose(np.asarray(report["x"].expected), proxy, rtol=1e-6, atol=0)
    assert isinstance(report.grads["x"], jax.Array)
    assert report["x"].difference is not None and report["x"].difference.cosine > 0.999999


def test_the_report_is_the_torch_report() -> None:
    report = check_backward(spike, jnp.asarray(X), reference=fast_sigmoid)
    lines = repr(report).splitlines()
    assert lines[0] == (
        "check_backward(`spike`) against the proxy `fast_sigmoid`, upstream gradient random "
        "normal (seed 0): ok"
    )
    assert lines[1].split() == [
        "input", "grad", "shape", "dtype", "device", "finite", "max", "abs", "diff", "max",
        "rel", "diff", "cosine", "status",
    ]
    cells = lines[2].split()
    assert cells[:3] == ["x", "(7,)", "float32"] and cells[4] == "yes" and cells[-1] == "ok"
    assert cells[3] == str(next(iter(jnp.asarray(X).devices())))


def test_the_same_op_gives_the_same_gradient_as_on_torch() -> None:
    # The rule written once for both frameworks, and the same seeded upstream gradient.
    @go.custom_backward
    def scaled(x: Any) -> Any:
        return x * 3

    @scaled.backward
    def _(grad: Any, *, x: Any) -> Any:
        return grad * x * x

    on_jax = check_backward(scaled, jnp.asarray(X))
    torch_grad = check_backward(scaled, torch.from_numpy(X))["x"].grad
    assert torch_grad is not None
    np.testing.assert_allclose(np.asarray(on_jax["x"].grad), torch_grad.numpy(), rtol=1e-6,
                               atol=0)
    np.testing.assert_allclose(np.asarray(on_jax["x"].grad), _random_upstream(X.shape) * X * X,
                               rtol=1e-6, atol=0)


# ---- a wrong rule is caught ------------------------------------------------------------------


def test_a_rule_off_by_a_factor_fails_naming_the_op_and_the_input() -> None:
    x = jnp.asarray(X)
    with pytest.raises(GradOverrideError) as caught:
        check_backward(spike_doubled, x, reference=fast_sigmoid)
    message = str(caught.value)
    assert message.startswith(
        "check_backward(`spike_doubled`): the gradient for `x` fails: it differs from the "
        "proxy `fast_sigmoid`: the largest difference is "
    )
    assert "Fix the rule's formula for `x`" in message
    assert "MISMATCH in x" in message
    report = check_backward(spike_doubled, x, reference=fast_sigmoid, raise_on_mismatch=False)
    assert not report.ok and report.mismatches == ("x",)
    # What it got is the hand-written rule's gradient doubled: the factor, found.
    hand = _vjp(_hand_spike(), x, _random_upstream(X.shape))
    np.testing.assert_allclose(np.asarray(report["x"].grad), 2 * hand, rtol=1e-6, atol=0)
    # Only the direction: the doubled rule points the same way.
    inf = float("inf")
    assert check_backward(spike_doubled, x, reference=fast_sigmoid, rtol=inf, atol=inf,
                          min_cosine=0.999).ok


def test_a_rule_that_forgets_grad_fails_only_with_a_random_upstream() -> None:
    x = jnp.asarray(X)
    assert check_backward(spike_without_grad, x, reference=fast_sigmoid, grad_outputs="ones").ok
    with pytest.raises(GradOverrideError, match=r"the gradient for `x` fails: it differs from"):
        check_backward(spike_without_grad, x, reference=fast_sigmoid)


def test_given_gradients_from_jax_grad_of_the_same_math() -> None:
    a, b = jnp.asarray([1.0, -2.0, 0.5]), jnp.asarray([3.0, 4.0, -1.0])
    da, db = jax.grad(lambda a, b: (a * b).sum(), argnums=(0, 1))(a, b)
    report = check_backward(mul, a, b, reference={"a": da, "b": db})
    assert report.ok and report.upstream == "ones"
    assert check_backward(mul, a, b, reference=[np.asarray(da), np.asarray(db)]).ok
    with pytest.raises(GradOverrideError) as caught:
        check_backward(mul_swapped, a, b, reference={"a": da, "b": db})
    assert str(caught.value).startswith(
        "check_backward(`mul_swapped`): the gradient for `a` fails (and for `b`): it differs "
        "from the given gradients: "
    )


def test_finite_differences_run_in_float64_and_leave_jax_in_float32() -> None:
    x = jnp.asarray([-1.0, 0.0, 0.5, 2.0])
    assert jnp.zeros(()).dtype == jnp.float32  # JAX's default: 64-bit types disabled
    report = check_backward(functools.partial(softplus, beta=2.0), x,
                            reference="finite_differences")
    assert report.reference == "central finite differences (step 1e-06, float64)"
    difference = report["x"].difference
    # In float32 a step of 1e-6 gives differences of order 1e-2; in float64, the float32
    # rounding of the rule's own gradient only.
    assert difference is not None and difference.max_abs < 1e-6
    upstream = _random_upstream((4,)).astype(np.float64)
    exact = upstream / (1 + np.exp(-2.0 * np.asarray(x, dtype=np.float64)))
    np.testing.assert_allclose(np.asarray(report["x"].expected), exact, rtol=1e-7, atol=1e-9)
    # The float64 was a context, not a change of the user's global setting.
    assert jnp.zeros(()).dtype == jnp.float32
    grad = report["x"].grad
    assert x.dtype == jnp.float32 and grad is not None and grad.dtype == jnp.float32
    with pytest.raises(GradOverrideError) as caught:
        check_backward(functools.partial(softplus_scaled, beta=2.0), x,
                       reference="finite_differences")
    message = str(caught.value)
    assert message.startswith(
        "check_backward(`softplus_scaled`): the gradient for `x` fails: it differs from "
        "central finite differences (step 1e-06, float64): "
    )
    assert "atol=1e-05 + rtol=0.001 * |expected|" in message
    assert "Finite differences need a smooth forward" in message


@go.custom_backward
def doubled(x: Any) -> Any:
    return x * 2


@doubled.backward
def _(grad: Any, *, x: Any) -> Any:
    return grad[:2]  # the bug: the wrong shape


def test_a_gradient_of_the_wrong_shape_from_the_rule_is_named() -> None:
    with pytest.raises(GradOverrideError) as caught:
        check_backward(doubled, jnp.ones(3))
    assert str(caught.value).startswith(
        "backward of `doubled` returned a gradient of shape (2,) for `x`, which has shape (3,)"
    )
    assert caught.value.__notes__ == [
        "(raised in the backward of `doubled` run by check_backward)"
    ]


@jax.custom_vjp
def halved(x: Any) -> Any:
    return x / 2


halved.defvjp(lambda x: (x / 2, None), lambda _, g: ((g / 2).astype(jnp.float16),))


def test_a_gradient_of_the_wrong_dtype_from_a_plain_custom_vjp_fails_its_row() -> None:
    # JAX lets a custom_vjp's rule return another float dtype; the check does not.
    with pytest.raises(GradOverrideError) as caught:
        check_backward(halved, jnp.ones(3))
    assert str(caught.value).startswith(
        "check_backward(`halved`): the gradient for `x` fails: its gradient has dtype "
        "float16, but `x` has dtype float32. Make the rule return a gradient of `x`'s shape "
        "and dtype."
    )


@go.custom_backward
def log_abs(x: Any) -> Any:
    return jnp.log(jnp.abs(x))


@log_abs.backward
def _(grad: Any, *, x: Any) -> Any:
    return grad / x  # infinite at 0


def test_a_nonfinite_gradient_fails_unless_allowed() -> None:
    x = jnp.asarray([-1.0, 0.0, 2.0])
    with pytest.raises(GradOverrideError) as caught:
        check_backward(log_abs, x, grad_outputs="ones")
    message = str(caught.value)
    assert message.startswith(
        "check_backward(`log_abs`): the gradient for `x` fails: its gradient is not finite: "
        "1 of 3 values are NaN or infinite (the first at index (1,): inf)."
    )
    assert "(`jnp.where`, `jnp.clip`)" in message
    report = check_backward(log_abs, x, grad_outputs="ones", allow_nonfinite=True)
    assert report.ok and not report["x"].finite


class Pair(NamedTuple):
    a: Any
    b: Any


def test_inputs_in_containers_are_named_and_integers_left_alone() -> None:
    @go.custom_backward
    def weighted(xs: Any, index: Any, scale: float = 1.0) -> Any:
        return xs[0] * xs[1][index] * scale

    @weighted.backward
    def _(grad: Any, *, xs: Any, index: Any, scale: float) -> Any:
        dxs = [grad * xs[1][index] * scale,
               jnp.zeros_like(xs[1]).at[index].add(grad * xs[0] * scale)]
        return dxs, None, None  # no gradient for the index and the number

    xs = [jnp.asarray([1.0, 2.0]), jnp.asarray([3.0, 4.0, 5.0])]
    index = jnp.asarray([2, 0])
    fn = functools.partial(weighted, scale=3.0)
    report = check_backward(fn, xs, index, reference="finite_differences")
    assert [row.name for row in report] == ["xs[0]", "xs[1]"]
    expected = jax.grad(lambda xs: (xs[0] * xs[1][index] * 3.0 * jnp.asarray(
        _random_upstream((2,)))).sum())(xs)
    np.testing.assert_allclose(np.asarray(report["xs[1]"].grad), np.asarray(expected[1]),
                               rtol=1e-6, atol=0)
    pair = Pair(jnp.asarray([1.0]), jnp.asarray([2.0]))
    report = check_backward(lambda p: mul(p.a, p.b), pair, reference="finite_differences")
    assert [row.name for row in report] == ["p[0]", "p[1]"]


def test_given_upstream_gradients_and_their_mistakes() -> None:
    x = jnp.asarray(X)
    upstream = jnp.linspace(-1.0, 1.0, 7)
    report = check_backward(spike, x, reference=fast_sigmoid, grad_outputs=upstream)
    hand = _vjp(_hand_spike(), x, upstream)
    np.testing.assert_allclose(np.asarray(report["x"].grad), hand, rtol=1e-6, atol=0)
    assert report.upstream == "given"
    with pytest.raises(GradOverrideError, match=(
        r"^`grad_outputs` for `output` of `spike` has shape \(3,\), but `output` has shape "
        r"\(7,\); pass an upstream gradient of the output's shape\.$"
    )):
        check_backward(spike, x, grad_outputs=jnp.ones(3))
    with pytest.raises(GradOverrideError, match=r"must be 'random', 'ones', an array or one"):
        check_backward(spike, x, grad_outputs="zeros")  # type: ignore[arg-type]


def test_a_proxy_of_another_shape_and_an_unknown_reference() -> None:
    x = jnp.asarray(X)
    with pytest.raises(GradOverrideError, match=(
        r"^check_backward\(`spike`\): the proxy `.*<lambda>` returned outputs of shapes "
        r"\[\(\)\], but `spike` returned \[\(7,\)\]"
    )):
        check_backward(spike, x, reference=lambda x: fast_sigmoid(x).sum())
    with pytest.raises(GradOverrideError, match=r"unknown reference 'finite_difference'"):
        check_backward(spike, x, reference="finite_difference")  # type: ignore[arg-type]
    with pytest.raises(GradOverrideError, match=(
        r"the reference gradient for `x` has shape \(2,\), but `x` has shape \(7,\)"
    )):
        check_backward(spike, x, reference=jnp.ones(2))


# ---- what has no meaning on JAX ----------------------------------------------------------------


def torch_tanh(x: Any) -> Any:
    return torch.tanh(torch.ones(x.shape))  # a proxy written in torch ops


def test_torch_values_with_jax_inputs_are_refused_naming_the_option() -> None:
    x = jnp.asarray(X)
    with pytest.raises(GradOverrideError, match=(
        r"^check_backward\(`mul`\): the input `b` is a torch tensor, but the inputs are JAX "
        r"arrays, so the check runs on JAX; pass every input as a JAX array"
    )):
        check_backward(mul, x, torch.from_numpy(X))
    with pytest.raises(GradOverrideError, match=(
        r"^check_backward\(`spike`\): `grad_outputs` is a torch tensor, but the inputs are JAX "
        r"arrays, so the check runs on JAX; pass the upstream gradients as JAX or numpy"
    )):
        check_backward(spike, x, grad_outputs=torch.ones(7))
    with pytest.raises(GradOverrideError, match=(
        r"^check_backward\(`spike`\): the reference gradient for `x` is a torch tensor, but "
        r"the inputs are JAX arrays"
    )):
        check_backward(spike, x, reference=torch.ones(7))
    with pytest.raises(GradOverrideError, match=(
        r"^`torch_tanh` returned a torch tensor at `output` for JAX inputs; a function checked on "
        r"JAX arrays \(and a proxy\) must compute with JAX \(`jnp`\) ops\.$"
    )):
        check_backward(spike, x, reference=torch_tanh)


def count_positive(x: Any) -> Any:
    return (x > 0).sum()


def test_a_function_returning_no_floating_point_array_is_refused() -> None:
    with pytest.raises(GradOverrideError, match=(
        r"^`count_positive` returned an array of dtype int32, which holds no floating-point "
        r"array to take a gradient of; the function checked must return an array, or a "
        r"tuple, list or dict of arrays\.$"
    )):
        check_backward(count_positive, jnp.asarray(X))


def test_a_torch_module_with_jax_inputs_is_refused() -> None:
    layer = torch.nn.Linear(7, 7)
    with pytest.raises(GradOverrideError, match=(
        r"^check_backward\(`Linear\(in_features=7, out_features=7, bias=True\)`\): `fn` is a "
        r"torch module, but the inputs are JAX arrays; "
        r"a module's parameters are torch tensors, which JAX cannot differentiate\."
    )):
        check_backward(layer, jnp.asarray(X))


def test_torch_checks_never_import_jax() -> None:
    # `import gradoverride.testing` and a check on torch tensors load neither JAX nor the
    # JAX checker: only a JAX array among the inputs does.
    code = """
import json, sys
import torch
import gradoverride as go
from gradoverride.testing import check_backward

@go.custom_backward
def spike(x):
    return (x > 0).to(x.dtype)

@spike.backward
def _(grad, *, x):
    return grad / (1 + x.abs()) ** 2

check_backward(spike, torch.linspace(-2, 2, 9), reference=lambda x: x / (1 + x.abs()))
print(json.dumps(sorted(m for m in ("jax", "jaxlib", "gradoverride.testing._jax_check")
                        if m in sys.modules)))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=300)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
