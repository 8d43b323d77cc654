"""The spike recipe: the step forward exactly, each surrogate's backward equal to autograd of
its smooth proxy, the stated conventions (peak 1 at the default alpha, integral 1, H(0)),
no NaN at extreme inputs, presets equal to the libraries they name."""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any

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


def _grad(recipe: Any, x: torch.Tensor, g: torch.Tensor, create_graph: bool = False) -> Any:
    leaf = x.detach().requires_grad_()
    y = recipe(leaf)
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
    recipe = R.spike(name, alpha=1.7, scale=0.8)
    x = torch.where((x.abs() - 0.5 / 1.7).abs() < 1e-3, 0.1, x).to(x.dtype)
    g = torch.randn(x.shape, dtype=torch.float64).to(x.dtype)
    y, gx = _grad(recipe, x, g, create_graph)
    assert y.dtype == x.dtype and gx.dtype == x.dtype
    assert torch.equal(y, (x > 0).to(x.dtype))
    expected = _proxy_grad(recipe, x, g).to(x.dtype)
    torch.testing.assert_close(gx, expected, **tolerance(x.dtype))


@pytest.mark.parametrize("name", NAMES)
def test_default_alpha_puts_the_peak_at_one_and_the_integral_is_one(name: str) -> None:
    recipe = R.spike(name)
    zero = torch.zeros((), dtype=torch.float64)
    torch.testing.assert_close(recipe.gradient(zero), torch.tensor(1.0, dtype=torch.float64))
    if name == "straight_through":
        return
    x = torch.linspace(-400, 400, 800_001, dtype=torch.float64)
    integral = torch.trapezoid(recipe.gradient(x), x)
    assert abs(integral.item() - 1) < 5e-3, integral


@pytest.mark.parametrize("name", NAMES)
def test_gradient_at_zero_is_scale_times_the_peak(name: str) -> None:
    recipe = R.spike(name, alpha=3.0, scale=0.5)
    peak = {"sigmoid": 3 / 4, "erf": 3 / math.sqrt(math.pi), "triangle": 3.0,
            "piecewise_quadratic": 3.0, "rectangular": 3.0, "straight_through": 1.0}
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


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "dtype,big", [(torch.float16, 1e4), (torch.bfloat16, 1e30), (torch.float32, 1e30)], ids=str
)
def test_finite_gradients_at_extreme_inputs(name: str, dtype: torch.dtype, big: float) -> None:
    x = torch.tensor([-big, -1.0, 0.0, 1.0, big], dtype=dtype)
    for recipe in (R.spike(name), R.spike(name, alpha=25.0)):
        y, gx = _grad(recipe, x, torch.ones(5, dtype=dtype))
        assert y.dtype == dtype and gx.dtype == dtype
        assert torch.isfinite(gx).all(), (recipe, gx)


def test_rectangle_edges_are_strict() -> None:
    x = torch.tensor([-0.5, 0.5, 0.499, -0.499])
    assert _grad(R.spike("rectangular"), x, torch.ones(4))[1].tolist() == [0, 0, 1, 1]


def test_repr_module_and_equality() -> None:
    assert repr(R.spike()) == "spike(surrogate='arctan', alpha=2.0, scale=1.0, at_zero=0.0)"
    assert R.spike() == R.spike("arctan", alpha=2.0)
    assert repr(R.spike("sigmoid").module()) == (
        "spike(surrogate='sigmoid', alpha=4.0, scale=1.0, at_zero=0.0)"
    )


def test_on_each_device(device: torch.device) -> None:
    x = torch.tensor([-1.0, 0.0, 0.3], device=device)
    for name in NAMES:
        y, gx = _grad(R.spike(name), x, torch.ones(3, device=device))
        assert y.device == device and gx.device == device


# ---- composition ------------------------------------------------------------------------------


@pytest.mark.compile
@_TORCH_CTX_WARNING
def test_every_surrogate_compiles_with_fullgraph_and_matches_eager() -> None:
    spikes = [R.spike(name, alpha=1.5) for name in NAMES]
    x0 = torch.tensor([-2.0, -0.5, -0.2, 0.0, 0.2, 0.5, 2.0])

    def loss(x: torch.Tensor) -> torch.Tensor:
        w = torch.arange(7.0)
        return sum(((s(x) * w).sum() for s in spikes), torch.zeros(()))

    assert_consistent(loss, x0, modes=("compile",))


@pytest.mark.parametrize("name", ["arctan", "sigmoid", "triangle", "rectangular", "erf"])
def test_vmap_of_grad_matches_the_loop(name: str) -> None:
    recipe = R.spike(name)
    xs = torch.tensor([[-2.0, -0.3, 0.1, 1.0], [0.5, 1.5, -0.2, 0.0]])

    def f(x: torch.Tensor) -> torch.Tensor:
        return (recipe(x) * torch.arange(1.0, 5.0)).sum()

    torch.testing.assert_close(vmap(func_grad(f))(xs), torch.stack([func_grad(f)(x) for x in xs]))


