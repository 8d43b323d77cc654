"""Straight-through recipes: each forward is the non-differentiable op exactly, each backward
the formula in its docstring; dtypes kept; boundaries exact; compile, vmap and peer parity."""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import grad as func_grad
from torch.func import vmap

import gradoverride as go
from gradoverride import recipes as R
from gradoverride.testing import assert_consistent
from gradoverride.testing import strategies as gst

EDGES = (0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, -1.5)

_TORCH_CTX_WARNING = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated:DeprecationWarning"
)


def _grad(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, g: torch.Tensor) -> Any:
    leaf = x.detach().requires_grad_()
    y = fn(leaf)
    (gx,) = torch.autograd.grad(y, leaf, g)
    return y.detach(), gx


def _upstream(x: torch.Tensor) -> torch.Tensor:
    return torch.randn(x.shape, dtype=torch.float64).to(x.dtype)


def _window(x: torch.Tensor, g: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.where((x >= low) & (x <= high), g, torch.zeros_like(g))


# ---- identity-gradient recipes ----------------------------------------------------------------

IDENTITY = [
    (R.ste_round(), torch.round),
    (R.ste_floor(), torch.floor),
    (R.ste_ceil(), torch.ceil),
    (R.ste_sign(), torch.sign),
    (R.ste_clamp(-1.0, 0.5, outside="pass"), lambda x: torch.clamp(x, -1.0, 0.5)),
    (R.binarize(clip=None), lambda x: torch.where(x < 0, -1.0, 1.0).to(x.dtype)),
]


@pytest.mark.parametrize("recipe,op", IDENTITY, ids=[repr(r) for r, _ in IDENTITY])
@given(x=gst.tensors(edges=EDGES, scale=3.0))
def test_forward_is_the_op_and_gradient_passes(recipe: Any, op: Any, x: torch.Tensor) -> None:
    g = _upstream(x)
    y, gx = _grad(recipe, x, g)
    assert y.dtype == x.dtype and gx.dtype == x.dtype
    assert torch.equal(y, op(x))
    assert torch.equal(gx, g)


def test_values_at_zero_and_halves() -> None:
    x = torch.tensor([-0.0, 0.0, 0.5, 1.5, -0.5, -2.5])
    assert R.ste_round()(x).tolist() == [0, 0, 0, 2, 0, -2]  # halves to even
    assert R.ste_sign()(x).tolist() == [0, 0, 1, 1, -1, -1]  # sign(0) = 0
    assert R.binarize()(x).tolist() == [1, 1, 1, 1, -1, -1]  # 0 and -0 -> +1


# ---- windowed gradients ---------------------------------------------------------------------

WINDOWED = [
    (R.ste_clamp(-1.0, 0.5, outside="zero"), -1.0, 0.5),
    (R.ste_clamp(-1.0, 0.5, outside="zero", keep="mask"), -1.0, 0.5),
    (R.binarize(), -1.0, 1.0),
    (R.binarize(clip=0.5, keep="mask"), -0.5, 0.5),
]


@pytest.mark.parametrize("recipe,low,high", WINDOWED, ids=[repr(r) for r, *_ in WINDOWED])
@given(x=gst.tensors(edges=EDGES, scale=2.0))
def test_window_gradient_bounds_included(
    recipe: Any, low: float, high: float, x: torch.Tensor
) -> None:
    g = _upstream(x)
    _, gx = _grad(recipe, x, g)
    assert gx.dtype == x.dtype
    assert torch.equal(gx, _window(x, g, low, high))


@given(x=gst.tensors(edges=EDGES, scale=2.0, dtype=gst.float_dtypes(low_precision=False)))
def test_clamp_zero_is_torch_clamps_own_gradient(x: torch.Tensor) -> None:
    g = _upstream(x)
    recipe = R.ste_clamp(-1.0, 0.5, outside="zero")
    y, gx = _grad(recipe, x, g)
    expected_y, expected = _grad(lambda t: torch.clamp(t, -1.0, 0.5), x, g)
    assert torch.equal(y, expected_y) and torch.equal(gx, expected)


@given(x=gst.tensors(scale=2.0, dtype=gst.float_dtypes(low_precision=False)))
def test_binarize_gradient_is_hardtanhs_away_from_the_bounds(x: torch.Tensor) -> None:
    x = torch.where(x.abs() == 1, 0.5, x)  # hardtanh's own gradient is 0 at exactly +-1
    g = _upstream(x)
    _, gx = _grad(R.binarize(), x, g)
    _, expected = _grad(nn.functional.hardtanh, x, g)
    assert torch.equal(gx, expected)


# ---- ternarize ------------------------------------------------------------------------------


def _work(x: torch.Tensor) -> torch.Tensor:
    """x in float32 when it is float16/bfloat16: reductions and codes are computed there."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _twn(x: torch.Tensor, factor: float, scaled: bool) -> torch.Tensor:
    m = _work(x).abs()
    keep = m > m.mean() * factor
    t = torch.sign(_work(x)) * keep
    if not scaled:
        return t.to(x.dtype)
    return (t * ((m * keep).sum() / keep.sum().clamp_min(1))).to(x.dtype)


@pytest.mark.parametrize("scaled", [True, False])
@given(x=gst.tensors(shape=gst.shapes(min_side=1), edges=EDGES))
def test_ternarize_is_twn(scaled: bool, x: torch.Tensor) -> None:
    g = _upstream(x)
    y, gx = _grad(R.ternarize(scaled=scaled), x, g)
    assert y.dtype == x.dtype
    assert torch.equal(y, _twn(x, 0.7, scaled))
    assert torch.equal(gx, g)


def test_ternarize_threshold_and_scale_exactly() -> None:
    x = torch.tensor([1.0, -2.0, 0.7, 0.0, -0.5])  # mean |x| = 0.84, delta = 0.588
    assert R.ternarize(scaled=False)(x).tolist() == [1, -1, 1, 0, 0]
    alpha = (1.0 + 2.0 + 0.7) / 3
    torch.testing.assert_close(R.ternarize()(x), torch.tensor([1, -1, 1, 0, 0]) * alpha)
    at_delta = torch.tensor([2.0, 1.0, 0.0])  # mean |x| = 1 = delta: |x| == delta gives 0
    assert R.ternarize(delta_factor=1.0, scaled=False)(at_delta).tolist() == [1, 0, 0]
    assert R.ternarize()(torch.zeros(3)).tolist() == [0, 0, 0]
    assert R.ternarize()(torch.empty(0)).shape == (0,)


# ---- quantize ---------------------------------------------------------------------------------


def _quantize_reference(
    x: torch.Tensor, bits: int, symmetric: bool, bound: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The docstring's formula, step by step (in float32 for half inputs): (y, grad mask)."""
    out_dtype = x.dtype
    x = _work(x)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        qmin = -qmax
        top = x.abs().amax() if bound is None else torch.tensor(bound, dtype=x.dtype)
        s = torch.where(top > 0, top, 1) / qmax
        z = torch.zeros((), dtype=x.dtype)
    else:
        qmin, qmax = 0, 2**bits - 1
        if bound is None:
            lo, hi = x.amin().clamp_max(0), x.amax().clamp_min(0)
            span = hi - lo
            s = torch.where(span > 0, span, 1) / qmax
            z = torch.round(-lo / s).clamp(qmin, qmax)
        else:
            low, high = min(bound[0], 0.0), max(bound[1], 0.0)  # the range includes 0
            s = torch.tensor((high - low) / qmax, dtype=torch.float64)
            z = torch.tensor(float(min(max(round(-low / s.item()), qmin), qmax)))
            s, z = s.item(), z.item()  # type: ignore[assignment]
    q = torch.round(x / s) + z
    inside = (q >= qmin) & (q <= qmax)
    return ((q.clamp(qmin, qmax) - z) * s).to(out_dtype), inside


QUANTIZERS = [
    R.quantize(bits=4),
    R.quantize(bits=3, symmetric=False),
    R.quantize(bits=2, bound=1.0),
    R.quantize(bits=4, symmetric=False, bound=(-0.5, 1.5), keep="mask"),
]


@pytest.mark.parametrize("recipe", QUANTIZERS, ids=repr)
@given(x=gst.tensors(shape=gst.shapes(min_side=1), edges=EDGES, scale=1.5))
def test_quantize_is_its_formula(recipe: Any, x: torch.Tensor) -> None:
    g = _upstream(x)
    y, gx = _grad(recipe, x, g)
    expected, inside = _quantize_reference(x, recipe.bits, recipe.symmetric, recipe.bound)
    assert y.dtype == x.dtype and gx.dtype == x.dtype
    assert torch.equal(y, expected)
    assert torch.equal(gx, torch.where(inside, g, torch.zeros_like(g)))


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_matches_torch_fake_quantize(symmetric: bool) -> None:
    x = torch.linspace(-2.2, 1.7, 97)
    bound: Any = 1.0 if symmetric else (-1.0, 1.5)
    recipe = R.quantize(bits=4, symmetric=symmetric, bound=bound)
    s, z = recipe.scale_and_zero_point(x)
    qmin, qmax = (-7, 7) if symmetric else (0, 15)
    g = torch.rand(97)
    y, gx = _grad(recipe, x, g)
    ref_y, ref_g = _grad(
        lambda t: torch.fake_quantize_per_tensor_affine(t, float(s), int(z), qmin, qmax), x, g
    )
    torch.testing.assert_close(y, ref_y)
    assert torch.equal(gx, ref_g)


# ---- LSQ --------------------------------------------------------------------------------------


def _lsq_reference(x: torch.Tensor, s: torch.Tensor, qn: int, qp: int, g: float) -> torch.Tensor:
    """The paper's implementation: grad_scale and round_pass written with detach()."""
    s_scaled = (s - s * g).detach() + s * g
    v = torch.clamp(x / s_scaled, -qn, qp)
    v_bar = (v.round() - v).detach() + v
    return v_bar * s_scaled


@pytest.mark.parametrize("bits,signed", [(3, True), (2, False), (8, True)])
@given(x=gst.tensors(shape=gst.shapes(min_side=1), dtype=torch.float64, scale=2.0),
       step=st.floats(0.05, 1.0))
def test_lsq_gradients_are_the_papers(bits: int, signed: bool, x: torch.Tensor,
                                      step: float) -> None:
    recipe = R.lsq(bits=bits, signed=signed)
    qn, qp = recipe.code_range
    assert (qn, qp) == ((2 ** (bits - 1), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1))
    v = x / step
    x = torch.where((v == -qn) | (v == qp), x + step / 3, x)  # off the exact bounds
    s = torch.tensor(step, dtype=torch.float64)
    gy = _upstream(x)
    xl, sl = x.clone().requires_grad_(), s.clone().requires_grad_()
    y = recipe(xl, sl)
    gx, gs = torch.autograd.grad(y, (xl, sl), gy)
    xr, sr = x.clone().requires_grad_(), s.clone().requires_grad_()
    ref = _lsq_reference(xr, sr, qn, qp, 1 / math.sqrt(x.numel() * qp))
    rx, rs = torch.autograd.grad(ref, (xr, sr), gy)
    torch.testing.assert_close(y, ref.detach())
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gs, rs)


