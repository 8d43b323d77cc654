"""The spike recipe: the step forward exactly, each surrogate's backward equal to autograd of
its smooth proxy, the stated conventions (peak 1 at the default alpha, integral 1, H(0)),
no NaN at extreme inputs, stochastic spikes deterministic given their noise, and every
preset equal to the peer library function it names (tests/peers.py)."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import peers
import pytest
import torch
from conftest import tolerance
from hypothesis import given
from torch.func import grad as func_grad
from torch.func import vmap

import gradoverride as go
from gradoverride import recipes as R
from gradoverride.testing import assert_consistent
from gradoverride.testing import strategies as gst

_TORCH_CTX_WARNING = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated:DeprecationWarning"
)

NAMES = R.SURROGATES
# Off the rectangle's edges (clamp's own gradient is 1 there, the rectangle's 0).
EDGES = (0.0, -0.0, 0.25, -0.25, 1.0, -1.0)
#: The surrogates whose sg integrates to 1 (the others say why not in the docstring's table).
INTEGRABLE = ("arctan", "sigmoid", "fast_sigmoid", "super_spike", "soft_sign", "erf",
              "triangle", "piecewise_quadratic", "rectangular", "piecewise_exp", "circ",
              "q_pseudo_spike")
#: Non-default values for the surrogates' own parameters, so that the tests exercise them.
PARAMS: dict[str, dict[str, Any]] = {
    "rectangular": {"leak": 0.2}, "log_tailed_relu": {"leak": 0.3},
    "leaky_relu": {"leak": -0.4}, "s2nn": {"beta": 0.6}, "squarewave_fourier": {"terms": 3},
    "sparse_fast_sigmoid": {"bound": -0.3},
}


def _grad(recipe: Any, x: torch.Tensor, g: torch.Tensor, create_graph: bool = False,
          **call: Any) -> Any:
    leaf = x.detach().requires_grad_()
    y = recipe(leaf, **call)
    (gx,) = torch.autograd.grad(y, leaf, g, create_graph=create_graph)
    return y.detach(), gx.detach()


def _proxy_grad(recipe: Any, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().double().requires_grad_()
    (gx,) = torch.autograd.grad(recipe.proxy(leaf), leaf, g.double())
    return gx


@pytest.mark.parametrize("create_graph", [False, True], ids=["backward", "create_graph"])
@pytest.mark.parametrize("name", NAMES)
@given(x=gst.tensors(edges=EDGES, scale=2.0))
def test_backward_is_autograd_of_the_smooth_proxy(
    name: str, create_graph: bool, x: torch.Tensor
) -> None:
    recipe = R.spike(name, alpha=1.7, scale=0.8, **PARAMS.get(name, {}))
    # Off the windows' edges and the sparse bound, where sg jumps.
    near = [0.5 / 1.7, 1 / 1.7] if name != "sparse_fast_sigmoid" else [-0.3]
    for edge in near:
        x = torch.where(((x - edge).abs() < 1e-3) | ((x + edge).abs() < 1e-3), 0.1, x).to(x.dtype)
    g = torch.randn(x.shape, dtype=torch.float64).to(x.dtype)
    y, gx = _grad(recipe, x, g, create_graph)
    assert y.dtype == x.dtype and gx.dtype == x.dtype
    assert torch.equal(y, (x > 0).to(x.dtype))
    expected = _proxy_grad(recipe, x, g).to(x.dtype)
    torch.testing.assert_close(gx, expected, **tolerance(x.dtype))


@pytest.mark.parametrize("name", ["arctan", "circ", "leaky_relu", "s2nn", "piecewise_exp"])
def test_center_moves_the_surrogate_not_the_step(name: str) -> None:
    x = torch.linspace(-3, 3, 121, dtype=torch.float64)
    moved = R.spike(name, center=0.75, **PARAMS.get(name, {}))
    plain = R.spike(name, **PARAMS.get(name, {}))
    y, gx = _grad(moved, x, torch.ones_like(x))
    assert torch.equal(y, (x > 0).double())
    torch.testing.assert_close(gx, plain.gradient(x - 0.75), rtol=1e-12, atol=0)
    assert repr(moved).endswith("center=0.75)")


@pytest.mark.parametrize("name", NAMES)
def test_default_alpha_puts_the_peak_at_one_and_the_integral_is_one(name: str) -> None:
    recipe = R.spike(name)
    zero = torch.zeros((), dtype=torch.float64)
    peak = {"log_tailed_relu": 0.0, "leaky_relu": 0.0, "sparse_fast_sigmoid": 0.0}
    assert recipe.gradient(zero).item() == pytest.approx(peak.get(name, 1.0), abs=1e-15)
    if name not in INTEGRABLE:
        return
    x = torch.linspace(-400, 400, 800_001, dtype=torch.float64)
    integral = torch.trapezoid(recipe.gradient(x), x)
    assert abs(integral.item() - 1) < 5e-3, integral


@pytest.mark.parametrize("name", NAMES)
def test_gradient_at_zero_is_scale_times_the_peak(name: str) -> None:
    recipe = R.spike(name, alpha=3.0, scale=0.5)
    peak = {"sigmoid": 3 / 4, "erf": 3 / math.sqrt(math.pi), "triangle": 3.0,
            "piecewise_quadratic": 3.0, "rectangular": 3.0, "straight_through": 1.0,
            "q_pseudo_spike": 1.0, "s2nn": 1.0, "squarewave_fourier": 6 / math.pi,
            "nonzero_sign_log_abs": 3.0, "fake_numerical_gradient": 3.0,
            "log_tailed_relu": 0.0, "leaky_relu": 0.0, "sparse_fast_sigmoid": 0.0}
    expected = 0.5 * peak.get(name, 3 / 2)
    assert math.isclose(recipe.gradient(torch.zeros((), dtype=torch.float64)).item(), expected)


def test_aliases_are_the_same_formula() -> None:
    x = torch.linspace(-3, 3, 61, dtype=torch.float64)
    fast = R.spike("fast_sigmoid", alpha=2.5).gradient(x)
    for alias in ("super_spike", "soft_sign"):
        assert torch.equal(R.spike(alias, alpha=2.5).gradient(x), fast)
    assert torch.equal(R.spike("piecewise_quadratic").gradient(x), R.spike("triangle").gradient(x))


@pytest.mark.parametrize("at_zero", [0.0, 0.5, 1.0])
@given(x=gst.tensors(edges=(0.0, -0.0)))
def test_step_value_at_zero(at_zero: float, x: torch.Tensor) -> None:
    y = R.spike(at_zero=at_zero)(x)
    expected = torch.where(x == 0, at_zero, (x > 0).to(torch.float64)).to(x.dtype)
    assert y.dtype == x.dtype and torch.equal(y, expected)


@pytest.mark.parametrize("at_zero", [0.0, 0.25, 1.0])
def test_leaky_relu_gradient_follows_the_step(at_zero: float) -> None:
    """1 where the step fires, the leak where it does not, and at 0 the step's own mix."""
    x = torch.tensor([-2.0, -0.0, 0.0, 1e-30, 3.0], dtype=torch.float64)
    _, gx = _grad(R.spike("leaky_relu", leak=0.1, scale=2.0, at_zero=at_zero), x,
                  torch.ones_like(x))
    at_0 = 2.0 * (at_zero + (1 - at_zero) * 0.1)
    assert gx.tolist() == pytest.approx([0.2, at_0, at_0, 2.0, 2.0], rel=1e-15)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "dtype,big", [(torch.float16, 1e4), (torch.bfloat16, 1e30), (torch.float32, 1e30)], ids=str
)
def test_finite_gradients_at_extreme_inputs(name: str, dtype: torch.dtype, big: float) -> None:
    x = torch.tensor([-big, -1.0, -0.0, 0.0, 1.0, big], dtype=dtype)
    for recipe in (R.spike(name), R.spike(name, alpha=25.0)):
        y, gx = _grad(recipe, x, torch.ones(6, dtype=dtype))
        assert y.dtype == dtype and gx.dtype == dtype
        assert torch.isfinite(gx).all(), (recipe, gx)


