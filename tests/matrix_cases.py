"""One case per op kind of the support matrix (`gradoverride._support_matrix`).

A case is an `nn.Module` of one input `x` (shape (4, 3), float32) doing one op of its kind,
with at least one parameter (so `functional_call` has something to pass), built two ways:

* `build()`: a fresh module with fresh ops and classes, for the contexts whose point is a
  first call (`torch.compile` with nothing run eagerly before);
* `saved`: a module-level instance made of module-level ops and classes, which pickle by
  reference, for `torch.save` / `deepcopy`.

`reference(module, x, upstream)` computes the gradients of `sum(module(x) * upstream)` with
respect to `x` and each parameter independently: the rule's math written out, or plain
autograd of a smooth proxy. The matrix test checks eager mode against it, then every other
context against eager mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

import gradoverride as go
from gradoverride.recipes import (
    blackbox_solver,
    lsq,
    reverse_grad,
    rotation_trick,
    spike,
    ste_argmax,
    ste_round,
)

Grads = dict[str, Tensor]


@dataclass(frozen=True)
class Case:
    kind: str
    build: Callable[[], nn.Module]
    saved: nn.Module
    reference: Callable[[nn.Module, Tensor, Tensor], Grads]


def _params(module: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach() for name, p in module.named_parameters()}


class OpModule(nn.Module):
    """`op(x * scale)` (or `op(x) * scale`): a function kind inside a module with a parameter."""

    def __init__(self, op: Callable[[Tensor], Tensor], after: bool = False) -> None:
        super().__init__()
        self.op = op
        self.after = after
        self.scale = nn.Parameter(torch.tensor(1.25))

    def forward(self, x: Tensor) -> Tensor:
        if self.after:
            return self.op(x) * self.scale
        return self.op(x * self.scale)


def _before(grad_h: Tensor, x: Tensor, scale: Tensor) -> Grads:
    """Gradients for `op(x * scale)` given the gradient `grad_h` at the op's input."""
    return {"x": grad_h * scale, "scale": (grad_h * x).sum()}


# ---- custom_backward -------------------------------------------------------------------------
#
# Each op is defined at module level (so `saved` pickles it by reference); `_fresh(op)` makes
# a new op of the same forward and rule, never called before.


def _fresh(op: go.CustomBackward[..., Tensor]) -> go.CustomBackward[..., Tensor]:
    rule = op._rule
    assert rule is not None
    owned = tuple(n for n, o in zip(op.parameters, rule.owned, strict=True) if o)
    return go.custom_backward(
        op.__wrapped__,
        residuals=op._residuals,
        backward=rule.rule,
        owns=owned if rule.owns_declared else None,
        once_differentiable=rule.once_differentiable,
    )


@go.custom_backward
def quantized(x: Tensor) -> Tensor:
    return torch.round(x * 4) / 4


@quantized.backward
def _(grad: Tensor, *, x: Tensor) -> Tensor:
    return grad * (x.abs() <= 1)