def test_lsq_step_gradient_at_the_bounds_and_per_channel_step() -> None:
    recipe = R.lsq(bits=2, signed=True, grad_scale=1.0)  # codes -2 .. 1
    x = torch.tensor([-2.0, 1.0, -3.0, 0.4], requires_grad=True)
    s = torch.tensor(1.0, requires_grad=True)
    y = recipe(x, s)
    gx, gs = torch.autograd.grad(y.sum(), (x, s))
    assert y.tolist() == [-2, 1, -2, 0]
    assert gx.tolist() == [0, 0, 0, 1]  # v == -Qn and v == Qp are outside
    torch.testing.assert_close(gs, torch.tensor(-2.0 + 1.0 - 2.0 + (0.0 - 0.4)))
    per_channel = torch.ones(2, 1, requires_grad=True)
    out = recipe(torch.randn(2, 5), per_channel)
    (g_pc,) = torch.autograd.grad(out.sum(), per_channel)
    assert g_pc.shape == (2, 1)


def test_lsq_module_initialises_and_keeps_a_loaded_step() -> None:
    quantizer = R.lsq(bits=4).module()
    assert isinstance(quantizer, R.LearnedStepQuantizer)
    assert repr(quantizer) == (
        "LearnedStepQuantizer(lsq(bits=4, signed=True, grad_scale=None, window='open'))"
    )
    x = torch.randn(64, 8)
    quantizer(x).sum().backward()
    torch.testing.assert_close(quantizer.step.detach(), 2 * x.abs().mean() / math.sqrt(7))
    assert quantizer.step.grad is not None
    fresh = R.lsq(bits=4).module()
    fresh.load_state_dict({"step": torch.tensor(0.25)})
    fresh(x)
    assert fresh.step.item() == 0.25
    assert copy.deepcopy(fresh).step.item() == 0.25
    # A checkpoint without a step (a float model's, strict=False) leaves it to the data.
    model = nn.Sequential(nn.Linear(8, 8), R.lsq(bits=4).module())
    model.load_state_dict(nn.Sequential(nn.Linear(8, 8)).state_dict(), strict=False)
    y = model[0](x)
    model(x)
    torch.testing.assert_close(model[1].step.detach(), 2 * y.detach().abs().mean() / math.sqrt(7))