@pytest.mark.parametrize(
    ("recipe", "reference"),
    [
        (R.spike("sigmoid"), lambda x: 4 * torch.sigmoid(4 * x) * torch.sigmoid(-4 * x)),
        (R.spike.preset("norse.tanh", alpha=2.0), lambda x: 1 / torch.cosh(2 * x) ** 2),
        (R.spike("circ"), lambda x: 1 / (1 + (2 * x) ** 2) ** 1.5),
        (R.spike("s2nn"), lambda x: 4 * torch.sigmoid(4 * x) * torch.sigmoid(-4 * x)),
    ],
    ids=["sigmoid", "norse.tanh", "circ", "s2nn-left"],
)
def test_tails_keep_their_relative_accuracy_in_bfloat16(recipe: Any, reference: Any) -> None:
    """No cancellation: 1 - tanh^2 (norse) and 1 - sigmoid give 0 in bfloat16 from x = 1.4
    on, and norse's circ, a difference of two near-equal terms, gives noise there."""
    x = torch.tensor([-6.0, -3.0, -2.0, -1.0], dtype=torch.bfloat16)
    if recipe.surrogate != "s2nn":
        x = torch.cat([x, -x])
    _, gx = _grad(recipe, x, torch.ones_like(x))
    expected = reference(x.double())
    assert (gx > 0).all()
    torch.testing.assert_close(gx.double(), expected, rtol=2e-2, atol=0)


