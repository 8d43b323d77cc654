"""Gradient-flow recipes: reversal, scaling (constant, tensor, schedule), clipping by value and
by norm, NaN/inf sanitizing. Each law is checked on any shape and floating dtype
(Hypothesis), each error text is matched, and the recipes compile with fullgraph=True."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import gradoverride as go
from gradoverride.recipes import (
    ScaledGradientModule,
    clip_grad_norm,
    clip_grad_value,
    ganin_ramp,
    reverse_grad,
    sanitize_grad,
    scale_grad,
)
from gradoverride.testing import strategies as gst

_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}
scales = st.floats(-4.0, 4.0, allow_nan=False, width=32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def _through(
    recipe: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, gy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe's output and the gradient it sends to `x` for the upstream `gy`."""
    leaf = x.detach().requires_grad_()
    y = recipe(leaf)
    (gx,) = torch.autograd.grad(y, leaf, gy)
    return y.detach(), gx


# ---- reversal and scaling: the laws ---------------------------------------------------------


@given(pair=gst.tensor_pairs(), scale=scales, form=st.sampled_from(("call", "module")))
def test_reverse_grad_law(pair: tuple[torch.Tensor, torch.Tensor], scale: float,
                          form: str) -> None:
    x, gy = pair
    recipe = reverse_grad(scale=scale)
    y, gx = _through(recipe if form == "call" else recipe.module(), x, gy)
    assert torch.equal(_bits(y), _bits(x)), "the forward is not the identity"
    assert gx.dtype == x.dtype and gx.shape == x.shape
    assert torch.equal(_bits(gx), _bits(gy * -scale))
    assert torch.equal(_bits(recipe.transform(gy)), _bits(gy * -scale))


@given(pair=gst.tensor_pairs(), scale=scales)
def test_scale_grad_law_and_negative_scale_is_reversal(
    pair: tuple[torch.Tensor, torch.Tensor], scale: float
) -> None:
    x, gy = pair
    y, gx = _through(scale_grad(scale=scale), x, gy)
    assert torch.equal(_bits(y), _bits(x))
    assert gx.dtype == x.dtype
    assert torch.equal(_bits(gx), _bits(gy * scale))
    _, reversed_gx = _through(reverse_grad(scale=-scale), x, gy)
    assert torch.equal(_bits(reversed_gx), _bits(gx))


@given(x=gst.tensors(shape=gst.shapes(min_dims=1), dtype=gst.float_dtypes()), a=scales, b=scales)
def test_reversals_compose_to_the_product_of_scales(x: torch.Tensor, a: float, b: float) -> None:
    gy = torch.ones_like(x)
    _, gx = _through(lambda t: reverse_grad(scale=a)(reverse_grad(scale=b)(t)), x, gy)
    _, expected = _through(scale_grad(scale=a * b), x, gy)
    torch.testing.assert_close(gx, expected, rtol=1e-2, atol=1e-2)


def test_scale_zero_blocks_the_gradient() -> None:
    x = torch.randn(5, requires_grad=True)
    reverse_grad(scale=0.0)(x).sum().backward()
    assert x.grad is not None and torch.equal(x.grad.abs(), torch.zeros(5))


def test_tensor_scale_broadcasts_keeps_dtype_and_gets_no_gradient() -> None:
    x = torch.randn(4, 3, dtype=torch.float16)
    gy = torch.randn(4, 3, dtype=torch.float16)
    per_channel = torch.tensor([1.0, 2.0, -0.5], requires_grad=True)  # float32
    _, gx = _through(reverse_grad(scale=per_channel), x, gy)
    assert gx.dtype == torch.float16
    torch.testing.assert_close(gx, (gy.float() * -per_channel.detach()).half())
    assert per_channel.grad is None
    zero_d = torch.tensor(0.25, dtype=torch.float64)
    _, gx = _through(scale_grad(scale=zero_d), x, gy)
    assert gx.dtype == torch.float16
    torch.testing.assert_close(gx, gy * 0.25)
    # The scale in effect is the one at call time: reversal negates it then.
    leaf = x.float().requires_grad_()
    scale = torch.tensor(2.0)
    y = reverse_grad(scale=scale)(leaf)
    scale.fill_(5.0)
    (g,) = torch.autograd.grad(y.sum(), leaf)
    torch.testing.assert_close(g, torch.full_like(g, -2.0))