# ---- all recipes: dtypes, extremes, module form, repr ----------------------------------------

ALL = [r for r, _ in IDENTITY] + [r for r, *_ in WINDOWED] + QUANTIZERS + [R.ternarize()] + [
    R.binarize(inclusive=False),
    R.ste_clamp(-1.0, 0.5, outside="zero", inclusive=(False, True), keep="mask"),
    R.ste_clamp(torch.tensor(-1.0), torch.tensor([0.5]), outside="zero"),
    R.ste_clamp(torch.tensor(-1.0), 1.0, outside="pass"),
    R.abs_subgradient(),
    R.abs_subgradient(at_zero=0.5),
]


@pytest.mark.parametrize("recipe", ALL, ids=repr)
@pytest.mark.parametrize(
    "dtype,big", [(torch.float16, 1e4), (torch.bfloat16, 1e30), (torch.float32, 1e30)], ids=str
)
def test_finite_gradients_at_extreme_inputs(recipe: Any, dtype: torch.dtype, big: float) -> None:
    x = torch.tensor([-big, -1.0, 0.0, 1.0, big], dtype=dtype)
    y, gx = _grad(recipe, x, torch.ones(5, dtype=dtype))
    assert y.dtype == dtype and gx.dtype == dtype
    assert torch.isfinite(gx).all()


def test_reprs_are_the_calls() -> None:
    assert repr(R.ste_round()) == "ste_round()"
    assert repr(R.ste_clamp(-1.0, 1.0, outside="zero")) == (
        "ste_clamp(low=-1.0, high=1.0, outside='zero', inclusive=True, keep='input')"
    )
    assert repr(R.binarize(clip=0.5, keep="mask")) == (
        "binarize(clip=0.5, inclusive=True, keep='mask')"
    )
    assert repr(R.quantize(bits=4)) == "quantize(bits=4, symmetric=True, bound=None, keep='input')"
    assert R.binarize() == R.binarize(clip=1.0) and hash(R.binarize()) == hash(R.binarize())


def test_module_form_in_sequential() -> None:
    model = nn.Sequential(nn.Linear(3, 4), R.binarize().module(), nn.Linear(4, 1))
    assert "binarize(clip=1.0, inclusive=True, keep='input')" in repr(model)
    model(torch.randn(5, 3)).sum().backward()
    assert model[0].weight.grad is not None


def test_on_each_device(device: torch.device) -> None:
    x = torch.tensor([-2.0, -0.5, 0.0, 0.7, 3.0], device=device)
    g = torch.ones(5, device=device)
    for recipe in ALL:
        y, gx = _grad(recipe, x, g)
        assert y.device == device and gx.device == device


# ---- composition ------------------------------------------------------------------------------


@pytest.mark.compile
@_TORCH_CTX_WARNING
def test_every_recipe_compiles_with_fullgraph_and_matches_eager() -> None:
    x0 = torch.tensor([[-2.0, -1.0, -0.5, 0.0], [0.5, 1.0, 1.5, 0.3]])
    s0 = torch.tensor(0.5)
    w = torch.arange(8.0).reshape(2, 4)
    quantizer = R.lsq(bits=3)

    def loss(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        total = (quantizer(x, s) * w).sum()
        for recipe in ALL:
            total = total + (recipe(x) * w).sum()
        return total

    assert_consistent(loss, x0, s0, modes=("compile",))


@pytest.mark.compile
@_TORCH_CTX_WARNING
@pytest.mark.parametrize("recipe,low,high", WINDOWED, ids=[repr(r) for r, *_ in WINDOWED])
def test_windows_compile_with_dynamic_shapes_and_match_eager(
    recipe: Any, low: float, high: float
) -> None:
    # Under dynamic shapes dynamo traces the bounds as symbolic floats: the window must still
    # compile (it once failed rounding them at trace time) and include its bounds.
    from torch._dynamo.testing import CompileCounterWithBackend

    at_bounds = [low, high, math.nextafter(low, -2.0), math.nextafter(high, 2.0)]
    inputs = [
        torch.tensor([*at_bounds, -2.0, 0.0, 0.75, 2.0]),
        torch.tensor([*at_bounds, -3.0, -0.25, 0.5, 0.9, 1.5, 3.0, -0.0]),
    ]
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(recipe, dynamic=True, fullgraph=True, backend=counter)
        compiles = []
        for x in inputs:
            g = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
            y, gx = _grad(recipe, x, g)
            y_c, gx_c = _grad(compiled, x, g)
            assert torch.equal(y_c, y) and torch.equal(gx_c, gx), (x, gx_c, gx)
            assert torch.equal(gx, _window(x, g, low, high))
            compiles.append(counter.frame_count)
    finally:
        torch._dynamo.reset()
    assert compiles[1] == compiles[0]  # the graph for the first shape serves the second


@pytest.mark.parametrize(
    "recipe", [R.ste_round(), R.binarize(), R.ste_clamp(-1.0, 1.0, outside="zero"),
               R.quantize(bits=3, bound=1.0)], ids=repr
)
def test_vmap_of_grad_matches_the_loop(recipe: Any) -> None:
    xs = torch.tensor([[-2.0, -1.0, 0.3, 1.0], [0.5, 1.5, -0.2, 0.0]])

    def f(x: torch.Tensor) -> torch.Tensor:
        return (recipe(x) * torch.arange(1.0, 5.0)).sum()

    torch.testing.assert_close(vmap(func_grad(f))(xs), torch.stack([func_grad(f)(x) for x in xs]))


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,error,message",
    [
        (lambda: R.ste_clamp(-1.0, 1.0, outside="clip"), go.GradOverrideError,
         r"ste_clamp: `outside` must be 'pass' .* or 'zero' .*; got 'clip'\."),
        (lambda: R.ste_clamp(1.0, -1.0, outside="zero"), go.GradOverrideError,
         r"ste_clamp: `\(low, high\)` as a pair must be \(low, high\) with low <= high; got "
         r"\(1\.0, -1\.0\)"),
        (lambda: R.binarize(keep="weights"), go.GradOverrideError,
         r"binarize: `keep` must be 'input' .* or 'mask' .*; got 'weights'\."),
        (lambda: R.binarize(clip=-1.0), go.GradOverrideError,
         r"binarize: `clip` must be a bound c >= 0"),
        (lambda: R.ternarize(delta_factor=-0.7), go.GradOverrideError,
         r"ternarize: `delta_factor` must be a finite number >= 0 \(TWN uses 0\.7\); got -0\.7"),
        (lambda: R.quantize(bits=1), go.GradOverrideError,
         r"quantize: `bits` must be an integer from 2 to 16; got int 1\."),
        (lambda: R.quantize(bits=8, bound=(-1.0, 1.0)), go.GradOverrideError,
         r"quantize\(symmetric=True\): `bound` is one number B for the range \[-B, B\]; got "
         r"the pair \(-1\.0, 1\.0\)\. Pass `bound=1\.0`, or `symmetric=False`"),
        (lambda: R.quantize(symmetric=False, bound=(1.0, 1.0)), go.GradOverrideError,
         r"quantize\(symmetric=False\): `bound` must be a pair \(low, high\) of finite numbers "
         r"with low < high; got \(1\.0, 1\.0\)\."),
        (lambda: R.quantize(bound=0.0), go.GradOverrideError,
         r"quantize: `bound` must be a positive finite number; got float 0\.0\."),
        (lambda: R.lsq(bits=17), go.GradOverrideError,
         r"lsq: `bits` must be an integer from 2 to 16; got int 17\."),
        (lambda: R.lsq(grad_scale=0.0), go.GradOverrideError,
         r"lsq: `grad_scale` must be a positive finite number; got float 0\.0\."),
        (lambda: R.lsq()(torch.ones(2), 0.5), go.GradOverrideTypeError,
         r"lsq\(bits=8, signed=True, grad_scale=None, window='open'\): `step` must be a "
         r"tensor \(a learnable parameter\), got float 0\.5; use "
         r"`lsq\(\.\.\.\)\.module\(\)` to hold it\."),
    ],
)
def test_mistakes_are_errors_that_name_the_fix(make: Any, error: type[Exception],
                                               message: str) -> None:
    with pytest.raises(error, match=message):
        make()


