"""`go.straight_through`: the identity, clipped (both keep options), surrogate and
explicit-derivative forms; what each saves; composition; errors."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import tolerance
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad as func_grad
from torch.func import vmap

import gradoverride as go
from gradoverride.testing import assert_consistent, saved_bytes
from gradoverride.testing import strategies as gst

EDGES = (0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0)

# Dynamo warns about instantiating a Function for a closure-held apply (see
# tests/test_composition.py for the full story); not gradoverride's warning.
_TORCH_CTX_WARNING = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated:DeprecationWarning"
)


@go.straight_through
def sign_ste(x: torch.Tensor) -> torch.Tensor:
    """Sign with the identity gradient."""
    return torch.sign(x)


@go.straight_through(clip=1.0)
def sign_clip(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x)


@go.straight_through(clip=(-0.5, 1.0), keep="mask")
def sign_clip_mask(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
    return torch.sign(x) * k


@go.straight_through(clip=1.0, keep="mask")
def sign_clip_mask_sym(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x)


@go.straight_through(clip=(-0.5, 1.0), keep="input")
def sign_clip_pair(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x)


@go.straight_through(surrogate=torch.tanh)
def step_tanh(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)


def _dtanh(x: torch.Tensor) -> torch.Tensor:
    return 1 - torch.tanh(x) ** 2


@go.straight_through(derivative=_dtanh)
def step_dtanh(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)


@go.straight_through(surrogate=torch.tanh, clip=1.0)
def step_tanh_clip(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)


def _grad(op: Callable[..., torch.Tensor], x: torch.Tensor, g: torch.Tensor, *args: Any) -> Any:
    leaf = x.detach().requires_grad_()
    y = op(leaf, *args)
    (gx,) = torch.autograd.grad(y, leaf, g)
    return y.detach(), gx


def _window(x: torch.Tensor, g: torch.Tensor, low: float, high: float) -> torch.Tensor:
    inside = (x >= low) & (x <= high)
    return torch.where(inside, g, torch.zeros_like(g))


# ---- identity -------------------------------------------------------------------------------


@given(gst.tensors(edges=EDGES))
def test_identity_forward_is_the_function_and_backward_the_upstream_gradient(
    x: torch.Tensor,
) -> None:
    g = torch.randn(x.shape, dtype=torch.float64).to(x.dtype)
    y, gx = _grad(sign_ste, x, g)
    assert torch.equal(y, torch.sign(x)) and y.dtype == x.dtype
    assert torch.equal(gx, g) and gx.dtype == x.dtype


def test_identity_returns_the_upstream_gradient_without_a_copy_and_saves_nothing() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    g = torch.randn(64, 64)
    (gx,) = torch.autograd.grad(sign_ste(x), x, g)
    assert gx.data_ptr() == g.data_ptr()
    assert saved_bytes(sign_ste, x) == 0


def test_further_arguments_go_to_the_forward_and_get_no_gradient() -> None:
    x = torch.tensor([-2.0, 0.25, 3.0], requires_grad=True)
    k = torch.tensor(3.0, requires_grad=True)
    y = sign_clip_mask(x, k)
    assert torch.equal(y, torch.tensor([-3.0, 3.0, 3.0]))
    y.sum().backward()
    assert k.grad is None
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0, 0.0]))


# ---- clip -----------------------------------------------------------------------------------

CLIPPED = [
    (sign_clip, -1.0, 1.0),
    (sign_clip_pair, -0.5, 1.0),
    (sign_clip_mask_sym, -1.0, 1.0),
    (sign_clip_mask, -0.5, 1.0),
]


@pytest.mark.parametrize("op,low,high", CLIPPED, ids=lambda v: getattr(v, "__name__", str(v)))
@given(x=gst.tensors(edges=EDGES))
def test_clip_passes_the_gradient_inside_the_window_bounds_included(
    op: Any, low: float, high: float, x: torch.Tensor
) -> None:
    g = torch.randn(x.shape, dtype=torch.float64).to(x.dtype)
    _, gx = _grad(op, x, g)
    assert gx.dtype == x.dtype
    assert torch.equal(gx, _window(x, g, low, high))


def test_clip_at_the_bounds_exactly() -> None:
    x = torch.tensor([-1.0, 1.0, -1.0001, 1.0001, 0.0, -0.5, -0.5001])
    g = torch.ones(7)
    assert _grad(sign_clip, x, g)[1].tolist() == [1, 1, 0, 0, 1, 1, 1]
    assert _grad(sign_clip_pair, x, g)[1].tolist() == [0, 1, 0, 0, 1, 1, 0]


@pytest.mark.parametrize("dtype", gst.FLOAT_DTYPES, ids=str)
def test_clip_keeps_the_input_or_a_one_byte_mask(dtype: torch.dtype) -> None:
    x = torch.randn(8, 16, dtype=dtype, requires_grad=True)
    assert saved_bytes(sign_clip, x) == x.numel() * x.element_size()
    assert saved_bytes(sign_clip_mask_sym, x) == x.numel()  # bool


def test_clip_bound_a_dtype_cannot_represent_is_rounded_to_it() -> None:
    @go.straight_through(clip=0.1)
    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    x = torch.tensor([0.1, -0.1], dtype=torch.float16)  # rounded, like `x.abs() <= 0.1`
    assert _grad(op, x, torch.ones(2, dtype=torch.float16))[1].tolist() == [1, 1]


def test_clip_with_an_infinite_bound() -> None:
    @go.straight_through(clip=(-math.inf, 0.0))
    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    x = torch.tensor([-math.inf, -1e30, 0.0, 1e-30])
    assert _grad(op, x, torch.ones(4))[1].tolist() == [1, 1, 1, 0]


# ---- surrogate and derivative ----------------------------------------------------------------


@pytest.mark.parametrize("op", [step_tanh, step_dtanh], ids=["surrogate", "derivative"])
@given(x=gst.tensors(edges=(0.0, 1.0, -1.0)))
def test_surrogate_gradient_is_the_surrogates_derivative(op: Any, x: torch.Tensor) -> None:
    g = torch.randn(x.shape, dtype=torch.float64).to(x.dtype)
    y, gx = _grad(op, x, g)
    assert torch.equal(y, (x > 0).to(x.dtype))
    leaf = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad(torch.tanh(leaf), leaf, g)
    assert gx.dtype == x.dtype
    torch.testing.assert_close(gx, expected, **tolerance(x.dtype))


@given(x=gst.tensors(edges=(1.0, -1.0, 0.0), dtype=gst.float_dtypes(low_precision=False)))
def test_surrogate_with_clip_zeroes_outside_the_window(x: torch.Tensor) -> None:
    g = torch.randn(x.shape, dtype=x.dtype)
    _, gx = _grad(step_tanh_clip, x, g)
    torch.testing.assert_close(gx, _window(x, g * _dtanh(x), -1.0, 1.0))


@pytest.mark.parametrize(
    "dtype,big", [(torch.float16, 1e4), (torch.bfloat16, 1e30), (torch.float32, 1e30)], ids=str
)
def test_surrogate_gradients_are_finite_at_extreme_inputs(dtype: torch.dtype, big: float) -> None:
    x = torch.tensor([-big, big, 0.0], dtype=dtype)
    for op in (step_tanh, step_dtanh, step_tanh_clip):
        _, gx = _grad(op, x, torch.ones(3, dtype=dtype))
        assert torch.isfinite(gx).all(), (op, gx)


def test_surrogate_is_differentiable_twice() -> None:
    x = torch.linspace(-2, 2, 7, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(step_tanh(x).sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sum(), x)
    t = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad(_dtanh(t).sum(), t)
    torch.testing.assert_close(ggx, expected)


def test_surrogate_of_the_wrong_shape_is_an_error() -> None:
    @go.straight_through(surrogate=lambda x: x.sum())
    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(go.GradOverrideError, match=r"surrogate `<lambda>` of `.*op` returned "
                       r"\(\), but the forward's output has shape \(3,\)"):
        op(x).sum().backward()


# ---- the object -------------------------------------------------------------------------------


def test_result_is_a_custom_backward_op_with_name_repr_and_module_form() -> None:
    assert isinstance(sign_clip_mask, go.CustomBackward)
    assert sign_ste.__name__ == "sign_ste"
    assert sign_ste.__doc__ == "Sign with the identity gradient."
    assert sign_clip_mask.__wrapped__.__name__ == "sign_clip_mask"
    assert repr(sign_clip_mask) == (
        "<custom_backward sign_clip_mask(x: 'torch.Tensor', k: 'float' = 2.0) -> "
        "'torch.Tensor', backward=straight_through(clip=(-0.5, 1.0), keep='mask')>"
    )
    assert "straight_through(surrogate=tanh)" in repr(step_tanh)
    module = sign_clip_mask.module(k=3.0)
    x = torch.tensor([0.25, -2.0], requires_grad=True)
    assert torch.equal(module(x), torch.tensor([3.0, -3.0]))


def test_call_form_and_builtins() -> None:
    op = go.straight_through(torch.round, clip=2.0)
    x = torch.tensor([0.4, 2.6, -1.5], requires_grad=True)
    y = op(x)
    y.sum().backward()
    assert torch.equal(y, torch.round(x.detach()))
    assert torch.equal(x.grad, torch.tensor([1.0, 0.0, 1.0]))


def test_autocast_runs_the_clipped_backward() -> None:
    x = torch.tensor([-2.0, 0.5, 1.0], requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sign_clip(x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0, 1.0]))


def test_on_each_device(device: torch.device) -> None:
    x = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0], device=device)
    g = torch.ones(5, device=device)
    for op, expected in ((sign_ste, [1, 1, 1, 1, 1]), (sign_clip, [0, 1, 1, 1, 0]),
                         (sign_clip_mask, [0, 0, 1, 1, 0])):
        _, gx = _grad(op, x, g)
        assert gx.device == x.device and gx.tolist() == expected


# ---- composition ------------------------------------------------------------------------------


@pytest.mark.compile
@_TORCH_CTX_WARNING
def test_every_form_compiles_with_fullgraph_and_matches_eager() -> None:
    ops = [sign_ste, sign_clip, sign_clip_pair, sign_clip_mask, sign_clip_mask_sym, step_tanh,
           step_dtanh, step_tanh_clip]
    x0 = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 0.75])
    w = torch.arange(8.0)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return sum(((op(x) * w).sum() for op in ops), torch.zeros(()))

    assert_consistent(loss, x0, modes=("compile",))


def assert_dynamic_compile_matches_eager(
    op: Callable[[torch.Tensor], torch.Tensor], inputs: list[torch.Tensor],
    backend: str = "aot_eager",
) -> None:
    """`op` under `torch.compile(dynamic=True, fullgraph=True)` gives eager's values and
    gradients on each input, the graph compiled for the first reused for the others."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(backend)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(op, dynamic=True, fullgraph=True, backend=counter)
        compiles = []
        for x in inputs:
            g = torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).to(x.dtype)
            y, gx = _grad(op, x, g)
            y_c, gx_c = _grad(compiled, x, g)
            assert torch.equal(y_c, y), (x, y_c, y)
            assert torch.equal(gx_c, gx), (x, gx_c, gx)
            compiles.append(counter.frame_count)
    finally:
        torch._dynamo.reset()
    assert compiles == compiles[:1] * len(inputs)  # no recompilation for a new shape