def test_rectangle_edges_are_strict_with_and_without_a_leak() -> None:
    x = torch.tensor([-0.5, 0.5, 0.499, -0.499, 3.0])
    assert _grad(R.spike("rectangular"), x, torch.ones(5))[1].tolist() == [0, 0, 1, 1, 0]
    leaky = _grad(R.spike("rectangular", leak=0.25), x, torch.ones(5))[1].tolist()
    assert leaky == [0.25, 0.25, 1, 1, 0.25]


def test_repr_module_and_equality() -> None:
    assert repr(R.spike()) == "spike(surrogate='arctan', alpha=2.0, scale=1.0, at_zero=0.0)"
    assert R.spike() == R.spike("arctan", alpha=2.0)
    assert repr(R.spike("sigmoid").module()) == (
        "spike(surrogate='sigmoid', alpha=4.0, scale=1.0, at_zero=0.0)"
    )
    assert R.spike("s2nn") == R.spike("s2nn", beta=1.0)
    assert repr(R.spike("s2nn", beta=0.5)) == (
        "spike(surrogate='s2nn', alpha=4.0, scale=1.0, at_zero=0.0, beta=0.5)"
    )
    assert repr(R.spike("circ", sample=True)) == (
        "spike(surrogate='circ', alpha=2.0, scale=1.0, at_zero=0.0, sample=True)"
    )
    for recipe in (R.spike("leaky_relu", leak=0.1, spread=0.3, center=0.5),
                   R.spike("squarewave_fourier", terms=4), R.spike("erf", sample=True)):
        assert eval(repr(recipe), {"spike": R.spike}) == recipe


def test_on_each_device(device: torch.device) -> None:
    x = torch.tensor([-1.0, 0.0, 0.3], device=device)
    for name in NAMES:
        y, gx = _grad(R.spike(name), x, torch.ones(3, device=device))
        assert y.device == device and gx.device == device
    noise = torch.rand(3, device=device)
    for recipe in (R.spike("circ", sample=True), R.spike("leaky_relu", spread=0.2)):
        y, gx = _grad(recipe, x, torch.ones(3, device=device), noise=noise)
        assert y.device == device and gx.device == device


# ---- stochastic spikes ------------------------------------------------------------------------