_FLOAT_DTYPES_TEXT = r"must be a floating-point tensor \(float16, bfloat16, float32 or float64\)"


@pytest.mark.parametrize("recipe", [*ALL, R.lsq(bits=3)], ids=repr)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.uint8, torch.bool], ids=str)
def test_integer_inputs_are_errors_that_name_the_recipe_and_the_fix(
    recipe: Any, dtype: torch.dtype
) -> None:
    # An integer or bool tensor never gets a gradient, and every recipe here exists for its
    # gradient: once a raw torch error or a silently truncated result.
    x = torch.tensor([0, 1, 1], dtype=dtype)
    args = (x, torch.tensor(0.5)) if isinstance(recipe, R.lsq) else (x,)
    message = (
        rf"{re.escape(repr(recipe))}: `x` {_FLOAT_DTYPES_TEXT}; got a {re.escape(str(dtype))} "
        r"tensor, which gets no gradient\. Convert it first: `x\.float\(\)`\.$"
    )
    with pytest.raises(go.GradOverrideTypeError, match=message):
        recipe(*args)


def test_lsq_integer_step_and_module_input_are_errors() -> None:
    recipe = R.lsq(bits=3)
    with pytest.raises(go.GradOverrideTypeError,
                       match=r"lsq\(bits=3, .*\): `step` must be a floating-point tensor .* got "
                             r"a torch\.int64 tensor, .* `step\.float\(\)`"):
        recipe(torch.ones(3), torch.tensor(1))
    for call in (recipe.module(), recipe.init_step):
        with pytest.raises(go.GradOverrideTypeError,
                           match=r"lsq\(bits=3, .*\): `x` must be a floating-point tensor .* "
                                 r"got a torch\.int32 tensor"):
            call(torch.ones(3, dtype=torch.int32))


