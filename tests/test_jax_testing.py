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

import dataclasses
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


# ---- finite differences that cannot be trusted, pytrees, numpy inputs, options ---------------


def dropout_sin(x: Any) -> Any:
    """A fixed dropout mask: `jax.random` draws another one in float64."""
    return jnp.where(jax.random.bernoulli(jax.random.PRNGKey(0), 0.5, x.shape),
                     jnp.sin(x) * 2, 0.0)


def test_a_forward_drawing_other_random_numbers_in_float64_is_named() -> None:
    x = jnp.linspace(-1.0, 1.0, 8)
    with jax.enable_x64(True):  # independently: the float64 run keeps other elements
        wide = np.asarray(dropout_sin(jnp.asarray(np.asarray(x), dtype=jnp.float64)))
    narrow = np.asarray(dropout_sin(x))
    assert ((wide == 0) != (narrow == 0)).any()
    with pytest.raises(GradOverrideError) as caught:
        check_backward(dropout_sin, x, reference="finite_differences")
    message = str(caught.value)
    first = int(np.argmax((wide == 0) != (narrow == 0)))
    assert message.startswith(
        "check_backward(`dropout_sin`): finite differences run `dropout_sin` on float64 "
        "copies of its inputs (inside `jax.enable_x64(True)`), but there it is not the same "
        f"function: at the unperturbed inputs its `output` differs at index ({first},): "
        f"{wide[first]:.6g} in float64 against {narrow[first]:.6g} in float32, beyond "
        "float32's precision (tolerance 0.00035). Random draws (`jax.random` gives other "
        "numbers in float64) or code that depends on the dtype make it so. Check the rule "
        "against a proxy function, or against the expected gradients given as arrays, "
        "instead of 'finite_differences'."
    )


KERNEL = np.asarray([[[1.0, -2.0, 0.5]]], dtype=np.float32)


def conv(x: Any) -> Any:
    """A convolution with a float32 kernel it closes over."""
    return jax.lax.conv(x, jnp.asarray(KERNEL), (1,), "SAME")


def test_an_error_in_the_float64_run_names_that_run() -> None:
    kernel = jnp.asarray(KERNEL)
    x = jnp.asarray(np.linspace(-1.0, 1.0, 5, dtype=np.float32).reshape(1, 1, 5))
    with pytest.raises(GradOverrideError) as caught:
        check_backward(conv, x, reference="finite_differences")
    assert isinstance(caught.value.__cause__, TypeError)
    message = str(caught.value)
    assert message.startswith(
        "check_backward(`conv`): `conv` raised TypeError in the float64 run of finite "
        "differences (its inputs as float64 copies, inside `jax.enable_x64(True)`), not in "
        "its own dtype: "
    )
    assert message.endswith(
        "An op that needs matching dtypes (`jax.lax.conv`, `jnp.dot` with "
        "preferred_element_type) fails there against an array the function closes over, "
        "which stays in its dtype: pass such arrays as inputs (they are then converted "
        "too), or check against a proxy function instead of 'finite_differences'."
    )
    # The fix it names: the kernel as an input, converted to float64 with x.
    report = check_backward(lambda x, k: jax.lax.conv(x, k, (1,), "SAME"), x, kernel,
                            reference="finite_differences")
    assert report.ok and [row.name for row in report] == ["x", "k"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w"], meta_fields=["n"])
@dataclasses.dataclass
class Weights:
    w: Any
    n: int


@jax.tree_util.register_pytree_node_class
class Holder:
    def __init__(self, a: Any) -> None:
        self.a = a

    def tree_flatten(self) -> tuple[tuple[Any], None]:
        return (self.a,), None

    @classmethod
    def tree_unflatten(cls, _aux: None, children: tuple[Any]) -> Holder:
        return cls(*children)


def test_arrays_in_registered_pytrees_are_checked_and_named_by_their_path() -> None:
    x = jnp.asarray(X)
    upstream = _random_upstream(X.shape)
    want = _vjp(fast_sigmoid, x, upstream)  # what the right rule gives
    for value, name, unwrap in [
        (Weights(x, 3), "d.w", lambda d: d.w),
        (Holder(x), "d[<flat index 0>]", lambda d: d.a),
        ({"k": Weights(x, 1)}, "d['k'].w", lambda d: d["k"].w),
    ]:
        def right(d: Any, unwrap: Any = unwrap) -> Any:
            return spike(unwrap(d))

        def wrong(d: Any, unwrap: Any = unwrap) -> Any:
            return spike_doubled(unwrap(d))

        def proxy(d: Any, unwrap: Any = unwrap) -> Any:
            return fast_sigmoid(unwrap(d))

        # The pytree alone: checked on JAX, not refused by the torch path.
        report = check_backward(right, value, reference=proxy)
        assert [row.name for row in report] == [name]
        np.testing.assert_allclose(np.asarray(report[name].grad), want, rtol=1e-6)
        with pytest.raises(GradOverrideError) as caught:
            check_backward(wrong, value, reference=proxy)
        assert f"`): the gradient for `{name}` fails: it differs from the proxy " in str(
            caught.value)
    # Next to another JAX input, the one in the pytree is checked too.
    report = check_backward(lambda y, d: mul_swapped(y, d.w), x, Weights(x * 2, 0),
                            reference="finite_differences", raise_on_mismatch=False)
    assert report.mismatches == ("y", "d.w")


def with_numpy(a: Any, b: Any) -> Any:
    """Computes with numpy on `b`, which JAX cannot trace."""
    return a * jnp.asarray(np.sin(b))


def test_float_numpy_inputs_next_to_jax_ones_are_differentiated() -> None:
    a = jnp.asarray([1.0, -2.0, 3.0])
    b = np.asarray([0.5, 4.0, -1.0], dtype=np.float32)
    report = check_backward(mul, a, b)
    upstream = _random_upstream((3,))
    np.testing.assert_allclose(np.asarray(report["b"].grad), upstream * np.asarray(a),
                               rtol=1e-6)
    with pytest.raises(GradOverrideError) as caught:
        check_backward(mul_swapped, a, b, reference=lambda a, b: a * b)
    assert str(caught.value).startswith(
        "check_backward(`mul_swapped`): the gradient for `a` fails (and for `b`): "
    )

    with pytest.raises(GradOverrideError) as caught:
        check_backward(with_numpy, a, b)
    assert isinstance(caught.value.__cause__, jax.errors.TracerArrayConversionError)
    assert str(caught.value) == (
        "check_backward(`with_numpy`): the numpy input(s) `b` are differentiated as JAX "
        "arrays (given with JAX inputs, a floating-point numpy array is checked too), but "
        "`with_numpy` converts one back to numpy, which JAX cannot differentiate. Compute "
        "with `jnp` ops, or, to keep a numpy array a constant, bind it with "
        "`functools.partial` or a closure instead of passing it as an input."
    )
    # numpy inputs alone go to torch, which says what to pass.
    with pytest.raises(GradOverrideError, match=r"numpy arrays are not differentiated: pass "
                       r"torch tensors \(`torch.from_numpy\(a\)`\), or JAX arrays"):
        check_backward(jnp.sin, np.asarray([1.0, 2.0]))


def test_options_that_cannot_mean_anything_are_refused_on_jax() -> None:
    x = jnp.asarray(X)
    with pytest.raises(GradOverrideError, match=r"^check_backward\(`spike`\): `step` must be "
                       r"a finite number greater than 0 .*, got 0\.0; pass e\.g\. `step=1e-6`\.$"):
        check_backward(spike, x, reference="finite_differences", step=0.0)
    with pytest.raises(GradOverrideError) as caught:
        check_backward(spike, x, grad_outputs=1.0)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "`grad_outputs` for `spike` must be 'random', 'ones', an array (one output) or a "
        "sequence of one array per output, got float 1.0; for an upstream gradient of ones "
        "pass 'ones', for another value an array in the output's shape "
        "(`jnp.full_like(output, value)`)."
    )
    with pytest.raises(GradOverrideError, match=r"^check_backward\(`spike`\): the reference "
                       r"is given as gradients, but `grad_outputs='random'`"):
        check_backward(spike, x, reference=np.ones(7, np.float32), grad_outputs="random")
    with pytest.raises(GradOverrideError) as caught:
        check_backward(functools.partial(softplus_scaled, beta=2.0), jnp.asarray([0.5]),
                       reference="finite_differences")
    assert "try another `step=`." in str(caught.value)