def test_sampled_spike_is_noise_below_the_probability() -> None:
    recipe = R.spike("circ", alpha=3.0, scale=0.5, sample=True)
    x = torch.linspace(-2, 2, 41, dtype=torch.float64)
    noise = torch.rand(41, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    p = 0.5 + 0.5 * (3 * x) / torch.sqrt(1 + (3 * x) ** 2)  # the circ step, written out
    y, gx = _grad(recipe, x, torch.ones_like(x), noise=noise)
    assert torch.equal(y, (noise < p).double())
    torch.testing.assert_close(recipe.probability(x), p, rtol=1e-15, atol=1e-16)
    torch.testing.assert_close(gx, 0.5 * 1.5 / (1 + (3 * x) ** 2) ** 1.5, rtol=1e-14, atol=0)


def test_stochastic_spikes_are_deterministic_given_a_generator() -> None:
    x = torch.randn(64, dtype=torch.float64)
    for recipe in (R.spike("sigmoid", sample=True), R.spike("leaky_relu", spread=0.5)):
        first = _grad(recipe, x, torch.ones_like(x), generator=torch.Generator().manual_seed(7))
        again = _grad(recipe, x, torch.ones_like(x), generator=torch.Generator().manual_seed(7))
        other = _grad(recipe, x, torch.ones_like(x), generator=torch.Generator().manual_seed(8))
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
        assert not (torch.equal(first[0], other[0]) and torch.equal(first[1], other[1]))


def test_leaky_relu_spread_is_uniform_noise_on_the_silent_side() -> None:
    x = torch.tensor([-1.0, -0.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    noise = torch.tensor([0.0, 0.25, 0.5, 0.75, 0.999], dtype=torch.float64)
    recipe = R.spike("leaky_relu", leak=0.1, spread=0.4, scale=2.0)
    _, gx = _grad(recipe, x, torch.ones_like(x), noise=noise)
    silent = 2.0 * (0.1 + 0.4 * (noise - 0.5))
    expected = torch.where(x > 0, 2.0, silent)
    torch.testing.assert_close(gx, expected, rtol=1e-15, atol=1e-16)
    torch.testing.assert_close(recipe.gradient(x, noise=noise), expected, rtol=1e-15, atol=1e-16)


def test_the_noise_gets_no_gradient() -> None:
    x = torch.randn(8, requires_grad=True)
    noise = torch.rand(8, requires_grad=True)
    for recipe in (R.spike("arctan", sample=True), R.spike("leaky_relu", spread=0.2)):
        recipe(x, noise=noise).sum().backward()
        assert noise.grad is None and x.grad is not None


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: R.spike()(torch.ones(3), noise=torch.rand(3)), go.GradOverrideTypeError,
         r"spike\(surrogate='arctan', alpha=2\.0, scale=1\.0, at_zero=0\.0\) is "
         r"deterministic: it takes no `noise` or `generator`\. A stochastic spike is "
         r"`sample=True`"),
        (lambda: R.spike(sample=True)(torch.ones(3), noise=torch.rand(2)),
         go.GradOverrideTypeError,
         r"`noise` must be a floating tensor of U\[0, 1\) samples with the input's shape and "
         r"device; got shape \(2,\) on cpu for an input of shape \(3,\) on cpu\. Pass "
         r"`noise=torch\.rand_like\(x\)`\."),
        (lambda: R.spike(sample=True)(torch.ones(3), noise=[0.5] * 3),
         go.GradOverrideTypeError, r"`noise` must be a floating tensor .*; got list\."),
        (lambda: R.spike(sample=True)(torch.ones(3), generator=0), go.GradOverrideTypeError,
         r"`generator` must be a torch\.Generator \(or None\); got int 0\."),
        (lambda: R.spike("s2nn", sample=True), go.GradOverrideError,
         r"spike\(surrogate='s2nn'\), sample=True: its proxy is not a step from 0 to 1, so "
         r"it is no probability; sample with one of 'arctan', "),
        (lambda: R.spike("rectangular", leak=0.1, sample=True), go.GradOverrideError,
         r"rectangular without a leak"),
        (lambda: R.spike(sample=True, at_zero=1.0), go.GradOverrideError,
         r"a sampled spike has no value at 0 \(`at_zero` does not apply\); leave it 0\."),
        (lambda: R.spike(sample=1), go.GradOverrideTypeError,
         r"`sample` must be True or False; got 1\."),
    ],
)
def test_stochastic_mistakes_are_errors_that_name_the_fix(call: Any, error: type[Exception],
                                                          message: str) -> None:
    with pytest.raises(error, match=message):
        call()


# ---- composition ------------------------------------------------------------------------------


def _every_spike() -> list[Any]:
    return [R.spike(name, alpha=1.5, **PARAMS.get(name, {})) for name in NAMES] + [
        R.spike("circ", center=0.5), R.spike("leaky_relu", leak=0.3, at_zero=0.5)
    ]


#: One of each formula (aliases share theirs), in two graphs to keep each compile short.
_FORMULAS = [name for name in NAMES if name not in ("super_spike", "soft_sign",
                                                     "piecewise_quadratic")]
_COMPILED = {
    "first": [R.spike(name, alpha=1.5, **PARAMS.get(name, {})) for name in _FORMULAS[:8]]
    + [R.spike("arctan", center=0.5)],
    "second": [R.spike(name, alpha=1.5, **PARAMS.get(name, {})) for name in _FORMULAS[8:]],
}