def test_complex_and_non_tensor_inputs_are_errors() -> None:
    with pytest.raises(go.GradOverrideTypeError,
                       match=r"binarize\(.*\): `x` must be a floating-point tensor .*; got a "
                             r"torch\.complex64 tensor \(the recipes are defined on real "
                             r"numbers\)\.$"):
        R.binarize()(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(go.GradOverrideTypeError,
                       match=r"ste_round\(\): `x` must be a floating-point tensor .*; got list\. "
                             r"Convert it first: `torch\.as_tensor\(x, dtype=torch\.float32\)`"):
        R.ste_round()([0.5, 1.5])


# ---- peers ------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore")  # brevitas's own deprecation warnings
def test_brevitas_parity() -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import brevitas.function.ops_ste as bv
    except Exception:  # any failure means the peer is not usable here
        pytest.skip("brevitas is not importable here (the `peers` extra)")
    x = torch.tensor([-2.5, -1.0, -0.5, 0.0, 0.5, 1.5, 2.25])
    g = torch.rand(7)
    for ours, theirs in [
        (R.ste_round(), bv.round_ste),
        (R.ste_floor(), bv.floor_ste),
        (R.ste_ceil(), bv.ceil_ste),
        (R.ste_sign(), bv.ternary_sign_ste),
        (R.binarize(clip=None), bv.binary_sign_ste),
        (R.ste_clamp(-1.0, 1.0, outside="pass"), lambda t: bv.scalar_clamp_ste(t, -1.0, 1.0)),
    ]:
        y, gx = _grad(ours, x, g)
        ref_y, ref_g = _grad(theirs, x, g)
        assert torch.equal(y, ref_y), ours
        assert torch.equal(gx, ref_g), ours


# ---- edge cases found in review --------------------------------------------------------------


def test_ternarize_reduces_in_float32_for_half_inputs() -> None:
    x = torch.full((2000,), 100.0, dtype=torch.float16)
    x[::2] = -100
    torch.testing.assert_close(R.ternarize()(x)[:4], torch.tensor([-100.0, 100, -100, 100]).half())
    y = R.ternarize()(torch.full((100000,), 3.0, dtype=torch.bfloat16))
    assert y[0].item() == 3.0


def test_quantize_bound_without_zero_is_widened_to_include_it() -> None:
    y = R.quantize(bits=4, symmetric=False, bound=(0.5, 1.0))(torch.tensor([0.0, 0.5, 0.75, 1.0]))
    torch.testing.assert_close(y, torch.tensor([0.0, 7 / 15, 11 / 15, 1.0]))
    assert y[-1] == 1.0  # the top of the stated range is not cut


def test_quantize_16_bits_in_float16_does_not_overflow() -> None:
    x = torch.linspace(-1, 1, 9, dtype=torch.float16)
    y = R.quantize(bits=16, symmetric=False)(x)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    torch.testing.assert_close(y, x, rtol=0, atol=1e-3)


def test_lsq_survives_an_all_zero_first_input() -> None:
    module = R.lsq(bits=4).module()
    x = torch.zeros(4, requires_grad=True)
    y = module(x)
    y.sum().backward()
    assert torch.isfinite(y).all() and module.step.item() > 0
    assert module.step.grad is not None and torch.isfinite(module.step.grad).all()


# ---- which ends belong to the window (`inclusive`) and the libraries' presets -----------------


def _neighbours(dtype: torch.dtype, *values: float) -> torch.Tensor:
    """Each value rounded to `dtype`, with its neighbours on both sides in `dtype`."""
    v = torch.tensor(values, dtype=torch.float64).to(dtype)
    inf = torch.tensor(math.inf, dtype=dtype)
    return torch.cat([torch.nextafter(v, -inf), v, torch.nextafter(v, inf)])


def _edges(dtype: torch.dtype, *bounds: float) -> torch.Tensor:
    """The bounds and their neighbours, ±0, ±inf, the window's middle and values beyond."""
    extra = torch.tensor([0.0, -0.0, math.inf, -math.inf, 3.5, -3.5, 0.3, 1e-30], dtype=dtype)
    return torch.cat([_neighbours(dtype, *bounds), extra])


def _window_ends(
    x: torch.Tensor, g: torch.Tensor, low: float, high: float, ends: tuple[bool, bool]
) -> torch.Tensor:
    """The gradient a window passes, by float64 comparisons with the bounds rounded to x's
    dtype first (as `x <= c` rounds them)."""
    lo, hi = (torch.tensor(b, dtype=torch.float64).to(x.dtype).double() for b in (low, high))
    v = x.double()
    above = v >= lo if ends[0] else v > lo
    below = v <= hi if ends[1] else v < hi
    return torch.where(above & below, g, torch.zeros_like(g))


WINDOW_ENDS = [
    (R.binarize(inclusive=False), -1.0, 1.0, (False, False)),
    (R.binarize(clip=(-0.5, 2.0), inclusive=(True, False), keep="mask"), -0.5, 2.0,
     (True, False)),
    (R.binarize(clip=0.3, inclusive=(False, True)), -0.3, 0.3, (False, True)),
    (R.ste_clamp(-1.0, 0.5, outside="zero", inclusive=False), -1.0, 0.5, (False, False)),
    (R.ste_clamp(-1.0, 0.5, outside="zero", inclusive=(False, True), keep="mask"), -1.0, 0.5,
     (False, True)),
    (R.ste_clamp(-0.3, 0.7, outside="zero", inclusive=(True, False)), -0.3, 0.7,
     (True, False)),
    (R.ste_clamp(-0.3, 0.3, outside="zero", inclusive=False), -0.3, 0.3, (False, False)),
]


_WINDOW_ENDS_IDS = [repr(r) for r, *_ in WINDOW_ENDS]


@pytest.mark.parametrize("recipe,low,high,ends", WINDOW_ENDS, ids=_WINDOW_ENDS_IDS)
@pytest.mark.parametrize("dtype", gst.FLOAT_DTYPES, ids=str)
def test_window_ends_in_or_out_as_inclusive_says(
    recipe: Any, low: float, high: float, ends: tuple[bool, bool], dtype: torch.dtype
) -> None:
    x = _edges(dtype, low, high)
    g = torch.linspace(-2, 2, x.numel(), dtype=torch.float64).to(dtype)
    y, gx = _grad(recipe, x, g)
    assert y.dtype == gx.dtype == dtype
    assert torch.equal(gx, _window_ends(x, g, low, high, ends)), (x, gx)
    assert torch.equal(y, recipe._forward(x))


@pytest.mark.compile
@_TORCH_CTX_WARNING
@pytest.mark.parametrize("recipe,low,high,ends", WINDOW_ENDS, ids=_WINDOW_ENDS_IDS)
def test_window_ends_compile_with_dynamic_shapes_and_match_eager(
    recipe: Any, low: float, high: float, ends: tuple[bool, bool]
) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    inputs = [_edges(torch.float32, low, high), torch.cat([_edges(torch.float32, low, high),
                                                         torch.tensor([0.1, -0.2, 0.9])])]
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiles = []
    try:
        compiled = torch.compile(recipe, dynamic=True, fullgraph=True, backend=counter)
        for x in inputs:
            g = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
            y_c, gx_c = _grad(compiled, x, g)
            assert torch.equal(gx_c, _window_ends(x, g, low, high, ends)), (x, gx_c)
            assert torch.equal(y_c, recipe._forward(x))
            compiles.append(counter.frame_count)
    finally:
        torch._dynamo.reset()
    assert compiles[1] == compiles[0]  # the graph for the first shape serves the second


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("keep", ["input", "mask"])
def test_presets_match_torch_hardtanh_and_clamp(dtype: torch.dtype, keep: Any) -> None:
    # torch itself is the library here: hardtanh's gradient is 0 at its bounds, clamp's is
    # not; the presets give each exactly, forward and gradient.
    nn_f = nn.functional
    for low, high in ((-1.0, 1.0), (-0.5, 2.0), (0.25, 0.75)):
        x = _edges(dtype, low, high)
        g = torch.linspace(-3, 3, x.numel(), dtype=dtype)
        for name, reference in (
            ("torch.nn.functional.hardtanh",
             lambda t, lo=low, hi=high: nn_f.hardtanh(t, lo, hi)),
            ("torch.clamp", lambda t, lo=low, hi=high: torch.clamp(t, lo, hi)),
        ):
            recipe = R.ste_clamp.preset(name, low, high, keep=keep)
            y, gx = _grad(recipe, x, g)
            ref_y, ref_g = _grad(reference, x, g)
            assert torch.equal(y, ref_y) and torch.equal(gx, ref_g), (name, low, high)
    x = _edges(dtype, -1.0, 1.0)
    g = torch.linspace(-3, 3, x.numel(), dtype=dtype)
    _, gx = _grad(R.binarize.preset("xnor_net", keep=keep), x, g)
    assert torch.equal(gx, _grad(nn_f.hardtanh, x, g)[1])  # XNOR-Net's window: hardtanh's


def test_presets_are_the_documented_recipes() -> None:
    assert R.binarize.preset("binarynet") == R.binarize() == R.binarize.preset("larq.ste_sign")
    assert R.binarize.preset("xnor_net") == R.binarize(clip=1.0, inclusive=False)
    assert R.binarize.preset("brevitas.binary_sign_ste") == R.binarize(clip=None)
    assert R.binarize.preset("xnor_net", keep="mask").keep == "mask"
    assert R.ste_clamp.preset("torch.clamp", -1.0, 2.0) == R.ste_clamp(-1.0, 2.0, outside="zero")
    assert R.ste_clamp.preset("torch.nn.functional.hardtanh", -1.0, 2.0) == (
        R.ste_clamp(-1.0, 2.0, outside="zero", inclusive=False)
    )
    for name in ("brevitas.scalar_clamp_ste", "brevitas.tensor_clamp_ste"):
        assert R.ste_clamp.preset(name, -1.0, 2.0) == R.ste_clamp(-1.0, 2.0, outside="pass")
    assert list(R.BINARIZE_PRESETS) == ["binarynet", "larq.ste_sign", "xnor_net",
                                        "brevitas.binary_sign_ste"]
    assert list(R.CLAMP_PRESETS) == ["torch.clamp", "torch.nn.functional.hardtanh",
                                     "brevitas.scalar_clamp_ste", "brevitas.tensor_clamp_ste"]
    with pytest.raises(go.GradOverrideError, match=r"binarize\.preset: unknown preset "
                       r"'xnor'; the presets are 'binarynet', 'larq\.ste_sign', 'xnor_net', "
                       r"'brevitas\.binary_sign_ste'\."):
        R.binarize.preset("xnor")
    with pytest.raises(go.GradOverrideError, match=r"ste_clamp\.preset: unknown preset "
                       r"'torch\.hardtanh'; the presets are 'torch\.clamp', "):
        R.ste_clamp.preset("torch.hardtanh", -1.0, 1.0)


# ---- abs with a chosen subgradient at 0 ---------------------------------------------------------


@pytest.mark.parametrize("at_zero", [1.0, 0.0, -1.0, 0.5])
@given(x=gst.tensors(edges=(0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30), scale=2.0))
def test_abs_subgradient_is_abs_with_at_zero_at_zero(at_zero: float, x: torch.Tensor) -> None:
    g = _upstream(x)
    y, gx = _grad(R.abs_subgradient(at_zero=at_zero), x, g)
    assert y.dtype == gx.dtype == x.dtype
    assert torch.equal(y, torch.abs(x))
    slope = torch.where(x > 0, 1.0, torch.where(x < 0, -1.0, at_zero)).to(x.dtype)
    assert torch.equal(gx, g * slope)


@given(x=gst.tensors(edges=(0.0, -0.0, 1.0, -1.0), dtype=gst.float_dtypes(low_precision=False)))
def test_abs_subgradient_at_zero_0_is_torch_abs(x: torch.Tensor) -> None:
    g = _upstream(x)
    assert torch.equal(_grad(R.abs_subgradient(at_zero=0.0), x, g)[1], _grad(torch.abs, x, g)[1])


# ---- ste_clamp with tensor bounds ---------------------------------------------------------------


def test_tensor_bounds_broadcast_per_channel_and_keep_the_dtype() -> None:
    x = torch.tensor([[-2.0, -1.0, 0.0, 0.5], [1.0, 2.0, -0.25, 0.25]])
    low = torch.tensor([[-1.0], [-0.25]])  # per row
    high = torch.tensor([[0.5], [1.0]])
    g = torch.arange(1.0, 9.0).reshape(2, 4)
    for outside, inclusive, keep, inside in [
        ("pass", True, "input", torch.ones(2, 4, dtype=torch.bool)),
        ("zero", True, "input", (x >= low) & (x <= high)),
        ("zero", True, "mask", (x >= low) & (x <= high)),
        ("zero", False, "input", (x > low) & (x < high)),
        ("zero", (True, False), "mask", (x >= low) & (x < high)),
    ]:
        recipe = R.ste_clamp(low, high, outside=outside, inclusive=inclusive, keep=keep)
        y, gx = _grad(recipe, x, g)
        assert torch.equal(y, torch.clamp(x, low, high)), recipe
        assert torch.equal(gx, torch.where(inside, g, 0)), recipe
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        y, gx = _grad(R.ste_clamp(low, 1.0, outside="zero"), x.to(dtype), g.to(dtype))
        assert y.dtype == gx.dtype == dtype


def test_tensor_bounds_are_rounded_to_the_input_dtype_as_number_bounds_are() -> None:
    x = torch.tensor([0.3, 0.2998, 0.3003, -0.3], dtype=torch.float16)
    g = torch.ones(4, dtype=torch.float16)
    by_number = R.ste_clamp(-0.3, 0.3, outside="zero")
    by_tensor = R.ste_clamp(torch.tensor(-0.3), torch.tensor([0.3]), outside="zero")
    assert torch.equal(_grad(by_tensor, x, g)[1], _grad(by_number, x, g)[1])
    assert torch.equal(_grad(by_tensor, x, g)[0], _grad(by_number, x, g)[0])


def test_tensor_bounds_wider_than_the_input_sum_the_gradient_to_its_shape() -> None:
    x = torch.tensor([-2.0, 0.5, 3.0])
    high = torch.tensor([[1.0], [4.0]])  # the output is (2, 3)
    g = torch.tensor([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]])
    for outside, expected in (("pass", [11.0, 22.0, 33.0]), ("zero", [0.0, 22.0, 30.0])):
        y, gx = _grad(R.ste_clamp(-1.0, high, outside=outside), x, g)
        assert y.shape == (2, 3) and gx.tolist() == expected, outside