# ---- presets ----------------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: R.spike.preset("snntorch.triangular"), go.GradOverrideError,
         r"spike\.preset: unknown preset 'snntorch\.triangular'; the presets are "
         r"'snntorch\.atan', "),
        (lambda: R.spike.preset("snntorch.atan", slope=2.0), go.GradOverrideTypeError,
         r"spike\.preset\('snntorch\.atan'\) takes `alpha` \(default 2\.0\); got slope\."),
        (lambda: R.spike.preset("snntorch.straight_through_estimator", alpha=1.0),
         go.GradOverrideTypeError, r"takes no parameter; got alpha\."),
        (lambda: R.spike.preset("norse.triangle", alpha=-1.0), go.GradOverrideError,
         r"spike\.preset\('norse\.triangle'\): `alpha` must be a positive finite number; got "
         r"-1\.0\."),
        (lambda: R.spike("tanh"), go.GradOverrideError,
         r"spike: unknown surrogate 'tanh'; choose one of 'arctan', 'sigmoid', "),
        (lambda: R.spike(alpha=0.0), go.GradOverrideError,
         r"spike\(surrogate='arctan'\): `alpha` must be a positive finite number; "
         r"got float 0\.0\."),
        (lambda: R.spike(scale=math.inf), go.GradOverrideError,
         r"`scale` must be a positive finite number; got float inf\."),
        (lambda: R.spike(at_zero=2.0), go.GradOverrideError,
         r"spike: `at_zero`, the step's value at x == 0, must be a number from 0 to 1 \(0: "
         r"spike when x > 0; 1: when x >= 0\); got 2\.0\."),
    ],
)
def test_mistakes_are_errors_that_name_the_fix(call: Any, error: type[Exception],
                                               message: str) -> None:
    with pytest.raises(error, match=message):
        call()


def _import_peer(module: str) -> Any:
    """The peer module, or None: missing, or failing to import with this torch. Peers'
    import-time deprecation warnings are theirs, not ours."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except Exception:  # any failure means the peer is not usable here
        return None


def _peer_cases() -> list[tuple[str, dict[str, float], Any]]:
    cases: list[tuple[str, dict[str, float], Any]] = []
    sn = _import_peer("snntorch.surrogate")
    if sn is not None:
        cases += [
            ("snntorch.atan", {"alpha": 3.0}, sn.atan(alpha=3.0)),
            ("snntorch.sigmoid", {"slope": 5.0}, sn.sigmoid(slope=5.0)),
            ("snntorch.fast_sigmoid", {"slope": 25.0}, sn.fast_sigmoid(slope=25.0)),
            ("snntorch.straight_through_estimator", {}, sn.straight_through_estimator()),
        ]
    sj = _import_peer("spikingjelly.activation_based.surrogate")
    if sj is not None:
        for name in ("ATan", "Sigmoid", "SoftSign", "SuperSpike", "Erf", "PiecewiseQuadratic",
                     "PiecewiseExp", "Rect"):
            cases.append((f"spikingjelly.{name}", {"alpha": 1.5}, getattr(sj, name)(alpha=1.5)))
    nt = _import_peer("norse.torch.functional.threshold")
    if nt is not None:
        for method in ("super", "triangle", "heavi_erfc", "tanh"):
            cases.append((f"norse.{method}", {"alpha": 2.0},
                          lambda x, m=method: nt.threshold(x, m, 2.0)))
    return cases


PEERS = _peer_cases()


@pytest.mark.skipif(
    not PEERS, reason="no spiking peer (snntorch, spikingjelly, norse) is importable here"
)
@pytest.mark.filterwarnings("ignore")  # the peers' own deprecation warnings
@pytest.mark.parametrize("preset,params,peer", PEERS, ids=[c[0] for c in PEERS])
def test_preset_equals_its_library(preset: str, params: dict[str, float], peer: Any) -> None:
    x = torch.cat([torch.linspace(-3, 3, 121), torch.tensor([0.0, -0.0, 1 / 3, -1 / 3])])
    g = torch.rand_like(x)
    ours = R.spike.preset(preset, **params)
    y, gx = _grad(ours, x, g)
    ref_y, ref_g = _grad(peer, x, g)
    assert torch.equal(y, ref_y.to(y.dtype))  # snnTorch returns float32 whatever came in
    torch.testing.assert_close(gx, ref_g.to(gx.dtype), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore")  # snnTorch's own overflow warnings
def test_snntorch_sigmoid_nan_is_not_reproduced() -> None:
    sn = _import_peer("snntorch.surrogate")
    if sn is None:
        pytest.skip("snntorch is not importable here (the `peers` extra)")
    x = torch.tensor([-1e4, 0.0, 1e4])
    _, theirs = _grad(sn.sigmoid(slope=25), x, torch.ones(3))
    _, ours = _grad(R.spike.preset("snntorch.sigmoid"), x, torch.ones(3))
    assert theirs.isnan().any()  # exp(25e4) overflows to inf / inf in snnTorch's formula
    assert torch.isfinite(ours).all() and ours[0] == 0 and ours[2] == 0


def test_sigmoid_surrogate_keeps_its_tail_in_bfloat16() -> None:
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16, requires_grad=True)
    R.spike("sigmoid")(x).sum().backward()
    a = 4.0  # the default alpha puts the peak at 1: a * s(ax) s(-ax) with s = 1
    expected = a * torch.sigmoid(a * x.detach().double()) * torch.sigmoid(-a * x.detach().double())
    assert x.grad is not None and (x.grad > 0).all()
    torch.testing.assert_close(x.grad.double(), expected, rtol=2e-2, atol=0)