# ---- schedules ------------------------------------------------------------------------------


def test_ganin_ramp_formula() -> None:
    ramp = ganin_ramp(total_steps=100)
    for step in (0, 1, 25, 50, 99, 100, 150):
        p = min(step / 100, 1.0)
        expected = 2.0 / (1.0 + math.exp(-10.0 * p)) - 1.0
        assert float(ramp(torch.tensor(step))) == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert float(ramp(0)) == 0.0
    assert float(ganin_ramp(total_steps=10, gamma=5.0, max_scale=0.5)(10)) == pytest.approx(
        0.5 * (2.0 / (1.0 + math.exp(-5.0)) - 1.0), rel=1e-6
    )


def test_scheduled_reversal_function_form_uses_the_step() -> None:
    recipe = reverse_grad(scale=ganin_ramp(total_steps=10))
    x, gy = torch.randn(3), torch.randn(3)
    _, gx = _through(lambda t: recipe(t, step=torch.tensor(4)), x, gy)
    expected = 2.0 / (1.0 + math.exp(-10.0 * 0.4)) - 1.0
    torch.testing.assert_close(gx, -expected * gy)
    torch.testing.assert_close(recipe.transform(gy, step=4), -expected * gy)


def test_scheduled_module_keeps_its_step_in_state_dict() -> None:
    module = reverse_grad(scale=ganin_ramp(total_steps=10)).module()
    assert isinstance(module, ScaledGradientModule)
    assert list(module.state_dict()) == ["steps"]
    x, gy = torch.randn(3), torch.randn(3)
    _, gx = _through(module, x, gy)
    assert torch.equal(gx.abs(), torch.zeros(3)), "the ramp starts at 0"
    module.step()
    module.step(4)
    assert int(module.steps) == 5
    expected = 2.0 / (1.0 + math.exp(-5.0)) - 1.0
    _, gx = _through(module, x, gy)
    torch.testing.assert_close(gx, -expected * gy)
    torch.testing.assert_close(module.transform(gy), -expected * gy)
    assert float(module.scale()) == pytest.approx(expected, rel=1e-6)

    restored = reverse_grad(scale=ganin_ramp(total_steps=10)).module()
    restored.load_state_dict(module.state_dict())
    assert int(restored.steps) == 5
    assert int(copy.deepcopy(module).steps) == 5
    # The count does not move by itself: forward calls in train mode leave it as it is.
    module.train()
    module(torch.randn(3))
    assert int(module.steps) == 5


def test_constant_scale_module_has_no_state_and_step_is_a_no_op() -> None:
    module = reverse_grad(scale=0.5).module()
    assert module.state_dict() == {}
    module.step()
    assert module.scale() == 0.5
    assert repr(module) == "reverse_grad(scale=0.5)"
    net = nn.Sequential(nn.Linear(2, 2), module)
    net(torch.randn(1, 2)).sum().backward()


def test_schedule_errors() -> None:
    recipe = reverse_grad(scale=ganin_ramp(total_steps=10))
    with pytest.raises(go.GradOverrideError, match=r"has a schedule for its scale, so it needs "
                       r"the step count: call it as `recipe\(x, step=step\)`"):
        recipe(torch.randn(2))
    with pytest.raises(go.GradOverrideError, match=r"needs the step count"):
        recipe.transform(torch.randn(2))
    with pytest.raises(go.GradOverrideTypeError, match=r"has a constant scale, so it takes no "
                       r"`step`; give it a schedule"):
        reverse_grad(scale=1.0)(torch.randn(2), step=3)
    with pytest.raises(go.GradOverrideError, match=r"ganin_ramp needs `total_steps` to be a "
                       r"positive int .*, got 0\."):
        ganin_ramp(total_steps=0)


def test_scale_errors() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"reverse_grad needs `scale` to be a "
                       r"number, a tensor or a schedule .*, got str '1'\."):
        reverse_grad(scale="1")  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideTypeError, match=r"scale_grad needs a floating-point "
                       r"`scale` tensor, got dtype torch.int64"):
        scale_grad(scale=torch.tensor(2))


# ---- clipping -------------------------------------------------------------------------------