def test_tensor_bounds_get_no_gradient() -> None:
    # As brevitas's tensor_clamp_ste: the bounds are not differentiated through.
    low = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    high = torch.nn.Parameter(torch.tensor(1.0))
    x = torch.tensor([-2.0, 0.5, 3.0], requires_grad=True)
    for outside in ("pass", "zero"):
        y = R.ste_clamp(low, high, outside=outside)(x)
        gx, g_low, g_high = torch.autograd.grad(y.sum(), (x, low, high), allow_unused=True)
        assert g_low is None and g_high is None
        assert gx.tolist() == ([1.0, 1.0, 1.0] if outside == "pass" else [0.0, 1.0, 0.0])


def test_tensor_bound_recipes_compare_by_identity_and_hash() -> None:
    low, high = torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 2.0])
    a = R.ste_clamp(low, high, outside="pass")
    assert a == R.ste_clamp(low, high, outside="pass") and hash(a) == hash(
        R.ste_clamp(low, high, outside="pass"))
    assert a != R.ste_clamp(low.clone(), high, outside="pass")
    assert a != R.ste_clamp(-1.0, 1.0, outside="pass")
    assert repr(R.ste_clamp(low, 2.0, outside="zero")) == (
        "ste_clamp(low=tensor([-1., -2.]), high=2.0, outside='zero', inclusive=True, "
        "keep='input')"
    )


@pytest.mark.compile
@_TORCH_CTX_WARNING
@pytest.mark.parametrize("outside,inclusive,keep", [("pass", True, "input"),
                                                    ("zero", True, "input"),
                                                    ("zero", (False, True), "mask")])