@pytest.mark.compile
@_TORCH_CTX_WARNING
@pytest.mark.parametrize("part", ["first", "second"])
def test_every_surrogate_compiles_with_fullgraph_and_matches_eager(part: str) -> None:
    spikes = _COMPILED[part]
    x0 = torch.tensor([-2.0, -0.5, -0.2, 0.0, 0.2, 0.5, 2.0])
    noise = torch.linspace(0.05, 0.95, 7)
    stochastic = [R.spike("circ", sample=True), R.spike("straight_through", sample=True),
                  R.spike("leaky_relu", leak=0.1, spread=0.5)] if part == "second" else []

    def loss(x: torch.Tensor) -> torch.Tensor:
        w = torch.arange(7.0)
        total = sum(((s(x) * w).sum() for s in spikes), torch.zeros(()))
        return total + sum(((s(x, noise=noise) * w).sum() for s in stochastic), torch.zeros(()))

    assert_consistent(loss, x0, modes=("compile",))


class _Layer(torch.nn.Module):
    """`recipe(x * weight)`: the recipe as a module's attribute, as a model holds it."""

    def __init__(self, recipe: Any) -> None:
        super().__init__()
        self.recipe = recipe
        self.weight = torch.nn.Parameter(torch.tensor(1.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.recipe(x * self.weight)


@pytest.mark.compile
@_TORCH_CTX_WARNING
@pytest.mark.parametrize("name", _FORMULAS)
def test_every_surrogate_compiles_with_dynamic_shapes(name: str) -> None:
    """dynamic=True makes the recipe's numbers symbolic: each formula's constants must
    trace (circ's float ** float did not: dynamo's guard on it failed)."""
    layer = _Layer(R.spike(name, alpha=1.5, center=0.1, **PARAMS.get(name, {})))
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    torch._dynamo.reset()
    try:
        # One shape: dynamic=True traces it symbolically already (circ failed right there).
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2)).requires_grad_()
        up = torch.rand(3, 4, generator=torch.Generator().manual_seed(5))
        expected = torch.autograd.grad(layer(x), [x, layer.weight], up)
        got = torch.autograd.grad(compiled(x), [x, layer.weight], up)
        torch.testing.assert_close(got, expected)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("recipe", _every_spike(), ids=repr)
def test_vmap_of_grad_matches_the_loop(recipe: Any) -> None:
    xs = torch.tensor([[-2.0, -0.3, 0.1, 1.0], [0.5, 1.5, -0.2, 0.0]])

    def f(x: torch.Tensor) -> torch.Tensor:
        return (recipe(x) * torch.arange(1.0, 5.0)).sum()

    torch.testing.assert_close(vmap(func_grad(f))(xs), torch.stack([func_grad(f)(x) for x in xs]))


def test_vmap_of_grad_with_noise_matches_the_loop() -> None:
    xs = torch.tensor([[-2.0, -0.3, 0.1, 1.0], [0.5, 1.5, -0.2, 0.0]])
    noises = torch.tensor([[0.1, 0.9, 0.4, 0.6], [0.3, 0.2, 0.8, 0.5]])
    for recipe in (R.spike("erf", sample=True), R.spike("leaky_relu", leak=0.1, spread=0.4)):

        def f(x: torch.Tensor, u: torch.Tensor, r: Any = recipe) -> torch.Tensor:
            return (r(x, noise=u) * torch.arange(1.0, 5.0)).sum()

        looped = torch.stack([func_grad(f)(x, u) for x, u in zip(xs, noises, strict=True)])
        torch.testing.assert_close(vmap(func_grad(f))(xs, noises), looped)


def test_autocast_keeps_the_dtype_it_is_given() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 3)
    for recipe in (R.spike("circ"), R.spike("s2nn"), R.spike("q_pseudo_spike"),
                   R.spike("sigmoid", sample=True)):
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x @ w
            y = recipe(h)
        assert y.dtype == h.dtype == torch.bfloat16
        y.float().sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()


def test_module_form_passes_the_noise() -> None:
    module = R.spike("circ", sample=True).module()
    x = torch.randn(16)
    noise = torch.rand(16)
    assert torch.equal(module(x, noise=noise), R.spike("circ", sample=True)(x, noise=noise))


# ---- parameters and presets -------------------------------------------------------------------


