"""`gradoverride.testing.gradient_report`: per override, the cosine and norm ratio of its
gradient against a reference, checked against computations written out with plain
autograd (never against the library itself)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import gradoverride as go
from gradoverride import recipes
from gradoverride.testing import GradientReport, MismatchRow, gradient_report

torch.set_default_dtype(torch.float32)
F64 = torch.float64


# ---- models ----------------------------------------------------------------------------------


def smooth_op(scale: float = 1.0) -> go.CustomBackward[..., Tensor]:
    """softplus, with the rule `scale` times its exact derivative (1: the true gradient)."""

    @go.custom_backward
    def smooth(x: Tensor) -> Tensor:
        return F.softplus(x)

    @smooth.backward
    def _(grad: Tensor, *, x: Tensor) -> Tensor:
        return grad * torch.sigmoid(x) * scale

    return smooth


class Calls(nn.Module):
    """`op` on its input, `times` times (a recurrent cell's nonlinearity at each step)."""

    def __init__(self, op: Callable[[Tensor], Tensor], times: int = 1) -> None:
        super().__init__()
        self.op = op
        self.times = times

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(self.times):
            x = self.op(x) * 0.9 + 0.1 * x
        return x


class Applied(nn.Module):
    """`fn(x)` called in the forward (not a module of its own)."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)


def smooth_model(scale: float = 1.0, times: int = 1) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), Calls(smooth_op(scale), times), nn.Linear(5, 2)).to(F64)


def regression_batch(n: int = 8) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(n, 3, generator=generator, dtype=F64),
            torch.randn(n, 2, generator=generator, dtype=F64))


def hand_gradient_at_smooth(model: nn.Sequential, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The true gradient of the loss at the softplus's input (one call), through the
    softplus: the residual `0.1 * h` reads the same tensor, but is not the override's."""
    first, last = model[0], model[2]
    x, y = batch
    h = F.linear(x, first.weight.detach(), first.bias.detach())
    h_op = h.clone().requires_grad_()
    out = F.softplus(h_op) * 0.9 + 0.1 * h
    loss = F.mse_loss(F.linear(out, last.weight.detach(), last.bias.detach()), y)
    (grad,) = torch.autograd.grad(loss, h_op)
    return grad


def cosine(a: Tensor, b: Tensor) -> float:
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    return float(a @ b / (a.norm() * b.norm()))


def only_row(report: GradientReport) -> MismatchRow:
    assert len(report.rows) == 1, report
    return report.rows[0]


# ---- a rule equal to the true derivative: cosine 1 and norm ratio 1 under every reference ----


REFERENCES: list[tuple[str, dict[str, Any]]] = [
    ("proxy", {"proxies": {"1": F.softplus}}),
    ("finite_differences", {}),
    ("spsa", {"samples": 16}),
]


@pytest.mark.parametrize(("reference", "options"), REFERENCES, ids=[r for r, _ in REFERENCES])
@pytest.mark.parametrize("scale", [1.0, 2.0, -1.0])
def test_a_rule_scaled_from_the_true_derivative_shows_its_scale(
    reference: str, options: dict[str, Any], scale: float
) -> None:
    # scale 1: the exact derivative (cosine 1, ratio 1); 2 and -1 are wrong rules the
    # report must see: the same direction twice as long, and the opposite direction.
    model, batch = smooth_model(scale), regression_batch()
    row = only_row(gradient_report(model, F.mse_loss, batch, reference=reference, **options))
    tight = 1e-12 if reference == "proxy" else 1e-6
    assert row.label == "1: smooth"
    assert row.cosine == pytest.approx(math.copysign(1.0, scale), abs=tight)
    assert row.norm_ratio == pytest.approx(abs(scale), rel=tight)


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_given_gradients_are_compared_with_the_overrides(scale: float) -> None:
    model, batch = smooth_model(scale), regression_batch()
    expected = hand_gradient_at_smooth(model, batch)
    row = only_row(gradient_report(model, F.mse_loss, batch, reference={"1: smooth": expected}))
    assert row.reference == "given"
    assert row.cosine == pytest.approx(1.0, abs=1e-12)
    assert row.norm_ratio == pytest.approx(scale, rel=1e-12)
    torch.testing.assert_close(row.got, scale * expected.reshape(-1))
    torch.testing.assert_close(row.expected, expected.reshape(-1))


@pytest.mark.parametrize("reference", ["finite_differences", "spsa"])
def test_an_override_called_several_times_is_one_row_over_its_calls(reference: str) -> None:
    model, batch = smooth_model(times=3), regression_batch()
    row = only_row(gradient_report(model, F.mse_loss, batch, reference=reference, samples=24))
    assert (row.calls, row.elements) == (3, 3 * 8 * 5)
    assert row.cosine == pytest.approx(1.0, abs=1e-6)
    assert row.norm_ratio == pytest.approx(1.0, rel=1e-6)


def test_a_module_rule_is_compared_at_its_inputs() -> None:
    class Softplus(go.Module):
        """softplus(x) * weight, with the exact derivative for x and for the weight."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=F64))

        def forward(self, x: Tensor) -> Tensor:
            return F.softplus(x) * self.weight

        def backward(self, grad: Tensor, *, x: Tensor, weight: Tensor) -> Any:
            return {"x": grad * torch.sigmoid(x) * weight,
                    "weight": (grad * F.softplus(x)).sum(0)}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), Softplus(), nn.Linear(5, 2)).to(F64)
    for reference in ("finite_differences", "spsa"):
        row = only_row(gradient_report(model, F.mse_loss, regression_batch(), reference=reference))
        assert (row.label, row.kind, row.elements) == ("1: Softplus", "go.Module", 8 * 5)
        assert row.cosine == pytest.approx(1.0, abs=1e-6)
        assert row.norm_ratio == pytest.approx(1.0, rel=1e-6)


# ---- a straight-through estimator against its proxy, by hand ---------------------------------


class BinaryLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, recipes.binarize()(self.weight), self.bias)


def _binary_net() -> nn.Sequential:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 6), recipes.binarize().module(), BinaryLinear(6, 2))
    model = model.to(F64)
    with torch.no_grad():
        model[2].weight.mul_(3).clamp_(-1, 1)  # some latent weights exactly at the ends
    return model


def _classification_batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(2)
    return (torch.randn(16, 3, generator=generator, dtype=F64),
            torch.randint(0, 2, (16,), generator=generator))


def _sign(x: Tensor) -> Tensor:
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def test_binarize_against_its_clamp_proxy_matches_the_hand_computation() -> None:
    model, (x, y) = _binary_net(), _classification_batch()
    report = gradient_report(model, F.cross_entropy, (x, y))
    w1, b1 = model[0].weight.detach(), model[0].bias.detach()
    w2, b2 = model[2].weight.detach(), model[2].bias.detach()
    h = F.linear(x, w1, b1)
    assert (w2.abs() == 1).any()

    # The straight-through gradients: autograd down to the ±1 values, then the window
    # 1{|.| <= 1} (ends included) at each binarization.
    s = _sign(h).requires_grad_()
    v = _sign(w2).requires_grad_()
    grad_s, grad_v = torch.autograd.grad(F.cross_entropy(F.linear(s, v, b2), y), (s, v))
    override_h = grad_s * (h.abs() <= 1)
    override_w = grad_v * (w2.abs() <= 1)

    # The relaxed network: clamp(., -1, 1) in place of both binarizations.
    h_leaf, w_leaf = h.clone().requires_grad_(), w2.clone().requires_grad_()
    relaxed = F.linear(h_leaf.clamp(-1, 1), w_leaf.clamp(-1, 1), b2)
    true_h, true_w = torch.autograd.grad(F.cross_entropy(relaxed, y), (h_leaf, w_leaf))

    for path, got, true in (("1", override_h, true_h), ("2", override_w, true_w)):
        row = report[path]
        assert row.reference == "clamp(x, -1, 1)"
        assert row.cosine == pytest.approx(cosine(got, true), abs=1e-12)
        assert row.norm_ratio == pytest.approx(float(got.norm() / true.norm()), rel=1e-12)
        assert row.cosine != pytest.approx(1.0, abs=1e-3)  # a real mismatch


def test_a_proxy_may_be_keyed_by_the_recipe_itself() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 6), recipes.ste_sign().module(), nn.Linear(6, 2)).to(F64)
    x, y = _classification_batch()
    by_label = gradient_report(model, F.cross_entropy, (x, y), proxies={"1": F.hardtanh})
    # A recipe of the same settings (not the model's object) names the same override.
    by_recipe = gradient_report(model, F.cross_entropy, (x, y),
                                proxies={recipes.ste_sign(): F.hardtanh})
    row = by_recipe["1: ste_sign()"]
    assert row.reference == "hardtanh"
    assert (row.cosine, row.norm_ratio) == (by_label["1: ste_sign()"].cosine,
                                             by_label["1: ste_sign()"].norm_ratio)
    with pytest.raises(go.GradOverrideError, match=r"proxies names ste_round\(\), which is "
                       r"no override the forward called"):
        gradient_report(model, F.cross_entropy, (x, y), proxies={recipes.ste_round(): None})


def test_ste_sign_against_a_hardtanh_proxy_matches_the_hand_computation() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 6), recipes.ste_sign().module(), nn.Linear(6, 2)).to(F64)
    x, y = _classification_batch()
    report = gradient_report(model, F.cross_entropy, (x, y), proxies={"1": F.hardtanh})
    w1, b1 = model[0].weight.detach(), model[0].bias.detach()
    w2, b2 = model[2].weight.detach(), model[2].bias.detach()
    h = F.linear(x, w1, b1)
    s = torch.sign(h).requires_grad_()
    (override,) = torch.autograd.grad(F.cross_entropy(F.linear(s, w2, b2), y), s)
    h_leaf = h.clone().requires_grad_()
    (true,) = torch.autograd.grad(F.cross_entropy(F.linear(F.hardtanh(h_leaf), w2, b2), y),
                                  h_leaf)
    row = report["1: ste_sign()"]
    assert row.reference == "hardtanh"
    assert row.cosine == pytest.approx(cosine(override, true), abs=1e-12)
    assert row.norm_ratio == pytest.approx(float(override.norm() / true.norm()), rel=1e-12)


# ---- each built-in proxy's derivative is its recipe's rule -----------------------------------

_DETERMINISTIC_SURROGATES = [s for s in recipes.SURROGATES]
_RECIPES: list[Any] = [
    recipes.binarize(),
    recipes.binarize(keep="mask"),
    recipes.binarize(clip=None),
    recipes.binarize(clip=2.0, inclusive=False),
    recipes.binarize(clip=(-1.0, 2.0), inclusive=(True, False)),
    recipes.ste_clamp(-1.0, 1.0, outside="zero"),
    recipes.ste_clamp(-1.0, 2.0, outside="zero", inclusive=(False, True)),
    recipes.ste_clamp(-1.0, 1.0, outside="pass"),
    recipes.ste_clamp(torch.full((6,), -1.0, dtype=F64), torch.linspace(0.5, 2, 6, dtype=F64),
                      outside="zero"),
    recipes.ste_round(),
    recipes.ste_floor(),
    recipes.ste_ceil(),
    recipes.ste_sign(),
    recipes.ternarize(),
    recipes.quantize(bits=3, bound=1.0),
    recipes.quantize(bits=3, symmetric=False, bound=(-0.5, 1.5)),
    recipes.abs_subgradient(),
    recipes.ste_argmax(),
    recipes.ste_argmax(temperature=0.5),
    *(recipes.spike(surrogate=s) for s in _DETERMINISTIC_SURROGATES),
    recipes.spike(surrogate="sigmoid", alpha=3.0, scale=0.5, center=0.25),
]


@pytest.mark.parametrize("recipe", _RECIPES, ids=repr)
def test_each_builtin_proxy_has_its_recipes_rule_as_derivative(recipe: Any) -> None:
    # A loss linear in the recipe's output: both runs get the same upstream gradient, so
    # the report's reference is the proxy's derivative times it, and the override's the
    # rule's. They agree exactly when the proxy is the rule's primitive, at the window's
    # ends too (the inputs hold ±1, ±2 and 0).
    x = torch.tensor([[-2.5, -2.0, -1.0, -0.3, 0.0, 0.4],
                      [0.9, 1.0, 1.7, 2.0, 3.0, -0.7]], dtype=F64)
    upstream = torch.linspace(-1.0, 2.0, 12, dtype=F64).reshape(2, 6)
    model = nn.Sequential(recipe.module())
    report = gradient_report(model, lambda out: (out * upstream).sum(), x)
    row = only_row(report)
    assert row.compared, row
    assert row.cosine == pytest.approx(1.0, abs=1e-12), row
    assert row.norm_ratio == pytest.approx(1.0, rel=1e-12), row


@pytest.mark.parametrize(("recipe", "x", "rule"), [
    # rectangular: a where |x| < 1/(2a), else the leak (strict)
    (recipes.spike(surrogate="rectangular"), [-0.5, -0.49, 0.0, 0.49, 0.5], [0, 1, 1, 1, 0]),
    (recipes.spike(surrogate="rectangular", alpha=2.0, leak=0.1), [-0.25, -0.2, 0.2, 0.25],
     [0.1, 2, 2, 0.1]),
    # quantize: 1 where qmin <= round(x / s) + z <= qmax, round half to even: with s = 1,
    # x = ±3.5 rounds to ±4 (outside the codes -3..3), x = -0.5 to 0 (inside 0..3)
    (recipes.quantize(bits=3, bound=3.0), [-3.5, -3.49, 3.49, 3.5], [0, 1, 1, 0]),
    (recipes.quantize(bits=2, symmetric=False, bound=(0.0, 3.0)), [-0.51, -0.5, 3.49, 3.5],
     [0, 1, 1, 0]),
], ids=["rectangular", "rectangular-leak", "quantize", "quantize-asymmetric"])
def test_a_proxy_counts_its_windows_ends_as_the_rule_does(recipe: Any, x: list[float],
                                                         rule: list[float]) -> None:
    upstream = torch.linspace(0.5, 2.0, len(x), dtype=F64)
    model = nn.Sequential(recipe.module())
    row = only_row(gradient_report(model, lambda out: (out * upstream).sum(),
                                   torch.tensor(x, dtype=F64)))
    by_hand = upstream * torch.tensor(rule, dtype=F64)
    torch.testing.assert_close(row.got, by_hand, rtol=0, atol=1e-15)
    torch.testing.assert_close(row.expected, by_hand, rtol=0, atol=1e-15)
    assert row.cosine == pytest.approx(1.0, abs=1e-12)


def test_learned_clamp_bounds_get_no_proxy_gradient_as_the_rule_gives_none() -> None:
    class LearnedClip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.low = nn.Parameter(torch.tensor(-1.0, dtype=F64))
            self.high = nn.Parameter(torch.tensor(1.0, dtype=F64))

        def forward(self, x: Tensor) -> Tensor:
            return recipes.ste_clamp(self.low, self.high, outside="zero")(x)

    x = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], dtype=F64)
    upstream = torch.linspace(-1.0, 2.0, 7, dtype=F64)
    row = only_row(gradient_report(LearnedClip(), lambda out: (out * upstream).sum(), x))
    # x's gradient: upstream inside [-1, 1], ends included; the bounds' (last two): none
    by_hand = torch.cat([upstream * (x.abs() <= 1), torch.zeros(2, dtype=F64)])
    torch.testing.assert_close(row.expected, by_hand, rtol=0, atol=0)
    assert row.cosine == pytest.approx(1.0, abs=1e-12)
    assert row.norm_ratio == pytest.approx(1.0, rel=1e-12)


_UPSTREAM = torch.linspace(-1.0, 2.0, 12, dtype=F64).reshape(2, 6)


@pytest.mark.parametrize(("transform", "moved"), [
    (recipes.reverse_grad(), -_UPSTREAM),
    (recipes.scale_grad(0.3), 0.3 * _UPSTREAM),
    (recipes.clip_grad_value(0.5), _UPSTREAM.clamp(-0.5, 0.5)),
], ids=repr)
def test_a_gradient_transform_is_measured_against_the_true_gradient(
    transform: Any, moved: Tensor
) -> None:
    # Its proxy is its forward, the identity: the report shows how far it moves the true
    # gradient (reversed: cosine -1; scaled: the ratio is the scale), as a module and as
    # a call in a forward.
    x = torch.linspace(-1.0, 1.0, 12, dtype=F64).reshape(2, 6)
    for model in (nn.Sequential(transform.module()), nn.Sequential(Applied(transform))):
        row = only_row(gradient_report(model, lambda out: (out * _UPSTREAM).sum(), x))
        assert row.reference == "x"
        assert row.cosine == pytest.approx(cosine(moved, _UPSTREAM), abs=1e-12)
        assert row.norm_ratio == pytest.approx(float(moved.norm() / _UPSTREAM.norm()),
                                               rel=1e-12)


# ---- rows that are not compared say so --------------------------------------------------------


def test_an_override_without_a_proxy_gets_a_row_saying_so() -> None:
    @go.custom_backward
    def rounded(x: Tensor) -> Tensor:
        return torch.round(x)

    @rounded.backward
    def _(grad: Tensor) -> Tensor:
        return grad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), Calls(rounded), recipes.lsq(4).module(),
                          recipes.binarize().module(), nn.Linear(5, 2)).to(F64)
    report = gradient_report(model, F.mse_loss, regression_batch(),
                             proxies={"3": None})
    assert [r.label for r in report.rows] == [
        "1: rounded", "2: lsq(bits=4, signed=True, grad_scale=None, window='open')",
        "3: binarize(clip=1.0, inclusive=True, keep='input')"]
    for row in report.rows:
        assert (row.cosine, row.norm_ratio, row.reference) == (None, None, "-")
    assert report["1"].note == "not compared: no proxy declared; pass one: proxies={label: fn}"
    assert report["2"].note.startswith("not compared: no proxy declared")
    assert report["3"].note == "not compared: left out by proxies="
    assert "no proxy declared" in str(report)


def test_a_grad_hook_is_listed_not_compared() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), recipes.binarize().module(), nn.Linear(5, 2)).to(F64)
    handle = go.grad_hook(model[2], recipes.scale_grad(0.5), at="inputs")
    try:
        report = gradient_report(model, F.mse_loss, regression_batch())
    finally:
        handle.remove()
    assert [r.label for r in report.rows] == [
        "1: binarize(clip=1.0, inclusive=True, keep='input')",
        "2: grad_hook(scale_grad(scale=0.5)) at inputs"]
    hook = report["2"]
    assert (hook.kind, hook.cosine) == ("grad_hook", None)
    assert hook.note.startswith("not compared: a grad_hook changes gradients only")


def test_finite_differences_through_a_step_say_the_loss_did_not_change() -> None:
    model, (x, y) = _binary_net(), _classification_batch()
    report = gradient_report(model, F.cross_entropy, (x, y), reference="finite_differences",
                             step=1e-9)
    for row in report.rows:
        assert math.isnan(row.cosine) and row.norm_ratio == math.inf, row
        assert row.note.startswith("the true loss did not change along these steps of 1e-09")


def test_a_model_without_overrides_reports_so() -> None:
    report = gradient_report(nn.Linear(3, 2).to(F64), F.mse_loss, regression_batch())
    assert report.rows == ()
    assert str(report).endswith("no gradient override ran in the forward")


def test_two_overrides_with_one_label_are_told_apart() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = smooth_op(1.0), smooth_op(2.0)  # two ops named `smooth`

        def forward(self, x: Tensor) -> Tensor:
            return self.a(x) + self.b(x * 2)

    model = nn.Sequential(nn.Linear(3, 4), Twice()).to(F64)
    report = gradient_report(model, lambda out: out.sum(), regression_batch()[0],
                             reference="spsa")
    assert [r.label for r in report.rows] == ["1: smooth", "1: smooth #2"]
    assert report["1: smooth #2"].norm_ratio == pytest.approx(2.0, rel=1e-6)
    with pytest.raises(KeyError, match="2 overrides match"):
        report["1"]


def test_equal_recipes_in_one_module_are_one_override() -> None:
    # As go.monitor counts them: a recipe by its settings, also one made at each call.
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = recipes.binarize()

        def forward(self, x: Tensor) -> Tensor:
            return self.a(x) + recipes.binarize()(x * 2)

    report = gradient_report(nn.Sequential(nn.Linear(3, 4), Twice()).to(F64),
                             lambda out: out.sum(), regression_batch()[0])
    assert [(r.label, r.calls) for r in report.rows] == [
        ("1: binarize(clip=1.0, inclusive=True, keep='input')", 2)]
    assert report.rows[0].cosine == pytest.approx(1.0, abs=1e-12)


# ---- reproducible, and leaves the model and the random state as they were --------------------


def _noisy_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Dropout(0.3),
                         Calls(smooth_op()), nn.Linear(5, 2)).to(F64)


def test_seeded_runs_are_reproducible_and_leave_no_trace() -> None:
    model, batch = _noisy_model(), regression_batch()
    model.train()
    statistics = model[1].running_mean.clone(), int(model[1].num_batches_tracked)
    state = torch.get_rng_state()
    first = gradient_report(model, F.mse_loss, batch, reference="spsa", seed=5)
    again = gradient_report(model, F.mse_loss, batch, reference="spsa", seed=5)
    other = gradient_report(model, F.mse_loss, batch, reference="spsa", seed=6)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(model[1].running_mean, statistics[0])
    assert int(model[1].num_batches_tracked) == statistics[1]
    assert all(p.grad is None for p in model.parameters())
    row, same, different = first["3"], again["3"], other["3"]
    assert (row.cosine, row.norm_ratio) == (same.cosine, same.norm_ratio)
    assert torch.equal(row.expected, same.expected) and torch.equal(row.got, same.got)
    assert not torch.equal(row.expected, different.expected)
    # Every forward drew the same dropout mask: the differences are those of one function.
    assert row.cosine == pytest.approx(1.0, abs=1e-6)
    assert different.cosine == pytest.approx(1.0, abs=1e-6)


def test_state_kept_in_plain_attributes_starts_every_run_as_it_was() -> None:
    class Neuron(nn.Module):
        """A spiking neuron keeping its membrane in a plain attribute, None when reset."""

        def __init__(self) -> None:
            super().__init__()
            self.v: Tensor | None = None
            self.memories: dict[str, Any] = {"u": 0.0}  # as SpikingJelly's _memories

        def forward(self, x: Tensor) -> Tensor:
            self.v = x if self.v is None else 0.5 * self.v + x
            self.memories["u"] = self.memories["u"] + x
            return recipes.spike()(self.v + self.memories["u"] - 1.0)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), Neuron(), nn.Linear(5, 2)).to(F64)
    batch = regression_batch()
    row = only_row(gradient_report(model, F.mse_loss, batch))
    assert model[1].v is None and model[1].memories == {"u": 0.0}

    def by_hand(step: Callable[[Tensor], Tensor]) -> Tensor:  # from the fresh state
        x, y = batch
        h = model[0](x).detach().requires_grad_()
        (grad,) = torch.autograd.grad(F.mse_loss(model[2](step(2 * h - 1.0)), y), h)
        return grad / 2  # at the spike's input 2h - 1

    override, proxy = by_hand(recipes.spike()), by_hand(recipes.spike().proxy)
    assert row.cosine == pytest.approx(cosine(override, proxy), abs=1e-12)
    assert row.norm_ratio == pytest.approx(float(override.norm() / proxy.norm()), rel=1e-12)


def test_state_changed_in_place_is_put_back_and_reports_repeat() -> None:
    class Stateful(nn.Module):
        """A membrane updated in place, an EMA codebook (a frozen parameter) updated in its
        forward, and noise from a generator the module holds."""

        def __init__(self) -> None:
            super().__init__()
            self.v = torch.zeros(5, dtype=F64)
            self.codebook = nn.Parameter(torch.ones(5, dtype=F64), requires_grad=False)
            self.generator = torch.Generator().manual_seed(7)

        def forward(self, x: Tensor) -> Tensor:
            noise = torch.randn(5, generator=self.generator, dtype=F64)
            with torch.no_grad():
                self.v.mul_(0.5).add_(x.mean(0))
                self.codebook.data.mul_(0.9).add_(0.1 * x.mean(0))
            return recipes.spike()(x + self.v + self.codebook + 0.1 * noise - 1.0)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), Stateful(), nn.Linear(5, 2)).to(F64)
    stateful = model[1]
    before = (stateful.v.clone(), stateful.codebook.clone(), stateful.generator.get_state())
    batch = regression_batch()
    first = only_row(gradient_report(model, F.mse_loss, batch))
    assert torch.equal(stateful.v, before[0]) and torch.equal(stateful.codebook, before[1])
    assert torch.equal(stateful.generator.get_state(), before[2])
    second = only_row(gradient_report(model, F.mse_loss, batch))
    assert (second.cosine, second.norm_ratio) == (first.cosine, first.norm_ratio)


def test_the_report_runs_the_models_own_forward_bit_for_bit() -> None:
    # The probe the report adds to an input leaves it unchanged, the sign of zero included.
    @go.straight_through
    def signed(x: Tensor) -> Tensor:
        return torch.copysign(torch.ones_like(x), x)  # -0.0 -> -1, +0.0 -> +1

    x = torch.tensor([-0.0, 0.0, -0.0, 2.0], dtype=F64)
    weights = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=F64)

    def loss_fn(out: Tensor) -> Tensor:
        return (out * weights).sum()

    model = nn.Sequential(Applied(signed))
    report = gradient_report(model, loss_fn, x, proxies={"0": lambda x: x})
    assert report.loss == float(loss_fn(model(x))) == 5.0


def test_it_runs_under_no_grad() -> None:
    # The report's forwards enable gradients themselves (a module rule skips its op
    # without them), so a call from an evaluation loop gives the same numbers.
    model, batch = smooth_model(2.0), regression_batch()
    with torch.no_grad():
        row = only_row(gradient_report(model, F.mse_loss, batch, reference="spsa"))
    assert row.norm_ratio == pytest.approx(2.0, rel=1e-6)


def test_it_runs_on_every_device(device: torch.device) -> None:
    model = _noisy_model().to(device).train()
    x, y = (t.to(device) for t in regression_batch())
    states = torch.get_rng_state(), (
        torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
    first = gradient_report(model, F.mse_loss, (x, y), reference="spsa", samples=8)
    again = gradient_report(model, F.mse_loss, (x, y), reference="spsa", samples=8)
    proxy = gradient_report(model, F.mse_loss, (x, y), proxies={"3": F.softplus})
    assert torch.equal(torch.get_rng_state(), states[0])
    if device.type == "cuda":
        assert torch.equal(torch.cuda.get_rng_state(device), states[1])
    assert first["3"].got.device == device
    assert torch.equal(first["3"].expected, again["3"].expected)
    assert first["3"].cosine == pytest.approx(1.0, abs=1e-6)
    assert proxy["3"].cosine == pytest.approx(1.0, abs=1e-12)


# ---- the report ------------------------------------------------------------------------------


def test_the_report_prints_a_table_and_finds_rows() -> None:
    model, (x, y) = _binary_net(), _classification_batch()
    report = gradient_report(model, F.cross_entropy, (x, y))
    text = str(report)
    lines = text.splitlines()
    assert lines[0].startswith("gradient_report of Sequential against their proxies: loss ")
    assert lines[0].endswith("; 2 forwards, 2 backward passes")
    assert lines[1].split() == ["override", "kind", "calls", "cosine", "norm", "ratio",
                                "reference"]
    assert len(lines) == 5 and lines[3].startswith("1: binarize(clip=1.0")
    assert repr(report) == text
    assert report["2: binarize(clip=1.0, inclusive=True, keep='input')"] is report.rows[1]
    assert (report.forwards, report.backwards, report.reference) == (2, 2, "proxy")
    assert list(report) == list(report.rows) and len(report) == 2
    with pytest.raises(KeyError, match=r"no override .*7.*; the labels are .*1: binarize"):
        report["7"]


# ---- mistakes --------------------------------------------------------------------------------


def test_an_unknown_reference_names_the_accepted_ones() -> None:
    model, batch = smooth_model(), regression_batch()
    with pytest.raises(go.GradOverrideError, match=(
            r"gradient_report: unknown reference='fd'; the references are 'proxy', "
            r"'finite_differences', 'spsa', or a dict \{label: gradient\}")):
        gradient_report(model, F.mse_loss, batch, reference="fd")  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideTypeError, match=r"reference= must be one of .* got int 3"):
        gradient_report(model, F.mse_loss, batch, reference=3)  # type: ignore[arg-type]


def test_given_gradients_for_no_override_or_of_the_wrong_shape_are_refused() -> None:
    model, batch = smooth_model(times=2), regression_batch()
    with pytest.raises(go.GradOverrideError, match=(
            r"reference names '2: smooth', which is no override the forward called; the "
            r"overrides are '1: smooth'")):
        gradient_report(model, F.mse_loss, batch, reference={"2: smooth": torch.zeros(8, 5)})
    with pytest.raises(go.GradOverrideError, match=(
            r"the given gradient for `1: smooth` has shape \(8, 5\), but the gradient at its "
            r"input has shape \(2, 8, 5\) \(its 2 calls' inputs, stacked\)")):
        gradient_report(model, F.mse_loss, batch, reference={"1": torch.zeros(8, 5)})
    with pytest.raises(go.GradOverrideTypeError, match=r"maps override labels \(str\) to "
                       r"gradient tensors; got str '1' -> list"):
        gradient_report(model, F.mse_loss, batch, reference={"1": [0.0]})  # type: ignore[dict-item]


def test_proxy_mistakes_are_refused() -> None:
    model, batch = smooth_model(), regression_batch()
    with pytest.raises(go.GradOverrideError, match=(
            r"proxies names 'tanh', which is no override the forward called; the overrides "
            r"are '1: smooth'")):
        gradient_report(model, F.mse_loss, batch, proxies={"tanh": torch.tanh})
    with pytest.raises(go.GradOverrideError, match=(
            r"the proxy `.*<lambda>` of `1: smooth` returned a tensor of shape \(8,\), but the "
            r"override returned a tensor of shape \(8, 5\)")):
        gradient_report(model, F.mse_loss, batch, proxies={"1": lambda x: x.sum(1)})
    with pytest.raises(go.GradOverrideError, match=(
            r"`proxies=` applies to reference='proxy'; the reference here is 'spsa'")):
        gradient_report(model, F.mse_loss, batch, reference="spsa", proxies={"1": torch.tanh})
    with pytest.raises(go.GradOverrideTypeError, match=r"`proxies` maps overrides \(a label, "
                       r"name or module path, or the recipe or op itself\)"):
        gradient_report(model, F.mse_loss, batch, proxies={"1": 3})  # type: ignore[dict-item]


def test_a_proxy_that_raises_is_named() -> None:
    def broken(x: Tensor) -> Tensor:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no") as info:
        gradient_report(smooth_model(), F.mse_loss, regression_batch(), proxies={"1": broken})
    assert info.value.__notes__ == [
        "(raised by the proxy `test_a_proxy_that_raises_is_named.<locals>.broken` of "
        "`1: smooth`, called by gradient_report)"]


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"samples": 0}, go.GradOverrideError, r"`samples` must be a positive integer; got 0"),
    ({"step": -1.0}, go.GradOverrideError, r"`step` must be a positive finite number or None"),
    ({"seed": 1.5}, go.GradOverrideTypeError, r"`seed` must be an integer; got float 1.5"),
    ({"seed": 2**64}, go.GradOverrideError, r"`seed` must be in \[-2\*\*63, 2\*\*64\); got "
     r"18446744073709551616"),
])
def test_bad_numbers_are_refused(kwargs: dict[str, Any], error: type[Exception],
                                 pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        gradient_report(smooth_model(), F.mse_loss, regression_batch(), reference="spsa",
                        **kwargs)


def test_bad_models_losses_and_batches_are_refused() -> None:
    model, batch = smooth_model(), regression_batch()
    with pytest.raises(go.GradOverrideTypeError, match=r"needs the model as an nn\.Module; "
                       r"got function"):
        gradient_report(lambda x: x, F.mse_loss, batch)  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideError, match=r"runs the model eagerly; got the "
                       r"torch.compile'd Sequential. Pass the module itself: `model._orig_mod`"):
        gradient_report(torch.compile(model, backend="eager"), F.mse_loss, batch)
    inner = smooth_model()
    inner[1] = torch.compile(inner[1], backend="eager")  # type: ignore[assignment]
    with pytest.raises(go.GradOverrideError, match=r"runs the model eagerly, but `1` "
                       r"\(OptimizedModule\) is torch.compile'd .* Pass an uncompiled copy"):
        gradient_report(inner, F.mse_loss, batch)
    in_place = smooth_model()
    in_place.compile(backend="eager")
    with pytest.raises(go.GradOverrideError, match=r"runs the model eagerly, but the model "
                       r"itself \(Sequential\) is torch.compile'd"):
        gradient_report(in_place, F.mse_loss, batch)
    with pytest.raises(go.GradOverrideTypeError, match="`loss_fn` must be callable"):
        gradient_report(model, "mse", batch)  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideError, match=(
            r"`loss_fn` must return the loss as a scalar floating-point tensor; got a "
            r"torch.float64 tensor of shape \(8, 2\). Reduce it")):
        gradient_report(model, lambda out, y: out - y, batch)
    with pytest.raises(go.GradOverrideError, match=r"`batch` is empty; pass \(inputs, "
                       r"\*targets\)"):
        gradient_report(model, F.mse_loss, ())


def test_it_refuses_to_run_inside_a_monitor() -> None:
    model, batch = smooth_model(), regression_batch()
    with go.monitor(model), pytest.raises(go.GradOverrideError, match=(
            r"cannot run while a go.monitor is recording .* call it outside the `with "
            r"go.monitor\(...\)` block")):
        gradient_report(model, F.mse_loss, batch)


def test_direction_settings_with_another_reference_are_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 3), recipes.binarize().module())
    batch = torch.randn(4, 2)
    for name, value in (("samples", 8), ("step", 1e-3)):
        with pytest.raises(go.GradOverrideError, match=rf"`{name}=` applies to "
                           r"reference='finite_differences' or 'spsa'; the reference here is "
                           r"'proxy'"):
            gradient_report(model, lambda out: out.sum(), batch, **{name: value})