def test_tensor_bounds_compile_with_fullgraph_and_match_eager(
    outside: Any, inclusive: Any, keep: Any
) -> None:
    low = torch.tensor([[-1.0], [-0.5]])
    high = torch.tensor([[0.5], [1.0]])
    recipe = R.ste_clamp(low, high, outside=outside, inclusive=inclusive, keep=keep)
    x0 = torch.tensor([[-2.0, -1.0, 0.0, 0.5], [1.0, 2.0, -0.5, 0.25]])
    assert_consistent(lambda x: (recipe(x) * torch.arange(8.0).reshape(2, 4)).sum(), x0,
                      modes=("compile",))

    def built_inside(x: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:  # as brevitas does
        return R.ste_clamp(lo, 1.0, outside=outside, inclusive=inclusive, keep=keep)(x).sum()

    torch._dynamo.reset()
    x = x0.clone().requires_grad_()
    compiled = torch.compile(built_inside, fullgraph=True, backend="aot_eager")
    (g_c,) = torch.autograd.grad(compiled(x, low), x)
    (g_e,) = torch.autograd.grad(built_inside(x, low), x)
    torch._dynamo.reset()
    assert torch.equal(g_c, g_e)


def test_tensor_bounds_under_vmap_of_grad() -> None:
    recipe = R.ste_clamp(torch.tensor([-1.0, -0.5, 0.0]), 1.0, outside="zero")
    xs = torch.tensor([[-2.0, -0.5, 0.3], [0.5, 1.5, -0.2]])

    def f(x: torch.Tensor) -> torch.Tensor:
        return (recipe(x) * torch.arange(1.0, 4.0)).sum()

    torch.testing.assert_close(vmap(func_grad(f))(xs), torch.stack([func_grad(f)(x) for x in xs]))


@pytest.mark.parametrize(
    "make,error,message",
    [
        (lambda: R.ste_clamp(torch.tensor([0, 1]), 2.0, outside="pass"), go.GradOverrideTypeError,
         r"ste_clamp: `low` as a tensor must be floating-point \(it is compared with the input "
         r"in the input's dtype\); got a torch\.int64 tensor\. Convert it first: `low\.float\(\)`"),
        (lambda: R.ste_clamp(torch.zeros(2), torch.ones(3), outside="pass"), go.GradOverrideError,
         r"ste_clamp: the tensor bounds must broadcast together; got bounds of shapes "
         r"\[\(2,\), \(3,\)\]\."),
        (lambda: R.ste_clamp(torch.zeros(2), "1", outside="pass"), go.GradOverrideTypeError,
         r"ste_clamp: `high` must be a number or a floating-point tensor; got str '1'\."),
        (lambda: R.ste_clamp(torch.zeros(3), 1.0, outside="zero")(torch.ones(2)),
         go.GradOverrideError,
         r"ste_clamp\(low=tensor\(\[0\., 0\., 0\.\]\), .*\): the bounds must broadcast against "
         r"the input; got an input of shape \(2,\) and bounds of shapes \[\(3,\), \(\)\]\."),
        (lambda: R.ste_clamp(1.0, 1.0, outside="zero", inclusive=False), go.GradOverrideError,
         r"ste_clamp: the window \(1\.0, 1\.0\) with inclusive=\(False, False\) is empty"),
        (lambda: R.binarize(inclusive="both"), go.GradOverrideTypeError,
         r"binarize: `inclusive` must be True .* got str 'both'\."),
        (lambda: R.abs_subgradient(at_zero=math.nan), go.GradOverrideError,
         r"abs_subgradient: `at_zero` must be a finite number \(the subgradient at 0, 1\.0 as "
         r"brevitas's abs_binary_sign_grad\); got float nan\."),
    ],
)
def test_new_option_mistakes_are_errors_that_name_the_fix(
    make: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make()


# ---- parity with brevitas, per preset -----------------------------------------------------------


def _brevitas() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import brevitas.function.ops_ste as bv
    except Exception:  # any failure means the peer is not usable here
        pytest.skip("brevitas is not importable here (the `peers` extra)")
    return bv


@pytest.mark.filterwarnings("ignore")  # brevitas's own deprecation warnings
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_brevitas_presets_at_edges_bounds_and_neighbours(dtype: torch.dtype) -> None:
    bv = _brevitas()
    x = torch.cat([_edges(dtype, -1.0, 1.0, -0.5, 0.5, 2.0), _neighbours(dtype, 0.0),
                   torch.tensor([1.5, -2.5, 1e30, -1e30], dtype=dtype)])
    g = torch.linspace(-4, 4, x.numel(), dtype=dtype)
    low_t = torch.tensor(-0.5, dtype=dtype)
    high_t = torch.full(x.shape, 1.0, dtype=dtype)
    high_t[::3] = 2.0  # per element
    cases = [
        ("brevitas.binary_sign_ste", R.binarize.preset("brevitas.binary_sign_ste"),
         bv.binary_sign_ste),
        ("brevitas.scalar_clamp_ste", R.ste_clamp.preset("brevitas.scalar_clamp_ste", -0.5, 2.0),
         lambda t: bv.scalar_clamp_ste(t, -0.5, 2.0)),
        ("brevitas.tensor_clamp_ste",
         R.ste_clamp.preset("brevitas.tensor_clamp_ste", low_t, high_t),
         lambda t: bv.tensor_clamp_ste(t, low_t, high_t)),
        ("brevitas.abs_binary_sign_grad", R.abs_subgradient(), bv.abs_binary_sign_grad),
    ]
    for name, ours, theirs in cases:
        y, gx = _grad(ours, x, g)
        ref_y, ref_g = _grad(theirs, x, g)
        assert y.dtype == ref_y.dtype == gx.dtype == dtype, name
        assert torch.equal(y, ref_y), name
        assert torch.equal(gx, ref_g), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("keep", ["input", "mask"])
def test_tensor_bounds_closed_window_is_torch_clamps_x_gradient(
    dtype: torch.dtype, keep: Any
) -> None:
    # torch.clamp with tensor bounds: its gradient for x is dL/dy where low <= x <= high.
    # Bounds at 0 and at a tiny number: the input's subnormal neighbours of the bounds too.
    tiny = torch.finfo(dtype).tiny
    low = torch.tensor([[-1.0], [0.0], [-tiny]], dtype=dtype)
    high = torch.tensor([[1.0], [tiny], [3.0]], dtype=dtype)
    x = torch.cat([_edges(dtype, -1.0, 1.0, 0.0, 3.0), _neighbours(dtype, tiny, -tiny),
                   torch.tensor([1e30, -1e30], dtype=dtype)])
    x = x.expand(3, -1)
    g = torch.linspace(-2, 2, x.numel(), dtype=dtype).reshape(x.shape)
    y, gx = _grad(R.ste_clamp(low, high, outside="zero", keep=keep), x, g)
    ref_y, ref_g = _grad(lambda t: torch.clamp(t, low, high), x, g)
    assert torch.equal(y, ref_y) and torch.equal(gx, ref_g)


NEW_RECIPES = [
    R.abs_subgradient(),
    R.abs_subgradient(at_zero=0.25),
    R.binarize(inclusive=False),
    R.binarize.preset("xnor_net", keep="mask"),
    R.ste_clamp.preset("torch.nn.functional.hardtanh", -1.0, 1.0),
    R.ste_clamp(-1.0, 1.0, outside="zero", inclusive=(True, False), keep="mask"),
    R.ste_clamp(torch.tensor([-1.0, -0.5, 0.0, -2.0]), 1.0, outside="zero"),
    R.ste_clamp(torch.tensor(-1.0), torch.tensor([1.0, 0.5, 2.0, 0.25]), outside="pass"),
]


@pytest.mark.parametrize("recipe", NEW_RECIPES, ids=repr)
def test_new_recipes_under_vmap_module_and_autocast(recipe: Any) -> None:
    xs = torch.tensor([[-2.0, -1.0, 0.0, 1.0], [0.5, 1.5, -0.0, 0.25]])
    w = torch.arange(1.0, 5.0)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (recipe(x) * w).sum()

    looped = torch.stack([func_grad(f)(x) for x in xs])
    torch.testing.assert_close(vmap(func_grad(f))(xs), looped)
    model = nn.Sequential(nn.Identity(), recipe.module())
    assert repr(recipe) in repr(model)
    leaf = xs.clone().requires_grad_()
    (via_module,) = torch.autograd.grad((model(leaf) * w).sum(), leaf)
    assert torch.equal(via_module, looped)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        leaf = xs.clone().requires_grad_()
        y = recipe(leaf)
    (under_autocast,) = torch.autograd.grad((y * w).sum(), leaf)
    assert y.dtype == torch.float32 and torch.equal(under_autocast, looped)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_open_clamp_bounds_rounded_to_the_dtype_alike_eager_and_inductor(
    dtype: torch.dtype
) -> None:
    # 0.3 rounds up in float16 and bfloat16; Inductor computes half in float32: the rounded
    # bound itself must stay outside the open window when compiled too.
    recipe = R.ste_clamp(-0.3, 0.3, outside="zero", inclusive=False)
    x = torch.tensor([0.3, -0.3, 0.2998, -0.2998, 0.5, 0.0], dtype=dtype)
    assert_consistent(recipe, x, modes=("compile",), backend="inductor")
    g = torch.ones(6, dtype=dtype)
    assert _grad(recipe, x, g)[1].tolist() == [0, 0, 1, 1, 0, 1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bound", [0.1, 0.3, 0.7, 1.0])
def test_the_hardtanh_preset_is_torch_hardtanh_at_every_value(dtype, bound) -> None:
    # At the bound rounded to a half-precision dtype, and its neighbours, forward and backward.
    preset = R.ste_clamp.preset("torch.nn.functional.hardtanh", -bound, bound)
    b = torch.tensor(bound, dtype=dtype)
    around = [b, torch.nextafter(b, b + 1), torch.nextafter(b, b - 1)]
    x = torch.stack([*around, *(-v for v in around), torch.tensor(0.0, dtype=dtype)])

    def grad_of(fn):
        v = x.clone().requires_grad_()
        fn(v).sum().backward()
        return v.grad

    def torch_hardtanh(v):
        return torch.nn.functional.hardtanh(v, -bound, bound)

    torch.testing.assert_close(preset(x), torch_hardtanh(x), rtol=0, atol=0)
    torch.testing.assert_close(grad_of(preset), grad_of(torch_hardtanh), rtol=0, atol=0)


# ---- lsq's window conventions -------------------------------------------------------------

# v = x / s at the places the conventions differ: inside, on the ends, past them by less
# than half a code (rounded back in), and by more.
_V = [6.9, 7.0, 7.3, 7.5, 7.6, -8.0, -8.4, -8.6, 0.3, 2.5, 9.0, -11.0]


def test_lsq_rounded_window_is_torch_ao_learnable_fake_quantize() -> None:
    # torch.ao's LSQ (`_LearnableFakeQuantize`) runs this kernel; its grad_factor is the
    # recipe's grad_scale.
    x = torch.tensor(_V) * 0.5  # the kernel takes float32 only
    up = torch.linspace(-1.0, 2.0, len(_V))
    step = torch.tensor([0.5])
    xt, st_ = x.clone().requires_grad_(), step.clone().requires_grad_()
    want_y = torch._fake_quantize_learnable_per_tensor_affine(
        xt, st_, torch.zeros(1), -8, 7, 0.25)
    want = torch.autograd.grad(want_y, (xt, st_), up)
    xr, sr = x.clone().requires_grad_(), step.clone().requires_grad_()
    got_y = R.lsq(bits=4, window="rounded", grad_scale=0.25)(xr, sr)
    got = torch.autograd.grad(got_y, (xr, sr), up)
    torch.testing.assert_close(got_y, want_y)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_lsq_closed_window_is_clamp_then_round_by_autograd() -> None:
    x = torch.tensor(_V, dtype=torch.float64) * 0.5
    up = torch.linspace(-1.0, 2.0, len(_V), dtype=torch.float64)
    xr, sr = x.clone().requires_grad_(), torch.tensor(0.5, dtype=torch.float64,
                                                     requires_grad=True)
    v = torch.clamp(xr / sr, -8, 7)
    want_y = (v + (torch.round(v) - v).detach()) * sr  # the common hand-written LSQ
    want = torch.autograd.grad(want_y, (xr, sr), up)
    xg, sg = x.clone().requires_grad_(), torch.tensor(0.5, dtype=torch.float64,
                                                     requires_grad=True)
    got = torch.autograd.grad(R.lsq(bits=4, window="closed", grad_scale=1.0)(xg, sg),
                              (xg, sg), up)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_lsq_rounded_window_agrees_with_quantize() -> None:
    # The same unsigned 4-bit grid: codes 0..15, step 0.5 (quantize's bound (0, 7.5)).
    x = torch.tensor([-0.3, -0.2, 0.1, 3.3, 7.6, 7.74, 7.76, 9.0], requires_grad=True)
    up = torch.arange(1.0, 9.0)
    lsq_grad = torch.autograd.grad(
        R.lsq(bits=4, signed=False, window="rounded")(x, torch.tensor(0.5)), x, up)[0]
    quantize_grad = torch.autograd.grad(
        R.quantize(bits=4, symmetric=False, bound=(0.0, 7.5))(x), x, up)[0]
    torch.testing.assert_close(lsq_grad, quantize_grad)


def test_lsq_unknown_window_names_the_conventions() -> None:
    with pytest.raises(go.GradOverrideError, match=r"lsq got window='torch'; expected one of "
                       r"'open', 'closed', 'rounded'"):
        R.lsq(window="torch")