def test_presets_are_spikes_with_the_stated_conventions() -> None:
    assert set(R.SPIKE_PRESETS) >= {"snntorch.atan", "spikingjelly.ATan", "norse.super"}
    assert R.spike.preset("snntorch.fast_sigmoid", slope=25) == R.spike(
        "fast_sigmoid", alpha=25.0, scale=0.08
    )
    assert R.spike.preset("spikingjelly.ATan").at_zero == 1.0
    assert R.spike.preset("norse.super").at_zero == 0.0
    x = torch.linspace(-3, 3, 13, dtype=torch.float64)
    torch.testing.assert_close(R.spike.preset("norse.super").gradient(x), 1 / (1 + x.abs()) ** 2)
    torch.testing.assert_close(
        R.spike.preset("norse.tanh", alpha=3.0).gradient(x), 1 - torch.tanh(3 * x) ** 2
    )
    torch.testing.assert_close(
        R.spike.preset("spikingjelly.SuperSpike", alpha=2.0).gradient(x),
        2 / (x.abs() + 1) ** 2,
    )
    torch.testing.assert_close(  # norse's circ: alpha^3 / (alpha^2 + x^2)^(3/2)
        R.spike.preset("norse.circ", alpha=0.5).gradient(x), 0.125 / (0.25 + x**2) ** 1.5
    )


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: R.spike.preset("snntorch.triangular"), go.GradOverrideError,
         r"spike\.preset: unknown preset 'snntorch\.triangular'; the presets are "
         r"'snntorch\.atan', "),
        (lambda: R.spike.preset("snntorch.atan", slope=2.0), go.GradOverrideTypeError,
         r"spike\.preset\('snntorch\.atan'\) takes `alpha` \(default 2\.0\); got slope\."),
        (lambda: R.spike.preset("spikingjelly.S2NN", gamma=2.0), go.GradOverrideTypeError,
         r"spike\.preset\('spikingjelly\.S2NN'\) takes `alpha` \(default 4\.0\), `beta` "
         r"\(default 1\.0\); got gamma\."),
        (lambda: R.spike.preset("snntorch.straight_through_estimator", alpha=1.0),
         go.GradOverrideTypeError, r"takes no parameter; got alpha\."),
        (lambda: R.spike.preset("norse.triangle", alpha=-1.0), go.GradOverrideError,
         r"spike\.preset\('norse\.triangle'\): `alpha` must be a positive finite number; got "
         r"float -1\.0\."),
        (lambda: R.spike("tanh"), go.GradOverrideError,
         r"spike: unknown surrogate 'tanh'; did you mean spike\.preset\('norse\.tanh'\)\? "
         r"choose one of 'arctan', 'sigmoid', "),
        (lambda: R.spike(alpha=0.0), go.GradOverrideError,
         r"spike\(surrogate='arctan'\): `alpha` must be a positive finite number; "
         r"got float 0\.0\."),
        (lambda: R.spike(scale=math.inf), go.GradOverrideError,
         r"`scale` must be a positive finite number; got float inf\."),
        (lambda: R.spike(at_zero=2.0), go.GradOverrideError,
         r"spike: `at_zero`, the step's value at x == 0, must be a number from 0 to 1 \(0: "
         r"spike when x > 0; 1: when x >= 0\); got 2\.0\."),
        (lambda: R.spike(leak=0.1), go.GradOverrideTypeError,
         r"spike\(surrogate='arctan'\) takes no `leak`: it is a parameter of 'rectangular', "
         r"'log_tailed_relu', 'leaky_relu'\."),
        (lambda: R.spike("q_pseudo_spike", alpha=1.0), go.GradOverrideError,
         r"spike\(surrogate='q_pseudo_spike'\): `alpha` must be greater than 1 \(the formula "
         r"divides by a - 1\); got 1\.0\."),
        (lambda: R.spike("squarewave_fourier", terms=1.5), go.GradOverrideError,
         r"`terms` must be an integer >= 1; got float 1\.5\."),
        (lambda: R.spike("leaky_relu", spread=-0.1), go.GradOverrideError,
         r"`spread` must be a finite number >= 0; got float -0\.1\."),
        (lambda: R.spike("leaky_relu", leak=math.nan), go.GradOverrideError,
         r"`leak` must be a finite number; got float nan\."),
        (lambda: R.spike(center="1"), go.GradOverrideError,
         r"`center` must be a finite number; got str '1'\."),
    ],
)
def test_mistakes_are_errors_that_name_the_fix(call: Any, error: type[Exception],
                                               message: str) -> None:
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize(("preset", "params", "message"), peers.INVALID,
                         ids=[f"{c[0]}-{c[1]}" for c in peers.INVALID])