def _ref_owning(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    s = _params(m)["scale"]
    return _before(up * ((x * s).abs() <= 1), x, s)


@go.custom_backward(owns="x")
def weighted(x: Tensor, w: Tensor) -> Tensor:
    return torch.round(x * 4) / 4 * w


@weighted.backward
def _(grad: Tensor, *, w: Tensor) -> Tensor:
    return grad * w * 2


class OwnsModule(nn.Module):
    """`weighted(x, w)`: the rule owns `x`; `w` gets its autograd gradient."""

    def __init__(self, op: Callable[[Tensor, Tensor], Tensor]) -> None:
        super().__init__()
        self.op = op
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.op(x, self.w)


def _ref_owns(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    w = _params(m)["w"]
    return {"x": up * w * 2, "w": (up * torch.round(x * 4) / 4).sum(0)}


@go.custom_backward(residuals="cosh")
def sinh(x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    e = torch.exp(x)
    return (e - 1 / e) / 2, {"cosh": (e + 1 / e) / 2}


@sinh.backward
def _(grad: Tensor, *, cosh: Tensor) -> Tensor:
    return grad * cosh


def _ref_sinh(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    s = _params(m)["scale"]
    return _before(up * torch.cosh(x * s), x, s)


@go.custom_backward(once_differentiable=True)
def cube(x: Tensor) -> Tensor:
    return x**3


@cube.backward
def _(grad: Tensor, *, x: Tensor) -> Tensor:
    return grad * 3 * x**2


def _ref_cube(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    s = _params(m)["scale"]
    return _before(up * 3 * (x * s) ** 2, x, s)


# ---- straight_through --------------------------------------------------------------------------


def _sign(x: Tensor) -> Tensor:
    return torch.sign(x)


def _heaviside(x: Tensor) -> Tensor:
    return (x > 0).to(x.dtype)


def _ref_identity(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    return _before(up, x, _params(m)["scale"])


def _ref_clip(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    s = _params(m)["scale"]
    return _before(up * ((x * s).abs() <= 1), x, s)


def _ref_surrogate(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    s = _params(m)["scale"]
    return _before(up * (1 - torch.tanh(x * s) ** 2), x, s)


# ---- modules ---------------------------------------------------------------------------------


def _make_layer(base: type[nn.Module], owns: str | None) -> nn.Module:
    keywords = {} if owns is None else {"owns": owns}

    class Layer(base, **keywords):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.Parameter(torch.linspace(0.5, 1.5, 3))

        def forward(self, x: Tensor) -> Tensor:
            return torch.round(x * 4) / 4 * self.weights

        def backward(self, grad: Tensor, *, x: Tensor) -> dict[str, Tensor]:
            if owns is None:
                return {"x": grad * self.weights * 2, "weights": (grad * x).sum(0)}
            return {"x": grad * self.weights * 2}

    return Layer()


class ForumLayer(go.Module):
    """The forum's layer, rounding its input: the rule gives both gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: Tensor) -> Tensor:
        return torch.round(x * 4) / 4 * self.weights

    def backward(self, grad: Tensor, *, x: Tensor) -> dict[str, Tensor]:
        return {"x": grad * self.weights * 2, "weights": (grad * x).sum(0)}


class ForumLayerOwnsX(go.Module, owns="x"):
    """The same layer; the rule owns `x`, `weights` keeps its autograd gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: Tensor) -> Tensor:
        return torch.round(x * 4) / 4 * self.weights

    def backward(self, grad: Tensor, *, x: Tensor) -> dict[str, Tensor]:
        return {"x": grad * self.weights * 2}


def _ref_layer(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    w = _params(m)["weights"]
    return {"x": up * w * 2, "weights": (up * x).sum(0)}


def _ref_layer_owns(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    w = _params(m)["weights"]
    return {"x": up * w * 2, "weights": (up * torch.round(x * 4) / 4).sum(0)}


def linear_rule(grad: Tensor, *, input: Tensor, module: nn.Module) -> Grads:
    """nn.Linear's own gradients, the input's doubled (so the override shows)."""
    return {"input": grad @ module.weight * 2, "weight": grad.T @ input, "bias": grad.sum(0)}


def _linear() -> nn.Linear:
    linear = nn.Linear(3, 3)
    with torch.no_grad():
        linear.weight.copy_(torch.linspace(-1, 1, 9).reshape(3, 3))
        linear.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    return linear


def _overridden() -> nn.Module:
    linear = _linear()
    go.override_backward(linear, linear_rule)
    return linear


def _ref_linear(m: nn.Module, x: Tensor, up: Tensor, input_factor: float = 1.0,
                output_factor: float = 1.0, param_factor: float = 1.0) -> Grads:
    p = _params(m)
    g = up * output_factor
    return {
        "x": g @ p["weight"] * input_factor,
        "weight": g.T @ x * param_factor,
        "bias": g.sum(0) * param_factor,
    }


def triple(grad: Tensor) -> Tensor:
    """The grad_hook transform of the matrix (module level, so hooked modules pickle)."""
    return grad * 3


def _hooked(at: str) -> nn.Module:
    linear = _linear()
    go.grad_hook(linear, triple, at=at)  # type: ignore[arg-type]
    return linear


# ---- recipes ---------------------------------------------------------------------------------

ROUND = ste_round()
SPIKE = spike("arctan")
REVERSE = reverse_grad(scale=0.5)
ARGMAX = ste_argmax(dim=-1)
LSQ = lsq(bits=4)


def _ref_round(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    return _before(up, x, _params(m)["scale"])


def _ref_spike(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    s = _params(m)["scale"]
    v = x * s
    return _before(up * 1.0 / (1 + (math.pi * v) ** 2), x, s)  # (a/2)/(1+(pi a v/2)^2), a=2


SAMPLED = spike("circ", alpha=1.5, sample=True)
NOISY = spike("leaky_relu", leak=0.1, spread=0.4)


def _noise_for(h: Tensor) -> Tensor:
    """Noise in [0, 1) that is a function of the input, so that every context (dynamic
    shapes, checkpoint's recomputation, per-sample vmap) sees the same numbers."""
    # (v - floor(v), not torch.frac: the TorchScript-based ONNX exporter has no frac.)
    v = h.detach().abs() * 7.31 + 0.137
    return v - torch.floor(v)


class StochasticSpikes(nn.Module):
    """A sampled spike and a spike with a noisy gradient of `x * scale`, given their noise
    (`op` is what scripting sees: its module form)."""

    def __init__(self) -> None:
        super().__init__()
        self.op = SAMPLED
        self.noisy = NOISY
        self.scale = nn.Parameter(torch.tensor(1.25))

    def forward(self, x: Tensor) -> Tensor:
        h = x * self.scale
        u = _noise_for(h)
        return self.op(h, noise=u) + 2 * self.noisy(h, noise=u)


def _ref_stochastic(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    s = _params(m)["scale"]
    h = x * s
    u = _noise_for(h)
    sampled = 0.75 / (1 + (1.5 * h) ** 2) ** 1.5  # circ, a = 1.5: (a/2) / (1 + (a h)^2)^1.5
    noisy = torch.where(h > 0, 1.0, 0.1 + 0.4 * (u - 0.5))
    return _before(up * (sampled + 2 * noisy), x, s)


def _ref_reverse(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    return _before(-0.5 * up, x, _params(m)["scale"])


def _ref_argmax(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    # ste_argmax's backward is the softmax's (temperature 1): independent, by autograd.
    s = _params(m)["scale"]
    v = (x * s).requires_grad_()
    (gv,) = torch.autograd.grad((torch.softmax(v, -1) * up).sum(), v)
    return _before(gv, x, s)


class LsqModule(nn.Module):
    """`lsq(4 bits)(x, step)` with the step a parameter."""

    op = LSQ  # the recipe; its own module form is `LSQ.module()`

    def __init__(self) -> None:
        super().__init__()
        self.step = nn.Parameter(torch.tensor(0.2))

    def forward(self, x: Tensor) -> Tensor:
        return LSQ(x, self.step)


def _ref_lsq(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    s = _params(m)["step"]
    v = x / s
    qn, qp = 8, 7
    inside = (v > -qn) & (v < qp)
    d = torch.where(inside, torch.round(v) - v, torch.where(v <= -qn, -qn, qp))
    g = 1 / math.sqrt(x.numel() * qp)
    return {"x": up * inside, "step": (up * d).sum() * g}


ROTATION = rotation_trick()
#: The codebook the rotation trick case quantizes to, a fixed tensor (5 codes of 3).
CODEBOOK = torch.tensor([[1.0, -0.5, 0.25], [-1.0, 2.0, 0.5], [0.5, 0.5, -1.5], [0.0, 1.0, 1.0],
                         [-0.8, -0.6, 0.3]])


def _nearest_codes(v: Tensor) -> Tensor:
    """Each row's nearest code (vector quantization's lookup)."""
    return CODEBOOK[((v.unsqueeze(-2) - CODEBOOK) ** 2).sum(-1).argmin(-1)]


class RotationModule(nn.Module):
    """`rotation_trick()(v, nearest code of v)` with v = x * scale: vector quantization."""

    op = ROTATION  # the recipe; its module form is `ROTATION.module()`

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.25))

    def forward(self, x: Tensor) -> Tensor:
        v = x * self.scale
        return ROTATION(v, _nearest_codes(v.detach()))


def _ref_rotation(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    # The paper's estimator as an explicit matrix per row: (lambda R)^T up, with R taking
    # the row's direction to its code's and lambda = |code| / |row|.
    s = _params(m)["scale"]
    rows = []
    v = x * s
    for e, c, g in zip(v, _nearest_codes(v), up, strict=True):
        u, d = e / e.norm(), c / c.norm()
        w = (u + d) / (u + d).norm()
        rotation = torch.eye(3) - 2 * torch.outer(w, w) + 2 * torch.outer(d, u)
        rows.append(c.norm() / e.norm() * rotation.T @ g)
    return _before(torch.stack(rows), x, s)


def cheapest_per_row(costs: np.ndarray) -> np.ndarray:
    """The solver of the matrix: a one-hot of the cheapest entry (a linear objective's argmin)."""
    out = np.zeros_like(costs)
    out[np.argmin(costs)] = 1
    return out


SOLVER = blackbox_solver(cheapest_per_row, lambda_=2.0, numpy=True)


def _ref_solver(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    s = _params(m)["scale"]
    w = x * s
    lam = 2.0

    def solve(costs: Tensor) -> Tensor:
        return nn.functional.one_hot(costs.argmin(-1), costs.shape[-1]).to(costs.dtype)

    grad_w = -(solve(w) - solve(w + lam * up)) / lam
    return _before(grad_w, x, s)


def _sine(x: np.ndarray) -> np.ndarray:
    return np.sin(x)


def sine_rule(grad: np.ndarray, *, x: np.ndarray) -> np.ndarray:
    return grad * np.cos(x)


def sine_outputs(x: Tensor) -> Tensor:
    """What `_sine` returns, for the compiler and the exporter (`outputs=`)."""
    return torch.empty_like(x)


SINE = go.bridge(_sine, backward=sine_rule, outputs=sine_outputs)


def _ref_sine(m: nn.Module, x: Tensor, up: Tensor) -> Grads:
    s = _params(m)["scale"]
    return _before(up * torch.cos(x * s), x, s)


# ---- the cases ---------------------------------------------------------------------------------

SIGN_ST = go.straight_through(_sign)
SIGN_CLIP = go.straight_through(clip=1.0)(_sign)
STEP_TANH = go.straight_through(surrogate=torch.tanh)(_heaviside)


def _op(op: Callable[..., Tensor]) -> Callable[[], nn.Module]:
    return lambda: OpModule(op)


CASES: dict[str, Case] = {
    case.kind: case
    for case in (
        Case("custom_backward", lambda: OpModule(_fresh(quantized)), OpModule(quantized),
             _ref_owning),
        Case("custom_backward owns=", lambda: OwnsModule(_fresh(weighted)), OwnsModule(weighted),
             _ref_owns),
        Case("custom_backward residuals", lambda: OpModule(_fresh(sinh)), OpModule(sinh),
             _ref_sinh),
        Case("custom_backward once_differentiable", lambda: OpModule(_fresh(cube)),
             OpModule(cube), _ref_cube),
        Case("straight_through", lambda: OpModule(go.straight_through(_sign)), OpModule(SIGN_ST),
             _ref_identity),
        Case("straight_through clip", lambda: OpModule(go.straight_through(clip=1.0)(_sign)),
             OpModule(SIGN_CLIP), _ref_clip),
        Case("straight_through surrogate",
             lambda: OpModule(go.straight_through(surrogate=torch.tanh)(_heaviside)),
             OpModule(STEP_TANH), _ref_surrogate),
        Case("go.Module", lambda: _make_layer(go.Module, None), ForumLayer(), _ref_layer),
        Case("go.Module owns=", lambda: _make_layer(go.Module, "x"), ForumLayerOwnsX(),
             _ref_layer_owns),
        Case("override_backward", _overridden, _overridden(),
             lambda m, x, up: _ref_linear(m, x, up, input_factor=2.0)),
        Case("grad_hook inputs", lambda: _hooked("inputs"), _hooked("inputs"),
             lambda m, x, up: _ref_linear(m, x, up, input_factor=3.0)),
        Case("grad_hook outputs", lambda: _hooked("outputs"), _hooked("outputs"),
             lambda m, x, up: _ref_linear(m, x, up, output_factor=3.0)),
        Case("grad_hook parameters", lambda: _hooked("parameters"), _hooked("parameters"),
             lambda m, x, up: _ref_linear(m, x, up, param_factor=3.0)),
        Case("recipe: straight-through estimator", _op(ste_round()), OpModule(ROUND),
             _ref_round),
        Case("recipe: learned step (lsq)", LsqModule, LsqModule(), _ref_lsq),
        Case("recipe: surrogate spike", _op(spike("arctan")), OpModule(SPIKE), _ref_spike),
        Case("recipe: stochastic spike", StochasticSpikes, StochasticSpikes(),
             _ref_stochastic),
        Case("recipe: gradient flow", lambda: OpModule(reverse_grad(scale=0.5).module()),
             OpModule(REVERSE.module()), _ref_reverse),
        Case("recipe: discrete choice", _op(ste_argmax(dim=-1)), OpModule(ARGMAX),
             _ref_argmax),
        Case("recipe: rotation trick", RotationModule, RotationModule(), _ref_rotation),
        Case("recipe: black-box solver",
             _op(blackbox_solver(cheapest_per_row, lambda_=2.0, numpy=True)),
             OpModule(SOLVER), _ref_solver),
        Case("bridge", _op(go.bridge(_sine, backward=sine_rule, outputs=sine_outputs)),
             OpModule(SINE), _ref_sine),
    )
}