@pytest.mark.compile
@_TORCH_CTX_WARNING
@pytest.mark.parametrize(
    "op,low,high",
    [(sign_clip, -1.0, 1.0), (sign_clip_pair, -0.5, 1.0), (sign_clip_mask_sym, -1.0, 1.0),
     (sign_clip_mask, -0.5, 1.0)],
    ids=["clip", "pair", "mask", "pair-mask"],
)
def test_clip_compiles_with_dynamic_shapes_and_matches_eager(
    op: Any, low: float, high: float
) -> None:
    # Under dynamic shapes dynamo traces the bound as a symbolic float: the window must
    # still compile (it once failed rounding the bound at trace time) and be inclusive.
    at_bounds = [low, high, math.nextafter(low, -2.0), math.nextafter(high, 2.0)]
    inputs = [
        torch.tensor([*at_bounds, -2.0, 0.0, 0.75, 2.0]),
        torch.tensor([*at_bounds, -3.0, -0.25, 0.5, 0.9, 1.5, 3.0, -0.0]),
    ]
    assert_dynamic_compile_matches_eager(op, inputs)


@pytest.mark.parametrize("op", [sign_ste, sign_clip, sign_clip_mask_sym, step_tanh, step_dtanh])
def test_vmap_of_grad_matches_the_loop(op: Any) -> None:
    xs = torch.tensor([[-2.0, -1.0, 0.3, 1.0], [0.5, 1.5, -0.2, 0.0]])

    def f(x: torch.Tensor) -> torch.Tensor:
        return (op(x) * torch.arange(4.0)).sum()

    batched = vmap(func_grad(f))(xs)
    looped = torch.stack([func_grad(f)(x) for x in xs])
    torch.testing.assert_close(batched, looped)