def test_preset_parameters_across_their_boundary_are_errors(
    preset: str, params: dict[str, float], message: str
) -> None:
    with pytest.raises(go.GradOverrideError, match=rf"spike\.preset\('{preset}'.*{message}"):
        R.spike.preset(preset, **params)


# ---- against the peer libraries ---------------------------------------------------------------

#: The peers' surrogate functions with no preset, and why.
NOT_OFFERED = {
    "snntorch.triangular": "its gradient is +-threshold, the sign flipping at 0: no triangle",
    "spikingjelly.MultiLevelSpikeCount": "a clamped round with a windowed straight-through "
    "gradient, not a spike",
}


@pytest.mark.parametrize("lib", ["snntorch", "spikingjelly", "norse"])
def test_every_peer_surrogate_has_a_preset(lib: str) -> None:
    module = peers.import_peer(peers._MODULES[lib])
    if module is None:
        pytest.skip(f"{peers._MODULES[lib]} is not importable here (pip install -e '.[peers]')")
    missing = [f"{lib}.{name}" for name in peers.peer_functions(module, lib)
               if f"{lib}.{name}" not in R.SPIKE_PRESETS and f"{lib}.{name}" not in NOT_OFFERED]
    assert not missing, f"peer surrogates without a preset: {missing}"
    covered = {case[0] for case in peers.CASES}
    assert {p for p in R.SPIKE_PRESETS if p.startswith(lib)} <= covered


def _peer_or_skip(preset: str, params: dict[str, float], dtype: torch.dtype) -> Any:
    peer = peers.peer_function(preset, params, dtype)
    if peer is None:
        pytest.skip(f"{peers.library(preset)} is not importable here (pip install -e '.[peers]')")
    return peer


