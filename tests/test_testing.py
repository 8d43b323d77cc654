"""`gradoverride.testing`: `check_backward` and `assert_consistent` catch real mistakes in
rules (a wrong shape, a surrogate that is not its proxy's derivative, a rule that breaks
under compile or vmap) and pass correct ones."""

from __future__ import annotations

import functools
import math
import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import given
from ops import pair_product, quantize, scale, sin_cos

import gradoverride as go
from gradoverride.testing import BackwardReport, assert_consistent, check_backward
from gradoverride.testing import strategies as gst

X = torch.linspace(-2.0, 2.0, 9)


# ---- rules under test ---------------------------------------------------------------------


def fast_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The smooth function the spike's surrogate stands for: its derivative is 1/(1+|x|)^2."""
    return x / (1 + x.abs())


@go.custom_backward
def spike(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)


@spike.backward
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad / (1 + x.abs()) ** 2


@go.custom_backward
def spike_wrong_formula(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)


@spike_wrong_formula.backward
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad / (1 + x.abs())  # the square is missing


@go.custom_backward
def spike_forgets_grad(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)


@spike_forgets_grad.backward
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return (1 + x.abs()) ** -2  # right for an upstream gradient of ones only


@go.custom_backward
def wrong_shape(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@wrong_shape.backward
def _(grad: torch.Tensor) -> torch.Tensor:
    return grad[:3]


@go.custom_backward
def log_abs(x: torch.Tensor) -> torch.Tensor:
    return x.abs().log()


@log_abs.backward
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad / x  # infinite at 0


@go.custom_backward
def branches_on_value(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@branches_on_value.backward
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:  # a Python `if` on a tensor's value: a graph break, and fails under vmap
        return grad * 2
    return grad * 2


@go.custom_backward
def calls_item(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@calls_item.backward
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad * (x.abs().max().item() > 0) * 2


@go.custom_backward
def calls_numpy(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@calls_numpy.backward
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(grad.numpy() * 2)


@go.custom_backward
def differs_when_compiled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@differs_when_compiled.backward
def _(grad: torch.Tensor) -> torch.Tensor:
    # Stands for a rule that compile drops or traces differently.
    return grad * (3 if torch.compiler.is_compiling() else 2)


# ---- check_backward: passes correct rules --------------------------------------------------


def test_surrogate_matching_its_proxy_passes_and_reports() -> None:
    report = check_backward(spike, X, reference=fast_sigmoid)
    assert isinstance(report, BackwardReport)
    assert report.ok
    assert report.mismatches == ()
    row = report["x"]
    assert row.ok and row.finite
    assert row.grad is not None and row.grad.shape == X.shape and row.grad.dtype == X.dtype
    assert row.difference is not None
    assert row.difference.cosine == pytest.approx(1.0)
    assert row.difference.max_abs <= 1e-6
    text = repr(report)
    assert "check_backward(`spike`) against the proxy `fast_sigmoid`" in text
    assert "random normal (seed 0): ok" in text
    lines = text.splitlines()
    assert lines[1].split() == [
        *("input", "grad", "shape", "dtype", "device", "finite"),
        *("max", "abs", "diff", "max", "rel", "diff", "cosine", "status"),
    ]
    assert lines[2].split()[:5] == ["x", "(9,)", "float32", "cpu", "yes"]
    assert lines[2].split()[-1] == "ok"


def test_without_reference_reports_shape_dtype_device_finite() -> None:
    report = check_backward(quantize, X)
    assert repr(report).splitlines()[1].split() == [
        *("input", "grad", "shape", "dtype", "device", "finite", "status"),
    ]
    assert repr(report).splitlines()[2].split() == ["x", "(9,)", "float32", "cpu", "yes", "ok"]
    torch.testing.assert_close(report.grads["x"], report["x"].grad)


def test_inputs_are_named_by_the_signature() -> None:
    a, b = X, X.flip(0)
    assert [r.name for r in check_backward(scale, a, b)] == ["x", "w"]
    assert [r.name for r in check_backward(pair_product, (a, b))] == ["xs[0]", "xs[1]"]

    def star(first: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return first * rest[0] * rest[1]

    assert [r.name for r in check_backward(star, a, b, a)] == ["first", "rest[0]", "rest[1]"]
    mapping = check_backward(lambda d, k: d["w"] * k, {"w": a}, 3)  # 3: not differentiated
    assert [r.name for r in mapping] == ["d['w']"]
    # an op over a builtin: the names come from the op's `.parameters`
    sign = go.custom_backward(torch.sign, backward=lambda grad: grad)
    assert [r.name for r in check_backward(sign, a)] == ["input"]
    bits4 = functools.partial(quantize, bits=4)
    assert [r.name for r in check_backward(bits4, a)] == ["x"]


def test_inputs_are_not_modified_and_get_no_grad() -> None:
    x = X.clone().requires_grad_()
    check_backward(spike, x, reference=fast_sigmoid)
    assert x.grad is None
    torch.testing.assert_close(x.detach(), X)


def test_finite_differences_pass_an_exact_rule() -> None:
    @go.custom_backward
    def cube(x: torch.Tensor) -> torch.Tensor:
        return x**3

    @cube.backward
    def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
        return 3 * x * x * grad

    report = check_backward(cube, X.double(), reference="finite_differences")
    assert report.ok
    assert report.reference is not None and "finite differences" in report.reference
    assert check_backward(cube, X, reference="finite_differences").ok  # float32 input


def test_given_gradients_by_name_sequence_and_tensor() -> None:
    x, w = X, X.flip(0) + 3
    # the gradients of `scale(x, w).sum()`: the rule doubles `x`'s, `w` keeps autograd's
    assert check_backward(scale, x, w, reference={"x": 2 * w, "w": x}).ok
    assert check_backward(scale, x, w, reference=[2 * w, x]).ok
    assert check_backward(scale, x, w, reference={"w": x}).ok  # `x` not compared
    assert check_backward(quantize, x, reference=(x.abs() <= 1).float()).ok


def test_gradients_that_do_not_flow_are_reported_as_none() -> None:
    @go.custom_backward
    def first_only(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    @first_only.backward
    def _(grad: torch.Tensor, *, w: torch.Tensor) -> Any:
        return grad * w, None

    report = check_backward(first_only, X, X, reference={"x": X, "w": None})
    assert report["w"].grad is None
    assert "no gradient" in repr(report)


def test_several_outputs_each_get_an_upstream_gradient() -> None:
    @go.custom_backward
    def exact_sin_cos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin(), x.cos()

    @exact_sin_cos.backward
    def _(g_sin: torch.Tensor, g_cos: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
        return g_sin * x.cos() - g_cos * x.sin()

    def proxy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin(), x.cos()

    assert check_backward(exact_sin_cos, X, reference=proxy).ok

    # `sin_cos`'s rule adds 0.5 whatever the upstream gradients: with ones it looks like the
    # gradient of (sin x + x / 2, cos x), with random ones it is no gradient of anything.
    def shifted(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin() + 0.5 * x, x.cos()

    assert check_backward(sin_cos, X, reference=shifted, grad_outputs="ones").ok
    with pytest.raises(go.GradOverrideError, match="the gradient for `x` fails: it differs"):
        check_backward(sin_cos, X, reference=shifted)


def test_min_cosine_checks_only_the_direction() -> None:
    @go.custom_backward
    def scaled_spike(x: torch.Tensor) -> torch.Tensor:
        return (x > 0).to(x.dtype)

    @scaled_spike.backward
    def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
        return 4 * grad / (1 + x.abs()) ** 2  # the right direction, four times longer

    direction_only: dict[str, Any] = {
        "rtol": float("inf"),
        "atol": float("inf"),
        "min_cosine": 0.999,
    }
    report = check_backward(scaled_spike, X, reference=fast_sigmoid, **direction_only)
    assert report.ok
    with pytest.raises(go.GradOverrideError, match=r"cosine similarity .* below min_cosine"):
        check_backward(spike_wrong_formula, X, reference=fast_sigmoid, **direction_only)


@go.custom_backward
def exact_sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@exact_sin.backward
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad * x.cos()


@given(x=gst.tensors())
def test_exact_rule_passes_for_any_shape_dtype_and_layout(x: torch.Tensor) -> None:
    """0-d, empty and non-contiguous inputs in every floating dtype, against autograd of sin."""
    report = check_backward(exact_sin, x, reference=torch.sin)
    row = report["x"]
    assert row.grad is not None
    assert (row.grad.shape, row.grad.dtype) == (x.shape, x.dtype)
    assert_consistent(exact_sin, x, modes=("vmap",))


def test_tools_on_each_device(device: torch.device) -> None:
    x = X.to(device)
    report = check_backward(spike, x, reference=fast_sigmoid)
    assert report["x"].grad is not None and report["x"].grad.device == x.device
    assert str(x.device) in repr(report).splitlines()[2].split()
    assert check_backward(exact_sin, x.double(), reference="finite_differences").ok
    assert_consistent(scale, x, x.flip(0), modes=("vmap",))


# ---- check_backward: catches mistakes ------------------------------------------------------


def test_surrogate_whose_formula_differs_from_its_proxy_fails() -> None:
    with pytest.raises(
        go.GradOverrideError,
        match=(
            r"check_backward\(`spike_wrong_formula`\): the gradient for `x` fails: it differs "
            r"from the proxy `fast_sigmoid`: the largest difference is .* Fix the rule's "
            r"formula for `x`"
        ),
    ) as info:
        check_backward(spike_wrong_formula, X, reference=fast_sigmoid)
    assert "MISMATCH" in str(info.value)  # the report is in the message


def test_report_only() -> None:
    report = check_backward(spike_wrong_formula, X, reference=fast_sigmoid, raise_on_mismatch=False)
    assert not report.ok
    assert report.mismatches == ("x",)
    assert report["x"].difference is not None and not report["x"].difference.close
    assert "MISMATCH in x" in repr(report)
    assert "`x`: it differs from the proxy `fast_sigmoid`" in repr(report)


def test_random_upstream_catches_a_rule_that_forgets_grad() -> None:
    # With an upstream gradient of ones the mistake is invisible ...
    assert check_backward(spike_forgets_grad, X, reference=fast_sigmoid, grad_outputs="ones").ok
    # ... the default random upstream gradient shows it.
    with pytest.raises(go.GradOverrideError, match="the gradient for `x` fails: it differs"):
        check_backward(spike_forgets_grad, X, reference=fast_sigmoid)


def test_wrong_shaped_gradient_fails_naming_the_input() -> None:
    with pytest.raises(
        go.GradOverrideError,
        match=r"backward of `wrong_shape` returned a gradient of shape \(3,\) for `x`, which "
        r"has shape \(9,\)",
    ) as info:
        check_backward(wrong_shape, X)
    assert any("check_backward" in note for note in info.value.__notes__)


def test_finite_differences_catch_a_wrong_exact_rule() -> None:
    with pytest.raises(
        go.GradOverrideError,
        match=r"the gradient for `x` fails: it differs from central finite differences .*"
        r"Finite differences need a smooth forward",
    ):
        check_backward(sin_cos, X.double(), reference="finite_differences")


def test_given_gradient_that_differs_names_the_input() -> None:
    x, w = X, X.flip(0) + 3
    with pytest.raises(go.GradOverrideError, match=r"the gradient for `w` fails: it differs"):
        check_backward(scale, x, w, reference={"x": 2 * w, "w": 2 * x})
    with pytest.raises(go.GradOverrideError, match=r"the gradient for `x` fails \(and for `w`\)"):
        check_backward(scale, x, w, reference={"x": w, "w": 2 * x})


def test_nonfinite_gradient_fails_unless_allowed() -> None:
    with pytest.raises(
        go.GradOverrideError,
        match=r"the gradient for `x` fails: its gradient is not finite: 1 of 9 values are NaN "
        r"or infinite \(the first at index \(4,\): -?inf\)\. Make the rule safe",
    ):
        check_backward(log_abs, X)
    report = check_backward(log_abs, X, allow_nonfinite=True)
    assert report.ok and not report["x"].finite
    assert "NO" in repr(report).splitlines()[2].split()


@pytest.mark.parametrize(
    ("fn", "reference", "message"),
    [
        (quantize, "finite_diff", r"unknown reference 'finite_diff'; the string reference is "),
        (quantize, torch.zeros(3), r"gradient for `x` has shape \(3,\), but `x` has shape \(9,"),
        (scale, {"y": X}, r"the reference names `y`, which is not an input of `scale`"),
        (scale, [X], r"the reference has 1 gradient\(s\), but `scale` has 2 inputs"),
        (scale, X, r"the reference is one tensor, but `scale` has 2 inputs to differentiate"),
        (scale, lambda x, w: (x * w)[:2], r"the proxy `.*<lambda>` returned outputs of shapes"),
        (scale, 3, r"`reference` must be a proxy function, 'finite_differences', or the"),
    ],
    ids=["string", "shape", "name", "count", "tensor", "proxy_shape", "type"],
)
def test_reference_misuse_is_explained(fn: Any, reference: Any, message: str) -> None:
    inputs = (X,) if fn is quantize else (X, X)
    with pytest.raises(go.GradOverrideError, match=message):
        check_backward(fn, *inputs, reference=reference)


def test_nothing_to_differentiate_is_explained() -> None:
    with pytest.raises(go.GradOverrideError, match="was given no floating-point tensor"):
        check_backward(lambda n: torch.ones(n), 3)
    with pytest.raises(go.GradOverrideError, match=r"no output of `.*` requires grad"):
        check_backward(lambda x: x.detach(), X)
    with pytest.raises(go.GradOverrideError, match=r"`grad_outputs` for `output` of .* shape"):
        check_backward(spike, X, grad_outputs=torch.ones(2))


# ---- assert_consistent ---------------------------------------------------------------------


@pytest.mark.compile
def test_consistent_rule_passes_every_mode() -> None:
    assert_consistent(spike, X)  # eager, compile (aot_eager), vmap


def test_consistent_under_vmap_with_containers_partial_and_several_outputs() -> None:
    assert_consistent(scale, X, X.flip(0) + 1, modes=("vmap",))
    assert_consistent(pair_product, (X, X + 1), modes=("vmap",))
    assert_consistent(sin_cos, X, modes=("vmap",))
    samples = [(X + k,) for k in range(3)]
    assert_consistent(quantize, X, modes=("vmap",), samples=samples)


@pytest.mark.compile
def test_graph_break_under_compile_is_reported() -> None:
    with pytest.raises(
        go.GradOverrideError,
        match=r"`branches_on_value` does not compile under torch\.compile\(fullgraph=True, "
        r"backend='aot_eager'\): the forward or its backward rule has a graph break: "
        r"Data-dependent branching\. It is at .*test_testing\.py.*: `if x\.sum\(\) > 0:",
    ):
        assert_consistent(branches_on_value, X, modes=("compile",))


@pytest.mark.compile
def test_gradient_that_differs_under_compile_is_reported() -> None:
    with pytest.raises(
        go.GradOverrideError,
        match=r"under torch\.compile\(fullgraph=True, backend='aot_eager'\), the gradient for "
        r"`x` differs from eager mode: the largest difference is",
    ):
        assert_consistent(differs_when_compiled, X, modes=("compile",))


@pytest.mark.parametrize(
    ("op", "message"),
    [
        (calls_item, r"RuntimeError: vmap: It looks like you're calling \.item\(\)"),
        (calls_numpy, r"RuntimeError: Cannot access data pointer"),
        (branches_on_value, r"RuntimeError: vmap: .* data-dependent control flow"),
    ],
    ids=["item", "numpy", "if"],
)
def test_rule_that_breaks_under_vmap_is_reported(op: Any, message: str) -> None:
    check_backward(op, X)  # fine in eager mode
    with pytest.raises(
        go.GradOverrideError,
        match=rf"runs in eager mode but raises under torch\.func\.vmap \(over a batch of 2 "
        rf"samples stacked along a new dim 0\): {message}",
    ):
        assert_consistent(op, X, modes=("vmap",))


class _FirstSampleOnly(torch.autograd.Function):
    """A hand-written vmap rule with a bug: every sample gets the first sample's output."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2

    @staticmethod
    def vmap(info: Any, in_dims: Any, x: torch.Tensor) -> Any:
        x = x.movedim(in_dims[0], 0)
        return _FirstSampleOnly.apply(x[:1].expand_as(x)), 0


def test_wrong_batching_is_reported_naming_the_sample() -> None:
    def doubled(x: torch.Tensor) -> Any:
        return _FirstSampleOnly.apply(x)

    # identical samples cannot show it; the default batch (inputs, then flipped) does
    assert_consistent(doubled, X, modes=("vmap",), samples=[(X,), (X,)])
    with pytest.raises(
        go.GradOverrideError,
        match=r"under torch\.func\.vmap .*, the output `output` in sample 1 differs from eager "
        r"mode: the largest difference is 8 at index \(0,\) \(-4 against 4 in eager mode\)",
    ):
        assert_consistent(doubled, X, modes=("vmap",))


def test_rule_with_state_differs_under_vmap() -> None:
    calls: list[None] = []

    @go.custom_backward
    def counted(x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @counted.backward
    def _(grad: torch.Tensor) -> torch.Tensor:
        calls.append(None)
        return grad * len(calls)

    with pytest.raises(
        go.GradOverrideError,
        match=r"the gradient for `x` in sample 0 differs from eager mode.* A rule that reads or "
        r"writes state outside its arguments",
    ):
        assert_consistent(counted, X, modes=("vmap",))


def test_assert_consistent_misuse_is_explained() -> None:
    with pytest.raises(go.GradOverrideError, match=r"unknown mode 'jit'; the modes are 'eager'"):
        assert_consistent(spike, X, modes=("eager", "jit"))
    with pytest.raises(go.GradOverrideError, match="sample 1 does not match sample 0"):
        assert_consistent(spike, X, modes=("vmap",), samples=[(X,), (X[:3],)])
    with pytest.raises(go.GradOverrideError, match="returned a gradient of shape") as info:
        assert_consistent(wrong_shape, X, modes=("vmap",))
    assert any("eager mode, the baseline" in note for note in info.value.__notes__)


# ---- import isolation ----------------------------------------------------------------------


def test_importing_gradoverride_does_not_import_testing_or_hypothesis() -> None:
    code = (
        "import sys, gradoverride; "
        "assert 'gradoverride.testing' not in sys.modules; "
        "assert 'hypothesis' not in sys.modules; "
        "import gradoverride.testing; "
        "assert 'hypothesis' not in sys.modules, 'gradoverride.testing imports hypothesis'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_saved_bytes_counts_what_a_call_keeps_for_backward() -> None:
    from gradoverride.testing import saved_bytes

    x = torch.ones(8, 4, requires_grad=True)
    assert saved_bytes(torch.sin, x) == x.numel() * x.element_size()  # sin saves its input
    assert saved_bytes(torch.neg, x) == 0
    assert saved_bytes(torch.mul, x, x) == 2 * x.numel() * x.element_size()


class _Scaled(go.Module):
    """y = w * x, whose rule gives the weight `weight_factor` times its true gradient."""

    def __init__(self, weight_factor: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64))
        self.weight_factor = weight_factor

    def forward(self, x):
        return self.w * x

    def backward(self, grad, *, x, w):
        return {"x": grad * w, "w": self.weight_factor * (grad * x)}


def test_a_module_rule_is_checked_for_its_parameters_too() -> None:
    x = torch.tensor([1.0, -1.5, 2.0], dtype=torch.float64)
    good = check_backward(_Scaled(1.0), x, reference="finite_differences")
    assert [row.name for row in good.rows] == ["x", "w"] and good.ok
    bad = _Scaled(100.0)  # the weight's gradient 100 times too large; the input's right
    with pytest.raises(go.GradOverrideError, match=r"check_backward\(`_Scaled\(\)`\): the "
                       r"gradient for `w` fails"):
        check_backward(bad, x, reference="finite_differences")
    # A proxy reading the module's parameter checks it too; the given gradients by name.
    with pytest.raises(go.GradOverrideError, match=r"the gradient for `w` fails"):
        check_backward(bad, x, reference=lambda x: bad.w * x)
    report = check_backward(bad, x, reference={"w": x.clone()}, raise_on_mismatch=False)
    assert list(report.mismatches) == ["w"]
    # Only the input given (one tensor): the parameter is not compared.
    assert check_backward(bad, x, reference=bad.w.detach().clone()).ok
    assert bad.w.grad is None  # the module's own parameters are not touched


class _Keyword(go.Module):
    """y = scale * w * x, whose rule gives the weight 100 times its true gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -2.0], dtype=torch.float64))

    def forward(self, x, scale=1.0):
        return scale * self.w * x

    def backward(self, grad, *, x, w, scale):
        return {"x": scale * grad * w, "w": 100 * scale * grad * x}


def test_a_module_bound_with_partial_is_checked_for_its_parameters() -> None:
    x = torch.tensor([1.0, 3.0], dtype=torch.float64)
    report = check_backward(functools.partial(_Keyword(), scale=2.0), x,
                            reference="finite_differences", raise_on_mismatch=False)
    assert [(row.name, row.ok) for row in report.rows] == [("x", True), ("w", False)]


def test_a_module_with_buffers_and_frozen_parameters_is_left_as_it_was() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model[0].bias.requires_grad_(False)  # frozen: float32 in a float64 finite difference
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 3)
    report = check_backward(model, x, reference="finite_differences", rtol=1e-2, atol=1e-3)
    assert [row.name for row in report.rows] == ["input", "0.weight", "1.weight", "1.bias"]
    for key, value in model.state_dict().items():  # running statistics untouched
        assert torch.equal(value, before[key]), key


# ---- options that cannot mean anything, and reports that must read sensibly -------------------


def test_infinite_tolerances_accept_an_expected_gradient_of_zero() -> None:
    x = torch.tensor([-1.0, 0.0, 1.0])
    want = torch.tensor([0.5, 0.0, 0.5])  # 0 where the rule's gradient is 1
    got = 1 / (1 + x.abs()) ** 2  # the rule's gradient for an upstream gradient of ones
    cosine = float(got @ want / (got.norm() * want.norm()))  # independently: 0.3333
    report = check_backward(spike, x, reference=want, rtol=float("inf"), atol=float("inf"),
                            min_cosine=0.3)
    difference = report["x"].difference
    assert report.ok and difference is not None
    assert difference.cosine == pytest.approx(cosine, rel=1e-6) and 0.33 < cosine < 0.34
    with pytest.raises(go.GradOverrideError,
                       match=r"cosine similarity with the given gradients is 0\.333333, below"):
        check_backward(spike, x, reference=want, rtol=float("inf"), atol=float("inf"),
                       min_cosine=0.5)


@pytest.mark.parametrize("step", [0.0, -1e-6, float("nan"), float("inf"), "1e-6"])
def test_a_step_that_is_not_a_positive_number_is_refused(step: Any) -> None:
    with pytest.raises(go.GradOverrideError) as caught:
        check_backward(spike, X, reference="finite_differences", step=step)
    assert str(caught.value) == (
        "check_backward(`spike`): `step` must be a finite number greater than 0 (the "
        f"finite-difference step, default 1e-6), got {step!r}; pass e.g. `step=1e-6`."
    )


def test_a_finite_difference_mismatch_names_the_step_as_a_possible_cause() -> None:
    x = torch.tensor([0.5, 1.0], dtype=torch.float64)
    # exp's central difference with step 1 is exp(x) * sinh(1): 17.5% above the derivative.
    report = check_backward(torch.exp, x, reference="finite_differences", step=1.0,
                            grad_outputs="ones", raise_on_mismatch=False)
    (row,) = report.rows
    assert row.expected is not None
    torch.testing.assert_close(row.expected, x.exp() * torch.sinh(torch.tensor(1.0,
                               dtype=torch.float64)))
    with pytest.raises(go.GradOverrideError) as caught:
        check_backward(torch.exp, x, reference="finite_differences", step=1.0)
    assert ("The step can also be the cause: too large for a strongly curved forward, too "
            "small for its precision; try another `step=`.") in str(caught.value)


@pytest.mark.parametrize(("grad_outputs", "where", "got"), [
    (1.0, "`grad_outputs`", "float 1.0"),
    ([torch.ones(9), 2.0], "`grad_outputs[1]`", "float 2.0"),
])
def test_grad_outputs_that_is_not_tensors_is_refused(grad_outputs: Any, where: str,
                                                     got: str) -> None:
    with pytest.raises(go.GradOverrideError) as caught:
        check_backward(sin_cos, X, grad_outputs=grad_outputs)
    assert str(caught.value) == (
        f"{where} for `sin_cos` must be 'random', 'ones', a tensor (one output) or a "
        f"sequence of one tensor per output, got {got}; for an upstream gradient of ones "
        "pass 'ones', for another value a tensor in the output's shape "
        "(`torch.full_like(output, value)`)."
    )


def test_equal_infinities_differ_by_nothing_and_the_hint_leaves_out_allow_nonfinite() -> None:
    x = torch.tensor([-1.0, 0.0, 2.0])
    right = torch.tensor([-1.0, math.inf, 0.5])  # d/dx log|x|, with its infinity at 0
    report = check_backward(log_abs, x, reference=right, allow_nonfinite=True)
    difference = report["x"].difference
    assert report.ok and difference is not None and difference.max_abs == 0.0
    assert difference.cosine == pytest.approx(1.0)
    assert "  x      (3,)        float32  cpu     NO      0  " in repr(report)
    wrong = torch.tensor([-2.0, math.inf, 0.5])
    with pytest.raises(go.GradOverrideError) as caught:
        check_backward(log_abs, x, reference=wrong, allow_nonfinite=True)
    message = str(caught.value)
    assert message.startswith(
        "check_backward(`log_abs`): the gradient for `x` fails: it differs from the given "
        "gradients: the largest difference is 1 at index (0,) (got -1, expected -2)"
    )
    assert "allow_nonfinite" not in message
    assert "Fix the rule's formula for `x`" in message


def test_given_gradients_with_a_random_upstream_gradient_are_refused() -> None:
    with pytest.raises(go.GradOverrideError) as caught:
        check_backward(spike, X, reference=1 / (1 + X.abs()) ** 2, grad_outputs="random")
    assert str(caught.value) == (
        "check_backward(`spike`): the reference is given as gradients, but "
        "`grad_outputs='random'`: given gradients are the backward's result for one "
        "upstream gradient, ones (the gradients of `output.sum()`) or the arrays passed as "
        "`grad_outputs`, never for a random draw. Pass `grad_outputs='ones'` (the default "
        "with given gradients) or the upstream gradients they are the VJP for, or give a "
        "proxy function as `reference` to check with a random upstream gradient."
    )


def test_dict_outputs_of_the_function_and_the_proxy_pair_by_key() -> None:
    def fn(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"spike": spike(x), "double": 2 * x}

    def proxy(x: torch.Tensor) -> dict[str, torch.Tensor]:  # the same keys, other order
        return {"double": 2 * x, "spike": fast_sigmoid(x)}

    report = check_backward(fn, X, reference=proxy)
    assert report.ok
    gen = torch.Generator().manual_seed(0)  # the documented upstream, in fn's output order
    up_spike, up_double = (torch.randn(9, generator=gen, dtype=torch.float64).float()
                           for _ in range(2))
    expected = up_spike / (1 + X.abs()) ** 2 + 2 * up_double
    torch.testing.assert_close(report["x"].expected, expected)


def test_numpy_inputs_alone_are_named_as_not_differentiated() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(go.GradOverrideError) as caught:
        check_backward(torch.sin, np.asarray([1.0, 2.0]))
    assert str(caught.value) == (
        "`torch.sin` was given no floating-point tensor to differentiate (inputs: ndarray); "
        "pass the tensors whose gradients the rule computes as positional inputs. numpy "
        "arrays are not differentiated: pass torch tensors (`torch.from_numpy(a)`), or JAX "
        "arrays (`jnp.asarray(a)`) to check JAX code."
    )
