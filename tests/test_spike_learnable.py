"""`spike` with a learned width: a tensor `alpha` (and `spike(...).module(learn_alpha=...)`)
gets the gradient of the surrogate's smooth step sigma(x; alpha), as if sigma were the
forward. Every expected gradient here is plain autograd (or float64 finite differences) of
sigma written out below in torch ops, independently of the library's formulas."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import gradoverride as go
from gradoverride import GradOverrideError, GradOverrideTypeError

R = go.recipes

_TORCH_CTX_WARNING = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated:DeprecationWarning"
)


def _fast(x: Tensor, a: Tensor) -> Tensor:
    return 0.5 + 0.5 * a * x / (1 + a * x.abs())


def _triangle(x: Tensor, a: Tensor) -> Tensor:
    u = a * x
    return torch.where(u.abs() < 1, u - 0.5 * u * u.abs() + 0.5, (x > 0).to(x.dtype))


def _rectangular(x: Tensor, a: Tensor, leak: float) -> Tensor:
    h = 0.5 / a
    outside = torch.where(x > 0, 1 + leak * (x - h), leak * (x + h))
    return torch.where(x.abs() < h, a * x + 0.5, outside)


def _q_pseudo(x: Tensor, a: Tensor) -> Tensor:
    w = 1 + 2 * x.abs() / (a - 1)
    return torch.where(x < 0, 0.5 * w ** (1 - a), 1 - 0.5 * w ** (1 - a))


def _fake_numerical(x: Tensor, a: Tensor) -> Tensor:
    tail = torch.sign(x) * (1 + torch.log(a * x.abs().clamp(min=1e-3)))
    return torch.where(x.abs() <= 1 / a, a * x, tail)


#: name -> (its parameters besides alpha, alpha to use, sigma(x; a) in plain torch ops)
SIGMAS: dict[str, tuple[dict[str, Any], float, Callable[[Tensor, Tensor], Tensor]]] = {
    "arctan": ({}, 2.0, lambda x, a: 0.5 + torch.atan(math.pi * a * x / 2) / math.pi),
    "sigmoid": ({}, 4.0, lambda x, a: torch.sigmoid(a * x)),
    "fast_sigmoid": ({}, 2.0, _fast),
    "super_spike": ({}, 1.5, _fast),
    "soft_sign": ({}, 2.5, _fast),
    "erf": ({}, 1.7, lambda x, a: 0.5 + 0.5 * torch.erf(a * x)),
    "triangle": ({}, 0.8, _triangle),
    "piecewise_quadratic": ({}, 1.2, _triangle),
    "rectangular": ({}, 0.7, lambda x, a: _rectangular(x, a, 0.0)),
    "piecewise_exp": ({}, 2.0, lambda x, a: torch.where(
        x < 0, 0.5 * torch.exp(a * x.clamp(max=0)), 1 - 0.5 * torch.exp(-a * x.clamp(min=0)))),
    "circ": ({}, 2.0, lambda x, a: 0.5 + 0.5 * a * x / torch.sqrt(1 + (a * x) ** 2)),
    "q_pseudo_spike": ({}, 2.5, _q_pseudo),
    "s2nn": ({"beta": 0.7}, 4.0, lambda x, a: torch.where(
        x < 0, torch.sigmoid(a * x), 0.5 + 0.7 * torch.log1p(x.clamp(min=0)))),
    "squarewave_fourier": ({"terms": 3}, 1.3, lambda x, a: 0.5 + (2 / math.pi) * sum(
        torch.sin(k * a * x) / k for k in (1, 3, 5))),
    "nonzero_sign_log_abs": ({}, 1.5, lambda x, a: torch.sign(x) * torch.log1p(a * x.abs())),
    "fake_numerical_gradient": ({}, 0.9, _fake_numerical),
    "sparse_fast_sigmoid": ({"bound": -0.4}, 2.0, lambda x, a: torch.where(
        x > -0.4, _fast(x, a) - _fast(torch.tensor(-0.4, dtype=x.dtype), a), 0.0)),
}
# The rectangle with a leak: its width derivative outside the window is not x sg / a.
LEAKY_RECT = ({"leak": 0.2}, 0.7, lambda x, a: _rectangular(x, a, 0.2))

NO_WIDTH = ("straight_through", "log_tailed_relu", "leaky_relu")


def _x(n: int = 64, seed: int = 0, dtype: torch.dtype = torch.float64) -> Tensor:
    return 2 * torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _expected(sigma: Callable[[Tensor, Tensor], Tensor], x: Tensor, a: Tensor, up: Tensor,
              scale: float = 1.0, center: float = 0.0) -> tuple[Tensor, Tensor]:
    xr = x.detach().clone().requires_grad_()
    ar = a.detach().clone().requires_grad_()
    out = scale * sigma(xr - center, ar)
    gx, ga = torch.autograd.grad(out, [xr, ar], up)
    return gx, ga


def _learned(recipe: Any, x: Tensor, alpha: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    xr = x.detach().clone().requires_grad_()
    out = recipe(xr)
    gx, ga = torch.autograd.grad(out, [xr, alpha], up)
    return gx, ga


# ---- the gradients, against autograd of sigma and finite differences -------------------------


@pytest.mark.parametrize("name", [*SIGMAS, "rectangular+leak"])
def test_gradients_are_autograd_of_the_smooth_step(name: str, device: torch.device) -> None:
    params, a0, sigma = LEAKY_RECT if name == "rectangular+leak" else SIGMAS[name]
    surrogate = name.partition("+")[0]
    x = _x().to(device)
    up = torch.rand(64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    up = up.to(device)
    alpha = nn.Parameter(torch.tensor(a0, dtype=torch.float64, device=device))
    recipe = R.spike(surrogate, alpha=alpha, scale=0.75, center=0.1, **params)
    got = _learned(recipe, x, alpha, up)
    expected = _expected(sigma, x, alpha, up, scale=0.75, center=0.1)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    # the forward is the step, whatever alpha is
    assert torch.equal(recipe(x), (x > 0).to(x.dtype))


@pytest.mark.parametrize("name", [*SIGMAS, "rectangular+leak"])
def test_alpha_gradient_is_the_finite_difference_of_the_smooth_step(name: str) -> None:
    params, a0, sigma = LEAKY_RECT if name == "rectangular+leak" else SIGMAS[name]
    x = _x(seed=3)
    up = torch.rand(64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    alpha = nn.Parameter(torch.tensor(a0, dtype=torch.float64))
    _, got = _learned(R.spike(name.partition("+")[0], alpha=alpha, **params), x, alpha, up)
    h = 1e-6
    with torch.no_grad():
        plus = (sigma(x, torch.tensor(a0 + h, dtype=torch.float64)) * up).sum()
        minus = (sigma(x, torch.tensor(a0 - h, dtype=torch.float64)) * up).sum()
    torch.testing.assert_close(got, (plus - minus) / (2 * h), rtol=1e-6, atol=1e-8)


def test_per_channel_alpha_gets_its_gradient_summed_to_its_shape(device: torch.device) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 4, 5, generator=g).to(device)
    up = torch.rand(2, 3, 4, 5, generator=g).to(device)
    alpha = nn.Parameter(torch.tensor([1.0, 2.0, 3.0], device=device).reshape(3, 1, 1))
    gx, ga = _learned(R.spike("arctan", alpha=alpha), x, alpha, up)
    assert ga.shape == (3, 1, 1)
    ex, ea = _expected(SIGMAS["arctan"][2], x, alpha, up)
    torch.testing.assert_close((gx, ga), (ex, ea))
    # the same as three separate scalar alphas, one per channel
    for c in range(3):
        _, one = _expected(SIGMAS["arctan"][2], x[:, c], alpha[c, 0, 0], up[:, c])
        torch.testing.assert_close(ga[c, 0, 0], one)


def test_a_cpu_scalar_alpha_gets_its_gradient_on_the_cpu(device: torch.device) -> None:
    # torch ops let a 0-d CPU tensor scale an input on any device; its gradient stays home
    alpha = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
    x, up = _x(seed=12).to(device), torch.rand(64, dtype=torch.float64).to(device)
    gx, ga = _learned(R.spike("circ", alpha=alpha), x, alpha, up)
    assert (gx.device, ga.device) == (x.device, torch.device("cpu"))
    ex, ea = _expected(SIGMAS["circ"][2], x.cpu(), alpha, up.cpu())
    torch.testing.assert_close((gx.cpu(), ga), (ex, ea))


def test_low_precision_input_takes_a_float32_alpha(device: torch.device) -> None:
    x = _x(dtype=torch.float32).to(device, torch.bfloat16)
    up = torch.ones(64, dtype=torch.bfloat16, device=device)
    alpha = nn.Parameter(torch.tensor([2.0], device=device))
    gx, ga = _learned(R.spike("erf", alpha=alpha), x, alpha, up)
    assert (gx.dtype, ga.dtype, ga.shape) == (torch.bfloat16, torch.float32, (1,))
    ex, ea = _expected(SIGMAS["erf"][2], x.double(), alpha.double(), up.double())
    torch.testing.assert_close(gx, ex.to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ga, ea.float(), rtol=1e-5, atol=1e-6)


def test_a_tensor_that_is_not_a_parameter_works_too_and_can_be_computed() -> None:
    # alpha = softplus(raw): the gradient flows on through the expression to `raw`
    raw = torch.tensor(1.0, requires_grad=True)
    x = _x(seed=6)
    up = torch.ones(64, dtype=torch.float64)
    R.spike("sigmoid", alpha=nn.functional.softplus(raw).double())(x.requires_grad_()) \
        .backward(up)
    rr = torch.tensor(1.0, requires_grad=True)
    torch.autograd.backward(torch.sigmoid(nn.functional.softplus(rr).double() * x.detach()), up)
    torch.testing.assert_close(raw.grad, rr.grad)


def test_gradient_method_takes_the_tensor_alpha() -> None:
    x = _x(seed=7)
    alpha = torch.tensor([[1.0], [3.0]], dtype=torch.float64)
    xs = torch.stack([x, x])
    xr = xs.clone().requires_grad_()
    (sg,) = torch.autograd.grad(SIGMAS["sigmoid"][2](xr, alpha).sum(), [xr])
    torch.testing.assert_close(R.spike("sigmoid", alpha=alpha).gradient(xs), sg)


# ---- the float path, the module form, training, compile, save/load ---------------------------


def test_a_float_alpha_gets_the_same_x_gradient_and_no_alpha_input() -> None:
    x, up = _x(seed=8), torch.rand(64, dtype=torch.float64)
    for name, (params, a0, sigma) in SIGMAS.items():
        alpha = torch.tensor(a0, dtype=torch.float64, requires_grad=True)
        learned, _ = _learned(R.spike(name, alpha=alpha, **params), x, alpha, up)
        xr = x.clone().requires_grad_()
        (fixed,) = torch.autograd.grad(R.spike(name, alpha=a0, **params)(xr), [xr], up)
        expected, _ = _expected(sigma, x, alpha, up)
        torch.testing.assert_close(fixed, expected, rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(learned, fixed, rtol=1e-10, atol=1e-12, msg=name)


def test_module_holds_alpha_as_its_parameter_and_training_moves_it(
        device: torch.device) -> None:
    torch.manual_seed(0)
    spk = R.spike("arctan", alpha=2.0).module(learn_alpha=(4,))
    model = nn.Sequential(nn.Linear(3, 4), spk, nn.Linear(4, 1)).to(device)
    assert any(p is spk.alpha for p in model.parameters())
    assert torch.equal(spk.alpha.detach().cpu(), torch.full((4,), 2.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(32, 3).to(device), torch.randn(32, 1).to(device)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert spk.alpha.grad is not None and spk.alpha.grad.shape == (4,)
    assert not torch.allclose(spk.alpha.detach().cpu(), torch.full((4,), 2.0))
    assert losses[-1] < losses[0]


def test_module_first_alpha_gradient_is_autograd_of_the_smooth_step() -> None:
    lin = nn.Linear(3, 2).double()
    spk = R.spike("fast_sigmoid", alpha=2.0).module(learn_alpha=True).double()
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    up = torch.rand(5, 2, dtype=torch.float64)
    spk(lin(x)).backward(up)
    _, expected = _expected(SIGMAS["fast_sigmoid"][2], lin(x), spk.alpha, up)
    torch.testing.assert_close(spk.alpha.grad, expected)


def test_state_dict_round_trip_keeps_the_learned_alpha() -> None:
    spk = R.spike("sigmoid", alpha=4.0).module(learn_alpha=(2, 1))
    with torch.no_grad():
        spk.alpha.copy_(torch.tensor([[3.5], [5.25]]))
    buffer = io.BytesIO()
    torch.save(spk.state_dict(), buffer)
    buffer.seek(0)
    fresh = R.spike("sigmoid", alpha=4.0).module(learn_alpha=(2, 1))
    assert set(fresh.state_dict()) == {"alpha"}
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(fresh.alpha.detach(), torch.tensor([[3.5], [5.25]]))
    x = torch.randn(2, 6).requires_grad_()
    (spk(x).sum() + fresh(x).sum()).backward()
    torch.testing.assert_close(fresh.alpha.grad, spk.alpha.grad)


def test_module_without_learn_alpha_is_the_plain_recipe_module() -> None:
    spk = R.spike("arctan", alpha=2.0).module()
    assert list(spk.parameters()) == [] and repr(spk) == repr(R.spike("arctan", alpha=2.0))


@pytest.mark.compile
@_TORCH_CTX_WARNING
def test_module_with_learned_alpha_compiles_with_fullgraph() -> None:
    torch._dynamo.reset()
    try:
        eager = R.spike("arctan", alpha=2.0).module(learn_alpha=(3, 1))
        compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")
        g = torch.Generator().manual_seed(10)
        x = torch.randn(3, 8, generator=g).requires_grad_()
        up = torch.rand(3, 8, generator=g)
        got = torch.autograd.grad(compiled(x), [x, eager.alpha], up)
        expected = _expected(SIGMAS["arctan"][2], x, eager.alpha, up)
        torch.testing.assert_close(got, expected)
    finally:
        torch._dynamo.reset()


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NO_WIDTH)
def test_surrogates_without_a_width_refuse_a_tensor_alpha(name: str) -> None:
    pattern = (rf"spike\(surrogate='{name}'\): `alpha` cannot be learned .*the surrogate "
               rf"'{name}' has no width in its formula\. Leave alpha out, or learn it with "
               r"one of 'arctan'")
    with pytest.raises(GradOverrideError, match=pattern):
        R.spike(name, alpha=nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(GradOverrideError, match=r"\.module\(learn_alpha=\.\.\.\): `alpha` "
                       rf"cannot be learned .*the surrogate '{name}' has no width"):
        R.spike(name).module(learn_alpha=True)


def test_sampled_spike_refuses_a_learned_alpha() -> None:
    with pytest.raises(GradOverrideError, match=r"spike\(surrogate='circ'\), sample=True: "
                       r"`alpha` cannot be learned .*give a float alpha"):
        R.spike("circ", alpha=torch.tensor(2.0), sample=True)
    with pytest.raises(GradOverrideError, match=r"sample=True: `alpha` cannot be learned"):
        R.spike("circ", sample=True).module(learn_alpha=True)


def test_integer_tensor_alpha_is_refused() -> None:
    with pytest.raises(GradOverrideTypeError,
                       match=r"a tensor `alpha` must be floating .*got torch\.int64"):
        R.spike("arctan", alpha=torch.tensor(2))


def test_alpha_that_does_not_broadcast_to_the_input_is_refused() -> None:
    recipe = R.spike("arctan", alpha=nn.Parameter(torch.ones(3)))
    with pytest.raises(GradOverrideError, match=re.escape(
            "`alpha` of shape (3,) does not broadcast to the input's shape (3, 4); give one "
            "alpha (shape ()) or one per channel with 1 for the other axes")):
        recipe(torch.randn(3, 4))


def test_module_of_a_tensor_alpha_spike_is_refused() -> None:
    recipe = R.spike("arctan", alpha=nn.Parameter(torch.tensor(2.0)))
    with pytest.raises(GradOverrideError, match=re.escape(
            ".module(): this spike's `alpha` is a tensor, which a module would not own (not "
            "in its parameters() nor its state_dict). Let the module hold it: "
            "`spike('arctan', alpha=<initial float>, ...).module(learn_alpha=True)`.")):
        recipe.module()


@pytest.mark.parametrize("bad", [(3, 0), "yes", 3, [3, 1]])
def test_learn_alpha_must_be_a_bool_or_a_shape(bad: Any) -> None:
    with pytest.raises(GradOverrideTypeError, match=r"`learn_alpha` must be True \(one alpha\), "
                       r"False, or the shape of the alphas, a tuple of positive ints"):
        R.spike("arctan").module(learn_alpha=bad)


def test_a_non_number_alpha_names_the_tensor_option() -> None:
    with pytest.raises(GradOverrideError, match=r"`alpha` must be a positive finite number; "
                       r"got str 'wide'\. \(Or a floating torch tensor, to learn the width"):
        R.spike("arctan", alpha="wide")  # type: ignore[arg-type]


def test_repr_shows_a_tensor_alpha_without_reading_it() -> None:
    recipe = R.spike("erf", alpha=nn.Parameter(torch.ones(2, 1)))
    assert repr(recipe) == (
        "spike(surrogate='erf', alpha=<Parameter of shape (2, 1), torch.float32>, scale=1.0, "
        "at_zero=0.0)"
    )


def test_tensorflow_input_refuses_a_torch_alpha() -> None:
    tf = pytest.importorskip("tensorflow", reason="the TensorFlow refusal needs TensorFlow")
    x = tf.constant([0.5, -0.5])
    with pytest.raises(GradOverrideError, match=r"has a torch tensor `alpha` \(a learned "
                       r"width\), and its input is a TensorFlow tensor.*On TensorFlow give a "
                       r"float alpha"):
        R.spike("arctan", alpha=nn.Parameter(torch.tensor(2.0)))(x)
    with pytest.raises(GradOverrideError, match=r"has a torch tensor `alpha`"):
        R.spike("arctan").module(learn_alpha=True)(x)


# ---- presets -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("preset", "param", "sigma"), [
    ("spikingjelly.ATan", "alpha", SIGMAS["arctan"][2]),
    ("snntorch.sigmoid", "slope", SIGMAS["sigmoid"][2]),
    ("spikingjelly.PiecewiseExp", "alpha", SIGMAS["piecewise_exp"][2]),
])
def test_preset_passing_its_parameter_to_alpha_learns_it(
        preset: str, param: str, sigma: Callable[[Tensor, Tensor], Tensor]) -> None:
    x, up = _x(seed=11), torch.rand(64, dtype=torch.float64)
    alpha = nn.Parameter(torch.tensor(3.0, dtype=torch.float64))
    got = _learned(R.spike.preset(preset, **{param: alpha}), x, alpha, up)
    torch.testing.assert_close(got, _expected(sigma, x, alpha, up))


def test_preset_whose_parameter_also_sets_the_scale_refuses_a_tensor() -> None:
    with pytest.raises(GradOverrideError, match=re.escape(
            "spike.preset('snntorch.fast_sigmoid'): `slope` cannot be a tensor (a learned "
            "width): this preset does not pass it unchanged to spike's alpha (it sets alpha, "
            "scale from it). Give a float, learn the width with spike(surrogate, "
            "alpha=tensor, ...), or use a preset that takes one: 'snntorch.atan', ")):
        R.spike.preset("snntorch.fast_sigmoid", slope=torch.tensor(25.0))
    with pytest.raises(GradOverrideError, match=r"`T_period` cannot be a tensor .*\(it sets "
                       r"alpha by a formula from it\)"):
        R.spike.preset("spikingjelly.SquarewaveFourierSeries", T_period=torch.tensor(8.0))
    with pytest.raises(GradOverrideError, match=r"`beta` cannot be a tensor .*\(only alpha "
                       r"can be a tensor, and `alpha` is alpha\)"):
        R.spike.preset("spikingjelly.S2NN", alpha=torch.tensor(4.0), beta=torch.tensor(1.0))