def _run(fn: Any, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fn's forward and gradient, with torch's default generator seeded before each, so
    that stochastic peers and presets draw the same numbers."""
    leaf = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the peers' own deprecation and overflow warnings
        torch.manual_seed(1234)
        y = fn(leaf)
        torch.manual_seed(5678)
        (gx,) = torch.autograd.grad(y, leaf, g.to(y.dtype))
    return y.detach(), gx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("preset", "params"), peers.CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in peers.CASES])
def test_preset_equals_its_library(preset: str, params: dict[str, float],
                                   dtype: torch.dtype) -> None:
    """Forward equal; gradients within a few ulps of the peak where the peer's is finite
    (its own rounding of constants aside); finite where the peer's breaks down."""
    peer = _peer_or_skip(preset, params, dtype)
    x = peers.inputs(preset, params, dtype)
    # float32 values, exact in float64 too: snnTorch's output, and so its upstream, is float32
    g = (torch.rand(x.shape, generator=torch.Generator().manual_seed(9)) + 0.5).to(dtype)
    ours_y, ours_g = _run(R.spike.preset(preset, **params), x, g)
    peer_y, peer_g = _run(peer, x, g)
    assert ours_y.dtype == ours_g.dtype == dtype
    assert torch.equal(ours_y, peer_y.to(dtype))
    finite = torch.isfinite(peer_g)
    assert torch.isfinite(ours_g[finite]).all()
    assert torch.isfinite(ours_g[~finite & torch.isfinite(x)]).all()  # never NaN where they are
    eps = torch.finfo(dtype).eps
    if dtype == torch.float64 and preset in peers.FLOAT32_IN_FLOAT64:
        eps = torch.finfo(torch.float32).eps
    peak = peer_g[finite].abs().max().item() if finite.any() else 1.0
    torch.testing.assert_close(ours_g[finite], peer_g[finite].to(dtype), rtol=0,
                               atol=8 * eps * max(peak, torch.finfo(dtype).tiny))


@pytest.mark.filterwarnings("ignore")  # the peers' own overflow warnings
@pytest.mark.parametrize(
    ("preset", "peer", "x"),
    [
        ("snntorch.sigmoid", ("snntorch", lambda m: m.sigmoid(slope=25)), [-1e4, -3.6, 0.0]),
        ("norse.circ", ("norse", lambda m: lambda x: m.threshold(x, "circ", 2.0)), [-1e20, 1e20]),
        ("spikingjelly.FakeNumericalGradient",
         ("spikingjelly", lambda m: m.FakeNumericalGradient()), [-0.0]),
    ],
)
def test_the_peers_non_finite_gradients_are_not_reproduced(preset: str, peer: Any,
                                                           x: list[float]) -> None:
    """snnTorch's sigmoid is inf / inf below -3.55 (float32); norse's circ squares x (inf
    from 1.8e19 on) and subtracts near-equal terms; SpikingJelly's fake numerical gradient
    is sign(x) / x, -inf at -0."""
    module = peers.import_peer(peers._MODULES[peer[0]])
    if module is None:
        pytest.skip(f"{peers._MODULES[peer[0]]} is not importable here")
    xs = torch.tensor(x)
    params = {"alpha": 2.0} if preset == "norse.circ" else {}
    _, theirs = _run(peer[1](module), xs, torch.ones_like(xs))
    _, ours = _run(R.spike.preset(preset, **params), xs, torch.ones_like(xs))
    assert not torch.isfinite(theirs).all()
    assert torch.isfinite(ours).all()


@pytest.mark.parametrize("leak", [0.0, 0.1])
def test_rectangular_proxy_is_strict_at_its_window_ends(leak: float) -> None:
    # The rule gives the leak at |x| = 1/(2a) (a strict window, as SpikingJelly's Rect); the
    # proxy's autograd derivative must too (a clamp would give a there).
    recipe = R.spike("rectangular", alpha=2.0, leak=leak)
    x = torch.tensor([-0.25, 0.25, -0.2, 0.2, 0.3], dtype=torch.float64)
    _, gx = _grad(recipe, x, torch.ones_like(x))
    assert gx.tolist() == [leak, leak, 2.0, 2.0, leak]
    torch.testing.assert_close(_proxy_grad(recipe, x, torch.ones_like(x)), gx)


# ---- edge values, and a spike built inside a compiled forward --------------------------------


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
@pytest.mark.parametrize("leak", [0.0, 0.1])
def test_rectangular_at_nan_is_outside_eagerly_and_compiled(leak: float) -> None:
    torch._dynamo.reset()
    surrogate = R.spike(surrogate="rectangular", leak=leak)
    x = torch.tensor([float("nan"), 0.1, 2.0])

    def grad_of(fn: Any) -> torch.Tensor:
        v = x.clone().requires_grad_()
        fn(v).sum().backward()
        assert v.grad is not None
        return v.grad

    compiled = torch.compile(lambda v: surrogate(v), fullgraph=True, backend="aot_eager")
    eager, traced = grad_of(surrogate), grad_of(compiled)
    torch.testing.assert_close(eager, traced)
    # SpikingJelly's rectangle, `alpha * (x.abs() < 0.5 / alpha) * grad`, is 0 at NaN.
    assert float(eager[0]) == pytest.approx(leak)


class _Built(torch.nn.Module):
    """A forward that builds its spike at each call, as spiking models often do."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.alpha = 2.0
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "default":
            surrogate = R.spike()
        elif self.how == "preset":
            surrogate = R.spike.preset("snntorch.atan")
        else:
            surrogate = R.spike(alpha=self.alpha)
        return surrogate(x * self.w)


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
@pytest.mark.parametrize("how", ["default", "preset", "attribute"])
def test_a_spike_built_in_a_dynamic_compiled_forward(how: str) -> None:
    torch._dynamo.reset()
    module = _Built(how)
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (4, 6):
        x = torch.randn(n, 3, generator=torch.Generator().manual_seed(n))
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        module(x1).sum().backward()
        compiled(x2).sum().backward()
        torch.testing.assert_close(x2.grad, x1.grad)


@pytest.mark.parametrize(("name", "suggested"), [
    ("atan", "arctan"),  # snnTorch
    ("ATan", "arctan"),  # SpikingJelly
    ("PiecewiseQuadratic", "piecewise_quadratic"),
    ("SquarewaveFourierSeries", "squarewave_fourier"),
    ("fast_sigmoi", "fast_sigmoid"),
    ("heaviside", "spike.preset('snntorch.heaviside')"),  # a peer's, with a preset only
])
def test_a_peer_name_of_a_surrogate_suggests_ours(name: str, suggested: str) -> None:
    shown = suggested if suggested.startswith("spike.") else repr(suggested)
    with pytest.raises(go.GradOverrideError, match=rf"spike: unknown surrogate {name!r}; did "
                       rf"you mean {re.escape(shown)}\? choose one of 'arctan'"):
        R.spike(name)
