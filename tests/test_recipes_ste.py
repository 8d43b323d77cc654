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
    assert repr(quantizer) == "LearnedStepQuantizer(lsq(bits=4, signed=True, grad_scale=None))"
    x = torch.randn(64, 8)
    quantizer(x).sum().backward()
    torch.testing.assert_close(quantizer.step.detach(), 2 * x.abs().mean() / math.sqrt(7))
    assert quantizer.step.grad is not None
    fresh = R.lsq(bits=4).module()
    fresh.load_state_dict({"step": torch.tensor(0.25)})
    fresh(x)
    assert fresh.step.item() == 0.25
    assert copy.deepcopy(fresh).step.item() == 0.25


# ---- all recipes: dtypes, extremes, module form, repr ----------------------------------------

ALL = [r for r, _ in IDENTITY] + [r for r, *_ in WINDOWED] + QUANTIZERS + [R.ternarize()]


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
        "ste_clamp(low=-1.0, high=1.0, outside='zero', keep='input')"
    )
    assert repr(R.binarize(clip=0.5, keep="mask")) == "binarize(clip=0.5, keep='mask')"
    assert repr(R.quantize(bits=4)) == "quantize(bits=4, symmetric=True, bound=None, keep='input')"
    assert R.binarize() == R.binarize(clip=1.0) and hash(R.binarize()) == hash(R.binarize())


def test_module_form_in_sequential() -> None:
    model = nn.Sequential(nn.Linear(3, 4), R.binarize().module(), nn.Linear(4, 1))
    assert "binarize(clip=1.0, keep='input')" in repr(model)
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
         r"lsq\(bits=8, signed=True, grad_scale=None\): `step` must be a tensor \(a learnable "
         r"parameter\), got float 0\.5; use `lsq\(\.\.\.\)\.module\(\)` to hold it\."),
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