def test_infinite_tolerances_and_infinite_gradients_on_jax() -> None:
    x = jnp.asarray([-1.0, 0.0, 1.0])
    want = np.asarray([0.5, 0.0, 0.5], dtype=np.float32)
    got = 1 / (1 + np.abs(np.asarray(x))) ** 2
    cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    report = check_backward(spike, x, reference=want, rtol=float("inf"), atol=float("inf"),
                            min_cosine=0.3)
    difference = report["x"].difference
    assert report.ok and difference is not None
    assert difference.cosine == pytest.approx(cosine, rel=1e-6)
    x = jnp.asarray([-1.0, 0.0, 2.0])
    right = np.asarray([-1.0, np.inf, 0.5], dtype=np.float32)
    report = check_backward(log_abs, x, reference=right, allow_nonfinite=True)
    difference = report["x"].difference
    assert report.ok and difference is not None and difference.max_abs == 0.0
    with pytest.raises(GradOverrideError) as caught:
        check_backward(log_abs, x, reference=np.asarray([-2.0, np.inf, 0.5], np.float32),
                       allow_nonfinite=True)
    message = str(caught.value)
    assert "the largest difference is 1 at index (0,) (got -1, expected -2)" in message
    assert "allow_nonfinite" not in message


def test_dict_outputs_of_the_function_and_the_proxy_pair_by_key() -> None:
    x = jnp.asarray(X)

    def fn(x: Any) -> Any:
        return {"spike": spike(x), "double": 2 * x}

    def proxy(x: Any) -> Any:
        return {"double": 2 * x, "spike": fast_sigmoid(x)}

    report = check_backward(fn, x, reference=proxy)
    assert report.ok
    # The upstream gradients are drawn in JAX's order of the outputs: keys sorted.
    gen = torch.Generator().manual_seed(0)
    up_double, up_spike = (torch.randn(7, generator=gen, dtype=torch.float64).numpy()
                           for _ in range(2))
    expected = up_spike / (1 + np.abs(X)) ** 2 + 2 * up_double
    np.testing.assert_allclose(np.asarray(report["x"].expected), expected, rtol=1e-6)