# ---- errors -----------------------------------------------------------------------------------


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x)


@pytest.mark.parametrize(
    "options,error,message",
    [
        ({"clip": -1.0}, go.GradOverrideError,
         r"straight_through: `clip` must be a bound c >= 0 \(the window \[-c, c\]\) or a pair "
         r"\(low, high\); got -1\.0\. Pass a non-negative number"),
        ({"clip": (1.0, -1.0)}, go.GradOverrideError,
         r"`clip` as a pair must be \(low, high\) with low <= high; got \(1\.0, -1\.0\)\. "
         r"Swap the bounds"),
        ({"clip": "1"}, go.GradOverrideTypeError,
         r"`clip` must be a number c \(the window \[-c, c\]\) or a pair \(low, high\) of "
         r"numbers; got str '1'\."),
        ({"keep": "mask"}, go.GradOverrideError,
         r"straight_through got keep='mask' without `clip=`; .* Add `clip=` or drop `keep`\."),
        ({"clip": 1.0, "keep": "bytes"}, go.GradOverrideError,
         r"`keep` must be 'input' .* or 'mask' .*; got 'bytes'\."),
        ({"clip": 1.0, "keep": "mask", "surrogate": torch.tanh}, go.GradOverrideError,
         r"keep='mask' does not apply with a surrogate or derivative"),
        ({"surrogate": torch.tanh, "derivative": _sign}, go.GradOverrideError,
         r"straight_through got both `surrogate=` and `derivative=`; pass one"),
        ({"surrogate": 1.0}, go.GradOverrideTypeError,
         r"straight_through: `surrogate` must be a function of the input tensor, got float"),
    ],
)
def test_option_mistakes_are_errors_that_name_the_fix(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        go.straight_through(_sign, **options)


def test_forward_must_take_the_tensor_first() -> None:
    def keyword_only(*, x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    with pytest.raises(go.GradOverrideTypeError, match=r"the forward must take the tensor "
                       r"first, as a positional parameter; `.*keyword_only` has the signature"):
        go.straight_through(keyword_only)
    with pytest.raises(go.GradOverrideTypeError, match=r"needs a forward function to "
                       r"decorate, got int 3\."):
        go.straight_through(3)  # type: ignore[call-overload]


@given(st.sampled_from([1.0, (0.0, 2.0)]), st.sampled_from(["input", "mask"]))
def test_valid_options_build(clip: Any, keep: Any) -> None:
    op = go.straight_through(_sign, clip=clip, keep=keep)
    x = torch.tensor([1.0], requires_grad=True)
    op(x).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0]


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_clip_bound_rounded_to_the_dtype_alike_eager_and_inductor(dtype: torch.dtype) -> None:
    # 0.3 rounds up in float16 and bfloat16: an input equal to the rounded bound is inside
    # the window in eager mode and must be inside when compiled too.
    @go.straight_through(clip=0.3)
    def st(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    x = torch.tensor([0.3, -0.3, 0.5], dtype=dtype)
    assert_consistent(st, x, modes=("compile",), backend="inductor")


@pytest.mark.compile
@_TORCH_CTX_WARNING
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_clip_bound_rounded_to_the_dtype_under_dynamic_shapes_with_inductor() -> None:
    # Under dynamic shapes the bounds reach the graph as symbolic floats, and Inductor
    # computes float16 in float32: -0.7 and 0.3 must still be rounded as eager rounds them.
    @go.straight_through(clip=(-0.7, 0.3))
    def st(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    edges = [0.3, -0.7, 0.2998, -0.6997, 0.3003, -0.7007, 0.0]
    inputs = [torch.tensor(edges, dtype=torch.float16),
              torch.tensor([*edges, 1.0, -1.0, 0.25], dtype=torch.float16)]
    assert_dynamic_compile_matches_eager(st, inputs, backend="inductor")