@given(pair=gst.tensor_pairs(scale=10.0), clip=st.floats(0.0, 5.0))
def test_clip_grad_value_bounds_hold(pair: tuple[torch.Tensor, torch.Tensor],
                                     clip: float) -> None:
    x, gy = pair
    y, gx = _through(clip_grad_value(clip_value=clip), x, gy)
    assert torch.equal(_bits(y), _bits(x))
    assert gx.dtype == x.dtype
    assert bool((gx.abs() <= clip).all())
    assert torch.equal(gx, torch.clamp(gy, -clip, clip))


def _reference_clip(g: torch.Tensor, max_norm: float, dim: tuple[int, ...] | None,
                    norm_type: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s formula, written out in float64."""
    g64 = g.double()
    if norm_type == math.inf:
        norm = g64.abs().amax(dim=dim, keepdim=True) if g64.numel() else g64.sum(
            dim=dim, keepdim=True)
    else:
        norm = (g64.abs() ** norm_type).sum(dim=dim, keepdim=True) ** (1 / norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return g64 * coef


@given(
    gy=gst.tensors(shape=gst.shapes(min_dims=2, min_side=1), dtype=gst.float_dtypes(),
                   scale=5.0),
    max_norm=st.floats(0.1, 5.0),
    per_sample=st.booleans(),
    norm_type=st.sampled_from((2.0, 1.0, math.inf)),
)
def test_clip_grad_norm_bounds_hold(gy: torch.Tensor, max_norm: float, per_sample: bool,
                                    norm_type: float) -> None:
    dim = tuple(range(1, gy.ndim)) if per_sample else None
    recipe = clip_grad_norm(max_norm=max_norm, dim=dim, norm_type=norm_type)
    _, gx = _through(recipe, torch.zeros_like(gy), gy)
    assert gx.dtype == gy.dtype and gx.shape == gy.shape
    expected = _reference_clip(gy, max_norm, dim, norm_type)
    loose = gy.dtype in (torch.float16, torch.bfloat16)
    torch.testing.assert_close(gx.double(), expected, rtol=1e-2 if loose else 1e-5,
                               atol=1e-2 if loose else 1e-6)
    norms = torch.linalg.vector_norm(gx.double(), ord=norm_type, dim=dim)
    assert bool((norms <= max_norm * (1.01 if loose else 1.0 + 1e-5)).all())


def test_clip_grad_norm_per_sample_clips_each_row_alone() -> None:
    gy = torch.tensor([[3.0, 4.0], [0.3, 0.4]])  # norms 5 and 0.5
    _, gx = _through(clip_grad_norm(max_norm=1.0, dim=1), torch.zeros(2, 2), gy)
    torch.testing.assert_close(gx[0], gy[0] / (5.0 + 1e-6))
    assert torch.equal(gx[1], gy[1]), "a row within the bound passes unchanged"
    _, whole = _through(clip_grad_norm(max_norm=1.0), torch.zeros(2, 2), gy)
    torch.testing.assert_close(whole.norm(), torch.tensor(1.0), rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_in_float16_does_not_overflow() -> None:
    gy = torch.full((64, 64), 300.0, dtype=torch.float16)  # sum of squares overflows fp16
    _, gx = _through(clip_grad_norm(max_norm=1.0), torch.zeros_like(gy), gy)
    assert gx.dtype == torch.float16
    assert float(gx.float().norm()) == pytest.approx(1.0, rel=1e-2)


def test_clip_errors() -> None:
    with pytest.raises(go.GradOverrideError, match=r"clip_grad_value needs `clip_value` to be "
                       r"a number >= 0 .*, got -1\."):
        clip_grad_value(clip_value=-1)
    with pytest.raises(go.GradOverrideError, match=r"clip_grad_norm needs `max_norm` to be a "
                       r"number >= 0, got 'a'\."):
        clip_grad_norm(max_norm="a")  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideTypeError, match=r"clip_grad_norm needs `dim` to be None "
                       r"\(the whole tensor\), an int or a tuple of ints .*, got \[1\]\."):
        clip_grad_norm(max_norm=1.0, dim=[1])  # type: ignore[arg-type]


# ---- NaN / inf ------------------------------------------------------------------------------


@given(gy=gst.tensors(dtype=gst.float_dtypes(),
                      edges=(math.nan, math.inf, -math.inf, 0.0)))
def test_sanitize_grad_replaces_non_finite_values(gy: torch.Tensor) -> None:
    _, gx = _through(sanitize_grad(), torch.zeros_like(gy), gy)
    assert gx.dtype == gy.dtype
    assert bool(torch.isfinite(gx).all())
    finfo = torch.finfo(gy.dtype)
    expected = torch.where(gy.isnan(), torch.zeros_like(gy), gy)
    expected = torch.where(gy == math.inf, torch.full_like(gy, finfo.max), expected)
    expected = torch.where(gy == -math.inf, torch.full_like(gy, finfo.min), expected)
    assert torch.equal(gx, expected)


def test_sanitize_grad_replacement_values() -> None:
    gy = torch.tensor([math.nan, math.inf, -math.inf, 2.0])
    _, gx = _through(sanitize_grad(nan=-1.0, posinf=10.0, neginf=-10.0), torch.zeros(4), gy)
    assert gx.tolist() == [-1.0, 10.0, -10.0, 2.0]


def test_sanitize_grad_raise_names_the_tensor() -> None:
    recipe = sanitize_grad(mode="raise", name="encoder output")
    gy = torch.tensor([math.nan, math.inf, 1.0, math.nan])
    with pytest.raises(go.GradOverrideError, match=(
        r"^the gradient of `encoder output` passing through sanitize_grad\(mode='raise', .*"
        r"name='encoder output'\) is not finite \(2 NaN and 1 infinite of 4 values\)\. Find "
        r"the op that makes it with `torch.autograd.set_detect_anomaly\(True\)`"
    )):
        _through(recipe, torch.zeros(4), gy)
    with pytest.raises(go.GradOverrideError, match=r"^a gradient passing through"):
        _through(sanitize_grad(mode="raise"), torch.zeros(1), torch.tensor([math.inf]))
    _, gx = _through(recipe, torch.zeros(2), torch.tensor([1.0, -2.0]))
    assert gx.tolist() == [1.0, -2.0]


def test_sanitize_errors() -> None:
    with pytest.raises(go.GradOverrideError, match=r"sanitize_grad got mode='clip'; the modes "
                       r"are 'replace', 'raise'\."):
        sanitize_grad(mode="clip")  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideError, match=r"sanitize_grad needs `posinf` to be a "
                       r"finite number, got inf\."):
        sanitize_grad(posinf=math.inf)


# ---- forms: repr, module, hook --------------------------------------------------------------


def test_reprs_are_the_calls() -> None:
    for recipe in (
        reverse_grad(),
        scale_grad(scale=0.5),
        clip_grad_value(clip_value=1.0),
        clip_grad_norm(max_norm=2.0, dim=(1, 2)),
        sanitize_grad(mode="raise", name="h"),
        reverse_grad(scale=ganin_ramp(total_steps=5)),
    ):
        namespace = {**vars(go.recipes)}
        assert eval(repr(recipe), namespace) == recipe
        assert repr(recipe.module()) == repr(recipe)


def test_takes_one_tensor() -> None:
    with pytest.raises(TypeError, match=r"clip_grad_value\(clip_value=1.0\) takes one tensor"):
        clip_grad_value(clip_value=1.0)(torch.randn(2), 3)


def test_flow_recipes_as_grad_hook_transforms() -> None:
    layer = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    handle = go.grad_hook(layer, reverse_grad(scale=2.0), at="outputs")
    layer(x).sum().backward()
    assert layer.bias.grad is not None
    torch.testing.assert_close(layer.bias.grad, torch.full((3,), -4.0))
    handle.remove()
    layer.zero_grad()
    go.grad_hook(layer, clip_grad_value(clip_value=0.5), at="outputs")
    layer(x).sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((3,), 1.0))


# ---- torch.compile --------------------------------------------------------------------------

# See test_composition.py: dynamo's own DeprecationWarning for a sourceless Function ctx.
_TORCH_CTX_WARNING = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated:DeprecationWarning"
)


def _every_flow_recipe(x: torch.Tensor) -> torch.Tensor:
    h = reverse_grad(scale=0.5)(x)
    h = scale_grad(scale=torch.tensor(3.0))(h)
    h = clip_grad_norm(max_norm=1.0, dim=1)(h)
    h = clip_grad_value(clip_value=0.2)(h * 2)
    h = sanitize_grad()(h)
    h = sanitize_grad(mode="raise", name="h")(h)
    return (h**2).sum()


@pytest.mark.compile
@_TORCH_CTX_WARNING
def test_flow_recipes_compile_fullgraph_with_eager_parity() -> None:
    torch._dynamo.reset()
    x = torch.randn(4, 6)
    eager_x = x.clone().requires_grad_()
    (eager,) = torch.autograd.grad(_every_flow_recipe(eager_x), eager_x)
    compiled = torch.compile(_every_flow_recipe, backend="aot_eager", fullgraph=True)
    comp_x = x.clone().requires_grad_()
    (got,) = torch.autograd.grad(compiled(comp_x), comp_x)
    torch.testing.assert_close(got, eager)
    assert not torch.equal(eager, 4 * x), "the recipes changed the gradient"
    # The raise mode's check runs inside the compiled backward (torch._assert_async).
    bad = torch.full((4, 6), math.inf, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"the gradient of `h` passing through"):
        torch.autograd.grad(compiled(bad), bad)
    torch._dynamo.reset()


@pytest.mark.compile
@_TORCH_CTX_WARNING
def test_scheduled_module_compiles_and_follows_its_step() -> None:
    torch._dynamo.reset()
    module = reverse_grad(scale=ganin_ramp(total_steps=4)).module()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    x = torch.ones(3, requires_grad=True)
    for step in range(3):
        (g,) = torch.autograd.grad(compiled(x).sum(), x)
        expected = 2.0 / (1.0 + math.exp(-10.0 * step / 4)) - 1.0
        torch.testing.assert_close(g, torch.full((3,), -expected))
        module.step()
    torch._dynamo.reset()


def test_clip_grad_value_beyond_the_dtype_range_clamps_nothing() -> None:
    g = torch.randn(4, dtype=torch.float16, requires_grad=True)
    clip_grad_value(1e6)(g).sum().backward()
    torch.testing.assert_close(g.grad, torch.ones(4, dtype=torch.float16))


def test_ganin_ramp_refuses_a_boolean_step_count() -> None:
    from gradoverride.recipes import ganin_ramp

    expected = "ganin_ramp needs `total_steps` to be a positive int"
    with pytest.raises(go.GradOverrideError, match=expected):
        ganin_ramp(total_steps=True)  # type: ignore[arg-type]


def test_a_schedule_that_never_steps_is_warned_about() -> None:
    grl = reverse_grad(scale=ganin_ramp(total_steps=100)).module()
    grl.UNSTEPPED_CALLS = 5
    x = torch.ones(3, requires_grad=True)
    for _ in range(4):
        grl(x)
    with pytest.warns(go.GradOverrideWarning, match=r"reverse_grad\(scale=ganin_ramp\(.*\)\) "
                      r"\(module form\) ran 5 training calls and its schedule never stepped: "
                      r"its scale is still 0.*Call its `step\(\)`"):
        grl(x)
    grl(x).sum().backward()
    assert torch.equal(x.grad, torch.zeros(3))  # what the warning is about: no gradient
    grl.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stepped: several calls per step are fine
        for _ in range(12):
            grl(x)
        grl.eval()
        grl.steps.zero_()
        for _ in range(12):
            grl(x)  # evaluation calls do not count


def test_a_clipping_recipe_copied_shares_its_scaler_and_saved_is_refused() -> None:
    import pickle

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    clip = clip_grad_value(1.0, scaler=scaler)
    model = nn.Sequential(nn.Identity(), clip.module())
    ema = copy.deepcopy(model)  # what an EMA copy does
    assert ema[1].recipe.scaler is scaler
    x = torch.zeros(4, requires_grad=True)
    scaler.scale((ema(x) * torch.tensor([-5.0, 0.5, 5.0, 0.01])).sum()).backward()
    torch.testing.assert_close(x.grad / 1024.0, torch.tensor([-1.0, 0.5, 1.0, 0.01]))
    assert copy.copy(clip) is clip
    with pytest.raises(go.GradOverrideError, match=r"clip_grad_value\(clip_value=1.0\) holds a "
                       r"GradScaler and cannot be saved with it.*give the scaler again"):
        pickle.dumps(clip)
    assert pickle.loads(pickle.dumps(clip_grad_value(1.0))) == clip_grad_value(1.0)
